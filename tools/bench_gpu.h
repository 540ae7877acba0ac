/* What the GPU benches (tools/bench_gpu_*.c) share: one CUDA-event timer. */
#ifndef TWIN_TOOLS_BENCH_GPU_H
#define TWIN_TOOLS_BENCH_GPU_H

#include <cuda_runtime.h>

/* One call of the timed work on stream s; nonzero on failure. */
typedef int (*tw_gpu_work)(void *arg);

/* Median ms of `iters` calls of fn(arg), each bracketed by events on s, after `warmup`
 * untimed calls; < 0 if a call failed. */
double tw_bench_gpu_time(cudaStream_t s, int warmup, int iters, tw_gpu_work fn, void *arg);

/* The --peers file (JSON from a tools/peers script) as one string, or NULL if path is NULL or
 * unreadable (free() it). */
char *tw_bench_peers_read(const char *path);
/* ms of `peer` in row `key` of {"rows": {"<key>": {"<peer>": ms, ...}}}, or -1. */
double tw_bench_peer_ms(const char *peers, const char *key, const char *peer);

#endif
