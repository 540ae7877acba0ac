/* The MoE block's differential fuzzer (`twin fuzz --op moe`): draws a block (E, k, H, F,
 * tokens, activation, weighting, biases, router mode with groups and expert bias, alignment,
 * aux loss, recipe: f32, bf16 or an fp8 one, with or without fp8_gather, and with bf16 weight
 * gradients in about half the cases with bf16 weights) and a dp x fsdp x ep
 * mesh of up to 8 thread ranks; about a fifth of the cases
 * break one rule and must be refused with a message naming it. A valid case runs sharded and
 * on one rank, and every output and gradient must agree within twice tw_moe.h's budget (both
 * runs carry their own rounding). Data is redrawn until the router's choice is robust (top-k
 * and group margins above 1e-3 in f64), so f32 rounding cannot flip a selection. A failing
 * case is shrunk. A planted bug (TW_MOE_FUZZ_PLANT_SKIP_DP_REDUCE: expert weight gradients
 * not summed over dp) shows the fuzzer finds a real sharding defect. */
#ifndef TWIN_MOE_FUZZ_H
#define TWIN_MOE_FUZZ_H

#include <stdint.h>
#include <stdio.h>

#include "twin/tw_moe.h"

typedef struct {
  int dp, fsdp, ep, E, k, groups, group_topk, bias, expert_bias, aux, fp8_gather;
  int bf16_grads; /* the sharded run asks for bf16 d_wi / d_wo (recipes with bf16 weights) */
  int64_t H, F, tokens_per_rank, alignment;
  tw_router_score score;
  int pre_softmax;
  tw_moe_act act;
  tw_moe_weighting weighting;
  tw_moe_recipe recipe;
  const char *expect; /* NULL: valid; else a substring of the error it must give */
} tw_moe_fuzz_case;

enum { TW_MOE_FUZZ_PLANT_NONE = 0, TW_MOE_FUZZ_PLANT_SKIP_DP_REDUCE = 1 };

void tw_moe_fuzz_draw(uint64_t *state, tw_moe_fuzz_case *c);
const char *tw_moe_fuzz_case_str(const tw_moe_fuzz_case *c, char *buf, size_t n);
/* TW_OK when the case behaves; else a status whose message says what differed. */
tw_status tw_moe_fuzz_run_case(const tw_moe_fuzz_case *c, uint64_t seed, int plant);
int tw_moe_fuzz_shrink(tw_moe_fuzz_case *c, uint64_t seed, int plant);

typedef struct {
  int cases, valid, invalid, failures;
  tw_moe_fuzz_case first_failure, shrunk;
  char message[512];
} tw_moe_fuzz_report;

tw_status tw_moe_fuzz(uint64_t seed, int max_cases, double seconds, int plant, tw_moe_fuzz_report *rep);

#endif
