/* `twin check`: every stored golden case on every available backend, one table, exit 0 only
 * if all pass. The same runner as the Criterion golden tests (golden/runner.h). Cases are
 * taken entry by entry in registry order (ops/registry.h, by their case.txt op); a case whose
 * op has no entry still runs, last, so none is lost. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/exec.h"
#include "golden/runner.h"
#include "ops/registry.h"
#include "shard/cli.h"
#include "tools/cli.h"

#pragma weak tw_check_sharding_main

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin check [--backend ref|gpu|all] [--golden DIR] [--filter S] [--verbose]\n"
          "       twin check --sharding [options of the sharding checks]\n"
          "\n"
          "Runs every golden case (golden/FORMAT.md) under DIR on each backend and prints one row\n"
          "per case and backend: the output with the worst error, that error against its bound\n"
          "(exact outputs: 'exact' or the mismatch count), PASS or FAIL. Exit 0 only if every case\n"
          "passes on every backend, 1 if any fails, 2 on bad arguments.\n"
          "\n"
          "  --backend NAME   ref, gpu or all (default all: ref, plus gpu where a GPU is visible)\n"
          "  --golden DIR     case root, or one case directory (default: golden/data of the\n"
          "                   workspace)\n"
          "  --filter S       only cases whose name (area/case) or operation (registry name) contains S\n"
          "  --verbose        print the checker's full line for every case, not only failures\n"
          "  --sharding       run the sharded-vs-unsharded checks instead (shard/)\n");
}

static void err_column(const tw_golden_result *r, char *buf, size_t n) {
  const tw_check_report *w = &r->worst;
  if (r->outputs == 0) snprintf(buf, n, "-");
  else if (!w->passed && w->worst_bound == 0) snprintf(buf, n, "%lld/%lld differ", (long long)w->mismatches, (long long)w->count);
  else if (w->worst_bound == 0 && w->worst_err == 0) snprintf(buf, n, "exact");
  else snprintf(buf, n, "%.2e <= %.2e", w->worst_err, w->worst_bound);
}

int twin_cmd_check(int argc, char **argv) {
  const char *backend = "all", *golden = NULL, *filter = NULL;
  int verbose = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (twin_is_help(a)) { usage(stdout); return TW_EXIT_OK; }
    if (!strcmp(a, "--sharding")) {
      if (!tw_check_sharding_main) {
        fprintf(stderr, "twin check --sharding: not in this build yet (shard/ provides it; rebuild once it has landed)\n");
        return TW_EXIT_USAGE;
      }
      /* the sharding checks get the remaining arguments, with argv[0] = "check" */
      int n = 0;
      char **sub = (char **)calloc((size_t)argc + 1, sizeof *sub);
      if (!sub) return TW_EXIT_FAIL;
      for (int j = 0; j < argc; j++)
        if (j != i) sub[n++] = argv[j];
      int rc = tw_check_sharding_main(n, sub);
      free(sub);
      return rc;
    }
    if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) { verbose = 1; continue; }
    static const char *const options[] = {"--backend", "--golden", "--filter", NULL};
    const char *v = twin_option_value("check", argc, argv, &i, options);
    if (!v) return TW_EXIT_USAGE;
    if (!strcmp(a, "--backend")) backend = v;
    else if (!strcmp(a, "--golden")) golden = v;
    else filter = v;
  }
  tw_backend only = TW_BACKEND_REF;
  int all;
  if (twin_parse_backend("check", backend, 1, &only, &all) != 0) return TW_EXIT_USAGE;
  tw_backend backends[TW_BACKEND_COUNT];
  int nb = 0;
  if (all) {
    for (int b = 0; b < TW_BACKEND_COUNT; b++)
      if (tw_backend_available((tw_backend)b)) backends[nb++] = (tw_backend)b;
    if (!tw_backend_available(TW_BACKEND_GPU))
      printf("note: gpu backend not available here (no GPU visible or not built in); checking ref only\n");
  } else {
    backends[nb++] = only;
  }
  char gbuf[2048];
  if (!golden) golden = twin_default_golden_dir(gbuf, sizeof gbuf);
  char **dirs = NULL;
  int n = tw_golden_list_cases(golden, &dirs);
  if (n < 0) {
    fprintf(stderr, "twin check: %s\n", tw_last_error());
    return TW_EXIT_USAGE;
  }
  int *order = (int *)malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
  if (!order) {
    tw_golden_free_list(dirs, n);
    return TW_EXIT_FAIL;
  }
  int no = twin_golden_order(dirs, n, filter, order);
  int passed = 0, failed = 0, skipped = 0, selected = no;
  printf("%-52s %-4s %-20s %-22s %s\n", "case", "be", "output", "worst err vs bound", "result");
  for (int bi = 0; bi < nb; bi++) {
    int code;
    tw_ctx *ctx = twin_open_ctx("check", backends[bi], &code);
    if (!ctx) {
      free(order);
      tw_golden_free_list(dirs, n);
      return code;
    }
    for (int j = 0; j < no; j++) {
      tw_golden_result r;
      tw_golden_run_case(ctx, dirs[order[j]], &r);
      char err[64];
      err_column(&r, err, sizeof err);
      printf("%-52s %-4s %-20s %-22s %s\n", r.name, tw_backend_name(backends[bi]),
             r.worst_output[0] ? r.worst_output : "-", err, r.skipped ? "SKIP" : r.passed ? "PASS" : "FAIL");
      if (!r.passed || verbose) printf("    %s\n", r.detail);
      if (r.skipped) skipped++;
      else if (r.passed) passed++;
      else failed++;
      fflush(stdout);
    }
    tw_ctx_destroy(ctx);
  }
  free(order);
  tw_golden_free_list(dirs, n);
  if (selected == 0) {
    fprintf(stderr, "twin check: no golden cases under %s%s%s (regenerate with python3 golden/gen_goldens.py)\n",
            golden, filter ? " matching " : "", filter ? filter : "");
    return TW_EXIT_FAIL;
  }
  printf("%d passed, %d failed", passed, failed);
  if (skipped) printf(", %d skipped (the backend lacks the operation)", skipped);
  printf(" (%d cases x %d backend%s)\n", selected, nb, nb == 1 ? "" : "s");
  return failed ? TW_EXIT_FAIL : TW_EXIT_OK;
}
