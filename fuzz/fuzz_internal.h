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
 */
#ifndef TWIN_FUZZ_INTERNAL_H
#define TWIN_FUZZ_INTERNAL_H

#include <stdint.h>
#include <stdio.h>

#include "twin/tw_base.h"
#include "twin/tw_check.h"
#include "twin/tw_gemm.h"
#include "twin/tw_quantize.h"

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
} fz_result;

/* subject: the backend under test; oracle: a ref context. When they are the same context
 * (--backend ref), the run is the oracle's self-consistency; otherwise every output is also
 * compared with the oracle's. Returns the verdict (also in res). */
fz_verdict fz_run_case(tw_ctx *subject, tw_ctx *oracle, const fz_case *c, fz_result *res);
void fz_result_print(const fz_result *r, FILE *f);

/* ---- shrinking ---- */
typedef struct {
  int attempts, accepted;
  int64_t elements_before, elements_after;
  double seconds;
} fz_shrink_stats;
/* Shrinks c in place while it still fails with the same first failing check. */
void fz_shrink(tw_ctx *subject, tw_ctx *oracle, fz_case *c, const fz_result *failing,
               double max_seconds, fz_shrink_stats *st);

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
 * "empty_group_unwritten" (wgrad leaves out[g] unwritten for empty groups). */
int fz_plant_count(void);
const char *fz_plant_name(int i);
const char *fz_plant_op(int i);  /* the op the bug lives in */
/* Points ctx (a ref context) at the broken variant; -1 if the name is unknown. */
int fz_plant(tw_ctx *ctx, const char *name);

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
  const char *mesh;       /* reserved for sharded fuzzing */
} fz_options;

typedef struct {
  int64_t cases, failures, errors;
  int64_t per_op_cases[FZ_OP_COUNT], per_op_failures[FZ_OP_COUNT];
  double per_op_seconds[FZ_OP_COUNT];
  double seconds;
  double first_failure_seconds;     /* < 0 if none */
  int64_t shrunk_elements;          /* of the first failure after shrinking (-1 if none) */
  char first_repro[512];            /* its shrunk repro dir */
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
