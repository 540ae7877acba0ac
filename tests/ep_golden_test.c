/* EP dispatch / combine and both backward passes against the independent NumPy goldens of
 * golden/gen_ep.py, bit for bit (twin fixes the slot order; every f32 sum runs in the
 * documented order), through the golden runner that `twin check` uses (golden/routing.c).
 * Ranks are threads; expert outputs hold NaN on padding rows, which must not leak into any
 * result. A case with expect_error = 1 must be refused by every rank, naming the receive rows. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/runner.h"
#include "tests/test_util.h"

Test(ep_golden, numpy_goldens) {
  char root[1024];
  snprintf(root, sizeof root, "%s/ep", tt_golden_root());
  char **dirs = NULL;
  int n = tw_golden_list_cases(root, &dirs);
  cr_assert_geq(n, 9, "%d ep golden cases under %s: %s", n, root, tw_last_error());
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK);
  int compared = 0;
  for (int i = 0; i < n; i++) {
    tw_golden_result res;
    tw_status s = tw_golden_run_case(ctx, dirs[i], &res);
    cr_expect_eq(s, TW_OK, "%s: %s", dirs[i], tw_last_error());
    cr_expect(res.passed, "%s: %s", res.name, res.detail);
    compared += res.outputs;
  }
  /* 8 cases x ranks x 11 outputs (+ scales) and one capacity error: every output was compared */
  cr_expect_gt(compared, 9 * 10, "only %d outputs compared", compared);
  tw_ctx_destroy(ctx);
  tw_golden_free_list(dirs, n);
}

/* A golden that differs in one byte fails, naming the output and rank. */
Test(ep_golden, a_changed_golden_byte_is_caught) {
  char root[1024];
  snprintf(root, sizeof root, "%s/ep/ep2_e4_k2_a4_bf16", tt_golden_root());
  char tmp[] = "/tmp/twin_ep_golden_XXXXXX";
  cr_assert_not_null(mkdtemp(tmp));
  char cmd[3000];
  snprintf(cmd, sizeof cmd, "cp -rL '%s' '%s/case'", root, tmp);
  cr_assert_eq(system(cmd), 0);
  /* flip the last byte of rank 1's combined output */
  snprintf(cmd, sizeof cmd, "%s/case/out_1.npy", tmp);
  FILE *f = fopen(cmd, "r+b");
  cr_assert_not_null(f);
  fseek(f, -1, SEEK_END);
  int c = fgetc(f);
  fseek(f, -1, SEEK_END);
  fputc(c ^ 1, f);
  fclose(f);
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK);
  tw_golden_result res;
  snprintf(cmd, sizeof cmd, "%s/case", tmp);
  cr_assert_eq(tw_golden_run_case(ctx, cmd, &res), TW_OK, "%s", tw_last_error());
  cr_expect_not(res.passed);
  cr_expect(strstr(res.detail, "out[rank 1]"), "%s", res.detail);
  tw_ctx_destroy(ctx);
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
  cr_assert_eq(system(cmd), 0);
}
