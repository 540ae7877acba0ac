/* .npy files (NumPy format 1.0/2.0/3.0, little-endian, C order) for goldens and `twin op`.
 *
 * dtype mapping: <f8 f64, <f4 f32, <f2 f16, <i4 i32, <i8 i64, |u1 (or <u1) u8, <u2 u16.
 * Raw codes travel as integers: bf16/f16 codes as <u2, fp8/e8m0 as |u1, e2m1 as |u1 packed
 * (two per byte, element 2i in the low nibble). Reinterpret with tw_tensor_view_as().
 * Anything else (big-endian, Fortran order, object arrays, a truncated file, a header that
 * does not parse, more than TW_MAX_DIMS dims) is TW_ERR_IO with a message; never a crash.
 */
#ifndef TWIN_TW_NPY_H
#define TWIN_TW_NPY_H

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Loads into a malloc'd host buffer (out->data; free it with free()). */
tw_status tw_npy_load(const char *path, tw_tensor *out);
/* Parses an in-memory file image (used by the fuzz harness); copies the data. */
tw_status tw_npy_parse(const void *bytes, size_t n, tw_tensor *out);
/* Saves a host tensor; bf16/f16 -> <u2, e4m3/e5m2/e8m0/e2m1 -> |u1 (e2m1 packed bytes, last
 * dim halved rounding up), others as mapped above. */
tw_status tw_npy_save(const char *path, const tw_tensor *t);

/* Same storage, another dtype of the same bit width (u16 <-> bf16/f16, u8 <-> fp8/e8m0). */
tw_status tw_tensor_view_as(const tw_tensor *t, tw_dtype as, tw_tensor *out);

#ifdef __cplusplus
}
#endif
#endif
