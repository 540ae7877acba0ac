/* gpu_cast against ref_cast for every (src, dst) dtype pair and both saturate modes: every
 * code of the 4/8/16-bit formats, random and special f32/f64 values, integer extremes.
 * Destinations are poisoned on both sides; odd lengths leave e2m1's last high nibble alone. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_check.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

/* Source values for a dtype: n elements (set by the function), malloc'd. */
static void *make_source(tw_dtype t, int64_t *n, uint64_t seed) {
  uint64_t st = seed;
  int bits = tw_dtype_bits(t);
  if (bits == 4) { /* every pair of nibbles, and one more to make the length odd */
    *n = 511;
    uint8_t *p = malloc(256);
    for (int i = 0; i < 256; i++) p[i] = (uint8_t)i;
    return p;
  }
  if (bits == 8 || bits == 16) {
    *n = (int64_t)1 << bits;
    void *p = malloc((size_t)*n * (size_t)(bits / 8));
    for (int64_t i = 0; i < *n; i++) {
      if (bits == 8) ((uint8_t *)p)[i] = (uint8_t)i;
      else ((uint16_t *)p)[i] = (uint16_t)i;
    }
    return p;
  }
  *n = 200003;
  void *p = malloc((size_t)*n * (size_t)(bits / 8));
  static const double specials[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, -NAN, 448.0, 464.0, 464.00001,
                                    57344.0, 61440.0, 65504.0, 65520.0, 6.0, 7.0, 1e-40, -1e-45, 3.4e38,
                                    1e39, -1e300, 2147483647.5, 2147483648.0, -2147483649.0, 255.9, 256.0,
                                    -0.9, 9.3e18, -9.3e18, 65535.5, 65536.0};
  const int ns = (int)(sizeof specials / sizeof specials[0]);
  for (int64_t i = 0; i < *n; i++) {
    uint64_t r = tt_rand_u64(&st);
    double v = i < ns ? specials[i] : ldexp(tt_rand_uniform(&st, -1.0, 1.0), (int)(r % 200) - 100);
    switch (t) {
      case TW_F32: {
        uint32_t u = (uint32_t)r;
        float f;
        memcpy(&f, &u, 4);
        ((float *)p)[i] = i < ns ? (float)v : (i & 1) ? f : (float)v;
        break;
      }
      case TW_F64: ((double *)p)[i] = i % 3 == 2 ? v * 1e30 : v; break;
      case TW_I32: ((int32_t *)p)[i] = i < 4 ? (int32_t[]){INT32_MIN, INT32_MAX, 0, -1}[i] : (int32_t)(r >> (r % 32)); break;
      default: ((int64_t *)p)[i] = i < 4 ? (int64_t[]){INT64_MIN, INT64_MAX, 0, -1}[i] : (int64_t)(r >> (r % 64)); break;
    }
  }
  return p;
}

Test(numerics_gpu, cast_matches_ref_for_every_dtype_pair, .timeout = 300) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&gpu, &cfg), TW_OK, "%s", tw_last_error());
  int pairs = 0;
  for (int s = 0; s < TW_DTYPE_COUNT; s++) {
    int64_t n;
    void *src = make_source((tw_dtype)s, &n, 100 + (uint64_t)s);
    tw_tensor hs = tw_tensor_1d(src, (tw_dtype)s, n, TW_MEM_HOST);
    size_t sb = tw_tensor_bytes(&hs);
    tw_tensor ds = hs;
    ds.mem = TW_MEM_DEVICE;
    cr_assert_eq(tw_alloc(gpu, sb, &ds.data), TW_OK);
    cr_assert_eq(tw_tensor_copy(gpu, &ds, &hs), TW_OK);
    for (int d = 0; d < TW_DTYPE_COUNT; d++) {
      if (d == TW_E8M0) continue;
      for (int sat = 0; sat < 2; sat++) {
        tw_tensor hd = tw_tensor_1d(NULL, (tw_dtype)d, n, TW_MEM_HOST);
        size_t db = tw_tensor_bytes(&hd);
        hd.data = malloc(db);
        memset(hd.data, TW_POISON_BYTE, db);
        tw_tensor dd = hd;
        dd.mem = TW_MEM_DEVICE;
        cr_assert_eq(tw_alloc(gpu, db, &dd.data), TW_OK);
        cr_assert_eq(tw_memset(gpu, dd.data, TW_POISON_BYTE, db), TW_OK);
        cr_assert_eq(tw_cast(ref, &hd, &hs, sat), TW_OK, "%s", tw_last_error());
        cr_assert_eq(tw_cast(gpu, &dd, &ds, sat), TW_OK, "%s", tw_last_error());
        cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s", tw_last_error());
        tw_tensor back = hd;
        back.data = malloc(db);
        cr_assert_eq(tw_tensor_copy(gpu, &back, &dd), TW_OK);
        char what[96];
        snprintf(what, sizeof what, "cast %s -> %s saturate=%d", tw_dtype_name((tw_dtype)s), tw_dtype_name((tw_dtype)d), sat);
        tt_expect_exact(&back, &hd, what);
        free(back.data);
        free(hd.data);
        tw_free(gpu, dd.data);
        pairs++;
      }
    }
    tw_free(gpu, ds.data);
    free(src);
  }
  cr_assert_eq(pairs, TW_DTYPE_COUNT * (TW_DTYPE_COUNT - 1) * 2);
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(ref);
}

/* The hardware fp8 conversion of the quantizer (cvt.rn.satfinite, NaN patched) against the
 * reference encoder: quantize with a delayed scale of 1 is exactly sat(x) per element, so
 * every f32 pattern class goes through the hot path. NaN becomes the canonical positive code
 * (tw_quantize.h), where the plain encoder keeps the sign. */
Test(numerics_gpu, quantizer_fp8_conversion_matches_the_reference_encoder) {
  tw_ctx *gpu = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&gpu, &cfg), TW_OK, "%s", tw_last_error());
  const int64_t M = 1024, K = 1024;
  float *x = malloc(sizeof(float) * M * K);
  uint64_t st = 99;
  for (int64_t i = 0; i < M * K; i++) {
    uint32_t u = (uint32_t)tt_rand_u64(&st);
    if (i % 2) u = (u & 0x807FFFFFu) | ((uint32_t)(100 + (u >> 24) % 60) << 23); /* near the fp8 range */
    memcpy(&x[i], &u, 4);
  }
  int32_t sz[1] = {(int32_t)M};
  float one = 1.0f;
  void *dx, *dsz, *dsc, *dq, *dsi, *dam;
  cr_assert_eq(tw_alloc(gpu, sizeof(float) * M * K, &dx), TW_OK);
  cr_assert_eq(tw_alloc(gpu, 4, &dsz), TW_OK);
  cr_assert_eq(tw_alloc(gpu, 4, &dsc), TW_OK);
  cr_assert_eq(tw_alloc(gpu, M * K, &dq), TW_OK);
  cr_assert_eq(tw_alloc(gpu, 4, &dsi), TW_OK);
  cr_assert_eq(tw_alloc(gpu, 4, &dam), TW_OK);
  tw_tensor hx = tw_tensor_2d(x, TW_F32, M, K, TW_MEM_HOST), tx = tw_tensor_2d(dx, TW_F32, M, K, TW_MEM_DEVICE);
  tw_tensor hs = tw_tensor_1d(sz, TW_I32, 1, TW_MEM_HOST), ts = tw_tensor_1d(dsz, TW_I32, 1, TW_MEM_DEVICE);
  tw_tensor hc = tw_tensor_1d(&one, TW_F32, 1, TW_MEM_HOST), tc = tw_tensor_1d(dsc, TW_F32, 1, TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(gpu, &tx, &hx), TW_OK);
  cr_assert_eq(tw_tensor_copy(gpu, &ts, &hs), TW_OK);
  cr_assert_eq(tw_tensor_copy(gpu, &tc, &hc), TW_OK);
  uint8_t *codes = malloc(M * K);
  for (int qd = 0; qd < 2; qd++) {
    tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
    o.mode = TW_SCALE_TENSOR_DELAYED;
    o.qdtype = qd ? TW_E5M2 : TW_E4M3;
    o.scale = tc;
    tw_qtensor q;
    cr_assert_eq(tw_quantize_output_shapes(&o, M, K, 1, &q), TW_OK);
    q.row_data.data = dq;
    q.row_data.mem = TW_MEM_DEVICE;
    q.row_scale_inv.data = dsi;
    q.row_scale_inv.mem = TW_MEM_DEVICE;
    q.amax.data = dam;
    q.amax.mem = TW_MEM_DEVICE;
    cr_assert_eq(tw_grouped_quantize(gpu, &tx, &ts, &o, &q), TW_OK, "%s", tw_last_error());
    tw_tensor hq = tw_tensor_2d(codes, TW_U8, M, K, TW_MEM_HOST), dqt = tw_tensor_2d(dq, TW_U8, M, K, TW_MEM_DEVICE);
    cr_assert_eq(tw_tensor_copy(gpu, &hq, &dqt), TW_OK);
    for (int64_t i = 0; i < M * K; i++) {
      uint8_t want = isnan(x[i]) ? (qd ? 0x7E : 0x7F) : qd ? tw_f32_to_e5m2(x[i], 1) : tw_f32_to_e4m3(x[i], 1);
      uint32_t u;
      memcpy(&u, &x[i], 4);
      cr_assert_eq(codes[i], want, "%s of 0x%08x: gpu 0x%02x, ref 0x%02x", qd ? "e5m2" : "e4m3", u, codes[i], want);
    }
  }
  free(codes);
  free(x);
  tw_free(gpu, dx);
  tw_free(gpu, dsz);
  tw_free(gpu, dsc);
  tw_free(gpu, dq);
  tw_free(gpu, dsi);
  tw_free(gpu, dam);
  tw_ctx_destroy(gpu);
}
