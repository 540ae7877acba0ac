// gpu/moe_elementwise.cu — the MoE block's elementwise steps over the EP receive rows
// (moe/elementwise.h): bias + cast, the gated activation (SwiGLU, GeGLU, bilinear) with early
// weighting, its backward with d_recv_weights, the per-group bias gradient, y += x.
// Same math as the ref (moe/elementwise.c): each value in double, rounded once to f32 (then to
// bf16 with twin's RNE encoder), so the backends differ only where CUDA's and libm's double
// exp/tanh differ in the last bit and that crosses an f32 rounding boundary.
// Group sizes stay on the device: each block reads them into shared memory, so no host sync;
// rows at or past their sum are neither read nor written. Called through weak references.
#include "gpu/gpu.h"
#include "gpu/numerics.cuh"
#include "twin/tw_moe.h"

#define GELU_C 0.7978845608028654  // sqrt(2/pi)
#define MAX_GROUPS 4096            // local experts per rank (16 KiB of shared memory)

namespace {

__device__ double act_value(int act, double g) {
  if (act == TW_MOE_SWIGLU) return g / (1.0 + exp(-g));
  if (act == TW_MOE_GEGLU) return 0.5 * g * (1.0 + tanh(GELU_C * (g + 0.044715 * g * g * g)));
  return g;
}

// act_value and its derivative with their exp / tanh taken once: the expressions of act_value
// above and of moe/elementwise.c's act_grad, so the same bits (the backward needs both).
__device__ void act_both(int act, double g, double *value, double *grad) {
  if (act == TW_MOE_SWIGLU) {
    double e = exp(-g), s = 1.0 / (1.0 + e);
    *value = g / (1.0 + e);
    *grad = s * (1.0 + g * (1.0 - s));
  } else if (act == TW_MOE_GEGLU) {
    double th = tanh(GELU_C * (g + 0.044715 * g * g * g));
    *value = 0.5 * g * (1.0 + th);
    *grad = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * GELU_C * (1.0 + 3 * 0.044715 * g * g);
  } else {
    *value = g;
    *grad = 1.0;
  }
}

__device__ void store(void *p, int bf16, int64_t i, double v) {
  float f = (float)v;
  if (bf16) ((uint16_t *)p)[i] = tw_f32_to_bf16_d(f);
  else ((float *)p)[i] = f;
}

// Four consecutive elements at i (a multiple of 4, the buffer 16-byte aligned) in one store.
__device__ void store4(void *p, int bf16, int64_t i, const double v[4]) {
  if (bf16) {
    uint2 u;
    u.x = (uint32_t)tw_f32_to_bf16_d((float)v[0]) | ((uint32_t)tw_f32_to_bf16_d((float)v[1]) << 16);
    u.y = (uint32_t)tw_f32_to_bf16_d((float)v[2]) | ((uint32_t)tw_f32_to_bf16_d((float)v[3]) << 16);
    *(uint2 *)((uint16_t *)p + i) = u;
  } else {
    *(float4 *)((float *)p + i) = make_float4((float)v[0], (float)v[1], (float)v[2], (float)v[3]);
  }
}

__device__ double load(const void *p, int bf16, int64_t i) {
  return bf16 ? (double)tw_bf16_to_f32_d(((const uint16_t *)p)[i]) : (double)((const float *)p)[i];
}

// Inclusive prefix of the group sizes in shared memory (ends[g] = rows of groups 0..g); a
// negative size counts as 0 (the dispatch that wrote them never makes one).
__device__ void group_ends(const int32_t *gs, int G, int64_t *ends) {
  if (threadIdx.x == 0) {
    int64_t s = 0;
    for (int g = 0; g < G; g++) {
      s += gs[g] > 0 ? gs[g] : 0;
      ends[g] = s;
    }
  }
  __syncthreads();
}

__device__ int group_of(const int64_t *ends, int G, int64_t row) {
  int lo = 0, hi = G - 1;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (row < ends[mid]) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Rows over blocks, columns over threads: no 64-bit division per element (the flat-index
// form spent most of its time in i / C and i % C).
__global__ void bias_out_kernel(const float *y, const int32_t *gs, int G, const float *bias, int64_t C, void *out,
                                int bf16) {
  __shared__ int64_t ends[MAX_GROUPS];
  group_ends(gs, G, ends);
  int64_t rows = ends[G - 1];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *b = bias ? bias + (int64_t)group_of(ends, G, r) * C : NULL;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      int64_t i = r * C + c;
      store(out, bf16, i, (double)y[i] + (b ? (double)b[c] : 0.0));
    }
  }
}

// vec (F % 4 == 0, h and a 16-byte aligned): four columns per thread from float4 loads of the
// gate and up halves, one 4-element store, the same per-element math (scalar loads and stores
// held the kernel at 1.5 TB/s: 0.45 ms at E 32, T 4096, F 2048 on an H200, 0.26 ms vectorized).
__global__ void act_fwd_kernel(int act, const float *h, const int32_t *gs, int G, const float *w, int64_t F, void *a,
                               int bf16, int vec) {
  __shared__ int64_t ends[MAX_GROUPS];
  group_ends(gs, G, ends);
  int64_t rows = ends[G - 1];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float *hr = h + r * 2 * F;
    double wr = w ? (double)w[r] : 1.0;
    if (vec) {
      for (int64_t f = 4 * (int64_t)threadIdx.x; f < F; f += 4 * (int64_t)blockDim.x) {
        float4 g4 = *(const float4 *)(hr + f), u4 = *(const float4 *)(hr + F + f);
        const float g[4] = {g4.x, g4.y, g4.z, g4.w}, u[4] = {u4.x, u4.y, u4.z, u4.w};
        double v[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
          v[e] = act_value(act, g[e]) * (double)u[e];
          if (w) v[e] *= wr;
        }
        store4(a, bf16, r * F + f, v);
      }
      continue;
    }
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
      double v = act_value(act, hr[f]) * (double)hr[F + f];
      if (w) v *= wr;
      store(a, bf16, r * F + f, v);
    }
  }
}

// One warp per row: the d_w sum runs over F in the ref's order only if done serially, so each
// row's sum is taken by one lane in f order (d_w is an [R] vector; the per-element work is
// spread over the warp).
// vec (F % 4 == 0, h, d_a and d_h 16-byte aligned): each lane takes four columns (float4 loads,
// 4-element stores).
__global__ void act_bwd_kernel(int act, const float *h, const float *d_a, const int32_t *gs, int G, const float *w,
                               int64_t F, void *d_h, int bf16, float *d_w, int vec) {
  __shared__ int64_t ends[MAX_GROUPS];
  group_ends(gs, G, ends);
  int64_t rows = ends[G - 1];
  int lane = threadIdx.x % 32;
  int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32, warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t r = warp; r < rows; r += warps) {
    double scale = w ? (double)w[r] : 1.0;
    if (vec) { /* constant trip counts: the four values stay in registers */
      for (int64_t f0 = 4 * (int64_t)lane; f0 < F; f0 += 128) {
        float4 g4 = *(const float4 *)(h + r * 2 * F + f0), u4 = *(const float4 *)(h + r * 2 * F + F + f0),
               d4 = *(const float4 *)(d_a + r * F + f0);
        const float g[4] = {g4.x, g4.y, g4.z, g4.w}, u[4] = {u4.x, u4.y, u4.z, u4.w}, da[4] = {d4.x, d4.y, d4.z, d4.w};
        double dg[4], dup[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
          double du = (double)da[e] * scale, av, ag;
          act_both(act, g[e], &av, &ag);
          dg[e] = du * ag * (double)u[e];
          dup[e] = du * av;
        }
        store4(d_h, bf16, r * 2 * F + f0, dg);
        store4(d_h, bf16, r * 2 * F + F + f0, dup);
      }
    } else {
      for (int64_t f = lane; f < F; f += 32) {
        double g = h[r * 2 * F + f], up = h[r * 2 * F + F + f], du = (double)d_a[r * F + f] * scale;
        double av, ag;
        act_both(act, g, &av, &ag);
        store(d_h, bf16, r * 2 * F + f, du * ag * up);
        store(d_h, bf16, r * 2 * F + F + f, du * av);
      }
    }
    if (d_w && lane == 0) {
      double s = 0;
      for (int64_t f = 0; f < F; f++) s += (double)d_a[r * F + f] * act_value(act, h[r * 2 * F + f]) * (double)h[r * 2 * F + F + f];
      d_w[r] = (float)s;
    }
  }
}

// db[g, c]: one thread per (g, c), rows of the group in order (the ref's f64 order).
__global__ void bias_grad_kernel(const void *dy, int bf16, const int32_t *gs, int G, int64_t C, float *db) {
  __shared__ int64_t ends[MAX_GROUPS];
  group_ends(gs, G, ends);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < G * C; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t g = i / C, c = i % C, r0 = g ? ends[g - 1] : 0;
    double s = 0;
    for (int64_t r = r0; r < ends[g]; r++) s += load(dy, bf16, r * C + c);
    db[i] = (float)s;
  }
}

__global__ void scales_kernel(const float *amax, int64_t G, float fp8_max, float *scale) {
  for (int64_t g = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; g < G; g += (int64_t)gridDim.x * blockDim.x)
    scale[g] = tw_compute_scale(amax[g], fp8_max, 0);
}

__global__ void add_kernel(float *y, const float *x, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += x[i];
}

unsigned blocks_for(tw_ctx *ctx, int64_t n) {
  int64_t b = (n + 255) / 256, cap = 16 * (int64_t)gpu_of(ctx)->num_sms;
  return (unsigned)(b < cap ? (b > 0 ? b : 1) : cap);
}

tw_status groups_ok(const tw_tensor *gs, const char *op) {
  int64_t G = tw_tensor_numel(gs);
  if (G < 1 || G > MAX_GROUPS)
    return tw_error(TW_ERR_UNSUPPORTED, "moe %s (gpu): %lld local experts (this kernel takes 1 .. %d)", op,
                    (long long)G, MAX_GROUPS);
  return TW_OK;
}

}  // namespace

extern "C" tw_status gpu_moe_bias_out(tw_ctx *ctx, const float *y, const tw_tensor *gs, const float *bias, int64_t C,
                                      void *out, tw_dtype out_dtype) {
  TW_TRY(groups_ok(gs, "bias_out"));
  int G = (int)tw_tensor_numel(gs);
  bias_out_kernel<<<blocks_for(ctx, 1 << 20), 256, 0, gpu_of(ctx)->stream>>>(y, (const int32_t *)gs->data, G, bias, C,
                                                                                 out, out_dtype == TW_BF16);
  GPU_TRY_CUDA(cudaGetLastError(), "moe bias_out: launch");
  return TW_OK;
}

extern "C" tw_status gpu_moe_act_fwd(tw_ctx *ctx, tw_moe_act act, const float *h, const tw_tensor *gs, const float *w,
                                     int64_t F, void *a, tw_dtype a_dtype) {
  TW_TRY(groups_ok(gs, "act_fwd"));
  act_fwd_kernel<<<blocks_for(ctx, 1 << 20), 256, 0, gpu_of(ctx)->stream>>>(
      (int)act, h, (const int32_t *)gs->data, (int)tw_tensor_numel(gs), w, F, a, a_dtype == TW_BF16,
      F % 4 == 0 && (uintptr_t)h % 16 == 0 && (uintptr_t)a % 16 == 0);
  GPU_TRY_CUDA(cudaGetLastError(), "moe act_fwd: launch");
  return TW_OK;
}

extern "C" tw_status gpu_moe_act_bwd(tw_ctx *ctx, tw_moe_act act, const float *h, const float *d_a, const tw_tensor *gs,
                                     const float *w, int64_t F, void *d_h, tw_dtype dh_dtype, float *d_w) {
  TW_TRY(groups_ok(gs, "act_bwd"));
  act_bwd_kernel<<<blocks_for(ctx, 1 << 20), 256, 0, gpu_of(ctx)->stream>>>(
      (int)act, h, d_a, (const int32_t *)gs->data, (int)tw_tensor_numel(gs), w, F, d_h, dh_dtype == TW_BF16, d_w,
      F % 4 == 0 && (uintptr_t)h % 16 == 0 && (uintptr_t)d_a % 16 == 0 && (uintptr_t)d_h % 16 == 0);
  GPU_TRY_CUDA(cudaGetLastError(), "moe act_bwd: launch");
  return TW_OK;
}

extern "C" tw_status gpu_moe_bias_grad(tw_ctx *ctx, const void *dy, tw_dtype dy_dtype, const tw_tensor *gs, int64_t C,
                                       float *db) {
  TW_TRY(groups_ok(gs, "bias_grad"));
  int64_t G = tw_tensor_numel(gs);
  bias_grad_kernel<<<blocks_for(ctx, G * C), 256, 0, gpu_of(ctx)->stream>>>(dy, dy_dtype == TW_BF16,
                                                                            (const int32_t *)gs->data, (int)G, C, db);
  GPU_TRY_CUDA(cudaGetLastError(), "moe bias_grad: launch");
  return TW_OK;
}

extern "C" tw_status gpu_moe_add_f32(tw_ctx *ctx, float *y, const float *x, int64_t n) {
  if (n == 0) return TW_OK;
  add_kernel<<<blocks_for(ctx, n), 256, 0, gpu_of(ctx)->stream>>>(y, x, n);
  GPU_TRY_CUDA(cudaGetLastError(), "moe add: launch");
  return TW_OK;
}

// fsdp layouts: P strided 2-D copies (cudaMemcpy2DAsync), each A rows of B elements.
extern "C" tw_status gpu_moe_swap_outer(tw_ctx *ctx, const void *src, int64_t P, int64_t A, int64_t B, size_t es,
                                        void *dst) {
  size_t row = (size_t)B * es;
  if (!row || !A) return TW_OK;
  for (int64_t p = 0; p < P; p++)
    GPU_TRY_CUDA(cudaMemcpy2DAsync((char *)dst + (size_t)p * row, (size_t)P * row, (const char *)src + (size_t)p * A * row,
                                   row, row, (size_t)A, cudaMemcpyDeviceToDevice, gpu_of(ctx)->stream),
                 "moe swap_outer: cudaMemcpy2DAsync");
  return TW_OK;
}

extern "C" tw_status gpu_moe_scales_from_amax(tw_ctx *ctx, const float *amax, int64_t G, float fp8_max, float *scale) {
  if (G == 0) return TW_OK;
  scales_kernel<<<blocks_for(ctx, G), 256, 0, gpu_of(ctx)->stream>>>(amax, G, fp8_max, scale);
  GPU_TRY_CUDA(cudaGetLastError(), "moe scales_from_amax: launch");
  return TW_OK;
}
