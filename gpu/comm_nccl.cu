// gpu/comm_nccl.cu — the NCCL communicator (tw_comm.h) of the CUDA twin.
//
// Every collective is enqueued on the calling context's stream and returns; tw_comm_wait()
// polls the stream and ncclCommGetAsyncError() until the work drained, and aborts the
// communicator (ncclCommAbort) when the handle's timeout passes or NCCL reports an
// asynchronous error, so a lost peer becomes TW_ERR_TIMEOUT / TW_ERR_NCCL instead of a hang.
// Communicators made by tw_comm_init_nccl_rank are non-blocking (NCCL's config.blocking = 0):
// every call that answers ncclInProgress is polled to completion under the same timeout.
// Data movement travels as bytes (ncclUint8), so every dtype of at least 8 bits moves;
// reductions map f32/f64/i32/i64 to NCCL's types. Arguments arrive validated (shard/comm.c).
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/gpu.h"
#include "twin/tw_comm.h"

static_assert(sizeof(tw_comm_id) == sizeof(ncclUniqueId), "tw_comm_id must hold an ncclUniqueId");

typedef struct {
  ncclComm_t comm;
  int device;
  int blocking;   // 0: calls may answer ncclInProgress and are polled
  int aborted;
  int *flag;      // device int for the barrier's all-reduce
} nccl_impl;

static nccl_impl *I(tw_comm *c) { return (nccl_impl *)c->impl; }

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static tw_status nccl_error(ncclComm_t comm, ncclResult_t r, const char *what) {
  const char *last = comm ? ncclGetLastError(comm) : NULL;
  return tw_error(TW_ERR_NCCL, "%s: %s%s%s", what, ncclGetErrorString(r), last && *last ? " — " : "",
                  last && *last ? last : "");
}

static tw_status abort_comm(tw_comm *c, tw_status s) {
  nccl_impl *im = I(c);
  if (!im->aborted) {
    ncclCommAbort(im->comm);
    im->aborted = 1;
  }
  return s;
}

// Polls a non-blocking communicator until the last call left ncclInProgress.
static tw_status settle(tw_comm *c, ncclResult_t r, const char *what) {
  nccl_impl *im = I(c);
  if (r == ncclSuccess) return TW_OK;
  if (r != ncclInProgress) return nccl_error(im->comm, r, what);
  double t0 = now_s();
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(im->comm, &st);
    if (q != ncclSuccess) return abort_comm(c, nccl_error(im->comm, q, what));
    if (st == ncclSuccess) return TW_OK;
    if (st != ncclInProgress) return abort_comm(c, nccl_error(im->comm, st, what));
    if (c->timeout_s > 0 && now_s() - t0 > c->timeout_s)
      return abort_comm(c, tw_error(TW_ERR_TIMEOUT, "%s: rank %d of %d still in progress after %.3g s; communicator aborted",
                                    what, c->rank, c->size, c->timeout_s));
    struct timespec ns = {0, 100000};
    nanosleep(&ns, NULL);
  }
}

// The context's stream, after checking the context drives this communicator's device.
static tw_status stream_of(tw_comm *c, tw_ctx *ctx, const char *what, cudaStream_t *out) {
  nccl_impl *im = I(c);
  if (im->aborted)
    return tw_error(TW_ERR_NCCL, "%s: rank %d: the communicator was aborted earlier", what, c->rank);
  gpu_state *st = gpu_of(ctx);
  if (st->device != im->device)
    return tw_error(TW_ERR_INVALID_ARG, "%s: the context drives GPU %d but this communicator's rank lives on GPU %d",
                    what, st->device, im->device);
  GPU_TRY_CUDA(cudaSetDevice(im->device), "comm: cudaSetDevice");
  *out = st->stream;
  return TW_OK;
}

static ncclDataType_t nccl_type(tw_dtype t) {
  switch (t) {
    case TW_F32: return ncclFloat32;
    case TW_F64: return ncclFloat64;
    case TW_I32: return ncclInt32;
    default: return ncclInt64;
  }
}

static size_t esize(tw_dtype t) { return tw_dtype_storage_bytes(t, 1); }

static tw_status nc_all_gather(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "all_gather", &s));
  return settle(c, ncclAllGather(send, recv, (size_t)count * esize(dt), ncclUint8, I(c)->comm, s), "all_gather");
}

static tw_status nc_reduce_scatter(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                                   tw_reduce_op op) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "reduce_scatter", &s));
  return settle(c, ncclReduceScatter(send, recv, (size_t)count, nccl_type(dt), op == TW_REDUCE_SUM ? ncclSum : ncclMax,
                                     I(c)->comm, s),
                "reduce_scatter");
}

static tw_status nc_all_reduce(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                               tw_reduce_op op) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "all_reduce", &s));
  return settle(c, ncclAllReduce(send, recv, (size_t)count, nccl_type(dt), op == TW_REDUCE_SUM ? ncclSum : ncclMax,
                                 I(c)->comm, s),
                "all_reduce");
}

// Counts must agree pairwise (rcount[j] == rank j's scount[r]); NCCL cannot check it, and a
// mismatch stalls the pair: the timeout in tw_comm_wait then aborts the communicator.
static tw_status nc_all_to_allv(tw_comm *c, tw_ctx *ctx, const void *send, const int64_t *sc, const int64_t *sd,
                                void *recv, const int64_t *rc, const int64_t *rd, tw_dtype dt) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "all_to_allv", &s));
  size_t es = esize(dt);
  ncclComm_t comm = I(c)->comm;
  ncclResult_t r = ncclGroupStart();
  for (int j = 0; j < c->size && r == ncclSuccess; j++) {
    if (sc[j]) r = ncclSend((const char *)send + (size_t)sd[j] * es, (size_t)sc[j] * es, ncclUint8, j, comm, s);
    if (r == ncclSuccess && rc[j]) r = ncclRecv((char *)recv + (size_t)rd[j] * es, (size_t)rc[j] * es, ncclUint8, j, comm, s);
  }
  ncclResult_t e = ncclGroupEnd();
  return settle(c, r != ncclSuccess ? r : e, "all_to_allv");
}

static tw_status nc_ppermute(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                             const int *perm) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "ppermute", &s));
  size_t bytes = (size_t)count * esize(dt);
  int src = -1;
  for (int j = 0; j < c->size; j++)
    if (perm[j] == c->rank) src = j;
  if (src < 0 && bytes) GPU_TRY_CUDA(cudaMemsetAsync(recv, 0, bytes, s), "ppermute: zero fill");
  ncclComm_t comm = I(c)->comm;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess && perm[c->rank] >= 0 && bytes) r = ncclSend(send, bytes, ncclUint8, perm[c->rank], comm, s);
  if (r == ncclSuccess && src >= 0 && bytes) r = ncclRecv(recv, bytes, ncclUint8, src, comm, s);
  ncclResult_t e = ncclGroupEnd();
  return settle(c, r != ncclSuccess ? r : e, "ppermute");
}

static tw_status nc_wait(tw_comm *c, tw_ctx *ctx) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "comm_wait", &s));
  nccl_impl *im = I(c);
  double t0 = now_s();
  for (;;) {
    cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return TW_OK;
    if (q != cudaErrorNotReady) return gpu_cuda_status(q, "comm_wait: cudaStreamQuery");
    ncclResult_t st = ncclSuccess;
    ncclResult_t g = ncclCommGetAsyncError(im->comm, &st);
    if (g != ncclSuccess) return abort_comm(c, nccl_error(im->comm, g, "comm_wait"));
    if (st != ncclSuccess && st != ncclInProgress) return abort_comm(c, nccl_error(im->comm, st, "comm_wait (asynchronous)"));
    if (c->timeout_s > 0 && now_s() - t0 > c->timeout_s)
      return abort_comm(c, tw_error(TW_ERR_TIMEOUT,
                                    "comm_wait: rank %d of %d: collectives did not finish in %.3g s; communicator aborted",
                                    c->rank, c->size, c->timeout_s));
    struct timespec ns = {0, 50000};
    nanosleep(&ns, NULL);
  }
}

static tw_status nc_barrier(tw_comm *c, tw_ctx *ctx) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "barrier", &s));
  TW_TRY(settle(c, ncclAllReduce(I(c)->flag, I(c)->flag, 1, ncclInt32, ncclSum, I(c)->comm, s), "barrier"));
  return nc_wait(c, ctx);
}

static tw_status nc_abort(tw_comm *c) { return abort_comm(c, TW_OK); }

static tw_status nc_destroy(tw_comm *c) {
  nccl_impl *im = I(c);
  if (!im) return TW_OK;
  tw_status s = TW_OK;
  cudaSetDevice(im->device);
  if (!im->aborted) {
    ncclResult_t r = ncclCommDestroy(im->comm);
    if (r != ncclSuccess) s = nccl_error(NULL, r, "comm_destroy");
  }
  if (im->flag) cudaFree(im->flag);
  free(im);
  c->impl = NULL;
  return s;
}

static tw_status nc_split(tw_comm *c, int color, int key, tw_comm **out);

static const tw_comm_ops nccl_ops = {
    "nccl",           TW_MEM_DEVICE, nc_all_gather, nc_reduce_scatter, nc_all_reduce, nc_all_to_allv,
    nc_ppermute,      nc_barrier,    nc_wait,       nc_split,          nc_abort,      nc_destroy,
};

// Wraps a ready NCCL communicator (takes ownership).
static tw_status wrap(ncclComm_t comm, int device, int blocking, double timeout_s, tw_comm **out) {
  int rank = 0, size = 0;
  ncclResult_t r = ncclCommUserRank(comm, &rank);
  if (r == ncclSuccess) r = ncclCommCount(comm, &size);
  if (r != ncclSuccess) {
    ncclCommAbort(comm);
    return nccl_error(comm, r, "comm: rank/size query");
  }
  nccl_impl *im = (nccl_impl *)calloc(1, sizeof *im);
  tw_comm *c = (tw_comm *)calloc(1, sizeof *c);
  if (!im || !c) {
    free(im);
    free(c);
    ncclCommAbort(comm);
    return tw_error(TW_ERR_MEMORY, "comm: out of host memory");
  }
  im->comm = comm;
  im->device = device;
  im->blocking = blocking;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMalloc((void **)&im->flag, sizeof(int));
  if (e == cudaSuccess) e = cudaMemset(im->flag, 0, sizeof(int));
  if (e != cudaSuccess) {
    if (im->flag) cudaFree(im->flag);
    free(im);
    free(c);
    ncclCommAbort(comm);
    return gpu_cuda_status(e, "comm: barrier flag");
  }
  c->ops = &nccl_ops;
  c->rank = rank;
  c->size = size;
  c->timeout_s = timeout_s;
  c->impl = im;
  *out = c;
  return TW_OK;
}

static tw_status nc_split(tw_comm *c, int color, int key, tw_comm **out) {
  nccl_impl *im = I(c);
  if (im->aborted) return tw_error(TW_ERR_NCCL, "comm_split: rank %d: the communicator was aborted earlier", c->rank);
  GPU_TRY_CUDA(cudaSetDevice(im->device), "comm_split: cudaSetDevice");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = im->blocking;
  ncclComm_t nc = NULL;
  ncclResult_t r = ncclCommSplit(im->comm, color, key, &nc, &cfg);
  if (r == ncclInProgress && nc) {
    // poll the new communicator until it is ready
    double t0 = now_s();
    ncclResult_t st = ncclInProgress;
    while (st == ncclInProgress) {
      if (ncclCommGetAsyncError(nc, &st) != ncclSuccess) break;
      if (st == ncclInProgress && c->timeout_s > 0 && now_s() - t0 > c->timeout_s) {
        ncclCommAbort(nc);
        return abort_comm(c, tw_error(TW_ERR_TIMEOUT, "comm_split: rank %d not done after %.3g s; aborted", c->rank,
                                      c->timeout_s));
      }
    }
    r = st;
  }
  if (r != ncclSuccess) {
    if (nc) ncclCommAbort(nc);
    return nccl_error(im->comm, r, "comm_split");
  }
  return wrap(nc, im->device, im->blocking, c->timeout_s, out);
}

extern "C" tw_status tw_comm_init_nccl_local(int ndev, const int *devices, tw_comm **comms) {
  if (!devices || !comms) return tw_error(TW_ERR_NULL, "comm_init_nccl_local: devices or comms is NULL");
  if (ndev < 1) return tw_error(TW_ERR_INVALID_ARG, "comm_init_nccl_local: ndev = %d", ndev);
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess) {
    cudaGetLastError();
    have = 0;
  }
  for (int i = 0; i < ndev; i++)
    if (devices[i] < 0 || devices[i] >= have)
      return tw_error(TW_ERR_INVALID_ARG, "comm_init_nccl_local: device %d is not one of the %d visible GPUs", devices[i],
                      have);
  ncclComm_t *nc = (ncclComm_t *)calloc((size_t)ndev, sizeof *nc);
  if (!nc) return tw_error(TW_ERR_MEMORY, "comm_init_nccl_local: out of host memory");
  ncclResult_t r = ncclCommInitAll(nc, ndev, devices);
  if (r != ncclSuccess) {
    free(nc);
    return nccl_error(NULL, r, "comm_init_nccl_local: ncclCommInitAll");
  }
  tw_status s = TW_OK;
  int made = 0;
  for (int i = 0; i < ndev && s == TW_OK; i++, made++) s = wrap(nc[i], devices[i], 1, 60.0, &comms[i]);
  if (s != TW_OK) {
    for (int i = 0; i < made - 1; i++) tw_comm_destroy(comms[i]);
    for (int i = made; i < ndev; i++) ncclCommAbort(nc[i]);
  }
  free(nc);
  return s;
}

extern "C" tw_status tw_comm_nccl_get_id(tw_comm_id *id) {
  if (!id) return tw_error(TW_ERR_NULL, "comm_nccl_get_id: id is NULL");
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return nccl_error(NULL, r, "comm_nccl_get_id");
  memcpy(id->bytes, u.internal, sizeof u.internal);
  return TW_OK;
}

extern "C" tw_status tw_comm_init_nccl_rank(const tw_comm_id *id, int nranks, int rank, int device, double timeout_s,
                                            tw_comm **out) {
  if (!id || !out) return tw_error(TW_ERR_NULL, "comm_init_nccl_rank: id or out is NULL");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return tw_error(TW_ERR_INVALID_ARG, "comm_init_nccl_rank: rank %d of %d", rank, nranks);
  GPU_TRY_CUDA(cudaSetDevice(device), "comm_init_nccl_rank: cudaSetDevice");
  ncclUniqueId u;
  memcpy(u.internal, id->bytes, sizeof u.internal);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t nc = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&nc, nranks, u, rank, &cfg);
  double t0 = now_s();
  while (r == ncclInProgress) {
    ncclResult_t st = ncclInProgress;
    if (ncclCommGetAsyncError(nc, &st) != ncclSuccess) st = ncclInternalError;
    r = st;
    if (r == ncclInProgress && timeout_s > 0 && now_s() - t0 > timeout_s) {
      ncclCommAbort(nc);
      return tw_error(TW_ERR_TIMEOUT, "comm_init_nccl_rank: rank %d of %d: peers did not join in %.3g s; aborted", rank,
                      nranks, timeout_s);
    }
    if (r == ncclInProgress) {
      struct timespec ns = {0, 1000000};
      nanosleep(&ns, NULL);
    }
  }
  if (r != ncclSuccess) {
    if (nc) ncclCommAbort(nc);
    return nccl_error(NULL, r, "comm_init_nccl_rank");
  }
  return wrap(nc, device, 0, timeout_s, out);
}

static int env_int(const char *a, const char *b, const char *c, int *out) {
  const char *names[3] = {a, b, c};
  for (int i = 0; i < 3; i++) {
    const char *v = names[i] ? getenv(names[i]) : NULL;
    if (v && *v) {
      *out = atoi(v);
      return 1;
    }
  }
  return 0;
}

extern "C" int tw_comm_env_rank(int *rank, int *size, int *local_rank) {
  if (!rank || !size || !local_rank) return -1;
  if (!env_int("TWIN_RANK", "OMPI_COMM_WORLD_RANK", "RANK", rank)) return -1;
  if (!env_int("TWIN_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", size)) return -1;
  if (!env_int("TWIN_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", local_rank)) *local_rank = *rank;
  return 0;
}
