/* The pipeline on ref thread ranks from global host tensors (pipeline/threads.h). */
#include "pipeline/threads.h"

#include "pipeline/loopback_comm.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* Host slices of this rank, moved into ctx memory for the run and back. */
static tw_status to_ctx(tw_ctx *ctx, const float *host, int64_t n, float **out) {
  *out = NULL;
  TW_TRY(tw_alloc(ctx, sizeof(float) * (size_t)(n > 0 ? n : 1), (void **)out));
  if (!n) return TW_OK;
  tw_tensor d = tw_tensor_1d(*out, TW_F32, n, tw_ctx_mem(ctx)), s = tw_tensor_1d((void *)host, TW_F32, n, TW_MEM_HOST);
  return tw_tensor_copy(ctx, &d, &s);
}
static tw_status to_host(tw_ctx *ctx, float *host, const float *dev, int64_t n) {
  if (!n) return TW_OK;
  tw_tensor d = tw_tensor_1d(host, TW_F32, n, TW_MEM_HOST), s = tw_tensor_1d((void *)dev, TW_F32, n, tw_ctx_mem(ctx));
  return tw_tensor_copy(ctx, &d, &s);
}

tw_status tw_pipeline_run_rank(tw_ctx *ctx, const tw_mesh *mesh, int rank, tw_pipeline_threads_run *g,
                               size_t *saved_bytes, size_t *window_bytes, double *step_s, size_t *peak_bytes) {
  const tw_pipeline_config *c = &g->cfg;
  const tw_pipeline_body *b = &g->body;
  const int s = tw_mesh_coord(mesh, rank, TW_AXIS_PP), f = tw_mesh_coord(mesh, rank, TW_AXIS_FSDP);
  const int S = c->stages, F = g->fsdp, mps = c->microbatches / S, R = c->repeats, Lps = c->layers_per_stage;
  const int64_t rows = c->mb_rows / F, E = b->width, act = rows * E, na = mps * act;
  tw_mesh_comms *mc = NULL;
  tw_status st = tw_mesh_comms_create(ctx, mesh, &mc);
  float *hx = (float *)malloc(sizeof(float) * (size_t)na), *hy = (float *)malloc(sizeof(float) * (size_t)na);
  float *hdy = (float *)malloc(sizeof(float) * (size_t)na), *hdx = (float *)malloc(sizeof(float) * (size_t)na);
  float *hw[TW_PIPELINE_MAX_PARAMS] = {0}, *hdw[TW_PIPELINE_MAX_PARAMS] = {0};
  float *x = NULL, *y = NULL, *dy = NULL, *dx = NULL;
  tw_pipeline_weights w;
  memset(&w, 0, sizeof w);
  if (st == TW_OK && (!hx || !hy || !hdy || !hdx)) st = tw_error(TW_ERR_MEMORY, "pipeline run: out of host memory");
  /* this rank's microbatches s*mps .. and row block f */
  for (int jm = 0; jm < mps && st == TW_OK; jm++) {
    int64_t src = ((int64_t)(s * mps + jm) * c->mb_rows + f * rows) * E;
    memcpy(hx + jm * act, g->x + src, sizeof(float) * (size_t)act);
    if (g->dy) memcpy(hdy + jm * act, g->dy + src, sizeof(float) * (size_t)act);
  }
  /* parameter shards [R, Lps, rows_i/F, cols_i] of stage s from the global [R, S, Lps, rows_i, cols_i] */
  for (int i = 0; i < b->nparams && st == TW_OK; i++) {
    int64_t full = b->param_rows[i] * b->param_cols[i], shard = full / F, n = (int64_t)R * Lps * shard;
    hw[i] = (float *)malloc(sizeof(float) * (size_t)n);
    hdw[i] = (float *)calloc((size_t)n, sizeof(float));
    if (!hw[i] || !hdw[i]) { st = tw_error(TW_ERR_MEMORY, "pipeline run: out of host memory"); break; }
    for (int r = 0; r < R; r++)
      for (int l = 0; l < Lps; l++)
        memcpy(hw[i] + ((int64_t)r * Lps + l) * shard, g->w[i] + (((int64_t)r * S + s) * Lps + l) * full + f * shard,
               sizeof(float) * (size_t)shard);
    float *dwi = NULL, *wi = NULL;
    st = to_ctx(ctx, hw[i], n, &wi);
    w.w[i] = wi;
    if (st == TW_OK) st = to_ctx(ctx, hdw[i], n, &dwi);
    w.dw[i] = dwi;
  }
  if (st == TW_OK) st = to_ctx(ctx, hx, na, &x);
  if (st == TW_OK) st = tw_alloc(ctx, sizeof(float) * (size_t)(na > 0 ? na : 1), (void **)&y);
  if (st == TW_OK && g->dy) st = to_ctx(ctx, hdy, na, &dy);
  if (st == TW_OK && g->dy) st = tw_alloc(ctx, sizeof(float) * (size_t)(na > 0 ? na : 1), (void **)&dx);
  tw_pipeline_saved *sv = NULL;
  struct timespec t0, t1;
  size_t inputs = 0, peak = 0;
  if (st == TW_OK) st = tw_ctx_sync(ctx);
  if (st == TW_OK) st = tw_ctx_reset_peak(ctx);
  if (st == TW_OK) st = tw_ctx_memory(ctx, &inputs, NULL);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  if (st == TW_OK) st = tw_pipeline_forward(ctx, mc, c, b, &w, x, y, g->dy ? &sv : NULL);
  if (st == TW_OK && g->dy) st = tw_pipeline_backward(ctx, mc, c, b, &w, sv, dy, dx);
  if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
  if (st == TW_OK) st = tw_ctx_sync(ctx);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (step_s) *step_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  if (st == TW_OK) st = tw_ctx_memory(ctx, NULL, &peak);
  if (peak_bytes) *peak_bytes = peak - inputs;
  if (st == TW_OK && sv) {
    if (saved_bytes) *saved_bytes = tw_pipeline_saved_size(sv);
    if (window_bytes) *window_bytes = tw_pipeline_peak_window_bytes(sv);
  }
  tw_pipeline_saved_free(ctx, sv);
  if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
  if (st == TW_OK) st = to_host(ctx, hy, y, na);
  if (st == TW_OK && g->dy) st = to_host(ctx, hdx, dx, na);
  for (int i = 0; i < b->nparams && st == TW_OK && g->dy; i++)
    st = to_host(ctx, hdw[i], w.dw[i], (int64_t)R * Lps * (b->param_rows[i] * b->param_cols[i] / F));
  if (st == TW_OK) st = tw_ctx_sync(ctx);
  for (int jm = 0; jm < mps && st == TW_OK; jm++) {
    int64_t dst = ((int64_t)(s * mps + jm) * c->mb_rows + f * rows) * E;
    if (g->y) memcpy(g->y + dst, hy + jm * act, sizeof(float) * (size_t)act);
    if (g->dy && g->dx) memcpy(g->dx + dst, hdx + jm * act, sizeof(float) * (size_t)act);
  }
  for (int i = 0; i < b->nparams && st == TW_OK && g->dy; i++) {
    int64_t full = b->param_rows[i] * b->param_cols[i], shard = full / F;
    if (!g->dw[i]) continue;
    for (int r = 0; r < R; r++)
      for (int l = 0; l < Lps; l++)
        memcpy(g->dw[i] + (((int64_t)r * S + s) * Lps + l) * full + f * shard, hdw[i] + ((int64_t)r * Lps + l) * shard,
               sizeof(float) * (size_t)shard);
  }
  for (int i = 0; i < b->nparams; i++) {
    if (w.w[i]) tw_free(ctx, (void *)w.w[i]);
    if (w.dw[i]) tw_free(ctx, w.dw[i]);
    free(hw[i]);
    free(hdw[i]);
  }
  if (x) tw_free(ctx, x);
  if (y) tw_free(ctx, y);
  if (dy) tw_free(ctx, dy);
  if (dx) tw_free(ctx, dx);
  free(hx); free(hy); free(hdy); free(hdx);
  tw_mesh_comms_destroy(mc);
  return st;
}

static tw_status rank_main(int rank, tw_comm *comm, void *arg) {
  job *j = (job *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_status st = tw_pipeline_run_rank(ctx, &j->mesh, rank, j->g, &j->saved[rank], &j->window[rank], NULL,
                                      j->g->rank_peak_bytes ? &j->g->rank_peak_bytes[rank] : NULL);
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
  if (st == TW_OK) st = g->loopback ? tw_comm_init_loopback(n, TW_MEM_HOST, comms) : tw_comm_init_threads(n, comms);
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
