/* Meshes, partition specs and the partitioning rules, checked as data: no op runs here. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "shard/golden.h"
#include "twin/tw_shard.h"

static tw_mesh mesh(const char *s) {
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse(s, &m), TW_OK, "%s: %s", s, tw_last_error());
  return m;
}

static tw_pspec spec(const char *s) {
  tw_pspec p;
  cr_assert_eq(tw_pspec_parse(s, &p), TW_OK, "%s: %s", s, tw_last_error());
  return p;
}

static tw_shard_operand operand(int nd, const int64_t *shape, const char *sp) {
  tw_shard_operand o;
  memset(&o, 0, sizeof o);
  o.ndim = nd;
  memcpy(o.shape, shape, sizeof(int64_t) * (size_t)nd);
  o.spec = spec(sp);
  return o;
}

/* "kind tensor axis dim" strings of the plan's steps, joined by "; ". */
static const char *steps_str(const tw_plan *p, char *buf, size_t n) {
  static const char *k[] = {"AG", "SLICE", "RS", "AR", "AMAX", "QUANT"};
  size_t u = 0;
  buf[0] = 0;
  for (int i = 0; i < p->nsteps && u < n; i++)
  {
    char dim[16] = "", where[64] = "";
    const tw_plan_step *st = &p->steps[i];
    if (st->dim >= 0) snprintf(dim, sizeof dim, " d%d", st->dim);
    if (st->kind == TW_STEP_QUANTIZE) { /* no axis of its own: the axes its amax reduces over */
      size_t w = (size_t)snprintf(where, sizeof where, "amax(");
      for (int a = 0; a < st->axes.n && w < sizeof where; a++)
        w += (size_t)snprintf(where + w, sizeof where - w, "%s%s", a ? "," : "", tw_axis_name(st->axes.axis[a]));
      if (w < sizeof where) snprintf(where + w, sizeof where - w, ")");
    } else {
      snprintf(where, sizeof where, "%s", tw_axis_name(st->axis));
    }
    u += (size_t)snprintf(buf + u, n - u, "%s%s %s %s%s", i ? "; " : "", k[st->kind], p->t[st->tensor].name, where, dim);
  }
  return buf;
}

static tw_plan plan_ok(const char *m, tw_shard_op op, tw_pass pass, tw_shard_operand x, tw_shard_operand w,
                       int64_t G, const char *want_steps) {
  tw_mesh me = mesh(m);
  tw_plan p;
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  cr_assert_eq(tw_plan_make(&me, op, pass, &x, &w, G, &ro, &p), TW_OK, "%s", tw_last_error());
  char buf[1024];
  steps_str(&p, buf, sizeof buf);
  if (want_steps) cr_assert_str_eq(buf, want_steps);
  return p;
}

static void plan_err(const char *m, tw_shard_op op, tw_pass pass, tw_shard_operand x, tw_shard_operand w, int64_t G,
                     const char *rule) {
  tw_mesh me = mesh(m);
  tw_plan p;
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  cr_assert_neq(tw_plan_make(&me, op, pass, &x, &w, G, &ro, &p), TW_OK);
  cr_assert(strstr(tw_last_error(), rule), "want '%s' in: %s", rule, tw_last_error());
}

Test(mesh, parse_print_and_coordinates) {
  tw_mesh m = mesh("dp=2, ep=4");
  char b[64];
  cr_assert_str_eq(tw_mesh_str(&m, b, sizeof b), "dp=2,ep=4");
  cr_assert_eq(tw_mesh_ranks(&m), 8);
  cr_assert_eq(tw_mesh_coord(&m, 5, TW_AXIS_DP), 1);
  cr_assert_eq(tw_mesh_coord(&m, 5, TW_AXIS_EP), 1);
  cr_assert_eq(tw_mesh_coord(&m, 5, TW_AXIS_TP), 0);
  cr_assert_eq(tw_mesh_axis_size(&m, TW_AXIS_TP), 1);
  tw_mesh one = mesh("");
  cr_assert_eq(tw_mesh_ranks(&one), 1);
  cr_assert_str_eq(tw_mesh_str(&one, b, sizeof b), "1");
}

Test(mesh, invalid_meshes_are_named) {
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse("dp=2,dp=2", &m), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "'dp' appears twice"), "%s", tw_last_error());
  cr_assert_eq(tw_mesh_parse("dq=2", &m), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "unknown axis 'dq'"), "%s", tw_last_error());
  cr_assert_eq(tw_mesh_parse("tp=0", &m), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "size 0"), "%s", tw_last_error());
  cr_assert_eq(tw_mesh_parse("tp", &m), TW_ERR_INVALID_ARG);
  cr_assert_eq(tw_mesh_parse("dp=2;tp=2", &m), TW_ERR_INVALID_ARG);
}

Test(spec, parse_print_and_shard_index) {
  tw_pspec p = spec("[(dp,ep), None, tp]");
  char b[96];
  cr_assert_str_eq(tw_pspec_str(&p, b, sizeof b), "[(dp,ep), None, tp]");
  tw_pspec q = spec("(dp,ep),-,tp");
  cr_assert(tw_pspec_equal(&p, &q));
  tw_mesh m = mesh("dp=2,ep=2,tp=2");
  /* rank 6 = (dp 1, ep 1, tp 0): block 1*2+1 = 3 of the (dp,ep) dim */
  cr_assert_eq(tw_dimspec_shards(&m, &p.dim[0]), 4);
  cr_assert_eq(tw_dimspec_index(&m, &p.dim[0], 6), 3);
  tw_pspec swapped = spec("[(ep,dp)]");
  cr_assert_eq(tw_dimspec_index(&m, &swapped.dim[0], 2), 2); /* rank 2 = (dp 0, ep 1): ep-major block 2 */
  tw_pspec bad;
  cr_assert_eq(tw_pspec_parse("[(dp,xx)]", &bad), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "unknown axis 'xx'"), "%s", tw_last_error());
  cr_assert_eq(tw_pspec_parse("[(dp,ep]", &bad), TW_ERR_INVALID_ARG);
}

Test(spec, invalid_specs_are_named) {
  tw_mesh m = mesh("dp=2,tp=4");
  int64_t s[2] = {8, 6};
  tw_pspec p = spec("[dp, dp]");
  cr_assert_eq(tw_pspec_check(&m, &p, 2, s, "x"), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "uses axis 'dp' twice"), "%s", tw_last_error());
  p = spec("[ep, None]");
  cr_assert_eq(tw_pspec_check(&m, &p, 2, s, "x"), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "which mesh dp=2,tp=4 lacks"), "%s", tw_last_error());
  p = spec("[None, tp]");
  cr_assert_eq(tw_pspec_check(&m, &p, 2, s, "x"), TW_ERR_SHAPE);
  cr_assert(strstr(tw_last_error(), "dim 1 of size 6 does not split into 4 shards"), "%s", tw_last_error());
  p = spec("[tp]");
  cr_assert_eq(tw_pspec_check(&m, &p, 2, s, "x"), TW_ERR_SHAPE);
  cr_assert(strstr(tw_last_error(), "x has 2 dims but its spec [tp] has 1"), "%s", tw_last_error());
}

Test(spec, host_slice_and_place_round_trip) {
  tw_mesh m = mesh("dp=2,tp=2");
  tw_pspec p = spec("[(tp,dp), None, dp]");
  p.dim[2].n = 0; /* [(tp,dp), None, None] */
  int32_t g[8 * 3 * 2], back[8 * 3 * 2], l[2 * 3 * 2];
  for (int i = 0; i < 48; i++) g[i] = i;
  memset(back, 0xff, sizeof back);
  tw_tensor gt = {g, TW_I32, 3, {8, 3, 2, 0}, TW_MEM_HOST}, bt = gt, lt = {l, TW_I32, 3, {2, 3, 2, 0}, TW_MEM_HOST};
  bt.data = back;
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(tw_shard_slice_host(&m, &p, r, &gt, &lt), TW_OK, "%s", tw_last_error());
    int block = tw_mesh_coord(&m, r, TW_AXIS_TP) * 2 + tw_mesh_coord(&m, r, TW_AXIS_DP);
    cr_assert_eq(l[0], block * 2 * 6, "rank %d", r);
    cr_assert_eq(tw_shard_place_host(&m, &p, r, &lt, &bt), TW_OK);
  }
  cr_assert_eq(memcmp(g, back, sizeof g), 0);
}

/* ---- dense (seed 001) ---- */
static const int64_t X3[3] = {8, 64, 256}, W2[2] = {256, 128}, W3[3] = {8, 256, 128};

Test(dense_rule, batch_keeps_its_sharding_and_m_is_gathered) {
  tw_plan p = plan_ok("dp=2,tp=4", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[dp, tp, None]"),
                      operand(2, W2, "[None, None]"), 0, "AG x tp d1");
  char b[96];
  cr_assert_str_eq(tw_pspec_str(&p.t[2].spec, b, sizeof b), "[dp, None, None]");
  cr_assert(!p.exact); /* the local GEMM has B/2 batches: within the bound */
  p = plan_ok("fsdp=2", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[None, None, None]"), operand(2, W2, "[fsdp, None]"),
              0, "AG w fsdp d0");
  cr_assert(p.exact); /* data movement around the global GEMM */
}

Test(dense_rule, k_follows_rhs_k_and_partial_sums_are_all_reduced) {
  tw_plan p = plan_ok("dp=2,tp=4", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[dp, None, None]"),
                      operand(2, W2, "[tp, None]"), 0, "SLICE x tp d2; AR y tp");
  cr_assert(!p.exact);
  char b[96];
  cr_assert_str_eq(tw_pspec_str(&p.t[2].spec, b, sizeof b), "[dp, None, None]");
  /* lhs K on another axis: gathered, then sliced to the rhs's axis */
  static const int64_t X2[2] = {64, 256};
  plan_ok("dp=2,tp=2", TW_SHARD_DENSE, TW_PASS_FWD, operand(2, X2, "[None, dp]"), operand(2, W2, "[tp, None]"), 0,
          "AG x dp d1; SLICE x tp d1; AR y tp");
}

Test(dense_rule, m_and_k_sharded_reduce_scatter) {
  tw_plan p = plan_ok("dp=2,tp=4", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[dp, tp, None]"),
                      operand(2, W2, "[tp, None]"), 0, "AG x tp d1; SLICE x tp d2; RS y tp d1");
  char b[96];
  cr_assert_str_eq(tw_pspec_str(&p.t[2].spec, b, sizeof b), "[dp, tp, None]");
}

Test(dense_rule, fsdp_weights_are_gathered_and_grads_reduce_scattered) {
  plan_ok("dp=2,fsdp=2", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[(dp,fsdp), None, None]"),
          operand(2, W2, "[fsdp, None]"), 0, "AG w fsdp d0");
  /* wgrad: partial over the batch axes (dp, fsdp); fsdp scatters back onto w's dim 0 */
  plan_ok("dp=2,fsdp=2", TW_SHARD_DENSE, TW_PASS_WGRAD, operand(3, X3, "[(dp,fsdp), None, None]"),
          operand(2, W2, "[fsdp, None]"), 0, "RS dw fsdp d0; AR dw dp");
  /* dgrad: dy in y's spec, dx back in x's */
  plan_ok("dp=2,fsdp=2", TW_SHARD_DENSE, TW_PASS_DGRAD, operand(3, X3, "[(dp,fsdp), None, None]"),
          operand(2, W2, "[fsdp, None]"), 0, "AG w fsdp d0");
  /* N sharded on tp: dgrad contracts N, so dx is all-reduced over tp */
  plan_ok("dp=2,tp=2", TW_SHARD_DENSE, TW_PASS_DGRAD, operand(3, X3, "[dp, None, None]"),
          operand(2, W2, "[None, tp]"), 0, "AR dx tp");
}

Test(dense_rule, errors_name_the_rule) {
  static const int64_t X2[2] = {64, 256};
  plan_err("dp=2,tp=2", TW_SHARD_DENSE, TW_PASS_FWD, operand(2, X2, "[None, None]"), operand(2, W2, "[tp, dp]"), 0,
           "rule gemm.rhs_k_and_n");
  plan_err("dp=2,tp=2", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[dp, None, None]"), operand(3, W3, "[tp, None, None]"),
           0, "rule gemm.batch");
  plan_err("dp=2,tp=2", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[dp, None, None]"), operand(2, W2, "[dp, None]"), 0,
           "rule gemm.batch_axis_reuse");
  plan_err("tp=4", TW_SHARD_DENSE, TW_PASS_FWD, operand(3, X3, "[None, None, None]"), operand(2, W2, "[tp, tp]"), 0,
           "spec: w [tp, tp] uses axis 'tp' twice");
}

Test(dense_rule, reduce_scatter_needs_m_divisible) {
  int64_t xs[2] = {6, 256};
  plan_err("dp=2,tp=4", TW_SHARD_DENSE, TW_PASS_FWD, operand(2, xs, "[dp, None]"), operand(2, W2, "[tp, None]"), 0,
           "rule gemm.reduce_scatter_m");
}

/* ---- grouped GEMM ---- */
static const int64_t GX[2] = {64, 32}, GW[3] = {8, 32, 16};

Test(grouped_rule, ep_is_injected_and_fsdp_stripped) {
  tw_plan p = plan_ok("fsdp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[(ep,fsdp), None]"),
                      operand(3, GW, "[None, fsdp, None]"), 8, "AG w fsdp d1; SLICE w ep d0");
  cr_assert(p.experts_on_ep);
  cr_assert(!p.exact);
  cr_assert(strstr(p.notes[0], "grouped_gemm.ep_inject"), "%s", p.notes[0]);
  /* wgrad: partial over fsdp rows; back to the caller's (ep-replicated) weights */
  plan_ok("fsdp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_WGRAD, operand(2, GX, "[(ep,fsdp), None]"),
          operand(3, GW, "[None, fsdp, None]"), 8, "AG dw ep d0; RS dw fsdp d1");
}

Test(grouped_rule, backward_fsdp_keeps_the_ep_axis) {
  /* seed 000's review: the EP axis was overwritten in the backward FSDP path. Here dw keeps
   * [ep, fsdp, None]: only fsdp is reduce-scattered. */
  tw_plan p = plan_ok("fsdp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_WGRAD, operand(2, GX, "[(ep,fsdp), None]"),
                      operand(3, GW, "[ep, fsdp, None]"), 8, "RS dw fsdp d1");
  char b[96];
  cr_assert_str_eq(tw_pspec_str(&p.t[2].spec, b, sizeof b), "[ep, fsdp, None]");
  plan_ok("fsdp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_DGRAD, operand(2, GX, "[(ep,fsdp), None]"),
          operand(3, GW, "[ep, fsdp, None]"), 8, "AG w fsdp d1");
}

Test(grouped_rule, contracting_dim_sharded_all_reduces) {
  plan_ok("tp=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[None, tp]"), operand(3, GW, "[None, tp, None]"), 8,
          "AR y tp");
  plan_ok("tp=2", TW_SHARD_GROUPED_GEMM, TW_PASS_DGRAD, operand(2, GX, "[None, None]"), operand(3, GW, "[None, None, tp]"),
          8, "AR dx tp");
}

Test(grouped_rule, errors_name_the_rule) {
  plan_err("dp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[(dp,ep), None]"), operand(3, GW, "[None, None, None]"),
           8, "rule grouped_gemm.ep_major");
  plan_err("dp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[ep, None]"), operand(3, GW, "[dp, None, None]"), 8,
           "rule grouped_gemm.expert_dim");
  plan_err("dp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[dp, None]"), operand(3, GW, "[ep, None, None]"), 8,
           "rule grouped_gemm.ep_rows");
  plan_err("dp=2,tp=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[None, None]"), operand(3, GW, "[None, dp, tp]"), 8,
           "rule grouped_gemm.rhs_k_and_n");
  plan_err("dp=2,tp=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[tp, None]"), operand(3, GW, "[None, None, tp]"), 8,
           "rule grouped_gemm.axis_reuse");
  plan_err("ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[ep, None]"), operand(3, GW, "[None, ep, None]"), 8,
           "rule grouped_gemm.axis_reuse");
}

Test(grouped_rule, local_groups_are_clipped_and_ep_checked) {
  tw_plan p = plan_ok("dp=2,ep=2", TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, operand(2, GX, "[(ep,dp), None]"),
                      operand(3, GW, "[None, None, None]"), 8, NULL);
  /* ep rank 0 holds rows 0..31 (experts 0..3), split over dp in 16-row halves */
  int32_t gs[8] = {10, 0, 12, 10, 20, 4, 8, 0}, l[8];
  int64_t Gl;
  cr_assert_eq(tw_plan_local_groups(&p, 0, gs, l, &Gl), TW_OK, "%s", tw_last_error());
  cr_assert_eq(Gl, 4);
  cr_assert(l[0] == 10 && l[1] == 0 && l[2] == 6 && l[3] == 0);
  cr_assert_eq(tw_plan_local_groups(&p, 2, gs, l, &Gl), TW_OK); /* rank 2 = (dp 1, ep 0): rows 16..31 */
  cr_assert(l[0] == 0 && l[1] == 0 && l[2] == 6 && l[3] == 10);
  cr_assert_eq(tw_plan_local_groups(&p, 1, gs, l, &Gl), TW_OK); /* rank 1 = (dp 0, ep 1): rows 32..47 */
  cr_assert(l[0] == 16 && l[1] == 0 && l[2] == 0 && l[3] == 0);
  cr_assert_eq(tw_plan_local_groups(&p, 3, gs, l, &Gl), TW_OK);
  cr_assert(l[0] == 4 && l[1] == 4 && l[2] == 8 && l[3] == 0, "%d %d %d %d", l[0], l[1], l[2], l[3]);
  int32_t wrong[8] = {10, 0, 12, 11, 19, 4, 8, 0}; /* expert 3 spills into ep rank 1's rows */
  cr_assert_eq(tw_plan_local_groups(&p, 1, wrong, l, &Gl), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "rows of group 3"), "%s", tw_last_error());
}

/* ---- grouped quantize ---- */
static tw_status qplan(const char *m, const char *xs, tw_scaling mode, tw_qlayout layout, tw_plan *p) {
  tw_mesh me = mesh(m);
  int64_t s[2] = {64, 256};
  tw_shard_operand x = operand(2, s, xs);
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  ro.quant.mode = mode;
  ro.quant.layout = layout;
  return tw_plan_make(&me, TW_SHARD_GROUPED_QUANTIZE, TW_PASS_FWD, &x, NULL, 4, &ro, p);
}

Test(quantize_rule, amax_is_max_reduced_over_the_sharding_axes) {
  tw_plan p;
  cr_assert_eq(qplan("dp=2,fsdp=2,tp=2", "[(dp,fsdp), tp]", TW_SCALE_TENSOR_CURRENT, TW_ROWWISE_COLWISE, &p), TW_OK, "%s",
               tw_last_error());
  char b[256];
  cr_assert_str_eq(steps_str(&p, b, sizeof b), "AMAX q dp; AMAX q fsdp; AMAX q tp");
  cr_assert_eq(qplan("dp=2,tp=2", "[None, None]", TW_SCALE_TENSOR_CURRENT, TW_ROWWISE, &p), TW_OK);
  cr_assert_eq(p.nsteps, 0);
  cr_assert_eq(qplan("dp=2", "[dp, None]", TW_SCALE_MXFP8_1D, TW_ROWWISE, &p), TW_OK);
  cr_assert_eq(p.nsteps, 0); /* block scales need no reduction */
  tw_qtensor q;
  cr_assert_eq(tw_plan_quantize_shapes(&p, &q), TW_OK);
  cr_assert_eq(q.row_data.shape[0], 32);
}

Test(quantize_rule, block_rules) {
  tw_plan p;
  cr_assert_eq(qplan("dp=2", "[dp, None]", TW_SCALE_MXFP8_1D, TW_ROWWISE_COLWISE, &p), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "rule quantize.blocks_along_m"), "%s", tw_last_error());
  cr_assert_eq(qplan("dp=2", "[dp, None]", TW_SCALE_BLOCK_128x128, TW_ROWWISE, &p), TW_ERR_INVALID_ARG);
  cr_assert_eq(qplan("tp=4", "[None, tp]", TW_SCALE_BLOCK_1x128, TW_ROWWISE, &p), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "rule quantize.k_block"), "%s", tw_last_error());
  cr_assert_eq(qplan("tp=2", "[None, tp]", TW_SCALE_BLOCK_1x128, TW_ROWWISE, &p), TW_OK, "%s", tw_last_error());
  cr_assert_eq(qplan("tp=8", "[None, tp]", TW_SCALE_MXFP8_1D, TW_ROWWISE, &p), TW_OK, "%s", tw_last_error());
}

/* The token-padded colwise layout is a whole-x layout: refused on any sharded x, planned unsharded. */
Test(quantize_rule, token_padded_colwise_needs_an_unsharded_x) {
  tw_mesh me = mesh("dp=2,tp=2");
  int64_t s[2] = {64, 256};
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  ro.quant.mode = TW_SCALE_BLOCK_1x128;
  ro.quant.layout = TW_ROWWISE_COLWISE;
  ro.quant.col_padded = 1;
  tw_plan p;
  const char *specs[3] = {"[dp, None]", "[None, tp]", "[dp, tp]"};
  for (int i = 0; i < 3; i++) {
    tw_shard_operand x = operand(2, s, specs[i]);
    cr_assert_eq(tw_plan_make(&me, TW_SHARD_GROUPED_QUANTIZE, TW_PASS_FWD, &x, NULL, 4, &ro, &p), TW_ERR_INVALID_ARG,
                 "%s", specs[i]);
    cr_assert(strstr(tw_last_error(), "rule quantize.col_padded"), "%s", tw_last_error());
    cr_assert_str_eq(tw_shard_expected_error(&me, TW_SHARD_GROUPED_QUANTIZE, &ro.quant, &x, NULL),
                     "rule quantize.col_padded");
  }
  tw_shard_operand x = operand(2, s, "[None, None]");
  cr_assert_eq(tw_plan_make(&me, TW_SHARD_GROUPED_QUANTIZE, TW_PASS_FWD, &x, NULL, 4, &ro, &p), TW_OK, "%s",
               tw_last_error());
}

Test(plan, format_names_tensors_steps_and_notes) {
  tw_plan p = plan_ok("dp=2,ep=4", TW_SHARD_GROUPED_GEMM, TW_PASS_WGRAD, operand(2, GX, "[(ep,dp), None]"),
                      operand(3, GW, "[None, None, None]"), 8, "AR dw dp; AG dw ep d0");
  char buf[4096];
  tw_plan_format(&p, buf, sizeof buf);
  cr_assert(strstr(buf, "plan grouped_gemm wgrad on mesh dp=2,ep=4 (8 ranks)"), "%s", buf);
  cr_assert(strstr(buf, "out dw    global [8, 32, 16] spec [None, None, None] local [8, 32, 16] | at op [ep, None, None] local [2, 32, 16]"), "%s", buf);
  cr_assert(strstr(buf, "dw    all-gather over ep along dim 0 -> [8, 32, 16]"), "%s", buf);
  cr_assert(strstr(buf, "(a partial sum over dp)"), "%s", buf);
  cr_assert(strstr(buf, "note: grouped_gemm.ep_inject"), "%s", buf);
}

Test(plan, bad_calls) {
  tw_mesh m = mesh("dp=2");
  tw_plan p;
  tw_shard_operand x = operand(2, GX, "[dp, None]");
  cr_assert_eq(tw_plan_make(&m, TW_SHARD_DENSE, TW_PASS_FWD, &x, NULL, 0, NULL, &p), TW_ERR_NULL);
  cr_assert_eq(tw_plan_make(&m, (tw_shard_op)9, TW_PASS_FWD, &x, &x, 0, NULL, &p), TW_ERR_INVALID_ARG);
  tw_shard_operand w = operand(3, GW, "[None, None, None]");
  cr_assert_eq(tw_plan_make(&m, TW_SHARD_GROUPED_GEMM, TW_PASS_FWD, &x, &w, 4, NULL, &p), TW_ERR_SHAPE);
  cr_assert(strstr(tw_last_error(), "4 groups but w has 8 experts"), "%s", tw_last_error());
  cr_assert_eq(tw_plan_make(&m, TW_SHARD_GROUPED_QUANTIZE, TW_PASS_WGRAD, &x, NULL, 4, NULL, &p), TW_ERR_INVALID_ARG);
}

/* ---- fp8 inputs of the grouped GEMM, quantized before the FSDP gather ---- */
static tw_status gplan(const char *m, const char *xs, const char *ws, tw_pass pass, int qin, int qbg, tw_dtype fp8,
                       tw_plan *p) {
  tw_mesh me = mesh(m);
  tw_shard_operand x = operand(2, GX, xs), w = operand(3, GW, ws);
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  ro.quantize_inputs = qin;
  ro.quantize_before_gather = qbg;
  ro.fp8 = fp8;
  return tw_plan_make(&me, TW_SHARD_GROUPED_GEMM, pass, &x, &w, 8, &ro, p);
}

Test(grouped_rule, quantize_before_gather_moves_fp8) {
  tw_plan p;
  char b[512];
  cr_assert_eq(gplan("fsdp=2,ep=2", "[(ep,fsdp), None]", "[None, fsdp, None]", TW_PASS_FWD, 1, 1, TW_E4M3, &p), TW_OK, "%s",
               tw_last_error());
  cr_assert_str_eq(steps_str(&p, b, sizeof b), "QUANT x amax(fsdp); SLICE w ep d0; QUANT w amax(fsdp); AG w fsdp d1");
  cr_assert_eq(p.steps[0].axes.n, 1);
  cr_assert_eq(p.steps[0].axes.axis[0], TW_AXIS_FSDP); /* x: rows over fsdp; ep ranks hold other experts */
  cr_assert_eq(p.steps[2].axes.axis[0], TW_AXIS_FSDP); /* w: its fsdp shard of K */
  cr_assert_eq(p.steps[2].shape[1], 16);               /* quantized before the gather: K/2 */
  cr_assert_eq(p.steps[3].shape[1], 32);
  cr_assert_eq(gplan("fsdp=2,ep=2", "[(ep,fsdp), None]", "[None, fsdp, None]", TW_PASS_FWD, 1, 0, TW_E4M3, &p), TW_OK);
  cr_assert_str_eq(steps_str(&p, b, sizeof b), "QUANT x amax(fsdp); AG w fsdp d1; SLICE w ep d0; QUANT w amax()");
  cr_assert_eq(p.steps[3].axes.n, 0); /* after the gather w is whole: nothing to reduce */
}

/* The backward passes take fp8 inputs too: the dgrad quantizes dy by its groups and w per
 * expert (before its gather when asked), the wgrad x and dy by their groups. */
Test(grouped_rule, fp8_backward_passes) {
  tw_plan p;
  char b[512];
  cr_assert_eq(gplan("fsdp=2,ep=2", "[(ep,fsdp), None]", "[None, fsdp, None]", TW_PASS_DGRAD, 1, 1, TW_E4M3, &p), TW_OK, "%s",
               tw_last_error());
  cr_assert_str_eq(steps_str(&p, b, sizeof b), "QUANT dy amax(fsdp); SLICE w ep d0; QUANT w amax(fsdp); AG w fsdp d1");
  cr_assert_eq(p.steps[0].axes.n, 1);
  cr_assert_eq(p.steps[0].axes.axis[0], TW_AXIS_FSDP); /* dy: rows over fsdp; ep ranks hold other experts */
  cr_assert_eq(p.steps[2].axes.axis[0], TW_AXIS_FSDP); /* w: its fsdp shard of K */
  cr_assert_eq(p.steps[2].shape[1], 16);
  cr_assert_eq(gplan("fsdp=2,ep=2", "[(ep,fsdp), None]", "[None, fsdp, None]", TW_PASS_WGRAD, 1, 0, TW_E4M3, &p), TW_OK, "%s",
               tw_last_error());
  cr_assert_eq(p.steps[0].kind, TW_STEP_QUANTIZE);
  cr_assert_eq(p.steps[0].tensor, 0);
  cr_assert_eq(p.steps[1].kind, TW_STEP_QUANTIZE);
  cr_assert_eq(p.steps[1].tensor, 1); /* dy, by its groups like x: amax over fsdp, not ep */
  cr_assert_eq(p.steps[1].axes.n, 1);
  cr_assert_eq(p.steps[1].axes.axis[0], TW_AXIS_FSDP);
  cr_assert(strstr(p.notes[p.nnotes - 1], "x and dy quantized to e4m3"), "%s", p.notes[p.nnotes - 1]);
  /* w sharded on N by tp: dy's N columns are split, so dy's amax reduces over tp too (dgrad
   * and wgrad); without quantize_before_gather w is quantized after its gather */
  cr_assert_eq(gplan("tp=2,fsdp=2", "[fsdp, None]", "[None, None, tp]", TW_PASS_DGRAD, 1, 0, TW_E4M3, &p), TW_OK, "%s",
               tw_last_error());
  int qdy = -1, qw = -1, ag = -1;
  for (int i = 0; i < p.nsteps; i++) {
    if (p.steps[i].kind == TW_STEP_QUANTIZE) { if (p.steps[i].tensor == 0) qdy = i; else qw = i; }
    if (p.steps[i].kind == TW_STEP_ALL_GATHER && p.steps[i].tensor == 1) ag = i;
  }
  cr_assert(qdy >= 0 && qw >= 0);
  cr_assert_eq(p.steps[qdy].axes.n, 2, "dy's amax axes: %d", p.steps[qdy].axes.n); /* fsdp (rows) and tp (N) */
  cr_assert(ag < qw, "w quantized after its gather");
  cr_assert_eq(gplan("tp=2,fsdp=2", "[fsdp, None]", "[None, None, tp]", TW_PASS_WGRAD, 1, 0, TW_E4M3, &p), TW_OK, "%s",
               tw_last_error());
  for (int i = 0; i < p.nsteps; i++)
    if (p.steps[i].kind == TW_STEP_QUANTIZE && p.steps[i].tensor == 1)
      cr_assert_eq(p.steps[i].axes.n, 2, "wgrad dy's amax axes: %d", p.steps[i].axes.n);
}

Test(grouped_rule, fp8_errors_name_the_rule) {
  tw_plan p;
  cr_assert_eq(gplan("fsdp=2", "[fsdp, None]", "[None, fsdp, None]", TW_PASS_WGRAD, 1, 1, TW_E4M3, &p), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "rule grouped_gemm.quantize_before_gather_needs_w"), "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "inputs are x and dy"), "%s", tw_last_error());
  cr_assert_eq(gplan("fsdp=2", "[fsdp, None]", "[None, fsdp, None]", TW_PASS_FWD, 1, 0, TW_E5M2, &p), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "rule grouped_gemm.fp8_pair"), "%s", tw_last_error());
  cr_assert_eq(gplan("fsdp=2", "[fsdp, None]", "[None, fsdp, None]", TW_PASS_FWD, 1, 0, TW_BF16, &p), TW_ERR_DTYPE);
  cr_assert_eq(gplan("fsdp=2", "[fsdp, None]", "[None, fsdp, None]", TW_PASS_FWD, 0, 1, TW_E4M3, &p), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "quantize_before_gather needs quantize_inputs"), "%s", tw_last_error());
  cr_assert(strstr(tw_last_error(), "rule grouped_gemm.quantize_before_gather_needs_fp8"), "%s", tw_last_error());
}
