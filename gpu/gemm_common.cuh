// gpu/gemm_common.cuh — internal to gpu/gemm.cu and gpu/grouped_gemm.cu: the problem
// description of twin's own tensor-core GEMM kernel ("gg", gpu/grouped_gemm.cu) and the
// cuBLASLt call (gpu/gemm.cu) that both files use.
//
// One kernel serves every grouped and dense case the cuBLASLt path does not. Per group g it
// computes the logical product
//   C_g [P_g, Q] = A_g [P_g, R_g] @ B_g [R_g, Q]       (f32 accumulation)
// where, with o_g the device prefix offsets and m_g = o_{g+1} - o_g:
//   GG_FWD_RAGGED: P_g = m_g (rows of lhs/out from o_g), R = K, Q = N
//   GG_WGRAD:      P = K, R_g = m_g (the ragged contracting dim), Q = N, out[g] = [K, N]
//   GG_UNIFORM:    P, R, Q fixed; G is the batch of a dense (batched) GEMM
// Each operand is a strided view: element (x, k) (x = row of A / col of B, k = contracting)
// lives at base_g + (kmajor ? x*ld + k : k*ld + x), base_g = o_g*row_elems (ragged) or
// g*group_stride (uniform, 0 = broadcast), ld fixed or = m_g (per-group transposed blocks).
#ifndef TWIN_GPU_GEMM_COMMON_CUH
#define TWIN_GPU_GEMM_COMMON_CUH

#include <cublasLt.h>

#include "gpu/gpu.h"

enum gg_kind { GG_FWD_RAGGED = 0, GG_WGRAD = 1, GG_UNIFORM = 2 };

// Which inner loop: tensor-core mma.sync on bf16 / f16 straight from the cp.async stage, fp8
// decoded exactly to bf16 in shared memory then mma.sync, or exact f32 FMA on CUDA cores.
enum gg_compute { GG_MMA_BF16 = 0, GG_MMA_F16 = 1, GG_MMA_FP8 = 2, GG_FMA_F32 = 3 };

typedef struct {
  const void *ptr;
  int dtype;             // tw_dtype of the data
  int kmajor;            // 1: the contracting index is the contiguous one
  int ragged;            // base = o_g * row_elems, else g * group_stride
  int padded;            // token-padded colwise copy (tw_quantize.h): base = 128 * T(g), ld = its pitch
  int64_t row_elems;
  int64_t group_stride;
  int64_t ld;            // 0: ld = m_g
  // scaling (tw_quantize.h layouts), addressed in source coordinates (r, c)
  int smode;             // tw_scaling
  const void *scale;     // scale_inv
  int64_t scale_ld;      // last dim of scale_inv
  int transposed;        // data is the per-group transposed colwise copy: (x,k) storage (i,j) = source (o+j, i)
  int colwise;           // scale orientation
  int swizzled;          // MXFP8 byte order
  int64_t src_rows;      // R of the source
  int64_t src_group_rows;// uniform groups: rows per group of the source (0 = ragged)
  // row-gathered lhs (tw_grouped_gemm_rows / _wgrad_rows; operand A only): storage row o_g + i
  // (the forward's x, kmajor; the wgrad's token, the contracting index) reads data row
  // rows[o_g + i] of a [gather_rows, K] source quantized as one group (-1 or an entry outside
  // [0, gather_rows): zeros; such an entry was reported by gg_check_rows)
  const int32_t *rows;
  int64_t gather_rows;
} gg_operand;

typedef struct {
  int kind;              // gg_kind
  int compute;           // gg_compute
  int wide;              // bf16/f16: 128x256 CTA tiles (kernel version 3, gg_mma_wide)
  int64_t G;
  int64_t P, Q, R;       // fixed dims (P unused for FWD_RAGGED, R unused for WGRAD)
  gg_operand a, b;
  void *out;
  int out_dtype;
  int accumulate;
  int64_t out_group_stride;    // WGRAD / UNIFORM: elements between groups' outputs
  const int64_t *offsets;      // device [G+1] (ragged kinds)
  const int64_t *tiles;        // device [G+1] 128-row tile offsets T(g) (ragged kinds)
} gg_problem;

// Launches the kernel on ctx's stream (no host sync); scratch must be reset by the caller.
tw_status gg_run(tw_ctx *ctx, const gg_problem *p, const char *op);
int gg_wide_fits(tw_ctx *ctx);  // gg_mma_wide's shared memory fits this device

// Kernel version 4 (gg_wgmma, gpu/grouped_gemm_wgmma.cu): Hopper forward, ragged M.
// gg_wgmma_takes: 1 if it takes the problem, else 0 and *why (a phrase after its name).
int gg_wgmma_takes(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op, const tw_tensor *out,
                   const char **why);
// offsets: device [G+1] from gpu_group_prefix. TW_ERR_UNSUPPORTED naming it when it declines.
tw_status gg_wgmma_forward(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                           const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate, const char *op);

// gg_wgmma with a row-gathered lhs [U, K] (tw_grouped_gemm_rows): rows device [out rows]; the
// producer warpgroup loads A rows itself (TMA cannot gather on Hopper).
tw_status gg_wgmma_forward_rows(tw_ctx *ctx, const tw_operand *lhs, const int32_t *rows, const tw_operand *rhs,
                                tw_op rhs_op, const int64_t *offsets, int64_t G, tw_tensor *out, int accumulate,
                                const char *op);

// Kernel version 5 (gg_wgmma_fp8, gpu/grouped_gemm_wgmma_fp8.cu): Hopper fp8 forward, ragged M,
// block scales promoted every 128 along K. tiles: device [G+1] 128-row tile offsets T(g).
int gg_wgmma_fp8_takes(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                       const tw_tensor *out, const char **why);
tw_status gg_wgmma_fp8_forward(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                               const int64_t *offsets, const int64_t *tiles, int64_t G, tw_tensor *out,
                               int accumulate, const char *op);

// gg_wgmma_fp8's wgrad: lhs and rhs as the per-group transposed colwise copies (ops T),
// out [G, K, N]; tiles: device [G+1] 128-row tile offsets T(g) of the groups.
int gg_wgmma_fp8_wgrad_takes(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                             const tw_tensor *out, const char **why);
tw_status gg_wgmma_fp8_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op, const tw_operand *rhs, tw_op rhs_op,
                             const int64_t *offsets, const int64_t *tiles, int64_t G, tw_tensor *out, int accumulate,
                             const char *op);

// Fills a gg_operand from a tw_operand (data pointer, dtype, scales); the caller sets the
// addressing (kmajor, ragged, row_elems, group_stride, ld, src_group_rows).
void gg_operand_from(gg_operand *o, const tw_operand *t);

// One cuBLASLt matmul in row-major terms: out[b] (M x N) = op(a[b]) @ op(b[b]) (+ out).
// Operands as stored row-major with leading dims; batch strides in elements (0 = broadcast).
// Scales: NULL or device f32 scale_inv (per-tensor), or the 1x128 block layout (block128 = 1).
typedef struct {
  const void *a; int a_dtype; tw_op op_a; int64_t lda; int64_t stride_a;
  const void *b; int b_dtype; tw_op op_b; int64_t ldb; int64_t stride_b;
  void *out; int out_dtype; int64_t ldo; int64_t stride_out;
  int64_t M, N, K, batch;
  const float *a_scale, *b_scale;
  int block128;
  int accumulate;
} gemm_lt_args;

// TW_ERR_UNSUPPORTED (message set, nothing enqueued) when cuBLASLt has no algorithm for it.
tw_status gemm_lt(tw_ctx *ctx, const gemm_lt_args *x, const char *op);

// The version names tw_ctx_kernel() may force (gpu/NOTES-gemm.md).
#define GG_KERNEL_MMA "gg_mma"
#define GG_KERNEL_MMA_WIDE "gg_mma_wide"
#define GG_KERNEL_FMA "gg_fma"
#define GG_KERNEL_LT_LOOP "gg_lt_loop"
#define GG_KERNEL_WGMMA "gg_wgmma"
#define GG_KERNEL_WGMMA_FP8 "gg_wgmma_fp8"
#define GEMM_KERNEL_LT "gemm_lt"

#endif
