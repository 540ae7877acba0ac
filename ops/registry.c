/* The table of operations (registry.h says how to add one). Order: numerics, quantize, GEMM,
 * routing (router, EP), the pipeline, the MoE block. */
#include "ops/registry.h"

#include <stdio.h>
#include <string.h>

#include "core/backend.h"
#include "core/backend_moe.h"
#include "ops/bench_ref.h"

/* The gpu benches are linked only into //tools:twin (tools/bench_gpu_*.c): weak, NULL elsewhere. */
#pragma weak tw_bench_gpu_quantize
#pragma weak tw_bench_gpu_gemm
#pragma weak tw_bench_gpu_moe
#pragma weak tw_bench_gpu_pipeline
#pragma weak tw_bench_gpu_ep
/* The routing and pipeline fuzzers (fuzz/entry_fuzzers.c) are linked into //tools:twin. */
#pragma weak tw_fuzz_run_router
#pragma weak tw_fuzz_run_ep
#pragma weak tw_fuzz_run_pipeline
#pragma weak tw_fuzz_run_moe

#define GG_VERSIONS "gg_mma_wide", "gg_mma", "gg_fma"

static const tw_op_entry table[] = {
    {.name = "cast",
     .backend_slot = TW_BACKEND_SLOT(cast),
     .area = "numerics",
     .summary = "element-wise conversion between f32, bf16, f16, fp8 e4m3/e5m2, e8m0, fp4 e2m1 (RNE, saturating)",
     .compare = TW_COMPARE_EXACT,
     .fuzz_kind = "cast",
     .min_ranks = 1,
     .auto_rule = "one kernel"},
    {.name = "grouped_quantize",
     .backend_slot = TW_BACKEND_SLOT(grouped_quantize),
     .alias = "quantize",
     .area = "quantize",
     .summary = "x [M, K] split along M by group_sizes: current, delayed, MXFP8, 1x128, 128x128 scaling; rowwise/colwise",
     .compare = TW_COMPARE_EXACT,
     .golden_op = "grouped_quantize",
     .fuzz_kind = "quantize",
     .shard_rule = "grouped_quantize",
     .min_ranks = 1,
     .versions = {"quantize_tile_spec", "quantize_rows", "quantize_tile_async", "quantize_tile_vec",
                  "quantize_tile_scalar"},
     .auto_rule = "quantize_rows for tensor scaling rowwise, else quantize_tile_spec where it compiles, else "
                  "quantize_rows (rowwise modes), quantize_tile_async (16-bit x), quantize_tile_vec",
     .bench_ref = tw_bench_ref_quantize,
     .bench_gpu = tw_bench_gpu_quantize},
    {.name = "grouped_dequantize",
     .backend_slot = TW_BACKEND_SLOT(grouped_dequantize),
     .alias = "dequantize",
     .area = "quantize",
     .summary = "codes and scales back to values, per group (the inverse the checker's bounds use)",
     .compare = TW_COMPARE_EXACT,
     .golden_op = "grouped_dequantize",
     .min_ranks = 1,
     .auto_rule = "one kernel"},
    {.name = "delayed_scale_update",
     .backend_slot = TW_BACKEND_SLOT(delayed_scale_update),
     .area = "quantize",
     .summary = "amax history roll and scale = f(history) for delayed scaling (max or most_recent)",
     .compare = TW_COMPARE_EXACT,
     .golden_op = "delayed_scale_update",
     .min_ranks = 1,
     .auto_rule = "one kernel"},
    {.name = "gemm",
     .backend_slot = TW_BACKEND_SLOT(gemm),
     .area = "gemm",
     .summary = "dense / batched ([B,] M, K) x ([B,] K, N), NN/NT/TN, bf16/f16/f32 and fp8 operands",
     .compare = TW_COMPARE_BOUND,
     .golden_op = "gemm",
     .fuzz_kind = "gemm",
     .shard_rule = "dense",
     .min_ranks = 1,
     .versions = {"gemm_lt", GG_VERSIONS},
     .auto_rule = "gemm_lt (cuBLASLt) for plain operands of one dtype, else gg_mma_wide where it fits, gg_mma, "
                  "gg_fma for f32",
     .bench_gpu = tw_bench_gpu_gemm},
    {.name = "grouped_gemm",
     .backend_slot = TW_BACKEND_SLOT(grouped_gemm),
     .area = "gemm",
     .summary = "lhs [M, K] ragged along M by device group_sizes x rhs [G, K, N] or [G, N, K]",
     .compare = TW_COMPARE_BOUND,
     .golden_op = "grouped_gemm",
     .fuzz_kind = "grouped_gemm",
     .shard_rule = "grouped_gemm",
     .min_ranks = 1,
     .versions = {GG_VERSIONS, "gg_lt_loop"},
     .auto_rule = "gg_mma_wide where the device grants its shared memory, else gg_mma; gg_fma when an operand is f32",
     .bench_ref = tw_bench_ref_grouped_gemm,
     .bench_gpu = tw_bench_gpu_gemm},
    {.name = "grouped_gemm_wgrad",
     .backend_slot = TW_BACKEND_SLOT(grouped_gemm_wgrad),
     .alias = "wgrad",
     .area = "gemm",
     .summary = "weight gradient: ragged contracting dim -> [G, K, N]",
     .compare = TW_COMPARE_BOUND,
     .golden_op = "grouped_gemm_wgrad",
     .fuzz_kind = "wgrad",
     .shard_rule = "grouped_gemm",
     .min_ranks = 1,
     .versions = {GG_VERSIONS},
     .auto_rule = "gg_wgmma on sm_90 for plain bf16/f16 lhs [M, K], rhs [M, N] (K, N multiples of 8), else "
                  "gg_mma_wide where it fits, else gg_mma; gg_fma when an operand is f32",
     .bench_gpu = tw_bench_gpu_gemm},
    {.name = "grouped_gemm_rows",
     .backend_slot = TW_BACKEND_SLOT(grouped_gemm_rows),
     .area = "gemm",
     .summary = "grouped forward with a row-gathered lhs: row i read from data row lhs_rows[i] of [U, K] (EP rows "
                "by source)",
     .compare = TW_COMPARE_BOUND,
     .golden_op = "grouped_gemm_rows",
     .min_ranks = 1,
     .versions = {"gg_mma_wide", "gg_mma", "gg_fma"},
     .auto_rule = "gg_mma_wide where it fits, else gg_mma; gg_fma when an operand is f32 (the row index in their "
                  "general tile loader; the wgmma versions do not take it yet)"},
    {.name = "grouped_gemm_wgrad_rows",
     .backend_slot = TW_BACKEND_SLOT(grouped_gemm_wgrad_rows),
     .area = "gemm",
     .summary = "grouped wgrad with a row-gathered lhs (plain operands)",
     .compare = TW_COMPARE_BOUND,
     .golden_op = "grouped_gemm_wgrad_rows",
     .min_ranks = 1,
     .versions = {"gg_mma_wide", "gg_mma", "gg_fma"},
     .auto_rule = "as grouped_gemm_rows"},
    {.name = "router",
     .backend_slot = TW_BACKEND_SLOT(router),
     .area = "routing",
     .summary = "logits [T, E] -> top-k ids, weights, counts (softmax pre/post, sigmoid + bias, group-limited); "
                "backward, aux loss",
     .compare = TW_COMPARE_BOUND,
     .golden_op = "router",
     .min_ranks = 1,
     .versions = {"router_warp"},
     .auto_rule = "one formula (f64 inside, rounded once to f32); gpu: router_warp (one warp per token)",
     .fuzz_run = tw_fuzz_run_router},
    {.name = "ep",
     .alias = "ep_dispatch",
     .backend_slot = TW_BACKEND_SLOT(ep),
     .area = "routing",
     .summary = "EP dispatch to the experts' ranks (expert-major, aligned slabs, group sizes), combine, both "
                "backward; capacity policies, fp8 rows with their scales",
     .compare = TW_COMPARE_EXACT,
     .golden_op = "ep",
     .min_ranks = 1,
     .versions = {"ep_nccl_slots", "ep_nccl_lsa"},
     .auto_rule = "ref: all-gathered counts, one all_to_allv per step; gpu: ep_nccl_slots (counts on the device, "
                  "fixed per-peer slots over grouped ncclSend/ncclRecv); ep_nccl_lsa (NCCL symmetric window, counts "
                  "and rows stored straight into the peers' windows over LSA pointers, dispatch and combine; the "
                  "backward on slots) when forced by name; `twin backends` says which and why",
     .bench_gpu = tw_bench_gpu_ep,
     .fuzz_run = tw_fuzz_run_ep,
     .planted = "ep_wrong_rank ep_drop_last_of_full_slab"},
    {.name = "pipeline",
     .area = "pipeline",
     .summary = "circular pipeline scan (S stages x R repeats x M microbatches) with its custom VJP, plain "
                "FSDP or the BSW window, over the interface",
     .compare = TW_COMPARE_BOUND,
     .min_ranks = 2,
     .above_interface = 1,
     .auto_rule = "one schedule (pipeline/scan.c) on any backend's communicator",
     .bench_gpu = tw_bench_gpu_pipeline,
     .fuzz_run = tw_fuzz_run_pipeline,
     .planted = "pipeline_stale_window"},
    {.name = "moe",
     .area = "moe",
     .summary = "MoE block: router -> dispatch -> grouped FFN (SwiGLU/GeGLU/bilinear) -> combine with its "
                "hand-written VJP, over the interface (f32, bf16; dp x ep)",
     .compare = TW_COMPARE_BOUND,
     .min_ranks = 1,
     .above_interface = 1,
     .auto_rule = "one block (moe/block.c) over the public ops on any backend",
     .bench_gpu = tw_bench_gpu_moe,
     .fuzz_run = tw_fuzz_run_moe,
     .planted = "moe_skip_dp_reduce"},
};

enum { COUNT = (int)(sizeof table / sizeof table[0]) };

int tw_op_count(void) { return COUNT; }

int tw_op_provided(const tw_op_entry *e, const struct tw_backend_ops *table) {
  if (e && table && e->above_interface) return 1;
  if (!e || !table || !e->backend_slot) return 0;
  void *fn;
  memcpy(&fn, (const char *)table + e->backend_slot, sizeof fn);
  return fn != NULL;
}
const tw_op_entry *tw_op_at(int i) { return i >= 0 && i < COUNT ? &table[i] : NULL; }

const tw_op_entry *tw_op_find(const char *name) {
  for (int i = 0; name && i < COUNT; i++)
    if (!strcmp(table[i].name, name) || (table[i].alias && !strcmp(table[i].alias, name))) return &table[i];
  return NULL;
}

const tw_op_entry *tw_op_for_golden(const char *golden_op) {
  for (int i = 0; golden_op && i < COUNT; i++)
    if (table[i].golden_op && !strcmp(table[i].golden_op, golden_op)) return &table[i];
  return NULL;
}

int tw_op_matches(const tw_op_entry *e, const char *filter) {
  if (!filter || !*filter || !strcmp(filter, "all")) return 1;
  return strstr(e->name, filter) || (e->alias && strstr(e->alias, filter));
}

const char *tw_op_names(void) {
  static char buf[512];
  if (!buf[0])
    for (int i = 0; i < COUNT; i++) {
      size_t n = strlen(buf);
      snprintf(buf + n, sizeof buf - n, "%s%s", i ? ", " : "", table[i].name);
    }
  return buf;
}
