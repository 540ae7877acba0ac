/* The sharding golden sweep: for each rule (dense 2-D/3-D, grouped GEMM, grouped quantize in
 * several scaling modes) and pass, every mesh of 1, 2, 4 and 8 ranks over the rule's axes
 * and every partition spec per operand (each dim: nothing, one axis or an ordered pair of
 * axes; specs that repeat an axis included), plans every case and checks:
 *   - invalid cases fail with the error an independent restatement of the rules expects;
 *   - valid cases, run sharded on the ref backend with the thread communicator, equal the
 *     unsharded ref op: bit for bit where the plan says so, else within twice the GEMM error
 *     bound (both sides may err by it); grouped quantize compares the dequantized shards and
 *     the amax exactly. Every rank checks its own shard, so replicas are checked too.
 * With backend gpu, rank r runs on GPU r over NCCL (tw_comm_init_nccl_local) and is compared
 * with the same unsharded ref results: GEMMs within the bound, quantize bit for bit. */
#ifndef TWIN_SHARD_GOLDEN_H
#define TWIN_SHARD_GOLDEN_H

#include <stdio.h>

#include "twin/tw_shard.h"

typedef struct {
  char rule[48];         /* "dense2", "grouped_gemm", "quantize.mxfp8.rowcol", ... */
  tw_pass pass;
  char mesh[48];
  int ranks;
  long cases;            /* spec combinations planned */
  long run, passed, failed;   /* valid ones executed */
  long skipped;          /* valid ones left out by the per-mesh budget (sampling) */
  long expected_errors;  /* invalid, and failed with the expected rule */
  long wrong_errors;     /* invalid but planned, valid but refused, or another rule's error */
  long exact_cases, exact_equal; /* cases the plan calls exact; how many were bit-equal */
  double worst_ratio;    /* max err / bound over the bound-checked cases */
  char first_problem[400];
} tw_golden_row;

typedef struct {
  int max_ranks;      /* 8 */
  int min_ranks;      /* 1 */
  tw_backend backend; /* ref: thread ranks; gpu: one GPU per rank over NCCL (one process) */
  int tuples;         /* 1: specs may put an ordered pair of axes on a dim */
  long budget;        /* max valid cases executed per (rule, pass, mesh); 0 = all */
  const char *only;   /* run only rules whose name starts with this (NULL = all) */
  FILE *log;          /* per-case lines when verbose */
  int verbose;
  /* only the rules of the registry entries (ops/registry.h) whose name contains this, by
   * their shard_rule (NULL = every rule) */
  const char *filter;
} tw_golden_cfg;
#define TW_GOLDEN_CFG_INIT {8, 1, TW_BACKEND_REF, 1, 0, NULL, NULL, 0, NULL}

/* Runs the sweep; *rows (malloc'd) gets one row per (rule, pass, mesh). Returns TW_OK when it
 * ran (failures are counted in the rows), or an error if it could not run. */
tw_status tw_golden_sharding(const tw_golden_cfg *cfg, tw_golden_row **rows, int *nrows);
/* The coverage table; returns the number of rows with failures. */
int tw_golden_print(FILE *f, const tw_golden_row *rows, int nrows);

/* The rules of tw_shard.h restated independently of shard/plan.c: the text the planner's
 * error must contain for the forward operands x, w (w unused for grouped_quantize, whose
 * quantization is q) on mesh m ("spec:" for a bad spec or a dim that does not divide, "rule
 * gemm.rhs_k_and_n", ...), or NULL when the case must plan. The sweep and `twin fuzz --mesh`
 * judge the planner with it. */
const char *tw_shard_expected_error(const tw_mesh *m, tw_shard_op op, const tw_quantize_opts *q,
                                    const tw_shard_operand *x, const tw_shard_operand *w);

#endif
