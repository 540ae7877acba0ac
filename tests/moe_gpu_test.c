/* The MoE block on one GPU (the gpu backend's router, EP with ep_size 1, grouped GEMMs and
 * gpu/moe_elementwise.cu) against the same independent goldens as the ref block
 * (golden/gen_moe.py, JAX f64) within tw_moe.h's error budget, and against the ref block on a
 * larger bf16 problem. The 2-GPU case (ep = 2 over NCCL) stands aside on fewer GPUs. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/moe_cases.h"
#include "test_util.h"
#include "twin/tw_comm.h"

int tw_gpu_device_count(void); /* gpu/probe.cu */

#define NEED_GPUS(n)                                                     \
  do {                                                                   \
    int have_ = tw_gpu_device_count();                                   \
    if (have_ < (n)) cr_skip_test("needs %d GPUs, sees %d", (n), have_); \
  } while (0)

typedef struct {
  tw_moe_threads_run *run;
  int n;
} gjob;

static tw_status gpu_rank(int rank, tw_comm *comm, void *arg) {
  gjob *j = (gjob *)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cfg.device = rank;
  cfg.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cfg));
  tw_status s = tw_moe_run_rank(ctx, j->run, rank, j->n);
  tw_ctx_destroy(ctx);
  if (s != TW_OK) tw_comm_abort(comm);
  return s;
}

/* Every rank of run->mesh on its own GPU over NCCL (one GPU: a one-rank NCCL communicator). */
static tw_status run_on_gpus(tw_moe_threads_run *run) {
  if (run->mesh.naxes == 0) {
    tw_axis ax = TW_AXIS_EP;
    int one = 1;
    TW_TRY(tw_mesh_init(&run->mesh, 1, &ax, &one));
  }
  int n = tw_mesh_ranks(&run->mesh), dev[8];
  if (n > 8) return tw_error(TW_ERR_INVALID_ARG, "moe gpu test: %d ranks", n);
  for (int i = 0; i < n; i++) dev[i] = i;
  tw_comm *comms[8];
  TW_TRY(tw_comm_init_nccl_local(n, dev, comms));
  for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], 120);
  gjob j = {run, n};
  tw_status s = tw_run_ranks(n, comms, gpu_rank, &j);
  char msg[TW_ERROR_MAX];
  snprintf(msg, sizeof msg, "%s", tw_last_error());
  for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  if (s != TW_OK) return tw_error(s, "%s", msg);
  return TW_OK;
}

static void on_one_gpu(const char *dir, const char *name) {
  gcase c;
  moe_load_case(dir, &c);
  double w = moe_check_case(&c, name, NULL, run_on_gpus);
  cr_log_info("moe gpu golden %s: worst |diff|/bound %.3g", name, w);
  moe_free_case(&c);
}

Test(moe_gpu, every_stored_case_on_one_gpu) {
  NEED_GPUS(1);
  cr_assert_geq(moe_each_case(on_one_gpu), 13);
}

static void on_two_gpus(const char *dir, const char *name) {
  gcase c;
  moe_load_case(dir, &c);
  if (c.T % 2 == 0 && c.E % 2 == 0) {
    tw_mesh m;
    tw_axis ax = TW_AXIS_EP;
    int two = 2;
    cr_assert_eq(tw_mesh_init(&m, 1, &ax, &two), TW_OK);
    char cname[300];
    snprintf(cname, sizeof cname, "%s ep=2 (2 GPUs)", name);
    double w = moe_check_case(&c, cname, &m, run_on_gpus);
    cr_log_info("moe gpu golden %s: worst |diff|/bound %.3g", cname, w);
  }
  moe_free_case(&c);
}

Test(moe_gpu, every_stored_case_on_two_gpus_ep2) {
  NEED_GPUS(2);
  cr_assert_geq(moe_each_case(on_two_gpus), 13);
}

/* A larger bf16 block (grouped GEMMs of hundreds of rows, 16 experts, k = 4): gpu vs ref. */
Test(moe_gpu, larger_bf16_block_matches_ref) {
  NEED_GPUS(1);
  enum { T = 512, H = 256, F = 128, E = 16, K = 4 };
  float *in[7];
  int64_t n[7] = {T * H, H * E, E * H * 2 * F, E * F * H, E * 2 * F, E * H, T * H};
  for (int i = 0; i < 7; i++) {
    in[i] = (float *)malloc(sizeof(float) * (size_t)n[i]);
    tt_fill_uniform_f32(in[i], n[i], 100 + i, -1, 1);
  }
  for (int64_t i = 0; i < n[1]; i++) in[1][i] *= 0.125f;
  for (int64_t i = 0; i < n[2]; i++) in[2][i] *= 0.0625f;
  for (int64_t i = 0; i < n[3]; i++) in[3][i] *= 0.09f;
  tw_moe_threads_run r;
  memset(&r, 0, sizeof r);
  tw_moe_config cfg = TW_MOE_CONFIG_INIT;
  cfg.num_experts = E; cfg.hidden = H; cfg.ffn = F; cfg.router.topk = K; cfg.recipe = TW_MOE_BF16;
  cfg.aux_coeff = 0.01f; cfg.alignment = 8;
  r.cfg = cfg; r.T = T; r.layers = 1; r.d_aux = 1;
  r.x = in[0]; r.gate = in[1]; r.wi = in[2]; r.wo = in[3]; r.bi = in[4]; r.bo = in[5]; r.d_out = in[6];
  const int nout = 6;
  int64_t on[6] = {T * H, T * H, H * E, E * H * 2 * F, E * F * H, 1};
  float *ref[6], *gpu[6];
  for (int i = 0; i < nout; i++) {
    ref[i] = (float *)calloc((size_t)on[i], 4);
    gpu[i] = (float *)calloc((size_t)on[i], 4);
  }
  tw_moe_threads_run rr = r, rg = r;
  rr.out = ref[0]; rr.dx = ref[1]; rr.dgate = ref[2]; rr.dwi = ref[3]; rr.dwo = ref[4]; rr.aux = ref[5];
  rg.out = gpu[0]; rg.dx = gpu[1]; rg.dgate = gpu[2]; rg.dwi = gpu[3]; rg.dwo = gpu[4]; rg.aux = gpu[5];
  cr_assert_eq(tw_moe_run_threads(&rr), TW_OK, "ref: %s", tw_last_error());
  cr_assert_eq(run_on_gpus(&rg), TW_OK, "gpu: %s", tw_last_error());
  const char *names[6] = {"out", "dx", "dgate", "dwi", "dwo", "aux"};
  for (int q = 0; q < nout; q++) {
    double ss = 0, worst = 0;
    for (int64_t i = 0; i < on[q]; i++) ss += (double)ref[q][i] * ref[q][i];
    double rms = sqrt(ss / (double)on[q]), k = (q == 0 || q == 5) ? 8 : 16;
    for (int64_t i = 0; i < on[q]; i++) {
      double bound = k * ldexp(1, -8) * (fabs(ref[q][i]) + rms), err = fabs((double)gpu[q][i] - ref[q][i]);
      cr_assert(err <= bound, "%s[%lld]: gpu %.9g, ref %.9g, |diff| %.3g > %.3g", names[q], (long long)i,
                (double)gpu[q][i], (double)ref[q][i], err, bound);
      worst = fmax(worst, err / bound);
    }
    cr_log_info("moe gpu vs ref, bf16 T=%d H=%d F=%d E=%d k=%d: %s worst |diff|/bound %.3g", T, H, F, E, K, names[q], worst);
  }
  for (int i = 0; i < 7; i++) free(in[i]);
  for (int i = 0; i < nout; i++) {
    free(ref[i]);
    free(gpu[i]);
  }
}
