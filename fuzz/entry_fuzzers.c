/* The fuzzers of the registry entries that bring their own (ops/registry.h fuzz_run): the
 * router and EP (fuzz/ep_fuzz.h) and the pipeline (pipeline/fuzz.h), in the shape `twin fuzz`
 * runs them: --cases or --seconds, a seed, a plant by name, a repro line for a failure. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "fuzz/ep_fuzz.h"
#include "ops/registry.h"
#include "moe/fuzz.h"
#include "pipeline/fuzz.h"

static double since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

/* <out_dir>/<op>-<seed>.txt: the failure and the shrunk case, one line each */
static void write_repro(const tw_op_fuzz_opts *o, FILE *out, const char *op, const char *message, const char *shrunk) {
  if (!o->out_dir) return;
  char path[1024];
  mkdir(o->out_dir, 0755);
  snprintf(path, sizeof path, "%s/%s-%llu.txt", o->out_dir, op, (unsigned long long)o->seed);
  FILE *f = fopen(path, "w");
  if (!f) return;
  fprintf(f, "# twin %s fuzz repro (seed %llu): %s\n%s\n", op, (unsigned long long)o->seed, message, shrunk);
  fclose(f);
  fprintf(out, "  repro: %s\n", path);
}

/* max cases for a run bounded by --seconds: the loop's own clock stops it */
#define BY_TIME 2000000000

int tw_fuzz_run_router(const tw_op_fuzz_opts *o, FILE *out) {
  if (o->plant) {
    fprintf(stderr, "twin fuzz: the router fuzzer has no planted bug '%s'\n", o->plant);
    return 2;
  }
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int total = 0;
  tw_ep_fuzz_report rep;
  memset(&rep, 0, sizeof rep);
  /* batches of 50 so that --seconds is honoured; each batch its own seed */
  for (uint64_t b = 0; !rep.found; b++) {
    int want = o->cases > 0 ? (int)(o->cases - total < 50 ? o->cases - total : 50) : 50;
    if (want <= 0 || (o->cases == 0 && since(&t0) > o->seconds)) break;
    if (tw_router_fuzz_run(o->seed + b * 0x9E3779B97F4A7C15ull, want, &rep) != TW_OK) {
      snprintf(rep.message, sizeof rep.message, "%s", tw_last_error());
      rep.found = 1;
    }
    total += rep.cases;
  }
  fprintf(out, "router: %d cases (properties of tw_router.h, backward vs finite differences), %s%s\n", total,
          rep.found ? "FAILED: " : "clean", rep.found ? rep.message : "");
  return rep.found ? 1 : 0;
}

int tw_fuzz_run_ep(const tw_op_fuzz_opts *o, FILE *out) {
  tw_ep_plant plant = TW_EP_PLANT_NONE;
  if (o->plant) {
    int p = 1;
    while (p < TW_EP_PLANT_COUNT && strcmp(tw_ep_plant_name((tw_ep_plant)p), o->plant)) p++;
    if (p == TW_EP_PLANT_COUNT) {
      fprintf(stderr, "twin fuzz: the ep fuzzer has no planted bug '%s'\n", o->plant);
      return 2;
    }
    plant = (tw_ep_plant)p;
  }
  tw_ep_fuzz_report rep;
  int max = o->cases > 0 ? (int)o->cases : BY_TIME;
  if (o->out_dir) mkdir(o->out_dir, 0755); /* for the repro; an existing folder is fine */
  if (tw_ep_fuzz_run(o->seed, max, o->cases > 0 ? 0 : o->seconds, plant, o->out_dir, &rep) != TW_OK) {
    fprintf(out, "ep: %s\n", tw_last_error());
    return 1;
  }
  char a[256], b[256];
  if (!rep.found) {
    fprintf(out, "ep: %d cases (dispatch, combine, both backward, combine_bwd by source on 1-8 thread ranks, meshes up to 8) clean\n", rep.cases);
    return 0;
  }
  fprintf(out, "ep: FAILED after %d cases: %s\n  first: %s\n  shrunk (%d steps): %s\n  repro: %s\n", rep.cases, rep.message,
          tw_ep_fuzz_case_str(&rep.first, a, sizeof a), rep.shrink_steps, tw_ep_fuzz_case_str(&rep.shrunk, b, sizeof b),
          rep.repro[0] ? rep.repro : "(no --out)");
  return 1;
}

int tw_fuzz_run_pipeline(const tw_op_fuzz_opts *o, FILE *out) {
  int plant = TW_PIPELINE_FUZZ_PLANT_NONE;
  if (o->plant) {
    if (strcmp(o->plant, "pipeline_stale_window")) {
      fprintf(stderr, "twin fuzz: the pipeline fuzzer has no planted bug '%s'\n", o->plant);
      return 2;
    }
    plant = TW_PIPELINE_FUZZ_PLANT_STALE_WINDOW;
  }
  tw_pipeline_fuzz_report rep;
  int max = o->cases > 0 ? (int)o->cases : BY_TIME;
  if (tw_pipeline_fuzz(o->seed, max, o->cases > 0 ? 0 : o->seconds, plant, &rep) != TW_OK) {
    fprintf(out, "pipeline: %s\n", tw_last_error());
    return 1;
  }
  char a[256], b[256];
  if (!rep.failures) {
    fprintf(out, "pipeline: %d cases (%d valid vs the unpipelined model, %d invalid named by their rule) clean\n",
            rep.cases, rep.valid, rep.invalid);
    return 0;
  }
  fprintf(out, "pipeline: FAILED after %d cases: %s\n  first: %s\n  shrunk: %s\n", rep.cases, rep.message,
          tw_pipeline_fuzz_case_str(&rep.first_failure, a, sizeof a), tw_pipeline_fuzz_case_str(&rep.shrunk, b, sizeof b));
  write_repro(o, out, "pipeline", rep.message, b);
  return 1;
}

int tw_fuzz_run_moe(const tw_op_fuzz_opts *o, FILE *out) {
  int plant = TW_MOE_FUZZ_PLANT_NONE;
  if (o->plant) {
    if (strcmp(o->plant, "moe_skip_dp_reduce")) {
      fprintf(stderr, "twin fuzz: the moe fuzzer has no planted bug '%s'\n", o->plant);
      return 2;
    }
    plant = TW_MOE_FUZZ_PLANT_SKIP_DP_REDUCE;
  }
  tw_moe_fuzz_report rep;
  int max = o->cases > 0 ? (int)o->cases : BY_TIME;
  if (tw_moe_fuzz(o->seed, max, o->cases > 0 ? 0 : o->seconds, plant, &rep) != TW_OK) {
    fprintf(out, "moe: %s\n", tw_last_error());
    return 1;
  }
  char a[512], b[512];
  if (!rep.failures) {
    fprintf(out, "moe: %d cases (%d valid: dp x fsdp x ep thread ranks vs one rank; %d invalid named by their rule) clean\n",
            rep.cases, rep.valid, rep.invalid);
    return 0;
  }
  fprintf(out, "moe: FAILED after %d cases: %s\n  first: %s\n  shrunk: %s\n", rep.cases, rep.message,
          tw_moe_fuzz_case_str(&rep.first_failure, a, sizeof a), tw_moe_fuzz_case_str(&rep.shrunk, b, sizeof b));
  write_repro(o, out, "moe", rep.message, b);
  return 1;
}
