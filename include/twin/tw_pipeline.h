/* twin pipeline: the circular pipeline scan over stages x repeats x microbatches, with a
 * hand-written VJP that saves only the light loop state, and FSDP weights gathered per
 * iteration (plain) or once per repeat into a two-slot sliding window (BSW).
 * Spec: ../shared/reference/pipeline-semantics.md (sections cited as §n). Written once over
 * the interface (tw_gemm.h, tw_comm.h, tw_shard.h mesh communicators): the same code runs on
 * ref thread ranks and on gpu ranks over NCCL.
 *
 * Symbols
 * -------
 *   S stages (mesh axis pp), R repeats, M microbatches, d in {1, 2} forwarding delay,
 *   Lps layers per stage, F = size of mesh axis fsdp (1 if absent), E row width,
 *   mb rows per microbatch (global; each fsdp rank runs mb/F of them).
 *   Global layer index of (repeat r, stage s, layer l) = (r*S + s)*Lps + l (§2.1); the
 *   pipeline computes exactly the sequential model y[m] = layer_{L-1}(...layer_0(x[m])).
 *
 * Schedule (§2.2): T = M*R + d*(S-1) iterations; at iteration t stage s runs
 *   k = t - d*s, valid iff 0 <= k < M*R, microbatch k mod M, repeat k div M, with the
 *   weights W[k div M][s]. Bubble fraction d(S-1)/(M*R + d(S-1)).
 *
 * Loop state of one rank (stage s, fsdp f), the "light" state of §2.3, rows = mb/F:
 *   state_io [M/S, rows, E]   the conveyor: inputs not yet consumed, finished outputs
 *   shift    [rows, E]        this stage's input for the next iteration
 *   circ     [M, rows, E]     stage 0 only, when R > 1 and M > d*S: last-stage outputs
 *                             waiting for their next repeat (MaxText keeps S copies, §8)
 *   mover    [rows, E]        when circ is used: last iteration's output (one-step delay)
 *   prev     [rows, E]        d = 2 only: the previous iteration's output
 * One iteration (§2.4): in = stage 0 ? (t < M ? state_io[t mod M/S] : circ[t mod M] or
 * shift) : shift; out = body(in); then the ppermutes: mover S-1 -> 0 into circ, shift
 * right (rotating when R > 1 and M == d*S), the state_io column left with stage S-1's out.
 * Invalid (t, s) compute nothing and send zeros. Output microbatch m ends on stage m div
 * (M/S) in column (m mod M/S + M(R-1) + d(S-1)) mod (M/S), the layout of the input.
 *
 * Custom VJP (§3): the forward saves, per valid iteration, only the stage input
 *   `iteration_input` [rows, E] f32 — M*R*rows*E*4 bytes per rank in all
 *   (tw_pipeline_saved_bytes); nothing else crosses iterations. The backward runs the scan
 *   in reverse (t = T-1 .. 0), transposing each iteration: cotangents of shift travel left,
 *   of state_io right, of circ from stage 0 back to stage S-1's mover; the body's VJP
 *   recomputes everything inside the stage (the Lps layers' inputs, the hidden activations)
 *   from the saved input, and the weights are gathered again. Heavy state (gathered weights,
 *   hidden activations) never outlives the iteration (plain) or the repeat (BSW).
 *
 * FSDP (§4): each layer parameter is a row-major f32 [rows_i, cols_i] tensor sharded along
 *   rows over fsdp (rank f holds rows [f*rows_i/F, (f+1)*rows_i/F)); the microbatch rows are
 *   sharded the same way (FSDP is data parallel with sharded weights).
 *   plain: before each valid iteration the stage's Lps layers are all-gathered; after its
 *          VJP the gathered gradient is reduce-scattered and added to the shard gradient.
 *          Window: 1 gathered stage weight + 1 gathered gradient. With F = 1 there is nothing to
 *          gather or scatter: the layers read the rank's own shards in place (no copy), the VJP
 *          adds into the shard gradients directly, and there is no window.
 *   BSW:   repeat step r covers iterations [rM, (r+1)M); at its start w_curr <- w_next and
 *          w_next <- AG(W[min(r, R-1)][s]) (§4.3: the correct repeat for every stage; step R
 *          is the drain and gathers nothing). (t, s) uses w_next iff rep(t, s) == r, else
 *          w_curr. The backward re-gathers w_curr once per repeat, reuses the step above's
 *          w_curr as its w_next, and reduce-scatters the window gradient once per repeat.
 *          Window: 2 gathered stage weights + 2 gathered gradients, whatever R is.
 *   bytes of one gathered stage weight: Lps * sum_i rows_i*cols_i * 4 (tw_pipeline_window).
 *
 * Determinism: every sum runs in a fixed order (reverse t within a rank, rank order in the
 * ref reductions), so two runs are bit-identical. Against the unpipelined model run with the
 * same row blocks (tw_pipeline_sequential_ref): y, the loss and dx are bit-identical
 * (every row sees the same GEMMs on the same row blocks); dW is bit-identical for BSW and for
 * F = 1, because both accumulate microbatches m = M-1 .. 0 into one gradient (the window's,
 * reduce-scattered once; at F = 1 plain, the shard gradient itself, as the sequential model
 * does); plain with F > 1 reduce-scatters each microbatch's gradient and adds
 * the shards, another association, so dW is compared within the bound instead.
 */
#ifndef TWIN_TW_PIPELINE_H
#define TWIN_TW_PIPELINE_H

#include "twin/tw_base.h"
#include "twin/tw_comm.h"
#include "twin/tw_shard.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_PIPELINE_MAX_PARAMS 4

/* ---- the stage body: one layer, y = f(x; W), and its VJP ---------------------------- */
struct tw_pipeline_body;
/* The full (gathered) parameters of one layer, f32 [rows_i, cols_i], in ctx memory. */
typedef struct {
  float *p[TW_PIPELINE_MAX_PARAMS];
} tw_pipeline_params;

typedef struct tw_pipeline_body {
  const char *name;
  int nparams;
  int64_t param_rows[TW_PIPELINE_MAX_PARAMS];
  int64_t param_cols[TW_PIPELINE_MAX_PARAMS];
  int64_t width;  /* E: x and y are [rows, E] */
  void *user;
  /* Scratch in ctx memory the calls below may use for `rows` rows. */
  size_t (*scratch_bytes)(const struct tw_pipeline_body *b, int64_t rows);
  /* y [rows, E] = f(x [rows, E]; w). y does not overlap x. */
  tw_status (*forward)(const struct tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w,
                       const float *x, float *y, int64_t rows, void *scratch);
  /* dx = (dy^T df/dx)^T; dw.p[i] += dL/dW_i (accumulates). Recomputes what it needs from x. */
  tw_status (*vjp)(const struct tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w,
                   const float *x, const float *dy, float *dx, tw_pipeline_params *dw,
                   int64_t rows, void *scratch);
} tw_pipeline_body;

/* The dense body y = x + gelu(x W1) W2, W1 [E, H], W2 [H, E], gelu the tanh form
 * 0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h^3))). GEMMs through tw_gemm (f32), the gelu and
 * its derivative through tw_pipeline_gelu / tw_pipeline_gelu_bwd. */
tw_status tw_pipeline_dense_body(int64_t E, int64_t H, tw_pipeline_body *out);

/* Elementwise operations of the dense body and the schedule, f32, n elements in ctx memory
 * (ref: host loops in double, rounded once; gpu: gpu/pipeline_body.cu, f32 math). */
tw_status tw_pipeline_gelu(tw_ctx *ctx, const float *h, float *a, int64_t n);
/* dh = da * gelu'(h) */
tw_status tw_pipeline_gelu_bwd(tw_ctx *ctx, const float *h, const float *da, float *dh, int64_t n);
/* y += x */
tw_status tw_pipeline_add(tw_ctx *ctx, float *y, const float *x, int64_t n);

/* ---- configuration ----------------------------------------------------------------- */
typedef enum { TW_PIPELINE_FSDP_PLAIN = 0, TW_PIPELINE_FSDP_BSW = 1 } tw_pipeline_fsdp;

typedef struct {
  size_t size;            /* sizeof(tw_pipeline_config) */
  int stages;             /* S; must equal the mesh's pp size */
  int microbatches;       /* M */
  int repeats;            /* R */
  int delay;              /* d, 1 or 2 */
  int layers_per_stage;   /* Lps */
  int layers;             /* total layers; S*R*Lps */
  int64_t mb_rows;        /* rows of one microbatch (global, split over fsdp) */
  tw_pipeline_fsdp fsdp;
  /* TEST ONLY: gather w_next with MaxText's index W[rep(rM + 1, s)] (§4.3's defect) to show
   * that the tests catch it. Never set outside tests. */
  int test_stale_window;
} tw_pipeline_config;
#define TW_PIPELINE_CONFIG_INIT {sizeof(tw_pipeline_config), 1, 1, 1, 1, 1, 1, 1, TW_PIPELINE_FSDP_PLAIN, 0}

/* Checks cfg against the mesh and the body; errors name the rule and its values:
 *   pipeline.config_size, pipeline.positive (every count >= 1),
 *   pipeline.mesh_pp (the mesh has no pp axis), pipeline.mesh_axes (an axis other than pp and
 *   fsdp of size > 1), pipeline.stages_match_mesh (S != pp size),
 *   pipeline.microbatches_divisible (M % S != 0, M < S included),
 *   pipeline.layers (S*R*Lps != layers), pipeline.delay (d not 1 or 2),
 *   pipeline.delay_microbatches (d = 2 needs M >= 2S),
 *   pipeline.bsw_repeats (BSW with R = 1), pipeline.bsw_delay (BSW with d = 2),
 *   pipeline.bsw_layers_per_stage (BSW with Lps > 1),
 *   pipeline.fsdp_rows (mb or a parameter's rows not divisible by F),
 *   pipeline.body (a body without forward/vjp or with 0 or too many parameters). */
tw_status tw_pipeline_check(const tw_pipeline_config *cfg, const tw_mesh *mesh,
                            const tw_pipeline_body *body);

/* ---- the schedule (pure functions, §2.2) -------------------------------------------- */
int tw_pipeline_iterations(const tw_pipeline_config *cfg);           /* T */
/* 1 if stage s runs at t; then *microbatch and *repeat are set. */
int tw_pipeline_slot(const tw_pipeline_config *cfg, int t, int s, int *microbatch, int *repeat);
/* The repeat whose weights BSW's w_next holds during step r at stage s (twin: min(r, R-1);
 * with test_stale_window MaxText's min(max(rM + 1 - d s, 0) div M, R-1)). */
int tw_pipeline_window_repeat(const tw_pipeline_config *cfg, int r, int s);
double tw_pipeline_bubble_fraction(const tw_pipeline_config *cfg);  /* d(S-1)/(MR + d(S-1)) */
/* The schedule as text: per iteration and stage `L<layer>:m<mb>` (Lps > 1: the first layer
 * of the stage) or `-`, stage 0's input source, the collectives of the iteration, the window
 * loads (BSW), and the bubble. cfg is checked first (no mesh: S stages, F = fsdp). Returns
 * the bytes needed (like snprintf); buf may be NULL when n is 0. */
tw_status tw_pipeline_format_schedule(const tw_pipeline_config *cfg, int fsdp, char *buf, size_t n,
                                      size_t *needed);

/* ---- memory ------------------------------------------------------------------------- */
/* Bytes a rank holds for the VJP: M*R*(mb/F)*E*4. */
size_t tw_pipeline_saved_bytes(const tw_pipeline_config *cfg, const tw_pipeline_body *body, int fsdp);
/* Bytes of the gathered-weight window a rank holds during a step, gradients included:
 * plain 2 * Lps*P*4 (F = 1: 0, the shards are used in place), BSW 4 * P*4 (P = sum_i rows_i*cols_i). */
size_t tw_pipeline_window_bytes(const tw_pipeline_config *cfg, const tw_pipeline_body *body, int fsdp);
/* Bytes of ctx memory the forward + backward of stage `stage` allocates at its peak (the
 * backward, which runs while `saved` is held), the caller's inputs (weight and gradient
 * shards, x, y, dy, dx) not counted; a = (mb/F)*E*4, one microbatch block:
 *   saved (tw_pipeline_saved_bytes) + window (tw_pipeline_window_bytes)
 *   + the loop state's cotangents: state_io (M/S) a, shift, out, in, source: 4 a;
 *     circ M a on stage 0 and mover a when circ is used (R > 1, M > dS); prev a when d = 2
 *   + per call: layer inputs max(Lps-1, 1) a, two cotangents and one landing buffer 3 a,
 *     a reduce-scatter landing buffer of the largest parameter shard, the body's scratch.
 * The forward holds less (half the window; at most the same state); `twin bench --op
 * pipeline` measures it against cudaMemGetInfo. */
size_t tw_pipeline_peak_bytes(const tw_pipeline_config *cfg, const tw_pipeline_body *body, int fsdp, int stage);

/* ---- running it --------------------------------------------------------------------- */
/* A rank's shards. Parameter i of this rank's stage: f32 [R, Lps, rows_i/F, cols_i]
 * (repeat-major, ctx memory). x, y, dy, dx: [M/S, mb/F, E], this rank's microbatches
 * (m = s*M/S + j) and row block f. */
typedef struct {
  const float *w[TW_PIPELINE_MAX_PARAMS];
  float *dw[TW_PIPELINE_MAX_PARAMS];  /* backward: shard gradients, accumulated into (+=) */
} tw_pipeline_weights;

typedef struct tw_pipeline_saved tw_pipeline_saved; /* the light state for the VJP */

/* Collective over the mesh's ranks (mc from tw_mesh_comms_create on a mesh with a pp axis).
 * saved may be NULL (inference: nothing is kept); else *saved is created and must be passed
 * to tw_pipeline_backward or freed with tw_pipeline_saved_free, on the same ctx: the scan's
 * buffers and the saved state are stream-ordered (tw_alloc_stream), never freed with a wait
 * for the device. On a device backend with a communicator, a rank's first call for a body
 * shape and row count runs the body once on zeros before its first collective (forward, and
 * for the backward the VJP), so that no kernel loads lazily while peers' collectives are
 * queued: its outputs go to scratch, and its VJP adds exact zeros to w->dw (a -0 may become +0). */
tw_status tw_pipeline_forward(tw_ctx *ctx, tw_mesh_comms *mc, const tw_pipeline_config *cfg,
                              const tw_pipeline_body *body, const tw_pipeline_weights *w,
                              const float *x, float *y, tw_pipeline_saved **saved);
/* dx = dL/dx (overwritten), w->dw[i] += dL/dW shards. Consumes nothing: free saved after. */
tw_status tw_pipeline_backward(tw_ctx *ctx, tw_mesh_comms *mc, const tw_pipeline_config *cfg,
                               const tw_pipeline_body *body, const tw_pipeline_weights *w,
                               const tw_pipeline_saved *saved, const float *dy, float *dx);
tw_status tw_pipeline_saved_free(tw_ctx *ctx, tw_pipeline_saved *saved);
/* Bytes held by saved (the measured counterpart of tw_pipeline_saved_bytes). */
size_t tw_pipeline_saved_size(const tw_pipeline_saved *saved);
/* Bytes of the gathered-weight window (gathered weights, plus gathered gradients once the
 * backward ran) that this rank allocated in the forward / backward that used `saved`. */
size_t tw_pipeline_peak_window_bytes(const tw_pipeline_saved *saved);

/* ---- the unpipelined model (one rank, the oracle of the schedule) -------------------- */
/* The sequential model over layers (r*S + s)*Lps + l on the global tensors, on ctx's
 * backend, rows processed in F blocks of mb/F exactly as the fsdp ranks do, weight
 * gradients summed over microbatches M-1 .. 0 per row block and then over blocks in order:
 * the same arithmetic as the pipeline with BSW. Parameter i: [R, S, Lps, rows_i, cols_i];
 * x, y, dy, dx: [M, mb, E]. dy may be NULL (forward only); dw[i] are overwritten. */
tw_status tw_pipeline_sequential_ref(tw_ctx *ctx, const tw_pipeline_config *cfg, int fsdp,
                                     const tw_pipeline_body *body, const float *const *w,
                                     const float *x, float *y, const float *dy, float *dx,
                                     float *const *dw);

#ifdef __cplusplus
}
#endif
#endif /* TWIN_TW_PIPELINE_H */
