/* Fuzzing MoE routing (router, EP dispatch/combine): draw a case, run it on thread ranks,
 * check it against the unsharded formula (EP) or the router's properties, shrink a failure
 * to a small case and write it as a one-line repro. Planted bugs are EP backend tables that
 * are wrong in one way a real kernel goes wrong; the fuzzer must catch and shrink them.
 * (A library with its own Criterion test; hooking it into `twin fuzz --op router|ep` waits
 * for the operation registry.) */
#ifndef TWIN_FUZZ_EP_FUZZ_H
#define TWIN_FUZZ_EP_FUZZ_H

#include <stdint.h>

#include "twin/tw_base.h"

#define TW_EP_FUZZ_MAXR 8

typedef enum { TW_EP_DIST_UNIFORM = 0, TW_EP_DIST_HOT, TW_EP_DIST_ONE, TW_EP_DIST_HALF, TW_EP_DIST_COUNT } tw_ep_dist;

typedef struct {
  int n, E, k, H, A, R; /* R = 0: the no-drop capacity */
  int T[TW_EP_FUZZ_MAXR];
  int dist, drop, dtype; /* dtype: 0 f32, 1 bf16, 2 e4m3 with MXFP8 scales (H % 32 == 0) */
  uint64_t seed;          /* of the data */
  /* the mesh dp x fsdp x ep(n) x tp (at most 8 ranks; 0 means 1): each of the dp*fsdp EP
   * groups routes its own tokens (seed + group), tp ranks are replicas of their group */
  int dp, fsdp, tp;
} tw_ep_fuzz_case;

typedef enum {
  TW_EP_PLANT_NONE = 0,
  TW_EP_PLANT_WRONG_RANK = 1,      /* the last route of the last token goes to the next rank */
  TW_EP_PLANT_DROP_LAST_FULL = 2,  /* a slab filled exactly to its alignment loses its last row */
  TW_EP_PLANT_COUNT
} tw_ep_plant;
const char *tw_ep_plant_name(tw_ep_plant p);

void tw_ep_fuzz_draw(uint64_t *rng, tw_ep_fuzz_case *c);
/* TW_OK, or TW_ERR_INTERNAL with the first difference from the formula. */
tw_status tw_ep_fuzz_check(const tw_ep_fuzz_case *c, tw_ep_plant plant);
/* Greedy: smaller n, T, E, k, H, A, R, simpler distribution and dtype while it still fails. */
int tw_ep_fuzz_shrink(tw_ep_fuzz_case *c, tw_ep_plant plant);
const char *tw_ep_fuzz_case_str(const tw_ep_fuzz_case *c, char *buf, size_t n);
tw_status tw_ep_fuzz_case_parse(const char *text, tw_ep_fuzz_case *c);
/* Size of a case for "shrunk" assertions: n + E + k + H + A + sum T (+ mesh axes beyond 1). */
int tw_ep_fuzz_case_size(const tw_ep_fuzz_case *c);

typedef struct {
  int cases, found;
  tw_ep_fuzz_case first, shrunk;
  int shrink_steps;
  char message[512];
  char repro[1024]; /* path written, "" if none */
} tw_ep_fuzz_report;

/* Runs until a failure, max_cases or `seconds`; shrinks the failure and writes
 * repro_dir/ep-<seed>.txt when repro_dir is set. */
tw_status tw_ep_fuzz_run(uint64_t seed, int max_cases, double seconds, tw_ep_plant plant,
                         const char *repro_dir, tw_ep_fuzz_report *rep);

/* Router: random logits and options; checks the properties of tw_router.h (ids distinct and
 * in range, the selection order and tie rule, weights from their formula, counts) and the
 * backward against central finite differences. */
tw_status tw_router_fuzz_run(uint64_t seed, int max_cases, tw_ep_fuzz_report *rep);

#endif
