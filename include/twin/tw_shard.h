/* twin sharding: meshes, partition specs, partitioning rules as data (plans), one executor.
 *
 * A mesh names its axes (dp, fsdp, ep, tp, pp, cp) with sizes; ranks are laid out row-major
 * over the axes in the order given (the last axis varies fastest). A partition spec gives each
 * tensor dim nothing (replicated), one axis, or a tuple of axes, major first: dim d of size D
 * with spec (a, b) is split into |a|*|b| equal blocks and the rank at coordinates (i, j)
 * holds block i*|b| + j. Invalid meshes and specs are errors with messages (unknown or
 * repeated axis, a dim not divisible, a spec of the wrong rank).
 *
 * A rule turns (global shapes, specs, options) into a plan, or an error naming the broken
 * rule ("rule gemm.rhs_k_and_n: ..."). A plan lists, per tensor, the spec the local op needs
 * and the collectives that get it there (one step per axis: all-gather, slice, reduce-scatter,
 * all-reduce), the local op and its local shapes, and the steps that bring the output from the
 * local op's spec (maybe a partial sum over some axes) to its final spec. Plans print and are
 * unit-testable without running anything; tw_plan_run executes one on any backend and
 * communicator (local ops through the public interface, collectives through tw_comm.h).
 *
 * Resharding a tensor from spec f to spec t (per dim, c = common prefix of f and t):
 * all-gather the axes f[c:] (minor first), then split by t[c:] (major first): a reduce-scatter
 * when the tensor is a partial sum over that axis, else a local slice; then all-reduce (sum)
 * over the partial axes left.
 *
 * Rules (NN layouts; x is the activation, w the weight; specs are per global dim)
 * -----
 * dense   x [B?, M, K], w [B?, K, N] -> y [B?, M, N]   (seed 001, TE's GemmPrimitive)
 *   gemm.batch           w's batch spec must equal x's; y keeps it.
 *   fsdp on w            w's fsdp axes (K or N) are all-gathered before the op (FSDP weights).
 *   gemm.rhs_k_and_n     w sharded (non-fsdp) on both K and N is an error.
 *   gemm.batch_axis_reuse an axis of the batch spec may not shard w's K or N.
 *   K                    x's K follows w's K (R = w's non-fsdp K axes); M is always gathered.
 *   output               R empty: y = [B, None, Nn]. R set, M unsharded: all-reduce over R.
 *                        R set and M sharded: reduce-scatter over R along M, y = [B, R, Nn]
 *                        (gemm.reduce_scatter_m: M must divide by |R|).
 *   dgrad  dx = dy w^T: dy takes y's spec; dx is reduced over Nn and resharded to x's spec.
 *   wgrad  dw = x^T dy: partial over the batch axes when w has no batch dim, then
 *          reduce-scattered/sliced to w's spec (all-reduce over what is left).
 * grouped_gemm  x [M, K] ragged along M by group_sizes [G], w [G, K, N] -> y [M, N]
 *   grouped_gemm.ep_major   ep, when it shards M, must be its major axis (rank e holds the rows
 *                           of experts e*G/ep ..).
 *   grouped_gemm.expert_dim w's expert dim takes ep or nothing.
 *   grouped_gemm.ep_rows    w sharded on ep needs x's rows sharded on ep.
 *   ep injection            x rows on ep and w's experts replicated: ep is added to w's expert
 *                           dim (each rank slices its experts); dw is all-gathered back.
 *   fsdp on w               all-gathered before the op; dw reduce-scattered back onto it.
 *   grouped_gemm.rhs_k_and_n, grouped_gemm.axis_reuse (an axis of x's rows may not shard w's
 *                           K or N): errors. x's K follows w's K; K sharded -> all-reduce.
 *   Rows stay sharded (group sizes are clipped per row shard; the local op sees its rows).
 *   quantized inputs (opts.quantize_inputs; fwd, dgrad and wgrad): the row-grouped inputs (x,
 *     dy) are quantized per local group after their collectives, the amax reduced over the axes
 *     of their op spec (less ep when the experts are on ep); w (fwd, dgrad) per expert after
 *     its collectives, or, with quantize_before_gather, before them (amax over w's given K/N
 *     axes, fsdp included) so the all-gather moves fp8 bytes and the per-expert scales follow
 *     the expert dim. Tensor current scaling: the rowwise bytes serve every orientation (dgrad
 *     reads w with rhs_op T, wgrad x and dy with ops N), the same bytes as quantizing the
 *     unsharded tensors. grouped_gemm.quantize_before_gather_needs_w (wgrad: no w),
 *     grouped_gemm.quantize_before_gather_needs_fp8, grouped_gemm.fp8_pair: errors.
 *   dgrad: dx = dy w[g]^T per group, reduced over Nn, to x's spec.
 *   wgrad: dw[g] = x_g^T dy_g, partial over x's non-ep row axes, then to w's spec.
 * grouped_quantize  x [M, K] ragged along M -> q (same spec as x), amax [G] replicated
 *   tensor scaling: per-group amax max-reduced over every axis that shards x, scales derived
 *     from the global amax (current) or given (delayed), so every shard's bytes equal the
 *     unsharded ones. Scale layouts are those of the local shape (tw_quantize.h).
 *   quantize.blocks_along_m  colwise MXFP8/BLOCK_1x128 and BLOCK_128x128 blocks run along M and
 *                            could straddle row shards: M may not be sharded.
 *   quantize.k_block         blocks along K (MXFP8 32, BLOCK 128) need K/|k axes| % block == 0.
 */
#ifndef TWIN_TW_SHARD_H
#define TWIN_TW_SHARD_H

#include "twin/tw_base.h"
#include "twin/tw_comm.h"
#include "twin/tw_quantize.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- mesh --------------------------------------------------------------------------- */
typedef enum {
  TW_AXIS_DP = 0,
  TW_AXIS_FSDP = 1,
  TW_AXIS_EP = 2,
  TW_AXIS_TP = 3,
  TW_AXIS_PP = 4,
  TW_AXIS_CP = 5,
  TW_AXIS_COUNT
} tw_axis;

const char *tw_axis_name(tw_axis a); /* "dp", ... */
int tw_axis_from_name(const char *name, tw_axis *out);

typedef struct {
  int naxes;                   /* 0: a single rank */
  tw_axis axis[TW_AXIS_COUNT]; /* in layout order, major first */
  int size[TW_AXIS_COUNT];
} tw_mesh;

/* Validates (known axes, none twice, sizes >= 1, at most 65536 ranks) and fills *m. */
tw_status tw_mesh_init(tw_mesh *m, int naxes, const tw_axis *axes, const int *sizes);
/* "dp=2,ep=4"; "" or "1" is the single-rank mesh. */
tw_status tw_mesh_parse(const char *text, tw_mesh *m);
const char *tw_mesh_str(const tw_mesh *m, char *buf, size_t n); /* "dp=2,ep=4" or "1" */
int tw_mesh_ranks(const tw_mesh *m);
int tw_mesh_axis_size(const tw_mesh *m, tw_axis a);           /* 1 if the mesh lacks it */
int tw_mesh_coord(const tw_mesh *m, int rank, tw_axis a);     /* 0 if the mesh lacks it */

/* ---- partition specs ---------------------------------------------------------------- */
typedef struct {
  int n;                       /* 0: replicated */
  tw_axis axis[TW_AXIS_COUNT]; /* major first */
} tw_dimspec;

typedef struct {
  int ndim;
  tw_dimspec dim[TW_MAX_DIMS];
} tw_pspec;

/* "[(dp,ep), None, tp]" (brackets optional; None or - for a replicated dim). */
tw_status tw_pspec_parse(const char *text, tw_pspec *p);
const char *tw_pspec_str(const tw_pspec *p, char *buf, size_t n); /* "[(dp,ep), None, tp]" */
int tw_pspec_equal(const tw_pspec *a, const tw_pspec *b);
/* Checks p against the mesh and a global shape; `what` names the tensor in the message. */
tw_status tw_pspec_check(const tw_mesh *m, const tw_pspec *p, int ndim, const int64_t *shape,
                         const char *what);
/* Number of shards of a dim and the shard a rank holds. */
int tw_dimspec_shards(const tw_mesh *m, const tw_dimspec *d);
int tw_dimspec_index(const tw_mesh *m, const tw_dimspec *d, int rank);

/* ---- plans -------------------------------------------------------------------------- */
typedef enum { TW_SHARD_DENSE = 0, TW_SHARD_GROUPED_GEMM = 1, TW_SHARD_GROUPED_QUANTIZE = 2,
               TW_SHARD_OP_COUNT } tw_shard_op;
typedef enum { TW_PASS_FWD = 0, TW_PASS_DGRAD = 1, TW_PASS_WGRAD = 2, TW_PASS_COUNT } tw_pass;
const char *tw_shard_op_name(tw_shard_op op);   /* "dense", "grouped_gemm", "grouped_quantize" */
int tw_shard_op_from_name(const char *name, tw_shard_op *out);
const char *tw_pass_name(tw_pass p);            /* "fwd", "dgrad", "wgrad" */
int tw_pass_from_name(const char *name, tw_pass *out);

typedef struct {
  size_t size;            /* sizeof(tw_rule_opts) */
  tw_quantize_opts quant; /* grouped_quantize: the quantization (delayed: scale given at run) */
  /* grouped_gemm, every pass: quantize both inputs to fp8 (tensor current scaling, per
   * group/expert, from the global amax) right before the GEMM, and optionally (fwd, dgrad)
   * quantize w's shard *before* its all-gather so fp8 bytes + per-expert scales travel instead
   * of 16/32-bit weights. Both give the same bytes as quantizing the unsharded tensors. */
  int quantize_inputs;
  tw_dtype fp8;           /* e4m3 (e5m2 x e5m2 is no GEMM) */
  int quantize_before_gather;
} tw_rule_opts;
#define TW_RULE_OPTS_INIT {sizeof(tw_rule_opts), TW_QUANTIZE_OPTS_INIT, 0, TW_E4M3, 0}

/* One operand of the forward op as the caller holds it: global shape and spec. */
typedef struct {
  int ndim;
  int64_t shape[TW_MAX_DIMS];
  tw_pspec spec;
} tw_shard_operand;

typedef enum {
  TW_STEP_ALL_GATHER = 0,
  TW_STEP_SLICE = 1,
  TW_STEP_REDUCE_SCATTER = 2,
  TW_STEP_ALL_REDUCE = 3,     /* sum of a partial output */
  TW_STEP_AMAX_MAX = 4,       /* quantize: max-reduce the per-group amax */
  TW_STEP_QUANTIZE = 5        /* grouped_gemm: fp8-quantize an input here (amax over `axes`) */
} tw_step_kind;

typedef struct {
  tw_step_kind kind;
  int tensor;                       /* 0, 1 inputs; 2 the output */
  int dim;                          /* -1 for the all-reduces */
  tw_axis axis;
  int64_t shape[TW_MAX_DIMS];       /* local shape after the step */
  tw_dimspec axes;                  /* TW_STEP_QUANTIZE: the amax is max-reduced over these */
} tw_plan_step;

#define TW_PLAN_MAX_STEPS 48
#define TW_PLAN_MAX_NOTES 4

typedef struct {
  const char *name;                 /* "x", "w", "dy", "y", "dx", "dw", "q" */
  int ndim;
  int64_t global[TW_MAX_DIMS];
  tw_pspec spec;                    /* inputs: as held by the caller; output: final */
  int64_t local[TW_MAX_DIMS];       /* the caller's shard under spec */
  tw_pspec op_spec;                 /* at the local op */
  int64_t op_local[TW_MAX_DIMS];    /* shape at the local op */
} tw_plan_tensor;

typedef struct {
  tw_shard_op op;
  tw_pass pass;
  tw_mesh mesh;
  tw_rule_opts opts;
  int64_t groups;                   /* G of the grouped ops */
  int ninputs;                      /* 2, or 1 for grouped_quantize */
  tw_plan_tensor t[3];              /* inputs then the output (index 2) */
  tw_dimspec partial;               /* the local op's output is a partial sum over these */
  tw_dimspec amax_axes;             /* grouped_quantize, tensor scaling */
  int experts_on_ep;                /* grouped_gemm: w's experts are split over ep */
  int exact;                        /* 1: equals the unsharded op bit for bit (grouped
                                       quantize; GEMMs whose local op is the global one).
                                       Else within the GEMM bound: a BLAS sums in a
                                       shape-dependent order and partial sums add in
                                       another order. */
  int nsteps;
  tw_plan_step steps[TW_PLAN_MAX_STEPS];
  int nnotes;
  char notes[TW_PLAN_MAX_NOTES][160]; /* rules that changed something, e.g. ep injection */
} tw_plan;

/* The rule of `op` for `pass`, from the forward operands x and w (w unused for
 * grouped_quantize, G taken from groups). Errors name the rule. */
tw_status tw_plan_make(const tw_mesh *mesh, tw_shard_op op, tw_pass pass,
                       const tw_shard_operand *x, const tw_shard_operand *w, int64_t groups,
                       const tw_rule_opts *opts, tw_plan *plan);
/* Multi-line text: tensors with global/local shapes and specs, steps, local op, notes. */
const char *tw_plan_format(const tw_plan *plan, char *buf, size_t n);

/* Group sizes of `rank`'s local op from the global ones (host): rows are clipped to the
 * rank's row shard; with experts on ep, the rank's G/ep groups, and any row of another
 * rank's expert is an error. *G_local gets the count. */
tw_status tw_plan_local_groups(const tw_plan *plan, int rank, const int32_t *global_gs,
                               int32_t *local_gs, int64_t *G_local);
/* Shapes of rank's local quantized output (grouped_quantize plans). */
tw_status tw_plan_quantize_shapes(const tw_plan *plan, tw_qtensor *q);

/* ---- execution ---------------------------------------------------------------------- */
/* One communicator per mesh axis for this rank, split from ctx's communicator (collective
 * over it; a NULL ctx comm means one rank). */
typedef struct tw_mesh_comms tw_mesh_comms;
tw_status tw_mesh_comms_create(tw_ctx *ctx, const tw_mesh *mesh, tw_mesh_comms **out);
tw_status tw_mesh_comms_destroy(tw_mesh_comms *mc);
tw_comm *tw_mesh_comms_axis(const tw_mesh_comms *mc, tw_axis a); /* NULL if size 1 */
/* Waits for this rank's enqueued collectives (tw_comm_wait on each axis communicator); when
 * one times out or fails, every axis communicator and ctx's communicator are aborted, so no
 * rank hangs on a stuck peer. ref: returns at once (its calls block). */
tw_status tw_mesh_comms_wait(tw_ctx *ctx, tw_mesh_comms *mc);
int tw_mesh_comms_rank(const tw_mesh_comms *mc);
/* The mesh mc was made for (NULL if mc is NULL). */
const tw_mesh *tw_mesh_comms_mesh(const tw_mesh_comms *mc);

typedef struct {
  tw_tensor in[2];            /* the caller's shards (plan->t[i].local), ctx memory */
  tw_tensor out;              /* dense / grouped_gemm: the output shard (plan->t[2].local) */
  tw_qtensor *q;              /* grouped_quantize: local output (tw_plan_quantize_shapes) */
  const int32_t *group_sizes; /* grouped ops: the global group sizes, host [G] */
  tw_tensor scale;            /* grouped_quantize, delayed: [G] f32 scales, ctx memory */
} tw_shard_io;

/* Runs the plan for this rank. Ranks must call it together with the same plan. On gpu it
 * returns once the work is enqueued on ctx's stream (tw_mesh_comms_wait bounds the wait),
 * except that tensor current scaling derives the per-group scales on the host from the
 * all-reduced amax (one device->host copy). Rows past the groups of an output reached through collectives
 * come back as 0; without collectives they are left untouched. */
tw_status tw_plan_run(tw_ctx *ctx, tw_mesh_comms *mc, const tw_plan *plan, tw_shard_io *io);

/* ---- host helpers (tests, tools) ---------------------------------------------------- */
/* local = the shard of `rank` of a global host tensor under spec (shapes must agree). */
tw_status tw_shard_slice_host(const tw_mesh *m, const tw_pspec *spec, int rank,
                              const tw_tensor *global, tw_tensor *local);
/* Writes rank's shard back into the global host tensor. */
tw_status tw_shard_place_host(const tw_mesh *m, const tw_pspec *spec, int rank,
                              const tw_tensor *local, tw_tensor *global);

#ifdef __cplusplus
}
#endif
#endif /* TWIN_TW_SHARD_H */
