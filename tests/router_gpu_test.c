/* The CUDA router (gpu/router.cu, version router_warp) against the oracle (ref/router.c), bit
 * for bit: every stored golden case through the runner `twin check` uses (within its f64
 * bound) and again ref-vs-gpu on the same inputs with every output compared exactly, then 600
 * seeded random cases (T 0..300, E 1..320 with awkward sizes, k 1..min(E, 12), softmax
 * pre/post, sigmoid with and without bias, group-limited top-k, bf16 logits, heavy ties from
 * quantized logits, scaling factors, coefficients) with forward, backward, aux loss and its
 * backward compared exactly; a large case (T 4096, E 256, k 8, 8 groups) for scale; errors
 * found on the device (NaN logit, bad or repeated ids for the backward) through the error
 * word; errors found on the host (shapes, host tensors, unknown forced version). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/exec.h"
#include "golden/runner.h"
#include "tests/test_util.h"
#include "twin/tw_check.h"
#include "twin/tw_npy.h"
#include "twin/tw_numerics.h"
#include "twin/tw_router.h"

static tw_ctx *gpu, *ref;
static void setup(void) {
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&gpu, &cfg), TW_OK, "gpu ctx: %s", tw_last_error());
  ref = tt_ref_ctx();
}
static void teardown(void) {
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(ref);
}
TestSuite(router_gpu, .init = setup, .fini = teardown, .timeout = 600);

/* ---- one case on both backends ----------------------------------------------------------- */

typedef struct {
  tw_router_opts o;
  int64_t T, E;
  int bf16;
  void *logits;    /* host [T, E] f32 or bf16 codes */
  float *bias;     /* [E] or NULL */
  float *dw;       /* [T, k] */
  float coeff, d_loss;
} rcase;

static void *dev_copy(const void *h, size_t bytes) {
  void *d = NULL;
  if (!bytes) return NULL;
  cr_assert_eq(tw_alloc(gpu, bytes, &d), TW_OK, "%s", tw_last_error());
  tw_tensor src = tw_tensor_1d((void *)h, TW_U8, (int64_t)bytes, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_1d(d, TW_U8, (int64_t)bytes, TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(gpu, &dst, &src), TW_OK, "%s", tw_last_error());
  return d;
}
static void dev_read(void *h, const void *d, size_t bytes) {
  if (!bytes) return;
  tw_tensor src = tw_tensor_1d((void *)d, TW_U8, (int64_t)bytes, TW_MEM_DEVICE);
  tw_tensor dst = tw_tensor_1d(h, TW_U8, (int64_t)bytes, TW_MEM_HOST);
  cr_assert_eq(tw_tensor_copy(gpu, &dst, &src), TW_OK, "%s", tw_last_error());
}

static int same_bits(const void *a, const void *b, size_t bytes, const char *what, const char *name) {
  if (memcmp(a, b, bytes) == 0) return 1;
  const uint32_t *x = a, *y = b;
  for (size_t i = 0; i < bytes / 4; i++)
    if (x[i] != y[i]) {
      float fx, fy;
      memcpy(&fx, &x[i], 4);
      memcpy(&fy, &y[i], 4);
      cr_log_error("%s: %s[%zu] gpu 0x%08x (%.9g) ref 0x%08x (%.9g)", name, what, i, x[i], fx, y[i], fy);
      break;
    }
  return 0;
}

/* Runs fwd, bwd, aux loss and aux bwd on both backends; 1 if every output is bit-identical. */
static int run_both(const rcase *c, const char *name) {
  int64_t T = c->T, E = c->E;
  int k = c->o.topk;
  size_t lb = (size_t)(T * E) * (c->bf16 ? 2 : 4), nk = (size_t)(T * k), ne = (size_t)(T * E);
  tw_dtype ldt = c->bf16 ? TW_BF16 : TW_F32;
  /* ref */
  int32_t *ri = calloc(nk + 1, 4), *rc = calloc((size_t)E, 4), *gi = calloc(nk + 1, 4), *gc = calloc((size_t)E, 4);
  float *rw = calloc(nk + 1, 4), *rdl = calloc(ne + 1, 4), *radl = calloc(ne + 1, 4), rloss = 0;
  float *gw = calloc(nk + 1, 4), *gdl = calloc(ne + 1, 4), *gadl = calloc(ne + 1, 4), gloss = 0;
  tw_router_opts ro = c->o;
  ro.expert_bias = c->bias ? tw_tensor_1d(c->bias, TW_F32, E, TW_MEM_HOST) : tw_tensor_none();
  tw_tensor L = tw_tensor_2d(c->logits, ldt, T, E, TW_MEM_HOST);
  tw_tensor I = tw_tensor_2d(ri, TW_I32, T, k, TW_MEM_HOST), W = tw_tensor_2d(rw, TW_F32, T, k, TW_MEM_HOST);
  tw_tensor C = tw_tensor_1d(rc, TW_I32, E, TW_MEM_HOST), DW = tw_tensor_2d(c->dw, TW_F32, T, k, TW_MEM_HOST);
  tw_tensor DL = tw_tensor_2d(rdl, TW_F32, T, E, TW_MEM_HOST), ADL = tw_tensor_2d(radl, TW_F32, T, E, TW_MEM_HOST);
  tw_tensor LOSS = tw_tensor_1d(&rloss, TW_F32, 1, TW_MEM_HOST);
  cr_assert_eq(tw_router_fwd(ref, &L, &ro, &I, &W, &C), TW_OK, "%s ref fwd: %s", name, tw_last_error());
  cr_assert_eq(tw_router_bwd(ref, &L, &ro, &I, &DW, &DL), TW_OK, "%s ref bwd: %s", name, tw_last_error());
  int aux = T > 0;
  if (aux) {
    cr_assert_eq(tw_router_aux_loss(ref, &L, &ro, &C, c->coeff, &LOSS), TW_OK, "%s: %s", name, tw_last_error());
    cr_assert_eq(tw_router_aux_loss_bwd(ref, &L, &ro, &C, c->coeff, c->d_loss, &ADL), TW_OK, "%s: %s", name,
                 tw_last_error());
  }
  /* gpu */
  void *dL = dev_copy(c->logits, lb), *dB = c->bias ? dev_copy(c->bias, (size_t)E * 4) : NULL;
  void *dDW = dev_copy(c->dw, nk * 4), *dI = NULL, *dW = NULL, *dC = NULL, *dDL = NULL, *dADL = NULL, *dLOSS = NULL;
  if (nk) {
    cr_assert_eq(tw_alloc(gpu, nk * 4, &dI), TW_OK);
    cr_assert_eq(tw_alloc(gpu, nk * 4, &dW), TW_OK);
  }
  cr_assert_eq(tw_alloc(gpu, (size_t)E * 4, &dC), TW_OK);
  if (ne) {
    cr_assert_eq(tw_alloc(gpu, ne * 4, &dDL), TW_OK);
    cr_assert_eq(tw_alloc(gpu, ne * 4, &dADL), TW_OK);
  }
  cr_assert_eq(tw_alloc(gpu, 4, &dLOSS), TW_OK);
  tw_router_opts go = c->o;
  go.expert_bias = c->bias ? tw_tensor_1d(dB, TW_F32, E, TW_MEM_DEVICE) : tw_tensor_none();
  tw_tensor gL = tw_tensor_2d(dL, ldt, T, E, TW_MEM_DEVICE);
  tw_tensor gI = tw_tensor_2d(dI, TW_I32, T, k, TW_MEM_DEVICE), gW = tw_tensor_2d(dW, TW_F32, T, k, TW_MEM_DEVICE);
  tw_tensor gC = tw_tensor_1d(dC, TW_I32, E, TW_MEM_DEVICE), gDW = tw_tensor_2d(dDW, TW_F32, T, k, TW_MEM_DEVICE);
  tw_tensor gDL = tw_tensor_2d(dDL, TW_F32, T, E, TW_MEM_DEVICE), gADL = tw_tensor_2d(dADL, TW_F32, T, E, TW_MEM_DEVICE);
  tw_tensor gLOSS = tw_tensor_1d(dLOSS, TW_F32, 1, TW_MEM_DEVICE);
  cr_assert_eq(tw_router_fwd(gpu, &gL, &go, &gI, &gW, &gC), TW_OK, "%s gpu fwd: %s", name, tw_last_error());
  cr_assert_eq(tw_router_bwd(gpu, &gL, &go, &gI, &gDW, &gDL), TW_OK, "%s gpu bwd: %s", name, tw_last_error());
  if (aux) {
    cr_assert_eq(tw_router_aux_loss(gpu, &gL, &go, &gC, c->coeff, &gLOSS), TW_OK, "%s: %s", name, tw_last_error());
    cr_assert_eq(tw_router_aux_loss_bwd(gpu, &gL, &go, &gC, c->coeff, c->d_loss, &gADL), TW_OK, "%s: %s", name,
                 tw_last_error());
  }
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s: device: %s", name, tw_last_error());
  dev_read(gi, dI, nk * 4);
  dev_read(gw, dW, nk * 4);
  dev_read(gc, dC, (size_t)E * 4);
  dev_read(gdl, dDL, ne * 4);
  if (aux) {
    dev_read(gadl, dADL, ne * 4);
    dev_read(&gloss, dLOSS, 4);
  }
  int ok = same_bits(gi, ri, nk * 4, "topk_idx", name) && same_bits(gw, rw, nk * 4, "topk_weights", name) &&
           same_bits(gc, rc, (size_t)E * 4, "counts", name) && same_bits(gdl, rdl, ne * 4, "d_logits", name);
  if (ok && aux)
    ok = same_bits(&gloss, &rloss, 4, "aux_loss", name) && same_bits(gadl, radl, ne * 4, "aux_d_logits", name);
  void *dev[] = {dL, dB, dDW, dI, dW, dC, dDL, dADL, dLOSS};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
    if (dev[i]) tw_free(gpu, dev[i]);
  free(ri); free(rc); free(gi); free(gc); free(rw); free(rdl); free(radl); free(gw); free(gdl); free(gadl);
  return ok;
}

/* ---- goldens ----------------------------------------------------------------------------- */

static double key_num(const tw_case_keys *k, const char *key) {
  const char *v = tw_case_get(k, key);
  cr_assert_not_null(v, "case.txt lacks %s", key);
  return strtod(v, NULL);
}

Test(router_gpu, goldens_through_the_runner) {
  char root[1024];
  snprintf(root, sizeof root, "%s/router", tt_golden_root());
  char **dirs = NULL;
  int n = tw_golden_list_cases(root, &dirs);
  cr_assert_geq(n, 12, "%d router golden cases under %s: %s", n, root, tw_last_error());
  int failed = 0;
  for (int i = 0; i < n; i++) {
    tw_golden_result res;
    tw_status s = tw_golden_run_case(gpu, dirs[i], &res);
    if (s != TW_OK || !res.passed || res.skipped || res.outputs != 6) {
      failed++;
      cr_log_error("%s: %s %s skipped=%d outputs=%d", dirs[i], s != TW_OK ? tw_last_error() : res.worst_output,
                   res.detail, res.skipped, res.outputs);
    }
  }
  cr_assert_eq(failed, 0, "%d of %d router goldens failed on the gpu", failed, n);
  cr_log_info("router goldens on the gpu: %d of %d passed", n - failed, n);
  tw_golden_free_list(dirs, n);
}

Test(router_gpu, goldens_bit_for_bit_against_ref) {
  char root[1024];
  snprintf(root, sizeof root, "%s/router", tt_golden_root());
  char **dirs = NULL;
  int n = tw_golden_list_cases(root, &dirs), failed = 0;
  cr_assert_geq(n, 12);
  for (int i = 0; i < n; i++) {
    char path[2048];
    tw_case_keys k;
    snprintf(path, sizeof path, "%s/case.txt", dirs[i]);
    cr_assert_eq(tw_case_keys_parse_file(path, &k), TW_OK, "%s", tw_last_error());
    rcase c;
    memset(&c, 0, sizeof c);
    tw_router_opts o = TW_ROUTER_OPTS_INIT;
    o.score = strcmp(tw_case_get(&k, "score"), "sigmoid") == 0 ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
    o.pre_softmax = (int)key_num(&k, "pre_softmax");
    o.topk = (int)key_num(&k, "topk");
    o.num_groups = (int)key_num(&k, "num_groups");
    o.group_topk = (int)key_num(&k, "group_topk");
    o.scaling_factor = (float)key_num(&k, "scaling_factor");
    c.o = o;
    c.coeff = (float)key_num(&k, "coeff");
    c.d_loss = (float)key_num(&k, "d_loss");
    c.bf16 = strcmp(tw_case_get(&k, "logits_dtype"), "bf16") == 0;
    tw_tensor lg, b = tw_tensor_none(), dw;
    snprintf(path, sizeof path, "%s/logits.npy", dirs[i]);
    cr_assert_eq(tw_npy_load(path, &lg), TW_OK, "%s", tw_last_error());
    snprintf(path, sizeof path, "%s/d_topk_weights.npy", dirs[i]);
    cr_assert_eq(tw_npy_load(path, &dw), TW_OK, "%s", tw_last_error());
    if (key_num(&k, "has_bias")) {
      snprintf(path, sizeof path, "%s/expert_bias.npy", dirs[i]);
      cr_assert_eq(tw_npy_load(path, &b), TW_OK, "%s", tw_last_error());
      c.bias = b.data;
    }
    c.T = lg.shape[0];
    c.E = lg.shape[1];
    c.logits = lg.data;
    c.dw = dw.data;
    if (!run_both(&c, dirs[i])) failed++;
    free(lg.data); free(dw.data); free(b.data);
  }
  cr_assert_eq(failed, 0, "%d of %d router goldens differ from ref on the gpu", failed, n);
  cr_log_info("router goldens bit for bit against ref: %d cases", n);
  tw_golden_free_list(dirs, n);
}

/* ---- random cases ------------------------------------------------------------------------ */

static const int64_t E_CHOICES[] = {1, 2, 3, 7, 8, 16, 24, 60, 64, 96, 128, 160, 256, 320};

static void random_case(rcase *c, uint64_t seed) {
  uint64_t st = seed;
  memset(c, 0, sizeof *c);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  c->E = E_CHOICES[tt_rand_u64(&st) % (sizeof E_CHOICES / sizeof E_CHOICES[0])];
  c->T = (int64_t)(tt_rand_u64(&st) % 301);
  if (seed % 17 == 0) c->T = 0;
  int kmax = c->E < 12 ? (int)c->E : 12;
  o.topk = 1 + (int)(tt_rand_u64(&st) % (uint64_t)kmax);
  int mode = (int)(tt_rand_u64(&st) % 4); /* post softmax, pre softmax, sigmoid, sigmoid + bias */
  o.score = mode >= 2 ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
  o.pre_softmax = mode == 1;
  o.scaling_factor = (tt_rand_u64(&st) & 1) ? 1.0f : (float)tt_rand_uniform(&st, 0.1, 4.0);
  if (tt_rand_u64(&st) % 3 == 0) { /* group-limited */
    int G_opts[8], ng = 0;
    for (int G = 2; G <= c->E && ng < 8; G++)
      if (c->E % G == 0) G_opts[ng++] = G;
    if (ng) {
      int G = G_opts[tt_rand_u64(&st) % (uint64_t)ng];
      int64_t per_group = c->E / G;
      for (int tries = 0; tries < 20; tries++) {
        int gk = 1 + (int)(tt_rand_u64(&st) % (uint64_t)G);
        int per = o.topk / gk;
        if (per >= 1 && per <= per_group && (int64_t)gk * per_group >= o.topk) {
          o.num_groups = G;
          o.group_topk = gk;
          break;
        }
      }
    }
  }
  c->o = o;
  c->bf16 = (int)(tt_rand_u64(&st) % 3 == 0);
  int ties = (int)(tt_rand_u64(&st) % 3 == 0); /* logits from a few values: many equal scores */
  double scale = tt_rand_uniform(&st, 0.1, 8.0);
  size_t n = (size_t)(c->T * c->E);
  c->logits = malloc(n * 4 + 4);
  for (size_t i = 0; i < n; i++) {
    float v = ties ? (float)((int)(tt_rand_u64(&st) % 5) - 2) * 0.5f : (float)tt_rand_uniform(&st, -scale, scale);
    if (c->bf16) ((uint16_t *)c->logits)[i] = tw_f32_to_bf16(v);
    else ((float *)c->logits)[i] = v;
  }
  if (mode == 3) {
    c->bias = malloc((size_t)c->E * 4);
    for (int64_t e = 0; e < c->E; e++)
      c->bias[e] = ties ? (float)(e % 3) * 0.25f : (float)tt_rand_uniform(&st, -0.5, 0.5);
  }
  c->dw = malloc((size_t)(c->T * o.topk) * 4 + 4);
  tt_fill_uniform_f32(c->dw, c->T * o.topk, seed * 7 + 1, -1, 1);
  c->coeff = (float)tt_rand_uniform(&st, 1e-3, 1.0);
  c->d_loss = (float)tt_rand_uniform(&st, -2, 2);
}

Test(router_gpu, random_cases_bit_for_bit) {
  int failed = 0, N = 600, by_mode[4] = {0}, grouped = 0, bf16 = 0;
  for (int i = 0; i < N; i++) {
    rcase c;
    random_case(&c, 0x5eed0000u + (uint64_t)i);
    char name[160];
    snprintf(name, sizeof name, "case %d (T=%lld E=%lld k=%d score=%d pre=%d G=%d gk=%d bias=%d bf16=%d)", i,
             (long long)c.T, (long long)c.E, c.o.topk, (int)c.o.score, c.o.pre_softmax, c.o.num_groups,
             c.o.group_topk, c.bias != NULL, c.bf16);
    if (!run_both(&c, name)) failed++;
    by_mode[c.o.score == TW_ROUTER_SIGMOID ? 2 + (c.bias != NULL) : c.o.pre_softmax]++;
    grouped += c.o.num_groups > 0;
    bf16 += c.bf16;
    free(c.logits); free(c.bias); free(c.dw);
  }
  cr_log_info("router random: %d cases (post %d, pre %d, sigmoid %d, sigmoid+bias %d; grouped %d; bf16 %d), %d differ",
              N, by_mode[0], by_mode[1], by_mode[2], by_mode[3], grouped, bf16, failed);
  cr_assert_eq(failed, 0, "%d of %d random router cases differ from ref", failed, N);
}

Test(router_gpu, large_case_deepseek_shape) {
  rcase c;
  memset(&c, 0, sizeof c);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.score = TW_ROUTER_SIGMOID;
  o.topk = 8;
  o.num_groups = 8;
  o.group_topk = 4;
  o.scaling_factor = 2.5f;
  c.o = o;
  c.T = 4096;
  c.E = 256;
  c.logits = malloc((size_t)(c.T * c.E) * 4);
  tt_fill_uniform_f32(c.logits, c.T * c.E, 99, -4, 4);
  c.bias = malloc((size_t)c.E * 4);
  tt_fill_uniform_f32(c.bias, c.E, 98, -0.1f, 0.1f);
  c.dw = malloc((size_t)(c.T * 8) * 4);
  tt_fill_uniform_f32(c.dw, c.T * 8, 97, -1, 1);
  c.coeff = 1e-2f;
  c.d_loss = 1.0f;
  cr_assert(run_both(&c, "T=4096 E=256 k=8 G=8/4 sigmoid+bias"));
  free(c.logits); free(c.bias); free(c.dw);
}

/* ---- errors ------------------------------------------------------------------------------- */

Test(router_gpu, nan_logit_is_a_device_error_naming_token_and_expert) {
  int64_t T = 5, E = 8;
  float x[40];
  tt_fill_uniform_f32(x, T * E, 3, -1, 1);
  x[3 * E + 6] = NAN;
  void *dx = dev_copy(x, sizeof x), *di, *dw, *dl, *dc;
  cr_assert_eq(tw_alloc(gpu, (size_t)T * 2 * 4, &di), TW_OK);
  cr_assert_eq(tw_alloc(gpu, (size_t)T * 2 * 4, &dw), TW_OK);
  cr_assert_eq(tw_alloc(gpu, (size_t)(T * E) * 4, &dl), TW_OK);
  cr_assert_eq(tw_alloc(gpu, (size_t)E * 4, &dc), TW_OK);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.topk = 2;
  tw_tensor L = tw_tensor_2d(dx, TW_F32, T, E, TW_MEM_DEVICE), I = tw_tensor_2d(di, TW_I32, T, 2, TW_MEM_DEVICE);
  tw_tensor W = tw_tensor_2d(dw, TW_F32, T, 2, TW_MEM_DEVICE), C = tw_tensor_1d(dc, TW_I32, E, TW_MEM_DEVICE);
  tw_tensor DL = tw_tensor_2d(dl, TW_F32, T, E, TW_MEM_DEVICE), loss = tw_tensor_1d(dl, TW_F32, 1, TW_MEM_DEVICE);
  cr_assert_eq(tw_router_fwd(gpu, &L, &o, &I, &W, &C), TW_OK);
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, "router: logits[3, 6] is NaN");
  int32_t ids[10];
  dev_read(ids, di, sizeof ids);
  for (int i = 0; i < 10; i++) cr_assert(ids[i] >= 0 && ids[i] < E, "id %d out of range after a NaN", ids[i]);
  cr_assert_eq(tw_router_bwd(gpu, &L, &o, &I, &W, &DL), TW_OK);
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, "router_bwd: logits[3, 6] is NaN");
  cr_assert_eq(tw_router_aux_loss(gpu, &L, &o, &C, 0.1f, &loss), TW_OK);
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, "router_aux_loss: logits[3, 6] is NaN");
  o.score = TW_ROUTER_SIGMOID;
  cr_assert_eq(tw_router_aux_loss_bwd(gpu, &L, &o, &C, 0.1f, 1.0f, &DL), TW_OK);
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, "router_aux_loss_bwd: logits[3, 6] is NaN");
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "the error word is cleared by the check");
  tw_free(gpu, dx); tw_free(gpu, di); tw_free(gpu, dw); tw_free(gpu, dl); tw_free(gpu, dc);
}

Test(router_gpu, bad_ids_for_the_backward_are_device_errors) {
  int64_t T = 3, E = 6;
  float x[18], g[6] = {1, 1, 1, 1, 1, 1}, out[18];
  tt_fill_uniform_f32(x, T * E, 4, -1, 1);
  int32_t bad_range[6] = {0, 1, 2, 3, 4, 9}, twice[6] = {0, 1, 5, 5, 2, 3};
  void *dx = dev_copy(x, sizeof x), *dg = dev_copy(g, sizeof g), *dl, *di;
  cr_assert_eq(tw_alloc(gpu, sizeof out, &dl), TW_OK);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.topk = 2;
  tw_tensor L = tw_tensor_2d(dx, TW_F32, T, E, TW_MEM_DEVICE), G = tw_tensor_2d(dg, TW_F32, T, 2, TW_MEM_DEVICE);
  tw_tensor DL = tw_tensor_2d(dl, TW_F32, T, E, TW_MEM_DEVICE);
  di = dev_copy(bad_range, sizeof bad_range);
  tw_tensor I = tw_tensor_2d(di, TW_I32, T, 2, TW_MEM_DEVICE);
  cr_assert_eq(tw_router_bwd(gpu, &L, &o, &I, &G, &DL), TW_OK);
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, "router_bwd: topk_idx[2, 1] = 9 is not an expert id");
  dev_read(out, dl, sizeof out);
  for (int e = 0; e < E; e++) cr_assert_eq(out[2 * E + e], 0.0f, "the bad token's gradient row is zero");
  tw_free(gpu, di);
  di = dev_copy(twice, sizeof twice);
  I.data = di;
  cr_assert_eq(tw_router_bwd(gpu, &L, &o, &I, &G, &DL), TW_OK);
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, "router_bwd: token 1 lists expert 5 twice");
  tw_free(gpu, di); tw_free(gpu, dx); tw_free(gpu, dg); tw_free(gpu, dl);
}

Test(router_gpu, host_side_errors) {
  int64_t T = 2, E = 4;
  float x[8] = {0};
  void *dx = dev_copy(x, sizeof x), *di, *dw;
  cr_assert_eq(tw_alloc(gpu, 64, &di), TW_OK);
  cr_assert_eq(tw_alloc(gpu, 64, &dw), TW_OK);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.topk = 5; /* > E */
  tw_tensor L = tw_tensor_2d(dx, TW_F32, T, E, TW_MEM_DEVICE), none = tw_tensor_none();
  tw_tensor I = tw_tensor_2d(di, TW_I32, T, 5, TW_MEM_DEVICE), W = tw_tensor_2d(dw, TW_F32, T, 5, TW_MEM_DEVICE);
  tt_expect_status(tw_router_fwd(gpu, &L, &o, &I, &W, &none), TW_ERR_INVALID_ARG, "topk = 5 must be in [1, E = 4]");
  o.topk = 2;
  I.shape[1] = 3; /* wrong shape */
  W.shape[1] = 2;
  tt_expect_status(tw_router_fwd(gpu, &L, &o, &I, &W, &none), TW_ERR_SHAPE, "topk_idx");
  I.shape[1] = 2;
  tw_tensor hostL = tw_tensor_2d(x, TW_F32, T, E, TW_MEM_HOST); /* host memory on a gpu context */
  cr_assert_neq(tw_router_fwd(gpu, &hostL, &o, &I, &W, &none), TW_OK);
  o.num_groups = 3; /* does not divide E */
  o.group_topk = 1;
  tt_expect_status(tw_router_fwd(gpu, &L, &o, &I, &W, &none), TW_ERR_INVALID_ARG, "num_groups = 3 does not divide");
  o.num_groups = 0;
  tw_ctx *forced = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cfg.kernel = "router_nope";
  cr_assert_eq(tw_ctx_create(&forced, &cfg), TW_OK);
  tt_expect_status(tw_router_fwd(forced, &L, &o, &I, &W, &none), TW_ERR_INVALID_ARG,
                   "no kernel version named 'router_nope'");
  tw_ctx_destroy(forced);
  cfg.kernel = "router_warp";
  cr_assert_eq(tw_ctx_create(&forced, &cfg), TW_OK);
  tt_expect_status(tw_router_fwd(forced, &L, &o, &I, &W, &none), TW_OK, NULL);
  cr_assert_eq(tw_ctx_check(forced), TW_OK, "%s", tw_last_error());
  tw_ctx_destroy(forced);
  tw_free(gpu, dx); tw_free(gpu, di); tw_free(gpu, dw);
}
