/* twin fuzz internals: the case, its generator, its runner, the shrinker and the repro I/O.
 *
 * A case stores its inputs *logically* and explicitly (f32 values already representable in
 * their dtype), so the shrinker can drop rows, columns and groups and simplify values, and
 * a repro directory can hold them as plain .npy files:
 *   quantize     x [M, K], group_sizes [G] (S = sum <= M; rows S..M-1 are the tail)
 *   cast         x [M, K] (a 2-D tensor of the source dtype)
 *   gemm         a [M, K], b [K, N]   (the logical operands; storage follows op_a/op_b)
 *   grouped_gemm a [M, K] ragged by group_sizes, b [G, K, N] (storage follows rhs_op)
 *   wgrad        a [M, K], b [M, N]   ragged by group_sizes; out [G, K, N]
 * plus out_init (accumulate=1) and scale [G] (delayed scaling). How each operand is stored
 * and quantized (mode, orientation) is part of the case, so replaying it is exact.
 *
 * A sharded case (twin fuzz --mesh, `sharded` = 1) runs one sharding rule (tw_shard.h) on a
 * mesh: the plan's two inputs are `a` and `b` in their global shapes (grouped_quantize: `x`),
 *   dense        fwd a = x [B?, M, K], b = w [B?, K, N]; dgrad a = dy [B?, M, N], b = w;
 *                wgrad a = x, b = dy          (w has B only when w_batched)
 *   grouped_gemm fwd a = x [M, K], b = w [G, K, N]; dgrad a = dy [M, N], b = w;
 *                wgrad a = x, b = dy [M, N]   (op grouped_gemm: fwd/dgrad, op wgrad: wgrad)
 *   quantize     x [M, K]                     (op quantize: grouped_quantize)
 * stored in sa.dtype / sb.dtype (x_dtype), the output in out_dtype, with the forward
 * operands' partition specs x_spec / w_spec. Whether the rule must refuse the case is not
 * stored: the runner restates the rules (tw_shard_expected_error) every time.
 */
#ifndef TWIN_FUZZ_INTERNAL_H
#define TWIN_FUZZ_INTERNAL_H

#include <stdint.h>
#include <stdio.h>

#include "twin/tw_base.h"
#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_quantize.h"
#include "twin/tw_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- deterministic PRNG (xoshiro256**, seeded by splitmix64): same seed, same cases ---- */
typedef struct { uint64_t s[4]; } fz_rng;
void fz_rng_seed(fz_rng *r, uint64_t seed);
uint64_t fz_next(fz_rng *r);
uint64_t fz_below(fz_rng *r, uint64_t n);    /* uniform in [0, n), n >= 1 */
int fz_chance(fz_rng *r, int percent);        /* 1 with probability percent/100 */
double fz_unit(fz_rng *r);                    /* uniform in [0, 1) (53 bits) */
uint64_t fz_case_seed(uint64_t seed, uint64_t index);

typedef enum {
  FZ_QUANTIZE = 0,
  FZ_CAST,
  FZ_GEMM,
  FZ_GROUPED_GEMM,
  FZ_WGRAD,
  FZ_OP_COUNT
} fz_op;
const char *fz_op_name(fz_op op);
int fz_op_from_name(const char *name, fz_op *out);

/* How a GEMM operand is presented: plain (dtype) or quantized (mode, qdtype, orientation). */
typedef struct {
  tw_dtype dtype;   /* plain: f32/bf16/f16 */
  tw_scaling mode;  /* TW_SCALE_NONE = plain */
  tw_dtype qdtype;  /* e4m3/e5m2 */
  int colwise;      /* quantized: which orientation of the quantized source is passed */
  int swizzled;     /* mxfp8 scales */
  int pow2;         /* pow2 scales (current, block) */
  int padded;       /* colwise transposed copy in the token-padded layout (tw_quantize.h col_padded) */
} fz_operand_spec;

typedef struct {
  fz_op op;
  uint64_t seed;       /* the case seed (fz_case_seed(run seed, index)); informational */
  int64_t M, K, N, G;
  int32_t *group_sizes;   /* [G] */
  float *x;               /* quantize/cast input [M, K] */
  float *a, *b;           /* gemm family operands (logical, see above) */
  float *out_init;        /* accumulate=1: initial output (logical out shape) */
  float *scale;           /* delayed scaling: [G] stored scales */
  /* quantize */
  tw_scaling mode;
  tw_dtype qdtype;
  tw_qlayout layout;
  int pow2, swizzled;
  tw_dtype x_dtype;       /* quantize/cast source dtype */
  /* cast */
  tw_dtype dst_dtype;
  int saturate;
  /* gemm family */
  tw_op op_a, op_b;       /* gemm: op_a/op_b; grouped: op_b = rhs_op; wgrad: lhs_op/rhs_op */
  fz_operand_spec sa, sb;
  tw_dtype out_dtype;
  int accumulate;
  char note[96];          /* the generator's pattern, e.g. "skew99" */
  char plant[48];         /* read from a repro: the planted bug it was found with ("" if none) */
  /* sharded cases (see the top of this file) */
  int sharded;
  tw_shard_op rule;
  tw_pass pass;
  tw_mesh mesh;
  tw_pspec x_spec, w_spec; /* the forward operands' specs (w_spec unused for quantize) */
  int64_t B;              /* dense: x's batch (0: x is 2-D) */
  int w_batched;          /* dense: w has the batch dim too */
  int fp8_inputs;         /* grouped_gemm, any pass: its inputs (x, w, dy) quantized to e4m3 inside the plan */
  int quantize_before_gather; /* fp8 w quantized before its gather: fwd, dgrad */
} fz_case;

void fz_case_free(fz_case *c);
int fz_case_copy(fz_case *dst, const fz_case *src); /* 0 on success */
int64_t fz_case_elements(const fz_case *c);          /* input + output elements: a case's size */
void fz_case_describe(const fz_case *c, char *buf, size_t n);
/* element counts of each logical array */
int64_t fz_numel_x(const fz_case *c);
int64_t fz_numel_a(const fz_case *c);
int64_t fz_numel_b(const fz_case *c);
int64_t fz_numel_out(const fz_case *c);

/* Draws case `index` of run `seed` for op (deterministic). */
int fz_generate(fz_case *c, fz_op op, uint64_t seed, uint64_t index);

/* ---- sharded cases ---- */
/* --mesh: "all" draws a mesh per case (1, 2, 4 or 8 ranks, at most max_ranks, over the
 * rule's axes); otherwise every case uses this mesh. */
typedef struct {
  int all;
  tw_mesh mesh;
  int max_ranks;
} fz_mesh_opt;
/* Parses --mesh; on error writes a one-line message to err and returns -1. */
int fz_mesh_opt_parse(const char *text, fz_mesh_opt *out, char *err, size_t n);
/* 1 if op has a sharding rule (quantize, gemm, grouped_gemm, wgrad; not cast). */
int fz_op_shardable(fz_op op);
/* Draws sharded case `index` of run `seed` for op: mesh, rule, pass, specs (about one in
 * nine deliberately invalid: a broken rule or a dim that does not divide), shapes divisible
 * by what the specs shard, group sizes that respect ep, values (deterministic). */
int fz_generate_sharded(fz_case *c, fz_op op, uint64_t seed, uint64_t index, const fz_mesh_opt *m);
/* The forward operands as the planner sees them, and the global shapes of the plan's two
 * inputs and its output (dims as letters B, M, K, N, G in *_dims when given). */
void fz_shard_operands(const fz_case *c, tw_shard_operand *x, tw_shard_operand *w);
void fz_shard_shapes(const fz_case *c, int nd[3], int64_t shape[3][TW_MAX_DIMS], char dims[3][TW_MAX_DIMS + 1]);
/* The rule options of the case (quantization, fp8 inputs). */
tw_rule_opts fz_shard_rule_opts(const fz_case *c);
/* The text the planner must fail with, or NULL (tw_shard_expected_error on the case). */
const char *fz_shard_expected_error(const fz_case *c);

/* ---- running a case ---- */
#define FZ_MAX_CHECKS 32
typedef struct {
  char name[64];
  tw_check_report rep;
  char line[320];
} fz_check;

typedef enum { FZ_PASS = 0, FZ_FAIL = 1, FZ_ERROR = 2 } fz_verdict;

typedef struct {
  fz_verdict verdict;
  int nchecks;
  fz_check checks[FZ_MAX_CHECKS];
  char first_failure[64]; /* name of the first failing check (or "status") */
  int severity;           /* of that check: 0 err <= 4x bound, 1 beyond, 2 exact/NaN/inf mismatch */
  char message[512];      /* first failure line, or the error */
  int expected_error;     /* sharded: the case was invalid and the planner refused it as expected */
  int ranks;              /* sharded: the mesh's ranks */
  int exact;              /* sharded: the plan promised the unsharded result bit for bit */
  int steps[6];           /* sharded: the plan's steps by tw_step_kind */
} fz_result;

/* subject: the backend under test; oracle: a ref context. When they are the same context
 * (--backend ref), the run is the oracle's self-consistency; otherwise every output is also
 * compared with the oracle's. Returns the verdict (also in res). */
fz_verdict fz_run_case(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, fz_result *res);
/* 1 if c's group sizes are usable (G >= 1, none negative, sum <= M), else 0 with the reason in
 * msg (replayed and shrunk cases are checked before they run). */
int fz_group_sizes_sane(const fz_case *c, char *msg, size_t n);
void fz_result_print(const fz_result *r, FILE *f);

/* The checks' bookkeeping, for runners outside run.c: each adds a named check to res (and the
 * first failure decides the verdict and severity). */
void fz_check_exact(fz_result *res, const char *name, const tw_tensor *got, const tw_tensor *exp);
void fz_check_bound(fz_result *res, const char *name, const tw_tensor *got, const tw_tensor *exp,
                    const tw_tensor *bound);
void fz_check_note(fz_result *res, const char *name, const char *line); /* a passing line */
void fz_fail(fz_result *res, fz_verdict v, const char *name, const char *msg);

/* ---- running sharded cases ---- */
/* What a sharded run needs beyond one context: the oracle (ref, unsharded), the subject's
 * backend, the planted bug (an ops-table bug goes into every rank's context, a communicator
 * bug into every rank's communicator), and for gpu the NCCL communicators (rank r on GPU r,
 * made once per rank count). */
typedef struct fz_shard_env fz_shard_env;
/* NULL (message in err) if the backend cannot run sharded here (gpu without NCCL or GPUs). */
fz_shard_env *fz_shard_env_open(tw_backend subject, const char *plant, tw_ctx *oracle, char *err, size_t n);
void fz_shard_env_close(fz_shard_env *e);
int fz_shard_env_max_ranks(const fz_shard_env *e); /* 64 on ref (threads); the GPUs visible on gpu */
/* Plans the case; an invalid case must fail with the restated rule's error; a valid one runs
 * on every rank through tw_plan_run and each rank's output shard is compared with the same
 * shard of the unsharded oracle: bit for bit when the plan is exact (ref subject), else within
 * twice the GEMM error bound, and with the exact f64 result within the bound; quantize: codes,
 * dequantized values and the global amax bit for bit. */
fz_verdict fz_run_sharded(fz_shard_env *e, const fz_case *c, fz_result *res);
/* The case's plan as tw_plan_format prints it (or the planner's error). */
const char *fz_shard_plan_text(const fz_case *c, char *buf, size_t n);
/* ---- shrinking ---- */
typedef struct {
  int attempts, accepted;
  int64_t elements_before, elements_after;
  double seconds;
} fz_shrink_stats;
/* Shrinks c in place while it still fails with the same first failing check. */
void fz_shrink(tw_ctx *subject, tw_ctx *oracle, fz_case *c, const fz_result *failing,
               double max_seconds, fz_shrink_stats *st);
/* The same for a sharded case: fewer ranks (drop or halve mesh axes), simpler specs, smaller
 * dims (keeping what the specs shard divisible), fewer groups, then simpler values. */
void fz_shrink_sharded(fz_shard_env *e, fz_case *c, const fz_result *failing, double max_seconds,
                       fz_shrink_stats *st);

/* ---- repro directories ---- */
/* A repro dir holds case.txt and the inputs as .npy; backend_name and plant go into the
 * replay command written at its top. */
tw_status fz_case_write(const char *dir, const fz_case *c, const char *backend_name,
                        const char *plant);
tw_status fz_case_read(const char *dir, fz_case *c);
tw_status fz_report_write(const char *dir, const fz_result *r, const char *extra);
int fz_mkdir_p(const char *path);

/* ---- planted bugs (test-only variants of the ref backend) ---- */
/* Names: "tile_off_by_one" (grouped_gemm skips the last row of groups of size 16k+1, k>=1),
 * "round_toward_zero" (tensor-scaled quantize truncates instead of RNE),
 * "empty_group_unwritten" (wgrad leaves out[g] unwritten for empty groups);
 * communicator bugs, for sharded runs (--mesh): "amax_reduce_dropped" (all-reduce(max), the
 * amax reduction, leaves each rank its own values), "reduce_scatter_shifted" (rank r gets
 * the reduced block of rank r+1). */
int fz_plant_count(void);
const char *fz_plant_name(int i);
const char *fz_plant_op(int i);  /* the op the bug lives in (or is found through) */
int fz_plant_is_comm(const char *name); /* 1: a communicator bug (needs --mesh) */
/* Points ctx (a ref context) at the broken variant; -1 if the name is unknown or a
 * communicator bug. */
int fz_plant(tw_ctx *ctx, const char *name);
/* Wraps each of the n thread-communicator handles in the broken variant (in place; splits
 * stay broken); -1 if the name is not a communicator bug. */
int fz_plant_comms(const char *name, int n, tw_comm **comms);

/* ---- the driver (also used by the tests in-process) ---- */
typedef struct {
  tw_backend backend;
  const char *plant;      /* NULL or a planted bug */
  int op_mask;            /* bit per fz_op */
  double seconds;         /* > 0: run for this long */
  int64_t cases;          /* > 0: run this many cases (one of seconds/cases) */
  uint64_t seed;
  const char *out_dir;    /* where repros go */
  int shrink;             /* 1 = shrink failures */
  double shrink_seconds;
  int max_failures;       /* stop after this many failing cases (0 = no limit) */
  int quiet;              /* no progress lines */
  const char *mesh;       /* NULL, "all" or a mesh ("dp=2,ep=4"): sharded cases (fz_mesh_opt) */
} fz_options;

typedef struct {
  int64_t cases, failures, errors;
  int64_t per_op_cases[FZ_OP_COUNT], per_op_failures[FZ_OP_COUNT];
  double per_op_seconds[FZ_OP_COUNT];
  double seconds;
  double first_failure_seconds;     /* < 0 if none */
  int64_t shrunk_elements;          /* of the first failure after shrinking (-1 if none) */
  char first_repro[512];            /* its shrunk repro dir */
  /* sharded runs */
  int64_t expected_errors;          /* invalid cases refused with the expected rule */
  int64_t by_ranks[65];             /* cases by their mesh's ranks (1..64) */
  int64_t exact_cases;              /* valid cases whose plan promised bit-exactness */
  int64_t steps[6];                 /* the plans' steps by tw_step_kind */
} fz_summary;

void fz_options_default(fz_options *o);
int fz_run(const fz_options *o, fz_summary *s);       /* 0 if no failure */
void fz_summary_print(const fz_summary *s, FILE *f);
/* Replays one repro dir on backend (plant may be NULL); prints the checks; 0 if it passes. */
int fz_replay(const char *dir, tw_backend backend, const char *plant, fz_result *res);

#ifdef __cplusplus
}
#endif
#endif
