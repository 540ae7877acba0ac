/* The MoE block's differential fuzzer (moe/fuzz.h). */
#include "moe/fuzz.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe/elementwise.h"
#include "moe/threads.h"

static uint64_t next_u64(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static int pick(uint64_t *s, int lo, int hi) { return lo + (int)(next_u64(s) % (uint64_t)(hi - lo + 1)); }
static float uni(uint64_t *s, float lo, float hi) { return lo + (hi - lo) * (float)((next_u64(s) >> 40) * 0x1.0p-24); }

enum { FP8_MIN_HF = 4 };

/* fp8_gather of block or MXFP8 scales over fsdp: H / fsdp must be a multiple of 128. */
static int gather_tiles(const tw_moe_fuzz_case *c) {
  return c->fp8_gather && c->fsdp > 1 && (c->recipe == TW_MOE_FP8_BLOCK || c->recipe == TW_MOE_FP8_MXFP8);
}

void tw_moe_fuzz_draw(uint64_t *st, tw_moe_fuzz_case *c) {
  memset(c, 0, sizeof *c);
  static const int meshes[][3] = {{1, 1, 1}, {1, 1, 2}, {2, 1, 1}, {1, 1, 4}, {2, 1, 2}, {4, 1, 1}, {1, 1, 8},
                                  {2, 1, 4}, {4, 1, 2}, {1, 2, 1}, {1, 2, 2}, {2, 2, 1}, {1, 4, 1}, {2, 2, 2},
                                  {1, 2, 4}, {1, 4, 2}};
  int mi = pick(st, 0, 15);
  c->dp = meshes[mi][0];
  c->fsdp = meshes[mi][1];
  c->ep = meshes[mi][2];
  c->E = c->ep * pick(st, 1, 4);
  c->k = pick(st, 1, c->E < 4 ? c->E : 4);
  c->score = pick(st, 0, 2) == 0 ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
  c->pre_softmax = c->score == TW_ROUTER_SOFTMAX && pick(st, 0, 2) == 0;
  c->expert_bias = c->score == TW_ROUTER_SIGMOID && pick(st, 0, 1);
  if (c->E % 2 == 0 && c->E >= 4 && pick(st, 0, 3) == 0) { /* group-limited: 2 groups, keep 1 or 2 */
    c->groups = 2;
    c->group_topk = pick(st, 1, 2);
    int per = c->E / 2, maxk = c->group_topk * per;
    if (c->k > maxk) c->k = maxk;
    if (c->k / c->group_topk < 1) c->k = c->group_topk;
    if (c->k / c->group_topk > per) c->k = per * c->group_topk;
  }
  c->H = c->fsdp > 1 ? c->fsdp * pick(st, 1, 6) : pick(st, 1, 12);
  c->F = pick(st, 1, 8);
  c->tokens_per_rank = pick(st, 1, 6);
  c->alignment = 1 << pick(st, 0, 3);
  c->act = (tw_moe_act)pick(st, 0, 2);
  c->weighting = (tw_moe_weighting)pick(st, 0, 1);
  int r = pick(st, 0, 5); /* f32 half the time, bf16 and the three fp8 recipes the rest */
  c->recipe = r < 3 ? TW_MOE_F32 : r == 3 ? TW_MOE_BF16 : (tw_moe_recipe)pick(st, TW_MOE_FP8_CURRENT, TW_MOE_FP8_MXFP8);
  c->bias = pick(st, 0, 1);
  c->aux = pick(st, 0, 1);
  c->fp8_gather = c->recipe >= TW_MOE_FP8_CURRENT && pick(st, 0, 1);
  /* fp8: the budget is relative to |x| + rms of the tensor, and a weight gradient of one
   * element whose token sum cancels has an rms far below its terms, while sharding over
   * tokens changes the quantization blocks (found by this fuzzer: dwo of H = F = 1 at dp = 4,
   * -5e-6 vs 3e-3 from terms of ~5e-2). At least 4 x 4 per expert keeps rms meaningful. */
  if (c->recipe >= TW_MOE_FP8_CURRENT) {
    int q = c->fsdp > 1 ? c->fsdp : 1;
    while (c->H < FP8_MIN_HF) c->H += q;
    if (c->F < FP8_MIN_HF) c->F = FP8_MIN_HF;
  }
  /* fp8_gather with block scales needs whole 128-row tiles per fsdp shard (tw_moe.h) */
  if (gather_tiles(c)) c->H = c->fsdp * 128 * (c->H / c->fsdp > 4 ? 2 : 1);
  /* bf16 d_wi / d_wo in the sharded run, half the cases with bf16 weights: taken from the drawn
   * sizes, not a new draw, so a seed draws the same cases as before this option */
  c->bf16_grads = c->recipe != TW_MOE_F32 && (c->H + c->F + c->tokens_per_rank) % 2 == 0;
  c->expect = NULL;
  if (pick(st, 0, 4) != 0) return;
  switch (pick(st, 0, 4)) {
    case 0:
      if (c->ep > 1) { c->E = c->ep + 1; c->k = 1; c->groups = 0; c->expect = "is not a positive multiple of ep_size"; break; }
      /* fall through */
    case 1: c->k = c->E + 1; c->groups = 0; c->expect = "must be in [1, E ="; break;
    case 2: c->bias = 2; c->expect = "bi is given but bo is missing"; break;
    case 3:
      if (gather_tiles(c)) { c->H = c->fsdp * 64; c->expect = "needs H / fsdp a multiple of 128"; break; }
      if (c->fsdp > 1) { c->H = c->fsdp + 1; c->expect = "does not split over fsdp"; break; }
      c->alignment = 3; c->expect = "is not a power of two"; break;
    default: c->dp = -2; c->expect = "has axis tp"; break; /* dp < 0: a tp axis of that size instead of dp */
  }
}

const char *tw_moe_fuzz_case_str(const tw_moe_fuzz_case *c, char *buf, size_t n) {
  snprintf(buf, n, "%s=%d,fsdp=%d,ep=%d E=%d k=%d groups=%d/%d %s%s%s H=%lld F=%lld T/rank=%lld A=%lld %s %s %s%s%s bias=%d aux=%d%s%s",
           c->dp < 0 ? "tp" : "dp", abs(c->dp), c->fsdp, c->ep, c->E, c->k, c->groups, c->group_topk,
           c->score == TW_ROUTER_SIGMOID ? "sigmoid" : "softmax", c->pre_softmax ? "-pre" : "",
           c->expert_bias ? "+bias" : "", (long long)c->H, (long long)c->F, (long long)c->tokens_per_rank,
           (long long)c->alignment, tw_moe_act_name(c->act), tw_moe_weighting_name(c->weighting),
           tw_moe_recipe_name(c->recipe), c->fp8_gather ? "+gather" : "", c->bf16_grads ? " dW=bf16" : "", c->bias, c->aux, c->expect ? " expect: " : "", c->expect ? c->expect : "");
  return buf;
}

/* ---- selection margin (f64): the choice must not hang on a rounding ---------------------- */
static double top_margin(const double *sel, int E, int k) {
  double kth = -INFINITY, next = -INFINITY; /* k-th largest and (k+1)-th largest */
  double *v = (double *)malloc(sizeof(double) * (size_t)E);
  memcpy(v, sel, sizeof(double) * (size_t)E);
  for (int i = 0; i <= k && i < E; i++) { /* partial selection sort */
    int b = i;
    for (int j = i + 1; j < E; j++)
      if (v[j] > v[b]) b = j;
    double t = v[i]; v[i] = v[b]; v[b] = t;
  }
  kth = v[k - 1];
  next = k < E ? v[k] : -INFINITY;
  free(v);
  return isfinite(next) ? kth - next : INFINITY;
}

static double selection_margin(const tw_moe_fuzz_case *c, const float *x, const float *gate, const float *ebias,
                               int64_t T) {
  int E = c->E;
  double margin = INFINITY, *sel = (double *)malloc(sizeof(double) * (size_t)E);
  for (int64_t t = 0; t < T; t++) {
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; e++) {
      double l = 0;
      for (int64_t h = 0; h < c->H; h++) l += (double)x[t * c->H + h] * gate[h * E + e];
      sel[e] = l;
      mx = fmax(mx, l);
    }
    if (c->score == TW_ROUTER_SIGMOID)
      for (int e = 0; e < E; e++) sel[e] = 1.0 / (1.0 + exp(-sel[e])) + (ebias ? ebias[e] : 0.0);
    else if (c->pre_softmax) {
      for (int e = 0; e < E; e++) sum += exp(sel[e] - mx);
      for (int e = 0; e < E; e++) sel[e] = exp(sel[e] - mx) / sum;
    }
    if (c->groups) {
      int per = E / c->groups, kg = c->k / c->group_topk;
      double gs[2];
      for (int g = 0; g < c->groups; g++) { /* sum of the group's top kg */
        double *v = sel + g * per, s = 0;
        double *tmp = (double *)malloc(sizeof(double) * (size_t)per);
        memcpy(tmp, v, sizeof(double) * (size_t)per);
        for (int i = 0; i < kg; i++) {
          int b = i;
          for (int j = i + 1; j < per; j++)
            if (tmp[j] > tmp[b]) b = j;
          double q = tmp[i]; tmp[i] = tmp[b]; tmp[b] = q;
          s += tmp[i];
        }
        free(tmp);
        gs[g] = s;
      }
      if (c->group_topk < c->groups) {
        margin = fmin(margin, fabs(gs[0] - gs[1]));
        int drop = gs[0] >= gs[1] ? 1 : 0;
        for (int e = drop * per; e < (drop + 1) * per; e++) sel[e] = -INFINITY;
      }
    }
    margin = fmin(margin, top_margin(sel, E, c->k));
  }
  free(sel);
  return margin;
}

/* ---- one case ---------------------------------------------------------------------------- */
typedef struct {
  float *x, *gate, *wi, *wo, *bi, *bo, *d_out, *ebias;
  float *out, *aux, *dx, *dgate, *dwi, *dwo, *dbi, *dbo;
} bufs;

static void free_bufs(bufs *b) {
  float **p = (float **)b;
  for (size_t i = 0; i < sizeof *b / sizeof(float *); i++) free(p[i]);
}

static void draw_data(const tw_moe_fuzz_case *c, uint64_t seed, int64_t T, bufs *b) {
  int64_t H = c->H, F = c->F, E = c->E;
  uint64_t s = seed;
  b->x = (float *)malloc(4 * (size_t)(T * H + 1));
  b->gate = (float *)malloc(4 * (size_t)(H * E));
  b->wi = (float *)malloc(4 * (size_t)(E * H * 2 * F));
  b->wo = (float *)malloc(4 * (size_t)(E * F * H));
  b->bi = (float *)malloc(4 * (size_t)(E * 2 * F));
  b->bo = (float *)malloc(4 * (size_t)(E * H));
  b->d_out = (float *)malloc(4 * (size_t)(T * H + 1));
  b->ebias = (float *)malloc(4 * (size_t)E);
  for (int64_t i = 0; i < T * H; i++) b->x[i] = uni(&s, -1, 1);
  for (int64_t i = 0; i < H * E; i++) b->gate[i] = uni(&s, -2, 2) / sqrtf((float)H);
  for (int64_t i = 0; i < E * H * 2 * F; i++) b->wi[i] = uni(&s, -1, 1) / sqrtf((float)H);
  for (int64_t i = 0; i < E * F * H; i++) b->wo[i] = uni(&s, -1, 1) / sqrtf((float)F);
  for (int64_t i = 0; i < E * 2 * F; i++) b->bi[i] = uni(&s, -0.2f, 0.2f);
  for (int64_t i = 0; i < E * H; i++) b->bo[i] = uni(&s, -0.2f, 0.2f);
  for (int64_t i = 0; i < T * H; i++) b->d_out[i] = uni(&s, -1, 1);
  for (int64_t i = 0; i < E; i++) b->ebias[i] = uni(&s, -0.1f, 0.1f);
}

static tw_status run_on(const tw_moe_fuzz_case *c, const bufs *in, bufs *o, int64_t T, int dp, int ep, int tp,
                        int fsdp, int bf16_grads) {
  int64_t H = c->H, F = c->F, E = c->E;
  tw_moe_threads_run r;
  memset(&r, 0, sizeof r);
  tw_moe_config cfg = TW_MOE_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.hidden = H; cfg.ffn = F;
  cfg.router.topk = c->k; cfg.router.score = c->score; cfg.router.pre_softmax = c->pre_softmax;
  cfg.router.num_groups = c->groups; cfg.router.group_topk = c->group_topk;
  cfg.act = c->act; cfg.weighting = c->weighting; cfg.recipe = c->recipe; cfg.fp8_gather = c->fp8_gather;
  cfg.aux_coeff = c->aux ? 0.05f : 0.0f;
  cfg.alignment = c->alignment;
  r.cfg = cfg;
  r.T = T;
  if (dp * ep * tp * fsdp > 1) {
    tw_axis ax[4];
    int sz[4], n = 0;
    if (tp > 1) { ax[n] = TW_AXIS_TP; sz[n++] = tp; }
    if (dp > 1) { ax[n] = TW_AXIS_DP; sz[n++] = dp; }
    if (fsdp > 1) { ax[n] = TW_AXIS_FSDP; sz[n++] = fsdp; }
    if (ep > 1) { ax[n] = TW_AXIS_EP; sz[n++] = ep; }
    TW_TRY(tw_mesh_init(&r.mesh, n, ax, sz));
  }
  r.x = in->x; r.gate = in->gate; r.wi = in->wi; r.wo = in->wo; r.d_out = in->d_out;
  if (c->bias) r.bi = in->bi;
  if (c->bias == 1) r.bo = in->bo;
  if (c->expert_bias) r.expert_bias = in->ebias;
  r.d_aux = 1;
  r.layers = 1;
  r.bf16_grads = bf16_grads;
  o->out = (float *)calloc((size_t)(T * H + 1), 4); o->dx = (float *)calloc((size_t)(T * H + 1), 4);
  o->aux = (float *)calloc(1, 4); o->dgate = (float *)calloc((size_t)(H * E), 4);
  o->dwi = (float *)calloc((size_t)(E * H * 2 * F), 4); o->dwo = (float *)calloc((size_t)(E * F * H), 4);
  o->dbi = (float *)calloc((size_t)(E * 2 * F), 4); o->dbo = (float *)calloc((size_t)(E * H), 4);
  r.out = o->out; r.dx = o->dx; r.aux = o->aux; r.dgate = o->dgate; r.dwi = o->dwi; r.dwo = o->dwo;
  r.dbi = o->dbi; r.dbo = o->dbo;
  return tw_moe_run_threads(&r);
}

static tw_status compare(const char *what, const float *a, const float *b, int64_t n, double k, double unit) {
  double ss = 0;
  for (int64_t i = 0; i < n; i++) ss += (double)a[i] * a[i];
  double rms = sqrt(ss / (double)(n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) {
    double bound = 2 * k * unit * (fabs((double)a[i]) + rms) + 1e-30;
    if (!(fabs((double)a[i] - b[i]) <= bound))
      return tw_error(TW_ERR_INVALID_ARG, "%s[%lld]: one rank %.9g, sharded %.9g (|diff| %.3g > bound %.3g)", what,
                      (long long)i, (double)a[i], (double)b[i], fabs((double)a[i] - b[i]), bound);
  }
  return TW_OK;
}

tw_status tw_moe_fuzz_run_case(const tw_moe_fuzz_case *c, uint64_t seed, int plant) {
  int dp = abs(c->dp), tp = c->dp < 0 ? abs(c->dp) : 1, fs = c->fsdp > 1 ? c->fsdp : 1, ranks = dp * fs * c->ep;
  if (c->dp < 0) dp = 1;
  int64_t T = c->tokens_per_rank * ranks;
  bufs in;
  memset(&in, 0, sizeof in);
  /* redraw until the router's choice is robust */
  int attempt = 0;
  for (;; attempt++) {
    draw_data(c, seed + 7919u * (uint64_t)attempt, T, &in);
    if (c->expect || T == 0 || selection_margin(c, in.x, in.gate, c->expert_bias ? in.ebias : NULL, T) > 1e-3) break;
    free_bufs(&in);
    memset(&in, 0, sizeof in);
    if (attempt == 50) return TW_OK; /* no robust draw: nothing to compare (rare; counted as clean) */
  }
  bufs one, sh;
  memset(&one, 0, sizeof one);
  memset(&sh, 0, sizeof sh);
  tw_moe_plant_skip_dp_reduce = plant == TW_MOE_FUZZ_PLANT_SKIP_DP_REDUCE;
  tw_status s = run_on(c, &in, &sh, T, dp, c->ep, tp, fs, c->bf16_grads);
  tw_moe_plant_skip_dp_reduce = 0;
  if (c->expect) {
    char msg[TW_ERROR_MAX];
    snprintf(msg, sizeof msg, "%s", s == TW_OK ? "" : tw_last_error());
    free_bufs(&in); free_bufs(&sh);
    if (s == TW_OK) return tw_error(TW_ERR_INVALID_ARG, "the block accepted a case that must fail with '%s'", c->expect);
    if (!strstr(msg, c->expect))
      return tw_error(TW_ERR_INVALID_ARG, "refused with '%s', expected a message with '%s'", msg, c->expect);
    return TW_OK;
  }
  if (s == TW_OK) s = run_on(c, &in, &one, T, 1, 1, 1, 1, 0);
  if (s != TW_OK) {
    char msg[TW_ERROR_MAX];
    snprintf(msg, sizeof msg, "%s", tw_last_error());
    free_bufs(&in); free_bufs(&sh); free_bufs(&one);
    return tw_error(s, "a valid case failed: %s", msg);
  }
  tw_moe_config bc = TW_MOE_CONFIG_INIT;
  bc.num_experts = c->E; bc.hidden = c->H; bc.ffn = c->F; bc.router.topk = c->k; bc.recipe = c->recipe;
  double kf = tw_moe_error_budget(&bc, T, 0), kb = tw_moe_error_budget(&bc, T, 1), unit = 1;
  int64_t H = c->H, F = c->F, E = c->E;
  if (s == TW_OK) s = compare("out", one.out, sh.out, T * H, kf, unit);
  if (s == TW_OK && c->aux) s = compare("aux", one.aux, sh.aux, 1, kf, unit);
  if (s == TW_OK) s = compare("dx", one.dx, sh.dx, T * H, kb, unit);
  if (s == TW_OK) s = compare("dgate", one.dgate, sh.dgate, H * E, kb, unit);
  if (s == TW_OK) s = compare("dwi", one.dwi, sh.dwi, E * H * 2 * F, kb, unit);
  if (s == TW_OK) s = compare("dwo", one.dwo, sh.dwo, E * F * H, kb, unit);
  if (s == TW_OK && c->bias) s = compare("dbi", one.dbi, sh.dbi, E * 2 * F, kb, unit);
  if (s == TW_OK && c->bias) s = compare("dbo", one.dbo, sh.dbo, E * H, kb, unit);
  free_bufs(&in); free_bufs(&sh); free_bufs(&one);
  return s;
}

int tw_moe_fuzz_shrink(tw_moe_fuzz_case *c, uint64_t seed, int plant) {
  int steps = 0, progress = 1;
  while (progress) {
    progress = 0;
    for (int f = 0; f < 8; f++) {
      tw_moe_fuzz_case t = *c;
      switch (f) {
        case 0: if (t.tokens_per_rank > 1) t.tokens_per_rank--; break;
        case 1: { /* stays a multiple of fsdp (of 128 fsdp for gather_tiles), and fp8 keeps FP8_MIN_HF (see the draw) */
          int64_t q = t.fsdp > 1 ? t.fsdp : 1, lo = t.recipe >= TW_MOE_FP8_CURRENT ? FP8_MIN_HF : 1;
          if (gather_tiles(&t)) q = lo = 128 * (int64_t)t.fsdp;
          if (t.H - q >= lo) t.H -= q;
          break;
        }
        case 2: if (t.F > (t.recipe >= TW_MOE_FP8_CURRENT ? FP8_MIN_HF : 1)) t.F--; break;
        case 3: if (t.k > 1 && !t.groups) t.k--; break;
        case 4: if (t.E > t.ep && !t.groups && t.E - t.ep >= t.k) t.E -= t.ep; break;
        case 5: if (t.bias) t.bias = 0; break;
        case 6: if (t.alignment > 1) t.alignment /= 2; break;
        default: if (t.aux) t.aux = 0; break;
      }
      if (!memcmp(&t, c, sizeof t)) continue;
      if (tw_moe_fuzz_run_case(&t, seed, plant) != TW_OK) {
        *c = t;
        steps++;
        progress = 1;
      }
    }
  }
  return steps;
}

tw_status tw_moe_fuzz(uint64_t seed, int max_cases, double seconds, int plant, tw_moe_fuzz_report *rep) {
  if (!rep) return tw_error(TW_ERR_NULL, "moe_fuzz: rep is NULL");
  memset(rep, 0, sizeof *rep);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  uint64_t st = seed;
  for (int i = 0; i < max_cases; i++) {
    if (seconds > 0) {
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) > seconds) break;
    }
    tw_moe_fuzz_case c;
    tw_moe_fuzz_draw(&st, &c);
    uint64_t data_seed = seed ^ (0x5851F42D4C957F2Dull * (uint64_t)(i + 1));
    rep->cases++;
    if (c.expect) rep->invalid++;
    else rep->valid++;
    if (tw_moe_fuzz_run_case(&c, data_seed, plant) == TW_OK) continue;
    rep->failures = 1;
    rep->first_failure = c;
    tw_moe_fuzz_shrink(&c, data_seed, plant);
    rep->shrunk = c;
    tw_moe_fuzz_run_case(&c, data_seed, plant);
    snprintf(rep->message, sizeof rep->message, "%s", tw_last_error());
    break;
  }
  return TW_OK;
}
