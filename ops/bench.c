/* The bench harness's shared pieces (bench.h): one row format for every kernel. */
#include "ops/bench.h"

#include <stdlib.h>
#include <time.h>

void tw_bench_print_header(void) {
  printf("%-14s %-40s %-12s %10s %12s %-8s %8s %-14s %10s %7s\n", "op", "shape", "backend/ver", "ms",
         "rate", "unit", "%floor", "peer", "peer ms", "ratio");
}

static tw_bench_sink sink;
static void *sink_user;

void tw_bench_set_sink(tw_bench_sink fn, void *user) {
  sink = fn;
  sink_user = user;
}

void tw_bench_emit(const tw_bench_row *r, FILE *csv) {
  if (sink) {
    sink(r, sink_user);
    return;
  }
  char ver[64];
  snprintf(ver, sizeof ver, "%s%s%s", r->backend, r->version[0] ? "/" : "", r->version);
  printf("%-14s %-40s %-12s %10.3f %12.2f %-8s ", r->op, r->shape, ver, r->ms, r->rate, r->unit);
  if (r->pct_of_floor >= 0) printf("%7.1f%% ", r->pct_of_floor);
  else printf("%8s ", "-");
  printf("%-14s ", r->peer[0] ? r->peer : "-");
  if (r->peer_ms >= 0) printf("%10.3f %7.2f\n", r->peer_ms, r->ratio);
  else printf("%10s %7s\n", "-", "-");
  fflush(stdout);
  if (csv) {
    fprintf(csv, "%s,\"%s\",%s,%s,%.6f,%.6f,%s,%.3f,%s,%.6f,%.6f\n", r->op, r->shape, r->backend,
            r->version, r->ms, r->rate, r->unit, r->pct_of_floor, r->peer, r->peer_ms, r->ratio);
    fflush(csv);
  }
}

void tw_bench_print_row(const tw_bench_row *r, FILE *csv) { tw_bench_emit(r, csv); }

double tw_bench_now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double tw_bench_median(double *v, int n) {
  if (n <= 0) return -1;
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
