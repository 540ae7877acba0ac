/* Rows by source (tw_ep.h, tw_ep_dispatch_by_source) against the expert-major dispatch of the
 * same EP group, on thread ranks (ep_size 1..4), for every token dtype and scale layout:
 *   for every expert-major row i: recv_row[i] = -1 exactly where dispatch wrote a zero row
 *     (padding, past the slabs), else recv_tokens[i] == src_tokens[recv_row[i]] and the
 *     scales of row i (rows, 1x128 GEMM layout, MXFP8 per-slab blocks) == those of row
 *     recv_row[i] in the by-source layout (rows, 1x128 [H/128, roundup(U, 4)], MXFP8 one group);
 *   src_tokens row s * max_tokens + t == tokens_s[t] for every referenced row, and every other
 *     row (and its scales, and every padding byte of the scale layouts) is zero: the outputs
 *     start poisoned;
 *   recv_weights, group_sizes, dropped and the status (capacity errors) equal dispatch's;
 *   combine, dispatch_bwd and combine_bwd after the by-source dispatch equal those after
 *     dispatch, bit for bit.
 * tw_ep_source_scales_shape equals tw_quantize_output_shapes' row scales for M = U, G = 1.
 * The NumPy goldens (golden/gen_ep.py, ep_golden_test) check the rows layout independently. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

#define MAXR 4

static int64_t rup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

typedef struct {
  int n, E, k, A, scale_block, gemm_layout, swz;
  int64_t H, maxT, R, T[MAXR];
  tw_dtype dt;
  tw_ep_overflow policy;
  unsigned char *tok[MAXR], *scl[MAXR]; /* tokens [T, H], scale rows [T, H/block] */
  int32_t *idx[MAXR];
  float *w[MAXR], *y[MAXR], *dout[MAXR];
  int failed, errors, drops, zero_rows, multi_ref;
  char name[200];
} bcase;

static size_t tb(const bcase *c) { return tw_dtype_storage_bytes(c->dt, c->H); }
static int64_t sc(const bcase *c) { return c->scale_block ? c->H / c->scale_block : 0; }
static size_t se(const bcase *c) { return c->scale_block == 32 ? 1 : 4; } /* bytes of one scale */
static tw_dtype sdt(const bcase *c) { return c->scale_block == 32 ? TW_E8M0 : TW_F32; }

static tw_ep_config cfg_of(const bcase *c) {
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = c->maxT; cfg.hidden = c->H; cfg.token_dtype = c->dt;
  cfg.scale_block = c->scale_block; cfg.recv_capacity = c->R; cfg.alignment = c->A; cfg.overflow = c->policy;
  cfg.scales_gemm_layout = c->gemm_layout; cfg.scales_mxfp8_swizzled = c->swz;
  return cfg;
}

static void make(bcase *c, int n, uint64_t seed) {
  uint64_t st = seed;
  memset(c, 0, sizeof *c);
  c->n = n;
  static const int Es[] = {1, 2, 3, 4, 6, 8, 12, 16};
  do c->E = Es[tt_rand_u64(&st) % 8]; while (c->E % n);
  c->k = 1 + (int)(tt_rand_u64(&st) % (uint64_t)(c->E < 4 ? c->E : 4));
  int kind = (int)(tt_rand_u64(&st) % 5); /* f32, bf16, fp8 1x128, fp8 MXFP8 (x2) */
  c->dt = kind == 0 ? TW_F32 : kind == 1 ? TW_BF16 : (tt_rand_u64(&st) & 1) ? TW_E4M3 : TW_E5M2;
  c->scale_block = kind == 2 ? 128 : kind >= 3 ? 32 : 0;
  c->gemm_layout = c->scale_block && (tt_rand_u64(&st) % 3 != 0);
  c->swz = c->gemm_layout && c->scale_block == 32 && (tt_rand_u64(&st) & 1);
  c->H = c->scale_block == 128 ? 128 * (1 + (int64_t)(tt_rand_u64(&st) % 3))
         : c->scale_block   ? 32 * (1 + (int64_t)(tt_rand_u64(&st) % 6))
                            : 1 + (int64_t)(tt_rand_u64(&st) % 24);
  static const int As[] = {1, 1, 2, 4, 8};
  c->A = As[tt_rand_u64(&st) % 5];
  c->maxT = 1 + (int64_t)(tt_rand_u64(&st) % (tt_rand_u64(&st) % 4 ? 20 : 90)); /* U past 128 rows sometimes */
  for (int r = 0; r < n; r++) c->T[r] = (int64_t)(tt_rand_u64(&st) % (uint64_t)(c->maxT + 1));
  tw_ep_config cfg = cfg_of(c);
  int64_t nodrop = tw_ep_capacity_no_drop(&cfg, n);
  int p = (int)(tt_rand_u64(&st) % 6); /* 0..2 no-drop capacity, 3..4 drop, 5 error policy with a small R */
  c->policy = p == 3 || p == 4 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  c->R = p >= 3 ? c->A * (1 + (int64_t)(tt_rand_u64(&st) % (uint64_t)(nodrop / c->A / 2 + 1))) : nodrop;
  for (int r = 0; r < n; r++) {
    int64_t T = c->T[r];
    c->tok[r] = malloc(tb(c) * (size_t)T + 1);
    for (size_t b = 0; b < tb(c) * (size_t)T; b++) c->tok[r][b] = (unsigned char)(tt_rand_u64(&st) & 0x77); /* finite */
    c->scl[r] = malloc((size_t)(T * sc(c)) * se(c) + 1);
    for (int64_t i = 0; i < T * sc(c); i++) {
      if (c->scale_block == 32) c->scl[r][i] = (unsigned char)(100 + tt_rand_u64(&st) % 50);
      else ((float *)c->scl[r])[i] = (float)tt_rand_uniform(&st, 0.01, 4.0);
    }
    c->idx[r] = malloc((size_t)(T * c->k) * 4 + 4);
    c->w[r] = malloc((size_t)(T * c->k) * 4 + 4);
    for (int64_t t = 0; t < T; t++) {
      int perm[16];
      for (int e = 0; e < c->E; e++) perm[e] = e;
      int hot = tt_rand_u64(&st) % 3 == 0; /* skew: expert 0 first */
      for (int j = 0; j < c->k; j++) {
        int m = j == 0 && hot ? 0 : j + (int)(tt_rand_u64(&st) % (uint64_t)(c->E - j)); /* perm[0] is 0 */
        int tmp = perm[j]; perm[j] = perm[m]; perm[m] = tmp;
        c->idx[r][t * c->k + j] = perm[j];
      }
    }
    for (int64_t i = 0; i < T * c->k; i++) c->w[r][i] = (float)tt_rand_uniform(&st, -1, 1);
    c->y[r] = malloc((size_t)(c->R * c->H) * 4 + 4);
    tt_fill_uniform_f32(c->y[r], c->R * c->H, seed * 31 + (uint64_t)r, -2, 2);
    c->dout[r] = malloc((size_t)(T * c->H) * 4 + 4);
    tt_fill_uniform_f32(c->dout[r], T * c->H, seed * 37 + (uint64_t)r, -1, 1);
  }
}

static void release(bcase *c) {
  for (int r = 0; r < c->n; r++) {
    free(c->tok[r]); free(c->scl[r]); free(c->idx[r]); free(c->w[r]); free(c->y[r]); free(c->dout[r]);
  }
}

/* Byte offset of scale b of expert-major row i in recv_scales (gs: the group sizes). */
static size_t recv_scale_at(const bcase *c, const int32_t *gs, int64_t i, int64_t b) {
  if (!c->gemm_layout) return (size_t)(i * sc(c) + b) * se(c);
  if (c->scale_block == 128) return (size_t)(b * rup(c->R, 4) + i) * 4;
  int64_t C = rup(sc(c), 4), O = 0, tiles = 0;
  for (int l = 0; l < c->E / c->n; l++) {
    if (i < O + gs[l]) break;
    O += gs[l];
    tiles += (gs[l] + 127) / 128;
  }
  int64_t r = i - O, a = r / 128, bb = r % 128 / 32, d = r % 32, e = b / 4, f = b % 4;
  return (size_t)(128 * tiles * C) + (size_t)(c->swz ? ((a * (C / 4) + e) * 32 + d) * 16 + bb * 4 + f : r * C + b);
}

/* Byte offset of scale b of source row u in src_scales. */
static size_t src_scale_at(const bcase *c, int64_t u, int64_t b) {
  int64_t U = c->n * c->maxT;
  if (!c->gemm_layout) return (size_t)(u * sc(c) + b) * se(c);
  if (c->scale_block == 128) return (size_t)(b * rup(U, 4) + u) * 4;
  int64_t C = rup(sc(c), 4), a = u / 128, bb = u % 128 / 32, d = u % 32, e = b / 4, f = b % 4;
  return (size_t)(c->swz ? ((a * (C / 4) + e) * 32 + d) * 16 + bb * 4 + f : u * C + b);
}

static int all_zero(const unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i]) return 0;
  return 1;
}

#define BAD(...) do { cr_log_error(__VA_ARGS__); c->failed++; goto done; } while (0)

/* combine_bwd by source after either dispatch of the step (la: expert-major, lb: by source),
 * f32 d_out, then bf16 d_out (against combine_bwd in bf16 on la):
 *   d_src[u] = d_out row of u's token where recv_row references u, zeros elsewhere (poisoned);
 *   combine_bwd's d_expert_out[i] = recv_weights[i] * d_src[recv_row[i]] rounded to d_out's
 *     dtype (0 rows where recv_row[i] = -1), bit for bit;
 *   d_topk_weights = combine_bwd's, bit for bit; none for both leaves the rest unchanged. */
/* A failed check logs, counts and ends that pass's checking without leaving the collective calls
 * (a rank that skipped them would leave the others waiting). */
#define CHECK_FAIL(...) do { cr_log_error(__VA_ARGS__); c->failed++; bad_pass = 1; } while (0)
static int all_a5(const unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != 0xA5) return 0;
  return 1;
}
static tw_status combine_bwd_by_source_checks(bcase *c, int r, tw_ctx *ctx, tw_ep_layer *la, tw_ep_layer *lb,
                                              const int32_t *row, const float *rw, const float *dexp_f32,
                                              const float *dtw_f32) {
  int64_t T = c->T[r], H = c->H, R = c->R, k = c->k, U = c->n * c->maxT;
  tw_status s = TW_OK;
  float *dsrc = malloc((size_t)(U * H) * 4 + 4), *dtw = malloc((size_t)(T * k) * 4 + 4);
  uint16_t *db = malloc((size_t)(T * H) * 2 + 2), *dexpb = malloc((size_t)(R * H) * 2 + 2);
  float *dtwb = malloc((size_t)(T * k) * 4 + 4);
  char *used = calloc((size_t)U + 1, 1);
  if (!dsrc || !dtw || !db || !dexpb || !dtwb || !used) {
    free(dsrc); free(dtw); free(db); free(dexpb); free(dtwb); free(used);
    return tw_error(TW_ERR_MEMORY, "ep_by_source_test: out of host memory");
  }
  for (int64_t i = 0; i < R; i++)
    if (row[i] >= 0) used[row[i]] = 1;
  tw_tensor y = tw_tensor_2d(c->y[r], TW_F32, R, H, TW_MEM_HOST), none = tw_tensor_none();
  tw_tensor w = tw_tensor_2d(c->w[r], TW_F32, T, k, TW_MEM_HOST);
  tw_tensor tdtw = tw_tensor_2d(dtw, TW_F32, T, k, TW_MEM_HOST);
  for (int pass = 0; pass < 3; pass++) { /* f32 on la, f32 on lb, bf16 on lb */
    int bf = pass == 2;
    tw_ep_layer *ly = pass == 0 ? la : lb;
    size_t eb = bf ? 2 : 4;
    memset(dsrc, 0xA5, (size_t)(U * H) * eb);
    memset(dtw, 0xA5, (size_t)(T * k) * 4);
    tw_tensor dout = tw_tensor_2d(c->dout[r], TW_F32, T, H, TW_MEM_HOST);
    if (bf) {
      for (int64_t i = 0; i < T * H; i++) db[i] = tw_f32_to_bf16(c->dout[r][i]);
      dout = tw_tensor_2d(db, TW_BF16, T, H, TW_MEM_HOST);
      tw_tensor tdexpb = tw_tensor_2d(dexpb, TW_BF16, R, H, TW_MEM_HOST), tdtwb = tw_tensor_2d(dtwb, TW_F32, T, k, TW_MEM_HOST);
      s = tw_ep_combine_bwd(ctx, la, &dout, &w, &y, &tdexpb, &tdtwb);
      if (s != TW_OK) goto done;
    }
    tw_tensor tdsrc = tw_tensor_2d(dsrc, bf ? TW_BF16 : TW_F32, U, H, TW_MEM_HOST);
    s = tw_ep_combine_bwd_by_source(ctx, ly, &dout, pass == 1 ? &none : &y, &tdsrc, pass == 1 ? &none : &tdtw);
    if (s != TW_OK) goto done;
    const unsigned char *D = (const unsigned char *)dsrc;
    int bad_pass = 0;
    for (int64_t u = 0; u < U && !bad_pass; u++) {
      const unsigned char *got = D + (size_t)(u * H) * eb;
      int so = (int)(u / c->maxT);
      int64_t t = u % c->maxT;
      int bad = !used[u] ? !all_zero(got, (size_t)H * eb) : !bf && memcmp(got, c->dout[so] + t * H, (size_t)H * 4);
      for (int64_t h = 0; used[u] && bf && h < H; h++)
        bad |= ((const uint16_t *)got)[h] != tw_f32_to_bf16(c->dout[so][t * H + h]);
      if (bad)
        CHECK_FAIL("%s rank %d pass %d: d_src row %lld (token %lld of rank %d, referenced %d) is wrong", c->name, r,
                   pass, (long long)u, (long long)t, so, used[u]);
    }
    for (int64_t i = 0; i < R && !bad_pass; i++)
      for (int64_t h = 0; h < H && !bad_pass; h++) {
        float x = row[i] < 0 ? 0.0f : bf ? tw_bf16_to_f32(((uint16_t *)dsrc)[row[i] * H + h]) : dsrc[row[i] * H + h];
        float p = rw[i] * x;
        int ok = bf ? tw_f32_to_bf16(p) == dexpb[i * H + h] : memcmp(&p, dexp_f32 + i * H + h, 4) == 0;
        if (!ok)
          CHECK_FAIL("%s rank %d pass %d: d_expert_out[%lld, %lld] != recv_weights * d_src[recv_row]", c->name, r,
                     pass, (long long)i, (long long)h);
      }
    if (pass != 1 && memcmp(dtw, bf ? dtwb : dtw_f32, (size_t)(T * k) * 4))
      CHECK_FAIL("%s rank %d pass %d: d_topk_weights differ from combine_bwd's", c->name, r, pass);
    if (pass == 1 && T * k > 0 && !all_a5((const unsigned char *)dtw, (size_t)(T * k) * 4))
      CHECK_FAIL("%s rank %d: d_topk_weights none, yet its buffer was written", c->name, r);
  }
done:
  free(dsrc); free(dtw); free(db); free(dexpb); free(dtwb); free(used);
  return s;
}

static tw_status rank_fn(int r, tw_comm *comm, void *arg) {
  bcase *c = arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep_config cfg = cfg_of(c);
  int nle = c->E / c->n;
  int64_t T = c->T[r], H = c->H, R = c->R, k = c->k, U = c->n * c->maxT;
  tw_ep *ep = NULL;
  tw_ep_layer *la = NULL, *lb = NULL;
  tw_status s = tw_ep_create(ctx, comm, &cfg, &ep);
  if (s == TW_OK) s = tw_ep_layer_create(ep, &la);
  if (s == TW_OK) s = tw_ep_layer_create(ep, &lb);
  int64_t rsh[2] = {0, 0}, ssh[2] = {0, 0};
  tw_dtype d0;
  if (s == TW_OK && sc(c)) s = tw_ep_recv_scales_shape(&cfg, c->n, rsh, &d0);
  if (s == TW_OK && sc(c)) s = tw_ep_source_scales_shape(&cfg, c->n, ssh, &d0);
  if (s == TW_OK && tw_ep_source_rows(ep) != U) s = tw_error(TW_ERR_INTERNAL, "tw_ep_source_rows %lld", (long long)tw_ep_source_rows(ep));
  size_t rsb = (size_t)(rsh[0] * rsh[1]) * se(c), ssb = (size_t)(ssh[0] * ssh[1]) * se(c);
  unsigned char *recv = malloc(tb(c) * (size_t)R + 1), *rscl = malloc(rsb + 1);
  unsigned char *src = malloc(tb(c) * (size_t)U + 1), *sscl = malloc(ssb + 1);
  int32_t *row = malloc((size_t)R * 4 + 4), *gs[2], *dr[2];
  float *rw[2], *out[2], *dtok[2], *dtw[2], *dexp[2], *dtwc[2];
  for (int L = 0; L < 2; L++) {
    gs[L] = malloc((size_t)nle * 4); dr[L] = malloc((size_t)nle * 4);
    rw[L] = malloc((size_t)R * 4 + 4); out[L] = malloc((size_t)(T * H) * 4 + 4); dtok[L] = malloc((size_t)(T * H) * 4 + 4);
    dtw[L] = malloc((size_t)(T * k) * 4 + 4); dtwc[L] = malloc((size_t)(T * k) * 4 + 4);
    dexp[L] = malloc((size_t)(R * H) * 4 + 4);
    memset(rw[L], 0xA5, (size_t)R * 4);
    memset(gs[L], 0xA5, (size_t)nle * 4);
  }
  memset(src, 0xA5, tb(c) * (size_t)U); /* poison: every byte must be written */
  memset(sscl, 0xA5, ssb);
  memset(row, 0xA5, (size_t)R * 4);
  tw_tensor tok = tw_tensor_2d(c->tok[r], c->dt, T, H, TW_MEM_HOST);
  tw_tensor scl = sc(c) ? tw_tensor_2d(c->scl[r], sdt(c), T, sc(c), TW_MEM_HOST) : tw_tensor_none();
  tw_tensor idx = tw_tensor_2d(c->idx[r], TW_I32, T, k, TW_MEM_HOST), w = tw_tensor_2d(c->w[r], TW_F32, T, k, TW_MEM_HOST);
  tw_tensor trecv = tw_tensor_2d(recv, c->dt, R, H, TW_MEM_HOST);
  tw_tensor trscl = sc(c) ? tw_tensor_2d(rscl, sdt(c), rsh[0], rsh[1], TW_MEM_HOST) : tw_tensor_none();
  tw_tensor tsrc = tw_tensor_2d(src, c->dt, U, H, TW_MEM_HOST);
  tw_tensor tsscl = sc(c) ? tw_tensor_2d(sscl, sdt(c), ssh[0], ssh[1], TW_MEM_HOST) : tw_tensor_none();
  tw_tensor trow = tw_tensor_1d(row, TW_I32, R, TW_MEM_HOST);
  tw_tensor y = tw_tensor_2d(c->y[r], TW_F32, R, H, TW_MEM_HOST), dy = tw_tensor_2d(c->dout[r], TW_F32, T, H, TW_MEM_HOST);
  tw_status st[2] = {TW_OK, TW_OK};
  if (s == TW_OK) {
    tw_tensor trw = tw_tensor_1d(rw[0], TW_F32, R, TW_MEM_HOST), tgs = tw_tensor_1d(gs[0], TW_I32, nle, TW_MEM_HOST);
    tw_tensor tdr = tw_tensor_1d(dr[0], TW_I32, nle, TW_MEM_HOST);
    st[0] = tw_ep_dispatch(ctx, la, &tok, &scl, &idx, &w, &trecv, &trscl, &trw, &tgs, &tdr);
    if (st[0] != TW_OK) tw_clear_error();
    trw.data = rw[1]; tgs.data = gs[1]; tdr.data = dr[1];
    st[1] = tw_ep_dispatch_by_source(ctx, lb, &tok, &scl, &idx, &w, &tsrc, &tsscl, &trow, &trw, &tgs, &tdr);
    if (st[1] != TW_OK) tw_clear_error();
  }
  if (s != TW_OK) goto done;
  if (st[0] != st[1]) BAD("%s rank %d: dispatch status %d, by source %d", c->name, r, st[0], st[1]);
  if (st[0] != TW_OK) { /* a capacity error on every rank */
    if (r == 0) c->errors++;
    goto done;
  }
  if (memcmp(gs[0], gs[1], (size_t)nle * 4) || memcmp(dr[0], dr[1], (size_t)nle * 4) || memcmp(rw[0], rw[1], (size_t)R * 4))
    BAD("%s rank %d: group_sizes, dropped or recv_weights differ", c->name, r);
  for (int l = 0; l < nle; l++) c->drops += dr[0][l] > 0;
  char *used = calloc((size_t)U + 1, 1);
  for (int64_t i = 0; i < R; i++) {
    int32_t u = row[i];
    if (u == -1) {
      if (!all_zero(recv + (size_t)i * tb(c), tb(c)) || rw[1][i] != 0.0f)
        BAD("%s rank %d: recv_row[%lld] = -1 but dispatch wrote a routed row there", c->name, r, (long long)i);
      continue;
    }
    if (u < 0 || u >= U) BAD("%s rank %d: recv_row[%lld] = %d outside [-1, U = %lld)", c->name, r, (long long)i, u, (long long)U);
    c->multi_ref += used[u];
    used[u] = 1;
    int s_ = (int)(u / c->maxT);
    int64_t t = u % c->maxT;
    if (t >= c->T[s_]) BAD("%s rank %d: recv_row[%lld] = %d is token %lld of rank %d, which has %lld", c->name, r, (long long)i, u, (long long)t, s_, (long long)c->T[s_]);
    if (memcmp(recv + (size_t)i * tb(c), src + (size_t)u * tb(c), tb(c)) ||
        memcmp(src + (size_t)u * tb(c), c->tok[s_] + (size_t)t * tb(c), tb(c)))
      BAD("%s rank %d: row %lld: recv_tokens, src_tokens[%d] and tokens_%d[%lld] differ", c->name, r, (long long)i, u, s_, (long long)t);
    for (int64_t b = 0; b < sc(c); b++)
      if (memcmp(rscl + recv_scale_at(c, gs[0], i, b), sscl + src_scale_at(c, u, b), se(c)))
        BAD("%s rank %d: scale %lld of row %lld (source row %d) differs", c->name, r, (long long)b, (long long)i, u);
  }
  for (int64_t u = 0; u < U; u++) {
    if (used[u]) continue;
    c->zero_rows++;
    if (!all_zero(src + (size_t)u * tb(c), tb(c))) BAD("%s rank %d: unreferenced src_tokens row %lld is not zero", c->name, r, (long long)u);
  }
  /* the scale layout's bytes: referenced rows' scales (checked above) and zeros everywhere else */
  for (int64_t u = 0; u < U; u++)
    for (int64_t b = 0; b < sc(c); b++) {
      size_t at = src_scale_at(c, u, b);
      if (!used[u] && !all_zero(sscl + at, se(c))) BAD("%s rank %d: scales of unreferenced row %lld not zero", c->name, r, (long long)u);
      memset(sscl + at, 0, se(c));
    }
  if (!all_zero(sscl, ssb)) BAD("%s rank %d: a padding byte of src_scales is not zero", c->name, r);
  free(used);
  /* the ops after each dispatch */
  for (int L = 0; L < 2; L++) {
    tw_ep_layer *ly = L ? lb : la;
    tw_tensor tout = tw_tensor_2d(out[L], TW_F32, T, H, TW_MEM_HOST), tdtok = tw_tensor_2d(dtok[L], TW_F32, T, H, TW_MEM_HOST);
    tw_tensor tdtw = tw_tensor_2d(dtw[L], TW_F32, T, k, TW_MEM_HOST), tdtwc = tw_tensor_2d(dtwc[L], TW_F32, T, k, TW_MEM_HOST);
    tw_tensor tdexp = tw_tensor_2d(dexp[L], TW_F32, R, H, TW_MEM_HOST), dw = tw_tensor_1d(c->y[r], TW_F32, R, TW_MEM_HOST);
    s = tw_ep_combine(ctx, ly, &y, &w, &tout);
    if (s == TW_OK) s = tw_ep_dispatch_bwd(ctx, ly, &y, &dw, &tdtok, &tdtw);
    if (s == TW_OK) s = tw_ep_combine_bwd(ctx, ly, &dy, &w, &y, &tdexp, &tdtwc);
    if (s != TW_OK) goto done;
  }
  if (memcmp(out[0], out[1], (size_t)(T * H) * 4) || memcmp(dtok[0], dtok[1], (size_t)(T * H) * 4) ||
      memcmp(dtw[0], dtw[1], (size_t)(T * k) * 4) || memcmp(dtwc[0], dtwc[1], (size_t)(T * k) * 4) ||
      memcmp(dexp[0], dexp[1], (size_t)(R * H) * 4))
    BAD("%s rank %d: combine / dispatch_bwd / combine_bwd differ after the by-source dispatch", c->name, r);
  s = combine_bwd_by_source_checks(c, r, ctx, la, lb, row, rw[1], dexp[0], dtwc[0]);
done:
  free(recv); free(rscl); free(src); free(sscl); free(row);
  for (int L = 0; L < 2; L++) {
    free(gs[L]); free(dr[L]); free(rw[L]); free(out[L]); free(dtok[L]); free(dtw[L]); free(dtwc[L]); free(dexp[L]);
  }
  tw_ep_layer_destroy(la);
  tw_ep_layer_destroy(lb);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

Test(ep_by_source, random_cases_equal_the_expert_major_dispatch_through_the_row_map) {
  const int N = 240;
  int failed = 0, errors = 0, drops = 0, zero_rows = 0, multi = 0, kinds[6] = {0};
  for (int i = 0; i < N; i++) {
    int n = 1 + i % 4;
    bcase c;
    make(&c, n, 0xb50c0000u + (uint64_t)i);
    snprintf(c.name, sizeof c.name, "case %d (n=%d E=%d k=%d H=%lld A=%d R=%lld maxT=%lld %s block %d layout %d%s %s)", i,
             n, c.E, c.k, (long long)c.H, c.A, (long long)c.R, (long long)c.maxT, tw_dtype_name(c.dt), c.scale_block,
             c.gemm_layout, c.swz ? " swizzled" : "", c.policy == TW_EP_OVERFLOW_DROP ? "drop" : "error");
    kinds[c.scale_block == 0 ? (c.dt == TW_F32 ? 0 : 1) : c.scale_block == 128 ? 2 + c.gemm_layout : 4 + c.gemm_layout]++;
    tw_comm *comms[MAXR];
    cr_assert_eq(tw_comm_init_threads(n, comms), TW_OK);
    tw_status s = tw_run_ranks(n, comms, rank_fn, &c);
    cr_assert_eq(s, TW_OK, "%s: %s", c.name, tw_last_error());
    for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
    failed += c.failed; errors += c.errors; drops += c.drops; zero_rows += c.zero_rows; multi += c.multi_ref;
    release(&c);
  }
  cr_log_info("EP rows by source: %d cases (f32 %d, bf16 %d, 1x128 rows %d / GEMM layout %d, MXFP8 rows %d / GEMM "
              "layout %d), %d capacity errors, %d experts with drops, %d zero source rows, %d source rows read by "
              "several expert rows; %d rank results differ",
              N, kinds[0], kinds[1], kinds[2], kinds[3], kinds[4], kinds[5], errors, drops, zero_rows, multi, failed);
  cr_assert_eq(failed, 0, "%d rank results differ", failed);
  cr_assert(errors > 0 && drops > 0 && zero_rows > 0 && multi > 0, "a feature was not drawn");
  for (int q = 0; q < 6; q++) cr_assert_gt(kinds[q], 0, "token kind %d not drawn", q);
}

Test(ep_by_source, source_scales_shape_is_the_quantizers_one_group_layout) {
  int64_t Us[] = {0, 1, 4, 5, 127, 128, 129, 300};
  for (int blk = 0; blk < 2; blk++)
    for (int layout = 0; layout < 2; layout++)
      for (size_t i = 0; i < sizeof Us / sizeof Us[0]; i++) {
        tw_ep_config cfg = TW_EP_CONFIG_INIT;
        int n = Us[i] % 2 == 0 && Us[i] ? 2 : 1;
        cfg.num_experts = 4; cfg.topk = 2; cfg.max_tokens = Us[i] / n; cfg.hidden = blk ? 96 : 256;
        cfg.token_dtype = TW_E4M3; cfg.scale_block = blk ? 32 : 128; cfg.scales_gemm_layout = layout;
        int64_t sh[2];
        tw_dtype dt;
        cr_assert_eq(tw_ep_source_scales_shape(&cfg, n, sh, &dt), TW_OK, "%s", tw_last_error());
        int64_t U = n * cfg.max_tokens, K = cfg.hidden;
        if (!layout) {
          cr_expect(sh[0] == U && sh[1] == K / cfg.scale_block, "rows: [%lld, %lld] for U %lld", (long long)sh[0], (long long)sh[1], (long long)U);
        } else {
          tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
          o.mode = blk ? TW_SCALE_MXFP8_1D : TW_SCALE_BLOCK_1x128;
          o.layout = TW_ROWWISE;
          tw_qtensor q;
          cr_assert_eq(tw_quantize_output_shapes(&o, U, K, 1, &q), TW_OK, "%s", tw_last_error());
          cr_expect(sh[0] == q.row_scale_inv.shape[0] && sh[1] == q.row_scale_inv.shape[1] && dt == q.row_scale_inv.dtype,
                    "U %lld block %d: [%lld, %lld] %s, the quantizer's [%lld, %lld] %s", (long long)U, cfg.scale_block,
                    (long long)sh[0], (long long)sh[1], tw_dtype_name(dt), (long long)q.row_scale_inv.shape[0],
                    (long long)q.row_scale_inv.shape[1], tw_dtype_name(q.row_scale_inv.dtype));
        }
      }
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = 4; cfg.topk = 2; cfg.max_tokens = 3; cfg.hidden = 8; cfg.token_dtype = TW_BF16;
  int64_t sh[2];
  tw_dtype dt;
  tt_expect_status(tw_ep_source_scales_shape(&cfg, 2, sh, &dt), TW_ERR_INVALID_ARG, "bf16 tokens have no src_scales");
  cfg.token_dtype = TW_E4M3;
  cfg.scale_block = 32;
  cfg.hidden = 64;
  tt_expect_status(tw_ep_source_scales_shape(&cfg, 0, sh, &dt), TW_ERR_INVALID_ARG, "ep_size = 0");
  tt_expect_status(tw_ep_source_scales_shape(&cfg, 2, NULL, &dt), TW_ERR_NULL, "shape or dtype is NULL");
  tt_expect_status(tw_ep_source_scales_shape(NULL, 2, sh, &dt), TW_ERR_NULL, "cfg is NULL");
  cr_expect_eq(tw_ep_source_rows(NULL), 0);
}

/* bf16 tokens: src_scales must be none */
static tw_status bf16_scales_fn(int r, tw_comm *comm, void *arg) {
  (void)r;
  (void)arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = 2; cfg.topk = 1; cfg.max_tokens = 2; cfg.hidden = 4; cfg.token_dtype = TW_BF16;
  tw_ep *ep = NULL;
  tw_ep_layer *ly = NULL;
  cr_assert_eq(tw_ep_create(ctx, comm, &cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &ly), TW_OK);
  uint16_t tok[8] = {0}, src[8];
  float w[2] = {1, 1}, rw[8], sc[2];
  int32_t ids[2] = {0, 1}, row[8], gs[2];
  const int64_t R = tw_ep_recv_capacity(ep);
  tw_tensor t = tw_tensor_2d(tok, TW_BF16, 2, 4, TW_MEM_HOST), idx = tw_tensor_2d(ids, TW_I32, 2, 1, TW_MEM_HOST);
  tw_tensor tw_ = tw_tensor_2d(w, TW_F32, 2, 1, TW_MEM_HOST), ts = tw_tensor_2d(src, TW_BF16, 2, 4, TW_MEM_HOST);
  tw_tensor trow = tw_tensor_1d(row, TW_I32, R, TW_MEM_HOST), trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor tgs = tw_tensor_1d(gs, TW_I32, 2, TW_MEM_HOST), none = tw_tensor_none();
  tw_tensor scl = tw_tensor_2d(sc, TW_F32, 2, 1, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &t, &none, &idx, &tw_, &ts, &scl, &trow, &trw, &tgs, &none),
                   TW_ERR_INVALID_ARG, "src_scales are for fp8 tokens only (tokens are bf16)");
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &t, &scl, &idx, &tw_, &ts, &none, &trow, &trw, &tgs, &none),
                   TW_ERR_INVALID_ARG, "token_scales are for fp8 tokens only (tokens are bf16)");
  tt_expect_status(tw_ep_dispatch_by_source(NULL, ly, &t, &none, &idx, &tw_, &ts, &none, &trow, &trw, &tgs, &none),
                   TW_ERR_NULL, "ctx or layer is NULL");
  cr_expect_eq(tw_ep_dispatch_by_source(ctx, ly, &t, &none, &idx, &tw_, &ts, &none, &trow, &trw, &tgs, &none), TW_OK,
               "%s", tw_last_error());
  tw_ep_layer_destroy(ly);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return TW_OK;
}

Test(ep_by_source, scales_for_bf16_tokens_and_nulls_are_refused) {
  tw_comm *comm;
  cr_assert_eq(tw_comm_init_threads(1, &comm), TW_OK);
  cr_assert_eq(tw_run_ranks(1, &comm, bf16_scales_fn, NULL), TW_OK, "%s", tw_last_error());
  tw_comm_destroy(comm);
}

/* ---- errors ------------------------------------------------------------------------------ */
typedef struct {
  tw_ep_config cfg;
} ecase;

static tw_status errors_fn(int r, tw_comm *comm, void *arg) {
  (void)r;
  ecase *e = arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep *ep = NULL;
  tw_ep_layer *ly = NULL;
  cr_assert_eq(tw_ep_create(ctx, comm, &e->cfg, &ep), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ep_layer_create(ep, &ly), TW_OK);
  const int64_t T = 3, H = 128, k = 2, R = tw_ep_recv_capacity(ep), U = tw_ep_source_rows(ep);
  cr_assert_eq(U, 2 * 4);
  unsigned char tokb[3 * 128], srcb[8 * 128 + 64];
  float sclb[3], w[6] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f}, rwb[64], ssclb[8 * 2 + 8];
  int32_t ids[6] = {0, 1, 2, 3, 1, 2}, rowb[64], gsb[2], drb[2];
  memset(tokb, 0x11, sizeof tokb);
  for (int i = 0; i < 3; i++) sclb[i] = 1.0f;
  tw_tensor tok = tw_tensor_2d(tokb, TW_E4M3, T, H, TW_MEM_HOST), scl = tw_tensor_2d(sclb, TW_F32, T, 1, TW_MEM_HOST);
  tw_tensor idx = tw_tensor_2d(ids, TW_I32, T, k, TW_MEM_HOST), tw_ = tw_tensor_2d(w, TW_F32, T, k, TW_MEM_HOST);
  tw_tensor src = tw_tensor_2d(srcb, TW_E4M3, U, H, TW_MEM_HOST), sscl = tw_tensor_2d(ssclb, TW_F32, U, 1, TW_MEM_HOST);
  tw_tensor row = tw_tensor_1d(rowb, TW_I32, R, TW_MEM_HOST), rw = tw_tensor_1d(rwb, TW_F32, R, TW_MEM_HOST);
  tw_tensor gs = tw_tensor_1d(gsb, TW_I32, 2, TW_MEM_HOST), dr = tw_tensor_1d(drb, TW_I32, 2, TW_MEM_HOST);
  tw_tensor bad;
  bad = tw_tensor_2d(srcb, TW_E4M3, U - 1, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &bad, &sscl, &row, &rw, &gs, &dr),
                   TW_ERR_SHAPE, "src_tokens");
  bad = tw_tensor_2d(srcb, TW_BF16, U, H / 2, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &bad, &sscl, &row, &rw, &gs, &dr),
                   TW_ERR_SHAPE, "src_tokens");
  bad = tw_tensor_2d(srcb, TW_E5M2, U, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &bad, &sscl, &row, &rw, &gs, &dr),
                   TW_ERR_DTYPE, "src_tokens is e5m2, expected e4m3");
  bad = tw_tensor_1d(rowb, TW_F32, R, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &sscl, &bad, &rw, &gs, &dr),
                   TW_ERR_DTYPE, "recv_row is f32, expected i32");
  bad = tw_tensor_1d(rowb, TW_I32, R - 1, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &sscl, &bad, &rw, &gs, &dr),
                   TW_ERR_SHAPE, "recv_row");
  bad = tw_tensor_2d(ssclb, TW_F32, 1, U, TW_MEM_HOST); /* the GEMM layout's shape while the config asks for rows */
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &bad, &row, &rw, &gs, &dr),
                   TW_ERR_SHAPE, "src_scales is [1, 8], expected [8, 1] for U = 8 source rows (rows [U, H/block]");
  bad = tw_tensor_none();
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &bad, &row, &rw, &gs, &dr),
                   TW_ERR_INVALID_ARG, "src_scales is required but none was given");
  bad = tw_tensor_2d(ssclb, TW_E8M0, U, 1, TW_MEM_HOST);
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &bad, &row, &rw, &gs, &dr),
                   TW_ERR_DTYPE, "src_scales is e8m0, expected f32");
  ids[3] = 9;
  tt_expect_status(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &sscl, &row, &rw, &gs, &dr),
                   TW_ERR_INVALID_ARG, "topk_idx[1, 1] = 9 is outside [0, E = 4)");
  ids[3] = 3;
  /* no dispatch succeeded yet: combine refuses */
  float yb[64 * 128], ob[3 * 128];
  tw_tensor y = tw_tensor_2d(yb, TW_F32, R, H, TW_MEM_HOST), out = tw_tensor_2d(ob, TW_F32, T, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine(ctx, ly, &y, &tw_, &out), TW_ERR_INVALID_ARG, "no successful dispatch");
  float dsb[8 * 128], dob[3 * 128] = {0}, dwb[6];
  tw_tensor dout = tw_tensor_2d(dob, TW_F32, T, H, TW_MEM_HOST), dsrc = tw_tensor_2d(dsb, TW_F32, U, H, TW_MEM_HOST);
  tw_tensor dw = tw_tensor_2d(dwb, TW_F32, T, k, TW_MEM_HOST), none = tw_tensor_none();
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &y, &dsrc, &dw), TW_ERR_INVALID_ARG, "no successful dispatch");
  cr_expect_eq(tw_ep_dispatch_by_source(ctx, ly, &tok, &scl, &idx, &tw_, &src, &sscl, &row, &rw, &gs, &dr), TW_OK,
               "%s", tw_last_error());
  /* combine_bwd by source */
  bad = tw_tensor_2d(dsb, TW_F32, U - 1, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &y, &bad, &dw), TW_ERR_SHAPE, "d_src");
  bad = tw_tensor_2d(dsb, TW_BF16, U, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &y, &bad, &dw), TW_ERR_DTYPE,
                   "d_src is bf16 but d_out is f32 (they must match)");
  bad = tw_tensor_2d(dob, TW_F32, T + 1, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &bad, &y, &dsrc, &dw), TW_ERR_SHAPE, "d_out");
  bad = tw_tensor_2d(dob, TW_E4M3, T, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &bad, &y, &dsrc, &dw), TW_ERR_DTYPE,
                   "d_out is e4m3, expected f32 or bf16");
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &none, &dsrc, &dw), TW_ERR_INVALID_ARG,
                   "d_topk_weights needs expert_out (it is none)");
  bad = tw_tensor_2d(yb, TW_F32, R - 1, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &bad, &dsrc, &dw), TW_ERR_SHAPE, "expert_out");
  bad = tw_tensor_2d(yb, TW_E4M3, R, H, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &bad, &dsrc, &dw), TW_ERR_DTYPE,
                   "expert_out is e4m3, expected f32 or bf16");
  bad = tw_tensor_2d(dwb, TW_F32, T, k + 1, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &y, &dsrc, &bad), TW_ERR_SHAPE, "d_topk_weights");
  bad = tw_tensor_2d(dwb, TW_I32, T, k, TW_MEM_HOST);
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &y, &dsrc, &bad), TW_ERR_DTYPE,
                   "d_topk_weights is i32, expected f32");
  tt_expect_status(tw_ep_combine_bwd_by_source(ctx, ly, NULL, &y, &dsrc, &dw), TW_ERR_NULL, "d_out");
  cr_expect_eq(tw_ep_combine_bwd_by_source(ctx, ly, &dout, &none, &dsrc, &none), TW_OK, "%s", tw_last_error());
  tw_ep_layer_destroy(ly);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return TW_OK;
}

Test(ep_by_source, bad_arguments_are_named) {
  ecase e;
  e.cfg = (tw_ep_config)TW_EP_CONFIG_INIT;
  e.cfg.num_experts = 4; e.cfg.topk = 2; e.cfg.max_tokens = 4; e.cfg.hidden = 128; e.cfg.token_dtype = TW_E4M3;
  e.cfg.scale_block = 128;
  tw_comm *comms[2];
  cr_assert_eq(tw_comm_init_threads(2, comms), TW_OK);
  cr_assert_eq(tw_run_ranks(2, comms, errors_fn, &e), TW_OK, "%s", tw_last_error());
  for (int r = 0; r < 2; r++) tw_comm_destroy(comms[r]);
}
