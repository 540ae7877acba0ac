/* Shrinking: greedy reduction of a failing case while it still fails the same check.
 * Order: drop whole groups, shorten groups and the tail, cut K and N (halves, then single
 * indices at both ends), then simplify values (zero halves, then single elements, then
 * round to small integers). Each accepted step restarts the pass; the loop stops when a pass
 * accepts nothing or the time is up. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fuzz/fuzz_internal.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* In-place removal of [start, start+cnt) along axis ax of a [d0, d1, d2] array. */
static void remove_axis(float *p, int64_t d0, int64_t d1, int64_t d2, int ax, int64_t start, int64_t cnt) {
  if (!p) return;
  int64_t w = 0;
  for (int64_t i = 0; i < d0; i++)
    for (int64_t j = 0; j < d1; j++)
      for (int64_t k = 0; k < d2; k++) {
        int64_t idx = ax == 0 ? i : (ax == 1 ? j : k);
        if (idx >= start && idx < start + cnt) continue;
        p[w++] = p[(i * d1 + j) * d2 + k];
      }
}

typedef enum { R_ROWS, R_K, R_N, R_GROUP } rkind;

static int64_t group_offset(const fz_case *c, int64_t g) {
  int64_t o = 0;
  for (int64_t i = 0; i < g; i++) o += c->group_sizes[i];
  return o;
}

/* Removes rows [start, start+cnt) that lie inside group g (g = -1: inside the tail). */
static int remove_rows(fz_case *c, int64_t g, int64_t start, int64_t cnt) {
  if (cnt <= 0 || start < 0 || start + cnt > c->M) return -1;
  int64_t M = c->M;
  switch (c->op) {
    case FZ_QUANTIZE: case FZ_CAST: remove_axis(c->x, 1, M, c->K, 1, start, cnt); break;
    case FZ_GEMM: case FZ_GROUPED_GEMM:
      remove_axis(c->a, 1, M, c->K, 1, start, cnt);
      remove_axis(c->out_init, 1, M, c->N, 1, start, cnt);
      break;
    case FZ_WGRAD:
      remove_axis(c->a, 1, M, c->K, 1, start, cnt);
      remove_axis(c->b, 1, M, c->N, 1, start, cnt);
      break;
    default: return -1;
  }
  if (g >= 0) c->group_sizes[g] -= (int32_t)cnt;
  c->M -= cnt;
  return 0;
}

static int remove_k(fz_case *c, int64_t start, int64_t cnt) {
  if (cnt <= 0 || start < 0 || start + cnt > c->K || c->K - cnt < 1) return -1;
  int64_t K = c->K;
  switch (c->op) {
    case FZ_QUANTIZE: case FZ_CAST: remove_axis(c->x, 1, c->M, K, 2, start, cnt); break;
    case FZ_GEMM:
      remove_axis(c->a, 1, c->M, K, 2, start, cnt);
      remove_axis(c->b, 1, K, c->N, 1, start, cnt);
      break;
    case FZ_GROUPED_GEMM:
      remove_axis(c->a, 1, c->M, K, 2, start, cnt);
      remove_axis(c->b, c->G, K, c->N, 1, start, cnt);
      break;
    case FZ_WGRAD:
      remove_axis(c->a, 1, c->M, K, 2, start, cnt);
      remove_axis(c->out_init, c->G, K, c->N, 1, start, cnt);
      break;
    default: return -1;
  }
  c->K -= cnt;
  return 0;
}

static int remove_n(fz_case *c, int64_t start, int64_t cnt) {
  if (cnt <= 0 || start < 0 || start + cnt > c->N || c->N - cnt < 1) return -1;
  int64_t N = c->N;
  switch (c->op) {
    case FZ_GEMM:
      remove_axis(c->b, 1, c->K, N, 2, start, cnt);
      remove_axis(c->out_init, 1, c->M, N, 2, start, cnt);
      break;
    case FZ_GROUPED_GEMM:
      remove_axis(c->b, c->G, c->K, N, 2, start, cnt);
      remove_axis(c->out_init, 1, c->M, N, 2, start, cnt);
      break;
    case FZ_WGRAD:
      remove_axis(c->b, 1, c->M, N, 2, start, cnt);
      remove_axis(c->out_init, c->G, c->K, N, 2, start, cnt);
      break;
    default: return -1;
  }
  c->N -= cnt;
  return 0;
}

static int remove_group(fz_case *c, int64_t g) {
  if (c->G <= 1 || g < 0 || g >= c->G) return -1;
  int64_t o = group_offset(c, g), m = c->group_sizes[g];
  if (m > 0 && remove_rows(c, g, o, m) != 0) return -1;
  if (c->op == FZ_GROUPED_GEMM) remove_axis(c->b, c->G, c->K, c->N, 0, g, 1);
  if (c->op == FZ_WGRAD) remove_axis(c->out_init, c->G, c->K, c->N, 0, g, 1);
  if (c->scale) memmove(c->scale + g, c->scale + g + 1, sizeof(float) * (size_t)(c->G - g - 1));
  memmove(c->group_sizes + g, c->group_sizes + g + 1, sizeof(int32_t) * (size_t)(c->G - g - 1));
  c->G--;
  return 0;
}

typedef struct {
  tw_ctx *subject, *oracle;
  const char *target;
  int severity;
  double deadline;
  fz_shrink_stats *st;
} shrinker;

/* Runs cand; keeps it as *best if it still fails the same way. */
static int try_accept(shrinker *sh, fz_case *best, fz_case *cand) {
  sh->st->attempts++;
  fz_result r;
  fz_run_case(sh->subject, sh->oracle, cand, &r);
  /* the same check, at least as badly: a gross error must not shrink into a marginal one */
  if (r.verdict == FZ_FAIL && strcmp(r.first_failure, sh->target) == 0 && r.severity >= sh->severity) {
    fz_case_free(best);
    *best = *cand;
    sh->st->accepted++;
    return 1;
  }
  fz_case_free(cand);
  return 0;
}

static int timed_out(const shrinker *sh) { return now_s() > sh->deadline; }

/* One structural step; 1 if something was accepted. */
static int shrink_structure(shrinker *sh, fz_case *best) {
  fz_case cand;
  int grouped = best->op == FZ_QUANTIZE || best->op == FZ_GROUPED_GEMM || best->op == FZ_WGRAD;
  if (grouped) {
    for (int64_t g = best->G - 1; g >= 0 && !timed_out(sh); g--) {
      if (fz_case_copy(&cand, best)) return 0;
      if (remove_group(&cand, g) == 0) { if (try_accept(sh, best, &cand)) return 1; }
      else fz_case_free(&cand);
    }
    int64_t S = group_offset(best, best->G);
    int64_t tail = best->M - S;
    int64_t tcuts[2] = {tail, tail / 2};
    for (int i = 0; i < 2 && !timed_out(sh); i++) {
      if (tcuts[i] <= 0) continue;
      if (fz_case_copy(&cand, best)) return 0;
      if (remove_rows(&cand, -1, S, tcuts[i]) == 0) { if (try_accept(sh, best, &cand)) return 1; }
      else fz_case_free(&cand);
    }
    for (int64_t g = 0; g < best->G && !timed_out(sh); g++) {
      int64_t m = best->group_sizes[g], o = group_offset(best, g);
      int64_t cuts[4] = {m, m / 2, 1, 1};
      int64_t from[4] = {o, o + m - m / 2, o + m - 1, o};
      for (int i = 0; i < 4; i++) {
        if (cuts[i] <= 0 || m == 0) continue;
        if (fz_case_copy(&cand, best)) return 0;
        if (remove_rows(&cand, g, from[i], cuts[i]) == 0) { if (try_accept(sh, best, &cand)) return 1; }
        else fz_case_free(&cand);
      }
    }
  } else if (best->M > 0) {
    int64_t M = best->M;
    int64_t cnt[4] = {M / 2, M / 2, 1, 1}, st[4] = {M - M / 2, 0, M - 1, 0};
    for (int i = 0; i < 4 && !timed_out(sh); i++) {
      if (cnt[i] <= 0) continue;
      if (fz_case_copy(&cand, best)) return 0;
      if (remove_rows(&cand, -1, st[i], cnt[i]) == 0) { if (try_accept(sh, best, &cand)) return 1; }
      else fz_case_free(&cand);
    }
  }
  /* K and N: halves from either end, then single indices at the ends */
  for (int dim = 0; dim < 2; dim++) {
    int64_t D = dim == 0 ? best->K : best->N;
    if (dim == 1 && best->op <= FZ_CAST) break;
    int64_t cnt[4] = {D / 2, D / 2, 1, 1}, st[4] = {D - D / 2, 0, D - 1, 0};
    for (int i = 0; i < 4 && !timed_out(sh); i++) {
      if (cnt[i] <= 0) continue;
      if (fz_case_copy(&cand, best)) return 0;
      int rc = dim == 0 ? remove_k(&cand, st[i], cnt[i]) : remove_n(&cand, st[i], cnt[i]);
      if (rc == 0) { if (try_accept(sh, best, &cand)) return 1; }
      else fz_case_free(&cand);
    }
  }
  return 0;
}

static float *array_of(fz_case *c, int which, int64_t *n) {
  switch (which) {
    case 0: *n = fz_numel_x(c); return c->x;
    case 1: *n = fz_numel_a(c); return c->a;
    case 2: *n = fz_numel_b(c); return c->b;
    case 3: *n = c->out_init ? fz_numel_out(c) : 0; return c->out_init;
    default: *n = 0; return NULL;
  }
}

/* Value steps: zero ranges, then single elements to 0, then to round small integers. */
static int shrink_values(shrinker *sh, fz_case *best) {
  fz_case cand;
  for (int w = 0; w < 4; w++) {
    int64_t n;
    float *p = array_of(best, w, &n);
    if (!p || n == 0) continue;
    /* zero halves, quarters, ... of the array */
    int64_t min_len = n <= 512 ? 1 : n / 64;
    for (int64_t len = n / 2; len >= min_len && len >= 1 && !timed_out(sh); len /= 2) {
      for (int64_t s0 = 0; s0 < n && !timed_out(sh); s0 += len) {
        int64_t e = s0 + len < n ? s0 + len : n, nz = 0;
        for (int64_t i = s0; i < e; i++) nz += p[i] != 0.0f || signbit(p[i]);
        if (!nz) continue;
        if (fz_case_copy(&cand, best)) return 0;
        int64_t cn;
        float *q = array_of(&cand, w, &cn);
        for (int64_t i = s0; i < e; i++) q[i] = 0.0f;
        if (try_accept(sh, best, &cand)) return 1;
      }
    }
    /* round survivors to small integers (1, or their rounded value) */
    for (int64_t i = 0; i < n && i < 512 && !timed_out(sh); i++) {
      float v = p[i];
      if (v == 0.0f || !isfinite(v)) continue;
      float r = roundf(v);
      if (r == 0.0f) r = v > 0 ? 1.0f : -1.0f;
      if (fabsf(r) > 8) r = v > 0 ? 1.0f : -1.0f;
      if (r == v) continue;
      if (fz_case_copy(&cand, best)) return 0;
      int64_t cn;
      array_of(&cand, w, &cn)[i] = r;
      if (try_accept(sh, best, &cand)) return 1;
    }
  }
  return 0;
}

void fz_shrink(tw_ctx *subject, tw_ctx *oracle, fz_case *c, const fz_result *failing,
               double max_seconds, fz_shrink_stats *st) {
  memset(st, 0, sizeof *st);
  double t0 = now_s();
  shrinker sh = {subject, oracle, failing->first_failure, failing->severity, t0 + max_seconds, st};
  st->elements_before = fz_case_elements(c);
  while (!timed_out(&sh)) {
    if (shrink_structure(&sh, c)) continue;
    if (shrink_values(&sh, c)) continue;
    break;
  }
  st->elements_after = fz_case_elements(c);
  st->seconds = now_s() - t0;
}
