// gpu/router.cu — the router of tw_router.h on the GPU, bit for bit equal to ref/router.c.
//
// Build: //gpu:routing (nvcc -fmad=false: no multiply-add is ever contracted, as the oracle's
// host C is built without FMA contraction; every product is rounded before it is added).
//
// Version router_warp (the only one): one warp per token, the token's scores in shared memory
// as f64 (the oracle computes in f64 and rounds once to f32):
//   fwd      lanes load the logits (f32, or bf16 widened) into x; the score (sigmoid, or the
//            full softmax, or the logits themselves) element-wise in parallel; the max of the
//            softmax is a warp reduction (exact, order-free); every *sum* is folded by lane 0
//            in the oracle's order (e = 0, 1, ...), because f64 addition does not reassociate.
//            Group scores: one lane per group, the group's top `per` values summed in selection
//            order; lane 0 keeps the group_topk best (lower group id wins a tie). Top-k: k warp
//            arg-max reductions over the unblocked experts with the oracle's tie rule (equal
//            sel: lower id). Weights by lane 0 (k terms, the oracle's order). counts by
//            atomicAdd of integers (order-free).
//   bwd      the same scores, then the oracle's gradient formulas (lane 0 folds the sums; the
//            per-expert outputs in parallel). topk_idx lives on the device, so it is checked
//            there: an id outside [0, E) or listed twice sets the error word and the token's
//            gradient row is written as zeros (no out-of-bounds read).
//   aux      per token the probabilities p[t, :] (softmax, or sigmoid / its sum) and, forward,
//            lane 0 folds the row r_t = sum_e p[t, e] * counts[e] in e order; one thread per
//            256-token chunk folds its rows, one thread the chunk sums, and c * total is rounded
//            once: tw_router.h's fixed order, which the oracle follows too, so the loss is
//            bit-exact. (The first version folded all T*E products on one thread, the oracle's
//            old order: 44 ms at T 4096, E 256 on an H200.) Backward: per token, lane 0 folds
//            the dot product over e, the lanes write d_logits.
// A NaN logit sets the error word (GPU_ERR_NAN_LOGIT, token and expert) on every entry point;
// the outputs of that call are then unspecified but every index written stays in [0, E).
//
// exp: both sides call tw_exp_f64 (core/tw_exp.h: +, -, *, / and floor only, no FMA), not libm's
// or CUDA's exp. With CUDA's f64 exp (1 ulp) against glibc's, 24 of 600 random cases differed
// (H100, first run): the aux-loss gradient cancels to ~1e-19 where k = E, and one f64 ulp of a
// probability is then the whole answer. With one exp on both sides every operation is the same
// IEEE operation in the same order, so the results are bit-identical by construction; the
// tests check every stored golden and 600 random cases bit for bit (tests/router_gpu_test.c).
//
// Shared memory per warp: 2 E f64 + group and top-k scratch + E bytes; E up to ~13000 fits one
// warp in 227 KB. Larger E: TW_ERR_UNSUPPORTED naming E.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/backend_moe.h"
#include "core/tw_exp.h"
#include "gpu/gpu.h"
#include "gpu/moe.h"
#include "gpu/numerics.cuh"

namespace {

struct router_args {
  const void *logits;
  int bf16;
  int64_t T, E;
  int k, score, pre, G, gk;
  double sf;
  const float *bias;
  long long *err;
  int op;
};

// Shared-memory layout of one warp (f64 first, then i32, then bytes).
struct warp_smem {
  double *s, *sel, *gscore, *w, *v;
  int *idx;
  unsigned char *blocked, *gblk;
};

__host__ __device__ static size_t smem_per_warp(int64_t E, int G, int k) {
  size_t g = (size_t)(G > 0 ? G : 1);
  size_t b = (size_t)E * 16 + g * 8 + (size_t)k * 16 + (size_t)k * 4 + (size_t)E + g;
  return (b + 15) & ~(size_t)15;
}

__device__ static warp_smem carve(char *base, int64_t E, int G, int k) {
  warp_smem m;
  size_t g = (size_t)(G > 0 ? G : 1);
  m.s = (double *)base;
  m.sel = m.s + E;
  m.gscore = m.sel + E;
  m.w = m.gscore + g;
  m.v = m.w + k;
  m.idx = (int *)(m.v + k);
  m.blocked = (unsigned char *)(m.idx + k);
  m.gblk = m.blocked + E;
  return m;
}

__device__ static double logit_at(const router_args &a, int64_t i) {
  return a.bf16 ? (double)tw_bf16_to_f32_d(((const uint16_t *)a.logits)[i]) : (double)((const float *)a.logits)[i];
}

// 1 / (1 + exp(-x)), the oracle's expression.
__device__ static double sigmoid_d(double x) { return __ddiv_rn(1.0, __dadd_rn(1.0, tw_exp_f64(-x))); }

// The largest of v[0..n) not blocked; ties to the lower index; -1 if none (ref argmax_free).
__device__ static int64_t argmax_free(const double *v, const unsigned char *blocked, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (!blocked[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

// The same over the whole warp: each lane scans e = lane, lane + 32, ... (ascending, strict >),
// then the lanes combine (greater value, or equal value and lower id). Every lane returns the
// lane-0 result.
__device__ static int64_t warp_argmax_free(const double *v, const unsigned char *blocked, int64_t n) {
  const int lane = threadIdx.x & 31;
  int64_t best = -1;
  double bv = 0.0;
  for (int64_t i = lane; i < n; i += 32)
    if (!blocked[i] && (best < 0 || v[i] > bv)) {
      best = i;
      bv = v[i];
    }
  for (int d = 16; d >= 1; d >>= 1) {
    int64_t ob = __shfl_down_sync(0xffffffffu, best, d);
    double ov = __shfl_down_sync(0xffffffffu, bv, d);
    if (ob >= 0 && (best < 0 || ov > bv || (ov == bv && ob < best))) {
      best = ob;
      bv = ov;
    }
  }
  return __shfl_sync(0xffffffffu, best, 0);
}

// x -> s (the values the weights come from) and sel (what top-k ranks), as ref token_scores.
// Also reports NaN logits. x is not kept: post-softmax has s = x.
__device__ static void token_scores(const router_args &a, int64_t t, const warp_smem &m) {
  const int lane = threadIdx.x & 31;
  const int64_t E = a.E;
  for (int64_t e = lane; e < E; e += 32) {
    double x = logit_at(a, t * E + e);
    if (x != x) gpu_report(a.err, GPU_ERR_NAN_LOGIT, a.op, t, e);
    if (a.score == TW_ROUTER_SIGMOID) {
      double s = sigmoid_d(x);
      m.s[e] = s;
      m.sel[e] = __dadd_rn(s, a.bias ? (double)a.bias[e] : 0.0);
    } else {
      m.s[e] = x;
      m.sel[e] = x;
    }
  }
  __syncwarp();
  if (a.score == TW_ROUTER_SOFTMAX && a.pre) {
    double mx = -INFINITY;
    for (int64_t e = lane; e < E; e += 32) mx = m.s[e] > mx ? m.s[e] : mx;
    for (int d = 16; d >= 1; d >>= 1) {
      double o = __shfl_xor_sync(0xffffffffu, mx, d);
      mx = o > mx ? o : mx;
    }
    for (int64_t e = lane; e < E; e += 32) m.s[e] = tw_exp_f64(__dsub_rn(m.s[e], mx));
    __syncwarp();
    double sum = 0.0;
    if (lane == 0)
      for (int64_t e = 0; e < E; e++) sum = __dadd_rn(sum, m.s[e]);
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int64_t e = lane; e < E; e += 32) {
      double p = __ddiv_rn(m.s[e], sum);
      m.s[e] = p;
      m.sel[e] = p;
    }
    __syncwarp();
  }
}

// ref select_topk: idx[0..k) by descending sel (ties: lower id), group-limited when asked.
__device__ static void select_topk(const router_args &a, const warp_smem &m) {
  const int lane = threadIdx.x & 31;
  const int64_t E = a.E;
  const int k = a.k;
  for (int64_t e = lane; e < E; e += 32) m.blocked[e] = 0;
  __syncwarp();
  if (a.G > 0) {
    const int G = a.G, per = k / a.gk;
    const int64_t n = E / G;
    for (int g = lane; g < G; g += 32) {  // one lane per group
      unsigned char *taken = m.blocked + (int64_t)g * n;
      double gs = 0.0;
      for (int i = 0; i < per; i++) {
        int64_t mm = argmax_free(m.sel + (int64_t)g * n, taken, n);
        gs = __dadd_rn(gs, m.sel[(int64_t)g * n + mm]);
        taken[mm] = 1;
      }
      for (int64_t i = 0; i < n; i++) taken[i] = 0;
      m.gscore[g] = gs;
    }
    __syncwarp();
    if (lane == 0) {
      for (int g = 0; g < G; g++) m.gblk[g] = 0;
      for (int i = 0; i < a.gk; i++) m.gblk[argmax_free(m.gscore, m.gblk, G)] = 1;
    }
    __syncwarp();
    for (int64_t e = lane; e < E; e += 32) m.blocked[e] = m.gblk[e / n] ? 0 : 1;
    __syncwarp();
  }
  for (int j = 0; j < k; j++) {
    int64_t mm = warp_argmax_free(m.sel, m.blocked, E);
    if (lane == 0) {
      m.idx[j] = (int)mm;
      m.blocked[mm] = 1;
    }
    __syncwarp();
  }
}

// ref topk_weights_of, by lane 0: w[0..k) in f64, scaled.
__device__ static void topk_weights_of(const router_args &a, const warp_smem &m) {
  const int k = a.k;
  double *w = m.w;
  if (a.score == TW_ROUTER_SOFTMAX && !a.pre) {
    double *v = m.v, mx = -INFINITY, sum = 0.0;
    for (int j = 0; j < k; j++) v[j] = m.s[m.idx[j]];
    for (int j = 0; j < k; j++) mx = v[j] > mx ? v[j] : mx;
    for (int j = 0; j < k; j++) sum = __dadd_rn(sum, w[j] = tw_exp_f64(__dsub_rn(v[j], mx)));
    for (int j = 0; j < k; j++) w[j] = __ddiv_rn(w[j], sum);
  } else {
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum = __dadd_rn(sum, w[j] = m.s[m.idx[j]]);
    if (a.score == TW_ROUTER_SIGMOID && k > 1)
      for (int j = 0; j < k; j++) w[j] = __ddiv_rn(w[j], __dadd_rn(sum, 1e-20));
  }
  for (int j = 0; j < k; j++) w[j] = __dmul_rn(w[j], a.sf);
}

__global__ void router_fwd_warp(router_args a, int32_t *__restrict__ topk_idx, float *__restrict__ topk_w,
                                int32_t *__restrict__ counts) {
  extern __shared__ __align__(16) char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  warp_smem m = carve(smem + (size_t)warp * smem_per_warp(a.E, a.G, a.k), a.E, a.G, a.k);
  for (int64_t t = (int64_t)blockIdx.x * wpb + warp; t < a.T; t += (int64_t)gridDim.x * wpb) {
    token_scores(a, t, m);
    select_topk(a, m);
    if (lane == 0) {
      topk_weights_of(a, m);
      for (int j = 0; j < a.k; j++) {
        topk_idx[t * a.k + j] = m.idx[j];
        topk_w[t * a.k + j] = (float)m.w[j];
        if (counts) atomicAdd(&counts[m.idx[j]], 1);
      }
    }
    __syncwarp();
  }
}

__global__ void router_bwd_warp(router_args a, const int32_t *__restrict__ topk_idx, const float *__restrict__ dw,
                                float *__restrict__ dl) {
  extern __shared__ __align__(16) char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  const int64_t E = a.E;
  const int k = a.k;
  warp_smem m = carve(smem + (size_t)warp * smem_per_warp(a.E, a.G, a.k), a.E, a.G, a.k);
  double *ds = m.sel;  // sel is not needed by the backward
  for (int64_t t = (int64_t)blockIdx.x * wpb + warp; t < a.T; t += (int64_t)gridDim.x * wpb) {
    token_scores(a, t, m);
    for (int64_t e = lane; e < E; e += 32) ds[e] = 0.0;
    __syncwarp();
    int ok = 1;
    if (lane == 0) {
      for (int j = 0; j < k && ok; j++) {
        int32_t id = topk_idx[t * k + j];
        if (id < 0 || id >= E) {
          gpu_report(a.err, GPU_ERR_EXPERT_ID, a.op, t, gpu_pack_id_slot(id, j));
          ok = 0;
        }
        for (int i = 0; i < j && ok; i++)
          if (m.idx[i] == id) {
            gpu_report(a.err, GPU_ERR_EXPERT_TWICE, a.op, t, gpu_pack_id_slot(id, j));
            ok = 0;
          }
        if (ok) m.idx[j] = id;
      }
      if (ok) {
        const int32_t *id = m.idx;
        double *g = m.w;  // g_j = scaling_factor * d_w_j
        for (int j = 0; j < k; j++) g[j] = __dmul_rn(a.sf, (double)dw[t * k + j]);
        if (a.score == TW_ROUTER_SOFTMAX && !a.pre) {
          double *v = m.v, mx = -INFINITY, sum = 0.0, gp = 0.0;
          // v_j = selected logits, then p_j = softmax(v)_j in place (ref: softmax(v, k, p))
          for (int j = 0; j < k; j++) v[j] = m.s[id[j]];
          for (int j = 0; j < k; j++) mx = v[j] > mx ? v[j] : mx;
          for (int j = 0; j < k; j++) sum = __dadd_rn(sum, v[j] = tw_exp_f64(__dsub_rn(v[j], mx)));
          for (int j = 0; j < k; j++) v[j] = __ddiv_rn(v[j], sum);
          for (int j = 0; j < k; j++) gp = __dadd_rn(gp, __dmul_rn(g[j], v[j]));
          for (int j = 0; j < k; j++) ds[id[j]] = __dmul_rn(v[j], __dsub_rn(g[j], gp));
        } else if (a.score == TW_ROUTER_SOFTMAX) {
          double dot = 0.0;
          for (int j = 0; j < k; j++) ds[id[j]] = g[j];
          for (int64_t e = 0; e < E; e++) dot = __dadd_rn(dot, __dmul_rn(ds[e], m.s[e]));
          m.v[0] = dot;
        } else {
          if (k > 1) {
            double S = 1e-20, gs = 0.0;
            for (int j = 0; j < k; j++) S = __dadd_rn(S, m.s[id[j]]);
            for (int j = 0; j < k; j++) gs = __dadd_rn(gs, __dmul_rn(g[j], m.s[id[j]]));
            for (int j = 0; j < k; j++)
              ds[id[j]] = __dsub_rn(__ddiv_rn(g[j], S), __ddiv_rn(gs, __dmul_rn(S, S)));
          } else {
            ds[id[0]] = g[0];
          }
        }
      }
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    float *row = dl + t * E;
    if (!ok) {
      for (int64_t e = lane; e < E; e += 32) row[e] = 0.0f;
    } else if (a.score == TW_ROUTER_SOFTMAX && !a.pre) {
      for (int64_t e = lane; e < E; e += 32) row[e] = (float)ds[e];
    } else if (a.score == TW_ROUTER_SOFTMAX) {
      double dot = m.v[0];
      for (int64_t e = lane; e < E; e += 32) row[e] = (float)__dmul_rn(m.s[e], __dsub_rn(ds[e], dot));
    } else {
      for (int64_t e = lane; e < E; e += 32)
        row[e] = (float)__dmul_rn(__dmul_rn(ds[e], m.s[e]), __dsub_rn(1.0, m.s[e]));
    }
    __syncwarp();
  }
}

// Aux loss: p[t, :] into m.s (softmax, or sigmoid / sum; for sigmoid also the sigmoid values
// into m.sel and their sum S). fwd (d_logits NULL): prod[t] = sum_e p * counts[e] in e order.
__global__ void router_aux_warp(router_args a, const int32_t *__restrict__ cnt, double c, double d_loss,
                                double *__restrict__ prod, float *__restrict__ dl) {
  extern __shared__ __align__(16) char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  const int64_t E = a.E;
  warp_smem m = carve(smem + (size_t)warp * smem_per_warp(a.E, a.G, a.k), a.E, a.G, a.k);
  for (int64_t t = (int64_t)blockIdx.x * wpb + warp; t < a.T; t += (int64_t)gridDim.x * wpb) {
    double S = 0.0;
    if (a.score == TW_ROUTER_SOFTMAX) {
      router_args b = a;
      b.pre = 1;  // the full softmax, as ref aux_probs
      token_scores(b, t, m);
    } else {
      for (int64_t e = lane; e < E; e += 32) {
        double x = logit_at(a, t * E + e);
        if (x != x) gpu_report(a.err, GPU_ERR_NAN_LOGIT, a.op, t, e);
        m.sel[e] = sigmoid_d(x);
      }
      __syncwarp();
      if (lane == 0)
        for (int64_t e = 0; e < E; e++) S = __dadd_rn(S, m.sel[e]);
      S = __shfl_sync(0xffffffffu, S, 0);
      for (int64_t e = lane; e < E; e += 32) m.s[e] = __ddiv_rn(m.sel[e], S);
      __syncwarp();
    }
    if (!dl) {
      if (lane == 0) {
        double row = 0.0;
        for (int64_t e = 0; e < E; e++) row = __dadd_rn(row, __dmul_rn(m.s[e], (double)cnt[e]));
        prod[t] = row;
      }
      __syncwarp();
      continue;
    }
    double dot = 0.0;
    if (lane == 0)
      for (int64_t e = 0; e < E; e++)
        dot = __dadd_rn(dot, __dmul_rn(__dmul_rn(__dmul_rn(m.s[e], d_loss), c), (double)cnt[e]));
    dot = __shfl_sync(0xffffffffu, dot, 0);
    float *row = dl + t * E;
    for (int64_t e = lane; e < E; e += 32) {
      double v = __dsub_rn(__dmul_rn(__dmul_rn(d_loss, c), (double)cnt[e]), dot);
      if (a.score == TW_ROUTER_SOFTMAX) {
        row[e] = (float)__dmul_rn(m.s[e], v);
      } else {
        double sg = m.sel[e];
        row[e] = (float)__dmul_rn(__dmul_rn(__ddiv_rn(v, S), sg), __dsub_rn(1.0, sg));
      }
    }
    __syncwarp();
  }
}

#define AUX_CHUNK 256  // tokens per partial sum (tw_router.h, ref/router.c)

// chunk i = rows i*256 .. in order, one thread per chunk
__global__ void router_aux_chunks(const double *__restrict__ rows, int64_t T, double *__restrict__ chunks) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (T + AUX_CHUNK - 1) / AUX_CHUNK;
  if (i >= n) return;
  double s = 0.0;
  for (int64_t t = i * AUX_CHUNK; t < T && t < (i + 1) * AUX_CHUNK; t++) s = __dadd_rn(s, rows[t]);
  chunks[i] = s;
}

// One thread: total = the chunk sums in order; loss = (float)(c * total).
__global__ void router_aux_fold(const double *__restrict__ chunks, int64_t n, double c, float *loss) {
  double total = 0.0;
  for (int64_t i = 0; i < n; i++) total = __dadd_rn(total, chunks[i]);
  *loss = (float)__dmul_rn(c, total);
}

struct launch_shape {
  int threads, blocks;
  size_t smem;
};

static tw_status shape_for(tw_ctx *ctx, const router_args &a, const void *kernel, const char *op, launch_shape *ls) {
  gpu_state *st = gpu_of(ctx);
  size_t per = smem_per_warp(a.E, a.G, a.k);
  int dev_max = 0;
  GPU_TRY_CUDA(cudaDeviceGetAttribute(&dev_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, st->device),
               "router: cudaDeviceGetAttribute");
  if (per > (size_t)dev_max)
    return tw_error(TW_ERR_UNSUPPORTED, "%s: E = %lld experts need %zu bytes of shared memory per token, the device "
                    "grants %d (router_warp keeps a token's f64 scores in shared memory)",
                    op, (long long)a.E, per, dev_max);
  int warps = (int)((48u << 10) / per);
  if (warps > 8) warps = 8;
  if (warps < 1) warps = 1;
  ls->threads = 32 * warps;
  ls->smem = per * (size_t)warps;
  if (ls->smem > (48u << 10))
    GPU_TRY_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ls->smem),
                 "router: cudaFuncSetAttribute");
  int64_t want = (a.T + warps - 1) / warps, cap = (int64_t)st->num_sms * 16;
  ls->blocks = (int)(want < cap ? want : cap);
  return TW_OK;
}

// A forced version of this family must be router_warp (names of other families are left alone).
static tw_status router_version(tw_ctx *ctx, const char *op) {
  const char *k = tw_ctx_kernel(ctx);
  if (!k || strncmp(k, "router_", 7) != 0 || strcmp(k, "router_warp") == 0) return TW_OK;
  return tw_error(TW_ERR_INVALID_ARG, "%s: no kernel version named '%s' (have router_warp)", op, k);
}

static router_args args_of(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o, int op) {
  router_args a;
  a.logits = logits->data;
  a.bf16 = logits->dtype == TW_BF16;
  a.T = logits->shape[0];
  a.E = logits->shape[1];
  a.k = o->topk;
  a.score = (int)o->score;
  a.pre = o->pre_softmax;
  a.G = o->num_groups;
  a.gk = o->group_topk;
  a.sf = (double)o->scaling_factor;
  a.bias = tw_tensor_is_none(&o->expert_bias) ? NULL : (const float *)o->expert_bias.data;
  a.err = gpu_of(ctx)->err_word;
  a.op = op;
  return a;
}

static tw_status gpu_router_fwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o, tw_tensor *topk_idx,
                                tw_tensor *topk_weights, tw_tensor *counts) {
  TW_TRY(router_version(ctx, "router"));
  gpu_state *st = gpu_of(ctx);
  router_args a = args_of(ctx, logits, o, GPU_OP_ROUTER);
  int32_t *cnt = tw_tensor_is_none(counts) ? NULL : (int32_t *)counts->data;
  if (cnt) GPU_TRY_CUDA(cudaMemsetAsync(cnt, 0, (size_t)a.E * 4, st->stream), "router: zero counts");
  if (a.T == 0) return TW_OK;
  launch_shape ls;
  TW_TRY(shape_for(ctx, a, (const void *)router_fwd_warp, "router", &ls));
  router_fwd_warp<<<ls.blocks, ls.threads, ls.smem, st->stream>>>(a, (int32_t *)topk_idx->data,
                                                                  (float *)topk_weights->data, cnt);
  GPU_TRY_CUDA(cudaGetLastError(), "router: launch");
  return TW_OK;
}

static tw_status gpu_router_bwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o,
                                const tw_tensor *topk_idx, const tw_tensor *d_topk_weights, tw_tensor *d_logits) {
  TW_TRY(router_version(ctx, "router_bwd"));
  gpu_state *st = gpu_of(ctx);
  router_args a = args_of(ctx, logits, o, GPU_OP_ROUTER_BWD);
  if (a.T == 0) return TW_OK;
  launch_shape ls;
  TW_TRY(shape_for(ctx, a, (const void *)router_bwd_warp, "router_bwd", &ls));
  router_bwd_warp<<<ls.blocks, ls.threads, ls.smem, st->stream>>>(a, (const int32_t *)topk_idx->data,
                                                                  (const float *)d_topk_weights->data,
                                                                  (float *)d_logits->data);
  GPU_TRY_CUDA(cudaGetLastError(), "router_bwd: launch");
  return TW_OK;
}

static tw_status gpu_router_aux_loss(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o,
                                     const tw_tensor *counts, float coeff, tw_tensor *loss, float d_loss,
                                     tw_tensor *d_logits) {
  gpu_state *st = gpu_of(ctx);
  router_args a = args_of(ctx, logits, o, d_logits ? GPU_OP_ROUTER_AUX_BWD : GPU_OP_ROUTER_AUX);
  a.G = 0;  // the aux loss ignores groups (and needs no group scratch)
  const char *op = d_logits ? "router_aux_loss_bwd" : "router_aux_loss";
  TW_TRY(router_version(ctx, op));
  // the oracle's constant, in the same f64 operations on the host
  double c = (double)coeff * (double)a.E / ((double)o->topk * (double)a.T * (double)a.T);
  launch_shape ls;
  TW_TRY(shape_for(ctx, a, (const void *)router_aux_warp, op, &ls));
  double *prod = NULL, *chunks = NULL;
  int64_t nchunks = (a.T + AUX_CHUNK - 1) / AUX_CHUNK;
  if (!d_logits) {
    gpu_scratch_reset(ctx);
    TW_TRY(gpu_scratch(ctx, (size_t)(a.T > 0 ? a.T : 1) * sizeof(double), (void **)&prod));
    TW_TRY(gpu_scratch(ctx, (size_t)(nchunks > 0 ? nchunks : 1) * sizeof(double), (void **)&chunks));
  }
  router_aux_warp<<<ls.blocks, ls.threads, ls.smem, st->stream>>>(a, (const int32_t *)counts->data, c,
                                                                  (double)d_loss, prod,
                                                                  d_logits ? (float *)d_logits->data : NULL);
  GPU_TRY_CUDA(cudaGetLastError(), "router_aux_loss: launch");
  if (!d_logits) {
    if (nchunks > 0) {
      router_aux_chunks<<<(unsigned)((nchunks + 127) / 128), 128, 0, st->stream>>>(prod, a.T, chunks);
      GPU_TRY_CUDA(cudaGetLastError(), "router_aux_loss: chunk launch");
    }
    router_aux_fold<<<1, 1, 0, st->stream>>>(chunks, nchunks, c, (float *)loss->data);
    GPU_TRY_CUDA(cudaGetLastError(), "router_aux_loss: fold launch");
  }
  return TW_OK;
}

}  // namespace

extern "C" const tw_router_backend gpu_router = {
    gpu_router_fwd,
    gpu_router_bwd,
    gpu_router_aux_loss,
};
