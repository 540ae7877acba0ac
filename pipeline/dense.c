/* The dense stage body y = x + gelu(x W1) W2 and the elementwise ops it needs.
 * GEMMs go through tw_gemm (either backend); gelu, its derivative and y += x run here on the
 * ref backend (host loops, double math rounded once to f32) and in gpu/pipeline_body.cu on
 * the gpu backend (linked weakly: a CPU-only binary has none and says so). */
#include <math.h>
#include <string.h>

#include "twin/tw_gemm.h"
#include "twin/tw_pipeline.h"

/* gpu/pipeline_body.cu */
extern tw_status gpu_pipeline_gelu(tw_ctx *ctx, const float *h, float *a, int64_t n) __attribute__((weak));
extern tw_status gpu_pipeline_gelu_bwd(tw_ctx *ctx, const float *h, const float *da, float *dh,
                                       int64_t n) __attribute__((weak));
extern tw_status gpu_pipeline_add(tw_ctx *ctx, float *y, const float *x, int64_t n) __attribute__((weak));

#define GELU_C 0.7978845608028654 /* sqrt(2/pi) */

static double gelu(double h) { return 0.5 * h * (1.0 + tanh(GELU_C * (h + 0.044715 * h * h * h))); }
static double gelu_grad(double h) {
  double u = GELU_C * (h + 0.044715 * h * h * h), th = tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * h * (1.0 - th * th) * GELU_C * (1.0 + 3 * 0.044715 * h * h);
}

static tw_status ew_args(const char *op, tw_ctx *ctx, const void *a, const void *b, int64_t n) {
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  if (n < 0) return tw_error(TW_ERR_INVALID_ARG, "%s: n = %lld < 0", op, (long long)n);
  if (n > 0 && (!a || !b)) return tw_error(TW_ERR_NULL, "%s: NULL buffer with n = %lld", op, (long long)n);
  return TW_OK;
}

static tw_status no_gpu(const char *op) {
  return tw_error(TW_ERR_UNSUPPORTED, "%s: backend 'gpu' of this binary lacks gpu/pipeline_body.cu", op);
}

tw_status tw_pipeline_gelu(tw_ctx *ctx, const float *h, float *a, int64_t n) {
  TW_TRY(ew_args("pipeline_gelu", ctx, h, a, n));
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_pipeline_gelu ? gpu_pipeline_gelu(ctx, h, a, n) : no_gpu("pipeline_gelu");
  for (int64_t i = 0; i < n; i++) a[i] = (float)gelu(h[i]);
  return TW_OK;
}

tw_status tw_pipeline_gelu_bwd(tw_ctx *ctx, const float *h, const float *da, float *dh, int64_t n) {
  TW_TRY(ew_args("pipeline_gelu_bwd", ctx, h, da, n));
  if (n > 0 && !dh) return tw_error(TW_ERR_NULL, "pipeline_gelu_bwd: dh is NULL");
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_pipeline_gelu_bwd ? gpu_pipeline_gelu_bwd(ctx, h, da, dh, n) : no_gpu("pipeline_gelu_bwd");
  for (int64_t i = 0; i < n; i++) dh[i] = (float)((double)da[i] * gelu_grad(h[i]));
  return TW_OK;
}

tw_status tw_pipeline_add(tw_ctx *ctx, float *y, const float *x, int64_t n) {
  TW_TRY(ew_args("pipeline_add", ctx, y, x, n));
  if (tw_ctx_backend(ctx) == TW_BACKEND_GPU)
    return gpu_pipeline_add ? gpu_pipeline_add(ctx, y, x, n) : no_gpu("pipeline_add");
  for (int64_t i = 0; i < n; i++) y[i] += x[i];
  return TW_OK;
}

/* ---- the body ------------------------------------------------------------------------ */
typedef struct {
  int64_t E, H;
} dense_dims;

static size_t dense_scratch(const tw_pipeline_body *b, int64_t rows) {
  return 2 * (size_t)rows * (size_t)b->param_cols[0] * sizeof(float); /* h, a: [rows, H] */
}

static tw_status mm(tw_ctx *ctx, const float *a, int64_t ar, int64_t ac, tw_op oa, const float *b, int64_t br,
                    int64_t bc, tw_op ob, float *out, int64_t m, int64_t n, int acc) {
  tw_mem mem = tw_ctx_mem(ctx);
  tw_tensor ta = tw_tensor_2d((void *)a, TW_F32, ar, ac, mem), tb = tw_tensor_2d((void *)b, TW_F32, br, bc, mem);
  tw_tensor to = tw_tensor_2d(out, TW_F32, m, n, mem);
  tw_operand pa = tw_operand_plain(&ta), pb = tw_operand_plain(&tb);
  return tw_gemm(ctx, &pa, oa, &pb, ob, &to, acc);
}

static tw_status copy_f32(tw_ctx *ctx, float *dst, const float *src, int64_t n) {
  tw_mem mem = tw_ctx_mem(ctx);
  tw_tensor d = tw_tensor_1d(dst, TW_F32, n, mem), s = tw_tensor_1d((void *)src, TW_F32, n, mem);
  return tw_tensor_copy(ctx, &d, &s);
}

/* y = x + gelu(x W1) W2 */
static tw_status dense_forward(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                               float *y, int64_t n, void *scratch) {
  int64_t E = b->param_rows[0], H = b->param_cols[0];
  float *h = (float *)scratch, *a = h + n * H;
  TW_TRY(mm(ctx, x, n, E, TW_OP_N, w->p[0], E, H, TW_OP_N, h, n, H, 0));
  TW_TRY(tw_pipeline_gelu(ctx, h, a, n * H));
  TW_TRY(copy_f32(ctx, y, x, n * E));
  return mm(ctx, a, n, H, TW_OP_N, w->p[1], H, E, TW_OP_N, y, n, E, 1);
}

/* h = x W1, a = gelu(h): dW2 += a^T dy; da = dy W2^T; dh = da gelu'(h); dW1 += x^T dh;
 * dx = dy + dh W1^T. */
static tw_status dense_vjp(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                           const float *dy, float *dx, tw_pipeline_params *dw, int64_t n, void *scratch) {
  int64_t E = b->param_rows[0], H = b->param_cols[0];
  float *h = (float *)scratch, *a = h + n * H;
  TW_TRY(mm(ctx, x, n, E, TW_OP_N, w->p[0], E, H, TW_OP_N, h, n, H, 0));
  TW_TRY(tw_pipeline_gelu(ctx, h, a, n * H));
  TW_TRY(mm(ctx, a, n, H, TW_OP_T, dy, n, E, TW_OP_N, dw->p[1], H, E, 1));
  TW_TRY(mm(ctx, dy, n, E, TW_OP_N, w->p[1], H, E, TW_OP_T, a, n, H, 0)); /* a <- da */
  TW_TRY(tw_pipeline_gelu_bwd(ctx, h, a, a, n * H));                      /* a <- dh */
  TW_TRY(mm(ctx, x, n, E, TW_OP_T, a, n, H, TW_OP_N, dw->p[0], E, H, 1));
  TW_TRY(copy_f32(ctx, dx, dy, n * E));
  return mm(ctx, a, n, H, TW_OP_N, w->p[0], E, H, TW_OP_T, dx, n, E, 1);
}

tw_status tw_pipeline_dense_body(int64_t E, int64_t H, tw_pipeline_body *out) {
  if (!out) return tw_error(TW_ERR_NULL, "pipeline_dense_body: out is NULL");
  if (E < 1 || H < 1)
    return tw_error(TW_ERR_INVALID_ARG, "pipeline_dense_body: E = %lld and H = %lld must be >= 1", (long long)E,
                    (long long)H);
  memset(out, 0, sizeof *out);
  out->name = "dense";
  out->nparams = 2;
  out->param_rows[0] = E; out->param_cols[0] = H; /* W1 */
  out->param_rows[1] = H; out->param_cols[1] = E; /* W2 */
  out->width = E;
  out->scratch_bytes = dense_scratch;
  out->forward = dense_forward;
  out->vjp = dense_vjp;
  return TW_OK;
}
