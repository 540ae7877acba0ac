/* Sharded cases (twin fuzz --mesh): the case is planned by the rule functions (tw_plan_make),
 * run on every rank of its mesh through the one executor (tw_plan_run) on the subject backend
 * (ref: one thread per rank over the thread communicator; gpu: GPU r per rank over NCCL), and
 * each rank's output shard is copied to the host and compared, stacked as [rank, local...],
 * with the same shard of the unsharded oracle through the one checker:
 *
 *   GEMMs     sharded_vs_unsharded  bit for bit when the plan is exact (its local op is the
 *                                   global one) and the subject is ref, else within twice the
 *                                   GEMM error bound (both sides may err by it) — golden.c's rule
 *             sharded_vs_f64        within the bound of the exact f64 product (a K split into
 *                                   partial sums stays within gamma(K))
 *             oracle_vs_f64         the unsharded oracle itself
 *             rows past the groups: 0 when the output went through collectives, else untouched
 *             (tw_plan_run's contract), exactly
 *   quantize  sharded_codes:row, sharded_vs_unsharded:row/col (dequantized with the rank's local
 *             groups), amax_global (tensor scaling): bit for bit
 *
 * An invalid case (the restated rules say the planner must refuse it) passes only when
 * tw_plan_make fails with that rule's error (check plan_error otherwise). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_internal.h"
#include "ops/data.h"
#include "ops/pass.h"
#include "twin/tw_comm.h"
#include "twin/tw_numerics.h"

/* Provided by //gpu; a ref-only binary has neither. */
int tw_gpu_device_count(void);
#pragma weak tw_comm_init_nccl_local
#pragma weak tw_gpu_device_count

#define MAX_RANKS 64

struct fz_shard_env {
  tw_backend backend;
  tw_ctx *oracle;
  const char *plant;      /* an ops-table bug for every rank's context */
  const char *comm_plant; /* a communicator bug for every rank's communicator */
  int max_ranks;
  tw_comm **nccl[MAX_RANKS + 1]; /* gpu: world communicators by rank count, made once */
};

fz_shard_env *fz_shard_env_open(tw_backend subject, const char *plant, tw_ctx *oracle, char *err, size_t n) {
  fz_shard_env *e = calloc(1, sizeof *e);
  if (!e) { snprintf(err, n, "out of memory"); return NULL; }
  e->backend = subject;
  e->oracle = oracle;
  e->max_ranks = MAX_RANKS; /* ref: one thread per rank */
  if (plant && fz_plant_is_comm(plant)) e->comm_plant = plant;
  else e->plant = plant;
  if (subject == TW_BACKEND_GPU) {
    if (!tw_comm_init_nccl_local || !tw_gpu_device_count) {
      snprintf(err, n, "--backend gpu --mesh runs rank r on GPU r over NCCL; this binary has no NCCL "
                       "communicator (use //tools:twin, which links //gpu)");
      free(e);
      return NULL;
    }
    int d = tw_gpu_device_count();
    if (d < 1) {
      snprintf(err, n, "--backend gpu --mesh: no GPU is visible");
      free(e);
      return NULL;
    }
    e->max_ranks = d < MAX_RANKS ? d : MAX_RANKS;
    if (e->comm_plant) {
      snprintf(err, n, "planted bug '%s' lives in the thread communicator; use it with --backend ref", plant);
      free(e);
      return NULL;
    }
  }
  return e;
}

static void nccl_drop(fz_shard_env *e, int n) {
  if (!e->nccl[n]) return;
  for (int i = 0; i < n; i++) tw_comm_destroy(e->nccl[n][i]);
  free(e->nccl[n]);
  e->nccl[n] = NULL;
}

void fz_shard_env_close(fz_shard_env *e) {
  if (!e) return;
  for (int n = 0; n <= MAX_RANKS; n++) nccl_drop(e, n);
  free(e);
}

int fz_shard_env_max_ranks(const fz_shard_env *e) { return e ? e->max_ranks : 0; }

/* ---- small host helpers ---------------------------------------------------------------- */
typedef struct {
  void *p[96];
  int n;
} bag;

static void *bag_alloc(bag *b, size_t bytes) {
  if (b->n == (int)(sizeof b->p / sizeof b->p[0])) return NULL;
  void *p = malloc(bytes ? bytes : 16);
  if (p) b->p[b->n++] = p;
  return p;
}
static void bag_free(bag *b) {
  for (int i = 0; i < b->n; i++) free(b->p[i]);
  b->n = 0;
}



/* A host tensor of dtype t holding the f32 values v (representable in t). */
static tw_tensor typed(bag *b, tw_dtype t, int nd, const int64_t *shape, const float *v) {
  tw_tensor x = tw_host_tensor(NULL, t, nd, shape);
  x.data = bag_alloc(b, tw_tensor_bytes(&x));
  if (x.data && v)
    for (int64_t i = 0; i < tw_tensor_numel(&x); i++) tw_store_from_f64(x.data, t, i, (double)v[i], 0);
  return x;
}

static tw_tensor poisoned(bag *b, tw_dtype t, int nd, const int64_t *shape) {
  tw_tensor x = tw_host_tensor(NULL, t, nd, shape);
  size_t bytes = tw_tensor_bytes(&x);
  x.data = bag_alloc(b, bytes);
  if (x.data) memset(x.data, TW_POISON_BYTE, bytes ? bytes : 16);
  return x;
}

/* map[i] = the global flat index of rank's local element i under spec. */
static void index_map(const tw_mesh *m, const tw_pspec *spec, int nd, const int64_t *global, const int64_t *local,
                      int rank, int64_t *map) {
  int64_t off[TW_MAX_DIMS] = {0}, idx[TW_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) off[d] = (int64_t)tw_dimspec_index(m, &spec->dim[d], rank) * local[d];
  int64_t n = tw_numel(nd, local);
  for (int64_t i = 0; i < n; i++) {
    int64_t g = 0;
    for (int d = 0; d < nd; d++) g = g * global[d] + off[d] + idx[d];
    map[i] = g;
    for (int d = nd - 1; d >= 0; d--) { /* next local index, row-major */
      if (++idx[d] < local[d]) break;
      idx[d] = 0;
    }
  }
}

/* ---- quantized outputs ----------------------------------------------------------------- */
static tw_tensor *q_part(tw_qtensor *q, int i) {
  tw_tensor *p[5] = {&q->row_data, &q->row_scale_inv, &q->col_data, &q->col_scale_inv, &q->amax};
  return p[i];
}
static int q_shares_scale(const tw_qtensor *q) {
  int tensor_mode = q->mode == TW_SCALE_TENSOR_CURRENT || q->mode == TW_SCALE_TENSOR_DELAYED;
  return tensor_mode && !tw_tensor_is_none(&q->row_scale_inv) && !tw_tensor_is_none(&q->col_scale_inv);
}

/* Allocates q's parts (shapes filled) in ctx's memory, poisoned; tensor scaling's rowwise and
 * colwise outputs share one scale_inv buffer (as golden.c does). */
static tw_status q_alloc(tw_ctx *ctx, tw_qtensor *q) {
  int share = q_shares_scale(q);
  for (int i = 0; i < 5; i++) {
    tw_tensor *t = q_part(q, i);
    t->data = NULL;
    if (tw_tensor_is_none(t) || (share && i == 3)) continue;
    t->mem = tw_ctx_mem(ctx);
    size_t bytes = tw_tensor_bytes(t);
    TW_TRY(tw_alloc(ctx, bytes, &t->data));
    if (bytes) TW_TRY(tw_memset(ctx, t->data, TW_POISON_BYTE, bytes));
  }
  if (share) q->col_scale_inv = q->row_scale_inv;
  return TW_OK;
}
static void q_release(tw_ctx *ctx, tw_qtensor *q) {
  if (q_shares_scale(q)) q->col_scale_inv.data = NULL;
  for (int i = 0; i < 5; i++) {
    tw_tensor *t = q_part(q, i);
    if (!tw_tensor_is_none(t) && t->data) tw_free(ctx, t->data);
    t->data = NULL;
  }
}
/* Host copies (malloc) of q's parts into h (same shapes). */
static tw_status q_to_host(tw_ctx *ctx, const tw_qtensor *q, tw_qtensor *h) {
  *h = *q;
  int share = q_shares_scale(q);
  for (int i = 0; i < 5; i++) q_part(h, i)->data = NULL;
  for (int i = 0; i < 5; i++) {
    tw_tensor *d = q_part((tw_qtensor *)q, i), *t = q_part(h, i);
    t->mem = TW_MEM_HOST;
    if (tw_tensor_is_none(d) || (share && i == 3)) continue;
    size_t bytes = tw_tensor_bytes(d);
    t->data = malloc(bytes ? bytes : 16);
    if (!t->data) return tw_error(TW_ERR_MEMORY, "fuzz: out of host memory");
    if (bytes) TW_TRY(tw_tensor_copy(ctx, t, d));
  }
  if (share) h->col_scale_inv = h->row_scale_inv;
  return TW_OK;
}
static void q_host_free(tw_qtensor *h) {
  if (q_shares_scale(h)) h->col_scale_inv.data = NULL;
  for (int i = 0; i < 5; i++) {
    free(q_part(h, i)->data);
    q_part(h, i)->data = NULL;
  }
}

/* ---- one rank ------------------------------------------------------------------------- */
typedef struct {
  fz_shard_env *e;
  const fz_case *c;
  const tw_plan *plan;
  tw_tensor in[2];        /* global inputs, host, in their dtypes */
  tw_tensor scale;        /* delayed quantize: [G] f32, host */
  tw_tensor out[MAX_RANKS];  /* each rank's output shard, host (malloc) */
  tw_qtensor q[MAX_RANKS];   /* quantize: each rank's output, host (malloc) */
  tw_status st[MAX_RANKS];
  char msg[MAX_RANKS][300];
} shard_job;

static tw_status to_ctx(tw_ctx *ctx, const tw_tensor *host, tw_tensor *dev) {
  *dev = *host;
  dev->mem = tw_ctx_mem(ctx);
  dev->data = NULL;
  size_t bytes = tw_tensor_bytes(host);
  TW_TRY(tw_alloc(ctx, bytes, &dev->data));
  return bytes ? tw_tensor_copy(ctx, dev, host) : TW_OK;
}

static tw_status rank_body(int rank, tw_comm *comm, shard_job *j, tw_ctx *ctx) {
  const tw_plan *p = j->plan;
  tw_mesh_comms *mc = NULL;
  tw_shard_io io;
  memset(&io, 0, sizeof io);
  io.group_sizes = j->c->group_sizes;
  tw_qtensor q;
  memset(&q, 0, sizeof q);
  void *hl[2] = {NULL, NULL};
  int quant = p->op == TW_SHARD_GROUPED_QUANTIZE;
  tw_status st = tw_mesh_comms_create(ctx, &p->mesh, &mc);
  for (int i = 0; i < p->ninputs && st == TW_OK; i++) { /* this rank's shards of the inputs */
    tw_tensor l = tw_host_tensor(NULL, j->in[i].dtype, p->t[i].ndim, p->t[i].local);
    size_t bytes = tw_tensor_bytes(&l);
    hl[i] = l.data = malloc(bytes ? bytes : 16);
    st = l.data ? tw_shard_slice_host(&p->mesh, &p->t[i].spec, rank, &j->in[i], &l)
                : tw_error(TW_ERR_MEMORY, "fuzz: out of host memory");
    if (st == TW_OK) st = to_ctx(ctx, &l, &io.in[i]);
  }
  if (st == TW_OK && quant) {
    if (!tw_tensor_is_none(&j->scale)) st = to_ctx(ctx, &j->scale, &io.scale);
    if (st == TW_OK) st = tw_plan_quantize_shapes(p, &q);
    if (st == TW_OK) st = q_alloc(ctx, &q);
    io.q = &q;
  } else if (st == TW_OK) {
    const tw_plan_tensor *ot = &p->t[2];
    io.out = tw_host_tensor(NULL, j->c->out_dtype, ot->ndim, ot->local);
    io.out.mem = tw_ctx_mem(ctx);
    size_t bytes = tw_tensor_bytes(&io.out);
    st = tw_alloc(ctx, bytes, &io.out.data);
    if (st == TW_OK && bytes) st = tw_memset(ctx, io.out.data, TW_POISON_BYTE, bytes);
  }
  if (st == TW_OK) st = tw_plan_run(ctx, mc, p, &io);
  if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
  if (st == TW_OK) st = tw_ctx_check(ctx);
  if (st == TW_OK && quant) st = q_to_host(ctx, &q, &j->q[rank]);
  if (st == TW_OK && !quant) {
    tw_tensor *h = &j->out[rank];
    *h = io.out;
    h->mem = TW_MEM_HOST;
    size_t bytes = tw_tensor_bytes(&io.out);
    h->data = malloc(bytes ? bytes : 16);
    st = !h->data ? tw_error(TW_ERR_MEMORY, "fuzz: out of host memory") : bytes ? tw_tensor_copy(ctx, h, &io.out) : TW_OK;
  }
  for (int i = 0; i < 2; i++) {
    if (io.in[i].data) tw_free(ctx, io.in[i].data);
    free(hl[i]);
  }
  if (io.scale.data) tw_free(ctx, io.scale.data);
  if (io.out.data) tw_free(ctx, io.out.data);
  q_release(ctx, &q);
  tw_mesh_comms_destroy(mc);
  (void)comm;
  return st;
}

static tw_status rank_fn(int rank, tw_comm *comm, void *arg) {
  shard_job *j = (shard_job *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = j->e->backend;
  cc.device = j->e->backend == TW_BACKEND_GPU ? rank : 0;
  cc.comm = comm;
  tw_status st = tw_ctx_create(&ctx, &cc);
  if (st == TW_OK && j->e->plant && fz_plant(ctx, j->e->plant) != 0)
    st = tw_error(TW_ERR_INVALID_ARG, "fuzz: cannot plant '%s' in a %s context", j->e->plant,
                  tw_backend_name(j->e->backend));
  if (st == TW_OK) st = rank_body(rank, comm, j, ctx);
  if (st != TW_OK) snprintf(j->msg[rank], sizeof j->msg[rank], "%s", tw_last_error());
  j->st[rank] = st;
  tw_ctx_destroy(ctx);
  return st;
}

/* Runs the job on every rank; 0 if every rank returned TW_OK. */
static int run_ranks(fz_shard_env *e, shard_job *j, int n) {
  for (int r = 0; r < n; r++) j->st[r] = TW_ERR_INTERNAL;
  if (n == 1) return rank_fn(0, NULL, j) == TW_OK ? 0 : -1;
  tw_comm *local[MAX_RANKS];
  tw_comm **comms = local;
  tw_status st;
  if (e->backend == TW_BACKEND_GPU) {
    if (!e->nccl[n]) {
      tw_comm **cs = calloc((size_t)n, sizeof *cs);
      int devices[MAX_RANKS];
      for (int i = 0; i < n; i++) devices[i] = i;
      st = cs ? tw_comm_init_nccl_local(n, devices, cs) : tw_error(TW_ERR_MEMORY, "fuzz: out of memory");
      if (st != TW_OK) {
        free(cs);
        for (int r = 0; r < n; r++) snprintf(j->msg[r], sizeof j->msg[r], "%s", tw_last_error());
        return -1;
      }
      for (int i = 0; i < n; i++) tw_comm_set_timeout(cs[i], 60.0);
      e->nccl[n] = cs;
    }
    comms = e->nccl[n];
  } else {
    st = tw_comm_init_threads(n, local);
    if (st == TW_OK)
      for (int i = 0; i < n; i++) tw_comm_set_timeout(local[i], 30.0);
    if (st == TW_OK && e->comm_plant && fz_plant_comms(e->comm_plant, n, local) != 0)
      st = tw_error(TW_ERR_INVALID_ARG, "fuzz: '%s' is not a communicator bug", e->comm_plant);
    if (st != TW_OK) {
      for (int r = 0; r < n; r++) snprintf(j->msg[r], sizeof j->msg[r], "%s", tw_last_error());
      return -1;
    }
  }
  st = tw_run_ranks(n, comms, rank_fn, j);
  int bad = st != TW_OK;
  for (int r = 0; r < n; r++) bad |= j->st[r] != TW_OK;
  if (e->backend == TW_BACKEND_GPU) {
    if (bad) nccl_drop(e, n); /* an aborted communicator is not reused */
  } else {
    for (int i = 0; i < n; i++) tw_comm_destroy(local[i]);
  }
  return bad ? -1 : 0;
}

/* ---- the unsharded oracle and the exact f64 result ------------------------------------- */
static int subnormal16(double v, tw_dtype t) {
  double a = fabs(v);
  if (a == 0) return 0;
  if (t == TW_F16) return a < 0x1p-14;
  if (t == TW_BF16) return a < 0x1p-126;
  return 0;
}

typedef struct {
  double *e, *absp, *fl; /* over the output's global elements */
  int64_t *K;            /* contraction length per element (the bound's K) */
} f64_expect;

/* The exact product of the plan's inputs va, vb (f32 values, dequantized for fp8 inputs) by
 * the rule and pass; rows past the groups get K = -1 (untouched). ta/tb: the inputs' dtypes
 * for the subnormal allowance (TW_E4M3 when quantized: none). */
static void exact_f64(const fz_case *c, const float *va, const float *vb, tw_dtype ta, tw_dtype tb, f64_expect *x) {
  int64_t B = c->B > 0 ? c->B : 1, M = c->M, K = c->K, N = c->N;
  if (c->rule == TW_SHARD_DENSE) {
    int64_t wstride = c->w_batched ? K * N : 0;
    if (c->pass == TW_PASS_FWD || c->pass == TW_PASS_DGRAD) {
      int fwd = c->pass == TW_PASS_FWD;
      int64_t C = fwd ? K : N, O = fwd ? N : K; /* contraction, output columns */
      for (int64_t b = 0; b < B; b++)
        for (int64_t m = 0; m < M; m++)
          for (int64_t o = 0; o < O; o++) {
            double s = 0, sa = 0, sf = 0;
            for (int64_t k = 0; k < C; k++) {
              double av = va[(b * M + m) * C + k];
              double bv = fwd ? vb[b * wstride + k * N + o] : vb[b * wstride + o * N + k];
              s += av * bv;
              sa += fabs(av) * fabs(bv);
              if (subnormal16(av, ta) || subnormal16(bv, tb)) sf += fabs(av) * fabs(bv);
            }
            int64_t i = (b * M + m) * O + o;
            x->e[i] = s, x->absp[i] = sa, x->fl[i] = sf, x->K[i] = C;
          }
    } else { /* dw[(b,) k, n] = sum over (b,) m of x[b, m, k] dy[b, m, n] */
      int64_t Bo = c->w_batched ? B : 1;
      for (int64_t bo = 0; bo < Bo; bo++)
        for (int64_t k = 0; k < K; k++)
          for (int64_t n = 0; n < N; n++) {
            double s = 0, sa = 0, sf = 0;
            for (int64_t b = c->w_batched ? bo : 0; b < (c->w_batched ? bo + 1 : B); b++)
              for (int64_t m = 0; m < M; m++) {
                double av = va[(b * M + m) * K + k], bv = vb[(b * M + m) * N + n];
                s += av * bv;
                sa += fabs(av) * fabs(bv);
                if (subnormal16(av, ta) || subnormal16(bv, tb)) sf += fabs(av) * fabs(bv);
              }
            int64_t i = (bo * K + k) * N + n;
            x->e[i] = s, x->absp[i] = sa, x->fl[i] = sf, x->K[i] = c->w_batched ? M : B * M;
          }
    }
    return;
  }
  /* grouped */
  int64_t o = 0;
  for (int64_t g = 0; g < c->G; g++) {
    int64_t mg = c->group_sizes[g];
    if (c->pass == TW_PASS_WGRAD) {
      for (int64_t k = 0; k < K; k++)
        for (int64_t n = 0; n < N; n++) {
          double s = 0, sa = 0, sf = 0;
          for (int64_t m = o; m < o + mg; m++) {
            double av = va[m * K + k], bv = vb[m * N + n];
            s += av * bv;
            sa += fabs(av) * fabs(bv);
            if (subnormal16(av, ta) || subnormal16(bv, tb)) sf += fabs(av) * fabs(bv);
          }
          int64_t i = (g * K + k) * N + n;
          x->e[i] = s, x->absp[i] = sa, x->fl[i] = sf, x->K[i] = mg;
        }
    } else {
      int fwd = c->pass == TW_PASS_FWD;
      int64_t C = fwd ? K : N, O = fwd ? N : K;
      const float *w = vb + g * K * N;
      for (int64_t m = o; m < o + mg; m++)
        for (int64_t oc = 0; oc < O; oc++) {
          double s = 0, sa = 0, sf = 0;
          for (int64_t k = 0; k < C; k++) {
            double av = va[m * C + k], bv = fwd ? w[k * N + oc] : w[oc * N + k];
            s += av * bv;
            sa += fabs(av) * fabs(bv);
            if (subnormal16(av, ta) || subnormal16(bv, tb)) sf += fabs(av) * fabs(bv);
          }
          int64_t i = m * O + oc;
          x->e[i] = s, x->absp[i] = sa, x->fl[i] = sf, x->K[i] = C;
        }
    }
    o += mg;
  }
  if (c->pass != TW_PASS_WGRAD) { /* rows past the groups */
    int64_t O = c->pass == TW_PASS_FWD ? N : K;
    for (int64_t i = o * O; i < M * O; i++) x->e[i] = 0, x->absp[i] = 0, x->fl[i] = 0, x->K[i] = -1;
  }
}

/* fp8 inputs of any pass (tensor current e4m3 from the global amax): x and dy by their groups,
 * w as [G*K, N] in G groups of K rows; the pass's grouped GEMM on those bytes; the dequantized
 * operands in da, db (and, lda / ldb non-NULL, their lifted magnitudes). */
static tw_status unsharded_fp8(tw_ctx *o, bag *bg, const fz_case *c, const tw_tensor *a, const tw_tensor *b,
                               const tw_tensor *gs, tw_tensor *out, float *da, float *db, float *lda, float *ldb) {
  int64_t G = c->G;
  /* a: x (fwd, wgrad) or dy (dgrad), by the groups; b: w [G, K, N] in the uniform form
   * [G*K, N] (fwd, dgrad) or dy (wgrad), by the groups */
  const int b_is_w = c->pass != TW_PASS_WGRAD;
  int64_t ra = a->shape[0], ca = a->shape[1];
  int64_t rb = b_is_w ? b->shape[0] * b->shape[1] : b->shape[0], cb = b_is_w ? b->shape[2] : b->shape[1];
  tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
  qo.mode = TW_SCALE_TENSOR_CURRENT;
  qo.qdtype = TW_E4M3;
  qo.layout = TW_ROWWISE;
  int32_t *ugs = bag_alloc(bg, sizeof(int32_t) * (size_t)(G ? G : 1));
  if (!ugs) return tw_error(TW_ERR_MEMORY, "fuzz: out of memory");
  for (int64_t g = 0; g < G; g++) ugs[g] = (int32_t)(b_is_w ? b->shape[1] : 0);
  tw_tensor b2 = tw_tensor_2d(b->data, b->dtype, rb, cb, TW_MEM_HOST), ugst = tw_tensor_1d(ugs, TW_I32, G, TW_MEM_HOST);
  const tw_tensor *bgs = b_is_w ? &ugst : gs;
  tw_qtensor qa, qb;
  memset(&qa, 0, sizeof qa);
  memset(&qb, 0, sizeof qb);
  tw_status s = tw_quantize_output_shapes(&qo, ra, ca, G, &qa);
  if (s == TW_OK) s = tw_quantize_output_shapes(&qo, rb, cb, G, &qb);
  if (s == TW_OK) s = q_alloc(o, &qa);
  if (s == TW_OK) s = q_alloc(o, &qb);
  if (s == TW_OK) s = tw_grouped_quantize(o, a, gs, &qo, &qa);
  if (s == TW_OK) s = tw_grouped_quantize(o, &b2, bgs, &qo, &qb);
  if (s == TW_OK) {
    tw_operand oa = tw_operand_rowwise(&qa), ob = tw_operand_rowwise(&qb);
    if (c->pass == TW_PASS_WGRAD) s = tw_grouped_gemm_wgrad(o, &oa, TW_OP_N, &ob, TW_OP_N, gs, out, 0);
    else s = tw_grouped_gemm(o, &oa, &ob, c->pass == TW_PASS_FWD ? TW_OP_N : TW_OP_T, gs, out, 0);
  }
  int64_t as[2] = {ra, ca}, bs[2] = {rb, cb};
  tw_tensor ta = tw_host_tensor(da, TW_F32, 2, as), tb = tw_host_tensor(db, TW_F32, 2, bs);
  if (s == TW_OK) s = tw_grouped_dequantize(o, &qa, gs, 0, &ta);
  if (s == TW_OK) s = tw_grouped_dequantize(o, &qb, bgs, 0, &tb);
  if (s == TW_OK && lda) s = tw_pass_lifted_abs(o, &qa, gs, ra, ca, lda);
  if (s == TW_OK && ldb) s = tw_pass_lifted_abs(o, &qb, bgs, rb, cb, ldb);
  q_release(o, &qa);
  q_release(o, &qb);
  return s;
}

/* ---- checks --------------------------------------------------------------------------- */
static void status_fail(fz_result *res, const char *what, int rank, tw_status s, const char *msg) {
  char m[480];
  snprintf(m, sizeof m, "%s (rank %d) returned %s: %.380s", what, rank, tw_status_name(s), msg);
  fz_check_note(res, "status", m);
  fz_fail(res, FZ_FAIL, "status", m);
}

/* The output shards of a GEMM-family case against the unsharded oracle and the f64 product. */
static void check_gemm(fz_shard_env *e, const fz_case *c, const tw_plan *p, shard_job *j, bag *bg, fz_result *res) {
  const tw_plan_tensor *ot = &p->t[2];
  int R = tw_mesh_ranks(&p->mesh), nd = ot->ndim;
  int64_t ng = tw_numel(nd, ot->global), nl = tw_numel(nd, ot->local);
  tw_tensor gs = c->G ? tw_tensor_1d(c->group_sizes, TW_I32, c->G, TW_MEM_HOST) : tw_tensor_none();
  /* the unsharded oracle (and for fp8 inputs the dequantized operands the GEMM sees) */
  tw_tensor un = poisoned(bg, c->out_dtype, nd, ot->global);
  float *va = c->a, *vb = c->b;
  tw_dtype ta = c->sa.dtype, tb = c->sb.dtype;
  tw_status s;
  /* the gpu's fp8 dgrad (rhs_op T) runs gg_wgmma_fp8 where it takes the shapes: its promoted
   * model (tw_gemm.h) on the lifted magnitudes */
  const int promoted = c->fp8_inputs && c->pass == TW_PASS_DGRAD && e->backend == TW_BACKEND_GPU;
  float *la = NULL, *lb = NULL;
  if (c->fp8_inputs) {
    va = bag_alloc(bg, sizeof(float) * (size_t)fz_numel_a(c));
    vb = bag_alloc(bg, sizeof(float) * (size_t)fz_numel_b(c));
    if (promoted) {
      la = bag_alloc(bg, sizeof(float) * (size_t)fz_numel_a(c));
      lb = bag_alloc(bg, sizeof(float) * (size_t)fz_numel_b(c));
    }
    ta = tb = TW_E4M3;
    s = va && vb && un.data && (!promoted || (la && lb))
            ? unsharded_fp8(e->oracle, bg, c, &j->in[0], &j->in[1], &gs, &un, va, vb, la, lb)
            : tw_error(TW_ERR_MEMORY, "fuzz: out of memory");
  } else {
    s = un.data ? tw_pass_gemm(e->oracle, c->rule, c->pass, &j->in[0], &j->in[1], &gs, &un) : tw_error(TW_ERR_MEMORY, "fuzz: out of memory");
  }
  if (s != TW_OK) { fz_fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  f64_expect x;
  x.e = bag_alloc(bg, sizeof(double) * (size_t)ng);
  x.absp = bag_alloc(bg, sizeof(double) * (size_t)ng);
  x.fl = bag_alloc(bg, sizeof(double) * (size_t)ng);
  x.K = bag_alloc(bg, sizeof(int64_t) * (size_t)ng);
  double *bound = bag_alloc(bg, sizeof(double) * (size_t)ng);
  if (!x.e || !x.absp || !x.fl || !x.K || !bound) { fz_fail(res, FZ_ERROR, "setup", "out of memory"); return; }
  exact_f64(c, va, vb, ta, tb, &x);
  f64_expect xl = x; /* promoted: the lifted magnitudes' sums */
  if (promoted) {
    xl.e = bag_alloc(bg, sizeof(double) * (size_t)ng);
    xl.absp = bag_alloc(bg, sizeof(double) * (size_t)ng);
    xl.fl = bag_alloc(bg, sizeof(double) * (size_t)ng);
    xl.K = bag_alloc(bg, sizeof(int64_t) * (size_t)ng);
    if (!xl.e || !xl.absp || !xl.fl || !xl.K) { fz_fail(res, FZ_ERROR, "setup", "out of memory"); return; }
    exact_f64(c, la, lb, ta, tb, &xl);
  }
  int extra = c->fp8_inputs ? 2 : 0; /* a scaled operand's two more roundings */
  for (int64_t i = 0; i < ng; i++) {
    if (x.K[i] < 0) { bound[i] = -1; continue; }
    if (promoted)
      tw_gemm_error_bound_promoted(&xl.absp[i], &x.e[i], 1, x.K[i], 128, 0x1p-13, 0x1p-24, 2, c->out_dtype, &bound[i]);
    else
      tw_gemm_error_bound(&x.absp[i], &x.e[i], 1, x.K[i] + extra, 0x1p-24, c->out_dtype, &bound[i]);
    bound[i] += x.fl[i];
    if (!isfinite(bound[i]) || !isfinite(x.e[i])) bound[i] = 0; /* specials: the same special */
  }
  /* rows past the groups: 0 when the output went through collectives, else untouched */
  int after = 0;
  for (int i = 0; i < p->nsteps; i++) after |= p->steps[i].tensor == 2;
  unsigned char tail[8];
  memset(tail, after ? 0 : TW_POISON_BYTE, sizeof tail);
  size_t es = tw_dtype_storage_bytes(c->out_dtype, 1);
  /* the stacks: [rank, local...] */
  int64_t ss[TW_MAX_DIMS];
  ss[0] = R;
  for (int d = 0; d < nd; d++) ss[d + 1] = ot->local[d];
  tw_tensor got = poisoned(bg, c->out_dtype, nd + 1, ss), uns = poisoned(bg, c->out_dtype, nd + 1, ss);
  tw_tensor e64 = poisoned(bg, TW_F64, nd + 1, ss), b1 = poisoned(bg, TW_F64, nd + 1, ss), b2 = poisoned(bg, TW_F64, nd + 1, ss);
  int64_t *map = bag_alloc(bg, sizeof(int64_t) * (size_t)(nl ? nl : 1));
  if (!got.data || !uns.data || !e64.data || !b1.data || !b2.data || !map) { fz_fail(res, FZ_ERROR, "setup", "out of memory"); return; }
  for (int r = 0; r < R; r++) {
    index_map(&p->mesh, &ot->spec, nd, ot->global, ot->local, r, map);
    memcpy((char *)got.data + (size_t)(r * nl) * es, j->out[r].data, (size_t)nl * es);
    for (int64_t i = 0; i < nl; i++) {
      int64_t gi = map[i], si = r * nl + i;
      double *ev = (double *)e64.data + si, *bv1 = (double *)b1.data + si, *bv2 = (double *)b2.data + si;
      char *u = (char *)uns.data + (size_t)si * es;
      if (x.K[gi] < 0) { /* untouched row */
        memcpy(u, tail, es);
        *ev = tw_load_as_f64(u, c->out_dtype, 0);
        *bv1 = *bv2 = -1;
        continue;
      }
      memcpy(u, (char *)un.data + (size_t)gi * es, es);
      *ev = x.e[gi];
      *bv1 = bound[gi];
      *bv2 = bound[gi] > 0 ? 2 * bound[gi] : bound[gi];
    }
  }
  if (p->exact && e->backend == TW_BACKEND_REF) fz_check_exact(res, "sharded_vs_unsharded", &got, &uns);
  else fz_check_bound(res, "sharded_vs_unsharded", &got, &uns, &b2);
  fz_check_bound(res, "sharded_vs_f64", &got, &e64, &b1);
  /* the unsharded oracle itself (untouched rows keep the poison there) */
  tw_tensor ue = poisoned(bg, TW_F64, nd, ot->global), ub = poisoned(bg, TW_F64, nd, ot->global);
  if (!ue.data || !ub.data) { fz_fail(res, FZ_ERROR, "setup", "out of memory"); return; }
  unsigned char pz[8];
  memset(pz, TW_POISON_BYTE, sizeof pz);
  for (int64_t i = 0; i < ng; i++) {
    ((double *)ue.data)[i] = x.K[i] < 0 ? tw_load_as_f64(pz, c->out_dtype, 0) : x.e[i];
    ((double *)ub.data)[i] = bound[i];
  }
  fz_check_bound(res, "oracle_vs_f64", &un, &ue, &ub);
}

/* Quantize: each rank's codes, dequantized values (with its local groups) and amax against
 * the unsharded quantize, bit for bit. */
static void check_quantize(fz_shard_env *e, const fz_case *c, const tw_plan *p, shard_job *j, bag *bg, fz_result *res) {
  tw_ctx *o = e->oracle;
  const tw_plan_tensor *xt = &p->t[0];
  int R = tw_mesh_ranks(&p->mesh);
  int64_t M = c->M, K = c->K, G = c->G, Ml = xt->local[0], Kl = xt->local[1], nl = Ml * Kl;
  tw_quantize_opts qo = fz_shard_rule_opts(c).quant;
  if (qo.mode == TW_SCALE_TENSOR_DELAYED) qo.scale = j->scale;
  tw_tensor gs = tw_tensor_1d(c->group_sizes, TW_I32, G, TW_MEM_HOST);
  tw_qtensor uq;
  memset(&uq, 0, sizeof uq);
  tw_status s = tw_quantize_output_shapes(&qo, M, K, G, &uq);
  if (s == TW_OK) s = q_alloc(o, &uq);
  if (s == TW_OK) s = tw_grouped_quantize(o, &j->in[0], &gs, &qo, &uq);
  int64_t ms[2] = {M, K};
  int row = (c->layout & TW_ROWWISE) != 0, col = (c->layout & TW_COLWISE) != 0;
  tw_tensor ud[2] = {poisoned(bg, TW_F32, 2, ms), poisoned(bg, TW_F32, 2, ms)};
  for (int cw = 0; cw < 2 && s == TW_OK; cw++)
    if (cw ? col : row) s = ud[cw].data ? tw_grouped_dequantize(o, &uq, &gs, cw, &ud[cw]) : tw_error(TW_ERR_MEMORY, "fuzz: out of memory");
  if (s != TW_OK) { fz_fail(res, FZ_ERROR, "oracle", tw_last_error()); q_release(o, &uq); return; }
  int64_t ss[3] = {R, Ml, Kl};
  tw_tensor codes = poisoned(bg, c->qdtype, 3, ss), ucodes = poisoned(bg, c->qdtype, 3, ss);
  tw_tensor got[2] = {poisoned(bg, TW_F32, 3, ss), poisoned(bg, TW_F32, 3, ss)};
  tw_tensor exp[2] = {poisoned(bg, TW_F32, 3, ss), poisoned(bg, TW_F32, 3, ss)};
  int64_t as[2] = {R, G};
  tw_tensor amax = poisoned(bg, TW_F32, 2, as), uamax = poisoned(bg, TW_F32, 2, as);
  int64_t *map = bag_alloc(bg, sizeof(int64_t) * (size_t)(nl ? nl : 1));
  int32_t *lgs = bag_alloc(bg, sizeof(int32_t) * (size_t)(G ? G : 1));
  int tensor_mode = c->mode == TW_SCALE_TENSOR_CURRENT || c->mode == TW_SCALE_TENSOR_DELAYED;
  if (!codes.data || !ucodes.data || !got[0].data || !got[1].data || !exp[0].data || !exp[1].data || !amax.data ||
      !uamax.data || !map || !lgs) {
    fz_fail(res, FZ_ERROR, "setup", "out of memory");
    q_release(o, &uq);
    return;
  }
  for (int r = 0; r < R && s == TW_OK; r++) {
    index_map(&p->mesh, &xt->spec, 2, xt->global, xt->local, r, map);
    int64_t Gl = 0;
    s = tw_plan_local_groups(p, r, c->group_sizes, lgs, &Gl);
    tw_tensor lg = tw_tensor_1d(lgs, TW_I32, Gl, TW_MEM_HOST);
    for (int cw = 0; cw < 2 && s == TW_OK; cw++) {
      if (!(cw ? col : row)) continue;
      int64_t ls[2] = {Ml, Kl};
      tw_tensor d = tw_host_tensor((float *)got[cw].data + r * nl, TW_F32, 2, ls);
      s = tw_grouped_dequantize(o, &j->q[r], &lg, cw, &d);
      for (int64_t i = 0; i < nl; i++) ((float *)exp[cw].data)[r * nl + i] = ((float *)ud[cw].data)[map[i]];
    }
    if (row) {
      memcpy((uint8_t *)codes.data + r * nl, j->q[r].row_data.data, (size_t)nl);
      for (int64_t i = 0; i < nl; i++) ((uint8_t *)ucodes.data)[r * nl + i] = ((uint8_t *)uq.row_data.data)[map[i]];
    }
    if (tensor_mode) {
      memcpy((float *)amax.data + r * G, j->q[r].amax.data, sizeof(float) * (size_t)G);
      memcpy((float *)uamax.data + r * G, uq.amax.data, sizeof(float) * (size_t)G);
    }
  }
  q_release(o, &uq);
  if (s != TW_OK) { fz_fail(res, FZ_ERROR, "oracle", tw_last_error()); return; }
  if (row) fz_check_exact(res, "sharded_codes:row", &codes, &ucodes);
  if (row) fz_check_exact(res, "sharded_vs_unsharded:row", &got[0], &exp[0]);
  if (col) fz_check_exact(res, "sharded_vs_unsharded:col", &got[1], &exp[1]);
  if (tensor_mode) fz_check_exact(res, "amax_global", &amax, &uamax);
}

/* ---- the case ------------------------------------------------------------------------- */
/* A case read from disk may be anything: refuse what would index out of bounds here. */
static int sharded_sane(const fz_case *c, char *msg, size_t n) {
  if (c->M < 0 || c->K < 0 || c->N < 0 || c->G < 0 || c->B < 0) { snprintf(msg, n, "negative dims"); return 0; }
  if ((int)c->rule < 0 || c->rule >= TW_SHARD_OP_COUNT || (int)c->pass < 0 || c->pass >= TW_PASS_COUNT) {
    snprintf(msg, n, "rule or pass out of range");
    return 0;
  }
  if (c->rule == TW_SHARD_GROUPED_QUANTIZE && c->pass != TW_PASS_FWD) { snprintf(msg, n, "quantize has only fwd"); return 0; }
  if (c->fp8_inputs && c->rule != TW_SHARD_GROUPED_GEMM) {
    snprintf(msg, n, "fp8 inputs are a grouped_gemm option");
    return 0;
  }
  if (c->quantize_before_gather && (!c->fp8_inputs || c->pass == TW_PASS_WGRAD)) {
    snprintf(msg, n, "quantize_before_gather needs fp8 inputs and a pass with w (fwd, dgrad)");
    return 0;
  }
  if (tw_mesh_ranks(&c->mesh) > MAX_RANKS) { snprintf(msg, n, "more than %d ranks", MAX_RANKS); return 0; }
  fz_op want = c->rule == TW_SHARD_GROUPED_QUANTIZE ? FZ_QUANTIZE : c->rule == TW_SHARD_DENSE ? FZ_GEMM
               : c->pass == TW_PASS_WGRAD ? FZ_WGRAD : FZ_GROUPED_GEMM;
  if (c->op != want) {
    snprintf(msg, n, "op %s does not go with rule %s %s (want op %s)", fz_op_name(c->op), tw_shard_op_name(c->rule),
             tw_pass_name(c->pass), fz_op_name(want));
    return 0;
  }
  if (!tw_dtype_name(c->sa.dtype) || !tw_dtype_name(c->sb.dtype) || !tw_dtype_name(c->out_dtype) ||
      !tw_dtype_name(c->x_dtype) || !tw_dtype_name(c->qdtype) || (int)c->mode < 0 || c->mode >= TW_SCALE_COUNT) {
    snprintf(msg, n, "a dtype or mode is out of range");
    return 0;
  }
  if (c->rule != TW_SHARD_DENSE) {
    if (!fz_group_sizes_sane(c, msg, n)) return 0;
  }
  if (c->rule == TW_SHARD_GROUPED_QUANTIZE ? !c->x || (c->mode == TW_SCALE_TENSOR_DELAYED && !c->scale)
                                           : !c->a || !c->b) {
    snprintf(msg, n, "an input array is missing");
    return 0;
  }
  return 1;
}

fz_verdict fz_run_sharded(fz_shard_env *e, const fz_case *c, fz_result *res) {
  memset(res, 0, sizeof *res);
  char why[200];
  if (!c->sharded) { fz_fail(res, FZ_ERROR, "case", "not a sharded case"); return res->verdict; }
  if (!sharded_sane(c, why, sizeof why)) { fz_fail(res, FZ_ERROR, "case", why); return res->verdict; }
  int R = tw_mesh_ranks(&c->mesh);
  res->ranks = R;
  if (R > e->max_ranks) {
    char mb[64];
    snprintf(why, sizeof why, "mesh %s needs %d ranks; this backend runs at most %d here",
             tw_mesh_str(&c->mesh, mb, sizeof mb), R, e->max_ranks);
    fz_fail(res, FZ_ERROR, "setup", why);
    return res->verdict;
  }
  /* the rule, and the rules restated */
  tw_shard_operand x, w;
  fz_shard_operands(c, &x, &w);
  tw_rule_opts ro = fz_shard_rule_opts(c);
  const char *want = fz_shard_expected_error(c);
  tw_plan *plan = malloc(sizeof *plan);
  shard_job *j = calloc(1, sizeof *j);
  if (!plan || !j) { free(plan); free(j); fz_fail(res, FZ_ERROR, "setup", "out of memory"); return res->verdict; }
  tw_status ps = tw_plan_make(&c->mesh, c->rule, c->pass, &x, c->rule == TW_SHARD_GROUPED_QUANTIZE ? NULL : &w,
                              c->G, &ro, plan);
  char m[480];
  if (want) {
    if (ps != TW_OK && strstr(tw_last_error(), want)) {
      snprintf(m, sizeof m, "PASS refused as the rules say ('%s'): %.380s", want, tw_last_error());
      fz_check_note(res, "expected_error", m);
      res->expected_error = 1;
    } else {
      snprintf(m, sizeof m, "the rules say the planner must refuse this with '%s', but it %s%.380s", want,
               ps == TW_OK ? "made a plan" : "said: ", ps == TW_OK ? "" : tw_last_error());
      fz_check_note(res, "plan_error", m);
      fz_fail(res, FZ_FAIL, "plan_error", m);
    }
    free(plan);
    free(j);
    return res->verdict;
  }
  if (ps != TW_OK) {
    snprintf(m, sizeof m, "valid by the rules, refused by the planner: %.400s", tw_last_error());
    fz_check_note(res, "plan_error", m);
    fz_fail(res, FZ_FAIL, "plan_error", m);
    free(plan);
    free(j);
    return res->verdict;
  }
  res->exact = plan->exact;
  for (int i = 0; i < plan->nsteps; i++)
    if ((int)plan->steps[i].kind >= 0 && plan->steps[i].kind < 6) res->steps[plan->steps[i].kind]++;
  /* the global inputs in their dtypes */
  bag bg;
  bg.n = 0;
  int nd[3];
  int64_t shape[3][TW_MAX_DIMS];
  fz_shard_shapes(c, nd, shape, NULL);
  j->e = e;
  j->c = c;
  j->plan = plan;
  j->scale = tw_tensor_none();
  int quant = c->rule == TW_SHARD_GROUPED_QUANTIZE;
  if (quant) {
    j->in[0] = typed(&bg, c->x_dtype, nd[0], shape[0], c->x);
    if (c->mode == TW_SCALE_TENSOR_DELAYED) j->scale = tw_tensor_1d(c->scale, TW_F32, c->G, TW_MEM_HOST);
  } else {
    j->in[0] = typed(&bg, c->sa.dtype, nd[0], shape[0], c->a);
    j->in[1] = typed(&bg, c->sb.dtype, nd[1], shape[1], c->b);
  }
  if (!j->in[0].data || (!quant && !j->in[1].data)) {
    fz_fail(res, FZ_ERROR, "setup", "out of memory");
  } else if (run_ranks(e, j, R) != 0) {
    int r = -1; /* the rank that failed on its own explains best; the others saw the abort */
    for (int k = 0; k < R && r < 0; k++)
      if (j->st[k] != TW_OK && !strstr(j->msg[k], "communicator aborted")) r = k;
    for (int k = 0; k < R && r < 0; k++)
      if (j->st[k] != TW_OK) r = k;
    if (r < 0) r = 0;
    if (j->st[r] == TW_ERR_ALIGNMENT) { /* a rule the backend states (tw_gemm_alignment) */
      snprintf(m, sizeof m, "SKIP %.300s", j->msg[r]);
      fz_check_note(res, "alignment_rule", m);
    } else {
      status_fail(res, "the sharded run", r, j->st[r], j->msg[r]);
    }
  } else if (quant) {
    check_quantize(e, c, plan, j, &bg, res);
  } else {
    check_gemm(e, c, plan, j, &bg, res);
  }
  for (int r = 0; r < R; r++) {
    free(j->out[r].data);
    q_host_free(&j->q[r]);
  }
  bag_free(&bg);
  free(plan);
  free(j);
  if (res->verdict == FZ_PASS && res->nchecks == 0) fz_fail(res, FZ_ERROR, "setup", "no check ran");
  return res->verdict;
}

const char *fz_shard_plan_text(const fz_case *c, char *buf, size_t n) {
  tw_shard_operand x, w;
  fz_shard_operands(c, &x, &w);
  tw_rule_opts ro = fz_shard_rule_opts(c);
  tw_plan *plan = malloc(sizeof *plan);
  if (!plan) { snprintf(buf, n, "(out of memory)"); return buf; }
  if (tw_plan_make(&c->mesh, c->rule, c->pass, &x, c->rule == TW_SHARD_GROUPED_QUANTIZE ? NULL : &w, c->G, &ro, plan) != TW_OK)
    snprintf(buf, n, "no plan: %s\n", tw_last_error());
  else
    tw_plan_format(plan, buf, n);
  free(plan);
  return buf;
}
