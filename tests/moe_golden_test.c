/* The MoE block on ref against the independent goldens of golden/gen_moe.py (the block written
 * densely in JAX, f64, jax.grad): out, aux, dx and every weight gradient, for each activation,
 * both weightings, k = 1 and k = E, softmax pre/post, sigmoid with expert bias, group-limited
 * top-k, idle experts, padded slabs, biases on and off, and the bf16 recipe.
 *
 * Bound (include/twin/tw_moe.h, "Error budget"): F32 within K u (|exact| + rms(exact)), u =
 * 2^-24, K = H + 2F + k + 16 forward (the GEMM sums over H, 2F via F, the k-term combine and
 * the elementwise roundings) and K + E + T for gradients (the d_logits @ gate^T sum over E and
 * the weight-gradient sums over T tokens); BF16 within 8 * 2^-8 (|exact| + rms) forward and
 * 16 * 2^-8 for gradients. Each case logs its worst |diff|/bound. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/threads.h"
#include "test_util.h"
#include "twin/tw_npy.h"

static const char *keyval(const char *txt, const char *k) {
  char pat[40];
  snprintf(pat, sizeof pat, "\n%s = ", k);
  const char *p = strstr(txt, pat);
  cr_assert(p, "moe.txt lacks %s", k);
  return p + strlen(pat);
}
static int ikey(const char *txt, const char *k) { return atoi(keyval(txt, k)); }
static int skey(const char *txt, const char *k, const char *v) { return strncmp(keyval(txt, k), v, strlen(v)) == 0; }

static void *load(const char *dir, const char *name, tw_dtype want, int64_t n) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s.npy", dir, name);
  tw_tensor t;
  cr_assert_eq(tw_npy_load(path, &t), TW_OK, "%s: %s", path, tw_last_error());
  cr_assert_eq(t.dtype, want, "%s: dtype", path);
  cr_assert_eq(tw_tensor_numel(&t), n, "%s: %lld elements, want %lld", path, (long long)tw_tensor_numel(&t), (long long)n);
  return t.data;
}

static int g_fail = 1; /* 0: report the worst ratio without failing (the non-vacuity test) */

/* worst |got - exact| / (k * unit * (|exact| + rms)); fails past 1 */
static double compare(const char *cname, const char *what, const float *got, const double *exact, int64_t n, double k,
                      double unit) {
  double ss = 0, worst = 0;
  for (int64_t i = 0; i < n; i++) ss += exact[i] * exact[i];
  double rms = sqrt(ss / (double)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) {
    double bound = k * unit * (fabs(exact[i]) + rms) + 1e-30, err = fabs((double)got[i] - exact[i]);
    if (g_fail) cr_assert(err <= bound, "%s %s[%lld]: got %.9g, golden %.12g, |diff| %.3g > bound %.3g", cname, what, (long long)i,
              (double)got[i], exact[i], err, bound);
    if (err / bound > worst) worst = err / bound;
  }
  return worst;
}

typedef struct {
  tw_moe_threads_run run;
  int64_t T, H, F, E;
  int k, bias;
  double *g[8]; /* out aux dx dgate dwi dwo dbi dbo */
  float *in[8]; /* x gate wi wo bi bo d_out expert_bias */
} gcase;

static void load_case(const char *dir, gcase *c) {
  char path[1200], txt[4096] = "\n";
  snprintf(path, sizeof path, "%s/moe.txt", dir);
  FILE *f = fopen(path, "r");
  cr_assert(f, "%s", path);
  size_t got = fread(txt + 1, 1, sizeof txt - 2, f);
  txt[got + 1] = 0;
  fclose(f);
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
  cfg.recipe = skey(txt, "recipe", "bf16") ? TW_MOE_BF16 : TW_MOE_F32;
  int64_t T = c->T, H = c->H, F = c->F, E = c->E;
  c->in[0] = load(dir, "x", TW_F32, T * H);
  c->in[1] = load(dir, "gate", TW_F32, H * E);
  c->in[2] = load(dir, "wi", TW_F32, E * H * 2 * F);
  c->in[3] = load(dir, "wo", TW_F32, E * F * H);
  if (c->bias) {
    c->in[4] = load(dir, "bi", TW_F32, E * 2 * F);
    c->in[5] = load(dir, "bo", TW_F32, E * H);
  }
  c->in[6] = load(dir, "d_out", TW_F32, T * H);
  if (ikey(txt, "expert_bias")) c->in[7] = load(dir, "expert_bias", TW_F32, E);
  const char *names[8] = {"out", "aux", "dx", "dgate", "dwi", "dwo", "dbi", "dbo"};
  int64_t sizes[8] = {T * H, 1, T * H, H * E, E * H * 2 * F, E * F * H, E * 2 * F, E * H};
  for (int i = 0; i < 8; i++)
    if (i < 6 || c->bias) c->g[i] = load(dir, names[i], TW_F64, sizes[i]);
  tw_moe_threads_run *r = &c->run;
  r->cfg = cfg;
  r->T = T;
  r->x = c->in[0]; r->gate = c->in[1]; r->wi = c->in[2]; r->wo = c->in[3]; r->bi = c->in[4]; r->bo = c->in[5];
  r->d_out = c->in[6]; r->expert_bias = c->in[7];
  r->d_aux = 1.0f;
  r->layers = 1;
}

static void free_case(gcase *c) {
  for (int i = 0; i < 8; i++) {
    free(c->in[i]);
    free(c->g[i]);
  }
}

/* Runs c on mesh (NULL: one rank) and compares with the golden; returns the worst ratio. */
static double check_case(gcase *c, const char *cname, const tw_mesh *mesh) {
  int64_t T = c->T, H = c->H, F = c->F, E = c->E;
  int64_t sizes[8] = {T * H, 1, T * H, H * E, E * H * 2 * F, E * F * H, E * 2 * F, E * H};
  float *o[8];
  for (int i = 0; i < 8; i++) o[i] = (float *)calloc((size_t)sizes[i], 4);
  tw_moe_threads_run r = c->run;
  if (mesh) r.mesh = *mesh;
  r.out = o[0]; r.aux = o[1]; r.dx = o[2]; r.dgate = o[3]; r.dwi = o[4]; r.dwo = o[5]; r.dbi = o[6]; r.dbo = o[7];
  tw_status s = tw_moe_run_threads(&r);
  cr_assert_eq(s, TW_OK, "%s: %s", cname, tw_last_error());
  int bf16 = r.cfg.recipe == TW_MOE_BF16;
  double kf = bf16 ? 8 : (double)(H + 2 * F + c->k + 16), kb = bf16 ? 16 : kf + (double)(E + T);
  double unit = bf16 ? ldexp(1, -8) : ldexp(1, -24), worst = 0;
  const char *names[8] = {"out", "aux", "dx", "dgate", "dwi", "dwo", "dbi", "dbo"};
  for (int i = 0; i < 8; i++)
    if (c->g[i]) worst = fmax(worst, compare(cname, names[i], o[i], c->g[i], sizes[i], i < 2 ? kf : kb, unit));
  for (int i = 0; i < 8; i++) free(o[i]);
  return worst;
}

static int each_case(void (*fn)(const char *dir, const char *name)) {
  char root[1024];
  snprintf(root, sizeof root, "%s/moe", tt_golden_root());
  DIR *d = opendir(root);
  cr_assert(d, "no goldens at %s (python3 golden/gen_moe.py)", root);
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char dir[1300];
    snprintf(dir, sizeof dir, "%s/%s", root, e->d_name);
    fn(dir, e->d_name);
    n++;
  }
  closedir(d);
  return n;
}

static void one_rank(const char *dir, const char *name) {
  gcase c;
  load_case(dir, &c);
  double w = check_case(&c, name, NULL);
  cr_log_info("moe golden %s: worst |diff|/bound %.3g", name, w);
  free_case(&c);
}

Test(moe_golden, every_stored_case_on_one_rank) { cr_assert_geq(each_case(one_rank), 13); }

/* The same goldens with the block sharded over thread ranks: every mesh of dp and ep that
 * divides the case (T % ranks, E % ep), up to 8 ranks. */
static void sharded(const char *dir, const char *name) {
  gcase c;
  load_case(dir, &c);
  static const int meshes[][2] = {{1, 2}, {2, 1}, {1, 4}, {2, 2}, {4, 1}, {1, 8}, {2, 4}, {4, 2}};
  int ran = 0;
  for (size_t i = 0; i < sizeof meshes / sizeof *meshes; i++) {
    int dp = meshes[i][0], ep = meshes[i][1];
    if (c.T % (dp * ep) != 0 || c.E % ep != 0) continue;
    tw_mesh m;
    tw_axis ax[2] = {TW_AXIS_DP, TW_AXIS_EP};
    int sz[2] = {dp, ep};
    cr_assert_eq(tw_mesh_init(&m, 2, ax, sz), TW_OK);
    char cname[300];
    snprintf(cname, sizeof cname, "%s dp=%d,ep=%d", name, dp, ep);
    double w = check_case(&c, cname, &m);
    cr_log_info("moe golden %s: worst |diff|/bound %.3g", cname, w);
    ran++;
  }
  cr_log_info("moe golden %s: %d meshes", name, ran);
  free_case(&c);
}

Test(moe_golden, every_stored_case_sharded_over_dp_and_ep) { cr_assert_geq(each_case(sharded), 13); }

/* The goldens are not vacuous: the block with the other weighting, without its biases, or
 * with another activation is far outside the bound. */
Test(moe_golden, a_wrong_block_is_caught) {
  char dir[1200];
  snprintf(dir, sizeof dir, "%s/moe/swiglu_early", tt_golden_root());
  gcase c;
  load_case(dir, &c);
  g_fail = 0;
  c.run.cfg.weighting = TW_MOE_WEIGHT_LATE;
  double w1 = check_case(&c, "late instead of early", NULL);
  c.run.cfg.weighting = TW_MOE_WEIGHT_EARLY;
  c.run.cfg.act = TW_MOE_GEGLU;
  double w2 = check_case(&c, "geglu instead of swiglu", NULL);
  c.run.cfg.act = TW_MOE_SWIGLU;
  c.run.d_aux = 0;
  double w3 = check_case(&c, "aux loss left out of the backward", NULL);
  c.run.d_aux = 1;
  double w4 = check_case(&c, "the right block", NULL);
  g_fail = 1;
  cr_assert_gt(w1, 100, "the wrong weighting went unnoticed (%g)", w1);
  cr_assert_gt(w2, 100, "the wrong activation went unnoticed (%g)", w2);
  cr_assert_gt(w3, 10, "a backward without the aux loss went unnoticed (%g)", w3);
  cr_assert_leq(w4, 1, "the right block is outside the bound (%g)", w4);
  free_case(&c);
}
