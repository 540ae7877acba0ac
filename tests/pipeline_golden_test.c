/* The pipeline on ref thread ranks against the independent goldens of golden/gen_pipeline.py
 * (the sequential model in JAX, f64, jax.grad) for spec §6 items 1-8: loss, y, dx, dW1, dW2.
 *
 * Bound. The ref pipeline runs in f32 (OpenBLAS sgemm, gelu in double rounded to f32), so
 * each layer adds at most about (E + H + 8) u |value| of rounding per element in the forward
 * (K = E and K = H products, gelu, the residual add; u = 2^-24) and, in the backward, also
 * the weight-gradient sums of K = M*mb/F rows and the F-way reduce-scatter. Summed over L
 * layers (first order: the growth of an early error through later layers is not counted,
 * which these weights, scaled by 1/sqrt(fan-in), keep near 1):
 *   forward  |got - exact| <= L (E + H + 8) u (|exact| + rms(exact))
 *   gradient |got - exact| <= L (E + H + 8 + M mb) u (|exact| + rms(exact))
 * (rms over the tensor keeps elements near zero from demanding relative accuracy). Each case
 * logs its worst |diff|/bound (all 26 stored cases: <= 0.05 when this was written), and a
 * wrong layer order or MaxText's BSW window is outside it by orders of magnitude. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/threads.h"
#include "test_util.h"
#include "tests/pipeline_cases.h"
#include "twin/tw_pipeline.h"


/* Runs a stored case; returns the worst |diff|/bound when `fail` is 0 (no assertion). */
static double run_case_opt(const char *dir, const char *cname, int stale, int fail);
static void run_case(const char *dir, const char *cname) { run_case_opt(dir, cname, 0, 1); }


static double run_case_opt(const char *dir, const char *cname, int stale, int fail) {
  pipe_golden g;
  pipe_golden_read(dir, cname, &g);
  tw_pipeline_threads_run run;
  memset(&run, 0, sizeof run);
  tw_pipeline_config c = g.cfg;
  int E = g.E, H = g.H;
  c.test_stale_window = stale;
  run.cfg = c;
  run.fsdp = g.F;
  cr_assert_eq(tw_pipeline_dense_body(E, H, &run.body), TW_OK);
  pipe_golden_io io;
  pipe_golden_load(dir, &g, &run.body, &io);
  run.x = io.x; run.y = io.y;
  run.w[0] = io.w[0]; run.w[1] = io.w[1];
  cr_assert_eq(tw_pipeline_run_threads(&run), TW_OK, "%s: %s", cname, tw_last_error()); /* forward: y */
  double loss = pipe_golden_set_dy(&io);
  run.dy = io.dy; run.dx = io.dx;
  run.dw[0] = io.dw[0]; run.dw[1] = io.dw[1];
  cr_assert_eq(tw_pipeline_run_threads(&run), TW_OK, "%s: %s", cname, tw_last_error());
  double r = pipe_golden_check(dir, cname, &g, &io, loss, fail);
  cr_log_info("%s%s: worst |diff|/bound %.3g", cname, stale ? " (MaxText window)" : "", r);
  pipe_golden_io_free(&io);
  return r;
}

Test(pipeline_golden, every_stored_case_within_the_bound) {
  int n = tt_each_golden_case("pipeline", "golden/gen_pipeline.py", run_case);
  cr_assert_geq(n, 26, "only %d pipeline goldens", n);
}

/* The goldens are not vacuous: the same case with layers in the wrong order (stage-major
 * instead of repeat-major placement) is far outside the bound. */
Test(pipeline_golden, a_wrong_layer_order_is_caught) {
  char dir[1100];
  snprintf(dir, sizeof dir, "%s/pipeline/S3_M6_R2_d1_Lps1_F1_plain", tt_golden_root());
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = 3; c.microbatches = 6; c.repeats = 2; c.layers = 6; c.mb_rows = 4;
  tw_pipeline_threads_run run;
  memset(&run, 0, sizeof run);
  run.cfg = c;
  run.fsdp = 1;
  cr_assert_eq(tw_pipeline_dense_body(4, 8, &run.body), TW_OK);
  int64_t na = tw_pipeline_act_elems(&c, &run.body), nw[2];
  for (int i = 0; i < 2; i++) nw[i] = tw_pipeline_param_elems(&c, &run.body, i);
  float *x = (float *)tt_load_npy(dir, "x", TW_F32, na);
  float *w[2] = {(float *)tt_load_npy(dir, "w1", TW_F32, nw[0]), (float *)tt_load_npy(dir, "w2", TW_F32, nw[1])};
  double *gy = (double *)tt_load_npy(dir, "y", TW_F64, na);
  /* swap the [R, S] placement: [S, R] read as [R, S] */
  float *sw[2];
  for (int i = 0; i < 2; i++) {
    int64_t per = nw[i] / 6;
    sw[i] = (float *)malloc(sizeof(float) * (size_t)nw[i]);
    for (int r = 0; r < 2; r++)
      for (int s = 0; s < 3; s++) memcpy(sw[i] + (r * 3 + s) * per, w[i] + (s * 2 + r) * per, sizeof(float) * (size_t)per);
  }
  float *y = (float *)calloc((size_t)na, 4);
  run.x = x; run.y = y; run.w[0] = sw[0]; run.w[1] = sw[1];
  cr_assert_eq(tw_pipeline_run_threads(&run), TW_OK, "%s", tw_last_error());
  double worst = 0;
  for (int64_t i = 0; i < na; i++) worst = fmax(worst, fabs((double)y[i] - gy[i]));
  cr_assert_gt(worst, 1e-3, "a wrong layer order went unnoticed (max |diff| %g)", worst);
  free(x); free(w[0]); free(w[1]); free(gy); free(sw[0]); free(sw[1]); free(y);
}

/* §4.3 against the independent golden: MaxText's BSW window, forced, is far outside the bound
 * for S = 3 and 4 (every F) and within it for S = 2; twin's window passes all of them above. */
Test(pipeline_golden, maxtext_window_fails_s3_and_s4_passes_s2) {
  const char *cases[] = {"S3_M6_R2_d1_Lps1_F1_bsw", "S3_M6_R2_d1_Lps1_F2_bsw", "S4_M4_R2_d1_Lps1_F4_bsw",
                         "S4_M8_R3_d1_Lps1_F1_bsw", "S2_M8_R4_d1_Lps1_F2_bsw"};
  for (int i = 0; i < 5; i++) {
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/pipeline/%s", tt_golden_root(), cases[i]);
    double r = run_case_opt(dir, cases[i], 1, 0);
    if (i < 4) cr_assert_gt(r, 100.0, "%s: MaxText's stale window went unnoticed (|diff|/bound %g)", cases[i], r);
    else cr_assert_leq(r, 1.0, "%s: with S = 2 MaxText's window is right (|diff|/bound %g)", cases[i], r);
  }
}
