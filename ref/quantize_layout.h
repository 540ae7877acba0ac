/* Index maps of the quantized scale layouts of tw_quantize.h (internal): one definition, used
 * by the oracle (ref/quantize.c) and the tests; plain C with no dependencies, so a CUDA file
 * may include it too. */
#ifndef TWIN_REF_QUANTIZE_LAYOUT_H
#define TWIN_REF_QUANTIZE_LAYOUT_H

#include <stdint.h>

/* cuBLAS's 128x4 tiling of an MXFP8 scale matrix S[R, cols] (R % 128 == 0, cols % 4 == 0):
 * element (r, c), r = 128a + 32b + d, c = 4e + f, lands at ((a*(cols/4) + e)*32 + d)*16 + b*4 + f.
 * 512-byte tiles in row-major tile order. */
static inline int64_t ref_mxfp8_swizzle_index(int64_t r, int64_t c, int64_t cols) {
  int64_t a = r / 128, b = (r % 128) / 32, d = r % 32;
  int64_t e = c / 4, f = c % 4;
  return ((a * (cols / 4) + e) * 32 + d) * 16 + b * 4 + f;
}

/* The inverse: which (r, c) of S[R, cols] is stored at linear index i. */
static inline void ref_mxfp8_unswizzle_index(int64_t i, int64_t cols, int64_t *r, int64_t *c) {
  int64_t f = i % 4, b = (i / 4) % 4, d = (i / 16) % 32, tile = i / 512;
  int64_t e = tile % (cols / 4), a = tile / (cols / 4);
  *r = 128 * a + 32 * b + d;
  *c = 4 * e + f;
}

/* Worst-case number of 128-row tiles over G groups of M rows in all (tw_quantize.h T_cap):
 * at most min(G, M) groups are non-empty and each adds at most 127/128 of a tile. */
static inline int64_t ref_tile_capacity(int64_t M, int64_t G) {
  int64_t nonempty = G < M ? G : M;
  return (M + 127 * nonempty) / 128;
}

#endif
