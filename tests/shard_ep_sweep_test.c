/* The sharded EP sweep: every mesh of 1, 2, 4 and 8 thread ranks over (dp, fsdp, ep, tp),
 * tokens sharded [(dp, fsdp, ep), None] (tp holds replicas), routing uniform, one hot
 * expert, all tokens to one expert, half the experts receiving nothing, and no tokens at
 * all. Each rank runs dispatch -> expert fn -> combine and both backward passes on its EP
 * group (the ep communicator of tw_mesh_comms) and is checked, bit for bit, against the
 * unsharded formula computed from the global tensors without communication; the main
 * thread then checks token conservation over all ranks: every (token, expert) route
 * arrives exactly once per replica, counted and checksummed. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"
#include "twin/tw_shard_ep.h"

#define GT 24 /* global tokens: divisible by every shard count up to 8 */
#define GE 8
#define GH 5
#define GK 2
#define ALIGN 4

enum { DIST_UNIFORM, DIST_HOT, DIST_ONE, DIST_HALF, DIST_NONE, DIST_COUNT };

typedef struct {
  tw_mesh mesh;
  tw_ep_plan plan;
  tw_pspec spec;
  tw_dtype dt;
  int64_t T; /* global tokens of this case (0 for DIST_NONE) */
  uint16_t x16[GT * GH];
  float x[GT * GH], w[GT * GK], dout[GT * GH];
  int32_t idx[GT * GK];
  /* per rank: routes seen (token, expert) and their checksum */
  int seen[8][GT][GE];
} sweep_case;

static float expert_fn(float x, int e, int64_t h) { return x * (float)(e + 1) + 0.125f * (float)h; }
static float grad_fn(float x, int e, int64_t h) { return x * 0.5f - (float)e + 0.25f * (float)h; }

static float xval(const sweep_case *c, int64_t i) { return c->dt == TW_F32 ? c->x[i] : tw_bf16_to_f32(c->x16[i]); }

static void make_global(sweep_case *c, int dist, uint64_t seed) {
  uint64_t st = seed;
  c->T = dist == DIST_NONE ? 0 : GT;
  for (int64_t t = 0; t < GT; t++) {
    for (int j = 0; j < GK; j++) {
      int e, again;
      do {
        if (dist == DIST_HOT && j == 0 && tt_rand_uniform(&st, 0, 1) < 0.75) e = 3;
        else if (dist == DIST_ONE && j == 0) e = GE - 1;
        else if (dist == DIST_HALF) e = (int)tt_rand_uniform(&st, 0, GE / 2); /* experts 4..7 get nothing */
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
}

#define FAIL(...) do { s = tw_error(TW_ERR_INTERNAL, __VA_ARGS__); goto done; } while (0)

static tw_status rank_body(int rank, tw_comm *world, void *arg) {
  sweep_case *c = arg;
  const tw_ep_plan *p = &c->plan;
  int64_t Tl = p->local_tokens, H = GH, k = GK;
  int ep_rank, n_ep = p->ep_size, nle = GE / n_ep;
  tw_ctx *ctx = NULL;
  tw_mesh_comms *mc = NULL;
  tw_comm *own = NULL, *epc;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  tw_status s;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = world;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  (void)tw_ep_plan_group(p, rank, &ep_rank);
  int shard = tw_ep_plan_shard(p, rank), group_first_shard = shard - ep_rank;
  int64_t t0 = (int64_t)shard * Tl;
  s = tw_mesh_comms_create(ctx, &c->mesh, &mc);
  if (s != TW_OK) goto done;
  epc = tw_mesh_comms_axis(mc, TW_AXIS_EP);
  if (!epc) {
    if ((s = tw_comm_init_threads(1, &own)) != TW_OK) goto done;
    epc = own;
  }
  if (tw_comm_size(epc) != n_ep || tw_comm_rank(epc) != ep_rank)
    FAIL("rank %d: ep communicator has size %d rank %d, the plan says %d / %d", rank, tw_comm_size(epc),
         tw_comm_rank(epc), n_ep, ep_rank);
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = GE; cfg.topk = GK; cfg.max_tokens = Tl; cfg.hidden = GH; cfg.token_dtype = c->dt;
  cfg.alignment = ALIGN;
  if ((s = tw_ep_create(ctx, epc, &cfg, &ep)) != TW_OK) goto done;
  if ((s = tw_ep_layer_create(ep, &layer)) != TW_OK) goto done;
  int64_t R = tw_ep_recv_capacity(ep);
  size_t es = c->dt == TW_F32 ? 4 : 2;
  unsigned char *recv = calloc((size_t)(R * H) * es + 1, 1);
  float *rw = calloc((size_t)R + 1, 4), *y = calloc((size_t)(R * H) + 1, 4), *dy = calloc((size_t)(R * H) + 1, 4);
  float *out = calloc((size_t)(Tl * H) + 1, 4), *dtok = calloc((size_t)(Tl * H) + 1, 4), *dtw = calloc((size_t)(Tl * k) + 1, 4);
  float *dexp = calloc((size_t)(R * H) + 1, 4);
  int32_t gs[GE];
  /* the rank's shards of the global tensors: rows [t0, t0 + Tl) */
  tw_tensor tok = tw_tensor_2d(c->dt == TW_F32 ? (void *)(c->x + t0 * H) : (void *)(c->x16 + t0 * H), c->dt, Tl, H, TW_MEM_HOST);
  tw_tensor idx = tw_tensor_2d(c->idx + t0 * k, TW_I32, Tl, k, TW_MEM_HOST);
  tw_tensor w = tw_tensor_2d(c->w + t0 * k, TW_F32, Tl, k, TW_MEM_HOST);
  tw_tensor none = tw_tensor_none();
  tw_tensor trecv = tw_tensor_2d(recv, c->dt, R, H, TW_MEM_HOST), trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST);
  if ((s = tw_ep_dispatch(ctx, layer, &tok, &none, &idx, &w, &trecv, &none, &trw, &tgs, &none)) != TW_OK) goto freeb;

  /* dispatch against the formula: slab l holds the group's routes to expert ep_rank*nle + l,
   * by (source shard, t, j), then zero padding to ALIGN */
  int64_t o = 0;
  for (int l = 0; l < nle && s == TW_OK; l++) {
    int e = ep_rank * nle + l;
    int64_t i = o;
    for (int src = 0; src < n_ep; src++)
      for (int64_t t = 0; t < Tl; t++)
        for (int j = 0; j < k; j++) {
          int64_t gt = (int64_t)(group_first_shard + src) * Tl + t;
          if (c->idx[gt * k + j] != e) continue;
          const unsigned char *want = c->dt == TW_F32 ? (const unsigned char *)(c->x + gt * H) : (const unsigned char *)(c->x16 + gt * H);
          if (memcmp(recv + i * H * es, want, H * es) != 0 || rw[i] != c->w[gt * k + j])
            FAIL("rank %d: recv row %lld is not token %lld (expert %d)", rank, (long long)i, (long long)gt, e);
          i++;
        }
    int64_t padded = (i - o + ALIGN - 1) / ALIGN * ALIGN;
    if (gs[l] != padded) FAIL("rank %d: group_sizes[%d] = %d, formula %lld", rank, l, gs[l], (long long)padded);
    for (; i < o + padded; i++)
      for (int64_t h = 0; h < H * (int64_t)es; h++)
        if (recv[i * H * es + h] || rw[i] != 0.0f) FAIL("rank %d: padding row %lld is not zero", rank, (long long)i);
    o += padded;
  }
  for (int64_t i = o; i < R; i++)
    for (int64_t h = 0; h < H * (int64_t)es; h++)
      if (recv[i * H * es + h]) FAIL("rank %d: row %lld past the slabs is not zero", rank, (long long)i);
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
  /* the expert: y = f(x, e) on routed rows, NaN on padding and past the slabs (must not leak) */
  o = 0;
  for (int64_t i = 0; i < R * H; i++) y[i] = dy[i] = NAN;
  for (int l = 0; l < nle; l++) {
    for (int64_t i = o; i < o + gs[l]; i++)
      if (rw[i] != 0.0f)
        for (int64_t h = 0; h < H; h++) {
          float xv = c->dt == TW_F32 ? ((float *)recv)[i * H + h] : tw_bf16_to_f32(((uint16_t *)recv)[i * H + h]);
          y[i * H + h] = expert_fn(xv, ep_rank * nle + l, h);
          dy[i * H + h] = grad_fn(xv, ep_rank * nle + l, h);
        }
    o += gs[l];
  }
  tw_tensor ty = tw_tensor_2d(y, TW_F32, R, H, TW_MEM_HOST), tout = tw_tensor_2d(out, TW_F32, Tl, H, TW_MEM_HOST);
  tw_tensor tdy = tw_tensor_2d(dy, TW_F32, R, H, TW_MEM_HOST), tdtok = tw_tensor_2d(dtok, TW_F32, Tl, H, TW_MEM_HOST);
  tw_tensor tdout = tw_tensor_2d(c->dout + t0 * H, TW_F32, Tl, H, TW_MEM_HOST);
  tw_tensor tdexp = tw_tensor_2d(dexp, TW_F32, R, H, TW_MEM_HOST), tdtw = tw_tensor_2d(dtw, TW_F32, Tl, k, TW_MEM_HOST);
  if ((s = tw_ep_combine(ctx, layer, &ty, &w, &tout)) != TW_OK) goto freeb;
  if ((s = tw_ep_dispatch_bwd(ctx, layer, &tdy, &none, &tdtok, &none)) != TW_OK) goto freeb;
  if ((s = tw_ep_combine_bwd(ctx, layer, &tdout, &w, &ty, &tdexp, &tdtw)) != TW_OK) goto freeb;
  for (int64_t t = 0; t < Tl; t++) {
    int64_t gt = t0 + t;
    for (int64_t h = 0; h < H; h++) {
      float acc = 0.0f, gacc = 0.0f;
      for (int j = 0; j < k; j++) {
        acc += c->w[gt * k + j] * expert_fn(xval(c, gt * H + h), c->idx[gt * k + j], h);
        gacc += grad_fn(xval(c, gt * H + h), c->idx[gt * k + j], h);
      }
      if (memcmp(&acc, &out[t * H + h], 4)) FAIL("rank %d: combine out[%lld, %lld] = %.9g, formula %.9g", rank, (long long)gt, (long long)h, out[t * H + h], acc);
      if (memcmp(&gacc, &dtok[t * H + h], 4)) FAIL("rank %d: d_tokens[%lld, %lld] = %.9g, formula %.9g", rank, (long long)gt, (long long)h, dtok[t * H + h], gacc);
    }
    for (int j = 0; j < k; j++) {
      float prod[GH]; /* combine_bwd's d_topk_weights in tw_ep.h's warp order */
      for (int64_t h = 0; h < H; h++) prod[h] = c->dout[gt * H + h] * expert_fn(xval(c, gt * H + h), c->idx[gt * k + j], h);
      float acc = tt_warp_order_sum(prod, H);
      if (memcmp(&acc, &dtw[t * k + j], 4)) FAIL("rank %d: d_topk_weights[%lld, %d] = %.9g, formula %.9g", rank, (long long)gt, j, dtw[t * k + j], acc);
    }
  }
freeb:
  free(recv); free(rw); free(y); free(dy); free(out); free(dtok); free(dtw); free(dexp);
done:
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_comm_destroy(own);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return s;
}

static int run_mesh(const int sizes[4], int dist, tw_dtype dt, uint64_t seed) {
  static sweep_case c; /* large; one at a time */
  memset(&c, 0, sizeof c);
  tw_axis axes[4] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_EP, TW_AXIS_TP};
  cr_assert_eq(tw_mesh_init(&c.mesh, 4, axes, sizes), TW_OK);
  cr_assert_eq(tw_pspec_parse("[(dp,fsdp,ep), None]", &c.spec), TW_OK);
  c.dt = dt;
  make_global(&c, dist, seed);
  cr_assert_eq(tw_ep_plan_make(&c.mesh, TW_EP_OP_DISPATCH, c.T, GH, GE, GK, &c.spec, NULL, NULL, &c.plan), TW_OK, "%s",
               tw_last_error());
  int n = tw_mesh_ranks(&c.mesh);
  tw_comm *comms[8];
  cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
  tw_status s = tw_run_ranks(n, comms, rank_body, &c);
  char mb[64];
  cr_expect_eq(s, TW_OK, "mesh %s dist %d %s: %s", tw_mesh_str(&c.mesh, mb, sizeof mb), dist, tw_dtype_name(dt), tw_last_error());
  for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
  /* conservation: each route arrives once in each replica group, nowhere else */
  int64_t arrived = 0;
  uint64_t sum_arrived = 0, sum_routes = 0;
  for (int64_t t = 0; t < GT; t++)
    for (int e = 0; e < GE; e++) {
      int want = 0, got = 0;
      for (int j = 0; j < GK && t < c.T; j++) want += c.idx[t * GK + j] == e;
      for (int r = 0; r < n; r++) got += c.seen[r][t][e];
      cr_expect_eq(got, want * c.plan.replicas, "mesh %s: token %lld reached expert %d %d times, expected %d",
                   tw_mesh_str(&c.mesh, mb, sizeof mb), (long long)t, e, got, want * c.plan.replicas);
      arrived += got;
      sum_arrived += (uint64_t)got * (uint64_t)(t * GE + e + 1) * 0x9E3779B97F4A7C15ull;
      sum_routes += (uint64_t)(want * c.plan.replicas) * (uint64_t)(t * GE + e + 1) * 0x9E3779B97F4A7C15ull;
    }
  cr_expect_eq(arrived, c.T * GK * c.plan.replicas);
  cr_expect_eq(sum_arrived, sum_routes);
  return s == TW_OK;
}

Test(shard_ep_sweep, every_mesh_up_to_8_ranks_every_distribution) {
  int meshes = 0, runs = 0, ok = 0;
  for (int n = 1; n <= 8; n *= 2)
    for (int dp = 1; dp <= n; dp *= 2)
      for (int fsdp = 1; dp * fsdp <= n; fsdp *= 2)
        for (int ep = 1; dp * fsdp * ep <= n; ep *= 2) {
          int tp = n / (dp * fsdp * ep);
          if (dp * fsdp * ep * tp != n) continue;
          int sizes[4] = {dp, fsdp, ep, tp};
          meshes++;
          for (int dist = 0; dist < DIST_COUNT; dist++, runs++)
            ok += run_mesh(sizes, dist, (meshes + dist) % 2 ? TW_BF16 : TW_F32, (uint64_t)(meshes * 10 + dist));
        }
  cr_expect_eq(meshes, 35, "meshes of 1/2/4/8 ranks over (dp, fsdp, ep, tp): %d", meshes);
  cr_log_info("shard_ep_sweep: %d meshes x %d distributions = %d runs, %d passed", meshes, DIST_COUNT, runs, ok);
  printf("shard_ep_sweep: %d meshes x %d distributions = %d runs, %d passed\n", meshes, DIST_COUNT, runs, ok);
}
