/* tw_exp_f64: exp(x) in f64 built from +, -, *, / and floor only (no libm exp, no FMA), so the
 * host oracle (ref/router.c) and the CUDA twin (gpu/router.cu) compute the same bits on every
 * machine. libm's exp is not that: glibc picks an FMA variant by CPU (ifunc), other libms
 * differ in the last bit, and CUDA's f64 exp is accurate to 1 ulp; one ulp of exp(x - max)
 * becomes the whole answer where the router's aux-loss gradient cancels to ~0.
 *
 * Method: n = floor(x / ln2 + 1/2), r = (x - n ln2_hi) - n ln2_lo (ln2_hi has 21 trailing zero
 * bits, so n ln2_hi is exact), |r| <= 0.3466; exp(r) by its Taylor series to degree 14 in
 * Horner form (truncation < 2^-60 relative); then times 2^n by exact power-of-two products,
 * the last one rounding once when the result is subnormal. Error: a few ulp of f64 at most,
 * far below the f32 rounding the router applies. x > 709.78: +inf; x < -745.2: +0; NaN: NaN.
 * Compile callers without FMA contraction (host C here has none; gpu/: -fmad=false). */
#ifndef TWIN_CORE_TW_EXP_H
#define TWIN_CORE_TW_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TW_EXP_HD __host__ __device__ static inline
#else
#define TW_EXP_HD static inline
#endif

/* 2^m for m in [-1022, 1023], exactly. */
TW_EXP_HD double tw_pow2_f64(int m) {
  uint64_t bits = (uint64_t)(m + 1023) << 52;
  double d;
  memcpy(&d, &bits, sizeof d);
  return d;
}

TW_EXP_HD double tw_exp_f64(double x) {
  if (x != x) return x;
  if (x > 709.782712893384) return INFINITY;
  if (x < -745.2) return 0.0;
  const double inv_ln2 = 1.4426950408889634074;
  const double ln2_hi = 6.93147180369123816490e-01; /* 0x3FE62E42FEE00000 */
  const double ln2_lo = 1.90821492927058770002e-10; /* ln2 - ln2_hi */
  double n = floor(x * inv_ln2 + 0.5);
  double r = (x - n * ln2_hi) - n * ln2_lo;
  /* 1/k!, k = 14 .. 2 */
  double p = 1.0 / 87178291200.0;
  p = p * r + 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  double e = 1.0 + (r + r * r * p); /* exp(r) = 1 + r + r^2 (1/2 + r/6 + ...) */
  int k = (int)n;
  if (k > 1023) return (e * 2.0) * tw_pow2_f64(k - 1);
  if (k < -1022) return (e * tw_pow2_f64(k + 64)) * tw_pow2_f64(-64);
  return e * tw_pow2_f64(k);
}

#endif
