/* CI: `twin fuzz --backend ref --seconds 60` in-process (every op, the oracle's
 * self-consistency) must run clean; the case rate goes to the test log. TWIN_FUZZ_SECONDS
 * overrides the duration. */
#include "fuzz/ci_run.h"

Test(fuzz_ci, ref_backend_runs_clean_for_60_seconds, .timeout = 240) {
  fz_options o;
  fz_options_default(&o);
  o.seed = 20261121;
  fz_summary s;
  ci_fuzz_run(&o, "TWIN_FUZZ_SECONDS", 60, "twin fuzz --backend ref", &s);
}
