/* Every validation error of tw_ep.h: the status and the piece of the message that carries
 * the values. One thread-rank group unless the error needs more ranks; each test starts
 * from a valid call (checked to succeed) and breaks one thing. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"

#define EXPECT_ERR(call, status, text) tt_expect_status((call), (status), (text))
#define EXPECT_OK(call) tt_expect_status((call), TW_OK, NULL)

enum { T = 3, H = 4, K = 2, E = 4, R = 32 };

typedef struct {
  tw_comm *comm;
  tw_ctx *ctx;
  tw_ep *ep;
  tw_ep_layer *layer;
  tw_ep_config cfg;
  float tok[T * H], w[T * K], recv[R * H], rw[R], out[T * H], y[R * H];
  int32_t idx[T * K], gs[E], dropped[E];
  tw_tensor ttok, tidx, tw_, trecv, trw, tgs, tdr, tout, ty, none;
} fx;

static void fx_init(fx *f, tw_ep_overflow policy, int64_t cap) {
  memset(f, 0, sizeof *f);
  cr_assert_eq(tw_comm_init_threads(1, &f->comm), TW_OK);
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = f->comm;
  cr_assert_eq(tw_ctx_create(&f->ctx, &cc), TW_OK);
  f->cfg = (tw_ep_config)TW_EP_CONFIG_INIT;
  f->cfg.num_experts = E; f->cfg.topk = K; f->cfg.max_tokens = T; f->cfg.hidden = H;
  f->cfg.token_dtype = TW_F32; f->cfg.recv_capacity = cap; f->cfg.overflow = policy;
  EXPECT_OK(tw_ep_create(f->ctx, f->comm, &f->cfg, &f->ep));
  EXPECT_OK(tw_ep_layer_create(f->ep, &f->layer));
  int32_t ids[T * K] = {0, 1, 2, 3, 1, 0};
  memcpy(f->idx, ids, sizeof ids);
  tt_fill_uniform_f32(f->tok, T * H, 1, -1, 1);
  tt_fill_uniform_f32(f->w, T * K, 2, 0, 1);
  int64_t Rr = tw_ep_recv_capacity(f->ep);
  cr_assert_leq(Rr, R);
  f->ttok = tw_tensor_2d(f->tok, TW_F32, T, H, TW_MEM_HOST);
  f->tidx = tw_tensor_2d(f->idx, TW_I32, T, K, TW_MEM_HOST);
  f->tw_ = tw_tensor_2d(f->w, TW_F32, T, K, TW_MEM_HOST);
  f->trecv = tw_tensor_2d(f->recv, TW_F32, Rr, H, TW_MEM_HOST);
  f->trw = tw_tensor_1d(f->rw, TW_F32, Rr, TW_MEM_HOST);
  f->tgs = tw_tensor_1d(f->gs, TW_I32, E, TW_MEM_HOST);
  f->tdr = tw_tensor_1d(f->dropped, TW_I32, E, TW_MEM_HOST);
  f->tout = tw_tensor_2d(f->out, TW_F32, T, H, TW_MEM_HOST);
  f->ty = tw_tensor_2d(f->y, TW_F32, Rr, H, TW_MEM_HOST);
  f->none = tw_tensor_none();
}

static void fx_fini(fx *f) {
  tw_ep_layer_destroy(f->layer);
  tw_ep_destroy(f->ep);
  tw_ctx_destroy(f->ctx);
  tw_comm_destroy(f->comm);
}

#define DISPATCH(f) tw_ep_dispatch((f).ctx, (f).layer, &(f).ttok, &(f).none, &(f).tidx, &(f).tw_, &(f).trecv, &(f).none, &(f).trw, &(f).tgs, &(f).tdr)

Test(ep_errors, valid_baseline) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 0);
  EXPECT_OK(DISPATCH(f));
  EXPECT_OK(tw_ep_combine(f.ctx, f.layer, &f.ty, &f.tw_, &f.tout));
  fx_fini(&f);
}

Test(ep_errors, expert_id_out_of_range_or_negative) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 0);
  f.idx[3] = 4;
  EXPECT_ERR(DISPATCH(f), TW_ERR_INVALID_ARG, "rank 0 topk_idx[1, 1] = 4 is outside [0, E = 4)");
  f.idx[3] = -2;
  EXPECT_ERR(DISPATCH(f), TW_ERR_INVALID_ARG, "topk_idx[1, 1] = -2");
  fx_fini(&f);
}

Test(ep_errors, duplicate_ids_in_one_token_are_rejected) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 0);
  f.idx[5] = 1; /* token 2: {1, 1} */
  EXPECT_ERR(DISPATCH(f), TW_ERR_INVALID_ARG, "token 2 lists expert 1 twice (slots 0 and 1)");
  fx_fini(&f);
}

Test(ep_errors, config_topk_and_experts) {
  tw_comm *comm;
  tw_ctx *ctx;
  cr_assert_eq(tw_comm_init_threads(1, &comm), TW_OK);
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK);
  tw_ep_config c = TW_EP_CONFIG_INIT;
  c.num_experts = 4; c.topk = 5; c.max_tokens = 2; c.hidden = 8;
  tw_ep *ep = NULL;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_INVALID_ARG, "topk = 5 must be in [1, num_experts = 4]");
  c.topk = 0;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_INVALID_ARG, "topk = 0");
  c.topk = 1;
  c.token_dtype = TW_E4M3;
  c.scale_block = 128; /* hidden 8 is not a multiple of 128 */
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_SHAPE, "hidden = 8 is not a multiple of the fp8 scale block 128");
  c.scale_block = 64;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_INVALID_ARG, "scale_block 128 (1x128) or 32 (MXFP8), got 64");
  c.token_dtype = TW_BF16;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_INVALID_ARG, "scale_block = 64 is for fp8 tokens only");
  c.scale_block = 0;
  c.token_dtype = TW_I32;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_DTYPE, "token_dtype i32");
  c.token_dtype = TW_BF16;
  c.alignment = 6;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_ALIGNMENT, "alignment = 6 is not a power of two");
  c.alignment = 8;
  c.recv_capacity = 12;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_ALIGNMENT, "recv_capacity = 12 is not a non-negative multiple of alignment 8");
  c.recv_capacity = 0;
  c.size = 4;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_INVALID_ARG, "cfg.size is 4");
  c.size = sizeof c;
  c.overflow = (tw_ep_overflow)5;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_INVALID_ARG, "unknown overflow policy 5");
  c.overflow = TW_EP_OVERFLOW_ERROR;
  /* sizes whose products leave int64 (R + 127 NLE, ep T k, R H) are refused, not computed */
  c.recv_capacity = (int64_t)1 << 62;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_SHAPE, "recv_capacity = 4611686018427387904: the sizes");
  c.recv_capacity = 0;
  c.max_tokens = INT64_MAX / 2;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_SHAPE, "max_tokens = 4611686018427387903");
  cr_expect_eq(tw_ep_capacity_no_drop(&c, 1), 0, "no R in int64 range: 0");
  c.max_tokens = INT64_MAX / 4;
  c.topk = -3; /* a negative k made the product negative, under the bound, and then overflow (libFuzzer) */
  cr_expect_eq(tw_ep_capacity_no_drop(&c, 2), 0, "k < 1: 0");
  c.topk = 1;
  c.max_tokens = 2;
  c.alignment = (int64_t)1 << 60;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_SHAPE, "alignment = 1152921504606846976");
  c.alignment = 8;
  c.hidden = (int64_t)1 << 61;
  EXPECT_ERR(tw_ep_create(ctx, comm, &c, &ep), TW_ERR_SHAPE, "the sizes they give are too large");
  cr_expect_null(ep);
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
}

static tw_status create_e3_on_two(int rank, tw_comm *comm, void *arg) {
  (void)rank; (void)arg;
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep_config c = TW_EP_CONFIG_INIT;
  c.num_experts = 3; c.topk = 1; c.max_tokens = 2; c.hidden = 8;
  tw_ep *ep = NULL;
  tw_status s = tw_ep_create(ctx, comm, &c, &ep);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

Test(ep_errors, experts_not_divisible_by_ep_size) {
  tw_comm *comms[2];
  cr_assert_eq(tw_comm_init_threads(2, comms), TW_OK);
  EXPECT_ERR(tw_run_ranks(2, comms, create_e3_on_two, NULL), TW_ERR_INVALID_ARG,
             "num_experts = 3 is not a positive multiple of ep_size = 2");
  tw_comm_destroy(comms[0]);
  tw_comm_destroy(comms[1]);
}

Test(ep_errors, more_tokens_than_max_tokens) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 0);
  f.ttok.shape[0] = T + 1;
  EXPECT_ERR(DISPATCH(f), TW_ERR_SHAPE, "rank 0 has T = 4 tokens, more than max_tokens = 3");
  fx_fini(&f);
}

Test(ep_errors, zero_tokens_is_valid) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 0);
  f.ttok.shape[0] = f.tidx.shape[0] = f.tw_.shape[0] = 0;
  EXPECT_OK(DISPATCH(f));
  for (int l = 0; l < E; l++) cr_expect_eq(f.gs[l], 0);
  fx_fini(&f);
}

Test(ep_errors, capacity_too_small_under_the_error_policy) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 4); /* 6 routes */
  EXPECT_ERR(DISPATCH(f), TW_ERR_INVALID_ARG, "rank 0 needs 6 receive rows");
  cr_expect(strstr(tw_last_error(), "recv_capacity is 4"), "%s", tw_last_error());
  /* nothing to combine after a failed dispatch */
  EXPECT_ERR(tw_ep_combine(f.ctx, f.layer, &f.ty, &f.tw_, &f.tout), TW_ERR_INVALID_ARG, "no successful dispatch");
  fx_fini(&f);
}

Test(ep_errors, drop_policy_needs_the_dropped_output) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_DROP, 4);
  EXPECT_ERR(tw_ep_dispatch(f.ctx, f.layer, &f.ttok, &f.none, &f.tidx, &f.tw_, &f.trecv, &f.none, &f.trw, &f.tgs, &f.none),
             TW_ERR_INVALID_ARG, "the drop policy needs the dropped output");
  EXPECT_OK(DISPATCH(f));
  int total = 0;
  for (int l = 0; l < E; l++) total += f.dropped[l];
  cr_expect_eq(total, 2, "6 routes into 4 rows drop 2, reported %d", total);
  fx_fini(&f);
}

Test(ep_errors, mismatched_dtypes_and_shapes) {
  fx f;
  fx_init(&f, TW_EP_OVERFLOW_ERROR, 0);
  tw_tensor bad = f.ttok;
  bad.dtype = TW_BF16;
  EXPECT_ERR(tw_ep_dispatch(f.ctx, f.layer, &bad, &f.none, &f.tidx, &f.tw_, &f.trecv, &f.none, &f.trw, &f.tgs, &f.tdr),
             TW_ERR_DTYPE, "tokens is bf16, expected f32");
  bad = f.tidx;
  bad.dtype = TW_I64;
  EXPECT_ERR(tw_ep_dispatch(f.ctx, f.layer, &f.ttok, &f.none, &bad, &f.tw_, &f.trecv, &f.none, &f.trw, &f.tgs, &f.tdr),
             TW_ERR_DTYPE, "topk_idx is i64, expected i32");
  bad = f.tgs;
  bad.shape[0] = 3;
  EXPECT_ERR(tw_ep_dispatch(f.ctx, f.layer, &f.ttok, &f.none, &f.tidx, &f.tw_, &f.trecv, &f.none, &f.trw, &bad, &f.tdr),
             TW_ERR_SHAPE, "group_sizes is [3] i32, expected [4]");
  bad = f.ttok;
  bad.shape[1] = 5;
  EXPECT_ERR(tw_ep_dispatch(f.ctx, f.layer, &bad, &f.none, &f.tidx, &f.tw_, &f.trecv, &f.none, &f.trw, &f.tgs, &f.tdr),
             TW_ERR_SHAPE, "tokens is [3, 5] f32, expected [3, 4]");
  tw_tensor scl = tw_tensor_2d(f.w, TW_F32, T, 1, TW_MEM_HOST);
  EXPECT_ERR(tw_ep_dispatch(f.ctx, f.layer, &f.ttok, &scl, &f.tidx, &f.tw_, &f.trecv, &f.none, &f.trw, &f.tgs, &f.tdr),
             TW_ERR_INVALID_ARG, "for fp8 tokens only");
  EXPECT_OK(DISPATCH(f));
  bad = f.tout;
  bad.dtype = TW_BF16;
  EXPECT_ERR(tw_ep_combine(f.ctx, f.layer, &f.ty, &f.tw_, &bad), TW_ERR_DTYPE, "out is bf16 but expert_out is f32");
  bad = f.tout;
  bad.shape[0] = 2;
  EXPECT_ERR(tw_ep_combine(f.ctx, f.layer, &f.ty, &f.tw_, &bad), TW_ERR_SHAPE, "out is [2, 4] f32, expected [3, 4]");
  tw_tensor dtw = tw_tensor_2d(f.w, TW_F32, T, K, TW_MEM_HOST);
  EXPECT_ERR(tw_ep_combine_bwd(f.ctx, f.layer, &f.tout, &f.none, &f.ty, &f.ty, &dtw), TW_ERR_INVALID_ARG,
             "d_topk_weights needs the weighted form");
  EXPECT_ERR(tw_ep_dispatch_bwd(f.ctx, f.layer, &f.ty, &f.trw, &f.tout, &f.none), TW_ERR_INVALID_ARG,
             "come together");
  fx_fini(&f);
}

/* A backend without EP (the gpu table today) is TW_ERR_UNSUPPORTED, named. */
#include "core/backend.h"
Test(ep_errors, backend_without_ep_is_unsupported_and_named) {
  tw_comm *comm;
  tw_ctx *ctx;
  cr_assert_eq(tw_comm_init_threads(1, &comm), TW_OK);
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  cr_assert_eq(tw_ctx_create(&ctx, &cc), TW_OK);
  tw_backend_ops fake = tw_ref_ops;
  fake.name = "noep";
  fake.ep = NULL;
  struct tw_ctx fctx = *ctx;
  fctx.ops = &fake;
  tw_ep_config c = TW_EP_CONFIG_INIT;
  c.num_experts = 4; c.topk = 1; c.max_tokens = 2; c.hidden = 8;
  tw_ep *ep = NULL;
  EXPECT_ERR(tw_ep_create(&fctx, comm, &c, &ep), TW_ERR_UNSUPPORTED, "ep_create: the noep backend does not provide it");
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
}

Test(ep_errors, workspace_bytes_are_reported_and_grow_with_the_config) {
  tw_ep_config c = TW_EP_CONFIG_INIT;
  c.num_experts = 8; c.topk = 2; c.max_tokens = 16; c.hidden = 64;
  size_t ws = 0, ls = 0, ws2 = 0, ls2 = 0;
  EXPECT_OK(tw_ep_workspace_bytes(&c, 4, &ws, &ls));
  /* by hand from the create functions (bf16, H 64, E 8, k 2, T 16, 4 ranks: NLE 2, R 128, 32
   * routes, rows of max(128, 256) + 4 = 260 bytes): workspace = the LSA window, 28544 bytes of
   * regions rounded to 2 MiB plus its 4 x 8 + 64-byte peer table = 2097248 (> the gpu slots, 2 x
   * 4 ranks x S 32 x 272 = 69632, and ref's 160 x 260 = 41600); layer = the gpu tables, 380 i64 +
   * 1113 i32 = 7492 (> ref's 2384) */
  cr_expect_eq(ws, 2097248);
  cr_expect_eq(ls, 7492);
  c.hidden = 4096; /* past the window's 2 MiB rounding */
  c.max_tokens = 32;
  EXPECT_OK(tw_ep_workspace_bytes(&c, 4, &ws2, &ls2));
  cr_expect_gt(ws2, ws);
  cr_expect_gt(ls2, ls);
  cr_expect_eq(tw_ep_capacity_no_drop(&c, 4), 4 * 32 * 2, "no alignment: ep * T * min(k, NLE)");
  c.alignment = 8;
  cr_expect_eq(tw_ep_capacity_no_drop(&c, 4), 256 + 2 * 7 + 2, "roundup(256 + NLE * 7, 8)");
  /* sizes whose products pass the config's checks but not the byte count: refused, not wrapped */
  tw_ep_config big = TW_EP_CONFIG_INIT;
  big.num_experts = 1024; big.topk = 1024; big.max_tokens = (int64_t)1 << 20; big.hidden = (int64_t)1 << 32;
  big.recv_capacity = 1;
  tw_status bs = tw_ep_workspace_bytes(&big, 1, &ws, &ls);
  cr_expect(bs == TW_ERR_SHAPE && strstr(tw_last_error(), "past 9e15"), "huge config: status %d (%s)", bs, tw_last_error());
  c.num_experts = 6;
  EXPECT_ERR(tw_ep_workspace_bytes(&c, 4, &ws, &ls), TW_ERR_INVALID_ARG, "num_experts = 6 is not a positive multiple of ep_size = 4");
}

static tw_status bad_id_on_rank_1(int rank, tw_comm *comm, void *arg) {
  (void)arg;
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep_config c = TW_EP_CONFIG_INIT;
  c.num_experts = 4; c.topk = 1; c.max_tokens = 2; c.hidden = 2; c.token_dtype = TW_F32;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  tw_status s = tw_ep_create(ctx, comm, &c, &ep);
  if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
  float x[4] = {0}, w[2] = {1, 1}, recv[64], rw[32];
  int32_t idx[2] = {0, rank == 1 ? 9 : 1}, gs[2];
  int64_t R = tw_ep_recv_capacity(ep);
  tw_tensor none = tw_tensor_none(), tx = tw_tensor_2d(x, TW_F32, 2, 2, TW_MEM_HOST);
  tw_tensor ti = tw_tensor_2d(idx, TW_I32, 2, 1, TW_MEM_HOST), tw_ = tw_tensor_2d(w, TW_F32, 2, 1, TW_MEM_HOST);
  tw_tensor tr = tw_tensor_2d(recv, TW_F32, R, 2, TW_MEM_HOST), trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor tg = tw_tensor_1d(gs, TW_I32, 2, TW_MEM_HOST);
  if (s == TW_OK) s = tw_ep_dispatch(ctx, layer, &tx, &none, &ti, &tw_, &tr, &none, &trw, &tg, &none);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

/* One rank's bad input fails that rank before any collective; its peer, already waiting in
 * the dispatch's all-gather, returns when tw_run_ranks aborts the group: no hang. */
Test(ep_errors, bad_input_on_one_rank_does_not_hang_the_group, .timeout = 30) {
  tw_comm *comms[2];
  cr_assert_eq(tw_comm_init_threads(2, comms), TW_OK);
  tw_status s = tw_run_ranks(2, comms, bad_id_on_rank_1, NULL);
  cr_expect_neq(s, TW_OK);
  tw_comm_destroy(comms[0]);
  tw_comm_destroy(comms[1]);
}
