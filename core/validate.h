/* Argument checks shared by every entry point (internal). Each returns TW_OK or sets the
 * thread-local message "<op>: <what> ..." with the values and returns the status. */
#ifndef TWIN_CORE_VALIDATE_H
#define TWIN_CORE_VALIDATE_H

#include "core/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* t non-NULL, not none, ndim == want_ndim (or any when want_ndim < 0), shapes >= 0, data
 * non-NULL when it has elements, and living in `mem`. */
tw_status tw_v_tensor(const char *op, const char *name, const tw_tensor *t, tw_mem mem,
                      int want_ndim);
tw_status tw_v_dtype_in(const char *op, const char *name, const tw_tensor *t, const tw_dtype *ok,
                        int n_ok);
tw_status tw_v_shape_is(const char *op, const char *name, const tw_tensor *t, int ndim,
                        const int64_t *shape);
/* group_sizes: 1-D i32 [G], G >= 1, in the context's memory. When it lives on the host
 * (ref), also checks each m_g >= 0 and sum <= rows; *sum_out gets the sum (-1 if on device). */
tw_status tw_v_group_sizes(const char *op, const tw_ctx *ctx, const tw_tensor *gs, int64_t rows,
                           const char *rows_name, int64_t *G_out, int64_t *sum_out);

/* Host helpers for backends: o_g prefix offsets [G+1] of host group sizes. */
void tw_group_offsets(const int32_t *gs, int64_t G, int64_t *offsets);

/* Number of 128-row tiles over groups (T(g) prefix, see tw_quantize.h); tiles [G+1]. */
void tw_group_tile_offsets(const int32_t *gs, int64_t G, int64_t tile_rows, int64_t *tiles);

static inline int64_t tw_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t tw_round_up(int64_t a, int64_t b) { return tw_ceil_div(a, b) * b; }

#ifdef __cplusplus
}
#endif
#endif
