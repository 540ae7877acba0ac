/* The MoE block (include/twin/tw_moe.h): forward and its hand-written backward, composed from
 * twin's public ops (gemm, grouped GEMM, router, EP, collectives) and moe/elementwise.h, so
 * the same code runs on every backend. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/elementwise.h"
#include "twin/tw_comm.h"
#include "twin/tw_ep.h"
#include "twin/tw_gemm.h"
#include "twin/tw_moe.h"
#include "twin/tw_numerics.h"
#include "twin/tw_quantize.h"
#include "twin/tw_router.h"

int tw_moe_plant_skip_dp_reduce = 0;

/* fp8_gather: how one part of a quantized weight shard (the codes or the scales of one
 * orientation) travels over fsdp. The shard's part is `rows` runs of `run` elements, run r
 * from element r*ld_s (rows = 1: one run from element 0; rows = 0: the part does not travel).
 * The all-gather lays the ranks' runs out as [fs][rows*run]; tw_moe_swap_outer(P = fs, A, B),
 * A*B = rows*run, turns that into [rows][fs*run], and run r of it lands at element r*ld of the
 * gathered part. */
typedef struct {
  int64_t rows, run, ld_s, ld, A, B;
} fs_part;

struct tw_moe {
  tw_ctx *ctx;
  tw_moe_config cfg;
  tw_mesh mesh;
  tw_mesh_comms *mc;
  tw_comm *ep_comm, *dp_comm, *fsdp_comm, *tok_comm; /* dp/fsdp/tok: NULL when one rank */
  int fs;          /* fsdp size: wi, wo and their gradients are sharded on H into fs parts */
  int64_t Hs;      /* H / fs */
  int own_ep_comm;
  tw_ep *ep;
  tw_ep_layer *layer;
  int nle, k;
  int64_t R, E, H, F, T; /* T: the last forward's T_r */
  tw_dtype dt;
  int forwarded, aux_on;
  float aux_coeff_rank; /* aux_coeff * (T_r / T)^2: this rank's share of the global loss */
  size_t saved;
  void (*hook)(void *arg, const char *step); /* tw_moe_set_step_hook (benches) */
  void *hook_arg;
  /* saved for the backward */
  float *logits, *topk_w, *recv_w, *h;
  int32_t *idx, *counts, *gs;
  void *recv, *eo;
  /* scratch */
  float *y32, *d_a, *d_logits, *d_logits_aux, *d_topk_w, *d_recv_w;
  void *a, *d_h, *d_eo, *d_recv;
  /* FP8_* recipes: the fp8 copies of the GEMM operands (moe/block.c "fp8 operands") */
  int fp8;
  tw_scaling act_mode, w_mode;
  int32_t *gs_h, *gs_f; /* uniform group sizes of the weight sources: NLE x H, NLE x F */
  tw_qtensor q_recv, q_wi, q_wo, q_a, q_deo, q_dh;
  void *qbuf[6][5]; /* the q_* buffers, to free */
  /* fsdp > 1: the gathered weights (kept for the backward), full-size f32 gradients before
   * the reduce-scatter, and one staging buffer for the layout swaps */
  void *wi_full, *wo_full, *stage;
  float *dwi_full, *dwo_full;
  /* bf16 d_wi / d_wo with dp or fsdp > 1: the shard's f32 gradients, summed, then rounded once
   * (allocated by the first such backward) */
  float *dwi_f32, *dwo_f32;
  /* fp8_gather: the shards' fp8 copies, their uniform group sizes (Hs), the per-expert scales
   * (FP8_CURRENT) and how each part of wi (plan[0]) and wo (plan[1]) travels: row data, col
   * data, row scales, col scales */
  int qgather;
  int32_t *gs_hs;
  tw_qtensor qs_wi, qs_wo;
  void *qsbuf[2][5];
  float *scale_wi, *scale_wo;
  fs_part plan[2][4];
  /* tw_moe_set_weight_reuse: the weights' data pointers the kept copies were made from */
  int reuse, made;
  const void *made_wi, *made_wo;
};

const char *tw_moe_act_name(tw_moe_act a) {
  static const char *n[] = {"swiglu", "geglu", "bilinear"};
  return (int)a >= 0 && a < TW_MOE_ACT_COUNT ? n[a] : NULL;
}
const char *tw_moe_weighting_name(tw_moe_weighting w) {
  static const char *n[] = {"late", "early"};
  return (int)w >= 0 && w < TW_MOE_WEIGHTING_COUNT ? n[w] : NULL;
}
static const char *recipe_names[] = {"f32", "bf16", "fp8_current", "fp8_block", "fp8_mxfp8"};
const char *tw_moe_recipe_name(tw_moe_recipe r) {
  return (int)r >= 0 && r < TW_MOE_RECIPE_COUNT ? recipe_names[r] : NULL;
}
int tw_moe_recipe_from_name(const char *name, tw_moe_recipe *out) {
  for (int r = 0; name && r < TW_MOE_RECIPE_COUNT; r++)
    if (!strcmp(name, recipe_names[r])) {
      if (out) *out = (tw_moe_recipe)r;
      return 1;
    }
  return 0;
}

static tw_status check_config(const tw_moe_config *c) {
  const char *op = "moe_create";
  if (c->size != sizeof *c)
    return tw_error(TW_ERR_INVALID_ARG, "%s: cfg.size = %zu, expected %zu (use TW_MOE_CONFIG_INIT)", op, c->size,
                    sizeof *c);
  if (c->num_experts < 1 || c->hidden < 1 || c->ffn < 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: E = %d, H = %lld and F = %lld must all be >= 1", op, c->num_experts,
                    (long long)c->hidden, (long long)c->ffn);
  if (c->router.topk < 1 || c->router.topk > c->num_experts)
    return tw_error(TW_ERR_INVALID_ARG, "%s: topk = %d must be in [1, E = %d]", op, c->router.topk, c->num_experts);
  if (!tw_moe_act_name(c->act)) return tw_error(TW_ERR_INVALID_ARG, "%s: unknown activation %d", op, (int)c->act);
  if (!tw_moe_weighting_name(c->weighting))
    return tw_error(TW_ERR_INVALID_ARG, "%s: unknown weighting %d", op, (int)c->weighting);
  if (!tw_moe_recipe_name(c->recipe)) return tw_error(TW_ERR_INVALID_ARG, "%s: unknown recipe %d", op, (int)c->recipe);
  if (!(c->aux_coeff >= 0) || !isfinite(c->aux_coeff))
    return tw_error(TW_ERR_INVALID_ARG, "%s: aux_coeff = %g must be finite and >= 0", op, (double)c->aux_coeff);
  if (c->max_tokens < 0)
    return tw_error(TW_ERR_INVALID_ARG, "%s: max_tokens = %lld < 0", op, (long long)c->max_tokens);
  if (c->fp8_gather != 0 && c->fp8_gather != 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: fp8_gather = %d must be 0 or 1", op, c->fp8_gather);
  if (c->fp8_gather && c->recipe < TW_MOE_FP8_CURRENT)
    return tw_error(TW_ERR_INVALID_ARG,
                    "%s: fp8_gather = 1 needs an fp8 recipe (fp8_current, fp8_block or fp8_mxfp8; got %s)", op,
                    tw_moe_recipe_name(c->recipe) ? tw_moe_recipe_name(c->recipe) : "?");
  if (c->global_tokens < 1)
    return tw_error(TW_ERR_INVALID_ARG, "%s: global_tokens = %lld must be >= 1 (the aux loss divides by it)", op,
                    (long long)c->global_tokens);
  /* the weights (E H 2F elements) and the received rows' activations (at most max_tokens k E
   * rows of 2F, whatever the ep size) stay far from size_t overflow; the EP context bounds the rest */
  if ((double)c->num_experts * (double)c->hidden * 2.0 * (double)c->ffn > 9.0e15 ||
      (double)c->max_tokens * c->router.topk * (double)c->num_experts * 2.0 * (double)c->ffn > 9.0e15)
    return tw_error(TW_ERR_SHAPE, "%s: E = %d, H = %lld, F = %lld, k = %d, max_tokens = %lld: the sizes they give are "
                    "too large", op, c->num_experts, (long long)c->hidden, (long long)c->ffn, c->router.topk,
                    (long long)c->max_tokens);
  return TW_OK;
}

static tw_status check_mesh(const tw_mesh *m, int nranks) {
  char mb[96];
  for (int i = 0; i < m->naxes; i++) {
    tw_axis a = m->axis[i];
    if (a == TW_AXIS_DP || a == TW_AXIS_FSDP || a == TW_AXIS_EP) continue;
    return tw_error(TW_ERR_UNSUPPORTED,
                    "moe_create: mesh %s has axis %s; the MoE block shards over dp, fsdp and ep only (moe.axes)",
                    tw_mesh_str(m, mb, sizeof mb), tw_axis_name(a));
  }
  if (tw_mesh_ranks(m) != nranks)
    return tw_error(TW_ERR_INVALID_ARG, "moe_create: mesh %s has %d ranks but the communicator has %d",
                    tw_mesh_str(m, mb, sizeof mb), tw_mesh_ranks(m), nranks);
  return TW_OK;
}

static tw_status alloc(tw_moe *m, size_t bytes, void *out, int saved) {
  void **p = (void **)out;
  TW_TRY(tw_alloc(m->ctx, bytes ? bytes : 1, p));
  if (saved) m->saved += bytes;
  return TW_OK;
}

tw_status tw_moe_destroy(tw_moe *m) {
  if (!m) return TW_OK;
  void *bufs[] = {m->logits, m->topk_w, m->recv_w, m->h, m->idx, m->counts, m->gs, m->recv, m->eo,
                  m->y32, m->d_a, m->d_logits, m->d_logits_aux, m->d_topk_w, m->d_recv_w, m->a,
                  m->d_h, m->d_eo, m->d_recv};
  for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
    if (bufs[i]) tw_free(m->ctx, bufs[i]);
  for (int i = 0; i < 6; i++)
    for (int j = 0; j < 5; j++)
      if (m->qbuf[i][j]) tw_free(m->ctx, m->qbuf[i][j]);
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 5; j++)
      if (m->qsbuf[i][j]) tw_free(m->ctx, m->qsbuf[i][j]);
  void *fs_bufs[] = {m->wi_full,  m->wo_full, m->stage,    m->dwi_full, m->dwo_full,
                     m->dwi_f32,  m->dwo_f32, m->gs_hs, m->scale_wi, m->scale_wo};
  for (size_t i = 0; i < sizeof fs_bufs / sizeof *fs_bufs; i++)
    if (fs_bufs[i]) tw_free(m->ctx, fs_bufs[i]);
  if (m->gs_h) tw_free(m->ctx, m->gs_h);
  if (m->gs_f) tw_free(m->ctx, m->gs_f);
  tw_status s = tw_ep_layer_destroy(m->layer);
  tw_status t = tw_ep_destroy(m->ep);
  if (s == TW_OK) s = t;
  if (m->own_ep_comm) {
    t = tw_comm_destroy(m->ep_comm);
    if (s == TW_OK) s = t;
  }
  t = tw_mesh_comms_destroy(m->mc);
  if (s == TW_OK) s = t;
  free(m);
  return s;
}

/* ---- fp8 operands (FP8_* recipes) ----------------------------------------------------- */
/* q's buffers for an [M, K] source in G groups, both orientations (e4m3). Slot i of qbuf;
 * the colwise half counts as saved when save_col, the rowwise half when save_row. The
 * activations' colwise copies are wgrad operands only: token-padded (tw_quantize.h) where the
 * mode has that layout, so the wgrad reads them in place (act = 1). */
static tw_status alloc_q(tw_moe *m, void **bufs, tw_scaling mode, int64_t M, int64_t K, int64_t G, int save_row,
                         int save_col, int act, tw_qtensor *q) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = mode;
  o.layout = TW_ROWWISE_COLWISE;
  o.col_padded = act && mode != TW_SCALE_MXFP8_1D;
  TW_TRY(tw_quantize_output_shapes(&o, M, K, G, q));
  tw_tensor *parts[5] = {&q->row_data, &q->row_scale_inv, &q->col_data, &q->col_scale_inv, &q->amax};
  int saved[5] = {save_row, save_row, save_col, save_col, save_row || save_col};
  int j = 0;
  for (int i = 0; i < 5; i++) {
    if (tw_tensor_is_none(parts[i])) continue;
    parts[i]->mem = tw_ctx_mem(m->ctx);
    TW_TRY(alloc(m, tw_tensor_bytes(parts[i]), &parts[i]->data, saved[i]));
    bufs[j++] = parts[i]->data;
  }
  return TW_OK;
}

/* NLE copies of v as i32 in the context's memory (the uniform group sizes of a weight). */
static tw_status uniform_sizes(tw_moe *m, int64_t v, int32_t **out) {
  TW_TRY(alloc(m, 4 * (size_t)m->nle, out, 0));
  int32_t *h = (int32_t *)malloc(4 * (size_t)m->nle);
  if (!h) return tw_error(TW_ERR_MEMORY, "moe_create: out of host memory");
  for (int i = 0; i < m->nle; i++) h[i] = (int32_t)v;
  tw_tensor src = tw_tensor_1d(h, TW_I32, m->nle, TW_MEM_HOST), dst = tw_tensor_1d(*out, TW_I32, m->nle, tw_ctx_mem(m->ctx));
  tw_status s = tw_tensor_copy(m->ctx, &dst, &src);
  if (s == TW_OK) s = tw_ctx_sync(m->ctx);
  free(h);
  return s;
}

static tw_status alloc_fp8(tw_moe *m) {
  int64_t R = m->R, H = m->H, F = m->F, G = m->nle;
  TW_TRY(uniform_sizes(m, H, &m->gs_h));
  TW_TRY(uniform_sizes(m, F, &m->gs_f));
  TW_TRY(alloc_q(m, m->qbuf[0], m->act_mode, R, H, G, 0, 1, 1, &m->q_recv)); /* colwise kept for d_wi */
  TW_TRY(alloc_q(m, m->qbuf[1], m->w_mode, G * H, 2 * F, G, 1, 1, 0, &m->q_wi));
  TW_TRY(alloc_q(m, m->qbuf[2], m->w_mode, G * F, H, G, 1, 1, 0, &m->q_wo));
  TW_TRY(alloc_q(m, m->qbuf[3], m->act_mode, R, F, G, 0, 1, 1, &m->q_a));  /* colwise kept for d_wo */
  TW_TRY(alloc_q(m, m->qbuf[4], m->act_mode, R, H, G, 0, 0, 1, &m->q_deo));
  TW_TRY(alloc_q(m, m->qbuf[5], m->act_mode, R, 2 * F, G, 0, 0, 1, &m->q_dh));
  return TW_OK;
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static fs_part whole(int64_t A, int64_t B) { return (fs_part){1, A * B, 0, 0, A, B}; }

/* fp8_gather's plan (fs_part above) from tw_quantize.h's layouts. Shards: wi [G*Hs, K = 2F] in
 * groups of Hs rows, wo [G*F, Hs] in groups of F rows; for the block modes Hs % 128 == 0
 * (tw_moe_create), so a shard's blocks and 128-row tiles are whole blocks and tiles of the
 * gathered weight, and only their places change:
 *   codes: rowwise [rows, cols]; colwise per-group transposed ([K, Hs] and [Hs, F] per
 *     expert), MXFP8's colwise untransposed like the rowwise.
 *   BLOCK_128x128 (T(g) = the 128-row tiles before expert g):
 *     wi rowwise [T(g) + b][kb]: each expert's Hs/128 tile rows, expert by expert;
 *     wi colwise [kb][T(g) + b]: kb rows of T_cap slots, G*Hs/128 of them used in a shard's
 *       (the used runs packed, gathered, one swap puts every row's shards in place, then the
 *       rows go back at the gathered array's T_cap stride);
 *     wo rowwise [t][kb]: the shards' Hs/128 tile columns side by side in every used row t
 *       (t < G*ceil(F/128));
 *     wo colwise [kb][t]: the shards' tile rows one after another (a plain concatenation of
 *       the whole arrays, T_cap slots per row).
 *   MXFP8 (swizzled: 512-byte tiles of 128 scale rows x 4 scale columns, row-tile major):
 *     wi rowwise: each expert's [Hs, ceil(K/32) padded to 4] block, whole 128-row tiles;
 *     wi colwise: each expert's transposed [roundup(K, 128), Hs/32] block: per 128-row tile of
 *       it, Hs/128 tiles of 4 columns (4*Hs bytes);
 *     wo rowwise: each expert's [128*ceil(F/128), Hs/32] block: per 128-row tile, 4*Hs bytes;
 *     wo colwise: each expert's transposed [Hs, 4*ceil(F/128)] block, whole 128-row tiles.
 *   TENSOR_CURRENT: the scales do not travel (every rank computes them from the amax). */
static void plan_gather(tw_moe *m) {
  int64_t G = m->nle, Hs = m->Hs, F = m->F, K = 2 * m->F;
  int mx = m->w_mode == TW_SCALE_MXFP8_1D;
  fs_part *wi = m->plan[0], *wo = m->plan[1], none = {0, 0, 0, 0, 0, 0};
  wi[0] = whole(G, Hs * K);
  wi[1] = mx ? wi[0] : whole(G * K, Hs);
  wo[0] = whole(G * F, Hs);
  wo[1] = mx ? wo[0] : whole(G, Hs * F);
  if (m->w_mode == TW_SCALE_BLOCK_128x128) {
    int64_t kb = cdiv(K, 128), t = m->q_wo.col_scale_inv.shape[1];
    wi[2] = whole(G, Hs / 128 * kb);
    wi[3] = (fs_part){kb, G * Hs / 128, m->qs_wi.col_scale_inv.shape[1], m->q_wi.col_scale_inv.shape[1], kb * G, Hs / 128};
    wo[2] = whole(G * cdiv(F, 128), Hs / 128);
    wo[3] = whole(1, Hs / 128 * t);
  } else if (mx) {
    int64_t c = cdiv(cdiv(K, 32), 4) * 4, ck = cdiv(K, 128), ft = cdiv(F, 128);
    wi[2] = whole(G, Hs * c);
    wi[3] = whole(G * ck, 4 * Hs);
    wo[2] = whole(G * ft, 4 * Hs);
    wo[3] = whole(G, Hs * 4 * ft);
  } else {
    wi[2] = wi[3] = wo[2] = wo[3] = none;
  }
}

/* The stage bytes one part needs (the gathered runs; a strided part also packs its runs and
 * swaps them above those), or an internal error if the plan leaves its tensors' bounds. */
static tw_status part_stage_bytes(const tw_moe *m, const fs_part *p, const tw_tensor *src, const tw_tensor *dst,
                                  size_t *need) {
  *need = 0;
  if (p->rows == 0) return TW_OK;
  int64_t n = p->rows * p->run, fs = m->fs;
  int64_t last_s = (p->rows - 1) * p->ld_s + p->run, last = p->rows == 1 ? fs * n : (p->rows - 1) * p->ld + fs * p->run;
  if (p->A * p->B != n || last_s > tw_tensor_numel(src) || last > tw_tensor_numel(dst) ||
      (p->rows > 1 && (p->ld_s < p->run || p->ld < fs * p->run)))
    return tw_error(TW_ERR_INTERNAL, "moe_create: fp8_gather plan of %lld x %lld elements (A = %lld, B = %lld) does not fit a %lld-element shard part and a %lld-element gathered part",
                    (long long)p->rows, (long long)p->run, (long long)p->A, (long long)p->B,
                    (long long)tw_tensor_numel(src), (long long)tw_tensor_numel(dst));
  if (p->rows == 1 && p->A == 1) return TW_OK; /* gathered straight into place */
  *need = (p->rows > 1 ? 2 : 1) * (size_t)(fs * n) * tw_dtype_storage_bytes(src->dtype, 1);
  return TW_OK;
}

/* fp8_gather: the shards' fp8 copies ([NLE*Hs, 2F] in groups of Hs rows, [NLE*F, Hs] in
 * groups of F rows), their per-expert scales (FP8_CURRENT) and the plan; *stage_need: the
 * stage bytes the plan needs. */
static tw_status alloc_qgather(tw_moe *m, size_t *stage_need) {
  int64_t G = m->nle;
  TW_TRY(uniform_sizes(m, m->Hs, &m->gs_hs));
  TW_TRY(alloc_q(m, m->qsbuf[0], m->w_mode, G * m->Hs, 2 * m->F, G, 0, 0, 0, &m->qs_wi));
  TW_TRY(alloc_q(m, m->qsbuf[1], m->w_mode, G * m->F, m->Hs, G, 0, 0, 0, &m->qs_wo));
  if (m->w_mode == TW_SCALE_TENSOR_CURRENT) {
    TW_TRY(alloc(m, 4 * (size_t)G, &m->scale_wi, 0));
    TW_TRY(alloc(m, 4 * (size_t)G, &m->scale_wo, 0));
  }
  plan_gather(m);
  *stage_need = 0;
  for (int w = 0; w < 2; w++) {
    const tw_qtensor *qs = w ? &m->qs_wo : &m->qs_wi, *q = w ? &m->q_wo : &m->q_wi;
    const tw_tensor *src[4] = {&qs->row_data, &qs->col_data, &qs->row_scale_inv, &qs->col_scale_inv};
    const tw_tensor *dst[4] = {&q->row_data, &q->col_data, &q->row_scale_inv, &q->col_scale_inv};
    for (int i = 0; i < 4; i++) {
      size_t need;
      TW_TRY(part_stage_bytes(m, &m->plan[w][i], src[i], dst[i], &need));
      if (need > *stage_need) *stage_need = need;
    }
  }
  return TW_OK;
}

static tw_status quantize(tw_moe *m, const tw_tensor *x, const int32_t *gs, tw_qtensor *q) {
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = q->mode;
  o.layout = TW_ROWWISE_COLWISE;
  o.col_padded = q->col_padded;
  tw_tensor g = tw_tensor_1d((void *)gs, TW_I32, m->nle, tw_ctx_mem(m->ctx));
  return tw_grouped_quantize(m->ctx, x, &g, &o, q);
}

/* The orientation whose blocks run along the source's rows (the dim a GEMM contracts when
 * it reads this operand as [K, N] or, in wgrad, over tokens) and the op that reads it:
 * transposed colwise copies (tensor, 1x128, 128x128) are read with op T, MXFP8's colwise
 * data keeps x's layout (op N). */
static tw_operand rows_operand(const tw_qtensor *q, tw_op *op) {
  *op = q->mode == TW_SCALE_MXFP8_1D ? TW_OP_N : TW_OP_T;
  return tw_operand_colwise(q);
}

static tw_status create_comms(tw_moe *m, const tw_mesh *mesh) {
  tw_comm *world = tw_ctx_comm(m->ctx);
  if (!world)
    return tw_error(TW_ERR_INVALID_ARG,
                    "moe_create: the context has no communicator (EP needs one: a one-rank communicator for one rank)");
  int n = tw_comm_size(world);
  if (mesh) {
    TW_TRY(check_mesh(mesh, n));
    m->mesh = *mesh;
  } else {
    tw_axis ax = TW_AXIS_EP;
    TW_TRY(tw_mesh_init(&m->mesh, 1, &ax, &n));
  }
  TW_TRY(tw_mesh_comms_create(m->ctx, &m->mesh, &m->mc));
  m->dp_comm = tw_mesh_comms_axis(m->mc, TW_AXIS_DP);
  m->fsdp_comm = tw_mesh_comms_axis(m->mc, TW_AXIS_FSDP);
  m->fs = tw_mesh_axis_size(&m->mesh, TW_AXIS_FSDP);
  if (m->H % m->fs != 0)
    return tw_error(TW_ERR_INVALID_ARG, "moe_create: H = %lld does not split over fsdp = %d (moe.fsdp: the expert weights are sharded on H)",
                    (long long)m->H, m->fs);
  m->Hs = m->H / m->fs;
  /* fp8_gather with block scales: a shard's blocks must be the gathered weight's blocks, and
   * its scale layout whole tiles of the gathered one (tw_moe.h, Sharding) */
  if (m->cfg.fp8_gather && m->fs > 1 && m->cfg.recipe != TW_MOE_FP8_CURRENT && m->Hs % 128 != 0)
    return tw_error(TW_ERR_INVALID_ARG,
                    "moe_create: fp8_gather = 1 with recipe %s needs H / fsdp a multiple of 128, got H = %lld, fsdp = %d, "
                    "H / fsdp = %lld (moe.fp8_gather: %s must not cross the fsdp shard boundary)",
                    tw_moe_recipe_name(m->cfg.recipe), (long long)m->H, m->fs, (long long)m->Hs,
                    m->cfg.recipe == TW_MOE_FP8_BLOCK ? "the weights' 128x128 scale tiles"
                                                      : "the weights' MXFP8 blocks of 32 and the 128x4 tiles of their swizzled scales");
  m->tok_comm = n > 1 ? world : NULL;
  m->ep_comm = tw_mesh_comms_axis(m->mc, TW_AXIS_EP);
  if (!m->ep_comm) { /* ep = 1: each rank its own EP group */
    if (n == 1) m->ep_comm = world;
    else {
      TW_TRY(tw_comm_split(world, tw_comm_rank(world), 0, &m->ep_comm));
      m->own_ep_comm = 1;
    }
  }
  return TW_OK;
}

tw_status tw_moe_create(tw_ctx *ctx, const tw_mesh *mesh, const tw_moe_config *cfg, tw_moe **out) {
  if (!ctx || !cfg || !out) return tw_error(TW_ERR_NULL, "moe_create: ctx, cfg or out is NULL");
  *out = NULL;
  TW_TRY(check_config(cfg));
  tw_moe *m = (tw_moe *)calloc(1, sizeof *m);
  if (!m) return tw_error(TW_ERR_MEMORY, "moe_create: out of host memory");
  m->ctx = ctx;
  m->cfg = *cfg;
  m->E = cfg->num_experts; m->H = cfg->hidden; m->F = cfg->ffn; m->k = cfg->router.topk;
  m->dt = cfg->recipe == TW_MOE_F32 ? TW_F32 : TW_BF16;
  m->fp8 = cfg->recipe >= TW_MOE_FP8_CURRENT;
  m->act_mode = cfg->recipe == TW_MOE_FP8_CURRENT ? TW_SCALE_TENSOR_CURRENT
                : cfg->recipe == TW_MOE_FP8_BLOCK ? TW_SCALE_BLOCK_1x128 : TW_SCALE_MXFP8_1D;
  m->w_mode = cfg->recipe == TW_MOE_FP8_BLOCK ? TW_SCALE_BLOCK_128x128 : m->act_mode;
  tw_status s = create_comms(m, mesh);
  tw_ep_config ec = TW_EP_CONFIG_INIT;
  if (s == TW_OK) {
    ec.num_experts = cfg->num_experts; ec.topk = m->k; ec.max_tokens = cfg->max_tokens; ec.hidden = m->H;
    ec.token_dtype = m->dt; ec.recv_capacity = cfg->recv_capacity; ec.alignment = cfg->alignment;
    s = tw_ep_create(ctx, m->ep_comm, &ec, &m->ep);
    if (s == TW_OK) s = tw_ep_layer_create(m->ep, &m->layer);
  }
  if (s != TW_OK) {
    tw_moe_destroy(m);
    return s;
  }
  m->nle = tw_ep_local_experts(m->ep);
  m->R = tw_ep_recv_capacity(m->ep);
  size_t T = (size_t)cfg->max_tokens, E = (size_t)m->E, k = (size_t)m->k, R = (size_t)m->R, H = (size_t)m->H,
         F = (size_t)m->F, es = m->dt == TW_BF16 ? 2 : 4;
  size_t ws = 0, layer_state = 0;
  ec.recv_capacity = m->R;
  s = tw_ep_workspace_bytes(&ec, tw_comm_size(m->ep_comm), &ws, &layer_state);
  m->saved = layer_state;
  int late = cfg->weighting == TW_MOE_WEIGHT_LATE;
  if (s == TW_OK) s = alloc(m, 4 * T * E, &m->logits, 1);
  if (s == TW_OK) s = alloc(m, 4 * T * k, &m->idx, 1);
  if (s == TW_OK) s = alloc(m, 4 * T * k, &m->topk_w, 1);
  if (s == TW_OK) s = alloc(m, 4 * E, &m->counts, 1);
  if (s == TW_OK) s = alloc(m, es * R * H, &m->recv, !m->fp8);
  if (s == TW_OK) s = alloc(m, 4 * R, &m->recv_w, 1);
  if (s == TW_OK) s = alloc(m, 4 * (size_t)m->nle, &m->gs, 1);
  if (s == TW_OK) s = alloc(m, 4 * R * 2 * F, &m->h, 1);
  if (s == TW_OK) s = alloc(m, es * R * H, &m->eo, late);
  if (s == TW_OK) s = alloc(m, 4 * R * H, &m->y32, 0);
  if (s == TW_OK) s = alloc(m, es * R * F, &m->a, 0);
  if (s == TW_OK) s = alloc(m, 4 * R * F, &m->d_a, 0);
  if (s == TW_OK) s = alloc(m, es * R * 2 * F, &m->d_h, 0);
  if (s == TW_OK) s = alloc(m, es * R * H, &m->d_eo, 0);
  if (s == TW_OK) s = alloc(m, es * R * H, &m->d_recv, 0);
  if (s == TW_OK) s = alloc(m, 4 * T * E, &m->d_logits, 0);
  if (s == TW_OK) s = alloc(m, 4 * T * E, &m->d_logits_aux, 0);
  if (s == TW_OK) s = alloc(m, 4 * T * k, &m->d_topk_w, 0);
  if (s == TW_OK) s = alloc(m, 4 * R, &m->d_recv_w, 0);
  if (s == TW_OK && m->fp8) s = alloc_fp8(m);
  m->qgather = m->fs > 1 && cfg->fp8_gather;
  if (s == TW_OK && m->fs > 1) { /* gathered weights kept for the backward; the rest scratch */
    size_t wi_n = (size_t)m->nle * H * 2 * F, wo_n = (size_t)m->nle * F * H, big = wi_n > wo_n ? wi_n : wo_n;
    if (!m->qgather) s = alloc(m, es * wi_n, &m->wi_full, 1);
    if (s == TW_OK && !m->qgather) s = alloc(m, es * wo_n, &m->wo_full, 1);
    size_t stage = 4 * big, need = 0; /* f32 gradients; fp8_gather: its plan's parts */
    if (s == TW_OK && m->qgather) s = alloc_qgather(m, &need);
    if (s == TW_OK) s = alloc(m, need > stage ? need : stage, &m->stage, 0);
    if (s == TW_OK) s = alloc(m, 4 * wi_n, &m->dwi_full, 0);
    if (s == TW_OK) s = alloc(m, 4 * wo_n, &m->dwo_full, 0);
  }
  if (s != TW_OK) {
    tw_moe_destroy(m);
    return s;
  }
  *out = m;
  return TW_OK;
}

int tw_moe_local_experts(const tw_moe *m) { return m ? m->nle : 0; }

double tw_moe_error_budget(const tw_moe_config *c, int64_t T, int gradient) {
  if (c->recipe == TW_MOE_F32) {
    double k = (double)(c->hidden + 2 * c->ffn + c->router.topk + 16);
    return ldexp(gradient ? k + (double)(c->num_experts + T) : k, -24);
  }
  double b = ldexp(gradient ? 16 : 8, -8); /* BF16: about eight bf16 roundings, twice for gradients */
  return c->recipe == TW_MOE_BF16 ? b : b + ldexp(gradient ? 16 : 8, -4); /* FP8_*: e4m3 quantizations */
}
size_t tw_moe_saved_bytes(const tw_moe *m) { return m ? m->saved : 0; }

/* ---- argument checks ----------------------------------------------------------------- */
static tw_status check_tensor(const char *op, const char *name, const tw_tensor *t, tw_mem mem, tw_dtype dt, int ndim,
                              int64_t d0, int64_t d1, int64_t d2) {
  if (tw_tensor_is_none(t)) return tw_error(TW_ERR_NULL, "%s: %s is missing", op, name);
  int64_t want[3] = {d0, d1, d2};
  int ok = t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == want[i];
  if (!ok) {
    char got[96];
    tw_tensor_str(t, got, sizeof got);
    if (ndim == 3)
      return tw_error(TW_ERR_SHAPE, "%s: %s is %s, expected [%lld, %lld, %lld]", op, name, got, (long long)d0,
                      (long long)d1, (long long)d2);
    return tw_error(TW_ERR_SHAPE, "%s: %s is %s, expected [%lld, %lld]", op, name, got, (long long)d0, (long long)d1);
  }
  if (t->dtype != dt)
    return tw_error(TW_ERR_DTYPE, "%s: %s is %s, expected %s", op, name, tw_dtype_name(t->dtype), tw_dtype_name(dt));
  if (t->mem != mem)
    return tw_error(TW_ERR_MEMORY, "%s: %s lives in %s memory, this context needs %s", op, name,
                    t->mem == TW_MEM_DEVICE ? "device" : "host", mem == TW_MEM_DEVICE ? "device" : "host");
  if (!t->data && tw_tensor_numel(t) > 0) return tw_error(TW_ERR_NULL, "%s: %s has no data", op, name);
  return TW_OK;
}

static int has_bias(const tw_moe_weights *w) { return !tw_tensor_is_none(&w->bi) || !tw_tensor_is_none(&w->bo); }

static tw_status check_weights(const char *op, const tw_moe *m, const tw_moe_weights *w) {
  if (!w) return tw_error(TW_ERR_NULL, "%s: weights is NULL", op);
  tw_mem mem = tw_ctx_mem(m->ctx);
  TW_TRY(check_tensor(op, "gate", &w->gate, mem, m->dt, 2, m->H, m->E, 0));
  TW_TRY(check_tensor(op, "wi", &w->wi, mem, m->dt, 3, m->nle, m->Hs, 2 * m->F));
  TW_TRY(check_tensor(op, "wo", &w->wo, mem, m->dt, 3, m->nle, m->F, m->Hs));
  int hi = !tw_tensor_is_none(&w->bi), ho = !tw_tensor_is_none(&w->bo);
  if (hi != ho)
    return tw_error(TW_ERR_INVALID_ARG, "%s: biases are all-or-nothing: %s is given but %s is missing", op,
                    hi ? "bi" : "bo", hi ? "bo" : "bi");
  if (hi) {
    TW_TRY(check_tensor(op, "bi", &w->bi, mem, TW_F32, 2, m->nle, 2 * m->F, 0));
    TW_TRY(check_tensor(op, "bo", &w->bo, mem, TW_F32, 2, m->nle, m->H, 0));
  }
  return TW_OK;
}

static tw_status check_tokens(const char *op, const tw_moe *m, const char *name, const tw_tensor *x, int64_t T) {
  TW_TRY(check_tensor(op, name, x, tw_ctx_mem(m->ctx), m->dt, 2, T < 0 ? (x && x->ndim == 2 ? x->shape[0] : 0) : T,
                      m->H, 0));
  if (x->shape[0] > m->cfg.max_tokens)
    return tw_error(TW_ERR_INVALID_ARG, "%s: %s has %lld tokens, above max_tokens = %lld", op, name,
                    (long long)x->shape[0], (long long)m->cfg.max_tokens);
  return TW_OK;
}

/* The step about to run, for a bench's timer (no-op without a hook). */
static void mark(tw_moe *m, const char *name) {
  if (m->hook) m->hook(m->hook_arg, name);
}

tw_status tw_moe_set_weight_reuse(tw_moe *m, int reuse) {
  if (!m) return tw_error(TW_ERR_NULL, "moe_set_weight_reuse: moe is NULL");
  if (reuse != 0 && reuse != 1) return tw_error(TW_ERR_INVALID_ARG, "moe_set_weight_reuse: reuse = %d must be 0 or 1", reuse);
  m->reuse = reuse;
  return TW_OK;
}

void tw_moe_set_step_hook(tw_moe *m, void (*fn)(void *arg, const char *step), void *arg) {
  if (!m) return;
  m->hook = fn;
  m->hook_arg = arg;
}

/* The failing step names itself in front of the op's own message. */
static tw_status step(tw_status s, const char *op, const char *what) {
  if (s == TW_OK) return s;
  char msg[TW_ERROR_MAX];
  snprintf(msg, sizeof msg, "%s", tw_last_error());
  return tw_error(s, "%s (%s): %s", op, what, msg);
}

/* ---- GEMM helpers -------------------------------------------------------------------- */
static tw_tensor t2(const tw_moe *m, void *p, tw_dtype dt, int64_t r, int64_t c) {
  return tw_tensor_2d(p, dt, r, c, tw_ctx_mem(m->ctx));
}

static tw_status mm(tw_moe *m, tw_tensor a, tw_op oa, tw_tensor b, tw_op ob, tw_tensor out, int acc) {
  tw_operand pa = tw_operand_plain(&a), pb = tw_operand_plain(&b);
  return tw_gemm(m->ctx, &pa, oa, &pb, ob, &out, acc);
}

static tw_status gg(tw_moe *m, tw_tensor lhs, const tw_tensor *rhs, tw_op op, tw_tensor out) {
  tw_tensor gs = tw_tensor_1d(m->gs, TW_I32, m->nle, tw_ctx_mem(m->ctx));
  tw_operand pl = tw_operand_plain(&lhs), pr = tw_operand_plain(rhs);
  return tw_grouped_gemm(m->ctx, &pl, &pr, op, &gs, &out, 0);
}

static tw_status wgrad(tw_moe *m, tw_tensor lhs, tw_tensor rhs, const tw_tensor *out) {
  tw_tensor gs = tw_tensor_1d(m->gs, TW_I32, m->nle, tw_ctx_mem(m->ctx));
  tw_operand pl = tw_operand_plain(&lhs), pr = tw_operand_plain(&rhs);
  tw_tensor o = *out;
  return tw_grouped_gemm_wgrad(m->ctx, &pl, TW_OP_N, &pr, TW_OP_N, &gs, &o, 0);
}

/* fp8 grouped forward: out = rowwise(lhs) @ op(rhs) with rhs's orientation as given. */
static tw_status gg_q(tw_moe *m, const tw_qtensor *lhs, tw_operand rhs, tw_op op, tw_tensor out) {
  tw_tensor gs = tw_tensor_1d(m->gs, TW_I32, m->nle, tw_ctx_mem(m->ctx));
  tw_operand pl = tw_operand_rowwise(lhs);
  return tw_grouped_gemm(m->ctx, &pl, &rhs, op, &gs, &out, 0);
}

/* fp8 wgrad: out[g] = lhs_g^T rhs_g from the colwise copies (blocks along tokens). */
static tw_status wgrad_q(tw_moe *m, const tw_qtensor *lhs, const tw_qtensor *rhs, const tw_tensor *out) {
  tw_tensor gs = tw_tensor_1d(m->gs, TW_I32, m->nle, tw_ctx_mem(m->ctx)), o = *out;
  tw_op ol, orr;
  tw_operand pl = rows_operand(lhs, &ol), pr = rows_operand(rhs, &orr);
  return tw_grouped_gemm_wgrad(m->ctx, &pl, ol, &pr, orr, &gs, &o, 0);
}

/* The weights as 2-D sources: wi [NLE*H, 2F], wo [NLE*F, H]. */
static tw_tensor flat(const tw_moe *m, const tw_tensor *w) {
  return t2(m, w->data, w->dtype, w->shape[0] * w->shape[1], w->shape[2]);
}

/* fsdp: the full weights from the shards. all_gather gives [fs][NLE][Hs*2F] for wi (wants
 * [NLE][fs][Hs*2F]) and [fs][NLE*F][Hs] for wo (wants [NLE*F][fs][Hs]). */
static tw_status gather_weights(tw_moe *m, const tw_moe_weights *w) {
  size_t es = m->dt == TW_BF16 ? 2 : 4;
  int64_t wi_n = m->nle * m->Hs * 2 * m->F, wo_n = m->nle * m->F * m->Hs;
  TW_TRY(tw_all_gather(m->ctx, m->fsdp_comm, w->wi.data, m->stage, wi_n, m->dt));
  TW_TRY(tw_moe_swap_outer(m->ctx, m->stage, m->fs, m->nle, m->Hs * 2 * m->F, es, m->wi_full));
  TW_TRY(tw_all_gather(m->ctx, m->fsdp_comm, w->wo.data, m->stage, wo_n, m->dt));
  return tw_moe_swap_outer(m->ctx, m->stage, m->fs, m->nle * m->F, m->Hs, es, m->wo_full);
}

/* n elements of dtype from src to dst (both in ctx memory). */
static tw_status copy_run(tw_moe *m, tw_dtype dt, const void *src, void *dst, int64_t n) {
  tw_mem mem = tw_ctx_mem(m->ctx);
  tw_tensor s = tw_tensor_1d((void *)src, dt, n, mem), d = tw_tensor_1d(dst, dt, n, mem);
  return tw_tensor_copy(m->ctx, &d, &s);
}

/* One part of a quantized shard gathered over fsdp into its place in the gathered weight's
 * quantized tensor (fs_part above). */
static tw_status gather_part(tw_moe *m, const fs_part *p, const tw_tensor *src, tw_tensor *dst) {
  if (p->rows == 0) return TW_OK;
  tw_ctx *ctx = m->ctx;
  size_t es = tw_dtype_storage_bytes(src->dtype, 1);
  int64_t n = p->rows * p->run, fs = m->fs;
  char *stage = (char *)m->stage, *above = stage + (size_t)(fs * n) * es;
  const char *send = (const char *)src->data;
  if (p->rows == 1 && p->A == 1) return tw_all_gather(ctx, m->fsdp_comm, send, dst->data, n, src->dtype);
  if (p->rows > 1) { /* the runs packed above the gathered ones */
    for (int64_t r = 0; r < p->rows; r++)
      TW_TRY(copy_run(m, src->dtype, send + (size_t)(r * p->ld_s) * es, above + (size_t)(r * p->run) * es, p->run));
    send = above;
  }
  TW_TRY(tw_all_gather(ctx, m->fsdp_comm, send, stage, n, src->dtype));
  if (p->rows == 1) return tw_moe_swap_outer(ctx, stage, fs, p->A, p->B, es, dst->data);
  TW_TRY(tw_moe_swap_outer(ctx, stage, fs, p->A, p->B, es, above)); /* [rows][fs*run] */
  for (int64_t r = 0; r < p->rows; r++)
    TW_TRY(copy_run(m, src->dtype, above + (size_t)(r * fs * p->run) * es, (char *)dst->data + (size_t)(r * p->ld) * es,
                    fs * p->run));
  return TW_OK;
}

/* fp8_gather: one weight shard quantized as its part of the whole weight, the codes and scales
 * of both orientations gathered into q by the plan. FP8_CURRENT: the per-expert amax is
 * max-reduced over fsdp, the scales come from it and the shard is quantized with them (the
 * delayed form). Block modes: the shard's blocks are whole blocks of the weight (Hs % 128 ==
 * 0), so its own quantization already gives their codes and scales. amax: max-reduced. */
static tw_status gather_q(tw_moe *m, const tw_tensor *shard, const int32_t *gs, tw_qtensor *qs, float *scale,
                          const fs_part plan[4], tw_qtensor *q) {
  tw_ctx *ctx = m->ctx;
  int64_t G = m->nle;
  tw_quantize_opts o = TW_QUANTIZE_OPTS_INIT;
  o.mode = qs->mode = m->w_mode;
  o.layout = TW_ROWWISE_COLWISE;
  tw_tensor g = tw_tensor_1d((void *)gs, TW_I32, G, tw_ctx_mem(ctx));
  if (m->w_mode == TW_SCALE_TENSOR_CURRENT) {
    TW_TRY(tw_grouped_quantize(ctx, shard, &g, &o, qs)); /* for the shard's amax */
    TW_TRY(tw_all_reduce(ctx, m->fsdp_comm, qs->amax.data, qs->amax.data, G, TW_F32, TW_REDUCE_MAX));
    TW_TRY(tw_moe_scales_from_amax(ctx, (const float *)qs->amax.data, G, 448.0f, scale));
    o.mode = qs->mode = TW_SCALE_TENSOR_DELAYED;
    o.scale = tw_tensor_1d(scale, TW_F32, G, tw_ctx_mem(ctx));
  }
  TW_TRY(tw_grouped_quantize(ctx, shard, &g, &o, qs));
  TW_TRY(tw_all_reduce(ctx, m->fsdp_comm, qs->amax.data, qs->amax.data, G, TW_F32, TW_REDUCE_MAX));
  TW_TRY(gather_part(m, &plan[0], &qs->row_data, &q->row_data));
  TW_TRY(gather_part(m, &plan[1], &qs->col_data, &q->col_data));
  if (m->w_mode == TW_SCALE_TENSOR_CURRENT) { /* the same on every rank: copied */
    TW_TRY(tw_tensor_copy(ctx, &q->row_scale_inv, &qs->row_scale_inv));
    if (!tw_tensor_is_none(&q->col_scale_inv)) {
      const tw_tensor *src = tw_tensor_is_none(&qs->col_scale_inv) ? &qs->row_scale_inv : &qs->col_scale_inv;
      TW_TRY(tw_tensor_copy(ctx, &q->col_scale_inv, src));
    }
  } else {
    TW_TRY(gather_part(m, &plan[2], &qs->row_scale_inv, &q->row_scale_inv));
    TW_TRY(gather_part(m, &plan[3], &qs->col_scale_inv, &q->col_scale_inv));
  }
  return tw_tensor_copy(ctx, &q->amax, &qs->amax);
}

/* fp8_gather: q_wi and q_wo from the shards wi [NLE*Hs, 2F] and wo [NLE*F, Hs]. */
static tw_status gather_weights_fp8(tw_moe *m, const tw_moe_weights *w) {
  int64_t G = m->nle, Hs = m->Hs, F = m->F;
  tw_tensor wi = t2(m, w->wi.data, m->dt, G * Hs, 2 * F), wo = t2(m, w->wo.data, m->dt, G * F, Hs);
  TW_TRY(gather_q(m, &wi, m->gs_hs, &m->qs_wi, m->scale_wi, m->plan[0], &m->q_wi));
  return gather_q(m, &wo, m->gs_f, &m->qs_wo, m->scale_wo, m->plan[1], &m->q_wo);
}

/* The weights the GEMMs read: the caller's (fsdp = 1) or the gathered ones. */
static tw_moe_weights full_weights(const tw_moe *m, const tw_moe_weights *w) {
  tw_moe_weights f = *w;
  if (m->fs > 1 && !m->qgather) { /* fp8_gather: the GEMMs read q_wi, q_wo only */
    tw_mem mem = tw_ctx_mem(m->ctx);
    f.wi = tw_tensor_3d(m->wi_full, m->dt, m->nle, m->H, 2 * m->F, mem);
    f.wo = tw_tensor_3d(m->wo_full, m->dt, m->nle, m->F, m->H, mem);
  }
  return f;
}

/* fsdp: the full f32 gradient back to this rank's shard, summed over fsdp (the inverse
 * layout swap, then reduce_scatter). */
static tw_status scatter_grad(tw_moe *m, const float *full, int64_t A, int64_t B, tw_tensor *shard) {
  TW_TRY(tw_moe_swap_outer(m->ctx, full, A, m->fs, B, 4, m->stage));
  return tw_reduce_scatter(m->ctx, m->fsdp_comm, m->stage, shard->data, A * B, TW_F32, TW_REDUCE_SUM);
}

/* ---- forward ------------------------------------------------------------------------- */
tw_status tw_moe_forward(tw_moe *m, const tw_tensor *x, const tw_moe_weights *w, tw_tensor *out, tw_tensor *aux) {
  const char *op = "moe_forward";
  if (!m || !x || !out) return tw_error(TW_ERR_NULL, "%s: moe, x or out is NULL", op);
  m->forwarded = 0;
  TW_TRY(check_tokens(op, m, "x", x, -1));
  TW_TRY(check_weights(op, m, w));
  int64_t T = x->shape[0];
  TW_TRY(check_tokens(op, m, "out", out, T));
  int want_aux = aux && !tw_tensor_is_none(aux);
  if (want_aux && (aux->dtype != TW_F32 || tw_tensor_numel(aux) != 1 || aux->mem != tw_ctx_mem(m->ctx) || !aux->data))
    return tw_error(TW_ERR_SHAPE, "%s: aux_loss must be one f32 element in the context's memory", op);
  if (!m->tok_comm && T != m->cfg.global_tokens)
    return tw_error(TW_ERR_INVALID_ARG, "%s: one rank holds all tokens, so global_tokens = %lld must equal T = %lld", op,
                    (long long)m->cfg.global_tokens, (long long)T);
  tw_ctx *ctx = m->ctx;
  tw_mem mem = tw_ctx_mem(ctx);
  int64_t E = m->E, H = m->H, F = m->F, R = m->R, k = m->k;
  int late = m->cfg.weighting == TW_MOE_WEIGHT_LATE, bias = has_bias(w);
  m->T = T;
  /* reuse: the gathered weights and fp8 copies of the last forward that made them, from the
   * same weight tensors (new data pointers make them again) */
  const int reuse = m->reuse && m->made && m->made_wi == w->wi.data && m->made_wo == w->wo.data;
  m->made = 0;  /* until this forward has made (or kept) them all */
  if (!reuse && m->qgather) TW_TRY(step((mark(m, "fsdp all-gather (fp8)"), gather_weights_fp8(m, w)), op, "fsdp all-gather (fp8)"));
  else if (!reuse && m->fs > 1) TW_TRY(step((mark(m, "fsdp all-gather"), gather_weights(m, w)), op, "fsdp all-gather"));
  const tw_moe_weights w0 = *w;  /* the caller's (shards with fsdp): what reuse compares */
  tw_moe_weights wf = full_weights(m, w);
  w = &wf;
  tw_tensor logits = t2(m, m->logits, TW_F32, T, E), idx = t2(m, m->idx, TW_I32, T, k);
  tw_tensor tw = t2(m, m->topk_w, TW_F32, T, k), counts = tw_tensor_1d(m->counts, TW_I32, E, mem);
  tw_tensor recv = t2(m, m->recv, m->dt, R, H), recv_w = tw_tensor_1d(m->recv_w, TW_F32, R, mem);
  tw_tensor gs = tw_tensor_1d(m->gs, TW_I32, m->nle, mem), none = tw_tensor_none();

  TW_TRY(step((mark(m, "gate GEMM"), mm(m, *x, TW_OP_N, w->gate, TW_OP_N, logits, 0)), op, "gate GEMM"));
  TW_TRY(step((mark(m, "router"), tw_router_fwd(ctx, &logits, &m->cfg.router, &idx, &tw, &counts)), op, "router"));
  if (m->tok_comm) TW_TRY(step((mark(m, "counts"), tw_all_reduce(ctx, m->tok_comm, m->counts, m->counts, E, TW_I32, TW_REDUCE_SUM)), op, "counts"));
  TW_TRY(step((mark(m, "dispatch"), tw_ep_dispatch(ctx, m->layer, x, &none, &idx, &tw, &recv, &none, &recv_w, &gs, &none)), op, "dispatch"));
  /* h = recv @ wi[g] + bi[g] */
  if (m->fp8) {
    tw_tensor wi2 = flat(m, &w->wi), wo2 = flat(m, &w->wo);
    TW_TRY(step((mark(m, "quantize"), quantize(m, &recv, m->gs, &m->q_recv)), op, "quantize recv"));
    if (!m->qgather && !reuse) { /* fp8_gather made them from the shards */
      TW_TRY(step(quantize(m, &wi2, m->gs_h, &m->q_wi), op, "quantize wi"));
      TW_TRY(step(quantize(m, &wo2, m->gs_f, &m->q_wo), op, "quantize wo"));
    }
    tw_op o;
    tw_operand r = rows_operand(&m->q_wi, &o);
    TW_TRY(step((mark(m, "GEMM wi"), gg_q(m, &m->q_recv, r, o, t2(m, m->h, TW_F32, R, 2 * F))), op, "GEMM wi"));
  } else {
    TW_TRY(step((mark(m, "GEMM wi"), gg(m, recv, &w->wi, TW_OP_N, t2(m, m->h, TW_F32, R, 2 * F))), op, "GEMM wi"));
  }
  if (bias) TW_TRY(step((mark(m, "bias bi"), tw_moe_bias_out(ctx, m->h, &gs, (const float *)w->bi.data, 2 * F, m->h, TW_F32)), op, "bias bi"));
  TW_TRY(step((mark(m, "activation"), tw_moe_act_fwd(ctx, m->cfg.act, m->h, &gs, late ? NULL : m->recv_w, F, m->a, m->dt)), op, "activation"));
  /* eo = a @ wo[g] + bo[g] (f32, then the recipe's dtype) */
  /* without a bias the GEMM rounds straight to eo's dtype: the same bits as rounding its f32
   * result (what bias_out would do with + 0), one pass over R x H fewer */
  tw_tensor eo_out = bias ? t2(m, m->y32, TW_F32, R, H) : t2(m, m->eo, m->dt, R, H);
  if (m->fp8) {
    tw_tensor a = t2(m, m->a, m->dt, R, F);
    TW_TRY(step((mark(m, "quantize"), quantize(m, &a, m->gs, &m->q_a)), op, "quantize a"));
    tw_op o;
    tw_operand r = rows_operand(&m->q_wo, &o);
    TW_TRY(step((mark(m, "GEMM wo"), gg_q(m, &m->q_a, r, o, eo_out)), op, "GEMM wo"));
  } else {
    TW_TRY(step((mark(m, "GEMM wo"), gg(m, t2(m, m->a, m->dt, R, F), &w->wo, TW_OP_N, eo_out)), op, "GEMM wo"));
  }
  if (bias) TW_TRY(step((mark(m, "bias bo"), tw_moe_bias_out(ctx, m->y32, &gs, (const float *)w->bo.data, H, m->eo, m->dt)), op, "bias bo"));
  tw_tensor eo = t2(m, m->eo, m->dt, R, H);
  TW_TRY(step((mark(m, "combine"), tw_ep_combine(ctx, m->layer, &eo, late ? &tw : &none, out)), op, "combine"));
  m->aux_on = want_aux && m->cfg.aux_coeff > 0;
  if (want_aux) {
    if (m->aux_on && T > 0) {
      double share = (double)T / (double)m->cfg.global_tokens;
      m->aux_coeff_rank = m->tok_comm ? (float)(m->cfg.aux_coeff * share * share) : m->cfg.aux_coeff;
      TW_TRY(step((mark(m, "aux loss"), tw_router_aux_loss(ctx, &logits, &m->cfg.router, &counts, m->aux_coeff_rank, aux)), op, "aux loss"));
    } else {
      TW_TRY(tw_memset(ctx, aux->data, 0, 4));
    }
    if (m->tok_comm) TW_TRY(step((mark(m, "aux loss sum"), tw_all_reduce(ctx, m->tok_comm, aux->data, aux->data, 1, TW_F32, TW_REDUCE_SUM)), op, "aux loss sum"));
  }
  mark(m, "end");
  m->forwarded = 1;
  m->made = 1;
  m->made_wi = w0.wi.data;
  m->made_wo = w0.wo.data;
  return TW_OK;
}

/* ---- backward ------------------------------------------------------------------------ */
static tw_status check_grads(const char *op, const tw_moe *m, const tw_moe_grads *g, int bias) {
  if (!g) return tw_error(TW_ERR_NULL, "%s: grads is NULL", op);
  tw_mem mem = tw_ctx_mem(m->ctx);
  TW_TRY(check_tensor(op, "grads.gate", &g->gate, mem, TW_F32, 2, m->H, m->E, 0));
  /* d_wi and d_wo: both f32, or both bf16 where the recipe's weights are bf16 */
  tw_dtype gw = g->wi.dtype;
  if (!tw_tensor_is_none(&g->wi) && !tw_tensor_is_none(&g->wo)) {
    if (gw != TW_F32 && gw != TW_BF16)
      return tw_error(TW_ERR_DTYPE, "%s: grads.wi is %s, expected f32 or bf16", op, tw_dtype_name(gw));
    if (gw == TW_BF16 && m->dt != TW_BF16)
      return tw_error(TW_ERR_DTYPE, "%s: bf16 grads.wi and grads.wo need a recipe with bf16 weights (this one is %s)",
                      op, tw_moe_recipe_name(m->cfg.recipe));
    if (g->wo.dtype != gw)
      return tw_error(TW_ERR_DTYPE, "%s: grads.wi is %s but grads.wo is %s: give both in the same dtype", op,
                      tw_dtype_name(gw), tw_dtype_name(g->wo.dtype));
  }
  TW_TRY(check_tensor(op, "grads.wi", &g->wi, mem, gw, 3, m->nle, m->Hs, 2 * m->F));
  TW_TRY(check_tensor(op, "grads.wo", &g->wo, mem, gw, 3, m->nle, m->F, m->Hs));
  if (bias) {
    TW_TRY(check_tensor(op, "grads.bi", &g->bi, mem, TW_F32, 2, m->nle, 2 * m->F, 0));
    TW_TRY(check_tensor(op, "grads.bo", &g->bo, mem, TW_F32, 2, m->nle, m->H, 0));
  }
  return TW_OK;
}

static tw_status reduce(tw_moe *m, tw_comm *c, const tw_tensor *t) {
  if (!c) return TW_OK;
  return tw_all_reduce(m->ctx, c, t->data, t->data, tw_tensor_numel(t), TW_F32, TW_REDUCE_SUM);
}

tw_status tw_moe_backward(tw_moe *m, const tw_tensor *x, const tw_moe_weights *w, const tw_tensor *d_out, float d_aux,
                          tw_tensor *d_x, tw_moe_grads *grads) {
  const char *op = "moe_backward";
  if (!m || !x || !d_out || !d_x) return tw_error(TW_ERR_NULL, "%s: moe, x, d_out or d_x is NULL", op);
  if (!m->forwarded) return tw_error(TW_ERR_INVALID_ARG, "%s: no successful forward to take the backward of", op);
  TW_TRY(check_tokens(op, m, "x", x, m->T));
  TW_TRY(check_weights(op, m, w));
  TW_TRY(check_tokens(op, m, "d_out", d_out, m->T));
  TW_TRY(check_tokens(op, m, "d_x", d_x, m->T));
  int bias = has_bias(w);
  TW_TRY(check_grads(op, m, grads, bias));
  if (!isfinite(d_aux)) return tw_error(TW_ERR_INVALID_ARG, "%s: d_aux = %g is not finite", op, (double)d_aux);
  tw_moe_weights wf = full_weights(m, w); /* fsdp: gathered by the forward */
  w = &wf;
  tw_ctx *ctx = m->ctx;
  tw_mem mem = tw_ctx_mem(ctx);
  int64_t T = m->T, E = m->E, H = m->H, F = m->F, R = m->R, k = m->k;
  int late = m->cfg.weighting == TW_MOE_WEIGHT_LATE;
  tw_tensor none = tw_tensor_none(), gs = tw_tensor_1d(m->gs, TW_I32, m->nle, mem);
  tw_tensor tw = t2(m, m->topk_w, TW_F32, T, k), dtw = t2(m, m->d_topk_w, TW_F32, T, k);
  tw_tensor eo = t2(m, m->eo, m->dt, R, H), d_eo = t2(m, m->d_eo, m->dt, R, H);
  tw_tensor d_recv_w = tw_tensor_1d(m->d_recv_w, TW_F32, R, mem);
  /* the shard's expert weight gradients before the final rounding: the caller's tensors, or
   * with bf16 gradients summed over dp or fsdp, f32 ones rounded once at the end */
  tw_tensor swi = grads->wi, swo = grads->wo;
  const int round_late = grads->wi.dtype == TW_BF16 && (m->fs > 1 || m->dp_comm);
  if (round_late) {
    if (!m->dwi_f32) TW_TRY(alloc(m, 4 * (size_t)tw_tensor_numel(&grads->wi), &m->dwi_f32, 0));
    if (!m->dwo_f32) TW_TRY(alloc(m, 4 * (size_t)tw_tensor_numel(&grads->wo), &m->dwo_f32, 0));
    swi = tw_tensor_3d(m->dwi_f32, TW_F32, m->nle, m->Hs, 2 * F, mem);
    swo = tw_tensor_3d(m->dwo_f32, TW_F32, m->nle, F, m->Hs, mem);
  }
  /* the expert weight gradients at full size (fsdp: scattered to the shards at the end); bf16
   * with neither dp nor fsdp: the wgrad GEMMs round their f32 sums straight into grads */
  tw_tensor gwi = m->fs > 1 ? tw_tensor_3d(m->dwi_full, TW_F32, m->nle, H, 2 * F, mem) : swi;
  tw_tensor gwo = m->fs > 1 ? tw_tensor_3d(m->dwo_full, TW_F32, m->nle, F, H, mem) : swo;

  TW_TRY(step((mark(m, "combine_bwd"), tw_ep_combine_bwd(ctx, m->layer, d_out, late ? &tw : &none, late ? &eo : &none, &d_eo, late ? &dtw : &none)), op, "combine_bwd"));
  /* f32/bf16: a again from h (not saved), as the forward made it. FP8_*: the forward's colwise
   * fp8 copy of a is kept instead (the same bits a recompute and a second quantization gave) */
  if (!m->fp8)
    TW_TRY(step((mark(m, "activation (recompute)"), tw_moe_act_fwd(ctx, m->cfg.act, m->h, &gs, late ? NULL : m->recv_w, F, m->a, m->dt)), op, "activation (recompute)"));
  if (m->fp8) {
    TW_TRY(step((mark(m, "quantize"), quantize(m, &d_eo, m->gs, &m->q_deo)), op, "quantize d_eo"));
    TW_TRY(step((mark(m, "dgrad wo"), gg_q(m, &m->q_deo, tw_operand_rowwise(&m->q_wo), TW_OP_T, t2(m, m->d_a, TW_F32, R, F))), op, "dgrad wo"));
    TW_TRY(step((mark(m, "wgrad wo"), wgrad_q(m, &m->q_a, &m->q_deo, &gwo)), op, "wgrad wo"));
  } else {
    TW_TRY(step((mark(m, "dgrad wo"), gg(m, d_eo, &w->wo, TW_OP_T, t2(m, m->d_a, TW_F32, R, F))), op, "dgrad wo"));
    TW_TRY(step((mark(m, "wgrad wo"), wgrad(m, t2(m, m->a, m->dt, R, F), d_eo, &gwo)), op, "wgrad wo"));
  }
  if (bias) TW_TRY(step((mark(m, "bias grad bo"), tw_moe_bias_grad(ctx, m->d_eo, m->dt, &gs, H, (float *)grads->bo.data)), op, "bias grad bo"));
  TW_TRY(step((mark(m, "activation bwd"), tw_moe_act_bwd(ctx, m->cfg.act, m->h, m->d_a, &gs, late ? NULL : m->recv_w, F, m->d_h, m->dt,
                             late ? NULL : m->d_recv_w)), op, "activation bwd"));
  tw_tensor d_h = t2(m, m->d_h, m->dt, R, 2 * F);
  if (bias) TW_TRY(step((mark(m, "bias grad bi"), tw_moe_bias_grad(ctx, m->d_h, m->dt, &gs, 2 * F, (float *)grads->bi.data)), op, "bias grad bi"));
  tw_tensor d_recv = t2(m, m->d_recv, m->dt, R, H);
  if (m->fp8) {
    TW_TRY(step((mark(m, "quantize"), quantize(m, &d_h, m->gs, &m->q_dh)), op, "quantize d_h"));
    TW_TRY(step((mark(m, "wgrad wi"), wgrad_q(m, &m->q_recv, &m->q_dh, &gwi)), op, "wgrad wi"));
    TW_TRY(step((mark(m, "dgrad wi"), gg_q(m, &m->q_dh, tw_operand_rowwise(&m->q_wi), TW_OP_T, d_recv)), op, "dgrad wi"));
  } else {
    TW_TRY(step((mark(m, "wgrad wi"), wgrad(m, t2(m, m->recv, m->dt, R, H), d_h, &gwi)), op, "wgrad wi"));
    TW_TRY(step((mark(m, "dgrad wi"), gg(m, d_h, &w->wi, TW_OP_T, d_recv)), op, "dgrad wi"));
  }
  TW_TRY(step((mark(m, "dispatch_bwd"), tw_ep_dispatch_bwd(ctx, m->layer, &d_recv, late ? &none : &d_recv_w, d_x, late ? &none : &dtw)), op, "dispatch_bwd"));
  /* the router: d_w -> d_logits, plus the aux loss's */
  tw_tensor logits = t2(m, m->logits, TW_F32, T, E), idx = t2(m, m->idx, TW_I32, T, k);
  tw_tensor d_logits = t2(m, m->d_logits, TW_F32, T, E), counts = tw_tensor_1d(m->counts, TW_I32, E, mem);
  if (T > 0) {
    TW_TRY(step((mark(m, "router_bwd"), tw_router_bwd(ctx, &logits, &m->cfg.router, &idx, &dtw, &d_logits)), op, "router_bwd"));
    if (m->aux_on && d_aux != 0) {
      tw_tensor d_aux_logits = t2(m, m->d_logits_aux, TW_F32, T, E);
      TW_TRY(step((mark(m, "aux loss bwd"), tw_router_aux_loss_bwd(ctx, &logits, &m->cfg.router, &counts, m->aux_coeff_rank, d_aux, &d_aux_logits)), op, "aux loss bwd"));
      TW_TRY(step((mark(m, "d_logits sum"), tw_moe_add_f32(ctx, m->d_logits, m->d_logits_aux, T * E)), op, "d_logits sum"));
    }
  } else {
    TW_TRY(tw_memset(ctx, m->d_logits, 0, 4));
  }
  /* d_x = d_x_dispatch + d_logits @ gate^T (one rounding); d_gate = x^T d_logits */
  TW_TRY(step((mark(m, "dgrad gate"), mm(m, d_logits, TW_OP_N, w->gate, TW_OP_T, *d_x, 1)), op, "dgrad gate"));
  TW_TRY(step((mark(m, "wgrad gate"), mm(m, *x, TW_OP_T, d_logits, TW_OP_N, grads->gate, 0)), op, "wgrad gate"));
  TW_TRY(step((mark(m, "d_gate sum"), reduce(m, m->tok_comm, &grads->gate)), op, "d_gate sum"));
  if (m->fs > 1) {
    TW_TRY(step((mark(m, "d_wi reduce-scatter over fsdp"), scatter_grad(m, m->dwi_full, m->nle, H / m->fs * 2 * F, &swi)), op, "d_wi reduce-scatter over fsdp"));
    TW_TRY(step((mark(m, "d_wo reduce-scatter over fsdp"), scatter_grad(m, m->dwo_full, m->nle * F, H / m->fs, &swo)), op, "d_wo reduce-scatter over fsdp"));
    if (bias) {
      TW_TRY(step((mark(m, "d_bi sum over fsdp"), reduce(m, m->fsdp_comm, &grads->bi)), op, "d_bi sum over fsdp"));
      TW_TRY(step((mark(m, "d_bo sum over fsdp"), reduce(m, m->fsdp_comm, &grads->bo)), op, "d_bo sum over fsdp"));
    }
  }
  if (!tw_moe_plant_skip_dp_reduce) {
    TW_TRY(step((mark(m, "d_wi sum over dp"), reduce(m, m->dp_comm, &swi)), op, "d_wi sum over dp"));
    TW_TRY(step((mark(m, "d_wo sum over dp"), reduce(m, m->dp_comm, &swo)), op, "d_wo sum over dp"));
  }
  if (round_late) {
    TW_TRY(step((mark(m, "weight grads to bf16"), tw_cast(ctx, &grads->wi, &swi, 0)), op, "d_wi to bf16"));
    TW_TRY(step((mark(m, "weight grads to bf16"), tw_cast(ctx, &grads->wo, &swo, 0)), op, "d_wo to bf16"));
  }
  if (tw_moe_plant_skip_dp_reduce) return TW_OK;
  if (bias) {
    TW_TRY(step((mark(m, "d_bi sum over dp"), reduce(m, m->dp_comm, &grads->bi)), op, "d_bi sum over dp"));
    TW_TRY(step((mark(m, "d_bo sum over dp"), reduce(m, m->dp_comm, &grads->bo)), op, "d_bo sum over dp"));
  }
  return TW_OK;
}
