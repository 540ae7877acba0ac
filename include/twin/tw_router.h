/* twin MoE router: top-k expert selection and its weights, with backward and the
 * load-balancing aux loss (TE router semantics, te-semantics.md §4.3). Computed in f64 and
 * rounded once to f32 (the oracle, ref/router.c, and the CUDA twin, gpu/router.cu, give the
 * same bits: every sum in the same order, exp from twin's own tw_exp_f64, core/tw_exp.h).
 *
 * Inputs: logits [T, E] f32 (bf16 accepted, widened to f32 first), E experts, k = topk.
 * Scores used for selection (sel) and the values the weights come from (val):
 *   SOFTMAX, pre_softmax = 0:  sel = logits;          w = softmax over the k selected logits
 *   SOFTMAX, pre_softmax = 1:  s = softmax(logits);   sel = s;  w_j = s[idx_j]
 *   SIGMOID:                   s = sigmoid(logits);   sel = s + expert_bias (bias optional,
 *                              [E] f32, selection only: it gets no gradient);
 *                              w_j = s[idx_j], and when k > 1: w_j /= (sum_j s[idx_j] + 1e-20)
 *   finally every w_j *= scaling_factor.
 * Group-limited top-k (num_groups > 0): the E experts form num_groups equal groups of
 *   E/num_groups consecutive ids; a group's score is the sum of its top (k / group_topk)
 *   sel values; the group_topk best groups are kept and the experts of the others are
 *   excluded; then the top k of the rest are taken.
 * Order and ties (TE leaves ties unstated; twin fixes them): topk_idx[t] lists the chosen
 *   experts by descending sel, equal sel values ordered by ascending expert id; the same
 *   rule picks groups (lower group id wins a tie). topk_weights[t, j] belongs to
 *   topk_idx[t, j]. Ids within a token are therefore always distinct.
 * counts [E] i32 (optional): counts[e] = #{t : e in topk_idx[t]} (tokens routed to e).
 *
 * Backward: d_logits [T, E] f32 from d_topk_weights [T, k] f32, for the same logits, opts
 *   and topk_idx as the forward (the selection is piecewise constant: no gradient flows
 *   through it). With g_j = scaling_factor * d_w_j:
 *   SOFTMAX post:  p = softmax(selected logits); d_logit[idx_j] = p_j (g_j - sum_i g_i p_i),
 *                  0 elsewhere.
 *   SOFTMAX pre:   d_s[idx_j] = g_j (0 elsewhere); d_logits = s * (d_s - sum_e d_s[e] s[e]).
 *   SIGMOID:       k > 1: with S = sum_j s[idx_j] + 1e-20,
 *                  d_s[idx_j] = g_j / S - (sum_i g_i s[idx_i]) / S^2; k = 1: d_s[idx] = g.
 *                  d_logits = d_s * s * (1 - s).
 *
 * Aux loss (Switch-style load balancing, on the global logits):
 *   p[t, e] = softmax(logits[t])[e] (SOFTMAX) or s[t, e] / sum_e' s[t, e'] (SIGMOID, s =
 *   sigmoid); loss = coeff * E / (k * T^2) * sum_e (sum_t p[t, e]) * counts[e]. counts is an
 *   input (i32 [E], normally the forward's counts) and a constant for the gradient:
 *   d_logits[t, :] = d_loss * coeff * E / (k * T^2) * J_p(t)^T counts.
 *   Summation order (fixed, so every backend gets the same bits): r_t = sum_e p[t, e] *
 *   counts[e] in e order; chunk sums of 256 consecutive tokens in t order; the total is the
 *   sum of the chunk sums in order; loss = (float)(c * total), all in f64.
 *
 * Errors (every one names the values): k < 1 or k > E; num_groups not dividing E, group_topk
 *   outside [1, num_groups], k / group_topk < 1 or > E / num_groups; expert_bias with SOFTMAX
 *   or not [E]; a NaN logit (token and expert named); shapes or dtypes that disagree.
 */
#ifndef TWIN_TW_ROUTER_H
#define TWIN_TW_ROUTER_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TW_ROUTER_SOFTMAX = 0, TW_ROUTER_SIGMOID = 1, TW_ROUTER_SCORE_COUNT } tw_router_score;

typedef struct {
  size_t size; /* sizeof(tw_router_opts) */
  tw_router_score score;
  int pre_softmax;     /* SOFTMAX only: softmax over all E before top-k */
  int topk;            /* k */
  int num_groups;      /* 0 = no group limit */
  int group_topk;      /* groups kept when num_groups > 0 */
  float scaling_factor;
  tw_tensor expert_bias; /* [E] f32 or tw_tensor_none(); SIGMOID only */
} tw_router_opts;

#define TW_ROUTER_OPTS_INIT \
  {sizeof(tw_router_opts), TW_ROUTER_SOFTMAX, 0, 1, 0, 0, 1.0f, {0, TW_F32, -1, {0, 0, 0, 0}, TW_MEM_HOST}}

/* topk_idx [T, k] i32, topk_weights [T, k] f32, counts [E] i32 or tw_tensor_none(). */
tw_status tw_router_fwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                        tw_tensor *topk_idx, tw_tensor *topk_weights, tw_tensor *counts);

/* d_logits [T, E] f32 (overwritten). */
tw_status tw_router_bwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                        const tw_tensor *topk_idx, const tw_tensor *d_topk_weights,
                        tw_tensor *d_logits);

/* loss: 0-d or [1] f32. Uses opts->score and opts->topk only. */
tw_status tw_router_aux_loss(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                             const tw_tensor *counts, float coeff, tw_tensor *loss);
/* d_logits [T, E] f32 (overwritten) for a scalar upstream gradient d_loss. */
tw_status tw_router_aux_loss_bwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                                 const tw_tensor *counts, float coeff, float d_loss,
                                 tw_tensor *d_logits);

#ifdef __cplusplus
}
#endif
#endif
