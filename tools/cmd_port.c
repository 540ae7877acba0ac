/* `twin port`: every registry entry x kernel version checked against the oracle and timed
 * against the ceilings measured in the same run; writes report.md, report.json, roofline.png
 * (tools/port.h). Progress goes to stderr, one line per entry and version. */
#include <cblas.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/backend.h"
#include "fuzz/fuzz_internal.h"
#include "golden/exec.h"
#include "golden/runner.h"
#include "tools/cli.h"
#include "tools/port.h"

#pragma weak tw_port_gpu_facts
extern const tw_backend_ops tw_ref_ops __attribute__((weak));
extern const tw_backend_ops tw_gpu_ops __attribute__((weak));

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin port [--backend ref|gpu] [--out DIR] [--filter S] [--quick] [--golden DIR]\n"
          "                 [--peers FILE]\n"
          "       twin port --compare A.json B.json\n"
          "\n"
          "The porting baseline of this machine: device facts, measured ceilings (copy bandwidth,\n"
          "dense GEMM rate), and for every operation of the registry x kernel version x input\n"
          "dtype: runs or TW_ERR_UNSUPPORTED (and why), correct against the oracle on a fixed case\n"
          "set (its golden cases and a fixed fuzz draw), time on its bench shapes, %% of floor,\n"
          "ratio to the default version and to peers. Writes DIR/report.md, DIR/report.json and,\n"
          "where matplotlib is installed, DIR/roofline.png (python3 tools/roofline.py DIR/report.json\n"
          "draws it anywhere later). Exit 0 if every case that ran passed, 1 if any failed.\n"
          "\n"
          "  --backend NAME   gpu (default where a GPU is visible) or ref\n"
          "  --out DIR        where the report goes (default port-<backend>)\n"
          "  --filter S       only operations whose registry name (or alias) contains S\n"
          "  --quick          fewer fuzz cases and timed iterations (the whole run under 5 minutes\n"
          "                   on an H100)\n"
          "  --golden DIR     golden case root (default: golden/data of the workspace)\n"
          "  --peers FILE     gpu: peer timings measured on this machine in this session, as the\n"
          "                   gpu benches read them (tools/peers/*.py outputs, concatenated)\n"
          "  --compare A B    per operation and version, the change in correctness and speed from\n"
          "                   report A to report B, regressions first; exit 1 if any\n");
}

void port_fact_add(port_report *r, const char *key, const char *fmt, ...) {
  if (r->nfacts >= PORT_MAX_FACTS) return;
  port_fact *f = &r->facts[r->nfacts++];
  snprintf(f->key, sizeof f->key, "%s", key);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(f->val, sizeof f->val, fmt, ap);
  va_end(ap);
}

/* ---- the host's facts and ceilings (--backend ref) ---------------------------------------- */
static void host_facts(port_report *r) {
  char line[256], model[160] = "unknown";
  FILE *f = fopen("/proc/cpuinfo", "r");
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
      snprintf(model, sizeof model, "%s", strchr(line, ':') + 2);
      model[strcspn(model, "\n")] = 0;
      break;
    }
  if (f) fclose(f);
  port_fact_add(r, "cpu", "%s", model);
  port_fact_add(r, "cores", "%ld", sysconf(_SC_NPROCESSORS_ONLN));
  port_fact_add(r, "memory", "%.1f GiB", (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) / (1 << 30));
  port_fact_add(r, "openblas", "%s", openblas_get_config());
}

static double best_ms(void (*fn)(void *), void *arg, int iters) {
  double best = 1e30;
  for (int i = 0; i < iters; i++) {
    double t0 = tw_bench_now_ms();
    fn(arg);
    double t = tw_bench_now_ms() - t0;
    if (t < best) best = t;
  }
  return best;
}

typedef struct { void *dst, *src; size_t n; float *a, *b, *c; int d; } host_ceiling;
static void do_copy(void *p) { host_ceiling *h = (host_ceiling *)p; memcpy(h->dst, h->src, h->n); }
static void do_sgemm(void *p) {
  host_ceiling *h = (host_ceiling *)p;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, h->d, h->d, h->d, 1.f, h->a, h->d, h->b, h->d, 0.f, h->c, h->d);
}

/* memcpy bandwidth (bytes read + written) and the dense sgemm rate, best of a few */
static void host_ceilings(port_report *r) {
  host_ceiling h = {0};
  h.n = (size_t)64 << 20;
  h.d = r->quick ? 512 : 1024;
  h.dst = malloc(h.n);
  h.src = malloc(h.n);
  h.a = (float *)calloc((size_t)h.d * h.d, 4);
  h.b = (float *)calloc((size_t)h.d * h.d, 4);
  h.c = (float *)calloc((size_t)h.d * h.d, 4);
  if (h.dst && h.src && h.a && h.b && h.c) {
    memset(h.src, 1, h.n);
    memset(h.dst, 0, h.n);
    r->copy_gbs = 2.0 * h.n / (best_ms(do_copy, &h, 5) * 1e6);
    r->dense_f32_tflops = 2.0 * h.d * h.d * h.d / (best_ms(do_sgemm, &h, 3) * 1e9);
  }
  free(h.dst); free(h.src); free(h.a); free(h.b); free(h.c);
}

/* ---- checks ------------------------------------------------------------------------------------- */
static port_check *check_row(port_report *r, const tw_op_entry *e, const char *version, const char *dtype) {
  for (int i = 0; i < r->nchecks; i++)
    if (r->checks[i].op == e && !strcmp(r->checks[i].version, version) && !strcmp(r->checks[i].dtype, dtype))
      return &r->checks[i];
  if (r->nchecks == r->capchecks) {
    int cap = r->capchecks ? 2 * r->capchecks : 64;
    port_check *p = (port_check *)realloc(r->checks, sizeof *p * (size_t)cap);
    if (!p) return NULL;
    r->checks = p;
    r->capchecks = cap;
  }
  port_check *c = &r->checks[r->nchecks++];
  memset(c, 0, sizeof *c);
  c->op = e;
  snprintf(c->version, sizeof c->version, "%s", version);
  snprintf(c->dtype, sizeof c->dtype, "%s", dtype);
  return c;
}

static void tally(port_check *c, int passed, int unsupported, const char *why) {
  if (!c) return;
  c->cases++;
  if (unsupported) c->unsupported++;
  else if (passed) c->passed++;
  else c->failed++;
  if (!passed && !c->why[0]) snprintf(c->why, sizeof c->why, "%s", why);
}

/* The input dtype of a golden case, as the report groups it: "bf16", "f32->e5m2", "e4m3 mxfp8". */
static const char *case_dtype(const char *dir, char *buf, size_t n) {
  char path[2048];
  tw_case_keys k;
  snprintf(path, sizeof path, "%s/case.txt", dir);
  if (tw_case_keys_parse_file(path, &k) != TW_OK) return snprintf(buf, n, "?"), buf;
  const char *in = tw_case_get(&k, "x_dtype"), *mode = tw_case_get(&k, "lhs_mode"), *q = tw_case_get(&k, "lhs_qdtype");
  if (!in) in = tw_case_get(&k, "lhs_dtype");
  if (!in) in = tw_case_get(&k, "a_dtype");
  if (!mode) mode = tw_case_get(&k, "a_mode");
  if (!q) q = tw_case_get(&k, "a_qdtype");
  const char *op = tw_case_get(&k, "op"), *qd = tw_case_get(&k, "qdtype");
  if (mode && strcmp(mode, "none")) snprintf(buf, n, "%s %s", q ? q : "e4m3", mode);
  else if (op && !strcmp(op, "grouped_quantize")) snprintf(buf, n, "%s->%s", in ? in : "f32", qd ? qd : "e4m3");
  else if (op && !strcmp(op, "grouped_dequantize")) snprintf(buf, n, "%s", qd ? qd : "e4m3");
  else snprintf(buf, n, "%s", in ? in : "f32");
  return buf;
}

static int is_unsupported(tw_status s, const char *msg) {
  return s == TW_ERR_UNSUPPORTED || (msg && strstr(msg, "TW_ERR_UNSUPPORTED"));
}

typedef struct {
  char **dirs;
  int ndirs;
  tw_ctx *oracle;
} case_set;

/* The entry's golden cases and a fixed fuzz draw (seed 1, indexes 0..n-1) on ctx. */
static void check_version(port_report *r, const case_set *cs, const tw_op_entry *e, const char *version, tw_ctx *ctx) {
  char op[64], dt[32];
  if (e->fuzz_run && tw_ctx_backend(ctx) == TW_BACKEND_REF) {
    /* an entry's own fuzzer runs on ref thread ranks (meshes included): its fixed draw */
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    tw_op_fuzz_opts fo = {1, r->quick ? 16 : 64, 0, NULL, NULL, 1};
    int rc = mem ? e->fuzz_run(&fo, mem) : 1;
    if (mem) fclose(mem);
    char why[240];
    snprintf(why, sizeof why, "%.230s", buf ? buf : "out of memory");
    for (char *nl = strchr(why, '\n'); nl; nl = strchr(nl, '\n')) *nl = ' ';
    port_check *c = check_row(r, e, version, "own fuzzer seed 1");
    if (rc != 0) tally(c, 0, 0, why); /* the fuzzer stopped at its first failure, shrunk in why */
    else
      for (int64_t i = 0; i < fo.cases; i++) tally(c, 1, 0, "");
    free(buf);
    if (e->min_ranks > 1) return;
  }
  if (e->min_ranks > 1) { /* see registry.h: port runs single-device checks only */
    char why[128];
    snprintf(why, sizeof why, "needs a mesh of %d ranks: %s", e->min_ranks,
             e->fuzz_run ? "its own fuzzer runs it on ref thread ranks (twin port --backend ref)"
                         : "run twin check --sharding / twin fuzz --mesh");
    tally(check_row(r, e, version, "mesh"), 0, 1, why);
    return;
  }
  for (int i = 0; e->golden_op && i < cs->ndirs; i++) {
    if (strcmp(twin_golden_op(cs->dirs[i], op, sizeof op), e->golden_op)) continue;
    tw_golden_result g;
    tw_status s = tw_golden_run_case(ctx, cs->dirs[i], &g);
    char why[240];
    snprintf(why, sizeof why, "%.80s: %.150s", g.name, g.detail);
    tally(check_row(r, e, version, case_dtype(cs->dirs[i], dt, sizeof dt)), s == TW_OK && g.passed,
          g.skipped || is_unsupported(s, g.detail), why);
  }
  fz_op kind;
  if (!e->fuzz_kind || fz_op_from_name(e->fuzz_kind, &kind) != 0) return;
  int n = r->quick ? 16 : 64;
  port_check *c = check_row(r, e, version, "fuzz seed 1");
  fz_case *fc = (fz_case *)malloc(sizeof *fc);
  fz_result *res = (fz_result *)malloc(sizeof *res);
  for (int i = 0; fc && res && i < n; i++) {
    if (fz_generate(fc, kind, 1, (uint64_t)i) != 0) continue;
    fz_verdict v = fz_run_case(ctx, cs->oracle, fc, res);
    char why[240];
    snprintf(why, sizeof why, "fuzz seed 1 index %d: %.200s", i, res->message);
    tally(c, v == FZ_PASS, v != FZ_PASS && is_unsupported(TW_OK, res->message), why);
  }
  free(fc);
  free(res);
}

/* ---- timings ------------------------------------------------------------------------------------ */
typedef struct {
  port_report *r;
} sink_state;

/* Rows from the benches: ceilings are kept, the rows of entries the filter keeps are stored. */
static void collect(const tw_bench_row *row, void *user) {
  port_report *r = ((sink_state *)user)->r;
  if (!strcmp(row->op, "copy")) {
    r->copy_gbs = row->rate;
    return;
  }
  if (!strcmp(row->version, "gemm_lt") && !strncmp(row->shape, "dense", 5) && row->ms > 0) {
    if (strstr(row->shape, "e4m3")) r->dense_fp8_tflops = row->rate;
    else r->dense_bf16_tflops = row->rate;
  }
  const tw_op_entry *e = tw_op_find(row->op);
  if (!e || !tw_op_matches(e, r->filter)) return;
  if (r->ntimes == r->captimes) {
    int cap = r->captimes ? 2 * r->captimes : 64;
    port_time *p = (port_time *)realloc(r->times, sizeof *p * (size_t)cap);
    if (!p) return;
    r->times = p;
    r->captimes = cap;
  }
  port_time *t = &r->times[r->ntimes++];
  t->op = e;
  t->row = *row;
  if (!t->row.version[0]) snprintf(t->row.version, sizeof t->row.version, "%s", row->backend);
  t->ratio_default = -1;
  fprintf(stderr, "port:   %-14s %-40s %-14s %9.3f ms\n", row->op, row->shape, t->row.version, row->ms);
}

/* 1 if a bench row's version names the kernel `full` (benches may drop the family prefix:
 * "tile_spec" for quantize_tile_spec) */
static int names_version(const char *row_version, const char *full) {
  size_t a = strlen(row_version), b = strlen(full);
  return !strcmp(row_version, full) || (a < b && full[b - a - 1] == '_' && !strcmp(full + b - a, row_version));
}

/* ratio to the default version (the entry's first) of the same op and shape */
static void ratios_to_default(port_report *r) {
  for (int i = 0; i < r->ntimes; i++) {
    port_time *t = &r->times[i];
    const char *def = t->op->versions[0];
    for (int j = 0; def && j < r->ntimes; j++) {
      port_time *d = &r->times[j];
      if (d->op == t->op && !strcmp(d->row.shape, t->row.shape) && names_version(d->row.version, def) && d->row.ms > 0 &&
          t->row.ms > 0)
        t->ratio_default = d->row.ms / t->row.ms;
    }
  }
}

static void run_benches(port_report *r, tw_backend be, tw_ctx *ctx) {
  tw_bench_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.warmup = r->quick ? (be == TW_BACKEND_GPU ? 2 : 0) : 2;
  cfg.iters = r->quick ? (be == TW_BACKEND_GPU ? 10 : 1) : (be == TW_BACKEND_GPU ? 20 : 3);
  cfg.peers_json = r->peers_json;
  sink_state st = {r};
  tw_bench_set_sink(collect, &st);
  const void *done[32];
  int ndone = 0;
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    /* the gpu benches also measure the ceilings: they all run, the filter picks the rows */
    if (be != TW_BACKEND_GPU && !tw_op_matches(e, r->filter)) continue;
    const void *fn = be == TW_BACKEND_GPU ? (const void *)e->bench_gpu : (const void *)e->bench_ref;
    int seen = 0;
    for (int k = 0; k < ndone; k++) seen |= done[k] == fn;
    if (!fn || seen || ndone == 32) continue;
    done[ndone++] = fn;
    fprintf(stderr, "port: timing %s (%s bench)\n", e->name, tw_backend_name(be));
    if (be == TW_BACKEND_GPU) e->bench_gpu(&cfg);
    else e->bench_ref(&cfg, ctx);
  }
  tw_bench_set_sink(NULL, NULL);
  ratios_to_default(r);
}

/* ---- the command -------------------------------------------------------------------------------- */
static int make_dir(const char *d) {
  char buf[2048];
  snprintf(buf, sizeof buf, "%s", d);
  for (char *p = buf + 1; *p; p++)
    if (*p == '/') {
      *p = 0;
      mkdir(buf, 0777);
      *p = '/';
    }
  struct stat st;
  return mkdir(buf, 0777) == 0 || (stat(buf, &st) == 0 && S_ISDIR(st.st_mode)) ? 0 : -1;
}

static tw_ctx *ctx_with(tw_backend be, const char *kernel) {
  tw_ctx_config c = TW_CTX_CONFIG_INIT;
  c.backend = be;
  c.kernel = kernel;
  tw_ctx *ctx = NULL;
  return tw_ctx_create(&ctx, &c) == TW_OK ? ctx : NULL;
}

int twin_cmd_port(int argc, char **argv) {
  port_report r;
  memset(&r, 0, sizeof r);
  r.copy_gbs = r.dense_f32_tflops = r.dense_bf16_tflops = r.dense_fp8_tflops = -1;
  const char *backend = tw_backend_available(TW_BACKEND_GPU) ? "gpu" : "ref", *out = NULL, *golden = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (twin_is_help(a)) { usage(stdout); return TW_EXIT_OK; }
    if (!strcmp(a, "--compare")) {
      if (i + 2 >= argc || argc != 4) {
        fprintf(stderr, "twin port: --compare takes exactly two report.json files (twin port --help)\n");
        return TW_EXIT_USAGE;
      }
      return port_compare(argv[i + 1], argv[i + 2]);
    }
    if (!strcmp(a, "--quick")) { r.quick = 1; continue; }
    static const char *const options[] = {"--backend", "--out", "--filter", "--golden", "--peers", NULL};
    const char *v = twin_option_value("port", argc, argv, &i, options);
    if (!v) return TW_EXIT_USAGE;
    if (!strcmp(a, "--backend")) backend = v;
    else if (!strcmp(a, "--out")) out = v;
    else if (!strcmp(a, "--filter")) r.filter = v;
    else if (!strcmp(a, "--peers")) r.peers_json = v;
    else golden = v;
  }
  tw_backend be;
  if (twin_parse_backend("port", backend, 0, &be, NULL) != 0) return TW_EXIT_USAGE;
  if (be == TW_BACKEND_GPU && !tw_backend_available(TW_BACKEND_GPU)) {
    fprintf(stderr, "twin port: the gpu backend is not available here (no GPU visible or not built in); --backend ref\n");
    return TW_EXIT_USAGE;
  }
  int selected = 0;
  for (int i = 0; i < tw_op_count(); i++) selected += tw_op_matches(tw_op_at(i), r.filter);
  if (!selected) {
    fprintf(stderr, "twin port: --filter '%s' matches no operation (%s)\n", r.filter, tw_op_names());
    return TW_EXIT_USAGE;
  }
  r.backend = tw_backend_name(be);
  char obuf[256];
  if (!out) snprintf(obuf, sizeof obuf, "port-%s", r.backend), out = obuf;
  if (make_dir(out) != 0) {
    fprintf(stderr, "twin port: cannot create --out %s\n", out);
    return TW_EXIT_USAGE;
  }
  char gbuf[2048];
  if (!golden) golden = twin_default_golden_dir(gbuf, sizeof gbuf);
  case_set cs = {NULL, 0, NULL};
  cs.ndirs = tw_golden_list_cases(golden, &cs.dirs);
  if (cs.ndirs < 0) {
    fprintf(stderr, "twin port: %s\n", tw_last_error());
    return TW_EXIT_USAGE;
  }
  double t0 = tw_bench_now_ms();
  int code = TW_EXIT_OK;
  cs.oracle = twin_open_ctx("port", TW_BACKEND_REF, &code);
  if (!cs.oracle) {
    tw_golden_free_list(cs.dirs, cs.ndirs);
    return code;
  }
  fprintf(stderr, "port: %s backend, %d golden cases under %s%s\n", r.backend, cs.ndirs, golden, r.quick ? ", quick" : "");
  port_fact_add(&r, "backend", "%s", r.backend);
  if (be == TW_BACKEND_GPU) {
    if (!tw_port_gpu_facts || tw_port_gpu_facts(&r) != 0) port_fact_add(&r, "device", "facts not available");
  } else {
    host_facts(&r);
    host_ceilings(&r);
  }
  /* correctness: every selected entry x version */
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    if (!tw_op_matches(e, r.filter)) continue;
    if (!tw_op_provided(e, be == TW_BACKEND_GPU ? &tw_gpu_ops : &tw_ref_ops)) {
      char why[96];
      snprintf(why, sizeof why, "the %s backend does not provide %s", r.backend, e->name);
      tally(check_row(&r, e, be == TW_BACKEND_GPU ? "auto" : "ref", "-"), 0, 1, why);
      fprintf(stderr, "port: [%d/%d] %-20s %s\n", i + 1, tw_op_count(), e->name, why);
      continue;
    }
    const char *versions[TW_OP_MAX_VERSIONS + 2];
    int nv = 0;
    versions[nv++] = be == TW_BACKEND_GPU ? "auto" : "ref";
    for (int k = 0; be == TW_BACKEND_GPU && e->versions[k]; k++) versions[nv++] = e->versions[k];
    for (int v = 0; v < nv; v++) {
      double tv = tw_bench_now_ms();
      tw_ctx *ctx = be == TW_BACKEND_REF ? cs.oracle : ctx_with(be, v == 0 ? NULL : versions[v]);
      if (!ctx) {
        tally(check_row(&r, e, versions[v], "-"), 0, 0, tw_last_error());
        continue;
      }
      int before = r.nchecks;
      check_version(&r, &cs, e, versions[v], ctx);
      int cases = 0, passed = 0, uns = 0;
      for (int k = before; k < r.nchecks; k++) {
        cases += r.checks[k].cases;
        passed += r.checks[k].passed;
        uns += r.checks[k].unsupported;
      }
      fprintf(stderr, "port: [%d/%d] %-20s %-22s %d/%d passed, %d unsupported (%.1f s)\n", i + 1, tw_op_count(),
              e->name, versions[v], passed, cases, uns, (tw_bench_now_ms() - tv) / 1e3);
      if (ctx != cs.oracle) tw_ctx_destroy(ctx);
    }
  }
  run_benches(&r, be, cs.oracle);
  r.seconds = (tw_bench_now_ms() - t0) / 1e3;
  tw_ctx_destroy(cs.oracle);
  tw_golden_free_list(cs.dirs, cs.ndirs);
  int rc = port_write(&r, out);
  int failed = 0;
  for (int i = 0; i < r.nchecks; i++) failed += r.checks[i].failed;
  fprintf(stderr, "port: %s/report.md, %s/report.json written in %.1f s; %d check rows, %d timed rows, %d failures\n",
          out, out, r.seconds, r.nchecks, r.ntimes, failed);
  free(r.checks);
  free(r.times);
  if (rc) return TW_EXIT_FAIL;
  return failed ? TW_EXIT_FAIL : TW_EXIT_OK;
}
