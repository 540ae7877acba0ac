/* twin grouped quantize / dequantize.
 *
 * Input x [M, K] (f32, bf16 or f16; M >= 0, K >= 1), split along M into G contiguous groups by
 * group_sizes [G] (i32, in the context's memory): group g holds rows [o_g, o_g + m_g) with
 * o_g = sum_{j<g} m_j. S = sum_g m_g may be less than M (the padded buffers of expert routing):
 * rows S..M-1 ("the tail") are neither read nor written, in any output. Every output element
 * that belongs to no group is left untouched, so callers (and twin's checker) see exactly
 * which elements an operation wrote. m_g = 0 is allowed and writes nothing but its own
 * per-group slots (amax, scale_inv of tensor scaling).
 * Errors: G = 0, m_g < 0 or S > M are TW_ERR_INVALID_ARG (on gpu with sizes in device memory:
 * the device error word; nothing is written out of bounds).
 *
 * All scale arithmetic is f32. fp8_max = 448 (e4m3) or 57344 (e5m2). sat(v) = RNE to the fp8
 * format with satfinite (tw_numerics.h). amax is max |x| over the elements a scale covers;
 * a NaN element makes that amax NaN (fmaxf would hide it; twin does not), +-inf makes it inf.
 * NaN outputs are canonical, because CPUs and GPUs give the NaN of an arithmetic result
 * different signs and payloads: a NaN q is the positive code (0x7F e4m3, 0x7E e5m2) whatever
 * the sign of x, and every NaN written to an f32/bf16/f16 output (amax, scale_inv,
 * dequantized values) is the positive quiet NaN 0x7FC00000 / 0x7FC0 / 0x7E00.
 *
 * Scaling modes
 * -------------
 * TENSOR_CURRENT (one scale per group, from this call's data):
 *   amax_g = max_{rows of g, all k} |x|              (0 for an empty group)
 *   scale_g = compute_scale(amax_g) where
 *     compute_scale(a) = 1                       if a == 0 or a is not finite (inf/NaN)
 *                      = fp8_max / a            (f32 division), FLT_MAX if that is inf
 *                        then, if opts.pow2_scales, the mantissa bits are cleared.
 *   q = sat(x * scale_g);  scale_inv[g] = 1 / scale_g;  amax[g] = amax_g
 *   (pow2 of FLT_MAX gives 2^127. amax inf/NaN: scale 1, so inf saturates to +-fp8_max and
 *   NaN stays NaN.)
 * TENSOR_DELAYED (one stored scale per group, from earlier steps):
 *   q = sat(x * scale[g]) with scale = opts.scale [G] f32, used as given (0 gives
 *   scale_inv inf); scale_inv[g] = 1 / scale[g]; amax[g] = amax_g of this call's data.
 *   tw_delayed_scale_update() then advances the history (TE's DelayedScaleQuantizer.update;
 *   formula below).
 * MXFP8_1D (blocks of 32 along one axis, E8M0 scales):
 *   rowwise: blocks of 32 consecutive k in one row; colwise: blocks of 32 consecutive rows of
 *   one group in one column (blocks never cross a group). A block at the end of a row (K % 32)
 *   or of a group (m_g % 32) is partial: it covers only the elements that exist.
 *   e = tw_f32_to_e8m0_ceil(amax_block * (1/fp8_max))  [the reciprocal is the f32 constant]
 *   q = sat(x * 2^(127-e)) computed in f32 (2^(127-e) is exact: e=254 gives 2^-127, a
 *   subnormal; e=255 (NaN amax) gives NaN, so the block becomes NaN).
 *   scale_inv byte = e. (TE's GPU multiplies bf16 inputs in bf16; the codes are the same,
 *   since both products are exact wherever the result is not far below fp8's range.)
 * BLOCK_1x128 (DeepSeek-style fp8 block scaling, f32 scales):
 *   rowwise: blocks of 128 consecutive k in one row; colwise: blocks of 128 consecutive rows
 *   of one group in one column. Partial blocks as for MXFP8.
 *   scale = compute_scale(amax_block) (pow2_scales honoured), q = sat(x * scale),
 *   scale_inv = 1 / scale.
 * BLOCK_128x128: one scale per 128x128 tile (128 rows of one group x 128 columns); tiles at
 *   the end of a group or of K are partial. Same formula as 1x128. The colwise output reuses
 *   the same per-tile scale (a tile is symmetric in the two orientations).
 * amax (optional for MXFP8 and BLOCK_*: pass none to skip it) is always the per-group
 *   amax_g above, whatever the block size.
 *
 * Data layouts (q dtype e4m3 or e5m2, one byte per element)
 * ------------
 * rowwise data: [M, K], same layout as x.
 * colwise data:
 *   TENSOR_* and BLOCK_*: per-group transposed. Group g's block is [K, m_g] row-major at
 *     element offset o_g*K (the "T" copy Hopper's fp8 GEMM needs for wgrad and dgrad).
 *   MXFP8_1D: not transposed: [M, K] like x, only the scale orientation differs (TE's "NN").
 *   Token-padded (opts.col_padded = 1; TENSOR_* and BLOCK_* only, MXFP8 is
 *     TW_ERR_INVALID_ARG): col_data [K, 128*T_cap] (T_cap below), group g's element
 *     (row o_g + i, column k) at [k][128*T(g) + i]: every group starts on a 128-token
 *     boundary of one row-major matrix whose rows are 16-byte multiples apart, the operand
 *     layout of DeepGEMM's k-grouped wgrad. Each group's padding columns 128*T(g) + m_g ..
 *     128*T(g+1) - 1 are written as code 0 in every row (so a reader may take whole 128-token
 *     blocks); columns from 128*T(G) on are untouched. Same codes and scales as the default
 *     layout, only the positions differ. The grouped wgrad reads it in place; from the
 *     default layout the gpu wgrad first copies both operands into this one (a pass over
 *     (K + N) * M bytes each way, ~10% of a large fp8 wgrad: gpu/NOTES-gemm.md).
 *
 * Scale layouts (scale_inv). "T" below is the number of 128-row tiles over all groups,
 * T(g) = sum_{j<g} ceil(m_j/128); capacities use the worst case over group sizes (at most
 * min(G, M) groups are non-empty), T_cap = floor((M + 127*min(G, M)) / 128)
 * (tw_quantize_output_shapes()).
 *   TENSOR_*:         [G] f32, one value per group (empty groups too). Written to
 *                     row_scale_inv when rowwise data is produced and to col_scale_inv when
 *                     colwise data is produced; with both, col_scale_inv may be none (then
 *                     row_scale_inv is the one shared buffer) or the same buffer.
 *   MXFP8_1D rowwise: per group a [128*ceil(m_g/128), roundup(ceil(K/32), 4)] E8M0 block,
 *                     blocks concatenated in group order (group g's block starts at
 *                     128*T(g) rows). Capacity [128*T_cap, roundup(ceil(K/32),4)].
 *            colwise: per group a [4*ceil(m_g/128), roundup(K, 128)] block (rows are the
 *                     32-row blocks of the group, padded to 4), concatenated from row 4*T(g).
 *                     Capacity [4*T_cap, roundup(K,128)].
 *     Padding entries (rows/cols past the data) are written as 0x00 for every group; padding
 *     that belongs to no group (past the last group's block) is untouched.
 *     Two byte orders, chosen by opts.mxfp8_swizzled:
 *       compact  (0): each group's padded block row-major.
 *       swizzled (1): cuBLAS's 128x4 tiling, per group. For a group's rowwise block S[R, C]
 *         (R % 128 == 0, C % 4 == 0) element (r, c), r = 128a + 32b + d, c = 4e + f, lands at
 *         ((a*(C/4) + e)*32 + d)*16 + b*4 + f within the group's block. A colwise block
 *         [Rc, Cc] is transposed to [Cc, Rc] (Cc % 128 == 0, Rc % 4 == 0) and swizzled the
 *         same way. This is the layout the GEMMs read.
 *   BLOCK_1x128 rowwise: [ceil(K/128), roundup(M, 4)] f32, element [kb][row]
 *                       ("MN-major", the layout block-scaled GEMMs read). Tail rows untouched.
 *               colwise: [T_cap, roundup(K, 4)] f32: group g's row-blocks start at T(g);
 *                       element [T(g) + b][k] scales rows 128b.. of group g in column k.
 *   BLOCK_128x128 rowwise: [T_cap, ceil(K/128)] f32, element [T(g) + b][kb].
 *                 colwise: the transpose, [ceil(K/128), T_cap], element [kb][T(g) + b].
 *   BLOCK_* entries that scale no data (padding columns, slots past the last group) are
 *   untouched; unlike MXFP8 no GEMM reads them.
 *
 * Dequantize is the inverse map to f32 (or bf16/f16 by RNE of the f32 value):
 *   x' = decode(q) * scale_inv   (f32 multiply in this order; E8M0 decoded with
 *                                 tw_e8m0_to_f32, so 0xFF gives NaN)
 * from either orientation; the output is always [M, K] and tail rows stay untouched. With
 * tensor scaling, colwise dequantize reads col_scale_inv, or row_scale_inv when that is none.
 *
 * Alignment rules (enforced for both backends, so a program that passes on ref runs on gpu):
 *   x, outputs: element-aligned (no further rule); K >= 1; M >= 0.
 *   MXFP8 and BLOCK modes need no K or m_g multiple: partial blocks are defined above.
 *   opts->pow2_scales, opts->mxfp8_swizzled and opts->col_padded are 0 or 1.
 *   No output overlaps an input or another output (nothing runs in place); the one exception
 *   is tensor scaling's col_scale_inv, which may be row_scale_inv's very buffer.
 */
#ifndef TWIN_TW_QUANTIZE_H
#define TWIN_TW_QUANTIZE_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_SCALE_NONE = 0,         /* not quantized */
  TW_SCALE_TENSOR_CURRENT = 1,
  TW_SCALE_TENSOR_DELAYED = 2,
  TW_SCALE_MXFP8_1D = 3,
  TW_SCALE_BLOCK_1x128 = 4,
  TW_SCALE_BLOCK_128x128 = 5,
  TW_SCALE_COUNT
} tw_scaling;

const char *tw_scaling_name(tw_scaling s); /* "none", "current", "delayed", "mxfp8", "block1x128", "block128x128" */
int tw_scaling_from_name(const char *name, tw_scaling *out);

typedef enum { TW_ROWWISE = 1, TW_COLWISE = 2, TW_ROWWISE_COLWISE = 3 } tw_qlayout;

/* A quantized tensor: rowwise and/or colwise data with their scale_inv, per-group amax. */
typedef struct {
  tw_scaling mode;
  tw_dtype qdtype;         /* TW_E4M3 or TW_E5M2 */
  int64_t rows, cols;      /* logical M, K of the source */
  int mxfp8_swizzled;      /* MXFP8 only: scale_inv bytes in the swizzled (GEMM) order */
  tw_tensor row_data;      /* [M, K] qdtype, or none */
  tw_tensor row_scale_inv; /* see the layouts above, or none */
  tw_tensor col_data;      /* colwise layout above, or none */
  tw_tensor col_scale_inv; /* TENSOR_*: the same buffer as row_scale_inv */
  tw_tensor amax;          /* [G] f32 per-group amax (TENSOR_*; optional for block modes) */
  int col_padded;          /* col_data in the token-padded layout above */
} tw_qtensor;

typedef struct {
  size_t size;                /* sizeof(tw_quantize_opts) */
  tw_scaling mode;
  tw_dtype qdtype;            /* TW_E4M3 or TW_E5M2 */
  tw_qlayout layout;
  int pow2_scales;            /* TENSOR_CURRENT and BLOCK_*: truncate scales to powers of 2 */
  int mxfp8_swizzled;         /* MXFP8: write scales swizzled (1) or compact (0) */
  tw_tensor scale;            /* TENSOR_DELAYED: [G] f32 stored scales */
  int col_padded;             /* colwise data token-padded (0 or 1; TENSOR_* and BLOCK_*) */
} tw_quantize_opts;

#define TW_QUANTIZE_OPTS_INIT \
  {sizeof(tw_quantize_opts), TW_SCALE_TENSOR_CURRENT, TW_E4M3, TW_ROWWISE, 0, 1, {0, TW_F32, -1, {0, 0, 0, 0}, TW_MEM_HOST}, 0}

/* Shapes of the outputs for (mode, layout, M, K, G); a component not produced has ndim -1.
 * Fills the dtypes and shapes of *q (data pointers NULL) so the caller can allocate. */
tw_status tw_quantize_output_shapes(const tw_quantize_opts *opts, int64_t M, int64_t K,
                                    int64_t G, tw_qtensor *q);

/* Quantizes x [M, K] by groups. q's buffers must have the shapes from
 * tw_quantize_output_shapes (amax may be none for BLOCK/MXFP8 modes). */
tw_status tw_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                              const tw_quantize_opts *opts, tw_qtensor *q);

/* out [M, K] (f32/bf16/f16) = dequantize of q's rowwise (colwise=0) or colwise (1) data. */
tw_status tw_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                int colwise, tw_tensor *out);

/* compute_scale above, in f32: 1 for amax 0 or not finite, else fp8_max / amax (FLT_MAX if
 * that overflows), mantissa cleared when pow2_scales. One definition for every host user
 * (ref, the sharded executor); the GPU's device copy is tested against it. */
float tw_scale_from_amax(float amax, float fp8_max, int pow2_scales);

typedef enum { TW_AMAX_MAX = 0, TW_AMAX_MOST_RECENT = 1 } tw_amax_algo;

/* Delayed scaling update, per group g (TE's DelayedScaleQuantizer.update), f32:
 *   hist[g][0] = amax[g]
 *   a = max_h hist[g][h] (MAX; a NaN anywhere gives NaN) or hist[g][0] (MOST_RECENT)
 *   if a > 0 and finite: s = fp8_max / a, FLT_MAX if that is inf (as compute_scale);
 *                        scale[g] = s / 2^margin
 *   else scale[g] is unchanged
 *   hist[g] = roll(hist[g], -1) (hist[h] = hist[h+1], the old hist[0] moves to the end);
 *   hist[g][0] = 0
 * amax_history [G, H] f32 (in/out, H >= 1), scale [G] f32 (in/out), amax [G] f32.
 * margin is an integer in [0, 127] (TE's recipe margin is an int): 2^margin is then exact,
 * so every backend gets the same bits. */
tw_status tw_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                  const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                  float margin);

#ifdef __cplusplus
}
#endif
#endif
