// gpu/ep.cu — expert-parallel dispatch / combine of tw_ep.h on the GPU, bit for bit equal to
// ref/ep.c (the same slots, the same f32 sums in the same order).
//
// Build: //gpu:routing (nvcc -fmad=false: combine's w * y + acc stays two roundings, as in the
// oracle).
//
// Version ep_nccl_slots (the baseline on NCCL's host API; the only version so far):
//   * counts stay on the device: the routes are counted per chunk of 1024 (one block per
//     chunk), the per-expert counts of this rank are all-gathered (tw_all_gather on the
//     communicator, in place), and one block derives every rank's slab layout from them with
//     segmented prefix sums (kept, offsets, group_sizes, dropped; capacity checked for every
//     rank alike, as the oracle does);
//   * the payload travels in fixed worst-case per-peer slots: S = max_tokens * min(k, NLE)
//     rows of rb bytes per peer (distinct ids per token: a token sends at most min(k, NLE) rows
//     to one rank), exchanged by one grouped ncclSend/ncclRecv (the communicator's all_to_allv
//     with equal host-known counts), so no count ever goes to the host;
//   * local kernels pack a route's row into its slot (send order: by expert, then t, then j;
//     the rank within an expert = the chunk's prefix + the route's rank in its chunk, computed
//     by the chunk's warps in turn with __match_any_sync) and unpack the received rows into the expert-major
//     layout (every destination row written once: routed rows, then zero padding / tail).
//   No device-to-host copy, no host synchronization, no allocation per step: dispatch, combine
//   and both backward ops can be captured in a CUDA graph. With ep_size 1 the exchange is
//   NCCL's send/recv to self and the whole step is a local permutation.
//   Rows on the wire: dispatch carries token bytes, scale bytes and the f32 weight; the way
//   back carries rows in the caller's dtype (f32 or bf16) plus one f32 per slot, widened to
//   f32 only where the oracle sums them, so every sum sees the oracle's values.
//   cfg.scales_gemm_layout (fp8 1x128): the scale row still travels with its token row; only
//   the kernels that write final rows (unpack, direct, LSA push / expand) store its f32s at
//   [b][i] of recv_scales [H/128, roundup(R, 4)] (put_scale_row), and the warp of row 0 zeroes
//   the tail columns R .. roundup(R, 4)-1: the grouped GEMM's operand, no transpose.
//   With MXFP8 (scale_block 32) the same kernels write the scale rows into mx_rows [R, H/32];
//   ep_mx_prefix / ep_mx_scales then lay them out per slab (T(l) from group_sizes on the device).
//
// Device-side checks (the ids live on the device): an id outside [0, E) or listed twice in a
// token sets the error word (GPU_ERR_EXPERT_ID / GPU_ERR_EXPERT_TWICE, token, slot and id) and
// that route is left out (counted nowhere, sent nowhere, combined as dropped); a capacity
// overflow under the error policy sets GPU_ERR_EP_CAPACITY (rank, demand, R) on every rank
// and the step writes none of its outputs (later combine / backward give zeros). No index is
// ever formed from an unchecked id, and the exchange always moves the same host-known bytes (S rows
// of the step's stride per peer; every rank must pass the same dtypes, else the counts disagree
// and the communicator's timeout aborts the step), so a bad step cannot hang the peers.
//
// Version ep_nccl_lsa (NCCL >= 2.28's symmetric windows; auto's pick for ep_size >= 2 on NCCL
// since its 2-GPU sweep passed on 2 H200s, 2026-11-27): one window per EP context, registered once
// (ncclMemAlloc + ncclCommWindowRegister), the peers' windows mapped through ncclGetLsaPointer
// and checked by a handshake word at creation. dispatch: counts stored into every window and a
// barrier (flags in the window, release/acquire at system scope, epochs counted on the device, a
// timeout (20 s, TWIN_EP_LSA_TIMEOUT_S) that sets GPU_ERR_EP_TIMEOUT instead of hanging, once per
// context, and GPU_ERR_EP_DESYNC for a peer two barriers ahead); the same layout and route
// tables as slots; each token stored once per destination rank into that rank's slab with
// 16-byte stores (only rows that travel: no padding on the wire), its routes' row-map entries
// beside it, this rank's own routes written straight into their final rows; a barrier; then
// every other row expanded from the slab into the expert-major layout. combine and
// dispatch_bwd: an entry barrier, each route's row (and dispatch_bwd's per-slot f32) stored
// into its token's rank's way-back slab, a barrier, the oracle's j-order sums (from 64 MiB of
// way-back rows in chunks of the tokens: a chunk's sums under the next chunk's stores,
// lsa_back). combine_bwd: an
// entry barrier, d_out once per (token, rank) with its routes' weights in the row map, a
// barrier, w * d_out and the d_topk_weights dots on the expert side in one pass, a warp per
// row (the dots in tw_ep.h's warp order, stored into the tokens' ranks), a barrier. With LSA
// no slots staging is allocated. No host sync, no allocation per step: capturable. Not used: ncclDevCommCreate and NCCL's LSA barrier: the headers here are
// 2.28.9 and the GPU machines run 2.28.3, and ncclDevComm's layout changed in between (GIN
// fields, 2.28.7), with no device ABI promise before 2.29; the window's LSA pointer fields are
// read by ncclGetLsaPointer and verified by the handshake. Where the runtime lacks the device
// API, the group is not one LSA team, or NCCL gives no window (a 1-rank communicator on NCCL
// 2.28.3), ep_create falls back to slots (auto) or refuses the forced name, saying why.
#include <dlfcn.h>
#include <pthread.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#if NCCL_VERSION_CODE >= 22800
#include <nccl_device.h>
#define EP_HAVE_LSA 1
#else
#define EP_HAVE_LSA 0
#endif
// Whether auto picks ep_nccl_lsa where it can run (1) or only a forced name runs it (0).
#define EP_LSA_AUTO 1

#include "core/backend_moe.h"
#include "gpu/comm_nccl.h"
#include "gpu/gpu.h"
#include "gpu/lsa_window.h"
#include "gpu/moe.h"
#include "gpu/numerics.cuh"
#include "twin/tw_comm.h"

namespace {

#define EP_CHUNK 1024  // routes per counting chunk (one block of EP_CHUNK threads; route_key packs e * EP_CHUNK + rank)
#define EP_BACK_MAXC 8  // the way back's chunks at most (lsa_back)
#define EP_SUM_MAXK 64  // top-k up to this: a token's rows and weights cached in shared memory

// ep_nccl_lsa's view of the symmetric window, passed by value into its kernels.
struct lsa_dev {
  unsigned char *const *peer;  // [n] device array: rank r's window as mapped on this GPU (LSA)
  unsigned long long *epoch;   // device: barriers this rank has passed (graph replays go on counting)
  unsigned long long *dead;    // device, sticky: a barrier of this rank timed out; later ones do not wait
  unsigned long long timeout_ns;  // a barrier's wait (TWIN_EP_LSA_TIMEOUT_S, default 20 s)
  int n, me;
  int64_t maxT;
  size_t off_flags, off_counts, off_rowmap, off_slab, off_comb, off_dw, off_tag;  // regions of every window
  size_t srb, crb;  // slab row bytes (token + scales); way-back row bytes (4 H + 4: an f32 or bf16 row and a per-slot f32)
};

struct lsa_impl {
  gpu_lsa_window *w;  // the window (gpu/lsa_window.h): opened, mapped and checked there
  lsa_dev d;
};

struct ep_impl {
  unsigned char *send, *recv;  // [n * S * rb] each
  int64_t S;                   // rows per peer slot
  size_t rb;                   // bytes per staged row (multiple of 16)
  lsa_impl *lsa;               // ep_nccl_lsa active (dispatch and combine); NULL: ep_nccl_slots
  // MXFP8 with scales_gemm_layout: the received scale rows [R, H/32] (written by the row
  // kernels as in the row layout), and [2 * (NLE + 1)] i64 tile / row prefixes over the slabs
  unsigned char *mx_rows;       // [max(R, U), H/32] (rows by source use it too)
  int64_t *mx_tab;
  int64_t *mx_src_tab;          // rows by source: ep_mx_scales' table for one group of U rows, then gs = {U}
  char why[256];               // why ep_nccl_lsa is not active (auto or forced slots)
};

struct layer_impl {
  void *base;
  int32_t *chunk_counts, *chunk_base;  // [nchunks_max * E]
  int32_t *route_key;                  // [max_tokens * k] e * EP_CHUNK + rank in its chunk, -1: invalid
  int32_t *counts_all;                 // [n * E]
  int64_t *kept, *offs;                // [n * NLE], [n * (NLE + 1)]
  int64_t *mykept, *sendbase;          // [E]
  int64_t *before, *recv_pref;         // [n * NLE]
  int64_t *route_pos;                  // [max_tokens * k] staging row of a route, -1: none
  int64_t *recv_src;                   // [R] staging row of a destination slot, -1: none
  int32_t *flag;                       // 1: the last dispatch failed (capacity, error policy)
  int64_t nchunks_max;
  // ep_nccl_lsa: [E] destination row base of this rank's routes to expert e (on e's rank),
  // [max_tokens * k] the destination row of each route (-1: none), [R] the route (s, t, j) as
  // (s * max_tokens + t) * k + j that filled destination row i (-1: padding); NULL under slots
  int64_t *dstbase, *route_dst, *recv_route;
  // one rank only (the direct path: no staging copies): [S] each, the route and the
  // destination row of a staging slot; NULL for ep_size > 1
  int64_t *slot_route, *slot_row;
  // ep_nccl_lsa: the way back's chunk lists [EP_BACK_MAXC][R] and counts (lsa_back_bucket)
  int32_t *back_list, *back_n;
};

// ---- row copies ---------------------------------------------------------------------------

// One warp copies `bytes` bytes (16-byte vectors where both sides allow it).
__device__ static void warp_copy(void *dst, const void *src, size_t bytes) {
  const int lane = threadIdx.x & 31;
  uintptr_t a = (uintptr_t)dst | (uintptr_t)src;
  if ((a & 15) == 0 && (bytes & 15) == 0) {
    for (size_t i = lane; i < bytes / 16; i += 32) ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
  } else if ((a & 3) == 0 && (bytes & 3) == 0) {
    for (size_t i = lane; i < bytes / 4; i += 32) ((uint32_t *)dst)[i] = ((const uint32_t *)src)[i];
  } else {
    for (size_t i = lane; i < bytes; i += 32) ((unsigned char *)dst)[i] = ((const unsigned char *)src)[i];
  }
}

// One warp copies `bytes` with 16-byte vectors, four in flight per lane (remote stores over
// NVLink want many outstanding, and so do local token rows: one 16-byte load per lane in flight
// left a 128-token dispatch's row copies latency-bound); unaligned rows take warp_copy.
__device__ static void warp_copy_wide(void *dst, const void *src, size_t bytes) {
  if ((((uintptr_t)dst | (uintptr_t)src) & 15) || (bytes & 15)) {
    warp_copy(dst, src, bytes);
    return;
  }
  const uint4 *s = (const uint4 *)src;
  uint4 *o = (uint4 *)dst;
  const size_t nv = bytes / 16;
  size_t i = threadIdx.x & 31;
  for (; i + 96 < nv; i += 128) {
    uint4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
    o[i] = a;
    o[i + 32] = b;
    o[i + 64] = c;
    o[i + 96] = e;
  }
  for (; i < nv; i += 32) o[i] = s[i];
}

__device__ static void warp_zero(void *dst, size_t bytes) {
  const int lane = threadIdx.x & 31;
  if (((uintptr_t)dst & 15) == 0 && (bytes & 15) == 0) {
    for (size_t i = lane; i < bytes / 16; i += 32) ((uint4 *)dst)[i] = make_uint4(0, 0, 0, 0);
  } else if (((uintptr_t)dst & 3) == 0 && (bytes & 3) == 0) {
    for (size_t i = lane; i < bytes / 4; i += 32) ((uint32_t *)dst)[i] = 0;
  } else {
    for (size_t i = lane; i < bytes; i += 32) ((unsigned char *)dst)[i] = 0;
  }
}

// Destination row i's scale row (sb bytes, from src) into recv_scales: row-major when sld == 0,
// else the grouped GEMM's rowwise 1x128 layout (tw_ep.h scales_gemm_layout): f32 b of the row
// at [b][i] of [sb / 4, sld], sld = roundup(R, 4). Scale rows are 4-byte aligned everywhere
// (f32 token_scales; staging and slab rows after H fp8 bytes, H % 128 == 0).
__device__ static void put_scale_row(unsigned char *rscl, size_t sb, int64_t sld, int64_t i, const unsigned char *src) {
  if (!sld) {
    warp_copy(rscl + (size_t)i * sb, src, sb);
    return;
  }
  for (size_t b = threadIdx.x & 31; b < sb / 4; b += 32)
    ((uint32_t *)rscl)[(size_t)b * (size_t)sld + (size_t)i] = ((const uint32_t *)src)[b];
}
__device__ static void zero_scale_row(unsigned char *rscl, size_t sb, int64_t sld, int64_t i) {
  if (!sld) {
    warp_zero(rscl + (size_t)i * sb, sb);
    return;
  }
  for (size_t b = threadIdx.x & 31; b < sb / 4; b += 32) ((uint32_t *)rscl)[(size_t)b * (size_t)sld + (size_t)i] = 0;
}
// The GEMM layout's tail columns R .. sld-1 (at most 3): zeroed by the warp of row 0 of a step
// that writes its outputs (R may be smaller than the tail: R = 1 has 3 tail columns).
__device__ static void zero_scale_tail(unsigned char *rscl, size_t sb, int64_t sld, int64_t R, int64_t i) {
  if (sb && sld && i == 0)
    for (int64_t j = R; j < sld; j++) zero_scale_row(rscl, sb, sld, j);
}

__device__ static float load_f32(const void *p, int bf16, int64_t i) {
  return bf16 ? tw_bf16_to_f32_d(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
__device__ static void store_f32(void *p, int bf16, int64_t i, float v) {
  if (bf16) ((uint16_t *)p)[i] = tw_f32_to_bf16_d(v);
  else ((float *)p)[i] = v;
}
// Eight consecutive bf16 at element i (a multiple of 8, the buffer 16-byte aligned) as f32, and
// back: the vector forms of load_f32 / store_f32 for bf16 rows (same conversions).
__device__ static void load8_bf16(const void *p, int64_t i, float v[8]) {
  uint4 u = *(const uint4 *)((const uint16_t *)p + i);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    v[2 * e] = tw_bf16_to_f32_d((uint16_t)(w[e] & 0xFFFFu));
    v[2 * e + 1] = tw_bf16_to_f32_d((uint16_t)(w[e] >> 16));
  }
}
__device__ static void store8(void *p, int bf16, int64_t i, const float v[8]) {
  if (!bf16) {
    for (int e = 0; e < 8; e++) ((float *)p)[i + e] = v[e];
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; e++)
    w[e] = (uint32_t)tw_f32_to_bf16_d(v[2 * e]) | ((uint32_t)tw_f32_to_bf16_d(v[2 * e + 1]) << 16);
  *(uint4 *)((uint16_t *)p + i) = make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- routing tables -----------------------------------------------------------------------
//
// Four kernels build them without serial loops over experts or routes (a 128-token step spent
// 0.21 ms in single-block / single-warp loops: ep_layout 137 us, ep_route_pos 45 us,
// ep_chunk_count 30 us on an H200):
//   ep_chunk_count  a block per chunk of EP_CHUNK routes: counts and each route's rank in its chunk
//   ep_chunk_scan   a thread per expert: prefix over chunks (not launched for one chunk)
//   ep_layout       one block, segmented prefix sums over experts (the oracle's serial loops);
//                   with one chunk it also places the routes (ep_route_pos' work)
//   ep_route_pos    a thread per route: its staging row, from its rank and the layout
// So a step of <= EP_CHUNK routes is two launches before the rows move. All sums are of exact
// integers in the oracle's order of items, so every table is the one the serial loops give.

// The expert of route q, or -1 when it is invalid (reported by the counting kernel only).
__device__ static int route_expert(const int32_t *idx, int64_t q, int k, int E, long long *err, int report) {
  int32_t e = idx[q];
  int64_t t = q / k, j = q % k;
  if (e < 0 || e >= E) {
    if (report) gpu_report(err, GPU_ERR_EXPERT_ID, GPU_OP_EP_DISPATCH, t, gpu_pack_id_slot(e, j));
    return -1;
  }
  for (int64_t i = 0; i < j; i++)
    if (idx[t * k + i] == e) {
      if (report) gpu_report(err, GPU_ERR_EXPERT_TWICE, GPU_OP_EP_DISPATCH, t, gpu_pack_id_slot(e, j));
      return -1;
    }
  return e;
}

// One block of EP_CHUNK threads per chunk of EP_CHUNK routes, one route per thread: the chunk's
// per-expert counts (chunk_counts, and count_mine too when the step has this one chunk), and each
// route's key: e * EP_CHUNK + its rank among the chunk's earlier routes to e in (t, j) order, or -1
// when invalid (e < 2^21: E counters must fit in shared memory). Every thread loads and checks
// its id at once; then the 32 warps take turns over the shared counters (a warp's lanes split by
// expert with __match_any_sync), so the serial part is 32 shared-memory steps, not 32 steps of
// global loads by one warp. Of the chunk's invalid routes the first in order is reported (the
// error word keeps the first report it gets).
__global__ void __launch_bounds__(EP_CHUNK) ep_chunk_count(const int32_t *__restrict__ idx, int64_t routes, int k,
                                                           int E, int32_t *__restrict__ chunk_counts,
                                                           int32_t *__restrict__ count_mine,
                                                           int32_t *__restrict__ route_key, long long *err) {
  extern __shared__ int32_t cnt[];
  __shared__ unsigned long long first_bad;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  if (threadIdx.x == 0) first_bad = ~0ull;
  const int64_t q = (int64_t)blockIdx.x * EP_CHUNK + threadIdx.x;
  const int e = q < routes ? route_expert(idx, q, k, E, err, 0) : -1;
  __syncthreads();
  if (q < routes && e < 0) atomicMin(&first_bad, (unsigned long long)q);
  const unsigned same = __match_any_sync(0xffffffffu, e);
  const unsigned lower = same & ((1u << lane) - 1u);
  int32_t rank = 0;
  for (int w = 0; w < EP_CHUNK / 32; w++) {  // warps in route order
    if (warp == w) {
      const int32_t base = e >= 0 ? cnt[e] : 0;
      __syncwarp();
      if (e >= 0 && lower == 0) cnt[e] = base + __popc(same);  // the group's lowest lane advances it
      rank = base + __popc(lower);
    }
    __syncthreads();
  }
  if (q < routes) route_key[q] = e >= 0 ? e * EP_CHUNK + rank : -1;
  if (q < routes && (unsigned long long)q == first_bad) route_expert(idx, q, k, E, err, 1);
  for (int e2 = threadIdx.x; e2 < E; e2 += blockDim.x) {
    chunk_counts[(int64_t)blockIdx.x * E + e2] = cnt[e2];
    if (count_mine) count_mine[e2] = cnt[e2];
  }
}

// Per expert: exclusive prefix over chunks (chunk_base) and this rank's count.
__global__ void ep_chunk_scan(const int32_t *__restrict__ chunk_counts, int64_t nchunks, int E,
                              int32_t *__restrict__ chunk_base, int32_t *__restrict__ count_mine) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    int32_t run = 0;
    for (int64_t c = 0; c < nchunks; c++) {
      chunk_base[c * E + e] = run;
      run += chunk_counts[c * E + e];
    }
    count_mine[e] = run;
  }
}

struct layout_args {
  int n, me, nle, E, policy;
  int64_t A, R;
  int64_t routes;  // > 0: the step's routes fit one chunk and ep_layout also places them (no ep_route_pos launch)
  int64_t S;       // staging rows per peer (route positions)
  int staged;      // counts_all and kept in shared memory (layout_smem bytes)
};

__device__ static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// Route q's staging row (after the layout): rank = its chunk's base for its expert (chunked;
// one chunk: 0) + its rank in the chunk (route_key); r*S + sendbase[e] + rank when rank <
// mykept[e], else -1 (dropped, invalid or a failed step). Also slot_route and route_dst.
__device__ static void place_route(int64_t q, int E, int nle, int64_t S, int chunked, int failed, const layer_impl &L) {
  const int32_t key = L.route_key[q];
  int64_t pos = -1, rank = 0;
  int e = -1;
  if (key >= 0 && !failed) {
    e = key / EP_CHUNK;
    rank = key % EP_CHUNK;
    if (chunked) rank += L.chunk_base[(q / EP_CHUNK) * E + e];
    if (rank < L.mykept[e]) pos = (int64_t)(e / nle) * S + L.sendbase[e] + rank;
  }
  L.route_pos[q] = pos;
  if (pos >= 0 && L.slot_route) L.slot_route[pos] = q;
  if (L.route_dst) L.route_dst[q] = pos >= 0 ? L.dstbase[e] + rank : -1;
}

#define EP_LAYOUT_THREADS 512

// Shared bytes ep_layout stages counts_all [n * E] i32 and kept [E] i64 in (0: it reads them
// from global memory; every item reads up to n counts several times).
static size_t layout_smem(int n, int E) {
  size_t b = (size_t)E * 8 + (size_t)n * (size_t)E * 4;
  return b <= (32u << 10) ? b : 0;
}

// Segmented exclusive prefix sums of two int64 columns by one block over items 0 .. N-1, a
// segment starting at every item i with i % seg == 0 (the oracle's `for r { base = 0; for l {
// ..; base += v } }`). Thread t owns items [t * ipt, (t + 1) * ipt), so each prefix is the sum
// of exact int64s in item order. val(i) is called twice per item (the thread's totals, then the
// walk); out(i, prefix, val(i)). Every thread of the block calls it; it ends with
// __syncthreads (outputs visible to the block).
template <class Val, class Out>
__device__ static void block_seg_scan(int64_t N, int64_t seg, Val val, Out out, longlong2 *sh_sum, int *sh_flag) {
  const int64_t ipt = (N + blockDim.x - 1) / blockDim.x;
  const int64_t i0 = (int64_t)threadIdx.x * ipt, i1 = i0 + ipt < N ? i0 + ipt : N;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (int)((blockDim.x + 31) >> 5);
  int f = 0;  // (a segment starts in my items, sums since the last start or of all my items)
  longlong2 s = make_longlong2(0, 0);
  for (int64_t i = i0; i < i1; i++) {
    if (i % seg == 0) f = 1, s = make_longlong2(0, 0);
    const longlong2 v = val(i);
    s.x += v.x, s.y += v.y;
  }
  // inclusive scan of (f, s) pairs: (f1, s1) then (f2, s2) = (f1 | f2, f2 ? s2 : s1 + s2)
  for (int d = 1; d < 32; d <<= 1) {
    const int fo = __shfl_up_sync(0xffffffffu, f, d);
    const long long ox = __shfl_up_sync(0xffffffffu, s.x, d), oy = __shfl_up_sync(0xffffffffu, s.y, d);
    if (lane >= d) {
      if (!f) s.x += ox, s.y += oy;
      f |= fo;
    }
  }
  int fl = __shfl_up_sync(0xffffffffu, f, 1);  // exclusive within the warp
  longlong2 sl = make_longlong2(__shfl_up_sync(0xffffffffu, s.x, 1), __shfl_up_sync(0xffffffffu, s.y, 1));
  if (lane == 0) fl = 0, sl = make_longlong2(0, 0);
  if (lane == 31) sh_flag[warp] = f, sh_sum[warp] = s;
  __syncthreads();
  if (warp == 0) {  // the warps' totals, scanned the same way
    int wf = lane < nw ? sh_flag[lane] : 0;
    longlong2 ws = lane < nw ? sh_sum[lane] : make_longlong2(0, 0);
    for (int d = 1; d < 32; d <<= 1) {
      const int fo = __shfl_up_sync(0xffffffffu, wf, d);
      const long long ox = __shfl_up_sync(0xffffffffu, ws.x, d), oy = __shfl_up_sync(0xffffffffu, ws.y, d);
      if (lane >= d) {
        if (!wf) ws.x += ox, ws.y += oy;
        wf |= fo;
      }
    }
    if (lane < nw) sh_flag[lane] = wf, sh_sum[lane] = ws;
  }
  __syncthreads();
  longlong2 run = warp > 0 ? sh_sum[warp - 1] : make_longlong2(0, 0);  // sums since the last start before my items
  if (fl) run = sl;
  else run.x += sl.x, run.y += sl.y;
  for (int64_t i = i0; i < i1; i++) {
    if (i % seg == 0) run = make_longlong2(0, 0);
    const longlong2 v = val(i);
    out(i, run, v);
    run.x += v.x, run.y += v.y;
  }
  __syncthreads();  // sh_* free again, outputs visible
}

// One block: every rank's slabs from the gathered counts (ref slab_layout), this rank's send
// bases and receive prefixes (ref route_tables), group_sizes and dropped, as segmented prefix
// sums over the experts; with one chunk of routes (a.routes > 0) also every route's staging row
// (ep_route_pos' work: one launch fewer at small T). Rank r's slab offsets are o_l = min(P_l, R)
// with P_l the unclamped prefix of roundup(count, A): the oracle's o += roundup(min(c, R - o), A)
// stays equal to P_l while the slabs fit and sticks at R from the first that does not (R - o is
// a multiple of A, so the cut slab's padding fills R exactly); kept_l = max(0, min(c_l, R - P_l)).
__global__ void __launch_bounds__(EP_LAYOUT_THREADS)
    ep_layout(layout_args a, const int32_t *__restrict__ counts_all, layer_impl L, int32_t *__restrict__ group_sizes,
              int32_t *__restrict__ dropped, long long *err) {
  const int n = a.n, nle = a.nle, E = a.E, me = a.me;
  const int64_t A = a.A, R = a.R;
  extern __shared__ int64_t lsm[];  // a.staged: kept [E] i64, then counts [n * E] i32
  __shared__ longlong2 sh_sum[32];
  __shared__ int sh_flag[32];
  __shared__ int first_fail;
  const int32_t *cnt = counts_all;
  int64_t *kept_rd = L.kept;  // kept as read back (a copy in shared memory when staged)
  if (a.staged) {
    int32_t *c = (int32_t *)(lsm + E);
    for (int64_t i = threadIdx.x; i < (int64_t)n * E; i += blockDim.x) c[i] = counts_all[i];
    cnt = c;
    kept_rd = lsm;
  }
  if (threadIdx.x == 0) first_fail = 0x7fffffff;
  __syncthreads();
  // count of expert i (= r * nle + l) from the source ranks before `upto`
  auto from = [&](int64_t i, int upto) {
    int64_t c = 0;
    for (int s = 0; s < upto; s++) c += cnt[(int64_t)s * E + i];
    return c;
  };
  // every rank's slabs (the capacity check needs every rank's demand, as the oracle does)
  block_seg_scan(
      E, nle, [&](int64_t i) { return make_longlong2(round_up(from(i, n), A), 0); },
      [&](int64_t i, longlong2 P2, longlong2 u2) {
        const int r = (int)(i / nle), l = (int)(i % nle);
        const int64_t c = from(i, n), P = P2.x, u = u2.x;
        int64_t kept = c < R - P ? c : R - P;
        kept = kept < 0 ? 0 : kept;
        L.kept[i] = kept;
        if (a.staged) lsm[i] = kept;
        L.offs[(int64_t)r * (nle + 1) + l] = P < R ? P : R;
        if (l == nle - 1) {  // demand = P_nle
          L.offs[(int64_t)r * (nle + 1) + nle] = P + u < R ? P + u : R;
          if (P + u > R && a.policy == TW_EP_OVERFLOW_ERROR) atomicMin(&first_fail, r);
        }
      },
      sh_sum, sh_flag);
  if (first_fail != 0x7fffffff) {  // the first rank in order, as the oracle; no output is written
    if (threadIdx.x == 0) {
      const int r = first_fail;
      int64_t demand = 0;
      for (int l = 0; l < nle; l++) demand += round_up(from((int64_t)r * nle + l, n), A);
      gpu_report(err, GPU_ERR_EP_CAPACITY, GPU_OP_EP_DISPATCH, r, gpu_pack_rows(demand, R));
      *L.flag = 1;
    }
    for (int64_t q = threadIdx.x; q < a.routes; q += blockDim.x) place_route(q, E, nle, a.S, 0, 1, L);  // all -1
    return;
  }
  if (threadIdx.x == 0) *L.flag = 0;
  // two columns over the same items, segments of nle:
  //   x: this rank's routes to rank r = e / nle, expert e: mykept, sendbase (prefix within r), dstbase
  //   y: rows this rank receives from rank s = i / nle for its local expert l = i % nle: before, recv_pref
  auto mykept = [&](int64_t e) {
    const int64_t before = from(e, me), mine = cnt[(int64_t)me * E + e], mk = kept_rd[e] - before;
    return mk < 0 ? 0 : mk > mine ? mine : mk;
  };
  auto from_s = [&](int64_t i) {
    const int s = (int)(i / nle);
    const int64_t ee = (int64_t)me * nle + i % nle, before = from(ee, s), cs = cnt[(int64_t)s * E + ee];
    const int64_t f = kept_rd[ee] - before;
    return f < 0 ? 0 : f > cs ? cs : f;
  };
  block_seg_scan(
      E, nle, [&](int64_t i) { return make_longlong2(mykept(i), from_s(i)); },
      [&](int64_t i, longlong2 pre, longlong2 v) {
        L.mykept[i] = v.x;
        L.sendbase[i] = pre.x;
        if (L.dstbase) L.dstbase[i] = L.offs[(i / nle) * (nle + 1) + i % nle] + from(i, me);
        L.before[i] = from((int64_t)me * nle + i % nle, (int)(i / nle));
        L.recv_pref[i] = pre.y;
      },
      sh_sum, sh_flag);
  for (int l = threadIdx.x; l < nle; l += blockDim.x) {
    const int64_t c = from((int64_t)me * nle + l, n), kept = kept_rd[(int64_t)me * nle + l];
    group_sizes[l] = (int32_t)round_up(kept, A);
    if (dropped) dropped[l] = (int32_t)(c - kept);
  }
  for (int64_t q = threadIdx.x; q < a.routes; q += blockDim.x) place_route(q, E, nle, a.S, 0, 0, L);
}

// One thread per route, after ep_layout (steps of several chunks): place_route.
__global__ void ep_route_pos(int64_t routes, int E, int nle, int64_t S, int chunked, layer_impl L) {
  const int failed = *L.flag;
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < routes; q += (int64_t)gridDim.x * blockDim.x)
    place_route(q, E, nle, S, chunked, failed, L);
}

// Rows by source on ep_nccl_slots: the word after a dispatch row's weight, t | (first << 31),
// first = no j' < j of the same token has a kept route to the same rank (route_pos / S is the
// destination rank), so each source row is copied once on the receiver.
__device__ static uint32_t src_word(const int64_t *__restrict__ route_pos, int64_t q, int k, int64_t S) {
  const int64_t t = q / k, r = route_pos[q] / S;
  uint32_t first = 1;
  for (int64_t q2 = t * k; q2 < q; q2++) {
    const int64_t p2 = route_pos[q2];
    if (p2 >= 0 && p2 / S == r) first = 0;
  }
  return (uint32_t)t | (first << 31);
}

// One warp per route: token row, scale row, weight and the source word (src_word) into the
// route's staging row.
__global__ void ep_pack_dispatch(const unsigned char *__restrict__ tokens, const unsigned char *__restrict__ scales,
                                 const float *__restrict__ w, int64_t routes, int k, size_t tb, size_t sb,
                                 const int64_t *__restrict__ route_pos, int64_t S, unsigned char *__restrict__ send,
                                 size_t rb) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int64_t q = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; q < routes; q += warps) {
    int64_t p = route_pos[q];
    if (p < 0) continue;
    int64_t t = q / k;
    unsigned char *row = send + (size_t)p * rb;
    warp_copy_wide(row, tokens + (size_t)t * tb, tb);
    if (sb) warp_copy(row + tb, scales + (size_t)t * sb, sb);
    if ((threadIdx.x & 31) == 0) {
      memcpy(row + tb + sb, w + q, 4);
      const uint32_t tw = src_word(route_pos, q, k, S);
      memcpy(row + tb + sb + 4, &tw, 4);
    }
  }
}

// Which staging row (source s's slot) fills destination row i, or -1 (padding, tail, failed).
__device__ static int64_t source_row(int64_t i, const layer_impl &L, int n, int me, int nle, int64_t S) {
  const int64_t *offs = L.offs + (int64_t)me * (nle + 1);
  if (i >= offs[nle]) return -1;
  int lo = 0, hi = nle - 1;  // the last l with offs[l] <= i
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (offs[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  int l = lo;
  int64_t ii = i - offs[l];
  if (ii >= L.kept[(int64_t)me * nle + l]) return -1;
  int s = 0;  // the last s with before[s][l] <= ii
  for (int s2 = 1; s2 < n; s2++)
    if (L.before[(int64_t)s2 * nle + l] <= ii) s = s2;
  return (int64_t)s * S + L.recv_pref[(int64_t)s * nle + l] + (ii - L.before[(int64_t)s * nle + l]);
}

// One warp per destination row: routed rows from the staging, zeros elsewhere (ref: every
// row written). Also records recv_src for combine and the backward.
__global__ void ep_unpack_dispatch(const unsigned char *__restrict__ recv, size_t rb, int64_t R, int n, int me,
                                   int nle, int64_t S, layer_impl L, unsigned char *__restrict__ rtok, size_t tb,
                                   unsigned char *__restrict__ rscl, size_t sb, int64_t sld, float *__restrict__ rw) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int failed = *L.flag;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    if (failed) {  // nothing is written; later steps see no routes
      if ((threadIdx.x & 31) == 0) L.recv_src[i] = -1;
      continue;
    }
    zero_scale_tail(rscl, sb, sld, R, i);
    int64_t p = source_row(i, L, n, me, nle, S);
    if ((threadIdx.x & 31) == 0) L.recv_src[i] = p;
    if (p >= 0) {
      const unsigned char *row = recv + (size_t)p * rb;
      warp_copy_wide(rtok + (size_t)i * tb, row, tb);
      if (sb) put_scale_row(rscl, sb, sld, i, row + tb);
      if ((threadIdx.x & 31) == 0) memcpy(rw + i, row + tb + sb, 4);
    } else {
      warp_zero(rtok + (size_t)i * tb, tb);
      if (sb) zero_scale_row(rscl, sb, sld, i);
      if ((threadIdx.x & 31) == 0) rw[i] = 0.0f;
    }
  }
}

// One rank, direct: destination row i straight from its token (the slot's route), no staging;
// the same bytes as pack + identity exchange + unpack. Records recv_src and slot_row.
__global__ void ep_dispatch_direct(const unsigned char *__restrict__ tokens, const unsigned char *__restrict__ scales,
                                   const float *__restrict__ w, int k, int64_t R, int nle, int64_t S, layer_impl L,
                                   unsigned char *__restrict__ rtok, size_t tb, unsigned char *__restrict__ rscl,
                                   size_t sb, int64_t sld, float *__restrict__ rw) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int failed = *L.flag;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    if (failed) {
      if ((threadIdx.x & 31) == 0) L.recv_src[i] = -1;
      continue;
    }
    zero_scale_tail(rscl, sb, sld, R, i);
    int64_t p = source_row(i, L, 1, 0, nle, S);
    if ((threadIdx.x & 31) == 0) L.recv_src[i] = p;
    if (p >= 0) {
      int64_t q = L.slot_route[p], t = q / k;
      if ((threadIdx.x & 31) == 0) L.slot_row[p] = i;
      warp_copy_wide(rtok + (size_t)i * tb, tokens + (size_t)t * tb, tb);
      if (sb) put_scale_row(rscl, sb, sld, i, scales + (size_t)t * sb);
      if ((threadIdx.x & 31) == 0) rw[i] = w[q];
    } else {
      warp_zero(rtok + (size_t)i * tb, tb);
      if (sb) zero_scale_row(rscl, sb, sld, i);
      if ((threadIdx.x & 31) == 0) rw[i] = 0.0f;
    }
  }
}

// Rows by source on ep_nccl_slots: zeros into src_tokens and its scale rows first (a thread per
// 16 or 4 bytes; none when the step failed, which writes no output), then ep_unpack_by_source
// copies each received source row once over them.
__device__ static void grid_zero(unsigned char *__restrict__ p, size_t bytes) {
  const size_t stride = (size_t)gridDim.x * blockDim.x, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if ((((uintptr_t)p) & 15) == 0) {
    for (size_t i = tid; i < bytes / 16; i += stride) ((uint4 *)p)[i] = make_uint4(0, 0, 0, 0);
    for (size_t i = bytes / 16 * 16 + tid; i < bytes; i += stride) p[i] = 0;
  } else {
    for (size_t i = tid; i < bytes; i += stride) p[i] = 0;
  }
}
__global__ void ep_zero_unless_failed(const int32_t *__restrict__ flag, unsigned char *__restrict__ a, size_t abytes,
                                      unsigned char *__restrict__ b, size_t bbytes) {
  if (*flag) return;
  grid_zero(a, abytes);
  if (b) grid_zero(b, bbytes);
}

// One warp per expert-major row i (after ep_zero_unless_failed): recv_src, recv_row (the
// source row s * max_tokens + t of its staging row's word), recv_weights, and the row with its
// scales into src_tokens when the word marks the token's first route to this rank. direct (one
// rank, no staging): the slot's route gives t and the token row comes from `tokens`.
__global__ void ep_unpack_by_source(const unsigned char *__restrict__ recv, size_t rb, int64_t R, int n, int me,
                                    int nle, int64_t S, int64_t maxT, int k, layer_impl L, int direct,
                                    const unsigned char *__restrict__ tokens, const unsigned char *__restrict__ scales,
                                    const float *__restrict__ w, unsigned char *__restrict__ src_tok, size_t tb,
                                    unsigned char *__restrict__ src_scl, size_t sb, int64_t sld,
                                    float *__restrict__ rw, int32_t *__restrict__ recv_row) {
  const int warps = (gridDim.x * blockDim.x) >> 5, lane = threadIdx.x & 31;
  const int failed = *L.flag;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    if (failed) {
      if (lane == 0) L.recv_src[i] = -1;
      continue;
    }
    const int64_t p = source_row(i, L, n, me, nle, S);
    if (lane == 0) L.recv_src[i] = p;
    if (p < 0) {
      if (lane == 0) {
        recv_row[i] = -1;
        rw[i] = 0.0f;
      }
      continue;
    }
    const unsigned char *row, *srow;
    uint32_t word;
    float wv;
    if (direct) {
      const int64_t q = L.slot_route[p], t = q / k;
      if (lane == 0) L.slot_row[p] = i;
      word = src_word(L.route_pos, q, k, S);
      row = tokens + (size_t)t * tb;
      srow = sb ? scales + (size_t)t * sb : NULL;
      wv = w[q];
    } else {
      row = recv + (size_t)p * rb;
      srow = row + tb;
      memcpy(&wv, row + tb + sb, 4);
      memcpy(&word, row + tb + sb + 4, 4);
    }
    const int64_t u = (int64_t)(p / S) * maxT + (int64_t)(word & 0x7fffffffu);
    if (lane == 0) {
      recv_row[i] = (int32_t)u;
      rw[i] = wv;
    }
    if (word >> 31) {
      warp_copy_wide(src_tok + (size_t)u * tb, row, tb);
      if (sb) put_scale_row(src_scl, sb, sld, u, srow);
    }
  }
}

// One rank, direct combine_bwd rows: d_expert_out[i] = w[q] * d_out[t] of the slot's route
// (in d_out's dtype, as the staging row held it), zeros for rows without a route. vec (bf16,
// H % 8 == 0, 16-byte aligned rows): eight elements per thread (0.46 -> 0.22 ms at E 32, T 4096 on an H200).
__global__ void ep_dout_direct(const void *__restrict__ d_out, int bf16, const float *__restrict__ w, int k, int64_t H,
                               int64_t R, layer_impl L, unsigned char *__restrict__ out, size_t row_bytes, int vec) {
  for (int64_t i = blockIdx.x; i < R; i += gridDim.x) {
    int64_t p = L.recv_src[i];
    unsigned char *row = out + (size_t)i * row_bytes;
    if (p < 0) {
      for (size_t b = threadIdx.x; b < row_bytes; b += blockDim.x) row[b] = 0;
      continue;
    }
    int64_t q = L.slot_route[p], t = q / k;
    float wq = w ? w[q] : 1.0f;
    if (vec) {
      for (int64_t h = 8 * (int64_t)threadIdx.x; h < H; h += 8 * (int64_t)blockDim.x) {
        float v[8];
        load8_bf16(d_out, t * H + h, v);
        for (int e = 0; e < 8; e++) v[e] = __fmul_rn(wq, v[e]);
        store8(row, 1, h, v);
      }
      continue;
    }
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
      store_f32(row, bf16, h, __fmul_rn(wq, load_f32(d_out, bf16, t * H + h)));
  }
}

// Destination rows back into the receive staging (the way back): row i (es * H bytes) and
// one f32 per slot (0 without per_slot) at byte row_bytes, in rows of the step's stride rb.
__global__ void ep_pack_back(const unsigned char *__restrict__ rows, size_t row_bytes, const float *__restrict__ per_slot,
                             int64_t R, const int64_t *__restrict__ recv_src, unsigned char *__restrict__ recv,
                             size_t rb, int64_t H) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    int64_t p = recv_src[i];
    if (p < 0) continue;
    unsigned char *row = recv + (size_t)p * rb;
    warp_copy(row, rows + (size_t)i * row_bytes, row_bytes);
    if ((threadIdx.x & 31) == 0) {
      float v = per_slot ? per_slot[i] : 0.0f;
      memcpy(row + row_bytes, &v, 4);  // the per-slot f32 right after the row
    }
  }
}

// out[t] = sum_j w[t, j] * y(route) in f32, j order (combine), or d_tokens[t] = sum_j g(route)
// (dispatch_bwd: w == NULL and unit == 0 means "no product", as the oracle adds g itself).
// One block per token; d_w (dispatch_bwd) takes the per-slot f32. vec (bf16 rows, H % 8 == 0,
// 16-byte aligned): eight elements per thread, each summed over j in the same order (one 2-byte
// load per element: 0.43 ms for the combine at E 32, T 4096 on an H200; vectorized 0.13 ms).
// direct (one rank): slot_row != NULL, rows read from `send` = the destination rows themselves
// (rb = their row bytes) and d_w from per_slot[row] (0 when per_slot is NULL).
__global__ void ep_sum_routes(const unsigned char *__restrict__ send, size_t rb, size_t slot_off, int y_bf16, int64_t T, int k,
                              int64_t H, const int64_t *__restrict__ route_pos, const float *__restrict__ w,
                              int weighted_form, void *__restrict__ out, int out_bf16, float *__restrict__ d_w,
                              const int64_t *__restrict__ slot_row, const float *__restrict__ per_slot, int vec) {
  // the token's k row addresses and weights, looked up once per token (not per element: the
  // route -> slot -> row chain was three dependent loads in front of every element's sum)
  __shared__ const unsigned char *row_of[EP_SUM_MAXK];
  __shared__ float w_of[EP_SUM_MAXK];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const bool cached = k <= EP_SUM_MAXK;
    if (cached) {
      __syncthreads();  // the previous token's readers are done
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        int64_t p = route_pos[t * k + j];
        if (p >= 0 && slot_row) p = slot_row[p];
        row_of[j] = p >= 0 ? send + (size_t)p * rb : NULL;
        w_of[j] = w ? w[t * k + j] : 1.0f;
      }
      __syncthreads();
    }
    if (vec && cached) { /* eight elements per thread, each summed over j in the same order */
      for (int64_t h = 8 * (int64_t)threadIdx.x; h < H; h += 8 * (int64_t)blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < k; j++) {
          if (!row_of[j]) continue;
          float y[8];
          load8_bf16(row_of[j], h, y);
          for (int e = 0; e < 8; e++) acc[e] = weighted_form ? __fadd_rn(acc[e], __fmul_rn(w_of[j], y[e])) : __fadd_rn(acc[e], y[e]);
        }
        store8(out, out_bf16, t * H + h, acc);
      }
    }
    for (int64_t h = threadIdx.x; h < H && !(vec && cached); h += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++) {
        const unsigned char *row;
        float wj;
        if (cached) {
          row = row_of[j];
          wj = w_of[j];
        } else {
          int64_t p = route_pos[t * k + j];
          if (p >= 0 && slot_row) p = slot_row[p];
          row = p >= 0 ? send + (size_t)p * rb : NULL;
          wj = w ? w[t * k + j] : 1.0f;
        }
        if (!row) continue;
        float y = load_f32(row, y_bf16, h);
        if (weighted_form) acc = __fadd_rn(acc, __fmul_rn(wj, y));
        else acc = __fadd_rn(acc, y);
      }
      store_f32(out, out_bf16, t * H + h, acc);
    }
    if (d_w)
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        int64_t p = route_pos[t * k + j];
        float g = 0.0f;
        if (p >= 0 && slot_row) g = per_slot ? per_slot[slot_row[p]] : 0.0f;
        else if (p >= 0) memcpy(&g, send + (size_t)p * rb + slot_off, 4);  // the per-slot f32 after the row
        d_w[t * k + j] = g;
      }
  }
}

// combine_bwd, source side: staging row of route q = w[q] * d_out[t] (f32), in d_out's dtype.
__global__ void ep_pack_dout(const void *__restrict__ d_out, int bf16, const float *__restrict__ w, int64_t routes,
                             int k, int64_t H, const int64_t *__restrict__ route_pos, unsigned char *__restrict__ send,
                             size_t rb) {
  for (int64_t q = blockIdx.x; q < routes; q += gridDim.x) {
    int64_t p = route_pos[q];
    if (p < 0) continue;
    int64_t t = q / k;
    float wq = w ? w[q] : 1.0f;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
      store_f32(send + (size_t)p * rb, bf16, h, __fmul_rn(wq, load_f32(d_out, bf16, t * H + h)));
  }
}

// combine_bwd, destination side: d_expert_out[i] = the received row, zeros elsewhere.
__global__ void ep_unpack_rows(const unsigned char *__restrict__ recv, size_t rb, int64_t R,
                               const int64_t *__restrict__ recv_src, unsigned char *__restrict__ out, size_t row_bytes) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    int64_t p = recv_src[i];
    if (p >= 0) warp_copy(out + (size_t)i * row_bytes, recv + (size_t)p * rb, row_bytes);
    else warp_zero(out + (size_t)i * row_bytes, row_bytes);
  }
}

// The bf16 halves of a 32-bit word as f32; dot8_bf16 adds the eight products of two uint4 of bf16
// into acc in element order (lo, hi of x, y, z, w), one f32 rounding per multiply and per add.
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }
__device__ __forceinline__ float dot8_bf16(float acc, uint4 a, uint4 b) {
  const uint32_t x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    acc = __fadd_rn(acc, __fmul_rn(bf16_lo(x[i]), bf16_lo(y[i])));
    acc = __fadd_rn(acc, __fmul_rn(bf16_hi(x[i]), bf16_hi(y[i])));
  }
  return acc;
}

// combine_bwd's d_topk_weights in tw_ep.h's warp order, one warp: lane l adds the f32 products
// of the h with (h / 8) % 32 == l in increasing h, then the 32 partials fold by xor shuffles
// (m = 16 .. 1: lane l < m gets P[l] + P[l + m]; fadd commutes, so every lane ends with P[0]).
// vec: both rows bf16, 16-byte aligned, H % 8 == 0 (lane l's eight elements are one vector).
__device__ static float warp_fold(float acc) {
#pragma unroll
  for (int m = 16; m; m >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, m));
  return acc;
}
__device__ static float warp_dot(const void *a, int a_bf16, const void *b, int b_bf16, int64_t H, int vec) {
  const int lane = threadIdx.x & 31;
  float acc = 0.0f;
  if (vec) {
    const uint4 *av = (const uint4 *)a, *bv = (const uint4 *)b;
    const int64_t nc = H / 8;
    int64_t c = lane;
    for (; c + 96 < nc; c += 128) {  // four vectors of each row in flight per lane
      uint4 x[4], y[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        x[u] = av[c + 32 * u];
        y[u] = bv[c + 32 * u];
      }
#pragma unroll
      for (int u = 0; u < 4; u++) acc = dot8_bf16(acc, x[u], y[u]);
    }
    for (; c < nc; c += 32) acc = dot8_bf16(acc, av[c], bv[c]);
  } else {
    for (int64_t base = 8 * (int64_t)lane; base < H; base += 256)
      for (int e = 0; e < 8 && base + e < H; e++)
        acc = __fadd_rn(acc, __fmul_rn(load_f32(a, a_bf16, base + e), load_f32(b, b_bf16, base + e)));
  }
  return warp_fold(acc);
}

// combine_bwd d_topk_weights (slots and one rank), one warp per route q: the dot of d_out[t]
// with the route's y row (staging row p of send, or with slot_row the destination row itself).
__global__ void ep_dot_routes(const unsigned char *__restrict__ send, size_t rb, int y_bf16, const void *__restrict__ d_out,
                              int d_bf16, int64_t routes, int k, int64_t H, const int64_t *__restrict__ route_pos,
                              float *__restrict__ d_w, const int64_t *__restrict__ slot_row, int vec) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const size_t ob = d_bf16 ? 2 : 4;
  for (int64_t q = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; q < routes; q += warps) {
    int64_t p = route_pos[q];
    if (p >= 0 && slot_row) p = slot_row[p];
    const float acc = p >= 0 ? warp_dot((const unsigned char *)d_out + (size_t)(q / k) * (size_t)H * ob, d_bf16,
                                        send + (size_t)p * rb, y_bf16, H, vec)
                             : 0.0f;
    if ((threadIdx.x & 31) == 0) d_w[q] = acc;
  }
}

// Whether ep_sum_routes may read bf16 rows (base + p rb) eight at a time and store out so.
static int sum_vec_ok(const void *base, size_t rb, tw_dtype row_dtype, const tw_tensor *out, int64_t H) {
  return row_dtype == TW_BF16 && H % 8 == 0 && rb % 16 == 0 && (uintptr_t)base % 16 == 0 &&
         (out->dtype != TW_BF16 || (uintptr_t)out->data % 16 == 0);
}

// Whether ep_dot_routes may read 16-byte vectors.
static int dot_vec_ok(const void *send, size_t rb, int y_bf16, const void *d_out, int d_bf16, int64_t H) {
  return y_bf16 && d_bf16 && H % 8 == 0 && rb % 16 == 0 && (uintptr_t)send % 16 == 0 && (uintptr_t)d_out % 16 == 0;
}

// ---- ep_nccl_lsa: dispatch and combine over NCCL's symmetric window ----------------------
//
// Every rank registers one window (ncclCommWindowRegister, same layout everywhere) and maps
// its peers' windows through LSA pointers (ncclGetLsaPointer: NVLink / P2P loads and stores).
// Regions of each window: barrier flags [n] u64, counts [n][E] i32 (row s written by rank s),
// row map [R] (destination row -> route and weight, written by the route's source), token slab
// [n][max_tokens] rows of srb bytes (row (s, t) written by rank s: token t's bytes and scales,
// once per destination rank however many of its experts live there), way-back slab
// [max_tokens * max(k, n)] rows of crb bytes (combine / dispatch_bwd: route q's row and per-slot
// f32, written by the expert's rank; combine_bwd: d_out of (s, t), written by rank s), d_w
// [max_tokens * k] f32 (combine_bwd's dot of route q, written by the expert's rank), source
// tags [n][max_tokens] u64 (rows by source: (s, t) is written by rank s with its barrier epoch
// when token t has a kept route here, else 0; the window starts zeroed, epochs start at 1 and only
// grow, so a tag equals this step's stamp exactly when the slab row is this step's).
// The row map also carries combine_bwd's weights (written by the token's rank).

struct lsa_rowmap {  // 16 bytes per destination row
  long long gid;     // (s * max_tokens + t) * k + j
  float w;
  int pad;
};

// One warp, after its block's writes (the caller's __syncthreads or a kernel boundary): the
// next epoch into this rank's flag in every window (release, system scope), then wait until
// every rank's flag in this window reached it (acquire). A rank that does not come within the
// timeout sets GPU_ERR_EP_TIMEOUT, the warp goes on (no hang; the step is reported invalid),
// and this rank's later barriers store their flags without waiting (d.dead), so one lost peer
// costs one timeout, not one per barrier (each later step still sets the error word, with rank
// -1: its outputs are not valid either). A peer two or more epochs ahead skipped a barrier:
// GPU_ERR_EP_DESYNC (a correct peer is at most one ahead: it waits for this rank at the next).
__device__ static void lsa_barrier_warp(const lsa_dev &d, long long *err, int op) {
  const int lane = threadIdx.x & 31;
  unsigned long long e = 0, dead = 0;
  if (lane == 0) {
    e = *d.epoch + 1;
    dead = *(volatile unsigned long long *)d.dead;
  }
  e = __shfl_sync(0xffffffffu, e, 0);
  dead = __shfl_sync(0xffffffffu, dead, 0);
  __threadfence_system();
  for (int r = lane; r < d.n; r += 32) gpu_st_release_sys((unsigned long long *)(d.peer[r] + d.off_flags) + d.me, e);
  const unsigned long long *mine = (const unsigned long long *)(d.peer[d.me] + d.off_flags);
  if (dead && lane == 0) gpu_report(err, GPU_ERR_EP_TIMEOUT, op, -1, (long long)e);  // each later step: invalid
  for (int r = lane; r < d.n && !dead; r += 32) {
    const unsigned long long t0 = gpu_global_ns();
    unsigned long long v;
    while ((v = gpu_ld_acquire_sys(mine + r)) < e)
      if (gpu_global_ns() - t0 > d.timeout_ns) {
        gpu_report(err, GPU_ERR_EP_TIMEOUT, op, r, (long long)e);
        *(volatile unsigned long long *)d.dead = 1;
        break;
      }
    if (v > e + 1) gpu_report(err, GPU_ERR_EP_DESYNC, op, r, (long long)((v << 32) | (e & 0xffffffffull)));
  }
  __syncwarp();
  if (lane == 0) *d.epoch = e;
}

__global__ void lsa_barrier(lsa_dev d, long long *err, int op) { lsa_barrier_warp(d, err, op); }

// One block: this rank's per-expert counts into row `me` of every window's counts, a barrier,
// then all n rows back into counts_all (what ep_layout reads). `mine` is counts_all's row me.
__global__ void lsa_counts(lsa_dev d, const int32_t *mine, int E, int32_t *counts_all, long long *err) {
  for (int r = 0; r < d.n; r++)
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      ((int32_t *)(d.peer[r] + d.off_counts))[(int64_t)d.me * E + e] = mine[e];
  __syncthreads();
  if (threadIdx.x < 32) lsa_barrier_warp(d, err, GPU_OP_EP_DISPATCH);
  __syncthreads();
  const volatile int32_t *all = (const volatile int32_t *)(d.peer[d.me] + d.off_counts);
  for (int64_t i = threadIdx.x; i < (int64_t)d.n * E; i += blockDim.x) counts_all[i] = all[i];
}


// Route (t, j) when it is kept on rank r (its staging row's rank): its index t * k + j, else -1.
__device__ static int64_t kept_on(const layer_impl &L, int64_t t, int k, int j, int64_t S, int r) {
  if (j >= k) return -1;
  const int64_t q = t * k + j, p = L.route_pos[q];
  return p >= 0 && p / S == r ? q : -1;
}
// The route's id in every rank's row map and way-back slab: (me * max_tokens + t) * k + j.
__device__ static long long route_gid(const lsa_dev &d, int64_t t, int k, int j) {
  return ((long long)d.me * d.maxT + t) * k + j;
}

// The row-map entries of t's routes j0 .. j0 + 31 (a lane each) that are kept on rank r: the
// route's id and weight (w[q], 1 without w) into r's window at the route's destination row.
// Returns the warp's ballot of those routes. (The dispatch push and combine_bwd's push.)
__device__ static unsigned put_route_maps(const lsa_dev &d, int64_t t, int r, int j0, int k, int64_t S,
                                          const layer_impl &L, const float *__restrict__ w) {
  const int j = j0 + (threadIdx.x & 31);
  const int64_t q = kept_on(L, t, k, j, S, r);
  if (q >= 0) {
    lsa_rowmap m;
    m.gid = route_gid(d, t, k, j);
    m.w = w ? w[q] : 1.0f;
    m.pad = 0;
    ((lsa_rowmap *)(d.peer[r] + d.off_rowmap))[L.route_dst[q]] = m;
  }
  return __ballot_sync(0xffffffffu, q >= 0);
}

// Dispatch push, one warp for (token t, rank r): the row map entry of each of t's routes kept
// on r (written into r's window at the route's destination row), then, when t has any, its
// token bytes and scales once into r's slab at (me, t). For r = me the routes' rows go straight
// into their final rows of recv_tokens (the expansion of this rank's own tokens overlaps the
// remote stores). A failed step (capacity) has no kept routes: nothing is written.
__device__ static void push_token(const lsa_dev &d, int64_t t, int r, const unsigned char *__restrict__ tokens,
                                  const unsigned char *__restrict__ scales, const float *__restrict__ w, int k,
                                  int64_t S, size_t tb, size_t sb, int64_t sld, const layer_impl &L,
                                  unsigned char *__restrict__ rtok, unsigned char *__restrict__ rscl,
                                  float *__restrict__ rw) {
  const int lane = threadIdx.x & 31;
  unsigned any = 0;
  for (int j0 = 0; j0 < k; j0 += 32) {
    unsigned hits = put_route_maps(d, t, r, j0, k, S, L, w);
    any |= hits;
    if (r == d.me && ((hits >> lane) & 1u)) {  // own routes: their weights into recv_weights
      const int64_t q = t * k + j0 + lane;
      rw[L.route_dst[q]] = w[q];
    }
    if (r == d.me)
      while (hits) {  // own routes: the token into each final row, the warp together
        const int b = __ffs(hits) - 1;
        hits &= hits - 1;
        const int64_t dst = L.route_dst[t * k + j0 + b];
        warp_copy_wide(rtok + (size_t)dst * tb, tokens + (size_t)t * tb, tb);
        if (sb) put_scale_row(rscl, sb, sld, dst, scales + (size_t)t * sb);
      }
  }
  if (any && r != d.me) {
    unsigned char *row = d.peer[r] + d.off_slab + ((size_t)d.me * (size_t)d.maxT + (size_t)t) * d.srb;
    warp_copy_wide(row, tokens + (size_t)t * tb, tb);
    if (sb) warp_copy(row + tb, scales + (size_t)t * sb, sb);
  }
}

// Dispatch expansion, one warp for destination row i whose map entry is in place: records
// recv_src (the row's place in the layout) and recv_route (combine's way back), then the row
// from the slab (own routes: written by the push already); zeros for padding and the tail.
__device__ static void expand_row(const lsa_dev &d, int64_t i, int64_t p, long long gid, float wv, int64_t R, int k,
                                  const layer_impl &L, const unsigned char *__restrict__ tokens,
                                  const unsigned char *__restrict__ scales, size_t tb, size_t sb, int64_t sld,
                                  unsigned char *__restrict__ rtok, unsigned char *__restrict__ rscl,
                                  float *__restrict__ rw) {
  const int lane = threadIdx.x & 31;
  const int64_t per = d.maxT * k;
  zero_scale_tail(rscl, sb, sld, R, i);
  if (p >= 0 && (gid < 0 || gid >= (long long)d.n * per)) gid = -1;  // never: both sides derive i alike
  if (p < 0) gid = -1;
  if (lane == 0) {
    L.recv_src[i] = p;
    L.recv_route[i] = gid;
    if (L.slot_row && p >= 0) L.slot_row[p] = i;  // one rank: the backward's direct path reads it
  }
  if (gid >= 0 && gid / per == d.me) return;  // written by the push
  if (gid >= 0) {
    const int s = (int)(gid / per);
    const int64_t t = (gid % per) / k;
    const unsigned char *src = d.peer[d.me] + d.off_slab + ((size_t)s * (size_t)d.maxT + (size_t)t) * d.srb;
    warp_copy_wide(rtok + (size_t)i * tb, src, tb);
    if (sb) put_scale_row(rscl, sb, sld, i, src + tb);
    if (lane == 0) rw[i] = wv;
  } else {
    warp_zero(rtok + (size_t)i * tb, tb);
    if (sb) zero_scale_row(rscl, sb, sld, i);
    if (lane == 0) rw[i] = 0.0f;
  }
}

// The dispatch: lsa_push_dispatch, lsa_barrier, lsa_expand. (A fused kernel that expanded each
// row once its source was tagged in place, without the barrier, ran 15-20% slower on 2 H200s,
// with acquire polls and with relaxed polls and backoff alike: gpu/NOTES-routing.md, session 11.)
__global__ void lsa_push_dispatch(lsa_dev d, const unsigned char *__restrict__ tokens,
                                  const unsigned char *__restrict__ scales, const float *__restrict__ w, int64_t T,
                                  int k, int64_t S, size_t tb, size_t sb, int64_t sld, layer_impl L,
                                  unsigned char *__restrict__ rtok, unsigned char *__restrict__ rscl,
                                  float *__restrict__ rw, int rank_major) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int64_t it = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; it < T * d.n; it += warps) {
    const int64_t t = rank_major ? it % T : it / d.n;
    const int r = (int)(rank_major ? it / T : it % d.n);
    push_token(d, t, r, tokens, scales, w, k, S, tb, sb, sld, L, rtok, rscl, rw);
  }
}

// Phase timing of the LSA ops (TWIN_EP_PHASES=1, read once; never while the stream is being
// captured): an event after each kernel of one op, the op synchronized at its end, the phases'
// times summed per (device, op, phase) and printed at exit (a phase met C times in an op, as the
// way back's steps, counts C times). A measuring aid for one thread per GPU: it adds a host
// synchronization per op, so the bench's own times are not comparable with it on, and a thread
// driving several ranks (the loopback test mode) would wait there on its own later ranks. Its
// CUDA errors are cleared and turn it off for the op, so they never reach the op's checks.
#define EP_PH_MAX 40
struct ep_phase_row { int dev; const char *op, *phase; long long T, rb; double ms; long n; };
static ep_phase_row g_ph_rows[256];
static int g_ph_nrows;
static pthread_mutex_t g_ph_mu = PTHREAD_MUTEX_INITIALIZER;
struct ep_phase_run { cudaStream_t s; int on, dev, n; long long T, rb; const char *op, *name[EP_PH_MAX]; cudaEvent_t ev[EP_PH_MAX]; };
static thread_local cudaEvent_t t_ph_ev[EP_PH_MAX];
static thread_local int t_ph_dev = -1;
static void ep_phases_print(void) {
  for (int i = 0; i < g_ph_nrows; i++)
    fprintf(stderr, "ep phase: T %6lld row %5lld B %-13s gpu %d %-10s %8.4f ms mean over %ld\n", g_ph_rows[i].T,
            g_ph_rows[i].rb, g_ph_rows[i].op, g_ph_rows[i].dev, g_ph_rows[i].phase, g_ph_rows[i].ms / g_ph_rows[i].n,
            g_ph_rows[i].n);
}
static int g_ph_on;
static pthread_once_t g_ph_once = PTHREAD_ONCE_INIT;
static void ep_phases_init(void) {
  const char *e = getenv("TWIN_EP_PHASES");
  g_ph_on = e && *e == '1';
  if (g_ph_on) atexit(ep_phases_print);
}
static int ep_phases_on(void) {
  pthread_once(&g_ph_once, ep_phases_init);
  return g_ph_on;
}
static void ph_begin(ep_phase_run *r, cudaStream_t s, const char *op, long long T, long long rb) {
  memset(r, 0, sizeof *r);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (!ep_phases_on()) return;
  int dev = 0;
  if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone ||
      cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (t_ph_dev != dev) {
    for (int i = 0; i < EP_PH_MAX; i++)
      if (cudaEventCreate(&t_ph_ev[i]) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
      }
    t_ph_dev = dev;
  }
  r->on = 1, r->s = s, r->dev = dev, r->op = op, r->T = T, r->rb = rb;
  memcpy(r->ev, t_ph_ev, sizeof r->ev);
  if (cudaEventRecord(r->ev[0], s) != cudaSuccess) {
    (void)cudaGetLastError();
    r->on = 0;
  }
  r->n = 1;
}
static void ph_mark(ep_phase_run *r, const char *phase) {
  if (!r->on || r->n >= EP_PH_MAX) return;
  r->name[r->n] = phase;
  if (cudaEventRecord(r->ev[r->n++], r->s) != cudaSuccess) {
    (void)cudaGetLastError();
    r->on = 0;
  }
}
static void ph_end(ep_phase_run *r) {
  if (!r->on) return;
  if (cudaEventSynchronize(r->ev[r->n - 1]) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  pthread_mutex_lock(&g_ph_mu);
  for (int i = 1; i < r->n; i++) {
    float ms = 0;
    cudaEventElapsedTime(&ms, r->ev[i - 1], r->ev[i]);
    int j = 0;
    while (j < g_ph_nrows && !(g_ph_rows[j].dev == r->dev && g_ph_rows[j].op == r->op && g_ph_rows[j].T == r->T &&
                               g_ph_rows[j].rb == r->rb && !strcmp(g_ph_rows[j].phase, r->name[i])))
      j++;
    if (j == g_ph_nrows && g_ph_nrows < 256) g_ph_rows[g_ph_nrows++] = {r->dev, r->op, r->name[i], r->T, r->rb, 0.0, 0};
    if (j < 256) g_ph_rows[j].ms += ms, g_ph_rows[j].n++;
  }
  pthread_mutex_unlock(&g_ph_mu);
}

// One device barrier of an LSA op on the stream, then its phase mark (what: the op, for the
// launch error's message).
static tw_status lsa_step_barrier(cudaStream_t stream, const lsa_dev &d, long long *err, int op, ep_phase_run *ph,
                                  const char *phase, const char *what) {
  lsa_barrier<<<1, 32, 0, stream>>>(d, err, op);
  GPU_TRY_CUDA(cudaGetLastError(), what);
  ph_mark(ph, phase);
  return TW_OK;
}

// The push kernels' item order: (token, rank) pairs token-major (a token's ranks side by side,
// its row read once from HBM; the default) or rank-major (TWIN_EP_PUSH_ORDER=rank), where a
// warp's grid-stride items mix the heavy items of its own rank (the own routes' rows) with the
// light remote ones; token-major gives a warp the same rank every time when the warp count is a
// multiple of the rank count. Measured on 2 H200s (gpu/NOTES-routing.md, session 15), same call:
// rank-major is slower for the dispatch at 4096 and 16384 tokens (+6-24 %) and for combine_bwd
// at 4096 (+2-13 %), faster for combine_bwd at 16384 (-3 % uniform, -13 % skewed). Read per call.
static int push_rank_major(void) {
  const char *e = getenv("TWIN_EP_PUSH_ORDER");
  return e && !strcmp(e, "rank");
}

__global__ void lsa_expand(lsa_dev d, int64_t R, int nle, int64_t S, int k, layer_impl L,
                           const unsigned char *__restrict__ tokens, const unsigned char *__restrict__ scales,
                           size_t tb, size_t sb, int64_t sld, unsigned char *__restrict__ rtok,
                           unsigned char *__restrict__ rscl, float *__restrict__ rw) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int failed = *L.flag;
  const lsa_rowmap *map = (const lsa_rowmap *)(d.peer[d.me] + d.off_rowmap);
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    if (failed) {  // nothing is written, as ep_nccl_slots
      if ((threadIdx.x & 31) == 0) L.recv_src[i] = L.recv_route[i] = -1;
      continue;
    }
    const int64_t p = source_row(i, L, d.n, d.me, nle, S);
    expand_row(d, i, p, p >= 0 ? map[i].gid : -1, p >= 0 ? map[i].w : 0.0f, R, k, L, tokens, scales, tb, sb, sld,
               rtok, rscl, rw);
  }
}

// Rows by source (tw_ep_dispatch_by_source) over ep_nccl_lsa, in C chunks of the token index t
// (chunk c: t in [c * cs, (c + 1) * cs), cs = ceil(max_tokens / C)): step c (c < C) pushes chunk
// c and a barrier follows; step c + 1 writes chunk c's source rows while chunk c + 1 is pushed
// (its first P blocks push, the others write), and the last step (c = C) also writes the row
// maps, so each chunk's rows land in src_tokens under the next chunk's NVLink transfer. The
// default is one chunk (src_chunks): push, barrier, write.
struct src_args {
  const unsigned char *tokens, *scales;
  const float *w;
  int64_t T, S, R, U, sld, cs;
  size_t tb, sb;
  int k, nle;
  unsigned char *src_tok, *src_scl;
  float *rw;
  int32_t *recv_row;
};

// Push item (t, r): the row-map entries of t's routes kept on r (as the dispatch push), the
// source tag of (me, t) in r's window (the push's epoch, or 0 when t has no kept route there),
// and, when t has any, its token bytes and scales once into r's slab (r != me) or straight into
// this rank's source row me * max_tokens + t (r = me; zeros when it has none).
__device__ static void src_push(const lsa_dev &d, const src_args &a, const layer_impl &L, int64_t t, int r,
                                unsigned long long stamp, int failed) {
  unsigned any = 0;
  for (int j0 = 0; j0 < a.k; j0 += 32) any |= put_route_maps(d, t, r, j0, a.k, a.S, L, a.w);
  if ((threadIdx.x & 31) == 0)
    ((unsigned long long *)(d.peer[r] + d.off_tag))[(size_t)d.me * (size_t)d.maxT + (size_t)t] = any ? stamp : 0ull;
  if (any && r != d.me) {
    unsigned char *row = d.peer[r] + d.off_slab + ((size_t)d.me * (size_t)d.maxT + (size_t)t) * d.srb;
    warp_copy_wide(row, a.tokens + (size_t)t * a.tb, a.tb);
    if (a.sb) warp_copy(row + a.tb, a.scales + (size_t)t * a.sb, a.sb);
  } else if (r == d.me && !failed) {  // a failed step writes no output
    const int64_t u = (int64_t)d.me * d.maxT + t;
    if (any) {
      warp_copy_wide(a.src_tok + (size_t)u * a.tb, a.tokens + (size_t)t * a.tb, a.tb);
      if (a.sb) put_scale_row(a.src_scl, a.sb, a.sld, u, a.scales + (size_t)t * a.sb);
    } else {
      warp_zero(a.src_tok + (size_t)u * a.tb, a.tb);
      if (a.sb) zero_scale_row(a.src_scl, a.sb, a.sld, u);
    }
  }
}

// Source row u = s * max_tokens + t (s != me, or t >= T): from the slab when its tag is the
// previous push's (stamp), zeros otherwise, with its scale row (rows, the 1x128 GEMM layout with
// sld = roundup(U, 4), or MXFP8's mx rows, laid out after).
__device__ static void src_row(const lsa_dev &d, const src_args &a, int64_t u, unsigned long long stamp) {
  const int s = (int)(u / d.maxT);
  const int64_t t = u % d.maxT;
  const unsigned long long *tag = (const unsigned long long *)(d.peer[d.me] + d.off_tag);
  zero_scale_tail(a.src_scl, a.sb, a.sld, a.U, u);
  if (s == d.me && t < a.T) return;  // the push's
  if (s != d.me && tag[u] == stamp) {
    const unsigned char *row = d.peer[d.me] + d.off_slab + ((size_t)s * (size_t)d.maxT + (size_t)t) * d.srb;
    warp_copy_wide(a.src_tok + (size_t)u * a.tb, row, a.tb);
    if (a.sb) put_scale_row(a.src_scl, a.sb, a.sld, u, row + a.tb);
  } else {
    warp_zero(a.src_tok + (size_t)u * a.tb, a.tb);
    if (a.sb) zero_scale_row(a.src_scl, a.sb, a.sld, u);
  }
}

// Expert-major row i's maps: recv_src, recv_route (combine and the backward), recv_row = its
// route's s * max_tokens + t, recv_weights. A failed step writes recv_src / recv_route only.
__device__ static void src_map(const lsa_dev &d, const src_args &a, const layer_impl &L, int64_t i, int failed) {
  const int64_t p = failed ? -1 : source_row(i, L, d.n, d.me, a.nle, a.S);
  if ((threadIdx.x & 31) != 0) return;
  const lsa_rowmap *map = (const lsa_rowmap *)(d.peer[d.me] + d.off_rowmap);
  const long long gid = p >= 0 ? map[i].gid : -1;
  L.recv_src[i] = p;
  L.recv_route[i] = gid;
  if (L.slot_row && p >= 0) L.slot_row[p] = i;
  if (!failed) {
    a.recv_row[i] = gid >= 0 ? (int32_t)(gid / a.k) : -1;
    a.rw[i] = gid >= 0 ? map[i].w : 0.0f;
  }
}

// Step c of C (above): blocks [0, P) push chunk c (all blocks when nothing is written this
// step), the others write chunk c - 1's source rows of every rank and, at c = C, the maps.
__global__ void lsa_src_step(lsa_dev d, src_args a, layer_impl L, int c, int C, int P) {
  const int failed = *L.flag;
  const unsigned long long epoch = *d.epoch;  // the same on every rank at this step (>= 1: lsa_counts' barrier)
  const int push = c < C, write = c > 0;
  const int pb = push && write ? P : push ? (int)gridDim.x : 0;
  const int lw = (int)(threadIdx.x >> 5), wpb = (int)(blockDim.x >> 5);
  if ((int)blockIdx.x < pb) {
    const int64_t t0 = (int64_t)c * a.cs, t1 = t0 + a.cs < a.T ? t0 + a.cs : a.T;
    const int64_t items = t1 > t0 ? (t1 - t0) * d.n : 0, warps = (int64_t)pb * wpb;
    for (int64_t it = (int64_t)blockIdx.x * wpb + lw; it < items; it += warps)
      src_push(d, a, L, t0 + it / d.n, (int)(it % d.n), epoch, failed);
    return;
  }
  if (failed && c < C) return;
  const int64_t t0 = (int64_t)(c - 1) * a.cs, t1 = t0 + a.cs < d.maxT ? t0 + a.cs : d.maxT;
  const int64_t len = t1 > t0 ? t1 - t0 : 0;  // chunks past max_tokens are empty (C * cs >= max_tokens)
  const int64_t rows = failed ? 0 : (int64_t)d.n * len, items = rows + (c == C ? a.R : 0);
  const int64_t warps = ((int64_t)gridDim.x - pb) * wpb;
  for (int64_t it = ((int64_t)blockIdx.x - pb) * wpb + lw; it < items; it += warps) {
    if (it < rows) src_row(d, a, (it / len) * d.maxT + t0 + it % len, epoch - 1ull);
    else src_map(d, a, L, it - rows, failed);
  }
}

// The way back of combine and dispatch_bwd over ep_nccl_lsa (lsa_back), in C chunks of the
// token side's tokens: step c stores the rows of the routes of tokens in chunk c into their
// ranks (its first blocks), while its other blocks sum chunk c - 1, which a barrier between the
// steps has completed on every rank. The sums then run under the NVLink transfer instead of
// after it (one chunk: push, barrier, sum, as before). Same stores, same sums: the same bits.
struct back_args {
  const unsigned char *y;  // expert_out / d_recv [R, H]
  size_t yb;
  int y_bf16, k, slot, weighted_form, out_bf16;
  int64_t R, H, S;
  const int64_t *recv_route, *route_pos, *route_dst;
  const float *per_slot, *w;
  void *out;
  float *d_w;
};

// Expert side: rows of another rank's routes into that rank's way-back slab at the route's
// index (own routes stay in place), and with `slot` the per-slot f32 right after the row
// (per_slot[i], 0 without it: the oracle's d_topk_weights of dispatch_bwd). A warp per row: all
// R destination rows (list NULL), or the *n rows of a chunk's list (lsa_back_bucket).
__device__ static void push_back_rows(const lsa_dev &d, const back_args &a, const int32_t *list, const int32_t *n,
                                      int blk, int nblk) {
  const int warps = (nblk * blockDim.x) >> 5;
  const int64_t per = d.maxT * a.k, rows = list ? *n : a.R;
  for (int64_t j = (int64_t)(blk * blockDim.x + threadIdx.x) / 32; j < rows; j += warps) {
    const int64_t i = list ? list[j] : j;
    const int64_t gid = a.recv_route[i];
    if (gid < 0) continue;
    const int s = (int)(gid / per);
    if (s == d.me) continue;
    unsigned char *row = d.peer[s] + d.off_comb + (size_t)(gid % per) * d.crb;
    warp_copy_wide(row, a.y + (size_t)i * a.yb, a.yb);
    if (a.slot && (threadIdx.x & 31) == 0) {
      const float v = a.per_slot ? a.per_slot[i] : 0.0f;
      memcpy(row + a.yb, &v, 4);
    }
  }
}

// The chunks' lists: destination row i of another rank's route (own: of any rank's) goes to the
// list of the chunk of its token, t / cs (lists [C][R], counts [C], zeroed before). Order within
// a list is free.
__global__ void lsa_back_bucket(lsa_dev d, int64_t R, int k, const int64_t *__restrict__ recv_route, int64_t cs,
                                int32_t *__restrict__ list, int32_t *__restrict__ count, int own) {
  const int64_t per = d.maxT * k;
  const int lane = threadIdx.x & 31;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x; base < R; base += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int64_t gid = i < R ? recv_route[i] : -1;
    const int c = gid < 0 || (!own && gid / per == d.me) ? -1 : (int)(((gid % per) / k) / cs);
    // one atomic per chunk and warp: the lanes of a chunk take consecutive places
    const unsigned peers = __match_any_sync(0xffffffffu, c);
    const int leader = __ffs(peers) - 1;
    int at = 0;
    if (c >= 0 && lane == leader) at = atomicAdd(&count[c], __popc(peers));
    at = __shfl_sync(0xffffffffu, at, leader);
    if (c >= 0) list[(int64_t)c * R + at + __popc(peers & ((1u << lane) - 1u))] = (int32_t)i;
  }
}

// Token side, tokens [t0, t1): out[t] = sum_j w[t, j] * y(route) (combine, weighted_form) or
// sum_j g(route) (dispatch_bwd: no product, as the oracle adds g itself) in f32, j order
// (ep_sum_routes' arithmetic); the row from this window's way-back slab, or `y` itself
// (expert_out / d_recv) for this rank's own routes. d_w (dispatch_bwd): each kept route's
// per-slot f32 (after the slab row; per_slot[row] for own routes, 0 without per_slot), 0 for a
// dropped one. Eight bf16 per thread where rows allow (the same sums, element by element).
__device__ static void sum_chunk(const lsa_dev &d, const back_args &a, int64_t t0, int64_t t1, int blk, int nblk) {
  const unsigned char *__restrict__ y = a.y;
  const size_t yb = a.yb;
  const int y_bf16 = a.y_bf16, k = a.k, weighted_form = a.weighted_form, out_bf16 = a.out_bf16;
  const int64_t H = a.H, S = a.S;
  const int64_t *__restrict__ route_pos = a.route_pos, *__restrict__ route_dst = a.route_dst;
  const float *__restrict__ w = a.w, *__restrict__ per_slot = a.per_slot;
  void *__restrict__ out = a.out;
  float *__restrict__ d_w = a.d_w;
  __shared__ const unsigned char *row_of[EP_SUM_MAXK];
  __shared__ float w_of[EP_SUM_MAXK];
  const unsigned char *comb = d.peer[d.me] + d.off_comb;
  const bool vec = y_bf16 && out_bf16 && H % 8 == 0 && yb % 16 == 0 && d.crb % 16 == 0 && k <= EP_SUM_MAXK &&
                   ((uintptr_t)y & 15) == 0 && ((uintptr_t)out & 15) == 0;
  for (int64_t t = t0 + blk; t < t1; t += nblk) {
    const bool cached = k <= EP_SUM_MAXK;
    if (cached) {
      __syncthreads();
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int64_t q = t * k + j, p = route_pos[q];
        row_of[j] = p < 0 ? NULL : p / S == d.me ? y + (size_t)route_dst[q] * yb : comb + (size_t)q * d.crb;
        w_of[j] = w ? w[q] : 1.0f;
      }
      __syncthreads();
    }
    if (vec) {
      for (int64_t h8 = threadIdx.x; h8 < H / 8; h8 += blockDim.x) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j = 0; j < k; j++) {
          if (!row_of[j]) continue;
          float y8[8];
          load8_bf16(row_of[j], 8 * h8, y8);
          for (int e = 0; e < 8; e++)
            acc[e] = weighted_form ? __fadd_rn(acc[e], __fmul_rn(w_of[j], y8[e])) : __fadd_rn(acc[e], y8[e]);
        }
        store8(out, 1, t * H + 8 * h8, acc);
      }
    }
    if (d_w)
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int64_t q = t * k + j, p = route_pos[q];
        float g = 0.0f;
        if (p >= 0 && p / S == d.me) g = per_slot ? per_slot[route_dst[q]] : 0.0f;
        else if (p >= 0) memcpy(&g, comb + (size_t)q * d.crb + yb, 4);
        d_w[q] = g;
      }
    if (vec) continue;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++) {
        const unsigned char *row;
        float wj;
        if (cached) {
          row = row_of[j];
          wj = w_of[j];
        } else {
          const int64_t q = t * k + j, p = route_pos[q];
          row = p < 0 ? NULL : p / S == d.me ? y + (size_t)route_dst[q] * yb : comb + (size_t)q * d.crb;
          wj = w ? w[q] : 1.0f;
        }
        if (!row) continue;
        const float yv = load_f32(row, y_bf16, h);
        acc = weighted_form ? __fadd_rn(acc, __fmul_rn(wj, yv)) : __fadd_rn(acc, yv);
      }
      store_f32(out, out_bf16, t * H + h, acc);
    }
  }
}


// One step of the way back: blocks [0, P) push the rows of `list` (NULL: every row), the others
// sum tokens [s0, s1).
__global__ void lsa_back_step(lsa_dev d, back_args a, int P, const int32_t *list, const int32_t *n, int64_t s0,
                              int64_t s1) {
  if ((int)blockIdx.x < P) push_back_rows(d, a, list, n, blockIdx.x, P);
  else sum_chunk(d, a, s0, s1, blockIdx.x - P, gridDim.x - P);
}
// The steps with one role only: the same device functions in kernels of their own registers.
__global__ void lsa_push_back(lsa_dev d, back_args a, const int32_t *list, const int32_t *n) {
  push_back_rows(d, a, list, n, blockIdx.x, gridDim.x);
}
__global__ void lsa_sum(lsa_dev d, back_args a, int64_t s0, int64_t s1) { sum_chunk(d, a, s0, s1, blockIdx.x, gridDim.x); }

// w * (eight bf16 of v), each product rounded to bf16: ep_dout_direct's arithmetic on a vector.
__device__ static uint4 scaled8_bf16(float w, uint4 v) {
  const uint32_t x[4] = {v.x, v.y, v.z, v.w};
  uint32_t o[4];
#pragma unroll
  for (int e = 0; e < 4; e++)
    o[e] = (uint32_t)tw_f32_to_bf16_d(__fmul_rn(w, bf16_lo(x[e]))) |
           ((uint32_t)tw_f32_to_bf16_d(__fmul_rn(w, bf16_hi(x[e]))) << 16);
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// combine_bwd's row i of d_expert_out: w * d_out(route) (ep_dout_direct's product, in d_out's
// dtype) from src, and with y (expert_out) d_topk_weights' dot of src with y[i] (warp_dot's
// order), returned to every lane. vec: bf16 rows, 16-byte aligned, H % 8 == 0, for d_out, out
// and y alike: each d_out vector is read once for both. Otherwise the row, then warp_dot on
// any dtypes. row = NULL: the dot only (combine_bwd by source), in the same order.
__device__ static float dout_row(const unsigned char *__restrict__ src, float wq, unsigned char *__restrict__ row,
                                 const unsigned char *__restrict__ yr, int bf16, int y_bf16, int64_t H, int vec) {
  const int lane = threadIdx.x & 31;
  float acc = 0.0f;
  if (vec) {
    const uint4 *sv = (const uint4 *)src, *yv = (const uint4 *)yr;
    uint4 *ov = (uint4 *)row;
    const int64_t nc = H / 8;
    int64_t c = lane;
    for (; c + 96 < nc; c += 128) {  // four vectors of each row in flight per lane
      uint4 x[4], z[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        x[u] = sv[c + 32 * u];
        if (yr) z[u] = yv[c + 32 * u];
      }
#pragma unroll
      for (int u = 0; u < 4; u++) {
        if (row) ov[c + 32 * u] = scaled8_bf16(wq, x[u]);
        if (yr) acc = dot8_bf16(acc, x[u], z[u]);
      }
    }
    for (; c < nc; c += 32) {
      const uint4 x = sv[c];
      if (row) ov[c] = scaled8_bf16(wq, x);
      if (yr) acc = dot8_bf16(acc, x, yv[c]);
    }
    return warp_fold(acc);
  }
  for (int64_t h = lane; row && h < H; h += 32) store_f32(row, bf16, h, __fmul_rn(wq, load_f32(src, bf16, h)));
  return yr ? warp_dot(src, bf16, yr, y_bf16, H, 0) : 0.0f;
}

// combine_bwd, token side (after the entry barrier): one warp per (token t, rank r): each of t's
// routes kept on r gets its row-map entry (route, the weight this call passes: 1 without one)
// in r's window, and when t has any there and r is another rank, d_out[t] (ob bytes) goes once
// into r's way-back slab at (me, t). With own_in_push the rows of d_expert_out of t's routes on
// this rank and their dots are formed here (dout_row; the dots into this rank's window), so
// they overlap the remote stores, as the dispatch push expands its own tokens; else
// lsa_dout_rows forms them, a warp per row.
__global__ void lsa_push_dout(lsa_dev d, const unsigned char *__restrict__ d_out, size_t ob,
                              const float *__restrict__ w, int64_t T, int k, int64_t S, layer_impl L, int bf16,
                              int64_t H, unsigned char *__restrict__ out, const unsigned char *__restrict__ y,
                              size_t yb, int y_bf16, int vec, int rank_major, int own_in_push) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  float *dw = (float *)(d.peer[d.me] + d.off_dw);
  for (int64_t it = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; it < T * d.n; it += warps) {
    const int64_t t = rank_major ? it % T : it / d.n;
    const int r = (int)(rank_major ? it / T : it % d.n);
    unsigned any = 0;
    for (int j0 = 0; j0 < k; j0 += 32) {
      unsigned hits = put_route_maps(d, t, r, j0, k, S, L, w);
      any |= hits;
      if (r == d.me && own_in_push)
        while (hits) {  // own routes: their rows, the warp together
          const int b = __ffs(hits) - 1;
          hits &= hits - 1;
          const int64_t q = t * k + j0 + b, i = L.route_dst[q];
          const float acc = dout_row(d_out + (size_t)t * ob, w ? w[q] : 1.0f, out + (size_t)i * ob,
                                     y ? y + (size_t)i * yb : NULL, bf16, y_bf16, H, vec);
          if (y && (threadIdx.x & 31) == 0) dw[q] = acc;  // route_gid(d, t, k, j) % (maxT * k) = q
        }
    }
    if (!any || r == d.me) continue;
    warp_copy_wide(d.peer[r] + d.off_comb + ((size_t)d.me * (size_t)d.maxT + (size_t)t) * d.crb,
                   d_out + (size_t)t * ob, ob);
  }
}

// combine_bwd, expert side (after the barrier), one warp per destination row i: dout_row from
// the slab row its token's rank stored (this rank's own routes: from d_out itself, unless
// lsa_push_dout formed them, own_in_push), the weight from the row map that rank's push wrote,
// the dot stored into that rank's window at the route's index; zeros for rows without a route.
__global__ void lsa_dout_rows(lsa_dev d, int bf16, int k, int64_t H, int64_t R,
                              const int64_t *__restrict__ recv_route, unsigned char *__restrict__ out, size_t ob,
                              const unsigned char *__restrict__ y, size_t yb, int y_bf16, int vec,
                              const unsigned char *__restrict__ d_out, int own_in_push) {
  const lsa_rowmap *map = (const lsa_rowmap *)(d.peer[d.me] + d.off_rowmap);
  const int warps = (gridDim.x * blockDim.x) >> 5, lane = threadIdx.x & 31;
  const int64_t per = d.maxT * k;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    const long long gid = recv_route[i];
    unsigned char *row = out + (size_t)i * ob;
    if (gid < 0) {
      warp_zero(row, ob);
      continue;
    }
    const int s = (int)(gid / per);
    if (s == d.me && own_in_push) continue;
    const int64_t t = (gid % per) / k;
    const unsigned char *src = s == d.me ? d_out + (size_t)t * ob
                                         : d.peer[d.me] + d.off_comb + ((size_t)s * (size_t)d.maxT + (size_t)t) * d.crb;
    const float acc = dout_row(src, map[i].w, row, y ? y + (size_t)i * yb : NULL, bf16, y_bf16, H, vec);
    if (y && lane == 0) ((float *)(d.peer[s] + d.off_dw))[gid % per] = acc;
  }
}

// combine_bwd d_topk_weights, token side (after the barrier): the dot of each kept route, 0 for a dropped one.
__global__ void lsa_take_dw(lsa_dev d, int64_t routes, const int64_t *__restrict__ route_pos, float *__restrict__ d_w) {
  const float *dw = (const float *)(d.peer[d.me] + d.off_dw);
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < routes; q += (int64_t)gridDim.x * blockDim.x)
    d_w[q] = route_pos[q] >= 0 ? dw[q] : 0.0f;
}

// combine_bwd by source (tw_ep.h) over ep_nccl_lsa, in C chunks of the token index (C = 1: push,
// barrier, rows). Step c: blocks [0, P) push chunk c, the others write chunk c - 1's rows; a
// barrier after each push.
struct dsrc_args {
  const unsigned char *d_out, *y;  // d_out [T, H]; expert_out [R, H] (NULL: no dots)
  unsigned char *d_src;            // [U, H]
  size_t ob, yb;
  int64_t T, H, R, S, cs;          // cs: tokens per chunk
  int k, bf16, y_bf16, vec, own_in_push, rank_major;
  const int64_t *recv_route;
};

// Push item (t, r): when t has a kept route on r, d_out[t] once into r's way-back slab at (me, t)
// (r != me) or into this rank's d_src row me * max_tokens + t (r = me; zeros when it has none);
// the source tag of (me, t) in r's window is this push's epoch (0: no route there; the tags of
// rows by source, whose epochs only grow, so a stale tag never matches). No row map: the
// dispatch's stays. With own_in_push the dots of t's routes on this rank are formed here too
// (under the remote stores), into this rank's window.
__device__ static void dsrc_push(const lsa_dev &d, const dsrc_args &a, const layer_impl &L, int64_t t, int r,
                                 unsigned long long stamp) {
  const int lane = threadIdx.x & 31;
  unsigned any = 0;
  for (int j0 = 0; j0 < a.k; j0 += 32) {
    unsigned hits = __ballot_sync(0xffffffffu, kept_on(L, t, a.k, j0 + lane, a.S, r) >= 0);
    any |= hits;
    if (r == d.me && a.own_in_push && a.y)
      while (hits) {
        const int b = __ffs(hits) - 1;
        hits &= hits - 1;
        const int64_t q = t * a.k + j0 + b, i = L.route_dst[q];
        const float acc =
            dout_row(a.d_out + (size_t)t * a.ob, 1.0f, NULL, a.y + (size_t)i * a.yb, a.bf16, a.y_bf16, a.H, a.vec);
        if (lane == 0) ((float *)(d.peer[d.me] + d.off_dw))[q] = acc;
      }
  }
  if (lane == 0)
    ((unsigned long long *)(d.peer[r] + d.off_tag))[(size_t)d.me * (size_t)d.maxT + (size_t)t] = any ? stamp : 0ull;
  unsigned char *dst = r != d.me ? d.peer[r] + d.off_comb + ((size_t)d.me * (size_t)d.maxT + (size_t)t) * d.crb
                                 : a.d_src + ((size_t)d.me * (size_t)d.maxT + (size_t)t) * a.ob;
  if (any) warp_copy_wide(dst, a.d_out + (size_t)t * a.ob, a.ob);
  else if (r == d.me) warp_zero(dst, a.ob);
}

// Source row u = s * max_tokens + t not written by a push (s != me, or t >= T): from the slab
// when its tag is the previous push's (stamp), zeros otherwise.
__device__ static void dsrc_row(const lsa_dev &d, const dsrc_args &a, int64_t u, unsigned long long stamp) {
  const int s = (int)(u / d.maxT);
  const int64_t t = u % d.maxT;
  if (s == d.me && t < a.T) return;
  unsigned char *row = a.d_src + (size_t)u * a.ob;
  if (s != d.me && ((const unsigned long long *)(d.peer[d.me] + d.off_tag))[u] == stamp)
    warp_copy_wide(row, d.peer[d.me] + d.off_comb + ((size_t)s * (size_t)d.maxT + (size_t)t) * d.crb, a.ob);
  else
    warp_zero(row, a.ob);
}

// The dot of expert-major row i's route (unless the push formed it), from the slab row (or d_out
// for this rank's own route), stored into the route's rank's window at its index.
__device__ static void dsrc_dot(const lsa_dev &d, const dsrc_args &a, int64_t i) {
  const long long gid = a.recv_route[i];
  if (gid < 0) return;
  const int64_t per = d.maxT * a.k;
  const int s = (int)(gid / per);
  if (s == d.me && a.own_in_push) return;
  const int64_t t = (gid % per) / a.k;
  const unsigned char *src = s == d.me ? a.d_out + (size_t)t * a.ob
                                       : d.peer[d.me] + d.off_comb + ((size_t)s * (size_t)d.maxT + (size_t)t) * d.crb;
  const float acc = dout_row(src, 1.0f, NULL, a.y + (size_t)i * a.yb, a.bf16, a.y_bf16, a.H, a.vec);
  if ((threadIdx.x & 31) == 0) ((float *)(d.peer[s] + d.off_dw))[gid % per] = acc;
}

// Step c's two roles over blocks [blk0, blk0 + nblk). Push: tokens [c cs, (c + 1) cs) to every
// rank. Write: chunk c - 1's source rows of every rank and its dots: with C = 1 every expert-major
// row's (those of own routes unless the push formed them), else the rows of lsa_back_bucket's
// list c - 1 (every rank's routes of that chunk).
__device__ static void dsrc_push_chunk(const lsa_dev &d, const dsrc_args &a, const layer_impl &L, int c, int blk,
                                       int nblk) {
  const int lw = (int)(threadIdx.x >> 5), wpb = (int)(blockDim.x >> 5);
  const unsigned long long epoch = *d.epoch;  // the same on every rank at this step
  const int64_t t0 = (int64_t)c * a.cs, t1 = t0 + a.cs < a.T ? t0 + a.cs : a.T;
  const int64_t len = t1 > t0 ? t1 - t0 : 0, items = len * d.n, warps = (int64_t)nblk * wpb;
  for (int64_t it = (int64_t)blk * wpb + lw; it < items; it += warps) {
    const int64_t t = t0 + (a.rank_major ? it % len : it / d.n);
    const int r = (int)(a.rank_major ? it / len : it % d.n);
    dsrc_push(d, a, L, t, r, epoch);
  }
}
__device__ static void dsrc_write_chunk(const lsa_dev &d, const dsrc_args &a, int c, int C, const int32_t *list,
                                        const int32_t *nlist, int blk, int nblk) {
  const int lw = (int)(threadIdx.x >> 5), wpb = (int)(blockDim.x >> 5);
  const unsigned long long stamp = *d.epoch - 1ull;  // the previous push's: one barrier since
  const int64_t t0 = (int64_t)(c - 1) * a.cs, t1 = t0 + a.cs < d.maxT ? t0 + a.cs : d.maxT;
  const int64_t len = t1 > t0 ? t1 - t0 : 0;  // chunks past max_tokens are empty
  const int64_t rows = (int64_t)d.n * len, dots = !a.y ? 0 : C == 1 ? a.R : *nlist;
  const int64_t warps = (int64_t)nblk * wpb;
  for (int64_t it = (int64_t)blk * wpb + lw; it < rows + dots; it += warps) {
    if (it < rows) dsrc_row(d, a, (it / len) * d.maxT + t0 + it % len, stamp);
    else dsrc_dot(d, a, C == 1 ? it - rows : list[it - rows]);
  }
}
// A step that does both: blocks [0, P) push chunk c, the others write chunk c - 1. The steps
// with one role (the first push, the last write) run the same device functions in kernels of
// their own registers (the fused kernel's made C = 1 ~10% slower on 2 H200s).
__global__ void lsa_dsrc_step(lsa_dev d, dsrc_args a, layer_impl L, int c, int C, int P, const int32_t *list,
                              const int32_t *nlist) {
  if ((int)blockIdx.x < P) dsrc_push_chunk(d, a, L, c, blockIdx.x, P);
  else dsrc_write_chunk(d, a, c, C, list, nlist, blockIdx.x - P, gridDim.x - P);
}
__global__ void lsa_dsrc_push(lsa_dev d, dsrc_args a, layer_impl L, int c) {
  dsrc_push_chunk(d, a, L, c, blockIdx.x, gridDim.x);
}
__global__ void lsa_dsrc_write(lsa_dev d, dsrc_args a, int c, int C, const int32_t *list, const int32_t *nlist) {
  dsrc_write_chunk(d, a, c, C, list, nlist, blockIdx.x, gridDim.x);
}

// combine_bwd by source on ep_nccl_slots, one warp per kept route: its token's d_out row (ob
// bytes) and the source word (src_word) right after it into the route's staging row.
__global__ void ep_pack_dout_src(const unsigned char *__restrict__ d_out, size_t ob, int64_t routes, int k,
                                 const int64_t *__restrict__ route_pos, int64_t S, unsigned char *__restrict__ send,
                                 size_t rb) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int64_t q = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; q < routes; q += warps) {
    const int64_t p = route_pos[q];
    if (p < 0) continue;
    unsigned char *row = send + (size_t)p * rb;
    warp_copy_wide(row, d_out + (size_t)(q / k) * ob, ob);
    if ((threadIdx.x & 31) == 0) {
      const uint32_t tw = src_word(route_pos, q, k, S);
      memcpy(row + ob, &tw, 4);
    }
  }
}

// ... and on the receiver (after ep_zero_unless_failed), one warp per expert-major row with a
// route: its staging row into d_src at s * max_tokens + t when the word marks the token's first
// route to this rank. direct (one rank, no staging): the row from d_out, the word from the route.
__global__ void ep_unpack_dout_src(const unsigned char *__restrict__ recv, size_t rb, int64_t R, int64_t maxT, int k,
                                   int64_t S, layer_impl L, int direct, const unsigned char *__restrict__ d_out,
                                   size_t ob, unsigned char *__restrict__ d_src) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int64_t i = (int64_t)(blockIdx.x * blockDim.x + threadIdx.x) / 32; i < R; i += warps) {
    const int64_t p = L.recv_src[i];
    if (p < 0) continue;
    const unsigned char *row;
    uint32_t word;
    if (direct) {
      const int64_t q = L.slot_route[p];
      word = src_word(L.route_pos, q, k, S);
      row = d_out + (size_t)(q / k) * ob;
    } else {
      row = recv + (size_t)p * rb;
      memcpy(&word, row + ob, 4);
    }
    if (word >> 31) warp_copy_wide(d_src + ((size_t)(p / S) * (size_t)maxT + (word & 0x7fffffffu)) * ob, row, ob);
  }
}

// ---- MXFP8 scales in the grouped GEMM's layout (cfg.scales_gemm_layout, scale_block 32) ----
//
// The row kernels put the received scale rows into mx_rows [R, sc] (the row layout); then
// ep_mx_prefix derives T(l) = sum_{l' < l} ceil(padded_l' / 128) and O_l = sum_{l' < l} padded_l'
// from group_sizes (this step's, on the device), and ep_mx_scales writes every 4-byte word of
// recv_scales [out_rows, C] from its position (the inverse of ref/ep.c's forward map): the
// slab whose block holds the word, the block row r and columns 4e..4e+3, the bytes of row
// O_l + r where r < padded_l and c < sc, 0x00 elsewhere (block padding, rows past the last
// block). Neither runs when the step failed (*flag): nothing is written.

// One block: tab[0..nle] = T(l), tab[nle+1 .. 2nle+1] = O_l (exclusive prefixes, l = nle: totals).
__global__ void ep_mx_prefix(const int32_t *__restrict__ gs, int nle, const int32_t *__restrict__ flag,
                             int64_t *__restrict__ tab) {
  if (*flag) return;
  __shared__ int64_t pt[256], po[256];
  const int tid = threadIdx.x, nt = blockDim.x;  // nt <= 256
  const int per = (nle + nt - 1) / nt, lo = tid * per < nle ? tid * per : nle, hi = lo + per < nle ? lo + per : nle;
  int64_t st = 0, so = 0;
  for (int l = lo; l < hi; l++) {
    st += (gs[l] + 127) / 128;
    so += gs[l];
  }
  pt[tid] = st;
  po[tid] = so;
  __syncthreads();
  if (tid == 0) {  // exclusive prefix over the threads' parts, in order
    int64_t a = 0, b = 0;
    for (int i = 0; i < nt; i++) {
      const int64_t x = pt[i], y = po[i];
      pt[i] = a;
      po[i] = b;
      a += x;
      b += y;
    }
    tab[nle] = a;
    tab[2 * nle + 1] = b;
  }
  __syncthreads();
  int64_t a = pt[tid], b = po[tid];
  for (int l = lo; l < hi; l++) {
    tab[l] = a;
    tab[nle + 1 + l] = b;
    a += (gs[l] + 127) / 128;
    b += gs[l];
  }
}

// A thread per 4-byte word of out (C % 4 == 0: a word is 4 columns of one block row, in either
// byte order). swz: cuBLAS's 128x4 tiling per block, (r, c) = (128a + 32b + d, 4e + f) at
// ((a * C/4 + e) * 32 + d) * 16 + b * 4 + f of the block (tw_quantize.h).
__global__ void ep_mx_scales(const unsigned char *__restrict__ rows, int64_t sc, int64_t C, int nle,
                             const int64_t *__restrict__ tab, const int32_t *__restrict__ gs,
                             const int32_t *__restrict__ flag, int swz, int64_t words, int aligned,
                             unsigned char *__restrict__ out) {
  if (*flag) return;
  const int64_t total = tab[nle], blk = 128 * C;
  for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = 4 * w, tile = p / blk;
    uint32_t v = 0;
    if (tile < total) {
      int lo = 0, hi = nle - 1;  // the last slab l with T(l) <= tile (empty slabs share their start)
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tab[mid] <= tile) lo = mid;
        else hi = mid - 1;
      }
      const int64_t wb = p - tab[lo] * blk;  // byte offset within slab lo's block
      int64_t r, c0;
      if (swz) {
        const int64_t b = (wb >> 2) & 3, d = (wb >> 4) & 31, rest = wb >> 9, e = rest % (C / 4), a = rest / (C / 4);
        r = 128 * a + 32 * b + d;
        c0 = 4 * e;
      } else {
        r = wb / C;
        c0 = wb % C;
      }
      if (r < gs[lo]) {
        const unsigned char *src = rows + (size_t)(tab[nle + 1 + lo] + r) * (size_t)sc;
        for (int f = 0; f < 4; f++)
          if (c0 + f < sc) v |= (uint32_t)src[c0 + f] << (8 * f);
      }
    }
    if (aligned) {
      ((uint32_t *)out)[w] = v;
    } else {
      for (int f = 0; f < 4; f++) out[p + f] = (unsigned char)(v >> (8 * f));
    }
  }
}

// ---- host side ----------------------------------------------------------------------------

static int grid_for(tw_ctx *ctx, int64_t work, int per_block) {
  int64_t b = (work + per_block - 1) / per_block, cap = (int64_t)gpu_of(ctx)->num_sms * 8;
  if (b < 1) b = 1;
  return (int)(b < cap ? b : cap);
}

static size_t round16(size_t x) { return (x + 15) & ~(size_t)15; }

static size_t fwd_row_bytes(const tw_ep *ep) {
  const tw_ep_config *c = &ep->cfg;
  return tw_dtype_storage_bytes(c->token_dtype, c->hidden) +
         tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, ep->scale_cols) + 8;  // + weight, src_word
}

// Staging row strides per step. The slots are allocated for the largest (an f32 row and its
// per-slot f32 on the way back), but each step strides by what it moves: a bf16 dispatch row is
// half an f32 one and an e4m3 row a quarter, and the exchange sends S rows of the stride to
// every peer (2 x H200, H 7168, T 16384: 13.1 ms per bf16 dispatch with the f32 stride).
static size_t step_rb_fwd(const tw_ep *ep) { return round16(fwd_row_bytes(ep)); }
// The way back: a row of dt, its per-slot f32 at step_slot_off (right after the row), padded.
static size_t step_slot_off(const tw_ep *ep, tw_dtype dt) { return tw_dtype_storage_bytes(dt, ep->cfg.hidden); }
static size_t step_rb_back(const tw_ep *ep, tw_dtype dt) { return round16(step_slot_off(ep, dt) + 4); }

// The version this context asks for: 0 auto, 1 ep_nccl_slots, 2 ep_nccl_lsa (names of other
// families are left alone).
static tw_status ep_version(tw_ctx *ctx, const char *op, int *want) {
  const char *k = tw_ctx_kernel(ctx);
  *want = 0;
  if (!k || strncmp(k, "ep_", 3) != 0) return TW_OK;
  if (strcmp(k, "ep_nccl_slots") == 0) *want = 1;
  else if (strcmp(k, "ep_nccl_lsa") == 0) *want = 2;
  else return tw_error(TW_ERR_INVALID_ARG, "%s: no kernel version named '%s' (have ep_nccl_slots, ep_nccl_lsa)", op, k);
  return TW_OK;
}

static size_t round_to(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Leaves im->lsa NULL with im->why when ep_nccl_lsa cannot run here; every rank reaches the
// same answer (static facts first, then flags all-reduced over the group before each step
// that could differ between ranks). An error status only for a failed collective.
static tw_status lsa_create(tw_ep *ep, ep_impl *im, int forced) {
#if !EP_HAVE_LSA
  snprintf(im->why, sizeof im->why, "built against NCCL %d, without the device API (needs 2.28)", NCCL_VERSION_CODE);
  return TW_OK;
#else
  const tw_ep_config *c = &ep->cfg;
  const int n = ep->ep_size, me = ep->rank;
  if (n < 2 && !forced) {  // forced on one rank, it runs (to self): tests cover its kernels on 1 GPU
    snprintf(im->why, sizeof im->why, "ep_size 1: one rank's dispatch is a local permutation (ep_nccl_slots' direct path)");
    return TW_OK;
  }
  // Test mode, forced only: the ranks of a loopback communicator (threads on one GPU) share one
  // address space, so each window is a cudaMalloc and the peer table an all_gather of the
  // pointers; every kernel of the version then runs as over NVLink (tests/ep_gpu_test.c).
  const int loopback_ok = forced;
  {
    // Load every kernel a step launches now: with lazy module loading (CUDA's default) the first
    // launch of a kernel waits for the GPU, and a peer's barrier kernel spinning there (ranks
    // sharing a GPU: the loopback test mode) would never let it (seen: 20 s barrier timeouts).
    const void *fns[] = {(const void *)ep_chunk_count, (const void *)ep_chunk_scan, (const void *)ep_layout,
                         (const void *)ep_route_pos, (const void *)lsa_counts, (const void *)lsa_push_dispatch,
                         (const void *)lsa_barrier, (const void *)lsa_expand, (const void *)lsa_src_step,
                         (const void *)ep_mx_prefix, (const void *)ep_mx_scales, (const void *)lsa_back_step, (const void *)lsa_back_bucket, (const void *)lsa_push_back,
                         (const void *)lsa_sum,
                         (const void *)lsa_push_dout, (const void *)lsa_dout_rows,
                         (const void *)lsa_dsrc_step, (const void *)lsa_dsrc_push, (const void *)lsa_dsrc_write,
                         (const void *)lsa_take_dw,
                         (const void *)ep_pack_back, (const void *)ep_sum_routes,
                         (const void *)ep_pack_dout, (const void *)ep_unpack_rows, (const void *)ep_dot_routes,
                         (const void *)ep_dout_direct};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
      cudaFuncAttributes fa;
      GPU_TRY_CUDA(cudaFuncGetAttributes(&fa, fns[i]), "ep_create: load the LSA step's kernels");
    }
  }
  lsa_impl *L = (lsa_impl *)calloc(1, sizeof *L);
  if (!L) return tw_error(TW_ERR_MEMORY, "ep_create: out of host memory");
  lsa_dev &d = L->d;
  d.n = n;
  d.me = me;
  d.maxT = c->max_tokens;
  size_t tb = tw_dtype_storage_bytes(c->token_dtype, c->hidden);
  size_t sb = ep->scale_cols ? tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, ep->scale_cols) : 0;
  d.srb = round16(tb + sb);
  d.crb = round16((size_t)c->hidden * 4 + 4);
  size_t o = GPU_LSA_HEADER_BYTES;  // the handshake word before it
  d.off_flags = o; o += round_to((size_t)n * 8, 256);
  d.off_counts = o; o += round_to((size_t)n * (size_t)c->num_experts * 4, 256);
  d.off_rowmap = o; o += round_to((size_t)c->recv_capacity * sizeof(lsa_rowmap), 256);
  d.off_slab = o; o += round_to((size_t)n * (size_t)c->max_tokens * d.srb, 256);
  // way-back slab: combine's and dispatch_bwd's [max_tokens * k] route rows, combine_bwd's (both
  // forms) [n][max_tokens] d_out rows
  const size_t back_rows = (size_t)c->max_tokens * (size_t)(c->topk > n ? c->topk : n);
  d.off_comb = o; o += round_to(back_rows * d.crb, 256);
  d.off_dw = o; o += round_to((size_t)c->max_tokens * (size_t)c->topk * 4, 256);
  // source tags [n][max_tokens] (an epoch each) of both by-source ops: which slab rows this step wrote
  d.off_tag = o; o += (size_t)n * (size_t)c->max_tokens * 8;
  {
    const char *te = getenv("TWIN_EP_LSA_TIMEOUT_S");  // a shorter wait for first runs on new machines
    double ts = te && atof(te) > 0 ? atof(te) : 20.0;
    d.timeout_ns = (unsigned long long)(ts * 1e9);
  }
  tw_status s = gpu_lsa_window_open(ep->comm, ep->ctx, o - GPU_LSA_HEADER_BYTES, loopback_ok, 1, "ep_create: LSA window",
                                    &L->w, im->why, sizeof im->why);
  if (s != TW_OK || !L->w) {
    free(L);
    return s;
  }
  d.peer = L->w->peer;
  d.epoch = L->w->epoch;
  d.dead = L->w->dead;
  im->lsa = L;
  return TW_OK;
#endif
}

static tw_status lsa_destroy(tw_ep *ep, lsa_impl *L) {
  tw_status s = gpu_lsa_window_close(ep->comm, ep->ctx, L->w, "ep_destroy: LSA window");
  free(L);
  return s;
}

extern "C" const char *gpu_ep_version_name(const tw_ep *ep) {
  const ep_impl *im = ep ? (const ep_impl *)ep->impl : NULL;
  return im && im->lsa ? "ep_nccl_lsa" : "ep_nccl_slots";
}
extern "C" const char *gpu_ep_version_why(const tw_ep *ep) {
  const ep_impl *im = ep ? (const ep_impl *)ep->impl : NULL;
  return im ? im->why : "";
}

// `twin backends`: which version auto picks on this machine and why, from what the process can
// see without a communicator (the per-group answer is gpu_ep_version_why after tw_ep_create).
extern "C" void gpu_ep_describe(char *buf, size_t n) {
  int ver = 0, gpus = 0, p2p = 0;
  ncclGetVersion(&ver);
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    cudaGetLastError();
    gpus = 0;
  }
  if (gpus >= 2 && cudaDeviceCanAccessPeer(&p2p, 0, 1) != cudaSuccess) p2p = 0;
  const int team = dlsym(RTLD_DEFAULT, "ncclTeamLsa") != NULL;
  if (!EP_LSA_AUTO)
    snprintf(buf, n, "ep_nccl_slots (auto); ep_nccl_lsa only when forced by name, until its 2-GPU sweep has passed "
                     "on the device (NCCL runtime %d, headers %d, %d GPU%s, peer access 0<->1: %s)", ver,
             NCCL_VERSION_CODE, gpus, gpus == 1 ? "" : "s", gpus < 2 ? "n/a" : p2p ? "yes" : "no");
  else if (!EP_HAVE_LSA || ver < 22800 || !team)
    snprintf(buf, n, "ep_nccl_slots: NCCL runtime %d / headers %d lack the device API (ep_nccl_lsa needs 2.28)", ver,
             NCCL_VERSION_CODE);
  else if (gpus < 2)
    snprintf(buf, n, "ep_nccl_slots here (%d GPU: ep_size 1 is a local permutation); ep_nccl_lsa on NCCL groups whose "
                     "GPUs share one LSA (NVLink/P2P) team (NCCL runtime %d, headers %d)", gpus, ver, NCCL_VERSION_CODE);
  else if (!p2p)
    snprintf(buf, n, "ep_nccl_slots: GPUs 0 and 1 have no peer access (no LSA team; NCCL runtime %d)", ver);
  else
    snprintf(buf, n, "ep_nccl_lsa for ep_size >= 2 NCCL groups on these %d GPUs (peer access 0<->1; NCCL runtime %d, "
                     "headers %d; checked again per group at tw_ep_create: LSA team, window handshake), "
                     "else ep_nccl_slots", gpus, ver, NCCL_VERSION_CODE);
}

static tw_status gpu_ep_create(tw_ep *ep) {
  int want = 0;
  TW_TRY(ep_version(ep->ctx, "ep_create", &want));
  const tw_comm_ops *co = ep->comm->ops;
  if (!co->all_gather || !co->all_to_allv || !co->barrier)
    return tw_error(TW_ERR_UNSUPPORTED, "ep_create: the '%s' communicator lacks all_gather, all_to_allv or barrier",
                    co->name);
  const tw_ep_config *c = &ep->cfg;
  ep_impl *im = (ep_impl *)calloc(1, sizeof *im);
  if (!im) return tw_error(TW_ERR_MEMORY, "ep_create: out of host memory");
  int64_t kk = c->topk < ep->nle ? c->topk : ep->nle;
  im->S = c->max_tokens * kk;
  size_t back = (size_t)c->hidden * 4 + 4, fwd = fwd_row_bytes(ep);
  im->rb = round16(fwd > back ? fwd : back);
  size_t bytes = (size_t)ep->ep_size * (size_t)im->S * im->rb;
  tw_status s = TW_OK;
  if (c->scales_gemm_layout && c->scale_block == 32) {
    const int64_t U = (int64_t)ep->ep_size * c->max_tokens, rows = c->recv_capacity > U ? c->recv_capacity : U;
    if (rows) s = tw_alloc(ep->ctx, (size_t)rows * (size_t)ep->scale_cols, (void **)&im->mx_rows);
    if (s == TW_OK) s = tw_alloc(ep->ctx, (size_t)(ep->nle + 1) * 16, (void **)&im->mx_tab);
    // one group of U rows: T(0) = 0, T(1) = ceil(U / 128), O_0 = 0, O_1 = U, then gs[0] = U
    if (s == TW_OK) s = tw_alloc(ep->ctx, 5 * 8, (void **)&im->mx_src_tab);
    if (s == TW_OK) {
      int64_t tab[5] = {0, (U + 127) / 128, 0, U, 0};
      int32_t g = (int32_t)U;
      memcpy(&tab[4], &g, 4);
      tw_tensor dt = tw_tensor_1d(im->mx_src_tab, TW_I64, 5, TW_MEM_DEVICE), ht = tw_tensor_1d(tab, TW_I64, 5, TW_MEM_HOST);
      s = tw_tensor_copy(ep->ctx, &dt, &ht);
    }
  }
  if (s == TW_OK) s = co->barrier(ep->comm, ep->ctx);  // every rank must come
  if (s == TW_OK && want == 1) snprintf(im->why, sizeof im->why, "ep_nccl_slots was forced (tw_ctx_config.kernel)");
  if (s == TW_OK && want == 0 && !EP_LSA_AUTO)
    snprintf(im->why, sizeof im->why, "auto picks ep_nccl_slots: ep_nccl_lsa runs only when forced by name until its "
                                      "2-GPU sweep has passed on the device");
  if (s == TW_OK && (want == 2 || (want == 0 && EP_LSA_AUTO)))
    s = lsa_create(ep, im, want == 2);  // every rank asks alike
  if (s == TW_OK && want == 2 && !im->lsa)
    s = tw_error(TW_ERR_UNSUPPORTED, "ep_create: ep_nccl_lsa was forced but cannot run here: %s", im->why);
  // the slots' staging (ep_nccl_slots only: with LSA every step runs in the window); max_tokens
  // 0 still gets a few bytes, so that its steps exchange empty slots instead of failing
  if (s == TW_OK && !im->lsa) {
    if (!bytes) bytes = 16;
    s = tw_alloc(ep->ctx, bytes, (void **)&im->send);
    // one rank: the exchange is the identity on the slots, so both sides share one staging
    // buffer and exchange() moves nothing (5 whole-slot copies fewer per fwd + bwd)
    if (s == TW_OK && ep->ep_size == 1) im->recv = im->send;
    else if (s == TW_OK) s = tw_alloc(ep->ctx, bytes, (void **)&im->recv);
  }
  if (s != TW_OK) {
    if (im->lsa) lsa_destroy(ep, im->lsa);
    if (im->send) tw_free(ep->ctx, im->send);
    if (im->recv && im->recv != im->send) tw_free(ep->ctx, im->recv);
    if (im->mx_rows) tw_free(ep->ctx, im->mx_rows);
    if (im->mx_tab) tw_free(ep->ctx, im->mx_tab);
    if (im->mx_src_tab) tw_free(ep->ctx, im->mx_src_tab);
    free(im);
    return s;
  }
  ep->impl = im;
  return TW_OK;
}

static tw_status gpu_ep_destroy(tw_ep *ep) {
  ep_impl *im = (ep_impl *)ep->impl;
  if (!im) return TW_OK;
  tw_status s = TW_OK;
  if (im->lsa) s = lsa_destroy(ep, im->lsa);
  if (im->send) {
    tw_status s1 = tw_free(ep->ctx, im->send);
    if (s == TW_OK) s = s1;
  }
  if (im->recv && im->recv != im->send) {
    tw_status s2 = tw_free(ep->ctx, im->recv);
    if (s == TW_OK) s = s2;
  }
  void *mxp[3] = {im->mx_rows, im->mx_tab, im->mx_src_tab};
  for (int i = 0; i < 3; i++)
    if (mxp[i]) {
      tw_status s3 = tw_free(ep->ctx, mxp[i]);
      if (s == TW_OK) s = s3;
    }
  free(im);
  ep->impl = NULL;
  return s;
}

static tw_status gpu_ep_layer_create(tw_ep_layer *layer) {
  const tw_ep *ep = layer->ep;
  const tw_ep_config *c = &ep->cfg;
  int64_t n = ep->ep_size, E = c->num_experts, nle = ep->nle, routes = c->max_tokens * c->topk;
  int64_t nch = (routes + EP_CHUNK - 1) / EP_CHUNK, R = c->recv_capacity;
  layer_impl *L = (layer_impl *)calloc(1, sizeof *L);
  if (!L) return tw_error(TW_ERR_MEMORY, "ep_layer_create: out of host memory");
  L->nchunks_max = nch;
  // i64 arrays first (8-byte aligned), then i32
  int64_t S1 = n == 1 ? ((ep_impl *)ep->impl)->S : 0;  // the direct path's slot maps
  const int lsa = ((ep_impl *)ep->impl)->lsa != NULL;
  size_t n64 = (size_t)(n * nle) * 3 + (size_t)(n * (nle + 1)) + (size_t)E * 2 + (size_t)routes + (size_t)R +
               2 * (size_t)S1 + (lsa ? (size_t)E + (size_t)routes + (size_t)R : 0);
  size_t n32 = (size_t)(nch * E) * 2 + (size_t)(n * E) + (size_t)routes + 1 +
               (lsa ? (size_t)EP_BACK_MAXC * ((size_t)R + 1) : 0);
  tw_status s = tw_alloc(ep->ctx, n64 * 8 + n32 * 4, &L->base);
  if (s != TW_OK) {
    free(L);
    return s;
  }
  int64_t *p = (int64_t *)L->base;
  L->kept = p; p += n * nle;
  L->before = p; p += n * nle;
  L->recv_pref = p; p += n * nle;
  L->offs = p; p += n * (nle + 1);
  L->mykept = p; p += E;
  L->sendbase = p; p += E;
  L->route_pos = p; p += routes;
  L->recv_src = p; p += R;
  if (S1) {
    L->slot_route = p; p += S1;
    L->slot_row = p; p += S1;
  }
  if (lsa) {
    L->dstbase = p; p += E;
    L->route_dst = p; p += routes;
    L->recv_route = p; p += R;
  }
  int32_t *q = (int32_t *)p;
  L->chunk_counts = q; q += nch * E;
  L->chunk_base = q; q += nch * E;
  L->counts_all = q; q += n * E;
  L->route_key = q; q += routes;
  L->flag = q; q += 1;
  if (lsa) {
    L->back_n = q; q += EP_BACK_MAXC;
    L->back_list = q; q += EP_BACK_MAXC * R;
  }
  // a combine before any dispatch is refused by core; still, start from "no routes"
  s = tw_memset(ep->ctx, L->base, 0xff, n64 * 8);
  if (s == TW_OK) s = tw_memset(ep->ctx, L->flag, 0, 4);
  if (s != TW_OK) {
    tw_free(ep->ctx, L->base);
    free(L);
    return s;
  }
  layer->impl = L;
  return TW_OK;
}

static tw_status gpu_ep_layer_destroy(tw_ep_layer *layer) {
  layer_impl *L = (layer_impl *)layer->impl;
  if (!L) return TW_OK;
  tw_status s = tw_free(layer->ep->ctx, L->base);
  free(L);
  layer->impl = NULL;
  return s;
}

// The fixed-slot exchange: every peer gets S rows of rb bytes (forward: send -> recv).
// rb: this step's staging row stride (step_rb_*), at most im->rb, the one the slots are allocated
// for: every peer gets S rows of it, so the bytes on the wire follow the step's dtype.
static tw_status exchange(tw_ctx *ctx, const tw_ep *ep, int forward, size_t rb) {
  ep_impl *im = (ep_impl *)ep->impl;
  if (rb > im->rb) return tw_error(TW_ERR_INTERNAL, "ep: a staging row of %zu bytes exceeds the slots' %zu", rb, im->rb);
  int n = ep->ep_size;
  if (!im->send) return tw_error(TW_ERR_INTERNAL, "ep: a slots exchange on a context without staging (ep_nccl_lsa)");
  if (n == 1 && im->recv == im->send) return TW_OK;  // one rank: one shared staging buffer
  int64_t cnt[2 * 8], *counts = cnt, *displs = cnt + n;
  int64_t *heap = NULL;
  if (n > 8) {
    heap = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)n);
    if (!heap) return tw_error(TW_ERR_MEMORY, "ep: out of host memory");
    counts = heap;
    displs = heap + n;
  }
  int64_t slot = im->S * (int64_t)rb;
  for (int r = 0; r < n; r++) {
    counts[r] = slot;
    displs[r] = r * slot;
  }
  tw_comm *c = ep->comm;
  tw_status s = forward ? c->ops->all_to_allv(c, ctx, im->send, counts, displs, im->recv, counts, displs, TW_U8)
                        : c->ops->all_to_allv(c, ctx, im->recv, counts, displs, im->send, counts, displs, TW_U8);
  free(heap);
  return s;
}

// Rows by source (tw_ep_dispatch_by_source): where dispatch_rows writes instead of recv_tokens.
struct src_out {
  unsigned char *tok, *scl;  // src_tokens; its scale rows (rows, 1x128 GEMM layout, or MXFP8's mx rows)
  size_t scl_bytes;          // of scl
  int64_t U, sld;            // source rows; 1x128 GEMM layout: roundup(U, 4), else 0
  int32_t *row;              // recv_row [R]
};

// Chunks of rows by source over ep_nccl_lsa (lsa_src_step): 1 by default; TWIN_EP_SRC_CHUNKS
// forces C (1 .. max_tokens). On 2 H200s every C > 1 was slower (gpu/NOTES-routing.md, session
// 18: 16384 tokens bf16 0.939 / 0.967 / 0.998 / 1.048 ms at C = 1 / 2 / 4 / 8): the writes of a
// chunk take HBM and SMs from the push, which is at the NVLink store ceiling. Kept as the general
// form for more ranks, where most rows are remote (not measured yet).
static int src_chunks(int64_t U, size_t tb, int64_t maxT) {
  (void)U;
  (void)tb;
  const char *e = getenv("TWIN_EP_SRC_CHUNKS");
  int64_t c = e ? atoi(e) : 1;
  if (c > maxT) c = maxT;
  if (c < 1) c = 1;
  if (c > 64) c = 64;
  return (int)c;
}
// Blocks of a step that pushes and writes: P push (a quarter of the SMs, as the way back's
// steps), W write (the rest of 8 blocks per SM). TWIN_EP_SRC_PUSH_BLOCKS forces P.
static void src_step_blocks(int sms, int *push, int *write) {
  const char *e = getenv("TWIN_EP_SRC_PUSH_BLOCKS");
  *push = e && atoi(e) > 0 ? atoi(e) : (sms + 3) / 4;
  *write = 8 * sms - *push;
  if (*write < 1) *write = 1;
}

// Every output but MXFP8's GEMM-layout scales (those go to mx_rows as rows; gpu_ep_dispatch lays
// them out). src: rows by source (recv_tokens and recv_scales unused), else expert-major.
static tw_status dispatch_rows(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                               const tw_tensor *token_scales, const tw_tensor *topk_idx,
                               const tw_tensor *topk_weights, tw_tensor *recv_tokens, tw_tensor *recv_scales,
                               tw_tensor *recv_weights, tw_tensor *group_sizes, tw_tensor *dropped,
                               const src_out *src) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  gpu_state *st = gpu_of(ctx);
  cudaStream_t stream = st->stream;
  const tw_ep_config *c = &ep->cfg;
  int E = c->num_experts, k = c->topk, nle = ep->nle, n = ep->ep_size, me = ep->rank;
  int64_t T = tokens->shape[0], routes = T * k, nch = (routes + EP_CHUNK - 1) / EP_CHUNK, R = c->recv_capacity;
  size_t smem = (size_t)E * 4;
  if (smem > (48u << 10)) {
    GPU_TRY_CUDA(cudaFuncSetAttribute(ep_chunk_count, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "ep_dispatch: shared memory for E counters");
  }
  const int32_t *idx = (const int32_t *)topk_idx->data;
  int32_t *mine = L->counts_all + (int64_t)me * E;
  ep_phase_run ph = {};
  if (im->lsa)
    ph_begin(&ph, stream, src ? "dispatch_by_source" : "dispatch", T,
             (long long)tw_dtype_storage_bytes(c->token_dtype, c->hidden));
  if (nch) {  // one chunk (T * k <= EP_CHUNK): its counts are this rank's, no scan launch
    ep_chunk_count<<<(unsigned)nch, EP_CHUNK, smem, stream>>>(idx, routes, k, E, L->chunk_counts,
                                                              nch == 1 ? mine : NULL, L->route_key, st->err_word);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: count launch");
  }
  if (nch != 1) {  // T = 0 too: zero counts
    ep_chunk_scan<<<(E + 255) / 256, 256, 0, stream>>>(L->chunk_counts, nch, E, L->chunk_base, mine);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: scan launch");
  }
  if (im->lsa) {  // counts into every window, one barrier, all rows back
    lsa_counts<<<1, 256, 0, stream>>>(im->lsa->d, mine, E, L->counts_all, st->err_word);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: LSA counts launch");
  } else if (n > 1) {  // one rank: counts_all is `mine` already (an in-place gather of itself)
    TW_TRY(ep->comm->ops->all_gather(ep->comm, ctx, mine, L->counts_all, E, TW_I32));
  }
  // one chunk: ep_layout places the routes too (ep_route_pos' launch saved at small T)
  const size_t lsmem = layout_smem(n, E);
  layout_args la = {n, me, nle, E, (int)c->overflow, c->alignment, R, nch == 1 ? routes : 0, im->S, lsmem > 0};
  ep_layout<<<1, EP_LAYOUT_THREADS, lsmem, stream>>>(la, L->counts_all, *L, (int32_t *)group_sizes->data,
                                                     tw_tensor_is_none(dropped) ? NULL : (int32_t *)dropped->data,
                                                     st->err_word);
  GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: layout launch");
  size_t tb = tw_dtype_storage_bytes(c->token_dtype, c->hidden);
  size_t sb = ep->scale_cols ? tw_dtype_storage_bytes(token_scales->dtype, ep->scale_cols) : 0;
  const int mx = sb && c->scales_gemm_layout && c->scale_block == 32;  // rows into mx_rows, laid out after
  const int64_t sld = sb && c->scales_gemm_layout && !mx ? (R + 3) / 4 * 4 : 0;  // recv_scales [H/128, sld] (tw_ep.h)
  unsigned char *rscl = !sb || src ? NULL : mx ? im->mx_rows : (unsigned char *)recv_scales->data;
  const unsigned char *tok_p = (const unsigned char *)tokens->data;
  const unsigned char *scl_p = sb ? (const unsigned char *)token_scales->data : NULL;
  if (nch > 1) {
    ep_route_pos<<<grid_for(ctx, routes, 256), 256, 0, stream>>>(routes, E, nle, im->S, 1, *L);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: route launch");
  }
  if (im->lsa && src) {
    const lsa_dev &d = im->lsa->d;
    ph_mark(&ph, "tables");
    const int C = src_chunks(src->U, tb, d.maxT);
    src_args a = {tok_p, scl_p, (const float *)topk_weights->data, T, im->S, R, src->U, src->sld,
                  (d.maxT + C - 1) / C, tb, sb, k, nle, src->tok, src->scl, (float *)recv_weights->data, src->row};
    int P = 0, W = 0;
    if (C > 1) src_step_blocks(st->num_sms, &P, &W);
    for (int step = 0; step <= C; step++) {
      const int grid = step == 0 ? grid_for(ctx, T * n, 8)
                       : step == C ? grid_for(ctx, R + (int64_t)n * a.cs, 8) : P + W;
      lsa_src_step<<<grid, 256, 0, stream>>>(d, a, *L, step, C, P);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch_by_source: LSA step launch");
      ph_mark(&ph, step == 0 ? "push" : step == C ? "rows" : "push+rows");
      if (step < C)
        TW_TRY(lsa_step_barrier(stream, d, st->err_word, GPU_OP_EP_DISPATCH, &ph, "barrier",
                                "ep_dispatch_by_source: LSA barrier launch"));
    }
    ph_end(&ph);
    return TW_OK;
  }
  if (src) {  // ep_nccl_slots (one rank: direct, no staging): zeros, then each received source row once
    if (!L->slot_route && nch) {
      ep_pack_dispatch<<<grid_for(ctx, routes, 8), 256, 0, stream>>>(
          tok_p, scl_p, (const float *)topk_weights->data, routes, k, tb, sb, L->route_pos, im->S, im->send,
          step_rb_fwd(ep));
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch_by_source: pack launch");
    }
    if (!L->slot_route) TW_TRY(exchange(ctx, ep, 1, step_rb_fwd(ep)));
    const size_t zb = (size_t)src->U * tb + src->scl_bytes;
    if (zb) {
      ep_zero_unless_failed<<<grid_for(ctx, (int64_t)(zb / 16 + 1), 256), 256, 0, stream>>>(
          L->flag, src->tok, (size_t)src->U * tb, src->scl, src->scl_bytes);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch_by_source: zero launch");
    }
    if (R) {
      ep_unpack_by_source<<<grid_for(ctx, R, 8), 256, 0, stream>>>(
          im->recv, step_rb_fwd(ep), R, n, me, nle, im->S, c->max_tokens, k, *L, L->slot_route != NULL, tok_p, scl_p,
          (const float *)topk_weights->data, src->tok, tb, src->scl, sb, src->sld, (float *)recv_weights->data,
          src->row);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch_by_source: unpack launch");
    }
    return TW_OK;
  }
  if (im->lsa) {
    const lsa_dev &d = im->lsa->d;
    ph_mark(&ph, "tables");
    if (T) {
      lsa_push_dispatch<<<grid_for(ctx, T * n, 8), 256, 0, stream>>>(
          d, (const unsigned char *)tokens->data, sb ? (const unsigned char *)token_scales->data : NULL,
          (const float *)topk_weights->data, T, k, im->S, tb, sb, sld, *L, (unsigned char *)recv_tokens->data,
          rscl, (float *)recv_weights->data, push_rank_major());
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: LSA push launch");
    }
    ph_mark(&ph, "push");
    TW_TRY(lsa_step_barrier(stream, d, st->err_word, GPU_OP_EP_DISPATCH, &ph, "barrier",
                            "ep_dispatch: LSA barrier launch"));
    if (R) {
      lsa_expand<<<grid_for(ctx, R, 8), 256, 0, stream>>>(
          d, R, nle, im->S, k, *L, (const unsigned char *)tokens->data,
          sb ? (const unsigned char *)token_scales->data : NULL, tb, sb, sld, (unsigned char *)recv_tokens->data,
          rscl, (float *)recv_weights->data);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: LSA expand launch");
    }
    ph_mark(&ph, "expand");
    ph_end(&ph);
    return TW_OK;
  }
  if (L->slot_route) {  // one rank: destination rows straight from the tokens
    if (R) {
      ep_dispatch_direct<<<grid_for(ctx, R, 8), 256, 0, stream>>>(
          (const unsigned char *)tokens->data, sb ? (const unsigned char *)token_scales->data : NULL,
          (const float *)topk_weights->data, k, R, nle, im->S, *L, (unsigned char *)recv_tokens->data, tb,
          rscl, sb, sld, (float *)recv_weights->data);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: direct launch");
    }
    return TW_OK;
  }
  if (nch) {
    ep_pack_dispatch<<<grid_for(ctx, routes, 8), 256, 0, stream>>>(
        (const unsigned char *)tokens->data, sb ? (const unsigned char *)token_scales->data : NULL,
        (const float *)topk_weights->data, routes, k, tb, sb, L->route_pos, im->S, im->send, step_rb_fwd(ep));
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: pack launch");
  }
  TW_TRY(exchange(ctx, ep, 1, step_rb_fwd(ep)));
  if (R) {
    ep_unpack_dispatch<<<grid_for(ctx, R, 8), 256, 0, stream>>>(
        im->recv, step_rb_fwd(ep), R, n, me, nle, im->S, *L, (unsigned char *)recv_tokens->data, tb,
        rscl, sb, sld, (float *)recv_weights->data);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: unpack launch");
  }
  return TW_OK;
}

static tw_status gpu_ep_dispatch(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                 const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                 const tw_tensor *topk_weights, tw_tensor *recv_tokens, tw_tensor *recv_scales,
                                 tw_tensor *recv_weights, tw_tensor *group_sizes, tw_tensor *dropped) {
  TW_TRY(dispatch_rows(ctx, layer, tokens, token_scales, topk_idx, topk_weights, recv_tokens, recv_scales, recv_weights,
                       group_sizes, dropped, NULL));
  const tw_ep *ep = layer->ep;
  const tw_ep_config *c = &ep->cfg;
  if (!(ep->scale_cols && c->scales_gemm_layout && c->scale_block == 32)) return TW_OK;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  cudaStream_t stream = gpu_of(ctx)->stream;
  const int64_t C = (ep->scale_cols + 3) / 4 * 4, words = recv_scales->shape[0] * C / 4;
  ep_mx_prefix<<<1, 256, 0, stream>>>((const int32_t *)group_sizes->data, ep->nle, L->flag, im->mx_tab);
  GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: MXFP8 scale prefix launch");
  if (words) {
    ep_mx_scales<<<grid_for(ctx, words, 256), 256, 0, stream>>>(
        im->mx_rows, ep->scale_cols, C, ep->nle, im->mx_tab, (const int32_t *)group_sizes->data, L->flag,
        c->scales_mxfp8_swizzled, words, ((uintptr_t)recv_scales->data & 3) == 0, (unsigned char *)recv_scales->data);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch: MXFP8 scale layout launch");
  }
  return TW_OK;
}

static tw_status gpu_ep_dispatch_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                           const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                           const tw_tensor *topk_weights, tw_tensor *src_tokens,
                                           tw_tensor *src_scales, tw_tensor *recv_row, tw_tensor *recv_weights,
                                           tw_tensor *group_sizes, tw_tensor *dropped) {
  const tw_ep *ep = layer->ep;
  const tw_ep_config *c = &ep->cfg;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  const int64_t U = (int64_t)ep->ep_size * c->max_tokens;
  const int mx = ep->scale_cols && c->scales_gemm_layout && c->scale_block == 32;
  src_out so = {};
  so.tok = (unsigned char *)src_tokens->data;
  so.U = U;
  so.row = (int32_t *)recv_row->data;
  if (ep->scale_cols) {
    const size_t sb = tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, ep->scale_cols);
    so.scl = mx ? im->mx_rows : (unsigned char *)src_scales->data;
    so.sld = c->scales_gemm_layout && !mx ? (U + 3) / 4 * 4 : 0;
    so.scl_bytes = so.sld ? (size_t)ep->scale_cols * (size_t)so.sld * 4 : (size_t)U * sb;
  }
  tw_tensor none = tw_tensor_none();
  TW_TRY(dispatch_rows(ctx, layer, tokens, token_scales, topk_idx, topk_weights, &none, &none, recv_weights,
                       group_sizes, dropped, &so));
  if (!mx) return TW_OK;
  cudaStream_t stream = gpu_of(ctx)->stream;
  const int64_t C = (ep->scale_cols + 3) / 4 * 4, words = src_scales->shape[0] * C / 4;
  if (words) {  // one group of U rows (the table made at create)
    ep_mx_scales<<<grid_for(ctx, words, 256), 256, 0, stream>>>(
        im->mx_rows, ep->scale_cols, C, 1, im->mx_src_tab, (const int32_t *)(im->mx_src_tab + 4), L->flag,
        c->scales_mxfp8_swizzled, words, ((uintptr_t)src_scales->data & 3) == 0, (unsigned char *)src_scales->data);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch_by_source: MXFP8 scale layout launch");
  }
  return TW_OK;
}

// Destination rows (and an optional per-slot f32) back to the sources' send staging.
static tw_status rows_back(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *rows, const tw_tensor *per_slot) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  int64_t R = ep->cfg.recv_capacity, H = ep->cfg.hidden;
  if (R) {
    ep_pack_back<<<grid_for(ctx, R, 8), 256, 0, gpu_of(ctx)->stream>>>(
        (const unsigned char *)rows->data, step_slot_off(ep, rows->dtype),
        per_slot && !tw_tensor_is_none(per_slot) ? (const float *)per_slot->data : NULL, R, L->recv_src, im->recv,
        step_rb_back(ep, rows->dtype), H);
    GPU_TRY_CUDA(cudaGetLastError(), "ep: pack-back launch");
  }
  return exchange(ctx, ep, 0, step_rb_back(ep, rows->dtype));
}

static unsigned sum_threads(int64_t H) { return H >= 256 ? 256u : (unsigned)((H + 31) / 32 * 32); }

// The rows a combine-like sum reads: the staging (after the way back) or, on one rank, the
// destination rows themselves through slot_row.
struct row_src {
  const unsigned char *base;
  size_t rb, slot_off;  // row stride; where the per-slot f32 sits in a staging row
  const int64_t *slot_row;
};
static tw_status rows_for_sum(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *rows, const tw_tensor *per_slot,
                              row_src *src) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  if (L->slot_row) {
    *src = {(const unsigned char *)rows->data, tw_dtype_storage_bytes(rows->dtype, ep->cfg.hidden), 0, L->slot_row};
    return TW_OK;
  }
  *src = {im->send, step_rb_back(ep, rows->dtype), step_slot_off(ep, rows->dtype), NULL};
  return rows_back(ctx, layer, rows, per_slot);
}

// The way back's chunk count: 1 while the way-back slab rows of the R destination rows (R x crb,
// crb = 4 H + 4 whatever the rows' dtype) are under 64 MiB (the extra barriers would cost more
// than the overlap gives: 128 tokens), else 4, and 8 from 16384 max_tokens (2 H200s: at 4096
// tokens 4 chunks beat 2 and 8; at 16384 8 beat 4 by 1-1.5 %, a shorter last sum).
// Every rank must take the same C (it sets the barrier count): it comes from the shared config
// only, and TWIN_EP_BACK_CHUNKS=C (forces C, 1 .. EP_BACK_MAXC, read per call) must be the same
// on every rank.
static int back_chunks(int64_t R, size_t crb, int64_t maxT) {
  const char *e = getenv("TWIN_EP_BACK_CHUNKS");
  int64_t c = e ? atoi(e) : (double)R * (double)crb < 64.0 * 1024 * 1024 ? 1 : maxT >= 16384 ? 8 : 4;
  if (c < 1) c = 1;
  if (c > EP_BACK_MAXC) c = EP_BACK_MAXC;
  if (c > maxT) c = maxT > 0 ? maxT : 1;
  return (int)c;
}
// Blocks of a step that both pushes and sums: P push (a quarter of the SMs: NVLink stores reach
// their rate from a few warps per SM, and every block more takes HBM bandwidth from the sums),
// the rest of one resident wave sums. TWIN_EP_BACK_PUSH_BLOCKS / TWIN_EP_BACK_SUM_BLOCKS force them.
static void back_step_blocks(int sms, unsigned threads, int *push, int *sum) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, lsa_back_step, (int)threads, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // not a launch's error: leave nothing for the next check to find
    per_sm = 1;
  }
  if (per_sm < 1) per_sm = 1;
  const char *ep = getenv("TWIN_EP_BACK_PUSH_BLOCKS"), *es = getenv("TWIN_EP_BACK_SUM_BLOCKS");
  *push = ep && atoi(ep) > 0 ? atoi(ep) : (sms + 3) / 4;
  *sum = es && atoi(es) > 0 ? atoi(es) : per_sm * sms - *push;
  if (*sum < 1) *sum = 1;
}

// ep_nccl_lsa's way back, combine (weighted_form, w = the weights or NULL) and dispatch_bwd
// (the plain sum; d_w and per_slot: d_topk_weights and d_recv_weights, or NULL): an entry
// barrier (every rank finished reading its way-back slab of the previous step), each route's row
// into its token's rank, a barrier, the oracle's j-order sums; with C > 1 chunks (back_chunks)
// the rows of chunk c are pushed while chunk c - 1 is summed, a barrier after each push (C + 1
// barriers, the same number on every rank: C depends on the shared config only; the lists by
// lsa_back_bucket). 2 H200s, T 16384 / 4096 (gpu/NOTES-routing.md, session 16): combine 3.48 ->
// 3.04 ms / 0.91 -> 0.82 ms uniform, 4.77 -> 4.29 / 1.22 -> 1.12 skewed. dispatch_bwd always sends the
// per-slot f32: whether a rank wants d_topk_weights is its own affair (a rank with no tokens
// passes none), the rows it receives are its peers' to write.
static tw_status lsa_back(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *rows, const float *w, int weighted_form,
                          tw_tensor *out, float *d_w, const float *per_slot, int op) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  const lsa_dev &d = im->lsa->d;
  gpu_state *st = gpu_of(ctx);
  cudaStream_t stream = st->stream;
  int64_t T = layer->tokens, H = ep->cfg.hidden, R = ep->cfg.recv_capacity;
  int k = ep->cfg.topk;
  size_t yb = tw_dtype_storage_bytes(rows->dtype, H);
  ep_phase_run ph;
  ph_begin(&ph, stream, weighted_form ? "combine" : "dispatch_bwd", T, (long long)yb);
  TW_TRY(lsa_step_barrier(stream, d, st->err_word, op, &ph, "barrier0",
                          "ep: LSA barrier launch"));
  back_args a = {(const unsigned char *)rows->data, yb, rows->dtype == TW_BF16, k, !weighted_form, weighted_form,
                 out->dtype == TW_BF16, R, H, im->S, L->recv_route, L->route_pos, L->route_dst, per_slot, w,
                 out->data, d_w};
  const unsigned threads = sum_threads(H > 0 ? H : 1);
  const int sms = gpu_of(ctx)->num_sms, C = back_chunks(R, d.crb, d.maxT);
  const int64_t cs = (d.maxT + C - 1) / C;  // tokens per chunk (the last may be shorter)
  const int push_all = grid_for(ctx, R, (int)(threads / 32));
  int push_part = 0, sum_part = 0;
  if (C > 1) {
    back_step_blocks(sms, threads, &push_part, &sum_part);
    GPU_TRY_CUDA(cudaMemsetAsync(L->back_n, 0, sizeof(int32_t) * EP_BACK_MAXC, stream), "ep: LSA way-back lists");
    lsa_back_bucket<<<grid_for(ctx, R, 256), 256, 0, stream>>>(d, R, k, L->recv_route, cs, L->back_list, L->back_n,
                                                                0);
    GPU_TRY_CUDA(cudaGetLastError(), "ep: LSA way-back lists launch");
    ph_mark(&ph, "lists");
  }
  for (int c = 0; c <= C; c++) {
    // step c: push chunk c (c < C), sum chunk c - 1 (c > 0)
    const int64_t s0 = c > 0 ? (c - 1) * cs : 0, s1 = c > 0 ? (c * cs < T ? c * cs : T) : 0;
    const int sum_blocks = s1 > s0 ? (c < C ? (int)(s1 - s0 < sum_part ? s1 - s0 : sum_part) : grid_for(ctx, s1 - s0, 1)) : 0;
    const int P = c < C && R ? (c == 0 || !sum_blocks ? push_all : push_part) : 0;
    const int32_t *list = C > 1 && c < C ? L->back_list + (int64_t)c * R : NULL;
    if (P && sum_blocks) {
      lsa_back_step<<<P + sum_blocks, threads, 0, stream>>>(d, a, P, list, list ? L->back_n + c : NULL, s0, s1);
    } else if (P) {
      lsa_push_back<<<P, threads, 0, stream>>>(d, a, list, list ? L->back_n + c : NULL);
    } else if (sum_blocks) {
      lsa_sum<<<sum_blocks, threads, 0, stream>>>(d, a, s0, s1);
    }
    GPU_TRY_CUDA(cudaGetLastError(), "ep: LSA way-back launch");
    ph_mark(&ph, c == 0 ? "push" : c == C ? "sum" : "push+sum");
    if (c < C) {
      TW_TRY(lsa_step_barrier(stream, d, st->err_word, op, &ph, "barrier",
                              "ep: LSA barrier launch"));
    }
  }
  ph_end(&ph);
  return TW_OK;
}

// The end of both combine_bwd forms with dots: a barrier (every rank's dots are in their
// tokens' windows), then d_topk_weights from this rank's window.
static tw_status lsa_take_dots(tw_ctx *ctx, tw_ep_layer *layer, tw_tensor *d_topk_weights, ep_phase_run *ph,
                               const char *op) {
  const tw_ep *ep = layer->ep;
  const lsa_dev &d = ((ep_impl *)ep->impl)->lsa->d;
  const layer_impl *L = (const layer_impl *)layer->impl;
  gpu_state *st = gpu_of(ctx);
  const int64_t routes = layer->tokens * ep->cfg.topk;
  char what[96];
  snprintf(what, sizeof what, "%s: LSA barrier launch", op);
  TW_TRY(lsa_step_barrier(st->stream, d, st->err_word, GPU_OP_EP_COMBINE, ph, "barrier2", what));
  if (routes) {
    lsa_take_dw<<<grid_for(ctx, routes, 256), 256, 0, st->stream>>>(d, routes, L->route_pos,
                                                                     (float *)d_topk_weights->data);
    snprintf(what, sizeof what, "%s: LSA d_w launch", op);
    GPU_TRY_CUDA(cudaGetLastError(), what);
  }
  ph_mark(ph, "take_dw");
  return TW_OK;
}

// Whether combine_bwd's push forms this rank's own routes' rows / dots (both forms, one chunk):
// from 16 (token, rank) items per SM, or as TWIN_EP_DOUT_OWN=push|rows forces (see below).
static int dout_own_in_push(int64_t T, int n, int sms) {
  const char *own = getenv("TWIN_EP_DOUT_OWN");
  return own && !strcmp(own, "push") ? 1 : own && !strcmp(own, "rows") ? 0 : T * n >= (int64_t)sms * 16;
}

// ep_nccl_lsa's combine_bwd: an entry barrier; d_out once per (token, rank) with the routes'
// weights beside it; a barrier; d_expert_out = w * d_out and the dots on the expert side, the
// dots stored into the tokens' ranks; a barrier; d_topk_weights from this rank's window. This
// rank's own routes' rows are formed by the push kernel where its (token, rank) items reach 16
// warps per SM (they then overlap the remote stores: 4096 tokens and up), else by the
// rows kernel, a warp per row (128 tokens on 2 H200s: 0.047 / 0.060 ms uniform / skewed, against
// 0.100 / 0.129 with them in the push, gpu/NOTES-routing.md session 17). TWIN_EP_DOUT_OWN=push|rows
// forces either (a per-rank choice: no other rank reads those rows).
static tw_status lsa_combine_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out, const float *w,
                                 const tw_tensor *expert_out, tw_tensor *d_expert_out, tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  const lsa_dev &d = im->lsa->d;
  gpu_state *st = gpu_of(ctx);
  cudaStream_t stream = st->stream;
  int64_t T = layer->tokens, H = ep->cfg.hidden, R = ep->cfg.recv_capacity;
  int k = ep->cfg.topk;
  const int bf16 = d_out->dtype == TW_BF16;
  const size_t ob = tw_dtype_storage_bytes(d_out->dtype, H);
  const unsigned char *dout = (const unsigned char *)d_out->data;
  const int want_dw = !tw_tensor_is_none(d_topk_weights);
  const unsigned char *y = want_dw ? (const unsigned char *)expert_out->data : NULL;
  const int ybf = want_dw && expert_out->dtype == TW_BF16;
  const size_t yb = want_dw ? tw_dtype_storage_bytes(expert_out->dtype, H) : 0;
  unsigned char *dexp = (unsigned char *)d_expert_out->data;
  const int vec = bf16 && d_expert_out->dtype == TW_BF16 && H % 8 == 0 && (uintptr_t)d_out->data % 16 == 0 &&
                  (uintptr_t)d_expert_out->data % 16 == 0 && d.crb % 16 == 0 && (!y || (ybf && (uintptr_t)y % 16 == 0));
  const int own_in_push = dout_own_in_push(T, d.n, st->num_sms);
  ep_phase_run ph;
  ph_begin(&ph, stream, "combine_bwd", T, (long long)ob);
  TW_TRY(lsa_step_barrier(stream, d, st->err_word, GPU_OP_EP_COMBINE, &ph, "barrier0",
                          "ep_combine_bwd: LSA barrier launch"));
  if (T) {
    lsa_push_dout<<<grid_for(ctx, T * d.n, 8), 256, 0, stream>>>(d, dout, ob, w, T, k, im->S, *L, bf16, H, dexp, y,
                                                                  yb, ybf, vec, push_rank_major(), own_in_push);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd: LSA push launch");
  }
  ph_mark(&ph, "push");
  TW_TRY(lsa_step_barrier(stream, d, st->err_word, GPU_OP_EP_COMBINE, &ph, "barrier",
                          "ep_combine_bwd: LSA barrier launch"));
  if (R) {
    lsa_dout_rows<<<grid_for(ctx, R, 8), 256, 0, stream>>>(d, bf16, k, H, R, L->recv_route, dexp, ob, y, yb, ybf, vec,
                                                            dout, own_in_push);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd: LSA rows launch");
  }
  ph_mark(&ph, "rows");
  if (want_dw) TW_TRY(lsa_take_dots(ctx, layer, d_topk_weights, &ph, "ep_combine_bwd"));
  ph_end(&ph);
  return TW_OK;
}

// Chunks of combine_bwd by source (lsa_dsrc_step), from the shared config and the dots request
// only (every rank asks alike), so every rank takes the same barrier count. With dots, the
// chunks put the dots of chunk c - 1 under the push of chunk c: on 2 H200s (gpu/NOTES-routing.md,
// session 20) 4096 tokens ran best at C = 4 (0.377 / 0.448 ms uniform / skewed against 0.416 /
// 0.476 at C = 1), 16384 at C = 8 (1.372 / 1.713 against 1.576 / 1.920); without dots the push
// alone is left and every C > 1 was slower (16384: 0.820 at C = 1, 0.829 / 0.850 / 0.902 at
// 2 / 4 / 8). TWIN_EP_DSRC_CHUNKS forces C (1 .. 8, at most max_tokens; the same on every rank);
// the push / write block split of the steps is rows by source's (TWIN_EP_SRC_PUSH_BLOCKS), and
// with C > 1 the own dots always go to the write role (TWIN_EP_DOUT_OWN applies at C = 1).
static int dsrc_chunks(int64_t maxT, int dots) {
  const char *e = getenv("TWIN_EP_DSRC_CHUNKS");
  int64_t c = e ? atoi(e) : !dots ? 1 : maxT >= 16384 ? 8 : maxT >= 4096 ? 4 : 1;
  if (c > EP_BACK_MAXC) c = EP_BACK_MAXC;
  if (c > maxT) c = maxT;
  if (c < 1) c = 1;
  return (int)c;
}

// ep_nccl_lsa's combine_bwd by source: an entry barrier; the steps (d_out once per (token, rank)
// into the rank's way-back slab with its source tag, own rows straight into d_src, and with one
// chunk where the items reach 16 warps per SM the own routes' dots, as combine_bwd; then the
// source rows from the slab and the other dots, stored into the tokens' ranks), a barrier after
// each push; with dots, a barrier and d_topk_weights from this rank's window. No expert-major
// rows are written.
static tw_status lsa_combine_bwd_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                           const tw_tensor *expert_out, tw_tensor *d_src, tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  const lsa_dev &d = im->lsa->d;
  gpu_state *st = gpu_of(ctx);
  cudaStream_t stream = st->stream;
  const int64_t T = layer->tokens, H = ep->cfg.hidden, R = ep->cfg.recv_capacity;
  const int k = ep->cfg.topk, want_dw = !tw_tensor_is_none(d_topk_weights);
  dsrc_args a = {};
  a.d_out = (const unsigned char *)d_out->data;
  a.y = want_dw ? (const unsigned char *)expert_out->data : NULL;
  a.d_src = (unsigned char *)d_src->data;
  a.ob = tw_dtype_storage_bytes(d_out->dtype, H);
  a.yb = want_dw ? tw_dtype_storage_bytes(expert_out->dtype, H) : 0;
  a.T = T; a.H = H; a.R = R; a.S = im->S; a.k = k;
  a.bf16 = d_out->dtype == TW_BF16;
  a.y_bf16 = want_dw && expert_out->dtype == TW_BF16;
  a.vec = a.bf16 && H % 8 == 0 && (uintptr_t)d_out->data % 16 == 0 && d.crb % 16 == 0 &&
          (!a.y || (a.y_bf16 && (uintptr_t)a.y % 16 == 0));
  a.rank_major = push_rank_major();
  a.recv_route = L->recv_route;
  const int C = dsrc_chunks(d.maxT, want_dw);
  a.cs = (d.maxT + C - 1) / C;
  a.own_in_push = C > 1 ? 0 : dout_own_in_push(T, d.n, st->num_sms);  // C > 1: the lists hold own routes too
  ep_phase_run ph;
  ph_begin(&ph, stream, "combine_bwd_by_source", T, (long long)a.ob);
  int P = 0, W = 0;
  if (C > 1) {  // the other ranks' routes by chunk of their token (the way back's lists)
    src_step_blocks(st->num_sms, &P, &W);
    GPU_TRY_CUDA(cudaMemsetAsync(L->back_n, 0, sizeof(int32_t) * EP_BACK_MAXC, stream),
                 "ep_combine_bwd_by_source: LSA chunk lists");
    if (R) {
      lsa_back_bucket<<<grid_for(ctx, R, 256), 256, 0, stream>>>(d, R, k, L->recv_route, a.cs, L->back_list, L->back_n,
                                                                  1);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd_by_source: LSA chunk lists launch");
    }
    ph_mark(&ph, "lists");
  }
  TW_TRY(lsa_step_barrier(stream, d, st->err_word, GPU_OP_EP_COMBINE, &ph, "barrier0",
                          "ep_combine_bwd_by_source: LSA barrier launch"));
  for (int c = 0; c <= C; c++) {
    const int grid = c == 0 ? grid_for(ctx, T * d.n, 8)
                     : c == C ? grid_for(ctx, (int64_t)d.n * a.cs + (a.y ? (C == 1 ? R : R / C + 1) : 0), 8)
                              : P + W;
    const int32_t *list = C > 1 && c > 0 ? L->back_list + (int64_t)(c - 1) * R : NULL;
    const int32_t *nlist = list ? L->back_n + (c - 1) : NULL;
    if (c == 0 && T > 0 && grid > 0) lsa_dsrc_push<<<grid, 256, 0, stream>>>(d, a, *L, c);
    else if (c == C && grid > 0) lsa_dsrc_write<<<grid, 256, 0, stream>>>(d, a, c, C, list, nlist);
    else if (c > 0 && c < C) lsa_dsrc_step<<<grid, 256, 0, stream>>>(d, a, *L, c, C, P, list, nlist);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd_by_source: LSA step launch");
    ph_mark(&ph, c == 0 ? "push" : c == C ? "rows" : "push+rows");
    if (c < C)
      TW_TRY(lsa_step_barrier(stream, d, st->err_word, GPU_OP_EP_COMBINE, &ph, "barrier",
                              "ep_combine_bwd_by_source: LSA barrier launch"));
  }
  if (want_dw) TW_TRY(lsa_take_dots(ctx, layer, d_topk_weights, &ph, "ep_combine_bwd_by_source"));
  ph_end(&ph);
  return TW_OK;
}

static tw_status gpu_ep_combine(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *expert_out,
                                const tw_tensor *topk_weights, tw_tensor *out) {
  if (((ep_impl *)layer->ep->impl)->lsa)
    return lsa_back(ctx, layer, expert_out, tw_tensor_is_none(topk_weights) ? NULL : (const float *)topk_weights->data,
                    1, out, NULL, NULL, GPU_OP_EP_COMBINE);
  row_src src;
  TW_TRY(rows_for_sum(ctx, layer, expert_out, NULL, &src));
  const tw_ep *ep = layer->ep;
  layer_impl *L = (layer_impl *)layer->impl;
  int64_t T = layer->tokens, H = ep->cfg.hidden;
  if (T == 0 || H == 0) return TW_OK;
  ep_sum_routes<<<grid_for(ctx, T, 1), sum_threads(H), 0, gpu_of(ctx)->stream>>>(
      src.base, src.rb, src.slot_off, expert_out->dtype == TW_BF16, T, ep->cfg.topk, H, L->route_pos,
      tw_tensor_is_none(topk_weights) ? NULL : (const float *)topk_weights->data, 1, out->data,
      out->dtype == TW_BF16, NULL, src.slot_row, NULL, sum_vec_ok(src.base, src.rb, expert_out->dtype, out, H));
  GPU_TRY_CUDA(cudaGetLastError(), "ep_combine: launch");
  return TW_OK;
}

static tw_status gpu_ep_dispatch_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_recv,
                                     const tw_tensor *d_recv_weights, tw_tensor *d_tokens,
                                     tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = (layer_impl *)layer->impl;
  const float *per_slot = d_recv_weights && !tw_tensor_is_none(d_recv_weights) ? (const float *)d_recv_weights->data : NULL;
  if (((ep_impl *)ep->impl)->lsa && !L->slot_row)  // one rank keeps the direct path
    return lsa_back(ctx, layer, d_recv, NULL, 0, d_tokens,
                    tw_tensor_is_none(d_topk_weights) ? NULL : (float *)d_topk_weights->data, per_slot,
                    GPU_OP_EP_DISPATCH);
  row_src src;
  TW_TRY(rows_for_sum(ctx, layer, d_recv, d_recv_weights, &src));
  int64_t T = layer->tokens, H = ep->cfg.hidden;
  if (T == 0) return TW_OK;
  ep_sum_routes<<<grid_for(ctx, T, 1), sum_threads(H > 0 ? H : 1), 0, gpu_of(ctx)->stream>>>(
      src.base, src.rb, src.slot_off, d_recv->dtype == TW_BF16, T, ep->cfg.topk, H, L->route_pos, NULL, 0, d_tokens->data,
      d_tokens->dtype == TW_BF16, tw_tensor_is_none(d_topk_weights) ? NULL : (float *)d_topk_weights->data,
      src.slot_row, per_slot, sum_vec_ok(src.base, src.rb, d_recv->dtype, d_tokens, H));
  GPU_TRY_CUDA(cudaGetLastError(), "ep_dispatch_bwd: launch");
  return TW_OK;
}

// combine_bwd's d_topk_weights on ep_nccl_slots (both forms): one rank reads expert_out in place
// through slot_row; otherwise its rows come back to the sources (rows_back) and each route's dot
// with its token's d_out row is taken there.
static tw_status slots_dots(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out, const tw_tensor *expert_out,
                            tw_tensor *d_topk_weights, const char *op) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  const int64_t T = layer->tokens, H = ep->cfg.hidden;
  const int k = ep->cfg.topk, bf16 = d_out->dtype == TW_BF16, ebf = !tw_tensor_is_none(expert_out) && expert_out->dtype == TW_BF16;
  if (tw_tensor_is_none(d_topk_weights)) return TW_OK;
  const unsigned char *base = (const unsigned char *)expert_out->data;
  size_t rbe = tw_dtype_storage_bytes(expert_out->dtype, H);
  if (!L->slot_row) {
    TW_TRY(rows_back(ctx, layer, expert_out, NULL));
    base = im->send;
    rbe = step_rb_back(ep, expert_out->dtype);  // rows_back's stride
  }
  if (!(T * k)) return TW_OK;
  ep_dot_routes<<<grid_for(ctx, T * k, 8), 256, 0, gpu_of(ctx)->stream>>>(
      base, rbe, ebf, d_out->data, bf16, T * k, k, H, L->route_pos, (float *)d_topk_weights->data, L->slot_row,
      dot_vec_ok(base, rbe, ebf, d_out->data, bf16, H));
  GPU_TRY_CUDA(cudaGetLastError(), op);
  return TW_OK;
}

static tw_status gpu_ep_combine_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                    const tw_tensor *topk_weights, const tw_tensor *expert_out,
                                    tw_tensor *d_expert_out, tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  cudaStream_t stream = gpu_of(ctx)->stream;
  int64_t T = layer->tokens, H = ep->cfg.hidden, R = ep->cfg.recv_capacity;
  int k = ep->cfg.topk;
  int bf16 = d_out->dtype == TW_BF16;
  const float *w = tw_tensor_is_none(topk_weights) ? NULL : (const float *)topk_weights->data;
  if (im->lsa && !L->slot_row) return lsa_combine_bwd(ctx, layer, d_out, w, expert_out, d_expert_out, d_topk_weights);
  if (L->slot_row) {  // one rank: the destination rows straight from d_out, the dots from expert_out
    if (R) {
      ep_dout_direct<<<grid_for(ctx, R, 1), sum_threads(H > 0 ? H : 1), 0, stream>>>(
          d_out->data, bf16, w, k, H, R, *L, (unsigned char *)d_expert_out->data,
          tw_dtype_storage_bytes(d_expert_out->dtype, H),
          bf16 && d_expert_out->dtype == TW_BF16 && H % 8 == 0 && (uintptr_t)d_out->data % 16 == 0 &&
              (uintptr_t)d_expert_out->data % 16 == 0);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd: direct launch");
    }
    return slots_dots(ctx, layer, d_out, expert_out, d_topk_weights, "ep_combine_bwd: dot launch");
  }
  // rows of d_out's dtype go out, d_expert_out's row bytes are read back: the stride covers both
  const size_t dob = tw_dtype_storage_bytes(d_out->dtype, H), deb = tw_dtype_storage_bytes(d_expert_out->dtype, H);
  const size_t rbd = round16(dob > deb ? dob : deb);
  if (T * k) {
    ep_pack_dout<<<grid_for(ctx, T * k, 1), sum_threads(H > 0 ? H : 1), 0, stream>>>(
        d_out->data, bf16, w, T * k, k, H, L->route_pos, im->send, rbd);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd: pack launch");
  }
  TW_TRY(exchange(ctx, ep, 1, rbd));
  if (R) {
    ep_unpack_rows<<<grid_for(ctx, R, 8), 256, 0, stream>>>(im->recv, rbd, R, L->recv_src,
                                                            (unsigned char *)d_expert_out->data,
                                                            tw_dtype_storage_bytes(d_expert_out->dtype, H));
    GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd: unpack launch");
  }
  return slots_dots(ctx, layer, d_out, expert_out, d_topk_weights, "ep_combine_bwd: dot launch");
}

// ep_nccl_slots' combine_bwd by source: every kept route's d_out row with its source word to the
// route's rank, then the first route of each (source, token) there writes d_src's row (one
// rank: straight from d_out); zeros first. The dots as combine_bwd's.
static tw_status gpu_ep_combine_bwd_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                              const tw_tensor *expert_out, tw_tensor *d_src,
                                              tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  ep_impl *im = (ep_impl *)ep->impl;
  layer_impl *L = (layer_impl *)layer->impl;
  if (im->lsa && !L->slot_row) return lsa_combine_bwd_by_source(ctx, layer, d_out, expert_out, d_src, d_topk_weights);
  cudaStream_t stream = gpu_of(ctx)->stream;
  const int64_t T = layer->tokens, H = ep->cfg.hidden, R = ep->cfg.recv_capacity, maxT = ep->cfg.max_tokens;
  const int k = ep->cfg.topk;
  const size_t ob = tw_dtype_storage_bytes(d_out->dtype, H), rb = step_rb_back(ep, d_out->dtype);  // row + word
  const size_t zb = (size_t)ep->ep_size * (size_t)maxT * ob;
  const unsigned char *dout = (const unsigned char *)d_out->data;
  if (!L->slot_row) {
    if (T * k) {
      ep_pack_dout_src<<<grid_for(ctx, T * k, 8), 256, 0, stream>>>(dout, ob, T * k, k, L->route_pos, im->S, im->send,
                                                                      rb);
      GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd_by_source: pack launch");
    }
    TW_TRY(exchange(ctx, ep, 1, rb));
  }
  // every row, also after a step whose dispatch failed on the device (its routes are gone: all
  // zeros, as ep_nccl_lsa and combine_bwd write)
  if (zb)
    GPU_TRY_CUDA(cudaMemsetAsync(d_src->data, 0, zb, stream), "ep_combine_bwd_by_source: zero d_src");
  if (R) {
    ep_unpack_dout_src<<<grid_for(ctx, R, 8), 256, 0, stream>>>(im->recv, rb, R, maxT, k, im->S, *L,
                                                                 L->slot_row != NULL, dout, ob,
                                                                 (unsigned char *)d_src->data);
    GPU_TRY_CUDA(cudaGetLastError(), "ep_combine_bwd_by_source: unpack launch");
  }
  return slots_dots(ctx, layer, d_out, expert_out, d_topk_weights, "ep_combine_bwd_by_source: dot launch");
}

}  // namespace

extern "C" const tw_ep_backend gpu_ep = {
    gpu_ep_create,    gpu_ep_destroy,  gpu_ep_layer_create, gpu_ep_layer_destroy,
    gpu_ep_dispatch,  gpu_ep_dispatch_by_source, gpu_ep_combine,  gpu_ep_dispatch_bwd, gpu_ep_combine_bwd,
    gpu_ep_combine_bwd_by_source,
};
