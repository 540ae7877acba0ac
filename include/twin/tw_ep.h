/* twin expert parallelism: dispatch tokens to the ranks that own their experts, combine the
 * expert outputs back, and the backward of both (TE ep.h semantics, te-semantics.md §4).
 *
 * One EP group = the ep_size ranks of one communicator (tw_shard.h derives it from a mesh: the
 * ranks that share every non-ep coordinate). E experts, E % ep_size == 0, NLE = E / ep_size
 * local experts per rank; expert e lives on rank e / NLE as local expert l = e % NLE.
 *
 * Lifetime. tw_ep_create (collective over the group) takes the worst-case sizes once and
 * allocates everything; tw_ep_workspace_bytes() says how much, for a caller that budgets
 * memory. A layer handle (tw_ep_layer) holds the routing state of one layer's step: dispatch
 * writes it, combine / dispatch_bwd / combine_bwd read it. Give every MoE layer its own
 * handle (two layers sharing one is the bug TE's review found); handles are independent, so
 * layers may interleave in any order. Per-step calls allocate nothing (gpu: capturable in a
 * CUDA graph; every size that depends on the routing stays in device memory).
 *
 * Every operation is collective over the group: each rank calls it for the same layer in the
 * same order and asks for the same optional outputs (d_topk_weights, d_recv_weights), since
 * those decide the steps the ranks take together.
 * Per rank r with T_r tokens (0 <= T_r <= max_tokens; T may differ between ranks, 0 too):
 *   count[r][l][s] = #{(t, j) on source rank s : topk_idx_s[t, j] == r*NLE + l}
 *   count[r][l]    = sum_s count[r][l][s]        (a token sent to two experts counts twice)
 * Receive layout of rank r (R = recv_capacity rows, A = alignment >= 1, R % A == 0):
 *   expert-major slabs; slab l starts at O_l = sum_{l' < l} padded_l', and holds kept_l
 *   routed rows followed by padded_l - kept_l zero rows, padded_l = roundup(kept_l, A)
 *   (an empty expert has padded 0). Rows O_NLE .. R-1 are zero too: dispatch writes every row.
 *   Within a slab the order is fixed: by source rank, then token t, then j (so the oracle is
 *   reproducible; the gpu twin may be compared per slab as a multiset).
 *   group_sizes [NLE] i32 = padded_l: exactly tw_grouped_gemm's group_sizes for the recv rows
 *   (lhs [R, H]), in the context's memory: dispatch -> grouped GEMM needs no host step.
 *   recv_weights [R] f32: topk_weights of the route that produced the row; 0 on padding.
 * Capacity (no silent drops): kept_l = count[r][l] when everything fits in R. Otherwise
 *   TW_EP_OVERFLOW_ERROR: every rank of the group returns TW_ERR_INVALID_ARG naming the rank,
 *     its demand sum_l roundup(count, A) and R; nothing is written.
 *   TW_EP_OVERFLOW_DROP: slabs are filled in order l = 0, 1, ...; kept_l = min(count, R - O_l);
 *     the last (source, t, j) rows of the slab are dropped, and dropped [NLE] i32 (required
 *     under this policy) reports count - kept per local expert. A dropped route contributes
 *     nothing to combine and gets zero gradients.
 *
 * dispatch:     recv_tokens[O_l + i] = tokens_s[t] for the i-th kept route (s, t, j) of slab l.
 *               Tokens are f32, bf16, e4m3 or e5m2 (cfg.token_dtype). fp8 tokens carry their
 *               row scales (token_scales [T, H / scale_block] f32 or e8m0; 1x128: block 128,
 *               MXFP8: block 32), which travel with the rows into recv_scales [R, H/block].
 *               With cfg.scales_gemm_layout = 1 (1x128 only) the scales arrive instead in
 *               the layout tw_grouped_gemm reads for a rowwise BLOCK_1x128 operand
 *               (tw_quantize.h, "MN-major"): recv_scales [H/128, roundup(R, 4)] f32,
 *               element [b][i] = the row-layout element [i][b]; padding rows, the rows past
 *               the slabs and the tail columns R .. roundup(R, 4)-1 are 0. So the operand
 *               {data = recv_tokens, mode TW_SCALE_BLOCK_1x128, scale_inv = recv_scales,
 *               src_rows = R, src_cols = H} with group_sizes goes straight into the GEMM.
 *               MXFP8 (scale_block 32) with the option: recv_scales arrive in the layout
 *               tw_grouped_gemm reads for a rowwise MXFP8_1D operand quantized by the groups
 *               group_sizes = padded_l (tw_quantize.h "Scale layouts"): with
 *               T(l) = sum_{l' < l} ceil(padded_l' / 128), slab l owns the E8M0 block
 *               [128 * ceil(padded_l / 128), C] starting at row 128 * T(l), C = roundup(H/32, 4);
 *               block row i < padded_l holds the scale row of recv row O_l + i (0x00 for a
 *               padding row), rows padded_l .. and columns H/32 .. C-1 are 0x00. The bytes are
 *               ordered compact (cfg.scales_mxfp8_swizzled = 0: each block row-major) or
 *               swizzled (1: cuBLAS's 128x4 tiling per block, tw_quantize.h's formula).
 *               recv_scales is [128 * T_cap, C] E8M0, T_cap = floor((R + 127 * min(NLE, R)) / 128)
 *               (tw_ep_recv_scales_shape; tw_quantize_output_shapes' T_cap for M = R, G = NLE);
 *               the rows past the last slab's block, 128 * T(NLE) .. 128 * T_cap - 1, are 0x00
 *               (dispatch writes every byte, as every row of recv_tokens). So the operand
 *               {data = recv_tokens, mode TW_SCALE_MXFP8_1D, scale_inv = recv_scales,
 *               mxfp8_swizzled = cfg.scales_mxfp8_swizzled, src_rows = R, src_cols = H} with
 *               group_sizes goes straight into the GEMM. The gpu derives T(l) on the device
 *               (no host read: capturable). A non-fp8 token_dtype with the option, or
 *               scales_mxfp8_swizzled = 1 without MXFP8 and the option, is TW_ERR_INVALID_ARG.
 * combine:      out[t] = sum_{j = 0..k-1, route kept} w[t, j] * y[slot(t, j)], accumulated in
 *               f32 in that order and rounded once to out's dtype; w = topk_weights [T, k], or
 *               unweighted (weights = none, w = 1: TE's form, where the caller weights y).
 *               y = expert_out [R, H], out [T, H], both f32 or both bf16.
 * dispatch_bwd: d_tokens[t] = sum_j d_recv[slot(t, j)] (f32, j order, rounded once);
 *               d_topk_weights[t, j] = d_recv_weights[slot(t, j)] (optional); dropped
 *               routes give 0.
 * combine_bwd:  d_expert_out[slot(t, j)] = w[t, j] * d_out[t] (w = 1 unweighted), padding
 *               and unused rows 0; d_topk_weights[t, j] = sum_h d_out[t, h] * y[slot, h] (f32,
 *               weighted form only; needs expert_out; a dropped route gives 0), summed in
 *               the warp order, for any H: p_h = f32(d_out[t, h] * y[slot, h]) (rounded, never
 *               fused into an FMA); 32 partials P[0..31] start at +0 and P[l] adds the p_h
 *               with (h / 8) % 32 == l one at a time in increasing h; then for m = 16, 8, 4,
 *               2, 1 and every l < m: P[l] = P[l] + P[l + m]; the sum is P[0]. One f32
 *               rounding per add (a warp: lane l's 8-wide chunks, then a shuffle tree).
 *
 * Rows by source (tw_ep_dispatch_by_source): the same routing, slabs, group sizes, weights and
 * drops as dispatch, but the token rows are not copied into the expert-major layout: they
 * arrive once per (source rank, token), and a row map says which one each expert-major row
 * stands for. The grouped GEMM reads them through the map (tw_grouped_gemm_rows), so the
 * T k H bytes of expert-major rows are never written (DeepEP's and NCCL EP's high-throughput
 * dispatch return tokens by source too; there a permute kernel then writes them).
 *   U = ep_size * max_tokens (tw_ep_source_rows). src_tokens [U, H]: row s * max_tokens + t
 *   holds tokens_s[t] when at least one kept route of token t of source rank s lands on this
 *   rank, else zeros (every row is written). recv_row [R] i32: recv_row[i] = the src_tokens row
 *   of expert-major row i, so recv_tokens[i] of dispatch == src_tokens[recv_row[i]]; -1 on
 *   padding rows and the rows past the slabs (where dispatch writes zeros).
 *   fp8: src_scales hold the scale rows the same way, [U, H/block]; with scales_gemm_layout = 1
 *   in the grouped GEMM's rowwise layout of the [U, H] source quantized as one group
 *   (tw_quantize.h): 1x128 [H/128, roundup(U, 4)] f32, element [b][u] = scale b of row u;
 *   MXFP8 [128 * ceil(U/128), roundup(H/32, 4)] E8M0 (T_cap for M = U, G = 1), row u = the scale
 *   row of row u, compact or swizzled (cfg.scales_mxfp8_swizzled); zeros elsewhere
 *   (tw_ep_source_scales_shape). combine, dispatch_bwd and combine_bwd after it are those of
 *   dispatch (their expert-major rows are the GEMM outputs, [R, H]).
 * combine_bwd by source (tw_ep_combine_bwd_by_source, after either dispatch of the step): the
 *   way in of combine_bwd without its T k H bytes of expert-major rows. d_src [U, H] (d_out's
 *   dtype): row s * max_tokens + t = d_out_s[t] when at least one kept route of token t of source
 *   rank s lands on this rank, else zeros (every row is written), so with the step's recv_row
 *   and recv_weights (tw_ep_dispatch_by_source): combine_bwd's d_expert_out[i] =
 *   f32(recv_weights[i] * d_src[recv_row[i]]) rounded to d_out's dtype (weighted form with the
 *   dispatched weights; unweighted: d_src[recv_row[i]] itself), 0 where recv_row[i] = -1. A
 *   grouped GEMM reads d_src through recv_row and scales its output rows by recv_weights
 *   (row scaling commutes with the product). d_topk_weights (optional, needs expert_out) is
 *   combine_bwd's, bit for bit (the same dots in the same warp order). After a plain dispatch
 *   the map is the one tw_ep_dispatch_by_source returns for the same routing (the op reads the
 *   layer's routing state, whichever dispatch made it).
 *
 * Errors: E % ep_size, k < 1 or k > E, T > max_tokens, H % scale block (fp8), R % A, A not a
 * power of two, an expert id < 0 or >= E (token, slot and id named), the same id twice in one
 * token's top-k (rejected: TE would count and store it twice; twin's router never makes it),
 * dtype or shape mismatches, capacity under the error policy, d_topk_weights without the tensor
 * its dots need (combine_bwd: topk_weights and expert_out; by source: expert_out).
 */
#ifndef TWIN_TW_EP_H
#define TWIN_TW_EP_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TW_EP_OVERFLOW_ERROR = 0, TW_EP_OVERFLOW_DROP = 1 } tw_ep_overflow;

typedef struct {
  size_t size;            /* sizeof(tw_ep_config) */
  int num_experts;        /* E */
  int topk;               /* k (every layer of this context) */
  int64_t max_tokens;     /* per rank */
  int64_t hidden;         /* H */
  tw_dtype token_dtype;   /* f32, bf16, e4m3, e5m2 */
  int scale_block;        /* fp8 only: 128 (1x128, f32 scales) or 32 (MXFP8, e8m0 scales) */
  int64_t recv_capacity;  /* R rows per rank; 0 = tw_ep_capacity_no_drop(): nothing can drop */
  int64_t alignment;      /* A: per-expert slab alignment, power of two; 0 or 1 = none */
  tw_ep_overflow overflow;
  int scales_gemm_layout; /* fp8: 0 = recv_scales [R, H/block] (rows); 1 = the grouped GEMM's rowwise
                             layout: 1x128 [H/128, roundup(R, 4)], MXFP8 [128*T_cap, roundup(H/32, 4)]
                             per-slab blocks (see dispatch above) */
  int scales_mxfp8_swizzled; /* MXFP8 with scales_gemm_layout = 1: 0 compact, 1 swizzled byte order
                                (tw_operand.mxfp8_swizzled); else 0 */
} tw_ep_config;

#define TW_EP_CONFIG_INIT {sizeof(tw_ep_config), 0, 1, 0, 0, TW_BF16, 0, 0, 1, TW_EP_OVERFLOW_ERROR, 0, 0}

typedef struct tw_ep tw_ep;             /* one EP group on one rank */
typedef struct tw_ep_layer tw_ep_layer; /* one layer's routing state */

/* The smallest R that never drops, for distinct ids per token:
 * roundup(ep_size * max_tokens * min(k, NLE) + NLE * (A - 1), A); 0 for a config with no such
 * R (ep_size < 1, E < ep_size, k < 1, max_tokens < 0, or sizes past 9e15). */
int64_t tw_ep_capacity_no_drop(const tw_ep_config *cfg, int ep_size);
/* Shape and dtype of recv_scales for an fp8 cfg on ep_size ranks (recv_capacity 0 resolved as
 * tw_ep_create does): [R, H/block], or with scales_gemm_layout = 1: [H/128, roundup(R, 4)] f32
 * (1x128), [128 * T_cap, roundup(H/32, 4)] E8M0 (MXFP8). Non-fp8 tokens: TW_ERR_INVALID_ARG. */
tw_status tw_ep_recv_scales_shape(const tw_ep_config *cfg, int ep_size, int64_t shape[2], tw_dtype *dtype);
/* Bytes tw_ep_create allocates (workspace) and each tw_ep_layer_create allocates, at most: the
 * larger of what the ref backend and the gpu backend (either EP version; ep_nccl_lsa's symmetric
 * window included, which twin rounds up to 2 MiB) ask for, before the allocators' own rounding.
 * Sizes past 9e15 bytes: TW_ERR_SHAPE naming them. */
tw_status tw_ep_workspace_bytes(const tw_ep_config *cfg, int ep_size, size_t *workspace,
                                size_t *layer_state);

/* Collective over comm (every rank passes the same cfg). ctx: this rank's context. */
tw_status tw_ep_create(tw_ctx *ctx, tw_comm *comm, const tw_ep_config *cfg, tw_ep **out);
tw_status tw_ep_destroy(tw_ep *ep); /* NULL is fine */
tw_status tw_ep_layer_create(tw_ep *ep, tw_ep_layer **out);
tw_status tw_ep_layer_destroy(tw_ep_layer *layer); /* NULL is fine */
/* R and NLE of the context (recv buffers are [R, H], group sizes [NLE]). */
int64_t tw_ep_recv_capacity(const tw_ep *ep);
int tw_ep_local_experts(const tw_ep *ep);

/* tokens [T, H], token_scales [T, H/block] (fp8) or none, topk_idx [T, k] i32,
 * topk_weights [T, k] f32 -> recv_tokens [R, H], recv_scales [R, H/block] (scales_gemm_layout:
 * tw_ep_recv_scales_shape) or none,
 * recv_weights [R] f32, group_sizes [NLE] i32, dropped [NLE] i32 (required under DROP,
 * else optional; zeros when nothing was dropped). */
tw_status tw_ep_dispatch(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                         const tw_tensor *token_scales, const tw_tensor *topk_idx,
                         const tw_tensor *topk_weights, tw_tensor *recv_tokens,
                         tw_tensor *recv_scales, tw_tensor *recv_weights,
                         tw_tensor *group_sizes, tw_tensor *dropped);
/* U = ep_size * max_tokens: the rows of src_tokens (0 for a config tw_ep_create refuses). */
int64_t tw_ep_source_rows(const tw_ep *ep);
/* Shape and dtype of src_scales for an fp8 cfg on ep_size ranks: [U, H/block], or with
 * scales_gemm_layout = 1: [H/128, roundup(U, 4)] f32 (1x128), [128 * ceil(U/128),
 * roundup(H/32, 4)] E8M0 (MXFP8). Non-fp8 tokens: TW_ERR_INVALID_ARG. */
tw_status tw_ep_source_scales_shape(const tw_ep_config *cfg, int ep_size, int64_t shape[2], tw_dtype *dtype);
/* Rows by source (above): the arguments of tw_ep_dispatch with src_tokens [U, H],
 * src_scales (fp8: tw_ep_source_scales_shape) or none, recv_row [R] i32 in place of
 * recv_tokens and recv_scales. */
tw_status tw_ep_dispatch_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                   const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                   const tw_tensor *topk_weights, tw_tensor *src_tokens,
                                   tw_tensor *src_scales, tw_tensor *recv_row,
                                   tw_tensor *recv_weights, tw_tensor *group_sizes,
                                   tw_tensor *dropped);
/* expert_out [R, H], topk_weights [T, k] f32 or none (unweighted) -> out [T, H]. */
tw_status tw_ep_combine(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *expert_out,
                        const tw_tensor *topk_weights, tw_tensor *out);
/* d_recv [R, H] f32/bf16, d_recv_weights [R] f32 or none -> d_tokens [T, H] (same dtype as
 * d_recv), d_topk_weights [T, k] f32 or none. */
tw_status tw_ep_dispatch_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_recv,
                             const tw_tensor *d_recv_weights, tw_tensor *d_tokens,
                             tw_tensor *d_topk_weights);
/* d_out [T, H], topk_weights [T, k] or none, expert_out [R, H] (needed when d_topk_weights
 * is requested) -> d_expert_out [R, H] (d_out's dtype), d_topk_weights [T, k] f32 or none. */
tw_status tw_ep_combine_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                            const tw_tensor *topk_weights, const tw_tensor *expert_out,
                            tw_tensor *d_expert_out, tw_tensor *d_topk_weights);

/* combine_bwd by source (above): d_out [T, H] f32/bf16, expert_out [R, H] (needed when
 * d_topk_weights is requested, else none) -> d_src [U, H] (d_out's dtype), d_topk_weights
 * [T, k] f32 or none. */
tw_status tw_ep_combine_bwd_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                      const tw_tensor *expert_out, tw_tensor *d_src,
                                      tw_tensor *d_topk_weights);

#ifdef __cplusplus
}
#endif
#endif
