/* Helpers shared by the Criterion tests: a ref context, seeded random data, temp dirs, the
 * stored goldens' location, and assertions that print the checker's one-line report. */
#ifndef TWIN_TESTS_TEST_UTIL_H
#define TWIN_TESTS_TEST_UTIL_H
#include <stddef.h>
#include <stdint.h>

#include "twin/tw_base.h"
#include "twin/tw_check.h"

#ifdef __cplusplus
extern "C" {
#endif

/* GPU tests: skip (saying why) when fewer than n GPUs are visible; NVLink multicast stays off
 * in NCCL unless the environment already says otherwise. tw_gpu_device_count: gpu/probe.cu. */
int tw_gpu_device_count(void);
#define TT_NEED_GPUS(n)                                                  \
  do {                                                                   \
    setenv("NCCL_NVLS_ENABLE", "0", 0);                                  \
    int have_ = tw_gpu_device_count();                                   \
    if (have_ < (n)) cr_skip_test("needs %d GPUs, sees %d", (n), have_); \
  } while (0)

/* dir/name.npy as a new host buffer; the test fails unless it holds n elements of dtype want. */
void *tt_load_npy(const char *dir, const char *name, tw_dtype want, int64_t n);

/* A ref-backend context; the test fails if it cannot be made. */
tw_ctx *tt_ref_ctx(void);

/* splitmix64: tiny, seeded, the same on every machine. */
uint64_t tt_rand_u64(uint64_t *state);
double tt_rand_uniform(uint64_t *state, double lo, double hi); /* [lo, hi) */
void tt_fill_uniform_f32(float *x, int64_t n, uint64_t seed, float lo, float hi);

/* tw_ep.h's warp order (combine_bwd's d_topk_weights) over products[0..H-1], each already
 * rounded to f32: 32 partials from +0, partial (h / 8) % 32 adding products[h] in increasing
 * h, then for m = 16, 8, 4, 2, 1: P[l] += P[l + m] for l < m; returns P[0]. */
float tt_warp_order_sum(const float *products, int64_t H);

/* A fresh directory under $TEST_TMPDIR (or /tmp); the path is malloc'd. */
char *tt_make_tmpdir(const char *tag);
/* path = dir + "/" + name into buf; returns buf. */
const char *tt_path(char *buf, size_t n, const char *dir, const char *name);
/* dir/name, a stored case's key=value text, into txt as "\n" + its first cap - 2 bytes,
 * NUL-terminated (the leading newline lets a key be found as "\nkey="); the test fails if the
 * file cannot be opened. */
void tt_read_text(const char *dir, const char *name, char *txt, size_t cap);
/* Writes raw bytes to a file (for hand-made, possibly broken, .npy files). */
void tt_write_file(const char *path, const void *bytes, size_t n);

/* The stored goldens: "$TEST_SRCDIR/twin/golden/data" under Bazel, else "golden/data". */
const char *tt_golden_root(void);
/* Calls fn(dir, name) for each case folder under <golden root>/<area> (the test fails if the
 * area is missing; `gen` names its generator for the message); returns how many. */
int tt_each_golden_case(const char *area, const char *gen, void (*fn)(const char *dir, const char *name));

/* Asserts s == want and, when substr is not NULL, that tw_last_error() contains it. */
#define tt_expect_status(s, want, substr) tt_expect_status_at((s), (want), (substr), __FILE__, __LINE__)
void tt_expect_status_at(tw_status s, tw_status want, const char *substr, const char *file, int line);

/* Asserts bit equality / the bound, printing the checker's report on failure. */
#define tt_expect_exact(got, expected, what) tt_expect_exact_at((got), (expected), (what), __FILE__, __LINE__)
void tt_expect_exact_at(const tw_tensor *got, const tw_tensor *expected, const char *what,
                        const char *file, int line);
#define tt_expect_bound(got, expected, bound, what) \
  tt_expect_bound_at((got), (expected), (bound), (what), __FILE__, __LINE__)
void tt_expect_bound_at(const tw_tensor *got, const tw_tensor *expected, const tw_tensor *bound,
                        const char *what, const char *file, int line);

/* A stall watch for multi-GPU tests (the device machine has no gdb): with TWIN_STALL_DUMP_S
 * set, tt_stall_watch_start arms a thread that, if tt_stall_watch_stop has not been called
 * within that many seconds, prints every thread's native stack (glibc backtrace, taken in a
 * SIGURG handler on each thread) and the process's executable mappings to stderr, once. The
 * frames read "binary(+offset)": `addr2line -f -e binary offset` names them. Without the
 * variable both are no-ops. */
void tt_stall_watch_start(const char *tag);
void tt_stall_watch_stop(void);

#ifdef __cplusplus
}
#endif
#endif
