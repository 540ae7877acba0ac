/* gg_wgmma_fp8's accumulation model against adversarial fp8 codes (tw_gemm.h, "Subnormal
 * codes"): planted codes, per-tensor scales of 1, f32 out, so the result is the tensor core's
 * own sum. Each grid is checked against the promoted model's bound with the lifted magnitudes
 * (tw_fp8_lift_subnormal_codes), and prints what it measured (the probe behind the model):
 *   anchor grids: one fixed product (the anchor) next to every finite code pair, in one
 *     instruction (forward, K = 32) or as a 2-token wgrad group (m_g = 2, where the model's
 *     bound is tight: gamma(3) of the sum);
 *   random grids: codes drawn over chosen exponent ranges (subnormals often), dense or sparse.
 * Printed per grid: errors seen, the worst error relative to the largest actual product and to
 * the largest exponent-field product, and how many elements the unlifted model would fail. */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_base.h"
#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_quantize.h"

static tw_ctx *ctx;
static int sm90(void) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev)) {
    cudaGetLastError();
    return 0;
  }
  return major == 9 && minor == 0;
}

/* fp8 code -> value, and the power of two of its exponent field (subnormal and zero codes at
 * the minimum normal exponent); written here from the formats, not from twin's decoder */
static double dec(uint8_t c, tw_dtype t, double *field_pow) {
  int e4 = t == TW_E4M3;
  int mb = e4 ? 3 : 2, bias = e4 ? 7 : 15, emask = e4 ? 15 : 31;
  int e = (c >> mb) & emask, m = c & ((1 << mb) - 1), s = c >> 7;
  double v;
  if (e4 && e == 15 && m == 7) v = NAN;
  else if (!e4 && e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexp(m, 1 - bias - mb);
  else v = ldexp(1.0 + ldexp(m, -mb), e - bias);
  if (field_pow) *field_pow = ldexp(1.0, (e ? e : 1) - bias);
  return s ? -v : v;
}
static int finite_code(uint8_t c, tw_dtype t) { return isfinite(dec(c, t, NULL)); }
/* the lifted magnitude of a code (tw_check.h): max(|x|, 2^emin) for a nonzero code, else 0 */
static double lifted(uint8_t c, tw_dtype t) {
  double f, v = fabs(dec(c, t, &f));
  return v == 0 ? 0 : fmax(v, f);
}

/* A per-tensor (delayed, scale_inv 1) operand on the device holding `codes` as its rowwise
 * data [rows, cols] or its per-group transposed colwise data; G groups. */
typedef struct {
  tw_qtensor q;
  void *bufs[3];
} dev_q;
static void dev_q_make(dev_q *d, int64_t rows, int64_t cols, int64_t G, tw_dtype qt, int colwise,
                       const uint8_t *codes) {
  memset(d, 0, sizeof *d);
  tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
  qo.mode = TW_SCALE_TENSOR_DELAYED;
  qo.qdtype = qt;
  qo.layout = colwise ? TW_COLWISE : TW_ROWWISE;
  cr_assert_eq(tw_quantize_output_shapes(&qo, rows, cols, G, &d->q), TW_OK, "%s", tw_last_error());
  tw_tensor *data = colwise ? &d->q.col_data : &d->q.row_data;
  tw_tensor *scale = tw_tensor_is_none(&d->q.row_scale_inv) ? &d->q.col_scale_inv : &d->q.row_scale_inv;
  tw_tensor *parts[3] = {data, scale, &d->q.amax};
  for (int j = 0; j < 3; ++j) {
    if (tw_tensor_is_none(parts[j])) continue;
    parts[j]->mem = TW_MEM_DEVICE;
    cr_assert_eq(tw_alloc(ctx, tw_tensor_bytes(parts[j]) + 16, &parts[j]->data), TW_OK, "%s", tw_last_error());
    d->bufs[j] = parts[j]->data;
  }
  float *ones = malloc((size_t)G * 4);
  for (int64_t g = 0; g < G; ++g) ones[g] = 1.0f;
  cudaMemcpy(data->data, codes, (size_t)(rows * cols), cudaMemcpyHostToDevice);
  cudaMemcpy(scale->data, ones, (size_t)G * 4, cudaMemcpyHostToDevice);
  if (d->bufs[2]) cudaMemcpy(d->q.amax.data, ones, (size_t)G * 4, cudaMemcpyHostToDevice);
  free(ones);
  d->q.row_scale_inv = d->q.col_scale_inv = *scale; /* per-tensor: one buffer for both */
}
static void dev_q_free(dev_q *d) {
  for (int j = 0; j < 3; ++j)
    if (d->bufs[j]) tw_free(ctx, d->bufs[j]);
}

/* Checks got against exact with the promoted bound over contraction Kc (lifted sums absl),
 * counts the elements the unlifted sums (absp) would fail; prints one line. */
typedef struct {
  const char *name;
  double worst_act, worst_field; /* max err / largest actual product, / largest field product */
  int64_t n, nz, unlifted_fail;
} grid_stats;
static void check_grid(grid_stats *st, const float *got, const double *exact, const double *absp,
                       const double *absl, const double *maxprod, const double *maxfield, int64_t n, int64_t Kc) {
  double *bl = malloc((size_t)n * 8), *bu = malloc((size_t)n * 8);
  tw_gemm_error_bound_promoted(absl, exact, n, Kc, 128, 0x1p-13, 0x1p-24, 2, TW_F32, bl);
  tw_gemm_error_bound_promoted(absp, exact, n, Kc, 128, 0x1p-13, 0x1p-24, 2, TW_F32, bu);
  int64_t fail = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    double err = fabs((double)got[i] - exact[i]);
    if (err != 0) {
      ++st->nz;
      if (maxprod[i] > 0) st->worst_act = fmax(st->worst_act, err / maxprod[i]);
      if (maxfield[i] > 0) st->worst_field = fmax(st->worst_field, err / maxfield[i]);
    }
    if (err > bu[i]) ++st->unlifted_fail;
    if (!(err <= bl[i])) {
      if (first < 0) first = i;
      ++fail;
    }
  }
  st->n += n;
  printf("fp8_accum %-44s K=%-3lld %7lld elems, %6lld off exact | worst err: 2^%6.2f of the largest product, "
         "2^%6.2f of the largest field product | unlifted model fails %lld\n",
         st->name, (long long)Kc, (long long)n, (long long)st->nz, st->nz ? log2(st->worst_act) : -INFINITY,
         st->nz ? log2(st->worst_field) : -INFINITY, (long long)st->unlifted_fail);
  fflush(stdout);
  cr_expect_eq(fail, 0, "%s: %lld of %lld elements out of the lifted promoted bound (first: %lld, got %.9g exact %.9g "
               "bound %.3g)",
               st->name, (long long)fail, (long long)n, (long long)first, first >= 0 ? got[first] : 0.0,
               first >= 0 ? exact[first] : 0.0, first >= 0 ? bl[first] : 0.0);
  free(bl);
  free(bu);
}

/* ---- forward: out[M, N] = A[M, K] x B[N, K]^T, one group ------------------------------------ */
static void run_fwd(int64_t M, int64_t N, int64_t K, tw_dtype ta, tw_dtype tb, const uint8_t *A, const uint8_t *B,
                    float *out) {
  dev_q qa, qb;
  dev_q_make(&qa, M, K, 1, ta, 0, A);
  dev_q_make(&qb, N, K, 1, tb, 0, B);
  int32_t gsz = (int32_t)M;
  void *gsd, *od;
  cr_assert_eq(tw_alloc(ctx, 16, &gsd), TW_OK);
  cr_assert_eq(tw_alloc(ctx, (size_t)(M * N * 4), &od), TW_OK);
  cudaMemcpy(gsd, &gsz, 4, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize(); /* a pageable upload may still be landing; the GEMM runs on another stream */
  tw_tensor gs = tw_tensor_1d(gsd, TW_I32, 1, TW_MEM_DEVICE);
  tw_tensor o = tw_tensor_2d(od, TW_F32, M, N, TW_MEM_DEVICE);
  tw_operand l = tw_operand_rowwise(&qa.q), r = tw_operand_rowwise(&qb.q);
  cr_assert_eq(tw_grouped_gemm(ctx, &l, &r, TW_OP_T, &gs, &o, 0), TW_OK, "gemm: %s", tw_last_error());
  cr_assert_eq(tw_ctx_check(ctx), TW_OK, "%s", tw_last_error());
  cudaMemcpy(out, od, (size_t)(M * N * 4), cudaMemcpyDeviceToHost);
  tw_free(ctx, gsd);
  tw_free(ctx, od);
  dev_q_free(&qa);
  dev_q_free(&qb);
}

/* exact, sums and maxima of out[i, j] = sum_k A[i, k] B[j, k] */
static void host_sums(int64_t M, int64_t N, int64_t K, tw_dtype ta, tw_dtype tb, const uint8_t *A, const uint8_t *B,
                      double *ex, double *absp, double *absl, double *maxp, double *maxf) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double e = 0, s = 0, sl = 0, mp = 0, mf = 0;
      for (int64_t k = 0; k < K; ++k) {
        uint8_t ca = A[i * K + k], cb = B[j * K + k];
        double fa, fb, p = dec(ca, ta, &fa) * dec(cb, tb, &fb);
        e += p;
        s += fabs(p);
        sl += lifted(ca, ta) * lifted(cb, tb);
        mp = fmax(mp, fabs(p));
        if (p != 0 || (lifted(ca, ta) != 0 && lifted(cb, tb) != 0)) mf = fmax(mf, fa * fb);
      }
      ex[i * N + j] = e;
      absp[i * N + j] = s;
      absl[i * N + j] = sl;
      maxp[i * N + j] = mp;
      maxf[i * N + j] = mf;
    }
}

static void fwd_grid(const char *name, int64_t K, tw_dtype ta, tw_dtype tb, const uint8_t *A, const uint8_t *B) {
  const int64_t M = 256, N = 256, n = M * N;
  float *out = malloc((size_t)n * 4);
  double *ex = malloc((size_t)n * 8), *ab = malloc((size_t)n * 8), *al = malloc((size_t)n * 8);
  double *mp = malloc((size_t)n * 8), *mf = malloc((size_t)n * 8);
  run_fwd(M, N, K, ta, tb, A, B, out);
  host_sums(M, N, K, ta, tb, A, B, ex, ab, al, mp, mf);
  grid_stats st = {name, 0, 0, 0, 0, 0};
  check_grid(&st, out, ex, ab, al, mp, mf, n, K);
  free(out); free(ex); free(ab); free(al); free(mp); free(mf);
}

/* forward anchor grid: k = 0 the anchor (ca, cb) in every row / column, k = at every finite
 * code (row i: code i, column j: code j), the rest zeros */
static void fwd_anchor(const char *name, tw_dtype ta, tw_dtype tb, uint8_t ca, uint8_t cb, int64_t at, int64_t K) {
  const int64_t M = 256, N = 256;
  uint8_t *A = calloc((size_t)(M * K), 1), *B = calloc((size_t)(N * K), 1);
  for (int64_t i = 0; i < M; ++i) {
    A[i * K] = ca;
    A[i * K + at] = finite_code((uint8_t)i, ta) ? (uint8_t)i : 0;
  }
  for (int64_t j = 0; j < N; ++j) {
    B[j * K] = cb;
    B[j * K + at] = finite_code((uint8_t)j, tb) ? (uint8_t)j : 0;
  }
  char nm[96];
  snprintf(nm, sizeof nm, "fwd anchor %s, pair at k=%lld", name, (long long)at);
  fwd_grid(nm, K, ta, tb, A, B);
  free(A);
  free(B);
}

static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return rs;
}
/* a finite code with exponent field 0..emax; zeros: 1 a quarter zeros, 2 sparse (11 of 12) */
static uint8_t rnd_code(tw_dtype t, int emax, int zeros) {
  int mb = t == TW_E4M3 ? 3 : 2;
  uint8_t c;
  do {
    int e = (int)(rnd() % (uint64_t)(emax + 1));
    c = (uint8_t)((e << mb) | (int)(rnd() & ((1u << mb) - 1)) | (int)((rnd() & 1) << 7));
    if (zeros == 1 ? rnd() % 4 == 0 : zeros == 2 ? rnd() % 12 != 0 : 0) c = 0;
  } while (!finite_code(c, t));
  return c;
}
static void fwd_random(const char *name, tw_dtype ta, tw_dtype tb, int64_t K, int emax_a, int emax_b, int zeros) {
  const int64_t M = 256, N = 256;
  uint8_t *A = malloc((size_t)(M * K)), *B = malloc((size_t)(N * K));
  for (int64_t i = 0; i < M * K; ++i) A[i] = rnd_code(ta, emax_a, zeros);
  for (int64_t i = 0; i < N * K; ++i) B[i] = rnd_code(tb, emax_b, zeros);
  char nm[96];
  snprintf(nm, sizeof nm, "fwd random %s", name);
  fwd_grid(nm, K, ta, tb, A, B);
  free(A);
  free(B);
}

/* ---- wgrad: out[g] = lhs_g^T rhs_g over the group's tokens, G groups of m tokens ------------ */
/* Tokens given as lhs [G*m, K] and rhs [G*m, N] codes (source orientation); stored as the
 * per-group transposed colwise copies (ops T). */
static void wgrad_grid(const char *name, int64_t G, int64_t m, int64_t K, int64_t N, tw_dtype ta, tw_dtype tb,
                       const uint8_t *L, const uint8_t *R) {
  const int64_t M = G * m, n = G * K * N;
  uint8_t *Lt = malloc((size_t)(M * K)), *Rt = malloc((size_t)(M * N));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t k = 0; k < K; ++k) Lt[g * m * K + k * m + r] = L[(g * m + r) * K + k];
      for (int64_t j = 0; j < N; ++j) Rt[g * m * N + j * m + r] = R[(g * m + r) * N + j];
    }
  dev_q ql, qr;
  dev_q_make(&ql, M, K, G, ta, 1, Lt);
  dev_q_make(&qr, M, N, G, tb, 1, Rt);
  int32_t *gsz = malloc((size_t)G * 4);
  for (int64_t g = 0; g < G; ++g) gsz[g] = (int32_t)m;
  void *gsd, *od;
  cr_assert_eq(tw_alloc(ctx, (size_t)G * 4 + 16, &gsd), TW_OK);
  cr_assert_eq(tw_alloc(ctx, (size_t)n * 4, &od), TW_OK);
  cudaMemcpy(gsd, gsz, (size_t)G * 4, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize(); /* as above */
  tw_tensor gs = tw_tensor_1d(gsd, TW_I32, G, TW_MEM_DEVICE);
  tw_tensor o = tw_tensor_3d(od, TW_F32, G, K, N, TW_MEM_DEVICE);
  tw_operand l = tw_operand_colwise(&ql.q), r = tw_operand_colwise(&qr.q);
  cr_assert_eq(tw_grouped_gemm_wgrad(ctx, &l, TW_OP_T, &r, TW_OP_T, &gs, &o, 0), TW_OK, "wgrad: %s", tw_last_error());
  cr_assert_eq(tw_ctx_check(ctx), TW_OK, "%s", tw_last_error());
  float *out = malloc((size_t)n * 4);
  cudaMemcpy(out, od, (size_t)n * 4, cudaMemcpyDeviceToHost);
  /* host sums per group: A = lhs_g^T [K, m], B = rhs_g^T [N, m]: the transposed blocks */
  double *ex = malloc((size_t)n * 8), *ab = malloc((size_t)n * 8), *al = malloc((size_t)n * 8);
  double *mp = malloc((size_t)n * 8), *mf = malloc((size_t)n * 8);
  for (int64_t g = 0; g < G; ++g)
    host_sums(K, N, m, ta, tb, Lt + g * m * K, Rt + g * m * N, ex + g * K * N, ab + g * K * N, al + g * K * N,
              mp + g * K * N, mf + g * K * N);
  grid_stats st = {name, 0, 0, 0, 0, 0};
  check_grid(&st, out, ex, ab, al, mp, mf, n, m);
  free(out); free(ex); free(ab); free(al); free(mp); free(mf); free(gsz); free(Lt); free(Rt);
  tw_free(ctx, gsd);
  tw_free(ctx, od);
  dev_q_free(&ql);
  dev_q_free(&qr);
}

/* 2-token groups: token 0 the anchor (ca in every lhs column, cb in every rhs column), token 1
 * every finite code pair (lhs column k: code k, rhs column j: code j); one group per anchor. */
static void wgrad_anchors(const char *name, tw_dtype ta, tw_dtype tb, const uint8_t (*anchors)[2], int64_t G) {
  const int64_t K = 256, N = 256, m = 2;
  uint8_t *L = malloc((size_t)(G * m * K)), *R = malloc((size_t)(G * m * N));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t k = 0; k < K; ++k) {
      L[(g * m) * K + k] = anchors[g][0];
      L[(g * m + 1) * K + k] = finite_code((uint8_t)k, ta) ? (uint8_t)k : 0;
    }
    for (int64_t j = 0; j < N; ++j) {
      R[(g * m) * N + j] = anchors[g][1];
      R[(g * m + 1) * N + j] = finite_code((uint8_t)j, tb) ? (uint8_t)j : 0;
    }
  }
  wgrad_grid(name, G, m, K, N, ta, tb, L, R);
  free(L);
  free(R);
}
static void wgrad_random(const char *name, tw_dtype ta, tw_dtype tb, int64_t G, int64_t m, int emax_a, int emax_b,
                         int zeros) {
  const int64_t K = 128, N = 128;
  uint8_t *L = malloc((size_t)(G * m * K)), *R = malloc((size_t)(G * m * N));
  for (int64_t i = 0; i < G * m * K; ++i) L[i] = rnd_code(ta, emax_a, zeros);
  for (int64_t i = 0; i < G * m * N; ++i) R[i] = rnd_code(tb, emax_b, zeros);
  wgrad_grid(name, G, m, K, N, ta, tb, L, R);
  free(L);
  free(R);
}

static const tw_dtype E4 = TW_E4M3, E5 = TW_E5M2;

static int setup_ctx(void) {
  if (!sm90()) return 0;
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  c.backend = TW_BACKEND_GPU;
  c.kernel = "gg_wgmma_fp8";
  cr_assert_eq(tw_ctx_create(&ctx, &c), TW_OK, "%s", tw_last_error());
  return 1;
}

/* One product next to every other, in one 32-deep instruction and across two. */
Test(fp8_accum_gpu, forward_anchor_grids, .timeout = 300) {
  if (!setup_ctx()) cr_skip_test("needs an sm_90 GPU (gg_wgmma_fp8)");
  fwd_anchor("e4m3 1 x 1", E4, E4, 0x38, 0x38, 1, 32);
  fwd_anchor("e4m3 448 x 448", E4, E4, 0x7E, 0x7E, 1, 32);
  fwd_anchor("e4m3 2^-6 x 1 (min normal)", E4, E4, 0x08, 0x38, 1, 32);
  fwd_anchor("e4m3 2^-9 x 1 (min subnormal)", E4, E4, 0x01, 0x38, 1, 32);
  fwd_anchor("e4m3 2^-9 x 448", E4, E4, 0x01, 0x7E, 1, 32);
  fwd_anchor("e4m3 2^-9 x 448", E4, E4, 0x01, 0x7E, 17, 32);
  fwd_anchor("e4m3 2^-9 x 448", E4, E4, 0x01, 0x7E, 33, 64);
  fwd_anchor("e4m3 0 x 448 (zero code)", E4, E4, 0x00, 0x7E, 1, 32);
  fwd_anchor("e4m3 2^-6 x 2^-6", E4, E4, 0x08, 0x08, 1, 32);
  fwd_anchor("e4m3 2^-9 x 2^-9", E4, E4, 0x01, 0x01, 1, 32);
  fwd_anchor("e5m2 x e4m3 2^-16 x 448", E5, E4, 0x01, 0x7E, 1, 32);
  fwd_anchor("e5m2 x e4m3 0 x 448 (zero code)", E5, E4, 0x00, 0x7E, 1, 32);
  fwd_anchor("e4m3 x e5m2 2^-9 x 1", E4, E5, 0x01, 0x3C, 1, 32);
  tw_ctx_destroy(ctx);
}

Test(fp8_accum_gpu, forward_random_grids, .timeout = 300) {
  if (!setup_ctx()) cr_skip_test("needs an sm_90 GPU (gg_wgmma_fp8)");
  fwd_random("e4m3 all exponents", E4, E4, 32, 15, 15, 0);
  fwd_random("e4m3 all exponents", E4, E4, 128, 15, 15, 0);
  fwd_random("e4m3 exponents 0..3", E4, E4, 128, 3, 3, 0);
  fwd_random("e4m3 exponents 0..3", E4, E4, 512, 3, 3, 0);
  fwd_random("e4m3 exponents 0..3, zeros", E4, E4, 128, 3, 3, 1);
  fwd_random("e4m3 a 0..3, b all", E4, E4, 128, 3, 15, 0);
  fwd_random("e5m2 x e4m3 0..4 / 0..3", E5, E4, 128, 4, 3, 0);
  fwd_random("e5m2 x e4m3 all exponents", E5, E4, 128, 30, 15, 0);
  fwd_random("e4m3 sparse a 0..2, b all", E4, E4, 32, 2, 15, 2);
  fwd_random("e4m3 sparse a 0..2, b all", E4, E4, 128, 2, 15, 2);
  fwd_random("e5m2 x e4m3 sparse 0..3, all", E5, E4, 32, 3, 15, 2);
  tw_ctx_destroy(ctx);
}

/* 2-token wgrad groups: where the model's bound is tight and the unlifted one fails. */
Test(fp8_accum_gpu, wgrad_anchor_grids, .timeout = 300) {
  if (!setup_ctx()) cr_skip_test("needs an sm_90 GPU (gg_wgmma_fp8)");
  static const uint8_t e4e4[][2] = {{0x38, 0x38}, {0x7E, 0x7E}, {0x08, 0x38}, {0x07, 0x38}, {0x01, 0x38},
                                    {0x01, 0x7E}, {0x07, 0x7E}, {0x00, 0x7E}, {0x08, 0x08}, {0x01, 0x01}};
  static const uint8_t e5e4[][2] = {{0x3C, 0x38}, {0x01, 0x38}, {0x01, 0x7E}, {0x03, 0x7E}, {0x00, 0x7E}};
  static const uint8_t e4e5[][2] = {{0x38, 0x3C}, {0x01, 0x3C}, {0x7E, 0x01}, {0x01, 0x7B}};
  wgrad_anchors("wgrad anchors e4m3 x e4m3 (10 groups)", E4, E4, e4e4, 10);
  wgrad_anchors("wgrad anchors e5m2 x e4m3 (5 groups)", E5, E4, e5e4, 5);
  wgrad_anchors("wgrad anchors e4m3 x e5m2 (4 groups)", E4, E5, e4e5, 4);
  tw_ctx_destroy(ctx);
}

Test(fp8_accum_gpu, wgrad_random_small_groups, .timeout = 300) {
  if (!setup_ctx()) cr_skip_test("needs an sm_90 GPU (gg_wgmma_fp8)");
  wgrad_random("wgrad random e4m3 m=2 exponents 0..3 / all", E4, E4, 64, 2, 3, 15, 0);
  wgrad_random("wgrad random e4m3 m=3 all exponents", E4, E4, 64, 3, 15, 15, 0);
  wgrad_random("wgrad random e4m3 m=4 exponents 0..2 / all", E4, E4, 64, 4, 2, 15, 0);
  wgrad_random("wgrad random e5m2 x e4m3 m=2 0..3 / all", E5, E4, 64, 2, 3, 15, 0);
  wgrad_random("wgrad random e4m3 m=16 sparse 0..2 / all", E4, E4, 32, 16, 2, 15, 2);
  wgrad_random("wgrad random e4m3 m=40 0..3 / 0..3", E4, E4, 16, 40, 3, 3, 0);
  tw_ctx_destroy(ctx);
}
