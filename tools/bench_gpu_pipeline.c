/* `twin bench --backend gpu --op pipeline`: the circular pipeline scan (tw_pipeline.h) with the
 * dense body y = x + gelu(x W1) W2 (f32, pipeline/dense.c, gpu/pipeline_body.cu), forward +
 * backward (the custom VJP), against the ideal built from one layer measured in the same call.
 *
 *   layer   one layer's forward + VJP alone on GPU 0 (CUDA events, median): t_layer. The VJP
 *           recomputes x W1 and gelu, so one layer-step is 7 GEMMs of 2 mb E H FLOPs.
 *   nccl    (>= 2 GPUs) one stage per GPU, one thread per GPU over NCCL. A stage executes
 *           M R Lps layer-steps; the schedule takes T = MR + d(S-1) iterations, so
 *           theory = M R Lps t_layer / (1 - bubble), bubble = d(S-1)/(MR + d(S-1)) (spec §2.2).
 *           measured / theory is the schedule's overhead (target <= 1.05).
 *   loopback (1 GPU) the S stages are threads with their own contexts and streams on GPU 0
 *           over pipeline/loopback_comm.h: they share one device, so the ideal is the sum of
 *           all stages' work, S M R Lps t_layer (no bubble: an idle stage leaves the GPU to the
 *           others); measured / ideal is the overhead of the schedule, the loopback's copies
 *           and host barriers, and the per-iteration gathers (plain) or window loads (BSW).
 *   step    wall time of forward + backward (saved state freed, context synchronized) on the
 *           slowest rank, after a barrier, inputs already in device memory; median of --iters.
 *   memory  one more step with a body that calls cudaMemGetInfo before every layer call: the
 *           device's peak use beyond what was in use before the step (inputs, contexts) against
 *           tw_pipeline_peak_bytes (summed over the ranks that share the device); the window
 *           the scan allocated (tw_pipeline_peak_window_bytes) against tw_pipeline_window_bytes,
 *           the saved state (tw_pipeline_saved_size) against tw_pipeline_saved_bytes.
 *   trace   (NCCL mode) one more step with a body that records CUDA events around every layer
 *           call on its stage's stream: per stage the layer calls' device time and the gaps
 *           between consecutive calls (the schedule's moves, copies and adds, and the waits for
 *           other stages), forward and backward apart, so the step's overhead over the theory
 *           can be placed without a profiler. */
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ops/bench.h"
#include "ops/data.h"
#include "pipeline/loopback_comm.h"
#include "tools/bench_gpu.h"
#include "twin/tw_comm.h"
#include "twin/tw_pipeline.h"
#include "twin/tw_shard.h"

int tw_gpu_device_count(void);                     /* gpu/probe.cu */
const char *gpu_ppermute_lsa_why(const tw_comm *c); /* gpu/ppermute_lsa.cu: the path the last ppermute took */

enum { MAX_RANKS = 16, MAX_ITERS = 64 };

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* n floats uniform in [-a, a) into device memory through a host chunk (repeated: timing only). */
static int fill_f32(float *d, int64_t n, float a, uint64_t seed) {
  enum { CH = 1 << 22 };
  static float host[CH];
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&mu);
  uint64_t rs = seed;
  for (int64_t i = 0; i < CH; i++) host[i] = (float)((2 * tw_splitmix_unit(&rs) - 1) * a);
  int rc = 0;
  for (int64_t off = 0; off < n && !rc; off += CH) {
    int64_t k = n - off < CH ? n - off : CH;
    rc = cudaMemcpy(d + off, host, (size_t)k * 4, cudaMemcpyHostToDevice) != cudaSuccess;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

static float *dalloc(tw_ctx *ctx, int64_t n, int *ok) {
  void *p = NULL;
  if (*ok && tw_alloc(ctx, (size_t)(n > 0 ? n : 1) * 4, &p) != TW_OK) *ok = 0;
  return (float *)p;
}

/* ---- one layer alone ------------------------------------------------------------------- */
typedef struct {
  const tw_pipeline_body *b;
  tw_ctx *ctx;
  tw_pipeline_params w, dw;
  float *x, *y, *dy, *dx;
  void *scratch;
  int64_t rows;
  int part; /* 0: fwd + vjp, 1: fwd, 2: vjp */
} layer_job;

static int layer_step(void *arg) {
  layer_job *j = (layer_job *)arg;
  if (j->part != 2 && j->b->forward(j->b, j->ctx, &j->w, j->x, j->y, j->rows, j->scratch) != TW_OK) return 1;
  if (j->part != 1 && j->b->vjp(j->b, j->ctx, &j->w, j->x, j->dy, j->dx, &j->dw, j->rows, j->scratch) != TW_OK)
    return 1;
  return 0;
}

/* Median ms of one layer's fwd + vjp (and of each alone) on GPU dev; < 0 on failure. With bar,
 * the timing starts once every thread of the barrier has set up (layers on all GPUs at once). */
static double time_layer(const tw_pipeline_body *b, int64_t rows, int warm, int iters, double *fwd_ms, double *vjp_ms,
                         int dev, pthread_barrier_t *bar) {
  cudaStream_t stream;
  if (cudaSetDevice(dev) != cudaSuccess || cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "bench gpu pipeline: no CUDA stream on GPU %d\n", dev);
    if (bar) pthread_barrier_wait(bar);
    return -1;
  }
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU; cc.stream = stream; cc.device = dev;
  if (tw_ctx_create(&ctx, &cc) != TW_OK) {
    fprintf(stderr, "bench gpu pipeline: %s\n", tw_last_error());
    cudaStreamDestroy(stream);
    if (bar) pthread_barrier_wait(bar);
    return -1;
  }
  const int64_t E = b->width, H = b->param_cols[0];
  layer_job j;
  memset(&j, 0, sizeof j);
  int ok = 1;
  j.b = b; j.ctx = ctx; j.rows = rows;
  j.w.p[0] = dalloc(ctx, E * H, &ok); j.w.p[1] = dalloc(ctx, H * E, &ok);
  j.dw.p[0] = dalloc(ctx, E * H, &ok); j.dw.p[1] = dalloc(ctx, H * E, &ok);
  j.x = dalloc(ctx, rows * E, &ok); j.y = dalloc(ctx, rows * E, &ok);
  j.dy = dalloc(ctx, rows * E, &ok); j.dx = dalloc(ctx, rows * E, &ok);
  size_t sb = b->scratch_bytes(b, rows);
  if (ok && tw_alloc(ctx, sb, &j.scratch) != TW_OK) ok = 0;
  if (ok)
    ok = !fill_f32(j.w.p[0], E * H, (float)(1 / sqrt((double)E)), 11) &&
         !fill_f32(j.w.p[1], H * E, (float)(1 / sqrt((double)H)), 12) && !fill_f32(j.x, rows * E, 1, 13) &&
         !fill_f32(j.dy, rows * E, 1, 14) && cudaMemset(j.dw.p[0], 0, (size_t)(E * H) * 4) == cudaSuccess &&
         cudaMemset(j.dw.p[1], 0, (size_t)(H * E) * 4) == cudaSuccess;
  double ms = -1;
  if (bar) {
    cudaDeviceSynchronize();
    pthread_barrier_wait(bar);
  }
  if (!ok) {
    fprintf(stderr, "bench gpu pipeline: one layer does not fit or failed to set up: %s\n", tw_last_error());
  } else {
    j.part = 0;
    ms = tw_bench_gpu_time(stream, warm, iters, layer_step, &j);
    j.part = 1;
    *fwd_ms = tw_bench_gpu_time(stream, 1, iters, layer_step, &j);
    j.part = 2;
    *vjp_ms = tw_bench_gpu_time(stream, 1, iters, layer_step, &j);
    if (tw_ctx_check(ctx) != TW_OK) {
      fprintf(stderr, "bench gpu pipeline: one layer: %s\n", tw_last_error());
      ms = -1;
    }
  }
  float *bufs[] = {j.w.p[0], j.w.p[1], j.dw.p[0], j.dw.p[1], j.x, j.y, j.dy, j.dx};
  for (int i = 0; i < 8; i++)
    if (bufs[i]) tw_free(ctx, bufs[i]);
  if (j.scratch) tw_free(ctx, j.scratch);
  tw_ctx_destroy(ctx);
  cudaStreamDestroy(stream);
  return ms;
}

/* The same on GPUs 0..n-1 at once, a thread each (what the pipeline's stages do side by side):
 * the slowest GPU's median fwd + vjp. */
typedef struct {
  const tw_pipeline_body *b;
  int64_t rows;
  int warm, iters, dev;
  pthread_barrier_t *bar;
  double ms, fwd, vjp;
} layer_thread;

static void *layer_thread_main(void *arg) {
  layer_thread *t = (layer_thread *)arg;
  t->ms = time_layer(t->b, t->rows, t->warm, t->iters, &t->fwd, &t->vjp, t->dev, t->bar);
  return NULL;
}

static double time_layer_all(const tw_pipeline_body *b, int64_t rows, int warm, int iters, int n) {
  layer_thread th[MAX_RANKS];
  pthread_t tid[MAX_RANKS];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, (unsigned)n);
  for (int i = 0; i < n; i++) {
    th[i] = (layer_thread){b, rows, warm, iters, i, &bar, -1, -1, -1};
    pthread_create(&tid[i], NULL, layer_thread_main, &th[i]);
  }
  double worst = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(tid[i], NULL);
    worst = th[i].ms < 0 || worst < 0 ? -1 : fmax(worst, th[i].ms);
  }
  pthread_barrier_destroy(&bar);
  return worst;
}

/* ---- the pipeline on S ranks ------------------------------------------------------------- */
#define TRACE_MAX 512 /* layer calls traced per rank (fwd + bwd of one step) */
typedef struct {
  tw_ctx *ctx;
  cudaStream_t stream;
  cudaEvent_t a[TRACE_MAX], b[TRACE_MAX]; /* before / after each layer call */
  char bwd[TRACE_MAX];
  cudaEvent_t edge[3]; /* the step's start, between tw_pipeline_forward and _backward, its end (after its waits) */
  int n, made, on; /* on: the trace step is running */
} trace_rank;

typedef struct {  /* one rank's trace step */
  int calls[2];   /* [0] forward, [1] backward layer calls */
  double busy_ms[2], gap_med_ms[2], gap_sum_ms[2], span_ms;
  double lead_ms, fwd_tail_ms, bwd_lead_ms, tail_ms; /* around the calls: see trace_summary */
  int ok;
} trace_sum;

typedef struct {
  tw_pipeline_config c;
  tw_pipeline_body dense, probe, noop, traced;
  trace_rank *trace; /* [MAX_RANKS] by GPU, NCCL mode only */
  trace_sum tsum[MAX_RANKS];
  tw_mesh mesh;
  int loopback, warm, iters;
  double step_s[MAX_ITERS + 8][MAX_RANKS];
  double sched_s[MAX_ITERS + 8][MAX_RANKS]; /* the same steps with the no-op body */
  double move_ms[MAX_RANKS];                /* one ppermute of a microbatch block, median */
  double move3_ms[MAX_RANKS];               /* a forward iteration's three moves as one ppermute_n, median */
  char move_path[160];                      /* rank 0's: over the window or NCCL's group, and why */
  size_t saved_size[MAX_RANKS], window_size[MAX_RANKS], ledger_peak[MAX_RANKS];
  size_t base_free[MAX_RANKS], min_free[MAX_RANKS]; /* per device */
  pthread_mutex_t mu;
} pjob;

static void probe_now(pjob *j) {
  int dev = 0;
  size_t fr = 0, tot = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= MAX_RANKS) return;
  if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) return;
  pthread_mutex_lock(&j->mu);
  if (fr < j->min_free[dev]) j->min_free[dev] = fr;
  pthread_mutex_unlock(&j->mu);
}
static tw_status probe_forward(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                               float *y, int64_t rows, void *scratch) {
  pjob *j = (pjob *)b->user;
  probe_now(j);
  return j->dense.forward(b, ctx, w, x, y, rows, scratch);
}
static tw_status probe_vjp(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                           const float *dy, float *dx, tw_pipeline_params *dw, int64_t rows, void *scratch) {
  pjob *j = (pjob *)b->user;
  probe_now(j);
  return j->dense.vjp(b, ctx, w, x, dy, dx, dw, rows, scratch);
}

/* A body that computes nothing: the step with it is the schedule alone (moves, copies, window
 * gathers, the scan's allocations), which the layer's compute adds to unless they overlap. */
static tw_status noop_forward(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                              float *y, int64_t rows, void *scratch) {
  (void)b; (void)ctx; (void)w; (void)x; (void)y; (void)rows; (void)scratch;
  return TW_OK;
}
static tw_status noop_vjp(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                          const float *dy, float *dx, tw_pipeline_params *dw, int64_t rows, void *scratch) {
  (void)b; (void)ctx; (void)w; (void)x; (void)dy; (void)dx; (void)dw; (void)rows; (void)scratch;
  return TW_OK;
}

/* The dense body with CUDA events around each call (the trace step); ranks are found by ctx. */
static trace_rank *trace_of(pjob *j, tw_ctx *ctx) { /* NCCL mode: stage r runs on GPU r */
  int d = -1;
  if (!j->trace || cudaGetDevice(&d) != cudaSuccess || d < 0 || d >= MAX_RANKS) return NULL;
  return j->trace[d].ctx == ctx ? &j->trace[d] : NULL;
}
static tw_status traced_forward(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                                float *y, int64_t rows, void *scratch) {
  pjob *j = (pjob *)b->user;
  trace_rank *t = trace_of(j, ctx);
  const int i = t && t->on && t->n < t->made ? t->n++ : -1;
  if (i >= 0) { t->bwd[i] = 0; cudaEventRecord(t->a[i], t->stream); }
  tw_status s = j->dense.forward(&j->dense, ctx, w, x, y, rows, scratch);
  if (i >= 0) cudaEventRecord(t->b[i], t->stream);
  return s;
}
static tw_status traced_vjp(const tw_pipeline_body *b, tw_ctx *ctx, const tw_pipeline_params *w, const float *x,
                            const float *dy, float *dx, tw_pipeline_params *dw, int64_t rows, void *scratch) {
  pjob *j = (pjob *)b->user;
  trace_rank *t = trace_of(j, ctx);
  const int i = t && t->on && t->n < t->made ? t->n++ : -1;
  if (i >= 0) { t->bwd[i] = 1; cudaEventRecord(t->a[i], t->stream); }
  tw_status s = j->dense.vjp(&j->dense, ctx, w, x, dy, dx, dw, rows, scratch);
  if (i >= 0) cudaEventRecord(t->b[i], t->stream);
  return s;
}

/* After the trace step (stream synchronized): rank r's calls and gaps, printed by the caller. */

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static trace_sum trace_summary(trace_rank *t) {
  trace_sum r;
  memset(&r, 0, sizeof r);
  double g[2][TRACE_MAX]; /* per thread: every rank summarizes its own trace at once */
  int ng[2] = {0, 0};
  for (int i = 0; i < t->n; i++) {
    float ms = 0;
    const int k = t->bwd[i];
    r.calls[k]++;
    if (cudaEventElapsedTime(&ms, t->a[i], t->b[i]) == cudaSuccess) r.busy_ms[k] += ms;
    if (i + 1 < t->n && t->bwd[i + 1] == k && cudaEventElapsedTime(&ms, t->b[i], t->a[i + 1]) == cudaSuccess) {
      g[k][ng[k]++] = ms;
      r.gap_sum_ms[k] += ms;
    }
  }
  for (int k = 0; k < 2; k++) {
    qsort(g[k], (size_t)ng[k], sizeof(double), cmp_d);
    r.gap_med_ms[k] = ng[k] ? g[k][ng[k] / 2] : 0;
  }
  float ms = 0;
  if (t->n > 1 && cudaEventElapsedTime(&ms, t->a[0], t->b[t->n - 1]) == cudaSuccess) r.span_ms = ms;
  /* the device timeline around the calls: step start to the first call, the last forward call to
   * tw_pipeline_forward's return (= the backward's call), that to the backward's first call, and
   * the last call to the step's end (its comm waits and sync) */
  int last_f = -1, first_b = -1;
  for (int i = 0; i < t->n; i++) {
    if (!t->bwd[i]) last_f = i;
    if (t->bwd[i] && first_b < 0) first_b = i;
  }
  if (t->n > 0 && cudaEventElapsedTime(&ms, t->edge[0], t->a[0]) == cudaSuccess) r.lead_ms = ms;
  if (last_f >= 0 && cudaEventElapsedTime(&ms, t->b[last_f], t->edge[1]) == cudaSuccess) r.fwd_tail_ms = ms;
  if (first_b >= 0 && cudaEventElapsedTime(&ms, t->edge[1], t->a[first_b]) == cudaSuccess) r.bwd_lead_ms = ms;
  if (t->n > 0 && cudaEventElapsedTime(&ms, t->b[t->n - 1], t->edge[2]) == cudaSuccess) r.tail_ms = ms;
  return r;
}

/* Median ms of one ppermute of n floats around the pp ring (every rank sends and receives), or
 * (three) of a forward iteration's three moves as one ppermute_n: right shift, left shift, last
 * to first, from a, a + n, a + 2n into b, b + n, b + 2n. */
static double time_move(tw_ctx *ctx, cudaStream_t s, tw_comm *comm, int S, float *a, float *b, int64_t n, int iters,
                        int three) {
  int perm[MAX_RANKS], right[MAX_RANKS], left[MAX_RANKS], last[MAX_RANKS];
  for (int i = 0; i < S; i++) {
    perm[i] = (i + 1) % S;
    right[i] = i + 1 < S ? i + 1 : -1;
    left[i] = i >= 1 ? i - 1 : -1;
    last[i] = i == S - 1 ? 0 : -1;
  }
  const int *perms[3] = {right, left, last};
  const void *snd[3] = {a, a + n, a + 2 * n};
  void *rcv[3] = {b, b + n, b + 2 * n};
  double ms[MAX_ITERS + 8];
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  double med = -1;
  int k = 0;
  for (int it = 0; it < iters + 2; it++) {
    if (tw_comm_barrier(ctx, comm) != TW_OK || tw_ctx_sync(ctx) != TW_OK) break;
    cudaEventRecord(e0, s);
    if (three ? tw_ppermute_n(ctx, comm, 3, snd, rcv, n, TW_F32, perms) != TW_OK
              : tw_ppermute(ctx, comm, a, b, n, TW_F32, perm) != TW_OK)
      break;
    cudaEventRecord(e1, s);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (it >= 2) ms[k++] = t;
  }
  if (k == iters) med = tw_bench_median(ms, k);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return med;
}

/* Every rank here, its stream drained (NCCL's barrier is an all-reduce on the stream). */
static tw_status barrier(tw_ctx *ctx, tw_comm *comm) {
  if (comm) TW_TRY(tw_comm_barrier(ctx, comm));
  return tw_ctx_sync(ctx);
}

static tw_status prank(int rank, tw_comm *comm, void *arg) {
  pjob *j = (pjob *)arg;
  const tw_pipeline_config *c = &j->c;
  const int dev = j->loopback ? 0 : rank, S = c->stages, mps = c->microbatches / S, RL = c->repeats * c->layers_per_stage;
  const int64_t E = j->dense.width, act = c->mb_rows * E;
  if (cudaSetDevice(dev) != cudaSuccess) return tw_error(TW_ERR_DEVICE, "pipeline bench: cudaSetDevice(%d)", dev);
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return tw_error(TW_ERR_DEVICE, "pipeline bench: no CUDA stream on GPU %d", dev);
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU; cc.device = dev; cc.comm = comm; cc.stream = stream;
  tw_status cs = tw_ctx_create(&ctx, &cc);
  if (cs != TW_OK) {
    cudaStreamDestroy(stream);
    return cs;
  }
  tw_mesh_comms *mc = NULL;
  tw_status st = tw_mesh_comms_create(ctx, &j->mesh, &mc);
  tw_pipeline_weights w;
  memset(&w, 0, sizeof w);
  int ok = st == TW_OK;
  for (int i = 0; i < j->dense.nparams; i++) {
    int64_t n = (int64_t)RL * j->dense.param_rows[i] * j->dense.param_cols[i];
    float *wi = dalloc(ctx, n, &ok), *dwi = dalloc(ctx, n, &ok);
    w.w[i] = wi; w.dw[i] = dwi;
    if (ok) ok = !fill_f32(wi, n, (float)(1 / sqrt((double)j->dense.param_rows[i])), 100 + (uint64_t)rank * 8 + (uint64_t)i) &&
                 cudaMemset(dwi, 0, (size_t)n * 4) == cudaSuccess;
  }
  float *x = dalloc(ctx, mps * act, &ok), *y = dalloc(ctx, mps * act, &ok);
  float *dy = dalloc(ctx, mps * act, &ok), *dx = dalloc(ctx, mps * act, &ok);
  if (ok) ok = !fill_f32(x, mps * act, 1, 200 + (uint64_t)rank) && !fill_f32(dy, mps * act, 1, 300 + (uint64_t)rank);
  if (st == TW_OK && !ok) st = tw_error(TW_ERR_MEMORY, "pipeline bench: rank %d: the inputs do not fit or failed to load: %s",
                                        rank, tw_last_error());
  if (st == TW_OK) st = tw_ctx_sync(ctx);
  const int timed = j->warm + j->iters + 1;  /* the last one measures memory */
  const int total = timed + 2 + j->iters;     /* the trace step, then the schedule alone (no-op body), one warm-up */
  trace_rank *tr = j->trace && !j->loopback && dev < MAX_RANKS ? &j->trace[dev] : NULL;
  if (tr) { /* events that fail to be made leave the trace out (no error reaches the steps) */
    int e = 0;
    while (e < 3 && cudaEventCreate(&tr->edge[e]) == cudaSuccess) e++;
    for (; tr->made < TRACE_MAX && e == 3; tr->made++) {
      if (cudaEventCreate(&tr->a[tr->made]) != cudaSuccess) break;
      if (cudaEventCreate(&tr->b[tr->made]) != cudaSuccess) {
        cudaEventDestroy(tr->a[tr->made]);
        break;
      }
    }
    if (e < 3 || tr->made == 0) {
      while (e > 0) cudaEventDestroy(tr->edge[--e]);
      for (int i = 0; i < tr->made; i++) {
        cudaEventDestroy(tr->a[i]);
        cudaEventDestroy(tr->b[i]);
      }
      tr->made = 0;
      tr = NULL;
    } else {
      tr->ctx = ctx;
      tr->stream = stream;
    }
    cudaGetLastError();
  }
  for (int it = 0; it < total && st == TW_OK; it++) {
    const int mem = it == timed - 1, trace = it == timed, noop = it > timed;
    if (mem) st = tw_ctx_trim(ctx); /* what the context's pool keeps goes back, so the step maps its own */
    if (st == TW_OK) st = barrier(ctx, comm);
    if (st == TW_OK && mem) { /* what is in use before the step, then nobody allocates until all have read it */
      size_t fr = 0, tot = 0;
      cudaMemGetInfo(&fr, &tot);
      pthread_mutex_lock(&j->mu);
      if (!j->base_free[dev] || fr > j->base_free[dev]) j->base_free[dev] = fr;
      j->min_free[dev] = j->base_free[dev];
      pthread_mutex_unlock(&j->mu);
      st = barrier(ctx, comm);
    }
    if (st != TW_OK) break;
    /* the timed steps and the trace step run one body (the scan warms a body up once, keyed by
     * its functions: the trace step must not see a warm-up); it records only in the trace step */
    const tw_pipeline_body *b = noop ? &j->noop : mem ? &j->probe : &j->traced;
    if (trace && !tr) continue;
    if (tr) {
      tr->n = 0;
      tr->on = trace;
    }
    tw_pipeline_saved *sv = NULL;
    size_t inputs = 0, peak = 0;
    if (mem) {
      tw_ctx_reset_peak(ctx);
      tw_ctx_memory(ctx, &inputs, NULL);
    }
    double t0 = now_s();
    if (tr && trace) cudaEventRecord(tr->edge[0], stream);
    st = tw_pipeline_forward(ctx, mc, c, b, &w, x, y, &sv);
    if (tr && trace) cudaEventRecord(tr->edge[1], stream);
    if (st == TW_OK) st = tw_pipeline_backward(ctx, mc, c, b, &w, sv, dy, dx);
    if (st == TW_OK && mem) {
      tw_ctx_memory(ctx, NULL, &peak);
      j->ledger_peak[rank] = peak - inputs;
      j->saved_size[rank] = tw_pipeline_saved_size(sv);
      j->window_size[rank] = tw_pipeline_peak_window_bytes(sv);
    }
    tw_status fs = tw_pipeline_saved_free(ctx, sv);
    if (st == TW_OK) st = fs;
    if (st == TW_OK) st = tw_mesh_comms_wait(ctx, mc);
    if (tr && trace) cudaEventRecord(tr->edge[2], stream);
    if (st == TW_OK) st = tw_ctx_sync(ctx);
    if (tr) tr->on = 0;
    /* summarized now: the no-op steps after it reset the count */
    if (tr && trace && st == TW_OK && tr->n > 0 && tr->n < tr->made) { /* n == made: calls past the events */
      j->tsum[rank] = trace_summary(tr);
      j->tsum[rank].ok = 1;
    }
    if (noop) j->sched_s[it - timed - 1][rank] = now_s() - t0;
    else if (!trace) j->step_s[it][rank] = now_s() - t0;
  }
  if (tr) {
    for (int e = 0; e < 3; e++) cudaEventDestroy(tr->edge[e]);
    for (int i = 0; i < tr->made; i++) {
      cudaEventDestroy(tr->a[i]);
      cudaEventDestroy(tr->b[i]);
    }
    tr->made = 0;
  }
  if (st == TW_OK && comm) { /* one move of a microbatch block, as the scan makes 2-3 per iteration each way */
    j->move_ms[rank] = time_move(ctx, stream, comm, S, x, y, act, j->iters, 0);
    if (j->move_ms[rank] < 0) st = tw_error(TW_ERR_NCCL, "pipeline bench: rank %d: timing one ppermute failed: %s", rank, tw_last_error());
    int ok3 = 1; /* after the steps: the memory figures above do not see these */
    float *a3 = st == TW_OK ? dalloc(ctx, 3 * act, &ok3) : NULL, *b3 = ok3 && a3 ? dalloc(ctx, 3 * act, &ok3) : NULL;
    j->move3_ms[rank] = ok3 && a3 && b3 ? time_move(ctx, stream, comm, S, a3, b3, act, j->iters, 1) : -1;
    if (st == TW_OK && j->move3_ms[rank] < 0)
      st = tw_error(TW_ERR_NCCL, "pipeline bench: rank %d: timing three moves failed: %s", rank, tw_last_error());
    if (a3) tw_free(ctx, a3);
    if (b3) tw_free(ctx, b3);
    if (rank == 0 && !strcmp(tw_comm_kind(comm), "nccl")) {
      const char *f = getenv("TWIN_PPERMUTE");
      snprintf(j->move_path, sizeof j->move_path, "%s", f && !strcmp(f, "nccl") ? "NCCL's group (TWIN_PPERMUTE=nccl)"
                                                                               : gpu_ppermute_lsa_why(comm));
    }
  }
  if (st == TW_OK) st = tw_ctx_check(ctx);
  for (int i = 0; i < j->dense.nparams; i++) {
    if (w.w[i]) tw_free(ctx, (void *)w.w[i]);
    if (w.dw[i]) tw_free(ctx, w.dw[i]);
  }
  float *bufs[] = {x, y, dy, dx};
  for (int i = 0; i < 4; i++)
    if (bufs[i]) tw_free(ctx, bufs[i]);
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  cudaStreamDestroy(stream);
  return st;
}

static const double MiB = 1048576.0;

static int64_t act_bytes(const pjob *j) { return j->c.mb_rows * j->dense.width * (int64_t)sizeof(float); }

int tw_bench_gpu_pipeline(const tw_bench_cfg *cfg) {
  const tw_bench_pipeline *pp = cfg->pipeline;
  if (!pp || !cfg->op || strcmp(cfg->op, "pipeline")) return 0; /* heavy: only when asked by name */
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const int gpus = tw_gpu_device_count(), S = pp->stages, loopback = pp->mode == TW_BENCH_PP_LOOPBACK;
  if (gpus < 1) {
    fprintf(stderr, "bench gpu pipeline: no GPU visible\n");
    return 1;
  }
  if (!loopback && gpus < S) { /* cmd_bench.c resolved the mode; guard anyway */
    fprintf(stderr, "bench gpu pipeline: NCCL mode needs >= %d GPUs (one stage per GPU), sees %d\n", S, gpus);
    return 1;
  }
  if (S > MAX_RANKS) {
    fprintf(stderr, "bench gpu pipeline: S = %d stages exceed the %d ranks this bench runs\n", S, MAX_RANKS);
    return 1;
  }
  pjob *j = (pjob *)calloc(1, sizeof *j);
  if (!j) return 1;
  if (!loopback && !(j->trace = (trace_rank *)calloc(MAX_RANKS, sizeof *j->trace))) {
    free(j);
    return 1;
  }
  pthread_mutex_init(&j->mu, NULL);
  j->loopback = loopback;
  j->warm = cfg->warmup > 7 ? 7 : cfg->warmup;
  j->iters = cfg->iters < 1 ? 1 : cfg->iters > MAX_ITERS ? MAX_ITERS : cfg->iters;
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = S; c.microbatches = pp->microbatches; c.repeats = pp->repeats; c.delay = pp->delay;
  c.layers_per_stage = 1; c.layers = S * pp->repeats; c.mb_rows = pp->mb_rows;
  c.fsdp = pp->bsw ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  j->c = c;
  int rc = 1;
  if (tw_pipeline_dense_body(pp->hidden, pp->ffn, &j->dense) != TW_OK) {
    fprintf(stderr, "bench gpu pipeline: %s\n", tw_last_error());
    goto out;
  }
  j->probe = j->dense;
  j->probe.forward = probe_forward;
  j->probe.vjp = probe_vjp;
  j->probe.user = j;
  j->noop = j->dense;
  j->noop.forward = noop_forward;
  j->noop.vjp = noop_vjp;
  j->traced = j->dense;
  j->traced.forward = traced_forward;
  j->traced.vjp = traced_vjp;
  j->traced.user = j;
  tw_axis ax = TW_AXIS_PP;
  if (tw_mesh_init(&j->mesh, 1, &ax, &c.stages) != TW_OK) {
    fprintf(stderr, "bench gpu pipeline: %s\n", tw_last_error());
    goto out;
  }
  struct cudaDeviceProp prop;
  char gpu_name[256] = "?";
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) snprintf(gpu_name, sizeof gpu_name, "%s", prop.name);
  char when[32];
  time_t tnow = time(NULL);
  strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&tnow));
  const int64_t E = pp->hidden, H = pp->ffn, mb = pp->mb_rows;
  const int M = c.microbatches, R = c.repeats, d = c.delay, Lps = c.layers_per_stage, T = tw_pipeline_iterations(&c);
  const double bubble = tw_pipeline_bubble_fraction(&c), layer_flops = 7.0 * 2.0 * (double)mb * (double)E * (double)H;
  char cfgs[64];
  snprintf(cfgs, sizeof cfgs, "S=%d M=%d R=%d d=%d %s", S, M, R, d, pp->bsw ? "bsw" : "plain");
  printf("# pipeline bench, %s, %d x %s visible\n", when, gpus, gpu_name);
  if (loopback)
    printf("# mode: LOOPBACK, one GPU: the %d stages are threads with their own contexts and streams on GPU 0 over "
           "pipeline/loopback_comm.c (%s)\n",
           S, gpus >= 2 ? "asked for with --mode loopback" : "NCCL mode needs >= 2 GPUs, this machine has 1");
  else
    printf("# mode: NCCL, one stage per GPU on GPUs 0..%d, one thread per GPU\n", S - 1);
  printf("# config: %s Lps=1 F=1, dense body E=%lld H=%lld f32, mb=%lld rows; T = MR + d(S-1) = %d iterations, "
         "bubble d(S-1)/(MR+d(S-1)) = %d/%d = %.4f\n",
         cfgs, (long long)E, (long long)H, (long long)mb, T, d * (S - 1), T, bubble);

  /* one layer alone */
  double fwd_ms = -1, vjp_ms = -1;
  const double layer_ms = time_layer(&j->dense, mb, cfg->warmup > 2 ? cfg->warmup : 2, j->iters > 5 ? j->iters : 5,
                                     &fwd_ms, &vjp_ms, 0, NULL);
  /* the same on every stage's GPU at once: the pipeline's GPUs are all busy */
  const double layer_all_ms =
      !loopback && S > 1 && layer_ms > 0
          ? time_layer_all(&j->dense, mb, cfg->warmup > 2 ? cfg->warmup : 2, j->iters > 5 ? j->iters : 5, S)
          : -1;
  tw_bench_row r;
  memset(&r, 0, sizeof r);
  r.op = "pipeline";
  snprintf(r.shape, sizeof r.shape, "one layer E=%lld H=%lld mb=%lld f32", (long long)E, (long long)H, (long long)mb);
  r.backend = "gpu";
  snprintf(r.version, sizeof r.version, "fwd+vjp");
  r.unit = "TFLOP/s";
  r.pct_of_floor = -1;
  r.peer_ms = r.ratio = -1;
  r.flops = layer_flops;
  r.ms = layer_ms;
  r.rate = layer_ms > 0 ? layer_flops / (layer_ms * 1e9) : -1;
  tw_bench_emit(&r, cfg->csv);
  if (layer_ms <= 0) goto out;

  /* the pipeline */
  tw_comm *comms[MAX_RANKS] = {0};
  int devs[MAX_RANKS];
  for (int i = 0; i < S; i++) devs[i] = i;
  tw_status st = TW_OK;
  if (S == 1) {
    st = prank(0, NULL, j);
  } else {
    st = loopback ? tw_comm_init_loopback(S, TW_MEM_DEVICE, comms) : tw_comm_init_nccl_local(S, devs, comms);
    if (st == TW_OK) {
      for (int i = 0; i < S; i++) tw_comm_set_timeout(comms[i], 300);
      st = tw_run_ranks(S, comms, prank, j);
      char msg[1024];
      snprintf(msg, sizeof msg, "%s", tw_last_error());
      for (int i = 0; i < S; i++) tw_comm_destroy(comms[i]);
      if (st != TW_OK) tw_error(st, "%s", msg);
    }
  }
  if (st != TW_OK) {
    fprintf(stderr, "bench gpu pipeline %s: %s\n", cfgs, tw_last_error());
    goto out;
  }
  double steps[MAX_ITERS], sched[MAX_ITERS];
  for (int it = 0; it < j->iters; it++) {
    steps[it] = sched[it] = 0;
    for (int k = 0; k < S; k++) {
      steps[it] = fmax(steps[it], j->step_s[j->warm + it][k]);
      sched[it] = fmax(sched[it], j->sched_s[1 + it][k]);
    }
  }
  const double step_ms = 1e3 * tw_bench_median(steps, j->iters), sched_ms = 1e3 * tw_bench_median(sched, j->iters);
  double move_ms = 0, move3_ms = 0;
  for (int k = 0; k < S; k++) move_ms = fmax(move_ms, j->move_ms[k]);
  for (int k = 0; k < S; k++) move3_ms = fmax(move3_ms, j->move3_ms[k]);
  const double steps_per_stage = (double)M * R * Lps;
  double ideal_ms, theory_ms;
  if (loopback) {
    ideal_ms = theory_ms = S * steps_per_stage * layer_ms;
  } else {
    ideal_ms = steps_per_stage * layer_ms;
    theory_ms = ideal_ms / (1.0 - bubble);
  }
  memset(&r, 0, sizeof r);
  r.op = "pipeline";
  snprintf(r.shape, sizeof r.shape, "S=%d M=%d R=%d d=%d %s %s", S, M, R, d, pp->bsw ? "bsw" : "plain",
           loopback ? "loopback 1 GPU" : "nccl");
  r.backend = "gpu";
  snprintf(r.version, sizeof r.version, "step");
  r.unit = "TFLOP/s";
  r.pct_of_floor = -1;
  r.flops = S * steps_per_stage * layer_flops;
  r.ms = step_ms;
  r.rate = r.flops / (step_ms * 1e9);
  snprintf(r.peer, sizeof r.peer, "%s", loopback ? "ideal (sum)" : "theory");
  r.peer_ms = theory_ms;
  r.ratio = theory_ms / step_ms;
  tw_bench_emit(&r, cfg->csv);
  printf("  layer alone (CUDA events, median): fwd %.3f ms + vjp %.3f ms (recomputes x W1, gelu) = %.3f ms together, "
         "%.1f TFLOP/s (7 GEMMs of 2 mb E H)\n",
         fwd_ms, vjp_ms, layer_ms, layer_flops / (layer_ms * 1e9));
  printf("  step: forward + backward, wall, slowest rank, median of %d (after %d warm-up): %.2f ms\n", j->iters, j->warm,
         step_ms);
  if (loopback) {
    printf("  ideal on one GPU: all S stages' work, S*M*R*Lps = %d*%d*%d*%d = %.0f layer-steps x %.3f ms = %.2f ms "
           "(the bubble does not apply: an idle stage leaves the GPU to the others)\n",
           S, M, R, Lps, S * steps_per_stage, layer_ms, ideal_ms);
    printf("  measured / ideal = %.3f (the schedule, the loopback's copies and host barriers, %s)\n", step_ms / ideal_ms,
           pp->bsw ? "one window load per repeat" : "no weight gather or gradient scatter at F = 1: the shards in place");
  } else {
    printf("  ideal: M*R*Lps = %.0f layer-steps per stage x %.3f ms = %.2f ms; with the bubble %.4f: "
           "%.2f / (1 - %.4f) = %.2f ms\n",
           steps_per_stage, layer_ms, ideal_ms, bubble, ideal_ms, bubble, theory_ms);
    printf("  measured / theory = %.3f (target <= 1.05: %s)\n", step_ms / theory_ms,
           step_ms / theory_ms <= 1.05 ? "met" : "NOT met");
    if (layer_all_ms > 0)
      printf("  one layer on all %d GPUs at once (a thread each, as the stages run): %.3f ms on the slowest GPU, %.3f x "
             "alone; the theory with it %.2f ms, measured / that = %.3f\n",
             S, layer_all_ms, layer_all_ms / layer_ms, theory_ms * layer_all_ms / layer_ms,
             step_ms / (theory_ms * layer_all_ms / layer_ms));
    const int moves = 2 * (2 + (R > 1 && M > d * S)) * T; /* forward and backward: shift, state_io (+ circ) */
    if (j->move_path[0]) printf("  ppermute path: %s\n", j->move_path);
    if (move3_ms > 0)
      printf("  a forward iteration's three moves (right shift, left shift, last to first) as one ppermute_n: %.3f ms, "
             "slowest rank; x %d iterations each way = %.2f ms per step\n", move3_ms, T, move3_ms * 2 * T);
    printf("  where the rest goes: one ppermute of a microbatch block (%.1f MiB, every rank sends and receives) %.3f ms "
           "(%.1f GB/s per direction); %d block moves per step, %d iterations of %d or %d moves issued as one group each "
           "(tw_ppermute_n; TWIN_PIPE_SEPARATE_MOVES=1: one by one), one by one they would take %.2f ms\n",
           (double)act_bytes(j) / MiB, move_ms, (double)act_bytes(j) / (move_ms * 1e6), moves, 2 * T,
           2 + (R > 1 && M > d * S), 2 + (R > 1 && M > d * S), moves * move_ms);
  }
  printf("  the schedule alone (a body that computes nothing: moves, copies, %s, the scan's allocations): %.2f ms "
         "= %.3f of the %s\n",
         pp->bsw ? "window loads" : "weight gathers", sched_ms, sched_ms / theory_ms, loopback ? "ideal" : "theory");
  for (int k = 0; k < S && !loopback; k++) {
    const trace_sum *q = &j->tsum[k];
    if (!q->ok) continue;
    printf("  trace, stage %d (CUDA events around its layer calls, one more step): %d + %d calls busy %.2f + %.2f ms; "
           "gaps between consecutive calls median %.3f / %.3f ms (fwd / bwd), summed %.2f + %.2f ms; first call to "
           "last %.2f ms\n",
           k, q->calls[0], q->calls[1], q->busy_ms[0], q->busy_ms[1], q->gap_med_ms[0], q->gap_med_ms[1],
           q->gap_sum_ms[0], q->gap_sum_ms[1], q->span_ms);
    printf("    around the calls (device timeline): step start to first call %.2f ms; last forward call to the forward's "
           "return %.2f, from there to the backward's first call %.2f ms; last call to the step's end %.2f ms\n",
           q->lead_ms, q->fwd_tail_ms, q->bwd_lead_ms, q->tail_ms);
  }
  /* memory */
  int worst_ok = 1;
  const int ndev = loopback ? 1 : S;
  for (int dv = 0; dv < ndev; dv++) {
    size_t pred = 0;
    for (int s = 0; s < S; s++)
      if (loopback || s == dv) pred += tw_pipeline_peak_bytes(&c, &j->dense, 1, s);
    double meas = (double)j->base_free[dv] - (double)j->min_free[dv], ratio = meas / (double)pred;
    int ok = fabs(ratio - 1.0) <= 0.10;
    worst_ok &= ok;
    printf("  memory GPU %d (%s): peak beyond the inputs %.1f MiB measured (cudaMemGetInfo before each layer call), "
           "%.1f MiB predicted (tw_pipeline_peak_bytes%s): ratio %.3f, %s\n",
           dv, loopback ? "all ranks" : "one rank", meas / MiB, pred / MiB, loopback ? ", summed over the S ranks" : "",
           ratio, ok ? "within 10%" : "NOT within 10%");
  }
  for (int s = 0; s < S; s++) {
    if (s > 1 && s < S - 1) continue; /* stage 0, 1 and the last say it all (circ lives on stage 0) */
    size_t saved = tw_pipeline_saved_bytes(&c, &j->dense, 1), win = tw_pipeline_window_bytes(&c, &j->dense, 1);
    size_t peak = tw_pipeline_peak_bytes(&c, &j->dense, 1, s);
    printf("  rank %d: allocated beyond its inputs at the peak (its context's ledger, tw_ctx_memory) %zu bytes, "
           "predicted %zu: %s\n",
           s, j->ledger_peak[s], peak, j->ledger_peak[s] == peak ? "equal" : "DIFFERENT");
    worst_ok &= j->ledger_peak[s] == peak;
    printf("  rank %d: predicted peak %.1f MiB = saved %.1f (scan's own: %.1f) + window %.1f (%s; scan allocated %.1f) + "
           "loop state and per-call buffers %.1f MiB\n",
           s, peak / MiB, saved / MiB, j->saved_size[s] / MiB, win / MiB,
           pp->bsw ? "BSW: 2 gathered layers + 2 gradients" : "plain, F = 1: none, the layers read and add into the shards in place", j->window_size[s] / MiB,
           (peak - saved - win) / MiB);
    worst_ok &= j->saved_size[s] == saved && j->window_size[s] == win;
  }
  rc = worst_ok ? 0 : 1;
  if (!worst_ok) printf("  memory: a measurement is off its formula (above)\n");
out:
  pthread_mutex_destroy(&j->mu);
  free(j->trace);
  free(j);
  return rc;
}
