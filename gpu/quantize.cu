// gpu/quantize.cu — grouped quantize / dequantize / delayed-scale update on the device.
// Same names and formulas as ref/quantize.c (tw_quantize.h holds the formulas).
//
// Work is cut into group-relative tiles of 128 rows x 128 columns: tile t belongs to group g
// with T(g) <= t < T(g+1) (T from gpu_group_prefix), covers rows o_g + 128(t - T(g)) ... of
// that group only, and a 128-column chunk (a CTA walks a few of them). Every scale block of every mode (32, 128,
// 128x128, the MXFP8 128x4 swizzle tile) then lies inside one tile, so one CTA computes and
// writes its scales directly in the final layout, rowwise and colwise from one read of x.
// The grid is sized by the host's worst case T_cap; CTAs past T(G) return at once. Group sizes
// are read on the device only.
//
// Versions (tw_ctx_config.kernel). Auto picks, in order: rows for tensor scaling's rowwise-only
// output, tile_spec wherever it applies (16-bit x, K % 8 == 0, aligned), rows for the other
// rowwise-only modes, tile_async for other 16-bit x, tile_vec, tile_scalar. Measured on an H200
// (gpu/NOTES-quantize.md, session 3): tile_spec 84-92% of copy bandwidth on every mode but
// current scaling, rows 89-91% on tensor rowwise.
//   quantize_tile_spec    gpu/quantize_tile_spec.cu: the tile kernel compiled per x dtype,
//                         scaling family, layout and fp8 format; a lane holds 4 rows x 8
//                         columns, statistics on raw 16-bit magnitudes, the transposed codes of
//                         tensor/128x128 scaling transposed from the rowwise ones in registers
//   quantize_tile_vec     the tile kernel with 8/16-byte loads and 4-byte stores (auto for f32
//                         x when x, K and the outputs are 4-element aligned)
//   quantize_tile_scalar  the same kernel with element loads and byte stores (any alignment)
//   quantize_rows         rowwise-only current/delayed/MXFP8/1x128 without shared memory (K % 8
//                         == 0, x 16-byte aligned); also the amax pass of current scaling
//   quantize_tile_async   the generic tile kernel around a cp.async double-buffered raw tile,
//                         512 threads at <= 64 registers (any shape: element loads where
//                         cp.async cannot); one kernel for every mode, chosen at run time,
//                         which left it issue-bound at 35-61% (the reason tile_spec exists)
// (quantize_tile_regs, a register-tile kernel of session 2, measured slower than tile_async
// and was replaced by tile_spec.)
//
// tile_vec / tile_scalar, per tile (256 threads): load x into shared memory as f32 (16-byte chunks XOR-swizzled by row
// so that both the row pass and the 32-row column strips are free of bank conflicts); column
// statistics (MXFP8 colwise and 1x128 colwise amax) in 32-row strips; a row pass (one warp per
// row, 4 consecutive k per lane) writes rowwise data and MXFP8 colwise data; a strip pass writes
// the per-group transposed colwise data of the tensor and block modes.
// TENSOR_CURRENT needs the group's amax before any element is scaled: an amax-only pass of the
// same kernel runs first (x is read twice; the floor for that mode counts one read).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"
#include "gpu/numerics.cuh"
#include "gpu/quantize.cuh"

#define THREADS 256
#define SMEM_TILE_BYTES (TILE * TILE * 4)





template <int XDT>
__device__ __forceinline__ float load_x(const void *x, int64_t i) {
  if (XDT == XDT_F32) return ((const float *)x)[i];
  uint16_t h = ((const uint16_t *)x)[i];
  return XDT == XDT_BF16 ? tw_bf16_to_f32_d(h) : tw_f16_to_f32_d(h);
}

__device__ __forceinline__ float absmax4(float4 v) {
  return tw_nmax(tw_nmax(fabsf(v.x), fabsf(v.y)), tw_nmax(fabsf(v.z), fabsf(v.w)));
}

__device__ __forceinline__ float warp_max(float v, int width) {
  for (int d = width >> 1; d > 0; d >>= 1) v = tw_nmax(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}


__device__ __forceinline__ uint32_t quant4(float4 v, float s, int fp8) {
  return gpu_fp8x4_sat(v.x * s, v.y * s, v.z * s, v.w * s, fp8);
}

template <bool VEC>
__device__ __forceinline__ void store4(uint8_t *p, uint32_t codes, int n) {
  if (VEC && n == 4) {
    *(uint32_t *)p = codes;
    return;
  }
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(codes >> (8 * i));
}

// Swizzled f32 tile: chunk c (4 floats) of row r lives at chunk c ^ (r & 31) of that row.
__device__ __forceinline__ float4 *tile_chunk(float *tile, int r, int c) {
  return (float4 *)(tile + r * TILE + ((c ^ (r & 31)) << 2));
}

__device__ __forceinline__ float block_max(float v, float *red) {
  v = warp_max(v, 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? red[lane] : 0.f;
    v = warp_max(v, 32);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  float r = red[0];
  __syncthreads();
  return r;
}

// Four consecutive elements of x as stored (f32: four words; bf16/f16: two packed words in
// .x/.y), so a prefetch holds only the raw bytes until they are converted into the tile.
template <int XDT, bool VEC>
__device__ __forceinline__ uint4 load_raw4(const void *x, int64_t i, int n) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (XDT == XDT_F32) {
    if (VEC && n == 4) return __ldg((const uint4 *)((const float *)x + i));
    const uint32_t *w = (const uint32_t *)x + i;
    if (n > 0) r.x = w[0];
    if (n > 1) r.y = w[1];
    if (n > 2) r.z = w[2];
    if (n > 3) r.w = w[3];
    return r;
  }
  if (VEC && n == 4) {
    uint2 u = __ldg((const uint2 *)((const uint16_t *)x + i));
    r.x = u.x;
    r.y = u.y;
    return r;
  }
  const uint16_t *h = (const uint16_t *)x + i;
  if (n > 0) r.x = h[0];
  if (n > 1) r.x |= (uint32_t)h[1] << 16;
  if (n > 2) r.y = h[2];
  if (n > 3) r.y |= (uint32_t)h[3] << 16;
  return r;
}

template <int XDT>
__device__ __forceinline__ float4 raw_to_f4(uint4 r) {
  if (XDT == XDT_F32) return make_float4(tw_u2f(r.x), tw_u2f(r.y), tw_u2f(r.z), tw_u2f(r.w));
  if (XDT == XDT_BF16)
    return make_float4(tw_u2f(r.x << 16), tw_u2f(r.x & 0xFFFF0000u), tw_u2f(r.y << 16), tw_u2f(r.y & 0xFFFF0000u));
  return make_float4(tw_f16_to_f32_d((uint16_t)r.x), tw_f16_to_f32_d((uint16_t)(r.x >> 16)),
                     tw_f16_to_f32_d((uint16_t)r.y), tw_f16_to_f32_d((uint16_t)(r.y >> 16)));
}


template <int XDT, bool VEC, bool AMAX_ONLY>
__global__ void __launch_bounds__(THREADS, 2) quantize_tile_kernel(QParams p) {
  extern __shared__ float4 smem4[];
  float *tile = (float *)smem4;
  __shared__ float red[THREADS / 32];
  __shared__ float colamax[4][TILE];   // per 32-row block and column
  __shared__ float colscale[TILE];     // 1x128 colwise scale per column
  __shared__ uint8_t rowe[TILE][4];    // MXFP8 rowwise exponents of this tile
  __shared__ uint8_t cole[4][TILE];    // MXFP8 colwise exponents of this tile

  const int64_t t = blockIdx.x;
  const int64_t Ttot = p.tiles[p.G];
  if (t >= Ttot) return;
  const int64_t g = find_group(p.tiles, p.G, t);
  const int64_t tg0 = p.tiles[g], og = p.offsets[g], mg = p.offsets[g + 1] - og;
  const int64_t a = t - tg0;             // tile index inside the group
  const int64_t lr0 = a * TILE;          // first local row of the tile
  const int rows = (int)min((int64_t)TILE, mg - lr0);
  const int64_t r0 = og + lr0;           // first global row
  const int64_t nkc = (p.K + TILE - 1) / TILE;  // column chunks in all
  const int64_t kc_begin = (int64_t)blockIdx.y * TILE_CHUNKS;
  const int64_t kc_end = min(nkc, kc_begin + TILE_CHUNKS);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool mx = p.mode == TW_SCALE_MXFP8_1D;
  const float inv_max = 1.0f / p.fp8_max;
  float gmax = 0.f;  // this CTA's amax over all its chunks

  uint4 raw[16];
  auto issue_loads = [&](int64_t kc) {
    const int64_t k0 = kc * TILE;
    const int cols = (int)min((int64_t)TILE, p.K - k0);
#pragma unroll
    for (int i = 0; i < 16; i++) {
      int id = i * THREADS + tid, r = id >> 5, c = id & 31;
      int n = (r < rows) ? max(0, min(4, cols - 4 * c)) : 0;
      raw[i] = load_raw4<XDT, VEC>(p.x, (r0 + r) * p.K + k0 + 4 * c, n);
    }
  };
  issue_loads(kc_begin);

  for (int64_t kc = kc_begin; kc < kc_end; kc++) {
    const int64_t k0 = kc * TILE;
    const int cols = (int)min((int64_t)TILE, p.K - k0);
    float tmax = 0.f;
    __syncthreads();  // the previous chunk's readers are done with the tile
#pragma unroll
    for (int i = 0; i < 16; i++) {
      float4 v = raw_to_f4<XDT>(raw[i]);
      tmax = tw_nmax(tmax, absmax4(v));
      if (!AMAX_ONLY) {
        int id = i * THREADS + tid, r = id >> 5, c = id & 31;
        *tile_chunk(tile, r, c) = v;
      }
    }
    gmax = tw_nmax(gmax, tmax);
    if (kc + 1 < kc_end) issue_loads(kc + 1);  // in flight while this chunk is processed
    if (AMAX_ONLY) continue;

    float tile_amax = 0.f;
    if (p.mode == TW_SCALE_BLOCK_128x128) tile_amax = block_max(tmax, red);  // syncs
    else __syncthreads();

    float tscale = 1.f;  // the scale of tensor modes and of the 128x128 tile
    if (p.mode == TW_SCALE_TENSOR_CURRENT) tscale = tw_compute_scale(p.amax[g], p.fp8_max, p.pow2);
    else if (p.mode == TW_SCALE_TENSOR_DELAYED) tscale = p.scale[g];
    else if (p.mode == TW_SCALE_BLOCK_128x128) tscale = tw_compute_scale(tile_amax, p.fp8_max, p.pow2);

    // ---- column statistics in 32-row strips: warp handles strips warp, warp+8, ...
    const bool need_colstats = p.col && (mx || p.mode == TW_SCALE_BLOCK_1x128);
    if (need_colstats) {
      for (int s = warp; s < 128; s += THREADS / 32) {
        int rb = s >> 5, c = s & 31, r = rb * 32 + lane;
        float4 x4 = *tile_chunk(tile, r, c);
        float m0 = warp_max(fabsf(x4.x), 32), m1 = warp_max(fabsf(x4.y), 32);
        float m2 = warp_max(fabsf(x4.z), 32), m3 = warp_max(fabsf(x4.w), 32);
        if (lane == 0) {
          colamax[rb][4 * c] = m0; colamax[rb][4 * c + 1] = m1;
          colamax[rb][4 * c + 2] = m2; colamax[rb][4 * c + 3] = m3;
        }
      }
      __syncthreads();
      if (tid < TILE) {
        if (mx) {
          for (int rb = 0; rb < 4; rb++) cole[rb][tid] = tw_f32_to_e8m0_ceil_d(colamax[rb][tid] * inv_max);
        } else {
          float m = tw_nmax(tw_nmax(colamax[0][tid], colamax[1][tid]), tw_nmax(colamax[2][tid], colamax[3][tid]));
          float sc = tw_compute_scale(m, p.fp8_max, p.pow2);
          colscale[tid] = sc;
          if (tid < cols) ((float *)p.col_si)[t * p.cs_ld + k0 + tid] = tw_canon(1.0f / sc);
        }
      }
      __syncthreads();
    }

    // ---- row pass: warp per row, lane = 16-byte chunk (4 consecutive k)
    for (int r = warp; r < TILE; r += THREADS / 32) {
      float4 x4 = *tile_chunk(tile, r, lane);
      const int n = (r < rows) ? max(0, min(4, cols - 4 * lane)) : 0;
      const int64_t gi = (r0 + r) * p.K + k0 + 4 * lane;
      if (p.row) {
        float sc = tscale;
        if (mx) {
          float m = warp_max(absmax4(x4), 8);
          uint8_t e = tw_f32_to_e8m0_ceil_d(m * inv_max);
          if ((lane & 7) == 0) rowe[r][lane >> 3] = e;
          sc = tw_e8m0_quant_scale(e);
        } else if (p.mode == TW_SCALE_BLOCK_1x128) {
          float m = warp_max(absmax4(x4), 32);
          sc = tw_compute_scale(m, p.fp8_max, p.pow2);
          if (lane == 0 && r < rows) ((float *)p.row_si)[kc * p.rs_ld + r0 + r] = tw_canon(1.0f / sc);
        }
        if (n > 0) store4<VEC>(p.row_data + gi, quant4(x4, sc, p.fp8), n);
      }
      if (p.col && mx && n > 0) {
        int rb = r >> 5, c = 4 * lane;
        float4 q;
        q.x = x4.x * tw_e8m0_quant_scale(cole[rb][c]);
        q.y = x4.y * tw_e8m0_quant_scale(cole[rb][c + 1]);
        q.z = x4.z * tw_e8m0_quant_scale(cole[rb][c + 2]);
        q.w = x4.w * tw_e8m0_quant_scale(cole[rb][c + 3]);
        store4<VEC>(p.col_data + gi, gpu_fp8x4_sat(q.x, q.y, q.z, q.w, p.fp8), n);
      }
    }

    // ---- colwise transposed data (tensor and block modes): group g's block is [K, m_g] at o_g*K
    if (p.col && !mx) {
      for (int s = warp; s < 128; s += THREADS / 32) {
        int rb = s >> 5, c = s & 31, r = rb * 32 + lane;
        if (r >= rows) continue;
        float4 x4 = *tile_chunk(tile, r, c);
        float4 sc = make_float4(tscale, tscale, tscale, tscale);
        if (p.mode == TW_SCALE_BLOCK_1x128)
          sc = make_float4(colscale[4 * c], colscale[4 * c + 1], colscale[4 * c + 2], colscale[4 * c + 3]);
        uint32_t codes = gpu_fp8x4_sat(x4.x * sc.x, x4.y * sc.y, x4.z * sc.z, x4.w * sc.w, p.fp8);
        // default: group g's [K, m_g] block at o_g*K; token-padded: [K, 128*T_cap], tile t at 128*t
        const int64_t pitch = p.col_pitch ? p.col_pitch : mg;
        uint8_t *base = p.col_data + (p.col_pitch ? TILE * t : og * p.K + lr0) + r;
        int n = max(0, min(4, cols - 4 * c));
        for (int j = 0; j < n; j++) base[(k0 + 4 * c + j) * pitch] = (uint8_t)(codes >> (8 * j));
      }
      // token-padded: the tile's rows past m_g are code 0 (only a group's last tile has them)
      for (int s = warp; p.col_pitch && rows < TILE && s < 128; s += THREADS / 32) {
        int rb = s >> 5, c = s & 31, r = rb * 32 + lane;
        if (r < rows) continue;
        uint8_t *base = p.col_data + TILE * t + r;
        int n = max(0, min(4, cols - 4 * c));
        for (int j = 0; j < n; j++) base[(k0 + 4 * c + j) * p.col_pitch] = 0;
      }
    }

    // ---- per-tile scales
    if (p.mode == TW_SCALE_BLOCK_128x128 && tid == 0) {
      float si = tw_canon(1.0f / tscale);
      if (p.row) ((float *)p.row_si)[t * p.rs_ld + kc] = si;
      if (p.col) ((float *)p.col_si)[kc * p.cs_ld + t] = si;
    }
    if (mx) {
      __syncthreads();
      if (p.row && tid < TILE) {
        // rowwise block [128 rows of this tile, 4 k-blocks]: C = 4 * nkc columns in all
        uint8_t *S = (uint8_t *)p.row_si;
        const int64_t C = 4 * nkc;
        if (p.swz) {
          int d = tid >> 2, b = tid & 3;  // 4 bytes at d*16 + b*4
          uint8_t *o = S + t * TILE * C + kc * 512 + d * 16 + b * 4;
          for (int f = 0; f < 4; f++) o[f] = rowe[32 * b + d][f];
        } else {
          uint8_t *o = S + (t * TILE + tid) * C + 4 * kc;
          for (int f = 0; f < 4; f++) o[f] = rowe[tid][f];
        }
      }
      if (p.col && tid < TILE) {
        uint8_t *S = (uint8_t *)p.col_si;
        const int64_t Cc = TILE * nkc;
        if (p.swz) {
          // the group's block transposed to [Cc, 4*ntiles] and tiled: this tile's 128 columns x
          // 4 row-blocks form the tile (kc, a) of 512 bytes
          const int64_t ntiles = p.tiles[g + 1] - tg0;
          int d = tid >> 2, b = tid & 3;
          uint8_t *o = S + 4 * tg0 * Cc + (kc * ntiles + a) * 512 + d * 16 + b * 4;
          for (int f = 0; f < 4; f++) o[f] = cole[f][32 * b + d];
        } else {
          for (int f = 0; f < 4; f++) S[(4 * t + f) * Cc + k0 + tid] = cole[f][tid];
        }
      }
    }
  }
  // per-group amax: one atomic per CTA (current scaling's main pass has it from the amax pass)
  if (AMAX_ONLY || (p.amax && p.mode != TW_SCALE_TENSOR_CURRENT)) {
    float m = block_max(gmax, red);
    if (tid == 0) atomic_amax(p.amax + g, m);
  }
}

// ---- the row kernel: rowwise-only outputs of current/delayed/MXFP8/1x128 ----------------------
// No shared memory and no barriers: a lane owns 8 consecutive elements (one 16-byte load of
// bf16/f16, two of f32), a warp a 256-column piece of a row, and each warp keeps ROW_PIECES
// pieces (ROWS_SEG columns of one row) in flight before it converts them. A CTA covers 128 group-relative rows
// (one tile, so the group lookup is done once) by ROWS_SEG columns. MXFP8 blocks of 32 are 4
// lanes, 1x128 blocks 16 lanes (shuffle reductions). Needs K % 8 == 0 and aligned pointers.
// AMAX_ONLY: the first pass of current scaling (per-group amax, nothing written).
#define ROWS_SEG 1024
#define ROW_PIECES (ROWS_SEG / 256)

// 8 elements of 16-bit x from one raw 16-byte piece (the conversion load_x8 does)
template <int XDT>
__device__ __forceinline__ void raw8_to_f(uint4 u, float v[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    if (XDT == XDT_BF16) {
      v[2 * j] = tw_u2f(w[j] << 16);
      v[2 * j + 1] = tw_u2f(w[j] & 0xFFFF0000u);
    } else {
      v[2 * j] = tw_f16_to_f32_d((uint16_t)w[j]);
      v[2 * j + 1] = tw_f16_to_f32_d((uint16_t)(w[j] >> 16));
    }
  }
}

template <int XDT>
__device__ __forceinline__ void load_x8(const void *x, int64_t i, float v[8]) {
  if (XDT == XDT_F32) {
    float4 a = __ldg((const float4 *)((const float *)x + i)), b = __ldg((const float4 *)((const float *)x + i + 4));
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    return;
  }
  raw8_to_f<XDT>(__ldg((const uint4 *)((const uint16_t *)x + i)), v);
}

// max |v| as the bits of a non-negative float: NaN patterns sort above inf, so they stick.
__device__ __forceinline__ uint32_t absmax_bits8(const float v[8]) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 8; j++) m = max(m, tw_f2u(v[j]) & 0x7FFFFFFFu);
  return m;
}


// 8 codes of sat(v * s); `maybe_nan` when a product can be NaN (a NaN input, a NaN scale or a
// zero scale against an inf), which sends the lane through the NaN patch.
__device__ __forceinline__ uint2 quant8(const float v[8], float s, int fp8) {
  uint2 r;
  r.x = gpu_fp8x4_sat(v[0] * s, v[1] * s, v[2] * s, v[3] * s, fp8);
  r.y = gpu_fp8x4_sat(v[4] * s, v[5] * s, v[6] * s, v[7] * s, fp8);
  return r;
}

// sat(v * s) for 8 values known not to give a NaN product (no NaN input, s finite and > 0):
// the hardware conversion alone, without gpu_fp8x4_sat's canonical-NaN patch.
__device__ __forceinline__ uint32_t fp8x4_sat_nonan(float v0, float v1, float v2, float v3, int fp8) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short lo, hi;
  if (fp8 == 0) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
  }
  return (uint32_t)lo | ((uint32_t)hi << 16);
#else
  return gpu_fp8x4_sat(v0, v1, v2, v3, fp8);
#endif
}
// gpu_fp8x4_sat when `may_nan`, else the bare conversion (one code path, a skipped check).
__device__ __forceinline__ uint32_t fp8x4_sat_checked(float v0, float v1, float v2, float v3, int fp8, bool may_nan) {
  uint32_t r = fp8x4_sat_nonan(v0, v1, v2, v3, fp8);
  if (may_nan && (tw_isnan(v0) | tw_isnan(v1) | tw_isnan(v2) | tw_isnan(v3))) r = gpu_fp8x4_sat(v0, v1, v2, v3, fp8);
  return r;
}
__device__ __forceinline__ uint2 quant8_checked(const float v[8], float s, int fp8, bool may_nan) {
  uint2 r;
  r.x = fp8x4_sat_checked(v[0] * s, v[1] * s, v[2] * s, v[3] * s, fp8, may_nan);
  r.y = fp8x4_sat_checked(v[4] * s, v[5] * s, v[6] * s, v[7] * s, fp8, may_nan);
  return r;
}

template <int XDT, bool AMAX_ONLY>
__global__ void __launch_bounds__(THREADS, 3) quantize_rows_kernel(QParams p) {
  __shared__ uint32_t red[THREADS / 32];
  int64_t t, seg;
  tile_of_block((p.K + ROWS_SEG - 1) / ROWS_SEG, &t, &seg);
  if (t >= p.tiles[p.G]) return;
  const int64_t g = find_group(p.tiles, p.G, t);
  const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
  const int64_t lr0 = (t - p.tiles[g]) * TILE;
  const int rows = (int)min((int64_t)TILE, mg - lr0);
  const int64_t r0 = og + lr0;
  const int64_t Kpad = (p.K + TILE - 1) / TILE * TILE;  // MXFP8 scale columns reach here
  const int64_t ks = seg * ROWS_SEG;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool mx = p.mode == TW_SCALE_MXFP8_1D, b128 = p.mode == TW_SCALE_BLOCK_1x128;
  float s = 1.f;
  if (!AMAX_ONLY) {
    if (p.mode == TW_SCALE_TENSOR_CURRENT) s = tw_compute_scale(p.amax[g], p.fp8_max, p.pow2);
    else if (p.mode == TW_SCALE_TENSOR_DELAYED) s = p.scale[g];
  }
  const float inv_max = 1.0f / p.fp8_max;
  // 1x128 scales come from compute_scale (finite, > 0); tensor scales may be anything
  const bool s_keeps = b128 || scale_keeps_numbers(s);
  const int64_t C = Kpad / 32;  // MXFP8 rowwise scale columns = roundup(ceil(K/32), 4)
  uint32_t gmax = 0;
  // MXFP8 writes padding rows' zero scales too, so it walks all 128 rows
  const int row_end = mx ? TILE : rows;
  // 16-bit x: the warp's next row is loaded (raw, 16 registers) before this row is converted,
  // so its loads stay in flight through the shuffles and scale math (run 4's profile: MXFP8 and
  // 1x128 at 63% of DRAM peak where delayed reached 80%, same occupancy)
  constexpr bool PF = XDT != XDT_F32;
  uint4 nxt[ROW_PIECES];
  auto load_raw = [&](int rr, uint4 *dst) {
#pragma unroll
    for (int piece = 0; piece < ROW_PIECES; piece++) {
      const int64_t c = ks + piece * 256 + lane * 8;
      dst[piece] = make_uint4(0u, 0u, 0u, 0u);
      if (rr < rows && c < p.K) dst[piece] = __ldg((const uint4 *)((const uint16_t *)p.x + (r0 + rr) * p.K + c));
    }
  };
  if (PF) load_raw(warp, nxt);
  for (int r = warp; r < row_end; r += THREADS / 32) {
    const int64_t grow = r0 + r;
    float v[ROW_PIECES][8];
    int64_t col[ROW_PIECES];
    if (PF) {
      uint4 cur[ROW_PIECES];
#pragma unroll
      for (int piece = 0; piece < ROW_PIECES; piece++) cur[piece] = nxt[piece];
      if (r + THREADS / 32 < row_end) load_raw(r + THREADS / 32, nxt);
#pragma unroll
      for (int piece = 0; piece < ROW_PIECES; piece++) {
        col[piece] = ks + piece * 256 + lane * 8;
        raw8_to_f<XDT>(cur[piece], v[piece]);
      }
    } else {
#pragma unroll
      for (int piece = 0; piece < ROW_PIECES; piece++) {
        col[piece] = ks + piece * 256 + lane * 8;
        if (r < rows && col[piece] < p.K) load_x8<XDT>(p.x, grow * p.K + col[piece], v[piece]);
        else
#pragma unroll
          for (int j = 0; j < 8; j++) v[piece][j] = 0.f;
      }
    }
    // 1x128: the row's 8 blocks (2 per piece) get their scales from lanes 0..7, one block
    // each, so a lane does one IEEE division pair per row instead of one per piece; the
    // half-warps then take their block's scale back by shuffle
    float bsc[ROW_PIECES];
    if (!AMAX_ONLY && b128) {
      uint32_t bm[ROW_PIECES];
#pragma unroll
      for (int piece = 0; piece < ROW_PIECES; piece++) bm[piece] = shfl_umax(absmax_bits8(v[piece]), 16);
      const int jb = lane & (2 * ROW_PIECES - 1);
      uint32_t mine = 0;
#pragma unroll
      for (int piece = 0; piece < ROW_PIECES; piece++) {
        const uint32_t x = __shfl_sync(0xffffffffu, bm[piece], (jb & 1) * 16);
        if (piece == (jb >> 1)) mine = x;
      }
      const float my_sc = tw_compute_scale(tw_u2f(mine), p.fp8_max, p.pow2);
      const int64_t bcol = ks + (jb >> 1) * 256 + (jb & 1) * 128;
      if (lane < 2 * ROW_PIECES && r < rows && bcol < p.K)
        ((float *)p.row_si)[(bcol >> 7) * p.rs_ld + grow] = tw_canon(1.0f / my_sc);
#pragma unroll
      for (int piece = 0; piece < ROW_PIECES; piece++) bsc[piece] = __shfl_sync(0xffffffffu, my_sc, 2 * piece + (lane >> 4));
    }
#pragma unroll
    for (int piece = 0; piece < ROW_PIECES; piece++) {
      uint32_t m = absmax_bits8(v[piece]);
      gmax = max(gmax, m);
      if (AMAX_ONLY) continue;
      const bool in_k = col[piece] < p.K, live = r < rows && in_k;
      float sc = s;
      // no NaN can come out of this lane's products: skip the canonical-NaN patch
      bool nonan = m <= 0x7F800000u && s_keeps;
      if (mx) {
        uint32_t bm = shfl_umax(m, 4);
        nonan = bm <= 0x7F800000u;  // 2^(127-e) is finite and > 0 unless the block is NaN
        uint8_t e = tw_f32_to_e8m0_ceil_d(tw_u2f(bm) * inv_max);
        sc = tw_e8m0_quant_scale(e);
        if ((lane & 3) == 0 && col[piece] < Kpad) {
          const int64_t kb = col[piece] >> 5;
          uint8_t *S = (uint8_t *)p.row_si;
          if (p.swz) S[t * TILE * C + (kb >> 2) * 512 + (r & 31) * 16 + (r >> 5) * 4 + (kb & 3)] = e;
          else S[(t * TILE + r) * C + kb] = e;
        }
      } else if (b128) {
        sc = bsc[piece];  // its scale_inv was written above
      }
      if (live)
        *(uint2 *)(p.row_data + grow * p.K + col[piece]) = quant8_checked(v[piece], sc, p.fp8, !nonan);
    }
  }
  if (AMAX_ONLY || p.amax) {
    if (p.mode == TW_SCALE_TENSOR_CURRENT && !AMAX_ONLY) return;  // the amax pass did it
    gmax = shfl_umax(gmax, 32);
    if (lane == 0) red[warp] = gmax;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t m = 0;
      for (int w = 0; w < THREADS / 32; w++) m = max(m, red[w]);
      atomic_amax(p.amax + g, tw_u2f(m));
    }
  }
}

// ---- quantize_tile_async: the tile kernel with the raw tile staged by cp.async ----------------
// Same tiles and outputs as quantize_tile_kernel; what changes is where the time went there:
// - x is copied raw (bf16/f16/f32 bytes, no conversion) into shared memory with cp.async, two
//   buffers, so chunk j+1 streams in while chunk j is processed and no register holds it;
//   16 warps per CTA, <= 64 registers, 2 CTAs (32 warps) per SM for 16-bit x.
// - one row pass (warp w owns rows 8w..8w+7, lane = 4 consecutive k) writes the rowwise
//   output and folds in the column statistics (per-lane column max over the warp's 8 rows,
//   then 4 or 16 partials per column in shared memory), so colwise scales need no extra pass.
// - transposed colwise output: a lane reads 4 rows of one 16-byte column chunk (8 or 4
//   columns), packs each column's 4 codes into one word, the words go through a per-warp
//   transposed stage, and a lane stores 16 consecutive rows of one column with one 16-byte
//   store (4-byte or byte stores where the address or a partial tile does not allow it).
// Raw tile layout: row r is 256 (16-bit x) or 512 (f32) bytes; its 16-byte chunk c lives at
// chunk c ^ ((r >> 2) & 7), so the row pass (8-byte or 16-byte lanes along a row) and the
// column pass (8 lanes reading rows 4l+j of one chunk) are both free of bank conflicts.
// VEC: cp.async 16-byte loads and word stores (K % (16/esz) == 0, x 16-byte aligned, outputs
// 4-byte aligned); otherwise element loads into the same layout and byte stores (any shape).
#define TA_THREADS 512
#define TA_WARPS (TA_THREADS / 32)
#define TA_ROWS_PER_WARP (TILE / TA_WARPS)


template <int XDT>
struct TA {
  static constexpr int ESZ = XDT == XDT_F32 ? 4 : 2;
  static constexpr int RB = TILE * ESZ;     // bytes per tile row
  static constexpr int NC = RB / 16;        // 16-byte chunks per row
  static constexpr int EPC = 16 / ESZ;      // elements per chunk
  static constexpr int BUF = TILE * RB;     // one raw tile
  static constexpr int STAGE = EPC * 32 * 4;  // per-warp transposed stage (bytes)
  static constexpr int SMEM = 2 * BUF + TA_WARPS * STAGE;
};

__device__ __forceinline__ uint8_t *ta_chunk(uint8_t *buf, int rb, int r, int c) {
  return buf + r * rb + ((c ^ ((r >> 2) & 7)) << 4);
}

// Element e (0..EPC-1) of a raw 16-byte chunk as f32.
template <int XDT>
__device__ __forceinline__ float ta_elem(uint4 u, int e) {
  if (XDT == XDT_F32) {
    uint32_t v = e == 0 ? u.x : e == 1 ? u.y : e == 2 ? u.z : u.w;
    return tw_u2f(v);
  }
  const int wi = e >> 1;
  uint32_t v = wi == 0 ? u.x : wi == 1 ? u.y : wi == 2 ? u.z : u.w;
  if (XDT == XDT_BF16) return tw_u2f((e & 1) ? (v & 0xFFFF0000u) : (v << 16));
  return tw_f16_to_f32_d((uint16_t)((e & 1) ? (v >> 16) : v));
}

// The 4 elements 4*lane..4*lane+3 of row r of a raw tile.
template <int XDT>
__device__ __forceinline__ float4 ta_row4(uint8_t *buf, int r, int lane) {
  if (XDT == XDT_F32) return *(const float4 *)ta_chunk(buf, TA<XDT>::RB, r, lane);
  uint2 u = *(const uint2 *)(ta_chunk(buf, TA<XDT>::RB, r, lane >> 1) + ((lane & 1) << 3));
  return raw_to_f4<XDT>(make_uint4(u.x, u.y, 0u, 0u));
}

__device__ __forceinline__ uint32_t absbits(float v) { return tw_f2u(v) & 0x7FFFFFFFu; }

// Stores n (0..4) codes; word store when allowed.
template <bool VEC>
__device__ __forceinline__ void ta_store4(uint8_t *p, uint32_t codes, int n) {
  if (VEC) {  // VEC shapes have whole 4-element lanes only
    if (n == 4) *(uint32_t *)p = codes;
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++)
      if (i < n) p[i] = (uint8_t)(codes >> (8 * i));
  }
}

// max over the CTA of a per-thread value (bit patterns of non-negative floats; NaN sticks)
__device__ __forceinline__ uint32_t ta_block_umax(uint32_t v, uint32_t *red) {
  v = shfl_umax(v, 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  uint32_t m = 0;
#pragma unroll
  for (int w = 0; w < TA_WARPS; w++) m = max(m, red[w]);
  __syncthreads();
  return m;
}

template <int XDT, bool VEC>
__global__ void __launch_bounds__(TA_THREADS, 2) quantize_tile_async_kernel(QParams p) {
  typedef TA<XDT> L;
  extern __shared__ __align__(16) uint8_t ta_smem[];
  __shared__ __align__(16) uint32_t colpart[TA_WARPS][TILE];  // per-warp column max bits
  __shared__ __align__(16) uint8_t rowe[TILE][4];
  __shared__ __align__(16) uint8_t cole[4][TILE];
  __shared__ float colscale[TILE];
  __shared__ uint32_t red[TA_WARPS];

  const int64_t nkc = (p.K + TILE - 1) / TILE;
  int64_t t, cblk;
  tile_of_block((nkc + TILE_CHUNKS - 1) / TILE_CHUNKS, &t, &cblk);
  const int64_t Ttot = p.tiles[p.G];
  if (t >= Ttot) return;
  const int64_t g = find_group(p.tiles, p.G, t);
  const int64_t tg0 = p.tiles[g], og = p.offsets[g], mg = p.offsets[g + 1] - og;
  const int64_t a = t - tg0;
  const int64_t lr0 = a * TILE;
  const int rows = (int)min((int64_t)TILE, mg - lr0);
  const int64_t r0 = og + lr0;
  const int64_t kc_begin = cblk * TILE_CHUNKS;
  const int64_t kc_end = min(nkc, kc_begin + TILE_CHUNKS);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool mx = p.mode == TW_SCALE_MXFP8_1D, b128 = p.mode == TW_SCALE_BLOCK_1x128;
  const bool t128 = p.mode == TW_SCALE_BLOCK_128x128;
  const bool need_colstats = p.col && (mx || b128);
  const float inv_max = 1.0f / p.fp8_max;
  uint8_t *stage = ta_smem + 2 * L::BUF + warp * L::STAGE;
  uint32_t gmax = 0;

  float tensor_scale = 1.f;
  if (p.mode == TW_SCALE_TENSOR_CURRENT) tensor_scale = tw_compute_scale(p.amax[g], p.fp8_max, p.pow2);
  else if (p.mode == TW_SCALE_TENSOR_DELAYED) tensor_scale = p.scale[g];
  const bool tensor_mode = p.mode == TW_SCALE_TENSOR_CURRENT || p.mode == TW_SCALE_TENSOR_DELAYED;
  const bool tensor_keeps = scale_keeps_numbers(tensor_scale);

  // raw chunk (r, c) of column chunk kc into buffer b; out-of-range chunks are zeros, so every
  // statistic may include them
  auto fill = [&](int64_t kc, int b) {
    uint8_t *buf = ta_smem + b * L::BUF;
    const int64_t k0 = kc * TILE;
    const int cols = (int)min((int64_t)TILE, p.K - k0);
#pragma unroll
    for (int i = 0; i < TILE * L::NC / TA_THREADS; i++) {
      const int id = i * TA_THREADS + tid, r = id / L::NC, c = id % L::NC;
      const int n = r < rows ? max(0, min(L::EPC, cols - L::EPC * c)) : 0;
      const int64_t e0 = (r0 + r) * p.K + k0 + L::EPC * c;
      uint8_t *dst = ta_chunk(buf, L::RB, r, c);
      if (VEC) {
        cp_async16(dst, n ? (const void *)((const uint8_t *)p.x + e0 * L::ESZ) : p.x, n ? 16 : 0);
      } else {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < L::EPC; e++) {
          if (e >= n) break;
          if (L::ESZ == 4) w[e] = ((const uint32_t *)p.x)[e0 + e];
          else w[e >> 1] |= (uint32_t)((const uint16_t *)p.x)[e0 + e] << (16 * (e & 1));
        }
        *(uint4 *)dst = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    if (VEC) cp_async_commit();
  };

  fill(kc_begin, 0);
  for (int64_t kc = kc_begin; kc < kc_end; kc++) {
    const int b = (int)((kc - kc_begin) & 1);
    const bool more = kc + 1 < kc_end;
    if (more) fill(kc + 1, b ^ 1);
    if (VEC) {
      if (more) cp_async_wait_all_but_one();
      else cp_async_wait_all();
    }
    __syncthreads();  // chunk kc is in buffer b for every thread
    uint8_t *buf = ta_smem + b * L::BUF;
    const int64_t k0 = kc * TILE;
    const int cols = (int)min((int64_t)TILE, p.K - k0);

    // 128x128: the tile's amax before anything is scaled
    float tscale = tensor_scale;
    if (t128) {
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < TILE * L::NC / TA_THREADS; i++) {
        const int id = i * TA_THREADS + tid, r = id / L::NC, c = id % L::NC;
        const uint4 u = *(const uint4 *)ta_chunk(buf, L::RB, r, c);
#pragma unroll
        for (int e = 0; e < L::EPC; e++) m = max(m, absbits(ta_elem<XDT>(u, e)));
      }
      tscale = tw_compute_scale(tw_u2f(ta_block_umax(m, red)), p.fp8_max, p.pow2);
    }

    // ---- row pass: rowwise output, per-group amax, column statistics
    uint32_t cm0 = 0, cm1 = 0, cm2 = 0, cm3 = 0;
    const int n4 = max(0, min(4, cols - 4 * lane));
#pragma unroll 1
    for (int i = 0; i < TA_ROWS_PER_WARP; i++) {
      const int r = warp * TA_ROWS_PER_WARP + i;
      const float4 v = ta_row4<XDT>(buf, r, lane);
      const uint32_t a0 = absbits(v.x), a1 = absbits(v.y), a2 = absbits(v.z), a3 = absbits(v.w);
      cm0 = max(cm0, a0);
      cm1 = max(cm1, a1);
      cm2 = max(cm2, a2);
      cm3 = max(cm3, a3);
      const uint32_t m = max(max(a0, a1), max(a2, a3));
      gmax = max(gmax, m);
      if (p.row) {
        float sc = tscale;
        uint32_t nan_check = m;  // the products can be NaN only if this is (see quantize_rows)
        if (mx) {
          nan_check = shfl_umax(m, 8);
          const uint8_t e = tw_f32_to_e8m0_ceil_d(tw_u2f(nan_check) * inv_max);
          if ((lane & 7) == 0) rowe[r][lane >> 3] = e;
          sc = tw_e8m0_quant_scale(e);
        } else if (b128) {
          sc = tw_compute_scale(tw_u2f(shfl_umax(m, 32)), p.fp8_max, p.pow2);
          if (lane == 0 && r < rows) ((float *)p.row_si)[kc * p.rs_ld + r0 + r] = tw_canon(1.0f / sc);
        }
        const uint32_t codes = fp8x4_sat_checked(v.x * sc, v.y * sc, v.z * sc, v.w * sc, p.fp8,
                                                 nan_check > 0x7F800000u || (tensor_mode && !tensor_keeps));
        if (r < rows) ta_store4<VEC>(p.row_data + (r0 + r) * p.K + k0 + 4 * lane, codes, n4);
      }
    }

    // colwise passes skip the canonical-NaN patch when the chunk holds no NaN (their scales
    // are then finite and > 0, except a tensor scale, checked once)
    bool col_nonan = false;
    if (p.col) col_nonan = !__syncthreads_or(max(max(cm0, cm1), max(cm2, cm3)) > 0x7F800000u) &&
                           (!tensor_mode || tensor_keeps);
    if (need_colstats) {
      *(uint4 *)&colpart[warp][4 * lane] = make_uint4(cm0, cm1, cm2, cm3);
      __syncthreads();
      if (mx) {  // thread = (32-row block, column); warps 4rb..4rb+3 cover the block's rows
        const int rb = tid >> 7, c = tid & (TILE - 1);
        const uint32_t m = max(max(colpart[4 * rb][c], colpart[4 * rb + 1][c]),
                               max(colpart[4 * rb + 2][c], colpart[4 * rb + 3][c]));
        cole[rb][c] = tw_f32_to_e8m0_ceil_d(tw_u2f(m) * inv_max);
      } else if (tid < TILE) {
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < TA_WARPS; w++) m = max(m, colpart[w][tid]);
        const float sc = tw_compute_scale(tw_u2f(m), p.fp8_max, p.pow2);
        colscale[tid] = sc;
        if (tid < cols) ((float *)p.col_si)[t * p.cs_ld + k0 + tid] = tw_canon(1.0f / sc);
      }
      __syncthreads();
    }

    // ---- MXFP8 colwise data: [M, K] like x, scales per 32-row block and column
    if (p.col && mx) {
#pragma unroll 1
      for (int i = 0; i < TA_ROWS_PER_WARP; i++) {
        const int r = warp * TA_ROWS_PER_WARP + i;
        if (r >= rows) break;
        const float4 v = ta_row4<XDT>(buf, r, lane);
        const uint32_t ew = *(const uint32_t *)&cole[r >> 5][4 * lane];
        const float q0 = v.x * tw_e8m0_quant_scale((uint8_t)ew), q1 = v.y * tw_e8m0_quant_scale((uint8_t)(ew >> 8));
        const float q2 = v.z * tw_e8m0_quant_scale((uint8_t)(ew >> 16)), q3 = v.w * tw_e8m0_quant_scale((uint8_t)(ew >> 24));
        const uint32_t codes = fp8x4_sat_checked(q0, q1, q2, q3, p.fp8, !col_nonan);
        ta_store4<VEC>(p.col_data + (r0 + r) * p.K + k0 + 4 * lane, codes, n4);
      }
    }

    // ---- transposed colwise data (tensor and block modes): group g's block is [K, m_g] at o_g*K
    if (p.col && !mx) {
      uint8_t *colg = p.col_data + og * p.K;
      for (int cc = warp; cc < L::NC; cc += TA_WARPS) {
        if (L::EPC * cc >= cols) break;
        uint4 u[4];
#pragma unroll
        for (int j = 0; j < 4; j++) u[j] = *(const uint4 *)ta_chunk(buf, L::RB, 4 * lane + j, cc);
#pragma unroll
        for (int e = 0; e < L::EPC; e++) {
          const float sc = b128 ? colscale[L::EPC * cc + e] : tscale;
          const float q0 = ta_elem<XDT>(u[0], e) * sc, q1 = ta_elem<XDT>(u[1], e) * sc;
          const float q2 = ta_elem<XDT>(u[2], e) * sc, q3 = ta_elem<XDT>(u[3], e) * sc;
          const uint32_t codes = fp8x4_sat_checked(q0, q1, q2, q3, p.fp8, !col_nonan);
          ((uint32_t *)stage)[e * 32 + lane] = codes;  // stage[e][rows 4*lane..+3]
        }
        __syncwarp();
        // item = (column e, 16-row segment s): 8 lanes write one column's 128 rows
#pragma unroll
        for (int it = lane; it < L::EPC * 8; it += 32) {
          const int e = it >> 3, s = it & 7;
          const int k = L::EPC * cc + e, n = min(16, rows - 16 * s);
          if (k >= cols) continue;
          const uint4 w = *(const uint4 *)(stage + e * 128 + s * 16);
          if (p.col_pitch)  // token-padded: whole aligned chunks, rows past m_g as code 0
            store_col16(p.col_data + (k0 + k) * p.col_pitch + TILE * t + 16 * s, keep_first_bytes(w, n), 16);
          else if (n > 0)
            store_col16(colg + (k0 + k) * mg + lr0 + 16 * s, w, n);
        }
        __syncwarp();  // the stage is reused by the next column chunk
      }
    }

    // ---- per-tile scales
    if (t128 && tid == 0) {
      const float si = tw_canon(1.0f / tscale);
      if (p.row) ((float *)p.row_si)[t * p.rs_ld + kc] = si;
      if (p.col) ((float *)p.col_si)[kc * p.cs_ld + t] = si;
    }
    if (mx) {
      __syncthreads();  // rowe (row pass) complete
      if (p.row && tid < TILE) {
        uint8_t *S = (uint8_t *)p.row_si;
        const int64_t C = 4 * nkc;
        if (p.swz) {  // 4 bytes at d*16 + b*4 of the 512-byte tile (kc)
          const int d = tid >> 2, bq = tid & 3;
          uint8_t *o = S + t * TILE * C + kc * 512 + d * 16 + bq * 4;  // u8 scales: any alignment
          for (int f = 0; f < 4; f++) o[f] = rowe[32 * bq + d][f];
        } else {
          uint8_t *o = S + (t * TILE + tid) * C + 4 * kc;
          for (int f = 0; f < 4; f++) o[f] = rowe[tid][f];
        }
      }
      if (p.col && tid >= TA_THREADS - TILE) {  // other threads than the row writers
        const int c = tid - (TA_THREADS - TILE);
        uint8_t *S = (uint8_t *)p.col_si;
        const int64_t Cc = TILE * nkc;
        if (p.swz) {
          const int64_t ntiles = p.tiles[g + 1] - tg0;
          const int d = c >> 2, bq = c & 3;
          uint8_t *o = S + 4 * tg0 * Cc + (kc * ntiles + a) * 512 + d * 16 + bq * 4;
          for (int f = 0; f < 4; f++) o[f] = cole[f][32 * bq + d];
        } else {
          for (int f = 0; f < 4; f++) S[(4 * t + f) * Cc + k0 + c] = cole[f][c];
        }
      }
    }
    __syncthreads();  // buffer b, the stats and the exponents are free for chunk kc + 2
  }
  if (p.amax && p.mode != TW_SCALE_TENSOR_CURRENT) {
    const uint32_t m = ta_block_umax(gmax, red);
    if (tid == 0) atomic_amax(p.amax + g, tw_u2f(m));
  }
}

// Per-group slots of the tensor modes: scale_inv (both buffers) and, for current scaling, the
// amax already accumulated. Empty groups get amax 0 and scale 1.
__global__ void tensor_finalize_kernel(int64_t G, int mode, float fp8_max, int pow2, const float *amax,
                                       const float *scale, float *row_si, float *col_si) {
  int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= G) return;
  float s = mode == TW_SCALE_TENSOR_CURRENT ? tw_compute_scale(amax[g], fp8_max, pow2) : scale[g];
  float si = tw_canon(1.0f / s);
  if (row_si) row_si[g] = si;
  if (col_si) col_si[g] = si;
}

#define SPEC_CHUNKS 4

static int xdt_of(tw_dtype t) { return t == TW_F32 ? XDT_F32 : t == TW_BF16 ? XDT_BF16 : XDT_F16; }

template <int XDT, bool VEC, bool AMAX>
static cudaError_t launch_q(const QParams &p, dim3 grid, cudaStream_t s) {
  size_t smem = AMAX ? 0 : SMEM_TILE_BYTES;
  if (!AMAX) {  // per device; cheap, host side only
    cudaError_t e = cudaFuncSetAttribute(quantize_tile_kernel<XDT, VEC, AMAX>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  quantize_tile_kernel<XDT, VEC, AMAX><<<grid, THREADS, smem, s>>>(p);
  return cudaGetLastError();
}

template <bool AMAX>
static cudaError_t launch_q_dt(int xdt, bool vec, const QParams &p, dim3 grid, cudaStream_t s) {
  if (xdt == XDT_F32) return vec ? launch_q<XDT_F32, true, AMAX>(p, grid, s) : launch_q<XDT_F32, false, AMAX>(p, grid, s);
  if (xdt == XDT_BF16) return vec ? launch_q<XDT_BF16, true, AMAX>(p, grid, s) : launch_q<XDT_BF16, false, AMAX>(p, grid, s);
  return vec ? launch_q<XDT_F16, true, AMAX>(p, grid, s) : launch_q<XDT_F16, false, AMAX>(p, grid, s);
}

template <int XDT, bool VEC>
static cudaError_t launch_async(const QParams &p, dim3 grid, cudaStream_t s) {
  const int smem = TA<XDT>::SMEM;
  cudaError_t e = cudaFuncSetAttribute(quantize_tile_async_kernel<XDT, VEC>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  // all of the unified L1 as shared memory: two CTAs need ~180 KB, and x is streamed anyway
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(quantize_tile_async_kernel<XDT, VEC>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             (int)cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return e;
  quantize_tile_async_kernel<XDT, VEC><<<grid, TA_THREADS, smem, s>>>(p);
  return cudaGetLastError();
}

static cudaError_t launch_async_dt(int xdt, bool vec, const QParams &p, dim3 grid, cudaStream_t s) {
  if (xdt == XDT_F32) return vec ? launch_async<XDT_F32, true>(p, grid, s) : launch_async<XDT_F32, false>(p, grid, s);
  if (xdt == XDT_BF16) return vec ? launch_async<XDT_BF16, true>(p, grid, s) : launch_async<XDT_BF16, false>(p, grid, s);
  return vec ? launch_async<XDT_F16, true>(p, grid, s) : launch_async<XDT_F16, false>(p, grid, s);
}

template <int XDT, bool AMAX>
static cudaError_t launch_rows(const QParams &p, dim3 grid, cudaStream_t s) {
  quantize_rows_kernel<XDT, AMAX><<<grid, THREADS, 0, s>>>(p);
  return cudaGetLastError();
}

template <bool AMAX>
static cudaError_t launch_rows_dt(int xdt, const QParams &p, dim3 grid, cudaStream_t s) {
  if (xdt == XDT_F32) return launch_rows<XDT_F32, AMAX>(p, grid, s);
  if (xdt == XDT_BF16) return launch_rows<XDT_BF16, AMAX>(p, grid, s);
  return launch_rows<XDT_F16, AMAX>(p, grid, s);
}


static int aligned(const void *ptr, size_t a) { return ((uintptr_t)ptr % a) == 0; }

// The forced version for ops of family `prefix` ("quantize_"), or NULL for auto. Names of other
// families are left to their ops; an unknown name of this family is an error.
static tw_status forced_version(tw_ctx *ctx, const char *op, const char *prefix, const char *const *names,
                                int n, int *out) {
  *out = -1;
  const char *k = tw_ctx_kernel(ctx);
  if (!k || strncmp(k, prefix, strlen(prefix)) != 0) return TW_OK;
  for (int i = 0; i < n; i++)
    if (strcmp(k, names[i]) == 0) {
      *out = i;
      return TW_OK;
    }
  char have[256] = "";
  for (int i = 0; i < n; i++) {
    strncat(have, i ? ", " : "", sizeof have - strlen(have) - 1);
    strncat(have, names[i], sizeof have - strlen(have) - 1);
  }
  return tw_error(TW_ERR_INVALID_ARG, "%s: no kernel version named '%s' (have %s)", op, k, have);
}

// Index = the forced value below; a promoted version keeps its name.
static const char *const quantize_versions[] = {"quantize_tile_vec", "quantize_tile_scalar", "quantize_rows",
                                                "quantize_tile_async", "quantize_tile_spec"};
enum { QV_TILE_VEC = 0, QV_TILE_SCALAR = 1, QV_ROWS = 2, QV_TILE_ASYNC = 3, QV_TILE_SPEC = 4, QV_COUNT = 5 };

extern "C" tw_status gpu_grouped_quantize(tw_ctx *ctx, const tw_tensor *x, const tw_tensor *group_sizes,
                                          const tw_quantize_opts *opts, tw_qtensor *q) {
  gpu_state *st = gpu_of(ctx);
  cudaStream_t s = st->stream;
  int forced;
  TW_TRY(forced_version(ctx, "grouped_quantize", "quantize_", quantize_versions, QV_COUNT, &forced));
  const int64_t M = x->shape[0], K = x->shape[1], G = group_sizes->shape[0];
  const int64_t Gn = G < M ? G : M, Tcap = (M + 127 * Gn) / 128;
  gpu_scratch_reset(ctx);
  int64_t *offsets, *tiles;
  TW_TRY(gpu_scratch(ctx, (G + 1) * 8, (void **)&offsets));
  TW_TRY(gpu_scratch(ctx, (G + 1) * 8, (void **)&tiles));
  TW_TRY(gpu_group_prefix(ctx, (const int32_t *)group_sizes->data, G, M, 1, GPU_OP_QUANTIZE, offsets, tiles));

  QParams p;
  memset(&p, 0, sizeof p);
  p.x = x->data;
  p.M = M;
  p.K = K;
  p.offsets = offsets;
  p.tiles = tiles;
  p.G = G;
  p.Tcap = Tcap;
  p.mode = opts->mode;
  p.fp8 = opts->qdtype == TW_E4M3 ? 0 : 1;
  p.fp8_max = opts->qdtype == TW_E4M3 ? 448.0f : 57344.0f;
  p.row = (opts->layout & TW_ROWWISE) != 0;
  p.col = (opts->layout & TW_COLWISE) != 0;
  p.pow2 = opts->pow2_scales;
  p.swz = opts->mxfp8_swizzled;
  p.row_data = p.row ? (uint8_t *)q->row_data.data : NULL;
  p.col_data = p.col ? (uint8_t *)q->col_data.data : NULL;
  p.col_pitch = p.col && opts->col_padded ? TILE * Tcap : 0;
  p.row_si = p.row ? q->row_scale_inv.data : NULL;
  p.col_si = p.col && !tw_tensor_is_none(&q->col_scale_inv) ? q->col_scale_inv.data : NULL;
  const bool tensor = opts->mode == TW_SCALE_TENSOR_CURRENT || opts->mode == TW_SCALE_TENSOR_DELAYED;
  if (tensor && !p.row_si) p.row_si = p.col_si;  // colwise-only may describe the shared buffer as row_scale_inv
  if (tensor && p.col && !p.col_si) p.col_si = q->row_scale_inv.data;
  if (p.mode == TW_SCALE_BLOCK_1x128) {
    p.rs_ld = (M + 3) / 4 * 4;
    p.cs_ld = (K + 3) / 4 * 4;
  } else if (p.mode == TW_SCALE_BLOCK_128x128) {
    p.rs_ld = (K + 127) / 128;
    p.cs_ld = Tcap;
  }
  p.scale = opts->mode == TW_SCALE_TENSOR_DELAYED ? (const float *)opts->scale.data : NULL;
  p.amax = tw_tensor_is_none(&q->amax) ? NULL : (float *)q->amax.data;
  if (p.amax) GPU_TRY_CUDA(cudaMemsetAsync(p.amax, 0, G * sizeof(float), s), "grouped_quantize: zeroing amax");

  const int xdt = xdt_of(x->dtype);
  const size_t esz = x->dtype == TW_F32 ? 4 : 2;
  bool vec = K % 4 == 0 && aligned(x->data, 4 * esz) && (!p.row_data || aligned(p.row_data, 4)) &&
             (!p.col_data || aligned(p.col_data, 4));
  // the row kernel: 8-element lanes, rowwise output only, modes without a 2-D block
  const bool rows_ok = K % 8 == 0 && aligned(x->data, 16) && (!p.row_data || aligned(p.row_data, 8));
  const bool rows_mode = !p.col && opts->mode != TW_SCALE_BLOCK_128x128;
  // the async tile kernel takes any shape; 16-byte cp.async chunks need whole chunks per row
  const bool async_vec = K % (int64_t)(16 / esz) == 0 && aligned(x->data, 16) &&
                         (!p.row_data || aligned(p.row_data, 4)) && (!p.col_data || aligned(p.col_data, 4));
  // the specialized tile kernel: 8 columns of 16-bit x per 16-byte load, 8-byte code stores
  const bool spec_ok = esz == 2 && K % 8 == 0 && aligned(x->data, 16) && (!p.row_data || aligned(p.row_data, 8)) &&
                       (!p.col_data || aligned(p.col_data, 8));
  if (forced == QV_TILE_SCALAR) vec = false;
  if (forced == QV_TILE_SPEC && !spec_ok)
    return tw_error(TW_ERR_UNSUPPORTED, "grouped_quantize: quantize_tile_spec takes bf16/f16 x with K %% 8 == 0, "
                                        "x 16-byte and outputs 8-byte aligned (got %s x, K = %lld)",
                    tw_dtype_name(x->dtype), (long long)K);
  if (forced == QV_TILE_VEC && !vec)
    /* a forced version that does not take the case declines it, like the others */
    return tw_error(TW_ERR_UNSUPPORTED, "grouped_quantize: quantize_tile_vec takes K %% 4 == 0 and 4-element "
                                        "aligned x and outputs (K = %lld)", (long long)K);
  if (forced == QV_ROWS && !(rows_ok && rows_mode))
    return tw_error(TW_ERR_UNSUPPORTED, "grouped_quantize: quantize_rows takes rowwise-only current, delayed, "
                                        "mxfp8 and block1x128 with K %% 8 == 0 and 16-byte aligned x "
                                        "(got %s, layout %d, K = %lld)", tw_scaling_name(opts->mode),
                    (int)opts->layout, (long long)K);
  // auto: the row kernel where it applies, else the async tile kernel for 16-bit x (f32 x
  // needs 139 KB of shared memory per CTA there: forced only), else the first tile kernel
  int version = forced;
  if (version < 0) {
    // H200 (gpu/NOTES-quantize.md, session 3): the row kernel is the faster of the two for
    // tensor scaling's rowwise output (89.6% vs 87.2% of copy bandwidth), the specialized tile
    // kernel for everything else (MXFP8 / 1x128 rowwise 88% vs 78% / 86%)
    if (rows_ok && rows_mode && tensor) version = QV_ROWS;
    else if (spec_ok) version = QV_TILE_SPEC;
    else if (rows_ok && rows_mode) version = QV_ROWS;
    else if (esz == 2) version = QV_TILE_ASYNC;
    else version = vec ? QV_TILE_VEC : QV_TILE_SCALAR;
  }
  if (Tcap > 0 && K > 0) {
    dim3 grid((unsigned)Tcap, (unsigned)(((K + TILE - 1) / TILE + TILE_CHUNKS - 1) / TILE_CHUNKS));
    // 1-D grids of the row, async and register-tile kernels (tile_of_block)
    const int64_t ngrid_rows = Tcap * ((K + ROWS_SEG - 1) / ROWS_SEG), ngrid_async = Tcap * (int64_t)grid.y,
                  ngrid_tiles = Tcap * ((K + TILE - 1) / TILE);
    if (ngrid_tiles > 0x7FFFFFFF)
      return tw_error(TW_ERR_UNSUPPORTED, "grouped_quantize: %lld tiles of 128x128 exceed one grid (M = %lld, K = %lld)",
                      (long long)ngrid_tiles, (long long)M, (long long)K);
    dim3 rgrid((unsigned)ngrid_rows), agrid((unsigned)ngrid_async);
    // chunks per CTA of quantize_tile_spec: 4 measured best on an H200 (4: 77-89% of copy
    // bandwidth, 8: 1-2 points less, 14 and 28 less again: the CTAs resident together then
    // stream more distinct rows); TWIN_SPEC_CHUNKS overrides it for the bench
    p.chunks = SPEC_CHUNKS;
    if (const char *env = getenv("TWIN_SPEC_CHUNKS")) p.chunks = atoi(env) > 0 ? atoi(env) : SPEC_CHUNKS;
    const int64_t ngrid_spec = Tcap * ((K + TILE * p.chunks - 1) / (TILE * p.chunks));
    if (opts->mode == TW_SCALE_TENSOR_CURRENT) {
      if (rows_ok && version != QV_TILE_VEC && version != QV_TILE_SCALAR)
        GPU_TRY_CUDA(launch_rows_dt<true>(xdt, p, rgrid, s), "grouped_quantize: amax pass");
      else
        GPU_TRY_CUDA(launch_q_dt<true>(xdt, vec, p, grid, s), "grouped_quantize: amax pass");
    }
    if (version == QV_ROWS) GPU_TRY_CUDA(launch_rows_dt<false>(xdt, p, rgrid, s), "grouped_quantize: row kernel");
    else if (version == QV_TILE_SPEC)
      GPU_TRY_CUDA(launch_quantize_tile_spec(xdt, p, (unsigned)ngrid_spec, s), "grouped_quantize: specialized tile kernel");
    else if (version == QV_TILE_ASYNC)
      GPU_TRY_CUDA(launch_async_dt(xdt, async_vec, p, agrid, s), "grouped_quantize: async tile kernel");
    else GPU_TRY_CUDA(launch_q_dt<false>(xdt, version == QV_TILE_VEC, p, grid, s), "grouped_quantize: tile kernel");
  }
  if (tensor) {
    tensor_finalize_kernel<<<(unsigned)((G + 255) / 256), 256, 0, s>>>(
        G, opts->mode, p.fp8_max, p.pow2, p.amax, p.scale, (float *)p.row_si,
        p.col_si != p.row_si ? (float *)p.col_si : NULL);
    GPU_TRY_CUDA(cudaGetLastError(), "grouped_quantize: finalize");
  }
  return TW_OK;
}

// ---- dequantize ------------------------------------------------------------------------------

struct DParams {
  const uint8_t *data;
  const void *si;
  void *out;
  int out_dt;  // XDT_*
  int64_t M, K, G, Tcap;
  const int64_t *offsets, *tiles;
  int mode, colwise, swz, fp8;
  int64_t ld;         // block-mode scale leading dim
  int64_t col_pitch;  // token-padded colwise data: 128*T_cap; 0: default layout
};

__device__ __forceinline__ float decode_fp8(uint8_t c, int fp8) {
  return fp8 == 0 ? tw_e4m3_to_f32_d(c) : tw_e5m2_to_f32_d(c);
}

__global__ void __launch_bounds__(THREADS) dequantize_tile_kernel(DParams p) {
  const int64_t t = blockIdx.x;
  if (t >= p.tiles[p.G]) return;
  const int64_t g = find_group(p.tiles, p.G, t);
  const int64_t tg0 = p.tiles[g], og = p.offsets[g], mg = p.offsets[g + 1] - og;
  const int64_t a = t - tg0, lr0 = a * TILE;
  const int rows = (int)min((int64_t)TILE, mg - lr0);
  const int64_t r0 = og + lr0, k0 = (int64_t)blockIdx.y * TILE;
  const int cols = (int)min((int64_t)TILE, p.K - k0);
  const bool transposed = p.colwise && p.mode != TW_SCALE_MXFP8_1D;
  for (int i = threadIdx.x; i < TILE * TILE; i += THREADS) {
    // transposed data is read along rows (its contiguous direction)
    int r = transposed ? (i & 127) : (i >> 7), k = transposed ? (i >> 7) : (i & 127);
    if (r >= rows || k >= cols) continue;
    const int64_t gr = r0 + r, gk = k0 + k;
    uint8_t c = !transposed ? p.data[gr * p.K + gk]
                : p.col_pitch ? p.data[gk * p.col_pitch + TILE * t + r]
                              : p.data[og * p.K + gk * mg + lr0 + r];
    float si;
    switch (p.mode) {
      case TW_SCALE_TENSOR_CURRENT:
      case TW_SCALE_TENSOR_DELAYED: si = ((const float *)p.si)[g]; break;
      case TW_SCALE_MXFP8_1D: {
        const uint8_t *S = (const uint8_t *)p.si;
        uint8_t e;
        if (!p.colwise) {
          const int64_t C = 4 * (int64_t)gridDim.y, kb = gk >> 5;
          e = p.swz ? S[t * TILE * C + (kb >> 2) * 512 + (r & 31) * 16 + (r >> 5) * 4 + (kb & 3)]
                    : S[(t * TILE + r) * C + kb];
        } else {
          const int64_t Cc = TILE * (int64_t)gridDim.y, ntiles = p.tiles[g + 1] - tg0;
          e = p.swz ? S[4 * tg0 * Cc + ((int64_t)blockIdx.y * ntiles + a) * 512 + (k & 31) * 16 + (k >> 5) * 4 + (r >> 5)]
                    : S[(4 * t + (r >> 5)) * Cc + gk];
        }
        si = tw_e8m0_to_f32_d(e);
        break;
      }
      case TW_SCALE_BLOCK_1x128:
        si = p.colwise ? ((const float *)p.si)[t * p.ld + gk] : ((const float *)p.si)[(gk >> 7) * p.ld + gr];
        break;
      default:  // 128x128
        si = p.colwise ? ((const float *)p.si)[(gk >> 7) * p.ld + t] : ((const float *)p.si)[t * p.ld + (gk >> 7)];
        break;
    }
    float v = tw_canon(decode_fp8(c, p.fp8) * si);
    const int64_t oi = gr * p.K + gk;
    if (p.out_dt == XDT_F32) ((float *)p.out)[oi] = v;
    else if (p.out_dt == XDT_BF16) ((uint16_t *)p.out)[oi] = tw_f32_to_bf16_d(v);
    else ((uint16_t *)p.out)[oi] = tw_f32_to_f16_d(v);
  }
}

extern "C" tw_status gpu_grouped_dequantize(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *group_sizes,
                                            int colwise, tw_tensor *out) {
  gpu_state *st = gpu_of(ctx);
  const int64_t M = q->rows, K = q->cols, G = group_sizes->shape[0];
  const int64_t Gn = G < M ? G : M, Tcap = (M + 127 * Gn) / 128;
  gpu_scratch_reset(ctx);
  int64_t *offsets, *tiles;
  TW_TRY(gpu_scratch(ctx, (G + 1) * 8, (void **)&offsets));
  TW_TRY(gpu_scratch(ctx, (G + 1) * 8, (void **)&tiles));
  TW_TRY(gpu_group_prefix(ctx, (const int32_t *)group_sizes->data, G, M, 1, GPU_OP_DEQUANTIZE, offsets, tiles));
  DParams p;
  memset(&p, 0, sizeof p);
  p.data = (const uint8_t *)(colwise ? q->col_data.data : q->row_data.data);
  const tw_tensor *si = colwise ? &q->col_scale_inv : &q->row_scale_inv;
  if ((q->mode == TW_SCALE_TENSOR_CURRENT || q->mode == TW_SCALE_TENSOR_DELAYED) && tw_tensor_is_none(si))
    si = &q->row_scale_inv;
  p.si = si->data;
  p.out = out->data;
  p.out_dt = xdt_of(out->dtype);
  p.M = M;
  p.K = K;
  p.G = G;
  p.Tcap = Tcap;
  p.offsets = offsets;
  p.tiles = tiles;
  p.mode = q->mode;
  p.colwise = colwise;
  p.swz = q->mxfp8_swizzled;
  p.fp8 = q->qdtype == TW_E4M3 ? 0 : 1;
  p.col_pitch = colwise && q->col_padded ? TILE * Tcap : 0;
  if (q->mode == TW_SCALE_BLOCK_1x128) p.ld = colwise ? (K + 3) / 4 * 4 : (M + 3) / 4 * 4;
  if (q->mode == TW_SCALE_BLOCK_128x128) p.ld = colwise ? Tcap : (K + 127) / 128;
  if (Tcap > 0 && K > 0) {
    dim3 grid((unsigned)Tcap, (unsigned)((K + TILE - 1) / TILE));
    dequantize_tile_kernel<<<grid, THREADS, 0, st->stream>>>(p);
    GPU_TRY_CUDA(cudaGetLastError(), "grouped_dequantize: launch");
  }
  return TW_OK;
}

// ---- delayed scale update ----------------------------------------------------------------------

// 2^margin as the reference takes it: the margin truncated to an integer (TE's margins are whole).
__device__ __forceinline__ float pow2_margin(float margin) { return ldexpf(1.0f, (int)margin); }

__device__ __forceinline__ float delayed_scale(float fp8_max, float a, float margin) {
  float s = fp8_max / a;
  if (tw_f2u(s) == 0x7F800000u) s = tw_u2f(0x7F7FFFFFu);
  return s / pow2_margin(margin);
}

// One block per group: max over the history (slot 0 replaced by the new amax), new scale,
// then the history rolled left by one with slot 0 cleared.
__global__ void delayed_update_kernel(float *hist, int64_t H, float *scale, const float *amax, float fp8_max,
                                      int algo, float margin) {
  __shared__ float red[THREADS / 32];
  const int64_t g = blockIdx.x;
  float *h = hist + g * H;
  const float a0 = amax[g];
  float m = 0.f;
  if (algo == TW_AMAX_MOST_RECENT) m = a0;
  else {
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) m = tw_nmax(m, i == 0 ? a0 : h[i]);
    m = block_max(m, red);
  }
  // roll: new[i] = old[i+1], new[H-1] = a0, then new[0] = 0 — read everything before writing
  float vals[8];
  int n = 0;
  for (int64_t i = threadIdx.x; i < H && n < 8; i += blockDim.x) vals[n++] = (i + 1 < H) ? h[i + 1] : a0;
  __syncthreads();
  n = 0;
  for (int64_t i = threadIdx.x; i < H && n < 8; i += blockDim.x) {
    h[i] = i == 0 ? 0.0f : vals[n];
    n++;
  }
  if (threadIdx.x == 0 && m > 0.0f && m - m == 0.0f) scale[g] = delayed_scale(fp8_max, m, margin);
}

// Histories longer than 8 * THREADS: one thread per group walks its row in order.
__global__ void delayed_update_long_kernel(float *hist, int64_t H, int64_t G, float *scale, const float *amax,
                                           float fp8_max, int algo, float margin) {
  int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= G) return;
  float *h = hist + g * H;
  const float a0 = amax[g];
  float m = a0;
  if (algo == TW_AMAX_MAX)
    for (int64_t i = 1; i < H; i++) m = tw_nmax(m, h[i]);
  for (int64_t i = 0; i + 1 < H; i++) h[i] = h[i + 1];
  h[H - 1] = a0;
  h[0] = 0.0f;
  if (m > 0.0f && m - m == 0.0f) scale[g] = delayed_scale(fp8_max, m, margin);
}

extern "C" tw_status gpu_delayed_scale_update(tw_ctx *ctx, tw_tensor *amax_history, tw_tensor *scale,
                                              const tw_tensor *amax, tw_dtype qdtype, tw_amax_algo algo,
                                              float margin) {
  gpu_state *st = gpu_of(ctx);
  const int64_t G = amax_history->shape[0], H = amax_history->shape[1];
  const float fp8_max = qdtype == TW_E4M3 ? 448.0f : 57344.0f;
  if (H <= 8 * THREADS)
    delayed_update_kernel<<<(unsigned)G, THREADS, 0, st->stream>>>((float *)amax_history->data, H,
                                                                   (float *)scale->data, (const float *)amax->data,
                                                                   fp8_max, (int)algo, margin);
  else
    delayed_update_long_kernel<<<(unsigned)((G + 127) / 128), 128, 0, st->stream>>>(
        (float *)amax_history->data, H, G, (float *)scale->data, (const float *)amax->data, fp8_max, (int)algo,
        margin);
  GPU_TRY_CUDA(cudaGetLastError(), "delayed_scale_update: launch");
  return TW_OK;
}
