/* The pipeline fuzzer (pipeline/fuzz.h) as a library: clean runs over drawn configurations
 * (valid ones against the unpipelined model, invalid ones must name their rule), and a planted
 * stale-window bug (MaxText's BSW index, spec §4.3) that it must catch and shrink. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <string.h>

#include "pipeline/fuzz.h"
#include "test_util.h"

Test(pipeline_fuzz, draws_valid_and_invalid_cases_and_all_behave) {
  tw_pipeline_fuzz_report rep;
  cr_assert_eq(tw_pipeline_fuzz(20261124, 160, 0, TW_PIPELINE_FUZZ_PLANT_NONE, &rep), TW_OK);
  char buf[256];
  cr_assert_eq(rep.failures, 0, "%s -> shrunk %s: %s", tw_pipeline_fuzz_case_str(&rep.first_failure, buf, sizeof buf),
               tw_pipeline_fuzz_case_str(&rep.shrunk, buf, sizeof buf), rep.message);
  cr_assert_eq(rep.cases, 160);
  cr_assert_geq(rep.invalid, 20, "only %d invalid cases", rep.invalid);
  cr_assert_geq(rep.valid, 80, "only %d valid cases", rep.valid);
  cr_log_info("%d cases: %d valid, %d invalid", rep.cases, rep.valid, rep.invalid);
}

Test(pipeline_fuzz, every_invalid_kind_is_drawn_and_named) {
  const char *rules[] = {"pipeline.microbatches_divisible", "pipeline.layers", "pipeline.bsw_repeats",
                         "pipeline.bsw_delay", "pipeline.bsw_layers_per_stage", "pipeline.fsdp_rows",
                         "pipeline.delay", "pipeline.delay_microbatches"};
  int seen[8] = {0};
  uint64_t st = 7;
  for (int i = 0; i < 2000; i++) {
    tw_pipeline_fuzz_case c;
    tw_pipeline_fuzz_draw(&st, &c);
    for (int k = 0; k < 8 && c.expect_rule; k++)
      if (strcmp(c.expect_rule, rules[k]) == 0 && !seen[k]) {
        seen[k] = 1;
        char buf[256];
        cr_assert_eq(tw_pipeline_fuzz_run_case(&c, 1, 0), TW_OK, "%s: %s", tw_pipeline_fuzz_case_str(&c, buf, sizeof buf),
                     tw_last_error());
      }
  }
  for (int k = 0; k < 8; k++) cr_assert(seen[k], "the generator never drew %s", rules[k]);
}

Test(pipeline_fuzz, planted_stale_window_is_caught_and_shrunk) {
  tw_pipeline_fuzz_report rep;
  cr_assert_eq(tw_pipeline_fuzz(99, 400, 0, TW_PIPELINE_FUZZ_PLANT_STALE_WINDOW, &rep), TW_OK);
  char a[256], b[256];
  cr_assert_eq(rep.failures, 1, "the planted stale window went unnoticed in %d cases", rep.cases);
  cr_log_info("caught after %d cases: %s, shrunk to %s: %s", rep.cases,
              tw_pipeline_fuzz_case_str(&rep.first_failure, a, sizeof a), tw_pipeline_fuzz_case_str(&rep.shrunk, b, sizeof b),
              rep.message);
  /* the smallest failing case: BSW with 3 stages (S = 2 is where MaxText's window is right),
   * 2 repeats, one microbatch per stage, one rank per stage, 1-wide shapes */
  const tw_pipeline_fuzz_case *s = &rep.shrunk;
  cr_assert(s->bsw && s->S == 3 && s->R == 2 && s->M == 3 && s->F == 1 && s->E == 1 && s->H == 1 && s->mb == 1,
            "shrunk to %s", b);
  cr_assert(strstr(rep.message, "unpipelined"), "%s", rep.message);
  /* without the plant the shrunk case passes */
  cr_assert_eq(tw_pipeline_fuzz_run_case(s, 5, TW_PIPELINE_FUZZ_PLANT_NONE), TW_OK, "%s", tw_last_error());
}
