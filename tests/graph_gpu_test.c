/* CUDA-graph proof: tw_grouped_gemm and tw_grouped_gemm_wgrad are captured once into a graph
 * on the context's stream, then the graph is replayed with different group sizes written into
 * the same device buffer (and the output re-poisoned between replays). Each replay must
 * match the ref backend run on those sizes, rows past the groups untouched. This only works
 * because the call never synchronizes with the host or copies sizes off the device. */
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

static uint64_t rng_s = 12345;
static double unif(void) {
  uint64_t z = (rng_s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 11) * (1.0 / 9007199254740992.0);
}

static tw_tensor host_new(tw_dtype t, int ndim, const int64_t *shape) {
  tw_tensor x = tw_tensor_none();
  x.dtype = t;
  x.ndim = ndim;
  for (int i = 0; i < ndim; ++i) x.shape[i] = shape[i];
  x.mem = TW_MEM_HOST;
  x.data = malloc(tw_tensor_bytes(&x));
  memset(x.data, TW_POISON_BYTE, tw_tensor_bytes(&x));
  return x;
}

static void cu_ok(cudaError_t e, const char *what) {
  cr_assert_eq(e, cudaSuccess, "%s: %s", what, cudaGetErrorString(e));
}
#define CU(call) cu_ok((call), #call)

/* |gpu - ref| within both bounds (u_acc 2^-23 and 2^-24, K + 4), poison where unwritten. */
static void compare(const char *what, const tw_tensor *got, const tw_tensor *ref, const double *ex, const double *ab,
                    int64_t Kc, const int *written) {
  int64_t n = tw_tensor_numel(got);
  double *bd = (double *)malloc((size_t)n * 8), *b2 = (double *)malloc((size_t)n * 8);
  tw_gemm_error_bound(ab, ex, n, Kc + 4, ldexp(1.0, -23), got->dtype, bd);
  tw_gemm_error_bound(ab, ex, n, Kc + 4, ldexp(1.0, -24), got->dtype, b2);
  for (int64_t i = 0; i < n; ++i) bd[i] = written[i] ? bd[i] + b2[i] : -1;
  tw_tensor bt = tw_tensor_1d(bd, TW_F64, n, TW_MEM_HOST);
  tw_tensor g1 = tw_tensor_1d(got->data, got->dtype, n, TW_MEM_HOST), e1 = tw_tensor_1d(ref->data, ref->dtype, n, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g1, &e1, &bt, &r), TW_OK, "%s", tw_last_error());
  char buf[512];
  cr_assert(r.passed, "%s: %s", what, tw_check_format(&r, buf, sizeof buf));
  free(bd);
  free(b2);
}

/* kernel: NULL (auto) or a forced version (tw_ctx_kernel). */
static void graph_replay(int wgrad, const char *kernel) {
  cudaStream_t stream;
  CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  tw_ctx *ref, *gpu;
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ref, &c), TW_OK, "%s", tw_last_error());
  c.backend = TW_BACKEND_GPU;
  c.stream = stream;
  c.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&gpu, &c), TW_OK, "%s", tw_last_error());

  /* N = 264: one full 256-wide tile (gg_mma_wide's fast loader) and a ragged one */
  const int64_t G = 8, M = 1000, K = 192, N = 264;
  int64_t ls[2] = {M, K}, rs3[3] = {G, K, N}, rs2[2] = {M, N}, gsh[1] = {G};
  tw_tensor lhs = host_new(TW_BF16, 2, ls);
  tw_tensor rhs = wgrad ? host_new(TW_BF16, 2, rs2) : host_new(TW_BF16, 3, rs3);
  for (int64_t i = 0; i < tw_tensor_numel(&lhs); ++i) tw_store_from_f64(lhs.data, TW_BF16, i, 2 * unif() - 1, 1);
  for (int64_t i = 0; i < tw_tensor_numel(&rhs); ++i) tw_store_from_f64(rhs.data, TW_BF16, i, 2 * unif() - 1, 1);
  tw_tensor gs = host_new(TW_I32, 1, gsh);
  int64_t os2[2] = {M, N}, os3[3] = {G, K, N};
  tw_tensor out_r = wgrad ? host_new(TW_F32, 3, os3) : host_new(TW_F32, 2, os2);
  tw_tensor out_g = wgrad ? host_new(TW_F32, 3, os3) : host_new(TW_F32, 2, os2);
  int64_t n_out = tw_tensor_numel(&out_r);

  tw_tensor dl = lhs, dr = rhs, dg = gs, dout = out_g;
  dl.mem = dr.mem = dg.mem = dout.mem = TW_MEM_DEVICE;
  cr_assert_eq(tw_alloc(gpu, tw_tensor_bytes(&lhs), &dl.data), TW_OK);
  cr_assert_eq(tw_alloc(gpu, tw_tensor_bytes(&rhs), &dr.data), TW_OK);
  cr_assert_eq(tw_alloc(gpu, tw_tensor_bytes(&gs), &dg.data), TW_OK);
  cr_assert_eq(tw_alloc(gpu, tw_tensor_bytes(&out_g), &dout.data), TW_OK);
  cr_assert_eq(tw_tensor_copy(gpu, &dl, &lhs), TW_OK);
  cr_assert_eq(tw_tensor_copy(gpu, &dr, &rhs), TW_OK);
  tw_operand a = tw_operand_plain(&dl), b = tw_operand_plain(&dr);
  tw_operand ha = tw_operand_plain(&lhs), hb = tw_operand_plain(&rhs);

  /* one eager call (first-use setup happens outside the capture), then capture */
  for (int64_t g = 0; g < G; ++g) ((int32_t *)gs.data)[g] = (int32_t)(M / G);
  cr_assert_eq(tw_tensor_copy(gpu, &dg, &gs), TW_OK);
  tw_status s = wgrad ? tw_grouped_gemm_wgrad(gpu, &a, TW_OP_N, &b, TW_OP_N, &dg, &dout, 0)
                      : tw_grouped_gemm(gpu, &a, &b, TW_OP_N, &dg, &dout, 0);
  cr_assert_eq(s, TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s", tw_last_error());

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  s = wgrad ? tw_grouped_gemm_wgrad(gpu, &a, TW_OP_N, &b, TW_OP_N, &dg, &dout, 0)
            : tw_grouped_gemm(gpu, &a, &b, TW_OP_N, &dg, &dout, 0);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  cr_assert_eq(s, TW_OK, "captured call: %s", tw_last_error());
  cr_assert_eq(ce, cudaSuccess, "capture failed (a host sync inside the call?): %s", cudaGetErrorString(ce));
  CU(cudaGraphInstantiate(&exec, graph, 0));

  const int32_t replays[4][8] = {
      {125, 125, 125, 125, 125, 125, 125, 125},
      {0, 0, 700, 0, 3, 0, 1, 0},      /* skewed with empty groups, tail rows */
      {1, 2, 3, 4, 5, 6, 7, 8},        /* tiny groups, big tail */
      {0, 0, 0, 0, 0, 0, 0, 1000},     /* one group takes all */
  };
  for (int rep = 0; rep < 4; ++rep) {
    memcpy(gs.data, replays[rep], sizeof replays[rep]);
    CU(cudaMemcpyAsync(dg.data, gs.data, (size_t)G * 4, cudaMemcpyHostToDevice, stream));
    CU(cudaMemsetAsync(dout.data, TW_POISON_BYTE, tw_tensor_bytes(&out_g), stream));
    CU(cudaGraphLaunch(exec, stream));
    CU(cudaStreamSynchronize(stream));
    cr_assert_eq(tw_ctx_check(gpu), TW_OK, "replay %d: %s", rep, tw_last_error());
    cr_assert_eq(tw_tensor_copy(gpu, &out_g, &dout), TW_OK);
    memset(out_r.data, TW_POISON_BYTE, tw_tensor_bytes(&out_r));
    s = wgrad ? tw_grouped_gemm_wgrad(ref, &ha, TW_OP_N, &hb, TW_OP_N, &gs, &out_r, 0)
              : tw_grouped_gemm(ref, &ha, &hb, TW_OP_N, &gs, &out_r, 0);
    cr_assert_eq(s, TW_OK, "ref: %s", tw_last_error());
    /* exact result and |a||b| */
    double *ex = (double *)calloc((size_t)n_out, 8), *ab = (double *)calloc((size_t)n_out, 8);
    int *written = (int *)calloc((size_t)n_out, sizeof(int));
    int64_t o = 0, kmax = wgrad ? 0 : K;
    for (int64_t g = 0; g < G; ++g) {
      int64_t m = replays[rep][g];
      if (wgrad) {
        if (m > kmax) kmax = m;
        for (int64_t k = 0; k < K; ++k)
          for (int64_t j = 0; j < N; ++j) {
            double sx = 0, sa = 0;
            for (int64_t r = 0; r < m; ++r) {
              double p = tw_load_as_f64(lhs.data, TW_BF16, (o + r) * K + k) * tw_load_as_f64(rhs.data, TW_BF16, (o + r) * N + j);
              sx += p;
              sa += fabs(p);
            }
            ex[(g * K + k) * N + j] = sx;
            ab[(g * K + k) * N + j] = sa;
            written[(g * K + k) * N + j] = 1;
          }
      } else {
        for (int64_t i = o; i < o + m; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double sx = 0, sa = 0;
            for (int64_t k = 0; k < K; ++k) {
              double p = tw_load_as_f64(lhs.data, TW_BF16, i * K + k) * tw_load_as_f64(rhs.data, TW_BF16, (g * K + k) * N + j);
              sx += p;
              sa += fabs(p);
            }
            ex[i * N + j] = sx;
            ab[i * N + j] = sa;
            written[i * N + j] = 1;
          }
      }
      o += m;
    }
    char what[64];
    snprintf(what, sizeof what, "%s replay %d (%s)", wgrad ? "wgrad" : "fwd", rep, kernel ? kernel : "auto");
    compare(what, &out_g, &out_r, ex, ab, kmax, written);
    free(ex);
    free(ab);
    free(written);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  tw_free(gpu, dl.data); tw_free(gpu, dr.data); tw_free(gpu, dg.data); tw_free(gpu, dout.data);
  free(lhs.data); free(rhs.data); free(gs.data); free(out_r.data); free(out_g.data);
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(ref);
  cudaStreamDestroy(stream);
}

Test(graph_gpu, grouped_gemm_replays_with_new_sizes, .timeout = 300) { graph_replay(0, NULL); }
Test(graph_gpu, grouped_gemm_wgrad_replays_with_new_sizes, .timeout = 300) { graph_replay(1, NULL); }
Test(graph_gpu, gg_mma_wide_grouped_gemm_replays, .timeout = 300) { graph_replay(0, "gg_mma_wide"); }
Test(graph_gpu, gg_mma_wide_grouped_gemm_wgrad_replays, .timeout = 300) { graph_replay(1, "gg_mma_wide"); }
Test(graph_gpu, gg_wgmma_grouped_gemm_replays, .timeout = 300) { graph_replay(0, "gg_wgmma"); }
Test(graph_gpu, gg_wgmma_grouped_gemm_wgrad_replays, .timeout = 300) { graph_replay(1, "gg_wgmma"); }

/* ---- fp8 (gg_wgmma_fp8 and auto): per-tensor and 1x128 scales -------------------------- */
#include "twin/tw_quantize.h"

/* Host qtensor (rowwise) of x [R, C] by gs, buffers malloc'ed once by the caller's shapes. */
static void q_alloc(tw_qtensor *q, tw_scaling mode, int64_t R, int64_t C, int64_t G) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.layout = TW_ROWWISE;
  cr_assert_eq(tw_quantize_output_shapes(&o, R, C, G, q), TW_OK, "%s", tw_last_error());
  tw_tensor *parts[3] = {&q->row_data, &q->row_scale_inv, &q->amax};
  for (int i = 0; i < 3; ++i)
    if (!tw_tensor_is_none(parts[i])) *parts[i] = host_new(parts[i]->dtype, parts[i]->ndim, parts[i]->shape);
}
static void q_run(tw_ctx *ref, tw_qtensor *q, const tw_tensor *x, const tw_tensor *gs) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = q->mode;
  o.layout = TW_ROWWISE;
  cr_assert_eq(tw_grouped_quantize(ref, x, gs, &o, q), TW_OK, "%s", tw_last_error());
}
/* Dequantized values [rows, cols] of one orientation; lifted: of the codes with subnormals as
 * the smallest normal (tw_fp8_lift_subnormal_codes), the magnitudes of the promoted model. */
static double *q_values(tw_ctx *ref, const tw_qtensor *q, const tw_tensor *gs, int colwise, int lifted) {
  int64_t sh[2] = {q->rows, q->cols};
  tw_tensor d = host_new(TW_F32, 2, sh);
  memset(d.data, 0, tw_tensor_bytes(&d));
  tw_qtensor l = *q;
  tw_tensor *ld = colwise ? &l.col_data : &l.row_data;
  if (lifted) {
    const tw_tensor *qd = colwise ? &q->col_data : &q->row_data;
    *ld = host_new(qd->dtype, qd->ndim, qd->shape);
    cr_assert_eq(tw_fp8_lift_subnormal_codes(qd->data, tw_tensor_numel(qd), qd->dtype, ld->data), TW_OK, "%s",
                 tw_last_error());
  }
  cr_assert_eq(tw_grouped_dequantize(ref, &l, gs, colwise, &d), TW_OK, "%s", tw_last_error());
  if (lifted) free(ld->data);
  double *v = (double *)malloc((size_t)(q->rows * q->cols) * sizeof(double));
  for (int64_t i = 0; i < q->rows * q->cols; ++i) v[i] = ((float *)d.data)[i];
  free(d.data);
  return v;
}
static tw_tensor dev_of(tw_ctx *gpu, const tw_tensor *h) {
  tw_tensor d = *h;
  if (tw_tensor_is_none(h)) return d;
  d.mem = TW_MEM_DEVICE;
  cr_assert_eq(tw_alloc(gpu, tw_tensor_bytes(h), &d.data), TW_OK);
  return d;
}

static void graph_replay_fp8(tw_scaling mode, const char *kernel) {
  cudaStream_t stream;
  CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  tw_ctx *ref, *gpu;
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ref, &c), TW_OK, "%s", tw_last_error());
  c.backend = TW_BACKEND_GPU;
  c.stream = stream;
  c.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&gpu, &c), TW_OK, "%s", tw_last_error());
  /* K = 208: two k-blocks, the second 80 deep; N = 264: two full 128 column tiles, one ragged */
  const int64_t G = 8, M = 1000, K = 208, N = 264;
  int64_t xs[2] = {M, K}, ws[2] = {G * N, K}, gsh[1] = {G}, os[2] = {M, N};
  tw_tensor x = host_new(TW_F32, 2, xs), w = host_new(TW_F32, 2, ws), gs = host_new(TW_I32, 1, gsh);
  for (int64_t i = 0; i < M * K; ++i) ((float *)x.data)[i] = (float)((2 * unif() - 1) * ldexp(1.0, (int)(i / K % 7) - 3));
  for (int64_t i = 0; i < G * N * K; ++i) ((float *)w.data)[i] = (float)(2 * unif() - 1);
  int32_t un[8];
  for (int g = 0; g < 8; ++g) un[g] = (int32_t)N;
  tw_tensor ugs = tw_tensor_1d(un, TW_I32, G, TW_MEM_HOST);
  tw_qtensor lq, rq;
  q_alloc(&lq, mode, M, K, G);
  q_alloc(&rq, mode, G * N, K, G);
  q_run(ref, &rq, &w, &ugs);
  double *bv = q_values(ref, &rq, &ugs, 0, 0), *bm = q_values(ref, &rq, &ugs, 0, 1);
  tw_qtensor dlq = lq, drq = rq;
  dlq.row_data = dev_of(gpu, &lq.row_data);
  dlq.row_scale_inv = dev_of(gpu, &lq.row_scale_inv);
  dlq.amax = tw_tensor_none();
  drq.row_data = dev_of(gpu, &rq.row_data);
  drq.row_scale_inv = dev_of(gpu, &rq.row_scale_inv);
  drq.amax = tw_tensor_none();
  cr_assert_eq(tw_tensor_copy(gpu, &drq.row_data, &rq.row_data), TW_OK);
  cr_assert_eq(tw_tensor_copy(gpu, &drq.row_scale_inv, &rq.row_scale_inv), TW_OK);
  tw_tensor dg = dev_of(gpu, &gs);
  tw_tensor out_r = host_new(TW_F32, 2, os), out_g = host_new(TW_F32, 2, os);
  tw_tensor dout = dev_of(gpu, &out_g);
  tw_operand a = tw_operand_rowwise(&dlq), b = tw_operand_rowwise(&drq);
  tw_operand ha = tw_operand_rowwise(&lq), hb = tw_operand_rowwise(&rq);

  /* sizes -> lhs quantized by them (per-tensor scales depend on the groups) -> device */
#define LOAD_SIZES(sz)                                                                   \
  do {                                                                                   \
    memcpy(gs.data, (sz), (size_t)G * 4);                                                \
    q_run(ref, &lq, &x, &gs);                                                            \
    cr_assert_eq(tw_tensor_copy(gpu, &dg, &gs), TW_OK);                                  \
    cr_assert_eq(tw_tensor_copy(gpu, &dlq.row_data, &lq.row_data), TW_OK);               \
    cr_assert_eq(tw_tensor_copy(gpu, &dlq.row_scale_inv, &lq.row_scale_inv), TW_OK);     \
  } while (0)
  const int32_t first[8] = {125, 125, 125, 125, 125, 125, 125, 125};
  LOAD_SIZES(first);
  cr_assert_eq(tw_grouped_gemm(gpu, &a, &b, TW_OP_T, &dg, &dout, 0), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s", tw_last_error());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  tw_status s = tw_grouped_gemm(gpu, &a, &b, TW_OP_T, &dg, &dout, 0);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  cr_assert_eq(s, TW_OK, "captured call: %s", tw_last_error());
  cr_assert_eq(ce, cudaSuccess, "capture failed (a host sync inside the call?): %s", cudaGetErrorString(ce));
  CU(cudaGraphInstantiate(&exec, graph, 0));
  const int32_t replays[4][8] = {
      {125, 125, 125, 125, 125, 125, 125, 125},
      {0, 0, 700, 0, 3, 0, 1, 0},
      {1, 2, 3, 4, 5, 6, 7, 8},
      {0, 0, 0, 0, 0, 0, 0, 1000},
  };
  for (int rep = 0; rep < 4; ++rep) {
    LOAD_SIZES(replays[rep]);
    CU(cudaStreamSynchronize(stream));
    CU(cudaMemsetAsync(dout.data, TW_POISON_BYTE, tw_tensor_bytes(&out_g), stream));
    CU(cudaGraphLaunch(exec, stream));
    CU(cudaStreamSynchronize(stream));
    cr_assert_eq(tw_ctx_check(gpu), TW_OK, "replay %d: %s", rep, tw_last_error());
    cr_assert_eq(tw_tensor_copy(gpu, &out_g, &dout), TW_OK);
    memset(out_r.data, TW_POISON_BYTE, tw_tensor_bytes(&out_r));
    cr_assert_eq(tw_grouped_gemm(ref, &ha, &hb, TW_OP_T, &gs, &out_r, 0), TW_OK, "ref: %s", tw_last_error());
    double *av = q_values(ref, &lq, &gs, 0, 0), *am = q_values(ref, &lq, &gs, 0, 1);
    int64_t n = M * N;
    double *ex = (double *)calloc((size_t)n, 8), *ab = (double *)calloc((size_t)n, 8);
    double *abl = (double *)calloc((size_t)n, 8); /* lifted: the promoted model's magnitudes */
    double *bd = (double *)malloc((size_t)n * 8), *b2 = (double *)malloc((size_t)n * 8);
    int64_t o = 0;
    for (int64_t i = 0; i < n; ++i) ab[i] = abl[i] = -1; /* rows past the groups: untouched */
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t i = o; i < o + replays[rep][g]; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double sx = 0, sa = 0, sl = 0;
          for (int64_t k = 0; k < K; ++k) {
            double p = av[i * K + k] * bv[(g * N + j) * K + k];
            sx += p;
            sa += fabs(p);
            sl += fabs(am[i * K + k] * bm[(g * N + j) * K + k]);
          }
          ex[i * N + j] = sx;
          ab[i * N + j] = sa;
          abl[i * N + j] = sl;
        }
      o += replays[rep][g];
    }
    /* gpu: gg_wgmma_fp8's promoted model (auto on sm_90 runs it; elsewhere the exact model is
     * tighter than this one), ref: f32 (K + 4, 2^-24) */
    tw_gemm_error_bound_promoted(abl, ex, n, K, 128, ldexp(1.0, -13), ldexp(1.0, -24), 2, TW_F32, bd);
    tw_gemm_error_bound(ab, ex, n, K + 4, ldexp(1.0, -24), TW_F32, b2);
    for (int64_t i = 0; i < n; ++i) bd[i] = ab[i] < 0 ? -1 : bd[i] + b2[i];
    tw_tensor bt = tw_tensor_1d(bd, TW_F64, n, TW_MEM_HOST);
    tw_tensor g1 = tw_tensor_1d(out_g.data, TW_F32, n, TW_MEM_HOST), e1 = tw_tensor_1d(out_r.data, TW_F32, n, TW_MEM_HOST);
    tw_check_report r;
    cr_assert_eq(tw_check_bound(&g1, &e1, &bt, &r), TW_OK, "%s", tw_last_error());
    char buf[512];
    cr_assert(r.passed, "fp8 %s replay %d (%s): %s", tw_scaling_name(mode), rep, kernel ? kernel : "auto",
              tw_check_format(&r, buf, sizeof buf));
    free(av); free(am); free(ex); free(ab); free(abl); free(bd); free(b2);
  }
#undef LOAD_SIZES
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  tw_free(gpu, dlq.row_data.data); tw_free(gpu, dlq.row_scale_inv.data); tw_free(gpu, drq.row_data.data);
  tw_free(gpu, drq.row_scale_inv.data); tw_free(gpu, dg.data); tw_free(gpu, dout.data);
  free(lq.row_data.data); free(lq.row_scale_inv.data); if (!tw_tensor_is_none(&lq.amax)) free(lq.amax.data);
  free(rq.row_data.data); free(rq.row_scale_inv.data); if (!tw_tensor_is_none(&rq.amax)) free(rq.amax.data);
  free(bv); free(bm); free(x.data); free(w.data); free(gs.data); free(out_r.data); free(out_g.data);
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(ref);
  cudaStreamDestroy(stream);
}

Test(graph_gpu, gg_wgmma_fp8_tensor_replays, .timeout = 300) { graph_replay_fp8(TW_SCALE_TENSOR_CURRENT, "gg_wgmma_fp8"); }
Test(graph_gpu, gg_wgmma_fp8_1x128_replays, .timeout = 300) { graph_replay_fp8(TW_SCALE_BLOCK_1x128, "gg_wgmma_fp8"); }
Test(graph_gpu, fp8_auto_1x128_replays, .timeout = 300) { graph_replay_fp8(TW_SCALE_BLOCK_1x128, NULL); }

/* ---- fp8 wgrad (gg_wgmma_fp8 and auto): the colwise copies, ops T ------------------------ */
static void qc_alloc(tw_qtensor *q, tw_scaling mode, int64_t R, int64_t C, int64_t G) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.layout = TW_COLWISE;
  cr_assert_eq(tw_quantize_output_shapes(&o, R, C, G, q), TW_OK, "%s", tw_last_error());
  tw_tensor *parts[5] = {&q->row_data, &q->row_scale_inv, &q->col_data, &q->col_scale_inv, &q->amax};
  for (int i = 0; i < 5; ++i)
    if (!tw_tensor_is_none(parts[i])) *parts[i] = host_new(parts[i]->dtype, parts[i]->ndim, parts[i]->shape);
}
static void qc_run(tw_ctx *ref, tw_qtensor *q, const tw_tensor *x, const tw_tensor *gs) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = q->mode;
  o.layout = TW_COLWISE;
  cr_assert_eq(tw_grouped_quantize(ref, x, gs, &o, q), TW_OK, "%s", tw_last_error());
}
static void graph_replay_fp8_wgrad(tw_scaling mode, const char *kernel) {
  cudaStream_t stream;
  CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  tw_ctx *ref, *gpu;
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ref, &c), TW_OK, "%s", tw_last_error());
  c.backend = TW_BACKEND_GPU;
  c.stream = stream;
  c.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&gpu, &c), TW_OK, "%s", tw_last_error());
  /* out [G, K, N]: K = 136 (a full 128-row tile and an 8-row one), N = 264 */
  const int64_t G = 8, M = 1000, K = 136, N = 264;
  int64_t xs[2] = {M, K}, ys[2] = {M, N}, gsh[1] = {G}, os[3] = {G, K, N};
  tw_tensor x = host_new(TW_F32, 2, xs), y = host_new(TW_F32, 2, ys), gs = host_new(TW_I32, 1, gsh);
  for (int64_t i = 0; i < M * K; ++i) ((float *)x.data)[i] = (float)((2 * unif() - 1) * ldexp(1.0, (int)(i / K % 7) - 3));
  for (int64_t i = 0; i < M * N; ++i) ((float *)y.data)[i] = (float)(2 * unif() - 1);
  tw_qtensor lq, rq;
  qc_alloc(&lq, mode, M, K, G);
  qc_alloc(&rq, mode, M, N, G);
  tw_qtensor dlq = lq, drq = rq;
  dlq.col_data = dev_of(gpu, &lq.col_data);
  dlq.col_scale_inv = dev_of(gpu, &lq.col_scale_inv);
  dlq.row_scale_inv = dev_of(gpu, &lq.row_scale_inv);
  dlq.amax = tw_tensor_none();
  drq.col_data = dev_of(gpu, &rq.col_data);
  drq.col_scale_inv = dev_of(gpu, &rq.col_scale_inv);
  drq.row_scale_inv = dev_of(gpu, &rq.row_scale_inv);
  drq.amax = tw_tensor_none();
  tw_tensor dg = dev_of(gpu, &gs);
  tw_tensor out_r = host_new(TW_F32, 3, os), out_g = host_new(TW_F32, 3, os);
  tw_tensor dout = dev_of(gpu, &out_g);
  tw_operand a = tw_operand_colwise(&dlq), b = tw_operand_colwise(&drq);
  tw_operand ha = tw_operand_colwise(&lq), hb = tw_operand_colwise(&rq);
#define COPY_IF(d, h) \
  if (!tw_tensor_is_none(&(h))) cr_assert_eq(tw_tensor_copy(gpu, &(d), &(h)), TW_OK)
  /* sizes -> both operands quantized by them (colwise blocks follow the groups) -> device */
#define LOAD_SIZES(sz)                                  \
  do {                                                  \
    memcpy(gs.data, (sz), (size_t)G * 4);               \
    qc_run(ref, &lq, &x, &gs);                          \
    qc_run(ref, &rq, &y, &gs);                          \
    cr_assert_eq(tw_tensor_copy(gpu, &dg, &gs), TW_OK); \
    COPY_IF(dlq.col_data, lq.col_data);                 \
    COPY_IF(dlq.col_scale_inv, lq.col_scale_inv);       \
    COPY_IF(dlq.row_scale_inv, lq.row_scale_inv);       \
    COPY_IF(drq.col_data, rq.col_data);                 \
    COPY_IF(drq.col_scale_inv, rq.col_scale_inv);       \
    COPY_IF(drq.row_scale_inv, rq.row_scale_inv);       \
  } while (0)
  const int32_t first[8] = {125, 125, 125, 125, 125, 125, 125, 125};
  LOAD_SIZES(first);
  cr_assert_eq(tw_grouped_gemm_wgrad(gpu, &a, TW_OP_T, &b, TW_OP_T, &dg, &dout, 0), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s", tw_last_error());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  tw_status s = tw_grouped_gemm_wgrad(gpu, &a, TW_OP_T, &b, TW_OP_T, &dg, &dout, 0);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  cr_assert_eq(s, TW_OK, "captured call: %s", tw_last_error());
  cr_assert_eq(ce, cudaSuccess, "capture failed (a host sync inside the call?): %s", cudaGetErrorString(ce));
  CU(cudaGraphInstantiate(&exec, graph, 0));
  const int32_t replays[4][8] = {
      {125, 125, 125, 125, 125, 125, 125, 125},
      {0, 0, 700, 0, 3, 0, 1, 0},
      {1, 2, 3, 4, 5, 6, 7, 8},
      {0, 0, 0, 0, 0, 0, 0, 1000},
  };
  for (int rep = 0; rep < 4; ++rep) {
    LOAD_SIZES(replays[rep]);
    CU(cudaStreamSynchronize(stream));
    CU(cudaMemsetAsync(dout.data, TW_POISON_BYTE, tw_tensor_bytes(&out_g), stream));
    CU(cudaGraphLaunch(exec, stream));
    CU(cudaStreamSynchronize(stream));
    cr_assert_eq(tw_ctx_check(gpu), TW_OK, "replay %d: %s", rep, tw_last_error());
    cr_assert_eq(tw_tensor_copy(gpu, &out_g, &dout), TW_OK);
    memset(out_r.data, TW_POISON_BYTE, tw_tensor_bytes(&out_r));
    cr_assert_eq(tw_grouped_gemm_wgrad(ref, &ha, TW_OP_T, &hb, TW_OP_T, &gs, &out_r, 0), TW_OK, "ref: %s",
                 tw_last_error());
    double *av = q_values(ref, &lq, &gs, 1, 0), *bv = q_values(ref, &rq, &gs, 1, 0);
    double *am = q_values(ref, &lq, &gs, 1, 1), *bm = q_values(ref, &rq, &gs, 1, 1);
    int64_t n = G * K * N;
    double *ex = (double *)calloc((size_t)n, 8), *ab = (double *)calloc((size_t)n, 8);
    double *abl = (double *)calloc((size_t)n, 8); /* lifted: the promoted model's magnitudes */
    double *bd = (double *)malloc((size_t)n * 8), *b2 = (double *)malloc((size_t)n * 8);
    int64_t o = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = replays[rep][g], base = g * K * N;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < N; ++j) {
          double sx = 0, sa = 0, sl = 0;
          for (int64_t r = o; r < o + m; ++r) {
            double p = av[r * K + k] * bv[r * N + j];
            sx += p;
            sa += fabs(p);
            sl += fabs(am[r * K + k] * bm[r * N + j]);
          }
          ex[base + k * N + j] = sx;
          ab[base + k * N + j] = sa;
          abl[base + k * N + j] = sl;
        }
      /* gpu: the promoted model over the group's m tokens; ref: f32; empty groups exactly +0 */
      tw_gemm_error_bound_promoted(abl + base, ex + base, K * N, m, 128, ldexp(1.0, -13), ldexp(1.0, -24), 2, TW_F32,
                                   bd + base);
      tw_gemm_error_bound(ab + base, ex + base, K * N, m + 4, ldexp(1.0, -24), TW_F32, b2 + base);
      for (int64_t i = base; i < base + K * N; ++i) bd[i] = m == 0 ? -1 : bd[i] + b2[i];
      o += m;
    }
    tw_tensor bt = tw_tensor_1d(bd, TW_F64, n, TW_MEM_HOST);
    tw_tensor g1 = tw_tensor_1d(out_g.data, TW_F32, n, TW_MEM_HOST), e1 = tw_tensor_1d(out_r.data, TW_F32, n, TW_MEM_HOST);
    tw_check_report r;
    cr_assert_eq(tw_check_bound(&g1, &e1, &bt, &r), TW_OK, "%s", tw_last_error());
    char buf[512];
    cr_assert(r.passed, "fp8 wgrad %s replay %d (%s): %s", tw_scaling_name(mode), rep, kernel ? kernel : "auto",
              tw_check_format(&r, buf, sizeof buf));
    free(av); free(bv); free(am); free(bm); free(ex); free(ab); free(abl); free(bd); free(b2);
  }
#undef LOAD_SIZES
#undef COPY_IF
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  tw_tensor *dparts[6] = {&dlq.col_data, &dlq.col_scale_inv, &dlq.row_scale_inv, &drq.col_data, &drq.col_scale_inv, &drq.row_scale_inv};
  for (int i = 0; i < 6; ++i)
    if (!tw_tensor_is_none(dparts[i])) tw_free(gpu, dparts[i]->data);
  tw_tensor *hparts[8] = {&lq.col_data, &lq.col_scale_inv, &lq.row_scale_inv, &lq.amax,
                          &rq.col_data, &rq.col_scale_inv, &rq.row_scale_inv, &rq.amax};
  for (int i = 0; i < 8; ++i)
    if (!tw_tensor_is_none(hparts[i])) free(hparts[i]->data);
  tw_free(gpu, dg.data); tw_free(gpu, dout.data);
  free(x.data); free(y.data); free(gs.data); free(out_r.data); free(out_g.data);
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(ref);
  cudaStreamDestroy(stream);
}

Test(graph_gpu, gg_wgmma_fp8_wgrad_tensor_replays, .timeout = 300) { graph_replay_fp8_wgrad(TW_SCALE_TENSOR_CURRENT, "gg_wgmma_fp8"); }
Test(graph_gpu, gg_wgmma_fp8_wgrad_1x128_replays, .timeout = 300) { graph_replay_fp8_wgrad(TW_SCALE_BLOCK_1x128, "gg_wgmma_fp8"); }
Test(graph_gpu, fp8_auto_wgrad_1x128_replays, .timeout = 300) { graph_replay_fp8_wgrad(TW_SCALE_BLOCK_1x128, NULL); }

/* ---- MXFP8 forward with the rhs as colwise data, op N (gg_wgmma_fp8's pad pass) ------------ */
/* The MoE fp8_mxfp8 forward GEMM: lhs the rowwise MXFP8 of x [M, K], rhs the colwise MXFP8 of
 * w [G*K, N] (op N). gg_wgmma_fp8 first transposes the rhs into a pad buffer that, inside a
 * capture, the call allocates and frees as graph nodes. Each replay (new sizes, the lhs quantized
 * for them) must give the same bits as an eager call with those sizes, rows past the groups
 * untouched (both outputs poisoned alike). */
static void graph_replay_mx_colwise(const char *kernel) {
  cudaStream_t stream;
  CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  tw_ctx *ref, *gpu;
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ref, &c), TW_OK, "%s", tw_last_error());
  c.backend = TW_BACKEND_GPU;
  c.stream = stream;
  c.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&gpu, &c), TW_OK, "%s", tw_last_error());
  /* K = 208: two k-blocks, the second 80 deep; N = 264: column tiles with a ragged one, N % 16 != 0 */
  const int64_t G = 8, M = 1000, K = 208, N = 264;
  int64_t xs[2] = {M, K}, ws[2] = {G * K, N}, gsh[1] = {G}, os[2] = {M, N};
  tw_tensor x = host_new(TW_F32, 2, xs), w = host_new(TW_F32, 2, ws), gs = host_new(TW_I32, 1, gsh);
  for (int64_t i = 0; i < M * K; ++i) ((float *)x.data)[i] = (float)((2 * unif() - 1) * ldexp(1.0, (int)(i / K % 7) - 3));
  for (int64_t i = 0; i < G * K * N; ++i) ((float *)w.data)[i] = (float)((2 * unif() - 1) * ldexp(1.0, (int)(i % 5) - 2));
  int32_t uk[8];
  for (int g = 0; g < 8; ++g) uk[g] = (int32_t)K;
  tw_tensor ugs = tw_tensor_1d(uk, TW_I32, G, TW_MEM_HOST);
  tw_qtensor lq, rq;
  q_alloc(&lq, TW_SCALE_MXFP8_1D, M, K, G);
  qc_alloc(&rq, TW_SCALE_MXFP8_1D, G * K, N, G);
  qc_run(ref, &rq, &w, &ugs);
  tw_qtensor dlq = lq, drq = rq;
  dlq.row_data = dev_of(gpu, &lq.row_data);
  dlq.row_scale_inv = dev_of(gpu, &lq.row_scale_inv);
  dlq.amax = tw_tensor_none();
  drq.col_data = dev_of(gpu, &rq.col_data);
  drq.col_scale_inv = dev_of(gpu, &rq.col_scale_inv);
  drq.amax = tw_tensor_none();
  cr_assert_eq(tw_tensor_copy(gpu, &drq.col_data, &rq.col_data), TW_OK);
  cr_assert_eq(tw_tensor_copy(gpu, &drq.col_scale_inv, &rq.col_scale_inv), TW_OK);
  tw_tensor dg = dev_of(gpu, &gs);
  tw_tensor out_e = host_new(TW_F32, 2, os), out_g = host_new(TW_F32, 2, os);
  tw_tensor dout = dev_of(gpu, &out_g), dout_e = dev_of(gpu, &out_e);
  tw_operand a = tw_operand_rowwise(&dlq), b = tw_operand_colwise(&drq);
#define LOAD_SIZES(sz)                                                                   \
  do {                                                                                   \
    memcpy(gs.data, (sz), (size_t)G * 4);                                                \
    q_run(ref, &lq, &x, &gs);                                                            \
    cr_assert_eq(tw_tensor_copy(gpu, &dg, &gs), TW_OK);                                  \
    cr_assert_eq(tw_tensor_copy(gpu, &dlq.row_data, &lq.row_data), TW_OK);               \
    cr_assert_eq(tw_tensor_copy(gpu, &dlq.row_scale_inv, &lq.row_scale_inv), TW_OK);     \
  } while (0)
  const int32_t first[8] = {125, 125, 125, 125, 125, 125, 125, 125};
  LOAD_SIZES(first);
  cr_assert_eq(tw_grouped_gemm(gpu, &a, &b, TW_OP_N, &dg, &dout, 0), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s", tw_last_error());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  tw_status s = tw_grouped_gemm(gpu, &a, &b, TW_OP_N, &dg, &dout, 0);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  cr_assert_eq(s, TW_OK, "captured call: %s", tw_last_error());
  cr_assert_eq(ce, cudaSuccess, "capture failed (a host sync inside the call?): %s", cudaGetErrorString(ce));
  CU(cudaGraphInstantiate(&exec, graph, 0));
  const int32_t replays[4][8] = {
      {125, 125, 125, 125, 125, 125, 125, 125},
      {0, 0, 700, 0, 3, 0, 1, 0},
      {1, 2, 3, 4, 5, 6, 7, 8},
      {0, 0, 0, 0, 0, 0, 0, 1000},
  };
  for (int rep = 0; rep < 4; ++rep) {
    LOAD_SIZES(replays[rep]);
    CU(cudaStreamSynchronize(stream));
    CU(cudaMemsetAsync(dout.data, TW_POISON_BYTE, tw_tensor_bytes(&out_g), stream));
    CU(cudaMemsetAsync(dout_e.data, TW_POISON_BYTE, tw_tensor_bytes(&out_e), stream));
    CU(cudaGraphLaunch(exec, stream));
    cr_assert_eq(tw_grouped_gemm(gpu, &a, &b, TW_OP_N, &dg, &dout_e, 0), TW_OK, "eager: %s", tw_last_error());
    CU(cudaStreamSynchronize(stream));
    cr_assert_eq(tw_ctx_check(gpu), TW_OK, "replay %d: %s", rep, tw_last_error());
    cr_assert_eq(tw_tensor_copy(gpu, &out_g, &dout), TW_OK);
    cr_assert_eq(tw_tensor_copy(gpu, &out_e, &dout_e), TW_OK);
    cr_assert(memcmp(out_g.data, out_e.data, tw_tensor_bytes(&out_g)) == 0,
              "mxfp8 colwise rhs replay %d (%s): the graph's output differs from the eager call's", rep,
              kernel ? kernel : "auto");
  }
#undef LOAD_SIZES
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  tw_free(gpu, dlq.row_data.data); tw_free(gpu, dlq.row_scale_inv.data); tw_free(gpu, drq.col_data.data);
  tw_free(gpu, drq.col_scale_inv.data); tw_free(gpu, dg.data); tw_free(gpu, dout.data); tw_free(gpu, dout_e.data);
  free(lq.row_data.data); free(lq.row_scale_inv.data); if (!tw_tensor_is_none(&lq.amax)) free(lq.amax.data);
  tw_tensor *rp[5] = {&rq.row_data, &rq.row_scale_inv, &rq.col_data, &rq.col_scale_inv, &rq.amax};
  for (int i = 0; i < 5; ++i)
    if (!tw_tensor_is_none(rp[i])) free(rp[i]->data);
  free(x.data); free(w.data); free(gs.data); free(out_e.data); free(out_g.data);
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(ref);
  cudaStreamDestroy(stream);
}

Test(graph_gpu, gg_wgmma_fp8_mxfp8_colwise_rhs_replays, .timeout = 300) { graph_replay_mx_colwise("gg_wgmma_fp8"); }
Test(graph_gpu, fp8_auto_mxfp8_colwise_rhs_replays, .timeout = 300) { graph_replay_mx_colwise(NULL); }
