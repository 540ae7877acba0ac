// gpu/grouped_gemm_wgmma_fp8_wgrad.cu — the wgrad of kernel version 5 (gg_wgmma_fp8): Hopper
// (sm_90a) fp8 wgmma with the contraction over each group's tokens (device group sizes).
//
//   out[g] [K, N] = sum over token blocks b of 128 of the group:  P_b * f_b
//   P_b = lhs_g^T[:, 128b..] @ rhs_g[128b.., :] over that block, in the tensor core
// fp8 wgmma reads both operands K-major (here: token-major), so the kernel takes the
// per-group transposed colwise copies (tw_quantize.h; lhs_op = rhs_op = T): group g's lhs block
// is [K, m_g] row-major at byte o_g*K, rhs [N, m_g] at o_g*N. Its rows are m_g bytes apart, so
// neither a TMA map (16-byte strides) nor one per group can address them for a general m_g.
// The default (tma) loader first copies them into token-padded matrices that one map each
// addresses (ggf_pad_colwise, below); an operand quantized token-padded (tw_quantize.h,
// opts.col_padded) already is one and is read in place (no copy, whatever the loader knob says);
// the register loaders (rows, staged) read the default layout in place,
// the producer warpgroup loading them itself (rows):
//   - thread i of the producer fills row i of the stage's A tile (out row p0 + i) and row i of
//     its B tile (out column q0 + i): the 128 bytes of tokens 128kb.. of the group, read as the
//     nine aligned 16-byte words that cover them (words holding no byte of the group's row are
//     not read; a word running past the end of the tensor is read byte by byte), shifted into
//     place (funnel shifts), bytes past m_g set to 0 (so the products of the last, partial
//     block are exact zeros, never another group's or a NaN), then stored into the 128-byte
//     swizzle layout the TMA would have written (16-byte chunk c of row r at chunk c ^ (r % 8)).
//     Rows past K (A) or N (B) are zeros.
//   - the loads of the next k-block's A row are in flight while the thread shifts and stores
//     the current B row, the next B row's while it waits for the next stage (registers: 2 x 9
//     words).
//   - each thread stores its row's scale (block modes) next to the data, fence.proxy.async
//     (generic stores -> the wgmma's async-proxy reads), arrives on full[s] (128 arrivals).
//   - the consumers are the forward's: 4 wgmma m64n128k32 per k-block, promotion every 128
//     tokens. The k-blocks are the quantizer's blocks: tokens 128b.. of the group, so a group
//     that starts anywhere is promoted exactly where the oracle's 1x128 blocks end.
//   - tiles: G x ceil(K/128) x ceil(N/BN), group-major (fixed on the host: graph-capturable);
//     a tile contracts over ceil(m_g / 128) k-blocks (device offsets). Empty groups: +0 written
//     by the consumers (accumulate: untouched), no loads.
//   - scales of the colwise copies (tw_quantize.h): 1x128 [T(g) + kb][k] (lhs rows k, rhs
//     rows n), 128x128 [k / 128][T(g) + kb]; per-tensor [g] (in the epilogue, as the forward).
// Column tile BN (kernel template, 128 | 192; knob TWIN_GG_WGMMA_FP8_WGRAD_BN=128|192, read on
// every call; default ggf_wdefault_bn: 192 per-tensor and 1x128 x 1x128, else 128): at 192 the tma loader's
// per-tensor, 1x128 and 128x128 kinds run 128 x 192 output tiles (the .cuh's wgmma m64n192k32
// ggf_mma_bn and promotion ggf_promote_n, 96 + 96 accumulators under setmaxnreg 40 / 232 as in
// the forward; 40 KiB stages: 4 with a bf16/f16 out or accumulate, 3 with the f32 TMA store; the
// rhs scale box 192 x 1; the scale warps give each column its own 128-block's 128x128 scale, a
// tile spanning two). The same promotion per column: the same bits (tests/grouped_gemm_gpu_test.c
// bn192_bits_gg_wgmma_fp8_version). MXFP8 and the rows / staged loaders stay at 128.
// Consumer turns (knob TWIN_GG_WGMMA_FP8_WGRAD_ORDER=0|1|2, read on every call; default
// ggf_wdefault_order: none per-tensor, at issue for block scales; never MXFP8): the forward's
// named-barrier gates, so one consumer warpgroup promotes while the tensor cores run the other's
// k-block (see the consumers). Same bits (test order_bits_gg_wgmma_fp8_version).
// Consumer skew (knob TWIN_GG_WGMMA_FP8_WGRAD_SKEW=h, read on every call; default 0; only without
// turns, MXFP8 never): warpgroup 1 starts once warpgroup 0 has issued h k-blocks, so the two
// warpgroups stay about h k-blocks apart and one's epilogue runs while the tensor cores still have
// the other's k-blocks (both walk the same stages; h <= stages - 2, so warpgroup 0 never waits on
// a stage that only warpgroup 1's lag keeps full). Same wgmmas and promotion: the same bits.
// gpu/NOTES-gemm.md "gg_wgmma_fp8 wgrad: 128 x 192 tiles" and "consumer turns, then 128 x 192".
// MXFP8 (kernel template MX; issue 16 item 1): the colwise MXFP8 data is not transposed
// (tw_quantize.h: [M, K] and [M, N], ops N; E8M0 scales per 32 tokens of a group and column), so
// the pad pass transposes it (ggf_pad_mx) into the same token-padded [K, Mp] / [N, Mp] matrices,
// and the tma loader runs as for the other modes. Per 128-token k-block the consumers run the
// forward's GGF_SC_MX scheme: one wgmma k32 per 32-token scaling block into fresh registers, then
//   total = fmaf(partial, sa * sb, total)
// with that block's scales decoded to f32 (2^(e-127); 0 -> 2^-127, 0xFF -> NaN), sa * sb in f32;
// blocks wholly past m_g are skipped. Since group g's tokens sit at padded column 128*T(g), the
// 32-blocks are the colwise quantizer's (counted from the group's first token). Producer warps
// 1-3 take the k-blocks in turn and decode the scale bytes into a 4 KiB slot per stage (lhs
// [4][128 rows k], rhs [4][128 columns n]): compact or swizzled colwise layout (see the MX
// producer). Declines: scale_inv not 4-byte aligned, sizes past the TMA coordinates, no encoder.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/grouped_gemm_wgmma_fp8.cuh"

struct ggf_wparams {
  const int64_t *offsets;  // device [G+1] row offsets (gpu_group_prefix)
  const int64_t *tiles;    // device [G+1] 128-row tile offsets T(g)
  const unsigned char *a, *b;          // colwise copies: lhs [K, M], rhs [N, M] (per-group blocks)
  const unsigned char *a_end, *b_end;  // one past their last byte
  void *out;                           // [G, K, N]
  int64_t K, N, G, tilesP, tilesQ;
  int accumulate;
  int mode, mode_b;  // GGF_* of lhs and rhs
  const float *sa, *sb;
  int64_t lda_s, ldb_s;
  int loader;  // GGF_WLOAD_*
  int nst;     // stages of the ring
  int64_t Mp;  // tma: columns of the token-padded copies (128 x a bound on the tiles T(G))
  int scale_tma;  // tma loader, 1x128 x 1x128: the k-block's scales come by TMA with the data
  int tma_out;    // tma loader, no accumulate: tiles leave by TMA store (maps.out)
  int epi_bytes;  // the epilogue's staging (ggf_wepi_bytes)
  int a_sw, b_sw;  // MXFP8: scale bytes in the swizzled (1) or compact (0) order
  int order;       // consumer turns (see the consumers): 0 none, 1 gate opened at issue, 2 at completion
  int bn;          // the column tile: 128, or 192 (tma loader, not MXFP8; the kernel's BN)
  int skew;        // k-blocks warpgroup 0 issues before warpgroup 1 starts (0: together; order 0 only)
};
// The tma loader's tensor maps: the padded copies a [K, Mp], b [N, Mp] (fp8) and, scale_tma,
// the colwise 1x128 scales sa [T, lda_s], sb [T, ldb_s] (f32; box 128 x 1 at (p0 or q0, T(g) + kb):
// the row starts are multiples of 128 floats, so every box starts 16-byte aligned).
// tma_out: out as a 3-D map {N, K, G} (16-bit), box 64 x 64 x 1 with the 128-byte swizzle; the
// store clips rows past K and columns past N, so edge tiles need no masks.
struct ggf_wmaps {
  CUtensorMap a, b, sa, sb, out;
};
// Two producers (TWIN_GG_WGMMA_FP8_WGRAD_LOADER=rows|staged picks one; gpu/NOTES-gemm.md):
//   rows:   each producer thread loads its A row and B row into registers (9 aligned words
//           each), shifts them and stores them into the stage; 6 stages.
//   staged: the producer warpgroup cp.async's the aligned words of a k-block's 256 rows
//           (consecutive threads on consecutive words: coalesced) into a raw buffer, GGF_WRAW
//           buffers deep (two k-blocks in flight ahead of the one being shifted, no registers
//           held), then shifts raw -> stage (8 threads per row, one 16-byte chunk each); 3 stages.
//   tma:    (default) a pass before the GEMM copies both colwise operands into token-padded
//           matrices lhs [K, Mp], rhs [N, Mp] (ggf_pad_colwise: group g's tokens at columns
//           128*T(g).., zeros up to its next 128 boundary), so every k-block of every group is
//           one 128 x 128 box at column 128*(T(g) + kb) of a plain 2-D map: the forward's TMA
//           producer (one thread) and scale warps. The shifting is done once per operand byte
//           instead of once per output column tile (N/128 or K/128 times).
// Epilogue (tma loader): without accumulate, where out's rows are 16-byte multiples, each
// consumer warpgroup writes its 64 x 128 result into shared memory as 128-byte-row boxes and
// one thread TMA-stores them (clipped at K and N), draining while the next tile runs: with one
// k-block per tile (small groups) the stores were half of each tile's serial chain (run fw7:
// G128 1.62 -> 0.73 ms). Otherwise (accumulate, odd rows, knob TWIN_GG_WGMMA_FP8_WGRAD_EPI=staged)
// the staged epilogue below: f32 staging, 16-byte row stores by the consumers. Same bits.
enum { GGF_WLOAD_ROWS = 0, GGF_WLOAD_STAGED = 1, GGF_WLOAD_TMA = 2 };
#define GGF_WLOAD_DEFAULT GGF_WLOAD_TMA  // rows: run fw1 (H100) 173-205 TFLOP/s, staged 137-149
#define GGF_WRAW 3
#define GGF_WRAW_ROW 144                              // 9 aligned 16-byte words hold any 128 bytes
#define GGF_WRAW_BYTES (256 * GGF_WRAW_ROW + 256 * 4)  // A and B rows, then their 256 scales
// The tma loader's epilogue stages each consumer warpgroup's 64 x 128 result in two 64 x 64 f32
// halves, then writes whole rows with 16-byte stores: the register epilogue's 4-byte stores, 8
// rows per warp instruction, held the write-bound shapes (small groups: out[G, K, N] dwarfs the
// operands) at ~1 TB/s (run fw4). Rows are padded to 72 floats: a half-warp's 64-bit writes (4
// rows x 4 column pairs) then hit 32 distinct banks; with 68 they conflicted and shared memory
// was the G128 wgrad's busiest unit (ncu: 42% excess wavefronts, L1 73%). 36 KiB: 5 stages.
#define GGF_EPI_PITCH 72
// Named barriers: 0 __syncthreads, 1 the staged producer (128 threads), 2 + c consumer warpgroup
// c's epilogue (128), GGF_WGATE + c the gate of warpgroup c's turn (256: see the consumers).
#define GGF_WGATE 4
#define GGF_WSKEW 6  // warpgroup 1's start under the skew (256: see the consumers)
#define GGF_EPI_BYTES (2 * 64 * GGF_EPI_PITCH * 4)
#define GGF_WTMA_STAGES 5
// tma_out staging: per consumer warpgroup its 64 x 128 tile as boxes of 128-byte rows (16-bit:
// two 64 x 64, f32: four 32 x 64); f32 needs 64 KiB, so the ring drops to 4 stages there.
// BN = 192: three 64 x 64 (six 32 x 64) boxes per warpgroup, 48 (96) KiB.
#define GGF_WEPI_TMA_BYTES(f32, BN) ((f32) ? 512 * (BN) : 256 * (BN))
static int ggf_wepi_bytes(int loader, int tma_out, int f32, int bn) {
  if (loader != GGF_WLOAD_TMA) return 0;
  const int t = tma_out ? GGF_WEPI_TMA_BYTES(f32, bn) : 0;
  return t > GGF_EPI_BYTES ? t : GGF_EPI_BYTES;
}
// MXFP8 (kernel template MX): a stage's scales are lhs [4 sub-blocks of 32 tokens][128 rows k]
// and rhs [4][128 columns n], decoded to f32 (4 KiB; the forward's GGF_MXSTAGE layout), so that
// the consumers promote with the forward's ggf_promote.
#define GGF_WMX 3  // the wgrad's scale mode for MXFP8 (the .cuh's ggf_mode_of has no MXFP8)
#define GGF_WMXSTAGE (2 * 4 * 128)
// Column tile BN (kernel template; knob TWIN_GG_WGMMA_FP8_WGRAD_BN=128|192, see the host side):
// a stage holds A 128 x 128 and B BN x 128 fp8 (BN = 192: 40 KiB) and 128 + BN scales.
#define GGF_WSTAGE_BYTES(BN) (GGF_A_BYTES + (BN) * GGF_BK)
#define GGF_WSST(MX, BN) ((MX) ? GGF_WMXSTAGE : GGF_BM + (BN))
static inline int ggf_wmode_of(int m) { return m == TW_SCALE_MXFP8_1D ? GGF_WMX : ggf_mode_of(m); }
static size_t ggf_wsmem(int loader, int nst, int epi_bytes, int mx, int bn) {
  return (size_t)nst * GGF_WSTAGE_BYTES(bn) + 1024 + (loader == GGF_WLOAD_STAGED ? GGF_WRAW * GGF_WRAW_BYTES : 0) +
         (size_t)epi_bytes + (size_t)nst * GGF_WSST(mx, bn) * 4 + 2 * (size_t)nst * 8;
}

#ifdef WGC_DEVICE
// One tile row of 128 tokens: the aligned 16-byte words w[0..8] that cover bytes
// [row, row + nv) (nv >= 1); words past them are 0.
__device__ __forceinline__ void ggf_row_load(const unsigned char *row, int nv, const unsigned char *end, uint4 (&w)[9]) {
  const unsigned char *a0 = (const unsigned char *)((uintptr_t)row & ~(uintptr_t)15), *lim = row + nv;
#pragma unroll
  for (int i = 0; i < 9; ++i) {
    const unsigned char *q = a0 + 16 * i;
    if (q < lim && q + 16 <= end) {
      w[i] = __ldg((const uint4 *)q);
    } else if (q < lim) {  // the tensor's last, partial word
      uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll 1
      for (int b = 0; b < 16 && q + b < end; ++b) v[b / 4] |= (uint32_t)q[b] << (8 * (b % 4));
      w[i] = make_uint4(v[0], v[1], v[2], v[3]);
    } else {
      w[i] = make_uint4(0, 0, 0, 0);
    }
  }
}
template <int J>
__device__ __forceinline__ uint32_t ggf_word(const uint4 (&w)[9]) {
  return (J & 3) == 0 ? w[J >> 2].x : (J & 3) == 1 ? w[J >> 2].y : (J & 3) == 2 ? w[J >> 2].z : w[J >> 2].w;
}
// 32-bit word j of the row (bytes 4j..4j+3 from row): words q + j and q + j + 1 of the aligned
// stream, q = off / 4, shifted right by 8 * (off % 4) bits.
template <int J>
__device__ __forceinline__ uint32_t ggf_pick(const uint4 (&w)[9], int q) {
  const uint32_t v0 = ggf_word<J>(w), v1 = ggf_word<J + 1>(w), v2 = ggf_word<J + 2>(w), v3 = ggf_word<(J + 3 < 36 ? J + 3 : 35)>(w);
  return q == 0 ? v0 : q == 1 ? v1 : q == 2 ? v2 : v3;
}
template <int C>
__device__ __forceinline__ void ggf_row_chunk(const uint4 (&w)[9], int q, int sh, int nv, unsigned char *line, int r) {
  uint32_t o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int j = 4 * C + e;
    uint32_t x0, x1;
    switch (e) {  // constant after unrolling
      case 0: x0 = ggf_pick<4 * C + 0>(w, q); x1 = ggf_pick<4 * C + 1>(w, q); break;
      case 1: x0 = ggf_pick<4 * C + 1>(w, q); x1 = ggf_pick<4 * C + 2>(w, q); break;
      case 2: x0 = ggf_pick<4 * C + 2>(w, q); x1 = ggf_pick<4 * C + 3>(w, q); break;
      default: x0 = ggf_pick<4 * C + 3>(w, q); x1 = ggf_pick<4 * C + 4 < 33 ? 4 * C + 4 : 32>(w, q); break;
    }
    uint32_t v = __funnelshift_r(x0, x1, sh);
    const int nb = nv - 4 * j;  // valid bytes of this word
    if (nb < 4) v = nb <= 0 ? 0u : v & ((1u << (8 * nb)) - 1u);
    o[e] = v;
  }
  *(uint4 *)(line + ((C ^ (r & 7)) << 4)) = make_uint4(o[0], o[1], o[2], o[3]);
}
// Row r of a 128 x 128 fp8 tile (128-byte swizzle) from the words of ggf_row_load; off = the
// row's address % 16; bytes nv.. are 0.
__device__ __forceinline__ void ggf_row_store(const uint4 (&w)[9], int off, int nv, unsigned char *tile, int r) {
  unsigned char *line = tile + r * 128;
  const int q = off >> 2, sh = 8 * (off & 3);
  ggf_row_chunk<0>(w, q, sh, nv, line, r);
  ggf_row_chunk<1>(w, q, sh, nv, line, r);
  ggf_row_chunk<2>(w, q, sh, nv, line, r);
  ggf_row_chunk<3>(w, q, sh, nv, line, r);
  ggf_row_chunk<4>(w, q, sh, nv, line, r);
  ggf_row_chunk<5>(w, q, sh, nv, line, r);
  ggf_row_chunk<6>(w, q, sh, nv, line, r);
  ggf_row_chunk<7>(w, q, sh, nv, line, r);
}

// Tile t -> group g, out row start p0, column start q0, the group's rows and T(g).
struct ggf_wtile {
  int64_t g, p0, q0, og, mg, tg;
  int kts;
};
// 32-bit divisions (the host declines 2^31 tiles or more): three 64-bit ones were a long
// dependent chain at every tile's start in the producer, the scale warps and the consumers,
// which with one k-block per tile (small groups) is most of a tile's time.
template <int BN = GGF_BN>
__device__ __forceinline__ ggf_wtile ggf_wlocate(const ggf_wparams &p, int64_t t) {
  ggf_wtile w;
  const uint32_t tq = (uint32_t)p.tilesQ, per = (uint32_t)p.tilesP * tq, tt = (uint32_t)t;
  const uint32_t g = tt / per, local = tt - g * per, pp = local / tq;
  w.g = g;
  w.p0 = (int64_t)pp * GGF_BM;
  w.q0 = (int64_t)(local - pp * tq) * BN;
  w.og = p.offsets[w.g];
  w.mg = p.offsets[w.g + 1] - w.og;
  w.tg = p.tiles[w.g];
  w.kts = (int)((w.mg + GGF_BK - 1) / GGF_BK);
  return w;
}
// The producer's view of one k-block: where its A row and B row start, and their scales.
struct ggf_wjob {
  const unsigned char *ra, *rb;  // NULL: the row is past K / N (zeros)
  int nv;                        // valid tokens in this block (1..128)
  float fa, fb;
};
template <bool BL>
__device__ __forceinline__ void ggf_wjob_setup(const ggf_wparams &p, const ggf_wtile &w, int kb, int i, ggf_wjob &j) {
  const int64_t t0 = (int64_t)kb * GGF_BK, k = w.p0 + i, n = w.q0 + i;
  const int64_t left = w.mg - t0;
  j.nv = (int)(left < GGF_BK ? left : GGF_BK);
  j.ra = k < p.K ? p.a + w.og * p.K + k * w.mg + t0 : NULL;
  j.rb = n < p.N ? p.b + w.og * p.N + n * w.mg + t0 : NULL;
  if (BL) {
    const int64_t tb = w.tg + kb;
    j.fa = !j.ra ? 0.f : p.mode == GGF_B1x128 ? p.sa[tb * p.lda_s + k] : p.sa[(w.p0 / 128) * p.lda_s + tb];
    j.fb = !j.rb ? 0.f : p.mode_b == GGF_B1x128 ? p.sb[tb * p.ldb_s + n] : p.sb[(w.q0 / 128) * p.ldb_s + tb];
  }
}

// ---- the staged producer -----------------------------------------------------------------------
// A cursor over the producer's k-blocks: tiles blockIdx.x, + gridDim.x, ... with work, then
// their k-blocks (the consumers walk the same sequence).
struct ggf_wcursor {
  int64_t t;
  int kb;
  bool ok;
  ggf_wtile w;
};
__device__ __forceinline__ void ggf_wcur_seek(const ggf_wparams &p, ggf_wcursor &c, int64_t t) {
  const int64_t total = p.G * p.tilesP * p.tilesQ;
  c.ok = false;
  c.kb = 0;
  for (; t < total; t += gridDim.x) {
    c.w = ggf_wlocate(p, t);
    if (c.w.kts > 0) {
      c.ok = true;
      c.t = t;
      return;
    }
  }
}
__device__ __forceinline__ void ggf_wcur_next(const ggf_wparams &p, ggf_wcursor &c) {
  if (++c.kb < c.w.kts) return;
  ggf_wcur_seek(p, c, c.t + gridDim.x);
}
__device__ __forceinline__ void ggf_cp16(unsigned char *dst, const unsigned char *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(wgc_smem(dst)), "l"(src) : "memory");
}
// 16 bytes of src from byte q (16-aligned) on, reading no byte at or past end.
__device__ __forceinline__ uint4 ggf_load16(const unsigned char *q, const unsigned char *end) {
  if (q + 16 <= end) return __ldg((const uint4 *)q);
  uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll 1
  for (int b = 0; b < 16 && q + b < end; ++b) v[b / 4] |= (uint32_t)q[b] << (8 * (b % 4));
  return make_uint4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void ggf_cp4(void *dst, const void *src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(wgc_smem(dst)), "l"(src) : "memory");
}
// The raw words of k-block c: thread tid copies words i = tid + 128n (n < 9) of the 128 A rows
// (row i / 9, word i % 9) and the same of the B rows: aligned 16-byte words, only those that
// hold a byte of the row's nv tokens (the tensor's last partial word zero-filled past its end,
// loaded by the thread itself);
// block modes also the row's scale. One commit group per k-block.
template <bool BL>
__device__ __forceinline__ void ggf_wissue(const ggf_wparams &p, const ggf_wcursor &c, unsigned char *rb, int tid) {
  const ggf_wtile &w = c.w;
  const int64_t t0 = (int64_t)c.kb * GGF_BK, left = w.mg - t0;
  const int nv = (int)(left < GGF_BK ? left : GGF_BK);
#pragma unroll
  for (int side = 0; side < 2; ++side) {
    const int64_t ext = side ? p.N : p.K, r0 = side ? w.q0 : w.p0;
    const unsigned char *end = side ? p.b_end : p.a_end;
    const unsigned char *row0 = (side ? p.b : p.a) + w.og * ext + r0 * w.mg + t0;
    const int64_t rows = ext - r0 < 128 ? ext - r0 : 128;  // valid rows of the tile
    unsigned char *dst0 = rb + side * 128 * GGF_WRAW_ROW;
    int row = tid / 9, word = tid - 9 * (tid / 9);
#pragma unroll
    for (int n = 0; n < 9; ++n) {
      if (row < rows) {
        const unsigned char *rp = row0 + row * w.mg;
        const unsigned char *q = (const unsigned char *)((uintptr_t)rp & ~(uintptr_t)15) + 16 * word;
        unsigned char *dst = dst0 + row * GGF_WRAW_ROW + 16 * word;
        // the tensor's last, partial word byte by byte and stored in place (visible after the
        // bar.sync that precedes the shift): a cp.async with fewer source bytes (src-size) was
        // reported by compute-sanitizer memcheck as a 16-byte read past the allocation (run wt2)
        if (q < rp + nv) {
          if (q + 16 <= end) ggf_cp16(dst, q);
          else *(uint4 *)dst = ggf_load16(q, end);
        }
      }
      row += 14;  // i += 128 = 14 * 9 + 2
      word += 2;
      if (word >= 9) {
        word -= 9;
        ++row;
      }
    }
    if (BL && tid < rows) {
      const int64_t tb = w.tg + c.kb, r = r0 + tid;
      const int m = side ? p.mode_b : p.mode;
      const float *f = side ? p.sb : p.sa;
      const int64_t ld = side ? p.ldb_s : p.lda_s;
      ggf_cp4(rb + 256 * GGF_WRAW_ROW + 4 * (128 * side + tid), m == GGF_B1x128 ? f + tb * ld + r : f + (r0 / 128) * ld + tb);
    }
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// 16 bytes of a row from its raw words w0, w1 (word ch and ch + 1 of the row's aligned stream):
// bytes off .. off + 15 of the pair, bytes from vb on set to 0 (vb = valid bytes of the chunk).
__device__ __forceinline__ uint4 ggf_shift16(uint4 w0, uint4 w1, int off, int vb) {
  const uint32_t x[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  const int q = off >> 2, sh = 8 * (off & 3);
  uint32_t y[5];
#pragma unroll
  for (int m = 0; m < 5; ++m) y[m] = q == 0 ? x[m] : q == 1 ? x[m + 1] : q == 2 ? x[m + 2] : x[m + 3 < 8 ? m + 3 : 7];
  uint32_t o[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    uint32_t v = __funnelshift_r(y[e], y[e + 1], sh);
    const int nb = vb - 4 * e;
    if (nb < 4) v = nb <= 0 ? 0u : v & ((1u << (8 * nb)) - 1u);
    o[e] = v;
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}
#endif  // WGC_DEVICE
// ---- the tma producer's pass: token-padded copies of the colwise operands -------------------------
// dst[r, 16c .. 16c+15] for chunk c of the padded token axis (tile c / 8 of T(G) tiles; side 0:
// lhs, R = K rows; side 1: rhs, R = N rows): tokens j0 .. j0+15 of the tile's group g,
// j0 = 128 (c/8 - T(g)) + 16 (c%8), read from its block [R, m_g] at byte o_g*R (row r at
// + r*m_g); tokens past m_g are zeros. One thread per chunk and row; rows strided by gridDim.y.
__global__ void ggf_pad_colwise(const ggf_wparams p, unsigned char *pa, unsigned char *pb, int side0) {
#ifdef WGC_DEVICE
  const int side = side0 + blockIdx.z;  // side0 = 1: the lhs came token-padded (only the rhs is copied)
  const int64_t R = side ? p.N : p.K, c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 8 * p.tiles[p.G]) return;
  const unsigned char *src = side ? p.b : p.a, *end = side ? p.b_end : p.a_end;
  unsigned char *dst = side ? pb : pa;
  const int64_t tile = c >> 3;
  int64_t lo = 0, hi = p.G - 1;
  while (lo < hi) {  // last g with T(g) <= tile: the non-empty group holding it
    const int64_t mid = (lo + hi + 1) >> 1;
    if (p.tiles[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  const int64_t og = p.offsets[lo], mg = p.offsets[lo + 1] - og;
  const int64_t j0 = (tile - p.tiles[lo]) * 128 + (c & 7) * 16, left = mg - j0;
  const int vb = (int)(left < 16 ? left : 16);
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
    uint4 o = make_uint4(0, 0, 0, 0);
    if (vb > 0) {
      const unsigned char *row = src + og * R + r * mg + j0;
      const unsigned char *q = (const unsigned char *)((uintptr_t)row & ~(uintptr_t)15);
      const int off = (int)((uintptr_t)row & 15);
      const uint4 w0 = ggf_load16(q, end);
      const uint4 w1 = off + vb > 16 ? ggf_load16(q + 16, end) : make_uint4(0, 0, 0, 0);
      o = ggf_shift16(w0, w1, off, vb);
    }
    *(uint4 *)(dst + r * p.Mp + 16 * c) = o;
  }
#endif
}
// MXFP8's colwise data is not transposed (tw_quantize.h: [M, K] like the source, only the
// scales run along the tokens), and fp8 wgmma reads both operands token-major, so the pad pass
// transposes: dst[r, 128*t + j] = src[o_g + 128*(t - T(g)) + j, r] for the 128-token tile t of
// group g (tokens past m_g: 0), the same token-padded matrices lhs [K, Mp], rhs [N, Mp] as
// ggf_pad_colwise writes, so the TMA producer and the k-blocks are the other modes'.
// One CTA per (token tile, 128 columns r, side): 128 x 128 bytes through shared memory.
//   load:  thread (row j = tid/8 + 32i, 16-byte word w = tid%8) reads tokens' rows (coalesced:
//          a warp reads 4 rows x 128 bytes) and stores 4 words into row j at word column
//          (4w + e) ^ 2*(j/16) (33 words a row: conflict-free stores, and the reads below)
//   store: thread (chunk c = tid%8 of 16 tokens, word column q = tid/8) reads the 16 words
//          (tokens 16c.., columns 4q..4q+3), transposes them 4x4 bytes at a time (byte_perm) and
//          writes 16 tokens of the 4 rows 4q..4q+3 (a warp writes 16 whole 128-byte rows).
// Rows of src that are not 16-byte multiples (or an unaligned base) are read byte by byte.
#define GGF_PMX_PITCH 33
__global__ void __launch_bounds__(256) ggf_pad_mx(const ggf_wparams p, unsigned char *pa, unsigned char *pb) {
#ifdef WGC_DEVICE
  __shared__ uint32_t tw[128 * GGF_PMX_PITCH];
  const int side = blockIdx.z, tid = threadIdx.x;
  const int64_t R = side ? p.N : p.K, r0 = (int64_t)blockIdx.y * 128, t = blockIdx.x;
  if (t >= p.tiles[p.G] || r0 >= R) return;
  int64_t lo = 0, hi = p.G - 1;
  while (lo < hi) {  // last g with T(g) <= t: the non-empty group holding token tile t
    const int64_t mid = (lo + hi + 1) >> 1;
    if (p.tiles[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  const int64_t og = p.offsets[lo], mg = p.offsets[lo + 1] - og, j0 = (t - p.tiles[lo]) * 128;
  const int nt = (int)(mg - j0 < 128 ? mg - j0 : 128), nc = (int)(R - r0 < 128 ? R - r0 : 128);
  const unsigned char *src = (side ? p.b : p.a) + (og + j0) * R + r0;
  const bool vec = (((uintptr_t)src | (uintptr_t)R) & 15) == 0;
  const int w = tid & 7;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int j = (tid >> 3) + 32 * i;
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (j < nt) {
      const unsigned char *q = src + (int64_t)j * R + 16 * w;
      if (vec && 16 * w + 16 <= nc) {
        const uint4 x = __ldg((const uint4 *)q);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
      } else {
        uint64_t lo = 0, hi = 0;
#pragma unroll 1
        for (int b = 0; b < 16 && 16 * w + b < nc; ++b) {
          const uint64_t x = q[b];
          if (b < 8) lo |= x << (8 * b);
          else hi |= x << (8 * (b - 8));
        }
        v[0] = (uint32_t)lo, v[1] = (uint32_t)(lo >> 32), v[2] = (uint32_t)hi, v[3] = (uint32_t)(hi >> 32);
      }
    }
    const int f = 2 * (j >> 4);
#pragma unroll
    for (int e = 0; e < 4; ++e) tw[j * GGF_PMX_PITCH + ((4 * w + e) ^ f)] = v[e];
  }
  __syncthreads();
  const int c = tid & 7, q = tid >> 3, f = 2 * c;  // rows 16c + i all have j / 16 = c
  uint32_t x[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) x[i] = tw[(16 * c + i) * GGF_PMX_PITCH + (q ^ f)];
  uint32_t o[4][4];  // o[e][m]: row 4q + e, tokens 16c + 4m .. + 3
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t lab = __byte_perm(x[4 * m], x[4 * m + 1], 0x5140), hab = __byte_perm(x[4 * m], x[4 * m + 1], 0x7362);
    const uint32_t lcd = __byte_perm(x[4 * m + 2], x[4 * m + 3], 0x5140), hcd = __byte_perm(x[4 * m + 2], x[4 * m + 3], 0x7362);
    o[0][m] = __byte_perm(lab, lcd, 0x5410);
    o[1][m] = __byte_perm(lab, lcd, 0x7632);
    o[2][m] = __byte_perm(hab, hcd, 0x5410);
    o[3][m] = __byte_perm(hab, hcd, 0x7632);
  }
  unsigned char *dst = (side ? pb : pa) + r0 * p.Mp + 128 * t + 16 * c;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (4 * q + e < nc) *(uint4 *)(dst + (int64_t)(4 * q + e) * p.Mp) = make_uint4(o[e][0], o[e][1], o[e][2], o[e][3]);
#endif
}
#ifdef WGC_DEVICE

template <bool BL>
__device__ void ggf_wproduce_staged(const ggf_wparams &p, unsigned char *base, unsigned char *rawbuf, float *scales,
                                    uint64_t *full, uint64_t *empty, int tid) {
  const int nst = p.nst, ch = tid & 7;
  ggf_wcursor ci, cs;  // the next k-block to issue, the next to shift
  ggf_wcur_seek(p, ci, blockIdx.x);
  cs = ci;
  int ri = 0, rs = 0, s = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int k = 0; k < GGF_WRAW - 1; ++k) {
    if (ci.ok) {
      ggf_wissue<BL>(p, ci, rawbuf + ri * GGF_WRAW_BYTES, tid);
      ggf_wcur_next(p, ci);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    ri = ri + 1 == GGF_WRAW ? 0 : ri + 1;
  }
  while (cs.ok) {
    if (ci.ok) {  // keeps GGF_WRAW - 1 k-blocks in flight ahead of this one
      ggf_wissue<BL>(p, ci, rawbuf + ri * GGF_WRAW_BYTES, tid);
      ggf_wcur_next(p, ci);
    } else {
      asm volatile("cp.async.commit_group;\n" ::: "memory");  // one group per step, so the count below holds
    }
    ri = ri + 1 == GGF_WRAW ? 0 : ri + 1;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(GGF_WRAW - 1) : "memory");
    asm volatile("bar.sync 1, 128;\n" ::: "memory");  // every thread's words of k-block cs landed
    const ggf_wtile &w = cs.w;
    const int64_t t0 = (int64_t)cs.kb * GGF_BK, left = w.mg - t0;
    const int nv = (int)(left < GGF_BK ? left : GGF_BK);
    const unsigned char *rb = rawbuf + rs * GGF_WRAW_BYTES;
    wgc_bar_wait(&empty[s], phase ^ 1);
    unsigned char *st = base + s * GGF_STAGE_BYTES;
#pragma unroll 4
    for (int n = 0; n < 16; ++n) {
      const int r = (tid >> 3) + 16 * n, side = r >> 7, rr = r & 127;
      const int64_t ext = side ? p.N : p.K, r0 = side ? w.q0 : w.p0;
      uint4 o = make_uint4(0, 0, 0, 0);
      if (r0 + rr < ext) {
        const uintptr_t rp = (uintptr_t)((side ? p.b : p.a) + w.og * ext + (r0 + rr) * w.mg + t0);
        const uint4 *rw = (const uint4 *)(rb + r * GGF_WRAW_ROW);
        o = ggf_shift16(rw[ch], rw[ch + 1], (int)(rp & 15), nv - 16 * ch);
      }
      *(uint4 *)(st + side * GGF_A_BYTES + rr * 128 + ((ch ^ (rr & 7)) << 4)) = o;
    }
    if (BL) {
      float *f = scales + s * GGF_SCALE_FLOATS;
      const float *rsf = (const float *)(rb + 256 * GGF_WRAW_ROW);
      f[tid] = w.p0 + tid < p.K ? rsf[tid] : 0.f;
      f[GGF_BM + tid] = w.q0 + tid < p.N ? rsf[128 + tid] : 0.f;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    wgc_bar_arrive(&full[s]);
    asm volatile("bar.sync 1, 128;\n" ::: "memory");  // raw buffer rs is read: free for a new issue
    rs = rs + 1 == GGF_WRAW ? 0 : rs + 1;
    if (++s == nst) {
      s = 0;
      phase ^= 1;
    }
    ggf_wcur_next(p, cs);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// 16 bytes of out (4 f32 or 8 bf16 / f16 elements from v) at element i, 16-byte aligned; with
// accumulate each is old + v in f32, then one rounding (wgc_put1's formula).
template <int OUT>
__device__ __forceinline__ void ggf_put16(void *out, int64_t i, const float *v, int acc) {
  if (OUT == TW_F32) {
    float4 *q = (float4 *)((float *)out + i);
    float4 o = make_float4(v[0], v[1], v[2], v[3]);
    if (acc) {
      const float4 a = *q;
      o.x = a.x + o.x, o.y = a.y + o.y, o.z = a.z + o.z, o.w = a.w + o.w;
    }
    *q = o;
  } else {
    uint4 *q = (uint4 *)((uint16_t *)out + i);
    uint4 old = make_uint4(0, 0, 0, 0);
    if (acc) old = *q;
    uint32_t w[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x0 = v[2 * e], x1 = v[2 * e + 1];
      if (OUT == TW_BF16) {
        __nv_bfloat162 o = *(__nv_bfloat162 *)&w[e];
        if (acc) x0 = __low2float(o) + x0, x1 = __high2float(o) + x1;
        o = __halves2bfloat162(__float2bfloat16_rn(x0), __float2bfloat16_rn(x1));
        w[e] = *(uint32_t *)&o;
      } else {
        __half2 o = *(__half2 *)&w[e];
        if (acc) x0 = __low2float(o) + x0, x1 = __high2float(o) + x1;
        o = __halves2half2(__float2half_rn(x0), __float2half_rn(x1));
        w[e] = *(uint32_t *)&o;
      }
    }
    *q = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
// The tma loader's epilogue (see GGF_EPI_PITCH): consumer warpgroup c writes its rows
// p0 + 64c .. of out[g], one 64-column part at a time (BN / 64 of them), through its staging
// buffer eb.
template <bool BL, int OUT, int BN>
__device__ __forceinline__ void ggf_epilogue_staged(const ggf_wparams &p, const ggf_wtile &w, const float *tot,
                                                    float tf, float *eb, int c, int warp, int lane, int tid) {
  constexpr int V = OUT == TW_F32 ? 4 : 8, TPR = 64 / V, RPP = 128 / TPR;  // per thread, row, pass
  const bool vec = ((uintptr_t)p.out & 15) == 0 && p.N % V == 0;
  const int rl = 16 * warp + lane / 4, cl = 2 * (lane % 4), ct = tid % TPR;
#pragma unroll
  for (int half = 0; half < BN / 64; ++half) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + c) : "memory");  // the last reads of eb are done
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = 8 * half + jj;
        const float v0 = BL ? tot[4 * j + 2 * h] : tot[4 * j + 2 * h] * tf;
        const float v1 = BL ? tot[4 * j + 2 * h + 1] : tot[4 * j + 2 * h + 1] * tf;
        *(float2 *)(eb + (rl + 8 * h) * GGF_EPI_PITCH + 8 * jj + cl) = make_float2(v0, v1);
      }
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + c) : "memory");
    const int64_t col0 = w.q0 + 64 * half + V * ct;
    for (int rr = tid / TPR; rr < 64; rr += RPP) {
      const int64_t r = w.p0 + 64 * c + rr;
      if (r >= p.K) break;
      const float *src = eb + rr * GGF_EPI_PITCH + V * ct;
      const int64_t i = (w.g * p.K + r) * p.N + col0;
      if (vec && col0 + V <= p.N) {
        float v[V];
        // 16-bit out: 8 floats a thread; threads 4-7 of each 8 read their second float4 first,
        // so each quarter-warp's 16-byte reads cover 8 distinct 16-byte bank groups
        if (V == 8) {
          const int first = (ct >> 2) & 1;
          const float4 ya = *(const float4 *)(src + 4 * first), yb = *(const float4 *)(src + 4 - 4 * first);
          const float4 lo = first ? yb : ya, hi = first ? ya : yb;
          v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
          v[4 % V] = hi.x, v[5 % V] = hi.y, v[6 % V] = hi.z, v[7 % V] = hi.w;
        } else {
          const float4 y = *(const float4 *)src;
          v[0] = y.x, v[1] = y.y, v[2] = y.z, v[3] = y.w;
        }
        ggf_put16<OUT>(p.out, i, v, p.accumulate);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (col0 + e < p.N) wgc_put1<OUT>(p.out, i + e, src[e], p.accumulate);
      }
    }
  }
}
// tma_out epilogue: consumer warpgroup c writes its 64 x BN result in boxes of 128-byte rows
// (16-bit pairs: BN/64 64 x 64 boxes; f32 pairs: BN/32 32 x 64 boxes; 128-byte swizzle: 16-byte
// chunk q of row r at chunk q ^ (r % 8)) and one thread stores them by TMA into out[g] at
// (q0, p0 + 64c). The store drains while the
// next tile runs; only the next write of the same staging waits for it (bulk wait_group.read).
// Same per-element formula as the staged epilogue (f32 value, one rounding, no accumulate).
__device__ __forceinline__ void ggf_wtma_store(const CUtensorMap *map, const void *src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"((uint64_t)map),
               "r"(wgc_smem(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
template <bool BL, int OUT, int BN>
__device__ __forceinline__ void ggf_epilogue_tma(const ggf_wparams &p, const CUtensorMap *map, const ggf_wtile &w,
                                                 const float *tot, float tf, unsigned char *ep, int c, int warp,
                                                 int lane, int tid) {
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the last store read ep
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + c) : "memory");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + lane / 4 + 8 * h;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float v0 = BL ? tot[4 * j + 2 * h] : tot[4 * j + 2 * h] * tf;
      const float v1 = BL ? tot[4 * j + 2 * h + 1] : tot[4 * j + 2 * h + 1] * tf;
      if (OUT == TW_F32) {  // columns 8j + 2(lane%4): box j/4, 16-byte chunk 2(j%4) + (lane%4)/2
        const int q = 2 * (j % 4) + (lane % 4) / 2;
        *(float2 *)(ep + (j / 4) * 8192 + r * 128 + ((q ^ (r & 7)) << 4) + 8 * (lane % 2)) = make_float2(v0, v1);
        continue;
      }
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
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes before the async proxy reads
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + c) : "memory");
  if (tid == 0) {
    constexpr int BC = OUT == TW_F32 ? 32 : 64;  // columns per box
#pragma unroll
    for (int b = 0; b < BN / BC; ++b)
      if (w.q0 + BC * b < p.N) ggf_wtma_store(map, ep + 8192 * b, (int)w.q0 + BC * b, (int)w.p0 + 64 * c, (int)w.g);
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  }
}
#endif  // WGC_DEVICE

#ifdef WGC_DEVICE
// E8M0 scale byte -> f32 as gg_scale_at (grouped_gemm_kernel.cu) and the forward's ggf_e8m0
// decode it: 2^(e-127), 0 gives 2^-127 (subnormal), 0xFF NaN.
__device__ __forceinline__ float ggf_wmx_e8m0(uint32_t e) {
  return e == 255u ? __int_as_float(0x7fc00000) : e == 0u ? __int_as_float(0x00400000) : __int_as_float((int)(e << 23));
}
// One operand's MXFP8 scales of a k-block into the stage slot f [4 sub-blocks][128 rows], from
// this lane's 4 words x[i] (see the MX producer): compact, word i = sub-block i of rows
// 4*lane..+3 (one float4 store each); swizzled, word i = rows 32i + lane, byte e = sub-block e.
// Rows r0 + r at or past `ext` (K or N) get 0.
__device__ __forceinline__ void ggf_wmx_store(float *f, const uint32_t (&x)[4], int sw, int64_t r0, int64_t ext,
                                              int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = sw ? 32 * i + lane : 4 * lane + e;
      v[e] = r0 + r < ext ? ggf_wmx_e8m0((x[i] >> (8 * e)) & 255u) : 0.f;
    }
    if (sw) {
#pragma unroll
      for (int e = 0; e < 4; ++e) f[128 * e + 32 * i + lane] = v[e];
    } else {
      *(float4 *)(f + 128 * i + 4 * lane) = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
}
#endif  // WGC_DEVICE

// maps: the tma loader's (unused by the other loaders). MX: MXFP8 (BL true too; tma loader only).
// BN: the tile's output columns n, 128 or 192 (192: the tma loader only, not MXFP8; the consumers
// hold 96 + 96 accumulators, so the warpgroups trade registers by setmaxnreg 40 / 232 as the
// forward does; BN = 128 keeps the launch-bounds allocation it had).
template <bool BL, int AT, int BT, int OUT, bool MX = false, int BN = 128>
__global__ void __launch_bounds__(GGF_THREADS, 1)
    ggf_wgrad_kernel(const __grid_constant__ ggf_wmaps maps, const ggf_wparams p) {
#ifdef WGC_DEVICE
  static_assert(BN == 128 || (BN == 192 && !MX), "wgrad BN 192: not MXFP8");
  constexpr int SST = GGF_WSST(MX, BN);                                     // scale floats per stage
  constexpr int STAGE = GGF_WSTAGE_BYTES(BN), NA = BN / 2, NJ = BN / 8;  // accumulators, 8-column groups
  extern __shared__ __align__(1024) unsigned char ggf_raw[];
  unsigned char *base = ggf_raw + ((1024 - (wgc_smem(ggf_raw) & 1023)) & 1023);
  const int nst = p.nst;
  unsigned char *rawbuf = base + nst * STAGE;  // staged loader: GGF_WRAW raw buffers
  float *epi = (float *)(rawbuf + (p.loader == GGF_WLOAD_STAGED ? GGF_WRAW * GGF_WRAW_BYTES : 0));  // tma: GGF_EPI_BYTES
  float *scales = (float *)((unsigned char *)epi + p.epi_bytes);  // [stage][128 + BN]
  uint64_t *full = (uint64_t *)(scales + nst * SST);
  uint64_t *empty = full + nst;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < nst; ++s) {
      // tma: the TMA thread (+ bytes) and, block modes without scale_tma, a scale warp; else
      // every producer thread
      wgc_bar_init(&full[s], p.loader == GGF_WLOAD_TMA ? (BL && !p.scale_tma ? 1 + 32 : 1) : 128);
      wgc_bar_init(&empty[s], 8);   // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int64_t total = p.G * p.tilesP * p.tilesQ;

  if (wg == 0 && p.loader == GGF_WLOAD_TMA) {
    if constexpr (BN != 128) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      // ---- producer (tma): k-block kb of a tile is the box at padded column 128*(T(g) + kb);
      // rows past K / N come back as zeros (TMA fill)
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&maps.a) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&maps.b) : "memory");
      const bool stma = BL && p.scale_tma;
      int s = 0;
      uint32_t phase = 0;
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const ggf_wtile w = ggf_wlocate<BN>(p, t);
        for (int kb = 0; kb < w.kts; ++kb) {
          wgc_bar_wait(&empty[s], phase ^ 1);
          unsigned char *sa = base + s * STAGE, *sb = sa + GGF_A_BYTES;
          const int col = (int)((w.tg + kb) * GGF_BK);
          wgc_bar_expect(&full[s], STAGE + (stma ? (GGF_BM + BN) * 4 : 0));
          wgc_tma_2d(sa, &maps.a, &full[s], col, (int)w.p0);
          wgc_tma_2d(sb, &maps.b, &full[s], col, (int)w.q0);
          if (stma) {
            float *f = scales + s * SST;
            wgc_tma_2d(f, &maps.sa, &full[s], (int)w.p0, (int)(w.tg + kb));
            wgc_tma_2d(f + GGF_BM, &maps.sb, &full[s], (int)w.q0, (int)(w.tg + kb));
          }
          if (++s == nst) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    } else if (MX && tid >= 32) {
      // ---- producer (tma, MXFP8): warps 1-3 in turn decode a k-block's E8M0 scales into the
      // stage: lhs rows k = p0.., rhs columns n = q0.., 4 sub-blocks of 32 tokens each. The
      // colwise scales of tw_quantize.h: group g's block starts at byte 4*T(g)*W (W = scale_inv's
      // last dimension = roundup(K or N, 128)); sub-block f of k-block kb, row r (< 128) of the tile:
      //   compact:  (4*kb + f)*W + p0 + r      (a tile's 128 rows: 128 contiguous bytes)
      //   swizzled: ((p0/128)*kts + kb)*512 + (r%32)*16 + (r/32)*4 + f   (kts = ceil(m_g/128))
      // Every byte read is inside the group's block (p0 + 127 < W); rows past K / N get 0.
      const int sw = tid / 32 - 1, lane = tid % 32;
      const unsigned char *ea = (const unsigned char *)p.sa, *eb = (const unsigned char *)p.sb;
      int s = 0, turn = 0;
      uint32_t phase = 0;
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const ggf_wtile w = ggf_wlocate<BN>(p, t);
        const unsigned char *ga = ea + 4 * w.tg * p.lda_s, *gb = eb + 4 * w.tg * p.ldb_s;
        for (int kb = 0; kb < w.kts; ++kb) {
          const bool mine = turn == sw;
          const int st = s;
          const uint32_t ph = phase;
          if (++turn == 3) turn = 0;
          if (++s == nst) {
            s = 0;
            phase ^= 1;
          }
          if (!mine) continue;
          uint32_t wa[4], wb[4];
          // compact: word i = sub-block i's rows 4*lane..+3; swizzled: word i = rows 32i + lane, f = byte
          const unsigned char *a = p.a_sw ? ga + ((w.p0 / 128) * w.kts + kb) * 512 + 16 * lane
                                          : ga + 4 * kb * p.lda_s + w.p0 + 4 * lane;
          const unsigned char *b = p.b_sw ? gb + ((w.q0 / 128) * w.kts + kb) * 512 + 16 * lane
                                          : gb + 4 * kb * p.ldb_s + w.q0 + 4 * lane;
          const int64_t sa_i = p.a_sw ? 4 : p.lda_s, sb_i = p.b_sw ? 4 : p.ldb_s;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            wa[i] = __ldg((const uint32_t *)(a + i * sa_i));
            wb[i] = __ldg((const uint32_t *)(b + i * sb_i));
          }
          wgc_bar_wait(&empty[st], ph ^ 1);
          float *f = scales + st * SST;
          ggf_wmx_store(f, wa, p.a_sw, w.p0, p.K, lane);
          ggf_wmx_store(f + 512, wb, p.b_sw, w.q0, p.N, lane);
          wgc_bar_arrive(&full[st]);
        }
      }
    } else if (BL && !MX && !p.scale_tma && tid >= 32) {
      // ---- producer (tma): warps 1-3 in turn stage a k-block's 128 row and 128 column scales
      // (the forward's scheme: three global-load latencies in flight); BN = 192: 192 columns,
      // a 128x128 rhs scale per column's 128-block (the tile spans two)
      const int sw = tid / 32 - 1, lane = tid % 32;
      int s = 0, turn = 0;
      uint32_t phase = 0;
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        const ggf_wtile w = ggf_wlocate<BN>(p, t);
        for (int kb = 0; kb < w.kts; ++kb) {
          const bool mine = turn == sw;
          const int st = s;
          const uint32_t ph = phase;
          if (++turn == 3) turn = 0;
          if (++s == nst) {
            s = 0;
            phase ^= 1;
          }
          if (!mine) continue;
          const int64_t tb = w.tg + kb;
          wgc_bar_wait(&empty[st], ph ^ 1);
          float *f = scales + st * SST + lane;
          if constexpr (BN == 128) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int64_t k = w.p0 + lane + 32 * r, n = w.q0 + lane + 32 * r;
              f[32 * r] = k >= p.K ? 0.f : p.mode == GGF_B1x128 ? p.sa[tb * p.lda_s + k] : p.sa[(w.p0 / 128) * p.lda_s + tb];
              f[GGF_BM + 32 * r] = n >= p.N ? 0.f : p.mode_b == GGF_B1x128 ? p.sb[tb * p.ldb_s + n] : p.sb[(w.q0 / 128) * p.ldb_s + tb];
            }
          } else {
            // the same values from per-k-block base pointers (the 64-bit index arithmetic above,
            // over 128 + 192 entries, spilled in the producers' 40 registers): valid rows ka and
            // columns nv of the tile. A 128x128 scale is one load per 128-block, broadcast: the
            // tile's rows share one, its columns one or two (q0 % 128 is 0 or 64: a column is in
            // block q0 / 128 or the next).
            const int ka = (int)(p.K - w.p0 < 128 ? p.K - w.p0 : 128), nv = (int)(p.N - w.q0 < BN ? p.N - w.q0 : BN);
            if (p.mode == GGF_B1x128) {
              const float *pa = p.sa + tb * p.lda_s + w.p0 + lane;
#pragma unroll
              for (int r = 0; r < 4; ++r) f[32 * r] = lane + 32 * r < ka ? __ldg(pa + 32 * r) : 0.f;
            } else {
              const float v = __ldg(p.sa + (w.p0 / 128) * p.lda_s + tb);
#pragma unroll
              for (int r = 0; r < 4; ++r) f[32 * r] = lane + 32 * r < ka ? v : 0.f;
            }
            if (p.mode_b == GGF_B1x128) {
              const float *pb = p.sb + tb * p.ldb_s + w.q0 + lane;
#pragma unroll
              for (int r = 0; r < BN / 32; ++r) f[GGF_BM + 32 * r] = lane + 32 * r < nv ? __ldg(pb + 32 * r) : 0.f;
            } else {
              const float *pb = p.sb + (w.q0 / 128) * p.ldb_s + tb;
              const int qo = (int)(w.q0 & 127) + lane;
              const float v0 = __ldg(pb), v1 = nv > 128 - (int)(w.q0 & 127) ? __ldg(pb + p.ldb_s) : 0.f;
#pragma unroll
              for (int r = 0; r < BN / 32; ++r) f[GGF_BM + 32 * r] = lane + 32 * r < nv ? (qo + 32 * r >= 128 ? v1 : v0) : 0.f;
            }
          }
          wgc_bar_arrive(&full[st]);
        }
      }
    }
  } else if (wg == 0 && (MX || p.loader == GGF_WLOAD_STAGED)) {
    if constexpr (!MX && BN == 128) ggf_wproduce_staged<BL>(p, base, rawbuf, scales, full, empty, tid);  // MX: tma only
  } else if (wg == 0) {
   if constexpr (BN == 128) {  // BN = 192 runs the tma loader only
    // ---- producer (rows): thread tid fills row tid of the A and B tiles of every stage -----
    int s = 0;
    uint32_t phase = 0;
    uint4 wa[9], wb[9];
    ggf_wjob cur;
    int64_t t = blockIdx.x;
    ggf_wtile w;
    int kb = 0;
    bool have = false;
    for (; t < total; t += gridDim.x) {  // first tile with work
      w = ggf_wlocate(p, t);
      if (w.kts > 0) {
        have = true;
        break;
      }
    }
    if (have) {
      ggf_wjob_setup<BL>(p, w, 0, tid, cur);
      if (cur.ra) ggf_row_load(cur.ra, cur.nv, p.a_end, wa);
      if (cur.rb) ggf_row_load(cur.rb, cur.nv, p.b_end, wb);
    }
    while (have) {
      // the next k-block (this tile's next, or the next tile with work)
      ggf_wtile wn = w;
      int kbn = kb + 1;
      bool next = kbn < w.kts;
      if (!next) {
        kbn = 0;
        for (int64_t tn = t + gridDim.x; tn < total; tn += gridDim.x) {
          wn = ggf_wlocate(p, tn);
          if (wn.kts > 0) {
            next = true;
            t = tn;
            break;
          }
        }
      }
      wgc_bar_wait(&empty[s], phase ^ 1);
      unsigned char *st = base + s * GGF_STAGE_BYTES;
      if (cur.ra) ggf_row_store(wa, (int)((uintptr_t)cur.ra & 15), cur.nv, st, tid);
      else {
#pragma unroll
        for (int c = 0; c < 8; ++c) *(uint4 *)(st + tid * 128 + 16 * c) = make_uint4(0, 0, 0, 0);
      }
      const ggf_wjob done = cur;
      ggf_wjob nj;
      // the next A row's loads fly while this B row is shifted and stored
      if (next) {
        ggf_wjob_setup<BL>(p, wn, kbn, tid, nj);
        if (nj.ra) ggf_row_load(nj.ra, nj.nv, p.a_end, wa);
      }
      if (done.rb) ggf_row_store(wb, (int)((uintptr_t)done.rb & 15), done.nv, st + GGF_A_BYTES, tid);
      else {
#pragma unroll
        for (int c = 0; c < 8; ++c) *(uint4 *)(st + GGF_A_BYTES + tid * 128 + 16 * c) = make_uint4(0, 0, 0, 0);
      }
      if (next && nj.rb) ggf_row_load(nj.rb, nj.nv, p.b_end, wb);
      if (BL) {
        float *f = scales + s * SST;
        f[tid] = done.fa;
        f[GGF_BM + tid] = done.fb;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      wgc_bar_arrive(&full[s]);
      if (++s == nst) {
        s = 0;
        phase ^= 1;
      }
      have = next;
      if (next) {
        cur = nj;
        w = wn;
        kb = kbn;
      }
    }
   }
  } else {
    // ---- consumers: warpgroup c = wg - 1 owns out rows p0 + 64c .. + 63 (the forward's), BN columns
    if constexpr (BN != 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    // the warpgroup index through a shuffle (the forward's): ptxas then knows it warp-uniform and
    // keeps the descriptors in uniform registers. Only it: with warp shuffled too (and the stage
    // and k-block count), the 1x128 wgrad lost 2-4% (session 8).
    const int c = __shfl_sync(0xffffffffu, wg - 1, 0), warp = tid / 32, lane = tid % 32;
    float d[NA], tot[NA];
    int s = 0;
    uint32_t phase = 0;
    const bool pairs = (p.N & 1) == 0 && ((uintptr_t)p.out & (OUT == TW_F32 ? 7 : 3)) == 0;
    // Turns (p.order, the forward's scheme; not MXFP8): both warpgroups wait on the same full
    // barrier, so left alone they issue their wgmmas together, finish together and promote
    // together while the tensor cores idle. Named barrier GGF_WGATE + c gates warpgroup c's
    // issue; the other warpgroup opens it once it has issued its own k-block (order 1) or once
    // that k-block's wgmmas completed (order 2); warpgroup 1 opens the first. The tensor cores
    // then run one warpgroup's k-block while the other promotes. Each gate opens exactly as often
    // as it is waited on, whatever tiles, groups (empty ones: no k-block, no gate) or k-blocks
    // this CTA gets: warpgroup 1 opens gate 0 once before its first k-block and once after each;
    // warpgroup 0 waits on it before each of its k-blocks and once more after its last tile (the
    // forward instead skips warpgroup 1's last opening, which needs to know the CTA's last
    // k-block: here the last tile may belong to an empty group). Both warpgroups walk the same
    // k-blocks, so warpgroup 0 is at most one issue ahead.
    const bool order = p.order != 0 && !MX, at_issue = p.order == 1;
    // Stage 0's descriptors and the full barriers' address, computed once (the forward's reason:
    // per-k32 descriptor arithmetic sat between the wgmmas, ncu session 7).
    const uint32_t da0 = (uint32_t)wgc_desc(wgc_smem(base) + c * (64 * GGF_BK), 16, 1024);
    const uint32_t db0 = (uint32_t)wgc_desc(wgc_smem(base) + GGF_A_BYTES, 16, 1024);
    const uint32_t full_at = wgc_smem(full);
    if (order && c == 1) ggf_named_arrive(GGF_WGATE, 256);
    // Skew (p.skew, never with turns): warpgroup 1 waits until warpgroup 0 has issued p.skew
    // k-blocks (or has none left); the gate opens exactly once.
    const int skew = order ? 0 : p.skew;
    int ahead = 0;  // warpgroup 0's k-blocks issued, counted up to skew
    if (skew && c == 1) ggf_named_sync(GGF_WSKEW, 256);
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
      const ggf_wtile w = ggf_wlocate<BN>(p, t);
      const int64_t r0 = w.p0 + 64 * c + 16 * warp + lane / 4;
      const int64_t cbase = w.q0 + 2 * (lane % 4);
      if (w.kts == 0) {  // empty group: out[g] = +0 (accumulate: untouched)
        if (p.accumulate) continue;
        for (int h = 0; h < 2; ++h) {
          const int64_t r = r0 + 8 * h;
          if (r >= p.K) continue;
          const int64_t rowbase = (w.g * p.K + r) * p.N;
          for (int j = 0; j < NJ; ++j) {
            const int64_t col = cbase + 8 * j;
            if (col < p.N) wgc_put1<OUT>(p.out, rowbase + col, 0.f, 0);
            if (col + 1 < p.N) wgc_put1<OUT>(p.out, rowbase + col + 1, 0.f, 0);
          }
        }
        continue;
      }
#pragma unroll
      for (int i = 0; i < NA; ++i) tot[i] = 0.f;
      for (int kt = 0; kt < w.kts; ++kt) {
        wgc_bar_wait_at(full_at + 8 * s, phase);
        const uint32_t da = da0 + s * (STAGE / 16), db = db0 + s * (STAGE / 16);  // + 2 per k32 step
        if (MX) {
          // MXFP8 (the forward's GGF_SC_MX consumer): one wgmma k32 per 32-token scaling block
          // into fresh registers (scale_d 0), then total = fmaf(partial, sa * sb, total) with
          // that block's decoded scales. Blocks wholly past m_g are skipped (tokens past m_g are
          // zeros and their scale bytes padding: never used).
          const float *fs = scales + s * SST;
          const int ra = 64 * c + 16 * warp + lane / 4;
          const int64_t left = w.mg - (int64_t)kt * GGF_BK;
          const int nsub = left >= GGF_BK ? 4 : (int)((left + 31) / 32);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (k >= nsub) break;
            wgc_fence();
            ggf_mma<AT, BT>(d, wgc_desc_lo(da + 2 * k), wgc_desc_lo(db + 2 * k), 0);
            wgc_commit();
            wgc_wait<0>();
            wgc_touch<64>(d);
            ggf_promote(d, tot, fs[128 * k + ra], fs[128 * k + ra + 8], fs + 512 + 128 * k, lane);
          }
          __syncwarp();
          if (lane == 0) wgc_bar_arrive(&empty[s]);
          if (++s == nst) {
            s = 0;
            phase ^= 1;
          }
          continue;
        }
        // the lhs scales are read before the issue (the forward's order)
        float fa0 = 0.f, fa1 = 0.f;
        if (BL) {
          const float *f = scales + s * SST;
          fa0 = f[64 * c + 16 * warp + lane / 4];
          fa1 = f[64 * c + 16 * warp + lane / 4 + 8];
        }
        if (order) ggf_named_sync(GGF_WGATE + c, 256);
        wgc_fence();
#pragma unroll
        for (int k = 0; k < GGF_BK / 32; ++k)
          ggf_mma_bn<BN, AT, BT>(d, wgc_desc_lo(da + 2 * k), wgc_desc_lo(db + 2 * k), k > 0 ? 1 : 0);
        wgc_commit();
        if (order && at_issue) ggf_named_arrive(GGF_WGATE + 1 - c, 256);
        if (c == 0 && ahead < skew && ++ahead == skew) ggf_named_arrive(GGF_WSKEW, 256);
        wgc_wait<0>();
        if (order && !at_issue) ggf_named_arrive(GGF_WGATE + 1 - c, 256);
        wgc_touch<NA>(d);
        if (BL) {
          ggf_promote_n<NJ>(d, tot, fa0, fa1, scales + s * SST + GGF_BM, lane);
          __syncwarp();
          if (lane == 0) wgc_bar_arrive(&empty[s]);
        } else {
          __syncwarp();
          if (lane == 0) wgc_bar_arrive(&empty[s]);
#pragma unroll
          for (int i = 0; i < NA; ++i) tot[i] += d[i];
        }
        if (++s == nst) {
          s = 0;
          phase ^= 1;
        }
      }
      // ---- epilogue: out[g] rows r0 (+8), columns cbase + 8j (+1)
      const float tf = BL ? 1.f : p.sa[w.g] * p.sb[w.g];
      if (p.tma_out) {
        ggf_epilogue_tma<BL, OUT, BN>(p, &maps.out, w, tot, tf, (unsigned char *)epi + c * (p.epi_bytes / 2), c, warp,
                                  lane, tid);
        continue;
      }
      if (p.loader == GGF_WLOAD_TMA) {
        ggf_epilogue_staged<BL, OUT, BN>(p, w, tot, tf, epi + c * 64 * GGF_EPI_PITCH, c, warp, lane, tid);
        continue;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = r0 + 8 * h;
        if (r >= p.K) continue;
        const int64_t rowbase = (w.g * p.K + r) * p.N;
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
    // warpgroup 1's last opening of gate 0 (its first, if this CTA had no k-block)
    if (order && c == 0) ggf_named_sync(GGF_WGATE, 256);
    // the skew gate, if warpgroup 0 had fewer than skew k-blocks
    if (c == 0 && ahead < skew) ggf_named_arrive(GGF_WSKEW, 256);
    // the staging must stay valid until the last store has read it
    if (p.tma_out && tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
#endif
}

int gg_wgmma_fp8_wgrad_takes(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                             const tw_tensor *out, const char **why) {
  gpu_state *st = gpu_of(ctx);
  const int ma = ggf_wmode_of(lhs->mode), mb = ggf_wmode_of(rhs->mode);
  const int mx = ma == GGF_WMX || mb == GGF_WMX;
  *why = NULL;
  if (st->sm != 90) *why = "needs an sm_90 device (fp8 wgmma)";
  else if (!ggf_fp8(lhs->data.dtype) || !ggf_fp8(rhs->data.dtype) || ma < 0 || mb < 0 ||
           (mx ? ma != mb : (ma == GGF_TENSOR) != (mb == GGF_TENSOR)))
    *why = "takes fp8 operands with per-tensor, 1x128, 128x128 or MXFP8 (both) scales only";
  else if (mx) {
    // MXFP8: the colwise data [M, K] / [M, N] (not transposed, ops N), scales in 32-token blocks
    const int64_t M = lhs->src_rows, G = out->shape[0];
    if (lhs_op != TW_OP_N || rhs_op != TW_OP_N || !lhs->colwise || !rhs->colwise || lhs->data.ndim != 2 ||
        rhs->data.ndim != 2 || out->ndim != 3)
      *why = "takes the MXFP8 wgrad from the colwise data [M, K] and [M, N] (lhs_op = rhs_op = N: scale blocks "
             "along the tokens)";
    else if (lhs->scale_inv.ndim != 2 || rhs->scale_inv.ndim != 2 || ((uintptr_t)lhs->scale_inv.data & 3) ||
             ((uintptr_t)rhs->scale_inv.data & 3))
      *why = "needs MXFP8 scale_inv in tw_quantize.h's colwise layout, 4-byte aligned (its scale warps read 32-bit "
             "words)";
    else if (M >= ((int64_t)1 << 31) || out->shape[0] >= ((int64_t)1 << 31) || out->shape[1] >= ((int64_t)1 << 31) ||
             out->shape[2] >= ((int64_t)1 << 31) || ((M + 127) / 128 + G) * 128 >= ((int64_t)1 << 31))
      *why = "needs M, N, K, G and the token-padded width 128 * (ceil(M/128) + G) below 2^31 (TMA coordinates)";
    else if ((out->shape[1] + 127) / 128 >= 65536 || (out->shape[2] + 127) / 128 >= 65536)
      *why = "needs K and N below 2^23 (the transposing pad pass's grid)";
    else if (out->shape[0] * ((out->shape[1] + GGF_BM - 1) / GGF_BM) * ((out->shape[2] + GGF_BN - 1) / GGF_BN) >=
             ((int64_t)1 << 31))
      *why = "needs fewer than 2^31 128x128 output tiles (32-bit tile ids)";
    else if (!wgc_encode_fn())
      *why = "needs cuTensorMapEncodeTiled in the driver (the MXFP8 wgrad runs the TMA loader only)";
  } else if (lhs_op != TW_OP_T || rhs_op != TW_OP_T || !lhs->colwise || !rhs->colwise || lhs->data.ndim != 2 ||
           rhs->data.ndim != 2 || out->ndim != 3)
    *why = "takes the wgrad from the per-group transposed colwise copies (lhs_op = rhs_op = T): fp8 wgmma reads "
           "both operands token-major";
  else if (((uintptr_t)lhs->data.data & 15) || ((uintptr_t)rhs->data.data & 15))
    *why = "needs 16-byte aligned lhs and rhs";
  else if ((lhs->col_padded || rhs->col_padded) &&
           (!wgc_encode_fn() || ((lhs->src_rows + 127) / 128 + out->shape[0]) * 128 >= ((int64_t)1 << 31)))
    *why = "reads token-padded operands by TMA only: needs cuTensorMapEncodeTiled in the driver and the padded "
           "width 128 * (ceil(M/128) + G) below 2^31";
  else if (lhs->src_rows >= ((int64_t)1 << 31) || out->shape[0] >= ((int64_t)1 << 31) ||
           out->shape[1] >= ((int64_t)1 << 31) || out->shape[2] >= ((int64_t)1 << 31))
    *why = "needs M, N, K and G below 2^31";
  else if (out->shape[0] * ((out->shape[1] + GGF_BM - 1) / GGF_BM) * ((out->shape[2] + GGF_BN - 1) / GGF_BN) >=
           ((int64_t)1 << 31))
    *why = "needs fewer than 2^31 128x128 output tiles (32-bit tile ids)";
  return *why == NULL;
}


template <bool BL, int AT, int BT, int OUT, bool MX, int BN>
static tw_status ggf_wgrad_launch_t(tw_ctx *ctx, const ggf_wmaps *m, const ggf_wparams *p, const char *op) {
  gpu_state *st = gpu_of(ctx);
  void (*fn)(const ggf_wmaps, const ggf_wparams) = ggf_wgrad_kernel<BL, AT, BT, OUT, MX, BN>;
  static int set_for[64];
  const int dev = st->device < 64 ? st->device : 0;
  const size_t smem = ggf_wsmem(p->loader, p->nst, p->epi_bytes, MX, BN);
  if (set_for[dev] < (int)smem) {
    GPU_TRY_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "grouped_gemm_wgrad (gg_wgmma_fp8): cudaFuncSetAttribute");
    set_for[dev] = (int)smem;
  }
  const int64_t total = p->G * p->tilesP * p->tilesQ;
  const unsigned grid = (unsigned)(total < st->num_sms ? total : st->num_sms);
  fn<<<grid, GGF_THREADS, smem, st->stream>>>(*m, *p);
  GPU_TRY_CUDA(cudaGetLastError(), op);
  return TW_OK;
}

template <bool BL, int AT, int BT, bool MX, int BN>
static tw_status ggf_wgrad_out_bn(tw_ctx *ctx, int od, const ggf_wmaps *m, const ggf_wparams *p, const char *op) {
  switch (od) {
    case TW_F32: return ggf_wgrad_launch_t<BL, AT, BT, TW_F32, MX, BN>(ctx, m, p, op);
    case TW_BF16: return ggf_wgrad_launch_t<BL, AT, BT, TW_BF16, MX, BN>(ctx, m, p, op);
    default: return ggf_wgrad_launch_t<BL, AT, BT, TW_F16, MX, BN>(ctx, m, p, op);
  }
}
// p->bn picks the column tile (192: never MXFP8, see the host side)
template <bool BL, int AT, int BT, bool MX = false>
static tw_status ggf_wgrad_out(tw_ctx *ctx, int od, const ggf_wmaps *m, const ggf_wparams *p, const char *op) {
  if constexpr (!MX)
    if (p->bn == 192) return ggf_wgrad_out_bn<BL, AT, BT, false, 192>(ctx, od, m, p, op);
  return ggf_wgrad_out_bn<BL, AT, BT, MX, 128>(ctx, od, m, p, op);
}

// The wgrad's defaults (knobs TWIN_GG_WGMMA_FP8_WGRAD_BN / _ORDER unset), from runs wt1 / wt2
// (H200; gpu/NOTES-gemm.md "wgrad: consumer turns, then 128 x 192 tiles again"; the forward's
// rule: 192 only where it is faster on every large shape of a mode). Per-tensor: no turns (they
// cost 1-2.5% at BN 128 and 2-5% at 192 on the large shapes), BN 192 (+3..9% over 128 on all five
// bench shapes in both runs) where N at 192 pads at most 1/16 more than at 128 (the forward's
// guard). Block scales: turns at issue (+2..4.5% at 128, +5..9% at 192), BN 128: with turns 192
// is +5..9% on G4 K7168, G4 K2048 and G8 but 0.99 on G32 m512 in all four benches (wt1 x2, wt2
// x2), so by the rule 128 (knob BN=192 for the others). 128x128 scales take the 1x128 choice
// untimed: their consumers run the same promotion (ggf_promote_n over the stage's column scales).
// The skew (session 8, gpu/NOTES-gemm.md "wgrad skew") stays 0 by default: its one large gain,
// the 1x128 wgrad of G128 m128 at BN 192 without turns and skew 1, was +10..12% over the default
// on an H200 (four benches) but -5.5% on an H100 (same build), and elsewhere it moved -2..+4%.
// 1x128 x 1x128 (the MoE block's activation pair) at 192 since session 9: with turns, +3.5..+12% over
// 128 on all five bench shapes, from the token-padded and the copied layouts alike (H200 run s9-2,
// two benches); its fp8 wgrad test set passed with 192 forced. 128x128 pairings stay at 128 (not
// measured at 192).
static int ggf_wdefault_bn(int mode, int mode_b, int64_t N) {
  const int wide = mode == GGF_TENSOR || (mode == GGF_B1x128 && mode_b == GGF_B1x128);
  return wide && ggf_n_fits_192(N) ? 192 : 128;
}
static int ggf_wdefault_order(int mode) { return mode == GGF_TENSOR ? 0 : 1; }

tw_status gg_wgmma_fp8_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                             const int64_t *offsets, const int64_t *tiles, int64_t G, tw_tensor *out, int accumulate,
                             const char *op) {
  const char *why;
  if (!gg_wgmma_fp8_wgrad_takes(ctx, lhs, lhs_op, rhs, rhs_op, out, &why))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA_FP8, why);
  const int64_t K = out->shape[1], N = out->shape[2];
  if (G == 0 || K == 0 || N == 0) return TW_OK;
  ggf_wparams p;
  memset(&p, 0, sizeof p);
  p.offsets = offsets;
  p.tiles = tiles;
  p.a = (const unsigned char *)lhs->data.data;
  p.b = (const unsigned char *)rhs->data.data;
  p.a_end = p.a + lhs->data.shape[0] * lhs->data.shape[1];
  p.b_end = p.b + rhs->data.shape[0] * rhs->data.shape[1];
  p.out = out->data;
  p.K = K;
  p.N = N;
  p.G = G;
  p.tilesP = (K + GGF_BM - 1) / GGF_BM;
  p.tilesQ = (N + GGF_BN - 1) / GGF_BN;
  p.accumulate = accumulate;
  p.mode = ggf_wmode_of(lhs->mode);
  p.mode_b = ggf_wmode_of(rhs->mode);
  const int mx = p.mode == GGF_WMX;
  p.a_sw = lhs->mxfp8_swizzled;
  p.b_sw = rhs->mxfp8_swizzled;
  p.sa = (const float *)lhs->scale_inv.data;
  p.sb = (const float *)rhs->scale_inv.data;
  p.lda_s = lhs->scale_inv.ndim >= 1 ? lhs->scale_inv.shape[lhs->scale_inv.ndim - 1] : 1;
  p.ldb_s = rhs->scale_inv.ndim >= 1 ? rhs->scale_inv.shape[rhs->scale_inv.ndim - 1] : 1;
  const char *lv = getenv("TWIN_GG_WGMMA_FP8_WGRAD_LOADER");  // measurement knob, read on every call
  p.loader = lv && !strcmp(lv, "rows")     ? GGF_WLOAD_ROWS
             : lv && !strcmp(lv, "staged") ? GGF_WLOAD_STAGED
             : lv && !strcmp(lv, "tma")    ? GGF_WLOAD_TMA
                                           : GGF_WLOAD_DEFAULT;
  if (mx) p.loader = GGF_WLOAD_TMA;  // MXFP8: the transposing pad pass + TMA only (takes checked the encoder)
  // Token-padded operands (tw_quantize.h) are already the layout the tma loader reads: no copy,
  // and the tma loader whatever the knob says (before the stages and the tile are chosen for it).
  // With M = 0 their width 128 * T_cap is 0 (no map takes that; every group is empty, nothing is
  // read): they take the copy path, whose pass copies nothing (fuzz repro gpu-wgrad-padded-m0).
  const int given[2] = {lhs->col_padded && lhs->data.shape[1] > 0, rhs->col_padded && rhs->data.shape[1] > 0};
  if (given[0] || given[1]) p.loader = GGF_WLOAD_TMA;  // (takes checked the encoder and the width)
  p.nst = p.loader == GGF_WLOAD_STAGED ? 3 : p.loader == GGF_WLOAD_TMA ? GGF_WTMA_STAGES : GGF_STAGES;
  // Consumer turns (knob TWIN_GG_WGMMA_FP8_WGRAD_ORDER=0|1|2, read on every call: none / gate
  // opened at issue / at completion; MXFP8 runs none whatever it says). Default ggf_wdefault_order.
  p.order = mx ? 0 : ggf_knob_order("TWIN_GG_WGMMA_FP8_WGRAD_ORDER", ggf_wdefault_order(p.mode));
  // Column tile (knob TWIN_GG_WGMMA_FP8_WGRAD_BN=128|192, read on every call; default
  // ggf_wdefault_bn): 192 runs the tma loader's per-tensor, 1x128 and 128x128 kinds; MXFP8 and
  // the register loaders stay at 128 (asked for 192, they run 128: the same bits either way).
  int bn = ggf_knob_bn("TWIN_GG_WGMMA_FP8_WGRAD_BN", ggf_wdefault_bn(p.mode, p.mode_b, N));
  if (mx || p.loader != GGF_WLOAD_TMA) bn = 128;
  ggf_wmaps maps;
  memset(&maps, 0, sizeof maps);
  unsigned char *pad = NULL;
  int pad_in_graph = 0;
  if (p.loader == GGF_WLOAD_TMA) {
    // Sum over groups of ceil(m_g / 128) <= ceil(M / 128) + G: the padded columns any sizes need.
    const int64_t M = lhs->src_rows;
    p.Mp = ((M + 127) / 128 + G) * 128;
    PFN_cuTensorMapEncodeTiled_v12000 enc = wgc_encode_fn();
    if (!mx && (p.Mp >= ((int64_t)1 << 31) || !enc) && !given[0] && !given[1]) {
      p.loader = GGF_WLOAD_ROWS;  // TMA coordinates are int32; no encoder: the register loader
      bn = 128;
    } else {
      const int copies = 2 - given[0] - given[1];  // sides to copy: rhs only when lhs came padded
      const int side0 = given[0] ? 1 : 0;
      unsigned char *pa = NULL, *pb = NULL;
      if (copies > 0) {
        TW_TRY(ggf_pad_buffer(ctx, (size_t)((given[0] ? 0 : K) + (given[1] ? 0 : N)) * (size_t)p.Mp, &pad,
                              &pad_in_graph, "grouped_gemm_wgrad"));
        pa = given[0] ? NULL : pad;
        pb = given[1] ? NULL : pad + (given[0] ? 0 : K * p.Mp);
      }
      const int64_t ra = given[0] ? 0 : K, rb = given[1] ? 0 : N, rows = ra > rb ? ra : rb;  // rows to copy
      if (mx) {  // transposes [M, K] / [M, N] into the same padded [K, Mp] / [N, Mp]
        dim3 pg((unsigned)(p.Mp / 128), (unsigned)((rows + 127) / 128), 2);
        ggf_pad_mx<<<pg, 256, 0, gpu_of(ctx)->stream>>>(p, pa, pb);
      } else if (copies > 0) {
        const int64_t chunks = 8 * (p.Mp / 128);
        dim3 pg((unsigned)((chunks + 255) / 256), (unsigned)(rows < 1024 ? rows : 1024), (unsigned)copies);
        ggf_pad_colwise<<<pg, 256, 0, gpu_of(ctx)->stream>>>(p, pa, pb, side0);
      }
      GPU_TRY_CUDA(cudaGetLastError(), op);
      const unsigned char *src[2] = {given[0] ? (const unsigned char *)lhs->data.data : pa,
                                     given[1] ? (const unsigned char *)rhs->data.data : pb};
      const int64_t pitch[2] = {given[0] ? lhs->data.shape[1] : p.Mp, given[1] ? rhs->data.shape[1] : p.Mp};
      const int64_t ext[2] = {K, N};
      CUtensorMap *mp[2] = {&maps.a, &maps.b};
      for (int i = 0; i < 2; ++i) {
        cuuint64_t dims[2] = {(cuuint64_t)pitch[i], (cuuint64_t)ext[i]}, strides[1] = {(cuuint64_t)pitch[i]};
        cuuint32_t box[2] = {GGF_BK, (cuuint32_t)(i ? bn : GGF_BM)}, es[2] = {1, 1};
        CUresult r = enc(mp[i], CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)src[i], dims, strides, box, es,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS)
          return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': padded %s tensor map refused (CUresult %d)", op,
                          GG_KERNEL_WGMMA_FP8, i ? "rhs" : "lhs", (int)r);
      }
      // 1x128 x 1x128: the scales by TMA too (knob TWIN_GG_WGMMA_FP8_WGRAD_SCALES=warps: the
      // three staging warps), where the layout maps: 2-D, rows 16-byte multiples, aligned bases
      const char *sv = getenv("TWIN_GG_WGMMA_FP8_WGRAD_SCALES");
      const tw_tensor *st2[2] = {&lhs->scale_inv, &rhs->scale_inv};
      p.scale_tma = p.mode == GGF_B1x128 && p.mode_b == GGF_B1x128 && !(sv && !strcmp(sv, "warps")) &&
                    st2[0]->ndim == 2 && st2[1]->ndim == 2 && p.lda_s % 4 == 0 && p.ldb_s % 4 == 0 &&
                    st2[0]->shape[0] > 0 && st2[1]->shape[0] > 0 &&  // M = 0: no rows to map (the encoder refuses 0)
                    ((uintptr_t)p.sa & 15) == 0 && ((uintptr_t)p.sb & 15) == 0;
      CUtensorMap *ms[2] = {&maps.sa, &maps.sb};
      for (int i = 0; p.scale_tma && i < 2; ++i) {
        cuuint64_t dims[2] = {(cuuint64_t)st2[i]->shape[1], (cuuint64_t)st2[i]->shape[0]};
        cuuint64_t strides[1] = {(cuuint64_t)st2[i]->shape[1] * 4};
        cuuint32_t box[2] = {(cuuint32_t)(i ? bn : GGF_BM), 1}, es[2] = {1, 1};  // rhs: the tile's BN columns
        CUresult r = enc(ms[i], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, st2[i]->data, dims, strides, box, es,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) p.scale_tma = 0;  // the staging warps take them
      }
      // no accumulate: tiles leave by TMA store (knob TWIN_GG_WGMMA_FP8_WGRAD_EPI=staged: 16-byte
      // row stores from a f32 staging, as before) where the map is legal: rows of N elements a
      // 16-byte multiple, 16-byte aligned base. The stores clip at K and N.
      const char *ev = getenv("TWIN_GG_WGMMA_FP8_WGRAD_EPI");
      const int esz = out->dtype == TW_F32 ? 4 : 2;
      if (!accumulate && (N * esz) % 16 == 0 && ((uintptr_t)out->data & 15) == 0 && !(ev && !strcmp(ev, "staged"))) {
        cuuint64_t dims[3] = {(cuuint64_t)N, (cuuint64_t)K, (cuuint64_t)G};
        cuuint64_t strides[2] = {(cuuint64_t)(N * esz), (cuuint64_t)(K * N * esz)};
        cuuint32_t box[3] = {(cuuint32_t)(128 / esz), 64, 1}, es[3] = {1, 1, 1};
        const CUtensorMapDataType dt = out->dtype == TW_F32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                       : out->dtype == TW_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
        CUresult r = enc(&maps.out, dt, 3, out->data, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                         CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        p.tma_out = r == CUDA_SUCCESS;  // refused: the staged epilogue
        if (p.tma_out && esz == 4) p.nst = GGF_WTMA_STAGES - 1;  // room for the 64 KiB f32 staging
      }
    }
  }
  p.bn = bn;
  p.tilesQ = (N + bn - 1) / bn;
  p.epi_bytes = ggf_wepi_bytes(p.loader, p.tma_out, out->dtype == TW_F32, bn);
  if (bn == 192) {  // 40 KiB stages: as many (up to 5) as fit beside the staging (bf16 out: 4, f32 TMA store: 3)
    p.nst = GGF_WTMA_STAGES;
    while (p.nst > 2 && ggf_wsmem(p.loader, p.nst, p.epi_bytes, 0, 192) > 232448) --p.nst;
  }
  // Skew (knob TWIN_GG_WGMMA_FP8_WGRAD_SKEW=h, read on every call; default 0):
  // without turns only, MXFP8 never; at most stages - 2 (warpgroup 0 may run that far ahead and
  // still find the next stage loadable: a stage is refilled once both warpgroups released it).
  // (p.nst >= 2 for every loader and tile.)
  const int h = ggf_knob_digit("TWIN_GG_WGMMA_FP8_WGRAD_SKEW", 9, 0);
  p.skew = mx || p.order != 0 ? 0 : h < p.nst - 2 ? h : p.nst - 2;
  const int at = lhs->data.dtype == TW_E5M2, bt = rhs->data.dtype == TW_E5M2, od = out->dtype;
  tw_status s;
  if (mx)
    s = at ? ggf_wgrad_out<true, 1, 0, true>(ctx, od, &maps, &p, op)
           : bt ? ggf_wgrad_out<true, 0, 1, true>(ctx, od, &maps, &p, op) : ggf_wgrad_out<true, 0, 0, true>(ctx, od, &maps, &p, op);
  else if (p.mode != GGF_TENSOR)
    s = at ? ggf_wgrad_out<true, 1, 0>(ctx, od, &maps, &p, op)
           : bt ? ggf_wgrad_out<true, 0, 1>(ctx, od, &maps, &p, op) : ggf_wgrad_out<true, 0, 0>(ctx, od, &maps, &p, op);
  else
    s = at ? ggf_wgrad_out<false, 1, 0>(ctx, od, &maps, &p, op)
           : bt ? ggf_wgrad_out<false, 0, 1>(ctx, od, &maps, &p, op) : ggf_wgrad_out<false, 0, 0>(ctx, od, &maps, &p, op);
  // a buffer allocated inside a capture is freed inside it too (alloc and free nodes of the graph)
  if (pad_in_graph) {
    cudaError_t e = cudaFreeAsync(pad, gpu_of(ctx)->stream);
    if (s == TW_OK && e != cudaSuccess) s = gpu_cuda_status(e, "grouped_gemm_wgrad (gg_wgmma_fp8): cudaFreeAsync");
  }
  return s;
}
