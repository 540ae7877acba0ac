/* The device facts of `twin port --backend gpu` (tools/port.h): GPU 0's name, compute
 * capability, SMs, memory, clocks, and the driver, CUDA runtime, cuBLASLt and NCCL versions,
 * each read from its library's own version call. Named bench_gpu_* so that only //tools:twin
 * (the build with the gpu backend) compiles it; cmd_port.c references it weakly. */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>

#include "tools/port.h"

/* "13.0" from 13000 */
static void version_str(int v, char *buf, size_t n) { snprintf(buf, n, "%d.%d", v / 1000, (v % 1000) / 10); }

int tw_port_gpu_facts(port_report *r) {
  int dev = 0, v = 0;
  struct cudaDeviceProp p;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) return -1;
  char buf[32];
  port_fact_add(r, "device", "%s", p.name);
  port_fact_add(r, "compute capability", "sm_%d%d", p.major, p.minor);
  port_fact_add(r, "SMs", "%d", p.multiProcessorCount);
  port_fact_add(r, "memory", "%.1f GiB", (double)p.totalGlobalMem / (1 << 30));
  port_fact_add(r, "L2", "%.1f MiB", (double)p.l2CacheSize / (1 << 20));
  port_fact_add(r, "shared memory per block (opt-in)", "%zu KiB", p.sharedMemPerBlockOptin / 1024);
  if (cudaDeviceGetAttribute(&v, cudaDevAttrClockRate, dev) == cudaSuccess) port_fact_add(r, "SM clock (max)", "%d MHz", v / 1000);
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMemoryClockRate, dev) == cudaSuccess) {
    int bus = 0;
    cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, dev);
    /* DDR: two transfers per clock */
    port_fact_add(r, "memory clock, bus", "%d MHz, %d bit (%.0f GB/s theoretical)", v / 1000, bus, 2.0 * v * 1e3 * bus / 8 / 1e9);
  }
  if (cudaDriverGetVersion(&v) == cudaSuccess) version_str(v, buf, sizeof buf), port_fact_add(r, "driver (CUDA API)", "%s", buf);
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) version_str(v, buf, sizeof buf), port_fact_add(r, "CUDA runtime", "%s", buf);
  size_t lt = cublasLtGetVersion();
  port_fact_add(r, "cuBLASLt", "%zu.%zu.%zu", lt / 10000, (lt / 100) % 100, lt % 100);
  if (ncclGetVersion(&v) == ncclSuccess) port_fact_add(r, "NCCL", "%d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
  return 0;
}
