/* CI: `twin fuzz --backend ref --seconds 60` in-process (every op, the oracle's
 * self-consistency) must run clean; the case rate goes to the test log. TWIN_FUZZ_SECONDS
 * overrides the duration. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz/fuzz_internal.h"

Test(fuzz_ci, ref_backend_runs_clean_for_60_seconds, .timeout = 240) {
  fz_options o;
  fz_options_default(&o);
  const char *sec = getenv("TWIN_FUZZ_SECONDS");
  o.seconds = sec && *sec ? atof(sec) : 60;
  o.seed = 20261121;
  o.quiet = 1;
  fz_summary s;
  int rc = fz_run(&o, &s);
  fz_summary_print(&s, stdout);
  printf("twin fuzz --backend ref --seconds %g: %lld cases, %.1f cases/s\n", o.seconds, (long long)s.cases,
         s.seconds > 0 ? s.cases / s.seconds : 0.0);
  fflush(stdout);
  cr_assert_eq(rc, 0, "%lld failing cases; first repro: %s", (long long)s.failures, s.first_repro);
  cr_assert(s.cases > 100, "only %lld cases in %g s", (long long)s.cases, o.seconds);
}
