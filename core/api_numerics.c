/* Public entry point of tw_cast (tw_numerics.h). */
#include "core/validate.h"

tw_status tw_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate) {
  const char *op = "cast";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(tw_v_tensor(op, "src", src, ctx->ops->mem, -1));
  TW_TRY(tw_v_tensor(op, "dst", dst, ctx->ops->mem, src->ndim));
  TW_TRY(tw_v_shape_is(op, "dst", dst, src->ndim, src->shape));
  if (dst->dtype == TW_E8M0)
    return tw_error(TW_ERR_DTYPE, "%s: e8m0 is a scale format; cast to it is not defined (use the MXFP8 quantizer)", op);
  if (!ctx->ops->cast)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->cast(ctx, dst, src, saturate ? 1 : 0);
}
