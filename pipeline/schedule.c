/* The circular schedule (§2.2), its configuration rules (§1, §6 item 9) and its printer:
 * pure functions, no backend. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "twin/tw_pipeline.h"

static tw_status rule(const char *name, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static tw_status rule(const char *name, const char *fmt, ...) {
  char msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return tw_error(TW_ERR_INVALID_ARG, "pipeline: rule %s: %s", name, msg);
}

/* The checks that need no mesh; F is the fsdp size. */
static tw_status check_counts(const tw_pipeline_config *c, int F, const tw_pipeline_body *b) {
  if (!c) return tw_error(TW_ERR_NULL, "pipeline: config is NULL");
  if (c->size != sizeof *c)
    return rule("pipeline.config_size", "cfg->size is %zu; initialize with TW_PIPELINE_CONFIG_INIT (%zu)",
                c->size, sizeof *c);
  if (c->stages < 1 || c->microbatches < 1 || c->repeats < 1 || c->layers_per_stage < 1 ||
      c->layers < 1 || c->mb_rows < 1 || F < 1)
    return rule("pipeline.positive",
                "S = %d, M = %d, R = %d, Lps = %d, layers = %d, mb = %lld, F = %d must all be >= 1",
                c->stages, c->microbatches, c->repeats, c->layers_per_stage, c->layers,
                (long long)c->mb_rows, F);
  int S = c->stages, M = c->microbatches, R = c->repeats, d = c->delay, L = c->layers_per_stage;
  if (M % S != 0)
    return rule("pipeline.microbatches_divisible",
                "M = %d microbatches must be a multiple of S = %d stages%s", M, S,
                M < S ? " (M < S leaves stages without a microbatch)" : "");
  if ((long long)S * R * L != c->layers)
    return rule("pipeline.layers", "S*R*Lps = %d*%d*%d = %lld but the model has %d layers", S, R, L,
                (long long)S * R * L, c->layers);
  if (d != 1 && d != 2) return rule("pipeline.delay", "d = %d; the forwarding delay is 1 or 2", d);
  if (d == 2 && M < 2 * S)
    return rule("pipeline.delay_microbatches", "d = 2 needs M >= 2S, got M = %d, S = %d", M, S);
  if (c->fsdp != TW_PIPELINE_FSDP_PLAIN && c->fsdp != TW_PIPELINE_FSDP_BSW)
    return rule("pipeline.fsdp_mode", "fsdp mode %d is neither plain (0) nor bsw (1)", (int)c->fsdp);
  if (c->fsdp == TW_PIPELINE_FSDP_BSW) {
    if (R == 1)
      return rule("pipeline.bsw_repeats", "BSW gathers the next repeat's weights, so it needs R > 1 (R = 1)");
    if (d != 1) return rule("pipeline.bsw_delay", "BSW needs d = 1 (d = %d)", d);
    if (L != 1) return rule("pipeline.bsw_layers_per_stage", "BSW needs Lps = 1 (Lps = %d)", L);
  }
  if (c->mb_rows % F != 0)
    return rule("pipeline.fsdp_rows", "mb = %lld rows per microbatch do not split over fsdp = %d",
                (long long)c->mb_rows, F);
  if (b) {
    if (!b->forward || !b->vjp || b->nparams < 1 || b->nparams > TW_PIPELINE_MAX_PARAMS || b->width < 1)
      return rule("pipeline.body", "body '%s' needs forward, vjp, width >= 1 and 1..%d parameters (has %d)",
                  b->name ? b->name : "?", TW_PIPELINE_MAX_PARAMS, b->nparams);
    for (int i = 0; i < b->nparams; i++)
      if (b->param_rows[i] < 1 || b->param_cols[i] < 1 || b->param_rows[i] % F != 0)
        return rule("pipeline.fsdp_rows", "parameter %d of body '%s' is [%lld, %lld]: its rows must split over fsdp = %d",
                    i, b->name ? b->name : "?", (long long)b->param_rows[i], (long long)b->param_cols[i], F);
  }
  return TW_OK;
}

tw_status tw_pipeline_check(const tw_pipeline_config *cfg, const tw_mesh *mesh, const tw_pipeline_body *body) {
  if (!cfg || !mesh) return tw_error(TW_ERR_NULL, "pipeline: config or mesh is NULL");
  int has_pp = 0;
  char mb[96];
  for (int i = 0; i < mesh->naxes; i++) {
    if (mesh->axis[i] == TW_AXIS_PP) has_pp = 1;
    else if (mesh->axis[i] != TW_AXIS_FSDP && mesh->size[i] > 1)
      return rule("pipeline.mesh_axes", "mesh %s has %s=%d; a pipeline mesh has only pp and fsdp",
                  tw_mesh_str(mesh, mb, sizeof mb), tw_axis_name(mesh->axis[i]), mesh->size[i]);
  }
  if (!has_pp)
    return rule("pipeline.mesh_pp", "mesh %s has no pp axis to place the stages on", tw_mesh_str(mesh, mb, sizeof mb));
  TW_TRY(check_counts(cfg, tw_mesh_axis_size(mesh, TW_AXIS_FSDP), body));
  int pp = tw_mesh_axis_size(mesh, TW_AXIS_PP);
  if (cfg->stages != pp)
    return rule("pipeline.stages_match_mesh", "S = %d stages but mesh %s has pp=%d", cfg->stages,
                tw_mesh_str(mesh, mb, sizeof mb), pp);
  return TW_OK;
}

int tw_pipeline_iterations(const tw_pipeline_config *c) {
  return c->microbatches * c->repeats + c->delay * (c->stages - 1);
}

int tw_pipeline_slot(const tw_pipeline_config *c, int t, int s, int *microbatch, int *repeat) {
  int k = t - c->delay * s;
  if (k < 0 || k >= c->microbatches * c->repeats) return 0;
  if (microbatch) *microbatch = k % c->microbatches;
  if (repeat) *repeat = k / c->microbatches;
  return 1;
}

int tw_pipeline_window_repeat(const tw_pipeline_config *c, int r, int s) {
  int R = c->repeats, M = c->microbatches;
  int rep = r;
  if (c->test_stale_window) { /* MaxText: the repeat of iteration rM + 1 at stage s */
    int k = r * M + 1 - c->delay * s;
    rep = (k < 0 ? 0 : k) / M;
  }
  return rep < R - 1 ? rep : R - 1;
}

double tw_pipeline_bubble_fraction(const tw_pipeline_config *c) {
  double b = (double)c->delay * (c->stages - 1);
  return b / ((double)c->microbatches * c->repeats + b);
}

size_t tw_pipeline_saved_bytes(const tw_pipeline_config *c, const tw_pipeline_body *b, int fsdp) {
  return (size_t)c->microbatches * (size_t)c->repeats * (size_t)(c->mb_rows / (fsdp > 0 ? fsdp : 1)) *
         (size_t)b->width * sizeof(float);
}

size_t tw_pipeline_window_bytes(const tw_pipeline_config *c, const tw_pipeline_body *b, int fsdp) {
  size_t P = 0;
  for (int i = 0; i < b->nparams; i++) P += (size_t)(b->param_rows[i] * b->param_cols[i]);
  if (c->fsdp == TW_PIPELINE_FSDP_BSW) return 4 * P * sizeof(float);
  return fsdp > 1 ? 2 * (size_t)c->layers_per_stage * P * sizeof(float) : 0; /* F = 1: the shards in place */
}

size_t tw_pipeline_peak_bytes(const tw_pipeline_config *c, const tw_pipeline_body *b, int fsdp, int stage) {
  const int F = fsdp > 0 ? fsdp : 1, S = c->stages, M = c->microbatches, R = c->repeats, d = c->delay;
  const int Lps = c->layers_per_stage, use_circ = R > 1 && M > d * S;
  const size_t a = (size_t)(c->mb_rows / F) * (size_t)b->width * sizeof(float);
  size_t max_shard = 1;
  for (int i = 0; i < b->nparams; i++) {
    size_t n = (size_t)(b->param_rows[i] * b->param_cols[i]) / (size_t)F;
    if (n > max_shard) max_shard = n;
  }
  size_t state = (size_t)(M / S) * a + 4 * a + (use_circ ? a : 0) + (use_circ && stage == 0 ? (size_t)M * a : 0) +
                 (d == 2 ? a : 0);
  size_t call = (size_t)(Lps > 1 ? Lps - 1 : 1) * a + 3 * a + max_shard * sizeof(float) +
                (b->scratch_bytes ? b->scratch_bytes(b, c->mb_rows / F) : 0);
  return tw_pipeline_saved_bytes(c, b, F) + tw_pipeline_window_bytes(c, b, F) + state + call;
}

/* ---- the printer ----------------------------------------------------------------------- */
typedef struct {
  char *buf;
  size_t n, len;
} sb;

static void put(sb *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void put(sb *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = b->len < b->n ? b->n - b->len : 0;
  int k = vsnprintf(room ? b->buf + b->len : NULL, room, fmt, ap);
  va_end(ap);
  if (k > 0) b->len += (size_t)k;
}

tw_status tw_pipeline_format_schedule(const tw_pipeline_config *c, int F, char *buf, size_t n,
                                      size_t *needed) {
  TW_TRY(check_counts(c, F, NULL));
  if (!buf && n) return tw_error(TW_ERR_NULL, "pipeline: format_schedule: buf is NULL but n = %zu", n);
  int S = c->stages, M = c->microbatches, R = c->repeats, d = c->delay, Lps = c->layers_per_stage;
  int T = tw_pipeline_iterations(c), mps = M / S;
  int use_circ = R > 1 && M > d * S, rotate = R > 1 && !use_circ;
  sb b = {buf, n, 0};
  if (n) buf[0] = 0;
  put(&b, "pipeline S=%d M=%d R=%d d=%d Lps=%d layers=%d mb=%lld fsdp=%d (%s%s)\n", S, M, R, d, Lps,
      c->layers, (long long)c->mb_rows, F, c->fsdp == TW_PIPELINE_FSDP_BSW ? "bsw" : "plain",
      c->test_stale_window ? ", TEST stale window" : "");
  put(&b, "T = M*R + d*(S-1) = %d iterations; bubble d(S-1)/(MR+d(S-1)) = %d/%d = %.4f\n", T, d * (S - 1), T,
      tw_pipeline_bubble_fraction(c));
  put(&b, "stage-0 feedback: %s\n",
      R == 1 ? "none (R = 1)" : use_circ ? "circ_storage (M > dS), written one iteration after S-1 produced"
                                          : "shift rotation S-1 -> 0 (M == dS)");
  put(&b, "per iteration: ppermute shift right (%s)%s, ppermute state_io column left",
      rotate ? "rotating" : "stage 0 gets zeros", use_circ ? ", ppermute mover S-1 -> 0" : "");
  if (d == 2) put(&b, ", prev_outputs kept one iteration");
  put(&b, "\n");
  if (F > 1) {
    if (c->fsdp == TW_PIPELINE_FSDP_BSW)
      put(&b, "fsdp=%d BSW: w_next <- all-gather(W[min(r,R-1)][s]) at each repeat step r; backward re-gathers w_curr once per step and reduce-scatters the window gradient once per repeat\n", F);
    else
      put(&b, "fsdp=%d plain: all-gather W[rep][s] before and reduce-scatter dW after every valid iteration\n", F);
  }
  put(&b, "%4s", "t");
  for (int s = 0; s < S; s++) put(&b, " | st%-6d", s);
  put(&b, " | stage-0 input\n");
  for (int t = 0; t < T; t++) {
    if (c->fsdp == TW_PIPELINE_FSDP_BSW && t % M == 0) {
      int r = t / M;
      put(&b, "     step %d:", r);
      if (r < R) {
        for (int s = 0; s < S; s++) put(&b, " st%d w_next=W[%d]", s, tw_pipeline_window_repeat(c, r, s));
      } else {
        put(&b, " drain, no gather");
      }
      put(&b, "\n");
    }
    put(&b, "%4d", t);
    for (int s = 0; s < S; s++) {
      int m, r;
      if (tw_pipeline_slot(c, t, s, &m, &r)) {
        char cell[32];
        snprintf(cell, sizeof cell, "L%d:m%d", (r * S + s) * Lps, m);
        put(&b, " | %-8s", cell);
      } else {
        put(&b, " | %-8s", "-");
      }
    }
    if (t < M) put(&b, " | x[%d] (state_io[0][%d])\n", t, t % mps);
    else if (t >= M * R) put(&b, " | (unused)\n");
    else if (use_circ) put(&b, " | circ[%d]\n", t % M);
    else put(&b, " | shift[0] (rotated)\n");
  }
  put(&b, "y[m] = stage S-1's output at t = (R-1)M + m + d(S-1); microbatch m ends on stage m div %d\n", mps);
  if (needed) *needed = b.len + 1;
  return TW_OK;
}
