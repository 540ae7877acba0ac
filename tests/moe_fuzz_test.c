/* The MoE fuzzer (moe/fuzz.h): a seeded run is clean, and the planted sharding bug (expert
 * weight gradients not summed over dp) is found and shrunk. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <string.h>

#include "moe/fuzz.h"

Test(moe_fuzz, seeded_cases_are_clean) {
  tw_moe_fuzz_report rep;
  cr_assert_eq(tw_moe_fuzz(2026, 150, 0, TW_MOE_FUZZ_PLANT_NONE, &rep), TW_OK);
  char b[512];
  cr_assert_eq(rep.failures, 0, "%s\n  shrunk: %s", rep.message, tw_moe_fuzz_case_str(&rep.shrunk, b, sizeof b));
  cr_assert_geq(rep.invalid, 10);
  cr_log_info("moe fuzz: %d cases (%d valid, %d invalid) clean", rep.cases, rep.valid, rep.invalid);
}

Test(moe_fuzz, planted_skip_of_the_dp_sum_is_found) {
  tw_moe_fuzz_report rep;
  cr_assert_eq(tw_moe_fuzz(7, 400, 0, TW_MOE_FUZZ_PLANT_SKIP_DP_REDUCE, &rep), TW_OK);
  cr_assert_eq(rep.failures, 1, "the planted bug survived %d cases", rep.cases);
  char b[512];
  cr_assert(strstr(rep.message, "dwi") || strstr(rep.message, "dwo"), "unexpected failure: %s", rep.message);
  cr_log_info("moe fuzz plant found after %d cases, shrunk to %s: %s", rep.cases,
              tw_moe_fuzz_case_str(&rep.shrunk, b, sizeof b), rep.message);
}
