#include "tests/test_util.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "twin/tw_npy.h"

tw_ctx *tt_ref_ctx(void) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  tw_status s = tw_ctx_create(&ctx, &cfg);
  cr_assert_eq(s, TW_OK, "ref context: %s", tw_last_error());
  return ctx;
}

uint64_t tt_rand_u64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double tt_rand_uniform(uint64_t *state, double lo, double hi) {
  double u = (double)(tt_rand_u64(state) >> 11) * 0x1.0p-53;
  return lo + (hi - lo) * u;
}

void tt_fill_uniform_f32(float *x, int64_t n, uint64_t seed, float lo, float hi) {
  uint64_t s = seed;
  for (int64_t i = 0; i < n; i++) x[i] = (float)tt_rand_uniform(&s, lo, hi);
}

char *tt_make_tmpdir(const char *tag) {
  const char *base = getenv("TEST_TMPDIR");
  if (!base || !*base) base = "/tmp";
  size_t n = strlen(base) + strlen(tag ? tag : "t") + 32;
  char *p = (char *)malloc(n);
  cr_assert_not_null(p);
  snprintf(p, n, "%s/%s.XXXXXX", base, tag ? tag : "t");
  cr_assert_not_null(mkdtemp(p), "mkdtemp %s failed", p);
  return p;
}

const char *tt_path(char *buf, size_t n, const char *dir, const char *name) {
  snprintf(buf, n, "%s/%s", dir, name);
  return buf;
}

void tt_write_file(const char *path, const void *bytes, size_t n) {
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "cannot create %s", path);
  cr_assert_eq(fwrite(bytes, 1, n, f), n);
  fclose(f);
}

const char *tt_golden_root(void) {
  static char buf[1024];
  const char *src = getenv("TEST_SRCDIR");
  if (src && *src) {
    snprintf(buf, sizeof buf, "%s/twin/golden/data", src);
    struct stat st;
    if (stat(buf, &st) == 0) return buf;
  }
  return "golden/data";
}

void tt_expect_status_at(tw_status s, tw_status want, const char *substr, const char *file, int line) {
  cr_assert_eq(s, want, "%s:%d: got %s, want %s (%s)", file, line, tw_status_name(s),
               tw_status_name(want), tw_last_error());
  if (substr)
    cr_assert(strstr(tw_last_error(), substr) != NULL, "%s:%d: message \"%s\" lacks \"%s\"", file,
              line, tw_last_error(), substr);
}

void tt_expect_exact_at(const tw_tensor *got, const tw_tensor *expected, const char *what,
                        const char *file, int line) {
  tw_check_report r;
  tw_status s = tw_check_exact(got, expected, &r);
  cr_assert_eq(s, TW_OK, "%s:%d: %s: check_exact: %s", file, line, what, tw_last_error());
  char buf[512];
  cr_assert(r.passed, "%s:%d: %s: %s", file, line, what, tw_check_format(&r, buf, sizeof buf));
}

void tt_expect_bound_at(const tw_tensor *got, const tw_tensor *expected, const tw_tensor *bound,
                        const char *what, const char *file, int line) {
  tw_check_report r;
  tw_status s = tw_check_bound(got, expected, bound, &r);
  cr_assert_eq(s, TW_OK, "%s:%d: %s: check_bound: %s", file, line, what, tw_last_error());
  char buf[512];
  cr_assert(r.passed, "%s:%d: %s: %s", file, line, what, tw_check_format(&r, buf, sizeof buf));
}

int tt_each_golden_case(const char *area, const char *gen, void (*fn)(const char *dir, const char *name)) {
  char root[1024];
  snprintf(root, sizeof root, "%s/%s", tt_golden_root(), area);
  DIR *d = opendir(root);
  cr_assert(d, "no goldens at %s (python3 %s)", root, gen);
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char dir[1300];
    snprintf(dir, sizeof dir, "%s/%s", root, e->d_name);
    fn(dir, e->d_name);
    n++;
  }
  closedir(d);
  return n;
}

void *tt_load_npy(const char *dir, const char *name, tw_dtype want, int64_t n) {
  char path[1200];
  snprintf(path, sizeof path, "%s/%s.npy", dir, name);
  tw_tensor t;
  cr_assert_eq(tw_npy_load(path, &t), TW_OK, "%s: %s", path, tw_last_error());
  cr_assert_eq(t.dtype, want, "%s: dtype", path);
  cr_assert_eq(tw_tensor_numel(&t), n, "%s: %lld elements, want %lld", path, (long long)tw_tensor_numel(&t), (long long)n);
  return t.data;
}

void tt_read_text(const char *dir, const char *name, char *txt, size_t cap) {
  char path[1200];
  tt_path(path, sizeof path, dir, name);
  FILE *f = fopen(path, "r");
  cr_assert(f, "%s", path);
  txt[0] = '\n';
  size_t got = fread(txt + 1, 1, cap - 2, f);
  txt[got + 1] = 0;
  fclose(f);
}
