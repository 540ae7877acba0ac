/* EP dispatch / combine and both backward passes against the independent NumPy goldens of
 * golden/gen_ep.py, bit for bit (twin fixes the slot order; every f32 sum runs in the
 * documented order). Ranks are threads; expert outputs hold NaN on padding rows, which must
 * not leak into any result. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_util.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_npy.h"

#define MAXR 8

typedef struct {
  char dir[1400];
  int n, E, k, A, expect_error, scale_block;
  int64_t H, R;
  tw_dtype dt;
  tw_ep_overflow policy;
} ep_case;

static int case_key(const char *dir, const char *key, char *val) {
  char path[1500], line[256];
  snprintf(path, sizeof path, "%s/case.txt", dir);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) {
    char k[64];
    if (line[0] != '#' && sscanf(line, " %63s = %127s", k, val) == 2 && strcmp(k, key) == 0) found = 1;
  }
  fclose(f);
  return found;
}

static int64_t key_num(const char *dir, const char *key) {
  char v[128];
  cr_assert(case_key(dir, key, v), "%s: no %s", dir, key);
  return atoll(v);
}

/* Loads name_<rank>.npy; bf16 codes are viewed as bf16 when as_bf16. */
static tw_status load(const ep_case *c, const char *name, int r, tw_tensor *t) {
  char path[1600];
  snprintf(path, sizeof path, "%s/%s_%d.npy", c->dir, name, r);
  TW_TRY(tw_npy_load(path, t));
  tw_dtype as = t->dtype == TW_U16 ? TW_BF16 : t->dtype;
  if (t->dtype == TW_U8) as = strstr(name, "scales") ? TW_E8M0 : c->dt; /* fp8 codes and e8m0 scales */
  if (as != t->dtype) {
    tw_tensor v;
    TW_TRY(tw_tensor_view_as(t, as, &v));
    *t = v;
  }
  return TW_OK;
}

static tw_status expect_same(const ep_case *c, int r, const char *name, const tw_tensor *got) {
  tw_tensor want;
  TW_TRY(load(c, name, r, &want));
  size_t n = tw_tensor_bytes(&want);
  tw_status s = TW_OK;
  if (tw_tensor_numel(&want) != tw_tensor_numel(got) || n != tw_tensor_bytes(got))
    s = tw_error(TW_ERR_INTERNAL, "%s rank %d: %s has %lld elements, golden %lld", c->dir, r, name,
                 (long long)tw_tensor_numel(got), (long long)tw_tensor_numel(&want));
  else if (n && memcmp(want.data, got->data, n) != 0) {
    size_t i = 0;
    while (((unsigned char *)want.data)[i] == ((unsigned char *)got->data)[i]) i++;
    s = tw_error(TW_ERR_INTERNAL, "%s rank %d: %s differs from the golden at byte %zu (element %zu)", c->dir, r, name, i,
                 i / (size_t)(tw_dtype_bits(got->dtype) / 8));
  }
  free(want.data);
  return s;
}

static tw_status rank_body(int r, tw_comm *comm, void *arg) {
  const ep_case *c = arg;
  tw_ctx *ctx = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.comm = comm;
  TW_TRY(tw_ctx_create(&ctx, &cc));
  tw_tensor tok, idx, w, y, dout, dy, dyw, scl = tw_tensor_none(), rscl_t = tw_tensor_none();
  TW_TRY(load(c, "tokens", r, &tok));
  if (c->scale_block) TW_TRY(load(c, "token_scales", r, &scl));
  TW_TRY(load(c, "topk_idx", r, &idx));
  TW_TRY(load(c, "topk_weights", r, &w));
  TW_TRY(load(c, "d_out", r, &dout));
  /* max_tokens: the largest T of the group (every rank reads every rank's file size) */
  int64_t maxT = 0;
  for (int s = 0; s < c->n; s++) {
    tw_tensor t;
    TW_TRY(load(c, "topk_idx", s, &t));
    maxT = t.shape[0] > maxT ? t.shape[0] : maxT;
    free(t.data);
  }
  tw_ep_config cfg = TW_EP_CONFIG_INIT;
  cfg.num_experts = c->E; cfg.topk = c->k; cfg.max_tokens = maxT; cfg.hidden = c->H; cfg.token_dtype = c->dt;
  cfg.alignment = c->A; cfg.recv_capacity = c->R; cfg.overflow = c->policy; cfg.scale_block = c->scale_block;
  tw_ep *ep = NULL;
  tw_ep_layer *layer = NULL;
  TW_TRY(tw_ep_create(ctx, comm, &cfg, &ep));
  TW_TRY(tw_ep_layer_create(ep, &layer));
  int64_t T = tok.shape[0], H = c->H, R = c->R, k = c->k;
  int nle = c->E / c->n;
  void *recv = calloc((size_t)(R * H) * 4 + 1, 1), *rscl = calloc((size_t)R * 8 + 1, 1);
  if (c->scale_block) rscl_t = tw_tensor_2d(rscl, TW_E8M0, R, H / c->scale_block, TW_MEM_HOST);
  float *rw = calloc((size_t)R + 1, 4), *out = calloc((size_t)(T * H) + 1, 4), *dtok = calloc((size_t)(T * H) + 1, 4);
  float *dtw = calloc((size_t)(T * k) + 1, 4), *dexp = calloc((size_t)(R * H) + 1, 4);
  int32_t gs[64], dropped[64];
  tw_tensor none = tw_tensor_none();
  tw_tensor trecv = tw_tensor_2d(recv, c->dt, R, H, TW_MEM_HOST), trw = tw_tensor_1d(rw, TW_F32, R, TW_MEM_HOST);
  tw_tensor tgs = tw_tensor_1d(gs, TW_I32, nle, TW_MEM_HOST), tdr = tw_tensor_1d(dropped, TW_I32, nle, TW_MEM_HOST);
  tw_tensor tout = tw_tensor_2d(out, TW_F32, T, H, TW_MEM_HOST), tdtok = tw_tensor_2d(dtok, TW_F32, T, H, TW_MEM_HOST);
  tw_tensor tdtw = tw_tensor_2d(dtw, TW_F32, T, k, TW_MEM_HOST), tdexp = tw_tensor_2d(dexp, TW_F32, R, H, TW_MEM_HOST);
  tw_status s = tw_ep_dispatch(ctx, layer, &tok, &scl, &idx, &w, &trecv, &rscl_t, &trw, &tgs, &tdr);
  if (s == TW_OK) s = expect_same(c, r, "recv_tokens", &trecv);
  if (s == TW_OK && c->scale_block) s = expect_same(c, r, "recv_scales", &rscl_t);
  if (s == TW_OK) s = expect_same(c, r, "recv_weights", &trw);
  if (s == TW_OK) s = expect_same(c, r, "group_sizes", &tgs);
  if (s == TW_OK) s = expect_same(c, r, "dropped", &tdr);
  if (s == TW_OK) s = load(c, "expert_out", r, &y);
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, &y, &w, &tout);
  if (s == TW_OK) s = expect_same(c, r, "out", &tout);
  if (s == TW_OK) s = tw_ep_combine(ctx, layer, &y, &none, &tout);
  if (s == TW_OK) s = expect_same(c, r, "out_unweighted", &tout);
  if (s == TW_OK) s = load(c, "d_recv", r, &dy);
  if (s == TW_OK) s = load(c, "d_recv_weights", r, &dyw);
  if (s == TW_OK) s = tw_ep_dispatch_bwd(ctx, layer, &dy, &dyw, &tdtok, &tdtw);
  if (s == TW_OK) s = expect_same(c, r, "d_tokens", &tdtok);
  if (s == TW_OK) s = expect_same(c, r, "d_topk_weights", &tdtw);
  if (s == TW_OK) s = tw_ep_combine_bwd(ctx, layer, &dout, &w, &y, &tdexp, &tdtw);
  if (s == TW_OK) s = expect_same(c, r, "d_expert_out", &tdexp);
  if (s == TW_OK) s = expect_same(c, r, "d_topk_weights_combine", &tdtw);
  if (s == TW_OK) { free(y.data); free(dy.data); free(dyw.data); }
  free(recv); free(rscl); free(scl.data); free(rw); free(out); free(dtok); free(dtw); free(dexp);
  free(tok.data); free(idx.data); free(w.data); free(dout.data);
  tw_ep_layer_destroy(layer);
  tw_ep_destroy(ep);
  tw_ctx_destroy(ctx);
  return s;
}

Test(ep_golden, numpy_goldens) {
  char root[1024];
  snprintf(root, sizeof root, "%s/ep", tt_golden_root());
  DIR *d = opendir(root);
  cr_assert(d, "no golden directory %s", root);
  struct dirent *de;
  int n = 0;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    ep_case c;
    memset(&c, 0, sizeof c);
    snprintf(c.dir, sizeof c.dir, "%s/%s", root, de->d_name);
    char v[128];
    c.n = (int)key_num(c.dir, "ep_size");
    c.E = (int)key_num(c.dir, "E");
    c.k = (int)key_num(c.dir, "k");
    c.H = key_num(c.dir, "H");
    c.A = (int)key_num(c.dir, "A");
    c.R = key_num(c.dir, "R");
    c.expect_error = (int)key_num(c.dir, "expect_error");
    cr_assert(case_key(c.dir, "dtype", v));
    c.dt = strcmp(v, "bf16") == 0 ? TW_BF16 : strcmp(v, "e4m3") == 0 ? TW_E4M3 : TW_F32;
    c.scale_block = (int)key_num(c.dir, "scale_block");
    cr_assert(case_key(c.dir, "policy", v));
    c.policy = strcmp(v, "drop") == 0 ? TW_EP_OVERFLOW_DROP : TW_EP_OVERFLOW_ERROR;
    tw_comm *comms[MAXR];
    cr_assert_eq(tw_comm_init_threads(c.n, comms), TW_OK);
    tw_status s = tw_run_ranks(c.n, comms, rank_body, &c);
    if (c.expect_error)
      tt_expect_status(s, TW_ERR_INVALID_ARG, "receive rows");
    else
      cr_expect_eq(s, TW_OK, "%s: %s", c.dir, tw_last_error());
    for (int r = 0; r < c.n; r++) tw_comm_destroy(comms[r]);
    n++;
  }
  closedir(d);
  cr_expect_geq(n, 9, "ran %d ep golden cases", n);
}
