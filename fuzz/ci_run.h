/* The timed CI fuzz runs (ref_fuzz_test.c, sharded_fuzz_test.c): run `twin fuzz` in-process for
 * $env seconds (default `seconds`), print the summary and the case rate to the test log, and
 * require a clean run of more than 100 cases. */
#ifndef TWIN_FUZZ_CI_RUN_H
#define TWIN_FUZZ_CI_RUN_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz/fuzz_internal.h"

static inline void ci_fuzz_run(fz_options *o, const char *env, double seconds, const char *cmd, fz_summary *s) {
  const char *sec = getenv(env);
  o->seconds = sec && *sec ? atof(sec) : seconds;
  o->quiet = 1;
  int rc = fz_run(o, s);
  fz_summary_print(s, stdout);
  printf("%s --seconds %g: %lld cases, %.1f cases/s\n", cmd, o->seconds, (long long)s->cases,
         s->seconds > 0 ? s->cases / s->seconds : 0.0);
  fflush(stdout);
  cr_assert_eq(rc, 0, "%lld failing cases; first repro: %s", (long long)s->failures, s->first_repro);
  cr_assert(s->cases > 100, "only %lld cases in %g s", (long long)s->cases, o->seconds);
}

#endif
