/* The golden runner itself, independent of the real operations: cases are written here from C
 * (tw_npy_save into a temp dir) and run on a fake backend defined below. The fake plays "gpu":
 * its memory is tagged device, so a runner that forgot a copy would be caught, and a switch
 * makes it misbehave the ways real kernels do (a wrong value, an unwritten row, a write past
 * the groups, a NaN). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/backend.h"
#include "golden/exec.h"
#include "golden/runner.h"
#include "tests/test_util.h"
#include "twin/tw_npy.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

/* ---- the fake backend ------------------------------------------------------------------------ */
enum { BUG_NONE, BUG_WRONG_VALUE, BUG_SKIP_ROW, BUG_WRITE_TAIL, BUG_NAN };
static int fake_bug;

static tw_status fake_alloc(tw_ctx *c, size_t n, void **out) {
  (void)c;
  *out = malloc(n);
  return *out ? TW_OK : tw_error(TW_ERR_MEMORY, "fake alloc");
}
static tw_status fake_free(tw_ctx *c, void *p) { (void)c; free(p); return TW_OK; }
static tw_status fake_copy(tw_ctx *c, void *d, tw_mem dm, const void *s, tw_mem sm, size_t n) {
  (void)c; (void)dm; (void)sm;
  memmove(d, s, n);
  return TW_OK;
}
static tw_status fake_memset(tw_ctx *c, void *p, int b, size_t n) { (void)c; memset(p, b, n); return TW_OK; }

/* out[o_g + i, n] = sum_k lhs[o_g + i, k] * rhs[g] (k, n) in f64, rounded once to out's dtype. */
static tw_status fake_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs,
                                   tw_op rhs_op, const tw_tensor *gs, tw_tensor *out, int acc) {
  (void)ctx;
  const int32_t *sizes = (const int32_t *)gs->data;
  int64_t G = gs->shape[0], K = lhs->data.shape[1], N = out->shape[1], row = 0;
  for (int64_t g = 0; g < G; g++) {
    for (int64_t i = 0; i < sizes[g]; i++, row++) {
      if (fake_bug == BUG_SKIP_ROW && row == 1) continue;
      for (int64_t n = 0; n < N; n++) {
        double s = acc ? tw_load_as_f64(out->data, out->dtype, row * N + n) : 0;
        for (int64_t k = 0; k < K; k++) {
          int64_t ri = rhs_op == TW_OP_N ? (g * K + k) * N + n : (g * N + n) * K + k;
          s += tw_load_as_f64(lhs->data.data, lhs->data.dtype, row * K + k) *
               tw_load_as_f64(rhs->data.data, rhs->data.dtype, ri);
        }
        if (fake_bug == BUG_WRONG_VALUE && row == 2 && n == 1) s += 0.25;
        if (fake_bug == BUG_NAN && row == 0 && n == 0) s = NAN;
        tw_store_from_f64(out->data, out->dtype, row * N + n, s, 0);
      }
    }
  }
  if (fake_bug == BUG_WRITE_TAIL && row < out->shape[0]) tw_store_from_f64(out->data, out->dtype, row * N, 0.0, 0);
  return TW_OK;
}

/* The delayed-scaling history update of tw_quantize.h, written out plainly. */
static tw_status fake_delayed(tw_ctx *ctx, tw_tensor *hist, tw_tensor *scale, const tw_tensor *amax,
                              tw_dtype qdtype, tw_amax_algo algo, float margin) {
  (void)ctx;
  int64_t G = hist->shape[0], H = hist->shape[1];
  float *h = (float *)hist->data, *s = (float *)scale->data;
  const float *a = (const float *)amax->data;
  float fmax = qdtype == TW_E4M3 ? 448.0f : 57344.0f;
  for (int64_t g = 0; g < G; g++) {
    float *hg = h + g * H;
    hg[0] = a[g];
    float m = hg[0];
    if (algo == TW_AMAX_MAX)
      for (int64_t j = 1; j < H; j++) m = hg[j] > m ? hg[j] : m;
    if (m > 0 && isfinite(m)) s[g] = (fmax / m) / exp2f(margin);
    if (fake_bug == BUG_WRONG_VALUE && g == 1) s[g] *= 2;
    float first = hg[0];
    for (int64_t j = 0; j + 1 < H; j++) hg[j] = hg[j + 1];
    hg[H - 1] = first;
    hg[0] = 0;
  }
  return TW_OK;
}

/* A strong definition: this test binary links no real gpu backend. */
const tw_backend_ops tw_gpu_ops = {
    .name = "fake",
    .mem = TW_MEM_DEVICE,
    .alloc = fake_alloc,
    .free = fake_free,
    .copy = fake_copy,
    .memset = fake_memset,
    .grouped_gemm = fake_grouped_gemm,
    .delayed_scale_update = fake_delayed,
};

static tw_ctx *fake_ctx(void) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_mem(ctx), TW_MEM_DEVICE);
  return ctx;
}

/* ---- writing cases ----------------------------------------------------------------------------- */
static void save(const char *dir, const char *name, tw_tensor t) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s.npy", dir, name);
  cr_assert_eq(tw_npy_save(path, &t), TW_OK, "%s", tw_last_error());
}

static void write_text(const char *dir, const char *name, const char *text) {
  char path[1100];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  tt_write_file(path, text, strlen(text));
}

static char *make_case_dir(const char *area, const char *name) {
  char *root = tt_make_tmpdir("golden");
  size_t n = strlen(root) + strlen(area) + strlen(name) + 8;
  char *dir = (char *)malloc(n);
  snprintf(dir, n, "%s/%s", root, area);
  mkdir(dir, 0755);
  snprintf(dir, n, "%s/%s/%s", root, area, name);
  mkdir(dir, 0755);
  free(root);
  return dir;
}

/* Grouped forward: M = 7 rows, groups {2, 0, 4} (row 6 is the tail), K = 5, N = 3.
 * expected in f64; the tail keeps the decoded poison and must stay exact (abs_prod -1). */
enum { GM = 7, GK = 5, GN = 3, GG = 3 };
static char *write_grouped_case(tw_dtype out_dtype, int accumulate) {
  char *dir = make_case_dir("gemm", "grouped_small");
  static float lhs[GM * GK], rhs[GG * GK * GN];
  int32_t gs[GG] = {2, 0, 4};
  tt_fill_uniform_f32(lhs, GM * GK, 11, -1, 1);
  tt_fill_uniform_f32(rhs, GG * GK * GN, 12, -1, 1);
  double expected[GM * GN], absp[GM * GN];
  uint16_t init16[GM * GN];
  float init32[GM * GN];
  uint8_t poison[8];
  memset(poison, TW_POISON_BYTE, sizeof poison);
  for (int i = 0; i < GM * GN; i++) {
    init32[i] = (float)(i % 5) - 2.0f;
    init16[i] = tw_f32_to_bf16(init32[i]);
  }
  for (int row = 0, g = 0, left = gs[0]; row < GM; row++) {
    while (g < GG && left == 0) left = ++g < GG ? gs[g] : 0;
    for (int n = 0; n < GN; n++) {
      double init = accumulate ? init32[row * GN + n] : tw_load_as_f64(poison, out_dtype, 0);
      if (g >= GG) { /* tail */
        expected[row * GN + n] = init;
        absp[row * GN + n] = -1;
        continue;
      }
      double s = accumulate ? init : 0, a = accumulate ? fabs(init) : 0;
      for (int k = 0; k < GK; k++) {
        double p = (double)lhs[row * GK + k] * rhs[(g * GK + k) * GN + n];
        s += p;
        a += fabs(p);
      }
      expected[row * GN + n] = s;
      absp[row * GN + n] = a;
    }
    if (g < GG) left--;
  }
  save(dir, "lhs", tw_tensor_2d(lhs, TW_F32, GM, GK, TW_MEM_HOST));
  save(dir, "rhs", tw_tensor_3d(rhs, TW_F32, GG, GK, GN, TW_MEM_HOST));
  save(dir, "group_sizes", tw_tensor_1d(gs, TW_I32, GG, TW_MEM_HOST));
  save(dir, "expected", tw_tensor_2d(expected, TW_F64, GM, GN, TW_MEM_HOST));
  save(dir, "abs_prod", tw_tensor_2d(absp, TW_F64, GM, GN, TW_MEM_HOST));
  if (accumulate)
    save(dir, "out_init", out_dtype == TW_F32 ? tw_tensor_2d(init32, TW_F32, GM, GN, TW_MEM_HOST)
                                              : tw_tensor_2d(init16, TW_U16, GM, GN, TW_MEM_HOST));
  char txt[512];
  snprintf(txt, sizeof txt,
           "# hand-made by runner_test\nop = grouped_gemm\nrhs_op = N\nout_dtype = %s\n"
           "accumulate = %d\nlhs_mode = none\nlhs_dtype = f32\nrhs_mode = none   # trailing comment\n"
           "rhs_dtype = f32\nbound_k = %d\n",
           tw_dtype_name(out_dtype), accumulate, GK);
  write_text(dir, "case.txt", txt);
  return dir;
}

static tw_golden_result run_case(tw_ctx *ctx, const char *dir, tw_status want) {
  tw_golden_result res;
  tw_status s = tw_golden_run_case(ctx, dir, &res);
  cr_assert_eq(s, want, "status %s: %s (%s)", tw_status_name(s), tw_last_error(), res.detail);
  return res;
}

/* ---- GEMM cases: the bound ------------------------------------------------------------------------ */
Test(runner, grouped_gemm_case_passes_on_a_correct_backend) {
  fake_bug = BUG_NONE;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_F32, 0);
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert(res.passed, "%s", res.detail);
  cr_assert_str_eq(res.name, "gemm/grouped_small");
  cr_assert_str_eq(res.op, "grouped_gemm");
  cr_assert_eq(res.outputs, 1);
  cr_assert_str_eq(res.worst_output, "out");
  cr_assert_eq(res.worst.count, GM * GN);
  cr_assert(strncmp(res.detail, "out: PASS 21 elems", 18) == 0, "%s", res.detail);
  free(dir);
  tw_ctx_destroy(ctx);
}

Test(runner, bf16_output_and_accumulate_pass_within_the_bound) {
  fake_bug = BUG_NONE;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_BF16, 1);
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert(res.passed, "%s", res.detail);
  cr_assert_gt(res.worst.worst_ratio, 0); /* bf16 rounding shows, inside the bound */
  cr_assert_leq(res.worst.worst_ratio, 1);
  free(dir);
  tw_ctx_destroy(ctx);
}

Test(runner, a_wrong_value_fails_with_its_coordinates) {
  fake_bug = BUG_WRONG_VALUE;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_F32, 0);
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert_not(res.passed);
  cr_assert_eq(res.worst.mismatches, 1);
  cr_assert_eq(res.worst.worst_coord[0], 2);
  cr_assert_eq(res.worst.worst_coord[1], 1);
  cr_assert(strstr(res.detail, "out: FAIL 1/21 out of bound") == res.detail, "%s", res.detail);
  free(dir);
  tw_ctx_destroy(ctx);
}

Test(runner, an_unwritten_row_is_reported_as_unwritten) {
  fake_bug = BUG_SKIP_ROW;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_F32, 0);
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert_not(res.passed);
  cr_assert_eq(res.worst.unwritten, GN);
  cr_assert(strstr(res.detail, "3 unwritten") != NULL, "%s", res.detail);
  free(dir);
  tw_ctx_destroy(ctx);
}

Test(runner, a_write_past_the_groups_fails) {
  fake_bug = BUG_WRITE_TAIL;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_F32, 0);
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert_not(res.passed);
  cr_assert_eq(res.worst.worst_coord[0], 6);
  cr_assert_eq(res.worst.worst_expected, (double)tw_load_as_f64((uint8_t[4]){0xA5, 0xA5, 0xA5, 0xA5}, TW_F32, 0));
  free(dir);
  tw_ctx_destroy(ctx);
}

Test(runner, a_nan_is_counted) {
  fake_bug = BUG_NAN;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_F32, 0);
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert_not(res.passed);
  cr_assert_eq(res.worst.nan_mismatches, 1);
  free(dir);
  tw_ctx_destroy(ctx);
}

/* ---- exact outputs: the delayed scaling update ----------------------------------------------------- */
static char *write_delayed_case(void) {
  char *dir = make_case_dir("quantize", "delayed_update");
  float hist[3 * 4] = {0, 1, 2, 3, 0, 5, 0.5f, 0, 0, 0, 0, 0};
  float scale[3] = {1, 2, 3}, amax[3] = {0.5f, 7, 0};
  float hist_out[3 * 4] = {0, 2, 3, 0.5f, 0, 0.5f, 0, 7, 0, 0, 0, 0};
  float scale_out[3] = {448.0f / 3, 64, 3};
  save(dir, "amax_history", tw_tensor_2d(hist, TW_F32, 3, 4, TW_MEM_HOST));
  save(dir, "scale", tw_tensor_1d(scale, TW_F32, 3, TW_MEM_HOST));
  save(dir, "amax", tw_tensor_1d(amax, TW_F32, 3, TW_MEM_HOST));
  save(dir, "amax_history_out", tw_tensor_2d(hist_out, TW_F32, 3, 4, TW_MEM_HOST));
  save(dir, "scale_out", tw_tensor_1d(scale_out, TW_F32, 3, TW_MEM_HOST));
  write_text(dir, "case.txt", "op = delayed_scale_update\nqdtype = e4m3\nalgo = max\nmargin = 0\n");
  return dir;
}

Test(runner, exact_outputs_pass_and_fail_bit_for_bit) {
  tw_ctx *ctx = fake_ctx();
  char *dir = write_delayed_case();
  fake_bug = BUG_NONE;
  tw_golden_result res = run_case(ctx, dir, TW_OK);
  cr_assert(res.passed, "%s", res.detail);
  cr_assert_eq(res.outputs, 2);
  fake_bug = BUG_WRONG_VALUE;
  res = run_case(ctx, dir, TW_OK);
  cr_assert_not(res.passed);
  cr_assert_str_eq(res.worst_output, "scale_out");
  cr_assert_eq(res.worst.worst_index, 1);
  cr_assert(strstr(res.detail, "scale_out: FAIL 1/3 differ") == res.detail, "%s", res.detail);
  free(dir);
  tw_ctx_destroy(ctx);
}

/* ---- broken cases: clear errors ---------------------------------------------------------------- */
static void expect_case_error(tw_ctx *ctx, const char *dir, tw_status want, const char *substr) {
  tw_golden_result res;
  tw_status s = tw_golden_run_case(ctx, dir, &res);
  cr_assert_eq(s, want, "%s: %s", tw_status_name(s), tw_last_error());
  cr_assert_not(res.passed);
  cr_assert(strstr(res.detail, substr) != NULL, "detail '%s' lacks '%s'", res.detail, substr);
  cr_assert(strncmp(res.detail, "ERROR ", 6) == 0, "%s", res.detail);
}

Test(runner, broken_cases_are_errors_that_say_why) {
  fake_bug = BUG_NONE;
  tw_ctx *ctx = fake_ctx();
  char *dir = write_grouped_case(TW_F32, 0);
  char path[1024];
  snprintf(path, sizeof path, "%s/abs_prod.npy", dir);
  tt_write_file(path, "garbage", 7);
  expect_case_error(ctx, dir, TW_ERR_IO, "abs_prod.npy: not a .npy file");
  write_text(dir, "case.txt", "op = grouped_gemm\nthis line is wrong\n");
  expect_case_error(ctx, dir, TW_ERR_IO, "case.txt:2: expected 'key = value'");
  write_text(dir, "case.txt", "op = transmogrify\n");
  expect_case_error(ctx, dir, TW_ERR_INVALID_ARG, "unknown op 'transmogrify'");
  write_text(dir, "case.txt", "rhs_op = N\n");
  expect_case_error(ctx, dir, TW_ERR_IO, "no 'op = ...' line");
  write_text(dir, "case.txt", "op = grouped_gemm\nrhs_op = X\n");
  expect_case_error(ctx, dir, TW_ERR_INVALID_ARG, "'rhs_op' = 'X' is not N or T");
  free(dir);

  dir = write_grouped_case(TW_F32, 0);
  write_text(dir, "case.txt", "op = grouped_gemm\nrhs_op = N\n");
  expect_case_error(ctx, dir, TW_ERR_IO, "neither 'bound_k' nor 'K'");
  snprintf(path, sizeof path, "%s/rhs.npy", dir);
  remove(path);
  expect_case_error(ctx, dir, TW_ERR_IO, "input 'rhs' is missing");
  float wrong[4] = {0};
  save(dir, "rhs", tw_tensor_3d(wrong, TW_F32, 1, 2, 2, TW_MEM_HOST));
  expect_case_error(ctx, dir, TW_ERR_SHAPE, "rhs has 1 groups but group_sizes has 3");
  free(dir);
  expect_case_error(ctx, "/nonexistent/case", TW_ERR_IO, "cannot open");

  dir = write_delayed_case();
  save(dir, "amax", tw_tensor_1d(wrong, TW_I32, 3, TW_MEM_HOST));
  expect_case_error(ctx, dir, TW_ERR_DTYPE, "input 'amax' is [3] i32, cannot use it as f32");
  free(dir);
  dir = write_delayed_case();
  save(dir, "scale_out", tw_tensor_1d(wrong, TW_F32, 4, TW_MEM_HOST));
  expect_case_error(ctx, dir, TW_ERR_SHAPE, "scale_out: expected file is [4] f32 but the output is [3] f32");
  snprintf(path, sizeof path, "%s/scale_out.npy", dir);
  remove(path);
  expect_case_error(ctx, dir, TW_ERR_IO, "lacks scale_out.npy");
  free(dir);
  tw_ctx_destroy(ctx);
}

Test(runner, an_op_the_backend_lacks_is_an_unsupported_error) {
  tw_ctx *ctx = fake_ctx();
  char *dir = make_case_dir("gemm", "dense");
  float a[6] = {1, 2, 3, 4, 5, 6};
  double e[4] = {0}, p[4] = {0};
  save(dir, "a", tw_tensor_2d(a, TW_F32, 2, 3, TW_MEM_HOST));
  save(dir, "b", tw_tensor_2d(a, TW_F32, 3, 2, TW_MEM_HOST));
  save(dir, "expected", tw_tensor_2d(e, TW_F64, 2, 2, TW_MEM_HOST));
  save(dir, "abs_prod", tw_tensor_2d(p, TW_F64, 2, 2, TW_MEM_HOST));
  write_text(dir, "case.txt", "op = gemm\nop_a = N\nop_b = N\nbound_k = 3\n");
  expect_case_error(ctx, dir, TW_ERR_UNSUPPORTED, "gemm: the fake backend does not provide it");
  free(dir);
  tw_ctx_destroy(ctx);
}

/* ---- listing ------------------------------------------------------------------------------------ */
Test(runner, list_cases_finds_case_dirs_sorted) {
  char *root = tt_make_tmpdir("list");
  char path[1024];
  const char *dirs[] = {"quantize", "quantize/b_case", "quantize/a_case", "gemm", "gemm/z",
                        "gemm/z/nested_not_a_case", "empty"};
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    snprintf(path, sizeof path, "%s/%s", root, dirs[i]);
    cr_assert_eq(mkdir(path, 0755), 0);
  }
  snprintf(path, sizeof path, "%s/quantize/b_case", root);
  write_text(path, "case.txt", "op = gemm\n");
  snprintf(path, sizeof path, "%s/quantize/a_case", root);
  write_text(path, "case.txt", "op = gemm\n");
  snprintf(path, sizeof path, "%s/gemm/z", root);
  write_text(path, "case.txt", "op = gemm\n");
  char **list = NULL;
  int n = tw_golden_list_cases(root, &list);
  cr_assert_eq(n, 3, "%s", tw_last_error());
  cr_assert(strstr(list[0], "/gemm/z") != NULL, "%s", list[0]);
  cr_assert(strstr(list[1], "/quantize/a_case") != NULL, "%s", list[1]);
  cr_assert(strstr(list[2], "/quantize/b_case") != NULL, "%s", list[2]);
  tw_golden_free_list(list, n);
  snprintf(path, sizeof path, "%s/empty", root);
  cr_assert_eq(tw_golden_list_cases(path, &list), 0);
  tw_golden_free_list(list, 0);
  cr_assert_eq(tw_golden_list_cases("/nonexistent/goldens", &list), -1);
  cr_assert(strstr(tw_last_error(), "/nonexistent/goldens is not a directory") != NULL, "%s", tw_last_error());
  free(root);
}

Test(runner, case_name_is_area_and_case) {
  char buf[64];
  cr_assert_str_eq(tw_golden_case_name("/a/golden/data/gemm/x_1", buf, sizeof buf), "gemm/x_1");
  cr_assert_str_eq(tw_golden_case_name("data/quantize/y/", buf, sizeof buf), "quantize/y");
  cr_assert_str_eq(tw_golden_case_name("solo", buf, sizeof buf), "solo");
}

Test(runner, case_keys_parse_and_set) {
  char *dir = tt_make_tmpdir("keys");
  write_text(dir, "case.txt", "# comment\n\n  op = gemm  \nK=5\n");
  char path[1024];
  snprintf(path, sizeof path, "%s/case.txt", dir);
  tw_case_keys k;
  cr_assert_eq(tw_case_keys_parse_file(path, &k), TW_OK, "%s", tw_last_error());
  cr_assert_str_eq(tw_case_get(&k, "op"), "gemm");
  cr_assert_str_eq(tw_case_get(&k, "K"), "5");
  cr_assert_null(tw_case_get(&k, "N"));
  cr_assert_eq(tw_case_set(&k, "K", "7"), TW_OK);
  cr_assert_str_eq(tw_case_get(&k, "K"), "7");
  write_text(dir, "case.txt", "op = gemm\nK = 5 6\n");
  tt_expect_status(tw_case_keys_parse_file(path, &k), TW_ERR_IO, "case.txt:2: expected 'key = value' with a one-token value");
  free(dir);
}

/* ---- exec on the real ref backend --------------------------------------------------------------- */
typedef struct {
  tw_tensor x, gs, scale;
} mem_inputs;

static tw_status from_memory(void *user, const char *name, tw_tensor *out, int *found) {
  const mem_inputs *in = (const mem_inputs *)user;
  const tw_tensor *t = !strcmp(name, "x") ? &in->x : !strcmp(name, "group_sizes") ? &in->gs
                       : !strcmp(name, "scale") ? &in->scale : NULL;
  *found = t != NULL;
  if (!t) return TW_OK;
  *out = *t;
  size_t n = tw_tensor_bytes(t);
  out->data = malloc(n ? n : 1); /* exec owns (frees) what an input callback returns */
  memcpy(out->data, t->data, n);
  return TW_OK;
}

/* exec's quantize (the path of `twin op` and `twin check`) writes exactly what a direct call of
 * tw_grouped_quantize writes, with the shapes of tw_quantize_output_shapes, for every mode and
 * layout (the shared tensor-scale buffer included). */
Test(runner, exec_quantize_equals_the_direct_call_for_every_mode_and_layout) {
  tw_ctx *ctx = tt_ref_ctx();
  enum { M = 150, K = 40, G = 3 };
  static float x[M * K];
  int32_t gs[G] = {70, 0, 77};
  float scale[G] = {2, 4, 8};
  tt_fill_uniform_f32(x, M * K, 5, -3, 3);
  mem_inputs in = {tw_tensor_2d(x, TW_F32, M, K, TW_MEM_HOST), tw_tensor_1d(gs, TW_I32, G, TW_MEM_HOST),
                   tw_tensor_1d(scale, TW_F32, G, TW_MEM_HOST)};
  static const char *layouts[] = {"rowwise", "colwise", "rowwise_colwise"};
  static const tw_qlayout qlayouts[] = {TW_ROWWISE, TW_COLWISE, TW_ROWWISE_COLWISE};
  for (int mode = TW_SCALE_TENSOR_CURRENT; mode < TW_SCALE_COUNT; mode++)
    for (int l = 0; l < 3; l++) {
      tw_case_keys k;
      memset(&k, 0, sizeof k);
      tw_case_set(&k, "op", "grouped_quantize");
      tw_case_set(&k, "mode", tw_scaling_name((tw_scaling)mode));
      tw_case_set(&k, "layout", layouts[l]);
      tw_tensor_set outs;
      tw_tensor_set_init(&outs);
      cr_assert_eq(tw_exec_case(ctx, &k, from_memory, &in, &outs), TW_OK, "%s %s: %s",
                   tw_scaling_name((tw_scaling)mode), layouts[l], tw_last_error());
      /* the direct call, on buffers allocated from the same shapes */
      tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
      o.mode = (tw_scaling)mode;
      o.layout = qlayouts[l];
      o.scale = in.scale;
      tw_qtensor q;
      cr_assert_eq(tw_quantize_output_shapes(&o, M, K, G, &q), TW_OK);
      tw_tensor *parts[5] = {&q.row_data, &q.row_scale_inv, &q.col_data, &q.col_scale_inv, &q.amax};
      const char *names[5] = {"row_data", "row_scale_inv", "col_data", "col_scale_inv", "amax"};
      int shared = mode <= TW_SCALE_TENSOR_DELAYED && l == 2;
      for (int i = 0; i < 5; i++) {
        if (tw_tensor_is_none(parts[i])) continue;
        if (i == 3 && shared) { *parts[3] = q.row_scale_inv; continue; }
        size_t n = tw_tensor_bytes(parts[i]);
        parts[i]->data = malloc(n ? n : 1);
        memset(parts[i]->data, TW_POISON_BYTE, n);
      }
      cr_assert_eq(tw_grouped_quantize(ctx, &in.x, &in.gs, &o, &q), TW_OK, "%s", tw_last_error());
      int compared = 0;
      for (int i = 0; i < 5; i++) {
        if (tw_tensor_is_none(parts[i])) {
          cr_assert_null(tw_tensor_set_get(&outs, names[i]), "%s: exec wrote %s", layouts[l], names[i]);
          continue;
        }
        const tw_tensor *got = tw_tensor_set_get(&outs, names[i]);
        cr_assert_not_null(got, "%s %s: exec did not write %s", tw_scaling_name((tw_scaling)mode), layouts[l], names[i]);
        char what[96];
        snprintf(what, sizeof what, "%s %s %s", tw_scaling_name((tw_scaling)mode), layouts[l], names[i]);
        tt_expect_exact(got, parts[i], what); /* same dtype and shape, same bits */
        compared++;
      }
      cr_assert_geq(compared, 3);
      for (int i = 0; i < 5; i++)
        if (!(i == 3 && shared) && !tw_tensor_is_none(parts[i])) free(parts[i]->data);
      tw_tensor_set_free(&outs);
    }
  tw_ctx_destroy(ctx);
}
