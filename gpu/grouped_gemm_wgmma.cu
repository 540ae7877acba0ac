// gpu/grouped_gemm_wgmma.cu — kernel version 4 of the grouped GEMM (gg_wgmma): Hopper (sm_90a)
// bf16/f16 forward with ragged M from device group sizes, and the wgrad (ragged K; its own
// kernel at the end of this file, ggw_wgrad_kernel).
//
//   C[o_g + i, :] = lhs[o_g + i, :] @ op(rhs[g])   for i < m_g   (f32 accumulation)
//
// Design (written for twin; the general Hopper recipe, not copied from a library):
//   - CTA tile 128 x 256 x 64, 384 threads: warpgroup 0 is the producer (one thread issues
//     the TMA loads), warpgroups 1 and 2 are consumers, each owning 64 rows x 256 columns
//     (128 f32 accumulators per thread). setmaxnreg moves registers from the producer (40)
//     to the consumers (232).
//   - 4-stage shared-memory ring (48 KiB a stage). Each stage has a "full" mbarrier (the
//     producer's expect_tx; the TMA engine completes the bytes) and an "empty" mbarrier (each
//     of the 8 consumer warps arrives once its wgmma reads of the stage are done).
//   - TMA with 128-byte swizzle: lhs through one 2-D map [M, K] (box 128 rows x 64 k), rhs
//     through one 3-D map over [G, N, K] (op T, K-major, box 256 x 64) or [G, K, N] (op N,
//     N-major, four 64 x 64 boxes). Maps depend only on pointers and shapes, never on the
//     group sizes, so they travel by value in the kernel parameters: graph-capturable,
//     replayable with new sizes in the same buffer.
//   - wgmma m64n256k16 from shared memory (descriptors: 128-byte swizzle; K-major A and B
//     advance 32 bytes per k16 step, N-major B advances 16 k-rows = 2048 bytes, LBO 8 KiB
//     between its 64-column boxes). One wgmma group in flight per consumer (wait_group 1):
//     the stage of k-tile kt-1 is released once k-tile kt is issued.
//   - Persistent CTAs (one per SM) walk the linear tile ids of ggw_tile_prefix (device
//     offsets -> tile starts); producer and consumers each find (g, p-tile, q-tile) by binary
//     search, so both walk the same sequence with no communication but the ring.
//   - Clusters of 2 (when groups average >= 256 rows): a tile id names 256 rows; the pair
//     shares the group and the columns, each CTA loads half of the rhs tile and multicasts it
//     to both, and a stage is free once the consumers of both CTAs arrived on its empty
//     barrier (remote arrive, cta-scope release: a cluster-scope release there halved the
//     rate, run g2 in gpu/NOTES-gemm.md).
//   - Ragged edges: a tile's 128 lhs rows start at o_g + p0; rows past the group belong to
//     the next group (or past M: TMA fills zeros). Their products are computed but never
//     stored: the epilogue writes row i only if p0 + i < m_g, column j only if j < N. The K
//     tail (K % 64) and N tail come back as zeros from TMA's out-of-bounds fill, and rhs
//     group g never reads group g+1 (the group index is its own map dimension).
//   - Epilogue: a consumer warpgroup whose 64 rows all lie in the group (not accumulating, out
//     16-byte aligned with 16-byte rows) converts them chunk by chunk (64 rows x 128 bytes) into
//     two alternating 8 KiB staging buffers and one thread TMA-stores each chunk into out [M, N];
//     the last stores drain while the next tile runs (+15% on K = 2048, +5-7% elsewhere: run b1
//     in gpu/NOTES-gemm.md). Group edges and accumulate store straight from the accumulators
//     (pairs of columns per store when aligned). Same rounding both ways; TWIN_GG_WGMMA_EPI=regs
//     (read on every call) forces the register stores. (Edges by TMA through per-group out maps,
//     as the wgrad's ragged ends below: tried in session 24, 0-1.5% on the MoE block at E 256,
//     not kept; gpu/NOTES-gemm.md.)
// Operands it declines (TW_ERR_UNSUPPORTED naming it; auto falls back to gg_mma_wide):
// anything but plain bf16 x bf16 / f16 x f16, K or (op N) N not a multiple of 8, K = 0,
// pointers not 16-byte aligned, a device other than sm_90, sizes past int32 TMA coordinates;
// wgrad: the same, and lhs / rhs as per-group transposed copies (op T).
// Other architectures compile the kernel as an empty stub that is never launched.
#include <cub/block/block_scan.cuh>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gemm_common.cuh"
#include "gpu/wgmma_common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GGW_DEVICE 1
#endif

#define GGW_BM 128
#define GGW_BN 256
#define GGW_BK 64
#define GGW_STAGES 4
#define GGW_THREADS 384
// CTAs per cluster: 2 (pairs sharing the rhs tile by multicast: 1.09-1.15x the single CTA on
// the H100, run g6) when the groups average at least 256 rows (M / G >= 256: the host does not
// see the sizes); else 1 (a pair covers 256 rows, so with 128-row groups one CTA of each pair
// would compute rows it never stores). Measurement knobs: TWIN_GG_WGMMA_CLUSTER=1 or 2 forces
// one, TWIN_GG_WGMMA_VERBOSE=1 prints the cluster grid once, TWIN_GG_WGMMA_GRID=n launches n
// CTAs (cluster variant).
#define GGW_A_BYTES (GGW_BM * GGW_BK * 2)  // 16 KiB
#define GGW_B_BYTES (GGW_BN * GGW_BK * 2)  // 32 KiB
#define GGW_STAGE_BYTES (GGW_A_BYTES + GGW_B_BYTES)
// Epilogue staging for TMA stores (forward and wgrad): per consumer warpgroup two 8 KiB buffers
// (64 rows x 128 bytes: 64 bf16/f16 or 32 f32 columns, 128-byte swizzle), after the ring.
#define GGW_EPI_BYTES (2 * 2 * 8192)
// ring + staging + 1 KiB for aligning the base to the 1024-byte swizzle atom + barriers
#define GGW_SMEM (GGW_STAGES * GGW_STAGE_BYTES + GGW_EPI_BYTES + 1024 + 2 * GGW_STAGES * 8)

struct ggw_params {
  const int64_t *offsets;     // device [G+1] row offsets (gpu_group_prefix)
  const int64_t *tile_start;  // device [G+1] tile starts (gg_tile_prefix with tilesQ)
  void *out;
  int64_t N, K, G, tilesQ;
  int accumulate;
  int tma_out;  // 1: a warpgroup whose 64 rows all lie in the group leaves through shared memory
                // and TMA stores (not accumulating, out 16-byte aligned, 16-byte row stride)
  // row-gathered lhs (GA kernels, tw_grouped_gemm_rows): A row o_g + x is data row rows[o_g + x]
  // of a [U, K] lhs (-1, or an entry outside [0, U): zeros), loaded by the producer warpgroup
  const int32_t *rows;
  const unsigned char *a;
  int64_t U;
  int m_first;  // tiles of a group walk its row tiles first (see ggw_forward)
};

#ifdef GGW_DEVICE
// ---- PTX wrappers (sm_90a) ---------------------------------------------------------------
// mbarriers, TMA loads, descriptors, wgmma fence/commit/wait, epilogue stores: gpu/wgmma_common.cuh
// Clusters (CL = 2): wgc_cta_rank, wgc_cluster_sync, wgc_bar_arrive_at, wgc_tma_3d_mc (wgmma_common.cuh).
// d (+)= A(64x16, desc da) * B(16x256, desc db); scale_d = 0 overwrites d. TB / TA: B / A
// stored MN-major (wgmma's transpose bits; TA only in the wgrad kernel). The 128 f32
// accumulators of one thread, in wgmma's fragment order (see ggw_epilogue).
template <bool F16, int TB, int TA = 0>
__device__ __forceinline__ void ggw_mma_256(float *d, uint64_t da, uint64_t db, int scale_d) {
  if (F16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %132, %131;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TB), "n"(TA));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %132, %131;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TB), "n"(TA));
}
// TMA store of one 2-D / 3-D box from shared memory (bulk-group completion), and its waits.
__device__ __forceinline__ void ggw_tma_store_2d(const CUtensorMap *map, const void *src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"((uint64_t)map),
               "r"(wgc_smem(src)), "r"(c0), "r"(c1)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void ggw_tma_store_3d(const CUtensorMap *map, const void *src, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"((uint64_t)map),
      "r"(wgc_smem(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void ggw_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ggw_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// The TMA-store epilogues (forward and wgrad): chunk ch (64 rows x 128 bytes, CW columns) of
// warpgroup c's accumulators d into staging buffer buf, 128-byte swizzle (16-byte chunk q of row
// r at q ^ (r % 8), conflict-free), RNE of the f32 value as the register stores. Waits until the
// store issued from buf two chunks ago has read it; on return buf is ready for the TMA store.
template <int OUT>
__device__ __forceinline__ void ggw_stage_chunk(const float *d, int ch, unsigned char *buf, int c, int warp, int lane,
                                                int tid) {
  constexpr int ES = OUT == TW_F32 ? 4 : 2, CW = 128 / ES, JPC = CW / 8;
  if (tid == 0) ggw_store_wait_read<1>();
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + c) : "memory");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rl = 16 * warp + lane / 4 + 8 * h;
#pragma unroll
    for (int jj = 0; jj < JPC; ++jj) {
      const int j = ch * JPC + jj;
      const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
      const int b = (8 * jj + 2 * (lane % 4)) * ES;
      unsigned char *a = buf + rl * 128 + ((((b >> 4) ^ (rl & 7)) << 4) | (b & 15));
      if (OUT == TW_F32) *(float2 *)a = make_float2(v0, v1);
      else if (OUT == TW_BF16) *(__nv_bfloat162 *)a = __halves2bfloat162(__float2bfloat16_rn(v0), __float2bfloat16_rn(v1));
      else *(__half2 *)a = __halves2half2(__float2half_rn(v0), __float2half_rn(v1));
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + c) : "memory");
}
// Linear tile id -> group (last g with tile_start[g] <= t), row tile start p0, column start q0.
// CL = 2: a tile id names 256 rows (both CTAs of the cluster), this CTA takes rows rank*128..
template <int CL>
__device__ __forceinline__ void ggw_locate(const ggw_params &p, int64_t t, uint32_t rank, int64_t &g, int64_t &p0,
                                           int64_t &q0) {
  int64_t lo = 0, hi = p.G - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) >> 1;
    if (p.tile_start[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  g = lo;
  int64_t local = t - p.tile_start[g];
  if (p.m_first) {  // group g's tiles column by column: the row tiles sharing an rhs tile adjacent
    const int64_t rg = (p.tile_start[g + 1] - p.tile_start[g]) / p.tilesQ;
    p0 = (local % rg) * (GGW_BM * CL) + rank * GGW_BM;
    q0 = (local / rg) * GGW_BN;
    return;
  }
  p0 = (local / p.tilesQ) * (GGW_BM * CL) + rank * GGW_BM;
  q0 = (local % p.tilesQ) * GGW_BN;
}
#endif  // GGW_DEVICE

// A 16-byte cp.async of n (16 or 0: zero fill) bytes, and the arrival on a barrier once every
// earlier cp.async of this thread has landed (noinc: it is one of the barrier's counted arrivals).
#ifdef GGW_DEVICE
__device__ __forceinline__ void ggw_cp_async16(void *dst, const void *src, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(wgc_smem(dst)), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void ggw_cp_async_arrive(uint64_t *b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(wgc_smem(b)) : "memory");
}
// The rhs tile of k-tile kt by TMA into sb, completing on bar. CL = 2: this CTA's half of the
// tile (columns rank*128..), multicast to both CTAs of the pair.
template <int TB, int CL>
__device__ __forceinline__ void ggw_load_b(unsigned char *sb, const CUtensorMap *map_b, uint64_t *bar, int kt,
                                           int64_t q0, int64_t g, uint32_t rank) {
  if (CL == 1) {
    if (TB == 0) {
      wgc_tma_3d(sb, map_b, bar, kt * GGW_BK, (int)q0, (int)g);
    } else {
#pragma unroll
      for (int j = 0; j < GGW_BN / 64; ++j)
        wgc_tma_3d(sb + j * (64 * GGW_BK * 2), map_b, bar, (int)q0 + 64 * j, kt * GGW_BK, (int)g);
    }
  } else {
    const int h = (int)rank * (GGW_BN / CL);
    if (TB == 0) {
      wgc_tma_3d_mc(sb + h * 128, map_b, bar, kt * GGW_BK, (int)q0 + h, (int)g, (uint16_t)3);
    } else {
#pragma unroll
      for (int j = 0; j < GGW_BN / 64 / CL; ++j)
        wgc_tma_3d_mc(sb + (h / 64 + j) * (64 * GGW_BK * 2), map_b, bar, (int)q0 + h + 64 * j, kt * GGW_BK, (int)g,
                      (uint16_t)3);
    }
  }
}
#endif

// F16: f16 inputs (else bf16). TB: rhs op N ([G, K, N], N-major in shared memory; wgmma's
// transpose bit), else op T ([G, N, K], K-major). OUT: output tw_dtype. CL: CTAs per cluster
// (2: the pair takes 256 rows x 256 columns, same group and columns; each CTA loads half of
// the rhs tile and multicasts it to both, halving rhs traffic out of L2; a stage is free
// once the consumers of both CTAs released it).
// GA: a row-gathered lhs. TMA cannot gather rows on Hopper, so the producer warpgroup's 128
// threads copy A by cp.async instead: 8 16-byte chunks per row and k-tile, in the 128-byte
// swizzle that TMA would have written (chunk c of row r at r * 128 + ((c ^ (r & 7)) << 4) of a
// 1024-aligned stage). Each thread's arrival on the full barrier is made by
// cp.async.mbarrier.arrive.noinc when its copies land (the barrier counts 128 of them plus
// thread 0's expect_tx for the rhs bytes), so every stage of the ring can be in flight; the
// consumers order those generic-proxy writes before their wgmma (fence.proxy.async after the
// full barrier). With CL = 2 each CTA copies its own 128 rows and the rhs is multicast as usual.
template <bool F16, int TB, int OUT, int CL, int GA = 0>
__global__ void __launch_bounds__(GGW_THREADS, 1)
    ggw_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_o, const ggw_params p) {
#ifdef GGW_DEVICE
  extern __shared__ __align__(1024) unsigned char ggw_raw[];
  // the swizzle pattern is a function of address bits 7-9: stages start on 1024-byte bounds
  unsigned char *base = ggw_raw + ((1024 - (wgc_smem(ggw_raw) & 1023)) & 1023);
  unsigned char *epi = base + GGW_STAGES * GGW_STAGE_BYTES;  // [warpgroup][2 staging buffers of 8 KiB]
  uint64_t *full = (uint64_t *)(epi + GGW_EPI_BYTES);
  uint64_t *empty = full + GGW_STAGES;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const uint32_t rank = CL > 1 ? wgc_cta_rank() : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < GGW_STAGES; ++s) {
      wgc_bar_init(&full[s], GA ? 1 + 128 : 1);
      wgc_bar_init(&empty[s], 8 * CL);  // one arrival per consumer warp of each CTA
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (CL > 1) wgc_cluster_sync();  // the peer's barriers exist before any multicast or remote arrive
  else __syncthreads();
  const int64_t total = p.tile_start[p.G];
  const int ktiles = (int)((p.K + GGW_BK - 1) / GGW_BK);

  if (wg == 0) {
    // ---- producer: one thread issues every TMA load --------------------------------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (GA) {  // every producer thread copies A rows; thread 0 also loads the rhs by TMA
      if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
      int s = 0;
      uint32_t phase = 0;
      const int64_t rowb = p.K * 2;
      // lanes 8j..8j+7 of a warp take the 8 chunks of one row, so each warp's copy reads 4
      // rows' 128 contiguous bytes (whole 128-byte lines when K % 64 == 0): thread tid copies
      // chunk tid % 8 of rows tid / 8 + 16 i (i < 8)
      const int c = tid & 7, r0 = tid / 8;
      for (int64_t t = blockIdx.x / CL; t < total; t += gridDim.x / CL) {
        int64_t g, p0, q0;
        ggw_locate<CL>(p, t, rank, g, p0, q0);
        const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
        int32_t drow[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int64_t v = p0 + r0 + 16 * i < mg ? (int64_t)p.rows[og + p0 + r0 + 16 * i] : -1;
          drow[i] = v < p.U ? (int32_t)v : -1;  // >= U is reported by gg_check_rows: zeros, no read past the lhs
        }
        for (int kt = 0; kt < ktiles; ++kt) {
          wgc_bar_wait(&empty[s], phase ^ 1);
          unsigned char *sa = base + s * GGW_STAGE_BYTES, *sb = sa + GGW_A_BYTES;
          if (tid == 0) {
            wgc_bar_expect(&full[s], GGW_STAGE_BYTES - GGW_A_BYTES);
            ggw_load_b<TB, CL>(sb, &map_b, &full[s], kt, q0, g, rank);
          }
          // 8 cp.async (zero-filled past K or for a -1 row), then an arrival on full[s] once they
          // land; the thread goes on to the next stage meanwhile
          const int64_t k = (int64_t)kt * GGW_BK + 8 * c;  // K % 8 == 0: whole chunks
          unsigned char *chunk = sa + r0 * 128 + ((c ^ (r0 & 7)) << 4);  // (r0 + 16 i) & 7 = r0 & 7
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const bool in = drow[i] >= 0 && k < p.K;
            ggw_cp_async16(chunk + i * 16 * 128, in ? p.a + (int64_t)drow[i] * rowb + k * 2 : p.a, in ? 16 : 0);
          }
          ggw_cp_async_arrive(&full[s]);
          if (++s == GGW_STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    } else if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_a) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
      int s = 0;
      uint32_t phase = 0;
      for (int64_t t = blockIdx.x / CL; t < total; t += gridDim.x / CL) {
        int64_t g, p0, q0;
        ggw_locate<CL>(p, t, rank, g, p0, q0);
        const int row0 = (int)(p.offsets[g] + p0);
        for (int kt = 0; kt < ktiles; ++kt) {
          wgc_bar_wait(&empty[s], phase ^ 1);
          unsigned char *sa = base + s * GGW_STAGE_BYTES, *sb = sa + GGW_A_BYTES;
          wgc_bar_expect(&full[s], GGW_STAGE_BYTES);
          wgc_tma_2d(sa, &map_a, &full[s], kt * GGW_BK, row0);
          ggw_load_b<TB, CL>(sb, &map_b, &full[s], kt, q0, g, rank);
          if (++s == GGW_STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c = wg - 1 owns rows 64c..64c+63 of the tile ---------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    float d[128];
    int s = 0;
    uint32_t phase = 0;
    const bool pairs = (p.N & 1) == 0 && ((uintptr_t)p.out & (OUT == TW_F32 ? 7 : 3)) == 0;
    unsigned char *ebuf = epi + c * 16384;  // this warpgroup's two staging buffers
    int eb = 0;                             // next staging buffer
    for (int64_t t = blockIdx.x / CL; t < total; t += gridDim.x / CL) {
      int64_t g, p0, q0;
      ggw_locate<CL>(p, t, rank, g, p0, q0);
      const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
      int prev = -1;
      for (int kt = 0; kt < ktiles; ++kt) {
        wgc_bar_wait(&full[s], phase);
        // GA: the A rows came by cp.async (generic proxy); order them before wgmma's reads
        if (GA) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const uint32_t a0 = wgc_smem(base + s * GGW_STAGE_BYTES) + c * (64 * GGW_BK * 2);
        const uint32_t b0 = wgc_smem(base + s * GGW_STAGE_BYTES + GGW_A_BYTES);
        wgc_fence();
#pragma unroll
        for (int k = 0; k < GGW_BK / 16; ++k) {
          const uint64_t da = wgc_desc(a0 + k * 32, 16, 1024);
          const uint64_t db = TB == 0 ? wgc_desc(b0 + k * 32, 16, 1024)
                                      : wgc_desc(b0 + k * (16 * 128), 64 * GGW_BK * 2, 1024);
          ggw_mma_256<F16, TB>(d, da, db, (kt > 0 || k > 0) ? 1 : 0);
        }
        wgc_commit();
        wgc_wait<1>();
        wgc_touch<128>(d);
        if (prev >= 0) {
          __syncwarp();
          if (lane == 0) {
            if (CL == 1) wgc_bar_arrive(&empty[prev]);
            else
              for (int r = 0; r < CL; ++r) wgc_bar_arrive_at(&empty[prev], r);
          }
        }
        prev = s;
        if (++s == GGW_STAGES) {
          s = 0;
          phase ^= 1;
        }
      }
      wgc_wait<0>();
      wgc_touch<128>(d);
      if (prev >= 0) {
        __syncwarp();
        if (lane == 0) {
          if (CL == 1) wgc_bar_arrive(&empty[prev]);
          else
            for (int r = 0; r < CL; ++r) wgc_bar_arrive_at(&empty[prev], r);
        }
      }
      if (p.tma_out && p0 + 64 * c + 64 <= mg) {
        // ---- epilogue through shared memory (all 64 rows of this warpgroup in the group):
        // chunks of 64 rows x 128 bytes (CW columns), each converted into a staging buffer
        // (128-byte swizzle: 16-byte chunk q of row r at q ^ (r % 8), conflict-free), then one TMA
        // store of the box into out [M, N] (columns past N clipped by the map; column starts
        // q0 + CW*ch are 128-byte aligned, so the 16-byte innermost-start rule holds). Two
        // buffers alternate; a buffer is refilled once the store issued from it two chunks ago
        // has read it; the last stores drain while the next tile's k-tiles run. Same
        // conversion (RNE of the f32 accumulator) as the register stores: same bits.
        constexpr int ES = OUT == TW_F32 ? 4 : 2, CW = 128 / ES, NCH = GGW_BN / CW;
        const int row = (int)(og + p0 + 64 * c);
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch) {
          if (q0 + ch * CW >= p.N) break;  // uniform
          unsigned char *buf = ebuf + eb * 8192;
          ggw_stage_chunk<OUT>(d, ch, buf, c, warp, lane, tid);
          if (tid == 0) ggw_tma_store_2d(&map_o, buf, (int)(q0 + ch * CW), row);
          eb ^= 1;
        }
        continue;
      }
      // ---- epilogue from registers (group edges, accumulate, or out TMA cannot map): rows
      // p0 + 64c + 16*warp + lane/4 (+8), columns q0 + 8j + 2*(lane%4) (+1)
      const int64_t r0 = p0 + 64 * c + 16 * warp + lane / 4;
      const int64_t cbase = q0 + 2 * (lane % 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = r0 + 8 * h;
        if (r >= mg) continue;
        const int64_t rowbase = (og + r) * p.N;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int64_t col = cbase + 8 * j;
          const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
          if (pairs) {
            if (col < p.N) wgc_put2<OUT>(p.out, rowbase + col, v0, v1, p.accumulate);
          } else {
            if (col < p.N) wgc_put1<OUT>(p.out, rowbase + col, v0, p.accumulate);
            if (col + 1 < p.N) wgc_put1<OUT>(p.out, rowbase + col + 1, v1, p.accumulate);
          }
        }
      }
    }
    if (p.tma_out && tid == 0) ggw_store_wait_all();  // the staging buffers stay alive until read
  }
  // no CTA leaves while its peer may still arrive on its barriers
  if (CL > 1) {
    __syncwarp();
    wgc_cluster_sync();
  }
#endif
}

// tile_start[g] = sum_{j<g} ceil(m_j / rows) * tilesQ (rows = 128 * CL), one block.
#define GGW_PREFIX_THREADS 256
__global__ void __launch_bounds__(GGW_PREFIX_THREADS)
    ggw_tile_prefix(const int64_t *__restrict__ offsets, int64_t G, int64_t rows, int64_t tilesQ,
                    int64_t *__restrict__ tile_start) {
  typedef cub::BlockScan<int64_t, GGW_PREFIX_THREADS> scan_t;
  __shared__ typename scan_t::TempStorage tmp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t b = 0; b < G; b += GGW_PREFIX_THREADS) {
    const int64_t g = b + threadIdx.x;
    const int64_t v = g < G ? ((offsets[g + 1] - offsets[g] + rows - 1) / rows) * tilesQ : 0;
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

// Whether gg_wgmma takes this forward problem; if not, *why says what it declines.
int gg_wgmma_takes(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op, const tw_tensor *out,
                   const char **why) {
  gpu_state *st = gpu_of(ctx);
  const int64_t M = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1], G = rhs->data.shape[0];
  const int dt = lhs->data.dtype;
  *why = NULL;
  if (st->sm != 90) *why = "needs an sm_90 device (wgmma, TMA)";
  else if (lhs->mode != TW_SCALE_NONE || rhs->mode != TW_SCALE_NONE || (dt != TW_BF16 && dt != TW_F16) ||
           rhs->data.dtype != dt)
    *why = "takes plain bf16 x bf16 or f16 x f16 operands only";
  else if (rhs->data.ndim != 3) *why = "takes rhs as one [G, K, N] or [G, N, K] tensor";
  else if (K == 0 || K % 8 || (rhs_op == TW_OP_N && N % 8))
    *why = "needs K (and N for rhs_op N) a non-zero multiple of 8 (TMA: 16-byte row strides)";
  else if (((uintptr_t)lhs->data.data & 15) || ((uintptr_t)rhs->data.data & 15))
    *why = "needs 16-byte aligned lhs and rhs";
  else if (M >= ((int64_t)1 << 31) || K >= ((int64_t)1 << 31) || N >= ((int64_t)1 << 31) || G >= ((int64_t)1 << 31))
    *why = "needs M, N, K and G below 2^31 (TMA coordinates)";
  return *why == NULL;
}

// Persistent grid: as many CTAs (clusters of CL) as are resident at once, asked once per device.
template <bool F16, int TB, int OUT, int CL, int GA = 0>
static tw_status ggw_launch_t(tw_ctx *ctx, const CUtensorMap *ma, const CUtensorMap *mb, const CUtensorMap *mo,
                              const ggw_params *p, const char *op) {
  gpu_state *st = gpu_of(ctx);
  void (*fn)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const ggw_params) =
      ggw_kernel<F16, TB, OUT, CL, GA>;
  static int grid_of[64];
  int dev = st->device < 64 ? st->device : 0;
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = CL;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(GGW_THREADS);
  cfg.dynamicSmemBytes = GGW_SMEM;
  cfg.stream = st->stream;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  if (!grid_of[dev]) {
    GPU_TRY_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, GGW_SMEM),
                 "grouped_gemm (gg_wgmma): cudaFuncSetAttribute");
    grid_of[dev] = st->num_sms;
  }
  if (CL == 1) {  // a plain launch, as in run g1 (suspect of the G32 drop in g2/g3: cluster launch of 1)
    fn<<<(unsigned)grid_of[dev], GGW_THREADS, GGW_SMEM, st->stream>>>(*ma, *mb, *mo, *p);
    GPU_TRY_CUDA(cudaGetLastError(), op);
    return TW_OK;
  }
  static int clusters_of[64];
  if (!clusters_of[dev]) {
    int clusters = 0;
    cfg.gridDim = dim3((unsigned)(st->num_sms / CL * CL));
    GPU_TRY_CUDA(cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg), "grouped_gemm (gg_wgmma): cluster occupancy");
    clusters_of[dev] = clusters > 0 ? clusters * CL : st->num_sms / CL * CL;
    const char *gv = getenv("TWIN_GG_WGMMA_GRID");  // measurement knob: CTAs of the cluster grid
    if (gv && atoi(gv) >= CL) clusters_of[dev] = atoi(gv) / CL * CL;
    const char *v = getenv("TWIN_GG_WGMMA_VERBOSE");
    if (v && *v == '1')
      fprintf(stderr, "gg_wgmma: cluster %d, max active clusters %d, grid %d CTAs, %d SMs\n", CL, clusters,
              clusters_of[dev], st->num_sms);
  }
  cfg.gridDim = dim3((unsigned)clusters_of[dev]);
  GPU_TRY_CUDA(cudaLaunchKernelEx(&cfg, fn, *ma, *mb, *mo, *p), op);
  return TW_OK;
}

// rows: a row-gathered lhs [U, K] (lhs_rows, device [M]); NULL: lhs [M, K].
static tw_status ggw_forward(tw_ctx *ctx, const tw_operand *lhs, const int32_t *rows, const tw_operand *rhs,
                             tw_op rhs_op, const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate,
                             const char *op) {
  const char *why;
  if (!gg_wgmma_takes(ctx, lhs, rhs, rhs_op, out, &why))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA, why);
  const int64_t M = out->shape[0], K = lhs->data.shape[1], N = out->shape[1], U = lhs->data.shape[0];
  if (M == 0 || N == 0 || G == 0) return TW_OK;
  if (M >= ((int64_t)1 << 31))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' needs M below 2^31 (TMA coordinates)", op, GG_KERNEL_WGMMA);
  PFN_cuTensorMapEncodeTiled_v12000 enc = wgc_encode_fn();
  if (!enc) return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': no cuTensorMapEncodeTiled in the driver", op, GG_KERNEL_WGMMA);
  const int f16 = lhs->data.dtype == TW_F16;
  static int forced_cl = -1;
  if (forced_cl < 0) {
    const char *e = getenv("TWIN_GG_WGMMA_CLUSTER");
    forced_cl = e && (strcmp(e, "1") == 0 || strcmp(e, "2") == 0) ? atoi(e) : 0;
  }
  const int cl = forced_cl ? forced_cl : (M / G >= 2 * GGW_BM ? 2 : 1);
  const CUtensorMapDataType dt = f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  CUtensorMap ma, mb;
  memset(&ma, 0, sizeof ma);
  memset(&mb, 0, sizeof mb);
  if (!rows) {
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M}, strides[1] = {(cuuint64_t)K * 2};
    cuuint32_t box[2] = {GGW_BK, GGW_BM}, es[2] = {1, 1};
    CUresult r = enc(&ma, dt, 2, lhs->data.data, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': lhs tensor map refused (CUresult %d)", op, GG_KERNEL_WGMMA,
                      (int)r);
  }
  {
    const int tb = rhs_op == TW_OP_N;  // [G, K, N]: N inner
    cuuint64_t dims[3] = {(cuuint64_t)(tb ? N : K), (cuuint64_t)(tb ? K : N), (cuuint64_t)G};
    cuuint64_t strides[2] = {(cuuint64_t)(tb ? N : K) * 2, (cuuint64_t)(K * N) * 2};
    cuuint32_t box[3] = {64, tb ? (cuuint32_t)GGW_BK : (cuuint32_t)(GGW_BN / cl), 1}, es[3] = {1, 1, 1};
    CUresult r = enc(&mb, dt, 3, rhs->data.data, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': rhs tensor map refused (CUresult %d)", op, GG_KERNEL_WGMMA,
                      (int)r);
  }
  ggw_params p;
  memset(&p, 0, sizeof p);
  p.offsets = offsets;
  p.out = out->data;
  p.N = N;
  p.K = K;
  p.G = G;
  p.tilesQ = (N + GGW_BN - 1) / GGW_BN;
  p.accumulate = accumulate;
  // Tile order within a group: with single CTAs (groups averaging < 256 rows) row tiles first,
  // so the few row tiles that share an rhs tile run side by side and read it from L2 once: the
  // MoE block at E 256 (groups of ~128 rows) ran its bf16 forward GEMMs 11-18% faster, while
  // with pairs (E 32, 1024-row groups) it was slower (gpu/NOTES-gemm.md session 19).
  // TWIN_GG_TILE_ORDER=m|n forces either (measurement knob).
  const char *tov = getenv("TWIN_GG_TILE_ORDER");
  p.m_first = tov && !strcmp(tov, "m") ? 1 : tov && !strcmp(tov, "n") ? 0 : cl == 1;
  p.rows = rows;
  p.a = (const unsigned char *)lhs->data.data;
  p.U = U;
  // out [M, N] as a 2-D map, boxes of 64 rows x 128 bytes, for the interior warpgroups' TMA
  // stores: not accumulating, base 16-byte aligned, row stride a multiple of 16 bytes.
  // Measurement knob TWIN_GG_WGMMA_EPI=regs (read on every call): every tile from registers.
  CUtensorMap mo;
  memset(&mo, 0, sizeof mo);
  const char *ev = getenv("TWIN_GG_WGMMA_EPI");
  const int oes = out->dtype == TW_F32 ? 4 : 2;
  p.tma_out = !accumulate && ((uintptr_t)out->data & 15) == 0 && (N * oes) % 16 == 0 && !(ev && !strcmp(ev, "regs"));
  if (p.tma_out) {
    const CUtensorMapDataType ot = out->dtype == TW_F32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : out->dtype == TW_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    cuuint64_t dims[2] = {(cuuint64_t)N, (cuuint64_t)M}, strides[1] = {(cuuint64_t)N * oes};
    cuuint32_t box[2] = {(cuuint32_t)(128 / oes), 64}, es2[2] = {1, 1};
    CUresult r = enc(&mo, ot, 2, out->data, dims, strides, box, es2, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) p.tma_out = 0;  // the register epilogue takes any out
  }
  int64_t *ts;
  TW_TRY(gpu_scratch(ctx, (size_t)(G + 1) * sizeof(int64_t), (void **)&ts));
  ggw_tile_prefix<<<1, GGW_PREFIX_THREADS, 0, gpu_of(ctx)->stream>>>(offsets, G, (int64_t)GGW_BM * cl, p.tilesQ, ts);
  GPU_TRY_CUDA(cudaGetLastError(), op);
  p.tile_start = ts;
#define GGW_CL(F, T, O) \
  return rows ? (cl == 1 ? ggw_launch_t<F, T, O, 1, 1>(ctx, &ma, &mb, &mo, &p, op) \
                         : ggw_launch_t<F, T, O, 2, 1>(ctx, &ma, &mb, &mo, &p, op)) \
         : cl == 1 ? ggw_launch_t<F, T, O, 1>(ctx, &ma, &mb, &mo, &p, op) \
                   : ggw_launch_t<F, T, O, 2>(ctx, &ma, &mb, &mo, &p, op);
#define GGW_OUT(F, T)                   \
  switch (out->dtype) {                 \
    case TW_F32: GGW_CL(F, T, TW_F32)   \
    case TW_BF16: GGW_CL(F, T, TW_BF16) \
    default: GGW_CL(F, T, TW_F16)       \
  }
  if (f16) {
    if (rhs_op == TW_OP_N) { GGW_OUT(true, 1) }
    GGW_OUT(true, 0)
  }
  if (rhs_op == TW_OP_N) { GGW_OUT(false, 1) }
  GGW_OUT(false, 0)
#undef GGW_OUT
#undef GGW_CL
}

tw_status gg_wgmma_forward(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                           const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate, const char *op) {
  return ggw_forward(ctx, lhs, NULL, rhs, rhs_op, offsets, G, out, accumulate, op);
}

tw_status gg_wgmma_forward_rows(tw_ctx *ctx, const tw_operand *lhs, const int32_t *rows, const tw_operand *rhs,
                                tw_op rhs_op, const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate,
                                const char *op) {
  return ggw_forward(ctx, lhs, rows, rhs, rhs_op, offsets, G, out, accumulate, op);
}

// ---- wgrad (ragged contracting dim) -----------------------------------------------------------
//   out[g] [P, N] = lhs_g^T @ rhs_g,  lhs_g = rows [o_g, o_g + m_g) of lhs [M, P] (op N),
//                                      rhs_g = the same rows of rhs [M, N] (op N)
// Same CTA tile, ring, warp roles and wgmma as the forward; what differs:
//   - A = lhs_g^T is MN-major (P contiguous): two 64 x 64 TMA boxes per stage (P columns
//     p0..p0+63 and p0+64..p0+127 of rows o_g + 64 kt ..), one per consumer warpgroup, read
//     with wgmma's transpose bit for A; B = rhs_g is N-major exactly like the forward's rhs op N.
//   - The tile list is fixed on the host: G x tilesP x tilesQ (group-major, then P, then N
//     tiles); each tile contracts over ceil(m_g / 64) k-tiles, m_g read from the device offsets.
//   - The group's K extent (default, session 24): per-group tensor maps. A small kernel
//     (ggw_patch_maps_kernel, before the GEMM, on the stream: no host sync) copies the two
//     whole-tensor maps into 2G slots of scratch and points slot 2g / 2g+1 at row o_g of lhs /
//     rhs with a row extent of m_g (tensormap.replace of the global address and of dim 1), so
//     the rows of a group's last k-tile past m_g are outside the map and TMA fills them with
//     zeros; the producer acquires a group's maps (fence.proxy.tensormap) at each change of
//     group, and the consumers never touch a stage. A group whose size is a multiple of 64
//     keeps the whole-tensor maps (nothing to fill). A row-gathered lhs has no map: it takes the
//     rhs maps only (its producer warpgroup copies A rows past the group as zeros).
//   - The same without per-group maps (TWIN_GG_WGMMA_WGRAD_MAPS=0, the zeroing knobs, more
//     groups than 2G maps fit the scratch): the last k-tile's box also covers rows of group
//     g+1 (or rows past the sizes' sum, which may hold NaN: tw_gemm.h). TMA zero-fills only at the tensor edge,
//     so the consumers zero those rows in shared memory before the wgmma reads the stage
//     (rows are whole 128-byte lines under the 128-byte swizzle, so no swizzle arithmetic):
//     warpgroup c clears its A box and B boxes 2c, 2c+1, then fence.proxy.async (generic
//     writes -> the async proxy wgmma reads through) and a named barrier of the 256 consumer
//     threads. Only the last k-tile of a tile with m_g % 64 != 0 pays this: 7-30% on small
//     ragged groups, which is why per-group maps took its place by default (gpu/NOTES-gemm.md,
//     "gg_wgmma wgrad" and "Session 24").
//   - Empty groups: out[g] = +0 written by the consumers (accumulate: untouched); no loads.
//   - Epilogue, not accumulating: each warpgroup's 64 x 256 block goes through two 8 KiB
//     staging buffers (64 rows x 128 bytes, 128-byte swizzle) and TMA stores into out seen as
//     [G, K, N] (clipped per group); accumulating: stores from registers (f32 read-modify-write,
//     one rounding). Run w2: 2.7x on the write-bound G128 shape.
//   - Knobs (measurement): TWIN_GG_WGMMA_WGRAD_ZERO=producer has producer warps 1-3 zero the
//     tail rows between a land and the full barrier (correct, not faster: run w3);
//     TWIN_GG_WGMMA_WGRAD_NOMASK=1 skips the zeroing (with MAPS=0; wrong results, timing only);
//     TWIN_GG_WGMMA_WGRAD_REGSTORE=1 forces the register epilogue.
//   - Tried and removed (gpu/NOTES-gemm.md, sessions 21-23; code at b391088): a ping-pong with
//     whole 128 x 128 tiles per consumer warpgroup, and pairs of CTAs sharing B by multicast,
//     each slower than this kernel or no faster (G32 / G128: 0.86-0.89 of the forward in all).
struct ggw_wparams {
  const int64_t *offsets;  // device [G+1] row offsets (gpu_group_prefix)
  void *out;               // [G, P, N]
  int64_t P, N, G, tilesP, tilesQ;
  int accumulate;
  int mask;     // 1 (always, but for the timing knob TWIN_GG_WGMMA_WGRAD_NOMASK): zero the tail rows
  int tma_out;  // 1: the epilogue goes through shared memory and TMA stores (not accumulating,
                // out 16-byte aligned); else stores from registers as the forward's
  const CUtensorMap *gmaps;  // per-group maps [2G] in device memory (lhs of group g at 2g, rhs at
                            // 2g+1), or NULL: the whole-tensor maps and the tail zeroing
  int zero_prod;  // who zeroes the tail rows: 0 the consumers (after full[s]), 1 producer warps
                  // 1-3 (TMA completes on land[s]; they zero, then arrive on full[s])
  // row-gathered lhs (GA kernel, tw_grouped_gemm_wgrad_rows): token row o_g + x of the lhs is
  // data row rows[o_g + x] of a [U, P] lhs (-1, or outside [0, U): zeros), copied by the
  // producer warpgroup; zero_prod is 0
  const int32_t *rows;
  const unsigned char *a;
  int64_t U;
};
#define GGW_ZERO_PROD_DEFAULT 0
#define GGW_WSMEM (GGW_STAGES * GGW_STAGE_BYTES + GGW_EPI_BYTES + 1024 + 3 * GGW_STAGES * 8)

#ifdef GGW_DEVICE
__device__ __forceinline__ void ggw_wlocate(const ggw_wparams &p, int64_t t, int64_t &g, int64_t &p0, int64_t &q0) {
  const int64_t per = p.tilesP * p.tilesQ;
  g = t / per;
  const int64_t local = t - g * per;
  p0 = (local / p.tilesQ) * GGW_BM;
  q0 = (local % p.tilesQ) * GGW_BN;
}
#endif



// GA: a row-gathered lhs (the forward's GA protocol): the 128 producer threads copy the two
// 64 x 64 A boxes of each k-tile by cp.async (thread t: chunk t % 8 of token rows t / 8 + 16 i,
// i < 4, in both boxes; rows past the group or with index -1 and columns past P zero-filled) and
// arrive through cp.async.mbarrier.arrive.noinc; thread 0 loads the rhs boxes by TMA. The
// consumers fence the generic-proxy writes after the full barrier, as in the forward.
template <bool F16, int OUT, int GA = 0>
__global__ void __launch_bounds__(GGW_THREADS, 1)
    ggw_wgrad_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_o, const ggw_wparams p) {
#ifdef GGW_DEVICE
  extern __shared__ __align__(1024) unsigned char ggw_raw[];
  unsigned char *base = ggw_raw + ((1024 - (wgc_smem(ggw_raw) & 1023)) & 1023);
  constexpr int NST = GGW_STAGES, SBY = GGW_STAGE_BYTES;
  unsigned char *epi = base + NST * SBY;
  uint64_t *full = (uint64_t *)(epi + GGW_EPI_BYTES);
  uint64_t *empty = full + NST;
  uint64_t *land = empty + NST;  // zero_prod: the TMA bytes landed (before the tail zeroing)
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int zp = p.zero_prod;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NST; ++s) {
      wgc_bar_init(&full[s], GA ? 1 + 128 : zp ? 3 : 1);  // zero_prod: one arrival per zeroing warp
      wgc_bar_init(&empty[s], 8);  // one arrival per consumer warp
      wgc_bar_init(&land[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int64_t t_first = blockIdx.x, t_step = gridDim.x;
  const int64_t total = p.G * p.tilesP * p.tilesQ;
  constexpr int BOX = 64 * GGW_BK * 2;  // one 64 x 64 box, 8 KiB

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (GA) {
      if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
      int s = 0;
      uint32_t phase = 0;
      const int c8 = tid & 7, r0 = tid / 8;
      const int64_t rowb = p.P * 2;
      int64_t mapped_g = -1;  // thread 0: the group whose rhs map it has acquired
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        int64_t g, p0, q0;
        ggw_wlocate(p, t, g, p0, q0);
        const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
        const int ktiles = (int)((mg + GGW_BK - 1) / GGW_BK);
        // the rhs through its group's map at a ragged end (A rows past the group are copied as
        // zeros anyway), so nothing in the stage needs zeroing
        const bool own = p.gmaps && mg % GGW_BK != 0;
        const CUtensorMap *mb = own ? p.gmaps + 2 * g + 1 : &map_b;
        const int64_t row0 = own ? 0 : og;
        if (own && tid == 0 && g != mapped_g) {
          wgc_tensormap_acquire(mb);
          mapped_g = g;
        }
        // the row indices of k-tile kt, read one k-tile ahead (their loads overlap the copies and
        // the next wait); >= U is reported by gg_check_rows and copies zeros
        int32_t drow[4];
        auto indices = [&](int kt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t x = (int64_t)kt * GGW_BK + r0 + 16 * i;
            const int64_t v = x < mg ? (int64_t)p.rows[og + x] : -1;
            drow[i] = v < p.U ? (int32_t)v : -1;
          }
        };
        if (ktiles > 0) indices(0);
        for (int kt = 0; kt < ktiles; ++kt) {
          wgc_bar_wait(&empty[s], phase ^ 1);
          unsigned char *sa = base + s * GGW_STAGE_BYTES, *sb = sa + GGW_A_BYTES;
          if (tid == 0) {
            wgc_bar_expect(&full[s], GGW_STAGE_BYTES - GGW_A_BYTES);
            const int row = (int)(row0 + (int64_t)kt * GGW_BK);
#pragma unroll
            for (int j = 0; j < GGW_BN / 64; ++j) wgc_tma_2d(sb + j * BOX, mb, &full[s], (int)q0 + 64 * j, row);
          }
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int64_t col = p0 + 64 * b + 8 * c8;  // P % 8 == 0: whole chunks
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int r = r0 + 16 * i;
              const bool in = drow[i] >= 0 && col < p.P;
              ggw_cp_async16(sa + b * BOX + r * 128 + ((c8 ^ (r & 7)) << 4),
                             in ? p.a + (int64_t)drow[i] * rowb + col * 2 : p.a, in ? 16 : 0);
            }
          }
          ggw_cp_async_arrive(&full[s]);
          if (kt + 1 < ktiles) indices(kt + 1);
          if (++s == GGW_STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    } else if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_a) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&map_b) : "memory");
      int s = 0;
      uint32_t phase = 0;
      int64_t mapped_g = -1;  // the group whose per-group maps this thread has acquired
      for (int64_t t = t_first; t < total; t += t_step) {
        int64_t g, p0, q0;
        ggw_wlocate(p, t, g, p0, q0);
        const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
        const int ktiles = (int)((mg + GGW_BK - 1) / GGW_BK);
        // per-group maps where the group ends inside a k-tile: rows counted from the group's
        // first row, the group's end is the map's (a group of whole k-tiles keeps the
        // whole-tensor maps: no acquire, no descriptor fetch; uniform G128 ran 2-4% slower
        // with its own maps)
        const bool own = p.gmaps && mg % GGW_BK != 0;
        const CUtensorMap *ma = own ? p.gmaps + 2 * g : &map_a, *mb = own ? p.gmaps + 2 * g + 1 : &map_b;
        const int64_t row0 = own ? 0 : og;
        if (own && g != mapped_g) {  // written by ggw_patch_maps_kernel
          wgc_tensormap_acquire(ma);
          wgc_tensormap_acquire(mb);
          mapped_g = g;
        }
        for (int kt = 0; kt < ktiles; ++kt) {
          wgc_bar_wait(&empty[s], phase ^ 1);
          unsigned char *sa = base + s * SBY, *sb = sa + GGW_A_BYTES;
          const int row = (int)(row0 + (int64_t)kt * GGW_BK);
          uint64_t *tb = zp ? &land[s] : &full[s];
          wgc_bar_expect(tb, (GGW_BM / 64 + GGW_BN / 64) * BOX);  // zero-filled bytes count too
          wgc_tma_2d(sa, ma, tb, (int)p0, row);
          wgc_tma_2d(sa + BOX, ma, tb, (int)p0 + 64, row);
#pragma unroll
          for (int j = 0; j < GGW_BN / 64; ++j) wgc_tma_2d(sb + j * BOX, mb, tb, (int)q0 + 64 * j, row);
          if (++s == NST) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    } else if (zp && tid >= 32) {
      // ---- zero_prod: warps 1-3 pass every stage on from land[s] to full[s]; on a group's
      // last k-tile they first zero rows valid..63 of its six 64 x 64 boxes (A: 2, B: 4,
      // contiguous), each warp a third, then fence.proxy.async (generic writes -> wgmma)
      const int zt = tid - 32, lane = tid % 32;
      int s = 0;
      uint32_t phase = 0;
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        int64_t g, p0, q0;
        ggw_wlocate(p, t, g, p0, q0);
        const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
        const int ktiles = (int)((mg + GGW_BK - 1) / GGW_BK);
        for (int kt = 0; kt < ktiles; ++kt) {
          wgc_bar_wait(&land[s], phase);
          const int valid = (int)(mg - (int64_t)kt * GGW_BK);
          if (valid < GGW_BK && p.mask) {
            unsigned char *st = base + s * GGW_STAGE_BYTES;
            const int per_box = (GGW_BK - valid) * 8;  // 16-byte chunks
            for (int i = zt; i < 6 * per_box; i += 96) {
              const int b = i / per_box, r = i - b * per_box;
              *(uint4 *)(st + b * BOX + (valid + r / 8) * 128 + (r % 8) * 16) = make_uint4(0, 0, 0, 0);
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          }
          __syncwarp();
          if (lane == 0) wgc_bar_arrive(&full[s]);
          if (++s == GGW_STAGES) {
            s = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c owns rows p0 + 64c .. + 63 of out[g] ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    float d[128];
    int s = 0;
    uint32_t phase = 0;
    const bool pairs = (p.N & 1) == 0 && ((uintptr_t)p.out & (OUT == TW_F32 ? 7 : 3)) == 0;
    unsigned char *ebuf = epi + c * 16384;  // this warpgroup's two staging buffers
    int eb = 0;                             // next staging buffer
    for (int64_t t = t_first; t < total; t += t_step) {
      int64_t g, p0, q0;
      ggw_wlocate(p, t, g, p0, q0);
      const int64_t og = p.offsets[g], mg = p.offsets[g + 1] - og;
      const int ktiles = (int)((mg + GGW_BK - 1) / GGW_BK);
      const int64_t r0 = p0 + 64 * c + 16 * warp + lane / 4;
      const int64_t cbase = q0 + 2 * (lane % 4);
      if (ktiles == 0) {  // empty group: out[g] = +0 (accumulate: untouched); d is not used here
        if (p.accumulate) continue;
        for (int h = 0; h < 2; ++h) {
          const int64_t r = r0 + 8 * h;
          if (r >= p.P) continue;
          const int64_t rowbase = (g * p.P + r) * p.N;
          for (int j = 0; j < 32; ++j) {
            const int64_t col = cbase + 8 * j;
            if (col < p.N) wgc_put1<OUT>(p.out, rowbase + col, 0.f, 0);
            if (col + 1 < p.N) wgc_put1<OUT>(p.out, rowbase + col + 1, 0.f, 0);
          }
        }
        continue;
      }
      int prev = -1;
      for (int kt = 0; kt < ktiles; ++kt) {
        wgc_bar_wait(&full[s], phase);
        if (GA) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the cp.async A rows
        unsigned char *st = base + s * SBY;
        const int valid = (int)(mg - (int64_t)kt * GGW_BK);
        if (valid < GGW_BK && p.mask && !zp && !p.gmaps) {
          // rows valid..63 of this warpgroup's A box and of B boxes 2c, 2c+1 belong to another
          // group (or past the sum): zero them, then make the writes visible to wgmma
          const int per_box = (GGW_BK - valid) * 8;  // 16-byte chunks
          for (int i = tid; i < 3 * per_box; i += 128) {
            const int b = i / per_box, r = i - b * per_box;
            unsigned char *box = b == 0 ? st + c * BOX : st + GGW_A_BYTES + (2 * c + b - 1) * BOX;
            *(uint4 *)(box + (valid + r / 8) * 128 + (r % 8) * 16) = make_uint4(0, 0, 0, 0);
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          asm volatile("bar.sync 1, 256;\n" ::: "memory");
        }
        const uint32_t a0 = wgc_smem(st) + c * BOX;
        const uint32_t b0 = wgc_smem(st + GGW_A_BYTES);
        wgc_fence();
#pragma unroll
        for (int k = 0; k < GGW_BK / 16; ++k) {
          // both MN-major: a k16 step is 16 rows of 128 bytes; LBO = next 64-wide box
          const uint64_t da = wgc_desc(a0 + k * (16 * 128), BOX, 1024);
          const uint64_t db = wgc_desc(b0 + k * (16 * 128), BOX, 1024);
          ggw_mma_256<F16, 1, 1>(d, da, db, (kt > 0 || k > 0) ? 1 : 0);
        }
        wgc_commit();
        wgc_wait<1>();
        wgc_touch<128>(d);
        if (prev >= 0) {
          __syncwarp();
          if (lane == 0) wgc_bar_arrive(&empty[prev]);
        }
        prev = s;
        if (++s == NST) {
          s = 0;
          phase ^= 1;
        }
      }
      wgc_wait<0>();
      wgc_touch<128>(d);
      __syncwarp();
      if (lane == 0) wgc_bar_arrive(&empty[prev]);
      if (p.tma_out) {
        // ---- epilogue through shared memory: chunks of 64 rows x 128 bytes (CW columns), each
        // converted into a staging buffer (128-byte swizzle: conflict-free), then one TMA store
        // of the box into out viewed as [G, K, N] (rows past K and columns past N are clipped by
        // the map, never into group g+1). Two buffers alternate; a buffer is refilled once the
        // store issued from it two chunks ago has read it.
        constexpr int ES = OUT == TW_F32 ? 4 : 2, CW = 128 / ES, NCH = GGW_BN / CW;
        const int64_t pw = p0 + 64 * c;  // this warpgroup's first row
        if (pw >= p.P) continue;         // rows all past K (uniform)
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch) {
          if (q0 + ch * CW >= p.N) break;  // uniform
          unsigned char *buf = ebuf + eb * 8192;
          ggw_stage_chunk<OUT>(d, ch, buf, c, warp, lane, tid);
          if (tid == 0) ggw_tma_store_3d(&map_o, buf, (int)(q0 + ch * CW), (int)pw, (int)g);
          eb ^= 1;
        }
        continue;
      }
      // ---- epilogue from registers (accumulate, or out not 16-byte aligned): rows
      // p0 + 64c + 16*warp + lane/4 (+8), columns q0 + 8j + 2*(lane%4) (+1)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = r0 + 8 * h;
        if (r >= p.P) continue;
        const int64_t rowbase = (g * p.P + r) * p.N;
#pragma unroll
        for (int j = 0; j < GGW_BN / 8; ++j) {
          const int64_t col = cbase + 8 * j;
          const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
          if (pairs) {
            if (col < p.N) wgc_put2<OUT>(p.out, rowbase + col, v0, v1, p.accumulate);
          } else {
            if (col < p.N) wgc_put1<OUT>(p.out, rowbase + col, v0, p.accumulate);
            if (col + 1 < p.N) wgc_put1<OUT>(p.out, rowbase + col + 1, v1, p.accumulate);
          }
        }
      }
    }
    if (tid == 0) ggw_store_wait_all();  // the staging buffers stay alive until read
  }
#endif
}

// The per-group maps of the wgrad (see "The group's K extent" above): thread i writes slot i of
// out [2G] (lhs of group i / 2 for even i, rhs for odd i): the whole-tensor map, then, for a
// non-empty group, its base moved to the group's first row and its row extent cut to m_g.
// lhs rows are P elements, rhs rows N (16-bit, multiples of 8: 16-byte aligned bases). A
// row-gathered lhs has no map: the host passes the rhs map and rows for both (its lhs slots are
// never read).
__global__ void ggw_patch_maps_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                      const int64_t *offsets, int64_t G, const unsigned char *a, const unsigned char *b,
                                      int64_t P, int64_t N, CUtensorMap *out) {
#ifdef GGW_DEVICE
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 2 * G) return;
  const int64_t g = i / 2;
  const bool rhs = i & 1;
  const uint4 *src = (const uint4 *)(rhs ? &map_b : &map_a);
  uint4 *dst = (uint4 *)(out + i);
#pragma unroll
  for (int k = 0; k < 8; ++k) dst[k] = src[k];
  const int64_t og = offsets[g], mg = offsets[g + 1] - og;
  if (mg > 0) {  // an empty group's maps are never used (no loads); a map's extent must be >= 1
    const uint64_t base = (uint64_t)(rhs ? b + og * N * 2 : a + og * P * 2);
    const uint64_t slot = (uint64_t)__cvta_generic_to_global(out + i);  // .global wants a global address
    asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;\n" ::"l"(slot), "l"(base) : "memory");
    asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;\n" ::"l"(slot), "r"((uint32_t)mg)
                 : "memory");
  }
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
#endif
}

// Calls that took the per-group maps (tests check the default path really runs them).
static long ggw_wgrad_map_calls;
extern "C" long gg_wgmma_wgrad_map_calls(void) { return __atomic_load_n(&ggw_wgrad_map_calls, __ATOMIC_RELAXED); }

int gg_wgmma_wgrad_takes(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                         const tw_tensor *out, const char **why) {
  gpu_state *st = gpu_of(ctx);
  const int dt = lhs->data.dtype;
  *why = NULL;
  if (st->sm != 90) *why = "needs an sm_90 device (wgmma, TMA)";
  else if (lhs->mode != TW_SCALE_NONE || rhs->mode != TW_SCALE_NONE || (dt != TW_BF16 && dt != TW_F16) ||
           rhs->data.dtype != dt)
    *why = "takes plain bf16 x bf16 or f16 x f16 operands only";
  else if (lhs_op != TW_OP_N || rhs_op != TW_OP_N || lhs->data.ndim != 2 || rhs->data.ndim != 2 || out->ndim != 3)
    *why = "takes the wgrad with lhs [M, K] and rhs [M, N] (ops N) only, not per-group transposed copies";
  else if (out->shape[1] % 8 || out->shape[2] % 8)
    *why = "needs K and N multiples of 8 for the wgrad (TMA: 16-byte row strides)";
  else if (((uintptr_t)lhs->data.data & 15) || ((uintptr_t)rhs->data.data & 15))
    *why = "needs 16-byte aligned lhs and rhs";
  else if (rhs->data.shape[0] >= ((int64_t)1 << 31) - GGW_BK || out->shape[1] >= ((int64_t)1 << 31) ||
           out->shape[2] >= ((int64_t)1 << 31) || out->shape[0] >= ((int64_t)1 << 31))  // M: rhs rows (a gathered lhs has U)
    *why = "needs M, N, K and G below 2^31 (TMA coordinates)";
  return *why == NULL;
}

template <bool F16, int OUT, int GA = 0>
static tw_status ggw_wgrad_launch_t(tw_ctx *ctx, const CUtensorMap *ma, const CUtensorMap *mb, const CUtensorMap *mo,
                                    const ggw_wparams *p, const char *op) {
  gpu_state *st = gpu_of(ctx);
  void (*fn)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const ggw_wparams) = ggw_wgrad_kernel<F16, OUT, GA>;
  static int ready[64];
  const int dev = st->device < 64 ? st->device : 0;
  if (!ready[dev]) {
    GPU_TRY_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, GGW_WSMEM),
                 "grouped_gemm_wgrad (gg_wgmma): cudaFuncSetAttribute");
    ready[dev] = 1;
  }
  const int64_t total = p->G * p->tilesP * p->tilesQ;
  const unsigned grid = (unsigned)(total < st->num_sms ? total : st->num_sms);
  fn<<<grid, GGW_THREADS, GGW_WSMEM, st->stream>>>(*ma, *mb, *mo, *p);
  GPU_TRY_CUDA(cudaGetLastError(), op);
  return TW_OK;
}

// rows: a row-gathered lhs [U, P] (lhs_rows, device [M]); NULL: lhs [M, P].
static tw_status ggw_wgrad(tw_ctx *ctx, const tw_operand *lhs, const int32_t *rows, tw_op lhs_op, const tw_operand *rhs,
                           tw_op rhs_op, const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate,
                           const char *op) {
  const char *why;
  if (!gg_wgmma_wgrad_takes(ctx, lhs, lhs_op, rhs, rhs_op, out, &why))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA, why);
  const int64_t M = rhs->data.shape[0], P = out->shape[1], N = out->shape[2];  // lhs [M, P] or gathered
  if (G == 0 || P == 0 || N == 0) return TW_OK;
  PFN_cuTensorMapEncodeTiled_v12000 enc = wgc_encode_fn();
  if (!enc) return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': no cuTensorMapEncodeTiled in the driver", op, GG_KERNEL_WGMMA);
  const int f16 = lhs->data.dtype == TW_F16;
  const CUtensorMapDataType dt = f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  // M = 0: every group is empty, no load is ever issued; the maps only need valid dims
  const cuuint64_t nrows = (cuuint64_t)(M > 0 ? M : 1);
  CUtensorMap ma, mb;
  memset(&ma, 0, sizeof ma);
  memset(&mb, 0, sizeof mb);
  const void *ptrs[2] = {lhs->data.data, rhs->data.data};
  const int64_t cols[2] = {P, N};
  CUtensorMap *maps[2] = {&ma, &mb};
  for (int i = rows ? 1 : 0; i < 2; ++i) {  // a gathered lhs has no map: the producer copies it
    cuuint64_t dims[2] = {(cuuint64_t)cols[i], nrows}, strides[1] = {(cuuint64_t)cols[i] * 2};
    cuuint32_t box[2] = {64, GGW_BK}, es[2] = {1, 1};
    CUresult r = enc(maps[i], dt, 2, (void *)ptrs[i], dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s': %s tensor map refused (CUresult %d)", op, GG_KERNEL_WGMMA,
                      i ? "rhs" : "lhs", (int)r);
  }
  ggw_wparams p;
  memset(&p, 0, sizeof p);
  p.offsets = offsets;
  p.out = out->data;
  p.P = P;
  p.N = N;
  p.G = G;
  p.tilesP = (P + GGW_BM - 1) / GGW_BM;
  p.tilesQ = (N + GGW_BN - 1) / GGW_BN;
  p.accumulate = accumulate;
  // Measurement knob, read on every call (the bench sets it for one row): 1 skips the tail
  // zeroing to time its cost; results are then wrong wherever a group's size is not a
  // multiple of 64.
  const char *nm = getenv("TWIN_GG_WGMMA_WGRAD_NOMASK");
  p.mask = !(nm && *nm == '1');
  // who zeroes a group's tail rows (gpu/NOTES-gemm.md, run w3): TWIN_GG_WGMMA_WGRAD_ZERO=
  // producer | consumer overrides the default, read on every call (the bench times both)
  const char *zv = getenv("TWIN_GG_WGMMA_WGRAD_ZERO");
  p.zero_prod = zv && !strcmp(zv, "producer") ? 1 : zv && !strcmp(zv, "consumer") ? 0 : GGW_ZERO_PROD_DEFAULT;
  // Per-group tensor maps (the default; TWIN_GG_WGMMA_WGRAD_MAPS=0, read on every call, keeps the
  // whole-tensor maps and the consumers' tail zeroing, as do the zeroing knobs ZERO and NOMASK
  // above; a gathered lhs takes the rhs maps only), and only while the 2G maps fit the context's
  // scratch (past it, about G >= 3,800 with the default scratch, the zeroing path: an overflow
  // buffer would be a stream-ordered allocation, which a captured graph must not hold)
  const char *mv = getenv("TWIN_GG_WGMMA_WGRAD_MAPS");
  const int zeroing_knob = (zv && *zv) || (nm && *nm == '1');
  const size_t maps_bytes = (size_t)(2 * G) * sizeof(CUtensorMap);
  gpu_state *gs = gpu_of(ctx);
  if (!zeroing_knob && !(mv && *mv == '0') && M > 0 &&
      gs->scratch_used + maps_bytes + 255 <= gs->scratch_bytes) {
    CUtensorMap *gm = NULL;
    TW_TRY(gpu_scratch(ctx, maps_bytes, (void **)&gm));
    const int threads = 128;
    const unsigned blocks = (unsigned)((2 * G + threads - 1) / threads);
    // a gathered lhs has no map: its slots copy the rhs map (never used)
    ggw_patch_maps_kernel<<<blocks, threads, 0, gs->stream>>>(
        rows ? mb : ma, mb, offsets, G, (const unsigned char *)(rows ? rhs->data.data : lhs->data.data),
        (const unsigned char *)rhs->data.data, rows ? N : P, N, gm);
    GPU_TRY_CUDA(cudaGetLastError(), op);
    p.gmaps = gm;
    __atomic_add_fetch(&ggw_wgrad_map_calls, 1, __ATOMIC_RELAXED);
  }
  if (rows) {  // the producer warps copy A (without maps the consumers zero the rhs tail rows)
    p.zero_prod = 0;
    p.rows = rows;
    p.a = (const unsigned char *)lhs->data.data;
    p.U = lhs->data.shape[0];
  }
  // out [G, K, N] as a 3-D map (so a box never crosses into group g+1), boxes of 64 rows x 128
  // bytes; TMA stores need a 16-byte aligned base (K, N multiples of 8 give 16-byte strides).
  // Measurement knob TWIN_GG_WGMMA_WGRAD_REGSTORE=1: the register epilogue instead.
  CUtensorMap mo;
  memset(&mo, 0, sizeof mo);
  const char *rs = getenv("TWIN_GG_WGMMA_WGRAD_REGSTORE");
  p.tma_out = !accumulate && ((uintptr_t)out->data & 15) == 0 && !(rs && *rs == '1');
  if (p.tma_out) {
    const int es = out->dtype == TW_F32 ? 4 : 2;
    const CUtensorMapDataType ot = out->dtype == TW_F32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : out->dtype == TW_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    cuuint64_t dims[3] = {(cuuint64_t)N, (cuuint64_t)P, (cuuint64_t)G};
    cuuint64_t strides[2] = {(cuuint64_t)N * es, (cuuint64_t)(P * N) * es};
    cuuint32_t box[3] = {(cuuint32_t)(128 / es), 64, 1}, es3[3] = {1, 1, 1};
    CUresult r = enc(&mo, ot, 3, out->data, dims, strides, box, es3, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) p.tma_out = 0;  // the register epilogue takes any out
  }
#define GGW_WOUT1(F, O) \
  return rows ? ggw_wgrad_launch_t<F, O, 1>(ctx, &ma, &mb, &mo, &p, op) : ggw_wgrad_launch_t<F, O>(ctx, &ma, &mb, &mo, &p, op);
#define GGW_WOUT(F)                    \
  switch (out->dtype) {                \
    case TW_F32: GGW_WOUT1(F, TW_F32)  \
    case TW_BF16: GGW_WOUT1(F, TW_BF16) \
    default: GGW_WOUT1(F, TW_F16)      \
  }
  if (f16) { GGW_WOUT(true) }
  GGW_WOUT(false)
#undef GGW_WOUT
#undef GGW_WOUT1
}

tw_status gg_wgmma_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                         const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate, const char *op) {
  return ggw_wgrad(ctx, lhs, NULL, lhs_op, rhs, rhs_op, offsets, G, out, accumulate, op);
}

tw_status gg_wgmma_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const int32_t *rows, const tw_operand *rhs,
                              const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate, const char *op) {
  return ggw_wgrad(ctx, lhs, rows, TW_OP_N, rhs, TW_OP_N, offsets, G, out, accumulate, op);
}
