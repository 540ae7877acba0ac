/* Planted bugs (fuzz/planted.c) are caught within 60 s of fuzzing and shrunk to a case of at
 * most a few hundred elements, whose repro replays the failure with the bug and passes
 * without it: the ops-table bugs unsharded, the communicator bugs (and one ops-table bug)
 * through sharded runs (--mesh all). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_internal.h"

static void caught_and_shrunk_on(const char *plant, const char *op, const char *mesh) {
  const char *t = getenv("TEST_TMPDIR");
  char out[512];
  snprintf(out, sizeof out, "%s/planted-%s%s", t && *t ? t : "/tmp", plant, mesh ? "-mesh" : "");
  fz_options o;
  fz_options_default(&o);
  o.plant = plant;
  o.mesh = mesh;
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
  if (mesh) { /* a communicator bug needs more than one rank to show */
    fz_case c;
    cr_assert_eq(fz_case_read(s.first_repro, &c), TW_OK);
    cr_assert(c.sharded);
    if (fz_plant_is_comm(plant)) cr_expect(tw_mesh_ranks(&c.mesh) > 1);
    printf("  shrunk to mesh %d ranks\n", tw_mesh_ranks(&c.mesh));
    fz_case_free(&c);
  }
}

static void caught_and_shrunk(const char *plant, const char *op) { caught_and_shrunk_on(plant, op, NULL); }

Test(fuzz_planted, off_by_one_tile_bound_in_grouped_gemm) { caught_and_shrunk("tile_off_by_one", "grouped_gemm"); }
Test(fuzz_planted, round_toward_zero_in_quantize) { caught_and_shrunk("round_toward_zero", "quantize"); }
Test(fuzz_planted, empty_group_unwritten_in_wgrad) { caught_and_shrunk("empty_group_unwritten", "wgrad"); }

/* Sharded runs (--mesh all): the communicator bugs, and an ops-table bug seen through the plan. */
Test(fuzz_planted, amax_reduce_dropped_in_sharded_quantize) {
  caught_and_shrunk_on("amax_reduce_dropped", "quantize", "all");
}
Test(fuzz_planted, reduce_scatter_shifted_in_sharded_gemm) {
  caught_and_shrunk_on("reduce_scatter_shifted", "gemm", "all");
}
Test(fuzz_planted, empty_group_unwritten_through_a_sharded_wgrad) {
  caught_and_shrunk_on("empty_group_unwritten", "wgrad", "all");
}

Test(fuzz_planted, every_plant_has_a_test) { cr_assert_eq(fz_plant_count(), 5); }

Test(fuzz_planted, communicator_bugs_need_a_mesh) {
  fz_options o;
  fz_options_default(&o);
  o.plant = "amax_reduce_dropped";
  o.cases = 3;
  o.quiet = 1;
  fz_summary s;
  cr_assert_eq(fz_run(&o, &s), 2);
}
