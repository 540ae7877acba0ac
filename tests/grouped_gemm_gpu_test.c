/* Grouped GEMM, gpu vs ref: >= 500 seeded random cases per operation (forward ragged M and
 * wgrad ragged K), every dtype and scaling mode, skewed and zero group sizes, tail rows, both
 * kernel versions; plus the device error word for bad sizes.
 *
 * Bound (tw_check.h): expected = the ref backend's output, and each element may differ by the
 * sum of both backends' bounds, tw_gemm_error_bound(|a||b| (+|init|), exact, K + 4, u_acc):
 *   ref: OpenBLAS sgemm, f32 FMA accumulation, u_acc = 2^-24.
 *   gpu: mma.sync with f32 accumulators. The tensor core's f32 accumulation is not specified
 *        as round-to-nearest (it may truncate while aligning addends), so u_acc = 2^-23, one
 *        f32 ulp per addition instead of half; the gg_fma version is RNE and meets it too.
 *   K + 4: the fp8 scales add up to four f32 roundings per product (the dequantized operands
 *        on ref, sa*sb and the promotion FMA on gpu), each at most u relative to |a||b|.
 * fp8 forward on gg_wgmma_fp8 (forced, or auto on an sm_90 device, where auto picks it for the
 *   fp8 cases it takes): the gpu side's bound is its accumulation model instead (tw_gemm.h:
 *   blocks of L along K summed with 2^-13 per add, promoted in f32; L = 128, or 32 for MXFP8),
 *   tw_gemm_error_bound_promoted(.., K, L, 2^-13, 2^-24, 2, ..) over the lifted magnitudes
 *   (subnormal codes at the smallest normal, tw_fp8_lift_subnormal_codes; both sides take them
 *   there); the ref side as above.
 *   gg_wgmma_fp8_bound_catches_planted_scales shows that bound is not vacuous.
 * Elements an operation must not write (rows past the groups) have bound -1: bit-equal.
 * Empty wgrad groups have bound -1 too: out[g] must be exactly 0 (or untouched). */
#include <cblas.h>
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_base.h"
#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

/* ---- helpers (host tensors, random data, device copies) --------------------------------- */
static uint64_t rng_s;
static uint64_t rnd(void) {
  uint64_t z = (rng_s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double unif(void) { return (rnd() >> 11) * (1.0 / 9007199254740992.0); }
static int64_t irange(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }
/* log-uniform in [1, hi] */
static int64_t logdim(int64_t hi) {
  int64_t v = (int64_t)floor(exp(unif() * log((double)hi + 1)));
  return v < 1 ? 1 : v > hi ? hi : v;
}

static tw_tensor host_new(tw_dtype t, int ndim, const int64_t *shape) {
  tw_tensor x = tw_tensor_none();
  x.dtype = t;
  x.ndim = ndim;
  for (int i = 0; i < ndim; ++i) x.shape[i] = shape[i];
  x.mem = TW_MEM_HOST;
  size_t b = tw_tensor_bytes(&x);
  x.data = malloc(b ? b : 1);
  memset(x.data, TW_POISON_BYTE, b);
  return x;
}
static void host_free(tw_tensor *x) {
  if (!tw_tensor_is_none(x)) free(x->data);
  x->data = NULL;
}

static tw_ctx *ref_ctx, *gpu_ctx;
/* fp8 forward cases get gg_wgmma_fp8's bound (its accumulation model) when it may run them */
static int fp8_fast_bound;
static int device_is_sm90(void) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major == 9 && minor == 0;
}
static void ctx_for(const char *kernel) {
  fp8_fast_bound = kernel ? strcmp(kernel, "gg_wgmma_fp8") == 0 : device_is_sm90();
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ref_ctx, &c), TW_OK, "ref ctx: %s", tw_last_error());
  c.backend = TW_BACKEND_GPU;
  c.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&gpu_ctx, &c), TW_OK, "gpu ctx: %s", tw_last_error());
}
static void ctx_done(void) {
  tw_ctx_destroy(gpu_ctx);
  tw_ctx_destroy(ref_ctx);
  gpu_ctx = ref_ctx = NULL;
}

static tw_tensor dev_copy(const tw_tensor *h) {
  tw_tensor d = *h;
  if (tw_tensor_is_none(h)) return d;
  d.mem = TW_MEM_DEVICE;
  d.data = NULL;
  size_t b = tw_tensor_bytes(h);
  cr_assert_eq(tw_alloc(gpu_ctx, b ? b : 16, &d.data), TW_OK, "%s", tw_last_error());
  if (b) cr_assert_eq(tw_tensor_copy(gpu_ctx, &d, h), TW_OK, "%s", tw_last_error());
  return d;
}
static void dev_free(tw_tensor *d) {
  if (!tw_tensor_is_none(d) && d->data) tw_free(gpu_ctx, d->data);
  d->data = NULL;
}
static void to_host(tw_tensor *h, const tw_tensor *d) {
  cr_assert_eq(tw_tensor_copy(gpu_ctx, h, d), TW_OK, "%s", tw_last_error());
}

/* Random values with row magnitudes spread over 2^-6..2^6 (exercises per-block scales). */
static void fill_random(tw_tensor *x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    double mag = ldexp(1.0, (int)irange(-6, 6));
    for (int64_t c = 0; c < cols; ++c)
      tw_store_from_f64(x->data, x->dtype, r * cols + c, (2 * unif() - 1) * mag, 1);
  }
}

/* group sizes: skewed (one heavy group), zeros, uniform-ish; sum <= M. */
static void random_groups(int64_t G, int64_t M, int32_t *gs) {
  int style = (int)irange(0, 3);
  int64_t S = style == 3 ? M : irange(0, M);
  for (int64_t g = 0; g < G; ++g) gs[g] = 0;
  if (style == 0) { /* uniform random split */
    for (int64_t i = 0; i < S; ++i) gs[rnd() % G]++;
  } else if (style == 1) { /* one heavy group, others small or empty */
    int64_t heavy = irange(0, G - 1), left = S;
    for (int64_t g = 0; g < G && left > 0; ++g) {
      if (g == heavy) continue;
      int64_t v = unif() < 0.5 ? 0 : irange(0, left / (G + 1) + 1);
      if (v > left) v = left;
      gs[g] = (int32_t)v;
      left -= v;
    }
    gs[heavy] += (int32_t)left;
  } else { /* chunks, many empty groups */
    int64_t left = S;
    while (left > 0) {
      int64_t v = irange(1, left);
      gs[rnd() % G] += (int32_t)v;
      left -= v;
    }
  }
}

/* fp8_mode_count = 2: per-tensor scales only (the modes gg_mma_wide takes itself) */
static int fp8_mode_count = 5;
/* fp8_only_mxfp8: every fp8 forward case MXFP8 (the forced gg_wgmma_fp8 MXFP8 tails set) */
static int fp8_only_mxfp8;
/* fp8_mx_colwise (with fp8_wgmma_dims): the MXFP8 rhs is the colwise data of its [G*K, N] source,
 * op N (the MoE fp8_mxfp8 weights); where gg_wgmma_fp8 runs it (fp8_fast_bound) the output must
 * also be bit-identical to the call with the rowwise operand of the transposed source [G*N, K],
 * op T; every 4th case passes the rhs codes at an odd address (the pad pass reads them bytewise). */
static int fp8_mx_colwise;
static const tw_scaling fp8_modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_BLOCK_1x128,
                                       TW_SCALE_BLOCK_128x128, TW_SCALE_MXFP8_1D};

/* A quantized operand on both sides: the host qtensor (ref), device copy (gpu) and the f64
 * values of the orientation used, as the source [R, C]. */
typedef struct {
  tw_qtensor hq, dq;
  tw_operand h, d;
  double *vals;
  double *mags; /* lifted magnitudes (tw_fp8_lift_subnormal_codes): gg_wgmma_fp8's abs_prod */
  int colwise;
} qop;

static tw_tensor dev_none_or_copy(const tw_tensor *h) { return tw_tensor_is_none(h) ? *h : dev_copy(h); }

static void qop_make(qop *o, tw_scaling mode, tw_dtype qd, const tw_tensor *x, const tw_tensor *gs, int colwise) {
  memset(o, 0, sizeof *o);
  int64_t R = x->shape[0], C = x->shape[1], G = gs->shape[0];
  tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
  qo.mode = mode;
  qo.qdtype = qd;
  qo.layout = colwise ? TW_COLWISE : TW_ROWWISE;
  qo.pow2_scales = (int)(rnd() & 1);
  qo.mxfp8_swizzled = (int)(rnd() & 1);
  tw_tensor scale = tw_tensor_none();
  if (mode == TW_SCALE_TENSOR_DELAYED) {
    int64_t sh[1] = {G};
    scale = host_new(TW_F32, 1, sh);
    for (int64_t g = 0; g < G; ++g) ((float *)scale.data)[g] = (float)ldexp(1.0, (int)irange(0, 6));
    qo.scale = scale;
  }
  cr_assert_eq(tw_quantize_output_shapes(&qo, R, C, G, &o->hq), TW_OK, "%s", tw_last_error());
  tw_tensor *parts[5] = {&o->hq.row_data, &o->hq.row_scale_inv, &o->hq.col_data, &o->hq.col_scale_inv, &o->hq.amax};
  for (int i = 0; i < 5; ++i)
    if (!tw_tensor_is_none(parts[i])) *parts[i] = host_new(parts[i]->dtype, parts[i]->ndim, parts[i]->shape);
  cr_assert_eq(tw_grouped_quantize(ref_ctx, x, gs, &qo, &o->hq), TW_OK, "quantize: %s", tw_last_error());
  int64_t sh2[2] = {R, C};
  tw_tensor deq = host_new(TW_F32, 2, sh2);
  memset(deq.data, 0, tw_tensor_bytes(&deq));
  cr_assert_eq(tw_grouped_dequantize(ref_ctx, &o->hq, gs, colwise, &deq), TW_OK, "dequantize: %s", tw_last_error());
  o->vals = (double *)malloc((size_t)(R * C + 1) * sizeof(double));
  for (int64_t i = 0; i < R * C; ++i) o->vals[i] = ((float *)deq.data)[i];
  /* the same with subnormal codes dequantized as the smallest normal */
  tw_qtensor lifted = o->hq;
  tw_tensor *ld = colwise ? &lifted.col_data : &lifted.row_data;
  const tw_tensor *qdata = colwise ? &o->hq.col_data : &o->hq.row_data;
  *ld = host_new(qdata->dtype, qdata->ndim, qdata->shape);
  cr_assert_eq(tw_fp8_lift_subnormal_codes(qdata->data, tw_tensor_numel(qdata), qdata->dtype, ld->data), TW_OK, "%s",
               tw_last_error());
  memset(deq.data, 0, tw_tensor_bytes(&deq));
  cr_assert_eq(tw_grouped_dequantize(ref_ctx, &lifted, gs, colwise, &deq), TW_OK, "dequantize: %s", tw_last_error());
  host_free(ld);
  o->mags = (double *)malloc((size_t)(R * C + 1) * sizeof(double));
  for (int64_t i = 0; i < R * C; ++i) o->mags[i] = ((float *)deq.data)[i];
  host_free(&deq);
  host_free(&scale);
  o->dq = o->hq;
  tw_tensor *dparts[5] = {&o->dq.row_data, &o->dq.row_scale_inv, &o->dq.col_data, &o->dq.col_scale_inv, &o->dq.amax};
  for (int i = 0; i < 5; ++i) *dparts[i] = dev_none_or_copy(parts[i]);
  o->colwise = colwise;
  o->h = colwise ? tw_operand_colwise(&o->hq) : tw_operand_rowwise(&o->hq);
  o->d = colwise ? tw_operand_colwise(&o->dq) : tw_operand_rowwise(&o->dq);
}
static void qop_free(qop *o) {
  tw_tensor *h[5] = {&o->hq.row_data, &o->hq.row_scale_inv, &o->hq.col_data, &o->hq.col_scale_inv, &o->hq.amax};
  tw_tensor *d[5] = {&o->dq.row_data, &o->dq.row_scale_inv, &o->dq.col_data, &o->dq.col_scale_inv, &o->dq.amax};
  for (int i = 0; i < 5; ++i) {
    host_free(h[i]);
    dev_free(d[i]);
  }
  free(o->vals);
  free(o->mags);
}

/* Output init (accumulate) or poison, same on both sides. */
static void init_out(tw_tensor *o, int accumulate) {
  if (!accumulate) {
    memset(o->data, TW_POISON_BYTE, tw_tensor_bytes(o));
    return;
  }
  int64_t n = tw_tensor_numel(o);
  for (int64_t i = 0; i < n; ++i) tw_store_from_f64(o->data, o->dtype, i, 2 * unif() - 1, 1);
}

/* Failures are counted, not fatal, so one run shows every failing case (the first 8 in
 * full); each Test asserts at its end that none failed. */
static int n_cases, n_failed;
static void note_case(const char *what, const char *failure) {
  ++n_cases;
  if (!failure) return;
  if (++n_failed <= 8) cr_log_error("%s: %s", what, failure);
}
static void cases_done(const char *name) {
  cr_assert_eq(n_failed, 0, "%s: %d of %d cases failed (first ones above)", name, n_failed, n_cases);
  n_cases = n_failed = 0;
}

/* Runs the check; a failure is noted with the case. */
static void check_case(const char *what, const tw_tensor *got, const tw_tensor *expected, const double *bound) {
  int64_t n = tw_tensor_numel(got);
  tw_tensor bt = tw_tensor_1d((void *)bound, TW_F64, n, TW_MEM_HOST);
  tw_tensor g1 = tw_tensor_1d(got->data, got->dtype, n, TW_MEM_HOST);
  tw_tensor e1 = tw_tensor_1d(expected->data, expected->dtype, n, TW_MEM_HOST);
  tw_check_report rep;
  cr_assert_eq(tw_check_bound(&g1, &e1, &bt, &rep), TW_OK, "%s: check: %s", what, tw_last_error());
  char buf[512];
  note_case(what, rep.passed ? NULL : tw_check_format(&rep, buf, sizeof buf));
}

/* gg_wgmma_fp8's promotion interval along K for a scaling mode (tw_gemm.h): every MXFP8 block
 * of 32, else every 128 */
static int64_t promote_len(tw_scaling mode) { return mode == TW_SCALE_MXFP8_1D ? 32 : 128; }
/* bound = gpu bound + ref bound for a block of `count` elements with contraction Kc; fast: the
 * gpu side is gg_wgmma_fp8's promoted model (tw_gemm.h), promoted every `fast` along K. */
static void add_bounds_m(const double *absp, const double *exact, int64_t count, int64_t Kc, tw_dtype od, int64_t fast,
                         double *bound) {
  double *b2 = (double *)malloc((size_t)(count + 1) * sizeof(double));
  if (fast) tw_gemm_error_bound_promoted(absp, exact, count, Kc, fast, ldexp(1.0, -13), ldexp(1.0, -24), 2, od, bound);
  else tw_gemm_error_bound(absp, exact, count, Kc + 4, ldexp(1.0, -23), od, bound);
  tw_gemm_error_bound(absp, exact, count, Kc + 4, ldexp(1.0, -24), od, b2);
  for (int64_t i = 0; i < count; ++i) bound[i] += b2[i];
  free(b2);
}

/* f64 product C[m, n] (+)= A[m, k] B[k, n] given strides; Cabs (+)= sum |Am||Bm|, the
 * magnitudes the bound's model takes (A and B, or the lifted ones: same strides). */
static void dref(int64_t m, int64_t n, int64_t k, const double *A, const double *Am, int64_t as_m, int64_t as_k,
                 const double *B, const double *Bm, int64_t bs_k, int64_t bs_n, double *C, double *Cabs, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, sa = 0;
      for (int64_t p = 0; p < k; ++p) {
        s += A[i * as_m + p * as_k] * B[p * bs_k + j * bs_n];
        sa += fabs(Am[i * as_m + p * as_k] * Bm[p * bs_k + j * bs_n]);
      }
      C[i * ldc + j] += s;
      Cabs[i * ldc + j] += sa;
    }
}

static double *values_of(const tw_tensor *x) {
  int64_t n = tw_tensor_numel(x);
  double *v = (double *)malloc((size_t)(n + 1) * sizeof(double));
  for (int64_t i = 0; i < n; ++i) v[i] = tw_load_as_f64(x->data, x->dtype, i);
  return v;
}

static const tw_dtype out_types[] = {TW_F32, TW_BF16, TW_F16};
/* Shapes in multiples of 64 with groups of hundreds of rows: most tiles are interior, so the
 * gg_mma_wide fast loader (aligned, in-bounds tiles) runs next to its edge path. */
static int aligned_dims;
/* gg_lt_loop runs cuBLASLt, which writes f32 or the input dtype (no bf16 -> f16). */
static int lt_loop_outs;
/* gg_wgmma (TMA): K and N rounded up to multiples of 8 (16-byte rows); it declines others. */
static int tma_dims;
/* gg_wgmma_fp8: K rounded up to a multiple of 16 (16-byte fp8 rows), rhs stored [G, N, K] (op T) */
static int fp8_wgmma_dims;
static tw_dtype pick_out(tw_dtype in) {
  if (lt_loop_outs) return (rnd() & 1) ? TW_F32 : in;
  return out_types[rnd() % 3];
}

/* ---- forward ---------------------------------------------------------------------------- */
/* kind: 0 plain bf16, 1 plain f16, 2 plain f32 (or f32 x bf16), 3 fp8 */
static void fwd_case(uint64_t seed, int kind, int64_t budget) {
  rng_s = seed * 7919 + 17;
  int64_t G = unif() < 0.3 ? irange(1, 4) : logdim(256);
  int64_t M = logdim(8192), N = logdim(8192), K = logdim(8192);
  while (M * N * K > budget || G * K * N > budget) {
    if (M >= N && M >= K) M = (M + 1) / 2;
    else if (N >= K) N = (N + 1) / 2;
    else K = (K + 1) / 2;
  }
  if (unif() < 0.2) M = 0 + irange(0, 3); /* tiny or empty lhs */
  if (aligned_dims) {
    N = 64 * irange(1, 6);
    K = 64 * irange(1, 6);
    if (G > 16) G = irange(1, 16);
    M = irange(0, 4 * budget / (N * K));
  }
  if (tma_dims) {
    K = (K + 7) / 8 * 8;
    N = (N + 7) / 8 * 8;
  }
  if (fp8_wgmma_dims) K = (K + 15) / 16 * 16;
  tw_op rhs_op = (tw_op)(rnd() & 1);
  tw_dtype od = pick_out(kind == 1 ? TW_F16 : TW_BF16);
  int accumulate = unif() < 0.25;
  int64_t gsh[1] = {G};
  tw_tensor gs = host_new(TW_I32, 1, gsh);
  random_groups(G, M, (int32_t *)gs.data);
  int64_t *off = (int64_t *)malloc((size_t)(G + 1) * sizeof(int64_t));
  off[0] = 0;
  for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + ((int32_t *)gs.data)[g];

  char what[256];
  tw_operand lh, rh, ld, rd;
  double *av = NULL, *bv = NULL; /* lhs [M, K]; rhs values and their strides below */
  double *am = NULL, *bm = NULL; /* their lifted magnitudes (quantized; else the values) */
  int64_t b_gs, b_sk, b_sn;      /* rhs[g](k, n) = bv[g*b_gs + k*b_sk + n*b_sn] */
  tw_tensor lhs_h = tw_tensor_none(), rhs_h = tw_tensor_none(), lhs_d = tw_tensor_none(), rhs_d = tw_tensor_none();
  qop ql, qr;
  int quant = kind == 3;
  tw_scaling mode = TW_SCALE_NONE;
  tw_tensor mx_src = tw_tensor_none(); /* fp8_mx_colwise: the rhs source [G*K, N] */
  tw_dtype mx_qt = TW_E4M3;
  if (!quant) {
    tw_dtype dl = kind == 0 ? TW_BF16 : kind == 1 ? TW_F16 : TW_F32;
    tw_dtype dr = dl;
    if (kind == 2 && unif() < 0.5) dr = (rnd() & 1) ? TW_BF16 : TW_F16;
    int64_t ls[2] = {M, K};
    lhs_h = host_new(dl, 2, ls);
    fill_random(&lhs_h, M, K);
    int64_t rs[3] = {G, rhs_op == TW_OP_N ? K : N, rhs_op == TW_OP_N ? N : K};
    rhs_h = host_new(dr, 3, rs);
    fill_random(&rhs_h, G * rs[1], rs[2]);
    lhs_d = dev_copy(&lhs_h);
    rhs_d = dev_copy(&rhs_h);
    lh = tw_operand_plain(&lhs_h);
    rh = tw_operand_plain(&rhs_h);
    ld = tw_operand_plain(&lhs_d);
    rd = tw_operand_plain(&rhs_d);
    am = av = values_of(&lhs_h);
    bm = bv = values_of(&rhs_h);
    b_gs = K * N;
    b_sk = rhs_op == TW_OP_N ? N : 1;
    b_sn = rhs_op == TW_OP_N ? 1 : K;
    snprintf(what, sizeof what, "fwd seed %llu: %s x %s -> %s G=%lld M=%lld N=%lld K=%lld rhs_op %c acc %d",
             (unsigned long long)seed, tw_dtype_name(dl), tw_dtype_name(dr), tw_dtype_name(od), (long long)G,
             (long long)M, (long long)N, (long long)K, rhs_op ? 'T' : 'N', accumulate);
  } else {
    mode = fp8_modes[rnd() % (uint64_t)fp8_mode_count];
    if (fp8_only_mxfp8) mode = TW_SCALE_MXFP8_1D;
    /* 1x128 activations with 128x128 weights half the time (DeepSeek-V3's pairing) */
    tw_scaling mode_r = mode == TW_SCALE_BLOCK_1x128 && (rnd() & 1) ? TW_SCALE_BLOCK_128x128 : mode;
    tw_dtype ql_t = (rnd() & 1) ? TW_E4M3 : TW_E5M2;
    tw_dtype qr_t = ql_t == TW_E5M2 ? TW_E4M3 : ((rnd() & 1) ? TW_E4M3 : TW_E5M2);
    int64_t ls[2] = {M, K};
    tw_tensor x = host_new(TW_F32, 2, ls);
    fill_random(&x, M, K);
    qop_make(&ql, mode, ql_t, &x, &gs, 0);
    host_free(&x);
    /* rhs source: [G*K, N] (kn) or [G*N, K]; orientation so that blocks lie on K */
    int kn = (int)(rnd() & 1), col;
    if (mode_r == TW_SCALE_BLOCK_1x128 || mode_r == TW_SCALE_MXFP8_1D) col = kn;
    else col = (int)(rnd() & 1);
    if (fp8_wgmma_dims && mode_r != TW_SCALE_MXFP8_1D) col = kn; /* storage [N, K] per group: op T */
    if (fp8_wgmma_dims && mode_r == TW_SCALE_MXFP8_1D) kn = col = fp8_mx_colwise; /* rowwise [G*N, K] or colwise [G*K, N] */
    int64_t rsrc[2] = {G * (kn ? K : N), kn ? N : K};
    tw_tensor w = host_new(TW_F32, 2, rsrc);
    fill_random(&w, rsrc[0], rsrc[1]);
    int64_t ush[1] = {G};
    tw_tensor ugs = host_new(TW_I32, 1, ush);
    for (int64_t g = 0; g < G; ++g) ((int32_t *)ugs.data)[g] = (int32_t)(kn ? K : N);
    qop_make(&qr, mode_r, qr_t, &w, &ugs, col);
    if (fp8_mx_colwise && fp8_wgmma_dims && mode_r == TW_SCALE_MXFP8_1D) mx_src = w; /* for the rowwise twin */
    else host_free(&w);
    host_free(&ugs);
    /* stored per group: kn rowwise [K,N] (N); kn colwise: transposed [N,K] (T), MXFP8 [K,N] (N);
     * nk rowwise [N,K] (T); nk colwise transposed [K,N] (N) */
    int transposed = col && mode_r != TW_SCALE_MXFP8_1D;
    rhs_op = (kn ^ transposed) ? TW_OP_N : TW_OP_T;
    lh = ql.h;
    ld = ql.d;
    rh = qr.h;
    rd = qr.d;
    mx_qt = qr_t;
    av = ql.vals;
    bv = qr.vals;
    am = ql.mags;
    bm = qr.mags;
    b_gs = K * N;
    b_sk = kn ? N : 1;
    b_sn = kn ? 1 : K;
    snprintf(what, sizeof what,
             "fwd seed %llu: fp8 %s x %s %s x %s (rhs %s %s) -> %s G=%lld M=%lld N=%lld K=%lld rhs_op %c acc %d",
             (unsigned long long)seed, tw_scaling_name(mode), tw_scaling_name(mode_r), tw_dtype_name(ql_t), tw_dtype_name(qr_t),
             kn ? "[G*K,N]" : "[G*N,K]", col ? "colwise" : "rowwise", tw_dtype_name(od), (long long)G, (long long)M,
             (long long)N, (long long)K, rhs_op ? 'T' : 'N', accumulate);
  }

  int64_t os[2] = {M, N};
  tw_tensor out_r = host_new(od, 2, os), out_g = host_new(od, 2, os);
  init_out(&out_r, accumulate);
  memcpy(out_g.data, out_r.data, tw_tensor_bytes(&out_r));
  double *init = values_of(&out_r);
  tw_tensor out_d = dev_copy(&out_g);
  tw_tensor gs_d = dev_copy(&gs);
  /* the colwise MXFP8 rhs codes at an odd address on every 4th case (a copy; rd points at it) */
  void *odd_keep = NULL;
  if (!tw_tensor_is_none(&mx_src) && seed % 4 == 0) {
    const size_t b = tw_tensor_bytes(&rd.data);
    cr_assert_eq(tw_alloc(gpu_ctx, b + 16, &odd_keep), TW_OK, "%s", tw_last_error());
    /* on the context's stream (non-blocking): a cudaMemcpy D2D on the legacy stream is not
     * ordered with it, and the GEMM read the copy half-done (run mxf1) */
    tw_tensor moved = rd.data;
    moved.data = (char *)odd_keep + 1;
    cr_assert_eq(tw_tensor_copy(gpu_ctx, &moved, &rd.data), TW_OK, "%s", tw_last_error());
    rd.data.data = moved.data;
    strncat(what, " (rhs codes at an odd address)", sizeof what - strlen(what) - 1);
  }

  cr_assert_eq(tw_grouped_gemm(ref_ctx, &lh, &rh, rhs_op, &gs, &out_r, accumulate), TW_OK, "%s: ref: %s", what,
               tw_last_error());
  tw_status gs_st = tw_grouped_gemm(gpu_ctx, &ld, &rd, rhs_op, &gs_d, &out_d, accumulate);
  if (gs_st == TW_OK) gs_st = tw_ctx_check(gpu_ctx);
  if (gs_st == TW_OK) to_host(&out_g, &out_d);
  /* fp8_mx_colwise on gg_wgmma_fp8: the same problem given as the rowwise MXFP8 operand of the
   * transposed source [G*N, K] (op T) must give the same bits (same codes, same E8M0 bytes) */
  const char *bit_failure = NULL;
  if (!tw_tensor_is_none(&mx_src) && fp8_fast_bound && gs_st == TW_OK) {
    int64_t tsh[2] = {G * N, K}, tgs[1] = {G};
    tw_tensor wt = host_new(TW_F32, 2, tsh), ugs = host_new(TW_I32, 1, tgs);
    for (int64_t g = 0; g < G; ++g) {
      ((int32_t *)ugs.data)[g] = (int32_t)N;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t n = 0; n < N; ++n)
          ((float *)wt.data)[(g * N + n) * K + k] = ((const float *)mx_src.data)[(g * K + k) * N + n];
    }
    qop qt;
    qop_make(&qt, TW_SCALE_MXFP8_1D, mx_qt, &wt, &ugs, 0);
    tw_tensor out_t = host_new(od, 2, os);
    for (int64_t i = 0; i < M * N; ++i) tw_store_from_f64(out_t.data, od, i, init[i], 1); /* the same init */
    if (!accumulate) memset(out_t.data, TW_POISON_BYTE, tw_tensor_bytes(&out_t));
    tw_tensor out_td = dev_copy(&out_t);
    tw_status st2 = tw_grouped_gemm(gpu_ctx, &ld, &qt.d, TW_OP_T, &gs_d, &out_td, accumulate);
    if (st2 == TW_OK) st2 = tw_ctx_check(gpu_ctx);
    if (st2 != TW_OK) bit_failure = "the rowwise twin (transposed source, op T) failed to run";
    else {
      to_host(&out_t, &out_td);
      if (memcmp(out_t.data, out_g.data, tw_tensor_bytes(&out_g)) != 0)
        bit_failure = "colwise op N and the rowwise operand of the transposed source give different bits";
    }
    dev_free(&out_td);
    host_free(&out_t); host_free(&wt); host_free(&ugs);
    qop_free(&qt);
  }
  if (odd_keep) tw_free(gpu_ctx, odd_keep);
  host_free(&mx_src);

  /* exact f64 result and bound */
  double *ex = (double *)calloc((size_t)(M * N + 1), sizeof(double));
  double *ab = (double *)calloc((size_t)(M * N + 1), sizeof(double));
  double *bound = (double *)malloc((size_t)(M * N + 1) * sizeof(double));
  for (int64_t i = 0; i < M * N; ++i) bound[i] = -1;
  for (int64_t g = 0; g < G; ++g) {
    int64_t o = off[g], m = off[g + 1] - off[g];
    if (m == 0) continue;
    if (accumulate)
      for (int64_t i = o * N; i < (o + m) * N; ++i) {
        ex[i] = init[i];
        ab[i] = fabs(init[i]);
      }
    const int64_t fast = quant && fp8_fast_bound ? promote_len(mode) : 0;
    dref(m, N, K, av + o * K, (fast ? am : av) + o * K, K, 1, bv + g * b_gs, (fast ? bm : bv) + g * b_gs, b_sk, b_sn,
         ex + o * N, ab + o * N, N);
    add_bounds_m(ab + o * N, ex + o * N, m * N, K, od, fast, bound + o * N);
  }
  if (gs_st == TW_OK) check_case(what, &out_g, &out_r, bound);
  else note_case(what, tw_last_error());
  if (bit_failure) note_case(what, bit_failure);

  free(ex); free(ab); free(bound); free(init); free(off);
  dev_free(&out_d); dev_free(&gs_d);
  host_free(&out_r); host_free(&out_g); host_free(&gs);
  if (quant) { qop_free(&ql); qop_free(&qr); }
  else {
    free(av); free(bv);
    host_free(&lhs_h); host_free(&rhs_h); dev_free(&lhs_d); dev_free(&rhs_d);
  }
}

/* ---- wgrad ------------------------------------------------------------------------------ */
/* Plain operand stored N ([M, C]) or T (per-group [C, m_g] blocks at o_g*C). */
static tw_tensor store_grouped(const tw_tensor *x, tw_op op, const int64_t *off, int64_t G) {
  if (op == TW_OP_N) {
    tw_tensor y = host_new(x->dtype, 2, x->shape);
    memcpy(y.data, x->data, tw_tensor_bytes(x));
    return y;
  }
  int64_t M = x->shape[0], C = x->shape[1];
  int64_t sh[2] = {C, M};
  tw_tensor y = host_new(x->dtype, 2, sh);
  for (int64_t g = 0; g < G; ++g) {
    int64_t o = off[g], m = off[g + 1] - off[g];
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < C; ++c)
        tw_store_from_f64(y.data, y.dtype, o * C + c * m + r, tw_load_as_f64(x->data, x->dtype, (o + r) * C + c), 0);
  }
  return y;
}

/* gg_wgmma_fp8 wgrad: both operands as the per-group transposed colwise copies (ops T), the
 * layout it takes, in every scaling mode it takes (tensor and block). */
static int fp8w_colwise;
/* every fp8 wgrad case MXFP8 (colwise [M, K] / [M, N] data, ops N: the forced MXFP8 wgrad sets) */
static int fp8w_only_mxfp8;
/* gg_wgmma wgrad: rows past the sizes' sum set to NaN in both operands (they must never be
 * read: a group's last k-tile must not take them into the contraction). */
static int nan_rest;
/* 1: gg_wgmma's wgrad runs twice, first as the default kernel, then with the knob
 * variant_knob=variant_value set (a variant the bench times), and the two outputs must be the
 * same bits (the first is also checked against the bound) */
static int variant_bits, variant_cases;
static const char *variant_knob, *variant_value;
/* Fixed wgrad problems (the tails test): sizes, shape, output dtype and accumulate given. */
static const int32_t *fixed_gs;
static int64_t fixed_G, fixed_M, fixed_N, fixed_K;
static tw_dtype fixed_od;
static int fixed_acc;

static void wgrad_case(uint64_t seed, int kind, int64_t budget) {
  rng_s = seed * 104729 + 3;
  int64_t G = unif() < 0.3 ? irange(1, 4) : logdim(256);
  int64_t M = logdim(8192), N = logdim(4096), K = logdim(4096);
  while (M * N * K > budget || G * K * N > budget / 4) {
    if (M >= N && M >= K) M = (M + 1) / 2;
    else if (N >= K) N = (N + 1) / 2;
    else K = (K + 1) / 2;
  }
  if (aligned_dims) {
    N = 64 * irange(1, 6);
    K = 64 * irange(1, 6);
    if (G > 16) G = irange(1, 16);
    M = irange(0, 4 * budget / (N * K));
  }
  if (tma_dims) {
    K = (K + 7) / 8 * 8;
    N = (N + 7) / 8 * 8;
  }
  tw_dtype od = pick_out(kind == 1 ? TW_F16 : TW_BF16);
  int accumulate = unif() < 0.25;
  if (fixed_gs) {
    G = fixed_G; M = fixed_M; N = fixed_N; K = fixed_K;
    od = fixed_od;
    accumulate = fixed_acc;
  }
  int64_t gsh[1] = {G};
  tw_tensor gs = host_new(TW_I32, 1, gsh);
  if (fixed_gs) memcpy(gs.data, fixed_gs, (size_t)G * 4);
  else random_groups(G, M, (int32_t *)gs.data);
  int64_t *off = (int64_t *)malloc((size_t)(G + 1) * sizeof(int64_t));
  off[0] = 0;
  for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + ((int32_t *)gs.data)[g];

  char what[256];
  tw_operand lh, rh, ldv, rdv;
  tw_op lop, rop;
  double *av, *bv; /* source values lhs [M, K], rhs [M, N] */
  double *am, *bm; /* their lifted magnitudes (quantized; else the values) */
  tw_tensor ls_h = tw_tensor_none(), rs_h = tw_tensor_none(), ls_d = tw_tensor_none(), rs_d = tw_tensor_none();
  qop ql, qr;
  int quant = kind == 3, fast = 0;
  int64_t plen = 128; /* gg_wgmma_fp8's promotion interval along the tokens (32: MXFP8) */
  int64_t lsh[2] = {M, K}, rsh[2] = {M, N};
  if (!quant) {
    tw_dtype dl = kind == 0 ? TW_BF16 : kind == 1 ? TW_F16 : TW_F32;
    tw_dtype dr = dl;
    if (kind == 2 && unif() < 0.5) dr = (rnd() & 1) ? TW_BF16 : TW_F16;
    lop = (tw_op)(rnd() & 1);
    rop = (tw_op)(rnd() & 1);
    if (tma_dims) lop = rop = TW_OP_N; /* gg_wgmma takes lhs [M, K] and rhs [M, N] */
    tw_tensor x = host_new(dl, 2, lsh), y = host_new(dr, 2, rsh);
    fill_random(&x, M, K);
    fill_random(&y, M, N);
    if (nan_rest && off[G] < M) { /* all-ones bits: NaN in bf16, f16 and f32 */
      int es = tw_dtype_bits(dl) / 8, er = tw_dtype_bits(dr) / 8;
      memset((char *)x.data + off[G] * K * es, 0xFF, (size_t)((M - off[G]) * K * es));
      memset((char *)y.data + off[G] * N * er, 0xFF, (size_t)((M - off[G]) * N * er));
    }
    am = av = values_of(&x);
    bm = bv = values_of(&y);
    ls_h = store_grouped(&x, lop, off, G);
    rs_h = store_grouped(&y, rop, off, G);
    host_free(&x);
    host_free(&y);
    ls_d = dev_copy(&ls_h);
    rs_d = dev_copy(&rs_h);
    lh = tw_operand_plain(&ls_h);
    rh = tw_operand_plain(&rs_h);
    ldv = tw_operand_plain(&ls_d);
    rdv = tw_operand_plain(&rs_d);
    snprintf(what, sizeof what, "wgrad seed %llu: %s x %s -> %s G=%lld M=%lld N=%lld K=%lld ops %c%c acc %d",
             (unsigned long long)seed, tw_dtype_name(dl), tw_dtype_name(dr), tw_dtype_name(od), (long long)G,
             (long long)M, (long long)N, (long long)K, lop ? 'T' : 'N', rop ? 'T' : 'N', accumulate);
  } else {
    tw_scaling mode = fp8_modes[rnd() % (uint64_t)fp8_mode_count];
    if (fp8w_only_mxfp8) mode = TW_SCALE_MXFP8_1D;
    tw_dtype ql_t = (rnd() & 1) ? TW_E4M3 : TW_E5M2;
    tw_dtype qr_t = ql_t == TW_E5M2 ? TW_E4M3 : ((rnd() & 1) ? TW_E4M3 : TW_E5M2);
    /* contraction over rows: 1x128 and MXFP8 need the colwise orientation */
    int lc = (mode == TW_SCALE_BLOCK_1x128 || mode == TW_SCALE_MXFP8_1D) ? 1 : (int)(rnd() & 1);
    int rc = (mode == TW_SCALE_BLOCK_1x128 || mode == TW_SCALE_MXFP8_1D) ? 1 : (int)(rnd() & 1);
    if (fp8w_colwise) lc = rc = 1;
    tw_tensor x = host_new(TW_F32, 2, lsh), y = host_new(TW_F32, 2, rsh);
    fill_random(&x, M, K);
    fill_random(&y, M, N);
    qop_make(&ql, mode, ql_t, &x, &gs, lc);
    qop_make(&qr, mode, qr_t, &y, &gs, rc);
    host_free(&x);
    host_free(&y);
    lop = (lc && mode != TW_SCALE_MXFP8_1D) ? TW_OP_T : TW_OP_N;
    rop = (rc && mode != TW_SCALE_MXFP8_1D) ? TW_OP_T : TW_OP_N;
    lh = ql.h; ldv = ql.d; rh = qr.h; rdv = qr.d;
    /* gg_wgmma_fp8 may run it (forced, or auto on sm_90): its promoted model. MXFP8 (the colwise
     * [M, K] / [M, N] data, ops N; always colwise here) is promoted every 32 tokens. */
    fast = fp8_fast_bound &&
           ((lop == TW_OP_T && rop == TW_OP_T &&
             (mode == TW_SCALE_TENSOR_CURRENT || mode == TW_SCALE_BLOCK_1x128 || mode == TW_SCALE_BLOCK_128x128 ||
              mode == TW_SCALE_TENSOR_DELAYED)) ||
            (mode == TW_SCALE_MXFP8_1D && lc && rc));
    plen = promote_len(mode);
    av = ql.vals;
    bv = qr.vals;
    am = ql.mags;
    bm = qr.mags;
    snprintf(what, sizeof what, "wgrad seed %llu: fp8 %s %s x %s -> %s G=%lld M=%lld N=%lld K=%lld ops %c%c acc %d",
             (unsigned long long)seed, tw_scaling_name(mode), tw_dtype_name(ql_t), tw_dtype_name(qr_t),
             tw_dtype_name(od), (long long)G, (long long)M, (long long)N, (long long)K, lop ? 'T' : 'N',
             rop ? 'T' : 'N', accumulate);
  }

  int64_t os[3] = {G, K, N};
  tw_tensor out_r = host_new(od, 3, os), out_g = host_new(od, 3, os);
  init_out(&out_r, accumulate);
  memcpy(out_g.data, out_r.data, tw_tensor_bytes(&out_r));
  double *init = values_of(&out_r);
  tw_tensor out_d = dev_copy(&out_g);
  tw_tensor out_variant = variant_bits ? dev_copy(&out_g) : tw_tensor_none();
  tw_tensor gs_d = dev_copy(&gs);
  cr_assert_eq(tw_grouped_gemm_wgrad(ref_ctx, &lh, lop, &rh, rop, &gs, &out_r, accumulate), TW_OK, "%s: ref: %s",
               what, tw_last_error());
  if (variant_bits) unsetenv(variant_knob); /* the first run is the default kernel */
  tw_status gs_st = tw_grouped_gemm_wgrad(gpu_ctx, &ldv, lop, &rdv, rop, &gs_d, &out_d, accumulate);
  if (gs_st == TW_OK) gs_st = tw_ctx_check(gpu_ctx);
  if (gs_st == TW_OK) to_host(&out_g, &out_d);
  if (variant_bits && gs_st == TW_OK) {
    setenv(variant_knob, variant_value, 1);
    tw_status ps = tw_grouped_gemm_wgrad(gpu_ctx, &ldv, lop, &rdv, rop, &gs_d, &out_variant, accumulate);
    unsetenv(variant_knob);
    if (ps == TW_OK) ps = tw_ctx_check(gpu_ctx);
    cr_assert_eq(ps, TW_OK, "%s: wgrad variant: %s", what, tw_last_error());
    tw_tensor h = host_new(od, 3, os);
    to_host(&h, &out_variant);
    cr_assert(memcmp(h.data, out_g.data, tw_tensor_bytes(&h)) == 0, "%s: the wgrad variant's bits differ from the default kernel's", what);
    host_free(&h);
    variant_cases++;
  }
  if (variant_bits) dev_free(&out_variant);

  int64_t n = G * K * N;
  double *ex = (double *)calloc((size_t)(n + 1), sizeof(double));
  double *ab = (double *)calloc((size_t)(n + 1), sizeof(double));
  double *bound = (double *)malloc((size_t)(n + 1) * sizeof(double));
  for (int64_t g = 0; g < G; ++g) {
    int64_t o = off[g], m = off[g + 1] - off[g], b = g * K * N;
    if (m == 0) { /* exactly 0, or untouched */
      for (int64_t i = 0; i < K * N; ++i) bound[b + i] = -1;
      continue;
    }
    if (accumulate)
      for (int64_t i = 0; i < K * N; ++i) {
        ex[b + i] = init[b + i];
        ab[b + i] = fabs(init[b + i]);
      }
    /* out[g](k, n) = sum_r lhs[o+r][k] rhs[o+r][n] */
    dref(K, N, m, av + o * K, (fast ? am : av) + o * K, 1, K, bv + o * N, (fast ? bm : bv) + o * N, N, 1, ex + b,
         ab + b, N);
    add_bounds_m(ab + b, ex + b, K * N, m, od, fast ? plen : 0, bound + b);
  }
  if (gs_st == TW_OK) check_case(what, &out_g, &out_r, bound);
  else note_case(what, tw_last_error());

  free(ex); free(ab); free(bound); free(init); free(off);
  dev_free(&out_d); dev_free(&gs_d);
  host_free(&out_r); host_free(&out_g); host_free(&gs);
  if (quant) { qop_free(&ql); qop_free(&qr); }
  else {
    free(av); free(bv);
    host_free(&ls_h); host_free(&rs_h); dev_free(&ls_d); dev_free(&rs_d);
  }
}

/* 500+ cases per operation: 4 kinds x 130 seeds on the auto version, plus each forced version
 * (gg_mma_wide: 120 random + 100 aligned bf16/f16 cases, 100 + 100 fp8 per-tensor cases). */
#define CASES 130
#define BUDGET ((int64_t)1 << 24)

#define RANDOM_TESTS(op, fn)                                                              \
  Test(op, random_bf16, .timeout = 600) { ctx_for(NULL); for (int s = 0; s < CASES; ++s) fn(s, 0, BUDGET); ctx_done(); cases_done(#op ".bf16"); } \
  Test(op, random_f16, .timeout = 600) { ctx_for(NULL); for (int s = 0; s < CASES; ++s) fn(1000 + s, 1, BUDGET); ctx_done(); cases_done(#op ".f16"); } \
  Test(op, random_f32_mixed, .timeout = 600) { ctx_for(NULL); for (int s = 0; s < CASES; ++s) fn(2000 + s, 2, BUDGET); ctx_done(); cases_done(#op ".f32"); } \
  Test(op, random_fp8, .timeout = 600) { ctx_for(NULL); for (int s = 0; s < CASES; ++s) fn(3000 + s, 3, BUDGET); ctx_done(); cases_done(#op ".fp8"); } \
  Test(op, random_gg_mma_version, .timeout = 600) { ctx_for("gg_mma"); for (int s = 0; s < 60; ++s) fn(6000 + s, (int)((s % 3) == 2 ? 3 : s % 3), BUDGET / 2); ctx_done(); cases_done(#op ".gg_mma"); } \
  Test(op, random_gg_mma_wide_version, .timeout = 600) { ctx_for("gg_mma_wide"); for (int s = 0; s < 120; ++s) fn(7000 + s, (int)(s % 2), BUDGET); ctx_done(); cases_done(#op ".gg_mma_wide"); } \
  Test(op, aligned_gg_mma_wide_version, .timeout = 600) { ctx_for("gg_mma_wide"); aligned_dims = 1; for (int s = 0; s < 100; ++s) fn(8000 + s, (int)(s % 2), BUDGET); aligned_dims = 0; ctx_done(); cases_done(#op ".gg_mma_wide_aligned"); } \
  Test(op, random_gg_mma_wide_fp8, .timeout = 600) { ctx_for("gg_mma_wide"); fp8_mode_count = 2; for (int s = 0; s < 100; ++s) fn(9000 + s, 3, BUDGET); fp8_mode_count = 5; ctx_done(); cases_done(#op ".gg_mma_wide_fp8"); } \
  Test(op, aligned_gg_mma_wide_fp8, .timeout = 600) { ctx_for("gg_mma_wide"); fp8_mode_count = 2; aligned_dims = 1; for (int s = 0; s < 100; ++s) fn(9500 + s, 3, BUDGET); aligned_dims = 0; fp8_mode_count = 5; ctx_done(); cases_done(#op ".gg_mma_wide_fp8_aligned"); } \
  Test(op, aligned_gg_mma_version, .timeout = 600) { ctx_for("gg_mma"); aligned_dims = 1; for (int s = 0; s < 40; ++s) fn(8000 + s, (int)(s % 2), BUDGET); aligned_dims = 0; ctx_done(); cases_done(#op ".gg_mma_aligned"); } \
  Test(op, random_fma_version, .timeout = 600) { ctx_for("gg_fma"); for (int s = 0; s < 40; ++s) fn(4000 + s, (int)(s % 4), BUDGET / 4); ctx_done(); cases_done(#op ".fma"); } \
  Test(op, random_lt_loop_version, .timeout = 600) { ctx_for("gg_lt_loop"); lt_loop_outs = 1; for (int s = 0; s < 40; ++s) fn(5000 + s, (int)(s % 2), BUDGET / 4); lt_loop_outs = 0; ctx_done(); cases_done(#op ".lt_loop"); }

RANDOM_TESTS(grouped_gemm_gpu, fwd_case)

/* gg_wgmma (Hopper, forward only): 400 random + 100 aligned bf16/f16 cases, and a few large
 * ones (many 64-deep k-tiles, several 128x256 tiles per group, K % 64 != 0 most of the time). */
Test(grouped_gemm_gpu, random_gg_wgmma_version, .timeout = 900) {
  ctx_for("gg_wgmma"); tma_dims = 1;
  for (int s = 0; s < 400; ++s) fwd_case(11000 + s, (int)(s % 2), BUDGET);
  tma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma");
}
Test(grouped_gemm_gpu, aligned_gg_wgmma_version, .timeout = 600) {
  ctx_for("gg_wgmma"); aligned_dims = 1;
  for (int s = 0; s < 100; ++s) fwd_case(12000 + s, (int)(s % 2), BUDGET);
  aligned_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_aligned");
}
Test(grouped_gemm_gpu, large_gg_wgmma_version, .timeout = 900) {
  ctx_for("gg_wgmma"); tma_dims = 1;
  for (int s = 0; s < 8; ++s) fwd_case(13000 + s, (int)(s % 2), (int64_t)1 << 30);
  tma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_large");
}
/* gg_wgmma's TMA-store epilogue (warpgroups whose 64 rows lie in one group) against its register
 * epilogue (TWIN_GG_WGMMA_EPI=regs, read on every call): the same bits in every output dtype,
 * both rhs layouts, pairs (M / G >= 256) and single CTAs, group edges and N tails. */
Test(grouped_gemm_gpu, epilogue_bits_gg_wgmma_version, .timeout = 300) {
  ctx_for("gg_wgmma");
  int64_t interior = 0;
  for (int s = 0; s < 36; ++s) {
    rng_s = (uint64_t)(14000 + s) * 7919 + 17;
    const tw_dtype in = (s & 1) ? TW_F16 : TW_BF16, od = out_types[(s / 2) % 3];
    const tw_op rhs_op = (tw_op)((s / 6) & 1);
    const int64_t G = irange(1, 10), N = 8 * irange(1, 90), K = 8 * irange(1, 48);
    const int64_t M = irange(0, 3) == 0 ? irange(0, 64 * G) : irange(64 * G, 640 * G);
    int64_t gsh[1] = {G}, ls[2] = {M, K}, rs[3] = {G, rhs_op == TW_OP_N ? K : N, rhs_op == TW_OP_N ? N : K};
    int64_t os[2] = {M, N};
    tw_tensor gs = host_new(TW_I32, 1, gsh), lhs = host_new(in, 2, ls), rhs = host_new(in, 3, rs);
    tw_tensor o_tma = host_new(od, 2, os), o_reg = host_new(od, 2, os);
    random_groups(G, M, (int32_t *)gs.data);
    for (int64_t g = 0; g < G; ++g) interior += ((int32_t *)gs.data)[g] / 64;
    fill_random(&lhs, M, K);
    fill_random(&rhs, G * rs[1], rs[2]);
    tw_tensor gs_d = dev_copy(&gs), lhs_d = dev_copy(&lhs), rhs_d = dev_copy(&rhs);
    tw_tensor od_tma = dev_copy(&o_tma), od_reg = dev_copy(&o_reg); /* both poisoned alike */
    tw_operand a = tw_operand_plain(&lhs_d), b = tw_operand_plain(&rhs_d);
    cr_assert_eq(tw_grouped_gemm(gpu_ctx, &a, &b, rhs_op, &gs_d, &od_tma, 0), TW_OK, "case %d: %s", s, tw_last_error());
    setenv("TWIN_GG_WGMMA_EPI", "regs", 1);
    cr_assert_eq(tw_grouped_gemm(gpu_ctx, &a, &b, rhs_op, &gs_d, &od_reg, 0), TW_OK, "case %d: %s", s, tw_last_error());
    unsetenv("TWIN_GG_WGMMA_EPI");
    cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "case %d: %s", s, tw_last_error());
    to_host(&o_tma, &od_tma);
    to_host(&o_reg, &od_reg);
    cr_assert(memcmp(o_tma.data, o_reg.data, tw_tensor_bytes(&o_tma)) == 0,
              "case %d (%s -> %s, G=%lld M=%lld N=%lld K=%lld, rhs_op %c): TMA and register epilogues differ", s,
              tw_dtype_name(in), tw_dtype_name(od), (long long)G, (long long)M, (long long)N, (long long)K,
              rhs_op ? 'T' : 'N');
    dev_free(&gs_d); dev_free(&lhs_d); dev_free(&rhs_d); dev_free(&od_tma); dev_free(&od_reg);
    host_free(&gs); host_free(&lhs); host_free(&rhs); host_free(&o_tma); host_free(&o_reg);
  }
  cr_assert(interior > 0, "no case had a 64-row block inside a group");
  ctx_done();
}
/* gg_wgmma_fp8 (Hopper fp8 wgmma, forward): per-tensor (current, delayed), 1x128, 128x128 and
 * MXFP8 scales (all 5 modes; MXFP8 with compact and swizzled scale bytes), e4m3/e5m2 pairs, K a
 * multiple of 16 (K % 128 != 0 most of the time, K % 32 = 16 in about half), rhs [G, N, K];
 * random (G 1..256, zero and skewed groups, tail rows), aligned, large, and an MXFP8-only set. */
Test(grouped_gemm_gpu, random_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1;
  for (int s = 0; s < 300; ++s) fwd_case(14000 + s, 3, BUDGET);
  fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8");
}
Test(grouped_gemm_gpu, aligned_gg_wgmma_fp8_version, .timeout = 600) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1; aligned_dims = 1;
  for (int s = 0; s < 100; ++s) fwd_case(15000 + s, 3, BUDGET);
  aligned_dims = 0; fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8_aligned");
}
Test(grouped_gemm_gpu, large_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1;
  for (int s = 0; s < 8; ++s) fwd_case(16000 + s, 3, (int64_t)1 << 30);
  fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8_large");
}
/* gg_wgmma_fp8's forward on 128 x 192 tiles (TWIN_GG_WGMMA_FP8_BN=192, read on every call) against
 * 128 x 128 (=128): the same promotion per column, so the same bits. Per-tensor, 1x128 x 1x128,
 * 1x128 x 128x128 and 128x128 x 128x128 (a 192-column tile spans two 128-column rhs scale blocks),
 * rhs rowwise of [G*N, K] or colwise of [G*K, N] (both op T), N = 192, 200, 384, 4104 (tails past
 * a multiple of 192) and 72 (one partial tile), ragged groups with an empty one, K tails, every
 * output dtype (bf16 / f16 through the TMA store where rows allow), accumulate on and off. A third
 * run asks for clusters of 2 (TWIN_GG_WGMMA_FP8_CLUSTER=2, lhs rows multicast to a pair of column
 * tiles): per-tensor pairs at BN 192 (N 192 and 72 have one column tile, so the pair's second is
 * the padding tile past N), block scales at BN 128 where the tile count is even; the same bits. */
Test(grouped_gemm_gpu, bn192_bits_gg_wgmma_fp8_version, .timeout = 300) {
  ctx_for("gg_wgmma_fp8");
  static const tw_scaling ml[4] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_1x128,
                                   TW_SCALE_BLOCK_128x128};
  static const tw_scaling mr[4] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128,
                                   TW_SCALE_BLOCK_128x128};
  static const int64_t Ns[5] = {192, 200, 384, 4104, 72};
  const char *prev = getenv("TWIN_GG_WGMMA_FP8_BN");
  char keep[16] = "";
  if (prev) snprintf(keep, sizeof keep, "%s", prev);
  unsetenv("TWIN_GG_WGMMA_FP8_CLUSTER");
  for (int s = 0; s < 60; ++s) {
    rng_s = (uint64_t)(16500 + s) * 7919 + 29;
    const int mi = s % 4, kn = (s / 4) & 1, acc = (int)(rnd() & 1);
    const int64_t N = Ns[(s / 8) % 5], G = N > 1000 ? irange(1, 3) : irange(1, 9), K = 16 * irange(1, 40);
    const int64_t M = irange(0, 3) == 0 ? irange(0, 64 * G) : irange(64 * G, 300 * G);
    const tw_dtype od = out_types[rnd() % 3];
    const tw_dtype qa = (rnd() & 1) ? TW_E4M3 : TW_E5M2, qb = qa == TW_E5M2 || (rnd() & 1) ? TW_E4M3 : TW_E5M2;
    int64_t gsh[1] = {G}, ls[2] = {M, K}, ws[2] = {G * (kn ? K : N), kn ? N : K}, os[2] = {M, N};
    tw_tensor gs = host_new(TW_I32, 1, gsh), ugs = host_new(TW_I32, 1, gsh);
    tw_tensor x = host_new(TW_F32, 2, ls), w = host_new(TW_F32, 2, ws);
    random_groups(G, M, (int32_t *)gs.data);
    if (G > 2) ((int32_t *)gs.data)[1] += ((int32_t *)gs.data)[0], ((int32_t *)gs.data)[0] = 0; /* an empty group */
    for (int64_t g = 0; g < G; ++g) ((int32_t *)ugs.data)[g] = (int32_t)(kn ? K : N);
    fill_random(&x, M, K);
    fill_random(&w, ws[0], ws[1]);
    qop ql, qr;
    qop_make(&ql, ml[mi], qa, &x, &gs, 0);
    qop_make(&qr, mr[mi], qb, &w, &ugs, kn); /* [G*N, K] rowwise or [G*K, N] colwise: [N, K] per group, op T */
    tw_tensor o128 = host_new(od, 2, os), o192 = host_new(od, 2, os), opair = host_new(od, 2, os);
    init_out(&o128, acc);
    memcpy(o192.data, o128.data, tw_tensor_bytes(&o128));
    memcpy(opair.data, o128.data, tw_tensor_bytes(&o128));
    tw_tensor gs_d = dev_copy(&gs), od128 = dev_copy(&o128), od192 = dev_copy(&o192), odpair = dev_copy(&opair);
    setenv("TWIN_GG_WGMMA_FP8_BN", "128", 1);
    cr_assert_eq(tw_grouped_gemm(gpu_ctx, &ql.d, &qr.d, TW_OP_T, &gs_d, &od128, acc), TW_OK, "case %d: %s", s,
                 tw_last_error());
    setenv("TWIN_GG_WGMMA_FP8_BN", "192", 1);
    cr_assert_eq(tw_grouped_gemm(gpu_ctx, &ql.d, &qr.d, TW_OP_T, &gs_d, &od192, acc), TW_OK, "case %d: %s", s,
                 tw_last_error());
    setenv("TWIN_GG_WGMMA_FP8_CLUSTER", "2", 1);
    cr_assert_eq(tw_grouped_gemm(gpu_ctx, &ql.d, &qr.d, TW_OP_T, &gs_d, &odpair, acc), TW_OK, "case %d: %s", s,
                 tw_last_error());
    unsetenv("TWIN_GG_WGMMA_FP8_CLUSTER");
    cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "case %d: %s", s, tw_last_error());
    to_host(&o128, &od128);
    to_host(&o192, &od192);
    to_host(&opair, &odpair);
    cr_assert(memcmp(o128.data, opair.data, tw_tensor_bytes(&o128)) == 0,
              "case %d (%s x %s, %s -> %s, G=%lld M=%lld N=%lld K=%lld acc %d): BN 128 and the cluster pair differ", s,
              tw_scaling_name(ml[mi]), tw_scaling_name(mr[mi]), tw_dtype_name(qa), tw_dtype_name(od), (long long)G,
              (long long)M, (long long)N, (long long)K, acc);
    cr_assert(memcmp(o128.data, o192.data, tw_tensor_bytes(&o128)) == 0,
              "case %d (%s x %s, rhs %s, %s x %s -> %s, G=%lld M=%lld N=%lld K=%lld acc %d): BN 128 and 192 differ",
              s, tw_scaling_name(ml[mi]), tw_scaling_name(mr[mi]), kn ? "colwise [G*K,N]" : "rowwise [G*N,K]",
              tw_dtype_name(qa), tw_dtype_name(qb), tw_dtype_name(od), (long long)G, (long long)M, (long long)N,
              (long long)K, acc);
    qop_free(&ql); qop_free(&qr);
    dev_free(&gs_d); dev_free(&od128); dev_free(&od192); dev_free(&odpair);
    host_free(&gs); host_free(&ugs); host_free(&x); host_free(&w); host_free(&o128); host_free(&o192);
    host_free(&opair);
  }
  if (prev) setenv("TWIN_GG_WGMMA_FP8_BN", keep, 1);
  else unsetenv("TWIN_GG_WGMMA_FP8_BN");
  ctx_done();
}
/* The wgrad bitwise tests' operands (bn192_bits, order_bits): x [M, K] and y [M, N] over G ragged
 * groups with group 1 empty; the test edits the sizes (wbits_groups), then wbits_quantize takes
 * both as colwise fp8 operands in scale pairing mi (wbits_ml / wbits_mr: per-tensor current and
 * delayed, 1x128, 128x128, 1x128 x 128x128). */
static const tw_scaling wbits_ml[5] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_BLOCK_1x128,
                                       TW_SCALE_BLOCK_128x128, TW_SCALE_BLOCK_1x128};
static const tw_scaling wbits_mr[5] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_BLOCK_1x128,
                                       TW_SCALE_BLOCK_128x128, TW_SCALE_BLOCK_128x128};
typedef struct {
  int64_t G, M, K, N;
  tw_tensor gs, x, y;
  qop ql, qr;
} wbits;
static int32_t *wbits_groups(wbits *c, int64_t G, int64_t M, int64_t K, int64_t N) {
  int64_t gsh[1] = {G}, lsh[2] = {M, K}, rsh[2] = {M, N};
  c->G = G, c->M = M, c->K = K, c->N = N;
  c->gs = host_new(TW_I32, 1, gsh);
  c->x = host_new(TW_F32, 2, lsh);
  c->y = host_new(TW_F32, 2, rsh);
  int32_t *g32 = (int32_t *)c->gs.data;
  random_groups(G, M, g32);
  if (G > 2) g32[1] += g32[0], g32[0] = 0; /* an empty group */
  return g32;
}
static void wbits_quantize(wbits *c, int mi, tw_dtype qa, tw_dtype qb) {
  fill_random(&c->x, c->M, c->K);
  fill_random(&c->y, c->M, c->N);
  qop_make(&c->ql, wbits_ml[mi], qa, &c->x, &c->gs, 1);
  qop_make(&c->qr, wbits_mr[mi], qb, &c->y, &c->gs, 1);
}
static void wbits_free(wbits *c) {
  qop_free(&c->ql);
  qop_free(&c->qr);
  host_free(&c->gs);
  host_free(&c->x);
  host_free(&c->y);
}
/* A random wbits case of pairing mi over [M, K] x [M, N] in G groups (with an empty and, G > 3, a
 * 1-token group): draws the output dtype and an fp8 pair (never e5m2 x e5m2), then quantizes. */
static void wbits_random(wbits *c, int mi, int64_t G, int64_t M, int64_t K, int64_t N, tw_dtype *od, tw_dtype *qa,
                         tw_dtype *qb) {
  *od = out_types[rnd() % 3];
  *qa = (rnd() & 1) ? TW_E4M3 : TW_E5M2;
  *qb = *qa == TW_E5M2 || (rnd() & 1) ? TW_E4M3 : TW_E5M2;
  int32_t *g32 = wbits_groups(c, G, M, K, N);
  if (G > 3 && g32[2] > 1) g32[3] += g32[2] - 1, g32[2] = 1; /* a 1-token group */
  wbits_quantize(c, mi, *qa, *qb);
}
/* gg_wgmma_fp8's wgrad (tma loader) on 128 x 192 output tiles (TWIN_GG_WGMMA_FP8_WGRAD_BN=192,
 * read on every call) against 128 x 128 (=128): the same promotion per output column, so the same
 * bits. Per-tensor current and delayed, 1x128, 128x128 and 1x128 x 128x128 (a 192-column tile
 * spans two 128-column rhs scale blocks), N = 192, 200, 384, 4104 (tails past a multiple of 192)
 * and 72 (one partial tile), K tails, ragged groups with an empty and a 1-token group, e4m3/e5m2,
 * every output dtype, accumulate on and off (off: the TMA-store epilogue; on: the staged one);
 * every third block-scale case stages the scales by warps (TWIN_GG_WGMMA_FP8_WGRAD_SCALES=warps)
 * instead of TMA. */
Test(grouped_gemm_wgrad_gpu, bn192_bits_gg_wgmma_fp8_version, .timeout = 300) {
  ctx_for("gg_wgmma_fp8");
  static const int64_t Ns[5] = {192, 200, 384, 4104, 72};
  const char *prev = getenv("TWIN_GG_WGMMA_FP8_WGRAD_BN");
  char keep[16] = "";
  if (prev) snprintf(keep, sizeof keep, "%s", prev);
  for (int s = 0; s < 75; ++s) {
    rng_s = (uint64_t)(26500 + s) * 7919 + 31;
    const int mi = s % 5, acc = (int)(rnd() & 1), warps = mi >= 2 && (s / 5) % 3 == 2;
    const int64_t N = Ns[(s / 5) % 5], G = N > 1000 ? irange(1, 4) : irange(1, 10), K = irange(1, 300);
    const int64_t M = irange(0, 3) == 0 ? irange(0, 64 * G) : irange(64 * G, 400 * G);
    int64_t os[3] = {G, K, N};
    wbits c;
    tw_dtype od, qa, qb;
    wbits_random(&c, mi, G, M, K, N, &od, &qa, &qb);
    tw_tensor o128 = host_new(od, 3, os), o192 = host_new(od, 3, os);
    init_out(&o128, acc);
    memcpy(o192.data, o128.data, tw_tensor_bytes(&o128));
    tw_tensor gs_d = dev_copy(&c.gs), od128 = dev_copy(&o128), od192 = dev_copy(&o192);
    if (warps) setenv("TWIN_GG_WGMMA_FP8_WGRAD_SCALES", "warps", 1);
    setenv("TWIN_GG_WGMMA_FP8_WGRAD_BN", "128", 1);
    cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &c.ql.d, TW_OP_T, &c.qr.d, TW_OP_T, &gs_d, &od128, acc), TW_OK,
                 "case %d: %s", s, tw_last_error());
    setenv("TWIN_GG_WGMMA_FP8_WGRAD_BN", "192", 1);
    cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &c.ql.d, TW_OP_T, &c.qr.d, TW_OP_T, &gs_d, &od192, acc), TW_OK,
                 "case %d: %s", s, tw_last_error());
    unsetenv("TWIN_GG_WGMMA_FP8_WGRAD_SCALES");
    cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "case %d: %s", s, tw_last_error());
    to_host(&o128, &od128);
    to_host(&o192, &od192);
    cr_assert(memcmp(o128.data, o192.data, tw_tensor_bytes(&o128)) == 0,
              "case %d (%s x %s, %s x %s -> %s, G=%lld M=%lld N=%lld K=%lld acc %d scales %s): BN 128 and 192 differ",
              s, tw_scaling_name(wbits_ml[mi]), tw_scaling_name(wbits_mr[mi]), tw_dtype_name(qa), tw_dtype_name(qb),
              tw_dtype_name(od), (long long)G, (long long)M, (long long)N, (long long)K, acc, warps ? "warps" : "tma");
    wbits_free(&c);
    dev_free(&gs_d); dev_free(&od128); dev_free(&od192);
    host_free(&o128); host_free(&o192);
  }
  if (prev) setenv("TWIN_GG_WGMMA_FP8_WGRAD_BN", keep, 1);
  else unsetenv("TWIN_GG_WGMMA_FP8_WGRAD_BN");
  ctx_done();
}
/* MXFP8 only (promoted every 32): random ragged groups (offsets at any row, zero groups), K
 * tails (K % 32 = 16, K % 128 != 0), e4m3/e5m2 pairs, f32/bf16/f16 out, accumulate, both scale
 * byte orders; 100 cases, and 4 large ones in their own test (the sanitizers run the first). */
Test(grouped_gemm_gpu, mxfp8_gg_wgmma_fp8_version, .timeout = 600) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1; fp8_only_mxfp8 = 1;
  for (int s = 0; s < 100; ++s) fwd_case(18000 + s, 3, BUDGET);
  fp8_only_mxfp8 = 0; fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8_mxfp8");
}
Test(grouped_gemm_gpu, large_mxfp8_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1; fp8_only_mxfp8 = 1;
  for (int s = 0; s < 4; ++s) fwd_case(18500 + s, 3, (int64_t)1 << 30);
  fp8_only_mxfp8 = 0; fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8_mxfp8_large");
}
/* MXFP8 rhs given as the colwise data of its [G*K, N] source, op N (the MoE fp8_mxfp8 weights):
 * gg_wgmma_fp8 transposes it (pad pass) and runs the MXFP8 kernel. Random ragged groups (zero
 * groups, offsets anywhere), K % 16 == 0 with K % 128 != 0 most of the time, any N (tails, N % 16
 * != 0: the pad pass's byte path), compact and swizzled scales, e4m3/e5m2 pairs, f32/bf16/f16
 * out, accumulate; against ref with the block-32 bound, and bit for bit against the rowwise
 * operand of the transposed source (fp8_mx_colwise); every 4th case with the rhs codes at an odd
 * address. 100 cases (the sanitizers run these), 3 large ones, and the same under auto: on sm_90
 * the bit-identity shows auto took gg_wgmma_fp8 (else gg_mma_wide's exact sums would differ). */
Test(grouped_gemm_gpu, mxfp8_colwise_rhs_gg_wgmma_fp8_version, .timeout = 600) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1; fp8_only_mxfp8 = 1; fp8_mx_colwise = 1;
  for (int s = 0; s < 100; ++s) fwd_case(31000 + s, 3, BUDGET);
  fp8_mx_colwise = 0; fp8_only_mxfp8 = 0; fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8_mxfp8_colwise");
}
Test(grouped_gemm_gpu, large_mxfp8_colwise_rhs_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8_wgmma_dims = 1; fp8_only_mxfp8 = 1; fp8_mx_colwise = 1;
  for (int s = 0; s < 3; ++s) fwd_case(31500 + s, 3, (int64_t)1 << 30);
  fp8_mx_colwise = 0; fp8_only_mxfp8 = 0; fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.gg_wgmma_fp8_mxfp8_colwise_large");
}
Test(grouped_gemm_gpu, auto_takes_mxfp8_colwise_rhs, .timeout = 600) {
  ctx_for(NULL); fp8_wgmma_dims = 1; fp8_only_mxfp8 = 1; fp8_mx_colwise = 1;
  for (int s = 0; s < 40; ++s) fwd_case(32000 + s, 3, BUDGET);
  fp8_mx_colwise = 0; fp8_only_mxfp8 = 0; fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.auto_mxfp8_colwise");
}
/* auto on fp8 operands gg_wgmma_fp8 takes (on sm_90 it runs them, MXFP8 included; elsewhere
 * gg_mma_wide/gg_mma) */
Test(grouped_gemm_gpu, random_fp8_auto_wgmma_shapes, .timeout = 900) {
  ctx_for(NULL); fp8_wgmma_dims = 1;
  for (int s = 0; s < 150; ++s) fwd_case(17000 + s, 3, BUDGET);
  fp8_wgmma_dims = 0; ctx_done(); cases_done("grouped_gemm_gpu.fp8_auto_wgmma_shapes");
}

/* The promoted bound is not vacuous: positive data (sum |a||b| = |exact|, the bound is ~1.6% of
 * the value, ~0.4% for MXFP8's blocks of 32), one group, K = 1008 (8 k-blocks, the last one 112
 * deep). The true scales pass; per-tensor: lhs scale_inv of the group times (1 + 2^-4) must
 * fail; 1x128: one k-block's lhs scale of every row times 2 (that block's share ~ 1/8 of the
 * value) must fail; MXFP8: one 32-block's lhs scale of every row times 2 (share ~ 1/31). */
static double planted_case(tw_scaling mode, int plant, int *passed) {
  ctx_for("gg_wgmma_fp8");
  rng_s = 424242;
  const int64_t G = 1, M = 200, N = 136, K = 1008;
  int64_t gsh[1] = {G}, ls[2] = {M, K}, ws[2] = {G * N, K}, os[2] = {M, N};
  tw_tensor gs = host_new(TW_I32, 1, gsh);
  ((int32_t *)gs.data)[0] = (int32_t)M;
  tw_tensor x = host_new(TW_F32, 2, ls), w = host_new(TW_F32, 2, ws);
  for (int64_t i = 0; i < M * K; ++i) ((float *)x.data)[i] = (float)(0.25 + unif());
  for (int64_t i = 0; i < G * N * K; ++i) ((float *)w.data)[i] = (float)(0.25 + unif());
  qop ql, qr;
  qop_make(&ql, mode, TW_E4M3, &x, &gs, 0);
  int32_t ng = (int32_t)N;
  tw_tensor ugs = tw_tensor_1d(&ng, TW_I32, 1, TW_MEM_HOST);
  qop_make(&qr, mode, TW_E4M3, &w, &ugs, 0);
  if (plant) { /* the device copy of lhs's scales only: ref keeps the true ones */
    tw_tensor hs = host_new(ql.hq.row_scale_inv.dtype, ql.hq.row_scale_inv.ndim, ql.hq.row_scale_inv.shape);
    memcpy(hs.data, ql.hq.row_scale_inv.data, tw_tensor_bytes(&hs));
    float *f = (float *)hs.data;
    if (mode == TW_SCALE_MXFP8_1D) { /* sub-block 3 (k 96..127) of every row: E8M0 exponent + 1 */
      uint8_t *e = (uint8_t *)hs.data;
      const int64_t W = hs.shape[1], cb = 3;
      for (int64_t r = 0; r < M; ++r)
        e[ql.hq.mxfp8_swizzled
              ? (((r / 128) * (W / 4) + cb / 4) * 32 + r % 32) * 16 + ((r % 128) / 32) * 4 + cb % 4
              : r * W + cb] += 1;
    } else if (mode == TW_SCALE_BLOCK_1x128) {
      int64_t ld = hs.shape[1];
      for (int64_t r = 0; r < M; ++r) f[3 * ld + r] *= 2.f; /* k-block 3 of every row */
    } else {
      f[0] *= 1.0625f;
    }
    cr_assert_eq(tw_tensor_copy(gpu_ctx, &ql.dq.row_scale_inv, &hs), TW_OK, "%s", tw_last_error());
    host_free(&hs);
  }
  tw_tensor out_r = host_new(TW_F32, 2, os), out_g = host_new(TW_F32, 2, os);
  tw_tensor out_d = dev_copy(&out_g), gs_d = dev_copy(&gs);
  cr_assert_eq(tw_grouped_gemm(ref_ctx, &ql.h, &qr.h, TW_OP_T, &gs, &out_r, 0), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_grouped_gemm(gpu_ctx, &ql.d, &qr.d, TW_OP_T, &gs_d, &out_d, 0), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "%s", tw_last_error());
  to_host(&out_g, &out_d);
  double *ex = (double *)calloc((size_t)(M * N), sizeof(double)), *ab = (double *)calloc((size_t)(M * N), sizeof(double));
  double *bound = (double *)malloc((size_t)(M * N) * sizeof(double));
  dref(M, N, K, ql.vals, ql.mags, K, 1, qr.vals, qr.mags, 1, K, ex, ab, N);
  add_bounds_m(ab, ex, M * N, K, TW_F32, promote_len(mode), bound);
  tw_tensor bt = tw_tensor_1d(bound, TW_F64, M * N, TW_MEM_HOST);
  tw_tensor g1 = tw_tensor_1d(out_g.data, TW_F32, M * N, TW_MEM_HOST), e1 = tw_tensor_1d(out_r.data, TW_F32, M * N, TW_MEM_HOST);
  tw_check_report rep;
  cr_assert_eq(tw_check_bound(&g1, &e1, &bt, &rep), TW_OK, "%s", tw_last_error());
  char buf[512];
  cr_log_info("planted %s %s: %s", tw_scaling_name(mode), plant ? "wrong scale" : "true scales",
              tw_check_format(&rep, buf, sizeof buf));
  *passed = rep.passed;
  double ratio = rep.worst_ratio;
  free(ex); free(ab); free(bound);
  dev_free(&out_d); dev_free(&gs_d);
  host_free(&out_r); host_free(&out_g); host_free(&gs); host_free(&x); host_free(&w);
  qop_free(&ql); qop_free(&qr);
  ctx_done();
  return ratio;
}
Test(grouped_gemm_gpu, gg_wgmma_fp8_bound_catches_planted_scales) {
  const tw_scaling modes[3] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_1x128, TW_SCALE_MXFP8_1D};
  for (int i = 0; i < 3; ++i) {
    int ok = 0;
    double r = planted_case(modes[i], 0, &ok);
    cr_assert(ok, "%s: true scales out of the model's bound (worst ratio %g)", tw_scaling_name(modes[i]), r);
    r = planted_case(modes[i], 1, &ok);
    cr_assert(!ok, "%s: a planted wrong scale passed the model's bound (worst ratio %g)", tw_scaling_name(modes[i]), r);
  }
}

/* gg_wgmma_fp8 declines by name: per-tensor rhs [G, K, N] (op N, c 0), and K not a multiple of
 * 16 (c 1); MXFP8 (cc 2, 3) with K = 24 as the colwise data of the [G*K, N] source (op N, which
 * it takes at K % 16 == 0) and as the rowwise [G*N, K] one (op T); then the MXFP8 colwise op N
 * rhs with its scale_inv at an odd address (cc 4: its scale warps read 32-bit words). */
Test(grouped_gemm_gpu, wgmma_fp8_version_declines_by_name) {
  ctx_for("gg_wgmma_fp8");
  const int64_t G = 1, M = 16;
  for (int cc = 0; cc < 5; ++cc) {
    const int c = cc == 4 ? 0 : cc % 2;
    const tw_scaling mode = cc < 2 ? TW_SCALE_TENSOR_CURRENT : TW_SCALE_MXFP8_1D;
    const int64_t K = cc == 0 || cc == 4 ? 64 : 24, N = 32;
    int64_t gsh[1] = {G}, ls[2] = {M, K}, ws[2] = {c == 0 ? G * K : G * N, c == 0 ? N : K}, os[2] = {M, N};
    tw_tensor gs = host_new(TW_I32, 1, gsh);
    ((int32_t *)gs.data)[0] = (int32_t)M;
    tw_tensor x = host_new(TW_F32, 2, ls), w = host_new(TW_F32, 2, ws);
    fill_random(&x, M, K);
    fill_random(&w, ws[0], ws[1]);
    int32_t ng = (int32_t)(c == 0 ? K : N);
    tw_tensor ugs = tw_tensor_1d(&ng, TW_I32, 1, TW_MEM_HOST);
    qop ql, qr;
    qop_make(&ql, mode, TW_E4M3, &x, &gs, 0);
    qop_make(&qr, mode, TW_E4M3, &w, &ugs, mode == TW_SCALE_MXFP8_1D && c == 0);
    tw_tensor out = host_new(TW_BF16, 2, os);
    tw_tensor od = dev_copy(&out), gd = dev_copy(&gs);
    void *keep = NULL;
    tw_tensor sc = qr.d.scale_inv;
    if (cc == 4) { /* a copy of the rhs scales one byte past an aligned allocation */
      const size_t b = tw_tensor_bytes(&sc);
      cr_assert_eq(tw_alloc(gpu_ctx, b + 16, &keep), TW_OK, "%s", tw_last_error());
      tw_tensor moved = sc;
      moved.data = (char *)keep + 1;
      cr_assert_eq(tw_tensor_copy(gpu_ctx, &moved, &sc), TW_OK, "%s", tw_last_error());
      qr.d.scale_inv.data = moved.data;
    }
    tw_status st = tw_grouped_gemm(gpu_ctx, &ql.d, &qr.d, c == 0 ? TW_OP_N : TW_OP_T, &gd, &od, 0);
    cr_assert_eq(st, TW_ERR_UNSUPPORTED, "case %d: %s", cc, tw_last_error());
    cr_assert(strstr(tw_last_error(), "gg_wgmma_fp8") != NULL, "message: %s", tw_last_error());
    if (cc == 4) cr_assert(strstr(tw_last_error(), "4-byte aligned") != NULL, "message: %s", tw_last_error());
    qr.d.scale_inv = sc;
    if (keep) tw_free(gpu_ctx, keep);
    dev_free(&od); dev_free(&gd);
    host_free(&out); host_free(&gs); host_free(&x); host_free(&w);
    qop_free(&ql); qop_free(&qr);
  }
  ctx_done();
}

RANDOM_TESTS(grouped_gemm_wgrad_gpu, wgrad_case)

/* gg_wgmma wgrad (lhs [M, K] and rhs [M, N], ops N; K and N rounded up to multiples of 8):
 * 400 random + 100 aligned bf16/f16 cases and a few large ones (many k-tiles per tile, several
 * 128 x 256 tiles per group), rows past the sizes' sum NaN; then fixed tail patterns. */
Test(grouped_gemm_wgrad_gpu, random_gg_wgmma_version, .timeout = 900) {
  ctx_for("gg_wgmma"); tma_dims = 1; nan_rest = 1;
  for (int s = 0; s < 400; ++s) wgrad_case(11000 + s, (int)(s % 2), BUDGET);
  tma_dims = 0; nan_rest = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma");
}
Test(grouped_gemm_wgrad_gpu, aligned_gg_wgmma_version, .timeout = 600) {
  ctx_for("gg_wgmma"); aligned_dims = 1; tma_dims = 1; nan_rest = 1;
  for (int s = 0; s < 100; ++s) wgrad_case(12000 + s, (int)(s % 2), BUDGET);
  aligned_dims = 0; tma_dims = 0; nan_rest = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_aligned");
}
Test(grouped_gemm_wgrad_gpu, large_gg_wgmma_version, .timeout = 900) {
  ctx_for("gg_wgmma"); tma_dims = 1; nan_rest = 1;
  for (int s = 0; s < 8; ++s) wgrad_case(13000 + s, (int)(s % 2), (int64_t)1 << 30);
  tma_dims = 0; nan_rest = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_large");
}
/* Group edges inside a 64-row k-tile: m_g = 1, 63, 64, 65, 0, 129, 2 (and a group of 1 last)
 * next to each other, K = 136 (a 128-row tile and an 8-row one), N = 264 (a 256 tile and an
 * 8-wide one), rows past the sum NaN; every output dtype, with and without accumulate, bf16
 * and f16. */
Test(grouped_gemm_wgrad_gpu, tails_gg_wgmma_version, .timeout = 600) {
  static const int32_t sizes[2][8] = {{1, 63, 64, 65, 0, 129, 2, 1}, {0, 0, 200, 0, 7, 0, 0, 1}};
  ctx_for("gg_wgmma"); tma_dims = 1; nan_rest = 1;
  for (int v = 0; v < 2; ++v)
    for (int o = 0; o < 3; ++o)
      for (int acc = 0; acc < 2; ++acc)
        for (int kind = 0; kind < 2; ++kind) {
          fixed_gs = sizes[v]; fixed_G = 8; fixed_M = 400; fixed_N = 264; fixed_K = 136;
          fixed_od = out_types[o]; fixed_acc = acc;
          wgrad_case(14000 + v, kind, BUDGET);
        }
  fixed_gs = NULL; tma_dims = 0; nan_rest = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_tails");
}

/* gg_wgmma's wgrad variants the bench times next to the default: one map per operand with the
 * tail rows zeroed by the consumers (TWIN_GG_WGMMA_WGRAD_MAPS=0) or by the producer warps
 * (TWIN_GG_WGMMA_WGRAD_ZERO=producer), and the register epilogue in place of the
 * TMA stores (TWIN_GG_WGMMA_WGRAD_REGSTORE=1): every random, large and tail case run by the
 * variant and by the default kernel, the same bits (and the bound against the ref). The
 * ping-pong and paired-CTA kernels of sessions 21-22 were removed (gpu/NOTES-gemm.md). */
static void variant_same_bits(const char *knob, const char *value) {
  static const int32_t sizes[2][8] = {{1, 63, 64, 65, 0, 129, 2, 1}, {0, 0, 200, 0, 7, 0, 0, 1}};
  /* knobs that would change both runs alike */
  unsetenv("TWIN_GG_WGMMA_WGRAD_ZERO"); unsetenv("TWIN_GG_WGMMA_WGRAD_NOMASK"); unsetenv("TWIN_GG_WGMMA_WGRAD_REGSTORE");
  unsetenv("TWIN_GG_WGMMA_WGRAD_MAPS");
  ctx_for("gg_wgmma"); tma_dims = 1; nan_rest = 1; variant_bits = 1; variant_knob = knob; variant_value = value; variant_cases = 0;
  const int n = getenv("GG_VARIANT_N") ? atoi(getenv("GG_VARIANT_N")) : 200;
  for (int s = 0; s < n; ++s) wgrad_case(15000 + s, (int)(s % 2), BUDGET);
  for (int s = 0; s < (n >= 200 ? 6 : 0); ++s) wgrad_case(13000 + s, (int)(s % 2), (int64_t)1 << 30);
  for (int v = 0; v < 2; ++v)
    for (int o = 0; o < 3; ++o)
      for (int acc = 0; acc < 2; ++acc) {
        fixed_gs = sizes[v]; fixed_G = 8; fixed_M = 400; fixed_N = 264; fixed_K = 136;
        fixed_od = out_types[o]; fixed_acc = acc;
        wgrad_case(14000 + v, (v + o + acc) % 2, BUDGET);
      }
  fixed_gs = NULL;
  cr_log_info("wgrad, %s=%s: %d cases, the same bits as the default kernel", knob, value, variant_cases);
  cr_assert_gt(variant_cases, 0, "no case ran both kernels");
  variant_bits = 0; variant_knob = variant_value = NULL; tma_dims = 0; nan_rest = 0; ctx_done();
  cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_variants");
}
Test(grouped_gemm_wgrad_gpu, producer_zeroing_same_bits_gg_wgmma_version, .timeout = 900) {
  variant_same_bits("TWIN_GG_WGMMA_WGRAD_ZERO", "producer");
}
/* gpu/grouped_gemm_wgmma.cu: calls of gg_wgmma's wgrad that took the per-group maps */
long gg_wgmma_wgrad_map_calls(void);
Test(grouped_gemm_wgrad_gpu, consumer_zeroing_same_bits_gg_wgmma_version, .timeout = 900) {
  const long before = gg_wgmma_wgrad_map_calls();
  variant_same_bits("TWIN_GG_WGMMA_WGRAD_MAPS", "0"); /* the default's per-group maps vs one map + zeroing */
  cr_assert_gt(gg_wgmma_wgrad_map_calls(), before, "the default wgrad never took the per-group maps");
}
/* More groups than the per-group maps fit in the context's scratch (2G x 128 bytes past 1 MiB):
 * the wgrad takes the zeroing path instead of an overflow allocation, and stays right. */
Test(grouped_gemm_wgrad_gpu, more_groups_than_map_scratch_gg_wgmma_version, .timeout = 300) {
  enum { NG = 4400 };
  static int32_t sizes[NG];
  int64_t sum = 0;
  for (int g = 0; g < NG; ++g) { sizes[g] = (int32_t)((g * 7) % 5); sum += sizes[g]; }
  ctx_for("gg_wgmma"); tma_dims = 1; nan_rest = 1;
  const long before = gg_wgmma_wgrad_map_calls();
  fixed_gs = sizes; fixed_G = NG; fixed_M = sum + 3; fixed_N = 16; fixed_K = 8; fixed_od = TW_BF16; fixed_acc = 0;
  wgrad_case(16000, 0, BUDGET);
  cr_assert_eq(gg_wgmma_wgrad_map_calls(), before, "2G maps past the scratch were taken");
  fixed_gs = NULL; tma_dims = 0; nan_rest = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_many_groups");
}
Test(grouped_gemm_wgrad_gpu, register_epilogue_same_bits_gg_wgmma_version, .timeout = 900) {
  variant_same_bits("TWIN_GG_WGMMA_WGRAD_REGSTORE", "1");
}

/* gg_wgmma_fp8 wgrad (fp8 wgmma from the colwise copies, promoted every 128 tokens of a group):
 * per-tensor (current, delayed), 1x128 and 128x128 (fp8_mode_count = 4), e4m3/e5m2 pairs, any
 * K and N, group starts anywhere (so the token rows sit at any byte alignment), zero and skewed
 * groups, rows past the sum poisoned; random, aligned, large, then fixed tail patterns. */
Test(grouped_gemm_wgrad_gpu, random_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8w_colwise = 1; fp8_mode_count = 4;
  for (int s = 0; s < 300; ++s) wgrad_case(21000 + s, 3, BUDGET);
  fp8_mode_count = 5; fp8w_colwise = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8");
}
Test(grouped_gemm_wgrad_gpu, aligned_gg_wgmma_fp8_version, .timeout = 600) {
  ctx_for("gg_wgmma_fp8"); fp8w_colwise = 1; fp8_mode_count = 4; aligned_dims = 1;
  for (int s = 0; s < 100; ++s) wgrad_case(22000 + s, 3, BUDGET);
  aligned_dims = 0; fp8_mode_count = 5; fp8w_colwise = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_aligned");
}
Test(grouped_gemm_wgrad_gpu, large_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8w_colwise = 1; fp8_mode_count = 4;
  for (int s = 0; s < 8; ++s) wgrad_case(23000 + s, 3, (int64_t)1 << 30);
  fp8_mode_count = 5; fp8w_colwise = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_large");
}
/* Token blocks inside and across groups: m_g = 1, 127, 128, 129, 0, 257, 3, 1 (block ends at
 * 128 within each group, never at a multiple of 128 of the whole tensor), K = 136, N = 264,
 * every output dtype, with and without accumulate, per mode. */
Test(grouped_gemm_wgrad_gpu, tails_gg_wgmma_fp8_version, .timeout = 600) {
  static const int32_t sizes[2][8] = {{1, 127, 128, 129, 0, 257, 3, 1}, {0, 0, 300, 0, 17, 0, 0, 1}};
  ctx_for("gg_wgmma_fp8"); fp8w_colwise = 1; fp8_mode_count = 4;
  for (int v = 0; v < 2; ++v)
    for (int o = 0; o < 3; ++o)
      for (int acc = 0; acc < 2; ++acc)
        for (int m = 0; m < 4; ++m) {
          fixed_gs = sizes[v]; fixed_G = 8; fixed_M = 700; fixed_N = 264; fixed_K = 136;
          fixed_od = out_types[o]; fixed_acc = acc;
          wgrad_case(24000 + 16 * v + 4 * o + m, 3, BUDGET);
        }
  fixed_gs = NULL; fp8_mode_count = 5; fp8w_colwise = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_tails");
}
/* gg_wgmma_fp8's wgrad: tiles leaving by TMA store (the default without accumulate, rows of N a
 * 16-byte multiple) against the staged epilogue (TWIN_GG_WGMMA_FP8_WGRAD_EPI=staged, read on
 * every call): the same bits, every output dtype, per-tensor / 1x128 / 128x128, group edges,
 * empty and one-token groups, K and N tails (the store clips at K and N). */
Test(grouped_gemm_wgrad_gpu, epilogue_bits_gg_wgmma_fp8_version, .timeout = 300) {
  ctx_for("gg_wgmma_fp8");
  static const tw_scaling modes[3] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};
  for (int s = 0; s < 27; ++s) {
    rng_s = (uint64_t)(26000 + s) * 7919 + 5;
    const tw_scaling mode = modes[s % 3];
    const tw_dtype od = out_types[(s / 3) % 3];
    const int64_t G = irange(1, 12), M = irange(0, 700), K = irange(1, 300);
    const int64_t N = (od == TW_F32 ? 4 : 8) * irange(1, 50);
    int64_t gsh[1] = {G}, lsh[2] = {M, K}, rsh[2] = {M, N}, os[3] = {G, K, N};
    tw_tensor gs = host_new(TW_I32, 1, gsh), x = host_new(TW_F32, 2, lsh), y = host_new(TW_F32, 2, rsh);
    random_groups(G, M, (int32_t *)gs.data);
    if (G > 2) ((int32_t *)gs.data)[1] += ((int32_t *)gs.data)[0], ((int32_t *)gs.data)[0] = 0; /* an empty group */
    fill_random(&x, M, K);
    fill_random(&y, M, N);
    qop ql, qr;
    qop_make(&ql, mode, TW_E4M3, &x, &gs, 1);
    qop_make(&qr, mode, (s & 1) ? TW_E5M2 : TW_E4M3, &y, &gs, 1);
    tw_tensor o_tma = host_new(od, 3, os), o_stg = host_new(od, 3, os);
    tw_tensor gs_d = dev_copy(&gs), od_tma = dev_copy(&o_tma), od_stg = dev_copy(&o_stg); /* poisoned alike */
    cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &ql.d, TW_OP_T, &qr.d, TW_OP_T, &gs_d, &od_tma, 0), TW_OK,
                 "case %d: %s", s, tw_last_error());
    setenv("TWIN_GG_WGMMA_FP8_WGRAD_EPI", "staged", 1);
    cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &ql.d, TW_OP_T, &qr.d, TW_OP_T, &gs_d, &od_stg, 0), TW_OK,
                 "case %d: %s", s, tw_last_error());
    unsetenv("TWIN_GG_WGMMA_FP8_WGRAD_EPI");
    cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "case %d: %s", s, tw_last_error());
    to_host(&o_tma, &od_tma);
    to_host(&o_stg, &od_stg);
    cr_assert(memcmp(o_tma.data, o_stg.data, tw_tensor_bytes(&o_tma)) == 0,
              "case %d (%s -> %s, G=%lld M=%lld N=%lld K=%lld): TMA-store and staged epilogues differ", s,
              tw_scaling_name(mode), tw_dtype_name(od), (long long)G, (long long)M, (long long)N, (long long)K);
    qop_free(&ql); qop_free(&qr);
    dev_free(&gs_d); dev_free(&od_tma); dev_free(&od_stg);
    host_free(&gs); host_free(&x); host_free(&y); host_free(&o_tma); host_free(&o_stg);
  }
  ctx_done();
}
/* gg_wgmma_fp8's wgrad with the consumers taking turns (TWIN_GG_WGMMA_FP8_WGRAD_ORDER=1: gate
 * opened at issue, =2: at completion; read on every call) or skewed (no turns,
 * TWIN_GG_WGMMA_FP8_WGRAD_SKEW=1 and =3, the latter clamped to stages - 2) against neither: the
 * same promotion in the same order, so the same bits. Per-tensor current and delayed, 1x128, 128x128
 * and 1x128 x 128x128; e4m3/e5m2; every output dtype; accumulate on (staged epilogue) and off
 * (TMA store); the three loaders (tma; rows and staged every fourth case each) and the scale
 * warps (every third block-scale case). The gates must open as often as they are waited on
 * whatever k-blocks a CTA gets: ragged groups with empty ones, the last group(s) empty (a CTA's
 * last tile then has no k-block), all groups empty (M = 0), K tails, and many tiles per CTA
 * (G up to 48 with K, N up to 520: more tiles than SMs). Half the cases with the column tile at
 * 192 (TWIN_GG_WGMMA_FP8_WGRAD_BN; the tma loader's), half at 128. A hang here is a gate out of
 * balance (or a skew gate: warpgroup 1 waits for warpgroup 0's first k-blocks, which a CTA may
 * not have). `small`: 8 small cases (the sanitizers' run). */
static void order_bits_cases(int n, int small) {
  ctx_for("gg_wgmma_fp8");
  static const char *const knobs[5] = {"TWIN_GG_WGMMA_FP8_WGRAD_ORDER", "TWIN_GG_WGMMA_FP8_WGRAD_LOADER",
                                       "TWIN_GG_WGMMA_FP8_WGRAD_SCALES", "TWIN_GG_WGMMA_FP8_WGRAD_BN",
                                       "TWIN_GG_WGMMA_FP8_WGRAD_SKEW"};
  /* variant v: turns order[v], skew skew[v] (0: none) */
  enum { NV = 5 };
  static const char *const order[NV] = {"0", "1", "2", "0", "0"}, *const skew[NV] = {"0", "0", "0", "1", "3"};
  char keep[5][16];
  int had[5];
  for (int i = 0; i < 5; ++i) {
    const char *v = getenv(knobs[i]);
    had[i] = v != NULL;
    snprintf(keep[i], sizeof keep[i], "%s", v ? v : "");
  }
  for (int s = 0; s < n; ++s) {
    rng_s = (uint64_t)(27000 + s + (small ? 500 : 0)) * 7919 + 43;
    const int mi = s % 5, acc = (int)(rnd() & 1), warps = mi >= 2 && (s / 5) % 3 == 2;
    const char *loader = small || s % 4 < 2 ? NULL : s % 4 == 2 ? "rows" : "staged";
    const int many = !small && s % 3 == 0; /* more tiles than SMs: each CTA walks several */
    const int64_t G = many ? irange(24, 48) : small ? irange(1, 5) : irange(1, 10);
    const int64_t K = many ? irange(200, 520) : irange(1, small ? 200 : 300);
    const int64_t N = many ? irange(200, 520) : irange(1, small ? 200 : 400);
    int64_t M = irange(0, 3) == 0 ? irange(0, 64 * G) : irange(64 * G, (small ? 200 : 400) * G);
    if (s % 11 == 5) M = 0; /* every group empty: no k-block anywhere */
    const tw_dtype od = out_types[rnd() % 3];
    const tw_dtype qa = (rnd() & 1) ? TW_E4M3 : TW_E5M2, qb = qa == TW_E5M2 || (rnd() & 1) ? TW_E4M3 : TW_E5M2;
    int64_t os[3] = {G, K, N};
    wbits c;
    int32_t *g32 = wbits_groups(&c, G, M, K, N);
    if (G > 1 && s % 2) { /* the last group(s) empty */
      const int64_t e = G > 4 && s % 4 == 1 ? 3 : 1;
      for (int64_t g = G - e; g < G; ++g) g32[0] += g32[g], g32[g] = 0;
    }
    wbits_quantize(&c, mi, qa, qb);
    tw_tensor o[NV];
    for (int i = 0; i < NV; ++i) o[i] = host_new(od, 3, os);
    init_out(&o[0], acc);
    for (int i = 1; i < NV; ++i) memcpy(o[i].data, o[0].data, tw_tensor_bytes(&o[0]));
    tw_tensor gs_d = dev_copy(&c.gs), od_[NV];
    for (int i = 0; i < NV; ++i) od_[i] = dev_copy(&o[i]);
    if (warps) setenv(knobs[2], "warps", 1);
    else unsetenv(knobs[2]);
    if (loader) setenv(knobs[1], loader, 1);
    else unsetenv(knobs[1]);
    setenv(knobs[3], (s / 4) % 2 ? "192" : "128", 1); /* 192: the tma loader's 128 x 192 tiles */
    for (int i = 0; i < NV; ++i) {
      setenv(knobs[0], order[i], 1);
      setenv(knobs[4], skew[i], 1);
      cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &c.ql.d, TW_OP_T, &c.qr.d, TW_OP_T, &gs_d, &od_[i], acc), TW_OK,
                   "case %d turns %s skew %s: %s", s, order[i], skew[i], tw_last_error());
    }
    cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "case %d: %s", s, tw_last_error());
    for (int i = 0; i < NV; ++i) to_host(&o[i], &od_[i]);
    for (int i = 1; i < NV; ++i)
      cr_assert(memcmp(o[0].data, o[i].data, tw_tensor_bytes(&o[0])) == 0,
                "case %d (%s x %s, %s x %s -> %s, G=%lld M=%lld N=%lld K=%lld acc %d loader %s scales %s BN %d): "
                "turns %s skew %s and neither differ",
                s, tw_scaling_name(wbits_ml[mi]), tw_scaling_name(wbits_mr[mi]), tw_dtype_name(qa), tw_dtype_name(qb),
                tw_dtype_name(od), (long long)G, (long long)M, (long long)N, (long long)K, acc,
                loader ? loader : "tma", warps ? "warps" : "tma", (s / 4) % 2 ? 192 : 128, order[i], skew[i]);
    wbits_free(&c);
    dev_free(&gs_d);
    for (int i = 0; i < NV; ++i) dev_free(&od_[i]), host_free(&o[i]);
  }
  for (int i = 0; i < 5; ++i)
    if (had[i]) setenv(knobs[i], keep[i], 1);
    else unsetenv(knobs[i]);
  ctx_done();
}
Test(grouped_gemm_wgrad_gpu, order_bits_gg_wgmma_fp8_version, .timeout = 300) { order_bits_cases(60, 0); }
Test(grouped_gemm_wgrad_gpu, order_bits_small_gg_wgmma_fp8_version, .timeout = 300) { order_bits_cases(8, 1); }

/* The token-padded colwise layout (tw_quantize.h, opts.col_padded), written here from the default
 * copy by the header's formula alone: [C, 128*T_cap], group g's token i at column 128*T(g) + i,
 * code 0 to the group's next 128 boundary, poison past 128*T(G) (never read). */
static tw_operand padded_copy(const qop *o, const int32_t *gs, int64_t G, tw_tensor *host, tw_tensor *dev) {
  const int64_t R = o->hq.rows, C = o->hq.cols, Gn = G < R ? G : R, pitch = 128 * ((R + 127 * Gn) / 128);
  int64_t sh[2] = {C, pitch};
  *host = host_new(o->hq.col_data.dtype, 2, sh);
  uint8_t *P = (uint8_t *)host->data;
  const uint8_t *D = (const uint8_t *)o->hq.col_data.data;
  memset(P, TW_POISON_BYTE, tw_tensor_bytes(host));
  int64_t og = 0, tg = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = gs[g], padded = 128 * ((m + 127) / 128);
    for (int64_t k = 0; k < C; ++k)
      for (int64_t i = 0; i < padded; ++i) P[k * pitch + 128 * tg + i] = i < m ? D[og * C + k * m + i] : 0;
    og += m;
    tg += padded / 128;
  }
  *dev = dev_copy(host);
  tw_operand d = o->d;
  d.data = *dev;
  d.col_padded = 1;
  return d;
}
/* The wgrad from token-padded operands (either or both) against the default layout, bit for bit,
 * on a version: every scale pairing of wbits, ragged groups with an empty and a 1-token group,
 * K and N tails, e4m3/e5m2, every output dtype, accumulate on and off; on gg_wgmma_fp8 the padded
 * side skips the copy pass (the other side alone is copied: the mixed pairs). */
static void padded_bits_cases(const char *version, int n) {
  ctx_for(version);
  for (int s = 0; s < n; ++s) {
    rng_s = (uint64_t)(41000 + s) * 7919 + 17;
    const int mi = s % 5, acc = (int)(rnd() & 1);
    const int64_t G = irange(1, 9), K = irange(1, 400), N = irange(1, 3) == 1 ? 192 * irange(1, 3) : irange(1, 520);
    int64_t M = irange(0, 3) == 0 ? irange(0, 64 * G) : irange(64 * G, 300 * G);
    if (s % 10 == 7) M = 0; /* no tokens: a padded copy is [C, 0] (fuzz repro gpu-wgrad-padded-m0) */
    int64_t os[3] = {G, K, N};
    wbits c;
    tw_dtype od, qa, qb;
    wbits_random(&c, mi, G, M, K, N, &od, &qa, &qb);
    const int32_t *g32 = (const int32_t *)c.gs.data;
    tw_tensor hl, dl, hr, dr;
    const tw_operand pl = padded_copy(&c.ql, g32, G, &hl, &dl), pr = padded_copy(&c.qr, g32, G, &hr, &dr);
    tw_tensor want = host_new(od, 3, os), got = host_new(od, 3, os);
    init_out(&want, acc);
    tw_tensor init = host_new(od, 3, os);
    memcpy(init.data, want.data, tw_tensor_bytes(&want));
    tw_tensor gs_d = dev_copy(&c.gs), od0 = dev_copy(&want);
    cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &c.ql.d, TW_OP_T, &c.qr.d, TW_OP_T, &gs_d, &od0, acc), TW_OK,
                 "%s case %d: %s", version, s, tw_last_error());
    to_host(&want, &od0);
    const tw_operand *pairs[3][2] = {{&pl, &pr}, {&pl, &c.qr.d}, {&c.ql.d, &pr}};
    /* every third case with the register loader asked for: padded operands run the tma loader anyway */
    const int knob = s % 3 == 1;
    for (int p = 0; p < 3; ++p) {
      tw_tensor od1 = dev_copy(&init);
      if (knob) setenv("TWIN_GG_WGMMA_FP8_WGRAD_LOADER", "rows", 1);
      const tw_status st = tw_grouped_gemm_wgrad(gpu_ctx, pairs[p][0], TW_OP_T, pairs[p][1], TW_OP_T, &gs_d, &od1, acc);
      unsetenv("TWIN_GG_WGMMA_FP8_WGRAD_LOADER");
      cr_assert_eq(st, TW_OK, "%s case %d pair %d (loader knob %s): %s", version, s, p, knob ? "rows" : "unset",
                   tw_last_error());
      cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "%s case %d: %s", version, s, tw_last_error());
      to_host(&got, &od1);
      cr_assert(memcmp(want.data, got.data, tw_tensor_bytes(&want)) == 0,
                "%s case %d pair %d (%s x %s, %s x %s -> %s, G=%lld M=%lld N=%lld K=%lld acc %d): the token-padded "
                "operands give other bits", version, s, p, tw_scaling_name(wbits_ml[mi]), tw_scaling_name(wbits_mr[mi]),
                tw_dtype_name(qa), tw_dtype_name(qb), tw_dtype_name(od), (long long)G, (long long)M, (long long)N,
                (long long)K, acc);
      dev_free(&od1);
    }
    wbits_free(&c);
    host_free(&hl); host_free(&hr); dev_free(&dl); dev_free(&dr);
    dev_free(&gs_d); dev_free(&od0);
    host_free(&want); host_free(&got); host_free(&init);
  }
  ctx_done();
}
Test(grouped_gemm_wgrad_gpu, padded_bits_gg_wgmma_fp8_version, .timeout = 300) { padded_bits_cases("gg_wgmma_fp8", 40); }
/* gg_lt_loop (forced only) slices the default layout per group: a padded operand is refused. */
Test(grouped_gemm_wgrad_gpu, padded_refused_by_gg_lt_loop) {
  ctx_for("gg_lt_loop");
  rng_s = 4242;
  wbits c;
  tw_dtype od, qa, qb;
  wbits_random(&c, 0, 3, 300, 64, 48, &od, &qa, &qb);
  tw_tensor hl, dl;
  const tw_operand pl = padded_copy(&c.ql, (const int32_t *)c.gs.data, 3, &hl, &dl);
  int64_t os[3] = {3, 64, 48};
  tw_tensor o = host_new(od, 3, os), gs_d = dev_copy(&c.gs), od0 = dev_copy(&o);
  cr_assert_eq(tw_grouped_gemm_wgrad(gpu_ctx, &pl, TW_OP_T, &c.qr.d, TW_OP_T, &gs_d, &od0, 0), TW_ERR_UNSUPPORTED);
  cr_assert(strstr(tw_last_error(), "kernel 'gg_lt_loop' reads the default colwise layout, not a token-padded operand"),
            "%s", tw_last_error());
  wbits_free(&c);
  host_free(&hl); dev_free(&dl); dev_free(&gs_d); dev_free(&od0); host_free(&o);
  ctx_done();
}
Test(grouped_gemm_wgrad_gpu, padded_bits_gg_mma_wide_version, .timeout = 300) { padded_bits_cases("gg_mma_wide", 25); }
/* auto picks it for the fp8 wgrad from colwise copies on sm_90 (the MoE block's fp8 wgrads) */
Test(grouped_gemm_wgrad_gpu, random_fp8_auto_colwise, .timeout = 900) {
  ctx_for(NULL); fp8w_colwise = 1; fp8_mode_count = 4;
  for (int s = 0; s < 150; ++s) wgrad_case(25000 + s, 3, BUDGET);
  fp8_mode_count = 5; fp8w_colwise = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.fp8_auto_colwise");
}
/* gg_wgmma_fp8's wgrad declines rowwise (op N) operands by name */
Test(grouped_gemm_wgrad_gpu, wgmma_fp8_version_declines_rowwise) {
  ctx_for("gg_wgmma_fp8");
  const int64_t G = 2, M = 40, K = 32, N = 48;
  int64_t gsh[1] = {G}, ls[2] = {M, K}, rs[2] = {M, N}, os[3] = {G, K, N};
  tw_tensor gs = host_new(TW_I32, 1, gsh);
  ((int32_t *)gs.data)[0] = 15;
  ((int32_t *)gs.data)[1] = 25;
  tw_tensor x = host_new(TW_F32, 2, ls), y = host_new(TW_F32, 2, rs);
  fill_random(&x, M, K);
  fill_random(&y, M, N);
  qop ql, qr;
  qop_make(&ql, TW_SCALE_TENSOR_CURRENT, TW_E4M3, &x, &gs, 0);
  qop_make(&qr, TW_SCALE_TENSOR_CURRENT, TW_E4M3, &y, &gs, 0);
  tw_tensor out = host_new(TW_F32, 3, os);
  tw_tensor od = dev_copy(&out), gd = dev_copy(&gs);
  tw_status st = tw_grouped_gemm_wgrad(gpu_ctx, &ql.d, TW_OP_N, &qr.d, TW_OP_N, &gd, &od, 0);
  cr_assert_eq(st, TW_ERR_UNSUPPORTED, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "gg_wgmma_fp8") != NULL, "message: %s", tw_last_error());
  dev_free(&od); dev_free(&gd);
  host_free(&out); host_free(&gs); host_free(&x); host_free(&y);
  qop_free(&ql); qop_free(&qr);
  ctx_done();
}

/* gg_wgmma_fp8 MXFP8 wgrad (colwise [M, K] / [M, N] data, ops N, E8M0 scales every 32 tokens of
 * a group, compact or swizzled at random; promoted every 32: tw_gemm_error_bound_promoted(..,
 * m_g, 32, ..)): random ragged groups (zero groups, sizes not multiples of 32, skewed), any K and
 * N (rows not 16-byte multiples: the pad pass's byte path), e4m3/e5m2 pairs, f32/bf16/f16 out,
 * accumulate; aligned shapes (its 16-byte path), large ones, then fixed tail patterns. */
Test(grouped_gemm_wgrad_gpu, mxfp8_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8w_only_mxfp8 = 1;
  for (int s = 0; s < 200; ++s) wgrad_case(27000 + s, 3, BUDGET);
  fp8w_only_mxfp8 = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_mxfp8");
}
Test(grouped_gemm_wgrad_gpu, aligned_mxfp8_gg_wgmma_fp8_version, .timeout = 600) {
  ctx_for("gg_wgmma_fp8"); fp8w_only_mxfp8 = 1; aligned_dims = 1;
  for (int s = 0; s < 60; ++s) wgrad_case(27500 + s, 3, BUDGET);
  aligned_dims = 0; fp8w_only_mxfp8 = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_mxfp8_aligned");
}
Test(grouped_gemm_wgrad_gpu, large_mxfp8_gg_wgmma_fp8_version, .timeout = 900) {
  ctx_for("gg_wgmma_fp8"); fp8w_only_mxfp8 = 1;
  for (int s = 0; s < 4; ++s) wgrad_case(27800 + s, 3, (int64_t)1 << 30);
  fp8w_only_mxfp8 = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_mxfp8_large");
}
/* 32-token blocks inside and across groups: m_g = 1, 31, 32, 33, 0, 127, 128, 129 and 257, 3,
 * 65, 0, 96, 1, 0, 160 (a group's blocks end at multiples of 32 of the group, never of the tensor),
 * K = 136 and N = 264 (tails of 8), then K = 128 and N = 512 (the 16-byte pad path and the TMA
 * store without tails), every output dtype, with and without accumulate (sanitizers run this). */
Test(grouped_gemm_wgrad_gpu, tails_mxfp8_gg_wgmma_fp8_version, .timeout = 600) {
  static const int32_t sizes[2][8] = {{1, 31, 32, 33, 0, 127, 128, 129}, {257, 3, 65, 0, 96, 1, 0, 160}};
  static const int64_t kn[2][2] = {{136, 264}, {128, 512}};
  ctx_for("gg_wgmma_fp8"); fp8w_only_mxfp8 = 1;
  for (int v = 0; v < 2; ++v)
    for (int d = 0; d < 2; ++d)
      for (int o = 0; o < 3; ++o)
        for (int acc = 0; acc < 2; ++acc) {
          fixed_gs = sizes[v]; fixed_G = 8; fixed_M = 700; fixed_K = kn[d][0]; fixed_N = kn[d][1];
          fixed_od = out_types[o]; fixed_acc = acc;
          wgrad_case(28000 + 16 * v + 8 * d + 2 * o + acc, 3, BUDGET);
        }
  fixed_gs = NULL; fp8w_only_mxfp8 = 0; ctx_done(); cases_done("grouped_gemm_wgrad_gpu.gg_wgmma_fp8_mxfp8_tails");
}
/* auto runs the MXFP8 wgrad on gg_wgmma_fp8 on sm_90: its output is bit-identical to the forced
 * gg_wgmma_fp8's on each case, and differs from the exact gg_mma_wide's on at least one (so the
 * comparison can tell them apart). Elsewhere auto must not take it: then it matches gg_mma_wide. */
Test(grouped_gemm_wgrad_gpu, auto_takes_mxfp8, .timeout = 300) {
  ctx_for(NULL);
  const int sm90 = device_is_sm90();
  const char *names[2] = {"gg_wgmma_fp8", "gg_mma_wide"};
  tw_ctx *forced_ctx[2];
  for (int i = 0; i < 2; ++i) {
    tw_ctx_config c = TW_CTX_CONFIG_INIT;
    c.backend = TW_BACKEND_GPU;
    c.kernel = names[i];
    cr_assert_eq(tw_ctx_create(&forced_ctx[i], &c), TW_OK, "%s", tw_last_error());
  }
  int differs_from_exact = 0;
  for (int s = 0; s < 8; ++s) {
    rng_s = (uint64_t)(29000 + s) * 7919 + 11;
    const int64_t G = irange(1, 9), M = irange(64, 900), K = irange(1, 300), N = irange(1, 300);
    const tw_dtype od = out_types[s % 3];
    int64_t gsh[1] = {G}, lsh[2] = {M, K}, rsh[2] = {M, N}, os[3] = {G, K, N};
    tw_tensor gs = host_new(TW_I32, 1, gsh), x = host_new(TW_F32, 2, lsh), y = host_new(TW_F32, 2, rsh);
    random_groups(G, M, (int32_t *)gs.data);
    fill_random(&x, M, K);
    fill_random(&y, M, N);
    qop ql, qr;
    qop_make(&ql, TW_SCALE_MXFP8_1D, TW_E4M3, &x, &gs, 1);
    qop_make(&qr, TW_SCALE_MXFP8_1D, (s & 1) ? TW_E5M2 : TW_E4M3, &y, &gs, 1);
    tw_tensor o[3], d[3];
    tw_tensor gs_d = dev_copy(&gs);
    tw_ctx *cx[3] = {gpu_ctx, forced_ctx[0], forced_ctx[1]};
    for (int i = 0; i < 3; ++i) {
      o[i] = host_new(od, 3, os);
      d[i] = dev_copy(&o[i]); /* poisoned alike */
      cr_assert_eq(tw_grouped_gemm_wgrad(cx[i], &ql.d, TW_OP_N, &qr.d, TW_OP_N, &gs_d, &d[i], 0), TW_OK,
                   "case %d (%s): %s", s, i ? names[i - 1] : "auto", tw_last_error());
      cr_assert_eq(tw_ctx_check(cx[i]), TW_OK, "case %d: %s", s, tw_last_error());
      to_host(&o[i], &d[i]);
    }
    const size_t nb = tw_tensor_bytes(&o[0]);
    const int same_fast = memcmp(o[0].data, o[1].data, nb) == 0, same_exact = memcmp(o[0].data, o[2].data, nb) == 0;
    if (sm90) cr_assert(same_fast, "case %d (G=%lld M=%lld K=%lld N=%lld -> %s): auto differs from forced gg_wgmma_fp8", s,
                        (long long)G, (long long)M, (long long)K, (long long)N, tw_dtype_name(od));
    else cr_assert(same_exact, "case %d: auto off sm_90 differs from gg_mma_wide", s);
    differs_from_exact += memcmp(o[1].data, o[2].data, nb) != 0;
    for (int i = 0; i < 3; ++i) { dev_free(&d[i]); host_free(&o[i]); }
    qop_free(&ql); qop_free(&qr);
    dev_free(&gs_d); host_free(&gs); host_free(&x); host_free(&y);
  }
  if (sm90) cr_assert(differs_from_exact > 0, "gg_wgmma_fp8 and gg_mma_wide agreed bit for bit on every case");
  for (int i = 0; i < 2; ++i) tw_ctx_destroy(forced_ctx[i]);
  ctx_done();
}
/* What the MXFP8 wgrad still declines by name (TW_ERR_UNSUPPORTED naming gg_wgmma_fp8 and why):
 * an lhs or rhs scale_inv that is not 4-byte aligned (its scale warps read 32-bit words); auto
 * then runs gg_mma_wide and is right. Data at an odd address is taken (the transposing pad pass
 * reads such rows byte by byte) and is checked against ref with the promoted bound. */
Test(grouped_gemm_wgrad_gpu, mxfp8_wgmma_fp8_declines_and_odd_data) {
  const int64_t G = 3, M = 150, K = 72, N = 40;
  int64_t gsh[1] = {G}, lsh[2] = {M, K}, rsh[2] = {M, N}, os[3] = {G, K, N};
  for (int c = 0; c < 3; ++c) { /* 0: lhs scales odd, 1: rhs scales odd, 2: both data odd (taken) */
    ctx_for(c < 2 && (c & 1) ? NULL : "gg_wgmma_fp8");
    rng_s = 30000 + (uint64_t)c;
    tw_tensor gs = host_new(TW_I32, 1, gsh), x = host_new(TW_F32, 2, lsh), y = host_new(TW_F32, 2, rsh);
    ((int32_t *)gs.data)[0] = 37; ((int32_t *)gs.data)[1] = 0; ((int32_t *)gs.data)[2] = 100;
    fill_random(&x, M, K);
    fill_random(&y, M, N);
    qop ql, qr;
    qop_make(&ql, TW_SCALE_MXFP8_1D, TW_E4M3, &x, &gs, 1);
    qop_make(&qr, TW_SCALE_MXFP8_1D, TW_E4M3, &y, &gs, 1);
    /* the moved tensor: a copy one byte past a 16-byte aligned allocation */
    tw_tensor *mv = c == 0 ? &ql.d.scale_inv : c == 1 ? &qr.d.scale_inv : &ql.d.data;
    tw_tensor *mv2 = c == 2 ? &qr.d.data : NULL;
    void *keep[2] = {NULL, NULL};
    tw_tensor *mvs[2] = {mv, mv2};
    for (int i = 0; i < 2; ++i) {
      if (!mvs[i]) continue;
      const size_t b = tw_tensor_bytes(mvs[i]);
      cr_assert_eq(tw_alloc(gpu_ctx, b + 16, &keep[i]), TW_OK, "%s", tw_last_error());
      /* the quantization ran on the context's non-blocking stream: finish it before the copy */
      cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
      cr_assert_eq(cudaMemcpy((char *)keep[i] + 1, mvs[i]->data, b, cudaMemcpyDeviceToDevice), cudaSuccess);
      /* the copy ran on the legacy stream, which the context's stream does not wait for */
      cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
      mvs[i]->data = (char *)keep[i] + 1;
    }
    tw_tensor out = host_new(TW_F32, 3, os), ref = host_new(TW_F32, 3, os);
    tw_tensor od = dev_copy(&out), gd = dev_copy(&gs);
    tw_status st = tw_grouped_gemm_wgrad(gpu_ctx, &ql.d, TW_OP_N, &qr.d, TW_OP_N, &gd, &od, 0);
    if (c == 0) {
      cr_assert_eq(st, TW_ERR_UNSUPPORTED, "%s", tw_last_error());
      cr_assert(strstr(tw_last_error(), "gg_wgmma_fp8") && strstr(tw_last_error(), "4-byte aligned"), "message: %s",
                tw_last_error());
    } else {
      cr_assert_eq(st, TW_OK, "case %d: %s", c, tw_last_error()); /* c 1: auto falls back; c 2: taken */
      cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "%s", tw_last_error());
      to_host(&out, &od);
      cr_assert_eq(tw_grouped_gemm_wgrad(ref_ctx, &ql.h, TW_OP_N, &qr.h, TW_OP_N, &gs, &ref, 0), TW_OK, "%s",
                   tw_last_error());
      const int64_t n = G * K * N;
      double *ex = (double *)calloc((size_t)n, sizeof(double)), *ab = (double *)calloc((size_t)n, sizeof(double));
      double *bound = (double *)malloc((size_t)n * sizeof(double));
      for (int64_t g = 0, o = 0; g < G; o += ((int32_t *)gs.data)[g], ++g) {
        const int64_t m = ((int32_t *)gs.data)[g], b = g * K * N;
        if (m == 0) { for (int64_t i = 0; i < K * N; ++i) bound[b + i] = -1; continue; }
        dref(K, N, m, ql.vals + o * K, (c == 2 ? ql.mags : ql.vals) + o * K, 1, K, qr.vals + o * N,
             (c == 2 ? qr.mags : qr.vals) + o * N, N, 1, ex + b, ab + b, N);
        add_bounds_m(ab + b, ex + b, K * N, m, TW_F32, c == 2 ? 32 : 0, bound + b); /* c 1: gg_mma_wide, exact */
      }
      check_case(c == 1 ? "mxfp8 wgrad, rhs scales odd (auto)" : "mxfp8 wgrad, odd data", &out, &ref, bound);
      free(ex); free(ab); free(bound);
    }
    for (int i = 0; i < 2; ++i) {
      if (mvs[i]) mvs[i]->data = NULL; /* not ours to free twice: the qop frees its own */
      if (keep[i]) tw_free(gpu_ctx, keep[i]);
    }
    /* restore the qop's own device pointers for qop_free: rebuild from dq */
    ql.d = tw_operand_colwise(&ql.dq);
    qr.d = tw_operand_colwise(&qr.dq);
    dev_free(&od); dev_free(&gd);
    host_free(&out); host_free(&ref); host_free(&gs); host_free(&x); host_free(&y);
    qop_free(&ql); qop_free(&qr);
    ctx_done();
    cases_done("grouped_gemm_wgrad_gpu.mxfp8_declines_and_odd_data");
  }
}

/* ---- device error word ------------------------------------------------------------------ */
/* Bad sizes in device memory: TW_ERR_DEVICE at the next check, and nothing written outside
 * out (a guard band after it stays poisoned). */
static void bad_sizes_with(const int32_t *sizes, int64_t G, int wgrad, const char *kernel) {
  ctx_for(kernel);
  int64_t M = 64, N = 32, K = 16;
  int64_t ls[2] = {M, K};
  tw_tensor lhs = host_new(TW_BF16, 2, ls);
  fill_random(&lhs, M, K);
  tw_tensor lhs_d = dev_copy(&lhs);
  int64_t gsh[1] = {G};
  tw_tensor gs = host_new(TW_I32, 1, gsh);
  memcpy(gs.data, sizes, (size_t)G * 4);
  tw_tensor gs_d = dev_copy(&gs);
  int64_t guard = 4096;
  tw_tensor rhs, out;
  size_t out_bytes;
  if (!wgrad) {
    int64_t rs[3] = {G, K, N};
    rhs = host_new(TW_BF16, 3, rs);
    fill_random(&rhs, G * K, N);
    out_bytes = (size_t)(M * N * 2);
  } else {
    int64_t rs[2] = {M, N};
    rhs = host_new(TW_BF16, 2, rs);
    fill_random(&rhs, M, N);
    out_bytes = (size_t)(G * K * N * 2);
  }
  tw_tensor rhs_d = dev_copy(&rhs);
  void *buf;
  cr_assert_eq(tw_alloc(gpu_ctx, out_bytes + (size_t)guard, &buf), TW_OK);
  cr_assert_eq(tw_memset(gpu_ctx, buf, TW_POISON_BYTE, out_bytes + (size_t)guard), TW_OK);
  tw_operand a = tw_operand_plain(&lhs_d), b = tw_operand_plain(&rhs_d);
  tw_status s;
  if (!wgrad) {
    out = tw_tensor_2d(buf, TW_BF16, M, N, TW_MEM_DEVICE);
    s = tw_grouped_gemm(gpu_ctx, &a, &b, TW_OP_N, &gs_d, &out, 0);
  } else {
    out = tw_tensor_3d(buf, TW_BF16, G, K, N, TW_MEM_DEVICE);
    s = tw_grouped_gemm_wgrad(gpu_ctx, &a, TW_OP_N, &b, TW_OP_N, &gs_d, &out, 0);
  }
  cr_assert_eq(s, TW_OK, "enqueue: %s", tw_last_error());
  s = tw_ctx_check(gpu_ctx);
  cr_assert_eq(s, TW_ERR_DEVICE, "expected TW_ERR_DEVICE, got %s: %s", tw_status_name(s), tw_last_error());
  cr_log_info("device error: %s", tw_last_error());
  unsigned char *h = (unsigned char *)malloc((size_t)guard);
  tw_tensor gd = tw_tensor_1d((char *)buf + out_bytes, TW_U8, guard, TW_MEM_DEVICE);
  tw_tensor gh = tw_tensor_1d(h, TW_U8, guard, TW_MEM_HOST);
  cr_assert_eq(tw_tensor_copy(gpu_ctx, &gh, &gd), TW_OK);
  for (int64_t i = 0; i < guard; ++i) cr_assert_eq(h[i], TW_POISON_BYTE, "guard byte %lld written", (long long)i);
  /* the context is usable again */
  cr_assert_eq(tw_ctx_check(gpu_ctx), TW_OK, "%s", tw_last_error());
  free(h);
  tw_free(gpu_ctx, buf);
  dev_free(&lhs_d); dev_free(&rhs_d); dev_free(&gs_d);
  host_free(&lhs); host_free(&rhs); host_free(&gs);
  ctx_done();
}

static void bad_sizes(const int32_t *sizes, int64_t G, int wgrad) { bad_sizes_with(sizes, G, wgrad, NULL); }

Test(grouped_gemm_gpu, gg_wgmma_negative_size_sets_device_error) {
  int32_t s[3] = {10, -5, 20};
  bad_sizes_with(s, 3, 0, "gg_wgmma");
}
Test(grouped_gemm_gpu, gg_wgmma_sum_past_rows_sets_device_error) {
  int32_t s[3] = {40, 40, 40};
  bad_sizes_with(s, 3, 0, "gg_wgmma");
}
Test(grouped_gemm_gpu, negative_size_sets_device_error) {
  int32_t s[3] = {10, -5, 20};
  bad_sizes(s, 3, 0);
}
Test(grouped_gemm_gpu, sum_past_rows_sets_device_error) {
  int32_t s[3] = {40, 40, 40};
  bad_sizes(s, 3, 0);
}
Test(grouped_gemm_wgrad_gpu, negative_size_sets_device_error) {
  int32_t s[2] = {-1, 8};
  bad_sizes(s, 2, 1);
}
Test(grouped_gemm_wgrad_gpu, sum_past_rows_sets_device_error) {
  int32_t s[2] = {60, 2147483000};
  bad_sizes(s, 2, 1);
}
Test(grouped_gemm_wgrad_gpu, gg_wgmma_negative_size_sets_device_error) {
  int32_t s[2] = {-1, 8};
  bad_sizes_with(s, 2, 1, "gg_wgmma");
}
Test(grouped_gemm_wgrad_gpu, gg_wgmma_sum_past_rows_sets_device_error) {
  int32_t s[2] = {60, 2147483000};
  bad_sizes_with(s, 2, 1, "gg_wgmma");
}

/* The host-sizes loop reports bad sizes as a plain error (it reads them on the host). */
Test(grouped_gemm_gpu, lt_loop_rejects_bad_sizes_on_host) {
  ctx_for("gg_lt_loop");
  int64_t M = 8, K = 16, N = 16, G = 2;
  int64_t ls[2] = {M, K}, rs[3] = {G, K, N}, gsh[1] = {G}, os[2] = {M, N};
  tw_tensor lhs = host_new(TW_BF16, 2, ls), rhs = host_new(TW_BF16, 3, rs), gs = host_new(TW_I32, 1, gsh);
  fill_random(&lhs, M, K);
  fill_random(&rhs, G * K, N);
  ((int32_t *)gs.data)[0] = 4;
  ((int32_t *)gs.data)[1] = 9;
  tw_tensor ld = dev_copy(&lhs), rd = dev_copy(&rhs), gd = dev_copy(&gs), out = host_new(TW_BF16, 2, os);
  tw_tensor od = dev_copy(&out);
  tw_operand a = tw_operand_plain(&ld), b = tw_operand_plain(&rd);
  tw_status s = tw_grouped_gemm(gpu_ctx, &a, &b, TW_OP_N, &gd, &od, 0);
  cr_assert_eq(s, TW_ERR_INVALID_ARG, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "sum to 13") != NULL, "message: %s", tw_last_error());
  dev_free(&ld); dev_free(&rd); dev_free(&gd); dev_free(&od);
  host_free(&lhs); host_free(&rhs); host_free(&gs); host_free(&out);
  ctx_done();
}

/* A forced version that cannot take the operands says so. */
static void rejects_f32(const char *kernel) {
  ctx_for(kernel);
  int64_t M = 8, K = 16, N = 16, G = 1;
  int64_t ls[2] = {M, K}, rs[3] = {G, K, N}, gsh[1] = {G}, os[2] = {M, N};
  tw_tensor lhs = host_new(TW_F32, 2, ls), rhs = host_new(TW_F32, 3, rs), gs = host_new(TW_I32, 1, gsh);
  ((int32_t *)gs.data)[0] = 8;
  tw_tensor ld = dev_copy(&lhs), rd = dev_copy(&rhs), gd = dev_copy(&gs), out = host_new(TW_F32, 2, os);
  tw_tensor od = dev_copy(&out);
  tw_operand a = tw_operand_plain(&ld), b = tw_operand_plain(&rd);
  tw_status s = tw_grouped_gemm(gpu_ctx, &a, &b, TW_OP_N, &gd, &od, 0);
  cr_assert_eq(s, TW_ERR_UNSUPPORTED, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), kernel) != NULL, "message: %s", tw_last_error());
  dev_free(&ld); dev_free(&rd); dev_free(&gd); dev_free(&od);
  host_free(&lhs); host_free(&rhs); host_free(&gs); host_free(&out);
  ctx_done();
}
Test(grouped_gemm_gpu, mma_version_rejects_f32) { rejects_f32("gg_mma"); }
Test(grouped_gemm_gpu, mma_wide_version_rejects_f32) { rejects_f32("gg_mma_wide"); }
Test(grouped_gemm_gpu, wgmma_version_rejects_f32) { rejects_f32("gg_wgmma"); }

/* gg_wgmma declines what TMA cannot address (K not a multiple of 8), forward and wgrad, by
 * name; and the wgrad with a per-group transposed lhs (op T). */
Test(grouped_gemm_gpu, wgmma_version_declines_by_name) {
  ctx_for("gg_wgmma");
  int64_t M = 8, K = 12, N = 16, G = 1;
  int64_t ls[2] = {M, K}, rs[3] = {G, K, N}, gsh[1] = {G}, os[2] = {M, N}, ws[3] = {G, K, N};
  tw_tensor lhs = host_new(TW_BF16, 2, ls), rhs = host_new(TW_BF16, 3, rs), gs = host_new(TW_I32, 1, gsh);
  fill_random(&lhs, M, K);
  fill_random(&rhs, G * K, N);
  ((int32_t *)gs.data)[0] = 8;
  tw_tensor ld = dev_copy(&lhs), rd = dev_copy(&rhs), gd = dev_copy(&gs), out = host_new(TW_BF16, 2, os);
  tw_tensor od = dev_copy(&out);
  tw_operand a = tw_operand_plain(&ld), b = tw_operand_plain(&rd);
  tw_status s = tw_grouped_gemm(gpu_ctx, &a, &b, TW_OP_N, &gd, &od, 0);
  cr_assert_eq(s, TW_ERR_UNSUPPORTED, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "gg_wgmma") != NULL, "message: %s", tw_last_error());
  /* wgrad: lhs [M, K], rhs [M, N] -> out [G, K, N] */
  int64_t r2[2] = {M, N};
  tw_tensor y = host_new(TW_BF16, 2, r2), w = host_new(TW_BF16, 3, ws);
  fill_random(&y, M, N);
  tw_tensor yd = dev_copy(&y), wd = dev_copy(&w);
  tw_operand bb = tw_operand_plain(&yd);
  s = tw_grouped_gemm_wgrad(gpu_ctx, &a, TW_OP_N, &bb, TW_OP_N, &gd, &wd, 0);
  cr_assert_eq(s, TW_ERR_UNSUPPORTED, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "gg_wgmma") != NULL, "message: %s", tw_last_error());
  /* lhs op T: one [K, M] tensor of per-group [K, m_g] blocks; K = N = 16 here */
  int64_t t2[2] = {16, M}, w16[3] = {G, 16, N};
  tw_tensor lt = host_new(TW_BF16, 2, t2), w2 = host_new(TW_BF16, 3, w16);
  fill_random(&lt, 16, M);
  tw_tensor ltd = dev_copy(&lt), w2d = dev_copy(&w2);
  tw_operand at = tw_operand_plain(&ltd);
  s = tw_grouped_gemm_wgrad(gpu_ctx, &at, TW_OP_T, &bb, TW_OP_N, &gd, &w2d, 0);
  cr_assert_eq(s, TW_ERR_UNSUPPORTED, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "gg_wgmma") != NULL && strstr(tw_last_error(), "transposed") != NULL,
            "message: %s", tw_last_error());
  dev_free(&ltd); dev_free(&w2d); host_free(&lt); host_free(&w2);
  dev_free(&ld); dev_free(&rd); dev_free(&gd); dev_free(&od); dev_free(&yd); dev_free(&wd);
  host_free(&lhs); host_free(&rhs); host_free(&gs); host_free(&out); host_free(&y); host_free(&w);
  ctx_done();
}
