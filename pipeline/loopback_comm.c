/* The loopback communicator (pipeline/loopback_comm.h). */
#include "pipeline/loopback_comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "twin/tw_pipeline.h"

typedef struct lgroup {
  int n;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;
  unsigned long gen;
  int aborted;
  int refs;
  /* per-rank slots of the current call */
  const void **send;
  void **recv;
  const int64_t **sdispl; /* all_to_allv: each rank's send displacements */
  int *color, *key;
  struct lgroup **made;  /* split: the group each rank joins */
  int *made_rank;
} lgroup;

static lgroup *lgroup_new(int n) {
  lgroup *g = (lgroup *)calloc(1, sizeof *g);
  if (!g) return NULL;
  g->n = n;
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->send = (const void **)calloc((size_t)n, sizeof *g->send);
  g->recv = (void **)calloc((size_t)n, sizeof *g->recv);
  g->sdispl = (const int64_t **)calloc((size_t)n, sizeof *g->sdispl);
  g->color = (int *)calloc((size_t)n, sizeof(int));
  g->key = (int *)calloc((size_t)n, sizeof(int));
  g->made = (lgroup **)calloc((size_t)n, sizeof *g->made);
  g->made_rank = (int *)calloc((size_t)n, sizeof(int));
  if (!g->send || !g->recv || !g->sdispl || !g->color || !g->key || !g->made || !g->made_rank) {
    free(g->send); free(g->recv); free(g->sdispl); free(g->color); free(g->key); free(g->made); free(g->made_rank); free(g);
    return NULL;
  }
  return g;
}

static void lgroup_unref(lgroup *g) {
  pthread_mutex_lock(&g->mu);
  int left = --g->refs;
  pthread_mutex_unlock(&g->mu);
  if (left > 0) return;
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
  free(g->send); free(g->recv); free(g->sdispl); free(g->color); free(g->key); free(g->made); free(g->made_rank); free(g);
}

static tw_status barrier(tw_comm *c, const char *op) {
  lgroup *g = (lgroup *)c->impl;
  pthread_mutex_lock(&g->mu);
  if (g->aborted) {
    pthread_mutex_unlock(&g->mu);
    return tw_error(TW_ERR_TIMEOUT, "%s: loopback communicator aborted", op);
  }
  unsigned long my = g->gen;
  if (++g->arrived == g->n) {
    g->arrived = 0;
    g->gen++;
    pthread_cond_broadcast(&g->cv);
  } else {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    double t = c->timeout_s > 0 ? c->timeout_s : 1e9;
    dl.tv_sec += (time_t)t;
    dl.tv_nsec += (long)((t - (double)(time_t)t) * 1e9);
    if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
    while (g->gen == my && !g->aborted) {
      if (pthread_cond_timedwait(&g->cv, &g->mu, &dl) == ETIMEDOUT && g->gen == my) {
        g->aborted = 1;
        pthread_cond_broadcast(&g->cv);
        break;
      }
    }
    if (g->gen == my) {
      pthread_mutex_unlock(&g->mu);
      return tw_error(TW_ERR_TIMEOUT, "%s: loopback communicator aborted (a peer did not arrive within %.0f s)", op, t);
    }
  }
  pthread_mutex_unlock(&g->mu);
  return TW_OK;
}

static tw_status copy_bytes(tw_ctx *ctx, void *dst, const void *src, size_t n) {
  if (!n) return TW_OK;
  tw_mem m = tw_ctx_mem(ctx);
  tw_tensor d = tw_tensor_1d(dst, TW_U8, (int64_t)n, m), s = tw_tensor_1d((void *)src, TW_U8, (int64_t)n, m);
  return tw_tensor_copy(ctx, &d, &s);
}

/* post, barrier, body, sync, barrier; a failing body still passes the second barrier */
static tw_status collective(tw_comm *c, tw_ctx *ctx, const char *op, const void *send, void *recv,
                            tw_status (*body)(tw_comm *, tw_ctx *, void *), void *arg) {
  lgroup *g = (lgroup *)c->impl;
  TW_TRY(tw_ctx_sync(ctx));
  g->send[c->rank] = send;
  g->recv[c->rank] = recv;
  TW_TRY(barrier(c, op));
  tw_status s = body(c, ctx, arg);
  tw_status s2 = tw_ctx_sync(ctx);
  if (s == TW_OK) s = s2;
  tw_status s3 = barrier(c, op);
  return s != TW_OK ? s : s3;
}

typedef struct {
  int64_t count;
  size_t esize;
  const int *perm;
  const int64_t *rcount, *rdispl; /* all_to_allv, the caller's */
} args;

static tw_status ag_body(tw_comm *c, tw_ctx *ctx, void *p) {
  args *a = (args *)p;
  lgroup *g = (lgroup *)c->impl;
  size_t b = (size_t)a->count * a->esize;
  for (int j = 0; j < g->n; j++) TW_TRY(copy_bytes(ctx, (char *)g->recv[c->rank] + (size_t)j * b, g->send[j], b));
  return TW_OK;
}

static tw_status rs_body(tw_comm *c, tw_ctx *ctx, void *p) {
  args *a = (args *)p;
  lgroup *g = (lgroup *)c->impl;
  float *out = (float *)g->recv[c->rank];
  TW_TRY(copy_bytes(ctx, out, (const float *)g->send[0] + c->rank * a->count, (size_t)a->count * sizeof(float)));
  for (int j = 1; j < g->n; j++) TW_TRY(tw_pipeline_add(ctx, out, (const float *)g->send[j] + c->rank * a->count, a->count));
  return TW_OK;
}

static tw_status pp_body(tw_comm *c, tw_ctx *ctx, void *p) {
  args *a = (args *)p;
  lgroup *g = (lgroup *)c->impl;
  size_t b = (size_t)a->count * a->esize;
  for (int j = 0; j < g->n; j++)
    if (a->perm[j] == c->rank) return copy_bytes(ctx, g->recv[c->rank], g->send[j], b);
  return b ? tw_memset(ctx, g->recv[c->rank], 0, b) : TW_OK;
}

/* all_to_allv: block rank of peer j's send (at its sdispl[rank]) into recv at rdispl[j]. */
static tw_status a2a_body(tw_comm *c, tw_ctx *ctx, void *p) {
  args *a = (args *)p;
  lgroup *g = (lgroup *)c->impl;
  for (int j = 0; j < g->n; j++)
    TW_TRY(copy_bytes(ctx, (char *)g->recv[c->rank] + (size_t)a->rdispl[j] * a->esize,
                      (const char *)g->send[j] + (size_t)g->sdispl[j][c->rank] * a->esize, (size_t)a->rcount[j] * a->esize));
  return TW_OK;
}

static tw_status lb_all_to_allv(tw_comm *c, tw_ctx *ctx, const void *send, const int64_t *sc, const int64_t *sd,
                                void *recv, const int64_t *rc, const int64_t *rd, tw_dtype dt) {
  (void)sc;
  lgroup *g = (lgroup *)c->impl;
  g->sdispl[c->rank] = sd; /* published before collective()'s first barrier */
  args a = {0, tw_dtype_storage_bytes(dt, 1), NULL, rc, rd};
  return collective(c, ctx, "all_to_allv", send, recv, a2a_body, &a);
}

static tw_status lb_all_gather(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt) {
  args a = {count, tw_dtype_storage_bytes(dt, 1), NULL, NULL, NULL};
  return collective(c, ctx, "all_gather", send, recv, ag_body, &a);
}

static tw_status lb_reduce_scatter(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                                   tw_reduce_op op) {
  if (dt != TW_F32 || op != TW_REDUCE_SUM)
    return tw_error(TW_ERR_UNSUPPORTED, "reduce_scatter: the loopback communicator sums f32 only (got %s %s)",
                    tw_dtype_name(dt), tw_reduce_op_name(op));
  args a = {count, 4, NULL, NULL, NULL};
  return collective(c, ctx, "reduce_scatter", send, recv, rs_body, &a);
}

/* all_reduce (f32 or i32 sum, f32 max): each rank reads every peer's send to the host and
 * combines them in rank order 0, 1, ... (like the thread communicator, so sums match it bit
 * for bit), into a host result written to recv after the closing barrier (recv may be send).
 * max keeps a NaN. */
typedef struct {
  int64_t count;
  tw_dtype dt;
  void *sum, *tmp; /* host */
  tw_reduce_op op;
} ar_args;

static tw_status ar_body(tw_comm *c, tw_ctx *ctx, void *p) {
  ar_args *a = (ar_args *)p;
  lgroup *g = (lgroup *)c->impl;
  tw_mem m = tw_ctx_mem(ctx);
  for (int j = 0; j < g->n; j++) {
    tw_tensor h = tw_tensor_1d(j ? a->tmp : a->sum, a->dt, a->count, TW_MEM_HOST);
    tw_tensor d = tw_tensor_1d((void *)g->send[j], a->dt, a->count, m);
    TW_TRY(tw_tensor_copy(ctx, &h, &d));
    for (int64_t i = 0; j && i < a->count; i++) {
      if (a->op == TW_REDUCE_MAX) {
        float t = ((const float *)a->tmp)[i], *s = (float *)a->sum + i;
        if (t > *s || t != t) *s = t;
      } else if (a->dt == TW_F32) ((float *)a->sum)[i] += ((const float *)a->tmp)[i];
      else ((int32_t *)a->sum)[i] += ((const int32_t *)a->tmp)[i];
    }
  }
  return TW_OK;
}

static tw_status lb_all_reduce(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                               tw_reduce_op op) {
  if (!((dt == TW_F32 || dt == TW_I32) && op == TW_REDUCE_SUM) && !(dt == TW_F32 && op == TW_REDUCE_MAX))
    return tw_error(TW_ERR_UNSUPPORTED,
                    "all_reduce: the loopback communicator sums f32 and i32 and takes the max of f32 only (got %s %s)",
                    tw_dtype_name(dt), tw_reduce_op_name(op));
  ar_args a = {count, dt, malloc(4 * (size_t)(count > 0 ? count : 1)), malloc(4 * (size_t)(count > 0 ? count : 1)), op};
  tw_status s = a.sum && a.tmp ? collective(c, ctx, "all_reduce", send, recv, ar_body, &a)
                               : tw_error(TW_ERR_MEMORY, "all_reduce: out of host memory");
  if (s == TW_OK && count > 0) {
    tw_tensor d = tw_tensor_1d(recv, dt, count, tw_ctx_mem(ctx)), h = tw_tensor_1d(a.sum, dt, count, TW_MEM_HOST);
    s = tw_tensor_copy(ctx, &d, &h);
  }
  free(a.sum);
  free(a.tmp);
  return s;
}

static tw_status lb_ppermute(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                             const int *perm) {
  args a = {count, tw_dtype_storage_bytes(dt, 1), perm, NULL, NULL};
  return collective(c, ctx, "ppermute", send, recv, pp_body, &a);
}

static tw_status lb_barrier(tw_comm *c, tw_ctx *ctx) { return barrier(c, "barrier"); }
static tw_status lb_wait(tw_comm *c, tw_ctx *ctx) { return tw_ctx_sync(ctx); }

static tw_status lb_abort(tw_comm *c) {
  lgroup *g = (lgroup *)c->impl;
  pthread_mutex_lock(&g->mu);
  g->aborted = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  return TW_OK;
}

static tw_status lb_destroy(tw_comm *c) {
  if (c->impl) lgroup_unref((lgroup *)c->impl);
  c->impl = NULL;
  return TW_OK;
}

static tw_status lb_split(tw_comm *c, int color, int key, tw_comm **out);

static const tw_comm_ops lb_host = {"loopback", TW_MEM_HOST, lb_all_gather, lb_reduce_scatter, lb_all_reduce, lb_all_to_allv,
                                    lb_ppermute, lb_barrier, lb_wait, lb_split, lb_abort, lb_destroy, NULL};
static const tw_comm_ops lb_device = {"loopback", TW_MEM_DEVICE, lb_all_gather, lb_reduce_scatter, lb_all_reduce, lb_all_to_allv,
                                      lb_ppermute, lb_barrier, lb_wait, lb_split, lb_abort, lb_destroy, NULL};

static tw_status lb_split(tw_comm *c, int color, int key, tw_comm **out) {
  lgroup *g = (lgroup *)c->impl;
  g->color[c->rank] = color;
  g->key[c->rank] = key;
  TW_TRY(barrier(c, "comm_split"));
  tw_status s = TW_OK;
  if (c->rank == 0) { /* rank 0 forms every new group */
    for (int i = 0; i < g->n; i++) g->made[i] = NULL;
    for (int i = 0; i < g->n && s == TW_OK; i++) {
      if (g->made[i]) continue;
      int m = 0;
      for (int j = 0; j < g->n; j++) m += g->color[j] == g->color[i];
      lgroup *ng = lgroup_new(m);
      if (!ng) { s = tw_error(TW_ERR_MEMORY, "comm_split: out of host memory"); break; }
      ng->refs = m;
      for (int j = 0; j < g->n; j++) {
        if (g->color[j] != g->color[i]) continue;
        int r = 0; /* position by (key, parent rank) */
        for (int k = 0; k < g->n; k++)
          if (g->color[k] == g->color[i] && (g->key[k] < g->key[j] || (g->key[k] == g->key[j] && k < j))) r++;
        g->made[j] = ng;
        g->made_rank[j] = r;
      }
    }
  }
  tw_status s2 = barrier(c, "comm_split");
  if (s != TW_OK) return s;
  TW_TRY(s2);
  if (!g->made[c->rank]) return tw_error(TW_ERR_INTERNAL, "comm_split: no group formed");
  tw_status s3 = tw_comm_wrap(c->ops, g->made_rank[c->rank], g->made[c->rank]->n, g->made[c->rank], out);
  if (s3 == TW_OK) (*out)->timeout_s = c->timeout_s;
  TW_TRY(barrier(c, "comm_split")); /* nobody reuses made[] before all have read it */
  return s3;
}

tw_status tw_comm_init_loopback(int n, tw_mem mem, tw_comm **comms) {
  if (!comms) return tw_error(TW_ERR_NULL, "comm_init_loopback: comms is NULL");
  if (n < 1) return tw_error(TW_ERR_INVALID_ARG, "comm_init_loopback: nranks = %d", n);
  lgroup *g = lgroup_new(n);
  if (!g) return tw_error(TW_ERR_MEMORY, "comm_init_loopback: out of host memory");
  g->refs = n;
  for (int r = 0; r < n; r++) {
    tw_status s = tw_comm_wrap(mem == TW_MEM_DEVICE ? &lb_device : &lb_host, r, n, g, &comms[r]);
    if (s != TW_OK) {
      for (int k = 0; k < r; k++) tw_comm_destroy(comms[k]);
      return s;
    }
  }
  return TW_OK;
}
