/* The ref communicator: N ranks as N threads of one process over shared host memory.
 *
 * Every collective is: post this rank's pointers in the group's slots; barrier; read the
 * peers' buffers (reductions in rank order 0..n-1, so results are reproducible bit for bit);
 * barrier (nobody reuses or frees a buffer a peer may still read). The barrier waits at most
 * the handle's timeout, then aborts the group: every later call on every rank fails at once.
 * Groups split from one another share a root; an abort anywhere marks the root too, and
 * waiters poll it every few milliseconds, so a rank blocked in an axis communicator learns
 * that a peer gave up on the world communicator. Arguments arrive validated (shard/comm.c). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "twin/tw_comm.h"

typedef struct group {
  int n;
  struct group *root; /* the group everything was split from (itself for the first) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;
  unsigned long generation;
  int aborted;
  char abort_why[256];
  int refs; /* live handles */
  /* per-rank slots, written before the first barrier of a call */
  const void **send;
  void **recv;
  const int64_t **counts, **displs;
  int *color, *key;
  struct group **made; /* split: the group a leader created */
} group;

static group *group_new(int n, group *root) {
  group *g = (group *)calloc(1, sizeof *g);
  if (!g) return NULL;
  g->n = n;
  g->root = root ? root : g;
  g->refs = n;
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->send = (const void **)calloc((size_t)n, sizeof *g->send);
  g->recv = (void **)calloc((size_t)n, sizeof *g->recv);
  g->counts = (const int64_t **)calloc((size_t)n, sizeof *g->counts);
  g->displs = (const int64_t **)calloc((size_t)n, sizeof *g->displs);
  g->color = (int *)calloc((size_t)n, sizeof *g->color);
  g->key = (int *)calloc((size_t)n, sizeof *g->key);
  g->made = (group **)calloc((size_t)n, sizeof *g->made);
  if (!g->send || !g->recv || !g->counts || !g->displs || !g->color || !g->key || !g->made) {
    free(g->send); free(g->recv); free(g->counts); free(g->displs);
    free(g->color); free(g->key); free(g->made); free(g);
    return NULL;
  }
  return g;
}

static void group_release(group *g) {
  pthread_mutex_lock(&g->mu);
  int left = --g->refs;
  pthread_mutex_unlock(&g->mu);
  if (left > 0) return;
  group *root = g->root;
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
  free(g->send); free(g->recv); free(g->counts); free(g->displs);
  free(g->color); free(g->key); free(g->made);
  free(g);
  if (root != g) group_release(root); /* a split group holds one reference on its root */
}

static int is_aborted(group *g) {
  return __atomic_load_n(&g->aborted, __ATOMIC_ACQUIRE) || __atomic_load_n(&g->root->aborted, __ATOMIC_ACQUIRE);
}

static void mark_aborted(group *g, const char *why) {
  pthread_mutex_lock(&g->mu);
  if (!g->aborted) {
    snprintf(g->abort_why, sizeof g->abort_why, "%s", why);
    __atomic_store_n(&g->aborted, 1, __ATOMIC_RELEASE);
  }
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static group *G(tw_comm *c) { return (group *)c->impl; }

static tw_status aborted_error(tw_comm *c, const char *what) {
  group *g = G(c);
  const char *why = g->abort_why[0] ? g->abort_why : g->root->abort_why;
  return tw_error(TW_ERR_TIMEOUT, "%s: rank %d of %d: communicator aborted (%s)", what, c->rank,
                  c->size, why[0] ? why : "by a peer");
}

/* Waits until all n ranks arrived; after the handle's timeout it aborts the group. Waits in
 * short slices so an abort of the root (another communicator of the same ranks) is seen. */
static tw_status barrier(tw_comm *c, const char *what) {
  group *g = G(c);
  if (is_aborted(g)) return aborted_error(c, what);
  pthread_mutex_lock(&g->mu);
  unsigned long gen = g->generation;
  if (++g->arrived == g->n) {
    g->arrived = 0;
    g->generation++;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return TW_OK;
  }
  struct timespec now, deadline;
  clock_gettime(CLOCK_REALTIME, &now);
  double t = c->timeout_s, waited = 0;
  while (g->generation == gen && !is_aborted(g)) {
    deadline = now;
    deadline.tv_nsec += 20 * 1000000L; /* 20 ms slices */
    if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec++; deadline.tv_nsec -= 1000000000L; }
    pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
    struct timespec after;
    clock_gettime(CLOCK_REALTIME, &after);
    waited += (double)(after.tv_sec - now.tv_sec) + 1e-9 * (double)(after.tv_nsec - now.tv_nsec);
    now = after;
    if (t > 0 && waited >= t && g->generation == gen && !is_aborted(g)) {
      char why[256];
      snprintf(why, sizeof why, "rank %d waited %.3g s in %s; %d of %d ranks had arrived", c->rank, t, what,
               g->arrived, g->n);
      pthread_mutex_unlock(&g->mu);
      mark_aborted(g, why);
      mark_aborted(g->root, why);
      return aborted_error(c, what);
    }
  }
  int ok = g->generation != gen;
  pthread_mutex_unlock(&g->mu);
  return ok ? TW_OK : aborted_error(c, what);
}

static size_t esize(tw_dtype t) { return tw_dtype_storage_bytes(t, 1); }

static tw_status th_all_gather(tw_comm *c, tw_ctx *ctx, const void *send, void *recv,
                               int64_t count, tw_dtype dtype) {
  (void)ctx;
  group *g = G(c);
  g->send[c->rank] = send;
  TW_TRY(barrier(c, "all_gather"));
  size_t bytes = (size_t)count * esize(dtype);
  for (int j = 0; j < g->n && bytes; j++) { /* empty: recv may be NULL */
    char *dst = (char *)recv + (size_t)j * bytes;
    if (dst != g->send[j]) memcpy(dst, g->send[j], bytes);
  }
  return barrier(c, "all_gather");
}

/* acc[i] = op(acc[i], x[i]) for the reducible dtypes; max propagates NaN. */
static void reduce_into(void *acc, const void *x, int64_t n, tw_dtype t, tw_reduce_op op) {
#define TW_REDUCE_LOOP(T, IS_NAN)                                   \
  {                                                                 \
    T *a = (T *)acc;                                                \
    const T *b = (const T *)x;                                      \
    if (op == TW_REDUCE_SUM)                                        \
      for (int64_t i = 0; i < n; i++) a[i] = a[i] + b[i];           \
    else                                                            \
      for (int64_t i = 0; i < n; i++)                               \
        if (!(IS_NAN(a[i])) && ((IS_NAN(b[i])) || b[i] > a[i])) a[i] = b[i]; \
  }
#define TW_NEVER_NAN(v) 0
  switch (t) {
    case TW_F32: TW_REDUCE_LOOP(float, isnan) break;
    case TW_F64: TW_REDUCE_LOOP(double, isnan) break;
    case TW_I32: TW_REDUCE_LOOP(int32_t, TW_NEVER_NAN) break;
    default: TW_REDUCE_LOOP(int64_t, TW_NEVER_NAN) break;
  }
#undef TW_REDUCE_LOOP
#undef TW_NEVER_NAN
}

/* out = op over ranks j = 0..n-1 of (peer j's send + offset), count elements. */
static void reduce_ranks(group *g, size_t offset_bytes, void *out, int64_t count, tw_dtype t,
                         tw_reduce_op op) {
  size_t bytes = (size_t)count * esize(t);
  if (bytes == 0) return; /* empty tensors may have NULL data: no memmove(NULL, ...) */
  memmove(out, (const char *)g->send[0] + offset_bytes, bytes);
  for (int j = 1; j < g->n; j++)
    reduce_into(out, (const char *)g->send[j] + offset_bytes, count, t, op);
}

static tw_status th_all_reduce(tw_comm *c, tw_ctx *ctx, const void *send, void *recv,
                               int64_t count, tw_dtype dtype, tw_reduce_op op) {
  (void)ctx;
  group *g = G(c);
  size_t bytes = (size_t)count * esize(dtype);
  /* a private result: with send == recv a peer may still be reading our send */
  void *tmp = malloc(bytes ? bytes : 1);
  if (!tmp) return tw_error(TW_ERR_MEMORY, "all_reduce: out of host memory for %zu bytes", bytes);
  g->send[c->rank] = send;
  tw_status s = barrier(c, "all_reduce");
  if (s == TW_OK) {
    reduce_ranks(g, 0, tmp, count, dtype, op);
    s = barrier(c, "all_reduce");
    if (s == TW_OK && bytes) memcpy(recv, tmp, bytes);
  }
  free(tmp);
  return s;
}

static tw_status th_reduce_scatter(tw_comm *c, tw_ctx *ctx, const void *send, void *recv,
                                   int64_t count, tw_dtype dtype, tw_reduce_op op) {
  (void)ctx;
  group *g = G(c);
  size_t bytes = (size_t)count * esize(dtype);
  void *tmp = malloc(bytes ? bytes : 1);
  if (!tmp) return tw_error(TW_ERR_MEMORY, "reduce_scatter: out of host memory for %zu bytes", bytes);
  g->send[c->rank] = send;
  tw_status s = barrier(c, "reduce_scatter");
  if (s == TW_OK) {
    reduce_ranks(g, (size_t)c->rank * bytes, tmp, count, dtype, op);
    s = barrier(c, "reduce_scatter");
    if (s == TW_OK && bytes) memcpy(recv, tmp, bytes);
  }
  free(tmp);
  return s;
}

static tw_status th_all_to_allv(tw_comm *c, tw_ctx *ctx, const void *send, const int64_t *scounts,
                                const int64_t *sdispls, void *recv, const int64_t *rcounts,
                                const int64_t *rdispls, tw_dtype dtype) {
  (void)ctx;
  group *g = G(c);
  g->send[c->rank] = send;
  g->counts[c->rank] = scounts;
  g->displs[c->rank] = sdispls;
  TW_TRY(barrier(c, "all_to_allv"));
  size_t es = esize(dtype);
  tw_status s = TW_OK;
  for (int j = 0; j < g->n && s == TW_OK; j++) {
    int64_t sent = g->counts[j][c->rank];
    if (sent != rcounts[j])
      s = tw_error(TW_ERR_SHAPE,
                   "all_to_allv: rank %d expects %lld elements from rank %d, which sends %lld",
                   c->rank, (long long)rcounts[j], j, (long long)sent);
  }
  if (s == TW_OK)
    for (int j = 0; j < g->n; j++)
      if (rcounts[j] > 0) /* empty: recv or the sender's buffer may be NULL */
        memcpy((char *)recv + (size_t)rdispls[j] * es,
               (const char *)g->send[j] + (size_t)g->displs[j][c->rank] * es, (size_t)rcounts[j] * es);
  tw_status s2 = barrier(c, "all_to_allv");
  return s != TW_OK ? s : s2;
}

static tw_status th_ppermute(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count,
                             tw_dtype dtype, const int *perm) {
  (void)ctx;
  group *g = G(c);
  g->send[c->rank] = send;
  TW_TRY(barrier(c, "ppermute"));
  size_t bytes = (size_t)count * esize(dtype);
  int src = -1;
  for (int j = 0; j < g->n; j++)
    if (perm[j] == c->rank) src = j;
  if (bytes == 0) { /* empty: recv may be NULL */
  } else if (src >= 0) {
    memcpy(recv, g->send[src], bytes);
  } else {
    memset(recv, 0, bytes);
  }
  return barrier(c, "ppermute");
}

static tw_status th_barrier(tw_comm *c, tw_ctx *ctx) {
  (void)ctx;
  return barrier(c, "barrier");
}

static tw_status th_wait(tw_comm *c, tw_ctx *ctx) {
  (void)ctx;
  if (is_aborted(G(c))) return aborted_error(c, "wait");
  return TW_OK;
}

static tw_status th_abort(tw_comm *c) {
  char why[64];
  snprintf(why, sizeof why, "rank %d called abort", c->rank);
  mark_aborted(G(c), why);
  mark_aborted(G(c)->root, why);
  return TW_OK;
}

static tw_status th_destroy(tw_comm *c) {
  group_release(G(c));
  c->impl = NULL;
  return TW_OK;
}

static tw_status th_split(tw_comm *c, int color, int key, tw_comm **out);

static const tw_comm_ops threads_ops = {
    .name = "threads",
    .mem = TW_MEM_HOST,
    .all_gather = th_all_gather,
    .reduce_scatter = th_reduce_scatter,
    .all_reduce = th_all_reduce,
    .all_to_allv = th_all_to_allv,
    .ppermute = th_ppermute,
    .barrier = th_barrier,
    .wait = th_wait,
    .split = th_split,
    .abort = th_abort,
    .destroy = th_destroy,
};

static tw_comm *handle_new(group *g, int rank, double timeout_s) {
  tw_comm *c = (tw_comm *)calloc(1, sizeof *c);
  if (!c) return NULL;
  c->ops = &threads_ops;
  c->rank = rank;
  c->size = g->n;
  c->timeout_s = timeout_s;
  c->impl = g;
  return c;
}

/* Members of `color` ordered by (key, parent rank); returns this rank's position. */
static int split_members(group *g, int color, int me, int *members, int *count) {
  int n = 0, pos = -1;
  for (int j = 0; j < g->n; j++)
    if (g->color[j] == color) members[n++] = j;
  for (int a = 1; a < n; a++) /* insertion sort, stable on parent rank */
    for (int b = a; b > 0 && g->key[members[b - 1]] > g->key[members[b]]; b--) {
      int t = members[b]; members[b] = members[b - 1]; members[b - 1] = t;
    }
  for (int i = 0; i < n; i++)
    if (members[i] == me) pos = i;
  *count = n;
  return pos;
}

static tw_status th_split(tw_comm *c, int color, int key, tw_comm **out) {
  group *g = G(c);
  int *members = (int *)malloc(sizeof(int) * (size_t)g->n);
  if (!members) return tw_error(TW_ERR_MEMORY, "comm_split: out of host memory");
  g->color[c->rank] = color;
  g->key[c->rank] = key;
  tw_status s = barrier(c, "comm_split");
  int n = 0, pos = -1;
  if (s == TW_OK) {
    pos = split_members(g, color, c->rank, members, &n);
    if (pos == 0) {
      group *ng = group_new(n, g->root);
      if (ng) { /* the new group keeps the root alive */
        pthread_mutex_lock(&g->root->mu);
        g->root->refs++;
        pthread_mutex_unlock(&g->root->mu);
      }
      g->made[c->rank] = ng; /* NULL (out of memory) is seen by every member below */
    }
    s = barrier(c, "comm_split");
  }
  group *ng = NULL;
  if (s == TW_OK) {
    ng = g->made[members[0]];
    s = barrier(c, "comm_split"); /* the leader's slot is reused by the next split */
  }
  free(members);
  if (s != TW_OK) return s;
  if (!ng) return tw_error(TW_ERR_MEMORY, "comm_split: out of host memory for a group of %d", n);
  tw_comm *h = handle_new(ng, pos, c->timeout_s);
  if (!h) return tw_error(TW_ERR_MEMORY, "comm_split: out of host memory");
  *out = h;
  return TW_OK;
}

tw_status tw_comm_init_threads(int nranks, tw_comm **comms) {
  if (!comms) return tw_error(TW_ERR_NULL, "comm_init_threads: comms is NULL");
  if (nranks < 1 || nranks > 4096)
    return tw_error(TW_ERR_INVALID_ARG, "comm_init_threads: nranks = %d (need 1..4096)", nranks);
  group *g = group_new(nranks, NULL);
  if (!g) return tw_error(TW_ERR_MEMORY, "comm_init_threads: out of host memory");
  for (int r = 0; r < nranks; r++) {
    comms[r] = handle_new(g, r, 60.0);
    if (!comms[r]) {
      for (int j = 0; j < r; j++) free(comms[j]);
      g->refs = 1;
      group_release(g);
      return tw_error(TW_ERR_MEMORY, "comm_init_threads: out of host memory");
    }
  }
  return TW_OK;
}

typedef struct {
  int rank;
  tw_comm *comm;
  tw_rank_fn fn;
  void *arg;
  tw_status status;
  char msg[1024];
} rank_job;

static void *rank_main(void *p) {
  rank_job *j = (rank_job *)p;
  tw_clear_error();
  j->status = j->fn(j->rank, j->comm, j->arg);
  if (j->status != TW_OK) {
    snprintf(j->msg, sizeof j->msg, "%s", tw_last_error());
    if (j->comm && j->comm->ops && j->comm->ops->abort) j->comm->ops->abort(j->comm);
  }
  return NULL;
}

tw_status tw_run_ranks(int nranks, tw_comm **comms, tw_rank_fn fn, void *arg) {
  if (!comms || !fn) return tw_error(TW_ERR_NULL, "run_ranks: comms or fn is NULL");
  if (nranks < 1) return tw_error(TW_ERR_INVALID_ARG, "run_ranks: nranks = %d", nranks);
  rank_job *jobs = (rank_job *)calloc((size_t)nranks, sizeof *jobs);
  pthread_t *th = (pthread_t *)calloc((size_t)nranks, sizeof *th);
  if (!jobs || !th) {
    free(jobs); free(th);
    return tw_error(TW_ERR_MEMORY, "run_ranks: out of host memory");
  }
  int started = 0;
  tw_status s = TW_OK;
  for (int r = 0; r < nranks; r++) {
    jobs[r] = (rank_job){r, comms[r], fn, arg, TW_OK, {0}};
    if (pthread_create(&th[r], NULL, rank_main, &jobs[r]) != 0) {
      s = tw_error(TW_ERR_INTERNAL, "run_ranks: could not start thread %d", r);
      if (comms[0] && comms[0]->ops->abort) comms[0]->ops->abort(comms[0]);
      break;
    }
    started++;
  }
  for (int r = 0; r < started; r++) pthread_join(th[r], NULL);
  if (s == TW_OK) {
    /* The rank that failed on its own explains best; the others report the abort. */
    int first = -1;
    for (int r = 0; r < nranks && first < 0; r++)
      if (jobs[r].status != TW_OK && !strstr(jobs[r].msg, "communicator aborted")) first = r;
    for (int r = 0; r < nranks && first < 0; r++)
      if (jobs[r].status != TW_OK) first = r;
    if (first >= 0) s = tw_error(jobs[first].status, "%s", jobs[first].msg);
  }
  free(jobs);
  free(th);
  return s;
}
