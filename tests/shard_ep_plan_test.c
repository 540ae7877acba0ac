/* EP sharding rules as data (tw_shard_ep.h): valid specs give the documented groups, local
 * shapes and output specs; every invalid spec is rejected with the rule's name. Nothing runs. */
#include <criterion/criterion.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_shard_ep.h"

static tw_mesh mesh(const char *text) {
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse(text, &m), TW_OK, "%s", tw_last_error());
  return m;
}
static tw_pspec spec(const char *text) {
  tw_pspec p;
  cr_assert_eq(tw_pspec_parse(text, &p), TW_OK, "%s", tw_last_error());
  return p;
}

static tw_status make(const char *m, const char *x, const char *idx, int E, tw_ep_plan *p) {
  tw_mesh mm = mesh(m);
  tw_pspec xs = spec(x), is = idx ? spec(idx) : xs;
  return tw_ep_plan_make(&mm, TW_EP_OP_DISPATCH, 32, 16, E, 2, &xs, &is, NULL, p);
}

Test(shard_ep_plan, ep_by_tp_mesh_gives_groups_0246_and_1357) {
  tw_ep_plan p;
  tt_expect_status(make("ep=4,tp=2", "[ep, None]", NULL, 8, &p), TW_OK, NULL);
  cr_expect_eq(p.ep_size, 4);
  cr_expect_eq(p.replicas, 2);
  cr_expect_eq(p.local_tokens, 8);
  int want_group[8] = {0, 1, 0, 1, 0, 1, 0, 1}, want_rank[8] = {0, 0, 1, 1, 2, 2, 3, 3};
  for (int r = 0; r < 8; r++) {
    int er;
    cr_expect_eq(tw_ep_plan_group(&p, r, &er), want_group[r], "rank %d", r);
    cr_expect_eq(er, want_rank[r], "rank %d", r);
  }
}

Test(shard_ep_plan, outer_axes_and_ep_innermost_are_accepted) {
  const char *ok[][2] = {{"ep=2", "[ep, None]"},
                         {"dp=2,ep=2", "[(dp,ep), None]"},
                         {"fsdp=2,ep=4", "[(fsdp,ep), None]"},
                         {"dp=2,fsdp=2,ep=2", "[(dp,fsdp,ep), None]"},
                         {"dp=1,ep=2", "[(dp,ep), None]"}}; /* a size-1 axis is tolerated */
  for (int i = 0; i < 5; i++) {
    tw_ep_plan p;
    tt_expect_status(make(ok[i][0], ok[i][1], NULL, 8, &p), TW_OK, NULL);
    char buf[1024];
    tw_ep_plan_format(&p, buf, sizeof buf);
    cr_expect(strstr(buf, "EP groups"), "%s", buf);
    char sb[64];
    cr_expect_str_eq(tw_pspec_str(&p.recv_spec, sb, sizeof sb), tw_pspec_str(&p.x_spec, buf, sizeof buf));
  }
  tw_ep_plan p;
  tt_expect_status(make("dp=2,fsdp=2,ep=2", "[(dp,fsdp,ep), None]", NULL, 8, &p), TW_OK, NULL);
  cr_expect_eq(p.num_groups, 4);
  cr_expect_eq(p.local_tokens, 4);
  /* rank 5 = dp 1, fsdp 0, ep 1: shard (1*2 + 0)*2 + 1 = 5, group = its dp/fsdp coordinates */
  int er;
  cr_expect_eq(tw_ep_plan_shard(&p, 5), 5);
  cr_expect_eq(tw_ep_plan_group(&p, 5, &er), 2);
  cr_expect_eq(er, 1);
}

Test(shard_ep_plan, invalid_specs_name_their_rule) {
  tw_ep_plan p;
  tt_expect_status(make("dp=2,ep=2", "[(ep,dp), None]", NULL, 8, &p), TW_ERR_INVALID_ARG, "rule ep.ep_innermost");
  tt_expect_status(make("tp=2,ep=2", "[(tp,ep), None]", NULL, 8, &p), TW_ERR_INVALID_ARG, "rule ep.axes: the token dim may use dp, fsdp and ep only, not 'tp'");
  tt_expect_status(make("dp=2,ep=2", "[dp, None]", NULL, 8, &p), TW_ERR_INVALID_ARG, "rule ep.needs_ep");
  tt_expect_status(make("ep=2,tp=2", "[ep, tp]", NULL, 8, &p), TW_ERR_INVALID_ARG, "rule ep.leading_dim_only");
  tt_expect_status(make("dp=2,ep=2", "[(dp,ep), None]", "[ep, None]", 8, &p), TW_ERR_INVALID_ARG, "rule ep.specs_equal");
  tt_expect_status(make("dp=2,ep=2,tp=2", "[(dp,ep), None]", "[(dp,ep), tp]", 8, &p), TW_ERR_INVALID_ARG, "rule ep.leading_dim_only");
  tt_expect_status(make("ep=4", "[ep, None]", NULL, 6, &p), TW_ERR_INVALID_ARG, "rule ep.experts_divisible: E = 6 is not divisible by |ep| = 4");
  /* plain spec errors come from tw_pspec_check, with the tensor named */
  tw_mesh m = mesh("ep=4");
  tw_pspec xs = spec("[ep, None]");
  tt_expect_status(tw_ep_plan_make(&m, TW_EP_OP_DISPATCH, 30, 16, 8, 2, &xs, NULL, NULL, &p), TW_ERR_SHAPE, "tokens");
  tt_expect_status(make("ep=2", "[tp, None]", NULL, 8, &p), TW_ERR_INVALID_ARG, "which mesh ep=2 lacks");
  tt_expect_status(tw_ep_plan_make(&m, TW_EP_OP_DISPATCH, 32, 16, 8, 9, &xs, NULL, NULL, &p), TW_ERR_INVALID_ARG, "k = 9");
}

Test(shard_ep_plan, router_rule) {
  tw_mesh m = mesh("dp=2,ep=2,tp=2");
  tw_pspec xs = spec("[(dp,ep), None]"), bad = spec("[dp, ep]");
  tw_ep_plan p;
  tt_expect_status(tw_ep_plan_make(&m, TW_EP_OP_ROUTER, 16, 8, 8, 2, &xs, NULL, NULL, &p), TW_OK, NULL);
  cr_expect_eq(p.local_tokens, 4);
  cr_expect_eq(p.replicas, 2);
  char buf[1024];
  cr_expect(strstr(tw_ep_plan_format(&p, buf, sizeof buf), "aux loss"), "%s", buf);
  tt_expect_status(tw_ep_plan_make(&m, TW_EP_OP_ROUTER, 16, 8, 8, 2, &bad, NULL, NULL, &p), TW_ERR_INVALID_ARG,
                   "rule router.experts_replicated");
}

Test(shard_ep_plan, op_names_round_trip) {
  for (int i = 0; i < TW_EP_OP_COUNT; i++) {
    tw_ep_op op;
    cr_expect_eq(tw_ep_op_from_name(tw_ep_op_name((tw_ep_op)i), &op), 0);
    cr_expect_eq(op, i);
  }
  tw_ep_op op;
  cr_expect_eq(tw_ep_op_from_name("ep_scatter", &op), -1);
}
