/* Internal to the `twin` command: subcommands and small shared helpers. */
#ifndef TWIN_TOOLS_CLI_H
#define TWIN_TOOLS_CLI_H

#include "twin/tw_base.h"

/* Exit codes of every subcommand. */
enum { TW_EXIT_OK = 0, TW_EXIT_FAIL = 1, TW_EXIT_USAGE = 2 };

int twin_cmd_op(int argc, char **argv);    /* argv[0] = "op" */
int twin_cmd_check(int argc, char **argv); /* argv[0] = "check" */
int twin_cmd_bench(int argc, char **argv); /* argv[0] = "bench" */
int twin_cmd_port(int argc, char **argv);  /* argv[0] = "port" */

/* 1 if arg is -h / --help. */
int twin_is_help(const char *arg);
/* The exit code for a failed library call: 2 for bad input (arguments, shapes, dtypes,
 * files), 1 for failures of the machine (memory, CUDA, NCCL, internal). */
int twin_exit_for(tw_status s);
/* Parses --backend NAME: "ref", "gpu" (or "all" when allow_all). */
int twin_parse_backend(const char *cmd, const char *name, int allow_all, tw_backend *out, int *all);
/* A context on b, or NULL after printing why (and the exit code in *code). */
tw_ctx *twin_open_ctx(const char *cmd, tw_backend b, int *code);


/* The value of option argv[*i] (advancing *i past it) when it is one of `known` (NULL-ended)
 * and has a value; else NULL after one line on stderr (unexpected argument, unknown option,
 * or a missing value): the caller exits TW_EXIT_USAGE. */
const char *twin_option_value(const char *cmd, int argc, char **argv, int *i, const char *const *known);

/* golden/data of the workspace (bazel run, bazel test, or ./golden/data). */
const char *twin_default_golden_dir(char *buf, size_t n);
/* The `op` key of a case directory's case.txt ("" if none) into buf. */
const char *twin_golden_op(const char *case_dir, char *buf, size_t n);
/* Fills order[] with indexes into dirs (n of them) in registry order (ops/registry.h), keeping
 * the cases whose name or entry name contains filter (NULL: all); the cases of no entry come
 * last. Returns how many. */
int twin_golden_order(char **dirs, int n, const char *filter, int *order);

#endif
