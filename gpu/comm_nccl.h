// gpu/comm_nccl.h — internal: the state behind an NCCL tw_comm handle (gpu/comm_nccl.cu owns
// it), shared with gpu/ep.cu so the EP fast path can register a symmetric window on the same
// ncclComm_t. Nothing outside gpu/ includes this.
#ifndef TWIN_GPU_COMM_NCCL_H
#define TWIN_GPU_COMM_NCCL_H

#include <nccl.h>
#include <string.h>

#include "twin/tw_comm.h"

struct family;         // the communicators made together (gpu/comm_nccl.cu)
struct ppermute_lsa;   // the ppermute over the communicator's window (gpu/ppermute_lsa.cu)

typedef struct nccl_impl {
  ncclComm_t comm;
  int device;
  int aborted;
  struct family *fam;
  int *flag;  // device int for the barrier's all-reduce
  struct ppermute_lsa *pp;  // NULL until the first ppermute asks for the window
} nccl_impl;

#ifdef __cplusplus
extern "C" {
#endif
// ppermute_n over a symmetric window on the communicator (gpu/ppermute_lsa.cu): *done = 1 when
// it enqueued the moves (and the zero fills of ranks nothing reaches), 0 when the caller must
// use the NCCL group (no LSA team, forced off, too big for a window during a capture). dst[k] /
// src[k]: where this rank sends op k / from whom it receives (-1: none). Collective. Like
// NCCL's own calls, one communicator's ppermutes are issued from one stream at a time: the
// window's epoch is counted on the device in stream order.
tw_status gpu_ppermute_lsa(tw_comm *c, tw_ctx *ctx, int n, const void *const *send, void *const *recv, size_t bytes,
                           const int *dst, const int *src, int *done);
// At the communicator's destroy, before NCCL's finalize: waits (under the timeout) for the last
// ppermute's kernels, then deregisters and frees its windows. After an abort, or when that wait
// timed out, the windows go with the communicator and park[0 .. *nparked) (room for 9) are
// device buffers the caller frees once nothing of the family can run.
tw_status gpu_ppermute_lsa_close(tw_comm *c, void **park, int *nparked);
// Before ncclCommAbort: ends this rank's spinning window waits (marks its windows dead).
void gpu_ppermute_lsa_stop(tw_comm *c);
// What this communicator's ppermutes use: "window (...)", "nccl: <why>", or that none ran yet.
const char *gpu_ppermute_lsa_why(const tw_comm *c);
#ifdef __cplusplus
}
#endif

// The ncclComm_t of an NCCL handle (and its device), or NULL for any other communicator
// (threads, loopback, custom) and for an aborted one.
static inline ncclComm_t gpu_nccl_comm(const tw_comm *c, int *device) {
  if (!c || !c->ops || !c->ops->name || strcmp(c->ops->name, "nccl") != 0 || !c->impl) return NULL;
  const nccl_impl *im = (const nccl_impl *)c->impl;
  if (im->aborted) return NULL;
  if (device) *device = im->device;
  return im->comm;
}

#endif
