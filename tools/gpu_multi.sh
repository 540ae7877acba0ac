#!/usr/bin/env bash
# One call on a machine of 2, 4 or 8 GPUs: every multi-GPU test and the multi-GPU benches, in
# phases that share the GPUs out so the call stays short. Usage (repo root, GPU machine):
#   tools/gpu_multi.sh BUNDLE_DIR OUT_DIR [SECONDS [PACK_DIR]]
# BUNDLE_DIR: tools/pack_gpu_bundle.sh's bund/. SECONDS (default 540): the whole budget; each
# step has its own cap below and is killed (rc 124) past it, so one hang costs one step.
# Writes OUT_DIR/summary.txt (a line per step) and a log per step; the benches' CSVs. PACK_DIR
# (the device tool's $OUT, which returns 8 files at most): after every step, summary.txt and
# logs.tgz of OUT_DIR there, so a call cut short still returns what ran.
#   phase 1 (2 GPUs each, side by side): EP on GPUs 0,1 (ep_size 2 sweep, both versions; one
#           process per GPU, by the test's own launcher and by mpirun); MoE and the pipeline
#           on GPUs 2,3 (skipped where only 2 GPUs exist: they run in phase 2 then)
#   phase 2 (4 GPUs): the pipeline S = 3, 4 and pp x fsdp and its goldens (alone), then EP
#           ep_size 4 beside MoE ep = 4 / dp x ep / fsdp x ep, 4 processes and `mpirun -np 4`,
#           shard_nccl, memcheck and racecheck of the 2-GPU EP sweep, every one-GPU EP case
#           the sharded EP sweep over NCCL (every mesh of 1, 2, 4 GPUs; 4 processes)
#   phase 2b (8 GPUs): EP ep_size 8, 8 processes, MoE ep = 8 / dp x ep / fsdp x ep = 2 x 4, the
#           sharded EP sweep on every mesh of 8 GPUs (one process; 8 processes; mpirun -np 8)
#   phase 3 (quiet machine): twin bench --op ep on 2, 4 (and 8) GPUs, --op moe with ep = 2
#           (and 8), --op pipeline at S = 4, the sharding check over NCCL on 2-4 (and 8) ranks
set -uo pipefail
B=${1:?bundle dir}; O=${2:?out dir}; budget=${3:-540}; P=${4:-}
mkdir -p "$O"
[ -e "$B/golden" ] || ln -s "$PWD/golden" "$B/golden" # a bundle packed with TW_BUNDLE_GOLDEN=repo
export NCCL_NVLS_ENABLE=0
export TWIN_EP_LSA_TIMEOUT_S=${TWIN_EP_LSA_TIMEOUT_S:-5}  # a stalled LSA barrier costs 5 s, once per context
t0=$(date +%s)
ngpu=$(nvidia-smi -L | wc -l)
left() { echo $((budget - ($(date +%s) - t0))); }
# step NAME CAP DEVICES CMD...: runs CMD under `timeout` with CUDA_VISIBLE_DEVICES=DEVICES.
# GPU_MULTI_ONLY (an extended regex over step names) runs the matching steps only, so a short
# call can take one slice of the list.
step() {
  local name=$1 cap=$2 devs=$3; shift 3
  if [ -n "${GPU_MULTI_ONLY:-}" ] && ! [[ $name =~ ^(${GPU_MULTI_ONLY})$ ]]; then return 0; fi
  local l; l=$(left)
  [ "$l" -gt 20 ] || { echo "$name: not run (budget spent)" >>"$O/summary.txt"; return; }
  [ "$cap" -lt "$l" ] || cap=$((l - 10))
  local s; s=$(date +%s)
  CUDA_VISIBLE_DEVICES=$devs timeout -k 5 "$cap" "$@" >"$O/$name.log" 2>&1 &
  local pid=$!
  # a step still running 8 s before its cap: every thread's stack of its processes first
  ( sleep $((cap > 16 ? cap - 8 : cap)); kill -0 $pid 2>/dev/null && dump_stacks $pid >"$O/$name.stacks" 2>&1 ) &
  local dog=$!
  wait $pid
  local r=$?
  kill $dog 2>/dev/null; wait $dog 2>/dev/null
  local pass; pass=$(grep -aoE 'Synthesis: Tested: [0-9]+ \| Passing: [0-9]+ \| Failing: [0-9]+ \| Crashing: [0-9]+' "$O/$name.log" | tail -1)
  printf '%-34s rc=%-3d %4ds  %s\n' "$name" "$r" $(($(date +%s) - s)) "$pass" >>"$O/summary.txt"
  pack
}
# the stacks of pid's process tree (gdb, else cuda-gdb; else the kernel's view)
dump_stacks() {
  local g; g=$(command -v gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
  local all="$1" kids="$1" k
  while [ -n "$kids" ]; do k=$(for p in $kids; do pgrep -P "$p"; done); kids=$k; all="$all $k"; done
  for p in $all; do
    echo "=== pid $p: $(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | cut -c1-200)"
    if [ -n "$g" ]; then timeout 20 "$g" -batch -p "$p" -ex 'thread apply all bt 30' 2>&1 | grep -E '^#|^Thread' | head -400
    else for t in /proc/$p/task/*; do echo "-- $t"; cat "$t/stack" 2>/dev/null; done; fi
  done
}
pack() {
  [ -n "$P" ] || return 0
  local t="$P/.logs.$BASHPID.tmp"; tar czf "$t" -C "$O" . 2>/dev/null && mv "$t" "$P/logs.tgz"
  cp "$O/summary.txt" "$P/summary.txt"
}
R="$B/run.sh"
{
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  nvidia-smi topo -m | head -8
  ls /usr/lib/x86_64-linux-gnu/libnccl.so.* 2>/dev/null | head -2
} >"$O/summary.txt" 2>&1
echo "gpus=$ngpu budget=${budget}s" >>"$O/summary.txt"

# ---- phase 1 ----
(
  step ep2_sweep 170 0,1 "$R" bin/ep_gpu_test --verbose -j2 --filter 'ep_gpu_2/*'
  step ep2_proc 60 0,1 "$R" bin/ep_gpu_test --verbose --filter 'ep_gpu_proc/one_process_per_gpu'
  rm -f /tmp/twin_mpi_id
  step ep2_mpirun 60 0,1 mpirun --allow-run-as-root --oversubscribe -np 2 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES \
    -x TWIN_EP_CHILD=1 -x TWIN_COMM_ID_FILE=/tmp/twin_mpi_id -x EP_PROC_N=40 \
    "$B/run.sh" bin/ep_gpu_test --verbose --filter 'ep_gpu_proc/rank_of_one_process_per_gpu'
) &
p1=$!
if [ "$ngpu" -ge 4 ]; then
  (
    step moe2 170 2,3 "$R" bin/moe_gpu_test --verbose -j2 --filter '*two_gpus*'
    PIPE_TIMEOUT_S=30 step pipe2 90 2,3 "$R" bin/pipeline_gpu_test --verbose -j1 --filter '*two_gpus*'
  ) &
  p2=$!
  wait $p2
fi
wait $p1
[ "$ngpu" -ge 4 ] || {
  step moe2 170 0,1 "$R" bin/moe_gpu_test --verbose -j2 --filter '*two_gpus*'
  step pipe2 90 0,1 "$R" bin/pipeline_gpu_test --verbose -j1 --filter '*two_gpus*'
}

# ---- phase 2 ----
if [ "$ngpu" -ge 4 ]; then
  all=0,1,2,3
  # The pipeline alone first (its S >= 3 runs once stalled beside EP and MoE: a cuBLASLt lazy
  # load, pipeline/README.md "Session 12"). A stall prints every thread's stack
  # (TWIN_STALL_DUMP_S, tests/test_util.h) before the step's cap.
  export TWIN_STALL_DUMP_S=${TWIN_STALL_DUMP_S:-40}
  PIPE_TIMEOUT_S=30 step pipe4 70 $all "$R" bin/pipeline_gpu_test --verbose -j1 --filter '*_gpus_nccl_*'
  PIPE_TIMEOUT_S=30 step pipe_goldens4 60 $all "$R" bin/pipeline_gpu_test --verbose --filter '*stored_goldens*'
  step ep4_sweep 170 $all "$R" bin/ep_gpu_test --verbose -j2 --filter 'ep_gpu_4/*' &
  step moe4 170 $all "$R" bin/moe_gpu_test --verbose --filter '*four_gpus*' &
  wait
  step ep4_proc 60 $all "$R" bin/ep_gpu_test --verbose --filter 'ep_gpu_proc/one_process_per_gpu' &
  ( rm -f /tmp/twin_mpi_id4
    step ep4_mpirun 90 $all mpirun --allow-run-as-root --oversubscribe -np 4 -x NCCL_NVLS_ENABLE -x CUDA_VISIBLE_DEVICES \
      -x TWIN_EP_CHILD=1 -x TWIN_COMM_ID_FILE=/tmp/twin_mpi_id4 -x EP_PROC_N=40 \
      "$B/run.sh" bin/ep_gpu_test --verbose --filter 'ep_gpu_proc/rank_of_one_process_per_gpu' ) &
  step shard_nccl 150 $all "$R" bin/shard_nccl_gpu_test --verbose -j1 &
  wait
  # the sharded EP sweep over NCCL: every mesh of 1, 2 and 4 GPUs; then one process per GPU
  step shard_ep4 150 $all "$R" bin/shard_ep_gpu_test --verbose -j1 --filter 'shard_ep_gpu/*'
  step shard_ep4_proc 120 $all "$R" bin/shard_ep_gpu_test --verbose --filter 'shard_ep_gpu_proc/one_process_per_gpu'
  TWIN_EP_LSA_TIMEOUT_S=60 EP_SWEEP_N=3 step ep2_memcheck 150 2,3 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
    "$B/run.sh" bin/ep_gpu_test -j1 --filter 'ep_gpu_2/*' &
  wait
  # every one-GPU EP case (ep_size 1, and 2 / 4 ranks on one GPU over loopback) beside the
  # 2-GPU racecheck: the slots staging changed (9028363) and these run every exchange path
  step ep1 170 0 "$R" bin/ep_gpu_test --verbose --filter 'ep_gpu/*' &
  TWIN_EP_LSA_TIMEOUT_S=60 EP_SWEEP_N=2 step ep2_racecheck 150 2,3 compute-sanitizer --tool racecheck --print-limit 20 \
    "$B/run.sh" bin/ep_gpu_test -j1 --filter 'ep_gpu_2/*' &
  wait
fi

# ---- phase 2 on a 2-GPU machine: the sanitizers on the 2-GPU sweep, the one-GPU EP cases ----
if [ "$ngpu" -lt 4 ]; then
  TWIN_EP_LSA_TIMEOUT_S=60 EP_SWEEP_N=3 step ep2_memcheck 150 0,1 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 \
    "$B/run.sh" bin/ep_gpu_test -j1 --filter 'ep_gpu_2/*'
  TWIN_EP_LSA_TIMEOUT_S=60 EP_SWEEP_N=2 step ep2_racecheck 150 0,1 compute-sanitizer --tool racecheck --print-limit 20 \
    "$B/run.sh" bin/ep_gpu_test -j1 --filter 'ep_gpu_2/*'
  step ep1 170 0 "$R" bin/ep_gpu_test --verbose --filter 'ep_gpu/*'
  # ep_nccl_lsa's kernels (every op, backward included) with 2 and 4 ranks on one GPU
  TWIN_EP_LSA_TIMEOUT_S=60 EP_SWEEP_N=12 step ep1_lsa_memcheck 120 0 compute-sanitizer --tool memcheck \
    --report-api-errors no --print-limit 20 "$B/run.sh" bin/ep_gpu_test -j1 \
    --filter 'ep_gpu/random_cases_ep_size_2_and_4_on_one_gpu_loopback_lsa_forced'
  step sharding2 60 0,1 "$R" bin/twin check --sharding --backend gpu --min-ranks 2 --max-ranks 2
fi

# ---- phase 2b (8 GPUs): EP ep_size 8, one process per GPU (8), MoE ep = 8 / 2 x 4 ----
if [ "$ngpu" -ge 8 ]; then
  all8=0,1,2,3,4,5,6,7
  step ep8_sweep 170 $all8 "$R" bin/ep_gpu_test --verbose -j2 --filter 'ep_gpu_8/*' &
  step moe8 170 $all8 "$R" bin/moe_gpu_test --verbose --filter '*eight_gpus*' &
  wait
  step ep8_proc 90 $all8 "$R" bin/ep_gpu_test --verbose --filter 'ep_gpu_proc/one_process_per_gpu'
  step shard_ep8 240 $all8 "$R" bin/shard_ep_gpu_test --verbose -j1 --filter 'shard_ep_gpu/every_mesh_of_8_gpus'
  step shard_ep8_proc 240 $all8 "$R" bin/shard_ep_gpu_test --verbose --filter 'shard_ep_gpu_proc/one_process_per_gpu'
  ( rm -f /tmp/twin_mpi_id8
    step shard_ep8_mpirun 240 $all8 mpirun --allow-run-as-root --oversubscribe -np 8 -x NCCL_NVLS_ENABLE \
      -x CUDA_VISIBLE_DEVICES -x TWIN_SHARD_EP_CHILD=1 -x TWIN_COMM_ID_FILE=/tmp/twin_mpi_id8 \
      "$B/run.sh" bin/shard_ep_gpu_test --verbose --filter 'shard_ep_gpu_proc/rank_of_one_process_per_gpu' )
fi

# ---- phase 3: benches, one at a time ----
step bench_ep2 110 0,1 "$R" bin/twin bench --backend gpu --op ep --iters 10 --csv "$O/bench_ep2.csv"
[ "$ngpu" -ge 4 ] && step bench_ep4 110 0,1,2,3 "$R" bin/twin bench --backend gpu --op ep --iters 10 --csv "$O/bench_ep4.csv"
[ "$ngpu" -ge 8 ] && step bench_ep8 110 $all8 "$R" bin/twin bench --backend gpu --op ep --iters 10 --csv "$O/bench_ep8.csv"
step peers_moe 60 0 env TWIN_PEER_MOE_SHAPES=32x4096,256x4096 python3 tools/peers/torch_moe.py
grep -a '^{' "$O/peers_moe.log" | tail -1 >"$O/moe_peers.json"
step bench_moe_ep2 150 0,1 "$R" bin/twin bench --backend gpu --op moe --ep 2 --iters 5 --peers "$O/moe_peers.json"
[ "$ngpu" -ge 4 ] && step bench_pipe4 60 0,1,2,3 "$R" bin/twin bench --backend gpu --op pipeline --stages 4 --iters 5
[ "$ngpu" -ge 4 ] && step sharding4 60 0,1,2,3 "$R" bin/twin check --sharding --backend gpu --min-ranks 2 --max-ranks 4
[ "$ngpu" -ge 8 ] && step bench_moe_ep8 150 $all8 "$R" bin/twin bench --backend gpu --op moe --ep 8 --iters 5 \
  --peers "$O/moe_peers.json"
[ "$ngpu" -ge 8 ] && step sharding8 90 $all8 "$R" bin/twin check --sharding --backend gpu --min-ranks 8 --max-ranks 8
echo "total $(($(date +%s) - t0))s" >>"$O/summary.txt"
pack
cat "$O/summary.txt"
