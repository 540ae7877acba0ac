// gpu/probe.cu — the smallest CUDA translation unit, proving the nvcc rule builds and links:
// counts visible devices. The real kernels live beside it.
#include <cuda_runtime.h>

#include "twin/tw_base.h"

extern "C" int tw_gpu_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}
