#include "ref/ref.h"
tw_status ref_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                               const tw_quantize_opts *opts, tw_qtensor *q) {
  (void)ctx; (void)x; (void)group_sizes; (void)opts; (void)q;
  return tw_error(TW_ERR_UNSUPPORTED, "grouped_quantize: pending");
}
tw_status ref_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                 int colwise, tw_tensor *out) {
  (void)ctx; (void)q; (void)group_sizes; (void)colwise; (void)out;
  return tw_error(TW_ERR_UNSUPPORTED, "grouped_dequantize: pending");
}
tw_status ref_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                   const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                   float margin) {
  (void)ctx; (void)amax_history; (void)scale; (void)amax; (void)qdtype; (void)algo; (void)margin;
  return tw_error(TW_ERR_UNSUPPORTED, "delayed_scale_update: pending");
}
