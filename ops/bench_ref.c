/* The ref backend's benches (registry entries grouped_gemm and grouped_quantize):
 *   grouped GEMM GFLOP/s (f32 and bf16 inputs, G = 8..64 with skewed group sizes) next to one
 *   cblas_sgemm of the same total FLOPs (M = sum of the groups), which is also its floor;
 *   grouped quantize GB/s per mode (bytes read + written) next to a memcpy moving as many
 *   bytes, which is also its floor. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/bench_ref.h"
#include "ops/data.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

static uint64_t rng_state = 0x7477696eull;
static double urand(void) { return tw_splitmix_unit(&rng_state); }

/* S rows over G groups, skewed like routed tokens: weight 1/(g+1)^1.2 in a shuffled order,
 * every fifth group empty. */
static void skewed_sizes(int32_t *gs, int G, int S) {
  double w[256], sum = 0;
  for (int g = 0; g < G; g++) sum += (w[g] = (g % 5 == 4) ? 0 : 1.0 / pow(g + 1, 1.2));
  int left = S;
  for (int g = 0; g < G; g++) {
    gs[g] = (int32_t)floor(S * w[g] / sum);
    left -= gs[g];
  }
  gs[0] += left;
  for (int g = G - 1; g > 0; g--) { /* shuffle so the big group is not always first */
    int j = (int)(urand() * (g + 1));
    int32_t t = gs[g]; gs[g] = gs[j]; gs[j] = t;
  }
}

/* Median wall time of fn over the configured iterations; < 0 if fn failed. */
typedef tw_status (*bench_fn)(void *arg);
static double time_it(const tw_bench_cfg *b, bench_fn fn, void *arg) {
  double t[1000];
  int n = b->iters < 1000 ? b->iters : 1000;
  for (int i = 0; i < b->warmup; i++)
    if (fn(arg) != TW_OK) return -1;
  for (int i = 0; i < n; i++) {
    double t0 = tw_bench_now_ms();
    if (fn(arg) != TW_OK) return -1;
    t[i] = tw_bench_now_ms() - t0;
  }
  return tw_bench_median(t, n);
}

/* ---- grouped GEMM ------------------------------------------------------------------------------ */
typedef struct {
  tw_ctx *ctx;
  tw_operand lhs, rhs;
  tw_tensor gs, out;
  float *a32, *b32, *c32;
  int S, K, N;
} gemm_arg;

static tw_status run_grouped(void *p) {
  gemm_arg *g = (gemm_arg *)p;
  return tw_grouped_gemm(g->ctx, &g->lhs, &g->rhs, TW_OP_N, &g->gs, &g->out, 0);
}

static tw_status run_sgemm(void *p) {
  gemm_arg *g = (gemm_arg *)p;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g->S, g->N, g->K, 1.0f, g->a32, g->K,
              g->b32, g->N, 0.0f, g->c32, g->N);
  return TW_OK;
}

int tw_bench_ref_grouped_gemm(const tw_bench_cfg *b, tw_ctx *ctx) {
  int failures = 0;
  static const struct { int G, S, K, N; } shapes[] = {
      {8, 4096, 512, 512}, {16, 4096, 1024, 256}, {32, 2048, 512, 1024}, {64, 4096, 256, 512}};
  static const tw_dtype dtypes[] = {TW_F32, TW_BF16};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (size_t di = 0; di < 2; di++) {
      int G = shapes[si].G, S = shapes[si].S, K = shapes[si].K, N = shapes[si].N;
      tw_dtype dt = dtypes[di];
      size_t esz = (size_t)tw_dtype_bits(dt) / 8;
      int32_t gs[64];
      skewed_sizes(gs, G, S);
      void *lhs = malloc((size_t)S * K * esz), *rhs = malloc((size_t)G * K * N * esz);
      float *out = (float *)malloc((size_t)S * N * 4);
      float *a32 = (float *)malloc((size_t)S * K * 4), *b32 = (float *)malloc((size_t)K * N * G * 4);
      float *c32 = (float *)malloc((size_t)S * N * 4);
      if (!lhs || !rhs || !out || !a32 || !b32 || !c32) {
        fprintf(stderr, "twin bench: out of memory\n");
        failures++;
      } else {
        for (int64_t i = 0; i < (int64_t)S * K; i++) tw_store_from_f64(lhs, dt, i, urand() * 2 - 1, 0);
        for (int64_t i = 0; i < (int64_t)G * K * N; i++) tw_store_from_f64(rhs, dt, i, urand() * 2 - 1, 0);
        for (int64_t i = 0; i < (int64_t)S * K; i++) a32[i] = (float)tw_load_as_f64(lhs, dt, i);
        for (int64_t i = 0; i < (int64_t)K * N; i++) b32[i] = (float)tw_load_as_f64(rhs, dt, i);
        tw_tensor tl = tw_tensor_2d(lhs, dt, S, K, TW_MEM_HOST), tr = tw_tensor_3d(rhs, dt, G, K, N, TW_MEM_HOST);
        gemm_arg g = {ctx, tw_operand_plain(&tl), tw_operand_plain(&tr), tw_tensor_1d(gs, TW_I32, G, TW_MEM_HOST),
                      tw_tensor_2d(out, TW_F32, S, N, TW_MEM_HOST), a32, b32, c32, S, K, N};
        tw_bench_row r;
        memset(&r, 0, sizeof r);
        r.op = "grouped_gemm";
        snprintf(r.shape, sizeof r.shape, "G=%d S=%d K=%d N=%d %s skewed", G, S, K, N, tw_dtype_name(dt));
        r.backend = "ref";
        snprintf(r.version, sizeof r.version, "%s", tw_ctx_kernel(ctx) ? tw_ctx_kernel(ctx) : "");
        r.unit = "GFLOP/s";
        r.pct_of_floor = -1;
        r.ms = time_it(b, run_grouped, &g);
        if (r.ms < 0) {
          fprintf(stderr, "twin bench: grouped_gemm %s: %s\n", r.shape, tw_last_error());
          failures++;
        } else {
          double flops = 2.0 * S * K * N;
          r.rate = flops / (r.ms * 1e6);
          r.flops = flops;
          r.bytes = (double)esz * ((double)S * K + (double)G * K * N) + 4.0 * S * N;
          snprintf(r.peer, sizeof r.peer, "cblas_sgemm");
          r.peer_ms = time_it(b, run_sgemm, &g);
          r.ratio = r.peer_ms / r.ms;
          /* the floor: the dense sgemm rate of this machine for the same FLOPs */
          r.pct_of_floor = 100.0 * r.peer_ms / r.ms;
          tw_bench_emit(&r, b->csv);
        }
      }
      free(lhs); free(rhs); free(out); free(a32); free(b32); free(c32);
    }
  return failures != 0;
}

/* ---- quantize ------------------------------------------------------------------------------------ */
typedef struct {
  tw_ctx *ctx;
  tw_tensor x, gs;
  tw_quantize_opts opts;
  tw_qtensor q;
  void *src, *dst;
  size_t copy_bytes;
} quant_arg;

static tw_status run_quantize(void *p) {
  quant_arg *a = (quant_arg *)p;
  return tw_grouped_quantize(a->ctx, &a->x, &a->gs, &a->opts, &a->q);
}

static tw_status run_memcpy(void *p) {
  quant_arg *a = (quant_arg *)p;
  memcpy(a->dst, a->src, a->copy_bytes);
  return TW_OK;
}

static void *alloc_part(tw_tensor *t, size_t *bytes) {
  if (tw_tensor_is_none(t)) return NULL;
  size_t n = tw_tensor_bytes(t);
  t->data = calloc(1, n ? n : 1);
  *bytes += n;
  return t->data;
}

int tw_bench_ref_quantize(const tw_bench_cfg *b, tw_ctx *ctx) {
  int failures = 0;
  const int M = 2048, K = 1024, G = 8;
  static const tw_scaling modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_MXFP8_1D,
                                     TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};
  uint16_t *x = (uint16_t *)malloc((size_t)M * K * 2);
  int32_t gs[8];
  float scale[8];
  skewed_sizes(gs, G, M);
  for (int g = 0; g < G; g++) scale[g] = 64.0f;
  if (!x) return 1;
  for (int64_t i = 0; i < (int64_t)M * K; i++) x[i] = tw_f32_to_bf16((float)(urand() * 8 - 4));
  for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
    quant_arg a;
    memset(&a, 0, sizeof a);
    a.ctx = ctx;
    a.x = tw_tensor_2d(x, TW_BF16, M, K, TW_MEM_HOST);
    a.gs = tw_tensor_1d(gs, TW_I32, G, TW_MEM_HOST);
    a.opts = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
    a.opts.mode = modes[mi];
    a.opts.layout = TW_ROWWISE_COLWISE;
    a.opts.scale = tw_tensor_1d(scale, TW_F32, G, TW_MEM_HOST);
    tw_bench_row r;
    memset(&r, 0, sizeof r);
    r.op = "quantize";
    snprintf(r.shape, sizeof r.shape, "%s M=%d K=%d G=%d bf16 row+col", tw_scaling_name(modes[mi]), M, K, G);
    r.backend = "ref";
    r.unit = "GB/s";
    if (tw_quantize_output_shapes(&a.opts, M, K, G, &a.q) != TW_OK) {
      fprintf(stderr, "twin bench: quantize %s: %s\n", r.shape, tw_last_error());
      failures++;
      continue;
    }
    size_t bytes = (size_t)M * K * 2;
    int shared = !tw_tensor_is_none(&a.q.col_scale_inv) &&
                 (modes[mi] == TW_SCALE_TENSOR_CURRENT || modes[mi] == TW_SCALE_TENSOR_DELAYED);
    alloc_part(&a.q.row_data, &bytes);
    alloc_part(&a.q.row_scale_inv, &bytes);
    alloc_part(&a.q.col_data, &bytes);
    if (shared) a.q.col_scale_inv = a.q.row_scale_inv;
    else alloc_part(&a.q.col_scale_inv, &bytes);
    alloc_part(&a.q.amax, &bytes);
    /* the peer moves the same bytes: memcpy of bytes/2 reads and writes bytes */
    a.copy_bytes = bytes / 2;
    a.src = malloc(a.copy_bytes);
    a.dst = malloc(a.copy_bytes);
    if (a.src) memset(a.src, 1, a.copy_bytes);
    r.ms = (a.src && a.dst) ? time_it(b, run_quantize, &a) : -1;
    if (r.ms < 0) {
      fprintf(stderr, "twin bench: quantize %s: %s\n", r.shape, tw_last_error());
      failures++;
    } else {
      r.rate = bytes / (r.ms * 1e6);
      r.bytes = (double)bytes;
      snprintf(r.peer, sizeof r.peer, "memcpy");
      r.peer_ms = time_it(b, run_memcpy, &a);
      r.ratio = r.peer_ms / r.ms;
      r.pct_of_floor = 100.0 * r.ratio; /* memcpy bandwidth is the floor for a streaming op */
      tw_bench_emit(&r, b->csv);
    }
    free(a.q.row_data.data);
    free(a.q.row_scale_inv.data);
    free(a.q.col_data.data);
    if (!shared) free(a.q.col_scale_inv.data);
    free(a.q.amax.data);
    free(a.src);
    free(a.dst);
  }
  free(x);
  return failures != 0;
}

