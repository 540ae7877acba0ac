/* The EP / router fuzzer in CI: the oracle passes a fixed budget of random cases; each
 * planted EP bug (a route sent to the wrong rank; the last row of an exactly full slab
 * dropped) is caught within seconds and shrunk to a small case, whose one-line repro parses
 * back and still fails. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "fuzz/ep_fuzz.h"
#include "tests/test_util.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

Test(fuzz_ep, oracle_passes_random_cases) {
  tw_ep_fuzz_report rep;
  double t0 = now();
  cr_assert_eq(tw_ep_fuzz_run(2026, 2000, 60.0, TW_EP_PLANT_NONE, NULL, &rep), TW_OK);
  char buf[512];
  cr_expect(!rep.found, "oracle failed on %s: %s", tw_ep_fuzz_case_str(&rep.shrunk, buf, sizeof buf), rep.message);
  cr_expect_geq(rep.cases, 100, "ran %d cases", rep.cases);
  printf("fuzz_ep oracle: %d cases in %.2f s\n", rep.cases, now() - t0);
}

Test(fuzz_ep, router_properties_and_finite_differences) {
  tw_ep_fuzz_report rep;
  cr_assert_eq(tw_router_fuzz_run(77, 400, &rep), TW_OK);
  cr_expect(!rep.found, "router: %s", rep.message);
  cr_expect_eq(rep.cases, 400);
}

static void planted(tw_ep_plant p, int max_size) {
  tw_ep_fuzz_report rep;
  char *dir = tt_make_tmpdir("ep_fuzz");
  double t0 = now();
  cr_assert_eq(tw_ep_fuzz_run(1, 2000, 30.0, p, dir, &rep), TW_OK);
  double dt = now() - t0;
  char a[512], b[512];
  cr_assert(rep.found, "plant %s not caught in %d cases", tw_ep_plant_name(p), rep.cases);
  printf("plant %s: caught after %d cases, %.2f s; %s -> %s (%d shrink steps): %s\n", tw_ep_plant_name(p), rep.cases, dt,
         tw_ep_fuzz_case_str(&rep.first, a, sizeof a), tw_ep_fuzz_case_str(&rep.shrunk, b, sizeof b), rep.shrink_steps,
         rep.message);
  cr_expect_lt(dt, 20.0, "caught in %.1f s", dt);
  cr_expect_leq(tw_ep_fuzz_case_size(&rep.shrunk), max_size, "shrunk to %s", b);
  /* the repro parses back and still fails; the oracle passes it */
  FILE *f = fopen(rep.repro, "r");
  cr_assert(f, "no repro at %s", rep.repro);
  char line[1024];
  cr_assert(fgets(line, sizeof line, f) && fgets(line, sizeof line, f));
  fclose(f);
  tw_ep_fuzz_case c;
  cr_assert_eq(tw_ep_fuzz_case_parse(line, &c), TW_OK, "%s", tw_last_error());
  cr_expect_neq(tw_ep_fuzz_check(&c, p), TW_OK);
  cr_expect_eq(tw_ep_fuzz_check(&c, TW_EP_PLANT_NONE), TW_OK, "%s", tw_last_error());
  free(dir);
}

Test(fuzz_ep, planted_wrong_rank_is_caught_and_shrunk) { planted(TW_EP_PLANT_WRONG_RANK, 12); }
Test(fuzz_ep, planted_drop_last_of_full_slab_is_caught_and_shrunk) { planted(TW_EP_PLANT_DROP_LAST_FULL, 8); }

Test(fuzz_ep, cases_on_a_mesh_run_every_ep_group) {
  tw_ep_fuzz_case c;
  const char *line = "n=2 E=4 k=2 H=3 A=2 R=0 dist=0 drop=0 dtype=0 seed=5 T=3,4 mesh=2,1,2";
  cr_assert_eq(tw_ep_fuzz_case_parse(line, &c), TW_OK, "%s", tw_last_error());
  cr_expect_eq(c.dp * c.fsdp * c.n * c.tp, 8);
  cr_expect_eq(tw_ep_fuzz_check(&c, TW_EP_PLANT_NONE), TW_OK, "%s", tw_last_error());
  cr_expect_neq(tw_ep_fuzz_check(&c, TW_EP_PLANT_WRONG_RANK), TW_OK);
  char buf[512];
  cr_expect_str_eq(tw_ep_fuzz_case_str(&c, buf, sizeof buf), line);
}
