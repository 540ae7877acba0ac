/* The stored golden cases seen through the registry: where they are, and which entry each
 * belongs to (its case.txt `op` = the entry's golden_op). Used by `twin check` and `twin port`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "golden/exec.h"
#include "golden/runner.h"
#include "ops/registry.h"
#include "tools/cli.h"

static int is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* golden/data of the workspace: `bazel run` sets BUILD_WORKSPACE_DIRECTORY; tests and bundles
 * set TEST_SRCDIR; otherwise relative to the current directory. */
const char *twin_default_golden_dir(char *buf, size_t n) {
  const char *ws = getenv("BUILD_WORKSPACE_DIRECTORY");
  if (ws && *ws) {
    snprintf(buf, n, "%s/golden/data", ws);
    if (is_dir(buf)) return buf;
  }
  const char *src = getenv("TEST_SRCDIR");
  if (src && *src) {
    snprintf(buf, n, "%s/twin/golden/data", src);
    if (is_dir(buf)) return buf;
  }
  return "golden/data";
}

const char *twin_golden_op(const char *case_dir, char *buf, size_t n) {
  char path[2048];
  tw_case_keys k;
  snprintf(path, sizeof path, "%s/case.txt", case_dir);
  buf[0] = 0;
  if (tw_case_keys_parse_file(path, &k) == TW_OK && tw_case_get(&k, "op")) snprintf(buf, n, "%s", tw_case_get(&k, "op"));
  return buf;
}

static int kept(const char *dir, const tw_op_entry *e, const char *filter) {
  char name[256];
  if (!filter || !*filter) return 1;
  return strstr(tw_golden_case_name(dir, name, sizeof name), filter) || (e && tw_op_matches(e, filter));
}

int twin_golden_order(char **dirs, int n, const char *filter, int *order) {
  int no = 0;
  char op[64];
  const tw_op_entry **of = (const tw_op_entry **)calloc((size_t)(n > 0 ? n : 1), sizeof *of);
  if (!of) return 0;
  for (int i = 0; i < n; i++) of[i] = tw_op_for_golden(twin_golden_op(dirs[i], op, sizeof op));
  for (int e = 0; e < tw_op_count(); e++)
    for (int i = 0; i < n; i++)
      if (of[i] == tw_op_at(e) && kept(dirs[i], of[i], filter)) order[no++] = i;
  for (int i = 0; i < n; i++) /* no entry: still run, the runner says what is wrong */
    if (!of[i] && kept(dirs[i], NULL, filter)) order[no++] = i;
  free(of);
  return no;
}
