/* EP dispatch / combine and their backward on thread ranks (tw_ep.h), against the unsharded
 * formula computed here without any communication: exact equality of every output row
 * (data movement and f32 sums in the documented order are exact), token conservation
 * (every kept (token, j) arrives once at its expert, kept + dropped = routes), zero padding,
 * NaN-poisoned padding that must not leak, capacity policies, and two interleaved layers. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"

#define MAXR 8
#define MAXT 64

enum { DIST_UNIFORM, DIST_HOT, DIST_ONE, DIST_EVEN_ONLY };

typedef struct {
  int n, E, k;
  int64_t H, T[MAXR], A, R; /* R = 0: the no-drop capacity */
  tw_dtype dt;
  int scale_block;
  tw_ep_overflow policy;
  int dist;
  uint64_t seed;
  int two_layers;
  /* inputs per rank */
  unsigned char *tok[MAXR], *scl[MAXR];
  int32_t *idx[MAXR];
  float *w[MAXR], *dout[MAXR];
  /* expected, from the formula */
  int64_t Rr;
  int64_t *slot_src[MAXR]; /* [R] flat (s, t, j) = (s*MAXT + t)*k + j of the row, -1 padding */
  int32_t gs[MAXR][64], dropped[MAXR][64];
  int expect_error;
} scenario;

static size_t tok_bytes(const scenario *c) { return tw_dtype_storage_bytes(c->dt, c->H); }
static int64_t scale_cols(const scenario *c) { return c->scale_block ? c->H / c->scale_block : 0; }
static tw_dtype scale_dtype(const scenario *c) { return c->scale_block == 32 ? TW_E8M0 : TW_F32; }
static size_t scl_bytes(const scenario *c) { return tw_dtype_storage_bytes(scale_dtype(c), scale_cols(c)); }

/* distinct ids for one token, by distribution */
static void draw_ids(scenario *c, uint64_t *st, int32_t *ids) {
  for (int j = 0; j < c->k; j++) {
    int e;
    int again;
    do {
      if (c->dist == DIST_HOT && j == 0 && tt_rand_uniform(st, 0, 1) < 0.8) e = 0;
      else if (c->dist == DIST_ONE && j == 0) e = c->E - 1;
      else if (c->dist == DIST_EVEN_ONLY) e = 2 * (int)tt_rand_uniform(st, 0, c->E / 2);
      else e = (int)tt_rand_uniform(st, 0, c->E);
      again = 0;
      for (int i = 0; i < j; i++) again |= ids[i] == e;
    } while (again);
    ids[j] = e;
  }
}

static void make_inputs(scenario *c) {
  uint64_t st = c->seed;
  for (int r = 0; r < c->n; r++) {
    int64_t T = c->T[r];
    c->tok[r] = calloc((size_t)T * tok_bytes(c) + 1, 1);
    c->scl[r] = calloc((size_t)T * scl_bytes(c) + 1, 1);
    c->idx[r] = calloc((size_t)(T * c->k) + 1, 4);
    c->w[r] = calloc((size_t)(T * c->k) + 1, 4);
    c->dout[r] = calloc((size_t)(T * c->H) + 1, 4);
    for (int64_t t = 0; t < T; t++) {
      draw_ids(c, &st, c->idx[r] + t * c->k);
      for (int j = 0; j < c->k; j++) c->w[r][t * c->k + j] = (float)tt_rand_uniform(&st, 0.05, 1);
      for (int64_t h = 0; h < c->H; h++) {
        float v = (float)tt_rand_uniform(&st, -2, 2);
        if (h == 0) v = (float)(r * MAXT + t); /* identity of the token, exact in f32 and bf16 (< 256) */
        if (c->dt == TW_F32) ((float *)c->tok[r])[t * c->H + h] = v;
        else if (c->dt == TW_BF16) ((uint16_t *)c->tok[r])[t * c->H + h] = tw_f32_to_bf16(v);
        else c->tok[r][t * c->H + h] = (unsigned char)tt_rand_u64(&st);
        c->dout[r][t * c->H + h] = (float)tt_rand_uniform(&st, -1, 1);
      }
      for (size_t b = 0; b < scl_bytes(c); b++) c->scl[r][t * scl_bytes(c) + b] = (unsigned char)tt_rand_u64(&st);
      if (c->scale_block == 128)
        for (int64_t b = 0; b < scale_cols(c); b++) ((float *)c->scl[r])[t * scale_cols(c) + b] = (float)tt_rand_uniform(&st, 0.1, 4);
    }
  }
}

static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* The formula of tw_ep.h, rank by rank, with no communication. */
static void expected_layout(scenario *c) {
  int nle = c->E / c->n;
  int64_t maxT = 0;
  for (int r = 0; r < c->n; r++) maxT = c->T[r] > maxT ? c->T[r] : maxT;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = MAXT; cfg.alignment = c->A;
  c->Rr = c->R ? c->R : tw_ep_capacity_no_drop(&cfg, c->n);
  c->expect_error = 0;
  for (int r = 0; r < c->n; r++) {
    c->slot_src[r] = malloc((size_t)c->Rr * 8);
    for (int64_t i = 0; i < c->Rr; i++) c->slot_src[r][i] = -1;
    int64_t O = 0, demand = 0;
    for (int l = 0; l < nle; l++) {
      int e = r * nle + l;
      int64_t cnt = 0;
      for (int s = 0; s < c->n; s++)
        for (int64_t q = 0; q < c->T[s] * c->k; q++) cnt += c->idx[s][q] == e;
      demand += round_up(cnt, c->A);
      int64_t kept = cnt < c->Rr - O ? cnt : c->Rr - O, i = 0;
      for (int s = 0; s < c->n; s++)
        for (int64_t q = 0; q < c->T[s] * c->k; q++)
          if (c->idx[s][q] == e) {
            if (i < kept) c->slot_src[r][O + i] = ((int64_t)s * MAXT + q / c->k) * c->k + q % c->k;
            i++;
          }
      c->gs[r][l] = (int32_t)round_up(kept, c->A);
      c->dropped[r][l] = (int32_t)(cnt - kept);
      O += round_up(kept, c->A);
    }
    if (demand > c->Rr && c->policy == TW_EP_OVERFLOW_ERROR) c->expect_error = 1;
  }
}

/* The expert "FFN" of the test: a function of the token row and the expert only, so the
 * expected combine needs no knowledge of slots. */
static float expert_fn(float x, int e, int64_t h) { return x * (float)(e + 1) + 0.125f * (float)h; }
static float grad_fn(float x, int e, int64_t h) { return x * 0.5f - (float)e + 0.25f * (float)h; }

static float tok_f32(const scenario *c, const unsigned char *rows, int64_t i) {
  if (c->dt == TW_F32) return ((const float *)rows)[i];
  if (c->dt == TW_BF16) return tw_bf16_to_f32(((const uint16_t *)rows)[i]);
  return (float)rows[i] / 16.0f; /* fp8 rows: any fixed function of the bytes */
}

#define FAIL(...) return tw_error(TW_ERR_INTERNAL, __VA_ARGS__)

typedef struct {
  scenario *c[2]; /* one routing per layer; both share the EP config of c[0] */
  int layers;
} job;

typedef struct {
  unsigned char *recv, *rscl;
  float *rw, *y, *dy, *drw, *out, *dtok, *dtw, *dexp, *dtw2;
  float *prod; /* [H] one route's d_topk_weights products */
  int32_t gs[64], dropped[64];
  tw_ep_layer *layer;
} layer_bufs;

static tw_status check_dispatch(const scenario *c, int me, const layer_bufs *b, int64_t R) {
  int nle = c->E / c->n;
  size_t tb = tok_bytes(c), sb = scl_bytes(c);
  for (int l = 0; l < nle; l++) {
    if (b->gs[l] != c->gs[me][l]) FAIL("rank %d: group_sizes[%d] = %d, formula %d", me, l, b->gs[l], c->gs[me][l]);
    if (b->dropped[l] != c->dropped[me][l]) FAIL("rank %d: dropped[%d] = %d, formula %d", me, l, b->dropped[l], c->dropped[me][l]);
  }
  for (int64_t i = 0; i < R; i++) {
    int64_t src = c->slot_src[me][i];
    const unsigned char *row = b->recv + i * tb;
    if (src < 0) { /* padding and unused rows: zero */
      for (size_t x = 0; x < tb; x++)
        if (row[x]) FAIL("rank %d: padding row %lld is not zero", me, (long long)i);
      if (b->rw[i] != 0.0f) FAIL("rank %d: recv_weights[%lld] of a padding row is %g", me, (long long)i, b->rw[i]);
      for (size_t x = 0; x < sb; x++)
        if (b->rscl[i * sb + x]) FAIL("rank %d: padding scale row %lld is not zero", me, (long long)i);
      continue;
    }
    int s = (int)(src / c->k / MAXT);
    int64_t t = src / c->k % MAXT, j = src % c->k;
    if (memcmp(row, c->tok[s] + t * tb, tb) != 0)
      FAIL("rank %d: recv row %lld is not token %lld of rank %d", me, (long long)i, (long long)t, s);
    if (sb && memcmp(b->rscl + i * sb, c->scl[s] + t * sb, sb) != 0)
      FAIL("rank %d: recv scales %lld are not those of token %lld of rank %d", me, (long long)i, (long long)t, s);
    if (b->rw[i] != c->w[s][t * c->k + j])
      FAIL("rank %d: recv_weights[%lld] = %g, expected %g", me, (long long)i, b->rw[i], c->w[s][t * c->k + j]);
  }
  return TW_OK;
}

/* kept(s, t, j): the route reached its expert. */
static int kept(const scenario *c, int s, int64_t t, int j) {
  int e = c->idx[s][t * c->k + j], r = e / (c->E / c->n);
  int64_t key = ((int64_t)s * MAXT + t) * c->k + j;
  for (int64_t i = 0; i < c->Rr; i++)
    if (c->slot_src[r][i] == key) return 1;
  return 0;
}

static tw_status step_fwd(tw_ctx *ctx, const scenario *c, int me, layer_bufs *b) {
  int64_t T = c->T[me], H = c->H, R = c->Rr;
  tw_tensor tok = tw_tensor_2d(c->tok[me], c->dt, T, H, TW_MEM_HOST);
  tw_tensor scl = c->scale_block ? tw_tensor_2d(c->scl[me], scale_dtype(c), T, scale_cols(c), TW_MEM_HOST) : tw_tensor_none();
  tw_tensor idx = tw_tensor_2d(c->idx[me], TW_I32, T, c->k, TW_MEM_HOST);
  tw_tensor w = tw_tensor_2d(c->w[me], TW_F32, T, c->k, TW_MEM_HOST);
  tw_tensor recv = tw_tensor_2d(b->recv, c->dt, R, H, TW_MEM_HOST);
  tw_tensor rscl = c->scale_block ? tw_tensor_2d(b->rscl, scale_dtype(c), R, scale_cols(c), TW_MEM_HOST) : tw_tensor_none();
  tw_tensor rw = tw_tensor_1d(b->rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor gs = tw_tensor_1d(b->gs, TW_I32, c->E / c->n, TW_MEM_HOST);
  tw_tensor dr = tw_tensor_1d(b->dropped, TW_I32, c->E / c->n, TW_MEM_HOST);
  memset(b->recv, 0xA5, (size_t)R * tok_bytes(c)); /* poison: every row must be written */
  memset(b->rw, 0xA5, (size_t)R * 4);
  return tw_ep_dispatch(ctx, b->layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &dr);
}

/* y, d_recv and d_recv_weights from the received rows; padding rows NaN (must not leak). */
static void expert_rows(const scenario *c, int me, layer_bufs *b) {
  int nle = c->E / c->n;
  int64_t H = c->H, o = 0;
  for (int l = 0; l < nle; l++) {
    for (int64_t i = o; i < o + b->gs[l]; i++)
      for (int64_t h = 0; h < H; h++) {
        float x = tok_f32(c, b->recv, i * H + h);
        int pad = c->slot_src[me][i] < 0;
        b->y[i * H + h] = pad ? NAN : expert_fn(x, me * nle + l, h);
        b->dy[i * H + h] = pad ? NAN : grad_fn(x, me * nle + l, h);
        b->drw[i] = pad ? NAN : b->rw[i] * 3.0f;
      }
    o += b->gs[l];
  }
  for (int64_t i = o; i < c->Rr; i++) {
    for (int64_t h = 0; h < H; h++) b->y[i * H + h] = b->dy[i * H + h] = NAN;
    b->drw[i] = NAN;
  }
}

static tw_status check_rest(tw_ctx *ctx, const scenario *c, int me, layer_bufs *b, int phase) {
  int64_t T = c->T[me], H = c->H, R = c->Rr, k = c->k;
  tw_tensor y = tw_tensor_2d(b->y, TW_F32, R, H, TW_MEM_HOST), w = tw_tensor_2d(c->w[me], TW_F32, T, k, TW_MEM_HOST);
  tw_tensor out = tw_tensor_2d(b->out, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor dy = tw_tensor_2d(b->dy, TW_F32, R, H, TW_MEM_HOST), drw = tw_tensor_1d(b->drw, TW_F32, R, TW_MEM_HOST);
  tw_tensor dtok = tw_tensor_2d(b->dtok, TW_F32, T, H, TW_MEM_HOST), dtw = tw_tensor_2d(b->dtw, TW_F32, T, k, TW_MEM_HOST);
  tw_tensor dout = tw_tensor_2d(c->dout[me], TW_F32, T, H, TW_MEM_HOST);
  tw_tensor dexp = tw_tensor_2d(b->dexp, TW_F32, R, H, TW_MEM_HOST), dtw2 = tw_tensor_2d(b->dtw2, TW_F32, T, k, TW_MEM_HOST);
  if (phase == 0) { /* combine, weighted then unweighted */
    for (int weighted = 1; weighted >= 0; weighted--) {
      tw_tensor none = tw_tensor_none();
      TW_TRY(tw_ep_combine(ctx, b->layer, &y, weighted ? &w : &none, &out));
      for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
          float acc = 0.0f;
          for (int j = 0; j < k; j++)
            if (kept(c, me, t, j))
              acc += (weighted ? c->w[me][t * k + j] : 1.0f) *
                     expert_fn(tok_f32(c, c->tok[me], t * H + h), c->idx[me][t * k + j], h);
          if (memcmp(&acc, &b->out[t * H + h], 4) != 0)
            FAIL("rank %d: combine (weighted %d) out[%lld, %lld] = %.9g, formula %.9g", me, weighted, (long long)t,
                 (long long)h, b->out[t * H + h], acc);
        }
    }
    return TW_OK;
  }
  if (phase == 1) { /* combine_bwd */
    TW_TRY(tw_ep_combine_bwd(ctx, b->layer, &dout, &w, &y, &dexp, &dtw2));
    for (int64_t i = 0; i < R; i++) {
      int64_t src = c->slot_src[me][i];
      for (int64_t h = 0; h < H; h++) {
        float want = 0.0f;
        if (src >= 0) {
          int s = (int)(src / k / MAXT);
          int64_t t = src / k % MAXT;
          want = c->w[s][src % (MAXT * k)] * c->dout[s][t * H + h];
        }
        if (memcmp(&want, &b->dexp[i * H + h], 4) != 0)
          FAIL("rank %d: d_expert_out[%lld, %lld] = %g, formula %g", me, (long long)i, (long long)h, b->dexp[i * H + h], want);
      }
    }
    for (int64_t t = 0; t < T; t++)
      for (int j = 0; j < k; j++) {
        float acc = 0.0f;
        if (kept(c, me, t, j)) {
          for (int64_t h = 0; h < H; h++)
            b->prod[h] = c->dout[me][t * H + h] * expert_fn(tok_f32(c, c->tok[me], t * H + h), c->idx[me][t * k + j], h);
          acc = tt_warp_order_sum(b->prod, H);
        }
        if (memcmp(&acc, &b->dtw2[t * k + j], 4) != 0)
          FAIL("rank %d: combine_bwd d_topk_weights[%lld, %d] = %.9g, formula %.9g", me, (long long)t, j, b->dtw2[t * k + j], acc);
      }
    return TW_OK;
  }
  /* dispatch_bwd */
  TW_TRY(tw_ep_dispatch_bwd(ctx, b->layer, &dy, &drw, &dtok, &dtw));
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++)
        if (kept(c, me, t, j)) acc += grad_fn(tok_f32(c, c->tok[me], t * H + h), c->idx[me][t * k + j], h);
      if (memcmp(&acc, &b->dtok[t * H + h], 4) != 0)
        FAIL("rank %d: d_tokens[%lld, %lld] = %.9g, formula %.9g", me, (long long)t, (long long)h, b->dtok[t * H + h], acc);
    }
    for (int j = 0; j < k; j++) {
      float want = kept(c, me, t, j) ? c->w[me][t * k + j] * 3.0f : 0.0f;
      if (memcmp(&want, &b->dtw[t * k + j], 4) != 0)
        FAIL("rank %d: d_topk_weights[%lld, %d] = %g, formula %g", me, (long long)t, j, b->dtw[t * k + j], want);
    }
  }
  return TW_OK;
}

static void bufs_alloc(const scenario *c, layer_bufs *b) {
  int64_t R = c->Rr, H = c->H, T = MAXT, k = c->k;
  b->recv = calloc((size_t)R * tok_bytes(c) + 1, 1);
  b->rscl = calloc((size_t)R * scl_bytes(c) + 1, 1);
  b->rw = calloc((size_t)R + 1, 4);
  b->y = calloc((size_t)(R * H) + 1, 4);
  b->dy = calloc((size_t)(R * H) + 1, 4);
  b->drw = calloc((size_t)R + 1, 4);
  b->dexp = calloc((size_t)(R * H) + 1, 4);
  b->out = calloc((size_t)(T * H) + 1, 4);
  b->dtok = calloc((size_t)(T * H) + 1, 4);
  b->dtw = calloc((size_t)(T * k) + 1, 4);
  b->dtw2 = calloc((size_t)(T * k) + 1, 4);
  b->prod = calloc((size_t)H + 1, 4);
}

static void bufs_free(layer_bufs *b) {
  free(b->recv); free(b->rscl); free(b->rw); free(b->y); free(b->dy); free(b->drw); free(b->dexp);
  free(b->out); free(b->dtok); free(b->dtw); free(b->dtw2); free(b->prod);
}

static tw_status rank_body(int me, tw_comm *comm, void *arg) {
  job *jb = arg;
  scenario *c = jb->c[0];
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = MAXT; cfg.hidden = c->H; cfg.token_dtype = c->dt;
  cfg.scale_block = c->scale_block; cfg.recv_capacity = c->R; cfg.alignment = c->A; cfg.overflow = c->policy;
  tw_ep *ep = NULL;
  layer_bufs b[2];
  memset(b, 0, sizeof b);
  tw_status s = tw_ep_create(ctx, comm, &cfg, &ep);
  if (s == TW_OK && tw_ep_recv_capacity(ep) != c->Rr)
    s = tw_error(TW_ERR_INTERNAL, "R = %lld, expected %lld", (long long)tw_ep_recv_capacity(ep), (long long)c->Rr);
  for (int L = 0; L < jb->layers && s == TW_OK; L++) {
    bufs_alloc(jb->c[L], &b[L]);
    s = tw_ep_layer_create(ep, &b[L].layer);
  }
  /* two layers with different routings interleave as a model's step does:
   * dispatch 0, dispatch 1 | combine 1, combine 0 | combine_bwd 0, 1 | dispatch_bwd 1, 0 */
  for (int L = 0; L < jb->layers && s == TW_OK; L++) {
    s = step_fwd(ctx, jb->c[L], me, &b[L]);
    if (s == TW_OK) s = check_dispatch(jb->c[L], me, &b[L], c->Rr);
    if (s == TW_OK) expert_rows(jb->c[L], me, &b[L]);
  }
  for (int L = jb->layers - 1; L >= 0 && s == TW_OK; L--) s = check_rest(ctx, jb->c[L], me, &b[L], 0);
  for (int L = 0; L < jb->layers && s == TW_OK; L++) s = check_rest(ctx, jb->c[L], me, &b[L], 1);
  for (int L = jb->layers - 1; L >= 0 && s == TW_OK; L--) s = check_rest(ctx, jb->c[L], me, &b[L], 2);
  for (int L = 0; L < jb->layers; L++) {
    tw_ep_layer_destroy(b[L].layer);
    bufs_free(&b[L]);
  }
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

static void scenario_free(scenario *c) {
  for (int r = 0; r < c->n; r++) {
    free(c->tok[r]); free(c->scl[r]); free(c->idx[r]); free(c->w[r]); free(c->dout[r]); free(c->slot_src[r]);
  }
}

/* Token conservation from the outputs' formula: kept + dropped = routes, and every kept
 * (rank, token, j) sits exactly once in the slab of its expert. */
static void check_conservation(const scenario *c) {
  int nle = c->E / c->n;
  int64_t routes = 0, kept_rows = 0, dropped = 0;
  uint64_t sum_routes = 0, sum_kept = 0;
  for (int s = 0; s < c->n; s++) routes += c->T[s] * c->k;
  for (int r = 0; r < c->n; r++) {
    for (int l = 0; l < nle; l++) dropped += c->dropped[r][l];
    int64_t o = 0;
    for (int l = 0; l < nle; l++) {
      for (int64_t i = o; i < o + c->gs[r][l]; i++) {
        int64_t src = c->slot_src[r][i];
        if (src < 0) continue;
        int s = (int)(src / c->k / MAXT);
        cr_assert_eq(c->idx[s][src % (MAXT * c->k)], r * nle + l, "row %lld of rank %d is in the wrong slab", (long long)i, r);
        kept_rows++;
        sum_kept += (uint64_t)(src + 1) * 0x9E3779B97F4A7C15ull;
      }
      o += c->gs[r][l];
    }
  }
  for (int s = 0; s < c->n; s++)
    for (int64_t q = 0; q < c->T[s] * c->k; q++)
      if (kept(c, s, q / c->k, (int)(q % c->k)))
        sum_routes += (uint64_t)(((int64_t)s * MAXT + q / c->k) * c->k + q % c->k + 1) * 0x9E3779B97F4A7C15ull;
  cr_assert_eq(kept_rows + dropped, routes, "kept %lld + dropped %lld != routes %lld", (long long)kept_rows,
               (long long)dropped, (long long)routes);
  cr_assert_eq(sum_kept, sum_routes, "checksum of kept routes differs");
  if (c->policy == TW_EP_OVERFLOW_ERROR) cr_assert_eq(dropped, 0);
}

static void setup_scenario(scenario *c) {
  make_inputs(c);
  expected_layout(c);
}

/* Runs the scenario (and a second routing for a second layer when layers == 2). */
static void run_scenario(scenario *c, int layers) {
  scenario c2 = *c;
  setup_scenario(c);
  if (!c->expect_error) check_conservation(c);
  job jb = {{c, &c2}, layers};
  if (layers == 2) {
    c2.seed = c->seed * 7 + 1;
    c2.dist = (c->dist + 1) % 4;
    setup_scenario(&c2);
    cr_assert_eq(c2.Rr, c->Rr);
    c->expect_error |= c2.expect_error;
  }
  tw_comm *comms[MAXR];
  cr_assert_eq(tw_comm_init_threads(c->n, comms), TW_OK);
  tw_status s = tw_run_ranks(c->n, comms, rank_body, &jb);
  if (c->expect_error)
    tt_expect_status(s, TW_ERR_INVALID_ARG, "receive rows");
  else
    cr_expect_eq(s, TW_OK, "n %d E %d k %d H %lld A %lld R %lld dtype %s dist %d: %s", c->n, c->E, c->k,
                 (long long)c->H, (long long)c->A, (long long)c->Rr, tw_dtype_name(c->dt), c->dist, tw_last_error());
  for (int r = 0; r < c->n; r++) tw_comm_destroy(comms[r]);
  scenario_free(c);
  if (layers == 2) scenario_free(&c2);
}

static scenario base(int n, int E, int k, int64_t H, tw_dtype dt, int dist, uint64_t seed) {
  scenario c;
  memset(&c, 0, sizeof c);
  c.n = n; c.E = E; c.k = k; c.H = H; c.dt = dt; c.dist = dist; c.seed = seed; c.A = 1;
  for (int r = 0; r < n; r++) c.T[r] = 1 + (int64_t)((seed * 31 + (uint64_t)r * 17) % 13);
  return c;
}

Test(ep, every_rank_count_distribution_and_alignment) {
  int ns[] = {1, 2, 4, 8};
  int64_t As[] = {1, 4, 16};
  int cases = 0;
  for (int a = 0; a < 4; a++)
    for (int dist = 0; dist < 4; dist++)
      for (int ai = 0; ai < 3; ai++) {
        int n = ns[a];
        scenario c = base(n, 2 * n * (1 + dist % 2), 1 + (dist + ai) % 3, 5 + ai, dist % 2 ? TW_BF16 : TW_F32, dist,
                          (uint64_t)(100 * a + 10 * dist + ai));
        if (c.k > c.E) c.k = c.E;
        if (c.dist == DIST_EVEN_ONLY && c.k > c.E / 2) c.k = c.E / 2;
        c.A = As[ai];
        run_scenario(&c, 1);
        cases++;
      }
  cr_log_info("ep: %d scenarios", cases);
}

Test(ep, ranks_that_send_nothing_and_experts_that_receive_nothing) {
  for (int n = 2; n <= 8; n *= 2) {
    scenario c = base(n, 2 * n, 2, 7, TW_F32, DIST_EVEN_ONLY, 7 + n);
    for (int r = 1; r < n; r += 2) c.T[r] = 0; /* odd ranks send nothing */
    c.A = 8;
    run_scenario(&c, 1);
  }
  scenario c = base(4, 8, 3, 3, TW_BF16, DIST_UNIFORM, 5);
  for (int r = 0; r < 4; r++) c.T[r] = 0; /* nobody sends: all outputs are zero padding */
  run_scenario(&c, 1);
}

Test(ep, all_tokens_to_one_expert_and_hot_expert) {
  for (int n = 1; n <= 8; n *= 2) {
    scenario c = base(n, 4 * n, 1, 6, TW_F32, DIST_ONE, 40 + n);
    for (int r = 0; r < n; r++) c.T[r] = MAXT; /* full ranks */
    run_scenario(&c, 1);
    scenario h = base(n, 2 * n, 2, 6, TW_BF16, DIST_HOT, 50 + n);
    h.A = 32;
    run_scenario(&h, 1);
  }
}

Test(ep, fp8_rows_carry_their_scales) {
  scenario c = base(4, 8, 2, 256, TW_E4M3, DIST_UNIFORM, 61);
  c.scale_block = 128; /* 1x128: f32 scales */
  run_scenario(&c, 1);
  scenario m = base(2, 4, 2, 64, TW_E5M2, DIST_HOT, 62);
  m.scale_block = 32; /* MXFP8: e8m0 scales */
  m.A = 4;
  run_scenario(&m, 1);
}

Test(ep, combine_bwd_dot_in_the_warp_order) {
  /* H past 256 and not a multiple of 8: lane (h / 8) % 32 wraps and the last chunk is short */
  scenario c = base(2, 4, 2, 8 * 32 * 2 + 13, TW_F32, DIST_UNIFORM, 120);
  run_scenario(&c, 1);
  scenario b = base(4, 8, 3, 300, TW_BF16, DIST_HOT, 121);
  b.A = 4;
  run_scenario(&b, 1);
}

Test(ep, drop_policy_reports_every_drop) {
  for (int n = 1; n <= 8; n *= 2) {
    scenario c = base(n, 2 * n, 2, 4, TW_F32, DIST_HOT, 70 + n);
    for (int r = 0; r < n; r++) c.T[r] = 20;
    c.A = 4;
    c.R = 16; /* far below the demand of the hot expert */
    c.policy = TW_EP_OVERFLOW_DROP;
    run_scenario(&c, 1);
    int64_t dropped = 0;
    for (int r = 0; r < n; r++)
      for (int l = 0; l < 2; l++) dropped += c.dropped[r][l];
    cr_expect_gt(dropped, 0, "n = %d: the scenario must actually drop", n);
  }
}

Test(ep, error_policy_fails_every_rank_with_the_demand) {
  scenario c = base(4, 8, 2, 4, TW_F32, DIST_HOT, 80);
  for (int r = 0; r < 4; r++) c.T[r] = 20;
  c.R = 16;
  c.policy = TW_EP_OVERFLOW_ERROR;
  run_scenario(&c, 1);
  cr_expect(strstr(tw_last_error(), "recv_capacity is 16") != NULL, "%s", tw_last_error());
}

Test(ep, two_layers_interleaved_do_not_disturb_each_other) {
  for (int n = 1; n <= 8; n *= 2) {
    scenario c = base(n, 2 * n, 2, 5, TW_F32, DIST_UNIFORM, 90 + n);
    c.A = 2;
    run_scenario(&c, 2);
    scenario d = base(n, 4 * n, 3, 3, TW_BF16, DIST_HOT, 95 + n);
    d.R = 8;
    d.policy = TW_EP_OVERFLOW_DROP;
    run_scenario(&d, 2);
  }
}
