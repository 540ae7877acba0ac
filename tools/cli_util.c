/* Helpers shared by the subcommands of `twin`. */
#include <stdio.h>
#include <string.h>

#include "tools/cli.h"

int twin_is_help(const char *arg) { return arg && (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0); }

int twin_exit_for(tw_status s) {
  switch (s) {
    case TW_OK: return TW_EXIT_OK;
    case TW_ERR_MEMORY: case TW_ERR_CUDA: case TW_ERR_NCCL: case TW_ERR_TIMEOUT: case TW_ERR_INTERNAL:
      return TW_EXIT_FAIL;
    default: return TW_EXIT_USAGE;
  }
}

int twin_parse_backend(const char *cmd, const char *name, int allow_all, tw_backend *out, int *all) {
  if (all) *all = 0;
  if (allow_all && strcmp(name, "all") == 0) {
    if (all) *all = 1;
    return 0;
  }
  if (tw_backend_from_name(name, out) == 0) return 0;
  fprintf(stderr, "twin %s: unknown backend '%s' (ref, gpu%s)\n", cmd, name, allow_all ? ", all" : "");
  return -1;
}

tw_ctx *twin_open_ctx(const char *cmd, tw_backend b, int *code) {
  tw_ctx *ctx = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cfg.backend = b;
  tw_status s = tw_ctx_create(&ctx, &cfg);
  if (s != TW_OK) {
    fprintf(stderr, "twin %s: %s\n", cmd, tw_last_error());
    *code = twin_exit_for(s);
    return NULL;
  }
  *code = TW_EXIT_OK;
  return ctx;
}

const char *twin_option_value(const char *cmd, int argc, char **argv, int *i, const char *const *known) {
  const char *a = argv[*i];
  int k = 0;
  while (known[k] && strcmp(known[k], a)) k++;
  if (strncmp(a, "--", 2) != 0) fprintf(stderr, "twin %s: unexpected argument '%s' (twin %s --help)\n", cmd, a, cmd);
  else if (!known[k]) fprintf(stderr, "twin %s: unknown option '%s' (twin %s --help)\n", cmd, a, cmd);
  else if (*i + 1 >= argc) fprintf(stderr, "twin %s: %s needs a value (twin %s --help)\n", cmd, a, cmd);
  else return argv[++*i];
  return NULL;
}
