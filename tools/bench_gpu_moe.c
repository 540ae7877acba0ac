/* `twin bench --backend gpu --op moe`: the MoE block (tw_moe.h) forward + backward on one GPU
 * (a one-rank NCCL communicator), bf16, H 7168, F 2048, k 8, SwiGLU, late weighting, aux loss,
 * E 32 at 4096 and 16384 tokens and E 256 at 4096. d_wi and d_wo are bf16, as the peer's
 * (tw_moe.h: the f32 gradients rounded once); TWIN_BENCH_MOE_GRADS=f32 asks for f32 ones (the
 * rows then say "dW f32"). Rate: the six expert GEMMs' FLOPs (18 T k H F) over the fwd + bwd time.
 * Peer: the same block in PyTorch (tools/peers/torch_moe.py: torch.topk router, experts by
 * torch._grouped_mm, autograd backward), timed in the same call and read from --peers. Below
 * each row, the breakdown by step (CUDA events between the block's steps, one extra run).
 * The fp8 recipes (fp8_current, fp8_block, fp8_mxfp8: bf16 tensors, e4m3 expert GEMMs) run the
 * same shapes; their peer is the same bf16 torch block (issue 14's target: 1.3x it in fp8), and a
 * second row each with the weights' fp8 copies reused across steps (tw_moe_set_weight_reuse:
 * later microbatches of one optimizer step); fp8_current and fp8_block then again with the
 * experts' slabs padded to 16 rows ("A=16", tw_moe_config.alignment, as TransformerEngine pads
 * fp8 expert counts). TWIN_BENCH_MOE_STEPS=1 adds each step's time below the breakdown.
 * --ep n (cfg->moe_ep) instead runs the block with ep = n over n GPUs (NCCL,
 * one thread per GPU), T = 4096 tokens per GPU, E 32 and 256, bf16, fp8_current and fp8_block,
 * against the same one-GPU torch block per GPU (bench_moe_ep). */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/elementwise.h"
#include "ops/bench.h"
#include "ops/data.h"
#include "tools/bench_gpu.h"
#include "twin/tw_comm.h"
#include "twin/tw_moe.h"

static cudaStream_t stream;
static tw_dtype grad_dt = TW_BF16; /* d_wi, d_wo (TWIN_BENCH_MOE_GRADS=f32: f32) */

/* random bf16 in +-[2^-8, 2^0) times 2^shift (shift <= 0) through a host chunk */
static int fill_bf16(void *d, int64_t n, int shift, uint64_t *rs) {
  enum { CH = 1 << 22 };
  static uint16_t host[CH];
  for (int64_t i = 0; i < CH; ++i) {
    uint64_t r = tw_splitmix64(rs);
    host[i] = (uint16_t)(((r & 1) << 15) | ((uint64_t)(119 + shift + (r >> 1) % 8) << 7) | ((r >> 8) & 0x7F));
  }
  for (int64_t off = 0; off < n; off += CH) {
    int64_t k = n - off < CH ? n - off : CH;
    if (cudaMemcpy((uint16_t *)d + off, host, (size_t)k * 2, cudaMemcpyHostToDevice) != cudaSuccess) return -1;
  }
  return 0;
}

typedef struct {
  tw_moe *m;
  tw_tensor x, out, d_out, d_x, aux;
  tw_moe_weights w;
  tw_moe_grads g;
} job;

static int fwd_bwd(void *arg) {
  job *j = (job *)arg;
  if (tw_moe_forward(j->m, &j->x, &j->w, &j->out, &j->aux) != TW_OK) return 1;
  return tw_moe_backward(j->m, &j->x, &j->w, &j->d_out, 1.0f, &j->d_x, &j->g) != TW_OK;
}

/* step timer: an event before each step */
enum { MAX_MARKS = 96 };
typedef struct {
  cudaEvent_t ev[MAX_MARKS];
  const char *name[MAX_MARKS];
  int n;
} marks;
static void on_step(void *arg, const char *name) {
  marks *mk = (marks *)arg;
  if (mk->n >= MAX_MARKS) return;
  cudaEventRecord(mk->ev[mk->n], stream);
  mk->name[mk->n++] = name;
}

static const char *category(const char *s) {
  if (strstr(s, "GEMM") || strstr(s, "grad gate") || strstr(s, "grad w")) return "GEMMs";
  if (strstr(s, "aux")) return "aux loss";
  if (strstr(s, "quantize")) return "quantize";
  if (strstr(s, "router")) return "router";
  if (strstr(s, "dispatch")) return "dispatch";
  if (strstr(s, "combine")) return "combine";
  if (strstr(s, "activation") || strstr(s, "bias")) return "activation";
  return "other";
}

static void *dalloc(tw_ctx *ctx, size_t bytes, int *ok) {
  void *p = NULL;
  if (*ok && tw_alloc(ctx, bytes, &p) != TW_OK) *ok = 0;
  return p;
}

/* The block's bf16 tensors and weight gradients (grad_dt) in device memory: T tokens, E experts
 * routed (the gate's width), nle of them held here (wi, wo and their gradients). */
static void job_alloc(tw_ctx *ctx, job *j, int64_t E, int64_t nle, int64_t T, int64_t H, int64_t F, void **bufs,
                      int *nb, int *ok) {
  tw_mem D = TW_MEM_DEVICE;
#define A(bytes) (bufs[(*nb)++] = dalloc(ctx, (bytes), ok))
  j->x = tw_tensor_2d(A((size_t)(T * H * 2)), TW_BF16, T, H, D);
  j->out = tw_tensor_2d(A((size_t)(T * H * 2)), TW_BF16, T, H, D);
  j->d_out = tw_tensor_2d(A((size_t)(T * H * 2)), TW_BF16, T, H, D);
  j->d_x = tw_tensor_2d(A((size_t)(T * H * 2)), TW_BF16, T, H, D);
  j->aux = tw_tensor_1d(A(4), TW_F32, 1, D);
  j->w.gate = tw_tensor_2d(A((size_t)(H * E * 2)), TW_BF16, H, E, D);
  j->w.wi = tw_tensor_3d(A((size_t)(nle * H * 2 * F * 2)), TW_BF16, nle, H, 2 * F, D);
  j->w.wo = tw_tensor_3d(A((size_t)(nle * F * H * 2)), TW_BF16, nle, F, H, D);
  j->w.bi = j->w.bo = tw_tensor_none();
  j->g.gate = tw_tensor_2d(A((size_t)(H * E * 4)), TW_F32, H, E, D);
  const size_t gb = (size_t)tw_dtype_bits(grad_dt) / 8;
  j->g.wi = tw_tensor_3d(A((size_t)(nle * H * 2 * F) * gb), grad_dt, nle, H, 2 * F, D);
  j->g.wo = tw_tensor_3d(A((size_t)(nle * F * H) * gb), grad_dt, nle, F, H, D);
  j->g.bi = j->g.bo = tw_tensor_none();
#undef A
}

static void bench_shape(tw_ctx *ctx, int E, int64_t T, tw_moe_recipe recipe, int64_t align, const char *peers,
                        const tw_bench_cfg *cfg) {
  const int64_t H = 7168, F = 2048;
  const int K = 8;
  tw_moe_config c = TW_MOE_CONFIG_INIT;
  c.num_experts = E; c.hidden = H; c.ffn = F; c.router.topk = K; c.recipe = recipe;
  c.aux_coeff = 0.01f; c.max_tokens = T; c.global_tokens = T; c.alignment = align;
  char shape[96], key[64], at[32] = "";
  if (align > 1) snprintf(at, sizeof at, " A=%lld", (long long)align);
  if (grad_dt == TW_F32) snprintf(at + strlen(at), sizeof at - strlen(at), " dW f32");
  snprintf(shape, sizeof shape, "E=%d T=%lld H=%lld F=%lld k=%d %s%s", E, (long long)T, (long long)H, (long long)F, K,
           tw_moe_recipe_name(recipe), at);
  snprintf(key, sizeof key, "moe_E%d_T%lld", E, (long long)T);
  /* profiling (ncu): TWIN_BENCH_ONLY=<part of the shape> runs only the shapes holding it */
  const char *only = getenv("TWIN_BENCH_ONLY");
  if (only && !strstr(shape, only)) return;
  job j;
  memset(&j, 0, sizeof j);
  int ok = 1;
  void *bufs[16];
  int nb = 0;
  if (tw_moe_create(ctx, NULL, &c, &j.m) != TW_OK) ok = 0;
  job_alloc(ctx, &j, E, E, T, H, F, bufs, &nb, &ok);
  uint64_t rs = 0x6d6f65ull + (uint64_t)E * 131 + (uint64_t)T;
  if (ok) ok = !fill_bf16(j.x.data, T * H, 0, &rs) && !fill_bf16(j.d_out.data, T * H, 0, &rs) &&
               !fill_bf16(j.w.gate.data, H * E, -6, &rs) && !fill_bf16(j.w.wi.data, E * H * 2 * F, -6, &rs) &&
               !fill_bf16(j.w.wo.data, E * F * H, -5, &rs);
  /* fp8 recipes: a second row with the weights' fp8 copies reused (tw_moe_set_weight_reuse: a
   * later microbatch on unchanged weights, what TransformerEngine's is_first_microbatch = False
   * skips); its warm-up step makes them */
  const int passes = recipe == TW_MOE_BF16 ? 1 : 2;
  for (int reuse = 0; reuse < passes; reuse++) {
    if (ok && reuse && tw_moe_set_weight_reuse(j.m, 1) != TW_OK) ok = 0;
    tw_bench_row r;
    memset(&r, 0, sizeof r);
    r.op = "moe";
    snprintf(r.shape, sizeof r.shape, "%s", shape);
    r.backend = "gpu";
    snprintf(r.version, sizeof r.version, "%s", reuse ? "fwd+bwd, weights reused" : "fwd+bwd");
    r.unit = "TFLOP/s";
    r.pct_of_floor = -1;
    r.flops = 18.0 * (double)T * K * (double)H * (double)F;
    double pms = tw_bench_peer_ms(peers, key, "torch_block");
    snprintf(r.peer, sizeof r.peer, "%s", pms > 0 ? "torch block (autograd, bf16)" : "");
    r.peer_ms = pms;
    if (!ok) {
      fprintf(stderr, "bench moe %s: does not fit or failed to set up: %s\n", shape, tw_last_error());
      r.ms = -1;
    } else {
      int warm = cfg->warmup > 2 ? cfg->warmup : 2, iters = cfg->iters > 5 ? cfg->iters : 5;
      r.ms = tw_bench_gpu_time(stream, warm, iters, fwd_bwd, &j);
      if (tw_ctx_check(ctx) != TW_OK) r.ms = -1;
    }
    r.rate = r.ms > 0 ? r.flops / (r.ms * 1e9) : -1;
    r.ratio = pms > 0 && r.ms > 0 ? pms / r.ms : -1;
    tw_bench_emit(&r, cfg->csv);
    if (ok && r.ms > 0) { /* breakdown */
      static marks mk;
      static int made;
      if (!made) {
        for (int i = 0; i < MAX_MARKS; i++) cudaEventCreate(&mk.ev[i]);
        made = 1;
      }
      mk.n = 0;
      tw_moe_set_step_hook(j.m, on_step, &mk);
      fwd_bwd(&j);
      tw_moe_set_step_hook(j.m, NULL, NULL);
      cudaStreamSynchronize(stream);
      const char *cats[] = {"GEMMs", "quantize", "router", "dispatch", "activation", "combine", "aux loss", "other"};
      enum { NC = 8 };
      double sum[NC] = {0};
      for (int i = 0; i + 1 < mk.n; i++) {
        if (!strcmp(mk.name[i], "end")) continue;
        float ms = 0;
        cudaEventElapsedTime(&ms, mk.ev[i], mk.ev[i + 1]);
        for (int q = 0; q < NC; q++)
          if (!strcmp(category(mk.name[i]), cats[q])) sum[q] += ms;
      }
      printf("  breakdown %s%s:", shape, reuse ? " (weights reused)" : "");
      for (int q = 0; q < NC; q++) printf(" %s %.3f ms%s", cats[q], sum[q], q < NC - 1 ? "," : "\n");
      if (getenv("TWIN_BENCH_MOE_STEPS")) { /* every step on its own (forward, then backward) */
        printf("  steps:");
        for (int i = 0; i + 1 < mk.n; i++) {
          if (!strcmp(mk.name[i], "end")) continue;
          float ms = 0;
          cudaEventElapsedTime(&ms, mk.ev[i], mk.ev[i + 1]);
          printf(" %s %.3f;", mk.name[i], ms);
        }
        printf("\n");
      }
    }
  }
  tw_moe_destroy(j.m);
  for (int i = 0; i < nb; i++)
    if (bufs[i]) tw_free(ctx, bufs[i]);
}

/* ---- ep = n over NCCL (--ep n, n of the visible GPUs) --------------------------------------- */
/* Each rank holds T tokens and E / n experts (wi, wo sharded on E), its own stream and context,
 * one thread per GPU over one NCCL communicator; rank r times its forward + backward on its
 * stream (the block's all-to-alls keep the ranks in step) and the row shows the slowest rank's
 * median. The peer stays the one-GPU torch block on the same T per GPU (weak scaling: n GPUs
 * run n T tokens with the experts split, the peer one GPU's T tokens with all of them). */
typedef struct {
  int E, n;
  int64_t T;
  tw_moe_recipe recipe;
  const tw_bench_cfg *cfg;
  double ms[8];
  char err[8][256];
} ep_job;

static tw_status moe_ep_rank(int rank, tw_comm *comm, void *arg) {
  ep_job *e = (ep_job *)arg;
  const int64_t H = 7168, F = 2048, T = e->T;
  const int E = e->E, nle = e->E / e->n;
  e->ms[rank] = -1;
  if (cudaSetDevice(rank) != cudaSuccess) return tw_error(TW_ERR_DEVICE, "bench moe ep: no device %d", rank);
  cudaStream_t st;
  if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) return tw_error(TW_ERR_DEVICE, "no stream");
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU; cc.comm = comm; cc.stream = st; cc.device = rank;
  tw_status s = tw_ctx_create(&ctx, &cc);
  tw_moe_config c = TW_MOE_CONFIG_INIT;
  c.num_experts = E; c.hidden = H; c.ffn = F; c.router.topk = 8; c.recipe = e->recipe;
  c.aux_coeff = 0.01f; c.max_tokens = T; c.global_tokens = T * e->n;
  tw_mesh mesh;
  tw_axis ax = TW_AXIS_EP;
  if (s == TW_OK) s = tw_mesh_init(&mesh, 1, &ax, &e->n);
  job j;
  memset(&j, 0, sizeof j);
  void *bufs[16] = {0};
  int nb = 0, ok = s == TW_OK;
  if (ok && tw_moe_create(ctx, &mesh, &c, &j.m) != TW_OK) ok = 0;
  job_alloc(ctx, &j, E, nle, T, H, F, bufs, &nb, &ok);
  uint64_t rs = 0x6d6f65ull + (uint64_t)E * 131 + (uint64_t)T + 977u * (uint64_t)rank, gs = 0x67617465ull;
  /* the gate is the same on every rank (replicated); tokens and experts differ */
  if (ok) ok = !fill_bf16(j.x.data, T * H, 0, &rs) && !fill_bf16(j.d_out.data, T * H, 0, &rs) &&
               !fill_bf16(j.w.gate.data, H * E, -6, &gs) && !fill_bf16(j.w.wi.data, nle * H * 2 * F, -6, &rs) &&
               !fill_bf16(j.w.wo.data, nle * F * H, -5, &rs);
  if (!ok) {
    snprintf(e->err[rank], sizeof e->err[rank], "%s", tw_last_error());
    s = TW_ERR_MEMORY;
  } else {
    int warm = e->cfg->warmup > 2 ? e->cfg->warmup : 2, iters = e->cfg->iters > 5 ? e->cfg->iters : 5;
    e->ms[rank] = tw_bench_gpu_time(st, warm, iters, fwd_bwd, &j);
    if (tw_ctx_check(ctx) != TW_OK) {
      snprintf(e->err[rank], sizeof e->err[rank], "%s", tw_last_error());
      e->ms[rank] = -1;
    }
  }
  tw_moe_destroy(j.m);
  for (int i = 0; i < nb; i++)
    if (bufs[i]) tw_free(ctx, bufs[i]);
  tw_ctx_destroy(ctx);
  cudaStreamDestroy(st);
  if (e->ms[rank] < 0) tw_comm_abort(comm);
  return e->ms[rank] < 0 ? TW_ERR_DEVICE : TW_OK;
}

static void bench_moe_ep(int n, const char *peers, const tw_bench_cfg *cfg) {
  const int Es[] = {32, 256};
  const tw_moe_recipe recipes[] = {TW_MOE_BF16, TW_MOE_FP8_CURRENT, TW_MOE_FP8_BLOCK};
  const int64_t T = 4096;
  for (int ri = 0; ri < 3; ri++)
    for (int ei = 0; ei < 2; ei++) {
      ep_job e;
      memset(&e, 0, sizeof e);
      e.E = Es[ei]; e.n = n; e.T = T; e.recipe = recipes[ri]; e.cfg = cfg;
      tw_comm *comms[8];
      int dev[8];
      for (int i = 0; i < n; i++) dev[i] = i;
      tw_status s = tw_comm_init_nccl_local(n, dev, comms);
      if (s == TW_OK) {
        for (int i = 0; i < n; i++) tw_comm_set_timeout(comms[i], 300);
        s = tw_run_ranks(n, comms, moe_ep_rank, &e);
        for (int i = 0; i < n; i++) tw_comm_destroy(comms[i]);
      }
      tw_bench_row r;
      memset(&r, 0, sizeof r);
      r.op = "moe";
      snprintf(r.shape, sizeof r.shape, "ep=%d E=%d T=%lld/GPU H=7168 F=2048 k=8 %s%s", n, e.E, (long long)T,
               tw_moe_recipe_name(e.recipe), grad_dt == TW_F32 ? " dW f32" : "");
      r.backend = "gpu";
      snprintf(r.version, sizeof r.version, "fwd+bwd, %d GPUs", n);
      r.unit = "TFLOP/s";
      r.pct_of_floor = -1;
      r.flops = 18.0 * (double)T * 8 * 7168.0 * 2048.0; /* per GPU */
      char key[64];
      snprintf(key, sizeof key, "moe_E%d_T%lld", e.E, (long long)T);
      double pms = tw_bench_peer_ms(peers, key, "torch_block");
      snprintf(r.peer, sizeof r.peer, "%s", pms > 0 ? "torch block, 1 GPU, same T/GPU" : "");
      r.peer_ms = pms;
      r.ms = 0;
      for (int i = 0; i < n; i++) r.ms = e.ms[i] < 0 || r.ms < 0 ? -1 : (e.ms[i] > r.ms ? e.ms[i] : r.ms);
      if (s != TW_OK || r.ms <= 0) {
        fprintf(stderr, "bench moe ep=%d %s: %s%s\n", n, r.shape, tw_last_error(), e.err[0]);
        r.ms = -1;
      }
      r.rate = r.ms > 0 ? r.flops / (r.ms * 1e9) : -1;
      r.ratio = pms > 0 && r.ms > 0 ? pms / r.ms : -1;
      tw_bench_emit(&r, cfg->csv);
    }
}

int tw_bench_gpu_moe(const tw_bench_cfg *cfg) {
  if (!cfg->op || strcmp(cfg->op, "moe")) return 0; /* heavy (tens of GB): only when asked by name */
  const char *gv = getenv("TWIN_BENCH_MOE_GRADS");
  grad_dt = gv && !strcmp(gv, "f32") ? TW_F32 : TW_BF16;
  if (cfg->moe_ep) { /* --ep N (2..8, checked by cmd_bench.c): the ep = N rows only, each rank its own context */
    int have = 0;
    if (cudaGetDeviceCount(&have) != cudaSuccess) have = 0;
    if (cfg->moe_ep > have) {
      fprintf(stderr, "bench gpu moe: --ep %d needs %d GPUs, sees %d\n", cfg->moe_ep, cfg->moe_ep, have);
      return 1;
    }
    char *peers = tw_bench_peers_read(cfg->peers_json);
    if (cfg->peers_json && !peers) fprintf(stderr, "bench gpu moe: cannot open --peers %s (rows without a peer)\n", cfg->peers_json);
    bench_moe_ep(cfg->moe_ep, peers, cfg);
    free(peers);
    return 0;
  }
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "bench gpu moe: no CUDA stream (no GPU?)\n");
    return 1;
  }
  tw_comm *comm = NULL;
  int dev0 = 0;
  if (tw_comm_init_nccl_local(1, &dev0, &comm) != TW_OK) {
    fprintf(stderr, "bench gpu moe: %s\n", tw_last_error());
    return 1;
  }
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU; cc.comm = comm; cc.stream = stream;
  if (tw_ctx_create(&ctx, &cc) != TW_OK) {
    fprintf(stderr, "bench gpu moe: %s\n", tw_last_error());
    return 1;
  }
  char *peers = tw_bench_peers_read(cfg->peers_json);
  if (cfg->peers_json && !peers) fprintf(stderr, "bench gpu moe: cannot open --peers %s (rows without a peer)\n", cfg->peers_json);
  const tw_moe_recipe recipes[] = {TW_MOE_BF16, TW_MOE_FP8_CURRENT, TW_MOE_FP8_BLOCK, TW_MOE_FP8_MXFP8};
  /* TWIN_BENCH_MOE_RECIPE=name: only that recipe (e.g. a second call under a kernel knob) */
  const char *only = getenv("TWIN_BENCH_MOE_RECIPE");
  /* fp8_current and fp8_block also with the experts' slabs padded to 16 rows
   * (tw_moe_config.alignment): TransformerEngine pads fp8 expert token counts to 16 for its
   * GEMMs; here it also makes every group's transposed (colwise) rows 16-byte aligned, so the
   * grouped quantize stores them whole */
  for (int i = 0; i < 4; i++) {
    if (only && strcmp(only, tw_moe_recipe_name(recipes[i]))) continue;
    const int64_t max_align = recipes[i] == TW_MOE_FP8_CURRENT || recipes[i] == TW_MOE_FP8_BLOCK ? 16 : 1;
    for (int64_t align = 1; align <= max_align; align *= 16) {
      bench_shape(ctx, 32, 4096, recipes[i], align, peers, cfg);
      bench_shape(ctx, 32, 16384, recipes[i], align, peers, cfg);
      bench_shape(ctx, 256, 4096, recipes[i], align, peers, cfg);
    }
  }
  free(peers);
  tw_ctx_destroy(ctx);
  tw_comm_destroy(comm);
  return 0;
}
