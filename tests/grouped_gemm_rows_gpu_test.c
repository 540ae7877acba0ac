/* Row-gathered lhs on the gpu (tw_grouped_gemm_rows, tw_grouped_gemm_wgrad_rows; tw_gemm.h):
 * the mma.sync kernels read lhs row x of group g from data row lhs_rows[o_g + x]. Each random
 * case is checked bit for bit against the same kernel version (forced) on the gathered operand
 * L, built on the host (L[i] = lhs[lhs_rows[i]], zeros for -1; 1x128 scales gathered by column;
 * per-tensor: the one scale repeated per group): the same products in the same order, only the
 * addresses differ. The non-gathered kernels are checked against the oracle elsewhere
 * (grouped_gemm_gpu_test); the stored goldens of the row-gathered ops run through `twin check
 * --backend gpu` against NumPy. Versions: gg_mma_wide and gg_mma (fp8 too), gg_fma (f32), and
 * gg_wgmma on sm_90 (bf16 / f16 forward and wgrad, its producer warpgroup gathering A). Then the device error word
 * for an entry outside [-1, U), and the versions that take no gathered lhs refusing by name. */
#include <criterion/criterion.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_gemm.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"

static uint64_t st;
static int64_t irange(int64_t lo, int64_t hi) { return lo + (int64_t)(tt_rand_u64(&st) % (uint64_t)(hi - lo + 1)); }

static tw_ctx *gctx(const char *kernel) {
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  c.backend = TW_BACKEND_GPU;
  c.kernel = kernel;
  tw_ctx *x = NULL;
  cr_assert_eq(tw_ctx_create(&x, &c), TW_OK, "%s", tw_last_error());
  return x;
}

static void *dput(tw_ctx *c, const void *h, size_t n) {
  void *d = NULL;
  cr_assert_eq(tw_alloc(c, n ? n : 16, &d), TW_OK, "%s", tw_last_error());
  if (n) cr_assert_eq(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
  /* a pageable host-to-device cudaMemcpy may return before its DMA lands, and the context's
   * stream does not wait for the legacy stream: finish it before any kernel reads d */
  cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  return d;
}

typedef struct {
  int64_t G, U, M, K, N, S;
  int32_t gs[12];
  int32_t *rows;
  tw_dtype dt, od;
  int q; /* 0 plain, 1 per-tensor e4m3, 2 1x128 e4m3 */
  int acc, wgrad;
} rcase;

static int wg_dims; /* gg_wgmma's operands: bf16 / f16, K and N multiples of 8 */
static void draw(rcase *c, uint64_t seed, int wgrad) {
  st = seed;
  memset(c, 0, sizeof *c);
  c->wgrad = wgrad;
  c->G = irange(1, 9);
  c->U = irange(0, 4) == 0 ? irange(0, 3) : irange(1, 400);
  c->K = wgrad ? irange(1, 200) : irange(0, 3) == 0 ? 128 * irange(1, 3) : irange(1, 300);
  c->N = irange(1, 300);
  for (int g = 0; g < c->G; g++) {
    c->gs[g] = irange(0, 5) == 0 ? 0 : (int32_t)irange(1, 150);
    c->S += c->gs[g];
  }
  c->M = c->S + irange(0, 20);
  c->rows = malloc((size_t)c->M * 4 + 4);
  for (int64_t i = 0; i < c->M; i++)
    c->rows[i] = i >= c->S ? 1 << 30 : (c->U == 0 || irange(0, 7) == 0) ? -1 : (int32_t)irange(0, c->U - 1);
  static const tw_dtype dts[] = {TW_BF16, TW_F16, TW_F32, TW_BF16};
  c->dt = dts[irange(0, 3)];
  c->q = wgrad || c->dt != TW_BF16 ? 0 : (int)irange(0, 2);
  if (c->q) c->dt = TW_E4M3;
  static const tw_dtype ods[] = {TW_F32, TW_BF16, TW_F16};
  c->od = ods[irange(0, 2)];
  c->acc = irange(0, 3) == 0;
  if (wg_dims) {
    c->K = 8 * irange(1, 48);
    c->N = 8 * irange(1, 48);
    c->dt = irange(0, 1) ? TW_BF16 : TW_F16;
    c->q = 0;
  }
}

/* One case: gathered (rows) and explicit L on the same forced kernel; out bytes equal. */
static int run_case(rcase *c, const char *kernel, const char *name) {
  tw_ctx *x = gctx(c->dt == TW_F32 ? "gg_fma" : kernel); /* f32 operands: the exact-FMA version */
  const size_t es = tw_dtype_storage_bytes(c->q ? TW_F32 : c->dt, 1); /* the source is f32 when quantized */
  const int64_t K = c->K, N = c->N, U = c->U, M = c->M, G = c->G;
  float *src = malloc((size_t)(U * K) * 4 + 4);
  tt_fill_uniform_f32(src, U * K, st + 1, -2, 2);
  /* host lhs [U, K] in its dtype; L [M, K] gathered (rows past S: zeros, never read) */
  unsigned char *lh = malloc((size_t)(U * K) * es + 4), *Lh = calloc((size_t)(M * K) * es + 4, 1);
  for (int64_t i = 0; i < U * K; i++) {
    if (c->q || c->dt == TW_F32) ((float *)lh)[i] = src[i];
    else if (c->dt == TW_BF16) ((uint16_t *)lh)[i] = tw_f32_to_bf16(src[i]);
    else ((uint16_t *)lh)[i] = tw_f32_to_f16(src[i]);
  }
  for (int64_t i = 0; i < c->S; i++)
    if (c->rows[i] >= 0) memcpy(Lh + (size_t)(i * K) * es, lh + (size_t)((int64_t)c->rows[i] * K) * es, (size_t)K * es);
  /* rhs: plain [G, K, N] (fwd) / [M, N] (wgrad), or quantized [G*N, K] (fwd, rhs_op T) */
  const int64_t rr = c->wgrad ? M : c->q ? G * N : G * K, rc = c->wgrad ? N : c->q ? K : N;
  float *rsrc = malloc((size_t)(rr * rc) * 4 + 4);
  tt_fill_uniform_f32(rsrc, rr * rc, st + 2, -2, 2);
  const size_t res = tw_dtype_storage_bytes(c->q ? TW_F32 : c->dt, 1);
  unsigned char *rh = malloc((size_t)(rr * rc) * res + 4);
  for (int64_t i = 0; i < rr * rc; i++) {
    if (c->q || c->dt == TW_F32) ((float *)rh)[i] = rsrc[i];
    else if (c->dt == TW_BF16) ((uint16_t *)rh)[i] = tw_f32_to_bf16(rsrc[i]);
    else ((uint16_t *)rh)[i] = tw_f32_to_f16(rsrc[i]);
  }
  tw_operand lop, Lop, rop;
  tw_qtensor ql, qL, qr;
  void *dmem[16];
  int nd = 0;
#define D(h, n) (dmem[nd] = dput(x, (h), (n)), dmem[nd++])
  if (!c->q) {
    tw_tensor tl = tw_tensor_2d(D(lh, (size_t)(U * K) * es), c->dt, U, K, TW_MEM_DEVICE);
    tw_tensor tL = tw_tensor_2d(D(Lh, (size_t)(M * K) * es), c->dt, M, K, TW_MEM_DEVICE);
    tw_tensor tr = c->wgrad ? tw_tensor_2d(D(rh, (size_t)(rr * rc) * res), c->dt, M, N, TW_MEM_DEVICE)
                            : tw_tensor_3d(D(rh, (size_t)(rr * rc) * res), c->dt, G, K, N, TW_MEM_DEVICE);
    lop = tw_operand_plain(&tl);
    Lop = tw_operand_plain(&tL);
    rop = tw_operand_plain(&tr);
  } else {
    /* quantize on the ref backend (host), then device copies of data and scales */
    tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
    o.mode = c->q == 1 ? TW_SCALE_TENSOR_CURRENT : TW_SCALE_BLOCK_1x128;
    o.qdtype = TW_E4M3;
    o.layout = TW_ROWWISE;
    int32_t one = (int32_t)U, gq[12];
    for (int g = 0; g < G; g++) gq[g] = (int32_t)N;
    tw_qtensor *qs[3] = {&ql, &qL, &qr};
    int64_t qrows[3] = {U, M, G * N}, qgroups[3] = {1, G, G};
    const float *qsrc[3] = {src, NULL, rsrc};
    for (int w = 0; w < 3; w++) {
      if (w == 1) continue;
      cr_assert_eq(tw_quantize_output_shapes(&o, qrows[w], K, qgroups[w], qs[w]), TW_OK, "%s", tw_last_error());
      qs[w]->row_data.data = calloc(tw_tensor_bytes(&qs[w]->row_data) + 4, 1);
      qs[w]->row_scale_inv.data = calloc(tw_tensor_bytes(&qs[w]->row_scale_inv) + 4, 1);
      float *amax = calloc((size_t)tw_tensor_numel(&qs[w]->amax) + 4, 4);
      qs[w]->amax.data = amax;
      qs[w]->amax.mem = TW_MEM_HOST;
      tw_tensor xs = tw_tensor_2d((void *)qsrc[w], TW_F32, qrows[w], K, TW_MEM_HOST);
      tw_tensor tg = tw_tensor_1d(w == 0 ? &one : gq, TW_I32, qgroups[w], TW_MEM_HOST);
      cr_assert_eq(tw_grouped_quantize(tt_ref_ctx(), &xs, &tg, &o, qs[w]), TW_OK, "%s", tw_last_error());
      free(amax);
      qs[w]->amax = tw_tensor_none();
    }
    /* L: codes gathered by row; scales per tw_grouped_gemm's lhs quantized by gs (1x128 rowwise:
     * [K/128 blocks, roundup(M, 4)] MN-major, column i = row rows[i]'s; per-tensor: [G] copies) */
    cr_assert_eq(tw_quantize_output_shapes(&o, M, K, G, &qL), TW_OK);
    unsigned char *Lc = calloc((size_t)(M * K) + 4, 1);
    float *Ls = calloc(tw_tensor_numel(&qL.row_scale_inv) + 4, 4);
    const int64_t kb = (K + 127) / 128, lds = ql.row_scale_inv.shape[1], ldL = qL.row_scale_inv.shape[1];
    for (int64_t i = 0; i < c->S; i++) {
      if (c->rows[i] < 0) continue;
      memcpy(Lc + i * K, (unsigned char *)ql.row_data.data + (int64_t)c->rows[i] * K, (size_t)K);
      for (int64_t b = 0; c->q == 2 && b < kb; b++)
        Ls[b * ldL + i] = ((float *)ql.row_scale_inv.data)[b * lds + c->rows[i]];
    }
    for (int64_t g = 0; c->q == 1 && g < G; g++) Ls[g] = ((float *)ql.row_scale_inv.data)[0];
    qL.row_data.data = Lc;
    qL.row_scale_inv.data = Ls;
    for (int w = 0; w < 3; w++) {  /* device copies; the host buffers go */
      void *hd = qs[w]->row_data.data, *hs = qs[w]->row_scale_inv.data;
      qs[w]->row_data.data = D(hd, tw_tensor_bytes(&qs[w]->row_data));
      qs[w]->row_data.mem = TW_MEM_DEVICE;
      qs[w]->row_scale_inv.data = D(hs, tw_tensor_bytes(&qs[w]->row_scale_inv));
      qs[w]->row_scale_inv.mem = TW_MEM_DEVICE;
      free(hd);
      free(hs);
    }
    lop = tw_operand_rowwise(&ql);
    Lop = tw_operand_rowwise(&qL);
    rop = tw_operand_rowwise(&qr);
  }
  tw_tensor drows = tw_tensor_1d(D(c->rows, (size_t)M * 4), TW_I32, M, TW_MEM_DEVICE);
  tw_tensor dgs = tw_tensor_1d(D(c->gs, (size_t)G * 4), TW_I32, G, TW_MEM_DEVICE);
  const int64_t on = c->wgrad ? G * K * N : M * N;
  const size_t ob = tw_dtype_storage_bytes(c->od, on);
  unsigned char *init = malloc(ob + 4), *o1 = malloc(ob + 4), *o2 = malloc(ob + 4);
  for (size_t i = 0; i < ob; i++) init[i] = (unsigned char)(c->acc ? (i * 37 + 11) & 0x3f : 0xA5);
  tw_tensor out1, out2;
  if (c->wgrad) {
    out1 = tw_tensor_3d(D(init, ob), c->od, G, K, N, TW_MEM_DEVICE);
    out2 = tw_tensor_3d(D(init, ob), c->od, G, K, N, TW_MEM_DEVICE);
  } else {
    out1 = tw_tensor_2d(D(init, ob), c->od, M, N, TW_MEM_DEVICE);
    out2 = tw_tensor_2d(D(init, ob), c->od, M, N, TW_MEM_DEVICE);
  }
#undef D
  tw_status s1, s2;
  if (c->wgrad) {
    s1 = tw_grouped_gemm_wgrad_rows(x, &lop, &drows, &rop, TW_OP_N, &dgs, &out1, c->acc);
    s2 = tw_grouped_gemm_wgrad(x, &Lop, TW_OP_N, &rop, TW_OP_N, &dgs, &out2, c->acc);
  } else {
    s1 = tw_grouped_gemm_rows(x, &lop, &drows, &rop, c->q ? TW_OP_T : TW_OP_N, &dgs, &out1, c->acc);
    s2 = tw_grouped_gemm(x, &Lop, &rop, c->q ? TW_OP_T : TW_OP_N, &dgs, &out2, c->acc);
  }
  if (s1 == TW_OK) s1 = tw_ctx_check(x);
  cr_assert_eq(tw_ctx_sync(x), TW_OK); /* the context's stream does not wait for cudaMemcpy's (legacy) stream */
  if (getenv("GG_ROWS_REPEAT") && s1 == TW_OK && s2 == TW_OK) { /* determinism of both calls, for a failing case */
    unsigned char *a = malloc(ob + 4), *b = malloc(ob + 4);
    cr_assert_eq(cudaMemcpy(a, out1.data, ob, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(cudaMemcpy(b, out2.data, ob, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int rep = 0; rep < 4; rep++) {
      cr_assert_eq(cudaMemcpy(out1.data, init, ob, cudaMemcpyHostToDevice), cudaSuccess);
      cr_assert_eq(cudaMemcpy(out2.data, init, ob, cudaMemcpyHostToDevice), cudaSuccess);
      cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
      if (c->wgrad) {
        tw_grouped_gemm_wgrad_rows(x, &lop, &drows, &rop, TW_OP_N, &dgs, &out1, c->acc);
        tw_grouped_gemm_wgrad(x, &Lop, TW_OP_N, &rop, TW_OP_N, &dgs, &out2, c->acc);
      } else {
        tw_grouped_gemm_rows(x, &lop, &drows, &rop, c->q ? TW_OP_T : TW_OP_N, &dgs, &out1, c->acc);
        tw_grouped_gemm(x, &Lop, &rop, c->q ? TW_OP_T : TW_OP_N, &dgs, &out2, c->acc);
      }
      cr_assert_eq(tw_ctx_sync(x), TW_OK);
      cr_assert_eq(cudaMemcpy(o1, out1.data, ob, cudaMemcpyDeviceToHost), cudaSuccess);
      cr_assert_eq(cudaMemcpy(o2, out2.data, ob, cudaMemcpyDeviceToHost), cudaSuccess);
      cr_log_info("%s: repeat %d: rows call %s, plain call %s, rows vs plain %s", name, rep,
                  memcmp(a, o1, ob) ? "CHANGED" : "same", memcmp(b, o2, ob) ? "CHANGED" : "same",
                  memcmp(o1, o2, ob) ? "differ" : "equal");
    }
    free(a);
    free(b);
  }
  int ok = s1 == TW_OK && s2 == TW_OK;
  if (!ok) cr_log_error("%s: statuses %s / %s: %s", name, tw_status_name(s1), tw_status_name(s2), tw_last_error());
  if (ok) {
    cr_assert_eq(cudaMemcpy(o1, out1.data, ob, cudaMemcpyDeviceToHost), cudaSuccess);
    cr_assert_eq(cudaMemcpy(o2, out2.data, ob, cudaMemcpyDeviceToHost), cudaSuccess);
    if (memcmp(o1, o2, ob)) {
      size_t i = 0;
      while (o1[i] == o2[i]) i++;
      cr_log_error("%s: out differs first at byte %zu", name, i);
      ok = 0;
    }
  }
  tw_ctx_sync(x);
  for (int i = 0; i < nd; i++) tw_free(x, dmem[i]);
  tw_ctx_destroy(x);
  free(src); free(lh); free(Lh); free(rsrc); free(rh); free(init); free(o1); free(o2);
  return ok;
}

static void sweep(const char *kernel, int wgrad, int N, uint64_t base) {
  int failed = 0, q = 0, zero_u = 0;
  const char *only = getenv("GG_ROWS_ONLY"); /* one case by index (with GG_ROWS_REPEAT: its determinism) */
  for (int i = only ? atoi(only) : 0; i < (only ? atoi(only) + 1 : N); i++) {
    rcase c;
    draw(&c, base + (uint64_t)i, wgrad);
    char name[200];
    snprintf(name, sizeof name, "%s %s case %d (G=%lld U=%lld M=%lld S=%lld K=%lld N=%lld %s q%d out %s acc %d)",
             kernel, wgrad ? "wgrad" : "fwd", i, (long long)c.G, (long long)c.U, (long long)c.M, (long long)c.S,
             (long long)c.K, (long long)c.N, tw_dtype_name(c.dt), c.q, tw_dtype_name(c.od), c.acc);
    failed += !run_case(&c, kernel, name);
    q += c.q > 0;
    zero_u += c.U == 0;
    free(c.rows);
  }
  cr_log_info("grouped_gemm%s_rows on %s (gg_fma for f32): %d cases (%d fp8, %d with U = 0), %d differ from the "
              "gathered operand", wgrad ? "_wgrad" : "", kernel, N, q, zero_u, failed);
  cr_assert_eq(failed, 0, "%d of %d cases differ", failed, N);
}

static int nrows(void) { return getenv("GG_ROWS_N") ? atoi(getenv("GG_ROWS_N")) : 200; }
/* gg_wgmma runs on sm_90 only: skip elsewhere, saying so */
#define NEED_SM90()                                                                                      \
  do {                                                                                                   \
    int dev_ = 0, major_ = 0, minor_ = 0;                                                                \
    cudaGetDevice(&dev_);                                                                                \
    cudaDeviceGetAttribute(&major_, cudaDevAttrComputeCapabilityMajor, dev_);                            \
    cudaDeviceGetAttribute(&minor_, cudaDevAttrComputeCapabilityMinor, dev_);                            \
    if (major_ != 9 || minor_ != 0) cr_skip_test("gg_wgmma needs an sm_90 device, this is sm_%d%d", major_, minor_); \
  } while (0)

/* gg_wgmma: its producer warpgroup gathers the A rows (128 threads, a row each, stored in the
 * 128-byte swizzle); the same bits as gg_wgmma on the gathered operand (A by TMA) */
Test(grouped_gemm_rows_gpu, forward_gg_wgmma, .timeout = 600) {
  NEED_SM90();
  wg_dims = 1;
  sweep("gg_wgmma", 0, nrows(), 0x7a300000u);
  wg_dims = 0;
}
/* gg_wgmma's wgrad: its producer warpgroup copies the gathered token rows of both A boxes */
Test(grouped_gemm_rows_gpu, wgrad_gg_wgmma, .timeout = 600) {
  NEED_SM90();
  wg_dims = 1;
  sweep("gg_wgmma", 1, nrows(), 0x7a400000u);
  wg_dims = 0;
}
Test(grouped_gemm_rows_gpu, forward_gg_mma_wide, .timeout = 600) { sweep("gg_mma_wide", 0, nrows(), 0x7a000000u); }
Test(grouped_gemm_rows_gpu, forward_gg_mma, .timeout = 600) { sweep("gg_mma", 0, nrows() / 2, 0x7a100000u); }
Test(grouped_gemm_rows_gpu, wgrad_gg_mma_wide, .timeout = 600) { sweep("gg_mma_wide", 1, nrows(), 0x7a200000u); }

/* An entry outside [-1, U) sets the error word (the call itself enqueues fine), and the versions
 * without a gathered loader refuse by name before any work. */
Test(grouped_gemm_rows_gpu, bad_entry_and_unsupported_versions) {
  tw_ctx *x = gctx(NULL);
  static uint16_t l[4 * 8], r[2 * 8 * 8];
  int32_t rows[5] = {0, 3, -1, 4, 1}, gs[2] = {3, 2};
  tw_tensor tl = tw_tensor_2d(dput(x, l, sizeof l), TW_BF16, 4, 8, TW_MEM_DEVICE);
  tw_tensor tr = tw_tensor_3d(dput(x, r, sizeof r), TW_BF16, 2, 8, 8, TW_MEM_DEVICE);
  tw_tensor trows = tw_tensor_1d(dput(x, rows, sizeof rows), TW_I32, 5, TW_MEM_DEVICE);
  tw_tensor tgs = tw_tensor_1d(dput(x, gs, sizeof gs), TW_I32, 2, TW_MEM_DEVICE);
  void *ob = NULL;
  cr_assert_eq(tw_alloc(x, 5 * 8 * 4, &ob), TW_OK);
  tw_tensor out = tw_tensor_2d(ob, TW_F32, 5, 8, TW_MEM_DEVICE);
  tw_operand lo = tw_operand_plain(&tl), ro = tw_operand_plain(&tr);
  cr_expect_eq(tw_grouped_gemm_rows(x, &lo, &trows, &ro, TW_OP_N, &tgs, &out, 0), TW_OK, "%s", tw_last_error());
  tt_expect_status(tw_ctx_check(x), TW_ERR_DEVICE, "lhs_rows[3] = 4 is outside [-1, U)");
  cr_expect_eq(tw_ctx_check(x), TW_OK, "the error word is cleared once reported");
  const char *ks[] = {"gg_wgmma_fp8", "gg_lt_loop"};
  for (int i = 0; i < 2; i++) {
    tw_ctx *y = gctx(ks[i]);
    char want[96];
    snprintf(want, sizeof want, "kernel '%s' takes no row-gathered lhs", ks[i]);
    tt_expect_status(tw_grouped_gemm_rows(y, &lo, &trows, &ro, TW_OP_N, &tgs, &out, 0), TW_ERR_UNSUPPORTED, want);
    tw_ctx_destroy(y);
  }
  /* gg_wgmma forced on a wgrad it cannot take (K = 6: TMA needs 16-byte rows) says why, before any work */
  {
    tw_ctx *y = gctx("gg_wgmma");
    static uint16_t l6[4 * 6], dy[5 * 8];
    tw_tensor t6 = tw_tensor_2d(dput(y, l6, sizeof l6), TW_BF16, 4, 6, TW_MEM_DEVICE);
    tw_tensor tdy = tw_tensor_2d(dput(y, dy, sizeof dy), TW_BF16, 5, 8, TW_MEM_DEVICE);
    void *wb = NULL;
    cr_assert_eq(tw_alloc(y, 2 * 6 * 8 * 4, &wb), TW_OK);
    tw_tensor tw = tw_tensor_3d(wb, TW_F32, 2, 6, 8, TW_MEM_DEVICE);
    tw_operand l6o = tw_operand_plain(&t6), dyo = tw_operand_plain(&tdy);
    tt_expect_status(tw_grouped_gemm_wgrad_rows(y, &l6o, &trows, &dyo, TW_OP_N, &tgs, &tw, 0), TW_ERR_UNSUPPORTED,
                     "kernel 'gg_wgmma'");
    tw_ctx_sync(y);
    tw_ctx_destroy(y);
  }
  tw_ctx_sync(x);
  tw_ctx_destroy(x);
}

/* Timing aid (GG_ROWS_TIME=1, skipped otherwise): one MoE-sized forward and wgrad, a kernel reading the
 * gathered rows against the same kernel on the expanded operand, medians of 10 calls (kernel
 * GG_ROWS_TIME_KERNEL, default gg_wgmma).
 * Shape: G 32 experts, 512 rows each (S 16384: 2048 tokens x top-8), U 4096 source rows, K 7168,
 * N 4096 (the wi GEMM of H 7168, F 2048), bf16 in and out. */
Test(grouped_gemm_rows_gpu, timing_moe_shape, .timeout = 300) {
  if (!getenv("GG_ROWS_TIME")) cr_skip_test("timing aid: set GG_ROWS_TIME=1");
  const int64_t G = 32, m = 512, S = G * m, U = 4096, K = 7168, N = 4096;
  cudaStream_t stream;
  cr_assert_eq(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.kernel = getenv("GG_ROWS_TIME_KERNEL") ? getenv("GG_ROWS_TIME_KERNEL") : "gg_wgmma";
  cc.stream = stream;
  tw_ctx *x = NULL;
  cr_assert_eq(tw_ctx_create(&x, &cc), TW_OK, "%s", tw_last_error());
  void *l, *L, *r, *o, *rw, *gsd;
  cr_assert_eq(tw_alloc(x, (size_t)(U * K) * 2, &l), TW_OK);
  cr_assert_eq(tw_alloc(x, (size_t)(S * K) * 2, &L), TW_OK);
  cr_assert_eq(tw_alloc(x, (size_t)(G * K * N) * 2, &r), TW_OK);
  cr_assert_eq(tw_alloc(x, (size_t)(S * N) * 2, &o), TW_OK);
  int32_t *rows = malloc((size_t)S * 4), gs[32];
  st = 99;
  for (int64_t i = 0; i < S; i++) rows[i] = (int32_t)irange(0, U - 1);
  for (int g = 0; g < G; g++) gs[g] = (int32_t)m;
  rw = dput(x, rows, (size_t)S * 4);
  gsd = dput(x, gs, sizeof gs);
  cudaMemset(l, 0x3c, (size_t)(U * K) * 2);
  cudaMemset(L, 0x3c, (size_t)(S * K) * 2);
  cudaMemset(r, 0x3c, (size_t)(G * K * N) * 2);
  cudaDeviceSynchronize();
  tw_tensor tl = tw_tensor_2d(l, TW_BF16, U, K, TW_MEM_DEVICE), tL = tw_tensor_2d(L, TW_BF16, S, K, TW_MEM_DEVICE);
  tw_tensor tr = tw_tensor_3d(r, TW_BF16, G, K, N, TW_MEM_DEVICE), to = tw_tensor_2d(o, TW_BF16, S, N, TW_MEM_DEVICE);
  tw_tensor trows = tw_tensor_1d(rw, TW_I32, S, TW_MEM_DEVICE), tgs = tw_tensor_1d(gsd, TW_I32, G, TW_MEM_DEVICE);
  tw_operand lo = tw_operand_plain(&tl), Lo = tw_operand_plain(&tL), ro = tw_operand_plain(&tr);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  /* the wgrad of the same shape: d_w [G, K, N] = gathered lhs^T [S, N] (o as its rhs, r as out) */
  tw_tensor tdy = tw_tensor_2d(o, TW_BF16, S, N, TW_MEM_DEVICE), tdw = tw_tensor_3d(r, TW_BF16, G, K, N, TW_MEM_DEVICE);
  tw_operand dyo = tw_operand_plain(&tdy);
  for (int way = 0; way < 4; way++) {
    float ms[10];
    const int wg = way >= 2, gathered = way & 1;
    for (int it = -2; it < 10; it++) {
      cudaEventRecord(e0, stream);
      tw_status s = wg ? (gathered ? tw_grouped_gemm_wgrad_rows(x, &lo, &trows, &dyo, TW_OP_N, &tgs, &tdw, 0)
                                   : tw_grouped_gemm_wgrad(x, &Lo, TW_OP_N, &dyo, TW_OP_N, &tgs, &tdw, 0))
                    : gathered ? tw_grouped_gemm_rows(x, &lo, &trows, &ro, TW_OP_N, &tgs, &to, 0)
                               : tw_grouped_gemm(x, &Lo, &ro, TW_OP_N, &tgs, &to, 0);
      cr_assert_eq(s, TW_OK, "%s", tw_last_error());
      cudaEventRecord(e1, stream);
      cudaEventSynchronize(e1);
      if (it >= 0) cudaEventElapsedTime(&ms[it], e0, e1);
    }
    for (int i = 0; i < 10; i++)
      for (int j = i + 1; j < 10; j++)
        if (ms[j] < ms[i]) { float t = ms[i]; ms[i] = ms[j]; ms[j] = t; }
    const double med = 0.5 * (ms[4] + ms[5]);
    cr_log_info("%s %s G %lld x m %lld, K %lld, N %lld, bf16: %s %.3f ms, %.0f TFLOP/s", cc.kernel,
                wg ? "wgrad" : "forward", (long long)G, (long long)m, (long long)K, (long long)N,
                gathered ? "rows gathered" : "expanded rows", med, 2.0 * S * K * N / (med * 1e9));
  }
  tw_ctx_sync(x);
  tw_free(x, l); tw_free(x, L); tw_free(x, r); tw_free(x, o); tw_free(x, rw); tw_free(x, gsd);
  free(rows);
  tw_ctx_destroy(x);
  cudaStreamDestroy(stream);
}
