/* twin numerics: bit-exact encode/decode of every dtype, on host and device.
 *
 * All encoders take an f32 and round to nearest, ties to even (RNE). Subnormals of the target
 * are produced and decoded exactly (no flush to zero). Special values, per format (NaN codes
 * written by encoders are canonical quiet NaNs that keep the input's sign):
 *
 *   format  max finite   inf   NaN codes           encode: overflow (|x| rounds past max), inf, NaN
 *   bf16    3.39e38      yes   exp=0xFF,m!=0       -> ±inf (IEEE); NaN -> 0x7FC0|sign
 *   f16     65504        yes   exp=0x1F,m!=0       -> ±inf (IEEE); NaN -> 0x7E00|sign
 *   e4m3    448          no    0x7F, 0xFF          saturate=0: -> NaN (0x7F|sign); inf -> NaN (0x7F|sign)
 *                                                   saturate=1: -> ±448;  inf -> ±448; NaN -> 0x7F|sign
 *   e5m2    57344        yes   exp=0x1F,m!=0       saturate=0: -> ±inf; inf -> ±inf; NaN -> 0x7E|sign
 *                                                   saturate=1: -> ±57344; inf -> ±57344; NaN -> 0x7E|sign
 *   e2m1    6            no    none                always saturates: -> ±6; inf -> ±6;
 *                                                   NaN -> +6 (0x7): the format has no NaN
 *   e8m0    2^127        no    0xFF                no RNE encoder (see tw_f32_to_e8m0_ceil);
 *                                                   0x00 = 2^-127
 *
 * "Rounds past max" means: RNE in an unbounded-exponent version of the format gives a value
 * larger than max; e.g. for e4m3, 464 (the midpoint 448..480) rounds to even, i.e. 448, and
 * anything above 464 overflows; for e5m2, 61440 (midpoint 57344..65536) ties to the even
 * 65536 and so overflows. bf16 and f16 have no saturating mode (the saturate argument of
 * tw_store_from_f64 / tw_cast is ignored for them).
 *
 * Agreement with ml_dtypes 0.6 (checked by golden/gen_numerics.py and tests/numerics_test.c):
 * saturate=0 equals `x.astype(dtype)` bit for bit, and saturate=1 equals
 * `np.clip(x, -max, max).astype(dtype)`, for bf16, e4m3 and e5m2 on every f32 input, NaNs
 * included; f16 equals NumPy's astype except that NumPy keeps NaN payloads (0x7FA00000 ->
 * 0x7D00) where twin writes 0x7E00|sign; e2m1 equals ml_dtypes except for NaN, which
 * ml_dtypes turns into a zero of flipped sign (+NaN -> 0x8, -NaN -> 0x0) and twin, like
 * CUDA's __nv_cvt_float_to_fp4, into +6. saturate=1 is what the GPU's cvt.*.satfinite does
 * and what quantization uses (clip(x*scale, -max, max) then RNE gives the same codes) on
 * every non-NaN input (checked on an H200); the hardware's NaNs lose their sign (see
 * core/numerics.c), so the GPU twin patches NaN lanes to the codes above.
 *
 * Decoders are exact. NaN codes decode to: fp8 and e8m0 -> the f32 quiet NaN 0x7FC00000 with
 * the code's sign (as ml_dtypes); bf16 -> the code shifted left 16 (payload kept); f16 -> sign,
 * 0x7F800000 | (mantissa << 13) (payload kept, as NumPy). So decode-then-encode returns every
 * non-NaN code unchanged and maps every NaN code to the canonical NaN of its sign.
 *
 * E8M0 from a scale (MXFP8, TE's float_to_e8m0): tw_f32_to_e8m0_ceil rounds *up* (toward +inf)
 * to a power of two and saturates: NaN -> 0xFF, +inf -> 0xFE, values <= 2^-127 -> 0x00 (the
 * subnormal corner: bits(v) with exp 0 and mantissa <= 0x400000 stay 0x00), negative (-0 and
 * -inf included) -> 0x00. Otherwise e = exp(v) + (mantissa != 0 && exp != 0xFE).
 * (ml_dtypes' float8_e8m0fnu astype rounds to nearest instead and maps 0 and negatives to NaN;
 * twin has no such encoder.)
 */
#ifndef TWIN_TW_NUMERICS_H
#define TWIN_TW_NUMERICS_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

float tw_bf16_to_f32(uint16_t h);
uint16_t tw_f32_to_bf16(float x);
float tw_f16_to_f32(uint16_t h);
uint16_t tw_f32_to_f16(float x);
float tw_e4m3_to_f32(uint8_t c);
uint8_t tw_f32_to_e4m3(float x, int saturate);
float tw_e5m2_to_f32(uint8_t c);
uint8_t tw_f32_to_e5m2(float x, int saturate);
float tw_e2m1_to_f32(uint8_t nibble); /* low 4 bits used */
uint8_t tw_f32_to_e2m1(float x);      /* returns a nibble 0..15 */
float tw_e8m0_to_f32(uint8_t e);      /* 2^(e-127); 0xFF -> NaN; 0x00 -> 2^-127 (subnormal) */
uint8_t tw_f32_to_e8m0_ceil(float v);

/* Largest finite value of a float format (f64/f32/bf16/f16/e4m3/e5m2/e2m1/e8m0), 0 otherwise. */
double tw_dtype_max(tw_dtype t);
/* Unit roundoff 2^-(mantissa bits + 1) of a float format (f32: 2^-24, bf16: 2^-8). */
double tw_dtype_unit_roundoff(tw_dtype t);

/* Element i of a tensor's storage, decoded to double (every dtype; e2m1 nibble-packed). */
double tw_load_as_f64(const void *data, tw_dtype t, int64_t i);
/* Encodes v (rounded first to f32 for the float formats, RNE) into element i. saturate applies
 * to e4m3/e5m2; e8m0 takes tw_f32_to_e8m0_ceil; e2m1 writes only element i's nibble; integer
 * dtypes (u8/u16 included) truncate toward zero and saturate, NaN -> 0. */
void tw_store_from_f64(void *data, tw_dtype t, int64_t i, double v, int saturate);

/* Operation: dst = convert(src), elementwise, same shape. Any float/int dtype to any other
 * (e8m0 only as a source). Float targets use the rules above (a source wider than f32 is
 * rounded to f32 first); integer targets truncate toward zero and saturate (NaN -> 0);
 * integer to integer is exact (clamped). */
tw_status tw_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate);

#ifdef __cplusplus
}
#endif
#endif
