/* The sharded EP sweep's cases (shard_ep_cases.h). */
#include "tests/shard_ep_cases.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"

#define GT SEP_GT
#define GE SEP_GE
#define GH SEP_GH
#define GK SEP_GK

static const char *dist_name[SEP_DISTS] = {"uniform", "hot", "one", "half", "none"};

int sep_meshes(int n, int sizes[][4]) {
  int m = 0;
  for (int dp = 1; dp <= n; dp *= 2)
    for (int fsdp = 1; dp * fsdp <= n; fsdp *= 2)
      for (int ep = 1; dp * fsdp * ep <= n; ep *= 2) {
        int tp = n / (dp * fsdp * ep);
        if (dp * fsdp * ep * tp != n) continue;
        sizes[m][0] = dp; sizes[m][1] = fsdp; sizes[m][2] = ep; sizes[m][3] = tp;
        m++;
      }
  return m;
}

int sep_specs(const int sizes[4], const char *specs[5]) {
  static const char *all[5] = {"[(dp,fsdp,ep), None]", "[(fsdp,dp,ep), None]", "[(dp,ep), None]",
                               "[(fsdp,ep), None]", "[ep, None]"};
  /* each spec's effect: the order of its axes of size > 1 (dp 1, fsdp 2), as a number */
  static const int order[5][2] = {{1, 2}, {2, 1}, {1, 0}, {2, 0}, {0, 0}};
  int keys[5], n = 0;
  for (int i = 0; i < 5; i++) {
    int key = 0;
    for (int a = 0; a < 2; a++)
      if (order[i][a] && sizes[order[i][a] - 1] > 1) key = key * 3 + order[i][a];
    int dup = 0;
    for (int j = 0; j < n; j++) dup |= keys[j] == key;
    if (dup) continue;
    keys[n] = key;
    specs[n++] = all[i];
  }
  return n;
}

const char *sep_case_str(const sep_case *c, char *buf, size_t cap) {
  char mb[64];
  snprintf(buf, cap, "%s %s %s %s", tw_mesh_str(&c->mesh, mb, sizeof mb), c->spec_str, dist_name[c->dist],
           tw_dtype_name(c->dt));
  return buf;
}

void sep_case_make(sep_case *c, const int sizes[4], const char *spec, int dist, tw_dtype dt, uint64_t seed) {
  memset(c, 0, sizeof *c);
  tw_axis axes[4] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_EP, TW_AXIS_TP};
  cr_assert_eq(tw_mesh_init(&c->mesh, 4, axes, sizes), TW_OK);
  cr_assert_eq(tw_pspec_parse(spec, &c->spec), TW_OK, "%s", spec);
  snprintf(c->spec_str, sizeof c->spec_str, "%s", spec);
  c->dt = dt;
  c->dist = dist;
  uint64_t st = seed;
  c->T = dist == SEP_NONE ? 0 : GT;
  for (int64_t t = 0; t < GT; t++) {
    for (int j = 0; j < GK; j++) {
      int e, again;
      do {
        if (dist == SEP_HOT && j == 0 && tt_rand_uniform(&st, 0, 1) < 0.75) e = 3;
        else if (dist == SEP_ONE && j == 0) e = GE - 1;
        else if (dist == SEP_HALF) e = (int)tt_rand_uniform(&st, 0, GE / 2); /* experts 4..7 get nothing */
        else e = (int)tt_rand_uniform(&st, 0, GE);
        again = j > 0 && c->idx[t * GK] == e;
      } while (again);
      c->idx[t * GK + j] = e;
      c->w[t * GK + j] = (float)tt_rand_uniform(&st, 0.1, 1);
    }
    for (int64_t h = 0; h < GH; h++) {
      float v = h == 0 ? (float)t : (float)tt_rand_uniform(&st, -2, 2); /* column 0: the token's id */
      c->x[t * GH + h] = v;
      c->x16[t * GH + h] = tw_f32_to_bf16(v);
      if (c->dt == TW_BF16) c->x[t * GH + h] = tw_bf16_to_f32(c->x16[t * GH + h]);
      c->dout[t * GH + h] = (float)tt_rand_uniform(&st, -1, 1);
    }
  }
  cr_assert_eq(tw_ep_plan_make(&c->mesh, TW_EP_OP_DISPATCH, c->T, GH, GE, GK, &c->spec, NULL, NULL, &c->plan), TW_OK,
               "%s: %s", spec, tw_last_error());
}

static float expert_fn(float x, int e, int64_t h) { return x * (float)(e + 1) + 0.125f * (float)h; }
static float grad_fn(float x, int e, int64_t h) { return x * 0.5f - (float)e + 0.25f * (float)h; }

static float xval(const sep_case *c, int64_t i) { return c->dt == TW_F32 ? c->x[i] : tw_bf16_to_f32(c->x16[i]); }

/* ---- tensors in the context's memory --------------------------------------------------------- */
/* A tensor of ctx's memory for host bytes: the host array itself on ref; on gpu a device copy
 * (in = 1) or a device buffer poisoned with 0xFF bytes (in = 0: an output, every element of
 * which the op must write). Host outputs are poisoned the same way. */
typedef struct {
  tw_tensor host, t;
  int dev;
} staged;

static tw_status stage(tw_ctx *ctx, staged *s, void *host, tw_dtype dt, int64_t rows, int64_t cols, int in) {
  s->host = cols ? tw_tensor_2d(host, dt, rows, cols, TW_MEM_HOST) : tw_tensor_1d(host, dt, rows, TW_MEM_HOST);
  s->t = s->host;
  s->dev = 0;
  size_t bytes = tw_tensor_bytes(&s->host);
  if (tw_ctx_mem(ctx) == TW_MEM_HOST) {
    if (!in) memset(host, 0xFF, bytes);
    return TW_OK;
  }
  void *p = NULL;
  s->t.data = NULL;
  TW_TRY(tw_alloc(ctx, bytes + 16, &p));
  s->t.data = p;
  s->dev = 1;
  s->t.mem = tw_ctx_mem(ctx);
  return in ? tw_tensor_copy(ctx, &s->t, &s->host) : tw_memset(ctx, p, 0xFF, bytes);
}
static tw_status fetch(tw_ctx *ctx, staged *s) { return s->dev ? tw_tensor_copy(ctx, &s->host, &s->t) : TW_OK; }
static void unstage(tw_ctx *ctx, staged *s) {
  if (s->dev && s->t.data) tw_free(ctx, s->t.data);
  s->t.data = NULL;
}

/* the first mismatch of a rank, then on to `label` (the ops after it still run: peers wait) */
#define BAD(label, ...) do { if (!c->msg[rank][0]) snprintf(c->msg[rank], sizeof c->msg[rank], __VA_ARGS__); goto label; } while (0)

tw_status sep_rank_case(tw_ctx *ctx, tw_comm *world, tw_mesh_comms *mc, sep_case *c, int rank) {
  const tw_ep_plan *p = &c->plan;
  const int64_t Tl = p->local_tokens, H = GH, k = GK;
  int ep_rank = 0, n_ep = p->ep_size, nle = GE / n_ep;
  tw_comm *own = NULL, *epc;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  tw_status s = TW_OK;
  (void)tw_ep_plan_group(p, rank, &ep_rank);
  int shard = tw_ep_plan_shard(p, rank), group_first_shard = shard - ep_rank;
  int64_t t0 = (int64_t)shard * Tl;
  epc = tw_mesh_comms_axis(mc, TW_AXIS_EP);
  if (!epc) { /* ep = 1: each rank its own group (collective over world) */
    if (tw_comm_size(world) == 1) epc = world;
    else {
      TW_TRY(tw_comm_split(world, tw_comm_rank(world), 0, &own));
      epc = own;
    }
  }
  if (tw_comm_size(epc) != n_ep || tw_comm_rank(epc) != ep_rank) { /* an error, not a mismatch: peers would
                                                                      * wait in tw_ep_create; the error aborts them */
    s = tw_error(TW_ERR_INTERNAL, "rank %d: ep communicator has size %d rank %d, the plan says %d / %d", rank,
                 tw_comm_size(epc), tw_comm_rank(epc), n_ep, ep_rank);
    tw_comm_destroy(own);
    return s;
  }
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = GE; cfg.topk = GK; cfg.max_tokens = Tl; cfg.hidden = GH; cfg.token_dtype = c->dt;
  cfg.alignment = SEP_ALIGN;
  if ((s = tw_ep_create(ctx, epc, &cfg, &ep)) != TW_OK) goto done;
  if ((s = tw_ep_layer_create(ep, &layer)) != TW_OK) goto done;
  const int64_t R = tw_ep_recv_capacity(ep);
  const size_t es = c->dt == TW_F32 ? 4 : 2;
  unsigned char *recv = malloc((size_t)(R * H) * es + 1);
  float *rw = malloc((size_t)R * 4 + 4), *y = malloc((size_t)(R * H) * 4 + 4), *dy = malloc((size_t)(R * H) * 4 + 4);
  float *out = malloc((size_t)(Tl * H) * 4 + 4), *dtok = malloc((size_t)(Tl * H) * 4 + 4);
  float *dtw = malloc((size_t)(Tl * k) * 4 + 4), *dexp = malloc((size_t)(R * H) * 4 + 4);
  int64_t *route = malloc((size_t)R * sizeof *route + 8); /* recv row -> global token * k + j, or -1 */
  int32_t gs[GE];
  /* the rank's shards of the global tensors: rows [t0, t0 + Tl) */
  void *xs = c->dt == TW_F32 ? (void *)(c->x + t0 * H) : (void *)(c->x16 + t0 * H);
  staged S[14];
  memset(S, 0, sizeof S);
  staged *tok = &S[0], *idx = &S[1], *w = &S[2], *trecv = &S[3], *trw = &S[4], *tgs = &S[5], *ty = &S[6];
  staged *tout = &S[7], *tdy = &S[8], *tdtok = &S[9], *tdout = &S[10], *tdexp = &S[11], *tdtw = &S[12];
  tw_tensor none = tw_tensor_none();
  if ((s = stage(ctx, tok, xs, c->dt, Tl, H, 1)) || (s = stage(ctx, idx, c->idx + t0 * k, TW_I32, Tl, k, 1)) ||
      (s = stage(ctx, w, c->w + t0 * k, TW_F32, Tl, k, 1)) || (s = stage(ctx, trecv, recv, c->dt, R, H, 0)) ||
      (s = stage(ctx, trw, rw, TW_F32, R, 0, 0)) || (s = stage(ctx, tgs, gs, TW_I32, nle, 0, 0)))
    goto freeb;
  if ((s = tw_ep_dispatch(ctx, layer, &tok->t, &none, &idx->t, &w->t, &trecv->t, &none, &trw->t, &tgs->t, &none)))
    goto freeb;
  if ((s = fetch(ctx, trecv)) || (s = fetch(ctx, trw)) || (s = fetch(ctx, tgs))) goto freeb;

  /* dispatch against the formula: slab l holds the group's routes to expert ep_rank*nle + l,
   * by (source shard, t, j), then zero padding to SEP_ALIGN; every row past the slabs zero */
  int64_t o = 0;
  for (int64_t i = 0; i < R; i++) route[i] = -1;
  for (int l = 0; l < nle; l++) {
    int e = ep_rank * nle + l;
    int64_t i = o;
    for (int src = 0; src < n_ep; src++)
      for (int64_t t = 0; t < Tl; t++)
        for (int j = 0; j < k; j++) {
          int64_t gt = (int64_t)(group_first_shard + src) * Tl + t;
          if (c->idx[gt * k + j] != e) continue;
          const void *want = c->dt == TW_F32 ? (const void *)(c->x + gt * H) : (const void *)(c->x16 + gt * H);
          if (i >= R || memcmp(recv + i * H * es, want, H * es) != 0 || rw[i] != c->w[gt * k + j])
            BAD(checked, "recv row %lld is not token %lld (expert %d)", (long long)i, (long long)gt, e);
          route[i++] = gt * k + j;
        }
    int64_t padded = (i - o + SEP_ALIGN - 1) / SEP_ALIGN * SEP_ALIGN;
    if (gs[l] != padded) BAD(checked, "group_sizes[%d] = %d, formula %lld", l, gs[l], (long long)padded);
    if (o + padded > R) BAD(checked, "expert %d's slab ends at row %lld, past R = %lld", e, (long long)(o + padded), (long long)R);
    for (; i < o + padded; i++)
      for (int64_t h = 0; h < H * (int64_t)es; h++)
        if (recv[i * H * es + h] || rw[i] != 0.0f) BAD(checked, "padding row %lld is not zero", (long long)i);
    o += padded;
  }
  for (int64_t i = o; i < R; i++)
    for (int64_t h = 0; h < H * (int64_t)es; h++)
      if (recv[i * H * es + h] || rw[i] != 0.0f) BAD(checked, "row %lld past the slabs is not zero", (long long)i);
  /* conservation record: the token id of every routed row, per expert */
  o = 0;
  for (int l = 0; l < nle; l++) {
    for (int64_t i = o; i < o + gs[l]; i++) {
      if (rw[i] == 0.0f) continue; /* padding (weights are >= 0.1) */
      float id = c->dt == TW_F32 ? ((float *)recv)[i * H] : tw_bf16_to_f32(((uint16_t *)recv)[i * H]);
      c->seen[rank][(int)id][ep_rank * nle + l]++;
    }
    o += gs[l];
  }
checked:;
  /* the expert: y = f(x, e) on routed rows, NaN on padding and past the slabs (must not leak) */
  for (int64_t i = 0; i < R * H; i++) y[i] = dy[i] = NAN;
  for (int64_t i = 0; i < R; i++) {
    if (route[i] < 0) continue;
    int e = c->idx[route[i]];
    for (int64_t h = 0; h < H; h++) {
      float xv = c->dt == TW_F32 ? ((float *)recv)[i * H + h] : tw_bf16_to_f32(((uint16_t *)recv)[i * H + h]);
      y[i * H + h] = expert_fn(xv, e, h);
      dy[i * H + h] = grad_fn(xv, e, h);
    }
  }
  if ((s = stage(ctx, ty, y, TW_F32, R, H, 1)) || (s = stage(ctx, tdy, dy, TW_F32, R, H, 1)) ||
      (s = stage(ctx, tdout, c->dout + t0 * H, TW_F32, Tl, H, 1)) || (s = stage(ctx, tout, out, TW_F32, Tl, H, 0)) ||
      (s = stage(ctx, tdtok, dtok, TW_F32, Tl, H, 0)) || (s = stage(ctx, tdexp, dexp, TW_F32, R, H, 0)) ||
      (s = stage(ctx, tdtw, dtw, TW_F32, Tl, k, 0)))
    goto freeb;
  if ((s = tw_ep_combine(ctx, layer, &ty->t, &w->t, &tout->t))) goto freeb;
  if ((s = tw_ep_dispatch_bwd(ctx, layer, &tdy->t, &none, &tdtok->t, &none))) goto freeb;
  if ((s = tw_ep_combine_bwd(ctx, layer, &tdout->t, &w->t, &ty->t, &tdexp->t, &tdtw->t))) goto freeb;
  if ((s = fetch(ctx, tout)) || (s = fetch(ctx, tdtok)) || (s = fetch(ctx, tdexp)) || (s = fetch(ctx, tdtw)))
    goto freeb;
  if ((s = tw_ctx_check(ctx))) goto freeb;
  if (c->msg[rank][0]) goto freeb; /* dispatch was wrong: the rest would only repeat it */
  for (int64_t t = 0; t < Tl; t++) {
    int64_t gt = t0 + t;
    for (int64_t h = 0; h < H; h++) {
      float acc = 0.0f, gacc = 0.0f;
      for (int j = 0; j < k; j++) {
        acc += c->w[gt * k + j] * expert_fn(xval(c, gt * H + h), c->idx[gt * k + j], h);
        gacc += grad_fn(xval(c, gt * H + h), c->idx[gt * k + j], h);
      }
      if (memcmp(&acc, &out[t * H + h], 4))
        BAD(freeb, "combine out[%lld, %lld] = %.9g, formula %.9g", (long long)gt, (long long)h, out[t * H + h], acc);
      if (memcmp(&gacc, &dtok[t * H + h], 4))
        BAD(freeb, "d_tokens[%lld, %lld] = %.9g, formula %.9g", (long long)gt, (long long)h, dtok[t * H + h], gacc);
    }
    for (int j = 0; j < k; j++) {
      float prod[GH]; /* combine_bwd's d_topk_weights in tw_ep.h's warp order */
      for (int64_t h = 0; h < H; h++) prod[h] = c->dout[gt * H + h] * expert_fn(xval(c, gt * H + h), c->idx[gt * k + j], h);
      float acc = tt_warp_order_sum(prod, H);
      if (memcmp(&acc, &dtw[t * k + j], 4))
        BAD(freeb, "d_topk_weights[%lld, %d] = %.9g, formula %.9g", (long long)gt, j, dtw[t * k + j], acc);
    }
  }
  /* combine_bwd's d_expert_out: w * d_out on routed rows, zero elsewhere (padding, unused) */
  for (int64_t i = 0; i < R; i++)
    for (int64_t h = 0; h < H; h++) {
      float want = route[i] < 0 ? 0.0f : c->w[route[i]] * c->dout[route[i] / k * H + h];
      if (memcmp(&want, &dexp[i * H + h], 4))
        BAD(freeb, "d_expert_out[%lld, %lld] = %.9g, formula %.9g", (long long)i, (long long)h, dexp[i * H + h], want);
    }
freeb:
  for (int i = 0; i < 14; i++) unstage(ctx, &S[i]);
  free(recv); free(rw); free(y); free(dy); free(out); free(dtok); free(dtw); free(dexp); free(route);
done:
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_comm_destroy(own);
  return s;
}

int sep_conserved(const sep_case *c, char *msg, size_t cap) {
  int n = tw_mesh_ranks(&c->mesh);
  int64_t arrived = 0;
  uint64_t sum_arrived = 0, sum_routes = 0;
  for (int64_t t = 0; t < GT; t++)
    for (int e = 0; e < GE; e++) {
      int want = 0, got = 0;
      for (int j = 0; j < GK && t < c->T; j++) want += c->idx[t * GK + j] == e;
      for (int r = 0; r < n; r++) got += c->seen[r][t][e];
      if (got != want * c->plan.replicas) {
        snprintf(msg, cap, "token %lld reached expert %d %d times, expected %d", (long long)t, e, got,
                 want * c->plan.replicas);
        return 0;
      }
      arrived += got;
      sum_arrived += (uint64_t)got * (uint64_t)(t * GE + e + 1) * 0x9E3779B97F4A7C15ull;
      sum_routes += (uint64_t)(want * c->plan.replicas) * (uint64_t)(t * GE + e + 1) * 0x9E3779B97F4A7C15ull;
    }
  if (arrived != c->T * GK * c->plan.replicas || sum_arrived != sum_routes) {
    snprintf(msg, cap, "%lld routes arrived, expected %lld (or their checksums differ)", (long long)arrived,
             (long long)(c->T * GK * c->plan.replicas));
    return 0;
  }
  return 1;
}
