/* Partitioning rules: (global shapes, specs, options) -> a plan, or an error naming the rule.
 * See tw_shard.h for the rules in prose; each check below carries the rule's name. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "twin/tw_shard.h"

static const char *const op_names[TW_SHARD_OP_COUNT] = {"dense", "grouped_gemm", "grouped_quantize"};
static const char *const pass_names[TW_PASS_COUNT] = {"fwd", "dgrad", "wgrad"};

const char *tw_shard_op_name(tw_shard_op op) {
  return ((int)op >= 0 && op < TW_SHARD_OP_COUNT) ? op_names[op] : "?";
}
int tw_shard_op_from_name(const char *name, tw_shard_op *out) {
  for (int i = 0; name && i < TW_SHARD_OP_COUNT; i++)
    if (strcmp(name, op_names[i]) == 0) { *out = (tw_shard_op)i; return 0; }
  return -1;
}
const char *tw_pass_name(tw_pass p) { return ((int)p >= 0 && p < TW_PASS_COUNT) ? pass_names[p] : "?"; }
int tw_pass_from_name(const char *name, tw_pass *out) {
  for (int i = 0; name && i < TW_PASS_COUNT; i++)
    if (strcmp(name, pass_names[i]) == 0) { *out = (tw_pass)i; return 0; }
  return -1;
}

/* ---- small dimspec algebra ----------------------------------------------------------- */
static int ds_has(const tw_dimspec *d, tw_axis a) {
  for (int i = 0; i < d->n; i++)
    if (d->axis[i] == a) return 1;
  return 0;
}
static tw_dimspec ds_without(const tw_dimspec *d, tw_axis a) {
  tw_dimspec r = {0, {0}};
  for (int i = 0; i < d->n; i++)
    if (d->axis[i] != a) r.axis[r.n++] = d->axis[i];
  return r;
}
static int ds_first_common(const tw_dimspec *a, const tw_dimspec *b, tw_axis *out) {
  for (int i = 0; i < a->n; i++)
    if (ds_has(b, a->axis[i])) { *out = a->axis[i]; return 1; }
  return 0;
}
static void ds_add(tw_dimspec *d, tw_axis a) {
  if (!ds_has(d, a)) d->axis[d->n++] = a;
}
static const tw_dimspec ds_none = {0, {0}};
static const char *ds_str(const tw_dimspec *d, char *buf, size_t n) {
  tw_pspec p = {1, {*d}};
  char tmp[96];
  tw_pspec_str(&p, tmp, sizeof tmp);
  size_t len = strlen(tmp);
  if (len >= 2) { tmp[len - 1] = 0; snprintf(buf, n, "%s", tmp + 1); }
  else snprintf(buf, n, "%s", tmp);
  return buf;
}

static tw_status rule_error(const tw_plan *p, const char *rule, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static tw_status rule_error(const tw_plan *p, const char *rule, const char *fmt, ...) {
  char detail[600], mb[96];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  return tw_error(TW_ERR_INVALID_ARG, "plan %s %s on mesh %s: rule %s: %s", tw_shard_op_name(p->op),
                  tw_pass_name(p->pass), tw_mesh_str(&p->mesh, mb, sizeof mb), rule, detail);
}

static void note(tw_plan *p, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void note(tw_plan *p, const char *fmt, ...) {
  if (p->nnotes >= TW_PLAN_MAX_NOTES) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->notes[p->nnotes++], sizeof p->notes[0], fmt, ap);
  va_end(ap);
}

/* ---- resharding ---------------------------------------------------------------------- */
static tw_status add_step(tw_plan *p, tw_step_kind k, int tensor, int dim, tw_axis a,
                          const int64_t *shape) {
  if (p->nsteps >= TW_PLAN_MAX_STEPS)
    return tw_error(TW_ERR_INTERNAL, "plan: more than %d steps", TW_PLAN_MAX_STEPS);
  tw_plan_step *s = &p->steps[p->nsteps++];
  s->kind = k;
  s->tensor = tensor;
  s->dim = dim;
  s->axis = a;
  memcpy(s->shape, shape, sizeof s->shape);
  return TW_OK;
}

/* Steps taking tensor `ti` from spec `from` (a partial sum over `partial`) to `to`; `shape`
 * is the local shape under `from` and becomes the local shape under `to`. The all-reduces of
 * partial axes that no reduce-scatter consumes run where the tensor is smallest: before the
 * gathers or after the splits. */
static tw_status reshard(tw_plan *p, int ti, int ndim, const tw_pspec *from, const tw_pspec *to,
                         tw_dimspec partial, int64_t *shape) {
  const tw_mesh *m = &p->mesh;
  int common[TW_MAX_DIMS];
  int64_t start = 1, end = 1;
  tw_dimspec scattered = ds_none;
  for (int d = 0; d < ndim; d++) {
    const tw_dimspec *f = &from->dim[d], *t = &to->dim[d];
    int c = 0;
    while (c < f->n && c < t->n && f->axis[c] == t->axis[c]) c++;
    common[d] = c;
    for (int i = c; i < t->n; i++)
      if (ds_has(&partial, t->axis[i])) ds_add(&scattered, t->axis[i]);
    start *= shape[d];
    end *= p->t[ti].global[d] / tw_dimspec_shards(m, t);
  }
  tw_dimspec reduce = ds_none;
  for (int i = 0; i < partial.n; i++)
    if (!ds_has(&scattered, partial.axis[i])) ds_add(&reduce, partial.axis[i]);
  int reduce_first = start <= end;
  if (reduce_first)
    for (int i = 0; i < reduce.n; i++) TW_TRY(add_step(p, TW_STEP_ALL_REDUCE, ti, -1, reduce.axis[i], shape));
  for (int d = 0; d < ndim; d++) {
    const tw_dimspec *f = &from->dim[d];
    for (int i = f->n - 1; i >= common[d]; i--) {
      shape[d] *= tw_mesh_axis_size(m, f->axis[i]);
      TW_TRY(add_step(p, TW_STEP_ALL_GATHER, ti, d, f->axis[i], shape));
    }
  }
  for (int d = 0; d < ndim; d++) {
    const tw_dimspec *t = &to->dim[d];
    for (int i = common[d]; i < t->n; i++) {
      tw_axis a = t->axis[i];
      shape[d] /= tw_mesh_axis_size(m, a);
      TW_TRY(add_step(p, ds_has(&scattered, a) ? TW_STEP_REDUCE_SCATTER : TW_STEP_SLICE, ti, d, a, shape));
    }
  }
  if (!reduce_first)
    for (int i = 0; i < reduce.n; i++) TW_TRY(add_step(p, TW_STEP_ALL_REDUCE, ti, -1, reduce.axis[i], shape));
  return TW_OK;
}

static void local_shape(const tw_mesh *m, const tw_pspec *s, int ndim, const int64_t *g, int64_t *l) {
  for (int d = 0; d < TW_MAX_DIMS; d++) l[d] = d < ndim ? g[d] / tw_dimspec_shards(m, &s->dim[d]) : 0;
}

static void set_tensor(tw_plan *p, int i, const char *name, int ndim, const int64_t *global,
                       const tw_pspec *spec) {
  tw_plan_tensor *t = &p->t[i];
  t->name = name;
  t->ndim = ndim;
  memset(t->global, 0, sizeof t->global);
  memcpy(t->global, global, sizeof(int64_t) * (size_t)ndim);
  t->spec = *spec;
  t->spec.ndim = ndim;
  local_shape(&p->mesh, &t->spec, ndim, t->global, t->local);
}

/* Inputs reshard from spec to op_spec; the output from op_spec (partial) to spec. */
static tw_status finish(tw_plan *p) {
  for (int i = 0; i < 3; i++) {
    if (i >= p->ninputs && i < 2) continue;
    tw_plan_tensor *t = &p->t[i];
    t->op_spec.ndim = t->ndim;
    TW_TRY(tw_pspec_check(&p->mesh, &t->op_spec, t->ndim, t->global, t->name));
    local_shape(&p->mesh, &t->op_spec, t->ndim, t->global, t->op_local);
  }
  for (int i = 0; i < p->ninputs; i++) {
    int64_t shape[TW_MAX_DIMS];
    memcpy(shape, p->t[i].local, sizeof shape);
    TW_TRY(reshard(p, i, p->t[i].ndim, &p->t[i].spec, &p->t[i].op_spec, ds_none, shape));
  }
  int64_t shape[TW_MAX_DIMS];
  memcpy(shape, p->t[2].op_local, sizeof shape);
  TW_TRY(reshard(p, 2, p->t[2].ndim, &p->t[2].op_spec, &p->t[2].spec, p->partial, shape));
  /* Bit-exact only when the local GEMM is the global one (data movement around it): a BLAS
   * picks its kernels and summation order by shape, and partial sums add in another order. */
  p->exact = p->partial.n == 0;
  for (int i = 0; i < 3; i++)
    if (i < p->ninputs || i == 2)
      for (int d = 0; d < p->t[i].ndim; d++) p->exact &= p->t[i].op_local[d] == p->t[i].global[d];
  return TW_OK;
}

static tw_pspec spec3(int ndim, tw_dimspec a, tw_dimspec b, tw_dimspec c) {
  tw_pspec s;
  memset(&s, 0, sizeof s);
  s.ndim = ndim;
  tw_dimspec v[3] = {a, b, c};
  for (int i = 0; i < ndim && i < 3; i++) s.dim[i] = v[i];
  return s;
}

/* ---- dense --------------------------------------------------------------------------- */
static tw_status rule_dense(tw_plan *p, const tw_shard_operand *x, const tw_shard_operand *w) {
  char b1[64], b2[64];
  const tw_mesh *m = &p->mesh;
  int xb = x->ndim == 3, wb = w->ndim == 3;
  if (x->ndim < 2 || x->ndim > 3 || w->ndim < 2 || w->ndim > 3 || (wb && !xb))
    return tw_error(TW_ERR_SHAPE, "plan dense: x must be [B?, M, K] and w [B?, K, N] (w batched only when x is); got %d-d and %d-d",
                    x->ndim, w->ndim);
  int64_t B = xb ? x->shape[0] : 1, M = x->shape[xb], K = x->shape[xb + 1];
  int64_t Kw = w->shape[wb], N = w->shape[wb + 1];
  if (Kw != K || (wb && w->shape[0] != B))
    return tw_error(TW_ERR_SHAPE, "plan dense: x [.., %lld, %lld] and w [.., %lld, %lld] disagree (K or B)",
                    (long long)M, (long long)K, (long long)Kw, (long long)N);
  TW_TRY(tw_pspec_check(m, &x->spec, x->ndim, x->shape, "x"));
  TW_TRY(tw_pspec_check(m, &w->spec, w->ndim, w->shape, "w"));
  tw_dimspec b = xb ? x->spec.dim[0] : ds_none;
  tw_dimspec xm = x->spec.dim[xb];
  if (wb && !tw_pspec_equal(&(tw_pspec){1, {w->spec.dim[0]}}, &(tw_pspec){1, {b}}))
    return rule_error(p, "gemm.batch", "w's batch dim is sharded %s but x's is %s; they must match",
                      ds_str(&w->spec.dim[0], b1, sizeof b1), ds_str(&b, b2, sizeof b2));
  tw_dimspec wk = w->spec.dim[wb], wn = w->spec.dim[wb + 1];
  tw_dimspec R = ds_without(&wk, TW_AXIS_FSDP), Nn = ds_without(&wn, TW_AXIS_FSDP);
  if (R.n != wk.n || Nn.n != wn.n) note(p, "fsdp: w's fsdp shards are all-gathered before the op");
  if (R.n && Nn.n)
    return rule_error(p, "gemm.rhs_k_and_n", "w is sharded on K (%s) and on N (%s); shard one of them",
                      ds_str(&R, b1, sizeof b1), ds_str(&Nn, b2, sizeof b2));
  tw_axis a;
  if (ds_first_common(&b, &R, &a) || ds_first_common(&b, &Nn, &a))
    return rule_error(p, "gemm.batch_axis_reuse", "axis %s shards the batch and w's %s", tw_axis_name(a),
                      ds_has(&R, a) ? "K" : "N");
  int scatter_m = R.n && xm.n;
  if (scatter_m && M % tw_dimspec_shards(m, &R) != 0)
    return rule_error(p, "gemm.reduce_scatter_m", "M = %lld does not split over %s (%d shards) for the reduce-scatter",
                      (long long)M, ds_str(&R, b1, sizeof b1), tw_dimspec_shards(m, &R));
  int64_t ys[3] = {B, M, N}, dxs[3] = {B, M, K}, dws[3] = {B, K, N};
  const int64_t *y = xb ? ys : ys + 1, *dx = xb ? dxs : dxs + 1, *dw = wb ? dws : dws + 1;
  tw_pspec yspec = xb ? spec3(3, b, scatter_m ? R : ds_none, Nn) : spec3(2, scatter_m ? R : ds_none, Nn, ds_none);
  tw_pspec xop = xb ? spec3(3, b, ds_none, R) : spec3(2, ds_none, R, ds_none);
  tw_pspec wop = wb ? spec3(3, b, R, Nn) : spec3(2, R, Nn, ds_none);
  tw_pspec yop = xb ? spec3(3, b, ds_none, Nn) : spec3(2, ds_none, Nn, ds_none);
  if (scatter_m)
    note(p, p->pass == TW_PASS_FWD ? "gemm: M and K both sharded: the output is reduce-scattered along M"
                                   : "gemm: M and K both sharded: dy comes sharded along M, as the forward's "
                                     "reduce-scatter left y");
  switch (p->pass) {
    case TW_PASS_FWD:
      set_tensor(p, 0, "x", x->ndim, x->shape, &x->spec);
      set_tensor(p, 1, "w", w->ndim, w->shape, &w->spec);
      set_tensor(p, 2, "y", x->ndim, y, &yspec);
      p->t[0].op_spec = xop; p->t[1].op_spec = wop; p->t[2].op_spec = yop;
      p->partial = R;
      break;
    case TW_PASS_DGRAD:
      set_tensor(p, 0, "dy", x->ndim, y, &yspec);
      set_tensor(p, 1, "w", w->ndim, w->shape, &w->spec);
      set_tensor(p, 2, "dx", x->ndim, dx, &x->spec);
      p->t[0].op_spec = yop; p->t[1].op_spec = wop; p->t[2].op_spec = xop;
      p->partial = Nn;
      break;
    default:
      set_tensor(p, 0, "x", x->ndim, x->shape, &x->spec);
      set_tensor(p, 1, "dy", x->ndim, y, &yspec);
      set_tensor(p, 2, "dw", w->ndim, dw, &w->spec);
      p->t[0].op_spec = xop; p->t[1].op_spec = yop; p->t[2].op_spec = wop;
      p->partial = wb ? ds_none : b; /* w shared over the batch: its grad sums the batch shards */
      break;
  }
  return finish(p);
}

/* ---- grouped GEMM ---------------------------------------------------------------------- */
static void dims_axes(const tw_pspec *s, int from, int to, tw_dimspec *out) {
  for (int d = from; d < to; d++)
    for (int i = 0; i < s->dim[d].n; i++) ds_add(out, s->dim[d].axis[i]);
}

/* fp8 inputs, in every pass: the row-grouped inputs (x, dy) quantized after their steps, per
 * local group, the amax over the axes of their op spec (not ep when the experts are on ep:
 * those ranks hold other experts' rows); w (fwd, dgrad) after its steps or, quantizing before
 * the gather, before them, per expert over its K / N axes. The step list is rebuilt in that
 * order. The wgrad's inputs are x and dy, both row-grouped. */
static tw_status add_quantize_steps(tw_plan *p) {
  tw_plan_step old[TW_PLAN_MAX_STEPS];
  int n = p->nsteps;
  memcpy(old, p->steps, sizeof old);
  if (n + 2 > TW_PLAN_MAX_STEPS) return tw_error(TW_ERR_INTERNAL, "plan: more than %d steps", TW_PLAN_MAX_STEPS);
  const int has_w = p->pass != TW_PASS_WGRAD;
  tw_plan_step qx, qw;
  memset(&qx, 0, sizeof qx);
  memset(&qw, 0, sizeof qw);
  qx.kind = qw.kind = TW_STEP_QUANTIZE;
  qx.tensor = 0;
  qw.tensor = 1;
  qx.dim = qw.dim = -1;
  memcpy(qx.shape, p->t[0].op_local, sizeof qx.shape);
  int qbg = p->opts.quantize_before_gather;
  memcpy(qw.shape, qbg ? p->t[1].local : p->t[1].op_local, sizeof qw.shape);
  dims_axes(&p->t[0].op_spec, 0, 2, &qx.axes);
  if (p->experts_on_ep) qx.axes = ds_without(&qx.axes, TW_AXIS_EP); /* ep ranks hold other experts */
  if (has_w) {
    dims_axes(qbg ? &p->t[1].spec : &p->t[1].op_spec, 1, 3, &qw.axes);
  } else { /* dy: row-grouped like x */
    dims_axes(&p->t[1].op_spec, 0, 2, &qw.axes);
    if (p->experts_on_ep) qw.axes = ds_without(&qw.axes, TW_AXIS_EP);
  }
  p->nsteps = 0;
  for (int i = 0; i < n; i++)
    if (old[i].tensor == 0) p->steps[p->nsteps++] = old[i];
  p->steps[p->nsteps++] = qx;
  /* before the gather, w first drops the experts of other ep ranks (slices along dim 0
   * change no expert's amax), so only its own experts are quantized */
  int moved[TW_PLAN_MAX_STEPS] = {0};
  if (qbg)
    for (int i = 0; i < n; i++)
      if (old[i].tensor == 1 && old[i].kind == TW_STEP_SLICE && old[i].dim == 0) {
        p->steps[p->nsteps++] = old[i];
        memcpy(qw.shape, old[i].shape, sizeof qw.shape);
        moved[i] = 1;
      }
  if (qbg) p->steps[p->nsteps++] = qw;
  for (int i = 0; i < n; i++)
    if (old[i].tensor == 1 && !moved[i]) p->steps[p->nsteps++] = old[i];
  if (!qbg) p->steps[p->nsteps++] = qw;
  /* the local shapes after each of w's steps, in the new order */
  int64_t shape[TW_MAX_DIMS];
  memcpy(shape, p->t[1].local, sizeof shape);
  for (int i = 0; i < p->nsteps; i++) {
    tw_plan_step *st = &p->steps[i];
    if (st->tensor != 1) continue;
    if (st->kind == TW_STEP_ALL_GATHER) shape[st->dim] *= tw_mesh_axis_size(&p->mesh, st->axis);
    if (st->kind == TW_STEP_SLICE) shape[st->dim] /= tw_mesh_axis_size(&p->mesh, st->axis);
    memcpy(st->shape, shape, sizeof shape);
  }
  for (int i = 0; i < n; i++)
    if (old[i].tensor == 2) p->steps[p->nsteps++] = old[i];
  note(p, "grouped_gemm: %s and %s quantized to %s (current scaling, per group, global amax)%s", p->t[0].name, p->t[1].name,
       tw_dtype_name(p->opts.fp8), qbg ? "; w quantized before its gather: fp8 bytes and scales travel" : "");
  return TW_OK;
}

static tw_status rule_grouped_gemm(tw_plan *p, const tw_shard_operand *x, const tw_shard_operand *w) {
  char b1[64], b2[64];
  const tw_mesh *m = &p->mesh;
  if (x->ndim != 2 || w->ndim != 3)
    return tw_error(TW_ERR_SHAPE, "plan grouped_gemm: x must be [M, K] and w [G, K, N]; got %d-d and %d-d",
                    x->ndim, w->ndim);
  int64_t M = x->shape[0], K = x->shape[1], G = w->shape[0], N = w->shape[2];
  if (w->shape[1] != K)
    return tw_error(TW_ERR_SHAPE, "plan grouped_gemm: x has K = %lld but w is [%lld, %lld, %lld]",
                    (long long)K, (long long)G, (long long)w->shape[1], (long long)N);
  if (p->groups != G)
    return tw_error(TW_ERR_SHAPE, "plan grouped_gemm: %lld groups but w has %lld experts",
                    (long long)p->groups, (long long)G);
  TW_TRY(tw_pspec_check(m, &x->spec, 2, x->shape, "x"));
  TW_TRY(tw_pspec_check(m, &w->spec, 3, w->shape, "w"));
  if (p->opts.quantize_inputs) {
    if (p->opts.quantize_before_gather && p->pass == TW_PASS_WGRAD)
      return rule_error(p, "grouped_gemm.quantize_before_gather_needs_w", "quantize_before_gather quantizes w before its all-gather; "
                        "the wgrad GEMM's inputs are x and dy, so there is no w to gather");
    if (!tw_dtype_is_fp8(p->opts.fp8))
      return tw_error(TW_ERR_DTYPE, "plan grouped_gemm: opts.fp8 must be e4m3, got %s",
                      tw_dtype_name(p->opts.fp8) ? tw_dtype_name(p->opts.fp8) : "?");
    if (p->opts.fp8 == TW_E5M2)
      return rule_error(p, "grouped_gemm.fp8_pair", "both inputs e5m2: e5m2 x e5m2 is no GEMM (TE rejects it); use e4m3");
  } else if (p->opts.quantize_before_gather) {
    return rule_error(p, "grouped_gemm.quantize_before_gather_needs_fp8", "quantize_before_gather needs quantize_inputs");
  }
  tw_dimspec rows = x->spec.dim[0], wg = w->spec.dim[0];
  int ep_rows = ds_has(&rows, TW_AXIS_EP);
  if (ep_rows && rows.axis[0] != TW_AXIS_EP)
    return rule_error(p, "grouped_gemm.ep_major", "x's rows are sharded %s; ep must come first so each ep rank holds its experts' rows",
                      ds_str(&rows, b1, sizeof b1));
  if (wg.n > 1 || (wg.n == 1 && wg.axis[0] != TW_AXIS_EP))
    return rule_error(p, "grouped_gemm.expert_dim", "w's expert dim is sharded %s; it takes ep or nothing",
                      ds_str(&wg, b1, sizeof b1));
  if (wg.n == 1 && !ep_rows)
    return rule_error(p, "grouped_gemm.ep_rows", "w's experts are split over ep but x's rows (%s) are not",
                      ds_str(&rows, b1, sizeof b1));
  tw_pspec wspec = w->spec;
  if (ep_rows && wg.n == 0) {
    if (ds_has(&w->spec.dim[1], TW_AXIS_EP) || ds_has(&w->spec.dim[2], TW_AXIS_EP))
      return rule_error(p, "grouped_gemm.axis_reuse", "ep shards x's rows and w's K or N");
    note(p, "grouped_gemm.ep_inject: ep added to w's expert dim (each rank keeps its %lld experts)",
         (long long)(G / tw_mesh_axis_size(m, TW_AXIS_EP)));
    wspec.dim[0].n = 1;
    wspec.dim[0].axis[0] = TW_AXIS_EP;
    TW_TRY(tw_pspec_check(m, &wspec, 3, w->shape, "w (ep injected)"));
  }
  p->experts_on_ep = ep_rows;
  tw_dimspec wk = w->spec.dim[1], wn = w->spec.dim[2];
  tw_dimspec R = ds_without(&wk, TW_AXIS_FSDP), Nn = ds_without(&wn, TW_AXIS_FSDP);
  if (R.n != wk.n || Nn.n != wn.n) note(p, "fsdp: w's fsdp shards are all-gathered before the op");
  if (R.n && Nn.n)
    return rule_error(p, "grouped_gemm.rhs_k_and_n", "w is sharded on K (%s) and on N (%s); shard one of them",
                      ds_str(&R, b1, sizeof b1), ds_str(&Nn, b2, sizeof b2));
  tw_axis a;
  if (ds_first_common(&rows, &R, &a) || ds_first_common(&rows, &Nn, &a))
    return rule_error(p, "grouped_gemm.axis_reuse", "axis %s shards x's rows and w's %s; group sizes are per row shard, so rows are never gathered",
                      tw_axis_name(a), ds_has(&R, a) ? "K" : "N");
  tw_dimspec eg = ep_rows ? (tw_dimspec){1, {TW_AXIS_EP}} : ds_none;
  tw_pspec xop = spec3(2, rows, R, ds_none), wop = spec3(3, eg, R, Nn), yop = spec3(2, rows, Nn, ds_none);
  tw_pspec yspec = yop;
  int64_t y[2] = {M, N}, dx[2] = {M, K};
  tw_dimspec row_partial = ds_without(&rows, TW_AXIS_EP);
  switch (p->pass) {
    case TW_PASS_FWD:
      set_tensor(p, 0, "x", 2, x->shape, &x->spec);
      set_tensor(p, 1, "w", 3, w->shape, &w->spec);
      set_tensor(p, 2, "y", 2, y, &yspec);
      p->t[0].op_spec = xop; p->t[1].op_spec = wop; p->t[2].op_spec = yop;
      p->partial = R;
      break;
    case TW_PASS_DGRAD:
      set_tensor(p, 0, "dy", 2, y, &yspec);
      set_tensor(p, 1, "w", 3, w->shape, &w->spec);
      set_tensor(p, 2, "dx", 2, dx, &x->spec);
      p->t[0].op_spec = yop; p->t[1].op_spec = wop; p->t[2].op_spec = xop;
      p->partial = Nn;
      break;
    default:
      set_tensor(p, 0, "x", 2, x->shape, &x->spec);
      set_tensor(p, 1, "dy", 2, y, &yspec);
      set_tensor(p, 2, "dw", 3, w->shape, &w->spec);
      p->t[0].op_spec = xop; p->t[1].op_spec = yop; p->t[2].op_spec = wop;
      p->partial = row_partial; /* each row shard holds part of every local group */
      break;
  }
  TW_TRY(finish(p));
  return p->opts.quantize_inputs ? add_quantize_steps(p) : TW_OK;
}

/* ---- grouped quantize ------------------------------------------------------------------ */
static tw_status rule_quantize(tw_plan *p, const tw_shard_operand *x) {
  char b1[64];
  const tw_mesh *m = &p->mesh;
  const tw_quantize_opts *q = &p->opts.quant;
  if (x->ndim != 2)
    return tw_error(TW_ERR_SHAPE, "plan grouped_quantize: x must be [M, K]; got %d-d", x->ndim);
  if (p->pass != TW_PASS_FWD)
    return tw_error(TW_ERR_INVALID_ARG, "plan grouped_quantize: only the fwd pass exists (got %s)", tw_pass_name(p->pass));
  if (p->groups < 1)
    return tw_error(TW_ERR_INVALID_ARG, "plan grouped_quantize: %lld groups (need >= 1)", (long long)p->groups);
  tw_qtensor probe;
  TW_TRY(tw_quantize_output_shapes(q, x->shape[0], x->shape[1], p->groups, &probe));
  TW_TRY(tw_pspec_check(m, &x->spec, 2, x->shape, "x"));
  tw_dimspec rows = x->spec.dim[0], cols = x->spec.dim[1];
  int colwise = q->layout & TW_COLWISE, rowwise = q->layout & TW_ROWWISE;
  if (colwise && q->col_padded && (rows.n || cols.n))
    return rule_error(p, "quantize.col_padded", "the token-padded colwise layout places each group by the sizes of all "
                      "groups over all of x, so no shard's copy is a slice of it; x is sharded %s x %s",
                      ds_str(&rows, b1, sizeof b1), rows.n && cols.n ? "(and K)" : cols.n ? "on K" : "on M");
  int along_m = (colwise && (q->mode == TW_SCALE_MXFP8_1D || q->mode == TW_SCALE_BLOCK_1x128)) ||
                q->mode == TW_SCALE_BLOCK_128x128;
  if (along_m && rows.n)
    return rule_error(p, "quantize.blocks_along_m", "%s %s blocks run along M, which is sharded %s; a block could straddle two shards",
                      tw_scaling_name(q->mode), colwise ? "colwise" : "", ds_str(&rows, b1, sizeof b1));
  int kblock = 0;
  if (rowwise && q->mode == TW_SCALE_MXFP8_1D) kblock = 32;
  if ((rowwise && q->mode == TW_SCALE_BLOCK_1x128) || q->mode == TW_SCALE_BLOCK_128x128) kblock = 128;
  int64_t Kl = x->shape[1] / tw_dimspec_shards(m, &cols);
  if (kblock && cols.n && Kl % kblock != 0)
    return rule_error(p, "quantize.k_block", "K is sharded %s into %lld columns per shard, not a multiple of the %d-wide %s blocks",
                      ds_str(&cols, b1, sizeof b1), (long long)Kl, kblock, tw_scaling_name(q->mode));
  set_tensor(p, 0, "x", 2, x->shape, &x->spec);
  set_tensor(p, 2, "q", 2, x->shape, &x->spec);
  p->t[0].op_spec = x->spec;
  p->t[2].op_spec = x->spec;
  p->partial = ds_none;
  TW_TRY(finish(p));
  p->exact = 1; /* elementwise given the global scales; blocks never straddle shards */
  if (q->mode == TW_SCALE_TENSOR_CURRENT || q->mode == TW_SCALE_TENSOR_DELAYED) {
    for (int d = 0; d < 2; d++)
      for (int i = 0; i < x->spec.dim[d].n; i++) ds_add(&p->amax_axes, x->spec.dim[d].axis[i]);
    int64_t gshape[TW_MAX_DIMS] = {p->groups, 0, 0, 0};
    for (int i = 0; i < p->amax_axes.n; i++)
      TW_TRY(add_step(p, TW_STEP_AMAX_MAX, 2, -1, p->amax_axes.axis[i], gshape));
    if (p->amax_axes.n) note(p, "quantize: per-group amax max-reduced over the axes that shard x");
  }
  return TW_OK;
}

tw_status tw_plan_make(const tw_mesh *mesh, tw_shard_op op, tw_pass pass, const tw_shard_operand *x,
                       const tw_shard_operand *w, int64_t groups, const tw_rule_opts *opts, tw_plan *plan) {
  if (!mesh || !x || !plan) return tw_error(TW_ERR_NULL, "plan: mesh, x or plan is NULL");
  if ((int)op < 0 || op >= TW_SHARD_OP_COUNT) return tw_error(TW_ERR_INVALID_ARG, "plan: unknown op %d", (int)op);
  if ((int)pass < 0 || pass >= TW_PASS_COUNT) return tw_error(TW_ERR_INVALID_ARG, "plan: unknown pass %d", (int)pass);
  if (op != TW_SHARD_GROUPED_QUANTIZE && !w) return tw_error(TW_ERR_NULL, "plan %s: w is NULL", tw_shard_op_name(op));
  if (opts && opts->size != sizeof(tw_rule_opts))
    return tw_error(TW_ERR_INVALID_ARG, "plan: opts->size is %zu, expected %zu (use TW_RULE_OPTS_INIT)",
                    opts->size, sizeof(tw_rule_opts));
  tw_mesh checked;
  TW_TRY(tw_mesh_init(&checked, mesh->naxes, mesh->axis, mesh->size));
  memset(plan, 0, sizeof *plan);
  plan->op = op;
  plan->pass = pass;
  plan->mesh = checked;
  tw_rule_opts def = TW_RULE_OPTS_INIT;
  plan->opts = opts ? *opts : def;
  plan->groups = groups;
  plan->ninputs = op == TW_SHARD_GROUPED_QUANTIZE ? 1 : 2;
  tw_status s;
  switch (op) {
    case TW_SHARD_DENSE: s = rule_dense(plan, x, w); break;
    case TW_SHARD_GROUPED_GEMM: s = rule_grouped_gemm(plan, x, w); break;
    default: s = rule_quantize(plan, x); break;
  }
  if (s != TW_OK) plan->nsteps = 0;
  return s;
}

/* ---- printing ------------------------------------------------------------------------ */
static const char *shape_str(int ndim, const int64_t *s, char *buf, size_t n) {
  size_t u = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < ndim && u < n; i++) u += (size_t)snprintf(buf + u, n - u, "%s%lld", i ? ", " : "", (long long)s[i]);
  if (u < n) snprintf(buf + u, n - u, "]");
  return buf;
}

static const char *step_name(tw_step_kind k) {
  switch (k) {
    case TW_STEP_ALL_GATHER: return "all-gather";
    case TW_STEP_SLICE: return "slice";
    case TW_STEP_REDUCE_SCATTER: return "reduce-scatter(sum)";
    case TW_STEP_ALL_REDUCE: return "all-reduce(sum)";
    case TW_STEP_QUANTIZE: return "quantize";
    default: return "all-reduce(max) amax";
  }
}

static const char *local_op_desc(const tw_plan *p) {
  switch (p->op) {
    case TW_SHARD_DENSE:
      return p->pass == TW_PASS_FWD ? "gemm y = x @ w" : p->pass == TW_PASS_DGRAD ? "gemm dx = dy @ w^T" : "gemm dw = x^T @ dy";
    case TW_SHARD_GROUPED_GEMM:
      return p->pass == TW_PASS_FWD     ? "grouped_gemm y_g = x_g @ w[g]"
             : p->pass == TW_PASS_DGRAD ? "grouped_gemm dx_g = dy_g @ w[g]^T"
                                        : "grouped_gemm_wgrad dw[g] = x_g^T @ dy_g";
    default: return "grouped_quantize";
  }
}

const char *tw_plan_format(const tw_plan *p, char *buf, size_t n) {
  if (!buf || n == 0) return "";
  buf[0] = 0;
  if (!p) return buf;
  char mb[96], s1[96], s2[96], s3[96], s4[96], s5[96];
  size_t u = 0;
#define OUT(...) do { if (u < n) u += (size_t)snprintf(buf + u, n - u, __VA_ARGS__); } while (0)
  OUT("plan %s %s on mesh %s (%d ranks)%s\n", tw_shard_op_name(p->op), tw_pass_name(p->pass),
      tw_mesh_str(&p->mesh, mb, sizeof mb), tw_mesh_ranks(&p->mesh), p->exact ? ", exact" : ", within the GEMM bound");
  if (p->op == TW_SHARD_GROUPED_QUANTIZE)
    OUT("  quantize %s %s layout %d, %lld groups\n", tw_scaling_name(p->opts.quant.mode),
        tw_dtype_name(p->opts.quant.qdtype), (int)p->opts.quant.layout, (long long)p->groups);
  for (int i = 0; i < 3; i++) {
    if (i >= p->ninputs && i < 2) continue;
    const tw_plan_tensor *t = &p->t[i];
    OUT("  %-3s %-5s global %s spec %s local %s | at op %s local %s\n", i == 2 ? "out" : "in", t->name,
        shape_str(t->ndim, t->global, s1, sizeof s1), tw_pspec_str(&t->spec, s2, sizeof s2),
        shape_str(t->ndim, t->local, s3, sizeof s3), tw_pspec_str(&t->op_spec, s4, sizeof s4),
        shape_str(t->ndim, t->op_local, s5, sizeof s5));
  }
  int before = 0;
  for (int i = 0; i < p->nsteps; i++) before += p->steps[i].tensor < 2;
  OUT("  before:%s\n", before ? "" : " nothing");
  for (int i = 0; i < p->nsteps; i++) {
    const tw_plan_step *s = &p->steps[i];
    if (s->tensor >= 2) continue;
    if (s->kind == TW_STEP_QUANTIZE)
      OUT("    %-5s quantize to %s, per-group amax max-reduced over %s -> %s\n", p->t[s->tensor].name,
          tw_dtype_name(p->opts.fp8), s->axes.n ? ds_str(&s->axes, s2, sizeof s2) : "nothing",
          shape_str(p->t[s->tensor].ndim, s->shape, s1, sizeof s1));
    else
      OUT("    %-5s %s over %s along dim %d -> %s\n", p->t[s->tensor].name, step_name(s->kind),
          tw_axis_name(s->axis), s->dim, shape_str(p->t[s->tensor].ndim, s->shape, s1, sizeof s1));
  }
  OUT("  local: %s -> %s %s\n", local_op_desc(p), p->t[2].name, shape_str(p->t[2].ndim, p->t[2].op_local, s1, sizeof s1));
  if (p->partial.n) OUT("         (a partial sum over %s)\n", ds_str(&p->partial, s1, sizeof s1));
  OUT("  after:%s\n", p->nsteps - before ? "" : " nothing");
  for (int i = 0; i < p->nsteps; i++) {
    const tw_plan_step *s = &p->steps[i];
    if (s->tensor < 2) continue;
    if (s->kind == TW_STEP_AMAX_MAX)
      OUT("    amax  %s over %s -> [%lld]\n", step_name(s->kind), tw_axis_name(s->axis), (long long)p->groups);
    else if (s->dim < 0)
      OUT("    %-5s %s over %s\n", p->t[2].name, step_name(s->kind), tw_axis_name(s->axis));
    else
      OUT("    %-5s %s over %s along dim %d -> %s\n", p->t[2].name, step_name(s->kind), tw_axis_name(s->axis),
          s->dim, shape_str(p->t[2].ndim, s->shape, s1, sizeof s1));
  }
  for (int i = 0; i < p->nnotes; i++) OUT("  note: %s\n", p->notes[i]);
#undef OUT
  return buf;
}

/* ---- local groups ---------------------------------------------------------------------- */
tw_status tw_plan_local_groups(const tw_plan *p, int rank, const int32_t *gs, int32_t *local, int64_t *G_local) {
  if (!p || !gs || !local || !G_local) return tw_error(TW_ERR_NULL, "plan_local_groups: NULL argument");
  if (p->op == TW_SHARD_DENSE) return tw_error(TW_ERR_INVALID_ARG, "plan_local_groups: dense plans have no groups");
  if (rank < 0 || rank >= tw_mesh_ranks(&p->mesh))
    return tw_error(TW_ERR_INVALID_ARG, "plan_local_groups: rank %d of %d", rank, tw_mesh_ranks(&p->mesh));
  /* the rows the local op sees: x's op spec (the same for every pass's row-carrying tensors) */
  const tw_plan_tensor *rt = &p->t[0]; /* x or dy: rows at dim 0 under the same spec */
  const tw_dimspec *rows = &rt->op_spec.dim[0];
  int64_t M = rt->global[0], G = p->groups;
  int64_t Ml = M / tw_dimspec_shards(&p->mesh, rows);
  int64_t lo = (int64_t)tw_dimspec_index(&p->mesh, rows, rank) * Ml, hi = lo + Ml;
  int64_t off = 0, sum = 0;
  for (int64_t g = 0; g < G; g++) {
    if (gs[g] < 0)
      return tw_error(TW_ERR_INVALID_ARG, "plan_local_groups: group_sizes[%lld] = %d is negative", (long long)g, gs[g]);
    sum += gs[g];
  }
  if (sum > M)
    return tw_error(TW_ERR_INVALID_ARG, "plan_local_groups: group_sizes sum to %lld but x has %lld rows",
                    (long long)sum, (long long)M);
  int64_t g0 = 0, Gl = G;
  if (p->experts_on_ep) {
    int ep = tw_mesh_axis_size(&p->mesh, TW_AXIS_EP);
    Gl = G / ep;
    g0 = (int64_t)tw_mesh_coord(&p->mesh, rank, TW_AXIS_EP) * Gl;
  }
  for (int64_t g = 0; g < G; g++) {
    int64_t a = off > lo ? off : lo, b = off + gs[g] < hi ? off + gs[g] : hi;
    int64_t cnt = b > a ? b - a : 0;
    off += gs[g];
    if (g >= g0 && g < g0 + Gl) local[g - g0] = (int32_t)cnt;
    else if (cnt)
      return tw_error(TW_ERR_INVALID_ARG,
                      "plan_local_groups: rank %d holds rows [%lld, %lld), with %lld rows of group %lld, but its experts are %lld..%lld (ep places expert g on ep rank g/%lld)",
                      rank, (long long)lo, (long long)hi, (long long)cnt, (long long)g, (long long)g0,
                      (long long)(g0 + Gl - 1), (long long)Gl);
  }
  *G_local = Gl;
  return TW_OK;
}

tw_status tw_plan_quantize_shapes(const tw_plan *p, tw_qtensor *q) {
  if (!p || !q) return tw_error(TW_ERR_NULL, "plan_quantize_shapes: NULL argument");
  if (p->op != TW_SHARD_GROUPED_QUANTIZE)
    return tw_error(TW_ERR_INVALID_ARG, "plan_quantize_shapes: a %s plan", tw_shard_op_name(p->op));
  return tw_quantize_output_shapes(&p->opts.quant, p->t[0].local[0], p->t[0].local[1], p->groups, q);
}
