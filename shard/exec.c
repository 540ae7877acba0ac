/* The executor: runs a plan for one rank on any backend and communicator. Local ops go
 * through the public interface (tw_gemm.h, tw_quantize.h), collectives through tw_comm.h,
 * data rearrangement through tw_tensor_copy on byte views; nothing here knows the backend. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_shard.h"

struct tw_mesh_comms {
  tw_mesh mesh;
  int rank;
  tw_comm *axis[TW_AXIS_COUNT];
};

tw_status tw_mesh_comms_create(tw_ctx *ctx, const tw_mesh *mesh, tw_mesh_comms **out) {
  if (!ctx || !mesh || !out) return tw_error(TW_ERR_NULL, "mesh_comms_create: NULL argument");
  *out = NULL;
  tw_mesh m;
  TW_TRY(tw_mesh_init(&m, mesh->naxes, mesh->axis, mesh->size));
  tw_comm *world = tw_ctx_comm(ctx);
  int n = tw_mesh_ranks(&m);
  char mb[96];
  if (!world && n != 1)
    return tw_error(TW_ERR_INVALID_ARG, "mesh_comms_create: mesh %s has %d ranks but the context has no communicator",
                    tw_mesh_str(&m, mb, sizeof mb), n);
  if (world && tw_comm_size(world) != n)
    return tw_error(TW_ERR_INVALID_ARG, "mesh_comms_create: mesh %s has %d ranks but the communicator has %d",
                    tw_mesh_str(&m, mb, sizeof mb), n, tw_comm_size(world));
  tw_mesh_comms *mc = (tw_mesh_comms *)calloc(1, sizeof *mc);
  if (!mc) return tw_error(TW_ERR_MEMORY, "mesh_comms_create: out of host memory");
  mc->mesh = m;
  mc->rank = world ? tw_comm_rank(world) : 0;
  for (int i = 0; i < m.naxes; i++) {
    if (m.size[i] == 1) continue;
    int stride = 1;
    for (int j = m.naxes - 1; j > i; j--) stride *= m.size[j];
    int coord = (mc->rank / stride) % m.size[i];
    /* ranks that differ only along axis i share a color: the rank with coordinate 0 there */
    tw_status s = tw_comm_split(world, mc->rank - coord * stride, coord, &mc->axis[m.axis[i]]);
    if (s != TW_OK) {
      tw_mesh_comms_destroy(mc);
      return s;
    }
  }
  *out = mc;
  return TW_OK;
}

tw_status tw_mesh_comms_destroy(tw_mesh_comms *mc) {
  if (!mc) return TW_OK;
  tw_status s = TW_OK;
  for (int a = 0; a < TW_AXIS_COUNT; a++) {
    tw_status t = tw_comm_destroy(mc->axis[a]);
    if (s == TW_OK) s = t;
  }
  free(mc);
  return s;
}

tw_comm *tw_mesh_comms_axis(const tw_mesh_comms *mc, tw_axis a) {
  return mc && (int)a >= 0 && a < TW_AXIS_COUNT ? mc->axis[a] : NULL;
}
int tw_mesh_comms_rank(const tw_mesh_comms *mc) { return mc ? mc->rank : -1; }
const tw_mesh *tw_mesh_comms_mesh(const tw_mesh_comms *mc) { return mc ? &mc->mesh : NULL; }

tw_status tw_mesh_comms_wait(tw_ctx *ctx, tw_mesh_comms *mc) {
  if (!ctx || !mc) return tw_error(TW_ERR_NULL, "mesh_comms_wait: NULL argument");
  for (int a = 0; a < TW_AXIS_COUNT; a++) {
    if (!mc->axis[a]) continue;
    tw_status s = tw_comm_wait(ctx, mc->axis[a]);
    if (s == TW_OK) continue;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    for (int b = 0; b < TW_AXIS_COUNT; b++)
      if (mc->axis[b]) tw_comm_abort(mc->axis[b]);
    if (tw_ctx_comm(ctx)) tw_comm_abort(tw_ctx_comm(ctx));
    return tw_error(s, "%s", msg);
  }
  return TW_OK;
}

/* ---- buffers ------------------------------------------------------------------------- */
/* A tensor and whether this executor allocated its data (freed with tw_free). */
typedef struct {
  tw_tensor t;
  int owned;
} buf;

static void buf_drop(tw_ctx *ctx, buf *b) {
  if (b->owned && b->t.data) tw_free(ctx, b->t.data);
  b->t.data = NULL;
  b->owned = 0;
}

static tw_status buf_new(tw_ctx *ctx, buf *b, tw_dtype dt, int ndim, const int64_t *shape) {
  memset(b, 0, sizeof *b);
  b->t.dtype = dt;
  b->t.ndim = ndim;
  b->t.mem = tw_ctx_mem(ctx);
  for (int d = 0; d < ndim; d++) b->t.shape[d] = shape[d];
  size_t bytes = tw_tensor_bytes(&b->t);
  TW_TRY(tw_alloc(ctx, bytes, &b->t.data));
  b->owned = 1;
  return TW_OK;
}

static tw_status copy_bytes(tw_ctx *ctx, void *dst, const void *src, size_t n) {
  if (n == 0) return TW_OK;
  tw_mem m = tw_ctx_mem(ctx);
  tw_tensor d = tw_tensor_1d(dst, TW_U8, (int64_t)n, m), s = tw_tensor_1d((void *)src, TW_U8, (int64_t)n, m);
  return tw_tensor_copy(ctx, &d, &s);
}

static int64_t prod(const int64_t *s, int from, int to) {
  int64_t p = 1;
  for (int i = from; i < to; i++) p *= s[i];
  return p;
}

static tw_comm *axis_comm(tw_mesh_comms *mc, tw_axis a, tw_status *s) {
  tw_comm *c = mc->axis[a];
  if (!c) *s = tw_error(TW_ERR_INTERNAL, "plan_run: no communicator for axis %s", tw_axis_name(a));
  return c;
}

/* One step on `cur` (replaced by the new buffer, the old one dropped). */
static tw_status apply_step(tw_ctx *ctx, tw_mesh_comms *mc, const tw_plan_step *st, buf *cur) {
  tw_status s = TW_OK;
  tw_comm *comm = axis_comm(mc, st->axis, &s);
  if (!comm) return s;
  int n = tw_comm_size(comm), nd = cur->t.ndim;
  size_t es = tw_dtype_storage_bytes(cur->t.dtype, 1);
  if (st->kind == TW_STEP_ALL_REDUCE)
    return tw_all_reduce(ctx, comm, cur->t.data, cur->t.data, tw_tensor_numel(&cur->t), cur->t.dtype, TW_REDUCE_SUM);
  int d = st->dim;
  if (d < 0 || d >= nd)
    return tw_error(TW_ERR_INVALID_ARG, "plan_run: a step on dim %d of a %d-d tensor", d, nd);
  for (int k = 0; k < nd; k++) { /* a plan edited by hand must not make us write out of bounds */
    int64_t want = k != d ? cur->t.shape[k] : st->kind == TW_STEP_ALL_GATHER ? cur->t.shape[k] * n : cur->t.shape[k] / n;
    if (st->shape[k] != want || (k == d && st->kind != TW_STEP_ALL_GATHER && cur->t.shape[k] % n))
      return tw_error(TW_ERR_INVALID_ARG, "plan_run: step over %s along dim %d expects dim %d = %lld, the tensor gives %lld",
                      tw_axis_name(st->axis), d, k, (long long)st->shape[k], (long long)want);
  }
  int64_t outer = prod(cur->t.shape, 0, d);
  size_t chunk = (size_t)prod(cur->t.shape, d, nd) * es; /* bytes of one outer row, before */
  buf nb, tmp = {{0}, 0};
  TW_TRY(buf_new(ctx, &nb, cur->t.dtype, nd, st->shape));
  const char *src = (const char *)cur->t.data;
  char *dst = (char *)nb.t.data;
  switch (st->kind) {
    case TW_STEP_ALL_GATHER:
      if (outer == 1) {
        s = tw_all_gather(ctx, comm, src, dst, (int64_t)chunk, TW_U8);
      } else {
        int64_t tshape[1] = {(int64_t)(chunk * (size_t)outer * (size_t)n)};
        s = buf_new(ctx, &tmp, TW_U8, 1, tshape);
        if (s == TW_OK) s = tw_all_gather(ctx, comm, src, tmp.t.data, (int64_t)(chunk * (size_t)outer), TW_U8);
        for (int64_t o = 0; o < outer && s == TW_OK; o++)
          for (int j = 0; j < n && s == TW_OK; j++)
            s = copy_bytes(ctx, dst + ((size_t)o * (size_t)n + (size_t)j) * chunk,
                           (const char *)tmp.t.data + ((size_t)j * (size_t)outer + (size_t)o) * chunk, chunk);
      }
      break;
    case TW_STEP_SLICE: {
      int c = tw_mesh_coord(&mc->mesh, mc->rank, st->axis);
      size_t part = chunk / (size_t)n;
      for (int64_t o = 0; o < outer && s == TW_OK; o++)
        s = copy_bytes(ctx, dst + (size_t)o * part, src + (size_t)o * chunk + (size_t)c * part, part);
      break;
    }
    case TW_STEP_REDUCE_SCATTER: {
      size_t part = chunk / (size_t)n;
      int64_t count = (int64_t)((size_t)outer * part / es);
      if (outer == 1) {
        s = tw_reduce_scatter(ctx, comm, src, dst, count, cur->t.dtype, TW_REDUCE_SUM);
      } else {
        /* [outer][n][part] -> [n][outer][part], so rank j's block is contiguous */
        int64_t tshape[1] = {(int64_t)(chunk * (size_t)outer)};
        s = buf_new(ctx, &tmp, TW_U8, 1, tshape);
        for (int j = 0; j < n && s == TW_OK; j++)
          for (int64_t o = 0; o < outer && s == TW_OK; o++)
            s = copy_bytes(ctx, (char *)tmp.t.data + ((size_t)j * (size_t)outer + (size_t)o) * part,
                           src + (size_t)o * chunk + (size_t)j * part, part);
        if (s == TW_OK) s = tw_reduce_scatter(ctx, comm, tmp.t.data, dst, count, cur->t.dtype, TW_REDUCE_SUM);
      }
      break;
    }
    default:
      s = tw_error(TW_ERR_INTERNAL, "plan_run: step kind %d on a tensor", (int)st->kind);
  }
  buf_drop(ctx, &tmp);
  if (s != TW_OK) {
    buf_drop(ctx, &nb);
    return s;
  }
  buf_drop(ctx, cur);
  *cur = nb;
  return TW_OK;
}

static tw_status check_io_tensor(const tw_plan *p, int i, const tw_tensor *t, tw_ctx *ctx) {
  const tw_plan_tensor *pt = &p->t[i];
  char a[96], b[96];
  if (tw_tensor_is_none(t) || t->ndim != pt->ndim)
    return tw_error(TW_ERR_SHAPE, "plan_run: %s must be a %d-d tensor, got %s", pt->name, pt->ndim,
                    tw_tensor_is_none(t) ? "none" : tw_tensor_str(t, a, sizeof a));
  for (int d = 0; d < pt->ndim; d++)
    if (t->shape[d] != pt->local[d]) {
      tw_tensor want = *t;
      memcpy(want.shape, pt->local, sizeof want.shape);
      return tw_error(TW_ERR_SHAPE, "plan_run: %s shard is %s but the plan expects %s", pt->name,
                      tw_tensor_str(t, a, sizeof a), tw_tensor_str(&want, b, sizeof b));
    }
  if (t->mem != tw_ctx_mem(ctx))
    return tw_error(TW_ERR_MEMORY, "plan_run: %s lives in %s memory but the context works on %s", pt->name,
                    t->mem == TW_MEM_HOST ? "host" : "device", tw_ctx_mem(ctx) == TW_MEM_HOST ? "host" : "device");
  if (tw_dtype_bits(t->dtype) < 8) return tw_error(TW_ERR_DTYPE, "plan_run: %s has a sub-byte dtype", pt->name);
  return TW_OK;
}

/* Local group sizes of this rank, in the context's memory. */
static tw_status local_groups(tw_ctx *ctx, const tw_plan *p, int rank, const int32_t *gs, buf *out) {
  if (!gs) return tw_error(TW_ERR_NULL, "plan_run: %s needs group_sizes (global, host)", tw_shard_op_name(p->op));
  int32_t *host = (int32_t *)malloc(sizeof(int32_t) * (size_t)(p->groups ? p->groups : 1));
  if (!host) return tw_error(TW_ERR_MEMORY, "plan_run: out of host memory");
  int64_t Gl = 0;
  tw_status s = tw_plan_local_groups(p, rank, gs, host, &Gl);
  if (s == TW_OK) s = buf_new(ctx, out, TW_I32, 1, &Gl);
  if (s == TW_OK) {
    tw_tensor h = tw_tensor_1d(host, TW_I32, Gl, TW_MEM_HOST);
    s = tw_tensor_copy(ctx, &out->t, &h);
  }
  free(host);
  return s;
}

/* 2-D view of a [B, R, C] tensor as [B*R, C]. */
static tw_tensor flat2(const tw_tensor *t) {
  if (t->ndim != 3) return *t;
  return tw_tensor_2d(t->data, t->dtype, t->shape[0] * t->shape[1], t->shape[2], t->mem);
}

static tw_status local_gemm(tw_ctx *ctx, const tw_plan *p, const tw_tensor *a_t, const tw_tensor *b_t,
                            const tw_tensor *gs, tw_tensor *out) {
  tw_operand a = tw_operand_plain(a_t), b = tw_operand_plain(b_t);
  if (p->op == TW_SHARD_DENSE) {
    if (p->pass == TW_PASS_FWD) return tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_N, out, 0);
    if (p->pass == TW_PASS_DGRAD) return tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, out, 0);
    if (out->ndim == 2 && a_t->ndim == 3) { /* w shared over the batch: contract B and M */
      tw_tensor af = flat2(a_t), bf = flat2(b_t);
      a = tw_operand_plain(&af);
      b = tw_operand_plain(&bf);
    }
    return tw_gemm(ctx, &a, TW_OP_T, &b, TW_OP_N, out, 0);
  }
  if (p->pass == TW_PASS_FWD) return tw_grouped_gemm(ctx, &a, &b, TW_OP_N, gs, out, 0);
  if (p->pass == TW_PASS_DGRAD) return tw_grouped_gemm(ctx, &a, &b, TW_OP_T, gs, out, 0);
  return tw_grouped_gemm_wgrad(ctx, &a, TW_OP_N, &b, TW_OP_N, gs, out, 0);
}

/* tw_quantize.h's compute_scale, in f32. */
static float current_scale(float amax, tw_dtype q, int pow2) {
  return tw_scale_from_amax(amax, q == TW_E4M3 ? 448.0f : 57344.0f, pow2);
}

static tw_status amax_reduce(tw_ctx *ctx, tw_mesh_comms *mc, const tw_dimspec *axes, tw_tensor *amax) {
  for (int i = 0; i < axes->n; i++) {
    tw_status s = TW_OK;
    tw_comm *c = axis_comm(mc, axes->axis[i], &s);
    if (!c) return s;
    TW_TRY(tw_all_reduce(ctx, c, amax->data, amax->data, amax->shape[0], TW_F32, TW_REDUCE_MAX));
  }
  return TW_OK;
}

/* Tensor current scaling of x by gs with the per-group amax max-reduced over `axes` first, so
 * every shard quantizes with the scales the unsharded tensor would get: a local quantize pass
 * for the amax, the all-reduce, the scales (host, the formula above), then the quantize proper
 * in the delayed form with those scales. q->amax ends as the global amax. */
static tw_status quantize_global(tw_ctx *ctx, tw_mesh_comms *mc, const tw_tensor *x, const tw_tensor *gs,
                                 const tw_quantize_opts *o, const tw_dimspec *axes, tw_qtensor *q) {
  int64_t G = gs->shape[0];
  tw_quantize_opts opts = *o;
  buf scale = {{0}, 0};
  tw_status s = tw_grouped_quantize(ctx, x, gs, &opts, q);
  if (s == TW_OK) s = amax_reduce(ctx, mc, axes, &q->amax);
  float *host = (float *)malloc(sizeof(float) * 2 * (size_t)(G ? G : 1));
  if (!host && s == TW_OK) s = tw_error(TW_ERR_MEMORY, "plan_run: out of host memory");
  tw_tensor hamax = tw_tensor_1d(host, TW_F32, G, TW_MEM_HOST);
  tw_tensor hscale = tw_tensor_1d(host ? host + G : NULL, TW_F32, G, TW_MEM_HOST);
  if (s == TW_OK) s = tw_tensor_copy(ctx, &hamax, &q->amax);
  if (s == TW_OK) {
    for (int64_t g = 0; g < G; g++) host[G + g] = current_scale(host[g], o->qdtype, o->pow2_scales);
    s = buf_new(ctx, &scale, TW_F32, 1, &G);
  }
  if (s == TW_OK) s = tw_tensor_copy(ctx, &scale.t, &hscale);
  if (s == TW_OK) {
    tw_qtensor q2 = *q;
    q2.mode = TW_SCALE_TENSOR_DELAYED;
    opts.mode = TW_SCALE_TENSOR_DELAYED;
    opts.pow2_scales = 0;
    opts.scale = scale.t;
    s = tw_grouped_quantize(ctx, x, gs, &opts, &q2);
  }
  if (s == TW_OK) s = tw_tensor_copy(ctx, &q->amax, &hamax); /* the global amax */
  free(host);
  buf_drop(ctx, &scale);
  return s;
}

/* An fp8 input of the grouped GEMM: the data (same shape as the tensor it replaced), its
 * per-group scale_inv and amax. */
typedef struct {
  int on;
  buf scale, amax;
} qin;

static void qin_drop(tw_ctx *ctx, qin *q) {
  buf_drop(ctx, &q->scale);
  buf_drop(ctx, &q->amax);
  q->on = 0;
}

/* Whether input i of the plan is w [G, K, N] (fwd, dgrad) rather than a row-grouped x or dy. */
static int input_is_w(const tw_plan *p, int i) { return i == 1 && p->pass != TW_PASS_WGRAD; }

/* Quantizes cur in place of itself: x or dy [M, *] by the local groups; w [G, K, N] in the
 * uniform form [G*K, N] with G groups of K rows. */
static tw_status quantize_input(tw_ctx *ctx, tw_mesh_comms *mc, const tw_plan *p, const tw_plan_step *st, buf *cur,
                                const tw_tensor *gs_local, qin *out) {
  int is_w = input_is_w(p, st->tensor);
  int64_t rows = is_w ? cur->t.shape[0] * cur->t.shape[1] : cur->t.shape[0];
  int64_t cols = is_w ? cur->t.shape[2] : cur->t.shape[1];
  int64_t G = is_w ? cur->t.shape[0] : gs_local->shape[0];
  buf gs = {{0}, 0}, data = {{0}, 0};
  tw_status s = TW_OK;
  if (is_w) { /* uniform group sizes */
    int32_t *h = (int32_t *)malloc(sizeof(int32_t) * (size_t)(G ? G : 1));
    if (!h) return tw_error(TW_ERR_MEMORY, "plan_run: out of host memory");
    for (int64_t g = 0; g < G; g++) h[g] = (int32_t)cur->t.shape[1];
    s = buf_new(ctx, &gs, TW_I32, 1, &G);
    tw_tensor ht = tw_tensor_1d(h, TW_I32, G, TW_MEM_HOST);
    if (s == TW_OK) s = tw_tensor_copy(ctx, &gs.t, &ht);
    free(h);
  } else {
    gs.t = *gs_local;
  }
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = TW_SCALE_TENSOR_CURRENT;
  o.qdtype = p->opts.fp8;
  o.layout = TW_ROWWISE;
  tw_qtensor q;
  if (s == TW_OK) s = tw_quantize_output_shapes(&o, rows, cols, G, &q);
  if (s == TW_OK) s = buf_new(ctx, &data, o.qdtype, cur->t.ndim, cur->t.shape);
  if (s == TW_OK) s = buf_new(ctx, &out->scale, TW_F32, 1, &G);
  if (s == TW_OK) s = buf_new(ctx, &out->amax, TW_F32, 1, &G);
  if (s == TW_OK) {
    q.row_data.data = data.t.data;
    q.row_data.mem = q.row_scale_inv.mem = q.amax.mem = tw_ctx_mem(ctx);
    q.row_scale_inv.data = out->scale.t.data;
    q.amax.data = out->amax.t.data;
    tw_tensor x2 = tw_tensor_2d(cur->t.data, cur->t.dtype, rows, cols, tw_ctx_mem(ctx));
    s = quantize_global(ctx, mc, &x2, &gs.t, &o, &st->axes, &q);
  }
  if (is_w) buf_drop(ctx, &gs);
  if (s != TW_OK) {
    buf_drop(ctx, &data);
    qin_drop(ctx, out);
    return s;
  }
  buf_drop(ctx, cur);
  *cur = data;
  out->on = 1;
  return TW_OK;
}

/* The rowwise operand of an fp8 input: x or dy [M, *], or w [G, K, N] as its uniform [G*K, N]
 * (tw_gemm.h: the storage of rhs_op N in the forward, of rhs_op T in the dgrad). */
static tw_operand qin_operand(const buf *cur, const qin *q, int is_w) {
  tw_qtensor t;
  memset(&t, 0, sizeof t);
  t.mode = TW_SCALE_TENSOR_DELAYED;
  t.qdtype = cur->t.dtype;
  t.rows = is_w ? cur->t.shape[0] * cur->t.shape[1] : cur->t.shape[0];
  t.cols = is_w ? cur->t.shape[2] : cur->t.shape[1];
  t.row_data = tw_tensor_2d(cur->t.data, cur->t.dtype, t.rows, t.cols, cur->t.mem);
  t.row_scale_inv = q->scale.t;
  t.col_data = t.col_scale_inv = tw_tensor_none();
  t.amax = q->amax.t;
  return tw_operand_rowwise(&t);
}

static tw_status run_gemm(tw_ctx *ctx, tw_mesh_comms *mc, const tw_plan *p, tw_shard_io *io) {
  for (int i = 0; i < 2; i++) TW_TRY(check_io_tensor(p, i, &io->in[i], ctx));
  TW_TRY(check_io_tensor(p, 2, &io->out, ctx));
  buf in[2] = {{io->in[0], 0}, {io->in[1], 0}}, out = {{0}, 0}, gs = {{0}, 0};
  qin q[2];
  memset(q, 0, sizeof q);
  tw_status s = TW_OK;
  if (p->op == TW_SHARD_GROUPED_GEMM) s = local_groups(ctx, p, mc->rank, io->group_sizes, &gs);
  for (int i = 0; i < p->nsteps && s == TW_OK; i++) {
    const tw_plan_step *st = &p->steps[i];
    if (st->tensor >= 2) continue;
    if (st->kind == TW_STEP_QUANTIZE) {
      s = quantize_input(ctx, mc, p, st, &in[st->tensor], &gs.t, &q[st->tensor]);
      continue;
    }
    if (q[st->tensor].on && input_is_w(p, st->tensor) && st->dim == 0) { /* per-expert scales follow w's expert dim */
      tw_plan_step ss = *st;
      memset(ss.shape, 0, sizeof ss.shape);
      ss.shape[0] = st->shape[0];
      s = apply_step(ctx, mc, &ss, &q[st->tensor].scale);
      if (s != TW_OK) break;
    }
    s = apply_step(ctx, mc, st, &in[st->tensor]);
  }
  int after = 0, reduces = 0;
  for (int i = 0; i < p->nsteps; i++)
    if (p->steps[i].tensor == 2) {
      after++;
      reduces += p->steps[i].kind == TW_STEP_REDUCE_SCATTER || p->steps[i].kind == TW_STEP_ALL_REDUCE;
    }
  if (s == TW_OK) {
    if (!after) {
      out.t = io->out;
    } else {
      /* partial sums travel in f32 (the communicators reduce f32); rows past the groups are 0 */
      s = buf_new(ctx, &out, reduces ? TW_F32 : io->out.dtype, p->t[2].ndim, p->t[2].op_local);
      if (s == TW_OK) s = tw_memset(ctx, out.t.data, 0, tw_tensor_bytes(&out.t));
    }
  }
  if (s == TW_OK) {
    if (q[0].on && q[1].on) {
      tw_operand a = qin_operand(&in[0], &q[0], 0), b = qin_operand(&in[1], &q[1], input_is_w(p, 1));
      if (p->pass == TW_PASS_WGRAD) s = tw_grouped_gemm_wgrad(ctx, &a, TW_OP_N, &b, TW_OP_N, &gs.t, &out.t, 0);
      else s = tw_grouped_gemm(ctx, &a, &b, p->pass == TW_PASS_FWD ? TW_OP_N : TW_OP_T, &gs.t, &out.t, 0);
    } else {
      s = local_gemm(ctx, p, &in[0].t, &in[1].t, &gs.t, &out.t);
    }
  }
  for (int i = 0; i < p->nsteps && s == TW_OK; i++)
    if (p->steps[i].tensor == 2) s = apply_step(ctx, mc, &p->steps[i], &out);
  if (s == TW_OK && after) {
    if (out.t.dtype == io->out.dtype) s = tw_tensor_copy(ctx, &io->out, &out.t);
    else s = tw_cast(ctx, &io->out, &out.t, 0);
  }
  buf_drop(ctx, &in[0]);
  buf_drop(ctx, &in[1]);
  buf_drop(ctx, &out);
  buf_drop(ctx, &gs);
  qin_drop(ctx, &q[0]);
  qin_drop(ctx, &q[1]);
  return s;
}

static tw_status run_quantize(tw_ctx *ctx, tw_mesh_comms *mc, const tw_plan *p, tw_shard_io *io) {
  TW_TRY(check_io_tensor(p, 0, &io->in[0], ctx));
  if (!io->q) return tw_error(TW_ERR_NULL, "plan_run: grouped_quantize needs io->q");
  const tw_quantize_opts *o = &p->opts.quant;
  int tensor_mode = o->mode == TW_SCALE_TENSOR_CURRENT || o->mode == TW_SCALE_TENSOR_DELAYED;
  int reduce = tensor_mode && p->amax_axes.n > 0;
  if (reduce && tw_tensor_is_none(&io->q->amax))
    return tw_error(TW_ERR_NULL, "plan_run: tensor scaling needs q->amax");
  buf gs = {{0}, 0};
  tw_status s = local_groups(ctx, p, mc->rank, io->group_sizes, &gs);
  tw_quantize_opts opts = *o;
  if (o->mode == TW_SCALE_TENSOR_DELAYED) opts.scale = io->scale;
  if (s == TW_OK && o->mode == TW_SCALE_TENSOR_CURRENT && reduce) {
    s = quantize_global(ctx, mc, &io->in[0], &gs.t, &opts, &p->amax_axes, io->q);
  } else if (s == TW_OK) {
    s = tw_grouped_quantize(ctx, &io->in[0], &gs.t, &opts, io->q);
    if (s == TW_OK && reduce) s = amax_reduce(ctx, mc, &p->amax_axes, &io->q->amax);
  }
  buf_drop(ctx, &gs);
  return s;
}

tw_status tw_plan_run(tw_ctx *ctx, tw_mesh_comms *mc, const tw_plan *plan, tw_shard_io *io) {
  if (!ctx || !mc || !plan || !io) return tw_error(TW_ERR_NULL, "plan_run: NULL argument");
  char a[96], b[96];
  if (mc->mesh.naxes != plan->mesh.naxes || tw_mesh_ranks(&mc->mesh) != tw_mesh_ranks(&plan->mesh) ||
      strcmp(tw_mesh_str(&mc->mesh, a, sizeof a), tw_mesh_str(&plan->mesh, b, sizeof b)) != 0)
    return tw_error(TW_ERR_INVALID_ARG, "plan_run: the plan is for mesh %s but the communicators are for %s", b, a);
  if (plan->op == TW_SHARD_GROUPED_QUANTIZE) return run_quantize(ctx, mc, plan, io);
  return run_gemm(ctx, mc, plan, io);
}
