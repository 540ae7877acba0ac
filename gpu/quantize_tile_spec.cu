// gpu/quantize_tile_spec.cu — quantize_tile_spec: the 128x128 tile kernel compiled once per
// (x dtype, scaling family, layout, fp8 format), so that each instance holds only the work of
// its own mode. Formulas: tw_quantize.h; tiles and grid: gpu/quantize.cu's header.
//
// Why it exists: quantize_tile_async (one kernel for every mode, chosen at run time) measured
// 38-70 issued instructions per element on an H200, mostly integer address math, branches
// and predicates (ncu source counters, gpu/NOTES-quantize.md session 3), and ran issue-bound at
// 35-61% of copy bandwidth; this kernel runs every mode but current scaling at 84-92% there.
// Here:
// - 512 threads; lane (rg = lane >> 4, cg = lane & 15) of warp w owns rows 8w + 4rg .. +3 and
//   columns 8cg .. 8cg+7 of the 128x128 chunk: four 16-byte shared loads put its 32 raw
//   elements in 16 registers, and every statistic and both orientations come from there.
// - Statistics on raw 16-bit magnitudes (sign cleared, compared as unsigned 16-bit pairs:
//   the same order as |x| for bf16 and f16, NaN above inf), two elements per instruction.
// - Row blocks (MXFP8: 4 lanes, 1x128: 16 lanes) reduce two rows per shuffle; one lane per row
//   computes the block scale and shares it.
// - Column blocks go through a 4 KB table of per-warp column maxima.
// - Tensor and 128x128 scaling give the colwise (transposed) codes = the rowwise codes: a 4x4
//   byte transpose in registers, a 16 KB stage [column][row] swizzled so that both its word
//   writes and its 16-byte reads are free of bank conflicts, 16-byte stores along the
//   transposed rows. 1x128 colwise computes its own codes with per-column scales, same path.
// - x arrives by cp.async into two 32 KB buffers (chunk kc+1 streams while kc is processed);
//   a CTA walks p.chunks (4) chunks of one row tile, so the CTAs resident together read nearby
//   columns of the same rows (persistent grids measured 5-15% slower).
// Needs bf16/f16 x, K % 8 == 0, x 16-byte, row_data and MXFP8 col_data 8-byte aligned
// (transposed col_data: any alignment, stores narrow where needed).
#include <cuda_fp16.h>

#include "gpu/quantize.cuh"

#define TS_THREADS 512
#define TS_WARPS (TS_THREADS / 32)
#define TS_RB 256               // bytes per raw tile row (128 16-bit elements)
#define TS_BUF (TILE * TS_RB)   // one raw 128x128 tile
#define TS_STAGE (TILE * TILE)  // transposed codes [column][row]

namespace {

enum { FAM_TENSOR = 0, FAM_MX = 1, FAM_B1x128 = 2, FAM_B128 = 3 };

// |x| of both 16-bit elements of a raw word, and their pairwise max (unsigned 16-bit halves)
__device__ __forceinline__ uint32_t mag2(uint32_t w) { return w & 0x7FFF7FFFu; }
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
__device__ __forceinline__ uint32_t word(uint4 u, int j) { return j == 0 ? u.x : j == 1 ? u.y : j == 2 ? u.z : u.w; }
__device__ __forceinline__ uint32_t mag2_of(uint4 u) {
  return max2(max2(mag2(u.x), mag2(u.y)), max2(mag2(u.z), mag2(u.w)));
}

// a 16-bit magnitude as the bits of the f32 it equals (exact; NaN stays above 0x7F800000)
template <int XDT>
__device__ __forceinline__ uint32_t mag_bits(uint32_t m16) {
  if (XDT == XDT_BF16) return m16 << 16;
  return tw_f2u(__half2float(__ushort_as_half((unsigned short)m16)));
}
// the larger of a word's two magnitudes, as f32 bits
template <int XDT>
__device__ __forceinline__ uint32_t mag2_bits(uint32_t m) {
  return mag_bits<XDT>(max(m >> 16, m & 0xFFFFu));
}
// the larger magnitude of each of two words, packed (first in the low half)
__device__ __forceinline__ uint32_t pack_max(uint32_t a, uint32_t b) {
  return max(a >> 16, a & 0xFFFFu) | (max(b >> 16, b & 0xFFFFu) << 16);
}

// The 16-bit magnitude max of row `my` (0..3) of the lane's rows over a row block of LANES
// consecutive lanes (8 columns each): two rows per shuffled word, log2(LANES) steps.
template <int LANES>
__device__ __forceinline__ uint32_t row_block_mag(const uint32_t rm[4], int my) {
  uint32_t w01 = pack_max(rm[0], rm[1]), w23 = pack_max(rm[2], rm[3]);
#pragma unroll
  for (int d = 1; d < LANES; d <<= 1) {
    w01 = max2(w01, __shfl_xor_sync(0xffffffffu, w01, d));
    w23 = max2(w23, __shfl_xor_sync(0xffffffffu, w23, d));
  }
  const uint32_t wm = my < 2 ? w01 : w23;
  return (my & 1) ? wm >> 16 : wm & 0xFFFFu;
}

template <int XDT>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if (XDT == XDT_BF16) return make_float2(tw_u2f(w << 16), tw_u2f(w & 0xFFFF0000u));
  __half2 h;
  memcpy(&h, &w, 4);
  return __half22float2(h);
}

// four f32 -> four fp8 codes (satfinite, RNE), a in the low byte; PATCH: NaN lanes become the
// canonical positive NaN code (gpu_fp8x4_sat), needed only where a product can be NaN
template <int FP8, bool PATCH>
__device__ __forceinline__ uint32_t cvt4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (!PATCH) {
    unsigned short lo, hi;
    if (FP8 == 0) {
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    } else {
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    }
    return (uint32_t)lo | ((uint32_t)hi << 16);
  }
#endif
  return gpu_fp8x4_sat(a, b, c, d, FP8);
}

// 8 codes of one raw 16-byte piece, one scale
template <int XDT, int FP8, bool PATCH>
__device__ __forceinline__ uint2 q8(uint4 u, float s) {
  const float2 a = unpack2<XDT>(u.x), b = unpack2<XDT>(u.y), c = unpack2<XDT>(u.z), d = unpack2<XDT>(u.w);
  return make_uint2(cvt4<FP8, PATCH>(a.x * s, a.y * s, b.x * s, b.y * s),
                    cvt4<FP8, PATCH>(c.x * s, c.y * s, d.x * s, d.y * s));
}
// 8 codes of one raw 16-byte piece, one scale per column
template <int XDT, int FP8, bool PATCH>
__device__ __forceinline__ uint2 q8c(uint4 u, const float s[8]) {
  const float2 a = unpack2<XDT>(u.x), b = unpack2<XDT>(u.y), c = unpack2<XDT>(u.z), d = unpack2<XDT>(u.w);
  return make_uint2(cvt4<FP8, PATCH>(a.x * s[0], a.y * s[1], b.x * s[2], b.y * s[3]),
                    cvt4<FP8, PATCH>(c.x * s[4], c.y * s[5], d.x * s[6], d.y * s[7]));
}
// the lane's four rows; `patch` is warp-uniform, so the branch does not diverge
template <int XDT, int FP8>
__device__ __forceinline__ void q4rows(const uint4 xr[4], const float s[4], bool patch, uint2 c[4]) {
  if (patch) {
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = q8<XDT, FP8, true>(xr[i], s[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = q8<XDT, FP8, false>(xr[i], s[i]);
  }
}
template <int XDT, int FP8>
__device__ __forceinline__ void q4rows_c(const uint4 xr[4], const float s[8], bool patch, uint2 c[4]) {
  if (patch) {
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = q8c<XDT, FP8, true>(xr[i], s);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] = q8c<XDT, FP8, false>(xr[i], s);
  }
}

// 4x4 byte transpose: w0..w3 hold rows (bytes = columns 0..3) -> t[j] holds column j (bytes =
// rows 0..3)
__device__ __forceinline__ void transpose4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t *t) {
  const uint32_t a = __byte_perm(w0, w1, 0x5140), b = __byte_perm(w0, w1, 0x7362);
  const uint32_t c = __byte_perm(w2, w3, 0x5140), d = __byte_perm(w2, w3, 0x7362);
  t[0] = __byte_perm(a, c, 0x5410);
  t[1] = __byte_perm(a, c, 0x7632);
  t[2] = __byte_perm(b, d, 0x5410);
  t[3] = __byte_perm(b, d, 0x7632);
}

// Stage word of (column col, rows 4wi..4wi+3): the row-word index is XORed with 2*(col >> 3),
// so the 32 lanes of a warp (16 column groups x 2 row quads) write 32 different banks, and a
// 16-byte group of 4 row-words stays whole (its order is swapped pairwise for odd col >> 3).
__device__ __forceinline__ int stage_word(int col, int wi) { return col * 32 + (wi ^ (2 * ((col >> 3) & 15))); }

// 4 bytes at o (any alignment; one word store where aligned)
__device__ __forceinline__ void store_bytes4(uint8_t *o, uint32_t w) {
  if (((uintptr_t)o & 3) == 0) {
    *(uint32_t *)o = w;
  } else {
#pragma unroll
    for (int f = 0; f < 4; f++) o[f] = (uint8_t)(w >> (8 * f));
  }
}

// One transposed row's run of this tile: L (<= 128) bytes at `base`, lane s (of the 8 lanes
// of the column, consecutive) holding bytes 16s..16s+15 in v. Where base is 16-byte aligned
// each lane stores its own 16 bytes. Otherwise (group offsets o_g and sizes m_g not multiples
// of 16: the colwise rows of group g start at o_g*K + k*m_g) lane s stores the aligned chunk
// at offsets [16s - d, 16s - d + 16), d = base % 16: bytes 16-d.. of lane s-1's 16 (taken by
// shuffle) then bytes ..15-d of its own; lane 7 also stores the chunk after it. Full chunks
// go out as one 16-byte store, the (at most two) partial ones in aligned pieces, only the
// bytes of [0, L): the same bytes as storing each lane's 16 directly (run q1,
// gpu/NOTES-quantize.md). All 32 lanes must call it (shuffles); `live`
// says whether this lane's column is in the tile.
__device__ __forceinline__ uint4 bytes_from(const uint32_t (&w)[8], int b0) {  // bytes b0..b0+15 of w
  const int q = b0 >> 2, r = 8 * (b0 & 3);
  uint32_t x[5];
#pragma unroll
  for (int i = 0; i < 5; i++) {
    uint32_t v = w[i];
#pragma unroll
    for (int j = 1; j < 4; j++)
      if (q == j) v = w[i + j];
    x[i] = v;
  }
  return make_uint4(__funnelshift_r(x[0], x[1], r), __funnelshift_r(x[1], x[2], r), __funnelshift_r(x[2], x[3], r),
                    __funnelshift_r(x[3], x[4], r));
}
// o is 16-byte aligned; only the bytes of run offsets [0, L) among lo..lo+15 are written, as
// naturally aligned 8/4/2/1-byte pieces (a piece never crosses the chunk's 8-byte halves)
__device__ __forceinline__ void store_chunk(uint8_t *o, uint4 v, int lo, int L) {  // run offsets lo..lo+15
  if (lo >= 0 && lo + 16 <= L) {
    *(uint4 *)o = v;
    return;
  }
  const uint64_t h0 = ((uint64_t)v.y << 32) | v.x, h1 = ((uint64_t)v.w << 32) | v.z;
  int x = max(0, -lo);
  const int e = min(16, L - lo);
#pragma unroll
  for (int it = 0; it < 8; it++) {  // at most 4 pieces for a head or a tail, 7 for both
    if (x >= e) break;
    const uint64_t w = (x < 8 ? h0 : h1) >> (8 * (x & 7));
    if ((x & 7) == 0 && x + 8 <= e) {
      *(uint64_t *)(o + x) = w;
      x += 8;
    } else if ((x & 3) == 0 && x + 4 <= e) {
      *(uint32_t *)(o + x) = (uint32_t)w;
      x += 4;
    } else if ((x & 1) == 0 && x + 2 <= e) {
      *(uint16_t *)(o + x) = (uint16_t)w;
      x += 2;
    } else {
      o[x] = (uint8_t)w;
      x += 1;
    }
  }
}
__device__ __forceinline__ void store_col_run(uint8_t *base, uint4 v, int s, int L, bool live) {
  uint4 pv;
  pv.x = __shfl_up_sync(0xffffffffu, v.x, 1, 8);
  pv.y = __shfl_up_sync(0xffffffffu, v.y, 1, 8);
  pv.z = __shfl_up_sync(0xffffffffu, v.z, 1, 8);
  pv.w = __shfl_up_sync(0xffffffffu, v.w, 1, 8);
  if (!live) return;
  const int d = (int)((uintptr_t)base & 15);
  if (d == 0) {
    if (16 * s < L) store_chunk(base + 16 * s, v, 16 * s, L);
    return;
  }
  const int lo = 16 * s - d;
  if (lo < L) {
    const uint32_t w[8] = {pv.x, pv.y, pv.z, pv.w, v.x, v.y, v.z, v.w};
    store_chunk(base + lo, bytes_from(w, 16 - d), lo, L);
  }
  if (s == 7 && 128 - d < L) {
    const uint32_t w[8] = {v.x, v.y, v.z, v.w, 0u, 0u, 0u, 0u};
    store_chunk(base + 128 - d, bytes_from(w, 16 - d), 128 - d, L);
  }
}

__device__ __forceinline__ uint32_t warp_umax(uint32_t v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

template <int XDT, int FAM, bool ROW, bool COL, int FP8>
__global__ void __launch_bounds__(TS_THREADS, 2) quantize_tile_spec_kernel(QParams p) {
  constexpr bool TRANS = COL && FAM != FAM_MX;  // transposed colwise output
  extern __shared__ __align__(16) uint8_t ts_smem[];  // raw[2][TS_BUF], then the stage
  __shared__ __align__(16) uint32_t colpart[TS_WARPS][64];  // per-warp column-pair maxima
  __shared__ __align__(16) float colmul[4][TILE];          // colwise multipliers per column block
  __shared__ __align__(16) uint8_t rowe[TILE][4];          // MXFP8 rowwise exponents
  __shared__ __align__(16) uint8_t cole[4][TILE];          // MXFP8 colwise exponents
  __shared__ uint32_t red[TS_WARPS];
  __shared__ uint8_t *mx_base[2];  // MXFP8: this row tile's scale bytes, rowwise and colwise
  __shared__ int64_t mx_step;      // MXFP8 swizzled colwise: bytes from one chunk's tile to the next

  // tile and chunk indices fit 32 bits (the host keeps the 128x128 tile count < 2^31); row
  // offsets stay 64-bit. Fewer 64-bit values held across the loop: the MXFP8 row+col instance
  // spilled to local memory, which misses L1 at this shared-memory carveout
  const int nkc = (int)((p.K + TILE - 1) / TILE);
  int64_t t64, cblk64;
  tile_of_block((nkc + p.chunks - 1) / p.chunks, &t64, &cblk64);
  if (t64 >= p.tiles[p.G]) return;
  const int t = (int)t64;
  const int64_t g = find_group(p.tiles, p.G, t);
  const int tg0 = (int)p.tiles[g];
  const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
  const int a = t - tg0;
  const int64_t lr0 = (int64_t)a * TILE, r0 = og + lr0;
  const int rows = (int)min((int64_t)TILE, mg - lr0);
  const int kc_begin = (int)cblk64 * (int)p.chunks, kc_end = min(nkc, kc_begin + (int)p.chunks);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, rg = lane >> 4, cg = lane & 15;
  const int rbase = 8 * warp + 4 * rg;  // the lane's first row in the tile
  const float inv_max = 1.0f / p.fp8_max;
  const uint8_t *xb = (const uint8_t *)p.x;
  uint32_t *stage = (uint32_t *)(ts_smem + 2 * TS_BUF);

  // MXFP8 scale addresses: uniform, kept in shared memory rather than registers (held in
  // registers across the loop they spilled, and the spill reloads delayed the warps that
  // write the scales, which everyone then waited for at the next barrier)
  // (row+col only: the rowwise-only instance measured 12% slower this way, H200)
  constexpr bool MX_SHARED_BASE = FAM == FAM_MX && ROW && COL;
  uint8_t *mx_row_base = nullptr, *mx_col_base = nullptr;
  int64_t mx_col_step = 0;
  if (FAM == FAM_MX && !MX_SHARED_BASE) {
    if (ROW) mx_row_base = (uint8_t *)p.row_si + (int64_t)t * TILE * (4 * (int64_t)nkc);
    if (COL) {
      const int64_t Cc = (int64_t)TILE * nkc;
      mx_col_base = p.swz ? (uint8_t *)p.col_si + 4 * (int64_t)tg0 * Cc + (int64_t)a * 512
                          : (uint8_t *)p.col_si + 4 * (int64_t)t * Cc;
      mx_col_step = p.swz ? (p.tiles[g + 1] - tg0) * 512 : 0;
    }
  }
  if (MX_SHARED_BASE && tid == 0) {
    if (ROW) mx_base[0] = (uint8_t *)p.row_si + (int64_t)t * TILE * (4 * (int64_t)nkc);
    if (COL) {
      const int64_t Cc = (int64_t)TILE * nkc;
      if (p.swz) {
        mx_base[1] = (uint8_t *)p.col_si + 4 * (int64_t)tg0 * Cc + (int64_t)a * 512;
        mx_step = (p.tiles[g + 1] - tg0) * 512;
      } else {
        mx_base[1] = (uint8_t *)p.col_si + 4 * (int64_t)t * Cc;
      }
    }
  }

  float tensor_scale = 1.f;
  bool tensor_keeps = true;
  if (FAM == FAM_TENSOR) {
    tensor_scale = p.mode == TW_SCALE_TENSOR_CURRENT ? tw_compute_scale(p.amax[g], p.fp8_max, p.pow2) : p.scale[g];
    tensor_keeps = scale_keeps_numbers(tensor_scale);
  }
  uint32_t lane_amax = 0;  // 16-bit magnitude pairs over every chunk

  // chunk kc into buffer b: 2048 16-byte pieces, 4 per thread; pieces past the group's rows or
  // past K are zero-filled, so every statistic may include them
  auto fill = [&](int kc, int b) {
    uint8_t *buf = ts_smem + b * TS_BUF;
    const int64_t k0 = (int64_t)kc * TILE;
#pragma unroll
    for (int i = 0; i < TILE * 16 / TS_THREADS; i++) {
      const int id = i * TS_THREADS + tid, r = id >> 4, c = id & 15;
      const bool ok = r < rows && k0 + 8 * c < p.K;
      const void *src = ok ? (const void *)(xb + ((r0 + r) * p.K + k0 + 8 * c) * 2) : p.x;
      cp_async16(buf + r * TS_RB + c * 16, src, ok ? 16 : 0);
    }
    cp_async_commit();
  };

  fill(kc_begin, 0);
  for (int kc = kc_begin; kc < kc_end; kc++) {
    const int b = (int)((kc - kc_begin) & 1);
    cp_async_wait_all();
    __syncthreads();  // chunk kc is in buffer b; buffer b^1, the stage and the tables are free
    if (kc + 1 < kc_end) fill(kc + 1, b ^ 1);
    const uint8_t *buf = ts_smem + b * TS_BUF;
    const int64_t k0 = (int64_t)kc * TILE;
    const int cols = (int)min((int64_t)TILE, p.K - k0);
    const bool col_ok = 8 * cg < cols;

    uint4 xr[4];
    uint32_t rm[4];  // per row: magnitude pair max over the lane's 8 elements
#pragma unroll
    for (int i = 0; i < 4; i++) {
      xr[i] = *(const uint4 *)(buf + (rbase + i) * TS_RB + cg * 16);
      rm[i] = mag2_of(xr[i]);
    }
    const uint32_t lm = max2(max2(rm[0], rm[1]), max2(rm[2], rm[3]));
    lane_amax = max2(lane_amax, lm);
    const bool lane_nan = mag2_bits<XDT>(lm) > 0x7F800000u;

    // ---- rowwise scales (also the colwise ones of tensor and 128x128 scaling)
    float rs[4];
    if (FAM == FAM_TENSOR) {
#pragma unroll
      for (int i = 0; i < 4; i++) rs[i] = tensor_scale;
    } else if (FAM == FAM_B128) {
      const uint32_t m = warp_umax(mag2_bits<XDT>(lm));
      if (lane == 0) red[warp] = m;
      __syncthreads();
      uint32_t tm = 0;
#pragma unroll
      for (int w = 0; w < TS_WARPS; w += 4) {
        const uint4 v = *(const uint4 *)&red[w];
        tm = max(tm, max(max(v.x, v.y), max(v.z, v.w)));
      }
      const float s = tw_compute_scale(tw_u2f(tm), p.fp8_max, p.pow2);
#pragma unroll
      for (int i = 0; i < 4; i++) rs[i] = s;
      if (tid == 0) {
        const float si = tw_canon(1.0f / s);
        if (ROW) ((float *)p.row_si)[(int64_t)t * p.rs_ld + kc] = si;
        if (COL) ((float *)p.col_si)[(int64_t)kc * p.cs_ld + t] = si;
      }
    } else if (ROW && FAM == FAM_MX) {
      // blocks of 32 columns = lanes 4f..4f+3; this lane computes row `my`'s exponent
      const int my = cg & 3;
      const uint32_t m16 = row_block_mag<4>(rm, my);
      const uint8_t e = tw_f32_to_e8m0_ceil_d(tw_u2f(mag_bits<XDT>(m16)) * inv_max);
      rowe[rbase + my][cg >> 2] = e;
#pragma unroll
      for (int i = 0; i < 4; i++) rs[i] = tw_e8m0_quant_scale((uint8_t)__shfl_sync(0xffffffffu, e, (lane & ~3) | i));
    } else if (ROW && FAM == FAM_B1x128) {
      // blocks of 128 columns = the 16 lanes of a row quad; this lane computes row `my`'s scale
      const int my = cg & 3;
      const uint32_t m16 = row_block_mag<16>(rm, my);
      const float s = tw_compute_scale(tw_u2f(mag_bits<XDT>(m16)), p.fp8_max, p.pow2);
      if (cg < 4 && rbase + cg < rows) ((float *)p.row_si)[(int64_t)kc * p.rs_ld + r0 + rbase + cg] = tw_canon(1.0f / s);
#pragma unroll
      for (int i = 0; i < 4; i++) rs[i] = __shfl_sync(0xffffffffu, s, (lane & 16) | i);
    }

    // NaN products only from NaN elements (every block scale here is finite and > 0, or NaN
    // exactly when its block holds a NaN, which then sits in this warp) or a delayed scale
    const bool patch_w = __any_sync(0xffffffffu, lane_nan) || !tensor_keeps;

    // ---- rowwise codes (and the transposed colwise ones where they are the same)
    uint2 c[4];
    if (ROW || (TRANS && (FAM == FAM_TENSOR || FAM == FAM_B128))) {
      q4rows<XDT, FP8>(xr, rs, patch_w, c);
      if (ROW && col_ok) {
        uint8_t *o = p.row_data + (r0 + rbase) * p.K + k0 + 8 * cg;
#pragma unroll
        for (int i = 0; i < 4; i++)
          if (rbase + i < rows) *(uint2 *)(o + i * p.K) = c[i];
      }
    }

    // ---- colwise statistics (MXFP8: blocks of 32 rows; 1x128: the tile's 128 rows)
    bool patch_col = patch_w;
    if (COL && (FAM == FAM_MX || FAM == FAM_B1x128)) {
      uint32_t cw[4];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        cw[j] = max2(max2(mag2(word(xr[0], j)), mag2(word(xr[1], j))), max2(mag2(word(xr[2], j)), mag2(word(xr[3], j))));
        cw[j] = max2(cw[j], __shfl_xor_sync(0xffffffffu, cw[j], 16));
      }
      if (rg == 0) *(uint4 *)&colpart[warp][4 * cg] = make_uint4(cw[0], cw[1], cw[2], cw[3]);
      const bool nan_cta = __syncthreads_or(lane_nan);  // also: rowe complete
      if (FAM == FAM_MX) {
        patch_col = nan_cta;  // a block's NaN may sit in another warp
        const int blk = tid >> 7, col = tid & (TILE - 1);
        const int pw = col >> 1;
        const uint32_t m = max2(max2(colpart[4 * blk][pw], colpart[4 * blk + 1][pw]),
                                max2(colpart[4 * blk + 2][pw], colpart[4 * blk + 3][pw]));
        const uint32_t m16 = (col & 1) ? m >> 16 : m & 0xFFFFu;
        const uint8_t e = tw_f32_to_e8m0_ceil_d(tw_u2f(mag_bits<XDT>(m16)) * inv_max);
        cole[blk][col] = e;
        colmul[blk][col] = tw_e8m0_quant_scale(e);
      } else if (tid < TILE) {
        const int pw = tid >> 1;
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < TS_WARPS; w++) m = max2(m, colpart[w][pw]);
        const uint32_t m16 = (tid & 1) ? m >> 16 : m & 0xFFFFu;
        const float s = tw_compute_scale(tw_u2f(mag_bits<XDT>(m16)), p.fp8_max, p.pow2);
        colmul[0][tid] = s;
        if (tid < cols) ((float *)p.col_si)[(int64_t)t * p.cs_ld + k0 + tid] = tw_canon(1.0f / s);
      }
      __syncthreads();
      // x again from the raw buffer (intact until the next chunk's barrier): holding it in
      // registers across the two barriers made the MXFP8 row+col instance spill
#pragma unroll
      for (int i = 0; i < 4; i++) xr[i] = *(const uint4 *)(buf + (rbase + i) * TS_RB + cg * 16);
      float cs[8];
      const float4 m0 = *(const float4 *)&colmul[FAM == FAM_MX ? warp >> 2 : 0][8 * cg];
      const float4 m1 = *(const float4 *)&colmul[FAM == FAM_MX ? warp >> 2 : 0][8 * cg + 4];
      cs[0] = m0.x; cs[1] = m0.y; cs[2] = m0.z; cs[3] = m0.w;
      cs[4] = m1.x; cs[5] = m1.y; cs[6] = m1.z; cs[7] = m1.w;
      q4rows_c<XDT, FP8>(xr, cs, patch_col, c);
      if (FAM == FAM_MX && col_ok) {  // [M, K] like x
        uint8_t *o = p.col_data + (r0 + rbase) * p.K + k0 + 8 * cg;
#pragma unroll
        for (int i = 0; i < 4; i++)
          if (rbase + i < rows) *(uint2 *)(o + i * p.K) = c[i];
      }
    } else if (ROW && FAM == FAM_MX) {
      __syncthreads();  // rowe complete
    }

    // ---- transposed colwise output: group g's block [K, m_g] at o_g*K
    if (TRANS) {
      uint32_t tcol[8];
      transpose4(c[0].x, c[1].x, c[2].x, c[3].x, tcol);
      transpose4(c[0].y, c[1].y, c[2].y, c[3].y, tcol + 4);
      const int wi = 2 * warp + rg;
#pragma unroll
      for (int j = 0; j < 8; j++) stage[stage_word(8 * cg + j, wi)] = tcol[j];
      __syncthreads();
      uint8_t *colg = p.col_data + og * p.K;
#pragma unroll
      for (int u = 0; u < 2; u++) {  // every lane (store_col_run shuffles); col < 128 always
        const int it = tid + u * TS_THREADS, col = it >> 3, s = it & 7;
        const int cgc = col >> 3;
        uint4 v = *(const uint4 *)&stage[col * 32 + 4 * (s ^ (cgc >> 1))];
        if (cgc & 1) v = make_uint4(v.z, v.w, v.x, v.y);
        if (p.col_pitch)  // token-padded: an aligned 128-byte run, rows past m_g as code 0
          store_col_run(p.col_data + (k0 + col) * p.col_pitch + (int64_t)TILE * t, keep_first_bytes(v, rows - 16 * s),
                        s, TILE, col < cols);
        else
          store_col_run(colg + (k0 + col) * mg + lr0, v, s, rows, col < cols);
      }
    }

    // ---- MXFP8 scales in their final layout (compact or swizzled), one 512-byte tile each;
    // a thread's 4 bytes are consecutive in both layouts: one word store where aligned
    if (FAM == FAM_MX) {
      if (ROW && tid < TILE) {
        uint8_t *o;
        uint32_t w;
        if (p.swz) {  // 4 bytes at d*16 + b*4 of the 512-byte tile (kc); a warp reads 32 rows
          const int d = tid & 31, bq = tid >> 5;
          o = (MX_SHARED_BASE ? mx_base[0] : mx_row_base) + (int64_t)kc * 512 + d * 16 + bq * 4;
          w = *(const uint32_t *)rowe[32 * bq + d];
        } else {
          o = (MX_SHARED_BASE ? mx_base[0] : mx_row_base) + (int64_t)tid * (4 * nkc) + 4 * kc;
          w = *(const uint32_t *)rowe[tid];
        }
        store_bytes4(o, w);
      }
      if (COL && tid >= TS_THREADS - TILE) {
        const int cc = tid - (TS_THREADS - TILE);
        if (p.swz) {
          const int d = cc >> 2, bq = cc & 3, k = 32 * bq + d;
          store_bytes4((MX_SHARED_BASE ? mx_base[1] + kc * mx_step : mx_col_base + kc * mx_col_step) + d * 16 + bq * 4,
                       cole[0][k] | (cole[1][k] << 8) | (cole[2][k] << 16) | ((uint32_t)cole[3][k] << 24));
        } else {
          const int64_t Cc = (int64_t)TILE * nkc;
#pragma unroll
          for (int f = 0; f < 4; f++) (MX_SHARED_BASE ? mx_base[1] : mx_col_base)[f * Cc + k0 + cc] = cole[f][cc];
        }
      }
    }
  }

  // per-group amax (current scaling has it from its amax pass)
  if (p.amax && p.mode != TW_SCALE_TENSOR_CURRENT) {
    const uint32_t m = warp_umax(mag2_bits<XDT>(lane_amax));
    __syncthreads();  // red may still be read for the last chunk's 128x128 scale
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (tid == 0) {
      uint32_t tm = 0;
      for (int w = 0; w < TS_WARPS; w++) tm = max(tm, red[w]);
      atomic_amax(p.amax + g, tw_u2f(tm));
    }
  }
}

template <int XDT, int FAM, bool ROW, bool COL, int FP8>
cudaError_t launch_spec(const QParams &p, unsigned nblocks, cudaStream_t s) {
  auto kernel = quantize_tile_spec_kernel<XDT, FAM, ROW, COL, FP8>;
  const int smem = 2 * TS_BUF + (COL && FAM != FAM_MX ? TS_STAGE : 0);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  // shared memory for two CTAs and not more: the rest of the unified L1 stays a cache (x is
  // streamed past it, but spilled registers and the group tables are not)
  cudaFuncAttributes fa;
  int dev = 0, max_smem = 0;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kernel);
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
  if (e == cudaSuccess && max_smem > 0) {
    const long need = 2L * (smem + (long)fa.sharedSizeBytes + 1024);
    const int pct = (int)min(100L, (need * 100 + max_smem - 1) / max_smem);
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, pct);
  }
  if (e != cudaSuccess) return e;
  kernel<<<nblocks, TS_THREADS, smem, s>>>(p);
  return cudaGetLastError();
}

template <int XDT, int FAM, int FP8>
cudaError_t launch_layout(const QParams &p, unsigned nblocks, cudaStream_t s) {
  if (p.row && p.col) return launch_spec<XDT, FAM, true, true, FP8>(p, nblocks, s);
  if (p.row) return launch_spec<XDT, FAM, true, false, FP8>(p, nblocks, s);
  return launch_spec<XDT, FAM, false, true, FP8>(p, nblocks, s);
}

template <int XDT, int FAM>
cudaError_t launch_fp8(const QParams &p, unsigned nblocks, cudaStream_t s) {
  return p.fp8 == 0 ? launch_layout<XDT, FAM, 0>(p, nblocks, s) : launch_layout<XDT, FAM, 1>(p, nblocks, s);
}

template <int XDT>
cudaError_t launch_family(const QParams &p, unsigned nblocks, cudaStream_t s) {
  switch (p.mode) {
    case TW_SCALE_TENSOR_CURRENT:
    case TW_SCALE_TENSOR_DELAYED: return launch_fp8<XDT, FAM_TENSOR>(p, nblocks, s);
    case TW_SCALE_MXFP8_1D: return launch_fp8<XDT, FAM_MX>(p, nblocks, s);
    case TW_SCALE_BLOCK_1x128: return launch_fp8<XDT, FAM_B1x128>(p, nblocks, s);
    default: return launch_fp8<XDT, FAM_B128>(p, nblocks, s);
  }
}

}  // namespace

cudaError_t launch_quantize_tile_spec(int xdt, const QParams &p, unsigned nblocks, cudaStream_t s) {
  return xdt == XDT_BF16 ? launch_family<XDT_BF16>(p, nblocks, s) : launch_family<XDT_F16>(p, nblocks, s);
}
