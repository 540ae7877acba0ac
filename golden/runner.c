/* The golden runner (golden/runner.h): a case directory -> tw_exec_case -> the checker.
 * Exact comparison for quantize/dequantize/delayed-update outputs; GEMM outputs against
 * tw_gemm_error_bound(abs_prod, expected, bound_k, u_acc = 2^-24, out_dtype). */
#include "golden/runner.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "golden/exec.h"
#include "golden/routing.h"
#include "twin/tw_npy.h"

#define U_ACC_F32 (1.0 / 16777216.0) /* 2^-24: the f32 accumulator's unit roundoff */

typedef struct {
  const char *dir;
} dir_input;

static int file_exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static tw_status load_from_dir(void *user, const char *name, tw_tensor *out, int *found) {
  const dir_input *d = (const dir_input *)user;
  char path[1024];
  snprintf(path, sizeof path, "%s/%s.npy", d->dir, name);
  *found = 0;
  if (!file_exists(path)) return TW_OK;
  TW_TRY(tw_npy_load(path, out));
  *found = 1;
  return TW_OK;
}

const char *tw_golden_case_name(const char *dir, char *buf, size_t n) {
  size_t len = strlen(dir);
  while (len > 1 && dir[len - 1] == '/') len--;
  size_t i = len, slashes = 0;
  while (i > 0) {
    if (dir[i - 1] == '/' && ++slashes == 2) break;
    i--;
  }
  snprintf(buf, n, "%.*s", (int)(len - i), dir + i);
  return buf;
}

void tw_golden_record(tw_golden_result *res, const char *output, const tw_check_report *r) {
  int first = res->outputs == 0;
  res->outputs++;
  int take;
  if (!r->passed) take = res->passed; /* the first failing output */
  else take = res->passed && (first || r->worst_ratio > res->worst.worst_ratio);
  if (!r->passed) res->passed = 0;
  if (take) {
    res->worst = *r;
    snprintf(res->worst_output, sizeof res->worst_output, "%s", output);
    char line[400];
    tw_check_format(r, line, sizeof line);
    snprintf(res->detail, sizeof res->detail, "%s: %s", output, line);
  }
}

/* Expected file as got's dtype and shape (same bytes; codes are stored as integers). */
static tw_status expected_like(const char *name, const tw_tensor *got, tw_tensor *exp) {
  char a[96], b[96];
  if (tw_dtype_bits(exp->dtype) != tw_dtype_bits(got->dtype) ||
      tw_tensor_numel(exp) != tw_tensor_numel(got))
    return tw_error(TW_ERR_SHAPE, "%s: expected file is %s but the output is %s", name,
                    tw_tensor_str(exp, a, sizeof a), tw_tensor_str(got, b, sizeof b));
  exp->dtype = got->dtype;
  exp->ndim = got->ndim;
  for (int d = 0; d < TW_MAX_DIMS; d++) exp->shape[d] = got->shape[d];
  return TW_OK;
}

static tw_status compare_exact(const char *dir, const tw_tensor_set *outs, const char *op,
                               tw_golden_result *res) {
  /* every file an op can produce must match what it produced, both ways */
  static const char *quantize_names[] = {"row_data", "row_scale_inv", "col_data", "col_scale_inv", "amax", NULL};
  static const char *dequant_names[] = {"out", NULL};
  static const char *delayed_names[] = {"amax_history_out", "scale_out", NULL};
  const char **names = strcmp(op, "grouped_quantize") == 0 ? quantize_names
                       : strcmp(op, "grouped_dequantize") == 0 ? dequant_names : delayed_names;
  char path[1024];
  for (int i = 0; names[i]; i++) {
    snprintf(path, sizeof path, "%s/%s.npy", dir, names[i]);
    if (file_exists(path) && !tw_tensor_set_get(outs, names[i]))
      return tw_error(TW_ERR_IO, "%s.npy is in the case but the operation does not produce it "
                      "(check the case's layout keys)", names[i]);
  }
  for (int i = 0; i < outs->n; i++) {
    snprintf(path, sizeof path, "%s/%s.npy", dir, outs->name[i]);
    if (!file_exists(path)) {
      if (outs->optional[i]) continue;
      return tw_error(TW_ERR_IO, "the case lacks %s.npy for output '%s'", outs->name[i], outs->name[i]);
    }
    tw_tensor exp;
    TW_TRY(tw_npy_load(path, &exp));
    tw_status s = expected_like(outs->name[i], &outs->t[i], &exp);
    tw_check_report r;
    if (s == TW_OK) s = tw_check_exact(&outs->t[i], &exp, &r);
    free(exp.data);
    TW_TRY(s);
    tw_golden_record(res, outs->name[i], &r);
  }
  return TW_OK;
}

/* tw_gemm.h: on a gpu backend, a grouped fp8 forward (per-tensor, 1x128 / 128x128 blocks or
 * MXFP8, rhs_op T) may run gg_wgmma_fp8 (auto on sm_90), whose accumulation model is promoted
 * every 128 along K (MXFP8: every 32; the value returned, 0 for the exact model) with a 14-bit
 * inner accumulator: such cases are checked against that model's bound.
 * So may a dense fp8 gemm (a op N, b op T, K % 16 == 0: gg_wgmma_fp8 as one group; the goldens
 * before MXFP8 never reached it with a bound the exact model missed, qgemm_mxfp8_NT_e4m3xe5m2
 * did: run mx1, bf16 out, err 0.25 > 0.231).
 * So may a grouped fp8 wgrad from the per-group transposed colwise copies (lhs_op = rhs_op = T;
 * auto for every per-tensor and block mode): the same model over each group's tokens,
 * bound_k (the largest group) for K; and an MXFP8 wgrad from the colwise [M, K] / [M, N] data
 * (lhs_op = rhs_op = N, auto): promoted every 32 tokens. A grouped MXFP8 forward whose rhs is the
 * colwise [G*K, N] data (rhs_op N) runs it too, through a K-major copy: promoted every 32. */
static int fp8_promoted_model(const tw_ctx *ctx, const tw_case_keys *k) {
  const int dense = tw_case_get(k, "op") && !strcmp(tw_case_get(k, "op"), "gemm");
  const char *op = tw_case_get(k, "op"), *m = tw_case_get(k, dense ? "a_mode" : "lhs_mode"),
             *r = tw_case_get(k, dense ? "op_b" : "rhs_op");
  if (!ctx || tw_ctx_backend(ctx) == TW_BACKEND_REF || !op || !m || !r) return 0;
  if (dense) { /* dense fp8 tw_gemm: gg_wgmma_fp8 as one group where it takes a op N, b op T, K % 16 */
    const char *a = tw_case_get(k, "op_a"), *K = tw_case_get(k, "K");
    if (!a || strcmp(a, "N") || strcmp(r, "T") || !K || atoll(K) % 16) return 0;
    if (!strcmp(m, "mxfp8")) return 32;
    return !strcmp(m, "current") || !strcmp(m, "delayed") || !strcmp(m, "block1x128") || !strcmp(m, "block128x128")
               ? 128
               : 0;
  }
  const int mode_ok =
      !strcmp(m, "current") || !strcmp(m, "delayed") || !strcmp(m, "block1x128") || !strcmp(m, "block128x128");
  if (!strcmp(op, "grouped_gemm_wgrad")) { /* auto: every fp8 mode */
    const char *l = tw_case_get(k, "lhs_op");
    if (!strcmp(m, "mxfp8")) return l && !strcmp(l, "N") && !strcmp(r, "N") ? 32 : 0; /* colwise [M, K] data */
    return mode_ok && l && !strcmp(l, "T") && !strcmp(r, "T") ? 128 : 0;
  }
  if (strcmp(op, "grouped_gemm")) return 0;
  const char *K = tw_case_get(k, "K"), *rc = tw_case_get(k, "rhs_colwise");
  if (!K || atoll(K) % 16) return 0; /* what gg_wgmma_fp8_takes declines keeps the exact model */
  /* MXFP8 rhs as the colwise [G*K, N] data, op N: transposed into the K-major copy, same model */
  if (!strcmp(m, "mxfp8")) return !strcmp(r, "T") || (!strcmp(r, "N") && rc && atoi(rc) == 1) ? 32 : 0;
  if (strcmp(r, "T")) return 0;
  return mode_ok ? 128 : 0;
}

static tw_status compare_gemm(const char *dir, const tw_case_keys *k, const tw_tensor_set *outs, int promoted,
                              tw_golden_result *res) {
  const tw_tensor *got = tw_tensor_set_get(outs, "out");
  if (!got) return tw_error(TW_ERR_INTERNAL, "gemm produced no 'out'");
  const char *ks = tw_case_get(k, "bound_k");
  if (!ks) ks = tw_case_get(k, "K");
  if (!ks) return tw_error(TW_ERR_IO, "case.txt has neither 'bound_k' nor 'K' (the contraction length for the bound)");
  char *end;
  long long K = strtoll(ks, &end, 10);
  if (*end || K < 0) return tw_error(TW_ERR_IO, "case.txt: bound_k '%s' is not a non-negative integer", ks);
  char path[1024];
  tw_tensor exp = tw_tensor_none(), absp = tw_tensor_none();
  snprintf(path, sizeof path, "%s/expected.npy", dir);
  TW_TRY(tw_npy_load(path, &exp));
  /* the promoted model takes the lifted magnitudes (subnormal codes at the smallest normal,
   * tw_check.h): abs_prod_lifted.npy, written for every quantized case */
  snprintf(path, sizeof path, "%s/%s.npy", dir, promoted ? "abs_prod_lifted" : "abs_prod");
  tw_status s = tw_npy_load(path, &absp);
  double *bound = NULL;
  int64_t n = tw_tensor_numel(got);
  char a[96], b[96];
  if (s == TW_OK && (exp.dtype != TW_F64 || absp.dtype != TW_F64))
    s = tw_error(TW_ERR_IO, "expected.npy (%s) and %s.npy (%s) must be f64", tw_dtype_name(exp.dtype),
                 promoted ? "abs_prod_lifted" : "abs_prod", tw_dtype_name(absp.dtype));
  if (s == TW_OK && (tw_tensor_numel(&exp) != n || tw_tensor_numel(&absp) != n))
    s = tw_error(TW_ERR_IO, "expected.npy is %s and %s.npy has %lld elements, the output is %s",
                 tw_tensor_str(&exp, a, sizeof a), promoted ? "abs_prod_lifted" : "abs_prod",
                 (long long)tw_tensor_numel(&absp),
                 tw_tensor_str(got, b, sizeof b));
  if (s == TW_OK && n > 0 && !(bound = (double *)malloc((size_t)n * sizeof(double))))
    s = tw_error(TW_ERR_MEMORY, "out of memory for %lld bounds", (long long)n);
  if (s == TW_OK) {
    if (promoted)
      tw_gemm_error_bound_promoted((const double *)absp.data, (const double *)exp.data, n, K, promoted, 0x1p-13,
                                   U_ACC_F32, 2, got->dtype, bound);
    else
      tw_gemm_error_bound((const double *)absp.data, (const double *)exp.data, n, K, U_ACC_F32, got->dtype,
                          bound);
    exp.ndim = got->ndim;
    for (int d = 0; d < TW_MAX_DIMS; d++) exp.shape[d] = got->shape[d];
    tw_tensor bt = tw_tensor_1d(bound, TW_F64, n, TW_MEM_HOST);
    tw_check_report r;
    s = tw_check_bound(got, &exp, &bt, &r);
    if (s == TW_OK) tw_golden_record(res, "out", &r);
  }
  free(bound);
  free(exp.data);
  free(absp.data);
  return s;
}

tw_status tw_golden_run_case(tw_ctx *ctx, const char *case_dir, tw_golden_result *res) {
  if (!res) return tw_error(TW_ERR_NULL, "golden: result is NULL");
  memset(res, 0, sizeof *res);
  res->worst.worst_index = -1;
  if (!ctx || !case_dir) return tw_error(TW_ERR_NULL, "golden: ctx or case_dir is NULL");
  tw_golden_case_name(case_dir, res->name, sizeof res->name);
  char path[1024];
  snprintf(path, sizeof path, "%s/case.txt", case_dir);
  tw_case_keys *k = (tw_case_keys *)calloc(1, sizeof *k);
  tw_tensor_set *outs = (tw_tensor_set *)calloc(1, sizeof *outs);
  tw_status s = (k && outs) ? TW_OK : tw_error(TW_ERR_MEMORY, "golden: out of memory");
  if (s == TW_OK) s = tw_case_keys_parse_file(path, k);
  if (s == TW_OK) {
    snprintf(res->op, sizeof res->op, "%s", tw_case_get(k, "op"));
    /* amax is optional for block modes: compare it only where the case stores it */
    snprintf(path, sizeof path, "%s/amax.npy", case_dir);
    if (strcmp(res->op, "grouped_quantize") == 0) s = tw_case_set(k, "amax", file_exists(path) ? "1" : "0");
  }
  dir_input in = {case_dir};
  res->passed = 1;
  int routing = s == TW_OK && (strcmp(res->op, "router") == 0 || strcmp(res->op, "ep") == 0);
  if (routing) /* runs and compares itself (golden/routing.c) */
    s = strcmp(res->op, "router") == 0 ? tw_golden_run_router(ctx, case_dir, k, res) : tw_golden_run_ep(ctx, case_dir, k, res);
  else if (s == TW_OK) s = tw_exec_case(ctx, k, load_from_dir, &in, outs);
  if (s == TW_OK && res->skipped) { /* not run: TW_ERR_UNSUPPORTED, as a kernel that does not take a case */
    res->passed = 0;
    s = tw_error(TW_ERR_UNSUPPORTED, "%s", res->detail);
  } else if (s == TW_OK && !routing) {
    if (tw_exec_op_is_gemm(res->op)) s = compare_gemm(case_dir, k, outs, fp8_promoted_model(ctx, k), res);
    else s = compare_exact(case_dir, outs, res->op, res);
  }
  if (s == TW_OK && !res->skipped && res->outputs == 0) s = tw_error(TW_ERR_IO, "golden: the case compared no outputs");
  if (s != TW_OK && !res->skipped) {
    res->passed = 0;
    snprintf(res->detail, sizeof res->detail, "ERROR %s: %s", tw_status_name(s), tw_last_error());
  }
  if (outs) tw_tensor_set_free(outs);
  free(outs);
  free(k);
  return s;
}

/* ---- listing ------------------------------------------------------------------------------- */
typedef struct {
  char **v;
  int n, cap;
} str_list;

static int push(str_list *l, const char *s) {
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 64;
    char **nv = (char **)realloc(l->v, (size_t)cap * sizeof *nv);
    if (!nv) return -1;
    l->v = nv;
    l->cap = cap;
  }
  if (!(l->v[l->n] = strdup(s))) return -1;
  l->n++;
  return 0;
}

static int walk(const char *dir, str_list *l, int depth) {
  char path[1024];
  snprintf(path, sizeof path, "%s/case.txt", dir);
  if (file_exists(path)) return push(l, dir);
  if (depth > 8) return 0;
  DIR *d = opendir(dir);
  if (!d) return 0;
  struct dirent *e;
  int rc = 0;
  while (rc == 0 && (e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) rc = walk(path, l, depth + 1);
  }
  closedir(d);
  return rc;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int tw_golden_list_cases(const char *root, char ***dirs) {
  if (!root || !dirs) {
    tw_error(TW_ERR_NULL, "golden_list_cases: NULL argument");
    return -1;
  }
  *dirs = NULL;
  struct stat st;
  if (stat(root, &st) != 0 || !S_ISDIR(st.st_mode)) {
    tw_error(TW_ERR_IO, "golden_list_cases: %s is not a directory (%s)", root,
             errno ? strerror(errno) : "not a directory");
    return -1;
  }
  str_list l = {0};
  if (walk(root, &l, 0) != 0) {
    tw_golden_free_list(l.v, l.n);
    tw_error(TW_ERR_MEMORY, "golden_list_cases: out of memory");
    return -1;
  }
  if (l.n) qsort(l.v, (size_t)l.n, sizeof *l.v, cmp_str);
  *dirs = l.v;
  return l.n;
}

void tw_golden_free_list(char **dirs, int n) {
  if (!dirs) return;
  for (int i = 0; i < n; i++) free(dirs[i]);
  free(dirs);
}
