/* `twin`: the command-line face of twin. One binary, subcommands:
 *   op      run one operation on .npy files (cmd_op.c)
 *   check   the golden suite on every available backend (cmd_check.c); --sharding: shard/
 *   bench   rates next to a peer from the same run (cmd_bench.c, bench.c)
 *   plan    print a sharding plan (shard/)
 *   fuzz    differential fuzzing against the oracle (fuzz/)
 * Subcommands owned by other parts are referenced weakly: a build without them says so. */
#include <stdio.h>
#include <string.h>

#include "fuzz/fuzz.h"
#include "shard/cli.h"
#include "tools/cli.h"

#pragma weak tw_fuzz_main
#pragma weak tw_plan_main

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin <command> [options]     (twin <command> --help for its options)\n"
          "\n"
          "  op <name>   run one operation on .npy inputs, write .npy outputs\n"
          "              names: quantize, dequantize, gemm, grouped_gemm, grouped_gemm_wgrad,\n"
          "              delayed_scale_update\n"
          "  check       run the golden suite on every available backend (--sharding: the\n"
          "              sharded-vs-unsharded checks)\n"
          "  bench       time the kernels next to a peer measured in the same run\n"
          "  plan        print the sharding plan of an operation on a mesh\n"
          "  fuzz        differential fuzzing of every operation against the oracle\n"
          "\n"
          "Backends in this binary: ref%s.\n",
          tw_backend_available(TW_BACKEND_GPU) ? ", gpu" : " (gpu: no device or not built in)");
}

static int missing(const char *what, const char *who) {
  fprintf(stderr, "twin %s: not in this build yet (%s provides it; rebuild once it has landed)\n", what, who);
  return TW_EXIT_USAGE;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "twin: missing command (op, check, bench, plan, fuzz; twin --help)\n");
    return TW_EXIT_USAGE;
  }
  if (twin_is_help(argv[1]) || strcmp(argv[1], "help") == 0) {
    usage(stdout);
    return TW_EXIT_OK;
  }
  const char *cmd = argv[1];
  int sub_argc = argc - 1;
  char **sub_argv = argv + 1;
  if (strcmp(cmd, "op") == 0) return twin_cmd_op(sub_argc, sub_argv);
  if (strcmp(cmd, "check") == 0) return twin_cmd_check(sub_argc, sub_argv);
  if (strcmp(cmd, "bench") == 0) return twin_cmd_bench(sub_argc, sub_argv);
  if (strcmp(cmd, "plan") == 0) return tw_plan_main ? tw_plan_main(sub_argc, sub_argv) : missing("plan", "shard/");
  if (strcmp(cmd, "fuzz") == 0) return tw_fuzz_main ? tw_fuzz_main(sub_argc, sub_argv) : missing("fuzz", "fuzz/");
  fprintf(stderr, "twin: unknown command '%s' (op, check, bench, plan, fuzz; twin --help)\n", cmd);
  return TW_EXIT_USAGE;
}
