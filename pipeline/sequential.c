/* The unpipelined model (the schedule's oracle): layers (r*S + s)*Lps + l in order, on one
 * rank, with the pipeline's row blocks and summation order so that the comparison can be
 * exact (tw_pipeline.h, "Determinism"). */
#include <stdlib.h>
#include <string.h>

#include "twin/tw_pipeline.h"

static tw_status cp(tw_ctx *ctx, float *dst, const float *src, int64_t n) {
  if (!n) return TW_OK;
  tw_mem mem = tw_ctx_mem(ctx);
  tw_tensor d = tw_tensor_1d(dst, TW_F32, n, mem), s = tw_tensor_1d((void *)src, TW_F32, n, mem);
  return tw_tensor_copy(ctx, &d, &s);
}

tw_status tw_pipeline_sequential_ref(tw_ctx *ctx, const tw_pipeline_config *cfg, int F,
                                     const tw_pipeline_body *body, const float *const *w, const float *x,
                                     float *y, const float *dy, float *dx, float *const *dw) {
  if (!ctx || !cfg || !body || !w || !x || !y) return tw_error(TW_ERR_NULL, "pipeline_sequential_ref: NULL argument");
  tw_mesh mesh;
  tw_axis ax[2] = {TW_AXIS_PP, TW_AXIS_FSDP};
  int sz[2] = {cfg->stages, F};
  TW_TRY(tw_mesh_init(&mesh, 2, ax, sz));
  TW_TRY(tw_pipeline_check(cfg, &mesh, body));
  if (dy && (!dx || !dw)) return tw_error(TW_ERR_NULL, "pipeline_sequential_ref: dy given without dx or dw");
  const int L = cfg->layers, M = cfg->microbatches;
  const int64_t rows = cfg->mb_rows / F, E = body->width, act = rows * E;
  int64_t P = 0, off[TW_PIPELINE_MAX_PARAMS];
  for (int i = 0; i < body->nparams; i++) { off[i] = P; P += body->param_rows[i] * body->param_cols[i]; }
  /* layer index = (r*S + s)*Lps + l, the same as parameter i's [R, S, Lps] flattening */
  float *xs = NULL, *g0 = NULL, *g1 = NULL, *gacc = NULL, *wl = NULL;
  void *scratch = NULL;
  size_t sb = body->scratch_bytes ? body->scratch_bytes(body, rows) : 0;
  tw_status st = tw_alloc(ctx, (size_t)(L + 1) * (size_t)act * sizeof(float), (void **)&xs);
  if (st == TW_OK) st = tw_alloc(ctx, (size_t)act * sizeof(float), (void **)&g0);
  if (st == TW_OK) st = tw_alloc(ctx, (size_t)act * sizeof(float), (void **)&g1);
  /* per row block f: the gradient of every layer, [F, L, P] (the fsdp ranks' windows) */
  if (st == TW_OK && dy) st = tw_alloc(ctx, (size_t)F * L * (size_t)P * sizeof(float), (void **)&gacc);
  if (st == TW_OK) st = tw_alloc(ctx, (size_t)L * (size_t)P * sizeof(float), (void **)&wl);
  if (st == TW_OK && sb) st = tw_alloc(ctx, sb, &scratch);
  if (st == TW_OK && gacc) st = tw_memset(ctx, gacc, 0, (size_t)F * L * (size_t)P * sizeof(float));
  /* weights repacked per layer as one [P] vector */
  for (int l = 0; l < L && st == TW_OK; l++)
    for (int i = 0; i < body->nparams; i++) {
      int64_t n = body->param_rows[i] * body->param_cols[i];
      if (st == TW_OK) st = cp(ctx, wl + l * P + off[i], w[i] + l * n, n);
    }
  /* microbatches in reverse: every weight gradient sums m = M-1 .. 0, as the scan does */
  for (int m = M - 1; m >= 0 && st == TW_OK; m--)
    for (int f = 0; f < F && st == TW_OK; f++) {
      const int64_t base = ((int64_t)m * cfg->mb_rows + f * rows) * E;
      st = cp(ctx, xs, x + base, act);
      for (int l = 0; l < L && st == TW_OK; l++) {
        tw_pipeline_params p;
        for (int i = 0; i < body->nparams; i++) p.p[i] = wl + l * P + off[i];
        st = body->forward(body, ctx, &p, xs + l * act, xs + (l + 1) * act, rows, scratch);
      }
      if (st == TW_OK) st = cp(ctx, y + base, xs + (int64_t)L * act, act);
      if (!dy || st != TW_OK) continue;
      const float *g = dy + base;
      for (int l = L - 1; l >= 0 && st == TW_OK; l--) {
        tw_pipeline_params p, dp;
        for (int i = 0; i < body->nparams; i++) {
          p.p[i] = wl + l * P + off[i];
          dp.p[i] = gacc + ((int64_t)f * L + l) * P + off[i];
        }
        float *dst = g == g0 ? g1 : g0;
        st = body->vjp(body, ctx, &p, xs + l * act, g, dst, &dp, rows, scratch);
        g = dst;
      }
      if (st == TW_OK) st = cp(ctx, dx + base, g, act);
    }
  /* the reduce-scatter's sum: block 0 + block 1 + ... */
  for (int l = 0; l < L && dy && st == TW_OK; l++)
    for (int i = 0; i < body->nparams; i++) {
      int64_t n = body->param_rows[i] * body->param_cols[i];
      float *dst = dw[i] + l * n;
      if (st == TW_OK) st = cp(ctx, dst, gacc + (int64_t)l * P + off[i], n);
      for (int f = 1; f < F && st == TW_OK; f++)
        st = tw_pipeline_add(ctx, dst, gacc + ((int64_t)f * L + l) * P + off[i], n);
    }
  if (xs) tw_free(ctx, xs);
  if (g0) tw_free(ctx, g0);
  if (g1) tw_free(ctx, g1);
  if (gacc) tw_free(ctx, gacc);
  if (wl) tw_free(ctx, wl);
  if (scratch) tw_free(ctx, scratch);
  return st;
}
