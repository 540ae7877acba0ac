/* Runs the pipeline on S*F ref thread ranks from global tensors and gathers the results back:
 * what the tests, the fuzz runner and (later) `twin fuzz/bench --op pipeline` call. */
#ifndef TWIN_PIPELINE_THREADS_H
#define TWIN_PIPELINE_THREADS_H

#include "twin/tw_pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  tw_pipeline_config cfg;
  int fsdp;                                  /* F; the mesh is pp=S,fsdp=F */
  tw_pipeline_body body;
  /* global host inputs: x [M, mb, E], parameter i [R, S, Lps, rows_i, cols_i], dy like x
   * (NULL: forward only) */
  const float *x;
  const float *w[TW_PIPELINE_MAX_PARAMS];
  const float *dy;
  /* global host outputs, written by the ranks that own them (dx, dw only with dy) */
  float *y, *dx;
  float *dw[TW_PIPELINE_MAX_PARAMS];
  /* measured on the ranks: the largest saved state and window any rank held */
  size_t saved_bytes, window_bytes;
  /* optional, S*F entries: what rank r's context ledger (tw_ctx_memory) held at its peak during
   * forward + backward beyond the rank's inputs; tw_pipeline_peak_bytes predicts it */
  size_t *rank_peak_bytes;
  double timeout_s;                          /* per collective; 0 = 30 s */
  int loopback;                              /* 1: the loopback communicator
                                                (pipeline/loopback_comm.h) instead of the
                                                ref thread communicator */
} tw_pipeline_threads_run;

/* Collective-free from the caller's view: makes the S*F thread ranks, runs forward (and
 * backward) on each, places the shards. The first failing rank's status and message. */
tw_status tw_pipeline_run_threads(tw_pipeline_threads_run *run);

/* One rank's part on any backend: slices its shards of the global host tensors, moves them
 * into ctx memory, runs forward (and backward) over the mesh's communicators split from ctx's
 * communicator, and places its results in the global host outputs. Every rank of the mesh
 * calls it together (tw_pipeline_run_threads does, on ref thread ranks; the gpu tests do, one
 * thread per GPU over NCCL). saved_bytes / window_bytes (may be NULL) get what it held;
 * step_s (may be NULL) the wall time of forward + backward on this rank, inputs already in
 * ctx memory and the context synchronized before and after; peak_bytes (may be NULL) the most ctx's
 * allocation ledger held during forward + backward beyond the inputs (tw_ctx_memory). */
tw_status tw_pipeline_run_rank(tw_ctx *ctx, const tw_mesh *mesh, int rank, tw_pipeline_threads_run *run,
                               size_t *saved_bytes, size_t *window_bytes, double *step_s, size_t *peak_bytes);

/* Element counts of the global tensors of a configuration. */
int64_t tw_pipeline_act_elems(const tw_pipeline_config *cfg, const tw_pipeline_body *b);   /* M*mb*E */
int64_t tw_pipeline_param_elems(const tw_pipeline_config *cfg, const tw_pipeline_body *b, int i); /* layers*rows*cols */

#ifdef __cplusplus
}
#endif
#endif
