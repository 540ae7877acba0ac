// gpu/grouped_gemm_wgmma_fp8.cuh — what the fp8 wgmma kernels (gg_wgmma_fp8) share: the tile
// constants, the scale modes, the m64n128k32 and m64n192k32 fp8 wgmmas (QGMMA), the block-scale
// promotion, the named barriers of the consumers' turns and the operand checks. Included by
// gpu/grouped_gemm_wgmma_fp8.cu (forward) and gpu/grouped_gemm_wgmma_fp8_wgrad.cu (wgrad).
#ifndef TWIN_GPU_GROUPED_GEMM_WGMMA_FP8_CUH
#define TWIN_GPU_GROUPED_GEMM_WGMMA_FP8_CUH

#include <cuda.h>
#include <cuda_fp8.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gemm_common.cuh"
#include "gpu/wgmma_common.cuh"


#define GGF_BM 128
#define GGF_BN 128
#define GGF_BK 128
#define GGF_STAGES 6
#define GGF_THREADS 384
#define GGF_A_BYTES (GGF_BM * GGF_BK)
#define GGF_B_BYTES (GGF_BN * GGF_BK)
#define GGF_STAGE_BYTES (GGF_A_BYTES + GGF_B_BYTES)
#define GGF_SCALE_FLOATS (GGF_BM + GGF_BN)
// ring + 1 KiB to align the base to the 1024-byte swizzle atom + scales + barriers
#define GGF_SMEM (GGF_STAGES * GGF_STAGE_BYTES + 1024 + GGF_STAGES * GGF_SCALE_FLOATS * 4 + 2 * GGF_STAGES * 8)

// Scale modes of the kernel: per-tensor, 1x128 rows x 1x128 columns, 128x128 tiles.
enum { GGF_TENSOR = 0, GGF_B1x128 = 1, GGF_B128 = 2 };
#ifdef WGC_DEVICE
#define GGF_D64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= A(64x32 fp8, desc da) * B(32x128 fp8, desc db)^T, both K-major; scale_d = 0
// overwrites d. AT, BT: 0 e4m3, 1 e5m2. The 64 f32 accumulators of one thread: d[4j + 2h + e]
// is row 16*warp + lane/4 + 8h, column 8j + 2*(lane%4) + e of the warpgroup's 64 x 128 block.
template <int AT, int BT>
__device__ __forceinline__ void ggf_mma(float *d, uint64_t da, uint64_t db, int scale_d) {
  if (AT == 0 && BT == 0)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : GGF_D64(d)
        : "l"(da), "l"(db), "r"(scale_d));
  if (AT == 0 && BT == 1)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : GGF_D64(d)
        : "l"(da), "l"(db), "r"(scale_d));
  if (AT == 1 && BT == 0)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : GGF_D64(d)
        : "l"(da), "l"(db), "r"(scale_d));
  if (AT == 1 && BT == 1)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e5m2 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : GGF_D64(d)
        : "l"(da), "l"(db), "r"(scale_d));
}

// Block-scale promotion of one k-block's partial d into the f32 total (tw_gemm.h's model:
// tot = fmaf(partial, sa * sb, tot)) over NJ groups of 8 columns (16: a 128-column tile, 24: 192):
// fa0 / fa1 this thread's two row scales, fb the k-block's column scales in shared memory (8-byte
// aligned), read one pair per j (volatile: hoisting all 16 pairs spilled registers). The same
// formula and order per element at any NJ, so a column's total is the same bits at either tile
// width. Used by the forward and the wgrad consumers alike.
template <int NJ>
__device__ __forceinline__ void ggf_promote_n(const float *d, float *tot, float fa0, float fa1, const float *fb,
                                              int lane) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(wgc_smem(fb + 8 * j + 2 * (lane % 4))));
    tot[4 * j + 0] = fmaf(d[4 * j + 0], fa0 * v.x, tot[4 * j + 0]);
    tot[4 * j + 1] = fmaf(d[4 * j + 1], fa0 * v.y, tot[4 * j + 1]);
    tot[4 * j + 2] = fmaf(d[4 * j + 2], fa1 * v.x, tot[4 * j + 2]);
    tot[4 * j + 3] = fmaf(d[4 * j + 3], fa1 * v.y, tot[4 * j + 3]);
  }
}
// the 128-column tile's promotion
__device__ __forceinline__ void ggf_promote(const float *d, float *tot, float fa0, float fa1, const float *fb,
                                            int lane) {
  ggf_promote_n<16>(d, tot, fa0, fa1, fb, lane);
}

// the 96 accumulators of an m64n192 block: GGF_D64's 64, then 32 more
#define GGF_D96(d) \
    GGF_D64(d), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])

// The m64n192k32 twin of ggf_mma: d[4j + 2h + e] is row 16*warp + lane/4 + 8h, column
// 8j + 2*(lane%4) + e of the warpgroup's 64 x 192 block (j < 24).
#define GGF_MMA192(TA, TB)                                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                                    \
               "wgmma.mma_async.sync.aligned.m64n192k32.f32." TA "." TB " {" GGF_R96 "}, %96, %97, p, 1, 1;\n}\n" \
               : GGF_D96(d)                                                                               \
               : "l"(da), "l"(db), "r"(scale_d))
#define GGF_R96 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"

template <int AT, int BT>
__device__ __forceinline__ void ggf_mma192(float *d, uint64_t da, uint64_t db, int scale_d) {
  if (AT == 0 && BT == 0) GGF_MMA192("e4m3", "e4m3");
  if (AT == 0 && BT == 1) GGF_MMA192("e4m3", "e5m2");
  if (AT == 1 && BT == 0) GGF_MMA192("e5m2", "e4m3");
  if (AT == 1 && BT == 1) GGF_MMA192("e5m2", "e5m2");
}
// One k32 step over the warpgroup's BN columns.
template <int BN, int AT, int BT>
__device__ __forceinline__ void ggf_mma_bn(float *d, uint64_t da, uint64_t db, int scale_d) {
  if constexpr (BN == 128) ggf_mma<AT, BT>(d, da, db, scale_d);
  else ggf_mma192<AT, BT>(d, da, db, scale_d);
}

// Named barriers over `threads` threads (bar.sync / bar.arrive): the consumers' turns.
__device__ __forceinline__ void ggf_named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void ggf_named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif  // WGC_DEVICE

static inline int ggf_mode_of(int m) {
  switch (m) {
    case TW_SCALE_TENSOR_CURRENT:
    case TW_SCALE_TENSOR_DELAYED: return GGF_TENSOR;
    case TW_SCALE_BLOCK_1x128: return GGF_B1x128;
    case TW_SCALE_BLOCK_128x128: return GGF_B128;
    default: return -1;
  }
}
static inline int ggf_fp8(int dt) { return dt == TW_E4M3 || dt == TW_E5M2; }

// Knobs the forward and the wgrad read on every call: a column tile ("128" or "192" forces it;
// unset or anything else: def), a turn order ("0", "1" or "2"; else def) and the wgrad skew (a digit).
static inline int ggf_knob_bn(const char *name, int def) {
  const char *v = getenv(name);
  return v && !strcmp(v, "192") ? 192 : v && !strcmp(v, "128") ? 128 : def;
}
// A one-digit knob 0..max (anything else: def).
static inline int ggf_knob_digit(const char *name, int max, int def) {
  const char *v = getenv(name);
  return v && v[0] >= '0' && v[0] <= '0' + max && !v[1] ? v[0] - '0' : def;
}
static inline int ggf_knob_order(const char *name, int def) { return ggf_knob_digit(name, 2, def); }
// Whether a 128 x 192 tile pads N by at most 1/16 more than 128 x 128 does (the defaults take 192
// only there: N 2048, 4096, 7168, 8192 pad 1.8-3%; N = 256 would compute 384 columns).
static inline int ggf_n_fits_192(int64_t N) { return (N + 191) / 192 * 192 * 16 <= (N + 127) / 128 * 128 * 17; }

// The context's grow-only buffer for gg_wgmma_fp8's operand copies (gpu_state.wgrad_pad): the
// wgrad's token-padded copies and the forward's K-major copy of an MXFP8 colwise rhs. Stream-
// ordered (cudaMallocAsync / cudaFreeAsync: the old buffer is freed behind the work already
// queued, and users on the context's one stream never overlap). Inside a graph capture the call
// gets an allocation of the graph instead (*in_graph = 1; the caller frees it in the graph), so a
// graph never holds the context's buffer. Internal scratch like the workspace: not in the
// tw_ctx_memory ledger. op names the caller in error messages ("grouped_gemm", ...).
static inline tw_status ggf_pad_buffer(tw_ctx *ctx, size_t bytes, unsigned char **out, int *in_graph, const char *op) {
  gpu_state *st = gpu_of(ctx);
  char what[96];
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  snprintf(what, sizeof what, "%s (gg_wgmma_fp8): cudaStreamIsCapturing", op);
  GPU_TRY_CUDA(cudaStreamIsCapturing(st->stream, &cs), what);
  *in_graph = cs != cudaStreamCaptureStatusNone;
  snprintf(what, sizeof what, "%s (gg_wgmma_fp8): cudaMallocAsync", op);
  if (*in_graph) {
    GPU_TRY_CUDA(cudaMallocAsync((void **)out, bytes, st->stream), what);
    return TW_OK;
  }
  if (st->wgrad_pad_bytes < bytes) {
    if (st->wgrad_pad) {
      char fwhat[96];
      snprintf(fwhat, sizeof fwhat, "%s (gg_wgmma_fp8): cudaFreeAsync", op);
      GPU_TRY_CUDA(cudaFreeAsync(st->wgrad_pad, st->stream), fwhat);
    }
    st->wgrad_pad = NULL;
    st->wgrad_pad_bytes = 0;
    GPU_TRY_CUDA(cudaMallocAsync(&st->wgrad_pad, bytes, st->stream), what);
    st->wgrad_pad_bytes = bytes;
  }
  *out = (unsigned char *)st->wgrad_pad;
  return TW_OK;
}

#endif
