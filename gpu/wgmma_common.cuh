// gpu/wgmma_common.cuh — Hopper (sm_90a) building blocks for twin's wgmma kernels: mbarriers,
// TMA tile loads, shared-memory matrix descriptors (128-byte swizzle), wgmma fence / commit /
// wait, the tensor-map encoder from the driver, and the epilogue stores. Written for
// gpu/grouped_gemm_wgmma_fp8.cu (gg_wgmma_fp8); the same idioms as gpu/grouped_gemm_wgmma.cu
// (gg_wgmma), which uses it too.
// Everything is inline (or a template), so any number of .cu files may include it.
#ifndef TWIN_GPU_WGMMA_COMMON_CUH
#define TWIN_GPU_WGMMA_COMMON_CUH

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include "gpu/gpu.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGC_DEVICE 1
#endif

#ifdef WGC_DEVICE
__device__ __forceinline__ uint32_t wgc_smem(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wgc_bar_init(uint64_t *b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(wgc_smem(b)), "r"(count));
}
__device__ __forceinline__ void wgc_bar_expect(uint64_t *b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(wgc_smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wgc_bar_arrive(uint64_t *b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(wgc_smem(b)) : "memory");
}
// The wait on a barrier given by its shared-memory address (hot loops keep the address: taking
// it from a generic pointer reads the CTA's id in the cluster each time).
__device__ __forceinline__ void wgc_bar_wait_at(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void wgc_bar_wait(uint64_t *b, uint32_t parity) { wgc_bar_wait_at(wgc_smem(b), parity); }
// Before the first TMA through a tensor map that an earlier kernel wrote in global memory
// (tensormap.replace, then fence.proxy.tensormap::generic.release there): the issuing thread's
// acquire of its 128 bytes for the tensormap proxy.
__device__ __forceinline__ void wgc_tensormap_acquire(const CUtensorMap *map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"((uint64_t)map) : "memory");
}
__device__ __forceinline__ void wgc_tma_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          wgc_smem(dst)),
      "l"((uint64_t)map), "r"(wgc_smem(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void wgc_tma_3d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(wgc_smem(dst)),
      "l"((uint64_t)map), "r"(wgc_smem(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Clusters: rank in the cluster, cluster-wide barrier (every thread of every CTA), arrive on
// the mbarrier at the same shared-memory offset in CTA `cta` (cta-scope release: a cluster-scope
// release there serialized gg_wgmma's pairs, gpu/NOTES-gemm.md run g6), and TMA loads
// multicast into the same shared-memory offset of every CTA in `mask`, completing on each one's
// mbarrier at the offset of `bar`.
__device__ __forceinline__ uint32_t wgc_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void wgc_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ void wgc_bar_arrive_at(uint64_t *b, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(wgc_smem(b)),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void wgc_tma_2d_mc(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                                              uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;\n" ::"r"(wgc_smem(dst)),
      "l"((uint64_t)map), "r"(wgc_smem(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
__device__ __forceinline__ void wgc_tma_3d_mc(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                                              int c2, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5}], [%2], %6;\n" ::"r"(wgc_smem(dst)),
      "l"((uint64_t)map), "r"(wgc_smem(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(mask)
      : "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle (bits 62-63 = 1), addresses in 16 B units.
__device__ __forceinline__ uint64_t wgc_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 62);
}
// wgc_desc(addr, 16, 1024) from its low word alone (the high word is the constant stride and
// swizzle), so hot loops keep and add 32-bit words and the compiler sees a constant high half.
__device__ __forceinline__ uint64_t wgc_desc_lo(uint32_t lo) {
  return (uint64_t)lo | ((uint64_t)((1024 & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wgc_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgc_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgc_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving uses of n accumulators across wgmma.wait_group.
template <int N>
__device__ __forceinline__ void wgc_touch(float *d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif  // WGC_DEVICE

// Output stores (one element, or two adjacent ones in one store), accumulate in f32 first.
template <int OUT>
__device__ __forceinline__ void wgc_put1(void *out, int64_t i, float v, int acc) {
  if (OUT == TW_F32) {
    float *p = (float *)out + i;
    *p = acc ? *p + v : v;
  } else if (OUT == TW_BF16) {
    __nv_bfloat16 *p = (__nv_bfloat16 *)out + i;
    *p = __float2bfloat16_rn(acc ? __bfloat162float(*p) + v : v);
  } else {
    __half *p = (__half *)out + i;
    *p = __float2half_rn(acc ? __half2float(*p) + v : v);
  }
}
template <int OUT>
__device__ __forceinline__ void wgc_put2(void *out, int64_t i, float v0, float v1, int acc) {
  if (OUT == TW_F32) {
    float2 *p = (float2 *)((float *)out + i);
    if (acc) {
      float2 o = *p;
      v0 = o.x + v0;
      v1 = o.y + v1;
    }
    *p = make_float2(v0, v1);
  } else if (OUT == TW_BF16) {
    __nv_bfloat162 *p = (__nv_bfloat162 *)((__nv_bfloat16 *)out + i);
    if (acc) {
      __nv_bfloat162 o = *p;
      v0 = __low2float(o) + v0;
      v1 = __high2float(o) + v1;
    }
    *p = __halves2bfloat162(__float2bfloat16_rn(v0), __float2bfloat16_rn(v1));
  } else {
    __half2 *p = (__half2 *)((__half *)out + i);
    if (acc) {
      __half2 o = *p;
      v0 = __low2float(o) + v0;
      v1 = __high2float(o) + v1;
    }
    *p = __halves2half2(__float2half_rn(v0), __float2half_rn(v1));
  }
}

// cuTensorMapEncodeTiled from the driver (no -lcuda), or NULL.
static inline PFN_cuTensorMapEncodeTiled_v12000 wgc_encode_fn(void) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
  if (!fn) {
    void *f = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
    else
      cudaGetLastError();
  }
  return fn;
}

#endif
