/* CI: `twin fuzz --backend ref --mesh all --seconds 30` in-process (sharded cases on meshes of
 * 1-8 thread ranks vs the unsharded oracle) must run clean and reach every kind of plan step;
 * the case rate goes to the test log. TWIN_FUZZ_MESH_SECONDS overrides the duration. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz/fuzz_internal.h"

Test(fuzz_ci, sharded_ref_runs_clean_for_30_seconds, .timeout = 180) {
  fz_options o;
  fz_options_default(&o);
  const char *sec = getenv("TWIN_FUZZ_MESH_SECONDS");
  o.seconds = sec && *sec ? atof(sec) : 30;
  o.seed = 20261122;
  o.mesh = "all";
  o.quiet = 1;
  fz_summary s;
  int rc = fz_run(&o, &s);
  fz_summary_print(&s, stdout);
  printf("twin fuzz --backend ref --mesh all --seconds %g: %lld cases, %.1f cases/s\n", o.seconds, (long long)s.cases,
         s.seconds > 0 ? s.cases / s.seconds : 0.0);
  fflush(stdout);
  cr_assert_eq(rc, 0, "%lld failing cases; first repro: %s", (long long)s.failures, s.first_repro);
  cr_assert(s.cases > 100, "only %lld cases in %g s", (long long)s.cases, o.seconds);
  /* it really sharded: 8-rank meshes, refused invalid cases, and every kind of step ran */
  cr_expect(s.by_ranks[8] > 0 && s.by_ranks[2] > 0, "ranks 2: %lld, 8: %lld", (long long)s.by_ranks[2],
            (long long)s.by_ranks[8]);
  cr_expect(s.expected_errors > 0);
  for (int k = 0; k < 6; k++) cr_expect(s.steps[k] > 0, "no plan step of kind %d ran", k);
}
