/* twin GEMM and grouped GEMM.
 *
 * Operands are plain tensors (f32, bf16, f16) or one orientation of a quantized tensor
 * (tw_quantize.h), dequantized exactly: value = decode(q) * scale_inv of its block (f32
 * multiply). Every product is accumulated in f32 (ref: OpenBLAS cblas_sgemm on the f32
 * values). The output is f32, bf16 or f16: the f32 result rounded once, RNE. With
 * accumulate=1 the f32 result is out_f32 + sum (out decoded to f32 first); otherwise out is
 * overwritten. Error bound against the exact result: tw_gemm_error_bound (tw_check.h).
 * IEEE specials propagate as in a plain sum of products: no zero is skipped, so inf * 0 and
 * inf - inf give NaN; a result that is exactly zero may come out +0 where the exact sign
 * is -0 (a sum starts from +0).
 *
 * Domain of quantized operands: every dequantized value decode(q) * scale_inv must be
 * finite in f32. Quantizing +-inf, or a value within one rounding step of FLT_MAX, produces
 * codes whose dequantized value overflows (e.g. inf -> 57344 * 2^127); a GEMM on such an
 * operand has an unspecified result: ref multiplies the overflowed values (inf, NaN), gpu
 * applies the scales to f32 block sums (finite). NaN codes and NaN scales are in the domain
 * and propagate as NaN. (Found by `twin fuzz --backend gpu`; fuzz/FINDINGS.md.)
 * Subnormal 16-bit inputs: a backend may treat f16/bf16 subnormal input values as zero —
 * the gpu backend's tensor-core paths do for f16 on the H200 (mma.sync and cuBLASLt alike).
 * The products that involve such an input may then be lost; twin's checkers allow exactly
 * their sum of |a||b| on top of tw_gemm_error_bound. The ref backend keeps them.
 *
 * tw_op says how an operand is stored relative to the product (row-major names):
 *   dense:   a: N = [B?, M, K], T = [B?, K, M];  b: N = [B?, K, N], T = [B?, N, K]
 *   out [B?, M, N] = op(a) @ op(b); B is present when either operand has 3 dims; a 2-D
 *   operand is broadcast over the batch. Every (op_a, op_b) pair is allowed. K = 0 gives
 *   out = 0 (accumulate: out unchanged).
 *
 * Grouped forward (ragged M): group g holds rows [o_g, o_g + m_g) of lhs and out,
 *   o_g = sum_{j<g} m_j, group_sizes [G] i32 in the context's memory, S = sum m_g <= M.
 *   out[o_g : o_g+m_g, :] = lhs[o_g : o_g+m_g, :] @ op(rhs[g])
 *   lhs [M, K]; rhs [G, K, N] (rhs_op N) or [G, N, K] (rhs_op T); out [M, N].
 *   Rows S..M-1 of lhs are never read and of out never written (they may hold NaN or
 *   poison); an empty group reads and writes nothing.
 * Grouped wgrad (ragged contracting dim):
 *   out[g] = lhs_g^T @ rhs_g for each g, out [G, K, N], where lhs_g / rhs_g are the m_g rows
 *   of group g. lhs_op N: lhs stored [M, K]; T: stored per-group transposed, group g's block
 *   [K, m_g] at element offset o_g*K (the colwise copy of tensor/block scaling), passed as
 *   one [K, M] tensor. rhs_op N: rhs [M, N]; T: per-group transposed [N, m_g] blocks, passed
 *   as [N, M]. An empty group gives out[g] = +0 exactly (accumulate: out[g]'s bytes are left
 *   as they are). Rows S..M-1 are never read.
 *
 * Quantized operands: both operands quantized with the same mode, or neither (delayed and
 *   current count as the same: both are per-tensor scales; so do BLOCK_1x128 and
 *   BLOCK_128x128, DeepSeek-V3's pairing of 1x128 activations with 128x128 weights). fp8 pairs: (e4m3, e4m3),
 *   (e4m3, e5m2), (e5m2, e4m3); e5m2 x e5m2 is TW_ERR_DTYPE (as in TE).
 *   Block scaling (MXFP8, BLOCK_1x128) must run along the contracting dimension: for each
 *   operand, the orientation (rowwise/colwise) must put its blocks on K, else
 *   TW_ERR_INVALID_ARG names the operand and the orientation to pass. Tensor scaling and
 *   BLOCK_128x128 tiles are symmetric: any orientation.
 *   The data tensor of an orientation is its storage: [rows, cols] of the source, or
 *   [cols, rows] for a per-group transposed colwise copy (TENSOR_* and BLOCK_*), as
 *   tw_operand_rowwise/colwise build it; a 2-D view of another shape is TW_ERR_SHAPE.
 *   dense: 2-D only, the source quantized as one group; op T on a transposed copy reads it
 *     back in the source's orientation.
 *   grouped forward: lhs is the rowwise data of the [M, K] source quantized by group_sizes;
 *     rhs is quantized in the uniform form: a [G*K, N] source (per-group storage [K, N],
 *     rhs_op N) or a [G*N, K] source (storage [N, K], rhs_op T), G groups of equal size; a
 *     transposed colwise copy of one is the other's storage.
 *   wgrad: lhs [M, K] and rhs [M, N] quantized by group_sizes; op T exactly when the data
 *     is a per-group transposed copy (else TW_ERR_INVALID_ARG). Either copy may be
 *     token-padded (tw_quantize.h, opts.col_padded: data [K, 128*T_cap] / [N, 128*T_cap],
 *     op T): the same products, read in place where the default layout is first copied into
 *     that one by gg_wgmma_fp8. Only the wgrad takes a token-padded operand; tw_gemm and
 *     tw_grouped_gemm give TW_ERR_INVALID_ARG for one.
 *   Plain operands must have equal dtypes, or one of them f32 (the other is widened).
 *
 * Row-gathered lhs (tw_grouped_gemm_rows, tw_grouped_gemm_wgrad_rows; EP rows by source,
 * tw_ep.h): the same products with row i of the logical lhs read from data row lhs_rows[i]:
 *   L[i] = lhs[lhs_rows[i]] (lhs_rows[i] >= 0), L[i] = 0 (lhs_rows[i] = -1), for i < S,
 * then the grouped forward / wgrad above on L (lhs_op N). lhs is [U, K] for any U >= 0 (U need
 * not equal M); lhs_rows [M] i32 in the context's memory, M = out's rows (forward) or rhs's rows
 * (wgrad); entries at i >= S are never read. A row may be read by several i (a token routed to
 * several experts of the rank). An entry outside [-1, U): TW_ERR_INVALID_ARG naming i and the
 * value (host-memory lhs_rows, checked before any work); on a device, the error word (that
 * row's products are then unspecified). Quantized lhs (forward only): the rowwise data of the
 * [U, K] source quantized as ONE group (per-tensor: scale_inv [1]; 1x128: [K/128, roundup(U,
 * 4)]; MXFP8: [128 ceil(U/128), roundup(K/32, 4)]), row u dequantized with row u's scales; rhs
 * quantized as for tw_grouped_gemm (the same mode). The wgrad takes a plain lhs. Error bound:
 * that of the same GEMM on L (tw_check.h, per version below).
 *
 * Other errors: out must not share bytes with an input, a scale_inv or group_sizes
 *   (TW_ERR_INVALID_ARG: in-place GEMMs are not supported). The ref backend calls OpenBLAS
 *   with 32-bit sizes: M, N or K (per group) above INT_MAX is TW_ERR_UNSUPPORTED.
 *
 * Accumulation model per gpu kernel version (the tests derive their bound from it:
 * tw_gemm_error_bound with u_acc per add; gpu/NOTES-gemm.md):
 *   gg_mma, gg_mma_wide, gg_wgmma: exact products (bf16/f16 x bf16/f16 and fp8 decoded to
 *     bf16/f16 fit f32) summed in the tensor core's f32 accumulator, whose rounding is not
 *     specified as RNE: u_acc = 2^-23 (one f32 ulp per add). gg_wgmma (Hopper wgmma, bf16/f16
 *     only, forward and wgrad) keeps this model: its K-chunks of 16 are added into the f32
 *     accumulator as mma.sync's; in the wgrad, rows past a group's end are zeroed in shared
 *     memory before the wgmma reads them, so they add exact zeros (never NaN from other rows).
 *   gg_fma: exact f32 FMA, RNE (meets the same bound).
 *   gemm_lt (cuBLASLt, CUBLAS_COMPUTE_32F, no TF32) on plain operands: f32 FMAs, u_acc = 2^-23
 *     (the same bound). Mixed plain operands (f32 x bf16/f16, bf16 x f16) are widened to f32
 *     first, exactly, so the products are the same; accumulating into a 16-bit output then
 *     takes the f32 product and one f32 add of the old value before the one rounding.
 *   gg_wgmma_fp8 (Hopper fp8 wgmma, the auto choice for the fp8 forward it takes on sm_90:
 *     per-tensor, 1x128 and 128x128 scales, and 1x128 lhs with 128x128 rhs, and MXFP8 (lhs
 *     rowwise, rhs the rowwise data of the [G*N, K] source, compact or swizzled scale bytes;
 *     or rhs the colwise data of the [G*K, N] source with rhs_op N, the MoE block's fp8_mxfp8
 *     weights: first transposed into [G, N, K] with the same codes and E8M0 bytes, so the same
 *     bits as its rowwise form, at the cost of G*K*N bytes read and written per call and as
 *     many bytes of the context's pad buffer, below); rhs [G, N, K]; and for dense fp8
 *     tw_gemm with a [M, K] rowwise op N, b [N, K] op T, no batch): promoted every 128 along K
 *     (MXFP8: every 32, below). The tensor core sums the exact fp8 x fp8 products of one
 *     128-deep k-block (the last one may be shorter) into a fresh accumulator that keeps
 *     about 14 significant bits (DeepSeek-V3 report; measured ~2^-13 relative on cuBLASLt,
 *     gpu/NOTES-gemm.md): u_in = 2^-13 per add,
 *     min(K,128) products plus one fold of the running partial per 32-deep instruction. Each
 *     block partial is then promoted into an f32 register total, RNE, u = 2^-24:
 *     block scales total = fmaf(partial, sa*sb, total); per-tensor total += partial, then
 *     out = total * (sa[g]*sb[g]) (the same formula as gg_mma's epilogue). With
 *     nb = ceil(K/128) and 2 further f32 roundings (the scale product or final multiply, the
 *     accumulate add): e_acc = (g_in + g_out (1 + g_in)) sum|a||b|, g_in =
 *     gamma(n + ceil(n/32), 2^-13) with n = min(K, 128), g_out = gamma(nb + 2, 2^-24)
 *     (tw_gemm_error_bound_promoted(.., K, 128, 0x1p-13, 0x1p-24, 2, ..) in tw_check.h).
 *     At K >= 128 that is about 1.6% of sum|a||b|, independent of K. Forcing gg_mma_wide or
 *     gg_mma gives the exact-f32 model above for the same operands.
 *     MXFP8 on gg_wgmma_fp8, the same model with blocks of 32: each 32-deep scaling block is one
 *     wgmma k32 into a fresh accumulator (u_in = 2^-13 per add over its <= 32 products; a block
 *     at the end of K may be 16 deep, the rest zeros), then total = fmaf(partial, sa * sb,
 *     total) with the block's decoded E8M0 scales (2^(e-127); 0 gives 2^-127, 0xFF NaN; the
 *     product sa * sb in f32, as gg_mma's promotion), RNE, u = 2^-24; nb = ceil(K/32):
 *     tw_gemm_error_bound_promoted(.., K, 32, 0x1p-13, 0x1p-24, 2, ..), about 0.4% of
 *     sum|a||b| at K >= 32.
 *     Its wgrad (lhs and rhs as the per-group transposed colwise copies, lhs_op = rhs_op = T;
 *     per-tensor, 1x128 or 128x128 scales; or MXFP8 from the colwise data [M, K] and [M, N],
 *     lhs_op = rhs_op = N, compact or swizzled scale bytes; the auto choice on sm_90 for every fp8
 *     scaling mode: current and delayed per-tensor, 1x128, 128x128 and MXFP8, the MoE block's
 *     fp8 wgrads) has the same model with the
 *     contraction over the group's m_g tokens: the k-blocks are the group's tokens
 *     128b..128b+127 counted from the group's first row (the colwise quantizer's blocks,
 *     wherever the group starts), the last one m_g % 128 deep, tokens past m_g adding exact
 *     zeros; per element of out[g] the bound is tw_gemm_error_bound_promoted(.., m_g, 128,
 *     0x1p-13, 0x1p-24, 2, ..). An empty group is +0 exactly, as in every version.
 *     MXFP8 wgrad: the same with blocks of 32 tokens: each of the colwise quantizer's 32-token
 *     blocks of the group (counted from its first row; the last one m_g % 32 deep, tokens past
 *     m_g adding exact zeros; blocks wholly past m_g skipped) is one wgmma k32 into a fresh
 *     accumulator (u_in = 2^-13 per add), then total = fmaf(partial, sa * sb, total) with the
 *     block's decoded E8M0 scales of row k and column n (as the forward), RNE, u = 2^-24:
 *     tw_gemm_error_bound_promoted(.., m_g, 32, 0x1p-13, 0x1p-24, 2, ..) per element of out[g].
 *     Memory: it first copies both operands (MXFP8: transposed) into token-padded matrices,
 *     (K + N) * 128 * (ceil(M/128) + G) bytes of device memory that the context keeps and grows (not in
 *     tw_ctx_memory's ledger; inside a graph capture the call allocates and frees its own). An
 *     operand quantized token-padded (tw_quantize.h opts.col_padded) is read in place: no copy
 *     and no buffer for it (the copy costs 8-23% of the wgrad on the bench shapes, H200).
 *     The forward's MXFP8 colwise rhs copy (above) uses the same buffer, the same way.
 *     Subnormal codes (probe: tests/fp8_accum_gpu_test.c, gpu/NOTES-gemm.md "fp8 accumulator
 *     probe"): inside one 32-deep instruction the tensor core aligns the products (and the
 *     running partial) to the largest product's exponent fields, where a subnormal code counts
 *     at the smallest normal exponent (2^-6 e4m3, 2^-14 e5m2) although its value may be 8x (e4m3)
 *     or 4x (e5m2) smaller, and zero codes do not count. So in every sum|a||b| of this model
 *     each quantized operand's magnitude is lifted: |x|^ = max(|x|, 2^emin * scale) for a
 *     nonzero code, 0 for a zero code (tw_fp8_lift_subnormal_codes in tw_check.h; goldens store
 *     it as abs_prod_lifted.npy). It equals sum|a||b| when no code is subnormal. Measured: a
 *     product of 2^-9 x 448 (e4m3 codes 0x01 x 0x7E) next to others loses 2^-10.8 of the
 *     largest product, where the unlifted model allows about 2^-11.4; 2^-13 of the largest
 *     lifted product at most in every probe grid. (This was the gap the session-5 fuzz found:
 *     `twin fuzz --backend gpu --op wgrad --seconds 40 --seed 57`, 5 of 8,330 cases.)
 *   gemm_lt (cuBLASLt) with fp8 on Hopper: ~14 mantissa bits between promotions (measured
 *     ~2^-13 relative) with no documented promotion interval: no model, so auto never picks it
 *     for fp8 (the tests, forcing it, give it u_acc = 2^-13 over all of K with the lifted
 *     magnitudes).
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
  int col_padded; /* colwise data in tw_quantize.h's token-padded layout (wgrad operands only) */
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

/* Row-gathered lhs (above): lhs [U, K], lhs_rows [M] i32. */
tw_status tw_grouped_gemm_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                               const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                               tw_tensor *out, int accumulate);
tw_status tw_grouped_gemm_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                     const tw_operand *rhs, tw_op rhs_op,
                                     const tw_tensor *group_sizes, tw_tensor *out, int accumulate);

#ifdef __cplusplus
}
#endif
#endif
