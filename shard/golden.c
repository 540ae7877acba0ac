/* The sharding golden sweep (see golden.h). */
#include "shard/golden.h"
#include "ops/data.h"
#include "ops/pass.h"

#include "ops/registry.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_quantize.h"

/* Provided by //gpu; a ref-only binary has none. */
#pragma weak tw_comm_init_nccl_local

/* ---- the rules swept ----------------------------------------------------------------- */
typedef struct {
  const char *name;
  tw_shard_op op;
  int npasses;
  int xnd, wnd;
  int64_t xs[3], ws[3];
  int64_t G;
  int naxes;
  tw_axis axes[4];
  tw_scaling mode;
  tw_qlayout layout;
  int qin, qbg; /* grouped_gemm: fp8 inputs; quantized before the gather */
  const char *kernel; /* gpu only: the rule runs with this kernel version forced (tw_ctx_config.kernel);
                         the ref sweep leaves such rules out */
} rule_desc;

#define DP TW_AXIS_DP
#define FSDP TW_AXIS_FSDP
#define EP TW_AXIS_EP
#define TP TW_AXIS_TP
static const rule_desc rules[] = {
    {"dense2", TW_SHARD_DENSE, 3, 2, 2, {16, 16}, {16, 16}, 0, 3, {DP, FSDP, TP}, 0, 0, 0, 0, NULL},
    {"dense3", TW_SHARD_DENSE, 3, 3, 2, {8, 8, 16}, {16, 16}, 0, 3, {DP, FSDP, TP}, 0, 0, 0, 0, NULL},
    {"dense3.batched_w", TW_SHARD_DENSE, 3, 3, 3, {8, 8, 16}, {8, 16, 16}, 0, 3, {DP, FSDP, TP}, 0, 0, 0, 0, NULL},
    {"grouped_gemm", TW_SHARD_GROUPED_GEMM, 3, 2, 3, {64, 16}, {8, 16, 16}, 8, 4, {DP, FSDP, EP, TP}, 0, 0, 0, 0, NULL},
    /* on gpu K and N are 64 (shapes_for): fp8 shards keep 16-byte rows up to 4 ranks */
    {"grouped_gemm.fp8", TW_SHARD_GROUPED_GEMM, 3, 2, 3, {64, 16}, {8, 16, 16}, 8, 4, {DP, FSDP, EP, TP}, 0, 0, 1, 0, NULL},
    /* quantized before the gather: fwd and dgrad (the wgrad has no w: its rule error is a plan test) */
    {"grouped_gemm.fp8.qbg", TW_SHARD_GROUPED_GEMM, 2, 2, 3, {64, 16}, {8, 16, 16}, 8, 4, {DP, FSDP, EP, TP}, 0, 0, 1, 1, NULL},
    /* gpu only: the fp8 passes again on gg_mma_wide, whose exact f32 model is tight. The default
     * fp8 dgrad runs gg_wgmma_fp8, judged by its promoted model (about 1.6% of sum |a||b| at
     * these sizes): loose enough to miss a wrong amax axis or an unquantized operand, which this
     * rule's f32 bound catches */
    {"grouped_gemm.fp8.exact_kernel", TW_SHARD_GROUPED_GEMM, 3, 2, 3, {64, 16}, {8, 16, 16}, 8, 4, {DP, FSDP, EP, TP},
     0, 0, 1, 0, "gg_mma_wide"},
    {"quantize.current", TW_SHARD_GROUPED_QUANTIZE, 1, 2, 0, {64, 256}, {0}, 4, 4, {DP, FSDP, EP, TP},
     TW_SCALE_TENSOR_CURRENT, TW_ROWWISE_COLWISE, 0, 0, NULL},
    {"quantize.delayed", TW_SHARD_GROUPED_QUANTIZE, 1, 2, 0, {64, 256}, {0}, 4, 4, {DP, FSDP, EP, TP},
     TW_SCALE_TENSOR_DELAYED, TW_ROWWISE, 0, 0, NULL},
    {"quantize.mxfp8.row", TW_SHARD_GROUPED_QUANTIZE, 1, 2, 0, {64, 256}, {0}, 4, 4, {DP, FSDP, EP, TP},
     TW_SCALE_MXFP8_1D, TW_ROWWISE, 0, 0, NULL},
    {"quantize.mxfp8.rowcol", TW_SHARD_GROUPED_QUANTIZE, 1, 2, 0, {64, 256}, {0}, 4, 4, {DP, FSDP, EP, TP},
     TW_SCALE_MXFP8_1D, TW_ROWWISE_COLWISE, 0, 0, NULL},
    {"quantize.block1x128.row", TW_SHARD_GROUPED_QUANTIZE, 1, 2, 0, {64, 256}, {0}, 4, 4, {DP, FSDP, EP, TP},
     TW_SCALE_BLOCK_1x128, TW_ROWWISE, 0, 0, NULL},
    {"quantize.block128x128", TW_SHARD_GROUPED_QUANTIZE, 1, 2, 0, {64, 256}, {0}, 4, 4, {DP, FSDP, EP, TP},
     TW_SCALE_BLOCK_128x128, TW_ROWWISE, 0, 0, NULL},
};
enum { NRULES = (int)(sizeof rules / sizeof rules[0]) };

/* The rules as a backend runs them: the gpu's fp8 GEMMs want 16-byte leading dimensions
 * (tw_gemm_alignment), so its fp8 shapes are wider; the ref keeps them small (its fp8 path
 * is slow on purpose: plain loops). */
static void shapes_for(tw_backend b, rule_desc *out) {
  memcpy(out, rules, sizeof rules);
  if (b != TW_BACKEND_GPU) return;
  for (int i = 0; i < NRULES; i++)
    if (out[i].qin) {
      out[i].xs[1] = 64;
      out[i].ws[1] = out[i].ws[2] = 64;
    }
}

/* ---- data -------------------------------------------------------------------------------- */
static uint64_t rng_state;
static double urand(void) { return tw_splitmix_unit(&rng_state); }


typedef struct {
  int ep;             /* the ep size the group sizes were drawn for */
  float *x, *w, *dy;  /* global inputs (dy has y's shape) */
  int32_t *gs;
  float *scale;       /* delayed scaling: [G] */
  float *expect[3], *absprod[3]; /* per pass: unsharded result, and the same op on |inputs| */
  float *absprod_lift[3];        /* fp8: the op on the lifted |inputs| (tw_fp8_lift_subnormal_codes), the
                                    promoted model's magnitudes (gpu fp8 dgrad: gg_wgmma_fp8) */
  int64_t contract[3];
  float *deq_row, *deq_col, *amax; /* quantize */
} golden_data;

static void data_free(golden_data *d) {
  free(d->x); free(d->w); free(d->dy); free(d->gs); free(d->scale);
  for (int i = 0; i < 3; i++) { free(d->expect[i]); free(d->absprod[i]); free(d->absprod_lift[i]); }
  free(d->deq_row); free(d->deq_col); free(d->amax);
  memset(d, 0, sizeof *d);
}

static void out_shape(const rule_desc *r, tw_pass pass, int *nd, int64_t *s) {
  memset(s, 0, sizeof(int64_t) * TW_MAX_DIMS);
  if (r->op == TW_SHARD_DENSE) {
    int xb = r->xnd == 3;
    int64_t B = xb ? r->xs[0] : 1, M = r->xs[xb], K = r->xs[xb + 1], N = r->ws[r->wnd - 1];
    int64_t y[3] = {B, M, N}, dx[3] = {B, M, K}, dw[3] = {B, K, N};
    const int64_t *src = pass == TW_PASS_FWD ? y : pass == TW_PASS_DGRAD ? dx : dw;
    int n = pass == TW_PASS_WGRAD ? r->wnd : r->xnd;
    int off = 3 - n;
    for (int i = 0; i < n; i++) s[i] = src[off + i];
    *nd = n;
  } else {
    int64_t M = r->xs[0], K = r->xs[1], G = r->ws[0], N = r->ws[2];
    if (pass == TW_PASS_WGRAD) { *nd = 3; s[0] = G; s[1] = K; s[2] = N; }
    else { *nd = 2; s[0] = M; s[1] = pass == TW_PASS_FWD ? N : K; }
  }
}

/* Group sizes: ep blocks of M/ep rows, each split at random over its G/ep experts, with
 * empty groups; quantize leaves a 3-row tail. */
static void draw_groups(const rule_desc *r, int ep, int32_t *gs) {
  int64_t M = r->xs[0], G = r->G, Gl = G / ep, rows = M / ep;
  for (int e = 0; e < ep; e++) {
    int64_t left = rows - (r->op == TW_SHARD_GROUPED_QUANTIZE && e == ep - 1 ? 3 : 0);
    for (int64_t g = 0; g < Gl; g++) {
      int64_t take = g == Gl - 1 ? left : (int64_t)(urand() * (double)(left + 1));
      if (g == 1 % Gl && Gl > 1 && g != Gl - 1) take = 0; /* a forced empty group, as TE tests */
      gs[e * Gl + g] = (int32_t)take;
      left -= take;
    }
  }
}

static tw_status host_ctx(tw_ctx **ctx, tw_comm *comm) {
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.comm = comm;
  return tw_ctx_create(ctx, &cfg);
}


/* The unsharded op of one pass on host buffers (dense or grouped). */
static tw_status unsharded_gemm(tw_ctx *ctx, const rule_desc *r, tw_pass pass, const float *x, const float *w,
                                const float *dy, const int32_t *gs, float *out) {
  int64_t ys[TW_MAX_DIMS];
  int ynd;
  out_shape(r, TW_PASS_FWD, &ynd, ys);
  tw_tensor xt = tw_host_tensor((void *)x, TW_F32, r->xnd, r->xs), wt = tw_host_tensor((void *)w, TW_F32, r->wnd, r->ws);
  tw_tensor dyt = tw_host_tensor((void *)dy, TW_F32, ynd, ys);
  int64_t os[TW_MAX_DIMS];
  int ond;
  out_shape(r, pass, &ond, os);
  tw_tensor ot = tw_host_tensor(out, TW_F32, ond, os);
  tw_tensor gst = tw_tensor_1d((void *)gs, TW_I32, r->G, TW_MEM_HOST);
  const tw_tensor *in_a = pass == TW_PASS_DGRAD ? &dyt : &xt, *in_b = pass == TW_PASS_WGRAD ? &dyt : &wt;
  return tw_pass_gemm(ctx, r->op, pass, in_a, in_b, &gst, &ot);
}

static tw_quantize_opts rule_qopts(const rule_desc *r) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = r->mode;
  o.qdtype = TW_E4M3;
  o.layout = r->layout;
  o.mxfp8_swizzled = 1;
  return o;
}

/* Memory in ctx's space: a copy of a host tensor, or poisoned fresh memory. */
static tw_status to_ctx(tw_ctx *ctx, const tw_tensor *host, tw_tensor *out) {
  *out = *host;
  out->mem = tw_ctx_mem(ctx);
  out->data = NULL;
  TW_TRY(tw_alloc(ctx, tw_tensor_bytes(host), &out->data));
  return tw_tensor_copy(ctx, out, host);
}
static tw_status ctx_poisoned(tw_ctx *ctx, tw_dtype dt, int nd, const int64_t *shape, tw_tensor *out) {
  *out = tw_host_tensor(NULL, dt, nd, shape);
  out->mem = tw_ctx_mem(ctx);
  TW_TRY(tw_alloc(ctx, tw_tensor_bytes(out), &out->data));
  return tw_memset(ctx, out->data, TW_POISON_BYTE, tw_tensor_bytes(out));
}
static void ctx_release(tw_ctx *ctx, tw_tensor *t) {
  if (t->data) tw_free(ctx, t->data);
  t->data = NULL;
}

/* Allocates the buffers of q (shapes already filled) in ctx's memory and poisons them.
 * Tensor scaling's rowwise and colwise outputs share one scale_inv buffer. */
static tw_status q_alloc(tw_ctx *ctx, tw_qtensor *q) {
  int tensor_mode = q->mode == TW_SCALE_TENSOR_CURRENT || q->mode == TW_SCALE_TENSOR_DELAYED;
  int share = tensor_mode && !tw_tensor_is_none(&q->row_scale_inv) && !tw_tensor_is_none(&q->col_scale_inv);
  tw_tensor *parts[5] = {&q->row_data, &q->row_scale_inv, &q->col_data, &q->col_scale_inv, &q->amax};
  for (int i = 0; i < 5; i++) {
    tw_tensor *t = parts[i];
    if (tw_tensor_is_none(t) || (share && t == &q->col_scale_inv)) continue;
    TW_TRY(ctx_poisoned(ctx, t->dtype, t->ndim, t->shape, t));
  }
  if (share) q->col_scale_inv = q->row_scale_inv;
  return TW_OK;
}

static void q_free(tw_ctx *ctx, tw_qtensor *q) {
  if (q->col_scale_inv.data == q->row_scale_inv.data) q->col_scale_inv.data = NULL;
  tw_tensor *parts[5] = {&q->row_data, &q->row_scale_inv, &q->col_data, &q->col_scale_inv, &q->amax};
  for (int i = 0; i < 5; i++)
    if (!tw_tensor_is_none(parts[i])) ctx_release(ctx, parts[i]);
  memset(q, 0, sizeof *q);
}

/* Dequantized rowwise / colwise [M, K] f32 into host buffers (poison where untouched), each
 * only if its buffer is given. gs lives in ctx's memory. */
static tw_status dequant_both(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *gs, float *row, float *col) {
  int64_t s[2] = {q->rows, q->cols};
  float *host[2] = {row, col};
  for (int c = 0; c < 2; c++) {
    if (!host[c]) continue;
    tw_tensor o, h = tw_host_tensor(host[c], TW_F32, 2, s);
    TW_TRY(ctx_poisoned(ctx, TW_F32, 2, s, &o));
    tw_status st = tw_grouped_dequantize(ctx, q, gs, c, &o);
    if (st == TW_OK) st = tw_tensor_copy(ctx, &h, &o);
    ctx_release(ctx, &o);
    TW_TRY(st);
  }
  return TW_OK;
}

/* The output buffers of pass p (expected, |a||b| and, for fp8, the lifted |a||b|), zeroed; its
 * shape in ond / os. */
static tw_status pass_buffers(const rule_desc *r, int p, golden_data *d, int lifted, int *ond, int64_t *os) {
  out_shape(r, (tw_pass)p, ond, os);
  int64_t no = tw_numel(*ond, os);
  d->expect[p] = (float *)calloc((size_t)no, sizeof(float));
  d->absprod[p] = (float *)calloc((size_t)no, sizeof(float));
  if (lifted) d->absprod_lift[p] = (float *)calloc((size_t)no, sizeof(float));
  if (!d->expect[p] || !d->absprod[p] || (lifted && !d->absprod_lift[p])) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  return TW_OK;
}

/* The unsharded fp8 passes: x and dy quantized by their groups, w in the uniform form
 * [G*K, N], all tensor current scaling (e4m3), then the pass's grouped GEMM (fwd x w, dgrad
 * dy w^T, wgrad x^T dy per group); the bound's |a||b| from the dequantized values. ax / aw /
 * ady are scratch of x's, w's and dy's sizes. */
static tw_status fp8_expected(tw_ctx *ctx, const rule_desc *r, golden_data *d, float *ax, float *aw, float *ady) {
  int64_t M = r->xs[0], K = r->xs[1], G = r->ws[0], N = r->ws[2];
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = TW_SCALE_TENSOR_CURRENT;
  o.qdtype = TW_E4M3;
  o.layout = TW_ROWWISE;
  tw_qtensor qx, qw, qdy;
  memset(&qx, 0, sizeof qx);
  memset(&qw, 0, sizeof qw);
  memset(&qdy, 0, sizeof qdy);
  int32_t *ugs = (int32_t *)malloc(sizeof(int32_t) * (size_t)G);
  if (!ugs) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  for (int64_t g = 0; g < G; g++) ugs[g] = (int32_t)K;
  int64_t ys[2] = {M, N};
  tw_tensor xt = tw_host_tensor(d->x, TW_F32, 2, r->xs), wt = tw_tensor_2d(d->w, TW_F32, G * K, N, TW_MEM_HOST);
  tw_tensor dyt = tw_host_tensor(d->dy, TW_F32, 2, ys);
  tw_tensor gst = tw_tensor_1d(d->gs, TW_I32, G, TW_MEM_HOST), ugst = tw_tensor_1d(ugs, TW_I32, G, TW_MEM_HOST);
  tw_status s = tw_quantize_output_shapes(&o, M, K, G, &qx);
  if (s == TW_OK) s = tw_quantize_output_shapes(&o, G * K, N, G, &qw);
  if (s == TW_OK) s = tw_quantize_output_shapes(&o, M, N, G, &qdy);
  if (s == TW_OK) s = q_alloc(ctx, &qx);
  if (s == TW_OK) s = q_alloc(ctx, &qw);
  if (s == TW_OK) s = q_alloc(ctx, &qdy);
  if (s == TW_OK) s = tw_grouped_quantize(ctx, &xt, &gst, &o, &qx);
  if (s == TW_OK) s = tw_grouped_quantize(ctx, &wt, &ugst, &o, &qw);
  if (s == TW_OK) s = tw_grouped_quantize(ctx, &dyt, &gst, &o, &qdy);
  /* |dequantized| of each operand, for the bound */
  tw_tensor dxt = tw_host_tensor(ax, TW_F32, 2, r->xs), dwt = tw_tensor_2d(aw, TW_F32, G * K, N, TW_MEM_HOST);
  tw_tensor ddyt = tw_host_tensor(ady, TW_F32, 2, ys);
  if (s == TW_OK) s = tw_grouped_dequantize(ctx, &qx, &gst, 0, &dxt);
  if (s == TW_OK) s = tw_grouped_dequantize(ctx, &qw, &ugst, 0, &dwt);
  if (s == TW_OK) s = tw_grouped_dequantize(ctx, &qdy, &gst, 0, &ddyt);
  if (s == TW_OK) {
    for (int64_t i = 0; i < M * K; i++) ax[i] = fabsf(ax[i]);
    for (int64_t i = 0; i < G * K * N; i++) aw[i] = fabsf(aw[i]);
    for (int64_t i = 0; i < M * N; i++) ady[i] = fabsf(ady[i]);
  }
  tw_tensor a3 = tw_host_tensor(aw, TW_F32, 3, r->ws);
  /* the lifted magnitudes (same as the above unless a code is subnormal) */
  float *lx = (float *)malloc(sizeof(float) * (size_t)(M * K)), *lw = (float *)malloc(sizeof(float) * (size_t)(G * K * N));
  float *ldy = (float *)malloc(sizeof(float) * (size_t)(M * N));
  if (s == TW_OK && (!lx || !lw || !ldy)) s = tw_error(TW_ERR_MEMORY, "golden: out of memory");
  if (s == TW_OK) s = tw_pass_lifted_abs(ctx, &qx, &gst, M, K, lx);
  if (s == TW_OK) s = tw_pass_lifted_abs(ctx, &qw, &ugst, G * K, N, lw);
  if (s == TW_OK) s = tw_pass_lifted_abs(ctx, &qdy, &gst, M, N, ldy);
  tw_tensor lxt = tw_host_tensor(lx, TW_F32, 2, r->xs), lw3 = tw_host_tensor(lw, TW_F32, 3, r->ws);
  tw_tensor ldyt = tw_host_tensor(ldy, TW_F32, 2, ys);
  for (int p = 0; p < r->npasses && s == TW_OK; p++) {
    int64_t os[TW_MAX_DIMS];
    int ond;
    if ((s = pass_buffers(r, p, d, 1, &ond, os)) != TW_OK) break;
    tw_tensor et = tw_host_tensor(d->expect[p], TW_F32, ond, os), at = tw_host_tensor(d->absprod[p], TW_F32, ond, os);
    tw_tensor lt = tw_host_tensor(d->absprod_lift[p], TW_F32, ond, os);
    tw_operand ox = tw_operand_rowwise(&qx), ow = tw_operand_rowwise(&qw), ody = tw_operand_rowwise(&qdy);
    tw_operand px = tw_operand_plain(&dxt), pw = tw_operand_plain(&a3), pdy = tw_operand_plain(&ddyt);
    tw_operand qlx = tw_operand_plain(&lxt), qlw = tw_operand_plain(&lw3), qldy = tw_operand_plain(&ldyt);
    if (p == TW_PASS_FWD) {
      s = tw_grouped_gemm(ctx, &ox, &ow, TW_OP_N, &gst, &et, 0);
      if (s == TW_OK) s = tw_grouped_gemm(ctx, &px, &pw, TW_OP_N, &gst, &at, 0);
      if (s == TW_OK) s = tw_grouped_gemm(ctx, &qlx, &qlw, TW_OP_N, &gst, &lt, 0);
    } else if (p == TW_PASS_DGRAD) {
      s = tw_grouped_gemm(ctx, &ody, &ow, TW_OP_T, &gst, &et, 0);
      if (s == TW_OK) s = tw_grouped_gemm(ctx, &pdy, &pw, TW_OP_T, &gst, &at, 0);
      if (s == TW_OK) s = tw_grouped_gemm(ctx, &qldy, &qlw, TW_OP_T, &gst, &lt, 0);
    } else {
      s = tw_grouped_gemm_wgrad(ctx, &ox, TW_OP_N, &ody, TW_OP_N, &gst, &et, 0);
      if (s == TW_OK) s = tw_grouped_gemm_wgrad(ctx, &px, TW_OP_N, &pdy, TW_OP_N, &gst, &at, 0);
      if (s == TW_OK) s = tw_grouped_gemm_wgrad(ctx, &qlx, TW_OP_N, &qldy, TW_OP_N, &gst, &lt, 0);
    }
    d->contract[p] = p == TW_PASS_FWD ? K : p == TW_PASS_DGRAD ? N : M;
  }
  q_free(ctx, &qx);
  q_free(ctx, &qw);
  q_free(ctx, &qdy);
  free(ugs);
  free(lx); free(lw); free(ldy);
  return s;
}

static tw_status make_data(const rule_desc *r, int index, int ep, golden_data *d) {
  memset(d, 0, sizeof *d);
  d->ep = ep;
  rng_state = 0x5eed0000ull + (uint64_t)index * 131 + (uint64_t)ep;
  int64_t nx = tw_numel(r->xnd, r->xs), nw = r->wnd ? tw_numel(r->wnd, r->ws) : 0;
  int64_t ys[TW_MAX_DIMS];
  int ynd;
  d->x = (float *)malloc(sizeof(float) * (size_t)nx);
  if (!d->x) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  if (r->op == TW_SHARD_GROUPED_QUANTIZE) {
    int64_t M = r->xs[0], K = r->xs[1];
    d->gs = (int32_t *)calloc((size_t)r->G, sizeof(int32_t));
    d->scale = (float *)malloc(sizeof(float) * (size_t)r->G);
    if (!d->gs || !d->scale) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
    draw_groups(r, ep, d->gs);
    /* magnitudes vary by row band so groups and blocks get different scales */
    for (int64_t i = 0; i < M; i++)
      for (int64_t k = 0; k < K; k++) d->x[i * K + k] = (float)((urand() * 2 - 1) * ldexp(1.0, (int)(i % 7) - 3));
    for (int64_t g = 0; g < r->G; g++) d->scale[g] = (float)ldexp(1.0, (int)g + 2);
    tw_ctx *ctx = NULL;
    TW_TRY(host_ctx(&ctx, NULL));
    tw_quantize_opts o = rule_qopts(r);
    tw_tensor scale = tw_tensor_1d(d->scale, TW_F32, r->G, TW_MEM_HOST);
    if (o.mode == TW_SCALE_TENSOR_DELAYED) o.scale = scale;
    tw_qtensor q;
    tw_status s = tw_quantize_output_shapes(&o, M, K, r->G, &q);
    if (s == TW_OK) s = q_alloc(ctx, &q);
    tw_tensor xt = tw_host_tensor(d->x, TW_F32, 2, r->xs), gst = tw_tensor_1d(d->gs, TW_I32, r->G, TW_MEM_HOST);
    if (s == TW_OK) s = tw_grouped_quantize(ctx, &xt, &gst, &o, &q);
    d->deq_row = r->layout & TW_ROWWISE ? (float *)malloc(sizeof(float) * (size_t)(M * K)) : NULL;
    d->deq_col = r->layout & TW_COLWISE ? (float *)malloc(sizeof(float) * (size_t)(M * K)) : NULL;
    d->amax = (float *)malloc(sizeof(float) * (size_t)r->G);
    if (s == TW_OK && (!d->amax || ((r->layout & TW_ROWWISE) && !d->deq_row) || ((r->layout & TW_COLWISE) && !d->deq_col)))
      s = tw_error(TW_ERR_MEMORY, "golden: out of memory");
    if (s == TW_OK) s = dequant_both(ctx, &q, &gst, d->deq_row, d->deq_col);
    if (s == TW_OK && !tw_tensor_is_none(&q.amax) && q.amax.data) memcpy(d->amax, q.amax.data, sizeof(float) * (size_t)r->G);
    q_free(ctx, &q);
    tw_ctx_destroy(ctx);
    return s;
  }
  out_shape(r, TW_PASS_FWD, &ynd, ys);
  int64_t ny = tw_numel(ynd, ys);
  d->w = (float *)malloc(sizeof(float) * (size_t)nw);
  d->dy = (float *)malloc(sizeof(float) * (size_t)ny);
  if (!d->w || !d->dy) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  for (int64_t i = 0; i < nx; i++) d->x[i] = (float)(urand() * 2 - 1);
  for (int64_t i = 0; i < nw; i++) d->w[i] = (float)(urand() * 2 - 1);
  for (int64_t i = 0; i < ny; i++) d->dy[i] = (float)(urand() * 2 - 1);
  if (r->op == TW_SHARD_GROUPED_GEMM) {
    d->gs = (int32_t *)calloc((size_t)r->G, sizeof(int32_t));
    if (!d->gs) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
    draw_groups(r, ep, d->gs);
  }
  float *ax = (float *)malloc(sizeof(float) * (size_t)nx), *aw = (float *)malloc(sizeof(float) * (size_t)nw);
  float *ady = (float *)malloc(sizeof(float) * (size_t)ny);
  if (!ax || !aw || !ady) { free(ax); free(aw); free(ady); return tw_error(TW_ERR_MEMORY, "golden: out of memory"); }
  for (int64_t i = 0; i < nx; i++) ax[i] = fabsf(d->x[i]);
  for (int64_t i = 0; i < nw; i++) aw[i] = fabsf(d->w[i]);
  for (int64_t i = 0; i < ny; i++) ady[i] = fabsf(d->dy[i]);
  tw_ctx *ctx = NULL;
  tw_status s = host_ctx(&ctx, NULL);
  if (s == TW_OK && r->qin) { /* fp8: the unsharded quantize of the inputs, then each pass's GEMM */
    s = fp8_expected(ctx, r, d, ax, aw, ady);
    tw_ctx_destroy(ctx);
    free(ax); free(aw); free(ady);
    return s;
  }
  for (int p = 0; p < 3 && s == TW_OK; p++) {
    int64_t os[TW_MAX_DIMS];
    int ond;
    if ((s = pass_buffers(r, p, d, 0, &ond, os)) != TW_OK) break;
    s = unsharded_gemm(ctx, r, (tw_pass)p, d->x, d->w, d->dy, d->gs, d->expect[p]);
    if (s == TW_OK) s = unsharded_gemm(ctx, r, (tw_pass)p, ax, aw, ady, d->gs, d->absprod[p]);
    int xb = r->xnd == 3;
    if (r->op == TW_SHARD_DENSE)
      d->contract[p] = p == 0 ? r->xs[xb + 1] : p == 1 ? r->ws[r->wnd - 1] : (r->wnd == 2 ? tw_numel(r->xnd - 1, r->xs) : r->xs[xb]);
    else
      d->contract[p] = p == 0 ? r->xs[1] : p == 1 ? r->ws[2] : r->xs[0];
  }
  tw_ctx_destroy(ctx);
  free(ax); free(aw); free(ady);
  return s;
}

/* ---- expected errors: the rules restated, independently of plan.c -------------------- */
static int has(const tw_dimspec *d, tw_axis a) {
  for (int i = 0; i < d->n; i++)
    if (d->axis[i] == a) return 1;
  return 0;
}
static int shards(const tw_mesh *m, const tw_dimspec *d) { return tw_dimspec_shards(m, d); }
static int in_mesh(const tw_mesh *m, tw_axis a) {
  for (int i = 0; i < m->naxes; i++)
    if (m->axis[i] == a) return 1;
  return 0;
}
/* The spec names axes of the mesh, each once, has the tensor's rank, and every dim divides. */
static int spec_ok(const tw_mesh *m, const tw_pspec *p, int nd, const int64_t *shape) {
  int used[TW_AXIS_COUNT] = {0};
  if (p->ndim != nd) return 0;
  for (int d = 0; d < p->ndim; d++) {
    for (int i = 0; i < p->dim[d].n; i++) {
      tw_axis a = p->dim[d].axis[i];
      if ((int)a < 0 || a >= TW_AXIS_COUNT || !in_mesh(m, a) || used[a]++) return 0;
    }
    if (shape[d] % shards(m, &p->dim[d])) return 0;
  }
  return 1;
}
/* Non-fsdp axes of a dim. */
static tw_dimspec nofsdp(const tw_dimspec *d) {
  tw_dimspec r = {0, {0}};
  for (int i = 0; i < d->n; i++)
    if (d->axis[i] != FSDP) r.axis[r.n++] = d->axis[i];
  return r;
}
static int overlap(const tw_dimspec *a, const tw_dimspec *b) {
  for (int i = 0; i < a->n; i++)
    if (has(b, a->axis[i])) return 1;
  return 0;
}

const char *tw_shard_expected_error(const tw_mesh *m, tw_shard_op op, const tw_quantize_opts *q,
                                    const tw_shard_operand *x, const tw_shard_operand *w) {
  const tw_pspec *xs = &x->spec;
  if (!spec_ok(m, xs, x->ndim, x->shape)) return "spec:";
  if (op == TW_SHARD_GROUPED_QUANTIZE) {
    int col = q->layout & TW_COLWISE, row = q->layout & TW_ROWWISE;
    if (col && q->col_padded && (xs->dim[0].n || xs->dim[1].n)) return "rule quantize.col_padded";
    int along_m = (col && (q->mode == TW_SCALE_MXFP8_1D || q->mode == TW_SCALE_BLOCK_1x128)) || q->mode == TW_SCALE_BLOCK_128x128;
    if (along_m && xs->dim[0].n) return "rule quantize.blocks_along_m";
    int kb = (row && q->mode == TW_SCALE_MXFP8_1D) ? 32 : ((row && q->mode == TW_SCALE_BLOCK_1x128) || q->mode == TW_SCALE_BLOCK_128x128) ? 128 : 0;
    /* an unsharded K may end in a partial block (the quantizer pads it); a split one may not */
    if (kb && xs->dim[1].n && (x->shape[1] / shards(m, &xs->dim[1])) % kb) return "rule quantize.k_block";
    return NULL;
  }
  const tw_pspec *ws = &w->spec;
  if (!spec_ok(m, ws, w->ndim, w->shape)) return "spec:";
  if (op == TW_SHARD_DENSE) {
    int xb = x->ndim == 3, wb = w->ndim == 3;
    tw_dimspec b = xb ? xs->dim[0] : (tw_dimspec){0, {0}};
    if (wb) {
      tw_pspec a1 = {1, {ws->dim[0]}}, a2 = {1, {b}};
      if (!tw_pspec_equal(&a1, &a2)) return "rule gemm.batch";
    }
    tw_dimspec R = nofsdp(&ws->dim[wb]), N = nofsdp(&ws->dim[wb + 1]);
    if (R.n && N.n) return "rule gemm.rhs_k_and_n";
    if (overlap(&b, &R) || overlap(&b, &N)) return "rule gemm.batch_axis_reuse";
    if (R.n && xs->dim[xb].n && x->shape[xb] % shards(m, &R)) return "rule gemm.reduce_scatter_m";
    return NULL;
  }
  const tw_dimspec *rows = &xs->dim[0], *eg = &ws->dim[0];
  if (has(rows, EP) && rows->axis[0] != EP) return "rule grouped_gemm.ep_major";
  if (eg->n > 1 || (eg->n == 1 && eg->axis[0] != EP)) return "rule grouped_gemm.expert_dim";
  if (eg->n == 1 && !has(rows, EP)) return "rule grouped_gemm.ep_rows";
  if (has(rows, EP) && eg->n == 0) {
    if (has(&ws->dim[1], EP) || has(&ws->dim[2], EP)) return "rule grouped_gemm.axis_reuse";
    if (w->shape[0] % tw_mesh_axis_size(m, EP)) return "spec:"; /* ep injected into w's experts */
  }
  tw_dimspec R = nofsdp(&ws->dim[1]), N = nofsdp(&ws->dim[2]);
  if (R.n && N.n) return "rule grouped_gemm.rhs_k_and_n";
  if (overlap(rows, &R) || overlap(rows, &N)) return "rule grouped_gemm.axis_reuse";
  return NULL;
}

/* The text the planner's error must contain, or NULL if the case is valid. */
static const char *expected_error(const rule_desc *r, const tw_mesh *m, const tw_pspec *xs, const tw_pspec *ws) {
  tw_shard_operand x = {r->xnd, {0}, *xs}, w = {r->wnd, {0}, *ws};
  memcpy(x.shape, r->xs, sizeof r->xs);
  memcpy(w.shape, r->ws, sizeof r->ws);
  tw_quantize_opts q = rule_qopts(r);
  return tw_shard_expected_error(m, r->op, &q, &x, &w);
}

/* ---- enumeration ----------------------------------------------------------------------- */
/* Options for one dim: none, each axis, each ordered pair. */
static int dim_options(const tw_mesh *m, int tuples, tw_dimspec *out) {
  int n = 0;
  out[n++] = (tw_dimspec){0, {0}};
  for (int i = 0; i < m->naxes; i++) out[n++] = (tw_dimspec){1, {m->axis[i]}};
  if (tuples)
    for (int i = 0; i < m->naxes; i++)
      for (int j = 0; j < m->naxes; j++)
        if (i != j) out[n++] = (tw_dimspec){2, {m->axis[i], m->axis[j]}};
  return n;
}

static long count_specs(int nopt, int nd) {
  long c = 1;
  for (int i = 0; i < nd; i++) c *= nopt;
  return c;
}

static void spec_at(const tw_dimspec *opts, int nopt, int nd, long idx, tw_pspec *out) {
  memset(out, 0, sizeof *out);
  out->ndim = nd;
  for (int d = nd - 1; d >= 0; d--) {
    out->dim[d] = opts[idx % nopt];
    idx /= nopt;
  }
}

/* Meshes over the rule's axes: sizes in {2, 4, 8}, product <= max_ranks, plus one rank. */
static int make_meshes(const rule_desc *r, int min_ranks, int max_ranks, tw_mesh *out, int cap) {
  int n = 0;
  int sizes[4];
  int total = 1;
  for (int i = 0; i < r->naxes; i++) total *= 4; /* each axis: absent, 2, 4, 8 */
  for (int code = 0; code < total && n < cap; code++) {
    int c = code, ranks = 1, na = 0;
    tw_axis ax[4];
    for (int i = 0; i < r->naxes; i++) {
      int v = c % 4;
      c /= 4;
      if (v) { sizes[na] = 1 << v; ax[na++] = r->axes[i]; ranks *= 1 << v; }
    }
    if (ranks > max_ranks || ranks < min_ranks) continue;
    tw_mesh_init(&out[n++], na, ax, sizes);
  }
  return n;
}

/* ---- one (rule, pass, mesh): plan every case, run the valid ones on threads ----------- */
typedef struct {
  tw_plan plan;
  tw_pspec xs, ws;
} vcase;

typedef struct {
  const rule_desc *r;
  tw_pass pass;
  const tw_mesh *mesh;
  const golden_data *d;
  vcase *cases;
  long ncases;
  /* per case, across ranks */
  unsigned char *bad, *unequal;
  double *ratio;
  pthread_mutex_t mu;
  char problem[400];
  tw_backend backend;
  int exact_required; /* ref vs ref: the plan's exactness is a promise; gpu vs ref is not */
} sweep;

static void note_problem(sweep *s, long ci, int rank, const char *what) {
  pthread_mutex_lock(&s->mu);
  if (!s->problem[0]) {
    char xb[96], wb[96];
    snprintf(s->problem, sizeof s->problem, "x %s w %s rank %d: %s", tw_pspec_str(&s->cases[ci].xs, xb, sizeof xb),
             tw_pspec_str(&s->cases[ci].ws, wb, sizeof wb), rank, what);
  }
  pthread_mutex_unlock(&s->mu);
}

/* rank's shard of a global host f32 tensor under the plan tensor i's spec, on the host. */
static tw_status slice_in(const tw_plan *p, int i, int rank, const void *global, void **local, tw_tensor *t) {
  const tw_plan_tensor *pt = &p->t[i];
  size_t n = sizeof(float) * (size_t)tw_numel(pt->ndim, pt->local);
  *local = malloc(n ? n : 1);
  if (!*local) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  tw_tensor g = tw_host_tensor((void *)global, TW_F32, pt->ndim, pt->global);
  *t = tw_host_tensor(*local, TW_F32, pt->ndim, pt->local);
  return tw_shard_slice_host(&p->mesh, &pt->spec, rank, &g, t);
}

static tw_status run_gemm_case(sweep *s, long ci, int rank, tw_ctx *ctx, tw_mesh_comms *mc) {
  const tw_plan *p = &s->cases[ci].plan;
  const golden_data *d = s->d;
  const float *ins[3][2] = {{d->x, d->w}, {d->dy, d->w}, {d->x, d->dy}};
  void *l0 = NULL, *l1 = NULL, *lo = NULL, *le = NULL, *la = NULL;
  tw_tensor h0, h1, he, ha;
  tw_shard_io io;
  memset(&io, 0, sizeof io);
  io.group_sizes = d->gs;
  const tw_plan_tensor *ot = &p->t[2];
  int64_t n = tw_numel(ot->ndim, ot->local);
  tw_status st = slice_in(p, 0, rank, ins[s->pass][0], &l0, &h0);
  if (st == TW_OK) st = slice_in(p, 1, rank, ins[s->pass][1], &l1, &h1);
  if (st == TW_OK) st = to_ctx(ctx, &h0, &io.in[0]);
  if (st == TW_OK) st = to_ctx(ctx, &h1, &io.in[1]);
  if (st == TW_OK) st = ctx_poisoned(ctx, TW_F32, ot->ndim, ot->local, &io.out);
  if (st == TW_OK) st = tw_plan_run(ctx, mc, p, &io);
  if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
  lo = malloc(sizeof(float) * (size_t)(n ? n : 1));
  if (st == TW_OK && !lo) st = tw_error(TW_ERR_MEMORY, "golden: out of memory");
  tw_tensor hl = tw_host_tensor(lo, TW_F32, ot->ndim, ot->local);
  if (st == TW_OK) st = tw_tensor_copy(ctx, &hl, &io.out);
  if (st == TW_OK) st = slice_in(p, 2, rank, d->expect[s->pass], &le, &he);
  /* the gpu's fp8 dgrad (rhs_op T) runs gg_wgmma_fp8 where it takes the shapes: its promoted
   * model (tw_gemm.h) on the lifted magnitudes; everything else (a rule forcing an exact kernel
   * such as gg_mma_wide too) the exact f32 model */
  const int exact_forced = s->r->kernel && strcmp(s->r->kernel, "gg_wgmma_fp8") != 0;
  const int promoted = s->backend == TW_BACKEND_GPU && s->r->qin && s->pass == TW_PASS_DGRAD && !exact_forced;
  if (st == TW_OK) st = slice_in(p, 2, rank, promoted ? d->absprod_lift[s->pass] : d->absprod[s->pass], &la, &ha);
  if (st == TW_OK) {
    const float *got = (const float *)lo, *exp = (const float *)le, *ab = (const float *)la;
    double u = ldexp(1.0, -24), K = (double)d->contract[s->pass];
    double gamma = K * u / (1 - K * u);
    int equal = memcmp(got, exp, sizeof(float) * (size_t)n) == 0;
    double worst = 0;
    int64_t bad_i = -1;
    for (int64_t i = 0; i < n; i++) {
      double bound = 2 * (gamma * ab[i] + u * fabs(exp[i])) + 1e-30;
      if (promoted) {
        double a = ab[i], e = exp[i];
        tw_gemm_error_bound_promoted(&a, &e, 1, d->contract[s->pass], 128, 0x1p-13, 0x1p-24, 2, TW_F32, &bound);
        bound = 2 * bound + 1e-30;
      }
      double err = fabs((double)got[i] - (double)exp[i]);
      if (!(err <= bound)) { if (bad_i < 0) bad_i = i; worst = INFINITY; }
      else if (err / bound > worst) worst = err / bound;
    }
    if (!equal) s->unequal[ci] = 1;
    pthread_mutex_lock(&s->mu);
    if (worst > s->ratio[ci]) s->ratio[ci] = worst;
    pthread_mutex_unlock(&s->mu);
    if (bad_i >= 0 || (p->exact && s->exact_required && !equal)) {
      char msg[200];
      if (bad_i >= 0)
        snprintf(msg, sizeof msg, "element %lld: got %.9g, expected %.9g (beyond the bound)", (long long)bad_i,
                 (double)got[bad_i], (double)exp[bad_i]);
      else
        snprintf(msg, sizeof msg, "the plan is exact but the shard differs from the unsharded result in some bits");
      s->bad[ci] = 1;
      note_problem(s, ci, rank, msg);
    }
  }
  for (int i = 0; i < 2; i++) ctx_release(ctx, &io.in[i]);
  ctx_release(ctx, &io.out);
  free(l0); free(l1); free(lo); free(le); free(la);
  return st;
}

static tw_status run_quant_case(sweep *s, long ci, int rank, tw_ctx *ctx, tw_mesh_comms *mc) {
  const tw_plan *p = &s->cases[ci].plan;
  const golden_data *d = s->d;
  const rule_desc *r = s->r;
  void *lx = NULL;
  float *row = NULL, *col = NULL, *erow = NULL, *ecol = NULL, *amax = NULL;
  int32_t *lgs = (int32_t *)malloc(sizeof(int32_t) * (size_t)r->G);
  tw_qtensor q;
  memset(&q, 0, sizeof q);
  tw_shard_io io;
  memset(&io, 0, sizeof io);
  io.group_sizes = d->gs;
  io.q = &q;
  tw_tensor hx, hscale = tw_tensor_1d(d->scale, TW_F32, r->G, TW_MEM_HOST), gst = {0};
  tw_status st = lgs ? slice_in(p, 0, rank, d->x, &lx, &hx) : tw_error(TW_ERR_MEMORY, "golden: out of memory");
  if (st == TW_OK) st = to_ctx(ctx, &hx, &io.in[0]);
  if (st == TW_OK) st = to_ctx(ctx, &hscale, &io.scale);
  if (st == TW_OK) st = tw_plan_quantize_shapes(p, &q);
  if (st == TW_OK) st = q_alloc(ctx, &q);
  if (st == TW_OK) st = tw_plan_run(ctx, mc, p, &io);
  if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
  int64_t Ml = p->t[0].local[0], Kl = p->t[0].local[1], Gl = 0;
  size_t n = sizeof(float) * (size_t)(Ml * Kl);
  if (st == TW_OK) st = tw_plan_local_groups(p, rank, d->gs, lgs, &Gl);
  if (st == TW_OK) {
    tw_tensor hg = tw_tensor_1d(lgs, TW_I32, Gl, TW_MEM_HOST);
    st = to_ctx(ctx, &hg, &gst);
  }
  if (st == TW_OK) {
    row = r->layout & TW_ROWWISE ? (float *)malloc(n) : NULL;
    col = r->layout & TW_COLWISE ? (float *)malloc(n) : NULL;
    st = dequant_both(ctx, &q, &gst, row, col);
  }
  int tensor_mode = r->mode == TW_SCALE_TENSOR_CURRENT || r->mode == TW_SCALE_TENSOR_DELAYED;
  if (st == TW_OK && tensor_mode) {
    amax = (float *)malloc(sizeof(float) * (size_t)r->G);
    tw_tensor ha = tw_tensor_1d(amax, TW_F32, r->G, TW_MEM_HOST);
    st = amax ? tw_tensor_copy(ctx, &ha, &q.amax) : tw_error(TW_ERR_MEMORY, "golden: out of memory");
  }
  tw_tensor et;
  void *tmp = NULL;
  if (st == TW_OK && row) { st = slice_in(p, 0, rank, d->deq_row, &tmp, &et); erow = (float *)tmp; }
  if (st == TW_OK && col) { st = slice_in(p, 0, rank, d->deq_col, &tmp, &et); ecol = (float *)tmp; }
  if (st == TW_OK) {
    const char *what = NULL;
    if (row && memcmp(row, erow, n)) what = "rowwise data/scales differ from the unsharded quantize";
    else if (col && memcmp(col, ecol, n)) what = "colwise data/scales differ from the unsharded quantize";
    else if (tensor_mode && memcmp(amax, d->amax, sizeof(float) * (size_t)r->G))
      what = "amax differs from the unsharded (global) amax";
    if (what) {
      s->bad[ci] = 1;
      s->unequal[ci] = 1;
      note_problem(s, ci, rank, what);
    }
  }
  q_free(ctx, &q);
  ctx_release(ctx, &io.in[0]);
  ctx_release(ctx, &io.scale);
  ctx_release(ctx, &gst);
  free(lx); free(lgs); free(row); free(col); free(erow); free(ecol); free(amax);
  return st;
}

/* One rank of one mesh: a context and the axis communicators once, then every (rule, pass)
 * case list of the mesh in order (all ranks walk the same lists). */
typedef struct {
  sweep *sweeps;
  int n;
  tw_backend backend;
  const tw_mesh *mesh;
} mesh_job;

static tw_status mesh_rank(int rank, tw_comm *comm, void *arg) {
  mesh_job *j = (mesh_job *)arg;
  tw_ctx *ctx = NULL, *forced = NULL; /* forced: a second context on the same device and
                                         communicator for the rules that force a kernel */
  tw_mesh_comms *mc = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = j->backend;
  cc.device = j->backend == TW_BACKEND_GPU ? rank : 0;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_status st = tw_mesh_comms_create(ctx, j->mesh, &mc);
  for (int k = 0; k < j->n && st == TW_OK; k++) {
    sweep *s = &j->sweeps[k];
    if (s->r->kernel && s->ncases > 0 && (!forced || strcmp(tw_ctx_kernel(forced), s->r->kernel))) {
      tw_ctx_destroy(forced);
      forced = NULL;
      cc.kernel = s->r->kernel;
      st = tw_ctx_create(&forced, &cc);
      if (st != TW_OK) { /* on this rank: its row says why (the others time out) */
        s->bad[0] = 1;
        note_problem(s, 0, rank, tw_last_error());
      }
    }
    tw_ctx *use = s->r->kernel ? forced : ctx;
    for (long ci = 0; ci < s->ncases && st == TW_OK; ci++) {
      st = s->r->op == TW_SHARD_GROUPED_QUANTIZE ? run_quant_case(s, ci, rank, use, mc)
                                                 : run_gemm_case(s, ci, rank, use, mc);
      if (st != TW_OK) {
        s->bad[ci] = 1;
        note_problem(s, ci, rank, tw_last_error());
      }
    }
  }
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(forced);
  tw_ctx_destroy(ctx);
  return st;
}

/* Plans every spec combination of (rule, pass) on mesh m: invalid ones are checked against
 * the expected error (counted in row), valid ones become s's cases. */
static tw_status plan_cases(const tw_golden_cfg *cfg, const rule_desc *r, tw_pass pass, const tw_mesh *m,
                            const golden_data *d, tw_golden_row *row, sweep *s) {
  memset(row, 0, sizeof *row);
  memset(s, 0, sizeof *s);
  snprintf(row->rule, sizeof row->rule, "%s", r->name);
  row->pass = pass;
  tw_mesh_str(m, row->mesh, sizeof row->mesh);
  row->ranks = tw_mesh_ranks(m);
  tw_dimspec opts[1 + 4 + 12];
  int nopt = dim_options(m, cfg->tuples, opts);
  long nx = count_specs(nopt, r->xnd), nw = r->wnd ? count_specs(nopt, r->wnd) : 1;
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  ro.quant = rule_qopts(r);
  ro.quantize_inputs = r->qin;
  ro.quantize_before_gather = r->qbg;
  long cap = 256, nv = 0;
  vcase *cases = (vcase *)malloc(sizeof(vcase) * (size_t)cap);
  if (!cases) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  for (long xi = 0; xi < nx; xi++)
    for (long wi = 0; wi < nw; wi++) {
      tw_shard_operand x = {r->xnd, {0}, {0}}, w = {r->wnd, {0}, {0}};
      memcpy(x.shape, r->xs, sizeof r->xs);
      memcpy(w.shape, r->ws, sizeof r->ws);
      spec_at(opts, nopt, r->xnd, xi, &x.spec);
      if (r->wnd) spec_at(opts, nopt, r->wnd, wi, &w.spec);
      row->cases++;
      const char *want = expected_error(r, m, &x.spec, &w.spec);
      if (nv == cap) {
        cap *= 2;
        vcase *nc = (vcase *)realloc(cases, sizeof(vcase) * (size_t)cap);
        if (!nc) { free(cases); return tw_error(TW_ERR_MEMORY, "golden: out of memory"); }
        cases = nc;
      }
      tw_status st = tw_plan_make(m, r->op, pass, &x, r->wnd ? &w : NULL, r->G, &ro, &cases[nv].plan);
      char xb[96], wb[96];
      if (st != TW_OK) {
        if (want && strstr(tw_last_error(), want)) { row->expected_errors++; continue; }
        row->wrong_errors++;
        if (!row->first_problem[0])
          snprintf(row->first_problem, sizeof row->first_problem, "x %s w %s: expected %s, got: %s",
                   tw_pspec_str(&x.spec, xb, sizeof xb), tw_pspec_str(&w.spec, wb, sizeof wb),
                   want ? want : "a plan", tw_last_error());
        continue;
      }
      if (want) {
        row->wrong_errors++;
        if (!row->first_problem[0])
          snprintf(row->first_problem, sizeof row->first_problem, "x %s w %s: expected an error (%s), got a plan",
                   tw_pspec_str(&x.spec, xb, sizeof xb), tw_pspec_str(&w.spec, wb, sizeof wb), want);
        continue;
      }
      cases[nv].xs = x.spec;
      cases[nv].ws = w.spec;
      nv++;
    }
  /* budget: an even stride over the valid cases */
  long keep = cfg->budget > 0 && nv > cfg->budget ? cfg->budget : nv;
  if (keep < nv) {
    for (long i = 0; i < keep; i++) cases[i] = cases[(long)((double)i * (double)nv / (double)keep)];
    row->skipped = nv - keep;
  }
  s->r = r; s->pass = pass; s->mesh = m; s->d = d; s->cases = cases; s->ncases = keep;
  s->bad = (unsigned char *)calloc((size_t)(keep + 1), 1);
  s->unequal = (unsigned char *)calloc((size_t)(keep + 1), 1);
  s->ratio = (double *)calloc((size_t)(keep + 1), sizeof(double));
  pthread_mutex_init(&s->mu, NULL);
  s->backend = cfg->backend;
  s->exact_required = cfg->backend == TW_BACKEND_REF;
  if (!s->bad || !s->unequal || !s->ratio) return tw_error(TW_ERR_MEMORY, "golden: out of memory");
  return TW_OK;
}

static void sweep_free(sweep *s) {
  if (!s->cases) return;
  pthread_mutex_destroy(&s->mu);
  free(s->bad); free(s->unequal); free(s->ratio); free(s->cases);
  memset(s, 0, sizeof *s);
}

static void collect(const tw_golden_cfg *cfg, const sweep *s, tw_golden_row *row) {
  row->run = s->ncases;
  for (long i = 0; i < s->ncases; i++) {
    if (s->bad[i]) row->failed++;
    else row->passed++;
    if (s->cases[i].plan.exact) { row->exact_cases++; row->exact_equal += !s->unequal[i]; }
    else if (s->ratio[i] > row->worst_ratio) row->worst_ratio = s->ratio[i];
    if (cfg->verbose && cfg->log) {
      char xb[96], wb[96];
      fprintf(cfg->log, "%s %s mesh %s x %s w %s: %s%s\n", s->r->name, tw_pass_name(s->pass), row->mesh,
              tw_pspec_str(&s->cases[i].xs, xb, sizeof xb), tw_pspec_str(&s->cases[i].ws, wb, sizeof wb),
              s->bad[i] ? "FAIL" : "pass", s->cases[i].plan.exact ? " (exact)" : "");
    }
  }
  if (s->problem[0] && !row->first_problem[0]) snprintf(row->first_problem, sizeof row->first_problem, "%s", s->problem);
}

/* Every mesh over {dp, fsdp, ep, tp}: sizes 2, 4, 8, within [min, max] ranks. */
static const rule_desc all_axes = {"", TW_SHARD_DENSE, 0, 0, 0, {0}, {0}, 0, 4, {DP, FSDP, EP, TP}, 0, 0, 0, 0, NULL};

static int mesh_fits(const tw_mesh *m, const rule_desc *r) {
  for (int i = 0; i < m->naxes; i++) {
    int ok = 0;
    for (int j = 0; j < r->naxes; j++) ok |= r->axes[j] == m->axis[i];
    if (!ok) return 0;
  }
  return 1;
}

typedef struct {
  tw_golden_row row;
  int rule, pass, mesh;
} keyed_row;

static int row_order(const void *a, const void *b) {
  const keyed_row *x = (const keyed_row *)a, *y = (const keyed_row *)b;
  if (x->rule != y->rule) return x->rule - y->rule;
  if (x->pass != y->pass) return x->pass - y->pass;
  return x->mesh - y->mesh;
}

/* 1 if a registry entry that filter keeps sweeps r's rule family (every rule without a filter) */
static int registered(const rule_desc *r, const char *filter) {
  if (!filter) return 1;
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    if (e->shard_rule && !strcmp(e->shard_rule, tw_shard_op_name(r->op)) && tw_op_matches(e, filter)) return 1;
  }
  return 0;
}

tw_status tw_golden_sharding(const tw_golden_cfg *cfg_in, tw_golden_row **rows_out, int *nrows_out) {
  tw_golden_cfg cfg = TW_GOLDEN_CFG_INIT;
  if (cfg_in) cfg = *cfg_in;
  if (!rows_out || !nrows_out) return tw_error(TW_ERR_NULL, "golden_sharding: NULL output");
  *rows_out = NULL;
  *nrows_out = 0;
  rule_desc rules_b[NRULES];
  shapes_for(cfg.backend, rules_b);
  const rule_desc *rules = rules_b;
  int use[NRULES] = {0}, nuse = 0;
  for (int ri = 0; ri < NRULES; ri++)
    if ((!cfg.only || strncmp(rules[ri].name, cfg.only, strlen(cfg.only)) == 0) && registered(&rules[ri], cfg.filter) &&
        (!rules[ri].kernel || cfg.backend == TW_BACKEND_GPU)) {
      use[ri] = 1;
      nuse++;
    }
  if (!nuse && cfg.filter)
    return tw_error(TW_ERR_INVALID_ARG, "golden_sharding: no rule of an operation matching '%s'%s%s", cfg.filter,
                    cfg.only ? " starts with " : "", cfg.only ? cfg.only : "");
  if (!nuse)
    return tw_error(TW_ERR_INVALID_ARG, "golden_sharding: no rule starts with '%s'%s", cfg.only,
                    cfg.backend == TW_BACKEND_GPU ? "" : " (rules that force a gpu kernel run on the gpu backend only)");
  /* inputs and unsharded results per rule and ep size */
  golden_data(*data)[4] = (golden_data(*)[4])calloc(NRULES, sizeof *data);
  tw_mesh *meshes = (tw_mesh *)malloc(sizeof(tw_mesh) * 256);
  keyed_row *rows = (keyed_row *)malloc(sizeof(keyed_row) * 1024);
  sweep *sweeps = (sweep *)calloc(NRULES * 3, sizeof(sweep));
  tw_status st = data && meshes && rows && sweeps ? TW_OK : tw_error(TW_ERR_MEMORY, "golden: out of memory");
  for (int ri = 0; ri < NRULES && st == TW_OK; ri++) {
    if (!use[ri]) continue;
    int uses_ep = 0;
    for (int i = 0; i < rules[ri].naxes; i++) uses_ep |= rules[ri].axes[i] == EP;
    for (int e = 1, k = 0; e <= 8 && st == TW_OK; e *= 2, k++)
      if (e == 1 || uses_ep) st = make_data(&rules[ri], ri, e, &data[ri][k]);
  }
  int nm = st == TW_OK ? make_meshes(&all_axes, cfg.min_ranks, cfg.max_ranks, meshes, 256) : 0;
  int nrows = 0;
  for (int mi = 0; mi < nm && st == TW_OK; mi++) {
    const tw_mesh *m = &meshes[mi];
    int ep = tw_mesh_axis_size(m, EP), nsw = 0, first_row = nrows;
    for (int ri = 0; ri < NRULES && st == TW_OK; ri++) {
      if (!use[ri] || !mesh_fits(m, &rules[ri])) continue;
      const golden_data *d = NULL;
      for (int k = 0; k < 4; k++)
        if (data[ri][k].x && data[ri][k].ep == ep) d = &data[ri][k];
      if (!d) { st = tw_error(TW_ERR_INTERNAL, "golden: no data for %s at ep = %d", rules[ri].name, ep); break; }
      for (int p = 0; p < rules[ri].npasses && st == TW_OK; p++) {
        if (nrows == 1024) { st = tw_error(TW_ERR_INTERNAL, "golden: more than 1024 rows"); break; }
        rows[nrows].rule = ri; rows[nrows].pass = p; rows[nrows].mesh = mi;
        st = plan_cases(&cfg, &rules[ri], (tw_pass)p, m, d, &rows[nrows].row, &sweeps[nsw]);
        nrows++;
        nsw++;
      }
    }
    long total = 0;
    for (int k = 0; k < nsw; k++) total += sweeps[k].ncases;
    if (st == TW_OK && total > 0) {
      int n = tw_mesh_ranks(m);
      tw_comm **comms = (tw_comm **)calloc((size_t)n, sizeof *comms);
      if (!comms) st = tw_error(TW_ERR_MEMORY, "golden: out of memory");
      else if (cfg.backend == TW_BACKEND_REF) st = tw_comm_init_threads(n, comms);
      else if (!tw_comm_init_nccl_local) st = tw_error(TW_ERR_UNSUPPORTED, "golden: this binary has no NCCL communicator (link //gpu)");
      else {
        int devices[64];
        for (int i = 0; i < n && i < 64; i++) devices[i] = i;
        st = n <= 64 ? tw_comm_init_nccl_local(n, devices, comms) : tw_error(TW_ERR_INVALID_ARG, "golden: %d GPUs", n);
      }
      if (st == TW_OK) {
        for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], 60.0);
        mesh_job job = {sweeps, nsw, cfg.backend, m};
        tw_status rs = tw_run_ranks(n, comms, mesh_rank, &job);
        if (rs != TW_OK) /* the failing case is marked; say why on its row */
          for (int k = 0; k < nsw; k++)
            if (!sweeps[k].problem[0]) snprintf(sweeps[k].problem, sizeof sweeps[k].problem, "%s", tw_last_error());
        for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
      }
      free(comms);
    }
    for (int k = 0; k < nsw; k++) {
      if (st == TW_OK) collect(&cfg, &sweeps[k], &rows[first_row + k].row);
      sweep_free(&sweeps[k]);
    }
  }
  if (data)
    for (int ri = 0; ri < NRULES; ri++)
      for (int k = 0; k < 4; k++) data_free(&data[ri][k]);
  free(data);
  free(meshes);
  free(sweeps);
  if (st != TW_OK) {
    free(rows);
    return st;
  }
  qsort(rows, (size_t)nrows, sizeof *rows, row_order);
  tw_golden_row *out = (tw_golden_row *)malloc(sizeof *out * (size_t)(nrows ? nrows : 1));
  if (!out) { free(rows); return tw_error(TW_ERR_MEMORY, "golden: out of memory"); }
  for (int i = 0; i < nrows; i++) out[i] = rows[i].row;
  free(rows);
  *rows_out = out;
  *nrows_out = nrows;
  return TW_OK;
}

int tw_golden_print(FILE *f, const tw_golden_row *rows, int nrows) {
  int bad = 0;
  fprintf(f, "%-24s %-5s %-22s %5s %7s %6s %6s %5s %7s %6s %8s %9s\n", "rule", "pass", "mesh", "ranks", "cases",
          "run", "pass", "fail", "exp-err", "wrong", "exact", "worst/bnd");
  long tot[6] = {0};
  for (int i = 0; i < nrows; i++) {
    const tw_golden_row *r = &rows[i];
    char ex[32];
    snprintf(ex, sizeof ex, "%ld/%ld", r->exact_equal, r->exact_cases);
    fprintf(f, "%-24s %-5s %-22s %5d %7ld %6ld %6ld %5ld %7ld %6ld %8s %9.3g\n", r->rule, tw_pass_name(r->pass),
            r->mesh, r->ranks, r->cases, r->run, r->passed, r->failed, r->expected_errors, r->wrong_errors, ex,
            r->worst_ratio);
    if (r->skipped) fprintf(f, "    (%ld more valid cases left out by the budget)\n", r->skipped);
    if (r->failed || r->wrong_errors) {
      bad++;
      fprintf(f, "    first problem: %s\n", r->first_problem);
    }
    tot[0] += r->cases; tot[1] += r->run; tot[2] += r->passed; tot[3] += r->failed;
    tot[4] += r->expected_errors; tot[5] += r->wrong_errors;
  }
  fprintf(f, "total: %d rows, %ld cases, %ld run, %ld passed, %ld failed, %ld expected errors, %ld wrong errors\n",
          nrows, tot[0], tot[1], tot[2], tot[3], tot[4], tot[5]);
  return bad;
}
