/* The stored MoE goldens (golden/gen_moe.py) for the tests: load a case, run it on some
 * runner (ref thread ranks by default), compare with the header's bound (tests/moe_cases.h). */
#include "tests/moe_cases.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static const char *keyval(const char *txt, const char *k) {
  char pat[40];
  snprintf(pat, sizeof pat, "\n%s = ", k);
  const char *p = strstr(txt, pat);
  cr_assert(p, "moe.txt lacks %s", k);
  return p + strlen(pat);
}
static int ikey(const char *txt, const char *k) { return atoi(keyval(txt, k)); }
static int skey(const char *txt, const char *k, const char *v) { return strncmp(keyval(txt, k), v, strlen(v)) == 0; }

int moe_g_fail = 1; /* 0: report the worst ratio without failing (the non-vacuity test) */
int moe_g_budget_recipe = -1;

/* worst |got - exact| / (k * unit * (|exact| + rms)); fails past 1 */
static double compare(const char *cname, const char *what, const float *got, const double *exact, int64_t n, double k,
                      double unit) {
  double ss = 0, worst = 0;
  for (int64_t i = 0; i < n; i++) ss += exact[i] * exact[i];
  double rms = sqrt(ss / (double)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) {
    double bound = k * unit * (fabs(exact[i]) + rms) + 1e-30, err = fabs((double)got[i] - exact[i]);
    if (moe_g_fail) cr_assert(err <= bound, "%s %s[%lld]: got %.9g, golden %.12g, |diff| %.3g > bound %.3g", cname, what, (long long)i,
              (double)got[i], exact[i], err, bound);
    if (err / bound > worst) worst = err / bound;
  }
  return worst;
}

void moe_load_case(const char *dir, gcase *c) {
  char txt[4096];
  tt_read_text(dir, "moe.txt", txt, sizeof txt);
  memset(c, 0, sizeof *c);
  tw_moe_config cfg = TW_MOE_CONFIG_INIT;
  c->T = ikey(txt, "T"); c->H = ikey(txt, "H"); c->F = ikey(txt, "F"); c->E = ikey(txt, "E");
  c->k = ikey(txt, "k"); c->bias = ikey(txt, "bias");
  cfg.num_experts = (int)c->E; cfg.hidden = c->H; cfg.ffn = c->F;
  cfg.router.topk = c->k;
  cfg.router.score = skey(txt, "score", "sigmoid") ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
  cfg.router.pre_softmax = ikey(txt, "pre_softmax");
  cfg.router.num_groups = ikey(txt, "num_groups");
  cfg.router.group_topk = ikey(txt, "group_topk");
  cfg.router.scaling_factor = (float)atof(keyval(txt, "scaling"));
  cfg.act = skey(txt, "act", "swiglu") ? TW_MOE_SWIGLU : skey(txt, "act", "geglu") ? TW_MOE_GEGLU : TW_MOE_BILINEAR;
  cfg.weighting = skey(txt, "weighting", "early") ? TW_MOE_WEIGHT_EARLY : TW_MOE_WEIGHT_LATE;
  cfg.aux_coeff = (float)atof(keyval(txt, "aux_coeff"));
  cfg.alignment = ikey(txt, "alignment");
  char rname[32] = "";
  sscanf(keyval(txt, "recipe"), "%31s", rname);
  cr_assert(tw_moe_recipe_from_name(rname, &cfg.recipe), "moe.txt: unknown recipe '%s'", rname);
  int64_t T = c->T, H = c->H, F = c->F, E = c->E;
  c->in[0] = tt_load_npy(dir, "x", TW_F32, T * H);
  c->in[1] = tt_load_npy(dir, "gate", TW_F32, H * E);
  c->in[2] = tt_load_npy(dir, "wi", TW_F32, E * H * 2 * F);
  c->in[3] = tt_load_npy(dir, "wo", TW_F32, E * F * H);
  if (c->bias) {
    c->in[4] = tt_load_npy(dir, "bi", TW_F32, E * 2 * F);
    c->in[5] = tt_load_npy(dir, "bo", TW_F32, E * H);
  }
  c->in[6] = tt_load_npy(dir, "d_out", TW_F32, T * H);
  if (ikey(txt, "expert_bias")) c->in[7] = tt_load_npy(dir, "expert_bias", TW_F32, E);
  const char *names[8] = {"out", "aux", "dx", "dgate", "dwi", "dwo", "dbi", "dbo"};
  int64_t sizes[8] = {T * H, 1, T * H, H * E, E * H * 2 * F, E * F * H, E * 2 * F, E * H};
  for (int i = 0; i < 8; i++)
    if (i < 6 || c->bias) c->g[i] = tt_load_npy(dir, names[i], TW_F64, sizes[i]);
  tw_moe_threads_run *r = &c->run;
  r->cfg = cfg;
  r->T = T;
  r->x = c->in[0]; r->gate = c->in[1]; r->wi = c->in[2]; r->wo = c->in[3]; r->bi = c->in[4]; r->bo = c->in[5];
  r->d_out = c->in[6]; r->expert_bias = c->in[7];
  r->d_aux = 1.0f;
  r->layers = 1;
}

void moe_free_case(gcase *c) {
  for (int i = 0; i < 8; i++) {
    free(c->in[i]);
    free(c->g[i]);
  }
}

/* Runs c on mesh (NULL: one rank) and compares with the golden; returns the worst ratio. */
double moe_check_case(gcase *c, const char *cname, const tw_mesh *mesh, moe_runner run_fn) {
  int64_t T = c->T, H = c->H, F = c->F, E = c->E;
  int64_t sizes[8] = {T * H, 1, T * H, H * E, E * H * 2 * F, E * F * H, E * 2 * F, E * H};
  float *o[8];
  for (int i = 0; i < 8; i++) o[i] = (float *)calloc((size_t)sizes[i], 4);
  tw_moe_threads_run r = c->run;
  if (mesh) r.mesh = *mesh;
  r.out = o[0]; r.aux = o[1]; r.dx = o[2]; r.dgate = o[3]; r.dwi = o[4]; r.dwo = o[5]; r.dbi = o[6]; r.dbo = o[7];
  tw_status s = run_fn ? run_fn(&r) : tw_moe_run_threads(&r);
  cr_assert_eq(s, TW_OK, "%s: %s", cname, tw_last_error());
  tw_moe_config bc = r.cfg;
  if (moe_g_budget_recipe >= 0) bc.recipe = (tw_moe_recipe)moe_g_budget_recipe;
  double kf = tw_moe_error_budget(&bc, T, 0), kb = tw_moe_error_budget(&bc, T, 1), unit = 1, worst = 0;
  const char *names[8] = {"out", "aux", "dx", "dgate", "dwi", "dwo", "dbi", "dbo"};
  for (int i = 0; i < 8; i++)
    if (c->g[i]) worst = fmax(worst, compare(cname, names[i], o[i], c->g[i], sizes[i], i < 2 ? kf : kb, unit));
  for (int i = 0; i < 8; i++) free(o[i]);
  return worst;
}

int moe_each_case(void (*fn)(const char *dir, const char *name)) {
  return tt_each_golden_case("moe", "golden/gen_moe.py", fn);
}
