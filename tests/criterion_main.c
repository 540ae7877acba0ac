/* Criterion entry point for every twin test: when Bazel runs the test it sets
 * XML_OUTPUT_FILE, and Criterion writes its per-case JUnit XML there, so bazel-testlogs/
 * counts individual test cases instead of one result per binary.
 *
 * A skipped case (cr_skip_test, e.g. "this test needs 4 GPUs and sees 1") must say why where
 * people look: Criterion prints the reason only with --verbose and writes a bare <skipped/>.
 * So every skip is printed to stderr, and its reason is written into the XML afterwards. */
#include <stdio.h>

#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <criterion/options.h>
#include <criterion/output.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SKIPS 256

typedef struct {
  char suite[128], name[128], reason[512];
} skip_note;

static skip_note skips[MAX_SKIPS];
static int n_skips;

ReportHook(POST_TEST)(struct criterion_test_stats *st) {
  if (st->test_status != CR_STATUS_SKIPPED) return;
  const char *why = st->message && *st->message ? st->message : "(no reason given)";
  fprintf(stderr, "[SKIP] %s::%s: %s\n", st->test->category, st->test->name, why);
  if (n_skips == MAX_SKIPS) return;
  skip_note *k = &skips[n_skips++];
  snprintf(k->suite, sizeof k->suite, "%s", st->test->category);
  snprintf(k->name, sizeof k->name, "%s", st->test->name);
  snprintf(k->reason, sizeof k->reason, "%s", why);
}

static void put_escaped(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
      case '&': fputs("&amp;", f); break;
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '"': fputs("&quot;", f); break;
      default: fputc(*s, f);
    }
  }
}

/* Rewrites each skipped case's "<skipped/>" as "<skipped message="reason"/>". On any trouble
 * the XML stays as Criterion wrote it (the reason is still on stderr). */
static void add_skip_reasons(const char *path) {
  if (!n_skips) return;
  FILE *f = fopen(path, "rb");
  if (!f) return;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *xml = n > 0 ? (char *)malloc((size_t)n + 1) : NULL;
  size_t got = xml ? fread(xml, 1, (size_t)n, f) : 0;
  fclose(f);
  if (!xml || got != (size_t)n) { free(xml); return; }
  xml[n] = 0;
  const char *at[MAX_SKIPS]; /* where each note's "<skipped/>" starts, or NULL */
  for (int i = 0; i < n_skips; i++) {
    at[i] = NULL;
    char key[192];
    snprintf(key, sizeof key, "<testsuite name=\"%.160s\"", skips[i].suite);
    const char *suite = strstr(xml, key);
    if (!suite) continue;
    snprintf(key, sizeof key, "<testcase name=\"%.160s\"", skips[i].name);
    const char *tc = strstr(suite, key);
    const char *sk = tc ? strstr(tc, "<skipped/>") : NULL;
    const char *end = tc ? strstr(tc, "</testcase>") : NULL;
    if (sk && end && sk < end) at[i] = sk;
  }
  f = fopen(path, "wb");
  if (!f) { free(xml); return; }
  const char *p = xml;
  for (;;) {
    const char *next = NULL;
    int which = -1;
    for (int i = 0; i < n_skips; i++)
      if (at[i] && at[i] >= p && (!next || at[i] < next)) { next = at[i]; which = i; }
    if (!next) break;
    fwrite(p, 1, (size_t)(next - p), f);
    fputs("<skipped message=\"", f);
    put_escaped(f, skips[which].reason);
    fputs("\"/>", f);
    p = next + strlen("<skipped/>");
  }
  fputs(p, f);
  fclose(f);
  free(xml);
}

int main(int argc, char *argv[]) {
  struct criterion_test_set *tests = criterion_initialize();
  const char *xml = getenv("XML_OUTPUT_FILE");
  if (xml && *xml) criterion_add_output("xml", xml);
  int result = 0;
  if (criterion_handle_args(argc, argv, true)) result = !criterion_run_all_tests(tests);
  criterion_finalize(tests);
  if (xml && *xml) add_skip_reasons(xml);
  return result;
}
