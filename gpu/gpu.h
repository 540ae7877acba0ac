// gpu/gpu.h — internal to the CUDA twin: the context state, the device error word, the
// checked-call macros and the functions each gpu/*.cu file provides to the backend table
// (gpu/backend.cu). Same names and signatures as ref/ref.h, prefix gpu_.
#ifndef TWIN_GPU_GPU_H
#define TWIN_GPU_GPU_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/backend.h"

// The state a gpu context owns (ctx->state).
typedef struct gpu_state {
  int device;
  int sm;                  // compute capability, major*10 + minor (90 on Hopper)
  int num_sms;
  cudaStream_t stream;
  int own_stream;          // created by the context (destroyed with it)
  // tw_alloc_stream's memory: the context's own stream-ordered pool, which keeps what is freed
  // (release threshold: no limit) until tw_ctx_trim or the context's end. The device's default
  // pool gives freed memory back at every synchronization, and mapping it again cost the
  // pipeline scan 4.5 ms a step (2 H200s). NULL: the device has no pools (plain cudaMalloc).
  cudaMemPool_t pool;
  void *workspace;         // ctx-owned scratch (cuBLASLt workspace, prefix sums, ...)
  size_t workspace_bytes;
  long long *err_word;     // device: GPU_ERR_WORDS words, first error wins (see below)
  void *lt;                // cublasLtHandle_t, created on first GEMM (gpu/gemm.cu)
  // Per-operation scratch (gpu_scratch), separate from the workspace so a GEMM may hand the
  // whole workspace to cuBLASLt while its group offsets live here.
  void *scratch;
  size_t scratch_bytes, scratch_used;
#define GPU_SCRATCH_EXTRA 8
  void *extra[GPU_SCRATCH_EXTRA];  // overflow buffers of the current operation (stream-ordered)
  int n_extra;
  // gg_wgmma_fp8's operand copies: the wgrad's token-padded ones (gpu/grouped_gemm_wgmma_fp8_wgrad.cu)
  // and the MXFP8 forward's K-major copy of a colwise rhs (gpu/grouped_gemm_wgmma_fp8.cu): grow-only,
  // stream-ordered (cudaMallocAsync / cudaFreeAsync), never grown during a graph capture (a call
  // inside a capture allocates and frees its own).
  void *wgrad_pad;
  size_t wgrad_pad_bytes;
} gpu_state;

// Device error word: [0] code (0 = none), [1] op id, [2] a, [3] b. The first error of a
// launch wins (atomicCAS on [0]); tw_ctx_check() formats it and clears it.
#define GPU_ERR_WORDS 4
enum gpu_err_code {
  GPU_ERR_NONE = 0,
  GPU_ERR_GROUP_NEGATIVE = 1,   // a = group index, b = its size
  GPU_ERR_GROUP_SUM = 2,        // a = sum of sizes, b = rows available
  GPU_ERR_GROUP_ALIGN = 3,      // a = group index, b = its size (must be a multiple of ...)
  GPU_ERR_ROW_INDEX = 4,        // a = i, b = lhs_rows[i] outside [-1, U) (row-gathered lhs)
  // MoE routing (gpu/router.cu, gpu/ep.cu; gpu/moe.h packs the values)
  GPU_ERR_NAN_LOGIT = 20,       // a = token, b = expert
  GPU_ERR_EXPERT_ID = 21,       // a = token, b = gpu_pack_id_slot(id, slot): id outside [0, E)
  GPU_ERR_EXPERT_TWICE = 22,    // a = token, b = gpu_pack_id_slot(id, slot): id listed twice
  GPU_ERR_EP_CAPACITY = 23,     // a = rank, b = gpu_pack_rows(demand, recv_capacity)
  GPU_ERR_EP_TIMEOUT = 24,      // a = the peer rank waited for, b = the barrier epoch (ep_nccl_lsa)
  GPU_ERR_EP_DESYNC = 25,       // a = the peer rank, b = its epoch << 32 | this rank's (ep_nccl_lsa)
  GPU_ERR_PP_TIMEOUT = 26,      // a = the peer rank waited for (-1: an earlier wait timed out), b = the call's epoch
};
enum gpu_op_id {
  GPU_OP_QUANTIZE = 1,
  GPU_OP_DEQUANTIZE = 2,
  GPU_OP_GROUPED_GEMM = 3,
  GPU_OP_GROUPED_GEMM_WGRAD = 4,
  GPU_OP_GROUPED_GEMM_ROWS = 5,
  GPU_OP_GROUPED_GEMM_WGRAD_ROWS = 6,
  GPU_OP_ROUTER = 20,
  GPU_OP_ROUTER_BWD = 21,
  GPU_OP_ROUTER_AUX = 22,
  GPU_OP_ROUTER_AUX_BWD = 23,
  GPU_OP_EP_DISPATCH = 24,
  GPU_OP_EP_COMBINE = 25,
  GPU_OP_PPERMUTE = 30,  // ppermute / ppermute_n over the communicator's window (gpu/ppermute_lsa.cu)
};

#ifdef __CUDACC__
// Records the first error of this context; later ones are dropped.
__device__ static inline void gpu_report(long long *w, int code, int op, long long a, long long b) {
  if (atomicCAS((unsigned long long *)&w[0], 0ull, (unsigned long long)code) == 0ull) {
    w[1] = op;
    w[2] = a;
    w[3] = b;
  }
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

static inline gpu_state *gpu_of(tw_ctx *ctx) { return (gpu_state *)ctx->state; }

// Maps a CUDA error to TW_ERR_CUDA with "<what>: <cuda error string>"; TW_OK on success.
tw_status gpu_cuda_status(cudaError_t e, const char *what);
// TW_OK for an all-zero error word, else TW_ERR_DEVICE with "<op>: <what> (seen on the device)".
tw_status gpu_format_error_word(const long long w[GPU_ERR_WORDS]);
#define GPU_TRY_CUDA(call, what)                                  \
  do {                                                            \
    cudaError_t gpu_e_ = (call);                                  \
    if (gpu_e_ != cudaSuccess) return gpu_cuda_status(gpu_e_, what); \
  } while (0)

// Group sizes on the device: validates them (negative, sum > rows) into the error word and
// writes exclusive prefix offsets[G+1] (int64) and 128-row tile offsets tiles[G+1] (int64,
// T(g) of tw_quantize.h), all on the context's stream, no host sync. When a size is bad
// the offsets are clamped so that every later kernel stays in bounds (empty groups).
// `align` > 1 additionally requires each size to be a multiple of it (GPU_ERR_GROUP_ALIGN).
tw_status gpu_group_prefix(tw_ctx *ctx, const int32_t *group_sizes, int64_t G, int64_t rows,
                           int align, int op_id, int64_t *offsets, int64_t *tiles);

// Scratch (not the workspace), bump-allocated per call (256-byte aligned); callers reset it
// with gpu_scratch_reset at the start of an operation. Requests past its size get a
// stream-ordered cudaMallocAsync buffer, freed (stream-ordered) by the next reset.
void gpu_scratch_reset(tw_ctx *ctx);
tw_status gpu_scratch(tw_ctx *ctx, size_t bytes, void **out);

// Provided by gpu/numerics + quantize (one owner) and gpu/gemm (another owner).
tw_status gpu_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate);
tw_status gpu_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                               const tw_quantize_opts *opts, tw_qtensor *q);
tw_status gpu_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                 int colwise, tw_tensor *out);
tw_status gpu_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                   const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                   float margin);
tw_status gpu_gemm_alignment(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b,
                             tw_op op_b, const tw_tensor *out);
tw_status gpu_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                   tw_tensor *out, int accumulate);
tw_status gpu_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs,
                           tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                           int accumulate);
tw_status gpu_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                 const tw_operand *rhs, tw_op rhs_op,
                                 const tw_tensor *group_sizes, tw_tensor *out, int accumulate);
tw_status gpu_grouped_gemm_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows, const tw_operand *rhs,
                                tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out, int accumulate);
tw_status gpu_grouped_gemm_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                      const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                                      int accumulate);
// Destroys what gpu/gemm.cu created in the state (cuBLASLt handle); called by ctx_fini.
void gpu_gemm_fini(gpu_state *st);

#ifdef __cplusplus
}
#endif
#endif
