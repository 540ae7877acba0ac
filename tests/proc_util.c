/* One process per GPU (proc_util.h). */
#include "tests/proc_util.h"

#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

void tt_proc_exchange_id(int rank, tw_comm_id *id) {
  const char *path = getenv("TWIN_COMM_ID_FILE");
  cr_assert(path && *path, "TWIN_COMM_ID_FILE is not set (the file through which rank 0 hands out the NCCL id)");
  if (rank == 0) {
    cr_assert_eq(tw_comm_nccl_get_id(id), TW_OK, "%s", tw_last_error());
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    cr_assert(f && fwrite(id->bytes, 1, sizeof id->bytes, f) == sizeof id->bytes && fclose(f) == 0,
              "cannot write %s", tmp);
    cr_assert_eq(rename(tmp, path), 0, "cannot rename %s to %s", tmp, path);
    return;
  }
  for (int waited_ms = 0;; waited_ms += 10) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t got = fread(id->bytes, 1, sizeof id->bytes, f);
      fclose(f);
      if (got == sizeof id->bytes) return;
    }
    cr_assert(waited_ms < 60000, "rank %d: no NCCL id in %s after 60 s", rank, path);
    usleep(10000);
  }
}

tw_comm *tt_proc_child_comm(int max_ranks, int *rank, int *size, int *local) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  cr_assert_eq(tw_comm_env_rank(rank, size, local), 0, "no rank/size in the environment (TWIN_RANK, ...)");
  cr_assert(*size >= 1 && *size <= max_ranks && *rank >= 0 && *rank < *size, "rank %d of %d (this test takes 1..%d)",
            *rank, *size, max_ranks);
  tw_comm_id id;
  tt_proc_exchange_id(*rank, &id);
  tw_comm *comm;
  cr_assert_eq(tw_comm_init_nccl_rank(&id, *size, *rank, *local, 60.0, &comm), TW_OK, "rank %d: %s", *rank,
               tw_last_error());
  tw_comm_set_timeout(comm, 60.0);
  return comm;
}

int tt_proc_run(int n, const char *child_flag, const char *child_test, int timeout_s, char dir[64]) {
  snprintf(dir, 64, "/tmp/twin-proc-XXXXXX");
  cr_assert(mkdtemp(dir), "mkdtemp failed");
  char envs[6][160];
  extern char **environ;
  int ne = 0;
  while (environ[ne]) ne++;
  char **env = calloc((size_t)ne + 8, sizeof *env);
  pid_t *pids = calloc((size_t)n, sizeof *pids);
  for (int r = 0; r < n; r++) {
    int k = 0;
    /* the children must not overwrite this process's XML report, nor take this test's worker's
     * BoxFort map (BXFI_MAP: a child that sees it runs as that sandboxed worker and aborts) */
    for (int i = 0; i < ne; i++)
      if (strncmp(environ[i], "XML_OUTPUT_FILE=", 16) && strncmp(environ[i], "TWIN_RANK=", 10) &&
          strncmp(environ[i], "TWIN_WORLD_SIZE=", 16) && strncmp(environ[i], "TWIN_LOCAL_RANK=", 16) &&
          strncmp(environ[i], "BXFI_", 5) && strncmp(environ[i], "TWIN_COMM_ID_FILE=", 18) &&
          strncmp(environ[i], "TWIN_PROC_DIR=", 14) &&
          !(strncmp(environ[i], child_flag, strlen(child_flag)) == 0 && environ[i][strlen(child_flag)] == '='))
        env[k++] = environ[i];
    snprintf(envs[0], sizeof envs[0], "%s=1", child_flag);
    snprintf(envs[1], sizeof envs[1], "TWIN_RANK=%d", r);
    snprintf(envs[2], sizeof envs[2], "TWIN_WORLD_SIZE=%d", n);
    snprintf(envs[3], sizeof envs[3], "TWIN_LOCAL_RANK=%d", r);
    snprintf(envs[4], sizeof envs[4], "TWIN_COMM_ID_FILE=%s/nccl_id", dir);
    snprintf(envs[5], sizeof envs[5], "TWIN_PROC_DIR=%s", dir);
    for (int j = 0; j < 6; j++) env[k++] = envs[j];
    env[k] = NULL;
    char *argv[] = {(char *)"/proc/self/exe", (char *)"--filter", (char *)child_test, (char *)"-j1", NULL};
    cr_assert_eq(posix_spawn(&pids[r], "/proc/self/exe", NULL, NULL, argv, env), 0, "cannot start rank %d", r);
  }
  int bad = 0;
  long waited = 0; /* one deadline for all of them, in 10 ms steps */
  for (int r = 0; r < n; r++) {
    int status = 0;
    pid_t got;
    while ((got = waitpid(pids[r], &status, WNOHANG)) == 0) {
      if (waited++ > (long)timeout_s * 100) {
        for (int q = 0; q < n; q++) kill(pids[q], SIGKILL);
        got = waitpid(pids[r], &status, 0);
        break;
      }
      usleep(10000);
    }
    if (got != pids[r]) {
      bad++;
      cr_log_error("rank %d of %d: lost (waitpid)", r, n);
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      bad++;
      cr_log_error("rank %d of %d: %s %d", r, n, WIFEXITED(status) ? "exit status" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    }
  }
  free(env);
  free(pids);
  return bad;
}

void tt_proc_cleanup(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char p[512];
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
      snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
      unlink(p);
    }
  closedir(d);
  rmdir(dir);
}
