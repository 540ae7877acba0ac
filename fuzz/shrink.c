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
  fz_shard_env *env; /* sharded cases run through it */
  const char *target;
  int severity;
  double deadline;
  fz_shrink_stats *st;
} shrinker;

/* Runs cand; keeps it as *best if it still fails the same way. */
static int try_accept(shrinker *sh, fz_case *best, fz_case *cand) {
  sh->st->attempts++;
  fz_result r;
  if (cand->sharded) fz_run_sharded(sh->env, cand, &r);
  else fz_run_case(sh->subject, sh->oracle, cand, &r);
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
  shrinker sh = {subject, oracle, NULL, failing->first_failure, failing->severity, t0 + max_seconds, st};
  st->elements_before = fz_case_elements(c);
  while (!timed_out(&sh)) {
    if (shrink_structure(&sh, c)) continue;
    if (shrink_values(&sh, c)) continue;
    break;
  }
  st->elements_after = fz_case_elements(c);
  st->seconds = now_s() - t0;
}

/* ======================================================================================
 * sharded cases: fewer ranks, simpler specs, smaller dims, fewer groups, then values
 * ====================================================================================== */
static void spec_drop_axis(tw_pspec *p, tw_axis a) {
  for (int d = 0; d < p->ndim; d++) {
    tw_dimspec *ds = &p->dim[d];
    int w = 0;
    for (int i = 0; i < ds->n; i++)
      if (ds->axis[i] != a) ds->axis[w++] = ds->axis[i];
    ds->n = w;
  }
}

/* Drop a mesh axis (and it from the specs), or halve it. */
static int shrink_mesh(shrinker *sh, fz_case *best) {
  fz_case cand;
  for (int i = best->mesh.naxes - 1; i >= 0 && !timed_out(sh); i--) {
    if (fz_case_copy(&cand, best)) return 0;
    tw_axis a = cand.mesh.axis[i];
    tw_mesh m = cand.mesh;
    for (int k = i; k + 1 < m.naxes; k++) { m.axis[k] = m.axis[k + 1]; m.size[k] = m.size[k + 1]; }
    m.naxes--;
    cand.mesh = m;
    spec_drop_axis(&cand.x_spec, a);
    spec_drop_axis(&cand.w_spec, a);
    if (try_accept(sh, best, &cand)) return 1;
  }
  for (int i = 0; i < best->mesh.naxes && !timed_out(sh); i++) {
    if (best->mesh.size[i] % 2 || best->mesh.size[i] < 4) continue; /* size 2: dropping it is the step */
    if (fz_case_copy(&cand, best)) return 0;
    cand.mesh.size[i] /= 2;
    if (try_accept(sh, best, &cand)) return 1;
  }
  return 0;
}

/* Drop the last axis of one dim's spec. */
static int shrink_specs(shrinker *sh, fz_case *best) {
  fz_case cand;
  for (int t = 0; t < 2; t++) {
    const tw_pspec *p = t ? &best->w_spec : &best->x_spec;
    for (int d = 0; d < p->ndim && !timed_out(sh); d++) {
      if (!p->dim[d].n) continue;
      if (fz_case_copy(&cand, best)) return 0;
      tw_pspec *q = t ? &cand.w_spec : &cand.x_spec;
      q->dim[d].n--;
      if (try_accept(sh, best, &cand)) return 1;
    }
  }
  return 0;
}

static int64_t *dim_of(fz_case *c, char L) {
  return L == 'B' ? &c->B : L == 'M' ? &c->M : L == 'K' ? &c->K : L == 'N' ? &c->N : &c->G;
}

/* Removes [start, start+cnt) along logical dim L from every array holding it (and from the
 * group sizes for rows, and w's experts / the scales for G). */
static int remove_logical(fz_case *c, char L, int64_t start, int64_t cnt) {
  int64_t *D = dim_of(c, L);
  if (cnt <= 0 || start < 0 || start + cnt > *D) return -1;
  int nd[3];
  int64_t shape[3][TW_MAX_DIMS];
  char dims[3][TW_MAX_DIMS + 1];
  fz_shard_shapes(c, nd, shape, dims);
  float *arr[2] = {c->rule == TW_SHARD_GROUPED_QUANTIZE ? c->x : c->a, c->b};
  for (int t = 0; t < 2; t++) {
    if (!arr[t] || nd[t] == 0) continue;
    for (int d = 0; d < nd[t]; d++) {
      if (dims[t][d] != L) continue;
      int64_t before = 1, after = 1;
      for (int k = 0; k < d; k++) before *= shape[t][k];
      for (int k = d + 1; k < nd[t]; k++) after *= shape[t][k];
      remove_axis(arr[t], before, shape[t][d], after, 1, start, cnt);
    }
  }
  if (L == 'M' && c->group_sizes) { /* each removed row leaves its group (or the tail) */
    for (int64_t row = start + cnt - 1; row >= start; row--) {
      int64_t o = 0;
      for (int64_t g = 0; g < c->G; g++) {
        if (row < o + c->group_sizes[g]) { c->group_sizes[g]--; break; }
        o += c->group_sizes[g];
      }
    }
  }
  if (L == 'G') {
    memmove(c->group_sizes + start, c->group_sizes + start + cnt, sizeof(int32_t) * (size_t)(c->G - start - cnt));
    if (c->scale) memmove(c->scale + start, c->scale + start + cnt, sizeof(float) * (size_t)(c->G - start - cnt));
  }
  *D -= cnt;
  return 0;
}

/* The rows per block that must stay together: x's rows on ep make ep blocks of M/ep rows
 * whose groups are that ep rank's experts. */
static int64_t ep_blocks(const fz_case *c) {
  if (c->rule != TW_SHARD_GROUPED_GEMM) return 1;
  for (int i = 0; i < c->x_spec.dim[0].n; i++)
    if (c->x_spec.dim[0].axis[i] == TW_AXIS_EP) {
      int64_t e = tw_mesh_axis_size(&c->mesh, TW_AXIS_EP);
      return e > 0 && c->M % e == 0 && c->G % e == 0 ? e : 1;
    }
  return 1;
}

/* Smaller dims: halves and single quanta (the shard count of the dim) from the end; rows in
 * every ep block alike; whole groups when no ep blocks bind them. */
static int shrink_sharded_dims(shrinker *sh, fz_case *best) {
  fz_case cand;
  int R = tw_mesh_ranks(&best->mesh);
  const char *letters = best->rule == TW_SHARD_DENSE ? "BMKN" : best->rule == TW_SHARD_GROUPED_GEMM ? "MKNG" : "MK";
  for (const char *L = letters; *L && !timed_out(sh); L++) {
    if (*L == 'B' && best->B == 0) continue;
    int64_t D = *dim_of(best, *L);
    if (*L == 'G') {
      if (ep_blocks(best) > 1) continue;
      for (int64_t g = best->G - 1; g >= 0 && best->G > 1 && !timed_out(sh); g--) {
        if (fz_case_copy(&cand, best)) return 0;
        int64_t o = 0;
        for (int64_t k = 0; k < g; k++) o += cand.group_sizes[k];
        int64_t m = cand.group_sizes[g];
        int ok = (m == 0 || remove_logical(&cand, 'M', o, m) == 0) && remove_logical(&cand, 'G', g, 1) == 0;
        if (ok && try_accept(sh, best, &cand)) return 1;
        if (!ok) fz_case_free(&cand);
      }
      continue;
    }
    int64_t E = *L == 'M' ? ep_blocks(best) : 1, per = D / E;
    int64_t cuts[3] = {per / 2, R > 1 ? R : 1, 1};
    for (int i = 0; i < 3 && !timed_out(sh); i++) {
      int64_t cnt = cuts[i];
      if (cnt <= 0 || cnt > per || (i > 0 && cnt == cuts[i - 1])) continue;
      if (*L != 'M' && *L != 'B' && per - cnt < 1) continue; /* K, N stay >= 1 */
      if (fz_case_copy(&cand, best)) return 0;
      int ok = 1;
      for (int64_t e = E - 1; e >= 0 && ok; e--) ok = remove_logical(&cand, *L, (e + 1) * per - cnt, cnt) == 0;
      if (ok && try_accept(sh, best, &cand)) return 1;
      if (!ok) fz_case_free(&cand);
    }
  }
  return 0;
}

void fz_shrink_sharded(fz_shard_env *e, fz_case *c, const fz_result *failing, double max_seconds,
                       fz_shrink_stats *st) {
  memset(st, 0, sizeof *st);
  double t0 = now_s();
  shrinker sh = {NULL, NULL, e, failing->first_failure, failing->severity, t0 + max_seconds, st};
  st->elements_before = fz_case_elements(c);
  while (!timed_out(&sh)) {
    if (shrink_mesh(&sh, c)) continue;
    if (shrink_specs(&sh, c)) continue;
    if (shrink_sharded_dims(&sh, c)) continue;
    if (shrink_values(&sh, c)) continue;
    break;
  }
  st->elements_after = fz_case_elements(c);
  st->seconds = now_s() - t0;
}
