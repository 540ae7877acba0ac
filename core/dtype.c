/* dtype names, widths; tensor helpers. */
#include <stdio.h>
#include <string.h>

#include "twin/tw_base.h"
#include "twin/tw_npy.h"

static const struct {
  const char *name;
  int bits;
  int is_float;
} tw_dtypes[TW_DTYPE_COUNT] = {
    [TW_F64] = {"f64", 64, 1},   [TW_F32] = {"f32", 32, 1},   [TW_BF16] = {"bf16", 16, 1},
    [TW_F16] = {"f16", 16, 1},   [TW_E4M3] = {"e4m3", 8, 1},  [TW_E5M2] = {"e5m2", 8, 1},
    [TW_E8M0] = {"e8m0", 8, 1},  [TW_E2M1] = {"e2m1", 4, 1},  [TW_I32] = {"i32", 32, 0},
    [TW_I64] = {"i64", 64, 0},   [TW_U8] = {"u8", 8, 0},      [TW_U16] = {"u16", 16, 0},
};

static int valid(tw_dtype t) { return (int)t >= 0 && t < TW_DTYPE_COUNT; }

const char *tw_dtype_name(tw_dtype t) { return valid(t) ? tw_dtypes[t].name : NULL; }
int tw_dtype_bits(tw_dtype t) { return valid(t) ? tw_dtypes[t].bits : 0; }
int tw_dtype_is_float(tw_dtype t) { return valid(t) && tw_dtypes[t].is_float; }
int tw_dtype_is_fp8(tw_dtype t) { return t == TW_E4M3 || t == TW_E5M2; }

int tw_dtype_from_name(const char *name, tw_dtype *out) {
  if (!name) return -1;
  for (int i = 0; i < TW_DTYPE_COUNT; i++)
    if (strcmp(name, tw_dtypes[i].name) == 0) {
      *out = (tw_dtype)i;
      return 0;
    }
  /* common aliases */
  static const struct { const char *a; tw_dtype t; } alias[] = {
      {"float32", TW_F32}, {"float64", TW_F64}, {"bfloat16", TW_BF16}, {"float16", TW_F16},
      {"fp8_e4m3", TW_E4M3}, {"e4m3fn", TW_E4M3}, {"fp8_e5m2", TW_E5M2}, {"int32", TW_I32},
      {"int64", TW_I64}, {"uint8", TW_U8}, {"uint16", TW_U16}, {"fp4", TW_E2M1}};
  for (size_t i = 0; i < sizeof alias / sizeof alias[0]; i++)
    if (strcmp(name, alias[i].a) == 0) {
      *out = alias[i].t;
      return 0;
    }
  return -1;
}

size_t tw_dtype_storage_bytes(tw_dtype t, int64_t n) {
  if (n <= 0 || !valid(t)) return 0;
  if (tw_dtypes[t].bits == 4) return (size_t)((n + 1) / 2);
  return (size_t)n * (size_t)(tw_dtypes[t].bits / 8);
}

int64_t tw_tensor_numel(const tw_tensor *t) {
  if (!t || t->ndim < 0) return 0;
  int nd = t->ndim < TW_MAX_DIMS ? t->ndim : TW_MAX_DIMS;
  for (int i = 0; i < nd; i++)
    if (t->shape[i] <= 0) return 0; /* an empty or invalid (negative) shape holds nothing */
  int64_t n = 1;
  for (int i = 0; i < nd; i++)
    if (__builtin_mul_overflow(n, t->shape[i], &n)) return INT64_MAX; /* validators reject it */
  return n;
}

size_t tw_tensor_bytes(const tw_tensor *t) {
  return t ? tw_dtype_storage_bytes(t->dtype, tw_tensor_numel(t)) : 0;
}

const char *tw_tensor_str(const tw_tensor *t, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  if (!t || t->ndim < 0) {
    snprintf(buf, n, "none");
    return buf;
  }
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < t->ndim && i < TW_MAX_DIMS && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (k < n) snprintf(buf + k, n - k, "] %s", tw_dtype_name(t->dtype) ? tw_dtype_name(t->dtype) : "?");
  return buf;
}

tw_status tw_tensor_view_as(const tw_tensor *t, tw_dtype as, tw_tensor *out) {
  if (!t || !out) return tw_error(TW_ERR_NULL, "tensor_view_as: NULL argument");
  if (!valid(as) || tw_dtype_bits(as) != tw_dtype_bits(t->dtype))
    return tw_error(TW_ERR_DTYPE, "tensor_view_as: cannot view %s (%d bits) as %s (%d bits)",
                    tw_dtype_name(t->dtype) ? tw_dtype_name(t->dtype) : "?",
                    tw_dtype_bits(t->dtype), tw_dtype_name(as) ? tw_dtype_name(as) : "?",
                    tw_dtype_bits(as));
  *out = *t;
  out->dtype = as;
  return TW_OK;
}
