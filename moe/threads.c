/* moe/threads.h: the MoE block on ref thread ranks. */
#include "moe/threads.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_comm.h"
#include "twin/tw_numerics.h"

typedef struct {
  tw_moe_threads_run *run;
  int nranks;
} job;

/* n f32 values as the recipe's dtype (a new host buffer). */
static void *as_dtype(const float *src, int64_t n, tw_dtype dt) {
  if (dt == TW_F32) {
    float *p = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (p && n) memcpy(p, src, sizeof(float) * (size_t)n);
    return p;
  }
  uint16_t *p = (uint16_t *)malloc(2 * (size_t)(n ? n : 1));
  if (p)
    for (int64_t i = 0; i < n; i++) p[i] = tw_f32_to_bf16(src[i]);
  return p;
}

static void to_f32(float *dst, const void *src, int64_t n, tw_dtype dt) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = dt == TW_F32 ? ((const float *)src)[i] : tw_bf16_to_f32(((const uint16_t *)src)[i]);
}

/* A host buffer staged into ctx memory (a copy on a device context; the host pointer on ref). */
static tw_status stage(tw_ctx *ctx, void *host, tw_dtype dt, int64_t n, void **out) {
  if (tw_ctx_mem(ctx) == TW_MEM_HOST) {
    *out = host;
    return TW_OK;
  }
  TW_TRY(tw_alloc(ctx, tw_dtype_storage_bytes(dt, n > 0 ? n : 1), out));
  tw_tensor d = tw_tensor_1d(*out, dt, n, TW_MEM_DEVICE), h = tw_tensor_1d(host, dt, n, TW_MEM_HOST);
  return n > 0 ? tw_tensor_copy(ctx, &d, &h) : TW_OK;
}
static tw_status unstage(tw_ctx *ctx, void *host, void *dev, tw_dtype dt, int64_t n) {
  if (tw_ctx_mem(ctx) == TW_MEM_HOST || n == 0) return TW_OK;
  tw_tensor d = tw_tensor_1d(dev, dt, n, TW_MEM_DEVICE), h = tw_tensor_1d(host, dt, n, TW_MEM_HOST);
  return tw_tensor_copy(ctx, &h, &d);
}

enum { IN_X, IN_GATE, IN_WI, IN_WO, IN_BI, IN_BO, IN_DOUT, IN_EBIAS, OUT_Y, OUT_DX, OUT_Y2, OUT_AUX, OUT_AUX2,
       G_GATE, G_WI, G_WO, G_BI, G_BO, NBUF };

tw_status tw_moe_run_rank(tw_ctx *ctx, const tw_moe_threads_run *r, int rank, int nranks) {
  const tw_mesh *mesh = &r->mesh;
  tw_dimspec tok = {0, {TW_AXIS_DP}};
  if (tw_mesh_axis_size(mesh, TW_AXIS_DP) > 1) tok.axis[tok.n++] = TW_AXIS_DP;
  if (tw_mesh_axis_size(mesh, TW_AXIS_FSDP) > 1) tok.axis[tok.n++] = TW_AXIS_FSDP;
  if (tw_mesh_axis_size(mesh, TW_AXIS_EP) > 1) tok.axis[tok.n++] = TW_AXIS_EP;
  int shard = tok.n ? tw_dimspec_index(mesh, &tok, rank) : 0;
  int ep = tw_mesh_axis_size(mesh, TW_AXIS_EP), epc = tw_mesh_coord(mesh, rank, TW_AXIS_EP);
  int dpc = tw_mesh_coord(mesh, rank, TW_AXIS_DP);
  int fs = tw_mesh_axis_size(mesh, TW_AXIS_FSDP), fsc = tw_mesh_coord(mesh, rank, TW_AXIS_FSDP);
  tw_moe_config cfg = r->cfg;
  int64_t Tl = r->T / nranks, H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts, nle = E / ep;
  if (H % fs != 0)
    return tw_error(TW_ERR_INVALID_ARG, "moe_run_rank: H = %lld does not split over fsdp = %d", (long long)H, fs);
  int64_t Hs = H / fs; /* fsdp: wi [nle, Hs, 2F] rows fsc*Hs.., wo [nle, F, Hs] columns fsc*Hs.. */
  cfg.max_tokens = Tl;
  cfg.global_tokens = r->T;
  tw_dtype dt = cfg.recipe == TW_MOE_F32 ? TW_F32 : TW_BF16;
  int layers = r->layers == 2 ? 2 : 1, bias = r->bi != NULL || r->bo != NULL;
  /* host copies in the recipe's dtype, then their ctx-memory twins */
  int64_t n[NBUF] = {Tl * H, H * E, nle * Hs * 2 * F, nle * F * Hs, nle * 2 * F, nle * H, Tl * H, E, Tl * H, Tl * H,
                     Tl * H, 1, 1, H * E, nle * Hs * 2 * F, nle * F * Hs, nle * 2 * F, nle * H};
  tw_dtype gw = r->bf16_grads ? TW_BF16 : TW_F32; /* d_wi, d_wo */
  tw_dtype t[NBUF] = {dt, dt, dt, dt, TW_F32, TW_F32, dt, TW_F32, dt, dt, dt, TW_F32, TW_F32,
                      TW_F32, gw, gw, TW_F32, TW_F32};
  void *host[NBUF] = {0}, *dev[NBUF] = {0};
  host[IN_X] = as_dtype(r->x + Tl * H * shard, Tl * H, dt);
  host[IN_GATE] = as_dtype(r->gate, H * E, dt);
  float *wi_s = (float *)malloc(sizeof(float) * (size_t)(n[IN_WI] ? n[IN_WI] : 1));
  float *wo_s = (float *)malloc(sizeof(float) * (size_t)(n[IN_WO] ? n[IN_WO] : 1));
  for (int64_t e = 0; wi_s && wo_s && e < nle; e++) {
    const float *gi = r->wi + (epc * nle + e) * H * 2 * F, *go = r->wo + (epc * nle + e) * F * H;
    memcpy(wi_s + e * Hs * 2 * F, gi + fsc * Hs * 2 * F, sizeof(float) * (size_t)(Hs * 2 * F));
    for (int64_t f = 0; f < F; f++) memcpy(wo_s + (e * F + f) * Hs, go + f * H + fsc * Hs, sizeof(float) * (size_t)Hs);
  }
  host[IN_WI] = wi_s ? as_dtype(wi_s, n[IN_WI], dt) : NULL;
  host[IN_WO] = wo_s ? as_dtype(wo_s, n[IN_WO], dt) : NULL;
  free(wi_s);
  free(wo_s);
  host[IN_BI] = r->bi ? as_dtype(r->bi + nle * 2 * F * epc, nle * 2 * F, TW_F32) : NULL;
  host[IN_BO] = r->bo ? as_dtype(r->bo + nle * H * epc, nle * H, TW_F32) : NULL;
  host[IN_DOUT] = as_dtype(r->d_out + Tl * H * shard, Tl * H, dt);
  host[IN_EBIAS] = r->expert_bias ? as_dtype(r->expert_bias, E, TW_F32) : NULL;
  for (int i = OUT_Y; i < NBUF; i++) host[i] = calloc((size_t)(n[i] > 0 ? n[i] : 1), 4);
  tw_status s = TW_OK;
  for (int i = 0; i < NBUF; i++) {
    int optional = i == IN_BI || i == IN_BO || i == IN_EBIAS || (!bias && (i == G_BI || i == G_BO));
    if (!host[i] && !optional) s = tw_error(TW_ERR_MEMORY, "moe threads: out of host memory");
    if (s == TW_OK && host[i]) s = stage(ctx, host[i], t[i], n[i], &dev[i]);
  }
  if (r->expert_bias) cfg.router.expert_bias = tw_tensor_1d(dev[IN_EBIAS], TW_F32, E, tw_ctx_mem(ctx));
  tw_moe *m[2] = {NULL, NULL};
  for (int l = 0; s == TW_OK && l < layers; l++) s = tw_moe_create(ctx, mesh, &cfg, &m[l]);
  if (s == TW_OK) {
    tw_mem mem = tw_ctx_mem(ctx);
    tw_moe_weights w;
    w.gate = tw_tensor_2d(dev[IN_GATE], dt, H, E, mem);
    w.wi = tw_tensor_3d(dev[IN_WI], dt, nle, Hs, 2 * F, mem);
    w.wo = tw_tensor_3d(dev[IN_WO], dt, nle, F, Hs, mem);
    w.bi = r->bi ? tw_tensor_2d(dev[IN_BI], TW_F32, nle, 2 * F, mem) : tw_tensor_none();
    w.bo = r->bo ? tw_tensor_2d(dev[IN_BO], TW_F32, nle, H, mem) : tw_tensor_none();
    tw_moe_grads g;
    g.gate = tw_tensor_2d(dev[G_GATE], TW_F32, H, E, mem);
    g.wi = tw_tensor_3d(dev[G_WI], gw, nle, Hs, 2 * F, mem);
    g.wo = tw_tensor_3d(dev[G_WO], gw, nle, F, Hs, mem);
    g.bi = bias ? tw_tensor_2d(dev[G_BI], TW_F32, nle, 2 * F, mem) : tw_tensor_none();
    g.bo = bias ? tw_tensor_2d(dev[G_BO], TW_F32, nle, H, mem) : tw_tensor_none();
    tw_tensor tx = tw_tensor_2d(dev[IN_X], dt, Tl, H, mem), tout = tw_tensor_2d(dev[OUT_Y], dt, Tl, H, mem);
    tw_tensor tdo = tw_tensor_2d(dev[IN_DOUT], dt, Tl, H, mem), tdx = tw_tensor_2d(dev[OUT_DX], dt, Tl, H, mem);
    tw_tensor taux = tw_tensor_1d(dev[OUT_AUX], TW_F32, 1, mem);
    /* two layers: layer 2 runs on other tokens (d_out as its x, x as its d_out: other routing)
     * between layer 1's forward and backward, which must not notice */
    tw_tensor tout2 = tw_tensor_2d(dev[OUT_Y2], dt, Tl, H, mem), taux2 = tw_tensor_1d(dev[OUT_AUX2], TW_F32, 1, mem);
    if (s == TW_OK && r->reuse) s = tw_moe_set_weight_reuse(m[0], 1);
    if (s == TW_OK && r->reuse) s = tw_moe_forward(m[0], &tdo, &w, &tout, &taux);
    if (s == TW_OK && r->reuse) s = tw_moe_backward(m[0], &tdo, &w, &tx, r->d_aux, &tdx, &g);
    if (s == TW_OK) s = tw_moe_forward(m[0], &tx, &w, &tout, &taux);
    if (s == TW_OK && layers == 2) s = tw_moe_forward(m[1], &tdo, &w, &tout2, &taux2);
    if (s == TW_OK && layers == 2) s = tw_moe_backward(m[1], &tdo, &w, &tx, r->d_aux, &tdx, &g);
    if (s == TW_OK) s = tw_moe_backward(m[0], &tx, &w, &tdo, r->d_aux, &tdx, &g);
    if (s == TW_OK) s = tw_ctx_sync(ctx);
    if (s == TW_OK) s = tw_ctx_check(ctx);
  }
  for (int i = OUT_Y; s == TW_OK && i < NBUF; i++)
    if (host[i]) s = unstage(ctx, host[i], dev[i], t[i], n[i]);
  if (s == TW_OK && gw == TW_BF16) /* widen in place, from the end (f32 i covers bf16 2i, 2i+1) */
    for (int i = G_WI; i <= G_WO; i++)
      for (int64_t e = n[i] - 1; e >= 0; e--)
        ((float *)host[i])[e] = tw_bf16_to_f32(((const uint16_t *)host[i])[e]);
  if (s == TW_OK) {
    if (r->out) to_f32(r->out + Tl * H * shard, host[OUT_Y], Tl * H, dt);
    if (r->dx) to_f32(r->dx + Tl * H * shard, host[OUT_DX], Tl * H, dt);
    if (rank == 0 && r->aux) r->aux[0] = *(float *)host[OUT_AUX];
    if (rank == 0 && r->dgate) memcpy(r->dgate, host[G_GATE], sizeof(float) * (size_t)(H * E));
    if (dpc == 0) { /* each fsdp coordinate writes its shard of the expert weights' gradients */
      const float *gwi = (const float *)host[G_WI], *gwo = (const float *)host[G_WO];
      for (int64_t e = 0; e < nle; e++) {
        if (r->dwi)
          memcpy(r->dwi + (epc * nle + e) * H * 2 * F + fsc * Hs * 2 * F, gwi + e * Hs * 2 * F, sizeof(float) * (size_t)(Hs * 2 * F));
        for (int64_t f = 0; r->dwo && f < F; f++)
          memcpy(r->dwo + (epc * nle + e) * F * H + f * H + fsc * Hs, gwo + (e * F + f) * Hs, sizeof(float) * (size_t)Hs);
      }
      if (fsc == 0 && r->bi && r->bo && r->dbi) memcpy(r->dbi + nle * 2 * F * epc, host[G_BI], sizeof(float) * (size_t)n[G_BI]);
      if (fsc == 0 && r->bi && r->bo && r->dbo) memcpy(r->dbo + nle * H * epc, host[G_BO], sizeof(float) * (size_t)n[G_BO]);
    }
  }
  for (int l = 0; l < 2; l++) tw_moe_destroy(m[l]);
  for (int i = 0; i < NBUF; i++) {
    if (dev[i] && dev[i] != host[i]) tw_free(ctx, dev[i]);
    free(host[i]);
  }
  return s;
}

static tw_status rank_fn(int rank, tw_comm *comm, void *arg) {
  job *j = (job *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  tw_status s = tw_ctx_create(&ctx, &cc);
  if (s == TW_OK) s = tw_moe_run_rank(ctx, j->run, rank, j->nranks);
  tw_ctx_destroy(ctx);
  if (s != TW_OK) tw_comm_abort(comm);
  return s;
}

tw_status tw_moe_run_threads(tw_moe_threads_run *r) {
  if (!r) return tw_error(TW_ERR_NULL, "moe_run_threads: run is NULL");
  int n = r->mesh.naxes ? tw_mesh_ranks(&r->mesh) : 1;
  if (n < 1 || r->T % n != 0)
    return tw_error(TW_ERR_INVALID_ARG, "moe_run_threads: T = %lld tokens do not split over %d ranks", (long long)r->T, n);
  if (r->mesh.naxes == 0) { /* one rank */
    tw_axis ax = TW_AXIS_EP;
    int one = 1;
    TW_TRY(tw_mesh_init(&r->mesh, 1, &ax, &one));
  }
  tw_comm *comms[64];
  if (n > 64) return tw_error(TW_ERR_INVALID_ARG, "moe_run_threads: %d ranks (at most 64)", n);
  TW_TRY(tw_comm_init_threads(n, comms));
  job j = {r, n};
  tw_status s = tw_run_ranks(n, comms, rank_fn, &j);
  for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  return s;
}
