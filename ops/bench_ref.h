/* The ref backend's benches, one per registry entry that has one (ops/registry.c). */
#ifndef TWIN_OPS_BENCH_REF_H
#define TWIN_OPS_BENCH_REF_H

#include "ops/bench.h"
#include "twin/tw_base.h"

int tw_bench_ref_grouped_gemm(const tw_bench_cfg *cfg, tw_ctx *ctx);
int tw_bench_ref_quantize(const tw_bench_cfg *cfg, tw_ctx *ctx);

#endif
