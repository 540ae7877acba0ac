/* The per-rank context: picks the backend table, owns the backend's state. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "core/validate.h"

/* Weak: a binary contains the backends it links. */
extern const tw_backend_ops tw_ref_ops __attribute__((weak));
extern const tw_backend_ops tw_gpu_ops __attribute__((weak));

static const tw_backend_ops *backend_table(tw_backend b) {
  switch (b) {
    case TW_BACKEND_REF: return &tw_ref_ops;
    case TW_BACKEND_GPU: return &tw_gpu_ops;
    default: return NULL;
  }
}

const char *tw_backend_name(tw_backend b) {
  switch (b) {
    case TW_BACKEND_REF: return "ref";
    case TW_BACKEND_GPU: return "gpu";
    default: return "?";
  }
}

int tw_backend_from_name(const char *name, tw_backend *out) {
  if (!name) return -1;
  if (strcmp(name, "ref") == 0) { *out = TW_BACKEND_REF; return 0; }
  if (strcmp(name, "gpu") == 0) { *out = TW_BACKEND_GPU; return 0; }
  return -1;
}

int tw_backend_available(tw_backend b) {
  const tw_backend_ops *ops = backend_table(b);
  return ops && (!ops->available || ops->available());
}

tw_status tw_ctx_create(tw_ctx **out, const tw_ctx_config *cfg) {
  if (!out) return tw_error(TW_ERR_NULL, "ctx_create: out is NULL");
  *out = NULL;
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  if (cfg) {
    /* sizes of older, smaller versions of the struct stay valid; this is version 1 */
    if (cfg->size != sizeof c)
      return tw_error(TW_ERR_INVALID_ARG,
                      "ctx_create: cfg->size is %zu; initialize with TW_CTX_CONFIG_INIT (%zu)",
                      cfg->size, sizeof c);
    memcpy(&c, cfg, cfg->size);
    c.size = sizeof c;
  }
  if ((int)c.backend < 0 || c.backend >= TW_BACKEND_COUNT)
    return tw_error(TW_ERR_INVALID_ARG, "ctx_create: unknown backend %d", (int)c.backend);
  const tw_backend_ops *ops = backend_table(c.backend);
  if (!ops)
    return tw_error(TW_ERR_UNSUPPORTED, "ctx_create: backend '%s' is not built into this binary",
                    tw_backend_name(c.backend));
  if (ops->available && !ops->available())
    return tw_error(TW_ERR_UNSUPPORTED, "ctx_create: backend '%s' has no usable device here",
                    tw_backend_name(c.backend));
  tw_ctx *ctx = (tw_ctx *)calloc(1, sizeof *ctx);
  if (!ctx) return tw_error(TW_ERR_MEMORY, "ctx_create: out of host memory");
  ctx->cfg = c;
  ctx->ops = ops;
  if (c.kernel) {
    if (strlen(c.kernel) >= sizeof ctx->kernel) {
      free(ctx);
      return tw_error(TW_ERR_INVALID_ARG, "ctx_create: kernel name '%s' is too long", c.kernel);
    }
    strcpy(ctx->kernel, c.kernel);
  }
  ctx->cfg.kernel = NULL; /* not owned; use tw_ctx_kernel() */
  static uint64_t next_id;
  ctx->id = __atomic_add_fetch(&next_id, 1, __ATOMIC_RELAXED);
  if (ops->ctx_init) {
    tw_status s = ops->ctx_init(ctx);
    if (s != TW_OK) {
      free(ctx);
      return s;
    }
  }
  *out = ctx;
  return TW_OK;
}

tw_status tw_ctx_destroy(tw_ctx *ctx) {
  if (!ctx) return TW_OK;
  tw_status s = TW_OK;
  if (ctx->ops->ctx_fini) s = ctx->ops->ctx_fini(ctx);
  free(ctx->ledger);
  free(ctx);
  return s;
}

tw_backend tw_ctx_backend(const tw_ctx *ctx) { return ctx ? ctx->cfg.backend : TW_BACKEND_REF; }
tw_mem tw_ctx_mem(const tw_ctx *ctx) { return ctx ? ctx->ops->mem : TW_MEM_HOST; }
tw_comm *tw_ctx_comm(const tw_ctx *ctx) { return ctx ? ctx->cfg.comm : NULL; }
const char *tw_ctx_kernel(const tw_ctx *ctx) { return ctx && ctx->kernel[0] ? ctx->kernel : NULL; }
uint64_t tw_ctx_id(const tw_ctx *ctx) { return ctx ? ctx->id : 0; }

tw_status tw_ctx_sync(tw_ctx *ctx) {
  if (!ctx) return tw_error(TW_ERR_NULL, "ctx_sync: ctx is NULL");
  return ctx->ops->sync ? ctx->ops->sync(ctx) : TW_OK;
}

tw_status tw_ctx_check(tw_ctx *ctx) {
  if (!ctx) return tw_error(TW_ERR_NULL, "ctx_check: ctx is NULL");
  TW_TRY(tw_ctx_sync(ctx));
  return ctx->ops->check ? ctx->ops->check(ctx) : TW_OK;
}

/* ---- the allocation ledger ------------------------------------------------------------ */
struct tw_ledger_slot {
  void *p; /* NULL: empty; TOMB: freed */
  size_t bytes;
  int stream_ordered; /* from tw_alloc_stream: tw_free returns it with free_stream */
};
static char tomb_mark;
#define TOMB ((void *)&tomb_mark)

static size_t ledger_hash(const void *p, size_t cap) {
  uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
  return (size_t)(h >> 17) & (cap - 1);
}

/* Grows (or cleans out tombstones) so that one more insert keeps the table at most half full. */
static int ledger_reserve(tw_ctx *ctx) {
  if ((ctx->ledger_used + 1) * 2 <= ctx->ledger_cap) return 0;
  size_t live = 0;
  for (size_t i = 0; i < ctx->ledger_cap; i++)
    if (ctx->ledger[i].p && ctx->ledger[i].p != TOMB) live++;
  size_t cap = 64;
  while ((live + 1) * 4 > cap) cap *= 2;
  struct tw_ledger_slot *t = (struct tw_ledger_slot *)calloc(cap, sizeof *t);
  if (!t) return -1;
  for (size_t i = 0; i < ctx->ledger_cap; i++) {
    struct tw_ledger_slot e = ctx->ledger[i];
    if (!e.p || e.p == TOMB) continue;
    size_t k = ledger_hash(e.p, cap);
    while (t[k].p) k = (k + 1) & (cap - 1);
    t[k] = e;
  }
  free(ctx->ledger);
  ctx->ledger = t;
  ctx->ledger_cap = cap;
  ctx->ledger_used = live;
  return 0;
}

static struct tw_ledger_slot *ledger_find(tw_ctx *ctx, const void *p) {
  if (!ctx->ledger_cap) return NULL;
  for (size_t k = ledger_hash(p, ctx->ledger_cap);; k = (k + 1) & (ctx->ledger_cap - 1)) {
    if (!ctx->ledger[k].p) return NULL;
    if (ctx->ledger[k].p == p) return &ctx->ledger[k];
  }
}

static tw_status alloc_as(tw_ctx *ctx, size_t bytes, void **out, int stream_ordered) {
  const char *op = stream_ordered ? "alloc_stream" : "alloc";
  if (!ctx || !out) return tw_error(TW_ERR_NULL, "%s: NULL argument", op);
  *out = NULL;
  if (bytes == 0) return TW_OK;
  if (ledger_reserve(ctx)) return tw_error(TW_ERR_MEMORY, "%s: out of host memory for the allocation ledger", op);
  stream_ordered = stream_ordered && ctx->ops->alloc_stream && ctx->ops->free_stream;
  TW_TRY(stream_ordered ? ctx->ops->alloc_stream(ctx, bytes, out) : ctx->ops->alloc(ctx, bytes, out));
  size_t k = ledger_hash(*out, ctx->ledger_cap);
  while (ctx->ledger[k].p && ctx->ledger[k].p != TOMB) k = (k + 1) & (ctx->ledger_cap - 1);
  if (!ctx->ledger[k].p) ctx->ledger_used++;
  ctx->ledger[k].p = *out;
  ctx->ledger[k].bytes = bytes;
  ctx->ledger[k].stream_ordered = stream_ordered;
  ctx->live_bytes += bytes;
  if (ctx->live_bytes > ctx->peak_bytes) ctx->peak_bytes = ctx->live_bytes;
  return TW_OK;
}

tw_status tw_alloc(tw_ctx *ctx, size_t bytes, void **out) { return alloc_as(ctx, bytes, out, 0); }
tw_status tw_alloc_stream(tw_ctx *ctx, size_t bytes, void **out) { return alloc_as(ctx, bytes, out, 1); }

/* A pointer this context did not hand out is still given to the backend (contexts on one
 * device share it); the ledger only counts its own. */
tw_status tw_free(tw_ctx *ctx, void *p) {
  if (!ctx) return tw_error(TW_ERR_NULL, "free: ctx is NULL");
  if (!p) return TW_OK;
  struct tw_ledger_slot *e = ledger_find(ctx, p);
  int stream_ordered = 0;
  if (e) {
    ctx->live_bytes -= e->bytes;
    stream_ordered = e->stream_ordered;
    e->p = TOMB;
    e->bytes = 0;
    e->stream_ordered = 0;
  }
  return stream_ordered ? ctx->ops->free_stream(ctx, p) : ctx->ops->free(ctx, p);
}

tw_status tw_ctx_memory(const tw_ctx *ctx, size_t *live, size_t *peak) {
  if (!ctx) return tw_error(TW_ERR_NULL, "ctx_memory: ctx is NULL");
  if (live) *live = ctx->live_bytes;
  if (peak) *peak = ctx->peak_bytes;
  return TW_OK;
}

tw_status tw_ctx_trim(tw_ctx *ctx) {
  if (!ctx) return tw_error(TW_ERR_NULL, "ctx_trim: ctx is NULL");
  TW_TRY(tw_ctx_sync(ctx));
  return ctx->ops->trim ? ctx->ops->trim(ctx) : TW_OK;
}

tw_status tw_ctx_reset_peak(tw_ctx *ctx) {
  if (!ctx) return tw_error(TW_ERR_NULL, "ctx_reset_peak: ctx is NULL");
  ctx->peak_bytes = ctx->live_bytes;
  return TW_OK;
}

tw_status tw_memset(tw_ctx *ctx, void *p, int byte, size_t bytes) {
  if (!ctx) return tw_error(TW_ERR_NULL, "memset: ctx is NULL");
  if (bytes == 0) return TW_OK;
  if (!p) return tw_error(TW_ERR_NULL, "memset: pointer is NULL for %zu bytes", bytes);
  return ctx->ops->memset(ctx, p, byte, bytes);
}

tw_status tw_tensor_copy(tw_ctx *ctx, tw_tensor *dst, const tw_tensor *src) {
  if (!ctx || !dst || !src) return tw_error(TW_ERR_NULL, "tensor_copy: NULL argument");
  TW_TRY(tw_v_tensor("tensor_copy", "dst", dst, dst->mem, -1));
  TW_TRY(tw_v_tensor("tensor_copy", "src", src, src->mem, -1));
  char a[96], b[96];
  if (dst->dtype != src->dtype || dst->ndim != src->ndim ||
      tw_tensor_numel(dst) != tw_tensor_numel(src))
    return tw_error(TW_ERR_SHAPE, "tensor_copy: dst %s and src %s differ",
                    tw_tensor_str(dst, a, sizeof a), tw_tensor_str(src, b, sizeof b));
  for (int i = 0; i < dst->ndim; i++)
    if (dst->shape[i] != src->shape[i])
      return tw_error(TW_ERR_SHAPE, "tensor_copy: dst %s and src %s differ",
                      tw_tensor_str(dst, a, sizeof a), tw_tensor_str(src, b, sizeof b));
  size_t n = tw_tensor_bytes(src);
  if (n == 0) return TW_OK;
  if (!dst->data || !src->data) return tw_error(TW_ERR_NULL, "tensor_copy: data is NULL");
  tw_mem m = ctx->ops->mem;
  if ((dst->mem != TW_MEM_HOST && dst->mem != m) || (src->mem != TW_MEM_HOST && src->mem != m))
    return tw_error(TW_ERR_MEMORY, "tensor_copy: a tensor lives in memory this '%s' context cannot reach",
                    ctx->ops->name);
  return ctx->ops->copy(ctx, dst->data, dst->mem, src->data, src->mem, n);
}
