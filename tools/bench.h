/* `twin bench`: one harness, one row format for every kernel and backend.
 * A row: op, shape, backend/version, median time, rate (TFLOP/s or GB/s), the floor it is
 * measured against (% of measured copy bandwidth or dense GEMM peak), and the peer from the
 * same run with the ratio peer_time / our_time (> 1 means twin is faster). */
#ifndef TWIN_TOOLS_BENCH_H
#define TWIN_TOOLS_BENCH_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const char *op;        /* "grouped_gemm", "quantize", ... */
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
} tw_bench_row;

typedef struct {
  int warmup;            /* iterations before timing */
  int iters;             /* timed iterations (median reported) */
  const char *op;        /* filter: NULL or "all" = every op */
  const char *peers_json;/* file with peer timings measured in the same run (gpu), or NULL */
  FILE *csv;             /* optional machine-readable copy of the rows */
} tw_bench_cfg;

void tw_bench_print_header(void);
void tw_bench_print_row(const tw_bench_row *r, FILE *csv);
double tw_bench_median(double *v, int n); /* sorts v */

/* GPU benches live with their kernels' owners (tools/bench_gpu_*.c); 0 on success. */
int tw_bench_gpu_quantize(const tw_bench_cfg *cfg);
int tw_bench_gpu_gemm(const tw_bench_cfg *cfg);

#ifdef __cplusplus
}
#endif
#endif
