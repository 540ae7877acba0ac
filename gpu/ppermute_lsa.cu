// gpu/ppermute_lsa.cu — ppermute / ppermute_n over a symmetric window on an NCCL communicator.
//
// Why: over NCCL's p2p a pipeline's 32 MiB activation moves at 80-122 GB/s (H100 and H200,
// NCCL 2.28.3, whatever the channel settings), while one NVLink direction copies at ~396 GB/s.
// The scan's shift sits on the critical path of every iteration (pipeline/README.md), so the
// move's rate is the step's overhead.
//
// The communicator opens one window (gpu/lsa_window.h) at its first ppermute with room for the
// call's n slots and keeps it; a later call that needs more opens a larger one (collectively) and
// keeps the outgrown one mapped until the communicator is destroyed (a graph captured over it
// keeps its addresses; no rank unmaps memory a peer may still touch). Destroy waits for the last
// call's kernels before it unmaps. Window layout after the header: landed[k] for
// k < TW_PPERMUTE_N_MAX, done[r] for every rank r, then slot k of `slot` bytes per op. One call,
// epoch e (counted on the device, so graph replays go on counting), on the context's stream:
//   1. wait_free: for each op k this rank sends in, wait until its receiver finished the
//      previous call (done[receiver] >= e - 1 in this rank's window). Per rank, not per slot:
//      the perms change between calls, so slot k's last sender may be another rank;
//   2. SMs store send[k] into slot k of the receiver's window (its LSA pointer, 16-byte stores);
//   3. landed: store e into the receiver's landed[k] (release, system scope), then wait until
//      landed[k] >= e in this rank's own window for every op it receives in;
//   4. SMs copy its own slot k into recv[k]; zeros where nothing arrives;
//   5. done: store e into done[this rank] of every rank's window; the epoch becomes e.
// Every wait has a timeout (TWIN_PPERMUTE_TIMEOUT_S, default the communicator's timeout_s) that
// sets GPU_ERR_PP_TIMEOUT in the context's error word (tw_ctx_check reports it) and marks the
// window dead: its later waits do not wait, it stores nothing more into its peers (a live peer
// times out too rather than read a later call's flag as this one's), and each later call
// reports again (peer -1). A rank given another perm than its peers waits for a slot that never
// fills: the same timeout. An abort of the communicator first marks its windows dead from the
// host (a copy on a stream of its own) and waits briefly for the last call, so a wait spinning on
// this rank ends before ncclCommAbort unmaps the window (gpu_ppermute_lsa_stop).
//
// Used when every rank of the communicator is in one LSA team (NVLink / P2P between every pair)
// on NCCL >= 2.28, for n ops of any size; else the NCCL group (gpu/comm_nccl.cu). Forced off by
// TWIN_PPERMUTE=nccl (every rank must see the same value). A call inside a stream capture that
// would need a new window takes the NCCL group instead.
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/comm_nccl.h"
#include "gpu/gpu.h"
#include "gpu/lsa_window.h"

#define PP_MAX TW_PPERMUTE_N_MAX
#define PP_OFF_LANDED GPU_LSA_HEADER_BYTES
#define PP_OFF_DONE (PP_OFF_LANDED + 8 * PP_MAX)
#define PP_OLD_MAX 8

// Where the slots start in a window of an n-rank communicator.
static size_t off_slots(int n) { return ((size_t)PP_OFF_DONE + 8 * (size_t)n + 255) & ~(size_t)255; }

struct ppermute_lsa {
  int state;                   // 0: not tried yet, 1: a window is open, -1: not available here (why)
  gpu_lsa_window *w;           // the open window
  size_t slot;                 // bytes per op slot in w (n_max * slot fit)
  int n_max;                   // slots in w
  // Outgrown windows stay mapped until the communicator is destroyed: a graph captured over one
  // keeps its addresses, and no rank unmaps memory a peer's call may still touch.
  gpu_lsa_window *old[PP_OLD_MAX];
  int n_old;
  cudaEvent_t last;            // recorded after every call: destroy waits for it before unmapping
  int device;
  char why[256];
};

namespace {

struct pp_args {  // passed by value to the three kernels
  unsigned char *const *peer;
  unsigned long long *epoch, *dead;
  long long *err;
  unsigned long long timeout_ns;
  int me, n, ranks;
  int dst[PP_MAX], src[PP_MAX];
};

// Waits until *flag >= e (acquire); on timeout reports `peer` and marks the window dead.
__device__ void wait_for(const pp_args &a, const unsigned long long *flag, unsigned long long e, int peer) {
  if (*(volatile unsigned long long *)a.dead) {
    gpu_report(a.err, GPU_ERR_PP_TIMEOUT, GPU_OP_PPERMUTE, -1, (long long)e);
    return;
  }
  const unsigned long long t0 = gpu_global_ns();
  while (gpu_ld_acquire_sys(flag) < e) {
    if (*(volatile unsigned long long *)a.dead) {  // set by the host's abort (gpu_ppermute_lsa_stop)
      gpu_report(a.err, GPU_ERR_PP_TIMEOUT, GPU_OP_PPERMUTE, -1, (long long)e);
      return;
    }
    if (gpu_global_ns() - t0 > a.timeout_ns) {
      gpu_report(a.err, GPU_ERR_PP_TIMEOUT, GPU_OP_PPERMUTE, peer, (long long)e);
      *(volatile unsigned long long *)a.dead = 1;
      return;
    }
  }
}

__device__ unsigned long long *flag_at(unsigned char *win, size_t off, int k) {
  return (unsigned long long *)(win + off) + k;
}

// Step 1, one thread per op: the receiver of op k finished the previous call (its slots are free).
__global__ void pp_wait_free(pp_args a) {
  const int k = threadIdx.x;
  const unsigned long long e = *a.epoch + 1;
  if (k < a.n && a.dst[k] >= 0) wait_for(a, flag_at(a.peer[a.me], PP_OFF_DONE, a.dst[k]), e - 1, a.dst[k]);
}

// Step 3: the copies into the receivers' slots are complete (stream order); publish them, then
// wait for what this rank receives.
__global__ void pp_landed(pp_args a) {
  const int k = threadIdx.x;
  const unsigned long long e = *a.epoch + 1;
  // a dead window stores nothing into its peers: a live peer must time out too, not take a
  // later call's flag for this one's
  const int dead = *(volatile unsigned long long *)a.dead != 0;
  __threadfence_system();
  if (!dead && k < a.n && a.dst[k] >= 0) gpu_st_release_sys(flag_at(a.peer[a.dst[k]], PP_OFF_LANDED, k), e);
  if (k < a.n && a.src[k] >= 0) wait_for(a, flag_at(a.peer[a.me], PP_OFF_LANDED, k), e, a.src[k]);
}

// Step 5: this rank's slots are copied out: say so in every window (whoever sends to this rank
// next), count the call.
__global__ void pp_release(pp_args a) {
  const unsigned long long e = *a.epoch + 1;
  const int dead = *(volatile unsigned long long *)a.dead != 0;
  __threadfence_system();
  for (int r = threadIdx.x; r < a.ranks && !dead; r += blockDim.x)
    gpu_st_release_sys(flag_at(a.peer[r], PP_OFF_DONE, a.me), e);
  __syncthreads();  // every thread read the epoch before it moves
  if (threadIdx.x == 0) *a.epoch = e;
}

// Steps 2 and 4: op k's bytes from src[k] to dst[k] (blockIdx.y = k; NULL dst: none), 16-byte
// loads and stores, four in flight per thread. The stores into a peer's slot go through its LSA
// pointer from SMs, as ep_nccl_lsa's pushes do; copy-engine copies into the peer's mapping
// (TWIN_PPERMUTE_COPY=ce) work too but measured slower (4 H200s: 0.221 against 0.155 ms for a
// 32 MiB move, 0.321 against 0.281 ms for an iteration's three).
struct pp_copy_args {
  const unsigned char *src[PP_MAX];
  unsigned char *dst[PP_MAX];
  size_t bytes;
  const unsigned long long *dead;  // into the peers (step 2): nothing once the window is dead
};

__global__ void __launch_bounds__(512) pp_copy(pp_copy_args c) {
  const int k = blockIdx.y;
  const unsigned char *s = c.src[k];
  unsigned char *d = c.dst[k];
  if (!d || (c.dead && *(const volatile unsigned long long *)c.dead)) return;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, nt = (size_t)gridDim.x * blockDim.x;
  const size_t nvec = (uintptr_t)s % 16 == 0 && (uintptr_t)d % 16 == 0 ? c.bytes / 16 : 0;
  const uint4 *sv = (const uint4 *)s;
  uint4 *dv = (uint4 *)d;
  size_t i = tid;
  for (; i + 3 * nt < nvec; i += 4 * nt) {
    const uint4 a0 = sv[i], a1 = sv[i + nt], a2 = sv[i + 2 * nt], a3 = sv[i + 3 * nt];
    dv[i] = a0;
    dv[i + nt] = a1;
    dv[i + 2 * nt] = a2;
    dv[i + 3 * nt] = a3;
  }
  for (; i < nvec; i += nt) dv[i] = sv[i];
  for (size_t b = nvec * 16 + tid; b < c.bytes; b += nt) d[b] = s[b];
}

// Steps 2 and 4 from the host: op k's bytes from src[k] to dst[k] for every op with a
// destination, by the copy engines (ce) or by pp_copy (two blocks of 512 per SM spread over
// the ops, at least 64 KiB a block).
tw_status move_blocks(const pp_copy_args &m, int n, int ce, int sms, cudaStream_t s, const char *what) {
  if (ce) {
    for (int k = 0; k < n; k++)
      if (m.dst[k]) GPU_TRY_CUDA(cudaMemcpyAsync(m.dst[k], m.src[k], m.bytes, cudaMemcpyDeviceToDevice, s), what);
    return TW_OK;
  }
  size_t per = (size_t)(2 * sms + n - 1) / (size_t)n;
  if (per * 65536 > m.bytes) per = (m.bytes + 65535) / 65536;
  pp_copy<<<dim3((unsigned)(per < 1 ? 1 : per), (unsigned)n), 512, 0, s>>>(m);
  GPU_TRY_CUDA(cudaGetLastError(), what);
  return TW_OK;
}

// Polls an event until it completed (1), `limit_s` passed or *stop became nonzero (0).
int event_done(cudaEvent_t e, double limit_s, const int *stop) {
  const double t0 = gpu_now_s();
  cudaError_t q;
  while ((q = cudaEventQuery(e)) == cudaErrorNotReady && !(stop && *stop) && gpu_now_s() - t0 < limit_s) {
    struct timespec ns = {0, 100000L};
    nanosleep(&ns, NULL);
  }
  cudaGetLastError();
  return q == cudaSuccess;
}

size_t round256(size_t x) { return (x + 255) & ~(size_t)255; }

double timeout_s(const tw_comm *c) {
  const char *t = getenv("TWIN_PPERMUTE_TIMEOUT_S");
  if (t && atof(t) > 0) return atof(t);
  return c->timeout_s > 0 ? c->timeout_s : 0;  // 0: the communicator never times out, nor do its waits
}

// Opens (or grows) the window so that n slots of `bytes` fit. Collective; every rank passes the
// same n and bytes, so every rank reaches the same answer.
tw_status ensure_window(tw_comm *c, tw_ctx *ctx, ppermute_lsa *p, int n, size_t bytes) {
  const size_t slot = round256(bytes);
  if (p->state == 1 && n <= p->n_max && slot <= p->slot) return TW_OK;
  // grow to at least what the old window held, so alternating sizes do not reopen each time
  int n_max = n;
  size_t want = slot;
  if (p->state == 1) {
    if (p->n_max > n_max) n_max = p->n_max;
    if (p->slot > want) want = p->slot;
    if (p->n_old == PP_OLD_MAX) {  // rare: a communicator whose calls kept growing; the group takes the rest
      snprintf(p->why, sizeof p->why, "nccl: the window grew %d times; calls that do not fit take NCCL's group",
               PP_OLD_MAX);
      return TW_OK;
    }
  }
  gpu_lsa_window *w = NULL;
  char why[256] = "";
  TW_TRY(gpu_lsa_window_open(c, ctx, off_slots(c->size) - GPU_LSA_HEADER_BYTES + (size_t)n_max * want, 0, 0,
                             "ppermute: window", &w, why, sizeof why));
  if (!w) {  // every rank alike: this call takes NCCL's group; a window already open stays in use
    if (p->state != 1) p->state = -1;
    snprintf(p->why, sizeof p->why, "nccl: %s", why);
    return TW_OK;
  }
  if (p->state == 1) p->old[p->n_old++] = p->w;
  else GPU_TRY_CUDA(cudaEventCreateWithFlags(&p->last, cudaEventDisableTiming), "ppermute: event");
  // load the three kernels now: a lazy load waits for the GPU, where a peer's wait may spin
  cudaFuncAttributes fa;
  GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, (const void *)pp_wait_free), "ppermute: loading kernels");
  GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, (const void *)pp_landed), "ppermute: loading kernels");
  GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, (const void *)pp_release), "ppermute: loading kernels");
  GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, (const void *)pp_copy), "ppermute: loading kernels");
  p->w = w;
  p->slot = want;
  p->n_max = n_max;
  p->state = 1;
  snprintf(p->why, sizeof p->why, "window (16-byte stores into the peers' LSA slots)");
  return TW_OK;
}

}  // namespace

extern "C" tw_status gpu_ppermute_lsa(tw_comm *c, tw_ctx *ctx, int n, const void *const *send, void *const *recv,
                                      size_t bytes, const int *dst, const int *src, int *done) {
  *done = 0;
  nccl_impl *im = (nccl_impl *)c->impl;
  const char *force = getenv("TWIN_PPERMUTE");
  if (c->size < 2 || !bytes || (force && !strcmp(force, "nccl"))) return TW_OK;
  if (!im->pp) {
    im->pp = (ppermute_lsa *)calloc(1, sizeof *im->pp);
    if (!im->pp) return tw_error(TW_ERR_MEMORY, "ppermute: out of host memory");
    im->pp->device = im->device;
  }
  ppermute_lsa *p = im->pp;
  if (p->state < 0) return TW_OK;
  cudaStream_t s = gpu_of(ctx)->stream;
  if (p->state == 0 || n > p->n_max || round256(bytes) > p->slot) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    GPU_TRY_CUDA(cudaStreamIsCapturing(s, &cap), "ppermute: capture status");
    if (cap != cudaStreamCaptureStatusNone) return TW_OK;  // no collective setup inside a capture
    TW_TRY(ensure_window(c, ctx, p, n, bytes));
    if (p->state < 0 || n > p->n_max || round256(bytes) > p->slot) return TW_OK;
  }
  const gpu_lsa_window *w = p->w;
  pp_args a;
  memset(&a, 0, sizeof a);
  a.peer = w->peer;
  a.epoch = w->epoch;
  a.dead = w->dead;
  a.err = gpu_of(ctx)->err_word;
  a.timeout_ns = timeout_s(c) > 0 ? (unsigned long long)(timeout_s(c) * 1e9) : ~0ull;
  a.me = c->rank;
  a.n = n;
  a.ranks = c->size;
  for (int k = 0; k < n; k++) {
    a.dst[k] = dst[k];
    a.src[k] = src[k];
  }
  unsigned char *const *peer = w->peer_host;
  unsigned char *own = peer[c->rank];  // this rank's window through its LSA alias, as the peers write it
  // TWIN_PPERMUTE_COPY=ce: the copy engines move the bytes (into the peers' LSA mappings and out
  // of the own window) instead of SMs; every rank may choose alike or not
  const char *ce_env = getenv("TWIN_PPERMUTE_COPY");
  const int ce = ce_env && !strcmp(ce_env, "ce");
  const int sms = gpu_of(ctx)->num_sms;
  const size_t slots = off_slots(c->size);
  pp_copy_args in, out;
  memset(&in, 0, sizeof in);
  memset(&out, 0, sizeof out);
  in.bytes = out.bytes = bytes;
  in.dead = w->dead;
  for (int k = 0; k < n; k++) {
    in.src[k] = (const unsigned char *)send[k];
    in.dst[k] = dst[k] >= 0 ? peer[dst[k]] + slots + (size_t)k * p->slot : NULL;
    out.src[k] = own + slots + (size_t)k * p->slot;
    out.dst[k] = src[k] >= 0 ? (unsigned char *)recv[k] : NULL;
  }
  pp_wait_free<<<1, 32, 0, s>>>(a);
  GPU_TRY_CUDA(cudaGetLastError(), "ppermute: wait_free");
  TW_TRY(move_blocks(in, n, ce, sms, s, "ppermute: copy into the peers' windows"));
  pp_landed<<<1, 32, 0, s>>>(a);
  GPU_TRY_CUDA(cudaGetLastError(), "ppermute: landed");
  for (int k = 0; k < n; k++)
    if (src[k] < 0) GPU_TRY_CUDA(cudaMemsetAsync(recv[k], 0, bytes, s), "ppermute: zero fill");
  TW_TRY(move_blocks(out, n, ce, sms, s, "ppermute: copy out of the window"));
  pp_release<<<1, 32, 0, s>>>(a);
  GPU_TRY_CUDA(cudaGetLastError(), "ppermute: release");
  GPU_TRY_CUDA(cudaEventRecord(p->last, s), "ppermute: event");
  *done = 1;
  return TW_OK;
}

extern "C" tw_status gpu_ppermute_lsa_close(tw_comm *c, void **park, int *nparked) {
  *nparked = 0;
  nccl_impl *im = (nccl_impl *)c->impl;
  ppermute_lsa *p = im ? im->pp : NULL;
  if (!p) return TW_OK;
  tw_status s = TW_OK;
  if (p->state == 1) {
    gpu_lsa_window *all[PP_OLD_MAX + 1];
    int nw = 0;
    for (int i = 0; i < p->n_old; i++) all[nw++] = p->old[i];
    all[nw++] = p->w;
    // the last call's kernels may still run on the stream that issued it: unmapping the window
    // under them would fault the context, so wait for them (polled under the timeout)
    cudaSetDevice(p->device);
    const int drained = !im->aborted && event_done(p->last, c->timeout_s > 0 ? c->timeout_s : 1e30, &im->aborted);
    for (int i = 0; i < nw; i++) {
      if (drained) {
        tw_status si = gpu_lsa_window_close(c, NULL, all[i], "comm_destroy: the ppermute window");
        if (s == TW_OK) s = si;
      } else {  // aborted, or work still in flight: NCCL frees the windows with the communicator;
                // the small buffers are the caller's to free once the family is gone
        if (*nparked < PP_OLD_MAX + 1) park[(*nparked)++] = all[i]->small;
        free(all[i]->peer_host);
        free(all[i]);
      }
    }
    if (!drained && !im->aborted)
      s = tw_error(TW_ERR_TIMEOUT, "comm_destroy: rank %d: a ppermute over the window was still running after %.3g s; "
                   "its window is left mapped", c->rank, c->timeout_s);
    cudaEventDestroy(p->last);
  }
  free(p);
  im->pp = NULL;
  return s;
}

extern "C" const char *gpu_ppermute_lsa_why(const tw_comm *c) {
  if (!gpu_nccl_comm(c, NULL)) return "nccl: not an NCCL communicator, or aborted";
  const nccl_impl *im = (const nccl_impl *)c->impl;
  if (!im->pp) return "nccl: no ppermute over two or more ranks yet";
  return im->pp->state == 1 ? im->pp->why : im->pp->state < 0 ? im->pp->why : "not decided yet";
}

// `twin backends`: how ppermute moves data on NCCL communicators here (decided per communicator
// at its first ppermute; gpu_ppermute_lsa_why says what it chose).
extern "C" void gpu_ppermute_describe(char *buf, size_t n) {
  int ver = 0;
  ncclGetVersion(&ver);
  const char *f = getenv("TWIN_PPERMUTE");
  if (f && !strcmp(f, "nccl"))
    snprintf(buf, n, "NCCL's group (TWIN_PPERMUTE=nccl; NCCL runtime %d)", ver);
  else
    snprintf(buf, n, "over a symmetric window per communicator (16-byte stores into the peers' LSA slots) where "
                     "its ranks are one LSA team on NCCL >= 2.28 (runtime %d), else NCCL's group; "
                     "TWIN_PPERMUTE=nccl forces the group", ver);
}

// Before ncclCommAbort (gpu/comm_nccl.cu): marks this rank's windows dead from the host, so its
// spinning waits end, and waits up to 2 s for the last call's kernels.
extern "C" void gpu_ppermute_lsa_stop(tw_comm *c) {
  nccl_impl *im = (nccl_impl *)c->impl;
  ppermute_lsa *p = im ? im->pp : NULL;
  if (!p || p->state != 1) return;
  cudaSetDevice(p->device);
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  static const unsigned long long one = 1;
  cudaMemcpyAsync(p->w->dead, &one, sizeof one, cudaMemcpyHostToDevice, s);
  for (int i = 0; i < p->n_old; i++) cudaMemcpyAsync(p->old[i]->dead, &one, sizeof one, cudaMemcpyHostToDevice, s);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  event_done(p->last, 2.0, NULL);
}
