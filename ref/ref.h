/* The oracle's operations (internal): each has the signature of its tw_backend_ops entry and
 * runs only after core/ validated the arguments. Host memory, plain C, f32/f64 accumulation,
 * OpenBLAS for the GEMMs. */
#ifndef TWIN_REF_REF_H
#define TWIN_REF_REF_H

#include "core/backend.h"

tw_status ref_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate);
tw_status ref_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                               const tw_quantize_opts *opts, tw_qtensor *q);
tw_status ref_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                 int colwise, tw_tensor *out);
tw_status ref_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                   const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                   float margin);
/* The values of one GEMM operand as stored: out[i] = decode(data[i]) * scale_inv of element i's
 * block (f32), same element order as o->data (a token-padded colwise copy comes back in the
 * default colwise order, M * K elements); plain operands are just widened to f32.
 * Groups: group_sizes [G] on the host, or NULL for G equal groups of o->src_rows / G rows
 * (the uniform form). Elements of rows past the groups are left untouched. */
tw_status ref_dequantize_operand(const tw_operand *o, const int32_t *group_sizes, int64_t G,
                                 float *out);
tw_status ref_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                   tw_tensor *out, int accumulate);
tw_status ref_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs,
                           tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                           int accumulate);
tw_status ref_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                 const tw_operand *rhs, tw_op rhs_op,
                                 const tw_tensor *group_sizes, tw_tensor *out, int accumulate);
tw_status ref_grouped_gemm_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                                tw_tensor *out, int accumulate);
tw_status ref_grouped_gemm_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                      const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                                      tw_tensor *out, int accumulate);

#endif
