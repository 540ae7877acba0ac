/* Planted bugs (fuzz/planted.c) are caught within 60 s of fuzzing and shrunk to a case of at
 * most a few hundred elements, whose repro replays the failure with the bug and passes
 * without it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_internal.h"

static void caught_and_shrunk(const char *plant, const char *op) {
  const char *t = getenv("TEST_TMPDIR");
  char out[512];
  snprintf(out, sizeof out, "%s/planted-%s", t && *t ? t : "/tmp", plant);
  fz_options o;
  fz_options_default(&o);
  o.plant = plant;
  fz_op fop;
  cr_assert_eq(fz_op_from_name(op, &fop), 0);
  o.op_mask = 1 << fop;
  o.seconds = 60;
  o.seed = 1;
  o.max_failures = 1;
  o.shrink_seconds = 30;
  o.out_dir = out;
  o.quiet = 1;
  fz_summary s;
  cr_assert_eq(fz_run(&o, &s), 1, "%s was not caught in 60 s (%lld cases)", plant, (long long)s.cases);
  cr_assert_eq(s.errors, 0);
  cr_assert(s.first_failure_seconds >= 0 && s.first_failure_seconds <= 60);
  cr_assert(s.shrunk_elements >= 0 && s.shrunk_elements <= 300, "%s shrunk only to %lld elements", plant,
            (long long)s.shrunk_elements);
  printf("%s: caught after %lld cases in %.2f s, shrunk to %lld elements: %s\n", plant, (long long)s.cases,
         s.first_failure_seconds, (long long)s.shrunk_elements, s.first_repro);
  fz_result r;
  cr_assert_eq(fz_replay(s.first_repro, TW_BACKEND_REF, plant, &r), 1, "the repro does not fail with %s", plant);
  cr_assert_eq(fz_replay(s.first_repro, TW_BACKEND_REF, NULL, &r), 0, "the repro fails without the bug: %s",
               r.message);
}

Test(fuzz_planted, off_by_one_tile_bound_in_grouped_gemm) { caught_and_shrunk("tile_off_by_one", "grouped_gemm"); }
Test(fuzz_planted, round_toward_zero_in_quantize) { caught_and_shrunk("round_toward_zero", "quantize"); }
Test(fuzz_planted, empty_group_unwritten_in_wgrad) { caught_and_shrunk("empty_group_unwritten", "wgrad"); }

Test(fuzz_planted, every_plant_has_a_test) { cr_assert_eq(fz_plant_count(), 3); }
