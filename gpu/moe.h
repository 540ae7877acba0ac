// gpu/moe.h — internal to the CUDA twin: the MoE routing tables (router, EP) that
// gpu/backend.cu plugs into tw_gpu_ops, and how their error-word values are packed.
#ifndef TWIN_GPU_MOE_H
#define TWIN_GPU_MOE_H

#include <stdint.h>

#include "core/backend_moe.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const tw_router_backend gpu_router;  // gpu/router.cu (version router_warp)
extern const tw_ep_backend gpu_ep;          // gpu/ep.cu (version ep_nccl_slots)

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#define GPU_MOE_HD __host__ __device__
#else
#define GPU_MOE_HD
#endif

// An expert id (any i32) and its top-k slot (j >= 0) in one error-word value.
GPU_MOE_HD static inline long long gpu_pack_id_slot(int32_t id, int64_t slot) {
  return (long long)(((uint64_t)(uint32_t)id << 32) | (uint64_t)(uint32_t)slot);
}
GPU_MOE_HD static inline int32_t gpu_unpack_id(long long v) { return (int32_t)(uint32_t)((uint64_t)v >> 32); }
GPU_MOE_HD static inline int64_t gpu_unpack_slot(long long v) { return (int64_t)(uint32_t)((uint64_t)v & 0xffffffffu); }
// Two row counts (each clamped to 2^31 - 1) in one value.
GPU_MOE_HD static inline long long gpu_pack_rows(int64_t a, int64_t b) {
  uint64_t x = (uint64_t)(a > 0x7fffffff ? 0x7fffffff : a), y = (uint64_t)(b > 0x7fffffff ? 0x7fffffff : b);
  return (long long)((x << 32) | y);
}

#endif
