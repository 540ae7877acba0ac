/* twin — the common C interface: status codes, dtypes, tensors, the per-rank context.
 *
 * A short tour
 * ------------
 *   tw_ctx *ctx;
 *   tw_ctx_config cfg = TW_CTX_CONFIG_INIT;          // backend = TW_BACKEND_REF
 *   if (tw_ctx_create(&ctx, &cfg) != TW_OK) puts(tw_last_error());
 *   tw_tensor x = tw_tensor_2d(ptr, TW_BF16, M, K, TW_MEM_HOST);
 *   ... tw_grouped_quantize(ctx, &x, &group_sizes, &opts, &q) ...   (tw_quantize.h)
 *   ... tw_grouped_gemm(ctx, &lhs, &rhs, TW_OP_N, &group_sizes, &out, 0) (tw_gemm.h)
 *   tw_ctx_destroy(ctx);
 *
 * Every public function returns a tw_status. On failure, tw_last_error() holds a one-line,
 * thread-local message that names the function and the offending values, e.g.
 *   "grouped_gemm: group_sizes sum to 1030 but lhs has 1024 rows".
 * No library function aborts, asserts or exits on bad input.
 *
 * Operations are declared once (tw_quantize.h, tw_gemm.h, ...). Each backend provides them
 * under the same signature: `ref` works on host pointers, `gpu` on device pointers and the
 * context's stream. Arguments are validated once, above the backends (core/), so both
 * backends reject exactly the same inputs with exactly the same message.
 *
 * Asynchronous work (gpu): a call returns once the work is enqueued on the context's stream.
 * Bad input that can only be seen on the device (a negative group size stored in device
 * memory) sets the context's device error word; tw_ctx_check() reads it and reports it.
 */
#ifndef TWIN_TW_BASE_H
#define TWIN_TW_BASE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status ----------------------------------------------------------------------------- */
typedef enum {
  TW_OK = 0,
  TW_ERR_INVALID_ARG = 1,  /* a value out of its domain (negative size, unknown enum, G = 0) */
  TW_ERR_NULL = 2,         /* a required pointer is NULL */
  TW_ERR_SHAPE = 3,        /* shapes disagree */
  TW_ERR_DTYPE = 4,        /* a dtype the operation does not take */
  TW_ERR_ALIGNMENT = 5,    /* an alignment rule (see tw_gemm.h, tw_quantize.h) is broken */
  TW_ERR_UNSUPPORTED = 6,  /* valid request that this backend/build does not provide */
  TW_ERR_MEMORY = 7,       /* allocation failed, or a tensor lives in the wrong memory */
  TW_ERR_CUDA = 8,         /* a CUDA runtime / cuBLASLt call failed */
  TW_ERR_NCCL = 9,         /* a NCCL call failed */
  TW_ERR_DEVICE = 10,      /* bad input detected on the device (see tw_ctx_check) */
  TW_ERR_IO = 11,          /* file I/O or a malformed file (.npy) */
  TW_ERR_TIMEOUT = 12,     /* a collective did not finish in time */
  TW_ERR_INTERNAL = 13,    /* a bug in twin: please report */
  TW_STATUS_COUNT
} tw_status;

const char *tw_status_name(tw_status s); /* "TW_ERR_SHAPE" */
/* The last error message of this thread ("" after success of the call that set it); at most
 * TW_ERROR_MAX - 1 bytes. A caller that must keep it across other calls copies it into a
 * char[TW_ERROR_MAX]. */
#define TW_ERROR_MAX 1024
const char *tw_last_error(void);
/* Sets the thread-local message (printf format, cut at 1023 bytes) and returns s; for backends
 * and tools. The arguments may include tw_last_error() itself, to wrap it with context. */
tw_status tw_error(tw_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void tw_clear_error(void);

/* Propagate a non-OK status. */
#define TW_TRY(expr)                  \
  do {                                \
    tw_status tw_try_s_ = (expr);     \
    if (tw_try_s_ != TW_OK) return tw_try_s_; \
  } while (0)

/* ---- dtypes ----------------------------------------------------------------------------- */
/* Enum values only grow at the end. */
typedef enum {
  TW_F64 = 0,
  TW_F32 = 1,
  TW_BF16 = 2,
  TW_F16 = 3,
  TW_E4M3 = 4, /* fp8 E4M3FN: no infinities, one NaN per sign (0x7F/0xFF), max 448 */
  TW_E5M2 = 5, /* fp8 E5M2: IEEE-like, infinities and NaNs, max 57344 */
  TW_E8M0 = 6, /* unsigned exponent-only scale: 2^(e-127), 0xFF = NaN */
  TW_E2M1 = 7, /* fp4: max 6, no inf/NaN; packed two per byte, element 2i in the low nibble */
  TW_I32 = 8,
  TW_I64 = 9,
  TW_U8 = 10,  /* raw bytes (e.g. codes read from a file) */
  TW_U16 = 11, /* raw 16-bit codes (bf16/f16 stored in .npy files) */
  TW_DTYPE_COUNT
} tw_dtype;

const char *tw_dtype_name(tw_dtype t);    /* "bf16", "e4m3", ... (NULL if out of range) */
int tw_dtype_from_name(const char *name, tw_dtype *out); /* 0 on success, -1 if unknown */
int tw_dtype_bits(tw_dtype t);            /* 64, 32, 16, 8 or 4 (0 if out of range) */
int tw_dtype_is_float(tw_dtype t);        /* every floating format, e8m0 included */
int tw_dtype_is_fp8(tw_dtype t);          /* e4m3, e5m2 */
/* Bytes for n elements (e2m1: (n+1)/2). */
size_t tw_dtype_storage_bytes(tw_dtype t, int64_t n);

/* ---- tensors ---------------------------------------------------------------------------- */
#define TW_MAX_DIMS 4

typedef enum { TW_MEM_HOST = 0, TW_MEM_DEVICE = 1 } tw_mem;

/* Non-owning, dense, row-major. A 0-d tensor (ndim 0) has one element. data may be NULL only
 * when the tensor has zero elements. */
typedef struct {
  void *data;
  tw_dtype dtype;
  int ndim;
  int64_t shape[TW_MAX_DIMS];
  tw_mem mem;
} tw_tensor;

static inline tw_tensor tw_tensor_1d(void *p, tw_dtype t, int64_t n, tw_mem m) {
  tw_tensor x = {p, t, 1, {n, 0, 0, 0}, m};
  return x;
}
static inline tw_tensor tw_tensor_2d(void *p, tw_dtype t, int64_t r, int64_t c, tw_mem m) {
  tw_tensor x = {p, t, 2, {r, c, 0, 0}, m};
  return x;
}
static inline tw_tensor tw_tensor_3d(void *p, tw_dtype t, int64_t a, int64_t b, int64_t c,
                                     tw_mem m) {
  tw_tensor x = {p, t, 3, {a, b, c, 0}, m};
  return x;
}
/* An empty descriptor (data NULL, ndim -1): "this optional output is not requested". */
static inline tw_tensor tw_tensor_none(void) {
  tw_tensor x = {0, TW_F32, -1, {0, 0, 0, 0}, TW_MEM_HOST};
  return x;
}
static inline int tw_tensor_is_none(const tw_tensor *t) { return t == 0 || t->ndim < 0; }

int64_t tw_tensor_numel(const tw_tensor *t);
size_t tw_tensor_bytes(const tw_tensor *t);
/* "[3, 5] bf16" into buf; returns buf. */
const char *tw_tensor_str(const tw_tensor *t, char *buf, size_t n);

/* ---- context ---------------------------------------------------------------------------- */
typedef enum { TW_BACKEND_REF = 0, TW_BACKEND_GPU = 1, TW_BACKEND_COUNT } tw_backend;

const char *tw_backend_name(tw_backend b); /* "ref", "gpu" */
int tw_backend_from_name(const char *name, tw_backend *out);
/* 1 if this build contains the backend and (gpu) a device is visible. */
int tw_backend_available(tw_backend b);

typedef struct tw_ctx tw_ctx;   /* one per rank */
typedef struct tw_comm tw_comm; /* communicator of a rank (tw_comm.h, the sharding issue) */

typedef struct {
  size_t size;            /* sizeof(tw_ctx_config): lets the struct grow compatibly */
  tw_backend backend;
  int device;             /* gpu: CUDA device ordinal */
  void *stream;           /* gpu: cudaStream_t to run on; NULL = the context creates one */
  size_t workspace_bytes; /* 0 = the backend's default; the context owns the workspace */
  tw_comm *comm;          /* NULL: single rank */
  const char *kernel;     /* force a kernel version by name (tests, benches); NULL = auto */
} tw_ctx_config;

#define TW_CTX_CONFIG_INIT {sizeof(tw_ctx_config), TW_BACKEND_REF, 0, 0, 0, 0, 0}

tw_status tw_ctx_create(tw_ctx **out, const tw_ctx_config *cfg);
tw_status tw_ctx_destroy(tw_ctx *ctx); /* NULL is fine */
tw_backend tw_ctx_backend(const tw_ctx *ctx);
tw_mem tw_ctx_mem(const tw_ctx *ctx);  /* where this context's tensors must live */
tw_comm *tw_ctx_comm(const tw_ctx *ctx);
const char *tw_ctx_kernel(const tw_ctx *ctx); /* the forced kernel name or NULL */
/* A number no other context of this process has had or will have (0 for NULL): a key for
 * caches of per-context work that must not outlive the context's address. */
uint64_t tw_ctx_id(const tw_ctx *ctx);
/* Waits for the enqueued work; reports asynchronous errors (device error word, CUDA). */
tw_status tw_ctx_sync(tw_ctx *ctx);
/* tw_ctx_sync, then clears and reports the device error word (TW_ERR_DEVICE + message). */
tw_status tw_ctx_check(tw_ctx *ctx);

/* Memory in the context's space (host for ref, device for gpu). */
tw_status tw_alloc(tw_ctx *ctx, size_t bytes, void **out);
tw_status tw_free(tw_ctx *ctx, void *p);
/* tw_alloc for memory that only this context's stream uses (another stream or the host only
 * after tw_ctx_sync): gpu takes it from the device's stream-ordered pool (cudaMallocAsync on
 * the context's stream) and tw_free gives it back in stream order (cudaFreeAsync), so neither
 * waits for the device, whose every stream (NCCL's kernels waiting on peers included) a
 * cudaFree would wait for. gpu: the pool is the context's own and keeps freed memory for the
 * next allocations (a step's buffers come back without mapping them again) until tw_ctx_trim
 * or tw_ctx_destroy; a failed tw_alloc or tw_alloc_stream trims it and tries once more.
 * ref: tw_alloc. Same ledger. */
tw_status tw_alloc_stream(tw_ctx *ctx, size_t bytes, void **out);
/* Waits for the context's work, then gives the freed memory its pool keeps back to the device
 * (gpu; ref keeps none). Before measuring device memory with cudaMemGetInfo, or to hand memory
 * to another context or library. */
tw_status tw_ctx_trim(tw_ctx *ctx);
/* The context's ledger of tw_alloc / tw_free: the bytes it holds now (`live`) and the most it
 * held at once since it was created or since tw_ctx_reset_peak (`peak`), exact to the byte and
 * private to this context (no other process or context disturbs it, unlike cudaMemGetInfo).
 * Memory a backend keeps for itself (gpu: workspace, scratch, cuBLASLt, NCCL) is not counted.
 * Either pointer may be NULL. A context is driven by one thread at a time. */
tw_status tw_ctx_memory(const tw_ctx *ctx, size_t *live, size_t *peak);
tw_status tw_ctx_reset_peak(tw_ctx *ctx); /* peak = live */
/* Copies between any two tensors of equal dtype and shape (host<->device as needed);
 * ordered on the context's stream; host destinations are complete on return. */
tw_status tw_tensor_copy(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src);
/* Fills bytes with one repeated byte value (poisoning outputs before a run). */
tw_status tw_memset(tw_ctx *ctx, void *p, int byte, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif /* TWIN_TW_BASE_H */
