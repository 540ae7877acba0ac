/* Case generators: shapes, group sizes and values drawn where kernels break.
 *
 * Determinism: the only randomness is xoshiro256** seeded by splitmix64 from (seed, index),
 * and values are built with integer and exact power-of-two arithmetic only (no libm), so a
 * seed gives bit-identical cases on every machine. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_internal.h"
#include "ops/data.h"
#include "shard/golden.h"
#include "twin/tw_numerics.h"

/* ---- PRNG ---- */

void fz_rng_seed(fz_rng *r, uint64_t seed) {
  uint64_t x = seed;
  for (int i = 0; i < 4; i++) r->s[i] = tw_splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t fz_next(fz_rng *r) {
  uint64_t *s = r->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

uint64_t fz_below(fz_rng *r, uint64_t n) { return n <= 1 ? 0 : fz_next(r) % n; }
int fz_chance(fz_rng *r, int percent) { return (int)fz_below(r, 100) < percent; }
double fz_unit(fz_rng *r) { return (double)(fz_next(r) >> 11) * (1.0 / 9007199254740992.0); }

uint64_t fz_case_seed(uint64_t seed, uint64_t index) {
  uint64_t x = seed ^ (index * 0xD1B54A32D192ED03ull);
  tw_splitmix64(&x);
  return tw_splitmix64(&x);
}

static int64_t range(fz_rng *r, int64_t lo, int64_t hi) { /* inclusive */
  return hi <= lo ? lo : lo + (int64_t)fz_below(r, (uint64_t)(hi - lo + 1));
}

/* ---- names ---- */
static const char *const op_names[FZ_OP_COUNT] = {"quantize", "cast", "gemm", "grouped_gemm",
                                                  "wgrad"};
const char *fz_op_name(fz_op op) { return (int)op >= 0 && op < FZ_OP_COUNT ? op_names[op] : "?"; }
int fz_op_from_name(const char *name, fz_op *out) {
  for (int i = 0; i < FZ_OP_COUNT; i++)
    if (name && strcmp(name, op_names[i]) == 0) {
      *out = (fz_op)i;
      return 0;
    }
  return -1;
}

/* ---- case bookkeeping ---- */
static int64_t shard_numel(const fz_case *c, int which) {
  int nd[3];
  int64_t shape[3][TW_MAX_DIMS];
  fz_shard_shapes(c, nd, shape, NULL);
  int64_t n = 1;
  for (int d = 0; d < nd[which]; d++) n *= shape[which][d];
  return nd[which] > 0 ? n : 0;
}
int64_t fz_numel_x(const fz_case *c) {
  return (c->op == FZ_QUANTIZE || c->op == FZ_CAST) ? c->M * c->K : 0;
}
int64_t fz_numel_a(const fz_case *c) {
  if (c->sharded) return c->rule == TW_SHARD_GROUPED_QUANTIZE ? 0 : shard_numel(c, 0);
  return (c->op == FZ_QUANTIZE || c->op == FZ_CAST) ? 0 : c->M * c->K;
}
int64_t fz_numel_b(const fz_case *c) {
  if (c->sharded) return c->rule == TW_SHARD_GROUPED_QUANTIZE ? 0 : shard_numel(c, 1);
  switch (c->op) {
    case FZ_GEMM: return c->K * c->N;
    case FZ_GROUPED_GEMM: return c->G * c->K * c->N;
    case FZ_WGRAD: return c->M * c->N;
    default: return 0;
  }
}
int64_t fz_numel_out(const fz_case *c) {
  if (c->sharded) return c->rule == TW_SHARD_GROUPED_QUANTIZE ? 0 : shard_numel(c, 2);
  switch (c->op) {
    case FZ_GEMM:
    case FZ_GROUPED_GEMM: return c->M * c->N;
    case FZ_WGRAD: return c->G * c->K * c->N;
    default: return 0;
  }
}
int64_t fz_case_elements(const fz_case *c) { /* inputs + outputs */
  int64_t n = fz_numel_x(c) + fz_numel_a(c) + fz_numel_b(c) + fz_numel_out(c);
  return c->op <= FZ_CAST ? 2 * n : n;
}

void fz_case_free(fz_case *c) {
  free(c->group_sizes);
  free(c->x);
  free(c->a);
  free(c->b);
  free(c->out_init);
  free(c->scale);
  c->group_sizes = NULL;
  c->x = c->a = c->b = c->out_init = c->scale = NULL;
}

static void *dup(const void *p, size_t bytes, int *fail) {
  if (!p) return NULL;
  void *q = malloc(bytes ? bytes : 1);
  if (!q) { *fail = 1; return NULL; }
  memcpy(q, p, bytes);
  return q;
}

int fz_case_copy(fz_case *d, const fz_case *s) {
  int fail = 0;
  *d = *s;
  d->group_sizes = dup(s->group_sizes, sizeof(int32_t) * (size_t)s->G, &fail);
  d->x = dup(s->x, sizeof(float) * (size_t)fz_numel_x(s), &fail);
  d->a = dup(s->a, sizeof(float) * (size_t)fz_numel_a(s), &fail);
  d->b = dup(s->b, sizeof(float) * (size_t)fz_numel_b(s), &fail);
  d->out_init = dup(s->out_init, sizeof(float) * (size_t)fz_numel_out(s), &fail);
  d->scale = dup(s->scale, sizeof(float) * (size_t)s->G, &fail);
  if (fail) { fz_case_free(d); return -1; }
  return 0;
}

static const char *opname(tw_op o) { return o == TW_OP_T ? "T" : "N"; }

static void spec_str(const fz_operand_spec *s, char *buf, size_t n) {
  if (s->mode == TW_SCALE_NONE)
    snprintf(buf, n, "%s", tw_dtype_name(s->dtype));
  else
    snprintf(buf, n, "%s/%s/%s%s%s%s", tw_scaling_name(s->mode), tw_dtype_name(s->qdtype),
             s->colwise ? "col" : "row", s->swizzled ? "/swz" : "", s->pow2 ? "/pow2" : "", s->padded ? "/pad" : "");
}

void fz_case_describe(const fz_case *c, char *buf, size_t n) {
  char gs[96] = "";
  size_t k = 0;
  for (int64_t g = 0; g < c->G && k + 12 < sizeof gs; g++)
    k += (size_t)snprintf(gs + k, sizeof gs - k, g ? ",%d" : "%d", c->group_sizes[g]);
  if (c->G > 0 && k + 12 >= sizeof gs) snprintf(gs + k, sizeof gs - k, ",..");
  char sa[48], sb[48];
  spec_str(&c->sa, sa, sizeof sa);
  spec_str(&c->sb, sb, sizeof sb);
  if (c->sharded) {
    char mb[64], xs[96], ws[96], q[96] = "";
    tw_mesh_str(&c->mesh, mb, sizeof mb);
    tw_pspec_str(&c->x_spec, xs, sizeof xs);
    tw_pspec_str(&c->w_spec, ws, sizeof ws);
    if (c->rule == TW_SHARD_GROUPED_QUANTIZE) {
      snprintf(q, sizeof q, "mode=%s,q=%s,layout=%d,pow2=%d,swz=%d,x=%s", tw_scaling_name(c->mode),
               tw_dtype_name(c->qdtype), (int)c->layout, c->pow2, c->swizzled, tw_dtype_name(c->x_dtype));
      snprintf(buf, n, "sharded grouped_quantize(mesh %s,x %s,%s,M=%lld,K=%lld,G=%lld,gs=[%s],%s)", mb, xs, q,
               (long long)c->M, (long long)c->K, (long long)c->G, gs, c->note);
    } else {
      snprintf(q, sizeof q, "%s,a=%s,b=%s,out=%s", c->fp8_inputs ? (c->quantize_before_gather ? "fp8-before-gather" : "fp8") : "plain",
               tw_dtype_name(c->sa.dtype), tw_dtype_name(c->sb.dtype), tw_dtype_name(c->out_dtype));
      snprintf(buf, n, "sharded %s %s(mesh %s,x %s,w %s,%s,B=%lld%s,M=%lld,K=%lld,N=%lld,G=%lld,gs=[%s],%s)",
               tw_shard_op_name(c->rule), tw_pass_name(c->pass), mb, xs, ws, q, (long long)c->B,
               c->w_batched ? ",w_batched" : "", (long long)c->M, (long long)c->K, (long long)c->N, (long long)c->G,
               c->rule == TW_SHARD_GROUPED_GEMM ? gs : "", c->note);
    }
    return;
  }
  switch (c->op) {
    case FZ_QUANTIZE:
      snprintf(buf, n, "quantize(mode=%s,q=%s,layout=%d,pow2=%d,swz=%d,x=%s,M=%lld,K=%lld,G=%lld,gs=[%s],%s)",
               tw_scaling_name(c->mode), tw_dtype_name(c->qdtype), (int)c->layout, c->pow2,
               c->swizzled, tw_dtype_name(c->x_dtype), (long long)c->M, (long long)c->K,
               (long long)c->G, gs, c->note);
      break;
    case FZ_CAST:
      snprintf(buf, n, "cast(%s->%s,sat=%d,[%lld,%lld],%s)", tw_dtype_name(c->x_dtype),
               tw_dtype_name(c->dst_dtype), c->saturate, (long long)c->M, (long long)c->K, c->note);
      break;
    case FZ_GEMM:
      snprintf(buf, n, "gemm(%s%s,a=%s,b=%s,out=%s,acc=%d,M=%lld,N=%lld,K=%lld,%s)", opname(c->op_a),
               opname(c->op_b), sa, sb, tw_dtype_name(c->out_dtype), c->accumulate, (long long)c->M,
               (long long)c->N, (long long)c->K, c->note);
      break;
    case FZ_GROUPED_GEMM:
      snprintf(buf, n, "grouped_gemm(rhs_op=%s,lhs=%s,rhs=%s,out=%s,acc=%d,M=%lld,N=%lld,K=%lld,G=%lld,gs=[%s],%s)",
               opname(c->op_b), sa, sb, tw_dtype_name(c->out_dtype), c->accumulate, (long long)c->M,
               (long long)c->N, (long long)c->K, (long long)c->G, gs, c->note);
      break;
    case FZ_WGRAD:
      snprintf(buf, n, "wgrad(%s%s,lhs=%s,rhs=%s,out=%s,acc=%d,M=%lld,N=%lld,K=%lld,G=%lld,gs=[%s],%s)",
               opname(c->op_a), opname(c->op_b), sa, sb, tw_dtype_name(c->out_dtype), c->accumulate,
               (long long)c->M, (long long)c->N, (long long)c->K, (long long)c->G, gs, c->note);
      break;
    default: snprintf(buf, n, "?");
  }
}

/* ---- shapes ---- */
static const int64_t kEdges[] = {1,  2,  3,  4,  5,  7,  8,  9,   15,  16,  17,  31,  32,
                                 33, 63, 64, 65, 127, 128, 129, 255, 256, 257};

/* A dimension in [lo, hi], biased to tile/block edges (+-1 around 16..256). */
static int64_t pick_dim(fz_rng *r, int64_t lo, int64_t hi) {
  if (fz_chance(r, 65)) {
    int64_t ok[sizeof kEdges / sizeof kEdges[0]];
    int n = 0;
    for (size_t i = 0; i < sizeof kEdges / sizeof kEdges[0]; i++)
      if (kEdges[i] >= lo && kEdges[i] <= hi) ok[n++] = kEdges[i];
    if (n) return ok[fz_below(r, (uint64_t)n)];
  }
  return range(r, lo, hi);
}

/* Group sizes summing to at most `rows_budget`; sets c->G, c->group_sizes, c->M (with a
 * tail now and then) and appends the pattern's name to the note. */
static int gen_groups(fz_rng *r, fz_case *c, int64_t rows_budget, int64_t max_groups) {
  static const char *const pats[] = {"random", "zero_group", "one_row", "skew99", "tiny_many",
                                     "tile_edge", "all_empty", "single", "equal"};
  int p = (int)fz_below(r, sizeof pats / sizeof pats[0]);
  int64_t G;
  switch (p) {
    case 4: G = range(r, 8, max_groups); break;
    case 7: G = 1; break;
    default: G = fz_chance(r, 50) ? range(r, 1, 4) : range(r, 1, max_groups < 16 ? max_groups : 16);
  }
  if (G > max_groups) G = max_groups;
  if (G < 1) G = 1;
  int32_t *gs = calloc((size_t)G, sizeof(int32_t));
  if (!gs) return -1;
  int64_t total = pick_dim(r, 0, rows_budget);
  switch (p) {
    case 0: case 1: /* random cut points; zero_group forces an empty group */
      for (int64_t i = 0; i < total; i++) gs[fz_below(r, (uint64_t)G)]++;
      if (p == 1) {
        int64_t z = (int64_t)fz_below(r, (uint64_t)G);
        int64_t to = (z + 1) % G;
        gs[to] += gs[z];
        gs[z] = 0;
      }
      break;
    case 2: /* one-row groups among others */
      for (int64_t g = 0; g < G; g++) gs[g] = fz_chance(r, 60) ? 1 : (int32_t)range(r, 0, total / G + 1);
      break;
    case 3: { /* one group holds ~99% */
      int64_t big = (int64_t)fz_below(r, (uint64_t)G);
      int64_t rest = total / 100;
      for (int64_t i = 0; i < rest; i++) gs[fz_below(r, (uint64_t)G)]++;
      gs[big] += (int32_t)(total - rest);
      break;
    }
    case 4: /* many tiny groups */
      for (int64_t g = 0; g < G; g++) gs[g] = (int32_t)range(r, 0, 3);
      break;
    case 5: /* sizes at tile edges */
      for (int64_t g = 0; g < G; g++) gs[g] = (int32_t)pick_dim(r, 0, rows_budget / G > 1 ? rows_budget / G : 1);
      break;
    case 6: break; /* all empty */
    case 7: gs[0] = (int32_t)total; break;
    case 8:
      for (int64_t g = 0; g < G; g++) gs[g] = (int32_t)(total / G);
      break;
  }
  int64_t S = 0;
  for (int64_t g = 0; g < G; g++) S += gs[g];
  /* the tail: rows past the last group (padded routing buffers) */
  int64_t tail = fz_chance(r, 25) ? pick_dim(r, 1, 40) : 0;
  c->G = G;
  c->group_sizes = gs;
  c->M = S + tail;
  size_t k = strlen(c->note);
  snprintf(c->note + k, sizeof c->note - k, "%s%s%s", k ? "," : "", pats[p], tail ? ",tail" : "");
  return 0;
}

/* ---- values ---- */
typedef enum { V_NORMAL, V_INTS, V_WIDE, V_SPARSE, V_EXTREME, V_SPECIAL, V_STYLE_COUNT } vstyle;
static const char *const vstyle_names[] = {"normal", "ints", "wide", "sparse", "extreme", "special"};

/* Approximately normal (Irwin-Hall of 4), times 2^e: exact arithmetic only. */
static double approx_normal(fz_rng *r) {
  return (fz_unit(r) + fz_unit(r) + fz_unit(r) + fz_unit(r) - 2.0) * 1.7320508075688772;
}

static float round_to(tw_dtype t, float v) {
  switch (t) {
    case TW_BF16: return tw_bf16_to_f32(tw_f32_to_bf16(v));
    case TW_F16: return tw_f16_to_f32(tw_f32_to_f16(v));
    default: return v;
  }
}

static double dtype_max_finite(tw_dtype t) {
  switch (t) {
    case TW_BF16: return 3.3895313892515355e38;
    case TW_F16: return 65504.0;
    default: return FLT_MAX;
  }
}
static int dtype_min_exp(tw_dtype t) { /* exponent of the smallest subnormal */
  switch (t) {
    case TW_BF16: return -133;
    case TW_F16: return -24;
    default: return -149;
  }
}

/* One value of style s representable in dtype t; specials (NaN/inf) only when allowed.
 * `emax` caps the magnitude exponent for ops whose sums must stay finite. */
static float draw_value(fz_rng *r, vstyle s, tw_dtype t, int allow_special, int emin, int emax,
                        int center) {
  double v;
  switch (s) {
    case V_INTS: v = (double)range(r, -8, 8); break;
    case V_WIDE: v = ldexp(approx_normal(r), (int)range(r, emin, emax)); break;
    case V_SPARSE:
      v = fz_chance(r, 80) ? (fz_chance(r, 50) ? 0.0 : -0.0) : ldexp(approx_normal(r), center);
      break;
    case V_EXTREME: {
      int k = (int)fz_below(r, 8);
      double mx = dtype_max_finite(t);
      if (emax < 127 && ldexp(1.0, emax) < mx) mx = ldexp(1.0, emax);
      switch (k) {
        case 0: v = mx; break;
        case 1: v = -mx; break;
        case 2: v = ldexp(1.0, dtype_min_exp(t) + (int)fz_below(r, 4)); break; /* subnormals */
        case 3: v = -ldexp((double)range(r, 1, 7), dtype_min_exp(t)); break;
        case 4: v = fz_chance(r, 50) ? 0.0 : -0.0; break;
        default: v = ldexp(approx_normal(r), center); break;
      }
      break;
    }
    case V_SPECIAL:
      if (allow_special && fz_chance(r, 10)) {
        int k = (int)fz_below(r, 3);
        v = k == 0 ? NAN : (k == 1 ? INFINITY : -INFINITY);
      } else {
        v = ldexp(approx_normal(r), center);
      }
      break;
    default: v = ldexp(approx_normal(r), center); break;
  }
  return round_to(t, (float)v);
}

static float *gen_values(fz_rng *r, int64_t n, tw_dtype t, int allow_special, int emin, int emax,
                         vstyle *style_out) {
  float *p = malloc(sizeof(float) * (size_t)(n ? n : 1));
  if (!p) return NULL;
  vstyle s = (vstyle)fz_below(r, V_STYLE_COUNT);
  if (s == V_SPECIAL && !allow_special) s = V_NORMAL;
  int center = (int)range(r, emin / 2, emax / 2);
  if (center > emax - 2) center = emax - 2;
  for (int64_t i = 0; i < n; i++) p[i] = draw_value(r, s, t, allow_special, emin, emax, center);
  if (style_out) *style_out = s;
  return p;
}

static void note_add(fz_case *c, const char *s) {
  size_t k = strlen(c->note);
  snprintf(c->note + k, sizeof c->note - k, "%s%s", k ? "," : "", s);
}

static tw_dtype pick(fz_rng *r, const tw_dtype *v, int n) { return v[fz_below(r, (uint64_t)n)]; }

static const tw_dtype kPlain[] = {TW_F32, TW_BF16, TW_F16};
static const tw_dtype kFp8[] = {TW_E4M3, TW_E5M2};

/* ---- per-op generators ---- */
static int gen_quantize(fz_rng *r, fz_case *c) {
  c->mode = (tw_scaling)range(r, TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_128x128);
  c->qdtype = pick(r, kFp8, 2);
  c->layout = (tw_qlayout)range(r, 1, 3);
  c->pow2 = (c->mode == TW_SCALE_TENSOR_CURRENT || c->mode == TW_SCALE_BLOCK_1x128 ||
             c->mode == TW_SCALE_BLOCK_128x128) && fz_chance(r, 30);
  c->swizzled = c->mode == TW_SCALE_MXFP8_1D ? fz_chance(r, 50) : 0;
  c->x_dtype = pick(r, kPlain, 3);
  c->K = pick_dim(r, 1, 300);
  int64_t rows_budget = 40000 / c->K;
  if (rows_budget > 700) rows_budget = 700;
  if (gen_groups(r, c, rows_budget, 40)) return -1;
  vstyle s;
  c->x = gen_values(r, c->M * c->K, c->x_dtype, 1, -40, 126, &s);
  if (!c->x) return -1;
  note_add(c, vstyle_names[s]);
  if (c->mode == TW_SCALE_TENSOR_DELAYED) {
    c->scale = malloc(sizeof(float) * (size_t)c->G);
    if (!c->scale) return -1;
    for (int64_t g = 0; g < c->G; g++) /* a stored scale, sometimes too large: clipping */
      c->scale[g] = (float)ldexp(1.0 + fz_unit(r), (int)range(r, -12, 12));
  }
  return 0;
}

static int gen_cast(fz_rng *r, fz_case *c) {
  static const tw_dtype src[] = {TW_F64, TW_F32, TW_BF16, TW_F16, TW_E4M3, TW_E5M2, TW_E2M1, TW_E8M0, TW_I32};
  static const tw_dtype dst[] = {TW_F64, TW_F32, TW_BF16, TW_F16, TW_E4M3, TW_E5M2, TW_E2M1, TW_I32, TW_I64};
  c->x_dtype = pick(r, src, sizeof src / sizeof src[0]);
  c->dst_dtype = pick(r, dst, sizeof dst / sizeof dst[0]);
  c->saturate = fz_chance(r, 50);
  c->M = pick_dim(r, 0, 64);
  c->K = pick_dim(r, 1, 64);
  if (c->x_dtype == TW_E2M1 && (c->K & 1)) c->K++; /* packed rows stay whole bytes */
  if (c->dst_dtype == TW_E2M1 && (c->K & 1)) c->K++;
  c->G = 0;
  int64_t n = c->M * c->K;
  c->x = malloc(sizeof(float) * (size_t)(n ? n : 1));
  if (!c->x) return -1;
  vstyle s = (vstyle)fz_below(r, V_STYLE_COUNT);
  int center = (int)range(r, -20, 20);
  for (int64_t i = 0; i < n; i++) {
    float v;
    if (c->x_dtype == TW_E4M3 || c->x_dtype == TW_E5M2 || c->x_dtype == TW_E2M1 || c->x_dtype == TW_E8M0) {
      /* every code of the small formats, specials included */
      uint8_t code = (uint8_t)fz_below(r, c->x_dtype == TW_E2M1 ? 16 : 256);
      v = c->x_dtype == TW_E4M3 ? tw_e4m3_to_f32(code)
        : c->x_dtype == TW_E5M2 ? tw_e5m2_to_f32(code)
        : c->x_dtype == TW_E2M1 ? tw_e2m1_to_f32(code) : tw_e8m0_to_f32(code);
    } else if (c->x_dtype == TW_I32) {
      v = (float)range(r, -100000, 100000);
    } else {
      v = draw_value(r, s, c->x_dtype, 1, -150, 127, center);
      /* targets' edges: around fp8/f16 max and RNE ties of the small formats */
      if (fz_chance(r, 10)) v = round_to(c->x_dtype, (float)(range(r, -600, 600) * 0.5 + 0.25 * range(r, -1, 1)));
    }
    c->x[i] = v;
  }
  note_add(c, vstyle_names[s]);
  return 0;
}

/* Picks an operand presentation for `mode`: plain dtype or quantized. */
static fz_operand_spec spec_for(fz_rng *r, tw_scaling mode, tw_dtype plain, tw_dtype qd) {
  fz_operand_spec s;
  memset(&s, 0, sizeof s);
  s.dtype = plain;
  s.mode = mode;
  s.qdtype = qd;
  s.swizzled = mode == TW_SCALE_MXFP8_1D ? fz_chance(r, 50) : 0;
  s.pow2 = (mode == TW_SCALE_TENSOR_CURRENT || mode == TW_SCALE_BLOCK_1x128 ||
            mode == TW_SCALE_BLOCK_128x128) && fz_chance(r, 30);
  return s;
}

/* Operand dtypes/modes for a GEMM pair; quantized pairs avoid e5m2 x e5m2. */
static void pick_pair(fz_rng *r, fz_case *c) {
  static const tw_scaling modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_MXFP8_1D,
                                     TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};
  tw_scaling mode = fz_chance(r, 45) ? modes[fz_below(r, 4)] : TW_SCALE_NONE;
  tw_dtype pa = pick(r, kPlain, 3), pb = pa;
  if (fz_chance(r, 25)) { if (fz_chance(r, 50)) pa = TW_F32; else pb = TW_F32; }
  tw_dtype qa = pick(r, kFp8, 2), qb = qa == TW_E5M2 ? TW_E4M3 : pick(r, kFp8, 2);
  c->sa = spec_for(r, mode, pa, qa);
  c->sb = spec_for(r, mode, pb, qb);
  c->out_dtype = pick(r, kPlain, 3);
  c->accumulate = fz_chance(r, 25);
}

/* Value range for GEMM inputs: keep f32 sums finite and f16 outputs in range. */
static void gemm_exp_range(const fz_case *c, int *emin, int *emax) {
  if (c->out_dtype == TW_F16) { *emin = -6; *emax = 2; }
  else { *emin = -24; *emax = 20; }
}

static int gen_gemm_values(fz_rng *r, fz_case *c) {
  int emin, emax;
  gemm_exp_range(c, &emin, &emax);
  vstyle s1, s2;
  /* plain operands hold values of their dtype; quantized ones start from f32 */
  tw_dtype ta = c->sa.mode == TW_SCALE_NONE ? c->sa.dtype : TW_F32;
  tw_dtype tb = c->sb.mode == TW_SCALE_NONE ? c->sb.dtype : TW_F32;
  int special = c->out_dtype != TW_F16 && fz_chance(r, 15);
  c->a = gen_values(r, fz_numel_a(c), ta, special, emin, emax, &s1);
  c->b = gen_values(r, fz_numel_b(c), tb, special, emin, emax, &s2);
  if (!c->a || !c->b) return -1;
  char buf[40];
  snprintf(buf, sizeof buf, "%s/%s", vstyle_names[s1], vstyle_names[s2]);
  note_add(c, buf);
  if (c->accumulate) {
    c->out_init = gen_values(r, fz_numel_out(c), c->out_dtype, 0, emin, emax, NULL);
    if (!c->out_init) return -1;
  }
  return 0;
}

/* Block scaling must run along K: pick ops/orientations the contract allows. */
static void orient_dense(fz_rng *r, fz_case *c) {
  tw_scaling m = c->sa.mode;
  c->op_a = fz_chance(r, 50) ? TW_OP_T : TW_OP_N;
  c->op_b = fz_chance(r, 50) ? TW_OP_T : TW_OP_N;
  if (m == TW_SCALE_BLOCK_1x128) { c->op_a = TW_OP_N; c->op_b = TW_OP_T; }
  /* colwise: for tensor/128x128 the transposed copy; for 1x128 the transposed copy whose
   * blocks run along storage rows; for mxfp8 the colwise scales of the same storage. */
  switch (m) {
    case TW_SCALE_NONE: break;
    case TW_SCALE_MXFP8_1D:
      c->sa.colwise = c->op_a == TW_OP_T;
      c->sb.colwise = c->op_b == TW_OP_N;
      break;
    default:
      c->sa.colwise = fz_chance(r, 50);
      c->sb.colwise = fz_chance(r, 50);
  }
}

static int gen_gemm(fz_rng *r, fz_case *c) {
  pick_pair(r, c);
  orient_dense(r, c);
  c->M = pick_dim(r, 0, 200);
  c->N = pick_dim(r, 0, 200);
  c->K = pick_dim(r, 0, 300);
  while (c->M * c->N * (c->K + 1) > 2000000) c->K /= 2;
  if (c->sa.mode != TW_SCALE_NONE) { /* every quantized source needs at least one column */
    if (c->M == 0) c->M = 1;
    if (c->N == 0) c->N = 1;
    if (c->K == 0) c->K = 1;
  }
  c->G = 0;
  return gen_gemm_values(r, c);
}

static int gen_grouped(fz_rng *r, fz_case *c) {
  pick_pair(r, c);
  tw_scaling m = c->sa.mode;
  c->op_b = fz_chance(r, 50) ? TW_OP_T : TW_OP_N; /* rhs_op */
  c->op_a = TW_OP_N;
  c->sa.colwise = 0; /* a quantized lhs is the rowwise copy */
  if (m == TW_SCALE_BLOCK_1x128) c->op_b = TW_OP_T;
  if (m == TW_SCALE_MXFP8_1D) c->sb.colwise = c->op_b == TW_OP_N;
  else if (m != TW_SCALE_NONE) c->sb.colwise = fz_chance(r, 50);
  c->K = pick_dim(r, 1, 256);
  c->N = pick_dim(r, 1, 200);
  int64_t rows_budget = 1500000 / (c->K * c->N + 1);
  if (rows_budget > 600) rows_budget = 600;
  if (rows_budget < 4) rows_budget = 4;
  if (gen_groups(r, c, rows_budget, 24)) return -1;
  return gen_gemm_values(r, c);
}

static int gen_wgrad(fz_rng *r, fz_case *c) {
  pick_pair(r, c);
  tw_scaling m = c->sa.mode;
  c->op_a = fz_chance(r, 50) ? TW_OP_T : TW_OP_N;
  c->op_b = fz_chance(r, 50) ? TW_OP_T : TW_OP_N;
  /* op T = the per-group transposed copy; mxfp8 has none (NN with colwise scales), 1x128's
   * rowwise blocks run along K, so only its transposed copy contracts over rows. */
  if (m == TW_SCALE_MXFP8_1D) { c->op_a = c->op_b = TW_OP_N; }
  if (m == TW_SCALE_BLOCK_1x128) { c->op_a = c->op_b = TW_OP_T; }
  if (m == TW_SCALE_NONE) { c->sa.colwise = c->sb.colwise = 0; }
  else if (m == TW_SCALE_MXFP8_1D) { c->sa.colwise = c->sb.colwise = 1; }
  else { c->sa.colwise = c->op_a == TW_OP_T; c->sb.colwise = c->op_b == TW_OP_T; }
  /* transposed copies token-padded in about half the cases, each side on its own bit of the
   * case seed (not the generator's stream, so every other choice of a seed is as before) */
  c->sa.padded = c->sa.colwise && m != TW_SCALE_MXFP8_1D && ((c->seed >> 17) & 1);
  c->sb.padded = c->sb.colwise && m != TW_SCALE_MXFP8_1D && ((c->seed >> 29) & 1);
  c->K = pick_dim(r, 1, 160);
  c->N = pick_dim(r, 1, 160);
  int64_t rows_budget = 1500000 / (c->K * c->N + 1);
  if (rows_budget > 600) rows_budget = 600;
  if (rows_budget < 4) rows_budget = 4;
  if (gen_groups(r, c, rows_budget, 16)) return -1;
  return gen_gemm_values(r, c);
}
/* The case seed, its generator (the seed XOR `stream`) and the defaults every case starts from. */
static void case_start(fz_case *c, fz_rng *r, uint64_t seed, uint64_t index, fz_op op, uint64_t stream) {
  c->seed = fz_case_seed(seed, index);
  fz_rng_seed(r, c->seed ^ stream);
  c->op = op;
  c->layout = TW_ROWWISE;
  c->qdtype = TW_E4M3;
  c->x_dtype = TW_F32;
  c->out_dtype = TW_F32;
  c->sa.dtype = c->sb.dtype = TW_F32;
  c->sa.qdtype = c->sb.qdtype = TW_E4M3;
}


int fz_generate(fz_case *c, fz_op op, uint64_t seed, uint64_t index) {
  memset(c, 0, sizeof *c);
  fz_rng r;
  case_start(c, &r, seed, index, op, 0);
  int rc;
  switch (op) {
    case FZ_QUANTIZE: rc = gen_quantize(&r, c); break;
    case FZ_CAST: rc = gen_cast(&r, c); break;
    case FZ_GEMM: rc = gen_gemm(&r, c); break;
    case FZ_GROUPED_GEMM: rc = gen_grouped(&r, c); break;
    case FZ_WGRAD: rc = gen_wgrad(&r, c); break;
    default: rc = -1;
  }
  if (rc) fz_case_free(c);
  return rc;
}

/* ======================================================================================
 * sharded cases (twin fuzz --mesh)
 * ====================================================================================== */
int fz_op_shardable(fz_op op) {
  return op == FZ_QUANTIZE || op == FZ_GEMM || op == FZ_GROUPED_GEMM || op == FZ_WGRAD;
}

int fz_mesh_opt_parse(const char *text, fz_mesh_opt *out, char *err, size_t n) {
  memset(out, 0, sizeof *out);
  out->max_ranks = 8;
  if (!text || !*text) {
    snprintf(err, n, "--mesh needs a value: all, or a mesh like dp=2,ep=4");
    return -1;
  }
  if (strcmp(text, "all") == 0) {
    out->all = 1;
    return 0;
  }
  if (tw_mesh_parse(text, &out->mesh) != TW_OK) {
    snprintf(err, n, "--mesh '%s': %s (give all, or a mesh like dp=2,ep=4)", text, tw_last_error());
    return -1;
  }
  int r = tw_mesh_ranks(&out->mesh);
  if (r > 64) {
    snprintf(err, n, "--mesh '%s' has %d ranks; sharded fuzzing runs at most 64 (one thread each)", text, r);
    return -1;
  }
  out->max_ranks = r;
  return 0;
}

void fz_shard_operands(const fz_case *c, tw_shard_operand *x, tw_shard_operand *w) {
  memset(x, 0, sizeof *x);
  memset(w, 0, sizeof *w);
  x->spec = c->x_spec;
  w->spec = c->w_spec;
  if (c->rule == TW_SHARD_DENSE) {
    int xb = c->B > 0, wb = xb && c->w_batched;
    int64_t xs[3] = {c->B, c->M, c->K}, ws[3] = {c->B, c->K, c->N};
    x->ndim = 2 + xb;
    w->ndim = 2 + wb;
    memcpy(x->shape, xs + !xb, sizeof(int64_t) * (size_t)x->ndim);
    memcpy(w->shape, ws + !wb, sizeof(int64_t) * (size_t)w->ndim);
  } else {
    x->ndim = 2;
    x->shape[0] = c->M;
    x->shape[1] = c->K;
    if (c->rule == TW_SHARD_GROUPED_GEMM) {
      w->ndim = 3;
      w->shape[0] = c->G;
      w->shape[1] = c->K;
      w->shape[2] = c->N;
    }
  }
}

void fz_shard_shapes(const fz_case *c, int nd[3], int64_t shape[3][TW_MAX_DIMS], char dims[3][TW_MAX_DIMS + 1]) {
  /* the forward tensors X, W, Y as (letters, sizes) */
  char L[3][TW_MAX_DIMS + 1];
  int64_t S[3][TW_MAX_DIMS];
  int n[3];
  memset(S, 0, sizeof S);
  int xb = c->rule == TW_SHARD_DENSE && c->B > 0, wb = xb && c->w_batched;
  const char *lx = xb ? "BMK" : "MK", *ly = xb ? "BMN" : "MN";
  const char *lw = c->rule == TW_SHARD_GROUPED_GEMM ? "GKN" : wb ? "BKN" : "KN";
  const char *ls[3] = {lx, lw, ly};
  for (int t = 0; t < 3; t++) {
    n[t] = (int)strlen(ls[t]);
    snprintf(L[t], sizeof L[t], "%s", ls[t]);
    for (int d = 0; d < n[t]; d++) {
      char ch = ls[t][d];
      S[t][d] = ch == 'B' ? c->B : ch == 'M' ? c->M : ch == 'K' ? c->K : ch == 'N' ? c->N : c->G;
    }
  }
  /* fwd: (X, W) -> Y; dgrad: (Y, W) -> X; wgrad: (X, Y) -> W; quantize: X -> X */
  int map[3][3] = {{0, 1, 2}, {2, 1, 0}, {0, 2, 1}};
  int p = c->pass >= TW_PASS_FWD && c->pass < TW_PASS_COUNT ? (int)c->pass : 0;
  for (int i = 0; i < 3; i++) {
    int t = map[p][i];
    if (c->rule == TW_SHARD_GROUPED_QUANTIZE) t = i == 1 ? -1 : 0;
    nd[i] = t < 0 ? 0 : n[t];
    memset(shape[i], 0, sizeof(int64_t) * TW_MAX_DIMS);
    if (t >= 0) memcpy(shape[i], S[t], sizeof(int64_t) * (size_t)n[t]);
    if (dims) snprintf(dims[i], TW_MAX_DIMS + 1, "%s", t < 0 ? "" : L[t]);
  }
}

tw_rule_opts fz_shard_rule_opts(const fz_case *c) {
  tw_rule_opts o = TW_RULE_OPTS_INIT;
  o.quant.mode = c->mode;
  o.quant.qdtype = c->qdtype;
  o.quant.layout = c->layout;
  o.quant.pow2_scales = c->pow2;
  o.quant.mxfp8_swizzled = c->swizzled;
  o.quantize_inputs = c->fp8_inputs;
  o.quantize_before_gather = c->quantize_before_gather;
  o.fp8 = TW_E4M3;
  return o;
}

const char *fz_shard_expected_error(const fz_case *c) {
  tw_shard_operand x, w;
  fz_shard_operands(c, &x, &w);
  tw_rule_opts o = fz_shard_rule_opts(c);
  return tw_shard_expected_error(&c->mesh, c->rule, &o.quant, &x, &w);
}

static const tw_axis kDenseAxes[] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_TP};
static const tw_axis kGroupedAxes[] = {TW_AXIS_DP, TW_AXIS_FSDP, TW_AXIS_EP, TW_AXIS_TP};

/* 1, 2, 4 or 8 ranks (weights 10/30/35/25, at most max_ranks), each doubling going to one of
 * the rule's axes at random; the axes laid out in a random order. */
static void draw_mesh(fz_rng *r, tw_shard_op rule, int max_ranks, tw_mesh *m) {
  const tw_axis *ax = rule == TW_SHARD_DENSE ? kDenseAxes : kGroupedAxes;
  int nax = rule == TW_SHARD_DENSE ? 3 : 4;
  int w = (int)fz_below(r, 100), target = w < 10 ? 1 : w < 40 ? 2 : w < 75 ? 4 : 8;
  while (target > max_ranks && target > 1) target /= 2;
  int size[4] = {1, 1, 1, 1}, perm[4] = {0, 1, 2, 3};
  for (int t = 1; t < target; t *= 2) size[fz_below(r, (uint64_t)nax)] *= 2;
  for (int i = nax - 1; i > 0; i--) {
    int j = (int)fz_below(r, (uint64_t)i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  tw_axis order[4];
  int sizes[4], n = 0;
  for (int i = 0; i < nax; i++)
    if (size[perm[i]] > 1) { order[n] = ax[perm[i]]; sizes[n++] = size[perm[i]]; }
  tw_mesh_init(m, n, order, sizes);
}

static int ds_has(const tw_dimspec *d, tw_axis a) {
  for (int i = 0; i < d->n; i++)
    if (d->axis[i] == a) return 1;
  return 0;
}

/* None (pct_none %), one axis of the mesh, or an ordered pair (rarely the same axis twice). */
static tw_dimspec draw_dimspec(fz_rng *r, const tw_mesh *m, int pct_none) {
  tw_dimspec d;
  memset(&d, 0, sizeof d);
  if (m->naxes == 0 || fz_chance(r, pct_none)) return d;
  d.axis[d.n++] = m->axis[fz_below(r, (uint64_t)m->naxes)];
  if (m->naxes > 1 && fz_chance(r, 25)) {
    tw_axis b = m->axis[fz_below(r, (uint64_t)m->naxes)];
    if (b != d.axis[0] || fz_chance(r, 20)) d.axis[d.n++] = b;
  }
  return d;
}

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) { int64_t t = a % b; a = b; b = t; }
  return a;
}
static int64_t lcm64(int64_t a, int64_t b) { return a / gcd64(a, b) * b; }
static int64_t nshards(const tw_mesh *m, const tw_dimspec *d) { return tw_dimspec_shards(m, d); }

/* A dim that splits into q shards: half the time an edge size rounded up to a multiple of q,
 * else q times an edge size (the local dim sits on the edge). */
static int64_t draw_multiple(fz_rng *r, int64_t q, int64_t hi) {
  if (q < 1) q = 1;
  if (fz_chance(r, 50)) {
    int64_t d = pick_dim(r, 1, hi > q ? hi : q);
    return (d + q - 1) / q * q;
  }
  int64_t lhi = hi / q;
  return q * pick_dim(r, 1, lhi > 1 ? lhi : 1);
}

/* Splits `rows` rows over gl groups (sum exactly `rows`) by a pattern; returns its name. */
static const char *fill_groups(fz_rng *r, int32_t *gs, int64_t gl, int64_t rows) {
  static const char *const pats[] = {"random", "zero_group", "one_row", "skew99", "tile_edge", "single", "equal"};
  int p = (int)fz_below(r, sizeof pats / sizeof pats[0]);
  for (int64_t g = 0; g < gl; g++) gs[g] = 0;
  int64_t left = rows;
  switch (p) {
    case 0: case 1:
      for (int64_t i = 0; i < rows; i++) gs[fz_below(r, (uint64_t)gl)]++;
      left = 0;
      if (p == 1 && gl > 1) {
        int64_t z = (int64_t)fz_below(r, (uint64_t)gl);
        gs[(z + 1) % gl] += gs[z];
        gs[z] = 0;
      }
      break;
    case 2:
      for (int64_t g = 0; g < gl && left > 0; g++)
        if (fz_chance(r, 60)) { gs[g] = 1; left--; }
      break;
    case 3: {
      int64_t rest = rows / 100;
      for (int64_t i = 0; i < rest; i++) gs[fz_below(r, (uint64_t)gl)]++;
      left -= rest;
      break;
    }
    case 4:
      for (int64_t g = 0; g < gl && left > 0; g++) {
        int64_t m = pick_dim(r, 0, left);
        gs[g] = (int32_t)m;
        left -= m;
      }
      break;
    case 6:
      for (int64_t g = 0; g < gl; g++) gs[g] = (int32_t)(rows / gl);
      left = rows - rows / gl * gl;
      break;
    default: break;
  }
  if (left > 0) gs[fz_below(r, (uint64_t)gl)] += (int32_t)left; /* the rest to one group */
  return pats[p];
}

/* Quantize's block along K when K is split (quantize.k_block), else 0. */
static int64_t k_block(const fz_case *c) {
  int row = c->layout & TW_ROWWISE;
  if ((row && c->mode == TW_SCALE_BLOCK_1x128) || c->mode == TW_SCALE_BLOCK_128x128) return 128;
  if (row && c->mode == TW_SCALE_MXFP8_1D) return 32;
  return 0;
}

/* Shapes for the drawn specs: every dim a multiple of what shards it (dense's reduce-scatter
 * along M, ep injected into w's experts and quantize's K blocks included). */
static void draw_shard_shapes(fz_rng *r, fz_case *c, int loose) {
  const tw_mesh *m = &c->mesh;
  const tw_pspec *xs = &c->x_spec, *ws = &c->w_spec;
  if (c->rule == TW_SHARD_DENSE) {
    int xb = c->B > 0, wb = xb && c->w_batched;
    int64_t qB = xb ? nshards(m, &xs->dim[0]) : 1, qM = nshards(m, &xs->dim[xb]), qK = nshards(m, &xs->dim[xb + 1]);
    if (wb) qB = lcm64(qB, nshards(m, &ws->dim[0]));
    tw_dimspec R;
    memset(&R, 0, sizeof R);
    for (int i = 0; i < ws->dim[wb].n; i++)
      if (ws->dim[wb].axis[i] != TW_AXIS_FSDP) R.axis[R.n++] = ws->dim[wb].axis[i];
    if (R.n && xs->dim[xb].n && !loose) qM = lcm64(qM, nshards(m, &R)); /* gemm.reduce_scatter_m */
    qK = lcm64(qK, nshards(m, &ws->dim[wb]));
    int64_t qN = nshards(m, &ws->dim[wb + 1]);
    if (xb) c->B = draw_multiple(r, qB, 6);
    c->M = draw_multiple(r, qM, 64);
    c->K = draw_multiple(r, qK, 96);
    c->N = draw_multiple(r, qN, 64);
    int z = (int)fz_below(r, 100); /* empty dims now and then */
    if (z < 2) c->M = 0;
    else if (z < 4) c->K = 0;
    else if (z < 6) c->N = 0;
    while ((xb ? c->B : 1) * c->M * c->N * c->K > 200000 && c->K > qK) c->K = qK * ((c->K / qK + 1) / 2);
  } else if (c->rule == TW_SHARD_GROUPED_GEMM) {
    int64_t qM = nshards(m, &xs->dim[0]), qK = lcm64(nshards(m, &xs->dim[1]), nshards(m, &ws->dim[1]));
    int64_t qN = nshards(m, &ws->dim[2]), qG = nshards(m, &ws->dim[0]);
    if (ds_has(&xs->dim[0], TW_AXIS_EP) && !loose) qG = lcm64(qG, tw_mesh_axis_size(m, TW_AXIS_EP));
    c->K = draw_multiple(r, qK, 64);
    c->N = draw_multiple(r, qN, 64);
    c->G = draw_multiple(r, qG, 12);
    int64_t budget = 400000 / (c->K * c->N + 1);
    if (budget > 256) budget = 256;
    c->M = draw_multiple(r, qM, budget);
    if (fz_chance(r, 3)) c->M = 0;
  } else {
    int64_t qM = nshards(m, &xs->dim[0]), qK = nshards(m, &xs->dim[1]), kb = k_block(c);
    if (kb && xs->dim[1].n && !loose) qK *= kb; /* quantize.k_block */
    c->K = draw_multiple(r, qK, qK > 300 ? qK * 2 : 300);
    int64_t budget = 30000 / c->K;
    if (budget > 200) budget = 200;
    c->M = draw_multiple(r, qM, budget);
    c->G = range(r, 1, 12);
  }
}

/* Makes one dim that a spec splits not divide (an invalid shape); 0 if none is split. */
static int break_divisibility(fz_rng *r, fz_case *c) {
  tw_shard_operand x, w;
  fz_shard_operands(c, &x, &w);
  int64_t *dims[6];
  int n = 0;
  const tw_mesh *m = &c->mesh;
  for (int d = 0; d < x.ndim; d++)
    if (nshards(m, &x.spec.dim[d]) > 1) {
      int xb = c->rule == TW_SHARD_DENSE && c->B > 0;
      char ch = (xb ? "BMK" : "MK")[d];
      dims[n++] = ch == 'B' ? &c->B : ch == 'M' ? &c->M : &c->K;
    }
  if (c->rule != TW_SHARD_GROUPED_QUANTIZE)
    for (int d = 0; d < w.ndim; d++)
      if (nshards(m, &w.spec.dim[d]) > 1) {
        const char *lw = c->rule == TW_SHARD_GROUPED_GEMM ? "GKN" : w.ndim == 3 ? "BKN" : "KN";
        char ch = lw[d];
        dims[n++] = ch == 'B' ? &c->B : ch == 'G' ? &c->G : ch == 'K' ? &c->K : &c->N;
      }
  if (!n) return 0;
  *dims[fz_below(r, (uint64_t)n)] += 1;
  return 1;
}

/* Group sizes: with x's rows on ep (grouped GEMM), ep blocks of M/ep rows, block e split over
 * its experts e*G/ep.. (every block but the last filled, as routing leaves them); rows past
 * the groups (a tail) only in the last block. */
static int draw_shard_groups(fz_rng *r, fz_case *c) {
  int64_t E = 1;
  if (c->rule == TW_SHARD_GROUPED_GEMM && ds_has(&c->x_spec.dim[0], TW_AXIS_EP)) {
    E = tw_mesh_axis_size(&c->mesh, TW_AXIS_EP);
    if (c->M % E || c->G % E) E = 1; /* an invalid case: it never runs */
  }
  c->group_sizes = calloc((size_t)(c->G ? c->G : 1), sizeof(int32_t));
  if (!c->group_sizes) return -1;
  int64_t gl = c->G / E, mb = c->M / E;
  const char *pat = "";
  for (int64_t e = 0; e < E; e++) {
    int64_t rows = mb;
    if (e == E - 1 && fz_chance(r, 30)) rows -= pick_dim(r, 0, mb); /* a tail */
    if (e == E - 1 && fz_chance(r, 4)) rows = 0;                     /* all empty */
    pat = fill_groups(r, c->group_sizes + e * gl, gl, rows);
  }
  int64_t S = 0;
  for (int64_t g = 0; g < c->G; g++) S += c->group_sizes[g];
  note_add(c, pat);
  if (S < c->M) note_add(c, "tail");
  if (E > 1) note_add(c, "ep_blocks");
  return 0;
}

/* Leaves out of d the axes used before in p (dims < upto) or twice in d. */
static void distinct_axes(const tw_pspec *p, int upto, tw_dimspec *d) {
  int k = 0;
  for (int i = 0; i < d->n; i++) {
    int seen = 0;
    for (int e = 0; e < upto; e++) seen |= ds_has(&p->dim[e], d->axis[i]);
    for (int j = 0; j < k; j++) seen |= d->axis[j] == d->axis[i];
    if (!seen) d->axis[k++] = d->axis[i];
  }
  d->n = k;
}

/* Partition specs for x and w; `repeats`: an axis may appear twice in one spec (a bad spec). */
static void draw_specs(fz_rng *r, fz_case *c, int repeats) {
  const tw_mesh *m = &c->mesh;
  memset(&c->x_spec, 0, sizeof c->x_spec);
  memset(&c->w_spec, 0, sizeof c->w_spec);
  tw_shard_operand x, w;
  fz_shard_operands(c, &x, &w);
  c->x_spec.ndim = x.ndim;
  c->w_spec.ndim = w.ndim;
  for (int d = 0; d < x.ndim; d++) {
    c->x_spec.dim[d] = draw_dimspec(r, m, 35);
    if (!repeats) distinct_axes(&c->x_spec, d, &c->x_spec.dim[d]);
  }
  for (int d = 0; d < w.ndim; d++) {
    c->w_spec.dim[d] = draw_dimspec(r, m, 40);
    if (!repeats) distinct_axes(&c->w_spec, d, &c->w_spec.dim[d]);
  }
  if (c->rule == TW_SHARD_DENSE && w.ndim == 3 && fz_chance(r, 70))
    c->w_spec.dim[0] = c->x_spec.dim[0]; /* gemm.batch: w's batch follows x's */
  if (c->rule == TW_SHARD_GROUPED_GEMM) {
    int has_ep = 0;
    for (int i = 0; i < m->naxes; i++) has_ep |= m->axis[i] == TW_AXIS_EP;
    tw_dimspec *rows = &c->x_spec.dim[0], *eg = &c->w_spec.dim[0];
    if (has_ep && fz_chance(r, 50)) { /* ep major on the rows (the EP layout), maybe a second axis */
      tw_dimspec d = draw_dimspec(r, m, 60);
      rows->n = 0;
      rows->axis[rows->n++] = TW_AXIS_EP;
      if (d.n && d.axis[0] != TW_AXIS_EP) rows->axis[rows->n++] = d.axis[0];
      if (!repeats) distinct_axes(&c->x_spec, 1, &c->x_spec.dim[1]); /* x's K: not the rows' axes */
    }
    /* the expert dim: mostly replicated (ep is injected), else ep */
    if (fz_chance(r, 80)) {
      int k = (int)fz_below(r, 100);
      eg->n = 0;
      if (k < 25 && has_ep) eg->axis[eg->n++] = TW_AXIS_EP;
    }
  }
}

int fz_generate_sharded(fz_case *c, fz_op op, uint64_t seed, uint64_t index, const fz_mesh_opt *mo) {
  memset(c, 0, sizeof *c);
  if (!fz_op_shardable(op)) return -1;
  fz_rng r;
  case_start(c, &r, seed, index, op, 0x5348415244454421ull); /* a stream of its own */
  c->sharded = 1;
  c->pass = TW_PASS_FWD;
  switch (op) {
    case FZ_QUANTIZE:
      c->rule = TW_SHARD_GROUPED_QUANTIZE;
      c->mode = (tw_scaling)range(&r, TW_SCALE_TENSOR_CURRENT, TW_SCALE_BLOCK_128x128);
      c->qdtype = pick(&r, kFp8, 2);
      c->layout = (tw_qlayout)range(&r, 1, 3);
      c->pow2 = (c->mode == TW_SCALE_TENSOR_CURRENT || c->mode == TW_SCALE_BLOCK_1x128 ||
                 c->mode == TW_SCALE_BLOCK_128x128) && fz_chance(&r, 30);
      c->swizzled = c->mode == TW_SCALE_MXFP8_1D ? fz_chance(&r, 50) : 0;
      c->x_dtype = pick(&r, kPlain, 3);
      break;
    case FZ_GEMM:
      c->rule = TW_SHARD_DENSE;
      c->pass = (tw_pass)fz_below(&r, 3);
      if (fz_chance(&r, 40)) {
        c->B = 1; /* 3-D x; the size comes with the shapes */
        c->w_batched = fz_chance(&r, 50);
      }
      break;
    case FZ_GROUPED_GEMM:
      c->rule = TW_SHARD_GROUPED_GEMM;
      c->pass = fz_chance(&r, 60) ? TW_PASS_FWD : TW_PASS_DGRAD;
      if (fz_chance(&r, 25)) { /* fp8 inputs, w (fwd, dgrad) quantized before its gather or after */
        c->fp8_inputs = 1;
        c->quantize_before_gather = fz_chance(&r, 50);
      }
      break;
    default:
      c->rule = TW_SHARD_GROUPED_GEMM;
      c->pass = TW_PASS_WGRAD;
      c->fp8_inputs = fz_chance(&r, 25); /* x and dy; the wgrad has no w to quantize before a gather */
  }
  if (mo->all) draw_mesh(&r, c->rule, mo->max_ranks, &c->mesh);
  else c->mesh = mo->mesh;
  /* specs and shapes: about one case in nine must be refused: two thirds of those by a rule
   * (gemm.rhs_k_and_n, grouped_gemm.ep_major, quantize.k_block, ...), the rest by a bad spec
   * (an axis twice, a dim that does not divide) */
  int want_invalid = fz_chance(&r, 11), want_rule = fz_chance(&r, 67), found = 0;
  for (int attempt = 0; attempt < 60 && !found; attempt++) {
    draw_specs(&r, c, want_invalid && !want_rule && fz_chance(&r, 60));
    draw_shard_shapes(&r, c, want_invalid && want_rule && fz_chance(&r, 50));
    if (want_invalid && !want_rule && (attempt & 1)) break_divisibility(&r, c);
    const char *e = fz_shard_expected_error(c);
    found = (e != NULL) == want_invalid;
    if (found && e && attempt < 40) found = (strncmp(e, "rule", 4) == 0) == want_rule;
  }
  if (!found) { /* replicated specs always plan */
    tw_shard_operand x, w;
    fz_shard_operands(c, &x, &w);
    memset(&c->x_spec, 0, sizeof c->x_spec);
    memset(&c->w_spec, 0, sizeof c->w_spec);
    c->x_spec.ndim = x.ndim;
    c->w_spec.ndim = w.ndim;
    draw_shard_shapes(&r, c, 0);
    want_invalid = 0;
    note_add(c, "replicated");
  }
  note_add(c, mo->all ? "mesh_all" : "mesh_fixed");
  if (want_invalid) note_add(c, "invalid");
  if (c->rule != TW_SHARD_DENSE && draw_shard_groups(&r, c)) return fz_case_free(c), -1;
  vstyle s1, s2;
  if (c->rule == TW_SHARD_GROUPED_QUANTIZE) {
    c->x = gen_values(&r, c->M * c->K, c->x_dtype, 1, -40, 126, &s1);
    if (!c->x) return fz_case_free(c), -1;
    note_add(c, vstyle_names[s1]);
    if (c->mode == TW_SCALE_TENSOR_DELAYED) {
      c->scale = malloc(sizeof(float) * (size_t)(c->G ? c->G : 1));
      if (!c->scale) return fz_case_free(c), -1;
      for (int64_t g = 0; g < c->G; g++) c->scale[g] = (float)ldexp(1.0 + fz_unit(&r), (int)range(&r, -12, 12));
    }
    return 0;
  }
  tw_dtype pa = pick(&r, kPlain, 3), pb = pa;
  if (fz_chance(&r, 25)) { if (fz_chance(&r, 50)) pa = TW_F32; else pb = TW_F32; }
  c->sa.dtype = pa;
  c->sb.dtype = pb;
  c->out_dtype = pick(&r, kPlain, 3);
  int emin, emax;
  gemm_exp_range(c, &emin, &emax);
  int special = c->out_dtype != TW_F16 && fz_chance(&r, 15);
  if (c->fp8_inputs) { /* the quantized operands stay in tw_gemm's domain */
    special = 0;
    emin = -8;
    emax = c->out_dtype == TW_F16 ? 2 : 8;
  }
  c->a = gen_values(&r, fz_numel_a(c), pa, special, emin, emax, &s1);
  c->b = gen_values(&r, fz_numel_b(c), pb, special, emin, emax, &s2);
  if (!c->a || !c->b) return fz_case_free(c), -1;
  char buf[40];
  snprintf(buf, sizeof buf, "%s/%s", vstyle_names[s1], vstyle_names[s2]);
  note_add(c, buf);
  return 0;
}
