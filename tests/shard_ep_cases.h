/* The sharded EP sweep's cases, shared by the thread-rank test (shard_ep_sweep_test, ref) and
 * the NCCL one (shard_ep_gpu_test, gpu: one process for all GPUs and one process per GPU).
 *
 * A case: a mesh over (dp, fsdp, ep, tp), a token spec [(outer..., ep), None] that the EP rules
 * accept (shard/ep_rules.c: dp and fsdp in either order, then ep; axes outside it hold
 * replicas), a routing distribution and a dtype. Each rank runs dispatch -> expert fn ->
 * combine, dispatch_bwd and combine_bwd on its EP group and checks its outputs bit for bit
 * against the unsharded formula computed from the global tensors; the caller then checks
 * token conservation over all ranks from the per-rank record `seen`. */
#ifndef TWIN_TESTS_SHARD_EP_CASES_H
#define TWIN_TESTS_SHARD_EP_CASES_H

#include <stdint.h>

#include "twin/tw_comm.h"
#include "twin/tw_shard.h"
#include "twin/tw_shard_ep.h"

#define SEP_GT 24 /* global tokens: divisible by every shard count up to 8 */
#define SEP_GE 8
#define SEP_GH 5
#define SEP_GK 2
#define SEP_ALIGN 4
#define SEP_MAXR 8

enum { SEP_UNIFORM, SEP_HOT, SEP_ONE, SEP_HALF, SEP_NONE, SEP_DISTS };

typedef struct {
  tw_mesh mesh;
  tw_ep_plan plan;
  tw_pspec spec;
  char spec_str[48];
  tw_dtype dt;
  int dist;
  int64_t T; /* global tokens of this case (0 for SEP_NONE) */
  uint16_t x16[SEP_GT * SEP_GH];
  float x[SEP_GT * SEP_GH], w[SEP_GT * SEP_GK], dout[SEP_GT * SEP_GH];
  int32_t idx[SEP_GT * SEP_GK];
  /* per rank: routes seen (token, expert) in its recv rows; the first check that failed */
  int seen[SEP_MAXR][SEP_GT][SEP_GE];
  char msg[SEP_MAXR][200];
} sep_case;

/* Meshes of n ranks over (dp, fsdp, ep, tp), sizes powers of two: writes up to 32 size tuples
 * {dp, fsdp, ep, tp}, returns how many (n = 1, 2, 4, 8: 1, 4, 10, 20). */
int sep_meshes(int n, int sizes[][4]);
/* The token specs of one mesh that differ in effect (an axis of size 1 in the spec changes
 * nothing): the full "[(dp,fsdp,ep), None]" first, then the others. Returns how many (<= 5). */
int sep_specs(const int sizes[4], const char *specs[5]);
/* Builds the global tensors and the plan (asserts the plan is accepted). */
void sep_case_make(sep_case *c, const int sizes[4], const char *spec, int dist, tw_dtype dt, uint64_t seed);
/* One rank's run of case c on ctx (ref: host tensors, gpu: device copies), its EP group the ep
 * communicator of mc (a one-rank split of world where ep = 1). Returns the ops' status; a
 * mismatch with the formula is no error (a failing rank must not abort its peers' collectives):
 * it is written to c->msg[rank]. */
tw_status sep_rank_case(tw_ctx *ctx, tw_comm *world, tw_mesh_comms *mc, sep_case *c, int rank);
/* Token conservation over the ranks' records: each route arrives once per replica group and
 * nowhere else. 1 if it holds, else 0 with the first difference in msg. */
int sep_conserved(const sep_case *c, char *msg, size_t cap);
/* "dp=2,ep=2 [(dp,ep), None] hot bf16" */
const char *sep_case_str(const sep_case *c, char *buf, size_t cap);

#endif
