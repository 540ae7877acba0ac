/* twin's one checker (tw_check.h): exact (bitwise) and bound (|got - expected| <= bound)
 * comparison with one report shape.
 *
 * The checker decodes elements with its own small decoders below instead of the numerics
 * library: it judges the numerics code, so it must not share its bugs. The decoders only need
 * to be exact for finite values and classify NaN/inf; they are a few lines per format.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "twin/tw_check.h"

/* ---- decoding (independent of core/numerics.c) ------------------------------------------ */
static double dec_minifloat(uint32_t code, int exp_bits, int man_bits, int has_inf_nan) {
  uint32_t sign = (code >> (exp_bits + man_bits)) & 1u;
  uint32_t e = (code >> man_bits) & ((1u << exp_bits) - 1u);
  uint32_t m = code & ((1u << man_bits) - 1u);
  int bias = (1 << (exp_bits - 1)) - 1;
  double v;
  if (has_inf_nan && e == (1u << exp_bits) - 1u)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = ldexp((double)m, 1 - bias - man_bits);
  else
    v = ldexp((double)(m | (1u << man_bits)), (int)e - bias - man_bits);
  return sign ? -v : v;
}

static uint64_t element_bits(const void *data, tw_dtype t, int64_t i) {
  const uint8_t *p = (const uint8_t *)data;
  switch (tw_dtype_bits(t)) {
    case 64: { uint64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    case 32: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case 16: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case 8: return p[i];
    case 4: return (i & 1) ? (p[i >> 1] >> 4) : (p[i >> 1] & 0xFu);
    default: return 0;
  }
}

static double decode(const void *data, tw_dtype t, int64_t i) {
  uint64_t b = element_bits(data, t, i);
  switch (t) {
    case TW_F64: { double d; memcpy(&d, &b, 8); return d; }
    case TW_F32: { uint32_t u = (uint32_t)b; float f; memcpy(&f, &u, 4); return f; }
    case TW_BF16: { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
    case TW_F16: return dec_minifloat((uint32_t)b, 5, 10, 1);
    case TW_E4M3: /* E4M3FN: only S.1111.111 is NaN, no infinities */
      return ((b & 0x7F) == 0x7F) ? NAN : dec_minifloat((uint32_t)b, 4, 3, 0);
    case TW_E5M2: return dec_minifloat((uint32_t)b, 5, 2, 1);
    case TW_E8M0: return b == 0xFF ? NAN : ldexp(1.0, (int)b - 127);
    case TW_E2M1: return dec_minifloat((uint32_t)b, 2, 1, 0);
    case TW_I32: return (double)(int32_t)(uint32_t)b;
    case TW_I64: return (double)(int64_t)b;
    case TW_U8: case TW_U16: return (double)b;
    default: return 0;
  }
}

/* got's element i still holds the poison pattern (for e2m1: its nibble of 0xA5). */
static int is_poison(const void *data, tw_dtype t, int64_t i) {
  int bits = tw_dtype_bits(t);
  if (bits == 4) return element_bits(data, t, i) == ((i & 1) ? (TW_POISON_BYTE >> 4) : (TW_POISON_BYTE & 0xF));
  const uint8_t *p = (const uint8_t *)data + (size_t)i * (size_t)(bits / 8);
  for (int k = 0; k < bits / 8; k++)
    if (p[k] != TW_POISON_BYTE) return 0;
  return 1;
}

/* ---- argument checks --------------------------------------------------------------------- */
static tw_status check_host_tensor(const char *op, const char *name, const tw_tensor *t) {
  if (!t) return tw_error(TW_ERR_NULL, "%s: %s is NULL", op, name);
  if (t->ndim < 0 || t->ndim > TW_MAX_DIMS)
    return tw_error(TW_ERR_SHAPE, "%s: %s has ndim %d (want 0..%d)", op, name, t->ndim, TW_MAX_DIMS);
  if (!tw_dtype_name(t->dtype))
    return tw_error(TW_ERR_DTYPE, "%s: %s has unknown dtype %d", op, name, (int)t->dtype);
  for (int d = 0; d < t->ndim; d++)
    if (t->shape[d] < 0)
      return tw_error(TW_ERR_SHAPE, "%s: %s has negative dim %d (%lld)", op, name, d,
                      (long long)t->shape[d]);
  double n = 1; /* as tw_v_tensor: a count no buffer can hold is a bad shape, not a read */
  for (int d = 0; d < t->ndim; d++) n *= (double)t->shape[d];
  if (n > 9.0e15) return tw_error(TW_ERR_SHAPE, "%s: %s has %.3g elements (too many)", op, name, n);
  if (t->mem != TW_MEM_HOST)
    return tw_error(TW_ERR_MEMORY, "%s: %s lives in device memory; copy it to the host first", op, name);
  if (tw_tensor_numel(t) > 0 && !t->data) return tw_error(TW_ERR_NULL, "%s: %s data is NULL", op, name);
  return TW_OK;
}

static tw_status check_same_shape(const char *op, const tw_tensor *got, const tw_tensor *exp) {
  int same = got->ndim == exp->ndim;
  for (int d = 0; same && d < got->ndim; d++) same = got->shape[d] == exp->shape[d];
  if (!same) {
    char a[96], b[96];
    return tw_error(TW_ERR_SHAPE, "%s: got %s and expected %s differ in shape", op,
                    tw_tensor_str(got, a, sizeof a), tw_tensor_str(exp, b, sizeof b));
  }
  return TW_OK;
}

static void report_init(tw_check_report *r, const tw_tensor *got) {
  memset(r, 0, sizeof *r);
  r->count = tw_tensor_numel(got);
  r->worst_index = -1;
  r->ndim = got->ndim;
}

static void set_worst(tw_check_report *r, const tw_tensor *got, int64_t i, double g, double e,
                      double err, double bound, double ratio) {
  r->worst_index = i;
  r->worst_got = g;
  r->worst_expected = e;
  r->worst_err = err;
  r->worst_bound = bound;
  r->worst_ratio = ratio;
  int64_t rest = i;
  for (int d = got->ndim - 1; d >= 0; d--) {
    int64_t n = got->shape[d] > 0 ? got->shape[d] : 1;
    r->worst_coord[d] = rest % n;
    rest /= n;
  }
}

/* NaN on exactly one side; or an inf not met by the same inf. */
static int nan_mismatch(double g, double e) { return isnan(g) != isnan(e); }
static int inf_mismatch(double g, double e) {
  if (isnan(g) || isnan(e)) return 0;
  return (isinf(g) || isinf(e)) && g != e;
}

/* |g - e| with NaN/inf made explicit: 0 when both are the same special value. */
static double abs_err(double g, double e) {
  if (isnan(g) && isnan(e)) return 0;
  if (isnan(g) || isnan(e)) return INFINITY;
  if (g == e) return 0;
  return fabs(g - e);
}

/* ---- exact ------------------------------------------------------------------------------- */
tw_status tw_check_exact(const tw_tensor *got, const tw_tensor *expected, tw_check_report *r) {
  const char *op = "check_exact";
  if (!r) return tw_error(TW_ERR_NULL, "%s: report is NULL", op);
  TW_TRY(check_host_tensor(op, "got", got));
  TW_TRY(check_host_tensor(op, "expected", expected));
  TW_TRY(check_same_shape(op, got, expected));
  if (got->dtype != expected->dtype)
    return tw_error(TW_ERR_DTYPE, "%s: got is %s but expected is %s (exact mode compares storage; "
                    "view raw codes with tw_tensor_view_as)", op, tw_dtype_name(got->dtype),
                    tw_dtype_name(expected->dtype));
  report_init(r, got);
  tw_dtype t = got->dtype;
  int is_float = tw_dtype_is_float(t);
  double worst_err = -1;
  for (int64_t i = 0; i < r->count; i++) {
    if (element_bits(got->data, t, i) == element_bits(expected->data, t, i)) continue;
    r->mismatches++;
    double g = decode(got->data, t, i), e = decode(expected->data, t, i);
    if (is_float) {
      r->nan_mismatches += nan_mismatch(g, e);
      r->inf_mismatches += inf_mismatch(g, e);
    }
    if (is_poison(got->data, t, i)) r->unwritten++;
    /* bits differ but values may be equal (+0/-0, two NaN payloads): still a mismatch */
    double err = abs_err(g, e);
    if (err == 0) err = DBL_MIN;
    if (err > worst_err) {
      worst_err = err;
      set_worst(r, got, i, g, e, abs_err(g, e), 0, INFINITY);
    }
  }
  r->passed = r->mismatches == 0;
  return TW_OK;
}

/* ---- bound ------------------------------------------------------------------------------- */
tw_status tw_check_bound(const tw_tensor *got, const tw_tensor *expected, const tw_tensor *bound,
                         tw_check_report *r) {
  const char *op = "check_bound";
  if (!r) return tw_error(TW_ERR_NULL, "%s: report is NULL", op);
  TW_TRY(check_host_tensor(op, "got", got));
  TW_TRY(check_host_tensor(op, "expected", expected));
  TW_TRY(check_host_tensor(op, "bound", bound));
  TW_TRY(check_same_shape(op, got, expected));
  if (!tw_dtype_is_float(got->dtype) || !tw_dtype_is_float(expected->dtype))
    return tw_error(TW_ERR_DTYPE, "%s: got (%s) and expected (%s) must be float dtypes; use "
                    "check_exact for integers and raw codes", op, tw_dtype_name(got->dtype),
                    tw_dtype_name(expected->dtype));
  if (bound->dtype != TW_F64 && bound->dtype != TW_F32)
    return tw_error(TW_ERR_DTYPE, "%s: bound must be f64 or f32, not %s", op, tw_dtype_name(bound->dtype));
  if (tw_tensor_numel(bound) != tw_tensor_numel(got))
    return tw_error(TW_ERR_SHAPE, "%s: bound has %lld elements but got has %lld", op,
                    (long long)tw_tensor_numel(bound), (long long)tw_tensor_numel(got));
  report_init(r, got);
  int worst_bad = 0;
  for (int64_t i = 0; i < r->count; i++) {
    double g = decode(got->data, got->dtype, i), e = decode(expected->data, expected->dtype, i);
    double b = decode(bound->data, bound->dtype, i);
    double err = abs_err(g, e);
    double ratio;
    int bad;
    int special_differs = nan_mismatch(g, e) || inf_mismatch(g, e);
    int special_same = (isnan(g) && isnan(e)) || (isinf(g) && g == e);
    if (special_differs || special_same) { /* no bound, not even an infinite one, excuses these */
      bad = special_differs; ratio = bad ? INFINITY : 0;
      if (!(b >= 0)) b = 0;
    } else if (isnan(b)) { /* a NaN bound is a broken bound, never a pass */
      bad = 1; ratio = INFINITY;
    } else if (b < 0) { /* must be left exactly as it was */
      bad = err != 0; ratio = bad ? INFINITY : 0;
      b = 0;
    } else {
      bad = !(err <= b);
      ratio = err == 0 ? 0 : (b > 0 ? err / b : INFINITY);
    }
    if (bad) {
      r->mismatches++;
      r->nan_mismatches += nan_mismatch(g, e);
      r->inf_mismatches += inf_mismatch(g, e);
      if (is_poison(got->data, got->dtype, i)) r->unwritten++;
    }
    /* The worst element: any failing one beats every passing one, then the largest ratio
     * (first index on ties). */
    if (r->worst_index < 0 || (bad && !worst_bad) || (bad == worst_bad && ratio > r->worst_ratio)) {
      worst_bad = bad;
      set_worst(r, got, i, g, e, err, b, ratio);
    }
  }
  r->passed = r->mismatches == 0;
  return TW_OK;
}

/* ---- GEMM error bound --------------------------------------------------------------------- */
/* Unit roundoff of the output format (own table: see the note at the top). */
static double out_unit_roundoff(tw_dtype t) {
  switch (t) {
    case TW_F64: return ldexp(1.0, -53);
    case TW_F32: return ldexp(1.0, -24);
    case TW_BF16: return ldexp(1.0, -8);
    case TW_F16: return ldexp(1.0, -11);
    default: return 0;
  }
}

/* Half the subnormal spacing of the output: the absolute rounding error of a result that
 * lands below the output's smallest normal (f16: 2^-25; f32/bf16: 2^-150, below FLT_MIN). */
static double out_subnormal_half_ulp(tw_dtype t) {
  switch (t) {
    case TW_F16: return ldexp(1.0, -25);
    default: return 0;
  }
}

static double gamma_n(int64_t n, double u) {
  double nu = (double)(n > 0 ? n : 0) * u;
  return nu < 1 ? nu / (1 - nu) : INFINITY;
}

static void bound_with_gamma(const double *abs_prod, const double *ref, int64_t count, double gamma,
                             tw_dtype out_dtype, double *bound);

void tw_gemm_error_bound(const double *abs_prod, const double *ref, int64_t count, int64_t K,
                         double u_acc, tw_dtype out_dtype, double *bound) {
  bound_with_gamma(abs_prod, ref, count, gamma_n(K, u_acc), out_dtype, bound);
}

void tw_gemm_error_bound_promoted(const double *abs_prod, const double *ref, int64_t count, int64_t K,
                                  int64_t chunk, double u_chunk, double u_acc, int64_t extra,
                                  tw_dtype out_dtype, double *bound) {
  int64_t k = K > 0 ? K : 0, c = chunk > 0 ? chunk : 1;
  int64_t n_in = k < c ? k : c;
  n_in += (n_in + 31) / 32; /* each 32-deep instruction also folds the running partial */
  double g_in = gamma_n(n_in, u_chunk);
  double g_out = gamma_n((k + c - 1) / c + extra, u_acc);
  bound_with_gamma(abs_prod, ref, count, g_in + g_out * (1 + g_in), out_dtype, bound);
}

tw_status tw_fp8_lift_subnormal_codes(const uint8_t *codes, int64_t n, tw_dtype qdtype, uint8_t *out) {
  const char *op = "fp8_lift_subnormal_codes";
  if (qdtype != TW_E4M3 && qdtype != TW_E5M2)
    return tw_error(TW_ERR_DTYPE, "%s: qdtype %s is not e4m3 or e5m2", op,
                    tw_dtype_name(qdtype) ? tw_dtype_name(qdtype) : "?");
  if (n < 0) return tw_error(TW_ERR_INVALID_ARG, "%s: n = %lld (need n >= 0)", op, (long long)n);
  if (n > 0 && (!codes || !out)) return tw_error(TW_ERR_NULL, "%s: codes or out is NULL (n = %lld)", op, (long long)n);
  /* exponent field mask and the smallest normal code (exponent field 1, mantissa 0) */
  const uint8_t emask = qdtype == TW_E4M3 ? 0x78 : 0x7C, min_normal = qdtype == TW_E4M3 ? 0x08 : 0x04;
  for (int64_t i = 0; i < n; i++) {
    uint8_t c = codes[i];
    int subnormal = (c & emask) == 0 && (c & 0x7F) != 0;
    out[i] = subnormal ? (uint8_t)((c & 0x80) | min_normal) : c;
  }
  return TW_OK;
}

static void bound_with_gamma(const double *abs_prod, const double *ref, int64_t count, double gamma,
                             tw_dtype out_dtype, double *bound) {
  double u_out = out_unit_roundoff(out_dtype);
  double tiny = fmax((double)FLT_MIN, out_subnormal_half_ulp(out_dtype));
  for (int64_t i = 0; i < count; i++) {
    if (abs_prod[i] < 0) { /* an element the operation must not write: exact */
      bound[i] = -1;
      continue;
    }
    double acc_err = gamma * abs_prod[i];
    /* the f32 result is off by acc_err; rounding it to the output adds u_out of its size */
    bound[i] = acc_err + u_out * (fabs(ref[i]) + acc_err) + tiny;
  }
}

/* ---- one-line report ----------------------------------------------------------------------- */
static void format_coord(const tw_check_report *r, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int d = 0; d < r->ndim && d < TW_MAX_DIMS && k < n; d++)
    k += (size_t)snprintf(buf + k, n - k, d ? ", %lld" : "%lld", (long long)r->worst_coord[d]);
  if (k < n) snprintf(buf + k, n - k, "]");
}

const char *tw_check_format(const tw_check_report *r, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  if (!r) {
    snprintf(buf, n, "(no report)");
    return buf;
  }
  char at[96];
  format_coord(r, at, sizeof at);
  if (r->passed) {
    if (r->worst_index < 0) /* exact mode records no worst element when all bits agree */
      snprintf(buf, n, "PASS %lld elems, bit-exact", (long long)r->count);
    else if (r->worst_err == 0)
      snprintf(buf, n, "PASS %lld elems, all exact", (long long)r->count);
    else
      snprintf(buf, n, "PASS %lld elems, worst %.3g <= %.3g (ratio %.3g) at %s",
               (long long)r->count, r->worst_err, r->worst_bound, r->worst_ratio, at);
    return buf;
  }
  int k = snprintf(buf, n, "FAIL %lld/%lld %s, %lld NaN, %lld inf, %lld unwritten; worst got=%.9g exp=%.9g",
                   (long long)r->mismatches, (long long)r->count,
                   r->worst_bound > 0 ? "out of bound" : "differ", (long long)r->nan_mismatches,
                   (long long)r->inf_mismatches, (long long)r->unwritten, r->worst_got,
                   r->worst_expected);
  if (k >= 0 && (size_t)k < n) {
    if (r->worst_bound > 0)
      snprintf(buf + k, n - (size_t)k, " err=%.3g bound=%.3g at %s", r->worst_err, r->worst_bound, at);
    else
      snprintf(buf + k, n - (size_t)k, " at %s", at);
  }
  return buf;
}
