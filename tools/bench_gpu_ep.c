/* `twin bench --backend gpu --op ep`: expert-parallel dispatch and combine (tw_ep.h) over NCCL
 * on every visible GPU (a power of two, at most 8; one process, one thread per GPU), next to
 * NCCL's own all-to-all moving the same per-peer bytes, timed in the same call.
 *
 * Shapes (issue 13): H 7168, top-8, 256 experts spread over the EP ranks, tokens per rank from
 * --tokens (default 128, 4096, 16384); dispatch of bf16 rows and of fp8 e4m3 rows with 1x128
 * f32 scales (TWIN_BENCH_EP_MXFP8=1 adds e4m3 with MXFP8 E8M0 scales in rows and in the grouped
 * GEMM's layout, compact and swizzled), combine of bf16 expert outputs (weighted), and with bf16
 * the two backward ops (dispatch_bwd: bf16 rows back with their per-slot f32, the peer being
 * combine's NCCL figure; combine_bwd with d_topk_weights: the peer being bf16 dispatch's); uniform routing (8 distinct experts of
 * 256) and skewed routing (each pick from experts 0-31 with probability 1/2, else from all 256:
 * rank 0 owns the hot experts). recv_capacity = the rows this routing needs on its busiest rank,
 * rounded up to 128 (error policy: nothing drops); the no-drop bound (ep_size * T * k rows)
 * would add up to T * k rows of zeros per dispatch that every version writes alike.
 *
 * Time: each iteration starts on every rank together (a host barrier between the threads),
 * CUDA events around the call on each rank's stream; the row shows the slowest rank's median.
 * Bytes, counted as DeepEP counts them: a token row is received once per (source token,
 * destination rank) that has at least one of the token's experts, however many of them
 * (dispatch: H * dtype bytes + the fp8 scales); combine returns one row per route (the oracle
 * sums the k rows of a token in j order, so rows are not reduced on the expert side). "incl
 * local" counts the rows whose source and destination rank are the same, "excl local" only
 * the rows that cross a link; GB/s = (bytes received by all ranks / ranks) / time.
 * Peer: grouped ncclSend/ncclRecv (called directly on the group's NCCL communicator and the
 * rank's stream, its non-blocking group polled without naps) with exactly those per-pair bytes
 * (the self pair included, which NCCL copies locally); ratio = nccl_ms / ms (> 1: twin faster).
 * Below each dispatch row, a second NCCL figure: one row per route (a token row for every one
 * of its experts, what a dispatch without deduplication moves to fill tw_ep's expert-major
 * rows; ep_nccl_slots moves these, in worst-case slots). And "a2a, then expand": per rank, the
 * NCCL time for the same bytes plus a cudaMemsetAsync of the expert-major rows it receives (one
 * token row per route, no scales), the writes any expansion after an all-to-all must make,
 * timed separately (medians), summed per rank; the slowest rank's sum. A lower bound for NCCL (or DeepEP) followed
 * by a permute, the work tw_ep's dispatch and combine_bwd do in one op.
 * Floor: the one-direction NVLink copy rate (cudaMemcpyPeerAsync, 1 GiB, GPU 0 -> 1) measured
 * here; %floor = excl-local GB/s / that rate.
 * "dispatch by source" (tw_ep_dispatch_by_source): the same routing into rows by source and the
 * expert-major row map instead of expert-major rows (tw_ep.h); its peer is the same NCCL figure:
 * it moves and writes each token row once per (token, destination rank), as NCCL's all-to-all.
 * "combine_bwd by source" (tw_ep_combine_bwd_by_source): d_out into rows by source (no
 * d_expert_out rows) with the same d_topk_weights, and without them ("no dots": the bytes NCCL
 * moves and nothing else); peer: bf16 dispatch's NCCL figure. */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/comm_nccl.h"
#include "ops/bench.h"
#include "ops/data.h"
#include "tools/bench_gpu.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"

const char *gpu_ep_version_name(const tw_ep *ep); /* gpu/ep.cu */
void gpu_ep_describe(char *buf, size_t n);

enum { MAXN = 8, EXPERTS = 256, TOPK = 8 };
static const int64_t HIDDEN = 7168;

typedef struct {
  int n, skew;
  int64_t T;
  int32_t *idx[MAXN];
  float *w[MAXN];
  int64_t tok_pairs[MAXN][MAXN];   /* tokens of rank s with >= 1 expert on rank r */
  int64_t route_pairs[MAXN][MAXN]; /* routes of rank s's tokens to experts on rank r */
} routing;

static void routing_make(routing *ro, int n, int64_t T, int skew) {
  memset(ro, 0, sizeof *ro);
  ro->n = n;
  ro->T = T;
  ro->skew = skew;
  int nle = EXPERTS / n;
  for (int s = 0; s < n; s++) {
    uint64_t st = 0x65707232ull * (uint64_t)(s + 1) + (uint64_t)T * 7 + (uint64_t)skew;
    ro->idx[s] = (int32_t *)malloc((size_t)(T * TOPK) * 4 + 4);
    ro->w[s] = (float *)malloc((size_t)(T * TOPK) * 4 + 4);
    for (int64_t t = 0; t < T; t++) {
      int mask = 0;
      for (int j = 0; j < TOPK; j++) {
        int e, dup;
        do {
          uint64_t r = tw_splitmix64(&st);
          e = skew && (r & 1) ? (int)((r >> 1) % 32) : (int)((r >> 1) % EXPERTS);
          dup = 0;
          for (int i = 0; i < j; i++) dup |= ro->idx[s][t * TOPK + i] == e;
        } while (dup);
        ro->idx[s][t * TOPK + j] = e;
        ro->w[s][t * TOPK + j] = (float)((tw_splitmix64(&st) >> 40) % 1000) / 1000.0f;
        ro->route_pairs[s][e / nle]++;
        mask |= 1 << (e / nle);
      }
      for (int r = 0; r < n; r++) ro->tok_pairs[s][r] += (mask >> r) & 1;
    }
  }
}

static void routing_free(routing *ro) {
  for (int s = 0; s < ro->n; s++) {
    free(ro->idx[s]);
    free(ro->w[s]);
  }
}

/* One case (version x dtype) on every rank; the threads share it. */
typedef struct {
  const routing *ro;
  const char *version; /* forced kernel name */
  tw_dtype dt;         /* TW_BF16 or TW_E4M3 */
  int mx;              /* e4m3 only: 0 1x128 f32 scales; MXFP8 E8M0 scales: 1 rows, 2 GEMM layout compact, 3 swizzled */
  int combine, peers;  /* also time combine / the NCCL peers */
  int warmup, iters;
  pthread_barrier_t bar;
  volatile int failed;
  double ms[11][MAXN]; /* dispatch, combine, nccl: dispatch's token rows, combine's rows, one row per route;
                        * dispatch_bwd, combine_bwd; a memset of the expert-major rows this rank receives;
                        * dispatch by source, combine_bwd by source with and without d_topk_weights */
  char used[MAXN][32];
  char err[MAXN][320];
} bcase;

enum { T_DISPATCH, T_COMBINE, T_PEER_D, T_PEER_C, T_PEER_DR, T_DISPATCH_BWD, T_COMBINE_BWD, T_FILL, T_DISPATCH_SRC,
       T_COMBINE_BWD_SRC, T_COMBINE_BWD_SRC_ND };

static size_t row_bytes(tw_dtype dt, int mx) {
  return dt == TW_BF16 ? (size_t)HIDDEN * 2 : mx ? (size_t)HIDDEN + (size_t)(HIDDEN / 32) : (size_t)HIDDEN + (size_t)(HIDDEN / 128) * 4;
}

/* random bytes through a host chunk (bf16 in +-[2^-8, 1), fp8 codes without NaN, f32 scales) */
static int fill(void *d, size_t bytes, int kind, uint64_t seed) {
  enum { CH = 1 << 22 };
  static _Thread_local unsigned char *host;
  if (!host && !(host = (unsigned char *)malloc(CH))) return -1;
  uint64_t st = seed;
  for (size_t i = 0; i < CH / 4; i++) {
    uint64_t r = tw_splitmix64(&st);
    uint32_t v;
    if (kind == 0) { /* two bf16 */
      uint16_t a = (uint16_t)(((r & 1) << 15) | ((119 + (r >> 1) % 8) << 7) | ((r >> 8) & 0x7F));
      uint16_t b = (uint16_t)((((r >> 16) & 1) << 15) | ((119 + (r >> 17) % 8) << 7) | ((r >> 24) & 0x7F));
      v = (uint32_t)a | ((uint32_t)b << 16);
    } else if (kind == 1) {
      v = (uint32_t)r & 0x7e7e7e7eu;
    } else {
      float f = 0.5f + (float)((r >> 40) % 1000) / 1000.0f;
      memcpy(&v, &f, 4);
    }
    memcpy(host + 4 * i, &v, 4);
  }
  for (size_t off = 0; off < bytes; off += CH) {
    size_t k = bytes - off < CH ? bytes - off : CH;
    if (cudaMemcpy((unsigned char *)d + off, host, k, cudaMemcpyHostToDevice) != cudaSuccess) return -1;
  }
  return 0;
}

static double median(double *v, int n) { return tw_bench_median(v, n); }

/* All ranks agree whether the case goes on (a failure anywhere stops every rank together). */
static int together(bcase *c) {
  pthread_barrier_wait(&c->bar);
  int f = c->failed;
  pthread_barrier_wait(&c->bar);
  return !f;
}

static void fail(bcase *c, int r, const char *what) {
  if (!c->err[r][0]) snprintf(c->err[r], sizeof c->err[r], "%s (at %s)", tw_last_error(), what);
  c->failed = 1;
}

typedef struct {
  tw_ctx *ctx;
  tw_ep_layer *layer;
  tw_comm *comm;
  tw_tensor tok, scl, idx, w, recv, rscl, rw, gs, y, out, dtw;
  tw_tensor src, sscl, row; /* rows by source */
  tw_ep_layer *layer_src;
  void *sbuf, *rbuf;
  int64_t sc[MAXN], sd[MAXN], rc[MAXN], rd[MAXN];
  size_t fill_bytes; /* do_fill: bytes of recv written */
  cudaStream_t stream;
} rank_job;

static tw_status do_dispatch(rank_job *j) {
  tw_tensor none = tw_tensor_none();
  return tw_ep_dispatch(j->ctx, j->layer, &j->tok, &j->scl, &j->idx, &j->w, &j->recv, &j->rscl, &j->rw, &j->gs, &none);
}
static tw_status do_dispatch_by_source(rank_job *j) {
  tw_tensor none = tw_tensor_none();
  return tw_ep_dispatch_by_source(j->ctx, j->layer_src, &j->tok, &j->scl, &j->idx, &j->w, &j->src, &j->sscl, &j->row,
                                  &j->rw, &j->gs, &none);
}
static tw_status do_combine(rank_job *j) { return tw_ep_combine(j->ctx, j->layer, &j->y, &j->w, &j->out); }
/* the backward ops, bf16 rows: d_recv = y (its rows travel back like combine's), d_tokens into
 * out; d_out = out (token rows travel out like dispatch's), d_expert_out into recv */
static tw_status do_dispatch_bwd(rank_job *j) {
  return tw_ep_dispatch_bwd(j->ctx, j->layer, &j->y, &j->rw, &j->out, &j->dtw);
}
static tw_status do_combine_bwd(rank_job *j) {
  return tw_ep_combine_bwd(j->ctx, j->layer, &j->out, &j->w, &j->y, &j->recv, &j->dtw);
}
/* d_src into src (bf16 rows: combine runs with bf16 tokens only) */
static tw_status do_combine_bwd_by_source(rank_job *j) {
  return tw_ep_combine_bwd_by_source(j->ctx, j->layer, &j->out, &j->y, &j->src, &j->dtw);
}
/* the same without the dots (the way in alone, as DeepEP's combine backward moves it) */
static tw_status do_combine_bwd_by_source_no_dots(rank_job *j) {
  tw_tensor none = tw_tensor_none();
  return tw_ep_combine_bwd_by_source(j->ctx, j->layer, &j->out, &none, &j->src, &none);
}
/* The peer calls NCCL itself (grouped ncclSend/ncclRecv on the same communicator and stream)
 * and polls a non-blocking group without sleeping: tw_comm's all_to_allv naps 100 us per poll,
 * which would charge the peer (and ep_nccl_slots, which goes through it) host latency. */
static tw_status do_a2a(rank_job *j) {
  ncclComm_t nc = gpu_nccl_comm(j->comm, NULL);
  if (!nc) return tw_error(TW_ERR_UNSUPPORTED, "bench ep: the NCCL peer needs an NCCL communicator");
  ncclResult_t r = ncclGroupStart();
  for (int q = 0; q < j->comm->size && (r == ncclSuccess || r == ncclInProgress); q++) {
    if (j->sc[q]) r = ncclSend((const char *)j->sbuf + j->sd[q], (size_t)j->sc[q], ncclUint8, q, nc, j->stream);
    if ((r == ncclSuccess || r == ncclInProgress) && j->rc[q])
      r = ncclRecv((char *)j->rbuf + j->rd[q], (size_t)j->rc[q], ncclUint8, q, nc, j->stream);
  }
  ncclResult_t e = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = e;
  while (r == ncclInProgress) {
    ncclResult_t st = ncclInProgress;
    if (ncclCommGetAsyncError(nc, &st) != ncclSuccess) break;
    r = st;
  }
  return r == ncclSuccess ? TW_OK : tw_error(TW_ERR_NCCL, "bench ep: nccl send/recv: %s", ncclGetErrorString(r));
}

/* The writes any permute into the expert-major rows must make (one row per route received,
 * without scales): a memset of that many bytes, the HBM write floor of "a2a, then expand". */
static tw_status do_fill(rank_job *j) {
  return cudaMemsetAsync(j->recv.data, 0, j->fill_bytes, j->stream) == cudaSuccess
             ? TW_OK
             : tw_error(TW_ERR_DEVICE, "bench ep: cudaMemsetAsync of %zu bytes", j->fill_bytes);
}

/* Median ms of `iters` calls, every iteration started on all ranks together. */
static double time_op(bcase *c, int r, cudaStream_t s, rank_job *j, tw_status (*fn)(rank_job *), const char *what) {
  double v[64];
  int iters = c->iters < 64 ? c->iters : 64, got = 0;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < c->warmup + iters; i++) {
    if (!together(c)) break;
    cudaEventRecord(a, s);
    if (fn(j) != TW_OK) {
      fail(c, r, what);
      continue;
    }
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (i >= c->warmup) v[got++] = ms;
  }
  if (!c->failed && tw_ctx_check(j->ctx) != TW_OK) fail(c, r, what);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return got == iters && !c->failed ? median(v, got) : -1;
}

static tw_status rank_fn(int r, tw_comm *comm, void *arg) {
  bcase *c = (bcase *)arg;
  const routing *ro = c->ro;
  const int n = ro->n, nle = EXPERTS / n;
  const int64_t T = ro->T, H = HIDDEN;
  for (int q = 0; q < 9; q++) c->ms[q][r] = -1;
  cudaSetDevice(r);
  cudaStream_t stream = NULL;
  rank_job j;
  memset(&j, 0, sizeof j);
  j.comm = comm;
  tw_ep *ep = NULL;
  void *bufs[16];
  int nb = 0;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    snprintf(c->err[r], sizeof c->err[r], "no CUDA stream on GPU %d", r);
    c->failed = 1;
  }
  j.stream = stream;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.device = r;
  cc.stream = stream;
  cc.comm = comm;
  cc.kernel = c->version;
  if (!c->failed && tw_ctx_create(&j.ctx, &cc) != TW_OK) fail(c, r, "ctx_create");
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = EXPERTS; cfg.topk = TOPK; cfg.max_tokens = T; cfg.hidden = H; cfg.token_dtype = c->dt;
  cfg.scale_block = c->dt == TW_BF16 ? 0 : c->mx ? 32 : 128;
  cfg.scales_gemm_layout = c->mx >= 2;
  cfg.scales_mxfp8_swizzled = c->mx == 3;
  int64_t need = 0;
  for (int q = 0; q < n; q++) {
    int64_t rows = 0;
    for (int s = 0; s < n; s++) rows += ro->route_pairs[s][q];
    if (rows > need) need = rows;
  }
  cfg.recv_capacity = (need + 127) / 128 * 128;
  if (cfg.recv_capacity == 0) cfg.recv_capacity = 128;
  if (together(c) && tw_ep_create(j.ctx, comm, &cfg, &ep) != TW_OK) fail(c, r, "ep_create");
  if (together(c) && tw_ep_layer_create(ep, &j.layer) != TW_OK) fail(c, r, "ep_layer_create");
  if (together(c) && tw_ep_layer_create(ep, &j.layer_src) != TW_OK) fail(c, r, "ep_layer_create");
  if (ep) snprintf(c->used[r], sizeof c->used[r], "%s", gpu_ep_version_name(ep));
  int64_t R = ep ? tw_ep_recv_capacity(ep) : 0;
  tw_mem D = TW_MEM_DEVICE;
  int ok = together(c);
#define A(bytes) (ok && tw_alloc(j.ctx, (bytes), &bufs[nb]) == TW_OK ? bufs[nb++] : (ok = 0, (void *)NULL))
  size_t tb = c->dt == TW_BF16 ? (size_t)H * 2 : (size_t)H;
  j.tok = tw_tensor_2d(A(tb * (size_t)T + 16), c->dt, T, H, D);
  const int64_t sc = c->mx ? H / 32 : H / 128; /* scale columns of a token */
  const size_t sbytes = c->mx ? (size_t)(T * sc) : (size_t)(T * sc) * 4;
  j.scl = c->dt == TW_BF16 ? tw_tensor_none() : tw_tensor_2d(A(sbytes + 16), c->mx ? TW_E8M0 : TW_F32, T, sc, D);
  j.idx = tw_tensor_2d(A((size_t)(T * TOPK) * 4 + 16), TW_I32, T, TOPK, D);
  j.w = tw_tensor_2d(A((size_t)(T * TOPK) * 4 + 16), TW_F32, T, TOPK, D);
  j.recv = tw_tensor_2d(A(tb * (size_t)R + 16), c->dt, R, H, D);
  int64_t rsh[2] = {R, sc};
  tw_dtype rsd = TW_F32;
  if (c->dt != TW_BF16 && ep && tw_ep_recv_scales_shape(&cfg, n, rsh, &rsd) != TW_OK) fail(c, r, "recv_scales_shape");
  j.rscl = c->dt == TW_BF16 ? tw_tensor_none()
                            : tw_tensor_2d(A(tw_dtype_storage_bytes(rsd, rsh[0] * rsh[1]) + 16), rsd, rsh[0], rsh[1], D);
  j.rw = tw_tensor_1d(A((size_t)R * 4 + 16), TW_F32, R, D);
  const int64_t U = (int64_t)n * T; /* rows by source */
  j.src = tw_tensor_2d(A(tb * (size_t)U + 16), c->dt, U, H, D);
  j.row = tw_tensor_1d(A((size_t)R * 4 + 16), TW_I32, R, D);
  int64_t ssh[2] = {U, sc};
  if (c->dt != TW_BF16 && ep && tw_ep_source_scales_shape(&cfg, n, ssh, &rsd) != TW_OK) fail(c, r, "source_scales_shape");
  j.sscl = c->dt == TW_BF16 ? tw_tensor_none()
                            : tw_tensor_2d(A(tw_dtype_storage_bytes(rsd, ssh[0] * ssh[1]) + 16), rsd, ssh[0], ssh[1], D);
  j.gs = tw_tensor_1d(A((size_t)nle * 4 + 16), TW_I32, nle, D);
  if (c->combine) {
    j.y = tw_tensor_2d(A((size_t)(R * H) * 2 + 16), TW_BF16, R, H, D);
    j.out = tw_tensor_2d(A((size_t)(T * H) * 2 + 16), TW_BF16, T, H, D);
    j.dtw = tw_tensor_2d(A((size_t)(T * TOPK) * 4 + 16), TW_F32, T, TOPK, D);
  }
#undef A
  if (ok) {
    ok = !fill(j.tok.data, tb * (size_t)T, c->dt == TW_BF16 ? 0 : 1, 11 + (uint64_t)r) &&
         (c->dt == TW_BF16 || !fill(j.scl.data, sbytes, c->mx ? 1 : 2, 12 + (uint64_t)r)) &&
         cudaMemcpy(j.idx.data, ro->idx[r], (size_t)(T * TOPK) * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(j.w.data, ro->w[r], (size_t)(T * TOPK) * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         (!c->combine || !fill(j.y.data, (size_t)(R * H) * 2, 0, 13 + (uint64_t)r));
    if (!ok) fail(c, r, "allocate / fill the inputs");
  } else if (!c->failed) {
    fail(c, r, "allocate the inputs");
  }
  if (together(c)) c->ms[T_DISPATCH][r] = time_op(c, r, stream, &j, do_dispatch, "dispatch");
  if (together(c)) c->ms[T_DISPATCH_SRC][r] = time_op(c, r, stream, &j, do_dispatch_by_source, "dispatch by source");
  if (c->combine && together(c)) c->ms[T_COMBINE][r] = time_op(c, r, stream, &j, do_combine, "combine");
  if (c->combine && together(c))
    c->ms[T_DISPATCH_BWD][r] = time_op(c, r, stream, &j, do_dispatch_bwd, "dispatch_bwd");
  if (c->combine && together(c)) c->ms[T_COMBINE_BWD][r] = time_op(c, r, stream, &j, do_combine_bwd, "combine_bwd");
  if (c->combine && together(c))
    c->ms[T_COMBINE_BWD_SRC][r] = time_op(c, r, stream, &j, do_combine_bwd_by_source, "combine_bwd by source");
  if (c->combine && together(c))
    c->ms[T_COMBINE_BWD_SRC_ND][r] =
        time_op(c, r, stream, &j, do_combine_bwd_by_source_no_dots, "combine_bwd by source, no dots");
  /* the expansion's write floor: dispatch's rows in its dtype (bf16: combine_bwd's d_expert_out too) */
  if (c->peers && n > 1) {
    int64_t routes_in = 0;
    for (int s = 0; s < n; s++) routes_in += ro->route_pairs[s][r];
    j.fill_bytes = tb * (size_t)routes_in;
    if (j.fill_bytes > tb * (size_t)R) j.fill_bytes = tb * (size_t)R;
    if (together(c)) c->ms[T_FILL][r] = time_op(c, r, stream, &j, do_fill, "memset");
  }
  /* the peers: the same per-pair bytes through grouped ncclSend/ncclRecv */
  for (int p = 0; p < 3 && c->peers && n > 1; p++) {
    if (p == 1 && !c->combine) continue;
    size_t rb = p != 1 ? row_bytes(c->dt, c->mx) : (size_t)H * 2;
    int64_t so = 0, ro_ = 0;
    for (int q = 0; q < n; q++) {
      /* dispatch: my token rows to rank q; combine: the rows of q's routes on my experts back to q */
      /* p 2: one row per route (what a dispatch without dedup moves to fill the expert-major rows) */
      j.sc[q] = (int64_t)rb * (p == 0 ? ro->tok_pairs[r][q] : p == 1 ? ro->route_pairs[q][r] : ro->route_pairs[r][q]);
      j.rc[q] = (int64_t)rb * (p == 0 ? ro->tok_pairs[q][r] : p == 1 ? ro->route_pairs[r][q] : ro->route_pairs[q][r]);
      j.sd[q] = so;
      j.rd[q] = ro_;
      so += j.sc[q];
      ro_ += j.rc[q];
    }
    void *sb = NULL, *rbuf = NULL;
    int aok = tw_alloc(j.ctx, (size_t)so + 16, &sb) == TW_OK && tw_alloc(j.ctx, (size_t)ro_ + 16, &rbuf) == TW_OK;
    if (!aok) fail(c, r, "allocate the NCCL peer's buffers");
    else if (fill(sb, (size_t)so, 0, 14)) fail(c, r, "fill the NCCL peer's buffer");
    j.sbuf = sb;
    j.rbuf = rbuf;
    if (together(c)) c->ms[p == 0 ? T_PEER_D : p == 1 ? T_PEER_C : T_PEER_DR][r] = time_op(c, r, stream, &j, do_a2a, "nccl all_to_allv");
    tw_ctx_sync(j.ctx);
    if (sb) tw_free(j.ctx, sb);
    if (rbuf) tw_free(j.ctx, rbuf);
  }
  if (j.ctx) tw_ctx_sync(j.ctx);
  for (int i = 0; i < nb; i++) tw_free(j.ctx, bufs[i]);
  tw_ep_layer_destroy(j.layer);
  tw_ep_layer_destroy(j.layer_src);
  tw_ep_destroy(ep);
  tw_ctx_destroy(j.ctx);
  if (stream) cudaStreamDestroy(stream);
  return TW_OK; /* failures are in c->err: every rank stopped together, the group stays usable */
}

static double slowest(const double *v, int n) {
  double m = 0;
  for (int r = 0; r < n; r++) {
    if (v[r] < 0) return -1;
    if (v[r] > m) m = v[r];
  }
  return m;
}

/* One direction of NVLink: GPU 0 -> 1, 1 GiB, median GB/s (or -1). */
static double nvlink_copy_gbs(int warmup, int iters) {
  size_t bytes = (size_t)1 << 30;
  void *a = NULL, *b = NULL;
  cudaStream_t s = NULL;
  double gbs = -1;
  cudaSetDevice(1);
  if (cudaDeviceEnablePeerAccess(0, 0) != cudaSuccess) cudaGetLastError();
  if (cudaMalloc(&b, bytes) != cudaSuccess) b = NULL;
  cudaSetDevice(0);
  if (cudaDeviceEnablePeerAccess(1, 0) != cudaSuccess) cudaGetLastError();
  if (cudaMalloc(&a, bytes) != cudaSuccess) a = NULL;
  if (a && b && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess) {
    double v[32];
    int it = iters < 32 ? iters : 32;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < warmup + it; i++) {
      cudaEventRecord(e0, s);
      cudaMemcpyPeerAsync(b, 1, a, 0, bytes, s);
      cudaEventRecord(e1, s);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (i >= warmup) v[i - warmup] = ms;
    }
    double ms = median(v, it);
    if (cudaGetLastError() == cudaSuccess && ms > 0) gbs = (double)bytes / (ms * 1e6);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(s);
  }
  cudaGetLastError();
  if (a) cudaFree(a);
  cudaSetDevice(1);
  if (b) cudaFree(b);
  cudaSetDevice(0);
  return gbs;
}

/* rows received, all ranks together: incl / excl the rows that stay on their rank */
static void recv_bytes(const routing *ro, int combine, size_t rb, double *incl, double *excl) {
  *incl = *excl = 0;
  for (int s = 0; s < ro->n; s++)
    for (int r = 0; r < ro->n; r++) {
      double b = (double)rb * (double)(combine ? ro->route_pairs[s][r] : ro->tok_pairs[s][r]);
      *incl += b;
      if (s != r) *excl += b;
    }
}

static void emit(const tw_bench_cfg *cfg, const routing *ro, const char *what, const char *dtname, const char *ver,
                 double ms, double peer_ms, double incl, double excl, double nvl, double peer_routes_ms, double routes_bytes,
                 double peer_fill_ms) {
  int n = ro->n;
  tw_bench_row row;
  memset(&row, 0, sizeof row);
  row.op = "ep";
  snprintf(row.shape, sizeof row.shape, "T=%lld ep=%d %s %s %s", (long long)ro->T, n, ro->skew ? "skew" : "unif",
           dtname, what);
  row.backend = "gpu";
  snprintf(row.version, sizeof row.version, "%s", ver);
  row.ms = ms;
  row.unit = "GB/s";
  row.rate = ms > 0 ? incl / n / (ms * 1e6) : -1;
  row.pct_of_floor = ms > 0 && nvl > 0 && n > 1 ? 100.0 * excl / n / (ms * 1e6) / nvl : -1;
  snprintf(row.peer, sizeof row.peer, "%s", n > 1 ? "nccl a2a" : "");
  row.peer_ms = peer_ms;
  row.ratio = ms > 0 && peer_ms > 0 ? peer_ms / ms : -1;
  row.bytes = incl / n;
  tw_bench_emit(&row, cfg->csv);
  if (ms > 0 && peer_ms <= 0)
    printf("    %s %s: per rank %.2f MB in (%.2f MB over links), %.1f GB/s incl local; no NCCL peer here\n", ver, what,
           incl / n / 1e6, excl / n / 1e6, incl / n / (ms * 1e6));
  else if (ms > 0)
    printf("    %s %s: per rank %.2f MB in (%.2f MB over links), %.1f GB/s incl local, %.1f GB/s excl local; "
           "nccl same bytes %.3f ms (%.1f / %.1f GB/s); nccl_ms/ms %.2f\n",
           ver, what, incl / n / 1e6, excl / n / 1e6, incl / n / (ms * 1e6), excl / n / (ms * 1e6), peer_ms,
           peer_ms > 0 ? incl / n / (peer_ms * 1e6) : -1, peer_ms > 0 ? excl / n / (peer_ms * 1e6) : -1,
           peer_ms > 0 ? peer_ms / ms : -1);
  if (ms > 0 && peer_routes_ms > 0)
    printf("    %s %s: nccl moving one row per route instead (%.2f MB per rank) %.3f ms; nccl_ms/ms %.2f\n", ver, what,
           routes_bytes / n / 1e6, peer_routes_ms, peer_routes_ms / ms);
  if (ms > 0 && peer_fill_ms > 0)
    printf("    %s %s: nccl same bytes, then a memset of the expert-major rows on the same rank (the writes any "
           "expansion makes; slowest rank) %.3f ms; that/ms %.2f\n",
           ver, what, peer_fill_ms, peer_fill_ms / ms);
}

/* the slowest rank's a + b (two steps one rank would run in turn), -1 if any is missing */
static double slowest_sum(const double *a, const double *b, int n) {
  double m = -1;
  for (int r = 0; r < n; r++) {
    if (a[r] < 0 || b[r] < 0) return -1;
    if (a[r] + b[r] > m) m = a[r] + b[r];
  }
  return m;
}

int tw_bench_gpu_ep(const tw_bench_cfg *cfg) {
  if (!cfg->op || strcmp(cfg->op, "ep")) return 0; /* several GPUs and tens of GB: only when asked by name */
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  tw_bench_ep dflt;
  memset(&dflt, 0, sizeof dflt);
  const tw_bench_ep *o = cfg->ep ? cfg->ep : &dflt;
  static const long long deftok[3] = {128, 4096, 16384};
  int ntok = o->ntokens ? o->ntokens : 3;
  const long long *toks = o->ntokens ? o->tokens : deftok;
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
    fprintf(stderr, "bench gpu ep: no GPU visible\n");
    return 1;
  }
  int n = 1;
  while (n * 2 <= gpus && n * 2 <= MAXN) n *= 2;
  int devs[MAXN];
  for (int r = 0; r < n; r++) devs[r] = r;
  tw_comm *comms[MAXN];
  if (tw_comm_init_nccl_local(n, devs, comms) != TW_OK) {
    fprintf(stderr, "bench gpu ep: %s\n", tw_last_error());
    return 1;
  }
  char why[400];
  gpu_ep_describe(why, sizeof why);
  printf("  ep: %d GPU%s (ep_size %d), H %lld, top-%d, %d experts; auto version: %s\n", n, n > 1 ? "s" : "", n,
         (long long)HIDDEN, TOPK, EXPERTS, why);
  double nvl = -1;
  if (n >= 2) {
    nvl = nvlink_copy_gbs(2, 5);
    printf("  NVLink one direction (cudaMemcpyPeerAsync 1 GiB, GPU 0 -> 1): %.1f GB/s\n", nvl);
  } else {
    printf("  peer: NCCL all-to-all and the NVLink copy need 2 GPUs, sees %d (ep_size 1: dispatch is local)\n", gpus);
  }
  const char *versions[2] = {"ep_nccl_slots", "ep_nccl_lsa"};
  int nv = 2, failed = 0;
  for (int ti = 0; ti < ntok; ti++)
    for (int skew = 0; skew < 2; skew++) {
      if ((o->routing == 1 && skew) || (o->routing == 2 && !skew)) continue;
      routing ro;
      routing_make(&ro, n, toks[ti], skew);
      /* TWIN_BENCH_EP_MXFP8=1 adds e4m3 with MXFP8 scales: in rows, and in the grouped GEMM's
       * layout compact / swizzled (tw_ep.h scales_gemm_layout) */
      const char *mxe = getenv("TWIN_BENCH_EP_MXFP8");
      int ndt = mxe && atoi(mxe) ? 5 : 2;
      for (int di = 0; di < ndt; di++) {
        tw_dtype dt = di == 0 ? TW_BF16 : TW_E4M3;
        static const char *names[5] = {"bf16", "e4m3", "e4m3 mx rows", "e4m3 mx gemm", "e4m3 mx gemm swz"};
        const char *dtname = names[di];
        const int mx = di >= 2 ? di - 1 : 0;
        double peer_d = -1, peer_c = -1, peer_dr = -1, peer_df = -1;
        for (int vi = 0; vi < nv; vi++) {
          if (o->version && strcmp(o->version, versions[vi])) continue;
          bcase *c = (bcase *)calloc(1, sizeof *c);
          c->ro = &ro;
          c->version = versions[vi];
          c->dt = dt;
          c->mx = mx;
          c->combine = di == 0;
          c->peers = peer_d < 0 && n > 1;
          c->warmup = cfg->warmup > 1 ? cfg->warmup : 1;
          c->iters = cfg->iters > 3 ? cfg->iters : 3;
          pthread_barrier_init(&c->bar, NULL, (unsigned)n);
          tw_run_ranks(n, comms, rank_fn, c);
          pthread_barrier_destroy(&c->bar);
          if (c->failed) {
            for (int r = 0; r < n; r++)
              if (c->err[r][0]) {
                printf("  ep T=%lld %s %s %s: rank %d: %s\n", (long long)ro.T, skew ? "skew" : "unif", dtname,
                       versions[vi], r, c->err[r]);
                break;
              }
            /* a forced version that cannot run here is a fact, not a failure */
            failed |= !strstr(c->err[0], "cannot run here");
            free(c);
            /* a failed step aborts the communicators (the abort path): new ones for the next rows */
            for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
            if (tw_comm_init_nccl_local(n, devs, comms) != TW_OK) {
              fprintf(stderr, "bench gpu ep: new communicators after a failure: %s\n", tw_last_error());
              return 1;
            }
            continue;
          }
          if (c->peers) {
            peer_d = slowest(c->ms[T_PEER_D], n);
            peer_c = slowest(c->ms[T_PEER_C], n);
          }
          if (c->peers) {
            peer_dr = slowest(c->ms[T_PEER_DR], n);
            peer_df = slowest_sum(c->ms[T_PEER_D], c->ms[T_FILL], n);
          }
          double incl, excl, rincl, rexcl;
          recv_bytes(&ro, 0, row_bytes(dt, mx), &incl, &excl);
          recv_bytes(&ro, 1, row_bytes(dt, mx), &rincl, &rexcl);
          emit(cfg, &ro, "dispatch", dtname, c->used[0], slowest(c->ms[T_DISPATCH], n), peer_d, incl, excl, nvl,
               peer_dr, rincl, peer_df);
          /* rows by source: the same bytes on the wire, each token row written once per rank */
          emit(cfg, &ro, "dispatch by source", dtname, c->used[0], slowest(c->ms[T_DISPATCH_SRC], n), peer_d, incl,
               excl, nvl, -1, 0, -1);
          if (c->combine) {
            recv_bytes(&ro, 1, (size_t)HIDDEN * 2, &incl, &excl);
            emit(cfg, &ro, "combine", "bf16", c->used[0], slowest(c->ms[T_COMBINE], n), peer_c, incl, excl, nvl, -1,
                 0, -1);
            /* dispatch_bwd moves combine's bytes (a row per route back), combine_bwd dispatch's
             * bf16 token rows (d_out once per token and rank) */
            emit(cfg, &ro, "dispatch_bwd", "bf16", c->used[0], slowest(c->ms[T_DISPATCH_BWD], n), peer_c, incl, excl,
                 nvl, -1, 0, -1);
            recv_bytes(&ro, 0, (size_t)HIDDEN * 2, &incl, &excl);
            /* combine_bwd's d_expert_out rows are bf16 dispatch's rows: the same floor */
            emit(cfg, &ro, "combine_bwd", "bf16", c->used[0], slowest(c->ms[T_COMBINE_BWD], n), peer_d, incl, excl,
                 nvl, -1, 0, peer_df);
            /* by source: the same bytes on the wire, d_out written once per (token, rank), no d_expert_out */
            emit(cfg, &ro, "combine_bwd by source", "bf16", c->used[0], slowest(c->ms[T_COMBINE_BWD_SRC], n), peer_d,
                 incl, excl, nvl, -1, 0, -1);
            emit(cfg, &ro, "combine_bwd by source, no dots", "bf16", c->used[0],
                 slowest(c->ms[T_COMBINE_BWD_SRC_ND], n), peer_d, incl, excl, nvl, -1, 0, -1);
          }
          fflush(stdout);
          free(c);
        }
      }
      routing_free(&ro);
    }
  for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
  return failed;
}
