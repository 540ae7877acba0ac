/* The MoE block on ref against the independent goldens of golden/gen_moe.py (the block written
 * densely in JAX, f64, jax.grad): out, aux, dx and every weight gradient, for each activation,
 * both weightings, k = 1 and k = E, softmax pre/post, sigmoid with expert bias, group-limited
 * top-k, idle experts, padded slabs, biases on and off, and the bf16 recipe.
 *
 * Bound (include/twin/tw_moe.h, "Error budget"): F32 within K u (|exact| + rms(exact)), u =
 * 2^-24, K = H + 2F + k + 16 forward (the GEMM sums over H, 2F via F, the k-term combine and
 * the elementwise roundings) and K + E + T for gradients (the d_logits @ gate^T sum over E and
 * the weight-gradient sums over T tokens); BF16 within 8 * 2^-8 (|exact| + rms) forward and
 * 16 * 2^-8 for gradients; FP8_* that plus 8 * 2^-4 forward, 16 * 2^-4 gradients (e4m3's
 * unit roundoff per quantization on the path). Each case logs its worst |diff|/bound. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/moe_cases.h"
#include "test_util.h"

static void one_rank(const char *dir, const char *name) {
  gcase c;
  moe_load_case(dir, &c);
  double w = moe_check_case(&c, name, NULL, NULL);
  cr_log_info("moe golden %s: worst |diff|/bound %.3g", name, w);
  moe_free_case(&c);
}

Test(moe_golden, every_stored_case_on_one_rank) { cr_assert_geq(moe_each_case(one_rank), 18); }

/* The same goldens with the block sharded over thread ranks: every mesh of dp, fsdp and ep
 * up to 8 ranks that divides the case (T % ranks, E % ep, H % fsdp). */
static void sharded(const char *dir, const char *name) {
  gcase c;
  moe_load_case(dir, &c);
  static const int meshes[][3] = {{1, 1, 2}, {2, 1, 1}, {1, 1, 4}, {2, 1, 2}, {4, 1, 1}, {1, 1, 8}, {2, 1, 4},
                                  {4, 1, 2}, {1, 2, 1}, {1, 2, 2}, {2, 2, 1}, {1, 4, 1}, {1, 2, 4}, {2, 2, 2},
                                  {1, 4, 2}, {1, 8, 1}};
  int ran = 0;
  for (size_t i = 0; i < sizeof meshes / sizeof *meshes; i++) {
    int dp = meshes[i][0], fs = meshes[i][1], ep = meshes[i][2];
    if (c.T % (dp * fs * ep) != 0 || c.E % ep != 0 || c.H % fs != 0) continue;
    tw_mesh m;
    tw_axis ax[3] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_EP};
    int sz[3] = {dp, fs, ep};
    cr_assert_eq(tw_mesh_init(&m, 3, ax, sz), TW_OK);
    char cname[300];
    snprintf(cname, sizeof cname, "%s dp=%d,fsdp=%d,ep=%d", name, dp, fs, ep);
    double w = moe_check_case(&c, cname, &m, NULL);
    cr_log_info("moe golden %s: worst |diff|/bound %.3g", cname, w);
    ran++;
  }
  cr_log_info("moe golden %s: %d meshes", name, ran);
  moe_free_case(&c);
}

Test(moe_golden, every_stored_case_sharded_over_dp_fsdp_and_ep) { cr_assert_geq(moe_each_case(sharded), 18); }

/* The goldens are not vacuous: the block with the other weighting, without its biases, or
 * with another activation is far outside the bound. */
Test(moe_golden, a_wrong_block_is_caught) {
  char dir[1200];
  snprintf(dir, sizeof dir, "%s/moe/swiglu_early", tt_golden_root());
  gcase c;
  moe_load_case(dir, &c);
  moe_g_fail = 0;
  c.run.cfg.weighting = TW_MOE_WEIGHT_LATE;
  double w1 = moe_check_case(&c, "late instead of early", NULL, NULL);
  c.run.cfg.weighting = TW_MOE_WEIGHT_EARLY;
  c.run.cfg.act = TW_MOE_GEGLU;
  double w2 = moe_check_case(&c, "geglu instead of swiglu", NULL, NULL);
  c.run.cfg.act = TW_MOE_SWIGLU;
  c.run.d_aux = 0;
  double w3 = moe_check_case(&c, "aux loss left out of the backward", NULL, NULL);
  c.run.d_aux = 1;
  double w4 = moe_check_case(&c, "the right block", NULL, NULL);
  moe_g_fail = 1;
  cr_assert_gt(w1, 100, "the wrong weighting went unnoticed (%g)", w1);
  cr_assert_gt(w2, 100, "the wrong activation went unnoticed (%g)", w2);
  cr_assert_gt(w3, 10, "a backward without the aux loss went unnoticed (%g)", w3);
  cr_assert_leq(w4, 1, "the right block is outside the bound (%g)", w4);
  moe_free_case(&c);
}

/* The fp8 recipes really quantize (judged by the bf16 budget they are far outside it), a
 * wrong fp8 block is caught, and the right one is inside its budget. The fp8 budget is loose
 * per element (8 e4m3 roundings: about half of |exact| + rms), so the planted faults are ones
 * that move outputs by their own size: router weights scaled by 3, and the other weighting
 * (fp8_block_late has k = 2, so its weights are not 1). Swapping SwiGLU for GeGLU moves these
 * outputs by about 5% in norm, inside e4m3's noise: the f32 and bf16 goldens catch that. */
Test(moe_golden, the_fp8_recipes_quantize_and_a_wrong_fp8_block_is_caught) {
  static const char *cases[] = {"fp8_current_late", "fp8_block_late", "fp8_mxfp8_late"};
  for (int i = 0; i < 3; i++) {
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/moe/%s", tt_golden_root(), cases[i]);
    gcase c;
    moe_load_case(dir, &c);
    moe_g_fail = 0;
    moe_g_budget_recipe = TW_MOE_BF16;
    double as_bf16 = moe_check_case(&c, "fp8 judged by the bf16 budget", NULL, NULL);
    moe_g_budget_recipe = -1;
    float sf = c.run.cfg.router.scaling_factor;
    c.run.cfg.router.scaling_factor = 3 * sf;
    double scaled = moe_check_case(&c, "router weights times 3", NULL, NULL);
    c.run.cfg.router.scaling_factor = sf;
    c.run.cfg.weighting = TW_MOE_WEIGHT_EARLY;
    double early = moe_check_case(&c, "early instead of late", NULL, NULL);
    c.run.cfg.weighting = TW_MOE_WEIGHT_LATE;
    double right = moe_check_case(&c, "the right block", NULL, NULL);
    moe_g_fail = 1;
    cr_log_info("%s: %.3g of the bf16 budget; weights x3 %.3g, early %.3g, right %.3g of its own", cases[i], as_bf16,
                scaled, early, right);
    cr_assert_gt(as_bf16, 1, "%s: within the bf16 budget (%g): did the GEMMs run in fp8?", cases[i], as_bf16);
    cr_assert_gt(scaled, 2, "%s: router weights times 3 went unnoticed (%g)", cases[i], scaled);
    if (i == 1) cr_assert_gt(early, 2, "%s: the wrong weighting went unnoticed (%g)", cases[i], early);
    cr_assert_leq(right, 1, "%s: the right block is outside the bound (%g)", cases[i], right);
    moe_free_case(&c);
  }
}
