/* The backend seam of MoE routing (internal): the router and EP entries a backend provides.
 * core/ validates every argument first (api_router.c, api_ep.c); a NULL table or entry is
 * TW_ERR_UNSUPPORTED naming the backend. */
#ifndef TWIN_CORE_BACKEND_MOE_H
#define TWIN_CORE_BACKEND_MOE_H

#include "core/backend.h"
#include "twin/tw_ep.h"
#include "twin/tw_router.h"

typedef struct tw_router_backend {
  tw_status (*fwd)(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                   tw_tensor *topk_idx, tw_tensor *topk_weights, tw_tensor *counts);
  tw_status (*bwd)(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                   const tw_tensor *topk_idx, const tw_tensor *d_topk_weights, tw_tensor *d_logits);
  /* d_logits NULL: forward (loss); else backward with d_loss */
  tw_status (*aux_loss)(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                        const tw_tensor *counts, float coeff, tw_tensor *loss, float d_loss,
                        tw_tensor *d_logits);
} tw_router_backend;

/* EP: core owns the common part of tw_ep / tw_ep_layer (validated config, sizes, the
 * layer's step state); the backend hangs its own state on impl. */
struct tw_ep {
  const struct tw_backend_ops *ops;
  tw_ctx *ctx;          /* the context it was created with */
  tw_comm *comm;        /* the EP group */
  tw_ep_config cfg;     /* recv_capacity and alignment resolved (R > 0, A >= 1) */
  int ep_size, rank, nle;
  int64_t scale_cols;   /* H / scale_block for fp8 tokens, else 0 */
  void *impl;
};

struct tw_ep_layer {
  tw_ep *ep;
  int dispatched;       /* a dispatch succeeded: combine and the backward may read the state */
  int64_t tokens;       /* T of the last dispatch */
  void *impl;
};

typedef struct tw_ep_backend {
  tw_status (*create)(tw_ep *ep); /* fills ep->impl; collective over ep->comm */
  tw_status (*destroy)(tw_ep *ep);
  tw_status (*layer_create)(tw_ep_layer *layer);
  tw_status (*layer_destroy)(tw_ep_layer *layer);
  tw_status (*dispatch)(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                        const tw_tensor *token_scales, const tw_tensor *topk_idx,
                        const tw_tensor *topk_weights, tw_tensor *recv_tokens,
                        tw_tensor *recv_scales, tw_tensor *recv_weights, tw_tensor *group_sizes,
                        tw_tensor *dropped);
  tw_status (*dispatch_by_source)(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                  const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                  const tw_tensor *topk_weights, tw_tensor *src_tokens,
                                  tw_tensor *src_scales, tw_tensor *recv_row, tw_tensor *recv_weights,
                                  tw_tensor *group_sizes, tw_tensor *dropped);
  tw_status (*combine)(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *expert_out,
                       const tw_tensor *topk_weights, tw_tensor *out);
  tw_status (*dispatch_bwd)(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_recv,
                            const tw_tensor *d_recv_weights, tw_tensor *d_tokens,
                            tw_tensor *d_topk_weights);
  tw_status (*combine_bwd)(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                           const tw_tensor *topk_weights, const tw_tensor *expert_out,
                           tw_tensor *d_expert_out, tw_tensor *d_topk_weights);
  tw_status (*combine_bwd_by_source)(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                     const tw_tensor *expert_out, tw_tensor *d_src,
                                     tw_tensor *d_topk_weights);
} tw_ep_backend;

#endif
