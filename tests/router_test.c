/* The router (tw_router.h) against the independent goldens of golden/gen_router.py (NumPy,
 * f64, backward verified there by f64 finite differences), against central finite
 * differences of its own forward, the documented tie rule, and every bad input. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/runner.h"
#include "tests/test_util.h"
#include "twin/tw_npy.h"
#include "twin/tw_numerics.h"
#include "twin/tw_router.h"

static tw_ctx *ctx;
static void setup(void) {
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
}
static void teardown(void) { tw_ctx_destroy(ctx); }
TestSuite(router, .init = setup, .fini = teardown);

#define EXPECT_ERR(call, status, text) tt_expect_status((call), (status), (text))
#define EXPECT_OK(call) tt_expect_status((call), TW_OK, NULL)

/* ---- goldens ---------------------------------------------------------------------------- */

/* The NumPy goldens through the runner `twin check` uses (golden/routing.c): ids and counts
 * bit for bit, weights and gradients within two f32 roundings of the f64 values. */
Test(router, goldens) {
  char root[1024];
  snprintf(root, sizeof root, "%s/router", tt_golden_root());
  char **dirs = NULL;
  int n = tw_golden_list_cases(root, &dirs);
  cr_assert_geq(n, 12, "%d router golden cases under %s: %s", n, root, tw_last_error());
  for (int i = 0; i < n; i++) {
    tw_golden_result res;
    tw_status s = tw_golden_run_case(ctx, dirs[i], &res);
    cr_expect_eq(s, TW_OK, "%s: %s", dirs[i], tw_last_error());
    cr_expect(res.passed, "%s: %s", res.name, res.detail);
    cr_expect_eq(res.outputs, 6, "%s: %d outputs compared", res.name, res.outputs);
  }
  tw_golden_free_list(dirs, n);
}

/* ---- finite differences of the forward -------------------------------------------------- */

/* L(logits) = sum_{t,j} topk_weights[t, j] * c[t, j]; its gradient is router_bwd(c). The
 * forward rounds its f64 result to f32, so the central step h = 1e-2 keeps that rounding
 * (1e-7 / 1e-2) and the truncation (h^2) both near 1e-5. */
static void check_fd(tw_router_opts o, int64_t T, int64_t E, uint64_t seed) {
  int k = o.topk;
  float *x = malloc((size_t)(T * E) * 4), *w = malloc((size_t)(T * k) * 4), *c = malloc((size_t)(T * k) * 4);
  float *dl = malloc((size_t)(T * E) * 4);
  int32_t *idx = malloc((size_t)(T * k) * 4), *idx2 = malloc((size_t)(T * k) * 4);
  uint64_t st = seed;
  /* well separated logits: a step of 1e-2 never changes the selection */
  for (int64_t t = 0; t < T; t++)
    for (int64_t e = 0; e < E; e++) x[t * E + e] = (float)(((e * 7 + t * 3) % E) * 0.37 - 1.0 + tt_rand_uniform(&st, 0, 0.05));
  tt_fill_uniform_f32(c, T * k, seed + 1, -1, 1);
  tw_tensor tx = tw_tensor_2d(x, TW_F32, T, E, TW_MEM_HOST), ti = tw_tensor_2d(idx, TW_I32, T, k, TW_MEM_HOST);
  tw_tensor ti2 = tw_tensor_2d(idx2, TW_I32, T, k, TW_MEM_HOST), tw_ = tw_tensor_2d(w, TW_F32, T, k, TW_MEM_HOST);
  tw_tensor tc = tw_tensor_2d(c, TW_F32, T, k, TW_MEM_HOST), tdl = tw_tensor_2d(dl, TW_F32, T, E, TW_MEM_HOST);
  tw_tensor none = tw_tensor_none();
  EXPECT_OK(tw_router_fwd(ctx, &tx, &o, &ti, &tw_, &none));
  EXPECT_OK(tw_router_bwd(ctx, &tx, &o, &ti, &tc, &tdl));
  const double h = 1e-2;
  for (int64_t i = 0; i < T * E; i++) {
    double l[2];
    float x0 = x[i];
    for (int s = 0; s < 2; s++) {
      x[i] = (float)(x0 + (s ? -h : h));
      EXPECT_OK(tw_router_fwd(ctx, &tx, &o, &ti2, &tw_, &none));
      cr_assert_eq(memcmp(idx, idx2, (size_t)(T * k) * 4), 0, "selection moved at element %lld", (long long)i);
      l[s] = 0;
      for (int64_t j = 0; j < T * k; j++) l[s] += (double)w[j] * c[j];
    }
    x[i] = x0;
    double fd = (l[0] - l[1]) / (2 * h);
    cr_expect(fabs(fd - dl[i]) <= 2e-4 + 1e-3 * fabs(fd), "score %d pre %d k %d: d_logits[%lld] = %.7g, finite difference %.7g",
              (int)o.score, o.pre_softmax, k, (long long)i, (double)dl[i], fd);
  }
  free(x); free(w); free(c); free(dl); free(idx); free(idx2);
}

Test(router, backward_matches_finite_differences) {
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  for (int k = 1; k <= 3; k++) {
    o.topk = k;
    o.score = TW_ROUTER_SOFTMAX; o.pre_softmax = 0; o.scaling_factor = 1.5f;
    check_fd(o, 3, 6, 11 + k);
    o.pre_softmax = 1;
    check_fd(o, 3, 6, 21 + k);
    o.score = TW_ROUTER_SIGMOID; o.pre_softmax = 0;
    check_fd(o, 3, 6, 31 + k);
  }
}

Test(router, aux_loss_bwd_matches_finite_differences) {
  int64_t T = 4, E = 5;
  float x[20], dl[20], loss[2];
  int32_t cnt[5] = {3, 0, 2, 1, 2};
  tt_fill_uniform_f32(x, T * E, 5, -2, 2);
  tw_tensor tx = tw_tensor_2d(x, TW_F32, T, E, TW_MEM_HOST), tc = tw_tensor_1d(cnt, TW_I32, E, TW_MEM_HOST);
  tw_tensor tdl = tw_tensor_2d(dl, TW_F32, T, E, TW_MEM_HOST);
  for (int sc = 0; sc < 2; sc++) {
    tw_router_opts o = TW_ROUTER_OPTS_INIT;
    o.score = sc ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
    o.topk = 2;
    EXPECT_OK(tw_router_aux_loss_bwd(ctx, &tx, &o, &tc, 1.0f, 1.0f, &tdl));
    for (int64_t i = 0; i < T * E; i++) {
      float x0 = x[i];
      for (int s = 0; s < 2; s++) {
        x[i] = x0 + (s ? -1e-2f : 1e-2f);
        tw_tensor tl = tw_tensor_1d(&loss[s], TW_F32, 1, TW_MEM_HOST);
        EXPECT_OK(tw_router_aux_loss(ctx, &tx, &o, &tc, 1.0f, &tl));
      }
      x[i] = x0;
      double fd = ((double)loss[0] - loss[1]) / (2 * (double)((x0 + 1e-2f) - x0));
      cr_expect(fabs(fd - dl[i]) <= 2e-4 + 1e-3 * fabs(fd), "score %d: aux d_logits[%lld] = %.7g, fd %.7g", sc,
                (long long)i, (double)dl[i], fd);
    }
  }
}

/* ---- documented behaviour ---------------------------------------------------------------- */

Test(router, ties_break_to_lower_expert_id_in_score_order) {
  float x[2 * 5] = {1, 1, 1, 1, 1, /**/ 0, 2, 1, 2, 2};
  int32_t idx[6], cnt[5];
  float w[6];
  tw_tensor tx = tw_tensor_2d(x, TW_F32, 2, 5, TW_MEM_HOST), ti = tw_tensor_2d(idx, TW_I32, 2, 3, TW_MEM_HOST);
  tw_tensor tw_ = tw_tensor_2d(w, TW_F32, 2, 3, TW_MEM_HOST), tc = tw_tensor_1d(cnt, TW_I32, 5, TW_MEM_HOST);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.topk = 3;
  EXPECT_OK(tw_router_fwd(ctx, &tx, &o, &ti, &tw_, &tc));
  int32_t want[6] = {0, 1, 2, 1, 3, 4}, want_cnt[5] = {1, 2, 1, 1, 1};
  cr_expect_arr_eq(idx, want, sizeof want);
  cr_expect_arr_eq(cnt, want_cnt, sizeof want_cnt);
  for (int j = 0; j < 3; j++) cr_expect_float_eq(w[j], 1.0f / 3.0f, 1e-7);
}

Test(router, zero_tokens_is_valid_and_counts_are_zero) {
  int32_t cnt[4] = {9, 9, 9, 9};
  tw_tensor tx = tw_tensor_2d(NULL, TW_F32, 0, 4, TW_MEM_HOST), ti = tw_tensor_2d(NULL, TW_I32, 0, 2, TW_MEM_HOST);
  tw_tensor tw_ = tw_tensor_2d(NULL, TW_F32, 0, 2, TW_MEM_HOST), tc = tw_tensor_1d(cnt, TW_I32, 4, TW_MEM_HOST);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.topk = 2;
  EXPECT_OK(tw_router_fwd(ctx, &tx, &o, &ti, &tw_, &tc));
  for (int e = 0; e < 4; e++) cr_expect_eq(cnt[e], 0);
}

Test(router, expert_bias_steers_selection_only) {
  /* the bias moves expert 3 into the top-1, but its weight is its own sigmoid */
  float x[4] = {2, 1, 0, -1}, bias[4] = {0, 0, 0, 5}, w;
  int32_t idx;
  tw_tensor tx = tw_tensor_2d(x, TW_F32, 1, 4, TW_MEM_HOST), ti = tw_tensor_2d(&idx, TW_I32, 1, 1, TW_MEM_HOST);
  tw_tensor tw_ = tw_tensor_2d(&w, TW_F32, 1, 1, TW_MEM_HOST), none = tw_tensor_none();
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.score = TW_ROUTER_SIGMOID;
  o.expert_bias = tw_tensor_1d(bias, TW_F32, 4, TW_MEM_HOST);
  EXPECT_OK(tw_router_fwd(ctx, &tx, &o, &ti, &tw_, &none));
  cr_expect_eq(idx, 3);
  cr_expect_float_eq(w, (float)(1.0 / (1.0 + exp(1.0))), 1e-7);
}

/* ---- errors ---------------------------------------------------------------------------- */

typedef struct {
  float x[4 * 8];
  int32_t idx[4 * 2], cnt[8];
  float w[4 * 2], dw[4 * 2], dl[4 * 8], bias[8];
  tw_tensor tx, ti, tw_, tc, tdw, tdl;
  tw_router_opts o;
} fixture;

static void fixture_init(fixture *f) {
  memset(f, 0, sizeof *f);
  tt_fill_uniform_f32(f->x, 32, 3, -1, 1);
  f->tx = tw_tensor_2d(f->x, TW_F32, 4, 8, TW_MEM_HOST);
  f->ti = tw_tensor_2d(f->idx, TW_I32, 4, 2, TW_MEM_HOST);
  f->tw_ = tw_tensor_2d(f->w, TW_F32, 4, 2, TW_MEM_HOST);
  f->tc = tw_tensor_1d(f->cnt, TW_I32, 8, TW_MEM_HOST);
  f->tdw = tw_tensor_2d(f->dw, TW_F32, 4, 2, TW_MEM_HOST);
  f->tdl = tw_tensor_2d(f->dl, TW_F32, 4, 8, TW_MEM_HOST);
  f->o = (tw_router_opts)TW_ROUTER_OPTS_INIT;
  f->o.topk = 2;
  EXPECT_OK(tw_router_fwd(ctx, &f->tx, &f->o, &f->ti, &f->tw_, &f->tc));
  EXPECT_OK(tw_router_bwd(ctx, &f->tx, &f->o, &f->ti, &f->tdw, &f->tdl));
}

#define FWD(f) tw_router_fwd(ctx, &(f).tx, &(f).o, &(f).ti, &(f).tw_, &(f).tc)

Test(router, error_topk_zero_or_above_E) {
  fixture f;
  fixture_init(&f);
  f.o.topk = 0;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "topk = 0 must be in [1, E = 8]");
  f.o.topk = 9;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "topk = 9 must be in [1, E = 8]");
}

Test(router, error_groups) {
  fixture f;
  fixture_init(&f);
  f.o.num_groups = 3;
  f.o.group_topk = 1;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "num_groups = 3 does not divide E = 8");
  f.o.num_groups = 4;
  f.o.group_topk = 5;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "group_topk = 5 must be in [1, num_groups = 4]");
  f.o.group_topk = 0;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "group_topk = 0");
  f.o.group_topk = 3; /* 2 / 3 = 0 experts per group */
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "topk / group_topk = 2 / 3 = 0");
  f.o.num_groups = -1;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "num_groups = -1");
}

Test(router, error_bias) {
  fixture f;
  fixture_init(&f);
  f.o.expert_bias = tw_tensor_1d(f.bias, TW_F32, 8, TW_MEM_HOST);
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "expert_bias applies to the sigmoid score only");
  f.o.score = TW_ROUTER_SIGMOID;
  f.o.expert_bias = tw_tensor_1d(f.bias, TW_F32, 7, TW_MEM_HOST);
  EXPECT_ERR(FWD(f), TW_ERR_SHAPE, "expert_bias is [7] f32, expected [8] f32");
  f.o.expert_bias = tw_tensor_1d(f.bias, TW_I32, 8, TW_MEM_HOST);
  EXPECT_ERR(FWD(f), TW_ERR_DTYPE, "expert_bias is i32");
}

Test(router, error_opts) {
  fixture f;
  fixture_init(&f);
  f.o.score = (tw_router_score)7;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "unknown score function 7");
  f.o.score = TW_ROUTER_SIGMOID;
  f.o.pre_softmax = 1;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "pre_softmax");
  f.o.pre_softmax = 0;
  f.o.scaling_factor = NAN;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "scaling_factor is nan");
  EXPECT_ERR(tw_router_fwd(ctx, &f.tx, NULL, &f.ti, &f.tw_, &f.tc), TW_ERR_NULL, "opts is NULL");
  EXPECT_ERR(tw_router_fwd(NULL, &f.tx, &f.o, &f.ti, &f.tw_, &f.tc), TW_ERR_NULL, "ctx is NULL");
}

Test(router, error_nan_logit_named) {
  fixture f;
  fixture_init(&f);
  f.x[2 * 8 + 5] = NAN;
  EXPECT_ERR(FWD(f), TW_ERR_INVALID_ARG, "logits[2, 5] is NaN");
}

Test(router, error_shapes_and_dtypes) {
  fixture f;
  fixture_init(&f);
  tw_tensor bad = tw_tensor_2d(f.idx, TW_I32, 4, 3, TW_MEM_HOST);
  EXPECT_ERR(tw_router_fwd(ctx, &f.tx, &f.o, &bad, &f.tw_, &f.tc), TW_ERR_SHAPE, "topk_idx is [4, 3] i32, expected [4, 2]");
  bad = tw_tensor_2d(f.w, TW_BF16, 4, 2, TW_MEM_HOST);
  EXPECT_ERR(tw_router_fwd(ctx, &f.tx, &f.o, &f.ti, &bad, &f.tc), TW_ERR_DTYPE, "topk_weights is bf16, expected f32");
  bad = tw_tensor_1d(f.cnt, TW_I32, 7, TW_MEM_HOST);
  EXPECT_ERR(tw_router_fwd(ctx, &f.tx, &f.o, &f.ti, &f.tw_, &bad), TW_ERR_SHAPE, "counts is [7] i32, expected [8]");
  bad = tw_tensor_2d(f.x, TW_F16, 4, 8, TW_MEM_HOST);
  EXPECT_ERR(tw_router_fwd(ctx, &bad, &f.o, &f.ti, &f.tw_, &f.tc), TW_ERR_DTYPE, "logits");
  bad = tw_tensor_2d(f.x, TW_F32, 4, 0, TW_MEM_HOST);
  EXPECT_ERR(tw_router_fwd(ctx, &bad, &f.o, &f.ti, &f.tw_, &f.tc), TW_ERR_SHAPE, "E = 0");
  bad = tw_tensor_2d(f.dl, TW_F32, 4, 7, TW_MEM_HOST);
  EXPECT_ERR(tw_router_bwd(ctx, &f.tx, &f.o, &f.ti, &f.tdw, &bad), TW_ERR_SHAPE, "d_logits is [4, 7] f32, expected [4, 8]");
}

Test(router, error_bwd_topk_idx_out_of_range_or_duplicate) {
  fixture f;
  fixture_init(&f);
  f.idx[3] = 8;
  EXPECT_ERR(tw_router_bwd(ctx, &f.tx, &f.o, &f.ti, &f.tdw, &f.tdl), TW_ERR_INVALID_ARG, "topk_idx[1, 1] = 8 is outside [0, E = 8)");
  f.idx[3] = -1;
  EXPECT_ERR(tw_router_bwd(ctx, &f.tx, &f.o, &f.ti, &f.tdw, &f.tdl), TW_ERR_INVALID_ARG, "topk_idx[1, 1] = -1");
  f.idx[3] = f.idx[2];
  EXPECT_ERR(tw_router_bwd(ctx, &f.tx, &f.o, &f.ti, &f.tdw, &f.tdl), TW_ERR_INVALID_ARG, "lists expert");
}

Test(router, error_aux_loss) {
  fixture f;
  fixture_init(&f);
  float loss[2];
  tw_tensor tl = tw_tensor_1d(loss, TW_F32, 2, TW_MEM_HOST);
  EXPECT_ERR(tw_router_aux_loss(ctx, &f.tx, &f.o, &f.tc, 1.0f, &tl), TW_ERR_SHAPE, "loss must be one f32");
  tl = tw_tensor_1d(loss, TW_F32, 1, TW_MEM_HOST);
  EXPECT_ERR(tw_router_aux_loss(ctx, &f.tx, &f.o, &f.tc, INFINITY, &tl), TW_ERR_INVALID_ARG, "coeff is inf");
  tw_tensor t0 = tw_tensor_2d(NULL, TW_F32, 0, 8, TW_MEM_HOST);
  EXPECT_ERR(tw_router_aux_loss(ctx, &t0, &f.o, &f.tc, 1.0f, &tl), TW_ERR_SHAPE, "T = 0");
  EXPECT_ERR(tw_router_aux_loss_bwd(ctx, &f.tx, &f.o, &f.tc, 1.0f, NAN, &f.tdl), TW_ERR_INVALID_ARG, "d_loss is nan");
}

/* A backend without a router (the gpu table today) is TW_ERR_UNSUPPORTED, named. */
#include "core/backend.h"
Test(router, backend_without_router_is_unsupported_and_named) {
  tw_backend_ops fake = tw_ref_ops;
  fake.name = "norouter";
  fake.router = NULL;
  struct tw_ctx fctx = *ctx;
  fctx.ops = &fake;
  float x[4] = {0};
  int32_t idx[1];
  float w[1];
  tw_tensor tx = tw_tensor_2d(x, TW_F32, 1, 4, TW_MEM_HOST), ti = tw_tensor_2d(idx, TW_I32, 1, 1, TW_MEM_HOST);
  tw_tensor tw_ = tw_tensor_2d(w, TW_F32, 1, 1, TW_MEM_HOST), none = tw_tensor_none();
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  EXPECT_ERR(tw_router_fwd(&fctx, &tx, &o, &ti, &tw_, &none), TW_ERR_UNSUPPORTED, "router: the norouter backend does not provide it");
}
