/* tw_cast through the ref backend: values for every allowed (src, dst) pair, the saturate
 * flag, packed e2m1, shapes of every rank, and every rejected input with its message. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_npy.h"
#include "twin/tw_numerics.h"

static tw_ctx *ctx;

static void setup(void) {
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK, "%s", tw_last_error());
}
static void teardown(void) { tw_ctx_destroy(ctx); }

#define N_VALUES 12
/* Values that stress each format: ties, overflow, subnormals, negatives, NaN, inf. */
static const double source_values[N_VALUES] = {0.0, -0.0,   1.0,      -2.5,     464.0, 1000.0,
                                               -7.9, 3.0e9, 0x1p-10, 61440.0, NAN,   -INFINITY};

static int is_integer(tw_dtype t) { return t == TW_I32 || t == TW_I64 || t == TW_U8 || t == TW_U16; }

/* Fills src with source_values as its dtype stores them (NaN and inf only where they exist). */
static void fill_source(void *buf, tw_dtype t) {
  for (int i = 0; i < N_VALUES; i++) {
    double v = source_values[i];
    if (t == TW_E8M0) {
      ((uint8_t *)buf)[i] = (uint8_t)(100 + 3 * i); /* e8m0 has no encoder for arbitrary v */
      continue;
    }
    tw_store_from_f64(buf, t, i, v, 0);
  }
}

static int same_bits(double a, double b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0; }

Test(cast, every_allowed_pair_matches_the_scalar_codecs, .init = setup, .fini = teardown) {
  for (int s = 0; s < TW_DTYPE_COUNT; s++) {
    for (int d = 0; d < TW_DTYPE_COUNT; d++) {
      if (d == TW_E8M0) continue;
      for (int sat = 0; sat < 2; sat++) {
        uint64_t src_buf[N_VALUES], dst_buf[N_VALUES], want_buf[N_VALUES];
        memset(src_buf, 0, sizeof src_buf);
        memset(dst_buf, 0xA5, sizeof dst_buf);
        memset(want_buf, 0xA5, sizeof want_buf);
        fill_source(src_buf, (tw_dtype)s);
        tw_tensor src = tw_tensor_1d(src_buf, (tw_dtype)s, N_VALUES, TW_MEM_HOST);
        tw_tensor dst = tw_tensor_1d(dst_buf, (tw_dtype)d, N_VALUES, TW_MEM_HOST);
        cr_assert_eq(tw_cast(ctx, &dst, &src, sat), TW_OK, "%s -> %s: %s", tw_dtype_name(s),
                     tw_dtype_name(d), tw_last_error());
        for (int i = 0; i < N_VALUES; i++) {
          double v = tw_load_as_f64(src_buf, (tw_dtype)s, i);
          tw_store_from_f64(want_buf, (tw_dtype)d, i, v, sat);
        }
        if (is_integer((tw_dtype)s) && is_integer((tw_dtype)d)) continue; /* exact path: below */
        cr_assert(memcmp(dst_buf, want_buf, tw_dtype_storage_bytes((tw_dtype)d, N_VALUES)) == 0,
                  "%s -> %s (saturate=%d) differs from load_as_f64/store_from_f64",
                  tw_dtype_name(s), tw_dtype_name(d), sat);
        for (int i = 0; i < N_VALUES && d != TW_E2M1; i++)
          cr_assert(same_bits(tw_load_as_f64(dst_buf, (tw_dtype)d, i), tw_load_as_f64(want_buf, (tw_dtype)d, i)));
      }
    }
  }
}

Test(cast, f32_to_fp8_respects_saturate, .init = setup, .fini = teardown) {
  float x[6] = {448.0f, 464.0f, 465.0f, INFINITY, -1e9f, NAN};
  uint8_t q[6];
  tw_tensor src = tw_tensor_2d(x, TW_F32, 2, 3, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_2d(q, TW_E4M3, 2, 3, TW_MEM_HOST);
  const uint8_t want_e4m3[2][6] = {{0x7E, 0x7E, 0x7F, 0x7F, 0xFF, 0x7F}, {0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F}};
  for (int sat = 0; sat < 2; sat++) {
    cr_assert_eq(tw_cast(ctx, &dst, &src, sat), TW_OK, "%s", tw_last_error());
    for (int i = 0; i < 6; i++)
      cr_expect_eq(q[i], want_e4m3[sat][i], "e4m3 sat=%d [%d] = %02x", sat, i, q[i]);
  }
  dst.dtype = TW_E5M2;
  const uint8_t want_e5m2[2][6] = {{0x5F, 0x5F, 0x5F, 0x7C, 0xFC, 0x7E}, {0x5F, 0x5F, 0x5F, 0x7B, 0xFB, 0x7E}};
  for (int sat = 0; sat < 2; sat++) {
    cr_assert_eq(tw_cast(ctx, &dst, &src, sat ? 7 : 0), TW_OK); /* any non-zero saturates */
    for (int i = 0; i < 6; i++)
      cr_expect_eq(q[i], want_e5m2[sat][i], "e5m2 sat=%d [%d] = %02x", sat, i, q[i]);
  }
}

Test(cast, bf16_to_f32_and_back_is_lossless, .init = setup, .fini = teardown) {
  static uint16_t codes[65536], back[65536];
  static float wide[65536];
  for (int c = 0; c < 65536; c++) codes[c] = (uint16_t)c;
  tw_tensor a = tw_tensor_3d(codes, TW_BF16, 16, 64, 64, TW_MEM_HOST);
  tw_tensor w = tw_tensor_3d(wide, TW_F32, 16, 64, 64, TW_MEM_HOST);
  tw_tensor b = tw_tensor_3d(back, TW_BF16, 16, 64, 64, TW_MEM_HOST);
  cr_assert_eq(tw_cast(ctx, &w, &a, 0), TW_OK);
  cr_assert_eq(tw_cast(ctx, &b, &w, 0), TW_OK);
  for (int c = 0; c < 65536; c++) {
    int is_nan = (c & 0x7F80) == 0x7F80 && (c & 0x7F);
    cr_assert_eq(back[c], is_nan ? (c & 0x8000) | 0x7FC0 : c, "bf16 %04x -> f32 -> %04x", c, back[c]);
  }
}

Test(cast, e2m1_odd_length_leaves_the_spare_nibble, .init = setup, .fini = teardown) {
  float x[5] = {1.0f, -6.0f, 0.5f, 100.0f, -0.25f};
  uint8_t p[3] = {0xA5, 0xA5, 0xA5};
  tw_tensor src = tw_tensor_1d(x, TW_F32, 5, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_1d(p, TW_E2M1, 5, TW_MEM_HOST);
  cr_assert_eq(tw_cast(ctx, &dst, &src, 0), TW_OK);
  cr_assert_eq(p[0], 0xF2);
  cr_assert_eq(p[1], 0x71);
  cr_assert_eq(p[2], 0xA8);
  float y[5];
  tw_tensor out = tw_tensor_1d(y, TW_F32, 5, TW_MEM_HOST);
  cr_assert_eq(tw_cast(ctx, &out, &dst, 0), TW_OK);
  const float want[5] = {1.0f, -6.0f, 0.5f, 6.0f, -0.0f};
  for (int i = 0; i < 5; i++) cr_assert_eq(y[i], want[i]);
}

Test(cast, e8m0_source_decodes, .init = setup, .fini = teardown) {
  uint8_t e[4] = {0, 127, 254, 255};
  float y[4];
  tw_tensor src = tw_tensor_1d(e, TW_E8M0, 4, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_1d(y, TW_F32, 4, TW_MEM_HOST);
  cr_assert_eq(tw_cast(ctx, &dst, &src, 0), TW_OK);
  cr_assert_eq(y[0], 0x1p-127f);
  cr_assert_eq(y[1], 1.0f);
  cr_assert_eq(y[2], 0x1p127f);
  cr_assert(isnan(y[3]));
}

Test(cast, integer_to_integer_is_exact_and_clamped, .init = setup, .fini = teardown) {
  int64_t a[5] = {(1LL << 60) + 1, -5, 70000, INT64_MIN, 255};
  int64_t b[5];
  int32_t c[5];
  uint8_t d[5];
  uint16_t e[5];
  tw_tensor src = tw_tensor_1d(a, TW_I64, 5, TW_MEM_HOST);
  tw_tensor tb = tw_tensor_1d(b, TW_I64, 5, TW_MEM_HOST), tc = tw_tensor_1d(c, TW_I32, 5, TW_MEM_HOST);
  tw_tensor td = tw_tensor_1d(d, TW_U8, 5, TW_MEM_HOST), te = tw_tensor_1d(e, TW_U16, 5, TW_MEM_HOST);
  cr_assert_eq(tw_cast(ctx, &tb, &src, 0), TW_OK);
  cr_assert_eq(tw_cast(ctx, &tc, &src, 0), TW_OK);
  cr_assert_eq(tw_cast(ctx, &td, &src, 0), TW_OK);
  cr_assert_eq(tw_cast(ctx, &te, &src, 0), TW_OK);
  cr_assert_eq(b[0], (1LL << 60) + 1); /* would be lost through a double */
  const int32_t wc[5] = {INT32_MAX, -5, 70000, INT32_MIN, 255};
  const uint8_t wd[5] = {255, 0, 255, 0, 255};
  const uint16_t we[5] = {65535, 0, 65535, 0, 255};
  for (int i = 0; i < 5; i++) {
    cr_expect_eq(b[i], a[i]);
    cr_expect_eq(c[i], wc[i], "i32[%d] = %d", i, c[i]);
    cr_expect_eq(d[i], wd[i], "u8[%d] = %d", i, d[i]);
    cr_expect_eq(e[i], we[i], "u16[%d] = %d", i, e[i]);
  }
}

Test(cast, zero_d_and_empty_tensors, .init = setup, .fini = teardown) {
  float x = 3.0f;
  uint16_t h = 0;
  tw_tensor src = {&x, TW_F32, 0, {0, 0, 0, 0}, TW_MEM_HOST};
  tw_tensor dst = {&h, TW_F16, 0, {0, 0, 0, 0}, TW_MEM_HOST};
  cr_assert_eq(tw_cast(ctx, &dst, &src, 0), TW_OK);
  cr_assert_eq(h, 0x4200);
  tw_tensor e_src = tw_tensor_2d(NULL, TW_F32, 0, 7, TW_MEM_HOST);
  tw_tensor e_dst = tw_tensor_2d(NULL, TW_E4M3, 0, 7, TW_MEM_HOST);
  cr_assert_eq(tw_cast(ctx, &e_dst, &e_src, 0), TW_OK, "%s", tw_last_error());
}

Test(cast, whole_golden_input_set_matches_ml_dtypes, .init = setup, .fini = teardown) {
  /* The tensor path on the ~300k golden inputs (golden/gen_numerics.py) for the formats whose
   * tables have no documented NaN divergence. */
  char path[1024];
  tw_tensor bits, x;
  snprintf(path, sizeof path, "%s/numerics/encode_inputs.npy", tt_golden_root());
  cr_assert_eq(tw_npy_load(path, &bits), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_tensor_view_as(&bits, TW_F32, &x), TW_OK);
  const struct { const char *table; tw_dtype dtype; int saturate; } c[] = {
      {"encode_bf16", TW_BF16, 0}, {"encode_e4m3", TW_E4M3, 0}, {"encode_e4m3_sat", TW_E4M3, 1},
      {"encode_e5m2", TW_E5M2, 0}, {"encode_e5m2_sat", TW_E5M2, 1}};
  for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
    tw_tensor want;
    snprintf(path, sizeof path, "%s/numerics/%s.npy", tt_golden_root(), c[k].table);
    cr_assert_eq(tw_npy_load(path, &want), TW_OK, "%s", tw_last_error());
    size_t bytes = tw_tensor_bytes(&want);
    void *got_buf = malloc(bytes);
    tw_tensor got = tw_tensor_1d(got_buf, c[k].dtype, x.shape[0], TW_MEM_HOST);
    cr_assert_eq(tw_cast(ctx, &got, &x, c[k].saturate), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_tensor_bytes(&got), bytes);
    for (int64_t i = 0; i < x.shape[0]; i++) {
      unsigned g = bytes == 2 * (size_t)x.shape[0] ? ((uint16_t *)got_buf)[i] : ((uint8_t *)got_buf)[i];
      unsigned w = bytes == 2 * (size_t)x.shape[0] ? ((uint16_t *)want.data)[i] : ((uint8_t *)want.data)[i];
      cr_assert_eq(g, w, "%s: element %lld (f32 bits %08x) -> %x, ml_dtypes %x", c[k].table,
                   (long long)i, ((uint32_t *)bits.data)[i], g, w);
    }
    free(got_buf);
    free(want.data);
  }
  free(bits.data);
}

/* ---- rejected inputs ----------------------------------------------------------------------- */

static void expect_error(tw_status got, tw_status want, const char *needle) {
  cr_assert_eq(got, want, "status %s, want %s (%s)", tw_status_name(got), tw_status_name(want),
               tw_last_error());
  cr_assert(strstr(tw_last_error(), needle) != NULL, "message \"%s\" lacks \"%s\"",
            tw_last_error(), needle);
}

Test(cast, rejects_shape_mismatch, .init = setup, .fini = teardown) {
  float x[6] = {0};
  uint16_t y[6];
  tw_tensor src = tw_tensor_2d(x, TW_F32, 2, 3, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_2d(y, TW_BF16, 3, 2, TW_MEM_HOST);
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_SHAPE, "cast: dst is [3, 2] bf16, expected [2, 3] bf16");
  tw_tensor flat = tw_tensor_1d(y, TW_BF16, 6, TW_MEM_HOST);
  expect_error(tw_cast(ctx, &flat, &src, 0), TW_ERR_SHAPE, "cast: dst must have 2 dims, has 1");
}

Test(cast, rejects_e8m0_target, .init = setup, .fini = teardown) {
  float x[4] = {1, 2, 3, 4};
  uint8_t e[4];
  tw_tensor src = tw_tensor_1d(x, TW_F32, 4, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_1d(e, TW_E8M0, 4, TW_MEM_HOST);
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_DTYPE, "e8m0");
}

Test(cast, rejects_null_arguments, .init = setup, .fini = teardown) {
  float x[4] = {0};
  uint16_t y[4];
  tw_tensor src = tw_tensor_1d(x, TW_F32, 4, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_1d(y, TW_F16, 4, TW_MEM_HOST);
  expect_error(tw_cast(NULL, &dst, &src, 0), TW_ERR_NULL, "cast: ctx is NULL");
  expect_error(tw_cast(ctx, &dst, NULL, 0), TW_ERR_NULL, "cast: src is NULL");
  expect_error(tw_cast(ctx, NULL, &src, 0), TW_ERR_NULL, "cast: dst is NULL");
  tw_tensor no_data = tw_tensor_1d(NULL, TW_F16, 4, TW_MEM_HOST);
  expect_error(tw_cast(ctx, &no_data, &src, 0), TW_ERR_NULL, "cast: dst data is NULL");
  tw_tensor none = tw_tensor_none();
  expect_error(tw_cast(ctx, &dst, &none, 0), TW_ERR_INVALID_ARG, "cast: src is required");
}

Test(cast, rejects_wrong_memory, .init = setup, .fini = teardown) {
  float x[4] = {0};
  uint16_t y[4];
  tw_tensor src = tw_tensor_1d(x, TW_F32, 4, TW_MEM_DEVICE);
  tw_tensor dst = tw_tensor_1d(y, TW_F16, 4, TW_MEM_HOST);
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_MEMORY,
               "cast: src lives in device memory, this context needs host memory");
  src.mem = TW_MEM_HOST;
  dst.mem = TW_MEM_DEVICE;
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_MEMORY, "cast: dst lives in device memory");
}

Test(cast, rejects_unknown_dtype_and_negative_dims, .init = setup, .fini = teardown) {
  float x[4] = {0};
  uint16_t y[4];
  tw_tensor src = tw_tensor_1d(x, (tw_dtype)42, 4, TW_MEM_HOST);
  tw_tensor dst = tw_tensor_1d(y, TW_F16, 4, TW_MEM_HOST);
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_DTYPE, "cast: src has unknown dtype 42");
  src.dtype = TW_F32;
  dst.dtype = (tw_dtype)-3;
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_DTYPE, "cast: dst has unknown dtype -3");
  dst.dtype = TW_F16;
  src.shape[0] = -4;
  expect_error(tw_cast(ctx, &dst, &src, 0), TW_ERR_SHAPE, "cast: src dim 0 is -4 (negative)");
}
