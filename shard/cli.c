/* `twin plan` and `twin check --sharding` (shard/cli.h). */
#include "shard/cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shard/ep_cli.h"
#include "shard/golden.h"
#include "twin/tw_shard.h"

static void plan_usage(FILE *f) {
  fprintf(f,
          "usage: twin plan --mesh dp=2,ep=4 --op dense|grouped_gemm|grouped_quantize\n"
          "       (--op router|ep_dispatch|ep_combine and --op pipeline: twin plan --op OP --help)\n"
          "                 [--pass fwd|dgrad|wgrad|all] [--x-shape 1024,256] [--w-shape 8,256,512]\n"
          "                 [--lhs-spec '[(ep,dp), None]'] [--rhs-spec '[None, fsdp, None]'] [--groups G]\n"
          "                 [--mode current|delayed|mxfp8|block1x128|block128x128] [--layout row|col|rowcol]\n"
          "                 [--fp8] [--quantize-before-gather]   (grouped_gemm: e4m3 inputs; before the gather: fwd, dgrad)\n"
          "Prints the plan of each pass: tensors (global/local shapes and specs), the collectives\n"
          "before and after the local op, and the rules that changed something; or the error\n"
          "naming the broken rule (exit 1). --x-spec/--w-spec are aliases of --lhs-spec/--rhs-spec.\n");
}

static int parse_shape(const char *s, tw_shard_operand *o) {
  o->ndim = 0;
  while (*s) {
    if (o->ndim == TW_MAX_DIMS) return -1;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (end == s || v < 0) return -1;
    o->shape[o->ndim++] = v;
    s = end;
    if (*s == ',' || *s == 'x') s++;
    else if (*s) return -1;
  }
  return o->ndim ? 0 : -1;
}

/* pipeline/plan_cli.c, linked into //tools:twin (the pipeline library depends on shard/) */
int tw_pipeline_plan_main(int argc, char **argv);
#pragma weak tw_pipeline_plan_main

int tw_plan_main(int argc, char **argv) {
  if (tw_ep_plan_wants(argc, argv)) return tw_ep_plan_main(argc, argv); /* router, ep_dispatch, ep_combine */
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--op") && !strcmp(argv[i + 1], "pipeline")) {
      if (!tw_pipeline_plan_main) {
        fprintf(stderr, "twin plan --op pipeline: not in this binary (link //pipeline:plan_cli)\n");
        return 2;
      }
      return tw_pipeline_plan_main(argc, argv);
    }
  const char *mesh_s = NULL, *op_s = NULL, *pass_s = "all", *xshape = NULL, *wshape = NULL;
  const char *xspec = NULL, *wspec = NULL, *mode_s = "current", *layout_s = "row";
  long long groups = -1;
  int fp8 = 0, qbg = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name, var) if (strcmp(a, name) == 0 && v) { var = v; i++; continue; }
    OPT("--mesh", mesh_s) OPT("--op", op_s) OPT("--pass", pass_s) OPT("--x-shape", xshape)
    OPT("--w-shape", wshape) OPT("--lhs-spec", xspec) OPT("--x-spec", xspec) OPT("--rhs-spec", wspec)
    OPT("--w-spec", wspec) OPT("--mode", mode_s) OPT("--layout", layout_s)
#undef OPT
    if (strcmp(a, "--groups") == 0 && v) { groups = atoll(v); i++; continue; }
    if (strcmp(a, "--fp8") == 0) { fp8 = 1; continue; }
    if (strcmp(a, "--quantize-before-gather") == 0) { fp8 = qbg = 1; continue; }
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) { plan_usage(stdout); return 0; }
    fprintf(stderr, "twin plan: unknown or incomplete option '%s'\n", a);
    plan_usage(stderr);
    return 2;
  }
  if (!mesh_s || !op_s) {
    plan_usage(stderr);
    return 2;
  }
  tw_mesh mesh;
  tw_shard_op op;
  if (tw_mesh_parse(mesh_s, &mesh) != TW_OK) { fprintf(stderr, "twin plan: %s\n", tw_last_error()); return 2; }
  if (tw_shard_op_from_name(op_s, &op) != 0) { fprintf(stderr, "twin plan: unknown op '%s'\n", op_s); return 2; }
  tw_shard_operand x, w;
  memset(&x, 0, sizeof x);
  memset(&w, 0, sizeof w);
  const char *dx = op == TW_SHARD_DENSE ? "256,256" : op == TW_SHARD_GROUPED_GEMM ? "1024,256" : "1024,256";
  const char *dw = op == TW_SHARD_DENSE ? "256,256" : "8,256,512";
  if (parse_shape(xshape ? xshape : dx, &x) || parse_shape(wshape ? wshape : dw, &w)) {
    fprintf(stderr, "twin plan: shapes are comma-separated sizes, e.g. 1024,256\n");
    return 2;
  }
  const char *defspec[4] = {"[]", "[None]", "[None, None]", "[None, None, None]"};
  if (tw_pspec_parse(xspec ? xspec : defspec[x.ndim < 4 ? x.ndim : 3], &x.spec) != TW_OK ||
      tw_pspec_parse(wspec ? wspec : defspec[w.ndim < 4 ? w.ndim : 3], &w.spec) != TW_OK) {
    fprintf(stderr, "twin plan: %s\n", tw_last_error());
    return 2;
  }
  tw_rule_opts ro = TW_RULE_OPTS_INIT;
  if (tw_scaling_from_name(mode_s, &ro.quant.mode) != 0) { fprintf(stderr, "twin plan: unknown mode '%s'\n", mode_s); return 2; }
  ro.quantize_inputs = fp8;
  ro.quantize_before_gather = qbg;
  ro.quant.layout = strcmp(layout_s, "col") == 0 ? TW_COLWISE : strcmp(layout_s, "rowcol") == 0 ? TW_ROWWISE_COLWISE : TW_ROWWISE;
  if (groups < 0) groups = op == TW_SHARD_GROUPED_GEMM ? w.shape[0] : 8;
  int first = 0, last = TW_PASS_COUNT - 1;
  if (strcmp(pass_s, "all") != 0) {
    tw_pass p;
    if (tw_pass_from_name(pass_s, &p) != 0) { fprintf(stderr, "twin plan: unknown pass '%s'\n", pass_s); return 2; }
    first = last = (int)p;
  }
  if (op == TW_SHARD_GROUPED_QUANTIZE) last = first;
  int rc = 0;
  for (int p = first; p <= last; p++) {
    tw_plan plan;
    if (tw_plan_make(&mesh, op, (tw_pass)p, &x, &w, groups, &ro, &plan) != TW_OK) {
      printf("error: %s\n", tw_last_error());
      rc = 1;
      continue;
    }
    char buf[8192];
    fputs(tw_plan_format(&plan, buf, sizeof buf), stdout);
  }
  return rc;
}

int tw_check_sharding_main(int argc, char **argv) {
  tw_golden_cfg cfg = TW_GOLDEN_CFG_INIT;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--sharding") == 0) continue; /* `twin check` strips it; accept it anyway */
    else if (strcmp(a, "--only") == 0 && v) { cfg.only = v; i++; }
    else if (strcmp(a, "--filter") == 0 && v) { cfg.filter = v; i++; }
    else if (strcmp(a, "--budget") == 0 && v) { cfg.budget = atol(v); i++; }
    else if (strcmp(a, "--max-ranks") == 0 && v) { cfg.max_ranks = atoi(v); i++; }
    else if (strcmp(a, "--min-ranks") == 0 && v) { cfg.min_ranks = atoi(v); i++; }
    else if (strcmp(a, "--backend") == 0 && v && tw_backend_from_name(v, &cfg.backend) == 0) i++;
    else if (strcmp(a, "--no-tuples") == 0) cfg.tuples = 0;
    else if (strcmp(a, "--verbose") == 0) { cfg.verbose = 1; cfg.log = stdout; }
    else {
      fprintf(stderr,
              "usage: twin check --sharding [--backend ref|gpu] [--filter OP] [--only RULE-PREFIX] [--budget N]\n"
              "                             [--min-ranks N] [--max-ranks N] [--no-tuples] [--verbose]\n"
              "Sweeps every mesh of min..max ranks (1..8) and every partition spec of each rule, runs\n"
              "the valid cases sharded (ref: thread ranks; gpu: GPU r = rank r over NCCL) against the\n"
              "unsharded ref, and prints the coverage table; exit 1 on any failure. --filter OP keeps the\n"
              "rules of the registry's operations whose name contains OP (ops/registry.h).\n");
      return 2;
    }
  }
  tw_golden_row *rows = NULL;
  int n = 0;
  tw_status st = tw_golden_sharding(&cfg, &rows, &n);
  if (st != TW_OK) {
    fprintf(stderr, "twin check --sharding: %s\n", tw_last_error());
    return st == TW_ERR_INVALID_ARG ? 2 : 1; /* a --only/--filter that selects nothing is a bad argument */
  }
  int bad = tw_golden_print(stdout, rows, n);
  free(rows);
  return bad ? 1 : 0;
}
