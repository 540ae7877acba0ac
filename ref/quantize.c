/* The oracle's grouped quantize, dequantize and delayed-scale update (tw_quantize.h).
 *
 * Straight loops over groups and scaling blocks. Every number is computed as the header's
 * formulas say, in f32, so the header is the whole specification:
 *   amax   = max |x| over the block (NaN if any element is NaN)
 *   scale  = compute_scale(amax) (tensor current, block modes), opts.scale[g] (delayed),
 *            2^(127-e) with e = e8m0_ceil(amax * (1/fp8_max)) (MXFP8)
 *   q      = sat(x * scale)                    (f32 multiply, RNE + satfinite to fp8)
 *   x'     = decode(q) * scale_inv              (dequantize)
 * Where each block's scale lives is one function (scale_slot), shared by quantize and
 * dequantize; where each element's code lives is another (data_pos).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/validate.h"
#include "ref/quantize_layout.h"
#include "ref/ref.h"
#include "twin/tw_numerics.h"

/* ---- scalar codecs (tw_numerics.h) ------------------------------------------------------ */

/* NaN results of arithmetic are written canonically (positive, one payload): CPUs and GPUs
 * give NaN products different signs and payloads, and goldens compare bits. */
static float canonical(float v) { return isnan(v) ? NAN : v; }

static uint8_t fp8_encode_sat(float x, tw_dtype t) {
  x = canonical(x); /* NaN -> 0x7F (e4m3) or 0x7E (e5m2) */
  return t == TW_E4M3 ? tw_f32_to_e4m3(x, 1) : tw_f32_to_e5m2(x, 1);
}

static float fp8_decode(uint8_t c, tw_dtype t) {
  return t == TW_E4M3 ? tw_e4m3_to_f32(c) : tw_e5m2_to_f32(c);
}

/* ---- elements -------------------------------------------------------------------------- */

static float load_x(const tw_tensor *x, int64_t i) {
  switch (x->dtype) {
    case TW_BF16: return tw_bf16_to_f32(((const uint16_t *)x->data)[i]);
    case TW_F16: return tw_f16_to_f32(((const uint16_t *)x->data)[i]);
    default: return ((const float *)x->data)[i];
  }
}

static void store_out(tw_tensor *out, int64_t i, float v) {
  switch (out->dtype) {
    case TW_BF16: ((uint16_t *)out->data)[i] = tw_f32_to_bf16(v); break;
    case TW_F16: ((uint16_t *)out->data)[i] = tw_f32_to_f16(v); break;
    default: ((float *)out->data)[i] = v; break;
  }
}

/* max |v| that lets a NaN through (fmaxf would drop it) */
static float amax_update(float amax, float v) {
  float a = fabsf(v);
  return (isnan(a) || a > amax) ? a : amax;
}

static double fp8_max_of(tw_dtype t) { return t == TW_E4M3 ? 448.0 : 57344.0; }

/* compute_scale of tw_quantize.h (tensor current scaling and the block modes). */
static float compute_scale(float amax, float fp8_max, int pow2) {
  return tw_scale_from_amax(amax, fp8_max, pow2);
}

/* ---- layout ----------------------------------------------------------------------------- */

typedef struct {
  tw_scaling mode;
  int swizzled;             /* MXFP8 scale byte order */
  int64_t M, K, G;
  const int32_t *sizes;     /* m_g */
  int64_t *off;             /* [G+1] o_g, first row of group g */
  int64_t *tile;            /* [G+1] T(g), 128-row tiles before group g */
  int64_t col_pitch;        /* token-padded colwise data: its row length 128*T_cap; else 0 */
} groups;

static tw_status groups_init(groups *gr, tw_scaling mode, int swizzled, int64_t M, int64_t K,
                             const int32_t *sizes, int64_t G) {
  gr->mode = mode;
  gr->swizzled = swizzled;
  gr->M = M;
  gr->K = K;
  gr->G = G;
  gr->sizes = sizes;
  gr->col_pitch = 0;
  gr->off = malloc(sizeof(int64_t) * (size_t)(G + 1));
  gr->tile = malloc(sizeof(int64_t) * (size_t)(G + 1));
  if (!gr->off || !gr->tile) {
    free(gr->off);
    free(gr->tile);
    return tw_error(TW_ERR_MEMORY, "quantize: out of host memory for %lld groups", (long long)G);
  }
  tw_group_offsets(sizes, G, gr->off);
  tw_group_tile_offsets(sizes, G, 128, gr->tile);
  return TW_OK;
}

static void groups_free(groups *gr) {
  free(gr->off);
  free(gr->tile);
}

static int transposed_colwise(tw_scaling mode) { return mode != TW_SCALE_MXFP8_1D; }

/* The token-padded colwise layout's row length 128*T_cap (tw_quantize.h). */
static int64_t padded_pitch(int64_t M, int64_t G) {
  int64_t Gn = G < M ? G : M;
  return 128 * ((M + 127 * Gn) / 128);
}

/* Storage index of element (row o_g + lr, column k) in the default layouts. */
static int64_t default_pos(const groups *gr, int colwise, int64_t g, int64_t lr, int64_t k) {
  if (colwise && transposed_colwise(gr->mode))
    return gr->off[g] * gr->K + k * gr->sizes[g] + lr; /* group g's [K, m_g] block */
  return (gr->off[g] + lr) * gr->K + k;
}

/* Storage index of element (row o_g + lr, column k) in rowwise or colwise data. */
static int64_t data_pos(const groups *gr, int colwise, int64_t g, int64_t lr, int64_t k) {
  if (colwise && gr->col_pitch) return k * gr->col_pitch + 128 * gr->tile[g] + lr; /* [K, 128*T_cap] */
  return default_pos(gr, colwise, g, lr, k);
}

/* Token-padded colwise data: code 0 in group g's padding columns m_g .. 128*ceil(m_g/128). */
static void zero_padding(const groups *gr, uint8_t *col_data, int64_t g) {
  int64_t m = gr->sizes[g], pad = 128 * tw_ceil_div(m, 128) - m;
  for (int64_t k = 0; pad > 0 && k < gr->K; k++) memset(col_data + data_pos(gr, 1, g, m, k), 0, (size_t)pad);
}

/* Storage index, in a scale_inv tensor whose rows hold `ld` entries (its shape[1]), of the
 * scale that covers element (o_g + lr, k) in the given orientation. */
static int64_t scale_slot(const groups *gr, int colwise, int64_t ld, int64_t g, int64_t lr,
                          int64_t k) {
  switch (gr->mode) {
    case TW_SCALE_TENSOR_CURRENT:
    case TW_SCALE_TENSOR_DELAYED:
      return g;
    case TW_SCALE_MXFP8_1D:
      if (!colwise) { /* group block [128*ceil(m_g/128), ld], from row 128*T(g) */
        int64_t base = 128 * gr->tile[g] * ld;
        return base + (gr->swizzled ? ref_mxfp8_swizzle_index(lr, k / 32, ld) : lr * ld + k / 32);
      } else { /* group block [4*ceil(m_g/128), ld], from row 4*T(g); swizzled as its transpose */
        int64_t base = 4 * gr->tile[g] * ld, rows = 4 * tw_ceil_div(gr->sizes[g], 128);
        return base + (gr->swizzled ? ref_mxfp8_swizzle_index(k, lr / 32, rows) : (lr / 32) * ld + k);
      }
    case TW_SCALE_BLOCK_1x128:
      if (!colwise) return (k / 128) * ld + gr->off[g] + lr;  /* [kb][row] */
      return (gr->tile[g] + lr / 128) * ld + k;                /* [T(g) + b][k] */
    default: /* TW_SCALE_BLOCK_128x128 */
      if (!colwise) return (gr->tile[g] + lr / 128) * ld + k / 128; /* [T(g) + b][kb] */
      return (k / 128) * ld + gr->tile[g] + lr / 128;               /* [kb][T(g) + b] */
  }
}

static int64_t scale_ld(const tw_tensor *s) { return s->ndim == 2 ? s->shape[1] : 0; }

/* ---- quantize --------------------------------------------------------------------------- */

typedef struct {
  const groups *gr;
  const tw_tensor *x;
  tw_dtype qdtype;
  int row, col;                /* which orientations the layout asks for */
  uint8_t *row_data, *col_data; /* (NULL when empty: M = 0) */
} qctx;

/* max |x| over rows [o_g + r0, o_g + r1) x columns [c0, c1) */
static float rect_amax(const qctx *c, int64_t g, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; r++)
    for (int64_t k = c0; k < c1; k++)
      amax = amax_update(amax, load_x(c->x, (c->gr->off[g] + r) * c->gr->K + k));
  return amax;
}

/* q = sat(x * scale) for the rectangle, into the rowwise and/or colwise data. */
static void rect_quantize(const qctx *c, int64_t g, int64_t r0, int64_t r1, int64_t c0,
                          int64_t c1, float scale, int to_row, int to_col) {
  for (int64_t r = r0; r < r1; r++)
    for (int64_t k = c0; k < c1; k++) {
      float v = load_x(c->x, (c->gr->off[g] + r) * c->gr->K + k) * scale;
      uint8_t code = fp8_encode_sat(v, c->qdtype);
      if (to_row) c->row_data[data_pos(c->gr, 0, g, r, k)] = code;
      if (to_col) c->col_data[data_pos(c->gr, 1, g, r, k)] = code;
    }
}

static void put_f32(tw_tensor *s, int64_t i, float v) { ((float *)s->data)[i] = canonical(v); }

static float mxfp8_multiplier(uint8_t e) {
  return e == 0xFF ? NAN : ldexpf(1.0f, 127 - (int)e); /* exact; e = 254 gives 2^-127 */
}

/* Zero group g's padded MXFP8 scale block (every entry; real ones are overwritten after). */
static void mxfp8_clear_group(const groups *gr, tw_tensor *s, int colwise, int64_t g) {
  int64_t ld = scale_ld(s), tiles = tw_ceil_div(gr->sizes[g], 128);
  int64_t rows = colwise ? 4 * tiles : 128 * tiles;
  int64_t base = (colwise ? 4 : 128) * gr->tile[g] * ld;
  if (rows * ld > 0) memset((uint8_t *)s->data + base, 0, (size_t)(rows * ld));
}

static void quantize_group(const qctx *c, const tw_quantize_opts *opts, tw_qtensor *q, int64_t g) {
  const groups *gr = c->gr;
  int64_t m = gr->sizes[g], K = gr->K;
  int row = c->row, col = c->col;
  float fp8_max = (float)fp8_max_of(c->qdtype);
  switch (gr->mode) {
    case TW_SCALE_TENSOR_CURRENT:
    case TW_SCALE_TENSOR_DELAYED: {
      float scale = gr->mode == TW_SCALE_TENSOR_CURRENT
                        ? compute_scale(rect_amax(c, g, 0, m, 0, K), fp8_max, opts->pow2_scales)
                        : ((const float *)opts->scale.data)[g];
      rect_quantize(c, g, 0, m, 0, K, scale, row, col);
      float scale_inv = 1.0f / scale;
      if (row) put_f32(&q->row_scale_inv, g, scale_inv);
      if (col && !tw_tensor_is_none(&q->col_scale_inv)) put_f32(&q->col_scale_inv, g, scale_inv);
      break;
    }
    case TW_SCALE_MXFP8_1D: {
      const float inv_max = 1.0f / fp8_max; /* the f32 constant, as the GPU uses it */
      if (row) {
        tw_tensor *s = &q->row_scale_inv;
        mxfp8_clear_group(gr, s, 0, g);
        for (int64_t r = 0; r < m; r++)
          for (int64_t k0 = 0; k0 < K; k0 += 32) {
            int64_t k1 = k0 + 32 < K ? k0 + 32 : K;
            uint8_t e = tw_f32_to_e8m0_ceil(rect_amax(c, g, r, r + 1, k0, k1) * inv_max);
            rect_quantize(c, g, r, r + 1, k0, k1, mxfp8_multiplier(e), 1, 0);
            ((uint8_t *)s->data)[scale_slot(gr, 0, scale_ld(s), g, r, k0)] = e;
          }
      }
      if (col) {
        tw_tensor *s = &q->col_scale_inv;
        mxfp8_clear_group(gr, s, 1, g);
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
          int64_t r1 = r0 + 32 < m ? r0 + 32 : m;
          for (int64_t k = 0; k < K; k++) {
            uint8_t e = tw_f32_to_e8m0_ceil(rect_amax(c, g, r0, r1, k, k + 1) * inv_max);
            rect_quantize(c, g, r0, r1, k, k + 1, mxfp8_multiplier(e), 0, 1);
            ((uint8_t *)s->data)[scale_slot(gr, 1, scale_ld(s), g, r0, k)] = e;
          }
        }
      }
      break;
    }
    case TW_SCALE_BLOCK_1x128: {
      if (row) {
        tw_tensor *s = &q->row_scale_inv;
        for (int64_t r = 0; r < m; r++)
          for (int64_t k0 = 0; k0 < K; k0 += 128) {
            int64_t k1 = k0 + 128 < K ? k0 + 128 : K;
            float scale = compute_scale(rect_amax(c, g, r, r + 1, k0, k1), fp8_max, opts->pow2_scales);
            rect_quantize(c, g, r, r + 1, k0, k1, scale, 1, 0);
            put_f32(s, scale_slot(gr, 0, scale_ld(s), g, r, k0), 1.0f / scale);
          }
      }
      if (col) {
        tw_tensor *s = &q->col_scale_inv;
        for (int64_t r0 = 0; r0 < m; r0 += 128) {
          int64_t r1 = r0 + 128 < m ? r0 + 128 : m;
          for (int64_t k = 0; k < K; k++) {
            float scale = compute_scale(rect_amax(c, g, r0, r1, k, k + 1), fp8_max, opts->pow2_scales);
            rect_quantize(c, g, r0, r1, k, k + 1, scale, 0, 1);
            put_f32(s, scale_slot(gr, 1, scale_ld(s), g, r0, k), 1.0f / scale);
          }
        }
      }
      break;
    }
    default: /* TW_SCALE_BLOCK_128x128: one scale per tile, both orientations */
      for (int64_t r0 = 0; r0 < m; r0 += 128) {
        int64_t r1 = r0 + 128 < m ? r0 + 128 : m;
        for (int64_t k0 = 0; k0 < K; k0 += 128) {
          int64_t k1 = k0 + 128 < K ? k0 + 128 : K;
          float scale = compute_scale(rect_amax(c, g, r0, r1, k0, k1), fp8_max, opts->pow2_scales);
          rect_quantize(c, g, r0, r1, k0, k1, scale, row, col);
          if (row) put_f32(&q->row_scale_inv, scale_slot(gr, 0, scale_ld(&q->row_scale_inv), g, r0, k0), 1.0f / scale);
          if (col) put_f32(&q->col_scale_inv, scale_slot(gr, 1, scale_ld(&q->col_scale_inv), g, r0, k0), 1.0f / scale);
        }
      }
      break;
  }
  if (col && gr->col_pitch) zero_padding(gr, c->col_data, g);
  if (!tw_tensor_is_none(&q->amax)) put_f32(&q->amax, g, rect_amax(c, g, 0, m, 0, K));
}

tw_status ref_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                               const tw_quantize_opts *opts, tw_qtensor *q) {
  (void)ctx;
  groups gr;
  TW_TRY(groups_init(&gr, opts->mode, opts->mxfp8_swizzled, x->shape[0], x->shape[1],
                     (const int32_t *)group_sizes->data, group_sizes->shape[0]));
  int row = (opts->layout & TW_ROWWISE) != 0, col = (opts->layout & TW_COLWISE) != 0;
  if (col && opts->col_padded) gr.col_pitch = padded_pitch(gr.M, gr.G);
  qctx c = {&gr, x, opts->qdtype, row, col, row ? q->row_data.data : NULL, col ? q->col_data.data : NULL};
  for (int64_t g = 0; g < gr.G; g++) quantize_group(&c, opts, q, g);
  groups_free(&gr);
  return TW_OK;
}

/* ---- dequantize ------------------------------------------------------------------------- */

/* decode(q) * scale_inv of every element of the groups, in one orientation. The value of
 * element (o_g + lr, k) goes to out[out_pos] where out_pos is its position in the [M, K]
 * source (as_stored = 0) or in the data as the default layout stores it (as_stored = 1; a
 * token-padded colwise copy is read from its padded positions and written unpadded). */
static void dequantize_groups(const groups *gr, tw_dtype qdtype, int colwise, const tw_tensor *data,
                              const tw_tensor *scale_inv, int as_stored, tw_tensor *out) {
  int64_t ld = scale_ld(scale_inv);
  const uint8_t *codes = data->data;
  for (int64_t g = 0; g < gr->G; g++)
    for (int64_t lr = 0; lr < gr->sizes[g]; lr++)
      for (int64_t k = 0; k < gr->K; k++) {
        int64_t at = data_pos(gr, colwise, g, lr, k), slot = scale_slot(gr, colwise, ld, g, lr, k);
        float s = gr->mode == TW_SCALE_MXFP8_1D ? tw_e8m0_to_f32(((const uint8_t *)scale_inv->data)[slot])
                                                : ((const float *)scale_inv->data)[slot];
        float v = fp8_decode(codes[at], qdtype) * s;
        store_out(out, as_stored ? default_pos(gr, colwise, g, lr, k) : (gr->off[g] + lr) * gr->K + k, canonical(v));
      }
}

tw_status ref_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                 int colwise, tw_tensor *out) {
  (void)ctx;
  groups gr;
  TW_TRY(groups_init(&gr, q->mode, q->mxfp8_swizzled, q->rows, q->cols,
                     (const int32_t *)group_sizes->data, group_sizes->shape[0]));
  if (colwise && q->col_padded) gr.col_pitch = padded_pitch(gr.M, gr.G);
  const tw_tensor *s = colwise ? &q->col_scale_inv : &q->row_scale_inv;
  if (colwise && tw_tensor_is_none(s)) s = &q->row_scale_inv; /* tensor scaling shares it */
  dequantize_groups(&gr, q->qdtype, colwise, colwise ? &q->col_data : &q->row_data, s, 0, out);
  groups_free(&gr);
  return TW_OK;
}

tw_status ref_dequantize_operand(const tw_operand *o, const int32_t *group_sizes, int64_t G,
                                 float *out) {
  const char *op = "dequantize_operand";
  if (!o || !out) return tw_error(TW_ERR_NULL, "%s: operand or out is NULL", op);
  int64_t M = o->src_rows, K = o->src_cols, n = tw_tensor_numel(&o->data);
  int padded = o->mode != TW_SCALE_NONE && o->colwise && o->col_padded;
  if (padded && (o->mode == TW_SCALE_MXFP8_1D || G < 1))
    return tw_error(TW_ERR_INVALID_ARG, "%s: a token-padded colwise operand needs tensor or block scaling and "
                    "G >= 1 (got %s, G = %lld)", op, tw_scaling_name(o->mode), (long long)G);
  if (padded && n != K * padded_pitch(M, G))
    return tw_error(TW_ERR_SHAPE, "%s: token-padded data has %lld elements but the source [%lld, %lld] in %lld "
                    "groups pads to [%lld, %lld]", op, (long long)n, (long long)M, (long long)K, (long long)G,
                    (long long)K, (long long)padded_pitch(M, G));
  if (!padded && n != M * K)
    return tw_error(TW_ERR_SHAPE, "%s: data has %lld elements but the source is [%lld, %lld]", op,
                    (long long)n, (long long)M, (long long)K);
  if (o->mode == TW_SCALE_NONE) {
    for (int64_t i = 0; i < n; i++) out[i] = load_x(&o->data, i);
    return TW_OK;
  }
  if (!tw_dtype_is_fp8(o->data.dtype))
    return tw_error(TW_ERR_DTYPE, "%s: quantized data has dtype %s, expected e4m3 or e5m2", op,
                    tw_dtype_name(o->data.dtype) ? tw_dtype_name(o->data.dtype) : "?");
  if (G < 1) return tw_error(TW_ERR_INVALID_ARG, "%s: G = %lld (need G >= 1)", op, (long long)G);
  int32_t *equal = NULL;
  if (!group_sizes) { /* the uniform form: G groups of M / G rows */
    if (M % G != 0)
      return tw_error(TW_ERR_SHAPE, "%s: %lld rows do not split into %lld equal groups", op,
                      (long long)M, (long long)G);
    equal = malloc(sizeof(int32_t) * (size_t)G);
    if (!equal) return tw_error(TW_ERR_MEMORY, "%s: out of host memory", op);
    for (int64_t g = 0; g < G; g++) equal[g] = (int32_t)(M / G);
    group_sizes = equal;
  }
  int64_t sum = 0;
  for (int64_t g = 0; g < G; g++) sum += group_sizes[g] < 0 ? M + 1 : group_sizes[g];
  tw_status st = TW_OK;
  if (sum > M) {
    st = tw_error(TW_ERR_INVALID_ARG, "%s: group sizes sum to %lld (or one is negative) but the source has %lld rows",
                  op, (long long)sum, (long long)M);
  } else {
    /* the scale tensor must be the one tw_quantize_output_shapes gives for this source */
    tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
    tw_qtensor want;
    qo.mode = o->mode;
    qo.qdtype = o->data.dtype;
    qo.layout = o->colwise ? TW_COLWISE : TW_ROWWISE;
    qo.mxfp8_swizzled = o->mxfp8_swizzled;
    st = tw_quantize_output_shapes(&qo, M, K, G, &want);
    const tw_tensor *ws = o->colwise ? &want.col_scale_inv : &want.row_scale_inv;
    if (st == TW_OK && (o->scale_inv.ndim != ws->ndim || o->scale_inv.dtype != ws->dtype ||
                        o->scale_inv.shape[0] != ws->shape[0] ||
                        (ws->ndim == 2 && o->scale_inv.shape[1] != ws->shape[1]))) {
      char a[96], b[96];
      st = tw_error(TW_ERR_SHAPE, "%s: scale_inv is %s, expected %s", op,
                    tw_tensor_str(&o->scale_inv, a, sizeof a), tw_tensor_str(ws, b, sizeof b));
    }
    groups gr;
    if (st == TW_OK) st = groups_init(&gr, o->mode, o->mxfp8_swizzled, M, K, group_sizes, G);
    if (st == TW_OK) {
      if (padded) gr.col_pitch = padded_pitch(M, G);
      tw_tensor o_out = tw_tensor_1d(out, TW_F32, M * K, TW_MEM_HOST);
      dequantize_groups(&gr, o->data.dtype, o->colwise, &o->data, &o->scale_inv, 1, &o_out);
      groups_free(&gr);
    }
  }
  free(equal);
  return st;
}

/* ---- delayed scaling -------------------------------------------------------------------- */

tw_status ref_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                   const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                   float margin) {
  (void)ctx;
  int64_t G = amax_history->shape[0], H = amax_history->shape[1];
  float fp8_max = (float)fp8_max_of(qdtype), pow2_margin = ldexpf(1.0f, (int)margin);
  for (int64_t g = 0; g < G; g++) {
    float *hist = (float *)amax_history->data + g * H;
    hist[0] = ((const float *)amax->data)[g];
    float a = hist[0];
    if (algo == TW_AMAX_MAX) /* a NaN anywhere in the history wins, as jnp.max does */
      for (int64_t h = 1; h < H; h++) a = (isnan(hist[h]) || hist[h] > a) ? hist[h] : a;
    if (a > 0.0f && isfinite(a)) {
      float s = fp8_max / a;
      if (isinf(s)) s = FLT_MAX;
      ((float *)scale->data)[g] = s / pow2_margin;
    }
    float newest = hist[0]; /* roll left by one: hist[h] = hist[h + 1], the oldest wraps */
    memmove(hist, hist + 1, sizeof(float) * (size_t)(H - 1));
    hist[H - 1] = newest;
    hist[0] = 0.0f;
  }
  return TW_OK;
}
