/* Runners of the stored router and EP cases (golden/routing.c), called by tw_golden_run_case
 * for `op = router` and `op = ep`. A backend that lacks the operation gives res->skipped. */
#ifndef TWIN_GOLDEN_ROUTING_H
#define TWIN_GOLDEN_ROUTING_H

#include "golden/exec.h"
#include "golden/runner.h"

tw_status tw_golden_run_router(tw_ctx *ctx, const char *dir, const tw_case_keys *k, tw_golden_result *res);
tw_status tw_golden_run_ep(tw_ctx *ctx, const char *dir, const tw_case_keys *k, tw_golden_result *res);

#endif
