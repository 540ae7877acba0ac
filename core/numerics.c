/* twin numerics: the scalar codecs of tw_numerics.h, bit-exact, plain C.
 *
 * One rounding routine serves every narrow float format (bf16, f16, e4m3, e5m2, e2m1). A
 * positive value v = sig * 2^(e-23) (f32: 24-bit significand, e >= -126) is rounded to the
 * target's quantum 2^(te-M), te = max(e, min_exp): q = RNE(sig / 2^shift). The magnitude code
 * is then simply ((te - min_exp) << M) + q: it covers subnormals (te = min_exp, q < 2^M),
 * normals, and the carry into the next binade (q = 2^(M+1)) without special cases. Because
 * codes are monotone in value, "rounds past max" is just code > max_code, decided on the
 * unbounded-exponent result, as the IEEE rule (and ml_dtypes) wants.
 *
 * The GPU twin uses hardware cvt where it exists (cvt.rn.bf16.f32, cvt.rn.f16.f32,
 * cvt.rn.satfinite.e4m3x2/e5m2x2.f32, cvt.rp.satfinite.ue8m0x2.f32 on sm_100) and must equal
 * these functions bit for bit; its tests compare against them. Measured on an H200 (sm_90)
 * over the 302666 golden encode inputs: those four cvt equal tw_f32_to_bf16, tw_f32_to_f16
 * and the saturate=1 fp8 encoders on every non-NaN input, but write sign-less NaNs (0x7FFF
 * for bf16/f16, 0x7F for e4m3 *and* e5m2), and cvt.f32.f16 / cvt.rn.f16x2.e4m3x2 decode NaN
 * codes to 0x7FFFFFFF. So the GPU side patches NaN lanes to the codes of tw_numerics.h.
 */
#include <math.h>
#include <string.h>

#include "twin/tw_numerics.h"

static uint32_t f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

static float f32_from_bits(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* A narrow float format: M mantissa bits, min_exp = 1 - bias (exponent of the smallest
 * normal), the largest finite magnitude code, the infinity and canonical NaN magnitude codes
 * (-1 when the format has none), and where the sign bit sits. */
typedef struct {
  int mant_bits;
  int min_exp;
  int max_code;
  int inf_code;
  int nan_code;
  int sign_shift;
} narrow_format;

static const narrow_format FMT_BF16 = {7, -126, 0x7F7F, 0x7F80, 0x7FC0, 15};
static const narrow_format FMT_F16 = {10, -14, 0x7BFF, 0x7C00, 0x7E00, 15};
static const narrow_format FMT_E4M3 = {3, -6, 0x7E, -1, 0x7F, 7};
static const narrow_format FMT_E5M2 = {2, -14, 0x7B, 0x7C, 0x7E, 7};
static const narrow_format FMT_E2M1 = {1, 0, 0x7, -1, -1, 3};

/* RNE of a finite, non-negative f32 (bits without sign) into the format with an unbounded
 * exponent range above; the result may exceed max_code (that is overflow). */
static uint32_t round_magnitude(uint32_t abs_bits, const narrow_format *f) {
  if (abs_bits == 0) return 0;
  uint32_t sig = abs_bits & 0x7FFFFFu;
  int biased = (int)(abs_bits >> 23);
  int e = -126; /* f32 subnormal: sig * 2^(-126-23), no implicit bit */
  if (biased != 0) {
    e = biased - 127;
    sig |= 0x800000u;
  }
  int te = e > f->min_exp ? e : f->min_exp;
  int shift = 23 - f->mant_bits + (te - e); /* >= 13: every format here is narrower than f32 */
  uint32_t q = 0;
  if (shift <= 25) { /* beyond 25, sig < 2^24 is below half a quantum: rounds to 0 */
    uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    q = sig >> shift;
    if (rem > half || (rem == half && (q & 1u))) q++;
  }
  return ((uint32_t)(te - f->min_exp) << f->mant_bits) + q;
}

static uint32_t encode_narrow(float x, const narrow_format *f, int saturate) {
  uint32_t b = f32_bits(x), a = b & 0x7FFFFFFFu;
  uint32_t sign = (b >> 31) << f->sign_shift;
  if (a > 0x7F800000u) /* NaN: the canonical quiet NaN with the sign; e2m1 has none: +max */
    return f->nan_code >= 0 ? sign | (uint32_t)f->nan_code : (uint32_t)f->max_code;
  uint32_t code = a == 0x7F800000u ? (uint32_t)f->max_code + 1u : round_magnitude(a, f);
  if (code <= (uint32_t)f->max_code) return sign | code;
  /* overflow (infinity included) */
  if (saturate || (f->inf_code < 0 && f->nan_code < 0)) return sign | (uint32_t)f->max_code;
  if (f->inf_code >= 0) return sign | (uint32_t)f->inf_code;
  return sign | (uint32_t)f->nan_code; /* e4m3: no infinity, overflow is NaN */
}

/* Decodes a narrow code; NaN codes give the canonical f32 quiet NaN with the code's sign
 * (what ml_dtypes returns for fp8). */
static float decode_narrow(uint32_t code, const narrow_format *f) {
  uint32_t sign = (code >> f->sign_shift) & 1u;
  uint32_t mag = code & ((1u << f->sign_shift) - 1u);
  float v;
  if (f->inf_code >= 0 && mag == (uint32_t)f->inf_code) {
    v = INFINITY;
  } else if (mag > (uint32_t)f->max_code) {
    return f32_from_bits((sign << 31) | 0x7FC00000u);
  } else {
    int M = f->mant_bits;
    uint32_t exp_field = mag >> M, mant = mag & ((1u << M) - 1u);
    if (exp_field == 0) /* subnormal: mant * 2^(min_exp - M) */
      v = ldexpf((float)mant, f->min_exp - M);
    else
      v = ldexpf((float)((1u << M) | mant), (int)exp_field - 1 + f->min_exp - M);
  }
  return sign ? -v : v;
}

float tw_bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

uint16_t tw_f32_to_bf16(float x) { return (uint16_t)encode_narrow(x, &FMT_BF16, 0); }

float tw_f16_to_f32(uint16_t h) {
  uint32_t mag = h & 0x7FFFu;
  if (mag > 0x7C00u) /* NaN: keep the payload in the top mantissa bits (as NumPy does) */
    return f32_from_bits(((uint32_t)(h >> 15) << 31) | 0x7F800000u | ((mag & 0x3FFu) << 13));
  return decode_narrow(h, &FMT_F16);
}

uint16_t tw_f32_to_f16(float x) { return (uint16_t)encode_narrow(x, &FMT_F16, 0); }

float tw_e4m3_to_f32(uint8_t c) { return decode_narrow(c, &FMT_E4M3); }

uint8_t tw_f32_to_e4m3(float x, int saturate) {
  return (uint8_t)encode_narrow(x, &FMT_E4M3, saturate);
}

float tw_e5m2_to_f32(uint8_t c) { return decode_narrow(c, &FMT_E5M2); }

uint8_t tw_f32_to_e5m2(float x, int saturate) {
  return (uint8_t)encode_narrow(x, &FMT_E5M2, saturate);
}

float tw_e2m1_to_f32(uint8_t nibble) { return decode_narrow(nibble & 0xFu, &FMT_E2M1); }

uint8_t tw_f32_to_e2m1(float x) { return (uint8_t)encode_narrow(x, &FMT_E2M1, 1); }

float tw_e8m0_to_f32(uint8_t e) {
  if (e == 0xFF) return f32_from_bits(0x7FC00000u);
  if (e == 0) return f32_from_bits(0x00400000u); /* 2^-127, an f32 subnormal */
  return f32_from_bits((uint32_t)e << 23);
}

uint8_t tw_f32_to_e8m0_ceil(float v) {
  uint32_t b = f32_bits(v);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0xFF;
  if (b >> 31) return 0x00; /* negative (and -0): rounding up lands on the smallest, 2^-127 */
  if (b == 0x7F800000u) return 0xFE;
  uint32_t exp = b >> 23, mant = b & 0x7FFFFFu;
  if (exp == 0) return mant > 0x400000u ? 1 : 0; /* (2^-127, 2^-126) -> 2^-126 */
  return (uint8_t)(exp + (mant != 0 && exp != 0xFE));
}

double tw_dtype_max(tw_dtype t) {
  switch (t) {
    case TW_F64: return 1.7976931348623157e308;
    case TW_F32: return 3.4028234663852886e38;
    case TW_BF16: return 3.3895313892515355e38; /* 0x7F7F = (2 - 2^-7) * 2^127 */
    case TW_F16: return 65504.0;
    case TW_E4M3: return 448.0;
    case TW_E5M2: return 57344.0;
    case TW_E2M1: return 6.0;
    case TW_E8M0: return 1.7014118346046923e38; /* 2^127 */
    default: return 0.0;
  }
}

double tw_dtype_unit_roundoff(tw_dtype t) {
  switch (t) {
    case TW_F64: return ldexp(1.0, -53);
    case TW_F32: return ldexp(1.0, -24);
    case TW_BF16: return ldexp(1.0, -8);
    case TW_F16: return ldexp(1.0, -11);
    case TW_E4M3: return ldexp(1.0, -4);
    case TW_E5M2: return ldexp(1.0, -3);
    case TW_E2M1: return ldexp(1.0, -2);
    case TW_E8M0: return ldexp(1.0, -1);
    default: return 0.0;
  }
}

double tw_load_as_f64(const void *data, tw_dtype t, int64_t i) {
  switch (t) {
    case TW_F64: return ((const double *)data)[i];
    case TW_F32: return ((const float *)data)[i];
    case TW_BF16: return tw_bf16_to_f32(((const uint16_t *)data)[i]);
    case TW_F16: return tw_f16_to_f32(((const uint16_t *)data)[i]);
    case TW_E4M3: return tw_e4m3_to_f32(((const uint8_t *)data)[i]);
    case TW_E5M2: return tw_e5m2_to_f32(((const uint8_t *)data)[i]);
    case TW_E8M0: return tw_e8m0_to_f32(((const uint8_t *)data)[i]);
    case TW_E2M1: {
      uint8_t byte = ((const uint8_t *)data)[i / 2];
      return tw_e2m1_to_f32((i & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0xF));
    }
    case TW_I32: return ((const int32_t *)data)[i];
    case TW_I64: return (double)((const int64_t *)data)[i];
    case TW_U8: return ((const uint8_t *)data)[i];
    case TW_U16: return ((const uint16_t *)data)[i];
    default: return NAN;
  }
}

/* Truncate toward zero into [lo, hi]; NaN -> 0. The bounds are compared in double, where
 * hi + 1 (a power of two) is exact even for i64. */
static int64_t to_int_saturating(double v, double lo, double hi_plus_one, int64_t lo_i,
                                 int64_t hi_i) {
  if (v != v) return 0;
  if (v <= lo) return lo_i;
  if (v >= hi_plus_one) return hi_i;
  return (int64_t)v;
}

void tw_store_from_f64(void *data, tw_dtype t, int64_t i, double v, int saturate) {
  float x = (float)v; /* RNE under the default rounding mode; used by the float formats */
  switch (t) {
    case TW_F64: ((double *)data)[i] = v; break;
    case TW_F32: ((float *)data)[i] = x; break;
    case TW_BF16: ((uint16_t *)data)[i] = tw_f32_to_bf16(x); break;
    case TW_F16: ((uint16_t *)data)[i] = tw_f32_to_f16(x); break;
    case TW_E4M3: ((uint8_t *)data)[i] = tw_f32_to_e4m3(x, saturate); break;
    case TW_E5M2: ((uint8_t *)data)[i] = tw_f32_to_e5m2(x, saturate); break;
    case TW_E8M0: ((uint8_t *)data)[i] = tw_f32_to_e8m0_ceil(x); break;
    case TW_E2M1: {
      uint8_t *byte = (uint8_t *)data + i / 2, nib = tw_f32_to_e2m1(x);
      *byte = (i & 1) ? (uint8_t)((*byte & 0x0F) | (nib << 4)) : (uint8_t)((*byte & 0xF0) | nib);
      break;
    }
    case TW_I32:
      ((int32_t *)data)[i] =
          (int32_t)to_int_saturating(v, -2147483648.0, 2147483648.0, INT32_MIN, INT32_MAX);
      break;
    case TW_I64:
      ((int64_t *)data)[i] = to_int_saturating(v, -9223372036854775808.0,
                                               9223372036854775808.0, INT64_MIN, INT64_MAX);
      break;
    case TW_U8: ((uint8_t *)data)[i] = (uint8_t)to_int_saturating(v, 0.0, 256.0, 0, 255); break;
    case TW_U16:
      ((uint16_t *)data)[i] = (uint16_t)to_int_saturating(v, 0.0, 65536.0, 0, 65535);
      break;
    default: break;
  }
}
