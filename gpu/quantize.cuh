// gpu/quantize.cuh — what the grouped quantize kernels share (gpu/quantize.cu and
// gpu/quantize_tile_spec.cu): parameters, the group-relative tile lookup, cp.async, the amax
// atomic. Internal to gpu/.
#ifndef TWIN_GPU_QUANTIZE_CUH
#define TWIN_GPU_QUANTIZE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu/numerics.cuh"
#include "twin/tw_quantize.h"

#define TILE 128

enum { XDT_F32 = 0, XDT_BF16 = 1, XDT_F16 = 2 };

struct QParams {
  const void *x;
  int64_t M, K;
  const int64_t *offsets, *tiles;  // [G+1], device
  int64_t G, Tcap;
  int mode, fp8, row, col, pow2, swz;
  float fp8_max;
  uint8_t *row_data, *col_data;
  void *row_si, *col_si;  // f32 or e8m0 bytes
  float *amax;            // [G] f32 atomics target (zeroed first), or NULL
  const float *scale;     // [G]: delayed scales, or NULL
  int64_t rs_ld, cs_ld;   // leading dims of the block-mode scale matrices
  int64_t chunks;         // quantize_tile_spec: 128-column chunks per CTA
  int64_t col_pitch;      // token-padded colwise data (tw_quantize.h): its row length 128*T_cap; 0: default
};

__device__ __forceinline__ int64_t find_group(const int64_t *tiles, int64_t G, int64_t t) {
  // the last g with tiles[g] <= t (empty groups share their start with the next group)
  int64_t lo = 0, hi = G;  // tiles[lo] <= t < tiles[hi]
  while (hi - lo > 1) {
    int64_t mid = (lo + hi) >> 1;
    if (tiles[mid] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// A 1-D grid of (row tile t, column piece c) with c fastest: the CTAs resident together then
// cover a few row tiles across all of K, so x is read in whole rows (DRAM pages) rather than
// 256-byte pieces of a thousand different rows (the register-tile kernel ran at 37-44% of copy
// bandwidth with the row tile fastest; H200, session 2).
__device__ __forceinline__ void tile_of_block(int64_t ncol, int64_t *t, int64_t *c) {
  const uint32_t b = blockIdx.x, n = (uint32_t)ncol, q = b / n;  // the host keeps the grid < 2^31
  *t = q;
  *c = b - q * n;
}

// NaN amax values go to the atomic as one canonical NaN, the largest unsigned pattern a
// non-negative float can have, so the result does not depend on the order of arrival.
__device__ __forceinline__ void atomic_amax(float *p, float v) {
  uint32_t u = tw_isnan(v) ? 0x7FC00000u : tw_f2u(v);
  atomicMax((unsigned int *)p, u);
}

// Column chunks (of 128) one tile CTA walks: the group lookup is paid once per CTA and the
// loads of chunk j+1 are in flight while chunk j is processed from shared memory.
#define TILE_CHUNKS 8

__device__ __forceinline__ uint32_t shfl_umax(uint32_t v, int width) {
  for (int d = 1; d < width; d <<= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

// A scale that turns no non-NaN input into NaN (0 * inf or a NaN scale would).
__device__ __forceinline__ bool scale_keeps_numbers(float s) { return s > 0.0f && s - s == 0.0f; }

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int src_bytes) {
  uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// n (<= 16) transposed codes of one column at o (the transposed colwise output of the tile
// kernels): one 16-byte store where allowed
__device__ __forceinline__ void store_col16(uint8_t *o, uint4 w, int n) {
  const uintptr_t ad = (uintptr_t)o;
  if (n == 16 && (ad & 15) == 0) {
    *(uint4 *)o = w;
  } else if (n == 16 && (ad & 3) == 0) {
    ((uint32_t *)o)[0] = w.x;
    ((uint32_t *)o)[1] = w.y;
    ((uint32_t *)o)[2] = w.z;
    ((uint32_t *)o)[3] = w.w;
  } else {
#pragma unroll
    for (int j = 0; j < 16; j++) {
      if (j >= n) break;
      const uint32_t word = j < 4 ? w.x : j < 8 ? w.y : j < 12 ? w.z : w.w;
      o[j] = (uint8_t)(word >> (8 * (j & 3)));
    }
  }
}

// The token-padded colwise layout: bytes n.. of a 16-byte chunk zeroed (n <= 0: all), so a
// tile's padding rows past m_g leave as code 0 in the same aligned 16-byte store.
__device__ __forceinline__ uint4 keep_first_bytes(uint4 w, int n) {
  if (n >= 16) return w;
  uint32_t v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int keep = n - 4 * i;  // bytes of this word to keep
    v[i] = keep >= 4 ? v[i] : keep <= 0 ? 0u : (v[i] & ((1u << (8 * keep)) - 1u));
  }
  return make_uint4(v[0], v[1], v[2], v[3]);
}

// quantize_tile_spec (gpu/quantize_tile_spec.cu): bf16/f16 x, K % 8 == 0, x 16-byte and
// row_data (and MXFP8 col_data) 8-byte aligned; `nblocks` CTAs of the 1-D tile grid
// (Tcap x ceil(nkc / p.chunks)).
cudaError_t launch_quantize_tile_spec(int xdt, const QParams &p, unsigned nblocks, cudaStream_t s);

#endif
