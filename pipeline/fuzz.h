/* The pipeline's differential fuzzer (what `twin fuzz --op pipeline` will call): draws
 * (S, M, R, d, Lps, F, fsdp mode) and shapes (E, H, mb), about a quarter of them invalid in
 * exactly one rule. A valid case runs on S*F ref thread ranks against the unpipelined model
 * (y and dx bit for bit; dW bit for bit, or within the reassociation bound for plain F > 1);
 * an invalid one must fail with TW_ERR_INVALID_ARG naming the rule it breaks. A failing case
 * is shrunk (smaller S, M, R, Lps, F, E, H, mb while it still fails).
 * A planted bug (TW_PIPELINE_FUZZ_PLANT_STALE_WINDOW: MaxText's BSW window, spec §4.3)
 * shows that the fuzzer finds and shrinks a real schedule defect. */
#ifndef TWIN_PIPELINE_FUZZ_H
#define TWIN_PIPELINE_FUZZ_H

#include <stdint.h>

#include "twin/tw_pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int S, M, R, d, Lps, layers, F, bsw;
  int64_t E, H, mb;
  const char *expect_rule; /* NULL: valid; else the rule the case breaks */
} tw_pipeline_fuzz_case;

enum { TW_PIPELINE_FUZZ_PLANT_NONE = 0, TW_PIPELINE_FUZZ_PLANT_STALE_WINDOW = 1 };

/* One case from the generator state. */
void tw_pipeline_fuzz_draw(uint64_t *state, tw_pipeline_fuzz_case *c);
/* "S=3 M=6 R=2 d=1 Lps=1 layers=6 F=2 bsw E=4 H=6 mb=2" (+ " expect <rule>") */
const char *tw_pipeline_fuzz_case_str(const tw_pipeline_fuzz_case *c, char *buf, size_t n);
/* TW_OK when the case behaves (valid: matches; invalid: the right error). Otherwise a non-OK
 * status whose message says what differed. `seed` fills the data. */
tw_status tw_pipeline_fuzz_run_case(const tw_pipeline_fuzz_case *c, uint64_t seed, int plant);
/* Shrinks a failing case in place (greedy, one field at a time); returns the number of
 * successful steps. */
int tw_pipeline_fuzz_shrink(tw_pipeline_fuzz_case *c, uint64_t seed, int plant);

typedef struct {
  int cases, valid, invalid, failures;
  tw_pipeline_fuzz_case first_failure, shrunk;
  char message[512];        /* the shrunk case's failure */
} tw_pipeline_fuzz_report;

/* Runs up to max_cases cases (or until `seconds` pass, if > 0) from seed; stops at the first
 * failure, shrinks it and reports it. TW_OK if the run finished (check rep->failures). */
tw_status tw_pipeline_fuzz(uint64_t seed, int max_cases, double seconds, int plant, tw_pipeline_fuzz_report *rep);

#ifdef __cplusplus
}
#endif
#endif
