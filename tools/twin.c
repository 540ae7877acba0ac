/* `twin`: the command-line face of twin. One binary, subcommands:
 *   op      run one operation on .npy files (cmd_op.c)
 *   check   the golden suite on every available backend (cmd_check.c); --sharding: shard/
 *   bench   rates next to a peer from the same run (cmd_bench.c, ops/bench.c)
 *   port    the porting report: every op x version checked and timed (cmd_port.c, port.h)
 *   plan    print a sharding plan (shard/)
 *   fuzz    differential fuzzing against the oracle (fuzz/)
 *   backends  the operations each backend of this binary provides
 * Subcommands owned by other parts are referenced weakly: a build without them says so. */
#include <stdio.h>
#include <string.h>

#include "core/backend.h"
#include "fuzz/fuzz.h"
#include "ops/registry.h"
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
          "  port        the porting report of this machine: every op x kernel version checked and\n"
          "              timed against its floor (report.md, report.json, roofline.png; --compare)\n"
          "  plan        print the sharding plan of an operation on a mesh\n"
          "  fuzz        differential fuzzing of every operation against the oracle\n"
          "  backends    which operations each backend of this binary provides\n"
          "\n"
          "Backends in this binary: ref%s.\n",
          tw_backend_available(TW_BACKEND_GPU) ? ", gpu" : " (gpu: no device or not built in)");
}

/* `twin backends`: what this binary's backends provide, read from their op tables for every
 * operation of the registry. */
extern const tw_backend_ops tw_ref_ops __attribute__((weak));
extern const tw_backend_ops tw_gpu_ops __attribute__((weak));

#pragma weak gpu_ep_describe
void gpu_ep_describe(char *buf, size_t n); /* gpu/ep.cu; absent from twin_cpu */
#pragma weak gpu_ppermute_describe
void gpu_ppermute_describe(char *buf, size_t n); /* gpu/ppermute_lsa.cu; absent from twin_cpu */

static int cmd_backends(void) {
  const tw_backend_ops *tables[TW_BACKEND_COUNT] = {&tw_ref_ops, &tw_gpu_ops};
  printf("%-22s", "operation");
  for (int b = 0; b < TW_BACKEND_COUNT; b++) printf(" %-10s", tw_backend_name((tw_backend)b));
  printf("\n%-22s", "(built in / device)");
  for (int b = 0; b < TW_BACKEND_COUNT; b++)
    printf(" %-10s", !tables[b] ? "absent" : tw_backend_available((tw_backend)b) ? "usable" : "no device");
  printf("\n");
  for (int i = 0; i < tw_op_count(); i++) { /* the registry's operations (ops/registry.h) */
    const tw_op_entry *e = tw_op_at(i);
    printf("%-22s", e->name);
    for (int b = 0; b < TW_BACKEND_COUNT; b++) printf(" %-10s", tw_op_provided(e, tables[b]) ? "yes" : "-");
    printf("\n");
  }
  if (gpu_ep_describe && tw_backend_available(TW_BACKEND_GPU)) { /* which EP version auto picks, and why */
    char why[400];
    gpu_ep_describe(why, sizeof why);
    printf("\nep (gpu): %s\n", why);
  }
  if (gpu_ppermute_describe && tw_backend_available(TW_BACKEND_GPU)) {
    char why[400];
    gpu_ppermute_describe(why, sizeof why);
    printf("ppermute (gpu, NCCL communicators): %s\n", why);
  }
  return TW_EXIT_OK;
}

static int missing(const char *what, const char *who) {
  fprintf(stderr, "twin %s: not in this build yet (%s provides it; rebuild once it has landed)\n", what, who);
  return TW_EXIT_USAGE;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "twin: missing command (op, check, bench, port, backends, plan, fuzz; twin --help)\n");
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
  if (strcmp(cmd, "port") == 0) return twin_cmd_port(sub_argc, sub_argv);
  if (strcmp(cmd, "backends") == 0) return cmd_backends();
  if (strcmp(cmd, "plan") == 0) return tw_plan_main ? tw_plan_main(sub_argc, sub_argv) : missing("plan", "shard/");
  if (strcmp(cmd, "fuzz") == 0) return tw_fuzz_main ? tw_fuzz_main(sub_argc, sub_argv) : missing("fuzz", "fuzz/");
  fprintf(stderr, "twin: unknown command '%s' (op, check, bench, port, backends, plan, fuzz; twin --help)\n", cmd);
  return TW_EXIT_USAGE;
}
