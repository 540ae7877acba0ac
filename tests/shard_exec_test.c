/* The executor on the ref backend with thread ranks: the paths the golden sweep does not take
 * (16-bit outputs through f32 partial sums, untouched tail rows, delayed scaling) and its
 * errors (shard shapes, meshes, experts on the wrong rank) — which must not hang the ranks. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_shard.h"

#define MAXR 8

typedef struct {
  const tw_plan *plan;
  const float *x, *w;           /* global inputs */
  const int32_t *gs;
  tw_dtype out_dtype;
  void *out_global;             /* each rank places its shard here (disjoint when unreplicated) */
  int corrupt_rank;             /* this rank passes a wrong shard shape (-1: none) */
} exec_job;

static tw_status rank_body(int rank, tw_comm *comm, void *arg) {
  exec_job *j = (exec_job *)arg;
  const tw_plan *p = j->plan;
  tw_ctx *ctx = NULL;
  tw_mesh_comms *mc = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cfg));
  tw_status s = tw_mesh_comms_create(ctx, &p->mesh, &mc);
  float *l[2] = {NULL, NULL};
  void *lo = NULL;
  tw_shard_io io;
  memset(&io, 0, sizeof io);
  io.group_sizes = j->gs;
  const float *g[2] = {j->x, j->w};
  for (int i = 0; i < 2 && s == TW_OK; i++) {
    const tw_plan_tensor *t = &p->t[i];
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->local[d];
    l[i] = (float *)malloc(sizeof(float) * (size_t)n);
    tw_tensor gt = {(void *)g[i], TW_F32, t->ndim, {0}, TW_MEM_HOST};
    io.in[i] = gt;
    io.in[i].data = l[i];
    memcpy(gt.shape, t->global, sizeof gt.shape);
    memcpy(io.in[i].shape, t->local, sizeof io.in[i].shape);
    s = tw_shard_slice_host(&p->mesh, &t->spec, rank, &gt, &io.in[i]);
  }
  const tw_plan_tensor *ot = &p->t[2];
  int64_t no = 1;
  for (int d = 0; d < ot->ndim; d++) no *= ot->local[d];
  size_t es = tw_dtype_storage_bytes(j->out_dtype, 1);
  lo = malloc(es * (size_t)no);
  memset(lo, TW_POISON_BYTE, es * (size_t)no);
  io.out = (tw_tensor){lo, j->out_dtype, ot->ndim, {0}, TW_MEM_HOST};
  memcpy(io.out.shape, ot->local, sizeof io.out.shape);
  if (rank == j->corrupt_rank) io.in[0].shape[0] -= 1;
  if (s == TW_OK) s = tw_plan_run(ctx, mc, p, &io);
  if (s == TW_OK) s = tw_mesh_comms_wait(ctx, mc);
  if (s == TW_OK && j->out_global) {
    tw_tensor gt = {j->out_global, j->out_dtype, ot->ndim, {0}, TW_MEM_HOST};
    memcpy(gt.shape, ot->global, sizeof gt.shape);
    s = tw_shard_place_host(&p->mesh, &ot->spec, rank, &io.out, &gt);
  }
  free(l[0]); free(l[1]); free(lo);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return s;
}

static tw_status run_plan(exec_job *j) {
  int n = tw_mesh_ranks(&j->plan->mesh);
  tw_comm *comms[MAXR];
  cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
  for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], 20);
  tw_status s = tw_run_ranks(n, comms, rank_body, j);
  for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  return s;
}

static tw_plan make(const char *mesh, tw_shard_op op, tw_pass pass, int xnd, const int64_t *xs, const char *xspec,
                    int wnd, const int64_t *ws, const char *wspec, int64_t G) {
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse(mesh, &m), TW_OK);
  tw_shard_operand x = {xnd, {0}, {0}}, w = {wnd, {0}, {0}};
  memcpy(x.shape, xs, sizeof(int64_t) * (size_t)xnd);
  memcpy(w.shape, ws, sizeof(int64_t) * (size_t)wnd);
  cr_assert_eq(tw_pspec_parse(xspec, &x.spec), TW_OK);
  cr_assert_eq(tw_pspec_parse(wspec, &w.spec), TW_OK);
  tw_plan p;
  cr_assert_eq(tw_plan_make(&m, op, pass, &x, &w, G, NULL, &p), TW_OK, "%s", tw_last_error());
  return p;
}

static void fill(float *a, int64_t n, unsigned seed) {
  for (int64_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    a[i] = (float)((int)(seed >> 9) % 2001 - 1000) / 1000.0f;
  }
}

Test(shard_exec, bf16_output_through_f32_partial_sums) {
  int64_t xs[2] = {16, 64}, ws[2] = {64, 32};
  tw_plan p = make("tp=4", TW_SHARD_DENSE, TW_PASS_FWD, 2, xs, "[None, tp]", 2, ws, "[tp, None]", 0);
  cr_assert_eq(p.nsteps, 1); /* the all-reduce of y */
  float x[16 * 64], w[64 * 32];
  uint16_t got[16 * 32];
  fill(x, 16 * 64, 1);
  fill(w, 64 * 32, 2);
  exec_job j = {&p, x, w, NULL, TW_BF16, got, -1};
  cr_assert_eq(run_plan(&j), TW_OK, "%s", tw_last_error());
  for (int i = 0; i < 16; i++)
    for (int n = 0; n < 32; n++) {
      double s = 0, a = 0;
      for (int k = 0; k < 64; k++) { s += (double)x[i * 64 + k] * w[k * 32 + n]; a += fabs((double)x[i * 64 + k] * w[k * 32 + n]); }
      double g = tw_bf16_to_f32(got[i * 32 + n]);
      cr_assert(fabs(g - s) <= ldexp(fabs(s), -8) + 64 * ldexp(a, -24), "y[%d][%d] = %g, exact %g", i, n, g, s);
    }
}

Test(shard_exec, tail_rows_stay_untouched_without_collectives_after) {
  int64_t xs[2] = {32, 16}, ws[3] = {4, 16, 8};
  tw_plan p = make("dp=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, 2, xs, "[dp, None]", 3, ws, "[None, None, None]", 4);
  int32_t gs[4] = {5, 0, 17, 6}; /* 28 of 32 rows */
  float x[32 * 16], w[4 * 16 * 8], y[32 * 8];
  fill(x, 32 * 16, 3);
  fill(w, 4 * 16 * 8, 4);
  memset(y, TW_POISON_BYTE, sizeof y);
  exec_job j = {&p, x, w, gs, TW_F32, y, -1};
  cr_assert_eq(run_plan(&j), TW_OK, "%s", tw_last_error());
  uint32_t poison;
  memset(&poison, TW_POISON_BYTE, 4);
  for (int i = 28; i < 32; i++)
    for (int n = 0; n < 8; n++) cr_assert_eq(memcmp(&y[i * 8 + n], &poison, 4), 0, "tail row %d was written", i);
  cr_assert(fabsf(y[27 * 8]) < 100 && memcmp(&y[27 * 8], &poison, 4) != 0);
}

Test(shard_exec, a_wrong_shard_shape_fails_every_rank_fast) {
  int64_t xs[2] = {16, 64}, ws[2] = {64, 32};
  tw_plan p = make("dp=2,tp=2", TW_SHARD_DENSE, TW_PASS_FWD, 2, xs, "[dp, tp]", 2, ws, "[tp, None]", 0);
  float x[16 * 64], w[64 * 32];
  fill(x, 16 * 64, 1);
  fill(w, 64 * 32, 2);
  exec_job j = {&p, x, w, NULL, TW_F32, NULL, 2};
  tw_status s = run_plan(&j);
  cr_assert_eq(s, TW_ERR_SHAPE, "%s", tw_status_name(s));
  cr_assert(strstr(tw_last_error(), "x shard is [7, 32] f32 but the plan expects [8, 32] f32"), "%s", tw_last_error());
}

Test(shard_exec, experts_on_the_wrong_rank_are_reported_not_hung) {
  int64_t xs[2] = {32, 16}, ws[3] = {4, 16, 8};
  tw_plan p = make("ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_WGRAD, 2, xs, "[ep, None]", 3, ws, "[None, None, None]", 4);
  int32_t gs[4] = {10, 7, 15, 0}; /* expert 1's rows reach row 17: ep rank 1's half */
  float x[32 * 16], dy[32 * 8];
  fill(x, 32 * 16, 3);
  fill(dy, 32 * 8, 4);
  exec_job j = {&p, x, dy, gs, TW_F32, NULL, -1};
  tw_status s = run_plan(&j);
  cr_assert_eq(s, TW_ERR_INVALID_ARG, "%s: %s", tw_status_name(s), tw_last_error());
  cr_assert(strstr(tw_last_error(), "rows of group 1"), "%s", tw_last_error());
}

static tw_status mismatch_body(int rank, tw_comm *comm, void *arg) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cfg));
  tw_mesh m4, m2;
  tw_mesh_parse("dp=4", &m4);
  tw_mesh_parse("dp=2", &m2);
  tw_mesh_comms *mc = NULL;
  tw_status s = tw_mesh_comms_create(ctx, &m4, &mc);
  tw_status want = TW_OK;
  if (s != TW_ERR_INVALID_ARG || !strstr(tw_last_error(), "mesh dp=4 has 4 ranks but the communicator has 2"))
    want = tw_error(TW_ERR_INTERNAL, "rank %d: mesh size check: %s", rank, tw_last_error());
  if (want == TW_OK) s = tw_mesh_comms_create(ctx, &m2, &mc);
  if (want == TW_OK && s == TW_OK) {
    int64_t xs[2] = {8, 8};
    tw_plan p = make("tp=2", TW_SHARD_DENSE, TW_PASS_FWD, 2, xs, "[None, None]", 2, xs, "[None, None]", 0);
    tw_shard_io io;
    memset(&io, 0, sizeof io);
    s = tw_plan_run(ctx, mc, &p, &io);
    if (s != TW_ERR_INVALID_ARG || !strstr(tw_last_error(), "the plan is for mesh tp=2 but the communicators are for dp=2"))
      want = tw_error(TW_ERR_INTERNAL, "rank %d: plan/mesh check: %s", rank, tw_last_error());
    if (tw_mesh_comms_axis(mc, TW_AXIS_DP) == NULL || tw_mesh_comms_axis(mc, TW_AXIS_TP) != NULL)
      want = tw_error(TW_ERR_INTERNAL, "rank %d: axis communicators", rank);
    if (want == TW_OK && tw_mesh_comms_wait(ctx, mc) != TW_OK)
      want = tw_error(TW_ERR_INTERNAL, "rank %d: mesh_comms_wait: %s", rank, tw_last_error());
  } else if (want == TW_OK) {
    want = s;
  }
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return want;
}

Test(shard_exec, mesh_and_plan_must_match_the_communicator) {
  tw_comm *comms[2];
  cr_assert_eq(tw_comm_init_threads(2, comms), TW_OK);
  tw_status s = tw_run_ranks(2, comms, mismatch_body, NULL);
  cr_assert_eq(s, TW_OK, "%s", tw_last_error());
  tw_comm_destroy(comms[0]);
  tw_comm_destroy(comms[1]);
  /* one rank and no communicator: only the single-rank mesh */
  tw_ctx *ctx = NULL;
  cr_assert_eq(tw_ctx_create(&ctx, NULL), TW_OK);
  tw_mesh m;
  tw_mesh_parse("ep=2", &m);
  tw_mesh_comms *mc = NULL;
  cr_assert_eq(tw_mesh_comms_create(ctx, &m, &mc), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "context has no communicator"), "%s", tw_last_error());
  tw_mesh_parse("1", &m);
  cr_assert_eq(tw_mesh_comms_create(ctx, &m, &mc), TW_OK);
  cr_assert_eq(tw_mesh_comms_rank(mc), 0);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
}

Test(shard_exec, bad_io_is_named_before_any_collective) {
  tw_ctx *ctx = NULL;
  cr_assert_eq(tw_ctx_create(&ctx, NULL), TW_OK);
  tw_mesh one;
  tw_mesh_parse("1", &one);
  tw_mesh_comms *mc = NULL;
  cr_assert_eq(tw_mesh_comms_create(ctx, &one, &mc), TW_OK);
  int64_t xs[2] = {8, 4}, ws[3] = {2, 4, 4};
  tw_plan p = make("1", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, 2, xs, "[None, None]", 3, ws, "[None, None, None]", 2);
  float x[32], w[32], y[32];
  tw_shard_io io;
  memset(&io, 0, sizeof io);
  io.in[0] = tw_tensor_2d(x, TW_F32, 8, 4, TW_MEM_HOST);
  io.in[1] = tw_tensor_3d(w, TW_F32, 2, 4, 4, TW_MEM_HOST);
  io.out = tw_tensor_2d(y, TW_F32, 8, 4, TW_MEM_HOST);
  cr_assert_eq(tw_plan_run(ctx, mc, &p, &io), TW_ERR_NULL);
  cr_assert(strstr(tw_last_error(), "grouped_gemm needs group_sizes"), "%s", tw_last_error());
  int32_t gs[2] = {5, 4}; /* 9 rows of 8 */
  io.group_sizes = gs;
  cr_assert_eq(tw_plan_run(ctx, mc, &p, &io), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "group_sizes sum to 9 but x has 8 rows"), "%s", tw_last_error());
  gs[1] = 3;
  io.in[1].mem = TW_MEM_DEVICE;
  cr_assert_eq(tw_plan_run(ctx, mc, &p, &io), TW_ERR_MEMORY);
  cr_assert(strstr(tw_last_error(), "w lives in device memory"), "%s", tw_last_error());
  io.in[1].mem = TW_MEM_HOST;
  io.out = tw_tensor_none();
  cr_assert_eq(tw_plan_run(ctx, mc, &p, &io), TW_ERR_SHAPE);
  cr_assert(strstr(tw_last_error(), "y must be a 2-d tensor, got none"), "%s", tw_last_error());
  io.out = tw_tensor_2d(y, TW_F32, 8, 4, TW_MEM_HOST);
  cr_assert_eq(tw_plan_run(ctx, mc, &p, &io), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_plan_run(ctx, mc, &p, NULL), TW_ERR_NULL);
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  tw_shard_operand xq = {2, {8, 4}, {0}};
  tw_pspec_parse("[None, None]", &xq.spec);
  tw_plan qp;
  cr_assert_eq(tw_plan_make(&one, TW_SHARD_GROUPED_QUANTIZE, TW_PASS_FWD, &xq, NULL, 2, &ro, &qp), TW_OK, "%s", tw_last_error());
  tw_shard_io qio;
  memset(&qio, 0, sizeof qio);
  qio.in[0] = io.in[0];
  qio.group_sizes = gs;
  cr_assert_eq(tw_plan_run(ctx, mc, &qp, &qio), TW_ERR_NULL);
  cr_assert(strstr(tw_last_error(), "grouped_quantize needs io->q"), "%s", tw_last_error());
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
}

Test(shard_exec, host_slice_rejects_mismatched_shapes) {
  tw_mesh m;
  tw_mesh_parse("dp=2", &m);
  tw_pspec p;
  tw_pspec_parse("[dp, None]", &p);
  float g[8], l[8];
  tw_tensor gt = tw_tensor_2d(g, TW_F32, 4, 2, TW_MEM_HOST), lt = tw_tensor_2d(l, TW_F32, 4, 2, TW_MEM_HOST);
  cr_assert_eq(tw_shard_slice_host(&m, &p, 0, &gt, &lt), TW_ERR_SHAPE);
  cr_assert(strstr(tw_last_error(), "dim 0: local 4 x 2 shards != global 4"), "%s", tw_last_error());
  lt.shape[0] = 2;
  cr_assert_eq(tw_shard_slice_host(&m, &p, 2, &gt, &lt), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "rank 2 of 2"), "%s", tw_last_error());
  cr_assert_eq(tw_shard_slice_host(&m, &p, 1, &gt, &lt), TW_OK);
}

Test(shard_exec, a_hand_edited_plan_cannot_write_out_of_bounds) {
  int64_t xs[2] = {16, 64}, ws[2] = {64, 32};
  tw_plan p = make("tp=2", TW_SHARD_DENSE, TW_PASS_FWD, 2, xs, "[tp, None]", 2, ws, "[None, None]", 0);
  cr_assert_eq(p.steps[0].kind, TW_STEP_ALL_GATHER);
  p.steps[0].shape[0] = 64; /* claims a bigger gather than tp=2 gives */
  float x[16 * 64], w[64 * 32];
  fill(x, 16 * 64, 1);
  fill(w, 64 * 32, 2);
  exec_job j = {&p, x, w, NULL, TW_F32, NULL, -1};
  int n = 2;
  tw_comm *comms[2];
  cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
  tw_status s = tw_run_ranks(n, comms, rank_body, &j);
  for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
  cr_assert_eq(s, TW_ERR_INVALID_ARG, "%s", tw_status_name(s));
  cr_assert(strstr(tw_last_error(), "step over tp along dim 0 expects dim 0 = 64, the tensor gives 16"), "%s", tw_last_error());
}
