/* The scalar codecs of tw_numerics.h: exhaustive round trips over every 4-, 8- and 16-bit
 * code, hand-picked edge cases per format, dtype constants, load/store of every dtype, and
 * the golden tables of golden/gen_numerics.py (ml_dtypes) compared bit for bit. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_npy.h"
#include "twin/tw_numerics.h"

static uint32_t bits_of(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

static float from_bits(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* ---- exhaustive round trips: decode then encode gives the code back ------------------------ */

Test(numerics, bf16_every_code_round_trips) {
  for (uint32_t c = 0; c < 65536; c++) {
    float v = tw_bf16_to_f32((uint16_t)c);
    cr_assert_eq(bits_of(v), c << 16, "bf16 %04x decodes to %08x", c, bits_of(v));
    int is_nan = (c & 0x7F80) == 0x7F80 && (c & 0x7F) != 0;
    uint16_t want = is_nan ? (uint16_t)((c & 0x8000) | 0x7FC0) : (uint16_t)c;
    cr_assert_eq(tw_f32_to_bf16(v), want, "bf16 %04x -> %g -> %04x, want %04x", c, v,
                 tw_f32_to_bf16(v), want);
  }
}

Test(numerics, f16_every_code_round_trips) {
  for (uint32_t c = 0; c < 65536; c++) {
    float v = tw_f16_to_f32((uint16_t)c);
    int is_nan = (c & 0x7C00) == 0x7C00 && (c & 0x3FF) != 0;
    cr_assert_eq(isnan(v) != 0, is_nan, "f16 %04x decodes to %g", c, v);
    uint16_t want = is_nan ? (uint16_t)((c & 0x8000) | 0x7E00) : (uint16_t)c;
    cr_assert_eq(tw_f32_to_f16(v), want, "f16 %04x -> %g -> %04x, want %04x", c, v,
                 tw_f32_to_f16(v), want);
  }
}

Test(numerics, e4m3_every_code_round_trips_in_both_modes) {
  for (int c = 0; c < 256; c++) {
    float v = tw_e4m3_to_f32((uint8_t)c);
    int is_nan = (c & 0x7F) == 0x7F;
    cr_assert_eq(isnan(v) != 0, is_nan, "e4m3 %02x decodes to %g", c, v);
    cr_assert(!isinf(v), "e4m3 has no infinity, %02x decodes to %g", c, v);
    for (int sat = 0; sat < 2; sat++)
      cr_assert_eq(tw_f32_to_e4m3(v, sat), c, "e4m3 %02x -> %g -> %02x (saturate=%d)", c, v,
                   tw_f32_to_e4m3(v, sat), sat);
  }
}

Test(numerics, e5m2_every_code_round_trips_in_both_modes) {
  for (int c = 0; c < 256; c++) {
    float v = tw_e5m2_to_f32((uint8_t)c);
    int mag = c & 0x7F, is_nan = mag > 0x7C;
    cr_assert_eq(isnan(v) != 0, is_nan, "e5m2 %02x decodes to %g", c, v);
    cr_assert_eq(isinf(v) != 0, mag == 0x7C, "e5m2 %02x decodes to %g", c, v);
    int want0 = is_nan ? (c & 0x80) | 0x7E : c;
    cr_assert_eq(tw_f32_to_e5m2(v, 0), want0, "e5m2 %02x -> %g -> %02x", c, v, tw_f32_to_e5m2(v, 0));
    int want1 = mag == 0x7C ? (c & 0x80) | 0x7B : want0; /* saturate: inf -> max */
    cr_assert_eq(tw_f32_to_e5m2(v, 1), want1, "e5m2 %02x -> %g -> %02x (saturate)", c, v,
                 tw_f32_to_e5m2(v, 1));
  }
}

Test(numerics, e2m1_every_code_round_trips) {
  static const float values[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; c++) {
    float v = tw_e2m1_to_f32((uint8_t)c);
    cr_assert_eq(bits_of(v), bits_of(values[c]), "e2m1 %x decodes to %g", c, v);
    cr_assert_eq(tw_e2m1_to_f32((uint8_t)(0xF0 | c)), v, "e2m1 decode must ignore the high nibble");
    cr_assert_eq(tw_f32_to_e2m1(v), c, "e2m1 %x -> %g -> %x", c, v, tw_f32_to_e2m1(v));
  }
}

Test(numerics, e8m0_every_code_round_trips_through_ceil) {
  for (int e = 0; e < 255; e++) {
    float v = tw_e8m0_to_f32((uint8_t)e);
    cr_assert_eq((double)v, ldexp(1.0, e - 127), "e8m0 %02x decodes to %g", e, v);
    cr_assert_eq(tw_f32_to_e8m0_ceil(v), e, "e8m0 %02x -> %g -> %02x", e, v, tw_f32_to_e8m0_ceil(v));
  }
  cr_assert(isnan(tw_e8m0_to_f32(0xFF)));
  cr_assert_eq(tw_f32_to_e8m0_ceil(tw_e8m0_to_f32(0xFF)), 0xFF);
}

Test(numerics, narrow_codes_are_monotone_in_value) {
  /* positive finite codes in increasing order decode to strictly increasing values */
  for (int c = 1; c <= 0x7E; c++) cr_assert_lt(tw_e4m3_to_f32((uint8_t)(c - 1)), tw_e4m3_to_f32((uint8_t)c));
  for (int c = 1; c <= 0x7B; c++) cr_assert_lt(tw_e5m2_to_f32((uint8_t)(c - 1)), tw_e5m2_to_f32((uint8_t)c));
  for (int c = 1; c <= 0x7; c++) cr_assert_lt(tw_e2m1_to_f32((uint8_t)(c - 1)), tw_e2m1_to_f32((uint8_t)c));
  for (int c = 1; c <= 0x7BFF; c++) cr_assert_lt(tw_f16_to_f32((uint16_t)(c - 1)), tw_f16_to_f32((uint16_t)c));
}

/* ---- hand-picked edge cases ------------------------------------------------------------------ */

typedef struct {
  uint32_t in;   /* f32 bits */
  unsigned sat0; /* expected code, saturate = 0 */
  unsigned sat1; /* expected code, saturate = 1 */
} edge_case;

#define F32(x) bits_of(x)

Test(numerics, e4m3_edges) {
  const edge_case cases[] = {
      {F32(448.0f), 0x7E, 0x7E},         {F32(464.0f), 0x7E, 0x7E}, /* tie 448|480 -> even 448 */
      {0x43E80001, 0x7F, 0x7E},          /* just above 464: overflow */
      {F32(480.0f), 0x7F, 0x7E},         {F32(1e9f), 0x7F, 0x7E},
      {F32(-464.0f), 0xFE, 0xFE},        {F32(-465.0f), 0xFF, 0xFE},
      {0x7F800000, 0x7F, 0x7E},          {0xFF800000, 0xFF, 0xFE}, /* inf */
      {0x7FC00000, 0x7F, 0x7F},          {0xFFC00000, 0xFF, 0xFF}, /* NaN keeps its sign */
      {0x7F800001, 0x7F, 0x7F},          /* signalling NaN */
      {F32(0.0f), 0x00, 0x00},           {F32(-0.0f), 0x80, 0x80},
      {F32(0x1p-9f), 0x01, 0x01},        /* smallest subnormal */
      {F32(0x1p-10f), 0x00, 0x00},       /* half of it: tie -> even 0 */
      {0x3A800001, 0x01, 0x01},          /* just above half */
      {F32(0x3p-10f), 0x02, 0x02},       /* tie 1|2 -> even 2 */
      {F32(0x7p-9f), 0x07, 0x07},        /* largest subnormal */
      {F32(0xFp-10f), 0x08, 0x08},       /* tie 7|8 -> even 8 = smallest normal */
      {F32(0x1p-6f), 0x08, 0x08},        {F32(1.0f), 0x38, 0x38},
      {F32(1.0625f), 0x38, 0x38},        /* tie 1|1.125 -> even */
      {F32(1.1875f), 0x3A, 0x3A},        /* tie 1.125|1.25 -> even 1.25 */
      {0x00000001, 0x00, 0x00},          /* f32 subnormal */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = from_bits(cases[i].in);
    cr_expect_eq(tw_f32_to_e4m3(x, 0), cases[i].sat0, "e4m3(%08x = %g) = %02x, want %02x",
                 cases[i].in, x, tw_f32_to_e4m3(x, 0), cases[i].sat0);
    cr_expect_eq(tw_f32_to_e4m3(x, 1), cases[i].sat1, "e4m3 sat(%08x = %g) = %02x, want %02x",
                 cases[i].in, x, tw_f32_to_e4m3(x, 1), cases[i].sat1);
  }
}

Test(numerics, e5m2_edges) {
  const edge_case cases[] = {
      {F32(57344.0f), 0x7B, 0x7B},
      {F32(61440.0f), 0x7C, 0x7B},       /* tie 57344|65536 -> even 65536: overflow */
      {0x476FFFFF, 0x7B, 0x7B},          /* just below the tie */
      {F32(-61440.0f), 0xFC, 0xFB},
      {0x7F800000, 0x7C, 0x7B},          {0xFF800000, 0xFC, 0xFB},
      {0x7FC00000, 0x7E, 0x7E},          {0xFFC00000, 0xFE, 0xFE},
      {0x7F800001, 0x7E, 0x7E},          /* payload below e5m2's mantissa: must not become inf */
      {F32(0x1p-16f), 0x01, 0x01},       {F32(0x1p-17f), 0x00, 0x00},
      {F32(0x3p-17f), 0x02, 0x02},       {F32(0x1p-14f), 0x04, 0x04},
      {F32(1.0f), 0x3C, 0x3C},           {F32(-0.0f), 0x80, 0x80},
      {F32(1.125f), 0x3C, 0x3C},         /* tie 1|1.25 -> even */
      {F32(1.375f), 0x3E, 0x3E},         /* tie 1.25|1.5 -> even 1.5 */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = from_bits(cases[i].in);
    cr_expect_eq(tw_f32_to_e5m2(x, 0), cases[i].sat0, "e5m2(%08x = %g) = %02x, want %02x",
                 cases[i].in, x, tw_f32_to_e5m2(x, 0), cases[i].sat0);
    cr_expect_eq(tw_f32_to_e5m2(x, 1), cases[i].sat1, "e5m2 sat(%08x = %g) = %02x, want %02x",
                 cases[i].in, x, tw_f32_to_e5m2(x, 1), cases[i].sat1);
  }
}

Test(numerics, e2m1_edges) {
  const edge_case cases[] = {
      {F32(6.0f), 0x7, 0}, {F32(7.0f), 0x7, 0}, {F32(100.0f), 0x7, 0}, {F32(-7.0f), 0xF, 0},
      {0x7F800000, 0x7, 0}, {0xFF800000, 0xF, 0},
      {0x7FC00000, 0x7, 0}, {0xFFC00000, 0x7, 0}, /* no NaN in e2m1: +6 (as CUDA) */
      {F32(0.25f), 0x0, 0},  /* tie 0|0.5 -> even 0 */
      {0x3E800001, 0x1, 0}, {F32(0.75f), 0x2, 0}, /* tie 0.5|1 -> even 1 */
      {F32(1.25f), 0x2, 0}, {F32(1.75f), 0x4, 0}, {F32(2.5f), 0x4, 0}, {F32(3.5f), 0x6, 0},
      {F32(5.0f), 0x6, 0},  {F32(-5.0f), 0xE, 0}, {F32(-0.0f), 0x8, 0}, {F32(-0.2f), 0x8, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = from_bits(cases[i].in);
    cr_expect_eq(tw_f32_to_e2m1(x), cases[i].sat0, "e2m1(%08x = %g) = %x, want %x", cases[i].in,
                 x, tw_f32_to_e2m1(x), cases[i].sat0);
  }
}

Test(numerics, bf16_edges) {
  const edge_case cases[] = {
      {F32(1.0f), 0x3F80, 0}, {0x3F808000, 0x3F80, 0}, /* tie -> even */
      {0x3F818000, 0x3F82, 0}, {0x3F808001, 0x3F81, 0},
      {0x7F7F7FFF, 0x7F7F, 0}, {0x7F7F8000, 0x7F80, 0}, /* tie at max -> even = inf */
      {0x7F7FFFFF, 0x7F80, 0}, {0x7F800000, 0x7F80, 0}, {0xFF800000, 0xFF80, 0},
      {0x7F800001, 0x7FC0, 0}, /* truncating would make this inf */
      {0xFF800001, 0xFFC0, 0}, {0x7FFFFFFF, 0x7FC0, 0},
      {0x00000001, 0x0000, 0}, {0x00008000, 0x0000, 0}, {0x00008001, 0x0001, 0},
      {0x00018000, 0x0002, 0}, {0x007FFFFF, 0x0080, 0}, /* rounds up into the smallest normal */
      {0x80000000, 0x8000, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = from_bits(cases[i].in);
    cr_expect_eq(tw_f32_to_bf16(x), cases[i].sat0, "bf16(%08x) = %04x, want %04x", cases[i].in,
                 tw_f32_to_bf16(x), cases[i].sat0);
  }
}

Test(numerics, f16_edges) {
  const edge_case cases[] = {
      {F32(65504.0f), 0x7BFF, 0}, {0x477FEFFF, 0x7BFF, 0}, /* just below 65520 */
      {F32(65520.0f), 0x7C00, 0}, /* tie at max -> even = inf */
      {F32(-65520.0f), 0xFC00, 0}, {0x7F800000, 0x7C00, 0},
      {0x7FC00000, 0x7E00, 0},   {0xFFC00000, 0xFE00, 0}, {0x7F800001, 0x7E00, 0},
      {F32(0x1p-24f), 0x0001, 0}, {F32(0x1p-25f), 0x0000, 0}, {0x33000001, 0x0001, 0},
      {F32(0x3p-25f), 0x0002, 0}, {F32(0x1p-14f), 0x0400, 0}, {F32(1.0f), 0x3C00, 0},
      {F32(1.0f + 0x1p-11f), 0x3C00, 0}, {F32(1.0f + 0x3p-11f), 0x3C02, 0},
      {0x00000001, 0x0000, 0}, {0x80000001, 0x8000, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = from_bits(cases[i].in);
    cr_expect_eq(tw_f32_to_f16(x), cases[i].sat0, "f16(%08x) = %04x, want %04x", cases[i].in,
                 tw_f32_to_f16(x), cases[i].sat0);
  }
}

Test(numerics, e8m0_ceil_edges) {
  const edge_case cases[] = {
      {F32(1.0f), 127, 0},     {0x3F800001, 128, 0},   {F32(0.75f), 127, 0},
      {F32(0.5f), 126, 0},     {F32(448.0f / 448.0f), 127, 0},
      {F32(0.0f), 0, 0},       {F32(-0.0f), 0, 0},     {F32(-1.0f), 0, 0},
      {0xFF800000, 0, 0},      {0x7F800000, 0xFE, 0},  {0x7FC00000, 0xFF, 0},
      {0xFFC00000, 0xFF, 0},   {F32(0x1p127f), 0xFE, 0}, {0x7F000001, 0xFE, 0}, /* saturates */
      {0x7F7FFFFF, 0xFE, 0},   {0x00400000, 0, 0},     /* 2^-127 */
      {0x00400001, 1, 0},      {0x003FFFFF, 0, 0},     {0x00000001, 0, 0},
      {0x00800000, 1, 0},      {0x00800001, 2, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    float x = from_bits(cases[i].in);
    cr_expect_eq(tw_f32_to_e8m0_ceil(x), cases[i].sat0, "e8m0_ceil(%08x = %g) = %02x, want %02x",
                 cases[i].in, x, tw_f32_to_e8m0_ceil(x), cases[i].sat0);
  }
  cr_assert_eq(bits_of(tw_e8m0_to_f32(0)), 0x00400000u);
  cr_assert_eq(bits_of(tw_e8m0_to_f32(1)), 0x00800000u);
  cr_assert_eq(tw_e8m0_to_f32(127), 1.0f);
}

Test(numerics, nan_decodes_are_canonical_for_fp8_and_keep_payload_for_16_bit) {
  cr_assert_eq(bits_of(tw_e4m3_to_f32(0x7F)), 0x7FC00000u);
  cr_assert_eq(bits_of(tw_e4m3_to_f32(0xFF)), 0xFFC00000u);
  cr_assert_eq(bits_of(tw_e5m2_to_f32(0x7D)), 0x7FC00000u);
  cr_assert_eq(bits_of(tw_e5m2_to_f32(0xFF)), 0xFFC00000u);
  cr_assert_eq(bits_of(tw_e8m0_to_f32(0xFF)), 0x7FC00000u);
  cr_assert_eq(bits_of(tw_bf16_to_f32(0x7F81)), 0x7F810000u);
  cr_assert_eq(bits_of(tw_f16_to_f32(0x7D01)), 0x7FA02000u);
  cr_assert_eq(bits_of(tw_f16_to_f32(0xFC01)), 0xFF802000u);
}

/* ---- dtype constants ------------------------------------------------------------------------ */

Test(numerics, dtype_max_is_the_largest_finite_code) {
  cr_assert_eq(tw_dtype_max(TW_BF16), tw_bf16_to_f32(0x7F7F));
  cr_assert_eq(tw_dtype_max(TW_F16), tw_f16_to_f32(0x7BFF));
  cr_assert_eq(tw_dtype_max(TW_E4M3), tw_e4m3_to_f32(0x7E));
  cr_assert_eq(tw_dtype_max(TW_E5M2), tw_e5m2_to_f32(0x7B));
  cr_assert_eq(tw_dtype_max(TW_E2M1), tw_e2m1_to_f32(0x7));
  cr_assert_eq(tw_dtype_max(TW_E8M0), tw_e8m0_to_f32(0xFE));
  cr_assert_eq(tw_dtype_max(TW_F32), (double)from_bits(0x7F7FFFFF));
  cr_assert_eq(tw_dtype_max(TW_F64), 1.7976931348623157e308);
  const tw_dtype not_float[] = {TW_I32, TW_I64, TW_U8, TW_U16, (tw_dtype)-1, TW_DTYPE_COUNT};
  for (size_t i = 0; i < sizeof not_float / sizeof not_float[0]; i++) {
    cr_assert_eq(tw_dtype_max(not_float[i]), 0.0);
    cr_assert_eq(tw_dtype_unit_roundoff(not_float[i]), 0.0);
  }
}

Test(numerics, unit_roundoff_is_half_an_ulp_of_one) {
  const struct { tw_dtype t; int mant_bits; } f[] = {
      {TW_F64, 52}, {TW_F32, 23}, {TW_BF16, 7}, {TW_F16, 10}, {TW_E4M3, 3}, {TW_E5M2, 2},
      {TW_E2M1, 1}, {TW_E8M0, 0}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    cr_assert_eq(tw_dtype_unit_roundoff(f[i].t), ldexp(1.0, -(f[i].mant_bits + 1)), "%s",
                 tw_dtype_name(f[i].t));
  /* 1 + u is the tie: it rounds down to 1, anything above rounds up */
  cr_assert_eq(tw_f32_to_bf16((float)(1.0 + tw_dtype_unit_roundoff(TW_BF16))), 0x3F80);
  cr_assert_eq(tw_f32_to_e4m3((float)(1.0 + tw_dtype_unit_roundoff(TW_E4M3)), 0), 0x38);
}

/* ---- load / store of every dtype -------------------------------------------------------------- */

Test(numerics, load_store_float_formats) {
  double f64[2] = {0};
  float f32[2] = {0};
  uint16_t u16[2] = {0};
  uint8_t u8[2] = {0};
  tw_store_from_f64(f64, TW_F64, 1, 0.1, 0);
  cr_assert_eq(tw_load_as_f64(f64, TW_F64, 1), 0.1);
  tw_store_from_f64(f32, TW_F32, 1, 0.1, 0);
  cr_assert_eq(tw_load_as_f64(f32, TW_F32, 1), (double)0.1f);
  tw_store_from_f64(u16, TW_BF16, 1, 1.5, 0);
  cr_assert_eq(u16[1], 0x3FC0);
  cr_assert_eq(tw_load_as_f64(u16, TW_BF16, 1), 1.5);
  tw_store_from_f64(u16, TW_F16, 0, -2.0, 0);
  cr_assert_eq(u16[0], 0xC000);
  cr_assert_eq(tw_load_as_f64(u16, TW_F16, 0), -2.0);
  tw_store_from_f64(u8, TW_E4M3, 0, 1000.0, 0);
  cr_assert_eq(u8[0], 0x7F);
  tw_store_from_f64(u8, TW_E4M3, 0, 1000.0, 1);
  cr_assert_eq(u8[0], 0x7E);
  cr_assert_eq(tw_load_as_f64(u8, TW_E4M3, 0), 448.0);
  tw_store_from_f64(u8, TW_E5M2, 1, -1e6, 0);
  cr_assert_eq(u8[1], 0xFC);
  tw_store_from_f64(u8, TW_E5M2, 1, -1e6, 1);
  cr_assert_eq(u8[1], 0xFB);
  cr_assert_eq(tw_load_as_f64(u8, TW_E5M2, 1), -57344.0);
  tw_store_from_f64(u8, TW_E8M0, 0, 3.0, 0); /* e8m0 stores round up */
  cr_assert_eq(u8[0], 129); /* 3 -> 4 = 2^(129-127) */
  cr_assert_eq(tw_load_as_f64(u8, TW_E8M0, 0), 4.0);
  u8[0] = 0xFF;
  cr_assert(isnan(tw_load_as_f64(u8, TW_E8M0, 0)));
}

Test(numerics, store_rounds_to_f32_first) {
  /* 1 + 2^-8 + 2^-30: direct RNE to bf16 gives 0x3F81, but through f32 it is the exact tie
   * 1 + 2^-8, which goes to the even 0x3F80. The header promises the f32 step. */
  uint16_t h = 0;
  tw_store_from_f64(&h, TW_BF16, 0, 1.0 + ldexp(1.0, -8) + ldexp(1.0, -30), 0);
  cr_assert_eq(h, 0x3F80);
  float f = 0;
  tw_store_from_f64(&f, TW_F32, 0, 1e300, 0);
  cr_assert(isinf(f));
}

Test(numerics, e2m1_packs_two_per_byte_low_nibble_first) {
  uint8_t p[3] = {0xA5, 0xA5, 0xA5};
  const double v[5] = {1.0, -6.0, 0.5, 100.0, -0.25};
  for (int i = 0; i < 5; i++) tw_store_from_f64(p, TW_E2M1, i, v[i], 0);
  cr_assert_eq(p[0], 0xF2); /* element 0 = 1.0 (0x2) low, element 1 = -6 (0xF) high */
  cr_assert_eq(p[1], 0x71); /* 0.5 (0x1), 100 -> 6 (0x7) */
  cr_assert_eq(p[2], 0xA8); /* -0.25 -> -0 (0x8); the high nibble is not an element: untouched */
  const double back[5] = {1.0, -6.0, 0.5, 6.0, -0.0};
  for (int i = 0; i < 5; i++) cr_assert_eq(tw_load_as_f64(p, TW_E2M1, i), back[i], "element %d", i);
  cr_assert(signbit(tw_load_as_f64(p, TW_E2M1, 4)));
}

Test(numerics, integer_stores_truncate_and_saturate) {
  int32_t i32 = 0;
  int64_t i64 = 0;
  uint8_t u8 = 0;
  uint16_t u16 = 0;
  const struct { double v; int32_t i32; int64_t i64; uint8_t u8; uint16_t u16; } c[] = {
      {2.9, 2, 2, 2, 2},
      {-2.9, -2, -2, 0, 0},
      {NAN, 0, 0, 0, 0},
      {INFINITY, INT32_MAX, INT64_MAX, 255, 65535},
      {-INFINITY, INT32_MIN, INT64_MIN, 0, 0},
      {3e9, INT32_MAX, 3000000000LL, 255, 65535},
      {-3e9, INT32_MIN, -3000000000LL, 0, 0},
      {2147483647.9, INT32_MAX, 2147483647LL, 255, 65535},
      {-2147483648.9, INT32_MIN, -2147483648LL, 0, 0},
      {9.3e18, INT32_MAX, INT64_MAX, 255, 65535},
      {255.99, 255, 255, 255, 255},
      {65535.5, 65535, 65535, 255, 65535},
      {-0.5, 0, 0, 0, 0},
  };
  for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
    tw_store_from_f64(&i32, TW_I32, 0, c[k].v, 0);
    tw_store_from_f64(&i64, TW_I64, 0, c[k].v, 0);
    tw_store_from_f64(&u8, TW_U8, 0, c[k].v, 0);
    tw_store_from_f64(&u16, TW_U16, 0, c[k].v, 0);
    cr_expect_eq(i32, c[k].i32, "i32 from %g: %d", c[k].v, i32);
    cr_expect_eq(i64, c[k].i64, "i64 from %g: %lld", c[k].v, (long long)i64);
    cr_expect_eq(u8, c[k].u8, "u8 from %g: %d", c[k].v, u8);
    cr_expect_eq(u16, c[k].u16, "u16 from %g: %d", c[k].v, u16);
  }
  int64_t big = (1LL << 53) + 2;
  cr_assert_eq(tw_load_as_f64(&big, TW_I64, 0), 9007199254740994.0);
  int32_t neg = -7;
  cr_assert_eq(tw_load_as_f64(&neg, TW_I32, 0), -7.0);
  uint16_t raw = 0xFFFF;
  cr_assert_eq(tw_load_as_f64(&raw, TW_U16, 0), 65535.0);
  uint8_t rawb = 0xC8;
  cr_assert_eq(tw_load_as_f64(&rawb, TW_U8, 0), 200.0);
}

/* ---- golden tables (golden/gen_numerics.py: NumPy + ml_dtypes) ------------------------------ */

/* Loads golden/data/numerics/<name>.npy; the caller frees t.data. */
static tw_tensor load_table(const char *name, tw_dtype want) {
  char path[1024];
  snprintf(path, sizeof path, "%s/numerics/%s.npy", tt_golden_root(), name);
  tw_tensor t;
  cr_assert_eq(tw_npy_load(path, &t), TW_OK, "%s", tw_last_error());
  cr_assert_eq(t.ndim, 1, "%s: %d dims", path, t.ndim);
  cr_assert_eq(t.dtype, want, "%s: dtype %s, want %s", path, tw_dtype_name(t.dtype), tw_dtype_name(want));
  return t;
}

typedef float (*decode_fn)(unsigned code);
static float dec_bf16(unsigned c) { return tw_bf16_to_f32((uint16_t)c); }
static float dec_f16(unsigned c) { return tw_f16_to_f32((uint16_t)c); }
static float dec_e4m3(unsigned c) { return tw_e4m3_to_f32((uint8_t)c); }
static float dec_e5m2(unsigned c) { return tw_e5m2_to_f32((uint8_t)c); }
static float dec_e2m1(unsigned c) { return tw_e2m1_to_f32((uint8_t)c); }
static float dec_e8m0(unsigned c) { return tw_e8m0_to_f32((uint8_t)c); }

Test(numerics_golden, decode_tables_match_ml_dtypes_bit_for_bit) {
  const struct { const char *name; decode_fn fn; int64_t n; } f[] = {
      {"decode_bf16", dec_bf16, 65536}, {"decode_f16", dec_f16, 65536},
      {"decode_e4m3", dec_e4m3, 256},   {"decode_e5m2", dec_e5m2, 256},
      {"decode_e2m1", dec_e2m1, 16},    {"decode_e8m0", dec_e8m0, 256}};
  for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
    tw_tensor t = load_table(f[k].name, TW_I32);
    cr_assert_eq(t.shape[0], f[k].n, "%s has %lld codes", f[k].name, (long long)t.shape[0]);
    const uint32_t *want = (const uint32_t *)t.data;
    for (int64_t c = 0; c < f[k].n; c++)
      cr_assert_eq(bits_of(f[k].fn((unsigned)c)), want[c], "%s: code %llx decodes to %08x, ml_dtypes %08x",
                   f[k].name, (long long)c, bits_of(f[k].fn((unsigned)c)), want[c]);
    free(t.data);
  }
}

typedef unsigned (*encode_fn)(float x);
static unsigned enc_bf16(float x) { return tw_f32_to_bf16(x); }
static unsigned enc_f16(float x) { return tw_f32_to_f16(x); }
static unsigned enc_e4m3(float x) { return tw_f32_to_e4m3(x, 0); }
static unsigned enc_e4m3_sat(float x) { return tw_f32_to_e4m3(x, 1); }
static unsigned enc_e5m2(float x) { return tw_f32_to_e5m2(x, 0); }
static unsigned enc_e5m2_sat(float x) { return tw_f32_to_e5m2(x, 1); }
static unsigned enc_e2m1(float x) { return tw_f32_to_e2m1(x); }
static unsigned enc_e8m0_ceil(float x) { return tw_f32_to_e8m0_ceil(x); }

/* Compares one encoder with its table on every stored input. nan_rule >= 0: for NaN inputs
 * the table (NumPy / ml_dtypes) is known to differ from tw_numerics.h, so the code must be
 * nan_rule | (sign << sign_shift) (sign_shift < 0: no sign) and the table must hold what
 * ml_dtypes is known to write, table_nan | (sign' << sign_shift) — so a change on either side
 * is seen. Returns the number of NaN inputs. */
static int64_t check_encoder(const char *table, tw_dtype code_dtype, encode_fn fn, int nan_rule,
                             int sign_shift, int table_nan_check) {
  tw_tensor in = load_table("encode_inputs", TW_I32);
  tw_tensor out = load_table(table, code_dtype);
  cr_assert_eq(out.shape[0], in.shape[0], "%s: %lld codes for %lld inputs", table,
               (long long)out.shape[0], (long long)in.shape[0]);
  const uint32_t *x = (const uint32_t *)in.data;
  int64_t mismatches = 0, nans = 0;
  for (int64_t i = 0; i < in.shape[0]; i++) {
    float v = from_bits(x[i]);
    unsigned want = code_dtype == TW_U16 ? ((const uint16_t *)out.data)[i] : ((const uint8_t *)out.data)[i];
    unsigned got = fn(v);
    if (isnan(v) && nan_rule >= 0) {
      unsigned sign = x[i] >> 31;
      nans++;
      unsigned rule = (unsigned)nan_rule | (sign_shift >= 0 ? sign << sign_shift : 0);
      if (got != rule && mismatches++ < 8)
        cr_log_error("%s: NaN %08x -> %x, tw_numerics.h says %x", table, x[i], got, rule);
      if (table_nan_check >= 0 && want != ((unsigned)table_nan_check ^ (sign << 3)) && mismatches++ < 8)
        cr_log_error("%s: ml_dtypes now writes %x for NaN %08x (was %x): revisit tw_numerics.h",
                     table, want, x[i], (unsigned)table_nan_check ^ (sign << 3));
      continue;
    }
    if (got != want && mismatches++ < 8)
      cr_log_error("%s: input %08x (%g) -> %x, ml_dtypes %x", table, x[i], v, got, want);
  }
  cr_assert_eq(mismatches, 0, "%s: %lld of %lld inputs differ", table, (long long)mismatches,
               (long long)in.shape[0]);
  free(in.data);
  free(out.data);
  return nans;
}

Test(numerics_golden, inputs_cover_the_promised_sets) {
  tw_tensor in = load_table("encode_inputs", TW_I32);
  cr_assert_gt(in.shape[0], 300000);
  const uint32_t *x = (const uint32_t *)in.data;
  int64_t nan = 0, inf = 0, sub = 0, bf16_exact = 0;
  for (int64_t i = 0; i < in.shape[0]; i++) {
    uint32_t a = x[i] & 0x7FFFFFFFu;
    nan += a > 0x7F800000u;
    inf += a == 0x7F800000u;
    sub += a != 0 && a < 0x00800000u;
    bf16_exact += (x[i] & 0xFFFF) == 0;
  }
  cr_assert_eq(inf, 2);
  cr_assert_gt(nan, 500);
  cr_assert_gt(sub, 100);
  cr_assert_geq(bf16_exact, 65536);
  free(in.data);
}

Test(numerics_golden, bf16_encode_matches_ml_dtypes) {
  check_encoder("encode_bf16", TW_U16, enc_bf16, -1, -1, -1);
}

Test(numerics_golden, f16_encode_matches_numpy_except_nan_payloads) {
  /* NumPy keeps NaN payload bits (0x7FA00000 -> 0x7D00); twin writes the canonical 0x7E00|sign */
  int64_t nans = check_encoder("encode_f16", TW_U16, enc_f16, 0x7E00, 15, -1);
  cr_assert_gt(nans, 500);
}

Test(numerics_golden, e4m3_encode_matches_ml_dtypes_in_both_modes) {
  check_encoder("encode_e4m3", TW_U8, enc_e4m3, -1, -1, -1);
  check_encoder("encode_e4m3_sat", TW_U8, enc_e4m3_sat, -1, -1, -1);
}

Test(numerics_golden, e5m2_encode_matches_ml_dtypes_in_both_modes) {
  check_encoder("encode_e5m2", TW_U8, enc_e5m2, -1, -1, -1);
  check_encoder("encode_e5m2_sat", TW_U8, enc_e5m2_sat, -1, -1, -1);
}

Test(numerics_golden, e2m1_encode_matches_ml_dtypes_except_nan) {
  /* ml_dtypes: +NaN -> 0x8, -NaN -> 0x0 (a zero of flipped sign); twin and CUDA: +6 (0x7) */
  int64_t nans = check_encoder("encode_e2m1", TW_U8, enc_e2m1, 0x7, -1, 0x8);
  cr_assert_gt(nans, 500);
}

Test(numerics_golden, e8m0_ceil_matches_the_frexp_formula) {
  check_encoder("encode_e8m0_ceil", TW_U8, enc_e8m0_ceil, -1, -1, -1);
}
