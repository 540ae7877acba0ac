// tools/probes/nvlink_store_probe.cu — how fast SM threads store rows into a peer GPU's memory,
// next to the copy engine and a local gather, on 2 GPUs with peer access (gpu/NOTES-routing.md,
// session 16: what ep_nccl_lsa's pushes can reach). Not part of the Bazel build: a standalone
// measuring aid.
//   nvcc -O3 -arch=sm_90a -o nvlink_store_probe tools/probes/nvlink_store_probe.cu
//   ./nvlink_store_probe [rows, default 65536]        one direction, then both at once
//   GATHER=1 ./nvlink_store_probe [rows]              local scatter copy and gathers only
// Rows are 14336 bytes (a bf16 row of H 7168); GB/s counts the rows moved once. Kernels: a warp
// per row with 4 or 8 16-byte vectors in flight per lane, plain or .L1::no_allocate; TMA bulk
// copies through shared memory (cp.async.bulk, 7168-byte chunks, two per warp in flight); the
// copy engine (cudaMemcpyPeerAsync); scattered (a random permutation) or contiguous rows.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

static const size_t RB = 14336;  // one bf16 row of H 7168

__device__ __forceinline__ uint4 ld_na(const uint4 *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_na(uint4 *p, uint4 v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// gather: dst row r (sequential) <- src row perm[r] % (rows / 4) (each source row read 4 times)
template <int U>
__global__ void gather_rows(const unsigned char *src, unsigned char *dst, const int *perm, int rows) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int lane = threadIdx.x & 31;
  const size_t nv = RB / 16;
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const uint4 *s = (const uint4 *)(src + (size_t)(perm[r] % (rows / 4)) * RB);
    uint4 *o = (uint4 *)(dst + (size_t)r * RB);
    size_t i = lane;
    for (; i + 32 * (U - 1) < nv; i += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = s[i + 32 * u];
#pragma unroll
      for (int u = 0; u < U; ++u) o[i + 32 * u] = v[u];
    }
    for (; i < nv; i += 32) o[i] = s[i];
  }
}

template <int U, int NA>
__global__ void push_rows(const unsigned char *src, unsigned char *dst, const int *perm, int rows) {
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int lane = threadIdx.x & 31;
  const size_t nv = RB / 16;
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const uint4 *s = (const uint4 *)(src + (size_t)r * RB);
    uint4 *o = (uint4 *)(dst + (size_t)perm[r] * RB);
    size_t i = lane;
    for (; i + 32 * (U - 1) < nv; i += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = NA ? ld_na(s + i + 32 * u) : s[i + 32 * u];
#pragma unroll
      for (int u = 0; u < U; ++u) { if (NA) st_na(o + i + 32 * u, v[u]); else o[i + 32 * u] = v[u]; }
    }
    for (; i < nv; i += 32) o[i] = s[i];
  }
}

// TMA bulk: each warp moves its rows in CH-byte chunks through a 2-deep shared ring: bulk load
// global -> shared (mbarrier), bulk store shared -> peer global.
#define CH 7168
__global__ void push_tma(const unsigned char *src, unsigned char *dst, const int *perm, int rows) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) uint64_t bar[8][2];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  unsigned char *buf = sm + (size_t)w * 2 * CH;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  if (lane == 0) {
    for (int b = 0; b < 2; ++b) {
      uint32_t a = (uint32_t)__cvta_generic_to_shared(&bar[w][b]);
      asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(a));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncwarp();
  uint32_t phase[2] = {0, 0};
  int n = 0;
  if (lane == 0)
    for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps)
      for (int c = 0; c < (int)(RB / CH); ++c, ++n) {
        const int b = n & 1;
        unsigned char *sb = buf + b * CH;
        uint32_t sa = (uint32_t)__cvta_generic_to_shared(sb);
        uint32_t ba = (uint32_t)__cvta_generic_to_shared(&bar[w][b]);
        // the buffer's previous store must have read it
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(ba), "r"(CH));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(sa), "l"(src + (size_t)r * RB + c * CH), "r"(CH), "r"(ba) : "memory");
        uint32_t done = 0;
        while (!done)
          asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                       : "=r"(done) : "r"(ba), "r"(phase[b]));
        phase[b] ^= 1;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + (size_t)perm[r] * RB + c * CH), "r"(sa), "r"(CH) : "memory");
        asm volatile("cp.async.bulk.commit_group;");
      }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Side { unsigned char *src, *dst; int *perm; cudaStream_t s; cudaEvent_t a, b; };

int main(int argc, char **argv) {
  int rows = argc > 1 ? atoi(argv[1]) : 65536;
  int iters = 10;
  int n; CK(cudaGetDeviceCount(&n));
  if (n < 2) { printf("need 2 GPUs\n"); return 0; }
  Side sd[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaMalloc(&sd[g].src, rows * RB));
    CK(cudaMalloc(&sd[g].dst, rows * RB));
    CK(cudaMalloc(&sd[g].perm, rows * 4));
    CK(cudaMemset(sd[g].src, 1 + g, rows * RB));
    std::vector<int> p(rows);
    for (int i = 0; i < rows; ++i) p[i] = i;
    srand(7 + g);
    for (int i = rows - 1; i > 0; --i) std::swap(p[i], p[rand() % (i + 1)]);
    CK(cudaMemcpy(sd[g].perm, p.data(), rows * 4, cudaMemcpyHostToDevice));
    CK(cudaStreamCreateWithFlags(&sd[g].s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&sd[g].a)); CK(cudaEventCreate(&sd[g].b));
    CK(cudaFuncSetAttribute(push_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 2 * CH));
  }
  int *ident[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    std::vector<int> p(rows); for (int i = 0; i < rows; ++i) p[i] = i;
    CK(cudaMalloc(&ident[g], rows * 4));
    CK(cudaMemcpy(ident[g], p.data(), rows * 4, cudaMemcpyHostToDevice));
  }
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double bytes = (double)rows * RB;
  // kind: 0 v4 u4, 1 na u4, 2 v4 u8, 3 na u8, 4 tma, 5 copy engine, 6 local v4 copy (HBM)
  const char *names[] = {"v4 u4", "na u4", "v4 u8", "na u8", "tma 8w", "copy engine", "local v4 u4", "gather u4", "gather u8"};
  auto launch = [&](int g, int kind, int blocks, int scattered) {
    Side &S = sd[g];
    unsigned char *dst = kind == 6 ? sd[g].dst : sd[1 - g].dst;
    const int *perm = scattered ? S.perm : ident[g];
    switch (kind) {
      case 0: push_rows<4, 0><<<blocks, 256, 0, S.s>>>(S.src, dst, perm, rows); break;
      case 1: push_rows<4, 1><<<blocks, 256, 0, S.s>>>(S.src, dst, perm, rows); break;
      case 2: push_rows<8, 0><<<blocks, 256, 0, S.s>>>(S.src, dst, perm, rows); break;
      case 3: push_rows<8, 1><<<blocks, 256, 0, S.s>>>(S.src, dst, perm, rows); break;
      case 4: push_tma<<<blocks, 256, 8 * 2 * CH, S.s>>>(S.src, dst, perm, rows); break;
      case 5: CK(cudaMemcpyPeerAsync(sd[1 - g].dst, 1 - g, S.src, g, rows * RB, S.s)); break;
      case 6: push_rows<4, 0><<<blocks, 256, 0, S.s>>>(S.src, dst, perm, rows); break;
      case 7: gather_rows<4><<<blocks, 256, 0, S.s>>>(S.src, sd[g].dst, S.perm, rows); break;
      case 8: gather_rows<8><<<blocks, 256, 0, S.s>>>(S.src, sd[g].dst, S.perm, rows); break;
    }
  };
  auto run = [&](int kind, int blocks, int scattered, int bidir) {
    std::vector<float> t;
    for (int it = 0; it < iters + 2; ++it) {
      for (int g = 0; g < 1 + bidir; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); }
      for (int g = 0; g < 1 + bidir; ++g) { CK(cudaSetDevice(g)); CK(cudaEventRecord(sd[g].a, sd[g].s)); launch(g, kind, blocks, scattered); CK(cudaEventRecord(sd[g].b, sd[g].s)); }
      float worst = 0;
      for (int g = 0; g < 1 + bidir; ++g) { CK(cudaSetDevice(g)); CK(cudaEventSynchronize(sd[g].b)); float ms; CK(cudaEventElapsedTime(&ms, sd[g].a, sd[g].b)); worst = std::max(worst, ms); }
      CK(cudaGetLastError());
      if (it >= 2) t.push_back(worst);
    }
    std::sort(t.begin(), t.end());
    float med = t[t.size() / 2];
    printf("%-12s blocks %5d %-9s %-5s %8.3f ms %7.1f GB/s\n", names[kind], blocks, scattered ? "scattered" : "contig",
           bidir ? "bidir" : "uni", med, bytes / med / 1e6);
    fflush(stdout);
  };
  printf("rows %d, %.3f GB per direction, %d SMs\n", rows, bytes / 1e9, sms);
  if (getenv("GATHER")) {
    int gg[] = {132, 264, 528, 1056};
    for (int gi = 0; gi < 4; ++gi) { run(6, gg[gi], 1, 0); run(7, gg[gi], 1, 0); run(8, gg[gi], 1, 0); }
    return 0;
  }
  for (int bidir = 0; bidir < 2; ++bidir) {
    run(5, 0, 0, bidir);
    run(6, sms * 8, 1, bidir);
    int grids[] = {16, 32, 66, 132, 264, 528, 1056};
    for (int kind = 0; kind < 4; ++kind)
      for (int gi = 0; gi < 7; ++gi) {
        if (kind > 0 && grids[gi] < 66) continue;
        run(kind, grids[gi], 1, bidir);
      }
    run(0, sms * 8, 0, bidir);
    int tg[] = {16, 32, 66, 132, 264};
    for (int gi = 0; gi < 5; ++gi) run(4, tg[gi], 1, bidir);
  }
  return 0;
}
