/* One process per GPU for the multi-GPU tests, as `mpirun -np N` starts them: the NCCL id handed
 * from rank 0 to the others through a file, and a launcher that starts N copies of the test
 * binary, each running one child test as one rank. */
#ifndef TWIN_TESTS_PROC_UTIL_H
#define TWIN_TESTS_PROC_UTIL_H

#include "twin/tw_comm.h"

/* The NCCL id through the file TWIN_COMM_ID_FILE: rank 0 makes it and writes it whole (by
 * rename), the others wait for it (60 s). One host, or a shared file system. Asserts. */
void tt_proc_exchange_id(int rank, tw_comm_id *id);

/* A child's side: rank, size and GPU from the environment (tw_comm_env_rank: TWIN_RANK,
 * TWIN_WORLD_SIZE, TWIN_LOCAL_RANK or mpirun's OMPI_COMM_WORLD_*), the NCCL id through
 * TWIN_COMM_ID_FILE, then its NCCL communicator (60 s timeout). NVLink multicast off unless the
 * environment says otherwise. Asserts 1 <= size <= max_ranks. */
tw_comm *tt_proc_child_comm(int max_ranks, int *rank, int *size, int *local);

/* Starts n processes of this binary, each `--filter child_test -j1` with child_flag=1,
 * TWIN_RANK=r, TWIN_WORLD_SIZE=n, TWIN_LOCAL_RANK=r, TWIN_COMM_ID_FILE=dir/nccl_id and
 * TWIN_PROC_DIR=dir in its environment (dir: a fresh directory, written to dir[64], where the
 * children may leave files for the caller), and waits for them (timeout_s, then kills them all).
 * Returns how many did not exit 0 (each logged). The caller removes dir with tt_proc_cleanup. */
int tt_proc_run(int n, const char *child_flag, const char *child_test, int timeout_s, char dir[64]);
void tt_proc_cleanup(const char *dir); /* removes dir's files and dir */

#endif
