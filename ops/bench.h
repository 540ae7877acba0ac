/* One row format and one harness for every kernel's bench (`twin bench`, `twin port`).
 * A row: op, shape, backend/version, median time, rate (TFLOP/s or GB/s), the floor it is
 * measured against (% of measured copy bandwidth or dense GEMM peak), its FLOPs and bytes (for
 * the roofline), and the peer from the same run with ratio = peer_time / our_time (> 1 means
 * twin is faster). Benches emit rows with tw_bench_emit; `twin bench` prints them, `twin port`
 * collects them through a sink. */
#ifndef TWIN_OPS_BENCH_H
#define TWIN_OPS_BENCH_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const char *op;        /* the registry entry's name or alias: "grouped_gemm", "quantize", ... */
  char shape[96];        /* "G=4 m=8192 N=4096 K=7168 bf16" */
  const char *backend;   /* "ref", "gpu" */
  char version[48];      /* kernel version name */
  double ms;             /* median */
  double rate;           /* in unit */
  const char *unit;      /* "GFLOP/s", "TFLOP/s", "GB/s" */
  double pct_of_floor;   /* rate / ceiling * 100, or < 0 if none */
  char peer[48];         /* "cblas_sgemm", "torch._grouped_mm", "" */
  double peer_ms;        /* < 0 if none */
  double ratio;          /* peer_ms / ms, < 0 if none */
  double flops;          /* floating-point operations of one call (0: a streaming op) */
  double bytes;          /* bytes an ideal kernel moves in one call (0: not stated) */
} tw_bench_row;

/* `twin bench --op pipeline`'s configuration (tools/cmd_bench.c parses and checks it; the gpu
 * bench, tools/bench_gpu_pipeline.c, runs it). */
typedef enum { TW_BENCH_PP_AUTO = 0, TW_BENCH_PP_NCCL = 1, TW_BENCH_PP_LOOPBACK = 2 } tw_bench_pp_mode;
typedef struct tw_bench_pipeline {
  int stages, microbatches, repeats, delay, bsw;
  long long hidden, ffn, mb_rows; /* E, H of the dense body; rows of one microbatch */
  tw_bench_pp_mode mode;          /* auto: NCCL with one stage per GPU on >= 2 GPUs, else loopback */
} tw_bench_pipeline;

/* `twin bench --op ep`'s choices (tools/cmd_bench.c parses them; tools/bench_gpu_ep.c runs). */
typedef struct tw_bench_ep {
  int ntokens;
  long long tokens[8];   /* tokens per rank, one case each (default 128, 4096, 16384) */
  const char *version;   /* NULL: every version (ep_nccl_slots, ep_nccl_lsa where it can run) */
  int routing;           /* 0 both (default), 1 uniform, 2 skewed */
} tw_bench_ep;

typedef struct {
  int warmup;            /* iterations before timing */
  int iters;             /* timed iterations (median reported) */
  const char *op;        /* filter: NULL or "all" = every op */
  const char *peers_json;/* file with peer timings measured in the same run (gpu), or NULL */
  FILE *csv;             /* optional machine-readable copy of the rows */
  const tw_bench_pipeline *pipeline; /* --op pipeline's configuration, else NULL */
  const tw_bench_ep *ep; /* --op ep's choices, else NULL (the defaults) */
  int moe_ep;            /* --op moe --ep N: the block with ep = N over N GPUs (0: one GPU) */
  int ngg;               /* --op grouped_gemm / wgrad --shapes: how many grouped shapes (0: the five standard) */
  long long gg[8][4];    /* each G, m (rows per group), N, K */
} tw_bench_cfg;

void tw_bench_print_header(void);
void tw_bench_print_row(const tw_bench_row *r, FILE *csv); /* the old name of tw_bench_emit */
/* Hands the row to the sink if one is set, else prints it (and its CSV line). */
void tw_bench_emit(const tw_bench_row *r, FILE *csv);
/* While set, every emitted row goes to fn (and is not printed); NULL restores printing. */
typedef void (*tw_bench_sink)(const tw_bench_row *r, void *user);
void tw_bench_set_sink(tw_bench_sink fn, void *user);
double tw_bench_median(double *v, int n); /* sorts v */
double tw_bench_now_ms(void);             /* monotonic wall clock */

/* GPU benches live with their kernels' owners (tools/bench_gpu_*.c); 0 on success. */
int tw_bench_gpu_quantize(const tw_bench_cfg *cfg);
int tw_bench_gpu_gemm(const tw_bench_cfg *cfg);
int tw_bench_gpu_moe(const tw_bench_cfg *cfg); /* only with --op moe */
int tw_bench_gpu_pipeline(const tw_bench_cfg *cfg); /* only with --op pipeline (cfg->pipeline set) */
int tw_bench_gpu_ep(const tw_bench_cfg *cfg); /* only with --op ep */

#ifdef __cplusplus
}
#endif
#endif
