/* The MoE block's elementwise steps over the EP receive rows (internal to moe/). Rows are
 * grouped by gs [G] i32 (the dispatch's group sizes, in ctx memory); only rows < sum(gs) are
 * read or written. Math in double, rounded once to f32 (then to bf16 for a bf16 output).
 * ref: host loops here; gpu: gpu/moe_elementwise.cu when linked (weak), else
 * TW_ERR_UNSUPPORTED naming the step. */
#ifndef TWIN_MOE_ELEMENTWISE_H
#define TWIN_MOE_ELEMENTWISE_H

#include "twin/tw_moe.h"

/* out[r, c] = y[r, c] + bias[g(r), c] (bias NULL: + 0); y f32 [R, C]; out f32 or bf16 [R, C]
 * (may be y itself when f32). */
tw_status tw_moe_bias_out(tw_ctx *ctx, const float *y, const tw_tensor *gs, const float *bias, int64_t C,
                          void *out, tw_dtype out_dtype);
/* a[r, f] = act(h[r, f]) * h[r, F + f] (* w[r] when w is not NULL); h f32 [R, 2F]; a f32/bf16. */
tw_status tw_moe_act_fwd(tw_ctx *ctx, tw_moe_act act, const float *h, const tw_tensor *gs, const float *w, int64_t F,
                         void *a, tw_dtype a_dtype);
/* With u = act(h_gate) * h_up (unweighted): d_w[r] = sum_f d_a[r, f] * u[r, f] (when d_w is not
 * NULL), d_u = d_a * w (w NULL: 1), d_h[r, f] = d_u * act'(h_gate) * h_up, d_h[r, F + f] =
 * d_u * act(h_gate). d_a f32 [R, F]; d_h f32/bf16 [R, 2F]; d_w f32 [R]. */
tw_status tw_moe_act_bwd(tw_ctx *ctx, tw_moe_act act, const float *h, const float *d_a, const tw_tensor *gs,
                         const float *w, int64_t F, void *d_h, tw_dtype dh_dtype, float *d_w);
/* db[g, c] = sum over group g's rows of dy[r, c] (f64 sum in row order, rounded once);
 * dy f32/bf16 [R, C]; db f32 [G, C] (an empty group: 0). */
tw_status tw_moe_bias_grad(tw_ctx *ctx, const void *dy, tw_dtype dy_dtype, const tw_tensor *gs, int64_t C,
                           float *db);
/* y[i] += x[i], f32. */
tw_status tw_moe_add_f32(tw_ctx *ctx, float *y, const float *x, int64_t n);
/* dst[a][p][b] = src[p][a][b] for p < P, a < A, b < B elements of es bytes (a byte copy):
 * the fsdp layouts. An all-gather of P shards [A, B] gives [P, A, B]; the weight wants
 * [A, P*B]. The inverse is the same call with P and A swapped. */
tw_status tw_moe_swap_outer(tw_ctx *ctx, const void *src, int64_t P, int64_t A, int64_t B, size_t es, void *dst);
/* scale[g] = tw_scale_from_amax(amax[g], fp8_max, 0) for g < G (f32, in ctx memory). */
tw_status tw_moe_scales_from_amax(tw_ctx *ctx, const float *amax, int64_t G, float fp8_max, float *scale);

/* Benches: fn(arg, name) is called before each step of the forward and backward (the names of
 * moe/block.c's error messages) and with "end" after the last one; NULL removes it. */
void tw_moe_set_step_hook(tw_moe *moe, void (*fn)(void *arg, const char *step), void *arg);

/* Tests only (moe/fuzz.c's planted bug): nonzero = the backward skips the sum of the expert
 * weight gradients over dp. */
extern int tw_moe_plant_skip_dp_reduce;

#endif
