/* Public entry points of tw_quantize.h: output shapes, argument validation, dispatch. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/validate.h"

static const char *const scaling_names[TW_SCALE_COUNT] = {
    "none", "current", "delayed", "mxfp8", "block1x128", "block128x128"};

const char *tw_scaling_name(tw_scaling s) {
  return ((int)s >= 0 && s < TW_SCALE_COUNT) ? scaling_names[s] : "?";
}

int tw_scaling_from_name(const char *name, tw_scaling *out) {
  if (!name) return -1;
  for (int i = 0; i < TW_SCALE_COUNT; i++)
    if (strcmp(name, scaling_names[i]) == 0) {
      *out = (tw_scaling)i;
      return 0;
    }
  return -1;
}

float tw_scale_from_amax(float amax, float fp8_max, int pow2_scales) {
  if (amax == 0.0f || !isfinite(amax)) return 1.0f;
  float s = fp8_max / amax;
  if (isinf(s)) s = FLT_MAX;
  if (pow2_scales) {
    uint32_t bits;
    memcpy(&bits, &s, 4);
    bits &= 0xFF800000u;
    memcpy(&s, &bits, 4);
  }
  return s;
}

static tw_tensor shape_only(tw_dtype t, int ndim, int64_t a, int64_t b) {
  tw_tensor x = {0, t, ndim, {a, ndim > 1 ? b : 0, 0, 0}, TW_MEM_HOST};
  return x;
}

static tw_status check_opts(const char *op, const tw_quantize_opts *opts) {
  if (!opts) return tw_error(TW_ERR_NULL, "%s: opts is NULL", op);
  if (opts->size != sizeof(tw_quantize_opts))
    return tw_error(TW_ERR_INVALID_ARG, "%s: opts->size is %zu, expected %zu (use TW_QUANTIZE_OPTS_INIT)",
                    op, opts->size, sizeof(tw_quantize_opts));
  if ((int)opts->mode <= TW_SCALE_NONE || opts->mode >= TW_SCALE_COUNT)
    return tw_error(TW_ERR_INVALID_ARG, "%s: scaling mode %d is not a quantizing mode", op, (int)opts->mode);
  if (!tw_dtype_is_fp8(opts->qdtype))
    return tw_error(TW_ERR_DTYPE, "%s: qdtype must be e4m3 or e5m2, got %s", op,
                    tw_dtype_name(opts->qdtype) ? tw_dtype_name(opts->qdtype) : "?");
  if (opts->layout != TW_ROWWISE && opts->layout != TW_COLWISE && opts->layout != TW_ROWWISE_COLWISE)
    return tw_error(TW_ERR_INVALID_ARG, "%s: layout %d is not rowwise(1), colwise(2) or both(3)", op,
                    (int)opts->layout);
  if (opts->pow2_scales != 0 && opts->pow2_scales != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: opts->pow2_scales is %d, expected 0 or 1", op, opts->pow2_scales);
  if (opts->mxfp8_swizzled != 0 && opts->mxfp8_swizzled != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: opts->mxfp8_swizzled is %d, expected 0 or 1", op,
                    opts->mxfp8_swizzled);
  if (opts->col_padded != 0 && opts->col_padded != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: opts->col_padded is %d, expected 0 or 1", op, opts->col_padded);
  if (opts->col_padded && !(opts->layout & TW_COLWISE))
    return tw_error(TW_ERR_INVALID_ARG, "%s: opts->col_padded = 1 asks for the token-padded colwise layout, but "
                    "the layout is rowwise only", op);
  if (opts->col_padded && opts->mode == TW_SCALE_MXFP8_1D)
    return tw_error(TW_ERR_INVALID_ARG, "%s: opts->col_padded = 1 with mxfp8: its colwise data is not "
                    "transposed, so there is no token-padded layout (tensor and block modes only)", op);
  return TW_OK;
}

tw_status tw_quantize_output_shapes(const tw_quantize_opts *opts, int64_t M, int64_t K,
                                    int64_t G, tw_qtensor *q) {
  const char *op = "quantize_output_shapes";
  TW_TRY(check_opts(op, opts));
  if (!q) return tw_error(TW_ERR_NULL, "%s: q is NULL", op);
  if (M < 0 || K < 1 || G < 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: M = %lld, K = %lld, G = %lld (need M >= 0, K >= 1, G >= 1)",
                    op, (long long)M, (long long)K, (long long)G);
  /* keeps every size below (M*K, 128*T_cap, padded K) far from int64 overflow */
  if ((double)M * (double)(K > 0 ? K : 1) > 9.0e15 || K > ((int64_t)1 << 40) || G > ((int64_t)1 << 31))
    return tw_error(TW_ERR_SHAPE, "%s: M = %lld, K = %lld, G = %lld is too large", op, (long long)M,
                    (long long)K, (long long)G);
  memset(q, 0, sizeof *q);
  q->mode = opts->mode;
  q->qdtype = opts->qdtype;
  q->rows = M;
  q->cols = K;
  q->mxfp8_swizzled = opts->mode == TW_SCALE_MXFP8_1D ? opts->mxfp8_swizzled : 0;
  q->row_data = q->row_scale_inv = q->col_data = q->col_scale_inv = tw_tensor_none();
  int row = opts->layout & TW_ROWWISE, col = opts->layout & TW_COLWISE;
  int64_t Gn = G < M ? G : M; /* at most min(G, M) groups are non-empty */
  int64_t T = (M + 127 * Gn) / 128; /* T_cap */
  tw_tensor rd = shape_only(opts->qdtype, 2, M, K), rs, cd, cs;
  switch (opts->mode) {
    case TW_SCALE_TENSOR_CURRENT:
    case TW_SCALE_TENSOR_DELAYED:
      rs = cs = shape_only(TW_F32, 1, G, 0);
      cd = shape_only(opts->qdtype, 1, M * K, 0);
      break;
    case TW_SCALE_MXFP8_1D:
      rs = shape_only(TW_E8M0, 2, 128 * T, tw_round_up(tw_ceil_div(K, 32), 4));
      cs = shape_only(TW_E8M0, 2, 4 * T, tw_round_up(K, 128));
      cd = shape_only(opts->qdtype, 2, M, K);
      break;
    case TW_SCALE_BLOCK_1x128:
      rs = shape_only(TW_F32, 2, tw_ceil_div(K, 128), tw_round_up(M, 4));
      cs = shape_only(TW_F32, 2, T, tw_round_up(K, 4));
      cd = shape_only(opts->qdtype, 1, M * K, 0);
      break;
    default: /* TW_SCALE_BLOCK_128x128 */
      rs = shape_only(TW_F32, 2, T, tw_ceil_div(K, 128));
      cs = shape_only(TW_F32, 2, tw_ceil_div(K, 128), T);
      cd = shape_only(opts->qdtype, 1, M * K, 0);
      break;
  }
  if (opts->col_padded) cd = shape_only(opts->qdtype, 2, K, 128 * T); /* [K, 128*T_cap] */
  if (row) { q->row_data = rd; q->row_scale_inv = rs; }
  if (col) { q->col_data = cd; q->col_scale_inv = cs; }
  q->col_padded = col && opts->col_padded;
  q->amax = shape_only(TW_F32, 1, G, 0);
  return TW_OK;
}

/* A requested output must exist with exactly the expected dtype and shape. */
static tw_status check_out(const char *op, const char *name, const tw_ctx *ctx,
                           const tw_tensor *got, const tw_tensor *want) {
  if (tw_tensor_is_none(want)) return TW_OK;
  TW_TRY(tw_v_tensor(op, name, got, ctx->ops->mem, want->ndim));
  if (got->dtype != want->dtype)
    return tw_error(TW_ERR_DTYPE, "%s: %s has dtype %s, expected %s", op, name,
                    tw_dtype_name(got->dtype), tw_dtype_name(want->dtype));
  return tw_v_shape_is(op, name, got, want->ndim, want->shape);
}

static const tw_dtype x_dtypes[] = {TW_F32, TW_BF16, TW_F16};

/* Byte ranges of two tensors (host or device addresses) intersect. */
static int overlaps(const tw_tensor *a, const tw_tensor *b) {
  if (tw_tensor_is_none(a) || tw_tensor_is_none(b) || !a->data || !b->data) return 0;
  size_t na = tw_tensor_bytes(a), nb = tw_tensor_bytes(b);
  if (na == 0 || nb == 0) return 0;
  uintptr_t a0 = (uintptr_t)a->data, b0 = (uintptr_t)b->data;
  return a0 < b0 + nb && b0 < a0 + na;
}

/* Outputs must not overlap the inputs or each other: no backend quantizes in place. */
static tw_status check_no_overlap(const char *op, int n_out, const tw_tensor *const *outs,
                                  const char *const *out_names, int n_in, const tw_tensor *const *ins,
                                  const char *const *in_names) {
  for (int i = 0; i < n_out; i++) {
    for (int j = 0; j < n_in; j++)
      if (overlaps(outs[i], ins[j]))
        return tw_error(TW_ERR_INVALID_ARG, "%s: %s overlaps the input %s", op, out_names[i], in_names[j]);
    for (int j = i + 1; j < n_out; j++)
      if (overlaps(outs[i], outs[j]))
        return tw_error(TW_ERR_INVALID_ARG, "%s: %s overlaps %s", op, out_names[i], out_names[j]);
  }
  return TW_OK;
}

tw_status tw_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                              const tw_quantize_opts *opts, tw_qtensor *q) {
  const char *op = "grouped_quantize";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(check_opts(op, opts));
  if (!q) return tw_error(TW_ERR_NULL, "%s: q is NULL", op);
  TW_TRY(tw_v_tensor(op, "x", x, ctx->ops->mem, 2));
  TW_TRY(tw_v_dtype_in(op, "x", x, x_dtypes, 3));
  int64_t M = x->shape[0], K = x->shape[1], G;
  if (K < 1) return tw_error(TW_ERR_SHAPE, "%s: x is [%lld, 0]; K must be >= 1", op, (long long)M);
  TW_TRY(tw_v_group_sizes(op, ctx, group_sizes, M, "x", &G, NULL));
  tw_qtensor want;
  TW_TRY(tw_quantize_output_shapes(opts, M, K, G, &want));
  if (q->mode != opts->mode || q->qdtype != opts->qdtype)
    return tw_error(TW_ERR_INVALID_ARG, "%s: q is described as %s/%s but opts ask for %s/%s", op,
                    tw_scaling_name(q->mode), tw_dtype_name(q->qdtype) ? tw_dtype_name(q->qdtype) : "?",
                    tw_scaling_name(opts->mode), tw_dtype_name(opts->qdtype));
  if (q->rows != M || q->cols != K)
    return tw_error(TW_ERR_SHAPE, "%s: q describes a [%lld, %lld] source but x is [%lld, %lld]", op,
                    (long long)q->rows, (long long)q->cols, (long long)M, (long long)K);
  if (opts->mode == TW_SCALE_MXFP8_1D && q->mxfp8_swizzled != opts->mxfp8_swizzled)
    return tw_error(TW_ERR_INVALID_ARG, "%s: q->mxfp8_swizzled = %d but opts->mxfp8_swizzled = %d", op,
                    q->mxfp8_swizzled, opts->mxfp8_swizzled);
  if ((opts->layout & TW_COLWISE) && q->col_padded != opts->col_padded)
    return tw_error(TW_ERR_INVALID_ARG, "%s: q->col_padded = %d but opts->col_padded = %d", op, q->col_padded,
                    opts->col_padded);
  TW_TRY(check_out(op, "row_data", ctx, &q->row_data, &want.row_data));
  TW_TRY(check_out(op, "row_scale_inv", ctx, &q->row_scale_inv, &want.row_scale_inv));
  TW_TRY(check_out(op, "col_data", ctx, &q->col_data, &want.col_data));
  int tensor_mode = opts->mode == TW_SCALE_TENSOR_CURRENT || opts->mode == TW_SCALE_TENSOR_DELAYED;
  if (!(tensor_mode && tw_tensor_is_none(&q->col_scale_inv) && !tw_tensor_is_none(&want.row_scale_inv)))
    TW_TRY(check_out(op, "col_scale_inv", ctx, &q->col_scale_inv, &want.col_scale_inv));
  if (tensor_mode || !tw_tensor_is_none(&q->amax))
    TW_TRY(check_out(op, "amax", ctx, &q->amax, &want.amax));
  if (opts->mode == TW_SCALE_TENSOR_DELAYED) {
    TW_TRY(tw_v_tensor(op, "opts->scale", &opts->scale, ctx->ops->mem, 1));
    int64_t gshape[1] = {G};
    if (opts->scale.dtype != TW_F32)
      return tw_error(TW_ERR_DTYPE, "%s: opts->scale must be f32, got %s", op, tw_dtype_name(opts->scale.dtype));
    TW_TRY(tw_v_shape_is(op, "opts->scale", &opts->scale, 1, gshape));
  }
  {
    int row = opts->layout & TW_ROWWISE, col = opts->layout & TW_COLWISE;
    const tw_tensor none = tw_tensor_none();
    /* tensor scaling: col_scale_inv may be the very buffer of row_scale_inv */
    int shared = tensor_mode && row && col && q->col_scale_inv.data == q->row_scale_inv.data;
    const tw_tensor *outs[5] = {row ? &q->row_data : &none, row ? &q->row_scale_inv : &none,
                                col ? &q->col_data : &none, col && !shared ? &q->col_scale_inv : &none,
                                &q->amax};
    const char *out_names[5] = {"row_data", "row_scale_inv", "col_data", "col_scale_inv", "amax"};
    const tw_tensor *ins[3] = {x, group_sizes,
                               opts->mode == TW_SCALE_TENSOR_DELAYED ? &opts->scale : &none};
    const char *in_names[3] = {"x", "group_sizes", "opts->scale"};
    TW_TRY(check_no_overlap(op, 5, outs, out_names, 3, ins, in_names));
  }
  if (!ctx->ops->grouped_quantize)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->grouped_quantize(ctx, x, group_sizes, opts, q);
}

tw_status tw_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                int colwise, tw_tensor *out) {
  const char *op = "grouped_dequantize";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  if (!q) return tw_error(TW_ERR_NULL, "%s: q is NULL", op);
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = q->mode;
  o.qdtype = q->qdtype;
  o.layout = colwise ? TW_COLWISE : TW_ROWWISE;
  o.mxfp8_swizzled = q->mxfp8_swizzled;
  if (q->col_padded != 0 && q->col_padded != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: q->col_padded is %d, expected 0 or 1", op, q->col_padded);
  if (colwise && q->col_padded && q->mode == TW_SCALE_MXFP8_1D)
    return tw_error(TW_ERR_INVALID_ARG, "%s: q->col_padded = 1 with mxfp8, whose colwise data has no token-padded "
                    "layout", op);
  o.col_padded = colwise ? q->col_padded : 0;
  TW_TRY(check_opts(op, &o));
  TW_TRY(tw_v_tensor(op, "out", out, ctx->ops->mem, 2));
  TW_TRY(tw_v_dtype_in(op, "out", out, x_dtypes, 3));
  int64_t M = q->rows, K = q->cols, G;
  int64_t oshape[2] = {M, K};
  TW_TRY(tw_v_shape_is(op, "out", out, 2, oshape));
  if (K < 1) return tw_error(TW_ERR_SHAPE, "%s: q describes [%lld, 0]; K must be >= 1", op, (long long)M);
  TW_TRY(tw_v_group_sizes(op, ctx, group_sizes, M, "q", &G, NULL));
  tw_qtensor want;
  TW_TRY(tw_quantize_output_shapes(&o, M, K, G, &want));
  if (colwise) {
    TW_TRY(check_out(op, "col_data", ctx, &q->col_data, &want.col_data));
    const tw_tensor *s = &q->col_scale_inv;
    if ((q->mode == TW_SCALE_TENSOR_CURRENT || q->mode == TW_SCALE_TENSOR_DELAYED) && tw_tensor_is_none(s))
      s = &q->row_scale_inv;
    TW_TRY(check_out(op, "col_scale_inv", ctx, s, &want.col_scale_inv));
  } else {
    TW_TRY(check_out(op, "row_data", ctx, &q->row_data, &want.row_data));
    TW_TRY(check_out(op, "row_scale_inv", ctx, &q->row_scale_inv, &want.row_scale_inv));
  }
  {
    const tw_tensor *s = colwise ? &q->col_scale_inv : &q->row_scale_inv;
    if (colwise && tw_tensor_is_none(s)) s = &q->row_scale_inv;
    const tw_tensor *outs[1] = {out}, *ins[3] = {colwise ? &q->col_data : &q->row_data, s, group_sizes};
    const char *out_names[1] = {"out"};
    const char *in_names[3] = {colwise ? "col_data" : "row_data", colwise ? "col_scale_inv" : "row_scale_inv",
                               "group_sizes"};
    TW_TRY(check_no_overlap(op, 1, outs, out_names, 3, ins, in_names));
  }
  if (!ctx->ops->grouped_dequantize)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->grouped_dequantize(ctx, q, group_sizes, colwise, out);
}

tw_status tw_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                  const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                  float margin) {
  const char *op = "delayed_scale_update";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(tw_v_tensor(op, "amax_history", amax_history, ctx->ops->mem, 2));
  TW_TRY(tw_v_tensor(op, "scale", scale, ctx->ops->mem, 1));
  TW_TRY(tw_v_tensor(op, "amax", amax, ctx->ops->mem, 1));
  static const tw_dtype f32[] = {TW_F32};
  TW_TRY(tw_v_dtype_in(op, "amax_history", amax_history, f32, 1));
  TW_TRY(tw_v_dtype_in(op, "scale", scale, f32, 1));
  TW_TRY(tw_v_dtype_in(op, "amax", amax, f32, 1));
  int64_t G = amax_history->shape[0];
  if (G < 1 || amax_history->shape[1] < 1)
    return tw_error(TW_ERR_SHAPE, "%s: amax_history is [%lld, %lld]; need G >= 1 and a history length >= 1",
                    op, (long long)G, (long long)amax_history->shape[1]);
  int64_t gshape[1] = {G};
  TW_TRY(tw_v_shape_is(op, "scale", scale, 1, gshape));
  TW_TRY(tw_v_shape_is(op, "amax", amax, 1, gshape));
  if (!tw_dtype_is_fp8(qdtype))
    return tw_error(TW_ERR_DTYPE, "%s: qdtype must be e4m3 or e5m2", op);
  if (algo != TW_AMAX_MAX && algo != TW_AMAX_MOST_RECENT)
    return tw_error(TW_ERR_INVALID_ARG, "%s: amax algo %d is not max(0) or most_recent(1)", op, (int)algo);
  /* an integer margin keeps 2^margin exact, so every backend gets the same bits */
  if (!(margin >= 0.0f && margin <= 127.0f) || margin != floorf(margin))
    return tw_error(TW_ERR_INVALID_ARG, "%s: margin %g is not an integer in [0, 127]", op, (double)margin);
  {
    const tw_tensor *outs[2] = {amax_history, scale}, *ins[1] = {amax};
    const char *out_names[2] = {"amax_history", "scale"}, *in_names[1] = {"amax"};
    TW_TRY(check_no_overlap(op, 2, outs, out_names, 1, ins, in_names));
  }
  if (!ctx->ops->delayed_scale_update)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->delayed_scale_update(ctx, amax_history, scale, amax, qdtype, algo, margin);
}
