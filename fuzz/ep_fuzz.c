/* EP and router fuzzing (ep_fuzz.h). The EP oracle is the formula of tw_ep.h computed
 * here without communication; the system under test is tw_ep_* on the ref backend or on a
 * planted variant of its EP table. */
#include "fuzz/ep_fuzz.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/backend_moe.h"
#include "ref/ref_moe.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"
#include "twin/tw_router.h"
#include "twin/tw_shard.h"

#define MAXT 12

static uint64_t next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static int below(uint64_t *s, int n) { return (int)(next(s) % (uint64_t)n); }
static double unit(uint64_t *s) { return (double)(next(s) >> 11) / 9007199254740992.0; }

const char *tw_ep_plant_name(tw_ep_plant p) {
  static const char *const names[TW_EP_PLANT_COUNT] = {"none", "ep_wrong_rank", "ep_drop_last_of_full_slab"};
  return (int)p >= 0 && p < TW_EP_PLANT_COUNT ? names[p] : "?";
}

/* ---- cases ------------------------------------------------------------------------------- */

void tw_ep_fuzz_draw(uint64_t *rng, tw_ep_fuzz_case *c) {
  memset(c, 0, sizeof *c);
  c->n = 1 << below(rng, 4);
  c->E = c->n * (1 + below(rng, 4));
  c->k = 1 + below(rng, c->E < 4 ? c->E : 4);
  c->dtype = below(rng, 8) == 0 ? 2 : below(rng, 2);
  c->H = c->dtype == 2 ? 32 * (1 + below(rng, 2)) : 1 + below(rng, 8);
  for (int r = 0; r < c->n; r++) c->T[r] = below(rng, 4) == 0 ? 0 : below(rng, MAXT + 1);
  c->A = 1 << below(rng, 5);
  c->dist = below(rng, TW_EP_DIST_COUNT);
  int cap = below(rng, 4);
  c->drop = cap == 0;
  c->R = cap <= 1 ? c->A * (1 + below(rng, 6)) : 0; /* small capacities: drops, or the error */
  c->seed = next(rng);
  c->dp = c->fsdp = c->tp = 1;
  if (below(rng, 3) == 0) /* a mesh around the EP groups, up to 8 ranks in all */
    for (int a = 0; a < 3; a++) {
      int *ax = a == 0 ? &c->dp : a == 1 ? &c->fsdp : &c->tp;
      if (c->n * c->dp * c->fsdp * c->tp * 2 <= TW_EP_FUZZ_MAXR && below(rng, 2)) *ax = 2;
    }
}

static int axis(int v) { return v < 1 ? 1 : v; }

const char *tw_ep_fuzz_case_str(const tw_ep_fuzz_case *c, char *buf, size_t n) {
  size_t u = (size_t)snprintf(buf, n, "n=%d E=%d k=%d H=%d A=%d R=%d dist=%d drop=%d dtype=%d seed=%llu T=", c->n, c->E,
                              c->k, c->H, c->A, c->R, c->dist, c->drop, c->dtype, (unsigned long long)c->seed);
  for (int r = 0; r < c->n && u < n; r++) u += (size_t)snprintf(buf + u, n - u, "%s%d", r ? "," : "", c->T[r]);
  if (u < n) snprintf(buf + u, n - u, " mesh=%d,%d,%d", axis(c->dp), axis(c->fsdp), axis(c->tp));
  return buf;
}

tw_status tw_ep_fuzz_case_parse(const char *text, tw_ep_fuzz_case *c) {
  memset(c, 0, sizeof *c);
  unsigned long long seed;
  int used = 0;
  if (sscanf(text, "n=%d E=%d k=%d H=%d A=%d R=%d dist=%d drop=%d dtype=%d seed=%llu T=%n", &c->n, &c->E, &c->k, &c->H,
             &c->A, &c->R, &c->dist, &c->drop, &c->dtype, &seed, &used) != 10 || used == 0)
    return tw_error(TW_ERR_INVALID_ARG, "ep fuzz: cannot parse case \"%s\"", text);
  c->seed = seed;
  const char *p = text + used;
  for (int r = 0; r < c->n; r++) {
    char *end;
    c->T[r] = (int)strtol(p, &end, 10);
    if (end == p) return tw_error(TW_ERR_INVALID_ARG, "ep fuzz: case \"%s\" lists fewer than n = %d token counts", text, c->n);
    p = *end == ',' ? end + 1 : end;
  }
  c->dp = c->fsdp = c->tp = 1;
  const char *m = strstr(p, "mesh=");
  if (m && sscanf(m, "mesh=%d,%d,%d", &c->dp, &c->fsdp, &c->tp) != 3)
    return tw_error(TW_ERR_INVALID_ARG, "ep fuzz: case \"%s\" has a malformed mesh", text);
  if (c->n < 1 || c->n > TW_EP_FUZZ_MAXR || c->E < c->n || c->E % c->n || c->k < 1 || c->k > c->E)
    return tw_error(TW_ERR_INVALID_ARG, "ep fuzz: case \"%s\" is out of range", text);
  return TW_OK;
}

int tw_ep_fuzz_case_size(const tw_ep_fuzz_case *c) {
  int s = c->n + c->E + c->k + c->H + c->A + axis(c->dp) + axis(c->fsdp) + axis(c->tp) - 3;
  for (int r = 0; r < c->n; r++) s += c->T[r];
  return s;
}

/* ---- data and the formula ---------------------------------------------------------------- */

typedef struct {
  const tw_ep_fuzz_case *c;
  tw_dtype dt;
  size_t tb, sb;     /* token and scale bytes per row */
  int64_t R, sc;     /* capacity, scale columns */
  int expect_error;
  unsigned char *tok[TW_EP_FUZZ_MAXR], *scl[TW_EP_FUZZ_MAXR];
  int32_t *idx[TW_EP_FUZZ_MAXR];
  float *w[TW_EP_FUZZ_MAXR], *dout[TW_EP_FUZZ_MAXR];
  int64_t *slot_src[TW_EP_FUZZ_MAXR]; /* (s*MAXT + t)*k + j, or -1 */
  int32_t gs[TW_EP_FUZZ_MAXR][32], dropped[TW_EP_FUZZ_MAXR][32];
  const tw_backend_ops *ops;
  tw_ep_plant plant;
} world;

static float tok_f32(const world *W, const unsigned char *rows, int64_t i) {
  if (W->dt == TW_F32) return ((const float *)rows)[i];
  if (W->dt == TW_BF16) return tw_bf16_to_f32(((const uint16_t *)rows)[i]);
  return (float)rows[i] / 16.0f;
}
static float expert_fn(float x, int e, int64_t h) { return x * (float)(e + 1) + 0.125f * (float)h; }
static float grad_fn(float x, int e, int64_t h) { return x * 0.5f - (float)e + 0.25f * (float)h; }

static void make_world(world *W, const tw_ep_fuzz_case *c) {
  memset(W, 0, sizeof *W);
  W->c = c;
  W->dt = c->dtype == 0 ? TW_F32 : c->dtype == 1 ? TW_BF16 : TW_E4M3;
  W->tb = tw_dtype_storage_bytes(W->dt, c->H);
  W->sc = c->dtype == 2 ? c->H / 32 : 0;
  W->sb = (size_t)W->sc;
  uint64_t st = c->seed;
  int k = c->k, E = c->E, nle = E / c->n;
  for (int r = 0; r < c->n; r++) {
    int T = c->T[r];
    W->tok[r] = calloc((size_t)T * W->tb + 1, 1);
    W->scl[r] = calloc((size_t)T * W->sb + 1, 1);
    W->idx[r] = calloc((size_t)(T * k) + 1, 4);
    W->w[r] = calloc((size_t)(T * k) + 1, 4);
    W->dout[r] = calloc((size_t)(T * c->H) + 1, 4);
    for (int t = 0; t < T; t++) {
      for (int j = 0; j < k; j++) {
        int e, again;
        do {
          if (c->dist == TW_EP_DIST_HOT && j == 0 && unit(&st) < 0.8) e = 0;
          else if (c->dist == TW_EP_DIST_ONE && j == 0) e = E - 1;
          else if (c->dist == TW_EP_DIST_HALF && k <= E / 2) e = below(&st, E / 2);
          else e = below(&st, E);
          again = 0;
          for (int i = 0; i < j; i++) again |= W->idx[r][t * k + i] == e;
        } while (again);
        W->idx[r][t * k + j] = e;
        W->w[r][t * k + j] = (float)(0.05 + 0.95 * unit(&st));
      }
      for (int h = 0; h < c->H; h++) {
        float v = (float)(4.0 * unit(&st) - 2.0);
        if (W->dt == TW_F32) ((float *)W->tok[r])[t * c->H + h] = v;
        else if (W->dt == TW_BF16) ((uint16_t *)W->tok[r])[t * c->H + h] = tw_f32_to_bf16(v);
        else W->tok[r][t * c->H + h] = (unsigned char)next(&st);
        W->dout[r][t * c->H + h] = (float)(2.0 * unit(&st) - 1.0);
      }
      for (size_t b = 0; b < W->sb; b++) W->scl[r][t * W->sb + b] = (unsigned char)(100 + below(&st, 50));
    }
  }
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = E; cfg.topk = k; cfg.max_tokens = MAXT; cfg.alignment = c->A;
  W->R = c->R ? c->R : tw_ep_capacity_no_drop(&cfg, c->n);
  for (int r = 0; r < c->n; r++) {
    W->slot_src[r] = malloc((size_t)W->R * 8 + 8);
    for (int64_t i = 0; i < W->R; i++) W->slot_src[r][i] = -1;
    int64_t O = 0, demand = 0;
    for (int l = 0; l < nle; l++) {
      int e = r * nle + l;
      int64_t cnt = 0, i = 0;
      for (int s = 0; s < c->n; s++)
        for (int q = 0; q < c->T[s] * k; q++) cnt += W->idx[s][q] == e;
      demand += (cnt + c->A - 1) / c->A * c->A;
      int64_t kept = cnt < W->R - O ? cnt : W->R - O;
      for (int s = 0; s < c->n; s++)
        for (int q = 0; q < c->T[s] * k; q++)
          if (W->idx[s][q] == e) {
            if (i < kept) W->slot_src[r][O + i] = ((int64_t)s * MAXT + q / k) * k + q % k;
            i++;
          }
      W->gs[r][l] = (int32_t)((kept + c->A - 1) / c->A * c->A);
      W->dropped[r][l] = (int32_t)(cnt - kept);
      O += W->gs[r][l];
    }
    if (demand > W->R && !c->drop) W->expect_error = 1;
  }
}

static void free_world(world *W) {
  for (int r = 0; r < W->c->n; r++) {
    free(W->tok[r]); free(W->scl[r]); free(W->idx[r]); free(W->w[r]); free(W->dout[r]); free(W->slot_src[r]);
  }
}

static int kept_route(const world *W, int s, int t, int j) {
  const tw_ep_fuzz_case *c = W->c;
  int r = W->idx[s][t * c->k + j] / (c->E / c->n);
  int64_t key = ((int64_t)s * MAXT + t) * c->k + j;
  for (int64_t i = 0; i < W->R; i++)
    if (W->slot_src[r][i] == key) return 1;
  return 0;
}

/* ---- planted EP tables ------------------------------------------------------------------- */

static tw_status plant_wrong_rank(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens, const tw_tensor *scales,
                                  const tw_tensor *topk_idx, const tw_tensor *w, tw_tensor *recv, tw_tensor *rscl,
                                  tw_tensor *rw, tw_tensor *gs, tw_tensor *dropped) {
  const tw_ep *ep = layer->ep;
  int64_t n = tw_tensor_numel(topk_idx);
  int32_t *copy = malloc((size_t)n * 4 + 4);
  if (!copy) return tw_error(TW_ERR_MEMORY, "planted: out of memory");
  memcpy(copy, topk_idx->data, (size_t)n * 4);
  if (n > 0 && ep->ep_size > 1) copy[n - 1] = (copy[n - 1] + ep->nle) % ep->cfg.num_experts; /* next rank's expert */
  tw_tensor t = *topk_idx;
  t.data = copy;
  tw_status s = tw_ref_ep.dispatch(ctx, layer, tokens, scales, &t, w, recv, rscl, rw, gs, dropped);
  free(copy);
  return s;
}

static tw_status plant_drop_last_full(tw_ctx *ctx, tw_ep_layer *layer, const tw_tensor *tokens, const tw_tensor *scales,
                                      const tw_tensor *topk_idx, const tw_tensor *w, tw_tensor *recv, tw_tensor *rscl,
                                      tw_tensor *rw, tw_tensor *gs, tw_tensor *dropped) {
  TW_TRY(tw_ref_ep.dispatch(ctx, layer, tokens, scales, topk_idx, w, recv, rscl, rw, gs, dropped));
  const tw_ep *ep = layer->ep;
  size_t tb = tw_dtype_storage_bytes(recv->dtype, ep->cfg.hidden);
  size_t sb = tw_tensor_is_none(rscl) ? 0 : tw_dtype_storage_bytes(rscl->dtype, ep->scale_cols);
  int64_t o = 0;
  for (int l = 0; l < ep->nle; l++) {
    int32_t g = ((const int32_t *)gs->data)[l];
    if (g > 0 && ((const float *)rw->data)[o + g - 1] != 0.0f) { /* full: no padding at the end */
      int64_t last = o + g - 1;
      memset((char *)recv->data + (size_t)last * tb, 0, tb);
      if (sb) memset((char *)rscl->data + (size_t)last * sb, 0, sb);
      ((float *)rw->data)[last] = 0.0f;
    }
    o += g;
  }
  return TW_OK;
}

static tw_ep_backend plant_tables[TW_EP_PLANT_COUNT];
static tw_backend_ops plant_ops[TW_EP_PLANT_COUNT];

static const tw_backend_ops *ops_for(tw_ep_plant p) {
  if (p == TW_EP_PLANT_NONE) return &tw_ref_ops;
  plant_tables[p] = tw_ref_ep;
  plant_tables[p].dispatch = p == TW_EP_PLANT_WRONG_RANK ? plant_wrong_rank : plant_drop_last_full;
  plant_ops[p] = tw_ref_ops;
  plant_ops[p].name = tw_ep_plant_name(p);
  plant_ops[p].ep = &plant_tables[p];
  return &plant_ops[p];
}

/* ---- one case on thread ranks ------------------------------------------------------------ */

#define FAIL(...) do { s = tw_error(TW_ERR_INTERNAL, __VA_ARGS__); goto out; } while (0)

static tw_status ep_rank(world *W, int me, tw_comm *comm) {
  const tw_ep_fuzz_case *c = W->c;
  int64_t T = c->T[me], H = c->H, R = W->R, k = c->k;
  int nle = c->E / c->n;
  tw_ctx *real = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&real, &cc));
  struct tw_ctx ctx = *real;
  ctx.ops = W->ops;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = MAXT; cfg.hidden = H; cfg.token_dtype = W->dt;
  cfg.scale_block = W->sc ? 32 : 0; cfg.recv_capacity = c->R; cfg.alignment = c->A;
  cfg.overflow = c->drop ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  unsigned char *recv = calloc((size_t)R * W->tb + 1, 1), *rscl = calloc((size_t)R * W->sb + 1, 1);
  float *rw = calloc((size_t)R + 1, 4), *y = calloc((size_t)(R * H) + 1, 4), *dy = calloc((size_t)(R * H) + 1, 4);
  float *out = calloc((size_t)(T * H) + 1, 4), *dtok = calloc((size_t)(T * H) + 1, 4);
  float *dexp = calloc((size_t)(R * H) + 1, 4), *dsrc = NULL;
  char *used = NULL;
  int32_t gs[32], dropped[32];
  tw_status s = tw_ep_create(&ctx, comm, &cfg, &ep);
  if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
  if (s != TW_OK) goto out;
  tw_tensor none = tw_tensor_none();
  tw_tensor tok = tw_tensor_2d(W->tok[me], W->dt, T, H, TW_MEM_HOST);
  tw_tensor scl = W->sc ? tw_tensor_2d(W->scl[me], TW_E8M0, T, W->sc, TW_MEM_HOST) : none;
  tw_tensor idx = tw_tensor_2d(W->idx[me], TW_I32, T, k, TW_MEM_HOST), w = tw_tensor_2d(W->w[me], TW_F32, T, k, TW_MEM_HOST);
  tw_tensor trecv = tw_tensor_2d(recv, W->dt, R, H, TW_MEM_HOST);
  tw_tensor trscl = W->sc ? tw_tensor_2d(rscl, TW_E8M0, R, W->sc, TW_MEM_HOST) : none;
  tw_tensor trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST), tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST);
  tw_tensor tdr = tw_tensor_1d(dropped, TW_I32, nle, TW_MEM_HOST);
  s = tw_ep_dispatch(&ctx, layer, &tok, &scl, &idx, &w, &trecv, &trscl, &trw, &tgs, &tdr);
  if (W->expect_error) {
    if (s == TW_ERR_INVALID_ARG) s = TW_OK; /* the error policy refused, as it must */
    else if (s == TW_OK) FAIL("rank %d: dispatch accepted a demand above R = %lld under the error policy", me, (long long)R);
    goto out;
  }
  if (s != TW_OK) goto out;
  for (int l = 0; l < nle; l++)
    if (gs[l] != W->gs[me][l] || dropped[l] != W->dropped[me][l])
      FAIL("rank %d expert %d: group size %d dropped %d, formula %d and %d", me, me * nle + l, gs[l], dropped[l],
           W->gs[me][l], W->dropped[me][l]);
  for (int64_t i = 0; i < R; i++) {
    int64_t src = W->slot_src[me][i];
    if (src < 0) {
      for (size_t b = 0; b < W->tb; b++)
        if (recv[i * W->tb + b]) FAIL("rank %d: padding row %lld is not zero", me, (long long)i);
      if (rw[i] != 0.0f) FAIL("rank %d: padding weight %lld is %g", me, (long long)i, rw[i]);
      continue;
    }
    int s_ = (int)(src / k / MAXT);
    int64_t t = src / k % MAXT;
    if (memcmp(recv + i * W->tb, W->tok[s_] + t * W->tb, W->tb) || rw[i] != W->w[s_][src % (MAXT * k)] ||
        (W->sb && memcmp(rscl + i * W->sb, W->scl[s_] + t * W->sb, W->sb)))
      FAIL("rank %d: recv row %lld is not (rank %d, token %lld, j %lld)", me, (long long)i, s_, (long long)t,
           (long long)(src % k));
  }
  /* expert fn on routed rows, NaN elsewhere */
  for (int64_t i = 0; i < R * H; i++) y[i] = dy[i] = NAN;
  for (int64_t i = 0; i < R; i++) {
    int64_t src = W->slot_src[me][i];
    if (src < 0) continue;
    int e = W->idx[src / k / MAXT][src % (MAXT * k)];
    for (int64_t h = 0; h < H; h++) {
      y[i * H + h] = expert_fn(tok_f32(W, recv + i * W->tb, h), e, h);
      dy[i * H + h] = grad_fn(tok_f32(W, recv + i * W->tb, h), e, h);
    }
  }
  tw_tensor ty = tw_tensor_2d(y, TW_F32, R, H, TW_MEM_HOST), tout = tw_tensor_2d(out, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor tdy = tw_tensor_2d(dy, TW_F32, R, H, TW_MEM_HOST), tdtok = tw_tensor_2d(dtok, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor tdout = tw_tensor_2d(W->dout[me], TW_F32, T, H, TW_MEM_HOST), tdexp = tw_tensor_2d(dexp, TW_F32, R, H, TW_MEM_HOST);
  if ((s = tw_ep_combine(&ctx, layer, &ty, &w, &tout)) != TW_OK) goto out;
  if ((s = tw_ep_dispatch_bwd(&ctx, layer, &tdy, &none, &tdtok, &none)) != TW_OK) goto out;
  if ((s = tw_ep_combine_bwd(&ctx, layer, &tdout, &w, &none, &tdexp, &none)) != TW_OK) goto out;
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      float acc = 0.0f, g = 0.0f, x = tok_f32(W, W->tok[me] + t * W->tb, h);
      for (int j = 0; j < k; j++)
        if (kept_route(W, me, (int)t, j)) {
          acc += W->w[me][t * k + j] * expert_fn(x, W->idx[me][t * k + j], h);
          g += grad_fn(x, W->idx[me][t * k + j], h);
        }
      if (memcmp(&acc, &out[t * H + h], 4)) FAIL("rank %d: combine out[%lld, %lld] = %.9g, formula %.9g", me, (long long)t, (long long)h, out[t * H + h], acc);
      if (memcmp(&g, &dtok[t * H + h], 4)) FAIL("rank %d: d_tokens[%lld, %lld] = %.9g, formula %.9g", me, (long long)t, (long long)h, dtok[t * H + h], g);
    }
  for (int64_t i = 0; i < R; i++) {
    int64_t src = W->slot_src[me][i];
    for (int64_t h = 0; h < H; h++) {
      float want = src < 0 ? 0.0f : W->w[src / k / MAXT][src % (MAXT * k)] * W->dout[src / k / MAXT][(src / k % MAXT) * H + h];
      if (memcmp(&want, &dexp[i * H + h], 4)) FAIL("rank %d: d_expert_out[%lld, %lld] = %g, formula %g", me, (long long)i, (long long)h, dexp[i * H + h], want);
    }
  }
  /* combine_bwd by source: d_src row s * MAXT + t = d_out_s[t] where a kept route of (s, t)
   * lands here, zeros elsewhere (the buffer starts poisoned) */
  {
    const int64_t U = (int64_t)c->n * MAXT;
    dsrc = malloc((size_t)(U * H) * 4 + 4);
    used = calloc((size_t)U + 1, 1);
    if (!dsrc || !used) { s = tw_error(TW_ERR_MEMORY, "ep fuzz: out of memory"); goto out; }
    memset(dsrc, 0xA5, (size_t)(U * H) * 4);
    for (int64_t i = 0; i < R; i++)
      if (W->slot_src[me][i] >= 0) used[W->slot_src[me][i] / k] = 1;
    tw_tensor tdsrc = tw_tensor_2d(dsrc, TW_F32, U, H, TW_MEM_HOST);
    if ((s = tw_ep_combine_bwd_by_source(&ctx, layer, &tdout, &none, &tdsrc, &none)) != TW_OK) goto out;
    for (int64_t u = 0; u < U; u++)
      for (int64_t h = 0; h < H; h++) {
        float want = used[u] ? W->dout[u / MAXT][(u % MAXT) * H + h] : 0.0f;
        if (memcmp(&want, &dsrc[u * H + h], 4)) FAIL("rank %d: d_src[%lld, %lld] = %g, formula %g", me, (long long)u, (long long)h, dsrc[u * H + h], want);
      }
  }
out:
  free(recv); free(rscl); free(rw); free(y); free(dy); free(out); free(dtok); free(dexp); free(dsrc); free(used);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(real);
  return s;
}

typedef struct {
  tw_mesh mesh;
  world *worlds; /* one per EP group of the outer axes (dp, fsdp) */
} mesh_job;

/* A world rank: its EP group is the ep communicator of the mesh (ranks that share every
 * non-ep coordinate); the group's tokens are those of its (dp, fsdp) index; tp ranks are
 * replicas that route the same tokens. */
static tw_status mesh_body(int rank, tw_comm *comm, void *arg) {
  mesh_job *J = arg;
  tw_ctx *ctx = NULL;
  tw_mesh_comms *mc = NULL;
  tw_comm *own = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_status s = tw_mesh_comms_create(ctx, &J->mesh, &mc);
  tw_comm *epc = s == TW_OK ? tw_mesh_comms_axis(mc, TW_AXIS_EP) : NULL;
  if (s == TW_OK && !epc && (s = tw_comm_init_threads(1, &own)) == TW_OK) epc = own;
  int outer = tw_mesh_coord(&J->mesh, rank, TW_AXIS_DP) * tw_mesh_axis_size(&J->mesh, TW_AXIS_FSDP) +
              tw_mesh_coord(&J->mesh, rank, TW_AXIS_FSDP);
  if (s == TW_OK) s = ep_rank(&J->worlds[outer], tw_mesh_coord(&J->mesh, rank, TW_AXIS_EP), epc);
  tw_comm_destroy(own);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return s;
}

tw_status tw_ep_fuzz_check(const tw_ep_fuzz_case *c, tw_ep_plant plant) {
  int dp = axis(c->dp), fsdp = axis(c->fsdp), tp = axis(c->tp), groups = dp * fsdp, n = groups * c->n * tp;
  if (n > TW_EP_FUZZ_MAXR) return tw_error(TW_ERR_INVALID_ARG, "ep fuzz: the mesh has %d ranks (at most %d)", n, TW_EP_FUZZ_MAXR);
  mesh_job J;
  tw_axis axes[4] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_EP, TW_AXIS_TP};
  int sizes[4] = {dp, fsdp, c->n, tp};
  TW_TRY(tw_mesh_init(&J.mesh, 4, axes, sizes));
  world W[TW_EP_FUZZ_MAXR];
  tw_ep_fuzz_case gc[TW_EP_FUZZ_MAXR];
  for (int g = 0; g < groups; g++) {
    gc[g] = *c;
    gc[g].seed = c->seed + (uint64_t)g; /* each group routes its own tokens */
    make_world(&W[g], &gc[g]);
    W[g].ops = ops_for(plant);
    W[g].plant = plant;
  }
  J.worlds = W;
  tw_comm *comms[TW_EP_FUZZ_MAXR];
  tw_status s = tw_comm_init_threads(n, comms);
  if (s == TW_OK) {
    s = tw_run_ranks(n, comms, mesh_body, &J);
    for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
  }
  for (int g = 0; g < groups; g++) free_world(&W[g]);
  return s;
}

/* ---- shrinking ---------------------------------------------------------------------------- */

static int fails(const tw_ep_fuzz_case *c, tw_ep_plant plant) { return tw_ep_fuzz_check(c, plant) != TW_OK; }

static int valid(const tw_ep_fuzz_case *c) {
  return c->n >= 1 && axis(c->dp) * axis(c->fsdp) * axis(c->tp) * c->n <= TW_EP_FUZZ_MAXR && c->E >= c->n && c->E % c->n == 0 && c->k >= 1 && c->k <= c->E && c->H >= 1 &&
         (c->dtype != 2 || c->H % 32 == 0) && c->A >= 1 && (c->R == 0 || c->R % c->A == 0);
}

int tw_ep_fuzz_shrink(tw_ep_fuzz_case *c, tw_ep_plant plant) {
  int steps = 0, progress = 1;
  while (progress) {
    progress = 0;
    for (int m = 0; m < 16 + 3 * TW_EP_FUZZ_MAXR; m++) {
      tw_ep_fuzz_case t = *c;
      switch (m) {
        case 0: t.n /= 2; if (t.n) t.E = t.E / 2 >= t.n ? t.E / 2 : t.n; break;
        case 1: t.E -= t.n; break;
        case 2: t.k--; break;
        case 3: if (t.dtype == 2) { t.dtype = 0; } else t.H = 1; break;
        case 4: if (t.dtype != 2) t.H /= 2; break;
        case 5: t.A /= 2; if (t.R) t.R = t.R / t.A * t.A; break;
        case 6: t.R = t.R > t.A ? t.R - t.A : t.R; break;
        case 7: t.dist = TW_EP_DIST_UNIFORM; break;
        case 8: t.drop = 0; t.R = 0; break;
        case 9: t.dtype = t.dtype == 1 ? 0 : t.dtype; break;
        case 10: t.seed = 1; break;
        case 11: t.E = t.n; break;
        case 12: t.dp = 1; break;
        case 13: t.fsdp = 1; break;
        case 14: t.tp = 1; break;
        default: {
          int r = (m - 16) / 3, how = (m - 16) % 3;
          if (m < 16 || r >= t.n || t.T[r] == 0) continue;
          t.T[r] = how == 0 ? 0 : how == 1 ? t.T[r] / 2 : t.T[r] - 1;
        }
      }
      if (memcmp(&t, c, sizeof t) == 0 || !valid(&t) || tw_ep_fuzz_case_size(&t) > tw_ep_fuzz_case_size(c)) continue;
      if (tw_ep_fuzz_case_size(&t) == tw_ep_fuzz_case_size(c) && m != 7 && m != 8 && m != 9 && m != 10 && m != 3) continue;
      if (fails(&t, plant)) {
        *c = t;
        steps++;
        progress = 1;
      }
    }
  }
  return steps;
}

tw_status tw_ep_fuzz_run(uint64_t seed, int max_cases, double seconds, tw_ep_plant plant, const char *repro_dir,
                         tw_ep_fuzz_report *rep) {
  memset(rep, 0, sizeof *rep);
  uint64_t rng = seed;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < max_cases; i++) {
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (seconds > 0 && (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) > seconds) break;
    tw_ep_fuzz_case c;
    tw_ep_fuzz_draw(&rng, &c);
    rep->cases++;
    if (tw_ep_fuzz_check(&c, plant) == TW_OK) continue;
    rep->found = 1;
    rep->first = c;
    rep->shrink_steps = tw_ep_fuzz_shrink(&c, plant);
    rep->shrunk = c;
    tw_ep_fuzz_check(&c, plant);
    snprintf(rep->message, sizeof rep->message, "%s", tw_last_error());
    if (repro_dir) {
      char line[512];
      snprintf(rep->repro, sizeof rep->repro, "%s/ep-%llu.txt", repro_dir, (unsigned long long)seed);
      FILE *f = fopen(rep->repro, "w");
      if (!f) return tw_error(TW_ERR_IO, "ep fuzz: cannot write %s", rep->repro);
      fprintf(f, "# twin ep fuzz repro (plant %s): %s\n%s\n", tw_ep_plant_name(plant), rep->message,
              tw_ep_fuzz_case_str(&c, line, sizeof line));
      fclose(f);
    }
    break;
  }
  return TW_OK;
}

/* ---- router ------------------------------------------------------------------------------- */

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

#define RFAIL(...) do { s = tw_error(TW_ERR_INTERNAL, __VA_ARGS__); goto rout; } while (0)

static tw_status router_case(uint64_t *rng, tw_ctx *ctx, char *desc, size_t dn) {
  int T = 1 + below(rng, 6), E = 1 + below(rng, 16), k = 1 + below(rng, E < 4 ? E : 4);
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  o.topk = k;
  o.score = below(rng, 2) ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
  o.pre_softmax = o.score == TW_ROUTER_SOFTMAX && below(rng, 2);
  o.scaling_factor = below(rng, 2) ? 1.0f : 2.5f;
  float bias[16], x[6 * 16], w[6 * 4], dw[6 * 4], dl[6 * 16], w2[6 * 4];
  int32_t idx[6 * 4], idx2[6 * 4], cnt[16];
  for (int e = 0; e < E; e++) bias[e] = (float)(unit(rng) - 0.5);
  if (o.score == TW_ROUTER_SIGMOID && below(rng, 2)) o.expert_bias = tw_tensor_1d(bias, TW_F32, E, TW_MEM_HOST);
  for (int i = 0; i < T * E; i++) x[i] = (float)(4.0 * unit(rng) - 2.0);
  if (below(rng, 3) == 0 && E > 1) x[below(rng, T) * E + 1] = x[0]; /* an exact tie now and then */
  for (int i = 0; i < T * k; i++) dw[i] = (float)(2.0 * unit(rng) - 1.0);
  snprintf(desc, dn, "T=%d E=%d k=%d score=%d pre=%d sf=%g bias=%d", T, E, k, (int)o.score, o.pre_softmax,
           (double)o.scaling_factor, !tw_tensor_is_none(&o.expert_bias));
  tw_tensor tx = tw_tensor_2d(x, TW_F32, T, E, TW_MEM_HOST), ti = tw_tensor_2d(idx, TW_I32, T, k, TW_MEM_HOST);
  tw_tensor tw_ = tw_tensor_2d(w, TW_F32, T, k, TW_MEM_HOST), tc = tw_tensor_1d(cnt, TW_I32, E, TW_MEM_HOST);
  tw_tensor tdw = tw_tensor_2d(dw, TW_F32, T, k, TW_MEM_HOST), tdl = tw_tensor_2d(dl, TW_F32, T, E, TW_MEM_HOST);
  tw_tensor ti2 = tw_tensor_2d(idx2, TW_I32, T, k, TW_MEM_HOST), tw2 = tw_tensor_2d(w2, TW_F32, T, k, TW_MEM_HOST);
  tw_tensor none = tw_tensor_none();
  tw_status s = tw_router_fwd(ctx, &tx, &o, &ti, &tw_, &tc);
  if (s != TW_OK) return s;
  int c2[16] = {0};
  for (int t = 0; t < T; t++) {
    double sel[16], val[16], mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++) mx = x[t * E + e] > mx ? x[t * E + e] : mx;
    for (int e = 0; e < E; e++) sum += exp(x[t * E + e] - mx);
    for (int e = 0; e < E; e++) {
      double v = x[t * E + e];
      val[e] = o.score == TW_ROUTER_SIGMOID ? sigm(v) : o.pre_softmax ? exp(v - mx) / sum : v;
      sel[e] = val[e] + (tw_tensor_is_none(&o.expert_bias) ? 0.0 : bias[e]);
    }
    int chosen[16] = {0};
    for (int j = 0; j < k; j++) {
      int e = idx[t * k + j];
      if (e < 0 || e >= E || chosen[e]) RFAIL("token %d: id %d out of range or repeated", t, e);
      chosen[e] = 1;
      c2[e]++;
      if (j > 0) { /* descending sel, ties to the lower id */
        int p = idx[t * k + j - 1];
        if (!(sel[p] > sel[e] || (sel[p] == sel[e] && p < e))) RFAIL("token %d: ids %d then %d break the order", t, p, e);
      }
    }
    int last = idx[t * k + k - 1];
    for (int e = 0; e < E; e++)
      if (!chosen[e] && (sel[e] > sel[last] || (sel[e] == sel[last] && e < last)))
        RFAIL("token %d: expert %d (sel %.17g) should have been chosen over %d (%.17g)", t, e, sel[e], last, sel[last]);
    double wv[4], ws = 0;
    for (int j = 0; j < k; j++) ws += wv[j] = o.score == TW_ROUTER_SOFTMAX && !o.pre_softmax ? exp(val[idx[t * k + j]] - val[idx[t * k]]) : val[idx[t * k + j]];
    for (int j = 0; j < k; j++) {
      double want = (o.score == TW_ROUTER_SOFTMAX && !o.pre_softmax) ? wv[j] / ws
                    : (o.score == TW_ROUTER_SIGMOID && k > 1) ? wv[j] / (ws + 1e-20) : wv[j];
      want *= o.scaling_factor;
      if (fabs(w[t * k + j] - want) > 2e-7 * fabs(want) + 1e-30)
        RFAIL("token %d: weight %d is %.9g, formula %.9g", t, j, (double)w[t * k + j], want);
    }
  }
  for (int e = 0; e < E; e++)
    if (cnt[e] != c2[e]) RFAIL("counts[%d] = %d, expected %d", e, cnt[e], c2[e]);
  if ((s = tw_router_bwd(ctx, &tx, &o, &ti, &tdw, &tdl)) != TW_OK) return s;
  for (int i = 0; i < T * E; i++) {
    double l[2];
    float x0 = x[i];
    int moved = 0;
    for (int sg = 0; sg < 2; sg++) {
      x[i] = x0 + (sg ? -1e-2f : 1e-2f);
      if ((s = tw_router_fwd(ctx, &tx, &o, &ti2, &tw2, &none)) != TW_OK) return s;
      moved |= memcmp(idx, idx2, (size_t)(T * k) * 4) != 0;
      l[sg] = 0;
      for (int j = 0; j < T * k; j++) l[sg] += (double)w2[j] * dw[j];
    }
    x[i] = x0;
    if (moved) continue; /* the selection is piecewise constant: no derivative across a switch */
    double fd = (l[0] - l[1]) / (2.0 * ((double)(x0 + 1e-2f) - (double)x0));
    if (fabs(fd - dl[i]) > 3e-4 + 2e-3 * fabs(fd))
      RFAIL("d_logits[%d] = %.7g, finite difference %.7g", i, (double)dl[i], fd);
  }
rout:
  return s;
}

tw_status tw_router_fuzz_run(uint64_t seed, int max_cases, tw_ep_fuzz_report *rep) {
  memset(rep, 0, sizeof *rep);
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  uint64_t rng = seed;
  for (int i = 0; i < max_cases; i++) {
    char desc[256];
    rep->cases++;
    if (router_case(&rng, ctx, desc, sizeof desc) != TW_OK) {
      rep->found = 1;
      snprintf(rep->message, sizeof rep->message, "%s: %s", desc, tw_last_error());
      break;
    }
  }
  tw_ctx_destroy(ctx);
  return TW_OK;
}
