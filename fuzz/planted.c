/* Planted bugs: test-only variants of the ref backend, each wrong in one op the way real
 * kernels go wrong. `twin fuzz --plant NAME` fuzzes such a variant against the oracle; the
 * planted-bug test shows each is caught and shrunk to a small case. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "fuzz/fuzz_internal.h"
#include "twin/tw_numerics.h"

static size_t esize(tw_dtype t) { return tw_dtype_storage_bytes(t, 1); }

/* grouped_gemm whose last tile drops its only row: groups of 16k+1 rows (k >= 1) leave
 * their last output row unwritten (a `<` that should be `<=` in a 16-row tile bound). */
static tw_status tile_off_by_one(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                                 const tw_tensor *gs, tw_tensor *out, int accumulate) {
  const int32_t *g = gs->data;
  int64_t G = gs->shape[0], N = out->shape[1];
  size_t row = (size_t)N * esize(out->dtype);
  char *saved = malloc(row * (size_t)G + 1);
  if (!saved) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  int64_t o = 0;
  for (int64_t i = 0; i < G; i++) {
    o += g[i];
    if (g[i] > 16 && g[i] % 16 == 1) memcpy(saved + row * (size_t)i, (char *)out->data + row * (size_t)(o - 1), row);
  }
  tw_status s = tw_ref_ops.grouped_gemm(ctx, lhs, rhs, rhs_op, gs, out, accumulate);
  o = 0;
  for (int64_t i = 0; i < G; i++) {
    o += g[i];
    if (g[i] > 16 && g[i] % 16 == 1) memcpy((char *)out->data + row * (size_t)(o - 1), saved + row * (size_t)i, row);
  }
  free(saved);
  return s;
}

/* Tensor-scaled quantize that rounds toward zero instead of to nearest even. */
static tw_status round_toward_zero(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *gs,
                                   const tw_quantize_opts *opts, tw_qtensor *q) {
  tw_status s = tw_ref_ops.grouped_quantize(ctx, x, gs, opts, q);
  if (s != TW_OK || tw_tensor_is_none(&q->row_data)) return s;
  if (opts->mode != TW_SCALE_TENSOR_CURRENT && opts->mode != TW_SCALE_TENSOR_DELAYED) return s;
  const int32_t *g = gs->data;
  int64_t K = x->shape[1], r = 0;
  uint8_t *codes = q->row_data.data;
  const float *si = q->row_scale_inv.data;
  for (int64_t i = 0; i < gs->shape[0]; i++) {
    float scale = 1.0f / si[i];
    for (int64_t e = r * K; e < (r + g[i]) * K; e++) {
      float v = (float)tw_load_as_f64(x->data, x->dtype, e) * scale;
      uint8_t c = codes[e];
      float d = q->qdtype == TW_E4M3 ? tw_e4m3_to_f32(c) : tw_e5m2_to_f32(c);
      if (isfinite(d) && isfinite(v) && (c & 0x7F) != 0 && fabsf(d) > fabsf(v)) codes[e] = (uint8_t)(c - 1);
    }
    r += g[i];
  }
  return s;
}

/* wgrad that skips empty groups: out[g] keeps whatever was there instead of 0. */
static tw_status empty_group_unwritten(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs,
                                       tw_op rhs_op, const tw_tensor *gs, tw_tensor *out, int accumulate) {
  const int32_t *g = gs->data;
  int64_t G = gs->shape[0];
  size_t slab = (size_t)(out->shape[1] * out->shape[2]) * esize(out->dtype);
  char *saved = malloc(slab * (size_t)G + 1);
  if (!saved) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  for (int64_t i = 0; i < G; i++)
    if (g[i] == 0) memcpy(saved + slab * (size_t)i, (char *)out->data + slab * (size_t)i, slab);
  tw_status s = tw_ref_ops.grouped_gemm_wgrad(ctx, lhs, lhs_op, rhs, rhs_op, gs, out, accumulate);
  for (int64_t i = 0; i < G; i++)
    if (g[i] == 0) memcpy((char *)out->data + slab * (size_t)i, saved + slab * (size_t)i, slab);
  free(saved);
  return s;
}

static const struct {
  const char *name, *op;
} plants[] = {
    {"tile_off_by_one", "grouped_gemm"},
    {"round_toward_zero", "quantize"},
    {"empty_group_unwritten", "wgrad"},
};
#define NPLANTS ((int)(sizeof plants / sizeof plants[0]))
static tw_backend_ops planted_tables[NPLANTS];

int fz_plant_count(void) { return NPLANTS; }
const char *fz_plant_name(int i) { return i >= 0 && i < NPLANTS ? plants[i].name : NULL; }
const char *fz_plant_op(int i) { return i >= 0 && i < NPLANTS ? plants[i].op : NULL; }

int fz_plant(tw_ctx *ctx, const char *name) {
  if (!ctx || !name || ctx->ops != &tw_ref_ops) return -1;
  for (int i = 0; i < NPLANTS; i++) {
    if (strcmp(name, plants[i].name) != 0) continue;
    tw_backend_ops *t = &planted_tables[i];
    *t = tw_ref_ops;
    t->name = plants[i].name;
    if (i == 0) t->grouped_gemm = tile_off_by_one;
    if (i == 1) t->grouped_quantize = round_toward_zero;
    if (i == 2) t->grouped_gemm_wgrad = empty_group_unwritten;
    ctx->ops = t;
    return 0;
  }
  return -1;
}
