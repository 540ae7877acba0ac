/* Every rejected input of tw_quantize_output_shapes, tw_grouped_quantize,
 * tw_grouped_dequantize, tw_delayed_scale_update and ref_dequantize_operand: the status and
 * a piece of the message that names the culprit (and its values). */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "ref/ref.h"
#include "tests/test_util.h"
#include "twin/tw_quantize.h"

enum { M = 6, K = 40, G = 3 };

/* A valid call (rowwise + colwise, all outputs) that each test then breaks in one place. */
typedef struct {
  tw_ctx *ctx;
  float x[M * K];
  int32_t sizes[G];
  float scale[G];
  uint8_t row[M * K], col[M * K], rs[4096], cs[4096];
  float amax[G];
  tw_tensor xt, gs;
  tw_quantize_opts opts;
  tw_qtensor q;
} fixture;

static void setup(fixture *f, tw_scaling mode) {
  memset(f, 0, sizeof *f);
  f->ctx = tt_ref_ctx();
  for (int i = 0; i < M * K; i++) f->x[i] = (float)(i % 7) - 3.0f;
  f->sizes[0] = 2;
  f->sizes[1] = 0;
  f->sizes[2] = 3;
  for (int g = 0; g < G; g++) f->scale[g] = 2.0f;
  f->xt = tw_tensor_2d(f->x, TW_F32, M, K, TW_MEM_HOST);
  f->gs = tw_tensor_1d(f->sizes, TW_I32, G, TW_MEM_HOST);
  f->opts = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  f->opts.mode = mode;
  f->opts.layout = TW_ROWWISE_COLWISE;
  f->opts.scale = tw_tensor_1d(f->scale, TW_F32, G, TW_MEM_HOST);
  cr_assert_eq(tw_quantize_output_shapes(&f->opts, M, K, G, &f->q), TW_OK, "%s", tw_last_error());
  cr_assert_leq(tw_tensor_bytes(&f->q.row_scale_inv), sizeof f->rs);
  cr_assert_leq(tw_tensor_bytes(&f->q.col_scale_inv), sizeof f->cs);
  f->q.row_data.data = f->row;
  f->q.col_data.data = f->col;
  f->q.row_scale_inv.data = f->rs;
  f->q.col_scale_inv.data = f->cs;
  f->q.amax.data = f->amax;
  cr_assert_eq(tw_grouped_quantize(f->ctx, &f->xt, &f->gs, &f->opts, &f->q), TW_OK, "%s", tw_last_error());
}

static tw_status quantize(fixture *f) { return tw_grouped_quantize(f->ctx, &f->xt, &f->gs, &f->opts, &f->q); }

static void teardown(fixture *f) { tw_ctx_destroy(f->ctx); }

/* ---- output shapes and opts ------------------------------------------------------------- */

Test(quantize_errors, output_shapes_rejects_bad_opts_and_sizes) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  tw_qtensor q;
  tt_expect_status(tw_quantize_output_shapes(NULL, 4, 4, 1, &q), TW_ERR_NULL, "opts is NULL");
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, NULL), TW_ERR_NULL, "q is NULL");
  o.size = 8;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "opts->size is 8");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  o.mode = TW_SCALE_NONE;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "scaling mode 0");
  o.mode = (tw_scaling)42;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "scaling mode 42");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  o.qdtype = TW_BF16;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_DTYPE, "qdtype must be e4m3 or e5m2, got bf16");
  o.qdtype = (tw_dtype)99;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_DTYPE, "got ?");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  o.layout = (tw_qlayout)0;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "layout 0");
  o.layout = (tw_qlayout)4;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "layout 4");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  o.pow2_scales = 2;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "pow2_scales is 2");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  o.mxfp8_swizzled = -1;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "mxfp8_swizzled is -1");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  o.col_padded = 2;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "opts->col_padded is 2");
  o.col_padded = 1; /* the default layout is rowwise only */
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG, "the layout is rowwise only");
  o.layout = TW_COLWISE;
  o.mode = TW_SCALE_MXFP8_1D;
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 1, &q), TW_ERR_INVALID_ARG,
                   "col_padded = 1 with mxfp8: its colwise data is not transposed");
  o = (tw_quantize_opts)TW_QUANTIZE_OPTS_INIT;
  tt_expect_status(tw_quantize_output_shapes(&o, -1, 4, 1, &q), TW_ERR_INVALID_ARG, "M = -1");
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 0, 1, &q), TW_ERR_INVALID_ARG, "K = 0");
  tt_expect_status(tw_quantize_output_shapes(&o, 4, 4, 0, &q), TW_ERR_INVALID_ARG, "G = 0");
}

Test(quantize_errors, output_shapes_of_every_mode) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  tw_qtensor q;
  o.layout = TW_ROWWISE_COLWISE;
  /* M = 300 in G = 4 groups: T_cap = (300 + 127*4)/128 = 6 */
  o.mode = TW_SCALE_MXFP8_1D;
  cr_assert_eq(tw_quantize_output_shapes(&o, 300, 33, 4, &q), TW_OK);
  cr_assert(q.row_scale_inv.shape[0] == 768 && q.row_scale_inv.shape[1] == 4 && q.row_scale_inv.dtype == TW_E8M0);
  cr_assert(q.col_scale_inv.shape[0] == 24 && q.col_scale_inv.shape[1] == 128);
  cr_assert(q.col_data.ndim == 2 && q.col_data.shape[0] == 300 && q.col_data.shape[1] == 33);
  o.mode = TW_SCALE_BLOCK_1x128;
  cr_assert_eq(tw_quantize_output_shapes(&o, 300, 130, 4, &q), TW_OK);
  cr_assert(q.row_scale_inv.shape[0] == 2 && q.row_scale_inv.shape[1] == 300);
  cr_assert(q.col_scale_inv.shape[0] == 6 && q.col_scale_inv.shape[1] == 132);
  cr_assert(q.col_data.ndim == 1 && q.col_data.shape[0] == 300 * 130);
  o.mode = TW_SCALE_BLOCK_128x128;
  cr_assert_eq(tw_quantize_output_shapes(&o, 300, 130, 4, &q), TW_OK);
  cr_assert(q.row_scale_inv.shape[0] == 6 && q.row_scale_inv.shape[1] == 2);
  cr_assert(q.col_scale_inv.shape[0] == 2 && q.col_scale_inv.shape[1] == 6);
  o.mode = TW_SCALE_TENSOR_CURRENT;
  o.layout = TW_COLWISE;
  cr_assert_eq(tw_quantize_output_shapes(&o, 300, 130, 4, &q), TW_OK);
  cr_assert(tw_tensor_is_none(&q.row_data) && tw_tensor_is_none(&q.row_scale_inv));
  cr_assert(q.col_scale_inv.ndim == 1 && q.col_scale_inv.shape[0] == 4 && q.amax.shape[0] == 4);
  /* token-padded colwise data: [K, 128 * T_cap], the rest unchanged */
  o.mode = TW_SCALE_BLOCK_1x128;
  o.layout = TW_ROWWISE_COLWISE;
  o.col_padded = 1;
  cr_assert_eq(tw_quantize_output_shapes(&o, 300, 130, 4, &q), TW_OK);
  cr_assert(q.col_padded == 1 && q.col_data.ndim == 2 && q.col_data.shape[0] == 130 && q.col_data.shape[1] == 768);
  cr_assert(q.col_scale_inv.shape[0] == 6 && q.col_scale_inv.shape[1] == 132 && q.row_data.shape[0] == 300);
  o.col_padded = 0;
  /* more groups than rows: only min(G, M) can be non-empty */
  o.mode = TW_SCALE_BLOCK_128x128;
  cr_assert_eq(tw_quantize_output_shapes(&o, 2, 5, 100, &q), TW_OK);
  cr_assert_eq(q.col_scale_inv.shape[1], 2); /* two one-row groups: two tiles */
}

/* ---- grouped_quantize -------------------------------------------------------------------- */

Test(quantize_errors, null_arguments) {
  fixture f;
  setup(&f, TW_SCALE_TENSOR_CURRENT);
  tt_expect_status(tw_grouped_quantize(NULL, &f.xt, &f.gs, &f.opts, &f.q), TW_ERR_NULL, "ctx is NULL");
  tt_expect_status(tw_grouped_quantize(f.ctx, NULL, &f.gs, &f.opts, &f.q), TW_ERR_NULL, "x is NULL");
  tt_expect_status(tw_grouped_quantize(f.ctx, &f.xt, NULL, &f.opts, &f.q), TW_ERR_NULL, "group_sizes is NULL");
  tt_expect_status(tw_grouped_quantize(f.ctx, &f.xt, &f.gs, NULL, &f.q), TW_ERR_NULL, "opts is NULL");
  tt_expect_status(tw_grouped_quantize(f.ctx, &f.xt, &f.gs, &f.opts, NULL), TW_ERR_NULL, "q is NULL");
  f.xt.data = NULL;
  tt_expect_status(quantize(&f), TW_ERR_NULL, "x data is NULL");
  f.xt.data = f.x;
  f.q.row_data.data = NULL;
  tt_expect_status(quantize(&f), TW_ERR_NULL, "row_data data is NULL");
  teardown(&f);
}

Test(quantize_errors, bad_opts_reach_the_quantize_call) {
  fixture f;
  setup(&f, TW_SCALE_TENSOR_CURRENT);
  f.opts.size = 0;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "grouped_quantize: opts->size is 0");
  f.opts.size = sizeof f.opts;
  f.opts.pow2_scales = 7;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "pow2_scales is 7");
  f.opts.pow2_scales = 0;
  f.opts.col_padded = 1; /* q was laid out with the default colwise layout */
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "q->col_padded = 0 but opts->col_padded = 1");
  f.opts.col_padded = 0;
  f.q.col_padded = 1;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "q->col_padded = 1 but opts->col_padded = 0");
  f.q.col_padded = 0;
  f.opts.mode = TW_SCALE_MXFP8_1D; /* q was laid out for current scaling */
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "q is described as current/e4m3 but opts ask for mxfp8/e4m3");
  f.opts.mode = TW_SCALE_TENSOR_CURRENT;
  f.opts.qdtype = TW_E5M2;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "but opts ask for current/e5m2");
  teardown(&f);
}

Test(quantize_errors, bad_x) {
  fixture f;
  setup(&f, TW_SCALE_TENSOR_CURRENT);
  tw_tensor keep = f.xt;
  f.xt = tw_tensor_none();
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "x is required");
  f.xt = tw_tensor_3d(f.x, TW_F32, 2, 3, 40, TW_MEM_HOST);
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "x must have 2 dims, has 3");
  f.xt = keep;
  f.xt.dtype = TW_I32;
  tt_expect_status(quantize(&f), TW_ERR_DTYPE, "x has dtype i32, expected one of {f32, bf16, f16}");
  f.xt = keep;
  f.xt.mem = TW_MEM_DEVICE;
  tt_expect_status(quantize(&f), TW_ERR_MEMORY, "x lives in device memory");
  f.xt = keep;
  f.xt.shape[1] = 0;
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "K must be >= 1");
  f.xt = keep;
  f.xt.shape[0] = -2;
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "x dim 0 is -2");
  f.xt = keep;
  f.xt.shape[1] = 39; /* q describes K = 40 */
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "q describes a [6, 40] source but x is [6, 39]");
  teardown(&f);
}

Test(quantize_errors, bad_group_sizes) {
  fixture f;
  setup(&f, TW_SCALE_BLOCK_1x128);
  f.gs.shape[0] = 0;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "group_sizes is empty (G = 0)");
  f.gs.shape[0] = G;
  f.sizes[1] = -1;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "group_sizes[1] = -1 is negative");
  f.sizes[1] = 2; /* 2 + 2 + 3 = 7 > 6 */
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "group_sizes sum to 7 but x has 6 rows");
  f.sizes[1] = 0;
  f.gs.dtype = TW_I64;
  tt_expect_status(quantize(&f), TW_ERR_DTYPE, "group_sizes must be i32, got i64");
  f.gs.dtype = TW_I32;
  f.gs.ndim = 2;
  f.gs.shape[1] = 1;
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "group_sizes must have 1 dims, has 2");
  f.gs = tw_tensor_1d(f.sizes, TW_I32, G, TW_MEM_DEVICE);
  tt_expect_status(quantize(&f), TW_ERR_MEMORY, "group_sizes lives in device memory");
  /* G changes the scale shapes: 2 groups instead of 3 */
  f.gs = tw_tensor_1d(f.sizes, TW_I32, 2, TW_MEM_HOST);
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "col_scale_inv is [3, 40] f32, expected [2, 40] f32");
  teardown(&f);
}

Test(quantize_errors, wrong_outputs_of_every_mode) {
  for (int mode = TW_SCALE_TENSOR_CURRENT; mode < TW_SCALE_COUNT; mode++) {
    fixture f;
    setup(&f, (tw_scaling)mode);
    tw_qtensor keep = f.q;
    f.q.row_data.dtype = TW_E5M2;
    tt_expect_status(quantize(&f), TW_ERR_DTYPE, "row_data has dtype e5m2, expected e4m3");
    f.q = keep;
    f.q.row_data.shape[1] = 41;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "row_data is [6, 41] e4m3, expected [6, 40] e4m3");
    f.q = keep;
    f.q.row_data = tw_tensor_none();
    tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "row_data is required");
    f.q = keep;
    f.q.row_data.mem = TW_MEM_DEVICE;
    tt_expect_status(quantize(&f), TW_ERR_MEMORY, "row_data lives in device memory");
    f.q = keep;
    f.q.row_scale_inv.dtype = mode == TW_SCALE_MXFP8_1D ? TW_U8 : TW_F16;
    tt_expect_status(quantize(&f), TW_ERR_DTYPE, "row_scale_inv has dtype");
    f.q = keep;
    f.q.row_scale_inv.shape[0] += 1;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "row_scale_inv is");
    f.q = keep;
    f.q.col_data.shape[0] += 1;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "col_data is");
    f.q = keep;
    f.q.col_data.ndim = mode == TW_SCALE_MXFP8_1D ? 1 : 2;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "col_data must have");
    f.q = keep;
    f.q.col_scale_inv.shape[0] += 1;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "col_scale_inv is");
    f.q = keep;
    f.q.amax.shape[0] = 2;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "amax is [2] f32, expected [3] f32");
    f.q = keep;
    f.q.amax.dtype = TW_BF16;
    tt_expect_status(quantize(&f), TW_ERR_DTYPE, "amax has dtype bf16, expected f32");
    f.q = keep;
    f.q.rows = 5;
    tt_expect_status(quantize(&f), TW_ERR_SHAPE, "q describes a [5, 40] source");
    f.q = keep;
    if (mode == TW_SCALE_TENSOR_CURRENT || mode == TW_SCALE_TENSOR_DELAYED) {
      f.q.amax = tw_tensor_none(); /* tensor scaling always reports amax */
      tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "amax is required");
      f.q = keep;
      f.q.col_scale_inv = tw_tensor_none(); /* shares row_scale_inv: fine */
      cr_assert_eq(quantize(&f), TW_OK, "%s", tw_last_error());
      f.q = keep;
      f.opts.layout = TW_COLWISE; /* ... but colwise alone needs its own */
      f.q.row_data = f.q.row_scale_inv = tw_tensor_none();
      f.q.col_scale_inv = tw_tensor_none();
      tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "col_scale_inv is required");
      f.opts.layout = TW_ROWWISE_COLWISE;
    } else {
      f.q.amax = tw_tensor_none(); /* optional for block modes */
      cr_assert_eq(quantize(&f), TW_OK, "%s", tw_last_error());
      f.q = keep;
      f.q.col_scale_inv = tw_tensor_none();
      tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "col_scale_inv is required");
    }
    f.q = keep;
    if (mode == TW_SCALE_MXFP8_1D) {
      f.q.mxfp8_swizzled = 0;
      tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "q->mxfp8_swizzled = 0 but opts->mxfp8_swizzled = 1");
    }
    teardown(&f);
  }
}

Test(quantize_errors, delayed_needs_a_scale_per_group) {
  fixture f;
  setup(&f, TW_SCALE_TENSOR_DELAYED);
  tw_tensor keep = f.opts.scale;
  f.opts.scale = tw_tensor_none();
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "opts->scale is required");
  f.opts.scale = keep;
  f.opts.scale.dtype = TW_BF16;
  tt_expect_status(quantize(&f), TW_ERR_DTYPE, "opts->scale must be f32, got bf16");
  f.opts.scale = keep;
  f.opts.scale.shape[0] = 2;
  tt_expect_status(quantize(&f), TW_ERR_SHAPE, "opts->scale is [2] f32, expected [3] f32");
  f.opts.scale = keep;
  f.opts.scale.mem = TW_MEM_DEVICE;
  tt_expect_status(quantize(&f), TW_ERR_MEMORY, "opts->scale lives in device memory");
  f.opts.scale = keep;
  f.opts.scale.data = NULL;
  tt_expect_status(quantize(&f), TW_ERR_NULL, "opts->scale data is NULL");
  teardown(&f);
}

Test(quantize_errors, outputs_must_not_overlap_inputs_or_each_other) {
  fixture f;
  setup(&f, TW_SCALE_TENSOR_DELAYED);
  tw_qtensor keep = f.q;
  f.q.row_data.data = f.x; /* in place */
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "row_data overlaps the input x");
  f.q = keep;
  f.q.col_data.data = f.row + 8;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "row_data overlaps col_data");
  f.q = keep;
  f.q.amax.data = f.sizes;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "amax overlaps the input group_sizes");
  f.q = keep;
  f.q.row_scale_inv.data = f.scale;
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "row_scale_inv overlaps the input opts->scale");
  f.q = keep;
  f.q.col_scale_inv.data = f.rs + 4; /* partly row_scale_inv: a bug */
  tt_expect_status(quantize(&f), TW_ERR_INVALID_ARG, "row_scale_inv overlaps col_scale_inv");
  f.q = keep;
  f.q.col_scale_inv.data = f.rs; /* exactly row_scale_inv: the shared buffer */
  cr_assert_eq(quantize(&f), TW_OK, "%s", tw_last_error());
  f.q = keep;
  f.opts.layout = TW_ROWWISE; /* outputs that are not produced are not checked */
  f.q.col_data.data = f.x;
  cr_assert_eq(quantize(&f), TW_OK, "%s", tw_last_error());
  /* dequantize */
  float out[M * K];
  tw_tensor o = tw_tensor_2d(out, TW_F32, M, K, TW_MEM_HOST);
  f.q = keep;
  cr_assert_eq(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_OK, "%s", tw_last_error());
  o.data = f.row;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "out overlaps the input row_data");
  o.data = f.rs; /* never written: rejected before any work */
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "out overlaps the input row_scale_inv");
  int32_t *inside = (int32_t *)(out + M * K - G); /* group sizes stored in out's last bytes */
  memcpy(inside, f.sizes, sizeof f.sizes);
  f.gs.data = inside;
  o.data = out;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "out overlaps the input group_sizes");
  teardown(&f);
  /* delayed update */
  tw_ctx *ctx = tt_ref_ctx();
  float hist[G * 4] = {0}, amax[G] = {1, 2, 3};
  tw_tensor h = tw_tensor_2d(hist, TW_F32, G, 4, TW_MEM_HOST), a = tw_tensor_1d(amax, TW_F32, G, TW_MEM_HOST);
  tw_tensor s = tw_tensor_1d(hist + 4, TW_F32, G, TW_MEM_HOST);
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_INVALID_ARG,
                   "amax_history overlaps scale");
  s = tw_tensor_1d(amax, TW_F32, G, TW_MEM_HOST);
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_INVALID_ARG,
                   "scale overlaps the input amax");
  tw_ctx_destroy(ctx);
}

/* ---- grouped_dequantize ------------------------------------------------------------------ */

Test(quantize_errors, dequantize_rejects_bad_arguments) {
  fixture f;
  setup(&f, TW_SCALE_MXFP8_1D);
  float out[M * K];
  tw_tensor o = tw_tensor_2d(out, TW_F32, M, K, TW_MEM_HOST);
  cr_assert_eq(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 1, &o), TW_OK, "%s", tw_last_error());
  tt_expect_status(tw_grouped_dequantize(NULL, &f.q, &f.gs, 0, &o), TW_ERR_NULL, "ctx is NULL");
  tt_expect_status(tw_grouped_dequantize(f.ctx, NULL, &f.gs, 0, &o), TW_ERR_NULL, "q is NULL");
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, NULL), TW_ERR_NULL, "out is NULL");
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, NULL, 0, &o), TW_ERR_NULL, "group_sizes is NULL");
  tw_tensor bad = o;
  bad.dtype = TW_E4M3;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &bad), TW_ERR_DTYPE, "out has dtype e4m3");
  bad = tw_tensor_2d(out, TW_F32, K, M, TW_MEM_HOST);
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &bad), TW_ERR_SHAPE, "out is [40, 6] f32, expected [6, 40] f32");
  bad = o;
  bad.mem = TW_MEM_DEVICE;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &bad), TW_ERR_MEMORY, "out lives in device memory");
  tw_qtensor keep = f.q;
  f.q.mode = TW_SCALE_NONE;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "scaling mode 0");
  f.q = keep;
  f.q.qdtype = TW_F32;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_DTYPE, "qdtype must be e4m3 or e5m2");
  f.q = keep;
  f.q.col_data = tw_tensor_none();
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 1, &o), TW_ERR_INVALID_ARG, "col_data is required");
  cr_assert_eq(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_OK); /* rowwise needs no col_data */
  f.q = keep;
  f.q.row_scale_inv.dtype = TW_F32;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_DTYPE, "row_scale_inv has dtype f32, expected e8m0");
  f.q = keep;
  f.q.col_scale_inv.shape[1] = 4;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 1, &o), TW_ERR_SHAPE, "col_scale_inv is [12, 4] e8m0, expected [12, 128] e8m0");
  f.q = keep;
  f.sizes[2] = 5; /* 2 + 0 + 5 > 6 */
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "group_sizes sum to 7 but q has 6 rows");
  f.sizes[2] = -3;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "group_sizes[2] = -3 is negative");
  f.sizes[2] = 3;
  f.gs.shape[0] = 0;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_INVALID_ARG, "G = 0");
  f.gs.shape[0] = G;
  f.q.cols = 0;
  o.shape[1] = 0;
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 0, &o), TW_ERR_SHAPE, "K must be >= 1");
  teardown(&f);
}

Test(quantize_errors, dequantize_tensor_colwise_falls_back_to_the_shared_scale) {
  fixture f;
  setup(&f, TW_SCALE_TENSOR_CURRENT);
  float out[M * K];
  tw_tensor o = tw_tensor_2d(out, TW_F32, M, K, TW_MEM_HOST);
  f.q.col_scale_inv = tw_tensor_none();
  cr_assert_eq(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 1, &o), TW_OK, "%s", tw_last_error());
  f.q.row_scale_inv = tw_tensor_none();
  tt_expect_status(tw_grouped_dequantize(f.ctx, &f.q, &f.gs, 1, &o), TW_ERR_INVALID_ARG, "col_scale_inv is required");
  teardown(&f);
}

/* ---- delayed_scale_update --------------------------------------------------------------- */

Test(quantize_errors, delayed_update_rejects_bad_arguments) {
  tw_ctx *ctx = tt_ref_ctx();
  float hist[G * 4] = {0}, scale[G] = {1, 1, 1}, amax[G] = {1, 2, 3};
  tw_tensor h = tw_tensor_2d(hist, TW_F32, G, 4, TW_MEM_HOST), s = tw_tensor_1d(scale, TW_F32, G, TW_MEM_HOST),
            a = tw_tensor_1d(amax, TW_F32, G, TW_MEM_HOST);
  cr_assert_eq(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_OK, "%s", tw_last_error());
  tt_expect_status(tw_delayed_scale_update(NULL, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_NULL, "ctx is NULL");
  tt_expect_status(tw_delayed_scale_update(ctx, NULL, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_NULL, "amax_history is NULL");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, NULL, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_NULL, "scale is NULL");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, NULL, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_NULL, "amax is NULL");
  tw_tensor bad = tw_tensor_1d(hist, TW_F32, G * 4, TW_MEM_HOST);
  tt_expect_status(tw_delayed_scale_update(ctx, &bad, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_SHAPE,
                   "amax_history must have 2 dims, has 1");
  bad = h;
  bad.dtype = TW_BF16;
  tt_expect_status(tw_delayed_scale_update(ctx, &bad, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_DTYPE,
                   "amax_history has dtype bf16");
  bad = s;
  bad.dtype = TW_F16;
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &bad, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_DTYPE, "scale has dtype f16");
  bad = a;
  bad.dtype = TW_F64;
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &bad, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_DTYPE, "amax has dtype f64");
  bad = h;
  bad.shape[1] = 0;
  tt_expect_status(tw_delayed_scale_update(ctx, &bad, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_SHAPE,
                   "amax_history is [3, 0]; need G >= 1 and a history length >= 1");
  bad = h;
  bad.shape[0] = 0;
  tt_expect_status(tw_delayed_scale_update(ctx, &bad, &s, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_SHAPE, "need G >= 1");
  bad = s;
  bad.shape[0] = 2;
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &bad, &a, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_SHAPE,
                   "scale is [2] f32, expected [3] f32");
  bad = a;
  bad.shape[0] = 4;
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &bad, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_SHAPE,
                   "amax is [4] f32, expected [3] f32");
  bad = a;
  bad.mem = TW_MEM_DEVICE;
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &bad, TW_E4M3, TW_AMAX_MAX, 0), TW_ERR_MEMORY, "amax lives in device memory");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_BF16, TW_AMAX_MAX, 0), TW_ERR_DTYPE, "qdtype must be e4m3 or e5m2");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, (tw_amax_algo)2, 0), TW_ERR_INVALID_ARG, "amax algo 2");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, -1), TW_ERR_INVALID_ARG,
                   "margin -1 is not an integer in [0, 127]");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, 0.5f), TW_ERR_INVALID_ARG, "margin 0.5");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, 128), TW_ERR_INVALID_ARG, "margin 128");
  tt_expect_status(tw_delayed_scale_update(ctx, &h, &s, &a, TW_E4M3, TW_AMAX_MAX, NAN), TW_ERR_INVALID_ARG, "margin nan");
  tw_ctx_destroy(ctx);
}

/* ---- ref_dequantize_operand (internal, used by ref/gemm.c) ------------------------------- */

Test(quantize_errors, dequantize_operand_rejects_inconsistent_operands) {
  fixture f;
  setup(&f, TW_SCALE_BLOCK_1x128);
  float out[M * K];
  tw_operand o = tw_operand_rowwise(&f.q), bad;
  cr_assert_eq(ref_dequantize_operand(&o, f.sizes, G, out), TW_OK, "%s", tw_last_error());
  tt_expect_status(ref_dequantize_operand(NULL, f.sizes, G, out), TW_ERR_NULL, "operand or out is NULL");
  tt_expect_status(ref_dequantize_operand(&o, f.sizes, G, NULL), TW_ERR_NULL, "operand or out is NULL");
  bad = o;
  bad.src_cols = 41;
  tt_expect_status(ref_dequantize_operand(&bad, f.sizes, G, out), TW_ERR_SHAPE, "data has 240 elements but the source is [6, 41]");
  bad = o;
  bad.data.dtype = TW_U8;
  tt_expect_status(ref_dequantize_operand(&bad, f.sizes, G, out), TW_ERR_DTYPE, "quantized data has dtype u8");
  tt_expect_status(ref_dequantize_operand(&o, f.sizes, 0, out), TW_ERR_INVALID_ARG, "G = 0");
  tt_expect_status(ref_dequantize_operand(&o, NULL, 4, out), TW_ERR_SHAPE, "6 rows do not split into 4 equal groups");
  int32_t over[G] = {3, 3, 1};
  tt_expect_status(ref_dequantize_operand(&o, over, G, out), TW_ERR_INVALID_ARG, "group sizes sum to 7");
  int32_t neg[G] = {3, -1, 1};
  tt_expect_status(ref_dequantize_operand(&o, neg, G, out), TW_ERR_INVALID_ARG, "one is negative");
  bad = o;
  bad.scale_inv.shape[1] = 7;
  tt_expect_status(ref_dequantize_operand(&bad, f.sizes, G, out), TW_ERR_SHAPE, "scale_inv is [1, 7] f32, expected [1, 8] f32");
  bad = o;
  bad.mode = (tw_scaling)9;
  tt_expect_status(ref_dequantize_operand(&bad, f.sizes, G, out), TW_ERR_INVALID_ARG, "scaling mode 9");
  /* a token-padded operand: its data must be [K, 128 * T_cap]; never MXFP8 */
  bad = tw_operand_colwise(&f.q);
  bad.col_padded = 1;
  tt_expect_status(ref_dequantize_operand(&bad, f.sizes, G, out), TW_ERR_SHAPE,
                   "token-padded data has 240 elements but the source [6, 40] in 3 groups pads to [40, 384]");
  bad.mode = TW_SCALE_MXFP8_1D;
  tt_expect_status(ref_dequantize_operand(&bad, f.sizes, G, out), TW_ERR_INVALID_ARG,
                   "a token-padded colwise operand needs tensor or block scaling");
  tw_qtensor qb = f.q; /* the public dequantize names q, not opts */
  qb.mode = TW_SCALE_MXFP8_1D;
  qb.col_padded = 1;
  tw_tensor dq = tw_tensor_2d(out, TW_F32, M, K, TW_MEM_HOST);
  tt_expect_status(tw_grouped_dequantize(f.ctx, &qb, &f.gs, 1, &dq), TW_ERR_INVALID_ARG,
                   "q->col_padded = 1 with mxfp8");
  /* a plain operand is just widened */
  tw_operand p = tw_operand_plain(&f.xt);
  cr_assert_eq(ref_dequantize_operand(&p, NULL, 1, out), TW_OK);
  cr_assert_eq(memcmp(out, f.x, sizeof out), 0);
  teardown(&f);
}
