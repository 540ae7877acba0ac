// gpu/backend.cu — the CUDA twin's backend table (tw_gpu_ops): context state (device, stream,
// workspace, scratch, the device error word), memory, copies, sync/check with the error word
// formatted into a message, and gpu_group_prefix (group sizes -> offsets on the device).
//
// Operations that live in other gpu/*.cu files are referenced weakly, so a build without one
// of them still links and reports TW_ERR_UNSUPPORTED ("the gpu backend does not provide it")
// instead of failing to link.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"
#include "gpu/moe.h"

extern "C" int tw_gpu_device_count(void);  // gpu/probe.cu

#pragma weak gpu_cast
#pragma weak gpu_grouped_quantize
#pragma weak gpu_grouped_dequantize
#pragma weak gpu_delayed_scale_update
#pragma weak gpu_gemm_alignment
#pragma weak gpu_gemm
#pragma weak gpu_grouped_gemm
#pragma weak gpu_grouped_gemm_wgrad
#pragma weak gpu_grouped_gemm_rows
#pragma weak gpu_grouped_gemm_wgrad_rows
#pragma weak gpu_gemm_fini
#pragma weak gpu_router
#pragma weak gpu_ep

// Default sizes: the workspace is cuBLASLt's (32 MiB covers Hopper's largest heuristic);
// scratch holds per-call prefix sums and per-group values and grows on demand.
#define GPU_DEFAULT_WORKSPACE (32u << 20)
#define GPU_DEFAULT_SCRATCH (1u << 20)

extern "C" tw_status gpu_cuda_status(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return TW_OK;
  return tw_error(TW_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

static int gpu_available(void) { return tw_gpu_device_count() > 0; }

static tw_status gpu_ctx_fini(tw_ctx *ctx);

static tw_status gpu_ctx_init(tw_ctx *ctx) {
  gpu_state *st = (gpu_state *)calloc(1, sizeof *st);
  if (!st) return tw_error(TW_ERR_MEMORY, "ctx_create: out of host memory");
  ctx->state = st;
  int n = tw_gpu_device_count();
  st->device = ctx->cfg.device;
  tw_status s = TW_OK;
  if (st->device < 0 || st->device >= n) {
    s = tw_error(TW_ERR_INVALID_ARG, "ctx_create: gpu device %d does not exist (%d visible)",
                 st->device, n);
    goto fail;
  }
#define INIT_TRY(call, what)                                  \
  do {                                                        \
    cudaError_t e_ = (call);                                  \
    if (e_ != cudaSuccess) {                                  \
      s = gpu_cuda_status(e_, what);                          \
      goto fail;                                              \
    }                                                         \
  } while (0)
  INIT_TRY(cudaSetDevice(st->device), "ctx_create: cudaSetDevice");
  {
    cudaDeviceProp p;
    INIT_TRY(cudaGetDeviceProperties(&p, st->device), "ctx_create: cudaGetDeviceProperties");
    st->sm = p.major * 10 + p.minor;
    st->num_sms = p.multiProcessorCount;
  }
  if (ctx->cfg.stream) {
    st->stream = (cudaStream_t)ctx->cfg.stream;
  } else {
    INIT_TRY(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking),
             "ctx_create: cudaStreamCreate");
    st->own_stream = 1;
  }
  {
    int pools = 0;
    INIT_TRY(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, st->device),
             "ctx_create: cudaDeviceGetAttribute(memory pools)");
    if (pools) {
      cudaMemPoolProps props;
      memset(&props, 0, sizeof props);
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = st->device;
      INIT_TRY(cudaMemPoolCreate(&st->pool, &props), "ctx_create: cudaMemPoolCreate");
      uint64_t keep_all = UINT64_MAX;
      INIT_TRY(cudaMemPoolSetAttribute(st->pool, cudaMemPoolAttrReleaseThreshold, &keep_all),
               "ctx_create: cudaMemPoolSetAttribute(release threshold)");
    }
  }
  INIT_TRY(cudaMalloc((void **)&st->err_word, GPU_ERR_WORDS * sizeof(long long)),
           "ctx_create: cudaMalloc(error word)");
  INIT_TRY(cudaMemsetAsync(st->err_word, 0, GPU_ERR_WORDS * sizeof(long long), st->stream),
           "ctx_create: cudaMemset(error word)");
  st->workspace_bytes = ctx->cfg.workspace_bytes ? ctx->cfg.workspace_bytes : GPU_DEFAULT_WORKSPACE;
  INIT_TRY(cudaMalloc(&st->workspace, st->workspace_bytes), "ctx_create: cudaMalloc(workspace)");
  st->scratch_bytes = GPU_DEFAULT_SCRATCH;
  INIT_TRY(cudaMalloc(&st->scratch, st->scratch_bytes), "ctx_create: cudaMalloc(scratch)");
  INIT_TRY(cudaStreamSynchronize(st->stream), "ctx_create: cudaStreamSynchronize");
#undef INIT_TRY
  return TW_OK;
fail:
  gpu_ctx_fini(ctx);
  return s;
}

static tw_status gpu_ctx_fini(tw_ctx *ctx) {
  gpu_state *st = gpu_of(ctx);
  if (!st) return TW_OK;
  tw_status s = TW_OK;
  if (st->stream) {
    cudaError_t e = cudaStreamSynchronize(st->stream);
    if (e != cudaSuccess) s = gpu_cuda_status(e, "ctx_destroy: cudaStreamSynchronize");
  }
  if (gpu_gemm_fini) gpu_gemm_fini(st);
  for (int i = 0; i < st->n_extra; i++) cudaFree(st->extra[i]);
  if (st->wgrad_pad) cudaFree(st->wgrad_pad);
  if (st->scratch) cudaFree(st->scratch);
  if (st->workspace) cudaFree(st->workspace);
  if (st->err_word) cudaFree(st->err_word);
  // allocations still live or frees in flight keep the pool's memory until they end (CUDA)
  if (st->pool) cudaMemPoolDestroy(st->pool);
  if (st->own_stream && st->stream) cudaStreamDestroy(st->stream);
  free(st);
  ctx->state = NULL;
  return s;
}

static tw_status gpu_sync(tw_ctx *ctx) {
  gpu_state *st = gpu_of(ctx);
  GPU_TRY_CUDA(cudaStreamSynchronize(st->stream), "ctx_sync");
  GPU_TRY_CUDA(cudaGetLastError(), "ctx_sync: earlier launch");
  return TW_OK;
}

static const char *op_name(long long op) {
  switch (op) {
    case GPU_OP_QUANTIZE: return "grouped_quantize";
    case GPU_OP_DEQUANTIZE: return "grouped_dequantize";
    case GPU_OP_GROUPED_GEMM: return "grouped_gemm";
    case GPU_OP_GROUPED_GEMM_WGRAD: return "grouped_gemm_wgrad";
    case GPU_OP_GROUPED_GEMM_ROWS: return "grouped_gemm_rows";
    case GPU_OP_GROUPED_GEMM_WGRAD_ROWS: return "grouped_gemm_wgrad_rows";
    case GPU_OP_ROUTER: return "router";
    case GPU_OP_ROUTER_BWD: return "router_bwd";
    case GPU_OP_ROUTER_AUX: return "router_aux_loss";
    case GPU_OP_ROUTER_AUX_BWD: return "router_aux_loss_bwd";
    case GPU_OP_EP_DISPATCH: return "ep_dispatch";
    case GPU_OP_EP_COMBINE: return "ep_combine";
    case GPU_OP_PPERMUTE: return "ppermute";
    default: return "gpu operation";
  }
}

// Formats a recorded error word; the same words are what gpu_report() wrote.
extern "C" tw_status gpu_format_error_word(const long long w[GPU_ERR_WORDS]) {
  const char *op = op_name(w[1]);
  switch (w[0]) {
    case GPU_ERR_NONE: return TW_OK;
    case GPU_ERR_GROUP_NEGATIVE:
      return tw_error(TW_ERR_DEVICE, "%s: group_sizes[%lld] = %lld is negative (seen on the device)",
                      op, w[2], w[3]);
    case GPU_ERR_GROUP_SUM:
      return tw_error(TW_ERR_DEVICE, "%s: group_sizes sum to %lld but there are %lld rows (seen on the device)",
                      op, w[2], w[3]);
    case GPU_ERR_GROUP_ALIGN:
      return tw_error(TW_ERR_DEVICE, "%s: group_sizes[%lld] = %lld breaks the operation's alignment (seen on the device)",
                      op, w[2], w[3]);
    case GPU_ERR_ROW_INDEX:
      return tw_error(TW_ERR_DEVICE, "%s: lhs_rows[%lld] = %lld is outside [-1, U) (seen on the device; that row's "
                      "products are unspecified)", op, w[2], w[3]);
    case GPU_ERR_NAN_LOGIT:
      return tw_error(TW_ERR_DEVICE, "%s: logits[%lld, %lld] is NaN (seen on the device)", op, w[2], w[3]);
    case GPU_ERR_EXPERT_ID:
      return tw_error(TW_ERR_DEVICE, "%s: topk_idx[%lld, %lld] = %d is not an expert id (outside [0, E); seen on the device)",
                      op, w[2], (long long)gpu_unpack_slot(w[3]), (int)gpu_unpack_id(w[3]));
    case GPU_ERR_EXPERT_TWICE:
      return tw_error(TW_ERR_DEVICE, "%s: token %lld lists expert %d twice (again at topk_idx slot %lld; seen on the device)",
                      op, w[2], (int)gpu_unpack_id(w[3]), (long long)gpu_unpack_slot(w[3]));
    case GPU_ERR_EP_CAPACITY:
      return tw_error(TW_ERR_DEVICE,
                      "%s: rank %lld needs %lld receive rows (per-expert counts rounded up to the alignment) but "
                      "recv_capacity is %lld (overflow policy: error; nothing was written; seen on the device)",
                      op, w[2], (long long)((unsigned long long)w[3] >> 32), (long long)(w[3] & 0xffffffffll));
    case GPU_ERR_EP_TIMEOUT:
      if (w[2] < 0)
        return tw_error(TW_ERR_DEVICE,
                        "%s: an earlier barrier of this EP context's LSA exchange timed out, so its barriers no "
                        "longer wait (barrier %lld): the step's outputs are not valid; make a new EP context (seen "
                        "on the device)", op, w[3]);
      return tw_error(TW_ERR_DEVICE,
                      "%s: rank %lld did not reach barrier %lld of the LSA exchange within the timeout "
                      "(TWIN_EP_LSA_TIMEOUT_S, default 20 s: peer gone or stalled; the step's outputs are not valid, "
                      "and this EP context no longer waits at its barriers; seen on the device)",
                      op, w[2], w[3]);
    case GPU_ERR_EP_DESYNC:
      return tw_error(TW_ERR_DEVICE,
                      "%s: rank %lld is at barrier %lld of the LSA exchange while this rank is at %lld: a rank "
                      "skipped a step (the step's outputs are not valid; seen on the device)",
                      op, w[2], (long long)((unsigned long long)w[3] >> 32), (long long)(w[3] & 0xffffffffll));
    case GPU_ERR_PP_TIMEOUT:
      if (w[2] < 0)
        return tw_error(TW_ERR_DEVICE,
                        "%s: an earlier wait of this communicator's window exchange timed out, or the communicator was "
                        "aborted, so it no longer waits (call %lld): the moved data is not valid; make a new "
                        "communicator (seen on the device)",
                        op, w[3]);
      return tw_error(TW_ERR_DEVICE,
                      "%s: rank %lld did not reach call %lld of the window exchange within the timeout "
                      "(TWIN_PPERMUTE_TIMEOUT_S, default the communicator's: peer gone, stalled or given another "
                      "perm; the moved data is not valid, and this communicator's window no longer waits; seen on "
                      "the device)", op, w[2], w[3]);
    default:
      return tw_error(TW_ERR_DEVICE, "%s: device error code %lld (a = %lld, b = %lld)", op, w[0], w[2], w[3]);
  }
}

static tw_status gpu_check(tw_ctx *ctx) {
  gpu_state *st = gpu_of(ctx);
  long long w[GPU_ERR_WORDS];
  GPU_TRY_CUDA(cudaMemcpyAsync(w, st->err_word, sizeof w, cudaMemcpyDeviceToHost, st->stream),
               "ctx_check: reading the error word");
  GPU_TRY_CUDA(cudaMemsetAsync(st->err_word, 0, sizeof w, st->stream), "ctx_check: clearing the error word");
  GPU_TRY_CUDA(cudaStreamSynchronize(st->stream), "ctx_check");
  return gpu_format_error_word(w);
}

// Waits for the stream and gives the pool's kept memory back: before a failed allocation's
// second try, and tw_ctx_trim.
static tw_status gpu_trim(tw_ctx *ctx) {
  gpu_state *st = gpu_of(ctx);
  if (!st->pool) return TW_OK;
  GPU_TRY_CUDA(cudaStreamSynchronize(st->stream), "ctx_trim: cudaStreamSynchronize");
  GPU_TRY_CUDA(cudaMemPoolTrimTo(st->pool, 0), "ctx_trim: cudaMemPoolTrimTo");
  return TW_OK;
}

// 1 when the context's stream is being captured into a graph (no synchronizing then).
static int gpu_capturing(gpu_state *st) {
  cudaStreamCaptureStatus c = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(st->stream, &c) == cudaSuccess && c != cudaStreamCaptureStatusNone;
}

static tw_status gpu_alloc(tw_ctx *ctx, size_t bytes, void **out) {
  GPU_TRY_CUDA(cudaSetDevice(gpu_of(ctx)->device), "alloc: cudaSetDevice");
  cudaError_t e = cudaMalloc(out, bytes);
  if (e == cudaErrorMemoryAllocation && gpu_of(ctx)->pool && !gpu_capturing(gpu_of(ctx))) {
    cudaGetLastError();  // the pool may hold what is missing
    if (gpu_trim(ctx) == TW_OK) e = cudaMalloc(out, bytes);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    *out = NULL;
    return tw_error(TW_ERR_MEMORY, "alloc: cudaMalloc of %zu bytes failed: %s", bytes, cudaGetErrorString(e));
  }
  return TW_OK;
}

static tw_status gpu_free(tw_ctx *ctx, void *p) {
  // cudaFree waits for the device; enqueued work using p stays valid.
  GPU_TRY_CUDA(cudaFree(p), "free");
  return TW_OK;
}

// From the context's pool, in stream order; inside a graph capture from the device's default
// pool (a graph's allocation node; its memory lives with the graph).
static cudaError_t pool_alloc(gpu_state *st, size_t bytes, void **out) {
  if (gpu_capturing(st)) return cudaMallocAsync(out, bytes, st->stream);
  return cudaMallocFromPoolAsync(out, bytes, st->pool, st->stream);
}

// pool_alloc, and once more after a trim when the device is out of memory (what the pool keeps
// may be in pieces too small); the trim waits for the stream, so only a failure pays a wait.
static cudaError_t pool_alloc_or_trim(tw_ctx *ctx, size_t bytes, void **out) {
  gpu_state *st = gpu_of(ctx);
  cudaError_t e = pool_alloc(st, bytes, out);
  if (e == cudaErrorMemoryAllocation && !gpu_capturing(st)) {
    cudaGetLastError();
    if (gpu_trim(ctx) == TW_OK) e = pool_alloc(st, bytes, out);
  }
  return e;
}

// A device without stream-ordered pools (old driver, some virtualized GPUs) gets plain
// cudaMalloc / cudaFree from alloc_stream / free_stream: same results, the old waits.
static tw_status gpu_alloc_stream(tw_ctx *ctx, size_t bytes, void **out) {
  gpu_state *st = gpu_of(ctx);
  if (!st->pool) return gpu_alloc(ctx, bytes, out);
  GPU_TRY_CUDA(cudaSetDevice(st->device), "alloc_stream: cudaSetDevice");
  cudaError_t e = pool_alloc_or_trim(ctx, bytes, out);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *out = NULL;
    return tw_error(TW_ERR_MEMORY, "alloc_stream: cudaMallocAsync of %zu bytes failed: %s", bytes, cudaGetErrorString(e));
  }
  return TW_OK;
}

static tw_status gpu_free_stream(tw_ctx *ctx, void *p) {
  if (!gpu_of(ctx)->pool) return gpu_free(ctx, p);
  GPU_TRY_CUDA(cudaFreeAsync(p, gpu_of(ctx)->stream), "free_stream");
  return TW_OK;
}

static tw_status gpu_copy(tw_ctx *ctx, void *dst, tw_mem dst_mem, const void *src, tw_mem src_mem,
                          size_t bytes) {
  gpu_state *st = gpu_of(ctx);
  cudaMemcpyKind kind = dst_mem == TW_MEM_HOST
                            ? (src_mem == TW_MEM_HOST ? cudaMemcpyHostToHost : cudaMemcpyDeviceToHost)
                            : (src_mem == TW_MEM_HOST ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice);
  GPU_TRY_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, st->stream), "tensor_copy: cudaMemcpyAsync");
  // A host destination must be complete on return; a pageable host source is staged by CUDA
  // before cudaMemcpyAsync returns, so only the device-to-host direction needs the wait.
  if (dst_mem == TW_MEM_HOST) GPU_TRY_CUDA(cudaStreamSynchronize(st->stream), "tensor_copy: sync");
  return TW_OK;
}

static tw_status gpu_memset(tw_ctx *ctx, void *p, int byte, size_t bytes) {
  GPU_TRY_CUDA(cudaMemsetAsync(p, byte, bytes, gpu_of(ctx)->stream), "memset: cudaMemsetAsync");
  return TW_OK;
}

// ---- scratch -------------------------------------------------------------------------------

extern "C" void gpu_scratch_reset(tw_ctx *ctx) {
  gpu_state *st = gpu_of(ctx);
  // Overflow buffers of the previous operation are freed in stream order (no host sync).
  for (int i = 0; i < st->n_extra; i++) cudaFreeAsync(st->extra[i], st->stream);
  st->n_extra = 0;
  st->scratch_used = 0;
}

extern "C" tw_status gpu_scratch(tw_ctx *ctx, size_t bytes, void **out) {
  gpu_state *st = gpu_of(ctx);
  size_t need = (bytes + 255) & ~(size_t)255;
  if (st->scratch_used + need <= st->scratch_bytes) {
    *out = (char *)st->scratch + st->scratch_used;
    st->scratch_used += need;
    return TW_OK;
  }
  if (st->n_extra >= GPU_SCRATCH_EXTRA)
    return tw_error(TW_ERR_INTERNAL, "gpu scratch: more than %d overflow buffers in one operation",
                    GPU_SCRATCH_EXTRA);
  GPU_TRY_CUDA(st->pool ? pool_alloc_or_trim(ctx, need, out) : cudaMallocAsync(out, need, st->stream),
               "gpu scratch: stream-ordered allocation");
  st->extra[st->n_extra++] = *out;
  return TW_OK;
}

// ---- group sizes -> offsets ----------------------------------------------------------------

// Inclusive sum over the block of one value per thread (blockDim.x a multiple of 32).
__device__ static int64_t block_inclusive_scan(int64_t v, int64_t *warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int d = 1; d < 32; d <<= 1) {
    int64_t u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < nwarps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      int64_t u = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += u;
    }
    if (lane < nwarps) warp_sums[lane] = w;
  }
  __syncthreads();
  int64_t r = v + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums is reused by the next call
  return r;
}

// One block scans the sizes in chunks of its width. A negative size counts as 0 and a group
// that would pass `rows` is cut to the rows left, so the offsets always describe groups inside
// the buffer; the first bad size is recorded in the error word.
__global__ void group_prefix_kernel(const int32_t *__restrict__ sizes, int64_t G, int64_t rows,
                                    int align, int op_id, int64_t *__restrict__ offsets,
                                    int64_t *__restrict__ tiles, long long *err) {
  __shared__ int64_t warp_sums[32];
  __shared__ int64_t carry_rows, carry_tiles;
  if (threadIdx.x == 0) carry_rows = carry_tiles = 0;
  __syncthreads();
  for (int64_t base = 0; base < G; base += blockDim.x) {
    int64_t g = base + threadIdx.x;
    int64_t raw = g < G ? (int64_t)sizes[g] : 0;
    if (g < G && raw < 0) gpu_report(err, GPU_ERR_GROUP_NEGATIVE, op_id, g, raw);
    if (g < G && raw > 0 && align > 1 && raw % align != 0)
      gpu_report(err, GPU_ERR_GROUP_ALIGN, op_id, g, raw);
    int64_t m = raw > 0 ? raw : 0;
    int64_t incl = carry_rows + block_inclusive_scan(m, warp_sums);
    int64_t excl = incl - m;
    int64_t start = excl < rows ? excl : rows, end = incl < rows ? incl : rows;
    int64_t tc = (end - start + 127) / 128;
    int64_t tincl = carry_tiles + block_inclusive_scan(tc, warp_sums);
    if (g < G) {
      offsets[g] = start;
      tiles[g] = tincl - tc;
      if (g == G - 1) {
        offsets[G] = end;
        tiles[G] = tincl;
        if (incl > rows) gpu_report(err, GPU_ERR_GROUP_SUM, op_id, incl, rows);
      }
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) {
      carry_rows = incl;
      carry_tiles = tincl;
    }
    __syncthreads();
  }
}

extern "C" tw_status gpu_group_prefix(tw_ctx *ctx, const int32_t *group_sizes, int64_t G, int64_t rows,
                                      int align, int op_id, int64_t *offsets, int64_t *tiles) {
  gpu_state *st = gpu_of(ctx);
  int threads = G >= 1024 ? 1024 : (int)((G + 31) / 32 * 32);
  group_prefix_kernel<<<1, threads, 0, st->stream>>>(group_sizes, G, rows, align, op_id, offsets, tiles,
                                                      st->err_word);
  GPU_TRY_CUDA(cudaGetLastError(), "group_prefix: launch");
  return TW_OK;
}

const tw_backend_ops tw_gpu_ops = {
    /* name */ "gpu",
    /* mem */ TW_MEM_DEVICE,
    /* available */ gpu_available,
    /* ctx_init */ gpu_ctx_init,
    /* ctx_fini */ gpu_ctx_fini,
    /* sync */ gpu_sync,
    /* check */ gpu_check,
    /* alloc */ gpu_alloc,
    /* free */ gpu_free,
    /* copy */ gpu_copy,
    /* memset */ gpu_memset,
    /* cast */ gpu_cast,
    /* grouped_quantize */ gpu_grouped_quantize,
    /* grouped_dequantize */ gpu_grouped_dequantize,
    /* delayed_scale_update */ gpu_delayed_scale_update,
    /* gemm_alignment */ gpu_gemm_alignment,
    /* gemm */ gpu_gemm,
    /* grouped_gemm */ gpu_grouped_gemm,
    /* grouped_gemm_wgrad */ gpu_grouped_gemm_wgrad,
    /* router */ &gpu_router,
    /* ep */ &gpu_ep,
    /* alloc_stream */ gpu_alloc_stream,
    /* free_stream */ gpu_free_stream,
    /* trim */ gpu_trim,
    /* grouped_gemm_rows */ gpu_grouped_gemm_rows,
    /* grouped_gemm_wgrad_rows */ gpu_grouped_gemm_wgrad_rows,
};
