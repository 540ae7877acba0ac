/* twin sharding rules for MoE routing (router, ep_dispatch, ep_combine), in plan form: a rule
 * takes the mesh, the global shapes and the callers' specs, and returns the local shapes, the
 * EP groups and the output specs, or an error naming the broken rule. Plans print and are
 * unit-tested without running anything (like tw_shard.h's plans; a separate struct so the
 * GEMM/quantize plans are untouched).
 *
 * Tokens x [T, H], topk_idx [T, k], topk_weights [T, k] (te-semantics.md §3.3):
 *   ep.leading_dim_only   only dim 0 may be sharded; H and k are replicated.
 *   ep.specs_equal        the three dim-0 specs are equal.
 *   ep.axes               dim 0 is sharded by ep, or by a tuple of axes in {dp, fsdp, ep}.
 *   ep.needs_ep           ep is in that tuple (a mesh without ep: use ep=1).
 *   ep.ep_innermost       ep is the tuple's last (minor) axis, so an EP group's token shards
 *                         are contiguous and in ep order.
 *   ep.experts_divisible  E % |ep| == 0.
 *   (spec checks)         T divisible by the shard count, axes known to the mesh, none twice.
 * EP groups: the ranks that share every non-ep mesh coordinate (an ep x tp mesh of 8 ranks,
 * ep=4 tp=2: {0, 2, 4, 6} and {1, 3, 5, 7}); the ep coordinate is the rank in the group, the
 * group's tokens are the shards (outer index, ep = 0 .. |ep|-1). Axes of the mesh outside
 * the spec (tp) hold replicas: each replica group routes the same tokens.
 * Outputs: dispatch's recv buffers are [|outer| * |ep| * R, H] globally, sharded
 * [(outer..., ep), None]; combine's output and dispatch_bwd's d_tokens take x's spec.
 * router  logits [T, E]:
 *   router.experts_replicated  E is not sharded; dim 0 takes any spec (the router is per
 *                              token). The aux loss needs the global T: a note says its
 *                              sums over tokens are all-reduced over dim 0's axes.
 */
#ifndef TWIN_TW_SHARD_EP_H
#define TWIN_TW_SHARD_EP_H

#include "twin/tw_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TW_EP_OP_ROUTER = 0, TW_EP_OP_DISPATCH = 1, TW_EP_OP_COMBINE = 2, TW_EP_OP_COUNT } tw_ep_op;
const char *tw_ep_op_name(tw_ep_op op); /* "router", "ep_dispatch", "ep_combine" */
int tw_ep_op_from_name(const char *name, tw_ep_op *out);

typedef struct {
  tw_ep_op op;
  tw_mesh mesh;
  int64_t tokens, hidden;   /* router: hidden = E */
  int num_experts, topk;
  tw_pspec x_spec;          /* as given: x (dispatch/combine) or logits (router) */
  tw_dimspec outer;         /* dim 0's axes before ep */
  int ep_size, num_groups;  /* |ep|, |outer| */
  int replicas;             /* ranks holding the same token shard (axes outside the spec) */
  int64_t local_tokens;     /* T / (|outer| * |ep|) */
  tw_pspec recv_spec;       /* dispatch output */
  tw_pspec out_spec;        /* combine output / d_tokens */
  int nnotes;
  char notes[4][160];
} tw_ep_plan;

/* x_spec/idx_spec/w_spec: the specs of tokens (or logits), topk_idx and topk_weights (the
 * latter two ignored for the router; NULL = the same as x). */
tw_status tw_ep_plan_make(const tw_mesh *mesh, tw_ep_op op, int64_t tokens, int64_t hidden,
                          int num_experts, int topk, const tw_pspec *x_spec,
                          const tw_pspec *idx_spec, const tw_pspec *w_spec, tw_ep_plan *plan);
const char *tw_ep_plan_format(const tw_ep_plan *plan, char *buf, size_t n);
/* The EP group of a rank (0 .. groups-1, counting replicas apart) and its rank inside it. */
int tw_ep_plan_group(const tw_ep_plan *plan, int rank, int *ep_rank);
/* The token shard a rank holds (0 .. |outer|*|ep| - 1). */
int tw_ep_plan_shard(const tw_ep_plan *plan, int rank);

#ifdef __cplusplus
}
#endif
#endif
