/* `twin bench`: rates of the kernels next to a peer timed in the same run. It walks the
 * registry (ops/registry.h): each entry's bench_ref on the ref backend (ops/bench_ref.c), its
 * bench_gpu on the gpu backend (the kernels' owners, tools/bench_gpu_*.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/registry.h"
#include "tools/cli.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin bench [--backend ref|gpu] [--op all|OP] [--iters N]\n"
          "                  [--warmup N] [--peers FILE] [--csv FILE]\n"
          "\n"
          "One row per kernel and shape: median time, rate, the floor it is measured against,\n"
          "and a peer timed in the same run with ratio = peer_ms / ms (> 1: twin is faster).\n"
          "  --backend NAME  ref (default): grouped GEMM vs one cblas_sgemm of the same FLOPs,\n"
          "                  quantize vs memcpy of the same bytes; gpu: the GPU kernels' benches\n"
          "  --op NAME       all (default) or one registry entry (name or alias: grouped_gemm,\n"
          "                  quantize, gemm, ...); an entry without a bench on that backend\n"
          "                  says so on stderr\n"
          "  --iters N       timed iterations, median reported (default 5)\n"
          "  --warmup N      untimed iterations first (default 1)\n"
          "  --peers FILE    gpu: peer timings measured on the same machine in the same run\n"
          "  --csv FILE      also write the rows as CSV\n");
}

static int positive_int(const char *flag, const char *v, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || end == v || x < 0 || x > 1000) {
    fprintf(stderr, "twin bench: %s wants an integer 0..1000, got '%s'\n", flag, v);
    return -1;
  }
  *out = (int)x;
  return 0;
}

/* Calls each selected entry's bench on backend be once (entries may share a function). */
static int walk(const tw_bench_cfg *cfg, const char *op, tw_backend be, tw_ctx *ctx) {
  const void *done[32];
  int ndone = 0, failed = 0, ran = 0;
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    if (op && tw_op_find(op) != e) continue;
    const void *fn = be == TW_BACKEND_GPU ? (const void *)e->bench_gpu : (const void *)e->bench_ref;
    if (!fn) continue;
    int seen = 0;
    for (int k = 0; k < ndone; k++) seen |= done[k] == fn;
    if (seen) continue;
    if (ndone < 32) done[ndone++] = fn;
    tw_bench_cfg c = *cfg;
    c.op = op ? e->name : NULL;
    int rc = be == TW_BACKEND_GPU ? e->bench_gpu(&c) : e->bench_ref(&c, ctx);
    ran++;
    if (rc) failed = 1;
  }
  return failed ? TW_EXIT_FAIL : ran ? TW_EXIT_OK : TW_EXIT_USAGE;
}

int twin_cmd_bench(int argc, char **argv) {
  tw_bench_cfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.warmup = 1;
  cfg.iters = 5;
  FILE *csv = NULL;
  const char *backend = "ref", *csv_path = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (twin_is_help(a)) { usage(stdout); return TW_EXIT_OK; }
    static const char *const options[] = {"--backend", "--op", "--peers", "--csv", "--iters", "--warmup", NULL};
    const char *v = twin_option_value("bench", argc, argv, &i, options);
    if (!v) return TW_EXIT_USAGE;
    if (!strcmp(a, "--backend")) backend = v;
    else if (!strcmp(a, "--op")) cfg.op = v;
    else if (!strcmp(a, "--peers")) cfg.peers_json = v;
    else if (!strcmp(a, "--csv")) csv_path = v;
    else if (!strcmp(a, "--iters")) { if (positive_int(a, v, &cfg.iters) || cfg.iters < 1) return TW_EXIT_USAGE; }
    else if (positive_int(a, v, &cfg.warmup)) return TW_EXIT_USAGE;
  }
  const char *op = cfg.op && strcmp(cfg.op, "all") ? cfg.op : NULL;
  if (op && !tw_op_find(op)) {
    fprintf(stderr, "twin bench: unknown --op '%s' (all, %s)\n", op, tw_op_names());
    return TW_EXIT_USAGE;
  }
  tw_backend be;
  if (twin_parse_backend("bench", backend, 0, &be, NULL) != 0) return TW_EXIT_USAGE;
  if (be == TW_BACKEND_GPU && !tw_backend_available(TW_BACKEND_GPU)) {
    fprintf(stderr, "twin bench: the gpu backend is not available here (no GPU visible or not built in)\n");
    return TW_EXIT_USAGE;
  }
  const tw_op_entry *only = op ? tw_op_find(op) : NULL;
  if (only && !(be == TW_BACKEND_GPU ? (const void *)only->bench_gpu : (const void *)only->bench_ref)) {
    fprintf(stderr, "twin bench: %s has no %s bench\n", only->name, tw_backend_name(be));
    return TW_EXIT_USAGE;
  }
  if (csv_path) {
    csv = fopen(csv_path, "w");
    if (!csv) {
      fprintf(stderr, "twin bench: cannot create %s\n", csv_path);
      return TW_EXIT_USAGE;
    }
    fprintf(csv, "op,shape,backend,version,ms,rate,unit,pct_of_floor,peer,peer_ms,ratio\n");
    cfg.csv = csv;
  }
  int rc;
  tw_ctx *ctx = NULL;
  if (be != TW_BACKEND_GPU) ctx = twin_open_ctx("bench", be, &rc); /* the gpu benches make their own */
  if (be == TW_BACKEND_GPU || ctx) {
    tw_bench_print_header();
    rc = walk(&cfg, op, be, ctx);
  }
  tw_ctx_destroy(ctx);
  if (csv) fclose(csv);
  return rc;
}
