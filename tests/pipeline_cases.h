/* The stored pipeline goldens (golden/gen_pipeline.py: the sequential model in JAX, f64,
 * jax.grad), shared by the ref test (pipeline_golden_test) and the gpu test over NCCL
 * (pipeline_gpu_test). Bound, for any backend that accumulates in f32 (u = 2^-24, L layers):
 *   forward  |got - exact| <= L (E + H + 8) u (|exact| + rms(exact))
 *   gradient |got - exact| <= L (E + H + 8 + M mb) u (|exact| + rms(exact))
 * (pipeline_golden_test.c says where each term comes from). */
#ifndef TWIN_TESTS_PIPELINE_CASES_H
#define TWIN_TESTS_PIPELINE_CASES_H

#include <stdint.h>

#include "twin/tw_pipeline.h"

typedef struct {
  tw_pipeline_config cfg; /* S, M, R, d, Lps, layers, mb_rows, fsdp mode */
  int F, E, H;            /* fsdp ranks per stage, the dense body's widths */
} pipe_golden;

/* Reads dir/pipeline.txt (asserts on a missing key or an unknown loss). */
void pipe_golden_read(const char *dir, const char *cname, pipe_golden *g);

/* The worst |got - exact| / bound over n elements, bound = k u (|exact| + rms(exact)); with
 * fail, the first element outside it fails the test naming what, cname and the index. */
double pipe_golden_compare(const char *what, const char *cname, const float *got, const double *exact, int64_t n,
                           double k, int fail);

/* A stored case's f32 arrays as a run takes them: x, tgt, w1, w2 loaded; y, dy, dx, dw zeroed. */
typedef struct {
  int64_t na, nw[2];
  float *x, *tgt, *w[2], *y, *dy, *dx, *dw[2];
} pipe_golden_io;
void pipe_golden_load(const char *dir, const pipe_golden *g, const tw_pipeline_body *body, pipe_golden_io *io);
void pipe_golden_io_free(pipe_golden_io *io);

/* dy = y - tgt, the gradient of the loss 1/2 sum (y - tgt)^2, which it returns. */
double pipe_golden_set_dy(pipe_golden_io *io);

/* y, the loss, dx, dW1 and dW2 against the golden's f64 values within the bound above; the
 * worst |diff|/bound (fail: as pipe_golden_compare). */
double pipe_golden_check(const char *dir, const char *cname, const pipe_golden *g, const pipe_golden_io *io, double loss,
                         int fail);

#endif
