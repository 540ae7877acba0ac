// gpu/gemm.cu — dense / batched GEMM on the GPU (twin of ref/gemm.c's ref_gemm).
//
// version "gemm_lt": cuBLASLt. out[B?, M, N] (row-major) is computed as the column-major
//   product out^T = op(b)^T op(a)^T, so cuBLASLt's A slot holds our b and its B slot our a.
//   f32 accumulation (CUBLAS_COMPUTE_32F, no TF32), alpha = 1, beta = accumulate.
//   fp8 (Hopper, only when forced): both operands K-major (a [M, K] op N, b [N, K] op T), scale_inv pointers as
//   A/B scales; per-tensor (SCALAR_32F) or 1x128 blocks (VEC128_32F, the MN-major
//   [ceil(K/128), roundup(rows, 4)] layout of tw_quantize.h, sm_90+ only).
// version "gg_mma_wide" / "gg_mma" / "gg_fma": twin's own kernel (gpu/grouped_gemm_kernel.cu) with one group
//   per batch entry. It takes every case cuBLASLt does not: mixed f32 x bf16/f16 operands,
//   fp8 in non-K-major layouts or with unaligned dims, 128x128 and MXFP8 blocks on Hopper,
//   K = 0, and any cuBLASLt request for which the heuristic returns no algorithm.
// version "gg_wgmma_fp8": the Hopper fp8 kernel (gpu/grouped_gemm_wgmma_fp8.cu) as one group:
//   a [M, K] rowwise op N, b [N, K] op T, no batch; per-tensor, 1x128, 128x128 or MXFP8 scales;
//   tw_gemm.h's "promoted every 128" model (MXFP8: every 32).
// Auto choice: cuBLASLt for plain operands of one dtype; plain operands of mixed dtypes (f32 x
//   bf16/f16) widened to f32 first (exact) and then cuBLASLt in f32 (dense_lt_widened); fp8
//   on gg_wgmma_fp8 where it takes the operands (sm_90, K-major, one matrix); else gg
//   (gg_mma_wide where it fits: exact f32 accumulation of fp8 decoded to bf16/f16).
//   fp8 never goes to cuBLASLt unless forced: Hopper's fp8 tensor cores keep about 14
//   mantissa bits in the accumulator with no documented promotion interval there (measured:
//   ~2^-13 relative to sum |a||b|; DeepSeek-V3 report, DeepGEMM #37), so no bound is derived.
#include <string.h>

#include "gpu/gemm_common.cuh"
#include "gpu/numerics.cuh"

static tw_status lt_status(cublasStatus_t s, const char *op, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS) return TW_OK;
  // "not supported" is cuBLASLt declining this problem, not a failure of the machine: the
  // auto path then hands it to the gg kernel (gpu_gemm), a forced gemm_lt reports it as such.
  return tw_error(s == CUBLAS_STATUS_NOT_SUPPORTED ? TW_ERR_UNSUPPORTED : TW_ERR_CUDA, "%s: %s failed: %s (%d)",
                  op, what, cublasLtGetStatusString(s), (int)s);
}
#define LT_TRY(call, what)                                        \
  do {                                                            \
    s = lt_status((call), op, what);                              \
    if (s != TW_OK) goto done;                                    \
  } while (0)

static cudaDataType lt_type(int dt) {
  switch (dt) {
    case TW_F32: return CUDA_R_32F;
    case TW_BF16: return CUDA_R_16BF;
    case TW_F16: return CUDA_R_16F;
    case TW_E4M3: return CUDA_R_8F_E4M3;
    default: return CUDA_R_8F_E5M2;
  }
}

void gpu_gemm_fini(gpu_state *st) {
  if (st && st->lt) {
    cublasLtDestroy((cublasLtHandle_t)st->lt);
    st->lt = NULL;
  }
}

static tw_status lt_handle(tw_ctx *ctx, cublasLtHandle_t *h, const char *op) {
  gpu_state *st = gpu_of(ctx);
  if (!st->lt) {
    cublasLtHandle_t nh;
    cublasStatus_t s = cublasLtCreate(&nh);
    if (s != CUBLAS_STATUS_SUCCESS) return lt_status(s, op, "cublasLtCreate");
    st->lt = nh;
  }
  *h = (cublasLtHandle_t)st->lt;
  return TW_OK;
}

static tw_status lt_layout(cublasLtMatrixLayout_t *l, int dt, int64_t rows, int64_t cols, int64_t ld,
                           int64_t batch, int64_t stride, const char *op) {
  TW_TRY(lt_status(cublasLtMatrixLayoutCreate(l, lt_type(dt), rows, cols, ld), op, "MatrixLayoutCreate"));
  if (batch > 1) {
    int32_t b = (int32_t)batch;
    TW_TRY(lt_status(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b),
                     op, "layout batch count"));
    TW_TRY(lt_status(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                      &stride, sizeof stride),
                     op, "layout batch stride"));
  }
  return TW_OK;
}

// Largest power of two (at most 256) dividing the address.
static uint32_t ptr_alignment(const void *p) {
  uintptr_t a = (uintptr_t)p;
  uint32_t al = 256;
  while (al > 1 && (a & (al - 1))) al >>= 1;
  return al;
}

tw_status gemm_lt(tw_ctx *ctx, const gemm_lt_args *x, const char *op) {
  cublasLtHandle_t h;
  TW_TRY(lt_handle(ctx, &h, op));
  gpu_state *st = gpu_of(ctx);
  tw_status s = TW_OK;
  cublasLtMatmulDesc_t desc = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
  cublasLtMatmulPreference_t pref = NULL;
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  float alpha = 1.f, beta = x->accumulate ? 1.f : 0.f;
  cublasOperation_t ta = x->op_b == TW_OP_N ? CUBLAS_OP_N : CUBLAS_OP_T;  // slot A = our b
  cublasOperation_t tb = x->op_a == TW_OP_N ? CUBLAS_OP_N : CUBLAS_OP_T;  // slot B = our a
  size_t ws_max = st->workspace_bytes;  // the context workspace is cuBLASLt's alone

  LT_TRY(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  LT_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "TRANSA");
  LT_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "TRANSB");
  if (x->a_scale) {
    const float *sa = x->b_scale, *sb = x->a_scale;
    LT_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa), "A_SCALE_POINTER");
    LT_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb), "B_SCALE_POINTER");
    if (x->block128) {
      int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      LT_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode), "A_SCALE_MODE");
      LT_TRY(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode), "B_SCALE_MODE");
    }
  }
  s = lt_layout(&la, x->b_dtype, x->op_b == TW_OP_N ? x->N : x->K, x->op_b == TW_OP_N ? x->K : x->N,
                x->ldb, x->batch, x->stride_b, op);
  if (s != TW_OK) goto done;
  s = lt_layout(&lb, x->a_dtype, x->op_a == TW_OP_N ? x->K : x->M, x->op_a == TW_OP_N ? x->M : x->K,
                x->lda, x->batch, x->stride_a, op);
  if (s != TW_OK) goto done;
  s = lt_layout(&lc, x->out_dtype, x->N, x->M, x->ldo, x->batch, x->stride_out, op);
  if (s != TW_OK) goto done;
  LT_TRY(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_max, sizeof ws_max),
         "preference workspace");
  {
    // Split-K partial sums may only be reduced in f32 (the compute type): reductions in the
    // output type (bf16/f16) or in place in the output round every partial sum, which the
    // fuzzer caught on H200 as errors far past the f32-accumulation bound (bf16 outputs with
    // cancellation, and accumulate=1). Algorithms without split-K are unaffected.
    uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                sizeof reduction),
           "preference reduction scheme");
  }
  {
    // The heuristic assumes 256-byte aligned pointers unless told otherwise; per-group slices
    // (o_g * K elements in) are often less aligned, and an algorithm chosen for 256 then
    // fails with "not supported". Tell it each pointer's real alignment.
    uint32_t al_a = ptr_alignment(x->b), al_b = ptr_alignment(x->a), al_c = ptr_alignment(x->out);
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a),
           "preference alignment A");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b),
           "preference alignment B");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c),
           "preference alignment C");
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c),
           "preference alignment D");
  }
  {
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, 1, &res, &found);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      s = tw_error(TW_ERR_UNSUPPORTED,
                   "%s: cuBLASLt %d has no algorithm for %s x %s -> %s, M=%lld N=%lld K=%lld (%s%s)", op,
                   CUBLAS_VERSION, tw_dtype_name((tw_dtype)x->a_dtype), tw_dtype_name((tw_dtype)x->b_dtype),
                   tw_dtype_name((tw_dtype)x->out_dtype), (long long)x->M, (long long)x->N, (long long)x->K,
                   x->block128 ? "1x128 block scales" : x->a_scale ? "per-tensor scales" : "unscaled",
                   hs != CUBLAS_STATUS_SUCCESS ? ", heuristic failed" : "");
      goto done;
    }
  }
  LT_TRY(cublasLtMatmul(h, desc, &alpha, x->b, la, x->a, lb, &beta, x->out, lc,
                        x->out, lc, &res.algo, st->workspace, res.workspaceSize, st->stream),
         "cublasLtMatmul");
done:
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (desc) cublasLtMatmulDescDestroy(desc);
  return s;
}

// ---- dense entry point ---------------------------------------------------------------------
typedef struct {
  int64_t batch, M, N, K;
  int a3, b3;
} dense_dims;

static dense_dims dims_of(const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b) {
  dense_dims d;
  const tw_tensor *A = &a->data, *B = &b->data;
  d.a3 = A->ndim == 3;
  d.b3 = B->ndim == 3;
  d.batch = d.a3 ? A->shape[0] : d.b3 ? B->shape[0] : 1;
  int oa = A->ndim - 2, ob = B->ndim - 2;
  d.M = op_a == TW_OP_N ? A->shape[oa] : A->shape[oa + 1];
  d.K = op_a == TW_OP_N ? A->shape[oa + 1] : A->shape[oa];
  d.N = op_b == TW_OP_N ? B->shape[ob + 1] : B->shape[ob];
  return d;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// The cuBLASLt rules twin applies before choosing it (else the gg kernel runs):
//   plain: a and b of one dtype (bf16, f16 or f32), K >= 1, any layout.
//   fp8 (per-tensor or 1x128 blocks): a op N and b op T (both K-major), K, M and N multiples
//     of 16, every pointer 16-byte aligned; 1x128 blocks need sm_90+ (VEC128_32F).
//   MXFP8 needs sm_100 in cuBLASLt and 128x128 x 128x128 is not a cuBLASLt pairing: gg runs.
// None of these is an error: the gg kernel accepts any shape, layout and alignment, so this
// backend rejects nothing for alignment.
static int lt_eligible(const gpu_state *st, const tw_operand *a, tw_op op_a, const tw_operand *b,
                       tw_op op_b, const tw_tensor *out, const dense_dims *d) {
  if (d->K == 0) return 0;
  if (a->mode == TW_SCALE_NONE) return a->data.dtype == b->data.dtype;
  int tensor = a->mode == TW_SCALE_TENSOR_CURRENT || a->mode == TW_SCALE_TENSOR_DELAYED;
  int block = a->mode == TW_SCALE_BLOCK_1x128;
  if (!tensor && !(block && st->sm >= 90)) return 0;
  if (op_a != TW_OP_N || op_b != TW_OP_T) return 0;
  if (d->K % 16 || d->M % 16 || d->N % 16) return 0;
  return aligned16(a->data.data) && aligned16(b->data.data) && aligned16(out->data) &&
         aligned16(a->scale_inv.data) && aligned16(b->scale_inv.data);
}

tw_status gpu_gemm_alignment(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b,
                             tw_op op_b, const tw_tensor *out) {
  (void)ctx; (void)a; (void)op_a; (void)b; (void)op_b; (void)out;
  return TW_OK;  // see lt_eligible: unaligned cases run on the gg kernel
}

static int compute_for(const tw_operand *a, const tw_operand *b, int force_fma) {
  if (force_fma) return GG_FMA_F32;
  if (a->mode != TW_SCALE_NONE) return GG_MMA_FP8;
  if (a->data.dtype == TW_BF16 && b->data.dtype == TW_BF16) return GG_MMA_BF16;
  if (a->data.dtype == TW_F16 && b->data.dtype == TW_F16) return GG_MMA_F16;
  return GG_FMA_F32;
}

// ver: 0 = gg_mma, 1 = gg_fma, 2 = gg_mma_wide (gg_run keeps block-scaled fp8 on the 128x128 tile)
static tw_status dense_gg(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                          tw_tensor *out, int accumulate, const dense_dims *d, int ver) {
  gg_problem p;
  memset(&p, 0, sizeof p);
  p.kind = GG_UNIFORM;
  p.compute = compute_for(a, b, ver == 1);
  p.wide = ver == 2 && p.compute != GG_FMA_F32;
  p.G = d->batch;
  p.P = d->M;
  p.Q = d->N;
  p.R = d->K;
  gg_operand_from(&p.a, a);
  p.a.kmajor = op_a == TW_OP_N;
  p.a.ld = op_a == TW_OP_N ? d->K : d->M;
  p.a.group_stride = d->a3 ? d->M * d->K : 0;
  p.a.src_group_rows = a->mode != TW_SCALE_NONE ? (a->src_rows > 0 ? a->src_rows : 1) : 0;
  gg_operand_from(&p.b, b);
  p.b.kmajor = op_b == TW_OP_T;
  p.b.ld = op_b == TW_OP_N ? d->N : d->K;
  p.b.group_stride = d->b3 ? d->K * d->N : 0;
  p.b.src_group_rows = b->mode != TW_SCALE_NONE ? (b->src_rows > 0 ? b->src_rows : 1) : 0;
  p.out = out->data;
  p.out_dtype = out->dtype;
  p.accumulate = accumulate;
  p.out_group_stride = d->M * d->N;
  return gg_run(ctx, &p, "gemm");
}

// gg_wgmma_fp8 over one group: its device offsets {0, M} and 128-row tile offsets {0, T}.
__global__ void dense_one_group(int64_t *offsets, int64_t *tiles, int64_t M) {
  offsets[0] = 0;
  offsets[1] = M;
  tiles[0] = 0;
  tiles[1] = (M + 127) / 128;
}
static int dense_wgmma_fp8_takes(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                                 const tw_tensor *out, const dense_dims *d, const char **why) {
  if (a->mode == TW_SCALE_NONE) *why = "takes fp8 operands only";
  else if (d->batch != 1 || d->a3 || d->b3 || out->ndim != 2) *why = "takes one matrix (no batch)";
  else if (op_a != TW_OP_N || op_b != TW_OP_T) *why = "needs a op N and b op T (fp8 wgmma reads both K-major)";
  else return gg_wgmma_fp8_takes(ctx, a, b, TW_OP_T, out, why);
  return 0;
}
static tw_status dense_wgmma_fp8(tw_ctx *ctx, const tw_operand *a, const tw_operand *b, tw_tensor *out,
                                 int accumulate, const dense_dims *d) {
  int64_t *offsets, *tiles;
  TW_TRY(gpu_scratch(ctx, 2 * sizeof(int64_t), (void **)&offsets));
  TW_TRY(gpu_scratch(ctx, 2 * sizeof(int64_t), (void **)&tiles));
  dense_one_group<<<1, 1, 0, gpu_of(ctx)->stream>>>(offsets, tiles, d->M);
  GPU_TRY_CUDA(cudaGetLastError(), "gemm (gg_wgmma_fp8)");
  return gg_wgmma_fp8_forward(ctx, a, b, TW_OP_T, offsets, tiles, 1, out, accumulate, "gemm");
}

static tw_status dense_lt(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                          tw_tensor *out, int accumulate, const dense_dims *d) {
  gemm_lt_args x;
  memset(&x, 0, sizeof x);
  x.a = a->data.data;
  x.a_dtype = a->data.dtype;
  x.op_a = op_a;
  x.lda = op_a == TW_OP_N ? d->K : d->M;
  x.stride_a = d->a3 ? d->M * d->K : 0;
  x.b = b->data.data;
  x.b_dtype = b->data.dtype;
  x.op_b = op_b;
  x.ldb = op_b == TW_OP_N ? d->N : d->K;
  x.stride_b = d->b3 ? d->K * d->N : 0;
  x.out = out->data;
  x.out_dtype = out->dtype;
  x.ldo = d->N;
  x.stride_out = d->M * d->N;
  x.M = d->M;
  x.N = d->N;
  x.K = d->K;
  x.batch = d->batch;
  if (a->mode != TW_SCALE_NONE) {
    x.a_scale = (const float *)a->scale_inv.data;
    x.b_scale = (const float *)b->scale_inv.data;
    x.block128 = a->mode == TW_SCALE_BLOCK_1x128;
  }
  x.accumulate = accumulate;
  return gemm_lt(ctx, &x, "gemm");
}

// out = round(f32(out) + t): the contract's accumulate into a 16-bit output (one f32 add of the
// old value, then one rounding), after a non-accumulating f32 product t.
__global__ void add_round_kernel(void *out, int f16, const float *t, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint16_t *o = (uint16_t *)out;
    float v = (f16 ? tw_f16_to_f32_d(o[i]) : tw_bf16_to_f32_d(o[i])) + t[i];
    o[i] = f16 ? tw_f32_to_f16_d(v) : tw_f32_to_bf16_d(v);
  }
}

// Plain operands of different dtypes (f32 x bf16/f16, bf16 x f16): each 16-bit operand widened to
// f32 in scratch (exact), then cuBLASLt in f32 (CUBLAS_COMPUTE_32F): the same products and f32
// accumulation as gg_fma, which took these before at a few TFLOP/s (the MoE gate's backward,
// f32 d_logits x bf16 x / gate at T 4096, H 7168, E 32: 1.29 ms on gg_fma, H200 2026-11-24).
// Accumulating into a 16-bit output goes through an f32 product and add_round_kernel (the
// contract's epilogue, which cuBLASLt's is not). TW_ERR_UNSUPPORTED when cuBLASLt declines.
static tw_status dense_lt_widened(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                                  tw_tensor *out, int accumulate, const dense_dims *d) {
  gpu_state *st = gpu_of(ctx);
  tw_operand w[2] = {*a, *b};
  for (int i = 0; i < 2; i++) {
    if (w[i].data.dtype == TW_F32) continue;
    void *p = NULL;
    TW_TRY(gpu_scratch(ctx, (size_t)tw_tensor_numel(&w[i].data) * sizeof(float), &p));
    tw_tensor wide = w[i].data;
    wide.data = p;
    wide.dtype = TW_F32;
    TW_TRY(gpu_cast(ctx, &wide, &w[i].data, 0));
    w[i].data = wide;
  }
  if (!accumulate || out->dtype == TW_F32) return dense_lt(ctx, &w[0], op_a, &w[1], op_b, out, accumulate, d);
  const int64_t n = d->batch * d->M * d->N;
  void *t = NULL;
  TW_TRY(gpu_scratch(ctx, (size_t)n * sizeof(float), &t));
  tw_tensor tt = *out;
  tt.data = t;
  tt.dtype = TW_F32;
  TW_TRY(dense_lt(ctx, &w[0], op_a, &w[1], op_b, &tt, 0, d));
  int64_t blocks = (n + 255) / 256, cap = 16 * (int64_t)st->num_sms;
  add_round_kernel<<<(unsigned)(blocks < cap ? blocks : cap), 256, 0, st->stream>>>(out->data, out->dtype == TW_F16,
                                                                                     (const float *)t, n);
  GPU_TRY_CUDA(cudaGetLastError(), "gemm: add_round launch");
  return TW_OK;
}

tw_status gpu_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                   tw_tensor *out, int accumulate) {
  gpu_state *st = gpu_of(ctx);
  dense_dims d = dims_of(a, op_a, b, op_b);
  if (d.batch == 0 || d.M == 0 || d.N == 0) return TW_OK;
  gpu_scratch_reset(ctx);
  const char *k = tw_ctx_kernel(ctx);
  if (k && (strcmp(k, GG_KERNEL_MMA) == 0 || strcmp(k, GG_KERNEL_MMA_WIDE) == 0)) {
    if (compute_for(a, b, 0) == GG_FMA_F32)
      return tw_error(TW_ERR_UNSUPPORTED, "gemm: kernel '%s' takes bf16, f16 or fp8 operands, not %s x %s",
                      k, tw_dtype_name(a->data.dtype), tw_dtype_name(b->data.dtype));
    return dense_gg(ctx, a, op_a, b, op_b, out, accumulate, &d, strcmp(k, GG_KERNEL_MMA) == 0 ? 0 : 2);
  }
  if (k && strcmp(k, GG_KERNEL_FMA) == 0) return dense_gg(ctx, a, op_a, b, op_b, out, accumulate, &d, 1);
  const char *why = NULL;
  if (k && strcmp(k, GG_KERNEL_WGMMA_FP8) == 0) {
    if (!dense_wgmma_fp8_takes(ctx, a, op_a, b, op_b, out, &d, &why))
      return tw_error(TW_ERR_UNSUPPORTED, "gemm: kernel '%s' %s", k, why);
    return dense_wgmma_fp8(ctx, a, b, out, accumulate, &d);
  }
  if (k && strcmp(k, GEMM_KERNEL_LT) == 0) {
    if (!lt_eligible(st, a, op_a, b, op_b, out, &d))
      return tw_error(TW_ERR_UNSUPPORTED,
                      "gemm: kernel '%s' (cuBLASLt %d, sm_%d) does not take %s %s x %s op %c%c M=%lld N=%lld K=%lld "
                      "(see gpu_gemm_alignment's rules)",
                      k, CUBLAS_VERSION, st->sm, tw_scaling_name(a->mode), tw_dtype_name(a->data.dtype),
                      tw_dtype_name(b->data.dtype), op_a == TW_OP_N ? 'N' : 'T', op_b == TW_OP_N ? 'N' : 'T',
                      (long long)d.M, (long long)d.N, (long long)d.K);
    return dense_lt(ctx, a, op_a, b, op_b, out, accumulate, &d);
  }
  // accumulate into a 16-bit output: the contract is one f32 add of the old value, then one
  // rounding; cuBLASLt's epilogue was seen (fuzzer, H200) to round the product first, so those
  // calls take the gg kernel, whose epilogue does exactly that.
  const int lt_exact_epilogue = !accumulate || out->dtype == TW_F32;
  if (a->mode == TW_SCALE_NONE && lt_exact_epilogue && lt_eligible(st, a, op_a, b, op_b, out, &d)) {
    tw_status s = dense_lt(ctx, a, op_a, b, op_b, out, accumulate, &d);
    if (s != TW_ERR_UNSUPPORTED) return s;
    tw_clear_error();  // no cuBLASLt algorithm: the gg kernel takes it
    gpu_scratch_reset(ctx);
  }
  const int widen = a->mode == TW_SCALE_NONE && b->mode == TW_SCALE_NONE && a->data.dtype != b->data.dtype &&
                    d.K > 0 && (out->dtype == TW_F32 || out->dtype == TW_BF16 || out->dtype == TW_F16);
  if (widen) {
    tw_status s = dense_lt_widened(ctx, a, op_a, b, op_b, out, accumulate, &d);
    if (s != TW_ERR_UNSUPPORTED) return s;
    tw_clear_error();
    gpu_scratch_reset(ctx);
  }
  // fp8: the promoted model where gg_wgmma_fp8 takes it (5.7-7x gg_mma_wide, NOTES-gemm.md)
  if (dense_wgmma_fp8_takes(ctx, a, op_a, b, op_b, out, &d, &why)) return dense_wgmma_fp8(ctx, a, b, out, accumulate, &d);
  // the gg fallback: the wide tile where it fits (gg_mma_wide measured 1.3-1.8x gg_mma, NOTES-gemm.md run 6)
  return dense_gg(ctx, a, op_a, b, op_b, out, accumulate, &d, gg_wide_fits(ctx) ? 2 : 0);
}
