/* `twin bench`: rates of the kernels next to a peer timed in the same run.
 *
 * ref: grouped GEMM GFLOP/s (f32 and bf16 inputs, G = 8..64 with skewed group sizes) next to
 * one cblas_sgemm of the same total FLOPs (M = sum of the groups); grouped quantize GB/s per
 * mode (bytes read + written) next to a memcpy moving as many bytes, which is also its floor.
 * gpu: the benches of the GPU kernels' owners (tools/bench_gpu_*.c). */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tools/bench.h"
#include "tools/cli.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

#pragma weak tw_bench_gpu_quantize
#pragma weak tw_bench_gpu_gemm

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin bench [--backend ref|gpu] [--op all|grouped_gemm|quantize] [--iters N]\n"
          "                  [--warmup N] [--peers FILE] [--csv FILE]\n"
          "\n"
          "One row per kernel and shape: median time, rate, the floor it is measured against,\n"
          "and a peer timed in the same run with ratio = peer_ms / ms (> 1: twin is faster).\n"
          "  --backend NAME  ref (default): grouped GEMM vs one cblas_sgemm of the same FLOPs,\n"
          "                  quantize vs memcpy of the same bytes; gpu: the GPU kernels' benches\n"
          "  --op NAME       all (default), grouped_gemm or quantize\n"
          "  --iters N       timed iterations, median reported (default 5)\n"
          "  --warmup N      untimed iterations first (default 1)\n"
          "  --peers FILE    gpu: peer timings measured on the same machine in the same run\n"
          "  --csv FILE      also write the rows as CSV\n");
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static uint64_t rng_state = 0x7477696eull;
static double urand(void) { /* splitmix64 -> [0, 1) */
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

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

typedef struct {
  tw_bench_cfg cfg;
  FILE *csv;
  int failures;
} bench_run;

/* Median wall time of fn over the configured iterations; < 0 if fn failed. */
typedef tw_status (*bench_fn)(void *arg);
static double time_it(const bench_run *b, bench_fn fn, void *arg) {
  double t[1000];
  int n = b->cfg.iters < 1000 ? b->cfg.iters : 1000;
  for (int i = 0; i < b->cfg.warmup; i++)
    if (fn(arg) != TW_OK) return -1;
  for (int i = 0; i < n; i++) {
    double t0 = now_ms();
    if (fn(arg) != TW_OK) return -1;
    t[i] = now_ms() - t0;
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

static void bench_grouped_gemm(bench_run *b, tw_ctx *ctx) {
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
        b->failures++;
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
          b->failures++;
        } else {
          double flops = 2.0 * S * K * N;
          r.rate = flops / (r.ms * 1e6);
          snprintf(r.peer, sizeof r.peer, "cblas_sgemm");
          r.peer_ms = time_it(b, run_sgemm, &g);
          r.ratio = r.peer_ms / r.ms;
          /* the floor: the dense sgemm rate of this machine for the same FLOPs */
          r.pct_of_floor = 100.0 * r.peer_ms / r.ms;
          tw_bench_print_row(&r, b->csv);
        }
      }
      free(lhs); free(rhs); free(out); free(a32); free(b32); free(c32);
    }
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

static void bench_quantize(bench_run *b, tw_ctx *ctx) {
  const int M = 2048, K = 1024, G = 8;
  static const tw_scaling modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_MXFP8_1D,
                                     TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};
  uint16_t *x = (uint16_t *)malloc((size_t)M * K * 2);
  int32_t gs[8];
  float scale[8];
  skewed_sizes(gs, G, M);
  for (int g = 0; g < G; g++) scale[g] = 64.0f;
  if (!x) { b->failures++; return; }
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
      b->failures++;
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
      b->failures++;
    } else {
      r.rate = bytes / (r.ms * 1e6);
      snprintf(r.peer, sizeof r.peer, "memcpy");
      r.peer_ms = time_it(b, run_memcpy, &a);
      r.ratio = r.peer_ms / r.ms;
      r.pct_of_floor = 100.0 * r.ratio; /* memcpy bandwidth is the floor for a streaming op */
      tw_bench_print_row(&r, b->csv);
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
}

static int positive_int(const char *flag, const char *v, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || end == v || x < 0 || x > 1000) {
    fprintf(stderr, "twin bench: %s wants an integer 0..1000, got '%s'\n", flag, v);
    return -1;
  }
  *out = (int)x;
  return 0;
}

int twin_cmd_bench(int argc, char **argv) {
  bench_run b;
  memset(&b, 0, sizeof b);
  b.cfg.warmup = 1;
  b.cfg.iters = 5;
  const char *backend = "ref", *csv_path = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (twin_is_help(a)) { usage(stdout); return TW_EXIT_OK; }
    if (i + 1 >= argc || strncmp(a, "--", 2) != 0) {
      fprintf(stderr, "twin bench: unexpected argument '%s' (twin bench --help)\n", a);
      return TW_EXIT_USAGE;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--backend")) backend = v;
    else if (!strcmp(a, "--op")) b.cfg.op = v;
    else if (!strcmp(a, "--peers")) b.cfg.peers_json = v;
    else if (!strcmp(a, "--csv")) csv_path = v;
    else if (!strcmp(a, "--iters")) { if (positive_int(a, v, &b.cfg.iters) || b.cfg.iters < 1) return TW_EXIT_USAGE; }
    else if (!strcmp(a, "--warmup")) { if (positive_int(a, v, &b.cfg.warmup)) return TW_EXIT_USAGE; }
    else {
      fprintf(stderr, "twin bench: unknown option '%s' (twin bench --help)\n", a);
      return TW_EXIT_USAGE;
    }
  }
  const char *op = b.cfg.op && strcmp(b.cfg.op, "all") ? b.cfg.op : NULL;
  if (op && strcmp(op, "grouped_gemm") && strcmp(op, "quantize")) {
    fprintf(stderr, "twin bench: unknown --op '%s' (all, grouped_gemm, quantize)\n", op);
    return TW_EXIT_USAGE;
  }
  tw_backend be;
  if (twin_parse_backend("bench", backend, 0, &be, NULL) != 0) return TW_EXIT_USAGE;
  if (csv_path) {
    b.csv = fopen(csv_path, "w");
    if (!b.csv) {
      fprintf(stderr, "twin bench: cannot create %s\n", csv_path);
      return TW_EXIT_USAGE;
    }
    fprintf(b.csv, "op,shape,backend,version,ms,rate,unit,pct_of_floor,peer,peer_ms,ratio\n");
    b.cfg.csv = b.csv;
  }
  int rc = TW_EXIT_OK;
  if (be == TW_BACKEND_GPU) {
    if (!tw_backend_available(TW_BACKEND_GPU)) {
      fprintf(stderr, "twin bench: the gpu backend is not available here (no GPU visible or not built in)\n");
      rc = TW_EXIT_USAGE;
    } else {
      int ran = 0;
      tw_bench_print_header();
      if (!op || !strcmp(op, "quantize")) {
        if (tw_bench_gpu_quantize) { ran++; if (tw_bench_gpu_quantize(&b.cfg)) rc = TW_EXIT_FAIL; }
        else fprintf(stderr, "twin bench: the gpu quantize bench is not in this build yet (tools/bench_gpu_*.c)\n");
      }
      if (!op || !strcmp(op, "grouped_gemm")) {
        if (tw_bench_gpu_gemm) { ran++; if (tw_bench_gpu_gemm(&b.cfg)) rc = TW_EXIT_FAIL; }
        else fprintf(stderr, "twin bench: the gpu GEMM bench is not in this build yet (tools/bench_gpu_*.c)\n");
      }
      if (!ran && rc == TW_EXIT_OK) rc = TW_EXIT_USAGE;
    }
  } else {
    int code;
    tw_ctx *ctx = twin_open_ctx("bench", be, &code);
    if (!ctx) {
      rc = code;
    } else {
      tw_bench_print_header();
      if (!op || !strcmp(op, "grouped_gemm")) bench_grouped_gemm(&b, ctx);
      if (!op || !strcmp(op, "quantize")) bench_quantize(&b, ctx);
      tw_ctx_destroy(ctx);
      if (b.failures) rc = TW_EXIT_FAIL;
    }
  }
  if (b.csv) fclose(b.csv);
  return rc;
}
