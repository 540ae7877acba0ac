/* One operation from keys + named inputs (golden/exec.h). */
#include "golden/exec.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_check.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_router.h"
#include "twin/tw_gemm.h"
#include "twin/tw_npy.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

/* ---- keys ------------------------------------------------------------------------------------ */
static char *trim(char *s) {
  while (*s == ' ' || *s == '\t') s++;
  size_t n = strlen(s);
  while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n')) s[--n] = 0;
  return s;
}

tw_status tw_case_set(tw_case_keys *k, const char *key, const char *val) {
  if (strlen(key) >= sizeof k->key[0] || strlen(val) >= sizeof k->val[0])
    return tw_error(TW_ERR_INVALID_ARG, "case key '%.40s' or its value is too long", key);
  for (int i = 0; i < k->n; i++)
    if (strcmp(k->key[i], key) == 0) {
      strcpy(k->val[i], val);
      return TW_OK;
    }
  if (k->n == TW_CASE_MAX_KEYS) return tw_error(TW_ERR_INVALID_ARG, "more than %d case keys", TW_CASE_MAX_KEYS);
  strcpy(k->key[k->n], key);
  strcpy(k->val[k->n], val);
  k->n++;
  return TW_OK;
}

const char *tw_case_get(const tw_case_keys *k, const char *key) {
  for (int i = 0; i < k->n; i++)
    if (strcmp(k->key[i], key) == 0) return k->val[i];
  return NULL;
}

tw_status tw_case_keys_parse_file(const char *path, tw_case_keys *k) {
  k->n = 0;
  FILE *f = fopen(path, "r");
  if (!f) return tw_error(TW_ERR_IO, "%s: cannot open (%s)", path, strerror(errno));
  char line[512];
  int lineno = 0;
  tw_status s = TW_OK;
  while (s == TW_OK && fgets(line, sizeof line, f)) {
    lineno++;
    if (!strchr(line, '\n') && !feof(f)) {
      s = tw_error(TW_ERR_IO, "%s:%d: line longer than %zu characters", path, lineno, sizeof line - 2);
      break;
    }
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *l = trim(line);
    if (!*l) continue;
    char *eq = strchr(l, '=');
    if (!eq) {
      s = tw_error(TW_ERR_IO, "%s:%d: expected 'key = value', got '%s'", path, lineno, l);
      break;
    }
    *eq = 0;
    char *key = trim(l), *val = trim(eq + 1);
    if (!*key || !*val || strchr(val, ' ')) {
      s = tw_error(TW_ERR_IO, "%s:%d: expected 'key = value' with a one-token value", path, lineno);
      break;
    }
    s = tw_case_set(k, key, val);
    if (s != TW_OK) s = tw_error(s, "%s:%d: %s", path, lineno, tw_last_error());
  }
  fclose(f);
  if (s == TW_OK && !tw_case_get(k, "op")) s = tw_error(TW_ERR_IO, "%s: no 'op = ...' line", path);
  return s;
}

/* ---- tensor sets ------------------------------------------------------------------------------ */
void tw_tensor_set_init(tw_tensor_set *s) { memset(s, 0, sizeof *s); }

void tw_tensor_set_free(tw_tensor_set *s) {
  for (int i = 0; i < s->n; i++) free(s->t[i].data);
  s->n = 0;
}

const tw_tensor *tw_tensor_set_get(const tw_tensor_set *s, const char *name) {
  for (int i = 0; i < s->n; i++)
    if (strcmp(s->name[i], name) == 0) return &s->t[i];
  return NULL;
}

int tw_exec_op_is_gemm(const char *op) {
  return op && (strcmp(op, "gemm") == 0 || strcmp(op, "grouped_gemm") == 0 ||
                strcmp(op, "grouped_gemm_wgrad") == 0 || strcmp(op, "grouped_gemm_rows") == 0 ||
                strcmp(op, "grouped_gemm_wgrad_rows") == 0);
}

/* ---- one run: inputs, context buffers, outputs --------------------------------------------------- */
#define RUN_MAX_BUFS 96
typedef struct {
  tw_ctx *ctx;
  const tw_case_keys *k;
  const char *op;
  tw_input_fn input;
  void *user;
  void *host[RUN_MAX_BUFS]; /* loaded inputs (malloc) */
  int nhost;
  void *dev[RUN_MAX_BUFS]; /* context allocations */
  int ndev;
  tw_tensor_set *out;
} run;

static void run_free(run *r) {
  for (int i = 0; i < r->nhost; i++) free(r->host[i]);
  for (int i = 0; i < r->ndev; i++) tw_free(r->ctx, r->dev[i]);
  r->nhost = r->ndev = 0;
}

static tw_status keep_host(run *r, void *p) {
  if (!p) return TW_OK;
  if (r->nhost == RUN_MAX_BUFS) {
    free(p);
    return tw_error(TW_ERR_INTERNAL, "%s: too many input buffers", r->op);
  }
  r->host[r->nhost++] = p;
  return TW_OK;
}

static tw_status key_str(run *r, const char *key, const char *dflt, const char **v) {
  *v = tw_case_get(r->k, key);
  if (!*v) *v = dflt;
  if (!*v) return tw_error(TW_ERR_INVALID_ARG, "%s: missing key '%s'", r->op, key);
  return TW_OK;
}

static tw_status key_int(run *r, const char *key, int64_t dflt, int required, int64_t *v) {
  const char *s = tw_case_get(r->k, key);
  if (!s) {
    if (required) return tw_error(TW_ERR_INVALID_ARG, "%s: missing key '%s'", r->op, key);
    *v = dflt;
    return TW_OK;
  }
  char *end;
  errno = 0;
  long long x = strtoll(s, &end, 10);
  if (errno || *end || end == s)
    return tw_error(TW_ERR_INVALID_ARG, "%s: key '%s' = '%s' is not an integer", r->op, key, s);
  *v = x;
  return TW_OK;
}

static tw_status key_flag(run *r, const char *key, int dflt, int *v) {
  int64_t x;
  TW_TRY(key_int(r, key, dflt, 0, &x));
  if (x != 0 && x != 1) return tw_error(TW_ERR_INVALID_ARG, "%s: key '%s' = %lld is not 0 or 1", r->op, key, (long long)x);
  *v = (int)x;
  return TW_OK;
}

static tw_status key_op(run *r, const char *key, tw_op *v) {
  const char *s;
  TW_TRY(key_str(r, key, "N", &s));
  if (strcmp(s, "N") == 0 || strcmp(s, "n") == 0) *v = TW_OP_N;
  else if (strcmp(s, "T") == 0 || strcmp(s, "t") == 0) *v = TW_OP_T;
  else return tw_error(TW_ERR_INVALID_ARG, "%s: key '%s' = '%s' is not N or T", r->op, key, s);
  return TW_OK;
}

static tw_status key_dtype(run *r, const char *key, const char *dflt, tw_dtype *v) {
  const char *s;
  TW_TRY(key_str(r, key, dflt, &s));
  if (tw_dtype_from_name(s, v) != 0) return tw_error(TW_ERR_INVALID_ARG, "%s: key '%s' = '%s' is not a dtype", r->op, key, s);
  return TW_OK;
}

static tw_status key_mode(run *r, const char *key, tw_scaling *v) {
  const char *s;
  TW_TRY(key_str(r, key, NULL, &s));
  if (tw_scaling_from_name(s, v) != 0)
    return tw_error(TW_ERR_INVALID_ARG, "%s: key '%s' = '%s' is not a scaling mode (none, current, "
                    "delayed, mxfp8, block1x128, block128x128)", r->op, key, s);
  return TW_OK;
}

static tw_status get_input(run *r, const char *name, int required, tw_tensor *t, int *found) {
  int f = 0;
  memset(t, 0, sizeof *t);
  *t = tw_tensor_none();
  TW_TRY(r->input(r->user, name, t, &f));
  if (f) TW_TRY(keep_host(r, t->data));
  if (!f && required) return tw_error(TW_ERR_IO, "%s: input '%s' is missing", r->op, name);
  if (!f) *t = tw_tensor_none();
  if (found) *found = f;
  return TW_OK;
}

static const char *tstr(const tw_tensor *t, char *buf, size_t n) { return tw_tensor_str(t, buf, n); }

/* The host tensor as dtype `want`, converting as exec.h says. */
static tw_status as_dtype(run *r, const char *name, tw_tensor *t, tw_dtype want) {
  char b[96];
  if (t->dtype == want) return TW_OK;
  int64_t n = tw_tensor_numel(t);
  int bits = tw_dtype_bits(want);
  /* same-width codes: reinterpret */
  if ((t->dtype == TW_U16 && bits == 16 && want != TW_U16) || (t->dtype == TW_U8 && bits == 8)) {
    t->dtype = want;
    return TW_OK;
  }
  /* float values: f64 -> f32 -> (bf16 | f16) */
  if ((t->dtype == TW_F64 || t->dtype == TW_F32) && (want == TW_F32 || want == TW_BF16 || want == TW_F16)) {
    size_t bytes = tw_dtype_storage_bytes(want, n);
    void *p = bytes ? malloc(bytes) : NULL;
    if (bytes && !p) return tw_error(TW_ERR_MEMORY, "%s: out of memory converting '%s'", r->op, name);
    for (int64_t i = 0; i < n; i++) {
      float x = t->dtype == TW_F64 ? (float)((const double *)t->data)[i] : ((const float *)t->data)[i];
      if (want == TW_F32) ((float *)p)[i] = x;
      else if (want == TW_BF16) ((uint16_t *)p)[i] = tw_f32_to_bf16(x);
      else ((uint16_t *)p)[i] = tw_f32_to_f16(x);
    }
    TW_TRY(keep_host(r, p));
    t->data = p;
    t->dtype = want;
    return TW_OK;
  }
  if (t->dtype == TW_I64 && want == TW_I32) {
    int32_t *p = n ? (int32_t *)malloc((size_t)n * 4) : NULL;
    if (n && !p) return tw_error(TW_ERR_MEMORY, "%s: out of memory converting '%s'", r->op, name);
    for (int64_t i = 0; i < n; i++) {
      int64_t v = ((const int64_t *)t->data)[i];
      if (v < INT32_MIN || v > INT32_MAX) {
        free(p);
        return tw_error(TW_ERR_INVALID_ARG, "%s: input '%s'[%lld] = %lld does not fit i32", r->op,
                        name, (long long)i, (long long)v);
      }
      p[i] = (int32_t)v;
    }
    TW_TRY(keep_host(r, p));
    t->data = p;
    t->dtype = TW_I32;
    return TW_OK;
  }
  return tw_error(TW_ERR_DTYPE, "%s: input '%s' is %s, cannot use it as %s%s", r->op, name,
                  tstr(t, b, sizeof b), tw_dtype_name(want),
                  want == TW_BF16 || want == TW_F16 ? " (give f32 values or u16 codes)"
                  : tw_dtype_bits(want) == 8 ? " (give u8 codes)" : "");
}

/* A float input whose dtype is `<dtype_key>` (default: f32 for f32/f64 files). */
static tw_status float_input(run *r, const char *name, const char *dtype_key, int required,
                             tw_tensor *t, int *found) {
  int f;
  TW_TRY(get_input(r, name, required, t, &f));
  if (found) *found = f;
  if (!f) return TW_OK;
  tw_dtype want;
  const char *ks = dtype_key ? tw_case_get(r->k, dtype_key) : NULL;
  if (ks) {
    TW_TRY(key_dtype(r, dtype_key, NULL, &want));
  } else if (t->dtype == TW_F32 || t->dtype == TW_F64) {
    want = TW_F32;
  } else {
    char b[96];
    return tw_error(TW_ERR_DTYPE, "%s: input '%s' is %s; give f32 values, or codes with key '%s'",
                    r->op, name, tstr(t, b, sizeof b), dtype_key ? dtype_key : "?");
  }
  if (want != TW_F32 && want != TW_BF16 && want != TW_F16)
    return tw_error(TW_ERR_DTYPE, "%s: '%s' must be f32, bf16 or f16, not %s", r->op,
                    dtype_key ? dtype_key : name, tw_dtype_name(want));
  return as_dtype(r, name, t, want);
}

static int same_numel_reshape(tw_tensor *t, const tw_tensor *like) {
  if (tw_tensor_is_none(like) || tw_tensor_numel(t) != tw_tensor_numel(like)) return 0;
  t->ndim = like->ndim;
  for (int d = 0; d < TW_MAX_DIMS; d++) t->shape[d] = d < like->ndim ? like->shape[d] : 0;
  return 1;
}

/* A copy of a host tensor in the context's memory. */
static tw_status to_ctx(run *r, const tw_tensor *h, tw_tensor *d) {
  *d = *h;
  d->mem = tw_ctx_mem(r->ctx);
  d->data = NULL;
  size_t bytes = tw_tensor_bytes(h);
  if (bytes == 0) return TW_OK;
  if (r->ndev == RUN_MAX_BUFS) return tw_error(TW_ERR_INTERNAL, "%s: too many buffers", r->op);
  TW_TRY(tw_alloc(r->ctx, bytes, &d->data));
  r->dev[r->ndev++] = d->data;
  return tw_tensor_copy(r->ctx, d, h);
}

/* An output buffer in the context's memory: poisoned, or a copy of init. */
static tw_status new_out(run *r, tw_dtype dt, int ndim, const int64_t *shape, const tw_tensor *init,
                         tw_tensor *d) {
  int64_t dims[TW_MAX_DIMS] = {0}; /* shape may point into *d */
  for (int i = 0; i < ndim && i < TW_MAX_DIMS; i++) dims[i] = shape[i];
  memset(d, 0, sizeof *d);
  d->dtype = dt;
  d->ndim = ndim;
  for (int i = 0; i < ndim && i < TW_MAX_DIMS; i++) d->shape[i] = dims[i];
  d->mem = tw_ctx_mem(r->ctx);
  size_t bytes = tw_tensor_bytes(d);
  if (bytes == 0) return TW_OK;
  if (r->ndev == RUN_MAX_BUFS) return tw_error(TW_ERR_INTERNAL, "%s: too many buffers", r->op);
  TW_TRY(tw_alloc(r->ctx, bytes, &d->data));
  r->dev[r->ndev++] = d->data;
  if (init && !tw_tensor_is_none(init)) return tw_tensor_copy(r->ctx, d, init);
  return tw_memset(r->ctx, d->data, TW_POISON_BYTE, bytes);
}

static tw_status emit(run *r, const char *name, const tw_tensor *d, int optional) {
  tw_tensor_set *s = r->out;
  if (s->n == TW_SET_MAX) return tw_error(TW_ERR_INTERNAL, "%s: too many outputs", r->op);
  tw_tensor h = *d;
  h.mem = TW_MEM_HOST;
  h.data = NULL;
  size_t bytes = tw_tensor_bytes(d);
  if (bytes) {
    h.data = malloc(bytes);
    if (!h.data) return tw_error(TW_ERR_MEMORY, "%s: out of host memory for output '%s'", r->op, name);
    tw_status st = tw_tensor_copy(r->ctx, &h, d);
    if (st != TW_OK) {
      free(h.data);
      return st;
    }
  }
  snprintf(s->name[s->n], sizeof s->name[0], "%s", name);
  s->t[s->n] = h;
  s->optional[s->n] = optional;
  s->n++;
  return TW_OK;
}

/* group_sizes as i32 [G]; absent -> one group of `rows` (for `twin op`). */
static tw_status group_sizes_input(run *r, int64_t rows, tw_tensor *gs) {
  int f;
  TW_TRY(get_input(r, "group_sizes", 0, gs, &f));
  if (!f) {
    int32_t *p = (int32_t *)malloc(4);
    if (!p) return tw_error(TW_ERR_MEMORY, "%s: out of memory", r->op);
    if (rows > INT32_MAX) {
      free(p);
      return tw_error(TW_ERR_INVALID_ARG, "%s: %lld rows do not fit one i32 group", r->op, (long long)rows);
    }
    *p = (int32_t)rows;
    TW_TRY(keep_host(r, p));
    *gs = tw_tensor_1d(p, TW_I32, 1, TW_MEM_HOST);
    return TW_OK;
  }
  if (gs->ndim != 1) {
    char b[96];
    return tw_error(TW_ERR_SHAPE, "%s: group_sizes is %s, expected 1-D [G]", r->op, tstr(gs, b, sizeof b));
  }
  return as_dtype(r, "group_sizes", gs, TW_I32);
}

/* ---- the ops -------------------------------------------------------------------------------- */
static tw_status parse_layout(run *r, tw_qlayout *l) {
  const char *s;
  TW_TRY(key_str(r, "layout", "rowwise", &s));
  if (strcmp(s, "rowwise") == 0) *l = TW_ROWWISE;
  else if (strcmp(s, "colwise") == 0) *l = TW_COLWISE;
  else if (strcmp(s, "rowwise_colwise") == 0 || strcmp(s, "both") == 0) *l = TW_ROWWISE_COLWISE;
  else return tw_error(TW_ERR_INVALID_ARG, "%s: layout '%s' is not rowwise, colwise or rowwise_colwise", r->op, s);
  return TW_OK;
}

static int tensor_scaled(tw_scaling m) { return m == TW_SCALE_TENSOR_CURRENT || m == TW_SCALE_TENSOR_DELAYED; }

static tw_status exec_quantize(run *r) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  TW_TRY(key_mode(r, "mode", &o.mode));
  TW_TRY(key_dtype(r, "qdtype", "e4m3", &o.qdtype));
  TW_TRY(parse_layout(r, &o.layout));
  TW_TRY(key_flag(r, "pow2_scales", 0, &o.pow2_scales));
  TW_TRY(key_flag(r, "swizzled", 1, &o.mxfp8_swizzled));
  TW_TRY(key_flag(r, "col_padded", 0, &o.col_padded));
  int want_amax = 1;
  TW_TRY(key_flag(r, "amax", 1, &want_amax));
  tw_tensor x, gs, scale;
  TW_TRY(float_input(r, "x", "x_dtype", 1, &x, NULL));
  if (x.ndim != 2) {
    char b[96];
    return tw_error(TW_ERR_SHAPE, "%s: x is %s, expected 2-D [M, K]", r->op, tstr(&x, b, sizeof b));
  }
  TW_TRY(group_sizes_input(r, x.shape[0], &gs));
  tw_tensor dx, dgs, dscale = tw_tensor_none();
  TW_TRY(to_ctx(r, &x, &dx));
  TW_TRY(to_ctx(r, &gs, &dgs));
  if (o.mode == TW_SCALE_TENSOR_DELAYED) {
    TW_TRY(get_input(r, "scale", 1, &scale, NULL));
    TW_TRY(as_dtype(r, "scale", &scale, TW_F32));
    TW_TRY(to_ctx(r, &scale, &dscale));
  }
  o.scale = dscale;
  tw_qtensor q;
  TW_TRY(tw_quantize_output_shapes(&o, x.shape[0], x.shape[1], gs.shape[0], &q));
  tw_tensor *parts[4] = {&q.row_data, &q.row_scale_inv, &q.col_data, &q.col_scale_inv};
  for (int i = 0; i < 4; i++) {
    if (tw_tensor_is_none(parts[i])) continue;
    if (i == 3 && tensor_scaled(o.mode) && !tw_tensor_is_none(&q.row_scale_inv)) {
      *parts[3] = q.row_scale_inv; /* one [G] buffer serves both orientations */
      continue;
    }
    TW_TRY(new_out(r, parts[i]->dtype, parts[i]->ndim, parts[i]->shape, NULL, parts[i]));
  }
  if (want_amax) TW_TRY(new_out(r, q.amax.dtype, q.amax.ndim, q.amax.shape, NULL, &q.amax));
  else q.amax = tw_tensor_none();
  TW_TRY(tw_grouped_quantize(r->ctx, &dx, &dgs, &o, &q));
  TW_TRY(tw_ctx_check(r->ctx));
  static const char *names[4] = {"row_data", "row_scale_inv", "col_data", "col_scale_inv"};
  for (int i = 0; i < 4; i++)
    if (!tw_tensor_is_none(parts[i]))
      TW_TRY(emit(r, names[i], parts[i], i == 3 && tensor_scaled(o.mode) && !tw_tensor_is_none(&q.row_scale_inv)));
  if (want_amax) TW_TRY(emit(r, "amax", &q.amax, 0));
  return TW_OK;
}

static tw_status exec_dequantize(run *r) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  TW_TRY(key_mode(r, "mode", &o.mode));
  TW_TRY(key_dtype(r, "qdtype", "e4m3", &o.qdtype));
  int colwise = 0;
  TW_TRY(key_flag(r, "colwise", 0, &colwise));
  TW_TRY(key_flag(r, "swizzled", 1, &o.mxfp8_swizzled));
  TW_TRY(key_flag(r, "col_padded", 0, &o.col_padded));
  o.layout = colwise ? TW_COLWISE : TW_ROWWISE;
  tw_dtype out_dtype;
  TW_TRY(key_dtype(r, "out_dtype", "f32", &out_dtype));
  int64_t rows, cols;
  TW_TRY(key_int(r, "rows", 0, 1, &rows));
  TW_TRY(key_int(r, "cols", 0, 1, &cols));
  tw_tensor data, sinv, gs;
  TW_TRY(get_input(r, "data", 1, &data, NULL));
  TW_TRY(as_dtype(r, "data", &data, o.qdtype));
  TW_TRY(get_input(r, "scale_inv", 1, &sinv, NULL));
  TW_TRY(as_dtype(r, "scale_inv", &sinv, o.mode == TW_SCALE_MXFP8_1D ? TW_E8M0 : TW_F32));
  TW_TRY(group_sizes_input(r, rows, &gs));
  tw_qtensor want;
  TW_TRY(tw_quantize_output_shapes(&o, rows, cols, gs.shape[0], &want));
  /* files may hold the same bytes in another shape (e.g. [K, M] for a transposed copy) */
  same_numel_reshape(&data, colwise ? &want.col_data : &want.row_data);
  same_numel_reshape(&sinv, colwise ? &want.col_scale_inv : &want.row_scale_inv);
  tw_qtensor q = want; /* (col_padded as the key said) */
  q.row_data = q.row_scale_inv = q.col_data = q.col_scale_inv = q.amax = tw_tensor_none();
  tw_tensor dgs, out;
  TW_TRY(to_ctx(r, &data, colwise ? &q.col_data : &q.row_data));
  TW_TRY(to_ctx(r, &sinv, colwise ? &q.col_scale_inv : &q.row_scale_inv));
  TW_TRY(to_ctx(r, &gs, &dgs));
  int64_t oshape[2] = {rows, cols};
  TW_TRY(new_out(r, out_dtype, 2, oshape, NULL, &out));
  TW_TRY(tw_grouped_dequantize(r->ctx, &q, &dgs, colwise, &out));
  TW_TRY(tw_ctx_check(r->ctx));
  return emit(r, "out", &out, 0);
}

static tw_status exec_delayed_update(run *r) {
  tw_dtype qdtype;
  TW_TRY(key_dtype(r, "qdtype", "e4m3", &qdtype));
  const char *algo_s, *margin_s;
  TW_TRY(key_str(r, "algo", "max", &algo_s));
  tw_amax_algo algo;
  if (strcmp(algo_s, "max") == 0) algo = TW_AMAX_MAX;
  else if (strcmp(algo_s, "most_recent") == 0) algo = TW_AMAX_MOST_RECENT;
  else return tw_error(TW_ERR_INVALID_ARG, "%s: algo '%s' is not max or most_recent", r->op, algo_s);
  TW_TRY(key_str(r, "margin", "0", &margin_s));
  char *end;
  float margin = strtof(margin_s, &end);
  if (*end || end == margin_s) return tw_error(TW_ERR_INVALID_ARG, "%s: margin '%s' is not a number", r->op, margin_s);
  tw_tensor hist, scale, amax, dh, ds, da;
  TW_TRY(get_input(r, "amax_history", 1, &hist, NULL));
  TW_TRY(as_dtype(r, "amax_history", &hist, TW_F32));
  TW_TRY(get_input(r, "scale", 1, &scale, NULL));
  TW_TRY(as_dtype(r, "scale", &scale, TW_F32));
  TW_TRY(get_input(r, "amax", 1, &amax, NULL));
  TW_TRY(as_dtype(r, "amax", &amax, TW_F32));
  TW_TRY(to_ctx(r, &hist, &dh));
  TW_TRY(to_ctx(r, &scale, &ds));
  TW_TRY(to_ctx(r, &amax, &da));
  TW_TRY(tw_delayed_scale_update(r->ctx, &dh, &ds, &da, qdtype, algo, margin));
  TW_TRY(tw_ctx_check(r->ctx));
  TW_TRY(emit(r, "amax_history_out", &dh, 0));
  return emit(r, "scale_out", &ds, 0);
}

/* Operand <p>: plain (`<p>.npy`) or quantized (`<p>_data.npy`, `<p>_scale_inv.npy`); `groups`
 * fixes the scale layout; `gs_host` the groups' sizes (NULL: uniform). */
static tw_status operand_input(run *r, const char *p, int64_t groups, tw_operand *o) {
  char key[64], name[64];
  tw_scaling mode = TW_SCALE_NONE;
  snprintf(key, sizeof key, "%s_mode", p);
  if (tw_case_get(r->k, key)) TW_TRY(key_mode(r, key, &mode));
  if (mode == TW_SCALE_NONE) {
    tw_tensor t, d;
    snprintf(key, sizeof key, "%s_dtype", p);
    TW_TRY(float_input(r, p, key, 1, &t, NULL));
    TW_TRY(to_ctx(r, &t, &d));
    *o = tw_operand_plain(&d);
    return TW_OK;
  }
  memset(o, 0, sizeof *o);
  o->mode = mode;
  tw_dtype qdtype;
  int64_t R, C;
  snprintf(key, sizeof key, "%s_qdtype", p);
  TW_TRY(key_dtype(r, key, "e4m3", &qdtype));
  snprintf(key, sizeof key, "%s_colwise", p);
  TW_TRY(key_flag(r, key, 0, &o->colwise));
  snprintf(key, sizeof key, "%s_swizzled", p);
  TW_TRY(key_flag(r, key, 1, &o->mxfp8_swizzled));
  snprintf(key, sizeof key, "%s_col_padded", p);
  TW_TRY(key_flag(r, key, 0, &o->col_padded));
  snprintf(key, sizeof key, "%s_src_rows", p);
  TW_TRY(key_int(r, key, 0, 1, &R));
  snprintf(key, sizeof key, "%s_src_cols", p);
  TW_TRY(key_int(r, key, 0, 1, &C));
  o->src_rows = R;
  o->src_cols = C;
  tw_tensor data, sinv;
  snprintf(name, sizeof name, "%s_data", p);
  TW_TRY(get_input(r, name, 1, &data, NULL));
  TW_TRY(as_dtype(r, name, &data, qdtype));
  /* the storage matrix: a transposed colwise copy is [C, R], everything else [R, C] */
  tw_tensor like = tw_tensor_2d(NULL, qdtype, R, C, TW_MEM_HOST);
  if (o->colwise && mode != TW_SCALE_MXFP8_1D) like = tw_tensor_2d(NULL, qdtype, C, R, TW_MEM_HOST);
  if (o->col_padded) { /* token-padded: [C, 128 * T_cap] (tw_quantize.h) */
    const int64_t g = groups > 0 ? groups : 1, gn = g < R ? g : R;
    like = tw_tensor_2d(NULL, qdtype, C, 128 * ((R + 127 * gn) / 128), TW_MEM_HOST);
  }
  same_numel_reshape(&data, &like);
  snprintf(name, sizeof name, "%s_scale_inv", p);
  TW_TRY(get_input(r, name, 1, &sinv, NULL));
  TW_TRY(as_dtype(r, name, &sinv, mode == TW_SCALE_MXFP8_1D ? TW_E8M0 : TW_F32));
  tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
  qo.mode = mode;
  qo.qdtype = qdtype;
  qo.layout = o->colwise ? TW_COLWISE : TW_ROWWISE;
  qo.mxfp8_swizzled = o->mxfp8_swizzled;
  tw_qtensor want;
  if (tw_quantize_output_shapes(&qo, R, C, groups > 0 ? groups : 1, &want) == TW_OK)
    same_numel_reshape(&sinv, o->colwise ? &want.col_scale_inv : &want.row_scale_inv);
  TW_TRY(to_ctx(r, &data, &o->data));
  TW_TRY(to_ctx(r, &sinv, &o->scale_inv));
  return TW_OK;
}

/* The logical [rows, cols] an operand presents under op (per group for grouped rhs). */
static void logical_dims(const tw_operand *o, tw_op op, int64_t groups, int64_t *rows, int64_t *cols) {
  const tw_tensor *t = &o->data;
  int64_t r, c;
  if (o->mode == TW_SCALE_NONE || t->ndim >= 2) {
    r = t->ndim >= 2 ? t->shape[t->ndim - 2] : 0;
    c = t->ndim >= 1 ? t->shape[t->ndim - 1] : 0;
  } else {
    r = o->src_rows;
    c = o->src_cols;
  }
  if (o->mode != TW_SCALE_NONE && groups > 1) { /* uniform groups stacked along rows */
    if (o->colwise && o->mode != TW_SCALE_MXFP8_1D) c /= groups;
    else r /= groups;
  }
  *rows = op == TW_OP_N ? r : c;
  *cols = op == TW_OP_N ? c : r;
}

static tw_status exec_gemm_family(run *r) {
  tw_dtype out_dtype;
  TW_TRY(key_dtype(r, "out_dtype", "f32", &out_dtype));
  int accumulate = 0;
  TW_TRY(key_flag(r, "accumulate", 0, &accumulate));
  tw_tensor init;
  int have_init;
  TW_TRY(get_input(r, "out_init", 0, &init, &have_init));
  if (accumulate && !have_init)
    return tw_error(TW_ERR_INVALID_ARG, "%s: accumulate = 1 needs an out_init input", r->op);
  if (have_init) TW_TRY(as_dtype(r, "out_init", &init, out_dtype));
  int64_t oshape[3];
  int ond;
  tw_tensor out;
  if (strcmp(r->op, "gemm") == 0) {
    tw_op op_a, op_b;
    TW_TRY(key_op(r, "op_a", &op_a));
    TW_TRY(key_op(r, "op_b", &op_b));
    tw_operand a, b;
    TW_TRY(operand_input(r, "a", 1, &a));
    TW_TRY(operand_input(r, "b", 1, &b));
    int64_t M, Ka, Kb, N;
    logical_dims(&a, op_a, 1, &M, &Ka);
    logical_dims(&b, op_b, 1, &Kb, &N);
    int64_t batch = a.data.ndim == 3 ? a.data.shape[0] : (b.data.ndim == 3 ? b.data.shape[0] : 0);
    ond = 0;
    if (batch) oshape[ond++] = batch;
    oshape[ond++] = M;
    oshape[ond++] = N;
    if (have_init) same_numel_reshape(&init, &(tw_tensor){NULL, out_dtype, ond, {oshape[0], oshape[1], ond > 2 ? oshape[2] : 0, 0}, TW_MEM_HOST});
    TW_TRY(new_out(r, out_dtype, ond, oshape, have_init ? &init : NULL, &out));
    TW_TRY(tw_gemm(r->ctx, &a, op_a, &b, op_b, &out, accumulate));
  } else {
    tw_tensor gs, dgs;
    TW_TRY(get_input(r, "group_sizes", 1, &gs, NULL));
    if (gs.ndim != 1) {
      char b[96];
      return tw_error(TW_ERR_SHAPE, "%s: group_sizes is %s, expected 1-D [G]", r->op, tstr(&gs, b, sizeof b));
    }
    TW_TRY(as_dtype(r, "group_sizes", &gs, TW_I32));
    int64_t G = gs.shape[0];
    TW_TRY(to_ctx(r, &gs, &dgs));
    /* grouped_gemm_rows / grouped_gemm_wgrad_rows: a row-gathered lhs, its source quantized as
     * one group, and lhs_rows (required); M is then the length of lhs_rows */
    const size_t on = strlen(r->op);
    const int want_rows = on > 5 && strcmp(r->op + on - 5, "_rows") == 0;
    tw_tensor hrows, drows;
    int have_rows = 0;
    TW_TRY(get_input(r, "lhs_rows", want_rows, &hrows, &have_rows));
    if (have_rows && !want_rows)
      return tw_error(TW_ERR_INVALID_ARG, "%s: lhs_rows is an input of %s_rows", r->op, r->op);
    if (have_rows) {
      TW_TRY(as_dtype(r, "lhs_rows", &hrows, TW_I32));
      TW_TRY(to_ctx(r, &hrows, &drows));
    }
    tw_operand lhs, rhs;
    TW_TRY(operand_input(r, "lhs", have_rows ? 1 : G, &lhs));
    TW_TRY(operand_input(r, "rhs", G, &rhs));
    if (strcmp(r->op, "grouped_gemm") == 0 || strcmp(r->op, "grouped_gemm_rows") == 0) {
      tw_op rhs_op;
      TW_TRY(key_op(r, "rhs_op", &rhs_op));
      int64_t M, K, Kr, N;
      logical_dims(&lhs, TW_OP_N, 1, &M, &K);
      if (have_rows) M = hrows.ndim == 1 ? hrows.shape[0] : 0;
      if (rhs.mode == TW_SCALE_NONE) {
        const tw_tensor *R = &rhs.data;
        N = R->ndim == 3 ? (rhs_op == TW_OP_N ? R->shape[2] : R->shape[1]) : 0;
      } else {
        logical_dims(&rhs, rhs_op, G, &Kr, &N);
      }
      ond = 2;
      oshape[0] = M;
      oshape[1] = N;
      if (have_init) same_numel_reshape(&init, &(tw_tensor){NULL, out_dtype, 2, {M, N, 0, 0}, TW_MEM_HOST});
      TW_TRY(new_out(r, out_dtype, ond, oshape, have_init ? &init : NULL, &out));
      if (have_rows) TW_TRY(tw_grouped_gemm_rows(r->ctx, &lhs, &drows, &rhs, rhs_op, &dgs, &out, accumulate));
      else TW_TRY(tw_grouped_gemm(r->ctx, &lhs, &rhs, rhs_op, &dgs, &out, accumulate));
    } else {
      tw_op lhs_op, rhs_op;
      TW_TRY(key_op(r, "lhs_op", &lhs_op));
      TW_TRY(key_op(r, "rhs_op", &rhs_op));
      int64_t M, K, Mr, N;
      if (have_rows && lhs_op != TW_OP_N)
        return tw_error(TW_ERR_INVALID_ARG, "%s: a row-gathered lhs is [U, K] rows (lhs_op N), got lhs_op T", r->op);
      if (lhs.mode == TW_SCALE_NONE) logical_dims(&lhs, lhs_op, 1, &M, &K);
      else { M = lhs.src_rows; K = lhs.src_cols; }
      if (rhs.mode == TW_SCALE_NONE) logical_dims(&rhs, rhs_op, 1, &Mr, &N);
      else { Mr = rhs.src_rows; N = rhs.src_cols; }
      (void)Mr;
      ond = 3;
      oshape[0] = G;
      oshape[1] = K;
      oshape[2] = N;
      if (have_init) same_numel_reshape(&init, &(tw_tensor){NULL, out_dtype, 3, {G, K, N, 0}, TW_MEM_HOST});
      TW_TRY(new_out(r, out_dtype, ond, oshape, have_init ? &init : NULL, &out));
      if (have_rows) TW_TRY(tw_grouped_gemm_wgrad_rows(r->ctx, &lhs, &drows, &rhs, rhs_op, &dgs, &out, accumulate));
      else TW_TRY(tw_grouped_gemm_wgrad(r->ctx, &lhs, lhs_op, &rhs, rhs_op, &dgs, &out, accumulate));
    }
  }
  TW_TRY(tw_ctx_check(r->ctx));
  return emit(r, "out", &out, 0);
}

/* ---- router and EP (`twin op router|ep_dispatch|ep_combine`) -------------------------------- */
static tw_status key_float(run *r, const char *key, const char *dflt, float *v) {
  const char *str;
  char *end;
  TW_TRY(key_str(r, key, dflt, &str));
  *v = strtof(str, &end);
  if (*end || end == str) return tw_error(TW_ERR_INVALID_ARG, "%s: %s '%s' is not a number", r->op, key, str);
  return TW_OK;
}

/* logits [T, E] (f32, or u16 codes with logits_dtype = bf16) -> topk_idx, topk_weights, counts;
 * with d_topk_weights also d_logits; with coeff also aux_loss (and aux_d_logits with d_loss). */
static tw_status exec_router(run *r) {
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  const char *score;
  int64_t v;
  TW_TRY(key_str(r, "score", "softmax", &score));
  if (strcmp(score, "softmax") && strcmp(score, "sigmoid"))
    return tw_error(TW_ERR_INVALID_ARG, "router: score '%s' must be softmax or sigmoid", score);
  o.score = strcmp(score, "sigmoid") == 0 ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
  TW_TRY(key_int(r, "topk", 0, 1, &v)); o.topk = (int)v;
  TW_TRY(key_int(r, "pre_softmax", 0, 0, &v)); o.pre_softmax = (int)v;
  TW_TRY(key_int(r, "num_groups", 0, 0, &v)); o.num_groups = (int)v;
  TW_TRY(key_int(r, "group_topk", 0, 0, &v)); o.group_topk = (int)v;
  TW_TRY(key_float(r, "scaling_factor", "1", &o.scaling_factor));
  tw_tensor hl, hb, hdw, l, b = tw_tensor_none(), dw;
  int have_bias, have_dw;
  TW_TRY(float_input(r, "logits", "logits_dtype", 1, &hl, NULL));
  if (hl.ndim != 2) return tw_error(TW_ERR_SHAPE, "router: logits must be [T, E], got %d dims", hl.ndim);
  TW_TRY(float_input(r, "expert_bias", NULL, 0, &hb, &have_bias));
  TW_TRY(float_input(r, "d_topk_weights", NULL, 0, &hdw, &have_dw));
  TW_TRY(to_ctx(r, &hl, &l));
  if (have_bias) TW_TRY(to_ctx(r, &hb, &b));
  o.expert_bias = b;
  int64_t T = hl.shape[0], E = hl.shape[1], k = o.topk > 0 ? o.topk : 1;
  tw_tensor idx, w, cnt;
  TW_TRY(new_out(r, TW_I32, 2, (int64_t[]){T, k}, NULL, &idx));
  TW_TRY(new_out(r, TW_F32, 2, (int64_t[]){T, k}, NULL, &w));
  TW_TRY(new_out(r, TW_I32, 1, (int64_t[]){E}, NULL, &cnt));
  TW_TRY(tw_router_fwd(r->ctx, &l, &o, &idx, &w, &cnt));
  TW_TRY(emit(r, "topk_idx", &idx, 0));
  TW_TRY(emit(r, "topk_weights", &w, 0));
  TW_TRY(emit(r, "counts", &cnt, 0));
  if (have_dw) {
    tw_tensor dl;
    TW_TRY(to_ctx(r, &hdw, &dw));
    TW_TRY(new_out(r, TW_F32, 2, (int64_t[]){T, E}, NULL, &dl));
    TW_TRY(tw_router_bwd(r->ctx, &l, &o, &idx, &dw, &dl));
    TW_TRY(emit(r, "d_logits", &dl, 0));
  }
  if (tw_case_get(r->k, "coeff")) {
    float coeff, d_loss;
    tw_tensor loss, adl;
    TW_TRY(key_float(r, "coeff", NULL, &coeff));
    TW_TRY(key_float(r, "d_loss", "1", &d_loss));
    TW_TRY(new_out(r, TW_F32, 1, (int64_t[]){1}, NULL, &loss));
    TW_TRY(tw_router_aux_loss(r->ctx, &l, &o, &cnt, coeff, &loss));
    TW_TRY(emit(r, "aux_loss", &loss, 0));
    TW_TRY(new_out(r, TW_F32, 2, (int64_t[]){T, E}, NULL, &adl));
    TW_TRY(tw_router_aux_loss_bwd(r->ctx, &l, &o, &cnt, coeff, d_loss, &adl));
    TW_TRY(emit(r, "aux_d_logits", &adl, 0));
  }
  return tw_ctx_check(r->ctx);
}

/* EP on ep_size thread ranks of the ref backend: the global tokens [n*T, H], topk_idx and
 * topk_weights [n*T, k] are split into n equal row blocks, block r on rank r. ep_dispatch writes
 * each rank's recv_tokens_<r>, recv_weights_<r>, group_sizes_<r>, dropped_<r>; ep_combine also
 * combines the expert outputs expert_out_<r> [R, H] (f32) back into out [n*T, H] (weighted by
 * topk_weights; unweighted with weighted = 0). */
#define EXEC_EP_MAXR 8
typedef struct {
  run *r;
  int n, combine, weighted;
  tw_ep_config cfg;
  tw_tensor tok, idx, w, y[EXEC_EP_MAXR];
  int64_t T; /* per rank */
  void *recv[EXEC_EP_MAXR];
  float *rw[EXEC_EP_MAXR], *out;
  int32_t *gs[EXEC_EP_MAXR], *dropped[EXEC_EP_MAXR];
} ep_exec;

static tw_tensor rows_of(const tw_tensor *t, int64_t r0, int64_t n) {
  tw_tensor v = *t;
  v.shape[0] = n;
  v.data = (char *)t->data + (size_t)r0 * tw_tensor_bytes(t) / (size_t)(t->shape[0] ? t->shape[0] : 1);
  return v;
}

static tw_status ep_exec_rank(int me, tw_comm *comm, void *arg) {
  ep_exec *x = (ep_exec *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  int64_t T = x->T, H = x->cfg.hidden, R = x->cfg.recv_capacity, k = x->cfg.topk;
  int nle = x->cfg.num_experts / x->n;
  tw_status s = tw_ep_create(ctx, comm, &x->cfg, &ep);
  if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
  tw_tensor tok = rows_of(&x->tok, me * T, T), idx = rows_of(&x->idx, me * T, T), w = rows_of(&x->w, me * T, T);
  tw_tensor none = tw_tensor_none(), sc_none = tw_tensor_none();
  tw_tensor recv = tw_tensor_2d(x->recv[me], x->cfg.token_dtype, R, H, TW_MEM_HOST);
  tw_tensor rw = tw_tensor_1d(x->rw[me], TW_F32, R, TW_MEM_HOST);
  tw_tensor gs = tw_tensor_1d(x->gs[me], TW_I32, nle, TW_MEM_HOST), dr = tw_tensor_1d(x->dropped[me], TW_I32, nle, TW_MEM_HOST);
  if (s == TW_OK) s = tw_ep_dispatch(ctx, layer, &tok, &sc_none, &idx, &w, &recv, &sc_none, &rw, &gs, &dr);
  if (s == TW_OK && x->combine) {
    tw_tensor out = tw_tensor_2d(x->out + me * T * H, TW_F32, T, H, TW_MEM_HOST);
    s = tw_ep_combine(ctx, layer, &x->y[me], x->weighted ? &w : &none, &out);
  }
  (void)k;
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

static tw_status exec_ep(run *r, int combine) {
  if (tw_ctx_backend(r->ctx) != TW_BACKEND_REF)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: twin op runs EP on ref thread ranks (the gpu EP is issue 13)", r->op);
  ep_exec *x = (ep_exec *)calloc(1, sizeof *x);
  if (!x) return tw_error(TW_ERR_MEMORY, "%s: out of memory", r->op);
  TW_TRY(keep_host(r, x)); /* freed with the run's inputs (also on error) */
  int64_t v = 0;
  const char *pol;
  tw_status s = key_int(r, "ep_size", 0, 1, &v);
  x->n = (int)v;
  if (s == TW_OK && (x->n < 1 || x->n > EXEC_EP_MAXR))
    s = tw_error(TW_ERR_INVALID_ARG, "%s: ep_size = %d must be in [1, %d] (ranks are threads)", r->op, x->n, EXEC_EP_MAXR);
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  if (s == TW_OK) s = key_int(r, "experts", 0, 1, &v);
  cfg.num_experts = (int)v;
  if (s == TW_OK) s = key_int(r, "alignment", 1, 0, &v);
  cfg.alignment = v;
  if (s == TW_OK) s = key_int(r, "recv_capacity", 0, 0, &v);
  cfg.recv_capacity = v;
  if (s == TW_OK) s = key_str(r, "policy", "error", &pol);
  if (s == TW_OK && strcmp(pol, "error") && strcmp(pol, "drop"))
    s = tw_error(TW_ERR_INVALID_ARG, "%s: policy '%s' must be error or drop", r->op, pol);
  if (s == TW_OK) cfg.overflow = strcmp(pol, "drop") == 0 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  if (s == TW_OK) s = key_int(r, "weighted", 1, 0, &v);
  x->weighted = (int)v;
  x->combine = combine;
  if (s == TW_OK) s = float_input(r, "tokens", "tokens_dtype", 1, &x->tok, NULL);
  if (s == TW_OK) s = get_input(r, "topk_idx", 1, &x->idx, NULL);
  if (s == TW_OK) s = as_dtype(r, "topk_idx", &x->idx, TW_I32);
  if (s == TW_OK) s = float_input(r, "topk_weights", NULL, 1, &x->w, NULL);
  if (s != TW_OK) return s;
  if (x->tok.ndim != 2 || x->idx.ndim != 2 || x->w.ndim != 2 || x->idx.shape[0] != x->tok.shape[0] ||
      x->w.shape[0] != x->tok.shape[0] || x->w.shape[1] != x->idx.shape[1])
    return tw_error(TW_ERR_SHAPE, "%s: want tokens [n*T, H], topk_idx and topk_weights [n*T, k]", r->op);
  if (x->tok.shape[0] % x->n)
    return tw_error(TW_ERR_SHAPE, "%s: %lld token rows do not split into ep_size = %d equal blocks", r->op,
                    (long long)x->tok.shape[0], x->n);
  x->T = x->tok.shape[0] / x->n;
  cfg.topk = (int)x->idx.shape[1];
  cfg.hidden = x->tok.shape[1];
  cfg.max_tokens = x->T;
  cfg.token_dtype = x->tok.dtype;
  int64_t R = cfg.recv_capacity ? cfg.recv_capacity : tw_ep_capacity_no_drop(&cfg, x->n);
  cfg.recv_capacity = R;
  x->cfg = cfg;
  int nle = cfg.num_experts / x->n, H = (int)cfg.hidden;
  char name[48];
  for (int q = 0; q < x->n; q++) {
    TW_TRY(keep_host(r, x->recv[q] = calloc((size_t)(R * H) * 4 + 1, 1)));
    TW_TRY(keep_host(r, x->rw[q] = calloc((size_t)R + 1, 4)));
    TW_TRY(keep_host(r, x->gs[q] = calloc((size_t)nle + 1, 4)));
    TW_TRY(keep_host(r, x->dropped[q] = calloc((size_t)nle + 1, 4)));
    if (!x->recv[q] || !x->rw[q] || !x->gs[q] || !x->dropped[q]) return tw_error(TW_ERR_MEMORY, "%s: out of memory", r->op);
    if (combine) {
      snprintf(name, sizeof name, "expert_out_%d", q);
      TW_TRY(float_input(r, name, NULL, 1, &x->y[q], NULL));
    }
  }
  if (combine) TW_TRY(keep_host(r, x->out = calloc((size_t)(x->tok.shape[0] * H) + 1, 4)));
  tw_comm *comms[EXEC_EP_MAXR];
  TW_TRY(tw_comm_init_threads(x->n, comms));
  s = tw_run_ranks(x->n, comms, ep_exec_rank, x);
  for (int q = 0; q < x->n; q++) tw_comm_destroy(comms[q]);
  TW_TRY(s);
  for (int q = 0; q < x->n; q++) {
    tw_tensor t;
    snprintf(name, sizeof name, "recv_tokens_%d", q);
    t = tw_tensor_2d(x->recv[q], cfg.token_dtype, R, H, TW_MEM_HOST);
    TW_TRY(emit(r, name, &t, 0));
    snprintf(name, sizeof name, "recv_weights_%d", q);
    t = tw_tensor_1d(x->rw[q], TW_F32, R, TW_MEM_HOST);
    TW_TRY(emit(r, name, &t, 0));
    snprintf(name, sizeof name, "group_sizes_%d", q);
    t = tw_tensor_1d(x->gs[q], TW_I32, nle, TW_MEM_HOST);
    TW_TRY(emit(r, name, &t, 0));
    snprintf(name, sizeof name, "dropped_%d", q);
    t = tw_tensor_1d(x->dropped[q], TW_I32, nle, TW_MEM_HOST);
    TW_TRY(emit(r, name, &t, 0));
  }
  if (combine) {
    tw_tensor t = tw_tensor_2d(x->out, TW_F32, x->tok.shape[0], H, TW_MEM_HOST);
    TW_TRY(emit(r, "out", &t, 0));
  }
  return TW_OK;
}

tw_status tw_exec_case(tw_ctx *ctx, const tw_case_keys *k, tw_input_fn input, void *user,
                       tw_tensor_set *outputs) {
  if (!ctx || !k || !input || !outputs) return tw_error(TW_ERR_NULL, "exec: NULL argument");
  run r;
  memset(&r, 0, sizeof r);
  r.ctx = ctx;
  r.k = k;
  r.op = tw_case_get(k, "op");
  r.input = input;
  r.user = user;
  r.out = outputs;
  if (!r.op) return tw_error(TW_ERR_INVALID_ARG, "exec: no 'op' key");
  tw_status s;
  if (strcmp(r.op, "grouped_quantize") == 0) s = exec_quantize(&r);
  else if (strcmp(r.op, "grouped_dequantize") == 0) s = exec_dequantize(&r);
  else if (strcmp(r.op, "delayed_scale_update") == 0) s = exec_delayed_update(&r);
  else if (tw_exec_op_is_gemm(r.op)) s = exec_gemm_family(&r);
  else if (strcmp(r.op, "router") == 0) s = exec_router(&r);
  else if (strcmp(r.op, "ep_dispatch") == 0) s = exec_ep(&r, 0);
  else if (strcmp(r.op, "ep_combine") == 0) s = exec_ep(&r, 1);
  else s = tw_error(TW_ERR_INVALID_ARG, "exec: unknown op '%s' (grouped_quantize, grouped_dequantize, "
                    "delayed_scale_update, gemm, grouped_gemm, grouped_gemm_wgrad, router, ep_dispatch, "
                    "ep_combine)", r.op);
  if (s != TW_OK) {
    /* keep the message: freeing context memory must not overwrite it */
    char msg[TW_ERROR_MAX];
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    run_free(&r);
    tw_error(s, "%s", msg);
    return s;
  }
  run_free(&r);
  return TW_OK;
}
