/* The pipeline scan for one rank (§2.4) and its custom VJP (§3.3, §4.2), written once over
 * the interface: activations move with tw_ppermute on the pp communicator, FSDP weights with
 * tw_all_gather / tw_reduce_scatter on the fsdp communicator, the layer through the body's
 * function pointers. Buffers live in ctx memory (stream-ordered); nothing here knows the backend
 * except that a device rank warms its kernels up before its first collective (warm_up). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_comm.h"
#include "twin/tw_pipeline.h"

struct tw_pipeline_saved {
  tw_ctx *ctx;
  float *in;           /* [M*R, rows, E]: stage input of valid iteration k = t - d*s */
  size_t bytes;
  size_t window_bytes; /* largest gathered window (weights + gradients) allocated */
};

typedef enum { RIGHT_ROTATE, RIGHT_SHIFT, LEFT_ROTATE, LEFT_SHIFT, LAST_TO_FIRST, FIRST_TO_LAST } move_kind;
#define MAX_STAGES 256

typedef struct {
  tw_ctx *ctx;
  const tw_pipeline_config *cfg;
  const tw_pipeline_body *body;
  const tw_pipeline_weights *w;
  tw_comm *pp, *fs; /* NULL when the axis has size 1 */
  int S, s, F, M, R, d, Lps, mps, T, use_circ, rotate;
  int in_place;                          /* plain with F = 1: layers read the shards and add into
                                            their gradients; no window */
  int64_t rows, E, act;                  /* act = rows*E floats: one microbatch block */
  int64_t shard_n[TW_PIPELINE_MAX_PARAMS], full_n[TW_PIPELINE_MAX_PARAMS], off[TW_PIPELINE_MAX_PARAMS], P;
  void *scratch;
  float *layer_in;                       /* [Lps-1 or 1, act]: inputs of layers 1..Lps-1 */
  float *g0, *g1;                        /* [act] cotangent ping-pong inside a stage */
  float *tmp;                            /* [act] ppermute landing buffer */
  float *shard_tmp;                      /* [max shard_n] reduce-scatter landing buffer */
  float *wbuf[2], *gbuf[2];              /* the window: plain uses [0] (Lps layers), BSW both */
  size_t window_bytes;
} run;

/* ---- small helpers ------------------------------------------------------------------- */
static tw_status zero(run *r, float *p, int64_t n) { return n ? tw_memset(r->ctx, p, 0, (size_t)n * sizeof(float)) : TW_OK; }

static tw_status copy(run *r, float *dst, const float *src, int64_t n) {
  if (!n || dst == src) return TW_OK;
  tw_mem mem = tw_ctx_mem(r->ctx);
  tw_tensor d = tw_tensor_1d(dst, TW_F32, n, mem), s = tw_tensor_1d((void *)src, TW_F32, n, mem);
  return tw_tensor_copy(r->ctx, &d, &s);
}

/* The scan's buffers live on the context's stream only: stream-ordered (tw_alloc_stream), so
 * the frees at the end of a call never wait for the device while peers' NCCL work is queued,
 * and the backward's buffers reuse the forward's without a device round trip. */
static tw_status alloc_f(run *r, float **p, int64_t n) {
  *p = NULL;
  return tw_alloc_stream(r->ctx, (size_t)(n > 0 ? n : 1) * sizeof(float), (void **)p);
}
static void free_f(run *r, float **p) {
  if (*p) tw_free(r->ctx, *p);
  *p = NULL;
}

/* The loop's microbatch blocks are allocated one by one and change hands by swapping pointers:
 * a 32 MiB copy is a pass over device memory between two layer calls, on the critical path.
 * Every block is held by exactly one pointer at a time (the run's tmp included), so each is
 * freed once whoever holds it at the end. */
static void swap_f(float **a, float **b) {
  float *t = *a;
  *a = *b;
  *b = t;
}
static tw_status alloc_blocks(run *r, float ***b, int n) {
  *b = (float **)calloc((size_t)n, sizeof **b);
  if (!*b) return tw_error(TW_ERR_MEMORY, "pipeline: out of host memory for %d block pointers", n);
  for (int i = 0; i < n; i++) TW_TRY(alloc_f(r, &(*b)[i], r->act));
  return TW_OK;
}
static void free_blocks(run *r, float ***b, int n) {
  if (!*b) return;
  for (int i = 0; i < n; i++) free_f(r, &(*b)[i]);
  free(*b);
  *b = NULL;
}

static void perm_of(move_kind k, int S, int *perm) {
  for (int i = 0; i < S; i++) {
    switch (k) {
      case RIGHT_ROTATE: perm[i] = (i + 1) % S; break;
      case RIGHT_SHIFT: perm[i] = i + 1 < S ? i + 1 : -1; break;
      case LEFT_ROTATE: perm[i] = (i + S - 1) % S; break;
      case LEFT_SHIFT: perm[i] = i >= 1 ? i - 1 : -1; break;
      case LAST_TO_FIRST: perm[i] = i == S - 1 ? 0 : -1; break;
      case FIRST_TO_LAST: perm[i] = i == 0 ? S - 1 : -1; break;
    }
  }
}

/* recv = what the stage that sends to this one sent (zeros if none), along the pp axis. */
static tw_status move_perm(run *r, const int *perm, const float *send, float *recv) {
  if (!r->pp) return perm[0] == 0 ? copy(r, recv, send, r->act) : zero(r, recv, r->act); /* one stage */
  return tw_ppermute(r->ctx, r->pp, send, recv, r->act, TW_F32, perm);
}
static tw_status move(run *r, move_kind k, const float *send, float *recv) {
  int perm[MAX_STAGES];
  perm_of(k, r->S, perm);
  return move_perm(r, perm, send, recv);
}

/* Whether the forward's move of kind k at iteration t carries anything from stage s that is
 * read later; a move that does not is left out (its receiver gets zeros, which nothing reads).
 * Derived from the schedule, so every rank decides alike:
 * - the output shifting right (prev with d = 2): only a valid iteration's (a bubble sends zeros);
 * - the last stage's mover: the output of a valid iteration of a repeat before the last (the last
 *   repeat's outputs never enter stage 0 again);
 * - the state_io column c = t % mps, moving left for the u-th time (t = c + u mps): an input
 *   block still on its way to stage 0 (s + u <= S-1), or an output the last stage wrote at the
 *   column's move w = u - S + s that survives to the final layout, i.e. one of the column's
 *   last S writes (it moves U_c = ceil((T - c) / mps) times; outputs written before are pushed
 *   out of stage 0 unread).
 * pipeline/move_liveness_sim.py (move_liveness_test) replays the forward's data flow block by
 * block for S <= 5, d = 1, 2, R <= 3: no move left out is read, and of 13500 moves the rule
 * keeps 130 that nothing reads (the rotate path's last outputs). */
static int forward_move_live(const run *r, move_kind k, int t, int s) {
  const tw_pipeline_config *c = r->cfg;
  switch (k) {
    case RIGHT_SHIFT:
    case RIGHT_ROTATE: return tw_pipeline_slot(c, t - (r->d - 1), s, NULL, NULL);
    case LAST_TO_FIRST: return tw_pipeline_slot(c, t - 1, s, NULL, NULL) && (t - 1 - r->d * (r->S - 1)) / r->M < r->R - 1;
    case LEFT_SHIFT: {
      const int col = t % r->mps, u = t / r->mps, uses = (r->T - col + r->mps - 1) / r->mps;
      return s + u <= r->S - 1 || u - r->S + s >= uses - r->S;
    }
    default: return 1;
  }
}

/* The backward's moves are the forward's transposed: its move from stage i to j carries the
 * cotangent of what the forward moved from j to i, exactly zero when that was not read. */
static move_kind transposed(move_kind k) {
  switch (k) {
    case RIGHT_SHIFT: return LEFT_SHIFT;
    case LEFT_SHIFT: return RIGHT_SHIFT;
    case RIGHT_ROTATE: return LEFT_ROTATE;
    case LEFT_ROTATE: return RIGHT_ROTATE;
    case LAST_TO_FIRST: return FIRST_TO_LAST;
    default: return LAST_TO_FIRST;
  }
}

/* An iteration's n independent moves as one collective (tw_ppermute_n: over NCCL one group,
 * whose transfers to different stages run side by side instead of one after another), each
 * without the senders whose block carries nothing (forward_move_live; iteration t of the
 * forward, or with backward its transposed move). Their recv buffers overlap nothing else of
 * the call. TWIN_PIPE_SEPARATE_MOVES=1 issues them one by one (same results; for timing the
 * difference); TWIN_PIPE_ALL_MOVES=1 sends every block (same results). */
static tw_status moves(run *r, int t, int backward, int n, const move_kind *kind, const float *const *send,
                       float *const *recv) {
  const char *e = getenv("TWIN_PIPE_SEPARATE_MOVES"); /* read per call: rank threads share no state */
  const int separate = e && atoi(e) == 1;
  const char *a = getenv("TWIN_PIPE_ALL_MOVES");
  const int all = a && atoi(a) == 1;
  int perms[TW_PPERMUTE_N_MAX][MAX_STAGES];
  for (int k = 0; k < n; k++) {
    perm_of(kind[k], r->S, perms[k]);
    for (int i = 0; i < r->S && !all; i++) {
      const int j = perms[k][i];
      if (j < 0) continue;
      const int live = backward ? forward_move_live(r, transposed(kind[k]), t, j) : forward_move_live(r, kind[k], t, i);
      if (!live) perms[k][i] = -1;
    }
  }
  if (!r->pp || separate || n == 1) {
    for (int k = 0; k < n; k++) TW_TRY(move_perm(r, perms[k], send[k], recv[k]));
    return TW_OK;
  }
  const int *pp[TW_PPERMUTE_N_MAX];
  const void *sp[TW_PPERMUTE_N_MAX];
  void *rp[TW_PPERMUTE_N_MAX];
  for (int k = 0; k < n; k++) {
    pp[k] = perms[k];
    sp[k] = send[k];
    rp[k] = recv[k];
  }
  return tw_ppermute_n(r->ctx, r->pp, n, sp, rp, r->act, TW_F32, pp);
}

/* Gathers the Lps layers of W[rep][s] into dst ([Lps, P]). */
static tw_status gather(run *r, int rep, float *dst) {
  for (int l = 0; l < r->Lps; l++)
    for (int i = 0; i < r->body->nparams; i++) {
      const float *src = r->w->w[i] + ((int64_t)rep * r->Lps + l) * r->shard_n[i];
      float *d = dst + l * r->P + r->off[i];
      if (r->fs) TW_TRY(tw_all_gather(r->ctx, r->fs, src, d, r->shard_n[i], TW_F32));
      else TW_TRY(copy(r, d, src, r->shard_n[i]));
    }
  return TW_OK;
}

/* dW shard of (rep, s) += reduce_scatter(g) for the Lps layers of g ([Lps, P]). */
static tw_status scatter_add(run *r, int rep, const float *g) {
  for (int l = 0; l < r->Lps; l++)
    for (int i = 0; i < r->body->nparams; i++) {
      float *dst = r->w->dw[i] + ((int64_t)rep * r->Lps + l) * r->shard_n[i];
      const float *src = g + l * r->P + r->off[i];
      if (r->fs) {
        TW_TRY(tw_reduce_scatter(r->ctx, r->fs, src, r->shard_tmp, r->shard_n[i], TW_F32, TW_REDUCE_SUM));
        src = r->shard_tmp;
      }
      TW_TRY(tw_pipeline_add(r->ctx, dst, src, r->shard_n[i]));
    }
  return TW_OK;
}

static tw_pipeline_params layer_params(run *r, float *base, int l) {
  tw_pipeline_params p;
  memset(&p, 0, sizeof p);
  for (int i = 0; i < r->body->nparams; i++) p.p[i] = base + l * r->P + r->off[i];
  return p;
}

/* Layer l's parameters (or their gradients) from the window buf ([Lps, P]), or with buf NULL
 * (in_place) straight from the rank's shards of repeat rep, base = w->w or w->dw. */
static tw_pipeline_params params_of(run *r, float *buf, float *const *base, int rep, int l) {
  if (buf) return layer_params(r, buf, l);
  tw_pipeline_params p;
  memset(&p, 0, sizeof p);
  for (int i = 0; i < r->body->nparams; i++) p.p[i] = base[i] + ((int64_t)rep * r->Lps + l) * r->shard_n[i];
  return p;
}
static tw_pipeline_params weight_params(run *r, float *wb, int rep, int l) {
  return params_of(r, wb, (float *const *)r->w->w, rep, l);
}

/* out = the stage's Lps layers applied to in, with weights wb ([Lps, P]; NULL: repeat rep's
 * shards in place). */
static tw_status stage_forward(run *r, float *wb, int rep, const float *in, float *out) {
  const float *cur = in;
  for (int l = 0; l < r->Lps; l++) {
    tw_pipeline_params p = weight_params(r, wb, rep, l);
    float *dst = l == r->Lps - 1 ? out : r->layer_in + (l % 2) * r->act;
    TW_TRY(r->body->forward(r->body, r->ctx, &p, cur, dst, r->rows, r->scratch));
    cur = dst;
  }
  return TW_OK;
}

/* din and gb += grads of the stage from its saved input; recomputes the layer inputs. wb, gb
 * NULL (in_place): the shards of repeat rep and their gradients, accumulated into directly. */
static tw_status stage_vjp(run *r, float *wb, int rep, float *gb, const float *in, const float *dout, float *din) {
  /* layer inputs 1..Lps-1 (the heavy state of one iteration, dropped at its end) */
  for (int l = 0; l + 1 < r->Lps; l++) {
    tw_pipeline_params p = weight_params(r, wb, rep, l);
    const float *src = l == 0 ? in : r->layer_in + (int64_t)(l - 1) * r->act;
    TW_TRY(r->body->forward(r->body, r->ctx, &p, src, r->layer_in + (int64_t)l * r->act, r->rows, r->scratch));
  }
  const float *g = dout;
  for (int l = r->Lps - 1; l >= 0; l--) {
    tw_pipeline_params p = weight_params(r, wb, rep, l), dp = params_of(r, gb, r->w->dw, rep, l);
    const float *x = l == 0 ? in : r->layer_in + (int64_t)(l - 1) * r->act;
    float *dst = l == 0 ? din : (g == r->g0 ? r->g1 : r->g0);
    TW_TRY(r->body->vjp(r->body, r->ctx, &p, x, g, dst, &dp, r->rows, r->scratch));
    g = dst;
  }
  return TW_OK;
}

/* ---- warm-up before the first collective ----------------------------------------------- */
/* A device loads kernels lazily: a kernel's first launch, and cuBLASLt's first heuristic query
 * of a GEMM shape (which loads its kernels while it holds a process-wide lock), wait for the
 * device to drain. When one process drives several GPUs, one thread per rank, such a wait in
 * the middle of a run can close a cycle: the device drains only once a peer's matching NCCL op
 * is enqueued, and the peer's thread waits for the lock. On 4 H200s every S >= 3 run stalled so
 * (tests/test_util.h's stall watch, 2026-11-27: one rank inside its first VJP's
 * cublasLtMatmulAlgoGetHeuristic loading a kernel, two ranks waiting for cuBLASLt's lock, one in
 * cudaFree). So before its first collective a device rank runs the body once on zeros, forward
 * and (for the backward) the VJP, which loads every kernel and resolves every GEMM shape the
 * scan will use. Its outputs land in scratch; the VJP adds exact zeros (x = dy = 0, finite
 * weights) to the window's gradient or, in place, to the shards'. Once per context, body shape
 * and row count: later calls find them loaded. */
typedef tw_status (*body_forward_fn)(const tw_pipeline_body *, tw_ctx *, const tw_pipeline_params *,
                                     const float *, float *, int64_t, void *);
typedef struct {
  uint64_t ctx;
  body_forward_fn fwd;
  int64_t rows, width, dims[2 * TW_PIPELINE_MAX_PARAMS];
  int backward;
} warm_key;
static warm_key warmed[256];
static int n_warmed;
static pthread_mutex_t warm_mu = PTHREAD_MUTEX_INITIALIZER;

static warm_key warm_key_of(const run *r, int backward) {
  warm_key k;
  memset(&k, 0, sizeof k);
  k.ctx = tw_ctx_id(r->ctx);
  k.fwd = r->body->forward;
  k.rows = r->rows;
  k.width = r->E;
  for (int i = 0; i < r->body->nparams; i++) {
    k.dims[2 * i] = r->body->param_rows[i];
    k.dims[2 * i + 1] = r->body->param_cols[i];
  }
  k.backward = backward;
  return k;
}

/* 1 if k was warmed before; else records it (while there is room) and returns 0. */
static int warm_seen(const warm_key *k) {
  int seen = 0;
  pthread_mutex_lock(&warm_mu);
  for (int i = 0; i < n_warmed && !seen; i++) seen = !memcmp(&warmed[i], k, sizeof *k);
  if (!seen && n_warmed < (int)(sizeof warmed / sizeof warmed[0])) warmed[n_warmed++] = *k;
  pthread_mutex_unlock(&warm_mu);
  return seen;
}

static tw_status warm_up(run *r, int backward) {
  if (tw_ctx_backend(r->ctx) != TW_BACKEND_GPU || (!r->pp && !r->fs)) return TW_OK;
  warm_key k = warm_key_of(r, backward);
  if (warm_seen(&k)) return TW_OK;
  float *wb = r->in_place ? NULL : r->wbuf[0];
  if (wb) TW_TRY(zero(r, wb, r->P)); /* layer 0 of the window: finite weights */
  TW_TRY(zero(r, r->g0, r->act));
  tw_pipeline_params p = weight_params(r, wb, 0, 0);
  TW_TRY(r->body->forward(r->body, r->ctx, &p, r->g0, r->g1, r->rows, r->scratch));
  TW_TRY(tw_pipeline_add(r->ctx, r->g1, r->g0, r->act));
  if (!backward) return TW_OK;
  tw_pipeline_params dp = params_of(r, r->in_place ? NULL : r->gbuf[0], r->w->dw, 0, 0);
  return r->body->vjp(r->body, r->ctx, &p, r->g0, r->g0, r->g1, &dp, r->rows, r->scratch);
}

static void run_free(run *r) {
  if (r->scratch) tw_free(r->ctx, r->scratch);
  r->scratch = NULL;
  free_f(r, &r->layer_in); free_f(r, &r->g0); free_f(r, &r->g1); free_f(r, &r->tmp); free_f(r, &r->shard_tmp);
  for (int i = 0; i < 2; i++) { free_f(r, &r->wbuf[i]); free_f(r, &r->gbuf[i]); }
}

static tw_status run_init(run *r, tw_ctx *ctx, tw_mesh_comms *mc, const tw_pipeline_config *cfg,
                          const tw_pipeline_body *body, const tw_pipeline_weights *w, int backward) {
  memset(r, 0, sizeof *r);
  if (!ctx || !mc || !cfg || !body || !w) return tw_error(TW_ERR_NULL, "pipeline: NULL argument");
  r->ctx = ctx; r->cfg = cfg; r->body = body; r->w = w;
  const tw_mesh *mesh = tw_mesh_comms_mesh(mc);
  TW_TRY(tw_pipeline_check(cfg, mesh, body));
  if (tw_mesh_axis_size(mesh, TW_AXIS_PP) > MAX_STAGES)
    return tw_error(TW_ERR_UNSUPPORTED, "pipeline: %d stages exceed the %d this build supports",
                    tw_mesh_axis_size(mesh, TW_AXIS_PP), MAX_STAGES);
  r->pp = tw_mesh_comms_axis(mc, TW_AXIS_PP);
  r->fs = tw_mesh_comms_axis(mc, TW_AXIS_FSDP);
  r->S = r->pp ? tw_comm_size(r->pp) : 1;
  r->s = r->pp ? tw_comm_rank(r->pp) : 0;
  r->F = r->fs ? tw_comm_size(r->fs) : 1;
  r->M = cfg->microbatches; r->R = cfg->repeats; r->d = cfg->delay; r->Lps = cfg->layers_per_stage;
  r->mps = r->M / r->S;
  r->T = tw_pipeline_iterations(cfg);
  r->use_circ = r->R > 1 && r->M > r->d * r->S;
  r->rotate = r->R > 1 && !r->use_circ;
  r->in_place = cfg->fsdp == TW_PIPELINE_FSDP_PLAIN && !r->fs;
  r->rows = cfg->mb_rows / r->F;
  r->E = body->width;
  r->act = r->rows * r->E;
  int64_t max_shard = 1;
  for (int i = 0; i < body->nparams; i++) {
    r->full_n[i] = body->param_rows[i] * body->param_cols[i];
    r->shard_n[i] = r->full_n[i] / r->F;
    r->off[i] = r->P;
    r->P += r->full_n[i];
    if (r->shard_n[i] > max_shard) max_shard = r->shard_n[i];
    if (!w->w[i] || (backward && !w->dw[i]))
      return tw_error(TW_ERR_NULL, "pipeline: weight%s shard %d is NULL", backward && w->w[i] ? " gradient" : "", i);
  }
  tw_status s = TW_OK;
  size_t sb = body->scratch_bytes ? body->scratch_bytes(body, r->rows) : 0;
  if (sb) s = tw_alloc_stream(ctx, sb, &r->scratch);
  int64_t nin = r->Lps > 1 ? (int64_t)(r->Lps - 1) * r->act : r->act;
  if (s == TW_OK) s = alloc_f(r, &r->layer_in, backward ? nin : (r->Lps > 1 ? 2 * r->act : r->act));
  if (s == TW_OK) s = alloc_f(r, &r->g0, r->act);
  if (s == TW_OK) s = alloc_f(r, &r->g1, r->act);
  if (s == TW_OK) s = alloc_f(r, &r->tmp, r->act);
  if (s == TW_OK) s = alloc_f(r, &r->shard_tmp, max_shard);
  int nwin = cfg->fsdp == TW_PIPELINE_FSDP_BSW ? 2 : 1;
  int64_t wn = (int64_t)r->Lps * r->P;
  for (int i = 0; i < nwin && s == TW_OK && !r->in_place; i++) {
    s = alloc_f(r, &r->wbuf[i], wn);
    if (s == TW_OK && backward) s = alloc_f(r, &r->gbuf[i], wn);
    r->window_bytes += (size_t)wn * sizeof(float) * (backward ? 2 : 1);
  }
  /* NCCL connects a pair of ranks at its first send/recv. With S >= 3 the pair 0 -> S-1 is first
   * used in the middle of the backward (LEFT_ROTATE, FIRST_TO_LAST), while the other stages
   * have kernels in flight; on 4 H200s (NCCL 2.28.3) S = 3 and 4 stalled there and S = 2, whose
   * pairs all connect at t = 0, did not. Both rotations once here, on scratch, connect every
   * pair the scan uses while nothing is in flight; the results do not change. */
  if (s == TW_OK) s = warm_up(r, backward);
  if (s == TW_OK && r->pp && r->S >= 3) s = zero(r, r->g0, r->act);
  if (s == TW_OK && r->pp && r->S >= 3) s = move(r, RIGHT_ROTATE, r->g0, r->tmp);
  if (s == TW_OK && r->pp && r->S >= 3) s = move(r, LEFT_ROTATE, r->g0, r->tmp);
  if (s != TW_OK) run_free(r);
  return s;
}

/* The weights (t, s) uses: plain gathers them now; BSW picks its window slot. */
typedef struct {
  int next, curr;          /* slots of wbuf/gbuf, -1 = none */
  int next_tag, curr_tag;  /* the repeat each slot holds */
  int step;                /* repeat step the window is set up for, -1 = none */
} window;

/* ---- forward ------------------------------------------------------------------------- */
tw_status tw_pipeline_forward(tw_ctx *ctx, tw_mesh_comms *mc, const tw_pipeline_config *cfg,
                              const tw_pipeline_body *body, const tw_pipeline_weights *w, const float *x,
                              float *y, tw_pipeline_saved **saved) {
  if (saved) *saved = NULL;
  run r;
  TW_TRY(run_init(&r, ctx, mc, cfg, body, w, 0));
  if (!x || !y) { run_free(&r); return tw_error(TW_ERR_NULL, "pipeline_forward: x or y is NULL"); }
  float **state_io = NULL, **circ = NULL; /* [mps] and (stage 0, circ) [M] blocks */
  float *shift = NULL, *mover = NULL, *prev = NULL, *out = NULL, *tmp2 = NULL;
  tw_pipeline_saved *sv = NULL;
  const int S = r.S, s = r.s, M = r.M, R = r.R, d = r.d, mps = r.mps;
  const int64_t act = r.act;
  tw_status st = alloc_blocks(&r, &state_io, mps);
  if (st == TW_OK) st = alloc_f(&r, &shift, act);
  if (st == TW_OK && r.use_circ && s == 0) st = alloc_blocks(&r, &circ, M);
  if (st == TW_OK && r.use_circ) st = alloc_f(&r, &mover, act);
  if (st == TW_OK && d == 2) st = alloc_f(&r, &prev, act);
  if (st == TW_OK) st = alloc_f(&r, &out, act);
  if (st == TW_OK) st = alloc_f(&r, &tmp2, act);
  if (st == TW_OK && saved) {
    sv = (tw_pipeline_saved *)calloc(1, sizeof *sv);
    if (!sv) st = tw_error(TW_ERR_MEMORY, "pipeline_forward: out of host memory");
    else {
      sv->ctx = ctx;
      sv->bytes = (size_t)M * R * (size_t)act * sizeof(float);
      st = alloc_f(&r, &sv->in, (int64_t)M * R * act);
    }
  }
  for (int j = 0; j < mps && st == TW_OK; j++) st = copy(&r, state_io[j], x + j * act, act);
  if (st == TW_OK) st = zero(&r, shift, act);
  for (int j = 0; j < M && circ && st == TW_OK; j++) st = zero(&r, circ[j], act);
  if (st == TW_OK && mover) st = zero(&r, mover, act);
  if (st == TW_OK && prev) st = zero(&r, prev, act);
  window win = {-1, -1, -1, -1, -1};
  const float *landed = shift; /* where the last right move put this stage's next input */
  for (int t = 0; t < r.T && st == TW_OK; t++) {
    const int c = t % mps;
    int m, rep;
    const int valid = tw_pipeline_slot(cfg, t, s, &m, &rep);
    const float *in = landed;
    if (s == 0 && t < M) in = state_io[c];
    else if (s == 0 && r.use_circ) in = circ[t % M];
    if (cfg->fsdp == TW_PIPELINE_FSDP_BSW && t / M != win.step) { /* a new repeat step */
      int step = t / M;
      win.curr = win.next; win.curr_tag = win.next_tag;
      win.next = -1;
      if (step < R) {
        win.next = win.curr == 0 ? 1 : 0;
        win.next_tag = tw_pipeline_window_repeat(cfg, step, s);
        st = gather(&r, win.next_tag, r.wbuf[win.next]);
      }
      win.step = step;
      if (st != TW_OK) break;
    }
    if (valid) {
      if (sv) st = copy(&r, sv->in + (int64_t)(t - d * s) * act, in, act); /* nothing if it landed there */
      float *wb = r.wbuf[0];
      if (cfg->fsdp == TW_PIPELINE_FSDP_BSW) {
        int slot = rep == win.step ? win.next : win.curr;
        if (slot < 0) st = tw_error(TW_ERR_INTERNAL, "pipeline: no window slot for t=%d s=%d", t, s);
        else wb = r.wbuf[slot];
      } else if (r.in_place) {
        wb = NULL;
      } else if (st == TW_OK) {
        st = gather(&r, rep, wb);
      }
      if (st == TW_OK) st = stage_forward(&r, wb, rep, in, out);
    } else {
      st = zero(&r, out, act); /* a bubble computes nothing and sends zeros */
    }
    if (st != TW_OK) break;
    /* The iteration's moves, as one collective: the output (or prev) shifts right into shift
     * (free once this step's compute is enqueued), or straight into the next iteration's
     * saved slot when that one reads it and is valid; the state_io column moves left; with
     * circ, the last stage's previous output (mover) reaches stage 0 one step late. */
    float *right_dst = shift;
    if (sv && t + 1 < r.T && !(s == 0 && (t + 1 < M || r.use_circ)) && tw_pipeline_slot(cfg, t + 1, s, NULL, NULL))
      right_dst = sv->in + (int64_t)(t + 1 - d * s) * act;
    {
      move_kind kind[3] = {r.rotate ? RIGHT_ROTATE : RIGHT_SHIFT, LEFT_SHIFT, LAST_TO_FIRST};
      const float *snd[3] = {d == 2 ? prev : out, state_io[c], mover};
      float *rcv[3] = {right_dst, tmp2, r.tmp};
      st = moves(&r, t, 0, r.use_circ ? 3 : 2, kind, snd, rcv);
    }
    landed = right_dst;
    if (st != TW_OK) break;
    if (r.use_circ && s == 0) swap_f(&circ[((t - d * (S - 1) - 1) % M + M) % M], &r.tmp);
    /* out goes to the last stage's state_io column, to prev (d = 2) and on the last stage to
     * mover (circ; only the last stage sends it): copies to all but the last of them, which
     * takes out's block; the other stages' column takes the one that arrived from the right */
    const int out_to_prev = d == 2, out_to_mover = r.use_circ && s == S - 1;
    if (s == S - 1 && (out_to_prev || out_to_mover)) st = copy(&r, state_io[c], out, act);
    else if (s == S - 1) swap_f(&state_io[c], &out);
    else swap_f(&state_io[c], &tmp2);
    if (st == TW_OK && out_to_prev && out_to_mover) st = copy(&r, prev, out, act);
    else if (out_to_prev) swap_f(&prev, &out);
    if (out_to_mover) swap_f(&mover, &out);
  }
  const int K = (M * (R - 1) + d * (S - 1)) % mps;
  for (int j = 0; j < mps && st == TW_OK; j++) st = copy(&r, y + j * act, state_io[(j + K) % mps], act);
  if (sv) sv->window_bytes = r.window_bytes;
  free_blocks(&r, &state_io, mps); free_f(&r, &shift); free_blocks(&r, &circ, M); free_f(&r, &mover);
  free_f(&r, &prev); free_f(&r, &out); free_f(&r, &tmp2);
  run_free(&r);
  if (st != TW_OK) {
    if (sv) tw_pipeline_saved_free(ctx, sv);
    return st;
  }
  if (saved) *saved = sv;
  return TW_OK;
}

/* ---- backward: the forward iteration transposed, t = T-1 .. 0 ------------------------ */
tw_status tw_pipeline_backward(tw_ctx *ctx, tw_mesh_comms *mc, const tw_pipeline_config *cfg,
                               const tw_pipeline_body *body, const tw_pipeline_weights *w,
                               const tw_pipeline_saved *saved, const float *dy, float *dx) {
  run r;
  TW_TRY(run_init(&r, ctx, mc, cfg, body, w, 1));
  if (!saved || !dy || !dx) { run_free(&r); return tw_error(TW_ERR_NULL, "pipeline_backward: saved, dy or dx is NULL"); }
  const int S = r.S, s = r.s, M = r.M, R = r.R, d = r.d, mps = r.mps;
  const int64_t act = r.act;
  if (saved->bytes != (size_t)M * R * (size_t)act * sizeof(float)) {
    run_free(&r);
    return tw_error(TW_ERR_INVALID_ARG, "pipeline_backward: saved state holds %zu bytes, this configuration needs %zu",
                    saved->bytes, (size_t)M * R * (size_t)act * sizeof(float));
  }
  float **d_io = NULL, **d_circ = NULL; /* [mps] and (stage 0, circ) [M] blocks */
  float *d_shift = NULL, *d_mover = NULL, *d_prev = NULL, *d_out = NULL, *d_in = NULL, *d_src = NULL;
  tw_status st = alloc_blocks(&r, &d_io, mps);
  if (st == TW_OK) st = alloc_f(&r, &d_shift, act);
  if (st == TW_OK && r.use_circ && s == 0) st = alloc_blocks(&r, &d_circ, M);
  if (st == TW_OK && r.use_circ) st = alloc_f(&r, &d_mover, act);
  if (st == TW_OK && d == 2) st = alloc_f(&r, &d_prev, act);
  if (st == TW_OK) st = alloc_f(&r, &d_out, act);
  if (st == TW_OK) st = alloc_f(&r, &d_in, act);
  if (st == TW_OK) st = alloc_f(&r, &d_src, act);
  const int K = (M * (R - 1) + d * (S - 1)) % mps;
  for (int j = 0; j < mps && st == TW_OK; j++) st = copy(&r, d_io[(j + K) % mps], dy + j * act, act);
  if (st == TW_OK) st = zero(&r, d_shift, act);
  for (int j = 0; j < M && d_circ && st == TW_OK; j++) st = zero(&r, d_circ[j], act);
  if (st == TW_OK && d_mover) st = zero(&r, d_mover, act);
  if (st == TW_OK && d_prev) st = zero(&r, d_prev, act);
  const int bsw = cfg->fsdp == TW_PIPELINE_FSDP_BSW;
  window win = {-1, -1, -1, -1, -1};
  int shift_sent = 0; /* d_shift went out and no cotangent replaced it since: a bubble sends zeros */
  for (int t = r.T - 1; t >= 0 && st == TW_OK; t--) {
    const int c = t % mps;
    int m, rep;
    const int valid = tw_pipeline_slot(cfg, t, s, &m, &rep);
    if (bsw && t / M != win.step) { /* entering repeat step t/M from the step above */
      int step = t / M;
      if (win.step >= 0 && win.step < R) st = scatter_add(&r, win.next_tag, r.gbuf[win.next]);
      if (st != TW_OK) break;
      if (win.step >= 0) { /* the step above's w_curr is this step's w_next, its gradient carried */
        win.next = win.curr; win.next_tag = win.curr_tag;
      } else if (step < R) {
        win.next = 1; win.next_tag = tw_pipeline_window_repeat(cfg, step, s);
        st = gather(&r, win.next_tag, r.wbuf[1]);
        if (st == TW_OK) st = zero(&r, r.gbuf[1], r.P);
      } else {
        win.next = -1;
      }
      win.curr = -1;
      if (st == TW_OK && step >= 1) { /* re-gather w_curr: one all-gather per repeat */
        win.curr = win.next == 0 ? 1 : 0;
        win.curr_tag = tw_pipeline_window_repeat(cfg, step - 1, s);
        st = gather(&r, win.curr_tag, r.wbuf[win.curr]);
        if (st == TW_OK) st = zero(&r, r.gbuf[win.curr], r.P);
      }
      win.step = step;
      if (st != TW_OK) break;
    }
    /* The iteration's moves, as one collective (the forward's, transposed): the state_io
     * column's cotangent moves right, shift's returns left, and with circ stage 0's circ slot
     * returns to the last stage's mover; that one lands in d_in (free until the VJP writes it). */
    float *slot = r.use_circ && s == 0 ? d_circ[((t - d * (S - 1) - 1) % M + M) % M] : NULL;
    if (shift_sent) st = zero(&r, d_shift, act);
    shift_sent = 1;
    if (st == TW_OK) {
      move_kind kind[3] = {RIGHT_SHIFT, r.rotate ? LEFT_ROTATE : LEFT_SHIFT, FIRST_TO_LAST};
      const float *snd[3] = {d_io[c], d_shift, slot ? slot : d_io[c]}; /* only stage 0 sends the third */
      float *rcv[3] = {r.tmp, d_src, d_in};
      st = moves(&r, t, 1, r.use_circ ? 3 : 2, kind, snd, rcv);
    }
    if (st != TW_OK) break;
    /* d_out = the cotangent of the stage's output: what came back from the right (d = 1) or
     * the one before it (prev, d = 2), plus on the last stage the state_io column's (its
     * output took the column; the column itself takes what arrived from the left), plus with
     * circ the mover's (mover = out). The first addend's block becomes d_out. */
    swap_f(&d_io[c], &r.tmp); /* r.tmp: the column's cotangent before the move */
    swap_f(&d_out, d == 2 ? &d_prev : &d_src);
    if (s == S - 1) st = tw_pipeline_add(ctx, d_out, r.tmp, act);
    if (d == 2) swap_f(&d_prev, &d_src); /* prev = out */
    if (st == TW_OK && r.use_circ) { /* circ slot <- S-1's mover */
      st = tw_pipeline_add(ctx, d_out, d_mover, act);
      swap_f(&d_mover, &d_in);
      if (st == TW_OK && slot) st = zero(&r, slot, act);
    }
    if (st != TW_OK || !valid) continue; /* a bubble's output is constant: no cotangent flows back */
    const float *in = saved->in + (int64_t)(t - d * s) * act;
    float *wb = r.wbuf[0], *gb = r.gbuf[0];
    if (bsw) {
      int slot = rep == win.step ? win.next : win.curr;
      if (slot < 0) { st = tw_error(TW_ERR_INTERNAL, "pipeline: no window slot for t=%d s=%d", t, s); break; }
      wb = r.wbuf[slot]; gb = r.gbuf[slot];
    } else if (r.in_place) {
      wb = gb = NULL; /* the shards themselves; the VJP adds into their gradients */
    } else {
      st = gather(&r, rep, wb);
      if (st == TW_OK) st = zero(&r, gb, (int64_t)r.Lps * r.P);
    }
    if (st == TW_OK) st = stage_vjp(&r, wb, rep, gb, in, d_out, d_in);
    if (st == TW_OK && !bsw && !r.in_place) st = scatter_add(&r, rep, gb);
    if (st != TW_OK) break;
    /* the input came from exactly one place */
    if (s >= 1 || (t >= M && !r.use_circ)) { /* it goes back left: d_in's block becomes d_shift */
      swap_f(&d_shift, &d_in);
      shift_sent = 0;
    } else if (t < M) {
      st = tw_pipeline_add(ctx, d_io[c], d_in, act);
    } else {
      st = tw_pipeline_add(ctx, d_circ[t % M], d_in, act);
    }
  }
  if (st == TW_OK && bsw && win.step >= 0 && win.step < R) st = scatter_add(&r, win.next_tag, r.gbuf[win.next]);
  for (int j = 0; j < mps && st == TW_OK; j++) st = copy(&r, dx + j * act, d_io[j], act);
  ((tw_pipeline_saved *)saved)->window_bytes = r.window_bytes;
  free_blocks(&r, &d_io, mps); free_f(&r, &d_shift); free_blocks(&r, &d_circ, M); free_f(&r, &d_mover);
  free_f(&r, &d_prev); free_f(&r, &d_out); free_f(&r, &d_in); free_f(&r, &d_src);
  run_free(&r);
  return st;
}

tw_status tw_pipeline_saved_free(tw_ctx *ctx, tw_pipeline_saved *sv) {
  if (!sv) return TW_OK;
  tw_status s = sv->in ? tw_free(ctx ? ctx : sv->ctx, sv->in) : TW_OK;
  free(sv);
  return s;
}

size_t tw_pipeline_saved_size(const tw_pipeline_saved *sv) { return sv ? sv->bytes : 0; }
size_t tw_pipeline_peak_window_bytes(const tw_pipeline_saved *sv) { return sv ? sv->window_bytes : 0; }
