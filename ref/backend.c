/* The ref backend table: host memory, synchronous, every operation in plain C. */
#include <stdlib.h>
#include <string.h>

#include "ref/ref.h"
#include "ref/ref_moe.h"

static tw_status ref_alloc(tw_ctx *ctx, size_t bytes, void **out) {
  (void)ctx;
  /* 64-byte aligned so the GPU's alignment rules can be exercised on the host too */
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes) != 0 || !p)
    return tw_error(TW_ERR_MEMORY, "alloc: out of host memory for %zu bytes", bytes);
  *out = p;
  return TW_OK;
}

static tw_status ref_free(tw_ctx *ctx, void *p) {
  (void)ctx;
  free(p);
  return TW_OK;
}

static tw_status ref_copy(tw_ctx *ctx, void *dst, tw_mem dm, const void *src, tw_mem sm,
                          size_t bytes) {
  (void)ctx; (void)dm; (void)sm;
  memmove(dst, src, bytes);
  return TW_OK;
}

static tw_status ref_memset(tw_ctx *ctx, void *p, int byte, size_t bytes) {
  (void)ctx;
  memset(p, byte, bytes);
  return TW_OK;
}

const tw_backend_ops tw_ref_ops = {
    .name = "ref",
    .mem = TW_MEM_HOST,
    .alloc = ref_alloc,
    .free = ref_free,
    .copy = ref_copy,
    .memset = ref_memset,
    .cast = ref_cast,
    .grouped_quantize = ref_grouped_quantize,
    .grouped_dequantize = ref_grouped_dequantize,
    .delayed_scale_update = ref_delayed_scale_update,
    .gemm = ref_gemm,
    .grouped_gemm = ref_grouped_gemm,
    .grouped_gemm_wgrad = ref_grouped_gemm_wgrad,
    .grouped_gemm_rows = ref_grouped_gemm_rows,
    .grouped_gemm_wgrad_rows = ref_grouped_gemm_wgrad_rows,
    .router = &tw_ref_router,
    .ep = &tw_ref_ep,
};
