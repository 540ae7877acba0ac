// gpu/grouped_gemm_wgmma_fp8.cu — kernel version 5 of the grouped GEMM (gg_wgmma_fp8): Hopper
// (sm_90a) fp8 forward, ragged M from device group sizes, on fp8 wgmma (SASS QGMMA).
//
//   C[o_g + i, :] = sum over k-blocks b of 128:  P_b[i, :] * f_b      (i < m_g)
//   P_b = lhs[o_g + i, 128b..128b+127] @ rhs[g]^T over that block, in the tensor core
//
// Accumulation model (tw_gemm.h, "gg_wgmma_fp8"): the tensor core sums the (exact) fp8 x fp8
// products of one 128-deep k-block into a fresh accumulator (Hopper's fp8 wgmma keeps about 14
// significant bits there); the block's partial is then promoted into an f32 total in
// registers, every 128 along K, for every scaling mode:
//   BLOCK_1x128 / BLOCK_128x128:  total = fmaf(partial, sa * sb, total)  (gg_mma's promotion,
//                                 the scales of that k-block for the row and the column)
//   TENSOR_*:                     total = total + partial; out = total * (sa[g] * sb[g])
//                                 (the per-tensor epilogue of gg_mma / gg_mma_wide)
//   MXFP8_1D:                     every 32 along K instead: each 32-deep scaling block is one
//                                 wgmma k32 into fresh registers, then total = fmaf(partial,
//                                 sa * sb, total) with its E8M0 scales decoded to f32 (as
//                                 gg_scale_at decodes them; gg_mma_wide's promotion)
// Design (written for twin, after gg_wgmma; no library code):
//   - CTA tile 128 x 128 x 128 (k-block = one scaling block), 384 threads: warpgroup 0
//     produces (thread 0 issues the TMA loads), warpgroups 1 and 2 consume, each owning 64
//     rows x 128 columns: 64 partial + 64 total f32 registers per thread. setmaxnreg 40 / 232.
//     N = 128 because the promotion needs two accumulator sets. 128 x 192 tiles (BN = 192: 96 +
//     96 registers, wgmma m64n192k32, 40 KiB stages; per-tensor (CL = 1 or 2) and TMA block
//     scales (CL = 1); the same bits as 128): the default for per-tensor, 1x128 x 1x128 and
//     1x128 x 128x128 where N pads little (ggf_default_bn: +2..12.5% on H200), 128 for
//     128x128 x 128x128 (not timed); knob
//     TWIN_GG_WGMMA_FP8_BN=128|192, gpu/NOTES-gemm.md "128 x 192 tiles".
//   - Ring of 32 KiB stages (A 128x128, B 128x128 fp8, both K-major, 128-byte swizzle; 5
//     stages with a bf16/f16 out, 6 with f32 out, which has no staging buffer) plus 1280 bytes
//     of scales per stage; "full" mbarrier (TMA bytes, + the scale warp's 32 arrivals when
//     warps stage the scales), "empty" mbarrier (one arrival per consumer warp).
//   - Block scales (SC, see ggf_kernel) reach the stage by TMA with the data, onto the same
//     full barrier (no latency chain): a 1x128 k-block's 128 row (or column) scales are 128
//     consecutive f32 of one scale row, a 128x128 tile's scale one f32. A tiled TMA box must
//     start 16-byte aligned in its innermost dimension (else cudaErrorIllegalInstruction, run
//     f3/f4: group offsets o_g are arbitrary), so the box starts at the coordinate rounded down
//     to a multiple of 4 (132 floats for 128 scales, 4 for one) and the consumers read from
//     the remainder on. Scale tensors TMA cannot map (row length not a multiple of 4 floats,
//     base not 16-byte aligned), and 1x128 rowwise rhs scales with N odd (the consumers read
//     column scales in 8-byte pairs), fall back to producer warps 1-3 staging them.
//   - wgmma m64n128k32 (e4m3/e5m2 x e4m3/e5m2 -> f32), 4 per k-block; fp8 wgmma takes both
//     operands K-major from shared memory only, so rhs must be [G, N, K] (rhs_op T).
//   - Persistent CTAs over 128-row x 128-column tiles: tile t is row tile t / tilesQ of the
//     global 128-row tile space (gpu_group_prefix's T(g)), column tile t % tilesQ (knob
//     TWIN_GG_TILE_ORDER=m, CL = 1: a group's row tiles first instead); the group
//     by binary search over T(g). No extra prefix kernel, nothing read back: capturable.
//   - Epilogue (bf16/f16 out, no accumulate, N % 8 == 0, 16-byte aligned out): a warpgroup
//     whose 64 rows all lie in the group writes them to shared memory (two 64 x 64 boxes,
//     128-byte swizzle) and one thread stores them by TMA, which drains while the next tile
//     runs; other tiles (group edges), f32 out and accumulate store from registers with masks.
//   - Ragged edges as gg_wgmma: rows past the group are computed from the next group's rows
//     (or TMA zero fill past M) and never stored; the K tail and N tail come back as zeros.
//   - Block scales: the two consumer warpgroups take turns issuing their k-block's wgmmas
//     (named barriers 3 and 4), so one promotes while the tensor cores run the other's k-block.
// Measurement knobs (read on every call): TWIN_GG_WGMMA_FP8_SCALES=warps stages block scales
// by warps 1-3 as before the TMA path; TWIN_GG_WGMMA_FP8_EPI=regs stores every tile from
// registers; TWIN_GG_WGMMA_FP8_ORDER=0|1|2 no turns / gate opened at issue / at completion
// (default 0 per-tensor and MXFP8, 1 block scales); TWIN_GG_WGMMA_FP8_CLUSTER=2 runs clusters of
// two CTAs sharing the lhs tile by multicast (CL = 2, even tilesQ; no consistent gain measured,
// gpu/NOTES-gemm.md runs cl1/cl2; BN = 128 then); TWIN_GG_WGMMA_FP8_BN=128|192 forces the column
// tile (see ggf_default_bn). Same bits.
//   - MXFP8 (kernel kind GGF_SC_MX): the k-block of 128 holds 4 scaling blocks; per block one
//     wgmma k32 (scale_d 0: fresh partial), wait, promote; the two consumers run free by
//     default (turns per block, knob ORDER=1, measured 1.5-5% slower, run mx2). Producer warps 1-3 read
//     the k-block's scale bytes (one 32-bit word per row / column: compact or swizzled order)
//     and store them decoded to f32 in a 4 KiB scale slot per stage (lhs [4][128], rhs
//     [4][128]); the consumers read them as the 1x128 path does (ggf_promote). Blocks wholly
//     past K are skipped, so padding scale bytes are never used.
//   - MXFP8 rhs given as the colwise data of its [G*K, N] source with rhs_op N (the MoE block's
//     fp8_mxfp8 weights): a transposing pad pass (ggf_pad_mxt, before the host side) writes the
//     K-major copy [G, N, K] and its scales into the context's pad buffer, then the kernel above
//     runs unchanged: bit-identical to the call with the rowwise operand of the transposed source.
//     Cost: G*K*N bytes read and written per call (not cached across calls).
// Declines (forced: TW_ERR_UNSUPPORTED naming it; auto falls back to gg_mma_wide / gg_mma):
// plain operands, MXFP8 mixed with another mode, an MXFP8 rhs other than the rowwise data of its
// [G*N, K] source (op T) or the colwise data of its [G*K, N] source (op N), MXFP8 scale_inv not
// 4-byte aligned, rhs_op N (other modes), K not a multiple of 16 (TMA row strides), K = 0,
// unaligned bases (rhs data excepted for the MXFP8 colwise rhs), a device other than sm_90, sizes
// past int32 TMA coordinates.
// The wgrad is gpu/grouped_gemm_wgmma_fp8_wgrad.cu; both share gpu/grouped_gemm_wgmma_fp8.cuh
// (its GGF_STAGES / GGF_SMEM are the wgrad's ring; the forward's are GGF_F* below).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/grouped_gemm_wgmma_fp8.cuh"

// Forward layout (the .cuh's GGF_STAGES / GGF_SMEM size the wgrad's ring, not this one).
// BN (kernel template): the CTA tile's columns, 128 or 192 (knob TWIN_GG_WGMMA_FP8_BN, see the
// host side); a stage holds A 128 x 128 and B BN x 128 fp8.
// Per stage, scales: lhs slot at float 0, rhs slot at float GGF_SSLOT(BN) (640 / 896 bytes: the
// slots stay 128-byte aligned for the TMA); a TMA box fills 132 (BN = 192: 196) floats of a slot,
// or 4 (128x128 rhs at BN = 192: 4 x 2, the tile's two 128-column scale blocks).
#define GGF_SSLOT(BN) ((BN) == 128 ? 160 : 224)
#define GGF_SSTAGE(BN) (2 * GGF_SSLOT(BN))
#define GGF_EPI_BYTES(BN) (2 * ((BN) / 64) * 64 * 64 * 2)  // per consumer warpgroup BN/64 64 x 64 16-bit boxes
#define GGF_FB_BYTES(BN) ((BN) * GGF_BK)
#define GGF_FSTAGE_BYTES(BN) (GGF_A_BYTES + GGF_FB_BYTES(BN))
// Stages: a bf16/f16 out gives 32 KiB to the epilogue staging; f32 out keeps 6. BN = 192 (40 KiB
// stages, 48 KiB of staging): 4, f32 out 5 (the same 160 / 200 KiB in flight as BN = 128).
#define GGF_FSTAGES(OUT, BN) ((BN) == 128 ? ((OUT) == TW_F32 ? 6 : 5) : ((OUT) == TW_F32 ? 5 : 4))
// ring + 1 KiB to align the base to the 1024-byte swizzle atom + staging + scales + barriers
#define GGF_FSMEM(SC, OUT, BN)                                                                               \
  (GGF_FSTAGES(OUT, BN) * GGF_FSTAGE_BYTES(BN) + 1024 + ((OUT) == TW_F32 ? 0 : GGF_EPI_BYTES(BN)) +          \
   GGF_FSTAGES(OUT, BN) * GGF_SST(SC, BN) * 4 + 2 * GGF_FSTAGES(OUT, BN) * 8)

// How block scales reach the stage (kernel template SC): none (per-tensor); producer warps 1-3
// from registers (any layout); TMA with per-column rhs scales (1x128 rhs); TMA with one rhs
// scale per tile (128x128 rhs). lhs (1x128 or 128x128) goes by TMA in both TMA kinds.
// MXFP8 (GGF_SC_MX): producer warps 1-3 read each k-block's E8M0 bytes (both tw_quantize.h byte
// orders, compact and swizzled) and write them decoded to f32 into a larger scale slot.
enum { GGF_SC_TENSOR = 0, GGF_SC_WARPS = 1, GGF_SC_TMA_V = 2, GGF_SC_TMA_S = 3, GGF_SC_MX = 4 };
// The forward's scale mode for MXFP8 operands (the .cuh's ggf_mode_of leaves it out; the wgrad
// maps MXFP8 in its own file).
#define GGF_MX 3
// An MXFP8 stage's scales: lhs [4 sub-blocks of 32 along K][128 rows], rhs [4][128 columns], f32.
#define GGF_MXSTAGE (2 * 4 * 128)
#define GGF_SST(SC, BN) ((SC) == GGF_SC_MX ? GGF_MXSTAGE : GGF_SSTAGE(BN))
// 227 KiB of dynamic shared memory per block on sm_90 (the largest configurations)
static_assert(GGF_FSMEM(GGF_SC_TMA_V, TW_BF16, 192) <= 232448 && GGF_FSMEM(GGF_SC_TMA_V, TW_F32, 192) <= 232448 &&
                  GGF_FSMEM(GGF_SC_MX, TW_F32, 128) <= 232448 && GGF_FSMEM(GGF_SC_TMA_V, TW_BF16, 128) <= 232448,
              "gg_wgmma_fp8 forward: shared memory past 227 KiB");
static inline int ggf_fwd_mode_of(int m) { return m == TW_SCALE_MXFP8_1D ? GGF_MX : ggf_mode_of(m); }

struct ggf_params {
  const int64_t *offsets;  // device [G+1] row offsets (gpu_group_prefix)
  const int64_t *tiles;    // device [G+1] 128-row tile offsets T(g) (gpu_group_prefix)
  void *out;
  int64_t N, K, G, tilesQ;
  int accumulate;
  int mode;                // GGF_* of lhs (both GGF_TENSOR, or both block modes)
  int mode_b;              // GGF_* of rhs: 1x128 lhs with 128x128 rhs is DeepSeek-V3's pairing
  const float *sa, *sb;    // scale_inv of lhs and rhs (tw_quantize.h layouts)
  int64_t lda_s, ldb_s;    // their last dimension
  int b_transposed;        // rhs is the per-group transposed (colwise) copy of a [G*K, N] source
  int tma_out;             // bf16/f16 out, no accumulate, N % 8 == 0: interior tiles leave by TMA store
  int scale_tx;            // TMA scale kinds: bytes of the two scale boxes per k-block
  int order;               // consumer turns (see the kernel): 0 none, 1 gate opened at issue, 2 at completion
  int a_sw, b_sw;          // MXFP8: scale bytes in the swizzled (1) or compact (0) order
  int m_first;             // tiles of a group walk its row tiles first (1; CTAs of one pass, CL = 1 only)
};


#ifdef WGC_DEVICE
// Tile id -> group g, row start p0 (within the group), column start q0. 32-bit division (the
// host declines problems with 2^31 tiles or more): a 64-bit one is a call whose saved registers
// spilled the accumulators.
template <int BN>
__device__ __forceinline__ void ggf_locate(const ggf_params &p, int t, int64_t &g, int64_t &p0, int64_t &q0) {
  const int tq = (int)p.tilesQ, tp = t / tq;
  int64_t lo = 0, hi = p.G - 1;
  while (lo < hi) {  // last g with T(g) <= tp: the non-empty group holding row tile tp
    int64_t mid = (lo + hi + 1) >> 1;
    if (p.tiles[mid] <= tp) lo = mid;
    else hi = mid - 1;
  }
  g = lo;
  if (p.m_first) {  // group g's tiles column by column: the row tiles sharing an rhs tile adjacent
    const int rg = (int)(p.tiles[g + 1] - p.tiles[g]), l = t - (int)p.tiles[g] * tq;
    p0 = (int64_t)(l % rg) * GGF_BM;
    q0 = (int64_t)(l / rg) * BN;
    return;
  }
  p0 = (int64_t)(tp - (int)p.tiles[g]) * GGF_BM;
  q0 = (int64_t)(t - tp * tq) * BN;
}

// Where the scales of one tile start (k-block 0, this lane's first row / column) and how they
// advance: per k-block (k) and per 32 rows / columns (r; 0 for 128x128 tiles, whose 128 rows or
// columns share one scale because tiles start on 128-row bounds of the group). The
// tw_quantize.h layouts, as gg_scale_at (grouped_gemm_kernel.cu) reads them:
//   lhs (rowwise [M, K] source, group rows from o_g, tiles from T(g)):
//     1x128 [kb][o_g + row];  128x128 [T(g) + row/128][kb]
//   rhs rowwise of the [G*N, K] source (uniform groups: source row g*N + n, T = g*ceil(N/128)):
//     1x128 [kb][g*N + n];  128x128 [g*ceil(N/128) + n/128][kb]
//   rhs colwise copy of the [G*K, N] source (source row g*K + k, T = g*ceil(K/128)):
//     1x128 [g*ceil(K/128) + kb][n];  128x128 [n/128][g*ceil(K/128) + kb]
struct ggf_sptr {
  const float *a, *b;
  int64_t ak, bk;
  int ar, br;
};
__device__ __forceinline__ ggf_sptr ggf_scale_ptrs(const ggf_params &p, int64_t g, int64_t og, int64_t tg, int64_t p0,
                                                   int64_t q0, int lane) {
  ggf_sptr r;
  const int64_t ktn = (p.K + 127) / 128, ntn = (p.N + 127) / 128;
  if (p.mode == GGF_B1x128) r.a = p.sa + og + p0 + lane, r.ak = p.lda_s, r.ar = 32;
  else r.a = p.sa + (tg + p0 / 128) * p.lda_s, r.ak = 1, r.ar = 0;
  if (p.mode_b == GGF_B1x128) {
    if (!p.b_transposed) r.b = p.sb + g * p.N + q0 + lane, r.bk = p.ldb_s, r.br = 32;
    else r.b = p.sb + g * ktn * p.ldb_s + q0 + lane, r.bk = p.ldb_s, r.br = 32;
  } else {
    if (!p.b_transposed) r.b = p.sb + (g * ntn + q0 / 128) * p.ldb_s, r.bk = 1, r.br = 0;
    else r.b = p.sb + (q0 / 128) * p.ldb_s + g * ktn, r.bk = 1, r.br = 0;
  }
  return r;
}

// The same layouts as TMA coordinates of a 2-D scale map (inner = the row of scale_inv's last
// dimension, outer = its row) for k-block kt: inner i0 + ik * kt, outer o0 + ok * kt. The box
// starts at inner & ~3 (16-byte aligned: TMA faults on an unaligned innermost start) and the
// wanted scale sits at (inner & 3) floats into the slot.
struct ggf_scoord {
  int i0, ik, o0, ok;
};
__device__ __forceinline__ void ggf_scale_coords(const ggf_params &p, int64_t g, int64_t og, int64_t tg, int64_t p0,
                                                 int64_t q0, ggf_scoord &a, ggf_scoord &b) {
  const int ktn = (int)((p.K + 127) / 128), ntn = (int)((p.N + 127) / 128);
  if (p.mode == GGF_B1x128) a = {(int)(og + p0), 0, 0, 1};        // [kb][o_g + row]
  else a = {0, 1, (int)(tg + p0 / 128), 0};                       // [T(g) + row/128][kb]
  if (p.mode_b == GGF_B1x128) {
    if (!p.b_transposed) b = {(int)(g * p.N + q0), 0, 0, 1};      // [kb][g*N + n]
    else b = {(int)q0, 0, (int)g * ktn, 1};                       // [g*ktn + kb][n]
  } else {
    if (!p.b_transposed) b = {0, 1, (int)g * ntn + (int)(q0 / 128), 0};  // [g*ntn + n/128][kb]
    else b = {(int)g * ktn, 1, (int)(q0 / 128), 0};                      // [n/128][g*ktn + kb]
  }
}

// TMA store of a 2-D box from shared memory (bulk group), its commit and waits; the fence that
// orders this thread's generic shared-memory writes before the async proxy reads them; a named
// barrier over `threads` threads (ids 1, 2: one per consumer warpgroup).
__device__ __forceinline__ void ggf_tma_store_2d(const CUtensorMap *map, const void *src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"((uint64_t)map),
               "r"(wgc_smem(src)), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void ggf_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ggf_bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void ggf_bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void ggf_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The promotion of a tile whose first JS 8-column groups take the first 128-column rhs scale block
// (products s00 / s10 for this thread's two rows) and the rest the second (s01 / s11): the same
// fmaf per element as BN = 128's single-block promotion.
template <int NJ, int JS>
__device__ __forceinline__ void ggf_promote_split(const float *d, float *tot, float s00, float s10, float s01,
                                                  float s11) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const float s0 = j < JS ? s00 : s01, s1 = j < JS ? s10 : s11;
    tot[4 * j + 0] = fmaf(d[4 * j + 0], s0, tot[4 * j + 0]);
    tot[4 * j + 1] = fmaf(d[4 * j + 1], s0, tot[4 * j + 1]);
    tot[4 * j + 2] = fmaf(d[4 * j + 2], s1, tot[4 * j + 2]);
    tot[4 * j + 3] = fmaf(d[4 * j + 3], s1, tot[4 * j + 3]);
  }
}
// A consumer warp releases a stage: in every CTA of the cluster (each one's producer writes it).
template <int CL>
__device__ __forceinline__ void ggf_release(uint64_t *empty) {
  if (CL == 1) wgc_bar_arrive(empty);
  else
    for (int r = 0; r < CL; ++r) wgc_bar_arrive_at(empty, (uint32_t)r);
}
// E8M0 scale byte -> f32 as gg_scale_at (grouped_gemm_kernel.cu) decodes it: 2^(e-127), 0 gives
// 2^-127 (subnormal), 0xFF NaN.
__device__ __forceinline__ float ggf_e8m0(uint32_t e) {
  return e == 255u ? __int_as_float(0x7fc00000) : e == 0u ? __int_as_float(0x00400000) : __int_as_float((int)(e << 23));
}

#endif  // WGC_DEVICE

// SC: scale path (GGF_SC_*). AT, BT: fp8 types (0 e4m3, 1 e5m2). OUT: output tw_dtype. CL: CTAs
// per cluster (1 by default; 2 on request, see the host side: a pair takes column tiles 2u and
// 2u + 1 of one row tile, tilesQ even; each CTA
// loads 64 of the tile's 128 lhs rows and multicasts them to both, so lhs traffic out of L2
// halves; a stage is free once the consumers of both CTAs released it).
template <int SC, int AT, int BT, int OUT, int CL, int BN>
__global__ void __launch_bounds__(GGF_THREADS, 1)
    ggf_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_sa, const __grid_constant__ CUtensorMap map_sb,
               const __grid_constant__ CUtensorMap map_out, const ggf_params p) {
#ifdef WGC_DEVICE
  constexpr bool BL = SC != GGF_SC_TENSOR, STMA = SC == GGF_SC_TMA_V || SC == GGF_SC_TMA_S, MX = SC == GGF_SC_MX;
  static_assert(BN == 128 || (BN == 192 && (SC == GGF_SC_TENSOR || (CL == 1 && STMA))),
                "BN 192: per-tensor (CL 1 or 2) or TMA block scales (CL 1)");
  constexpr int ST = GGF_FSTAGES(OUT, BN), SST = GGF_SST(SC, BN), SSLOT = GGF_SSLOT(BN);
  constexpr int STAGE = GGF_FSTAGE_BYTES(BN), NA = BN / 2, NJ = BN / 8;  // accumulators, 8-column groups
  constexpr bool EPI = OUT != TW_F32;  // a staging buffer for the TMA-store epilogue
  extern __shared__ __align__(1024) unsigned char ggf_raw[];
  unsigned char *base = ggf_raw + ((1024 - (wgc_smem(ggf_raw) & 1023)) & 1023);
  unsigned char *epi = base + ST * STAGE;                         // [warpgroup][BN/64 boxes of 64 x 64]
  float *scales = (float *)(epi + (EPI ? GGF_EPI_BYTES(BN) : 0));  // [stage][lhs slot, rhs slot]
  uint64_t *full = (uint64_t *)(scales + ST * SST);
  uint64_t *empty = full + ST;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < ST; ++s) {
      wgc_bar_init(&full[s], SC == GGF_SC_WARPS || MX ? 1 + 32 : 1);  // TMA thread (+ bytes), scale warp
      wgc_bar_init(&empty[s], 8 * CL);                          // one arrival per consumer warp of each CTA
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (CL > 1) wgc_cluster_sync();  // the peer's barriers exist before any multicast or remote arrive
  else __syncthreads();
  // CL = 2: blockIdx.x = 2 * cluster + rank and gridDim.x is even, so the pair walks tiles 2u and
  // 2u + 1 together; tilesQ is even, so both lie in one row tile (same group, same lhs rows).
  const int total = (int)(p.tiles[p.G] * p.tilesQ);
  const int ktiles = (int)((p.K + GGF_BK - 1) / GGF_BK);

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      // ---- producer: TMA loads ---------------------------------------------------------
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_a) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
      if (STMA) {
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_sa) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_sb) : "memory");
      }
      int s = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int64_t g, p0, q0;
        ggf_locate<BN>(p, t, g, p0, q0);
        const int64_t og = p.offsets[g];
        const int row0 = (int)(og + p0);
        ggf_scoord ca, cb;
        if (STMA) ggf_scale_coords(p, g, og, p.tiles[g], p0, q0, ca, cb);
        for (int kt = 0; kt < ktiles; ++kt) {
          wgc_bar_wait(&empty[s], phase ^ 1);
          unsigned char *sa = base + s * STAGE, *sb = sa + GGF_A_BYTES;
          wgc_bar_expect(&full[s], STAGE + (STMA ? p.scale_tx : 0));
          if (CL == 1) wgc_tma_2d(sa, &map_a, &full[s], kt * GGF_BK, row0);
          else  // this CTA's 64 of the 128 lhs rows (map_a's box is 64 rows), to both CTAs
            wgc_tma_2d_mc(sa + (t & 1) * (64 * GGF_BK), &map_a, &full[s], kt * GGF_BK, row0 + 64 * (t & 1), (uint16_t)3);
          wgc_tma_3d(sb, &map_b, &full[s], kt * GGF_BK, (int)q0, (int)g);
          if (STMA) {
            float *f = scales + s * SST;
            wgc_tma_2d(f, &map_sa, &full[s], (ca.i0 + ca.ik * kt) & ~3, ca.o0 + ca.ok * kt);
            wgc_tma_2d(f + SSLOT, &map_sb, &full[s], (cb.i0 + cb.ik * kt) & ~3, cb.o0 + cb.ok * kt);
          }
          if (++s == ST) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    } else if (SC == GGF_SC_WARPS && tid >= 32) {
      // ---- producer: the k-block's scales into the stage (layouts TMA cannot map) ----------
      // Warps 1-3 take every third k-block (in the order all warps walk), so three scale loads are in
      // flight at once. One warp alone spent a
      // global-load latency per k-block in series: 0.46-0.64x the per-tensor rate (run f1).
      const int w = tid / 32 - 1, lane = tid % 32;
      int s = 0, turn = 0;  // stage and whose turn (0..2) of the global k-block count
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int64_t g, p0, q0;
        ggf_locate<BN>(p, t, g, p0, q0);
        const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
        const ggf_sptr sp = ggf_scale_ptrs(p, g, og, p.tiles[g], p0, q0, lane);
        const int rows = (int)(mg - p0 < GGF_BM ? mg - p0 : GGF_BM) - lane;   // valid rows past lane
        const int cols = (int)(p.N - q0 < BN ? p.N - q0 : BN) - lane;  // valid columns past lane
        for (int kt = 0; kt < ktiles; ++kt) {
          const bool mine = turn == w;
          const int st = s;
          const uint32_t ph = phase;
          if (++turn == 3) turn = 0;
          if (++s == ST) {
            s = 0;
            phase ^= 1;
          }
          if (!mine) continue;
          const float *a = sp.a + kt * sp.ak, *b = sp.b + kt * sp.bk;
          wgc_bar_wait(&empty[st], ph ^ 1);
          float *f = scales + st * SST + lane;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            f[32 * r] = 32 * r < rows ? a[r * sp.ar] : 0.f;
            f[SSLOT + 32 * r] = 32 * r < cols ? b[r * sp.br] : 0.f;
          }
          wgc_bar_arrive(&full[st]);
        }
      }
    } else if (MX && tid >= 32) {
      // ---- producer: an MXFP8 k-block's scales, decoded, into the stage --------------------
      // The tile's 128 rows (columns) of one k-block have one 32-bit word of scale bytes each
      // (the 4 sub-blocks of 32 along K, byte f = sub-block f). tw_quantize.h's rowwise layout:
      // group g's block starts at byte 128*T(g)*W (W = scale_inv's last dimension, a multiple of
      // 4), tile rows p0.. at (128*T(g) + p0)*W in both orders; row r of the tile, k-block kt:
      //   compact:  r*W + 4*kt;   swizzled (r = 32b + d): d*16 + b*4 + 512*kt.
      // rhs likewise with T = g*ceil(N/128) and q0. Warps 1-3 take turns as GGF_SC_WARPS's do.
      const int w = tid / 32 - 1, lane = tid % 32;
      const unsigned char *ea = (const unsigned char *)p.sa, *eb = (const unsigned char *)p.sb;
      const int64_t ntn = (p.N + 127) / 128, Wa = p.lda_s, Wb = p.ldb_s;
      const int64_t la = p.a_sw ? 16 * lane : lane * Wa, ia = p.a_sw ? 4 : 32 * Wa, ka = p.a_sw ? 512 : 4;
      const int64_t lb = p.b_sw ? 16 * lane : lane * Wb, ib = p.b_sw ? 4 : 32 * Wb, kb = p.b_sw ? 512 : 4;
      int s = 0, turn = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int64_t g, p0, q0;
        ggf_locate<BN>(p, t, g, p0, q0);
        const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
        const unsigned char *a = ea + (128 * p.tiles[g] + p0) * Wa + la;
        const unsigned char *b = eb + (128 * g * ntn + q0) * Wb + lb;
        const int rows = (int)(mg - p0 < GGF_BM ? mg - p0 : GGF_BM) - lane;   // valid rows past lane
        const int cols = (int)(p.N - q0 < BN ? p.N - q0 : BN) - lane;  // valid columns past lane
        for (int kt = 0; kt < ktiles; ++kt) {
          const bool mine = turn == w;
          const int st = s;
          const uint32_t ph = phase;
          if (++turn == 3) turn = 0;
          if (++s == ST) {
            s = 0;
            phase ^= 1;
          }
          if (!mine) continue;
          wgc_bar_wait(&empty[st], ph ^ 1);
          uint32_t wa[4], wb[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            wa[i] = 32 * i < rows ? *(const uint32_t *)(a + i * ia + kt * ka) : 0u;
            wb[i] = 32 * i < cols ? *(const uint32_t *)(b + i * ib + kt * kb) : 0u;
          }
          float *f = scales + st * SST + lane;
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              f[128 * k + 32 * i] = 32 * i < rows ? ggf_e8m0((wa[i] >> (8 * k)) & 255u) : 0.f;
              f[512 + 128 * k + 32 * i] = 32 * i < cols ? ggf_e8m0((wb[i] >> (8 * k)) & 255u) : 0.f;
            }
          wgc_bar_arrive(&full[st]);
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c = wg - 1 owns rows 64c..64c+63 of the tile ---------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    // the warpgroup and warp indices through a shuffle: ptxas then knows them warp-uniform and keeps
    // what derives from them (the descriptors) in uniform registers
    const int c = __shfl_sync(0xffffffffu, wg - 1, 0), warp = __shfl_sync(0xffffffffu, tid / 32, 0), lane = tid % 32;
    // lhs scale stride over rows in a slot: 1 (1x128, or the warps' per-row copies), 0 (128x128)
    const int sa_row = SC == GGF_SC_WARPS || p.mode == GGF_B1x128;
    float d[NA], tot[NA];
    int s = 0;
    uint32_t phase = 0;
    // Descriptors of stage 0 (this warpgroup's 64 lhs rows, the rhs tile), computed once: building
    // them per k32 step from the address (mask, shift, or, then to uniform registers) took about
    // 90 instructions per k-block, and the block-scale consumers issue in turns, so the other
    // warpgroup waited on that too (ncu source counters, session 7).
    const uint32_t da0 = (uint32_t)wgc_desc(wgc_smem(base) + c * (64 * GGF_BK), 16, 1024);
    const uint32_t db0 = (uint32_t)wgc_desc(wgc_smem(base) + GGF_A_BYTES, 16, 1024);
    const uint32_t full_at = wgc_smem(full);
    // Turns (p.order): both warpgroups wait on the same full barrier, so left alone they issue
    // their wgmmas together, finish together and promote together while the tensor cores idle.
    // Named barrier 3 + c gates warpgroup c's issue; the other warpgroup opens it once it has
    // issued its own k-block (order 1) or once that k-block's wgmmas completed (order 2);
    // warpgroup 1 opens the first. The tensor cores then run one warpgroup's k-block while the
    // other promotes. Each gate opens exactly as often as it is waited on: warpgroup 1 skips
    // its arrival after its last k-block.
    const bool order = p.order != 0, at_issue = p.order == 1;
    if (order && c == 1 && (int)blockIdx.x < total) ggf_named_arrive(3, 256);
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      int64_t g, p0, q0;
      ggf_locate<BN>(p, t, g, p0, q0);
      const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
      const bool last_tile = t + (int)gridDim.x >= total;
      ggf_scoord ca = {0, 0, 0, 0}, cb = {0, 0, 0, 0};  // the warps' copies start at 0
      if (STMA) ggf_scale_coords(p, g, og, p.tiles[g], p0, q0, ca, cb);
#pragma unroll
      for (int i = 0; i < NA; ++i) tot[i] = 0.f;
      for (int kt = 0; kt < ktiles; ++kt) {
        wgc_bar_wait_at(full_at + 8 * s, phase);
        // stage s's descriptors: the stage-0 ones plus the stage offset; the k32 steps add 2
        // (32 bytes in 16-byte units; shared addresses stay below 2^18, the field's range)
        const uint32_t da = da0 + s * (STAGE / 16), db = db0 + s * (STAGE / 16);
        if (MX) {
          // MXFP8: one wgmma k32 per scaling block, each into fresh registers (scale_d 0), then
          // promoted: total = fmaf(partial, sa * sb, total) with that sub-block's scales. The
          // turns go per sub-block. Sub-blocks wholly past K are skipped (their scale bytes are
          // padding, never read, as gg_mma_wide never reads them).
          const float *fs = scales + s * SST;
          const int ra = 64 * c + 16 * warp + lane / 4;
          const int64_t kleft = p.K - (int64_t)kt * GGF_BK;
          const int nsub = kleft >= GGF_BK ? 4 : (int)((kleft + 31) / 32);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (k >= nsub) break;
            if (order) ggf_named_sync(3 + c, 256);
            wgc_fence();
            ggf_mma<AT, BT>(d, wgc_desc_lo(da + 2 * k), wgc_desc_lo(db + 2 * k), 0);
            wgc_commit();
            const bool open = order && !(c == 1 && last_tile && kt == ktiles - 1 && k == nsub - 1);
            if (open && at_issue) ggf_named_arrive(4 - c, 256);
            wgc_wait<0>();
            if (open && !at_issue) ggf_named_arrive(4 - c, 256);
            wgc_touch<64>(d);
            ggf_promote(d, tot, fs[128 * k + ra], fs[128 * k + ra + 8], fs + 512 + 128 * k, lane);
          }
          __syncwarp();
          if (lane == 0) ggf_release<CL>(&empty[s]);
          if (++s == ST) {
            s = 0;
            phase ^= 1;
          }
          continue;
        }
        // What the promotion needs is read and decided before the issue: left alone, the compiler
        // placed the scale loads' address arithmetic between the wgmmas, and the other
        // warpgroup's turn, opened after the last wgmma, waited on it (ncu source counters,
        // session 7). The empty asm keeps the front end from sinking the loads past the wgmmas;
        // ptxas still interleaves some arithmetic (two FMULs, the gate predicates), but the
        // loads now precede the first wgmma in the SASS.
        const float *fb = scales + s * SST + SSLOT + ((cb.i0 + cb.ik * kt) & 3);
        float fa0 = 0.f, fa1 = 0.f, fb0 = 0.f, fb1 = 0.f;
        if (BL) {
          const float *fa = scales + s * SST + ((ca.i0 + ca.ik * kt) & 3);
          const int ra = (64 * c + 16 * warp + lane / 4) * sa_row;
          fa0 = fa[ra];
          fa1 = fa[ra + 8 * sa_row];
          if (SC == GGF_SC_TMA_S) fb0 = fb[0];
          if (SC == GGF_SC_TMA_S && BN != 128) fb1 = fb[4];
        }
        const bool open = order && !(c == 1 && last_tile && kt == ktiles - 1);
        int open_at_issue = open && at_issue, open_at_done = open && !at_issue;
        asm volatile("" : "+f"(fa0), "+f"(fa1), "+f"(fb0), "+f"(fb1), "+r"(open_at_issue), "+r"(open_at_done));
        if (order) ggf_named_sync(3 + c, 256);
        wgc_fence();
#pragma unroll
        for (int k = 0; k < GGF_BK / 32; ++k)
          ggf_mma_bn<BN, AT, BT>(d, wgc_desc_lo(da + 2 * k), wgc_desc_lo(db + 2 * k), k > 0 ? 1 : 0);
        wgc_commit();
        if (open_at_issue) ggf_named_arrive(4 - c, 256);
        wgc_wait<0>();
        if (open_at_done) ggf_named_arrive(4 - c, 256);
        wgc_touch<NA>(d);
        if (BL) {
          // the scales were read from the stage before the issue; it is released below (64 + 64
          // + 34 live registers at BN = 128; the consumers' 232 of setmaxnreg hold BN = 192's 96 + 96)
          if (SC == GGF_SC_TMA_S && BN == 128) {  // one rhs scale for the tile's 128 columns
            const float s0 = fa0 * fb0, s1 = fa1 * fb0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              tot[4 * j + 0] = fmaf(d[4 * j + 0], s0, tot[4 * j + 0]);
              tot[4 * j + 1] = fmaf(d[4 * j + 1], s0, tot[4 * j + 1]);
              tot[4 * j + 2] = fmaf(d[4 * j + 2], s1, tot[4 * j + 2]);
              tot[4 * j + 3] = fmaf(d[4 * j + 3], s1, tot[4 * j + 3]);
            }
          } else if (SC == GGF_SC_TMA_S) {
            // BN = 192: the tile's columns span two 128-column scale blocks (the box's two rows,
            // at fb and fb + 4): local columns below `split` (128 - q0 % 128: 128 or 64, a multiple
            // of 8) take the first, the rest the second; the same products and fmaf as BN = 128.
            // Two unrolled copies, one per split (q0 = 192i: split 128 for even i, 64 for odd), so
            // each column's scale pair is known at compile time: a runtime choice per 8 columns
            // cost 20 SEL and 30 FMUL per k-block (273 instructions in the loop against 174 at
            // BN = 128, SASS of session 7).
            const float s00 = fa0 * fb0, s10 = fa1 * fb0, s01 = fa0 * fb1, s11 = fa1 * fb1;
            if ((q0 & 127) == 0) ggf_promote_split<NJ, 16>(d, tot, s00, s10, s01, s11);
            else ggf_promote_split<NJ, 8>(d, tot, s00, s10, s01, s11);
          } else {  // fb is 8-byte aligned (the host takes TMA_V only with an even start)
            ggf_promote_n<NJ>(d, tot, fa0, fa1, fb, lane);
          }
          __syncwarp();
          if (lane == 0) ggf_release<CL>(&empty[s]);
        } else {
          __syncwarp();
          if (lane == 0) ggf_release<CL>(&empty[s]);
#pragma unroll
          for (int i = 0; i < NA; ++i) tot[i] += d[i];
        }
        if (++s == ST) {
          s = 0;
          phase ^= 1;
        }
      }
      // ---- epilogue: rows p0 + 64c + 16*warp + lane/4 (+8), columns q0 + 8j + 2*(lane%4) (+1)
      // A pair's padding tile (CL 2 with an odd column-tile count: tilesQ rounded up) lies past N
      // and writes nothing; it ran its k-blocks so its partner got the multicast lhs rows.
      if (CL > 1 && q0 >= p.N) continue;
      const float tf = BL ? 1.f : p.sa[g] * p.sb[g];
      if (EPI && p.tma_out && p0 + 64 * c + 64 <= mg) {
        // interior rows (all 64 of this warpgroup's rows in the group): through shared memory and
        // a TMA store, which drains while the next tile's k-blocks run. BN/64 64 x 64 boxes with
        // the 128-byte swizzle (16-byte chunk q of row r at chunk q ^ (r % 8)): conflict-free.
        unsigned char *ep = epi + c * (GGF_EPI_BYTES(BN) / 2);
        if (tid == 0) ggf_bulk_wait_read0();  // the previous tile's store has read the staging
        ggf_named_sync(1 + c, 128);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * warp + lane / 4 + 8 * h;
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            const float v0 = BL ? tot[4 * j + 2 * h] : tot[4 * j + 2 * h] * tf;
            const float v1 = BL ? tot[4 * j + 2 * h + 1] : tot[4 * j + 2 * h + 1] * tf;
            uint32_t two;
            if (OUT == TW_BF16) {
              __nv_bfloat162 b2 = __halves2bfloat162(__float2bfloat16_rn(v0), __float2bfloat16_rn(v1));
              two = *(uint32_t *)&b2;
            } else {
              __half2 h2 = __halves2half2(__float2half_rn(v0), __float2half_rn(v1));
              two = *(uint32_t *)&h2;
            }
            *(uint32_t *)(ep + (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4) + 4 * (lane % 4)) = two;
          }
        }
        ggf_fence_proxy_async();  // this thread's generic writes, before the async proxy reads them
        ggf_named_sync(1 + c, 128);
        if (tid == 0) {
          const int row = (int)(og + p0 + 64 * c);
          // column starts q0 + 64b: 16-byte aligned; boxes starting past N are skipped, the
          // store clips the one that crosses N (elements past the map's N are not written)
          ggf_tma_store_2d(&map_out, ep, (int)q0, row);
#pragma unroll
          for (int b = 1; b < BN / 64; ++b)
            if (q0 + 64 * b < p.N) ggf_tma_store_2d(&map_out, ep + 8192 * b, (int)q0 + 64 * b, row);
          ggf_bulk_commit();
        }
        continue;
      }
      const int64_t r0 = p0 + 64 * c + 16 * warp + lane / 4;
      const int64_t cbase = q0 + 2 * (lane % 4);
      const bool pairs = (p.N & 1) == 0 && ((uintptr_t)p.out & (OUT == TW_F32 ? 7 : 3)) == 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = r0 + 8 * h;
        if (r >= mg) continue;
        const int64_t rowbase = (og + r) * p.N;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const int64_t col = cbase + 8 * j;
          const float v0 = BL ? tot[4 * j + 2 * h] : tot[4 * j + 2 * h] * tf;
          const float v1 = BL ? tot[4 * j + 2 * h + 1] : tot[4 * j + 2 * h + 1] * tf;
          if (pairs) {
            if (col < p.N) wgc_put2<OUT>(p.out, rowbase + col, v0, v1, p.accumulate);
          } else {
            if (col < p.N) wgc_put1<OUT>(p.out, rowbase + col, v0, p.accumulate);
            if (col + 1 < p.N) wgc_put1<OUT>(p.out, rowbase + col + 1, v1, p.accumulate);
          }
        }
      }
    }
    if (EPI && p.tma_out && tid == 0) ggf_bulk_wait0();  // the staging stays valid until read
  }
  // no CTA leaves while its peer may still multicast into it or arrive on its barriers
  if (CL > 1) {
    __syncwarp();
    wgc_cluster_sync();
  }
#endif
}

// ---- MXFP8 rhs given as colwise data, op N: the transposing pad pass ---------------------------
// The MoE block's fp8_mxfp8 recipe passes its expert weights as the colwise MXFP8 operand of the
// [G*K, N] source (tw_quantize.h: colwise MXFP8 data is not transposed, [G*K, N] like the source,
// E8M0 scales per 32 rows k of a group, rhs_op N). fp8 wgmma reads both operands K-major, so a
// pad pass writes the K-major copy the kernel already reads for a rowwise MXFP8 rhs, into the
// context's pad buffer (ggf_pad_buffer, grouped_gemm_wgmma_fp8.cuh), and the unchanged kernel
// runs on that:
//   codes:  dst[g][n][k] = src[g*K + k][n]                ([G, N, K], rows K bytes apart)
//   scales: the rowwise MXFP8 of the transposed source [G*N, K] has the same 32-element blocks
//           (32 consecutive k of one column n of one group), so the same E8M0 bytes. Swizzled
//           colwise scales are byte for byte the swizzled rowwise scales of the transposed
//           source (tw_quantize.h swizzles a colwise block as its transpose; both group blocks
//           are [128*ceil(N/128), 4*ceil(K/128)] bytes from byte 512*g*ceil(N/128)*ceil(K/128)),
//           so they are read in place. Compact colwise scales ([4*ceil(K/128), roundup(N, 128)]
//           per group, row = 32-block of k) are transposed into the swizzled rowwise order: the
//           4 bytes of column n, k-block kt are the word at 512*((g*ntn + n/128)*ktn + kt) +
//           16*(n%32) + 4*((n%128)/32), so one tile's 128 words are 512 contiguous bytes.
// Same bytes moved, so the forward's result is bit-identical to the one it gives for the
// rowwise operand of the transposed source (tests/grouped_gemm_gpu_test.c checks it).
// One CTA per 128 k x 128 n tile of a group (grid-stride): 128 rows of 128 bytes in through
// a 33-word-pitch shared tile with an XOR on the word column (ggf_pad_mx's scheme, conflict-free
// both ways), 4x4 byte transposes by byte_perm, 16-byte stores (K % 16 == 0: a k chunk of 16 is
// whole or past K). Rows of src that are not 16-byte multiples (N % 16, or an unaligned base)
// are read byte by byte. Threads 0-127 also move the tile's scale words (compact input only).
struct ggf_tparams {
  const unsigned char *src;   // colwise data [G*K, N]
  unsigned char *dst;         // [G, N, K]
  const unsigned char *ssrc;  // compact colwise E8M0 [4*T_cap, lds], or NULL (swizzled: read in place)
  unsigned char *sdst;        // swizzled rowwise E8M0 of [G*N, K]: [128*G*ntn, 4*ktn]
  int64_t K, N, G, ktn, ntn, lds;
};
#define GGF_PT_PITCH 33
__global__ void __launch_bounds__(256) ggf_pad_mxt(const ggf_tparams p) {
#ifdef WGC_DEVICE
  __shared__ uint32_t tw[128 * GGF_PT_PITCH];
  const int tid = threadIdx.x;
  const int64_t per_g = p.ktn * p.ntn, total = p.G * per_g;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t g = t / per_g, kt = (t - g * per_g) / p.ntn, nt = t - g * per_g - kt * p.ntn;
    const int64_t k0 = 128 * kt, n0 = 128 * nt;
    const int nk = (int)(p.K - k0 < 128 ? p.K - k0 : 128), nn = (int)(p.N - n0 < 128 ? p.N - n0 : 128);
    const unsigned char *src = p.src + (g * p.K + k0) * p.N + n0;
    const bool vec = (((uintptr_t)src | (uintptr_t)p.N) & 15) == 0;
    const int w = tid & 7;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = (tid >> 3) + 32 * i;  // row k0 + j, bytes n0 + 16w ..
      uint32_t v[4] = {0u, 0u, 0u, 0u};
      if (j < nk) {
        const unsigned char *q = src + (int64_t)j * p.N + 16 * w;
        if (vec && 16 * w + 16 <= nn) {
          const uint4 x = __ldg((const uint4 *)q);
          v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
        } else {
          uint64_t lo = 0, hi = 0;
#pragma unroll 1
          for (int b = 0; b < 16 && 16 * w + b < nn; ++b) {
            const uint64_t x = q[b];
            if (b < 8) lo |= x << (8 * b);
            else hi |= x << (8 * (b - 8));
          }
          v[0] = (uint32_t)lo, v[1] = (uint32_t)(lo >> 32), v[2] = (uint32_t)hi, v[3] = (uint32_t)(hi >> 32);
        }
      }
      const int f = 2 * (j >> 4);
#pragma unroll
      for (int e = 0; e < 4; ++e) tw[j * GGF_PT_PITCH + ((4 * w + e) ^ f)] = v[e];
    }
    if (p.ssrc && tid < 128) {  // compact scales: column n0 + tid, k-block kt -> its swizzled word
      const unsigned char *s = p.ssrc + 4 * (g * p.ktn + kt) * p.lds + n0 + tid;
      const uint32_t word = (uint32_t)s[0] | (uint32_t)s[p.lds] << 8 | (uint32_t)s[2 * p.lds] << 16 |
                            (uint32_t)s[3 * p.lds] << 24;
      *(uint32_t *)(p.sdst + 512 * ((g * p.ntn + nt) * p.ktn + kt) + 16 * (tid & 31) + 4 * (tid >> 5)) = word;
    }
    __syncthreads();
    const int c = tid & 7, q = tid >> 3, f = 2 * c;  // rows 16c + i all have j / 16 = c
    uint32_t x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = tw[(16 * c + i) * GGF_PT_PITCH + (q ^ f)];
    uint32_t o[4][4];  // o[e][m]: column n0 + 4q + e, k0 + 16c + 4m .. + 3
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint32_t lab = __byte_perm(x[4 * m], x[4 * m + 1], 0x5140), hab = __byte_perm(x[4 * m], x[4 * m + 1], 0x7362);
      const uint32_t lcd = __byte_perm(x[4 * m + 2], x[4 * m + 3], 0x5140),
                     hcd = __byte_perm(x[4 * m + 2], x[4 * m + 3], 0x7362);
      o[0][m] = __byte_perm(lab, lcd, 0x5410);
      o[1][m] = __byte_perm(lab, lcd, 0x7632);
      o[2][m] = __byte_perm(hab, hcd, 0x5410);
      o[3][m] = __byte_perm(hab, hcd, 0x7632);
    }
    unsigned char *dst = p.dst + (g * p.N + n0) * p.K + k0 + 16 * c;
    if (16 * c < nk)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (4 * q + e < nn) *(uint4 *)(dst + (int64_t)(4 * q + e) * p.K) = make_uint4(o[e][0], o[e][1], o[e][2], o[e][3]);
    __syncthreads();  // the next tile's loads overwrite tw
  }
#endif
}

// ---- host side ---------------------------------------------------------------------------------

int gg_wgmma_fp8_takes(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                       const tw_tensor *out, const char **why) {
  gpu_state *st = gpu_of(ctx);
  const int64_t M = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1];
  const int ma = ggf_fwd_mode_of(lhs->mode), mb = ggf_fwd_mode_of(rhs->mode);
  const int mx = ma == GGF_MX || mb == GGF_MX;
  // an MXFP8 rhs given as the colwise data of its [G*K, N] source (op N): transposed by
  // ggf_pad_mxt into the rowwise form first (its data may sit at any byte address)
  // (measurement knob, read on every call: TWIN_GG_WGMMA_FP8_MXT=0 declines it, so auto runs
  // gg_mma_wide as before; the benches time both in one process)
  const char *xv = getenv("TWIN_GG_WGMMA_FP8_MXT");
  const int mxt = mx && rhs->colwise && rhs_op == TW_OP_N && !(xv && xv[0] == '0');
  *why = NULL;
  if (st->sm != 90) *why = "needs an sm_90 device (fp8 wgmma, TMA)";
  else if (!ggf_fp8(lhs->data.dtype) || !ggf_fp8(rhs->data.dtype) || ma < 0 || mb < 0 ||
           (mx ? ma != mb : (ma == GGF_TENSOR) != (mb == GGF_TENSOR)))
    *why = "takes fp8 operands with per-tensor, 1x128, 128x128 or MXFP8 scales only";
  else if (rhs_op != TW_OP_T && !mxt)
    *why = "needs rhs as [G, N, K] (rhs_op T; MXFP8 also as the colwise data of its [G*K, N] source, op N): fp8 "
           "wgmma reads both operands K-major";
  else if (lhs->colwise || lhs->data.ndim != 2)
    *why = "needs the rowwise lhs [M, K]";
  else if (K == 0 || K % 16)
    *why = "needs K a non-zero multiple of 16 (TMA: 16-byte row strides)";
  else if (((uintptr_t)lhs->data.data & 15) || (!mxt && ((uintptr_t)rhs->data.data & 15)))
    *why = "needs 16-byte aligned lhs and rhs";
  else if (M >= ((int64_t)1 << 31) || K >= ((int64_t)1 << 31) || N >= ((int64_t)1 << 31))
    *why = "needs M, N and K below 2^31 (TMA coordinates)";
  else if (M * ((N + GGF_BN - 1) / GGF_BN) >= ((int64_t)1 << 31))  // row tiles <= M
    *why = "needs fewer than 2^31 128x128 output tiles (32-bit tile ids)";
  else if (mx && rhs->colwise && !mxt)
    *why = "needs the MXFP8 rhs as the rowwise data of its [G*N, K] source (op T) or the colwise data of its "
           "[G*K, N] source (op N)";
  else if (mx && (lhs->scale_inv.ndim != 2 || rhs->scale_inv.ndim != 2 || (lhs->scale_inv.shape[1] & 3) ||
                  (rhs->scale_inv.shape[1] & 3) || ((uintptr_t)lhs->scale_inv.data & 3) ||
                  ((uintptr_t)rhs->scale_inv.data & 3)))
    *why = "needs MXFP8 scale_inv in tw_quantize.h's rowwise layout, 4-byte aligned (rows of 4-byte multiples)";
  return *why == NULL;
}

// Persistent grid: one CTA per SM (CL = 1: a plain launch; a cluster-dimension attribute of 1
// cost gg_wgmma 30%, run g3/g4), or as many pairs as are resident at once (asked once per device).
template <int SC, int AT, int BT, int OUT, int CL, int BN>
static tw_status ggf_launch_t(tw_ctx *ctx, const CUtensorMap *m, const ggf_params *p, const char *op) {
  gpu_state *st = gpu_of(ctx);
  void (*fn)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const CUtensorMap, const CUtensorMap,
             const ggf_params) = ggf_kernel<SC, AT, BT, OUT, CL, BN>;
  static int set_for[64], grid_of[64];
  const int dev = st->device < 64 ? st->device : 0;
  if (!set_for[dev]) {
    GPU_TRY_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, GGF_FSMEM(SC, OUT, BN)),
                 "grouped_gemm (gg_wgmma_fp8): cudaFuncSetAttribute");
    set_for[dev] = 1;
  }
  if (CL == 1) {
    fn<<<(unsigned)st->num_sms, GGF_THREADS, GGF_FSMEM(SC, OUT, BN), st->stream>>>(m[0], m[1], m[2], m[3], m[4], *p);
    GPU_TRY_CUDA(cudaGetLastError(), op);
    return TW_OK;
  }
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = CL;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(GGF_THREADS);
  cfg.dynamicSmemBytes = GGF_FSMEM(SC, OUT, BN);
  cfg.stream = st->stream;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  if (!grid_of[dev]) {
    int clusters = 0;
    cfg.gridDim = dim3((unsigned)(st->num_sms / CL * CL));
    GPU_TRY_CUDA(cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg), "grouped_gemm (gg_wgmma_fp8): cluster occupancy");
    grid_of[dev] = clusters > 0 ? clusters * CL : st->num_sms / CL * CL;
  }
  cfg.gridDim = dim3((unsigned)grid_of[dev]);
  GPU_TRY_CUDA(cudaLaunchKernelEx(&cfg, fn, m[0], m[1], m[2], m[3], m[4], *p), op);
  return TW_OK;
}

// bn 192 (CL 1 with TMA or no block scales, CL 2 per-tensor) instantiates the 128 x 192 tile; the
// host never asks it of another kind (ggf_forward_kmajor), so those instantiations do not exist.
template <int SC, int AT, int BT>
static tw_status ggf_out(tw_ctx *ctx, int od, int cl, int bn, const CUtensorMap *m, const ggf_params *p,
                         const char *op) {
  if constexpr (SC == GGF_SC_TENSOR) {
    if (bn == 192 && cl == 2) switch (od) {
        case TW_F32: return ggf_launch_t<SC, AT, BT, TW_F32, 2, 192>(ctx, m, p, op);
        case TW_BF16: return ggf_launch_t<SC, AT, BT, TW_BF16, 2, 192>(ctx, m, p, op);
        default: return ggf_launch_t<SC, AT, BT, TW_F16, 2, 192>(ctx, m, p, op);
      }
  }
  if constexpr (SC == GGF_SC_TENSOR || SC == GGF_SC_TMA_V || SC == GGF_SC_TMA_S) {
    if (bn == 192) switch (od) {
        case TW_F32: return ggf_launch_t<SC, AT, BT, TW_F32, 1, 192>(ctx, m, p, op);
        case TW_BF16: return ggf_launch_t<SC, AT, BT, TW_BF16, 1, 192>(ctx, m, p, op);
        default: return ggf_launch_t<SC, AT, BT, TW_F16, 1, 192>(ctx, m, p, op);
      }
  }
  if (cl == 2) switch (od) {
      case TW_F32: return ggf_launch_t<SC, AT, BT, TW_F32, 2, 128>(ctx, m, p, op);
      case TW_BF16: return ggf_launch_t<SC, AT, BT, TW_BF16, 2, 128>(ctx, m, p, op);
      default: return ggf_launch_t<SC, AT, BT, TW_F16, 2, 128>(ctx, m, p, op);
    }
  switch (od) {
    case TW_F32: return ggf_launch_t<SC, AT, BT, TW_F32, 1, 128>(ctx, m, p, op);
    case TW_BF16: return ggf_launch_t<SC, AT, BT, TW_BF16, 1, 128>(ctx, m, p, op);
    default: return ggf_launch_t<SC, AT, BT, TW_F16, 1, 128>(ctx, m, p, op);
  }
}
template <int SC>
static tw_status ggf_types(tw_ctx *ctx, int at, int bt, int od, int cl, int bn, const CUtensorMap *m,
                           const ggf_params *p, const char *op) {
  // e5m2 x e5m2 never reaches here (TW_ERR_DTYPE in core/api_gemm.c)
  if (at) return ggf_out<SC, 1, 0>(ctx, od, cl, bn, m, p, op);
  if (bt) return ggf_out<SC, 0, 1>(ctx, od, cl, bn, m, p, op);
  return ggf_out<SC, 0, 0>(ctx, od, cl, bn, m, p, op);
}

// A 2-D f32 tensor map over a scale_inv array [rows, ld], box `box` x `rows` (132: a 1x128 k-block's
// 128 scales from a 16-byte aligned start, 196 for 192 columns; 4: one 128x128 scale likewise, 4 x
// 2: the two 128-column blocks of a 192-column tile, rows n/128 and n/128 + 1); 0 if TMA cannot
// map it (base not 16-byte aligned, ld not a multiple of 4 floats, sizes past int32 coordinates).
static int ggf_scale_map(PFN_cuTensorMapEncodeTiled_v12000 enc, CUtensorMap *m, const tw_tensor *t, int box,
                         int rows) {
  if (t->ndim != 2 || ((uintptr_t)t->data & 15) || (t->shape[1] & 3) || t->shape[0] <= 0 || t->shape[1] <= 0 ||
      t->shape[0] >= ((int64_t)1 << 31) || t->shape[1] >= ((int64_t)1 << 31))
    return 0;
  cuuint64_t dims[2] = {(cuuint64_t)t->shape[1], (cuuint64_t)t->shape[0]}, strides[1] = {(cuuint64_t)t->shape[1] * 4};
  cuuint32_t bx[2] = {(cuuint32_t)box, (cuuint32_t)rows}, es[2] = {1, 1};
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, t->data, dims, strides, bx, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

// The forward's default column tile per scaling mode (lhs, rhs GGF_*) and N, when the knob
// TWIN_GG_WGMMA_FP8_BN does not set one. Runs n192-b2 (H200, gpu/NOTES-gemm.md "128 x 192
// tiles"): 192 was faster on all five shapes per-tensor (+9..12% on the four large ones, dense
// 8192^3 +8%) and 1x128 x 1x128 (+9..12.5%). 1x128 x 128x128 (DeepSeek-V3's pairing) since its
// 192-column promotion lost its runtime selects (session 7, H200): +5.6..6.4% on G4 K2048, G8 and
// G32, +1.7% G128, and G4 K7168 6% ahead in the rounds after the first (whose BN 128 round ran in
// the bench's fast first-row state). 128x128 x 128x128 (not timed) stays 128. Only where 192
// pads N by at most 1/16 more than 128 does (the measured N 2048, 4096, 7168, 8192 pad 1.8-3%;
// N = 256 would compute 384 columns, 1024 1152): other N run 128, unmeasured.
static int ggf_default_bn(int mode, int mode_b, int64_t N) {
  const int wide = mode == GGF_TENSOR || (mode == GGF_B1x128 && (mode_b == GGF_B1x128 || mode_b == GGF_B128));
  return wide && ggf_n_fits_192(N) ? 192 : 128;
}

// The forward on a K-major rhs [G, N, K] (rhs_op T; for MXFP8 the rowwise data of the [G*N, K]
// source, or ggf_pad_mxt's copy of the colwise data).
static tw_status ggf_forward_kmajor(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                                   const int64_t *offsets, const int64_t *tiles, int64_t G, tw_tensor *out,
                                   int accumulate, const char *op) {
  const char *why;
  if (!gg_wgmma_fp8_takes(ctx, lhs, rhs, rhs_op, out, &why))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA_FP8, why);
  const int64_t M = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1];
  if (M == 0 || N == 0 || G == 0) return TW_OK;
  PFN_cuTensorMapEncodeTiled_v12000 enc = wgc_encode_fn();
  if (!enc)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': no cuTensorMapEncodeTiled in the driver", op,
                    GG_KERNEL_WGMMA_FP8);
  const int mode = ggf_fwd_mode_of(lhs->mode), mode_b = ggf_fwd_mode_of(rhs->mode);
  // Column tile (knob TWIN_GG_WGMMA_FP8_BN=128|192, read on every call; default ggf_default_bn):
  // 192 runs per-tensor and the TMA block-scale kinds; MXFP8, warp-staged block scales and
  // clusters stay at 128 (asked for 192, they run 128: same bits, the model is per column).
  int bn = ggf_knob_bn("TWIN_GG_WGMMA_FP8_BN", ggf_default_bn(mode, mode_b, N));
  if (mode == GGF_MX) bn = 128;
  // Clusters of 2 (lhs rows multicast to a pair of column tiles) only on request:
  // TWIN_GG_WGMMA_FP8_CLUSTER=2. Runs cl1/cl2 (H200, gpu/NOTES-gemm.md, BN 128) found no
  // consistent gain: per-tensor G8 K7168 +7% / +4%, other shapes -2..+3.5%, block scales -1..-12%,
  // MXFP8 flat. Per-tensor keeps its BN (192 too: the tile count is then rounded up to even, the
  // extra tile past N writes nothing); the other modes pair at BN 128 with an even tile count.
  const char *cv = getenv("TWIN_GG_WGMMA_FP8_CLUSTER");
  const int want_pair = cv && !strcmp(cv, "2");
  if (want_pair && mode != GGF_TENSOR) bn = 128;
  const int cl = want_pair && (mode == GGF_TENSOR || ((N + bn - 1) / bn) % 2 == 0) ? 2 : 1;
  CUtensorMap maps[5];  // lhs, rhs, (block scales through TMA) their scales, (bf16/f16) out
  memset(maps, 0, sizeof maps);
  // Block scales by TMA where both scale arrays map (boxes as ggf_scale_map says, for this bn;
  // if a 192-column box does not map, 128 is tried). rhs 1x128 rowwise starts its columns at
  // g*N + q0: the consumers' paired (8-byte) reads need that even, so N even. Else producer warps
  // stage them (BN = 128).
  int sc = mode == GGF_TENSOR ? GGF_SC_TENSOR : mode == GGF_MX ? GGF_SC_MX : GGF_SC_WARPS, scale_tx = 0;
  if (sc == GGF_SC_WARPS) {
    const char *sv = getenv("TWIN_GG_WGMMA_FP8_SCALES");  // measurement knob
    const int tma_ok = !(sv && !strcmp(sv, "warps")) && !(mode_b == GGF_B1x128 && !rhs->colwise && (N & 1));
    for (int b = bn; tma_ok && sc == GGF_SC_WARPS && b >= 128; b -= 64) {
      const int box_a = mode == GGF_B1x128 ? 132 : 4, box_b = mode_b == GGF_B1x128 ? b + 4 : 4;
      const int rows_b = mode_b == GGF_B1x128 ? 1 : (b + 127) / 128;
      if (ggf_scale_map(enc, &maps[2], &lhs->scale_inv, box_a, 1) &&
          ggf_scale_map(enc, &maps[3], &rhs->scale_inv, box_b, rows_b)) {
        sc = mode_b == GGF_B1x128 ? GGF_SC_TMA_V : GGF_SC_TMA_S;
        scale_tx = 4 * (box_a + box_b * rows_b);
        bn = b;
      }
    }
    if (sc == GGF_SC_WARPS) bn = 128;
  }
  const int64_t tilesQ = (N + bn - 1) / bn + (cl == 2 && ((N + bn - 1) / bn) % 2);
  {
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M}, strides[1] = {(cuuint64_t)K};
    cuuint32_t box[2] = {GGF_BK, (cuuint32_t)(GGF_BM / cl)}, es[2] = {1, 1};
    CUresult r = enc(&maps[0], CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, lhs->data.data, dims, strides, box, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': lhs tensor map refused (CUresult %d)", op,
                      GG_KERNEL_WGMMA_FP8, (int)r);
  }
  {
    cuuint64_t dims[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)G};
    cuuint64_t strides[2] = {(cuuint64_t)K, (cuuint64_t)(K * N)};
    cuuint32_t box[3] = {GGF_BK, (cuuint32_t)bn, 1}, es[3] = {1, 1, 1};
    CUresult r = enc(&maps[1], CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, rhs->data.data, dims, strides, box, es,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': rhs tensor map refused (CUresult %d)", op,
                      GG_KERNEL_WGMMA_FP8, (int)r);
  }
  ggf_params p;
  memset(&p, 0, sizeof p);
  p.offsets = offsets;
  p.tiles = tiles;
  p.out = out->data;
  p.N = N;
  p.K = K;
  p.G = G;
  p.tilesQ = tilesQ;
  p.accumulate = accumulate;
  p.mode = mode;
  p.mode_b = mode_b;
  p.scale_tx = scale_tx;
  p.a_sw = lhs->mxfp8_swizzled;
  p.b_sw = rhs->mxfp8_swizzled;
  p.sa = (const float *)lhs->scale_inv.data;
  p.sb = (const float *)rhs->scale_inv.data;
  p.lda_s = lhs->scale_inv.ndim >= 1 ? lhs->scale_inv.shape[lhs->scale_inv.ndim - 1] : 1;
  p.ldb_s = rhs->scale_inv.ndim >= 1 ? rhs->scale_inv.shape[rhs->scale_inv.ndim - 1] : 1;
  p.b_transposed = rhs->colwise;
  const char *tov = getenv("TWIN_GG_TILE_ORDER");  // measurement knob: "m" = a group's row tiles first
  p.m_first = cl == 1 && tov && !strcmp(tov, "m");
  const char *ev = getenv("TWIN_GG_WGMMA_FP8_EPI");  // measurement knob
  // Turns: per-tensor ran up to 2% faster without them (its promotion is one add), 1x128 2-4.5%
  // faster with them (runs f5/f6, gpu/NOTES-gemm.md); MXFP8 (turns per 32-block) 1.5-5% faster
  // without them (run mx2).
  p.order = ggf_knob_order("TWIN_GG_WGMMA_FP8_ORDER", p.mode == GGF_TENSOR || p.mode == GGF_MX ? 0 : 1);
  if (!accumulate && (out->dtype == TW_BF16 || out->dtype == TW_F16) && N % 8 == 0 &&
      ((uintptr_t)out->data & 15) == 0 && !(ev && !strcmp(ev, "regs"))) {
    cuuint64_t dims[2] = {(cuuint64_t)N, (cuuint64_t)M}, strides[1] = {(cuuint64_t)N * 2};
    cuuint32_t box[2] = {64, 64}, es[2] = {1, 1};
    p.tma_out = enc(&maps[4], out->dtype == TW_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                    2, out->data, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  }
  const int at = lhs->data.dtype == TW_E5M2, bt = rhs->data.dtype == TW_E5M2, od = out->dtype;
  switch (sc) {
    case GGF_SC_TENSOR: return ggf_types<GGF_SC_TENSOR>(ctx, at, bt, od, cl, bn, maps, &p, op);
    case GGF_SC_MX: return ggf_types<GGF_SC_MX>(ctx, at, bt, od, cl, bn, maps, &p, op);
    case GGF_SC_TMA_V: return ggf_types<GGF_SC_TMA_V>(ctx, at, bt, od, cl, bn, maps, &p, op);
    case GGF_SC_TMA_S: return ggf_types<GGF_SC_TMA_S>(ctx, at, bt, od, cl, bn, maps, &p, op);
    default: return ggf_types<GGF_SC_WARPS>(ctx, at, bt, od, cl, bn, maps, &p, op);
  }
}

// rhs_op T: the kernel as is. MXFP8 colwise rhs, op N: ggf_pad_mxt writes the K-major copy (and,
// for compact scales, the swizzled rowwise scale bytes) into the pad buffer, then the same kernel
// runs on it as on a rowwise MXFP8 rhs. Sizes from shapes only (no host sync, capturable). Cost
// per call: G*K*N code bytes read and as many written (+ 2*G*ceil(K/128)*ceil(N/128)*512 scale
// bytes with compact scales), and as many bytes of pad buffer. The MoE bench's E32 block (H 7168,
// F 2048): wi G*K*N = 940 MB (~0.55 ms at ~3.5 TB/s), wo 470 MB (~0.27 ms); E256: 8x that.
// A caller that reuses its weights (tw_moe_set_weight_reuse) still pays it on every call: the
// copy is not cached (future work: keep it with the quantized weights).
tw_status gg_wgmma_fp8_forward(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                               const int64_t *offsets, const int64_t *tiles, int64_t G, tw_tensor *out,
                               int accumulate, const char *op) {
  const char *why;
  if (!gg_wgmma_fp8_takes(ctx, lhs, rhs, rhs_op, out, &why))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA_FP8, why);
  if (!(rhs->colwise && rhs_op == TW_OP_N))
    return ggf_forward_kmajor(ctx, lhs, rhs, rhs_op, offsets, tiles, G, out, accumulate, op);
  const int64_t M = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1];
  if (M == 0 || N == 0 || G == 0) return TW_OK;
  const int64_t ktn = (K + 127) / 128, ntn = (N + 127) / 128;
  const size_t code_bytes = ((size_t)(G * N * K) + 255) & ~(size_t)255;
  const size_t scale_bytes = rhs->mxfp8_swizzled ? 0 : (size_t)(G * ntn * ktn) * 512;
  unsigned char *pad = NULL;
  int in_graph = 0;
  TW_TRY(ggf_pad_buffer(ctx, code_bytes + scale_bytes, &pad, &in_graph, "grouped_gemm"));
  ggf_tparams tp;
  tp.src = (const unsigned char *)rhs->data.data;
  tp.dst = pad;
  tp.ssrc = rhs->mxfp8_swizzled ? NULL : (const unsigned char *)rhs->scale_inv.data;
  tp.sdst = pad + code_bytes;
  tp.K = K;
  tp.N = N;
  tp.G = G;
  tp.ktn = ktn;
  tp.ntn = ntn;
  tp.lds = rhs->scale_inv.shape[1];
  gpu_state *st = gpu_of(ctx);
  const int64_t tiles_t = G * ktn * ntn, cap = 8 * (int64_t)st->num_sms;
  ggf_pad_mxt<<<(unsigned)(tiles_t < cap ? tiles_t : cap), 256, 0, st->stream>>>(tp);
  tw_status s = gpu_cuda_status(cudaGetLastError(), op);
  if (s == TW_OK) {
    tw_operand rw = *rhs;  // the rowwise MXFP8 operand of the transposed source [G*N, K]
    rw.data = tw_tensor_2d(pad, rhs->data.dtype, G * N, K, TW_MEM_DEVICE);
    rw.colwise = 0;
    rw.mxfp8_swizzled = 1;
    rw.src_rows = G * N;
    rw.src_cols = K;
    rw.scale_inv = tw_tensor_2d(rhs->mxfp8_swizzled ? rhs->scale_inv.data : (void *)(pad + code_bytes), TW_E8M0,
                                128 * G * ntn, 4 * ktn, TW_MEM_DEVICE);
    s = ggf_forward_kmajor(ctx, lhs, &rw, TW_OP_T, offsets, tiles, G, out, accumulate, op);
  }
  // a buffer allocated inside a capture is freed inside it too (alloc and free nodes of the graph)
  if (in_graph) {
    cudaError_t e = cudaFreeAsync(pad, st->stream);
    if (s == TW_OK && e != cudaSuccess) s = gpu_cuda_status(e, "grouped_gemm (gg_wgmma_fp8): cudaFreeAsync");
  }
  return s;
}
