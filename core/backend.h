/* The backend seam (internal). A backend fills one tw_backend_ops table; the public entry
 * points in core/ validate every argument once and then call through the table, so ref and
 * gpu see only valid calls and reject nothing on their own except what only they can know
 * (alignment, device memory, device-side group sizes).
 *
 * Later areas add their entries at the end (collectives, EP routing, the pipeline scan);
 * a NULL entry means "this backend does not provide it" (TW_ERR_UNSUPPORTED, named). */
#ifndef TWIN_CORE_BACKEND_H
#define TWIN_CORE_BACKEND_H

#include "twin/tw_base.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tw_backend_ops {
  const char *name;
  tw_mem mem;
  int (*available)(void);
  tw_status (*ctx_init)(tw_ctx *ctx);
  tw_status (*ctx_fini)(tw_ctx *ctx);
  tw_status (*sync)(tw_ctx *ctx);
  tw_status (*check)(tw_ctx *ctx); /* reads and clears the device error word */
  tw_status (*alloc)(tw_ctx *ctx, size_t bytes, void **out);
  tw_status (*free)(tw_ctx *ctx, void *p);
  /* dst/src each in host or the backend's memory */
  tw_status (*copy)(tw_ctx *ctx, void *dst, tw_mem dst_mem, const void *src, tw_mem src_mem,
                    size_t bytes);
  tw_status (*memset)(tw_ctx *ctx, void *p, int byte, size_t bytes);

  tw_status (*cast)(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate);
  tw_status (*grouped_quantize)(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                                const tw_quantize_opts *opts, tw_qtensor *q);
  tw_status (*grouped_dequantize)(tw_ctx *ctx, const tw_qtensor *q,
                                  const tw_tensor *group_sizes, int colwise, tw_tensor *out);
  tw_status (*delayed_scale_update)(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                    const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                    float margin);
  tw_status (*gemm_alignment)(tw_ctx *ctx, const tw_operand *a, tw_op op_a,
                              const tw_operand *b, tw_op op_b, const tw_tensor *out);
  tw_status (*gemm)(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b,
                    tw_op op_b, tw_tensor *out, int accumulate);
  tw_status (*grouped_gemm)(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs,
                            tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                            int accumulate);
  tw_status (*grouped_gemm_wgrad)(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                  const tw_operand *rhs, tw_op rhs_op,
                                  const tw_tensor *group_sizes, tw_tensor *out, int accumulate);
  /* MoE routing (core/backend_moe.h); NULL = not provided */
  const struct tw_router_backend *router;
  const struct tw_ep_backend *ep;
  /* tw_alloc_stream's memory (NULL: alloc / free); free_stream returns it */
  tw_status (*alloc_stream)(tw_ctx *ctx, size_t bytes, void **out);
  tw_status (*free_stream)(tw_ctx *ctx, void *p);
  /* gives back the freed stream-ordered memory the backend keeps (NULL: it keeps none) */
  tw_status (*trim)(tw_ctx *ctx);
  /* row-gathered lhs (tw_gemm.h); NULL = not provided */
  tw_status (*grouped_gemm_rows)(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                 const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                                 tw_tensor *out, int accumulate);
  tw_status (*grouped_gemm_wgrad_rows)(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                       const tw_operand *rhs, tw_op rhs_op,
                                       const tw_tensor *group_sizes, tw_tensor *out, int accumulate);
} tw_backend_ops;

struct tw_ctx {
  tw_ctx_config cfg;
  const tw_backend_ops *ops;
  void *state;     /* the backend's own (gpu: stream, cuBLASLt handle, workspace, error word) */
  char kernel[64]; /* forced kernel version name, "" = auto */
  uint64_t id;     /* tw_ctx_id: from a process-wide counter, never reused */
  /* tw_alloc's ledger: open addressing on the pointer, tombstones for freed slots */
  struct tw_ledger_slot *ledger;
  size_t ledger_cap, ledger_used; /* used counts live slots and tombstones */
  size_t live_bytes, peak_bytes;
};

/* Each backend library defines its table; core references them weakly, so a binary has the
 * backends it links (//ref:ref, //gpu:gpu). */
extern const tw_backend_ops tw_ref_ops;
extern const tw_backend_ops tw_gpu_ops;

#ifdef __cplusplus
}
#endif
#endif
