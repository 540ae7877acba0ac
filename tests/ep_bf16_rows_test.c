/* bf16 expert outputs and gradients: combine, dispatch_bwd and combine_bwd accumulate in f32
 * in the documented order and round once to bf16, bit for bit; NaN codes on padding rows
 * must not leak. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_numerics.h"

enum { N = 2, E = 4, K = 2, H = 3, T = 5, A = 2 };

typedef struct {
  float x[N][T * H], w[N][T * K];
  int32_t idx[N][T * K];
  uint16_t dout[N][T * H], out[N][T * H], dtok[N][T * H];
} world;

static float f(float x, int e, int h) { return x * (float)(e + 1) + 0.3f * (float)h; }
static float g(float x, int e, int h) { return x * 0.7f - (float)e + 0.1f * (float)h; }
static int token_id(float v) { return (int)v; } /* column 0 holds r*16 + t */

static tw_status body(int r, tw_comm *comm, void *arg) {
  world *W = arg;
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
  float *recv = calloc((size_t)(R * H), 4), *rw = calloc((size_t)R, 4);
  uint16_t *y = calloc((size_t)(R * H), 2), *dy = calloc((size_t)(R * H), 2), *dexp = calloc((size_t)(R * H), 2);
  int32_t gs[E];
  tw_tensor none = tw_tensor_none();
  tw_tensor tok = tw_tensor_2d(W->x[r], TW_F32, T, H, TW_MEM_HOST), idx = tw_tensor_2d(W->idx[r], TW_I32, T, K, TW_MEM_HOST);
  tw_tensor w = tw_tensor_2d(W->w[r], TW_F32, T, K, TW_MEM_HOST), trecv = tw_tensor_2d(recv, TW_F32, R, H, TW_MEM_HOST);
  tw_tensor trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST), tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST);
  tw_tensor ty = tw_tensor_2d(y, TW_BF16, R, H, TW_MEM_HOST), tdy = tw_tensor_2d(dy, TW_BF16, R, H, TW_MEM_HOST);
  tw_tensor tout = tw_tensor_2d(W->out[r], TW_BF16, T, H, TW_MEM_HOST), tdtok = tw_tensor_2d(W->dtok[r], TW_BF16, T, H, TW_MEM_HOST);
  tw_tensor tdout = tw_tensor_2d(W->dout[r], TW_BF16, T, H, TW_MEM_HOST), tdexp = tw_tensor_2d(dexp, TW_BF16, R, H, TW_MEM_HOST);
  tw_status s = tw_ep_dispatch(ctx, layer, &tok, &none, &idx, &w, &trecv, &none, &trw, &tgs, &none);
  int64_t o = 0;
  for (int l = 0; s == TW_OK && l < nle; l++) {
    for (int64_t i = o; i < o + gs[l]; i++)
      for (int h = 0; h < H; h++) {
        int pad = rw[i] == 0.0f;
        y[i * H + h] = pad ? 0x7FC0 : tw_f32_to_bf16(f(recv[i * H + h], r * nle + l, h));
        dy[i * H + h] = pad ? 0x7FC0 : tw_f32_to_bf16(g(recv[i * H + h], r * nle + l, h));
      }
    o += gs[l];
  }
  for (int64_t i = o * H; i < R * H; i++) y[i] = dy[i] = 0x7FC0;
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, &ty, &w, &tout);
  if (s == TW_OK) s = tw_ep_dispatch_bwd(ctx, layer, &tdy, &none, &tdtok, &none);
  if (s == TW_OK) s = tw_ep_combine_bwd(ctx, layer, &tdout, &w, &none, &tdexp, &none);
  for (int64_t i = 0; s == TW_OK && i < R; i++)
    for (int h = 0; h < H; h++) {
      uint16_t want = 0;
      if (rw[i] != 0.0f) {
        int id = token_id(recv[i * H]), src = id / 16, t = id % 16;
        want = tw_f32_to_bf16(rw[i] * tw_bf16_to_f32(W->dout[src][t * H + h]));
      }
      if (dexp[i * H + h] != want)
        s = tw_error(TW_ERR_INTERNAL, "rank %d: d_expert_out[%lld, %d] = 0x%04x, expected 0x%04x", r, (long long)i, h,
                     dexp[i * H + h], want);
    }
  free(recv); free(rw); free(y); free(dy); free(dexp);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

Test(ep_bf16, combine_and_backward_round_once_to_bf16) {
  static world W;
  uint64_t st = 4;
  for (int r = 0; r < N; r++)
    for (int t = 0; t < T; t++) {
      int a = (int)tt_rand_uniform(&st, 0, E), b = (a + 1 + (int)tt_rand_uniform(&st, 0, E - 1)) % E;
      W.idx[r][t * K] = a;
      W.idx[r][t * K + 1] = b;
      W.w[r][t * K] = (float)tt_rand_uniform(&st, 0.1, 1);
      W.w[r][t * K + 1] = (float)tt_rand_uniform(&st, 0.1, 1);
      for (int h = 0; h < H; h++) {
        W.x[r][t * H + h] = h == 0 ? (float)(r * 16 + t) : (float)tt_rand_uniform(&st, -2, 2);
        W.dout[r][t * H + h] = tw_f32_to_bf16((float)tt_rand_uniform(&st, -1, 1));
      }
    }
  tw_comm *comms[N];
  cr_assert_eq(tw_comm_init_threads(N, comms), TW_OK);
  tw_status s = tw_run_ranks(N, comms, body, &W);
  cr_assert_eq(s, TW_OK, "%s", tw_last_error());
  for (int r = 0; r < N; r++) tw_comm_destroy(comms[r]);
  for (int r = 0; r < N; r++)
    for (int t = 0; t < T; t++)
      for (int h = 0; h < H; h++) {
        float acc = 0.0f, gacc = 0.0f, x = W.x[r][t * H + h];
        for (int j = 0; j < K; j++) {
          int e = W.idx[r][t * K + j];
          acc += W.w[r][t * K + j] * tw_bf16_to_f32(tw_f32_to_bf16(f(x, e, h)));
          gacc += tw_bf16_to_f32(tw_f32_to_bf16(g(x, e, h)));
        }
        cr_expect_eq(W.out[r][t * H + h], tw_f32_to_bf16(acc), "rank %d out[%d, %d] = 0x%04x, expected 0x%04x", r, t, h,
                     W.out[r][t * H + h], tw_f32_to_bf16(acc));
        cr_expect_eq(W.dtok[r][t * H + h], tw_f32_to_bf16(gacc), "rank %d d_tokens[%d, %d]", r, t, h);
      }
}
