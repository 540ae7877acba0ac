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

static tw_status rank_fn(int rank, tw_comm *comm, void *arg) {
  job *j = (job *)arg;
  tw_moe_threads_run *r = j->run;
  const tw_mesh *mesh = &r->mesh;
  tw_dimspec tok = {0, {TW_AXIS_DP}};
  if (tw_mesh_axis_size(mesh, TW_AXIS_DP) > 1) tok.axis[tok.n++] = TW_AXIS_DP;
  if (tw_mesh_axis_size(mesh, TW_AXIS_EP) > 1) tok.axis[tok.n++] = TW_AXIS_EP;
  int shard = tok.n ? tw_dimspec_index(mesh, &tok, rank) : 0;
  int ep = tw_mesh_axis_size(mesh, TW_AXIS_EP), epc = tw_mesh_coord(mesh, rank, TW_AXIS_EP);
  int dpc = tw_mesh_coord(mesh, rank, TW_AXIS_DP);
  tw_moe_config cfg = r->cfg;
  int64_t Tl = r->T / j->nranks, H = cfg.hidden, F = cfg.ffn, E = cfg.num_experts, nle = E / ep;
  cfg.max_tokens = Tl;
  cfg.global_tokens = r->T;
  tw_dtype dt = cfg.recipe == TW_MOE_BF16 ? TW_BF16 : TW_F32;
  if (r->expert_bias) cfg.router.expert_bias = tw_tensor_1d((void *)r->expert_bias, TW_F32, E, TW_MEM_HOST);

  tw_ctx *ctx = NULL;
  tw_moe *m[2] = {NULL, NULL};
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  int layers = r->layers == 2 ? 2 : 1;
  void *x = as_dtype(r->x + Tl * H * shard, Tl * H, dt), *gate = as_dtype(r->gate, H * E, dt);
  void *wi = as_dtype(r->wi + nle * H * 2 * F * epc, nle * H * 2 * F, dt);
  void *wo = as_dtype(r->wo + nle * F * H * epc, nle * F * H, dt);
  void *d_out = as_dtype(r->d_out + Tl * H * shard, Tl * H, dt);
  size_t es = dt == TW_BF16 ? 2 : 4;
  size_t nth = (size_t)(Tl * H > 0 ? Tl * H : 1);
  void *out = calloc(nth, es), *dx = calloc(nth, es), *out2 = calloc(nth, es);
  float *g_gate = (float *)calloc((size_t)(H * E), 4), *g_wi = (float *)calloc((size_t)(nle * H * 2 * F), 4);
  float *g_wo = (float *)calloc((size_t)(nle * F * H), 4), *g_bi = (float *)calloc((size_t)(nle * 2 * F), 4);
  float *g_bo = (float *)calloc((size_t)(nle * H), 4);
  float aux = 0, aux2 = 0;
  tw_status s = TW_OK;
  if (!x || !gate || !wi || !wo || !d_out || !out || !dx || !out2 || !g_gate || !g_wi || !g_wo || !g_bi || !g_bo)
    s = tw_error(TW_ERR_MEMORY, "moe threads: out of host memory");
  if (s == TW_OK) s = tw_ctx_create(&ctx, &cc);
  for (int l = 0; s == TW_OK && l < layers; l++) s = tw_moe_create(ctx, mesh, &cfg, &m[l]);
  if (s == TW_OK) {
    tw_moe_weights w;
    w.gate = tw_tensor_2d(gate, dt, H, E, TW_MEM_HOST);
    w.wi = tw_tensor_3d(wi, dt, nle, H, 2 * F, TW_MEM_HOST);
    w.wo = tw_tensor_3d(wo, dt, nle, F, H, TW_MEM_HOST);
    w.bi = r->bi ? tw_tensor_2d((void *)(r->bi + nle * 2 * F * epc), TW_F32, nle, 2 * F, TW_MEM_HOST) : tw_tensor_none();
    w.bo = r->bo ? tw_tensor_2d((void *)(r->bo + nle * H * epc), TW_F32, nle, H, TW_MEM_HOST) : tw_tensor_none();
    tw_moe_grads g;
    g.gate = tw_tensor_2d(g_gate, TW_F32, H, E, TW_MEM_HOST);
    g.wi = tw_tensor_3d(g_wi, TW_F32, nle, H, 2 * F, TW_MEM_HOST);
    g.wo = tw_tensor_3d(g_wo, TW_F32, nle, F, H, TW_MEM_HOST);
    g.bi = r->bi ? tw_tensor_2d(g_bi, TW_F32, nle, 2 * F, TW_MEM_HOST) : tw_tensor_none();
    g.bo = r->bo ? tw_tensor_2d(g_bo, TW_F32, nle, H, TW_MEM_HOST) : tw_tensor_none();
    tw_tensor tx = tw_tensor_2d(x, dt, Tl, H, TW_MEM_HOST), tout = tw_tensor_2d(out, dt, Tl, H, TW_MEM_HOST);
    tw_tensor tdo = tw_tensor_2d(d_out, dt, Tl, H, TW_MEM_HOST), tdx = tw_tensor_2d(dx, dt, Tl, H, TW_MEM_HOST);
    tw_tensor taux = tw_tensor_1d(&aux, TW_F32, 1, TW_MEM_HOST);
    /* two layers: layer 2 runs on other tokens (d_out as its x, x as its d_out: other routing)
     * between layer 1's forward and backward, which must not notice */
    tw_tensor tout2 = tw_tensor_2d(out2, dt, Tl, H, TW_MEM_HOST), taux2 = tw_tensor_1d(&aux2, TW_F32, 1, TW_MEM_HOST);
    if (s == TW_OK) s = tw_moe_forward(m[0], &tx, &w, &tout, &taux);
    if (s == TW_OK && layers == 2) s = tw_moe_forward(m[1], &tdo, &w, &tout2, &taux2);
    if (s == TW_OK && layers == 2) s = tw_moe_backward(m[1], &tdo, &w, &tx, r->d_aux, &tdx, &g);
    if (s == TW_OK) s = tw_moe_backward(m[0], &tx, &w, &tdo, r->d_aux, &tdx, &g);
  }
  if (s == TW_OK) {
    if (r->out) to_f32(r->out + Tl * H * shard, out, Tl * H, dt);
    if (r->dx) to_f32(r->dx + Tl * H * shard, dx, Tl * H, dt);
    if (rank == 0 && r->aux) r->aux[0] = aux;
    if (rank == 0 && r->dgate) memcpy(r->dgate, g_gate, sizeof(float) * (size_t)(H * E));
    if (dpc == 0) {
      if (r->dwi) memcpy(r->dwi + nle * H * 2 * F * epc, g_wi, sizeof(float) * (size_t)(nle * H * 2 * F));
      if (r->dwo) memcpy(r->dwo + nle * F * H * epc, g_wo, sizeof(float) * (size_t)(nle * F * H));
      if (r->bi && r->dbi) memcpy(r->dbi + nle * 2 * F * epc, g_bi, sizeof(float) * (size_t)(nle * 2 * F));
      if (r->bo && r->dbo) memcpy(r->dbo + nle * H * epc, g_bo, sizeof(float) * (size_t)(nle * H));
    }
  }
  for (int l = 0; l < 2; l++) tw_moe_destroy(m[l]);
  tw_ctx_destroy(ctx);
  free(x); free(gate); free(wi); free(wo); free(d_out); free(out); free(dx); free(out2);
  free(g_gate); free(g_wi); free(g_wo); free(g_bi); free(g_bo);
  if (s != TW_OK) tw_comm_abort(comm);
  return s;
}

tw_status tw_moe_run_threads(tw_moe_threads_run *r) {
  if (!r) return tw_error(TW_ERR_NULL, "moe_run_threads: run is NULL");
  int n = r->mesh.naxes ? tw_mesh_ranks(&r->mesh) : 1;
  if (n < 1 || r->T % n != 0)
    return tw_error(TW_ERR_INVALID_ARG, "moe_run_threads: T = %lld tokens do not split over %d ranks", (long long)r->T, n);
  if (r->mesh.naxes == 0) {
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
