/* Grouped quantize / dequantize / delayed update on the ref backend: every stored golden case
 * (golden/data/quantize, written by golden/gen_quantize.py without twin's code) through the
 * golden runner, then properties that hold for any input: the round-trip error bound per
 * block, power-of-two scales, the MXFP8 swizzle as a permutation, tails neither read nor
 * written, and ref_dequantize_operand (the GEMMs' view of a quantized operand). */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/runner.h"
#include "ref/quantize_layout.h"
#include "ref/ref.h"
#include "tests/test_util.h"
#include "twin/tw_check.h"
#include "twin/tw_quantize.h"

/* An output buffer of t's dtype and shape, filled with the poison byte. */
static void poison_alloc(tw_tensor *t) {
  if (tw_tensor_is_none(t)) return;
  size_t n = tw_tensor_bytes(t);
  t->data = malloc(n ? n : 1);
  cr_assert_not_null(t->data);
  memset(t->data, TW_POISON_BYTE, n);
}

/* ---- golden cases: each one a test case, run by the golden runner on ref --------------- */

typedef struct {
  char dir[600];
} golden_case;

ParameterizedTestParameters(quantize_golden, case_passes) {
  char root[512], **dirs = NULL;
  snprintf(root, sizeof root, "%s/quantize", tt_golden_root());
  int n = tw_golden_list_cases(root, &dirs);
  if (n <= 0) { /* an empty list would pass silently: one impossible case instead */
    golden_case *none = cr_malloc(sizeof *none);
    snprintf(none->dir, sizeof none->dir, "%s/<no cases found: run golden/gen_quantize.py>", root);
    return cr_make_param_array(golden_case, none, 1);
  }
  golden_case *cases = cr_malloc(sizeof(golden_case) * (size_t)n);
  for (int i = 0; i < n; i++) snprintf(cases[i].dir, sizeof cases[i].dir, "%s", dirs[i]);
  tw_golden_free_list(dirs, n);
  return cr_make_param_array(golden_case, cases, (size_t)n);
}

ParameterizedTest(golden_case *c, quantize_golden, case_passes) {
  tw_ctx *ctx = tt_ref_ctx();
  tw_golden_result res;
  memset(&res, 0, sizeof res);
  tw_status s = tw_golden_run_case(ctx, c->dir, &res);
  cr_assert_eq(s, TW_OK, "%s: %s", c->dir, tw_last_error());
  cr_assert(res.passed, "%s (%s): %s %s", c->dir, res.op, res.worst_output, res.detail);
  cr_assert_gt(res.outputs, 0, "%s compared nothing", c->dir);
  tw_ctx_destroy(ctx);
}

/* ---- properties ------------------------------------------------------------------------- */

static const tw_scaling all_modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_MXFP8_1D,
                                       TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};

enum { PM = 301, PK = 130, PG = 5 };
static const int32_t prop_sizes[PG] = {129, 0, 1, 100, 40}; /* sum 270: a tail of 31 rows */

/* x of varying magnitude per row (so blocks get different scales) */
static void prop_input(float *x, uint64_t seed) {
  uint64_t st = seed;
  for (int64_t r = 0; r < PM; r++) {
    double mag = ldexp(1.0, (int)tt_rand_uniform(&st, -20, 20));
    for (int64_t k = 0; k < PK; k++) x[r * PK + k] = (float)(tt_rand_uniform(&st, -1, 1) * mag);
  }
}

typedef struct {
  tw_qtensor q;
  float scale[PG];
} prop_q;

static void prop_quantize_opt(tw_ctx *ctx, const float *x, tw_scaling mode, tw_dtype qd, int pow2, int swizzled,
                              int col_padded, prop_q *pq) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.qdtype = qd;
  o.layout = TW_ROWWISE_COLWISE;
  o.pow2_scales = pow2;
  o.mxfp8_swizzled = swizzled;
  o.col_padded = col_padded;
  if (mode == TW_SCALE_TENSOR_DELAYED) { /* a stored scale that fits each group's range */
    int64_t r0 = 0;
    for (int g = 0; g < PG; g++) {
      float amax = 0;
      for (int64_t i = r0 * PK; i < (r0 + prop_sizes[g]) * PK; i++) amax = fmaxf(amax, fabsf(x[i]));
      pq->scale[g] = amax > 0 ? (qd == TW_E4M3 ? 448.0f : 57344.0f) / amax : 1.0f;
      r0 += prop_sizes[g];
    }
    o.scale = tw_tensor_1d(pq->scale, TW_F32, PG, TW_MEM_HOST);
  }
  tw_tensor xt = tw_tensor_2d((void *)x, TW_F32, PM, PK, TW_MEM_HOST);
  tw_tensor gs = tw_tensor_1d((void *)prop_sizes, TW_I32, PG, TW_MEM_HOST);
  cr_assert_eq(tw_quantize_output_shapes(&o, PM, PK, PG, &pq->q), TW_OK);
  poison_alloc(&pq->q.row_data);
  poison_alloc(&pq->q.row_scale_inv);
  poison_alloc(&pq->q.col_data);
  poison_alloc(&pq->q.col_scale_inv);
  poison_alloc(&pq->q.amax);
  cr_assert_eq(tw_grouped_quantize(ctx, &xt, &gs, &o, &pq->q), TW_OK, "%s", tw_last_error());
}

static void prop_quantize(tw_ctx *ctx, const float *x, tw_scaling mode, tw_dtype qd, int pow2, int swizzled,
                          prop_q *pq) {
  prop_quantize_opt(ctx, x, mode, qd, pow2, swizzled, 0, pq);
}

static void prop_free(prop_q *pq) {
  free(pq->q.row_data.data);
  free(pq->q.row_scale_inv.data);
  free(pq->q.col_data.data);
  free(pq->q.col_scale_inv.data);
  free(pq->q.amax.data);
}

static void dequantize(tw_ctx *ctx, const tw_qtensor *q, int colwise, float *out) {
  tw_tensor gs = tw_tensor_1d((void *)prop_sizes, TW_I32, PG, TW_MEM_HOST);
  tw_tensor o = tw_tensor_2d(out, TW_F32, PM, PK, TW_MEM_HOST);
  memset(out, TW_POISON_BYTE, sizeof(float) * PM * PK);
  cr_assert_eq(tw_grouped_dequantize(ctx, q, &gs, colwise, &o), TW_OK, "%s", tw_last_error());
}

static int is_poison_f32(float v) {
  uint32_t b;
  memcpy(&b, &v, 4);
  return b == 0xA5A5A5A5u;
}

/* |x' - x| <= (u + 2^-21)|x| + (half the fp8 subnormal spacing) * scale_inv of x's block:
 * RNE to fp8 (unit roundoff u) of x * scale, where scaling keeps |x * scale| <= fp8_max, and
 * two f32 roundings (the product and the dequantize multiply). scale_inv per element comes
 * from dequantizing the code of 1.0 with the same scales. */
Test(quantize_props, round_trip_error_is_within_the_format_bound_per_block) {
  tw_ctx *ctx = tt_ref_ctx();
  float *x = malloc(sizeof(float) * PM * PK), *back = malloc(sizeof(float) * PM * PK),
        *sinv = malloc(sizeof(float) * PM * PK);
  prop_input(x, 42);
  int64_t S = 0;
  for (int g = 0; g < PG; g++) S += prop_sizes[g];
  for (int qi = 0; qi < 2; qi++) {
    tw_dtype qd = qi ? TW_E5M2 : TW_E4M3;
    double u = qi ? 0x1p-3 : 0x1p-4, half_sub = qi ? 0x1p-17 : 0x1p-10;
    uint8_t one = qi ? 0x3C : 0x38;
    for (int mi = 0; mi < 5; mi++)
      for (int colwise = 0; colwise < 2; colwise++) {
        prop_q pq;
        prop_quantize(ctx, x, all_modes[mi], qd, 0, 1, &pq);
        dequantize(ctx, &pq.q, colwise, back);
        tw_tensor *data = colwise ? &pq.q.col_data : &pq.q.row_data;
        memset(data->data, one, (size_t)tw_tensor_numel(data));
        dequantize(ctx, &pq.q, colwise, sinv);
        for (int64_t i = 0; i < PM * PK; i++) {
          if (i >= S * PK) { /* the tail is never written */
            cr_assert(is_poison_f32(back[i]), "%s colwise=%d: tail element %lld written",
                      tw_scaling_name(all_modes[mi]), colwise, (long long)i);
            continue;
          }
          double err = fabs((double)back[i] - (double)x[i]);
          double bound = (u + 0x1p-21) * fabs((double)x[i]) + half_sub * (double)sinv[i] * (1 + 0x1p-21);
          cr_assert(err <= bound, "%s %s colwise=%d: element [%lld, %lld]: x=%.9g back=%.9g err=%.3g > %.3g",
                    tw_scaling_name(all_modes[mi]), tw_dtype_name(qd), colwise, (long long)(i / PK),
                    (long long)(i % PK), (double)x[i], (double)back[i], err, bound);
        }
        prop_free(&pq);
      }
  }
  free(x);
  free(back);
  free(sinv);
  tw_ctx_destroy(ctx);
}

Test(quantize_props, pow2_scales_are_powers_of_two) {
  tw_ctx *ctx = tt_ref_ctx();
  float *x = malloc(sizeof(float) * PM * PK);
  prop_input(x, 7);
  const tw_scaling modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};
  for (int mi = 0; mi < 3; mi++) {
    prop_q pq;
    prop_quantize(ctx, x, modes[mi], TW_E4M3, 1, 0, &pq);
    tw_tensor *scales[2] = {&pq.q.row_scale_inv, &pq.q.col_scale_inv};
    int64_t checked = 0;
    for (int o = 0; o < 2; o++) {
      const uint32_t *b = scales[o]->data;
      for (int64_t i = 0; i < tw_tensor_numel(scales[o]); i++) {
        if (b[i] == 0xA5A5A5A5u) continue; /* a slot no block owns */
        cr_assert_eq(b[i] & 0x807FFFFFu, 0u, "%s: scale_inv[%lld] bits 0x%08x are not a power of two",
                     tw_scaling_name(modes[mi]), (long long)i, b[i]);
        checked++;
      }
    }
    cr_assert_gt(checked, 0);
    prop_free(&pq);
  }
  free(x);
  tw_ctx_destroy(ctx);
}

Test(quantize_props, swizzle_and_unswizzle_are_inverse_permutations) {
  const int64_t dims[][2] = {{128, 4}, {256, 8}, {128, 12}, {384, 4}, {512, 16}};
  for (int t = 0; t < 5; t++) {
    int64_t R = dims[t][0], C = dims[t][1], n = R * C;
    char *seen = calloc((size_t)n, 1);
    for (int64_t r = 0; r < R; r++)
      for (int64_t c = 0; c < C; c++) {
        int64_t i = ref_mxfp8_swizzle_index(r, c, C), r2, c2;
        cr_assert(i >= 0 && i < n && !seen[i], "[%lld, %lld] -> %lld: not a permutation", (long long)r,
                  (long long)c, (long long)i);
        seen[i] = 1;
        ref_mxfp8_unswizzle_index(i, C, &r2, &c2);
        cr_assert(r2 == r && c2 == c, "unswizzle(swizzle(%lld, %lld)) = (%lld, %lld)", (long long)r,
                  (long long)c, (long long)r2, (long long)c2);
      }
    for (int64_t i = 0; i < n; i++) {
      int64_t r, c;
      ref_mxfp8_unswizzle_index(i, C, &r, &c);
      cr_assert_eq(ref_mxfp8_swizzle_index(r, c, C), i);
    }
    free(seen);
  }
}

/* The swizzled scales are the compact ones permuted per group; the data does not change. */
Test(quantize_props, mxfp8_swizzled_scales_are_the_compact_ones_permuted_per_group) {
  tw_ctx *ctx = tt_ref_ctx();
  float *x = malloc(sizeof(float) * PM * PK);
  prop_input(x, 11);
  prop_q sw, co;
  prop_quantize(ctx, x, TW_SCALE_MXFP8_1D, TW_E4M3, 0, 1, &sw);
  prop_quantize(ctx, x, TW_SCALE_MXFP8_1D, TW_E4M3, 0, 0, &co);
  cr_assert_eq(memcmp(sw.q.row_data.data, co.q.row_data.data, PM * PK), 0);
  cr_assert_eq(memcmp(sw.q.col_data.data, co.q.col_data.data, PM * PK), 0);
  for (int colwise = 0; colwise < 2; colwise++) {
    const tw_tensor *ts = colwise ? &sw.q.col_scale_inv : &sw.q.row_scale_inv;
    const uint8_t *s = ts->data, *c = colwise ? co.q.col_scale_inv.data : co.q.row_scale_inv.data;
    int64_t ld = ts->shape[1], tile = 0;
    for (int g = 0; g < PG; g++) {
      int64_t tiles = (prop_sizes[g] + 127) / 128, rows = (colwise ? 4 : 128) * tiles;
      int64_t base = (colwise ? 4 : 128) * tile * ld;
      for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < ld; k++) {
          /* colwise blocks are swizzled as their transpose [ld, rows] */
          int64_t i = colwise ? ref_mxfp8_swizzle_index(k, r, rows) : ref_mxfp8_swizzle_index(r, k, ld);
          cr_assert_eq(s[base + i], c[base + r * ld + k], "colwise=%d group %d [%lld, %lld]", colwise, g,
                       (long long)r, (long long)k);
        }
      tile += tiles;
    }
    /* past the last group's block: untouched */
    for (int64_t i = (colwise ? 4 : 128) * tile * ld; i < tw_tensor_numel(ts); i++)
      cr_assert_eq(s[i], TW_POISON_BYTE);
  }
  prop_free(&sw);
  prop_free(&co);
  free(x);
  tw_ctx_destroy(ctx);
}

/* ref_dequantize_operand (used by ref/gemm.c) gives grouped_dequantize's values in the data's
 * own element order: the same for rowwise and MXFP8 colwise, per-group transposed otherwise. */
Test(quantize_props, dequantize_operand_matches_grouped_dequantize_in_storage_order) {
  tw_ctx *ctx = tt_ref_ctx();
  float *x = malloc(sizeof(float) * PM * PK), *ref = malloc(sizeof(float) * PM * PK),
        *got = malloc(sizeof(float) * PM * PK);
  prop_input(x, 3);
  int64_t off[PG + 1] = {0};
  for (int g = 0; g < PG; g++) off[g + 1] = off[g] + prop_sizes[g];
  for (int mi = 0; mi < 5; mi++)
    for (int colwise = 0; colwise < 2; colwise++) {
      prop_q pq;
      prop_quantize(ctx, x, all_modes[mi], TW_E4M3, 0, 1, &pq);
      dequantize(ctx, &pq.q, colwise, ref);
      tw_operand o = colwise ? tw_operand_colwise(&pq.q) : tw_operand_rowwise(&pq.q);
      memset(got, TW_POISON_BYTE, sizeof(float) * PM * PK);
      cr_assert_eq(ref_dequantize_operand(&o, prop_sizes, PG, got), TW_OK, "%s", tw_last_error());
      int transposed = colwise && all_modes[mi] != TW_SCALE_MXFP8_1D;
      for (int g = 0; g < PG; g++)
        for (int64_t r = 0; r < prop_sizes[g]; r++)
          for (int64_t k = 0; k < PK; k++) {
            int64_t at = transposed ? off[g] * PK + k * prop_sizes[g] + r : (off[g] + r) * PK + k;
            cr_assert(memcmp(&got[at], &ref[(off[g] + r) * PK + k], 4) == 0, "%s colwise=%d group %d [%lld, %lld]",
                      tw_scaling_name(all_modes[mi]), colwise, g, (long long)r, (long long)k);
          }
      for (int64_t i = off[PG] * PK; i < PM * PK; i++) cr_assert(is_poison_f32(got[i]));
      prop_free(&pq);
    }
  free(x);
  free(ref);
  free(got);
  tw_ctx_destroy(ctx);
}

/* The uniform form (group_sizes NULL): G equal groups, as the grouped GEMM's rhs [G*K, N]. */
Test(quantize_props, dequantize_operand_uniform_groups) {
  tw_ctx *ctx = tt_ref_ctx();
  enum { G = 3, KR = 130, N = 40 };
  float *x = malloc(sizeof(float) * G * KR * N), *ref = malloc(sizeof(float) * G * KR * N),
        *got = malloc(sizeof(float) * G * KR * N);
  tt_fill_uniform_f32(x, G * KR * N, 5, -3, 3);
  int32_t sizes[G] = {KR, KR, KR};
  for (int mi = 0; mi < 5; mi++) {
    tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
    float scale[G] = {100, 50, 25};
    o.mode = all_modes[mi];
    o.layout = TW_ROWWISE;
    o.scale = tw_tensor_1d(scale, TW_F32, G, TW_MEM_HOST);
    tw_qtensor q;
    tw_tensor xt = tw_tensor_2d(x, TW_F32, G * KR, N, TW_MEM_HOST), gs = tw_tensor_1d(sizes, TW_I32, G, TW_MEM_HOST);
    cr_assert_eq(tw_quantize_output_shapes(&o, G * KR, N, G, &q), TW_OK);
    poison_alloc(&q.row_data);
    poison_alloc(&q.row_scale_inv);
    poison_alloc(&q.amax);
    cr_assert_eq(tw_grouped_quantize(ctx, &xt, &gs, &o, &q), TW_OK, "%s", tw_last_error());
    tw_tensor out = tw_tensor_2d(ref, TW_F32, G * KR, N, TW_MEM_HOST);
    cr_assert_eq(tw_grouped_dequantize(ctx, &q, &gs, 0, &out), TW_OK);
    tw_operand op = tw_operand_rowwise(&q);
    cr_assert_eq(ref_dequantize_operand(&op, NULL, G, got), TW_OK, "%s", tw_last_error());
    cr_assert_eq(memcmp(got, ref, sizeof(float) * G * KR * N), 0, "%s", tw_scaling_name(all_modes[mi]));
    free(q.row_data.data);
    free(q.row_scale_inv.data);
    free(q.amax.data);
  }
  free(x);
  free(ref);
  free(got);
  tw_ctx_destroy(ctx);
}

/* A group of only zeros and an empty group get scale 1; the tail row is not written. */
Test(quantize_props, tensor_current_zero_group_has_unit_scale) {
  tw_ctx *ctx = tt_ref_ctx();
  float x[4 * 3] = {0, 0, 0, 0, 0, 0, 1, -2, 3, 0, 0, 0};
  int32_t sizes[3] = {2, 1, 0};
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  tw_qtensor q;
  cr_assert_eq(tw_quantize_output_shapes(&o, 4, 3, 3, &q), TW_OK);
  uint8_t data[12];
  float si[3], amax[3];
  memset(data, TW_POISON_BYTE, sizeof data);
  q.row_data.data = data;
  q.row_scale_inv.data = si;
  q.amax.data = amax;
  tw_tensor xt = tw_tensor_2d(x, TW_F32, 4, 3, TW_MEM_HOST), gs = tw_tensor_1d(sizes, TW_I32, 3, TW_MEM_HOST);
  cr_assert_eq(tw_grouped_quantize(ctx, &xt, &gs, &o, &q), TW_OK, "%s", tw_last_error());
  cr_assert_eq(si[0], 1.0f);
  cr_assert_eq(amax[0], 0.0f);
  cr_assert_eq(amax[1], 3.0f);
  cr_assert_eq(si[1], 1.0f / (448.0f / 3.0f));
  cr_assert_eq(si[2], 1.0f); /* an empty group still owns its slot: amax 0, scale 1 */
  cr_assert_eq(amax[2], 0.0f);
  cr_assert_eq(data[6 + 2], 0x7E); /* 3 * (448/3) rounds to 448 */
  for (int i = 9; i < 12; i++) cr_assert_eq(data[i], TW_POISON_BYTE); /* the tail row */
  tw_ctx_destroy(ctx);
}

/* Rows past the groups are never read: NaN there changes no output byte, in any mode. */
Test(quantize_props, tail_rows_are_never_read) {
  tw_ctx *ctx = tt_ref_ctx();
  float *x = malloc(sizeof(float) * PM * PK);
  prop_input(x, 19);
  int64_t S = 0;
  for (int g = 0; g < PG; g++) S += prop_sizes[g];
  for (int mi = 0; mi < 5; mi++) {
    prop_q clean, dirty;
    for (int64_t i = S * PK; i < PM * PK; i++) x[i] = 0.0f;
    prop_quantize(ctx, x, all_modes[mi], TW_E5M2, 0, 1, &clean);
    for (int64_t i = S * PK; i < PM * PK; i++) x[i] = NAN;
    prop_quantize(ctx, x, all_modes[mi], TW_E5M2, 0, 1, &dirty);
    const tw_tensor *a[5] = {&clean.q.row_data, &clean.q.row_scale_inv, &clean.q.col_data, &clean.q.col_scale_inv,
                             &clean.q.amax};
    const tw_tensor *b[5] = {&dirty.q.row_data, &dirty.q.row_scale_inv, &dirty.q.col_data, &dirty.q.col_scale_inv,
                             &dirty.q.amax};
    for (int i = 0; i < 5; i++)
      cr_assert_eq(memcmp(a[i]->data, b[i]->data, tw_tensor_bytes(a[i])), 0, "%s: output %d depends on the tail",
                   tw_scaling_name(all_modes[mi]), i);
    prop_free(&clean);
    prop_free(&dirty);
  }
  free(x);
  tw_ctx_destroy(ctx);
}

/* The token-padded colwise layout (tw_quantize.h, opts.col_padded) holds the default layout's
 * codes at [k][128*T(g) + i], code 0 in each group's padding to the next 128 tokens, and
 * nothing past 128*T(G); every other output is the default's, byte for byte, and so is the
 * colwise dequantize. */
Test(quantize_props, token_padded_colwise_is_the_default_layout_moved) {
  tw_ctx *ctx = tt_ref_ctx();
  float *x = malloc(sizeof(float) * PM * PK), *d0 = malloc(sizeof(float) * PM * PK),
        *d1 = malloc(sizeof(float) * PM * PK);
  prop_input(x, 23);
  int64_t off[PG + 1], tile[PG + 1];
  off[0] = tile[0] = 0;
  for (int g = 0; g < PG; g++) {
    off[g + 1] = off[g] + prop_sizes[g];
    tile[g + 1] = tile[g] + (prop_sizes[g] + 127) / 128;
  }
  const int64_t pitch = 128 * ((PM + 127 * PG) / 128); /* 128 * T_cap, T_cap = 7 > T(G) = 5 */
  cr_assert_eq(pitch, 896);
  const tw_scaling modes[4] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_BLOCK_1x128,
                               TW_SCALE_BLOCK_128x128};
  for (int mi = 0; mi < 4; mi++) {
    prop_q a, b;
    prop_quantize_opt(ctx, x, modes[mi], TW_E4M3, 0, 0, 0, &a);
    prop_quantize_opt(ctx, x, modes[mi], TW_E4M3, 0, 0, 1, &b);
    const char *mn = tw_scaling_name(modes[mi]);
    cr_assert(b.q.col_padded == 1 && a.q.col_padded == 0, "%s: col_padded not recorded", mn);
    cr_assert(b.q.col_data.ndim == 2 && b.q.col_data.shape[0] == PK && b.q.col_data.shape[1] == pitch,
              "%s: col_data shape", mn);
    const tw_tensor *ta[4] = {&a.q.row_data, &a.q.row_scale_inv, &a.q.col_scale_inv, &a.q.amax};
    const tw_tensor *tb[4] = {&b.q.row_data, &b.q.row_scale_inv, &b.q.col_scale_inv, &b.q.amax};
    for (int i = 0; i < 4; i++)
      cr_assert(tw_tensor_bytes(ta[i]) == tw_tensor_bytes(tb[i]) &&
                    memcmp(ta[i]->data, tb[i]->data, tw_tensor_bytes(ta[i])) == 0,
                "%s: output %d differs with the padded colwise layout", mn, i);
    const uint8_t *ca = a.q.col_data.data, *cb = b.q.col_data.data;
    for (int64_t k = 0; k < PK; k++) {
      for (int g = 0; g < PG; g++) {
        const int64_t m = prop_sizes[g], padded_end = 128 * ((m + 127) / 128);
        for (int64_t i = 0; i < padded_end; i++) {
          uint8_t want = i < m ? ca[off[g] * PK + k * m + i] : 0;
          cr_assert_eq(cb[k * pitch + 128 * tile[g] + i], want, "%s: k %lld group %d token %lld", mn, (long long)k, g,
                       (long long)i);
        }
      }
      for (int64_t j = 128 * tile[PG]; j < pitch; j++)
        cr_assert_eq(cb[k * pitch + j], TW_POISON_BYTE, "%s: column %lld past the groups written", mn, (long long)j);
    }
    dequantize(ctx, &a.q, 1, d0);
    dequantize(ctx, &b.q, 1, d1);
    cr_assert(memcmp(d0, d1, sizeof(float) * PM * PK) == 0, "%s: colwise dequantize differs", mn);
    prop_free(&a);
    prop_free(&b);
  }
  free(x);
  free(d0);
  free(d1);
  tw_ctx_destroy(ctx);
}
