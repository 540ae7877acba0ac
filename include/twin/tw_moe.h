/* twin MoE block: router -> dispatch -> grouped FFN -> combine, forward and a hand-written
 * backward (TransformerEngine's moe.py semantics, te-semantics.md §3.4 and §4.4), written once
 * over twin's interface (moe/): the same code runs on every backend that provides the router,
 * EP and grouped GEMM ops.
 *
 * Shapes, per rank (T_r local tokens, E experts, NLE = E / ep local experts, R = the EP
 * receive capacity, k = router.topk):
 *   x [T_r, H]            tokens; the rank's shard of the global [T, H] batch
 *   gate [H, E]           replicated
 *   wi [NLE, H, 2F]       gate and up projections stacked on the last dim (cols 0..F-1: gate)
 *   wo [NLE, F, H]
 *   bi [NLE, 2F], bo [NLE, H]  f32, optional: both or neither
 *
 * Forward (rows of the EP receive buffer, group g = local expert of the row):
 *   logits = x @ gate                                  f32 [T_r, E]
 *   idx, w, counts = router(logits)                    tw_router.h; counts summed over ranks
 *   recv, recv_w, gs = dispatch(x, idx, w)             tw_ep.h (expert-major, padded slabs)
 *   h   = recv @ wi[g] + bi[g]                         f32 [R, 2F] (GEMM f32, bias in f32)
 *   a   = act(h[:, :F]) * h[:, F:]                     act: silu (SwiGLU), gelu tanh form
 *                                                      (GeGLU) or identity (bilinear)
 *   EARLY weighting: a *= recv_w  (padding rows have recv_w = 0 and h = bias, so a = 0)
 *   eo  = a @ wo[g] + bo[g]
 *   out = combine(eo, LATE ? w : none)                 out[t] = sum_j w_tj eo[slot(t, j)]
 *   aux = router aux loss on the global batch (coeff aux_coeff; 0 = none): the sums over
 *         tokens and the counts are all-reduced over the token ranks.
 * Backward, given d_out [T_r, H] and d_aux (scalar), by hand (moe/block.c):
 *   d_eo, d_w(late) = combine_bwd(d_out, w, eo)        eo saved (late weighting only)
 *   a is recomputed from h (FP8_*: its colwise fp8 copy is saved);  d_bo = sum of d_eo's rows
 *   d_a = d_eo @ wo[g]^T;  d_wo = a^T d_eo (per group; an expert with no rows: exact 0)
 *   EARLY: d_recv_w[row] = sum_f d_a * a_unweighted;  d_a *= recv_w
 *   d_h = act_bwd(h, d_a);  d_bi = sum of d_h rows;  d_wi = recv^T d_h
 *   d_recv = d_h @ wi[g]^T;  d_x_disp, d_w(early) = dispatch_bwd(d_recv, d_recv_w)
 *   d_logits = router_bwd(d_w) + d_aux * aux_loss_bwd
 *   d_x = d_x_disp + d_logits @ gate^T (one rounding to x's dtype);  d_gate = x^T d_logits
 *   d_gate is all-reduced over every token rank, d_wi/d_wo/d_bi/d_bo over dp and fsdp (the
 *   ranks with the same experts and other tokens; fsdp: see Sharding). Weight gradients are
 *   overwritten, in the weights' (sharded) shapes: d_gate, d_bi, d_bo f32; d_wi and d_wo f32,
 *   or both bf16 in the recipes with bf16 weights (TransformerEngine's gradient in the
 *   parameter's dtype, half the bytes to write): each bf16 element is the f32 gradient of the
 *   same step rounded once (RNE) after the sums over dp and fsdp; with neither, the wgrad
 *   GEMMs round their own f32 results (the same bits, tw_gemm.h).
 * Elementwise math (act, its backward, bias, weighting) is done in double and rounded once to
 * f32 (then to bf16 where the recipe keeps bf16), like pipeline/dense.c.
 *
 * Recipes (the dtype of x, out, d_x, gate, wi, wo and of what crosses the EP wire):
 *   F32   everything f32.
 *   BF16  x, out, d_out, d_x, gate, wi, wo bf16; recv and d_recv bf16 (dispatched as bf16);
 *         a and d_h rounded to bf16 before their GEMMs, eo rounded to bf16 before combine;
 *         logits, h, d_a f32; every weight gradient f32, but d_wi and d_wo bf16 when the
 *         caller gives bf16 tensors for them (see Backward).
 *   FP8_CURRENT, FP8_BLOCK, FP8_MXFP8  the BF16 recipe, with each of the six expert GEMMs
 *         (forward h and eo, dgrad d_a and d_recv, wgrad d_wo and d_wi) on e4m3 operands made
 *         by tw_grouped_quantize (tw_quantize.h): the activations recv, a, d_eo, d_h by the
 *         expert group sizes, the weights wi, wo as [NLE*H, 2F] and [NLE*F, H] sources in
 *         uniform groups of H and F rows (one scale set per expert). Scaling:
 *           FP8_CURRENT  per-group current scaling (tensor scales per expert);
 *           FP8_BLOCK    activations 1x128 blocks, weights 128x128 tiles (DeepSeek-V3);
 *           FP8_MXFP8    MXFP8 blocks of 32 (E8M0 scales) for every operand.
 *         Each GEMM reads the orientation that puts the blocks on its contracting dim:
 *           h  = rowwise(recv) @ wi        colwise(wi), [2F, H] per expert (rhs op T; MXFP8: op N)
 *           eo = rowwise(a) @ wo           colwise(wo)
 *           d_a    = rowwise(d_eo) @ rowwise(wo)^T      d_recv = rowwise(d_h) @ rowwise(wi)^T
 *           d_wo_g = colwise(a)^T colwise(d_eo)         d_wi_g = colwise(recv)^T colwise(d_h)
 *         The gate GEMMs, the router and every elementwise step stay as in BF16. Extra state:
 *         the fp8 copies of wi and wo (both orientations) made by the forward are kept for the
 *         backward, and recv is kept as its colwise fp8 copy instead of bf16.
 *   Error budget against an exact (f64) model, asserted by tests/moe_golden_test.c: F32 within
 *   c * (H + 2F + k + 16) * 2^-24 * (|exact| + rms) per element, where the GEMM sums of
 *   lengths H, F and 2F dominate (c = 1 forward, c = 1 + T/min(T, H) for weight gradients
 *   whose sums run over tokens); BF16 within 8 * 2^-8 * (|exact| + rms) forward and
 *   16 * 2^-8 * (|exact| + rms) for gradients: about eight bf16 roundings on any path
 *   (recv, a, eo, out; d_out, d_eo, d_h, d_recv, d_x) and their growth through one GEMM.
 *   FP8_*: the BF16 budget plus q * 2^-4 * (|exact| + rms), 2^-4 the unit roundoff of e4m3
 *   (3 mantissa bits; every scale keeps the block's values in e4m3's normal range but for
 *   values below 2^-6 of the block's amax) and q the fp8 quantizations on the longest path
 *   times 2 for their growth through a GEMM: q = 8 forward (recv, wi, a, wo), 16 for
 *   gradients (those four plus d_eo, d_h and the other orientation of the weights).
 *
 * Saved between forward and backward (per rank, worst case; x is not saved: the backward
 * takes it again), with T = max_tokens, s = 2 (BF16) or 4 (F32) bytes:
 *   logits 4*T*E, idx + w 8*T*k, counts 4*E, the EP layer state (tw_ep_workspace_bytes),
 *   recv s*R*H, recv_w 4*R, group sizes 4*NLE, h 4*R*2F, eo s*R*H (LATE weighting only).
 *   FP8_*: recv's colwise fp8 copy with its scales instead of recv, a's colwise fp8 copy with its
 *   scales (for d_wo, instead of recomputing a and quantizing it again), plus the fp8 copies of
 *   wi and wo (both orientations, with scales) (tw_quantize_output_shapes gives each size; the
 *   activations' colwise copies, read only by the wgrads, are token-padded where the mode has
 *   that layout (FP8_CURRENT, FP8_BLOCK): [H or F, 128*T_cap] codes, T_cap the tile bound of R
 *   rows in NLE groups).
 *   fsdp > 1: the gathered wi and wo, s*NLE*H*2F + s*NLE*F*H (scratch: f32 gradients of the
 *   same sizes and one f32 staging buffer of the larger). With fp8_gather they are not kept:
 *   the fp8 copies above are the gathered weights (scratch: the shard's fp8 copies too).
 *   tw_moe_saved_bytes() returns the sum. bf16 d_wi / d_wo with dp or fsdp > 1: f32 copies of
 *   the shards' gradients, 4*NLE*(H/fsdp)*3F, allocated by the first such backward and kept
 *   (so run one such step before capturing the block in a CUDA graph).
 *   Scratch for one call (not kept): 4*R*H (f32 GEMM
 *   output) + s*R*F (a) + 4*R*F (d_a) + s*R*2F (d_h) + s*R*H (d_eo, d_recv) + 8*T*E + 8*T*k + 4*R.
 *
 * Sharding (tw_moe_create's mesh): axes dp, fsdp and ep (tp, pp, cp: TW_ERR_UNSUPPORTED
 * naming the axis). Every rank holds its own token shard (x's dim 0 split over (dp, fsdp, ep),
 * ep innermost), the local experts of its ep coordinate, and the gate. The EP group is the ep
 * axis (a one-rank group for ep = 1). fsdp (size f, H % f == 0 or TW_ERR_INVALID_ARG) shards
 * the expert weights on H: a rank holds wi [NLE, H/f, 2F] (rows c*H/f.. of each expert, c its
 * fsdp coordinate) and wo [NLE, F, H/f] (columns c*H/f..); bi, bo and the gate are whole. The
 * forward all-gathers wi and wo over fsdp (in the weights' dtype; the fp8 recipes quantize
 * the gathered weights) and keeps them for the backward, which reduce-scatters d_wi and d_wo
 * over fsdp back to the shards (then sums them over dp) and all-reduces d_bi and d_bo over
 * fsdp and dp.
 *   fp8_gather = 1 (the FP8_* recipes, else TW_ERR_INVALID_ARG; ignored when fsdp = 1):
 *   quantize before the all-gather. Each rank quantizes its shard of wi and wo in both
 *   orientations the GEMMs read, and the e4m3 codes and their scales travel instead of bf16;
 *   each rank's GEMMs then read the gathered codes and scales (laid out again locally with
 *   copies), which are exactly those of quantizing the gathered weights: results are
 *   bit-identical to fp8_gather = 0.
 *     FP8_CURRENT: each rank takes its shard's per-expert amax, the amax is max-reduced over
 *       fsdp, the scales come from it (tw_scale_from_amax) and the shard is quantized with
 *       them (the delayed form). Any H % fsdp == 0 works; the scales do not travel.
 *     FP8_BLOCK (weights in 128x128 tiles) and FP8_MXFP8 (blocks of 32; scales in the
 *       swizzled 128x4 tiles): a shard's blocks must be whole blocks of the gathered weight
 *       and its scale tiles whole tiles of the gathered scale layout, so these need
 *       H / fsdp % 128 == 0 (else TW_ERR_INVALID_ARG naming H, fsdp and H / fsdp; for MXFP8,
 *       H / fsdp % 32 == 0 would give the right scale values, but not whole 128-row / 4-column
 *       scale tiles). The shard is then quantized on its own: its scales are already the
 *       gathered weight's.
 *   What travels, per rank and forward (s = 2 bytes of bf16): codes NLE*(H/fsdp)*3F bytes
 *   per orientation, both orientations, so 2 * NLE*(H/fsdp)*3F = the s * NLE*(H/fsdp)*3F of
 *   the bf16 gather (the colwise codes of tensor and 128x128 scaling are the transpose of the
 *   rowwise ones, but twin gathers both rather than transposing bytes locally), plus the
 *   scales: FP8_CURRENT none (NLE f32 amax are max-reduced instead); FP8_BLOCK one f32 per
 *   128x128 tile per orientation, 4 * NLE*(H/fsdp)/128 * (ceil(2F/128) + ceil(F/128)) bytes
 *   (wo's colwise array travels whole, with its fewer than NLE spare slots per 128 columns);
 *   FP8_MXFP8 one byte per 32 codes per orientation, with 2F and F rounded up to multiples
 *   of 128 (the layouts' padding). What it saves: each rank quantizes 1/fsdp of the weights
 *   instead of all of them, and no bf16 copy of the gathered weights is kept for the backward.
 *
 * Layers: each tw_moe is one layer with its own EP state and residuals, so layers interleave
 * freely (fwd L1, fwd L2, bwd L2, bwd L1 equals each alone, bit for bit).
 *
 * Errors (each names the values): E, H, F, k, max_tokens, global_tokens, recipe, act,
 * weighting out of range; a mesh with another axis, a rank count unlike ctx's communicator, a
 * context without a communicator, E % ep, H % fsdp, fp8_gather with a non-fp8 recipe or (block
 * and MXFP8 recipes) H / fsdp % 128; weights or tokens of the wrong shape or dtype; one
 * bias without the other (the missing one named); d_wi and d_wo in different dtypes, or bf16
 * with the F32 recipe; T_r > max_tokens; backward before forward;
 * everything the router, EP and GEMM ops reject (their message, prefixed with the step).
 */
#ifndef TWIN_TW_MOE_H
#define TWIN_TW_MOE_H

#include "twin/tw_base.h"
#include "twin/tw_router.h"
#include "twin/tw_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TW_MOE_SWIGLU = 0, TW_MOE_GEGLU = 1, TW_MOE_BILINEAR = 2, TW_MOE_ACT_COUNT } tw_moe_act;
typedef enum { TW_MOE_WEIGHT_LATE = 0, TW_MOE_WEIGHT_EARLY = 1, TW_MOE_WEIGHTING_COUNT } tw_moe_weighting;
typedef enum {
  TW_MOE_F32 = 0,
  TW_MOE_BF16 = 1,
  TW_MOE_FP8_CURRENT = 2,
  TW_MOE_FP8_BLOCK = 3,
  TW_MOE_FP8_MXFP8 = 4,
  TW_MOE_RECIPE_COUNT
} tw_moe_recipe;

const char *tw_moe_act_name(tw_moe_act a);             /* "swiglu", "geglu", "bilinear" */
const char *tw_moe_weighting_name(tw_moe_weighting w); /* "late", "early" */
const char *tw_moe_recipe_name(tw_moe_recipe r); /* "f32", "bf16", "fp8_current", "fp8_block", "fp8_mxfp8" */
int tw_moe_recipe_from_name(const char *name, tw_moe_recipe *out); /* 1 if known */

typedef struct {
  size_t size;               /* sizeof(tw_moe_config) */
  int num_experts;           /* E */
  int64_t hidden;            /* H */
  int64_t ffn;               /* F */
  tw_router_opts router;     /* score, topk, groups, scaling, expert_bias */
  tw_moe_act act;
  tw_moe_weighting weighting;
  tw_moe_recipe recipe;
  float aux_coeff;           /* >= 0; 0: no aux loss */
  int64_t max_tokens;        /* T_r <= max_tokens on every rank */
  int64_t global_tokens;     /* T: the sum of T_r over the token ranks (the aux loss's T) */
  int64_t alignment;         /* EP slab alignment (tw_ep_config.alignment) */
  int64_t recv_capacity;     /* 0: the no-drop capacity */
  int fp8_gather;            /* FP8_* with fsdp > 1: quantize before the fsdp all-gather (see Sharding) */
} tw_moe_config;

#define TW_MOE_CONFIG_INIT \
  {sizeof(tw_moe_config), 0, 0, 0, TW_ROUTER_OPTS_INIT, TW_MOE_SWIGLU, TW_MOE_WEIGHT_LATE, TW_MOE_F32, 0.0f, 0, 0, 1, 0, 0}

typedef struct {
  tw_tensor gate, wi, wo; /* recipe dtype */
  tw_tensor bi, bo;       /* f32 or tw_tensor_none() (both or neither) */
} tw_moe_weights;

typedef struct {
  tw_tensor gate, wi, wo, bi, bo; /* the shapes of the weights (bi, bo: none if no bias); f32, but
                                   * wi and wo may both be bf16 (recipes with bf16 weights) */
} tw_moe_grads;

typedef struct tw_moe tw_moe;

/* The error budget above as one coefficient c: each output (gradient = 0) or gradient
 * (gradient = 1) element is within c * (|exact| + rms(exact)) of the exact block, T the
 * global token count. Uses recipe, hidden, ffn, topk and num_experts of cfg. */
double tw_moe_error_budget(const tw_moe_config *cfg, int64_t T, int gradient);

/* Collective over ctx's communicator (a one-rank communicator for a single rank). mesh: NULL
 * = every rank on ep. */
tw_status tw_moe_create(tw_ctx *ctx, const tw_mesh *mesh, const tw_moe_config *cfg, tw_moe **out);
tw_status tw_moe_destroy(tw_moe *moe); /* NULL is fine */
int tw_moe_local_experts(const tw_moe *moe);
size_t tw_moe_saved_bytes(const tw_moe *moe);

/* Weights unchanged across microbatches (TransformerEngine's is_first_microbatch = False):
 * with reuse = 1 a forward given the same wi and wo tensors (data pointers) as the last
 * forward that completed takes that forward's gathered weights (fsdp > 1) and fp8 copies of
 * wi and wo (FP8_*) instead of all-gathering and quantizing them again: the caller promises
 * the bytes did not change since (an optimizer step in between needs reuse = 0 for the next
 * forward, or new tensors). Results are bit-identical to reuse = 0 on unchanged weights; other
 * data pointers, a failed forward, or reuse = 0 make them again. Default 0. The gate is not
 * affected (its GEMM reads it directly). 0 or 1, else TW_ERR_INVALID_ARG. */
tw_status tw_moe_set_weight_reuse(tw_moe *moe, int reuse);

/* out [T_r, H] recipe dtype; aux_loss: 0-d or [1] f32 in ctx memory, or none (then the aux
 * loss is not computed even with aux_coeff > 0, and the backward takes d_aux = 0). */
tw_status tw_moe_forward(tw_moe *moe, const tw_tensor *x, const tw_moe_weights *w, tw_tensor *out,
                         tw_tensor *aux_loss);
/* The last forward's backward: x and w as given to it, d_out [T_r, H] recipe dtype, d_aux the
 * aux loss's cotangent. d_x [T_r, H] recipe dtype; grads overwritten, f32 but d_wi and d_wo
 * f32 or bf16 (see Backward). */
tw_status tw_moe_backward(tw_moe *moe, const tw_tensor *x, const tw_moe_weights *w, const tw_tensor *d_out,
                          float d_aux, tw_tensor *d_x, tw_moe_grads *grads);

#ifdef __cplusplus
}
#endif
#endif
