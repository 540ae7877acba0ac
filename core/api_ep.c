/* Public entry points of tw_ep.h: the config and every per-step argument validated once,
 * then the backend's EP table. */
#include <stdlib.h>
#include <string.h>

#include "core/backend_moe.h"
#include "core/validate.h"
#include "twin/tw_comm.h"

static const tw_ep_backend *ep_table(const tw_backend_ops *ops) { return ops ? ops->ep : NULL; }

static int pow2(int64_t a) { return a >= 1 && (a & (a - 1)) == 0; }

/* The no-drop capacity's terms in double (ep * T * k routes + NLE * A): above 9e15 no R (nor
 * its products) stays in int64. One bound for tw_ep_capacity_no_drop and check_config. */
static double no_drop_estimate(const tw_ep_config *c, int ep_size) {
  double nle = (double)(c->num_experts / ep_size), A = c->alignment > 1 ? (double)c->alignment : 1.0;
  return (double)ep_size * (double)c->max_tokens * (double)c->topk + nle * A;
}

int64_t tw_ep_capacity_no_drop(const tw_ep_config *cfg, int ep_size) {
  if (!cfg || ep_size < 1 || cfg->num_experts < ep_size) return 0;
  if (cfg->max_tokens < 0 || cfg->topk < 1 || no_drop_estimate(cfg, ep_size) > 9.0e15)
    return 0; /* no such R in int64 range (tw_ep_create refuses the config, naming it) */
  int64_t nle = cfg->num_experts / ep_size, A = cfg->alignment > 1 ? cfg->alignment : 1;
  int64_t per_src = cfg->topk < nle ? cfg->topk : nle; /* distinct ids: at most NLE per token here */
  return tw_round_up((int64_t)ep_size * cfg->max_tokens * per_src + nle * (A - 1), A);
}

static tw_status check_config(const char *op, const tw_ep_config *c, int ep_size) {
  if (!c) return tw_error(TW_ERR_NULL, "%s: cfg is NULL", op);
  if (c->size != sizeof(tw_ep_config))
    return tw_error(TW_ERR_INVALID_ARG, "%s: cfg.size is %zu, expected %zu (use TW_EP_CONFIG_INIT)", op, c->size,
                    sizeof(tw_ep_config));
  if (c->num_experts < 1 || c->num_experts % ep_size != 0)
    return tw_error(TW_ERR_INVALID_ARG, "%s: num_experts = %d is not a positive multiple of ep_size = %d", op,
                    c->num_experts, ep_size);
  if (c->topk < 1 || c->topk > c->num_experts)
    return tw_error(TW_ERR_INVALID_ARG, "%s: topk = %d must be in [1, num_experts = %d]", op, c->topk, c->num_experts);
  if (c->max_tokens < 0 || c->hidden < 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: max_tokens = %lld and hidden = %lld must be >= 0 and >= 1", op,
                    (long long)c->max_tokens, (long long)c->hidden);
  if (c->token_dtype != TW_F32 && c->token_dtype != TW_BF16 && !tw_dtype_is_fp8(c->token_dtype))
    return tw_error(TW_ERR_DTYPE, "%s: token_dtype %s is not f32, bf16, e4m3 or e5m2", op,
                    tw_dtype_name(c->token_dtype) ? tw_dtype_name(c->token_dtype) : "?");
  if (tw_dtype_is_fp8(c->token_dtype)) {
    if (c->scale_block != 128 && c->scale_block != 32)
      return tw_error(TW_ERR_INVALID_ARG, "%s: fp8 tokens need scale_block 128 (1x128) or 32 (MXFP8), got %d", op,
                      c->scale_block);
    if (c->hidden % c->scale_block != 0)
      return tw_error(TW_ERR_SHAPE, "%s: hidden = %lld is not a multiple of the fp8 scale block %d", op,
                      (long long)c->hidden, c->scale_block);
  } else if (c->scale_block != 0) {
    return tw_error(TW_ERR_INVALID_ARG, "%s: scale_block = %d is for fp8 tokens only (token_dtype %s)", op,
                    c->scale_block, tw_dtype_name(c->token_dtype));
  }
  if (c->alignment < 0 || (c->alignment > 1 && !pow2(c->alignment)))
    return tw_error(TW_ERR_ALIGNMENT, "%s: alignment = %lld is not a power of two (0 or 1: none)", op,
                    (long long)c->alignment);
  int64_t A = c->alignment > 1 ? c->alignment : 1;
  if (c->recv_capacity < 0 || c->recv_capacity % A != 0)
    return tw_error(TW_ERR_ALIGNMENT, "%s: recv_capacity = %lld is not a non-negative multiple of alignment %lld", op,
                    (long long)c->recv_capacity, (long long)A);
  /* keeps every size derived below (routes ep * T * k, R and its T_cap padding, R * H and T * H
   * elements, workspace bytes) far from int64 overflow */
  const double nle = (double)(c->num_experts / ep_size), no_drop = no_drop_estimate(c, ep_size);
  const double R = c->recv_capacity ? (double)c->recv_capacity : no_drop;
  if (no_drop > 9.0e15 || (R + 128.0 * nle) * (double)c->hidden > 9.0e15 ||
      (double)c->max_tokens * (double)c->hidden > 9.0e15)
    return tw_error(TW_ERR_SHAPE,
                    "%s: max_tokens = %lld, topk = %d, ep_size = %d, alignment = %lld, hidden = %lld, recv_capacity = "
                    "%lld: the sizes they give are too large", op, (long long)c->max_tokens, c->topk, ep_size,
                    (long long)c->alignment, (long long)c->hidden, (long long)c->recv_capacity);
  if ((int)c->overflow != TW_EP_OVERFLOW_ERROR && (int)c->overflow != TW_EP_OVERFLOW_DROP)
    return tw_error(TW_ERR_INVALID_ARG, "%s: unknown overflow policy %d", op, (int)c->overflow);
  if (c->scales_gemm_layout != 0 && c->scales_gemm_layout != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: scales_gemm_layout = %d must be 0 (rows) or 1 (the GEMM's layout)", op,
                    c->scales_gemm_layout);
  if (c->scales_gemm_layout && !tw_dtype_is_fp8(c->token_dtype))
    return tw_error(TW_ERR_INVALID_ARG, "%s: scales_gemm_layout = 1 is for fp8 tokens only (token_dtype %s)", op,
                    tw_dtype_name(c->token_dtype));
  if (c->scales_mxfp8_swizzled != 0 && c->scales_mxfp8_swizzled != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: scales_mxfp8_swizzled = %d must be 0 (compact) or 1 (swizzled)", op,
                    c->scales_mxfp8_swizzled);
  if (c->scales_mxfp8_swizzled && !(c->scales_gemm_layout && c->scale_block == 32))
    return tw_error(TW_ERR_INVALID_ARG,
                    "%s: scales_mxfp8_swizzled = 1 needs MXFP8 tokens (scale_block 32, got %d) with "
                    "scales_gemm_layout = 1 (got %d)",
                    op, c->scale_block, c->scales_gemm_layout);
  return TW_OK;
}

/* recv_scales of an fp8 config (R resolved): [R, H/block] rows; 1x128 GEMM layout
 * [H/128, roundup(R, 4)]; MXFP8 GEMM layout [128 * T_cap, roundup(H/32, 4)] with
 * T_cap = floor((R + 127 * min(NLE, R)) / 128) (tw_quantize_output_shapes' T_cap for M = R,
 * G = NLE). */
static void scales_shape(const tw_ep_config *c, int64_t R, int64_t nle, int64_t sh[2]) {
  int64_t cols = c->hidden / c->scale_block;
  if (!c->scales_gemm_layout) {
    sh[0] = R;
    sh[1] = cols;
  } else if (c->scale_block == 128) {
    sh[0] = cols;
    sh[1] = tw_round_up(R, 4);
  } else {
    int64_t g = nle < R ? nle : R;
    sh[0] = 128 * ((R + 127 * g) / 128);
    sh[1] = tw_round_up(cols, 4);
  }
}

tw_status tw_ep_recv_scales_shape(const tw_ep_config *cfg, int ep_size, int64_t shape[2], tw_dtype *dtype) {
  const char *op = "ep_recv_scales_shape";
  if (ep_size < 1) return tw_error(TW_ERR_INVALID_ARG, "%s: ep_size = %d", op, ep_size);
  TW_TRY(check_config(op, cfg, ep_size));
  if (!shape || !dtype) return tw_error(TW_ERR_NULL, "%s: shape or dtype is NULL", op);
  if (!tw_dtype_is_fp8(cfg->token_dtype))
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s tokens have no recv_scales (fp8 only)", op,
                    tw_dtype_name(cfg->token_dtype));
  int64_t R = cfg->recv_capacity ? cfg->recv_capacity : tw_ep_capacity_no_drop(cfg, ep_size);
  scales_shape(cfg, R, cfg->num_experts / ep_size, shape);
  *dtype = cfg->scale_block == 32 ? TW_E8M0 : TW_F32;
  return TW_OK;
}

/* Row payload of the data movement: token row, its scale row, its weight (f32). */
static size_t row_bytes(const tw_ep_config *c) {
  int64_t scols = tw_dtype_is_fp8(c->token_dtype) ? c->hidden / c->scale_block : 0;
  size_t tok = tw_dtype_storage_bytes(c->token_dtype, c->hidden);
  size_t scl = tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, scols);
  size_t y = (size_t)c->hidden * 4; /* f32 outputs / gradients travel back */
  return (tok + scl > y ? tok + scl : y) + 4;
}

static double up(double x, double a) { /* x rounded up to a multiple of a (huge x: left as is, refused later) */
  const double t = x / a;
  if (t > 9e18) return x;
  double i = (double)(int64_t)t;
  return (i < t ? i + 1 : i) * a;
}
static double max2(double a, double b) { return a > b ? a : b; }

/* What each backend's create functions allocate (ref/ep.c; gpu/ep.cu with either EP version,
 * gpu/lsa_window.cu for ep_nccl_lsa's window), written out here because the call names no
 * backend: tw_ep_workspace_bytes reports the larger, so a budget made with it holds whichever
 * backend and version runs. In doubles: a caller's sizes past 9e15 bytes are refused, not wrapped. */
static void ep_bytes(const tw_ep_config *c, int n, int64_t R, double *workspace, double *layer) {
  const double E = c->num_experts, nle = (double)(c->num_experts / n), maxT = (double)c->max_tokens, k = c->topk;
  const double routes = maxT * k, r = (double)R, nn = n;
  const double scols = tw_dtype_is_fp8(c->token_dtype) ? (double)(c->hidden / c->scale_block) : 0;
  const int mxgemm = c->scales_gemm_layout && c->scale_block == 32;
  const double mx = mxgemm ? r * scols : 0;                       /* ref: received MXFP8 scale rows */
  const double gmx = mxgemm ? max2(r, nn * maxT) * scols + 40 : 0; /* gpu: for rows by source too, + its table */
  const double rowb = (double)row_bytes(c);
  /* ref: send rows [max_tokens * k] and receive rows [R] of the payload, which also carries
   * the token index (4 bytes) */
  const double ref_ws = (routes + r) * (rowb + 4) + mx;
  /* gpu ep_nccl_slots: per-peer slots of S = max_tokens * min(k, NLE) rows, send and receive
   * (one buffer on one rank); ep_nccl_lsa (one rank too, in its loopback test mode): the
   * symmetric window's regions after its 256-byte header, rounded to 2 MiB, and its peer table */
  const double tokscl = (double)tw_dtype_storage_bytes(c->token_dtype, c->hidden) +
                        (double)tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, (int64_t)scols);
  /* a slot row: the token, its scales, weight and source word; or an f32 row and its f32 */
  const double S = maxT * (k < nle ? k : nle), rb = up(max2(tokscl + 8, (double)c->hidden * 4 + 4), 16);
  const double slots = (n == 1 ? 1 : 2) * nn * S * rb;
  const double srb = up((double)tw_dtype_storage_bytes(c->token_dtype, c->hidden) +
                            (double)tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, (int64_t)scols),
                        16);
  const double crb = up((double)c->hidden * 4 + 4, 16);
  const double regions = 256 + up(nn * 8, 256) + up(nn * E * 4, 256) + up(r * 16, 256) + up(nn * maxT * srb, 256) +
                         up(maxT * (k > nn ? k : nn) * crb, 256) + up(maxT * k * 4, 256) + nn * maxT * 8;
  const double window = up(regions, 2u << 20) + nn * 8 + 64;
  const double gpu_ws = max2(slots, window) + (mxgemm ? gmx + (nle + 1) * 16 : 0);
  *workspace = max2(ref_ws, gpu_ws);
  /* layer state. ref: counters, counts, kept / offsets, per-route slot / pack order / position,
   * per-row slot, per-peer counts and offsets. gpu: its tables (i64 then i32), with
   * ep_nccl_lsa's route and row maps and way-back chunk lists, one rank's slot maps. */
  const double ref_l = E * 8 + nn * E * 4 + nn * nle * 16 + routes * 24 + r * 8 + nn * 16 + (nn + 1) * 16 + nn * 32;
  const double nch = up(routes, 1024) / 1024; /* gpu/ep.cu EP_CHUNK */
  const double g64 = 3 * nn * nle + nn * (nle + 1) + 3 * E + 2 * routes + 2 * r + (n == 1 ? 2 * S : 0);
  const double g32 = 2 * nch * E + nn * E + routes + 1 + 8 * (r + 1); /* gpu/ep.cu EP_BACK_MAXC lists */
  *layer = max2(ref_l, g64 * 8 + g32 * 4);
}

tw_status tw_ep_workspace_bytes(const tw_ep_config *cfg, int ep_size, size_t *workspace,
                                size_t *layer_state) {
  const char *op = "ep_workspace_bytes";
  if (ep_size < 1) return tw_error(TW_ERR_INVALID_ARG, "%s: ep_size = %d", op, ep_size);
  TW_TRY(check_config(op, cfg, ep_size));
  if (!workspace || !layer_state) return tw_error(TW_ERR_NULL, "%s: an output pointer is NULL", op);
  int64_t R = cfg->recv_capacity ? cfg->recv_capacity : tw_ep_capacity_no_drop(cfg, ep_size);
  double ws, ls;
  ep_bytes(cfg, ep_size, R, &ws, &ls);
  if (ws > 9e15 || ls > 9e15)
    return tw_error(TW_ERR_SHAPE, "%s: %.3g workspace bytes and %.3g layer bytes for ep_size %d, H %lld, max_tokens %lld, "
                                  "k %d, E %d, R %lld: past 9e15",
                    op, ws, ls, ep_size, (long long)cfg->hidden, (long long)cfg->max_tokens, cfg->topk,
                    cfg->num_experts, (long long)R);
  *workspace = (size_t)ws;
  *layer_state = (size_t)ls;
  return TW_OK;
}

tw_status tw_ep_create(tw_ctx *ctx, tw_comm *comm, const tw_ep_config *cfg, tw_ep **out) {
  const char *op = "ep_create";
  if (!ctx || !comm || !out) return tw_error(TW_ERR_NULL, "%s: ctx, comm or out is NULL", op);
  *out = NULL;
  /* comm's fields directly: core links without //shard (the libFuzzer harness builds core/ and ref/ alone) */
  int n = comm->size;
  if (!comm->ops || comm->ops->mem != ctx->ops->mem)
    return tw_error(TW_ERR_MEMORY, "%s: the communicator's buffers live in %s memory, this context needs %s", op,
                    comm->ops && comm->ops->mem == TW_MEM_DEVICE ? "device" : "host",
                    ctx->ops->mem == TW_MEM_DEVICE ? "device" : "host");
  TW_TRY(check_config(op, cfg, n));
  const tw_ep_backend *b = ep_table(ctx->ops);
  if (!b || !b->create)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  tw_ep *ep = calloc(1, sizeof *ep);
  if (!ep) return tw_error(TW_ERR_MEMORY, "%s: out of host memory", op);
  ep->ops = ctx->ops;
  ep->ctx = ctx;
  ep->comm = comm;
  ep->cfg = *cfg;
  ep->ep_size = n;
  ep->rank = comm->rank;
  ep->nle = cfg->num_experts / n;
  if (ep->cfg.alignment < 1) ep->cfg.alignment = 1;
  if (ep->cfg.recv_capacity == 0) ep->cfg.recv_capacity = tw_ep_capacity_no_drop(cfg, n);
  ep->scale_cols = tw_dtype_is_fp8(cfg->token_dtype) ? cfg->hidden / cfg->scale_block : 0;
  tw_status s = b->create(ep);
  if (s != TW_OK) {
    free(ep);
    return s;
  }
  *out = ep;
  return TW_OK;
}

tw_status tw_ep_destroy(tw_ep *ep) {
  if (!ep) return TW_OK;
  tw_status s = ep->ops->ep->destroy(ep);
  free(ep);
  return s;
}

tw_status tw_ep_layer_create(tw_ep *ep, tw_ep_layer **out) {
  if (!ep || !out) return tw_error(TW_ERR_NULL, "ep_layer_create: ep or out is NULL");
  tw_ep_layer *l = calloc(1, sizeof *l);
  if (!l) return tw_error(TW_ERR_MEMORY, "ep_layer_create: out of host memory");
  l->ep = ep;
  tw_status s = ep->ops->ep->layer_create(l);
  if (s != TW_OK) {
    free(l);
    return s;
  }
  *out = l;
  return TW_OK;
}

tw_status tw_ep_layer_destroy(tw_ep_layer *layer) {
  if (!layer) return TW_OK;
  tw_status s = layer->ep->ops->ep->layer_destroy(layer);
  free(layer);
  return s;
}

int64_t tw_ep_recv_capacity(const tw_ep *ep) { return ep ? ep->cfg.recv_capacity : 0; }
int tw_ep_local_experts(const tw_ep *ep) { return ep ? ep->nle : 0; }

/* ---- per-step validation ----------------------------------------------------------------- */

static tw_status want(const char *op, const char *name, const tw_tensor *t, tw_mem mem, int ndim,
                      int64_t d0, int64_t d1) {
  TW_TRY(tw_v_tensor(op, name, t, mem, ndim));
  int64_t sh[2] = {d0, d1};
  return tw_v_shape_is(op, name, t, ndim, sh);
}

static tw_status want_dtype(const char *op, const char *name, const tw_tensor *t, tw_dtype dt) {
  if (t->dtype != dt)
    return tw_error(TW_ERR_DTYPE, "%s: %s is %s, expected %s", op, name, tw_dtype_name(t->dtype), tw_dtype_name(dt));
  return TW_OK;
}

static tw_status check_layer(const char *op, tw_ctx *ctx, tw_ep_layer *layer, int need_dispatch) {
  if (!ctx || !layer) return tw_error(TW_ERR_NULL, "%s: ctx or layer is NULL", op);
  if (ctx->ops != layer->ep->ops)
    return tw_error(TW_ERR_INVALID_ARG, "%s: ctx is a %s context but the EP group was made on %s", op,
                    ctx->ops->name, layer->ep->ops->name);
  if (need_dispatch && !layer->dispatched)
    return tw_error(TW_ERR_INVALID_ARG, "%s: this layer has no successful dispatch to route by", op);
  return TW_OK;
}

/* f32 or bf16, and (when other is given) the same dtype as other. */
static tw_status float_rows(const char *op, const char *name, const tw_tensor *t, const tw_tensor *other,
                            const char *other_name) {
  if (t->dtype != TW_F32 && t->dtype != TW_BF16)
    return tw_error(TW_ERR_DTYPE, "%s: %s is %s, expected f32 or bf16", op, name, tw_dtype_name(t->dtype));
  if (other && other->dtype != t->dtype)
    return tw_error(TW_ERR_DTYPE, "%s: %s is %s but %s is %s (they must match)", op, name, tw_dtype_name(t->dtype),
                    other_name, tw_dtype_name(other->dtype));
  return TW_OK;
}

/* The arguments both dispatch forms share: tokens, their scales, ids, weights, recv_weights,
 * group_sizes, dropped; host ids checked here (a device backend checks them on the device). */
static tw_status check_dispatch_common(const char *op, tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                       const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                       const tw_tensor *topk_weights, const tw_tensor *recv_weights,
                                       const tw_tensor *group_sizes, const tw_tensor *dropped) {
  TW_TRY(check_layer(op, ctx, layer, 0));
  const tw_ep *ep = layer->ep;
  const tw_ep_config *c = &ep->cfg;
  tw_mem m = ctx->ops->mem;
  TW_TRY(tw_v_tensor(op, "tokens", tokens, m, 2));
  int64_t T = tokens->shape[0], H = c->hidden, R = c->recv_capacity, k = c->topk;
  if (T > c->max_tokens)
    return tw_error(TW_ERR_SHAPE, "%s: rank %d has T = %lld tokens, more than max_tokens = %lld", op, ep->rank,
                    (long long)T, (long long)c->max_tokens);
  TW_TRY(want(op, "tokens", tokens, m, 2, T, H));
  TW_TRY(want_dtype(op, "tokens", tokens, c->token_dtype));
  TW_TRY(want(op, "topk_idx", topk_idx, m, 2, T, k));
  TW_TRY(want_dtype(op, "topk_idx", topk_idx, TW_I32));
  TW_TRY(want(op, "topk_weights", topk_weights, m, 2, T, k));
  TW_TRY(want_dtype(op, "topk_weights", topk_weights, TW_F32));
  TW_TRY(want(op, "recv_weights", recv_weights, m, 1, R, 0));
  TW_TRY(want_dtype(op, "recv_weights", recv_weights, TW_F32));
  TW_TRY(want(op, "group_sizes", group_sizes, m, 1, ep->nle, 0));
  TW_TRY(want_dtype(op, "group_sizes", group_sizes, TW_I32));
  if (ep->scale_cols) {
    TW_TRY(want(op, "token_scales", token_scales, m, 2, T, ep->scale_cols));
    TW_TRY(want_dtype(op, "token_scales", token_scales, c->scale_block == 32 ? TW_E8M0 : TW_F32));
  } else if (!tw_tensor_is_none(token_scales)) {
    return tw_error(TW_ERR_INVALID_ARG, "%s: token_scales are for fp8 tokens only (tokens are %s)", op,
                    tw_dtype_name(c->token_dtype));
  }
  if (c->overflow == TW_EP_OVERFLOW_DROP && tw_tensor_is_none(dropped))
    return tw_error(TW_ERR_INVALID_ARG, "%s: the drop policy needs the dropped output (drops must be read)", op);
  if (!tw_tensor_is_none(dropped)) {
    TW_TRY(want(op, "dropped", dropped, m, 1, ep->nle, 0));
    TW_TRY(want_dtype(op, "dropped", dropped, TW_I32));
  }
  if (topk_idx->mem == TW_MEM_HOST) { /* a device backend checks ids on the device */
    const int32_t *p = (const int32_t *)topk_idx->data;
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < k; j++) {
        int32_t e = p[t * k + j];
        if (e < 0 || e >= c->num_experts)
          return tw_error(TW_ERR_INVALID_ARG, "%s: rank %d topk_idx[%lld, %lld] = %d is outside [0, E = %d)", op,
                          ep->rank, (long long)t, (long long)j, e, c->num_experts);
        for (int64_t i = 0; i < j; i++)
          if (p[t * k + i] == e)
            return tw_error(TW_ERR_INVALID_ARG, "%s: rank %d token %lld lists expert %d twice (slots %lld and %lld)",
                            op, ep->rank, (long long)t, e, (long long)i, (long long)j);
      }
  }
  return TW_OK;
}

tw_status tw_ep_dispatch(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                         const tw_tensor *token_scales, const tw_tensor *topk_idx,
                         const tw_tensor *topk_weights, tw_tensor *recv_tokens,
                         tw_tensor *recv_scales, tw_tensor *recv_weights,
                         tw_tensor *group_sizes, tw_tensor *dropped) {
  const char *op = "ep_dispatch";
  TW_TRY(check_dispatch_common(op, ctx, layer, tokens, token_scales, topk_idx, topk_weights, recv_weights,
                               group_sizes, dropped));
  const tw_ep *ep = layer->ep;
  const tw_ep_config *c = &ep->cfg;
  tw_mem m = ctx->ops->mem;
  int64_t H = c->hidden, R = c->recv_capacity;
  TW_TRY(want(op, "recv_tokens", recv_tokens, m, 2, R, H));
  TW_TRY(want_dtype(op, "recv_tokens", recv_tokens, c->token_dtype));
  if (ep->scale_cols) {
    tw_dtype sd = c->scale_block == 32 ? TW_E8M0 : TW_F32;
    if (c->scales_gemm_layout) { /* the grouped GEMM's rowwise 1x128 or MXFP8 scales */
      TW_TRY(tw_v_tensor(op, "recv_scales", recv_scales, m, 2));
      int64_t sh[2];
      scales_shape(c, R, ep->nle, sh);
      if (recv_scales->shape[0] != sh[0] || recv_scales->shape[1] != sh[1]) {
        if (c->scale_block == 128)
          return tw_error(TW_ERR_SHAPE,
                          "%s: recv_scales is [%lld, %lld], expected [%lld, %lld] = [H/128, roundup(R = %lld, 4)] "
                          "(scales_gemm_layout = 1)",
                          op, (long long)recv_scales->shape[0], (long long)recv_scales->shape[1], (long long)sh[0],
                          (long long)sh[1], (long long)R);
        return tw_error(TW_ERR_SHAPE,
                        "%s: recv_scales is [%lld, %lld], expected [%lld, %lld] = [128 * T_cap, roundup(H/32, 4)], "
                        "T_cap = floor((R + 127 * min(NLE, R)) / 128) with R = %lld, NLE = %d (MXFP8, "
                        "scales_gemm_layout = 1; tw_ep_recv_scales_shape)",
                        op, (long long)recv_scales->shape[0], (long long)recv_scales->shape[1], (long long)sh[0],
                        (long long)sh[1], (long long)R, ep->nle);
      }
    } else {
      TW_TRY(want(op, "recv_scales", recv_scales, m, 2, R, ep->scale_cols));
    }
    TW_TRY(want_dtype(op, "recv_scales", recv_scales, sd));
  } else if (!tw_tensor_is_none(recv_scales)) {
    return tw_error(TW_ERR_INVALID_ARG, "%s: recv_scales are for fp8 tokens only (tokens are %s)", op,
                    tw_dtype_name(c->token_dtype));
  }
  if (!ep->ops->ep->dispatch)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  layer->dispatched = 0;
  TW_TRY(ep->ops->ep->dispatch(ctx, layer, tokens, token_scales, topk_idx, topk_weights, recv_tokens,
                               recv_scales, recv_weights, group_sizes, dropped));
  layer->dispatched = 1;
  layer->tokens = tokens->shape[0];
  return TW_OK;
}

int64_t tw_ep_source_rows(const tw_ep *ep) { return ep ? (int64_t)ep->ep_size * ep->cfg.max_tokens : 0; }

tw_status tw_ep_source_scales_shape(const tw_ep_config *cfg, int ep_size, int64_t shape[2], tw_dtype *dtype) {
  const char *op = "ep_source_scales_shape";
  if (ep_size < 1) return tw_error(TW_ERR_INVALID_ARG, "%s: ep_size = %d", op, ep_size);
  TW_TRY(check_config(op, cfg, ep_size));
  if (!shape || !dtype) return tw_error(TW_ERR_NULL, "%s: shape or dtype is NULL", op);
  if (!tw_dtype_is_fp8(cfg->token_dtype))
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s tokens have no src_scales (fp8 only)", op,
                    tw_dtype_name(cfg->token_dtype));
  scales_shape(cfg, (int64_t)ep_size * cfg->max_tokens, 1, shape); /* U rows quantized as one group */
  *dtype = cfg->scale_block == 32 ? TW_E8M0 : TW_F32;
  return TW_OK;
}

tw_status tw_ep_dispatch_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                   const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                   const tw_tensor *topk_weights, tw_tensor *src_tokens,
                                   tw_tensor *src_scales, tw_tensor *recv_row,
                                   tw_tensor *recv_weights, tw_tensor *group_sizes,
                                   tw_tensor *dropped) {
  const char *op = "ep_dispatch_by_source";
  TW_TRY(check_dispatch_common(op, ctx, layer, tokens, token_scales, topk_idx, topk_weights, recv_weights,
                               group_sizes, dropped));
  const tw_ep *ep = layer->ep;
  const tw_ep_config *c = &ep->cfg;
  tw_mem m = ctx->ops->mem;
  int64_t H = c->hidden, R = c->recv_capacity, U = tw_ep_source_rows(ep);
  if (U > INT32_MAX)
    return tw_error(TW_ERR_SHAPE, "%s: U = ep_size %d x max_tokens %lld = %lld source rows do not fit recv_row's i32",
                    op, ep->ep_size, (long long)c->max_tokens, (long long)U);
  TW_TRY(want(op, "src_tokens", src_tokens, m, 2, U, H));
  TW_TRY(want_dtype(op, "src_tokens", src_tokens, c->token_dtype));
  TW_TRY(want(op, "recv_row", recv_row, m, 1, R, 0));
  TW_TRY(want_dtype(op, "recv_row", recv_row, TW_I32));
  if (ep->scale_cols) {
    int64_t sh[2];
    scales_shape(c, U, 1, sh);
    TW_TRY(tw_v_tensor(op, "src_scales", src_scales, m, 2));
    if (src_scales->shape[0] != sh[0] || src_scales->shape[1] != sh[1])
      return tw_error(TW_ERR_SHAPE,
                      "%s: src_scales is [%lld, %lld], expected [%lld, %lld] for U = %lld source rows (%s; "
                      "tw_ep_source_scales_shape)",
                      op, (long long)src_scales->shape[0], (long long)src_scales->shape[1], (long long)sh[0],
                      (long long)sh[1], (long long)U,
                      !c->scales_gemm_layout ? "rows [U, H/block]"
                      : c->scale_block == 128 ? "1x128 GEMM layout [H/128, roundup(U, 4)]"
                                              : "MXFP8 GEMM layout [128 * ceil(U/128), roundup(H/32, 4)]");
    TW_TRY(want_dtype(op, "src_scales", src_scales, c->scale_block == 32 ? TW_E8M0 : TW_F32));
  } else if (!tw_tensor_is_none(src_scales)) {
    return tw_error(TW_ERR_INVALID_ARG, "%s: src_scales are for fp8 tokens only (tokens are %s)", op,
                    tw_dtype_name(c->token_dtype));
  }
  if (!ep->ops->ep->dispatch_by_source)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  layer->dispatched = 0;
  TW_TRY(ep->ops->ep->dispatch_by_source(ctx, layer, tokens, token_scales, topk_idx, topk_weights, src_tokens,
                                         src_scales, recv_row, recv_weights, group_sizes, dropped));
  layer->dispatched = 1;
  layer->tokens = tokens->shape[0];
  return TW_OK;
}

static tw_status check_weights(const char *op, const tw_ep_layer *layer, const tw_tensor *w, tw_mem m,
                               const char *name) {
  if (tw_tensor_is_none(w)) return TW_OK;
  TW_TRY(want(op, name, w, m, 2, layer->tokens, layer->ep->cfg.topk));
  return want_dtype(op, name, w, TW_F32);
}

tw_status tw_ep_combine(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *expert_out,
                        const tw_tensor *topk_weights, tw_tensor *out) {
  const char *op = "ep_combine";
  TW_TRY(check_layer(op, ctx, layer, 1));
  tw_mem m = ctx->ops->mem;
  const tw_ep_config *c = &layer->ep->cfg;
  TW_TRY(want(op, "expert_out", expert_out, m, 2, c->recv_capacity, c->hidden));
  TW_TRY(want(op, "out", out, m, 2, layer->tokens, c->hidden));
  TW_TRY(float_rows(op, "expert_out", expert_out, NULL, NULL));
  TW_TRY(float_rows(op, "out", out, expert_out, "expert_out"));
  TW_TRY(check_weights(op, layer, topk_weights, m, "topk_weights"));
  if (!layer->ep->ops->ep->combine)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return layer->ep->ops->ep->combine(ctx, layer, expert_out, topk_weights, out);
}

tw_status tw_ep_dispatch_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_recv,
                             const tw_tensor *d_recv_weights, tw_tensor *d_tokens,
                             tw_tensor *d_topk_weights) {
  const char *op = "ep_dispatch_bwd";
  TW_TRY(check_layer(op, ctx, layer, 1));
  tw_mem m = ctx->ops->mem;
  const tw_ep_config *c = &layer->ep->cfg;
  TW_TRY(want(op, "d_recv", d_recv, m, 2, c->recv_capacity, c->hidden));
  TW_TRY(want(op, "d_tokens", d_tokens, m, 2, layer->tokens, c->hidden));
  TW_TRY(float_rows(op, "d_recv", d_recv, NULL, NULL));
  TW_TRY(float_rows(op, "d_tokens", d_tokens, d_recv, "d_recv"));
  if (tw_tensor_is_none(d_recv_weights) != tw_tensor_is_none(d_topk_weights))
    return tw_error(TW_ERR_INVALID_ARG, "%s: d_recv_weights and d_topk_weights come together (one is none)", op);
  if (!tw_tensor_is_none(d_recv_weights)) {
    TW_TRY(want(op, "d_recv_weights", d_recv_weights, m, 1, c->recv_capacity, 0));
    TW_TRY(want_dtype(op, "d_recv_weights", d_recv_weights, TW_F32));
    TW_TRY(check_weights(op, layer, d_topk_weights, m, "d_topk_weights"));
  }
  if (!layer->ep->ops->ep->dispatch_bwd)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return layer->ep->ops->ep->dispatch_bwd(ctx, layer, d_recv, d_recv_weights, d_tokens, d_topk_weights);
}

tw_status tw_ep_combine_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                            const tw_tensor *topk_weights, const tw_tensor *expert_out,
                            tw_tensor *d_expert_out, tw_tensor *d_topk_weights) {
  const char *op = "ep_combine_bwd";
  TW_TRY(check_layer(op, ctx, layer, 1));
  tw_mem m = ctx->ops->mem;
  const tw_ep_config *c = &layer->ep->cfg;
  TW_TRY(want(op, "d_out", d_out, m, 2, layer->tokens, c->hidden));
  TW_TRY(want(op, "d_expert_out", d_expert_out, m, 2, c->recv_capacity, c->hidden));
  TW_TRY(float_rows(op, "d_out", d_out, NULL, NULL));
  TW_TRY(float_rows(op, "d_expert_out", d_expert_out, d_out, "d_out"));
  TW_TRY(check_weights(op, layer, topk_weights, m, "topk_weights"));
  if (!tw_tensor_is_none(d_topk_weights)) {
    if (tw_tensor_is_none(topk_weights))
      return tw_error(TW_ERR_INVALID_ARG, "%s: d_topk_weights needs the weighted form (topk_weights is none)", op);
    TW_TRY(check_weights(op, layer, d_topk_weights, m, "d_topk_weights"));
    TW_TRY(want(op, "expert_out", expert_out, m, 2, c->recv_capacity, c->hidden));
    TW_TRY(float_rows(op, "expert_out", expert_out, NULL, NULL));
  }
  if (!layer->ep->ops->ep->combine_bwd)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return layer->ep->ops->ep->combine_bwd(ctx, layer, d_out, topk_weights, expert_out, d_expert_out,
                                         d_topk_weights);
}

tw_status tw_ep_combine_bwd_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                      const tw_tensor *expert_out, tw_tensor *d_src,
                                      tw_tensor *d_topk_weights) {
  const char *op = "ep_combine_bwd_by_source";
  TW_TRY(check_layer(op, ctx, layer, 1));
  tw_mem m = ctx->ops->mem;
  const tw_ep_config *c = &layer->ep->cfg;
  int64_t U = tw_ep_source_rows(layer->ep);
  TW_TRY(want(op, "d_out", d_out, m, 2, layer->tokens, c->hidden));
  TW_TRY(want(op, "d_src", d_src, m, 2, U, c->hidden));
  TW_TRY(float_rows(op, "d_out", d_out, NULL, NULL));
  TW_TRY(float_rows(op, "d_src", d_src, d_out, "d_out"));
  if (!tw_tensor_is_none(d_topk_weights)) {
    TW_TRY(check_weights(op, layer, d_topk_weights, m, "d_topk_weights"));
    if (tw_tensor_is_none(expert_out))
      return tw_error(TW_ERR_INVALID_ARG, "%s: d_topk_weights needs expert_out (it is none)", op);
  }
  if (!tw_tensor_is_none(expert_out)) {
    TW_TRY(want(op, "expert_out", expert_out, m, 2, c->recv_capacity, c->hidden));
    TW_TRY(float_rows(op, "expert_out", expert_out, NULL, NULL));
  }
  if (!layer->ep->ops->ep->combine_bwd_by_source)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: the %s backend does not provide it", op, ctx->ops->name);
  return layer->ep->ops->ep->combine_bwd_by_source(ctx, layer, d_out, expert_out, d_src, d_topk_weights);
}
