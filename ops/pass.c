/* ops/pass.h: the global GEMM of a pass, through the public interface. */
#include "ops/pass.h"

#include "twin/tw_gemm.h"

/* [B, R, C] seen as [B*R, C] */
static tw_tensor flat2(const tw_tensor *t) {
  if (t->ndim != 3) return *t;
  return tw_tensor_2d(t->data, t->dtype, t->shape[0] * t->shape[1], t->shape[2], t->mem);
}

tw_status tw_pass_gemm(tw_ctx *ctx, tw_shard_op op, tw_pass pass, const tw_tensor *a, const tw_tensor *b,
                       const tw_tensor *gs, tw_tensor *out) {
  tw_operand oa = tw_operand_plain(a), ob = tw_operand_plain(b);
  if (op == TW_SHARD_DENSE) {
    if (pass == TW_PASS_FWD) return tw_gemm(ctx, &oa, TW_OP_N, &ob, TW_OP_N, out, 0);
    if (pass == TW_PASS_DGRAD) return tw_gemm(ctx, &oa, TW_OP_N, &ob, TW_OP_T, out, 0);
    tw_tensor af = *a, bf = *b;
    if (out->ndim == 2 && a->ndim == 3) { /* w shared over the batch: contract B and M */
      af = flat2(a);
      bf = flat2(b);
    }
    oa = tw_operand_plain(&af);
    ob = tw_operand_plain(&bf);
    return tw_gemm(ctx, &oa, TW_OP_T, &ob, TW_OP_N, out, 0);
  }
  if (pass == TW_PASS_FWD) return tw_grouped_gemm(ctx, &oa, &ob, TW_OP_N, gs, out, 0);
  if (pass == TW_PASS_DGRAD) return tw_grouped_gemm(ctx, &oa, &ob, TW_OP_T, gs, out, 0);
  return tw_grouped_gemm_wgrad(ctx, &oa, TW_OP_N, &ob, TW_OP_N, gs, out, 0);
}
