/* The sharded EP sweep: every mesh of 1, 2, 4 and 8 thread ranks over (dp, fsdp, ep, tp), every
 * token spec the EP rules accept that differs in effect on the mesh ([(dp,fsdp,ep), None],
 * [(fsdp,dp,ep), None], [(dp,ep), None], [(fsdp,ep), None], [ep, None]; axes outside the spec hold
 * replicas), routing uniform, one hot expert, all tokens to one expert, half the experts
 * receiving nothing, and no tokens at all. Each rank runs dispatch -> expert fn -> combine and
 * both backward passes on its EP group (the ep communicator of tw_mesh_comms) and is checked,
 * bit for bit, against the unsharded formula computed from the global tensors without
 * communication (tests/shard_ep_cases.c); the main thread then checks token conservation over
 * all ranks: every (token, expert) route arrives exactly once per replica, counted and
 * checksummed. shard_ep_gpu_test runs the same cases over NCCL on GPUs. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/shard_ep_cases.h"
#include "twin/tw_comm.h"

typedef struct {
  sep_case *c;
} job;

static tw_status rank_body(int rank, tw_comm *world, void *arg) {
  sep_case *c = ((job *)arg)->c;
  tw_ctx *ctx = NULL;
  tw_mesh_comms *mc = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = world;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_status s = tw_mesh_comms_create(ctx, &c->mesh, &mc);
  if (s == TW_OK) s = sep_rank_case(ctx, world, mc, c, rank);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return s;
}

static int run_case(const int sizes[4], const char *spec, int dist, tw_dtype dt, uint64_t seed) {
  static sep_case c; /* large; one at a time */
  sep_case_make(&c, sizes, spec, dist, dt, seed);
  int n = tw_mesh_ranks(&c.mesh);
  tw_comm *comms[8];
  cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
  job j = {&c};
  tw_status s = tw_run_ranks(n, comms, rank_body, &j);
  for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
  char name[160], why[200];
  sep_case_str(&c, name, sizeof name);
  cr_expect_eq(s, TW_OK, "%s: %s", name, tw_last_error());
  int ok = s == TW_OK;
  for (int r = 0; r < n; r++)
    if (c.msg[r][0]) {
      cr_expect_fail("%s, rank %d: %s", name, r, c.msg[r]);
      ok = 0;
    }
  if (s == TW_OK && !sep_conserved(&c, why, sizeof why)) {
    cr_expect_fail("%s: %s", name, why);
    ok = 0;
  }
  return ok;
}

Test(shard_ep_sweep, every_mesh_up_to_8_ranks_every_spec_every_distribution) {
  int meshes = 0, runs = 0, ok = 0, sizes[32][4];
  for (int n = 1; n <= 8; n *= 2) {
    int m = sep_meshes(n, sizes);
    for (int i = 0; i < m; i++, meshes++) {
      const char *specs[5];
      int ns = sep_specs(sizes[i], specs);
      for (int sp = 0; sp < ns; sp++)
        for (int dist = 0; dist < SEP_DISTS; dist++, runs++)
          ok += run_case(sizes[i], specs[sp], dist, (meshes + sp + dist) % 2 ? TW_BF16 : TW_F32,
                         (uint64_t)(meshes * 100 + sp * 10 + dist));
    }
  }
  cr_expect_eq(meshes, 35, "meshes of 1/2/4/8 ranks over (dp, fsdp, ep, tp): %d", meshes);
  cr_log_info("shard_ep_sweep: %d meshes, %d runs (specs x distributions), %d passed", meshes, runs, ok);
  printf("shard_ep_sweep: %d meshes, %d runs (specs x distributions), %d passed\n", meshes, runs, ok);
  cr_expect_eq(ok, runs);
}
