/* EP dispatch of MXFP8 tokens with cfg.scales_gemm_layout = 1 (tw_ep.h): recv_scales arrive in
 * the grouped GEMM's rowwise MXFP8_1D layout over the slabs (group_sizes = padded_l), compact
 * (cfg.scales_mxfp8_swizzled = 0) or swizzled (1). On thread ranks (ep_size 1, 2, 4), the
 * golden is independent of ref/ep.c's layout code: quantization commutes with dispatch.
 *   x [T, H] f32 per rank --tw_grouped_quantize (MXFP8 rowwise, one group)--> codes + scale rows
 *   --dispatch (fp8, the option)--> recv_tokens, recv_scales (GEMM layout)
 * must equal
 *   x --dispatch (f32, same routing)--> recv_x [R, H] --tw_grouped_quantize (MXFP8 rowwise,
 *   group_sizes = the dispatch's padded_l, the same byte order)--> codes, scale_inv
 * bit for bit: recv_tokens = codes on rows 0 .. O_NLE-1 (quantize leaves the tail rows alone;
 * dispatch zeroes them), recv_scales = scale_inv on rows 0 .. 128*T(NLE)-1 (padding rows and
 * columns 0x00 in both), and rows 128*T(NLE) .. 128*T_cap-1 of recv_scales are 0x00 (quantize
 * leaves them untouched: dispatch's rule, checked against a poisoned buffer). Then
 * tw_grouped_gemm with {recv_tokens, MXFP8_1D, recv_scales, mxfp8_swizzled} and group_sizes
 * equals the GEMM on the re-quantized operand, bit for bit. tw_ep_recv_scales_shape equals
 * tw_quantize_output_shapes' row_scale_inv for M = R, G = NLE. Error cases at the end. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_gemm.h"
#include "twin/tw_quantize.h"

#define MAXR 4
#define NOUT 8 /* the GEMM's N */

static int64_t rup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* out-of-band: rows of a [*, C] E8M0 buffer -> [rows, sc] (the first sc columns) */
static void first_cols(const unsigned char *src, int64_t C, int64_t rows, int64_t sc, unsigned char *dst) {
  for (int64_t i = 0; i < rows; i++) memcpy(dst + i * sc, src + i * C, (size_t)sc);
}

typedef struct {
  int n, E, k, A, swz;
  int64_t H, maxT, R, T[MAXR];
  tw_dtype dt;
  tw_ep_overflow policy;
  float *x[MAXR];
  unsigned char *q[MAXR], *qs[MAXR]; /* codes [T, H], scale rows [T, H/32] */
  int32_t *idx[MAXR];
  float *w[MAXR];
  tw_qtensor qw[MAXR]; /* the rank's experts' weights [NLE * NOUT, H], MXFP8 rowwise swizzled */
  void *qmem[MAXR][2];
  /* fp8 dispatch (GEMM layout) and f32 dispatch */
  unsigned char *recv[MAXR], *rscl[MAXR];
  float *rx[MAXR], *rw[2][MAXR];
  int32_t *gs[2][MAXR], *dr[2][MAXR];
  tw_status st[2][MAXR];
  int64_t srows; /* recv_scales rows: 128 * T_cap */
} mcase;

static int64_t scl_cols(const mcase *c) { return c->H / 32; }
static int64_t scl_pad(const mcase *c) { return rup(c->H / 32, 4); }

static void quantize(tw_ctx *ctx, const float *x, int64_t M, int64_t K, const int32_t *g, int G, int swz,
                     tw_dtype qdt, tw_qtensor *q, void *mem[2]) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = TW_SCALE_MXFP8_1D;
  o.qdtype = qdt;
  o.layout = TW_ROWWISE;
  o.mxfp8_swizzled = swz;
  cr_assert_eq(tw_quantize_output_shapes(&o, M, K, G, q), TW_OK, "%s", tw_last_error());
  tw_tensor *parts[2] = {&q->row_data, &q->row_scale_inv};
  for (int i = 0; i < 2; i++) {
    size_t b = tw_tensor_bytes(parts[i]);
    mem[i] = malloc(b + 4);
    memset(mem[i], 0xC3, b); /* poison: quantize leaves the tail rows and past-the-groups scales alone */
    parts[i]->data = mem[i];
    parts[i]->mem = TW_MEM_HOST;
  }
  q->amax = tw_tensor_none();
  tw_tensor tx = tw_tensor_2d((void *)x, TW_F32, M, K, TW_MEM_HOST), tg = tw_tensor_1d((void *)g, TW_I32, G, TW_MEM_HOST);
  cr_assert_eq(tw_grouped_quantize(ctx, &tx, &tg, &o, q), TW_OK, "%s", tw_last_error());
}

static void make(mcase *c, int n, uint64_t seed) {
  uint64_t st = seed;
  memset(c, 0, sizeof *c);
  c->n = n;
  static const int Es[] = {1, 2, 3, 4, 6, 8, 12, 16};
  do c->E = Es[tt_rand_u64(&st) % 8]; while (c->E % n);
  c->k = 1 + (int)(tt_rand_u64(&st) % (uint64_t)(c->E < 4 ? c->E : 4));
  c->dt = (tt_rand_u64(&st) & 1) ? TW_E4M3 : TW_E5M2;
  c->swz = (int)(tt_rand_u64(&st) & 1);
  c->H = 32 * (1 + (int64_t)(tt_rand_u64(&st) % 6)); /* H/32 = 1..6: padding columns when not % 4 */
  static const int As[] = {1, 1, 2, 4, 8, 16};
  c->A = As[tt_rand_u64(&st) % 6];
  c->maxT = 1 + (int64_t)(tt_rand_u64(&st) % (tt_rand_u64(&st) % 3 ? 40 : 200)); /* some slabs > 128 rows */
  for (int r = 0; r < n; r++) c->T[r] = (int64_t)(tt_rand_u64(&st) % (uint64_t)(c->maxT + 1));
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = c->maxT; cfg.alignment = c->A;
  int64_t nodrop = tw_ep_capacity_no_drop(&cfg, n);
  int p = (int)(tt_rand_u64(&st) % 6); /* 0..2 no-drop capacity, 3..4 drop, 5 error policy with a small R */
  c->policy = p == 3 || p == 4 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  c->R = p >= 3 ? c->A * (1 + (int64_t)(tt_rand_u64(&st) % (uint64_t)(nodrop / c->A / 2 + 1))) : nodrop;
  int nle = c->E / n;
  int64_t g = nle < c->R ? nle : c->R;
  c->srows = 128 * ((c->R + 127 * g) / 128);
  for (int r = 0; r < n; r++) {
    int64_t T = c->T[r], H = c->H;
    c->x[r] = malloc((size_t)(T * H) * 4 + 4);
    for (int64_t b = 0; b < T * H / 32; b++) { /* blocks of 32 with their own magnitude, 1 in 16 all zero */
      uint64_t u = tt_rand_u64(&st);
      int zero = u % 16 == 0, ex = (int)(u / 16 % 17) - 8;
      for (int64_t i = 32 * b; i < 32 * b + 32; i++)
        c->x[r][i] = zero ? 0.0f : (float)tt_rand_uniform(&st, -1, 1) * ldexpf(1.0f, ex);
    }
    /* the tokens: x quantized as one group, compact; the scale rows are the first H/32 columns */
    int32_t one = (int32_t)T;
    tw_qtensor qx;
    void *mem[2];
    quantize(tt_ref_ctx(), c->x[r], T, H, &one, 1, 0, c->dt, &qx, mem);
    c->q[r] = malloc((size_t)(T * H) + 1);
    memcpy(c->q[r], mem[0], (size_t)(T * H));
    c->qs[r] = malloc((size_t)(T * scl_cols(c)) + 1);
    first_cols(mem[1], scl_pad(c), T, scl_cols(c), c->qs[r]);
    free(mem[0]);
    free(mem[1]);
    c->idx[r] = malloc((size_t)(T * c->k) * 4 + 4);
    c->w[r] = malloc((size_t)(T * c->k) * 4 + 4);
    for (int64_t t = 0; t < T; t++) {
      int perm[16];
      for (int e = 0; e < c->E; e++) perm[e] = e;
      for (int j = 0; j < c->k; j++) {
        int m = j + (int)(tt_rand_u64(&st) % (uint64_t)(c->E - j));
        int tmp = perm[j]; perm[j] = perm[m]; perm[m] = tmp;
        c->idx[r][t * c->k + j] = perm[j];
      }
    }
    for (int64_t i = 0; i < T * c->k; i++) c->w[r][i] = (float)tt_rand_uniform(&st, -1, 1);
    /* weights [NLE * NOUT, H] in uniform groups of NOUT, e4m3 (e5m2 x e5m2 is no GEMM) */
    float *wx = malloc((size_t)(nle * NOUT * H) * 4 + 4);
    tt_fill_uniform_f32(wx, nle * NOUT * H, 0x5eed + (uint64_t)r, -1, 1);
    int32_t *wg = malloc((size_t)nle * 4);
    for (int l = 0; l < nle; l++) wg[l] = NOUT;
    quantize(tt_ref_ctx(), wx, (int64_t)nle * NOUT, H, wg, nle, 1, TW_E4M3, &c->qw[r], c->qmem[r]);
    free(wx);
    free(wg);
    c->recv[r] = malloc((size_t)(c->R * H) + 1);
    memset(c->recv[r], 0xA5, (size_t)(c->R * H));
    c->rscl[r] = malloc((size_t)(c->srows * scl_pad(c)) + 1);
    memset(c->rscl[r], 0xA5, (size_t)(c->srows * scl_pad(c))); /* poison: every byte must be written */
    c->rx[r] = malloc((size_t)(c->R * H) * 4 + 4);
    for (int L = 0; L < 2; L++) {
      c->rw[L][r] = malloc((size_t)c->R * 4 + 4);
      c->gs[L][r] = malloc((size_t)nle * 4);
      c->dr[L][r] = malloc((size_t)nle * 4);
    }
  }
}

static void release(mcase *c) {
  for (int r = 0; r < c->n; r++) {
    free(c->x[r]); free(c->q[r]); free(c->qs[r]); free(c->idx[r]); free(c->w[r]);
    free(c->qmem[r][0]); free(c->qmem[r][1]);
    free(c->recv[r]); free(c->rscl[r]); free(c->rx[r]);
    for (int L = 0; L < 2; L++) { free(c->rw[L][r]); free(c->gs[L][r]); free(c->dr[L][r]); }
  }
}

/* L = 0: fp8 tokens with the option; L = 1: the f32 tokens x on the same routing */
static tw_status rank_fn(int r, tw_comm *comm, void *arg) {
  mcase *c = arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  int nle = c->E / c->n;
  int64_t T = c->T[r], H = c->H, R = c->R, k = c->k;
  tw_status s = TW_OK;
  for (int L = 0; L < 2 && s == TW_OK; L++) {
    tw_ep_config cfg = TW_EP_CONFIG_INIT;
    cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = c->maxT; cfg.hidden = H;
    cfg.token_dtype = L ? TW_F32 : c->dt; cfg.scale_block = L ? 0 : 32;
    cfg.recv_capacity = R; cfg.alignment = c->A; cfg.overflow = c->policy;
    cfg.scales_gemm_layout = !L;
    cfg.scales_mxfp8_swizzled = L ? 0 : c->swz;
    tw_ep *ep = NULL;
    tw_ep_layer *layer = NULL;
    s = tw_ep_create(ctx, comm, &cfg, &ep);
    if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
    tw_tensor tok = L ? tw_tensor_2d(c->x[r], TW_F32, T, H, TW_MEM_HOST) : tw_tensor_2d(c->q[r], c->dt, T, H, TW_MEM_HOST);
    tw_tensor scl = L ? tw_tensor_none() : tw_tensor_2d(c->qs[r], TW_E8M0, T, scl_cols(c), TW_MEM_HOST);
    tw_tensor idx = tw_tensor_2d(c->idx[r], TW_I32, T, k, TW_MEM_HOST), w = tw_tensor_2d(c->w[r], TW_F32, T, k, TW_MEM_HOST);
    tw_tensor recv = L ? tw_tensor_2d(c->rx[r], TW_F32, R, H, TW_MEM_HOST) : tw_tensor_2d(c->recv[r], c->dt, R, H, TW_MEM_HOST);
    tw_tensor rscl = L ? tw_tensor_none() : tw_tensor_2d(c->rscl[r], TW_E8M0, c->srows, scl_pad(c), TW_MEM_HOST);
    tw_tensor rw = tw_tensor_1d(c->rw[L][r], TW_F32, R, TW_MEM_HOST);
    tw_tensor gs = tw_tensor_1d(c->gs[L][r], TW_I32, nle, TW_MEM_HOST), dr = tw_tensor_1d(c->dr[L][r], TW_I32, nle, TW_MEM_HOST);
    if (s == TW_OK) {
      c->st[L][r] = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &dr);
      if (c->st[L][r] != TW_OK) tw_clear_error();
    }
    tw_ep_layer_destroy(layer);
    tw_ep_destroy(ep);
  }
  tw_ctx_destroy(ctx);
  return s;
}

#define BAD(...) do { cr_log_error(__VA_ARGS__); ok = 0; goto done; } while (0)

static tw_status gemm(const mcase *c, int r, const tw_operand *lhs, int32_t *gs, float *out) {
  int nle = c->E / c->n;
  tw_operand rhs = tw_operand_rowwise(&c->qw[r]);
  tw_tensor tg = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST), to = tw_tensor_2d(out, TW_F32, c->R, NOUT, TW_MEM_HOST);
  return tw_grouped_gemm(tt_ref_ctx(), lhs, &rhs, TW_OP_T, &tg, &to, 0);
}

/* counters of what the cases covered */
static int n_multi_tile, n_pad_rows, n_past, n_pad_cols, n_empty;

static int check_rank(const mcase *c, int r, const char *name) {
  int nle = c->E / c->n, ok = 1;
  int64_t R = c->R, H = c->H, C = scl_pad(c), S = 0, tiles = 0;
  tw_qtensor q;
  void *mem[2] = {NULL, NULL};
  float *o1 = NULL, *o2 = NULL;
  if (c->st[0][r] != c->st[1][r])
    BAD("%s rank %d: fp8 dispatch %s, f32 dispatch %s", name, r, tw_status_name(c->st[0][r]), tw_status_name(c->st[1][r]));
  if (c->st[0][r] != TW_OK) return 1; /* the same capacity error */
  if (memcmp(c->gs[0][r], c->gs[1][r], (size_t)nle * 4) || memcmp(c->dr[0][r], c->dr[1][r], (size_t)nle * 4) ||
      memcmp(c->rw[0][r], c->rw[1][r], (size_t)R * 4))
    BAD("%s rank %d: group_sizes, dropped or recv_weights differ between the fp8 and f32 dispatch", name, r);
  for (int l = 0; l < nle; l++) {
    int64_t m = c->gs[0][r][l];
    S += m;
    tiles += (m + 127) / 128;
    n_multi_tile += m > 128;
    n_pad_rows += m % 128 != 0;
    n_empty += m == 0;
  }
  n_past += 128 * tiles < c->srows;
  n_pad_cols += C != scl_cols(c);
  quantize(tt_ref_ctx(), c->rx[r], R, H, c->gs[0][r], nle, c->swz, c->dt, &q, mem);
  if (q.row_scale_inv.shape[0] != c->srows || q.row_scale_inv.shape[1] != C)
    BAD("%s rank %d: quantize's scale shape [%lld, %lld], the EP's [%lld, %lld]", name, r,
        (long long)q.row_scale_inv.shape[0], (long long)q.row_scale_inv.shape[1], (long long)c->srows, (long long)C);
  const unsigned char *qd = mem[0], *qsc = mem[1];
  for (int64_t i = 0; i < S * H; i++)
    if (c->recv[r][i] != qd[i])
      BAD("%s rank %d: recv_tokens[%lld][%lld] = 0x%02x, re-quantized 0x%02x", name, r, (long long)(i / H),
          (long long)(i % H), c->recv[r][i], qd[i]);
  for (int64_t i = S * H; i < R * H; i++)
    if (c->recv[r][i]) BAD("%s rank %d: tail row %lld of recv_tokens is not 0", name, r, (long long)(i / H));
  for (int64_t i = 0; i < 128 * tiles * C; i++)
    if (c->rscl[r][i] != qsc[i])
      BAD("%s rank %d: recv_scales byte %lld (%s) = 0x%02x, re-quantized 0x%02x", name, r, (long long)i,
          c->swz ? "swizzled" : "compact", c->rscl[r][i], qsc[i]);
  for (int64_t i = 128 * tiles * C; i < c->srows * C; i++)
    if (c->rscl[r][i] != 0 || qsc[i] != 0xC3)
      BAD("%s rank %d: past the last slab's block, byte %lld: dispatch 0x%02x (want 0x00), quantize 0x%02x (want "
          "untouched 0xC3)",
          name, r, (long long)i, c->rscl[r][i], qsc[i]);
  /* straight into the GEMM, against the GEMM on the re-quantized operand */
  o1 = malloc((size_t)(R * NOUT) * 4 + 4);
  o2 = malloc((size_t)(R * NOUT) * 4 + 4);
  memset(o1, 0x5A, (size_t)(R * NOUT) * 4);
  memset(o2, 0x5A, (size_t)(R * NOUT) * 4);
  tw_operand lhs;
  memset(&lhs, 0, sizeof lhs);
  lhs.data = tw_tensor_2d(c->recv[r], c->dt, R, H, TW_MEM_HOST);
  lhs.mode = TW_SCALE_MXFP8_1D;
  lhs.scale_inv = tw_tensor_2d(c->rscl[r], TW_E8M0, c->srows, C, TW_MEM_HOST);
  lhs.mxfp8_swizzled = c->swz;
  lhs.src_rows = R;
  lhs.src_cols = H;
  tw_operand lq = tw_operand_rowwise(&q);
  tw_status s1 = gemm(c, r, &lhs, c->gs[0][r], o1), s2 = gemm(c, r, &lq, c->gs[0][r], o2);
  if (s1 != TW_OK || s2 != TW_OK) BAD("%s rank %d: grouped GEMM %s / %s: %s", name, r, tw_status_name(s1), tw_status_name(s2), tw_last_error());
  if (memcmp(o1, o2, (size_t)(S * NOUT) * 4))
    BAD("%s rank %d: the grouped GEMM on the dispatched operand differs from the one on the re-quantized operand", name, r);
done:
  free(mem[0]); free(mem[1]); free(o1); free(o2);
  return ok;
}

Test(ep_gemm_scales_mxfp8, random_cases_equal_requantized_received_rows_and_grouped_gemm) {
  const int N = 96;
  int failed = 0, errors = 0, drops = 0, swz = 0;
  for (int i = 0; i < N; i++) {
    int n = i % 3 == 0 ? 1 : i % 3 == 1 ? 2 : 4;
    mcase c;
    make(&c, n, 0xe5d0000u + (uint64_t)i);
    char name[200];
    snprintf(name, sizeof name, "case %d (n=%d E=%d k=%d H=%lld A=%d R=%lld %s %s %s)", i, n, c.E, c.k, (long long)c.H,
             c.A, (long long)c.R, tw_dtype_name(c.dt), c.swz ? "swizzled" : "compact",
             c.policy == TW_EP_OVERFLOW_DROP ? "drop" : "error");
    /* the shape function against tw_quantize_output_shapes for M = R, G = NLE */
    tw_ep_config cfg = TW_EP_CONFIG_INIT;
    cfg.num_experts = c.E; cfg.topk = c.k; cfg.max_tokens = c.maxT; cfg.hidden = c.H; cfg.token_dtype = c.dt;
    cfg.scale_block = 32; cfg.recv_capacity = c.R; cfg.alignment = c.A; cfg.scales_gemm_layout = 1;
    cfg.scales_mxfp8_swizzled = c.swz;
    int64_t sh[2];
    tw_dtype sdt;
    cr_assert_eq(tw_ep_recv_scales_shape(&cfg, n, sh, &sdt), TW_OK, "%s", tw_last_error());
    cr_assert(sh[0] == c.srows && sh[1] == scl_pad(&c) && sdt == TW_E8M0, "%s: tw_ep_recv_scales_shape [%lld, %lld]",
              name, (long long)sh[0], (long long)sh[1]);
    tw_comm *comms[MAXR];
    cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
    tw_status s = tw_run_ranks(n, comms, rank_fn, &c);
    cr_assert_eq(s, TW_OK, "%s: %s", name, tw_last_error());
    for (int r = 0; r < n; r++) {
      failed += !check_rank(&c, r, name);
      if (c.st[0][r] == TW_OK)
        for (int l = 0; l < c.E / n; l++) drops += c.dr[0][r][l] > 0;
      tw_comm_destroy(comms[r]);
    }
    errors += c.st[0][0] != TW_OK;
    swz += c.swz;
    release(&c);
  }
  cr_log_info("EP MXFP8 scales_gemm_layout: %d cases (%d swizzled, %d capacity errors, %d experts with drops); slabs: "
              "%d of > 128 rows, %d with padding rows in their block, %d empty; %d ranks with rows past the last "
              "block, %d with padding columns; %d rank results differ",
              N, swz, errors, drops, n_multi_tile, n_pad_rows, n_empty, n_past, n_pad_cols, failed);
  cr_assert_eq(failed, 0, "%d rank results differ", failed);
  cr_assert(errors > 0 && drops > 0 && swz > 0 && swz < N, "errors %d drops %d swizzled %d", errors, drops, swz);
  cr_assert(n_multi_tile > 0 && n_past > 0 && n_pad_cols > 0 && n_empty > 0, "a layout feature was not drawn");
}

/* ---- errors ------------------------------------------------------------------------------ */
static tw_ep_config mx_cfg(void) {
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = 4; cfg.topk = 2; cfg.max_tokens = 3; cfg.hidden = 64; cfg.token_dtype = TW_E4M3;
  cfg.scale_block = 32; cfg.recv_capacity = 6; cfg.scales_gemm_layout = 1; cfg.scales_mxfp8_swizzled = 1;
  return cfg;
}

Test(ep_gemm_scales_mxfp8, bad_combinations_are_named) {
  tw_comm *comm;
  cr_assert_eq(tw_comm_init_threads(1, &comm), TW_OK);
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK);
  tw_ep *ep = NULL;
  size_t ws, ls;
  int64_t sh[2];
  tw_dtype sdt;
  tw_ep_config cfg = mx_cfg();
  cfg.token_dtype = TW_BF16; /* the option with bf16 tokens */
  cfg.scale_block = 0;
  cfg.scales_mxfp8_swizzled = 0;
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG, "is for fp8 tokens only (token_dtype bf16)");
  cr_expect_null(ep);
  cfg = mx_cfg();
  cfg.scale_block = 64; /* neither 1x128 nor MXFP8 */
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG,
                   "fp8 tokens need scale_block 128 (1x128) or 32 (MXFP8), got 64");
  cfg = mx_cfg();
  cfg.scales_gemm_layout = 3; /* unknown option value */
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG, "scales_gemm_layout = 3 must be 0");
  cfg = mx_cfg();
  cfg.scales_mxfp8_swizzled = 2;
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG, "scales_mxfp8_swizzled = 2 must be 0");
  cfg = mx_cfg();
  cfg.scales_gemm_layout = 0; /* swizzled without the GEMM layout */
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG,
                   "scales_mxfp8_swizzled = 1 needs MXFP8 tokens (scale_block 32, got 32) with scales_gemm_layout = 1 (got 0)");
  cfg = mx_cfg();
  cfg.scale_block = 128;
  cfg.hidden = 128; /* swizzled with 1x128 */
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG,
                   "needs MXFP8 tokens (scale_block 32, got 128) with scales_gemm_layout = 1 (got 1)");
  tt_expect_status(tw_ep_workspace_bytes(&cfg, 1, &ws, &ls), TW_ERR_INVALID_ARG, "scales_mxfp8_swizzled = 1 needs");
  tt_expect_status(tw_ep_recv_scales_shape(&cfg, 1, sh, &sdt), TW_ERR_INVALID_ARG, "scales_mxfp8_swizzled = 1 needs");
  cfg = mx_cfg();
  cfg.token_dtype = TW_F32;
  cfg.scale_block = 0;
  cfg.scales_gemm_layout = 0;
  cfg.scales_mxfp8_swizzled = 0;
  tt_expect_status(tw_ep_recv_scales_shape(&cfg, 1, sh, &sdt), TW_ERR_INVALID_ARG, "f32 tokens have no recv_scales");
  /* the shapes: rows, 1x128 GEMM, MXFP8 GEMM (R 6, NLE 4: T_cap = (6 + 127 * 4) / 128 = 4) */
  cfg = mx_cfg();
  cr_assert_eq(tw_ep_recv_scales_shape(&cfg, 1, sh, &sdt), TW_OK, "%s", tw_last_error());
  cr_expect(sh[0] == 512 && sh[1] == 4 && sdt == TW_E8M0, "[%lld, %lld]", (long long)sh[0], (long long)sh[1]);
  cfg.scales_gemm_layout = 0;
  cfg.scales_mxfp8_swizzled = 0;
  cr_assert_eq(tw_ep_recv_scales_shape(&cfg, 1, sh, &sdt), TW_OK, "%s", tw_last_error());
  cr_expect(sh[0] == 6 && sh[1] == 2 && sdt == TW_E8M0, "[%lld, %lld]", (long long)sh[0], (long long)sh[1]);
  cfg.scale_block = 128;
  cfg.hidden = 256;
  cfg.scales_gemm_layout = 1;
  cr_assert_eq(tw_ep_recv_scales_shape(&cfg, 1, sh, &sdt), TW_OK, "%s", tw_last_error());
  cr_expect(sh[0] == 2 && sh[1] == 8 && sdt == TW_F32, "[%lld, %lld]", (long long)sh[0], (long long)sh[1]);
  /* a wrong recv_scales shape names the expected one and the formula */
  cfg = mx_cfg();
  tw_ep_layer *layer;
  cr_assert_eq(tw_ep_create(ctx, comm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &layer), TW_OK);
  unsigned char tokb[3 * 64] = {0}, sclb[3 * 2] = {127, 127, 127, 127, 127, 127}, recvb[6 * 64], rsb[512 * 4];
  float rwb[6], wb[6] = {1, 1, 1, 1, 1, 1};
  int32_t idxb[6] = {0, 1, 2, 3, 1, 2}, gsb[4];
  tw_tensor tok = tw_tensor_2d(tokb, TW_E4M3, 3, 64, TW_MEM_HOST), scl = tw_tensor_2d(sclb, TW_E8M0, 3, 2, TW_MEM_HOST);
  tw_tensor idx = tw_tensor_2d(idxb, TW_I32, 3, 2, TW_MEM_HOST), w = tw_tensor_2d(wb, TW_F32, 3, 2, TW_MEM_HOST);
  tw_tensor recv = tw_tensor_2d(recvb, TW_E4M3, 6, 64, TW_MEM_HOST), rw = tw_tensor_1d(rwb, TW_F32, 6, TW_MEM_HOST);
  tw_tensor gs = tw_tensor_1d(gsb, TW_I32, 4, TW_MEM_HOST), none = tw_tensor_none();
  tw_tensor rows = tw_tensor_2d(rsb, TW_E8M0, 6, 2, TW_MEM_HOST), short_ = tw_tensor_2d(rsb, TW_E8M0, 384, 4, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rows, &rw, &gs, &none), TW_ERR_SHAPE,
                   "recv_scales is [6, 2], expected [512, 4] = [128 * T_cap, roundup(H/32, 4)]");
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &short_, &rw, &gs, &none), TW_ERR_SHAPE,
                   "with R = 6, NLE = 4");
  tw_tensor f32 = tw_tensor_2d(rsb, TW_F32, 512, 1, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &f32, &rw, &gs, &none), TW_ERR_SHAPE,
                   "recv_scales");
  /* the right one: experts 0..3 get 1, 2, 2, 1 rows: four blocks of 128 rows, swizzled */
  memset(rsb, 0xA5, sizeof rsb);
  sclb[2] = 100; sclb[3] = 101; /* token 1 (experts 2 and 3) */
  tw_tensor good = tw_tensor_2d(rsb, TW_E8M0, 512, 4, TW_MEM_HOST);
  cr_assert_eq(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &good, &rw, &gs, &none), TW_OK, "%s",
               tw_last_error());
  cr_expect(gsb[0] == 1 && gsb[1] == 2 && gsb[2] == 2 && gsb[3] == 1);
  /* expert 3's block starts at byte 3 * 128 * 4; its row 0 is token 1: (0, c) at c (swizzled: d = b = a = e = 0),
   * columns 2, 3 are padding */
  cr_expect(rsb[3 * 512 + 0] == 100 && rsb[3 * 512 + 1] == 101 && rsb[3 * 512 + 2] == 0 && rsb[3 * 512 + 3] == 0,
            "expert 3 row 0: %d %d %d %d", rsb[1536], rsb[1537], rsb[1538], rsb[1539]);
  /* expert 2: row 0 token 1, row 1 token 2 (r = 1 -> d = 1 -> byte 16 of its block) */
  cr_expect(rsb[2 * 512 + 0] == 100 && rsb[2 * 512 + 1] == 101, "expert 2 row 0");
  cr_expect(rsb[2 * 512 + 16] == 127 && rsb[2 * 512 + 17] == 127, "expert 2 row 1");
  int nz = 0;
  for (int i = 0; i < 512 * 4; i++) nz += rsb[i] != 0;
  cr_expect_eq(nz, 6 * 2, "%d non-zero bytes, expected the 6 rows' 2 scales (no poison left)", nz);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
}
