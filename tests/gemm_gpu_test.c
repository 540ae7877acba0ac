/* Dense GEMM on the gpu backend: every stored golden GEMM case (gemm, grouped_gemm,
 * grouped_gemm_wgrad) through the golden runner, and seeded random dense cases gpu vs ref
 * on each version (cuBLASLt, gg_mma, gg_mma_wide, gg_fma, gg_wgmma_fp8), any layout, batched and
 * broadcast, fp8 with per-tensor and block scales. Bound as in grouped_gemm_gpu_test.c: ref's
 * output is expected, each element may differ by the sum of both bounds (u_acc 2^-23 gpu, 2^-24
 * ref, K + 4; gg_wgmma_fp8's cases: its promoted model on the gpu side). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/runner.h"
#include "twin/tw_base.h"
#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

static uint64_t rng_s;
static uint64_t rnd(void) {
  uint64_t z = (rng_s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double unif(void) { return (rnd() >> 11) * (1.0 / 9007199254740992.0); }
static int64_t logdim(int64_t hi) {
  int64_t v = (int64_t)floor(exp(unif() * log((double)hi + 1)));
  return v < 1 ? 1 : v > hi ? hi : v;
}

static tw_ctx *ref_ctx, *gpu_ctx;
static void ctx_for(const char *kernel) {
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
static tw_tensor dev_copy(const tw_tensor *h) {
  tw_tensor d = *h;
  if (tw_tensor_is_none(h)) return d;
  d.mem = TW_MEM_DEVICE;
  size_t b = tw_tensor_bytes(h);
  cr_assert_eq(tw_alloc(gpu_ctx, b ? b : 16, &d.data), TW_OK, "%s", tw_last_error());
  if (b) cr_assert_eq(tw_tensor_copy(gpu_ctx, &d, h), TW_OK, "%s", tw_last_error());
  return d;
}
static void fill_random(tw_tensor *x) {
  int64_t n = tw_tensor_numel(x);
  for (int64_t i = 0; i < n; ++i) tw_store_from_f64(x->data, x->dtype, i, 2 * unif() - 1, 1);
}

/* ---- golden cases ----------------------------------------------------------------------- */
static const char *golden_root(char *buf, size_t n) {
  const char *srcdir = getenv("TEST_SRCDIR"), *ws = getenv("TEST_WORKSPACE");
  if (srcdir) snprintf(buf, n, "%s/%s/golden/data/gemm", srcdir, ws ? ws : "twin");
  else snprintf(buf, n, "golden/data/gemm");
  return buf;
}

static void run_goldens(const char *kernel) {
  ctx_for(kernel);
  char root[1024];
  char **dirs = NULL;
  int n = tw_golden_list_cases(golden_root(root, sizeof root), &dirs);
  cr_assert(n > 0, "no golden GEMM cases under %s (%s)", root, n < 0 ? tw_last_error() : "empty");
  int failed = 0, ran = 0;
  for (int i = 0; i < n; ++i) {
    tw_golden_result res;
    tw_status s = tw_golden_run_case(gpu_ctx, dirs[i], &res);
    if (s == TW_ERR_UNSUPPORTED && kernel) {
      cr_log_info("%s: %s (forced %s)", dirs[i], tw_last_error(), kernel);
      continue; /* a forced version may not take every case; auto must */
    }
    ++ran;
    if (s != TW_OK || !res.passed) {
      ++failed;
      cr_log_error("%s: %s", dirs[i], s != TW_OK ? tw_last_error() : res.detail);
    }
  }
  tw_golden_free_list(dirs, n);
  cr_expect(ran > 0, "no golden case ran");
  cr_assert_eq(failed, 0, "%d of %d golden GEMM cases failed on gpu (%s)", failed, ran, kernel ? kernel : "auto");
  ctx_done();
}

Test(gemm_gpu, goldens_auto, .timeout = 600) { run_goldens(NULL); }
Test(gemm_gpu, goldens_gg_mma, .timeout = 600) { run_goldens("gg_mma"); }
Test(gemm_gpu, goldens_gg_fma, .timeout = 600) { run_goldens("gg_fma"); }
/* grouped and wgrad cases on the 128x256x64 version; dense cases there run as auto (gpu/gemm.cu
 * does not take the name yet) */
Test(gemm_gpu, goldens_gg_mma_wide, .timeout = 600) { run_goldens("gg_mma_wide"); }
/* grouped forward and wgrad cases on the Hopper version (sm_90; the cases it declines, e.g. op T
 * wgrad operands, fp8, K % 8 != 0, are logged and skipped); dense cases run as auto */
Test(gemm_gpu, goldens_gg_wgmma, .timeout = 600) { run_goldens("gg_wgmma"); }
/* the fp8 cases on the Hopper fp8 version: grouped forward (rhs_op T) and the wgrad from the
 * colwise copies (ops T); what it declines is logged and skipped */
Test(gemm_gpu, goldens_gg_wgmma_fp8, .timeout = 600) { run_goldens("gg_wgmma_fp8"); }

/* ---- random dense cases ----------------------------------------------------------------- */
/* Failures are counted (the first 8 shown), so one run shows every failing case. */
static int n_cases, n_failed;
static void note_case(const char *what, const char *failure) {
  ++n_cases;
  if (!failure) return;
  if (++n_failed <= 8) cr_log_error("%s: %s", what, failure);
}
static void check(const char *what, const tw_tensor *got, const tw_tensor *exp, const double *bound) {
  int64_t n = tw_tensor_numel(got);
  tw_tensor bt = tw_tensor_1d((void *)bound, TW_F64, n, TW_MEM_HOST);
  tw_tensor g1 = tw_tensor_1d(got->data, got->dtype, n, TW_MEM_HOST);
  tw_tensor e1 = tw_tensor_1d(exp->data, exp->dtype, n, TW_MEM_HOST);
  tw_check_report rep;
  cr_assert_eq(tw_check_bound(&g1, &e1, &bt, &rep), TW_OK, "%s: %s", what, tw_last_error());
  char buf[512];
  note_case(what, rep.passed ? NULL : tw_check_format(&rep, buf, sizeof buf));
}

/* value of op(x)[b](i, j) for a stored [B?, r, c] tensor of logical [rows, cols] */
static double at(const double *v, int batched, int64_t b, tw_op op, int64_t rows, int64_t cols, int64_t i, int64_t j) {
  int64_t base = batched ? b * rows * cols : 0;
  return op == TW_OP_N ? v[base + i * cols + j] : v[base + j * rows + i];
}

static const tw_dtype outs[] = {TW_F32, TW_BF16, TW_F16};

/* kind 0 bf16, 1 f16, 2 f32 / mixed, 3 fp8 per-tensor, 4 fp8 1x128, 5 fp8 128x128, 6 mxfp8 */
static void dense_case(uint64_t seed, int kind) {
  rng_s = seed * 31337 + 11;
  int quant = kind >= 3;
  int64_t M = logdim(2048), N = logdim(2048), K = logdim(4096), B = 0;
  while (M * N * K > ((int64_t)1 << 24)) {
    if (M >= N && M >= K) M = (M + 1) / 2;
    else if (N >= K) N = (N + 1) / 2;
    else K = (K + 1) / 2;
  }
  if (!quant && unif() < 0.3) B = 1 + (int64_t)(rnd() % 4);
  if (quant && unif() < 0.5) { /* the cuBLASLt-eligible shape class */
    M = (M + 15) / 16 * 16; N = (N + 15) / 16 * 16; K = (K + 15) / 16 * 16;
  }
  tw_op oa = (tw_op)(rnd() & 1), ob = (tw_op)(rnd() & 1);
  if ((quant && unif() < 0.5) || kind == 4) { oa = TW_OP_N; ob = TW_OP_T; } /* 1x128 blocks need K last */
  tw_dtype od = outs[rnd() % 3];
  int acc = unif() < 0.25;
  int a3 = B && (rnd() & 1), b3 = B && (!a3 || (rnd() & 1));
  if (B && !a3 && !b3) a3 = 1;
  int64_t ar = oa == TW_OP_N ? M : K, ac = oa == TW_OP_N ? K : M;
  int64_t br = ob == TW_OP_N ? K : N, bc = ob == TW_OP_N ? N : K;
  int64_t Bn = B ? B : 1;
  tw_operand ha, hb, da, db;
  double *av, *bv;
  double *am = NULL, *bm = NULL; /* fp8: lifted magnitudes (tw_fp8_lift_subnormal_codes), stored order */
  tw_tensor bufs[16];
  int nb = 0;
  char what[256];
  int may_promote = 0; /* a case gg_wgmma_fp8 may run (auto on sm_90, or forced): its promotion
                        * interval along K (tw_gemm.h: 32 for MXFP8, else 128), 0 if it cannot */
  if (!quant) {
    tw_dtype ta = kind == 0 ? TW_BF16 : kind == 1 ? TW_F16 : TW_F32, tb = ta;
    if (kind == 2 && unif() < 0.5) tb = (rnd() & 1) ? TW_BF16 : TW_F16;
    int64_t as[3] = {B, ar, ac}, bs[3] = {B, br, bc};
    tw_tensor A = a3 ? host_new(ta, 3, as) : host_new(ta, 2, as + 1);
    tw_tensor Bt = b3 ? host_new(tb, 3, bs) : host_new(tb, 2, bs + 1);
    fill_random(&A);
    fill_random(&Bt);
    bufs[nb++] = A; bufs[nb++] = Bt;
    tw_tensor dA = dev_copy(&A), dB = dev_copy(&Bt);
    bufs[nb++] = dA; bufs[nb++] = dB;
    ha = tw_operand_plain(&bufs[0]); hb = tw_operand_plain(&bufs[1]);
    da = tw_operand_plain(&bufs[2]); db = tw_operand_plain(&bufs[3]);
    int64_t na = tw_tensor_numel(&A), nbb = tw_tensor_numel(&Bt);
    av = (double *)malloc((size_t)(na + 1) * 8); bv = (double *)malloc((size_t)(nbb + 1) * 8);
    for (int64_t i = 0; i < na; ++i) av[i] = tw_load_as_f64(A.data, A.dtype, i);
    for (int64_t i = 0; i < nbb; ++i) bv[i] = tw_load_as_f64(Bt.data, Bt.dtype, i);
    snprintf(what, sizeof what, "dense seed %llu: %s x %s -> %s B=%lld(%d%d) M=%lld N=%lld K=%lld op %c%c acc %d",
             (unsigned long long)seed, tw_dtype_name(ta), tw_dtype_name(tb), tw_dtype_name(od), (long long)B, a3, b3,
             (long long)M, (long long)N, (long long)K, oa ? 'T' : 'N', ob ? 'T' : 'N', acc);
  } else {
    tw_scaling mode = kind == 3 ? TW_SCALE_TENSOR_CURRENT
                      : kind == 4 ? TW_SCALE_BLOCK_1x128 : kind == 5 ? TW_SCALE_BLOCK_128x128 : TW_SCALE_MXFP8_1D;
    tw_dtype qa = (rnd() & 1) ? TW_E4M3 : TW_E5M2, qb = qa == TW_E5M2 ? TW_E4M3 : ((rnd() & 1) ? TW_E4M3 : TW_E5M2);
    /* each operand: pick the source [rows, cols] and orientation so that blocks lie on K */
    tw_operand *hs[2] = {&ha, &hb}, *ds[2] = {&da, &db};
    double **vs[2] = {&av, &bv}, **ms[2] = {&am, &bm};
    for (int w = 0; w < 2; ++w) {
      tw_op op = w == 0 ? oa : ob;
      int64_t sr = w == 0 ? ar : br, sc = w == 0 ? ac : bc;  /* stored shape wanted */
      /* K is the last stored dim for (a, N) and (b, T) */
      int k_last = (w == 0) == (op == TW_OP_N);
      int blocks_on_k_needed = mode == TW_SCALE_BLOCK_1x128 || mode == TW_SCALE_MXFP8_1D;
      int col;
      if (!blocks_on_k_needed) col = (int)(rnd() & 1);
      else if (mode == TW_SCALE_MXFP8_1D) col = !k_last; /* colwise MXFP8 blocks run down the rows */
      else col = (int)(rnd() & 1); /* 1x128, K last: rowwise, or the transposed colwise copy */
      int transposed = col && mode != TW_SCALE_MXFP8_1D;
      int64_t src_r = transposed ? sc : sr, src_c = transposed ? sr : sc;
      int64_t ss[2] = {src_r, src_c};
      tw_tensor x = host_new(TW_F32, 2, ss);
      fill_random(&x);
      tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
      qo.mode = mode;
      qo.qdtype = w == 0 ? qa : qb;
      qo.layout = col ? TW_COLWISE : TW_ROWWISE;
      qo.mxfp8_swizzled = (int)(rnd() & 1);
      int64_t g1[1] = {1};
      tw_tensor gs = host_new(TW_I32, 1, g1);
      ((int32_t *)gs.data)[0] = (int32_t)src_r;
      tw_qtensor q, dq;
      cr_assert_eq(tw_quantize_output_shapes(&qo, src_r, src_c, 1, &q), TW_OK, "%s", tw_last_error());
      tw_tensor *parts[5] = {&q.row_data, &q.row_scale_inv, &q.col_data, &q.col_scale_inv, &q.amax};
      for (int i = 0; i < 5; ++i)
        if (!tw_tensor_is_none(parts[i])) { *parts[i] = host_new(parts[i]->dtype, parts[i]->ndim, parts[i]->shape); bufs[nb++] = *parts[i]; }
      cr_assert_eq(tw_grouped_quantize(ref_ctx, &x, &gs, &qo, &q), TW_OK, "%s", tw_last_error());
      tw_tensor deq = host_new(TW_F32, 2, ss);
      cr_assert_eq(tw_grouped_dequantize(ref_ctx, &q, &gs, col, &deq), TW_OK, "%s", tw_last_error());
      /* values in stored (sr x sc) orientation */
      double *v = (double *)malloc((size_t)(sr * sc + 1) * 8);
      for (int64_t i = 0; i < sr; ++i)
        for (int64_t j = 0; j < sc; ++j)
          v[i * sc + j] = ((float *)deq.data)[transposed ? j * src_c + i : i * src_c + j];
      *vs[w] = v;
      /* the lifted magnitudes: the codes with subnormals as the smallest normal, dequantized */
      tw_qtensor lq = q;
      tw_tensor *lqd = col ? &lq.col_data : &lq.row_data;
      const tw_tensor *qd = col ? &q.col_data : &q.row_data;
      *lqd = host_new(qd->dtype, qd->ndim, qd->shape);
      cr_assert_eq(tw_fp8_lift_subnormal_codes(qd->data, tw_tensor_numel(qd), qd->dtype, lqd->data), TW_OK, "%s",
                   tw_last_error());
      cr_assert_eq(tw_grouped_dequantize(ref_ctx, &lq, &gs, col, &deq), TW_OK, "%s", tw_last_error());
      free(lqd->data);
      double *mv = (double *)malloc((size_t)(sr * sc + 1) * 8);
      for (int64_t i = 0; i < sr; ++i)
        for (int64_t j = 0; j < sc; ++j)
          mv[i * sc + j] = ((float *)deq.data)[transposed ? j * src_c + i : i * src_c + j];
      *ms[w] = mv;
      dq = q;
      tw_tensor *dparts[5] = {&dq.row_data, &dq.row_scale_inv, &dq.col_data, &dq.col_scale_inv, &dq.amax};
      for (int i = 0; i < 5; ++i)
        if (!tw_tensor_is_none(parts[i])) { *dparts[i] = dev_copy(parts[i]); bufs[nb++] = *dparts[i]; }
      *hs[w] = col ? tw_operand_colwise(&q) : tw_operand_rowwise(&q);
      *ds[w] = col ? tw_operand_colwise(&dq) : tw_operand_rowwise(&dq);
      free(deq.data);
      free(x.data);
      free(gs.data);
    }
    may_promote = oa == TW_OP_N && ob == TW_OP_T ? (mode == TW_SCALE_MXFP8_1D ? 32 : 128) : 0;
    snprintf(what, sizeof what, "dense seed %llu: fp8 %s %s x %s -> %s M=%lld N=%lld K=%lld op %c%c acc %d",
             (unsigned long long)seed, tw_scaling_name(mode), tw_dtype_name(qa), tw_dtype_name(qb), tw_dtype_name(od),
             (long long)M, (long long)N, (long long)K, oa ? 'T' : 'N', ob ? 'T' : 'N', acc);
  }
  int64_t os[3] = {B, M, N};
  tw_tensor outr = B ? host_new(od, 3, os) : host_new(od, 2, os + 1);
  tw_tensor outg = B ? host_new(od, 3, os) : host_new(od, 2, os + 1);
  int64_t n = tw_tensor_numel(&outr);
  double *init = (double *)calloc((size_t)(n + 1), 8);
  if (acc) {
    fill_random(&outr);
    for (int64_t i = 0; i < n; ++i) init[i] = tw_load_as_f64(outr.data, od, i);
  }
  memcpy(outg.data, outr.data, tw_tensor_bytes(&outr));
  tw_tensor outd = dev_copy(&outg);
  cr_assert_eq(tw_gemm(ref_ctx, &ha, oa, &hb, ob, &outr, acc), TW_OK, "%s: ref: %s", what, tw_last_error());
  tw_status s = tw_gemm(gpu_ctx, &da, oa, &db, ob, &outd, acc);
  if (s == TW_ERR_UNSUPPORTED && tw_ctx_kernel(gpu_ctx)) {
    /* a forced version that does not take this case must say why; nothing else to check */
    cr_assert(strlen(tw_last_error()) > 0);
  } else {
    if (s == TW_OK) s = tw_ctx_check(gpu_ctx);
    if (s == TW_OK) s = tw_tensor_copy(gpu_ctx, &outg, &outd);
  }
  if (s != TW_OK && !(s == TW_ERR_UNSUPPORTED && tw_ctx_kernel(gpu_ctx))) {
    note_case(what, tw_last_error());
  } else if (s == TW_OK) {
    double *ex = (double *)malloc((size_t)(n + 1) * 8), *ab = (double *)malloc((size_t)(n + 1) * 8);
    double *bd = (double *)malloc((size_t)(n + 1) * 8), *b2 = (double *)malloc((size_t)(n + 1) * 8);
    double *abl = (double *)malloc((size_t)(n + 1) * 8); /* sum of lifted magnitudes (fp8) */
    for (int64_t b = 0; b < Bn; ++b)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double sx = init[(b * M + i) * N + j], sa = fabs(sx), sl = sa;
          for (int64_t k = 0; k < K; ++k) {
            double p = at(av, a3, b, oa, M, K, i, k) * at(bv, b3, b, ob, K, N, k, j);
            sx += p;
            sa += fabs(p);
            if (quant) sl += fabs(at(am, a3, b, oa, M, K, i, k) * at(bm, b3, b, ob, K, N, k, j));
          }
          ex[(b * M + i) * N + j] = sx;
          ab[(b * M + i) * N + j] = sa;
          abl[(b * M + i) * N + j] = quant ? sl : sa;
        }
    /* cuBLASLt's fp8 (forced gemm_lt) accumulates with ~14 mantissa bits: u_acc = 2^-13;
     * gg_wgmma_fp8 (auto on sm_90 where it takes the case, or forced): tw_gemm.h's promoted model.
     * Both on the fp8 tensor core: the lifted magnitudes (tw_check.h). */
    const char *kn = tw_ctx_kernel(gpu_ctx);
    int lt_fp8 = quant && kn && !strcmp(kn, "gemm_lt");
    double u_gpu = lt_fp8 ? ldexp(1.0, -13) : ldexp(1.0, -23);
    if (may_promote && (!kn || !strcmp(kn, "gg_wgmma_fp8")))
      tw_gemm_error_bound_promoted(abl, ex, n, K, may_promote, ldexp(1.0, -13), ldexp(1.0, -24), 2, od, bd);
    else
      tw_gemm_error_bound(lt_fp8 ? abl : ab, ex, n, K + 4, u_gpu, od, bd);
    tw_gemm_error_bound(ab, ex, n, K + 4, ldexp(1.0, -24), od, b2);
    for (int64_t i = 0; i < n; ++i) bd[i] += b2[i];
    check(what, &outg, &outr, bd);
    free(ex); free(ab); free(abl); free(bd); free(b2);
  }
  free(init);
  tw_free(gpu_ctx, outd.data);
  free(outr.data); free(outg.data);
  free(av); free(bv); free(am); free(bm);
  for (int i = 0; i < nb; ++i) {
    if (bufs[i].mem == TW_MEM_DEVICE) tw_free(gpu_ctx, bufs[i].data);
    else free(bufs[i].data);
  }
}

#define DENSE_TESTS(name, kernel)                                                                    \
  Test(gemm_gpu, random_##name, .timeout = 600) {                                                   \
    ctx_for(kernel);                                                                                \
    for (int s = 0; s < 210; ++s) dense_case((uint64_t)s + 7000 * (sizeof(#name) % 7), s % 7);     \
    ctx_done();                                                                                     \
    cr_assert_eq(n_failed, 0, "%d of %d dense cases failed (first ones above)", n_failed, n_cases); \
  }
DENSE_TESTS(auto, NULL)
DENSE_TESTS(gg_mma, "gg_mma")
DENSE_TESTS(gg_mma_wide, "gg_mma_wide")
DENSE_TESTS(gg_fma, "gg_fma")
DENSE_TESTS(gemm_lt, "gemm_lt")
DENSE_TESTS(gg_wgmma_fp8, "gg_wgmma_fp8")
