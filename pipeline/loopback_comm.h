/* A communicator whose N ranks are N threads of one process, each with its own context on
 * the same backend and device (ref: host memory; gpu: one GPU's memory), moving data with the
 * calling rank's tw_tensor_copy. It lets one GPU play S pipeline stages (NCCL takes one rank
 * per device), at the speed of device-to-device copies and host barriers — a correctness
 * vehicle, not a fast path.
 *
 * Each collective: sync the caller's context (its send buffer is final), barrier, the caller
 * reads its peers' buffers into its own recv with its own context, sync, barrier. Reductions
 * (reduce_scatter f32 sum; all_reduce f32 or i32 sum, through the host) add the peers' blocks
 * in rank order 0, 1, ..., like the ref thread communicator, so results match it bit for bit.
 * Supports all_gather, reduce_scatter, all_reduce, all_to_allv (byte blocks; EP and the MoE
 * block on one GPU), ppermute, barrier, split; the rest are TW_ERR_UNSUPPORTED. A peer that does not
 * arrive within the timeout aborts the group: every rank's call then fails. */
#ifndef TWIN_PIPELINE_LOOPBACK_COMM_H
#define TWIN_PIPELINE_LOOPBACK_COMM_H

#include "twin/tw_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* comms[r] is rank r's handle; mem is the memory of the contexts the ranks will use. */
tw_status tw_comm_init_loopback(int nranks, tw_mem mem, tw_comm **comms);

#ifdef __cplusplus
}
#endif
#endif
