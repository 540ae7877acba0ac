/* The pipeline on the gpu backend against the ref pipeline (itself equal to the unpipelined
 * model bit for bit, tests/pipeline_test.c):
 *   one GPU   S = 1 (the whole scan: circ, rotate, d = 2, Lps = 2, BSW) with no communicator,
 *             and S stages x F ranks as threads with their own contexts on GPU 0 over the
 *             loopback communicator (pipeline/loopback_comm.h; NCCL takes one rank per device):
 *             S = 3 and 4 BSW (where MaxText's window is wrong), circ with d = 2, fsdp = 2;
 *   2 GPUs    NCCL, one thread per GPU: S = 2 plain (rotate and circ paths) and BSW, and
 *             pp = 1 x fsdp = 2 BSW (the window's all-gather / reduce-scatter over NCCL);
 *   memory    the device memory a rank allocates, from its context's ledger (tw_ctx_memory):
 *             the formula's to the byte, and BSW with R = 4 holds two gathered layers (+ two
 *             gradients), not R;
 *   speed     forward + backward step time of S = 2 against the ideal and the bubble (logged).
 * Bound against ref: the two backends round each GEMM differently (cuBLASLt vs OpenBLAS sum
 * orders, both f32 accumulation), so per layer up to (E + H + 8) u |value| each, plus
 * M mb u for the weight-gradient sums: |gpu - ref| <= 2 L (E + H + 8 + M mb) u (|ref| + rms).
 * A test needing N GPUs skips with "needs N GPUs, sees n" where fewer are visible. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pipeline/loopback_comm.h"
#include "pipeline/threads.h"
#include "test_util.h"
#include "tests/pipeline_cases.h"
#include "twin/tw_comm.h"
#include "twin/tw_pipeline.h"

#define NEED_GPUS(n) TT_NEED_GPUS(n)

typedef struct {
  tw_pipeline_threads_run run;
  int64_t na, nw[2];
  float *x, *dy, *w[2], *y, *dx, *dw[2];
} problem;

/* PIPE_TIMEOUT_S: the communicators' and the run's timeout (default 120 s); shorter on the
 * device so that a stalled rank reports which step it waited in before the call's cap. */
static double comm_timeout_s(void) {
  const char *e = getenv("PIPE_TIMEOUT_S");
  return e && atof(e) > 0 ? atof(e) : 120.0;
}

static void problem_make(problem *p, int S, int M, int R, int d, int Lps, int F, int bsw, int64_t E, int64_t H,
                         int64_t mb, uint64_t seed) {
  memset(p, 0, sizeof *p);
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = S; c.microbatches = M; c.repeats = R; c.delay = d; c.layers_per_stage = Lps;
  c.layers = S * R * Lps; c.mb_rows = mb;
  c.fsdp = bsw ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  p->run.cfg = c;
  p->run.fsdp = F;
  p->run.timeout_s = comm_timeout_s();
  cr_assert_eq(tw_pipeline_dense_body(E, H, &p->run.body), TW_OK);
  p->na = tw_pipeline_act_elems(&c, &p->run.body);
  p->x = (float *)calloc((size_t)p->na, 4); p->dy = (float *)calloc((size_t)p->na, 4);
  p->y = (float *)calloc((size_t)p->na, 4); p->dx = (float *)calloc((size_t)p->na, 4);
  tt_fill_uniform_f32(p->x, p->na, seed, -1, 1);
  tt_fill_uniform_f32(p->dy, p->na, seed + 1, -1, 1);
  for (int i = 0; i < 2; i++) {
    p->nw[i] = tw_pipeline_param_elems(&c, &p->run.body, i);
    p->w[i] = (float *)calloc((size_t)p->nw[i], 4);
    p->dw[i] = (float *)calloc((size_t)p->nw[i], 4);
    float a = (float)(1.0 / sqrt((double)p->run.body.param_rows[i]));
    tt_fill_uniform_f32(p->w[i], p->nw[i], seed + 2 + (uint64_t)i, -a, a);
  }
  p->run.x = p->x; p->run.dy = p->dy; p->run.y = p->y; p->run.dx = p->dx;
  for (int i = 0; i < 2; i++) { p->run.w[i] = p->w[i]; p->run.dw[i] = p->dw[i]; }
}

static void problem_free(problem *p) {
  free(p->x); free(p->dy); free(p->y); free(p->dx);
  for (int i = 0; i < 2; i++) { free(p->w[i]); free(p->dw[i]); }
}

/* ---- running on GPUs ------------------------------------------------------------------ */
typedef struct {
  problem *p;
  tw_mesh mesh;
  int one_gpu; /* every rank on GPU 0 over the loopback communicator */
  double step_s[16];
} gpu_job;
static double g_last_step_s; /* slowest rank's forward + backward of the last run */

static tw_status gpu_rank(int rank, tw_comm *comm, void *arg) {
  gpu_job *j = (gpu_job *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cfg.device = j->one_gpu ? 0 : rank;
  cfg.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cfg));
  tw_status s = tw_pipeline_run_rank(ctx, &j->mesh, rank, &j->p->run, NULL, NULL, &j->step_s[rank], NULL);
  tw_ctx_destroy(ctx);
  return s;
}

static void run_on_gpus_as(problem *p, int one_gpu) {
  gpu_job j;
  memset(&j, 0, sizeof j);
  j.p = p;
  j.one_gpu = one_gpu;
  tw_axis ax[2] = {TW_AXIS_PP, TW_AXIS_FSDP};
  int sz[2] = {p->run.cfg.stages, p->run.fsdp};
  cr_assert_eq(tw_mesh_init(&j.mesh, 2, ax, sz), TW_OK);
  int n = tw_mesh_ranks(&j.mesh);
  g_last_step_s = 0;
  if (n == 1) {
    cr_assert_eq(gpu_rank(0, NULL, &j), TW_OK, "%s", tw_last_error());
    g_last_step_s = j.step_s[0];
    return;
  }
  tw_comm *comms[16];
  int dev[16];
  for (int i = 0; i < n; i++) dev[i] = i;
  if (one_gpu) cr_assert_eq(tw_comm_init_loopback(n, TW_MEM_DEVICE, comms), TW_OK, "%s", tw_last_error());
  else cr_assert_eq(tw_comm_init_nccl_local(n, dev, comms), TW_OK, "%s", tw_last_error());
  for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], comm_timeout_s());
  char tag[96];
  snprintf(tag, sizeof tag, "pipeline S=%d M=%d R=%d F=%d on %s", p->run.cfg.stages, p->run.cfg.microbatches,
           p->run.cfg.repeats, p->run.fsdp, one_gpu ? "one GPU" : "NCCL");
  tt_stall_watch_start(tag);
  tw_status s = tw_run_ranks(n, comms, gpu_rank, &j);
  tt_stall_watch_stop();
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", tw_last_error());
  for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  cr_assert_eq(s, TW_OK, "%s", msg);
  for (int i = 0; i < n; i++) g_last_step_s = fmax(g_last_step_s, j.step_s[i]);
}
static void run_on_gpus(problem *p) { run_on_gpus_as(p, 0); }

static void expect_close(const char *what, const char *tag, const float *got, const float *ref, int64_t n, double k) {
  double ss = 0;
  for (int64_t i = 0; i < n; i++) ss += (double)ref[i] * ref[i];
  double rms = sqrt(ss / (double)(n ? n : 1)), worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double bound = 2.0 * k * ldexp(1.0, -24) * (fabs((double)ref[i]) + rms), err = fabs((double)got[i] - ref[i]);
    cr_assert(err <= bound, "%s %s[%lld]: gpu %.9g, ref %.9g, bound %.3g", tag, what, (long long)i, (double)got[i],
              (double)ref[i], bound);
    worst = fmax(worst, err / bound);
  }
  cr_log_info("%s %s: worst |gpu - ref| / bound %.3g", tag, what, worst);
}

static void gpu_vs_ref_as(int S, int M, int R, int d, int Lps, int F, int bsw, int one_gpu) {
  char tag[112];
  snprintf(tag, sizeof tag, "S=%d M=%d R=%d d=%d Lps=%d F=%d %s%s", S, M, R, d, Lps, F, bsw ? "bsw" : "plain",
           one_gpu ? " (one GPU, loopback)" : "");
  if (getenv("PIPE_TIMEOUT_S")) cr_log_info("%s: running", tag);
  const int64_t E = 64, H = 96, mb = 16;
  problem ref, gpu;
  problem_make(&ref, S, M, R, d, Lps, F, bsw, E, H, mb, 31);
  problem_make(&gpu, S, M, R, d, Lps, F, bsw, E, H, mb, 31);
  cr_assert_eq(tw_pipeline_run_threads(&ref.run), TW_OK, "%s ref: %s", tag, tw_last_error());
  run_on_gpus_as(&gpu, one_gpu);
  double kf = (double)S * R * Lps * (E + H + 8), kb = (double)S * R * Lps * (E + H + 8 + M * mb);
  expect_close("y", tag, gpu.y, ref.y, ref.na, kf);
  expect_close("dx", tag, gpu.dx, ref.dx, ref.na, kb);
  expect_close("dW1", tag, gpu.dw[0], ref.dw[0], ref.nw[0], kb);
  expect_close("dW2", tag, gpu.dw[1], ref.dw[1], ref.nw[1], kb);
  problem_free(&ref);
  problem_free(&gpu);
}

static void gpu_vs_ref(int S, int M, int R, int d, int Lps, int F, int bsw) { gpu_vs_ref_as(S, M, R, d, Lps, F, bsw, 0); }

Test(pipeline_gpu, one_gpu_plays_s_stages_over_loopback) {
  NEED_GPUS(1);
  gpu_vs_ref_as(3, 6, 2, 1, 1, 1, 1, 1); /* BSW, S = 3 */
  gpu_vs_ref_as(4, 8, 3, 1, 1, 1, 1, 1); /* BSW, S = 4 */
  gpu_vs_ref_as(4, 8, 2, 2, 1, 1, 0, 1); /* d = 2, rotate */
  gpu_vs_ref_as(3, 9, 2, 2, 1, 1, 0, 1); /* d = 2, circ */
  gpu_vs_ref_as(2, 4, 2, 1, 1, 2, 1, 1); /* pp = 2 x fsdp = 2, BSW: 4 contexts on GPU 0 */
  gpu_vs_ref_as(2, 4, 2, 1, 2, 2, 0, 1); /* Lps = 2, plain fsdp = 2 */
}

Test(pipeline_gpu, one_gpu_every_path_of_the_scan) {
  NEED_GPUS(1);
  gpu_vs_ref(1, 3, 2, 1, 1, 1, 0); /* circ */
  gpu_vs_ref(1, 1, 3, 1, 1, 1, 0); /* rotate */
  gpu_vs_ref(1, 2, 2, 2, 1, 1, 0); /* d = 2 */
  gpu_vs_ref(1, 2, 2, 1, 2, 1, 0); /* Lps = 2 */
  gpu_vs_ref(1, 2, 3, 1, 1, 1, 1); /* BSW */
}

Test(pipeline_gpu, two_gpus_nccl_s2_plain) {
  NEED_GPUS(2);
  gpu_vs_ref(2, 2, 2, 1, 1, 1, 0); /* rotate */
  gpu_vs_ref(2, 4, 2, 1, 1, 1, 0); /* circ */
  gpu_vs_ref(2, 4, 2, 2, 1, 1, 0); /* d = 2 */
}

Test(pipeline_gpu, two_gpus_nccl_s2_bsw) {
  NEED_GPUS(2);
  gpu_vs_ref(2, 4, 3, 1, 1, 1, 1);
  gpu_vs_ref(2, 8, 4, 1, 1, 1, 1);
}

Test(pipeline_gpu, two_gpus_nccl_fsdp2_bsw_window_collectives) {
  NEED_GPUS(2);
  gpu_vs_ref(1, 2, 3, 1, 1, 2, 1);
  gpu_vs_ref(1, 2, 2, 1, 1, 2, 0);
}

/* Three and four GPUs over NCCL (issue 18): S = 4 and S = 3, plain and BSW, delay d = 2 at
 * S = 4, and pp = 2 x fsdp = 2 with BSW, against the ref pipeline. */
Test(pipeline_gpu, three_gpus_nccl_s3_plain_and_bsw) {
  NEED_GPUS(3);
  gpu_vs_ref(3, 6, 2, 1, 1, 1, 0);
  gpu_vs_ref(3, 6, 2, 1, 1, 1, 1);
}

Test(pipeline_gpu, four_gpus_nccl_s4_plain_and_bsw) {
  NEED_GPUS(4);
  gpu_vs_ref(4, 4, 2, 1, 1, 1, 0);
  gpu_vs_ref(4, 4, 2, 1, 1, 1, 1);
  gpu_vs_ref(4, 8, 3, 1, 1, 1, 0);
  gpu_vs_ref(4, 8, 3, 1, 1, 1, 1);
  gpu_vs_ref(4, 8, 2, 2, 1, 1, 0); /* d = 2 */
}

Test(pipeline_gpu, four_gpus_nccl_pp2_fsdp2_bsw) {
  NEED_GPUS(4);
  gpu_vs_ref(2, 4, 2, 1, 1, 2, 1);
  gpu_vs_ref(2, 8, 4, 1, 1, 2, 1);
}

/* ---- against the JAX goldens over NCCL ------------------------------------------------ */
/* Every stored case of golden/gen_pipeline.py (the sequential model in JAX, f64, jax.grad)
 * whose S x F ranks fit the visible GPUs, one rank per GPU over NCCL, within the bound
 * pipeline_golden_test states for any f32-accumulating backend:
 *   forward L (E + H + 8) u (|exact| + rms), gradients L (E + H + 8 + M mb) u (|exact| + rms). */
static int g_golden_ran, g_golden_skipped;

static void golden_on_gpus(const char *dir, const char *cname) {
  pipe_golden g;
  pipe_golden_read(dir, cname, &g);
  const int S = g.cfg.stages, F = g.F, E = g.E, H = g.H;
  if (S * F > tw_gpu_device_count() || S * F < 2) { /* one rank has its own test above */
    g_golden_skipped++;
    return;
  }
  cr_log_info("pipeline golden %s on %d GPUs (NCCL): running", cname, S * F);
  problem p;
  memset(&p, 0, sizeof p);
  p.run.cfg = g.cfg;
  p.run.fsdp = F;
  p.run.timeout_s = comm_timeout_s();
  cr_assert_eq(tw_pipeline_dense_body(E, H, &p.run.body), TW_OK);
  pipe_golden_io io;
  pipe_golden_load(dir, &g, &p.run.body, &io);
  p.run.x = io.x; p.run.y = io.y;
  p.run.w[0] = io.w[0]; p.run.w[1] = io.w[1];
  run_on_gpus(&p); /* forward: y */
  double loss = pipe_golden_set_dy(&io);
  p.run.dy = io.dy; p.run.dx = io.dx;
  p.run.dw[0] = io.dw[0]; p.run.dw[1] = io.dw[1];
  run_on_gpus(&p); /* forward + backward */
  double r = pipe_golden_check(dir, cname, &g, &io, loss, 1);
  cr_log_info("pipeline golden %s on %d GPUs (NCCL): worst |diff|/bound %.3g", cname, S * F, r);
  g_golden_ran++;
  pipe_golden_io_free(&io);
}

Test(pipeline_gpu, stored_goldens_over_nccl_on_the_visible_gpus) {
  NEED_GPUS(2);
  int n = tt_each_golden_case("pipeline", "golden/gen_pipeline.py", golden_on_gpus);
  cr_assert_geq(n, 26, "only %d pipeline goldens", n);
  cr_log_info("pipeline goldens over NCCL: %d ran, %d need more GPUs than the %d visible (or one rank)", g_golden_ran,
              g_golden_skipped, tw_gpu_device_count());
  cr_assert_gt(g_golden_ran, 0);
}

/* ---- the window's device memory ------------------------------------------------------- */
/* What a BSW run with R repeats allocated on the device beyond its inputs at its peak, from the
 * rank context's allocation ledger (tw_ctx_memory: exact, and private to this process, so
 * Criterion's parallel workers on the same GPU cannot disturb it as they did cudaMemGetInfo). */
static size_t peak_use(int R, int64_t E, int64_t H, int64_t mb, tw_pipeline_config *cfg, tw_pipeline_body *body) {
  problem p;
  problem_make(&p, 1, 2, R, 1, 1, 1, 1, E, H, mb, 4);
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK, "%s", tw_last_error());
  tw_mesh mesh;
  tw_axis ax[2] = {TW_AXIS_PP, TW_AXIS_FSDP};
  int sz[2] = {1, 1};
  cr_assert_eq(tw_mesh_init(&mesh, 2, ax, sz), TW_OK);
  size_t peak = 0;
  cr_assert_eq(tw_pipeline_run_rank(ctx, &mesh, 0, &p.run, NULL, NULL, NULL, &peak), TW_OK, "%s", tw_last_error());
  tw_ctx_destroy(ctx);
  *cfg = p.run.cfg;
  *body = p.run.body;
  problem_free(&p);
  return peak;
}

/* The peak is the formula's to the byte (saved state + window + loop state + per-call buffers),
 * and from R = 2 to R = 4 it grows by the saved state alone (M R blocks): the window holds two
 * gathered layers and two gradients whatever R is; a window of R layers would add 4 more. */
Test(pipeline_gpu, bsw_window_holds_two_gathered_layers_not_r) {
  NEED_GPUS(1);
  const int64_t E = 2048, H = 4096, mb = 8;
  const size_t layer = (size_t)2 * E * H * sizeof(float); /* one gathered layer: W1 + W2, 64 MiB */
  const double MiB = 1048576.0;
  tw_pipeline_config c2, c4;
  tw_pipeline_body b;
  size_t u2 = peak_use(2, E, H, mb, &c2, &b), u4 = peak_use(4, E, H, mb, &c4, &b);
  size_t want = tw_pipeline_window_bytes(&c4, &b, 1);
  cr_assert_eq(want, tw_pipeline_window_bytes(&c2, &b, 1));
  cr_assert_eq(want, 4 * layer); /* w_curr, w_next and their gradients */
  cr_log_info("BSW peak device allocation beyond the inputs: R=2 %.3f MiB, R=4 %.3f MiB (window %.1f MiB)", u2 / MiB,
              u4 / MiB, want / MiB);
  cr_assert_eq(u2, tw_pipeline_peak_bytes(&c2, &b, 1, 0), "R=2 peak %zu bytes, formula %zu", u2,
               tw_pipeline_peak_bytes(&c2, &b, 1, 0));
  cr_assert_eq(u4, tw_pipeline_peak_bytes(&c4, &b, 1, 0), "R=4 peak %zu bytes, formula %zu", u4,
               tw_pipeline_peak_bytes(&c4, &b, 1, 0));
  cr_assert_eq(u4 - u2, tw_pipeline_saved_bytes(&c4, &b, 1) - tw_pipeline_saved_bytes(&c2, &b, 1),
               "from R=2 to R=4 the peak grew %zu bytes, the saved state %zu", u4 - u2,
               tw_pipeline_saved_bytes(&c4, &b, 1) - tw_pipeline_saved_bytes(&c2, &b, 1));
  cr_assert(u4 >= want);
}

/* ---- step time against the ideal (logged; the bench proper is `twin bench --op pipeline`) */
Test(pipeline_gpu, step_time_against_theory_s2) {
  NEED_GPUS(2);
  const int S = 2, M = 8, R = 2;
  const int64_t E = 4096, H = 4096, mb = 1024;
  problem p;
  problem_make(&p, S, M, R, 1, 1, 1, 0, E, H, mb, 9);
  run_on_gpus(&p); /* warm */
  run_on_gpus(&p);
  double step = g_last_step_s;
  /* one layer's forward + VJP alone on one GPU, same shapes: the ideal per layer-step */
  problem one;
  problem_make(&one, 1, 1, 1, 1, 1, 1, 0, E, H, mb, 10);
  run_on_gpus(&one);
  run_on_gpus(&one);
  double layer_step = g_last_step_s;
  tw_pipeline_config c = p.run.cfg;
  double ideal = (double)S * R * M * layer_step / S, bubble = tw_pipeline_bubble_fraction(&c);
  double theory = ideal / (1.0 - bubble);
  cr_log_info("S=2 M=8 R=2 E=H=4096 mb=1024: step %.2f ms, ideal %.2f ms, with bubble %.4f: %.2f ms, over theory %+.1f%% "
              "(forward + backward on the slowest rank, inputs already on the device)",
              1e3 * step, 1e3 * ideal, bubble, 1e3 * theory, 100.0 * (step / theory - 1.0));
  problem_free(&p);
  problem_free(&one);
}
