/* EP dispatch of fp8 1x128 tokens with cfg.scales_gemm_layout = 1 (tw_ep.h): recv_scales
 * arrive as [H/128, roundup(R, 4)] f32, the grouped GEMM's rowwise BLOCK_1x128 layout.
 * On thread ranks (ep_size 1, 2, 4), against the same dispatch in the row layout:
 *   - recv_scales (gemm) [b][i] == recv_scales (rows) [i][b] bit for bit for every row i < R
 *     (padding rows and rows past the slabs included: 0 in both), the tail columns
 *     R .. roundup(R, 4)-1 are 0, and the other outputs are the same bytes;
 *   - tw_grouped_gemm on (recv_tokens, recv_scales) as a rowwise 1x128 operand, with the
 *     dispatch's group_sizes and the rank's 1x128 expert weights, equals the same GEMM with the
 *     row layout's scales transposed by hand, bit for bit;
 *   - a wrong recv_scales shape is TW_ERR_SHAPE naming the expected [H/128, roundup(R, 4)];
 *     non-fp8 tokens with it TW_ERR_INVALID_ARG (MXFP8 with the option: ep_gemm_scales_mxfp8_test.c). */
#include <criterion/criterion.h>
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

typedef struct {
  int n, E, k, A;
  int64_t H, maxT, R, T[MAXR];
  tw_dtype dt;
  tw_ep_overflow policy;
  unsigned char *tok[MAXR];
  float *scl[MAXR];
  int32_t *idx[MAXR];
  float *w[MAXR];
  /* the rank's experts' weights [NLE * NOUT, H], quantized 1x128 rowwise (uniform groups) */
  tw_qtensor qw[MAXR];
  void *qmem[MAXR][2];
  /* per layout (0 rows, 1 gemm) and rank */
  unsigned char *recv[2][MAXR];
  float *rscl[2][MAXR], *rw[2][MAXR], *out[2][MAXR];
  int32_t *gs[2][MAXR], *dr[2][MAXR];
  tw_status st[2][MAXR];
  char msg[MAXR][240];
} scase;

static int64_t cols(const scase *c) { return c->H / 128; }
static int64_t rpad(const scase *c) { return rup(c->R, 4); }

static void quantize_weights(scase *c, int r) {
  int nle = c->E / c->n;
  int64_t rows = (int64_t)nle * NOUT;
  float *x = malloc((size_t)(rows * c->H) * 4 + 4);
  tt_fill_uniform_f32(x, rows * c->H, 0x5eed + (uint64_t)r, -1, 1);
  int32_t *g = malloc((size_t)nle * 4);
  for (int l = 0; l < nle; l++) g[l] = NOUT;
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = TW_SCALE_BLOCK_1x128;
  o.qdtype = TW_E4M3;
  o.layout = TW_ROWWISE;
  tw_qtensor *q = &c->qw[r];
  cr_assert_eq(tw_quantize_output_shapes(&o, rows, c->H, nle, q), TW_OK, "%s", tw_last_error());
  tw_tensor *parts[2] = {&q->row_data, &q->row_scale_inv};
  for (int i = 0; i < 2; i++) {
    c->qmem[r][i] = malloc(tw_tensor_bytes(parts[i]) + 4);
    parts[i]->data = c->qmem[r][i];
    parts[i]->mem = TW_MEM_HOST;
  }
  q->amax = tw_tensor_none();
  tw_tensor tx = tw_tensor_2d(x, TW_F32, rows, c->H, TW_MEM_HOST), tg = tw_tensor_1d(g, TW_I32, nle, TW_MEM_HOST);
  cr_assert_eq(tw_grouped_quantize(tt_ref_ctx(), &tx, &tg, &o, q), TW_OK, "%s", tw_last_error());
  free(x);
  free(g);
}

static void make(scase *c, int n, uint64_t seed) {
  uint64_t st = seed;
  memset(c, 0, sizeof *c);
  c->n = n;
  static const int Es[] = {1, 2, 3, 4, 6, 8, 12, 16};
  do c->E = Es[tt_rand_u64(&st) % 8]; while (c->E % n);
  c->k = 1 + (int)(tt_rand_u64(&st) % (uint64_t)(c->E < 4 ? c->E : 4));
  c->dt = (tt_rand_u64(&st) & 1) ? TW_E4M3 : TW_E5M2;
  c->H = 128 * (1 + (int64_t)(tt_rand_u64(&st) % 3));
  static const int As[] = {1, 1, 2, 4, 8};
  c->A = As[tt_rand_u64(&st) % 5];
  c->maxT = 1 + (int64_t)(tt_rand_u64(&st) % 24);
  for (int r = 0; r < n; r++) c->T[r] = (int64_t)(tt_rand_u64(&st) % (uint64_t)(c->maxT + 1));
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = c->maxT; cfg.alignment = c->A;
  int64_t nodrop = tw_ep_capacity_no_drop(&cfg, n);
  int p = (int)(tt_rand_u64(&st) % 6); /* 0..2 no-drop capacity, 3..4 drop, 5 error policy with a small R */
  c->policy = p == 3 || p == 4 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  c->R = p >= 3 ? c->A * (1 + (int64_t)(tt_rand_u64(&st) % (uint64_t)(nodrop / c->A / 2 + 1))) : nodrop;
  for (int r = 0; r < n; r++) {
    int64_t T = c->T[r];
    c->tok[r] = malloc((size_t)(T * c->H) + 1);
    c->scl[r] = malloc((size_t)(T * cols(c)) * 4 + 4);
    c->idx[r] = malloc((size_t)(T * c->k) * 4 + 4);
    c->w[r] = malloc((size_t)(T * c->k) * 4 + 4);
    for (int64_t i = 0; i < T * c->H; i++) { /* finite codes of either format: |exponent| small */
      uint64_t u = tt_rand_u64(&st);
      c->tok[r][i] = (unsigned char)((u & 0x3f) | (u & 0x80));
    }
    for (int64_t i = 0; i < T * cols(c); i++) c->scl[r][i] = (float)tt_rand_uniform(&st, 0.1, 4);
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
    quantize_weights(c, r);
    int nle = c->E / n;
    for (int L = 0; L < 2; L++) {
      size_t sbytes = L ? (size_t)(cols(c) * rpad(c)) * 4 : (size_t)(c->R * cols(c)) * 4;
      c->recv[L][r] = malloc((size_t)(c->R * c->H) + 1);
      c->rscl[L][r] = malloc(sbytes + 4);
      c->rw[L][r] = malloc((size_t)c->R * 4 + 4);
      c->out[L][r] = malloc((size_t)(c->R * NOUT) * 4 + 4);
      c->gs[L][r] = malloc((size_t)nle * 4);
      c->dr[L][r] = malloc((size_t)nle * 4);
      memset(c->recv[L][r], 0xA5, (size_t)(c->R * c->H)); /* poison: every byte must be written */
      memset(c->rscl[L][r], 0xA5, sbytes);
      memset(c->rw[L][r], 0xA5, (size_t)c->R * 4);
      memset(c->out[L][r], 0xA5, (size_t)(c->R * NOUT) * 4);
    }
  }
}

static void release(scase *c) {
  for (int r = 0; r < c->n; r++) {
    free(c->tok[r]); free(c->scl[r]); free(c->idx[r]); free(c->w[r]);
    free(c->qmem[r][0]); free(c->qmem[r][1]);
    for (int L = 0; L < 2; L++) {
      free(c->recv[L][r]); free(c->rscl[L][r]); free(c->rw[L][r]); free(c->out[L][r]); free(c->gs[L][r]);
      free(c->dr[L][r]);
    }
  }
}

/* rows [R, C] -> [C, roundup(R, 4)], tail columns 0: what a caller does without the option */
static float *transposed(const float *rows, int64_t R, int64_t C) {
  int64_t Rp = rup(R, 4);
  float *t = calloc((size_t)(C * Rp) + 1, 4);
  for (int64_t i = 0; i < R; i++)
    for (int64_t b = 0; b < C; b++) t[b * Rp + i] = rows[i * C + b];
  return t;
}

/* The grouped GEMM out [R, NOUT] = recv (1x128 rowwise, scales [H/128, roundup(R, 4)]) @ W^T. */
static tw_status gemm(tw_ctx *ctx, const scase *c, int r, unsigned char *recv, float *gemm_scales, int32_t *gs,
                      float *out) {
  int nle = c->E / c->n;
  tw_operand lhs;
  memset(&lhs, 0, sizeof lhs);
  lhs.data = tw_tensor_2d(recv, c->dt, c->R, c->H, TW_MEM_HOST);
  lhs.mode = TW_SCALE_BLOCK_1x128;
  lhs.scale_inv = tw_tensor_2d(gemm_scales, TW_F32, cols(c), rpad(c), TW_MEM_HOST);
  lhs.src_rows = c->R;
  lhs.src_cols = c->H;
  tw_operand rhs = tw_operand_rowwise(&c->qw[r]);
  tw_tensor tg = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST), to = tw_tensor_2d(out, TW_F32, c->R, NOUT, TW_MEM_HOST);
  return tw_grouped_gemm(ctx, &lhs, &rhs, TW_OP_T, &tg, &to, 0);
}

static tw_status rank_fn(int r, tw_comm *comm, void *arg) {
  scase *c = arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  int nle = c->E / c->n;
  int64_t T = c->T[r], H = c->H, R = c->R, k = c->k;
  tw_status s = TW_OK;
  for (int L = 0; L < 2 && s == TW_OK; L++) {
    tw_ep_config cfg = TW_EP_CONFIG_INIT;
    cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = c->maxT; cfg.hidden = H; cfg.token_dtype = c->dt;
    cfg.scale_block = 128; cfg.recv_capacity = R; cfg.alignment = c->A; cfg.overflow = c->policy;
    cfg.scales_gemm_layout = L;
    tw_ep *ep = NULL;
    tw_ep_layer *layer = NULL;
    s = tw_ep_create(ctx, comm, &cfg, &ep);
    if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
    tw_tensor tok = tw_tensor_2d(c->tok[r], c->dt, T, H, TW_MEM_HOST);
    tw_tensor scl = tw_tensor_2d(c->scl[r], TW_F32, T, cols(c), TW_MEM_HOST);
    tw_tensor idx = tw_tensor_2d(c->idx[r], TW_I32, T, k, TW_MEM_HOST), w = tw_tensor_2d(c->w[r], TW_F32, T, k, TW_MEM_HOST);
    tw_tensor recv = tw_tensor_2d(c->recv[L][r], c->dt, R, H, TW_MEM_HOST);
    tw_tensor rscl = L ? tw_tensor_2d(c->rscl[L][r], TW_F32, cols(c), rpad(c), TW_MEM_HOST)
                       : tw_tensor_2d(c->rscl[L][r], TW_F32, R, cols(c), TW_MEM_HOST);
    tw_tensor rw = tw_tensor_1d(c->rw[L][r], TW_F32, R, TW_MEM_HOST);
    tw_tensor gs = tw_tensor_1d(c->gs[L][r], TW_I32, nle, TW_MEM_HOST), dr = tw_tensor_1d(c->dr[L][r], TW_I32, nle, TW_MEM_HOST);
    if (s == TW_OK) {
      c->st[L][r] = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rscl, &rw, &gs, &dr);
      if (c->st[L][r] == TW_OK) { /* the layout under test straight in; the row layout transposed by hand */
        float *t = L ? NULL : transposed(c->rscl[0][r], R, cols(c));
        s = gemm(ctx, c, r, c->recv[L][r], L ? c->rscl[1][r] : t, c->gs[L][r], c->out[L][r]);
        free(t);
      } else {
        snprintf(c->msg[r], sizeof c->msg[r], "%s", tw_last_error());
        tw_clear_error();
      }
    }
    tw_ep_layer_destroy(layer);
    tw_ep_destroy(ep);
  }
  tw_ctx_destroy(ctx);
  return s;
}

#define BAD(...) do { cr_log_error(__VA_ARGS__); return 0; } while (0)

static int same(const scase *c, int r, const char *name) {
  int nle = c->E / c->n;
  int64_t R = c->R, C = cols(c), Rp = rpad(c);
  if (c->st[0][r] != c->st[1][r])
    BAD("%s rank %d: row layout %s, gemm layout %s (%s)", name, r, tw_status_name(c->st[0][r]),
        tw_status_name(c->st[1][r]), c->msg[r]);
  if (c->st[0][r] != TW_OK) return 1; /* a capacity error, the same in both */
  if (memcmp(c->recv[0][r], c->recv[1][r], (size_t)(R * c->H))) BAD("%s rank %d: recv_tokens differ", name, r);
  if (memcmp(c->rw[0][r], c->rw[1][r], (size_t)R * 4)) BAD("%s rank %d: recv_weights differ", name, r);
  if (memcmp(c->gs[0][r], c->gs[1][r], (size_t)nle * 4)) BAD("%s rank %d: group_sizes differ", name, r);
  if (memcmp(c->dr[0][r], c->dr[1][r], (size_t)nle * 4)) BAD("%s rank %d: dropped differ", name, r);
  const float zero = 0.0f;
  for (int64_t b = 0; b < C; b++)
    for (int64_t i = 0; i < Rp; i++) {
      const float *g = &c->rscl[1][r][b * Rp + i], *want = i < R ? &c->rscl[0][r][i * C + b] : &zero;
      if (memcmp(g, want, 4))
        BAD("%s rank %d: recv_scales[%lld][%lld] = %g, expected %g%s", name, r, (long long)b, (long long)i, *g, *want,
            i < R ? " (row layout [i][b])" : " (tail column)");
    }
  if (memcmp(c->out[0][r], c->out[1][r], (size_t)(R * NOUT) * 4))
    BAD("%s rank %d: the grouped GEMM on the gemm layout differs from the hand-transposed one", name, r);
  return 1;
}

Test(ep_gemm_scales, random_cases_transpose_of_row_layout_and_same_grouped_gemm) {
  const int N = 90;
  int failed = 0, errors = 0, tails = 0, padded = 0, drops = 0;
  for (int i = 0; i < N; i++) {
    int n = i % 3 == 0 ? 1 : i % 3 == 1 ? 2 : 4;
    scase c;
    make(&c, n, 0xe5c0000u + (uint64_t)i);
    char name[160];
    snprintf(name, sizeof name, "case %d (n=%d E=%d k=%d H=%lld A=%d R=%lld %s %s)", i, n, c.E, c.k, (long long)c.H,
             c.A, (long long)c.R, tw_dtype_name(c.dt), c.policy == TW_EP_OVERFLOW_DROP ? "drop" : "error");
    tw_comm *comms[MAXR];
    cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
    tw_status s = tw_run_ranks(n, comms, rank_fn, &c);
    cr_assert_eq(s, TW_OK, "%s: %s", name, tw_last_error());
    for (int r = 0; r < n; r++) {
      failed += !same(&c, r, name);
      if (c.st[0][r] == TW_OK)
        for (int l = 0; l < c.E / n; l++) drops += c.dr[0][r][l] > 0;
      tw_comm_destroy(comms[r]);
    }
    errors += c.st[0][0] != TW_OK;
    tails += rpad(&c) != c.R;
    padded += c.A > 1;
    release(&c);
  }
  cr_log_info("EP scales_gemm_layout: %d cases (%d capacity errors, %d with tail columns, %d aligned, %d experts "
              "with drops), %d rank results differ",
              N, errors, tails, padded, drops, failed);
  cr_assert_eq(failed, 0, "%d rank results differ", failed);
  cr_assert_gt(tails, 0, "no case with R %% 4 != 0 was drawn");
  cr_assert_gt(drops, 0, "no drop case was drawn");
}

/* one rank, fixed shapes: the option's argument checks */
/* one thread rank and its ref context, for the error cases */
static void one_rank(tw_comm **comm, tw_ctx **ctx) {
  cr_assert_eq(tw_comm_init_threads(1, comm), TW_OK);
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = *comm;
  cr_assert_eq(tw_ctx_create(ctx, &cc), TW_OK);
}

static tw_ep_config small_cfg(void) {
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = 4; cfg.topk = 2; cfg.max_tokens = 3; cfg.hidden = 256; cfg.token_dtype = TW_E4M3;
  cfg.scale_block = 128; cfg.recv_capacity = 6; cfg.scales_gemm_layout = 1;
  return cfg;
}

Test(ep_gemm_scales, wrong_recv_scales_shape_is_rejected) {
  tw_comm *comm;
  tw_ctx *ctx;
  one_rank(&comm, &ctx);
  tw_ep_config cfg = small_cfg();
  tw_ep *ep;
  tw_ep_layer *layer;
  cr_assert_eq(tw_ep_create(ctx, comm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &layer), TW_OK);
  unsigned char tokb[3 * 256] = {0}, recvb[6 * 256];
  float sclb[3 * 2] = {1, 1, 1, 1, 1, 1}, rsb[2 * 8 + 8], rwb[6], wb[6] = {1, 1, 1, 1, 1, 1};
  int32_t idxb[6] = {0, 1, 2, 3, 1, 2}, gsb[4];
  tw_tensor tok = tw_tensor_2d(tokb, TW_E4M3, 3, 256, TW_MEM_HOST), scl = tw_tensor_2d(sclb, TW_F32, 3, 2, TW_MEM_HOST);
  tw_tensor idx = tw_tensor_2d(idxb, TW_I32, 3, 2, TW_MEM_HOST), w = tw_tensor_2d(wb, TW_F32, 3, 2, TW_MEM_HOST);
  tw_tensor recv = tw_tensor_2d(recvb, TW_E4M3, 6, 256, TW_MEM_HOST), rw = tw_tensor_1d(rwb, TW_F32, 6, TW_MEM_HOST);
  tw_tensor gs = tw_tensor_1d(gsb, TW_I32, 4, TW_MEM_HOST), none = tw_tensor_none();
  /* the row layout's shape [R, H/128] = [6, 2], and [2, R] without the padding to 4 */
  tw_tensor rows = tw_tensor_2d(rsb, TW_F32, 6, 2, TW_MEM_HOST), unpadded = tw_tensor_2d(rsb, TW_F32, 2, 6, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &rows, &rw, &gs, &none), TW_ERR_SHAPE,
                   "recv_scales is [6, 2], expected [2, 8] = [H/128, roundup(R = 6, 4)]");
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &unpadded, &rw, &gs, &none), TW_ERR_SHAPE,
                   "recv_scales is [2, 6], expected [2, 8]");
  tw_tensor one_d = tw_tensor_1d(rsb, TW_F32, 16, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &one_d, &rw, &gs, &none), TW_ERR_SHAPE,
                   "recv_scales");
  tw_tensor e8 = tw_tensor_2d(rsb, TW_E8M0, 2, 8, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &e8, &rw, &gs, &none), TW_ERR_DTYPE,
                   "recv_scales");
  /* and the right shape works: rows 0..5 hold the routes of tokens 0..2, tail columns 6, 7 are 0 */
  memset(rsb, 0xA5, sizeof rsb);
  tw_tensor good = tw_tensor_2d(rsb, TW_F32, 2, 8, TW_MEM_HOST);
  sclb[0] = 2; sclb[1] = 3; /* token 0's two blocks */
  cr_assert_eq(tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &recv, &good, &rw, &gs, &none), TW_OK, "%s",
               tw_last_error());
  /* expert 0 gets token 0 only: row 0; its scales are column 0 of [2, 8] */
  cr_expect_eq(rsb[0], 2.0f);
  cr_expect_eq(rsb[8], 3.0f);
  for (int b = 0; b < 2; b++)
    for (int i = 6; i < 8; i++) {
      uint32_t bits;
      memcpy(&bits, &rsb[b * 8 + i], 4);
      cr_expect_eq(bits, 0u, "tail [%d][%d] is 0x%08x, not +0", b, i, bits);
    }
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
}

Test(ep_gemm_scales, option_needs_fp8) {
  tw_comm *comm;
  tw_ctx *ctx;
  one_rank(&comm, &ctx);
  tw_ep *ep = NULL;
  size_t ws, ls;
  tw_ep_config cfg = small_cfg();
  cfg.scale_block = 32; /* MXFP8: its own layout now (ep_gemm_scales_mxfp8_test.c) */
  cr_assert_eq(tw_ep_create(ctx, comm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  tw_ep_destroy(ep);
  ep = NULL;
  cr_assert_eq(tw_ep_workspace_bytes(&cfg, 1, &ws, &ls), TW_OK, "%s", tw_last_error());
  cfg = small_cfg();
  cfg.token_dtype = TW_BF16;
  cfg.scale_block = 0;
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG, "is for fp8 tokens only (token_dtype bf16)");
  cfg = small_cfg();
  cfg.scales_gemm_layout = 2;
  tt_expect_status(tw_ep_create(ctx, comm, &cfg, &ep), TW_ERR_INVALID_ARG, "scales_gemm_layout = 2 must be 0");
  cfg = small_cfg();
  cr_assert_eq(tw_ep_create(ctx, comm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
}
