/* `twin bench --backend gpu --op grouped_gemm`: the GPU GEMM bench (tw_bench_gpu_gemm).
 *
 * Rows, all timed in one run on one stream with CUDA events (median of max(iters, 10)):
 *   dense 8192^3 bf16 and fp8 e4m3 (per-tensor): tw_gemm through cuBLASLt (gemm_lt) and the
 *     gg kernels (gg_mma, gg_mma_wide), next to a direct cublasLtMatmul call of the same problem (twin's overhead over
 *     cuBLASLt; target within 3%) or the torch peer; fp8 also the default choice ("auto":
 *     gg_wgmma_fp8 on sm_90) and its ratio to gemm_lt's time in the same call (target >= 0.9). The cuBLASLt rates are the floors
 *     ("% of dense peak") of the grouped rows below.
 *   grouped forward, the five shapes of gpu-machine.md (G, m per group, N, K; lhs [G*m, K],
 *     rhs [G, N, K] op T, bf16 out): bf16, fp8 per-tensor, fp8 1x128 blocks, fp8 MXFP8 (E8M0
 *     scales every 32 along K, compact byte order); versions gg_mma
 *     (128x128 tiles), gg_mma_wide (auto where it fits; bf16 and per-tensor fp8 rows), gg_wgmma
 *     (Hopper wgmma + TMA, bf16 rows), gg_wgmma_fp8 (Hopper fp8 wgmma, per-tensor and 1x128 rows;
 *     the fp8 auto choice on sm_90; also with its column tile forced to 128 and to 192, rows "BN
 *     128" / "BN 192", knob TWIN_GG_WGMMA_FP8_BN, as the dense fp8 default: after a discarded
 *     warm round, the fastest of three rounds in alternating order, all three printed) and
 *     gg_lt_loop (host sizes, one cuBLASLt call per group), peers from --peers
 *     (tools/peers/torch_grouped_mm.py: torch._grouped_mm / torch._scaled_grouped_mm; the 1x128
 *     rows are compared with torch's rowwise-scaled fp8, the peer issue 16 sets; so are the MXFP8
 *     rows: torch has no MXFP8 grouped GEMM on Hopper). MXFP8 runs gg_mma_wide (its auto choice
 *     before gg_wgmma_fp8 took MXFP8) and gg_wgmma_fp8; then MXFP8 with rhs the colwise data of
 *     its [G*K, N] source, op N (the MoE fp8_mxfp8 weights: gg_wgmma_fp8's transposing pad pass
 *     included in the time), compact and swizzled scales, with its rate over the rowwise row.
 *   grouped wgrad, the same five shapes with the same FLOPs: out [G, K, N] (bf16) from lhs
 *     [G*m, K] and rhs [G*m, N] (bf16, ops N), groups of m rows; versions gg_mma_wide and
 *     gg_wgmma (and gg_wgmma with its register epilogue, the accumulate path; with the
 *     producer warps' tail zeroing; with one map per operand and the consumers' tail zeroing, the
 *     default before per-group maps), peer torch._grouped_mm in its ragged-K form (offs along the
 *     contracting dim), the ratio to gg_wgmma's forward rate on the same shape (target >= 0.9),
 *     and on G32 / G128 ragged sizes (m -+ d) the same ways and with no tail handling at all.
 *   fp8 wgrad (e4m3 from the per-group transposed colwise copies, ops T, the MoE block's form):
 *     per-tensor and 1x128, gg_wgmma_fp8 next to the exact kernel it replaced (gg_mma_wide /
 *     gg_mma), with the ratio to gg_wgmma_fp8's forward rate; also from token-padded operands
 *     (tw_quantize.h opts.col_padded: no copy pass; rows "token-padded"), with the consumers' turns
 *     forced off and on and the column tile forced to 128 and 192 (knobs
 *     TWIN_GG_WGMMA_FP8_WGRAD_ORDER=0|1, TWIN_GG_WGMMA_FP8_WGRAD_BN=128|192; rows "turns 0|1, BN
 *     128|192") next to the forward, all eight timed in rotating rounds after a discarded warm
 *     round (time_variants; fastest kept round per row, each wgrad's rate over that forward row
 *     and over the default row printed with the rounds); G32 / G128 ragged sizes too. MXFP8
 *     (colwise [M, K] / [M, N] data, ops N, compact E8M0 scales every 32 tokens): gg_wgmma_fp8
 *     next to gg_mma_wide, with its rate over the 1x128 and per-tensor wgrads and over the MXFP8
 *     forward.
 * `--op grouped_gemm_wgrad` (alias wgrad) runs only the dense floors (bf16, fp8), the gg_wgmma and
 * gg_wgmma_fp8 forward rows (MXFP8 included) and the wgrad rows.
 * Data is random (random bits inflate power less than constants; DeepGEMM PR #116). */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/bench.h"
#include "ops/data.h"
#include "tools/bench_gpu.h"
#include "twin/tw_base.h"
#include "twin/tw_gemm.h"

typedef struct { int64_t G, m, N, K; } gshape;
static const gshape shapes[] = {
    {4, 8192, 4096, 7168}, {4, 8192, 7168, 2048}, {8, 4096, 4096, 7168}, {32, 512, 2048, 7168}, {128, 128, 2048, 4096},
};

static cudaStream_t stream;
static uint64_t rs = 0x62656e6368ull;
static uint64_t rnd(void) { return tw_splitmix64(&rs); }

/* Fills n elements of esize bytes with random finite values in about [-1, 1] (bf16) or
 * random finite e4m3 codes (fp8), through a host chunk. */
static int fill(void *d, int64_t n, int esize) {
  enum { CH = 1 << 22 };
  static uint8_t host[CH * 2];
  static int ready[3];
  if (!ready[esize]) {
    for (int64_t i = 0; i < CH; ++i) {
      uint64_t r = rnd();
      if (esize == 2) { /* bf16: sign, exponent 2^-8..2^0, random mantissa */
        uint16_t v = (uint16_t)(((r & 1) << 15) | ((119 + (r >> 1) % 8) << 7) | ((r >> 8) & 0x7F));
        memcpy(host + 2 * i, &v, 2);
      } else {
        uint8_t c = (uint8_t)(r & 0xFF);
        if ((c & 0x7F) == 0x7F) c ^= 1; /* no NaN codes */
        host[i] = c;
      }
    }
    ready[esize] = 1;
  }
  for (int64_t off = 0; off < n; off += CH) {
    int64_t k = n - off < CH ? n - off : CH;
    if (cudaMemcpy((char *)d + off * esize, host, (size_t)(k * esize), cudaMemcpyHostToDevice) != cudaSuccess) return -1;
  }
  return 0;
}
static int fill_f32(void *d, int64_t n, float v) {
  float *h = (float *)malloc((size_t)n * 4);
  for (int64_t i = 0; i < n; ++i) h[i] = v;
  int rc = cudaMemcpy(d, h, (size_t)n * 4, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
  free(h);
  return rc;
}

/* The ragged variants' step d (sizes m - d, m + d alternating; d < m, so no size is <= 0): the
 * five standard shapes' 12 / 28 (bf16) and 13 / 29 (fp8, odd: every row at an odd offset), less
 * on --shapes with few rows per group. */
static int32_t ragged_step(int64_t m, int odd) {
  const int32_t d = m == 512 ? 12 : 28;
  if (d < m / 2) return d + odd;
  return odd ? (int32_t)((m - 1) / 2) | 1 : (int32_t)(m / 2);
}

/* median ms of fn on the stream (bench_gpu.h), then the context's device error word */
static double time_it(tw_gpu_work fn, void *arg, int warmup, int iters, tw_ctx *ctx) {
  double med = tw_bench_gpu_time(stream, warmup, iters, fn, arg);
  if (ctx && tw_ctx_check(ctx) != TW_OK) return -1;
  return med;
}

static int run_call(void *p);
/* Variants, each a call (args[v]) with a setting of knobs (value NULL: the knob unset), timed in
 * one discarded warm round, then max(3, nv) rounds; round r runs variant (i + r) % nv at position
 * i (with two variants: 0 1, 1 0, 0 1), so each variant leads a round. The discarded round: the
 * first ~100 ms after an idle gap (the data fills) run at a higher clock than what follows (run
 * wt1, H200: every variant of the first round 5-12% faster than in the three after it, which
 * hid the differences that held in all later rounds). Fastest kept round per variant in best[],
 * all kept rounds in all[v][r]; the knobs' previous values restored after. */
#define VAR_KNOBS 3
#define VAR_MAX 8
typedef struct {
  const char *name;
  const char *val[VAR_KNOBS];
} variant;
static void time_variants(const char *const knobs[VAR_KNOBS], const variant *vs, int nv, void *const *args,
                          int warmup, int iters, tw_ctx *ctx, double best[VAR_MAX], double all[VAR_MAX][VAR_MAX]) {
  const int nr = nv > 3 ? nv : 3;
  char keep[VAR_KNOBS][16];
  int had[VAR_KNOBS];
  for (int k = 0; k < VAR_KNOBS; ++k) {
    const char *p = knobs[k] ? getenv(knobs[k]) : NULL;
    had[k] = p != NULL;
    snprintf(keep[k], sizeof keep[k], "%s", p ? p : "");
  }
  for (int r = -1; r < nr; ++r)
    for (int i = 0; i < nv; ++i) {
      const int v = (i + (r < 0 ? 0 : r)) % nv;
      for (int k = 0; k < VAR_KNOBS; ++k) {
        if (!knobs[k]) continue;
        if (vs[v].val[k]) setenv(knobs[k], vs[v].val[k], 1);
        else unsetenv(knobs[k]);
      }
      const double ms = time_it(run_call, args[v], warmup, iters, ctx);
      if (r >= 0) all[v][r] = ms;
      else if (ms < 0) all[v][0] = ms;  /* an error in the warm round still shows */
    }
  for (int k = 0; k < VAR_KNOBS; ++k) {
    if (!knobs[k]) continue;
    if (had[k]) setenv(knobs[k], keep[k], 1);
    else unsetenv(knobs[k]);
  }
  for (int v = 0; v < nv; ++v) {
    best[v] = all[v][0];
    for (int r = 1; r < nr; ++r)
      if (all[v][r] < 0 || (best[v] > 0 && all[v][r] < best[v])) best[v] = all[v][r];
  }
}
/* BN 128 against BN 192 (TWIN_GG_WGMMA_FP8_BN, read on every call) as two time_variants
 * variants: a discarded warm round, then three rounds in rotating order (128 192, 192 128,
 * 128 192). Without the warm round the first row of a kind ran up to 14% faster than the same
 * kernel after it (runs n192-b1, wt1) and "fastest round" favoured whichever BN ran first. Each
 * BN's fastest kept round in best[], all kept rounds in all[][3]. */
static void time_bn_pair(void *arg, int warmup, int iters, tw_ctx *ctx, double best[2], double all[2][3]) {
  static const char *const knobs[VAR_KNOBS] = {"TWIN_GG_WGMMA_FP8_BN", NULL, NULL};
  static const variant vs[2] = {{"BN 128", {"128", NULL, NULL}}, {"BN 192", {"192", NULL, NULL}}};
  void *const args[2] = {arg, arg};
  double b[VAR_MAX], a[VAR_MAX][VAR_MAX];
  time_variants(knobs, vs, 2, args, warmup, iters, ctx, b, a);
  for (int w = 0; w < 2; ++w) {
    best[w] = b[w];
    for (int r = 0; r < 3; ++r) all[w][r] = a[w][r];
  }
}

/* ---- peers ----------------------------------------------------------------------------- */
static char *peers;
static double peer_ms(const char *key, const char *peer) { return tw_bench_peer_ms(peers, key, peer); }

/* ---- the calls ------------------------------------------------------------------------- */
typedef struct {
  tw_ctx *ctx;
  tw_operand a, b;
  tw_op op_b;
  tw_tensor gs, out;
  int grouped;  /* 2: wgrad (ops N) */
} call;

static int run_call(void *p) {
  call *c = (call *)p;
  if (c->grouped == 2) return tw_grouped_gemm_wgrad(c->ctx, &c->a, TW_OP_N, &c->b, TW_OP_N, &c->gs, &c->out, 0);
  if (c->grouped == 3) return tw_grouped_gemm_wgrad(c->ctx, &c->a, TW_OP_T, &c->b, TW_OP_T, &c->gs, &c->out, 0);
  if (c->grouped) return tw_grouped_gemm(c->ctx, &c->a, &c->b, c->op_b, &c->gs, &c->out, 0);
  return tw_gemm(c->ctx, &c->a, TW_OP_N, &c->b, c->op_b, &c->out, 0);
}

/* direct cuBLASLt: out^T [N, M] = b^T-slot x a, both K-major (the layout of the rows above) */
typedef struct {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulHeuristicResult_t res;
  const void *a, *b;
  void *out, *ws;
  size_t ws_bytes;
} raw_lt;

static int run_raw(void *p) {
  raw_lt *r = (raw_lt *)p;
  float alpha = 1, beta = 0;
  return cublasLtMatmul(r->h, r->desc, &alpha, r->b, r->la, r->a, r->lb, &beta, r->out, r->lc, r->out, r->lc,
                        &r->res.algo, r->ws, r->res.workspaceSize, stream) == CUBLAS_STATUS_SUCCESS
             ? TW_OK
             : TW_ERR_CUDA;
}

static int raw_setup(raw_lt *r, int fp8, int64_t M, int64_t N, int64_t K, const void *a, const void *b, void *out,
                     const float *sa, const float *sb) {
  memset(r, 0, sizeof *r);
  cudaDataType in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasOperation_t T = CUBLAS_OP_T, N_ = CUBLAS_OP_N;
  r->ws_bytes = (size_t)32 << 20;
  if (cudaMalloc(&r->ws, r->ws_bytes) != cudaSuccess) return -1;
  if (cublasLtCreate(&r->h) != CUBLAS_STATUS_SUCCESS) return -1;
  cublasLtMatmulDescCreate(&r->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasLtMatmulDescSetAttribute(r->desc, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof T);
  cublasLtMatmulDescSetAttribute(r->desc, CUBLASLT_MATMUL_DESC_TRANSB, &N_, sizeof N_);
  if (fp8) {
    cublasLtMatmulDescSetAttribute(r->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof sb);
    cublasLtMatmulDescSetAttribute(r->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof sa);
  }
  cublasLtMatrixLayoutCreate(&r->la, in, K, N, K);
  cublasLtMatrixLayoutCreate(&r->lb, in, K, M, K);
  cublasLtMatrixLayoutCreate(&r->lc, CUDA_R_16BF, N, M, N);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &r->ws_bytes, sizeof r->ws_bytes);
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(r->h, r->desc, r->la, r->lb, r->lc, r->lc, pref, 1, &r->res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  r->a = a;
  r->b = b;
  r->out = out;
  return found ? 0 : -1;
}
static void raw_free(raw_lt *r) {
  if (r->desc) cublasLtMatmulDescDestroy(r->desc);
  if (r->la) cublasLtMatrixLayoutDestroy(r->la);
  if (r->lb) cublasLtMatrixLayoutDestroy(r->lb);
  if (r->lc) cublasLtMatrixLayoutDestroy(r->lc);
  if (r->h) cublasLtDestroy(r->h);
  if (r->ws) cudaFree(r->ws);
}

static tw_ctx *make_ctx(const char *kernel) {
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  c.backend = TW_BACKEND_GPU;
  c.stream = stream;
  c.kernel = kernel;
  tw_ctx *ctx = NULL;
  if (tw_ctx_create(&ctx, &c) != TW_OK) fprintf(stderr, "bench gpu gemm: %s\n", tw_last_error());
  return ctx;
}

/* bytes an ideal kernel moves for the problem being timed (operands read once, out written
 * once): set where each problem is set up, read by row_out for the roofline */
static double cur_bytes;

static void row_out(const char *shape, const char *ver, double ms, double flop, double floor_tflops,
                    const char *peer, double pms, FILE *csv) {
  tw_bench_row r;
  memset(&r, 0, sizeof r);
  r.op = "grouped_gemm";
  snprintf(r.shape, sizeof r.shape, "%s", shape);
  r.backend = "gpu";
  snprintf(r.version, sizeof r.version, "%s", ver);
  r.ms = ms;
  r.unit = "TFLOP/s";
  r.rate = ms > 0 ? flop / (ms * 1e-3) / 1e12 : -1;
  r.flops = flop;
  r.bytes = cur_bytes;
  r.pct_of_floor = floor_tflops > 0 && ms > 0 ? 100.0 * r.rate / floor_tflops : -1;
  snprintf(r.peer, sizeof r.peer, "%s", peer ? peer : "");
  r.peer_ms = pms;
  r.ratio = pms > 0 && ms > 0 ? pms / ms : -1;
  if (!strncmp(shape, "dense", 5)) r.op = "gemm";
  tw_bench_print_row(&r, csv);
}

int tw_bench_gpu_gemm(const tw_bench_cfg *cfg) {
  int iters = cfg->iters > 10 ? cfg->iters : 10, warmup = cfg->warmup > 2 ? cfg->warmup : 2;
  if (cfg->op && strcmp(cfg->op, "all") && strcmp(cfg->op, "grouped_gemm") && strcmp(cfg->op, "gemm") &&
      strcmp(cfg->op, "grouped_gemm_wgrad"))
    return 0;
  const int wgrad_only = cfg->op && !strcmp(cfg->op, "grouped_gemm_wgrad");
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "bench gpu gemm: no CUDA stream (no GPU?)\n");
    return 1;
  }
  if (cfg->peers_json && !(peers = tw_bench_peers_read(cfg->peers_json))) {
    fprintf(stderr, "bench gpu gemm: cannot open --peers %s\n", cfg->peers_json);
    return 1;
  }
  tw_ctx *c_auto = make_ctx(NULL), *c_mma = make_ctx("gg_mma"), *c_loop = make_ctx("gg_lt_loop"),
         *c_lt = make_ctx("gemm_lt"), *c_wide = make_ctx("gg_mma_wide"), *c_wg = make_ctx("gg_wgmma"), *c_wf8 = make_ctx("gg_wgmma_fp8");
  if (!c_auto || !c_mma || !c_loop || !c_lt || !c_wide || !c_wg || !c_wf8) return 1;
  int rc = 0;
  /* cmd_bench printed the header */

  /* profiling (ncu): TWIN_BENCH_ONLY=G128_m128 runs only the grouped shapes whose key holds it,
   * TWIN_BENCH_ONLY=dense_8192 only the dense floors (then no grouped shape runs) */
  const char *only = getenv("TWIN_BENCH_ONLY");

  /* ---- dense 8192^3: the floors ---- */
  const int64_t D = 8192;
  double peak_bf16 = -1, peak_fp8 = -1;
  if (!only || strstr("dense_8192", only)) {
    void *a, *b, *o, *a8, *b8, *s;
    if (tw_alloc(c_auto, (size_t)(D * D * 2), &a) || tw_alloc(c_auto, (size_t)(D * D * 2), &b) ||
        tw_alloc(c_auto, (size_t)(D * D * 2), &o) || tw_alloc(c_auto, (size_t)(D * D), &a8) ||
        tw_alloc(c_auto, (size_t)(D * D), &b8) || tw_alloc(c_auto, 256, &s) || fill(a, D * D, 2) ||
        fill(b, D * D, 2) || fill(a8, D * D, 1) || fill(b8, D * D, 1) || fill_f32(s, 8, 1.f)) {
      fprintf(stderr, "bench gpu gemm: allocation failed\n");
      return 1;
    }
    double flop = 2.0 * D * D * D;
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      call c;
      memset(&c, 0, sizeof c);
      tw_tensor A = tw_tensor_2d(fp8 ? a8 : a, fp8 ? TW_E4M3 : TW_BF16, D, D, TW_MEM_DEVICE);
      tw_tensor B = tw_tensor_2d(fp8 ? b8 : b, fp8 ? TW_E4M3 : TW_BF16, D, D, TW_MEM_DEVICE);
      c.out = tw_tensor_2d(o, TW_BF16, D, D, TW_MEM_DEVICE);
      c.a = tw_operand_plain(&A);
      c.b = tw_operand_plain(&B);
      c.op_b = TW_OP_T;
      if (fp8) {
        c.a.mode = c.b.mode = TW_SCALE_TENSOR_CURRENT;
        c.a.scale_inv = tw_tensor_1d(s, TW_F32, 1, TW_MEM_DEVICE);
        c.b.scale_inv = tw_tensor_1d((float *)s + 4, TW_F32, 1, TW_MEM_DEVICE);
      }
      raw_lt r;
      double raw = -1;
      if (raw_setup(&r, fp8, D, D, D, fp8 ? a8 : a, fp8 ? b8 : b, o, (float *)s, (float *)s + 4) == 0)
        raw = time_it(run_raw, &r, warmup, iters, NULL);
      raw_free(&r);
      const char *shape = fp8 ? "dense 8192^3 e4m3 NT -> bf16" : "dense 8192^3 bf16 NT -> bf16";
      cur_bytes = (double)D * D * (fp8 ? 2 : 4) + (double)D * D * 2;
      c.ctx = c_lt;
      double ms = time_it(run_call, &c, warmup, iters, c_lt);
      if (ms < 0) { fprintf(stderr, "gemm_lt: %s\n", tw_last_error()); rc = 1; }
      row_out(shape, "gemm_lt", ms, flop, -1, "cublasLtMatmul", raw, cfg->csv);
      if (fp8) peak_fp8 = flop / (ms * 1e-3) / 1e12;
      else peak_bf16 = flop / (ms * 1e-3) / 1e12;
      const char *tp = fp8 ? "torch._scaled_mm" : "torch.matmul";
      tw_ctx *own[2] = {c_mma, c_wide};
      const char *own_names[2] = {"gg_mma", "gg_mma_wide"};
      for (int v = 0; v < (wgrad_only ? 0 : 2); ++v) {
        c.ctx = own[v];
        ms = time_it(run_call, &c, warmup, iters, own[v]);
        if (ms < 0) { fprintf(stderr, "%s: %s\n", own_names[v], tw_last_error()); rc = 1; }
        row_out(shape, own_names[v], ms, flop, fp8 ? peak_fp8 : peak_bf16, tp, peer_ms("dense_8192", tp), cfg->csv);
      }
      if (fp8 && !wgrad_only) {  /* what a caller gets: the default choice (gg_wgmma_fp8 on sm_90) */
        const double lt_ms = flop / (peak_fp8 * 1e12) * 1e3;
        c.ctx = c_auto;
        ms = time_it(run_call, &c, warmup, iters, c_auto);
        if (ms < 0) { fprintf(stderr, "dense fp8 auto: %s\n", tw_last_error()); rc = 1; }
        row_out(shape, "auto", ms, flop, peak_fp8, tp, peer_ms("dense_8192", tp), cfg->csv);
        if (ms > 0 && !cfg->csv)
          printf("# %s: default / gemm_lt (cuBLASLt, same call) = %.3f (target >= 0.9)\n", shape, lt_ms / ms);
        setenv("TWIN_GG_WGMMA_FP8_CLUSTER", "2", 1);  /* the default with clusters of 2 (off by default) */
        ms = time_it(run_call, &c, warmup, iters, c_auto);
        unsetenv("TWIN_GG_WGMMA_FP8_CLUSTER");
        if (ms < 0) { fprintf(stderr, "dense fp8 auto, cluster pair: %s\n", tw_last_error()); rc = 1; }
        row_out(shape, "auto, cluster pair", ms, flop, peak_fp8, tp, peer_ms("dense_8192", tp), cfg->csv);
        double best[2], all[2][3];  /* gg_wgmma_fp8's column tile forced (TWIN_GG_WGMMA_FP8_BN), same call */
        time_bn_pair(&c, warmup, iters, c_auto, best, all);
        for (int w = 0; w < 2; ++w) {
          const char *name = w ? "auto, BN 192" : "auto, BN 128";
          if (best[w] < 0) { fprintf(stderr, "dense fp8 %s: %s\n", name, tw_last_error()); rc = 1; }
          row_out(shape, name, best[w], flop, peak_fp8, tp, peer_ms("dense_8192", tp), cfg->csv);
          if (best[w] > 0 && !cfg->csv)
            printf("# %s: %s / gemm_lt = %.3f (rounds %.3f %.3f %.3f ms)\n", shape, name, lt_ms / best[w], all[w][0],
                   all[w][1], all[w][2]);
        }
      }
    }
    tw_free(c_auto, a); tw_free(c_auto, b); tw_free(c_auto, o); tw_free(c_auto, a8); tw_free(c_auto, b8);
    tw_free(c_auto, s);
  }

  /* ---- grouped forward ---- */
  /* --shapes replaces the five standard shapes */
  gshape own[8];
  for (int i = 0; i < cfg->ngg && i < 8; ++i) own[i] = (gshape){cfg->gg[i][0], cfg->gg[i][1], cfg->gg[i][2], cfg->gg[i][3]};
  const gshape *list = cfg->ngg ? own : shapes;
  const size_t nshapes = cfg->ngg ? (size_t)cfg->ngg : sizeof shapes / sizeof shapes[0];
  for (size_t i = 0; i < nshapes; ++i) {
    const gshape sh = list[i];
    {
      char k0[96];
      snprintf(k0, sizeof k0, "grouped_G%lld_m%lld_N%lld_K%lld", (long long)sh.G, (long long)sh.m, (long long)sh.N,
               (long long)sh.K);
      if (only && !strstr(k0, only)) continue;
    }
    int64_t M = sh.G * sh.m;
    double flop = 2.0 * M * sh.N * sh.K;
    void *a, *b, *o, *gs, *sa, *sb;
    int64_t kb = (sh.K + 127) / 128, sa_n = kb * ((M + 3) / 4 * 4), sb_n = kb * ((sh.G * sh.N + 3) / 4 * 4);
    /* MXFP8 rowwise E8M0 (tw_quantize.h): [128*T_cap, W] of the [M, K] source and of the
     * [G*N, K] one, T_cap = (rows + 127*min(G, rows)) / 128, W = roundup(ceil(K/32), 4); byte
     * 127 = 1.0 */
    const int64_t mx_w = ((sh.K + 31) / 32 + 3) / 4 * 4, mx_ra = 128 * ((M + 127 * (sh.G < M ? sh.G : M)) / 128),
                  mx_rb = 128 * ((sh.G * sh.N + 127 * sh.G) / 128);
    void *xa = NULL, *xb = NULL;
    if (tw_alloc(c_auto, (size_t)(mx_ra * mx_w), &xa) || tw_alloc(c_auto, (size_t)(mx_rb * mx_w), &xb) ||
        cudaMemset(xa, 127, (size_t)(mx_ra * mx_w)) != cudaSuccess || cudaMemset(xb, 127, (size_t)(mx_rb * mx_w)) != cudaSuccess) {
      fprintf(stderr, "bench gpu gemm: allocation failed (MXFP8 scales)\n");
      return 1;
    }
    if (tw_alloc(c_auto, (size_t)(M * sh.K * 2), &a) || tw_alloc(c_auto, (size_t)(sh.G * sh.N * sh.K * 2), &b) ||
        tw_alloc(c_auto, (size_t)(M * sh.N * 2), &o) || tw_alloc(c_auto, (size_t)sh.G * 4, &gs) ||
        tw_alloc(c_auto, (size_t)(sa_n * 4), &sa) || tw_alloc(c_auto, (size_t)(sb_n * 4), &sb) ||
        fill_f32(sa, sa_n, 1.f) || fill_f32(sb, sb_n, 1.f)) {
      fprintf(stderr, "bench gpu gemm: allocation failed\n");
      return 1;
    }
    int32_t *h = (int32_t *)malloc((size_t)sh.G * 4);
    for (int64_t g = 0; g < sh.G; ++g) h[g] = (int32_t)sh.m;
    cudaMemcpy(gs, h, (size_t)sh.G * 4, cudaMemcpyHostToDevice);
    free(h);
    char key[96];
    snprintf(key, sizeof key, "grouped_G%lld_m%lld_N%lld_K%lld", (long long)sh.G, (long long)sh.m, (long long)sh.N,
             (long long)sh.K);
    double fwd_wgmma_tflops = -1, fwd_f8_tflops[5] = {-1, -1, -1, -1, -1};
    /* bf16, fp8 per-tensor, fp8 1x128 x 1x128, fp8 MXFP8, fp8 1x128 x 128x128 (DeepSeek-V3's
     * pairing: activations 1x128, weights 128x128; issue 16's blockwise target) */
    for (int kind = 0; kind < 5; ++kind) {
      if (kind == 4 && wgrad_only) continue;
      int fp8 = kind > 0;
      if (fill(a, M * sh.K, fp8 ? 1 : 2) || fill(b, sh.G * sh.N * sh.K, fp8 ? 1 : 2)) return 1;
      call c;
      memset(&c, 0, sizeof c);
      c.grouped = 1;
      c.op_b = TW_OP_T;
      c.gs = tw_tensor_1d(gs, TW_I32, sh.G, TW_MEM_DEVICE);
      c.out = tw_tensor_2d(o, TW_BF16, M, sh.N, TW_MEM_DEVICE);
      tw_tensor A = tw_tensor_2d(a, fp8 ? TW_E4M3 : TW_BF16, M, sh.K, TW_MEM_DEVICE);
      if (!fp8) {
        tw_tensor B = tw_tensor_3d(b, TW_BF16, sh.G, sh.N, sh.K, TW_MEM_DEVICE);
        c.a = tw_operand_plain(&A);
        c.b = tw_operand_plain(&B);
      } else {
        tw_tensor B = tw_tensor_2d(b, TW_E4M3, sh.G * sh.N, sh.K, TW_MEM_DEVICE);
        c.a = tw_operand_plain(&A);
        c.b = tw_operand_plain(&B);
        c.a.mode = c.b.mode = kind == 1 ? TW_SCALE_TENSOR_CURRENT : kind == 3 ? TW_SCALE_MXFP8_1D : TW_SCALE_BLOCK_1x128;
        if (kind == 4) c.b.mode = TW_SCALE_BLOCK_128x128;
        if (kind == 1) {
          c.a.scale_inv = tw_tensor_1d(sa, TW_F32, sh.G, TW_MEM_DEVICE);
          c.b.scale_inv = tw_tensor_1d(sb, TW_F32, sh.G, TW_MEM_DEVICE);
        } else if (kind == 3) {
          c.a.scale_inv = tw_tensor_2d(xa, TW_E8M0, mx_ra, mx_w, TW_MEM_DEVICE);
          c.b.scale_inv = tw_tensor_2d(xb, TW_E8M0, mx_rb, mx_w, TW_MEM_DEVICE);
        } else {
          c.a.scale_inv = tw_tensor_2d(sa, TW_F32, kb, (M + 3) / 4 * 4, TW_MEM_DEVICE);
          c.b.scale_inv = tw_tensor_2d(sb, TW_F32, kb, (sh.G * sh.N + 3) / 4 * 4, TW_MEM_DEVICE);
          if (kind == 4) /* tw_quantize.h's 128x128 layout of the [G*N, K] source: [T_cap, ceil(K/128)],
                          * T_cap = (G*N + 127*G) / 128 (fits in sb) */
            c.b.scale_inv = tw_tensor_2d(sb, TW_F32, (sh.G * sh.N + 127 * sh.G) / 128, kb, TW_MEM_DEVICE);
        }
        c.a.src_rows = M; c.a.src_cols = sh.K;
        c.b.src_rows = sh.G * sh.N; c.b.src_cols = sh.K;
      }
      char shape[96];
      snprintf(shape, sizeof shape, "G=%lld m=%lld N=%lld K=%lld %s", (long long)sh.G, (long long)sh.m,
               (long long)sh.N, (long long)sh.K,
               kind == 0 ? "bf16" : kind == 1 ? "e4m3" : kind == 2 ? "e4m3 1x128" : kind == 3 ? "e4m3 mxfp8"
                                                                                   : "e4m3 1x128 x 128x128");
      const char *peer = kind == 0 ? "torch._grouped_mm" : "torch._scaled_grouped_mm";
      cur_bytes = (double)(M * sh.K + sh.G * sh.N * sh.K) * (fp8 ? 1 : 2) + (double)M * sh.N * 2;
      double pms = peer_ms(key, peer);
      double floor = fp8 ? peak_fp8 : peak_bf16;
      /* bf16: gg_mma, gg_lt_loop, gg_mma_wide, gg_wgmma; per-tensor fp8: gg_mma, gg_lt_loop,
       * gg_mma_wide, gg_wgmma_fp8; 1x128: gg_mma, gg_wgmma_fp8; MXFP8: gg_mma_wide, gg_wgmma_fp8 */
      tw_ctx *ctxs[5][4] = {{c_mma, c_loop, c_wide, c_wg}, {c_mma, c_loop, c_wide, c_wf8}, {c_mma, c_wf8, NULL, NULL},
                            {c_wide, c_wf8, NULL, NULL}, {c_mma, c_wf8, NULL, NULL}};
      const char *names[5][4] = {{"gg_mma", "gg_lt_loop", "gg_mma_wide", "gg_wgmma"},
                                 {"gg_mma", "gg_lt_loop", "gg_mma_wide", "gg_wgmma_fp8"},
                                 {"gg_mma", "gg_wgmma_fp8", NULL, NULL},
                                 {"gg_mma_wide", "gg_wgmma_fp8", NULL, NULL},
                                 {"gg_mma", "gg_wgmma_fp8", NULL, NULL}};
      for (int v = wgrad_only ? (kind >= 2 ? 1 : 3) : 0; v < (kind >= 2 ? 2 : 4); ++v) {
        c.ctx = ctxs[kind][v];
        double ms = time_it(run_call, &c, warmup, iters, ctxs[kind][v]);
        if (ms < 0) { fprintf(stderr, "%s %s: %s\n", shape, names[kind][v], tw_last_error()); rc = 1; }
        row_out(shape, names[kind][v], ms, flop, floor, peer, pms, cfg->csv);
        if (kind == 0 && v == 3 && ms > 0) fwd_wgmma_tflops = flop / (ms * 1e-3) / 1e12;
        if (kind > 0 && !strcmp(names[kind][v], "gg_wgmma_fp8") && ms > 0) fwd_f8_tflops[kind] = flop / (ms * 1e-3) / 1e12;
        if (kind > 0 && !wgrad_only && !strcmp(names[kind][v], "gg_wgmma_fp8") && (sh.N / 128) % 2 == 0) {
          /* the same kernel with clusters of 2 (lhs multicast; off by default), same call */
          const char *other = "gg_wgmma_fp8, cluster pair";
          setenv("TWIN_GG_WGMMA_FP8_CLUSTER", "2", 1);
          ms = time_it(run_call, &c, warmup, iters, ctxs[kind][v]);
          unsetenv("TWIN_GG_WGMMA_FP8_CLUSTER");
          if (ms < 0) { fprintf(stderr, "%s %s: %s\n", shape, other, tw_last_error()); rc = 1; }
          row_out(shape, other, ms, flop, floor, peer, pms, cfg->csv);
        }
        if (kind > 0 && kind != 3 && !wgrad_only && !strcmp(names[kind][v], "gg_wgmma_fp8")) {
          double best[2], all[2][3];  /* the column tile forced (TWIN_GG_WGMMA_FP8_BN), same call */
          time_bn_pair(&c, warmup, iters, ctxs[kind][v], best, all);
          for (int w = 0; w < 2; ++w) {
            const char *other = w ? "gg_wgmma_fp8, BN 192" : "gg_wgmma_fp8, BN 128";
            if (best[w] < 0) { fprintf(stderr, "%s %s: %s\n", shape, other, tw_last_error()); rc = 1; }
            row_out(shape, other, best[w], flop, floor, peer, pms, cfg->csv);
          }
          if (best[0] > 0 && best[1] > 0 && !cfg->csv)
            printf("# %s: gg_wgmma_fp8 BN 192 / BN 128 rate = %.3f (rounds 128: %.3f %.3f %.3f, 192: %.3f %.3f %.3f ms)\n",
                   shape, best[0] / best[1], all[0][0], all[0][1], all[0][2], all[1][0], all[1][1], all[1][2]);
        }
      }
      if (kind == 3 && fwd_f8_tflops[3] > 0 && fwd_f8_tflops[2] > 0 && fwd_f8_tflops[1] > 0)
        printf("# %s: gg_wgmma_fp8 MXFP8 / 1x128 rate = %.3f, / per-tensor = %.3f\n", shape,
               fwd_f8_tflops[3] / fwd_f8_tflops[2], fwd_f8_tflops[3] / fwd_f8_tflops[1]);
    }
    /* MXFP8 with the rhs as the colwise data of its [G*K, N] source, op N (the MoE fp8_mxfp8
     * weights): gg_wgmma_fp8 transposes it (pad pass, in the time) and runs the MXFP8 kernel; its
     * rate over the rowwise MXFP8 row above. Colwise E8M0 (tw_quantize.h): [4*T_cap, roundup(N, 128)],
     * T_cap = (G*K + 127*G) / 128, byte 127 = 1.0; compact (the scale bytes transposed too) and
     * swizzled (read in place) */
    if (!wgrad_only && fwd_f8_tflops[3] > 0) {
      const int64_t cw = (sh.N + 127) / 128 * 128, cr = 4 * ((sh.G * sh.K + 127 * sh.G) / 128);
      void *xc = NULL;
      if (tw_alloc(c_auto, (size_t)(cr * cw), &xc) || cudaMemset(xc, 127, (size_t)(cr * cw)) != cudaSuccess ||
          fill(a, M * sh.K, 1) || fill(b, sh.G * sh.N * sh.K, 1)) {
        fprintf(stderr, "bench gpu gemm: allocation failed (MXFP8 colwise scales)\n");
        return 1;
      }
      call c;
      memset(&c, 0, sizeof c);
      c.grouped = 1;
      c.op_b = TW_OP_N;
      c.gs = tw_tensor_1d(gs, TW_I32, sh.G, TW_MEM_DEVICE);
      c.out = tw_tensor_2d(o, TW_BF16, M, sh.N, TW_MEM_DEVICE);
      tw_tensor A = tw_tensor_2d(a, TW_E4M3, M, sh.K, TW_MEM_DEVICE), B = tw_tensor_2d(b, TW_E4M3, sh.G * sh.K, sh.N, TW_MEM_DEVICE);
      c.a = tw_operand_plain(&A);
      c.b = tw_operand_plain(&B);
      c.a.mode = c.b.mode = TW_SCALE_MXFP8_1D;
      c.a.scale_inv = tw_tensor_2d(xa, TW_E8M0, mx_ra, mx_w, TW_MEM_DEVICE);
      c.b.scale_inv = tw_tensor_2d(xc, TW_E8M0, cr, cw, TW_MEM_DEVICE);
      c.b.colwise = 1;
      c.a.src_rows = M; c.a.src_cols = sh.K;
      c.b.src_rows = sh.G * sh.K; c.b.src_cols = sh.N;
      char shape[112];
      snprintf(shape, sizeof shape, "G=%lld m=%lld N=%lld K=%lld e4m3 mxfp8, rhs colwise op N", (long long)sh.G,
               (long long)sh.m, (long long)sh.N, (long long)sh.K);
      const char *peer = "torch._scaled_grouped_mm";
      cur_bytes = (double)(M * sh.K + 3 * sh.G * sh.N * sh.K) + (double)M * sh.N * 2;  /* rhs: the copy reads and writes it, the GEMM reads it */
      const double pms = peer_ms(key, peer);
      double t_cw[2] = {-1, -1};
      for (int sw = 0; sw < 2; ++sw) {
        c.b.mxfp8_swizzled = sw;
        c.ctx = c_wf8;
        const double ms = time_it(run_call, &c, warmup, iters, c_wf8);
        const char *nm = sw ? "gg_wgmma_fp8, swizzled scales" : "gg_wgmma_fp8";
        if (ms < 0) { fprintf(stderr, "%s %s: %s\n", shape, nm, tw_last_error()); rc = 1; }
        row_out(shape, nm, ms, flop, peak_fp8, peer, pms, cfg->csv);
        if (ms > 0) t_cw[sw] = flop / (ms * 1e-3) / 1e12;
      }
      if (t_cw[0] > 0 && !cfg->csv)
        printf("# %s: gg_wgmma_fp8 MXFP8 rhs colwise op N / rowwise op T rate = %.3f (compact scales), %.3f (swizzled)\n",
               shape, t_cw[0] / fwd_f8_tflops[3], t_cw[1] > 0 ? t_cw[1] / fwd_f8_tflops[3] : -1.0);
      tw_free(c_auto, xc);
    }
    tw_free(c_auto, o);
    o = NULL;
    /* ---- wgrad, same FLOPs: out [G, K, N] = per group lhs_g^T [K, m] @ rhs_g [m, N] ---- */
    {
      void *r2 = NULL, *o2 = NULL;
      if (tw_alloc(c_auto, (size_t)(M * sh.N * 2), &r2) || tw_alloc(c_auto, (size_t)(sh.G * sh.K * sh.N * 2), &o2) ||
          fill(a, M * sh.K, 2) || fill(r2, M * sh.N, 2)) {
        fprintf(stderr, "bench gpu gemm: allocation failed (wgrad)\n");
        return 1;
      }
      call c;
      memset(&c, 0, sizeof c);
      c.grouped = 2;
      c.gs = tw_tensor_1d(gs, TW_I32, sh.G, TW_MEM_DEVICE);
      c.out = tw_tensor_3d(o2, TW_BF16, sh.G, sh.K, sh.N, TW_MEM_DEVICE);
      tw_tensor A = tw_tensor_2d(a, TW_BF16, M, sh.K, TW_MEM_DEVICE);
      tw_tensor B = tw_tensor_2d(r2, TW_BF16, M, sh.N, TW_MEM_DEVICE);
      c.a = tw_operand_plain(&A);
      c.b = tw_operand_plain(&B);
      char shape[96], wkey[104];
      snprintf(shape, sizeof shape, "wgrad G=%lld m=%lld N=%lld K=%lld bf16", (long long)sh.G, (long long)sh.m,
               (long long)sh.N, (long long)sh.K);
      snprintf(wkey, sizeof wkey, "wgrad_%s", key + strlen("grouped_"));
      cur_bytes = (double)(M * sh.K + M * sh.N) * 2 + (double)sh.G * sh.K * sh.N * 2;
      const double pms = peer_ms(wkey, "torch._grouped_mm");
      /* v = 2: gg_wgmma with the register epilogue (TWIN_GG_WGMMA_WGRAD_REGSTORE=1), the
       * accumulate path's stores, to show what the TMA-store epilogue buys */
      /* v = 3: the tail zeroing done by producer warps (TWIN_GG_WGMMA_WGRAD_ZERO=producer) */
      /* v = 4: one map per operand and the consumers' tail zeroing (TWIN_GG_WGMMA_WGRAD_MAPS=0),
       * the default before the per-group maps */
      tw_ctx *ctxs[5] = {c_wide, c_wg, c_wg, c_wg, c_wg};
      const char *names[5] = {"gg_mma_wide", "gg_wgmma", "gg_wgmma, register epilogue", "gg_wgmma, producer zeroing",
                              "gg_wgmma, consumer zeroing (MAPS=0)"};
      for (int v = 0; v < 5; ++v) {
        c.ctx = ctxs[v];
        if (v == 2) setenv("TWIN_GG_WGMMA_WGRAD_REGSTORE", "1", 1);
        if (v == 3) setenv("TWIN_GG_WGMMA_WGRAD_ZERO", "producer", 1);
        if (v == 4) setenv("TWIN_GG_WGMMA_WGRAD_MAPS", "0", 1);
        double ms = time_it(run_call, &c, warmup, iters, ctxs[v]);
        if (v == 2) unsetenv("TWIN_GG_WGMMA_WGRAD_REGSTORE");
        if (v == 3) unsetenv("TWIN_GG_WGMMA_WGRAD_ZERO");
        if (v == 4) unsetenv("TWIN_GG_WGMMA_WGRAD_MAPS");
        if (ms < 0) { fprintf(stderr, "%s %s: %s\n", shape, names[v], tw_last_error()); rc = 1; }
        row_out(shape, names[v], ms, flop, peak_bf16, "torch._grouped_mm", pms, cfg->csv);
        if (v == 1 && ms > 0 && fwd_wgmma_tflops > 0)
          printf("# %s: gg_wgmma wgrad / gg_wgmma forward rate = %.3f (target >= 0.9)\n", shape,
                 flop / (ms * 1e-3) / 1e12 / fwd_wgmma_tflops);
      }
      /* the cost of a group's ragged end: the G32 and G128 shapes with sizes m -+ d alternating
       * (same sum; every group then ends inside a 64-row k-tile), timed with the default
       * per-group maps (TMA zero-fills past the group), with the consumers' tail zeroing
       * (TWIN_GG_WGMMA_WGRAD_MAPS=0), without any (MAPS=0 and TWIN_GG_WGMMA_WGRAD_NOMASK=1: wrong
       * results, timing only) and with the producer warps zeroing */
      if (sh.m <= 512 && sh.m >= 2) {
        const int32_t d = ragged_step(sh.m, 0);
        int32_t *hs = (int32_t *)malloc((size_t)sh.G * 4);
        for (int64_t g = 0; g < sh.G; ++g) hs[g] = (int32_t)(sh.m + (g % 2 ? d : -d));
        cudaMemcpy(gs, hs, (size_t)sh.G * 4, cudaMemcpyHostToDevice);
        free(hs);
        snprintf(shape, sizeof shape, "wgrad G=%lld m=%lld-+%d N=%lld K=%lld bf16", (long long)sh.G, (long long)sh.m,
                 (int)d, (long long)sh.N, (long long)sh.K);
        c.ctx = c_wg;
        const char *modes[4] = {"gg_wgmma", "gg_wgmma, consumer zeroing (MAPS=0)",
                                "gg_wgmma, no tail zeroing (timing only)", "gg_wgmma, producer zeroing"};
        for (int mode = 0; mode < 4; ++mode) {
          if (mode == 1 || mode == 2) setenv("TWIN_GG_WGMMA_WGRAD_MAPS", "0", 1);
          if (mode == 2) setenv("TWIN_GG_WGMMA_WGRAD_NOMASK", "1", 1);
          if (mode == 3) setenv("TWIN_GG_WGMMA_WGRAD_ZERO", "producer", 1);
          double ms = time_it(run_call, &c, warmup, iters, c_wg);
          unsetenv("TWIN_GG_WGMMA_WGRAD_MAPS");
          unsetenv("TWIN_GG_WGMMA_WGRAD_NOMASK");
          unsetenv("TWIN_GG_WGMMA_WGRAD_ZERO");
          if (ms < 0) { fprintf(stderr, "%s gg_wgmma: %s\n", shape, tw_last_error()); rc = 1; }
          row_out(shape, modes[mode], ms, flop, peak_bf16, "", -1, cfg->csv);
        }
        int32_t *hu = (int32_t *)malloc((size_t)sh.G * 4);
        for (int64_t g = 0; g < sh.G; ++g) hu[g] = (int32_t)sh.m;
        cudaMemcpy(gs, hu, (size_t)sh.G * 4, cudaMemcpyHostToDevice);
        free(hu);
      }
      /* ---- fp8 wgrad (e4m3, the MoE block's form): lhs and rhs as per-group transposed colwise
       * copies ([K, m] and [N, m] per group, ops T), per-tensor and 1x128 scales; versions
       * gg_wgmma_fp8 (auto on sm_90) and the exact kernels it replaced (gg_mma_wide for
       * per-tensor, gg_mma for 1x128); the ratio to gg_wgmma_fp8's forward on the same shape
       * (target >= 0.9). Then the G32 / G128 ragged sizes (token rows at odd byte offsets). */
      {
        const int64_t T_cap = (M + 127 * (sh.G < M ? sh.G : M)) / 128;
        const int64_t lda = (sh.K + 3) / 4 * 4, ldb = (sh.N + 3) / 4 * 4;
        /* MXFP8 colwise E8M0 (tw_quantize.h): [4*T_cap, roundup(K or N, 128)], byte 127 = 1.0 */
        const int64_t mxa = 4 * T_cap * ((sh.K + 127) / 128 * 128), mxb = 4 * T_cap * ((sh.N + 127) / 128 * 128);
        void *sa2 = NULL, *sb2 = NULL, *xa2 = NULL, *xb2 = NULL;
        if (tw_alloc(c_auto, (size_t)(T_cap * lda * 4 + 16), &sa2) || tw_alloc(c_auto, (size_t)(T_cap * ldb * 4 + 16), &sb2) ||
            tw_alloc(c_auto, (size_t)mxa, &xa2) || tw_alloc(c_auto, (size_t)mxb, &xb2) ||
            cudaMemset(xa2, 127, (size_t)mxa) != cudaSuccess || cudaMemset(xb2, 127, (size_t)mxb) != cudaSuccess ||
            fill_f32(sa2, T_cap * lda, 1.f) || fill_f32(sb2, T_cap * ldb, 1.f) || fill(a, M * sh.K, 1) || fill(r2, M * sh.N, 1)) {
          fprintf(stderr, "bench gpu gemm: allocation failed (fp8 wgrad)\n");
          return 1;
        }
        double wgrad_f8_tflops[4] = {-1, -1, -1, -1};
        for (int kind = 1; kind <= 3; ++kind) { /* per-tensor, 1x128 (ops T), MXFP8 (colwise [M, K] / [M, N], ops N) */
          call c8;
          memset(&c8, 0, sizeof c8);
          c8.grouped = kind == 3 ? 2 : 3;
          c8.gs = tw_tensor_1d(gs, TW_I32, sh.G, TW_MEM_DEVICE);
          c8.out = tw_tensor_3d(o2, TW_BF16, sh.G, sh.K, sh.N, TW_MEM_DEVICE);
          tw_tensor A8 = kind == 3 ? tw_tensor_2d(a, TW_E4M3, M, sh.K, TW_MEM_DEVICE) : tw_tensor_2d(a, TW_E4M3, sh.K, M, TW_MEM_DEVICE);
          tw_tensor B8 = kind == 3 ? tw_tensor_2d(r2, TW_E4M3, M, sh.N, TW_MEM_DEVICE) : tw_tensor_2d(r2, TW_E4M3, sh.N, M, TW_MEM_DEVICE);
          c8.a = tw_operand_plain(&A8);
          c8.b = tw_operand_plain(&B8);
          c8.a.mode = c8.b.mode = kind == 1 ? TW_SCALE_TENSOR_CURRENT : kind == 2 ? TW_SCALE_BLOCK_1x128 : TW_SCALE_MXFP8_1D;
          c8.a.colwise = c8.b.colwise = 1;
          c8.a.src_rows = M; c8.a.src_cols = sh.K;
          c8.b.src_rows = M; c8.b.src_cols = sh.N;
          if (kind == 1) {
            c8.a.scale_inv = tw_tensor_1d(sa2, TW_F32, sh.G, TW_MEM_DEVICE);
            c8.b.scale_inv = tw_tensor_1d(sb2, TW_F32, sh.G, TW_MEM_DEVICE);
          } else if (kind == 2) {
            c8.a.scale_inv = tw_tensor_2d(sa2, TW_F32, T_cap, lda, TW_MEM_DEVICE);
            c8.b.scale_inv = tw_tensor_2d(sb2, TW_F32, T_cap, ldb, TW_MEM_DEVICE);
          } else {
            c8.a.scale_inv = tw_tensor_2d(xa2, TW_E8M0, 4 * T_cap, (sh.K + 127) / 128 * 128, TW_MEM_DEVICE);
            c8.b.scale_inv = tw_tensor_2d(xb2, TW_E8M0, 4 * T_cap, (sh.N + 127) / 128 * 128, TW_MEM_DEVICE);
          }
          const char *kn = kind == 1 ? "e4m3" : kind == 2 ? "e4m3 1x128" : "e4m3 mxfp8";
          char s8[112];
          snprintf(s8, sizeof s8, "wgrad G=%lld m=%lld N=%lld K=%lld %s", (long long)sh.G, (long long)sh.m,
                   (long long)sh.N, (long long)sh.K, kn);
          cur_bytes = (double)(M * sh.K + M * sh.N) + (double)sh.G * sh.K * sh.N * 2;
          /* v = 2: gg_wgmma_fp8 with the register producer (TWIN_GG_WGMMA_FP8_WGRAD_LOADER=rows;
           * not for MXFP8, which runs the transposing pad pass + TMA only). MXFP8's exact kernel:
           * gg_mma_wide (auto before gg_wgmma_fp8 took the MXFP8 wgrad) */
          tw_ctx *c8s[3] = {kind == 2 ? c_mma : c_wide, c_wf8, c_wf8};
          const char *n8[3] = {kind == 2 ? "gg_mma" : "gg_mma_wide", "gg_wgmma_fp8", "gg_wgmma_fp8, rows loader"};
          for (int v = 0; v < (kind == 3 ? 2 : 3); ++v) {
            c8.ctx = c8s[v];
            if (v == 2) setenv("TWIN_GG_WGMMA_FP8_WGRAD_LOADER", "rows", 1);
            double ms = time_it(run_call, &c8, warmup, iters, c8s[v]);
            if (v == 2) unsetenv("TWIN_GG_WGMMA_FP8_WGRAD_LOADER");
            if (ms < 0) { fprintf(stderr, "%s %s: %s\n", s8, n8[v], tw_last_error()); rc = 1; }
            row_out(s8, n8[v], ms, flop, peak_fp8, "", -1, cfg->csv);
            if (v == 1 && ms > 0) wgrad_f8_tflops[kind] = flop / (ms * 1e-3) / 1e12;
            if (v == 1 && ms > 0 && fwd_f8_tflops[kind] > 0)
              printf("# %s: gg_wgmma_fp8 wgrad / gg_wgmma_fp8 forward rate = %.3f (target >= 0.9)\n", s8,
                     flop / (ms * 1e-3) / 1e12 / fwd_f8_tflops[kind]);
          }
          if (kind < 3) {
            /* the wgrad's consumer turns (TWIN_GG_WGMMA_FP8_WGRAD_ORDER=0|1) and column tile
             * (TWIN_GG_WGMMA_FP8_WGRAD_BN=128|192) forced, same call, and the forward (default
             * knobs, rhs [G*N, K] op T, same FLOPs) in the same rounds (time_variants), so that
             * each wgrad's rate over the forward compares rounds of the same clock state */
            static const char *const kn2[VAR_KNOBS] = {"TWIN_GG_WGMMA_FP8_WGRAD_ORDER", "TWIN_GG_WGMMA_FP8_WGRAD_BN",
                                                       "TWIN_GG_WGMMA_FP8_WGRAD_SKEW"};
            static const variant vs[] = {{"gg_wgmma_fp8 forward", {NULL, NULL, NULL}},
                                         {"gg_wgmma_fp8 (default knobs)", {NULL, NULL, NULL}},
                                         {"gg_wgmma_fp8, token-padded operands", {NULL, NULL, NULL}},
                                         {"gg_wgmma_fp8, turns 0, BN 128", {"0", "128", "0"}},
                                         {"gg_wgmma_fp8, turns 1, BN 128", {"1", "128", "0"}},
                                         {"gg_wgmma_fp8, turns 0, BN 192", {"0", "192", "0"}},
                                         {"gg_wgmma_fp8, turns 1, BN 192", {"1", "192", "0"}},
                                         {"gg_wgmma_fp8, token-padded, turns 1, BN 192", {"1", "192", "0"}}};
            const int nv = (int)(sizeof vs / sizeof vs[0]), nr = nv > 3 ? nv : 3;
            call cf; /* the forward: lhs [M, K] in a, rhs [G*N, K] in b (fp8 codes from the forward
                      * rows), the forward's scales (1.0), out [M, N] bf16 in fo */
            memset(&cf, 0, sizeof cf);
            void *fo = NULL;
            if (tw_alloc(c_auto, (size_t)(M * sh.N * 2), &fo)) {
              fprintf(stderr, "bench gpu gemm: allocation failed (fp8 wgrad variants)\n");
              return 1;
            }
            cf.ctx = c_wf8;
            cf.grouped = 1;
            cf.op_b = TW_OP_T;
            cf.gs = c8.gs;
            cf.out = tw_tensor_2d(fo, TW_BF16, M, sh.N, TW_MEM_DEVICE);
            tw_tensor FA = tw_tensor_2d(a, TW_E4M3, M, sh.K, TW_MEM_DEVICE);
            tw_tensor FB = tw_tensor_2d(b, TW_E4M3, sh.G * sh.N, sh.K, TW_MEM_DEVICE);
            cf.a = tw_operand_plain(&FA);
            cf.b = tw_operand_plain(&FB);
            cf.a.mode = cf.b.mode = c8.a.mode;
            if (kind == 1) {
              cf.a.scale_inv = tw_tensor_1d(sa, TW_F32, sh.G, TW_MEM_DEVICE);
              cf.b.scale_inv = tw_tensor_1d(sb, TW_F32, sh.G, TW_MEM_DEVICE);
            } else {
              cf.a.scale_inv = tw_tensor_2d(sa, TW_F32, kb, (M + 3) / 4 * 4, TW_MEM_DEVICE);
              cf.b.scale_inv = tw_tensor_2d(sb, TW_F32, kb, (sh.G * sh.N + 3) / 4 * 4, TW_MEM_DEVICE);
            }
            cf.a.src_rows = M; cf.a.src_cols = sh.K;
            cf.b.src_rows = sh.G * sh.N; cf.b.src_cols = sh.K;
            c8.ctx = c_wf8;
            /* the same operands token-padded: [K, 128*T_cap] / [N, 128*T_cap] codes (1.0 like the
             * default copies), read in place */
            call c8p = c8;
            void *pa = NULL, *pb = NULL;
            if (tw_alloc(c_auto, (size_t)(sh.K * 128 * T_cap), &pa) || tw_alloc(c_auto, (size_t)(sh.N * 128 * T_cap), &pb) ||
                fill(pa, sh.K * 128 * T_cap, 1) || fill(pb, sh.N * 128 * T_cap, 1)) {
              fprintf(stderr, "bench gpu gemm: allocation failed (token-padded fp8 wgrad)\n");
              return 1;
            }
            c8p.a.data = tw_tensor_2d(pa, TW_E4M3, sh.K, 128 * T_cap, TW_MEM_DEVICE);
            c8p.b.data = tw_tensor_2d(pb, TW_E4M3, sh.N, 128 * T_cap, TW_MEM_DEVICE);
            c8p.a.col_padded = c8p.b.col_padded = 1;
            void *const args[VAR_MAX] = {&cf, &c8, &c8p, &c8, &c8, &c8, &c8, &c8p};
            double best[VAR_MAX], all[VAR_MAX][VAR_MAX];
            time_variants(kn2, vs, nv, args, warmup, iters, c_wf8, best, all);
            tw_free(c_auto, fo);
            tw_free(c_auto, pa);
            tw_free(c_auto, pb);
            for (int w = 0; w < nv; ++w) {
              if (best[w] < 0) { fprintf(stderr, "%s %s: %s\n", s8, vs[w].name, tw_last_error()); rc = 1; }
              row_out(s8, vs[w].name, best[w], flop, peak_fp8, "", -1, cfg->csv);
              if (cfg->csv || best[w] <= 0) continue;
              printf("# %s: wgrad variant %s: %.1f TFLOP/s, / forward (same rounds) %.3f, / %s %.3f; rounds", s8,
                     vs[w].name, flop / (best[w] * 1e-3) / 1e12, best[0] > 0 ? best[0] / best[w] : -1.0, vs[1].name,
                     best[1] > 0 ? best[1] / best[w] : -1.0);
              for (int r = 0; r < nr; ++r) printf(" %.3f", all[w][r]);
              printf(" ms\n");
            }
          }
          if (kind == 3 && wgrad_f8_tflops[3] > 0 && wgrad_f8_tflops[2] > 0 && wgrad_f8_tflops[1] > 0)
            printf("# %s: gg_wgmma_fp8 MXFP8 wgrad / 1x128 wgrad rate = %.3f, / per-tensor wgrad = %.3f\n", s8,
                   wgrad_f8_tflops[3] / wgrad_f8_tflops[2], wgrad_f8_tflops[3] / wgrad_f8_tflops[1]);
          if (sh.m <= 512 && sh.m >= 2) { /* ragged: m -+ d alternating, so group starts and rows sit at odd byte offsets */
            const int32_t d = ragged_step(sh.m, 1);
            int32_t *hs = (int32_t *)malloc((size_t)sh.G * 4);
            for (int64_t g = 0; g < sh.G; ++g) hs[g] = (int32_t)(sh.m + (g % 2 ? d : -d));
            cudaMemcpy(gs, hs, (size_t)sh.G * 4, cudaMemcpyHostToDevice);
            snprintf(s8, sizeof s8, "wgrad G=%lld m=%lld-+%d N=%lld K=%lld %s", (long long)sh.G, (long long)sh.m, (int)d,
                     (long long)sh.N, (long long)sh.K, kn);
            for (int v = 0; v < 2; ++v) {
              c8.ctx = c8s[v];
              double ms = time_it(run_call, &c8, warmup, iters, c8s[v]);
              if (ms < 0) { fprintf(stderr, "%s %s: %s\n", s8, n8[v], tw_last_error()); rc = 1; }
              row_out(s8, n8[v], ms, flop, peak_fp8, "", -1, cfg->csv);
            }
            for (int64_t g = 0; g < sh.G; ++g) hs[g] = (int32_t)sh.m;
            cudaMemcpy(gs, hs, (size_t)sh.G * 4, cudaMemcpyHostToDevice);
            free(hs);
          }
        }
        tw_free(c_auto, sa2);
        tw_free(c_auto, sb2);
        tw_free(c_auto, xa2);
        tw_free(c_auto, xb2);
      }
      tw_free(c_auto, r2);
      tw_free(c_auto, o2);
    }
    tw_free(c_auto, a); tw_free(c_auto, b); tw_free(c_auto, gs); tw_free(c_auto, sa);
    tw_free(c_auto, sb); tw_free(c_auto, xa); tw_free(c_auto, xb);
  }
  tw_ctx_destroy(c_auto); tw_ctx_destroy(c_mma); tw_ctx_destroy(c_loop); tw_ctx_destroy(c_lt);
  tw_ctx_destroy(c_wide); tw_ctx_destroy(c_wg); tw_ctx_destroy(c_wf8);
  free(peers);
  peers = NULL;
  cudaStreamDestroy(stream);
  return rc;
}
