/* The routing chain with no host step between the ops: dispatch's group_sizes go straight
 * into tw_grouped_gemm (recv rows x the rank's expert weights), whose output goes straight
 * into combine. Checked against out[t] = sum_j w[t,j] * (x[t] @ W[e_tj]) in f64 within the
 * f32 GEMM's error; rows past the groups are NaN-poisoned (the GEMM leaves them unwritten)
 * and must not reach the output. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_gemm.h"

enum { N = 2, E = 4, K = 2, H = 8, T = 9, A = 4 };

typedef struct {
  float x[N][T * H], w[N][T * K], W[E * H * H];
  int32_t idx[N][T * K];
  float out[N][T * H];
} chain;

static tw_status body(int r, tw_comm *comm, void *arg) {
  chain *c = arg;
  tw_ctx *ctx;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = E; cfg.topk = K; cfg.max_tokens = T; cfg.hidden = H; cfg.token_dtype = TW_F32; cfg.alignment = A;
  tw_ep *ep;
  tw_ep_layer *layer;
  TW_TRY(tw_ep_create(ctx, comm, &cfg, &ep));
  TW_TRY(tw_ep_layer_create(ep, &layer));
  int64_t R = tw_ep_recv_capacity(ep);
  int nle = tw_ep_local_experts(ep);
  float *recv = malloc((size_t)(R * H) * 4), *rw = malloc((size_t)R * 4), *y = malloc((size_t)(R * H) * 4);
  int32_t gs[E];
  for (int64_t i = 0; i < R * H; i++) y[i] = NAN;
  tw_tensor none = tw_tensor_none();
  tw_tensor tok = tw_tensor_2d(c->x[r], TW_F32, T, H, TW_MEM_HOST), idx = tw_tensor_2d(c->idx[r], TW_I32, T, K, TW_MEM_HOST);
  tw_tensor w = tw_tensor_2d(c->w[r], TW_F32, T, K, TW_MEM_HOST), trecv = tw_tensor_2d(recv, TW_F32, R, H, TW_MEM_HOST);
  tw_tensor trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST), tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST);
  tw_tensor ty = tw_tensor_2d(y, TW_F32, R, H, TW_MEM_HOST), tout = tw_tensor_2d(c->out[r], TW_F32, T, H, TW_MEM_HOST);
  tw_tensor rhs = tw_tensor_3d(c->W + (size_t)r * nle * H * H, TW_F32, nle, H, H, TW_MEM_HOST);
  tw_status s = tw_ep_dispatch(ctx, layer, &tok, &none, &idx, &w, &trecv, &none, &trw, &tgs, &none);
  tw_operand lhs = tw_operand_plain(&trecv), wop = tw_operand_plain(&rhs);
  if (s == TW_OK) s = tw_grouped_gemm(ctx, &lhs, &wop, TW_OP_N, &tgs, &ty, 0);
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, &ty, &w, &tout);
  free(recv); free(rw); free(y);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

Test(ep_chain, dispatch_group_sizes_feed_grouped_gemm_then_combine) {
  static chain c;
  uint64_t st = 9;
  tt_fill_uniform_f32(c.W, E * H * H, 3, -1, 1);
  for (int r = 0; r < N; r++) {
    tt_fill_uniform_f32(c.x[r], T * H, 10 + r, -1, 1);
    tt_fill_uniform_f32(c.w[r], T * K, 20 + r, 0.1f, 1);
    for (int t = 0; t < T; t++) {
      int a = (int)tt_rand_uniform(&st, 0, E), b = (a + 1 + (int)tt_rand_uniform(&st, 0, E - 1)) % E;
      c.idx[r][t * K] = a;
      c.idx[r][t * K + 1] = b;
    }
  }
  tw_comm *comms[N];
  cr_assert_eq(tw_comm_init_threads(N, comms), TW_OK);
  tw_status s = tw_run_ranks(N, comms, body, &c);
  cr_assert_eq(s, TW_OK, "%s", tw_last_error());
  for (int r = 0; r < N; r++) tw_comm_destroy(comms[r]);
  for (int r = 0; r < N; r++)
    for (int t = 0; t < T; t++)
      for (int n = 0; n < H; n++) {
        double want = 0, mag = 0;
        for (int j = 0; j < K; j++) {
          int e = c.idx[r][t * K + j];
          for (int h = 0; h < H; h++) {
            double p = (double)c.x[r][t * H + h] * c.W[(e * H + h) * H + n];
            want += c.w[r][t * K + j] * p;
            mag += fabs(c.w[r][t * K + j] * p);
          }
        }
        double got = c.out[r][t * H + n];
        cr_expect(fabs(got - want) <= 1e-5 * mag + 1e-6, "rank %d out[%d, %d] = %.9g, formula %.9g", r, t, n, got, want);
      }
}
