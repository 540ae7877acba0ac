/* report.md and report.json of `twin port` (tools/port.h), and the roofline plot through
 * tools/roofline.py. report.json keeps one record per line so that `--compare` (and a
 * reader with grep) can take it apart without a JSON library. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tools/port.h"

/* s as a JSON string body: quotes, backslashes and control characters escaped */
static void jstr(FILE *f, const char *s) {
  fputc('"', f);
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

static void jnum(FILE *f, double v) {
  if (v != v || v < -1e300 || v > 1e300) fprintf(f, "null");
  else fprintf(f, "%.6g", v);
}

/* `, "name": value` (first = 1 leaves out the comma) */
static void field_s(FILE *f, int first, const char *name, const char *v) {
  fprintf(f, "%s\"%s\": ", first ? "" : ", ", name);
  jstr(f, v);
}
static void field_n(FILE *f, const char *name, double v) {
  fprintf(f, ", \"%s\": ", name);
  jnum(f, v);
}

static const char *verdict(const port_check *c) {
  if (c->failed) return "FAIL";
  if (c->passed) return c->unsupported ? "PASS (some unsupported)" : "PASS";
  return c->unsupported ? "UNSUPPORTED" : "no cases";
}

static int write_json(const port_report *r, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "{\"twin_port\": 1,\n\"backend\": ");
  jstr(f, r->backend);
  fprintf(f, ",\n\"quick\": %d,\n\"seconds\": ", r->quick);
  jnum(f, r->seconds);
  fprintf(f, ",\n\"facts\": {");
  for (int i = 0; i < r->nfacts; i++) {
    fprintf(f, "%s\n  ", i ? "," : "");
    jstr(f, r->facts[i].key);
    fprintf(f, ": ");
    jstr(f, r->facts[i].val);
  }
  fprintf(f, "},\n\"ceilings\": {\"copy_gbs\": ");
  jnum(f, r->copy_gbs);
  field_n(f, "dense_f32_tflops", r->dense_f32_tflops);
  field_n(f, "dense_bf16_tflops", r->dense_bf16_tflops);
  field_n(f, "dense_fp8_tflops", r->dense_fp8_tflops);
  fprintf(f, "},\n\"ops\": [");
  for (int i = 0, n = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    if (!tw_op_matches(e, r->filter)) continue;
    fprintf(f, "%s\n  {", n++ ? "," : "");
    field_s(f, 1, "op", e->name);
    field_s(f, 0, "compare", e->compare == TW_COMPARE_EXACT ? "exact" : "bound");
    field_n(f, "min_ranks", e->min_ranks);
    field_s(f, 0, "default", e->versions[0] && !strcmp(r->backend, "gpu") ? e->versions[0] : r->backend);
    field_s(f, 0, "auto", e->auto_rule);
    fprintf(f, "}");
  }
  fprintf(f, "],\n\"checks\": [");
  for (int i = 0; i < r->nchecks; i++) {
    const port_check *c = &r->checks[i];
    fprintf(f, "%s\n  {\"kind\": \"check\"", i ? "," : "");
    field_s(f, 0, "op", c->op->name);
    field_s(f, 0, "version", c->version);
    field_s(f, 0, "dtype", c->dtype);
    field_n(f, "cases", c->cases);
    field_n(f, "passed", c->passed);
    field_n(f, "failed", c->failed);
    field_n(f, "unsupported", c->unsupported);
    field_s(f, 0, "why", c->why);
    fprintf(f, "}");
  }
  fprintf(f, "],\n\"timings\": [");
  for (int i = 0; i < r->ntimes; i++) {
    const port_time *t = &r->times[i];
    const tw_bench_row *w = &t->row;
    fprintf(f, "%s\n  {\"kind\": \"time\"", i ? "," : "");
    field_s(f, 0, "op", t->op->name);
    field_s(f, 0, "version", w->version);
    field_s(f, 0, "shape", w->shape);
    field_n(f, "ms", w->ms);
    field_n(f, "rate", w->rate);
    field_s(f, 0, "unit", w->unit);
    field_n(f, "flops", w->flops);
    field_n(f, "bytes", w->bytes);
    field_n(f, "pct_floor", w->pct_of_floor);
    field_n(f, "ratio_default", t->ratio_default);
    field_s(f, 0, "peer", w->peer);
    field_n(f, "peer_ratio", w->ratio);
    fprintf(f, "}");
  }
  fprintf(f, "]\n}\n");
  return fclose(f);
}

static void num_or_dash(FILE *f, const char *fmt, double v) {
  if (v < 0) fprintf(f, "-");
  else fprintf(f, fmt, v);
}

static int write_md(const port_report *r, const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "# twin port report (%s backend%s)\n\nWritten by `twin port` in %.0f s. Every operation of the registry "
             "(ops/registry.c) x kernel version, checked against the oracle and timed against the ceilings below.\n\n",
          r->backend, r->quick ? ", --quick" : "", r->seconds);
  fprintf(f, "## Device\n\n| fact | value |\n| --- | --- |\n");
  for (int i = 0; i < r->nfacts; i++) fprintf(f, "| %s | %s |\n", r->facts[i].key, r->facts[i].val);
  fprintf(f, "\n## Ceilings measured in this run\n\n| ceiling | value |\n| --- | --- |\n| copy bandwidth (read + write) | ");
  num_or_dash(f, "%.1f GB/s", r->copy_gbs);
  fprintf(f, " |\n| dense f32 GEMM (cblas_sgemm) | ");
  num_or_dash(f, "%.3f TFLOP/s", r->dense_f32_tflops);
  fprintf(f, " |\n| dense bf16 GEMM (cuBLASLt 8192^3) | ");
  num_or_dash(f, "%.1f TFLOP/s", r->dense_bf16_tflops);
  fprintf(f, " |\n| dense fp8 e4m3 GEMM (cuBLASLt 8192^3) | ");
  num_or_dash(f, "%.1f TFLOP/s", r->dense_fp8_tflops);
  fprintf(f, " |\n\n## Operations and what auto picks\n\n| op | compare | versions | auto |\n| --- | --- | --- | --- |\n");
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    if (!tw_op_matches(e, r->filter)) continue;
    fprintf(f, "| %s | %s | ", e->name, e->compare == TW_COMPARE_EXACT ? "exact" : "bound");
    for (int k = 0; e->versions[k]; k++) fprintf(f, "%s%s", k ? ", " : "", e->versions[k]);
    fprintf(f, "%s | %s |\n", e->versions[0] ? "" : "-", e->auto_rule ? e->auto_rule : "-");
  }
  fprintf(f, "\n## Correctness against the oracle\n\nGolden cases (golden/data, grouped by input dtype) and a fixed fuzz "
             "draw (seed 1) per version. UNSUPPORTED: the forced kernel declined the case (TW_ERR_UNSUPPORTED).\n\n"
             "| op | version | dtype | cases | passed | failed | unsupported | result | first failure or reason |\n"
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |\n");
  for (int i = 0; i < r->nchecks; i++) {
    const port_check *c = &r->checks[i];
    char why[240];
    snprintf(why, sizeof why, "%s", c->why);
    for (char *p = why; *p; p++)
      if (*p == '|' || *p == '\n') *p = ' ';
    fprintf(f, "| %s | %s | %s | %d | %d | %d | %d | %s | %s |\n", c->op->name, c->version, c->dtype, c->cases, c->passed,
            c->failed, c->unsupported, verdict(c), why);
  }
  fprintf(f, "\n## Speed against the floor\n\n%% of floor: rate over the measured ceiling (streaming ops: copy "
             "bandwidth; GEMMs: the dense rate of their dtype). vs default: the default version's time over this "
             "one (> 1: faster). vs peer: the peer's time over this one.\n\n"
             "| op | shape | version | ms | rate | %% of floor | vs default | peer | vs peer |\n"
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |\n");
  for (int i = 0; i < r->ntimes; i++) {
    const port_time *t = &r->times[i];
    const tw_bench_row *w = &t->row;
    if (w->ms < 0) { /* the bench said why on stderr */
      fprintf(f, "| %s | %s | %s | failed | - | - | - | - | - |\n", t->op->name, w->shape, w->version);
      continue;
    }
    fprintf(f, "| %s | %s | %s | %.3f | %.2f %s | ", t->op->name, w->shape, w->version, w->ms, w->rate, w->unit);
    num_or_dash(f, "%.1f%%", w->pct_of_floor);
    fprintf(f, " | ");
    num_or_dash(f, "%.2f", t->ratio_default);
    fprintf(f, " | %s | ", w->peer[0] ? w->peer : "-");
    num_or_dash(f, "%.2f", w->peer[0] ? w->ratio : -1);
    fprintf(f, " |\n");
  }
  fprintf(f, "\n## Roofline\n\n![roofline](roofline.png)\n\n(`python3 tools/roofline.py report.json` redraws it.)\n");
  return fclose(f);
}

/* tools/roofline.py: in the workspace (bazel run), the runfiles, or the current directory */
static const char *roofline_script(char *buf, size_t n) {
  const char *roots[3] = {getenv("BUILD_WORKSPACE_DIRECTORY"), getenv("TEST_SRCDIR"), "."};
  const char *sub[3] = {"", "/twin", ""};
  struct stat st;
  for (int i = 0; i < 3; i++) {
    if (!roots[i] || !*roots[i]) continue;
    snprintf(buf, n, "%s%s/tools/roofline.py", roots[i], sub[i]);
    if (stat(buf, &st) == 0) return buf;
  }
  return NULL;
}

int port_write(const port_report *r, const char *dir) {
  char path[2048], script[2048];
  snprintf(path, sizeof path, "%s/report.json", dir);
  if (write_json(r, path) != 0) {
    fprintf(stderr, "twin port: cannot write %s\n", path);
    return -1;
  }
  snprintf(path, sizeof path, "%s/report.md", dir);
  if (write_md(r, path) != 0) {
    fprintf(stderr, "twin port: cannot write %s\n", path);
    return -1;
  }
  /* the plot is optional: the report stands without it */
  if (!roofline_script(script, sizeof script)) {
    fprintf(stderr, "port: tools/roofline.py not found here: no roofline.png (run it on report.json elsewhere)\n");
    return 0;
  }
  char cmd[4400];
  snprintf(cmd, sizeof cmd, "python3 '%s' '%s/report.json' '%s/roofline.png' 1>&2", script, dir, dir);
  if (system(cmd) != 0) fprintf(stderr, "port: no roofline.png (%s failed; matplotlib missing?)\n", script);
  return 0;
}
