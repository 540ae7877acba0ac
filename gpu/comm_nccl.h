// gpu/comm_nccl.h — internal: the state behind an NCCL tw_comm handle (gpu/comm_nccl.cu owns
// it), shared with gpu/ep.cu so the EP fast path can register a symmetric window on the same
// ncclComm_t. Nothing outside gpu/ includes this.
#ifndef TWIN_GPU_COMM_NCCL_H
#define TWIN_GPU_COMM_NCCL_H

#include <nccl.h>
#include <string.h>

#include "twin/tw_comm.h"

struct family;  // the communicators made together (gpu/comm_nccl.cu)

typedef struct nccl_impl {
  ncclComm_t comm;
  int device;
  int aborted;
  struct family *fam;
  int *flag;  // device int for the barrier's all-reduce
} nccl_impl;

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
