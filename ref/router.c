/* The oracle's router (tw_router.h): straight loops over one token at a time, f64 inside,
 * f32 out. Read it against the formulas in the header. exp is twin's own tw_exp_f64
 * (core/tw_exp.h), not libm's, so the oracle gives the same bits on every host and the CUDA
 * twin (gpu/router.cu) can equal it bit for bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/tw_exp.h"
#include "ref/ref_moe.h"
#include "twin/tw_numerics.h"

static double logit_at(const tw_tensor *l, int64_t i) {
  return l->dtype == TW_F32 ? (double)((const float *)l->data)[i]
                            : (double)tw_bf16_to_f32(((const uint16_t *)l->data)[i]);
}

static void softmax(const double *x, int64_t n, double *out) {
  double mx = -INFINITY, sum = 0.0;
  for (int64_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
  for (int64_t i = 0; i < n; i++) sum += out[i] = tw_exp_f64(x[i] - mx);
  for (int64_t i = 0; i < n; i++) out[i] /= sum;
}

static double sigmoid(double x) { return 1.0 / (1.0 + tw_exp_f64(-x)); }

/* The largest of v[0..n) not yet taken (and allowed); ties to the lower index. -1 if none. */
static int64_t argmax_free(const double *v, const unsigned char *blocked, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (!blocked[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

/* One token's scores: s (softmax/sigmoid values the weights come from; the logits for
 * post-softmax) and sel (what top-k ranks). */
static void token_scores(const tw_tensor *logits, const tw_router_opts *o, int64_t t, int64_t E,
                         double *x, double *s, double *sel) {
  for (int64_t e = 0; e < E; e++) x[e] = logit_at(logits, t * E + e);
  if (o->score == TW_ROUTER_SIGMOID) {
    const float *bias = tw_tensor_is_none(&o->expert_bias) ? NULL : (const float *)o->expert_bias.data;
    for (int64_t e = 0; e < E; e++) {
      s[e] = sigmoid(x[e]);
      sel[e] = s[e] + (bias ? (double)bias[e] : 0.0);
    }
  } else if (o->pre_softmax) {
    softmax(x, E, s);
    memcpy(sel, s, (size_t)E * sizeof(double));
  } else {
    memcpy(s, x, (size_t)E * sizeof(double));
    memcpy(sel, x, (size_t)E * sizeof(double));
  }
}

/* Top-k of sel, group-limited when asked; idx gets k ids by descending sel (ties: lower id).
 * blocked [E] and gscore [num_groups] are scratch. */
static void select_topk(const tw_router_opts *o, const double *sel, int64_t E, int *idx,
                        unsigned char *blocked, double *gscore, unsigned char *gblocked) {
  int k = o->topk;
  memset(blocked, 0, (size_t)E);
  if (o->num_groups > 0) {
    int G = o->num_groups, per = k / o->group_topk;
    int64_t n = E / G;
    for (int g = 0; g < G; g++) { /* sum of the group's top `per` values */
      unsigned char *taken = blocked + g * n;
      gscore[g] = 0.0;
      for (int i = 0; i < per; i++) {
        int64_t m = argmax_free(sel + g * n, taken, n);
        gscore[g] += sel[g * n + m];
        taken[m] = 1;
      }
      memset(taken, 0, (size_t)n);
    }
    memset(gblocked, 0, (size_t)G);
    for (int i = 0; i < o->group_topk; i++) gblocked[argmax_free(gscore, gblocked, G)] = 1;
    for (int g = 0; g < G; g++) /* gblocked now marks the kept groups */
      memset(blocked + g * n, gblocked[g] ? 0 : 1, (size_t)n);
  }
  for (int j = 0; j < k; j++) {
    int64_t m = argmax_free(sel, blocked, E);
    idx[j] = (int)m;
    blocked[m] = 1;
  }
}

/* Weights of the chosen experts from s (formula in tw_router.h), before nothing else. */
static void topk_weights_of(const tw_router_opts *o, const double *s, const int *idx, double *w) {
  int k = o->topk;
  if (o->score == TW_ROUTER_SOFTMAX && !o->pre_softmax) {
    double v[k > 0 ? k : 1];
    for (int j = 0; j < k; j++) v[j] = s[idx[j]];
    softmax(v, k, w);
  } else {
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += w[j] = s[idx[j]];
    if (o->score == TW_ROUTER_SIGMOID && k > 1)
      for (int j = 0; j < k; j++) w[j] /= sum + 1e-20;
  }
  for (int j = 0; j < k; j++) w[j] *= (double)o->scaling_factor;
}

typedef struct {
  double *x, *s, *sel, *w, *gscore, *ds;
  unsigned char *blocked, *gblocked;
  int *idx;
} scratch;

static tw_status scratch_alloc(scratch *sc, int64_t E, int k, int G) {
  memset(sc, 0, sizeof *sc);
  size_t n = (size_t)E;
  sc->x = malloc(n * sizeof(double));
  sc->s = malloc(n * sizeof(double));
  sc->sel = malloc(n * sizeof(double));
  sc->ds = malloc(n * sizeof(double));
  sc->w = malloc((size_t)k * sizeof(double));
  sc->gscore = malloc((size_t)(G > 0 ? G : 1) * sizeof(double));
  sc->blocked = malloc(n);
  sc->gblocked = malloc((size_t)(G > 0 ? G : 1));
  sc->idx = malloc((size_t)k * sizeof(int));
  if (!sc->x || !sc->s || !sc->sel || !sc->ds || !sc->w || !sc->gscore || !sc->blocked ||
      !sc->gblocked || !sc->idx)
    return tw_error(TW_ERR_MEMORY, "router: out of host memory for E = %lld", (long long)E);
  return TW_OK;
}

static void scratch_free(scratch *sc) {
  free(sc->x); free(sc->s); free(sc->sel); free(sc->ds); free(sc->w); free(sc->gscore);
  free(sc->blocked); free(sc->gblocked); free(sc->idx);
}

static tw_status ref_router_fwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o,
                                tw_tensor *topk_idx, tw_tensor *topk_weights, tw_tensor *counts) {
  (void)ctx;
  int64_t T = logits->shape[0], E = logits->shape[1];
  int k = o->topk;
  scratch sc;
  tw_status st = scratch_alloc(&sc, E, k, o->num_groups);
  int32_t *cnt = tw_tensor_is_none(counts) ? NULL : (int32_t *)counts->data;
  if (cnt) memset(cnt, 0, (size_t)E * sizeof(int32_t));
  for (int64_t t = 0; st == TW_OK && t < T; t++) {
    token_scores(logits, o, t, E, sc.x, sc.s, sc.sel);
    select_topk(o, sc.sel, E, sc.idx, sc.blocked, sc.gscore, sc.gblocked);
    topk_weights_of(o, sc.s, sc.idx, sc.w);
    for (int j = 0; j < k; j++) {
      ((int32_t *)topk_idx->data)[t * k + j] = sc.idx[j];
      ((float *)topk_weights->data)[t * k + j] = (float)sc.w[j];
      if (cnt) cnt[sc.idx[j]]++;
    }
  }
  scratch_free(&sc);
  return st;
}

static tw_status ref_router_bwd(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o,
                                const tw_tensor *topk_idx, const tw_tensor *d_topk_weights,
                                tw_tensor *d_logits) {
  (void)ctx;
  int64_t T = logits->shape[0], E = logits->shape[1];
  int k = o->topk;
  scratch sc;
  tw_status st = scratch_alloc(&sc, E, k, o->num_groups);
  const int32_t *idx = (const int32_t *)topk_idx->data;
  const float *dw = (const float *)d_topk_weights->data;
  float *dl = (float *)d_logits->data;
  double sf = (double)o->scaling_factor;
  for (int64_t t = 0; st == TW_OK && t < T; t++) {
    token_scores(logits, o, t, E, sc.x, sc.s, sc.sel);
    const int32_t *id = idx + t * k;
    double *g = sc.w; /* g_j = scaling_factor * d_w_j */
    for (int j = 0; j < k; j++) g[j] = sf * (double)dw[t * k + j];
    for (int64_t e = 0; e < E; e++) sc.ds[e] = 0.0;
    if (o->score == TW_ROUTER_SOFTMAX && !o->pre_softmax) {
      double v[k], p[k], gp = 0.0;
      for (int j = 0; j < k; j++) v[j] = sc.x[id[j]];
      softmax(v, k, p);
      for (int j = 0; j < k; j++) gp += g[j] * p[j];
      for (int j = 0; j < k; j++) sc.ds[id[j]] = p[j] * (g[j] - gp);
      for (int64_t e = 0; e < E; e++) dl[t * E + e] = (float)sc.ds[e];
    } else if (o->score == TW_ROUTER_SOFTMAX) {
      double dot = 0.0;
      for (int j = 0; j < k; j++) sc.ds[id[j]] = g[j];
      for (int64_t e = 0; e < E; e++) dot += sc.ds[e] * sc.s[e];
      for (int64_t e = 0; e < E; e++) dl[t * E + e] = (float)(sc.s[e] * (sc.ds[e] - dot));
    } else {
      if (k > 1) {
        double S = 1e-20, gs = 0.0;
        for (int j = 0; j < k; j++) S += sc.s[id[j]];
        for (int j = 0; j < k; j++) gs += g[j] * sc.s[id[j]];
        for (int j = 0; j < k; j++) sc.ds[id[j]] = g[j] / S - gs / (S * S);
      } else {
        sc.ds[id[0]] = g[0];
      }
      for (int64_t e = 0; e < E; e++) dl[t * E + e] = (float)(sc.ds[e] * sc.s[e] * (1.0 - sc.s[e]));
    }
  }
  scratch_free(&sc);
  return st;
}

#define TW_ROUTER_AUX_CHUNK 256 /* tokens per partial sum of the aux loss (tw_router.h) */

/* p[t, :] of the aux loss: full softmax, or sigmoid normalized to sum 1. */
static void aux_probs(const tw_tensor *logits, const tw_router_opts *o, int64_t t, int64_t E,
                      double *x, double *p) {
  for (int64_t e = 0; e < E; e++) x[e] = logit_at(logits, t * E + e);
  if (o->score == TW_ROUTER_SOFTMAX) {
    softmax(x, E, p);
  } else {
    double sum = 0.0;
    for (int64_t e = 0; e < E; e++) sum += p[e] = sigmoid(x[e]);
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
  }
}

static tw_status ref_router_aux_loss(tw_ctx *ctx, const tw_tensor *logits, const tw_router_opts *o,
                                     const tw_tensor *counts, float coeff, tw_tensor *loss,
                                     float d_loss, tw_tensor *d_logits) {
  (void)ctx;
  int64_t T = logits->shape[0], E = logits->shape[1];
  const int32_t *cnt = (const int32_t *)counts->data;
  double c = (double)coeff * (double)E / ((double)o->topk * (double)T * (double)T);
  scratch sc;
  tw_status st = scratch_alloc(&sc, E, o->topk, 0);
  double total = 0.0, chunk = 0.0; /* tw_router.h's order: rows, 256-token chunks, chunks */
  for (int64_t t = 0; st == TW_OK && t < T; t++) {
    aux_probs(logits, o, t, E, sc.x, sc.s);
    if (!d_logits) {
      double row = 0.0;
      for (int64_t e = 0; e < E; e++) row += sc.s[e] * (double)cnt[e];
      chunk += row;
      if ((t + 1) % TW_ROUTER_AUX_CHUNK == 0 || t == T - 1) {
        total += chunk;
        chunk = 0.0;
      }
      continue;
    }
    /* v = d_loss * c * counts; d_logits = J_p^T v */
    double dot = 0.0;
    for (int64_t e = 0; e < E; e++) dot += sc.s[e] * (double)d_loss * c * (double)cnt[e];
    float *dl = (float *)d_logits->data + t * E;
    if (o->score == TW_ROUTER_SOFTMAX) {
      for (int64_t e = 0; e < E; e++) dl[e] = (float)(sc.s[e] * ((double)d_loss * c * cnt[e] - dot));
    } else { /* p = s / S: dp/ds = (v - dot) / S, then ds/dx = s (1 - s) */
      double S = 0.0;
      for (int64_t e = 0; e < E; e++) S += sc.x[e] = sigmoid(sc.x[e]);
      for (int64_t e = 0; e < E; e++)
        dl[e] = (float)(((double)d_loss * c * cnt[e] - dot) / S * sc.x[e] * (1.0 - sc.x[e]));
    }
  }
  if (loss && st == TW_OK) *(float *)loss->data = (float)(c * total);
  scratch_free(&sc);
  return st;
}

const tw_router_backend tw_ref_router = {
    .fwd = ref_router_fwd,
    .bwd = ref_router_bwd,
    .aux_loss = ref_router_aux_loss,
};
