/* Public entry points of tw_gemm.h: operand views, argument validation, dispatch.
 *
 * Every operand is reduced to a "storage view": per group, the matrix as stored
 * [rows_s, cols_s], and the axis its scaling blocks run along (none for tensor scaling and
 * 128x128 tiles, which are symmetric). Each GEMM then says which storage it expects and on
 * which axis its contracting dimension lies; the checks below are that comparison. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "core/validate.h"

enum { BLOCKS_NONE = 0, BLOCKS_LAST = 1, BLOCKS_FIRST = 2 };

static int transposed_colwise(tw_scaling m) { return m != TW_SCALE_MXFP8_1D && m != TW_SCALE_NONE; }

tw_operand tw_operand_plain(const tw_tensor *t) {
  tw_operand o;
  memset(&o, 0, sizeof o);
  o.data = *t;
  o.mode = TW_SCALE_NONE;
  o.scale_inv = tw_tensor_none();
  o.src_rows = t->ndim >= 2 ? t->shape[t->ndim - 2] : 0;
  o.src_cols = t->ndim >= 1 ? t->shape[t->ndim - 1] : 0;
  return o;
}

tw_operand tw_operand_rowwise(const tw_qtensor *q) {
  tw_operand o;
  memset(&o, 0, sizeof o);
  o.data = q->row_data;
  o.mode = q->mode;
  o.scale_inv = q->row_scale_inv;
  o.colwise = 0;
  o.mxfp8_swizzled = q->mxfp8_swizzled;
  o.src_rows = q->rows;
  o.src_cols = q->cols;
  return o;
}

tw_operand tw_operand_colwise(const tw_qtensor *q) {
  tw_operand o;
  memset(&o, 0, sizeof o);
  o.data = q->col_data;
  o.mode = q->mode;
  o.scale_inv = tw_tensor_is_none(&q->col_scale_inv) ? q->row_scale_inv : q->col_scale_inv;
  o.colwise = 1;
  o.mxfp8_swizzled = q->mxfp8_swizzled;
  o.src_rows = q->rows;
  o.src_cols = q->cols;
  o.col_padded = q->col_padded; /* its data is already the 2-D [K, 128*T_cap] */
  if (!q->col_padded && transposed_colwise(q->mode) && !tw_tensor_is_none(&q->col_data) &&
      q->rows >= 0 && q->cols >= 0 && (double)q->rows * (double)q->cols <= 9.0e15 &&
      tw_tensor_numel(&q->col_data) == q->rows * q->cols) {
    /* only a correctly sized copy gets the [K, M] view; a wrong one keeps its shape and fails validation */
    /* per-group transposed blocks; as one matrix this is [K, M] (exact for one group) */
    o.data.ndim = 2;
    o.data.shape[0] = q->cols;
    o.data.shape[1] = q->rows;
  }
  return o;
}

static const tw_dtype plain_dtypes[] = {TW_F32, TW_BF16, TW_F16};
static const tw_dtype out_dtypes[] = {TW_F32, TW_BF16, TW_F16};

/* Checks one operand's data/scales against its quantization description, for `groups`
 * groups of its source rows (uniform when gs is NULL), and returns its blocks axis. */
static tw_status check_operand(const char *op, const char *name, const tw_ctx *ctx,
                               const tw_operand *o, const tw_tensor *gs, int64_t groups,
                               int *blocks) {
  if (!o) return tw_error(TW_ERR_NULL, "%s: %s is NULL", op, name);
  TW_TRY(tw_v_tensor(op, name, &o->data, ctx->ops->mem, -1));
  *blocks = BLOCKS_NONE;
  if (o->col_padded != 0 && o->col_padded != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s->col_padded is %d, expected 0 or 1", op, name, o->col_padded);
  if (o->col_padded && !(o->colwise && transposed_colwise(o->mode)))
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s is marked token-padded but is not a per-group transposed colwise "
                    "copy (%s, %s)", op, name, tw_scaling_name(o->mode), o->colwise ? "colwise" : "rowwise");
  if (o->mode == TW_SCALE_NONE) return tw_v_dtype_in(op, name, &o->data, plain_dtypes, 3);
  if ((int)o->mode < 0 || o->mode >= TW_SCALE_COUNT)
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s has unknown scaling mode %d", op, name, (int)o->mode);
  if (!tw_dtype_is_fp8(o->data.dtype))
    return tw_error(TW_ERR_DTYPE, "%s: %s is quantized (%s) but its data is %s, not e4m3/e5m2", op,
                    name, tw_scaling_name(o->mode), tw_dtype_name(o->data.dtype));
  int64_t R = o->src_rows, C = o->src_cols;
  if (R < 0 || C < 0)
    return tw_error(TW_ERR_SHAPE, "%s: %s has source shape [%lld, %lld]", op, name, (long long)R, (long long)C);
  if (!gs && groups > 0 && R % groups != 0)
    return tw_error(TW_ERR_SHAPE, "%s: %s source has %lld rows, not divisible into %lld equal groups",
                    op, name, (long long)R, (long long)groups);
  if ((double)R * (double)C > 9.0e15)
    return tw_error(TW_ERR_SHAPE, "%s: %s's source [%lld, %lld] is too large", op, name, (long long)R, (long long)C);
  /* token-padded: [C, 128*T_cap] (tw_quantize.h), 2-D. R + 127 G in double first: with C = 0 any
   * R passes the size check above (libFuzzer, validators_fuzz: a signed overflow here). */
  const int64_t gn = groups < R ? groups : R;
  if (o->col_padded && (double)R + 127.0 * (double)(gn > 0 ? gn : 0) > 9.0e15)
    return tw_error(TW_ERR_SHAPE, "%s: %s is token-padded with %lld source rows in %lld groups: too large", op, name,
                    (long long)R, (long long)groups);
  const int64_t pitch = o->col_padded ? 128 * ((R + 127 * (gn > 0 ? gn : 0)) / 128) : 0;
  if (o->col_padded && (o->data.ndim != 2 || o->data.shape[0] != C || o->data.shape[1] != pitch)) {
    char got[96];
    return tw_error(TW_ERR_SHAPE, "%s: %s is token-padded, so its data must be [%lld, %lld] (source [%lld, %lld] "
                    "in %lld groups), got %s", op, name, (long long)C, (long long)pitch, (long long)R,
                    (long long)C, (long long)groups, tw_tensor_str(&o->data, got, sizeof got));
  }
  if (!o->col_padded && tw_tensor_numel(&o->data) != R * C)
    return tw_error(TW_ERR_SHAPE, "%s: %s data has %lld elements but its source is [%lld, %lld]", op,
                    name, (long long)tw_tensor_numel(&o->data), (long long)R, (long long)C);
  /* A 2-D view must be the orientation's storage as one matrix: [R, C], or [C, R] for a
   * per-group transposed copy (exact for one group); other ranks only need the count. */
  int64_t sr = o->colwise && transposed_colwise(o->mode) ? C : R;
  int64_t sc = o->colwise && transposed_colwise(o->mode) ? R : C;
  if (!o->col_padded && o->data.ndim == 2 && (o->data.shape[0] != sr || o->data.shape[1] != sc))
    return tw_error(TW_ERR_SHAPE, "%s: %s's data is [%lld, %lld] but its %s orientation stores [%lld, %lld]",
                    op, name, (long long)o->data.shape[0], (long long)o->data.shape[1],
                    o->colwise ? "colwise" : "rowwise", (long long)sr, (long long)sc);
  tw_quantize_opts qo = TW_QUANTIZE_OPTS_INIT;
  qo.mode = o->mode;
  qo.qdtype = o->data.dtype;
  qo.layout = o->colwise ? TW_COLWISE : TW_ROWWISE;
  qo.mxfp8_swizzled = o->mxfp8_swizzled;
  tw_qtensor want;
  TW_TRY(tw_quantize_output_shapes(&qo, R, C, groups, &want));
  const tw_tensor *ws = o->colwise ? &want.col_scale_inv : &want.row_scale_inv;
  char nm[64];
  snprintf(nm, sizeof nm, "%s scale_inv", name);
  TW_TRY(tw_v_tensor(op, nm, &o->scale_inv, ctx->ops->mem, ws->ndim));
  if (o->scale_inv.dtype != ws->dtype)
    return tw_error(TW_ERR_DTYPE, "%s: %s has dtype %s, expected %s", op, nm,
                    tw_dtype_name(o->scale_inv.dtype), tw_dtype_name(ws->dtype));
  TW_TRY(tw_v_shape_is(op, nm, &o->scale_inv, ws->ndim, ws->shape));
  if (o->mode == TW_SCALE_TENSOR_CURRENT || o->mode == TW_SCALE_TENSOR_DELAYED ||
      o->mode == TW_SCALE_BLOCK_128x128)
    *blocks = BLOCKS_NONE;
  else if (!o->colwise)
    *blocks = BLOCKS_LAST;
  else
    *blocks = o->mode == TW_SCALE_MXFP8_1D ? BLOCKS_FIRST : BLOCKS_LAST;
  return TW_OK;
}

/* The token-padded colwise layout is read by the wgrad only. */
static tw_status reject_padded(const char *op, const char *name, const tw_operand *o) {
  if (!o || !o->col_padded) return TW_OK; /* (a NULL operand is reported by check_operand) */
  if (o->col_padded != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s->col_padded is %d, expected 0 or 1", op, name, o->col_padded);
  return tw_error(TW_ERR_INVALID_ARG, "%s: %s is a token-padded colwise copy; only grouped_gemm_wgrad reads that "
                  "layout", op, name);
}

/* Per-group storage [rows, cols] of a quantized operand with uniform groups. */
static void storage_of(const tw_operand *o, int64_t groups, int64_t *rows, int64_t *cols) {
  int64_t r = groups > 0 ? o->src_rows / groups : o->src_rows;
  if (o->colwise && transposed_colwise(o->mode)) { *rows = o->src_cols; *cols = r; }
  else { *rows = r; *cols = o->src_cols; }
}

static tw_status check_blocks(const char *op, const char *name, const tw_operand *o, int blocks,
                              int contract_axis /* BLOCKS_LAST or BLOCKS_FIRST */) {
  if (blocks == BLOCKS_NONE || blocks == contract_axis) return TW_OK;
  return tw_error(TW_ERR_INVALID_ARG,
                  "%s: %s's %s scaling blocks run along its %s storage dim, but the contracting "
                  "dim is its %s; pass the %s orientation",
                  op, name, tw_scaling_name(o->mode), blocks == BLOCKS_LAST ? "last" : "first",
                  contract_axis == BLOCKS_LAST ? "last" : "first", o->colwise ? "rowwise" : "colwise");
}

static tw_status check_pair(const char *op, const tw_operand *a, const tw_operand *b) {
  if ((a->mode == TW_SCALE_NONE) != (b->mode == TW_SCALE_NONE))
    return tw_error(TW_ERR_INVALID_ARG, "%s: one operand is quantized (%s) and the other is not (%s)",
                    op, tw_scaling_name(a->mode), tw_scaling_name(b->mode));
  if (a->mode == TW_SCALE_NONE) {
    if (a->data.dtype != b->data.dtype && a->data.dtype != TW_F32 && b->data.dtype != TW_F32)
      return tw_error(TW_ERR_DTYPE, "%s: operand dtypes %s and %s differ", op,
                      tw_dtype_name(a->data.dtype), tw_dtype_name(b->data.dtype));
    return TW_OK;
  }
  /* delayed and current are both tensor scales; 1x128 rows with 128x128 tiles is DeepSeek's
   * pairing (activations x weights): both are f32 scales on 128-deep K blocks */
  int ta = a->mode == TW_SCALE_TENSOR_DELAYED ? TW_SCALE_TENSOR_CURRENT
           : a->mode == TW_SCALE_BLOCK_128x128 ? TW_SCALE_BLOCK_1x128 : a->mode;
  int tb = b->mode == TW_SCALE_TENSOR_DELAYED ? TW_SCALE_TENSOR_CURRENT
           : b->mode == TW_SCALE_BLOCK_128x128 ? TW_SCALE_BLOCK_1x128 : b->mode;
  if (ta != tb)
    return tw_error(TW_ERR_INVALID_ARG, "%s: operands use different scaling modes (%s, %s)", op,
                    tw_scaling_name(a->mode), tw_scaling_name(b->mode));
  if (a->data.dtype == TW_E5M2 && b->data.dtype == TW_E5M2)
    return tw_error(TW_ERR_DTYPE, "%s: e5m2 x e5m2 is not a supported fp8 pair", op);
  return TW_OK;
}

static tw_status check_out(const char *op, const tw_ctx *ctx, const tw_tensor *out, int ndim,
                           const int64_t *shape) {
  TW_TRY(tw_v_tensor(op, "out", out, ctx->ops->mem, ndim));
  TW_TRY(tw_v_dtype_in(op, "out", out, out_dtypes, 3));
  return tw_v_shape_is(op, "out", out, ndim, shape);
}

/* An output that shares bytes with an input would be overwritten while it is read. */
static int overlaps(const tw_tensor *x, const tw_tensor *y) {
  if (tw_tensor_is_none(x) || tw_tensor_is_none(y) || !x->data || !y->data) return 0;
  size_t nx = tw_tensor_bytes(x), ny = tw_tensor_bytes(y);
  if (nx == 0 || ny == 0) return 0;
  uintptr_t x0 = (uintptr_t)x->data, y0 = (uintptr_t)y->data;
  return x0 < y0 + ny && y0 < x0 + nx;
}

static tw_status check_no_alias(const char *op, const tw_tensor *out, const char *an,
                                const tw_operand *a, const char *bn, const tw_operand *b,
                                const tw_tensor *group_sizes) {
  const tw_operand *ops[2] = {a, b};
  const char *names[2] = {an, bn};
  for (int i = 0; i < 2; i++) {
    if (overlaps(out, &ops[i]->data))
      return tw_error(TW_ERR_INVALID_ARG, "%s: out overlaps %s (in-place GEMMs are not supported)",
                      op, names[i]);
    if (ops[i]->mode != TW_SCALE_NONE && overlaps(out, &ops[i]->scale_inv))
      return tw_error(TW_ERR_INVALID_ARG, "%s: out overlaps %s's scale_inv", op, names[i]);
  }
  if (group_sizes && overlaps(out, group_sizes))
    return tw_error(TW_ERR_INVALID_ARG, "%s: out overlaps group_sizes", op);
  return TW_OK;
}

tw_status tw_gemm_alignment(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b,
                            tw_op op_b, const tw_tensor *out) {
  if (!ctx) return tw_error(TW_ERR_NULL, "gemm_alignment: ctx is NULL");
  if (!ctx->ops->gemm_alignment) return TW_OK;
  return ctx->ops->gemm_alignment(ctx, a, op_a, b, op_b, out);
}

static tw_status check_op(const char *op, const char *name, tw_op o) {
  if (o != TW_OP_N && o != TW_OP_T)
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s is %d, not N(0) or T(1)", op, name, (int)o);
  return TW_OK;
}

tw_status tw_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                  tw_tensor *out, int accumulate) {
  const char *op = "gemm";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(check_op(op, "op_a", op_a));
  TW_TRY(check_op(op, "op_b", op_b));
  int ba, bb;
  TW_TRY(reject_padded(op, "a", a));
  TW_TRY(reject_padded(op, "b", b));
  TW_TRY(check_operand(op, "a", ctx, a, NULL, 1, &ba));
  TW_TRY(check_operand(op, "b", ctx, b, NULL, 1, &bb));
  TW_TRY(check_pair(op, a, b));
  const tw_tensor *A = &a->data, *B = &b->data;
  if (A->ndim < 2 || A->ndim > 3 || B->ndim < 2 || B->ndim > 3)
    return tw_error(TW_ERR_SHAPE, "%s: operands must be 2-D or 3-D, got a %d-D and b %d-D", op,
                    A->ndim, B->ndim);
  if (a->mode != TW_SCALE_NONE && (A->ndim != 2 || B->ndim != 2))
    return tw_error(TW_ERR_SHAPE, "%s: quantized operands must be 2-D (batch them as groups)", op);
  int64_t batch = A->ndim == 3 ? A->shape[0] : (B->ndim == 3 ? B->shape[0] : 0);
  if (A->ndim == 3 && B->ndim == 3 && A->shape[0] != B->shape[0])
    return tw_error(TW_ERR_SHAPE, "%s: batch sizes differ: a has %lld, b has %lld", op,
                    (long long)A->shape[0], (long long)B->shape[0]);
  int oa = A->ndim - 2, ob = B->ndim - 2;
  int64_t M = op_a == TW_OP_N ? A->shape[oa] : A->shape[oa + 1];
  int64_t Ka = op_a == TW_OP_N ? A->shape[oa + 1] : A->shape[oa];
  int64_t Kb = op_b == TW_OP_N ? B->shape[ob] : B->shape[ob + 1];
  int64_t N = op_b == TW_OP_N ? B->shape[ob + 1] : B->shape[ob];
  if (Ka != Kb)
    return tw_error(TW_ERR_SHAPE, "%s: contracting dims differ: op(a) is [%lld, %lld], op(b) is [%lld, %lld]",
                    op, (long long)M, (long long)Ka, (long long)Kb, (long long)N);
  TW_TRY(check_blocks(op, "a", a, ba, op_a == TW_OP_N ? BLOCKS_LAST : BLOCKS_FIRST));
  TW_TRY(check_blocks(op, "b", b, bb, op_b == TW_OP_N ? BLOCKS_FIRST : BLOCKS_LAST));
  int64_t oshape[3];
  int ond = batch ? 3 : 2;
  if (batch) { oshape[0] = batch; oshape[1] = M; oshape[2] = N; }
  else { oshape[0] = M; oshape[1] = N; }
  TW_TRY(check_out(op, ctx, out, ond, oshape));
  TW_TRY(check_no_alias(op, out, "a", a, "b", b, NULL));
  TW_TRY(tw_gemm_alignment(ctx, a, op_a, b, op_b, out));
  if (!ctx->ops->gemm)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->gemm(ctx, a, op_a, b, op_b, out, accumulate ? 1 : 0);
}

/* lhs_rows of a row-gathered lhs (tw_gemm.h): [M] i32 in ctx's memory; M = its length. */
static tw_status check_rows_tensor(const char *op, const tw_ctx *ctx, const tw_tensor *rows, int64_t *M) {
  if (!rows) return tw_error(TW_ERR_NULL, "%s: lhs_rows is NULL", op);
  TW_TRY(tw_v_tensor(op, "lhs_rows", rows, ctx->ops->mem, 1));
  if (rows->dtype != TW_I32)
    return tw_error(TW_ERR_DTYPE, "%s: lhs_rows is %s, expected i32", op, tw_dtype_name(rows->dtype));
  *M = rows->shape[0];
  return TW_OK;
}

/* Host lhs_rows and group sizes: every entry read (i < S) in [-1, U), before any work (a
 * device backend reports through its error word). */
static tw_status check_rows_values(const char *op, const tw_tensor *rows, const tw_tensor *group_sizes, int64_t U) {
  if (rows->mem != TW_MEM_HOST || group_sizes->mem != TW_MEM_HOST) return TW_OK;
  int64_t S = 0;
  for (int64_t g = 0; g < group_sizes->shape[0]; g++) S += ((const int32_t *)group_sizes->data)[g];
  for (int64_t i = 0; i < S; i++) {
    int32_t v = ((const int32_t *)rows->data)[i];
    if (v < -1 || v >= U)
      return tw_error(TW_ERR_INVALID_ARG, "%s: lhs_rows[%lld] = %d is outside [-1, U = %lld) (lhs has %lld rows)", op,
                      (long long)i, v, (long long)U, (long long)U);
  }
  return TW_OK;
}

/* Everything the grouped forward checks; rows: a row-gathered lhs ([U, K], quantized as one
 * group) with lhs_rows giving M, else lhs [M, K] quantized by group_sizes. */
static tw_status check_grouped_fwd(const char *op, tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *rows,
                                   const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                                   tw_tensor *out) {
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(check_op(op, "rhs_op", rhs_op));
  if (!lhs) return tw_error(TW_ERR_NULL, "%s: lhs is NULL", op);
  if (!rhs) return tw_error(TW_ERR_NULL, "%s: rhs is NULL", op);
  TW_TRY(reject_padded(op, "lhs", lhs));
  TW_TRY(reject_padded(op, "rhs", rhs));
  const tw_tensor *L = &lhs->data, *R = &rhs->data;
  TW_TRY(tw_v_tensor(op, "lhs", L, ctx->ops->mem, -1));
  TW_TRY(tw_v_tensor(op, "rhs", R, ctx->ops->mem, -1));
  if (L->ndim != 2)
    return tw_error(TW_ERR_SHAPE, "%s: lhs must be 2-D [%s, K], has %d dims", op, rows ? "U" : "M", L->ndim);
  int64_t M = L->shape[0], K = L->shape[1], U = L->shape[0], G;
  if (rows) TW_TRY(check_rows_tensor(op, ctx, rows, &M));
  TW_TRY(tw_v_group_sizes(op, ctx, group_sizes, M, rows ? "lhs_rows" : "lhs", &G, NULL));
  int bl, br;
  TW_TRY(check_operand(op, "lhs", ctx, lhs, rows ? NULL : group_sizes, rows ? 1 : G, &bl));
  TW_TRY(check_operand(op, "rhs", ctx, rhs, NULL, G, &br));
  TW_TRY(check_pair(op, lhs, rhs));
  int64_t N;
  if (rhs->mode == TW_SCALE_NONE) {
    if (R->ndim != 3)
      return tw_error(TW_ERR_SHAPE, "%s: rhs must be 3-D [G, K, N] or [G, N, K], has %d dims", op, R->ndim);
    if (R->shape[0] != G)
      return tw_error(TW_ERR_SHAPE, "%s: rhs has %lld groups but group_sizes has %lld", op,
                      (long long)R->shape[0], (long long)G);
    int64_t Kr = rhs_op == TW_OP_N ? R->shape[1] : R->shape[2];
    N = rhs_op == TW_OP_N ? R->shape[2] : R->shape[1];
    if (Kr != K)
      return tw_error(TW_ERR_SHAPE, "%s: lhs has K = %lld but rhs (%s) has K = %lld", op, (long long)K,
                      rhs_op == TW_OP_N ? "[G, K, N]" : "[G, N, K]", (long long)Kr);
  } else {
    if (lhs->colwise || lhs->src_rows != (rows ? U : M) || lhs->src_cols != K) {
      if (rows)
        return tw_error(TW_ERR_INVALID_ARG,
                        "%s: a quantized lhs must be the rowwise data of a [U, K] = [%lld, %lld] source quantized as "
                        "one group", op, (long long)U, (long long)K);
      return tw_error(TW_ERR_INVALID_ARG, "%s: a quantized lhs must be the rowwise data of an [M, K] = [%lld, %lld] source",
                      op, (long long)M, (long long)K);
    }
    int64_t r, c;
    storage_of(rhs, G, &r, &c);
    int64_t Kr = rhs_op == TW_OP_N ? r : c;
    N = rhs_op == TW_OP_N ? c : r;
    if (Kr != K)
      return tw_error(TW_ERR_SHAPE, "%s: lhs has K = %lld but each rhs group stores [%lld, %lld] (%s)", op,
                      (long long)K, (long long)r, (long long)c, rhs_op == TW_OP_N ? "K, N" : "N, K");
    TW_TRY(check_blocks(op, "lhs", lhs, bl, BLOCKS_LAST));
    TW_TRY(check_blocks(op, "rhs", rhs, br, rhs_op == TW_OP_N ? BLOCKS_FIRST : BLOCKS_LAST));
  }
  int64_t oshape[2] = {M, N};
  TW_TRY(check_out(op, ctx, out, 2, oshape));
  TW_TRY(check_no_alias(op, out, "lhs", lhs, "rhs", rhs, group_sizes));
  if (rows && overlaps(out, rows)) return tw_error(TW_ERR_INVALID_ARG, "%s: out overlaps lhs_rows", op);
  if (rows) TW_TRY(check_rows_values(op, rows, group_sizes, U));
  return TW_OK;
}

tw_status tw_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs, tw_op rhs_op,
                          const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm";
  TW_TRY(check_grouped_fwd(op, ctx, lhs, NULL, rhs, rhs_op, group_sizes, out));
  if (!ctx->ops->grouped_gemm)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->grouped_gemm(ctx, lhs, rhs, rhs_op, group_sizes, out, accumulate ? 1 : 0);
}

tw_status tw_grouped_gemm_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                               const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                               tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm_rows";
  if (ctx && !lhs_rows) return tw_error(TW_ERR_NULL, "%s: lhs_rows is NULL", op);
  TW_TRY(check_grouped_fwd(op, ctx, lhs, lhs_rows, rhs, rhs_op, group_sizes, out));
  if (!ctx->ops->grouped_gemm_rows)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->grouped_gemm_rows(ctx, lhs, lhs_rows, rhs, rhs_op, group_sizes, out, accumulate ? 1 : 0);
}

tw_status tw_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                const tw_operand *rhs, tw_op rhs_op,
                                const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm_wgrad";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(check_op(op, "lhs_op", lhs_op));
  TW_TRY(check_op(op, "rhs_op", rhs_op));
  if (!lhs) return tw_error(TW_ERR_NULL, "%s: lhs is NULL", op);
  if (!rhs) return tw_error(TW_ERR_NULL, "%s: rhs is NULL", op);
  TW_TRY(tw_v_tensor(op, "lhs", &lhs->data, ctx->ops->mem, -1));
  TW_TRY(tw_v_tensor(op, "rhs", &rhs->data, ctx->ops->mem, -1));
  /* Logical shapes: lhs [M, K], rhs [M, N] whatever the storage. */
  int64_t M, K, N;
  if (lhs->mode == TW_SCALE_NONE) {
    if (lhs->data.ndim != 2 || rhs->data.ndim != 2)
      return tw_error(TW_ERR_SHAPE, "%s: lhs and rhs must be 2-D", op);
    M = lhs_op == TW_OP_N ? lhs->data.shape[0] : lhs->data.shape[1];
    K = lhs_op == TW_OP_N ? lhs->data.shape[1] : lhs->data.shape[0];
  } else {
    M = lhs->src_rows;
    K = lhs->src_cols;
  }
  if (rhs->mode == TW_SCALE_NONE) {
    if (rhs->data.ndim != 2) return tw_error(TW_ERR_SHAPE, "%s: rhs must be 2-D", op);
    int64_t Mr = rhs_op == TW_OP_N ? rhs->data.shape[0] : rhs->data.shape[1];
    N = rhs_op == TW_OP_N ? rhs->data.shape[1] : rhs->data.shape[0];
    if (Mr != M)
      return tw_error(TW_ERR_SHAPE, "%s: lhs has %lld rows but rhs has %lld", op, (long long)M, (long long)Mr);
  } else {
    N = rhs->src_cols;
    if (rhs->src_rows != M)
      return tw_error(TW_ERR_SHAPE, "%s: lhs has %lld rows but rhs has %lld", op, (long long)M,
                      (long long)rhs->src_rows);
  }
  int64_t G;
  TW_TRY(tw_v_group_sizes(op, ctx, group_sizes, M, "lhs", &G, NULL));
  int bl, br;
  TW_TRY(check_operand(op, "lhs", ctx, lhs, group_sizes, G, &bl));
  TW_TRY(check_operand(op, "rhs", ctx, rhs, group_sizes, G, &br));
  TW_TRY(check_pair(op, lhs, rhs));
  if (lhs->mode != TW_SCALE_NONE) {
    /* op T means per-group transposed storage: only the transposed colwise copy is that. */
    int lt = lhs->colwise && transposed_colwise(lhs->mode);
    int rt = rhs->colwise && transposed_colwise(rhs->mode);
    if (lt != (lhs_op == TW_OP_T))
      return tw_error(TW_ERR_INVALID_ARG, "%s: lhs_op is %s but the lhs data is %s", op,
                      lhs_op == TW_OP_T ? "T" : "N", lt ? "per-group transposed (use T)" : "row-major [M, K] (use N)");
    if (rt != (rhs_op == TW_OP_T))
      return tw_error(TW_ERR_INVALID_ARG, "%s: rhs_op is %s but the rhs data is %s", op,
                      rhs_op == TW_OP_T ? "T" : "N", rt ? "per-group transposed (use T)" : "row-major [M, N] (use N)");
    /* contraction over the ragged rows: first storage dim for N, last for T */
    TW_TRY(check_blocks(op, "lhs", lhs, bl, lhs_op == TW_OP_N ? BLOCKS_FIRST : BLOCKS_LAST));
    TW_TRY(check_blocks(op, "rhs", rhs, br, rhs_op == TW_OP_N ? BLOCKS_FIRST : BLOCKS_LAST));
  }
  int64_t oshape[3] = {G, K, N};
  TW_TRY(check_out(op, ctx, out, 3, oshape));
  TW_TRY(check_no_alias(op, out, "lhs", lhs, "rhs", rhs, group_sizes));
  if (!ctx->ops->grouped_gemm_wgrad)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->grouped_gemm_wgrad(ctx, lhs, lhs_op, rhs, rhs_op, group_sizes, out, accumulate ? 1 : 0);
}

tw_status tw_grouped_gemm_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                     const tw_operand *rhs, tw_op rhs_op,
                                     const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  const char *op = "grouped_gemm_wgrad_rows";
  if (!ctx) return tw_error(TW_ERR_NULL, "%s: ctx is NULL", op);
  TW_TRY(check_op(op, "rhs_op", rhs_op));
  if (!lhs) return tw_error(TW_ERR_NULL, "%s: lhs is NULL", op);
  if (!rhs) return tw_error(TW_ERR_NULL, "%s: rhs is NULL", op);
  if (lhs->mode != TW_SCALE_NONE || rhs->mode != TW_SCALE_NONE)
    return tw_error(TW_ERR_INVALID_ARG, "%s: takes plain operands (lhs is %s, rhs is %s)", op,
                    tw_scaling_name(lhs->mode), tw_scaling_name(rhs->mode));
  TW_TRY(tw_v_tensor(op, "lhs", &lhs->data, ctx->ops->mem, 2));
  TW_TRY(tw_v_tensor(op, "rhs", &rhs->data, ctx->ops->mem, 2));
  int64_t M, U = lhs->data.shape[0], K = lhs->data.shape[1], G;
  TW_TRY(check_rows_tensor(op, ctx, lhs_rows, &M));
  int64_t Mr = rhs_op == TW_OP_N ? rhs->data.shape[0] : rhs->data.shape[1];
  int64_t N = rhs_op == TW_OP_N ? rhs->data.shape[1] : rhs->data.shape[0];
  if (Mr != M)
    return tw_error(TW_ERR_SHAPE, "%s: lhs_rows has %lld rows but rhs has %lld", op, (long long)M, (long long)Mr);
  TW_TRY(tw_v_group_sizes(op, ctx, group_sizes, M, "lhs_rows", &G, NULL));
  int bl, br;
  TW_TRY(check_operand(op, "lhs", ctx, lhs, NULL, 1, &bl));
  TW_TRY(check_operand(op, "rhs", ctx, rhs, group_sizes, G, &br));
  TW_TRY(check_pair(op, lhs, rhs));
  int64_t oshape[3] = {G, K, N};
  TW_TRY(check_out(op, ctx, out, 3, oshape));
  TW_TRY(check_no_alias(op, out, "lhs", lhs, "rhs", rhs, group_sizes));
  if (overlaps(out, lhs_rows)) return tw_error(TW_ERR_INVALID_ARG, "%s: out overlaps lhs_rows", op);
  TW_TRY(check_rows_values(op, lhs_rows, group_sizes, U));
  if (!ctx->ops->grouped_gemm_wgrad_rows)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return ctx->ops->grouped_gemm_wgrad_rows(ctx, lhs, lhs_rows, rhs, rhs_op, group_sizes, out, accumulate ? 1 : 0);
}
