#include "core/validate.h"

#include <stdio.h>

tw_status tw_v_tensor(const char *op, const char *name, const tw_tensor *t, tw_mem mem,
                      int want_ndim) {
  if (!t) return tw_error(TW_ERR_NULL, "%s: %s is NULL", op, name);
  if (t->ndim < 0) return tw_error(TW_ERR_INVALID_ARG, "%s: %s is required but none was given", op, name);
  if (t->ndim > TW_MAX_DIMS)
    return tw_error(TW_ERR_SHAPE, "%s: %s has %d dims (at most %d)", op, name, t->ndim, TW_MAX_DIMS);
  if (want_ndim >= 0 && t->ndim != want_ndim)
    return tw_error(TW_ERR_SHAPE, "%s: %s must have %d dims, has %d", op, name, want_ndim, t->ndim);
  if ((int)t->dtype < 0 || t->dtype >= TW_DTYPE_COUNT)
    return tw_error(TW_ERR_DTYPE, "%s: %s has unknown dtype %d", op, name, (int)t->dtype);
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] < 0)
      return tw_error(TW_ERR_SHAPE, "%s: %s dim %d is %lld (negative)", op, name, i,
                      (long long)t->shape[i]);
  /* overflow guard: element count must fit comfortably in int64 */
  double n = 1;
  for (int i = 0; i < t->ndim; i++) n *= (double)t->shape[i];
  if (n > 9.0e15)
    return tw_error(TW_ERR_SHAPE, "%s: %s has %.3g elements (too many)", op, name, n);
  if (tw_tensor_numel(t) > 0 && !t->data)
    return tw_error(TW_ERR_NULL, "%s: %s data is NULL", op, name);
  if (t->mem != mem)
    return tw_error(TW_ERR_MEMORY, "%s: %s lives in %s memory, this context needs %s memory", op,
                    name, t->mem == TW_MEM_HOST ? "host" : "device",
                    mem == TW_MEM_HOST ? "host" : "device");
  return TW_OK;
}

tw_status tw_v_dtype_in(const char *op, const char *name, const tw_tensor *t, const tw_dtype *ok,
                        int n_ok) {
  for (int i = 0; i < n_ok; i++)
    if (t->dtype == ok[i]) return TW_OK;
  char list[128];
  size_t k = 0;
  list[0] = 0;
  for (int i = 0; i < n_ok && k < sizeof list; i++)
    k += (size_t)snprintf(list + k, sizeof list - k, i ? ", %s" : "%s", tw_dtype_name(ok[i]));
  return tw_error(TW_ERR_DTYPE, "%s: %s has dtype %s, expected one of {%s}", op, name,
                  tw_dtype_name(t->dtype), list);
}

tw_status tw_v_shape_is(const char *op, const char *name, const tw_tensor *t, int ndim,
                        const int64_t *shape) {
  int ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
  if (ok) return TW_OK;
  tw_tensor want = {0, t->dtype, ndim, {0, 0, 0, 0}, t->mem};
  for (int i = 0; i < ndim; i++) want.shape[i] = shape[i];
  char a[96], b[96];
  return tw_error(TW_ERR_SHAPE, "%s: %s is %s, expected %s", op, name, tw_tensor_str(t, a, sizeof a),
                  tw_tensor_str(&want, b, sizeof b));
}

tw_status tw_v_group_sizes(const char *op, const tw_ctx *ctx, const tw_tensor *gs, int64_t rows,
                           const char *rows_name, int64_t *G_out, int64_t *sum_out) {
  TW_TRY(tw_v_tensor(op, "group_sizes", gs, ctx->ops->mem, 1));
  if (gs->dtype != TW_I32)
    return tw_error(TW_ERR_DTYPE, "%s: group_sizes must be i32, got %s", op, tw_dtype_name(gs->dtype));
  int64_t G = gs->shape[0];
  if (G == 0) return tw_error(TW_ERR_INVALID_ARG, "%s: group_sizes is empty (G = 0)", op);
  if (G_out) *G_out = G;
  if (sum_out) *sum_out = -1;
  if (gs->mem != TW_MEM_HOST) return TW_OK; /* checked on the device */
  const int32_t *g = (const int32_t *)gs->data;
  int64_t sum = 0;
  for (int64_t i = 0; i < G; i++) {
    if (g[i] < 0)
      return tw_error(TW_ERR_INVALID_ARG, "%s: group_sizes[%lld] = %d is negative", op,
                      (long long)i, g[i]);
    sum += g[i];
  }
  if (sum > rows)
    return tw_error(TW_ERR_INVALID_ARG, "%s: group_sizes sum to %lld but %s has %lld rows", op,
                    (long long)sum, rows_name, (long long)rows);
  if (sum_out) *sum_out = sum;
  return TW_OK;
}

void tw_group_offsets(const int32_t *gs, int64_t G, int64_t *offsets) {
  offsets[0] = 0;
  for (int64_t g = 0; g < G; g++) offsets[g + 1] = offsets[g] + gs[g];
}

void tw_group_tile_offsets(const int32_t *gs, int64_t G, int64_t tile_rows, int64_t *tiles) {
  tiles[0] = 0;
  for (int64_t g = 0; g < G; g++) tiles[g + 1] = tiles[g] + tw_ceil_div(gs[g], tile_rows);
}
