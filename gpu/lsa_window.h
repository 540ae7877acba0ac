// gpu/lsa_window.h — internal: one symmetric NCCL window (ncclMemAlloc + ncclCommWindowRegister)
// of the same size on every rank of a communicator, mapped on each GPU through LSA pointers
// (NVLink / P2P loads, stores and copy-engine copies) and checked by a handshake word before
// anything trusts it. Used by ep_nccl_lsa (gpu/ep.cu) and the ppermute over the window
// (gpu/ppermute_lsa.cu). Nothing outside gpu/ includes this.
//
// Opening is collective over the communicator and every rank reaches the same answer: the static
// facts (NCCL >= 2.28 at run time, ncclTeamLsa present, every rank in one LSA team) first, then a
// flag all-reduced before each step that could differ between ranks (allocation, registration,
// the pointers' handshake). Where the window cannot exist the open returns TW_OK with *out NULL
// and says why; an error status only for a failed collective (the communicator is then aborted).
// Bytes [0, 256) of every window hold the handshake word; users lay out the rest.
#ifndef TWIN_GPU_LSA_WINDOW_H
#define TWIN_GPU_LSA_WINDOW_H

#include <stddef.h>
#include <stdint.h>

#include "twin/tw_comm.h"

#define GPU_LSA_HEADER_BYTES 256

typedef struct gpu_lsa_window {
  int loopback;  // test mode: ranks are threads on one GPU (loopback communicator), the window a cudaMalloc
  int n, me;     // the communicator's size and this rank
  void *nc;      // ncclComm_t (NULL in loopback mode)
  void *win;     // ncclWindow_t
  void *buf;     // this rank's window (ncclMemAlloc or cudaMalloc), `bytes` long, zeroed at open
  size_t bytes;
  void *small;                // the peer table and the words below: tw_alloc'd, or cudaMalloc'd when !small_in_ctx
  int small_in_ctx;
  unsigned char **peer;       // device [n]: rank r's window as mapped on this GPU
  unsigned char **peer_host;  // host [n]: the same table (copy-engine copies take these addresses)
  unsigned long long *epoch;  // device word, 0 at open: for the user's epoch counting
  unsigned long long *dead;   // device word, 0 at open: for the user's sticky timeout
} gpu_lsa_window;

#ifdef __CUDACC__
// Flags between GPUs: release/acquire at system scope, and the global timer for timeouts.
__device__ static inline unsigned long long gpu_ld_acquire_sys(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ static inline void gpu_st_release_sys(unsigned long long *p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline unsigned long long gpu_global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

#ifdef __cplusplus
extern "C" {
#endif

// Opens a window of at least `bytes` (rounded up to 2 MiB) on every rank of comm, on ctx's stream.
// loopback_ok: a loopback communicator with device memory (threads on one GPU) gets cudaMalloc'd
// windows and a gathered peer table (a test mode). small_in_ctx: the small device state counts in
// ctx's ledger (tw_alloc; then close needs the same ctx), else it is the window's own (a window
// that outlives any one context: the communicator's). `what` prefixes messages; why[nwhy] says
// why *out is NULL.
tw_status gpu_lsa_window_open(tw_comm *comm, tw_ctx *ctx, size_t bytes, int loopback_ok, int small_in_ctx,
                              const char *what, gpu_lsa_window **out, char *why, size_t nwhy);
// Synchronizes ctx's stream (ctx may be NULL when !small_in_ctx: the caller drained the work that
// touches the window), deregisters (rank-local in NCCL 2.28) and frees. After an abort the window goes with the communicator (NCCL frees it) and only the rest
// is released.
tw_status gpu_lsa_window_close(tw_comm *comm, tw_ctx *ctx, gpu_lsa_window *w, const char *what);
// Polls a non-blocking communicator's call until it left ncclInProgress (under the handle's
// timeout); a failure or a timeout aborts the communicator. nc is an ncclComm_t, r an ncclResult_t.
tw_status gpu_nccl_done(tw_comm *comm, void *nc, int r, const char *what);
// The wall clock in seconds (CLOCK_MONOTONIC).
double gpu_now_s(void);

#ifdef __cplusplus
}
#endif

#endif
