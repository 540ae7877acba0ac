/* The GPU benches' timer (bench_gpu.h): CUDA events around each call on the stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

char *tw_bench_peers_read(const char *path) {
  if (!path) return NULL;
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = (char *)calloc((size_t)(n > 0 ? n : 0) + 1, 1);
  if (s && n > 0 && fread(s, 1, (size_t)n, f) != (size_t)n) s[0] = 0;
  fclose(f);
  return s;
}

double tw_bench_peer_ms(const char *peers, const char *key, const char *peer) {
  if (!peers) return -1;
  char k[128];
  snprintf(k, sizeof k, "\"%s\"", key);
  const char *p = strstr(peers, k);
  if (!p) return -1;
  const char *end = strchr(p, '}');
  snprintf(k, sizeof k, "\"%s\":", peer);
  const char *q = strstr(p, k);
  if (!q || (end && q > end)) return -1;
  return strtod(q + strlen(k), NULL);
}
