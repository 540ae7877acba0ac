/* The checker (tw_check.h): exact and bound modes, NaN/inf placement, unwritten poison,
 * the worst element's coordinates, the GEMM error bound and the one-line report. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_check.h"

static tw_tensor f32_2d(float *p, int64_t r, int64_t c) { return tw_tensor_2d(p, TW_F32, r, c, TW_MEM_HOST); }

Test(check, exact_equal_passes_and_says_bit_exact) {
  uint8_t a[5] = {1, 2, 3, 0x7F, 0xFF}, b[5] = {1, 2, 3, 0x7F, 0xFF};
  tw_tensor ta = tw_tensor_1d(a, TW_E4M3, 5, TW_MEM_HOST), tb = tw_tensor_1d(b, TW_E4M3, 5, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&ta, &tb, &r), TW_OK);
  cr_assert(r.passed);
  cr_assert_eq(r.count, 5);
  cr_assert_eq(r.mismatches, 0);
  cr_assert_eq(r.worst_index, -1);
  char buf[256];
  cr_assert_str_eq(tw_check_format(&r, buf, sizeof buf), "PASS 5 elems, bit-exact");
}

Test(check, exact_reports_worst_with_coordinates_and_counts) {
  float got[6] = {1, 2, 3, 4, 5, 6}, exp[6] = {1, 2.5f, 3, 4, 5, 16};
  tw_tensor g = f32_2d(got, 2, 3), e = f32_2d(exp, 2, 3);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&g, &e, &r), TW_OK);
  cr_assert_not(r.passed);
  cr_assert_eq(r.mismatches, 2);
  cr_assert_eq(r.worst_index, 5);
  cr_assert_eq(r.worst_coord[0], 1);
  cr_assert_eq(r.worst_coord[1], 2);
  cr_assert_eq(r.worst_got, 6.0);
  cr_assert_eq(r.worst_expected, 16.0);
  cr_assert_eq(r.worst_err, 10.0);
  char buf[256];
  tw_check_format(&r, buf, sizeof buf);
  cr_assert(strstr(buf, "FAIL 2/6 differ") == buf, "%s", buf);
  cr_assert(strstr(buf, "at [1, 2]") != NULL, "%s", buf);
}

Test(check, exact_is_bitwise_signed_zero_and_nan_payload_differ) {
  float got[2] = {0.0f, 0}, exp[2] = {-0.0f, 0};
  uint32_t qnan = 0x7FC00000u, other = 0x7FC00001u;
  memcpy(&got[1], &qnan, 4);
  memcpy(&exp[1], &other, 4);
  tw_tensor g = tw_tensor_1d(got, TW_F32, 2, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_F32, 2, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&g, &e, &r), TW_OK);
  cr_assert_eq(r.mismatches, 2);
  cr_assert_eq(r.nan_mismatches, 0); /* NaN on both sides */
}

Test(check, exact_classifies_nan_and_inf_per_format) {
  /* e4m3: 0x7F is NaN, 0x7E is 448 (no inf); e5m2: 0x7C is +inf, 0xFC is -inf */
  uint8_t g4[2] = {0x7F, 0x7E}, e4[2] = {0x7E, 0x7E};
  tw_tensor a = tw_tensor_1d(g4, TW_E4M3, 2, TW_MEM_HOST), b = tw_tensor_1d(e4, TW_E4M3, 2, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&a, &b, &r), TW_OK);
  cr_assert_eq(r.nan_mismatches, 1);
  cr_assert_eq(r.inf_mismatches, 0);
  cr_assert(isnan(r.worst_got));
  cr_assert_eq(r.worst_expected, 448.0);
  uint8_t g5[3] = {0x7C, 0xFC, 0x7B}, e5[3] = {0xFC, 0xFC, 0x7C};
  a = tw_tensor_1d(g5, TW_E5M2, 3, TW_MEM_HOST), b = tw_tensor_1d(e5, TW_E5M2, 3, TW_MEM_HOST);
  cr_assert_eq(tw_check_exact(&a, &b, &r), TW_OK);
  cr_assert_eq(r.mismatches, 2);
  cr_assert_eq(r.inf_mismatches, 2); /* +inf vs -inf, finite vs +inf */
  cr_assert_eq(r.worst_index, 0);
}

Test(check, exact_counts_unwritten_poison) {
  uint16_t got[4] = {0x3F80, 0xA5A5, 0xA5A5, 0x4000}, exp[4] = {0x3F80, 0x4040, 0xA5A5, 0x4000};
  tw_tensor g = tw_tensor_1d(got, TW_BF16, 4, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_BF16, 4, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&g, &e, &r), TW_OK);
  cr_assert_eq(r.mismatches, 1);
  cr_assert_eq(r.unwritten, 1); /* index 2: poison expected there, so it is not "unwritten" */
  cr_assert_eq(r.worst_index, 1);
  cr_assert_eq(r.worst_expected, 3.0);
}

Test(check, exact_e2m1_compares_nibbles) {
  uint8_t got[2] = {0x21, 0x03}, exp[2] = {0x21, 0x0B}; /* 3 elements: 1, 2, 3 vs 1, 2, -3 */
  tw_tensor g = tw_tensor_1d(got, TW_E2M1, 3, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_E2M1, 3, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&g, &e, &r), TW_OK);
  cr_assert_eq(r.mismatches, 1);
  cr_assert_eq(r.worst_index, 2);
  cr_assert_eq(r.worst_got, 1.5);     /* nibble 3 = 1.5 */
  cr_assert_eq(r.worst_expected, -1.5);
  /* the unused high nibble of the last byte is not an element */
  exp[1] = 0xF3;
  cr_assert_eq(tw_check_exact(&g, &e, &r), TW_OK);
  cr_assert(r.passed);
}

Test(check, exact_integer_and_e8m0) {
  int32_t a[3] = {1, -2, 3}, b[3] = {1, -2, 4};
  tw_tensor ta = tw_tensor_1d(a, TW_I32, 3, TW_MEM_HOST), tb = tw_tensor_1d(b, TW_I32, 3, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&ta, &tb, &r), TW_OK);
  cr_assert_eq(r.mismatches, 1);
  cr_assert_eq(r.worst_expected, 4.0);
  uint8_t e1[2] = {127, 0xFF}, e2[2] = {128, 0xFF};
  ta = tw_tensor_1d(e1, TW_E8M0, 2, TW_MEM_HOST), tb = tw_tensor_1d(e2, TW_E8M0, 2, TW_MEM_HOST);
  cr_assert_eq(tw_check_exact(&ta, &tb, &r), TW_OK);
  cr_assert_eq(r.mismatches, 1);
  cr_assert_eq(r.worst_got, 1.0);
  cr_assert_eq(r.worst_expected, 2.0);
  cr_assert_eq(r.nan_mismatches, 0);
}

Test(check, exact_rejects_bad_arguments_with_values) {
  float a[6] = {0}, b[6] = {0};
  tw_tensor ta = f32_2d(a, 2, 3), tb = f32_2d(b, 3, 2);
  tw_check_report r;
  tt_expect_status(tw_check_exact(&ta, &tb, &r), TW_ERR_SHAPE, "[2, 3] f32");
  tb = tw_tensor_2d(b, TW_I32, 2, 3, TW_MEM_HOST);
  tt_expect_status(tw_check_exact(&ta, &tb, &r), TW_ERR_DTYPE, "got is f32 but expected is i32");
  tt_expect_status(tw_check_exact(&ta, NULL, &r), TW_ERR_NULL, "expected");
  tt_expect_status(tw_check_exact(&ta, &ta, NULL), TW_ERR_NULL, "report");
  tb = ta;
  tb.mem = TW_MEM_DEVICE;
  tt_expect_status(tw_check_exact(&ta, &tb, &r), TW_ERR_MEMORY, "device memory");
  tb = f32_2d(NULL, 2, 3);
  tt_expect_status(tw_check_exact(&ta, &tb, &r), TW_ERR_NULL, "expected data is NULL");
  tb = f32_2d(b, -1, 3);
  tt_expect_status(tw_check_exact(&ta, &tb, &r), TW_ERR_SHAPE, "negative dim 0 (-1)");
}

Test(check, exact_empty_tensors_pass) {
  tw_tensor a = tw_tensor_2d(NULL, TW_F32, 0, 7, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_exact(&a, &a, &r), TW_OK);
  cr_assert(r.passed);
  cr_assert_eq(r.count, 0);
}

Test(check, bound_passes_within_and_reports_worst_ratio) {
  float got[4] = {1.0f, 2.001f, 3.0f, -4.0f};
  double exp[4] = {1.0, 2.0, 3.0005, -4.0};
  double bnd[4] = {1e-6, 2e-3, 1e-3, 0.0};
  tw_tensor g = f32_2d(got, 2, 2), e = tw_tensor_2d(exp, TW_F64, 2, 2, TW_MEM_HOST),
            b = tw_tensor_1d(bnd, TW_F64, 4, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g, &e, &b, &r), TW_OK);
  cr_assert(r.passed);
  cr_assert_eq(r.worst_index, 2); /* 0.0005/1e-3 = 0.5 > 0.001/2e-3 ~ 0.5000..? */
  cr_assert_float_eq(r.worst_ratio, fabs(3.0f - 3.0005) / 1e-3, 1e-9);
  cr_assert_eq(r.worst_coord[0], 1);
  cr_assert_eq(r.worst_coord[1], 0);
  char buf[256];
  tw_check_format(&r, buf, sizeof buf);
  cr_assert(strncmp(buf, "PASS 4 elems, worst ", 20) == 0, "%s", buf);
  cr_assert(strstr(buf, "at [1, 0]") != NULL, "%s", buf);
}

Test(check, bound_failure_beats_larger_passing_ratio) {
  float got[3] = {1.5f, 10.0f, 0.0f};
  float exp[3] = {1.0f, 10.0f, 0.0f};
  float bnd[3] = {1.0f, 0.0f, 0.0f};
  got[2] = 1e-3f; /* fails: bound 0 */
  tw_tensor g = tw_tensor_1d(got, TW_F32, 3, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_F32, 3, TW_MEM_HOST),
            b = tw_tensor_1d(bnd, TW_F32, 3, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g, &e, &b, &r), TW_OK);
  cr_assert_not(r.passed);
  cr_assert_eq(r.mismatches, 1);
  cr_assert_eq(r.worst_index, 2);
  cr_assert(isinf(r.worst_ratio));
}

Test(check, bound_nan_inf_placement) {
  float got[5] = {NAN, 1.0f, INFINITY, -INFINITY, NAN};
  float exp[5] = {NAN, NAN, INFINITY, INFINITY, 2.0f};
  double bnd[5] = {1, 1, 1, 1, 1e30};
  tw_tensor g = tw_tensor_1d(got, TW_F32, 5, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_F32, 5, TW_MEM_HOST),
            b = tw_tensor_1d(bnd, TW_F64, 5, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g, &e, &b, &r), TW_OK);
  cr_assert_eq(r.mismatches, 3);
  cr_assert_eq(r.nan_mismatches, 2); /* [1] and [4]: a huge bound does not excuse a NaN */
  cr_assert_eq(r.inf_mismatches, 1); /* [3] opposite signs */
  cr_assert_eq(r.worst_index, 1);
}

Test(check, bound_specials_must_match_whatever_the_bound) {
  /* an infinite (or NaN) bound, e.g. from inf inputs, never excuses a NaN or inf mismatch */
  float got[5] = {NAN, INFINITY, 1.0f, INFINITY, NAN};
  float exp[5] = {INFINITY, 1.0f, NAN, INFINITY, NAN};
  double bnd[5] = {INFINITY, INFINITY, INFINITY, NAN, NAN};
  tw_tensor g = tw_tensor_1d(got, TW_F32, 5, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_F32, 5, TW_MEM_HOST),
            b = tw_tensor_1d(bnd, TW_F64, 5, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g, &e, &b, &r), TW_OK);
  cr_assert_eq(r.mismatches, 3); /* [3] inf meets inf and [4] NaN meets NaN, even with NaN bounds */
  cr_assert_eq(r.nan_mismatches, 2);
  cr_assert_eq(r.inf_mismatches, 1);
  cr_assert_eq(r.worst_index, 0);
}

Test(check, bound_negative_demands_exact_and_counts_unwritten) {
  uint16_t got[3] = {0x3F80, 0xA5A5, 0x3F81}; /* bf16: 1.0, poison, 1.0078125 */
  float exp[3] = {1.0f, 1.0f, 1.0f};
  double bnd[3] = {-1, 1e9, -1};
  tw_tensor g = tw_tensor_1d(got, TW_BF16, 3, TW_MEM_HOST), e = tw_tensor_1d(exp, TW_F32, 3, TW_MEM_HOST),
            b = tw_tensor_1d(bnd, TW_F64, 3, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g, &e, &b, &r), TW_OK);
  cr_assert_eq(r.mismatches, 1); /* [1] is within its (huge) bound, [2] must be exact */
  cr_assert_eq(r.worst_index, 2);
  cr_assert_eq(r.unwritten, 0);
  bnd[1] = 1e-3;
  cr_assert_eq(tw_check_bound(&g, &e, &b, &r), TW_OK);
  cr_assert_eq(r.mismatches, 2);
  cr_assert_eq(r.unwritten, 1);
  char buf[256];
  tw_check_format(&r, buf, sizeof buf);
  cr_assert(strstr(buf, "1 unwritten") != NULL, "%s", buf);
}

Test(check, bound_rejects_bad_arguments) {
  float a[4] = {0};
  int32_t ia[4] = {0};
  tw_tensor g = tw_tensor_1d(a, TW_F32, 4, TW_MEM_HOST), bad = tw_tensor_1d(ia, TW_I32, 4, TW_MEM_HOST);
  tw_tensor b3 = tw_tensor_1d(a, TW_F32, 3, TW_MEM_HOST), bb = tw_tensor_1d(a, TW_BF16, 4, TW_MEM_HOST);
  tw_check_report r;
  tt_expect_status(tw_check_bound(&bad, &bad, &g, &r), TW_ERR_DTYPE, "must be float dtypes");
  tt_expect_status(tw_check_bound(&g, &g, &b3, &r), TW_ERR_SHAPE, "bound has 3 elements but got has 4");
  tt_expect_status(tw_check_bound(&g, &g, &bb, &r), TW_ERR_DTYPE, "bound must be f64 or f32, not bf16");
  tt_expect_status(tw_check_bound(&g, &b3, &g, &r), TW_ERR_SHAPE, "differ in shape");
}

Test(check, gemm_error_bound_formula) {
  double absp[4] = {10.0, 0.0, -1.0, 1.0}, ref[4] = {3.0, 0.0, 5.0, -1.0}, b[4];
  double u = ldexp(1.0, -24);
  tw_gemm_error_bound(absp, ref, 4, 100, u, TW_F32, b);
  double gamma = 100 * u / (1 - 100 * u);
  cr_assert_float_eq(b[0], gamma * 10 + u * (3 + gamma * 10) + FLT_MIN, 1e-20);
  cr_assert_eq(b[1], (double)FLT_MIN);
  cr_assert_eq(b[2], -1.0);
  tw_gemm_error_bound(absp, ref, 4, 100, u, TW_BF16, b);
  cr_assert_float_eq(b[3], gamma + ldexp(1.0, -8) * (1 + gamma) + FLT_MIN, 1e-20);
  tw_gemm_error_bound(absp, ref, 4, 100, u, TW_F16, b);
  cr_assert_eq(b[1], ldexp(1.0, -25)); /* f16 subnormal rounding */
  tw_gemm_error_bound(absp, ref, 4, 1 << 25, u, TW_F32, b);
  cr_assert(isinf(b[0])); /* K*u >= 1: no bound */
  tw_gemm_error_bound(absp, ref, 4, 0, u, TW_F32, b);
  cr_assert_eq(b[0], ldexp(1.0, -24) * 3 + FLT_MIN);
}

/* The promoted model (gg_wgmma_fp8): K = 1000 in chunks of 128: n_in = 128 + 4 adds at 2^-13,
 * 8 chunk sums + 2 at 2^-24; K = 40 < chunk: n_in = 40 + 2. */
Test(check, gemm_error_bound_promoted_formula) {
  double absp[2] = {10.0, -1.0}, ref[2] = {3.0, 0.0}, b[2];
  double ui = ldexp(1.0, -13), u = ldexp(1.0, -24);
  tw_gemm_error_bound_promoted(absp, ref, 2, 1000, 128, ui, u, 2, TW_F32, b);
  double gi = 132 * ui / (1 - 132 * ui), go = 10 * u / (1 - 10 * u), g = gi + go * (1 + gi);
  cr_assert_float_eq(b[0], g * 10 + u * (3 + g * 10) + FLT_MIN, 1e-18);
  cr_assert_eq(b[1], -1.0);
  tw_gemm_error_bound_promoted(absp, ref, 1, 40, 128, ui, u, 2, TW_F32, b);
  gi = 42 * ui / (1 - 42 * ui), go = 3 * u / (1 - 3 * u), g = gi + go * (1 + gi);
  cr_assert_float_eq(b[0], g * 10 + u * (3 + g * 10) + FLT_MIN, 1e-18);
}

/* Subnormal codes (exponent field 0, mantissa != 0) become the smallest normal of their sign;
 * zeros, normals, NaN and inf stay; in place works; bad arguments are errors that write nothing. */
Test(check, fp8_lift_subnormal_codes) {
  const uint8_t e4[] = {0x00, 0x80, 0x01, 0x07, 0x81, 0x87, 0x08, 0x09, 0x38, 0x7E, 0x7F, 0xFF};
  const uint8_t w4[] = {0x00, 0x80, 0x08, 0x08, 0x88, 0x88, 0x08, 0x09, 0x38, 0x7E, 0x7F, 0xFF};
  const uint8_t e5[] = {0x00, 0x80, 0x01, 0x03, 0x83, 0x04, 0x05, 0x3C, 0x7B, 0x7C, 0x7F, 0xFE};
  const uint8_t w5[] = {0x00, 0x80, 0x04, 0x04, 0x84, 0x04, 0x05, 0x3C, 0x7B, 0x7C, 0x7F, 0xFE};
  uint8_t out[12];
  cr_assert_eq(tw_fp8_lift_subnormal_codes(e4, 12, TW_E4M3, out), TW_OK);
  cr_assert_arr_eq(out, w4, 12);
  cr_assert_eq(tw_fp8_lift_subnormal_codes(e5, 12, TW_E5M2, out), TW_OK);
  cr_assert_arr_eq(out, w5, 12);
  memcpy(out, e4, 12);
  cr_assert_eq(tw_fp8_lift_subnormal_codes(out, 12, TW_E4M3, out), TW_OK);
  cr_assert_arr_eq(out, w4, 12);
  cr_assert_eq(tw_fp8_lift_subnormal_codes(NULL, 0, TW_E4M3, NULL), TW_OK); /* nothing to do */
  memset(out, 0x5A, 12);
  tt_expect_status(tw_fp8_lift_subnormal_codes(e4, 12, TW_BF16, out), TW_ERR_DTYPE, "qdtype bf16 is not e4m3 or e5m2");
  tt_expect_status(tw_fp8_lift_subnormal_codes(e4, -1, TW_E4M3, out), TW_ERR_INVALID_ARG, "n = -1");
  tt_expect_status(tw_fp8_lift_subnormal_codes(NULL, 12, TW_E4M3, out), TW_ERR_NULL, "codes or out is NULL");
  tt_expect_status(tw_fp8_lift_subnormal_codes(e4, 12, TW_E5M2, NULL), TW_ERR_NULL, "codes or out is NULL");
  for (int i = 0; i < 12; i++) cr_assert_eq(out[i], 0x5A, "written on error at %d", i);
}

/* The bound is not vacuous: an f32 dot product accumulated in order stays inside it, and an
 * off-by-one in the index (a typical kernel bug) does not. */
Test(check, gemm_error_bound_holds_for_f32_dot_and_catches_a_bug) {
  enum { K = 4096 };
  static float a[K], b[K];
  tt_fill_uniform_f32(a, K, 1, -1, 1);
  tt_fill_uniform_f32(b, K, 2, -1, 1);
  float acc = 0, bug = 0;
  double exact = 0, absp = 0;
  for (int k = 0; k < K; k++) {
    acc += a[k] * b[k];
    bug += a[k] * b[(k + 1) % K];
    exact += (double)a[k] * b[k];
    absp += fabs((double)a[k] * b[k]);
  }
  double bound;
  tw_gemm_error_bound(&absp, &exact, 1, K, ldexp(1.0, -24), TW_F32, &bound);
  tw_tensor e = tw_tensor_1d(&exact, TW_F64, 1, TW_MEM_HOST), bt = tw_tensor_1d(&bound, TW_F64, 1, TW_MEM_HOST);
  tw_tensor g = tw_tensor_1d(&acc, TW_F32, 1, TW_MEM_HOST);
  tt_expect_bound(&g, &e, &bt, "f32 dot");
  g = tw_tensor_1d(&bug, TW_F32, 1, TW_MEM_HOST);
  tw_check_report r;
  cr_assert_eq(tw_check_bound(&g, &e, &bt, &r), TW_OK);
  cr_assert_not(r.passed, "ratio %g", r.worst_ratio);
}

Test(check, format_truncates_safely) {
  tw_check_report r;
  float a = 1, b = 2;
  tw_tensor ta = tw_tensor_1d(&a, TW_F32, 1, TW_MEM_HOST), tb = tw_tensor_1d(&b, TW_F32, 1, TW_MEM_HOST);
  cr_assert_eq(tw_check_exact(&ta, &tb, &r), TW_OK);
  char small[8];
  tw_check_format(&r, small, sizeof small);
  cr_assert_str_eq(small, "FAIL 1/");
  cr_assert_str_eq(tw_check_format(NULL, small, sizeof small), "(no rep");
}
