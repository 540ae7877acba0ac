/* The GPU benches' timer (bench_gpu.h): CUDA events around each call on the stream. */
#include <stdlib.h>

#include "ops/bench.h"
#include "tools/bench_gpu.h"

double tw_bench_gpu_time(cudaStream_t s, int warmup, int iters, tw_gpu_work fn, void *arg) {
  for (int i = 0; i < warmup; i++)
    if (fn(arg)) return -1;
  double *ms = (double *)malloc(sizeof(double) * (size_t)(iters > 0 ? iters : 1));
  cudaEvent_t a, b;
  if (!ms) return -1;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  double med = 0;
  for (int i = 0; i < iters; i++) {
    cudaEventRecord(a, s);
    if (fn(arg)) {
      med = -1;
      break;
    }
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms[i] = t;
  }
  if (med == 0) med = tw_bench_median(ms, iters);
  free(ms);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return med;
}
