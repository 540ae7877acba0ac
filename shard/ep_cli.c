/* `twin plan` for the MoE routing ops (tw_shard_ep.h). */
#include "shard/ep_cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_shard_ep.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin plan --mesh dp=2,ep=4 --op router|ep_dispatch|ep_combine\n"
          "                 [--tokens 1024] [--hidden 256] [--experts 8] [--topk 2]\n"
          "                 [--x-spec '[(dp,ep), None]'] [--idx-spec ...] [--w-spec ...]\n"
          "Prints the EP plan (local shapes, EP groups, output specs) or the error naming the\n"
          "broken rule (exit 1). --x-spec is the tokens' spec (router: the logits').\n");
}

int tw_ep_plan_wants(int argc, char **argv) {
  tw_ep_op op;
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--op") == 0) return tw_ep_op_from_name(argv[i + 1], &op) == 0;
  return 0;
}

int tw_ep_plan_main(int argc, char **argv) {
  const char *mesh_s = NULL, *op_s = NULL, *xs = "[ep, None]", *is = NULL, *ws = NULL;
  long long T = 1024, H = 256, E = 8, k = 2;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v && strcmp(a, "-h") && strcmp(a, "--help")) { fprintf(stderr, "twin plan: '%s' needs a value\n", a); usage(stderr); return 2; }
#define S(name, var) if (strcmp(a, name) == 0) { var = v; i++; continue; }
#define N(name, var) if (strcmp(a, name) == 0) { var = atoll(v); i++; continue; }
    S("--mesh", mesh_s) S("--op", op_s) S("--x-spec", xs) S("--idx-spec", is) S("--w-spec", ws)
    N("--tokens", T) N("--hidden", H) N("--experts", E) N("--topk", k)
#undef S
#undef N
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) { usage(stdout); return 0; }
    fprintf(stderr, "twin plan: unknown option '%s'\n", a);
    usage(stderr);
    return 2;
  }
  tw_mesh mesh;
  tw_ep_op op;
  tw_pspec x, i_, w;
  if (!mesh_s || !op_s || tw_ep_op_from_name(op_s, &op) != 0) { usage(stderr); return 2; }
  if (tw_mesh_parse(mesh_s, &mesh) != TW_OK || tw_pspec_parse(xs, &x) != TW_OK ||
      (is && tw_pspec_parse(is, &i_) != TW_OK) || (ws && tw_pspec_parse(ws, &w) != TW_OK)) {
    fprintf(stderr, "twin plan: %s\n", tw_last_error());
    return 2;
  }
  tw_ep_plan plan;
  if (tw_ep_plan_make(&mesh, op, T, op == TW_EP_OP_ROUTER ? E : H, (int)E, (int)k, &x, is ? &i_ : NULL,
                      ws ? &w : NULL, &plan) != TW_OK) {
    printf("error: %s\n", tw_last_error());
    return 1;
  }
  char buf[4096];
  fputs(tw_ep_plan_format(&plan, buf, sizeof buf), stdout);
  return 0;
}
