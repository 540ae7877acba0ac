/* The pipeline fuzzer (pipeline/fuzz.h). */
#include "pipeline/fuzz.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pipeline/threads.h"

static uint64_t next_u64(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static int pick(uint64_t *s, int lo, int hi) { return lo + (int)(next_u64(s) % (uint64_t)(hi - lo + 1)); }

static void fix_layers(tw_pipeline_fuzz_case *c) { c->layers = c->S * c->R * c->Lps; }

void tw_pipeline_fuzz_draw(uint64_t *st, tw_pipeline_fuzz_case *c) {
  memset(c, 0, sizeof *c);
  const int fs[3] = {1, 2, 4};
  do {
    c->S = pick(st, 1, 4);
    c->F = fs[pick(st, 0, 2)];
  } while (c->S * c->F > 8);
  c->bsw = pick(st, 0, 2) == 0;
  c->d = c->bsw ? 1 : pick(st, 1, 2);
  c->R = pick(st, c->bsw ? 2 : 1, 3);
  c->Lps = c->bsw ? 1 : pick(st, 1, 2);
  int k = pick(st, c->d == 2 ? 2 : 1, 3);
  c->M = c->S * k;
  fix_layers(c);
  c->E = c->F * pick(st, 1, 3);
  c->H = c->F * pick(st, 1, 3);
  c->mb = c->F * pick(st, 1, 2);
  c->expect_rule = NULL;
  if (pick(st, 0, 3) != 0) return;
  /* break exactly one rule */
  switch (pick(st, 0, 6)) {
    case 0:
      if (c->S > 1) { c->M += pick(st, 1, c->S - 1); c->expect_rule = "pipeline.microbatches_divisible"; }
      else { c->layers += 1; c->expect_rule = "pipeline.layers"; } /* one stage: every M is a multiple */
      break;
    case 1: c->layers += pick(st, 1, 2); c->expect_rule = "pipeline.layers"; break;
    case 2: c->bsw = 1; c->d = 1; c->Lps = 1; c->R = 1; fix_layers(c); c->expect_rule = "pipeline.bsw_repeats"; break;
    case 3:
      c->bsw = 1; c->d = 2; c->Lps = 1; c->R = 2; c->M = 2 * c->S; fix_layers(c);
      c->expect_rule = "pipeline.bsw_delay";
      break;
    case 4: c->bsw = 1; c->d = 1; c->Lps = 2; c->R = 2; fix_layers(c); c->expect_rule = "pipeline.bsw_layers_per_stage"; break;
    case 5:
      if (c->F > 1) { c->mb += 1; c->expect_rule = "pipeline.fsdp_rows"; break; }
      c->d = 3; c->expect_rule = "pipeline.delay";
      break;
    default:
      if (c->d == 2) { c->M = c->S; c->expect_rule = "pipeline.delay_microbatches"; break; }
      c->d = 3; c->expect_rule = "pipeline.delay";
      break;
  }
}

const char *tw_pipeline_fuzz_case_str(const tw_pipeline_fuzz_case *c, char *buf, size_t n) {
  snprintf(buf, n, "S=%d M=%d R=%d d=%d Lps=%d layers=%d F=%d %s E=%lld H=%lld mb=%lld%s%s", c->S, c->M, c->R, c->d,
           c->Lps, c->layers, c->F, c->bsw ? "bsw" : "plain", (long long)c->E, (long long)c->H, (long long)c->mb,
           c->expect_rule ? " expect " : "", c->expect_rule ? c->expect_rule : "");
  return buf;
}

static void fill(float *p, int64_t n, uint64_t seed, float a) {
  for (int64_t i = 0; i < n; i++) p[i] = (float)((double)(next_u64(&seed) >> 11) * 0x1.0p-53 * 2.0 - 1.0) * a;
}

tw_status tw_pipeline_fuzz_run_case(const tw_pipeline_fuzz_case *c, uint64_t seed, int plant) {
  char cs[256];
  tw_pipeline_fuzz_case_str(c, cs, sizeof cs);
  tw_pipeline_threads_run run;
  memset(&run, 0, sizeof run);
  tw_pipeline_config cfg = TW_PIPELINE_CONFIG_INIT;
  cfg.stages = c->S; cfg.microbatches = c->M; cfg.repeats = c->R; cfg.delay = c->d;
  cfg.layers_per_stage = c->Lps; cfg.layers = c->layers; cfg.mb_rows = c->mb;
  cfg.fsdp = c->bsw ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  cfg.test_stale_window = plant == TW_PIPELINE_FUZZ_PLANT_STALE_WINDOW;
  run.cfg = cfg;
  run.fsdp = c->F;
  run.timeout_s = 20;
  TW_TRY(tw_pipeline_dense_body(c->E, c->H, &run.body));
  if (c->expect_rule) {
    /* invalid: the run must refuse with the rule's name; give it small real buffers */
    float dummy[64] = {0};
    run.x = dummy;
    for (int i = 0; i < 2; i++) run.w[i] = dummy;
    tw_status s = tw_pipeline_run_threads(&run);
    if (s == TW_ERR_INVALID_ARG && strstr(tw_last_error(), c->expect_rule)) return TW_OK;
    return tw_error(TW_ERR_INTERNAL, "fuzz %s: got %s (%s), want TW_ERR_INVALID_ARG naming %s", cs, tw_status_name(s),
                    tw_last_error(), c->expect_rule);
  }
  int64_t na = tw_pipeline_act_elems(&cfg, &run.body), nw[2];
  for (int i = 0; i < 2; i++) nw[i] = tw_pipeline_param_elems(&cfg, &run.body, i);
  float *x = (float *)malloc(4 * (size_t)na), *dy = (float *)malloc(4 * (size_t)na);
  float *y = (float *)calloc((size_t)na, 4), *dx = (float *)calloc((size_t)na, 4);
  float *ry = (float *)calloc((size_t)na, 4), *rdx = (float *)calloc((size_t)na, 4);
  float *w[2], *dw[2], *rdw[2];
  for (int i = 0; i < 2; i++) {
    w[i] = (float *)malloc(4 * (size_t)nw[i]);
    dw[i] = (float *)calloc((size_t)nw[i], 4);
    rdw[i] = (float *)calloc((size_t)nw[i], 4);
  }
  tw_status st = TW_OK;
  if (!x || !dy || !y || !dx || !ry || !rdx || !w[0] || !w[1] || !dw[0] || !dw[1] || !rdw[0] || !rdw[1])
    st = tw_error(TW_ERR_MEMORY, "fuzz: out of host memory");
  if (st == TW_OK) {
    fill(x, na, seed, 1);
    fill(dy, na, seed + 1, 1);
    for (int i = 0; i < 2; i++) fill(w[i], nw[i], seed + 2 + (uint64_t)i, (float)(1.0 / sqrt((double)run.body.param_rows[i])));
    run.x = x; run.dy = dy; run.y = y; run.dx = dx;
    for (int i = 0; i < 2; i++) { run.w[i] = w[i]; run.dw[i] = dw[i]; }
    st = tw_pipeline_run_threads(&run);
    if (st != TW_OK) st = tw_error(st, "fuzz %s: the valid case failed: %s", cs, tw_last_error());
  }
  if (st == TW_OK) {
    tw_ctx *ctx = NULL;
    tw_ctx_config cc = TW_CTX_CONFIG_INIT;
    st = tw_ctx_create(&ctx, &cc);
    cfg.test_stale_window = 0; /* the oracle never has the planted bug */
    const float *cw[2] = {w[0], w[1]};
    float *const rw[2] = {rdw[0], rdw[1]};
    if (st == TW_OK) st = tw_pipeline_sequential_ref(ctx, &cfg, c->F, &run.body, cw, x, ry, dy, rdx, rw);
    tw_ctx_destroy(ctx);
  }
  const char *names[4] = {"y", "dx", "dW1", "dW2"};
  const float *got[4] = {y, dx, dw[0], dw[1]}, *want[4] = {ry, rdx, rdw[0], rdw[1]};
  int64_t ns[4] = {na, na, nw[0], nw[1]};
  for (int t = 0; t < 4 && st == TW_OK; t++) {
    int exact = t < 2 || c->bsw || c->F == 1;
    double mx = 0;
    for (int64_t i = 0; i < ns[t]; i++) mx = fmax(mx, fabs((double)want[t][i]));
    double terms = (double)c->M * c->F, tol = exact ? 0 : 2.0 * terms * terms * terms * ldexp(1.0, -24) * mx;
    for (int64_t i = 0; i < ns[t]; i++) {
      int bad = exact ? memcmp(&got[t][i], &want[t][i], 4) != 0 : !(fabs((double)got[t][i] - want[t][i]) <= tol);
      if (bad) {
        st = tw_error(TW_ERR_INTERNAL, "fuzz %s: %s[%lld] = %.9g, unpipelined %.9g (%s)", cs, names[t], (long long)i,
                      (double)got[t][i], (double)want[t][i], exact ? "must be bit-identical" : "reassociation bound");
        break;
      }
    }
  }
  free(x); free(dy); free(y); free(dx); free(ry); free(rdx);
  for (int i = 0; i < 2; i++) { free(w[i]); free(dw[i]); free(rdw[i]); }
  return st;
}

/* Candidate smaller cases of c, kept valid (or breaking the same rule). */
static int shrink_step(tw_pipeline_fuzz_case *c, uint64_t seed, int plant) {
  for (int field = 0; field < 8; field++) {
    for (int attempt = 0; attempt < 2; attempt++) {
      tw_pipeline_fuzz_case t = *c;
      int changed = 0;
      switch (field) {
        case 0: if (t.S > 1) { int k = t.M / t.S; t.S--; t.M = t.S * k; changed = 1; } break;
        case 1: if (t.M > t.S && t.M - t.S >= (t.d == 2 ? 2 * t.S : t.S)) { t.M -= t.S; changed = 1; } break;
        case 2: if (t.R > (t.bsw ? 2 : 1)) { t.R--; changed = 1; } break;
        case 3: if (t.Lps > 1) { t.Lps--; changed = 1; } break;
        case 4: if (t.F > 1) { t.E /= t.F; t.H /= t.F; t.mb /= t.F; t.F /= 2; t.E *= t.F; t.H *= t.F; t.mb *= t.F; changed = 1; } break;
        case 5: if (t.E > t.F) { t.E -= t.F; changed = 1; } break;
        case 6: if (t.H > t.F) { t.H -= t.F; changed = 1; } break;
        case 7: if (t.mb > t.F) { t.mb -= t.F; changed = 1; } break;
      }
      if (!changed) break;
      if (!t.expect_rule || strcmp(t.expect_rule, "pipeline.layers") != 0) fix_layers(&t);
      if (t.expect_rule) break; /* invalid cases: the rule's values matter; keep them */
      if (tw_pipeline_fuzz_run_case(&t, seed, plant) != TW_OK) {
        *c = t;
        return 1;
      }
      break;
    }
  }
  return 0;
}

int tw_pipeline_fuzz_shrink(tw_pipeline_fuzz_case *c, uint64_t seed, int plant) {
  int steps = 0;
  while (steps < 64 && shrink_step(c, seed, plant)) steps++;
  return steps;
}

tw_status tw_pipeline_fuzz(uint64_t seed, int max_cases, double seconds, int plant, tw_pipeline_fuzz_report *rep) {
  if (!rep) return tw_error(TW_ERR_NULL, "pipeline_fuzz: rep is NULL");
  memset(rep, 0, sizeof *rep);
  uint64_t st = seed;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < max_cases; i++) {
    if (seconds > 0) {
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) > seconds) break;
    }
    tw_pipeline_fuzz_case c;
    tw_pipeline_fuzz_draw(&st, &c);
    uint64_t data_seed = next_u64(&st);
    rep->cases++;
    if (c.expect_rule) rep->invalid++;
    else rep->valid++;
    if (tw_pipeline_fuzz_run_case(&c, data_seed, plant) == TW_OK) continue;
    rep->failures++;
    rep->first_failure = c;
    tw_pipeline_fuzz_shrink(&c, data_seed, plant);
    rep->shrunk = c;
    tw_pipeline_fuzz_run_case(&c, data_seed, plant);
    snprintf(rep->message, sizeof rep->message, "%s", tw_last_error());
    break;
  }
  return TW_OK;
}
