/* The pipeline's schedule (spec §2.2), its printer, its memory formulas and every
 * configuration rule (spec §1, §6 item 9): pure functions, nothing runs. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "twin/tw_pipeline.h"

static tw_pipeline_config cfg(int S, int M, int R, int d, int Lps) {
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = S; c.microbatches = M; c.repeats = R; c.delay = d; c.layers_per_stage = Lps;
  c.layers = S * R * Lps;
  c.mb_rows = 4;
  return c;
}

static tw_mesh mesh_of(const char *text) {
  tw_mesh m;
  cr_assert_eq(tw_mesh_parse(text, &m), TW_OK, "%s", tw_last_error());
  return m;
}

static char *schedule_text(const tw_pipeline_config *c, int F) {
  size_t need = 0;
  cr_assert_eq(tw_pipeline_format_schedule(c, F, NULL, 0, &need), TW_OK, "%s", tw_last_error());
  char *buf = (char *)malloc(need);
  size_t need2 = 0;
  cr_assert_eq(tw_pipeline_format_schedule(c, F, buf, need, &need2), TW_OK);
  cr_assert_eq(need, need2);
  cr_assert_eq(strlen(buf) + 1, need);
  return buf;
}

/* The example table of §2.2: S=4 M=4 R=2, cell = layer:microbatch. */
Test(pipeline_schedule, matches_the_spec_example_s4_m4_r2) {
  tw_pipeline_config c = cfg(4, 4, 2, 1, 1);
  cr_assert_eq(tw_pipeline_iterations(&c), 11);
  const char *want[11][4] = {
      {"L0:m0", "-", "-", "-"},         {"L0:m1", "L1:m0", "-", "-"},     {"L0:m2", "L1:m1", "L2:m0", "-"},
      {"L0:m3", "L1:m2", "L2:m1", "L3:m0"}, {"L4:m0", "L1:m3", "L2:m2", "L3:m1"}, {"L4:m1", "L5:m0", "L2:m3", "L3:m2"},
      {"L4:m2", "L5:m1", "L6:m0", "L3:m3"}, {"L4:m3", "L5:m2", "L6:m1", "L7:m0"}, {"-", "L5:m3", "L6:m2", "L7:m1"},
      {"-", "-", "L6:m3", "L7:m2"},     {"-", "-", "-", "L7:m3"}};
  for (int t = 0; t < 11; t++)
    for (int s = 0; s < 4; s++) {
      int m = -1, r = -1;
      char cell[16] = "-";
      if (tw_pipeline_slot(&c, t, s, &m, &r)) snprintf(cell, sizeof cell, "L%d:m%d", r * 4 + s, m);
      cr_assert_str_eq(cell, want[t][s], "t=%d s=%d", t, s);
    }
  char *txt = schedule_text(&c, 1);
  cr_assert(strstr(txt, "   6 | L4:m2    | L5:m1    | L6:m0    | L3:m3    | shift[0] (rotated)"), "%s", txt);
  cr_assert(strstr(txt, "  10 | -        | -        | -        | L7:m3    | (unused)"), "%s", txt);
  cr_assert(strstr(txt, "bubble d(S-1)/(MR+d(S-1)) = 3/11 = 0.2727"), "%s", txt);
  cr_assert(strstr(txt, "shift rotation S-1 -> 0 (M == dS)"), "%s", txt);
  free(txt);
}

Test(pipeline_schedule, every_microbatch_meets_every_layer_once_in_order) {
  int cases[][5] = {{2, 2, 1, 1, 1}, {3, 6, 2, 1, 1}, {4, 8, 3, 1, 1}, {4, 8, 2, 2, 1}, {2, 4, 2, 1, 2}, {5, 10, 3, 2, 1}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int *k = cases[i];
    tw_pipeline_config c = cfg(k[0], k[1], k[2], k[3], k[4]);
    int S = c.stages, M = c.microbatches, R = c.repeats;
    int *last_t = (int *)calloc((size_t)M, sizeof(int));
    int *next_layer = (int *)calloc((size_t)M, sizeof(int));
    for (int m = 0; m < M; m++) last_t[m] = -1;
    for (int t = 0; t < tw_pipeline_iterations(&c); t++)
      for (int s = 0; s < S; s++) {
        int m, r;
        if (!tw_pipeline_slot(&c, t, s, &m, &r)) continue;
        cr_assert_eq(r * S + s, next_layer[m], "case %zu: m%d runs stage-layer %d, expected %d", i, m, r * S + s, next_layer[m]);
        /* the producer ran at least d iterations earlier (the data has arrived) */
        if (last_t[m] >= 0) cr_assert_geq(t - last_t[m], c.delay, "case %zu: m%d at t=%d", i, m, t);
        next_layer[m]++;
        last_t[m] = t;
      }
    for (int m = 0; m < M; m++) cr_assert_eq(next_layer[m], R * S, "case %zu m%d", i, m);
    free(last_t);
    free(next_layer);
  }
}

Test(pipeline_schedule, bubble_fraction_is_the_theory) {
  tw_pipeline_config c = cfg(4, 8, 2, 2, 1);
  cr_assert_float_eq(tw_pipeline_bubble_fraction(&c), 6.0 / 22.0, 1e-15);
  c = cfg(1, 3, 2, 1, 1);
  cr_assert_float_eq(tw_pipeline_bubble_fraction(&c), 0.0, 0.0);
}

Test(pipeline_schedule, printer_names_circ_collectives_and_bsw_windows) {
  tw_pipeline_config c = cfg(3, 6, 2, 1, 1);
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  char *txt = schedule_text(&c, 2);
  cr_assert(strstr(txt, "stage-0 feedback: circ_storage (M > dS)"), "%s", txt);
  cr_assert(strstr(txt, "ppermute mover S-1 -> 0"), "%s", txt);
  cr_assert(strstr(txt, "fsdp=2 BSW"), "%s", txt);
  cr_assert(strstr(txt, "step 1: st0 w_next=W[1] st1 w_next=W[1] st2 w_next=W[1]"), "%s", txt);
  cr_assert(strstr(txt, "step 2: drain, no gather"), "%s", txt);
  free(txt);
  c.test_stale_window = 1; /* MaxText's index: stage 2 gathers repeat 0 again at step 1 */
  txt = schedule_text(&c, 2);
  cr_assert(strstr(txt, "step 1: st0 w_next=W[1] st1 w_next=W[1] st2 w_next=W[0]"), "%s", txt);
  free(txt);
  /* a short buffer is filled as far as it goes and stays terminated */
  char small[16];
  size_t need = 0;
  cr_assert_eq(tw_pipeline_format_schedule(&c, 2, small, sizeof small, &need), TW_OK);
  cr_assert_gt(need, sizeof small);
  cr_assert_eq(strlen(small), sizeof small - 1);
}

Test(pipeline_schedule, window_repeat_twin_vs_maxtext) {
  for (int S = 2; S <= 5; S++) {
    tw_pipeline_config c = cfg(S, 2 * S, 3, 1, 1);
    c.fsdp = TW_PIPELINE_FSDP_BSW;
    for (int r = 0; r < 3; r++)
      for (int s = 0; s < S; s++) {
        cr_assert_eq(tw_pipeline_window_repeat(&c, r, s), r);
        c.test_stale_window = 1;
        int stale = tw_pipeline_window_repeat(&c, r, s);
        c.test_stale_window = 0;
        /* MaxText's rep(rM + 1, s): right for s <= 1, one repeat behind for s >= 2, r >= 1 */
        cr_assert_eq(stale, (s >= 2 && r >= 1) ? r - 1 : r, "S=%d r=%d s=%d", S, r, s);
      }
  }
}

Test(pipeline_schedule, memory_formulas) {
  tw_pipeline_body b;
  cr_assert_eq(tw_pipeline_dense_body(8, 12, &b), TW_OK);
  tw_pipeline_config c = cfg(2, 4, 2, 1, 2);
  c.mb_rows = 6;
  cr_assert_eq(tw_pipeline_saved_bytes(&c, &b, 2), (size_t)4 * 2 * 3 * 8 * 4);
  cr_assert_eq(tw_pipeline_window_bytes(&c, &b, 2), (size_t)2 * 2 * (2 * 8 * 12) * 4);
  cr_assert_eq(tw_pipeline_window_bytes(&c, &b, 1), 0); /* F = 1: the shards in place */
  c = cfg(2, 4, 5, 1, 1);
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  cr_assert_eq(tw_pipeline_window_bytes(&c, &b, 1), (size_t)4 * (2 * 8 * 12) * 4); /* not R */
  cr_assert_eq(tw_pipeline_window_bytes(&c, &b, 1), tw_pipeline_window_bytes(&c, &b, 2));
}

/* The scan's peak allocation (tw_pipeline_peak_bytes), term by term: S=2 M=4 R=2 Lps=2 F=2,
 * E=8 H=12, mb=6 (3 rows a rank): a = 3*8*4 bytes; circ is used (M > dS). */
Test(pipeline_schedule, peak_bytes_formula) {
  tw_pipeline_body b;
  cr_assert_eq(tw_pipeline_dense_body(8, 12, &b), TW_OK);
  tw_pipeline_config c = cfg(2, 4, 2, 1, 2);
  c.mb_rows = 6;
  const size_t a = 3 * 8 * 4, saved = 4 * 2 * a, window = 2 * 2 * (2 * 8 * 12) * 4;
  const size_t call = 1 * a + 3 * a + (8 * 12 / 2) * 4 + 2 * 3 * 12 * 4; /* layer_in, g0 g1 tmp, shard, scratch */
  cr_assert_eq(tw_pipeline_peak_bytes(&c, &b, 2, 0), saved + window + (2 + 4 + 1 + 4) * a + call);
  cr_assert_eq(tw_pipeline_peak_bytes(&c, &b, 2, 1), saved + window + (2 + 4 + 1) * a + call);
  c = cfg(2, 2, 2, 1, 1); /* M == dS: rotate, no circ; BSW window */
  c.mb_rows = 6;
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  const size_t a1 = 6 * 8 * 4;
  cr_assert_eq(tw_pipeline_peak_bytes(&c, &b, 1, 0),
               2 * 2 * a1 + 4 * (2 * 8 * 12) * 4 + (1 + 4) * a1 + (1 + 3) * a1 + 8 * 12 * 4 + 2 * 6 * 12 * 4);
  c = cfg(2, 4, 1, 2, 1); /* d = 2: prev; plain at F = 1: no window */
  c.mb_rows = 6;
  cr_assert_eq(tw_pipeline_peak_bytes(&c, &b, 1, 1),
               4 * a1 + (2 + 4 + 1) * a1 + (1 + 3) * a1 + 8 * 12 * 4 + 2 * 6 * 12 * 4);
}

/* ---- configuration rules ------------------------------------------------------------ */
static void expect_rule(tw_pipeline_config c, const char *mesh, const char *rule, const char *detail) {
  tw_pipeline_body b;
  cr_assert_eq(tw_pipeline_dense_body(8, 12, &b), TW_OK);
  tw_mesh m = mesh_of(mesh);
  tw_status s = tw_pipeline_check(&c, &m, &b);
  cr_assert_eq(s, TW_ERR_INVALID_ARG, "%s: got %s", rule, tw_status_name(s));
  cr_assert(strstr(tw_last_error(), rule), "want %s in: %s", rule, tw_last_error());
  if (detail) cr_assert(strstr(tw_last_error(), detail), "want '%s' in: %s", detail, tw_last_error());
}

Test(pipeline_rules, valid_configurations_pass) {
  tw_pipeline_body b;
  cr_assert_eq(tw_pipeline_dense_body(8, 12, &b), TW_OK);
  tw_mesh m = mesh_of("pp=4,fsdp=2");
  tw_pipeline_config c = cfg(4, 8, 2, 2, 1);
  cr_assert_eq(tw_pipeline_check(&c, &m, &b), TW_OK, "%s", tw_last_error());
  c = cfg(4, 4, 2, 1, 1);
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  cr_assert_eq(tw_pipeline_check(&c, &m, &b), TW_OK, "%s", tw_last_error());
  m = mesh_of("fsdp=2,pp=4,dp=1"); /* axis order free; size-1 axes ignored */
  cr_assert_eq(tw_pipeline_check(&c, &m, &b), TW_OK, "%s", tw_last_error());
}

Test(pipeline_rules, microbatches_not_a_multiple_of_stages) {
  expect_rule(cfg(4, 6, 1, 1, 1), "pp=4", "pipeline.microbatches_divisible", "M = 6 microbatches must be a multiple of S = 4");
}
Test(pipeline_rules, fewer_microbatches_than_stages) {
  expect_rule(cfg(4, 2, 1, 1, 1), "pp=4", "pipeline.microbatches_divisible", "M < S");
}
Test(pipeline_rules, layers_not_s_r_lps) {
  tw_pipeline_config c = cfg(2, 4, 2, 1, 1);
  c.layers = 6;
  expect_rule(c, "pp=2", "pipeline.layers", "S*R*Lps = 2*2*1 = 4 but the model has 6 layers");
}
Test(pipeline_rules, bsw_needs_repeats) {
  tw_pipeline_config c = cfg(2, 4, 1, 1, 1);
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  expect_rule(c, "pp=2", "pipeline.bsw_repeats", "R = 1");
}
Test(pipeline_rules, bsw_needs_delay_1) {
  tw_pipeline_config c = cfg(2, 4, 2, 2, 1);
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  expect_rule(c, "pp=2", "pipeline.bsw_delay", "d = 2");
}
Test(pipeline_rules, bsw_needs_one_layer_per_stage) {
  tw_pipeline_config c = cfg(2, 4, 2, 1, 2);
  c.fsdp = TW_PIPELINE_FSDP_BSW;
  expect_rule(c, "pp=2", "pipeline.bsw_layers_per_stage", "Lps = 2");
}
Test(pipeline_rules, mesh_without_pp) {
  expect_rule(cfg(2, 4, 1, 1, 1), "fsdp=2", "pipeline.mesh_pp", "mesh fsdp=2 has no pp axis");
}
Test(pipeline_rules, mesh_with_another_axis) {
  expect_rule(cfg(2, 4, 1, 1, 1), "dp=2,pp=2", "pipeline.mesh_axes", "dp=2");
}
Test(pipeline_rules, stages_must_match_pp) {
  expect_rule(cfg(2, 4, 1, 1, 1), "pp=4", "pipeline.stages_match_mesh", "S = 2 stages but mesh pp=4 has pp=4");
}
Test(pipeline_rules, delay_is_1_or_2) {
  expect_rule(cfg(2, 8, 1, 3, 1), "pp=2", "pipeline.delay", "d = 3");
}
Test(pipeline_rules, delay_2_needs_2s_microbatches) {
  expect_rule(cfg(2, 2, 2, 2, 1), "pp=2", "pipeline.delay_microbatches", "M >= 2S, got M = 2, S = 2");
}
Test(pipeline_rules, rows_split_over_fsdp) {
  tw_pipeline_config c = cfg(2, 4, 1, 1, 1);
  c.mb_rows = 5;
  expect_rule(c, "pp=2,fsdp=2", "pipeline.fsdp_rows", "mb = 5 rows");
}
Test(pipeline_rules, parameter_rows_split_over_fsdp) {
  tw_pipeline_config c = cfg(2, 4, 1, 1, 1);
  c.mb_rows = 12;
  /* W2 has H = 12 rows, W1 E = 8: fsdp = 3 splits neither */
  expect_rule(c, "pp=2,fsdp=3", "pipeline.fsdp_rows", "parameter 0 of body 'dense' is [8, 12]");
}
Test(pipeline_rules, non_positive_counts) {
  expect_rule(cfg(2, 0, 1, 1, 1), "pp=2", "pipeline.positive", "M = 0");
}
Test(pipeline_rules, config_size) {
  tw_pipeline_config c = cfg(2, 4, 1, 1, 1);
  c.size = 8;
  expect_rule(c, "pp=2", "pipeline.config_size", "TW_PIPELINE_CONFIG_INIT");
}
Test(pipeline_rules, printer_checks_the_config_too) {
  tw_pipeline_config c = cfg(4, 6, 1, 1, 1);
  char buf[64];
  cr_assert_eq(tw_pipeline_format_schedule(&c, 1, buf, sizeof buf, NULL), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "pipeline.microbatches_divisible"), "%s", tw_last_error());
}
