// gpu/cast.cu — gpu_cast: dst = convert(src) elementwise, every dtype pair of tw_cast.
// Same path as the reference: int -> int exactly in int64; otherwise decode to f64, then encode (float targets round to f32 first,
// RNE; integer targets truncate toward zero and saturate, NaN -> 0). e2m1 is nibble-packed:
// one thread per destination byte, and an odd last element leaves its neighbour nibble as is.
#include "gpu/gpu.h"
#include "gpu/numerics.cuh"

// float <-> double with x86's NaN rule (the reference runs there): the payload moves along and
// the NaN is quieted. The GPU's cvt would write its canonical NaN instead.
__device__ static double f32_to_f64(float f) {
  uint32_t u = tw_f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return __longlong_as_double((long long)(((uint64_t)(u & 0x80000000u) << 32) | 0x7FF8000000000000ull |
                                            ((uint64_t)(u & 0x7FFFFFu) << 29)));
  return (double)f;
}
__device__ static float f64_to_f32(double v) {
  uint64_t u = (uint64_t)__double_as_longlong(v);
  if ((u & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull)
    return tw_u2f((uint32_t)((u >> 32) & 0x80000000u) | 0x7FC00000u | (uint32_t)((u >> 29) & 0x7FFFFFu));
  return (float)v;
}

__device__ static double load_f64(const void *p, int dt, int64_t i) {
  switch (dt) {
    case TW_F64: return ((const double *)p)[i];
    case TW_F32: return f32_to_f64(((const float *)p)[i]);
    case TW_BF16: return f32_to_f64(tw_bf16_to_f32_d(((const uint16_t *)p)[i]));
    case TW_F16: return f32_to_f64(tw_f16_to_f32_d(((const uint16_t *)p)[i]));
    case TW_E4M3: return f32_to_f64(tw_e4m3_to_f32_d(((const uint8_t *)p)[i]));
    case TW_E5M2: return f32_to_f64(tw_e5m2_to_f32_d(((const uint8_t *)p)[i]));
    case TW_E8M0: return f32_to_f64(tw_e8m0_to_f32_d(((const uint8_t *)p)[i]));
    case TW_E2M1: return tw_e2m1_to_f32_d((uint8_t)(((const uint8_t *)p)[i >> 1] >> ((i & 1) * 4)));
    case TW_I32: return ((const int32_t *)p)[i];
    case TW_I64: return (double)((const int64_t *)p)[i];
    case TW_U8: return ((const uint8_t *)p)[i];
    default: return ((const uint16_t *)p)[i];  // TW_U16
  }
}

// Truncate toward zero, saturate to [lo, hi], NaN -> 0.
__device__ static double to_int_range(double v, double lo, double hi) {
  if (v != v) return 0.0;
  v = trunc(v);
  return v < lo ? lo : v > hi ? hi : v;
}

__device__ static void store_f64(void *p, int dt, int64_t i, double v, int sat) {
  float f = f64_to_f32(v);  // RNE to f32 first for every float target
  switch (dt) {
    case TW_F64: ((double *)p)[i] = v; break;
    case TW_F32: ((float *)p)[i] = f; break;
    case TW_BF16: ((uint16_t *)p)[i] = tw_f32_to_bf16_d(f); break;
    case TW_F16: ((uint16_t *)p)[i] = tw_f32_to_f16_d(f); break;
    case TW_E4M3: ((uint8_t *)p)[i] = tw_f32_to_e4m3_d(f, sat); break;
    case TW_E5M2: ((uint8_t *)p)[i] = tw_f32_to_e5m2_d(f, sat); break;
    case TW_I32: ((int32_t *)p)[i] = (int32_t)to_int_range(v, -2147483648.0, 2147483647.0); break;
    case TW_I64: {
      // 2^63 is not an int64: saturate before converting
      int64_t r;
      if (v != v) r = 0;
      else if (v >= 9223372036854775808.0) r = INT64_MAX;
      else if (v < -9223372036854775808.0) r = INT64_MIN;
      else r = (int64_t)trunc(v);
      ((int64_t *)p)[i] = r;
      break;
    }
    case TW_U8: ((uint8_t *)p)[i] = (uint8_t)to_int_range(v, 0.0, 255.0); break;
    default: ((uint16_t *)p)[i] = (uint16_t)to_int_range(v, 0.0, 65535.0); break;  // TW_U16
  }
}

__device__ static bool is_int(int dt) { return dt == TW_I32 || dt == TW_I64 || dt == TW_U8 || dt == TW_U16; }

__device__ static int64_t load_int(const void *p, int dt, int64_t i) {
  switch (dt) {
    case TW_I32: return ((const int32_t *)p)[i];
    case TW_I64: return ((const int64_t *)p)[i];
    case TW_U8: return ((const uint8_t *)p)[i];
    default: return ((const uint16_t *)p)[i];
  }
}

// int -> int stays in int64 (a double would lose i64 values past 2^53), clamped to dst's range.
__device__ static void store_int(void *p, int dt, int64_t i, int64_t v) {
  switch (dt) {
    case TW_I32: ((int32_t *)p)[i] = (int32_t)(v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v); break;
    case TW_I64: ((int64_t *)p)[i] = v; break;
    case TW_U8: ((uint8_t *)p)[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v); break;
    default: ((uint16_t *)p)[i] = (uint16_t)(v < 0 ? 0 : v > 65535 ? 65535 : v); break;
  }
}

__global__ void cast_kernel(void *dst, int ddt, const void *src, int sdt, int64_t n, int sat) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  if (is_int(ddt) && is_int(sdt)) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
      store_int(dst, ddt, i, load_int(src, sdt, i));
    return;
  }
  if (ddt == TW_E2M1) {
    uint8_t *d = (uint8_t *)dst;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < (n + 1) / 2; b += stride) {
      uint8_t lo = tw_f32_to_e2m1_d(f64_to_f32(load_f64(src, sdt, 2 * b)));
      uint8_t hi = 2 * b + 1 < n ? tw_f32_to_e2m1_d(f64_to_f32(load_f64(src, sdt, 2 * b + 1))) : (uint8_t)(d[b] >> 4);
      d[b] = (uint8_t)(lo | (hi << 4));
    }
    return;
  }
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    store_f64(dst, ddt, i, load_f64(src, sdt, i), sat);
}

extern "C" tw_status gpu_cast(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src, int saturate) {
  gpu_state *st = gpu_of(ctx);
  const int64_t n = tw_tensor_numel(src);
  if (n == 0) return TW_OK;
  int64_t work = dst->dtype == TW_E2M1 ? (n + 1) / 2 : n;
  int64_t blocks = (work + 255) / 256;
  if (blocks > 16 * (int64_t)st->num_sms) blocks = 16 * (int64_t)st->num_sms;
  cast_kernel<<<(unsigned)blocks, 256, 0, st->stream>>>(dst->data, dst->dtype, src->data, src->dtype, n, saturate);
  GPU_TRY_CUDA(cudaGetLastError(), "cast: launch");
  return TW_OK;
}
