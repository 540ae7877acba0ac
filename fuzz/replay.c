/* Repro directories: case.txt (key = value) + the inputs as .npy (f32 logical values, i32
 * group sizes), and report.txt with the checker's lines. fuzz/README.md documents the keys. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz/fuzz_internal.h"
#include "twin/tw_npy.h"

int fz_mkdir_p(const char *path) {
  char buf[1024];
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
  for (char *p = buf + 1; *p; p++)
    if (*p == '/') {
      *p = 0;
      if (mkdir(buf, 0775) != 0 && errno != EEXIST) return -1;
      *p = '/';
    }
  if (mkdir(buf, 0775) != 0 && errno != EEXIST) return -1;
  return 0;
}

static tw_status save_f32(const char *dir, const char *name, const float *v, int ndim,
                          const int64_t *shape) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s.npy", dir, name);
  tw_tensor t = {(void *)v, TW_F32, ndim, {0, 0, 0, 0}, TW_MEM_HOST};
  for (int i = 0; i < ndim; i++) t.shape[i] = shape[i];
  return tw_npy_save(path, &t);
}

static const char *op_str(tw_op o) { return o == TW_OP_T ? "T" : "N"; }

static void write_spec(FILE *f, const char *p, const fz_operand_spec *s) {
  fprintf(f, "%s_dtype = %s\n%s_mode = %s\n", p, tw_dtype_name(s->dtype), p, tw_scaling_name(s->mode));
  if (s->mode != TW_SCALE_NONE)
    fprintf(f, "%s_qdtype = %s\n%s_colwise = %d\n%s_swizzled = %d\n%s_pow2 = %d\n%s_padded = %d\n", p,
            tw_dtype_name(s->qdtype), p, s->colwise, p, s->swizzled, p, s->pow2, p, s->padded);
}

static const char *const kFiles[] = {"case.txt", "report.txt", "group_sizes.npy", "x.npy", "a.npy",
                                     "b.npy", "out_init.npy", "scale.npy"};

tw_status fz_case_write(const char *dir, const fz_case *c, const char *backend_name, const char *plant) {
  if (fz_mkdir_p(dir) != 0) return tw_error(TW_ERR_IO, "fuzz: cannot create directory %s", dir);
  char path[1200];
  for (size_t i = 0; i < sizeof kFiles / sizeof kFiles[0]; i++) { /* no stale inputs of an earlier case */
    snprintf(path, sizeof path, "%s/%s", dir, kFiles[i]);
    remove(path);
  }
  snprintf(path, sizeof path, "%s/case.txt", dir);
  FILE *f = fopen(path, "w");
  if (!f) return tw_error(TW_ERR_IO, "fuzz: cannot write %s", path);
  char desc[512];
  fz_case_describe(c, desc, sizeof desc);
  fprintf(f, "# twin fuzz case: %s\n", desc);
  fprintf(f, "# replay: twin fuzz --replay %s --backend %s%s%s\n", dir, backend_name ? backend_name : "ref",
          plant ? " --plant " : "", plant ? plant : "");
  fprintf(f, "op = %s\nseed = %llu\nM = %lld\nK = %lld\nN = %lld\nG = %lld\n", fz_op_name(c->op),
          (unsigned long long)c->seed, (long long)c->M, (long long)c->K, (long long)c->N, (long long)c->G);
  fprintf(f, "backend = %s\n", backend_name ? backend_name : "ref");
  if (plant) fprintf(f, "plant = %s\n", plant);
  if (c->sharded) {
    char mb[96], xs[160], ws[160];
    fprintf(f, "sharded = 1\nrule = %s\npass = %s\nmesh = %s\nx_spec = %s\n", tw_shard_op_name(c->rule),
            tw_pass_name(c->pass), tw_mesh_str(&c->mesh, mb, sizeof mb), tw_pspec_str(&c->x_spec, xs, sizeof xs));
    if (c->rule != TW_SHARD_GROUPED_QUANTIZE) fprintf(f, "w_spec = %s\n", tw_pspec_str(&c->w_spec, ws, sizeof ws));
    if (c->rule == TW_SHARD_DENSE) fprintf(f, "B = %lld\nw_batched = %d\n", (long long)c->B, c->w_batched);
    if (c->fp8_inputs) fprintf(f, "fp8_inputs = 1\nquantize_before_gather = %d\n", c->quantize_before_gather);
    const char *want = fz_shard_expected_error(c);
    fprintf(f, "# the rules say: %s%s%s\n", want ? "refuse with '" : "plan", want ? want : "", want ? "'" : "");
    if (c->rule == TW_SHARD_GROUPED_QUANTIZE)
      fprintf(f, "mode = %s\nqdtype = %s\nlayout = %d\npow2_scales = %d\nswizzled = %d\nx_dtype = %s\n",
              tw_scaling_name(c->mode), tw_dtype_name(c->qdtype), (int)c->layout, c->pow2, c->swizzled,
              tw_dtype_name(c->x_dtype));
    else
      fprintf(f, "a_dtype = %s\nb_dtype = %s\nout_dtype = %s\n", tw_dtype_name(c->sa.dtype), tw_dtype_name(c->sb.dtype),
              tw_dtype_name(c->out_dtype));
  } else
  switch (c->op) {
    case FZ_QUANTIZE:
      fprintf(f, "mode = %s\nqdtype = %s\nlayout = %d\npow2_scales = %d\nswizzled = %d\nx_dtype = %s\n",
              tw_scaling_name(c->mode), tw_dtype_name(c->qdtype), (int)c->layout, c->pow2, c->swizzled,
              tw_dtype_name(c->x_dtype));
      break;
    case FZ_CAST:
      fprintf(f, "x_dtype = %s\ndst_dtype = %s\nsaturate = %d\n", tw_dtype_name(c->x_dtype),
              tw_dtype_name(c->dst_dtype), c->saturate);
      break;
    default:
      fprintf(f, "op_a = %s\nop_b = %s\nout_dtype = %s\naccumulate = %d\n", op_str(c->op_a), op_str(c->op_b),
              tw_dtype_name(c->out_dtype), c->accumulate);
      write_spec(f, "a", &c->sa);
      write_spec(f, "b", &c->sb);
  }
  fprintf(f, "note = %s\n", c->note[0] ? c->note : "-");
  int bad = ferror(f);
  if (fclose(f) != 0 || bad) return tw_error(TW_ERR_IO, "fuzz: error writing %s", path);
  if (c->G > 0) {
    snprintf(path, sizeof path, "%s/group_sizes.npy", dir);
    tw_tensor t = tw_tensor_1d(c->group_sizes, TW_I32, c->G, TW_MEM_HOST);
    TW_TRY(tw_npy_save(path, &t));
  }
  int64_t mk[2] = {c->M, c->K};
  if (c->sharded) { /* the plan's inputs in their global shapes */
    int nd[3];
    int64_t shape[3][TW_MAX_DIMS];
    fz_shard_shapes(c, nd, shape, NULL);
    if (c->x) TW_TRY(save_f32(dir, "x", c->x, 2, mk));
    if (c->a) TW_TRY(save_f32(dir, "a", c->a, nd[0], shape[0]));
    if (c->b) TW_TRY(save_f32(dir, "b", c->b, nd[1], shape[1]));
    if (c->scale) {
      int64_t g[1] = {c->G};
      TW_TRY(save_f32(dir, "scale", c->scale, 1, g));
    }
    return TW_OK;
  }
  if (c->x) TW_TRY(save_f32(dir, "x", c->x, 2, mk));
  if (c->a) TW_TRY(save_f32(dir, "a", c->a, 2, mk));
  if (c->b) {
    int64_t kn[2] = {c->K, c->N}, gkn[3] = {c->G, c->K, c->N}, mn[2] = {c->M, c->N};
    if (c->op == FZ_GEMM) TW_TRY(save_f32(dir, "b", c->b, 2, kn));
    else if (c->op == FZ_GROUPED_GEMM) TW_TRY(save_f32(dir, "b", c->b, 3, gkn));
    else TW_TRY(save_f32(dir, "b", c->b, 2, mn));
  }
  if (c->out_init) {
    int64_t mn[2] = {c->M, c->N}, gkn[3] = {c->G, c->K, c->N};
    TW_TRY(save_f32(dir, "out_init", c->out_init, c->op == FZ_WGRAD ? 3 : 2, c->op == FZ_WGRAD ? gkn : mn));
  }
  if (c->scale) {
    int64_t g[1] = {c->G};
    TW_TRY(save_f32(dir, "scale", c->scale, 1, g));
  }
  return TW_OK;
}

tw_status fz_report_write(const char *dir, const fz_result *r, const char *extra) {
  char path[1200];
  snprintf(path, sizeof path, "%s/report.txt", dir);
  FILE *f = fopen(path, "w");
  if (!f) return tw_error(TW_ERR_IO, "fuzz: cannot write %s", path);
  if (extra) fprintf(f, "%s\n", extra);
  fprintf(f, "verdict: %s\n", r->verdict == FZ_PASS ? "PASS" : r->verdict == FZ_FAIL ? "FAIL" : "ERROR");
  fz_result_print(r, f);
  fclose(f);
  return TW_OK;
}

/* ---- reading ---- */
typedef struct {
  char key[64][48];
  char val[64][160];
  int n;
} kv;

static tw_status read_kv(const char *path, kv *t) {
  FILE *f = fopen(path, "r");
  if (!f) return tw_error(TW_ERR_IO, "fuzz: cannot open %s", path);
  char line[512];
  t->n = 0;
  int ln = 0;
  while (fgets(line, sizeof line, f)) {
    ln++;
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#' || *p == '\n' || *p == 0) continue;
    char *eq = strchr(p, '=');
    if (!eq || t->n >= 64) {
      fclose(f);
      return tw_error(TW_ERR_IO, "fuzz: %s:%d: expected 'key = value'", path, ln);
    }
    char *ke = eq;
    while (ke > p && (ke[-1] == ' ' || ke[-1] == '\t')) ke--;
    char *v = eq + 1;
    while (*v == ' ' || *v == '\t') v++;
    char *ve = v + strlen(v);
    while (ve > v && (ve[-1] == '\n' || ve[-1] == '\r' || ve[-1] == ' ')) ve--;
    snprintf(t->key[t->n], sizeof t->key[0], "%.*s", (int)(ke - p), p);
    snprintf(t->val[t->n], sizeof t->val[0], "%.*s", (int)(ve - v), v);
    t->n++;
  }
  fclose(f);
  return TW_OK;
}

static const char *get(const kv *t, const char *key) {
  for (int i = 0; i < t->n; i++)
    if (strcmp(t->key[i], key) == 0) return t->val[i];
  return NULL;
}

static tw_status get_int(const kv *t, const char *key, int64_t def, int64_t *out) {
  const char *v = get(t, key);
  if (!v) { *out = def; return TW_OK; }
  char *end;
  long long x = strtoll(v, &end, 10);
  if (*end) return tw_error(TW_ERR_IO, "fuzz: case.txt: %s = '%s' is not an integer", key, v);
  *out = x;
  return TW_OK;
}

static tw_status get_dtype(const kv *t, const char *key, tw_dtype def, tw_dtype *out) {
  const char *v = get(t, key);
  if (!v) { *out = def; return TW_OK; }
  if (tw_dtype_from_name(v, out) != 0) return tw_error(TW_ERR_IO, "fuzz: case.txt: %s = '%s' is not a dtype", key, v);
  return TW_OK;
}

static tw_status get_mode(const kv *t, const char *key, tw_scaling *out) {
  const char *v = get(t, key);
  if (!v) { *out = TW_SCALE_NONE; return TW_OK; }
  if (tw_scaling_from_name(v, out) != 0)
    return tw_error(TW_ERR_IO, "fuzz: case.txt: %s = '%s' is not a scaling mode", key, v);
  return TW_OK;
}

static tw_status get_op(const kv *t, const char *key, tw_op *out) {
  const char *v = get(t, key);
  if (!v || strcmp(v, "N") == 0) { *out = TW_OP_N; return TW_OK; }
  if (strcmp(v, "T") == 0) { *out = TW_OP_T; return TW_OK; }
  return tw_error(TW_ERR_IO, "fuzz: case.txt: %s = '%s' is not N or T", key, v);
}

static tw_status get_spec(const kv *t, const char *p, fz_operand_spec *s) {
  char k[32];
  int64_t v;
  memset(s, 0, sizeof *s);
  snprintf(k, sizeof k, "%s_dtype", p);
  TW_TRY(get_dtype(t, k, TW_F32, &s->dtype));
  snprintf(k, sizeof k, "%s_mode", p);
  TW_TRY(get_mode(t, k, &s->mode));
  snprintf(k, sizeof k, "%s_qdtype", p);
  TW_TRY(get_dtype(t, k, TW_E4M3, &s->qdtype));
  snprintf(k, sizeof k, "%s_colwise", p);
  TW_TRY(get_int(t, k, 0, &v));
  s->colwise = (int)v;
  snprintf(k, sizeof k, "%s_swizzled", p);
  TW_TRY(get_int(t, k, 0, &v));
  s->swizzled = (int)v;
  snprintf(k, sizeof k, "%s_pow2", p);
  TW_TRY(get_int(t, k, 0, &v));
  s->pow2 = (int)v;
  snprintf(k, sizeof k, "%s_padded", p); /* absent in repros older than the layout: 0 */
  TW_TRY(get_int(t, k, 0, &v));
  s->padded = (int)v;
  return TW_OK;
}

/* Loads dir/name.npy as f32 (or i32) with exactly n elements into a malloc'd array. */
static tw_status load_array(const char *dir, const char *name, tw_dtype want, int64_t n, void **out) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s.npy", dir, name);
  tw_tensor t;
  TW_TRY(tw_npy_load(path, &t));
  if (t.dtype != want || tw_tensor_numel(&t) != n) {
    free(t.data);
    return tw_error(TW_ERR_IO, "fuzz: %s holds %lld %s elements, expected %lld %s", path,
                    (long long)tw_tensor_numel(&t), tw_dtype_name(t.dtype), (long long)n, tw_dtype_name(want));
  }
  if (!t.data) t.data = malloc(4);
  *out = t.data;
  return TW_OK;
}

static tw_status read_case(const char *dir, fz_case *c) {
  char path[1200];
  snprintf(path, sizeof path, "%s/case.txt", dir);
  kv *t = calloc(1, sizeof *t);
  if (!t) return tw_error(TW_ERR_MEMORY, "fuzz: out of memory");
  tw_status s = read_kv(path, t);
  if (s != TW_OK) { free(t); return s; }
#define TRY(e) do { s = (e); if (s != TW_OK) goto done; } while (0)
  const char *opn = get(t, "op");
  if (!opn || fz_op_from_name(opn, &c->op) != 0) {
    s = tw_error(TW_ERR_IO, "fuzz: %s: op = '%s' is not a fuzzed op", path, opn ? opn : "(missing)");
    goto done;
  }
  int64_t v;
  const char *seed = get(t, "seed");
  c->seed = seed ? strtoull(seed, NULL, 10) : 0; /* informational */
  TRY(get_int(t, "M", 0, &c->M));
  TRY(get_int(t, "K", 0, &c->K));
  TRY(get_int(t, "N", 0, &c->N));
  TRY(get_int(t, "G", 0, &c->G));
  if (c->M < 0 || c->K < 0 || c->N < 0 || c->G < 0 || c->M > (1 << 24) || c->K > (1 << 24) ||
      c->N > (1 << 24) || c->G > (1 << 20)) {
    s = tw_error(TW_ERR_IO, "fuzz: %s: dims out of range", path);
    goto done;
  }
  TRY(get_mode(t, "mode", &c->mode));
  TRY(get_dtype(t, "qdtype", TW_E4M3, &c->qdtype));
  TRY(get_int(t, "layout", 1, &v)); c->layout = (tw_qlayout)v;
  TRY(get_int(t, "pow2_scales", 0, &v)); c->pow2 = (int)v;
  TRY(get_int(t, "swizzled", 0, &v)); c->swizzled = (int)v;
  TRY(get_dtype(t, "x_dtype", TW_F32, &c->x_dtype));
  TRY(get_dtype(t, "dst_dtype", TW_F32, &c->dst_dtype));
  TRY(get_int(t, "saturate", 0, &v)); c->saturate = (int)v;
  TRY(get_op(t, "op_a", &c->op_a));
  TRY(get_op(t, "op_b", &c->op_b));
  TRY(get_dtype(t, "out_dtype", TW_F32, &c->out_dtype));
  TRY(get_int(t, "accumulate", 0, &v)); c->accumulate = (int)v;
  TRY(get_spec(t, "a", &c->sa));
  TRY(get_spec(t, "b", &c->sb));
  const char *note = get(t, "note");
  snprintf(c->note, sizeof c->note, "%s", note ? note : "");
  const char *plant = get(t, "plant");
  snprintf(c->plant, sizeof c->plant, "%s", plant ? plant : "");
  TRY(get_int(t, "sharded", 0, &v)); c->sharded = v != 0;
  if (c->sharded) {
    const char *rule = get(t, "rule"), *pass = get(t, "pass"), *mesh = get(t, "mesh");
    const char *xs = get(t, "x_spec"), *ws = get(t, "w_spec");
    if (!rule || tw_shard_op_from_name(rule, &c->rule) != 0) {
      s = tw_error(TW_ERR_IO, "fuzz: %s: rule = '%s' is not dense, grouped_gemm or grouped_quantize", path, rule ? rule : "(missing)");
      goto done;
    }
    if (pass && tw_pass_from_name(pass, &c->pass) != 0) {
      s = tw_error(TW_ERR_IO, "fuzz: %s: pass = '%s' is not fwd, dgrad or wgrad", path, pass);
      goto done;
    }
    if (!mesh || tw_mesh_parse(mesh, &c->mesh) != TW_OK || tw_mesh_ranks(&c->mesh) > 64) {
      s = tw_error(TW_ERR_IO, "fuzz: %s: mesh = '%s': %s", path, mesh ? mesh : "(missing)",
                   mesh ? (tw_mesh_ranks(&c->mesh) > 64 ? "more than 64 ranks" : tw_last_error()) : "needed");
      goto done;
    }
    if (!xs || tw_pspec_parse(xs, &c->x_spec) != TW_OK ||
        (c->rule != TW_SHARD_GROUPED_QUANTIZE && (!ws || tw_pspec_parse(ws, &c->w_spec) != TW_OK))) {
      s = tw_error(TW_ERR_IO, "fuzz: %s: x_spec/w_spec: %s", path, xs ? tw_last_error() : "missing");
      goto done;
    }
    TRY(get_int(t, "B", 0, &c->B));
    TRY(get_int(t, "w_batched", 0, &v)); c->w_batched = v != 0;
    TRY(get_int(t, "fp8_inputs", 0, &v)); c->fp8_inputs = v != 0;
    TRY(get_int(t, "quantize_before_gather", 0, &v)); c->quantize_before_gather = v != 0;
    if (c->B < 0 || c->B > (1 << 16)) {
      s = tw_error(TW_ERR_IO, "fuzz: %s: B out of range", path);
      goto done;
    }
    if (c->G > 0) TRY(load_array(dir, "group_sizes", TW_I32, c->G, (void **)&c->group_sizes));
    if (c->rule == TW_SHARD_GROUPED_QUANTIZE) {
      TRY(load_array(dir, "x", TW_F32, c->M * c->K, (void **)&c->x));
      if (c->mode == TW_SCALE_TENSOR_DELAYED) TRY(load_array(dir, "scale", TW_F32, c->G, (void **)&c->scale));
    } else {
      TRY(load_array(dir, "a", TW_F32, fz_numel_a(c), (void **)&c->a));
      TRY(load_array(dir, "b", TW_F32, fz_numel_b(c), (void **)&c->b));
    }
    goto done;
  }
  if (c->G > 0) TRY(load_array(dir, "group_sizes", TW_I32, c->G, (void **)&c->group_sizes));
  if (fz_numel_x(c) > 0 || c->op == FZ_QUANTIZE || c->op == FZ_CAST)
    TRY(load_array(dir, "x", TW_F32, fz_numel_x(c), (void **)&c->x));
  if (c->op >= FZ_GEMM) {
    TRY(load_array(dir, "a", TW_F32, fz_numel_a(c), (void **)&c->a));
    TRY(load_array(dir, "b", TW_F32, fz_numel_b(c), (void **)&c->b));
    if (c->accumulate) TRY(load_array(dir, "out_init", TW_F32, fz_numel_out(c), (void **)&c->out_init));
  }
  if (c->op == FZ_QUANTIZE && c->mode == TW_SCALE_TENSOR_DELAYED)
    TRY(load_array(dir, "scale", TW_F32, c->G, (void **)&c->scale));
#undef TRY
done:
  free(t);
  return s;
}

tw_status fz_case_read(const char *dir, fz_case *c) {
  memset(c, 0, sizeof *c);
  tw_status s = read_case(dir, c);
  if (s != TW_OK) fz_case_free(c);
  return s;
}
