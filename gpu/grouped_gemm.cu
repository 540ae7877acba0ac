// gpu/grouped_gemm.cu — grouped GEMM on the GPU (twin of ref_grouped_gemm /
// ref_grouped_gemm_wgrad). Group sizes stay in device memory.
//
// Versions (tw_ctx_kernel() may force one by name):
//   gg_wgmma    (auto on sm_90 for the plain bf16/f16 forward it takes: K, and N for rhs op N,
//               multiples of 8, 16-byte aligned bases): gpu/grouped_gemm_wgmma.cu, Hopper wgmma
//               fed by TMA, 128x256x64 tiles, warp-specialized, persistent, pairs of CTAs
//               sharing the rhs tile by TMA multicast when groups average >= 256 rows. Also the
//               wgrad with lhs [M, K], rhs [M, N] (ops N; K, N multiples of 8), auto likewise
//               (H200: 0.91-1.44x its forward's rate, 1.12-1.41x torch's wgrad, 2.6-8.7x
//               gg_mma_wide); what it declines runs gg_mma_wide (forced: TW_ERR_UNSUPPORTED
//               naming it).
//               Measured ~2.5x gg_mma_wide on an H100, 0.94-1.10x torch._grouped_mm (NOTES-gemm.md).
//   gg_wgmma_fp8 (auto on sm_90 for the fp8 forward it takes: per-tensor, 1x128, 128x128 or
//               MXFP8 scales, rhs [G, N, K], K % 16 == 0; MXFP8 also with rhs the colwise data
//               of its [G*K, N] source, op N, through a transposing pad pass: the MoE
//               fp8_mxfp8 forward GEMMs): gpu/grouped_gemm_wgmma_fp8.cu, fp8
//               wgmma promoted into f32 every 128 along K, every 32 for MXFP8 (tw_gemm.h's
//               "gg_wgmma_fp8" model, not exact f32: force gg_mma_wide / gg_mma for that). H200: 1.07-1.26x torch rowwise
//               per-tensor on four of five shapes (0.98x at K = 2048), 1x128 0.63-0.83x.
//               Also the fp8 wgrad from the per-group transposed colwise copies (ops T), auto
//               for current / 1x128 / 128x128 scales (H100: 1x128 3-5x gg_mma, MoE fp8 blocks
//               2.3-4.3x faster end to end; 0.15-0.27x its forward's rate), and the MXFP8 wgrad
//               from the colwise [M, K] / [M, N] data (ops N), auto too.
//   gg_mma_wide (auto for bf16, f16 and fp8 operands where the device grants its shared
//               memory): the tensor-core kernel of gpu/grouped_gemm_kernel.cu with 128x256x64
//               tiles, 3 stages, a hoisted loader for interior tiles; bf16, f16, and fp8 with
//               per-tensor scales (decoded exactly to f16); fp8 with block scales runs the
//               128x128 tile. Needs up to 162 KiB of shared memory (sm_80, sm_90); forced on a
//               device with less it is TW_ERR_UNSUPPORTED naming it. Measured 1.2-1.8x gg_mma
//               on an H200 (bf16 197-282 vs 155-166 TFLOP/s, fp8 169-189 vs 100-105;
//               gpu/NOTES-gemm.md), hence the default.
//   gg_mma      (auto where gg_mma_wide does not fit, e.g. sm_86/sm_89 with 99 KiB): the same
//               kernel with 128x128x32 tiles; no host sync, no device-to-host copy, capturable.
//   gg_fma      (auto when an operand is f32): the same kernel with exact f32 FMA.
//   gg_lt_loop  (only when forced; for the bench): copies group_sizes to the host, synchronizes
//               the stream and calls cuBLASLt once per group. Takes what gemm_lt takes:
//               plain equal dtypes, fp8 with per-tensor scales in the K-major layouts.
// Names this file does not know are left to the other operations (they are context-wide).
#include <stdlib.h>
#include <string.h>

#include "gpu/gemm_common.cuh"

typedef enum {
  VER_MMA = 0, VER_FMA = 1, VER_LT_LOOP = 2, VER_MMA_WIDE = 3, VER_WGMMA = 4, VER_WGMMA_FP8 = 5
} gg_version;

static const char *const gg_names[] = {GG_KERNEL_MMA, GG_KERNEL_FMA, GG_KERNEL_LT_LOOP, GG_KERNEL_MMA_WIDE,
                                       GG_KERNEL_WGMMA, GG_KERNEL_WGMMA_FP8};
#define GG_NVERSIONS 6

// gg_wgmma's wgrad (gpu/grouped_gemm_wgmma.cu; declared here, not in gemm_common.cuh, so that
// no other kernel file depends on it): lhs [M, K] and rhs [M, N] (ops N), out [G, K, N].
// _takes: 1 if it takes the problem, else 0 and *why; the other returns TW_ERR_UNSUPPORTED
// naming it when it declines. offsets: device [G+1] from gpu_group_prefix.
int gg_wgmma_wgrad_takes(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                         const tw_tensor *out, const char **why);
tw_status gg_wgmma_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                         const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate, const char *op);
// The same with a row-gathered lhs [U, K] (token row o_g + x is data row rows[o_g + x]; ops N).
tw_status gg_wgmma_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const int32_t *rows, const tw_operand *rhs,
                              const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate, const char *op);

// gg_wgmma is the automatic choice for the forward ops it takes (gg_wgmma_takes): on since
// it passed on the H100 (runs g1, g2 in gpu/NOTES-gemm.md).
#define GG_WGMMA_AUTO 1
// gg_wgmma_fp8 (fp8 per-tensor / 1x128 / 128x128 promoted every 128 along K, MXFP8 every 32: the
// accumulation model "gg_wgmma_fp8" of tw_gemm.h) is the automatic choice for the fp8 forward it
// takes.
#define GG_WGMMA_FP8_AUTO 1
// Its wgrad (from the per-group transposed colwise copies, the MoE block's fp8 wgrads; MXFP8 from
// the colwise [M, K] / [M, N] data, ops N, promoted every 32 tokens), same model, is the automatic
// choice for every fp8 wgrad it takes (per-tensor current or delayed, 1x128, 128x128, MXFP8):
// 3x gg_mma for 1x128, 1.05x gg_mma_wide per-tensor on large groups and 1.6-3.7x on small /
// ragged ones (H100, run fw1 in gpu/NOTES-gemm.md); MXFP8: run mxw1 there. Delayed scales were
// kept on gg_mma_wide until the model's magnitudes were lifted for subnormal codes (session 6,
// "fp8 accumulator probe" in gpu/NOTES-gemm.md): they leave codes in the subnormal range, which
// the tensor core aligns at the smallest normal exponent.
// Measurement knob (read on every call, so the bench times both in one process):
// TWIN_GG_WGMMA_FP8_WGRAD=0 turns the auto choice off.
#define GG_WGMMA_FP8_WGRAD_AUTO 1
static int fp8_wgrad_auto_on(void) {
  const char *e = getenv("TWIN_GG_WGMMA_FP8_WGRAD");
  return !(e && *e == '0');
}
static int fp8_scaled(const tw_operand *a) { return a->mode != TW_SCALE_NONE; }

static int has_f32(const tw_operand *a, const tw_operand *b) {
  return a->mode == TW_SCALE_NONE && (a->data.dtype == TW_F32 || b->data.dtype == TW_F32);
}

// The one place that picks the version for this device and these operands.
static tw_status choose_version(tw_ctx *ctx, const char *op, const tw_operand *a, const tw_operand *b,
                                gg_version *v) {
  gpu_state *st = gpu_of(ctx);
  if (st->sm < 80)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: needs sm_80 or newer, device %d is sm_%d", op, st->device, st->sm);
  const char *k = tw_ctx_kernel(ctx);
  *v = has_f32(a, b) ? VER_FMA : gg_wide_fits(ctx) ? VER_MMA_WIDE : VER_MMA;
  if (!k) return TW_OK;
  for (int i = 0; i < GG_NVERSIONS; ++i)
    if (strcmp(k, gg_names[i]) == 0) *v = (gg_version)i;
  if ((*v == VER_MMA || *v == VER_MMA_WIDE) && has_f32(a, b))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' takes bf16, f16 or fp8 operands, not %s x %s", op, k,
                    tw_dtype_name(a->data.dtype), tw_dtype_name(b->data.dtype));
  return TW_OK;
}

// Whether the context forces one of this file's versions by name.
static int forced(tw_ctx *ctx) {
  const char *k = tw_ctx_kernel(ctx);
  if (!k) return 0;
  for (int i = 0; i < GG_NVERSIONS; ++i)
    if (strcmp(k, gg_names[i]) == 0) return 1;
  return 0;
}

static int compute_of(const tw_operand *a, const tw_operand *b, gg_version v) {
  if (v == VER_FMA) return GG_FMA_F32;
  if (a->mode != TW_SCALE_NONE) return GG_MMA_FP8;
  return a->data.dtype == TW_F16 ? GG_MMA_F16 : GG_MMA_BF16;
}

static tw_status prefix(tw_ctx *ctx, const tw_tensor *gs, int64_t rows, int op_id, int64_t **offsets,
                        int64_t **tiles) {
  int64_t G = gs->shape[0];
  TW_TRY(gpu_scratch(ctx, (size_t)(G + 1) * sizeof(int64_t), (void **)offsets));
  TW_TRY(gpu_scratch(ctx, (size_t)(G + 1) * sizeof(int64_t), (void **)tiles));
  return gpu_group_prefix(ctx, (const int32_t *)gs->data, G, rows, 1, op_id, *offsets, *tiles);
}

// ---- the host-sizes loop (version gg_lt_loop) --------------------------------------------------
static tw_status host_sizes(tw_ctx *ctx, const tw_tensor *gs, int64_t rows, const char *op, int32_t **out) {
  gpu_state *st = gpu_of(ctx);
  int64_t G = gs->shape[0];
  int32_t *h = (int32_t *)malloc((size_t)G * sizeof(int32_t));
  if (!h) return tw_error(TW_ERR_MEMORY, "%s: out of host memory", op);
  cudaError_t e = cudaMemcpyAsync(h, gs->data, (size_t)G * sizeof(int32_t), cudaMemcpyDeviceToHost, st->stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st->stream);
  if (e != cudaSuccess) {
    free(h);
    return gpu_cuda_status(e, "grouped_gemm (gg_lt_loop): copying group_sizes to the host");
  }
  int64_t sum = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (h[g] < 0) {
      tw_status s = tw_error(TW_ERR_INVALID_ARG, "%s: group_sizes[%lld] = %d is negative", op, (long long)g, h[g]);
      free(h);
      return s;
    }
    sum += h[g];
  }
  if (sum > rows) {
    free(h);
    return tw_error(TW_ERR_INVALID_ARG, "%s: group_sizes sum to %lld but lhs has %lld rows", op, (long long)sum,
                    (long long)rows);
  }
  *out = h;
  return TW_OK;
}

// cuBLASLt wants 16-byte aligned scale pointers: per-group scale_inv g goes to slot 4g of a
// scratch copy (one strided device-to-device copy).
static tw_status aligned_scales(tw_ctx *ctx, const tw_operand *o, int64_t G, const char *op, float **out) {
  *out = NULL;
  if (o->mode == TW_SCALE_NONE) return TW_OK;
  TW_TRY(gpu_scratch(ctx, (size_t)G * 16, (void **)out));
  return gpu_cuda_status(cudaMemcpy2DAsync(*out, 16, o->scale_inv.data, 4, 4, (size_t)G, cudaMemcpyDeviceToDevice,
                                           gpu_of(ctx)->stream),
                         op);
}

static tw_status loop_supported(const char *op, const tw_operand *l, const tw_operand *r) {
  int tensor = l->mode == TW_SCALE_TENSOR_CURRENT || l->mode == TW_SCALE_TENSOR_DELAYED;
  if ((l->mode == TW_SCALE_NONE && l->data.dtype == r->data.dtype) || tensor) return TW_OK;
  return tw_error(TW_ERR_UNSUPPORTED,
                  "%s: kernel '%s' takes equal plain dtypes or per-tensor fp8, not %s %s x %s (use gg_mma)", op,
                  GG_KERNEL_LT_LOOP, tw_scaling_name(l->mode), tw_dtype_name(l->data.dtype),
                  tw_dtype_name(r->data.dtype));
}

static tw_status fwd_loop(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                          const tw_tensor *gs, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm";
  TW_TRY(loop_supported(op, lhs, rhs));
  int64_t M = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1], G = gs->shape[0];
  float *sa, *sb;
  TW_TRY(aligned_scales(ctx, lhs, G, op, &sa));
  TW_TRY(aligned_scales(ctx, rhs, G, op, &sb));
  int32_t *h;
  TW_TRY(host_sizes(ctx, gs, M, op, &h));
  int ea = tw_dtype_bits(lhs->data.dtype) / 8, eb = tw_dtype_bits(rhs->data.dtype) / 8;
  int eo = tw_dtype_bits(out->dtype) / 8;
  int64_t o = 0;
  tw_status s = TW_OK;
  for (int64_t g = 0; g < G && s == TW_OK; o += h[g], ++g) {
    if (h[g] == 0) continue;
    gemm_lt_args x;
    memset(&x, 0, sizeof x);
    x.a = (const char *)lhs->data.data + o * K * ea;
    x.a_dtype = lhs->data.dtype;
    x.op_a = TW_OP_N;
    x.lda = K;
    x.b = (const char *)rhs->data.data + g * K * N * eb;
    x.b_dtype = rhs->data.dtype;
    x.op_b = rhs_op;
    x.ldb = rhs_op == TW_OP_N ? N : K;
    x.out = (char *)out->data + o * N * eo;
    x.out_dtype = out->dtype;
    x.ldo = N;
    x.M = h[g];
    x.N = N;
    x.K = K;
    x.batch = 1;
    if (lhs->mode != TW_SCALE_NONE) {
      x.a_scale = sa + 4 * g;
      x.b_scale = sb + 4 * g;
    }
    x.accumulate = accumulate;
    s = gemm_lt(ctx, &x, op);
  }
  free(h);
  return s;
}

static tw_status wgrad_loop(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                            const tw_tensor *gs, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm_wgrad";
  TW_TRY(loop_supported(op, lhs, rhs));
  if (lhs->col_padded || rhs->col_padded)  // its per-group slices address the default layout only
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel 'gg_lt_loop' reads the default colwise layout, not a token-padded "
                    "operand (use gg_wgmma_fp8 or gg_mma_wide)", op);
  int64_t G = out->shape[0], K = out->shape[1], N = out->shape[2];
  int64_t M = lhs->mode != TW_SCALE_NONE ? lhs->src_rows
                                          : (lhs_op == TW_OP_N ? lhs->data.shape[0] : lhs->data.shape[1]);
  float *sa, *sb;
  TW_TRY(aligned_scales(ctx, lhs, G, op, &sa));
  TW_TRY(aligned_scales(ctx, rhs, G, op, &sb));
  int32_t *h;
  TW_TRY(host_sizes(ctx, gs, M, op, &h));
  int ea = tw_dtype_bits(lhs->data.dtype) / 8, eb = tw_dtype_bits(rhs->data.dtype) / 8;
  int eo = tw_dtype_bits(out->dtype) / 8;
  int64_t o = 0;
  tw_status s = TW_OK;
  for (int64_t g = 0; g < G && s == TW_OK; o += h[g], ++g) {
    char *og = (char *)out->data + g * K * N * eo;
    if (h[g] == 0) {
      if (!accumulate)
        s = gpu_cuda_status(cudaMemsetAsync(og, 0, (size_t)(K * N * eo), gpu_of(ctx)->stream), op);
      continue;
    }
    gemm_lt_args x;
    memset(&x, 0, sizeof x);
    // out[g] [K, N] = lhs_g^T [K, m] @ rhs_g [m, N]
    x.a = (const char *)lhs->data.data + o * K * ea;
    x.a_dtype = lhs->data.dtype;
    x.op_a = lhs_op == TW_OP_N ? TW_OP_T : TW_OP_N;
    x.lda = lhs_op == TW_OP_N ? K : h[g];
    x.b = (const char *)rhs->data.data + o * N * eb;
    x.b_dtype = rhs->data.dtype;
    x.op_b = rhs_op;
    x.ldb = rhs_op == TW_OP_N ? N : h[g];
    x.out = og;
    x.out_dtype = out->dtype;
    x.ldo = N;
    x.M = K;
    x.N = N;
    x.K = h[g];
    x.batch = 1;
    if (lhs->mode != TW_SCALE_NONE) {
      x.a_scale = sa + 4 * g;
      x.b_scale = sb + 4 * g;
    }
    x.accumulate = accumulate;
    s = gemm_lt(ctx, &x, op);
  }
  free(h);
  return s;
}

// ---- entry points -------------------------------------------------------------------------------
tw_status gpu_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                           const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm";
  gg_version v;
  TW_TRY(choose_version(ctx, op, lhs, rhs, &v));
  gpu_scratch_reset(ctx);
  if (v == VER_LT_LOOP) return fwd_loop(ctx, lhs, rhs, rhs_op, group_sizes, out, accumulate);
  const char *why;
  if (GG_WGMMA_AUTO && !forced(ctx) && gg_wgmma_takes(ctx, lhs, rhs, rhs_op, out, &why)) v = VER_WGMMA;
  if (GG_WGMMA_FP8_AUTO && !forced(ctx) && gg_wgmma_fp8_takes(ctx, lhs, rhs, rhs_op, out, &why)) v = VER_WGMMA_FP8;
  if (v == VER_WGMMA_FP8 && !gg_wgmma_fp8_takes(ctx, lhs, rhs, rhs_op, out, &why))
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA_FP8, why);
  int64_t M = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1], G = group_sizes->shape[0];
  if (v == VER_WGMMA && !gg_wgmma_takes(ctx, lhs, rhs, rhs_op, out, &why))  // before any work is enqueued
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA, why);
  gg_problem p;
  memset(&p, 0, sizeof p);
  TW_TRY(prefix(ctx, group_sizes, M, GPU_OP_GROUPED_GEMM, (int64_t **)&p.offsets, (int64_t **)&p.tiles));
  if (v == VER_WGMMA) return gg_wgmma_forward(ctx, lhs, rhs, rhs_op, p.offsets, G, out, accumulate, op);
  if (v == VER_WGMMA_FP8)
    return gg_wgmma_fp8_forward(ctx, lhs, rhs, rhs_op, p.offsets, p.tiles, G, out, accumulate, op);
  p.kind = GG_FWD_RAGGED;
  p.compute = compute_of(lhs, rhs, v);
  p.wide = v == VER_MMA_WIDE;
  p.G = G;
  p.Q = N;
  p.R = K;
  gg_operand_from(&p.a, lhs);  // lhs [M, K], rows of group g from o_g
  p.a.kmajor = 1;
  p.a.ragged = 1;
  p.a.row_elems = K;
  p.a.ld = K;
  gg_operand_from(&p.b, rhs);  // rhs[g] stored [K, N] (op N) or [N, K] (op T)
  p.b.kmajor = rhs_op == TW_OP_T;
  p.b.group_stride = K * N;
  p.b.ld = rhs_op == TW_OP_N ? N : K;
  if (rhs->mode != TW_SCALE_NONE) p.b.src_group_rows = rhs->src_rows / G;
  p.out = out->data;
  p.out_dtype = out->dtype;
  p.accumulate = accumulate;
  return gg_run(ctx, &p, op);
}

tw_status gpu_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs,
                                 tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm_wgrad";
  gg_version v;
  TW_TRY(choose_version(ctx, op, lhs, rhs, &v));
  gpu_scratch_reset(ctx);
  if (v == VER_LT_LOOP) return wgrad_loop(ctx, lhs, lhs_op, rhs, rhs_op, group_sizes, out, accumulate);
  const char *why;
  if (GG_WGMMA_FP8_WGRAD_AUTO && !forced(ctx) && fp8_wgrad_auto_on() && fp8_scaled(lhs) &&
      gg_wgmma_fp8_wgrad_takes(ctx, lhs, lhs_op, rhs, rhs_op, out, &why))
    v = VER_WGMMA_FP8;
  if (v == VER_WGMMA_FP8 && !gg_wgmma_fp8_wgrad_takes(ctx, lhs, lhs_op, rhs, rhs_op, out, &why))  // before any work
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA_FP8, why);
  if (GG_WGMMA_AUTO && !forced(ctx) && gg_wgmma_wgrad_takes(ctx, lhs, lhs_op, rhs, rhs_op, out, &why)) v = VER_WGMMA;
  if (v == VER_WGMMA && !gg_wgmma_wgrad_takes(ctx, lhs, lhs_op, rhs, rhs_op, out, &why))  // before any work
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA, why);
  int64_t G = out->shape[0], K = out->shape[1], N = out->shape[2];
  int64_t M = lhs->mode != TW_SCALE_NONE ? lhs->src_rows
                                          : (lhs_op == TW_OP_N ? lhs->data.shape[0] : lhs->data.shape[1]);
  gg_problem p;
  memset(&p, 0, sizeof p);
  TW_TRY(prefix(ctx, group_sizes, M, GPU_OP_GROUPED_GEMM_WGRAD, (int64_t **)&p.offsets, (int64_t **)&p.tiles));
  if (v == VER_WGMMA)
    return gg_wgmma_wgrad(ctx, lhs, lhs_op, rhs, rhs_op, p.offsets, G, out, accumulate, op);
  if (v == VER_WGMMA_FP8)
    return gg_wgmma_fp8_wgrad(ctx, lhs, lhs_op, rhs, rhs_op, p.offsets, p.tiles, G, out, accumulate, op);
  p.kind = GG_WGRAD;
  p.compute = compute_of(lhs, rhs, v);
  p.wide = v == VER_MMA_WIDE;
  p.G = G;
  p.P = K;
  p.Q = N;
  // A_g = lhs_g^T [K, m_g]: op N stores [m_g, K] rows (k contiguous in x), op T stores [K, m_g].
  gg_operand_from(&p.a, lhs);
  p.a.kmajor = lhs_op == TW_OP_T;
  p.a.ragged = 1;
  p.a.row_elems = K;
  p.a.ld = lhs_op == TW_OP_N ? K : 0;
  // B_g = rhs_g [m_g, N]: op N stores [m_g, N] rows, op T stores [N, m_g].
  gg_operand_from(&p.b, rhs);
  p.b.kmajor = rhs_op == TW_OP_T;
  p.b.ragged = 1;
  p.b.row_elems = N;
  p.b.ld = rhs_op == TW_OP_N ? N : 0;
  // token-padded copies (op T): [K, 128*T_cap] / [N, 128*T_cap], group g at column 128*T(g)
  p.a.padded = lhs->col_padded;
  if (p.a.padded) p.a.ld = lhs->data.shape[1];
  p.b.padded = rhs->col_padded;
  if (p.b.padded) p.b.ld = rhs->data.shape[1];
  p.out = out->data;
  p.out_dtype = out->dtype;
  p.accumulate = accumulate;
  p.out_group_stride = K * N;
  return gg_run(ctx, &p, op);
}

// ---- row-gathered lhs (tw_grouped_gemm_rows, tw_grouped_gemm_wgrad_rows) ------------------------
// The mma.sync kernel family reads lhs row x of group g from data row lhs_rows[o_g + x] in its
// general tile loader (gg_load_tile; a cp.async per 16 bytes, so a per-row source costs nothing
// there), scales from the one-group source; gg_mma_wide's hoisted interior loader is left out for
// the gathered operand. On sm_90 the forward and the wgrad run gg_wgmma where it takes the
// operands (plain bf16 / f16), its producer warpgroup copying the A rows (gpu/grouped_gemm_wgmma.cu,
// GA). gg_wgmma_fp8 and gg_lt_loop do not take it: auto runs gg_mma_wide (gg_mma where it does
// not fit, gg_fma for f32); forcing one of them is TW_ERR_UNSUPPORTED.

// Every entry read (i < S = offsets[G]) in [-1, U), else the error word (first one wins).
__global__ void gg_check_rows(const int32_t *__restrict__ rows, const int64_t *__restrict__ offsets, int64_t G,
                              int64_t U, long long *err, int op_id) {
  const int64_t S = offsets[G];
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < S; i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t v = rows[i];
    if (v < -1 || v >= U) gpu_report(err, GPU_ERR_ROW_INDEX, op_id, i, v);
  }
}

static tw_status rows_version(tw_ctx *ctx, const char *op, const tw_operand *a, const tw_operand *b, gg_version *v) {
  TW_TRY(choose_version(ctx, op, a, b, v));
  if (*v == VER_MMA || *v == VER_MMA_WIDE || *v == VER_FMA || *v == VER_WGMMA) return TW_OK;
  return tw_error(TW_ERR_UNSUPPORTED,
                  "%s: kernel '%s' takes no row-gathered lhs (gg_wgmma, gg_mma_wide, gg_mma and gg_fma do)", op,
                  gg_names[*v]);
}

static tw_status rows_check(tw_ctx *ctx, const tw_tensor *rows, const int64_t *offsets, int64_t G, int64_t U,
                            int op_id, const char *op) {
  const int64_t M = rows->shape[0];
  if (!M) return TW_OK;
  gpu_state *st = gpu_of(ctx);
  int64_t blocks = (M + 255) / 256, cap = (int64_t)st->num_sms * 4;
  gg_check_rows<<<(unsigned)(blocks < cap ? blocks : cap), 256, 0, st->stream>>>(
      (const int32_t *)rows->data, offsets, G, U, st->err_word, op_id);
  return gpu_cuda_status(cudaGetLastError(), op);
}

// The gathered lhs [U, K] as the mma.sync loader reads it: K-major rows (forward) or the
// wgrad's token-major A_g^T, row x of group g from data row lhs_rows[o_g + x].
static void gathered_lhs(gg_operand *a, const tw_operand *lhs, const tw_tensor *lhs_rows, int64_t K, int kmajor) {
  gg_operand_from(a, lhs);
  a->kmajor = kmajor;
  a->ragged = 1;
  a->row_elems = K;
  a->ld = K;
  a->rows = (const int32_t *)lhs_rows->data;
  a->gather_rows = lhs->data.shape[0];
}

tw_status gpu_grouped_gemm_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows, const tw_operand *rhs,
                                tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm_rows";
  gg_version v;
  TW_TRY(rows_version(ctx, op, lhs, rhs, &v));
  gpu_scratch_reset(ctx);
  const char *why;
  if (GG_WGMMA_AUTO && !forced(ctx) && gg_wgmma_takes(ctx, lhs, rhs, rhs_op, out, &why)) v = VER_WGMMA;
  if (v == VER_WGMMA && !gg_wgmma_takes(ctx, lhs, rhs, rhs_op, out, &why))  // before any work is enqueued
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA, why);
  const int64_t M = lhs_rows->shape[0], U = lhs->data.shape[0], K = lhs->data.shape[1], N = out->shape[1];
  const int64_t G = group_sizes->shape[0];
  gg_problem p;
  memset(&p, 0, sizeof p);
  TW_TRY(prefix(ctx, group_sizes, M, GPU_OP_GROUPED_GEMM, (int64_t **)&p.offsets, (int64_t **)&p.tiles));
  TW_TRY(rows_check(ctx, lhs_rows, p.offsets, G, U, GPU_OP_GROUPED_GEMM_ROWS, op));
  if (v == VER_WGMMA)
    return gg_wgmma_forward_rows(ctx, lhs, (const int32_t *)lhs_rows->data, rhs, rhs_op, p.offsets, G, out, accumulate,
                                 op);
  p.kind = GG_FWD_RAGGED;
  p.compute = compute_of(lhs, rhs, v);
  p.wide = v == VER_MMA_WIDE;
  p.G = G;
  p.Q = N;
  p.R = K;
  gathered_lhs(&p.a, lhs, lhs_rows, K, 1);  // lhs [U, K]: row x of group g is data row lhs_rows[o_g + x]
  gg_operand_from(&p.b, rhs);
  p.b.kmajor = rhs_op == TW_OP_T;
  p.b.group_stride = K * N;
  p.b.ld = rhs_op == TW_OP_N ? N : K;
  if (rhs->mode != TW_SCALE_NONE) p.b.src_group_rows = rhs->src_rows / G;
  p.out = out->data;
  p.out_dtype = out->dtype;
  p.accumulate = accumulate;
  return gg_run(ctx, &p, op);
}

tw_status gpu_grouped_gemm_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                      const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                                      int accumulate) {
  const char *op = "grouped_gemm_wgrad_rows";
  gg_version v;
  TW_TRY(rows_version(ctx, op, lhs, rhs, &v));
  gpu_scratch_reset(ctx);
  const char *why;
  if (GG_WGMMA_AUTO && !forced(ctx) && gg_wgmma_wgrad_takes(ctx, lhs, TW_OP_N, rhs, rhs_op, out, &why)) v = VER_WGMMA;
  if (v == VER_WGMMA && !gg_wgmma_wgrad_takes(ctx, lhs, TW_OP_N, rhs, rhs_op, out, &why))  // before any work
    return tw_error(TW_ERR_UNSUPPORTED, "%s: kernel '%s' %s", op, GG_KERNEL_WGMMA, why);
  const int64_t M = lhs_rows->shape[0], U = lhs->data.shape[0];
  const int64_t G = out->shape[0], K = out->shape[1], N = out->shape[2];
  gg_problem p;
  memset(&p, 0, sizeof p);
  TW_TRY(prefix(ctx, group_sizes, M, GPU_OP_GROUPED_GEMM_WGRAD, (int64_t **)&p.offsets, (int64_t **)&p.tiles));
  TW_TRY(rows_check(ctx, lhs_rows, p.offsets, G, U, GPU_OP_GROUPED_GEMM_WGRAD_ROWS, op));
  if (v == VER_WGMMA)
    return gg_wgmma_wgrad_rows(ctx, lhs, (const int32_t *)lhs_rows->data, rhs, p.offsets, G, out, accumulate, op);
  p.kind = GG_WGRAD;
  p.compute = compute_of(lhs, rhs, v);
  p.wide = v == VER_MMA_WIDE;
  p.G = G;
  p.P = K;
  p.Q = N;
  // A_g = L_g^T [K, m_g], L_g's token rows gathered: storage row o_g + k is data row lhs_rows[o_g + k]
  gathered_lhs(&p.a, lhs, lhs_rows, K, 0);
  gg_operand_from(&p.b, rhs);
  p.b.kmajor = rhs_op == TW_OP_T;
  p.b.ragged = 1;
  p.b.row_elems = N;
  p.b.ld = rhs_op == TW_OP_N ? N : 0;
  p.out = out->data;
  p.out_dtype = out->dtype;
  p.accumulate = accumulate;
  p.out_group_stride = K * N;
  return gg_run(ctx, &p, op);
}

