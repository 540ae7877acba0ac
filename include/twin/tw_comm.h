/* twin communicators: the collectives that sharded plans, expert routing and the pipeline
 * stand on.
 *
 * A communicator (tw_comm) connects `size` ranks; each rank holds its own handle and calls
 * every collective with the same arguments (counts, dtype, op) in the same order. Buffers
 * live in the memory of the context passed to the call (host for ref, device for gpu), and
 * the call runs on that context's stream:
 *   ref  (tw_comm_init_threads): N ranks are N threads of one process over shared host
 *        memory. Calls are blocking. Reductions run in a fixed order (rank 0 + rank 1 + ...,
 *        in the dtype's own arithmetic), so results are reproducible bit for bit.
 *   gpu  (tw_comm_init_nccl_*): NCCL. Calls are stream-ordered: they return once enqueued on
 *        the context's stream; tw_comm_wait() blocks until the stream drained, reports NCCL's
 *        asynchronous errors and aborts the communicator when the timeout passes. A call that
 *        waits for its peers on the host (connecting at the first collective, a split) is
 *        bounded by the same timeout. An abort reaches the communicators created with it in
 *        this process (one init call) and those split from them: their next call fails.
 * Every rank of a thread communicator that waits longer than the timeout (a peer that never
 * came, or a peer that called tw_comm_abort) returns TW_ERR_TIMEOUT / TW_ERR_NCCL; after an
 * abort every later call on any rank of that communicator fails at once instead of hanging.
 *
 * Semantics (n = size, r = rank, `count` in elements of `dtype`):
 *   all_gather:     recv[j*count + i] = send_j[i]                 recv has n*count elements
 *   reduce_scatter: recv[i] = op_j send_j[r*count + i]            send has n*count elements
 *   all_reduce:     recv[i] = op_j send_j[i]
 *   all_to_all:     recv[j*count + i] = send_j[r*count + i]       (block r of rank j's send)
 *   all_to_allv:    recv[rdispl[j] + i] = send_j[sdispl_j[r] + i], i < rcount[j] which must
 *                   equal scount_j[r] (counts and displacements are host int64 arrays [n])
 *   ppermute:       recv = send of the rank src with perm[src] == r; zeros if none sends to r.
 *                   perm [n] (host): perm[j] = destination of rank j, or -1; no destination
 *                   twice. All ranks pass the same perm.
 *   ppermute_n:     n ppermutes (n <= TW_PPERMUTE_N_MAX) of count elements each, as one call:
 *                   op k moves send[k] by perm[k]. No recv buffer may overlap another op's
 *                   send or recv. On NCCL whose ranks share NVLink / P2P (one LSA team, NCCL
 *                   >= 2.28) the blocks go through a symmetric window the communicator opens at
 *                   its first ppermute (n x count elements, kept until it is destroyed; a peer
 *                   that never comes sets the context's device error word after the timeout:
 *                   tw_ctx_check); elsewhere in one NCCL group, side by side; the ref
 *                   communicators run them in order. Same results.
 *   barrier:        returns when every rank entered it.
 * op_j is applied over j = 0, 1, ..., n-1 in that order (ref). Reductions take f32, f64, i32
 * and i64 (sum, max); max propagates NaN. 16-bit floats are reduced by widening to f32 first
 * (NCCL would round every step; twin keeps one rounding, done by the caller). Data movement
 * takes every dtype of at least 8 bits.
 * In place: all_reduce with send == recv; all_gather with send == recv + r*count;
 * reduce_scatter with recv == send + r*count. Other overlaps are TW_ERR_INVALID_ARG.
 *
 * Splitting: tw_comm_split(parent, color, key) is collective over the parent; ranks with the
 * same color form a new communicator, ordered by (key, parent rank). tw_shard.h derives one
 * communicator per mesh axis from it.
 *
 * Custom communicators (MPI, another runtime): fill a tw_comm_ops table and wrap it with
 * tw_comm_wrap(); every entry point validates arguments before calling through the table.
 */
#ifndef TWIN_TW_COMM_H
#define TWIN_TW_COMM_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { TW_REDUCE_SUM = 0, TW_REDUCE_MAX = 1, TW_REDUCE_COUNT } tw_reduce_op;
const char *tw_reduce_op_name(tw_reduce_op op); /* "sum", "max" */

int tw_comm_rank(const tw_comm *comm);
int tw_comm_size(const tw_comm *comm);
const char *tw_comm_kind(const tw_comm *comm); /* "threads", "nccl", or the custom name */
tw_mem tw_comm_mem(const tw_comm *comm);       /* where its buffers must live */

/* Seconds a call may wait for its peers before the communicator is aborted (default 60;
 * <= 0 waits forever). Per handle. */
tw_status tw_comm_set_timeout(tw_comm *comm, double seconds);

tw_status tw_all_gather(tw_ctx *ctx, tw_comm *comm, const void *send, void *recv, int64_t count,
                        tw_dtype dtype);
tw_status tw_reduce_scatter(tw_ctx *ctx, tw_comm *comm, const void *send, void *recv,
                            int64_t count, tw_dtype dtype, tw_reduce_op op);
tw_status tw_all_reduce(tw_ctx *ctx, tw_comm *comm, const void *send, void *recv, int64_t count,
                        tw_dtype dtype, tw_reduce_op op);
tw_status tw_all_to_all(tw_ctx *ctx, tw_comm *comm, const void *send, void *recv, int64_t count,
                        tw_dtype dtype);
tw_status tw_all_to_allv(tw_ctx *ctx, tw_comm *comm, const void *send, const int64_t *send_counts,
                         const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                         const int64_t *recv_displs, tw_dtype dtype);
tw_status tw_ppermute(tw_ctx *ctx, tw_comm *comm, const void *send, void *recv, int64_t count,
                      tw_dtype dtype, const int *perm);
#define TW_PPERMUTE_N_MAX 8
tw_status tw_ppermute_n(tw_ctx *ctx, tw_comm *comm, int n, const void *const *send, void *const *recv,
                        int64_t count, tw_dtype dtype, const int *const *perm);
tw_status tw_comm_barrier(tw_ctx *ctx, tw_comm *comm);

/* gpu: waits for this rank's enqueued collectives on ctx's stream (polling NCCL's async
 * error), aborting the communicator after the timeout (TW_ERR_TIMEOUT). ref: TW_OK. */
tw_status tw_comm_wait(tw_ctx *ctx, tw_comm *comm);

/* Collective over parent. color >= 0; *out is the new communicator of this rank. */
tw_status tw_comm_split(tw_comm *parent, int color, int key, tw_comm **out);

/* Marks the communicator failed on every rank (peers blocked in a call return an error);
 * call it when a rank gives up mid-plan so the others do not wait for it. */
tw_status tw_comm_abort(tw_comm *comm);
/* NULL is fine. gpu: lets this rank's work drain for at most the timeout (ncclCommFinalize),
 * else aborts; a communicator whose group saw an abort is aborted at once. */
tw_status tw_comm_destroy(tw_comm *comm);

/* ---- ref: N ranks as N threads ------------------------------------------------------ */
/* Creates the n handles of one group: comms[r] belongs to the thread playing rank r. */
tw_status tw_comm_init_threads(int nranks, tw_comm **comms);

/* Runs fn(rank, comms[rank], arg) on n threads (rank 0 on a new thread too) and joins them;
 * returns the first non-OK status by rank order, with that rank's message. When a rank fails
 * it aborts the group so the others return instead of waiting. */
typedef tw_status (*tw_rank_fn)(int rank, tw_comm *comm, void *arg);
tw_status tw_run_ranks(int nranks, tw_comm **comms, tw_rank_fn fn, void *arg);

/* ---- gpu: NCCL ---------------------------------------------------------------------- */
typedef struct { char bytes[128]; } tw_comm_id; /* = ncclUniqueId */

/* One process, several GPUs: comms[i] is rank i on devices[i] (like ncclCommInitAll, with
 * non-blocking communicators; initialization is bounded by 60 s). */
tw_status tw_comm_init_nccl_local(int ndev, const int *devices, tw_comm **comms);
/* One process per GPU: rank 0 makes the id and hands it to every other process (MPI_Bcast,
 * a file, the launcher's store); each process then calls init_rank with it. Initialization
 * is non-blocking inside and bounded by timeout_s (<= 0: forever). */
tw_status tw_comm_nccl_get_id(tw_comm_id *id);
tw_status tw_comm_init_nccl_rank(const tw_comm_id *id, int nranks, int rank, int device,
                                 double timeout_s, tw_comm **out);
/* Reads rank and size from the environment (TWIN_RANK/TWIN_WORLD_SIZE, else
 * OMPI_COMM_WORLD_RANK/SIZE, else RANK/WORLD_SIZE) and the device from LOCAL_RANK
 * (OMPI_COMM_WORLD_LOCAL_RANK); 0 if found. */
int tw_comm_env_rank(int *rank, int *size, int *local_rank);

/* ---- the seam for other communicator implementations -------------------------------- */
typedef struct tw_comm_ops {
  const char *name;
  tw_mem mem;
  tw_status (*all_gather)(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count,
                          tw_dtype dtype);
  tw_status (*reduce_scatter)(tw_comm *c, tw_ctx *ctx, const void *send, void *recv,
                              int64_t count, tw_dtype dtype, tw_reduce_op op);
  tw_status (*all_reduce)(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count,
                          tw_dtype dtype, tw_reduce_op op);
  tw_status (*all_to_allv)(tw_comm *c, tw_ctx *ctx, const void *send, const int64_t *scounts,
                           const int64_t *sdispls, void *recv, const int64_t *rcounts,
                           const int64_t *rdispls, tw_dtype dtype);
  tw_status (*ppermute)(tw_comm *c, tw_ctx *ctx, const void *send, void *recv, int64_t count,
                        tw_dtype dtype, const int *perm);
  tw_status (*barrier)(tw_comm *c, tw_ctx *ctx);
  tw_status (*wait)(tw_comm *c, tw_ctx *ctx);
  tw_status (*split)(tw_comm *c, int color, int key, tw_comm **out);
  tw_status (*abort)(tw_comm *c);
  tw_status (*destroy)(tw_comm *c); /* frees impl, not the tw_comm */
  /* optional (NULL: tw_ppermute_n calls ppermute n times); arguments already checked */
  tw_status (*ppermute_n)(tw_comm *c, tw_ctx *ctx, int n, const void *const *send, void *const *recv,
                          int64_t count, tw_dtype dtype, const int *const *perm);
} tw_comm_ops;

struct tw_comm {
  const tw_comm_ops *ops;
  int rank, size;
  double timeout_s;
  void *impl;
};

/* Allocates a handle around ops/impl (freed by tw_comm_destroy after ops->destroy). */
tw_status tw_comm_wrap(const tw_comm_ops *ops, int rank, int size, void *impl, tw_comm **out);

#ifdef __cplusplus
}
#endif
#endif /* TWIN_TW_COMM_H */
