// gpu/lsa_window.cu — the symmetric NCCL window shared by ep_nccl_lsa and the ppermute over the
// window (gpu/lsa_window.h has the contract). Moved here from gpu/ep.cu, where it was written
// and first verified (2-GPU sweeps on H200 and H100, NCCL 2.28.3), so both users open and check
// their windows the same way.
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if NCCL_VERSION_CODE >= 22800
#include <nccl_device.h>
#define LSA_WINDOW_HAVE_API 1
#else
#define LSA_WINDOW_HAVE_API 0
#endif

#include "gpu/comm_nccl.h"
#include "gpu/gpu.h"
#include "gpu/lsa_window.h"

#define HANDSHAKE 0x7477696e4c534100ull  // "twinLSA\0" | rank

extern "C" double gpu_now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

extern "C" tw_status gpu_nccl_done(tw_comm *comm, void *ncv, int rv, const char *what) {
  ncclComm_t nc = (ncclComm_t)ncv;
  ncclResult_t r = (ncclResult_t)rv;
  const double t0 = gpu_now_s();
  while (r == ncclInProgress) {
    ncclResult_t st = ncclInProgress;
    ncclResult_t q = ncclCommGetAsyncError(nc, &st);
    r = q != ncclSuccess ? q : st;
    if (r == ncclInProgress && comm->timeout_s > 0 && gpu_now_s() - t0 > comm->timeout_s) {
      tw_status s = tw_error(TW_ERR_TIMEOUT, "%s: rank %d of %d still in progress after %.3g s; communicator aborted",
                             what, comm->rank, comm->size, comm->timeout_s);
      comm->ops->abort(comm);
      return s;
    }
    if (r == ncclInProgress) {
      struct timespec ns = {0, 100000L};
      nanosleep(&ns, NULL);
    }
  }
  if (r == ncclSuccess) return TW_OK;
  const char *last = ncclGetLastError(nc);
  tw_status s = tw_error(TW_ERR_NCCL, "%s: rank %d: %s%s%s", what, comm->rank, ncclGetErrorString(r),
                         last && *last ? " — " : "", last && *last ? last : "");
  comm->ops->abort(comm);
  return s;
}

namespace {

// The sum of a 0/1 flag over the group (device int32 at dev; host answer > 0 if any rank set it).
tw_status any_rank(tw_comm *comm, tw_ctx *ctx, int32_t *dev, int32_t mine, int32_t *all, const char *what) {
  cudaStream_t s = gpu_of(ctx)->stream;
  GPU_TRY_CUDA(cudaMemcpyAsync(dev, &mine, 4, cudaMemcpyHostToDevice, s), what);
  TW_TRY(comm->ops->all_reduce(comm, ctx, dev, dev, 1, TW_I32, TW_REDUCE_SUM));
  GPU_TRY_CUDA(cudaMemcpyAsync(all, dev, 4, cudaMemcpyDeviceToHost, s), what);
  GPU_TRY_CUDA(cudaStreamSynchronize(s), what);
  return TW_OK;
}

size_t round_to(size_t x, size_t a) { return (x + a - 1) / a * a; }

#if LSA_WINDOW_HAVE_API
static_assert(sizeof(ncclWindow_t) == sizeof(void *), "gpu_lsa_window keeps the window handle as a void *");

// The LSA pointer of every rank's window (lsa index = the rank's place in the LSA team), and this
// rank's handshake word at offset 0 of its own window.
__global__ void map_peers(ncclWindow_t win, int n, int me, int lsa_rank, unsigned char **peer, unsigned char *own) {
  for (int r = threadIdx.x; win && r < n; r += blockDim.x)  // loopback test mode: the table is gathered
    peer[r] = (unsigned char *)ncclGetLsaPointer(win, 0, lsa_rank + (r - me));
  if (threadIdx.x == 0) *(unsigned long long *)own = HANDSHAKE | (unsigned long long)me;
}
#endif

// After a host barrier and after the host checked that every pointer of the table is mapped
// device memory: 1 in *bad unless every rank's handshake word reads back through its LSA
// pointer, this rank's own included. The own LSA pointer is NCCL's flat-VA alias of the window
// (lsaFlatBase + lsaRank * stride), not the ncclMemAlloc pointer: same memory, another address
// (NCCL 2.28.3 and 2.28.9 alike; the first 2-GPU run refused LSA on comparing the two).
__global__ void check_peers(unsigned char *const *peer, int n, int32_t *bad) {
  int b = 0;
  for (int r = 0; r < n; r++) b |= peer[r] == NULL;
  for (int r = 0; r < n && !b; r++) {
    unsigned long long v = *(const volatile unsigned long long *)peer[r];
    if (v != (HANDSHAKE | (unsigned long long)r)) b = 1;
  }
  *bad = b;
}

}  // namespace

static void free_small(tw_ctx *ctx, gpu_lsa_window *L) {
  if (L->small_in_ctx) tw_free(ctx, L->small);
  else cudaFree(L->small);
}

extern "C" tw_status gpu_lsa_window_open(tw_comm *comm, tw_ctx *ctx, size_t want_bytes, int loopback_ok,
                                         int small_in_ctx, const char *what, gpu_lsa_window **out, char *why,
                                         size_t nwhy) {
  *out = NULL;
#if !LSA_WINDOW_HAVE_API
  (void)comm; (void)ctx; (void)want_bytes; (void)loopback_ok; (void)small_in_ctx; (void)what;
  snprintf(why, nwhy, "built against NCCL %d, without the device API (needs 2.28)", NCCL_VERSION_CODE);
  return TW_OK;
#else
  const int n = comm->size, me = comm->rank;
  int device = 0;
  ncclComm_t nc = gpu_nccl_comm(comm, &device);
  int ver = 0;
  const int loop = !nc && loopback_ok && !strcmp(comm->ops->name, "loopback") && comm->ops->mem == TW_MEM_DEVICE;
  if (!nc && !loop) {
    snprintf(why, nwhy, "the '%s' communicator is not NCCL (LSA needs an NCCL window)", comm->ops->name);
    return TW_OK;
  }
  ncclTeam_t team = {n, me, 1};
  if (!loop) {
    if (ncclGetVersion(&ver) != ncclSuccess || ver < 22800) {
      snprintf(why, nwhy, "NCCL runtime %d lacks the device API (LSA windows need 2.28)", ver);
      return TW_OK;
    }
    // ncclTeamLsa is looked up at run time: a binary that names it would not load on an older NCCL
    typedef ncclTeam_t (*team_fn)(ncclComm_t);
    team_fn team_lsa = (team_fn)dlsym(RTLD_DEFAULT, "ncclTeamLsa");
    if (!team_lsa) {
      snprintf(why, nwhy, "NCCL runtime %d has no ncclTeamLsa", ver);
      return TW_OK;
    }
    team = team_lsa(nc);
    if (team.nRanks != n || team.stride != 1) {
      snprintf(why, nwhy,
               "the %d ranks are not one LSA team (NCCL's LSA team: %d ranks, stride %d: no NVLink/P2P path between "
               "every pair of GPUs)", n, team.nRanks, team.stride);
      return TW_OK;
    }
  }
  {  // with lazy module loading the first launch waits for the GPU: load the two kernels now
    cudaFuncAttributes fa;
    GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, (const void *)map_peers), what);
    GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, (const void *)check_peers), what);
  }
  gpu_lsa_window *L = (gpu_lsa_window *)calloc(1, sizeof *L);
  if (!L) return tw_error(TW_ERR_MEMORY, "%s: out of host memory", what);
  L->nc = nc;
  L->loopback = loop;
  L->n = n;
  L->me = me;
  L->bytes = round_to(GPU_LSA_HEADER_BYTES + want_bytes, (size_t)2 << 20);
  cudaStream_t stream = gpu_of(ctx)->stream;
  L->small_in_ctx = small_in_ctx;
  const size_t small_bytes = (size_t)n * 8 + 64;
  tw_status s = small_in_ctx ? tw_alloc(ctx, small_bytes, &L->small)
                             : gpu_cuda_status(cudaMalloc(&L->small, small_bytes), what);
  if (s != TW_OK) {
    free(L);
    return s;
  }
  unsigned char **peer = (unsigned char **)L->small;
  L->peer = peer;
  L->epoch = (unsigned long long *)((char *)L->small + (size_t)n * 8);
  int32_t *flag = (int32_t *)((char *)L->small + (size_t)n * 8 + 16);
  L->dead = (unsigned long long *)((char *)L->small + (size_t)n * 8 + 24);
  int32_t all = 0;
  GPU_TRY_CUDA(cudaSetDevice(device), what);
  ncclResult_t ar = ncclSuccess;
  if (loop) {
    if (cudaMalloc(&L->buf, L->bytes) != cudaSuccess) {
      cudaGetLastError();
      L->buf = NULL;
      ar = ncclUnhandledCudaError;
    }
  } else {
    ar = ncclMemAlloc(&L->buf, L->bytes);
    if (ar != ncclSuccess) L->buf = NULL;
  }
  s = any_rank(comm, ctx, flag, L->buf == NULL, &all, what);
  if (s == TW_OK && all) {
    snprintf(why, nwhy, "ncclMemAlloc of the %zu-byte window failed on a rank (%s)", L->bytes,
             ar != ncclSuccess ? ncclGetErrorString(ar) : "another rank");
  } else if (s == TW_OK && loop) {  // the peer table: every rank's buffer pointer, gathered
    unsigned char *mine = (unsigned char *)L->buf;
    s = gpu_cuda_status(cudaMemcpyAsync(L->epoch, &mine, 8, cudaMemcpyHostToDevice, stream), what);
    if (s == TW_OK) s = gpu_cuda_status(cudaStreamSynchronize(stream), what);
    if (s == TW_OK) s = comm->ops->all_gather(comm, ctx, L->epoch, peer, 1, TW_I64);
  } else if (s == TW_OK) {
    // registered straight into L (heap): NCCL's job may store the handle after the call returned
    ncclWindow_t *win = (ncclWindow_t *)&L->win;
    s = gpu_nccl_done(comm, nc, ncclCommWindowRegister(nc, L->buf, L->bytes, win, NCCL_WIN_COLL_SYMMETRIC), what);
    // A non-blocking communicator registers in a group job, which can still run after the call
    // returned ncclSuccess (2-GPU H200 run, NCCL 2.28.3: the next all_reduce failed with "Attempt
    // to use communicator before the previous operation returned ncclSuccess"): poll it until
    // it leaves ncclInProgress. The job stores the handle when it ends (seen on an H200: a NULL
    // window read by the first kernel), so wait for that too, briefly; a communicator without
    // symmetric memory gives none.
    if (s == TW_OK) s = gpu_nccl_done(comm, nc, ncclInProgress, what);
    const double t0 = gpu_now_s();
    while (s == TW_OK && !__atomic_load_n(win, __ATOMIC_ACQUIRE) && gpu_now_s() - t0 < 5.0) {
      struct timespec ns = {0, 100000L};
      nanosleep(&ns, NULL);
    }
    int nowin = s == TW_OK && !__atomic_load_n(win, __ATOMIC_ACQUIRE);
    if (!nowin && s == TW_OK) {  // the handle must be device memory: the kernels read it
      cudaPointerAttributes at;
      nowin = cudaPointerGetAttributes(&at, (const void *)L->win) != cudaSuccess || at.type != cudaMemoryTypeDevice;
      cudaGetLastError();
    }
    if (s == TW_OK) s = any_rank(comm, ctx, flag, nowin, &all, what);
    if (s == TW_OK && all)
      snprintf(why, nwhy,
               "ncclCommWindowRegister gave no device window on a rank (NCCL runtime %d: no symmetric memory on this "
               "communicator)", ver);
  }
  if (s == TW_OK && !all) {
    cudaError_t e = cudaMemsetAsync(L->buf, 0, L->bytes, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(L->epoch, 0, 8, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(L->dead, 0, 8, stream);
    if (e == cudaSuccess) {
      map_peers<<<1, 32, 0, stream>>>((ncclWindow_t)L->win, n, me, team.rank, peer, (unsigned char *)L->buf);
      e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);  // a host-only barrier must see it done
    s = gpu_cuda_status(e, what);
    if (s == TW_OK) s = comm->ops->barrier(comm, ctx);  // every handshake word is written
    // the table on the host first: a pointer that is not mapped device memory (a window layout
    // misread) stops here, before a kernel loads through it and faults the context
    int32_t bad = 0;
    unsigned char **tab = (unsigned char **)calloc((size_t)n, sizeof *tab);
    char whybad[160] = "a handshake word did not read back";
    if (s == TW_OK && !tab) s = tw_error(TW_ERR_MEMORY, "%s: out of host memory", what);
    if (s == TW_OK)
      s = gpu_cuda_status(cudaMemcpyAsync(tab, peer, sizeof(void *) * (size_t)n, cudaMemcpyDeviceToHost, stream), what);
    if (s == TW_OK) s = gpu_cuda_status(cudaStreamSynchronize(stream), what);
    for (int r = 0; s == TW_OK && r < n && !bad; r++) {
      cudaPointerAttributes at;
      cudaError_t pe = tab[r] ? cudaPointerGetAttributes(&at, tab[r]) : cudaErrorInvalidValue;
      cudaGetLastError();
      if (pe != cudaSuccess || at.type != cudaMemoryTypeDevice) {
        bad = 1;
        snprintf(whybad, sizeof whybad, "rank %d's pointer %p is not mapped device memory (%s, type %d)", r,
                 (void *)tab[r], cudaGetErrorString(pe), pe == cudaSuccess ? (int)at.type : -1);
      }
    }
    L->peer_host = tab;
    if (s == TW_OK && !bad) {
      check_peers<<<1, 1, 0, stream>>>(peer, n, flag);
      s = gpu_cuda_status(cudaGetLastError(), what);
    }
    if (s == TW_OK && !bad) s = gpu_cuda_status(cudaMemcpyAsync(&bad, flag, 4, cudaMemcpyDeviceToHost, stream), what);
    if (s == TW_OK) s = gpu_cuda_status(cudaStreamSynchronize(stream), what);
    if (s == TW_OK) s = any_rank(comm, ctx, flag, bad, &all, what);
    if (s == TW_OK && all)
      snprintf(why, nwhy,
               "the LSA pointers did not reach every rank's window (on this rank: %s%s; headers of NCCL %d, runtime %d)",
               bad ? whybad : "fine", bad ? "" : ", on another rank not", NCCL_VERSION_CODE, ver);
  }
  if (s == TW_OK && !all) {
    *out = L;
    return TW_OK;
  }
  if (L->win && gpu_nccl_comm(comm, NULL)) {  // a failure here aborted the communicator: say so
    tw_status sd = gpu_nccl_done(comm, nc, ncclCommWindowDeregister(nc, (ncclWindow_t)L->win), what);
    if (sd == TW_OK) sd = gpu_nccl_done(comm, nc, ncclInProgress, what);
    if (s == TW_OK) s = sd;
  }
  if (L->buf && loop) cudaFree(L->buf);
  else if (L->buf && gpu_nccl_comm(comm, NULL)) ncclMemFree(L->buf);
  free(L->peer_host);
  free_small(ctx, L);
  free(L);
  return s;
#endif
}

extern "C" tw_status gpu_lsa_window_close(tw_comm *comm, tw_ctx *ctx, gpu_lsa_window *L, const char *what) {
  if (!L) return TW_OK;
  tw_status s = TW_OK;
  if (ctx) cudaStreamSynchronize(gpu_of(ctx)->stream);
  if (L->loopback) cudaFree(L->buf);
#if LSA_WINDOW_HAVE_API
  int device = 0;
  ncclComm_t nc = L->loopback ? NULL : gpu_nccl_comm(comm, &device);
  if (nc) {  // after an abort the window goes with the communicator (NCCL frees it)
    cudaSetDevice(device);
    s = gpu_nccl_done(comm, nc, ncclCommWindowDeregister(nc, (ncclWindow_t)L->win), what);
    if (s == TW_OK) s = gpu_nccl_done(comm, nc, ncclInProgress, what);
    if (s == TW_OK && ncclMemFree(L->buf) != ncclSuccess) s = tw_error(TW_ERR_NCCL, "%s: ncclMemFree failed", what);
  }
#else
  (void)comm;
  (void)what;
#endif
  free(L->peer_host);
  tw_status s2 = L->small_in_ctx ? tw_free(ctx, L->small) : gpu_cuda_status(cudaFree(L->small), what);
  free(L);
  return s != TW_OK ? s : s2;
}
