/* `twin bench --backend gpu --op quantize`: the CUDA grouped quantizer per mode and layout on
 * large inputs (bf16 [32768, 7168]; G = 1, 8, 128 equal groups), timed with CUDA events on the
 * context's stream (median of cfg->iters after cfg->warmup). Floor: the bytes an ideal kernel
 * moves (x read once, every output written once) over the device-to-device copy bandwidth
 * measured in the same run. Peer: torch.compile'd per-tensor current-scaling quantize, read
 * from --peers FILE (tools/peers/torch_quantize.py prints it: one torch.compile'd function per
 * mode and layout) next to the G = 1 rows, and current scaling per group next to G = 8;
 * ratio = peer_ms / ours (> 1: twin is faster). */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"
#include "ops/bench.h"
#include "tools/bench_gpu.h"
#include "twin/tw_quantize.h"

#define BQ_M 32768
#define BQ_K 7168

static int cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 1;
  fprintf(stderr, "bench quantize: %s: %s\n", what, cudaGetErrorString(e));
  return 0;
}

typedef struct {
  void *dst;
  const void *src;
  size_t bytes;
  cudaStream_t s;
} copy_arg;
static int run_copy(void *p) {
  copy_arg *c = p;
  return !cuda_ok(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, c->s), "copy");
}

typedef struct {
  tw_ctx *ctx;
  tw_tensor *x, *gs;
  tw_quantize_opts *o;
  tw_qtensor *q;
} q_arg;
static int run_q(void *p) {
  q_arg *a = p;
  tw_status s = tw_grouped_quantize(a->ctx, a->x, a->gs, a->o, a->q);
  if (s != TW_OK) fprintf(stderr, "bench quantize: %s\n", tw_last_error());
  return s != TW_OK;
}

/* "ms" of the first peer entry whose "name" contains `key`, or -1. The file is the small
 * JSON list tools/peers/torch_quantize.py prints: [{"name": ..., "ms": ...}, ...]. */
static double peer_ms(const char *path, const char *key, char *name_out, size_t n) {
  if (!path) return -1;
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  static char buf[1 << 16];
  size_t len = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[len] = 0;
  for (char *p = strstr(buf, "\"name\""); p; p = strstr(p + 1, "\"name\"")) {
    char *q1 = strchr(p + 6, '"'), *q2 = q1 ? strchr(q1 + 1, '"') : NULL;
    if (!q2) break;
    if ((size_t)(q2 - q1 - 1) < n && strstr(q1, key) && strstr(q1, key) < q2) {
      char *m = strstr(q2, "\"ms\"");
      if (!m) break;
      m = strchr(m, ':');
      if (!m) break;
      snprintf(name_out, n, "%.*s", (int)(q2 - q1 - 1), q1 + 1);
      return atof(m + 1);
    }
  }
  return -1;
}

int tw_bench_gpu_quantize(const tw_bench_cfg *cfg) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  if (tw_ctx_create(&ctx, &cc) != TW_OK) {
    fprintf(stderr, "bench quantize: %s\n", tw_last_error());
    return 1;
  }
  tw_ctx *tile_ctx = NULL, *async_ctx = NULL, *spec_ctx = NULL, *rows_ctx = NULL; /* forced, at G = 8 */
  cc.kernel = "quantize_tile_vec";
  if (tw_ctx_create(&tile_ctx, &cc) != TW_OK) {
    fprintf(stderr, "bench quantize: %s\n", tw_last_error());
    tw_ctx_destroy(ctx);
    return 1;
  }
  cc.kernel = "quantize_tile_spec";
  if (tw_ctx_create(&spec_ctx, &cc) != TW_OK || (cc.kernel = "quantize_rows", tw_ctx_create(&rows_ctx, &cc)) != TW_OK) {
    fprintf(stderr, "bench quantize: %s\n", tw_last_error());
    tw_ctx_destroy(spec_ctx);
    tw_ctx_destroy(tile_ctx);
    tw_ctx_destroy(ctx);
    return 1;
  }
  cc.kernel = "quantize_tile_async";
  if (tw_ctx_create(&async_ctx, &cc) != TW_OK) {
    fprintf(stderr, "bench quantize: %s\n", tw_last_error());
    tw_ctx_destroy(tile_ctx);
    tw_ctx_destroy(ctx);
    return 1;
  }
  cudaStream_t s = gpu_of(ctx)->stream;
  const int64_t M = BQ_M, K = BQ_K, n = M * K;
  int rc = 0;
  uint16_t *hx = malloc((size_t)n * 2);
  uint64_t st = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < n; i++) { /* random bf16 in about [-8, 8], row scale varies */
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t r = (uint32_t)(st >> 33);
    hx[i] = (uint16_t)((r & 0x8000u) | (uint16_t)(0x3C00u + (r % 0x0600u)));
  }
  void *dx = NULL, *dx32 = NULL, *dcopy = NULL, *drow = NULL, *dcol = NULL, *drs = NULL, *dcs = NULL, *dam = NULL, *dgs = NULL,
       *dsc = NULL;
  size_t scale_bytes = 64u << 20;
  if (!cuda_ok(cudaMalloc(&dx, (size_t)n * 2), "malloc x") || !cuda_ok(cudaMalloc(&dcopy, (size_t)n * 2), "malloc copy") ||
      !cuda_ok(cudaMalloc(&drow, (size_t)n), "malloc row") || !cuda_ok(cudaMalloc(&dcol, (size_t)n), "malloc col") ||
      !cuda_ok(cudaMalloc(&drs, scale_bytes), "malloc scales") || !cuda_ok(cudaMalloc(&dcs, scale_bytes), "malloc scales") ||
      !cuda_ok(cudaMalloc(&dam, 4096), "malloc amax") || !cuda_ok(cudaMalloc(&dgs, 4096), "malloc sizes") ||
      !cuda_ok(cudaMalloc(&dsc, 4096), "malloc scale") ||
      !cuda_ok(cudaMemcpy(dx, hx, (size_t)n * 2, cudaMemcpyHostToDevice), "copy x")) {
    rc = 1;
    goto done;
  }
  int iters = cfg->iters > 0 ? cfg->iters : 10, warmup = cfg->warmup > 0 ? cfg->warmup : 1;

  /* the ceiling: a device-to-device copy of x, bytes read + written */
  copy_arg ca = {dcopy, dx, (size_t)n * 2, s};
  double copy_ms = tw_bench_gpu_time(s, warmup, iters, run_copy, &ca);
  double copy_gbs = 2.0 * (double)n * 2 / (copy_ms * 1e6);
  tw_bench_row cr = {0};
  cr.op = "copy";
  snprintf(cr.shape, sizeof cr.shape, "%lld bytes d2d", (long long)n * 2);
  cr.backend = "gpu";
  snprintf(cr.version, sizeof cr.version, "cudaMemcpy");
  cr.ms = copy_ms;
  cr.rate = copy_gbs;
  cr.bytes = 2.0 * (double)n * 2;
  cr.unit = "GB/s";
  cr.pct_of_floor = 100.0;
  cr.peer_ms = cr.ratio = -1;
  tw_bench_print_row(&cr, cfg->csv);

  char peer_name[48] = "";
  static const int64_t Gs[] = {1, 8, 128};
  static const tw_scaling modes[] = {TW_SCALE_TENSOR_CURRENT, TW_SCALE_TENSOR_DELAYED, TW_SCALE_MXFP8_1D,
                                     TW_SCALE_BLOCK_1x128, TW_SCALE_BLOCK_128x128};
  /* bf16 x at G = 1, 8, 128 (every version at G = 8), then f32 x at G = 8 (auto only: the
   * versions for 32-bit x are tile_vec and rows), then bf16 at G = 32 ragged (auto only: sizes
   * M/32 -+ 7 alternating, as routed tokens fall: no group starts on a 16-row bound, so the
   * transposed colwise rows are unaligned) */
  for (int gi = 0; gi < 5; gi++) {
    const int f32 = gi == 3, ragged = gi == 4;
    int64_t G = f32 ? 8 : ragged ? 32 : Gs[gi];
    if (f32) {
      float *h32 = malloc((size_t)n * 4);
      int ok = h32 && cuda_ok(cudaMalloc(&dx32, (size_t)n * 4), "malloc f32 x");
      for (int64_t i = 0; ok && i < n; i++) {
        uint32_t b = (uint32_t)hx[i] << 16;
        memcpy(&h32[i], &b, 4);
      }
      ok = ok && cuda_ok(cudaMemcpy(dx32, h32, (size_t)n * 4, cudaMemcpyHostToDevice), "copy f32 x");
      free(h32);
      if (!ok) { rc = 1; goto done; }
    }
    int32_t sizes[128];
    float ones[128];
    for (int64_t g = 0; g < G; g++) {
      sizes[g] = (int32_t)(M / G) + (ragged ? (g % 2 ? 7 : -7) : 0);
      ones[g] = 1.0f;
    }
    cudaMemcpy(dgs, sizes, sizeof(int32_t) * (size_t)G, cudaMemcpyHostToDevice);
    cudaMemcpy(dsc, ones, sizeof(float) * (size_t)G, cudaMemcpyHostToDevice);
    tw_tensor x = tw_tensor_2d(f32 ? dx32 : dx, f32 ? TW_F32 : TW_BF16, M, K, TW_MEM_DEVICE), gs = tw_tensor_1d(dgs, TW_I32, G, TW_MEM_DEVICE);
    for (int mi = 0; mi < 5; mi++)
      for (int lay = TW_ROWWISE; lay <= TW_ROWWISE_COLWISE; lay += 2) {
        tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
        o.mode = modes[mi];
        o.layout = (tw_qlayout)lay;
        o.scale = tw_tensor_1d(dsc, TW_F32, G, TW_MEM_DEVICE);
        tw_qtensor q;
        if (tw_quantize_output_shapes(&o, M, K, G, &q) != TW_OK) { rc = 1; goto done; }
        size_t written = 0;
        tw_tensor *parts[5] = {&q.row_data, &q.row_scale_inv, &q.col_data, &q.col_scale_inv, &q.amax};
        void *bufs[5] = {drow, drs, dcol, dcs, dam};
        if (o.mode <= TW_SCALE_TENSOR_DELAYED) q.col_scale_inv = tw_tensor_none();
        for (int i = 0; i < 5; i++) {
          if (tw_tensor_is_none(parts[i])) continue;
          parts[i]->data = bufs[i];
          parts[i]->mem = TW_MEM_DEVICE;
          if (tw_tensor_bytes(parts[i]) > scale_bytes && i != 0 && i != 2) { rc = 1; goto done; }
          written += tw_tensor_bytes(parts[i]);
        }
        /* auto runs the row kernel on tensor scaling's rowwise-only output, the specialized tile
         * kernel on the rest of these bf16 shapes */
        int row_kernel = lay == TW_ROWWISE && (f32 ? o.mode != TW_SCALE_BLOCK_128x128 : o.mode <= TW_SCALE_TENSOR_DELAYED);
        /* auto first (named after the kernel it picks for these bf16 shapes), then at G = 8
         * every other version that takes the layout */
        tw_ctx *vctxs[5] = {ctx, tile_ctx, async_ctx, spec_ctx, rows_ctx};
        const char *vnames[5] = {row_kernel ? "rows" : f32 ? "tile_vec" : "tile_spec", "tile_vec", "tile_async", "tile_spec", "rows"};
        for (int ver = 0; ver < (G == 8 && !f32 ? 5 : 1); ver++) {
        if (ver > 0 && !strcmp(vnames[ver], vnames[0])) continue;
        if (ver == 4 && !(lay == TW_ROWWISE && o.mode != TW_SCALE_BLOCK_128x128)) continue;
        tw_ctx *vctx = vctxs[ver];
        q_arg qa = {vctx, &x, &gs, &o, &q};
        double ms = tw_bench_gpu_time(gpu_of(vctx)->stream, warmup, iters, run_q, &qa);
        if (ms < 0 || tw_ctx_check(vctx) != TW_OK) {
          fprintf(stderr, "bench quantize: %s\n", tw_last_error());
          rc = 1;
          goto done;
        }
        double bytes = (double)n * (f32 ? 4 : 2) + (double)written;
        tw_bench_row r = {0};
        r.op = "quantize";
        snprintf(r.shape, sizeof r.shape, "%s %s G=%lld%s %lldx%lld %s", tw_scaling_name(o.mode),
                 lay == TW_ROWWISE ? "row" : "row+col", (long long)G, ragged ? " ragged" : "", (long long)M, (long long)K,
                 f32 ? "f32" : "bf16");
        r.backend = "gpu";
        snprintf(r.version, sizeof r.version, "%s", vnames[ver]);
        r.ms = ms;
        r.rate = bytes / (ms * 1e6);
        r.bytes = bytes;
        r.unit = "GB/s";
        r.pct_of_floor = 100.0 * r.rate / copy_gbs;
        r.peer_ms = r.ratio = -1;
        if (ver == 0 && !f32 && (G == 1 || (G == 8 && o.mode == TW_SCALE_TENSOR_CURRENT && lay == TW_ROWWISE))) {
          /* the torch.compile'd peer of this mode and layout (G = 1), or current scaling per group */
          char key[64];
          snprintf(key, sizeof key, "compile %s %s %s", tw_scaling_name(o.mode), lay == TW_ROWWISE ? "row" : "row+col",
                   G == 1 ? "e4m3" : "G=8");
          double pm = peer_ms(cfg->peers_json, key, peer_name, sizeof peer_name);
          if (pm > 0) {
            snprintf(r.peer, sizeof r.peer, "%s", peer_name);
            r.peer_ms = pm;
            r.ratio = pm / ms;
          }
        }
        tw_bench_print_row(&r, cfg->csv);
        }
      }
  }
done:
  free(hx);
  cudaFree(dx);
  cudaFree(dx32);
  cudaFree(dcopy);
  cudaFree(drow);
  cudaFree(dcol);
  cudaFree(drs);
  cudaFree(dcs);
  cudaFree(dam);
  cudaFree(dgs);
  cudaFree(dsc);
  tw_ctx_destroy(async_ctx);
  tw_ctx_destroy(spec_ctx);
  tw_ctx_destroy(rows_ctx);
  tw_ctx_destroy(tile_ctx);
  tw_ctx_destroy(ctx);
  return rc;
}
