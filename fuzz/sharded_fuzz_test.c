/* CI: `twin fuzz --backend ref --mesh all --seconds 30` in-process (sharded cases on meshes of
 * 1-8 thread ranks vs the unsharded oracle) must run clean and reach every kind of plan step;
 * the case rate goes to the test log. TWIN_FUZZ_MESH_SECONDS overrides the duration. */
#include "fuzz/ci_run.h"

Test(fuzz_ci, sharded_ref_runs_clean_for_30_seconds, .timeout = 180) {
  fz_options o;
  fz_options_default(&o);
  o.seed = 20261122;
  o.mesh = "all";
  fz_summary s;
  ci_fuzz_run(&o, "TWIN_FUZZ_MESH_SECONDS", 30, "twin fuzz --backend ref --mesh all", &s);
  /* it really sharded: 8-rank meshes, refused invalid cases, and every kind of step ran */
  cr_expect(s.by_ranks[8] > 0 && s.by_ranks[2] > 0, "ranks 2: %lld, 8: %lld", (long long)s.by_ranks[2],
            (long long)s.by_ranks[8]);
  cr_expect(s.expected_errors > 0);
  for (int k = 0; k < 6; k++) cr_expect(s.steps[k] > 0, "no plan step of kind %d ran", k);
}
