/* twin GEMM and grouped GEMM.
 *
 * Operands are plain tensors (f32, bf16, f16) or one orientation of a quantized tensor
 * (tw_quantize.h), dequantized exactly: value = decode(q) * scale_inv of its block. All
 * products are accumulated in f32 (ref: OpenBLAS sgemm on the dequantized f32 values).
 * The output is f32, bf16 or f16 (rounded RNE from the f32 result); with accumulate=1 the
 * result is added in f32 to the output's current value before that rounding, otherwise the
 * output is overwritten.
 *
 * tw_op says how an operand is stored relative to the product (row-major names):
 *   dense:   a: N = [B?, M, K], T = [B?, K, M];  b: N = [B?, K, N], T = [B?, N, K]
 *   out [B?, M, N] = op(a) @ op(b); B is present when either operand has 3 dims; a 2-D
 *   operand is broadcast over the batch. Every (op_a, op_b) pair is allowed.
 *
 * Grouped forward (ragged M): group g holds rows [o_g, o_g + m_g) of lhs and out,
 *   o_g = sum_{j<g} m_j, group_sizes [G] i32 in the context's memory, S = sum m_g <= M.
 *   out[o_g : o_g+m_g, :] = lhs[o_g : o_g+m_g, :] @ op(rhs[g])
 *   lhs [M, K]; rhs [G, K, N] (rhs_op N) or [G, N, K] (rhs_op T); out [M, N].
 *   Rows S..M-1 of out are not touched. Empty groups write nothing.
 * Grouped wgrad (ragged contracting dim):
 *   out[g] = lhs_g^T @ rhs_g for each g, out [G, K, N], where lhs_g / rhs_g are the m_g rows
 *   of group g. lhs_op N: lhs stored [M, K]; T: stored per-group transposed, group g's block
 *   [K, m_g] at element offset o_g*K (the colwise copy of tensor/block scaling). rhs_op N:
 *   rhs [M, N]; T: per-group transposed [N, m_g] blocks. An empty group gives out[g] = 0
 *   exactly (or leaves it unchanged with accumulate=1). Rows S..M-1 are never read.
 *
 * Quantized operands: both operands quantized with the same mode, or neither. fp8 pairs:
 *   (e4m3, e4m3), (e4m3, e5m2), (e5m2, e4m3); e5m2 x e5m2 is TW_ERR_DTYPE (as in TE).
 *   Block scaling (MXFP8, BLOCK_1x128) must run along the contracting dimension: for each
 *   operand, the orientation (rowwise/colwise) must put its blocks on K, else
 *   TW_ERR_INVALID_ARG names the operand. BLOCK_128x128 is symmetric. Plain operands must
 *   have equal dtypes (or f32 with anything: it is widened).
 *   The rhs of a grouped forward GEMM is quantized as the uniform form: [G*K, N] (rhs_op N)
 *   or [G*N, K] (rhs_op T) with G groups of equal size.
 *
 * Alignment: the ref backend accepts any shape and any element-aligned pointer. A backend
 * that needs more (gpu: fp8 cuBLASLt paths want 16-byte leading dimensions) states it in
 * tw_gemm_alignment() and rejects violations with TW_ERR_ALIGNMENT and the values, before
 * any work is enqueued; alignment that depends on device-resident group sizes is reported
 * through the device error word.
 */
#ifndef TWIN_TW_GEMM_H
#define TWIN_TW_GEMM_H

#include "twin/tw_base.h"
#include "twin/tw_quantize.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TW_OP_N = 0, TW_OP_T = 1 } tw_op;

/* One GEMM operand: a plain tensor (mode TW_SCALE_NONE) or one orientation of a quantized
 * tensor. src_rows/src_cols are the [M, K] of the tensor that was quantized (they fix where
 * each scale lives); colwise says which orientation data/scale_inv are. */
typedef struct {
  tw_tensor data;
  tw_scaling mode;
  tw_tensor scale_inv;
  int colwise;
  int mxfp8_swizzled;
  int64_t src_rows, src_cols;
} tw_operand;

tw_operand tw_operand_plain(const tw_tensor *t);
tw_operand tw_operand_rowwise(const tw_qtensor *q);
tw_operand tw_operand_colwise(const tw_qtensor *q);

/* The alignment rules of ctx's backend for these operands (TW_OK if none is broken, else
 * TW_ERR_ALIGNMENT with a message); the GEMM entry points call it themselves. */
tw_status tw_gemm_alignment(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b,
                            tw_op op_b, const tw_tensor *out);

tw_status tw_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                  tw_tensor *out, int accumulate);

tw_status tw_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                          const tw_tensor *group_sizes, tw_tensor *out, int accumulate);

tw_status tw_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                const tw_operand *rhs, tw_op rhs_op,
                                const tw_tensor *group_sizes, tw_tensor *out, int accumulate);

#ifdef __cplusplus
}
#endif
#endif
