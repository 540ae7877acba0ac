/* The registry's invariants: what a new entry must keep so that no mode loses a case. Every
 * stored golden case, every fuzz kind and every sharding rule family belongs to exactly one
 * entry; names and aliases are unique and found; versions are distinct. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "core/backend.h"
#include "fuzz/fuzz_internal.h"
#include "golden/exec.h"
#include "golden/runner.h"
#include "ops/registry.h"
#include "tests/test_util.h"
#include "twin/tw_shard.h"

Test(registry, names_and_aliases_are_unique_and_found) {
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    cr_assert(e->name && e->area && e->summary, "entry %d lacks a name, area or summary", i);
    cr_assert_eq(tw_op_find(e->name), e, "%s", e->name);
    if (e->alias) cr_assert_eq(tw_op_find(e->alias), e, "alias %s of %s", e->alias, e->name);
    cr_assert_geq(e->min_ranks, 1, "%s: min_ranks", e->name);
    for (int j = 0; j < i; j++) {
      const tw_op_entry *o = tw_op_at(j);
      cr_assert(strcmp(e->name, o->name), "two entries named %s", e->name);
      if (e->golden_op && o->golden_op) cr_assert(strcmp(e->golden_op, o->golden_op), "golden op %s twice", e->golden_op);
      if (e->fuzz_kind && o->fuzz_kind) cr_assert(strcmp(e->fuzz_kind, o->fuzz_kind), "fuzz kind %s twice", e->fuzz_kind);
    }
  }
  cr_assert_null(tw_op_find("conv"));
  cr_assert_null(tw_op_find(NULL));
}

Test(registry, versions_are_distinct) {
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    for (int k = 0; k < TW_OP_MAX_VERSIONS && e->versions[k]; k++)
      for (int j = 0; j < k; j++) cr_assert(strcmp(e->versions[j], e->versions[k]), "%s: %s twice", e->name, e->versions[k]);
    cr_assert_null(e->versions[TW_OP_MAX_VERSIONS], "%s: versions not NULL-ended", e->name);
  }
}

Test(registry, every_golden_case_has_an_entry) {
  char **dirs = NULL;
  int n = tw_golden_list_cases(tt_golden_root(), &dirs);
  cr_assert_gt(n, 0, "no golden cases under %s: %s", tt_golden_root(), tw_last_error());
  for (int i = 0; i < n; i++) {
    char path[2048];
    tw_case_keys k;
    snprintf(path, sizeof path, "%s/case.txt", dirs[i]);
    cr_assert_eq(tw_case_keys_parse_file(path, &k), TW_OK, "%s", tw_last_error());
    cr_assert_not_null(tw_op_for_golden(tw_case_get(&k, "op")), "%s: op '%s' has no registry entry", dirs[i],
                       tw_case_get(&k, "op"));
  }
  tw_golden_free_list(dirs, n);
}

Test(registry, every_fuzz_kind_and_sharding_rule_has_an_entry) {
  for (int op = 0; op < FZ_OP_COUNT; op++) {
    int found = 0;
    for (int i = 0; i < tw_op_count(); i++)
      found |= tw_op_at(i)->fuzz_kind && !strcmp(tw_op_at(i)->fuzz_kind, fz_op_name((fz_op)op));
    cr_assert(found, "fuzz kind %s has no registry entry", fz_op_name((fz_op)op));
  }
  for (int op = 0; op < TW_SHARD_OP_COUNT; op++) {
    int found = 0;
    for (int i = 0; i < tw_op_count(); i++)
      found |= tw_op_at(i)->shard_rule && !strcmp(tw_op_at(i)->shard_rule, tw_shard_op_name((tw_shard_op)op));
    cr_assert(found, "sharding rule family %s has no registry entry", tw_shard_op_name((tw_shard_op)op));
  }
}

Test(registry, filters_match_names_and_aliases) {
  cr_assert(tw_op_matches(tw_op_find("grouped_gemm_wgrad"), "wgrad"));
  cr_assert(tw_op_matches(tw_op_find("grouped_quantize"), "quantize"));
  cr_assert(tw_op_matches(tw_op_find("gemm"), NULL));
  cr_assert(tw_op_matches(tw_op_find("gemm"), "all"));
  cr_assert_not(tw_op_matches(tw_op_find("cast"), "gemm"));
  cr_assert_not_null(strstr(tw_op_names(), "grouped_gemm_wgrad"));
}

/* The oracle provides every operation: an entry the ref backend lacks could not be checked. */
Test(registry, the_ref_backend_provides_every_entry) {
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    cr_assert(e->backend_slot || e->above_interface, "%s: no backend_slot", e->name);
    cr_assert(tw_op_provided(e, &tw_ref_ops), "the ref backend lacks %s", e->name);
  }
}
