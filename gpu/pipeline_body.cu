// gpu/pipeline_body.cu — the elementwise ops of the pipeline's dense body (tw_pipeline.h):
// gelu (tanh form), dh = da * gelu'(h), y += x; f32 in and out on the context's stream.
// Same math as the ref (pipeline/dense.c): each element in double, rounded once to f32, so
// the two backends differ at most where CUDA's and libm's double tanh differ in the last bit
// and that difference crosses an f32 rounding boundary. The GEMMs around them are tw_gemm.
// Called from pipeline/dense.c through weak references (a CPU-only build has none).
#include "gpu/gpu.h"

#define GELU_C 0.7978845608028654  // sqrt(2/pi)

__global__ static void gelu_kernel(const float *h, float *a, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    double x = h[i];
    a[i] = (float)(0.5 * x * (1.0 + tanh(GELU_C * (x + 0.044715 * x * x * x))));
  }
}

__global__ static void gelu_bwd_kernel(const float *h, const float *da, float *dh, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    double x = h[i];
    double u = GELU_C * (x + 0.044715 * x * x * x), th = tanh(u);
    double g = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_C * (1.0 + 3 * 0.044715 * x * x);
    dh[i] = (float)((double)da[i] * g);
  }
}

__global__ static void add_kernel(float *y, const float *x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += x[i];
}

static unsigned blocks_for(tw_ctx *ctx, int64_t n) {
  int64_t b = (n + 255) / 256, cap = 16 * (int64_t)gpu_of(ctx)->num_sms;
  return (unsigned)(b < cap ? (b > 0 ? b : 1) : cap);
}

extern "C" tw_status gpu_pipeline_gelu(tw_ctx *ctx, const float *h, float *a, int64_t n) {
  if (n == 0) return TW_OK;
  gelu_kernel<<<blocks_for(ctx, n), 256, 0, gpu_of(ctx)->stream>>>(h, a, n);
  GPU_TRY_CUDA(cudaGetLastError(), "pipeline_gelu: launch");
  return TW_OK;
}

extern "C" tw_status gpu_pipeline_gelu_bwd(tw_ctx *ctx, const float *h, const float *da, float *dh, int64_t n) {
  if (n == 0) return TW_OK;
  gelu_bwd_kernel<<<blocks_for(ctx, n), 256, 0, gpu_of(ctx)->stream>>>(h, da, dh, n);
  GPU_TRY_CUDA(cudaGetLastError(), "pipeline_gelu_bwd: launch");
  return TW_OK;
}

extern "C" tw_status gpu_pipeline_add(tw_ctx *ctx, float *y, const float *x, int64_t n) {
  if (n == 0) return TW_OK;
  add_kernel<<<blocks_for(ctx, n), 256, 0, gpu_of(ctx)->stream>>>(y, x, n);
  GPU_TRY_CUDA(cudaGetLastError(), "pipeline_add: launch");
  return TW_OK;
}
