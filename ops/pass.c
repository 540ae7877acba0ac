/* ops/pass.h: the global GEMM of a pass, through the public interface. */
#include "ops/pass.h"

#include <math.h>
#include <stdlib.h>

#include "twin/tw_check.h"
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

tw_status tw_pass_lifted_abs(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *gs, int64_t rows, int64_t cols,
                             float *out) {
  const int64_t n = rows * cols;
  uint8_t *codes = (uint8_t *)malloc((size_t)(n ? n : 1));
  if (!codes) return tw_error(TW_ERR_MEMORY, "lifted_abs: out of host memory");
  tw_qtensor l = *q;
  l.row_data.data = codes;
  tw_status s = tw_fp8_lift_subnormal_codes((const uint8_t *)q->row_data.data, n, q->qdtype, codes);
  tw_tensor o = tw_tensor_2d(out, TW_F32, rows, cols, TW_MEM_HOST);
  if (s == TW_OK) s = tw_grouped_dequantize(ctx, &l, gs, 0, &o);
  for (int64_t i = 0; s == TW_OK && i < n; i++) out[i] = fabsf(out[i]);
  free(codes);
  return s;
}
