/* The MoE block's contract beyond the goldens: every bad input is refused with a message that
 * names it; two layers interleaved give each layer's own results bit for bit; the backward
 * agrees with central finite differences of the forward; the saved bytes are as the header
 * states. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/threads.h"
#include "test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

enum { T = 8, H = 6, F = 4, E = 4, K = 2 };

static tw_moe_config base_cfg(void) {
  tw_moe_config c = TW_MOE_CONFIG_INIT;
  c.num_experts = E; c.hidden = H; c.ffn = F; c.router.topk = K;
  c.max_tokens = T; c.global_tokens = T; c.aux_coeff = 0.01f;
  return c;
}

typedef struct {
  float x[T * H], gate[H * E], wi[E * H * 2 * F], wo[E * F * H], bi[E * 2 * F], bo[E * H], d_out[T * H];
} problem;

static void fill(problem *p, uint64_t seed) {
  tt_fill_uniform_f32(p->x, T * H, seed, -1, 1);
  tt_fill_uniform_f32(p->gate, H * E, seed + 1, -0.8f, 0.8f);
  tt_fill_uniform_f32(p->wi, E * H * 2 * F, seed + 2, -0.4f, 0.4f);
  tt_fill_uniform_f32(p->wo, E * F * H, seed + 3, -0.5f, 0.5f);
  tt_fill_uniform_f32(p->bi, E * 2 * F, seed + 4, -0.2f, 0.2f);
  tt_fill_uniform_f32(p->bo, E * H, seed + 5, -0.2f, 0.2f);
  tt_fill_uniform_f32(p->d_out, T * H, seed + 6, -1, 1);
}

/* ---- errors ------------------------------------------------------------------------------ */
typedef struct {
  tw_comm *comm;
  tw_ctx *ctx;
} one_rank;

static one_rank open_rank(void) {
  one_rank r;
  cr_assert_eq(tw_comm_init_threads(1, &r.comm), TW_OK);
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = r.comm;
  cr_assert_eq(tw_ctx_create(&r.ctx, &cc), TW_OK);
  return r;
}
static void close_rank(one_rank r) {
  tw_ctx_destroy(r.ctx);
  tw_comm_destroy(r.comm);
}

static void expect_create(tw_moe_config c, const tw_mesh *mesh, tw_status want, const char *substr) {
  one_rank r = open_rank();
  tw_moe *m = NULL;
  tt_expect_status(tw_moe_create(r.ctx, mesh, &c, &m), want, substr);
  cr_expect_null(m);
  close_rank(r);
}

Test(moe_errors, config_values_are_named) {
  tw_moe_config c = base_cfg();
  c.num_experts = 0;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "E = 0");
  c = base_cfg(); c.router.topk = 5;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "topk = 5 must be in [1, E = 4]");
  c = base_cfg(); c.act = (tw_moe_act)7;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "unknown activation 7");
  c = base_cfg(); c.weighting = (tw_moe_weighting)3;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "unknown weighting 3");
  c = base_cfg(); c.recipe = (tw_moe_recipe)9;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "unknown recipe 9");
  c = base_cfg(); c.aux_coeff = -1;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "aux_coeff = -1");
  c = base_cfg(); c.global_tokens = 0;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "global_tokens = 0");
  c = base_cfg(); c.ffn = (int64_t)1 << 60; /* E H 2F and the activations would leave size_t */
  expect_create(c, NULL, TW_ERR_SHAPE, "F = 1152921504606846976, k = 2");
  c = base_cfg(); c.max_tokens = (int64_t)1 << 55;
  expect_create(c, NULL, TW_ERR_SHAPE, "max_tokens = 36028797018963968: the sizes they give are too large");
  c = base_cfg(); c.recipe = TW_MOE_BF16; c.fp8_gather = 1;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "fp8_gather = 1 needs an fp8 recipe (fp8_current, fp8_block or fp8_mxfp8; got bf16)");
  c = base_cfg(); c.fp8_gather = 1; /* f32 */
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "fp8_gather = 1 needs an fp8 recipe (fp8_current, fp8_block or fp8_mxfp8; got f32)");
  c = base_cfg(); c.fp8_gather = 2;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "fp8_gather = 2 must be 0 or 1");
  c = base_cfg(); c.size = 8;
  expect_create(c, NULL, TW_ERR_INVALID_ARG, "TW_MOE_CONFIG_INIT");
}

Test(moe_errors, meshes_outside_dp_fsdp_and_ep_are_refused) {
  tw_mesh m;
  tw_axis tp = TW_AXIS_TP, pp = TW_AXIS_PP, ep = TW_AXIS_EP;
  int one = 1, two = 2;
  cr_assert_eq(tw_mesh_init(&m, 1, &tp, &one), TW_OK);
  expect_create(base_cfg(), &m, TW_ERR_UNSUPPORTED, "has axis tp");
  cr_assert_eq(tw_mesh_init(&m, 1, &pp, &one), TW_OK);
  expect_create(base_cfg(), &m, TW_ERR_UNSUPPORTED, "has axis pp");
  cr_assert_eq(tw_mesh_init(&m, 1, &ep, &two), TW_OK);
  expect_create(base_cfg(), &m, TW_ERR_INVALID_ARG, "has 2 ranks but the communicator has 1");
  /* no communicator at all */
  tw_moe_config c = base_cfg();
  tw_moe *mo = NULL;
  tt_expect_status(tw_moe_create(tt_ref_ctx(), NULL, &c, &mo), TW_ERR_INVALID_ARG, "the context has no communicator");
}

static tw_status experts_not_divisible(int rank, tw_comm *comm, void *arg) {
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_moe_config c = base_cfg();
  c.num_experts = 3; c.global_tokens = 2 * T;
  tw_moe *m = NULL;
  tw_status s = tw_moe_create(ctx, NULL, &c, &m);
  tw_moe_destroy(m);
  tw_ctx_destroy(ctx);
  return s;
}

Test(moe_errors, experts_must_divide_over_ep) {
  tw_comm *comms[2];
  cr_assert_eq(tw_comm_init_threads(2, comms), TW_OK);
  tt_expect_status(tw_run_ranks(2, comms, experts_not_divisible, NULL), TW_ERR_INVALID_ARG, "3");
  for (int i = 0; i < 2; i++) tw_comm_destroy(comms[i]);
}

static tw_status hidden_not_divisible(int rank, tw_comm *comm, void *arg) {
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_moe_config c = base_cfg();
  c.global_tokens = 4 * T;
  tw_mesh m;
  tw_axis fsdp = TW_AXIS_FSDP;
  int four = 4;
  tw_status s = tw_mesh_init(&m, 1, &fsdp, &four);
  tw_moe *mo = NULL;
  if (s == TW_OK) s = tw_moe_create(ctx, &m, &c, &mo);
  tw_moe_destroy(mo);
  tw_ctx_destroy(ctx);
  return s;
}

Test(moe_errors, hidden_must_divide_over_fsdp) {
  tw_comm *comms[4];
  cr_assert_eq(tw_comm_init_threads(4, comms), TW_OK);
  tt_expect_status(tw_run_ranks(4, comms, hidden_not_divisible, NULL), TW_ERR_INVALID_ARG,
                   "H = 6 does not split over fsdp = 4");
  for (int i = 0; i < 4; i++) tw_comm_destroy(comms[i]);
}

/* fp8_gather with block scales: H / fsdp must be a multiple of 128 (tw_moe.h, Sharding). */
typedef struct {
  tw_moe_recipe recipe;
  int64_t H;
  int fsdp;
} gather_rule;

static tw_status create_gather(int rank, tw_comm *comm, void *arg) {
  const gather_rule *g = (const gather_rule *)arg;
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_moe_config c = base_cfg();
  c.recipe = g->recipe; c.hidden = g->H; c.fp8_gather = 1; c.global_tokens = g->fsdp * T;
  tw_mesh m;
  tw_axis fsdp = TW_AXIS_FSDP;
  tw_status s = tw_mesh_init(&m, 1, &fsdp, &g->fsdp);
  tw_moe *mo = NULL;
  if (s == TW_OK) s = tw_moe_create(ctx, &m, &c, &mo);
  tw_moe_destroy(mo);
  tw_ctx_destroy(ctx);
  return s;
}

static void expect_gather(tw_moe_recipe recipe, int64_t H, int fsdp, tw_status want, const char *substr) {
  tw_comm *comms[4];
  cr_assert_eq(tw_comm_init_threads(fsdp, comms), TW_OK);
  gather_rule g = {recipe, H, fsdp};
  tw_status s = tw_run_ranks(fsdp, comms, create_gather, &g);
  if (want == TW_OK) cr_expect_eq(s, TW_OK, "%s H = %lld fsdp = %d: %s", tw_moe_recipe_name(recipe), (long long)H, fsdp, tw_last_error());
  else tt_expect_status(s, want, substr);
  for (int i = 0; i < fsdp; i++) tw_comm_destroy(comms[i]);
}

Test(moe_errors, fp8_gather_with_block_scales_needs_whole_blocks_per_shard) {
  expect_gather(TW_MOE_FP8_BLOCK, 256, 4, TW_ERR_INVALID_ARG,
                "fp8_gather = 1 with recipe fp8_block needs H / fsdp a multiple of 128, got H = 256, fsdp = 4, H / fsdp = 64 "
                "(moe.fp8_gather: the weights' 128x128 scale tiles must not cross the fsdp shard boundary)");
  /* MXFP8: blocks of 32 would fit (96 = 3 x 32), the 128x4 tiles of the swizzled scales not */
  expect_gather(TW_MOE_FP8_MXFP8, 192, 2, TW_ERR_INVALID_ARG,
                "fp8_gather = 1 with recipe fp8_mxfp8 needs H / fsdp a multiple of 128, got H = 192, fsdp = 2, H / fsdp = 96 "
                "(moe.fp8_gather: the weights' MXFP8 blocks of 32 and the 128x4 tiles of their swizzled scales must not cross");
  expect_gather(TW_MOE_FP8_BLOCK, 6, 2, TW_ERR_INVALID_ARG, "H = 6, fsdp = 2, H / fsdp = 3");
  /* accepted: whole tiles per shard; tensor scaling has no such rule; fsdp = 1 ignores it */
  expect_gather(TW_MOE_FP8_BLOCK, 256, 2, TW_OK, NULL);
  expect_gather(TW_MOE_FP8_MXFP8, 512, 4, TW_OK, NULL);
  expect_gather(TW_MOE_FP8_CURRENT, 6, 2, TW_OK, NULL);
  expect_gather(TW_MOE_FP8_MXFP8, 6, 1, TW_OK, NULL);
}

/* fsdp > 1 keeps the gathered bf16 weights for the backward; with fp8_gather it does not (the
 * fp8 copies, saved either way, are the gathered weights): tw_moe.h's saved bytes. */
static tw_status saved_with_and_without_gather(int rank, tw_comm *comm, void *arg) {
  const gather_rule *g = (const gather_rule *)arg;
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_mesh m;
  tw_axis fsdp = TW_AXIS_FSDP;
  tw_status s = tw_mesh_init(&m, 1, &fsdp, &g->fsdp);
  size_t saved[2] = {0, 0};
  for (int q = 0; s == TW_OK && q < 2; q++) {
    tw_moe_config c = base_cfg();
    c.recipe = g->recipe; c.hidden = g->H; c.fp8_gather = q; c.global_tokens = g->fsdp * T;
    tw_moe *mo = NULL;
    s = tw_moe_create(ctx, &m, &c, &mo);
    saved[q] = tw_moe_saved_bytes(mo);
    tw_moe_destroy(mo);
  }
  size_t gathered = 2 * (size_t)E * (size_t)g->H * 3 * F; /* bf16 wi [E, H, 2F] + wo [E, F, H] */
  if (s == TW_OK && saved[0] - saved[1] != gathered)
    s = tw_error(TW_ERR_INTERNAL, "%s: saved %zu bytes without fp8_gather, %zu with: the difference should be %zu",
                 tw_moe_recipe_name(g->recipe), saved[0], saved[1], gathered);
  tw_ctx_destroy(ctx);
  return s;
}

Test(moe_layers, fp8_gather_keeps_no_bf16_copy_of_the_gathered_weights) {
  for (int rc = TW_MOE_FP8_CURRENT; rc <= TW_MOE_FP8_MXFP8; rc++) {
    tw_comm *comms[2];
    cr_assert_eq(tw_comm_init_threads(2, comms), TW_OK);
    gather_rule g = {(tw_moe_recipe)rc, 256, 2};
    tw_status s = tw_run_ranks(2, comms, saved_with_and_without_gather, &g);
    cr_expect_eq(s, TW_OK, "%s", tw_last_error());
    for (int i = 0; i < 2; i++) tw_comm_destroy(comms[i]);
  }
}

Test(moe_errors, tensors_biases_and_order_are_checked) {
  static problem p;
  fill(&p, 1);
  one_rank r = open_rank();
  tw_moe_config c = base_cfg();
  tw_moe *m;
  cr_assert_eq(tw_moe_create(r.ctx, NULL, &c, &m), TW_OK, "%s", tw_last_error());
  float out[T * H], dx[T * H], g_gate[H * E], g_wi[E * H * 2 * F], g_wo[E * F * H], aux;
  tw_moe_weights w;
  w.gate = tw_tensor_2d(p.gate, TW_F32, H, E, TW_MEM_HOST);
  w.wi = tw_tensor_3d(p.wi, TW_F32, E, H, 2 * F, TW_MEM_HOST);
  w.wo = tw_tensor_3d(p.wo, TW_F32, E, F, H, TW_MEM_HOST);
  w.bi = tw_tensor_none();
  w.bo = tw_tensor_none();
  tw_moe_grads g = {tw_tensor_2d(g_gate, TW_F32, H, E, TW_MEM_HOST), tw_tensor_3d(g_wi, TW_F32, E, H, 2 * F, TW_MEM_HOST),
                    tw_tensor_3d(g_wo, TW_F32, E, F, H, TW_MEM_HOST), tw_tensor_none(), tw_tensor_none()};
  tw_tensor x = tw_tensor_2d(p.x, TW_F32, T, H, TW_MEM_HOST), o = tw_tensor_2d(out, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor d = tw_tensor_2d(p.d_out, TW_F32, T, H, TW_MEM_HOST), tdx = tw_tensor_2d(dx, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor ta = tw_tensor_1d(&aux, TW_F32, 1, TW_MEM_HOST);
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &g), TW_ERR_INVALID_ARG, "no successful forward");
  tw_moe_weights bad = w;
  bad.wi = tw_tensor_3d(p.wi, TW_F32, E, 2 * F, H, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &x, &bad, &o, &ta), TW_ERR_SHAPE, "wi is [4, 8, 6] f32, expected [4, 6, 8]");
  bad = w;
  bad.gate.dtype = TW_BF16;
  tt_expect_status(tw_moe_forward(m, &x, &bad, &o, &ta), TW_ERR_DTYPE, "gate is bf16, expected f32");
  bad = w;
  bad.bi = tw_tensor_2d(p.bi, TW_F32, E, 2 * F, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &x, &bad, &o, &ta), TW_ERR_INVALID_ARG, "bi is given but bo is missing");
  bad = w;
  bad.bo = tw_tensor_2d(p.bo, TW_F32, E, H, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &x, &bad, &o, &ta), TW_ERR_INVALID_ARG, "bo is given but bi is missing");
  tw_tensor big = tw_tensor_2d(p.x, TW_F32, T + 1, H, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &big, &w, &o, &ta), TW_ERR_INVALID_ARG, "x has 9 tokens, above max_tokens = 8");
  tw_tensor oshort = tw_tensor_2d(out, TW_F32, T - 1, H, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &x, &w, &oshort, &ta), TW_ERR_SHAPE, "out is [7, 6] f32, expected [8, 6]");
  tw_tensor small = tw_tensor_2d(p.x, TW_F32, T - 1, H, TW_MEM_HOST), os = tw_tensor_2d(out, TW_F32, T - 1, H, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &small, &w, &os, &ta), TW_ERR_INVALID_ARG, "global_tokens = 8 must equal T = 7");
  tw_tensor xb = tw_tensor_2d(p.x, TW_F32, T, H + 1, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &xb, &w, &o, &ta), TW_ERR_SHAPE, "x is");
  /* a good forward, then a backward with a wrong gradient buffer, then a good one */
  cr_assert_eq(tw_moe_forward(m, &x, &w, &o, &ta), TW_OK, "%s", tw_last_error());
  tw_moe_grads gb = g;
  gb.wo = tw_tensor_3d(g_wo, TW_F32, E, H, F, TW_MEM_HOST);
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &gb), TW_ERR_SHAPE, "grads.wo");
  /* bf16 weight gradients: both or neither, and only where the weights are bf16 */
  gb = g;
  gb.wi.dtype = gb.wo.dtype = TW_BF16;
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &gb), TW_ERR_DTYPE,
                   "bf16 grads.wi and grads.wo need a recipe with bf16 weights (this one is f32)");
  gb = g;
  gb.wo.dtype = TW_BF16;
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &gb), TW_ERR_DTYPE,
                   "grads.wi is f32 but grads.wo is bf16: give both in the same dtype");
  gb = g;
  gb.wi.dtype = gb.wo.dtype = TW_F16;
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &gb), TW_ERR_DTYPE, "grads.wi is f16, expected f32 or bf16");
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, NAN, &tdx, &g), TW_ERR_INVALID_ARG, "d_aux = nan");
  cr_assert_eq(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &g), TW_OK, "%s", tw_last_error());
  /* a failed forward clears the state: no backward of a stale forward */
  tt_expect_status(tw_moe_forward(m, &x, &bad, &o, &ta), TW_ERR_INVALID_ARG, "bo is given");
  tt_expect_status(tw_moe_backward(m, &x, &w, &d, 1, &tdx, &g), TW_ERR_INVALID_ARG, "no successful forward");
  tw_moe_destroy(m);
  close_rank(r);
}

/* A router error surfaces with the step named. */
Test(moe_errors, a_failing_step_is_named) {
  static problem p;
  fill(&p, 2);
  p.x[3] = NAN; /* a NaN logit */
  one_rank r = open_rank();
  tw_moe_config c = base_cfg();
  tw_moe *m;
  cr_assert_eq(tw_moe_create(r.ctx, NULL, &c, &m), TW_OK);
  float out[T * H];
  tw_moe_weights w = {tw_tensor_2d(p.gate, TW_F32, H, E, TW_MEM_HOST), tw_tensor_3d(p.wi, TW_F32, E, H, 2 * F, TW_MEM_HOST),
                      tw_tensor_3d(p.wo, TW_F32, E, F, H, TW_MEM_HOST), tw_tensor_none(), tw_tensor_none()};
  tw_tensor x = tw_tensor_2d(p.x, TW_F32, T, H, TW_MEM_HOST), o = tw_tensor_2d(out, TW_F32, T, H, TW_MEM_HOST);
  tt_expect_status(tw_moe_forward(m, &x, &w, &o, NULL), TW_ERR_INVALID_ARG, "moe_forward (router)");
  tw_moe_destroy(m);
  close_rank(r);
}

/* ---- layers, saved bytes -------------------------------------------------------------------- */
static void run(problem *p, tw_moe_config c, int layers, int bias, float *out, float *dx, float *dwi) {
  tw_moe_threads_run r;
  memset(&r, 0, sizeof r);
  r.cfg = c;
  r.T = T;
  r.x = p->x; r.gate = p->gate; r.wi = p->wi; r.wo = p->wo; r.d_out = p->d_out;
  if (bias) { r.bi = p->bi; r.bo = p->bo; }
  r.d_aux = 1;
  r.layers = layers;
  r.out = out; r.dx = dx; r.dwi = dwi;
  cr_assert_eq(tw_moe_run_threads(&r), TW_OK, "%s", tw_last_error());
}

Test(moe_layers, two_interleaved_layers_equal_each_alone) {
  static problem p;
  fill(&p, 3);
  for (int early = 0; early < 2; early++) {
    tw_moe_config c = base_cfg();
    c.weighting = early ? TW_MOE_WEIGHT_EARLY : TW_MOE_WEIGHT_LATE;
    float a[3][T * H], b[3][T * H], wa[E * H * 2 * F], wb[E * H * 2 * F];
    run(&p, c, 1, 1, a[0], a[1], wa);
    run(&p, c, 2, 1, b[0], b[1], wb);
    cr_assert(memcmp(a[0], b[0], sizeof a[0]) == 0, "out differs when another layer runs in between");
    cr_assert(memcmp(a[1], b[1], sizeof a[1]) == 0, "dx differs when another layer runs in between");
    cr_assert(memcmp(wa, wb, sizeof wa) == 0, "dwi differs when another layer runs in between");
  }
}

Test(moe_layers, saved_bytes_are_the_headers_sum) {
  one_rank r = open_rank();
  for (int late = 0; late < 2; late++) {
    tw_moe_config c = base_cfg();
    c.weighting = late ? TW_MOE_WEIGHT_LATE : TW_MOE_WEIGHT_EARLY;
    tw_moe *m;
    cr_assert_eq(tw_moe_create(r.ctx, NULL, &c, &m), TW_OK);
    tw_ep_config ec = TW_EP_CONFIG_INIT;
    ec.num_experts = E; ec.topk = K; ec.max_tokens = T; ec.hidden = H; ec.token_dtype = TW_F32;
    int64_t R = tw_ep_capacity_no_drop(&ec, 1);
    ec.recv_capacity = R;
    size_t ws, layer;
    cr_assert_eq(tw_ep_workspace_bytes(&ec, 1, &ws, &layer), TW_OK);
    size_t want = 4 * T * E + 8 * T * K + 4 * E + layer + 4 * (size_t)R * H + 4 * (size_t)R + 4 * E +
                  4 * (size_t)R * 2 * F + (late ? 4 * (size_t)R * H : 0);
    cr_expect_eq(tw_moe_saved_bytes(m), want, "saved %zu bytes, header says %zu", tw_moe_saved_bytes(m), want);
    tw_moe_destroy(m);
  }
  close_rank(r);
}

/* FP8_*: recv is kept as its colwise fp8 copy (data + scales) instead of bf16, a's colwise fp8
 * copy (for d_wo) and the fp8 copies of wi and wo (both orientations) join the saved state. */
static size_t q_bytes(tw_scaling mode, int64_t M, int64_t K, int64_t G, int row, int col) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.layout = TW_ROWWISE_COLWISE;
  /* the activations' colwise copies (row = 0: wgrad operands) are token-padded, MXFP8 aside */
  o.col_padded = !row && mode != TW_SCALE_MXFP8_1D;
  tw_qtensor q;
  cr_assert_eq(tw_quantize_output_shapes(&o, M, K, G, &q), TW_OK, "%s", tw_last_error());
  size_t b = 0;
  if (row) b += tw_tensor_bytes(&q.row_data) + (tw_tensor_is_none(&q.row_scale_inv) ? 0 : tw_tensor_bytes(&q.row_scale_inv));
  if (col) b += tw_tensor_bytes(&q.col_data) + (tw_tensor_is_none(&q.col_scale_inv) ? 0 : tw_tensor_bytes(&q.col_scale_inv));
  if (!tw_tensor_is_none(&q.amax)) b += tw_tensor_bytes(&q.amax);
  return b;
}

Test(moe_layers, fp8_saved_bytes_are_the_headers_sum) {
  one_rank r = open_rank();
  const tw_moe_recipe recipes[3] = {TW_MOE_FP8_CURRENT, TW_MOE_FP8_BLOCK, TW_MOE_FP8_MXFP8};
  const tw_scaling act[3] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_1x128, TW_SCALE_MXFP8_1D};
  const tw_scaling wts[3] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_128x128, TW_SCALE_MXFP8_1D};
  for (int i = 0; i < 3; i++) {
    tw_moe_config c = base_cfg();
    c.recipe = recipes[i];
    tw_moe *m;
    cr_assert_eq(tw_moe_create(r.ctx, NULL, &c, &m), TW_OK, "%s", tw_last_error());
    tw_ep_config ec = TW_EP_CONFIG_INIT;
    ec.num_experts = E; ec.topk = K; ec.max_tokens = T; ec.hidden = H; ec.token_dtype = TW_BF16;
    int64_t R = tw_ep_capacity_no_drop(&ec, 1);
    ec.recv_capacity = R;
    size_t ws, layer;
    cr_assert_eq(tw_ep_workspace_bytes(&ec, 1, &ws, &layer), TW_OK);
    size_t want = 4 * T * E + 8 * T * K + 4 * E + layer + 4 * (size_t)R + 4 * E + 4 * (size_t)R * 2 * F +
                  2 * (size_t)R * H /* eo, late */ + q_bytes(act[i], R, H, E, 0, 1) + q_bytes(act[i], R, F, E, 0, 1) +
                  q_bytes(wts[i], E * H, 2 * F, E, 1, 1) + q_bytes(wts[i], E * F, H, E, 1, 1);
    cr_expect_eq(tw_moe_saved_bytes(m), want, "%s: saved %zu bytes, header says %zu", tw_moe_recipe_name(c.recipe),
                 tw_moe_saved_bytes(m), want);
    tw_moe_destroy(m);
  }
  close_rank(r);
}

Test(moe_layers, two_interleaved_fp8_layers_equal_each_alone) {
  static problem p;
  fill(&p, 5);
  for (int rc = TW_MOE_FP8_CURRENT; rc <= TW_MOE_FP8_MXFP8; rc++) {
    tw_moe_config c = base_cfg();
    c.recipe = (tw_moe_recipe)rc;
    float a[3][T * H], b[3][T * H], wa[E * H * 2 * F], wb[E * H * 2 * F];
    run(&p, c, 1, 1, a[0], a[1], wa);
    run(&p, c, 2, 1, b[0], b[1], wb);
    cr_assert(memcmp(a[0], b[0], sizeof a[0]) == 0, "%s: out differs when another layer runs in between", tw_moe_recipe_name(c.recipe));
    cr_assert(memcmp(a[1], b[1], sizeof a[1]) == 0, "%s: dx differs when another layer runs in between", tw_moe_recipe_name(c.recipe));
    cr_assert(memcmp(wa, wb, sizeof wa) == 0, "%s: dwi differs when another layer runs in between", tw_moe_recipe_name(c.recipe));
  }
}

/* fp8_gather (quantize before the fsdp all-gather) gives the very bits of quantizing the
 * gathered weights, on fsdp = 2 and on fsdp = 2 x ep = 2. */
static void run_mesh(problem *p, tw_moe_config c, int fsdp, int ep, float *out, float *dx, float *dwi, float *dwo) {
  tw_moe_threads_run r;
  memset(&r, 0, sizeof r);
  r.cfg = c;
  r.cfg.global_tokens = T;
  r.T = T;
  tw_axis ax[2] = {TW_AXIS_FSDP, TW_AXIS_EP};
  int sz[2] = {fsdp, ep};
  cr_assert_eq(tw_mesh_init(&r.mesh, ep > 1 ? 2 : 1, ax, sz), TW_OK);
  r.x = p->x; r.gate = p->gate; r.wi = p->wi; r.wo = p->wo; r.d_out = p->d_out; r.bi = p->bi; r.bo = p->bo;
  r.d_aux = 1; r.layers = 1;
  r.out = out; r.dx = dx; r.dwi = dwi; r.dwo = dwo;
  cr_assert_eq(tw_moe_run_threads(&r), TW_OK, "%s", tw_last_error());
}

Test(moe_layers, fp8_gather_equals_quantizing_the_gathered_weights) {
  static problem p;
  fill(&p, 6);
  for (int ep = 1; ep <= 2; ep++) {
    tw_moe_config c = base_cfg();
    c.recipe = TW_MOE_FP8_CURRENT;
    static float o[2][T * H], dx[2][T * H], dwi[2][E * H * 2 * F], dwo[2][E * F * H];
    for (int q = 0; q < 2; q++) {
      c.fp8_gather = q;
      run_mesh(&p, c, 2, ep, o[q], dx[q], dwi[q], dwo[q]);
    }
    cr_assert(memcmp(o[0], o[1], sizeof o[0]) == 0, "ep=%d: out differs with fp8_gather", ep);
    cr_assert(memcmp(dx[0], dx[1], sizeof dx[0]) == 0, "ep=%d: dx differs with fp8_gather", ep);
    cr_assert(memcmp(dwi[0], dwi[1], sizeof dwi[0]) == 0, "ep=%d: dwi differs with fp8_gather", ep);
    cr_assert(memcmp(dwo[0], dwo[1], sizeof dwo[0]) == 0, "ep=%d: dwo differs with fp8_gather", ep);
  }
}

/* The same for every fp8 recipe on blocks whose shards hold whole scale tiles (H / fsdp a
 * multiple of 128): fsdp = 2 and 4, fsdp x ep = 2 x 2 and dp x fsdp = 2 x 2, F = 40 (partial
 * MXFP8 and 128-wide blocks along 2F and F) and F = 136 (two 128-row tiles of F). The weights
 * have a magnitude per 32 x 32 patch (1/8 to 1), so a scale put in another tile's place changes
 * the codes and the results. */
typedef struct {
  int64_t T, H, F, E;
  float *x, *gate, *wi, *wo, *bi, *bo, *d_out;
} gproblem;

static gproblem gproblem_make(int64_t F, uint64_t seed) {
  gproblem p = {16, 512, F, 4, 0, 0, 0, 0, 0, 0, 0};
  int64_t H = p.H, E = p.E, T = p.T;
  float **b[7] = {&p.x, &p.gate, &p.wi, &p.wo, &p.bi, &p.bo, &p.d_out};
  int64_t n[7] = {T * H, H * E, E * H * 2 * F, E * F * H, E * 2 * F, E * H, T * H};
  float hi[7] = {1, 0.1f, 0.1f, 0.12f, 0.2f, 0.2f, 1};
  for (int i = 0; i < 7; i++) {
    *b[i] = (float *)malloc(sizeof(float) * (size_t)n[i]);
    tt_fill_uniform_f32(*b[i], n[i], seed + (uint64_t)i, -hi[i], hi[i]);
  }
  for (int64_t e = 0; e < E; e++)
    for (int64_t h = 0; h < H; h++) {
      for (int64_t j = 0; j < 2 * F; j++) p.wi[(e * H + h) * 2 * F + j] *= (float)(1 + (h / 32 + 3 * (j / 32) + e) % 8) / 8;
      for (int64_t f = 0; f < F; f++) p.wo[(e * F + f) * H + h] *= (float)(1 + (5 * (h / 32) + f / 32 + e) % 8) / 8;
    }
  return p;
}
/* Two sets of the six outputs (out, dx, dwi, dwo, dbi, dbo: output_names) and their sizes. */
static const char *const output_names[6] = {"out", "dx", "dwi", "dwo", "dbi", "dbo"};
static void gproblem_outputs(const gproblem *p, int64_t n[6], float *o[2][6]) {
  const int64_t sz[6] = {p->T * p->H, p->T * p->H, p->E * p->H * 2 * p->F, p->E * p->F * p->H, p->E * 2 * p->F, p->E * p->H};
  for (int i = 0; i < 6; i++) n[i] = sz[i];
  for (int u = 0; u < 2; u++)
    for (int i = 0; i < 6; i++) o[u][i] = (float *)calloc((size_t)n[i], sizeof(float));
}
static void gproblem_outputs_free(float *o[2][6]) {
  for (int u = 0; u < 2; u++)
    for (int i = 0; i < 6; i++) free(o[u][i]);
}
static void gproblem_free(gproblem *p) {
  float *b[7] = {p->x, p->gate, p->wi, p->wo, p->bi, p->bo, p->d_out};
  for (int i = 0; i < 7; i++) free(b[i]);
}

/* Runs p on the dp x fsdp x ep mesh with fp8_gather = q; outputs: out, dx, dwi, dwo, dbi, dbo
 * (bf16_grads: d_wi and d_wo asked for in bf16). */
static void run_gathered_grads(const gproblem *p, tw_moe_recipe recipe, int dp, int fsdp, int ep, int q, int reuse,
                               int bf16_grads, float *o[6]) {
  tw_moe_threads_run r;
  memset(&r, 0, sizeof r);
  tw_moe_config c = TW_MOE_CONFIG_INIT;
  c.num_experts = (int)p->E; c.hidden = p->H; c.ffn = p->F; c.router.topk = K; c.aux_coeff = 0.01f;
  c.recipe = recipe; c.fp8_gather = q;
  r.cfg = c;
  r.T = p->T;
  tw_axis ax[3] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_EP};
  int sz[3] = {dp, fsdp, ep};
  cr_assert_eq(tw_mesh_init(&r.mesh, 3, ax, sz), TW_OK);
  r.x = p->x; r.gate = p->gate; r.wi = p->wi; r.wo = p->wo; r.bi = p->bi; r.bo = p->bo; r.d_out = p->d_out;
  r.d_aux = 1; r.layers = 1; r.reuse = reuse; r.bf16_grads = bf16_grads;
  r.out = o[0]; r.dx = o[1]; r.dwi = o[2]; r.dwo = o[3]; r.dbi = o[4]; r.dbo = o[5];
  cr_assert_eq(tw_moe_run_threads(&r), TW_OK, "%s dp=%d fsdp=%d ep=%d fp8_gather=%d reuse=%d: %s", tw_moe_recipe_name(recipe),
               dp, fsdp, ep, q, reuse, tw_last_error());
}
static void run_gathered_reuse(const gproblem *p, tw_moe_recipe recipe, int dp, int fsdp, int ep, int q, int reuse,
                               float *o[6]) {
  run_gathered_grads(p, recipe, dp, fsdp, ep, q, reuse, 0, o);
}
static void run_gathered(const gproblem *p, tw_moe_recipe recipe, int dp, int fsdp, int ep, int q, float *o[6]) {
  run_gathered_reuse(p, recipe, dp, fsdp, ep, q, 0, o);
}

/* Runs with OpenBLAS's own thread count: before ref/gemm.c's blas_count_lock, concurrent thread
 * ranks saw one rank's "1 thread while my workers run" and differed by 1 bf16 ulp in 3 of 12
 * runs here (2 cores); 0 of 10 since. */
Test(moe_layers, fp8_gather_is_bit_identical_for_every_fp8_recipe) {
  static const int meshes[][3] = {{1, 2, 1}, {1, 4, 1}, {1, 2, 2}, {2, 2, 1}};
  int runs = 0;
  for (int fi = 0; fi < 2; fi++) {
    gproblem p = gproblem_make(fi ? 136 : 40, 40 + (uint64_t)fi);
    int64_t n[6];
    float *o[2][6];
    gproblem_outputs(&p, n, o);
    for (int rc = TW_MOE_FP8_CURRENT; rc <= TW_MOE_FP8_MXFP8; rc++)
      for (int mi = 0; mi < 4; mi++) {
        const int *ms = meshes[mi];
        for (int q = 0; q < 2; q++) {
          for (int i = 0; i < 6; i++) memset(o[q][i], 0xA5, sizeof(float) * (size_t)n[i]); /* poison */
          run_gathered(&p, (tw_moe_recipe)rc, ms[0], ms[1], ms[2], q, o[q]);
        }
        runs++;
        for (int i = 0; i < 6; i++)
          cr_assert(memcmp(o[0][i], o[1][i], sizeof(float) * (size_t)n[i]) == 0,
                    "%s F=%lld dp=%d fsdp=%d ep=%d: %s differs with fp8_gather", tw_moe_recipe_name((tw_moe_recipe)rc),
                    (long long)p.F, ms[0], ms[1], ms[2], output_names[i]);
      }
    gproblem_outputs_free(o);
    gproblem_free(&p);
  }
  cr_assert_eq(runs, 24);
}

/* tw_moe_set_weight_reuse: a step on other tokens, then the step under test taking that step's
 * gathered / fp8 weights, equals the step alone bit for bit (every recipe, fsdp meshes,
 * fp8_gather on and off). */
Test(moe_layers, weight_reuse_is_bit_identical) {
  static const int meshes[][3] = {{1, 1, 1}, {1, 2, 1}, {1, 2, 2}};
  gproblem p = gproblem_make(40, 52);
  int64_t n[6];
  float *o[2][6];
  gproblem_outputs(&p, n, o);
  int runs = 0;
  for (int rc = TW_MOE_BF16; rc <= TW_MOE_FP8_MXFP8; rc++)
    for (int mi = 0; mi < 3; mi++)
      for (int q = 0; q < 2; q++) {
        const int *ms = meshes[mi];
        if (q && (rc == TW_MOE_BF16 || ms[1] == 1)) continue;
        for (int u = 0; u < 2; u++) {
          for (int i = 0; i < 6; i++) memset(o[u][i], 0xA5, sizeof(float) * (size_t)n[i]);
          run_gathered_reuse(&p, (tw_moe_recipe)rc, ms[0], ms[1], ms[2], q, u, o[u]);
        }
        runs++;
        for (int i = 0; i < 6; i++)
          cr_assert(memcmp(o[0][i], o[1][i], sizeof(float) * (size_t)n[i]) == 0,
                    "%s dp=%d fsdp=%d ep=%d fp8_gather=%d: %s differs with weight reuse",
                    tw_moe_recipe_name((tw_moe_recipe)rc), ms[0], ms[1], ms[2], q, output_names[i]);
      }
  gproblem_outputs_free(o);
  gproblem_free(&p);
  cr_assert_eq(runs, 4 * 3 + 3 * 2);
}

/* bf16 d_wi / d_wo (tw_moe.h "Backward"): each element is the f32 gradient of the same step
 * rounded once, whether the wgrad GEMMs round it (no dp, no fsdp) or the block does after the
 * sums over dp and fsdp; every other output is unchanged, bit for bit. Every recipe with bf16
 * weights, on one rank and on dp, fsdp, ep and mixed meshes (fp8_gather on one). */
Test(moe_layers, bf16_weight_grads_are_the_f32_ones_rounded_once) {
  static const int meshes[][4] = {{1, 1, 1, 0}, {2, 1, 1, 0}, {1, 2, 1, 0}, {1, 1, 2, 0}, {2, 2, 1, 0}, {1, 2, 2, 1}};
  gproblem p = gproblem_make(40, 61);
  int64_t n[6];
  float *o[2][6];
  gproblem_outputs(&p, n, o);
  int runs = 0;
  for (int rc = TW_MOE_BF16; rc <= TW_MOE_FP8_MXFP8; rc++)
    for (int mi = 0; mi < 6; mi++) {
      const int *ms = meshes[mi];
      int q = ms[3] && rc != TW_MOE_BF16;
      for (int u = 0; u < 2; u++) {
        for (int i = 0; i < 6; i++) memset(o[u][i], 0xA5, sizeof(float) * (size_t)n[i]);
        run_gathered_grads(&p, (tw_moe_recipe)rc, ms[0], ms[1], ms[2], q, 0, u, o[u]);
      }
      runs++;
      for (int i = 0; i < 6; i++) {
        if (i == 2 || i == 3) {
          for (int64_t e = 0; e < n[i]; e++) {
            float want = tw_bf16_to_f32(tw_f32_to_bf16(o[0][i][e]));
            cr_assert(memcmp(&want, &o[1][i][e], 4) == 0, "%s dp=%d fsdp=%d ep=%d: %s[%lld] = %a, the f32 one %a rounds to %a",
                      tw_moe_recipe_name((tw_moe_recipe)rc), ms[0], ms[1], ms[2], output_names[i], (long long)e,
                      (double)o[1][i][e], (double)o[0][i][e], (double)want);
          }
        } else {
          cr_assert(memcmp(o[0][i], o[1][i], sizeof(float) * (size_t)n[i]) == 0, "%s dp=%d fsdp=%d ep=%d: %s differs with bf16 grads",
                    tw_moe_recipe_name((tw_moe_recipe)rc), ms[0], ms[1], ms[2], output_names[i]);
        }
      }
    }
  gproblem_outputs_free(o);
  gproblem_free(&p);
  cr_assert_eq(runs, 4 * 6);
}

Test(moe_layers, weight_reuse_arguments) {
  cr_assert_eq(tw_moe_set_weight_reuse(NULL, 1), TW_ERR_NULL);
  tw_comm *comm = NULL;
  cr_assert_eq(tw_comm_init_threads(1, &comm), TW_OK);
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK, "%s", tw_last_error());
  tw_moe_config c = base_cfg();
  tw_moe *m = NULL;
  cr_assert_eq(tw_moe_create(ctx, NULL, &c, &m), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_moe_set_weight_reuse(m, 2), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "reuse = 2 must be 0 or 1") != NULL, "%s", tw_last_error());
  cr_assert_eq(tw_moe_set_weight_reuse(m, 1), TW_OK);
  tw_moe_destroy(m);
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
}

/* ---- finite differences ------------------------------------------------------------------- */
/* L = sum(out * d_out) + aux in double, from an f32 forward */
static double loss_of(problem *p, tw_moe_config c) {
  tw_moe_threads_run r;
  memset(&r, 0, sizeof r);
  float out[T * H], aux = 0;
  r.cfg = c; r.T = T;
  r.x = p->x; r.gate = p->gate; r.wi = p->wi; r.wo = p->wo; r.bi = p->bi; r.bo = p->bo; r.d_out = p->d_out;
  r.d_aux = 1; r.layers = 1; r.out = out; r.aux = &aux;
  cr_assert_eq(tw_moe_run_threads(&r), TW_OK, "%s", tw_last_error());
  double L = aux;
  for (int i = 0; i < T * H; i++) L += (double)out[i] * p->d_out[i];
  return L;
}

Test(moe_fd, backward_matches_central_differences) {
  static problem p;
  fill(&p, 4);
  for (int early = 0; early < 2; early++) {
    tw_moe_config c = base_cfg();
    c.weighting = early ? TW_MOE_WEIGHT_EARLY : TW_MOE_WEIGHT_LATE;
    c.act = early ? TW_MOE_GEGLU : TW_MOE_SWIGLU;
    static float dx[T * H], dgate[H * E], dwi[E * H * 2 * F], dwo[E * F * H], dbi[E * 2 * F], dbo[E * H];
    tw_moe_threads_run r;
    memset(&r, 0, sizeof r);
    r.cfg = c; r.T = T;
    r.x = p.x; r.gate = p.gate; r.wi = p.wi; r.wo = p.wo; r.bi = p.bi; r.bo = p.bo; r.d_out = p.d_out;
    r.d_aux = 1; r.layers = 1;
    r.dx = dx; r.dgate = dgate; r.dwi = dwi; r.dwo = dwo; r.dbi = dbi; r.dbo = dbo;
    cr_assert_eq(tw_moe_run_threads(&r), TW_OK, "%s", tw_last_error());
    struct { const char *name; float *param, *grad; int n; } ps[] = {
        {"x", p.x, dx, T * H}, {"gate", p.gate, dgate, H * E}, {"wi", p.wi, dwi, E * H * 2 * F},
        {"wo", p.wo, dwo, E * F * H}, {"bi", p.bi, dbi, E * 2 * F}, {"bo", p.bo, dbo, E * H}};
    uint64_t st = 77 + early;
    for (size_t q = 0; q < sizeof ps / sizeof *ps; q++)
      for (int rep = 0; rep < 8; rep++) {
        int i = (int)tt_rand_uniform(&st, 0, ps[q].n);
        float keep = ps[q].param[i], h = 1e-2f;
        ps[q].param[i] = keep + h;
        double lp = loss_of(&p, c);
        ps[q].param[i] = keep - h;
        double lm = loss_of(&p, c);
        ps[q].param[i] = keep;
        double fd = (lp - lm) / (2.0 * h), got = ps[q].grad[i];
        cr_expect(fabs(fd - got) <= 2e-3 + 2e-2 * fabs(fd), "%s %s[%d]: backward %.6g, central difference %.6g",
                  early ? "early" : "late", ps[q].name, i, got, fd);
      }
  }
}
