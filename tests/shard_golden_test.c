/* The sharding golden sweep (shard/golden.h), one test per rule: every mesh of 1, 2, 4, 8
 * ranks over the rule's axes, every partition spec per operand (single axes and ordered pairs,
 * invalid ones included), fwd/dgrad/wgrad; sharded ref on threads vs unsharded ref. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shard/golden.h"

static void sweep(const char *only, long min_run) {
  tw_golden_cfg cfg = TW_GOLDEN_CFG_INIT;
  cfg.only = only;
  tw_golden_row *rows = NULL;
  int n = 0;
  cr_assert_eq(tw_golden_sharding(&cfg, &rows, &n), TW_OK, "%s", tw_last_error());
  long run = 0, expected = 0;
  for (int i = 0; i < n; i++) {
    const tw_golden_row *r = &rows[i];
    cr_expect(r->failed == 0 && r->wrong_errors == 0, "%s %s mesh %s: %ld failed, %ld wrong errors; first: %s", r->rule,
              tw_pass_name(r->pass), r->mesh, r->failed, r->wrong_errors, r->first_problem);
    cr_expect_eq(r->skipped, 0);
    cr_expect_eq(r->exact_equal, r->exact_cases, "%s %s %s", r->rule, tw_pass_name(r->pass), r->mesh);
    run += r->run;
    expected += r->expected_errors;
  }
  /* the sweep really ran: every rule has a 1-rank row, 8-rank rows and valid cases */
  cr_assert(n >= 10, "%d rows", n);
  cr_assert(run >= min_run, "%s: only %ld cases ran", only, run);
  cr_assert(expected > 0);
  free(rows);
}

Test(shard_golden, dense2) { sweep("dense2", 3000); }
Test(shard_golden, dense3) { sweep("dense3", 10000); }
Test(shard_golden, grouped_gemm) { sweep("grouped_gemm", 10000); }
Test(shard_golden, quantize) { sweep("quantize.", 500); }

/* a rule that forces a gpu kernel version is left out of the ref sweep, and asking for it alone
 * there says why */
Test(shard_golden, a_gpu_kernel_rule_is_gpu_only) {
  tw_golden_cfg cfg = TW_GOLDEN_CFG_INIT;
  cfg.only = "grouped_gemm.fp8.exact_kernel";
  tw_golden_row *rows = NULL;
  int n = 0;
  cr_assert_eq(tw_golden_sharding(&cfg, &rows, &n), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "gpu backend only"), "%s", tw_last_error());
  cr_assert_null(rows);
}
