/* The stored MoE goldens for the tests (tests/moe_cases.c). Bound: tw_moe.h's error budget
 * (F32: K u (|exact| + rms), K = H + 2F + k + 16 forward, + E + T for gradients; BF16: 8 and
 * 16 times 2^-8 (|exact| + rms)). */
#ifndef TWIN_TESTS_MOE_CASES_H
#define TWIN_TESTS_MOE_CASES_H

#include "moe/threads.h"

typedef struct {
  tw_moe_threads_run run;
  int64_t T, H, F, E;
  int k, bias;
  double *g[8]; /* out aux dx dgate dwi dwo dbi dbo */
  float *in[8]; /* x gate wi wo bi bo d_out expert_bias */
} gcase;

/* Runs a whole problem (every rank) and fills its outputs; NULL = tw_moe_run_threads. */
typedef tw_status (*moe_runner)(tw_moe_threads_run *run);

extern int moe_g_fail; /* 0: moe_check_case reports the worst ratio without failing */
extern int moe_g_budget_recipe; /* >= 0: judge by this recipe's budget instead of the case's */
void moe_load_case(const char *dir, gcase *c);
void moe_free_case(gcase *c);
/* Runs c on mesh (NULL: one rank) and compares with the golden; returns the worst ratio. */
double moe_check_case(gcase *c, const char *cname, const tw_mesh *mesh, moe_runner run_fn);
/* Calls fn for each case under golden/data/moe; returns how many. */
int moe_each_case(void (*fn)(const char *dir, const char *name));

#endif
