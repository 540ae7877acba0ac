/* ref_cast: dst[i] = convert(src[i]), elementwise over host tensors of equal shape.
 *
 *   float or mixed:  dst[i] = store(load_as_f64(src[i]))   (tw_load_as_f64 / tw_store_from_f64)
 *   int -> int:      dst[i] = clamp(src[i], dst range)      (exact in int64; i64 values beyond
 *                                                            2^53 would not survive a double)
 * Float targets round through f32 (RNE) then to the format, with the rules of tw_numerics.h
 * (an i64 source beyond 2^53 is rounded to f64 on the way, so i64 -> f32 may round twice);
 * integer targets truncate toward zero and saturate, NaN -> 0. e2m1 writes only its own
 * nibble, so the unused high nibble of an odd-length e2m1 tensor keeps its old value.
 * core/api_numerics.c has already checked shapes, memory and that dst is not e8m0. */
#include "ref/ref.h"

static int is_integer(tw_dtype t) {
  return t == TW_I32 || t == TW_I64 || t == TW_U8 || t == TW_U16;
}

static int64_t load_int(const void *p, tw_dtype t, int64_t i) {
  switch (t) {
    case TW_I32: return ((const int32_t *)p)[i];
    case TW_I64: return ((const int64_t *)p)[i];
    case TW_U8: return ((const uint8_t *)p)[i];
    default: return ((const uint16_t *)p)[i]; /* TW_U16 */
  }
}

static void store_int(void *p, tw_dtype t, int64_t i, int64_t v) {
  switch (t) {
    case TW_I32: ((int32_t *)p)[i] = (int32_t)(v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v); break;
    case TW_I64: ((int64_t *)p)[i] = v; break;
    case TW_U8: ((uint8_t *)p)[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v); break;
    default: ((uint16_t *)p)[i] = (uint16_t)(v < 0 ? 0 : v > 65535 ? 65535 : v); break;
  }
}

tw_status ref_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate) {
  (void)ctx;
  int64_t n = tw_tensor_numel(src);
  if (is_integer(src->dtype) && is_integer(dst->dtype)) {
    for (int64_t i = 0; i < n; i++) store_int(dst->data, dst->dtype, i, load_int(src->data, src->dtype, i));
    return TW_OK;
  }
  for (int64_t i = 0; i < n; i++)
    tw_store_from_f64(dst->data, dst->dtype, i, tw_load_as_f64(src->data, src->dtype, i), saturate);
  return TW_OK;
}
