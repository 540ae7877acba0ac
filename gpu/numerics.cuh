// gpu/numerics.cuh — device codecs, bit for bit equal to core/numerics.c (tw_numerics.h):
// RNE everywhere, subnormals kept, the same NaN codes and signs (ml_dtypes': e4m3 0x7F|s,
// e5m2 0x7E|s, f16 0x7E00|s, bf16 0x7FC0|s, e2m1 NaN -> +6). Every function is
// __host__ __device__ so the same code can be checked on the host.
//
// The hot path of quantization (f32 -> e4m3/e5m2 with satfinite) uses the hardware
// cvt.rn.satfinite.{e4m3,e5m2}x2.f32 on sm_89+, which rounds the same way; NaN lanes are then
// set to the canonical positive code the quantizer writes (0x7F e4m3, 0x7E e5m2).
#ifndef TWIN_GPU_NUMERICS_CUH
#define TWIN_GPU_NUMERICS_CUH

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TW_HD __host__ __device__ __forceinline__
#else
#define TW_HD static inline
#endif

TW_HD uint32_t tw_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
TW_HD float tw_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}
TW_HD int tw_isnan(float f) { return (tw_f2u(f) & 0x7FFFFFFFu) > 0x7F800000u; }

// Largest-with-NaN max: once either side is NaN the result is NaN (fmaxf would drop it).
TW_HD float tw_nmax(float a, float b) { return (a > b || a != a) ? a : b; }

// NaN outputs are canonical (tw_quantize.h): the positive quiet NaN, whatever sign and payload
// the arithmetic produced (CPUs and GPUs differ there).
TW_HD float tw_canon(float v) { return tw_isnan(v) ? tw_u2f(0x7FC00000u) : v; }

// |x| of a finite f32 rounded RNE into a format with `mbits` mantissa bits and exponent
// `bias`, unbounded above: returns the magnitude code (exponent field << mbits | mantissa),
// which may exceed the format's largest code (the caller decides overflow).
TW_HD uint32_t tw_round_mag(uint32_t abs_bits, int mbits, int bias) {
  int exp = (int)(abs_bits >> 23);
  if (exp == 0) return 0;  // f32 subnormals are far below every narrow format's smallest value
  uint32_t full = (abs_bits & 0x7FFFFFu) | 0x800000u;
  int te = exp - 127 + bias;  // biased exponent in the target
  int shift = 23 - mbits + (te < 1 ? 1 - te : 0);
  if (shift > 25) return 0;  // below half the smallest subnormal
  uint32_t q = full >> shift, rem = full & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return ((uint32_t)(te < 1 ? 0 : te - 1) << mbits) + q;
}

TW_HD float tw_bf16_to_f32_d(uint16_t h) { return tw_u2f((uint32_t)h << 16); }
TW_HD uint16_t tw_f32_to_bf16_d(float x) {
  uint32_t u = tw_f2u(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7FC0u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

TW_HD float tw_f16_to_f32_d(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return tw_u2f(s | 0x7F800000u | (m << 13));  // NaN payload kept (NumPy)
  if (e == 0) {
    float v = (float)m * tw_u2f(0x33800000u);  // m * 2^-24, exact
    return s ? -v : v;
  }
  return tw_u2f(s | ((e + 112u) << 23) | (m << 13));
}
TW_HD uint16_t tw_f32_to_f16_d(float x) {
  uint32_t u = tw_f2u(x), s = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)(s | 0x7E00u);
  if (a == 0x7F800000u) return (uint16_t)(s | 0x7C00u);
  uint32_t c = tw_round_mag(a, 10, 15);
  return (uint16_t)(s | (c >= 0x7C00u ? 0x7C00u : c));
}

TW_HD float tw_e4m3_to_f32_d(uint8_t c) {
  uint32_t s = (uint32_t)(c & 0x80u) << 24, e = (c >> 3) & 0xFu, m = c & 7u;
  if (e == 0xF && m == 7) return tw_u2f(s | 0x7FC00000u);
  if (e == 0) {
    float v = (float)m * 0.001953125f;  // m * 2^-9
    return s ? -v : v;
  }
  return tw_u2f(s | ((e + 120u) << 23) | (m << 20));
}
TW_HD uint8_t tw_f32_to_e4m3_d(float x, int saturate) {
  uint32_t u = tw_f2u(x), s = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint8_t)(s | 0x7F);
  if (a == 0x7F800000u) return (uint8_t)(s | (saturate ? 0x7E : 0x7F));
  uint32_t c = tw_round_mag(a, 3, 7);
  if (c > 0x7E) c = saturate ? 0x7E : 0x7F;
  return (uint8_t)(s | c);
}

TW_HD float tw_e5m2_to_f32_d(uint8_t c) {
  if ((c & 0x7Fu) > 0x7Cu) return tw_u2f(((uint32_t)(c & 0x80u) << 24) | 0x7FC00000u);  // ml_dtypes
  return tw_f16_to_f32_d((uint16_t)((uint16_t)c << 8));
}
TW_HD uint8_t tw_f32_to_e5m2_d(float x, int saturate) {
  uint32_t u = tw_f2u(x), s = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint8_t)(s | 0x7E);
  if (a == 0x7F800000u) return (uint8_t)(s | (saturate ? 0x7B : 0x7C));
  uint32_t c = tw_round_mag(a, 2, 15);
  if (c > 0x7B) c = saturate ? 0x7B : 0x7C;
  return (uint8_t)(s | c);
}

TW_HD float tw_e2m1_to_f32_d(uint8_t nib) {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = mag[nib & 7u];
  return (nib & 8u) ? -v : v;
}
TW_HD uint8_t tw_f32_to_e2m1_d(float x) {
  uint32_t u = tw_f2u(x), s = (u >> 28) & 0x8u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7;
  if (a == 0x7F800000u) return (uint8_t)(s | 0x7);
  uint32_t c = tw_round_mag(a, 1, 1);
  return (uint8_t)(s | (c > 7 ? 7 : c));
}

TW_HD float tw_e8m0_to_f32_d(uint8_t e) {
  if (e == 0xFF) return tw_u2f(0x7FC00000u);
  if (e == 0) return tw_u2f(0x00400000u);  // 2^-127, subnormal
  return tw_u2f((uint32_t)e << 23);
}
// TE's float_to_e8m0: round up to a power of two, saturating (see tw_numerics.h).
TW_HD uint8_t tw_f32_to_e8m0_ceil_d(float v) {
  uint32_t u = tw_f2u(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFF;
  if (u == 0x7F800000u) return 0xFE;
  if (u & 0x80000000u) return 0x00;
  uint32_t exp = u >> 23, mant = u & 0x7FFFFFu;
  if (mant > 0 && exp != 0xFE && !(exp == 0 && mant <= 0x400000u)) exp++;
  return (uint8_t)exp;
}
// 2^(127 - e) as the f32 that multiplies data into range: e = 254 gives 2^-127 (subnormal),
// e = 0 gives 2^127, e = 255 (NaN amax) gives NaN.
TW_HD float tw_e8m0_quant_scale(uint8_t e) {
  if (e == 0xFF) return tw_u2f(0x7FC00000u);
  if (e == 0xFE) return tw_u2f(0x00400000u);
  return tw_u2f((uint32_t)(254 - e) << 23);
}

// compute_scale of tw_quantize.h: 1 for a zero or non-finite amax, else fp8_max / a (FLT_MAX
// when that overflows), mantissa cleared with pow2.
TW_HD float tw_compute_scale(float amax, float fp8_max, int pow2) {
  if (amax == 0.0f || !(amax - amax == 0.0f)) return 1.0f;
  float s = fp8_max / amax;
  if (tw_f2u(s) == 0x7F800000u) s = tw_u2f(0x7F7FFFFFu);
  if (pow2) s = tw_u2f(tw_f2u(s) & 0xFF800000u);
  return s;
}

#ifdef __CUDACC__
// Four f32 -> four fp8 codes with satfinite, packed little-endian (v0 in the low byte); NaN
// gives the positive NaN code. fp8: 0 = e4m3, 1 = e5m2.
__device__ __forceinline__ uint32_t gpu_fp8x4_sat(float v0, float v1, float v2, float v3, int fp8) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short lo, hi;
  if (fp8 == 0) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  }
  uint32_t r = (uint32_t)lo | ((uint32_t)hi << 16);
  if (tw_isnan(v0) | tw_isnan(v1) | tw_isnan(v2) | tw_isnan(v3)) {
    const float v[4] = {v0, v1, v2, v3};
    const uint32_t code = fp8 == 0 ? 0x7Fu : 0x7Eu;
    for (int i = 0; i < 4; i++)
      if (tw_isnan(v[i])) r = (r & ~(0xFFu << (8 * i))) | (code << (8 * i));
  }
  return r;
#else
  v0 = tw_canon(v0);
  v1 = tw_canon(v1);
  v2 = tw_canon(v2);
  v3 = tw_canon(v3);
  if (fp8 == 0)
    return (uint32_t)tw_f32_to_e4m3_d(v0, 1) | ((uint32_t)tw_f32_to_e4m3_d(v1, 1) << 8) |
           ((uint32_t)tw_f32_to_e4m3_d(v2, 1) << 16) | ((uint32_t)tw_f32_to_e4m3_d(v3, 1) << 24);
  return (uint32_t)tw_f32_to_e5m2_d(v0, 1) | ((uint32_t)tw_f32_to_e5m2_d(v1, 1) << 8) |
         ((uint32_t)tw_f32_to_e5m2_d(v2, 1) << 16) | ((uint32_t)tw_f32_to_e5m2_d(v3, 1) << 24);
#endif
}
#endif

#endif
