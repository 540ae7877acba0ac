/* Public entry points of tw_router.h: argument validation, then the backend's router. */
#include <math.h>
#include <stdint.h>

#include "core/backend_moe.h"
#include "core/validate.h"
#include "twin/tw_numerics.h"

static const tw_dtype logit_dtypes[] = {TW_F32, TW_BF16};

static tw_status check_backend(const char *op, tw_ctx *ctx, int have) {
  if (!have)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return TW_OK;
}

/* logits [T, E] and opts; sets T and E. */
static tw_status check_logits_opts(const char *op, tw_ctx *ctx, const tw_tensor *logits,
                                   const tw_router_opts *opts, int64_t *T, int64_t *E) {
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  if (!opts) return tw_error(TW_ERR_NULL, "%s: opts is NULL", op);
  TW_TRY(tw_v_tensor(op, "logits", logits, ctx->ops->mem, 2));
  TW_TRY(tw_v_dtype_in(op, "logits", logits, logit_dtypes, 2));
  *T = logits->shape[0];
  *E = logits->shape[1];
  if (*E < 1) return tw_error(TW_ERR_SHAPE, "%s: logits has E = %lld experts (need >= 1)", op, (long long)*E);
  if ((int)opts->score < 0 || opts->score >= TW_ROUTER_SCORE_COUNT)
    return tw_error(TW_ERR_INVALID_ARG, "%s: unknown score function %d", op, (int)opts->score);
  int k = opts->topk;
  if (k < 1 || k > *E)
    return tw_error(TW_ERR_INVALID_ARG, "%s: topk = %d must be in [1, E = %lld]", op, k, (long long)*E);
  if (opts->pre_softmax && opts->score != TW_ROUTER_SOFTMAX)
    return tw_error(TW_ERR_INVALID_ARG, "%s: pre_softmax = 1 applies to the softmax score only", op);
  if (!isfinite(opts->scaling_factor))
    return tw_error(TW_ERR_INVALID_ARG, "%s: scaling_factor is %g", op, (double)opts->scaling_factor);
  if (opts->num_groups < 0)
    return tw_error(TW_ERR_INVALID_ARG, "%s: num_groups = %d is negative", op, opts->num_groups);
  if (opts->num_groups > 0) {
    int G = opts->num_groups, gk = opts->group_topk;
    if (*E % G != 0)
      return tw_error(TW_ERR_INVALID_ARG, "%s: num_groups = %d does not divide E = %lld", op, G, (long long)*E);
    if (gk < 1 || gk > G)
      return tw_error(TW_ERR_INVALID_ARG, "%s: group_topk = %d must be in [1, num_groups = %d]", op, gk, G);
    int64_t per_group = *E / G;
    if (k / gk < 1 || k / gk > per_group)
      return tw_error(TW_ERR_INVALID_ARG,
                      "%s: topk / group_topk = %d / %d = %d must be in [1, E / num_groups = %lld]", op,
                      k, gk, k / gk, (long long)per_group);
    if ((int64_t)gk * per_group < k)
      return tw_error(TW_ERR_INVALID_ARG, "%s: topk = %d exceeds the %lld experts of %d kept groups", op,
                      k, (long long)(gk * per_group), gk);
  }
  if (!tw_tensor_is_none(&opts->expert_bias)) {
    if (opts->score != TW_ROUTER_SIGMOID)
      return tw_error(TW_ERR_INVALID_ARG, "%s: expert_bias applies to the sigmoid score only", op);
    TW_TRY(tw_v_tensor(op, "expert_bias", &opts->expert_bias, ctx->ops->mem, 1));
    if (opts->expert_bias.dtype != TW_F32)
      return tw_error(TW_ERR_DTYPE, "%s: expert_bias is %s, expected f32", op, tw_dtype_name(opts->expert_bias.dtype));
    int64_t want[1] = {*E};
    TW_TRY(tw_v_shape_is(op, "expert_bias", &opts->expert_bias, 1, want));
  }
  if (logits->mem == TW_MEM_HOST) /* a NaN has no place in an order: reject it, named */
    for (int64_t i = 0; i < *T * *E; i++) {
      float v = logits->dtype == TW_F32 ? ((const float *)logits->data)[i]
                                        : tw_bf16_to_f32(((const uint16_t *)logits->data)[i]);
      if (isnan(v))
        return tw_error(TW_ERR_INVALID_ARG, "%s: logits[%lld, %lld] is NaN", op, (long long)(i / *E),
                        (long long)(i % *E));
    }
  return TW_OK;
}

static tw_status check_out(const char *op, tw_ctx *ctx, const char *name, const tw_tensor *t,
                           tw_dtype dt, int ndim, int64_t d0, int64_t d1) {
  TW_TRY(tw_v_tensor(op, name, t, ctx->ops->mem, ndim));
  if (t->dtype != dt)
    return tw_error(TW_ERR_DTYPE, "%s: %s is %s, expected %s", op, name, tw_dtype_name(t->dtype), tw_dtype_name(dt));
  int64_t want[2] = {d0, d1};
  return tw_v_shape_is(op, name, t, ndim, want);
}

tw_status tw_router_fwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                        tw_tensor *topk_idx, tw_tensor *topk_weights, tw_tensor *counts) {
  const char *op = "router";
  int64_t T, E;
  TW_TRY(check_logits_opts(op, ctx, logits, opts, &T, &E));
  TW_TRY(check_out(op, ctx, "topk_idx", topk_idx, TW_I32, 2, T, opts->topk));
  TW_TRY(check_out(op, ctx, "topk_weights", topk_weights, TW_F32, 2, T, opts->topk));
  if (!tw_tensor_is_none(counts)) TW_TRY(check_out(op, ctx, "counts", counts, TW_I32, 1, E, 0));
  TW_TRY(check_backend(op, ctx, ctx->ops->router && ctx->ops->router->fwd));
  return ctx->ops->router->fwd(ctx, logits, opts, topk_idx, topk_weights, counts);
}

/* topk_idx must be what the forward could produce: ids in range, distinct within a token.
 * Host memory only (a device backend checks on the device). */
static tw_status check_topk_idx(const char *op, tw_ctx *ctx, const tw_tensor *idx, int64_t T,
                                int64_t E, int k) {
  TW_TRY(check_out(op, ctx, "topk_idx", idx, TW_I32, 2, T, k));
  if (idx->mem != TW_MEM_HOST) return TW_OK;
  const int32_t *p = (const int32_t *)idx->data;
  for (int64_t t = 0; t < T; t++)
    for (int j = 0; j < k; j++) {
      int32_t e = p[t * k + j];
      if (e < 0 || e >= E)
        return tw_error(TW_ERR_INVALID_ARG, "%s: topk_idx[%lld, %d] = %d is outside [0, E = %lld)", op,
                        (long long)t, j, e, (long long)E);
      for (int i = 0; i < j; i++)
        if (p[t * k + i] == e)
          return tw_error(TW_ERR_INVALID_ARG, "%s: token %lld lists expert %d twice (topk_idx slots %d and %d)",
                          op, (long long)t, e, i, j);
    }
  return TW_OK;
}

tw_status tw_router_bwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                        const tw_tensor *topk_idx, const tw_tensor *d_topk_weights,
                        tw_tensor *d_logits) {
  const char *op = "router_bwd";
  int64_t T, E;
  TW_TRY(check_logits_opts(op, ctx, logits, opts, &T, &E));
  TW_TRY(check_topk_idx(op, ctx, topk_idx, T, E, opts->topk));
  TW_TRY(check_out(op, ctx, "d_topk_weights", d_topk_weights, TW_F32, 2, T, opts->topk));
  TW_TRY(check_out(op, ctx, "d_logits", d_logits, TW_F32, 2, T, E));
  TW_TRY(check_backend(op, ctx, ctx->ops->router && ctx->ops->router->bwd));
  return ctx->ops->router->bwd(ctx, logits, opts, topk_idx, d_topk_weights, d_logits);
}

static tw_status check_aux(const char *op, tw_ctx *ctx, const tw_tensor *logits,
                           const tw_router_opts *opts, const tw_tensor *counts, float coeff,
                           int64_t *T, int64_t *E) {
  TW_TRY(check_logits_opts(op, ctx, logits, opts, T, E));
  if (*T < 1) return tw_error(TW_ERR_SHAPE, "%s: the aux loss needs T >= 1 tokens (T = %lld)", op, (long long)*T);
  if (!isfinite(coeff)) return tw_error(TW_ERR_INVALID_ARG, "%s: coeff is %g", op, (double)coeff);
  return check_out(op, ctx, "counts", counts, TW_I32, 1, *E, 0);
}

tw_status tw_router_aux_loss(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                             const tw_tensor *counts, float coeff, tw_tensor *loss) {
  const char *op = "router_aux_loss";
  int64_t T, E;
  TW_TRY(check_aux(op, ctx, logits, opts, counts, coeff, &T, &E));
  TW_TRY(tw_v_tensor(op, "loss", loss, ctx->ops->mem, -1));
  if (loss->dtype != TW_F32 || tw_tensor_numel(loss) != 1 || loss->ndim > 1)
    return tw_error(TW_ERR_SHAPE, "%s: loss must be one f32 (0-d or [1]), got ndim %d with %lld %s", op,
                    loss->ndim, (long long)tw_tensor_numel(loss), tw_dtype_name(loss->dtype));
  TW_TRY(check_backend(op, ctx, ctx->ops->router && ctx->ops->router->aux_loss));
  return ctx->ops->router->aux_loss(ctx, logits, opts, counts, coeff, loss, 0.0f, NULL);
}

tw_status tw_router_aux_loss_bwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *opts,
                                 const tw_tensor *counts, float coeff, float d_loss,
                                 tw_tensor *d_logits) {
  const char *op = "router_aux_loss_bwd";
  int64_t T, E;
  TW_TRY(check_aux(op, ctx, logits, opts, counts, coeff, &T, &E));
  if (!isfinite(d_loss)) return tw_error(TW_ERR_INVALID_ARG, "%s: d_loss is %g", op, (double)d_loss);
  TW_TRY(check_out(op, ctx, "d_logits", d_logits, TW_F32, 2, T, E));
  TW_TRY(check_backend(op, ctx, ctx->ops->router && ctx->ops->router->aux_loss));
  return ctx->ops->router->aux_loss(ctx, logits, opts, counts, coeff, NULL, d_loss, d_logits);
}
