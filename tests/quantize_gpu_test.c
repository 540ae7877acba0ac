/* The CUDA grouped quantize, dequantize and delayed-scale update against the oracle:
 * every stored golden case on the gpu backend, then seeded random cases (shapes 1..8192,
 * G 1..256, skewed and zero-size groups, ragged tails, NaN/inf/huge/tiny values) run on both
 * backends from poisoned outputs and compared bit for bit with the one checker; bad group
 * sizes found on the device (error word, no write out of bounds); forced kernel versions
 * (quantize_tile_async over every golden case, >= 200 random cases and 45 large-tile cases;
 * quantize_tile_spec over every golden case it takes, >= 250 random cases and the 30 16-bit
 * large-tile cases). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden/runner.h"
#include "tests/test_util.h"
#include "twin/tw_check.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

static tw_ctx *gpu_ctx_named(const char *kernel) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = TW_BACKEND_GPU;
  cfg.kernel = kernel;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK, "gpu ctx: %s", tw_last_error());
  return ctx;
}

/* ---- golden cases on the gpu ----------------------------------------------------------- */

/* Every stored golden case on `kernel`; with `skip_unsupported`, cases the kernel does not take
 * (TW_ERR_UNSUPPORTED) are skipped and at least `min_ran` others must run. */
static void golden_cases_on_some(const char *kernel, int skip_unsupported, int min_ran);
static void golden_cases_on(const char *kernel) { golden_cases_on_some(kernel, 0, 0); }
static void golden_cases_on_some(const char *kernel, int skip_unsupported, int min_ran) {
  char root[1024];
  snprintf(root, sizeof root, "%s/quantize", tt_golden_root());
  char **dirs = NULL;
  int n = tw_golden_list_cases(root, &dirs);
  cr_assert_geq(n, 100, "only %d cases under %s: %s", n, root, tw_last_error());
  tw_ctx *ctx = gpu_ctx_named(kernel);
  int failed = 0, ran = 0;
  for (int i = 0; i < n; i++) {
    tw_golden_result res;
    tw_status s = tw_golden_run_case(ctx, dirs[i], &res);
    if (skip_unsupported && s == TW_ERR_UNSUPPORTED) {
      tw_clear_error();
      continue;
    }
    ran++;
    if (s != TW_OK || !res.passed) {
      failed++;
      cr_log_error("[kernel %s] %s: %s %s", kernel ? kernel : "auto", res.name,
                   s != TW_OK ? tw_last_error() : res.worst_output, res.detail);
    }
  }
  cr_assert_eq(failed, 0, "%d of %d golden cases failed on the gpu (kernel %s)", failed, ran, kernel ? kernel : "auto");
  cr_assert_geq(ran, min_ran, "only %d of %d golden cases ran on kernel %s", ran, n, kernel ? kernel : "auto");
  tw_golden_free_list(dirs, n);
  tw_ctx_destroy(ctx);
}

Test(quantize_gpu, every_stored_golden_case_passes_on_the_gpu) { golden_cases_on(NULL); }
/* the async tile kernel takes every shape (element loads where cp.async cannot): all goldens */
Test(quantize_gpu, every_stored_golden_case_passes_forced_tile_async) { golden_cases_on("quantize_tile_async"); }
/* the specialized tile kernel takes bf16/f16 x with K % 8 == 0: every such golden case */
Test(quantize_gpu, every_eligible_golden_case_passes_forced_tile_spec) { golden_cases_on_some("quantize_tile_spec", 1, 20); }

/* ---- random cases ------------------------------------------------------------------------ */

typedef struct {
  int64_t M, K, G, S;
  int32_t *sizes;
  tw_dtype xdt;
  void *x;       /* host, xdt */
  float *scale;  /* delayed: [G] */
  tw_quantize_opts opts;
  int with_amax;
  char name[256];
} qcase;

static float special_value(uint64_t *st) {
  static const uint32_t bits[] = {0x7FC00000u, 0xFFC00000u, 0x7F800000u, 0xFF800000u, 0x00000000u,
                                  0x80000000u, 0x7F000000u, 0x00000001u, 0x80400000u, 0x43E00000u,
                                  0x43E80000u, 0x47600000u, 0x47700000u, 0x3A800000u, 0x007FFFFFu};
  uint32_t b = bits[tt_rand_u64(st) % (sizeof bits / sizeof bits[0])];
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* Group sizes of sum S <= M: random cut points, many zero groups in some cases, one giant
 * group in others. */
static void make_sizes(qcase *c, uint64_t *st) {
  int64_t G = c->G, S = c->S;
  c->sizes = calloc((size_t)G, sizeof(int32_t));
  int style = (int)(tt_rand_u64(st) % 4);
  if (style == 0) { /* one group takes almost everything */
    int64_t big = (int64_t)(tt_rand_u64(st) % (uint64_t)G);
    int64_t left = S;
    for (int64_t g = 0; g < G && left > 0; g++) {
      if (g == big) continue;
      int64_t m = (int64_t)(tt_rand_u64(st) % 3);
      m = m > left ? left : m;
      c->sizes[g] = (int32_t)m;
      left -= m;
    }
    c->sizes[big] += (int32_t)left;
    return;
  }
  /* cut [0, S] at G-1 random points (sorted) */
  int64_t *cuts = malloc(sizeof(int64_t) * (size_t)(G + 1));
  cuts[0] = 0;
  cuts[G] = S;
  for (int64_t g = 1; g < G; g++) cuts[g] = S ? (int64_t)(tt_rand_u64(st) % (uint64_t)(S + 1)) : 0;
  for (int64_t i = 1; i < G; i++) /* insertion sort of the inner cuts */
    for (int64_t j = i; j > 1 && cuts[j - 1] > cuts[j]; j--) {
      int64_t t = cuts[j];
      cuts[j] = cuts[j - 1];
      cuts[j - 1] = t;
    }
  for (int64_t g = 0; g < G; g++) c->sizes[g] = (int32_t)(cuts[g + 1] - cuts[g]);
  if (style == 1) /* merge neighbours into zeros: move every other group's rows to the next */
    for (int64_t g = 0; g + 1 < G; g += 2) {
      c->sizes[g + 1] += c->sizes[g];
      c->sizes[g] = 0;
    }
  free(cuts);
}

static void make_case(qcase *c, uint64_t seed, int mode_pick) {
  uint64_t st = seed;
  memset(c, 0, sizeof *c);
  int shape = (int)(tt_rand_u64(&st) % 10);
  if (shape < 5) {
    c->M = 1 + (int64_t)(tt_rand_u64(&st) % 300);
    c->K = 1 + (int64_t)(tt_rand_u64(&st) % 300);
  } else if (shape < 8) {
    c->M = 1 + (int64_t)(tt_rand_u64(&st) % 2048);
    c->K = 1 + (int64_t)(tt_rand_u64(&st) % 700);
  } else if (shape == 8) {
    c->M = 1 + (int64_t)(tt_rand_u64(&st) % 8192);
    c->K = 1 + (int64_t)(tt_rand_u64(&st) % 96);
  } else {
    c->M = 1 + (int64_t)(tt_rand_u64(&st) % 64);
    c->K = 1 + (int64_t)(tt_rand_u64(&st) % 8192);
  }
  if (tt_rand_u64(&st) % 3 == 0) c->K = (c->K + 31) / 32 * 32; /* aligned shapes too */
  c->G = 1 + (int64_t)(tt_rand_u64(&st) % (tt_rand_u64(&st) % 2 ? 8 : 256));
  c->S = c->M - (tt_rand_u64(&st) % 3 == 0 ? (int64_t)(tt_rand_u64(&st) % (uint64_t)(c->M + 1)) : 0);
  make_sizes(c, &st);
  static const tw_dtype xdts[] = {TW_BF16, TW_F32, TW_F16};
  c->xdt = xdts[tt_rand_u64(&st) % 3];
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = (tw_scaling)(1 + (mode_pick >= 0 ? mode_pick : (int)(tt_rand_u64(&st) % 5)));
  o.qdtype = tt_rand_u64(&st) % 3 == 0 ? TW_E5M2 : TW_E4M3;
  o.layout = (tw_qlayout)(1 + tt_rand_u64(&st) % 3);
  o.pow2_scales = (int)(tt_rand_u64(&st) % 2);
  o.mxfp8_swizzled = (int)(tt_rand_u64(&st) % 2);
  /* token-padded colwise data in a third of the cases that have it (from the seed: the random
   * stream, and so every other choice of a case, is the same as before the layout existed) */
  o.col_padded = (o.layout & TW_COLWISE) && o.mode != TW_SCALE_MXFP8_1D && seed % 3 == 1;
  c->opts = o;
  c->with_amax = o.mode <= TW_SCALE_TENSOR_DELAYED || tt_rand_u64(&st) % 2;
  /* values: normal-ish times a per-case magnitude, per-row spread, some specials */
  int64_t n = c->M * c->K;
  double mag = ldexp(1.0, (int)(tt_rand_u64(&st) % 41) - 20);
  int specials = tt_rand_u64(&st) % 4 == 0;
  c->x = malloc((size_t)n * (c->xdt == TW_F32 ? 4 : 2) + 4);
  for (int64_t i = 0; i < n; i++) {
    double u = tt_rand_uniform(&st, -1.0, 1.0) + tt_rand_uniform(&st, -1.0, 1.0);
    float v = (float)(u * mag * (1 + (i / c->K) % 7));
    if (specials && tt_rand_u64(&st) % 97 == 0) v = special_value(&st);
    if (c->xdt == TW_F32) ((float *)c->x)[i] = v;
    else if (c->xdt == TW_BF16) ((uint16_t *)c->x)[i] = tw_f32_to_bf16(v);
    else ((uint16_t *)c->x)[i] = tw_f32_to_f16(v);
  }
  if (o.mode == TW_SCALE_TENSOR_DELAYED) {
    c->scale = malloc(sizeof(float) * (size_t)c->G);
    for (int64_t g = 0; g < c->G; g++)
      c->scale[g] = (float)ldexp(tt_rand_uniform(&st, 1.0, 2.0), (int)(tt_rand_u64(&st) % 30) - 15);
    if (specials) c->scale[0] = special_value(&st);
  }
  snprintf(c->name, sizeof c->name, "seed %llu: %s %s %s%s x %s [%lld, %lld] G=%lld S=%lld pow2=%d swz=%d amax=%d",
           (unsigned long long)seed, tw_scaling_name(o.mode), tw_dtype_name(o.qdtype),
           o.layout == TW_ROWWISE ? "rowwise" : o.layout == TW_COLWISE ? "colwise" : "rowwise_colwise",
           o.col_padded ? " (token-padded)" : "", tw_dtype_name(c->xdt), (long long)c->M, (long long)c->K,
           (long long)c->G, (long long)c->S, o.pow2_scales, o.mxfp8_swizzled, c->with_amax);
}

static void free_case(qcase *c) {
  free(c->sizes);
  free(c->x);
  free(c->scale);
}

/* The components of a qtensor, by index, so both sides can be walked together. */
static tw_tensor *component(tw_qtensor *q, int i) {
  switch (i) {
    case 0: return &q->row_data;
    case 1: return &q->row_scale_inv;
    case 2: return &q->col_data;
    case 3: return &q->col_scale_inv;
    default: return &q->amax;
  }
}
static const char *const component_names[] = {"row_data", "row_scale_inv", "col_data", "col_scale_inv", "amax"};

/* Allocates every component of `shape` in ctx's memory, poisoned. Tensor modes share one
 * scale buffer: col_scale_inv is left none when rowwise exists (the documented form). */
static void alloc_q(tw_ctx *ctx, const tw_qtensor *shape, int with_amax, tw_qtensor *q) {
  *q = *shape;
  int tensor = shape->mode == TW_SCALE_TENSOR_CURRENT || shape->mode == TW_SCALE_TENSOR_DELAYED;
  if (tensor && !tw_tensor_is_none(&shape->row_scale_inv)) q->col_scale_inv = tw_tensor_none();
  if (!with_amax) q->amax = tw_tensor_none();
  for (int i = 0; i < 5; i++) {
    tw_tensor *t = component(q, i);
    if (tw_tensor_is_none(t)) continue;
    size_t b = tw_tensor_bytes(t);
    t->mem = tw_ctx_mem(ctx);
    t->data = NULL;
    cr_assert_eq(tw_alloc(ctx, b, &t->data), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_memset(ctx, t->data, TW_POISON_BYTE, b), TW_OK);
  }
}

static void free_q(tw_ctx *ctx, tw_qtensor *q) {
  for (int i = 0; i < 5; i++)
    if (!tw_tensor_is_none(component(q, i))) tw_free(ctx, component(q, i)->data);
}

/* A device copy of a host tensor. */
static tw_tensor to_device(tw_ctx *g, const tw_tensor *h) {
  tw_tensor d = *h;
  d.mem = TW_MEM_DEVICE;
  d.data = NULL;
  size_t b = tw_tensor_bytes(h);
  if (b) {
    cr_assert_eq(tw_alloc(g, b, &d.data), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_tensor_copy(g, &d, h), TW_OK, "%s", tw_last_error());
  }
  return d;
}

/* The host copy of a device tensor (malloc'd). */
static tw_tensor to_host(tw_ctx *g, const tw_tensor *d) {
  tw_tensor h = *d;
  h.mem = TW_MEM_HOST;
  h.data = malloc(tw_tensor_bytes(d) + 1);
  if (tw_tensor_bytes(d)) cr_assert_eq(tw_tensor_copy(g, &h, d), TW_OK, "%s", tw_last_error());
  return h;
}

/* Runs one case on ref and gpu; asserts equality of every produced component. */
static void run_quantize_case(tw_ctx *ref, tw_ctx *gpu, qcase *c) {
  tw_tensor hx = tw_tensor_2d(c->x, c->xdt, c->M, c->K, TW_MEM_HOST);
  tw_tensor hs = tw_tensor_1d(c->sizes, TW_I32, c->G, TW_MEM_HOST);
  tw_qtensor shape, qr, qg;
  cr_assert_eq(tw_quantize_output_shapes(&c->opts, c->M, c->K, c->G, &shape), TW_OK, "%s", tw_last_error());
  alloc_q(ref, &shape, c->with_amax, &qr);
  alloc_q(gpu, &shape, c->with_amax, &qg);
  tw_quantize_opts ro = c->opts, go = c->opts;
  tw_tensor dscale = tw_tensor_none();
  if (c->scale) {
    ro.scale = tw_tensor_1d(c->scale, TW_F32, c->G, TW_MEM_HOST);
    dscale = to_device(gpu, &ro.scale);
    go.scale = dscale;
  }
  tw_tensor dx = to_device(gpu, &hx), ds = to_device(gpu, &hs);
  cr_assert_eq(tw_grouped_quantize(ref, &hx, &hs, &ro, &qr), TW_OK, "ref %s: %s", c->name, tw_last_error());
  cr_assert_eq(tw_grouped_quantize(gpu, &dx, &ds, &go, &qg), TW_OK, "gpu %s: %s", c->name, tw_last_error());
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "gpu %s: %s", c->name, tw_last_error());
  for (int i = 0; i < 5; i++) {
    tw_tensor *tr = component(&qr, i), *tg = component(&qg, i);
    if (tw_tensor_is_none(tr)) continue;
    tw_tensor back = to_host(gpu, tg);
    char what[400];
    snprintf(what, sizeof what, "%s of %s", component_names[i], c->name);
    tt_expect_exact(&back, tr, what);
    free(back.data);
  }
  for (int i = 0; i < 5; i++)
    if (!tw_tensor_is_none(component(&qr, i))) free(component(&qr, i)->data);
  free_q(gpu, &qg);
  tw_free(gpu, dx.data);
  tw_free(gpu, ds.data);
  if (dscale.data) tw_free(gpu, dscale.data);
}

/* ref contexts allocate with tw_alloc too (host), freed with free() above: same allocator. */

static void random_quantize_cases(const char *kernel, int count, uint64_t seed0, int mode_pick) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named(kernel);
  for (int i = 0; i < count; i++) {
    qcase c;
    make_case(&c, seed0 + (uint64_t)i * 7919u, mode_pick);
    run_quantize_case(ref, gpu, &c);
    free_case(&c);
  }
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
}

Test(quantize_gpu, random_current_cases_match_ref, .timeout = 600) { random_quantize_cases(NULL, 120, 1000, 0); }
Test(quantize_gpu, random_delayed_cases_match_ref, .timeout = 600) { random_quantize_cases(NULL, 120, 2000, 1); }
Test(quantize_gpu, random_mxfp8_cases_match_ref, .timeout = 600) { random_quantize_cases(NULL, 150, 3000, 2); }
Test(quantize_gpu, random_block1x128_cases_match_ref, .timeout = 600) { random_quantize_cases(NULL, 120, 4000, 3); }
Test(quantize_gpu, random_block128x128_cases_match_ref, .timeout = 600) { random_quantize_cases(NULL, 120, 5000, 4); }
Test(quantize_gpu, forced_scalar_version_matches_ref, .timeout = 600) {
  random_quantize_cases("quantize_tile_scalar", 100, 6000, -1);
}
/* auto picks the row kernel for aligned rowwise-only cases; the tile kernel must agree too */
Test(quantize_gpu, forced_tile_vec_version_matches_ref_on_aligned_cases, .timeout = 600) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named("quantize_tile_vec");
  int ran = 0;
  for (int i = 0; ran < 100; i++) {
    qcase c;
    make_case(&c, 7000 + (uint64_t)i * 7919u, -1);
    if (c.K % 4 == 0) {
      run_quantize_case(ref, gpu, &c);
      ran++;
    }
    free_case(&c);
  }
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
}

/* quantize_tile_async (the default tile kernel for bf16/f16): random cases of every shape, so
 * both its cp.async path (K % 8 == 0) and its element-load path run; at least 60 of each. */
Test(quantize_gpu, forced_tile_async_version_matches_ref, .timeout = 600) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named("quantize_tile_async");
  int vec = 0, scalar = 0;
  for (int i = 0; i < 400 && (vec < 60 || scalar < 60 || vec + scalar < 200); i++) {
    qcase c;
    make_case(&c, 12000 + (uint64_t)i * 7919u, -1);
    if (c.K % (c.xdt == TW_F32 ? 4 : 8) == 0) vec++;
    else scalar++;
    run_quantize_case(ref, gpu, &c);
    free_case(&c);
  }
  cr_assert_geq(vec, 60, "only %d cp.async-shaped cases", vec);
  cr_assert_geq(scalar, 60, "only %d element-load cases", scalar);
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
}

/* quantize_tile_spec: >= 250 random cases of the shapes it takes (16-bit x, K % 8 == 0), every
 * mode and layout, ragged and empty groups, tails; others must be refused with a message. */
Test(quantize_gpu, forced_tile_spec_version_matches_ref, .timeout = 600) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named("quantize_tile_spec");
  int ran = 0, modes[TW_SCALE_COUNT] = {0};
  for (int i = 0; i < 4000 && ran < 250; i++) {
    qcase c;
    make_case(&c, 31000 + (uint64_t)i * 7919u, -1);
    if (c.K % 8 == 0 && c.xdt != TW_F32) {
      run_quantize_case(ref, gpu, &c);
      ran++;
      modes[c.opts.mode]++;
    }
    free_case(&c);
  }
  cr_assert_geq(ran, 250, "only %d eligible cases", ran);
  for (int m = 1; m < TW_SCALE_COUNT; m++) cr_assert_geq(modes[m], 20, "mode %d: only %d cases", m, modes[m]);
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
}

/* Full 128-row tiles, K past one CTA's 8 column chunks (both buffers reused several times),
 * a group size that is not a multiple of 16 (4-byte and byte colwise stores) next to one that
 * is (16-byte stores), an empty group and a ragged tail: every mode x layout x input dtype,
 * forced async and auto. */
Test(quantize_gpu, tile_async_large_tiles_every_mode_layout_dtype, .timeout = 600) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named("quantize_tile_async"), *aut = gpu_ctx_named(NULL),
         *spec = gpu_ctx_named("quantize_tile_spec");
  static const tw_dtype xdts[] = {TW_BF16, TW_F16, TW_F32};
  static const int32_t sizes[] = {384, 0, 298, 2};  /* S = 684 of M = 700 */
  int ran = 0;
  for (int m = 1; m < TW_SCALE_COUNT; m++)
    for (int lay = 1; lay <= 3; lay++)
      for (int d = 0; d < 3; d++) {
        uint64_t st = 4242 + (uint64_t)(m * 100 + lay * 10 + d);
        qcase c;
        memset(&c, 0, sizeof c);
        c.M = 700;
        c.K = 1168; /* 9.125 chunks of 128: a partial last chunk, K % 16 == 0 */
        c.G = 4;
        c.S = 684;
        c.sizes = malloc(sizeof sizes);
        memcpy(c.sizes, sizes, sizeof sizes);
        c.xdt = xdts[d];
        tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
        o.mode = (tw_scaling)m;
        o.layout = (tw_qlayout)lay;
        o.qdtype = (m + lay) % 2 ? TW_E4M3 : TW_E5M2;
        o.pow2_scales = (m + d) % 2;
        o.mxfp8_swizzled = (lay + d) % 2;
        c.opts = o;
        c.with_amax = 1;
        int64_t n = c.M * c.K;
        c.x = malloc((size_t)n * 4);
        for (int64_t i = 0; i < n; i++) {
          float v = (float)(tt_rand_uniform(&st, -1.0, 1.0) * ldexp(1.0, (int)((i / c.K) % 9) - 4 + (int)((i % c.K) % 5)));
          if (i % 50021 == 7) v = special_value(&st);
          if (c.xdt == TW_F32) ((float *)c.x)[i] = v;
          else if (c.xdt == TW_BF16) ((uint16_t *)c.x)[i] = tw_f32_to_bf16(v);
          else ((uint16_t *)c.x)[i] = tw_f32_to_f16(v);
        }
        if (m == TW_SCALE_TENSOR_DELAYED) {
          c.scale = malloc(sizeof(float) * 4);
          for (int g = 0; g < 4; g++) c.scale[g] = (float)ldexp(1.5, g - 2);
        }
        for (int padded = 0; padded < 2; padded++) {  /* and the token-padded colwise layout */
          if (padded && (!(lay & TW_COLWISE) || m == TW_SCALE_MXFP8_1D)) break;
          c.opts.col_padded = padded;
          snprintf(c.name, sizeof c.name, "large tile case: %s %s layout %d%s x %s [700, 1168] G=4",
                   tw_scaling_name(o.mode), tw_dtype_name(o.qdtype), lay, padded ? " (token-padded)" : "",
                   tw_dtype_name(c.xdt));
          run_quantize_case(ref, gpu, &c);
          run_quantize_case(ref, aut, &c);
          if (c.xdt != TW_F32) run_quantize_case(ref, spec, &c);
          ran += padded;
        }
        free_case(&c);
        ran++;
      }
  cr_assert_eq(ran, 45 + 4 * 2 * 3);  /* + the padded runs: 4 transposed modes x 2 colwise layouts x 3 dtypes */
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
  tw_ctx_destroy(aut);
  tw_ctx_destroy(spec);
}

/* ---- dequantize ------------------------------------------------------------------------- */

Test(quantize_gpu, random_dequantize_cases_match_ref, .timeout = 600) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named(NULL);
  int runs = 0;
  for (int i = 0; i < 300; i++) {
    qcase c;
    make_case(&c, 9000 + (uint64_t)i * 104729u, -1);
    uint64_t st = 77 + (uint64_t)i;
    tw_tensor hx = tw_tensor_2d(c.x, c.xdt, c.M, c.K, TW_MEM_HOST);
    tw_tensor hs = tw_tensor_1d(c.sizes, TW_I32, c.G, TW_MEM_HOST);
    tw_qtensor shape, q;
    c.opts.layout = TW_ROWWISE_COLWISE;
    if (c.scale) c.opts.scale = tw_tensor_1d(c.scale, TW_F32, c.G, TW_MEM_HOST);
    cr_assert_eq(tw_quantize_output_shapes(&c.opts, c.M, c.K, c.G, &shape), TW_OK);
    alloc_q(ref, &shape, 1, &q);
    cr_assert_eq(tw_grouped_quantize(ref, &hx, &hs, &c.opts, &q), TW_OK, "%s: %s", c.name, tw_last_error());
    /* sometimes arbitrary codes (NaN codes included) instead of quantized ones */
    if (tt_rand_u64(&st) % 3 == 0)
      for (int64_t j = 0; j < c.M * c.K; j++) ((uint8_t *)q.row_data.data)[j] = (uint8_t)tt_rand_u64(&st);
    tw_qtensor qd = q;
    for (int k = 0; k < 5; k++)
      if (!tw_tensor_is_none(component(&q, k))) *component(&qd, k) = to_device(gpu, component(&q, k));
    tw_tensor ds = to_device(gpu, &hs);
    static const tw_dtype outs[] = {TW_F32, TW_BF16, TW_F16};
    for (int colwise = 0; colwise < 2; colwise++) {
      tw_dtype odt = outs[tt_rand_u64(&st) % 3];
      size_t ob = tw_dtype_storage_bytes(odt, c.M * c.K);
      tw_tensor ro = tw_tensor_2d(malloc(ob + 1), odt, c.M, c.K, TW_MEM_HOST);
      memset(ro.data, TW_POISON_BYTE, ob);
      tw_tensor go = tw_tensor_2d(NULL, odt, c.M, c.K, TW_MEM_DEVICE);
      cr_assert_eq(tw_alloc(gpu, ob, &go.data), TW_OK);
      cr_assert_eq(tw_memset(gpu, go.data, TW_POISON_BYTE, ob), TW_OK);
      cr_assert_eq(tw_grouped_dequantize(ref, &q, &hs, colwise, &ro), TW_OK, "%s: %s", c.name, tw_last_error());
      cr_assert_eq(tw_grouped_dequantize(gpu, &qd, &ds, colwise, &go), TW_OK, "%s: %s", c.name, tw_last_error());
      cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s: %s", c.name, tw_last_error());
      tw_tensor back = to_host(gpu, &go);
      char what[400];
      snprintf(what, sizeof what, "dequantize %s to %s of %s", colwise ? "colwise" : "rowwise", tw_dtype_name(odt), c.name);
      tt_expect_exact(&back, &ro, what);
      free(back.data);
      free(ro.data);
      tw_free(gpu, go.data);
      runs++;
    }
    for (int k = 0; k < 5; k++)
      if (!tw_tensor_is_none(component(&q, k))) {
        free(component(&q, k)->data);
        tw_free(gpu, component(&qd, k)->data);
      }
    tw_free(gpu, ds.data);
    free_case(&c);
  }
  cr_assert_geq(runs, 500);
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
}

/* ---- delayed scale update ---------------------------------------------------------------- */

Test(quantize_gpu, random_delayed_updates_match_ref, .timeout = 600) {
  tw_ctx *ref = tt_ref_ctx(), *gpu = gpu_ctx_named(NULL);
  for (int i = 0; i < 520; i++) {
    uint64_t st = 31337 + (uint64_t)i * 65537u;
    int64_t G = 1 + (int64_t)(tt_rand_u64(&st) % 300);
    int64_t H = 1 + (int64_t)(tt_rand_u64(&st) % (i % 10 == 0 ? 5000 : 1100));
    float *hist = malloc(sizeof(float) * (size_t)(G * H)), *scale = malloc(sizeof(float) * (size_t)G),
          *amax = malloc(sizeof(float) * (size_t)G);
    int specials = tt_rand_u64(&st) % 3 == 0;
    for (int64_t j = 0; j < G * H; j++) {
      hist[j] = (float)ldexp(tt_rand_uniform(&st, 0.0, 1.0), (int)(tt_rand_u64(&st) % 40) - 20);
      if (specials && tt_rand_u64(&st) % 500 == 0) hist[j] = special_value(&st);
    }
    for (int64_t g = 0; g < G; g++) {
      scale[g] = (float)tt_rand_uniform(&st, 0.5, 4.0);
      amax[g] = tt_rand_u64(&st) % 8 == 0 ? 0.0f : (float)ldexp(tt_rand_uniform(&st, 0.0, 1.0), (int)(tt_rand_u64(&st) % 60) - 30);
      if (specials && tt_rand_u64(&st) % 10 == 0) amax[g] = special_value(&st);
    }
    tw_dtype qd = tt_rand_u64(&st) % 2 ? TW_E4M3 : TW_E5M2;
    tw_amax_algo algo = tt_rand_u64(&st) % 2 ? TW_AMAX_MAX : TW_AMAX_MOST_RECENT;
    float margin = (float)(tt_rand_u64(&st) % 4 == 0 ? tt_rand_u64(&st) % 128 : tt_rand_u64(&st) % 4);
    tw_tensor th = tw_tensor_2d(hist, TW_F32, G, H, TW_MEM_HOST), ts = tw_tensor_1d(scale, TW_F32, G, TW_MEM_HOST),
              ta = tw_tensor_1d(amax, TW_F32, G, TW_MEM_HOST);
    tw_tensor dh = to_device(gpu, &th), ds = to_device(gpu, &ts), da = to_device(gpu, &ta);
    cr_assert_eq(tw_delayed_scale_update(ref, &th, &ts, &ta, qd, algo, margin), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_delayed_scale_update(gpu, &dh, &ds, &da, qd, algo, margin), TW_OK, "%s", tw_last_error());
    cr_assert_eq(tw_ctx_check(gpu), TW_OK, "%s", tw_last_error());
    tw_tensor bh = to_host(gpu, &dh), bs = to_host(gpu, &ds);
    char what[200];
    snprintf(what, sizeof what, "delayed update %d: G=%lld H=%lld %s margin %g", i, (long long)G, (long long)H,
             algo == TW_AMAX_MAX ? "max" : "most_recent", (double)margin);
    tt_expect_exact(&bh, &th, what);
    tt_expect_exact(&bs, &ts, what);
    free(bh.data);
    free(bs.data);
    tw_free(gpu, dh.data);
    tw_free(gpu, ds.data);
    tw_free(gpu, da.data);
    free(hist);
    free(scale);
    free(amax);
  }
  tw_ctx_destroy(ref);
  tw_ctx_destroy(gpu);
}

/* ---- bad group sizes on the device ------------------------------------------------------ */

/* Every output lives in the middle of a poisoned arena; after a run with bad sizes the
 * guard bytes around each output must still be poison. */
#define GUARD 4096
/* x is f32 (the tile_vec kernel on auto) or, with `bf16`, bf16 on `kernel` */
static void bad_sizes_case(tw_scaling mode, const int32_t *sizes, int64_t G, int64_t M, const char *want_msg,
                           const char *kernel, int bf16) {
  tw_ctx *gpu = gpu_ctx_named(kernel);
  const int64_t K = 200;
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.layout = TW_ROWWISE_COLWISE;
  tw_qtensor shape;
  cr_assert_eq(tw_quantize_output_shapes(&o, M, K, G, &shape), TW_OK);
  if (mode == TW_SCALE_TENSOR_CURRENT || mode == TW_SCALE_TENSOR_DELAYED) shape.col_scale_inv = tw_tensor_none();
  size_t total = 0, at[5];
  for (int i = 0; i < 5; i++) {
    at[i] = (total + GUARD + 15) / 16 * 16; /* 16-byte aligned outputs, as tile_spec needs */
    total = at[i] + tw_tensor_bytes(component(&shape, i));
  }
  total += GUARD;
  void *arena;
  cr_assert_eq(tw_alloc(gpu, total, &arena), TW_OK);
  cr_assert_eq(tw_memset(gpu, arena, TW_POISON_BYTE, total), TW_OK);
  tw_qtensor q = shape;
  for (int i = 0; i < 5; i++) {
    tw_tensor *t = component(&q, i);
    if (tw_tensor_is_none(t)) continue;
    t->data = (char *)arena + at[i];
    t->mem = TW_MEM_DEVICE;
  }
  float *hx = malloc(sizeof(float) * (size_t)(M * K));
  tt_fill_uniform_f32(hx, M * K, 5, -3.0f, 3.0f);
  uint16_t *hb = malloc(sizeof(uint16_t) * (size_t)(M * K));
  for (int64_t i = 0; i < M * K; i++) hb[i] = tw_f32_to_bf16(hx[i]);
  tw_tensor th = bf16 ? tw_tensor_2d(hb, TW_BF16, M, K, TW_MEM_HOST) : tw_tensor_2d(hx, TW_F32, M, K, TW_MEM_HOST), ts = tw_tensor_1d((void *)sizes, TW_I32, G, TW_MEM_HOST);
  tw_tensor dx = to_device(gpu, &th), ds = to_device(gpu, &ts);
  float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  tw_tensor hsc = tw_tensor_1d(ones, TW_F32, G, TW_MEM_HOST), dsc = to_device(gpu, &hsc);
  o.scale = dsc;
  cr_assert_eq(tw_grouped_quantize(gpu, &dx, &ds, &o, &q), TW_OK, "%s", tw_last_error());
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, want_msg);
  cr_assert(strstr(tw_last_error(), "grouped_quantize") != NULL, "%s", tw_last_error());
  /* and dequantize reports the same sizes */
  tw_tensor out = tw_tensor_2d(NULL, TW_F32, M, K, TW_MEM_DEVICE);
  size_t ob = (size_t)(M * K) * 4;
  void *oarena;
  cr_assert_eq(tw_alloc(gpu, ob + 2 * GUARD, &oarena), TW_OK);
  cr_assert_eq(tw_memset(gpu, oarena, TW_POISON_BYTE, ob + 2 * GUARD), TW_OK);
  out.data = (char *)oarena + GUARD;
  cr_assert_eq(tw_grouped_dequantize(gpu, &q, &ds, 0, &out), TW_OK, "%s", tw_last_error());
  tt_expect_status(tw_ctx_check(gpu), TW_ERR_DEVICE, want_msg);
  cr_assert(strstr(tw_last_error(), "grouped_dequantize") != NULL, "%s", tw_last_error());
  /* the guards */
  unsigned char *h = malloc(total);
  tw_tensor ha = tw_tensor_1d(h, TW_U8, (int64_t)total, TW_MEM_HOST), da = tw_tensor_1d(arena, TW_U8, (int64_t)total, TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(gpu, &ha, &da), TW_OK);
  size_t start = 0;
  for (int i = 0; i < 5; i++) {
    for (size_t b = start; b < at[i]; b++) cr_assert_eq(h[b], TW_POISON_BYTE, "%s: guard byte %zu before %s written", tw_scaling_name(mode), b, component_names[i]);
    start = at[i] + tw_tensor_bytes(component(&shape, i));
  }
  for (size_t b = start; b < total; b++) cr_assert_eq(h[b], TW_POISON_BYTE, "%s: tail guard byte %zu written", tw_scaling_name(mode), b);
  unsigned char *ho = malloc(ob + 2 * GUARD);
  tw_tensor hoa = tw_tensor_1d(ho, TW_U8, (int64_t)(ob + 2 * GUARD), TW_MEM_HOST), doa = tw_tensor_1d(oarena, TW_U8, (int64_t)(ob + 2 * GUARD), TW_MEM_DEVICE);
  cr_assert_eq(tw_tensor_copy(gpu, &hoa, &doa), TW_OK);
  for (size_t b = 0; b < GUARD; b++) cr_assert(ho[b] == TW_POISON_BYTE && ho[GUARD + ob + b] == TW_POISON_BYTE);
  cr_assert_eq(tw_ctx_check(gpu), TW_OK, "the error word is cleared after a check");
  free(h);
  free(ho);
  free(hx);
  free(hb);
  tw_free(gpu, arena);
  tw_free(gpu, oarena);
  tw_free(gpu, dx.data);
  tw_free(gpu, ds.data);
  tw_free(gpu, dsc.data);
  tw_ctx_destroy(gpu);
}

Test(quantize_gpu, negative_group_size_sets_the_error_word_every_mode) {
  const int32_t sizes[] = {40, -3, 50};
  for (int m = 1; m < TW_SCALE_COUNT; m++)
    bad_sizes_case((tw_scaling)m, sizes, 3, 100, "group_sizes[1] = -3 is negative", NULL, 0);
}

Test(quantize_gpu, sizes_past_the_rows_set_the_error_word_every_mode) {
  const int32_t sizes[] = {60, 150, 30};
  for (int m = 1; m < TW_SCALE_COUNT; m++)
    bad_sizes_case((tw_scaling)m, sizes, 3, 100, "group_sizes sum to 240 but there are 100 rows", NULL, 0);
}

/* the same two on quantize_tile_spec (bf16 x, K = 200): error word set, nothing written */
Test(quantize_gpu, bad_group_sizes_on_tile_spec_set_the_error_word_every_mode) {
  const int32_t negative[] = {40, -3, 50}, past[] = {60, 150, 30};
  for (int m = 1; m < TW_SCALE_COUNT; m++) {
    bad_sizes_case((tw_scaling)m, negative, 3, 100, "group_sizes[1] = -3 is negative", "quantize_tile_spec", 1);
    bad_sizes_case((tw_scaling)m, past, 3, 100, "group_sizes sum to 240 but there are 100 rows", "quantize_tile_spec", 1);
  }
}

/* ---- versions ------------------------------------------------------------------------------ */

Test(quantize_gpu, unknown_or_misaligned_forced_versions_are_errors) {
  tw_ctx *bad = gpu_ctx_named("quantize_nope");
  float x[5 * 5] = {0};
  int32_t sz[1] = {5};
  tw_tensor hx = tw_tensor_2d(x, TW_F32, 5, 5, TW_MEM_HOST), hs = tw_tensor_1d(sz, TW_I32, 1, TW_MEM_HOST);
  tw_tensor dx = to_device(bad, &hx), ds = to_device(bad, &hs);
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  tw_qtensor shape, q;
  cr_assert_eq(tw_quantize_output_shapes(&o, 5, 5, 1, &shape), TW_OK);
  alloc_q(bad, &shape, 1, &q);
  tt_expect_status(tw_grouped_quantize(bad, &dx, &ds, &o, &q), TW_ERR_INVALID_ARG, "no kernel version named 'quantize_nope'");
  free_q(bad, &q);
  tw_free(bad, dx.data);
  tw_free(bad, ds.data);
  tw_ctx_destroy(bad);

  tw_ctx *vec = gpu_ctx_named("quantize_tile_vec");
  dx = to_device(vec, &hx);
  ds = to_device(vec, &hs);
  alloc_q(vec, &shape, 1, &q);
  tt_expect_status(tw_grouped_quantize(vec, &dx, &ds, &o, &q), TW_ERR_UNSUPPORTED, "K = 5");
  free_q(vec, &q);
  tw_free(vec, dx.data);
  tw_free(vec, ds.data);
  tw_ctx_destroy(vec);

  tw_ctx *rows = gpu_ctx_named("quantize_rows");
  dx = to_device(rows, &hx);
  ds = to_device(rows, &hs);
  alloc_q(rows, &shape, 1, &q);
  tt_expect_status(tw_grouped_quantize(rows, &dx, &ds, &o, &q), TW_ERR_UNSUPPORTED, "quantize_rows takes");
  free_q(rows, &q);
  tw_free(rows, dx.data);
  tw_free(rows, ds.data);
  tw_ctx_destroy(rows);

  tw_ctx *spec = gpu_ctx_named("quantize_tile_spec"); /* f32 x, K = 5: not its shape */
  dx = to_device(spec, &hx);
  ds = to_device(spec, &hs);
  alloc_q(spec, &shape, 1, &q);
  tt_expect_status(tw_grouped_quantize(spec, &dx, &ds, &o, &q), TW_ERR_UNSUPPORTED, "quantize_tile_spec takes bf16/f16 x");
  free_q(spec, &q);
  tw_free(spec, dx.data);
  tw_free(spec, ds.data);
  tw_ctx_destroy(spec);

  /* a forced name of another family is not ours to judge */
  tw_ctx *other = gpu_ctx_named("gemm_something");
  dx = to_device(other, &hx);
  ds = to_device(other, &hs);
  alloc_q(other, &shape, 1, &q);
  cr_assert_eq(tw_grouped_quantize(other, &dx, &ds, &o, &q), TW_OK, "%s", tw_last_error());
  cr_assert_eq(tw_ctx_check(other), TW_OK, "%s", tw_last_error());
  free_q(other, &q);
  tw_free(other, dx.data);
  tw_free(other, ds.data);
  tw_ctx_destroy(other);
}
