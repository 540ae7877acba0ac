/* Meshes and partition specs: parsing, printing, validation, shard index arithmetic and the
 * host slicing helpers. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_shard.h"

static const char *const axis_names[TW_AXIS_COUNT] = {"dp", "fsdp", "ep", "tp", "pp", "cp"};

const char *tw_axis_name(tw_axis a) {
  return ((int)a >= 0 && a < TW_AXIS_COUNT) ? axis_names[a] : "?";
}

int tw_axis_from_name(const char *name, tw_axis *out) {
  if (!name) return -1;
  for (int i = 0; i < TW_AXIS_COUNT; i++)
    if (strcmp(name, axis_names[i]) == 0) {
      *out = (tw_axis)i;
      return 0;
    }
  return -1;
}

tw_status tw_mesh_init(tw_mesh *m, int naxes, const tw_axis *axes, const int *sizes) {
  if (!m) return tw_error(TW_ERR_NULL, "mesh: out is NULL");
  memset(m, 0, sizeof *m);
  if (naxes < 0 || naxes > TW_AXIS_COUNT)
    return tw_error(TW_ERR_INVALID_ARG, "mesh: %d axes (at most %d)", naxes, TW_AXIS_COUNT);
  if (naxes > 0 && (!axes || !sizes)) return tw_error(TW_ERR_NULL, "mesh: axes or sizes is NULL");
  long long ranks = 1;
  for (int i = 0; i < naxes; i++) {
    if ((int)axes[i] < 0 || axes[i] >= TW_AXIS_COUNT)
      return tw_error(TW_ERR_INVALID_ARG, "mesh: axis %d is unknown (id %d)", i, (int)axes[i]);
    for (int j = 0; j < i; j++)
      if (axes[j] == axes[i])
        return tw_error(TW_ERR_INVALID_ARG, "mesh: axis '%s' appears twice", tw_axis_name(axes[i]));
    if (sizes[i] < 1)
      return tw_error(TW_ERR_INVALID_ARG, "mesh: axis '%s' has size %d (need >= 1)",
                      tw_axis_name(axes[i]), sizes[i]);
    ranks *= sizes[i];
    if (ranks > 65536)
      return tw_error(TW_ERR_INVALID_ARG, "mesh: more than 65536 ranks");
    m->axis[i] = axes[i];
    m->size[i] = sizes[i];
  }
  m->naxes = naxes;
  return TW_OK;
}

tw_status tw_mesh_parse(const char *text, tw_mesh *m) {
  if (!text || !m) return tw_error(TW_ERR_NULL, "mesh: text or out is NULL");
  tw_axis axes[TW_AXIS_COUNT] = {TW_AXIS_DP};
  int sizes[TW_AXIS_COUNT] = {0}, n = 0;
  const char *p = text;
  while (isspace((unsigned char)*p)) p++;
  if (*p == 0 || strcmp(p, "1") == 0) return tw_mesh_init(m, 0, axes, sizes);
  while (*p) {
    char name[16];
    int len = 0;
    while (isspace((unsigned char)*p)) p++;
    while (isalpha((unsigned char)*p) && len < 15) name[len++] = *p++;
    name[len] = 0;
    while (isspace((unsigned char)*p)) p++;
    if (*p != '=' || len == 0)
      return tw_error(TW_ERR_INVALID_ARG, "mesh: expected axis=size at '%s' in \"%s\"", p, text);
    p++;
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p) return tw_error(TW_ERR_INVALID_ARG, "mesh: axis '%s' has no size in \"%s\"", name, text);
    p = end;
    if (n == TW_AXIS_COUNT) return tw_error(TW_ERR_INVALID_ARG, "mesh: too many axes in \"%s\"", text);
    if (tw_axis_from_name(name, &axes[n]) != 0)
      return tw_error(TW_ERR_INVALID_ARG, "mesh: unknown axis '%s' (known: dp, fsdp, ep, tp, pp, cp)", name);
    sizes[n++] = v > 1 << 20 ? 1 << 20 : v < -1 ? -1 : (int)v;
    while (isspace((unsigned char)*p)) p++;
    if (*p == ',') p++;
    else if (*p) return tw_error(TW_ERR_INVALID_ARG, "mesh: expected ',' at '%s' in \"%s\"", p, text);
  }
  return tw_mesh_init(m, n, axes, sizes);
}

const char *tw_mesh_str(const tw_mesh *m, char *buf, size_t n) {
  if (!buf || n == 0) return "";
  buf[0] = 0;
  if (!m || m->naxes == 0) {
    snprintf(buf, n, "1");
    return buf;
  }
  size_t used = 0;
  for (int i = 0; i < m->naxes && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, "%s%s=%d", i ? "," : "", tw_axis_name(m->axis[i]), m->size[i]);
  return buf;
}

int tw_mesh_ranks(const tw_mesh *m) {
  int r = 1;
  for (int i = 0; m && i < m->naxes; i++) r *= m->size[i];
  return r;
}

static int axis_pos(const tw_mesh *m, tw_axis a) {
  for (int i = 0; i < m->naxes; i++)
    if (m->axis[i] == a) return i;
  return -1;
}

int tw_mesh_axis_size(const tw_mesh *m, tw_axis a) {
  int i = axis_pos(m, a);
  return i < 0 ? 1 : m->size[i];
}

int tw_mesh_coord(const tw_mesh *m, int rank, tw_axis a) {
  int i = axis_pos(m, a);
  if (i < 0) return 0;
  int stride = 1;
  for (int j = m->naxes - 1; j > i; j--) stride *= m->size[j];
  return (rank / stride) % m->size[i];
}

/* ---- specs -------------------------------------------------------------------------- */

static const char *skip_ws(const char *p) {
  while (isspace((unsigned char)*p)) p++;
  return p;
}

static tw_status parse_axis(const char **pp, tw_axis *out, const char *text) {
  const char *p = skip_ws(*pp);
  char name[16];
  int len = 0;
  while ((isalnum((unsigned char)*p) || *p == '_') && len < 15) name[len++] = *p++;
  name[len] = 0;
  if (len == 0) return tw_error(TW_ERR_INVALID_ARG, "spec: expected an axis at '%s' in \"%s\"", p, text);
  if (tw_axis_from_name(name, out) != 0)
    return tw_error(TW_ERR_INVALID_ARG, "spec: unknown axis '%s' in \"%s\" (known: dp, fsdp, ep, tp, pp, cp)",
                    name, text);
  *pp = p;
  return TW_OK;
}

tw_status tw_pspec_parse(const char *text, tw_pspec *ps) {
  if (!text || !ps) return tw_error(TW_ERR_NULL, "spec: text or out is NULL");
  memset(ps, 0, sizeof *ps);
  const char *p = skip_ws(text);
  int bracket = *p == '[';
  if (bracket) p = skip_ws(p + 1);
  if ((bracket && *p == ']') || (!bracket && *p == 0)) { /* a 0-d spec */
    if (bracket && *skip_ws(p + 1))
      return tw_error(TW_ERR_INVALID_ARG, "spec: trailing text after ']' in \"%s\"", text);
    return TW_OK;
  }
  for (;;) {
    if (ps->ndim == TW_MAX_DIMS)
      return tw_error(TW_ERR_INVALID_ARG, "spec: more than %d dims in \"%s\"", TW_MAX_DIMS, text);
    tw_dimspec *d = &ps->dim[ps->ndim++];
    p = skip_ws(p);
    if (strncmp(p, "None", 4) == 0) {
      p += 4;
    } else if (*p == '-') {
      p++;
    } else if (*p == '(') {
      p = skip_ws(p + 1);
      if (*p == ')') { p++; } /* () = replicated */
      else
        for (;;) {
          if (d->n == TW_AXIS_COUNT) return tw_error(TW_ERR_INVALID_ARG, "spec: tuple too long in \"%s\"", text);
          TW_TRY(parse_axis(&p, &d->axis[d->n], text));
          d->n++;
          p = skip_ws(p);
          if (*p == ',') { p++; continue; }
          if (*p == ')') { p++; break; }
          return tw_error(TW_ERR_INVALID_ARG, "spec: expected ',' or ')' at '%s' in \"%s\"", p, text);
        }
    } else {
      TW_TRY(parse_axis(&p, &d->axis[0], text));
      d->n = 1;
    }
    p = skip_ws(p);
    if (*p == ',') { p++; continue; }
    if (bracket && *p == ']') {
      if (*skip_ws(p + 1)) return tw_error(TW_ERR_INVALID_ARG, "spec: trailing text after ']' in \"%s\"", text);
      return TW_OK;
    }
    if (!bracket && *p == 0) return TW_OK;
    return tw_error(TW_ERR_INVALID_ARG, "spec: expected ',' at '%s' in \"%s\"", p, text);
  }
}

static size_t dimspec_str(const tw_dimspec *d, char *buf, size_t n) {
  if (d->n == 0) return (size_t)snprintf(buf, n, "None");
  if (d->n == 1) return (size_t)snprintf(buf, n, "%s", tw_axis_name(d->axis[0]));
  size_t u = (size_t)snprintf(buf, n, "(");
  for (int i = 0; i < d->n && u < n; i++)
    u += (size_t)snprintf(buf + u, n - u, "%s%s", i ? "," : "", tw_axis_name(d->axis[i]));
  if (u < n) u += (size_t)snprintf(buf + u, n - u, ")");
  return u;
}

const char *tw_pspec_str(const tw_pspec *ps, char *buf, size_t n) {
  if (!buf || n == 0) return "";
  size_t u = (size_t)snprintf(buf, n, "[");
  for (int i = 0; ps && i < ps->ndim && u < n; i++) {
    if (i && u < n) u += (size_t)snprintf(buf + u, n - u, ", ");
    if (u < n) u += dimspec_str(&ps->dim[i], buf + u, n - u);
  }
  if (u < n) snprintf(buf + u, n - u, "]");
  return buf;
}

int tw_pspec_equal(const tw_pspec *a, const tw_pspec *b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++) {
    if (a->dim[i].n != b->dim[i].n) return 0;
    for (int j = 0; j < a->dim[i].n; j++)
      if (a->dim[i].axis[j] != b->dim[i].axis[j]) return 0;
  }
  return 1;
}

int tw_dimspec_shards(const tw_mesh *m, const tw_dimspec *d) {
  int s = 1;
  for (int i = 0; i < d->n; i++) s *= tw_mesh_axis_size(m, d->axis[i]);
  return s;
}

int tw_dimspec_index(const tw_mesh *m, const tw_dimspec *d, int rank) {
  int idx = 0;
  for (int i = 0; i < d->n; i++)
    idx = idx * tw_mesh_axis_size(m, d->axis[i]) + tw_mesh_coord(m, rank, d->axis[i]);
  return idx;
}

tw_status tw_pspec_check(const tw_mesh *m, const tw_pspec *p, int ndim, const int64_t *shape,
                         const char *what) {
  char sb[128];
  if (!m || !p) return tw_error(TW_ERR_NULL, "spec: mesh or spec is NULL");
  if (!what) what = "tensor";
  if (p->ndim != ndim)
    return tw_error(TW_ERR_SHAPE, "spec: %s has %d dims but its spec %s has %d", what, ndim,
                    tw_pspec_str(p, sb, sizeof sb), p->ndim);
  int used[TW_AXIS_COUNT] = {0};
  for (int d = 0; d < ndim; d++) {
    const tw_dimspec *ds = &p->dim[d];
    if (ds->n < 0 || ds->n > TW_AXIS_COUNT)
      return tw_error(TW_ERR_INVALID_ARG, "spec: %s dim %d has %d axes", what, d, ds->n);
    for (int i = 0; i < ds->n; i++) {
      tw_axis a = ds->axis[i];
      if ((int)a < 0 || a >= TW_AXIS_COUNT)
        return tw_error(TW_ERR_INVALID_ARG, "spec: %s dim %d names axis id %d", what, d, (int)a);
      if (axis_pos(m, a) < 0) {
        char mb[96];
        return tw_error(TW_ERR_INVALID_ARG, "spec: %s %s uses axis '%s', which mesh %s lacks", what,
                        tw_pspec_str(p, sb, sizeof sb), tw_axis_name(a), tw_mesh_str(m, mb, sizeof mb));
      }
      if (used[a])
        return tw_error(TW_ERR_INVALID_ARG, "spec: %s %s uses axis '%s' twice", what,
                        tw_pspec_str(p, sb, sizeof sb), tw_axis_name(a));
      used[a] = 1;
    }
    int s = tw_dimspec_shards(m, ds);
    if (shape && shape[d] % s != 0)
      return tw_error(TW_ERR_SHAPE, "spec: %s dim %d of size %lld does not split into %d shards (%s)",
                      what, d, (long long)shape[d], s, tw_pspec_str(p, sb, sizeof sb));
  }
  return TW_OK;
}

/* ---- host slicing -------------------------------------------------------------------- */

/* Copies between a global tensor and rank's shard; to_global picks the direction. */
static tw_status host_shard_copy(const char *op, const tw_mesh *m, const tw_pspec *spec, int rank,
                                 const tw_tensor *global, const tw_tensor *local, int to_global) {
  if (!m || !spec || !global || !local) return tw_error(TW_ERR_NULL, "%s: NULL argument", op);
  if (global->dtype != local->dtype || global->ndim != local->ndim || global->ndim != spec->ndim)
    return tw_error(TW_ERR_SHAPE, "%s: global, local and spec disagree in dtype or rank", op);
  if (global->mem != TW_MEM_HOST || local->mem != TW_MEM_HOST)
    return tw_error(TW_ERR_MEMORY, "%s: host tensors only", op);
  if (tw_dtype_bits(global->dtype) < 8) return tw_error(TW_ERR_DTYPE, "%s: sub-byte dtype", op);
  if (rank < 0 || rank >= tw_mesh_ranks(m))
    return tw_error(TW_ERR_INVALID_ARG, "%s: rank %d of %d", op, rank, tw_mesh_ranks(m));
  int nd = global->ndim;
  TW_TRY(tw_pspec_check(m, spec, nd, global->shape, "tensor"));
  int64_t off[TW_MAX_DIMS] = {0};
  for (int d = 0; d < nd; d++) {
    int s = tw_dimspec_shards(m, &spec->dim[d]);
    if (local->shape[d] * s != global->shape[d])
      return tw_error(TW_ERR_SHAPE, "%s: dim %d: local %lld x %d shards != global %lld", op, d,
                      (long long)local->shape[d], s, (long long)global->shape[d]);
    off[d] = (int64_t)tw_dimspec_index(m, &spec->dim[d], rank) * local->shape[d];
  }
  size_t es = tw_dtype_storage_bytes(global->dtype, 1);
  int64_t n = tw_tensor_numel(local);
  if (n == 0) return TW_OK;
  /* copy rows of the last dim */
  int64_t row = nd ? local->shape[nd - 1] : 1, rows = n / row;
  for (int64_t r = 0; r < rows; r++) {
    int64_t rem = r, gi = 0, stride = 1;
    int64_t idx[TW_MAX_DIMS] = {0};
    for (int d = nd - 2; d >= 0; d--) {
      idx[d] = rem % local->shape[d];
      rem /= local->shape[d];
    }
    for (int d = nd - 1; d >= 0; d--) {
      int64_t i = (d == nd - 1 ? 0 : idx[d]) + off[d];
      gi += i * stride;
      stride *= global->shape[d];
    }
    char *g = (char *)global->data + (size_t)gi * es;
    char *l = (char *)local->data + (size_t)(r * row) * es;
    if (to_global) memcpy(g, l, (size_t)row * es);
    else memcpy(l, g, (size_t)row * es);
  }
  return TW_OK;
}

tw_status tw_shard_slice_host(const tw_mesh *m, const tw_pspec *spec, int rank,
                              const tw_tensor *global, tw_tensor *local) {
  return host_shard_copy("shard_slice_host", m, spec, rank, global, local, 0);
}

tw_status tw_shard_place_host(const tw_mesh *m, const tw_pspec *spec, int rank,
                              const tw_tensor *local, tw_tensor *global) {
  return host_shard_copy("shard_place_host", m, spec, rank, global, local, 1);
}
