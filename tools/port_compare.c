/* `twin port --compare A.json B.json`: per operation, version and dtype (checks) or shape
 * (timings), what changed from report A to report B. Correctness regressions first, then the
 * timings from the largest slowdown to the largest speedup; exit 1 if a check that passed in
 * A fails (or is gone) in B, 0 otherwise, 2 if a file is not a `twin port` report. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cli.h"
#include "tools/port.h"

typedef struct {
  int is_time;
  char key[256]; /* op | version | dtype-or-shape */
  int cases, passed, failed, unsupported;
  double ms;
} rec;

typedef struct {
  rec *v;
  int n;
  char backend[32], device[160];
} report;

/* The string value of "key" in one line of report.json (escapes kept as written). */
static int jget(const char *line, const char *key, char *out, size_t n) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\": \"", key);
  const char *p = strstr(line, pat);
  if (!p) return -1;
  p += strlen(pat);
  size_t k = 0;
  for (; *p && *p != '"' && k + 1 < n; p++) {
    if (*p == '\\' && p[1]) p++;
    out[k++] = *p;
  }
  out[k] = 0;
  return 0;
}

static double jnumber(const char *line, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\": ", key);
  const char *p = strstr(line, pat);
  return p ? strtod(p + strlen(pat), NULL) : -1;
}

static int load(const char *path, report *r) {
  memset(r, 0, sizeof *r);
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "twin port --compare: cannot open %s\n", path);
    return -1;
  }
  char line[4096];
  int cap = 0, magic = 0;
  while (fgets(line, sizeof line, f)) {
    if (strstr(line, "\"twin_port\": 1")) magic = 1;
    if (!strncmp(line, "\"backend\": ", 11)) jget(line, "backend", r->backend, sizeof r->backend);
    if (strstr(line, "\"device\": ") || (!r->device[0] && strstr(line, "\"cpu\": "))) {
      if (jget(line, "device", r->device, sizeof r->device)) jget(line, "cpu", r->device, sizeof r->device);
    }
    int is_check = strstr(line, "\"kind\": \"check\"") != NULL, is_time = strstr(line, "\"kind\": \"time\"") != NULL;
    if (!is_check && !is_time) continue;
    if (r->n == cap) {
      cap = cap ? 2 * cap : 128;
      rec *v = (rec *)realloc(r->v, sizeof *v * (size_t)cap);
      if (!v) break;
      r->v = v;
    }
    rec *x = &r->v[r->n];
    memset(x, 0, sizeof *x);
    char op[64] = "", ver[64] = "", what[128] = "";
    jget(line, "op", op, sizeof op);
    jget(line, "version", ver, sizeof ver);
    jget(line, is_time ? "shape" : "dtype", what, sizeof what);
    snprintf(x->key, sizeof x->key, "%s | %s | %s", op, ver, what);
    x->is_time = is_time;
    x->cases = (int)jnumber(line, "cases");
    x->passed = (int)jnumber(line, "passed");
    x->failed = (int)jnumber(line, "failed");
    x->unsupported = (int)jnumber(line, "unsupported");
    x->ms = jnumber(line, "ms");
    r->n++;
  }
  fclose(f);
  if (!magic) {
    fprintf(stderr, "twin port --compare: %s is not a twin port report.json\n", path);
    free(r->v);
    return -1;
  }
  return 0;
}

static const rec *find(const report *r, const rec *x) {
  for (int i = 0; i < r->n; i++)
    if (r->v[i].is_time == x->is_time && !strcmp(r->v[i].key, x->key)) return &r->v[i];
  return NULL;
}

typedef struct {
  const rec *a, *b;
  double speed; /* ms_a / ms_b: < 1 slower in B */
} change;

static int by_speed(const void *p, const void *q) {
  double x = ((const change *)p)->speed, y = ((const change *)q)->speed;
  return (x > y) - (x < y);
}

int port_compare(const char *a_path, const char *b_path) {
  report A, B;
  if (load(a_path, &A)) return TW_EXIT_USAGE;
  if (load(b_path, &B)) {
    free(A.v);
    return TW_EXIT_USAGE;
  }
  printf("A: %s (%s backend, %s)\nB: %s (%s backend, %s)\n\n", a_path, A.backend, A.device[0] ? A.device : "?", b_path,
         B.backend, B.device[0] ? B.device : "?");
  int regressions = 0, same = 0;
  printf("## correctness (op | version | dtype: A -> B passed/cases, failed)\n");
  for (int pass = 0; pass < 2; pass++) /* regressions, then the other changes */
    for (int i = 0; i < A.n + B.n; i++) {
      const rec *x = i < A.n ? &A.v[i] : &B.v[i - A.n];
      if (x->is_time) continue;
      const rec *a = i < A.n ? x : find(&A, x), *b = i < A.n ? find(&B, x) : x;
      if (i >= A.n && a) continue; /* seen from A's side */
      int regressed = a && a->passed > 0 && a->failed == 0 && (!b || b->failed > 0);
      int changed = !a || !b || a->passed != b->passed || a->failed != b->failed || a->unsupported != b->unsupported;
      if (pass == 0 && regressed) {
        regressions++;
        printf("REGRESSED  %-60s %d/%d passed -> ", x->key, a->passed, a->cases);
        if (b) printf("%d/%d passed, %d failed, %d unsupported\n", b->passed, b->cases, b->failed, b->unsupported);
        else printf("missing in B\n");
      } else if (pass == 1 && !regressed && changed) {
        printf("changed    %-60s ", x->key);
        if (a) printf("%d/%d failed %d", a->passed, a->cases, a->failed);
        else printf("(not in A)");
        printf(" -> ");
        if (b) printf("%d/%d failed %d\n", b->passed, b->cases, b->failed);
        else printf("(not in B)\n");
      } else if (pass == 1 && !changed) {
        same++;
      }
    }
  printf("%d check rows unchanged\n\n## speed (op | version | shape: A ms -> B ms, B/A speed; slowest first)\n", same);
  change *ch = (change *)calloc((size_t)A.n + 1, sizeof *ch);
  int nc = 0, only = 0;
  for (int i = 0; ch && i < A.n; i++) {
    if (!A.v[i].is_time) continue;
    const rec *b = find(&B, &A.v[i]);
    if (!b || A.v[i].ms <= 0 || b->ms <= 0) { only++; continue; }
    ch[nc].a = &A.v[i];
    ch[nc].b = b;
    ch[nc].speed = A.v[i].ms / b->ms;
    nc++;
  }
  if (ch) qsort(ch, (size_t)nc, sizeof *ch, by_speed);
  for (int i = 0; i < nc; i++)
    printf("%-9s  %-72s %9.3f -> %9.3f  %5.2fx\n", ch[i].speed < 0.95 ? "SLOWER" : ch[i].speed > 1.05 ? "faster" : "same",
           ch[i].a->key, ch[i].a->ms, ch[i].b->ms, ch[i].speed);
  for (int i = 0; i < B.n; i++)
    if (B.v[i].is_time && !find(&A, &B.v[i])) only++;
  printf("%d timed rows compared, %d in only one report\n", nc, only);
  printf("%d correctness regression%s\n", regressions, regressions == 1 ? "" : "s");
  free(ch);
  free(A.v);
  free(B.v);
  return regressions ? TW_EXIT_FAIL : TW_EXIT_OK;
}
