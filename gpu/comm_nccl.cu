// gpu/comm_nccl.cu — the NCCL communicator (tw_comm.h) of the CUDA twin.
//
// Every collective is enqueued on the calling context's stream and returns; tw_comm_wait()
// polls the stream and ncclCommGetAsyncError() until the work drained, and aborts the
// communicator (ncclCommAbort) when the handle's timeout passes or NCCL reports an
// asynchronous error, so a lost peer becomes TW_ERR_TIMEOUT / TW_ERR_NCCL instead of a hang.
//
// Every communicator is non-blocking (NCCL's config.blocking = 0), those of
// tw_comm_init_nccl_local too. A blocking communicator does its host-side work inside the
// call: since NCCL 2.22 that includes connecting to the peers at the first collective
// (NCCL_RUNTIME_CONNECT=1, the default), so a peer that never comes keeps ncclAllReduce
// itself from returning and no timeout can ever run. A non-blocking one answers
// ncclInProgress, and settle() polls it under the handle's timeout, aborting when it passes.
// Every call waits until NCCL finished its part (the kernel is on the stream) before it
// returns, so stream order holds as with blocking calls.
//
// A family is the communicators made together in this process (one init call) and every
// communicator split from them. An abort of one marks the family, as the ref communicator
// marks its root group: its siblings fail at once and abort themselves at their next call,
// wait or destroy. That matters because several ranks of one process share NCCL state:
// finalizing or destroying a sibling would wait forever for the half of a collective that
// the aborted rank will never run.
//
// Data movement travels as bytes (ncclUint8), so every dtype of at least 8 bits moves;
// reductions map f32/f64/i32/i64 to NCCL's types. Arguments arrive validated (shard/comm.c).
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/comm_nccl.h"
#include "gpu/gpu.h"
#include "gpu/lsa_window.h"
#include "twin/tw_comm.h"

static_assert(sizeof(tw_comm_id) == sizeof(ncclUniqueId), "tw_comm_id must hold an ncclUniqueId");

#define DEFAULT_TIMEOUT_S 60.0  // a new handle's timeout (tw_comm.h), and init_nccl_local's

static void nap_us(long us) {
  struct timespec ns = {0, us * 1000L};
  nanosleep(&ns, NULL);
}

// ---- families ---------------------------------------------------------------------------

// A device buffer whose free waits for the family's end (see nc_destroy).
typedef struct parked {
  void *p;
  int device;
  struct parked *next;
} parked;

typedef struct family {
  int refs;     // live handles, plus one while the creator still adds handles (atomic)
  int aborted;  // atomic
  pthread_mutex_t mu;
  char why[256];  // the first abort's message
  parked *parked;
} family;

static family *family_new(void) {
  family *f = (family *)calloc(1, sizeof *f);
  if (!f) return NULL;
  f->refs = 1;
  pthread_mutex_init(&f->mu, NULL);
  return f;
}

static void family_retain(family *f) { __atomic_add_fetch(&f->refs, 1, __ATOMIC_ACQ_REL); }

static void family_release(family *f) {
  if (__atomic_sub_fetch(&f->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
  // every communicator of the family is finalized or aborted: nothing can still use these
  for (parked *p = f->parked, *next; p; p = next) {
    next = p->next;
    cudaSetDevice(p->device);
    cudaFree(p->p);
    free(p);
  }
  pthread_mutex_destroy(&f->mu);
  free(f);
}

static int family_aborted(family *f) { return __atomic_load_n(&f->aborted, __ATOMIC_ACQUIRE); }

static void family_mark(family *f, const char *why) {
  pthread_mutex_lock(&f->mu);
  if (!f->aborted) {
    snprintf(f->why, sizeof f->why, "%s", why);
    __atomic_store_n(&f->aborted, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&f->mu);
}

static void family_park(family *f, void *p, int device) {
  parked *n = (parked *)malloc(sizeof *n);
  if (!n) return;  // out of host memory: leak the buffer rather than risk a cudaFree that hangs
  n->p = p;
  n->device = device;
  pthread_mutex_lock(&f->mu);
  n->next = f->parked;
  f->parked = n;
  pthread_mutex_unlock(&f->mu);
}

// ---- one handle -------------------------------------------------------------------------

// nccl_impl (one handle's state) is in gpu/comm_nccl.h: gpu/ep.cu reads its ncclComm_t.

static nccl_impl *I(tw_comm *c) { return (nccl_impl *)c->impl; }

static tw_status nccl_error(ncclComm_t comm, ncclResult_t r, const char *what) {
  const char *last = comm ? ncclGetLastError(comm) : NULL;
  return tw_error(TW_ERR_NCCL, "%s: %s%s%s", what, ncclGetErrorString(r), last && *last ? " — " : "",
                  last && *last ? last : "");
}

// Aborts this handle's communicator once and marks its family; returns s. The caller has
// just set tw_last_error() for s, which becomes the family's reason.
static tw_status abort_comm(tw_comm *c, tw_status s) {
  nccl_impl *im = I(c);
  if (!im->aborted) {
    im->aborted = 1;
    char why[256];
    if (s == TW_OK) snprintf(why, sizeof why, "rank %d of %d called tw_comm_abort", c->rank, c->size);
    else snprintf(why, sizeof why, "%s", tw_last_error());
    family_mark(im->fam, why);  // first, so the siblings stop waiting as early as possible
    gpu_ppermute_lsa_stop(c);   // its window waits end before NCCL unmaps the window
    cudaSetDevice(im->device);
    ncclCommAbort(im->comm);
  }
  return s;
}

// TW_OK unless a sibling aborted the family; then this handle aborts too and says why.
static tw_status family_check(tw_comm *c, const char *what) {
  nccl_impl *im = I(c);
  if (im->aborted || !family_aborted(im->fam)) return TW_OK;
  char why[256];
  pthread_mutex_lock(&im->fam->mu);
  snprintf(why, sizeof why, "%s", im->fam->why);
  pthread_mutex_unlock(&im->fam->mu);
  return abort_comm(c, tw_error(TW_ERR_NCCL, "%s: rank %d of %d: communicator aborted (a communicator of the same group was: %s)",
                                what, c->rank, c->size, why));
}

enum { KEPT_ON = 0, GAVE_UP_TIMEOUT = 1, GAVE_UP_FAMILY = 2 };

// Polls a non-blocking communicator until its last call left ncclInProgress and returns
// the outcome; gives up (*gave_up) after timeout_s (<= 0: never) or when fam is aborted.
static ncclResult_t poll_comm(ncclComm_t comm, double timeout_s, family *fam, int *gave_up) {
  double t0 = gpu_now_s();
  *gave_up = KEPT_ON;
  for (;;) {
    ncclResult_t st = ncclInProgress;
    ncclResult_t q = ncclCommGetAsyncError(comm, &st);
    if (q != ncclSuccess) return q;
    if (st != ncclInProgress) return st;
    if (fam && family_aborted(fam)) {
      *gave_up = GAVE_UP_FAMILY;
      return ncclInProgress;
    }
    if (timeout_s > 0 && gpu_now_s() - t0 > timeout_s) {
      *gave_up = GAVE_UP_TIMEOUT;
      return ncclInProgress;
    }
    nap_us(100);
  }
}

// Turns what an NCCL call answered into a status, polling ncclInProgress under the
// handle's timeout. Any failure aborts: NCCL keeps a failed non-blocking communicator in
// its error state, and its peers would wait for it.
static tw_status settle(tw_comm *c, ncclResult_t r, const char *what) {
  nccl_impl *im = I(c);
  if (r == ncclInProgress) {
    int gave_up;
    r = poll_comm(im->comm, c->timeout_s, im->fam, &gave_up);
    if (gave_up == GAVE_UP_FAMILY) return family_check(c, what);
    if (gave_up == GAVE_UP_TIMEOUT)
      return abort_comm(c, tw_error(TW_ERR_TIMEOUT, "%s: rank %d of %d still in progress after %.3g s; communicator aborted",
                                    what, c->rank, c->size, c->timeout_s));
  }
  if (r == ncclSuccess) return TW_OK;
  return abort_comm(c, nccl_error(im->comm, r, what));
}

// The context's stream, after checking the communicator is usable and the context drives
// this communicator's device.
static tw_status stream_of(tw_comm *c, tw_ctx *ctx, const char *what, cudaStream_t *out) {
  nccl_impl *im = I(c);
  if (im->aborted)
    return tw_error(TW_ERR_NCCL, "%s: rank %d: the communicator was aborted earlier", what, c->rank);
  TW_TRY(family_check(c, what));
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

// Inside a group, calls only queue work; ncclGroupEnd answers for all of them.
static int queued(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

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
  for (int j = 0; j < c->size && queued(r); j++) {
    if (sc[j]) r = ncclSend((const char *)send + (size_t)sd[j] * es, (size_t)sc[j] * es, ncclUint8, j, comm, s);
    if (queued(r) && rc[j]) r = ncclRecv((char *)recv + (size_t)rd[j] * es, (size_t)rc[j] * es, ncclUint8, j, comm, s);
  }
  ncclResult_t e = ncclGroupEnd();  // always: it closes the group even after an error
  return settle(c, queued(r) ? e : r, "all_to_allv");
}

// n ppermutes: over the communicator's window where its ranks are one LSA team
// (gpu/ppermute_lsa.cu), else in one NCCL group, one kernel moving them side by side over their
// links. A rank that receives nothing in op k gets zeros there.
static tw_status permutes(tw_comm *c, tw_ctx *ctx, int n, const void *const *send, void *const *recv, int64_t count,
                          tw_dtype dt, const int *const *perm, const char *what) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, what, &s));
  size_t bytes = (size_t)count * esize(dt);
  int src[TW_PPERMUTE_N_MAX], dst[TW_PPERMUTE_N_MAX];
  for (int k = 0; k < n; k++) {
    src[k] = -1;
    dst[k] = perm[k][c->rank];
    for (int j = 0; j < c->size; j++)
      if (perm[k][j] == c->rank) src[k] = j;
  }
  int done = 0;  // over the communicator's window where every rank is one LSA team (gpu/ppermute_lsa.cu)
  TW_TRY(gpu_ppermute_lsa(c, ctx, n, send, recv, bytes, dst, src, &done));
  if (done) return TW_OK;
  for (int k = 0; k < n; k++)
    if (src[k] < 0 && bytes) GPU_TRY_CUDA(cudaMemsetAsync(recv[k], 0, bytes, s), "ppermute: zero fill");
  ncclComm_t comm = I(c)->comm;
  ncclResult_t r = ncclGroupStart();
  for (int k = 0; k < n && queued(r) && bytes; k++) {
    if (perm[k][c->rank] >= 0) r = ncclSend(send[k], bytes, ncclUint8, perm[k][c->rank], comm, s);
    if (queued(r) && src[k] >= 0) r = ncclRecv(recv[k], bytes, ncclUint8, src[k], comm, s);
  }
  ncclResult_t e = ncclGroupEnd();
  return settle(c, queued(r) ? e : r, what);
}

static tw_status nc_ppermute(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count, tw_dtype dt,
                             const int *perm) {
  return permutes(c, ctx, 1, &send, &recv, count, dt, &perm, "ppermute");
}

static tw_status nc_ppermute_n(tw_comm *c, tw_ctx *ctx, int n, const void *const *send, void *const *recv,
                               int64_t count, tw_dtype dt, const int *const *perm) {
  return permutes(c, ctx, n, send, recv, count, dt, perm, "ppermute_n");
}

static tw_status nc_wait(tw_comm *c, tw_ctx *ctx) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "comm_wait", &s));
  nccl_impl *im = I(c);
  double t0 = gpu_now_s();
  for (;;) {
    cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return TW_OK;
    if (q != cudaErrorNotReady) return gpu_cuda_status(q, "comm_wait: cudaStreamQuery");
    ncclResult_t st = ncclSuccess;
    ncclResult_t g = ncclCommGetAsyncError(im->comm, &st);
    if (g != ncclSuccess) return abort_comm(c, nccl_error(im->comm, g, "comm_wait"));
    if (st != ncclSuccess && st != ncclInProgress) return abort_comm(c, nccl_error(im->comm, st, "comm_wait (asynchronous)"));
    TW_TRY(family_check(c, "comm_wait"));  // a sibling gave up: its half of our collective will never run
    if (c->timeout_s > 0 && gpu_now_s() - t0 > c->timeout_s)
      return abort_comm(c, tw_error(TW_ERR_TIMEOUT,
                                    "comm_wait: rank %d of %d: collectives did not finish in %.3g s; communicator aborted",
                                    c->rank, c->size, c->timeout_s));
    nap_us(50);
  }
}

static tw_status nc_barrier(tw_comm *c, tw_ctx *ctx) {
  cudaStream_t s;
  TW_TRY(stream_of(c, ctx, "barrier", &s));
  TW_TRY(settle(c, ncclAllReduce(I(c)->flag, I(c)->flag, 1, ncclInt32, ncclSum, I(c)->comm, s), "barrier"));
  return nc_wait(c, ctx);
}

static tw_status nc_abort(tw_comm *c) { return abort_comm(c, TW_OK); }

// Finalize (polled under the timeout) lets this rank's work drain, then destroy frees what
// is left. A communicator whose family was aborted is aborted instead: finalize would wait
// for collectives that an aborted sibling will never finish.
static tw_status nc_destroy(tw_comm *c) {
  nccl_impl *im = I(c);
  if (!im) return TW_OK;
  tw_status s = TW_OK;
  cudaSetDevice(im->device);
  if (!im->aborted && family_aborted(im->fam)) abort_comm(c, TW_OK);
  void *pp_park[16];
  int n_park = 0;
  s = gpu_ppermute_lsa_close(c, pp_park, &n_park);  // before the finalize: NCCL frees windows with the communicator
  for (int i = 0; i < n_park; i++) family_park(im->fam, pp_park[i], im->device);
  if (!im->aborted) {
    int gave_up = KEPT_ON;
    ncclResult_t r = ncclCommFinalize(im->comm);
    if (r == ncclInProgress) r = poll_comm(im->comm, c->timeout_s, im->fam, &gave_up);
    if (gave_up == GAVE_UP_FAMILY) {
      abort_comm(c, TW_OK);
    } else if (gave_up == GAVE_UP_TIMEOUT) {
      s = abort_comm(c, tw_error(TW_ERR_TIMEOUT, "comm_destroy: rank %d of %d: ncclCommFinalize did not finish in %.3g s; communicator aborted",
                                 c->rank, c->size, c->timeout_s));
    } else if (r != ncclSuccess) {
      s = abort_comm(c, nccl_error(im->comm, r, "comm_destroy: ncclCommFinalize"));
    } else {
      r = ncclCommDestroy(im->comm);
      if (r != ncclSuccess) s = nccl_error(NULL, r, "comm_destroy: ncclCommDestroy");
    }
  }
  // cudaFree waits for the whole device. After an abort in the family, another communicator
  // of it on this device may still run a collective that only its own abort ends, so the
  // buffer waits for the family's last handle (by then all are finalized or aborted).
  if (im->flag) {
    if (family_aborted(im->fam)) family_park(im->fam, im->flag, im->device);
    else cudaFree(im->flag);
  }
  family_release(im->fam);
  free(im);
  c->impl = NULL;
  return s;
}

static tw_status nc_split(tw_comm *c, int color, int key, tw_comm **out);

static const tw_comm_ops nccl_ops = {
    "nccl",           TW_MEM_DEVICE, nc_all_gather, nc_reduce_scatter, nc_all_reduce, nc_all_to_allv,
    nc_ppermute,      nc_barrier,    nc_wait,       nc_split,          nc_abort,      nc_destroy,
    nc_ppermute_n,
};

// Wraps a ready NCCL communicator of family fam (takes ownership; aborts it on failure).
static tw_status wrap(ncclComm_t comm, int device, family *fam, double timeout_s, tw_comm **out) {
  int rank = 0, size = 0;
  ncclResult_t r = ncclCommUserRank(comm, &rank);
  if (r == ncclSuccess) r = ncclCommCount(comm, &size);
  if (r != ncclSuccess) {
    tw_status s = nccl_error(comm, r, "comm: rank/size query");
    ncclCommAbort(comm);
    return s;
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
  family_retain(fam);
  im->fam = fam;
  c->ops = &nccl_ops;
  c->rank = rank;
  c->size = size;
  c->timeout_s = timeout_s;
  c->impl = im;
  *out = c;
  return TW_OK;
}

// Collective over the parent. With a non-blocking config NCCL runs the split as a job on
// its own thread and stores the child handle only when that job ends (seen on 2 H200s, NCCL
// 2.28: the parent reports success at once and the handle is still NULL), so the handle is
// polled until it appears, then the child until it is ready, both under the timeout. The
// slot lives on the heap: if the split never ends, NCCL may still write it after we return,
// so on that path it is left allocated on purpose.
static tw_status nc_split(tw_comm *c, int color, int key, tw_comm **out) {
  nccl_impl *im = I(c);
  if (im->aborted) return tw_error(TW_ERR_NCCL, "comm_split: rank %d: the communicator was aborted earlier", c->rank);
  TW_TRY(family_check(c, "comm_split"));
  GPU_TRY_CUDA(cudaSetDevice(im->device), "comm_split: cudaSetDevice");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t *slot = (ncclComm_t *)calloc(1, sizeof *slot);
  if (!slot) return tw_error(TW_ERR_MEMORY, "comm_split: out of host memory");
  ncclResult_t r = ncclCommSplit(im->comm, color, key, slot, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    tw_status s = abort_comm(c, nccl_error(im->comm, r, "comm_split"));
    return s;  // NCCL refused the call: no job holds the slot, but leave it (a few bytes) to be safe
  }
  const double t0 = gpu_now_s();
  ncclComm_t made = NULL;
  for (;;) {
    made = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (made) break;
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(im->comm, &st);
    if (q != ncclSuccess || (st != ncclSuccess && st != ncclInProgress))
      return abort_comm(c, nccl_error(im->comm, q != ncclSuccess ? q : st, "comm_split"));
    if (family_aborted(im->fam)) return family_check(c, "comm_split");
    if (c->timeout_s > 0 && gpu_now_s() - t0 > c->timeout_s) {
      tw_status s = abort_comm(c, tw_error(TW_ERR_TIMEOUT, "comm_split: rank %d of %d: no communicator for color %d after "
                                                           "%.3g s (a peer did not join?); communicator aborted",
                                           c->rank, c->size, color, c->timeout_s));
      made = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
      if (made) {  // it ended while we gave up
        ncclCommAbort(made);
        free(slot);
      }
      return s;
    }
    nap_us(100);
  }
  free(slot);
  int gave_up;
  r = poll_comm(made, c->timeout_s, im->fam, &gave_up);
  if (r != ncclSuccess) {
    tw_status s = gave_up == GAVE_UP_TIMEOUT
                      ? tw_error(TW_ERR_TIMEOUT, "comm_split: rank %d: the new communicator was not ready after %.3g s; aborted",
                                 c->rank, c->timeout_s)
                  : gave_up == GAVE_UP_FAMILY ? family_check(c, "comm_split")
                                              : nccl_error(made, r, "comm_split: the new communicator");
    ncclCommAbort(made);
    return s;
  }
  return wrap(made, im->device, im->fam, c->timeout_s, out);
}

extern "C" tw_status tw_comm_init_nccl_local(int ndev, const int *devices, tw_comm **comms) {
  if (!devices || !comms) return tw_error(TW_ERR_NULL, "comm_init_nccl_local: devices or comms is NULL");
  if (ndev < 1) return tw_error(TW_ERR_INVALID_ARG, "comm_init_nccl_local: ndev = %d", ndev);
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess) {
    cudaGetLastError();
    have = 0;
  }
  for (int i = 0; i < ndev; i++) {
    if (devices[i] < 0 || devices[i] >= have)
      return tw_error(TW_ERR_INVALID_ARG, "comm_init_nccl_local: device %d is not one of the %d visible GPUs", devices[i],
                      have);
    for (int j = 0; j < i; j++)
      if (devices[j] == devices[i])
        return tw_error(TW_ERR_INVALID_ARG, "comm_init_nccl_local: device %d is listed twice", devices[i]);
  }
  for (int i = 0; i < ndev; i++) comms[i] = NULL;
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return nccl_error(NULL, r, "comm_init_nccl_local: ncclGetUniqueId");
  ncclComm_t *nc = (ncclComm_t *)calloc((size_t)ndev, sizeof *nc);
  family *fam = family_new();
  if (!nc || !fam) {
    free(nc);
    free(fam);
    return tw_error(TW_ERR_MEMORY, "comm_init_nccl_local: out of host memory");
  }
  // What ncclCommInitAll does, with non-blocking communicators (see the top of this file).
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  tw_status s = TW_OK;
  int caller_dev = 0;
  cudaGetDevice(&caller_dev);
  r = ncclGroupStart();
  for (int i = 0; i < ndev && queued(r); i++) {
    cudaError_t e = cudaSetDevice(devices[i]);
    if (e != cudaSuccess) {
      s = gpu_cuda_status(e, "comm_init_nccl_local: cudaSetDevice");
      break;
    }
    r = ncclCommInitRankConfig(&nc[i], ndev, id, i, &cfg);
  }
  ncclResult_t end = ncclGroupEnd();  // always: it closes the group even after an error
  if (s == TW_OK && !queued(r)) s = nccl_error(NULL, r, "comm_init_nccl_local: ncclCommInitRankConfig");
  if (s == TW_OK && !queued(end)) s = nccl_error(NULL, end, "comm_init_nccl_local: ncclGroupEnd");
  double t0 = gpu_now_s();
  for (int i = 0; i < ndev && s == TW_OK; i++) {
    int gave_up;
    double left = DEFAULT_TIMEOUT_S - (gpu_now_s() - t0);
    ncclResult_t st = nc[i] ? poll_comm(nc[i], left > 1e-3 ? left : 1e-3, NULL, &gave_up) : ncclInternalError;
    if (gave_up)
      s = tw_error(TW_ERR_TIMEOUT, "comm_init_nccl_local: %d GPUs not ready after %.3g s; aborted", ndev, DEFAULT_TIMEOUT_S);
    else if (st != ncclSuccess)
      s = nccl_error(nc[i], st, "comm_init_nccl_local: initialization");
  }
  int made = 0;
  for (; made < ndev && s == TW_OK; made++) {
    s = wrap(nc[made], devices[made], fam, DEFAULT_TIMEOUT_S, &comms[made]);
    if (s != TW_OK) comms[made] = NULL;  // wrap aborted nc[made]
  }
  if (s != TW_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    family_mark(fam, msg);  // the wrapped ones are aborted by their destroy
    for (int i = 0; i < ndev; i++) {
      if (comms[i]) tw_comm_destroy(comms[i]);
      else if (i >= made && nc[i]) ncclCommAbort(nc[i]);
      comms[i] = NULL;
    }
    tw_error(s, "%s", msg);
  }
  family_release(fam);  // the creator's reference
  free(nc);
  cudaSetDevice(caller_dev);
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
  int gave_up = KEPT_ON;
  if (r == ncclInProgress && nc) r = poll_comm(nc, timeout_s, NULL, &gave_up);
  if (gave_up) {
    ncclCommAbort(nc);
    return tw_error(TW_ERR_TIMEOUT, "comm_init_nccl_rank: rank %d of %d: peers did not join in %.3g s; aborted", rank,
                    nranks, timeout_s);
  }
  if (r != ncclSuccess) {
    tw_status s = nccl_error(NULL, r, "comm_init_nccl_rank");
    if (nc) ncclCommAbort(nc);
    return s;
  }
  family *fam = family_new();  // this process's rank and what will be split from it
  if (!fam) {
    ncclCommAbort(nc);
    return tw_error(TW_ERR_MEMORY, "comm_init_nccl_rank: out of host memory");
  }
  tw_status s = wrap(nc, device, fam, timeout_s, out);
  family_release(fam);  // the creator's reference
  return s;
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
