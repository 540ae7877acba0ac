/* Public entry points of tw_comm.h: argument validation written once, then the
 * implementation's table (ref threads, NCCL, or a custom one). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_comm.h"

const char *tw_reduce_op_name(tw_reduce_op op) {
  switch (op) {
    case TW_REDUCE_SUM: return "sum";
    case TW_REDUCE_MAX: return "max";
    default: return "?";
  }
}

int tw_comm_rank(const tw_comm *c) { return c ? c->rank : -1; }
int tw_comm_size(const tw_comm *c) { return c ? c->size : 0; }
const char *tw_comm_kind(const tw_comm *c) { return c && c->ops ? c->ops->name : "?"; }
tw_mem tw_comm_mem(const tw_comm *c) { return c && c->ops ? c->ops->mem : TW_MEM_HOST; }

tw_status tw_comm_set_timeout(tw_comm *c, double seconds) {
  if (!c) return tw_error(TW_ERR_NULL, "comm_set_timeout: comm is NULL");
  c->timeout_s = seconds;
  return TW_OK;
}

tw_status tw_comm_wrap(const tw_comm_ops *ops, int rank, int size, void *impl, tw_comm **out) {
  if (!ops || !out) return tw_error(TW_ERR_NULL, "comm_wrap: ops or out is NULL");
  if (size < 1 || rank < 0 || rank >= size)
    return tw_error(TW_ERR_INVALID_ARG, "comm_wrap: rank %d of size %d", rank, size);
  tw_comm *c = (tw_comm *)calloc(1, sizeof *c);
  if (!c) return tw_error(TW_ERR_MEMORY, "comm_wrap: out of host memory");
  c->ops = ops;
  c->rank = rank;
  c->size = size;
  c->timeout_s = 60.0;
  c->impl = impl;
  *out = c;
  return TW_OK;
}

/* ctx and comm present, the comm's memory is the ctx's, count >= 0, dtype movable. */
static tw_status check_common(const char *op, tw_ctx *ctx, tw_comm *c, int64_t count,
                              tw_dtype dtype) {
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  if (!c) return tw_error(TW_ERR_NULL, "%s: comm is NULL", op);
  if (!c->ops) return tw_error(TW_ERR_INVALID_ARG, "%s: comm has no implementation (destroyed?)", op);
  if (c->ops->mem != tw_ctx_mem(ctx))
    return tw_error(TW_ERR_MEMORY, "%s: a '%s' communicator moves %s memory but the '%s' context works on %s memory",
                    op, c->ops->name, c->ops->mem == TW_MEM_HOST ? "host" : "device",
                    tw_backend_name(tw_ctx_backend(ctx)),
                    tw_ctx_mem(ctx) == TW_MEM_HOST ? "host" : "device");
  if (count < 0) return tw_error(TW_ERR_INVALID_ARG, "%s: count = %lld is negative", op, (long long)count);
  if ((int)dtype < 0 || dtype >= TW_DTYPE_COUNT)
    return tw_error(TW_ERR_DTYPE, "%s: unknown dtype %d", op, (int)dtype);
  if (tw_dtype_bits(dtype) < 8)
    return tw_error(TW_ERR_DTYPE, "%s: %s packs two elements per byte; move it as u8", op,
                    tw_dtype_name(dtype));
  return TW_OK;
}

static tw_status check_reduce(const char *op, tw_dtype dtype, tw_reduce_op rop) {
  if ((int)rop < 0 || rop >= TW_REDUCE_COUNT)
    return tw_error(TW_ERR_INVALID_ARG, "%s: reduce op %d is not sum(0) or max(1)", op, (int)rop);
  if (dtype != TW_F32 && dtype != TW_F64 && dtype != TW_I32 && dtype != TW_I64)
    return tw_error(TW_ERR_DTYPE, "%s: reductions take f32, f64, i32 or i64, not %s (widen to f32 first)",
                    op, tw_dtype_name(dtype));
  return TW_OK;
}

static tw_status check_bufs(const char *op, int64_t count, const void *send, const void *recv) {
  if (count > 0 && (!send || !recv))
    return tw_error(TW_ERR_NULL, "%s: send or recv is NULL for %lld elements", op, (long long)count);
  return TW_OK;
}

static int overlap(const void *a, size_t an, const void *b, size_t bn) {
  const char *x = (const char *)a, *y = (const char *)b;
  return an && bn && x < y + bn && y < x + an;
}

static tw_status unsupported(const char *op, tw_comm *c) {
  return tw_error(TW_ERR_UNSUPPORTED, "%s: the '%s' communicator does not provide it", op,
                  c->ops->name);
}

tw_status tw_all_gather(tw_ctx *ctx, tw_comm *c, const void *send, void *recv, int64_t count,
                        tw_dtype dtype) {
  const char *op = "all_gather";
  TW_TRY(check_common(op, ctx, c, count, dtype));
  TW_TRY(check_bufs(op, count, send, recv));
  size_t b = tw_dtype_storage_bytes(dtype, count);
  if (send != (const char *)recv + (size_t)c->rank * b && overlap(send, b, recv, b * (size_t)c->size))
    return tw_error(TW_ERR_INVALID_ARG, "%s: send overlaps recv but is not recv + rank*count (in place)", op);
  if (!c->ops->all_gather) return unsupported(op, c);
  return c->ops->all_gather(c, ctx, send, recv, count, dtype);
}

tw_status tw_reduce_scatter(tw_ctx *ctx, tw_comm *c, const void *send, void *recv, int64_t count,
                            tw_dtype dtype, tw_reduce_op rop) {
  const char *op = "reduce_scatter";
  TW_TRY(check_common(op, ctx, c, count, dtype));
  TW_TRY(check_reduce(op, dtype, rop));
  TW_TRY(check_bufs(op, count, send, recv));
  size_t b = tw_dtype_storage_bytes(dtype, count);
  if (recv != (const char *)send + (size_t)c->rank * b && overlap(send, b * (size_t)c->size, recv, b))
    return tw_error(TW_ERR_INVALID_ARG, "%s: recv overlaps send but is not send + rank*count (in place)", op);
  if (!c->ops->reduce_scatter) return unsupported(op, c);
  return c->ops->reduce_scatter(c, ctx, send, recv, count, dtype, rop);
}

tw_status tw_all_reduce(tw_ctx *ctx, tw_comm *c, const void *send, void *recv, int64_t count,
                        tw_dtype dtype, tw_reduce_op rop) {
  const char *op = "all_reduce";
  TW_TRY(check_common(op, ctx, c, count, dtype));
  TW_TRY(check_reduce(op, dtype, rop));
  TW_TRY(check_bufs(op, count, send, recv));
  size_t b = tw_dtype_storage_bytes(dtype, count);
  if (send != recv && overlap(send, b, recv, b))
    return tw_error(TW_ERR_INVALID_ARG, "%s: send and recv overlap without being equal", op);
  if (!c->ops->all_reduce) return unsupported(op, c);
  return c->ops->all_reduce(c, ctx, send, recv, count, dtype, rop);
}

static tw_status check_v(const char *op, const tw_comm *c, const char *name, const int64_t *counts,
                         const int64_t *displs) {
  if (!counts || !displs) return tw_error(TW_ERR_NULL, "%s: %s counts or displacements are NULL", op, name);
  for (int j = 0; j < c->size; j++)
    if (counts[j] < 0 || displs[j] < 0)
      return tw_error(TW_ERR_INVALID_ARG, "%s: %s count[%d] = %lld, displ[%d] = %lld (need >= 0)", op,
                      name, j, (long long)counts[j], j, (long long)displs[j]);
  return TW_OK;
}

tw_status tw_all_to_allv(tw_ctx *ctx, tw_comm *c, const void *send, const int64_t *scounts,
                         const int64_t *sdispls, void *recv, const int64_t *rcounts,
                         const int64_t *rdispls, tw_dtype dtype) {
  const char *op = "all_to_allv";
  TW_TRY(check_common(op, ctx, c, 0, dtype));
  TW_TRY(check_v(op, c, "send", scounts, sdispls));
  TW_TRY(check_v(op, c, "recv", rcounts, rdispls));
  int64_t send_end = 0, recv_end = 0;
  for (int j = 0; j < c->size; j++) {
    if (scounts[j] && sdispls[j] + scounts[j] > send_end) send_end = sdispls[j] + scounts[j];
    if (rcounts[j] && rdispls[j] + rcounts[j] > recv_end) recv_end = rdispls[j] + rcounts[j];
  }
  TW_TRY(check_bufs(op, send_end, send, send_end ? send : recv));
  TW_TRY(check_bufs(op, recv_end, recv ? recv : send, recv));
  if (overlap(send, tw_dtype_storage_bytes(dtype, send_end), recv, tw_dtype_storage_bytes(dtype, recv_end)))
    return tw_error(TW_ERR_INVALID_ARG, "%s: send and recv overlap (not supported in place)", op);
  if (!c->ops->all_to_allv) return unsupported(op, c);
  return c->ops->all_to_allv(c, ctx, send, scounts, sdispls, recv, rcounts, rdispls, dtype);
}

tw_status tw_all_to_all(tw_ctx *ctx, tw_comm *c, const void *send, void *recv, int64_t count,
                        tw_dtype dtype) {
  const char *op = "all_to_all";
  TW_TRY(check_common(op, ctx, c, count, dtype));
  int n = c->size;
  int64_t *v = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)n);
  if (!v) return tw_error(TW_ERR_MEMORY, "%s: out of host memory", op);
  for (int j = 0; j < n; j++) {
    v[j] = count;
    v[n + j] = count * j;
  }
  tw_status s = tw_all_to_allv(ctx, c, send, v, v + n, recv, v, v + n, dtype);
  free(v);
  return s;
}

static tw_status check_perm(const char *op, const tw_comm *c, const int *perm) {
  if (!perm) return tw_error(TW_ERR_NULL, "%s: perm is NULL", op);
  for (int j = 0; j < c->size; j++) {
    if (perm[j] < -1 || perm[j] >= c->size)
      return tw_error(TW_ERR_INVALID_ARG, "%s: perm[%d] = %d is not a rank of %d or -1", op, j, perm[j], c->size);
    for (int k = 0; k < j; k++)
      if (perm[j] >= 0 && perm[k] == perm[j])
        return tw_error(TW_ERR_INVALID_ARG, "%s: ranks %d and %d both send to rank %d", op, k, j, perm[j]);
  }
  return TW_OK;
}

tw_status tw_ppermute_n(tw_ctx *ctx, tw_comm *c, int n, const void *const *send, void *const *recv, int64_t count,
                        tw_dtype dtype, const int *const *perm) {
  const char *op = "ppermute_n";
  TW_TRY(check_common(op, ctx, c, count, dtype));
  if (n < 1 || n > TW_PPERMUTE_N_MAX)
    return tw_error(TW_ERR_INVALID_ARG, "%s: n = %d, need 1 <= n <= %d", op, n, TW_PPERMUTE_N_MAX);
  if (!send || !recv || !perm) return tw_error(TW_ERR_NULL, "%s: send, recv or perm array is NULL", op);
  size_t b = tw_dtype_storage_bytes(dtype, count);
  for (int k = 0; k < n; k++) {
    char what[32];
    snprintf(what, sizeof what, "%s op %d", op, k);
    TW_TRY(check_bufs(what, count, send[k], recv[k]));
    TW_TRY(check_perm(what, c, perm[k]));
    for (int i = 0; i < n; i++) {
      if (overlap(send[i], b, recv[k], b))
        return tw_error(TW_ERR_INVALID_ARG, "%s: recv of op %d overlaps send of op %d", op, k, i);
      if (i != k && overlap(recv[i], b, recv[k], b))
        return tw_error(TW_ERR_INVALID_ARG, "%s: recv of ops %d and %d overlap", op, i < k ? i : k, i < k ? k : i);
    }
  }
  if (c->ops->ppermute_n) return c->ops->ppermute_n(c, ctx, n, send, recv, count, dtype, perm);
  if (!c->ops->ppermute) return unsupported(op, c);
  for (int k = 0; k < n; k++) TW_TRY(c->ops->ppermute(c, ctx, send[k], recv[k], count, dtype, perm[k]));
  return TW_OK;
}

tw_status tw_ppermute(tw_ctx *ctx, tw_comm *c, const void *send, void *recv, int64_t count,
                      tw_dtype dtype, const int *perm) {
  const char *op = "ppermute";
  TW_TRY(check_common(op, ctx, c, count, dtype));
  TW_TRY(check_bufs(op, count, send, recv));
  TW_TRY(check_perm(op, c, perm));
  size_t b = tw_dtype_storage_bytes(dtype, count);
  if (overlap(send, b, recv, b)) return tw_error(TW_ERR_INVALID_ARG, "%s: send and recv overlap", op);
  if (!c->ops->ppermute) return unsupported(op, c);
  return c->ops->ppermute(c, ctx, send, recv, count, dtype, perm);
}

tw_status tw_comm_barrier(tw_ctx *ctx, tw_comm *c) {
  TW_TRY(check_common("barrier", ctx, c, 0, TW_U8));
  if (!c->ops->barrier) return unsupported("barrier", c);
  return c->ops->barrier(c, ctx);
}

tw_status tw_comm_wait(tw_ctx *ctx, tw_comm *c) {
  TW_TRY(check_common("comm_wait", ctx, c, 0, TW_U8));
  return c->ops->wait ? c->ops->wait(c, ctx) : TW_OK;
}

tw_status tw_comm_split(tw_comm *c, int color, int key, tw_comm **out) {
  if (!c || !out) return tw_error(TW_ERR_NULL, "comm_split: comm or out is NULL");
  *out = NULL;
  if (color < 0) return tw_error(TW_ERR_INVALID_ARG, "comm_split: color = %d (need >= 0)", color);
  if (!c->ops->split) return unsupported("comm_split", c);
  return c->ops->split(c, color, key, out);
}

tw_status tw_comm_abort(tw_comm *c) {
  if (!c) return tw_error(TW_ERR_NULL, "comm_abort: comm is NULL");
  return c->ops->abort ? c->ops->abort(c) : TW_OK;
}

tw_status tw_comm_destroy(tw_comm *c) {
  if (!c) return TW_OK;
  tw_status s = c->ops && c->ops->destroy ? c->ops->destroy(c) : TW_OK;
  free(c);
  return s;
}
