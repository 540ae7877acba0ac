/* The oracle's GEMMs: dense/batched, grouped forward (ragged M) and grouped wgrad (ragged
 * contracting dim). Formulas and layouts: include/twin/tw_gemm.h. Arguments were validated
 * in core/api_gemm.c; only what the ref alone limits (OpenBLAS's 32-bit sizes, host
 * memory for scratch) is checked here.
 *
 * Each operand becomes f32 once, keeping its own storage layout: f32 data is used in place,
 * bf16/f16 is widened into a scratch copy, quantized data is dequantized into one
 * (ref_dequantize_operand: decode(q) * scale_inv, f32). Then every batch or group is one
 * cblas_sgemm on slices of that storage, with the transpose flag and leading dimension the
 * layout implies. An f32 output is written in place (beta = 1 when accumulating); a 16-bit
 * output goes through an f32 scratch and is rounded once (RNE) at the end. Rows past
 * sum(group_sizes) are never read or written.
 *
 * Speed (one H200 host, 16 cores, grouped vs one cblas_sgemm of the same FLOPs, M = 2048..4096):
 * f32 0.83-0.97x for G <= 16, 0.63-0.73x for G = 32..64 (OpenBLAS's per-call cost on groups of
 * 64-128 rows); bf16 0.46-0.88x (the widening is memory-bound: the rhs has G*K*N elements
 * for 2*M*K*N flops).
 */
#include <cblas.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/validate.h"
#include "ref/ref.h"
#include "twin/tw_numerics.h"

/* ---- operands as f32 ------------------------------------------------------------------- */

/* f32 scratch, kept per thread between calls: the pages of a fresh large malloc fault in on
 * first touch, and that cost as much as the widening itself (bf16 grouped GEMM went from
 * 0.36x to 0.52x of sgemm's rate on 16 cores with reuse). What a call leaves above
 * SCRATCH_KEEP_BYTES is given back at its end. */
enum { SCRATCH_A, SCRATCH_B, SCRATCH_OUT, SCRATCH_SLOTS };
#define SCRATCH_KEEP_BYTES ((size_t)256 << 20)

typedef struct {
  float *p[SCRATCH_SLOTS];
  size_t bytes[SCRATCH_SLOTS];
} scratch_set;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok;

static void scratch_free_set(void *p) {
  scratch_set *set = (scratch_set *)p;
  for (int i = 0; i < SCRATCH_SLOTS; i++) free(set->p[i]);
  free(set);
}
static void scratch_key_make(void) { scratch_key_ok = pthread_key_create(&scratch_key, scratch_free_set) == 0; }

static scratch_set *scratch_of_thread(void) {
  pthread_once(&scratch_once, scratch_key_make);
  if (!scratch_key_ok) return NULL;
  scratch_set *set = (scratch_set *)pthread_getspecific(scratch_key);
  if (!set && (set = (scratch_set *)calloc(1, sizeof *set)) != NULL &&
      pthread_setspecific(scratch_key, set) != 0) {
    free(set);
    set = NULL;
  }
  return set;
}

/* n floats of this thread's scratch slot (contents undefined). */
static tw_status alloc_f32(const char *op, const char *what, int slot, int64_t n, float **out) {
  *out = NULL;
  if (n <= 0) return TW_OK;
  size_t bytes = (size_t)n * sizeof(float);
  scratch_set *set = scratch_of_thread();
  if (set && set->bytes[slot] >= bytes) {
    *out = set->p[slot];
    return TW_OK;
  }
  float *p = (float *)malloc(bytes);
  if (!p)
    return tw_error(TW_ERR_MEMORY, "%s: no host memory for the f32 copy of %s (%lld elements)", op,
                    what, (long long)n);
  if (set) {
    free(set->p[slot]);
    set->p[slot] = p;
    set->bytes[slot] = bytes;
  }
  *out = p;
  return TW_OK;
}

/* End of a call: give back what is above the keep limit (or everything without a set). */
static void scratch_release(float *const *used, int n_used) {
  scratch_set *set = scratch_of_thread();
  if (!set) {
    for (int i = 0; i < n_used; i++) free(used[i]);
    return;
  }
  size_t total = 0;
  for (int i = 0; i < SCRATCH_SLOTS; i++) total += set->bytes[i];
  for (int i = 0; i < SCRATCH_SLOTS && total > SCRATCH_KEEP_BYTES; i++) {
    total -= set->bytes[i];
    free(set->p[i]);
    set->p[i] = NULL;
    set->bytes[i] = 0;
  }
}

/* f16 -> f32 through a table filled once from tw_f16_to_f32 (exact by construction); bf16 is
 * the top half of an f32, so a shift is its definition. Both run at memory speed. */
static float f16_table[65536];
static pthread_once_t f16_once = PTHREAD_ONCE_INIT;
static void f16_table_fill(void) {
  for (uint32_t h = 0; h < 65536; h++) f16_table[h] = tw_f16_to_f32((uint16_t)h);
}

typedef struct {
  const uint16_t *src;
  tw_dtype dt;
  int64_t n;
  float *dst;
} widen_job;

static void *widen_run(void *p) {
  const widen_job *j = (const widen_job *)p;
  if (j->dt == TW_BF16) {
    uint32_t *d = (uint32_t *)j->dst;
    for (int64_t i = 0; i < j->n; i++) d[i] = (uint32_t)j->src[i] << 16;
  } else {
    for (int64_t i = 0; i < j->n; i++) j->dst[i] = f16_table[j->src[i]];
  }
  return NULL;
}

/* Widens n 16-bit values, split over as many threads as OpenBLAS uses (chunks of at least
 * 64K): sgemm runs that wide, and a rhs of G*K*N elements feeds only 2*M/G flops per
 * element, so a one-thread widen would cost more than the GEMM on a many-core machine. */
#define WIDEN_MAX_THREADS 64
static void widen(const void *src, tw_dtype dt, int64_t n, float *dst) {
  pthread_once(&f16_once, f16_table_fill);
  int64_t T = openblas_get_num_threads();
  if (T > n / 65536) T = n / 65536;
  if (T > WIDEN_MAX_THREADS) T = WIDEN_MAX_THREADS;
  if (T < 1) T = 1;
  int64_t chunk = (n + T - 1) / T;
  widen_job jobs[WIDEN_MAX_THREADS];
  pthread_t threads[WIDEN_MAX_THREADS];
  int started[WIDEN_MAX_THREADS] = {0};
  for (int64_t t = 0; t < T; t++) {
    int64_t lo = t * chunk, hi = lo + chunk < n ? lo + chunk : n;
    jobs[t] = (widen_job){(const uint16_t *)src + lo, dt, hi > lo ? hi - lo : 0, dst + lo};
    if (t > 0) started[t] = pthread_create(&threads[t], NULL, widen_run, &jobs[t]) == 0;
  }
  widen_run(&jobs[0]);
  for (int64_t t = 1; t < T; t++) {
    if (started[t]) pthread_join(threads[t], NULL);
    else widen_run(&jobs[t]); /* no thread to be had: do it here */
  }
}

static void narrow(const float *src, tw_dtype dt, int64_t n, void *dst) {
  uint16_t *h = (uint16_t *)dst;
  if (dt == TW_BF16)
    for (int64_t i = 0; i < n; i++) h[i] = tw_f32_to_bf16(src[i]);
  else
    for (int64_t i = 0; i < n; i++) h[i] = tw_f32_to_f16(src[i]);
}

/* An operand as f32 values in its own storage order: f32 data is read in place; 16-bit data
 * is widened and quantized data dequantized (ref_dequantize_operand), once, into a scratch
 * copy. Only the first n_read elements are widened: rows past the groups are never read. */
typedef struct {
  const float *p;
  float *owned; /* the scratch copy, or NULL */
} f32_source;

static tw_status source_open(const char *op, const char *name, int slot, const tw_operand *o,
                             int64_t n_read, const int32_t *group_sizes, int64_t G,
                             f32_source *src) {
  src->p = NULL;
  src->owned = NULL;
  if (o->mode == TW_SCALE_NONE && o->data.dtype == TW_F32) {
    static const float empty_f32[1];
    src->p = o->data.data ? (const float *)o->data.data : empty_f32;
    return TW_OK;
  }
  /* quantized: every stored element (a token-padded copy comes back unpadded: M * K) */
  int64_t n = o->mode == TW_SCALE_NONE ? n_read
              : o->col_padded        ? o->src_rows * o->src_cols
                                     : tw_tensor_numel(&o->data);
  TW_TRY(alloc_f32(op, name, slot, n, &src->owned));
  static const float empty_source[1];
  src->p = src->owned ? src->owned : empty_source; /* never NULL: callers offset it */
  if (n == 0) return TW_OK;
  if (o->mode == TW_SCALE_NONE) {
    widen(o->data.data, o->data.dtype, n, src->owned);
    return TW_OK;
  }
  return ref_dequantize_operand(o, group_sizes, G, src->owned);
}

/* ---- one GEMM into an output slice ---------------------------------------------------- */

static tw_status blas_sizes(const char *op, int64_t m, int64_t n, int64_t k) {
  const char *names[3] = {"M", "N", "K"};
  int64_t v[3] = {m, n, k};
  for (int i = 0; i < 3; i++)
    if (v[i] > INT_MAX)
      return tw_error(TW_ERR_UNSUPPORTED,
                      "%s: %s = %lld exceeds the ref backend's OpenBLAS int range (%d)", op,
                      names[i], (long long)v[i], INT_MAX);
  return TW_OK;
}

/* C[m, n] (row-major, ld n, element offset c_off of out) = op(A) op(B) (+ C when
 * accumulating). A is [m, k] after op_a, stored with leading dim lda; B likewise.
 * scratch holds m*n floats when out is 16-bit. */
/* OpenBLAS's thread count is process-wide and its sgemm's bits depend on it for some shapes, so
 * with thread ranks (several callers at once) fwd_groups_parallel's "1 thread while my workers
 * run" leaked into other ranks' calls (1-ulp differences run to run, seen in moe_test). Every
 * sgemm outside those workers holds this lock shared; fwd_groups_parallel holds it exclusively
 * while the count is 1, so each call runs at the count it would run at alone. */
static pthread_rwlock_t blas_count_lock = PTHREAD_RWLOCK_INITIALIZER;
static __thread int blas_in_worker; /* set in fwd_groups_parallel's workers (count held at 1) */

static void gemm_slice(const float *A, int trans_a, int64_t lda, const float *B, int trans_b,
                       int64_t ldb, int64_t m, int64_t n, int64_t k, tw_tensor *out,
                       int64_t c_off, int accumulate, float *scratch) {
  if (m == 0 || n == 0) return;
  if (k == 0 && accumulate) return; /* adds nothing: leave the bytes as they are */
  float *C = out->dtype == TW_F32 ? (float *)out->data + c_off : scratch;
  char *c16 = (char *)out->data + c_off * 2;
  if (out->dtype != TW_F32 && accumulate) widen(c16, out->dtype, m * n, C);
  if (k == 0) {
    memset(C, 0, (size_t)(m * n) * sizeof(float));
  } else {
    if (!blas_in_worker) pthread_rwlock_rdlock(&blas_count_lock);
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, 1.0f, A, (int)lda, B,
                (int)ldb, accumulate ? 1.0f : 0.0f, C, (int)n);
    if (!blas_in_worker) pthread_rwlock_unlock(&blas_count_lock);
  }
  if (out->dtype != TW_F32) narrow(C, out->dtype, m * n, c16);
}

/* ---- dense / batched ------------------------------------------------------------------- */

tw_status ref_gemm(tw_ctx *ctx, const tw_operand *a, tw_op op_a, const tw_operand *b, tw_op op_b,
                   tw_tensor *out, int accumulate) {
  (void)ctx;
  const char *op = "gemm";
  const tw_tensor *A = &a->data, *B = &b->data;
  int oa = A->ndim - 2, ob = B->ndim - 2;
  /* storage of one batch: a [ra, ca], b [rb, cb] */
  int64_t ra = A->shape[oa], ca = A->shape[oa + 1], rb = B->shape[ob], cb = B->shape[ob + 1];
  int64_t M = op_a == TW_OP_N ? ra : ca, K = op_a == TW_OP_N ? ca : ra;
  int64_t N = op_b == TW_OP_N ? cb : rb;
  int64_t batch = out->ndim == 3 ? out->shape[0] : 1;
  TW_TRY(blas_sizes(op, M, N, K));
  if (M == 0 || N == 0 || batch == 0) return TW_OK;

  f32_source fa = {0}, fb = {0};
  float *scratch = NULL;
  tw_status s = source_open(op, "a", SCRATCH_A, a, tw_tensor_numel(A), NULL, 1, &fa);
  if (s == TW_OK) s = source_open(op, "b", SCRATCH_B, b, tw_tensor_numel(B), NULL, 1, &fb);
  if (s == TW_OK && out->dtype != TW_F32) s = alloc_f32(op, "out", SCRATCH_OUT, M * N, &scratch);
  if (s == TW_OK) {
    /* a 2-D operand is broadcast over the batch: stride 0 */
    int64_t sa = A->ndim == 3 ? ra * ca : 0, sb = B->ndim == 3 ? rb * cb : 0;
    for (int64_t i = 0; i < batch; i++)
      gemm_slice(fa.p + i * sa, op_a == TW_OP_T, ca, fb.p + i * sb, op_b == TW_OP_T, cb, M, N, K,
                 out, i * M * N, accumulate, scratch);
  }
  float *used[3] = {fa.owned, fb.owned, scratch};
  scratch_release(used, 3);
  return s;
}

/* ---- grouped forward: ragged M --------------------------------------------------------- */

/* Host offsets o_g [G+1] and the largest group; NULL when out of memory. */
static int64_t *group_offsets(const char *op, const tw_tensor *group_sizes, int64_t *max_m) {
  const int32_t *gs = (const int32_t *)group_sizes->data;
  int64_t G = group_sizes->shape[0];
  int64_t *off = (int64_t *)malloc((size_t)(G + 1) * sizeof(int64_t));
  if (!off) {
    tw_error(TW_ERR_MEMORY, "%s: no host memory for %lld group offsets", op, (long long)G);
    return NULL;
  }
  tw_group_offsets(gs, G, off);
  *max_m = 0;
  for (int64_t g = 0; g < G; g++) *max_m = gs[g] > *max_m ? gs[g] : *max_m;
  return off;
}

/* Many groups, none dominant: run the groups in parallel, one single-threaded sgemm each, on
 * as many threads as OpenBLAS would use. OpenBLAS splits one GEMM across threads by blocks of
 * the output, never along K, so every element is computed exactly as in the sequential loop;
 * what changes is that a small group is no longer split (and synchronized) across threads.
 * Measured on 2 cores, 64 groups of ~70 rows: 80 -> 110 GFLOP/s. Returns 0 (nothing done)
 * when the sequential loop is the better choice or no thread can be had. */
typedef struct {
  const float *a, *b;
  const int64_t *off;
  const int32_t *gs;
  int64_t G, K, N;
  int trans_b;
  tw_tensor *out;
  int accumulate;
  int64_t next; /* next group to take (atomic) */
} fwd_groups;

typedef struct {
  fwd_groups *job;
  float *scratch; /* max_m * N floats when out is 16-bit */
} fwd_worker;

static void *fwd_groups_run(void *arg) {
  fwd_worker *w = (fwd_worker *)arg;
  fwd_groups *j = w->job;
  blas_in_worker = 1;
  for (;;) {
    int64_t g = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (g >= j->G) {
      blas_in_worker = 0;
      return NULL;
    }
    if (j->gs[g] == 0) continue;
    gemm_slice(j->a + j->off[g] * j->K, 0, j->K, j->b + g * j->K * j->N, j->trans_b,
               j->trans_b ? j->K : j->N, j->gs[g], j->N, j->K, j->out, j->off[g] * j->N,
               j->accumulate, w->scratch);
  }
}

#define FWD_MAX_THREADS 64

static int fwd_groups_parallel(fwd_groups *j, int64_t max_m) {
  pthread_rwlock_rdlock(&blas_count_lock); /* the count as it is with no workers running */
  const int T0 = openblas_get_num_threads();
  pthread_rwlock_unlock(&blas_count_lock);
  int T = T0 > FWD_MAX_THREADS ? FWD_MAX_THREADS : T0;
  int64_t S = j->off[j->G];
  if (T < 2 || j->G < 2 * T || max_m * T > S) return 0;
  fwd_worker w[FWD_MAX_THREADS];
  pthread_t th[FWD_MAX_THREADS];
  int started[FWD_MAX_THREADS] = {0};
  size_t sbytes = j->out->dtype == TW_F32 ? 0 : sizeof(float) * (size_t)(max_m * j->N);
  for (int t = 0; t < T; t++) {
    w[t].job = j;
    w[t].scratch = sbytes ? (float *)malloc(sbytes) : NULL;
    if (sbytes && !w[t].scratch) {
      for (int u = 0; u < t; u++) free(w[u].scratch);
      return 0;
    }
  }
  /* The thread count is process-wide: hold it at 1 only while this call's workers run. */
  pthread_rwlock_wrlock(&blas_count_lock);
  openblas_set_num_threads(1);
  for (int t = 1; t < T; t++) started[t] = pthread_create(&th[t], NULL, fwd_groups_run, &w[t]) == 0;
  fwd_groups_run(&w[0]);
  for (int t = 1; t < T; t++)
    if (started[t]) pthread_join(th[t], NULL);
  openblas_set_num_threads(T0);
  pthread_rwlock_unlock(&blas_count_lock);
  for (int t = 0; t < T; t++) free(w[t].scratch);
  return 1;
}

tw_status ref_grouped_gemm(tw_ctx *ctx, const tw_operand *lhs, const tw_operand *rhs,
                           tw_op rhs_op, const tw_tensor *group_sizes, tw_tensor *out,
                           int accumulate) {
  (void)ctx;
  const char *op = "grouped_gemm";
  const int32_t *gs = (const int32_t *)group_sizes->data;
  int64_t G = group_sizes->shape[0];
  int64_t K = lhs->data.shape[1], N = out->shape[1], max_m;
  int64_t *off = group_offsets(op, group_sizes, &max_m);
  if (!off) return TW_ERR_MEMORY;
  tw_status s = blas_sizes(op, max_m, N, K);
  if (s != TW_OK || off[G] == 0 || N == 0) {
    free(off);
    return s;
  }

  /* lhs group g: rows [o_g, o_g + m_g), ld K. rhs group g: storage [K, N] (op N) or
   * [N, K] (op T) at element g*K*N. */
  f32_source fl = {0}, fr = {0};
  float *scratch = NULL;
  s = source_open(op, "lhs", SCRATCH_A, lhs, off[G] * K, gs, G, &fl);
  if (s == TW_OK) s = source_open(op, "rhs", SCRATCH_B, rhs, G * K * N, NULL, G, &fr);
  if (s == TW_OK && out->dtype != TW_F32) s = alloc_f32(op, "out", SCRATCH_OUT, max_m * N, &scratch);
  if (s == TW_OK) {
    int trans_b = rhs_op == TW_OP_T;
    fwd_groups job = {fl.p, fr.p, off, gs, G, K, N, trans_b, out, accumulate, 0};
    if (!fwd_groups_parallel(&job, max_m))
      for (int64_t g = 0; g < G; g++) {
        if (gs[g] == 0) continue;
        gemm_slice(fl.p + off[g] * K, 0, K, fr.p + g * K * N, trans_b, trans_b ? K : N, gs[g], N, K,
                   out, off[g] * N, accumulate, scratch);
      }
  }
  float *used[3] = {fl.owned, fr.owned, scratch};
  scratch_release(used, 3);
  free(off);
  return s;
}

/* ---- grouped wgrad: ragged contracting dim --------------------------------------------- */

static void zero_out(tw_tensor *out, int64_t off, int64_t n) {
  size_t es = out->dtype == TW_F32 ? 4 : 2; /* +0.0 is all-zero bits in f32, bf16 and f16 */
  memset((char *)out->data + off * (int64_t)es, 0, (size_t)n * es);
}

tw_status ref_grouped_gemm_wgrad(tw_ctx *ctx, const tw_operand *lhs, tw_op lhs_op,
                                 const tw_operand *rhs, tw_op rhs_op,
                                 const tw_tensor *group_sizes, tw_tensor *out, int accumulate) {
  (void)ctx;
  const char *op = "grouped_gemm_wgrad";
  const int32_t *gs = (const int32_t *)group_sizes->data;
  int64_t G = out->shape[0], K = out->shape[1], N = out->shape[2], max_m;
  int64_t *off = group_offsets(op, group_sizes, &max_m);
  if (!off) return TW_ERR_MEMORY;
  tw_status s = blas_sizes(op, K, N, max_m);
  if (s != TW_OK || K == 0 || N == 0) {
    free(off);
    return s;
  }

  /* Group g of lhs starts at element o_g*K in both layouts: op N rows [m_g, K] (ld K),
   * op T a [K, m_g] block (ld m_g). Likewise rhs with N. */
  f32_source fl = {0}, fr = {0};
  float *scratch = NULL;
  s = source_open(op, "lhs", SCRATCH_A, lhs, off[G] * K, gs, G, &fl);
  if (s == TW_OK) s = source_open(op, "rhs", SCRATCH_B, rhs, off[G] * N, gs, G, &fr);
  if (s == TW_OK && out->dtype != TW_F32) s = alloc_f32(op, "out", SCRATCH_OUT, K * N, &scratch);
  if (s == TW_OK) {
    int lt = lhs_op == TW_OP_T, rt = rhs_op == TW_OP_T;
    for (int64_t g = 0; g < G; g++) {
      int64_t m = gs[g];
      if (m == 0) {
        if (!accumulate) zero_out(out, g * K * N, K * N);
        continue;
      }
      /* out[g] = lhs_g^T rhs_g: lhs_g^T is the [m, K] rows transposed, or the [K, m] block */
      gemm_slice(fl.p + off[g] * K, !lt, lt ? m : K, fr.p + off[g] * N, rt, rt ? m : N, K, N, m, out,
                 g * K * N, accumulate, scratch);
    }
  }
  float *used[3] = {fl.owned, fr.owned, scratch};
  scratch_release(used, 3);
  free(off);
  return s;
}

/* ---- row-gathered lhs: a gather, then the same GEMM -------------------------------------- */

/* L [M, K] f32 (malloc'd; *t views it): L[i] = the value of lhs row lhs_rows[i] (the [U, K]
 * source dequantized as one group), zeros for -1; rows i >= S are never read by the GEMM (left
 * zero). */
static tw_status gather_lhs(const char *op, const tw_operand *lhs, const tw_tensor *lhs_rows,
                            const tw_tensor *group_sizes, float **L, tw_tensor *t) {
  int64_t M = lhs_rows->shape[0], K = lhs->mode == TW_SCALE_NONE ? lhs->data.shape[1] : lhs->src_cols;
  int64_t U = lhs->mode == TW_SCALE_NONE ? lhs->data.shape[0] : lhs->src_rows, S = 0;
  for (int64_t g = 0; g < group_sizes->shape[0]; g++) S += ((const int32_t *)group_sizes->data)[g];
  *L = (float *)calloc((size_t)(M * K) + 1, sizeof(float));
  if (!*L) return tw_error(TW_ERR_MEMORY, "%s: no host memory for the gathered lhs (%lld x %lld)", op, (long long)M,
                           (long long)K);
  int32_t one = (int32_t)U;
  f32_source src = {0};
  tw_status s = source_open(op, "lhs", SCRATCH_A, lhs, U * K, &one, 1, &src);
  const int32_t *rows = (const int32_t *)lhs_rows->data;
  for (int64_t i = 0; s == TW_OK && i < S; i++) {
    if (rows[i] < -1 || rows[i] >= U) /* the API checked; kept for callers of the backend table */
      s = tw_error(TW_ERR_INVALID_ARG, "%s: lhs_rows[%lld] = %d is outside [-1, U = %lld)", op, (long long)i, rows[i],
                   (long long)U);
    else if (rows[i] >= 0)
      memcpy(*L + i * K, src.p + (int64_t)rows[i] * K, (size_t)K * sizeof(float));
  }
  float *used[1] = {src.owned};
  scratch_release(used, 1);
  if (s != TW_OK) {
    free(*L);
    *L = NULL;
  }
  *t = tw_tensor_2d(*L, TW_F32, M, K, TW_MEM_HOST);
  return s;
}

tw_status ref_grouped_gemm_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                                tw_tensor *out, int accumulate) {
  float *L = NULL;
  tw_tensor t;
  TW_TRY(gather_lhs("grouped_gemm_rows", lhs, lhs_rows, group_sizes, &L, &t));
  tw_operand gathered = tw_operand_plain(&t);
  tw_status s = ref_grouped_gemm(ctx, &gathered, rhs, rhs_op, group_sizes, out, accumulate);
  free(L);
  return s;
}

tw_status ref_grouped_gemm_wgrad_rows(tw_ctx *ctx, const tw_operand *lhs, const tw_tensor *lhs_rows,
                                      const tw_operand *rhs, tw_op rhs_op, const tw_tensor *group_sizes,
                                      tw_tensor *out, int accumulate) {
  float *L = NULL;
  tw_tensor t;
  TW_TRY(gather_lhs("grouped_gemm_wgrad_rows", lhs, lhs_rows, group_sizes, &L, &t));
  tw_operand gathered = tw_operand_plain(&t);
  tw_status s = ref_grouped_gemm_wgrad(ctx, &gathered, TW_OP_N, rhs, rhs_op, group_sizes, out, accumulate);
  free(L);
  return s;
}
