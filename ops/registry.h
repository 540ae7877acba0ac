/* The registry of operations: one table that every mode of `twin` walks.
 *
 *   twin check            runs the stored golden cases of each entry (golden_op)
 *   twin check --sharding sweeps the sharding rules of each entry (shard_rule)
 *   twin fuzz             draws cases of each entry's fuzz kind (fuzz_kind)
 *   twin bench            times each entry's bench shapes (bench_ref, bench_gpu)
 *   twin port             all of the above per kernel version, against the entry's floor
 *
 * Names double as filters: `--filter S` keeps the entries whose name contains S, and `--op X`
 * takes an entry's name or its short alias (the fuzz kind: "quantize", "wgrad").
 *
 * How to add an operation (the router, EP dispatch/combine, the MoE block, the pipeline):
 *   1. Declare it in include/twin/ and give both backends their tw_backend_ops entry.
 *   2. Add one tw_op_entry to the table in ops/registry.c, at the end of its area:
 *        - golden_op: the `op = ...` key its golden/data cases use (golden/exec.c runs them);
 *        - fuzz_kind: the fz_op name its fuzz generator draws (fuzz/gen.c, fuzz/run.c);
 *        - shard_rule: the tw_shard_op family check --sharding sweeps for it (shard/golden.c);
 *        - min_ranks > 1 for an op that only exists on a mesh (EP dispatch/combine, the
 *          pipeline). The single-device runners (the golden runner, port's checks) do not
 *          build meshes: port lists such an entry as needing N ranks (on ref it still runs
 *          the entry's own fuzzer, which makes its thread ranks), and its cases belong in
 *          check --sharding / fuzz --mesh or its own fuzzer;
 *        - backend_slot: TW_BACKEND_SLOT(<its tw_backend_ops field>), so `twin backends`
 *          and `twin port` can say which backend provides it;
 *        - above_interface = 1 instead of a slot for code written once over the interface;
 *        - fuzz_run: its own fuzzer when fuzz/'s generators do not draw its cases;
 *        - versions: the gpu kernel names tw_ctx_config.kernel can force, default first;
 *        - bench_ref / bench_gpu: functions that emit tw_bench_row's (ops/bench.h) whose `op`
 *          is this entry's name or alias, with flops and bytes filled in (its floor).
 *      A field that does not apply stays NULL / 0; the modes skip it and say so.
 *   3. That is all: check, bench, fuzz and port list it; `twin port` times every version and
 *      marks TW_ERR_UNSUPPORTED ones with the backend's reason. */
#ifndef TWIN_OPS_REGISTRY_H
#define TWIN_OPS_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ops/bench.h"
#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How an entry's outputs are judged against the oracle (core/check.c). */
typedef enum {
  TW_COMPARE_EXACT = 0, /* bit for bit (codes, scales, amax) */
  TW_COMPARE_BOUND = 1  /* |got - exact| <= the bound derived from K, dtypes and sum |a||b| */
} tw_compare;

#define TW_OP_MAX_VERSIONS 8

/* What `twin fuzz` hands an entry that brings its own fuzzer (fuzz_run below). */
typedef struct tw_op_fuzz_opts {
  uint64_t seed;
  int64_t cases;       /* > 0: this many cases */
  double seconds;      /* > 0 (cases == 0): until this much time has passed */
  const char *out_dir; /* where a shrunk failure's repro goes, or NULL */
  const char *plant;   /* a planted bug of this entry's fuzzer, or NULL */
  int quiet;
} tw_op_fuzz_opts;

typedef struct tw_op_entry {
  const char *name;      /* "grouped_gemm": the public function's name without tw_ */
  const char *alias;     /* short name bench/fuzz used before the registry, or NULL */
  const char *area;      /* "quantize", "gemm", ...: the golden/data folder and the report section */
  const char *summary;   /* one line for listings and the port report */
  tw_compare compare;
  const char *golden_op; /* case.txt `op` of its stored cases, or NULL */
  const char *fuzz_kind; /* fz_op name, or NULL */
  const char *shard_rule;/* "dense", "grouped_gemm", "grouped_quantize" (tw_shard_op), or NULL */
  int min_ranks;         /* 1 for a single-device op; > 1: needs a mesh of that many ranks */
  size_t backend_slot;   /* TW_BACKEND_SLOT(field) of its tw_backend_ops entry, 0 if none */
  /* 1: written once above the interface (the pipeline scan, later the MoE block): it has no
   * backend slot and runs wherever the operations it calls run */
  int above_interface;
  /* gpu kernel versions that tw_ctx_config.kernel forces (NULL-terminated); the ref backend
   * has one version, itself. */
  const char *versions[TW_OP_MAX_VERSIONS + 1];
  const char *auto_rule; /* which version auto picks, in words (from the kernel's header) */
  /* Benches: emit rows through tw_bench_emit; return 0 on success. NULL if none. A gpu bench
   * may time several entries (gemm's also times grouped_gemm): modes call each function once. */
  int (*bench_ref)(const tw_bench_cfg *cfg, tw_ctx *ctx);
  int (*bench_gpu)(const tw_bench_cfg *cfg);
  /* An entry whose fuzzer is not one of fuzz/'s generators (fz_op): router, EP, pipeline.
   * Prints its summary to `out`; returns 0 when clean, 1 when it found (and shrank) a
   * failure, 2 on a bad option (an unknown plant). `planted` lists its plant names. */
  int (*fuzz_run)(const tw_op_fuzz_opts *o, FILE *out);
  const char *planted;
} tw_op_entry;

/* The entries' own fuzzers (fuzz/entry_fuzzers.c; weak in registry.c: NULL where not linked). */
int tw_fuzz_run_router(const tw_op_fuzz_opts *o, FILE *out);
int tw_fuzz_run_ep(const tw_op_fuzz_opts *o, FILE *out);
int tw_fuzz_run_pipeline(const tw_op_fuzz_opts *o, FILE *out);
int tw_fuzz_run_moe(const tw_op_fuzz_opts *o, FILE *out);

/* Where an entry's function sits in a backend's table (core/backend.h). */
#define TW_BACKEND_SLOT(field) offsetof(struct tw_backend_ops, field)
struct tw_backend_ops;
/* 1 if the backend table provides e's function (NULL table or no slot: 0; an entry above
 * the interface: 1 where the table exists). */
int tw_op_provided(const tw_op_entry *e, const struct tw_backend_ops *table);

/* The table, in report order. */
int tw_op_count(void);
const tw_op_entry *tw_op_at(int i);
/* The entry named `name` or aliased so, or NULL. */
const tw_op_entry *tw_op_find(const char *name);
/* The entry whose golden_op is `golden_op`, or NULL. */
const tw_op_entry *tw_op_for_golden(const char *golden_op);
/* 1 if a --filter S keeps e: S is NULL/"" or "all", or e's name or alias contains S. */
int tw_op_matches(const tw_op_entry *e, const char *filter);
/* "gemm, grouped_gemm, ...": every name, for error messages. */
const char *tw_op_names(void);

#ifdef __cplusplus
}
#endif
#endif
