#include "ref/ref.h"
tw_status ref_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                   tw_tensor *out, int accumulate) {
  (void)ctx; (void)a; (void)op_a; (void)b; (void)op_b; (void)out; (void)accumulate;
  return tw_error(TW_ERR_UNSUPPORTED, "gemm: pending");
}
tw_status ref_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs,
                           tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                           int accumulate) {
  (void)ctx; (void)lhs; (void)rhs; (void)rhs_op; (void)group_sizes; (void)out; (void)accumulate;
  return tw_error(TW_ERR_UNSUPPORTED, "grouped_gemm: pending");
}
tw_status ref_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                 const tw_operand *rhs, tw_op rhs_op,
                                 const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  (void)ctx; (void)lhs; (void)lhs_op; (void)rhs; (void)rhs_op; (void)group_sizes; (void)out; (void)accumulate;
  return tw_error(TW_ERR_UNSUPPORTED, "grouped_gemm_wgrad: pending");
}
