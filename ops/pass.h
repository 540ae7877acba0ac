/* Running the global GEMM of one pass of a sharding rule family: the one definition that the
 * sharding sweep (shard/golden.c) and the sharded fuzzer (fuzz/shard_run.c) compare the
 * sharded result against.
 *   fwd    out = x w       dense ([B,] M, K) x (K, N); grouped: x ragged by gs x w [G, K, N]
 *   dgrad  out = dy w^T
 *   wgrad  out = x^T dy    dense with w shared over a batch: B and M contracted together;
 *                          grouped: per group -> [G, K, N]
 * a and b are the pass's operands in that order (fwd: x, w; dgrad: dy, w; wgrad: x, dy). */
#ifndef TWIN_OPS_PASS_H
#define TWIN_OPS_PASS_H

#include "twin/tw_base.h"
#include "twin/tw_quantize.h"
#include "twin/tw_shard.h"

tw_status tw_pass_gemm(tw_ctx *ctx, tw_shard_op op, tw_pass pass, const tw_tensor *a, const tw_tensor *b,
                       const tw_tensor *gs, tw_tensor *out);

/* The magnitudes the promoted accuracy model of an fp8 pass takes (tw_check.h): |dequantized q|
 * with every nonzero subnormal code lifted to the smallest normal one
 * (tw_fp8_lift_subnormal_codes), into out (host, rows x cols of the source). q's rowwise data and
 * out are host memory; ctx is a host (ref) context; gs are q's group sizes. */
tw_status tw_pass_lifted_abs(tw_ctx *ctx, const tw_qtensor *q, const tw_tensor *gs, int64_t rows, int64_t cols,
                             float *out);

#endif
