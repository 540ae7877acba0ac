#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall(), for the stall watch's per-thread signals */
#endif
#include "tests/test_util.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
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

float tt_warp_order_sum(const float *products, int64_t H) {
  float P[32] = {0.0f};
  for (int64_t h = 0; h < H; h++) P[(h / 8) % 32] += products[h];
  for (int m = 16; m >= 1; m /= 2)
    for (int l = 0; l < m; l++) P[l] += P[l + m];
  return P[0];
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

/* ---- stall watch ----------------------------------------------------------------------- */
static volatile int stall_armed;  /* generation of the armed watch; 0: none */
static int stall_gen;
static char stall_tag[160];

static void stall_on_signal(int sig) {
  (void)sig;
  void *frames[48];
  int n = backtrace(frames, 48);
  char head[64];
  int len = snprintf(head, sizeof head, "--- thread %ld:\n", (long)syscall(SYS_gettid));
  if (write(2, head, (size_t)len) < 0) return;
  backtrace_symbols_fd(frames, n, 2);
}

static void *stall_watch(void *arg) {
  int gen = (int)(intptr_t)arg;
  const char *e = getenv("TWIN_STALL_DUMP_S");
  double secs = e ? atof(e) : 0;
  struct timespec ts = {(time_t)secs, (long)((secs - (double)(time_t)secs) * 1e9)};
  nanosleep(&ts, NULL);
  if (stall_armed != gen) return NULL;
  fprintf(stderr, "=== stall watch: %s still running after %.0f s; every thread's stack:\n", stall_tag, secs);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = stall_on_signal;
  sa.sa_flags = SA_RESTART; /* a blocked call resumes after its stack is printed */
  sigaction(SIGURG, &sa, NULL);
  long self = (long)syscall(SYS_gettid);
  DIR *d = opendir("/proc/self/task");
  struct dirent *t;
  while (d && (t = readdir(d))) {
    long tid = atol(t->d_name);
    if (tid <= 0 || tid == self) continue;
    syscall(SYS_tgkill, (long)getpid(), tid, SIGURG);
    struct timespec gap = {0, 50 * 1000 * 1000}; /* one thread's stack at a time */
    nanosleep(&gap, NULL);
  }
  if (d) closedir(d);
  FILE *m = fopen("/proc/self/maps", "r");
  char line[512];
  fprintf(stderr, "=== executable mappings:\n");
  while (m && fgets(line, sizeof line, m))
    if (strstr(line, " r-xp ")) fputs(line, stderr);
  if (m) fclose(m);
  fflush(stderr);
  return NULL;
}

void tt_stall_watch_start(const char *tag) {
  const char *e = getenv("TWIN_STALL_DUMP_S");
  if (!e || atof(e) <= 0) return;
  void *warm[2];
  backtrace(warm, 2); /* loads libgcc's unwinder now, not inside the signal handler */
  snprintf(stall_tag, sizeof stall_tag, "%s", tag);
  stall_armed = ++stall_gen;
  pthread_t th;
  if (pthread_create(&th, NULL, stall_watch, (void *)(intptr_t)stall_armed) == 0) pthread_detach(th);
}

void tt_stall_watch_stop(void) { stall_armed = 0; }
