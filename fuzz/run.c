/* Running one case: the backend under test ("subject") and the oracle (ref), every
 * comparison through the one checker (tw_check_exact / tw_check_bound).
 *
 * Checks per op (subject = oracle for --backend ref: self-consistency only):
 *   quantize  vs_oracle:<component> exact; dequantize error within the format's bound
 *             (row/col); the tail rows untouched; amax = max|x|; tensor scale_inv by the
 *             formula; swizzled vs compact scales dequantize identically; rowwise vs colwise
 *             agree where they share scales (tensor, 128x128).
 *   cast      vs_oracle exact; every element equals the scalar encoder's code.
 *   gemm family  out vs the exact f64 product (bound from K, dtypes, sum |a||b|) for subject
 *             and oracle; grouped vs per-group dense tw_gemm; wgrad vs dense on slices.
 * Inputs of GEMMs are quantized once by the oracle, so both sides see identical operands.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_internal.h"
#include "ops/data.h"
#include "twin/tw_numerics.h"

/* ---- allocation bookkeeping: everything a case allocates is freed at its end ---- */
#define ARENA_MAX 256
typedef struct {
  tw_ctx *ctx[ARENA_MAX]; /* NULL: host malloc */
  void *p[ARENA_MAX];
  int n;
} arena;

static void arena_free(arena *A) {
  for (int i = A->n - 1; i >= 0; i--) {
    if (A->ctx[i]) tw_free(A->ctx[i], A->p[i]);
    else free(A->p[i]);
  }
  A->n = 0;
}

static tw_status arena_alloc(arena *A, tw_ctx *ctx, size_t bytes, void **out) {
  *out = NULL;
  if (A->n >= ARENA_MAX) return tw_error(TW_ERR_INTERNAL, "fuzz: too many buffers in one case");
  if (bytes == 0) bytes = 16; /* a valid pointer even for empty tensors */
  void *p = NULL;
  if (ctx) {
    TW_TRY(tw_alloc(ctx, bytes, &p));
  } else {
    p = malloc(bytes);
    if (!p) return tw_error(TW_ERR_MEMORY, "fuzz: out of host memory (%zu bytes)", bytes);
  }
  A->ctx[A->n] = ctx;
  A->p[A->n++] = p;
  *out = p;
  return TW_OK;
}


/* A host tensor like `like` (dtype, shape), poisoned. */
static tw_status host_like(arena *A, const tw_tensor *like, tw_tensor *out) {
  void *p;
  size_t bytes = tw_tensor_bytes(like);
  TW_TRY(arena_alloc(A, NULL, bytes, &p));
  memset(p, TW_POISON_BYTE, bytes ? bytes : 16);
  *out = *like;
  out->data = p;
  out->mem = TW_MEM_HOST;
  return TW_OK;
}

/* A tensor like `like` in ctx's memory, poisoned. */
static tw_status ctx_like(arena *A, tw_ctx *ctx, const tw_tensor *like, tw_tensor *out) {
  void *p;
  size_t bytes = tw_tensor_bytes(like);
  TW_TRY(arena_alloc(A, ctx, bytes, &p));
  TW_TRY(tw_memset(ctx, p, TW_POISON_BYTE, bytes ? bytes : 16));
  *out = *like;
  out->data = p;
  out->mem = tw_ctx_mem(ctx);
  return TW_OK;
}

static tw_status to_ctx(arena *A, tw_ctx *ctx, const tw_tensor *host, tw_tensor *dev) {
  if (tw_tensor_is_none(host)) { *dev = *host; return TW_OK; }
  TW_TRY(ctx_like(A, ctx, host, dev));
  if (tw_tensor_bytes(host) == 0) return TW_OK;
  return tw_tensor_copy(ctx, dev, host);
}

static tw_status to_host(arena *A, tw_ctx *ctx, const tw_tensor *dev, tw_tensor *host) {
  if (tw_tensor_is_none(dev)) { *host = *dev; return TW_OK; }
  TW_TRY(host_like(A, dev, host));
  if (tw_tensor_bytes(dev) == 0) return TW_OK;
  return tw_tensor_copy(ctx, host, dev);
}

/* Host tensor of dtype t holding f32 values v (codes via the numerics encoders). */
static tw_status host_from_f32(arena *A, tw_dtype t, int ndim, const int64_t *shape,
                               const float *v, tw_tensor *out) {
  tw_tensor like = tw_tensor_of(NULL, t, ndim, shape, TW_MEM_HOST);
  TW_TRY(host_like(A, &like, out));
  int64_t n = tw_tensor_numel(out);
  if (t == TW_E2M1) memset(out->data, 0, tw_tensor_bytes(out));
  for (int64_t i = 0; i < n; i++) {
    if (t == TW_E8M0) { /* exact powers of two (or NaN) from the generator */
      uint8_t code = 0xFF;
      if (!isnan(v[i])) { int e; frexpf(v[i], &e); code = (uint8_t)(e - 1 + 127); }
      ((uint8_t *)out->data)[i] = code;
    } else {
      tw_store_from_f64(out->data, t, i, (double)v[i], 0);
    }
  }
  return TW_OK;
}

/* ---- results ---- */
static fz_check *add_check(fz_result *res, const char *name) {
  if (res->nchecks >= FZ_MAX_CHECKS) return NULL;
  fz_check *c = &res->checks[res->nchecks++];
  memset(c, 0, sizeof *c);
  snprintf(c->name, sizeof c->name, "%s", name);
  return c;
}

static void fail(fz_result *res, fz_verdict v, const char *name, const char *msg) {
  if (res->verdict == FZ_PASS) {
    res->verdict = v;
    snprintf(res->first_failure, sizeof res->first_failure, "%s", name);
    snprintf(res->message, sizeof res->message, "%s: %s", name, msg);
  }
}

static void record(fz_result *res, const char *name, tw_status s, const tw_check_report *rep) {
  fz_check *c = add_check(res, name);
  if (s != TW_OK) {
    char m[400];
    snprintf(m, sizeof m, "checker error %s: %s", tw_status_name(s), tw_last_error());
    if (c) snprintf(c->line, sizeof c->line, "%.300s", m);
    fail(res, FZ_ERROR, name, m);
    return;
  }
  if (c) {
    c->rep = *rep;
    tw_check_format(rep, c->line, sizeof c->line);
  }
  if (!rep->passed) {
    if (res->verdict == FZ_PASS) res->severity = rep->worst_ratio > 1e30 ? 2 : rep->worst_ratio > 4 ? 1 : 0;
    char line[320];
    tw_check_format(rep, line, sizeof line);
    fail(res, FZ_FAIL, name, line);
  }
}

static void check_exact(fz_result *res, const char *name, const tw_tensor *got, const tw_tensor *exp) {
  tw_check_report rep;
  memset(&rep, 0, sizeof rep);
  tw_status s = tw_check_exact(got, exp, &rep);
  record(res, name, s, &rep);
}

static void check_bound(fz_result *res, const char *name, const tw_tensor *got, const tw_tensor *exp,
                        const tw_tensor *bound) {
  tw_check_report rep;
  memset(&rep, 0, sizeof rep);
  tw_status s = tw_check_bound(got, exp, bound, &rep);
  record(res, name, s, &rep);
}

/* Equal values (NaN meets NaN, payloads free): bound mode with a zero bound. */
static tw_status zero_bound(arena *A, const tw_tensor *like, tw_tensor *out) {
  int64_t n = tw_tensor_numel(like);
  int64_t shape[1] = {n};
  tw_tensor b = tw_tensor_of(NULL, TW_F64, 1, shape, TW_MEM_HOST);
  TW_TRY(host_like(A, &b, out));
  memset(out->data, 0, sizeof(double) * (size_t)(n ? n : 1));
  return TW_OK;
}

static void check_equal_values(arena *A, fz_result *res, const char *name, const tw_tensor *got,
                               const tw_tensor *exp) {
  tw_tensor b;
  if (zero_bound(A, got, &b) != TW_OK) { fail(res, FZ_ERROR, name, tw_last_error()); return; }
  check_bound(res, name, got, exp, &b);
}

/* A status the subject returned where the oracle succeeded (or the reverse). */
static int status_check(fz_result *res, const char *what, tw_status s) {
  if (s == TW_OK) return 0;
  char m[400];
  if (s == TW_ERR_ALIGNMENT) { /* a rule the backend states (tw_gemm_alignment): not a failure */
    fz_check *c = add_check(res, "alignment_rule");
    if (c) snprintf(c->line, sizeof c->line, "SKIP %.280s", tw_last_error());
    return 1;
  }
  snprintf(m, sizeof m, "%s returned %s: %s", what, tw_status_name(s), tw_last_error());
  fz_check *c = add_check(res, "status");
  if (c) snprintf(c->line, sizeof c->line, "%.300s", m);
  fail(res, FZ_FAIL, "status", m);
  return 1;
}

static float poison_f32(void) {
  uint32_t u;
  memset(&u, TW_POISON_BYTE, 4);
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ======================================================================================
 * quantize
 * ====================================================================================== */
typedef struct {
  tw_qtensor q; /* host copies of every component */
} qresult;

static int is_tensor_mode(tw_scaling m) {
  return m == TW_SCALE_TENSOR_CURRENT || m == TW_SCALE_TENSOR_DELAYED;
}

/* Quantizes host x on ctx; all components (amax included) come back as host copies. */
static tw_status quantize_on(tw_ctx *ctx, arena *A, const tw_tensor *x_host, const int32_t *gs,
                             int64_t G, const tw_quantize_opts *opts, const float *scale,
                             tw_qtensor *out, int want_amax) {
  int64_t M = x_host->shape[0], K = x_host->shape[1];
  tw_qtensor shp, q;
  TW_TRY(tw_quantize_output_shapes(opts, M, K, G, &shp));
  q = shp;
  if (is_tensor_mode(opts->mode) && !tw_tensor_is_none(&q.row_scale_inv))
    q.col_scale_inv = tw_tensor_none(); /* one shared scale buffer */
  if (!want_amax && !is_tensor_mode(opts->mode)) q.amax = tw_tensor_none();
  tw_tensor *parts[5] = {&q.row_data, &q.row_scale_inv, &q.col_data, &q.col_scale_inv, &q.amax};
  for (int i = 0; i < 5; i++)
    if (!tw_tensor_is_none(parts[i])) TW_TRY(ctx_like(A, ctx, parts[i], parts[i]));
  tw_tensor xd, gsd;
  TW_TRY(to_ctx(A, ctx, x_host, &xd));
  int64_t gshape[1] = {G};
  tw_tensor gsh = tw_tensor_of((void *)gs, TW_I32, 1, gshape, TW_MEM_HOST);
  TW_TRY(to_ctx(A, ctx, &gsh, &gsd));
  tw_quantize_opts o = *opts;
  if (opts->mode == TW_SCALE_TENSOR_DELAYED) {
    tw_tensor sh = tw_tensor_of((void *)scale, TW_F32, 1, gshape, TW_MEM_HOST);
    TW_TRY(to_ctx(A, ctx, &sh, &o.scale));
  }
  TW_TRY(tw_grouped_quantize(ctx, &xd, &gsd, &o, &q));
  TW_TRY(tw_ctx_check(ctx));
  *out = q;
  tw_tensor *oparts[5] = {&out->row_data, &out->row_scale_inv, &out->col_data, &out->col_scale_inv,
                          &out->amax};
  for (int i = 0; i < 5; i++) TW_TRY(to_host(A, ctx, parts[i], oparts[i]));
  return TW_OK;
}

/* Dequantizes host q (one orientation) on the oracle into a poisoned f32 [M, K]. */
static tw_status dequantize_host(tw_ctx *oracle, arena *A, const tw_qtensor *q, const int32_t *gs,
                                 int64_t G, int colwise, tw_tensor *out) {
  int64_t shape[2] = {q->rows, q->cols};
  tw_tensor like = tw_tensor_of(NULL, TW_F32, 2, shape, TW_MEM_HOST);
  TW_TRY(host_like(A, &like, out));
  int64_t gshape[1] = {G};
  tw_tensor gst = tw_tensor_of((void *)gs, TW_I32, 1, gshape, TW_MEM_HOST);
  return tw_grouped_dequantize(oracle, q, &gst, colwise, out);
}

/* Per-element scale_inv of one orientation: dequantize a copy whose codes all mean 1.0. */
static tw_status scale_map(tw_ctx *oracle, arena *A, const tw_qtensor *q, const int32_t *gs,
                           int64_t G, int colwise, tw_tensor *out) {
  tw_qtensor ones = *q;
  tw_tensor *d = colwise ? &ones.col_data : &ones.row_data;
  const tw_tensor *src = colwise ? &q->col_data : &q->row_data;
  TW_TRY(host_like(A, src, d));
  uint8_t one = q->qdtype == TW_E4M3 ? 0x38 : 0x3C;
  memset(d->data, one, tw_tensor_bytes(src) ? tw_tensor_bytes(src) : 1);
  return dequantize_host(oracle, A, &ones, gs, G, colwise, out);
}

static double fp8_max(tw_dtype q) { return q == TW_E4M3 ? 448.0 : 57344.0; }
static double fp8_u(tw_dtype q) { return q == TW_E4M3 ? 0.0625 : 0.125; }        /* 2^-(m+1) */
static double fp8_sub(tw_dtype q) { return q == TW_E4M3 ? 0x1p-9 : 0x1p-16; }    /* min subnormal */

/* compute_scale of tw_quantize.h, in f32. */
static float compute_scale(float amax, float qmax, int pow2) {
  if (amax == 0.0f || !isfinite(amax)) return 1.0f;
  float s = qmax / amax;
  if (isinf(s)) s = FLT_MAX;
  if (pow2) {
    uint32_t u;
    memcpy(&u, &s, 4);
    u &= 0xFF800000u;
    memcpy(&s, &u, 4);
  }
  return s;
}

/* dequantize(q) against x: |x' - clip(x)| <= u_q |clip(x)| + sub_q/2 * s + f32 slack. */
static void check_dequant_bound(tw_ctx *oracle, arena *A, fz_result *res, const char *name,
                                const fz_case *c, const float *x, const tw_qtensor *q, int colwise,
                                int64_t S) {
  tw_tensor deq, smap, exp, bnd;
  tw_status s;
  if ((s = dequantize_host(oracle, A, q, c->group_sizes, c->G, colwise, &deq)) != TW_OK ||
      (s = scale_map(oracle, A, q, c->group_sizes, c->G, colwise, &smap)) != TW_OK) {
    fail(res, FZ_ERROR, name, tw_last_error());
    return;
  }
  int64_t n = c->M * c->K, shape[2] = {c->M, c->K};
  tw_tensor l64 = tw_tensor_of(NULL, TW_F64, 2, shape, TW_MEM_HOST);
  if (host_like(A, &l64, &exp) != TW_OK || host_like(A, &l64, &bnd) != TW_OK) {
    fail(res, FZ_ERROR, name, tw_last_error());
    return;
  }
  double *e = exp.data, *b = bnd.data;
  const float *sm = smap.data;
  float qmax = (float)fp8_max(c->qdtype);
  for (int64_t i = 0; i < n; i++) {
    if (i >= S * c->K) { e[i] = poison_f32(); b[i] = -1; continue; } /* the tail: untouched */
    float sv = sm[i], xv = x[i];
    b[i] = 0;
    if (isnan(sv) || isnan(xv)) { e[i] = NAN; continue; }
    float lim = qmax * sv; /* f32, as the dequantizer computes it */
    double v = xv;
    if (v > lim) v = lim;
    if (v < -lim) v = -lim;
    e[i] = v;
    if (isinf(v)) continue;
    b[i] = fp8_u(c->qdtype) * fabs(v) + 0.5 * fp8_sub(c->qdtype) * sv + 0x1p-20 * fabs((double)xv);
  }
  check_bound(res, name, &deq, &exp, &bnd);
}

/* Bytes past the groups must still hold the poison. */
static void check_tail(arena *A, fz_result *res, const char *name, const tw_tensor *data,
                       int64_t first_untouched) {
  tw_tensor exp;
  if (host_like(A, data, &exp) != TW_OK) { fail(res, FZ_ERROR, name, tw_last_error()); return; }
  size_t bytes = tw_tensor_bytes(data);
  memcpy(exp.data, data->data, bytes);
  size_t from = tw_dtype_storage_bytes(data->dtype, first_untouched);
  if (from < bytes) memset((char *)exp.data + from, TW_POISON_BYTE, bytes - from);
  check_exact(res, name, data, &exp);
}

static void qopts_of(const fz_case *c, tw_quantize_opts *o) {
  tw_quantize_opts d = TW_QUANTIZE_OPTS_INIT;
  *o = d;
  o->mode = c->mode;
  o->qdtype = c->qdtype;
  o->layout = c->layout;
  o->pow2_scales = c->pow2;
  o->mxfp8_swizzled = c->swizzled;
}

static void run_quantize(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, arena *A, fz_result *res) {
  int64_t shape[2] = {c->M, c->K};
  tw_tensor x;
  if (host_from_f32(A, c->x_dtype, 2, shape, c->x, &x) != TW_OK) {
    fail(res, FZ_ERROR, "setup", tw_last_error());
    return;
  }
  tw_quantize_opts o;
  qopts_of(c, &o);
  int differential = subject != oracle;
  tw_qtensor qo, qs;
  if (differential) {
    tw_status s = quantize_on(oracle, A, &x, c->group_sizes, c->G, &o, c->scale, &qo, 1);
    if (s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  }
  tw_status s = quantize_on(subject, A, &x, c->group_sizes, c->G, &o, c->scale, &qs, 1);
  if (!differential && s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  if (status_check(res, "grouped_quantize", s)) return;

  static const char *names[5] = {"row_data", "row_scale_inv", "col_data", "col_scale_inv", "amax"};
  tw_tensor *ps[5] = {&qs.row_data, &qs.row_scale_inv, &qs.col_data, &qs.col_scale_inv, &qs.amax};
  tw_tensor *po[5] = {&qo.row_data, &qo.row_scale_inv, &qo.col_data, &qo.col_scale_inv, &qo.amax};
  if (differential)
    for (int i = 0; i < 5; i++) {
      if (tw_tensor_is_none(ps[i])) continue;
      char nm[64];
      snprintf(nm, sizeof nm, "vs_oracle:%s", names[i]);
      if (ps[i]->dtype == TW_F32) check_equal_values(A, res, nm, ps[i], po[i]);
      else check_exact(res, nm, ps[i], po[i]);
    }

  /* self-consistency of the subject's output */
  int64_t S = 0;
  for (int64_t g = 0; g < c->G; g++) S += c->group_sizes[g];
  int row = (c->layout & TW_ROWWISE) != 0, col = (c->layout & TW_COLWISE) != 0;
  if (row) {
    check_dequant_bound(oracle, A, res, "dequant_bound:row", c, c->x, &qs, 0, S);
    check_tail(A, res, "tail_untouched:row_data", &qs.row_data, S * c->K);
  }
  if (col) {
    check_dequant_bound(oracle, A, res, "dequant_bound:col", c, c->x, &qs, 1, S);
    check_tail(A, res, "tail_untouched:col_data", &qs.col_data, S * c->K);
  }
  /* amax per group, and tensor scales by their formula */
  int64_t gshape[1] = {c->G};
  tw_tensor ea, es;
  tw_tensor l32 = tw_tensor_of(NULL, TW_F32, 1, gshape, TW_MEM_HOST);
  if (host_like(A, &l32, &ea) != TW_OK || host_like(A, &l32, &es) != TW_OK) return;
  float *eav = ea.data, *esv = es.data;
  const float *xin = c->x;
  int64_t o0 = 0;
  for (int64_t g = 0; g < c->G; g++) {
    float m = 0.0f;
    for (int64_t i = o0 * c->K; i < (o0 + c->group_sizes[g]) * c->K; i++) {
      float a = fabsf(xin[i]);
      if (isnan(a) || isnan(m)) m = NAN;
      else if (a > m) m = a;
    }
    eav[g] = m;
    float sc = c->mode == TW_SCALE_TENSOR_DELAYED ? c->scale[g]
                                                 : compute_scale(m, (float)fp8_max(c->qdtype), c->pow2);
    esv[g] = 1.0f / sc;
    o0 += c->group_sizes[g];
  }
  if (!tw_tensor_is_none(&qs.amax)) check_equal_values(A, res, "amax_is_max_abs", &qs.amax, &ea);
  if (is_tensor_mode(c->mode)) {
    const tw_tensor *si = row ? &qs.row_scale_inv : &qs.col_scale_inv;
    check_equal_values(A, res, "tensor_scale_inv_formula", si, &es);
  }
  /* rowwise and colwise share their scales in tensor and 128x128 modes: same values */
  if (row && col && (is_tensor_mode(c->mode) || c->mode == TW_SCALE_BLOCK_128x128)) {
    tw_tensor dr, dc;
    if (dequantize_host(oracle, A, &qs, c->group_sizes, c->G, 0, &dr) == TW_OK &&
        dequantize_host(oracle, A, &qs, c->group_sizes, c->G, 1, &dc) == TW_OK)
      check_equal_values(A, res, "rowwise_vs_colwise", &dc, &dr);
  }
  /* MXFP8: the other scale order must dequantize to the same values */
  if (c->mode == TW_SCALE_MXFP8_1D) {
    tw_quantize_opts o2 = o;
    o2.mxfp8_swizzled = !o.mxfp8_swizzled;
    tw_qtensor q2;
    s = quantize_on(subject, A, &x, c->group_sizes, c->G, &o2, c->scale, &q2, 0);
    if (status_check(res, "grouped_quantize (other scale order)", s)) return;
    for (int cw = 0; cw < 2; cw++) {
      if (!(cw ? col : row)) continue;
      tw_tensor d1, d2;
      if (dequantize_host(oracle, A, &qs, c->group_sizes, c->G, cw, &d1) == TW_OK &&
          dequantize_host(oracle, A, &q2, c->group_sizes, c->G, cw, &d2) == TW_OK)
        check_equal_values(A, res, cw ? "swizzled_vs_compact:col" : "swizzled_vs_compact:row", &d2, &d1);
      check_exact(res, cw ? "swizzle_same_codes:col" : "swizzle_same_codes:row",
                  cw ? &q2.col_data : &q2.row_data, cw ? &qs.col_data : &qs.row_data);
    }
  }
}

/* ======================================================================================
 * cast
 * ====================================================================================== */
static void run_cast(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, arena *A, fz_result *res) {
  int64_t shape[2] = {c->M, c->K};
  tw_tensor src, sd, dd, got, exp;
  tw_tensor dl = tw_tensor_of(NULL, c->dst_dtype, 2, shape, TW_MEM_HOST);
  if (host_from_f32(A, c->x_dtype, 2, shape, c->x, &src) != TW_OK || host_like(A, &dl, &exp) != TW_OK) {
    fail(res, FZ_ERROR, "setup", tw_last_error());
    return;
  }
  int64_t n = c->M * c->K;
  if (c->dst_dtype == TW_E2M1) memset(exp.data, 0, tw_tensor_bytes(&exp));
  for (int64_t i = 0; i < n; i++)
    tw_store_from_f64(exp.data, c->dst_dtype, i, tw_load_as_f64(src.data, c->x_dtype, i), c->saturate);
  tw_tensor ores;
  if (subject != oracle) {
    tw_tensor od;
    if (host_like(A, &dl, &od) != TW_OK) return;
    tw_status s = tw_cast(oracle, &od, &src, c->saturate);
    if (s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
    ores = od;
  }
  tw_status s = to_ctx(A, subject, &src, &sd);
  if (s == TW_OK) s = ctx_like(A, subject, &dl, &dd);
  if (s != TW_OK) { fail(res, FZ_ERROR, "setup", tw_last_error()); return; }
  s = tw_cast(subject, &dd, &sd, c->saturate);
  if (s == TW_OK) s = tw_ctx_check(subject);
  if (subject == oracle && s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  if (status_check(res, "cast", s)) return;
  if (to_host(A, subject, &dd, &got) != TW_OK) { fail(res, FZ_ERROR, "copy", tw_last_error()); return; }
  if (subject != oracle) check_exact(res, "vs_oracle:dst", &got, &ores);
  check_exact(res, "cast_vs_scalar_encoder", &got, &exp);
}

/* ======================================================================================
 * GEMM family
 * ====================================================================================== */
/* Transpose [r, c] -> [c, r] (f32). */
static void transpose(const float *in, int64_t r, int64_t c, float *out) {
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < c; j++) out[j * r + i] = in[i * c + j];
}

static int transposed_colwise(tw_scaling m) { return m != TW_SCALE_MXFP8_1D && m != TW_SCALE_NONE; }

/* tw_gemm.h's operand domain: every dequantized value decode(q) * scale_inv is finite in f32.
 * Quantizing +-inf (or a value one rounding step below FLT_MAX) gives codes whose dequantized
 * value overflows; the result is then unspecified (ref multiplies the infinities, gpu applies
 * the scales to f32 block sums), so such a case checks the oracle only. Set by
 * quantized_operand, cleared by each GEMM runner. */
static int gemm_outside_domain;

/* tw_gemm.h: a backend may treat subnormal 16-bit inputs as zero (the H200's tensor cores do
 * for f16). The products it may lose that way are added to the bound as they are. */
static int subnormal16(double v, const fz_operand_spec *sp) {
  double a = fabs(v);
  if (sp->mode != TW_SCALE_NONE || a == 0) return 0;
  if (sp->dtype == TW_F16) return a < 0x1p-14;
  if (sp->dtype == TW_BF16) return a < 0x1p-126;
  return 0;
}
static double flushable(double av, double bv, const fz_case *c) {
  return subnormal16(av, &c->sa) || subnormal16(bv, &c->sb) ? fabs(av) * fabs(bv) : 0;
}

/* Quantizes `src` [R, C] (groups gs) on the oracle with spec and returns the operand (host),
 * the dequantized source [R, C] the GEMM will effectively see, and (mag) the lifted magnitudes
 * of the promoted model's abs_prod (tw_fp8_lift_subnormal_codes: subnormal codes dequantized
 * as the smallest normal). */
static tw_status quantized_operand(tw_ctx *oracle, arena *A, const float *src, int64_t R, int64_t C,
                                   const int32_t *gs, int64_t G, const fz_operand_spec *sp,
                                   tw_operand *op, float **deq, float **mag) {
  int64_t shape[2] = {R, C};
  tw_tensor x = tw_tensor_of((void *)src, TW_F32, 2, shape, TW_MEM_HOST);
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = sp->mode;
  o.qdtype = sp->qdtype;
  o.layout = sp->colwise ? TW_COLWISE : TW_ROWWISE;
  o.pow2_scales = sp->pow2;
  o.mxfp8_swizzled = sp->swizzled;
  o.col_padded = sp->colwise && sp->padded;
  tw_qtensor q;
  TW_TRY(quantize_on(oracle, A, &x, gs, G, &o, NULL, &q, 0));
  *op = sp->colwise ? tw_operand_colwise(&q) : tw_operand_rowwise(&q);
  tw_tensor d;
  TW_TRY(dequantize_host(oracle, A, &q, gs, G, sp->colwise, &d));
  *deq = d.data;
  for (int64_t i = 0; i < R * C; i++)
    if (isinf((*deq)[i])) gemm_outside_domain = 1;
  tw_qtensor lifted = q;
  tw_tensor *ld = sp->colwise ? &lifted.col_data : &lifted.row_data;
  const tw_tensor *qd = sp->colwise ? &q.col_data : &q.row_data;
  TW_TRY(host_like(A, qd, ld));
  TW_TRY(tw_fp8_lift_subnormal_codes(qd->data, tw_tensor_numel(qd), qd->dtype, ld->data));
  TW_TRY(dequantize_host(oracle, A, &lifted, gs, G, sp->colwise, &d));
  *mag = d.data;
  return TW_OK;
}

/* Host operand for storage values [r, c] (per group for the grouped rhs: `groups` slabs of
 * [r, c] stacked), plain or quantized; *eff gets the effective storage values, *mag their
 * lifted magnitudes for the promoted model (plain: eff). */
static tw_status make_operand(tw_ctx *oracle, arena *A, const float *storage, int64_t groups,
                              int64_t r, int64_t c, const fz_operand_spec *sp, int ndim3,
                              tw_operand *op, float **eff, float **mag) {
  int64_t n = groups * r * c;
  if (sp->mode == TW_SCALE_NONE) {
    tw_tensor t;
    int64_t shape3[3] = {groups, r, c}, shape2[2] = {groups * r, c};
    TW_TRY(host_from_f32(A, sp->dtype, ndim3 ? 3 : 2, ndim3 ? shape3 : shape2, storage, &t));
    *op = tw_operand_plain(&t);
    *eff = *mag = (float *)storage;
    return TW_OK;
  }
  /* uniform groups over the quantization source */
  int32_t *gs;
  TW_TRY(arena_alloc(A, NULL, sizeof(int32_t) * (size_t)groups, (void **)&gs));
  float *src, *deq, *lifted;
  TW_TRY(arena_alloc(A, NULL, sizeof(float) * (size_t)n, (void **)&src));
  int tr = sp->colwise && transposed_colwise(sp->mode);
  for (int64_t g = 0; g < groups; g++) {
    gs[g] = (int32_t)(tr ? c : r);
    if (tr) transpose(storage + g * r * c, r, c, src + g * r * c);
    else memcpy(src + g * r * c, storage + g * r * c, sizeof(float) * (size_t)(r * c));
  }
  TW_TRY(quantized_operand(oracle, A, src, groups * (tr ? c : r), tr ? r : c, gs, groups, sp, op, &deq,
                           &lifted));
  float *e, *l;
  TW_TRY(arena_alloc(A, NULL, sizeof(float) * (size_t)n, (void **)&e));
  TW_TRY(arena_alloc(A, NULL, sizeof(float) * (size_t)n, (void **)&l));
  for (int64_t g = 0; g < groups; g++) {
    if (tr) {
      transpose(deq + g * r * c, c, r, e + g * r * c);
      transpose(lifted + g * r * c, c, r, l + g * r * c);
    } else {
      memcpy(e + g * r * c, deq + g * r * c, sizeof(float) * (size_t)(r * c));
      memcpy(l + g * r * c, lifted + g * r * c, sizeof(float) * (size_t)(r * c));
    }
  }
  *eff = e;
  *mag = l;
  return TW_OK;
}

/* Copies a host operand into ctx memory. */
static tw_status operand_to_ctx(arena *A, tw_ctx *ctx, const tw_operand *h, tw_operand *d) {
  *d = *h;
  TW_TRY(to_ctx(A, ctx, &h->data, &d->data));
  if (!tw_tensor_is_none(&h->scale_inv)) TW_TRY(to_ctx(A, ctx, &h->scale_inv, &d->scale_inv));
  return TW_OK;
}

/* The expected output: exact f64 (ref), its bound; untouched elements: bound -1. */
typedef struct {
  tw_tensor init;     /* host, out dtype: poison or out_init */
  tw_tensor expected; /* f64 */
  tw_tensor bound;    /* f64 */
} gemm_expect;

static tw_status expect_alloc(arena *A, const fz_case *c, int ndim, const int64_t *shape, gemm_expect *ge) {
  tw_tensor lo = tw_tensor_of(NULL, c->out_dtype, ndim, shape, TW_MEM_HOST);
  tw_tensor l64 = tw_tensor_of(NULL, TW_F64, ndim, shape, TW_MEM_HOST);
  if (c->accumulate) TW_TRY(host_from_f32(A, c->out_dtype, ndim, shape, c->out_init, &ge->init));
  else TW_TRY(host_like(A, &lo, &ge->init));
  TW_TRY(host_like(A, &l64, &ge->expected));
  TW_TRY(host_like(A, &l64, &ge->bound));
  return TW_OK;
}

/* Fills expected/bound for out elements [i0, i0+cnt) given ref and abs_prod there. */
/* promoted: the subject may run gg_wgmma_fp8 (tw_gemm.h: a grouped fp8 forward or a dense fp8
 * gemm (a op N, b op T) with per-tensor, 1x128 / 128x128 or MXFP8 scales and rhs_op T, or a
 * wgrad from the colwise copies, on a gpu backend), whose model is promoted every `promoted`
 * along K (128; 32 for MXFP8) with a 14-bit inner accumulator; 0: the exact model. */
static void expect_fill(const fz_case *c, gemm_expect *ge, int64_t i0, int64_t cnt, double *ref,
                        double *absp, const double *flush, int64_t K, int64_t promoted) {
  double *e = ge->expected.data, *b = ge->bound.data;
  for (int64_t i = 0; i < cnt; i++) {
    double init = tw_load_as_f64(ge->init.data, c->out_dtype, i0 + i);
    if (c->accumulate) { ref[i] += init; absp[i] += fabs(init); }
    e[i0 + i] = ref[i];
  }
  /* A scaled operand's product picks up two more f32 roundings, wherever the scales are
   * applied (ref: dequantized values; gpu: scales on partial sums). */
  int64_t extra = (c->accumulate ? 1 : 0) + (c->sa.mode != TW_SCALE_NONE ? 2 : 0);
  if (promoted) tw_gemm_error_bound_promoted(absp, ref, cnt, K, promoted, 0x1p-13, 0x1p-24, 2, c->out_dtype, b + i0);
  else tw_gemm_error_bound(absp, ref, cnt, K + extra, 0x1p-24, c->out_dtype, b + i0);
  for (int64_t i = 0; i < cnt; i++)
    if (b[i0 + i] >= 0) b[i0 + i] += flush[i];
  /* NaN/inf results (NaN or inf inputs) must be met by the same special value */
  for (int64_t i = 0; i < cnt; i++)
    if (!isfinite(b[i0 + i]) || !isfinite(ref[i])) b[i0 + i] = 0;
}

static void expect_untouched(const fz_case *c, gemm_expect *ge, int64_t i0, int64_t cnt) {
  double *e = ge->expected.data, *b = ge->bound.data;
  for (int64_t i = i0; i < i0 + cnt; i++) {
    e[i] = tw_load_as_f64(ge->init.data, c->out_dtype, i);
    b[i] = -1;
  }
}

/* Runs fn on ctx with operands copied there and a fresh output (init copied); output back
 * to host in *got. */
typedef tw_status (*gemm_call)(tw_ctx *ctx, const fz_case *c, const tw_operand *a, const tw_operand *b,
                               const tw_tensor *gs, tw_tensor *out);

static tw_status call_gemm(tw_ctx *ctx, const fz_case *c, const tw_operand *a, const tw_operand *b,
                           const tw_tensor *gs, tw_tensor *out) {
  (void)gs;
  return tw_gemm(ctx, a, c->op_a, b, c->op_b, out, c->accumulate);
}
static tw_status call_grouped(tw_ctx *ctx, const fz_case *c, const tw_operand *a, const tw_operand *b,
                              const tw_tensor *gs, tw_tensor *out) {
  return tw_grouped_gemm(ctx, a, b, c->op_b, gs, out, c->accumulate);
}
static tw_status call_wgrad(tw_ctx *ctx, const fz_case *c, const tw_operand *a, const tw_operand *b,
                            const tw_tensor *gs, tw_tensor *out) {
  return tw_grouped_gemm_wgrad(ctx, a, c->op_a, b, c->op_b, gs, out, c->accumulate);
}

static tw_status run_on(tw_ctx *ctx, arena *A, gemm_call fn, const fz_case *c, const tw_operand *ha,
                        const tw_operand *hb, const gemm_expect *ge, tw_tensor *got) {
  tw_operand da, db;
  tw_tensor out, gsd = tw_tensor_none();
  TW_TRY(operand_to_ctx(A, ctx, ha, &da));
  TW_TRY(operand_to_ctx(A, ctx, hb, &db));
  TW_TRY(to_ctx(A, ctx, &ge->init, &out));
  if (c->G > 0) {
    int64_t gshape[1] = {c->G};
    tw_tensor gsh = tw_tensor_of(c->group_sizes, TW_I32, 1, gshape, TW_MEM_HOST);
    TW_TRY(to_ctx(A, ctx, &gsh, &gsd));
  }
  TW_TRY(fn(ctx, c, &da, &db, &gsd, &out));
  TW_TRY(tw_ctx_check(ctx));
  return to_host(A, ctx, &out, got);
}

/* Subject (and oracle when different) vs the f64 expectation. */
static void gemm_compare(tw_ctx *subject, tw_ctx *oracle, arena *A, fz_result *res, gemm_call fn,
                         const char *opn, const fz_case *c, const tw_operand *ha, const tw_operand *hb,
                         const gemm_expect *ge, tw_tensor *subject_out) {
  tw_tensor got;
  if (subject != oracle) {
    tw_status s = run_on(oracle, A, fn, c, ha, hb, ge, &got);
    if (s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
    check_bound(res, "oracle_vs_f64", &got, &ge->expected, &ge->bound);
    if (gemm_outside_domain) return; /* see gemm_outside_domain */
  }
  tw_status s = run_on(subject, A, fn, c, ha, hb, ge, &got);
  if (subject == oracle && s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  if (status_check(res, opn, s)) return;
  check_bound(res, "out_vs_f64", &got, &ge->expected, &ge->bound);
  if (subject_out) *subject_out = got;
}

static tw_status scratch_f64(arena *A, int64_t n, double **p) {
  return arena_alloc(A, NULL, sizeof(double) * (size_t)(n ? n : 1), (void **)p);
}

/* Doubles every bound (two f32 results, each within its bound of the exact value). */
static tw_status doubled(arena *A, const tw_tensor *bound, tw_tensor *out) {
  TW_TRY(host_like(A, bound, out));
  int64_t n = tw_tensor_numel(bound);
  const double *b = bound->data;
  double *o = out->data;
  for (int64_t i = 0; i < n; i++) o[i] = b[i] < 0 ? b[i] : 2 * b[i];
  return TW_OK;
}

/* After per-group dense tw_gemm calls wrote dout (on the subject): their result must meet the
 * f64 expectation (name_f64) and agree with the grouped op's own output `got` within twice the
 * bound (name_vs): both are f32 results, each within its bound of the exact value. */
static void slices_agree(tw_ctx *subject, arena *A, fz_result *res, const fz_case *c, const gemm_expect *ge,
                         const tw_tensor *got, const tw_tensor *dout, const char *name_f64, const char *name_vs) {
  tw_tensor dense_host, b2, gexp;
  if (tw_ctx_check(subject) != TW_OK || to_host(A, subject, dout, &dense_host) != TW_OK ||
      doubled(A, &ge->bound, &b2) != TW_OK || host_like(A, &ge->expected, &gexp) != TW_OK) {
    fail(res, FZ_ERROR, "copy", tw_last_error());
    return;
  }
  check_bound(res, name_f64, &dense_host, &ge->expected, &ge->bound);
  int64_t n = tw_tensor_numel(&ge->expected);
  for (int64_t i = 0; i < n; i++) ((double *)gexp.data)[i] = tw_load_as_f64(got->data, c->out_dtype, i);
  check_bound(res, name_vs, &dense_host, &gexp, &b2);
}

/* The promotion interval of gg_wgmma_fp8's forward model for this case, 0 where it cannot run
 * it (tw_gemm.h: fp8 with rhs / b op T, K % 16 == 0; dense also a op N: lhs_ok; grouped MXFP8
 * also with rhs as the colwise [G*K, N] data, op N, which it transposes into the K-major copy). */
static int64_t fwd_promoted(tw_ctx *subject, const fz_case *c, int64_t K, int lhs_ok, int grouped) {
  const tw_scaling qm = c->sa.mode;
  const int mx_colwise_n = grouped && qm == TW_SCALE_MXFP8_1D && c->op_b == TW_OP_N && c->sb.colwise;
  if (tw_ctx_backend(subject) == TW_BACKEND_REF || (c->op_b != TW_OP_T && !mx_colwise_n) || K % 16 || !lhs_ok)
    return 0;
  if (qm == TW_SCALE_MXFP8_1D) return 32;
  return qm == TW_SCALE_TENSOR_CURRENT || qm == TW_SCALE_TENSOR_DELAYED || qm == TW_SCALE_BLOCK_1x128 ||
                 qm == TW_SCALE_BLOCK_128x128
             ? 128
             : 0;
}

static void run_dense(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, arena *A, fz_result *res) {
  int64_t M = c->M, N = c->N, K = c->K;
  gemm_outside_domain = 0;
  /* storage: a is [M,K] (N) or [K,M] (T); b is [K,N] (N) or [N,K] (T) */
  float *sa, *sb, *ea, *eb, *la, *lb;
  tw_operand ha, hb;
  if (arena_alloc(A, NULL, sizeof(float) * (size_t)(M * K), (void **)&sa) ||
      arena_alloc(A, NULL, sizeof(float) * (size_t)(K * N), (void **)&sb)) return;
  if (c->op_a == TW_OP_T) transpose(c->a, M, K, sa); else memcpy(sa, c->a, sizeof(float) * (size_t)(M * K));
  if (c->op_b == TW_OP_T) transpose(c->b, K, N, sb); else memcpy(sb, c->b, sizeof(float) * (size_t)(K * N));
  int64_t ar = c->op_a == TW_OP_T ? K : M, ac = c->op_a == TW_OP_T ? M : K;
  int64_t br = c->op_b == TW_OP_T ? N : K, bc = c->op_b == TW_OP_T ? K : N;
  if (make_operand(oracle, A, sa, 1, ar, ac, &c->sa, 0, &ha, &ea, &la) != TW_OK ||
      make_operand(oracle, A, sb, 1, br, bc, &c->sb, 0, &hb, &eb, &lb) != TW_OK) {
    fail(res, FZ_ERROR, "oracle", tw_last_error());
    return;
  }
  int64_t oshape[2] = {M, N};
  gemm_expect ge;
  double *ref, *absp, *flush;
  if (expect_alloc(A, c, 2, oshape, &ge) || scratch_f64(A, M * N, &ref) || scratch_f64(A, M * N, &absp) ||
      scratch_f64(A, M * N, &flush)) return;
  const int64_t promoted = fwd_promoted(subject, c, K, c->op_a == TW_OP_N, 0);
  const float *ma = promoted ? la : ea, *mb = promoted ? lb : eb; /* the model's magnitudes */
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double s = 0, s_abs = 0, s_fl = 0;
      for (int64_t k = 0; k < K; k++) {
        int64_t ia = c->op_a == TW_OP_T ? k * M + m : m * K + k, ib = c->op_b == TW_OP_T ? n * K + k : k * N + n;
        double av = ea[ia], bv = eb[ib];
        s += av * bv;
        s_abs += fabs(ma[ia]) * fabs(mb[ib]);
        s_fl += flushable(av, bv, c);
      }
      ref[m * N + n] = s;
      absp[m * N + n] = s_abs;
      flush[m * N + n] = s_fl;
    }
  expect_fill(c, &ge, 0, M * N, ref, absp, flush, K, promoted);
  gemm_compare(subject, oracle, A, res, call_gemm, "gemm", c, &ha, &hb, &ge, NULL);
}

static void run_grouped(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, arena *A, fz_result *res) {
  int64_t M = c->M, N = c->N, K = c->K, G = c->G;
  gemm_outside_domain = 0;
  float *sb, *ea, *eb, *la, *lb;
  tw_operand ha, hb;
  /* rhs storage per group: [K,N] (N) or [N,K] (T) */
  if (arena_alloc(A, NULL, sizeof(float) * (size_t)(G * K * N), (void **)&sb)) return;
  for (int64_t g = 0; g < G; g++) {
    if (c->op_b == TW_OP_T) transpose(c->b + g * K * N, K, N, sb + g * K * N);
    else memcpy(sb + g * K * N, c->b + g * K * N, sizeof(float) * (size_t)(K * N));
  }
  int64_t br = c->op_b == TW_OP_T ? N : K, bc = c->op_b == TW_OP_T ? K : N;
  tw_status s;
  if (c->sa.mode == TW_SCALE_NONE) {
    s = make_operand(oracle, A, c->a, 1, M, K, &c->sa, 0, &ha, &ea, &la);
  } else {
    s = quantized_operand(oracle, A, c->a, M, K, c->group_sizes, G, &c->sa, &ha, &ea, &la);
  }
  if (s == TW_OK)
    s = make_operand(oracle, A, sb, G, br, bc, &c->sb, c->sb.mode == TW_SCALE_NONE, &hb, &eb, &lb);
  if (s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  int64_t oshape[2] = {M, N};
  gemm_expect ge;
  double *ref, *absp, *flush;
  if (expect_alloc(A, c, 2, oshape, &ge) || scratch_f64(A, M * N, &ref) || scratch_f64(A, M * N, &absp) ||
      scratch_f64(A, M * N, &flush)) return;
  const int64_t promoted = fwd_promoted(subject, c, K, 1, 1);
  const float *ma = promoted ? la : ea, *mb = promoted ? lb : eb; /* the model's magnitudes */
  int64_t o = 0;
  for (int64_t g = 0; g < G; g++) {
    int64_t mg = c->group_sizes[g];
    const float *bg = eb + g * K * N, *mbg = mb + g * K * N;
    for (int64_t m = o; m < o + mg; m++)
      for (int64_t n = 0; n < N; n++) {
        double acc = 0, acc_abs = 0, acc_fl = 0;
        for (int64_t k = 0; k < K; k++) {
          int64_t ib = c->op_b == TW_OP_T ? n * K + k : k * N + n;
          double av = ea[m * K + k], bv = bg[ib];
          acc += av * bv;
          acc_abs += fabs(ma[m * K + k]) * fabs(mbg[ib]);
          acc_fl += flushable(av, bv, c);
        }
        ref[(m - o) * N + n] = acc;
        absp[(m - o) * N + n] = acc_abs;
        flush[(m - o) * N + n] = acc_fl;
      }
    expect_fill(c, &ge, o * N, mg * N, ref, absp, flush, K, promoted);
    o += mg;
  }
  expect_untouched(c, &ge, o * N, (M - o) * N);
  tw_tensor got;
  got.ndim = -1;
  gemm_compare(subject, oracle, A, res, call_grouped, "grouped_gemm", c, &ha, &hb, &ge, &got);
  if (tw_tensor_is_none(&got) || c->sa.mode != TW_SCALE_NONE) return;
  /* per-group dense tw_gemm on slices of the same buffers must agree */
  tw_operand da, db;
  tw_tensor dout;
  if (operand_to_ctx(A, subject, &ha, &da) || operand_to_ctx(A, subject, &hb, &db) ||
      to_ctx(A, subject, &ge.init, &dout)) { fail(res, FZ_ERROR, "setup", tw_last_error()); return; }
  size_t ea_sz = tw_dtype_storage_bytes(da.data.dtype, 1), eb_sz = tw_dtype_storage_bytes(db.data.dtype, 1),
         eo_sz = tw_dtype_storage_bytes(c->out_dtype, 1);
  o = 0;
  for (int64_t g = 0; g < G; g++) {
    int64_t mg = c->group_sizes[g];
    tw_tensor at = tw_tensor_2d((char *)da.data.data + (size_t)(o * K) * ea_sz, da.data.dtype, mg, K, da.data.mem);
    tw_tensor bt = tw_tensor_2d((char *)db.data.data + (size_t)(g * K * N) * eb_sz, db.data.dtype, br, bc, db.data.mem);
    tw_tensor ot = tw_tensor_2d((char *)dout.data + (size_t)(o * N) * eo_sz, c->out_dtype, mg, N, dout.mem);
    tw_operand oa = tw_operand_plain(&at), ob = tw_operand_plain(&bt);
    s = tw_gemm(subject, &oa, TW_OP_N, &ob, c->op_b, &ot, c->accumulate);
    if (status_check(res, "gemm (per-group slice)", s)) return;
    o += mg;
  }
  slices_agree(subject, A, res, c, &ge, &got, &dout, "dense_per_group_vs_f64", "grouped_vs_dense");
}

/* Per-group transposed storage of a logical [M, C] ragged matrix: group g's [C, m_g] block
 * at element offset o_g*C; rows past the groups keep row-major order (never read). */
static void per_group_transpose(const float *in, const int32_t *gs, int64_t G, int64_t M, int64_t C,
                                float *out) {
  int64_t o = 0;
  for (int64_t g = 0; g < G; g++) {
    transpose(in + o * C, gs[g], C, out + o * C);
    o += gs[g];
  }
  memcpy(out + o * C, in + o * C, sizeof(float) * (size_t)((M - o) * C));
}

static void run_wgrad(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, arena *A, fz_result *res) {
  int64_t M = c->M, N = c->N, K = c->K, G = c->G;
  gemm_outside_domain = 0;
  float *ea, *eb, *la, *lb;
  tw_operand ha, hb;
  tw_status s = TW_OK;
  const fz_operand_spec *sp[2] = {&c->sa, &c->sb};
  const float *val[2] = {c->a, c->b};
  int64_t cols[2] = {K, N};
  tw_op ops[2] = {c->op_a, c->op_b};
  tw_operand *hs[2] = {&ha, &hb};
  float **es[2] = {&ea, &eb}, **ls[2] = {&la, &lb};
  for (int i = 0; i < 2 && s == TW_OK; i++) {
    if (sp[i]->mode != TW_SCALE_NONE) {
      s = quantized_operand(oracle, A, val[i], M, cols[i], c->group_sizes, G, sp[i], hs[i], es[i], ls[i]);
      continue;
    }
    float *st;
    s = arena_alloc(A, NULL, sizeof(float) * (size_t)(M * cols[i]), (void **)&st);
    if (s != TW_OK) break;
    if (ops[i] == TW_OP_T) per_group_transpose(val[i], c->group_sizes, G, M, cols[i], st);
    else memcpy(st, val[i], sizeof(float) * (size_t)(M * cols[i]));
    int64_t shape[2] = {ops[i] == TW_OP_T ? cols[i] : M, ops[i] == TW_OP_T ? M : cols[i]};
    tw_tensor t;
    s = host_from_f32(A, sp[i]->dtype, 2, shape, st, &t);
    *hs[i] = tw_operand_plain(&t);
    *es[i] = *ls[i] = (float *)val[i];
  }
  if (s != TW_OK) { fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  int64_t oshape[3] = {G, K, N};
  gemm_expect ge;
  double *ref, *absp, *flush;
  if (expect_alloc(A, c, 3, oshape, &ge) || scratch_f64(A, K * N, &ref) || scratch_f64(A, K * N, &absp) ||
      scratch_f64(A, K * N, &flush)) return;
  /* gg_wgmma_fp8's wgrad (tw_gemm.h) may run fp8 from the colwise copies (ops T; auto for every
   * per-tensor and block mode): promoted model; MXFP8 from the colwise [M, K] / [M, N] data (ops
   * N, auto): promoted every 32 tokens */
  const tw_scaling qm = c->sa.mode;
  const int on_gpu = tw_ctx_backend(subject) != TW_BACKEND_REF;
  const int64_t promoted = on_gpu && qm == TW_SCALE_MXFP8_1D && c->op_a == TW_OP_N && c->op_b == TW_OP_N ? 32
                           : on_gpu && c->op_a == TW_OP_T && c->op_b == TW_OP_T &&
                                   (qm == TW_SCALE_TENSOR_CURRENT || qm == TW_SCALE_BLOCK_1x128 ||
                                    qm == TW_SCALE_BLOCK_128x128 || qm == TW_SCALE_TENSOR_DELAYED)
                               ? 128
                               : 0;
  const float *ma = promoted ? la : ea, *mb = promoted ? lb : eb; /* the model's magnitudes */
  int64_t o = 0;
  for (int64_t g = 0; g < G; g++) {
    int64_t mg = c->group_sizes[g];
    memset(ref, 0, sizeof(double) * (size_t)(K * N));
    memset(absp, 0, sizeof(double) * (size_t)(K * N));
    memset(flush, 0, sizeof(double) * (size_t)(K * N));
    for (int64_t m = o; m < o + mg; m++)
      for (int64_t k = 0; k < K; k++) {
        double av = ea[m * K + k], am = fabs(ma[m * K + k]);
        for (int64_t n = 0; n < N; n++) {
          double bv = eb[m * N + n];
          ref[k * N + n] += av * bv;
          absp[k * N + n] += am * fabs(mb[m * N + n]);
          flush[k * N + n] += flushable(av, bv, c);
        }
      }
    expect_fill(c, &ge, g * K * N, K * N, ref, absp, flush, mg, promoted);
    o += mg;
  }
  tw_tensor got;
  got.ndim = -1;
  gemm_compare(subject, oracle, A, res, call_wgrad, "grouped_gemm_wgrad", c, &ha, &hb, &ge, &got);
  if (tw_tensor_is_none(&got) || c->sa.mode != TW_SCALE_NONE) return;
  /* dense tw_gemm on each group's slices: lhs_g^T @ rhs_g */
  tw_operand da, db;
  tw_tensor dout;
  if (operand_to_ctx(A, subject, &ha, &da) || operand_to_ctx(A, subject, &hb, &db) ||
      to_ctx(A, subject, &ge.init, &dout)) { fail(res, FZ_ERROR, "setup", tw_last_error()); return; }
  size_t ea_sz = tw_dtype_storage_bytes(da.data.dtype, 1), eb_sz = tw_dtype_storage_bytes(db.data.dtype, 1),
         eo_sz = tw_dtype_storage_bytes(c->out_dtype, 1);
  o = 0;
  for (int64_t g = 0; g < G; g++) {
    int64_t mg = c->group_sizes[g];
    /* lhs N: [m_g, K] used as op T; lhs T: its [K, m_g] block used as op N */
    tw_tensor at = c->op_a == TW_OP_N
        ? tw_tensor_2d((char *)da.data.data + (size_t)(o * K) * ea_sz, da.data.dtype, mg, K, da.data.mem)
        : tw_tensor_2d((char *)da.data.data + (size_t)(o * K) * ea_sz, da.data.dtype, K, mg, da.data.mem);
    tw_tensor bt = c->op_b == TW_OP_N
        ? tw_tensor_2d((char *)db.data.data + (size_t)(o * N) * eb_sz, db.data.dtype, mg, N, db.data.mem)
        : tw_tensor_2d((char *)db.data.data + (size_t)(o * N) * eb_sz, db.data.dtype, N, mg, db.data.mem);
    tw_tensor ot = tw_tensor_2d((char *)dout.data + (size_t)(g * K * N) * eo_sz, c->out_dtype, K, N, dout.mem);
    tw_operand oa = tw_operand_plain(&at), ob = tw_operand_plain(&bt);
    s = tw_gemm(subject, &oa, c->op_a == TW_OP_N ? TW_OP_T : TW_OP_N, &ob,
                c->op_b == TW_OP_N ? TW_OP_N : TW_OP_T, &ot, c->accumulate);
    if (status_check(res, "gemm (per-group slice)", s)) return;
    o += mg;
  }
  slices_agree(subject, A, res, c, &ge, &got, &dout, "dense_slices_vs_f64", "wgrad_vs_dense");
}

/* ====================================================================================== */
static int valid_dtype(tw_dtype t) { return tw_dtype_name(t) != NULL; }
static int valid_spec(const fz_operand_spec *s) {
  return valid_dtype(s->dtype) && (int)s->mode >= 0 && s->mode < TW_SCALE_COUNT && valid_dtype(s->qdtype);
}

/* A case read from disk may be anything: reject what would make the fuzzer itself index out
 * of bounds (the library's own validation judges the rest). */
int fz_group_sizes_sane(const fz_case *c, char *msg, size_t n) {
  if (c->G < 1 || !c->group_sizes) { snprintf(msg, n, "no group sizes"); return 0; }
  int64_t S = 0;
  for (int64_t g = 0; g < c->G; g++) {
    if (c->group_sizes[g] < 0) { snprintf(msg, n, "group_sizes[%lld] < 0", (long long)g); return 0; }
    S += c->group_sizes[g];
  }
  if (S > c->M) { snprintf(msg, n, "group sizes sum to %lld > M = %lld", (long long)S, (long long)c->M); return 0; }
  return 1;
}

static int case_sane(const fz_case *c, char *msg, size_t n) {
  if (c->M < 0 || c->K < 0 || c->N < 0 || c->G < 0) { snprintf(msg, n, "negative dims"); return 0; }
  if (!valid_dtype(c->x_dtype) || !valid_dtype(c->dst_dtype) || !valid_dtype(c->out_dtype) ||
      !valid_dtype(c->qdtype) || !valid_spec(&c->sa) || !valid_spec(&c->sb) ||
      (c->op_a != TW_OP_N && c->op_a != TW_OP_T) || (c->op_b != TW_OP_N && c->op_b != TW_OP_T)) {
    snprintf(msg, n, "a dtype, mode or op is out of range");
    return 0;
  }
  if (c->op == FZ_QUANTIZE || c->op == FZ_GROUPED_GEMM || c->op == FZ_WGRAD) {
    if (!fz_group_sizes_sane(c, msg, n)) return 0;
  }
  if (c->op == FZ_QUANTIZE && c->mode == TW_SCALE_TENSOR_DELAYED && !c->scale) {
    snprintf(msg, n, "delayed scaling without scale");
    return 0;
  }
  if ((c->op <= FZ_CAST && !c->x) || (c->op >= FZ_GEMM && (!c->a || !c->b)) ||
      (c->op >= FZ_GEMM && c->accumulate && !c->out_init)) {
    snprintf(msg, n, "an input array is missing");
    return 0;
  }
  return 1;
}

fz_verdict fz_run_case(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, fz_result *res) {
  memset(res, 0, sizeof *res);
  char why[160];
  if (c->sharded) { fail(res, FZ_ERROR, "case", "a sharded case: run it with fz_run_sharded"); return res->verdict; }
  if (!case_sane(c, why, sizeof why)) { fail(res, FZ_ERROR, "case", why); return res->verdict; }
  arena *A = calloc(1, sizeof *A);
  if (!A) { fail(res, FZ_ERROR, "setup", "out of memory"); return res->verdict; }
  switch (c->op) {
    case FZ_QUANTIZE: run_quantize(subject, oracle, c, A, res); break;
    case FZ_CAST: run_cast(subject, oracle, c, A, res); break;
    case FZ_GEMM: run_dense(subject, oracle, c, A, res); break;
    case FZ_GROUPED_GEMM: run_grouped(subject, oracle, c, A, res); break;
    case FZ_WGRAD: run_wgrad(subject, oracle, c, A, res); break;
    default: fail(res, FZ_ERROR, "setup", "unknown op");
  }
  if (res->verdict == FZ_PASS && res->nchecks == 0) fail(res, FZ_ERROR, "setup", tw_last_error());
  arena_free(A);
  free(A);
  return res->verdict;
}

void fz_result_print(const fz_result *r, FILE *f) {
  for (int i = 0; i < r->nchecks; i++) fprintf(f, "  %-28s %s\n", r->checks[i].name, r->checks[i].line);
  if (r->verdict != FZ_PASS) fprintf(f, "  => %s\n", r->message);
}

/* ---- the checks' bookkeeping for other runners (shard_run.c) ---- */
void fz_check_exact(fz_result *res, const char *name, const tw_tensor *got, const tw_tensor *exp) {
  check_exact(res, name, got, exp);
}
void fz_check_bound(fz_result *res, const char *name, const tw_tensor *got, const tw_tensor *exp,
                    const tw_tensor *bound) {
  check_bound(res, name, got, exp, bound);
}
void fz_check_note(fz_result *res, const char *name, const char *line) {
  fz_check *c = add_check(res, name);
  if (c) snprintf(c->line, sizeof c->line, "%.300s", line);
}
void fz_fail(fz_result *res, fz_verdict v, const char *name, const char *msg) { fail(res, v, name, msg); }
