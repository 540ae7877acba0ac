/* The MoE block's elementwise steps (moe/elementwise.h): host loops for the ref backend, the
 * gpu kernels through weak symbols (a CPU-only binary has none and says so). */
#include "moe/elementwise.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

/* gpu/moe_elementwise.cu (same arguments, device pointers) */
extern tw_status gpu_moe_bias_out(tw_ctx *ctx, const float *y, const tw_tensor *gs, const float *bias, int64_t C,
                                  void *out, tw_dtype out_dtype) __attribute__((weak));
extern tw_status gpu_moe_act_fwd(tw_ctx *ctx, tw_moe_act act, const float *h, const tw_tensor *gs, const float *w,
                                 int64_t F, void *a, tw_dtype a_dtype) __attribute__((weak));
extern tw_status gpu_moe_act_bwd(tw_ctx *ctx, tw_moe_act act, const float *h, const float *d_a, const tw_tensor *gs,
                                 const float *w, int64_t F, void *d_h, tw_dtype dh_dtype, float *d_w)
    __attribute__((weak));
extern tw_status gpu_moe_bias_grad(tw_ctx *ctx, const void *dy, tw_dtype dy_dtype, const tw_tensor *gs, int64_t C,
                                   float *db) __attribute__((weak));
extern tw_status gpu_moe_add_f32(tw_ctx *ctx, float *y, const float *x, int64_t n) __attribute__((weak));
extern tw_status gpu_moe_scales_from_amax(tw_ctx *ctx, const float *amax, int64_t G, float fp8_max, float *scale)
    __attribute__((weak));
extern tw_status gpu_moe_swap_outer(tw_ctx *ctx, const void *src, int64_t P, int64_t A, int64_t B, size_t es, void *dst)
    __attribute__((weak));

static tw_status no_gpu(const char *op) {
  return tw_error(TW_ERR_UNSUPPORTED, "moe %s: backend 'gpu' of this binary lacks gpu/moe_elementwise.cu", op);
}

#define GELU_C 0.7978845608028654 /* sqrt(2/pi) */

static double act_value(tw_moe_act act, double g) {
  switch (act) {
    case TW_MOE_SWIGLU: return g / (1.0 + exp(-g));
    case TW_MOE_GEGLU: return 0.5 * g * (1.0 + tanh(GELU_C * (g + 0.044715 * g * g * g)));
    default: return g;
  }
}

static double act_grad(tw_moe_act act, double g) {
  switch (act) {
    case TW_MOE_SWIGLU: {
      double s = 1.0 / (1.0 + exp(-g));
      return s * (1.0 + g * (1.0 - s));
    }
    case TW_MOE_GEGLU: {
      double u = GELU_C * (g + 0.044715 * g * g * g), th = tanh(u);
      return 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * GELU_C * (1.0 + 3 * 0.044715 * g * g);
    }
    default: return 1.0;
  }
}

/* Rows covered by the groups (host gs). */
static int64_t rows_of(const tw_tensor *gs) {
  int64_t n = 0, G = tw_tensor_numel(gs);
  for (int64_t g = 0; g < G; g++) n += ((const int32_t *)gs->data)[g];
  return n;
}

/* double -> f32 -> (bf16): the block's one rounding to f32, then the recipe's to bf16. */
static void store(void *p, tw_dtype t, int64_t i, double v) {
  float f = (float)v;
  if (t == TW_BF16) ((uint16_t *)p)[i] = tw_f32_to_bf16(f);
  else ((float *)p)[i] = f;
}

static double load(const void *p, tw_dtype t, int64_t i) {
  return t == TW_BF16 ? (double)tw_bf16_to_f32(((const uint16_t *)p)[i]) : (double)((const float *)p)[i];
}

tw_status tw_moe_bias_out(tw_ctx *ctx, const float *y, const tw_tensor *gs, const float *bias, int64_t C, void *out,
                          tw_dtype out_dtype) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_moe_bias_out ? gpu_moe_bias_out(ctx, y, gs, bias, C, out, out_dtype) : no_gpu("bias_out");
  int64_t G = tw_tensor_numel(gs), r = 0;
  for (int64_t g = 0; g < G; g++)
    for (int32_t i = 0; i < ((const int32_t *)gs->data)[g]; i++, r++)
      for (int64_t c = 0; c < C; c++)
        store(out, out_dtype, r * C + c, (double)y[r * C + c] + (bias ? (double)bias[g * C + c] : 0.0));
  return TW_OK;
}

tw_status tw_moe_act_fwd(tw_ctx *ctx, tw_moe_act act, const float *h, const tw_tensor *gs, const float *w, int64_t F,
                         void *a, tw_dtype a_dtype) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_moe_act_fwd ? gpu_moe_act_fwd(ctx, act, h, gs, w, F, a, a_dtype) : no_gpu("act_fwd");
  int64_t rows = rows_of(gs);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t f = 0; f < F; f++) {
      double v = act_value(act, h[r * 2 * F + f]) * (double)h[r * 2 * F + F + f];
      if (w) v *= (double)w[r];
      store(a, a_dtype, r * F + f, v);
    }
  return TW_OK;
}

tw_status tw_moe_act_bwd(tw_ctx *ctx, tw_moe_act act, const float *h, const float *d_a, const tw_tensor *gs,
                         const float *w, int64_t F, void *d_h, tw_dtype dh_dtype, float *d_w) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_moe_act_bwd ? gpu_moe_act_bwd(ctx, act, h, d_a, gs, w, F, d_h, dh_dtype, d_w) : no_gpu("act_bwd");
  int64_t rows = rows_of(gs);
  for (int64_t r = 0; r < rows; r++) {
    double dw = 0, scale = w ? (double)w[r] : 1.0;
    for (int64_t f = 0; f < F; f++) {
      double g = h[r * 2 * F + f], up = h[r * 2 * F + F + f], da = d_a[r * F + f];
      double av = act_value(act, g);
      dw += da * av * up;
      double du = da * scale;
      store(d_h, dh_dtype, r * 2 * F + f, du * act_grad(act, g) * up);
      store(d_h, dh_dtype, r * 2 * F + F + f, du * av);
    }
    if (d_w) d_w[r] = (float)dw;
  }
  return TW_OK;
}

tw_status tw_moe_bias_grad(tw_ctx *ctx, const void *dy, tw_dtype dy_dtype, const tw_tensor *gs, int64_t C,
                           float *db) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_moe_bias_grad ? gpu_moe_bias_grad(ctx, dy, dy_dtype, gs, C, db) : no_gpu("bias_grad");
  int64_t G = tw_tensor_numel(gs), r0 = 0;
  for (int64_t g = 0; g < G; g++) {
    int32_t m = ((const int32_t *)gs->data)[g];
    for (int64_t c = 0; c < C; c++) {
      double s = 0;
      for (int32_t i = 0; i < m; i++) s += load(dy, dy_dtype, (r0 + i) * C + c);
      db[g * C + c] = (float)s;
    }
    r0 += m;
  }
  return TW_OK;
}

tw_status tw_moe_add_f32(tw_ctx *ctx, float *y, const float *x, int64_t n) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU) return gpu_moe_add_f32 ? gpu_moe_add_f32(ctx, y, x, n) : no_gpu("add");
  for (int64_t i = 0; i < n; i++) y[i] += x[i];
  return TW_OK;
}

tw_status tw_moe_scales_from_amax(tw_ctx *ctx, const float *amax, int64_t G, float fp8_max, float *scale) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_moe_scales_from_amax ? gpu_moe_scales_from_amax(ctx, amax, G, fp8_max, scale) : no_gpu("scales_from_amax");
  for (int64_t g = 0; g < G; g++) scale[g] = tw_scale_from_amax(amax[g], fp8_max, 0);
  return TW_OK;
}

tw_status tw_moe_swap_outer(tw_ctx *ctx, const void *src, int64_t P, int64_t A, int64_t B, size_t es, void *dst) {
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_moe_swap_outer ? gpu_moe_swap_outer(ctx, src, P, A, B, es, dst) : no_gpu("swap_outer");
  size_t row = (size_t)B * es;
  for (int64_t p = 0; p < P; p++)
    for (int64_t a = 0; a < A; a++)
      memcpy((char *)dst + ((size_t)a * (size_t)P + (size_t)p) * row, (const char *)src + ((size_t)p * (size_t)A + (size_t)a) * row, row);
  return TW_OK;
}
