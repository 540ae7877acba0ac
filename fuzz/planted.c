/* Planted bugs: test-only variants of the ref backend, each wrong in one op the way real
 * kernels go wrong, and of the thread communicator, wrong the way a sharded executor goes
 * wrong (the amax max-reduce dropped, a reduce-scatter into the wrong block). `twin fuzz --plant NAME` fuzzes such a variant against the oracle; the
 * planted-bug test shows each is caught and shrunk to a small case. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "fuzz/fuzz_internal.h"
#include "twin/tw_comm.h"
#include "twin/tw_numerics.h"

static size_t esize(tw_dtype t) { return tw_dtype_storage_bytes(t, 1); }

/* grouped_gemm whose last tile drops its only row: groups of 16k+1 rows (k >= 1) leave
 * their last output row unwritten (a `<` that should be `<=` in a 16-row tile bound). */
static tw_status tile_off_by_one(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                                 const tw_tensor *gs, tw_tensor *out, int accumulate) {
  const int32_t *g = gs->data;
  int64_t G = gs->shape[0], N = out->shape[1];
  size_t row = (size_t)N * esize(out->dtype);
  char *saved = malloc(row * (size_t)G + 1);
  if (!saved) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  int64_t o = 0;
  for (int64_t i = 0; i < G; i++) {
    o += g[i];
    if (g[i] > 16 && g[i] % 16 == 1) memcpy(saved + row * (size_t)i, (char *)out->data + row * (size_t)(o - 1), row);
  }
  tw_status s = tw_ref_ops.grouped_gemm(ctx, lhs, rhs, rhs_op, gs, out, accumulate);
  o = 0;
  for (int64_t i = 0; i < G; i++) {
    o += g[i];
    if (g[i] > 16 && g[i] % 16 == 1) memcpy((char *)out->data + row * (size_t)(o - 1), saved + row * (size_t)i, row);
  }
  free(saved);
  return s;
}

/* Tensor-scaled quantize that rounds toward zero instead of to nearest even. */
static tw_status round_toward_zero(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *gs,
                                   const tw_quantize_opts *opts, tw_qtensor *q) {
  tw_status s = tw_ref_ops.grouped_quantize(ctx, x, gs, opts, q);
  if (s != TW_OK || tw_tensor_is_none(&q->row_data)) return s;
  if (opts->mode != TW_SCALE_TENSOR_CURRENT && opts->mode != TW_SCALE_TENSOR_DELAYED) return s;
  const int32_t *g = gs->data;
  int64_t K = x->shape[1], r = 0;
  uint8_t *codes = q->row_data.data;
  const float *si = q->row_scale_inv.data;
  for (int64_t i = 0; i < gs->shape[0]; i++) {
    float scale = 1.0f / si[i];
    for (int64_t e = r * K; e < (r + g[i]) * K; e++) {
      float v = (float)tw_load_as_f64(x->data, x->dtype, e) * scale;
      uint8_t c = codes[e];
      float d = q->qdtype == TW_E4M3 ? tw_e4m3_to_f32(c) : tw_e5m2_to_f32(c);
      if (isfinite(d) && isfinite(v) && (c & 0x7F) != 0 && fabsf(d) > fabsf(v)) codes[e] = (uint8_t)(c - 1);
    }
    r += g[i];
  }
  return s;
}

/* wgrad that skips empty groups: out[g] keeps whatever was there instead of 0. */
static tw_status empty_group_unwritten(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs,
                                       tw_op rhs_op, const tw_tensor *gs, tw_tensor *out, int accumulate) {
  const int32_t *g = gs->data;
  int64_t G = gs->shape[0];
  size_t slab = (size_t)(out->shape[1] * out->shape[2]) * esize(out->dtype);
  char *saved = malloc(slab * (size_t)G + 1);
  if (!saved) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  for (int64_t i = 0; i < G; i++)
    if (g[i] == 0) memcpy(saved + slab * (size_t)i, (char *)out->data + slab * (size_t)i, slab);
  tw_status s = tw_ref_ops.grouped_gemm_wgrad(ctx, lhs, lhs_op, rhs, rhs_op, gs, out, accumulate);
  for (int64_t i = 0; i < G; i++)
    if (g[i] == 0) memcpy((char *)out->data + slab * (size_t)i, saved + slab * (size_t)i, slab);
  free(saved);
  return s;
}

/* ---- communicator bugs (sharded runs): a wrapper around a thread communicator handle that
 * forwards every call to it, but one ---- */
typedef struct {
  tw_comm *inner;
  int bug; /* 0 amax_reduce_dropped, 1 reduce_scatter_shifted */
} wrapped_comm;

static tw_comm *inner_of(tw_comm *c) { return ((wrapped_comm *)c->impl)->inner; }
static int bug_of(tw_comm *c) { return ((wrapped_comm *)c->impl)->bug; }

static tw_status w_all_gather(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt) {
  return tw_all_gather(ctx, inner_of(c), send, recv, count, dt);
}
static tw_status w_all_reduce(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                              tw_reduce_op op) {
  if (bug_of(c) == 0 && op == TW_REDUCE_MAX) { /* dropped: every rank keeps its own values */
    if (send != recv && count) memmove(recv, send, tw_dtype_storage_bytes(dt, count));
    return TW_OK;
  }
  return tw_all_reduce(ctx, inner_of(c), send, recv, count, dt, op);
}
/* bug 1: rank r receives the reduced block of rank r+1 (a wrong block index) */
static tw_status w_reduce_scatter(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count,
                                  tw_dtype dt, tw_reduce_op op) {
  if (bug_of(c) != 1 || c->size == 1) return tw_reduce_scatter(ctx, inner_of(c), send, recv, count, dt, op);
  size_t block = tw_dtype_storage_bytes(dt, count);
  char *all = malloc(block * (size_t)c->size + 1);
  if (!all) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  tw_status s = tw_all_reduce(ctx, inner_of(c), send, all, count * c->size, dt, op);
  if (s == TW_OK && block) memmove(recv, all + block * (size_t)((c->rank + 1) % c->size), block);
  free(all);
  return s;
}
static tw_status w_all_to_allv(tw_comm *c, tw_ctx *ctx, const void *send, const int64_t *sc, const int64_t *sd,
                               void *recv, const int64_t *rc, const int64_t *rd, tw_dtype dt) {
  return tw_all_to_allv(ctx, inner_of(c), send, sc, sd, recv, rc, rd, dt);
}
static tw_status w_ppermute(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                            const int *perm) {
  return tw_ppermute(ctx, inner_of(c), send, recv, count, dt, perm);
}
static tw_status w_barrier(tw_comm *c, tw_ctx *ctx) { return tw_comm_barrier(ctx, inner_of(c)); }
static tw_status w_wait(tw_comm *c, tw_ctx *ctx) { return tw_comm_wait(ctx, inner_of(c)); }
static tw_status w_abort(tw_comm *c) { return tw_comm_abort(inner_of(c)); }
static tw_status w_destroy(tw_comm *c) {
  tw_status s = tw_comm_destroy(inner_of(c));
  free(c->impl);
  return s;
}
static tw_status wrap(tw_comm *inner, int bug, tw_comm **out);
static tw_status w_split(tw_comm *c, int color, int key, tw_comm **out) {
  tw_comm *child = NULL;
  TW_TRY(tw_comm_split(inner_of(c), color, key, &child));
  tw_status s = wrap(child, bug_of(c), out);
  if (s != TW_OK) tw_comm_destroy(child);
  return s;
}

static const tw_comm_ops wrapped_ops = {
    "threads+planted", TW_MEM_HOST, w_all_gather, w_reduce_scatter, w_all_reduce, w_all_to_allv,
    w_ppermute,        w_barrier,   w_wait,       w_split,          w_abort,      w_destroy,
    NULL /* ppermute_n: core runs w_ppermute n times, planted bugs included */};

static tw_status wrap(tw_comm *inner, int bug, tw_comm **out) {
  wrapped_comm *w = malloc(sizeof *w);
  if (!w) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  w->inner = inner;
  w->bug = bug;
  tw_status s = tw_comm_wrap(&wrapped_ops, tw_comm_rank(inner), tw_comm_size(inner), w, out);
  if (s != TW_OK) { free(w); return s; }
  (*out)->timeout_s = inner->timeout_s;
  return TW_OK;
}

static const struct {
  const char *name, *op;
  int comm; /* a communicator bug (0, 1) or -1: an ops-table bug */
} plants[] = {
    {"tile_off_by_one", "grouped_gemm", -1},
    {"round_toward_zero", "quantize", -1},
    {"empty_group_unwritten", "wgrad", -1},
    {"amax_reduce_dropped", "quantize", 0},
    {"reduce_scatter_shifted", "gemm", 1},
};
#define NPLANTS ((int)(sizeof plants / sizeof plants[0]))
static tw_backend_ops planted_tables[NPLANTS];

int fz_plant_count(void) { return NPLANTS; }
const char *fz_plant_name(int i) { return i >= 0 && i < NPLANTS ? plants[i].name : NULL; }
const char *fz_plant_op(int i) { return i >= 0 && i < NPLANTS ? plants[i].op : NULL; }

int fz_plant_is_comm(const char *name) {
  for (int i = 0; name && i < NPLANTS; i++)
    if (strcmp(name, plants[i].name) == 0) return plants[i].comm >= 0;
  return 0;
}

int fz_plant_comms(const char *name, int n, tw_comm **comms) {
  for (int i = 0; name && i < NPLANTS; i++) {
    if (strcmp(name, plants[i].name) != 0 || plants[i].comm < 0) continue;
    for (int r = 0; r < n; r++) {
      tw_comm *w = NULL;
      if (wrap(comms[r], plants[i].comm, &w) != TW_OK) return -1;
      comms[r] = w;
    }
    return 0;
  }
  return -1;
}

/* Rank threads of a sharded run plant their contexts at once: each table is filled once,
 * under a lock, and never written again. */
static pthread_mutex_t tables_mu = PTHREAD_MUTEX_INITIALIZER;
static int tables_filled[NPLANTS];

int fz_plant(tw_ctx *ctx, const char *name) {
  if (!ctx || !name || ctx->ops != &tw_ref_ops) return -1;
  for (int i = 0; i < NPLANTS; i++) {
    if (strcmp(name, plants[i].name) != 0 || plants[i].comm >= 0) continue;
    tw_backend_ops *t = &planted_tables[i];
    pthread_mutex_lock(&tables_mu);
    if (!tables_filled[i]) {
      *t = tw_ref_ops;
      t->name = plants[i].name;
      if (i == 0) t->grouped_gemm = tile_off_by_one;
      if (i == 1) t->grouped_quantize = round_toward_zero;
      if (i == 2) t->grouped_gemm_wgrad = empty_group_unwritten;
      tables_filled[i] = 1;
    }
    pthread_mutex_unlock(&tables_mu);
    ctx->ops = t;
    return 0;
  }
  return -1;
}
