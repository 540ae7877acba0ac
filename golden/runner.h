/* The golden runner: runs one stored case (golden/FORMAT.md) on any backend through the
 * public interface and compares with the one checker. Used by the Criterion golden tests and
 * by `twin check`, so both judge a case the same way. */
#ifndef TWIN_GOLDEN_RUNNER_H
#define TWIN_GOLDEN_RUNNER_H

#include "twin/tw_base.h"
#include "twin/tw_check.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  char name[256];           /* "<area>/<case>" */
  char op[64];
  int passed;
  int skipped;              /* the backend lacks the operation: not run, neither passed nor failed */
  int outputs;              /* outputs compared */
  tw_check_report worst;    /* the output with the largest worst_ratio (or first failure) */
  char worst_output[64];    /* its name, e.g. "row_scale_inv" */
  char detail[512];         /* one line: checker report or the error that stopped the case */
} tw_golden_result;

/* Runs the case in case_dir on ctx's backend; TW_OK means it ran (see res->passed). */
tw_status tw_golden_run_case(tw_ctx *ctx, const char *case_dir, tw_golden_result *res);

/* Folds one output's report into res: the first failing output, else the one with the largest
 * err/bound ratio, becomes res->worst and res->detail (every runner of a case uses it). */
void tw_golden_record(tw_golden_result *res, const char *output, const tw_check_report *r);

/* "<area>/<case>": the last two components of a case directory (what --filter matches). */
const char *tw_golden_case_name(const char *case_dir, char *buf, size_t n);

/* Case directories (those holding a case.txt) under root, sorted; *dirs is malloc'd, free
 * with tw_golden_free_list. Returns the count, or -1 with tw_last_error() set. */
int tw_golden_list_cases(const char *root, char ***dirs);
void tw_golden_free_list(char **dirs, int n);

#ifdef __cplusplus
}
#endif
#endif
