/* The pipeline on ref thread ranks (pp x fsdp, up to 16 ranks) against the unpipelined model
 * run with the same row blocks (tw_pipeline_sequential_ref): forward y, dx and dW bit for
 * bit where the summation order is the same (every case but plain FSDP with F > 1, whose dW
 * reduce-scatters every microbatch: checked within the bound derived below), for every
 * configuration of spec §6 items 1-8, plus the backward against finite differences. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/threads.h"
#include "test_util.h"
#include "twin/tw_pipeline.h"

typedef struct {
  int S, M, R, d, Lps, F, bsw;
} pcase;

typedef struct {
  tw_pipeline_threads_run run;
  int64_t nact, nw[2];
  float *x, *dy, *w[2];
  float *y, *dx, *dw[2];          /* pipeline */
  float *ry, *rdx, *rdw[2];       /* unpipelined */
} problem;

static float *fvec(int64_t n) {
  float *p = (float *)calloc((size_t)n, sizeof(float));
  cr_assert(p);
  return p;
}

static void problem_make(problem *p, pcase k, int64_t E, int64_t H, int64_t mb, uint64_t seed) {
  memset(p, 0, sizeof *p);
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = k.S; c.microbatches = k.M; c.repeats = k.R; c.delay = k.d; c.layers_per_stage = k.Lps;
  c.layers = k.S * k.R * k.Lps;
  c.mb_rows = mb;
  c.fsdp = k.bsw ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  p->run.cfg = c;
  p->run.fsdp = k.F;
  cr_assert_eq(tw_pipeline_dense_body(E, H, &p->run.body), TW_OK);
  p->nact = tw_pipeline_act_elems(&c, &p->run.body);
  p->x = fvec(p->nact); p->dy = fvec(p->nact);
  p->y = fvec(p->nact); p->dx = fvec(p->nact); p->ry = fvec(p->nact); p->rdx = fvec(p->nact);
  tt_fill_uniform_f32(p->x, p->nact, seed, -1, 1);
  tt_fill_uniform_f32(p->dy, p->nact, seed + 1, -1, 1);
  for (int i = 0; i < 2; i++) {
    p->nw[i] = tw_pipeline_param_elems(&c, &p->run.body, i);
    p->w[i] = fvec(p->nw[i]); p->dw[i] = fvec(p->nw[i]); p->rdw[i] = fvec(p->nw[i]);
    float a = (float)(1.0 / sqrt((double)p->run.body.param_rows[i]));
    tt_fill_uniform_f32(p->w[i], p->nw[i], seed + 2 + (uint64_t)i, -a, a);
  }
  p->run.x = p->x; p->run.dy = p->dy; p->run.y = p->y; p->run.dx = p->dx;
  for (int i = 0; i < 2; i++) { p->run.w[i] = p->w[i]; p->run.dw[i] = p->dw[i]; }
}

static void problem_free(problem *p) {
  free(p->x); free(p->dy); free(p->y); free(p->dx); free(p->ry); free(p->rdx);
  for (int i = 0; i < 2; i++) { free(p->w[i]); free(p->dw[i]); free(p->rdw[i]); }
}

static void run_sequential(problem *p) {
  tw_ctx *ctx = tt_ref_ctx();
  const float *w[2] = {p->w[0], p->w[1]};
  float *dw[2] = {p->rdw[0], p->rdw[1]};
  cr_assert_eq(tw_pipeline_sequential_ref(ctx, &p->run.cfg, p->run.fsdp, &p->run.body, w, p->x, p->ry, p->dy, p->rdx, dw),
               TW_OK, "%s", tw_last_error());
  tw_ctx_destroy(ctx);
}

static void expect_same_bits(const char *what, const char *tag, const float *got, const float *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
      cr_assert_fail("%s %s: element %lld is %.9g, unpipelined %.9g (first of the differences)", tag, what,
                     (long long)i, (double)got[i], (double)want[i]);
}

/* Plain FSDP, F > 1: each microbatch's f32 gradient is reduce-scattered and the shards are
 * added, against the window sum reduce-scattered once: the same n = M*F f32 terms summed in
 * two orders, so |diff| <= 2 (n - 1) u sum|terms| <= 2 n^2 u max|term|, and max|term| is at
 * most the largest per-microbatch gradient, itself at most the largest |dW| element times n
 * (taken loosely: the terms are of one sign-free size). Stated as 2 n^2 u * n * max|dW|. */
static void expect_within_reassociation(const char *tag, const float *got, const float *want, int64_t n, int terms) {
  double mx = 0;
  for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs((double)want[i]));
  double tol = 2.0 * terms * terms * (double)terms * ldexp(1.0, -24) * mx;
  for (int64_t i = 0; i < n; i++)
    cr_assert(fabs((double)got[i] - want[i]) <= tol, "%s dW: element %lld is %.9g, unpipelined %.9g, bound %.3g", tag,
              (long long)i, (double)got[i], (double)want[i], tol);
}

static void check_against_unpipelined_on(pcase k, int64_t E, int64_t H, int64_t mb, int loopback) {
  char tag[112];
  snprintf(tag, sizeof tag, "S=%d M=%d R=%d d=%d Lps=%d F=%d %s%s", k.S, k.M, k.R, k.d, k.Lps, k.F, k.bsw ? "bsw" : "plain",
           loopback ? " (loopback comm)" : "");
  problem p;
  problem_make(&p, k, E, H, mb, 1000 + (uint64_t)(k.S * 131 + k.M * 17 + k.R * 7 + k.d * 3 + k.Lps + k.F * 5 + k.bsw));
  p.run.loopback = loopback;
  size_t peak[64] = {0};
  cr_assert(k.S * k.F <= 64);
  p.run.rank_peak_bytes = peak;
  tw_status s = tw_pipeline_run_threads(&p.run);
  cr_assert_eq(s, TW_OK, "%s: %s: %s", tag, tw_status_name(s), tw_last_error());
  run_sequential(&p);
  expect_same_bits("y", tag, p.y, p.ry, p.nact);
  expect_same_bits("dx", tag, p.dx, p.rdx, p.nact);
  for (int i = 0; i < 2; i++) {
    if (k.bsw || k.F == 1) expect_same_bits(i ? "dW2" : "dW1", tag, p.dw[i], p.rdw[i], p.nw[i]);
    else expect_within_reassociation(tag, p.dw[i], p.rdw[i], p.nw[i], k.M * k.F);
  }
  /* the light state a rank keeps: M*R microbatch blocks, nothing else */
  cr_assert_eq(p.run.saved_bytes, tw_pipeline_saved_bytes(&p.run.cfg, &p.run.body, k.F), "%s", tag);
  cr_assert_eq(p.run.window_bytes, tw_pipeline_window_bytes(&p.run.cfg, &p.run.body, k.F), "%s", tag);
  /* everything a rank allocates beyond its inputs, to the byte (its context's ledger) */
  tw_mesh mesh;
  tw_axis ax[2] = {TW_AXIS_PP, TW_AXIS_FSDP};
  int sz[2] = {k.S, k.F};
  cr_assert_eq(tw_mesh_init(&mesh, 2, ax, sz), TW_OK);
  for (int r = 0; r < k.S * k.F; r++) {
    int stage = tw_mesh_coord(&mesh, r, TW_AXIS_PP);
    size_t want = tw_pipeline_peak_bytes(&p.run.cfg, &p.run.body, k.F, stage);
    cr_assert_eq(peak[r], want, "%s: rank %d (stage %d) held %zu bytes at its peak beyond its inputs, "
                 "tw_pipeline_peak_bytes says %zu", tag, r, stage, peak[r], want);
  }
  problem_free(&p);
}

static void check_against_unpipelined(pcase k, int64_t E, int64_t H, int64_t mb) {
  check_against_unpipelined_on(k, E, H, mb, 0);
}

/* §6 items 1-7 (plain path), each also with fsdp = 2 where F is 1 in the spec */
Test(pipeline_vs_unpipelined, item1_smallest) { check_against_unpipelined((pcase){2, 2, 1, 1, 1, 1, 0}, 8, 12, 4); }
Test(pipeline_vs_unpipelined, item2_non_circular) {
  check_against_unpipelined((pcase){4, 4, 1, 1, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){4, 8, 1, 1, 1, 2, 0}, 8, 12, 4);
}
Test(pipeline_vs_unpipelined, item3_rotate_path) {
  check_against_unpipelined((pcase){2, 2, 2, 1, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){4, 4, 2, 1, 1, 2, 0}, 8, 12, 4);
}
Test(pipeline_vs_unpipelined, item4_circ_storage) {
  check_against_unpipelined((pcase){2, 4, 2, 1, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){4, 8, 2, 1, 1, 2, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){3, 6, 2, 1, 1, 1, 0}, 8, 12, 4);
}
Test(pipeline_vs_unpipelined, item5_output_roll) {
  check_against_unpipelined((pcase){2, 6, 2, 1, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){4, 8, 3, 1, 1, 1, 0}, 8, 12, 4);
}
Test(pipeline_vs_unpipelined, item6_delay_2) {
  check_against_unpipelined((pcase){4, 8, 2, 2, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){2, 4, 2, 2, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){3, 9, 2, 2, 1, 2, 0}, 8, 12, 4); /* circ with d = 2 */
}
Test(pipeline_vs_unpipelined, item7_two_layers_per_stage) {
  check_against_unpipelined((pcase){2, 4, 2, 1, 2, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){2, 4, 2, 1, 3, 2, 0}, 8, 12, 4);
}
Test(pipeline_vs_unpipelined, five_stages_and_one_stage) {
  check_against_unpipelined((pcase){5, 10, 2, 1, 1, 1, 0}, 8, 12, 4);
  check_against_unpipelined((pcase){1, 3, 2, 1, 1, 2, 0}, 8, 12, 4);
}
/* §6 item 8: BSW with F in {1, 2, 4}; S >= 3 is where MaxText's window is wrong */
static void bsw_all_f(int S, int M, int R) {
  for (int F = 1; F <= 4; F *= 2) check_against_unpipelined((pcase){S, M, R, 1, 1, F, 1}, 8, 12, 8);
}
Test(pipeline_vs_unpipelined, item8_bsw_2_8_4) { bsw_all_f(2, 8, 4); }
Test(pipeline_vs_unpipelined, item8_bsw_3_6_2) { bsw_all_f(3, 6, 2); }
Test(pipeline_vs_unpipelined, item8_bsw_4_4_2) { bsw_all_f(4, 4, 2); }
Test(pipeline_vs_unpipelined, item8_bsw_4_8_3) { bsw_all_f(4, 8, 3); }
Test(pipeline_vs_unpipelined, plain_fsdp_4_on_16_ranks) { check_against_unpipelined((pcase){4, 8, 2, 1, 1, 4, 0}, 8, 12, 8); }
Test(pipeline_vs_unpipelined, bsw_5_stages) { check_against_unpipelined((pcase){5, 5, 3, 1, 1, 2, 1}, 8, 12, 4); }

/* The loopback communicator (what lets one GPU play S stages) gives the same bits as the
 * thread communicator: checked here on host memory. */
Test(pipeline_vs_unpipelined, loopback_communicator) {
  check_against_unpipelined_on((pcase){3, 6, 2, 1, 1, 2, 1}, 8, 12, 4, 1);
  check_against_unpipelined_on((pcase){4, 8, 2, 2, 1, 2, 0}, 8, 12, 4, 1);
  check_against_unpipelined_on((pcase){2, 4, 2, 1, 2, 1, 0}, 8, 12, 4, 1);
}

/* ---- the §4.3 defect: MaxText's window, forced, gives wrong results for S >= 3 ---------- */
static double max_diff(const float *a, const float *b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
  return m;
}

static void stale_window(int S, int M, int R, int F, int expect_wrong) {
  problem p;
  problem_make(&p, (pcase){S, M, R, 1, 1, F, 1}, 8, 12, 4, 77);
  p.run.cfg.test_stale_window = 1;
  cr_assert_eq(tw_pipeline_run_threads(&p.run), TW_OK, "%s", tw_last_error());
  run_sequential(&p);
  double dy = max_diff(p.y, p.ry, p.nact), dw = max_diff(p.dw[0], p.rdw[0], p.nw[0]);
  if (expect_wrong)
    cr_assert(dy > 1e-3 && dw > 1e-3, "S=%d: the stale window went unnoticed (|dy| %g, |dW1| %g)", S, dy, dw);
  else
    cr_assert(dy == 0 && dw == 0, "S=%d: MaxText's window is right for S <= 2 (|dy| %g, |dW1| %g)", S, dy, dw);
  problem_free(&p);
}
Test(pipeline_bsw_defect, maxtext_window_fails_s3) { stale_window(3, 6, 2, 2, 1); }
Test(pipeline_bsw_defect, maxtext_window_fails_s4) { stale_window(4, 8, 3, 1, 1); }
Test(pipeline_bsw_defect, maxtext_window_passes_s2) { stale_window(2, 8, 4, 2, 0); }

/* ---- finite differences: the VJP against the forward -------------------------------- */
/* L = sum(dy * y) (so dL/dy = dy). Central differences in f32 with step h on a few
 * coordinates: truncation h^2 |L'''| / 6 and rounding ~ u |sum |dy*y|| / h; with h = 1e-2
 * both stay below 2e-3 here, so tol = 5e-3 + 1e-2 |g|. */
static double loss_of(problem *p) {
  const float *save_dy = p->run.dy;
  p->run.dy = NULL;
  cr_assert_eq(tw_pipeline_run_threads(&p->run), TW_OK, "%s", tw_last_error());
  p->run.dy = save_dy;
  double L = 0;
  for (int64_t i = 0; i < p->nact; i++) L += (double)p->dy[i] * p->y[i];
  return L;
}

static void finite_differences(pcase k) {
  problem p;
  problem_make(&p, k, 8, 12, 4, 4242);
  cr_assert_eq(tw_pipeline_run_threads(&p.run), TW_OK, "%s", tw_last_error());
  float *gx = fvec(p.nact), *gw[2] = {fvec(p.nw[0]), fvec(p.nw[1])};
  memcpy(gx, p.dx, sizeof(float) * (size_t)p.nact);
  for (int i = 0; i < 2; i++) memcpy(gw[i], p.dw[i], sizeof(float) * (size_t)p.nw[i]);
  const float h = 1e-2f;
  uint64_t st = 99;
  for (int probe = 0; probe < 12; probe++) {
    int which = probe % 3; /* x, W1, W2 */
    float *v = which == 0 ? p.x : p.w[which - 1];
    int64_t n = which == 0 ? p.nact : p.nw[which - 1];
    int64_t idx = (int64_t)(tt_rand_u64(&st) % (uint64_t)n);
    double g = which == 0 ? gx[idx] : gw[which - 1][idx];
    float keep = v[idx];
    v[idx] = keep + h;
    double lp = loss_of(&p);
    v[idx] = keep - h;
    double lm = loss_of(&p);
    v[idx] = keep;
    double fd = (lp - lm) / (2.0 * (double)h);
    cr_assert(fabs(fd - g) <= 5e-3 + 1e-2 * fabs(g), "%s[%lld]: VJP %.6g, finite difference %.6g",
              which == 0 ? "x" : which == 1 ? "W1" : "W2", (long long)idx, g, fd);
  }
  free(gx); free(gw[0]); free(gw[1]);
  problem_free(&p);
}
Test(pipeline_finite_differences, circ_fsdp2) { finite_differences((pcase){3, 6, 2, 1, 1, 2, 0}); }
Test(pipeline_finite_differences, bsw_s4) { finite_differences((pcase){4, 4, 2, 1, 1, 2, 1}); }
Test(pipeline_finite_differences, delay2_lps2) { finite_differences((pcase){2, 4, 2, 2, 2, 1, 0}); }

/* ---- errors at run time: reported by every rank, none hangs ------------------------ */
Test(pipeline_run_errors, bad_config_is_a_status_not_a_hang) {
  problem p;
  problem_make(&p, (pcase){2, 4, 2, 1, 1, 1, 0}, 8, 12, 4, 5);
  p.run.cfg.layers = 5;
  tw_status s = tw_pipeline_run_threads(&p.run);
  cr_assert_eq(s, TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "pipeline.layers"), "%s", tw_last_error());
  problem_free(&p);
}

Test(pipeline_run_errors, backward_checks_the_saved_state) {
  tw_ctx *ctx = tt_ref_ctx();
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse("pp=1", &m), TW_OK);
  tw_mesh_comms *mc = NULL;
  cr_assert_eq(tw_mesh_comms_create(ctx, &m, &mc), TW_OK, "%s", tw_last_error());
  tw_pipeline_body b;
  cr_assert_eq(tw_pipeline_dense_body(4, 4, &b), TW_OK);
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.microbatches = 2; c.mb_rows = 2;
  float w1[16] = {0}, w2[16] = {0}, d1[16] = {0}, d2[16] = {0}, x[16] = {0}, y[16];
  tw_pipeline_weights w = {{w1, w2}, {d1, d2}};
  tw_pipeline_saved *sv = NULL;
  cr_assert_eq(tw_pipeline_forward(ctx, mc, &c, &b, &w, x, y, &sv), TW_OK, "%s", tw_last_error());
  c.microbatches = 1; /* a different configuration than the forward's */
  tw_status s = tw_pipeline_backward(ctx, mc, &c, &b, &w, sv, x, y);
  cr_assert_eq(s, TW_ERR_INVALID_ARG, "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "saved state holds 64 bytes, this configuration needs 32"), "%s", tw_last_error());
  cr_assert_eq(tw_pipeline_backward(ctx, mc, &c, &b, &w, NULL, x, y), TW_ERR_NULL);
  tw_pipeline_saved_free(ctx, sv);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
}

Test(pipeline_run_errors, a_mesh_without_pp_is_refused_at_run_time) {
  tw_ctx *ctx = tt_ref_ctx();
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse("fsdp=1", &m), TW_OK);
  tw_mesh_comms *mc = NULL;
  cr_assert_eq(tw_mesh_comms_create(ctx, &m, &mc), TW_OK, "%s", tw_last_error());
  tw_pipeline_body b;
  cr_assert_eq(tw_pipeline_dense_body(4, 4, &b), TW_OK);
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.mb_rows = 2;
  float w1[16] = {0}, w2[16] = {0}, x[8] = {0}, y[8];
  tw_pipeline_weights w = {{w1, w2}, {NULL, NULL}};
  tw_status s = tw_pipeline_forward(ctx, mc, &c, &b, &w, x, y, NULL);
  cr_assert_eq(s, TW_ERR_INVALID_ARG, "%s", tw_status_name(s));
  cr_assert(strstr(tw_last_error(), "pipeline.mesh_pp") && strstr(tw_last_error(), "mesh fsdp=1 has no pp axis"), "%s",
            tw_last_error());
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
}
