// gpu/grouped_gemm_kernel.cu — twin's own grouped GEMM kernel ("gg"), portable to sm_80+.
//
// One persistent launch walks every (group, p-tile, q-tile) work item; group sizes stay on the
// device (prefix offsets from gpu_group_prefix), nothing is copied to the host, so the call
// can be captured in a CUDA graph and replayed with new sizes in the same buffer.
//
// kernel version 1 (gg_mma): 128x128x32 CTA tile, 8 warps of 64x32, mma.sync m16n8k16 with
//   f32 accumulators, ldmatrix(.trans) so any operand layout feeds the tensor cores,
//   cp.async 16-byte copies into a 4-stage (bf16/f16) or 3-stage (fp8) ring.
//   fp8: the stage holds the raw bytes; each k-tile is decoded exactly to bf16 in shared
//   memory (every e4m3/e5m2 value is a bf16 value) and the scales are applied to the f32
//   accumulator: per-tensor in the epilogue; 1x128 / 128x128 / MXFP8 blocks by promoting a
//   partial accumulator into the total at each scaling-block boundary along K.
// kernel version 2 (gg_fma): same tiles and scheduler, operands widened to f32 in shared
//   memory, exact f32 FMA on CUDA cores. Used for f32 operands and as an independent check.
//
// Edges: a 16-byte chunk that is in bounds and aligned goes through cp.async; a chunk past the
// edge is zero-filled; a partial or misaligned chunk is copied element by element. So any
// shape, any leading dimension and any group size works, only the speed differs.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <stdio.h>

#include "gpu/gemm_common.cuh"

#define GG_BM 128
#define GG_BN 128
#define GG_BK 32
#define GG_THREADS 256

// ---- small PTX wrappers --------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t *r, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
template <bool F16>
__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, const uint32_t *b) {
  if (F16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- element decoding ----------------------------------------------------------------------
__device__ __forceinline__ float gg_fp8_to_f32(uint32_t c, int dtype) {
  float sign = (c & 0x80) ? -1.f : 1.f;
  if (dtype == TW_E4M3) {
    int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return __int_as_float(0x7fc00000);
    if (e == 0) return sign * ldexpf((float)m, -9);
    return sign * ldexpf(1.f + m / 8.f, e - 7);
  }
  int e = (c >> 2) & 31, m = c & 3;
  if (e == 31) return m ? __int_as_float(0x7fc00000) : sign * __int_as_float(0x7f800000);
  if (e == 0) return sign * ldexpf((float)m, -16);
  return sign * ldexpf(1.f + m / 4.f, e - 15);
}

__device__ __forceinline__ float gg_load_f32(const char *p, int dtype) {
  switch (dtype) {
    case TW_F32: return *(const float *)p;
    case TW_BF16: return __bfloat162float(*(const __nv_bfloat16 *)p);
    case TW_F16: return __half2float(*(const __half *)p);
    default: return gg_fp8_to_f32(*(const uint8_t *)p, dtype);
  }
}

__host__ __device__ __forceinline__ int gg_esize(int dtype) {
  return dtype == TW_F32 ? 4 : (dtype == TW_BF16 || dtype == TW_F16) ? 2 : 1;
}

// Raw stage of one operand: kmajor [X][BK] or [BK][X] elements, each row padded by 16 bytes
// (keeps ldmatrix rows on distinct banks and cp.async destinations 16-byte aligned).
__host__ __device__ __forceinline__ int gg_row_bytes(int kmajor, int X, int es, int bk = GG_BK) {
  return kmajor ? bk * es + 16 : X * es + 16;
}
__host__ __device__ __forceinline__ int gg_stage_bytes(int es, int X, int bk = GG_BK) {
  int km = X * (bk * es + 16), xm = bk * (X * es + 16);
  return km > xm ? km : xm;
}

// Per-group view of an operand.
struct gg_view {
  const char *base;
  int64_t ld;
  int64_t xlim, klim;  // valid rows (x) and contracting length
  int es, kmajor, vec_ok;
  const int32_t *rows;  // row-gathered: data row of storage row i is rows[i], from base; NULL: i itself
  int64_t urows;        // rows of the gathered source
};

// Data row of view row x of a row-gathered view, or -1 (a zero row).
__device__ __forceinline__ int64_t gg_data_row(const gg_view &v, int64_t x) {
  const int64_t r = v.rows[x];
  return r >= 0 && r < v.urows ? r : -1;
}

__device__ __forceinline__ gg_view gg_make_view(const gg_operand &o, int64_t g, int64_t og, int64_t tg,
                                                int64_t mg, int64_t xlim, int64_t klim) {
  gg_view v;
  v.es = gg_esize(o.dtype);
  int64_t base = o.rows ? 0 : o.padded ? 128 * tg : o.ragged ? og * o.row_elems : g * o.group_stride;
  v.base = (const char *)o.ptr + base * v.es;
  v.rows = o.rows ? o.rows + og : NULL;
  v.urows = o.gather_rows;
  v.ld = o.ld ? o.ld : mg;
  v.xlim = xlim;
  v.klim = klim;
  v.kmajor = o.kmajor;
  v.vec_ok = (((uintptr_t)v.base & 15) == 0) && (((v.ld * v.es) & 15) == 0);
  return v;
}

// Copies tile (x0.., k0..) of an operand into a raw stage (see gg_row_bytes). General path:
// any bounds, any alignment (per chunk: cp.async, zero fill or element copy).
template <int BK_ = GG_BK>
__device__ __forceinline__ void gg_load_tile(char *stage, const gg_view &v, int64_t x0, int64_t k0,
                                             int X, int tid) {
  const int es = v.es;
  const int rows = v.kmajor ? X : BK_, cols = v.kmajor ? BK_ : X;
  const int64_t r0 = v.kmajor ? x0 : k0, c0 = v.kmajor ? k0 : x0;
  const int64_t rlim = v.kmajor ? v.xlim : v.klim, clim = v.kmajor ? v.klim : v.xlim;
  const int rb = gg_row_bytes(v.kmajor, X, es, BK_);
  const int epc = 16 / es;
  const int cpr = cols / epc;
  for (int c = tid; c < rows * cpr; c += GG_THREADS) {
    int r = c / cpr, cc = c % cpr;
    int64_t gi = r0 + r, gj = c0 + (int64_t)cc * epc;
    char *dst = stage + r * rb + cc * 16;
    int64_t glim = rlim;
    if (v.rows && gi < rlim) {  // row-gathered (kmajor: gi is x): its data row, or zeros
      gi = gg_data_row(v, gi);
      glim = v.urows;
      if (gi < 0) {
        *(uint4 *)dst = make_uint4(0, 0, 0, 0);
        continue;
      }
    }
    if (gi < glim && gj + epc <= clim && v.vec_ok) {
      cp_async16(dst, v.base + (gi * v.ld + gj) * es);
    } else if (gi >= glim || gj >= clim) {
      *(uint4 *)dst = make_uint4(0, 0, 0, 0);
    } else {
      const char *src = v.base + (gi * v.ld + gj) * es;
      for (int e = 0; e < epc; ++e) {
        bool in = gj + e < clim;
        if (es == 1) ((uint8_t *)dst)[e] = in ? ((const uint8_t *)src)[e] : 0;
        else if (es == 2) ((uint16_t *)dst)[e] = in ? ((const uint16_t *)src)[e] : 0;
        else ((uint32_t *)dst)[e] = in ? ((const uint32_t *)src)[e] : 0;
      }
    }
  }
}

// ---- scales ----------------------------------------------------------------------------------
struct gg_sgroup {  // where group g of an operand's source starts
  int64_t o, m, t;  // source row offset, rows, 128-row tile offset T(g)
};

__device__ __forceinline__ gg_sgroup gg_scale_group(const gg_operand &o, int64_t g, int64_t og,
                                                    int64_t mg, int64_t tg) {
  gg_sgroup s;
  if (o.src_group_rows) {
    s.m = o.src_group_rows;
    s.o = g * s.m;
    s.t = g * ((s.m + 127) / 128);
  } else {
    s.o = og;
    s.m = mg;
    s.t = tg;
  }
  return s;
}

// scale_inv of the element (x, k) of an operand (tw_quantize.h layouts).
__device__ __forceinline__ float gg_scale_at(const gg_operand &o, const gg_sgroup &s, int64_t g,
                                             int64_t x, int64_t k) {
  int64_t i = o.kmajor ? x : k, j = o.kmajor ? k : x;  // storage (row, col) in the group
  int64_t rl = o.transposed ? j : i, c = o.transposed ? i : j;  // source row in group, col
  const float *f = (const float *)o.scale;
  switch (o.smode) {
    case TW_SCALE_TENSOR_CURRENT:
    case TW_SCALE_TENSOR_DELAYED: return f[g];
    case TW_SCALE_BLOCK_1x128:
      if (!o.colwise) return f[(c / 128) * o.scale_ld + s.o + rl];
      return f[(s.t + rl / 128) * o.scale_ld + c];
    case TW_SCALE_BLOCK_128x128:
      if (!o.colwise) return f[(s.t + rl / 128) * o.scale_ld + c / 128];
      return f[(c / 128) * o.scale_ld + s.t + rl / 128];
    case TW_SCALE_MXFP8_1D: {
      const uint8_t *e8 = (const uint8_t *)o.scale;
      int64_t W = o.scale_ld, idx;
      if (!o.colwise) {
        int64_t cb = c / 32, base = 128 * s.t * W;
        if (!o.swizzled) idx = base + rl * W + cb;
        else
          idx = base + (((rl / 128) * (W / 4) + cb / 4) * 32 + rl % 32) * 16 + ((rl % 128) / 32) * 4 + cb % 4;
      } else {
        int64_t rb = rl / 32, base = 4 * s.t * W;
        if (!o.swizzled) idx = base + rb * W + c;
        else {
          int64_t Rc4 = (s.m + 127) / 128;  // (4*ceil(m/128)) / 4
          idx = base + (((c / 128) * Rc4 + rb / 4) * 32 + c % 32) * 16 + ((c % 128) / 32) * 4 + rb % 4;
        }
      }
      uint8_t e = e8[idx];
      if (e == 0xFF) return __int_as_float(0x7fc00000);
      return e == 0 ? ldexpf(1.f, -127) : __int_as_float((int)e << 23);
    }
    default: return 1.f;
  }
}

__device__ __forceinline__ void gg_store(void *out, int dtype, int64_t idx, float v, int accumulate) {
  switch (dtype) {
    case TW_F32: {
      float *p = (float *)out + idx;
      *p = accumulate ? *p + v : v;
      break;
    }
    case TW_BF16: {
      __nv_bfloat16 *p = (__nv_bfloat16 *)out + idx;
      *p = __float2bfloat16_rn(accumulate ? __bfloat162float(*p) + v : v);
      break;
    }
    default: {
      __half *p = (__half *)out + idx;
      *p = __float2half_rn(accumulate ? __half2float(*p) + v : v);
      break;
    }
  }
}

// Interior tiles of the wide kernel: each thread copies the same chunks of every k-tile (rows
// r, r+RSTEP, ... of the stage, chunk column c), so their addresses are computed once per work
// item and advanced by one constant per k-tile: no bounds tests, no divisions, no 64-bit
// index math per chunk. Same bytes to the same places as gg_load_tile's general path.
template <bool KM, int X, int BK_, int ES>
struct gg_fast_loader {
  static constexpr int ROWS = KM ? X : BK_, CPR = (KM ? BK_ : X) * ES / 16;
  static constexpr int RSTEP = GG_THREADS / CPR, N = ROWS * CPR / GG_THREADS;
  static constexpr int RB = KM ? BK_ * ES + 16 : X * ES + 16;  // = gg_row_bytes
  static_assert(GG_THREADS % CPR == 0 && (ROWS * CPR) % GG_THREADS == 0, "chunks per thread");
  const char *src;   // this thread's first chunk at k-tile 0
  int64_t row_step;  // bytes between its chunks in global memory
  int64_t k_step;    // bytes per k-tile
  int dst;           // its first chunk's byte offset in a stage
  __device__ __forceinline__ void init(const gg_view &v, int64_t x0, int tid) {
    const int r = tid / CPR, c = tid % CPR;
    src = v.base + (KM ? (x0 + r) * v.ld + c * (16 / ES) : r * v.ld + x0 + c * (16 / ES)) * ES;
    row_step = (int64_t)RSTEP * v.ld * ES;
    k_step = KM ? (int64_t)BK_ * ES : (int64_t)BK_ * v.ld * ES;
    dst = r * RB + c * 16;
  }
  __device__ __forceinline__ void load(char *stage, int kt) const {
    const char *s = src + kt * k_step;
#pragma unroll
    for (int i = 0; i < N; ++i) cp_async16(stage + dst + i * RSTEP * RB, s + i * row_step);
  }
};

// fp8 stage -> f16, k-contiguous [X][BK_ + 8] (the wide kernel's fp8 path). Every e4m3 / e5m2
// value is an f16 value (e4m3: 4 exponent bits, 3 mantissa bits, smallest 2^-9; e5m2 is the
// top byte of an f16), so the conversion is exact, and f16 x f16 products are exact in the f32
// accumulator, as with bf16. sm_89+: one cvt per 2 codes; sm_80: cuda_fp8.h's software path.
__device__ __forceinline__ uint32_t gg_fp8x2_to_f16x2(uint32_t two, __nv_fp8_interpretation_t kind) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, kind);  // low byte -> .x
  return (uint32_t)h.x | ((uint32_t)h.y << 16);
}
template <bool KM, int X, int BK_>
__device__ __forceinline__ void gg_decode_fp8_f16(uint16_t *dst, const char *stage, int dtype, int tid) {
  const __nv_fp8_interpretation_t kind = dtype == TW_E4M3 ? __NV_E4M3 : __NV_E5M2;
  constexpr int DS = BK_ + 8;  // dst row stride in elements
  if (KM) {                    // stage [X][BK_ + 16 bytes]: 4 codes along k per word
    constexpr int WPR = BK_ / 4, RB = BK_ + 16;
#pragma unroll
    for (int w = tid; w < X * WPR; w += GG_THREADS) {
      const int x = w / WPR, kw = w % WPR;
      const uint32_t c = *(const uint32_t *)(stage + x * RB + kw * 4);
      uint2 o;
      o.x = gg_fp8x2_to_f16x2(c & 0xffffu, kind);
      o.y = gg_fp8x2_to_f16x2(c >> 16, kind);
      *(uint2 *)(dst + x * DS + kw * 4) = o;
    }
  } else {  // stage [BK_][X + 16 bytes]: 4 codes along x per word; lanes walk k (dst rows contiguous)
    constexpr int WPR = X / 4, RB = X + 16;
#pragma unroll 4
    for (int w = tid; w < BK_ * WPR; w += GG_THREADS) {
      const int k = w % BK_, xw = w / BK_;
      const uint32_t c = *(const uint32_t *)(stage + k * RB + xw * 4);
      const uint32_t lo = gg_fp8x2_to_f16x2(c & 0xffffu, kind), hi = gg_fp8x2_to_f16x2(c >> 16, kind);
      dst[(4 * xw + 0) * DS + k] = (uint16_t)lo;
      dst[(4 * xw + 1) * DS + k] = (uint16_t)(lo >> 16);
      dst[(4 * xw + 2) * DS + k] = (uint16_t)hi;
      dst[(4 * xw + 3) * DS + k] = (uint16_t)(hi >> 16);
    }
  }
}

// Two adjacent outputs (idx even, 4- or 8-byte aligned): one store, each value rounded as
// gg_store rounds it.
__device__ __forceinline__ void gg_store2(void *out, int dtype, int64_t idx, float v0, float v1, int accumulate) {
  switch (dtype) {
    case TW_F32: {
      float2 *p = (float2 *)((float *)out + idx);
      if (accumulate) {
        float2 o = *p;
        v0 = o.x + v0;
        v1 = o.y + v1;
      }
      *p = make_float2(v0, v1);
      break;
    }
    case TW_BF16: {
      __nv_bfloat162 *p = (__nv_bfloat162 *)((__nv_bfloat16 *)out + idx);
      if (accumulate) {
        __nv_bfloat162 o = *p;
        v0 = __low2float(o) + v0;
        v1 = __high2float(o) + v1;
      }
      *p = __halves2bfloat162(__float2bfloat16_rn(v0), __float2bfloat16_rn(v1));
      break;
    }
    default: {
      __half2 *p = (__half2 *)((__half *)out + idx);
      if (accumulate) {
        __half2 o = *p;
        v0 = __low2float(o) + v0;
        v1 = __high2float(o) + v1;
      }
      *p = __halves2half2(__float2half_rn(v0), __float2half_rn(v1));
      break;
    }
  }
}

// ---- the kernel ------------------------------------------------------------------------------
// COMPUTE: gg_compute. AK/BKM: operand layouts for the direct mma paths (kmajor).
// BLOCKED: block scales (promotion every kb_len along K). BN_: CTA tile width, 128 (warp
// tiles 64x32, 2 CTAs per SM) or 256 (kernel version 3, gg_mma_wide: warp tiles 64x64,
// twice the mma per ldmatrix, 1 CTA per SM; BK = 64, 3 stages, interior tiles through
// gg_fast_loader; bf16/f16, and fp8 with per-tensor scales decoded to f16).
template <int COMPUTE, bool AK, bool BKM, bool BLOCKED, int STAGES, int BN_>
__global__ void __launch_bounds__(GG_THREADS, (BLOCKED || COMPUTE == GG_FMA_F32 || BN_ > 128) ? 1 : 2)
    gg_kernel(const gg_problem p, const int64_t *__restrict__ tile_start, int64_t total_host,
              int kb_len) {
  static_assert(BN_ == GG_BM || COMPUTE != GG_FMA_F32, "wide tiles: no f32 FMA path");
  constexpr bool WIDE = BN_ > 128;
  static_assert(!WIDE || !BLOCKED, "wide tiles: no block scales");
  constexpr int WN = BN_ / 4, NT = WN / 8;  // warp tile width, its n8 tiles
  constexpr int BK_ = WIDE ? 64 : GG_BK;    // contracting depth of one stage
  extern __shared__ __align__(16) char smem[];
  const int esA = COMPUTE == GG_FMA_F32 ? 4 : COMPUTE == GG_MMA_FP8 ? 1 : 2;
  const int sbA = gg_stage_bytes(esA, GG_BM, BK_), sbB = gg_stage_bytes(esA, BN_, BK_);
  char *sA = smem;
  char *sB = smem + STAGES * sbA;
  char *conv = sB + STAGES * sbB;  // decoded tiles (fp8 / f32 paths)
  uint16_t *lut = (uint16_t *)(conv + (COMPUTE == GG_FMA_F32 ? 2 * GG_BK * (GG_BM + 4) * 4
                                                              : (GG_BM + BN_) * (BK_ + 8) * 2));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;
  const int gq = lane >> 2, t4 = lane & 3;

  if (COMPUTE == GG_MMA_FP8 && !WIDE) {  // fp8 code -> bf16 bits, for both operands
    __nv_bfloat16 va = __float2bfloat16_rn(gg_fp8_to_f32(tid, p.a.dtype));
    __nv_bfloat16 vb = __float2bfloat16_rn(gg_fp8_to_f32(tid, p.b.dtype));
    lut[tid] = *(uint16_t *)&va;
    lut[256 + tid] = *(uint16_t *)&vb;
    __syncthreads();
  }

  const int64_t tilesQ = (p.Q + BN_ - 1) / BN_;
  const int64_t total = p.kind == GG_FWD_RAGGED ? tile_start[p.G] : total_host;

  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    int64_t g, local;
    if (p.kind == GG_FWD_RAGGED) {
      int64_t lo = 0, hi = p.G - 1;  // last g with tile_start[g] <= t
      while (lo < hi) {
        int64_t mid = (lo + hi + 1) >> 1;
        if (tile_start[mid] <= t) lo = mid;
        else hi = mid - 1;
      }
      g = lo;
      local = t - tile_start[g];
    } else {
      int64_t P = p.P;
      int64_t per = ((P + GG_BM - 1) / GG_BM) * tilesQ;
      g = t / per;
      local = t % per;
    }
    int64_t og = 0, mg = 0, tg = 0;
    if (p.kind != GG_UNIFORM) {
      og = p.offsets[g];
      mg = p.offsets[g + 1] - og;
      tg = p.tiles[g];
    }
    const int64_t Pg = p.kind == GG_FWD_RAGGED ? mg : p.P;
    const int64_t Rg = p.kind == GG_WGRAD ? mg : p.R;
    const int64_t p0 = (local / tilesQ) * GG_BM, q0 = (local % tilesQ) * BN_;
    if (Rg == 0 && p.accumulate) continue;  // adds exactly nothing: leave out untouched

    const gg_view va = gg_make_view(p.a, g, og, tg, mg, Pg, Rg);
    const gg_view vb = gg_make_view(p.b, g, og, tg, mg, p.Q, Rg);
    const int ktiles = (int)((Rg + BK_ - 1) / BK_);
    constexpr int ESL = COMPUTE == GG_MMA_FP8 ? 1 : 2;  // element bytes (the loaders run only when WIDE)
    gg_fast_loader<AK, GG_BM, BK_, ESL> lda;
    gg_fast_loader<BKM, BN_, BK_, ESL> ldb;
    bool a_inside = false, b_inside = false;  // the tile's rows (x) are all in bounds, aligned
    if (WIDE) {
      lda.init(va, p0, tid);
      ldb.init(vb, q0, tid);
      a_inside = va.vec_ok && p0 + GG_BM <= Pg && !va.rows;  // a gathered A takes the general loader
      b_inside = vb.vec_ok && q0 + BN_ <= p.Q;
    }
    auto load_stage = [&](int s, int kk) {
      char *dA = sA + s * sbA, *dB = sB + s * sbB;
      const bool k_inside = (int64_t)(kk + 1) * BK_ <= Rg;
      if (WIDE && a_inside && k_inside) lda.load(dA, kk);
      else gg_load_tile<BK_>(dA, va, p0, (int64_t)kk * BK_, GG_BM, tid);
      if (WIDE && b_inside && k_inside) ldb.load(dB, kk);
      else gg_load_tile<BK_>(dB, vb, q0, (int64_t)kk * BK_, BN_, tid);
    };

    float acc[4][NT][4];
    float tot[BLOCKED ? 4 : 1][BLOCKED ? NT : 1][BLOCKED ? 4 : 1];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    if (BLOCKED) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) tot[BLOCKED ? i : 0][BLOCKED ? j : 0][BLOCKED ? e : 0] = 0.f;
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ktiles) load_stage(s, s);
      cp_async_commit();
    }

    for (int kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      {
        int nk = kt + STAGES - 1;
        if (nk < ktiles) load_stage(nk % STAGES, nk);
        cp_async_commit();
      }
      const char *stA = sA + (kt % STAGES) * sbA;
      const char *stB = sB + (kt % STAGES) * sbB;

      if (COMPUTE == GG_FMA_F32) {
        // widen both tiles to f32, k-outer: cA[k][x], cB[k][x]
        float *cA = (float *)conv, *cB = cA + GG_BK * (GG_BM + 4);
        for (int e = tid; e < GG_BK * GG_BM; e += GG_THREADS) {
          int k = e / GG_BM, x = e % GG_BM;
          int ra = gg_row_bytes(va.kmajor, GG_BM, va.es), rbb = gg_row_bytes(vb.kmajor, GG_BN, vb.es);
          const char *pa = va.kmajor ? stA + x * ra + k * va.es : stA + k * ra + x * va.es;
          const char *pb = vb.kmajor ? stB + x * rbb + k * vb.es : stB + k * rbb + x * vb.es;
          cA[k * (GG_BM + 4) + x] = gg_load_f32(pa, p.a.dtype);
          cB[k * (GG_BN + 4) + x] = gg_load_f32(pb, p.b.dtype);
        }
        __syncthreads();
#pragma unroll 4
        for (int k = 0; k < GG_BK; ++k) {
          float av[8], bv[2 * NT];
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            av[2 * mt] = cA[k * (GG_BM + 4) + wm * 64 + mt * 16 + gq];
            av[2 * mt + 1] = cA[k * (GG_BM + 4) + wm * 64 + mt * 16 + gq + 8];
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            bv[2 * nt] = cB[k * (GG_BN + 4) + wn * WN + nt * 8 + 2 * t4];
            bv[2 * nt + 1] = cB[k * (GG_BN + 4) + wn * WN + nt * 8 + 2 * t4 + 1];
          }
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e)
                acc[mt][nt][e] = fmaf(av[2 * mt + (e >> 1)], bv[2 * nt + (e & 1)], acc[mt][nt][e]);
        }
      } else {
        const __nv_bfloat16 *tA, *tB;
        int strA, strB;
        bool ak = AK, bk = BKM;
        if (COMPUTE == GG_MMA_FP8) {
          // decode, kmajor [X][BK+8] for both: v1 to bf16 through the table, wide to f16
          uint16_t *cA = (uint16_t *)conv, *cB = cA + GG_BM * (BK_ + 8);
          if (WIDE) {
            gg_decode_fp8_f16<AK, GG_BM, BK_>(cA, stA, p.a.dtype, tid);
            gg_decode_fp8_f16<BKM, BN_, BK_>(cB, stB, p.b.dtype, tid);
          } else {
            int ra = gg_row_bytes(va.kmajor, GG_BM, 1), rbb = gg_row_bytes(vb.kmajor, GG_BN, 1);
            for (int e = tid; e < GG_BK * GG_BM; e += GG_THREADS) {
              int x = e / GG_BK, k = e % GG_BK;
              uint8_t ca = va.kmajor ? stA[x * ra + k] : stA[k * ra + x];
              uint8_t cb = vb.kmajor ? stB[x * rbb + k] : stB[k * rbb + x];
              cA[x * (GG_BK + 8) + k] = lut[ca];
              cB[x * (GG_BK + 8) + k] = lut[256 + cb];
            }
          }
          __syncthreads();
          tA = (const __nv_bfloat16 *)cA;
          tB = (const __nv_bfloat16 *)cB;
          strA = strB = BK_ + 8;
          ak = bk = true;
        } else {
          tA = (const __nv_bfloat16 *)stA;
          tB = (const __nv_bfloat16 *)stB;
          strA = AK ? BK_ + 8 : GG_BM + 8;
          strB = BKM ? BK_ + 8 : BN_ + 8;
        }
        const int q = lane >> 3, l8 = lane & 7;
#pragma unroll
        for (int ks = 0; ks < BK_ / 16; ++ks) {
          const int k0 = ks * 16;
          uint32_t af[4][4], bf[NT][2];
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            int r0 = wm * 64 + mt * 16;
            if (ak) ldsm_x4(af[mt], tA + (r0 + (q & 1) * 8 + l8) * strA + k0 + (q >> 1) * 8);
            else ldsm_x4_t(af[mt], tA + (k0 + (q >> 1) * 8 + l8) * strA + r0 + (q & 1) * 8);
          }
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            int n0 = wn * WN + np * 16;
            uint32_t r[4];
            if (bk) ldsm_x4(r, tB + (n0 + (q >> 1) * 8 + l8) * strB + k0 + (q & 1) * 8);
            else ldsm_x4_t(r, tB + (k0 + (q & 1) * 8 + l8) * strB + n0 + (q >> 1) * 8);
            bf[2 * np][0] = r[0];
            bf[2 * np][1] = r[1];
            bf[2 * np + 1][0] = r[2];
            bf[2 * np + 1][1] = r[3];
          }
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma16816<COMPUTE == GG_MMA_F16 || (WIDE && COMPUTE == GG_MMA_FP8)>(acc[mt][nt], af[mt], bf[nt]);
        }
      }

      if (BLOCKED) {
        int64_t kend = (int64_t)(kt + 1) * GG_BK;
        if (kend % kb_len == 0 || kt == ktiles - 1) {
          int64_t kb0 = ((int64_t)kt * GG_BK / kb_len) * kb_len;
          gg_sgroup sa = gg_scale_group(p.a, g, og, mg, tg), sb = gg_scale_group(p.b, g, og, mg, tg);
          float fa[8], fb[2 * NT];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            int64_t x = p0 + wm * 64 + (i >> 1) * 16 + gq + (i & 1) * 8;
            if (va.rows) {  // the data row's scales in the one-group source (a zero row: 0)
              const int64_t xr = x < Pg ? gg_data_row(va, x) : -1;
              fa[i] = xr >= 0 ? gg_scale_at(p.a, gg_sgroup{0, va.urows, 0}, 0, xr, kb0) : 0.f;
            } else {
              fa[i] = x < Pg ? gg_scale_at(p.a, sa, g, x, kb0) : 0.f;
            }
          }
#pragma unroll
          for (int i = 0; i < 2 * NT; ++i) {
            int64_t y = q0 + wn * WN + (i >> 1) * 8 + 2 * t4 + (i & 1);
            fb[i] = y < p.Q ? gg_scale_at(p.b, sb, g, y, kb0) : 0.f;
          }
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                float f = fa[2 * mt + (e >> 1)] * fb[2 * nt + (e & 1)];
                tot[BLOCKED ? mt : 0][BLOCKED ? nt : 0][BLOCKED ? e : 0] =
                    fmaf(acc[mt][nt][e], f, tot[BLOCKED ? mt : 0][BLOCKED ? nt : 0][BLOCKED ? e : 0]);
                acc[mt][nt][e] = 0.f;
              }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();

    // epilogue
    float tensor_f = 1.f;
    if (p.a.smode == TW_SCALE_TENSOR_CURRENT || p.a.smode == TW_SCALE_TENSOR_DELAYED)
      tensor_f = ((const float *)p.a.scale)[p.a.rows ? 0 : g] * ((const float *)p.b.scale)[g];  // gathered: one group
    const int64_t obase = p.kind == GG_FWD_RAGGED ? og * p.Q : g * p.out_group_stride;
    // wide: column pairs (y even) in one store when every pair start is even and aligned
    const bool pairs = WIDE && (p.Q & 1) == 0 && (obase & 1) == 0 &&
                       ((uintptr_t)p.out & (p.out_dtype == TW_F32 ? 7 : 3)) == 0;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int64_t x = p0 + wm * 64 + mt * 16 + gq + h * 8;
        if (x >= Pg) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int64_t y0 = q0 + wn * WN + nt * 8 + 2 * t4;
          if (pairs && !BLOCKED && y0 < p.Q) {  // Q even, y0 even: y0 + 1 < Q too
            gg_store2(p.out, p.out_dtype, obase + x * p.Q + y0, acc[mt][nt][2 * h] * tensor_f,
                      acc[mt][nt][2 * h + 1] * tensor_f, p.accumulate);
            continue;
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            int64_t y = y0 + e;
            if (y >= p.Q) continue;
            float v = BLOCKED ? tot[BLOCKED ? mt : 0][BLOCKED ? nt : 0][BLOCKED ? 2 * h + e : 0]
                              : acc[mt][nt][2 * h + e] * tensor_f;
            gg_store(p.out, p.out_dtype, obase + x * p.Q + y, v, p.accumulate);
          }
        }
      }
  }
}

// Tile prefix over ragged groups: tile_start[g] = sum_{j<g} ceil(m_j/BM) * tilesQ.
#define GG_PREFIX_THREADS 256
__global__ void __launch_bounds__(GG_PREFIX_THREADS)
    gg_tile_prefix(const int64_t *__restrict__ offsets, int64_t G, int64_t tilesQ, int64_t *__restrict__ tile_start) {
  typedef cub::BlockScan<int64_t, GG_PREFIX_THREADS> scan_t;
  __shared__ typename scan_t::TempStorage tmp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < G; base += GG_PREFIX_THREADS) {
    int64_t g = base + threadIdx.x;
    int64_t v = 0;
    if (g < G) v = ((offsets[g + 1] - offsets[g] + GG_BM - 1) / GG_BM) * tilesQ;
    int64_t ex, sum;
    scan_t(tmp).ExclusiveSum(v, ex, sum);
    if (g < G) tile_start[g] = carry + ex;
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_start[G] = carry;
}

// ---- host side ---------------------------------------------------------------------------------
static size_t gg_smem_bytes(int compute, int stages, int bn) {
  int es = compute == GG_FMA_F32 ? 4 : compute == GG_MMA_FP8 ? 1 : 2;
  int bk = bn > GG_BN ? 64 : GG_BK;  // as BK_ in gg_kernel
  size_t s = (size_t)stages * (gg_stage_bytes(es, GG_BM, bk) + gg_stage_bytes(es, bn, bk));
  if (compute == GG_FMA_F32) s += (size_t)2 * GG_BK * (GG_BM + 4) * 4;
  if (compute == GG_MMA_FP8) s += (size_t)(GG_BM + bn) * (bk + 8) * 2 + 512 * 2;
  return s;
}

typedef void (*gg_fn)(const gg_problem, const int64_t *, int64_t, int);

// Whether this device grants the shared memory of every gg_mma_wide instantiation (the fp8
// one needs the most: its f16 decode stage comes on top of the raw tiles).
int gg_wide_fits(tw_ctx *ctx) {
  gpu_state *st = gpu_of(ctx);
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, st->device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  size_t need = gg_smem_bytes(GG_MMA_FP8, 3, 2 * GG_BN);
  if (gg_smem_bytes(GG_MMA_BF16, 3, 2 * GG_BN) > need) need = gg_smem_bytes(GG_MMA_BF16, 3, 2 * GG_BN);
  return need <= (size_t)optin;
}

template <int C, bool AK, bool BKM, bool BL, int S, int BN_ = GG_BN>
static tw_status gg_launch_t(tw_ctx *ctx, const gg_problem *p, const int64_t *tile_start,
                             int64_t total_host, int kb_len, const char *op) {
  gpu_state *st = gpu_of(ctx);
  gg_fn fn = gg_kernel<C, AK, BKM, BL, S, BN_>;
  size_t smem = gg_smem_bytes(C, S, BN_);
  // Per device: attribute and occupancy (host-only queries, no stream work).
  static int occ_cache[64];
  int dev = st->device < 64 ? st->device : 0;
  if (!occ_cache[dev]) {
    int optin = 0;
    GPU_TRY_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, st->device),
                 "grouped_gemm: shared memory query");
    if (smem > (size_t)optin)  // e.g. gg_mma_wide (162 KiB) on sm_86/sm_89 (99 KiB)
      return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' needs %zu bytes of shared memory per block, device %d has %d",
                      op, BN_ > GG_BN ? GG_KERNEL_MMA_WIDE : C == GG_FMA_F32 ? GG_KERNEL_FMA : GG_KERNEL_MMA, smem,
                      st->device, optin);
    GPU_TRY_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                 "grouped_gemm: cudaFuncSetAttribute");
    int occ = 0;
    GPU_TRY_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, GG_THREADS, smem),
                 "grouped_gemm: occupancy query");
    occ_cache[dev] = occ > 0 ? occ : 1;
  }
  int64_t grid = (int64_t)st->num_sms * occ_cache[dev];
  if (p->kind != GG_FWD_RAGGED && total_host < grid) grid = total_host;
  if (grid <= 0) return TW_OK;
  fn<<<(unsigned)grid, GG_THREADS, smem, st->stream>>>(*p, tile_start, total_host, kb_len);
  GPU_TRY_CUDA(cudaGetLastError(), op);
  return TW_OK;
}

void gg_operand_from(gg_operand *o, const tw_operand *t) {
  memset(o, 0, sizeof *o);
  o->ptr = t->data.data;
  o->dtype = t->data.dtype;
  o->smode = t->mode;
  if (t->mode != TW_SCALE_NONE) {
    o->scale = t->scale_inv.data;
    o->scale_ld = t->scale_inv.ndim >= 1 ? t->scale_inv.shape[t->scale_inv.ndim - 1] : 1;
    o->colwise = t->colwise;
    o->transposed = t->colwise && t->mode != TW_SCALE_MXFP8_1D;
    o->swizzled = t->mxfp8_swizzled;
    o->src_rows = t->src_rows;
  }
}

tw_status gg_run(tw_ctx *ctx, const gg_problem *pin, const char *op) {
  gg_problem p = *pin;
  if (p.Q == 0 || p.G == 0) return TW_OK;
  if (p.kind != GG_FWD_RAGGED && p.P == 0) return TW_OK;
  int blocked = p.a.smode == TW_SCALE_BLOCK_1x128 || p.a.smode == TW_SCALE_BLOCK_128x128 ||
                p.a.smode == TW_SCALE_MXFP8_1D;
  int kb_len = p.a.smode == TW_SCALE_MXFP8_1D ? 32 : 128;
  // wide: bf16/f16, and fp8 with per-tensor scales (block scales keep the 128x128x32 tile)
  const int wide = p.wide && (p.compute == GG_MMA_BF16 || p.compute == GG_MMA_F16 || (p.compute == GG_MMA_FP8 && !blocked));
  const int bn = wide ? 2 * GG_BN : GG_BN;
  const int64_t tilesQ = (p.Q + bn - 1) / bn;
  int64_t *tile_start = NULL;
  int64_t total_host = 0;
  if (p.kind == GG_FWD_RAGGED) {
    TW_TRY(gpu_scratch(ctx, (size_t)(p.G + 1) * sizeof(int64_t), (void **)&tile_start));
    gg_tile_prefix<<<1, GG_PREFIX_THREADS, 0, gpu_of(ctx)->stream>>>(p.offsets, p.G, tilesQ, tile_start);
    GPU_TRY_CUDA(cudaGetLastError(), op);
  } else {
    total_host = p.G * ((p.P + GG_BM - 1) / GG_BM) * tilesQ;
  }
  const int ak = p.a.kmajor, bk = p.b.kmajor;
  if (wide) {
#define GG_WIDE(C)                                                                                       \
  if (ak && bk) return gg_launch_t<C, true, true, false, 3, 256>(ctx, &p, tile_start, total_host, kb_len, op);   \
  if (ak) return gg_launch_t<C, true, false, false, 3, 256>(ctx, &p, tile_start, total_host, kb_len, op);        \
  if (bk) return gg_launch_t<C, false, true, false, 3, 256>(ctx, &p, tile_start, total_host, kb_len, op);        \
  return gg_launch_t<C, false, false, false, 3, 256>(ctx, &p, tile_start, total_host, kb_len, op);
    if (p.compute == GG_MMA_BF16) { GG_WIDE(GG_MMA_BF16) }
    if (p.compute == GG_MMA_FP8) { GG_WIDE(GG_MMA_FP8) }
    GG_WIDE(GG_MMA_F16)
#undef GG_WIDE
  }
  switch (p.compute) {
    case GG_MMA_BF16:
      if (ak && bk) return gg_launch_t<GG_MMA_BF16, true, true, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
      if (ak) return gg_launch_t<GG_MMA_BF16, true, false, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
      if (bk) return gg_launch_t<GG_MMA_BF16, false, true, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
      return gg_launch_t<GG_MMA_BF16, false, false, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
    case GG_MMA_F16:
      if (ak && bk) return gg_launch_t<GG_MMA_F16, true, true, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
      if (ak) return gg_launch_t<GG_MMA_F16, true, false, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
      if (bk) return gg_launch_t<GG_MMA_F16, false, true, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
      return gg_launch_t<GG_MMA_F16, false, false, false, 4>(ctx, &p, tile_start, total_host, kb_len, op);
    case GG_MMA_FP8:
      if (blocked) return gg_launch_t<GG_MMA_FP8, true, true, true, 3>(ctx, &p, tile_start, total_host, kb_len, op);
      return gg_launch_t<GG_MMA_FP8, true, true, false, 3>(ctx, &p, tile_start, total_host, kb_len, op);
    case GG_FMA_F32:
      if (blocked) return gg_launch_t<GG_FMA_F32, true, true, true, 3>(ctx, &p, tile_start, total_host, kb_len, op);
      return gg_launch_t<GG_FMA_F32, true, true, false, 3>(ctx, &p, tile_start, total_host, kb_len, op);
    default:
      return tw_error(TW_ERR_INTERNAL, "%s: unknown compute path %d", op, p.compute);
  }
}
