/* The MoE block on ref thread ranks (or one rank on any context) from global f32 tensors (tests, `twin` tools): each rank
 * takes its token shard (dim 0 split over (dp, fsdp, ep), ep minor), the experts of its ep
 * coordinate and, with fsdp, its shard of their H dim (wi rows, wo columns), runs forward
 * then backward, and the global outputs are put back together. */
#ifndef TWIN_MOE_THREADS_H
#define TWIN_MOE_THREADS_H

#include "twin/tw_moe.h"

typedef struct {
  tw_moe_config cfg;   /* max_tokens and global_tokens are set by the runner */
  tw_mesh mesh;        /* naxes 0: one rank */
  int64_t T;           /* global tokens (T % ranks == 0) */
  /* inputs, global, f32 (the BF16 recipe rounds them to bf16 first): x [T, H], gate [H, E],
   * wi [E, H, 2F], wo [E, F, H], bi [E, 2F] and bo [E, H] or NULL, d_out [T, H],
   * expert_bias [E] or NULL (sigmoid only) */
  const float *x, *gate, *wi, *wo, *bi, *bo, *d_out, *expert_bias;
  float d_aux;
  int layers;          /* 1, or 2: two layers interleaved (fwd 1, fwd 2, bwd 2, bwd 1), layer 2
                        * on other tokens (x and d_out swapped); the outputs are layer 1's */
  int bf16_grads;      /* 1: d_wi and d_wo come back from the block as bf16 (widened to f32 here);
                        * recipes with bf16 weights only */
  int reuse;           /* 1: a step on other tokens first (fwd + bwd, x and d_out swapped),
                        * then the step whose outputs are returned, with tw_moe_set_weight_reuse
                        * on: it takes the first step's gathered / fp8 weights */
  /* outputs, global, f32 (caller's memory): out, dx [T, H]; aux [1]; dgate [H, E];
   * dwi [E, H, 2F], dwo [E, F, H]; dbi, dbo when bi/bo are given. NULL: not wanted. */
  float *out, *aux, *dx, *dgate, *dwi, *dwo, *dbi, *dbo;
} tw_moe_threads_run;

tw_status tw_moe_run_threads(tw_moe_threads_run *run);

/* One rank's part of run on ctx (any backend; ctx's communicator is the rank's world of
 * nranks, and run->mesh must be set): inputs staged into ctx memory, outputs written back
 * into run's global host buffers. tw_moe_run_threads calls it on ref thread ranks; GPU tests
 * call it with a device context. */
tw_status tw_moe_run_rank(tw_ctx *ctx, const tw_moe_threads_run *run, int rank, int nranks);

#endif
