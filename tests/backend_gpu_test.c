/* The CUDA backend's own contract: context, memory, copies, the device error word and its
 * message, scratch, and gpu_group_prefix (device-side offsets of group sizes). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"
#include "twin/tw_base.h"
#include "twin/tw_check.h"

static tw_ctx *gpu_ctx(void) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  tw_status s = tw_ctx_create(&ctx, &cfg);
  cr_assert_eq(s, TW_OK, "ctx_create: %s", tw_last_error());
  return ctx;
}

Test(backend_gpu, available_matches_visible_devices) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cr_assert_eq(tw_backend_available(TW_BACKEND_GPU), n > 0);
  cr_assert(n > 0, "a gpu test needs a GPU");
}

Test(backend_gpu, ctx_reports_device_and_memory) {
  tw_ctx *ctx = gpu_ctx();
  cr_assert_eq(tw_ctx_backend(ctx), TW_BACKEND_GPU);
  cr_assert_eq(tw_ctx_mem(ctx), TW_MEM_DEVICE);
  gpu_state *st = gpu_of(ctx);
  cr_assert(st->sm >= 70 && st->num_sms > 0 && st->stream && st->own_stream);
  cr_assert_eq(tw_ctx_check(ctx), TW_OK);
  cr_assert_eq(tw_ctx_destroy(ctx), TW_OK);
}

Test(backend_gpu, bad_device_is_a_clear_error) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cfg.device = 4096;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "device 4096") != NULL, "%s", tw_last_error());
  cr_assert_null(ctx);
}

Test(backend_gpu, caller_stream_is_used_and_not_destroyed) {
  cudaStream_t s;
  cr_assert_eq(cudaStreamCreate(&s), cudaSuccess);
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cfg.stream = s;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
  cr_assert_eq(gpu_of(ctx)->stream, s);
  cr_assert_eq(gpu_of(ctx)->own_stream, 0);
  tw_ctx_destroy(ctx);
  cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess); /* still valid */
  cudaStreamDestroy(s);
}

Test(backend_gpu, alloc_copy_memset_round_trip) {
  tw_ctx *ctx = gpu_ctx();
  enum { N = 1000003 };
  float *h = malloc(N * sizeof *h), *back = malloc(N * sizeof *back);
  for (int i = 0; i < N; i++) h[i] = (float)i * 0.5f - 7.0f;
  void *d1, *d2;
  cr_assert_eq(tw_alloc(ctx, N * sizeof(float), &d1), TW_OK);
  cr_assert_eq(tw_alloc(ctx, N * sizeof(float), &d2), TW_OK);
  tw_tensor th = tw_tensor_1d(h, TW_F32, N, TW_MEM_HOST), tb = tw_tensor_1d(back, TW_F32, N, TW_MEM_HOST);
  tw_tensor t1 = tw_tensor_1d(d1, TW_F32, N, TW_MEM_DEVICE), t2 = tw_tensor_1d(d2, TW_F32, N, TW_MEM_DEVICE);
  cr_assert_eq(tw_memset(ctx, d2, TW_POISON_BYTE, N * sizeof(float)), TW_OK);
  cr_assert_eq(tw_tensor_copy(ctx, &t1, &th), TW_OK);
  cr_assert_eq(tw_tensor_copy(ctx, &t2, &t1), TW_OK);
  cr_assert_eq(tw_tensor_copy(ctx, &tb, &t2), TW_OK);
  cr_assert_eq(memcmp(h, back, N * sizeof(float)), 0);
  /* memset of a sub-range, then back to the host */
  cr_assert_eq(tw_memset(ctx, (char *)d2 + 8, 0xA5, 12), TW_OK);
  cr_assert_eq(tw_tensor_copy(ctx, &tb, &t2), TW_OK);
  const unsigned char *b = (const unsigned char *)back;
  for (int i = 8; i < 20; i++) cr_assert_eq(b[i], 0xA5);
  cr_assert_eq(back[1], h[1]);
  cr_assert_eq(back[5], h[5]);
  cr_assert_eq(tw_free(ctx, d1), TW_OK);
  cr_assert_eq(tw_free(ctx, d2), TW_OK);
  cr_assert_eq(tw_alloc(ctx, 0, &d1), TW_OK);
  cr_assert_null(d1);
  free(h);
  free(back);
  tw_ctx_destroy(ctx);
}

/* Stream-ordered memory: used on the context's stream, counted by the ledger, given back by
 * tw_free in stream order; a second allocation after the free may reuse it (the pool). */
Test(backend_gpu, stream_ordered_alloc_round_trip_and_ledger) {
  tw_ctx *ctx = gpu_ctx();
  enum { N = 1 << 20 };
  float *h = malloc(N * sizeof *h), *back = malloc(N * sizeof *back);
  for (int i = 0; i < N; i++) h[i] = (float)i - 3.0f;
  void *d = NULL, *e = NULL;
  cr_assert_eq(tw_alloc_stream(ctx, N * sizeof(float), &d), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_alloc(ctx, 64, &e), TW_OK);
  size_t live = 0, peak = 0;
  cr_assert_eq(tw_ctx_memory(ctx, &live, &peak), TW_OK);
  cr_assert_eq(live, N * sizeof(float) + 64);
  tw_tensor th = tw_tensor_1d(h, TW_F32, N, TW_MEM_HOST), tb = tw_tensor_1d(back, TW_F32, N, TW_MEM_HOST);
  tw_tensor td = tw_tensor_1d(d, TW_F32, N, TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(ctx, &td, &th), TW_OK);
  cr_assert_eq(tw_tensor_copy(ctx, &tb, &td), TW_OK);
  cr_assert_eq(memcmp(h, back, N * sizeof(float)), 0);
  cr_assert_eq(tw_free(ctx, d), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_alloc_stream(ctx, N * sizeof(float), &d), TW_OK);
  cr_assert_eq(tw_memset(ctx, d, 0, N * sizeof(float)), TW_OK);
  cr_assert_eq(tw_free(ctx, d), TW_OK);
  cr_assert_eq(tw_free(ctx, e), TW_OK);
  cr_assert_eq(tw_ctx_memory(ctx, &live, &peak), TW_OK);
  cr_assert(live == 0 && peak == N * sizeof(float) + 64, "live %zu peak %zu", live, peak);
  cr_assert_eq(tw_ctx_check(ctx), TW_OK, "%s", tw_last_error());
  void *p = (void *)1;
  cr_assert_eq(tw_alloc_stream(ctx, (size_t)1 << 52, &p), TW_ERR_MEMORY);
  cr_assert_null(p);
  cr_assert(strstr(tw_last_error(), "cudaMallocAsync") != NULL, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(ctx), TW_OK, "the failed allocation is not sticky: %s", tw_last_error());
  free(h);
  free(back);
  tw_ctx_destroy(ctx);
}

/* The context's pool keeps what tw_free gave back across synchronizations (the next step's
 * buffers come without mapping memory again) until tw_ctx_trim; its own counters, not
 * cudaMemGetInfo, which other tests on the GPU disturb. */
static size_t pool_reserved(tw_ctx *ctx) {
  uint64_t v = 0;
  cr_assert_eq(cudaMemPoolGetAttribute(gpu_of(ctx)->pool, cudaMemPoolAttrReservedMemCurrent, &v), cudaSuccess);
  return (size_t)v;
}
Test(backend_gpu, the_pool_keeps_freed_memory_until_trim) {
  tw_ctx *ctx = gpu_ctx();
  cr_assert_not_null(gpu_of(ctx)->pool, "H100/H200 have stream-ordered pools");
  const size_t big = (size_t)256 << 20;
  void *d = NULL;
  cr_assert_eq(tw_alloc_stream(ctx, big, &d), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_free(ctx, d), TW_OK);
  cr_assert_eq(tw_ctx_sync(ctx), TW_OK);
  const size_t kept = pool_reserved(ctx);
  cr_assert(kept >= big, "after a sync the pool still holds %zu bytes, want >= %zu", kept, big);
  cr_assert_eq(tw_alloc_stream(ctx, big, &d), TW_OK, "%s", tw_last_error());
  cr_assert_eq(pool_reserved(ctx), kept, "the second allocation reuses what was kept");
  cr_assert_eq(tw_free(ctx, d), TW_OK);
  cr_assert_eq(tw_ctx_trim(ctx), TW_OK, "%s", tw_last_error());
  cr_assert_eq(pool_reserved(ctx), 0, "trim gives everything back");
  size_t live = 1;
  cr_assert_eq(tw_ctx_memory(ctx, &live, NULL), TW_OK);
  cr_assert_eq(live, 0);
  tw_ctx_destroy(ctx);
}

Test(backend_gpu, huge_alloc_fails_with_a_message) {
  tw_ctx *ctx = gpu_ctx();
  void *p = (void *)1;
  cr_assert_eq(tw_alloc(ctx, (size_t)1 << 52, &p), TW_ERR_MEMORY);
  cr_assert_null(p);
  cr_assert(strstr(tw_last_error(), "bytes") != NULL, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(ctx), TW_OK); /* the failed allocation is not sticky */
  tw_ctx_destroy(ctx);
}

Test(backend_gpu, error_word_messages_name_op_and_values) {
  long long w[GPU_ERR_WORDS] = {GPU_ERR_GROUP_NEGATIVE, GPU_OP_QUANTIZE, 3, -5};
  cr_assert_eq(gpu_format_error_word(w), TW_ERR_DEVICE);
  cr_assert_str_eq(tw_last_error(), "grouped_quantize: group_sizes[3] = -5 is negative (seen on the device)");
  long long w2[GPU_ERR_WORDS] = {GPU_ERR_GROUP_SUM, GPU_OP_GROUPED_GEMM, 1030, 1024};
  cr_assert_eq(gpu_format_error_word(w2), TW_ERR_DEVICE);
  cr_assert(strstr(tw_last_error(), "grouped_gemm: group_sizes sum to 1030 but there are 1024 rows"), "%s",
            tw_last_error());
  long long w3[GPU_ERR_WORDS] = {GPU_ERR_GROUP_ALIGN, GPU_OP_DEQUANTIZE, 2, 33};
  cr_assert_eq(gpu_format_error_word(w3), TW_ERR_DEVICE);
  cr_assert(strstr(tw_last_error(), "group_sizes[2] = 33"), "%s", tw_last_error());
  long long w0[GPU_ERR_WORDS] = {0, 0, 0, 0};
  cr_assert_eq(gpu_format_error_word(w0), TW_OK);
}

Test(backend_gpu, scratch_grows_past_its_buffer_and_resets) {
  tw_ctx *ctx = gpu_ctx();
  gpu_state *st = gpu_of(ctx);
  gpu_scratch_reset(ctx);
  void *a, *b, *c;
  cr_assert_eq(gpu_scratch(ctx, 100, &a), TW_OK);
  cr_assert_eq(gpu_scratch(ctx, 100, &b), TW_OK);
  cr_assert_eq((char *)b - (char *)a, 256);
  cr_assert_eq(gpu_scratch(ctx, st->scratch_bytes * 2, &c), TW_OK);
  cr_assert_eq(st->n_extra, 1);
  cr_assert_eq(cudaMemsetAsync(c, 1, st->scratch_bytes * 2, st->stream), cudaSuccess);
  gpu_scratch_reset(ctx);
  cr_assert_eq(st->n_extra, 0);
  cr_assert_eq(st->scratch_used, 0);
  cr_assert_eq(tw_ctx_check(ctx), TW_OK);
  tw_ctx_destroy(ctx);
}

/* Runs gpu_group_prefix on host sizes; returns the tw_ctx_check status. */
static tw_status run_prefix(tw_ctx *ctx, const int32_t *sizes, int64_t G, int64_t rows, int align,
                            int64_t *off, int64_t *tiles) {
  void *d_sizes, *d_off, *d_tiles;
  cr_assert_eq(tw_alloc(ctx, G * 4, &d_sizes), TW_OK);
  cr_assert_eq(tw_alloc(ctx, (G + 1) * 8, &d_off), TW_OK);
  cr_assert_eq(tw_alloc(ctx, (G + 1) * 8, &d_tiles), TW_OK);
  tw_tensor hs = tw_tensor_1d((void *)sizes, TW_I32, G, TW_MEM_HOST), ds = tw_tensor_1d(d_sizes, TW_I32, G, TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(ctx, &ds, &hs), TW_OK);
  cr_assert_eq(gpu_group_prefix(ctx, d_sizes, G, rows, align, GPU_OP_QUANTIZE, d_off, d_tiles), TW_OK);
  tw_status s = tw_ctx_check(ctx);
  char msg[512];
  snprintf(msg, sizeof msg, "%s", tw_last_error());
  tw_tensor ho = tw_tensor_1d(off, TW_I64, G + 1, TW_MEM_HOST), dO = tw_tensor_1d(d_off, TW_I64, G + 1, TW_MEM_DEVICE);
  tw_tensor ht = tw_tensor_1d(tiles, TW_I64, G + 1, TW_MEM_HOST), dT = tw_tensor_1d(d_tiles, TW_I64, G + 1, TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(ctx, &ho, &dO), TW_OK);
  cr_assert_eq(tw_tensor_copy(ctx, &ht, &dT), TW_OK);
  tw_free(ctx, d_sizes);
  tw_free(ctx, d_off);
  tw_free(ctx, d_tiles);
  if (s != TW_OK) tw_error(s, "%s", msg);
  return s;
}

Test(backend_gpu, group_prefix_matches_host_for_many_sizes) {
  tw_ctx *ctx = gpu_ctx();
  srand(7);
  int64_t Gs[] = {1, 2, 31, 32, 33, 1023, 1024, 1025, 5000};
  for (size_t c = 0; c < sizeof Gs / sizeof Gs[0]; c++) {
    int64_t G = Gs[c];
    int32_t *sz = malloc(G * 4);
    int64_t *off = malloc((G + 1) * 8), *tl = malloc((G + 1) * 8), rows = 0;
    for (int64_t g = 0; g < G; g++) {
      sz[g] = rand() % 4 == 0 ? 0 : rand() % 300;
      rows += sz[g];
    }
    rows += 17; /* a tail */
    cr_assert_eq(run_prefix(ctx, sz, G, rows, 1, off, tl), TW_OK, "G=%lld: %s", (long long)G, tw_last_error());
    int64_t o = 0, t = 0;
    for (int64_t g = 0; g < G; g++) {
      cr_assert_eq(off[g], o, "G=%lld g=%lld", (long long)G, (long long)g);
      cr_assert_eq(tl[g], t, "G=%lld g=%lld", (long long)G, (long long)g);
      o += sz[g];
      t += (sz[g] + 127) / 128;
    }
    cr_assert_eq(off[G], o);
    cr_assert_eq(tl[G], t);
    free(sz);
    free(off);
    free(tl);
  }
  tw_ctx_destroy(ctx);
}

Test(backend_gpu, group_prefix_bad_sizes_set_the_error_word_and_clamp) {
  tw_ctx *ctx = gpu_ctx();
  int32_t neg[] = {4, -3, 5};
  int64_t off[4], tl[4];
  cr_assert_eq(run_prefix(ctx, neg, 3, 100, 1, off, tl), TW_ERR_DEVICE);
  cr_assert(strstr(tw_last_error(), "group_sizes[1] = -3 is negative"), "%s", tw_last_error());
  cr_assert_eq(off[0], 0);
  cr_assert_eq(off[1], 4);
  cr_assert_eq(off[2], 4); /* the negative group is empty */
  cr_assert_eq(off[3], 9);
  /* the word was cleared: the next check is clean */
  cr_assert_eq(tw_ctx_check(ctx), TW_OK);

  int32_t big[] = {60, 50, 30};
  cr_assert_eq(run_prefix(ctx, big, 3, 100, 1, off, tl), TW_ERR_DEVICE);
  cr_assert(strstr(tw_last_error(), "group_sizes sum to 140 but there are 100 rows"), "%s", tw_last_error());
  cr_assert_eq(off[1], 60);
  cr_assert_eq(off[2], 100); /* cut to the rows there are */
  cr_assert_eq(off[3], 100);
  cr_assert_eq(tl[2], 2);    /* 60 rows -> 1 tile, 40 rows -> 1 tile, 0 -> 0 */
  cr_assert_eq(tl[3], 2);

  int32_t odd[] = {32, 33};
  cr_assert_eq(run_prefix(ctx, odd, 2, 100, 32, off, tl), TW_ERR_DEVICE);
  cr_assert(strstr(tw_last_error(), "group_sizes[1] = 33"), "%s", tw_last_error());
  tw_ctx_destroy(ctx);
}
