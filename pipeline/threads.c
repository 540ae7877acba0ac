/* The pipeline on ref thread ranks from global host tensors (pipeline/threads.h). */
#include "pipeline/threads.h"

#include <stdlib.h>
#include <string.h>

int64_t tw_pipeline_act_elems(const tw_pipeline_config *c, const tw_pipeline_body *b) {
  return (int64_t)c->microbatches * c->mb_rows * b->width;
}
int64_t tw_pipeline_param_elems(const tw_pipeline_config *c, const tw_pipeline_body *b, int i) {
  return (int64_t)c->layers * b->param_rows[i] * b->param_cols[i];
}

typedef struct {
  tw_pipeline_threads_run *g;
  tw_mesh mesh;
  size_t saved[65536 / 64], window[65536 / 64];
} job;

static tw_status rank_main(int rank, tw_comm *comm, void *arg) {
  job *j = (job *)arg;
  tw_pipeline_threads_run *g = j->g;
  const tw_pipeline_config *c = &g->cfg;
  const tw_pipeline_body *b = &g->body;
  const int s = tw_mesh_coord(&j->mesh, rank, TW_AXIS_PP), f = tw_mesh_coord(&j->mesh, rank, TW_AXIS_FSDP);
  const int S = c->stages, F = g->fsdp, mps = c->microbatches / S, R = c->repeats, Lps = c->layers_per_stage;
  const int64_t rows = c->mb_rows / F, E = b->width, act = rows * E;
  tw_ctx *ctx = NULL;
  tw_mesh_comms *mc = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_status st = tw_mesh_comms_create(ctx, &j->mesh, &mc);
  float *x = (float *)malloc(sizeof(float) * (size_t)(mps * act));
  float *y = (float *)malloc(sizeof(float) * (size_t)(mps * act));
  float *dy = (float *)malloc(sizeof(float) * (size_t)(mps * act));
  float *dx = (float *)malloc(sizeof(float) * (size_t)(mps * act));
  tw_pipeline_weights w;
  memset(&w, 0, sizeof w);
  if (!x || !y || !dy || !dx) st = tw_error(TW_ERR_MEMORY, "pipeline threads: out of host memory");
  /* this rank's microbatches s*mps .. and row block f */
  for (int jm = 0; jm < mps && st == TW_OK; jm++) {
    int64_t src = ((int64_t)(s * mps + jm) * c->mb_rows + f * rows) * E;
    memcpy(x + jm * act, g->x + src, sizeof(float) * (size_t)act);
    if (g->dy) memcpy(dy + jm * act, g->dy + src, sizeof(float) * (size_t)act);
  }
  /* parameter shards [R, Lps, rows_i/F, cols_i] of stage s from the global [R, S, Lps, rows_i, cols_i] */
  for (int i = 0; i < b->nparams && st == TW_OK; i++) {
    int64_t full = b->param_rows[i] * b->param_cols[i], shard = full / F;
    float *ws = (float *)malloc(sizeof(float) * (size_t)(R * Lps * shard));
    float *dws = (float *)calloc((size_t)(R * Lps * shard), sizeof(float));
    w.w[i] = ws;
    w.dw[i] = dws;
    if (!ws || !dws) { st = tw_error(TW_ERR_MEMORY, "pipeline threads: out of host memory"); break; }
    for (int r = 0; r < R; r++)
      for (int l = 0; l < Lps; l++)
        memcpy(ws + ((int64_t)r * Lps + l) * shard, g->w[i] + (((int64_t)r * S + s) * Lps + l) * full + f * shard,
               sizeof(float) * (size_t)shard);
  }
  tw_pipeline_saved *sv = NULL;
  if (st == TW_OK) st = tw_pipeline_forward(ctx, mc, c, b, &w, x, y, g->dy ? &sv : NULL);
  if (st == TW_OK && g->dy) st = tw_pipeline_backward(ctx, mc, c, b, &w, sv, dy, dx);
  if (st == TW_OK && sv) {
    j->saved[rank] = tw_pipeline_saved_size(sv);
    j->window[rank] = tw_pipeline_peak_window_bytes(sv);
  }
  tw_pipeline_saved_free(ctx, sv);
  if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
  for (int jm = 0; jm < mps && st == TW_OK; jm++) {
    int64_t dst = ((int64_t)(s * mps + jm) * c->mb_rows + f * rows) * E;
    if (g->y) memcpy(g->y + dst, y + jm * act, sizeof(float) * (size_t)act);
    if (g->dy && g->dx) memcpy(g->dx + dst, dx + jm * act, sizeof(float) * (size_t)act);
  }
  for (int i = 0; i < b->nparams && st == TW_OK && g->dy; i++) {
    int64_t full = b->param_rows[i] * b->param_cols[i], shard = full / F;
    if (!g->dw[i]) continue;
    for (int r = 0; r < R; r++)
      for (int l = 0; l < Lps; l++)
        memcpy(g->dw[i] + (((int64_t)r * S + s) * Lps + l) * full + f * shard, w.dw[i] + ((int64_t)r * Lps + l) * shard,
               sizeof(float) * (size_t)shard);
  }
  for (int i = 0; i < b->nparams; i++) { free((void *)w.w[i]); free(w.dw[i]); }
  free(x); free(y); free(dy); free(dx);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return st;
}

tw_status tw_pipeline_run_threads(tw_pipeline_threads_run *g) {
  if (!g || !g->x) return tw_error(TW_ERR_NULL, "pipeline threads: run or x is NULL");
  job *j = (job *)calloc(1, sizeof *j);
  if (!j) return tw_error(TW_ERR_MEMORY, "pipeline threads: out of host memory");
  j->g = g;
  tw_axis ax[2] = {TW_AXIS_PP, TW_AXIS_FSDP};
  int sz[2] = {g->cfg.stages, g->fsdp};
  tw_status st = tw_mesh_init(&j->mesh, 2, ax, sz);
  if (st == TW_OK) st = tw_pipeline_check(&g->cfg, &j->mesh, &g->body);
  int n = st == TW_OK ? tw_mesh_ranks(&j->mesh) : 0;
  if (st == TW_OK && n > (int)(sizeof j->saved / sizeof j->saved[0]))
    st = tw_error(TW_ERR_UNSUPPORTED, "pipeline threads: %d ranks is too many threads", n);
  tw_comm **comms = st == TW_OK ? (tw_comm **)calloc((size_t)n, sizeof *comms) : NULL;
  if (st == TW_OK && !comms) st = tw_error(TW_ERR_MEMORY, "pipeline threads: out of host memory");
  if (st == TW_OK) st = tw_comm_init_threads(n, comms);
  if (st == TW_OK) {
    for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], g->timeout_s > 0 ? g->timeout_s : 30);
    st = tw_run_ranks(n, comms, rank_main, j);
    for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  }
  g->saved_bytes = g->window_bytes = 0;
  for (int i = 0; i < n; i++) {
    if (j->saved[i] > g->saved_bytes) g->saved_bytes = j->saved[i];
    if (j->window[i] > g->window_bytes) g->window_bytes = j->window[i];
  }
  free(comms);
  free(j);
  return st;
}
