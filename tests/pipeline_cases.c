#include "tests/pipeline_cases.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/threads.h"
#include "tests/test_util.h"

static int key(const char *txt, const char *k) {
  char pat[32];
  snprintf(pat, sizeof pat, "\n%s = ", k);
  const char *p = strstr(txt, pat);
  cr_assert(p, "pipeline.txt lacks %s", k);
  return atoi(p + strlen(pat));
}

void pipe_golden_read(const char *dir, const char *cname, pipe_golden *g) {
  char txt[2048];
  tt_read_text(dir, "pipeline.txt", txt, sizeof txt);
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = key(txt, "S"); c.microbatches = key(txt, "M"); c.repeats = key(txt, "R"); c.delay = key(txt, "d");
  c.layers_per_stage = key(txt, "Lps");
  c.layers = c.stages * c.repeats * c.layers_per_stage;
  c.mb_rows = key(txt, "mb");
  c.fsdp = strstr(txt, "\nfsdp = bsw") ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  cr_assert(strstr(txt, "\nloss = half_sum_sq"), "%s: unknown loss", cname);
  g->cfg = c;
  g->F = key(txt, "F");
  g->E = key(txt, "E");
  g->H = key(txt, "H");
}

double pipe_golden_compare(const char *what, const char *cname, const float *got, const double *exact, int64_t n,
                           double k, int fail) {
  double ss = 0;
  for (int64_t i = 0; i < n; i++) ss += exact[i] * exact[i];
  double rms = sqrt(ss / (double)(n > 0 ? n : 1)), worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double bound = k * ldexp(1.0, -24) * (fabs(exact[i]) + rms);
    double err = fabs((double)got[i] - exact[i]);
    if (fail)
      cr_assert(err <= bound, "%s %s[%lld]: got %.9g, golden %.12g, |diff| %.3g > bound %.3g", cname, what,
                (long long)i, (double)got[i], exact[i], err, bound);
    if (err / bound > worst) worst = err / bound;
  }
  return worst;
}

void pipe_golden_load(const char *dir, const pipe_golden *g, const tw_pipeline_body *body, pipe_golden_io *io) {
  memset(io, 0, sizeof *io);
  io->na = tw_pipeline_act_elems(&g->cfg, body);
  for (int i = 0; i < 2; i++) io->nw[i] = tw_pipeline_param_elems(&g->cfg, body, i);
  io->x = (float *)tt_load_npy(dir, "x", TW_F32, io->na);
  io->tgt = (float *)tt_load_npy(dir, "tgt", TW_F32, io->na);
  io->w[0] = (float *)tt_load_npy(dir, "w1", TW_F32, io->nw[0]);
  io->w[1] = (float *)tt_load_npy(dir, "w2", TW_F32, io->nw[1]);
  io->y = (float *)calloc((size_t)io->na, 4);
  io->dy = (float *)calloc((size_t)io->na, 4);
  io->dx = (float *)calloc((size_t)io->na, 4);
  for (int i = 0; i < 2; i++) io->dw[i] = (float *)calloc((size_t)io->nw[i], 4);
}

void pipe_golden_io_free(pipe_golden_io *io) {
  free(io->x); free(io->tgt); free(io->y); free(io->dy); free(io->dx);
  for (int i = 0; i < 2; i++) { free(io->w[i]); free(io->dw[i]); }
  memset(io, 0, sizeof *io);
}

double pipe_golden_set_dy(pipe_golden_io *io) {
  double loss = 0;
  for (int64_t i = 0; i < io->na; i++) {
    io->dy[i] = io->y[i] - io->tgt[i];
    loss += 0.5 * (double)io->dy[i] * io->dy[i];
  }
  return loss;
}

double pipe_golden_check(const char *dir, const char *cname, const pipe_golden *g, const pipe_golden_io *io, double loss,
                         int fail) {
  double *gy = (double *)tt_load_npy(dir, "y", TW_F64, io->na), *gdx = (double *)tt_load_npy(dir, "dx", TW_F64, io->na);
  double *gloss = (double *)tt_load_npy(dir, "loss", TW_F64, 1);
  double *gdw[2] = {(double *)tt_load_npy(dir, "dw1", TW_F64, io->nw[0]),
                    (double *)tt_load_npy(dir, "dw2", TW_F64, io->nw[1])};
  const double L = g->cfg.layers;
  const double kf = L * (g->E + g->H + 8), kb = L * (g->E + g->H + 8 + (double)g->cfg.microbatches * g->cfg.mb_rows);
  const float lf = (float)loss;
  double r = 0;
  r = fmax(r, pipe_golden_compare("y", cname, io->y, gy, io->na, kf, fail));
  r = fmax(r, pipe_golden_compare("loss", cname, &lf, gloss, 1, 2 * kf, fail));
  r = fmax(r, pipe_golden_compare("dx", cname, io->dx, gdx, io->na, kb, fail));
  r = fmax(r, pipe_golden_compare("dW1", cname, io->dw[0], gdw[0], io->nw[0], kb, fail));
  r = fmax(r, pipe_golden_compare("dW2", cname, io->dw[1], gdw[1], io->nw[1], kb, fail));
  free(gy); free(gdx); free(gloss); free(gdw[0]); free(gdw[1]);
  return r;
}
