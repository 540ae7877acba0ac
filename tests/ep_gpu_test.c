/* EP dispatch / combine on the gpu backend (gpu/ep.cu, version ep_nccl_slots) against the
 * oracle (ref/ep.c), bit for bit:
 *   1 GPU   every stored EP golden with ep_size 1 through the runner `twin check` uses (NCCL
 *           communicator of one rank: the exchange is NCCL send/recv to self), the others
 *           skipped with "needs N GPUs, sees n"; 600 seeded random cases with ep_size 1 (E 1..64,
 *           k 1..8, T 0..max_tokens, H 1..300 and awkward, f32 / bf16 / e4m3 with 1x128 or MXFP8
 *           scales / e5m2, alignment 1..16, no-drop capacity, drop policy with small R, error
 *           policy overflow) comparing dispatch (rows, scales, weights, group sizes, dropped),
 *           combine weighted and unweighted, dispatch_bwd and combine_bwd from poisoned outputs;
 *           device-side errors (id out of range, id twice, capacity overflow: error word, no
 *           write, the next step works); dispatch -> combine captured in one CUDA graph and
 *           replayed with new routing written into the same buffers, each replay vs the oracle.
 *   1 GPU, several ranks: ep_size 2 and 4 as threads on GPU 0 over the loopback communicator
 *           (160 random cases, error-policy overflow included) against the ref threads; with
 *           ep_nccl_lsa forced, the same and 4 x 40 cases with combine's and dispatch_bwd's way
 *           back forced into 2, 3 and 8 chunks (lsa_back), and a graph of all four ops and
 *           combine_bwd by source replayed (also with 3 chunks both ways);
 *           combine_bwd with this rank's own rows formed in the push kernel (forced: the
 *           default forms them in the rows kernel at these sizes);
 *   scales_gemm_layout = 1 (fp8 1x128, recv_scales [H/128, roundup(R, 4)]): 120 + 60 (LSA forced)
 *           random cases with ep_size 1 and 60 + 60 loopback cases of 2 / 4 ranks (auto, LSA);
 *   the same with MXFP8 (per-slab blocks [128 * T_cap, roundup(H/32, 4)], compact and swizzled):
 *           60 + 60 (auto) + 60 (LSA forced) with ep_size 1, 60 + 60 loopback of 2 / 4 ranks
 *           (EP_MX_N each), and dispatch captured in a CUDA graph with 3 replays of new routing;
 *   2 GPUs  the same random comparison with ep_size 2 over NCCL (one thread per GPU) against
 *           the ref thread communicator of 2 ranks, with token conservation checked; skipped
 *           with "needs 2 GPUs, sees n" where fewer are visible (LSA also with the way back in 3
 *           chunks); 4 and 8 GPUs: the same with ep_size 4, 8 (4: rows by source on ep_nccl_lsa too).
 *   one process per GPU (ep_gpu_proc): the test launches one process per visible GPU (up to 8),
 *           as `mpirun -np N` would, each one rank over tw_comm_init_nccl_rank (the NCCL id
 *           handed out through a file), 100 cases per EP version against the ref threads, its
 *           own rank checked; on one GPU that is one process of world size 1. */
#include <criterion/criterion.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "golden/runner.h"
#include "pipeline/loopback_comm.h"
#include "tests/proc_util.h"
#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"

#define NEED_GPUS(n) TT_NEED_GPUS(n)

#define MAXR 8

/* ---- a random scenario for n ranks --------------------------------------------------------- */
typedef struct {
  int n, E, k, A, scale_block;
  int gemm; /* cfg.scales_gemm_layout: 1x128 recv_scales [H/128, roundup(R, 4)]; MXFP8 per-slab blocks */
  int mxsw; /* cfg.scales_mxfp8_swizzled (MXFP8 with gemm) */
  int64_t H, maxT, R, T[MAXR];
  tw_dtype dt, ydt;
  tw_ep_overflow policy;
  unsigned char *tok[MAXR], *scl[MAXR];
  int32_t *idx[MAXR];
  float *w[MAXR], *rdw[MAXR];
  unsigned char *y[MAXR], *dy[MAXR], *dout[MAXR];
} scen;

typedef struct { /* every output of one rank */
  unsigned char *recv, *rscl, *out, *outu, *dtok, *dexp, *dsrc; /* dsrc: combine_bwd by source (by_source runs) */
  float *rw, *dtw, *dtwc, *dtws;
  int32_t *gs, *dr, *row;
  tw_status st; /* of dispatch (error cases) */
  char msg[240]; /* the rank's last error message (several ranks) */
} outs;

static size_t tokb(const scen *c) { return tw_dtype_storage_bytes(c->dt, c->H); }
static int64_t scols(const scen *c) { return c->scale_block ? c->H / c->scale_block : 0; }
static tw_dtype sdt(const scen *c) { return c->scale_block == 32 ? TW_E8M0 : TW_F32; }
static size_t sclb(const scen *c) { return c->scale_block ? tw_dtype_storage_bytes(sdt(c), scols(c)) : 0; }
static size_t yb(const scen *c) { return tw_dtype_storage_bytes(c->ydt, c->H); }
/* by_source: dispatch is tw_ep_dispatch_by_source (rows by source, tw_ep.h): recv holds src_tokens
 * [U = n * max_tokens, H], rscl src_scales (its layouts for M = U, G = 1), row recv_row [R]. */
static int by_source;
static int64_t rrows(const scen *c) { return by_source ? c->n * c->maxT : c->R; } /* rows of recv */
/* combine_bwd by source with its dots (expert_out given) in two of three scenarios, the way in
 * alone in the third (d_topk_weights none: on ep_nccl_lsa one chunk fewer barriers) */
static int src_dots_force = -1; /* 0 / 1: every scenario (the graph tests) */
static int src_dots(const scen *c) { return src_dots_force >= 0 ? src_dots_force : (c->H + c->maxT) % 3 != 0; }
static int64_t rpad(const scen *c) { return (rrows(c) + 3) / 4 * 4; }
/* MXFP8 GEMM layout: [128 * T_cap, roundup(H/32, 4)], T_cap = (M + 127 * min(G, M)) / 128 with M = R,
 * G = NLE (tw_ep.h); by source M = U, G = 1 */
static int64_t mxrows(const scen *c) {
  int64_t M = rrows(c), G = by_source ? 1 : c->E / c->n, g = G < M ? G : M;
  return 128 * ((M + 127 * g) / 128);
}
static int64_t mxcols(const scen *c) { return (scols(c) + 3) / 4 * 4; }
/* bytes of recv_scales: [R, H/block], or in the GEMM layout [H/128, roundup(R, 4)] f32 (1x128),
 * [mxrows, mxcols] E8M0 (MXFP8) */
static size_t rsclb(const scen *c) {
  if (c->gemm && c->scale_block == 32) return (size_t)(mxrows(c) * mxcols(c));
  return c->gemm ? (size_t)(scols(c) * rpad(c)) * 4 : sclb(c) * (size_t)rrows(c);
}

static void fill_f(unsigned char *p, tw_dtype dt, int64_t n, uint64_t *st) {
  for (int64_t i = 0; i < n; i++) {
    float v = (float)tt_rand_uniform(st, -2, 2);
    if (dt == TW_F32) ((float *)p)[i] = v;
    else if (dt == TW_BF16) ((uint16_t *)p)[i] = tw_f32_to_bf16(v);
    else p[i] = (unsigned char)(tt_rand_u64(st) & 0x7e); /* fp8 codes, no NaN */
  }
}

/* many_chunks: maxT up to 1500 and E 256 or 2048 half the time, so T * k spans several counting
 * chunks of gpu/ep.cu (EP_CHUNK 1024 routes: its chunk scan and chunked route ranks) and its
 * layout block takes several experts per thread (E 2048; with 4 ranks its tables no longer fit
 * the shared-memory staging); 0 keeps the default draws (maxT <= 96: one chunk) unchanged. */
static int many_chunks;
/* gemm_scales: every case fp8 with cfg.scales_gemm_layout = 1: 1 with 1x128 scales; 2 MXFP8
 * compact, 3 MXFP8 swizzled, 4 MXFP8 either (drawn per case); 0 keeps the default draws unchanged. */
static int gemm_scales;
/* wide_rows: every case bf16 tokens and bf16 expert rows with H in {776, 1032, 1040, 2056}, so
 * combine_bwd's warp dot and lsa_dout_rows take their four-vectors-a-lane loop (H / 8 > 96) and
 * then the tail; 0 keeps the default draws (H <= 384) unchanged. */
static int wide_rows;

static void scen_make(scen *c, int n, uint64_t seed) {
  uint64_t st = seed;
  memset(c, 0, sizeof *c);
  c->n = n;
  static const int Es[] = {1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
  do c->E = Es[tt_rand_u64(&st) % 10]; while (c->E % n);
  if (many_chunks && tt_rand_u64(&st) % 2) c->E = (tt_rand_u64(&st) % 2) ? 2048 : 256;
  c->k = 1 + (int)(tt_rand_u64(&st) % (uint64_t)(c->E < 8 ? c->E : 8));
  int d = (int)(tt_rand_u64(&st) % 6);
  c->dt = d == 0 ? TW_F32 : d <= 2 ? TW_BF16 : d <= 4 ? TW_E4M3 : TW_E5M2;
  if (gemm_scales) c->dt = d & 1 ? TW_E4M3 : TW_E5M2;
  c->gemm = gemm_scales != 0;
  c->mxsw = gemm_scales == 3 || (gemm_scales == 4 && (tt_rand_u64(&st) & 1));
  static const int64_t Hs[] = {1, 3, 8, 17, 64, 96, 128, 160, 256, 300};
  if (tw_dtype_is_fp8(c->dt)) {
    c->scale_block = gemm_scales >= 2 ? 32 : (tt_rand_u64(&st) & 1) || gemm_scales ? 128 : 32;
    c->H = c->scale_block * (1 + (int64_t)(tt_rand_u64(&st) % (gemm_scales >= 2 ? 6 : 3)));
  } else {
    c->H = Hs[tt_rand_u64(&st) % 10];
  }
  c->ydt = (tt_rand_u64(&st) & 1) ? TW_F32 : TW_BF16;
  if (wide_rows) {
    static const int64_t Ws[] = {776, 1032, 1040, 2056};
    c->dt = c->ydt = TW_BF16;
    c->scale_block = 0;
    c->H = Ws[tt_rand_u64(&st) % 4];
  }
  static const int As[] = {1, 1, 2, 4, 8, 16};
  c->A = As[tt_rand_u64(&st) % 6];
  c->maxT = 1 + (int64_t)(tt_rand_u64(&st) % (many_chunks ? 1500 : 96));
  for (int r = 0; r < n; r++) {
    c->T[r] = (int64_t)(tt_rand_u64(&st) % (uint64_t)(c->maxT + 1));
    if (tt_rand_u64(&st) % 8 == 0) c->T[r] = c->maxT;
  }
  int skew = (int)(tt_rand_u64(&st) % 3 == 0);
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = c->maxT; cfg.alignment = c->A;
  int64_t nodrop = tw_ep_capacity_no_drop(&cfg, n);
  int p = (int)(tt_rand_u64(&st) % 6);
  c->policy = p == 5 ? TW_EP_OVERFLOW_ERROR : p >= 3 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  c->R = p >= 3 ? c->A * (1 + (int64_t)(tt_rand_u64(&st) % (uint64_t)(nodrop / c->A / 2 + 1))) : nodrop;
  for (int r = 0; r < n; r++) {
    int64_t T = c->T[r];
    c->tok[r] = malloc(tokb(c) * (size_t)T + 1);
    c->scl[r] = malloc(sclb(c) * (size_t)T + 1);
    c->idx[r] = malloc((size_t)(T * c->k) * 4 + 4);
    c->w[r] = malloc((size_t)(T * c->k) * 4 + 4);
    c->dout[r] = malloc(yb(c) * (size_t)T + 1);
    c->y[r] = malloc(yb(c) * (size_t)c->R + 1);
    c->dy[r] = malloc(yb(c) * (size_t)c->R + 1);
    c->rdw[r] = malloc((size_t)c->R * 4 + 4);
    fill_f(c->tok[r], c->dt, T * c->H, &st);
    if (c->scale_block == 128) for (int64_t i = 0; i < T * scols(c); i++) ((float *)c->scl[r])[i] = (float)tt_rand_uniform(&st, 0.1, 4);
    if (c->scale_block == 32) for (int64_t i = 0; i < T * scols(c); i++) c->scl[r][i] = (unsigned char)(100 + tt_rand_u64(&st) % 50);
    for (int64_t t = 0; t < T; t++) { /* k distinct ids per token */
      int perm[2048];
      for (int e = 0; e < c->E; e++) perm[e] = e;
      for (int j = 0; j < c->k; j++) {
        int lim = skew && c->E > 2 * c->k ? 2 * c->k : c->E;
        int m = j + (int)(tt_rand_u64(&st) % (uint64_t)(lim - j));
        int tmp = perm[j]; perm[j] = perm[m]; perm[m] = tmp;
        c->idx[r][t * c->k + j] = perm[j];
      }
    }
    for (int64_t i = 0; i < T * c->k; i++) c->w[r][i] = (float)tt_rand_uniform(&st, -1, 1);
    fill_f(c->dout[r], c->ydt, T * c->H, &st);
    fill_f(c->y[r], c->ydt, c->R * c->H, &st);
    fill_f(c->dy[r], c->ydt, c->R * c->H, &st);
    for (int64_t i = 0; i < c->R; i++) c->rdw[r][i] = (float)tt_rand_uniform(&st, -1, 1);
  }
}

static void scen_free(scen *c) {
  for (int r = 0; r < c->n; r++) {
    free(c->tok[r]); free(c->scl[r]); free(c->idx[r]); free(c->w[r]); free(c->dout[r]); free(c->y[r]);
    free(c->dy[r]); free(c->rdw[r]);
  }
}

static void outs_alloc(outs *o, const scen *c, int r) {
  int nle = c->E / c->n;
  int64_t T = c->T[r], R = c->R;
  o->recv = malloc(tokb(c) * (size_t)rrows(c) + 1); memset(o->recv, 0xAB, tokb(c) * (size_t)rrows(c));
  o->row = malloc((size_t)R * 4 + 4); memset(o->row, 0xAB, (size_t)R * 4);
  o->rscl = malloc(rsclb(c) + 1); memset(o->rscl, 0xAB, rsclb(c));
  o->out = malloc(yb(c) * (size_t)T + 1);
  o->outu = malloc(yb(c) * (size_t)T + 1);
  o->dtok = malloc(yb(c) * (size_t)T + 1);
  o->dexp = malloc(yb(c) * (size_t)R + 1);
  o->rw = malloc((size_t)R * 4 + 4); memset(o->rw, 0xAB, (size_t)R * 4);
  o->dtw = malloc((size_t)(T * c->k) * 4 + 4);
  o->dtwc = malloc((size_t)(T * c->k) * 4 + 4);
  o->dsrc = malloc(yb(c) * (size_t)(c->n * c->maxT) + 1);
  o->dtws = malloc((size_t)(T * c->k) * 4 + 4);
  o->gs = malloc((size_t)nle * 4); memset(o->gs, 0xAB, (size_t)nle * 4);
  o->dr = malloc((size_t)nle * 4); memset(o->dr, 0xAB, (size_t)nle * 4);
}
static void outs_free(outs *o) {
  free(o->recv); free(o->rscl); free(o->out); free(o->outu); free(o->dtok); free(o->dexp); free(o->rw); free(o->dtw);
  free(o->dtwc); free(o->gs); free(o->dr); free(o->row); free(o->dsrc); free(o->dtws);
}

/* ---- one rank's step on either backend ----------------------------------------------------- */
typedef struct {
  tw_ctx *ctx;
  void *b[24];
  int nb;
} dmem;

static tw_tensor put(dmem *m, const void *h, tw_dtype dt, int ndim, int64_t d0, int64_t d1, int copy) {
  tw_tensor t = ndim == 1 ? tw_tensor_1d((void *)h, dt, d0, TW_MEM_HOST) : tw_tensor_2d((void *)h, dt, d0, d1, TW_MEM_HOST);
  if (tw_ctx_mem(m->ctx) == TW_MEM_HOST) return t;
  tw_tensor d = t;
  d.mem = TW_MEM_DEVICE;
  d.data = NULL;
  size_t bytes = tw_tensor_bytes(&t);
  if (bytes) {
    cr_assert_eq(tw_alloc(m->ctx, bytes, &d.data), TW_OK, "%s", tw_last_error());
    m->b[m->nb++] = d.data;
    if (copy) cr_assert_eq(tw_tensor_copy(m->ctx, &d, &t), TW_OK, "%s", tw_last_error());
    else cr_assert_eq(tw_memset(m->ctx, d.data, 0xAB, bytes), TW_OK);
  }
  return d;
}
static void get(dmem *m, void *h, const tw_tensor *d) {
  if (tw_ctx_mem(m->ctx) == TW_MEM_HOST || !tw_tensor_bytes(d)) return;
  tw_tensor t = *d;
  t.mem = TW_MEM_HOST;
  t.data = h;
  cr_assert_eq(tw_tensor_copy(m->ctx, &t, d), TW_OK, "%s", tw_last_error());
}

/* Runs dispatch, both combines, dispatch_bwd and combine_bwd for rank r on ctx/comm. */
static tw_status run_rank(tw_ctx *ctx, tw_comm *comm, const scen *c, int r, outs *o) {
  int nle = c->E / c->n, k = c->k;
  int64_t T = c->T[r], H = c->H, R = c->R;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = k; cfg.max_tokens = c->maxT; cfg.hidden = H; cfg.token_dtype = c->dt;
  cfg.scale_block = c->scale_block; cfg.recv_capacity = R; cfg.alignment = c->A; cfg.overflow = c->policy;
  cfg.scales_gemm_layout = c->gemm;
  cfg.scales_mxfp8_swizzled = c->mxsw;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  o->st = TW_ERR_INTERNAL;
  o->msg[0] = 0;
  tw_status s = tw_ep_create(ctx, comm, &cfg, &ep);
  if (s != TW_OK) return o->st = s;
  s = tw_ep_layer_create(ep, &layer);
  if (s != TW_OK) { tw_ep_destroy(ep); return o->st = s; }
  dmem m = {ctx, {0}, 0};
  tw_tensor none = tw_tensor_none();
  tw_tensor tok = put(&m, c->tok[r], c->dt, 2, T, H, 1), idx = put(&m, c->idx[r], TW_I32, 2, T, k, 1);
  tw_tensor w = put(&m, c->w[r], TW_F32, 2, T, k, 1);
  tw_tensor scl = c->scale_block ? put(&m, c->scl[r], sdt(c), 2, T, scols(c), 1) : none;
  tw_tensor recv = put(&m, o->recv, c->dt, 2, rrows(c), H, 0), rw = put(&m, o->rw, TW_F32, 1, R, 0, 0);
  tw_tensor rscl = !c->scale_block ? none
                  : c->gemm && c->scale_block == 32 ? put(&m, o->rscl, sdt(c), 2, mxrows(c), mxcols(c), 0)
                  : c->gemm       ? put(&m, o->rscl, sdt(c), 2, scols(c), rpad(c), 0)
                                  : put(&m, o->rscl, sdt(c), 2, rrows(c), scols(c), 0);
  tw_tensor gs = put(&m, o->gs, TW_I32, 1, nle, 0, 0), dr = put(&m, o->dr, TW_I32, 1, nle, 0, 0);
  tw_tensor row = by_source ? put(&m, o->row, TW_I32, 1, R, 0, 0) : none;
  if (by_source) s = tw_ep_dispatch_by_source(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &row, &rw, &gs, &dr);
  else s = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &dr);
  if (s == TW_OK && tw_ctx_mem(ctx) != TW_MEM_HOST) s = tw_ctx_check(ctx);
  o->st = s;
  if (s != TW_OK) snprintf(o->msg, sizeof o->msg, "%s", tw_last_error());
  get(&m, o->recv, &recv); get(&m, o->rw, &rw); get(&m, o->gs, &gs); get(&m, o->dr, &dr);
  if (by_source) get(&m, o->row, &row);
  if (c->scale_block) get(&m, o->rscl, &rscl);
  if (s == TW_OK) {
    tw_tensor y = put(&m, c->y[r], c->ydt, 2, R, H, 1), out = put(&m, o->out, c->ydt, 2, T, H, 0);
    tw_tensor outu = put(&m, o->outu, c->ydt, 2, T, H, 0);
    tw_tensor dy = put(&m, c->dy[r], c->ydt, 2, R, H, 1), rdw = put(&m, c->rdw[r], TW_F32, 1, R, 0, 1);
    tw_tensor dtok = put(&m, o->dtok, c->ydt, 2, T, H, 0), dtw = put(&m, o->dtw, TW_F32, 2, T, k, 0);
    tw_tensor dout = put(&m, c->dout[r], c->ydt, 2, T, H, 1), dexp = put(&m, o->dexp, c->ydt, 2, R, H, 0);
    tw_tensor dtwc = put(&m, o->dtwc, TW_F32, 2, T, k, 0);
    if (s == TW_OK) s = tw_ep_combine(ctx, layer, &y, &w, &out);
    if (s == TW_OK) s = tw_ep_combine(ctx, layer, &y, &none, &outu);
    if (s == TW_OK) s = tw_ep_dispatch_bwd(ctx, layer, &dy, &rdw, &dtok, &dtw);
    if (s == TW_OK) s = tw_ep_combine_bwd(ctx, layer, &dout, &w, &y, &dexp, &dtwc);
    tw_tensor dsrc = by_source ? put(&m, o->dsrc, c->ydt, 2, c->n * c->maxT, H, 0) : none;
    tw_tensor dtws = by_source && src_dots(c) ? put(&m, o->dtws, TW_F32, 2, T, k, 0) : none;
    if (s == TW_OK && by_source) s = tw_ep_combine_bwd_by_source(ctx, layer, &dout, src_dots(c) ? &y : &none, &dsrc, &dtws);
    if (s == TW_OK && tw_ctx_mem(ctx) != TW_MEM_HOST) s = tw_ctx_check(ctx);
    if (s != TW_OK) {  /* a failure after a good dispatch (a barrier timeout, say) shows as a status, not as zeros */
      o->st = s;
      snprintf(o->msg, sizeof o->msg, "%s", tw_last_error());
    }
    if (s == TW_OK) {
      get(&m, o->out, &out); get(&m, o->outu, &outu); get(&m, o->dtok, &dtok); get(&m, o->dtw, &dtw);
      get(&m, o->dexp, &dexp); get(&m, o->dtwc, &dtwc);
      if (by_source) { get(&m, o->dsrc, &dsrc); if (src_dots(c)) get(&m, o->dtws, &dtws); }
    }
  }
  if (tw_ctx_mem(ctx) != TW_MEM_HOST) tw_ctx_sync(ctx);
  for (int i = 0; i < m.nb; i++) tw_free(ctx, m.b[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  return s;
}

static int cmp(const void *g, const void *r, size_t bytes, const char *what, const char *name, int rank) {
  if (!bytes || memcmp(g, r, bytes) == 0) return 1;
  const unsigned char *a = g, *b = r;
  size_t i = 0;
  while (a[i] == b[i]) i++;
  cr_log_error("%s rank %d: %s differs first at byte %zu (gpu 0x%02x, ref 0x%02x)", name, rank, what, i, a[i], b[i]);
  return 0;
}

/* 1 if rank r's gpu outputs equal the ref outputs bit for bit (statuses agree on errors). */
static int same_outs(const scen *c, int r, const outs *g, const outs *f, const char *name) {
  int nle = c->E / c->n;
  int64_t T = c->T[r], R = c->R;
  if ((g->st == TW_OK) != (f->st == TW_OK)) {
    cr_log_error("%s rank %d: gpu status %s, ref %s (gpu: %s)", name, r, tw_status_name(g->st), tw_status_name(f->st),
                 g->msg);
    return 0;
  }
  int ok = cmp(g->recv, f->recv, tokb(c) * (size_t)rrows(c), by_source ? "src_tokens" : "recv_tokens", name, r) &&
           (!by_source || g->st != TW_OK || cmp(g->row, f->row, (size_t)R * 4, "recv_row", name, r)) &&
           cmp(g->rscl, f->rscl, rsclb(c),
               !c->gemm ? "recv_scales" : c->scale_block == 128 ? "recv_scales (gemm layout)"
               : c->mxsw ? "recv_scales (MXFP8 gemm layout, swizzled)" : "recv_scales (MXFP8 gemm layout, compact)",
               name, r) &&
           cmp(g->rw, f->rw, (size_t)R * 4, "recv_weights", name, r) &&
           cmp(g->gs, f->gs, (size_t)nle * 4, "group_sizes", name, r) &&
           cmp(g->dr, f->dr, (size_t)nle * 4, "dropped", name, r);
  if (!ok || g->st != TW_OK) return ok; /* on an error both left the outputs as they were */
  return cmp(g->out, f->out, yb(c) * (size_t)T, "combine out", name, r) &&
         cmp(g->outu, f->outu, yb(c) * (size_t)T, "combine out (unweighted)", name, r) &&
         cmp(g->dtok, f->dtok, yb(c) * (size_t)T, "d_tokens", name, r) &&
         cmp(g->dtw, f->dtw, (size_t)(T * c->k) * 4, "d_topk_weights (dispatch_bwd)", name, r) &&
         cmp(g->dexp, f->dexp, yb(c) * (size_t)R, "d_expert_out", name, r) &&
         cmp(g->dtwc, f->dtwc, (size_t)(T * c->k) * 4, "d_topk_weights (combine_bwd)", name, r) &&
         (!by_source || (cmp(g->dsrc, f->dsrc, yb(c) * (size_t)(c->n * c->maxT), "d_src (combine_bwd by source)", name, r) &&
                         (!src_dots(c) ||
                          cmp(g->dtws, f->dtws, (size_t)(T * c->k) * 4, "d_topk_weights (combine_bwd by source)", name, r))));
}

/* Token conservation: kept rows (sum of group sizes without padding is not visible, so: kept =
 * routes to this rank's experts - dropped, and the non-zero recv_weights rows can't tell) --
 * checked from the oracle's formula: sum_l dropped + rows kept == routes into the rank. */
static int conserved(const scen *c, int r, const outs *o) {
  int nle = c->E / c->n;
  int64_t routes_in = 0, dropped = 0, padded = 0;
  for (int s = 0; s < c->n; s++)
    for (int64_t q = 0; q < c->T[s] * c->k; q++) routes_in += c->idx[s][q] / nle == r;
  for (int l = 0; l < nle; l++) {
    dropped += o->dr[l];
    padded += o->gs[l];
  }
  return padded >= routes_in - dropped && padded <= c->R && dropped >= 0;
}

/* ---- 1 GPU --------------------------------------------------------------------------------- */
static tw_ctx *gctx, *rctx;
static tw_comm *gcomm, *rcomm;

static void setup1(void) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&gctx, &cfg), TW_OK, "%s", tw_last_error());
  int dev = 0;
  cr_assert_eq(tw_comm_init_nccl_local(1, &dev, &gcomm), TW_OK, "%s", tw_last_error());
  rctx = tt_ref_ctx();
  cr_assert_eq(tw_comm_init_threads(1, &rcomm), TW_OK, "%s", tw_last_error());
}
static void teardown1(void) {
  tw_comm_destroy(gcomm);
  tw_comm_destroy(rcomm);
  tw_ctx_destroy(gctx);
  tw_ctx_destroy(rctx);
}
TestSuite(ep_gpu, .init = setup1, .fini = teardown1, .timeout = 900);

Test(ep_gpu, goldens_ep_size_1_through_the_runner) {
  char root[1024];
  snprintf(root, sizeof root, "%s/ep", tt_golden_root());
  char **dirs = NULL;
  int n = tw_golden_list_cases(root, &dirs), ran = 0, skipped = 0, failed = 0;
  cr_assert_gt(n, 0, "no EP goldens under %s", root);
  for (int i = 0; i < n; i++) {
    tw_golden_result res;
    tw_status s = tw_golden_run_case(gctx, dirs[i], &res);
    if (res.skipped) { /* the runner answers TW_ERR_UNSUPPORTED for a skipped case */
      tw_clear_error();
      skipped++;
      cr_assert(strstr(res.detail, "needs ") && strstr(res.detail, "GPUs, sees"), "%s: skipped for '%s'", dirs[i],
                res.detail);
      continue;
    }
    ran++;
    if (s != TW_OK || !res.passed) {
      failed++;
      cr_log_error("%s: %s %s", dirs[i], s != TW_OK ? tw_last_error() : res.worst_output, res.detail);
    }
  }
  cr_log_info("EP goldens on 1 GPU: %d ran (%d failed), %d skipped (need more GPUs)", ran, failed, skipped);
  cr_assert_eq(failed, 0, "%d of %d EP goldens with ep_size 1 failed on the gpu", failed, ran);
  cr_assert_gt(ran, 0, "no EP golden with ep_size 1 ran");
  tw_golden_free_list(dirs, n);
}

/* N seeded random cases with ep_size 1 on the 1-rank NCCL communicator, one EP version forced
 * (NULL: auto, which is ep_nccl_slots at ep_size 1). */
static void random_1(const char *kernel, int N) {
  int failed = 0, errors = 0, drops = 0, fp8 = 0, tails = 0, small = 0;
  tw_ctx *kctx = gctx;
  if (kernel) {
    tw_ctx_config cc = TW_CTX_CONFIG_INIT;
    cc.backend = TW_BACKEND_GPU;
    cc.kernel = kernel;
    cr_assert_eq(tw_ctx_create(&kctx, &cc), TW_OK, "%s", tw_last_error());
  }
  for (int i = 0; i < N; i++) {
    scen c;
    scen_make(&c, 1, 0xe9000000u + (uint64_t)i);
    char name[200];
    snprintf(name, sizeof name, "case %d (E=%d k=%d T=%lld maxT=%lld H=%lld dt=%s sb=%d ydt=%s A=%d R=%lld %s)", i, c.E,
             c.k, (long long)c.T[0], (long long)c.maxT, (long long)c.H, tw_dtype_name(c.dt), c.scale_block,
             tw_dtype_name(c.ydt), c.A, (long long)c.R, c.policy == TW_EP_OVERFLOW_DROP ? "drop" : "error");
    outs g, f;
    outs_alloc(&g, &c, 0);
    outs_alloc(&f, &c, 0);
    tw_status gs = run_rank(kctx, gcomm, &c, 0, &g);
    if (kernel && gs == TW_ERR_UNSUPPORTED && strstr(tw_last_error(), "cannot run here")) {
      char why[512];
      snprintf(why, sizeof why, "%s", tw_last_error());
      outs_free(&g);
      outs_free(&f);
      scen_free(&c);
      tw_ctx_destroy(kctx);
      cr_skip_test("%s", why);
    }
    tw_status fs = run_rank(rctx, rcomm, &c, 0, &f);
    if (fs != TW_OK) errors++;
    if (fs != TW_OK && !strstr(tw_last_error(), "receive rows")) cr_log_error("%s: ref %s", name, tw_last_error());
    if (gs != TW_OK && g.st == TW_OK) cr_log_error("%s: gpu %s", name, tw_last_error()); /* not the step's own */
    int ok = same_outs(&c, 0, &g, &f, name) && (gs == TW_OK || g.st != TW_OK);
    if (ok && g.st != TW_OK) ok = g.st == TW_ERR_DEVICE; /* the overflow is seen on the device */
    if (ok && f.st == TW_OK) ok = conserved(&c, 0, &g);
    if (!ok) failed++;
    for (int l = 0; f.st == TW_OK && l < c.E; l++) drops += f.dr[l] > 0;
    fp8 += tw_dtype_is_fp8(c.dt);
    if (c.scale_block == 32 && c.gemm) { /* MXFP8: rows past the last slab's block, swizzled cases */
      int64_t tiles = 0;
      for (int l = 0; f.st == TW_OK && l < c.E; l++) tiles += ((int64_t)f.gs[l] + 127) / 128;
      tails += f.st == TW_OK && 128 * tiles < mxrows(&c);
      small += c.mxsw;
    } else {
      tails += c.gemm && rpad(&c) != c.R; /* recv_scales has tail columns R .. roundup(R, 4)-1 */
      small += c.gemm && c.R < 3;         /* more tail columns than rows */
    }
    outs_free(&g);
    outs_free(&f);
    scen_free(&c);
  }
  if (kernel) tw_ctx_destroy(kctx);
  cr_log_info("EP random ep_size 1 (%s%s): %d cases (%d capacity errors, %d experts with drops, %d fp8), %d differ",
              kernel ? kernel : "auto", gemm_scales ? ", scales_gemm_layout" : "", N, errors, drops, fp8, failed);
  if (gemm_scales == 1) cr_log_info("  scales_gemm_layout: %d cases with tail columns, %d with R < 3", tails, small);
  if (gemm_scales >= 2)
    cr_log_info("  MXFP8 scales_gemm_layout: %d cases with rows past the last slab's block, %d swizzled", tails, small);
  cr_assert_eq(failed, 0, "%d of %d random EP cases differ from ref", failed, N);
  if (N < 60) return; /* a short run (EP_MANY_N under a sanitizer) need not draw them */
  cr_assert_gt(errors, 0, "no capacity-error case was drawn");
  cr_assert_gt(drops, 0, "no drop case was drawn");
  if (gemm_scales) cr_assert_gt(tails, 0, "no case with R %% 4 != 0 (1x128) / rows past the blocks (MXFP8) was drawn");
}

Test(ep_gpu, random_cases_ep_size_1_bit_for_bit) { random_1(NULL, 600); }
/* ep_nccl_lsa forced on one rank: the window, its handshake and barriers, and every kernel of
 * the version run (rows to self), against the oracle; the 2-GPU sweep covers the remote path */
Test(ep_gpu, random_cases_ep_size_1_lsa_forced) { random_1("ep_nccl_lsa", 200); }

/* Device-side errors: the step reports through the error word, writes nothing out of bounds,
 * and the next good step works. */
Test(ep_gpu, device_errors) {
  int E = 8, k = 2;
  int64_t T = 4, H = 16;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = E; cfg.topk = k; cfg.max_tokens = T; cfg.hidden = H; cfg.token_dtype = TW_F32;
  tw_ep *ep;
  tw_ep_layer *layer;
  cr_assert_eq(tw_ep_create(gctx, gcomm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &layer), TW_OK);
  int64_t R = tw_ep_recv_capacity(ep);
  float tok[64], w[8];
  tt_fill_uniform_f32(tok, T * H, 1, -1, 1);
  tt_fill_uniform_f32(w, T * k, 2, -1, 1);
  int32_t good[8] = {0, 1, 2, 3, 4, 5, 6, 7}, range[8] = {0, 1, 2, 3, 4, 99, 6, 7}, twice[8] = {0, 1, 3, 3, 4, 5, 6, 7};
  dmem m = {gctx, {0}, 0};
  tw_tensor none = tw_tensor_none();
  tw_tensor dtok = put(&m, tok, TW_F32, 2, T, H, 1), dw = put(&m, w, TW_F32, 2, T, k, 1);
  tw_tensor didx = put(&m, good, TW_I32, 2, T, k, 1);
  tw_tensor recv = put(&m, NULL, TW_F32, 2, R, H, 0), rw = put(&m, NULL, TW_F32, 1, R, 0, 0);
  tw_tensor gs = put(&m, NULL, TW_I32, 1, E, 0, 0);
  int32_t gsh[8];
  /* id out of range */
  tw_tensor h = tw_tensor_2d(range, TW_I32, T, k, TW_MEM_HOST);
  cr_assert_eq(tw_tensor_copy(gctx, &didx, &h), TW_OK);
  cr_assert_eq(tw_ep_dispatch(gctx, layer, &dtok, &none, &didx, &dw, &recv, &none, &rw, &gs, &none), TW_OK);
  tt_expect_status(tw_ctx_check(gctx), TW_ERR_DEVICE, "ep_dispatch: topk_idx[2, 1] = 99 is not an expert id");
  get(&m, gsh, &gs);
  int sum = 0;
  for (int e = 0; e < E; e++) sum += gsh[e];
  cr_assert_eq(sum, 7, "the 7 good routes are dispatched, the bad one left out (got %d)", sum);
  /* the same id twice in one token */
  h.data = twice;
  cr_assert_eq(tw_tensor_copy(gctx, &didx, &h), TW_OK);
  cr_assert_eq(tw_ep_dispatch(gctx, layer, &dtok, &none, &didx, &dw, &recv, &none, &rw, &gs, &none), TW_OK);
  tt_expect_status(tw_ctx_check(gctx), TW_ERR_DEVICE, "ep_dispatch: token 1 lists expert 3 twice");
  /* three bad routes in one counting chunk: the first in (t, j) order is the one named */
  int32_t several[8] = {0, 1, 3, 3, 4, 99, 6, 99};
  h.data = several;
  cr_assert_eq(tw_tensor_copy(gctx, &didx, &h), TW_OK);
  cr_assert_eq(tw_ep_dispatch(gctx, layer, &dtok, &none, &didx, &dw, &recv, &none, &rw, &gs, &none), TW_OK);
  tt_expect_status(tw_ctx_check(gctx), TW_ERR_DEVICE, "ep_dispatch: token 1 lists expert 3 twice");
  get(&m, gsh, &gs);
  sum = 0;
  for (int e = 0; e < E; e++) sum += gsh[e];
  cr_assert_eq(sum, 5, "the 5 good routes are dispatched, the 3 bad ones left out (got %d)", sum);
  /* a good step afterwards */
  h.data = good;
  cr_assert_eq(tw_tensor_copy(gctx, &didx, &h), TW_OK);
  cr_assert_eq(tw_ep_dispatch(gctx, layer, &dtok, &none, &didx, &dw, &recv, &none, &rw, &gs, &none), TW_OK);
  cr_assert_eq(tw_ctx_check(gctx), TW_OK, "%s", tw_last_error());
  get(&m, gsh, &gs);
  for (int e = 0; e < E; e++) cr_assert_eq(gsh[e], 1);
  for (int i = 0; i < m.nb; i++) tw_free(gctx, m.b[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);

  /* capacity overflow under the error policy: nothing written */
  cfg.recv_capacity = 4; /* 8 routes into 4 rows */
  cr_assert_eq(tw_ep_create(gctx, gcomm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &layer), TW_OK);
  m.nb = 0;
  dtok = put(&m, tok, TW_F32, 2, T, H, 1);
  dw = put(&m, w, TW_F32, 2, T, k, 1);
  didx = put(&m, good, TW_I32, 2, T, k, 1);
  recv = put(&m, NULL, TW_F32, 2, 4, H, 0);
  rw = put(&m, NULL, TW_F32, 1, 4, 0, 0);
  gs = put(&m, NULL, TW_I32, 1, E, 0, 0);
  cr_assert_eq(tw_ep_dispatch(gctx, layer, &dtok, &none, &didx, &dw, &recv, &none, &rw, &gs, &none), TW_OK);
  tt_expect_status(tw_ctx_check(gctx), TW_ERR_DEVICE, "rank 0 needs 8 receive rows");
  cr_assert(strstr(tw_last_error(), "recv_capacity is 4"), "%s", tw_last_error());
  unsigned char rb[4 * 16 * 4];
  get(&m, rb, &recv);
  for (size_t i = 0; i < sizeof rb; i++) cr_assert_eq(rb[i], 0xAB, "recv_tokens byte %zu written on overflow", i);
  get(&m, gsh, &gs);
  for (int e = 0; e < E; e++) cr_assert_eq((uint32_t)gsh[e], 0xABABABABu, "group_sizes written on overflow");
  for (int i = 0; i < m.nb; i++) tw_free(gctx, m.b[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
}

/* dispatch -> combine captured once in a CUDA graph; each replay reads new routing written
 * into the same device buffers and must equal the oracle. */
static void graph_1(const char *kernel) {
  cudaStream_t stream;
  cr_assert_eq(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.stream = stream;
  cc.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK, "%s", tw_last_error());
  /* a fixed shape: E 16, k 4, T 48, H 96 bf16, A 8, no-drop capacity */
  int E = 16, k = 4;
  int64_t T = 48, H = 96;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = E; cfg.topk = k; cfg.max_tokens = T; cfg.hidden = H; cfg.token_dtype = TW_BF16; cfg.alignment = 8;
  tw_ep *ep;
  tw_ep_layer *layer;
  tw_status cs = tw_ep_create(ctx, gcomm, &cfg, &ep);
  if (kernel && cs == TW_ERR_UNSUPPORTED && strstr(tw_last_error(), "cannot run here")) {
    char why[512];
    snprintf(why, sizeof why, "%s", tw_last_error());
    tw_ctx_destroy(ctx);
    cudaStreamDestroy(stream);
    cr_skip_test("%s", why);
  }
  cr_assert_eq(cs, TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &layer), TW_OK);
  int64_t R = tw_ep_recv_capacity(ep);
  dmem m = {ctx, {0}, 0};
  tw_tensor none = tw_tensor_none();
  tw_tensor tok = put(&m, NULL, TW_BF16, 2, T, H, 0), idx = put(&m, NULL, TW_I32, 2, T, k, 0);
  tw_tensor w = put(&m, NULL, TW_F32, 2, T, k, 0), recv = put(&m, NULL, TW_BF16, 2, R, H, 0);
  tw_tensor rw = put(&m, NULL, TW_F32, 1, R, 0, 0), gs = put(&m, NULL, TW_I32, 1, E, 0, 0);
  tw_tensor y = put(&m, NULL, TW_BF16, 2, R, H, 0), out = put(&m, NULL, TW_BF16, 2, T, H, 0);
  /* the layer must have dispatched once before combine is accepted by core (host state only) */
  uint16_t *htok = malloc((size_t)(T * H) * 2), *hy = malloc((size_t)(R * H) * 2), *hout = malloc((size_t)(T * H) * 2);
  uint16_t *rrecv = malloc((size_t)(R * H) * 2), *grecv = malloc((size_t)(R * H) * 2), *rout = malloc((size_t)(T * H) * 2);
  int32_t *hidx = malloc((size_t)(T * k) * 4);
  float *hw = malloc((size_t)(T * k) * 4);
  uint64_t st = 4242;
  for (int64_t i = 0; i < T * k; i++) hidx[i] = (int32_t)(i % k);
  cr_assert_eq(tw_tensor_copy(ctx, &idx, &(tw_tensor){hidx, TW_I32, 2, {T, k}, TW_MEM_HOST}), TW_OK);
  cr_assert_eq(tw_ep_dispatch(ctx, layer, &tok, &none, &idx, &w, &recv, &none, &rw, &gs, &none), TW_OK);
  cr_assert_eq(tw_ctx_check(ctx), TW_OK, "%s", tw_last_error());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cr_assert_eq(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  tw_status s1 = tw_ep_dispatch(ctx, layer, &tok, &none, &idx, &w, &recv, &none, &rw, &gs, &none);
  tw_status s2 = tw_ep_combine(ctx, layer, &y, &w, &out);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  cr_assert_eq(s1, TW_OK, "dispatch under capture: %s", tw_last_error());
  cr_assert_eq(s2, TW_OK, "combine under capture: %s", tw_last_error());
  cr_assert_eq(ce, cudaSuccess, "end capture: %s", cudaGetErrorString(ce));
  cr_assert_eq(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int rep = 0; rep < 3; rep++) {
    for (int64_t i = 0; i < T * H; i++) htok[i] = tw_f32_to_bf16((float)tt_rand_uniform(&st, -2, 2));
    for (int64_t i = 0; i < R * H; i++) hy[i] = tw_f32_to_bf16((float)tt_rand_uniform(&st, -2, 2));
    for (int64_t t = 0; t < T; t++) {
      int perm[16];
      for (int e = 0; e < E; e++) perm[e] = e;
      for (int j = 0; j < k; j++) {
        int mm = j + (int)(tt_rand_u64(&st) % (uint64_t)(E - j));
        int tmp = perm[j]; perm[j] = perm[mm]; perm[mm] = tmp;
        hidx[t * k + j] = perm[j];
        hw[t * k + j] = (float)tt_rand_uniform(&st, -1, 1);
      }
    }
    cr_assert_eq(tw_tensor_copy(ctx, &tok, &(tw_tensor){htok, TW_BF16, 2, {T, H}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &idx, &(tw_tensor){hidx, TW_I32, 2, {T, k}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &w, &(tw_tensor){hw, TW_F32, 2, {T, k}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &y, &(tw_tensor){hy, TW_BF16, 2, {R, H}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(cudaGraphLaunch(exec, stream), cudaSuccess);
    cr_assert_eq(tw_ctx_check(ctx), TW_OK, "replay %d: %s", rep, tw_last_error());
    tw_tensor hrecv = {grecv, TW_BF16, 2, {R, H}, TW_MEM_HOST}, hout_t = {hout, TW_BF16, 2, {T, H}, TW_MEM_HOST};
    cr_assert_eq(tw_tensor_copy(ctx, &hrecv, &recv), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &hout_t, &out), TW_OK);
    /* the oracle on the same routing */
    tw_ep *rep_ep;
    tw_ep_layer *rl;
    cr_assert_eq(tw_ep_create(rctx, rcomm, &cfg, &rep_ep), TW_OK);
    cr_assert_eq(tw_ep_layer_create(rep_ep, &rl), TW_OK);
    int32_t rgs[16];
    float *rrw = malloc((size_t)R * 4);
    tw_tensor a = {htok, TW_BF16, 2, {T, H}, TW_MEM_HOST}, b = {hidx, TW_I32, 2, {T, k}, TW_MEM_HOST};
    tw_tensor cw = {hw, TW_F32, 2, {T, k}, TW_MEM_HOST}, d = {rrecv, TW_BF16, 2, {R, H}, TW_MEM_HOST};
    tw_tensor e = {rrw, TW_F32, 1, {R}, TW_MEM_HOST}, f = {rgs, TW_I32, 1, {E}, TW_MEM_HOST};
    tw_tensor yy = {hy, TW_BF16, 2, {R, H}, TW_MEM_HOST}, oo = {rout, TW_BF16, 2, {T, H}, TW_MEM_HOST};
    cr_assert_eq(tw_ep_dispatch(rctx, rl, &a, &none, &b, &cw, &d, &none, &e, &f, &none), TW_OK);
    cr_assert_eq(tw_ep_combine(rctx, rl, &yy, &cw, &oo), TW_OK);
    cr_assert_eq(memcmp(grecv, rrecv, (size_t)(R * H) * 2), 0, "replay %d: recv_tokens differ from the oracle", rep);
    cr_assert_eq(memcmp(hout, rout, (size_t)(T * H) * 2), 0, "replay %d: combine differs from the oracle", rep);
    free(rrw);
    tw_ep_layer_destroy(rl);
    tw_ep_destroy(rep_ep);
  }
  cr_log_info("EP graph: dispatch + combine captured once, 3 replays with new routing equal the oracle");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (int i = 0; i < m.nb; i++) tw_free(ctx, m.b[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  cudaStreamDestroy(stream);
  free(htok); free(hy); free(hout); free(rrecv); free(grecv); free(rout); free(hidx); free(hw);
}

Test(ep_gpu, graph_capture_and_replay) { graph_1(NULL); }
/* the LSA version's barriers count epochs on the device: replays must go on agreeing */
Test(ep_gpu, graph_capture_and_replay_lsa_forced) { graph_1("ep_nccl_lsa"); }

/* ---- several ranks ------------------------------------------------------------------------- */
typedef struct {
  const scen *c;
  outs *o;
  /* 0 ref, 1 gpu rank r on GPU r (NCCL), 2 gpu every rank on GPU 0 (loopback), 3 gpu on this
   * process's GPU (proc_device: one process per GPU) */
  int gpu;
  const char *kernel; /* forced EP version, or NULL (auto) */
} rank_arg;
static int proc_device;

static tw_status rank_fn(int r, tw_comm *comm, void *arg) {
  rank_arg *a = (rank_arg *)arg;
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = a->gpu ? TW_BACKEND_GPU : TW_BACKEND_REF;
  cc.device = a->gpu == 1 ? r : a->gpu == 3 ? proc_device : 0;
  cc.comm = comm;
  cc.kernel = a->kernel;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_status s = run_rank(ctx, comm, a->c, r, &a->o[r]);
  if (s != TW_OK) snprintf(a->o[r].msg, sizeof a->o[r].msg, "%s", tw_last_error());
  tw_ctx_destroy(ctx);
  return s;
}

/* The n-GPU sweep (n = 2, 4) with one EP version forced (both run: ep_nccl_slots, ep_nccl_lsa):
 * one thread per GPU over NCCL against the ref thread communicator of n ranks. */
static void sweep_gpus(int n, const char *kernel) {
  NEED_GPUS(n);
  tw_comm *g[MAXR], *f[MAXR];
  int devs[MAXR];
  for (int r = 0; r < n; r++) devs[r] = r;
  cr_assert_eq(tw_comm_init_nccl_local(n, devs, g), TW_OK, "%s", tw_last_error());
  /* EP_SWEEP_N: fewer cases (the compute-sanitizer run); default 200 */
  int N = getenv("EP_SWEEP_N") ? atoi(getenv("EP_SWEEP_N")) : 200, failed = 0, drops = 0;
  for (int i = 0; i < N; i++) {
    scen c;
    scen_make(&c, n, (n == 2 ? 0xe9200000u : n == 4 ? 0xe9800000u : 0xe9a00000u) + (uint64_t)i);
    /* a failing rank aborts the NCCL group (tw_run_ranks): overflow is the 1-GPU test's */
    if (c.policy == TW_EP_OVERFLOW_ERROR) c.policy = TW_EP_OVERFLOW_DROP;
    char name[128];
    snprintf(name, sizeof name, "%s %d-rank case %d (E=%d k=%d H=%lld R=%lld)", kernel, n, i, c.E, c.k, (long long)c.H,
             (long long)c.R);
    outs go[MAXR], fo[MAXR];
    for (int r = 0; r < n; r++) {
      outs_alloc(&go[r], &c, r);
      outs_alloc(&fo[r], &c, r);
    }
    cr_assert_eq(tw_comm_init_threads(n, f), TW_OK);
    rank_arg ga = {&c, go, 1, kernel}, fa = {&c, fo, 0, NULL};
    tt_stall_watch_start(name);
    tw_status gs = tw_run_ranks(n, g, rank_fn, &ga);
    tt_stall_watch_stop();
    cr_assert_eq(gs, TW_OK, "%s: %s", name, tw_last_error());
    tw_run_ranks(n, f, rank_fn, &fa);
    for (int r = 0; r < n; r++) {
      int ok = same_outs(&c, r, &go[r], &fo[r], name);
      if (ok && fo[r].st == TW_OK) ok = conserved(&c, r, &go[r]);
      for (int l = 0; l < c.E / n; l++) drops += fo[r].dr[l] > 0;
      failed += !ok;
      outs_free(&go[r]);
      outs_free(&fo[r]);
    }
    for (int r = 0; r < n; r++) tw_comm_destroy(f[r]);
    scen_free(&c);
  }
  for (int r = 0; r < n; r++) tw_comm_destroy(g[r]);
  cr_log_info("EP ep_size %d over NCCL, %s forced: %d cases (%d experts with drops), %d rank results differ", n,
              kernel, N, drops, failed);
  cr_assert_eq(failed, 0, "%d rank results of %d %d-rank cases (%s) differ from ref", failed, N, n, kernel);
}

/* Device-side errors with the ranks on two GPUs over NCCL (issue 13: "test it on 2 GPUs"), each
 * version forced. Every rank runs the same collective steps and never returns an error from its
 * thread (that would abort the group): it records what it saw, checked after the join.
 *   A: rank 1 lists expert 99: rank 1's error word names it, rank 0's step is clean, and the 15
 *      good routes are dispatched (the bad one counted nowhere, so both ranks agree on layouts);
 *   B: a good step on both afterwards: 16 routes;
 *   C: recv_capacity 4 under the error policy (each rank needs 8 rows): the capacity error on
 *      both ranks, recv_tokens and group_sizes left unwritten;
 *   D: the same capacity with the drop policy: no error, kept + dropped = 16 over both ranks;
 *   E: the first context again: a good step. */
typedef struct {
  const char *kernel;
  int gs_sum[2][5], dropped_sum[2];
  tw_status st[2][5];
  char msg[2][5][200];
  int unwritten[2]; /* C: recv_tokens and group_sizes still hold the fill byte */
  char fail[2][200];
} err2_arg;

static void err2_step(err2_arg *a, int r, int step, tw_ctx *ctx, tw_ep_layer *layer, const int32_t *ids, int E, int k,
                      int64_t T, int64_t H, int64_t R, int with_dropped) {
  dmem m = {ctx, {0}, 0};
  float tok[64], w[8];
  tt_fill_uniform_f32(tok, T * H, 1 + (uint64_t)r, -1, 1);
  tt_fill_uniform_f32(w, T * k, 2 + (uint64_t)r, -1, 1);
  tw_tensor none = tw_tensor_none();
  tw_tensor dtok = put(&m, tok, TW_F32, 2, T, H, 1), dw = put(&m, w, TW_F32, 2, T, k, 1);
  tw_tensor didx = put(&m, ids, TW_I32, 2, T, k, 1);
  tw_tensor recv = put(&m, NULL, TW_F32, 2, R, H, 0), rw = put(&m, NULL, TW_F32, 1, R, 0, 0);
  int nle = E / 2;
  tw_tensor gs = put(&m, NULL, TW_I32, 1, nle, 0, 0), dr = with_dropped ? put(&m, NULL, TW_I32, 1, nle, 0, 0) : none;
  tw_status s = tw_ep_dispatch(ctx, layer, &dtok, &none, &didx, &dw, &recv, &none, &rw, &gs, &dr);
  if (s == TW_OK) s = tw_ctx_check(ctx);
  a->st[r][step] = s;
  snprintf(a->msg[r][step], sizeof a->msg[r][step], "%s", s == TW_OK ? "" : tw_last_error());
  int32_t g[8], d[8];
  get(&m, g, &gs);
  a->gs_sum[r][step] = 0;
  for (int e = 0; step != 2 && e < nle; e++) a->gs_sum[r][step] += g[e]; /* 2: left unwritten (checked below) */
  if (with_dropped) {
    get(&m, d, &dr);
    a->dropped_sum[r] = 0;
    for (int e = 0; e < nle; e++) a->dropped_sum[r] += d[e];
  }
  if (step == 2) {
    unsigned char rb[4 * 16 * 4];
    get(&m, rb, &recv);
    int same = 1;
    for (size_t i = 0; i < sizeof rb; i++) same &= rb[i] == 0xAB;
    for (int e = 0; e < nle; e++) same &= (uint32_t)g[e] == 0xABABABABu;
    a->unwritten[r] = same;
  }
  for (int i = 0; i < m.nb; i++) tw_free(ctx, m.b[i]);
}

static tw_status err2_rank(int r, tw_comm *comm, void *arg) {
  err2_arg *a = (err2_arg *)arg;
  const int E = 8, k = 2;
  const int64_t T = 4, H = 16;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.device = r;
  cc.comm = comm;
  cc.kernel = a->kernel;
  tw_ep *ep = NULL, *small = NULL;
  tw_ep_layer *layer = NULL, *slayer = NULL;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = E; cfg.topk = k; cfg.max_tokens = T; cfg.hidden = H; cfg.token_dtype = TW_F32;
  const int32_t good[8] = {0, 1, 2, 3, 4, 5, 6, 7}, bad[8] = {0, 1, 2, 3, 4, 99, 6, 7};
  if (tw_ctx_create(&ctx, &cc) != TW_OK || tw_ep_create(ctx, comm, &cfg, &ep) != TW_OK ||
      tw_ep_layer_create(ep, &layer) != TW_OK) {
    snprintf(a->fail[r], sizeof a->fail[r], "setup: %s", tw_last_error());
    goto out; /* reported; a peer left in a collective is stopped by the test's timeout */
  }
  const int64_t R = tw_ep_recv_capacity(ep);
  err2_step(a, r, 0, ctx, layer, r == 1 ? bad : good, E, k, T, H, R, 0);
  err2_step(a, r, 1, ctx, layer, good, E, k, T, H, R, 0);
  cfg.recv_capacity = 4;
  if (tw_ep_create(ctx, comm, &cfg, &small) != TW_OK || tw_ep_layer_create(small, &slayer) != TW_OK) {
    snprintf(a->fail[r], sizeof a->fail[r], "setup (capacity 4): %s", tw_last_error());
    goto out;
  }
  err2_step(a, r, 2, ctx, slayer, good, E, k, T, H, 4, 0);
  tw_ep_layer_destroy(slayer);
  tw_ep_destroy(small);
  slayer = NULL;
  small = NULL;
  cfg.overflow = TW_EP_OVERFLOW_DROP;
  if (tw_ep_create(ctx, comm, &cfg, &small) != TW_OK || tw_ep_layer_create(small, &slayer) != TW_OK) {
    snprintf(a->fail[r], sizeof a->fail[r], "setup (drop): %s", tw_last_error());
    goto out;
  }
  err2_step(a, r, 3, ctx, slayer, good, E, k, T, H, 4, 1);
  err2_step(a, r, 4, ctx, layer, good, E, k, T, H, R, 0);
out:
  tw_ep_layer_destroy(slayer);
  tw_ep_destroy(small);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return TW_OK;
}

static void errors_2(const char *kernel) {
  NEED_GPUS(2);
  tw_comm *g[2];
  int devs[2] = {0, 1};
  cr_assert_eq(tw_comm_init_nccl_local(2, devs, g), TW_OK, "%s", tw_last_error());
  err2_arg a;
  memset(&a, 0, sizeof a);
  a.kernel = kernel;
  tt_stall_watch_start(kernel);
  cr_assert_eq(tw_run_ranks(2, g, err2_rank, &a), TW_OK, "%s", tw_last_error());
  tt_stall_watch_stop();
  for (int r = 0; r < 2; r++) {
    tw_comm_destroy(g[r]);
    cr_assert_eq(a.fail[r][0], 0, "%s rank %d: %s", kernel, r, a.fail[r]);
  }
  /* A */
  cr_assert_eq(a.st[0][0], TW_OK, "%s rank 0, clean ids: %s", kernel, a.msg[0][0]);
  cr_assert_eq(a.st[1][0], TW_ERR_DEVICE, "%s rank 1, id 99: status %d", kernel, (int)a.st[1][0]);
  cr_assert(strstr(a.msg[1][0], "topk_idx[2, 1] = 99 is not an expert id"), "%s: %s", kernel, a.msg[1][0]);
  cr_assert_eq(a.gs_sum[0][0] + a.gs_sum[1][0], 15, "%s: the 15 good routes dispatched (got %d)", kernel,
               a.gs_sum[0][0] + a.gs_sum[1][0]);
  /* B, E */
  for (int st = 1; st <= 4; st += 3)
    for (int r = 0; r < 2; r++) {
      cr_assert_eq(a.st[r][st], TW_OK, "%s rank %d, good step %d: %s", kernel, r, st, a.msg[r][st]);
      cr_assert_eq(a.gs_sum[r][st], 8, "%s rank %d, good step %d: %d rows", kernel, r, st, a.gs_sum[r][st]);
    }
  /* C */
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(a.st[r][2], TW_ERR_DEVICE, "%s rank %d, capacity 4: status %d", kernel, r, (int)a.st[r][2]);
    cr_assert(strstr(a.msg[r][2], "needs 8 receive rows") && strstr(a.msg[r][2], "recv_capacity is 4"), "%s: %s",
              kernel, a.msg[r][2]);
    cr_assert(a.unwritten[r], "%s rank %d: an output written by the failed step", kernel, r);
  }
  /* D */
  for (int r = 0; r < 2; r++) cr_assert_eq(a.st[r][3], TW_OK, "%s rank %d, drop: %s", kernel, r, a.msg[r][3]);
  int kept = a.gs_sum[0][3] + a.gs_sum[1][3], dropped = a.dropped_sum[0] + a.dropped_sum[1];
  cr_assert(kept == 8 && dropped == 8, "%s drop policy: %d kept + %d dropped, want 8 + 8", kernel, kept, dropped);
  cr_log_info("EP device errors on 2 GPUs (%s): bad id, capacity (error and drop policies), good steps after", kernel);
}
Test(ep_gpu_2, device_errors_over_nccl) { errors_2("ep_nccl_slots"); }
Test(ep_gpu_2, device_errors_over_nccl_lsa) { errors_2("ep_nccl_lsa"); }

Test(ep_gpu_2, random_cases_ep_size_2_over_nccl) { sweep_gpus(2, "ep_nccl_slots"); }
Test(ep_gpu_2, random_cases_ep_size_2_over_nccl_lsa) { sweep_gpus(2, "ep_nccl_lsa"); }
/* the same sweep with the way back in 3 chunks (see random_cases_loopback_lsa_way_back_in_chunks) */
Test(ep_gpu_2, random_cases_by_source_ep_size_2_over_nccl) {
  by_source = 1;
  sweep_gpus(2, "ep_nccl_slots");
  by_source = 0;
}
Test(ep_gpu_2, random_cases_by_source_ep_size_2_over_nccl_lsa) {
  by_source = 1;
  sweep_gpus(2, "ep_nccl_lsa");
  by_source = 0;
}
Test(ep_gpu_2, random_cases_ep_size_2_over_nccl_lsa_way_back_in_chunks) {
  setenv("TWIN_EP_BACK_CHUNKS", "3", 1);
  sweep_gpus(2, "ep_nccl_lsa");
  unsetenv("TWIN_EP_BACK_CHUNKS");
}
Test(ep_gpu_4, random_cases_ep_size_4_over_nccl) { sweep_gpus(4, "ep_nccl_slots"); }
Test(ep_gpu_4, random_cases_ep_size_4_over_nccl_lsa) { sweep_gpus(4, "ep_nccl_lsa"); }
Test(ep_gpu_4, random_cases_by_source_ep_size_4_over_nccl_lsa) {
  by_source = 1;
  sweep_gpus(4, "ep_nccl_lsa");
  by_source = 0;
}
Test(ep_gpu_8, random_cases_ep_size_8_over_nccl) { sweep_gpus(8, "ep_nccl_slots"); }
Test(ep_gpu_8, random_cases_ep_size_8_over_nccl_lsa) { sweep_gpus(8, "ep_nccl_lsa"); }

/* ep_size 2 and 4 on ONE GPU: the ranks are threads with their own gpu contexts on GPU 0 over
 * the loopback communicator (pipeline/loopback_comm.h: device-to-device copies instead of
 * NCCL, which takes one rank per GPU). It runs every multi-rank path of gpu/ep.cu (gathered
 * counts, every rank's slabs, send bases, receive prefixes, drops across sources) against the
 * ref thread communicator, bit for bit, with the error policy's overflow included. */
static void loop_24(const char *kernel, int N) {
  int failed = 0, errors = 0;
  for (int i = 0; i < N; i++) {
    int n = i % 2 ? 4 : 2;
    scen c;
    scen_make(&c, n, 0xe9400000u + (uint64_t)i);
    char name[128];
    snprintf(name, sizeof name, "loopback %d-rank case %d (E=%d k=%d H=%lld R=%lld %s)", n, i, c.E, c.k, (long long)c.H,
             (long long)c.R, c.policy == TW_EP_OVERFLOW_DROP ? "drop" : "error");
    outs go[MAXR], fo[MAXR];
    for (int r = 0; r < n; r++) {
      outs_alloc(&go[r], &c, r);
      outs_alloc(&fo[r], &c, r);
    }
    tw_comm *g[MAXR], *f[MAXR];
    cr_assert_eq(tw_comm_init_loopback(n, TW_MEM_DEVICE, g), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_comm_init_threads(n, f), TW_OK);
    rank_arg ga = {&c, go, 2, kernel}, fa = {&c, fo, 0, NULL};
    tw_run_ranks(n, g, rank_fn, &ga);
    tw_run_ranks(n, f, rank_fn, &fa);
    errors += fo[0].st != TW_OK;
    for (int r = 0; r < n; r++) {
      int ok = same_outs(&c, r, &go[r], &fo[r], name);
      if (ok && go[r].st != TW_OK) ok = go[r].st == TW_ERR_DEVICE;
      if (ok && fo[r].st == TW_OK) ok = conserved(&c, r, &go[r]);
      failed += !ok;
      outs_free(&go[r]);
      outs_free(&fo[r]);
      tw_comm_destroy(g[r]);
      tw_comm_destroy(f[r]);
    }
    scen_free(&c);
  }
  cr_log_info("EP ep_size 2/4 on one GPU (loopback, %s%s): %d cases (%d capacity errors), %d rank results differ",
              kernel ? kernel : "auto",
              gemm_scales == 1 ? ", scales_gemm_layout" : gemm_scales >= 2 ? ", MXFP8 scales_gemm_layout" : "", N, errors,
              failed);
  cr_assert_eq(failed, 0, "%d rank results of %d loopback cases differ from ref", failed, N);
}

static int sweep_n(void) { return getenv("EP_SWEEP_N") ? atoi(getenv("EP_SWEEP_N")) : 160; }
Test(ep_gpu, random_cases_ep_size_2_and_4_on_one_gpu_loopback) { loop_24(NULL, sweep_n()); }
/* ep_nccl_lsa's kernels with 2 and 4 ranks on one GPU: the windows are cudaMalloc'd and shared
 * by pointer between the rank threads (its loopback test mode); the barriers, row maps, slab
 * stores, expansion and combine slab run as over NVLink, bit for bit against the oracle */
Test(ep_gpu, random_cases_ep_size_2_and_4_on_one_gpu_loopback_lsa_forced) { loop_24("ep_nccl_lsa", sweep_n()); }
/* combine's and dispatch_bwd's way back over ep_nccl_lsa in C chunks of the token side's tokens
 * (lsa_back: a chunk's rows pushed while the previous chunk is summed; the default takes one
 * chunk below 64 MiB of way-back rows, so these small cases force C): C = 2, 3 and 8 (more chunks
 * than some ranks' tokens), and 3 with one push block and one sum block in the steps that do both
 * (their grid-stride loops walked), bit for bit against the oracle */
Test(ep_gpu, random_cases_loopback_lsa_way_back_in_chunks) {
  const char *cs[] = {"2", "3", "8", "3"};
  for (int i = 0; i < 4; i++) {
    setenv("TWIN_EP_BACK_CHUNKS", cs[i], 1);
    if (i == 3) {
      setenv("TWIN_EP_BACK_PUSH_BLOCKS", "1", 1);
      setenv("TWIN_EP_BACK_SUM_BLOCKS", "1", 1);
    }
    loop_24("ep_nccl_lsa", sweep_n() / 4 > 2 ? sweep_n() / 4 : 2);  // both 2 and 4 ranks
  }
  unsetenv("TWIN_EP_BACK_CHUNKS");
  unsetenv("TWIN_EP_BACK_PUSH_BLOCKS");
  unsetenv("TWIN_EP_BACK_SUM_BLOCKS");
}
/* combine_bwd over ep_nccl_lsa with this rank's own routes' rows formed in the push kernel
 * (TWIN_EP_DOUT_OWN=push; at these sizes the default forms them in the rows kernel, the push
 * takes them from 16 (token, rank) items per SM: 4096 tokens and up), bit for bit against the
 * oracle */
Test(ep_gpu, random_cases_loopback_lsa_own_rows_in_push) {
  setenv("TWIN_EP_DOUT_OWN", "push", 1);
  loop_24("ep_nccl_lsa", sweep_n() / 4 > 2 ? sweep_n() / 4 : 2);
  by_source = 1; /* combine_bwd by source's own dots in its push too */
  loop_24("ep_nccl_lsa", sweep_n() / 4 > 2 ? sweep_n() / 4 : 2);
  by_source = 0;
  unsetenv("TWIN_EP_DOUT_OWN");
}
/* bf16 rows wide enough for the warp dot's four-vector loop (combine_bwd: ep_dot_routes on the
 * direct path and the slots staging, lsa_dout_rows): ep_size 1 (auto) and 2 / 4 ranks on one GPU
 * (loopback, both versions), bit for bit */
Test(ep_gpu, random_cases_wide_bf16_rows) {
  wide_rows = 1;
  for (by_source = 0; by_source < 2; by_source++) { /* and combine_bwd by source's dots (row = NULL) */
    random_1(NULL, 40);
    loop_24(NULL, 24);
    loop_24("ep_nccl_lsa", 24); /* LSA at ep_size 1 is left out: a 1-rank NCCL communicator has no window on
                                 * NCCL 2.28.3, and its skip would hide this test's result */
  }
  by_source = 0;
  wide_rows = 0;
}

/* T * k over several counting chunks (up to 12 of 1024 routes), E up to 2048: ep_size 1 and 2 / 4
 * ranks on one GPU (loopback; auto and ep_nccl_lsa forced), bit for bit vs the oracle */
/* cfg.scales_gemm_layout = 1: fp8 1x128 cases whose recv_scales arrive as [H/128, roundup(R, 4)]
 * (tail columns and padding rows included) vs the oracle with the option, bit for bit: ep_size 1
 * (auto: the direct path; ep_nccl_lsa forced) and 2 / 4 ranks on one GPU (loopback, both
 * versions: pack/unpack, LSA push/expand) */
Test(ep_gpu, random_cases_gemm_scales_layout_ep_size_1) {
  gemm_scales = 1;
  random_1(NULL, 120);
  gemm_scales = 0;
}
Test(ep_gpu, random_cases_gemm_scales_layout_ep_size_1_lsa_forced) {
  gemm_scales = 1;
  random_1("ep_nccl_lsa", 60);
  gemm_scales = 0;
}
Test(ep_gpu, random_cases_gemm_scales_layout_2_and_4_on_one_gpu_loopback) {
  gemm_scales = 1;
  loop_24(NULL, 60);
  loop_24("ep_nccl_lsa", 60);
  gemm_scales = 0;
}

/* MXFP8 with cfg.scales_gemm_layout = 1: recv_scales in the grouped GEMM's rowwise MXFP8 layout
 * over the slabs ([128 * T_cap, roundup(H/32, 4)], T(l) from the device's group sizes), compact
 * and swizzled, vs the oracle bit for bit (padding rows and columns, rows past the last block
 * included): ep_size 1 (auto: direct path; ep_nccl_lsa forced) and 2 / 4 loopback ranks */
static int mx_n(void) { return getenv("EP_MX_N") ? atoi(getenv("EP_MX_N")) : 60; } /* fewer under a sanitizer */
Test(ep_gpu, random_cases_mxfp8_gemm_scales_ep_size_1) {
  gemm_scales = 2;
  random_1(NULL, mx_n());
  gemm_scales = 3;
  random_1(NULL, mx_n());
  gemm_scales = 0;
}
Test(ep_gpu, random_cases_mxfp8_gemm_scales_ep_size_1_lsa_forced) {
  gemm_scales = 4;
  random_1("ep_nccl_lsa", mx_n());
  gemm_scales = 0;
}
Test(ep_gpu, random_cases_mxfp8_gemm_scales_2_and_4_on_one_gpu_loopback) {
  gemm_scales = 4;
  loop_24(NULL, mx_n());
  loop_24("ep_nccl_lsa", mx_n());
  gemm_scales = 0;
}

/* Rows by source (tw_ep_dispatch_by_source): src_tokens, src_scales (rows, 1x128 GEMM layout,
 * MXFP8 one-group layout) and recv_row vs the oracle bit for bit, with the weights, group sizes,
 * drops and statuses, and combine / dispatch_bwd / combine_bwd and combine_bwd by source (d_src
 * and its dots) after it: ep_size 1 (the direct
 * path) and 2 / 4 ranks on one GPU (loopback, ep_nccl_slots and ep_nccl_lsa) */
Test(ep_gpu, random_cases_by_source) {
  const int few = getenv("EP_SWEEP_N") != NULL; /* a sanitizer run: EP_SWEEP_N cases each */
  const int n1 = few ? sweep_n() : 200, n2 = few ? sweep_n() : sweep_n() / 2, n3 = few ? sweep_n() : 30;
  by_source = 1;
  random_1(NULL, n1);
  loop_24(NULL, n2);
  loop_24("ep_nccl_lsa", n2);
  gemm_scales = 1;
  random_1(NULL, n3);
  loop_24(NULL, n3);
  loop_24("ep_nccl_lsa", n3);
  gemm_scales = 4;
  random_1(NULL, n3);
  loop_24(NULL, n3);
  loop_24("ep_nccl_lsa", n3);
  gemm_scales = 0;
  by_source = 0;
}

/* Rows by source over ep_nccl_lsa in C chunks of the token index (lsa_src_step: chunk c's source
 * rows written while chunk c + 1 is pushed; the default takes one chunk, so these force C), and
 * combine_bwd by source in the same C chunks (lsa_dsrc_step): C = 2, 3 and 8 (more chunks than some ranks' tokens), and
 * 3 with one push block in the steps that do both (the C = 3 runs with fp8 tokens in the 1x128
 * and the MXFP8 GEMM layouts), bit for bit against the oracle */
Test(ep_gpu, random_cases_by_source_lsa_in_chunks) {
  const char *cs[] = {"2", "3", "8", "3"};
  const int n = sweep_n() / 4 > 2 ? sweep_n() / 4 : 2;
  by_source = 1;
  for (int i = 0; i < 4; i++) {
    setenv("TWIN_EP_SRC_CHUNKS", cs[i], 1);
    setenv("TWIN_EP_DSRC_CHUNKS", cs[i], 1); /* combine_bwd by source in the same chunks (at most 8) */
    if (i == 3) setenv("TWIN_EP_SRC_PUSH_BLOCKS", "1", 1);
    gemm_scales = i == 1 ? 1 : i == 3 ? 4 : 0; /* C = 3: 1x128 GEMM layout; C = 3, one push block: MXFP8 */
    loop_24("ep_nccl_lsa", n);
  }
  gemm_scales = 0;
  by_source = 0;
  unsetenv("TWIN_EP_SRC_CHUNKS");
  unsetenv("TWIN_EP_DSRC_CHUNKS");
  unsetenv("TWIN_EP_SRC_PUSH_BLOCKS");
}

/* MXFP8 dispatch with the swizzled GEMM layout captured once in a CUDA graph; each replay reads
 * new routing, tokens and scales written into the same buffers (so the slab sizes and T(l)
 * change between replays without the host seeing them) and must equal the oracle. */
Test(ep_gpu, graph_capture_mxfp8_gemm_scales) {
  cudaStream_t stream;
  cr_assert_eq(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.stream = stream;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK, "%s", tw_last_error());
  int E = 16, k = 4;
  int64_t T = 160, H = 96, sc = 3;
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = E; cfg.topk = k; cfg.max_tokens = T; cfg.hidden = H; cfg.token_dtype = TW_E4M3;
  cfg.scale_block = 32; cfg.alignment = 8; cfg.scales_gemm_layout = 1; cfg.scales_mxfp8_swizzled = 1;
  int64_t sh[2];
  tw_dtype sdt;
  cr_assert_eq(tw_ep_recv_scales_shape(&cfg, 1, sh, &sdt), TW_OK, "%s", tw_last_error());
  tw_ep *ep;
  tw_ep_layer *layer;
  cr_assert_eq(tw_ep_create(ctx, gcomm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &layer), TW_OK);
  int64_t R = tw_ep_recv_capacity(ep), SB = sh[0] * sh[1];
  dmem m = {ctx, {0}, 0};
  tw_tensor none = tw_tensor_none();
  tw_tensor tok = put(&m, NULL, TW_E4M3, 2, T, H, 0), scl = put(&m, NULL, TW_E8M0, 2, T, sc, 0);
  tw_tensor idx = put(&m, NULL, TW_I32, 2, T, k, 0), w = put(&m, NULL, TW_F32, 2, T, k, 0);
  tw_tensor recv = put(&m, NULL, TW_E4M3, 2, R, H, 0), rscl = put(&m, NULL, TW_E8M0, 2, sh[0], sh[1], 0);
  tw_tensor rw = put(&m, NULL, TW_F32, 1, R, 0, 0), gs = put(&m, NULL, TW_I32, 1, E, 0, 0);
  unsigned char *htok = malloc((size_t)(T * H)), *hscl = malloc((size_t)(T * sc));
  unsigned char *grecv = malloc((size_t)(R * H)), *rrecv = malloc((size_t)(R * H));
  unsigned char *gscl = malloc((size_t)SB), *rscl_h = malloc((size_t)SB);
  int32_t *hidx = malloc((size_t)(T * k) * 4), ggs[16], rgs[16];
  float *hw = malloc((size_t)(T * k) * 4), *rrw = malloc((size_t)R * 4);
  uint64_t st = 4343;
  for (int64_t i = 0; i < T * k; i++) hidx[i] = (int32_t)(i % k);
  cr_assert_eq(tw_tensor_copy(ctx, &idx, &(tw_tensor){hidx, TW_I32, 2, {T, k}, TW_MEM_HOST}), TW_OK);
  cr_assert_eq(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &none), TW_OK, "%s",
               tw_last_error());
  cr_assert_eq(tw_ctx_check(ctx), TW_OK, "%s", tw_last_error());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cr_assert_eq(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  tw_status s1 = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &none);
  cudaError_t ce = cudaStreamEndCapture(stream, &graph);
  cr_assert_eq(s1, TW_OK, "dispatch under capture: %s", tw_last_error());
  cr_assert_eq(ce, cudaSuccess, "end capture: %s", cudaGetErrorString(ce));
  cr_assert_eq(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  int multi = 0;
  for (int rep = 0; rep < 3; rep++) {
    for (int64_t i = 0; i < T * H; i++) htok[i] = (unsigned char)(tt_rand_u64(&st) & 0x7e);
    for (int64_t i = 0; i < T * sc; i++) hscl[i] = (unsigned char)(100 + tt_rand_u64(&st) % 50);
    int lim = rep == 1 ? k : E; /* replay 1 sends every token to experts 0..k-1: slabs of 160 rows */
    for (int64_t t = 0; t < T; t++) {
      int perm[16];
      for (int e = 0; e < E; e++) perm[e] = e;
      for (int j = 0; j < k; j++) {
        int mm = j + (int)(tt_rand_u64(&st) % (uint64_t)(lim - j));
        int tmp = perm[j]; perm[j] = perm[mm]; perm[mm] = tmp;
        hidx[t * k + j] = perm[j];
        hw[t * k + j] = (float)tt_rand_uniform(&st, -1, 1);
      }
    }
    cr_assert_eq(tw_tensor_copy(ctx, &tok, &(tw_tensor){htok, TW_E4M3, 2, {T, H}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &scl, &(tw_tensor){hscl, TW_E8M0, 2, {T, sc}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &idx, &(tw_tensor){hidx, TW_I32, 2, {T, k}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &w, &(tw_tensor){hw, TW_F32, 2, {T, k}, TW_MEM_HOST}), TW_OK);
    cr_assert_eq(tw_memset(ctx, rscl.data, 0xAB, (size_t)SB), TW_OK); /* poison: every byte must be rewritten */
    cr_assert_eq(cudaGraphLaunch(exec, stream), cudaSuccess);
    cr_assert_eq(tw_ctx_check(ctx), TW_OK, "replay %d: %s", rep, tw_last_error());
    cr_assert_eq(tw_tensor_copy(ctx, &(tw_tensor){grecv, TW_E4M3, 2, {R, H}, TW_MEM_HOST}, &recv), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &(tw_tensor){gscl, TW_E8M0, 2, {sh[0], sh[1]}, TW_MEM_HOST}, &rscl), TW_OK);
    cr_assert_eq(tw_tensor_copy(ctx, &(tw_tensor){ggs, TW_I32, 1, {E}, TW_MEM_HOST}, &gs), TW_OK);
    tw_ep *rep_ep;
    tw_ep_layer *rl;
    cr_assert_eq(tw_ep_create(rctx, rcomm, &cfg, &rep_ep), TW_OK);
    cr_assert_eq(tw_ep_layer_create(rep_ep, &rl), TW_OK);
    tw_tensor a = {htok, TW_E4M3, 2, {T, H}, TW_MEM_HOST}, as = {hscl, TW_E8M0, 2, {T, sc}, TW_MEM_HOST};
    tw_tensor b = {hidx, TW_I32, 2, {T, k}, TW_MEM_HOST}, cw = {hw, TW_F32, 2, {T, k}, TW_MEM_HOST};
    tw_tensor d = {rrecv, TW_E4M3, 2, {R, H}, TW_MEM_HOST}, ds = {rscl_h, TW_E8M0, 2, {sh[0], sh[1]}, TW_MEM_HOST};
    tw_tensor e = {rrw, TW_F32, 1, {R}, TW_MEM_HOST}, f = {rgs, TW_I32, 1, {E}, TW_MEM_HOST};
    cr_assert_eq(tw_ep_dispatch(rctx, rl, &a, &as, &b, &cw, &d, &ds, &e, &f, &none), TW_OK, "%s", tw_last_error());
    cr_assert_eq(memcmp(ggs, rgs, sizeof rgs), 0, "replay %d: group_sizes differ from the oracle", rep);
    cr_assert_eq(memcmp(grecv, rrecv, (size_t)(R * H)), 0, "replay %d: recv_tokens differ from the oracle", rep);
    cr_assert_eq(memcmp(gscl, rscl_h, (size_t)SB), 0, "replay %d: MXFP8 recv_scales (swizzled) differ from the oracle",
                 rep);
    for (int l = 0; l < E; l++) multi += rgs[l] > 128;
    tw_ep_layer_destroy(rl);
    tw_ep_destroy(rep_ep);
  }
  cr_assert_gt(multi, 0, "no slab of more than 128 rows was drawn");
  cr_log_info("EP graph (MXFP8, swizzled GEMM scales): dispatch captured once, 3 replays with new routing equal the "
              "oracle (%d slabs > 128 rows)", multi);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (int i = 0; i < m.nb; i++) tw_free(ctx, m.b[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  cudaStreamDestroy(stream);
  free(htok); free(hscl); free(grecv); free(rrecv); free(gscl); free(rscl_h); free(hidx); free(hw); free(rrw);
}

Test(ep_gpu, random_cases_many_chunks) {
  int N = getenv("EP_MANY_N") ? atoi(getenv("EP_MANY_N")) : 60; /* fewer under a sanitizer */
  many_chunks = 1;
  random_1(NULL, N);
  loop_24(NULL, (N + 1) / 2);
  loop_24("ep_nccl_lsa", (N + 1) / 2);
  many_chunks = 0;
}

/* ---- ep_nccl_lsa in a CUDA graph, 2 ranks on one GPU ------------------------------------- */

/* New tokens, ids and weights for an existing scenario (same shapes and buffers). */
static void scen_reroute(scen *c, uint64_t seed) {
  uint64_t st = seed;
  for (int r = 0; r < c->n; r++) {
    int64_t T = c->T[r];
    fill_f(c->tok[r], c->dt, T * c->H, &st);
    for (int64_t t = 0; t < T; t++) {
      int perm[64];
      for (int e = 0; e < c->E; e++) perm[e] = e;
      for (int j = 0; j < c->k; j++) {
        int m = j + (int)(tt_rand_u64(&st) % (uint64_t)(c->E - j));
        int tmp = perm[j]; perm[j] = perm[m]; perm[m] = tmp;
        c->idx[r][t * c->k + j] = perm[j];
      }
    }
    for (int64_t i = 0; i < T * c->k; i++) c->w[r][i] = (float)tt_rand_uniform(&st, -1, 1);
    fill_f(c->y[r], c->ydt, c->R * c->H, &st);
  }
}

enum { NREP = 3 };
typedef struct {
  scen *reps;     /* NREP scenarios: the same shapes, new routing each */
  outs (*fo)[2];  /* the oracle's outputs per replay and rank */
  outs (*fs)[2];  /* the same with a by-source dispatch: combine_bwd by source's d_src and dots */
  int bad[2];
  char msg[2][240];
  /* the ranks' host steps around each replay: neither uploads nor copies back while the other's
   * graph runs (under compute-sanitizer a copy queued behind the other rank's spinning barrier
   * kernel on the shared GPU stalled both until the barrier's timeout) */
  int arrived, broken;
} graph2_arg;
/* meeting m of both ranks (m = 1, 2, ...): waits until both arrived, at most 60 s (a rank that
 * left early breaks the meetings: no hang, the LSA barriers then report the missing rank) */
static void host_meet(graph2_arg *a, int m) {
  __atomic_add_fetch(&a->arrived, 1, __ATOMIC_SEQ_CST);
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (!__atomic_load_n(&a->broken, __ATOMIC_SEQ_CST) && __atomic_load_n(&a->arrived, __ATOMIC_SEQ_CST) < 2 * m) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 60) __atomic_store_n(&a->broken, 1, __ATOMIC_SEQ_CST);
    sched_yield();
  }
}

/* ep_nccl_lsa forced on a loopback rank: rank r's context (on stream, or its own when NULL), EP
 * context and layer for scenario c, and its device buffers b[0..10]: tokens, scales, ids,
 * weights, recv rows, recv scales, recv weights, group sizes, dropped, expert rows, out. */
static tw_status lsa_rank_open(int r, tw_comm *comm, cudaStream_t stream, const scen *c, tw_ctx **ctx, tw_ep **ep,
                               tw_ep_layer **layer, void *b[11]) {
  int nle = c->E / 2, k = c->k;
  int64_t T = c->T[r], R = c->R;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.stream = stream;
  cc.comm = comm;
  cc.kernel = "ep_nccl_lsa";
  TW_TRY(tw_ctx_create(ctx, &cc));
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = k; cfg.max_tokens = c->maxT; cfg.hidden = c->H; cfg.token_dtype = c->dt;
  cfg.scale_block = c->scale_block; cfg.recv_capacity = R; cfg.alignment = c->A; cfg.overflow = c->policy;
  tw_status s = tw_ep_create(*ctx, comm, &cfg, ep);
  if (s == TW_OK) s = tw_ep_layer_create(*ep, layer);
  size_t sz[11] = {tokb(c) * (size_t)T + 16, sclb(c) * (size_t)T + 16, (size_t)(T * k) * 4 + 16,
                   (size_t)(T * k) * 4 + 16, tokb(c) * (size_t)R + 16, sclb(c) * (size_t)R + 16, (size_t)R * 4 + 16,
                   (size_t)nle * 4 + 16, (size_t)nle * 4 + 16, yb(c) * (size_t)R + 16, yb(c) * (size_t)T + 16};
  for (int i = 0; i < 11 && s == TW_OK; i++) s = tw_alloc(*ctx, sz[i], &b[i]);
  return s;
}

/* Rank r's tensors over lsa_rank_open's buffers. */
typedef struct {
  tw_tensor tok, scl, idx, w, recv, rscl, rw, gs, dr, y, out;
} lsa_views;
static lsa_views lsa_rank_views(const scen *c, int r, void *const b[11]) {
  int nle = c->E / 2, k = c->k;
  int64_t T = c->T[r], H = c->H, R = c->R;
  tw_mem D = TW_MEM_DEVICE;
  tw_tensor none = tw_tensor_none();
  lsa_views v;
  v.tok = tw_tensor_2d(b[0], c->dt, T, H, D);
  v.scl = c->scale_block ? tw_tensor_2d(b[1], sdt(c), T, scols(c), D) : none;
  v.idx = tw_tensor_2d(b[2], TW_I32, T, k, D);
  v.w = tw_tensor_2d(b[3], TW_F32, T, k, D);
  v.recv = tw_tensor_2d(b[4], c->dt, R, H, D);
  v.rscl = c->scale_block ? tw_tensor_2d(b[5], sdt(c), R, scols(c), D) : none;
  v.rw = tw_tensor_1d(b[6], TW_F32, R, D);
  v.gs = tw_tensor_1d(b[7], TW_I32, nle, D);
  v.dr = tw_tensor_1d(b[8], TW_I32, nle, D);
  v.y = tw_tensor_2d(b[9], c->ydt, R, H, D);
  v.out = tw_tensor_2d(b[10], c->ydt, T, H, D);
  return v;
}

static tw_status graph2_rank(int r, tw_comm *comm, void *arg) {
  graph2_arg *a = (graph2_arg *)arg;
  const scen *c = &a->reps[0];
  int nle = c->E / 2, k = c->k;
  int64_t T = c->T[r], R = c->R;
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    return tw_error(TW_ERR_CUDA, "stream");
  tw_ctx *ctx = NULL;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  void *b[12] = {0};
  tw_status s = lsa_rank_open(r, comm, stream, c, &ctx, &ep, &layer, b);
  if (!ctx) {
    cudaStreamDestroy(stream);
    return s;
  }
  lsa_views v = lsa_rank_views(c, r, b);
  tw_tensor tok = v.tok, scl = v.scl, idx = v.idx, w = v.w, recv = v.recv, rscl = v.rscl, rw = v.rw, gs = v.gs,
            dr = v.dr, y = v.y, out = v.out;
  /* the backward ops too: d_recv, d_recv_weights, d_tokens, d_topk_weights (dispatch_bwd), d_out,
   * d_expert_out, d_topk_weights (combine_bwd) */
  int64_t H = c->H;
  /* and combine_bwd by source: d_src [2 max_tokens, H], its d_topk_weights */
  const int64_t U = 2 * c->maxT;
  void *e[9] = {0};
  size_t esz[9] = {yb(c) * (size_t)R + 16, (size_t)R * 4 + 16, yb(c) * (size_t)T + 16, (size_t)(T * k) * 4 + 16,
                   yb(c) * (size_t)T + 16, yb(c) * (size_t)R + 16, (size_t)(T * k) * 4 + 16,
                   yb(c) * (size_t)U + 16, (size_t)(T * k) * 4 + 16};
  for (int i = 0; i < 9 && s == TW_OK; i++) s = tw_alloc(ctx, esz[i], &e[i]);
  const int bwd = !getenv("EP_GRAPH_FWD_ONLY"); /* a measuring aid: dispatch -> combine alone */
  tw_mem D = TW_MEM_DEVICE;
  tw_tensor dy = tw_tensor_2d(e[0], c->ydt, R, H, D), rdw = tw_tensor_1d(e[1], TW_F32, R, D),
            dtok = tw_tensor_2d(e[2], c->ydt, T, H, D), dtw = tw_tensor_2d(e[3], TW_F32, T, k, D),
            dout = tw_tensor_2d(e[4], c->ydt, T, H, D), dexp = tw_tensor_2d(e[5], c->ydt, R, H, D),
            dtwc = tw_tensor_2d(e[6], TW_F32, T, k, D), dsrc = tw_tensor_2d(e[7], c->ydt, U, H, D),
            dtws = src_dots(c) ? tw_tensor_2d(e[8], TW_F32, T, k, D) : tw_tensor_none(),
            ys = src_dots(c) ? y : tw_tensor_none();
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  for (int i = -1; i < NREP && s == TW_OK; i++) { /* i = -1: eager step, then capture */
    const scen *ci = &a->reps[i < 0 ? 0 : i];
    cudaMemcpyAsync(b[0], ci->tok[r], tokb(c) * (size_t)T, cudaMemcpyHostToDevice, stream);
    if (c->scale_block) cudaMemcpyAsync(b[1], ci->scl[r], sclb(c) * (size_t)T, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(b[2], ci->idx[r], (size_t)(T * k) * 4, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(b[3], ci->w[r], (size_t)(T * k) * 4, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(b[9], ci->y[r], yb(c) * (size_t)R, cudaMemcpyHostToDevice, stream);
    cudaMemsetAsync(b[4], 0xAB, tokb(c) * (size_t)R, stream);
    cudaMemsetAsync(b[10], 0xAB, yb(c) * (size_t)T, stream);
    if (s == TW_OK) {
      cudaMemcpyAsync(e[0], ci->dy[r], yb(c) * (size_t)R, cudaMemcpyHostToDevice, stream);
      cudaMemcpyAsync(e[1], ci->rdw[r], (size_t)R * 4, cudaMemcpyHostToDevice, stream);
      cudaMemcpyAsync(e[4], ci->dout[r], yb(c) * (size_t)T, cudaMemcpyHostToDevice, stream);
      const int poisoned[6] = {2, 3, 5, 6, 7, 8};
      for (int j = 0; j < 6; j++) cudaMemsetAsync(e[poisoned[j]], 0xAB, esz[poisoned[j]] - 16, stream);
    }
    if (cudaStreamSynchronize(stream) != cudaSuccess) s = tw_error(TW_ERR_CUDA, "upload");
    if (s == TW_OK && i < 0) {
      s = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &dr);
      if (s == TW_OK) s = tw_ep_combine(ctx, layer, &y, &w, &out);
      if (s == TW_OK && bwd) s = tw_ep_dispatch_bwd(ctx, layer, &dy, &rdw, &dtok, &dtw);
      if (s == TW_OK && bwd) s = tw_ep_combine_bwd(ctx, layer, &dout, &w, &y, &dexp, &dtwc);
      if (s == TW_OK && bwd) s = tw_ep_combine_bwd_by_source(ctx, layer, &dout, &ys, &dsrc, &dtws);
      if (s == TW_OK) s = tw_ctx_check(ctx);
      if (s == TW_OK && cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        s = tw_error(TW_ERR_CUDA, "begin capture");
      if (s == TW_OK) {
        tw_status s1 = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &dr);
        if (s1 == TW_OK) s1 = tw_ep_combine(ctx, layer, &y, &w, &out);
        if (s1 == TW_OK && bwd) s1 = tw_ep_dispatch_bwd(ctx, layer, &dy, &rdw, &dtok, &dtw);
        if (s1 == TW_OK && bwd) s1 = tw_ep_combine_bwd(ctx, layer, &dout, &w, &y, &dexp, &dtwc);
        if (s1 == TW_OK && bwd) s1 = tw_ep_combine_bwd_by_source(ctx, layer, &dout, &ys, &dsrc, &dtws);
        cudaError_t ce = cudaStreamEndCapture(stream, &graph);
        s = s1 != TW_OK ? s1 : ce != cudaSuccess ? tw_error(TW_ERR_CUDA, "end capture: %s", cudaGetErrorString(ce)) : TW_OK;
        if (s == TW_OK && cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) s = tw_error(TW_ERR_CUDA, "instantiate");
      }
      continue;
    }
    host_meet(a, 2 * i + 1);
    if (s == TW_OK && cudaGraphLaunch(exec, stream) != cudaSuccess) s = tw_error(TW_ERR_CUDA, "graph launch");
    if (s == TW_OK) s = tw_ctx_check(ctx);
    host_meet(a, 2 * i + 2);
    if (s != TW_OK) break;
    outs *f = &a->fo[i][r], g;
    outs_alloc(&g, c, r);
    cudaMemcpy(g.recv, b[4], tokb(c) * (size_t)R, cudaMemcpyDeviceToHost);
    if (c->scale_block) cudaMemcpy(g.rscl, b[5], sclb(c) * (size_t)R, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.rw, b[6], (size_t)R * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.gs, b[7], (size_t)nle * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dr, b[8], (size_t)nle * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.out, b[10], yb(c) * (size_t)T, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dtok, e[2], yb(c) * (size_t)T, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dtw, e[3], (size_t)(T * k) * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dexp, e[5], yb(c) * (size_t)R, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dtwc, e[6], (size_t)(T * k) * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dsrc, e[7], yb(c) * (size_t)U, cudaMemcpyDeviceToHost);
    cudaMemcpy(g.dtws, e[8], (size_t)(T * k) * 4, cudaMemcpyDeviceToHost);
    const outs *fs = &a->fs[i][r];
    char name[64];
    snprintf(name, sizeof name, "graph replay %d", i);
    int ok = cmp(g.recv, f->recv, tokb(c) * (size_t)R, "recv_tokens", name, r) &&
             cmp(g.rscl, f->rscl, sclb(c) * (size_t)R, "recv_scales", name, r) &&
             cmp(g.rw, f->rw, (size_t)R * 4, "recv_weights", name, r) &&
             cmp(g.gs, f->gs, (size_t)nle * 4, "group_sizes", name, r) &&
             cmp(g.dr, f->dr, (size_t)nle * 4, "dropped", name, r) &&
             cmp(g.out, f->out, yb(c) * (size_t)T, "combine out", name, r) && (!bwd ||
             (cmp(g.dtok, f->dtok, yb(c) * (size_t)T, "d_tokens", name, r) &&
             cmp(g.dtw, f->dtw, (size_t)(T * k) * 4, "d_topk_weights (dispatch_bwd)", name, r) &&
             cmp(g.dexp, f->dexp, yb(c) * (size_t)R, "d_expert_out", name, r) &&
             cmp(g.dtwc, f->dtwc, (size_t)(T * k) * 4, "d_topk_weights (combine_bwd)", name, r) &&
             cmp(g.dsrc, fs->dsrc, yb(c) * (size_t)U, "d_src (combine_bwd by source)", name, r) &&
             (!src_dots(c) ||
              cmp(g.dtws, fs->dtws, (size_t)(T * k) * 4, "d_topk_weights (combine_bwd by source)", name, r))));
    a->bad[r] += !ok;
    outs_free(&g);
  }
  if (s != TW_OK) snprintf(a->msg[r], sizeof a->msg[r], "%s", tw_last_error());
  cudaStreamSynchronize(stream);
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  for (int i = 0; i < 11; i++)
    if (b[i]) tw_free(ctx, b[i]);
  for (int i = 0; i < 9; i++)
    if (e[i]) tw_free(ctx, e[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  cudaStreamDestroy(stream);
  return s;
}

/* dispatch -> combine -> dispatch_bwd -> combine_bwd -> combine_bwd by source of ep_nccl_lsa
 * captured in one CUDA graph per rank (2 ranks as threads on GPU 0, the version's loopback test
 * mode), replayed NREP times with new routing written into the same buffers; each replay's
 * outputs against the oracle (d_src and its dots from the oracle's by-source run of the same
 * routing). The barriers count epochs on the device, so the replays must go on agreeing. */
static void graph_lsa_loopback(int dots) {
  src_dots_force = dots; /* combine_bwd by source with or without its dots */
  scen reps[NREP];
  for (int i = 0; i < NREP; i++) {
    scen_make(&reps[i], 2, 0xe9600003u); /* the same shapes every time */
    reps[i].policy = TW_EP_OVERFLOW_DROP;
    if (i) scen_reroute(&reps[i], 0x7000u + (uint64_t)i);
  }
  outs fo[NREP][2], fs[NREP][2];
  for (int i = 0; i < NREP; i++)
    for (int src = 0; src < 2; src++) {
      tw_comm *f[2];
      cr_assert_eq(tw_comm_init_threads(2, f), TW_OK);
      by_source = src; /* before outs_alloc: the by-source recv buffer has 2 max_tokens rows */
      for (int r = 0; r < 2; r++) outs_alloc(src ? &fs[i][r] : &fo[i][r], &reps[i], r);
      rank_arg fa = {&reps[i], src ? fs[i] : fo[i], 0, NULL};
      cr_assert_eq(tw_run_ranks(2, f, rank_fn, &fa), TW_OK, "ref: %s", tw_last_error());
      by_source = 0;
      tw_comm_destroy(f[0]);
      tw_comm_destroy(f[1]);
    }
  tw_comm *g[2];
  cr_assert_eq(tw_comm_init_loopback(2, TW_MEM_DEVICE, g), TW_OK, "%s", tw_last_error());
  graph2_arg ga;
  memset(&ga, 0, sizeof ga);
  ga.reps = reps;
  ga.fo = fo;
  ga.fs = fs;
  tw_status s = tw_run_ranks(2, g, graph2_rank, &ga);
  cr_assert_eq(s, TW_OK, "rank 0: %s / rank 1: %s", ga.msg[0], ga.msg[1]);
  cr_log_info("EP ep_nccl_lsa graph, 2 ranks on one GPU (E=%d k=%d H=%lld T=%lld,%lld R=%lld %s): %d replays, %d+%d differ",
              reps[0].E, reps[0].k, (long long)reps[0].H, (long long)reps[0].T[0], (long long)reps[0].T[1],
              (long long)reps[0].R, tw_dtype_name(reps[0].dt), NREP, ga.bad[0], ga.bad[1]);
  cr_assert_eq(ga.bad[0] + ga.bad[1], 0, "replays differ from ref");
  for (int i = 0; i < NREP; i++) {
    for (int r = 0; r < 2; r++) {
      outs_free(&fo[i][r]);
      outs_free(&fs[i][r]);
    }
    tw_comm_destroy(i < 2 ? g[i] : NULL);
    scen_free(&reps[i]);
  }
  src_dots_force = -1;
}
Test(ep_gpu, graph_capture_and_replay_lsa_two_ranks_loopback) { graph_lsa_loopback(1); }
/* the same with combine's way back in 3 chunks (the chunk lists built by a kernel and a memset
 * inside the graph, barriers between the steps) */
Test(ep_gpu, graph_capture_and_replay_lsa_way_back_in_chunks) {
  setenv("TWIN_EP_BACK_CHUNKS", "3", 1);
  setenv("TWIN_EP_DSRC_CHUNKS", "3", 1); /* combine_bwd by source's way in too (without its dots) */
  graph_lsa_loopback(0);
  unsetenv("TWIN_EP_BACK_CHUNKS");
  unsetenv("TWIN_EP_DSRC_CHUNKS");
}

/* A rank that does not come to ep_nccl_lsa's barrier (2 ranks on GPU 0, the loopback test mode:
 * rank 1 makes its EP context and then skips the dispatch): rank 0's dispatch waits
 * TWIN_EP_LSA_TIMEOUT_S once and sets GPU_ERR_EP_TIMEOUT naming rank 1; its next dispatch
 * does not wait again and is reported invalid too. */
typedef struct {
  scen *c;
  pthread_barrier_t *bar;
  double wait_s[2];
  char msg[2][400];
} skip_arg;

static tw_status skip_rank(int r, tw_comm *comm, void *arg) {
  skip_arg *a = (skip_arg *)arg;
  const scen *c = a->c;
  int k = c->k;
  int64_t T = c->T[0];
  tw_ctx *ctx = NULL;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  void *b[11] = {0};
  tw_status s = lsa_rank_open(r, comm, NULL, c, &ctx, &ep, &layer, b);
  if (!ctx) {
    pthread_barrier_wait(a->bar); /* the other rank waits there */
    return s;
  }
  if (s == TW_OK && r == 0) {
    lsa_views v = lsa_rank_views(c, r, b);
    cudaMemcpy(b[2], c->idx[0], (size_t)(T * k) * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(b[3], c->w[0], (size_t)(T * k) * 4, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize(); /* the pageable uploads land before the context's stream reads them */
    for (int step = 0; step < 2; step++) {
      struct timespec t0, t1;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      tw_status d = tw_ep_dispatch(ctx, layer, &v.tok, &v.scl, &v.idx, &v.w, &v.recv, &v.rscl, &v.rw, &v.gs, &v.dr);
      tw_status chk = d == TW_OK ? tw_ctx_check(ctx) : d;
      clock_gettime(CLOCK_MONOTONIC, &t1);
      a->wait_s[step] = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
      snprintf(a->msg[step], sizeof a->msg[step], "%s", chk == TW_ERR_DEVICE ? tw_last_error() : "no device error");
    }
  }
  pthread_barrier_wait(a->bar); /* rank 1 keeps its context until rank 0 is done */
  for (int i = 0; i < 11; i++)
    if (b[i]) tw_free(ctx, b[i]);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

Test(ep_gpu, lsa_barrier_timeout_is_reported_and_not_waited_again) {
  NEED_GPUS(1);
  setenv("TWIN_EP_LSA_TIMEOUT_S", "1", 1);
  scen c;
  uint64_t seed = 0xe9600003u;
  scen_make(&c, 2, seed);
  while (c.T[0] == 0) { /* rank 0 needs tokens to dispatch */
    scen_free(&c);
    scen_make(&c, 2, ++seed);
  }
  c.policy = TW_EP_OVERFLOW_DROP;
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, 2);
  tw_comm *g[2];
  cr_assert_eq(tw_comm_init_loopback(2, TW_MEM_DEVICE, g), TW_OK, "%s", tw_last_error());
  skip_arg a;
  memset(&a, 0, sizeof a);
  a.c = &c;
  a.bar = &bar;
  tw_status s = tw_run_ranks(2, g, skip_rank, &a);
  cr_assert_eq(s, TW_OK, "%s", tw_last_error());
  cr_log_info("LSA barrier without rank 1: %.2f s, then %.2f s; '%s' / '%s'", a.wait_s[0], a.wait_s[1], a.msg[0],
              a.msg[1]);
  cr_assert(strstr(a.msg[0], "rank 1 did not reach barrier"), "first dispatch: %s", a.msg[0]);
  cr_assert(a.wait_s[0] >= 0.9, "the first dispatch returned after %.2f s, before the 1 s timeout", a.wait_s[0]);
  cr_assert(strstr(a.msg[1], "an earlier barrier of this EP context"), "second dispatch: %s", a.msg[1]);
  cr_assert(a.wait_s[1] < 0.5, "the second dispatch waited %.2f s again", a.wait_s[1]);
  for (int i = 0; i < 2; i++) tw_comm_destroy(g[i]);
  pthread_barrier_destroy(&bar);
  scen_free(&c);
  unsetenv("TWIN_EP_LSA_TIMEOUT_S");
}

/* ---- one process per GPU (launched by mpirun, or by the test below) ------------------------- */
/* Rank r of n processes: rank, size and device from TWIN_RANK / TWIN_WORLD_SIZE /
 * TWIN_LOCAL_RANK (or mpirun's OMPI_COMM_WORLD_*: tw_comm_env_rank); the NCCL id goes through the
 * file TWIN_COMM_ID_FILE (rank 0 writes it whole by rename, the others wait for it; one host, or
 * a shared file system). Every process draws the same cases, runs the oracle for every rank on
 * threads and its own rank on its GPU over its tw_comm_init_nccl_rank communicator, and checks
 * its rank (outputs bit for bit, tokens conserved), with both EP versions forced. */
Test(ep_gpu_proc, rank_of_one_process_per_gpu, .timeout = 900) {
  if (!getenv("TWIN_EP_CHILD"))
    cr_skip_test("one rank of ep_gpu_proc/one_process_per_gpu (or of `mpirun -np N` with TWIN_EP_CHILD=1 and "
                 "TWIN_COMM_ID_FILE set)");
  int rank, size, local;
  tw_comm *comm = tt_proc_child_comm(MAXR, &rank, &size, &local);
  proc_device = local;
  const char *versions[2] = {"ep_nccl_slots", "ep_nccl_lsa"};
  const int N = getenv("EP_PROC_N") ? atoi(getenv("EP_PROC_N")) : 100;
  int failed = 0, ran = 0;
  for (int v = 0; v < 2; v++) {
    int skipped = 0;
    for (int i = 0; i < N && !skipped; i++) {
      scen c;
      scen_make(&c, size, 0xe9600000u + (uint64_t)i);
      /* a failing rank aborts the NCCL group: the error policy's overflow is the 1-GPU test's */
      if (c.policy == TW_EP_OVERFLOW_ERROR) c.policy = TW_EP_OVERFLOW_DROP;
      char name[160];
      snprintf(name, sizeof name, "%s rank %d of %d processes, case %d (E=%d k=%d H=%lld R=%lld)", versions[v], rank,
               size, i, c.E, c.k, (long long)c.H, (long long)c.R);
      outs go[MAXR], fo[MAXR];
      for (int r = 0; r < size; r++) {
        outs_alloc(&go[r], &c, r);
        outs_alloc(&fo[r], &c, r);
      }
      tw_comm *f[MAXR];
      cr_assert_eq(tw_comm_init_threads(size, f), TW_OK);
      rank_arg fa = {&c, fo, 0, NULL}, ga = {&c, go, 3, versions[v]};
      tw_run_ranks(size, f, rank_fn, &fa);
      tw_status gs = rank_fn(rank, comm, &ga);
      if (gs == TW_ERR_UNSUPPORTED && strstr(go[rank].msg, "cannot run here")) {
        cr_log_info("%s: %s", versions[v], go[rank].msg); /* e.g. no NCCL window on one rank */
        skipped = 1;
      } else {
        cr_assert_eq(gs, TW_OK, "%s: %s", name, go[rank].msg);
        int ok = same_outs(&c, rank, &go[rank], &fo[rank], name);
        if (ok && fo[rank].st == TW_OK) ok = conserved(&c, rank, &go[rank]);
        failed += !ok;
        ran++;
      }
      for (int r = 0; r < size; r++) {
        outs_free(&go[r]);
        outs_free(&fo[r]);
        tw_comm_destroy(f[r]);
      }
      scen_free(&c);
    }
  }
  tw_comm_destroy(comm);
  cr_log_info("EP one process per GPU: rank %d of %d (GPU %d), %d cases run over both versions, %d differ", rank, size,
              local, ran, failed);
  cr_assert_gt(ran, 0, "no case ran");
  cr_assert_eq(failed, 0, "rank %d: %d of %d cases differ from ref", rank, failed, ran);
}

/* Launches one process per visible GPU (up to MAXR) running the test above, as mpirun would,
 * and waits for all of them (600 s, then kills them). On one GPU that is one process: the
 * launch, the id exchange, tw_comm_init_nccl_rank and the per-rank checks at world size 1. */
Test(ep_gpu_proc, one_process_per_gpu, .timeout = 900) {
  int n = tw_gpu_device_count();
  if (n < 1) cr_skip_test("needs a GPU, sees none");
  if (n > MAXR) n = MAXR;
  char dir[64];
  int bad = tt_proc_run(n, "TWIN_EP_CHILD", "ep_gpu_proc/rank_of_one_process_per_gpu", 600, dir);
  tt_proc_cleanup(dir);
  cr_log_info("EP one process per GPU: %d processes, %d failed", n, bad);
  cr_assert_eq(bad, 0, "%d of %d rank processes failed (their output is above)", bad, n);
}
