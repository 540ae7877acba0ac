#include "tests/pipeline_cases.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int key(const char *txt, const char *k) {
  char pat[32];
  snprintf(pat, sizeof pat, "\n%s = ", k);
  const char *p = strstr(txt, pat);
  cr_assert(p, "pipeline.txt lacks %s", k);
  return atoi(p + strlen(pat));
}

void pipe_golden_read(const char *dir, const char *cname, pipe_golden *g) {
  char path[1024], txt[2048] = "\n";
  snprintf(path, sizeof path, "%s/pipeline.txt", dir);
  FILE *f = fopen(path, "r");
  cr_assert(f, "%s", path);
  size_t got = fread(txt + 1, 1, sizeof txt - 2, f);
  txt[got + 1] = 0;
  fclose(f);
  tw_pipeline_config c = TW_PIPELINE_CONFIG_INIT;
  c.stages = key(txt, "S"); c.microbatches = key(txt, "M"); c.repeats = key(txt, "R"); c.delay = key(txt, "d");
  c.layers_per_stage = key(txt, "Lps");
  c.layers = c.stages * c.repeats * c.layers_per_stage;
  c.mb_rows = key(txt, "mb");
  c.fsdp = strstr(txt, "\nfsdp = bsw") ? TW_PIPELINE_FSDP_BSW : TW_PIPELINE_FSDP_PLAIN;
  cr_assert(strstr(txt, "\nloss = half_sum_sq"), "%s: unknown loss", cname);
  g->cfg = c;
  g->F = key(txt, "F");
  g->E = key(txt, "E");
  g->H = key(txt, "H");
}

double pipe_golden_compare(const char *what, const char *cname, const float *got, const double *exact, int64_t n,
                           double k, int fail) {
  double ss = 0;
  for (int64_t i = 0; i < n; i++) ss += exact[i] * exact[i];
  double rms = sqrt(ss / (double)(n > 0 ? n : 1)), worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double bound = k * ldexp(1.0, -24) * (fabs(exact[i]) + rms);
    double err = fabs((double)got[i] - exact[i]);
    if (fail)
      cr_assert(err <= bound, "%s %s[%lld]: got %.9g, golden %.12g, |diff| %.3g > bound %.3g", cname, what,
                (long long)i, (double)got[i], exact[i], err, bound);
    if (err / bound > worst) worst = err / bound;
  }
  return worst;
}
