/* The fuzzer's own contract: the corpus replays clean (and its planted-bug regressions still
 * catch their bug), same seed => same cases, repro dirs round-trip, the CLI rejects bad
 * arguments, and a case is on disk before it runs. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz/fuzz.h"
#include "fuzz/fuzz_internal.h"
#include "golden/runner.h"

#define CORPUS "golden/fuzz-corpus"
#define FZ_SEED1_FINGERPRINT 0xc3143fda5abb044aull
#define FZ_SHARDED_SEED1_FINGERPRINT 0x531d5fb8938d88d9ull

static const char *tmp_root(void) {
  const char *t = getenv("TEST_TMPDIR");
  return t && *t ? t : "/tmp";
}

Test(fuzz_corpus, every_case_replays_clean_on_ref) {
  char **dirs = NULL;
  int n = tw_golden_list_cases(CORPUS, &dirs);
  cr_assert(n >= 10, "corpus has %d cases (%s)", n, tw_last_error());
  int failed = 0;
  for (int i = 0; i < n; i++) {
    fz_result r;
    int rc = fz_replay(dirs[i], TW_BACKEND_REF, NULL, &r);
    if (rc != 0) {
      failed++;
      cr_log_error("%s: %s", dirs[i], r.message);
    }
  }
  tw_golden_free_list(dirs, n);
  cr_assert_eq(failed, 0, "%d of %d corpus cases fail on ref", failed, n);
}

Test(fuzz_corpus, planted_regressions_still_catch_their_bug) {
  char **dirs = NULL;
  int n = tw_golden_list_cases(CORPUS, &dirs), planted = 0;
  cr_assert(n > 0);
  for (int i = 0; i < n; i++) {
    fz_case c;
    cr_assert_eq(fz_case_read(dirs[i], &c), TW_OK, "%s: %s", dirs[i], tw_last_error());
    if (c.plant[0]) {
      planted++;
      fz_result r;
      cr_expect_eq(fz_replay(dirs[i], TW_BACKEND_REF, c.plant, &r), 1, "%s no longer catches %s", dirs[i], c.plant);
      cr_expect(fz_case_elements(&c) <= 300, "%s has %lld elements", dirs[i], (long long)fz_case_elements(&c));
    }
    fz_case_free(&c);
  }
  tw_golden_free_list(dirs, n);
  cr_assert_eq(planted, fz_plant_count(), "one shrunk regression per planted bug, found %d", planted);
}

/* The sharded corpus cases (rule, mesh and specs in case.txt) replay clean on ref: valid ones
 * on meshes of up to 8 thread ranks, invalid ones refused with the rule's error. */
Test(fuzz_corpus, sharded_cases_replay_clean_on_ref) {
  char **dirs = NULL;
  int n = tw_golden_list_cases(CORPUS, &dirs), sharded = 0, refused = 0, wide = 0, failed = 0;
  for (int i = 0; i < n; i++) {
    fz_case c;
    cr_assert_eq(fz_case_read(dirs[i], &c), TW_OK, "%s: %s", dirs[i], tw_last_error());
    if (c.sharded && !c.plant[0]) {
      sharded++;
      wide += tw_mesh_ranks(&c.mesh) >= 4;
      fz_result r;
      if (fz_replay(dirs[i], TW_BACKEND_REF, NULL, &r) != 0) {
        failed++;
        cr_log_error("%s: %s", dirs[i], r.message);
      }
      refused += r.expected_error;
    }
    fz_case_free(&c);
  }
  tw_golden_free_list(dirs, n);
  cr_assert_eq(failed, 0, "%d of %d sharded corpus cases fail on ref", failed, sharded);
  cr_assert(sharded >= 6 && refused >= 1 && wide >= 2, "sharded %d, refused %d, on >= 4 ranks %d", sharded, refused, wide);
}

/* FNV-1a over everything a case holds. */
static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}
static uint64_t case_hash(const fz_case *c) {
  uint64_t h = 0xCBF29CE484222325ull;
  int64_t dims[4] = {c->M, c->K, c->N, c->G};
  h = fnv(h, dims, sizeof dims);
  char desc[512];
  fz_case_describe(c, desc, sizeof desc);
  h = fnv(h, desc, strlen(desc));
  if (c->sharded) {
    char m[96], x[160], w[160];
    tw_mesh_str(&c->mesh, m, sizeof m);
    tw_pspec_str(&c->x_spec, x, sizeof x);
    tw_pspec_str(&c->w_spec, w, sizeof w);
    h = fnv(h, m, strlen(m));
    h = fnv(h, x, strlen(x));
    h = fnv(h, w, strlen(w));
    int64_t more[5] = {c->B, c->w_batched, c->fp8_inputs, c->quantize_before_gather, (int64_t)c->rule * 8 + c->pass};
    h = fnv(h, more, sizeof more);
  }
  if (c->group_sizes) h = fnv(h, c->group_sizes, sizeof(int32_t) * (size_t)c->G);
  if (c->x) h = fnv(h, c->x, sizeof(float) * (size_t)fz_numel_x(c));
  if (c->a) h = fnv(h, c->a, sizeof(float) * (size_t)fz_numel_a(c));
  if (c->b) h = fnv(h, c->b, sizeof(float) * (size_t)fz_numel_b(c));
  if (c->out_init) h = fnv(h, c->out_init, sizeof(float) * (size_t)fz_numel_out(c));
  if (c->scale) h = fnv(h, c->scale, sizeof(float) * (size_t)c->G);
  return h;
}

static uint64_t run_hash(uint64_t seed, int n) {
  uint64_t h = 0;
  for (int i = 0; i < n; i++) {
    fz_case c;
    cr_assert_eq(fz_generate(&c, (fz_op)(i % FZ_OP_COUNT), seed, (uint64_t)i), 0);
    h = h * 31 + case_hash(&c);
    fz_case_free(&c);
  }
  return h;
}

Test(fuzz_gen, same_seed_same_cases_on_any_machine) {
  uint64_t a = run_hash(1, 200), b = run_hash(1, 200), c = run_hash(2, 200);
  cr_assert_eq(a, b);
  cr_assert_neq(a, c);
  /* Pinned: the generator uses only its own PRNG and exact arithmetic, so this holds on every
   * machine. If you change the generator on purpose, update the constant (printed here). */
  cr_log_info("seed 1, 200 cases: fingerprint 0x%016llx", (unsigned long long)a);
  cr_assert_eq(a, FZ_SEED1_FINGERPRINT, "generator output changed: 0x%016llx", (unsigned long long)a);
}

static uint64_t sharded_run_hash(uint64_t seed, int n) {
  fz_mesh_opt mo;
  char err[200];
  cr_assert_eq(fz_mesh_opt_parse("all", &mo, err, sizeof err), 0);
  static const fz_op ops[4] = {FZ_QUANTIZE, FZ_GEMM, FZ_GROUPED_GEMM, FZ_WGRAD};
  uint64_t h = 0;
  for (int i = 0; i < n; i++) {
    fz_case c;
    cr_assert_eq(fz_generate_sharded(&c, ops[i % 4], seed, (uint64_t)i, &mo), 0);
    h = h * 31 + case_hash(&c);
    fz_case_free(&c);
  }
  return h;
}

Test(fuzz_gen, sharded_same_seed_same_cases_on_any_machine) {
  uint64_t a = sharded_run_hash(1, 200), b = sharded_run_hash(1, 200), c = sharded_run_hash(2, 200);
  cr_assert_eq(a, b);
  cr_assert_neq(a, c);
  cr_log_info("sharded, seed 1, 200 cases: fingerprint 0x%016llx", (unsigned long long)a);
  cr_assert_eq(a, FZ_SHARDED_SEED1_FINGERPRINT, "sharded generator output changed: 0x%016llx", (unsigned long long)a);
}

/* The sharded generator draws what it should: every rule and pass, 1-8 ranks, ep blocks,
 * fp8 inputs, and invalid cases of several rules. */
Test(fuzz_gen, sharded_generator_reaches_the_rules) {
  fz_mesh_opt mo;
  char err[200];
  cr_assert_eq(fz_mesh_opt_parse("all", &mo, err, sizeof err), 0);
  int ranks[9] = {0}, passes[3][3] = {{0}}, fp8_pass[3] = {0}, fp8 = 0, qbg = 0, ep_blocks = 0, invalid = 0, rule_errors = 0, batched = 0;
  static const fz_op ops[4] = {FZ_QUANTIZE, FZ_GEMM, FZ_GROUPED_GEMM, FZ_WGRAD};
  for (int i = 0; i < 2000; i++) {
    fz_case c;
    cr_assert_eq(fz_generate_sharded(&c, ops[i % 4], 7, (uint64_t)i, &mo), 0);
    int r = tw_mesh_ranks(&c.mesh);
    cr_assert(r >= 1 && r <= 8);
    ranks[r]++;
    passes[c.rule][c.pass]++;
    fp8 += c.fp8_inputs;
    fp8_pass[c.pass] += c.fp8_inputs;
    qbg += c.quantize_before_gather;
    batched += c.B > 0;
    ep_blocks += strstr(c.note, "ep_blocks") != NULL;
    const char *e = fz_shard_expected_error(&c);
    invalid += e != NULL;
    rule_errors += e && strncmp(e, "rule", 4) == 0;
    fz_case_free(&c);
  }
  cr_expect(ranks[1] > 50 && ranks[2] > 200 && ranks[4] > 200 && ranks[8] > 200, "1: %d 2: %d 4: %d 8: %d", ranks[1],
            ranks[2], ranks[4], ranks[8]);
  for (int p = 0; p < 3; p++) cr_expect(passes[TW_SHARD_DENSE][p] > 50 && passes[TW_SHARD_GROUPED_GEMM][p] > 50);
  cr_expect(passes[TW_SHARD_GROUPED_QUANTIZE][0] == 500);
  cr_expect(fp8 > 20 && qbg > 10 && batched > 50 && ep_blocks > 50, "fp8 %d qbg %d batched %d ep_blocks %d", fp8, qbg,
            batched, ep_blocks);
  for (int p = 0; p < 3; p++) cr_expect(fp8_pass[p] > 10, "fp8 inputs in the %s pass: %d", tw_pass_name((tw_pass)p), fp8_pass[p]);
  cr_expect(invalid > 100 && invalid < 400 && rule_errors > 50, "invalid %d (rules %d)", invalid, rule_errors);
}

Test(fuzz_gen, generators_reach_the_edges) {
  int zero_group = 0, one_row = 0, tail = 0, edge = 0, specials = 0, empty = 0, modes[TW_SCALE_COUNT] = {0};
  for (int i = 0; i < 1500; i++) {
    fz_case c;
    fz_op op = (fz_op)(i % FZ_OP_COUNT);
    cr_assert_eq(fz_generate(&c, op, 3, (uint64_t)i), 0);
    int64_t S = 0;
    for (int64_t g = 0; g < c.G; g++) {
      zero_group += c.group_sizes[g] == 0;
      one_row += c.group_sizes[g] == 1;
      int32_t m = c.group_sizes[g];
      edge += m == 17 || m == 33 || m == 63 || m == 127 || m == 129 || m == 255 || m == 257;
      S += m;
    }
    tail += c.G > 0 && S < c.M;
    empty += fz_numel_a(&c) + fz_numel_x(&c) == 0;
    if (op == FZ_QUANTIZE) {
      modes[c.mode]++;
      for (int64_t k = 0; k < c.M * c.K; k++) specials += c.x[k] != c.x[k] || c.x[k] - c.x[k] != 0;
    }
    fz_case_free(&c);
  }
  cr_expect(zero_group > 50 && one_row > 50 && tail > 30 && edge > 30 && specials > 10 && empty > 3,
            "zero %d one %d tail %d edge %d specials %d empty %d", zero_group, one_row, tail, edge, specials, empty);
  for (int m = TW_SCALE_TENSOR_CURRENT; m < TW_SCALE_COUNT; m++) cr_expect(modes[m] > 20, "mode %d: %d", m, modes[m]);
}

Test(fuzz_repro, write_then_read_round_trips) {
  char dir[512];
  for (int op = 0; op < FZ_OP_COUNT; op++) {
    snprintf(dir, sizeof dir, "%s/rt-%d", tmp_root(), op);
    fz_case c, d;
    cr_assert_eq(fz_generate(&c, (fz_op)op, 11, 5), 0);
    cr_assert_eq(fz_case_write(dir, &c, "ref", NULL), TW_OK, "%s", tw_last_error());
    cr_assert_eq(fz_case_read(dir, &d), TW_OK, "%s", tw_last_error());
    c.note[0] = d.note[0] = 0; /* the note is informational */
    cr_assert_eq(case_hash(&c), case_hash(&d), "op %d", op);
    fz_result r1, r2;
    tw_ctx *ctx;
    tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
    cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
    cr_assert_eq(fz_run_case(ctx, ctx, &c, &r1), fz_run_case(ctx, ctx, &d, &r2));
    cr_assert_eq(r1.nchecks, r2.nchecks);
    tw_ctx_destroy(ctx);
    fz_case_free(&c);
    fz_case_free(&d);
  }
}

Test(fuzz_repro, sharded_write_then_read_round_trips) {
  char dir[512];
  fz_mesh_opt mo;
  char err[200];
  cr_assert_eq(fz_mesh_opt_parse("all", &mo, err, sizeof err), 0);
  tw_ctx *ctx;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
  char e2[200];
  fz_shard_env *env = fz_shard_env_open(TW_BACKEND_REF, NULL, ctx, e2, sizeof e2);
  cr_assert(env, "%s", e2);
  static const fz_op ops[4] = {FZ_QUANTIZE, FZ_GEMM, FZ_GROUPED_GEMM, FZ_WGRAD};
  for (int i = 0; i < 12; i++) {
    snprintf(dir, sizeof dir, "%s/srt-%d", tmp_root(), i);
    fz_case c, d;
    cr_assert_eq(fz_generate_sharded(&c, ops[i % 4], 11, (uint64_t)i, &mo), 0);
    cr_assert_eq(fz_case_write(dir, &c, "ref", NULL), TW_OK, "%s", tw_last_error());
    cr_assert_eq(fz_case_read(dir, &d), TW_OK, "%s", tw_last_error());
    cr_assert(d.sharded);
    c.note[0] = d.note[0] = 0;
    cr_assert_eq(case_hash(&c), case_hash(&d), "case %d", i);
    fz_result r1, r2;
    cr_assert_eq(fz_run_sharded(env, &c, &r1), FZ_PASS, "%s", r1.message);
    cr_assert_eq(fz_run_sharded(env, &d, &r2), FZ_PASS, "%s", r2.message);
    cr_assert_eq(r1.nchecks, r2.nchecks);
    fz_case_free(&c);
    fz_case_free(&d);
  }
  fz_shard_env_close(env);
  tw_ctx_destroy(ctx);
}

Test(fuzz_repro, hostile_case_files_are_errors) {
  char dir[512], path[600];
  snprintf(dir, sizeof dir, "%s/hostile", tmp_root());
  cr_assert_eq(fz_mkdir_p(dir), 0);
  const char *bodies[] = {"op = nope\n", "op = quantize\nM = -3\n", "garbage line\n",
                          "op = gemm\nM = 2\nK = 2\nN = 2\n" /* no a.npy */,
                          "op = quantize\nM = 4\nK = 2\nG = 1\nmode = current\n" /* no arrays */,
                          "op = gemm\nsharded = 1\nrule = conv\nmesh = dp=2\nx_spec = [dp, None]\n",
                          "op = gemm\nsharded = 1\nrule = dense\nmesh = xp=2\nx_spec = [None, None]\n",
                          "op = gemm\nsharded = 1\nrule = dense\nmesh = dp=100,tp=100\nx_spec = [None, None]\n",
                          "op = gemm\nsharded = 1\nrule = dense\nmesh = dp=2\nx_spec = [dp, (]\nw_spec = [None, None]\n",
                          "op = gemm\nsharded = 1\nrule = dense\npass = sideways\nmesh = dp=2\n"};
  for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
    snprintf(path, sizeof path, "%s/case.txt", dir);
    FILE *f = fopen(path, "w");
    fputs(bodies[i], f);
    fclose(f);
    fz_case c;
    cr_expect_neq(fz_case_read(dir, &c), TW_OK, "case %zu was accepted", i);
  }
  /* an inconsistent case (groups summing past M) is an error verdict, never a crash */
  fz_case c;
  cr_assert_eq(fz_generate(&c, FZ_GROUPED_GEMM, 4, 1), 0);
  c.group_sizes[0] = (int32_t)c.M + 1;
  tw_ctx *ctx;
  tw_ctx_config cfg = TW_CTX_CONFIG_INIT;
  cr_assert_eq(tw_ctx_create(&ctx, &cfg), TW_OK);
  fz_result r;
  cr_assert_eq(fz_run_case(ctx, ctx, &c, &r), FZ_ERROR);
  tw_ctx_destroy(ctx);
  fz_case_free(&c);
}

static int run_cli(const char *a0, const char *a1, const char *a2, const char *a3, const char *a4) {
  char *argv[6] = {(char *)"fuzz", (char *)a0, (char *)a1, (char *)a2, (char *)a3, (char *)a4};
  int argc = 1;
  while (argc < 6 && argv[argc]) argc++;
  return tw_fuzz_main(argc, argv);
}

Test(fuzz_cli, bad_arguments_are_usage_errors) {
  cr_assert_eq(run_cli("--backend", "tpu", NULL, NULL, NULL), 2);
  cr_assert_eq(run_cli("--op", "conv", NULL, NULL, NULL), 2);
  cr_assert_eq(run_cli("--seconds", "-1", NULL, NULL, NULL), 2);
  cr_assert_eq(run_cli("--seconds", "1", "--cases", "3", NULL), 2);
  cr_assert_eq(run_cli("--plant", "no_such_bug", "--cases", "1", NULL), 2);
  cr_assert_eq(run_cli("--frobnicate", NULL, NULL, NULL, NULL), 2);
  cr_assert_eq(run_cli("--replay", "/nonexistent/dir", NULL, NULL, NULL), 2);
  cr_assert_eq(run_cli("--list", NULL, NULL, NULL, NULL), 0);
}

/* Runs the CLI with stderr captured; returns the exit code, stderr's text in err. */
static int run_cli_err(char *err, size_t n, const char *a0, const char *a1, const char *a2, const char *a3) {
  char path[512];
  snprintf(path, sizeof path, "%s/cli-stderr.txt", tmp_root());
  fflush(stderr);
  int saved = dup(2), fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
  cr_assert(saved >= 0 && fd >= 0);
  dup2(fd, 2);
  close(fd);
  int rc = run_cli(a0, a1, a2, a3, NULL);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  FILE *f = fopen(path, "r");
  size_t got = f ? fread(err, 1, n - 1, f) : 0;
  err[got] = 0;
  if (f) fclose(f);
  return rc;
}

Test(fuzz_cli, bad_mesh_is_a_usage_error_with_a_message) {
  static const struct { const char *mesh, *says; } bad[] = {
      {"xp=2", "unknown axis 'xp'"},
      {"dp=2,dp=2", "appears twice"},
      {"dp=0", "size 0"},
      {"dp=2;ep=2", "expected ','"},
      {"dp", "expected axis=size"},
      {"dp=16,ep=16", "at most 64"},
      {"", "--mesh needs a value"},
  };
  char err[2048];
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = run_cli_err(err, sizeof err, "--mesh", bad[i].mesh, "--cases", "1");
    cr_expect_eq(rc, 2, "--mesh '%s': exit %d", bad[i].mesh, rc);
    cr_expect(strstr(err, "twin fuzz: ") && strstr(err, bad[i].says), "--mesh '%s': stderr '%s' lacks '%s'", bad[i].mesh,
              err, bad[i].says);
  }
  cr_expect_eq(run_cli_err(err, sizeof err, "--cases", "1", "--mesh", NULL), 2); /* no value */
  cr_expect(strstr(err, "--mesh needs a value"), "%s", err);
  cr_expect_eq(run_cli_err(err, sizeof err, "--op", "cast", "--mesh", "all"), 2);
  cr_expect(strstr(err, "cast has none"), "%s", err);
  cr_expect_eq(run_cli_err(err, sizeof err, "--plant", "reduce_scatter_shifted", "--cases", "1"), 2);
  cr_expect(strstr(err, "add --mesh all"), "%s", err);
  cr_expect_eq(run_cli_err(err, sizeof err, "--backend", "gpu", "--mesh", "all"), 2);
  cr_expect(strstr(err, "gpu"), "%s", err);
}

Test(fuzz_cli, good_meshes_run) {
  char out[512];
  snprintf(out, sizeof out, "%s/mesh-cli", tmp_root());
  cr_assert_eq(run_cli("--mesh", "all", "--cases", "40", "--out"), 2); /* --out without a value */
  char *argv[] = {(char *)"fuzz", (char *)"--mesh", (char *)"dp=3,ep=2", (char *)"--cases", (char *)"24",
                  (char *)"--out", out, (char *)"--quiet"};
  cr_assert_eq(tw_fuzz_main(8, argv), 0);
  char *argv1[] = {(char *)"fuzz", (char *)"--mesh", (char *)"1", (char *)"--cases", (char *)"8", (char *)"--out", out,
                   (char *)"--quiet"};
  cr_assert_eq(tw_fuzz_main(8, argv1), 0);
}

Test(fuzz_cli, gpu_backend_absent_is_a_clear_error) {
  cr_assert_eq(run_cli("--backend", "gpu", "--cases", "1", NULL), 2);
}

Test(fuzz_run, each_case_is_on_disk_before_it_runs) {
  char out[512], cur[600];
  snprintf(out, sizeof out, "%s/run-out", tmp_root());
  fz_options o;
  fz_options_default(&o);
  o.cases = 7;
  o.seed = 5;
  o.out_dir = out;
  o.quiet = 1;
  fz_summary s;
  cr_assert_eq(fz_run(&o, &s), 0);
  cr_assert_eq(s.cases, 7);
  /* the last case written is case 6, whole */
  snprintf(cur, sizeof cur, "%s/current", out);
  fz_case c, d;
  cr_assert_eq(fz_case_read(cur, &c), TW_OK, "%s", tw_last_error());
  cr_assert_eq(fz_generate(&d, (fz_op)(6 % FZ_OP_COUNT), 5, 6), 0);
  c.note[0] = d.note[0] = 0;
  cr_assert_eq(case_hash(&c), case_hash(&d));
  fz_case_free(&c);
  fz_case_free(&d);
}
