#include "ref/ref.h"
tw_status ref_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate) {
  (void)ctx; (void)dst; (void)src; (void)saturate;
  return tw_error(TW_ERR_UNSUPPORTED, "cast: pending");
}
