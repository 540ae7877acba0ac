/* `twin plan --op pipeline`: the circular schedule of a configuration (tw_pipeline.h): per
 * iteration and stage which layer and microbatch run, stage 0's input, the collectives, BSW's
 * window loads and the bubble; or the error naming the broken rule (exit 1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "twin/tw_pipeline.h"

int tw_pipeline_plan_main(int argc, char **argv);

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin plan --op pipeline --stages S --microbatches M [--repeats R] [--delay 1|2]\n"
          "                 [--layers-per-stage L] [--fsdp F] [--bsw]\n"
          "Prints the circular schedule (spec: pipeline/README.md): per iteration and stage\n"
          "`L<layer>:m<microbatch>` or `-`, stage 0's input, the collectives, the BSW window loads\n"
          "and the bubble d(S-1)/(MR + d(S-1)); or the error naming the broken rule (exit 1).\n"
          "Defaults: R = 1, d = 1, L = 1, F = 1, plain FSDP (gather per iteration).\n");
}

int tw_pipeline_plan_main(int argc, char **argv) {
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  int F = 1, have_s = 0, have_m = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
    if (!strcmp(a, "--bsw")) { c.fsdp = TW_PIPELINE_FSDP_BSW; continue; }
    if (!strcmp(a, "--op") && v) { i++; continue; } /* "pipeline", checked by the caller */
    int *dst = !strcmp(a, "--stages") ? &c.stages : !strcmp(a, "--microbatches") ? &c.microbatches
             : !strcmp(a, "--repeats") ? &c.repeats : !strcmp(a, "--delay") ? &c.delay
             : !strcmp(a, "--layers-per-stage") ? &c.layers_per_stage : !strcmp(a, "--fsdp") ? &F : NULL;
    char *end = NULL;
    long val = v ? strtol(v, &end, 10) : 0;
    if (!dst || !v || *end || end == v) {
      fprintf(stderr, "twin plan --op pipeline: unknown option or bad value '%s %s' (--help lists every flag)\n", a,
              v ? v : "");
      return 2;
    }
    *dst = (int)val;
    have_s |= dst == &c.stages;
    have_m |= dst == &c.microbatches;
    i++;
  }
  if (!have_s || !have_m) {
    fprintf(stderr, "twin plan --op pipeline: --stages and --microbatches are required (--help lists every flag)\n");
    return 2;
  }
  c.layers = c.stages * c.repeats * c.layers_per_stage;
  c.mb_rows = F; /* one row per fsdp rank: the schedule does not depend on the row count */
  size_t need = 0;
  if (tw_pipeline_format_schedule(&c, F, NULL, 0, &need) != TW_OK) {
    printf("error: %s\n", tw_last_error());
    return 1;
  }
  char *buf = (char *)malloc(need + 1);
  if (!buf) return 1;
  tw_status s = tw_pipeline_format_schedule(&c, F, buf, need + 1, &need);
  if (s == TW_OK) fputs(buf, stdout);
  else printf("error: %s\n", tw_last_error());
  free(buf);
  return s == TW_OK ? 0 : 1;
}
