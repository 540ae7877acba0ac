/* Every validation error of tw_gemm, tw_grouped_gemm and tw_grouped_gemm_wgrad: the status
 * and a piece of the message that carries the offending values. Each test starts from a
 * valid call (checked to succeed) and breaks one thing. */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_gemm.h"

static tw_ctx *ctx;
static void setup(void) {
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
}
static void teardown(void) { tw_ctx_destroy(ctx); }

TestSuite(gemm_errors, .init = setup, .fini = teardown);

#define EXPECT_ERR(call, status, text) tt_expect_status((call), (status), (text))
#define EXPECT_OK(call) tt_expect_status((call), TW_OK, NULL)

/* Backing store big enough for every tensor below; values are irrelevant to validation but
 * the valid calls run, so keep them finite. */
static float buf_a[4096], buf_b[4096], buf_o[4096];

/* ---- dense ------------------------------------------------------------------------------ */

typedef struct {
  tw_tensor ta, tb, to;
  tw_operand a, b;
} dense_args;

/* a [5, 7] N, b [7, 3] N, out [5, 3] f32 */
static dense_args dense(void) {
  dense_args d;
  d.ta = tw_tensor_2d(buf_a, TW_F32, 5, 7, TW_MEM_HOST);
  d.tb = tw_tensor_2d(buf_b, TW_F32, 7, 3, TW_MEM_HOST);
  d.to = tw_tensor_2d(buf_o, TW_F32, 5, 3, TW_MEM_HOST);
  d.a = tw_operand_plain(&d.ta);
  d.b = tw_operand_plain(&d.tb);
  return d;
}
#define GEMM(d, oa, ob) tw_gemm(ctx, &(d).a, (oa), &(d).b, (ob), &(d).to, 0)

Test(gemm_errors, dense_valid_baseline) {
  dense_args d = dense();
  EXPECT_OK(GEMM(d, TW_OP_N, TW_OP_N));
}

Test(gemm_errors, dense_null_pointers) {
  dense_args d = dense();
  EXPECT_ERR(tw_gemm(NULL, &d.a, TW_OP_N, &d.b, TW_OP_N, &d.to, 0), TW_ERR_NULL, "gemm: ctx is NULL");
  EXPECT_ERR(tw_gemm(ctx, NULL, TW_OP_N, &d.b, TW_OP_N, &d.to, 0), TW_ERR_NULL, "gemm: a is NULL");
  EXPECT_ERR(tw_gemm(ctx, &d.a, TW_OP_N, NULL, TW_OP_N, &d.to, 0), TW_ERR_NULL, "gemm: b is NULL");
  EXPECT_ERR(tw_gemm(ctx, &d.a, TW_OP_N, &d.b, TW_OP_N, NULL, 0), TW_ERR_NULL, "gemm: out is NULL");
  d.a.data.data = NULL;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_NULL, "gemm: a data is NULL");
  d = dense();
  d.to.data = NULL;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_NULL, "gemm: out data is NULL");
}

Test(gemm_errors, dense_bad_op_enum) {
  dense_args d = dense();
  EXPECT_ERR(GEMM(d, (tw_op)2, TW_OP_N), TW_ERR_INVALID_ARG, "op_a is 2, not N(0) or T(1)");
  EXPECT_ERR(GEMM(d, TW_OP_N, (tw_op)-1), TW_ERR_INVALID_ARG, "op_b is -1");
}

Test(gemm_errors, dense_k_mismatch) {
  dense_args d = dense();
  d.tb.shape[0] = 6;
  d.b = tw_operand_plain(&d.tb);
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_SHAPE,
             "contracting dims differ: op(a) is [5, 7], op(b) is [6, 3]");
  d = dense(); /* op_a T turns a [5, 7] into [7, 5]: K 5 vs 7 */
  EXPECT_ERR(GEMM(d, TW_OP_T, TW_OP_N), TW_ERR_SHAPE, "op(a) is [7, 5], op(b) is [7, 3]");
}

Test(gemm_errors, dense_rank) {
  dense_args d = dense();
  d.a.data = tw_tensor_1d(buf_a, TW_F32, 35, TW_MEM_HOST);
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "operands must be 2-D or 3-D, got a 1-D and b 2-D");
}

Test(gemm_errors, dense_batch_mismatch) {
  dense_args d = dense();
  d.a.data = tw_tensor_3d(buf_a, TW_F32, 3, 5, 7, TW_MEM_HOST);
  d.b.data = tw_tensor_3d(buf_b, TW_F32, 2, 7, 3, TW_MEM_HOST);
  d.to = tw_tensor_3d(buf_o, TW_F32, 3, 5, 3, TW_MEM_HOST);
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "batch sizes differ: a has 3, b has 2");
  d.b.data.shape[0] = 3;
  EXPECT_OK(GEMM(d, TW_OP_N, TW_OP_N));
  d.to = tw_tensor_2d(buf_o, TW_F32, 5, 3, TW_MEM_HOST);
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "out must have 3 dims, has 2");
}

Test(gemm_errors, dense_out_shape_and_dtype) {
  dense_args d = dense();
  d.to.shape[1] = 4;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "out is [5, 4] f32, expected [5, 3] f32");
  d = dense();
  d.to.dtype = TW_E4M3;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "out has dtype e4m3, expected one of {f32, bf16, f16}");
  d.to.dtype = TW_F64;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "out has dtype f64");
}

Test(gemm_errors, dense_plain_dtype_pairs) {
  dense_args d = dense();
  d.a.data.dtype = TW_BF16;
  d.b.data.dtype = TW_F16;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "operand dtypes bf16 and f16 differ");
  d.b.data.dtype = TW_F32; /* f32 with anything is widened */
  EXPECT_OK(GEMM(d, TW_OP_N, TW_OP_N));
  d.a.data.dtype = TW_E4M3; /* fp8 data needs a scaling mode */
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "a has dtype e4m3, expected one of {f32, bf16, f16}");
  d.a.data.dtype = TW_I32;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "a has dtype i32");
}

Test(gemm_errors, dense_wrong_memory) {
  dense_args d = dense();
  d.b.data.mem = TW_MEM_DEVICE;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_MEMORY, "b lives in device memory, this context needs host memory");
  d = dense();
  d.to.mem = TW_MEM_DEVICE;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_MEMORY, "out lives in device memory");
}

Test(gemm_errors, dense_negative_dim) {
  dense_args d = dense();
  d.a.data.shape[0] = -5;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "a dim 0 is -5 (negative)");
}

Test(gemm_errors, dense_out_aliases_input) {
  dense_args d = dense();
  d.to.data = buf_a + 3; /* overlaps a's 35 floats */
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "gemm: out overlaps a");
  d.to.data = buf_b;
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "gemm: out overlaps b");
  d.to.data = buf_a + 35; /* right after a: fine */
  EXPECT_OK(GEMM(d, TW_OP_N, TW_OP_N));
}

Test(gemm_errors, dense_sizes_past_blas_int) {
  /* M = 2^31 rows of K = 0: nothing to read, but OpenBLAS takes 32-bit sizes */
  dense_args d = dense();
  int64_t big = (int64_t)INT_MAX + 1;
  d.a.data = tw_tensor_2d(NULL, TW_F32, big, 0, TW_MEM_HOST);
  d.b.data = tw_tensor_2d(NULL, TW_F32, 0, 3, TW_MEM_HOST);
  d.to = tw_tensor_2d(buf_o, TW_F32, big, 3, TW_MEM_HOST); /* never touched */
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_UNSUPPORTED, "M = 2147483648 exceeds the ref backend's OpenBLAS int range");
}

/* ---- quantized operands ----------------------------------------------------------------- */

/* A quantized tensor of shape [rows, cols] with both orientations, zero-filled buffers. */
typedef struct {
  tw_qtensor q;
  void *mem[4];
} qbuf;

static qbuf make_q(tw_scaling mode, tw_dtype qdtype, int64_t rows, int64_t cols, int64_t groups) {
  qbuf b;
  memset(&b, 0, sizeof b);
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.qdtype = qdtype;
  o.layout = TW_ROWWISE_COLWISE;
  EXPECT_OK(tw_quantize_output_shapes(&o, rows, cols, groups, &b.q));
  tw_tensor *ts[4] = {&b.q.row_data, &b.q.row_scale_inv, &b.q.col_data, &b.q.col_scale_inv};
  for (int i = 0; i < 4; i++) {
    if (tw_tensor_is_none(ts[i])) continue;
    if (i == 3 && (mode == TW_SCALE_TENSOR_CURRENT || mode == TW_SCALE_TENSOR_DELAYED)) {
      ts[3]->data = ts[1]->data; /* one shared [G] buffer */
      continue;
    }
    b.mem[i] = calloc(tw_tensor_bytes(ts[i]) + 1, 1);
    ts[i]->data = b.mem[i];
    ts[i]->mem = TW_MEM_HOST;
  }
  b.q.amax = tw_tensor_none();
  return b;
}

static void free_q(qbuf *b) {
  for (int i = 0; i < 4; i++) free(b->mem[i]);
}

Test(gemm_errors, quantized_mixed_with_plain) {
  dense_args d = dense();
  qbuf qa = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 5, 7, 1);
  d.a = tw_operand_rowwise(&qa.q);
  EXPECT_ERR(GEMM(d, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG,
             "one operand is quantized (current) and the other is not (none)");
  free_q(&qa);
}

Test(gemm_errors, quantized_e5m2_pair) {
  qbuf qa = make_q(TW_SCALE_TENSOR_CURRENT, TW_E5M2, 5, 7, 1);
  qbuf qb = make_q(TW_SCALE_TENSOR_CURRENT, TW_E5M2, 3, 7, 1); /* b source [N, K], op T */
  tw_operand a = tw_operand_rowwise(&qa.q), b = tw_operand_rowwise(&qb.q);
  tw_tensor out = tw_tensor_2d(buf_o, TW_BF16, 5, 3, TW_MEM_HOST);
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_DTYPE,
             "e5m2 x e5m2 is not a supported fp8 pair");
  free_q(&qa);
  free_q(&qb);
}

Test(gemm_errors, quantized_mode_mismatch) {
  qbuf qa = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 5, 64, 1);
  qbuf qb = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 3, 64, 1);
  tw_operand a = tw_operand_rowwise(&qa.q), b = tw_operand_rowwise(&qb.q);
  tw_tensor out = tw_tensor_2d(buf_o, TW_F32, 5, 3, TW_MEM_HOST);
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_INVALID_ARG,
             "operands use different scaling modes (current, mxfp8)");
  free_q(&qa);
  free_q(&qb);
}

Test(gemm_errors, quantized_blocks_along_wrong_dim) {
  /* MXFP8 rowwise blocks run along the source's columns; with op_a = T those are M */
  qbuf qa = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 64, 32, 1); /* a stored [64, 32], op T: [32, 64] */
  qbuf qb = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 64, 16, 1); /* b source [K=64, N=16] */
  tw_operand a = tw_operand_rowwise(&qa.q), b = tw_operand_colwise(&qb.q);
  tw_tensor out = tw_tensor_2d(buf_o, TW_F32, 32, 16, TW_MEM_HOST);
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_T, &b, TW_OP_N, &out, 0), TW_ERR_INVALID_ARG,
             "a's mxfp8 scaling blocks run along its last storage dim, but the contracting dim is its first; pass the colwise orientation");
  /* b rowwise: blocks along N, but b's contracting dim (K) is its first */
  qbuf qa2 = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 32, 64, 1);
  a = tw_operand_rowwise(&qa2.q);
  b = tw_operand_rowwise(&qb.q);
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_N, &out, 0), TW_ERR_INVALID_ARG,
             "b's mxfp8 scaling blocks run along its last storage dim");
  free_q(&qa);
  free_q(&qb);
  free_q(&qa2);
}

Test(gemm_errors, quantized_scale_inv_shape_and_dtype) {
  qbuf qa = make_q(TW_SCALE_BLOCK_1x128, TW_E4M3, 5, 130, 1);
  qbuf qb = make_q(TW_SCALE_BLOCK_1x128, TW_E4M3, 3, 130, 1);
  tw_operand a = tw_operand_rowwise(&qa.q), b = tw_operand_rowwise(&qb.q);
  tw_tensor out = tw_tensor_2d(buf_o, TW_F32, 5, 3, TW_MEM_HOST);
  a.scale_inv.shape[1] = 4; /* expected [2, 8] */
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_SHAPE,
             "a scale_inv is [2, 4] f32, expected [2, 8] f32");
  a = tw_operand_rowwise(&qa.q);
  a.scale_inv.dtype = TW_E8M0;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_DTYPE,
             "a scale_inv has dtype e8m0, expected f32");
  a = tw_operand_rowwise(&qa.q);
  a.scale_inv = tw_tensor_none();
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_INVALID_ARG,
             "a scale_inv is required but none was given");
  free_q(&qa);
  free_q(&qb);
}

Test(gemm_errors, quantized_data_inconsistent) {
  qbuf qa = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 5, 7, 1);
  qbuf qb = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 3, 7, 1);
  tw_operand a = tw_operand_rowwise(&qa.q), b = tw_operand_rowwise(&qb.q);
  tw_tensor out = tw_tensor_2d(buf_o, TW_F32, 5, 3, TW_MEM_HOST);
  a.data.dtype = TW_BF16;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_DTYPE,
             "a is quantized (current) but its data is bf16, not e4m3/e5m2");
  a = tw_operand_rowwise(&qa.q);
  a.src_cols = 6;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_SHAPE,
             "a data has 35 elements but its source is [5, 6]");
  a = tw_operand_rowwise(&qa.q);
  a.data.shape[0] = 7; /* [7, 5]: same count, not the rowwise storage [5, 7] */
  a.data.shape[1] = 5;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_SHAPE,
             "a's data is [7, 5] but its rowwise orientation stores [5, 7]");
  a = tw_operand_rowwise(&qa.q);
  a.mode = (tw_scaling)42;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_INVALID_ARG,
             "a has unknown scaling mode 42");
  a = tw_operand_rowwise(&qa.q);
  a.data = tw_tensor_3d(a.data.data, TW_E4M3, 1, 5, 7, TW_MEM_HOST);
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_SHAPE,
             "quantized operands must be 2-D");
  a = tw_operand_rowwise(&qa.q);
  out.data = a.scale_inv.data;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &out, 0), TW_ERR_INVALID_ARG,
             "out overlaps a's scale_inv");
  free_q(&qa);
  free_q(&qb);
}

/* ---- grouped forward -------------------------------------------------------------------- */

static int32_t gs3[3] = {2, 0, 3};

typedef struct {
  tw_tensor tl, tr, tg, to;
  tw_operand l, r;
} grouped_args;

/* lhs [6, 4], rhs [3, 4, 5] (N), group_sizes {2, 0, 3} (tail row 5), out [6, 5] */
static grouped_args grouped(void) {
  grouped_args g;
  gs3[0] = 2, gs3[1] = 0, gs3[2] = 3;
  g.tl = tw_tensor_2d(buf_a, TW_F32, 6, 4, TW_MEM_HOST);
  g.tr = tw_tensor_3d(buf_b, TW_F32, 3, 4, 5, TW_MEM_HOST);
  g.tg = tw_tensor_1d(gs3, TW_I32, 3, TW_MEM_HOST);
  g.to = tw_tensor_2d(buf_o, TW_F32, 6, 5, TW_MEM_HOST);
  g.l = tw_operand_plain(&g.tl);
  g.r = tw_operand_plain(&g.tr);
  return g;
}
#define GROUPED(g, op) tw_grouped_gemm(ctx, &(g).l, &(g).r, (op), &(g).tg, &(g).to, 0)

Test(gemm_errors, grouped_valid_baseline) {
  grouped_args g = grouped();
  EXPECT_OK(GROUPED(g, TW_OP_N));
  g.r.data = tw_tensor_3d(buf_b, TW_F32, 3, 5, 4, TW_MEM_HOST);
  EXPECT_OK(GROUPED(g, TW_OP_T));
}

Test(gemm_errors, grouped_nulls_and_op) {
  grouped_args g = grouped();
  EXPECT_ERR(tw_grouped_gemm(NULL, &g.l, &g.r, TW_OP_N, &g.tg, &g.to, 0), TW_ERR_NULL, "ctx is NULL");
  EXPECT_ERR(tw_grouped_gemm(ctx, NULL, &g.r, TW_OP_N, &g.tg, &g.to, 0), TW_ERR_NULL, "grouped_gemm: lhs is NULL");
  EXPECT_ERR(tw_grouped_gemm(ctx, &g.l, NULL, TW_OP_N, &g.tg, &g.to, 0), TW_ERR_NULL, "grouped_gemm: rhs is NULL");
  EXPECT_ERR(tw_grouped_gemm(ctx, &g.l, &g.r, TW_OP_N, NULL, &g.to, 0), TW_ERR_NULL, "group_sizes is NULL");
  EXPECT_ERR(tw_grouped_gemm(ctx, &g.l, &g.r, TW_OP_N, &g.tg, NULL, 0), TW_ERR_NULL, "out is NULL");
  EXPECT_ERR(GROUPED(g, (tw_op)3), TW_ERR_INVALID_ARG, "rhs_op is 3");
  g.tg.data = NULL;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_NULL, "group_sizes data is NULL");
}

Test(gemm_errors, grouped_group_sizes) {
  grouped_args g = grouped();
  gs3[1] = -3;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "group_sizes[1] = -3 is negative");
  gs3[1] = 2; /* 2 + 2 + 3 = 7 > 6 */
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "group_sizes sum to 7 but lhs has 6 rows");
  g = grouped();
  g.tg.shape[0] = 0;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "group_sizes is empty (G = 0)");
  g = grouped();
  g.tg.dtype = TW_I64;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_DTYPE, "group_sizes must be i32, got i64");
  g = grouped();
  g.tg.mem = TW_MEM_DEVICE;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_MEMORY, "group_sizes lives in device memory");
  g = grouped();
  g.tg = tw_tensor_2d(gs3, TW_I32, 1, 3, TW_MEM_HOST);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "group_sizes must have 1 dims, has 2");
}

Test(gemm_errors, grouped_shapes) {
  grouped_args g = grouped();
  g.r.data.shape[0] = 4;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "rhs has 4 groups but group_sizes has 3");
  g = grouped();
  g.r.data.shape[1] = 6; /* [3, 6, 5]: K 6 */
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "lhs has K = 4 but rhs ([G, K, N]) has K = 6");
  g = grouped(); /* the same [3, 4, 5] read as [G, N, K] has K = 5 */
  EXPECT_ERR(GROUPED(g, TW_OP_T), TW_ERR_SHAPE, "lhs has K = 4 but rhs ([G, N, K]) has K = 5");
  g = grouped();
  g.r.data = tw_tensor_2d(buf_b, TW_F32, 4, 5, TW_MEM_HOST);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "rhs must be 3-D [G, K, N] or [G, N, K], has 2 dims");
  g = grouped();
  g.l.data = tw_tensor_3d(buf_a, TW_F32, 1, 6, 4, TW_MEM_HOST);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "lhs must be 2-D [M, K], has 3 dims");
  g = grouped();
  g.to.shape[0] = 5; /* out rows must be M, even past the groups */
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "out is [5, 5] f32, expected [6, 5] f32");
  g = grouped();
  g.to.dtype = TW_E5M2;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_DTYPE, "out has dtype e5m2");
}

Test(gemm_errors, grouped_dtypes_and_alias) {
  grouped_args g = grouped();
  g.l.data.dtype = TW_F16;
  g.r.data.dtype = TW_BF16;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_DTYPE, "grouped_gemm: operand dtypes f16 and bf16 differ");
  g = grouped();
  g.to.data = buf_b + 10;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "grouped_gemm: out overlaps rhs");
  g = grouped();
  g.l.data.mem = TW_MEM_DEVICE;
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_MEMORY, "lhs lives in device memory");
}

Test(gemm_errors, grouped_quantized) {
  grouped_args g = grouped();
  qbuf ql = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 6, 64, 3);
  qbuf qr = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 3 * 64 + 1, 5, 1);
  g.l = tw_operand_rowwise(&ql.q);
  g.r = tw_operand_colwise(&qr.q);
  g.to = tw_tensor_2d(buf_o, TW_BF16, 6, 5, TW_MEM_HOST);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "rhs source has 193 rows, not divisible into 3 equal groups");
  free_q(&qr);
  qr = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 3 * 64, 5, 1); /* scales laid out for 1 group, not 3 */
  g.r = tw_operand_colwise(&qr.q);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "rhs scale_inv is [8, 128] e8m0, expected [16, 128] e8m0");
  free_q(&qr);
  qr = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 3 * 64, 5, 3); /* uniform [G*K, N] */
  g.r = tw_operand_colwise(&qr.q); /* blocks along K: right for op N */
  EXPECT_OK(GROUPED(g, TW_OP_N));
  g.r = tw_operand_rowwise(&qr.q); /* blocks along N */
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "rhs's mxfp8 scaling blocks run along its last storage dim, but the contracting dim is its first");
  g.r = tw_operand_colwise(&qr.q);
  g.l = tw_operand_colwise(&ql.q);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "a quantized lhs must be the rowwise data of an [M, K] = [6, 64] source");
  g.l = tw_operand_rowwise(&ql.q);
  g.r = tw_operand_plain(&g.tr);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_INVALID_ARG, "one operand is quantized (mxfp8) and the other is not (none)");
  free_q(&ql);
  free_q(&qr);
}

/* ---- grouped wgrad ---------------------------------------------------------------------- */

typedef struct {
  tw_tensor tl, tr, tg, to;
  tw_operand l, r;
} wgrad_args;

/* lhs [6, 4], rhs [6, 5], group_sizes {2, 0, 3} (tail row 5), out [3, 4, 5] */
static wgrad_args wgrad(void) {
  wgrad_args w;
  gs3[0] = 2, gs3[1] = 0, gs3[2] = 3;
  w.tl = tw_tensor_2d(buf_a, TW_F32, 6, 4, TW_MEM_HOST);
  w.tr = tw_tensor_2d(buf_b, TW_F32, 6, 5, TW_MEM_HOST);
  w.tg = tw_tensor_1d(gs3, TW_I32, 3, TW_MEM_HOST);
  w.to = tw_tensor_3d(buf_o, TW_F32, 3, 4, 5, TW_MEM_HOST);
  w.l = tw_operand_plain(&w.tl);
  w.r = tw_operand_plain(&w.tr);
  return w;
}
#define WGRAD(w, lo, ro) tw_grouped_gemm_wgrad(ctx, &(w).l, (lo), &(w).r, (ro), &(w).tg, &(w).to, 0)

Test(gemm_errors, wgrad_valid_baseline) {
  wgrad_args w = wgrad();
  EXPECT_OK(WGRAD(w, TW_OP_N, TW_OP_N));
  w.l.data = tw_tensor_2d(buf_a, TW_F32, 4, 6, TW_MEM_HOST); /* per-group transposed [K, M] */
  w.r.data = tw_tensor_2d(buf_b, TW_F32, 5, 6, TW_MEM_HOST);
  EXPECT_OK(WGRAD(w, TW_OP_T, TW_OP_T));
}

Test(gemm_errors, wgrad_nulls_and_ops) {
  wgrad_args w = wgrad();
  EXPECT_ERR(tw_grouped_gemm_wgrad(NULL, &w.l, TW_OP_N, &w.r, TW_OP_N, &w.tg, &w.to, 0), TW_ERR_NULL, "ctx is NULL");
  EXPECT_ERR(tw_grouped_gemm_wgrad(ctx, NULL, TW_OP_N, &w.r, TW_OP_N, &w.tg, &w.to, 0), TW_ERR_NULL, "grouped_gemm_wgrad: lhs is NULL");
  EXPECT_ERR(tw_grouped_gemm_wgrad(ctx, &w.l, TW_OP_N, NULL, TW_OP_N, &w.tg, &w.to, 0), TW_ERR_NULL, "grouped_gemm_wgrad: rhs is NULL");
  EXPECT_ERR(tw_grouped_gemm_wgrad(ctx, &w.l, TW_OP_N, &w.r, TW_OP_N, NULL, &w.to, 0), TW_ERR_NULL, "group_sizes is NULL");
  EXPECT_ERR(tw_grouped_gemm_wgrad(ctx, &w.l, TW_OP_N, &w.r, TW_OP_N, &w.tg, NULL, 0), TW_ERR_NULL, "out is NULL");
  EXPECT_ERR(WGRAD(w, (tw_op)7, TW_OP_N), TW_ERR_INVALID_ARG, "lhs_op is 7");
  EXPECT_ERR(WGRAD(w, TW_OP_N, (tw_op)7), TW_ERR_INVALID_ARG, "rhs_op is 7");
  w.r.data.data = NULL;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_NULL, "rhs data is NULL");
}

Test(gemm_errors, wgrad_shapes) {
  wgrad_args w = wgrad();
  w.r.data.shape[0] = 7;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "lhs has 6 rows but rhs has 7");
  w = wgrad(); /* rhs [6, 5] read as per-group transposed [N, M] has M = 5 */
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_T), TW_ERR_SHAPE, "lhs has 6 rows but rhs has 5");
  w = wgrad();
  w.to.shape[0] = 2; /* one [K, N] per group */
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "out is [2, 4, 5] f32, expected [3, 4, 5] f32");
  w = wgrad();
  w.to = tw_tensor_3d(buf_o, TW_F32, 3, 5, 4, TW_MEM_HOST);
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "out is [3, 5, 4] f32, expected [3, 4, 5] f32");
  w = wgrad();
  w.l.data = tw_tensor_1d(buf_a, TW_F32, 24, TW_MEM_HOST);
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "lhs and rhs must be 2-D");
  w = wgrad();
  w.l.data.shape[1] = -4;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "lhs dim 1 is -4 (negative)");
  w = wgrad();
  w.to.dtype = TW_E4M3;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "out has dtype e4m3");
}

Test(gemm_errors, wgrad_group_sizes) {
  wgrad_args w = wgrad();
  gs3[2] = 5; /* 2 + 0 + 5 = 7 > 6 */
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "group_sizes sum to 7 but lhs has 6 rows");
  gs3[2] = -1;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "group_sizes[2] = -1 is negative");
  w = wgrad();
  w.tg.shape[0] = 0;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "G = 0");
  w = wgrad();
  w.tg.shape[0] = 2; /* G from group_sizes disagrees with out's 3 groups */
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_SHAPE, "out is [3, 4, 5] f32, expected [2, 4, 5] f32");
}

Test(gemm_errors, wgrad_dtypes_and_alias) {
  wgrad_args w = wgrad();
  w.l.data.dtype = TW_BF16;
  w.r.data.dtype = TW_F16;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_DTYPE, "grouped_gemm_wgrad: operand dtypes bf16 and f16 differ");
  w = wgrad();
  w.to.data = buf_a;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "grouped_gemm_wgrad: out overlaps lhs");
  w = wgrad();
  w.to.data = gs3;
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG, "grouped_gemm_wgrad: out overlaps group_sizes");
}

Test(gemm_errors, wgrad_quantized_layouts) {
  wgrad_args w = wgrad();
  /* tensor scaling: colwise data is per-group transposed, so it must be passed with op T */
  qbuf ql = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 6, 4, 3);
  qbuf qr = make_q(TW_SCALE_TENSOR_CURRENT, TW_E5M2, 6, 5, 3);
  w.l = tw_operand_colwise(&ql.q);
  w.r = tw_operand_colwise(&qr.q);
  EXPECT_OK(WGRAD(w, TW_OP_T, TW_OP_T));
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_T), TW_ERR_INVALID_ARG,
             "lhs_op is N but the lhs data is per-group transposed (use T)");
  w.l.data.shape[0] = 6; /* the transposed copy viewed as [M, K] instead of [K, M] */
  w.l.data.shape[1] = 4;
  EXPECT_ERR(WGRAD(w, TW_OP_T, TW_OP_T), TW_ERR_SHAPE,
             "lhs's data is [6, 4] but its colwise orientation stores [4, 6]");
  w.l.data = tw_tensor_1d(w.l.data.data, TW_E4M3, 24, TW_MEM_HOST); /* flat: the count is enough */
  EXPECT_OK(WGRAD(w, TW_OP_T, TW_OP_T));
  w.l = tw_operand_rowwise(&ql.q);
  EXPECT_ERR(WGRAD(w, TW_OP_T, TW_OP_T), TW_ERR_INVALID_ARG,
             "lhs_op is T but the lhs data is row-major [M, K] (use N)");
  w.r = tw_operand_rowwise(&qr.q);
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_T), TW_ERR_INVALID_ARG,
             "rhs_op is T but the rhs data is row-major [M, N] (use N)");
  w.l = tw_operand_colwise(&ql.q);
  w.r = tw_operand_plain(&w.tr);
  EXPECT_ERR(WGRAD(w, TW_OP_T, TW_OP_N), TW_ERR_INVALID_ARG, "one operand is quantized (current) and the other is not (none)");
  free_q(&ql);
  free_q(&qr);
  /* MXFP8: blocks must run along the ragged rows (colwise), data not transposed (op N) */
  qbuf ml = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 6, 64, 3);
  qbuf mr = make_q(TW_SCALE_MXFP8_1D, TW_E4M3, 6, 32, 3);
  w = wgrad();
  w.to = tw_tensor_3d(buf_o, TW_F32, 3, 64, 32, TW_MEM_HOST);
  w.l = tw_operand_colwise(&ml.q);
  w.r = tw_operand_colwise(&mr.q);
  EXPECT_OK(WGRAD(w, TW_OP_N, TW_OP_N));
  w.l = tw_operand_rowwise(&ml.q);
  EXPECT_ERR(WGRAD(w, TW_OP_N, TW_OP_N), TW_ERR_INVALID_ARG,
             "lhs's mxfp8 scaling blocks run along its last storage dim, but the contracting dim is its first; pass the colwise orientation");
  free_q(&ml);
  free_q(&mr);
  /* e5m2 x e5m2 */
  qbuf el = make_q(TW_SCALE_TENSOR_CURRENT, TW_E5M2, 6, 4, 3);
  qbuf er = make_q(TW_SCALE_TENSOR_CURRENT, TW_E5M2, 6, 5, 3);
  w = wgrad();
  w.l = tw_operand_colwise(&el.q);
  w.r = tw_operand_colwise(&er.q);
  EXPECT_ERR(WGRAD(w, TW_OP_T, TW_OP_T), TW_ERR_DTYPE, "grouped_gemm_wgrad: e5m2 x e5m2 is not a supported fp8 pair");
  free_q(&el);
  free_q(&er);
}

/* ---- the remaining messages ------------------------------------------------------------- */

Test(gemm_errors, alignment_query_and_quantized_shapes) {
  dense_args d = dense();
  EXPECT_ERR(tw_gemm_alignment(NULL, &d.a, TW_OP_N, &d.b, TW_OP_N, &d.to), TW_ERR_NULL, "gemm_alignment: ctx is NULL");
  EXPECT_OK(tw_gemm_alignment(ctx, &d.a, TW_OP_N, &d.b, TW_OP_N, &d.to)); /* ref: no rule */
  qbuf qa = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 5, 7, 1);
  qbuf qb = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 3, 7, 1);
  tw_operand a = tw_operand_rowwise(&qa.q), b = tw_operand_rowwise(&qb.q);
  a.src_rows = -5;
  EXPECT_ERR(tw_gemm(ctx, &a, TW_OP_N, &b, TW_OP_T, &d.to, 0), TW_ERR_SHAPE, "a has source shape [-5, 7]");
  free_q(&qa);
  free_q(&qb);
}

Test(gemm_errors, grouped_quantized_rhs_k_mismatch) {
  grouped_args g = grouped();
  qbuf ql = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 6, 4, 3);
  qbuf qr = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 3 * 6, 5, 3); /* per group [6, 5]: K 6 */
  g.l = tw_operand_rowwise(&ql.q);
  g.r = tw_operand_rowwise(&qr.q);
  EXPECT_ERR(GROUPED(g, TW_OP_N), TW_ERR_SHAPE, "lhs has K = 4 but each rhs group stores [6, 5] (K, N)");
  free_q(&ql);
  free_q(&qr);
}

Test(gemm_errors, wgrad_quantized_rows_and_rank) {
  wgrad_args w = wgrad();
  qbuf ql = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 6, 4, 3);
  qbuf qr = make_q(TW_SCALE_TENSOR_CURRENT, TW_E4M3, 7, 5, 3);
  w.l = tw_operand_colwise(&ql.q);
  w.r = tw_operand_colwise(&qr.q);
  EXPECT_ERR(WGRAD(w, TW_OP_T, TW_OP_T), TW_ERR_SHAPE, "lhs has 6 rows but rhs has 7");
  w.r.data = tw_tensor_3d(buf_b, TW_F32, 1, 6, 5, TW_MEM_HOST);
  w.r.mode = TW_SCALE_NONE;
  EXPECT_ERR(WGRAD(w, TW_OP_T, TW_OP_N), TW_ERR_SHAPE, "grouped_gemm_wgrad: rhs must be 2-D");
  free_q(&ql);
  free_q(&qr);
}

/* ---- row-gathered lhs (tw_grouped_gemm_rows, tw_grouped_gemm_wgrad_rows) ---------------- */

static int32_t rows_buf[8], rows_gs[2];

typedef struct {
  tw_tensor tl, rows, tr, gs, to;
  tw_operand l, r;
} rows_args;

/* lhs [U = 5, K = 4], lhs_rows [M = 6] (S = 5: entry 5 is never read), rhs [G = 2, 4, 3], out [6, 3] */
static rows_args rows_fwd(void) {
  rows_args a;
  int32_t rows[6] = {4, 0, -1, 4, 2, 999};
  memcpy(rows_buf, rows, sizeof rows);
  rows_gs[0] = 3;
  rows_gs[1] = 2;
  a.tl = tw_tensor_2d(buf_a, TW_F32, 5, 4, TW_MEM_HOST);
  a.rows = tw_tensor_1d(rows_buf, TW_I32, 6, TW_MEM_HOST);
  a.tr = tw_tensor_3d(buf_b, TW_F32, 2, 4, 3, TW_MEM_HOST);
  a.gs = tw_tensor_1d(rows_gs, TW_I32, 2, TW_MEM_HOST);
  a.to = tw_tensor_2d(buf_o, TW_F32, 6, 3, TW_MEM_HOST);
  a.l = tw_operand_plain(&a.tl);
  a.r = tw_operand_plain(&a.tr);
  return a;
}
#define ROWS(a) tw_grouped_gemm_rows(ctx, &(a).l, &(a).rows, &(a).r, TW_OP_N, &(a).gs, &(a).to, 0)

Test(gemm_errors, rows_forward) {
  rows_args a = rows_fwd();
  EXPECT_OK(ROWS(a));
  EXPECT_ERR(tw_grouped_gemm_rows(ctx, &a.l, NULL, &a.r, TW_OP_N, &a.gs, &a.to, 0), TW_ERR_NULL,
             "grouped_gemm_rows: lhs_rows is NULL");
  a.rows.dtype = TW_I64;
  EXPECT_ERR(ROWS(a), TW_ERR_DTYPE, "grouped_gemm_rows: lhs_rows is i64, expected i32");
  a = rows_fwd();
  a.rows = tw_tensor_2d(rows_buf, TW_I32, 2, 3, TW_MEM_HOST);
  EXPECT_ERR(ROWS(a), TW_ERR_SHAPE, "lhs_rows must have 1 dims, has 2");
  a = rows_fwd();
  rows_buf[3] = 5; /* U = 5 */
  EXPECT_ERR(ROWS(a), TW_ERR_INVALID_ARG, "lhs_rows[3] = 5 is outside [-1, U = 5)");
  rows_buf[3] = -2;
  EXPECT_ERR(ROWS(a), TW_ERR_INVALID_ARG, "lhs_rows[3] = -2 is outside [-1, U = 5)");
  a = rows_fwd();
  rows_gs[1] = 4; /* S = 7 > M = 6 */
  EXPECT_ERR(ROWS(a), TW_ERR_INVALID_ARG, "group_sizes sum to 7 but lhs_rows has 6 rows");
  a = rows_fwd();
  a.to = tw_tensor_2d(buf_o, TW_F32, 5, 3, TW_MEM_HOST); /* out has U rows, not M */
  EXPECT_ERR(ROWS(a), TW_ERR_SHAPE, "out");
  a = rows_fwd();
  a.tr = tw_tensor_3d(buf_b, TW_F32, 2, 5, 3, TW_MEM_HOST);
  a.r = tw_operand_plain(&a.tr);
  EXPECT_ERR(ROWS(a), TW_ERR_SHAPE, "lhs has K = 4 but rhs ([G, K, N]) has K = 5");
  a = rows_fwd();
  a.to = tw_tensor_2d(rows_buf, TW_F32, 2, 3, TW_MEM_HOST); /* out over lhs_rows' bytes */
  a.to.shape[0] = 6;
  a.to.data = rows_buf;
  EXPECT_ERR(ROWS(a), TW_ERR_INVALID_ARG, "out overlaps lhs_rows");
}

Test(gemm_errors, rows_forward_quantized_source_is_one_group_of_U_rows) {
  /* e4m3 per-tensor: lhs source [U = 5, K = 4] as one group (scale_inv [1]), rhs [G*K, N] uniform */
  static uint8_t ql[20], qr[24];
  static float sl[1] = {1.0f}, sr[2] = {1.0f, 1.0f};
  rows_args a = rows_fwd();
  tw_operand l = {tw_tensor_2d(ql, TW_E4M3, 5, 4, TW_MEM_HOST), TW_SCALE_TENSOR_CURRENT,
                  tw_tensor_1d(sl, TW_F32, 1, TW_MEM_HOST), 0, 0, 5, 4, 0};
  tw_operand r = {tw_tensor_2d(qr, TW_E4M3, 8, 3, TW_MEM_HOST), TW_SCALE_TENSOR_CURRENT,
                  tw_tensor_1d(sr, TW_F32, 2, TW_MEM_HOST), 0, 0, 8, 3, 0};
  EXPECT_OK(tw_grouped_gemm_rows(ctx, &l, &a.rows, &r, TW_OP_N, &a.gs, &a.to, 0));
  l.src_rows = 6; /* M, as tw_grouped_gemm's lhs would be: the source is [U, K] */
  l.data = tw_tensor_2d(ql, TW_E4M3, 6, 4, TW_MEM_HOST);
  l.scale_inv = tw_tensor_1d(sl, TW_F32, 1, TW_MEM_HOST);
  EXPECT_OK(tw_grouped_gemm_rows(ctx, &l, &a.rows, &r, TW_OP_N, &a.gs, &a.to, 0)); /* U = 6 is fine too */
  l = (tw_operand){tw_tensor_2d(ql, TW_E4M3, 5, 4, TW_MEM_HOST), TW_SCALE_TENSOR_CURRENT,
                   tw_tensor_1d(sr, TW_F32, 2, TW_MEM_HOST), 0, 0, 5, 4, 0}; /* per-group scales: not one group */
  EXPECT_ERR(tw_grouped_gemm_rows(ctx, &l, &a.rows, &r, TW_OP_N, &a.gs, &a.to, 0), TW_ERR_SHAPE, "lhs scale_inv");
}

Test(gemm_errors, rows_wgrad) {
  /* lhs [U = 5, K = 4], lhs_rows [6], rhs [6, 3], out [2, 4, 3] */
  rows_args a = rows_fwd();
  tw_tensor rhs = tw_tensor_2d(buf_b, TW_F32, 6, 3, TW_MEM_HOST), out = tw_tensor_3d(buf_o, TW_F32, 2, 4, 3, TW_MEM_HOST);
  tw_operand r = tw_operand_plain(&rhs);
  EXPECT_OK(tw_grouped_gemm_wgrad_rows(ctx, &a.l, &a.rows, &r, TW_OP_N, &a.gs, &out, 0));
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &a.l, NULL, &r, TW_OP_N, &a.gs, &out, 0), TW_ERR_NULL, "lhs_rows is NULL");
  tw_tensor rhs5 = tw_tensor_2d(buf_b, TW_F32, 5, 3, TW_MEM_HOST);
  tw_operand r5 = tw_operand_plain(&rhs5);
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &a.l, &a.rows, &r5, TW_OP_N, &a.gs, &out, 0), TW_ERR_SHAPE,
             "lhs_rows has 6 rows but rhs has 5");
  rows_buf[0] = 7;
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &a.l, &a.rows, &r, TW_OP_N, &a.gs, &out, 0), TW_ERR_INVALID_ARG,
             "lhs_rows[0] = 7 is outside [-1, U = 5)");
  rows_buf[0] = 4;
  tw_tensor bad = tw_tensor_3d(buf_o, TW_F32, 2, 3, 3, TW_MEM_HOST);
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &a.l, &a.rows, &r, TW_OP_N, &a.gs, &bad, 0), TW_ERR_SHAPE, "out");
  static uint8_t q[24];
  static float sc[1] = {1.0f};
  tw_operand ql = {tw_tensor_2d(q, TW_E4M3, 5, 4, TW_MEM_HOST), TW_SCALE_TENSOR_CURRENT,
                   tw_tensor_1d(sc, TW_F32, 1, TW_MEM_HOST), 0, 0, 5, 4, 0};
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &ql, &a.rows, &r, TW_OP_N, &a.gs, &out, 0), TW_ERR_INVALID_ARG,
             "takes plain operands (lhs is current");
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &a.l, &a.rows, &r, (tw_op)7, &a.gs, &out, 0), TW_ERR_INVALID_ARG,
             "rhs_op is 7");
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(NULL, &a.l, &a.rows, &r, TW_OP_N, &a.gs, &out, 0), TW_ERR_NULL, "ctx is NULL");
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, NULL, &a.rows, &r, TW_OP_N, &a.gs, &out, 0), TW_ERR_NULL, "lhs is NULL");
  tw_tensor l3 = tw_tensor_3d(buf_a, TW_F32, 1, 5, 4, TW_MEM_HOST);
  tw_operand o3 = tw_operand_plain(&l3);
  EXPECT_ERR(tw_grouped_gemm_wgrad_rows(ctx, &o3, &a.rows, &r, TW_OP_N, &a.gs, &out, 0), TW_ERR_SHAPE,
             "lhs must have 2 dims, has 3");
}

Test(gemm_errors, rows_forward_pairs_and_nulls) {
  rows_args a = rows_fwd();
  EXPECT_ERR(tw_grouped_gemm_rows(NULL, &a.l, &a.rows, &a.r, TW_OP_N, &a.gs, &a.to, 0), TW_ERR_NULL, "ctx is NULL");
  EXPECT_ERR(tw_grouped_gemm_rows(ctx, NULL, &a.rows, &a.r, TW_OP_N, &a.gs, &a.to, 0), TW_ERR_NULL, "lhs is NULL");
  EXPECT_ERR(tw_grouped_gemm_rows(ctx, &a.l, &a.rows, NULL, TW_OP_N, &a.gs, &a.to, 0), TW_ERR_NULL, "rhs is NULL");
  EXPECT_ERR(tw_grouped_gemm_rows(ctx, &a.l, &a.rows, &a.r, (tw_op)3, &a.gs, &a.to, 0), TW_ERR_INVALID_ARG,
             "rhs_op is 3");
  a.tl = tw_tensor_2d(buf_a, TW_BF16, 5, 4, TW_MEM_HOST); /* bf16 x f16: no plain pair */
  a.tr = tw_tensor_3d(buf_b, TW_F16, 2, 4, 3, TW_MEM_HOST);
  a.l = tw_operand_plain(&a.tl);
  a.r = tw_operand_plain(&a.tr);
  EXPECT_ERR(ROWS(a), TW_ERR_DTYPE, "bf16");
}
