/* The sharded EP sweep over NCCL on GPUs (issue 17): every mesh of 1, 2, 4 and 8 ranks over
 * (dp, fsdp, ep, tp), every token spec the EP rules accept that differs in effect on the mesh,
 * five routing distributions (uniform, one hot expert, all to one expert, half the experts
 * idle, no tokens), with each EP version forced (ep_nccl_slots; ep_nccl_lsa where ep > 1). Rank
 * r runs on GPU r over its NCCL communicator, its mesh communicators split from it (tw_mesh_comms), and
 * checks dispatch -> expert fn -> combine, dispatch_bwd and combine_bwd (d_expert_out and the
 * dots too) bit for bit against the unsharded formula (tests/shard_ep_cases.c); then tokens
 * are conserved over all ranks: every (token, expert) route arrives once per replica group.
 *   shard_ep_gpu/every_mesh_of_N_gpus (N = 1, 2, 4, 8): one process, one thread per GPU (needs
 *     N GPUs; skipped, saying so, where fewer are visible);
 *   shard_ep_gpu_proc/one_process_per_gpu: one process per GPU (the largest power of two of the
 *     visible GPUs, up to 8), each rank over tw_comm_init_nccl_rank; each child checks its rank
 *     and leaves its route record in a file, from which the launcher checks conservation;
 *   shard_ep_gpu_proc/rank_of_one_process_per_gpu: one such rank (also under `mpirun -np N`
 *     with TWIN_SHARD_EP_CHILD=1 and TWIN_COMM_ID_FILE set; conservation then needs
 *     TWIN_PROC_DIR and the launcher's check, so under mpirun each rank's check is the proof). */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/proc_util.h"
#include "tests/shard_ep_cases.h"
#include "tests/test_util.h"
#include "twin/tw_comm.h"

static const char *versions[2] = {"ep_nccl_slots", "ep_nccl_lsa"};

/* ep_nccl_lsa needs an EP group of 2+ ranks: NCCL (2.28.3) registers no symmetric window on a
 * one-rank communicator, so where ep = 1 only ep_nccl_slots runs (auto picks it there anyway). */
static int version_runs(const int sizes[4], int v) { return v == 0 || sizes[2] > 1; }

/* The cases of one mesh: every spec x distribution, dtypes alternating. */
static int mesh_cases(const int sizes[4], int mesh_index, sep_case **out) {
  const char *specs[5];
  int ns = sep_specs(sizes, specs), n = 0;
  sep_case *c = calloc((size_t)ns * SEP_DISTS, sizeof *c);
  for (int sp = 0; sp < ns; sp++)
    for (int d = 0; d < SEP_DISTS; d++, n++)
      sep_case_make(&c[n], sizes, specs[sp], d, (mesh_index + sp + d) % 2 ? TW_BF16 : TW_F32,
                    0x5e9000ull + (uint64_t)mesh_index * 100 + (uint64_t)(sp * 10 + d));
  *out = c;
  return n;
}

typedef struct {
  sep_case *cases;
  int n;
  const char *kernel;
  int device; /* -1: rank r on GPU r; else this process's GPU */
  char err[SEP_MAXR][400];
} mesh_job;

/* One rank: a context on its GPU with the EP version forced, the mesh's communicators, then
 * every case of the mesh in order (the peers run the same collectives in the same order). */
static tw_status mesh_rank(int rank, tw_comm *world, void *arg) {
  mesh_job *j = arg;
  tw_ctx *ctx = NULL;
  tw_mesh_comms *mc = NULL;
  tw_ctx_config cc = TW_CTX_CONFIG_INIT;
  cc.backend = TW_BACKEND_GPU;
  cc.device = j->device < 0 ? rank : j->device;
  cc.comm = world;
  cc.kernel = j->kernel;
  tw_status s = tw_ctx_create(&ctx, &cc);
  if (s == TW_OK) s = tw_mesh_comms_create(ctx, &j->cases[0].mesh, &mc);
  int i = 0;
  for (; i < j->n && s == TW_OK; i++) s = sep_rank_case(ctx, world, mc, &j->cases[i], rank);
  if (s != TW_OK) {
    char name[160] = "setup";
    if (i > 0) sep_case_str(&j->cases[i - 1], name, sizeof name);
    snprintf(j->err[rank], sizeof j->err[rank], "case %d (%s): %s", i - 1, name, tw_last_error());
  }
  tw_mesh_comms_destroy(mc);
  tw_ctx_destroy(ctx);
  return s;
}

/* the rank's results of one mesh: 1 per case that passed on this rank */
static int rank_results(const mesh_job *j, int rank, const char *kernel) {
  int ok = 0;
  char name[160];
  for (int i = 0; i < j->n; i++) {
    if (!j->cases[i].msg[rank][0]) { ok++; continue; }
    cr_log_error("%s %s, rank %d: %s", kernel, sep_case_str(&j->cases[i], name, sizeof name), rank,
                 j->cases[i].msg[rank]);
  }
  return ok;
}

static void every_mesh(int n) {
  TT_NEED_GPUS(n);
  tw_comm *comms[SEP_MAXR];
  int devs[SEP_MAXR], sizes[32][4];
  for (int r = 0; r < n; r++) devs[r] = r;
  cr_assert_eq(tw_comm_init_nccl_local(n, devs, comms), TW_OK, "%s", tw_last_error());
  for (int r = 0; r < n; r++) tw_comm_set_timeout(comms[r], 60.0);
  int meshes = sep_meshes(n, sizes), runs = 0, passed = 0, lsa_meshes = 0;
  for (int m = 0; m < meshes; m++)
    for (int v = 0; v < 2; v++) {
      if (!version_runs(sizes[m], v)) continue;
      lsa_meshes += v;
      mesh_job j;
      memset(&j, 0, sizeof j);
      j.n = mesh_cases(sizes[m], m, &j.cases);
      j.kernel = versions[v];
      j.device = -1;
      char mb[64];
      tw_mesh_str(&j.cases[0].mesh, mb, sizeof mb);
      tt_stall_watch_start(mb);
      tw_status s = tw_run_ranks(n, comms, mesh_rank, &j);
      tt_stall_watch_stop();
      for (int r = 0; r < n; r++)
        cr_assert(!j.err[r][0], "%s on mesh %s, rank %d: %s", versions[v], mb, r, j.err[r]);
      cr_assert_eq(s, TW_OK, "%s on mesh %s: %s", versions[v], mb, tw_last_error());
      for (int i = 0; i < j.n; i++) {
        int ok = 1;
        for (int r = 0; r < n; r++) ok &= !j.cases[i].msg[r][0];
        char why[200], name[160];
        if (!sep_conserved(&j.cases[i], why, sizeof why)) {
          cr_log_error("%s %s: %s", versions[v], sep_case_str(&j.cases[i], name, sizeof name), why);
          ok = 0;
        }
        passed += ok;
        runs++;
      }
      for (int r = 0; r < n; r++) rank_results(&j, r, versions[v]); /* logs each rank's failures once */
      free(j.cases);
    }
  for (int r = 0; r < n; r++) tw_comm_destroy(comms[r]);
  cr_log_info("sharded EP over NCCL on %d GPUs: %d meshes (ep_nccl_slots on all, ep_nccl_lsa on the %d with ep > 1) "
              "x specs x distributions = %d runs, %d passed", n, meshes, lsa_meshes, runs, passed);
  cr_assert_eq(passed, runs, "%d of %d sharded EP runs on %d GPUs differ from the formula (above)", runs - passed,
               runs, n);
}

/* one GPU: the one mesh, its steps with no tokens at all (max_tokens 0) included */
Test(shard_ep_gpu, every_mesh_of_1_gpu, .timeout = 600) { every_mesh(1); }
Test(shard_ep_gpu, every_mesh_of_2_gpus, .timeout = 600) { every_mesh(2); }
Test(shard_ep_gpu, every_mesh_of_4_gpus, .timeout = 600) { every_mesh(4); }
Test(shard_ep_gpu, every_mesh_of_8_gpus, .timeout = 600) { every_mesh(8); }

/* ---- one process per GPU ------------------------------------------------------------------ */
static int proc_world(void) {
  int n = tw_gpu_device_count(), p = 1;
  while (p * 2 <= n && p * 2 <= SEP_MAXR) p *= 2;
  return p;
}

Test(shard_ep_gpu_proc, rank_of_one_process_per_gpu, .timeout = 900) {
  if (!getenv("TWIN_SHARD_EP_CHILD"))
    cr_skip_test("one rank of shard_ep_gpu_proc/one_process_per_gpu (or of `mpirun -np N` with "
                 "TWIN_SHARD_EP_CHILD=1 and TWIN_COMM_ID_FILE set)");
  int rank, size, local;
  tw_comm *comm = tt_proc_child_comm(SEP_MAXR, &rank, &size, &local);
  cr_assert((size & (size - 1)) == 0, "%d ranks: this test takes 1, 2, 4 or 8", size);
  FILE *rec = NULL;
  const char *dir = getenv("TWIN_PROC_DIR");
  if (dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/seen.%d", dir, rank);
    rec = fopen(path, "wb");
    cr_assert(rec, "cannot write %s", path);
  }
  int sizes[32][4], meshes = sep_meshes(size, sizes), runs = 0, passed = 0;
  for (int m = 0; m < meshes; m++)
    for (int v = 0; v < 2; v++) {
      if (!version_runs(sizes[m], v)) continue;
      mesh_job j;
      memset(&j, 0, sizeof j);
      j.n = mesh_cases(sizes[m], m, &j.cases);
      j.kernel = versions[v];
      j.device = local;
      tw_status s = mesh_rank(rank, comm, &j);
      cr_assert_eq(s, TW_OK, "%s, rank %d of %d processes: %s", versions[v], rank, size, j.err[rank]);
      passed += rank_results(&j, rank, versions[v]);
      runs += j.n;
      for (int i = 0; i < j.n && rec; i++)
        cr_assert_eq(fwrite(j.cases[i].seen[rank], sizeof j.cases[i].seen[rank], 1, rec), 1u);
      free(j.cases);
    }
  if (rec) fclose(rec);
  tw_comm_destroy(comm);
  cr_log_info("sharded EP, rank %d of %d processes (GPU %d): %d runs over both versions, %d passed", rank, size,
              local, runs, passed);
  cr_assert_eq(passed, runs, "rank %d: %d of %d runs differ from the formula (above)", rank, runs - passed, runs);
}

Test(shard_ep_gpu_proc, one_process_per_gpu, .timeout = 900) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  int n = proc_world();
  if (tw_gpu_device_count() < 1) cr_skip_test("needs a GPU, sees none");
  char dir[64];
  int bad = tt_proc_run(n, "TWIN_SHARD_EP_CHILD", "shard_ep_gpu_proc/rank_of_one_process_per_gpu", 600, dir);
  /* conservation over the processes' records, case by case in the children's order */
  FILE *rec[SEP_MAXR];
  for (int r = 0; r < n; r++) {
    char path[512];
    snprintf(path, sizeof path, "%s/seen.%d", dir, r);
    rec[r] = fopen(path, "rb");
  }
  int sizes[32][4], meshes = sep_meshes(n, sizes), runs = 0, conserved = 0, missing = 0;
  for (int m = 0; m < meshes && !bad; m++)
    for (int v = 0; v < 2; v++) {
      if (!version_runs(sizes[m], v)) continue;
      sep_case *cases;
      int nc = mesh_cases(sizes[m], m, &cases);
      for (int i = 0; i < nc; i++, runs++) {
        for (int r = 0; r < n; r++)
          if (!rec[r] || fread(cases[i].seen[r], sizeof cases[i].seen[r], 1, rec[r]) != 1) missing = 1;
        char why[200], name[160];
        if (!missing && sep_conserved(&cases[i], why, sizeof why)) conserved++;
        else if (!missing) cr_log_error("%s %s: %s", versions[v], sep_case_str(&cases[i], name, sizeof name), why);
      }
      free(cases);
    }
  for (int r = 0; r < n; r++)
    if (rec[r]) fclose(rec[r]);
  tt_proc_cleanup(dir);
  cr_assert_eq(bad, 0, "%d of %d rank processes failed (their output is above)", bad, n);
  cr_assert(!missing, "a rank's route record is missing or short");
  cr_log_info("sharded EP, %d processes (one per GPU): %d runs, tokens conserved in %d", n, runs, conserved);
  cr_assert_eq(conserved, runs, "tokens not conserved in %d of %d runs (above)", runs - conserved, runs);
}
