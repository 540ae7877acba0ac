/* Stored router and EP cases (golden/gen_router.py, golden/gen_ep.py) through the one checker,
 * so `twin check`, `twin port` and the Criterion golden tests judge them the same way.
 *
 * Device contexts get device copies of every input and output (mirror_in / mirror_out, which
 * also reads the device error word after each call).
 * router: topk_idx and counts bit for bit; topk_weights, d_logits, aux_loss and aux_d_logits
 *   against the f64 golden within |got - exact| <= c u |exact| + tiny, u = 2^-24: the oracle
 *   computes in f64 and rounds once to f32 (c = 2: one rounding, plus the golden's own f64
 *   noise; the aux loss and its gradient sum T*E terms in f64 before rounding, c = 4).
 * ep: the case's ep_size ranks run as threads of ctx's backend (ref: the thread communicator;
 *   gpu: NCCL with rank r on GPU r, skipped with "needs N GPUs, sees n" where fewer are
 *   visible; inputs and outputs are copied to and from each rank's device);
 *   dispatch (rows, scales, weights, group sizes, drops), combine (weighted, unweighted),
 *   dispatch_bwd and combine_bwd bit for bit: twin fixes the slot order and every sum's order. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "golden/routing.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_npy.h"
#include "twin/tw_router.h"

/* The gpu side is linked only into binaries with //gpu (weak: NULL elsewhere). */
#pragma weak tw_gpu_device_count
#pragma weak tw_comm_init_nccl_local
int tw_gpu_device_count(void); /* gpu/probe.cu */

#define U32 (1.0 / 16777216.0)

static tw_status load_npy(const char *dir, const char *name, tw_tensor *t) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s.npy", dir, name);
  return tw_npy_load(path, t);
}

/* got against the stored name.npy, bit for bit (the file's integer codes viewed as got's dtype). */
static tw_status exact(tw_golden_result *res, const char *dir, const char *name, const char *label,
                       const tw_tensor *got) {
  tw_tensor want;
  TW_TRY(load_npy(dir, name, &want));
  tw_status s = TW_OK;
  char a[96], b[96];
  if (tw_tensor_numel(&want) != tw_tensor_numel(got) || tw_dtype_bits(want.dtype) != tw_dtype_bits(got->dtype))
    s = tw_error(TW_ERR_IO, "%s: the golden is %s, the output %s", label, tw_tensor_str(&want, a, sizeof a),
                 tw_tensor_str(got, b, sizeof b));
  if (s == TW_OK) {
    want.dtype = got->dtype;
    want.ndim = got->ndim;
    for (int d = 0; d < TW_MAX_DIMS; d++) want.shape[d] = got->shape[d];
    tw_check_report r;
    s = tw_check_exact(got, &want, &r);
    if (s == TW_OK) tw_golden_record(res, label, &r);
  }
  free(want.data);
  return s;
}

/* f32 got against the stored f64 golden within c u |exact| + tiny. */
static tw_status close_f64(tw_golden_result *res, const char *dir, const char *name, const tw_tensor *got, double c,
                           double tiny) {
  tw_tensor want;
  TW_TRY(load_npy(dir, name, &want));
  int64_t n = tw_tensor_numel(got);
  double *bound = (double *)malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  tw_status s = bound ? TW_OK : tw_error(TW_ERR_MEMORY, "router golden: out of memory");
  if (s == TW_OK && (want.dtype != TW_F64 || tw_tensor_numel(&want) != n))
    s = tw_error(TW_ERR_IO, "%s.npy: want %lld f64 values, the file has %lld %s", name, (long long)n,
                 (long long)tw_tensor_numel(&want), tw_dtype_name(want.dtype));
  if (s == TW_OK) {
    const double *w = (const double *)want.data;
    for (int64_t i = 0; i < n; i++) bound[i] = c * U32 * (w[i] < 0 ? -w[i] : w[i]) + tiny;
    want.ndim = got->ndim;
    for (int d = 0; d < TW_MAX_DIMS; d++) want.shape[d] = got->shape[d];
    tw_tensor bt = tw_tensor_1d(bound, TW_F64, n, TW_MEM_HOST);
    tw_check_report r;
    s = tw_check_bound(got, &want, &bt, &r);
    if (s == TW_OK) tw_golden_record(res, name, &r);
  }
  free(bound);
  free(want.data);
  return s;
}

static int num(const tw_case_keys *k, const char *key, double *out) {
  const char *v = tw_case_get(k, key);
  char *end;
  if (!v) return tw_error(TW_ERR_IO, "case.txt has no '%s'", key), -1;
  *out = strtod(v, &end);
  if (*end) return tw_error(TW_ERR_IO, "case.txt: %s = '%s' is not a number", key, v), -1;
  return 0;
}
#define NUM(key, var)                                                      \
  do {                                                                     \
    double v_;                                                             \
    if (num(k, key, &v_) != 0) return TW_ERR_IO;                           \
    var = v_;                                                              \
  } while (0)

static int skip_if_missing(tw_ctx *ctx, int have, const char *op, tw_golden_result *res) {
  if (have) return 0;
  res->skipped = 1;
  snprintf(res->detail, sizeof res->detail, "the %s backend does not provide %s", ctx->ops->name, op);
  return 1;
}

/* ---- host <-> the context's memory ---------------------------------------------------------- */
/* A device context gets device copies of the inputs and device outputs, read back after the
 * call (and after tw_ctx_check, so a device-side error is the call's status). A host context
 * works on the host tensors themselves. */
#define MIRROR_MAX 32
typedef struct {
  tw_ctx *ctx;
  void *bufs[MIRROR_MAX];
  int n;
} mirror;

static int on_device(const mirror *m) { return tw_ctx_mem(m->ctx) != TW_MEM_HOST; }

/* d = h in the context's memory (a copy when it is device memory); none stays none. */
static tw_status mirror_in(mirror *m, const tw_tensor *h, tw_tensor *d) {
  *d = *h;
  if (!on_device(m) || tw_tensor_is_none(h)) return TW_OK;
  d->mem = tw_ctx_mem(m->ctx);
  d->data = NULL;
  size_t bytes = tw_tensor_bytes(h);
  if (!bytes) return TW_OK;
  if (m->n == MIRROR_MAX) return tw_error(TW_ERR_INTERNAL, "routing golden: too many device buffers");
  TW_TRY(tw_alloc(m->ctx, bytes, &d->data));
  m->bufs[m->n++] = d->data;
  return tw_tensor_copy(m->ctx, d, h);
}

/* Reads d back into h after checking the device (no-op for a host context). */
static tw_status mirror_out(mirror *m, tw_tensor *h, const tw_tensor *d) {
  if (!on_device(m) || tw_tensor_is_none(h)) return TW_OK;
  TW_TRY(tw_ctx_check(m->ctx));
  if (!tw_tensor_bytes(h)) return TW_OK;
  return tw_tensor_copy(m->ctx, h, d);
}

static void mirror_free(mirror *m) {
  for (int i = 0; i < m->n; i++) tw_free(m->ctx, m->bufs[i]);
  m->n = 0;
}

/* ---- router -------------------------------------------------------------------------------- */
tw_status tw_golden_run_router(tw_ctx *ctx, const char *dir, const tw_case_keys *k, tw_golden_result *res) {
  if (skip_if_missing(ctx, ctx->ops->router != NULL, "the router", res)) return TW_OK;
  tw_router_opts o = TW_ROUTER_OPTS_INIT;
  const char *score = tw_case_get(k, "score"), *ldt = tw_case_get(k, "logits_dtype");
  if (!score || !ldt) return tw_error(TW_ERR_IO, "case.txt needs 'score' and 'logits_dtype'");
  o.score = strcmp(score, "sigmoid") == 0 ? TW_ROUTER_SIGMOID : TW_ROUTER_SOFTMAX;
  double has_bias, coeff, d_loss;
  NUM("pre_softmax", o.pre_softmax);
  NUM("topk", o.topk);
  NUM("num_groups", o.num_groups);
  NUM("group_topk", o.group_topk);
  NUM("scaling_factor", o.scaling_factor);
  NUM("has_bias", has_bias);
  NUM("coeff", coeff);
  NUM("d_loss", d_loss);
  tw_tensor logits = tw_tensor_none(), bias = tw_tensor_none(), dw = tw_tensor_none();
  TW_TRY(load_npy(dir, "logits", &logits));
  tw_status s = TW_OK;
  if (strcmp(ldt, "bf16") == 0) {
    tw_tensor v;
    s = tw_tensor_view_as(&logits, TW_BF16, &v);
    if (s == TW_OK) logits = v;
  }
  if (s == TW_OK && has_bias) s = load_npy(dir, "expert_bias", &bias);
  o.expert_bias = bias;
  if (s == TW_OK) s = load_npy(dir, "d_topk_weights", &dw);
  if (s == TW_OK && logits.ndim != 2) s = tw_error(TW_ERR_IO, "logits.npy must be [T, E]");
  int64_t T = s == TW_OK ? logits.shape[0] : 0, E = s == TW_OK ? logits.shape[1] : 0, kk = o.topk > 0 ? o.topk : 1;
  int32_t *idx = calloc((size_t)(T * kk + 1), 4), *cnt = calloc((size_t)E + 1, 4);
  float *w = calloc((size_t)(T * kk + 1), 4), *dl = calloc((size_t)(T * E + 1), 4), loss = 0;
  if (s == TW_OK && !(idx && cnt && w && dl)) s = tw_error(TW_ERR_MEMORY, "router golden: out of memory");
  tw_tensor t_idx = tw_tensor_2d(idx, TW_I32, T, kk, TW_MEM_HOST), t_w = tw_tensor_2d(w, TW_F32, T, kk, TW_MEM_HOST);
  tw_tensor t_cnt = tw_tensor_1d(cnt, TW_I32, E, TW_MEM_HOST), t_dl = tw_tensor_2d(dl, TW_F32, T, E, TW_MEM_HOST);
  tw_tensor t_loss = tw_tensor_1d(&loss, TW_F32, 1, TW_MEM_HOST);
  const double tiny = 1e-30; /* far below every stored value's f32 spacing */
  /* the same tensors in the context's memory (device copies for a gpu context) */
  mirror m = {ctx, {0}, 0};
  tw_tensor d_logits_in, d_bias, d_dw, d_idx, d_w, d_cnt, d_dl, d_lossv;
  if (s == TW_OK) s = mirror_in(&m, &logits, &d_logits_in);
  if (s == TW_OK) s = mirror_in(&m, &bias, &d_bias);
  if (s == TW_OK) s = mirror_in(&m, &dw, &d_dw);
  if (s == TW_OK) s = mirror_in(&m, &t_idx, &d_idx);
  if (s == TW_OK) s = mirror_in(&m, &t_w, &d_w);
  if (s == TW_OK) s = mirror_in(&m, &t_cnt, &d_cnt);
  if (s == TW_OK) s = mirror_in(&m, &t_dl, &d_dl);
  if (s == TW_OK) s = mirror_in(&m, &t_loss, &d_lossv);
  o.expert_bias = d_bias;
  if (s == TW_OK) s = tw_router_fwd(ctx, &d_logits_in, &o, &d_idx, &d_w, &d_cnt);
  if (s == TW_OK) s = mirror_out(&m, &t_idx, &d_idx);
  if (s == TW_OK) s = mirror_out(&m, &t_w, &d_w);
  if (s == TW_OK) s = mirror_out(&m, &t_cnt, &d_cnt);
  if (s == TW_OK) s = exact(res, dir, "topk_idx", "topk_idx", &t_idx);
  if (s == TW_OK) s = exact(res, dir, "counts", "counts", &t_cnt);
  if (s == TW_OK) s = close_f64(res, dir, "topk_weights", &t_w, 2, tiny);
  if (s == TW_OK) s = tw_router_bwd(ctx, &d_logits_in, &o, &d_idx, &d_dw, &d_dl);
  if (s == TW_OK) s = mirror_out(&m, &t_dl, &d_dl);
  if (s == TW_OK) s = close_f64(res, dir, "d_logits", &t_dl, 2, 1e-12);
  if (s == TW_OK) s = tw_router_aux_loss(ctx, &d_logits_in, &o, &d_cnt, (float)coeff, &d_lossv);
  if (s == TW_OK) s = mirror_out(&m, &t_loss, &d_lossv);
  if (s == TW_OK) s = close_f64(res, dir, "aux_loss", &t_loss, 4, tiny);
  if (s == TW_OK) s = tw_router_aux_loss_bwd(ctx, &d_logits_in, &o, &d_cnt, (float)coeff, (float)d_loss, &d_dl);
  if (s == TW_OK) s = mirror_out(&m, &t_dl, &d_dl);
  if (s == TW_OK) s = close_f64(res, dir, "aux_d_logits", &t_dl, 4, 1e-12);
  mirror_free(&m);
  free(idx); free(cnt); free(w); free(dl);
  free(logits.data); free(bias.data); free(dw.data);
  return s;
}

/* ---- ep ------------------------------------------------------------------------------------ */
#define EP_MAXR 8

typedef struct {
  const char *dir;
  tw_backend backend;
  int n, E, k, A, scale_block;
  int64_t H, R;
  tw_dtype dt;
  tw_ep_overflow policy;
  tw_golden_result sub[EP_MAXR]; /* per rank; folded into the case's result after the run */
} ep_case;

/* name_<rank>.npy; u16 codes read as bf16, u8 as the token dtype (or e8m0 for scales). */
static tw_status ep_load(const ep_case *c, const char *name, int r, tw_tensor *t) {
  char nm[96];
  snprintf(nm, sizeof nm, "%s_%d", name, r);
  TW_TRY(load_npy(c->dir, nm, t));
  tw_dtype as = t->dtype == TW_U16 ? TW_BF16 : t->dtype;
  if (t->dtype == TW_U8) as = strstr(name, "scales") ? TW_E8M0 : c->dt;
  if (as != t->dtype) {
    tw_tensor v;
    TW_TRY(tw_tensor_view_as(t, as, &v));
    *t = v;
  }
  return TW_OK;
}

static tw_status ep_exact(ep_case *c, int r, const char *name, const tw_tensor *got) {
  char nm[96], label[96];
  snprintf(nm, sizeof nm, "%s_%d", name, r);
  snprintf(label, sizeof label, "%s[rank %d]", name, r);
  return exact(&c->sub[r], c->dir, nm, label, got);
}

/* Rows by source on a second layer of the same group: src_tokens, src_scales, recv_row and the
 * shared outputs against the goldens, then its combine against the same out_r (the routing
 * state a by-source dispatch leaves is the same), and combine_bwd by source: d_src and the
 * dots against d_topk_weights_combine_r. */
static tw_status ep_by_source(ep_case *c, int r, tw_ctx *ctx, mirror *m, tw_ep *ep, const tw_tensor *D_tok,
                              const tw_tensor *D_scl, const tw_tensor *D_idx, const tw_tensor *D_w,
                              const tw_tensor *D_y, const tw_tensor *D_dout, int64_t maxT) {
  int64_t U = (int64_t)c->n * maxT, H = c->H, R = c->R, T = D_tok->shape[0];
  int nle = c->E / c->n;
  tw_ep_layer *layer = NULL;
  void *src = calloc((size_t)(U * H) * 4 + 1, 1), *sscl = calloc((size_t)U * (size_t)(H / 32 + 1) * 4 + 1, 1);
  int32_t *row = calloc((size_t)R + 1, 4), *gs = calloc((size_t)nle + 1, 4), *dr = calloc((size_t)nle + 1, 4);
  float *rw = calloc((size_t)R + 1, 4), *out = calloc((size_t)(T * H) + 1, 4);
  float *dsrc = calloc((size_t)(U * H) + 1, 4), *dtw = calloc((size_t)(T * c->k) + 1, 4);
  tw_status s = src && sscl && row && gs && dr && rw && out && dsrc && dtw
                    ? TW_OK : tw_error(TW_ERR_MEMORY, "ep golden: out of memory");
  if (dsrc) memset(dsrc, 0xA5, (size_t)(U * H) * 4); /* poisoned: every row must be written */
  tw_tensor tsrc = tw_tensor_2d(src, c->dt, U, H, TW_MEM_HOST), tsscl = tw_tensor_none();
  if (c->scale_block)
    tsscl = tw_tensor_2d(sscl, c->scale_block == 32 ? TW_E8M0 : TW_F32, U, H / c->scale_block, TW_MEM_HOST);
  tw_tensor trow = tw_tensor_1d(row, TW_I32, R, TW_MEM_HOST), trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST), tdr = tw_tensor_1d(dr, TW_I32, nle, TW_MEM_HOST);
  tw_tensor tout = tw_tensor_2d(out, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor tdsrc = tw_tensor_2d(dsrc, TW_F32, U, H, TW_MEM_HOST), tdtw = tw_tensor_2d(dtw, TW_F32, T, c->k, TW_MEM_HOST);
  tw_tensor D_src, D_sscl, D_row, D_rw, D_gs, D_dr, D_out, D_dsrc, D_dtw;
  if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
  if (s == TW_OK) s = mirror_in(m, &tsrc, &D_src);
  if (s == TW_OK) s = mirror_in(m, &tsscl, &D_sscl);
  if (s == TW_OK) s = mirror_in(m, &trow, &D_row);
  if (s == TW_OK) s = mirror_in(m, &trw, &D_rw);
  if (s == TW_OK) s = mirror_in(m, &tgs, &D_gs);
  if (s == TW_OK) s = mirror_in(m, &tdr, &D_dr);
  if (s == TW_OK) s = mirror_in(m, &tout, &D_out);
  if (s == TW_OK) s = mirror_in(m, &tdsrc, &D_dsrc);
  if (s == TW_OK) s = mirror_in(m, &tdtw, &D_dtw);
  if (s == TW_OK)
    s = tw_ep_dispatch_by_source(ctx, layer, D_tok, D_scl, D_idx, D_w, &D_src, &D_sscl, &D_row, &D_rw, &D_gs, &D_dr);
  if (s == TW_OK) s = mirror_out(m, &tsrc, &D_src);
  if (s == TW_OK) s = mirror_out(m, &tsscl, &D_sscl);
  if (s == TW_OK) s = mirror_out(m, &trow, &D_row);
  if (s == TW_OK) s = mirror_out(m, &trw, &D_rw);
  if (s == TW_OK) s = mirror_out(m, &tgs, &D_gs);
  if (s == TW_OK) s = mirror_out(m, &tdr, &D_dr);
  if (s == TW_OK) s = ep_exact(c, r, "src_tokens", &tsrc);
  if (s == TW_OK && c->scale_block) s = ep_exact(c, r, "src_scales", &tsscl);
  if (s == TW_OK) s = ep_exact(c, r, "recv_row", &trow);
  if (s == TW_OK) s = ep_exact(c, r, "recv_weights", &trw);
  if (s == TW_OK) s = ep_exact(c, r, "group_sizes", &tgs);
  if (s == TW_OK) s = ep_exact(c, r, "dropped", &tdr);
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, D_y, D_w, &D_out);
  if (s == TW_OK) s = mirror_out(m, &tout, &D_out);
  if (s == TW_OK) s = ep_exact(c, r, "out", &tout);
  if (s == TW_OK) s = tw_ep_combine_bwd_by_source(ctx, layer, D_dout, D_y, &D_dsrc, &D_dtw);
  if (s == TW_OK) s = mirror_out(m, &tdsrc, &D_dsrc);
  if (s == TW_OK) s = mirror_out(m, &tdtw, &D_dtw);
  if (s == TW_OK) s = ep_exact(c, r, "d_src", &tdsrc);
  if (s == TW_OK) s = ep_exact(c, r, "d_topk_weights_combine", &tdtw);
  if (on_device(m)) tw_ctx_sync(ctx);
  tw_ep_layer_destroy(layer);
  free(src); free(sscl); free(row); free(gs); free(dr); free(rw); free(out); free(dsrc); free(dtw);
  return s;
}

static tw_status ep_rank(int r, tw_comm *comm, void *arg) {
  ep_case *c = (ep_case *)arg;
  tw_golden_result *res = &c->sub[r];
  res->passed = 1;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = c->backend;
  cc.comm = comm;
  cc.device = c->backend == TW_BACKEND_REF ? 0 : r; /* gpu: rank r on GPU r (one NCCL rank per GPU) */
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_tensor tok = tw_tensor_none(), idx = tw_tensor_none(), w = tw_tensor_none(), dout = tw_tensor_none();
  tw_tensor scl = tw_tensor_none(), y = tw_tensor_none(), dy = tw_tensor_none(), dyw = tw_tensor_none();
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  int64_t maxT = 0; /* the largest T of the group: every rank reads every rank's topk_idx */
  tw_status s = TW_OK;
  for (int q = 0; s == TW_OK && q < c->n; q++) {
    tw_tensor t;
    s = ep_load(c, "topk_idx", q, &t);
    if (s == TW_OK) maxT = t.shape[0] > maxT ? t.shape[0] : maxT;
    if (s == TW_OK) free(t.data);
  }
  if (s == TW_OK) s = ep_load(c, "tokens", r, &tok);
  if (s == TW_OK && c->scale_block) s = ep_load(c, "token_scales", r, &scl);
  if (s == TW_OK) s = ep_load(c, "topk_idx", r, &idx);
  if (s == TW_OK) s = ep_load(c, "topk_weights", r, &w);
  if (s == TW_OK) s = ep_load(c, "d_out", r, &dout);
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = maxT; cfg.hidden = c->H; cfg.token_dtype = c->dt;
  cfg.alignment = c->A; cfg.recv_capacity = c->R; cfg.overflow = c->policy; cfg.scale_block = c->scale_block;
  if (s == TW_OK) s = tw_ep_create(ctx, comm, &cfg, &ep);
  if (s == TW_OK) s = tw_ep_layer_create(ep, &layer);
  int64_t T = tok.shape[0], H = c->H, R = c->R, k = c->k;
  int nle = c->E / (c->n > 0 ? c->n : 1);
  void *recv = calloc((size_t)(R * H) * 4 + 1, 1), *rscl = calloc((size_t)R * 8 + 1, 1);
  float *rw = calloc((size_t)R + 1, 4), *out = calloc((size_t)(T * H) + 1, 4), *dtok = calloc((size_t)(T * H) + 1, 4);
  float *dtw = calloc((size_t)(T * k) + 1, 4), *dexp = calloc((size_t)(R * H) + 1, 4);
  int32_t *gs = calloc((size_t)nle + 1, 4), *dropped = calloc((size_t)nle + 1, 4);
  if (s == TW_OK && !(recv && rscl && rw && out && dtok && dtw && dexp && gs && dropped))
    s = tw_error(TW_ERR_MEMORY, "ep golden: out of memory");
  tw_tensor none = tw_tensor_none(), rscl_t = tw_tensor_none();
  if (c->scale_block) rscl_t = tw_tensor_2d(rscl, TW_E8M0, R, H / c->scale_block, TW_MEM_HOST);
  tw_tensor trecv = tw_tensor_2d(recv, c->dt, R, H, TW_MEM_HOST), trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST), tdr = tw_tensor_1d(dropped, TW_I32, nle, TW_MEM_HOST);
  tw_tensor tout = tw_tensor_2d(out, TW_F32, T, H, TW_MEM_HOST), tdtok = tw_tensor_2d(dtok, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor tdtw = tw_tensor_2d(dtw, TW_F32, T, k, TW_MEM_HOST), tdexp = tw_tensor_2d(dexp, TW_F32, R, H, TW_MEM_HOST);
  /* inputs and outputs in the context's memory (device copies for a gpu rank) */
  mirror m = {ctx, {0}, 0};
  tw_tensor D_tok, D_scl, D_idx, D_w, D_recv, D_rscl, D_rw, D_gs, D_dr, D_y, D_out, D_dy, D_dyw, D_dtok, D_dtw, D_dout,
      D_dexp;
  if (s == TW_OK) s = mirror_in(&m, &tok, &D_tok);
  if (s == TW_OK) s = mirror_in(&m, &scl, &D_scl);
  if (s == TW_OK) s = mirror_in(&m, &idx, &D_idx);
  if (s == TW_OK) s = mirror_in(&m, &w, &D_w);
  if (s == TW_OK) s = mirror_in(&m, &dout, &D_dout);
  if (s == TW_OK) s = mirror_in(&m, &trecv, &D_recv);
  if (s == TW_OK) s = mirror_in(&m, &rscl_t, &D_rscl);
  if (s == TW_OK) s = mirror_in(&m, &trw, &D_rw);
  if (s == TW_OK) s = mirror_in(&m, &tgs, &D_gs);
  if (s == TW_OK) s = mirror_in(&m, &tdr, &D_dr);
  if (s == TW_OK) s = mirror_in(&m, &tout, &D_out);
  if (s == TW_OK) s = mirror_in(&m, &tdtok, &D_dtok);
  if (s == TW_OK) s = mirror_in(&m, &tdtw, &D_dtw);
  if (s == TW_OK) s = mirror_in(&m, &tdexp, &D_dexp);
  if (s == TW_OK) s = tw_ep_dispatch(ctx, layer, &D_tok, &D_scl, &D_idx, &D_w, &D_recv, &D_rscl, &D_rw, &D_gs, &D_dr);
  if (s == TW_OK) s = mirror_out(&m, &trecv, &D_recv);
  if (s == TW_OK) s = mirror_out(&m, &rscl_t, &D_rscl);
  if (s == TW_OK) s = mirror_out(&m, &trw, &D_rw);
  if (s == TW_OK) s = mirror_out(&m, &tgs, &D_gs);
  if (s == TW_OK) s = mirror_out(&m, &tdr, &D_dr);
  if (s == TW_OK) s = ep_exact(c, r, "recv_tokens", &trecv);
  if (s == TW_OK && c->scale_block) s = ep_exact(c, r, "recv_scales", &rscl_t);
  if (s == TW_OK) s = ep_exact(c, r, "recv_weights", &trw);
  if (s == TW_OK) s = ep_exact(c, r, "group_sizes", &tgs);
  if (s == TW_OK) s = ep_exact(c, r, "dropped", &tdr);
  if (s == TW_OK) s = ep_load(c, "expert_out", r, &y);
  if (s == TW_OK) s = mirror_in(&m, &y, &D_y);
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, &D_y, &D_w, &D_out);
  if (s == TW_OK) s = mirror_out(&m, &tout, &D_out);
  if (s == TW_OK) s = ep_exact(c, r, "out", &tout);
  if (s == TW_OK) s = ep_by_source(c, r, ctx, &m, ep, &D_tok, &D_scl, &D_idx, &D_w, &D_y, &D_dout, maxT);
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, &D_y, &none, &D_out);
  if (s == TW_OK) s = mirror_out(&m, &tout, &D_out);
  if (s == TW_OK) s = ep_exact(c, r, "out_unweighted", &tout);
  if (s == TW_OK) s = ep_load(c, "d_recv", r, &dy);
  if (s == TW_OK) s = ep_load(c, "d_recv_weights", r, &dyw);
  if (s == TW_OK) s = mirror_in(&m, &dy, &D_dy);
  if (s == TW_OK) s = mirror_in(&m, &dyw, &D_dyw);
  if (s == TW_OK) s = tw_ep_dispatch_bwd(ctx, layer, &D_dy, &D_dyw, &D_dtok, &D_dtw);
  if (s == TW_OK) s = mirror_out(&m, &tdtok, &D_dtok);
  if (s == TW_OK) s = mirror_out(&m, &tdtw, &D_dtw);
  if (s == TW_OK) s = ep_exact(c, r, "d_tokens", &tdtok);
  if (s == TW_OK) s = ep_exact(c, r, "d_topk_weights", &tdtw);
  if (s == TW_OK) s = tw_ep_combine_bwd(ctx, layer, &D_dout, &D_w, &D_y, &D_dexp, &D_dtw);
  if (s == TW_OK) s = mirror_out(&m, &tdexp, &D_dexp);
  if (s == TW_OK) s = mirror_out(&m, &tdtw, &D_dtw);
  if (s == TW_OK) s = ep_exact(c, r, "d_expert_out", &tdexp);
  if (s == TW_OK) s = ep_exact(c, r, "d_topk_weights_combine", &tdtw);
  if (on_device(&m)) tw_ctx_sync(ctx);
  mirror_free(&m);
  free(recv); free(rscl); free(rw); free(out); free(dtok); free(dtw); free(dexp); free(gs); free(dropped);
  free(tok.data); free(scl.data); free(idx.data); free(w.data); free(dout.data);
  free(y.data); free(dy.data); free(dyw.data);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

tw_status tw_golden_run_ep(tw_ctx *ctx, const char *dir, const tw_case_keys *k, tw_golden_result *res) {
  if (skip_if_missing(ctx, ctx->ops->ep != NULL, "EP dispatch/combine", res)) return TW_OK;
  ep_case *c = (ep_case *)calloc(1, sizeof *c);
  if (!c) return tw_error(TW_ERR_MEMORY, "ep golden: out of memory");
  double expect_error = 0;
  tw_status s = TW_OK;
  c->dir = dir;
  c->backend = tw_ctx_backend(ctx);
  const char *dt = tw_case_get(k, "dtype"), *policy = tw_case_get(k, "policy");
  if (!dt || !policy) s = tw_error(TW_ERR_IO, "case.txt needs 'dtype' and 'policy'");
#define EPNUM(key, var)                        \
  if (s == TW_OK) {                            \
    double v_;                                 \
    if (num(k, key, &v_) != 0) s = TW_ERR_IO;  \
    else var = v_;                             \
  }
  EPNUM("ep_size", c->n);
  EPNUM("E", c->E);
  EPNUM("k", c->k);
  EPNUM("H", c->H);
  EPNUM("A", c->A);
  EPNUM("R", c->R);
  EPNUM("scale_block", c->scale_block);
  EPNUM("expect_error", expect_error);
#undef EPNUM
  if (s == TW_OK && (c->n < 1 || c->n > EP_MAXR))
    s = tw_error(TW_ERR_IO, "case.txt: ep_size = %d outside [1, %d]", c->n, EP_MAXR);
  if (s == TW_OK) {
    c->dt = strcmp(dt, "bf16") == 0 ? TW_BF16 : strcmp(dt, "e4m3") == 0 ? TW_E4M3 : TW_F32;
    c->policy = strcmp(policy, "drop") == 0 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
  }
  tw_comm *comms[EP_MAXR] = {0};
  if (s == TW_OK && tw_ctx_mem(ctx) != TW_MEM_HOST) {
    /* a device backend: the case's ranks are threads over NCCL, rank r on GPU r */
    int have = tw_gpu_device_count ? tw_gpu_device_count() : 0;
    if (have < c->n || !tw_comm_init_nccl_local) {
      res->skipped = 1;
      snprintf(res->detail, sizeof res->detail, "needs %d GPUs, sees %d (EP on the gpu backend: one NCCL rank per GPU)",
               c->n, have);
      free(c);
      return TW_OK;
    }
    int devs[EP_MAXR];
    for (int r = 0; r < c->n; r++) devs[r] = r;
    s = tw_comm_init_nccl_local(c->n, devs, comms);
  } else if (s == TW_OK) {
    s = tw_comm_init_threads(c->n, comms);
  }
  if (s == TW_OK) {
    tw_status rs = tw_run_ranks(c->n, comms, ep_rank, c);
    for (int r = 0; r < c->n; r++) tw_comm_destroy(comms[r]);
    if (expect_error) {
      /* the capacity is too small under the error policy: every rank must refuse the step */
      tw_check_report rep;
      memset(&rep, 0, sizeof rep);
      rep.worst_index = -1;
      rep.count = 1;
      /* ref refuses on the host (TW_ERR_INVALID_ARG); a device backend sees the counts on the
       * device and reports through the error word (TW_ERR_DEVICE) with the same words */
      rep.passed = (rs == TW_ERR_INVALID_ARG || rs == TW_ERR_DEVICE) && strstr(tw_last_error(), "receive rows") != NULL;
      rep.mismatches = !rep.passed;
      tw_golden_record(res, "capacity_error", &rep);
      if (!rep.passed)
        snprintf(res->detail, sizeof res->detail, "expected TW_ERR_INVALID_ARG naming the receive rows, got %s: %.400s",
                 tw_status_name(rs), tw_last_error());
    } else if (rs != TW_OK) {
      s = rs;
    } else {
      for (int r = 0; r < c->n; r++) { /* each rank's worst output, in rank order */
        if (!c->sub[r].outputs) continue;
        int first_failure = res->passed && !c->sub[r].passed;
        tw_golden_record(res, c->sub[r].worst_output, &c->sub[r].worst);
        res->outputs += c->sub[r].outputs - 1; /* fold counted one */
        if (first_failure) snprintf(res->detail, sizeof res->detail, "%s", c->sub[r].detail);
      }
    }
  }
  free(c);
  return s;
}
