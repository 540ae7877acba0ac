/* The interface's own contract: statuses, messages, dtypes, contexts. */
#include <criterion/criterion.h>
#include <string.h>

#include "twin/tw_base.h"

Test(base, status_names_cover_every_code) {
  for (int s = 0; s < TW_STATUS_COUNT; s++) cr_assert(strncmp(tw_status_name((tw_status)s), "TW_", 3) == 0);
  cr_assert_str_eq(tw_status_name(TW_ERR_SHAPE), "TW_ERR_SHAPE");
}

Test(base, error_message_is_thread_local_and_formatted) {
  tw_status s = tw_error(TW_ERR_SHAPE, "op: %d rows", 7);
  cr_assert_eq(s, TW_ERR_SHAPE);
  cr_assert_str_eq(tw_last_error(), "op: 7 rows");
}

/* Wrapping the last message with context, the way callers add a file or rank, reads exactly
 * as written: the format must not read the buffer it writes (it did: "input 'x': input 'x':
 * ta/trunc.npy" for "input 'x': /data/trunc.npy"). */
Test(base, wrapping_the_last_error_reads_exactly) {
  tw_error(TW_ERR_IO, "npy_load /data/trunc.npy: truncated: shape needs more than the 19 data bytes present");
  tw_status s = tw_error(TW_ERR_IO, "input '%s': %s", "x", tw_last_error());
  cr_assert_eq(s, TW_ERR_IO);
  cr_assert_str_eq(tw_last_error(),
                   "input 'x': npy_load /data/trunc.npy: truncated: shape needs more than the 19 data bytes present");
  tw_error(TW_ERR_SHAPE, "%s: %s", tw_last_error(), tw_last_error());
  cr_assert_str_eq(tw_last_error(),
                   "input 'x': npy_load /data/trunc.npy: truncated: shape needs more than the 19 data bytes present: "
                   "input 'x': npy_load /data/trunc.npy: truncated: shape needs more than the 19 data bytes present");
}

/* A message longer than the buffer is cut at 1023 bytes, wrapped or not, and stays terminated. */
Test(base, a_long_wrapped_message_is_cut_cleanly) {
  char big[1500];
  memset(big, 'p', sizeof big - 1);
  big[sizeof big - 1] = 0;
  tw_error(TW_ERR_IO, "%s", big);
  cr_assert_eq(strlen(tw_last_error()), 1023);
  tw_error(TW_ERR_IO, "ctx: %s", tw_last_error());
  cr_assert_eq(strlen(tw_last_error()), 1023);
  cr_assert(strncmp(tw_last_error(), "ctx: ppp", 8) == 0);
}

Test(base, dtype_names_round_trip) {
  for (int t = 0; t < TW_DTYPE_COUNT; t++) {
    tw_dtype back;
    cr_assert_eq(tw_dtype_from_name(tw_dtype_name((tw_dtype)t), &back), 0);
    cr_assert_eq(back, t);
  }
  tw_dtype d;
  cr_assert_eq(tw_dtype_from_name("nope", &d), -1);
  cr_assert_eq(tw_dtype_storage_bytes(TW_E2M1, 5), 3);
  cr_assert_eq(tw_dtype_storage_bytes(TW_BF16, 5), 10);
}

Test(base, ctx_create_ref_and_reject_bad_config) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
  cr_assert_eq(tw_ctx_backend(ctx), TW_BACKEND_REF);
  cr_assert_eq(tw_ctx_mem(ctx), TW_MEM_HOST);
  tw_ctx_destroy(ctx);
  cfg.size = 3;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_ERR_INVALID_ARG);
  cr_assert(strstr(tw_last_error(), "TW_CTX_CONFIG_INIT") != NULL);
  cfg = (tw_ctx_config)TW_CTX_CONFIG_INIT;
  cfg.backend = (tw_backend)7;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_ERR_INVALID_ARG);
  cr_assert_eq(tw_ctx_create(NULL, &cfg), TW_ERR_NULL);
}

Test(base, gpu_backend_absent_from_cpu_binary_is_a_clear_error) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_ERR_UNSUPPORTED);
  cr_assert(strstr(tw_last_error(), "gpu") != NULL);
}

Test(base, tensor_copy_checks_shapes) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {0};
  tw_tensor ta = tw_tensor_2d(a, TW_F32, 2, 3, TW_MEM_HOST), tb = tw_tensor_2d(b, TW_F32, 2, 3, TW_MEM_HOST);
  cr_assert_eq(tw_tensor_copy(ctx, &tb, &ta), TW_OK);
  cr_assert_eq(b[5], 6.0f);
  tw_tensor tc = tw_tensor_2d(b, TW_F32, 3, 2, TW_MEM_HOST);
  cr_assert_eq(tw_tensor_copy(ctx, &tc, &ta), TW_ERR_SHAPE);
  cr_assert(strstr(tw_last_error(), "[3, 2] f32") != NULL);
  tw_ctx_destroy(ctx);
}

/* The allocation ledger counts exactly what tw_alloc handed out and tw_free took back, through
 * the table's growth (more than its first 64 slots) and tombstone reuse. */
Test(base, ctx_memory_ledger_counts_live_and_peak_bytes) {
  tw_ctx *ctx = NULL;
  cr_assert_eq(tw_ctx_create(&ctx, NULL), TW_OK);
  size_t live = 1, peak = 1;
  cr_assert_eq(tw_ctx_memory(ctx, &live, &peak), TW_OK);
  cr_assert(live == 0 && peak == 0);
  enum { N = 300 };
  void *p[N];
  size_t want = 0;
  for (int i = 0; i < N; i++) {
    cr_assert_eq(tw_alloc(ctx, (size_t)(i + 1) * 8, &p[i]), TW_OK);
    want += (size_t)(i + 1) * 8;
  }
  cr_assert_eq(tw_ctx_memory(ctx, &live, &peak), TW_OK);
  cr_assert(live == want && peak == want, "live %zu peak %zu want %zu", live, peak, want);
  for (int i = 0; i < N; i += 2) {
    cr_assert_eq(tw_free(ctx, p[i]), TW_OK);
    want -= (size_t)(i + 1) * 8;
  }
  cr_assert_eq(tw_ctx_memory(ctx, &live, NULL), TW_OK);
  cr_assert_eq(live, want);
  cr_assert_eq(tw_ctx_reset_peak(ctx), TW_OK);
  void *q = NULL;
  cr_assert_eq(tw_alloc(ctx, 1000, &q), TW_OK);
  cr_assert_eq(tw_free(ctx, q), TW_OK);
  cr_assert_eq(tw_alloc_stream(NULL, 24, &q), TW_ERR_NULL);
  cr_assert(strstr(tw_last_error(), "alloc_stream: NULL argument"), "%s", tw_last_error());
  cr_assert_eq(tw_alloc_stream(ctx, 24, NULL), TW_ERR_NULL);
  cr_assert(strstr(tw_last_error(), "alloc_stream: NULL argument"), "%s", tw_last_error());
  cr_assert_eq(tw_alloc_stream(ctx, 24, &q), TW_OK); /* ref: plain memory, counted the same */
  cr_assert_eq(tw_ctx_memory(ctx, &live, NULL), TW_OK);
  cr_assert_eq(live, want + 24);
  cr_assert_eq(tw_free(ctx, q), TW_OK);
  cr_assert_eq(tw_ctx_trim(ctx), TW_OK); /* ref keeps nothing: nothing to give back */
  cr_assert_eq(tw_ctx_trim(NULL), TW_ERR_NULL);
  cr_assert(strstr(tw_last_error(), "ctx_trim: ctx is NULL"), "%s", tw_last_error());
  cr_assert_eq(tw_alloc(ctx, 0, &q), TW_OK); /* nothing handed out, nothing counted */
  cr_assert_null(q);
  cr_assert_eq(tw_ctx_memory(ctx, &live, &peak), TW_OK);
  cr_assert(live == want && peak == want + 1000, "live %zu peak %zu", live, peak);
  for (int i = 1; i < N; i += 2) cr_assert_eq(tw_free(ctx, p[i]), TW_OK);
  cr_assert_eq(tw_ctx_memory(ctx, &live, NULL), TW_OK);
  cr_assert_eq(live, 0);
  cr_assert_eq(tw_ctx_memory(NULL, &live, NULL), TW_ERR_NULL);
  tw_ctx_destroy(ctx);
}

/* tw_ctx_id: distinct for every context made, never reused after a destroy; 0 for NULL. */
Test(base, ctx_ids_are_never_reused) {
  cr_assert_eq(tw_ctx_id(NULL), 0u);
  tw_ctx *a = NULL, *b = NULL;
  cr_assert_eq(tw_ctx_create(&a, NULL), TW_OK);
  uint64_t ia = tw_ctx_id(a);
  cr_assert_neq(ia, 0u);
  tw_ctx_destroy(a);
  cr_assert_eq(tw_ctx_create(&b, NULL), TW_OK);
  cr_assert_neq(tw_ctx_id(b), ia, "a new context (maybe at the old address) gets a new id");
  cr_assert_neq(tw_ctx_id(b), 0u);
  tw_ctx_destroy(b);
}
