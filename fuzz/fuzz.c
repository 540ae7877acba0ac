/* `twin fuzz`: the driver loop, progress, summary table, repro dirs, replay and the CLI.
 *
 *   twin fuzz --backend gpu|ref --op all|<op>[,<op>...] (--seconds N | --cases N) --seed S
 *             [--out DIR] [--no-shrink] [--shrink-seconds N] [--max-failures N] [--plant BUG]
 *   twin fuzz --replay DIR [--backend gpu|ref] [--plant BUG]
 *   ... --mesh all|MESH: sharded cases (shard_run.c)
 *
 * Case i of seed S is op[i % nops] drawn from fz_case_seed(S, i): the same on every machine.
 * Each case is written to OUT/current/ before it runs (a crash leaves it there); a failing
 * case is copied to OUT/<op>-<seed>-<i>/ and its shrunk form to OUT/<op>-<seed>-<i>/shrunk/.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fuzz/fuzz.h"
#include "fuzz/fuzz_internal.h"
#include "ops/registry.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void fz_options_default(fz_options *o) {
  memset(o, 0, sizeof *o);
  o->backend = TW_BACKEND_REF;
  o->op_mask = (1 << FZ_OP_COUNT) - 1;
  o->seed = 1;
  o->cases = 0;
  o->seconds = 0;
  o->shrink = 1;
  o->shrink_seconds = 20;
  o->max_failures = 5;
  const char *u = getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  static char dflt[1024];
  if (u && *u) snprintf(dflt, sizeof dflt, "%s/twin-fuzz", u);
  else snprintf(dflt, sizeof dflt, "twin-fuzz-out");
  o->out_dir = dflt;
}

/* Subject and oracle contexts; the oracle is the subject itself for plain --backend ref. A
 * communicator bug (sharded runs) leaves the contexts alone. */
static int open_contexts(tw_backend backend, const char *plant, tw_ctx **subject, tw_ctx **oracle) {
  *subject = *oracle = NULL;
  if (plant && fz_plant_is_comm(plant)) plant = NULL;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  if (tw_ctx_create(oracle, &cfg) != TW_OK) {
    fprintf(stderr, "twin fuzz: cannot create the ref oracle: %s\n", tw_last_error());
    return -1;
  }
  if (backend == TW_BACKEND_REF && !plant) {
    *subject = *oracle;
    return 0;
  }
  if (plant && backend != TW_BACKEND_REF) {
    fprintf(stderr, "twin fuzz: --plant wraps the ref backend; use it with --backend ref\n");
    tw_ctx_destroy(*oracle);
    return -1;
  }
  cfg.backend = backend;
  if (!tw_backend_available(backend)) {
    fprintf(stderr, "twin fuzz: backend '%s' is not in this binary or has no device here (the gpu "
            "backend needs a binary that links //gpu, e.g. //tools:twin, and a visible GPU)\n",
            tw_backend_name(backend));
    tw_ctx_destroy(*oracle);
    return -1;
  }
  if (tw_ctx_create(subject, &cfg) != TW_OK) {
    fprintf(stderr, "twin fuzz: cannot create a '%s' context: %s\n", tw_backend_name(backend), tw_last_error());
    tw_ctx_destroy(*oracle);
    return -1;
  }
  if (plant && fz_plant(*subject, plant) != 0) {
    fprintf(stderr, "twin fuzz: unknown planted bug '%s' (known:", plant);
    for (int i = 0; i < fz_plant_count(); i++) fprintf(stderr, " %s", fz_plant_name(i));
    fprintf(stderr, ")\n");
    tw_ctx_destroy(*subject);
    tw_ctx_destroy(*oracle);
    return -1;
  }
  return 0;
}

static void close_contexts(tw_ctx *subject, tw_ctx *oracle) {
  if (subject != oracle) tw_ctx_destroy(subject);
  tw_ctx_destroy(oracle);
}

/* The mesh option, the environment of sharded runs and its rank limit; 0 or 2 (usage). */
static int open_sharding(const fz_options *o, tw_ctx *oracle, fz_mesh_opt *mo, fz_shard_env **env) {
  char err[400];
  *env = NULL;
  if (fz_mesh_opt_parse(o->mesh, mo, err, sizeof err) != 0) {
    fprintf(stderr, "twin fuzz: %s\n", err);
    return 2;
  }
  *env = fz_shard_env_open(o->backend, o->plant, oracle, err, sizeof err);
  if (!*env) {
    fprintf(stderr, "twin fuzz: %s\n", err);
    return 2;
  }
  int have = fz_shard_env_max_ranks(*env);
  if (mo->all) {
    while (mo->max_ranks > have) mo->max_ranks /= 2;
  } else if (tw_mesh_ranks(&mo->mesh) > have) {
    char mb[96];
    fprintf(stderr, "twin fuzz: --mesh %s needs %d ranks; backend %s runs at most %d here\n",
            tw_mesh_str(&mo->mesh, mb, sizeof mb), tw_mesh_ranks(&mo->mesh), tw_backend_name(o->backend), have);
    fz_shard_env_close(*env);
    *env = NULL;
    return 2;
  }
  return 0;
}

static fz_verdict run_one(tw_ctx *subject, tw_ctx *oracle, fz_shard_env *env, const fz_case *c, fz_result *r) {
  if (c->sharded) return fz_run_sharded(env, c, r);
  return fz_run_case(subject, oracle, c, r);
}

static void report_failure(const fz_options *o, tw_ctx *subject, tw_ctx *oracle, fz_shard_env *env, fz_case *c,
                           const fz_result *r, int64_t index, double t_start, fz_summary *s) {
  char dir[1200], sdir[1300], desc[512], extra[6000];
  snprintf(dir, sizeof dir, "%s/%s-%llu-%lld", o->out_dir, fz_op_name(c->op), (unsigned long long)o->seed,
           (long long)index);
  const char *bname = tw_backend_name(o->backend);
  fz_case_describe(c, desc, sizeof desc);
  fprintf(stderr, "\nFAIL case %lld %s\n", (long long)index, desc);
  fz_result_print(r, stderr);
  char plan[4096] = "";
  if (c->sharded) fz_shard_plan_text(c, plan, sizeof plan);
  snprintf(extra, sizeof extra, "case %lld of seed %llu: %s\n%s", (long long)index, (unsigned long long)o->seed, desc, plan);
  if (fz_case_write(dir, c, bname, o->plant) != TW_OK || fz_report_write(dir, r, extra) != TW_OK)
    fprintf(stderr, "  (could not write the repro: %s)\n", tw_last_error());
  const char *final_dir = dir;
  if (o->shrink && r->verdict == FZ_FAIL) {
    fz_shrink_stats st;
    if (c->sharded) fz_shrink_sharded(env, c, r, o->shrink_seconds, &st);
    else fz_shrink(subject, oracle, c, r, o->shrink_seconds, &st);
    fz_result r2;
    run_one(subject, oracle, env, c, &r2);
    snprintf(sdir, sizeof sdir, "%s/shrunk", dir);
    fz_case_describe(c, desc, sizeof desc);
    if (c->sharded) fz_shard_plan_text(c, plan, sizeof plan);
    snprintf(extra, sizeof extra, "shrunk from %lld to %lld input elements in %.1f s (%d runs): %s\n%s",
             (long long)st.elements_before, (long long)st.elements_after, st.seconds, st.attempts, desc,
             c->sharded ? plan : "");
    if (fz_case_write(sdir, c, bname, o->plant) != TW_OK || fz_report_write(sdir, &r2, extra) != TW_OK)
      fprintf(stderr, "  (could not write the shrunk repro: %s)\n", tw_last_error());
    fprintf(stderr, "  shrunk: %s\n", extra);
    fz_result_print(&r2, stderr);
    final_dir = sdir;
    if (s->failures == 1) s->shrunk_elements = st.elements_after;
  } else if (s->failures == 1) {
    s->shrunk_elements = fz_case_elements(c);
  }
  fprintf(stderr, "  replay: twin fuzz --replay %s --backend %s%s%s\n", final_dir, bname,
          o->plant ? " --plant " : "", o->plant ? o->plant : "");
  if (s->failures == 1) {
    snprintf(s->first_repro, sizeof s->first_repro, "%.500s", final_dir);
    s->first_failure_seconds = now_s() - t_start;
  }
}

/* --mesh with no op that has a rule, or a communicator bug without --mesh: one line, 2. */
static int sharding_usage(const fz_options *o) {
  if (o->mesh) {
    int any = 0;
    for (int i = 0; i < FZ_OP_COUNT; i++) any |= (o->op_mask & (1 << i)) && fz_op_shardable((fz_op)i);
    if (!any) {
      fprintf(stderr, "twin fuzz: --mesh: none of the selected ops has a sharding rule (quantize, gemm, grouped_gemm and wgrad have; cast has none)\n");
      return 2;
    }
  } else if (o->plant && fz_plant_is_comm(o->plant)) {
    fprintf(stderr, "twin fuzz: planted bug '%s' lives in the communicator of sharded runs; add --mesh all\n", o->plant);
    return 2;
  }
  return 0;
}

int fz_run(const fz_options *o, fz_summary *s) {
  memset(s, 0, sizeof *s);
  s->first_failure_seconds = -1;
  s->shrunk_elements = -1;
  fz_op ops[FZ_OP_COUNT];
  int nops = 0;
  for (int i = 0; i < FZ_OP_COUNT; i++)
    if (o->op_mask & (1 << i)) ops[nops++] = (fz_op)i;
  if (sharding_usage(o) != 0) return 2;
  if (o->mesh) { /* only the ops with a sharding rule */
    int k = 0;
    for (int i = 0; i < nops; i++)
      if (fz_op_shardable(ops[i])) ops[k++] = ops[i];
    nops = k;
  }
  if (!nops) { fprintf(stderr, "twin fuzz: no op selected\n"); return 2; }
  tw_ctx *subject, *oracle;
  if (open_contexts(o->backend, o->plant, &subject, &oracle) != 0) return 2;
  fz_mesh_opt mo;
  fz_shard_env *env = NULL;
  if (o->mesh && open_sharding(o, oracle, &mo, &env) != 0) {
    close_contexts(subject, oracle);
    return 2;
  }
  char cur[1100];
  snprintf(cur, sizeof cur, "%s/current", o->out_dir);
  double t0 = now_s(), last = t0;
  int rc = 0;
  for (int64_t i = 0;; i++) {
    double t = now_s();
    if (o->cases > 0 ? i >= o->cases : t - t0 >= o->seconds) break;
    if (o->max_failures > 0 && s->failures >= o->max_failures) break;
    fz_op op = ops[i % nops];
    fz_case c;
    if ((env ? fz_generate_sharded(&c, op, o->seed, (uint64_t)i, &mo) : fz_generate(&c, op, o->seed, (uint64_t)i)) != 0) {
      fprintf(stderr, "twin fuzz: could not generate case %lld (out of memory)\n", (long long)i);
      rc = 2;
      break;
    }
    /* on disk before it runs: a crash or hang leaves the case behind */
    if (fz_case_write(cur, &c, tw_backend_name(o->backend), o->plant) != TW_OK) {
      fprintf(stderr, "twin fuzz: %s\n", tw_last_error());
      fz_case_free(&c);
      rc = 2;
      break;
    }
    fz_result r;
    double tc = now_s();
    fz_verdict v = run_one(subject, oracle, env, &c, &r);
    s->per_op_seconds[op] += now_s() - tc;
    s->cases++;
    s->per_op_cases[op]++;
    if (c.sharded) {
      if (r.ranks >= 1 && r.ranks <= 64) s->by_ranks[r.ranks]++;
      s->expected_errors += r.expected_error;
      s->exact_cases += r.exact;
      for (int k = 0; k < 6; k++) s->steps[k] += r.steps[k];
    }
    if (v != FZ_PASS) {
      s->failures++;
      if (v == FZ_ERROR) s->errors++;
      s->per_op_failures[op]++;
      report_failure(o, subject, oracle, env, &c, &r, i, t0, s);
    }
    fz_case_free(&c);
    t = now_s();
    if (!o->quiet && t - last >= 2.0) {
      fprintf(stderr, "[fuzz] %6.1fs %lld cases (%.1f/s) %lld failures\n", t - t0, (long long)s->cases,
              s->cases / (t - t0), (long long)s->failures);
      last = t;
    }
  }
  s->seconds = now_s() - t0;
  fz_shard_env_close(env);
  close_contexts(subject, oracle);
  if (rc) return rc;
  return s->failures ? 1 : 0;
}

void fz_summary_print(const fz_summary *s, FILE *f) {
  fprintf(f, "%-14s %10s %9s %10s\n", "op", "cases", "failures", "cases/s");
  for (int i = 0; i < FZ_OP_COUNT; i++) {
    if (!s->per_op_cases[i]) continue;
    double t = s->per_op_seconds[i];
    fprintf(f, "%-14s %10lld %9lld %10.1f\n", fz_op_name((fz_op)i), (long long)s->per_op_cases[i],
            (long long)s->per_op_failures[i], t > 0 ? s->per_op_cases[i] / t : 0.0);
  }
  fprintf(f, "%-14s %10lld %9lld %10.1f   (%.1f s)\n", "total", (long long)s->cases, (long long)s->failures,
          s->seconds > 0 ? s->cases / s->seconds : 0.0, s->seconds);
  int64_t sharded = 0;
  for (int i = 0; i <= 64; i++) sharded += s->by_ranks[i];
  if (sharded) {
    fprintf(f, "sharded: %lld cases by ranks:", (long long)sharded);
    for (int i = 0; i <= 64; i++)
      if (s->by_ranks[i]) fprintf(f, " %d:%lld", i, (long long)s->by_ranks[i]);
    fprintf(f, "; %lld invalid specs/shapes refused with the expected rule; %lld exact plans\n",
            (long long)s->expected_errors, (long long)s->exact_cases);
    fprintf(f, "plan steps run: all-gather %lld, slice %lld, reduce-scatter %lld, all-reduce %lld, amax max-reduce %lld, fp8 quantize %lld\n",
            (long long)s->steps[0], (long long)s->steps[1], (long long)s->steps[2], (long long)s->steps[3],
            (long long)s->steps[4], (long long)s->steps[5]);
  }
  if (s->failures) fprintf(f, "first failure after %.1f s; repro: %s\n", s->first_failure_seconds, s->first_repro);
}

int fz_replay(const char *dir, tw_backend backend, const char *plant, fz_result *res) {
  fz_case c;
  if (fz_case_read(dir, &c) != TW_OK) {
    fprintf(stderr, "twin fuzz --replay: %s\n", tw_last_error());
    memset(res, 0, sizeof *res);
    res->verdict = FZ_ERROR;
    snprintf(res->message, sizeof res->message, "%s", tw_last_error());
    return 2;
  }
  tw_ctx *subject, *oracle;
  if ((plant && fz_plant_is_comm(plant) && !c.sharded) || open_contexts(backend, plant, &subject, &oracle) != 0) {
    if (plant && fz_plant_is_comm(plant) && !c.sharded)
      fprintf(stderr, "twin fuzz --replay: planted bug '%s' lives in the communicator; %s is not a sharded case\n", plant, dir);
    fz_case_free(&c);
    memset(res, 0, sizeof *res);
    res->verdict = FZ_ERROR;
    return 2;
  }
  fz_shard_env *env = NULL;
  if (c.sharded) {
    char err[400];
    env = fz_shard_env_open(backend, plant, oracle, err, sizeof err);
    if (!env) {
      fprintf(stderr, "twin fuzz --replay: %s\n", err);
      close_contexts(subject, oracle);
      fz_case_free(&c);
      memset(res, 0, sizeof *res);
      res->verdict = FZ_ERROR;
      return 2;
    }
  }
  char desc[512];
  fz_case_describe(&c, desc, sizeof desc);
  fz_verdict v = run_one(subject, oracle, env, &c, res);
  printf("%s %s on %s%s%s\n", v == FZ_PASS ? "PASS" : v == FZ_FAIL ? "FAIL" : "ERROR", desc,
         tw_backend_name(backend), plant ? "+" : "", plant ? plant : "");
  if (c.sharded) {
    char plan[8192];
    fputs(fz_shard_plan_text(&c, plan, sizeof plan), stdout);
  }
  fz_result_print(res, stdout);
  fz_shard_env_close(env);
  close_contexts(subject, oracle);
  fz_case_free(&c);
  return v == FZ_PASS ? 0 : 1;
}

/* ---- CLI ---- */
static const char *registry_ops(void);

static void usage(FILE *f) {
  fprintf(f,
          "usage: twin fuzz [--backend ref|gpu] [--op all|OP[,OP...]] [--seconds N | --cases N]\n"
          "                 [--seed S] [--out DIR] [--no-shrink] [--shrink-seconds N]\n"
          "                 [--max-failures N] [--plant BUG] [--quiet] [--mesh all|MESH]\n"
          "       twin fuzz --replay DIR [--backend ref|gpu] [--plant BUG]\n"
          "       twin fuzz --write-case DIR --op OP --seed S --index I [--mesh all|MESH]   (export one case)\n"
          "       twin fuzz --list\n"
          "ops: %s (or their registry names: grouped_quantize, grouped_gemm_wgrad; default all).\n"
          "Default: --cases 200 --seed 1.\n"
          "--backend ref checks the oracle's self-consistency; gpu is compared with ref.\n"
          "--mesh runs sharded cases (fuzz/README.md): 'all' draws a mesh of 1, 2, 4 or 8 ranks over the\n"
          "rule's axes per case, a mesh such as dp=2,ep=4 is used for every case; each case draws a\n"
          "partition spec per operand, plans it (some deliberately invalid: the planner must refuse\n"
          "them with the rule's error), runs the plan on every rank (ref: threads; gpu: GPU r over\n"
          "NCCL) and compares each rank's shard with the unsharded oracle. cast has no rule.\n",
          registry_ops());
}

static int parse_num(const char *flag, const char *v, double *out) {
  char *end;
  if (!v) { fprintf(stderr, "twin fuzz: %s needs a value\n", flag); return -1; }
  *out = strtod(v, &end);
  if (*end || *out < 0) { fprintf(stderr, "twin fuzz: %s '%s' is not a non-negative number\n", flag, v); return -1; }
  return 0;
}

/* An entry with its own fuzzer (registry fuzz_run) in this binary. */
static int own_fuzzer(const tw_op_entry *e) { return e && e->fuzz_run; }

/* The fuzzable ops, read from the registry (ops/registry.h): each entry with a fuzz kind, by
 * its kind ("quantize", "wgrad"), then those with their own fuzzer, in registry order. */
static const char *registry_ops(void) {
  static char buf[256];
  buf[0] = 0;
  for (int i = 0; i < tw_op_count(); i++) {
    const tw_op_entry *e = tw_op_at(i);
    fz_op op;
    int kind = e->fuzz_kind && fz_op_from_name(e->fuzz_kind, &op) == 0;
    if (!kind && !own_fuzzer(e)) continue;
    size_t n = strlen(buf);
    snprintf(buf + n, sizeof buf - n, "%s%s", n ? " " : "", kind ? e->fuzz_kind : e->name);
  }
  return buf;
}

/* Bit i: registry entry i's own fuzzer is selected. */
static int own_mask_all(void) {
  int m = 0;
  for (int i = 0; i < tw_op_count() && i < 31; i++)
    if (own_fuzzer(tw_op_at(i))) m |= 1 << i;
  return m;
}

/* --op: registry names or aliases (grouped_gemm_wgrad or wgrad), comma-separated, or all.
 * fz generators go to *mask, entries with their own fuzzer to *own (registry index bits). */
static int parse_ops(const char *v, int *mask, int *own) {
  if (!v) return -1;
  if (strcmp(v, "all") == 0) { *mask = (1 << FZ_OP_COUNT) - 1; *own = own_mask_all(); return 0; }
  *mask = 0;
  *own = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", v);
  for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
    const tw_op_entry *e = tw_op_find(tok);
    fz_op op;
    if (!e) {
      fprintf(stderr, "twin fuzz: unknown op '%s' (ops: %s, or all)\n", tok, registry_ops());
      return -1;
    }
    if ((!e->fuzz_kind || fz_op_from_name(e->fuzz_kind, &op) != 0) && own_fuzzer(e)) {
      for (int i = 0; i < tw_op_count(); i++)
        if (tw_op_at(i) == e) *own |= 1 << i;
      continue;
    }
    if (!e->fuzz_kind || fz_op_from_name(e->fuzz_kind, &op) != 0) {
      fprintf(stderr, "twin fuzz: %s has no fuzz generator (ops: %s, or all)\n", e->name, registry_ops());
      return -1;
    }
    *mask |= 1 << op;
  }
  return 0;
}

/* Runs the selected entries' own fuzzers; o->seconds is shared among `groups` of them. */
static int run_own_fuzzers(const fz_options *o, int own, int groups) {
  int rc = 0;
  for (int i = 0; i < tw_op_count() && i < 31; i++) {
    if (!(own & (1 << i))) continue;
    const tw_op_entry *e = tw_op_at(i);
    tw_op_fuzz_opts fo = {o->seed, o->cases, o->cases ? 0 : o->seconds / (groups > 0 ? groups : 1), o->out_dir,
                          o->plant, o->quiet};
    if (!o->quiet) fprintf(stderr, "twin fuzz: %s, seed %llu\n", e->name, (unsigned long long)o->seed);
    int r = e->fuzz_run(&fo, stdout);
    if (r == 2) return 2;
    rc |= r;
  }
  return rc;
}

int tw_fuzz_main(int argc, char **argv) {
  fz_options o;
  fz_options_default(&o);
  const char *replay = NULL, *write_dir = NULL;
  int64_t index = 0;
  int own = own_mask_all(); /* entries with their own fuzzer (default: all of them) */
  int op_given = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    double d;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
    else if (!strcmp(a, "--list")) {
      printf("ops: %s (--mesh: all but cast and the entries with their own fuzzer)\nplanted bugs:", registry_ops());
      for (int k = 0; k < fz_plant_count(); k++)
        printf(" %s(%s%s)", fz_plant_name(k), fz_plant_op(k), fz_plant_is_comm(fz_plant_name(k)) ? ", --mesh" : "");
      for (int k = 0; k < tw_op_count(); k++)
        if (own_fuzzer(tw_op_at(k)) && tw_op_at(k)->planted) {
          char names[160];
          snprintf(names, sizeof names, "%s", tw_op_at(k)->planted);
          for (char *t = strtok(names, " "); t; t = strtok(NULL, " ")) printf(" %s(%s)", t, tw_op_at(k)->name);
        }
      printf("\n");
      return 0;
    } else if (!strcmp(a, "--backend")) {
      if (!v || tw_backend_from_name(v, &o.backend) != 0) {
        fprintf(stderr, "twin fuzz: --backend must be ref or gpu, got '%s'\n", v ? v : "");
        return 2;
      }
      i++;
    } else if (!strcmp(a, "--op")) {
      if (parse_ops(v, &o.op_mask, &own) != 0) return 2;
      op_given = 1;
      i++;
    } else if (!strcmp(a, "--seconds")) {
      if (parse_num(a, v, &o.seconds)) return 2;
      i++;
    } else if (!strcmp(a, "--cases")) {
      if (parse_num(a, v, &d)) return 2;
      o.cases = (int64_t)d;
      i++;
    } else if (!strcmp(a, "--seed")) {
      char *end;
      if (!v) { fprintf(stderr, "twin fuzz: --seed needs a value\n"); return 2; }
      o.seed = strtoull(v, &end, 0);
      if (*end) { fprintf(stderr, "twin fuzz: --seed '%s' is not an integer\n", v); return 2; }
      i++;
    } else if (!strcmp(a, "--out")) {
      if (!v) { fprintf(stderr, "twin fuzz: --out needs a directory\n"); return 2; }
      o.out_dir = v;
      i++;
    } else if (!strcmp(a, "--no-shrink")) {
      o.shrink = 0;
    } else if (!strcmp(a, "--shrink-seconds")) {
      if (parse_num(a, v, &o.shrink_seconds)) return 2;
      i++;
    } else if (!strcmp(a, "--max-failures")) {
      if (parse_num(a, v, &d)) return 2;
      o.max_failures = (int)d;
      i++;
    } else if (!strcmp(a, "--plant")) {
      if (!v) { fprintf(stderr, "twin fuzz: --plant needs a bug name (see --list)\n"); return 2; }
      o.plant = v;
      i++;
    } else if (!strcmp(a, "--replay")) {
      if (!v) { fprintf(stderr, "twin fuzz: --replay needs a directory\n"); return 2; }
      replay = v;
      i++;
    } else if (!strcmp(a, "--write-case")) {
      if (!v) { fprintf(stderr, "twin fuzz: --write-case needs a directory\n"); return 2; }
      write_dir = v;
      i++;
    } else if (!strcmp(a, "--index")) {
      if (parse_num(a, v, &d)) return 2;
      index = (int64_t)d;
      i++;
    } else if (!strcmp(a, "--quiet")) {
      o.quiet = 1;
    } else if (!strcmp(a, "--mesh")) {
      fz_mesh_opt mo;
      char err[400];
      if (fz_mesh_opt_parse(v, &mo, err, sizeof err) != 0) {
        fprintf(stderr, "twin fuzz: %s\n", err);
        return 2;
      }
      o.mesh = v;
      i++;
    } else {
      fprintf(stderr, "twin fuzz: unknown argument '%s'\n", a);
      usage(stderr);
      return 2;
    }
  }
  if (replay) {
    fz_result r;
    return fz_replay(replay, o.backend, o.plant, &r);
  }
  if (write_dir) { /* export case --index of --seed for --op (first selected op) without running it */
    fz_op op = FZ_QUANTIZE;
    for (int k = FZ_OP_COUNT - 1; k >= 0; k--)
      if (o.op_mask & (1 << k)) op = (fz_op)k;
    fz_case c;
    fz_mesh_opt mo;
    char err[400];
    if (o.mesh && (fz_mesh_opt_parse(o.mesh, &mo, err, sizeof err) != 0 || !fz_op_shardable(op))) {
      fprintf(stderr, "twin fuzz: --write-case --mesh: %s\n", fz_op_shardable(op) ? err : "this op has no sharding rule");
      return 2;
    }
    if ((o.mesh ? fz_generate_sharded(&c, op, o.seed, (uint64_t)index, &mo) : fz_generate(&c, op, o.seed, (uint64_t)index)) != 0) {
      fprintf(stderr, "twin fuzz: out of memory\n");
      return 2;
    }
    tw_status st = fz_case_write(write_dir, &c, tw_backend_name(o.backend), o.plant);
    char desc[512];
    fz_case_describe(&c, desc, sizeof desc);
    fz_case_free(&c);
    if (st != TW_OK) { fprintf(stderr, "twin fuzz: %s\n", tw_last_error()); return 2; }
    printf("wrote %s: %s\n", write_dir, desc);
    return 0;
  }
  if (o.seconds > 0 && o.cases > 0) {
    fprintf(stderr, "twin fuzz: give --seconds or --cases, not both\n");
    return 2;
  }
  if (o.seconds == 0 && o.cases == 0) o.cases = 200;
  if (o.backend != TW_BACKEND_REF && own) { /* router, ep, pipeline fuzz the oracle on thread ranks */
    if (!op_given) {
      own = 0;
    } else {
      fprintf(stderr, "twin fuzz: router, ep and pipeline fuzz on ref thread ranks only (use --backend ref; "
                      "their gpu versions are tested against the ref by their own tests)\n");
      return 2;
    }
  }
  if (o.mesh || o.plant) { /* sharded cases and fz plants belong to fz's generators alone ... */
    int keep = 0;
    for (int i = 0; o.plant && i < tw_op_count() && i < 31; i++) /* ... unless the plant is an entry's */
      if ((own & (1 << i)) && tw_op_at(i)->planted && strstr(tw_op_at(i)->planted, o.plant)) keep |= 1 << i;
    if (keep) {
      o.op_mask = 0;
      own = keep;
    } else {
      own = 0;
    }
  }
  if (o.op_mask == 0 && own == 0) {
    fprintf(stderr, "twin fuzz: nothing to run: router, ep and pipeline draw their own meshes and take only their own "
                    "plants (twin fuzz --list)\n");
    return 2;
  }
  if (o.op_mask == 0) return run_own_fuzzers(&o, own, __builtin_popcount((unsigned)own));
  int groups = 1 + __builtin_popcount((unsigned)own);
  if (own && o.seconds > 0) o.seconds /= groups; /* --seconds is the whole run's budget */
  if (sharding_usage(&o) != 0) return 2;
  fprintf(stderr, "twin fuzz: backend %s%s%s, seed %llu, %s %g%s%s, repros under %s\n", tw_backend_name(o.backend),
          o.plant ? "+" : "", o.plant ? o.plant : "", (unsigned long long)o.seed,
          o.cases ? "cases" : "seconds", o.cases ? (double)o.cases : o.seconds, o.mesh ? ", sharded on mesh " : "",
          o.mesh ? o.mesh : "", o.out_dir);
  fz_summary s;
  int rc = fz_run(&o, &s);
  if (rc == 2) return 2;
  fz_summary_print(&s, stdout);
  int own_rc = own ? run_own_fuzzers(&o, own, 1) : 0; /* o.seconds is already one group's share */
  return own_rc == 2 ? 2 : (rc || own_rc);
}
