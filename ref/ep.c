/* The oracle's expert parallelism (tw_ep.h) on any tw_comm: the routing tables are computed
 * on the host from the all-gathered per-expert counts, and rows travel through one byte-wise
 * all_to_allv per step. Every rank derives every rank's slab layout from the same counts, so
 * a capacity error is reported by all ranks alike (no rank waits for a peer that gave up).
 *
 * Route = (t, j) of a source rank, flat index t*k + j. Send order of a source: by expert id,
 * then t, then j (kept routes only); receive order of a destination: by source rank, then
 * local expert, then the same (t, j) order -- so a row's slot follows from the counts.
 * A dispatch row carries the token row, its scales, the route's weight and t (the source-row
 * index of rows by source). */
#include <stdlib.h>
#include <string.h>

#include "core/validate.h"
#include "ref/ref_moe.h"
#include "twin/tw_comm.h"
#include "twin/tw_numerics.h"

typedef struct {
  unsigned char *send, *recv; /* staging: max_tokens*k and R rows of rb bytes */
  size_t rb;
  unsigned char *mx_rows;     /* MXFP8 with scales_gemm_layout: the [R, H/32] scale rows, then laid out */
} ep_impl;

typedef struct {
  int32_t *count_mine;  /* [E] routes of this rank per expert */
  int32_t *counts_all;  /* [ep, E] count_mine of every rank */
  int64_t *kept;        /* [ep, NLE] rows kept in slab l of rank r */
  int64_t *offs;        /* [ep, NLE] O_l of rank r */
  int64_t *slot_of;     /* [max_tokens*k] slot at the destination, -1 if dropped */
  int64_t *pack_list;   /* [max_tokens*k] route of each send position */
  int64_t *pos_of;      /* [max_tokens*k] send position of each route, -1 if dropped */
  int64_t *recv_slot;   /* [R] slot of each receive position */
  int64_t *send_cnt, *send_off, *recv_cnt, *recv_off; /* [ep], [ep+1] rows */
  int64_t *bytes;       /* [4 * ep] all_to_allv counts and displacements */
  int32_t *counter;     /* [E] scratch */
} layer_impl;

/* The communicator's table directly: the oracle links without //shard (the libFuzzer harness
 * builds core/ and ref/ alone), and every argument below is built here, not by a caller. */
static tw_status comm_all_gather(tw_ctx *ctx, tw_comm *c, const void *send, void *recv, int64_t count, tw_dtype dt) {
  return c->ops->all_gather(c, ctx, send, recv, count, dt);
}
static tw_status comm_all_to_allv(tw_ctx *ctx, tw_comm *c, const void *send, const int64_t *sc, const int64_t *sd,
                                  void *recv, const int64_t *rc, const int64_t *rd) {
  return c->ops->all_to_allv(c, ctx, send, sc, sd, recv, rc, rd, TW_U8);
}

static size_t payload_bytes(const tw_ep *ep) {
  const tw_ep_config *c = &ep->cfg;
  size_t tok = tw_dtype_storage_bytes(c->token_dtype, c->hidden);
  size_t scl = tw_dtype_storage_bytes(c->scale_block == 32 ? TW_E8M0 : TW_F32, ep->scale_cols);
  size_t y = (size_t)c->hidden * 4;
  return (tok + scl > y ? tok + scl : y) + 8; /* + the weight (f32) and the token index (i32) */
}

static void *zalloc(size_t n, int *failed) {
  void *p = calloc(n ? n : 1, 1);
  if (!p) *failed = 1;
  return p;
}

static tw_status ref_ep_create(tw_ep *ep) {
  const tw_comm_ops *co = ep->comm->ops;
  if (!co->all_gather || !co->all_to_allv || !co->barrier)
    return tw_error(TW_ERR_UNSUPPORTED, "ep_create: the '%s' communicator lacks all_gather, all_to_allv or barrier",
                    co->name);
  ep_impl *im = calloc(1, sizeof *im);
  int bad = !im;
  if (im) {
    im->rb = payload_bytes(ep);
    im->send = zalloc((size_t)(ep->cfg.max_tokens * ep->cfg.topk) * im->rb, &bad);
    im->recv = zalloc((size_t)ep->cfg.recv_capacity * im->rb, &bad);
    if (ep->cfg.scales_gemm_layout && ep->cfg.scale_block == 32)
      im->mx_rows = zalloc((size_t)ep->cfg.recv_capacity * (size_t)ep->scale_cols, &bad);
  }
  if (bad) {
    if (im) { free(im->send); free(im->recv); free(im->mx_rows); }
    free(im);
    return tw_error(TW_ERR_MEMORY, "ep_create: out of host memory for the staging buffers");
  }
  ep->impl = im;
  /* every rank must come: a create that fails on one rank fails the group */
  return ep->comm->ops->barrier(ep->comm, ep->ctx);
}

static tw_status ref_ep_destroy(tw_ep *ep) {
  ep_impl *im = ep->impl;
  if (im) { free(im->send); free(im->recv); free(im->mx_rows); }
  free(im);
  return TW_OK;
}

static tw_status ref_ep_layer_destroy(tw_ep_layer *layer);

static tw_status ref_ep_layer_create(tw_ep_layer *layer) {
  const tw_ep *ep = layer->ep;
  int64_t n = ep->ep_size, E = ep->cfg.num_experts, routes = ep->cfg.max_tokens * ep->cfg.topk;
  int bad = 0;
  layer_impl *L = zalloc(sizeof *L, &bad);
  if (L) {
    L->count_mine = zalloc((size_t)E * 4, &bad);
    L->counter = zalloc((size_t)E * 4, &bad);
    L->counts_all = zalloc((size_t)(n * E) * 4, &bad);
    L->kept = zalloc((size_t)(n * ep->nle) * 8, &bad);
    L->offs = zalloc((size_t)(n * ep->nle) * 8, &bad);
    L->slot_of = zalloc((size_t)routes * 8, &bad);
    L->pack_list = zalloc((size_t)routes * 8, &bad);
    L->pos_of = zalloc((size_t)routes * 8, &bad);
    L->recv_slot = zalloc((size_t)ep->cfg.recv_capacity * 8, &bad);
    L->send_cnt = zalloc((size_t)n * 8, &bad);
    L->recv_cnt = zalloc((size_t)n * 8, &bad);
    L->send_off = zalloc((size_t)(n + 1) * 8, &bad);
    L->recv_off = zalloc((size_t)(n + 1) * 8, &bad);
    L->bytes = zalloc((size_t)(4 * n) * 8, &bad);
  }
  layer->impl = L;
  if (bad) {
    ref_ep_layer_destroy(layer);
    return tw_error(TW_ERR_MEMORY, "ep_layer_create: out of host memory for the routing state");
  }
  return TW_OK;
}

static tw_status ref_ep_layer_destroy(tw_ep_layer *layer) {
  layer_impl *L = layer->impl;
  if (!L) return TW_OK;
  free(L->count_mine); free(L->counter); free(L->counts_all); free(L->kept); free(L->offs);
  free(L->slot_of); free(L->pack_list); free(L->pos_of); free(L->recv_slot);
  free(L->send_cnt); free(L->recv_cnt); free(L->send_off); free(L->recv_off); free(L->bytes);
  free(L);
  layer->impl = NULL;
  return TW_OK;
}

/* ---- the routing tables ----------------------------------------------------------------- */

/* kept/offs of every rank from counts_all; under the error policy, the first rank whose
 * demand exceeds R fails the call (every rank computes the same). */
static tw_status slab_layout(const tw_ep *ep, layer_impl *L) {
  int n = ep->ep_size, nle = ep->nle, E = ep->cfg.num_experts;
  int64_t A = ep->cfg.alignment, R = ep->cfg.recv_capacity;
  for (int r = 0; r < n; r++) {
    int64_t demand = 0;
    for (int l = 0; l < nle; l++) {
      int64_t c = 0;
      for (int s = 0; s < n; s++) c += L->counts_all[s * E + r * nle + l];
      demand += tw_round_up(c, A);
    }
    if (demand > R && ep->cfg.overflow == TW_EP_OVERFLOW_ERROR)
      return tw_error(TW_ERR_INVALID_ARG,
                      "ep_dispatch: rank %d needs %lld receive rows (per-expert counts rounded up to alignment "
                      "%lld) but recv_capacity is %lld (overflow policy: error)",
                      r, (long long)demand, (long long)A, (long long)R);
    int64_t o = 0;
    for (int l = 0; l < nle; l++) {
      int64_t c = 0;
      for (int s = 0; s < n; s++) c += L->counts_all[s * E + r * nle + l];
      int64_t kept = c < R - o ? c : R - o; /* R - o is a multiple of A: the padding fits */
      L->kept[r * nle + l] = kept;
      L->offs[r * nle + l] = o;
      o += tw_round_up(kept, A);
    }
  }
  return TW_OK;
}

/* Routes sent by this rank (slot_of, pack order) and rows it receives (recv_slot). */
static void route_tables(const tw_ep *ep, layer_impl *L, const int32_t *idx, int64_t T) {
  int n = ep->ep_size, nle = ep->nle, E = ep->cfg.num_experts, me = ep->rank, k = ep->cfg.topk;
  memset(L->counter, 0, (size_t)E * 4);
  for (int64_t q = 0; q < T * k; q++) {
    int e = idx[q], r = e / nle, l = e % nle;
    int64_t before = 0;
    for (int s = 0; s < me; s++) before += L->counts_all[s * E + e];
    int64_t pos = before + L->counter[e]++;
    L->slot_of[q] = pos < L->kept[r * nle + l] ? L->offs[r * nle + l] + pos : -1;
    L->pos_of[q] = -1;
  }
  int64_t p = 0;
  for (int r = 0; r < n; r++) {
    L->send_off[r] = p;
    for (int e = r * nle; e < (r + 1) * nle; e++)
      for (int64_t q = 0; q < T * k; q++)
        if (idx[q] == e && L->slot_of[q] >= 0) {
          L->pos_of[q] = p;
          L->pack_list[p++] = q;
        }
    L->send_cnt[r] = p - L->send_off[r];
  }
  L->send_off[n] = p;
  p = 0;
  for (int s = 0; s < n; s++) {
    L->recv_off[s] = p;
    for (int l = 0; l < nle; l++) {
      int e = me * nle + l;
      int64_t before = 0;
      for (int s2 = 0; s2 < s; s2++) before += L->counts_all[s2 * E + e];
      int64_t from_s = L->kept[me * nle + l] - before;
      if (from_s > L->counts_all[s * E + e]) from_s = L->counts_all[s * E + e];
      for (int64_t i = 0; i < from_s; i++) L->recv_slot[p++] = L->offs[me * nle + l] + before + i;
    }
    L->recv_cnt[s] = p - L->recv_off[s];
  }
  L->recv_off[n] = p;
}

/* Source -> destination (send staging -> recv staging), or back. */
static tw_status move(tw_ctx *ctx, const tw_ep *ep, const layer_impl *L, int forward) {
  ep_impl *im = ep->impl;
  int n = ep->ep_size;
  int64_t *scount = L->bytes, *sdisp = L->bytes + n, *rcount = L->bytes + 2 * n, *rdisp = L->bytes + 3 * n;
  const int64_t *cnt_s = forward ? L->send_cnt : L->recv_cnt, *off_s = forward ? L->send_off : L->recv_off;
  const int64_t *cnt_r = forward ? L->recv_cnt : L->send_cnt, *off_r = forward ? L->recv_off : L->send_off;
  for (int r = 0; r < n; r++) {
    scount[r] = cnt_s[r] * (int64_t)im->rb;
    sdisp[r] = off_s[r] * (int64_t)im->rb;
    rcount[r] = cnt_r[r] * (int64_t)im->rb;
    rdisp[r] = off_r[r] * (int64_t)im->rb;
  }
  return forward ? comm_all_to_allv(ctx, ep->comm, im->send, scount, sdisp, im->recv, rcount, rdisp)
                 : comm_all_to_allv(ctx, ep->comm, im->recv, scount, sdisp, im->send, rcount, rdisp);
}

static float row_f32(const tw_tensor *t, int64_t i) {
  return t->dtype == TW_F32 ? ((const float *)t->data)[i] : tw_bf16_to_f32(((const uint16_t *)t->data)[i]);
}
static void set_f32(tw_tensor *t, int64_t i, float v) {
  if (t->dtype == TW_F32) ((float *)t->data)[i] = v;
  else ((uint16_t *)t->data)[i] = tw_f32_to_bf16(v);
}

/* MXFP8 rows [R, sc] (E8M0) -> the grouped GEMM's rowwise scale layout (tw_ep.h, tw_quantize.h):
 * slab l's block [128 * ceil(padded_l / 128), C] at row 128 * T(l), row i < padded_l = the
 * scale row of recv row O_l + i; everything else of out [out_rows, C] is 0x00. swz: each block
 * in cuBLAS's 128x4 tiling, element (r, c) with r = 128a + 32b + d, c = 4e + f at
 * ((a * C/4 + e) * 32 + d) * 16 + b * 4 + f of the block. */
static void mx_gemm_layout(const unsigned char *rows, int64_t sc, const int32_t *padded, int nle, int swz,
                           int64_t out_rows, unsigned char *out) {
  int64_t C = tw_round_up(sc, 4);
  memset(out, 0, (size_t)(out_rows * C));
  int64_t o = 0, tiles = 0;
  for (int l = 0; l < nle; l++) {
    int64_t m = padded[l];
    unsigned char *blk = out + (size_t)(128 * tiles * C);
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < sc; c++) {
        int64_t a = r / 128, b = r % 128 / 32, d = r % 32, e = c / 4, f = c % 4;
        int64_t at = swz ? ((a * (C / 4) + e) * 32 + d) * 16 + b * 4 + f : r * C + c;
        blk[at] = rows[(o + r) * sc + c];
      }
    o += m;
    tiles += (m + 127) / 128;
  }
}

/* ---- the four operations ----------------------------------------------------------------- */

/* The part both dispatch forms share: counts, layout and route tables, then every kept
 * route's row (token, scales, weight, t) from its source to its destination's staging. */
static tw_status route_and_move(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                const tw_tensor *topk_weights, tw_tensor *group_sizes, tw_tensor *dropped) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = layer->impl;
  ep_impl *im = ep->impl;
  int E = ep->cfg.num_experts, k = ep->cfg.topk, nle = ep->nle, me = ep->rank;
  int64_t T = tokens->shape[0], A = ep->cfg.alignment;
  const int32_t *idx = topk_idx->data;
  memset(L->count_mine, 0, (size_t)E * 4);
  for (int64_t q = 0; q < T * k; q++) L->count_mine[idx[q]]++;
  TW_TRY(comm_all_gather(ctx, ep->comm, L->count_mine, L->counts_all, E, TW_I32));
  TW_TRY(slab_layout(ep, L));
  route_tables(ep, L, idx, T);

  size_t tb = tw_dtype_storage_bytes(ep->cfg.token_dtype, ep->cfg.hidden);
  size_t sb = ep->scale_cols ? tw_dtype_storage_bytes(token_scales->dtype, ep->scale_cols) : 0;
  for (int64_t p = 0; p < L->send_off[ep->ep_size]; p++) {
    int64_t q = L->pack_list[p], t = q / k;
    int32_t t32 = (int32_t)t;
    unsigned char *row = im->send + (size_t)p * im->rb;
    memcpy(row, (const unsigned char *)tokens->data + (size_t)t * tb, tb);
    if (sb) memcpy(row + tb, (const unsigned char *)token_scales->data + (size_t)t * sb, sb);
    memcpy(row + tb + sb, (const float *)topk_weights->data + q, 4);
    memcpy(row + tb + sb + 4, &t32, 4);
  }
  TW_TRY(move(ctx, ep, L, 1));
  for (int l = 0; l < nle; l++) {
    int64_t c = 0;
    for (int s = 0; s < ep->ep_size; s++) c += L->counts_all[s * E + me * nle + l];
    ((int32_t *)group_sizes->data)[l] = (int32_t)tw_round_up(L->kept[me * nle + l], A);
    if (!tw_tensor_is_none(dropped)) ((int32_t *)dropped->data)[l] = (int32_t)(c - L->kept[me * nle + l]);
  }
  return TW_OK;
}

/* Staging row p's source rank (recv_off is ascending). */
static int source_of(const layer_impl *L, int n, int64_t p) {
  int s = 0;
  while (s + 1 < n && p >= L->recv_off[s + 1]) s++;
  return s;
}

static tw_status ref_ep_dispatch(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                 const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                 const tw_tensor *topk_weights, tw_tensor *recv_tokens,
                                 tw_tensor *recv_scales, tw_tensor *recv_weights,
                                 tw_tensor *group_sizes, tw_tensor *dropped) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = layer->impl;
  ep_impl *im = ep->impl;
  int nle = ep->nle;
  int64_t R = ep->cfg.recv_capacity;
  TW_TRY(route_and_move(ctx, layer, tokens, token_scales, topk_idx, topk_weights, group_sizes, dropped));
  size_t tb = tw_dtype_storage_bytes(ep->cfg.token_dtype, ep->cfg.hidden);
  size_t sb = ep->scale_cols ? tw_dtype_storage_bytes(token_scales->dtype, ep->scale_cols) : 0;
  /* every row is written: padding and the rows past the slabs are zero. The GEMM layout
   * (1x128 f32): scale b of row `slot` at [b][slot] of [scale_cols, Rp], tail columns 0;
   * (MXFP8): the rows first, laid out per slab below */
  int mx = sb && ep->cfg.scales_gemm_layout && ep->cfg.scale_block == 32;
  int64_t Rp = sb && ep->cfg.scales_gemm_layout && !mx ? tw_round_up(R, 4) : 0;
  unsigned char *srows = mx ? im->mx_rows : recv_scales->data;
  memset(recv_tokens->data, 0, (size_t)R * tb);
  if (sb) memset(srows, 0, Rp ? (size_t)(ep->scale_cols * Rp) * 4 : (size_t)R * sb);
  memset(recv_weights->data, 0, (size_t)R * 4);
  for (int64_t p = 0; p < L->recv_off[ep->ep_size]; p++) {
    int64_t slot = L->recv_slot[p];
    const unsigned char *row = im->recv + (size_t)p * im->rb;
    memcpy((unsigned char *)recv_tokens->data + (size_t)slot * tb, row, tb);
    if (sb && !Rp) memcpy(srows + (size_t)slot * sb, row + tb, sb);
    for (int64_t b = 0; sb && Rp && b < ep->scale_cols; b++) /* the bytes of each f32 as they came */
      memcpy((unsigned char *)recv_scales->data + (size_t)(b * Rp + slot) * 4, row + tb + (size_t)b * 4, 4);
    memcpy((float *)recv_weights->data + slot, row + tb + sb, 4);
  }
  if (mx)
    mx_gemm_layout(srows, ep->scale_cols, (const int32_t *)group_sizes->data, nle, ep->cfg.scales_mxfp8_swizzled,
                   recv_scales->shape[0], recv_scales->data);
  return TW_OK;
}

/* Rows by source (tw_ep.h): row s * max_tokens + t of src_tokens from each received row, the
 * expert-major row map, the weights; zeros where nothing arrived. */
static tw_status ref_ep_dispatch_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens,
                                           const tw_tensor *token_scales, const tw_tensor *topk_idx,
                                           const tw_tensor *topk_weights, tw_tensor *src_tokens,
                                           tw_tensor *src_scales, tw_tensor *recv_row, tw_tensor *recv_weights,
                                           tw_tensor *group_sizes, tw_tensor *dropped) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = layer->impl;
  ep_impl *im = ep->impl;
  int64_t R = ep->cfg.recv_capacity, maxT = ep->cfg.max_tokens, U = (int64_t)ep->ep_size * maxT;
  int64_t sc = ep->scale_cols;
  TW_TRY(route_and_move(ctx, layer, tokens, token_scales, topk_idx, topk_weights, group_sizes, dropped));
  size_t tb = tw_dtype_storage_bytes(ep->cfg.token_dtype, ep->cfg.hidden);
  size_t sb = sc ? tw_dtype_storage_bytes(token_scales->dtype, sc) : 0;
  int gemm = sb && ep->cfg.scales_gemm_layout, mx = ep->cfg.scale_block == 32;
  int64_t Up = tw_round_up(U, 4), C = tw_round_up(sc, 4);
  memset(src_tokens->data, 0, (size_t)U * tb);
  if (sb) memset(src_scales->data, 0, (size_t)tw_tensor_numel(src_scales) * (mx ? 1 : 4));
  memset(recv_weights->data, 0, (size_t)R * 4);
  for (int64_t i = 0; i < R; i++) ((int32_t *)recv_row->data)[i] = -1;
  for (int64_t p = 0; p < L->recv_off[ep->ep_size]; p++) {
    int64_t slot = L->recv_slot[p];
    const unsigned char *row = im->recv + (size_t)p * im->rb;
    int32_t t;
    memcpy(&t, row + tb + sb + 4, 4);
    int64_t u = (int64_t)source_of(L, ep->ep_size, p) * maxT + t;
    memcpy((unsigned char *)src_tokens->data + (size_t)u * tb, row, tb); /* a token with several routes: same bytes */
    for (int64_t b = 0; b < sc; b++) {
      const unsigned char *v = row + tb + (size_t)b * (mx ? 1 : 4);
      unsigned char *scl = src_scales->data;
      if (!gemm) { /* rows [U, sc] */
        memcpy(scl + (size_t)(u * sc + b) * (mx ? 1 : 4), v, mx ? 1 : 4);
      } else if (!mx) { /* 1x128: [b][u] of [sc, roundup(U, 4)], the f32's bytes as they came */
        memcpy(scl + (size_t)(b * Up + u) * 4, v, 4);
      } else { /* MXFP8, one group: row u of the [128 * ceil(U/128), C] block, compact or swizzled */
        int64_t a = u / 128, bb = u % 128 / 32, d = u % 32, e = b / 4, f = b % 4;
        scl[ep->cfg.scales_mxfp8_swizzled ? ((a * (C / 4) + e) * 32 + d) * 16 + bb * 4 + f : u * C + b] = *v;
      }
    }
    ((int32_t *)recv_row->data)[slot] = (int32_t)u;
    memcpy((float *)recv_weights->data + slot, row + tb + sb, 4);
  }
  return TW_OK;
}

/* Destination rows (slots of `rows`, widened to f32) plus an optional per-slot f32 back to
 * the sources; afterwards send staging position p holds the row of route pack_list[p]. */
static tw_status rows_back(tw_ctx *ctx, const tw_ep_layer *layer, const tw_tensor *rows,
                           const tw_tensor *per_slot) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = layer->impl;
  ep_impl *im = ep->impl;
  int64_t H = ep->cfg.hidden;
  for (int64_t p = 0; p < L->recv_off[ep->ep_size]; p++) {
    int64_t slot = L->recv_slot[p];
    float *row = (float *)(im->recv + (size_t)p * im->rb);
    for (int64_t h = 0; h < H; h++) row[h] = row_f32(rows, slot * H + h);
    row[H] = per_slot && !tw_tensor_is_none(per_slot) ? ((const float *)per_slot->data)[slot] : 0.0f;
  }
  return move(ctx, ep, L, 0);
}

static const float *route_row(const tw_ep_layer *layer, int64_t q) {
  const layer_impl *L = layer->impl;
  const ep_impl *im = layer->ep->impl;
  return L->pos_of[q] < 0 ? NULL : (const float *)(im->send + (size_t)L->pos_of[q] * im->rb);
}

static tw_status ref_ep_combine(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *expert_out,
                                const tw_tensor *topk_weights, tw_tensor *out) {
  TW_TRY(rows_back(ctx, layer, expert_out, NULL));
  int64_t T = layer->tokens, H = layer->ep->cfg.hidden, k = layer->ep->cfg.topk;
  const float *w = tw_tensor_is_none(topk_weights) ? NULL : topk_weights->data;
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      float acc = 0.0f; /* f32, j = 0..k-1: the documented order */
      for (int64_t j = 0; j < k; j++) {
        const float *y = route_row(layer, t * k + j);
        if (y) acc += (w ? w[t * k + j] : 1.0f) * y[h];
      }
      set_f32(out, t * H + h, acc);
    }
  return TW_OK;
}

static tw_status ref_ep_dispatch_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_recv,
                                     const tw_tensor *d_recv_weights, tw_tensor *d_tokens,
                                     tw_tensor *d_topk_weights) {
  TW_TRY(rows_back(ctx, layer, d_recv, d_recv_weights));
  int64_t T = layer->tokens, H = layer->ep->cfg.hidden, k = layer->ep->cfg.topk;
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; j++) {
        const float *g = route_row(layer, t * k + j);
        if (g) acc += g[h];
      }
      set_f32(d_tokens, t * H + h, acc);
    }
    if (!tw_tensor_is_none(d_topk_weights))
      for (int64_t j = 0; j < k; j++) {
        const float *g = route_row(layer, t * k + j);
        ((float *)d_topk_weights->data)[t * k + j] = g ? g[H] : 0.0f;
      }
  }
  return TW_OK;
}

/* combine_bwd's d_topk_weights dot, sum_h d_out[off + h] * y[h], in tw_ep.h's warp order: each
 * product rounded to f32 on its own, added into partial (h / 8) % 32 in increasing h, then the
 * fold. Never an FMA: the product is its own statement (clang contracts only within one), and
 * GCC contracts across statements only outside ISO C (.bazelrc builds -std=c11). */
static float dot_warp_order(const tw_tensor *d_out, int64_t off, const float *y, int64_t H) {
  float P[32] = {0.0f};
  for (int64_t h = 0; h < H; h++) {
    float p = row_f32(d_out, off + h) * y[h];
    P[(h / 8) % 32] += p;
  }
  for (int m = 16; m >= 1; m /= 2)
    for (int l = 0; l < m; l++) P[l] += P[l + m];
  return P[0];
}

/* d_topk_weights of combine_bwd (both forms): expert_out's rows back to the routes' sources,
 * then each kept route's dot with its token's d_out row. */
static tw_status dots_back(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out, const tw_tensor *expert_out,
                           tw_tensor *d_topk_weights) {
  int64_t H = layer->ep->cfg.hidden, k = layer->ep->cfg.topk, T = layer->tokens;
  TW_TRY(rows_back(ctx, layer, expert_out, NULL));
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      const float *y = route_row(layer, t * k + j);
      ((float *)d_topk_weights->data)[t * k + j] = y ? dot_warp_order(d_out, t * H, y, H) : 0.0f;
    }
  return TW_OK;
}

static tw_status ref_ep_combine_bwd(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                    const tw_tensor *topk_weights, const tw_tensor *expert_out,
                                    tw_tensor *d_expert_out, tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = layer->impl;
  ep_impl *im = ep->impl;
  int64_t H = ep->cfg.hidden, k = ep->cfg.topk, R = ep->cfg.recv_capacity;
  const float *w = tw_tensor_is_none(topk_weights) ? NULL : topk_weights->data;
  for (int64_t p = 0; p < L->send_off[ep->ep_size]; p++) {
    int64_t q = L->pack_list[p], t = q / k;
    float *row = (float *)(im->send + (size_t)p * im->rb);
    for (int64_t h = 0; h < H; h++) row[h] = (w ? w[q] : 1.0f) * row_f32(d_out, t * H + h);
  }
  TW_TRY(move(ctx, ep, L, 1));
  size_t eb = tw_dtype_storage_bytes(d_expert_out->dtype, H);
  memset(d_expert_out->data, 0, (size_t)R * eb);
  for (int64_t p = 0; p < L->recv_off[ep->ep_size]; p++) {
    const float *row = (const float *)(im->recv + (size_t)p * im->rb);
    for (int64_t h = 0; h < H; h++) set_f32(d_expert_out, L->recv_slot[p] * H + h, row[h]);
  }
  if (tw_tensor_is_none(d_topk_weights)) return TW_OK;
  return dots_back(ctx, layer, d_out, expert_out, d_topk_weights);
}

/* combine_bwd by source (tw_ep.h): each kept route carries its token's d_out row (as f32, exact
 * for bf16 too) and t to the route's rank, which writes it at row source * max_tokens + t of
 * d_src (a token with several routes there: the same bytes again); zeros where nothing came. */
static tw_status ref_ep_combine_bwd_by_source(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *d_out,
                                              const tw_tensor *expert_out, tw_tensor *d_src,
                                              tw_tensor *d_topk_weights) {
  const tw_ep *ep = layer->ep;
  layer_impl *L = layer->impl;
  ep_impl *im = ep->impl;
  int64_t H = ep->cfg.hidden, k = ep->cfg.topk, maxT = ep->cfg.max_tokens, U = (int64_t)ep->ep_size * maxT;
  for (int64_t p = 0; p < L->send_off[ep->ep_size]; p++) {
    int64_t q = L->pack_list[p], t = q / k;
    int32_t t32 = (int32_t)t;
    float *row = (float *)(im->send + (size_t)p * im->rb);
    for (int64_t h = 0; h < H; h++) row[h] = row_f32(d_out, t * H + h);
    memcpy(row + H, &t32, 4);
  }
  TW_TRY(move(ctx, ep, L, 1));
  memset(d_src->data, 0, (size_t)U * tw_dtype_storage_bytes(d_src->dtype, H));
  for (int64_t p = 0; p < L->recv_off[ep->ep_size]; p++) {
    const float *row = (const float *)(im->recv + (size_t)p * im->rb);
    int32_t t;
    memcpy(&t, row + H, 4);
    int64_t u = (int64_t)source_of(L, ep->ep_size, p) * maxT + t;
    for (int64_t h = 0; h < H; h++) set_f32(d_src, u * H + h, row[h]);
  }
  if (tw_tensor_is_none(d_topk_weights)) return TW_OK;
  return dots_back(ctx, layer, d_out, expert_out, d_topk_weights);
}

const tw_ep_backend tw_ref_ep = {
    .create = ref_ep_create,
    .destroy = ref_ep_destroy,
    .layer_create = ref_ep_layer_create,
    .layer_destroy = ref_ep_layer_destroy,
    .dispatch = ref_ep_dispatch,
    .dispatch_by_source = ref_ep_dispatch_by_source,
    .combine = ref_ep_combine,
    .dispatch_bwd = ref_ep_dispatch_bwd,
    .combine_bwd = ref_ep_combine_bwd,
    .combine_bwd_by_source = ref_ep_combine_bwd_by_source,
};
