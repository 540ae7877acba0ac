#!/usr/bin/env bash
# The `twin` command's contract: every bad argument or input is one line on stderr and exit
# code 2 (never a crash); --help documents every flag; the tables parse.
set -u
JUNIT_SUITE=twin_cli
. "$(dirname "$0")/junit.sh"
TWIN=$(realpath "${1:?usage: cli_test.sh path/to/twin}")
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/cli.XXXXXX")

# expect NAME CODE STDERR_SUBSTRING -- twin args...
expect() {
  local name=$1 code=$2 want=$3; shift 4
  "$TWIN" "$@" >"$T/out" 2>"$T/err"
  local rc=$? lines; lines=$(wc -l <"$T/err")
  if [ "$rc" -ne "$code" ]; then fail "$name" "exit $rc, want $code; stderr: $(head -c 300 "$T/err")"
  elif [ "$code" -eq 2 ] && [ "$lines" -ne 1 ]; then fail "$name" "stderr has $lines lines, want 1: $(head -c 300 "$T/err")"
  elif ! grep -qF -- "$want" "$T/err" "$T/out"; then fail "$name" "output lacks '$want': $(head -c 1500 "$T/err")"
  else pass "$name"; fi
}

python3 - "$T" <<'PY'
import sys, numpy as np
d = sys.argv[1]
np.save(d + "/a23.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
np.save(d + "/b42.npy", np.ones((4, 2), np.float32))
np.save(d + "/b32.npy", np.ones((3, 2), np.float32))
np.save(d + "/i32.npy", np.ones((2, 3), np.int32))
np.save(d + "/big.npy", np.ones((2, 3), '>f4'))
np.save(d + "/fortran.npy", np.asfortranarray(np.ones((2, 3), np.float32)))
np.save(d + "/gs_neg.npy", np.array([3, -1], np.int32))
np.save(d + "/x5.npy", np.ones((5, 7), np.float32))
np.save(d + "/gs_huge.npy", np.array([2**40], np.int64))
np.save(d + "/gs_2d.npy", np.ones((2, 2), np.int32))
np.save(d + "/hist.npy", np.ones((2, 4), np.float32))
np.save(d + "/v2.npy", np.ones(2, np.float32))
rng = np.random.default_rng(0)
np.save(d + "/logits.npy", rng.standard_normal((6, 8)).astype(np.float32))
np.save(d + "/dw62.npy", rng.standard_normal((6, 2)).astype(np.float32))
np.save(d + "/tok.npy", rng.standard_normal((6, 4)).astype(np.float32))
np.save(d + "/idx.npy", np.array([[0, 1], [2, 3], [3, 0], [1, 2], [0, 3], [2, 1]], np.int32))
np.save(d + "/idx_bad.npy", np.array([[0, 1], [2, 9], [3, 0], [1, 2], [0, 3], [2, 1]], np.int32))
np.save(d + "/w62.npy", rng.random((6, 2)).astype(np.float32))
open(d + "/garbage.npy", "wb").write(b"definitely not numpy")
b = open(d + "/a23.npy", "rb").read()
open(d + "/trunc.npy", "wb").write(b[:-5])
PY

O="--out-dir $T/o"
expect no_args 2 "missing command" -- 
expect unknown_command 2 "unknown command 'frobnicate'" -- frobnicate
expect op_no_name 2 "missing operation name" -- op
expect op_unknown_name 2 "unknown operation 'conv'" -- op conv
expect op_missing_out_dir 2 "--out-dir DIR is required" -- op gemm --in a=$T/a23.npy --in b=$T/b32.npy
expect op_flag_without_value 2 "--in needs a value" -- op gemm --in
expect op_bad_in_syntax 2 "--in wants NAME=FILE.npy" -- op gemm --in a23.npy $O
expect op_unknown_input 2 "unknown input 'c'" -- op gemm --in c=$T/a23.npy $O
expect op_duplicate_input 2 "input 'a' given twice" -- op gemm --in a=$T/a23.npy --in a=$T/a23.npy $O
expect op_unknown_option 2 "unknown option '--frob'" -- op gemm --frob 1 $O
expect op_stray_argument 2 "unexpected argument 'extra'" -- op gemm extra $O
expect op_bad_backend 2 "unknown backend 'tpu'" -- op gemm --backend tpu --in a=$T/a23.npy --in b=$T/b32.npy $O
expect op_missing_file 2 "cannot open" -- op gemm --in a=$T/nope.npy --in b=$T/b32.npy $O
expect op_garbage_npy 2 "not a .npy file (bad magic)" -- op gemm --in a=$T/garbage.npy --in b=$T/b32.npy $O
expect op_truncated_npy 2 "truncated" -- op gemm --in a=$T/trunc.npy --in b=$T/b32.npy $O
expect op_big_endian_npy 2 "dtype '>f4' is not supported" -- op gemm --in a=$T/big.npy --in b=$T/b32.npy $O
expect op_fortran_npy 2 "Fortran-order" -- op gemm --in a=$T/fortran.npy --in b=$T/b32.npy $O
# An .npy error names the file exactly as given, once, after the input's name (wrapping the
# message used to format the buffer into itself: "input 'a': input 'a': ta/trunc.npy").
L=$T/$(printf 'd%.0s' $(seq 200))/$(printf 'e%.0s' $(seq 200))
mkdir -p "$L" && cp "$T/trunc.npy" "$L/trunc.npy"
expect op_npy_error_names_the_file 2 "input 'a': npy_load $T/trunc.npy: truncated: shape needs" -- op gemm --in a=$T/trunc.npy --in b=$T/b32.npy $O
expect op_npy_error_names_a_long_path 2 "input 'a': npy_load $L/trunc.npy: truncated" -- op gemm --in a=$L/trunc.npy --in b=$T/b32.npy $O
(cd "$T" && "$TWIN" op gemm --in a=trunc.npy --in b=b32.npy --out-dir o 2>"$T/rel_err" >/dev/null)
if [ "$(grep -o "input 'a'" "$T/rel_err" | wc -l)" = 1 ] && grep -qF "input 'a': npy_load trunc.npy: truncated" "$T/rel_err"; then
  pass op_npy_error_names_a_relative_path_once
else fail op_npy_error_names_a_relative_path_once "$(head -c 300 "$T/rel_err")"; fi
expect op_missing_input 2 "input 'b' is missing" -- op gemm --in a=$T/a23.npy $O
expect op_mismatched_shapes 2 "contracting dims differ" -- op gemm --in a=$T/a23.npy --in b=$T/b42.npy $O
expect op_integer_operand 2 "input 'a' is [2, 3] i32; give f32 values" -- op gemm --in a=$T/i32.npy --in b=$T/b32.npy $O
expect op_bad_dtype_key 2 "'a_dtype' = 'f8' is not a dtype" -- op gemm --a-dtype f8 --in a=$T/a23.npy --in b=$T/b32.npy $O
expect op_bad_op_key 2 "'op_a' = 'X' is not N or T" -- op gemm --op-a X --in a=$T/a23.npy --in b=$T/b32.npy $O
expect op_accumulate_without_init 2 "accumulate = 1 needs an out_init" -- op gemm --accumulate 1 --in a=$T/a23.npy --in b=$T/b32.npy $O
expect op_quantize_needs_mode 2 "missing key 'mode'" -- op quantize --in x=$T/x5.npy $O
expect op_quantize_bad_mode 2 "'mode' = 'fp4' is not a scaling mode" -- op quantize --mode fp4 --in x=$T/x5.npy $O
expect op_quantize_bad_layout 2 "layout 'diagonal'" -- op quantize --mode current --layout diagonal --in x=$T/x5.npy $O
expect op_quantize_negative_group 2 "group_sizes[1] = -1 is negative" -- op quantize --mode current --in x=$T/x5.npy --in group_sizes=$T/gs_neg.npy $O
expect op_quantize_1d_x 2 "input 'x' is [2] i32; give f32 values" -- op quantize --mode current --in x=$T/gs_neg.npy $O
expect op_group_sizes_overflow 2 "group_sizes'[0] = 1099511627776 does not fit i32" -- op quantize --mode current --in x=$T/x5.npy --in group_sizes=$T/gs_huge.npy $O
expect op_group_sizes_2d 2 "group_sizes is [2, 2] i32, expected 1-D [G]" -- op quantize --mode current --in x=$T/x5.npy --in group_sizes=$T/gs_2d.npy $O
expect op_dequantize_needs_rows 2 "missing key 'rows'" -- op dequantize --mode current --in data=$T/x5.npy --in scale_inv=$T/v2.npy $O
expect op_dequantize_f32_data 2 "input 'data' is [5, 7] f32, cannot use it as e4m3 (give u8 codes)" -- op dequantize --mode current --rows 5 --cols 7 --in data=$T/x5.npy --in scale_inv=$T/v2.npy $O
expect op_delayed_bad_algo 2 "algo 'mean' is not max or most_recent" -- op delayed_scale_update --algo mean --in amax_history=$T/hist.npy --in scale=$T/v2.npy --in amax=$T/v2.npy $O
expect op_delayed_bad_margin 2 "margin 'two' is not a number" -- op delayed_scale_update --margin two --in amax_history=$T/hist.npy --in scale=$T/v2.npy --in amax=$T/v2.npy $O
expect op_quantize_col_padded_runs 0 "col_data.npy [7, 128] e4m3" -- op quantize --mode block1x128 --layout colwise --col_padded 1 --in x=$T/x5.npy $O
expect op_quantize_col_padded_mxfp8 2 "col_padded = 1 with mxfp8" -- op quantize --mode mxfp8 --layout colwise --col_padded 1 --in x=$T/x5.npy $O
expect op_quantize_col_padded_not_flag 2 "key 'col_padded' = 2 is not 0 or 1" -- op quantize --mode current --layout colwise --col_padded 2 --in x=$T/x5.npy $O
expect op_delayed_runs 0 "scale_out.npy [2] f32" -- op delayed_scale_update --in amax_history=$T/hist.npy --in scale=$T/v2.npy --in amax=$T/v2.npy $O
expect op_gpu_unavailable 2 "gpu" -- op gemm --backend gpu --in a=$T/a23.npy --in b=$T/b32.npy $O
expect op_out_dir_is_a_file 2 "cannot create --out-dir" -- op gemm --in a=$T/a23.npy --in b=$T/b32.npy --out-dir $T/a23.npy/x
expect fuzz_bad_mesh_axis 2 "mesh: unknown axis 'xp'" -- fuzz --mesh xp=2 --cases 1
expect fuzz_bad_mesh_syntax 2 "expected ','" -- fuzz --mesh "dp=2;ep=2" --cases 1
expect fuzz_bad_mesh_size 2 "has size 0" -- fuzz --mesh dp=0 --cases 1
expect fuzz_mesh_too_many_ranks 2 "at most 64" -- fuzz --mesh dp=16,tp=16 --cases 1
expect fuzz_mesh_without_value 2 "--mesh needs a value" -- fuzz --cases 1 --mesh
expect fuzz_mesh_cast_has_no_rule 2 "cast has none" -- fuzz --op cast --mesh all --cases 1
expect fuzz_comm_plant_needs_mesh 2 "add --mesh all" -- fuzz --plant amax_reduce_dropped --cases 1
expect fuzz_mesh_runs 0 "sharded:" -- fuzz --mesh dp=2,ep=2 --cases 8 --out "$T-fuzz" # not under $T: check --golden $T must stay empty
expect check_bad_backend 2 "unknown backend 'cpu'" -- check --backend cpu
expect check_missing_golden 2 "is not a directory" -- check --golden $T/none
expect check_empty_golden 1 "no golden cases" -- check --golden $T
mkdir -p "$T/one/area/c1" && printf 'op = delayed_scale_update\n' > "$T/one/area/c1/case.txt"
cp "$T/hist.npy" "$T/one/area/c1/amax_history.npy"; cp "$T/v2.npy" "$T/one/area/c1/scale.npy"; cp "$T/v2.npy" "$T/one/area/c1/amax.npy"
expect check_one_case_missing_expected 1 "lacks amax_history_out.npy" -- check --backend ref --golden $T/one/area/c1
expect check_unknown_option 2 "unknown option '--fast'" -- check --fast 1
expect bench_bad_iters 2 "--iters wants an integer" -- bench --iters lots
expect bench_bad_op 2 "unknown --op 'conv'" -- bench --op conv
expect bench_gpu_unavailable 2 "gpu backend is not available" -- bench --backend gpu
expect bench_registry_name 2 "gemm has no ref bench" -- bench --op gemm
# bench --op pipeline: its options parse and the configuration is checked with the pipeline's
# own rules (the rule's name on stderr, exit 2) before the backend is even looked at
PB="bench --backend gpu --op pipeline"
expect bench_pipeline_rule_divisible 2 "pipeline.microbatches_divisible" -- $PB --stages 3 --microbatches 4
expect bench_pipeline_rule_delay 2 "pipeline.delay" -- $PB --stages 2 --microbatches 4 --delay 3
expect bench_pipeline_rule_delay_microbatches 2 "pipeline.delay_microbatches" -- $PB --stages 4 --microbatches 4 --delay 2
expect bench_pipeline_rule_bsw_repeats 2 "pipeline.bsw_repeats" -- $PB --stages 2 --microbatches 4 --repeats 1 --bsw
expect bench_pipeline_rule_bsw_delay 2 "pipeline.bsw_delay" -- $PB --stages 2 --microbatches 4 --delay 2 --bsw
expect bench_pipeline_default_stages_rule 2 "M = 6 microbatches must be a multiple of S = 4" -- $PB --microbatches 6
expect bench_pipeline_bad_value 2 "--stages wants an integer 1..4096, got 'two'" -- $PB --stages two
expect bench_pipeline_bad_dim 2 "--hidden wants an integer 1..1048576, got '0'" -- $PB --hidden 0
expect bench_pipeline_bad_mode 2 "--mode wants auto, nccl or loopback, got 'ring'" -- $PB --mode ring
expect bench_pipeline_flag_needs_op 2 "--stages applies to --op pipeline only" -- bench --backend gpu --op gemm --stages 2
expect bench_pipeline_bsw_needs_op 2 "--bsw applies to --op pipeline only" -- bench --bsw
expect bench_pipeline_nccl_needs_gpus 2 "--mode nccl needs >= 2 GPUs (one stage per GPU), sees 0" -- $PB --stages 2 --mode nccl
expect bench_pipeline_valid_reaches_backend 2 "gpu backend is not available" -- $PB --stages 2 --microbatches 4 --bsw --mode loopback
expect bench_pipeline_no_ref_bench 2 "pipeline has no ref bench" -- bench --op pipeline --stages 2 --microbatches 4
# bench --op ep: its options parse first (a bad value is named), and apply to --op ep only
expect bench_ep_bad_tokens 2 "--tokens wants up to 8 comma-separated integers 1..1048576, got '128,0'" -- bench --backend gpu --op ep --tokens 128,0
expect bench_ep_bad_version 2 "--ep-version wants all, ep_nccl_slots or ep_nccl_lsa, got 'ep_fast'" -- bench --backend gpu --op ep --ep-version ep_fast
expect bench_ep_bad_routing 2 "--routing wants both, uniform or skewed, got 'zipf'" -- bench --backend gpu --op ep --routing zipf
expect bench_ep_flag_needs_op 2 "--tokens applies to --op ep only" -- bench --backend gpu --op gemm --tokens 128
expect bench_moe_bad_ep 2 "--ep wants an integer 2..8, got '1'" -- bench --backend gpu --op moe --ep 1
expect bench_moe_ep_not_int 2 "--ep wants an integer 2..8, got 'two'" -- bench --backend gpu --op moe --ep two
expect bench_moe_ep_needs_op 2 "--ep applies to --op moe only" -- bench --backend gpu --op ep --ep 2
expect bench_ep_valid_reaches_backend 2 "gpu backend is not available" -- bench --backend gpu --op ep --tokens 128,4096 --routing skewed
expect bench_ep_no_ref_bench 2 "ep has no ref bench" -- bench --op ep --tokens 128
# bench --shapes: GxMxNxK lists for the grouped GEMM bench (gpu), a bad one named
expect bench_shapes_bad 2 "--shapes wants up to 8 comma-separated GxMxNxK (each >= 1, G <= 4096), got '32x512x2048'" -- bench --backend gpu --op wgrad --shapes 32x512x2048
expect bench_shapes_zero 2 "got '32x0x2048x7168'" -- bench --backend gpu --op grouped_gemm --shapes 32x0x2048x7168
expect bench_shapes_trailing 2 "got '4x8x8x8,'" -- bench --backend gpu --op grouped_gemm --shapes 4x8x8x8,
expect bench_shapes_too_big 2 "has an operand of more than 2^34 elements" -- bench --backend gpu --op wgrad --shapes 4096x1000000x7168x7168
expect bench_shapes_needs_op 2 "--shapes applies to --op grouped_gemm or wgrad only" -- bench --backend gpu --op moe --shapes 4x8x8x8
expect bench_shapes_needs_gpu 2 "--shapes applies to --backend gpu only" -- bench --op grouped_gemm --shapes 4x8x8x8
expect bench_shapes_valid_reaches_backend 2 "gpu backend is not available" -- bench --backend gpu --op wgrad --shapes 64x256x2048x7168,32x512x2048x7168
if "$TWIN" bench --help >"$T/help" 2>&1; then
  missing=""
  for f in --stages --microbatches --repeats --delay --bsw --hidden --ffn --mb-rows --mode; do
    grep -q -- "$f" "$T/help" || missing="$missing $f"
  done
  if [ -z "$missing" ]; then pass help_bench_pipeline; else fail help_bench_pipeline "undocumented:$missing"; fi
else fail help_bench_pipeline "exit $?"; fi
expect fuzz_registry_name_runs 0 "wgrad" -- fuzz --op grouped_gemm_wgrad --cases 2 --out "$T-fuzz"
expect fuzz_op_without_generator 2 "grouped_dequantize has no fuzz generator" -- fuzz --op grouped_dequantize --cases 1
expect check_sharding_filter_nothing 2 "no rule of an operation matching 'conv'" -- check --sharding --filter conv
expect check_sharding_filter_by_op 0 "0 failed" -- check --sharding --filter wgrad --max-ranks 2
expect check_filter_by_op 0 "24 passed, 0 failed" -- check --backend ref --filter grouped_gemm_wgrad
# routing and the pipeline through the same modes (registry entries router, ep, pipeline)
expect op_router 0 "aux_d_logits.npy" -- op router --topk 2 --coeff 0.01 --in logits=$T/logits.npy --in d_topk_weights=$T/dw62.npy --out-dir $T/router
expect op_router_bad_topk 2 "topk = 9 must be in [1, E = 8]" -- op router --topk 9 --in logits=$T/logits.npy --out-dir $T/router
expect op_ep_dispatch 0 "group_sizes_1.npy" -- op ep_dispatch --ep-size 2 --experts 4 --alignment 2 --in tokens=$T/tok.npy --in topk_idx=$T/idx.npy --in topk_weights=$T/w62.npy --out-dir $T/epd
expect op_ep_bad_split 2 "do not split into ep_size = 4" -- op ep_dispatch --ep-size 4 --experts 4 --in tokens=$T/tok.npy --in topk_idx=$T/idx.npy --in topk_weights=$T/w62.npy --out-dir $T/epd
expect op_ep_bad_expert 2 "9" -- op ep_dispatch --ep-size 2 --experts 4 --in tokens=$T/tok.npy --in topk_idx=$T/idx_bad.npy --in topk_weights=$T/w62.npy --out-dir $T/epd
expect op_ep_combine_needs_outputs 2 "input 'expert_out_0' is missing" -- op ep_combine --ep-size 2 --experts 4 --in tokens=$T/tok.npy --in topk_idx=$T/idx.npy --in topk_weights=$T/w62.npy --out-dir $T/epc
expect check_router_goldens 0 "12 passed, 0 failed" -- check --backend ref --filter router
expect check_ep_goldens 0 "ep/ep8_e8_k1_a1" -- check --backend ref --filter ep/
expect fuzz_router_ep_pipeline 0 "pipeline: 20 cases" -- fuzz --op router,ep,pipeline --cases 20 --out "$T-fuzz"
expect fuzz_ep_plant_caught 1 "shrunk" -- fuzz --op ep --plant ep_wrong_rank --cases 50 --out "$T-fuzz"
expect fuzz_pipeline_plant_caught 1 "S=3" -- fuzz --op pipeline --plant pipeline_stale_window --cases 200 --out "$T-fuzz"
expect fuzz_moe 0 "moe: 60 cases" -- fuzz --op moe --cases 60 --out "$T-fuzz"
expect fuzz_moe_plant_caught 1 "dwi" -- fuzz --op moe --plant moe_skip_dp_reduce --cases 200 --out "$T-fuzz"
expect fuzz_own_fuzzers_are_ref 2 "ref thread ranks only" -- fuzz --backend gpu --op ep --cases 1
expect fuzz_ep_foreign_plant 2 "take only their own plants" -- fuzz --op ep,router --plant round_toward_zero --cases 1
expect plan_pipeline 0 "bubble d(S-1)/(MR+d(S-1)) = 2/14" -- plan --op pipeline --stages 3 --microbatches 6 --repeats 2 --bsw --fsdp 2
expect plan_pipeline_rule 1 "pipeline.microbatches_divisible" -- plan --op pipeline --stages 3 --microbatches 4
expect plan_pipeline_needs_sizes 2 "--stages and --microbatches are required" -- plan --op pipeline --stages 3

# twin port: the ref report here; --compare of two reports, regressions first
expect port_bad_backend 2 "unknown backend 'tpu'" -- port --backend tpu
expect port_unknown_option 2 "unknown option '--fast'" -- port --fast 1
expect port_out_without_value 2 "--out needs a value" -- port --backend ref --out
expect port_stray_argument 2 "unexpected argument 'now'" -- port now
expect port_filter_matches_nothing 2 "--filter 'conv' matches no operation" -- port --backend ref --filter conv
expect port_gpu_unavailable 2 "gpu backend is not available" -- port --backend gpu
expect port_out_is_a_file 2 "cannot create --out" -- port --backend ref --out $T/a23.npy/x
expect port_compare_one_file 2 "exactly two" -- port --compare $T/a.json
expect port_compare_missing 2 "cannot open" -- port --compare $T/nope.json $T/nope2.json
expect port_compare_not_a_report 2 "is not a twin port report" -- port --compare $T/a23.npy $T/a23.npy
expect port_ref_quick 0 "report.json written" -- port --backend ref --quick --filter grouped_gemm --out $T/pa
if python3 - "$T/pa" <<'PY'
import json, sys
d = sys.argv[1]
r = json.load(open(d + "/report.json"))
md = open(d + "/report.md").read()
ops = {c["op"] for c in r["checks"]}
assert ops == {"grouped_gemm", "grouped_gemm_wgrad", "grouped_gemm_rows", "grouped_gemm_wgrad_rows"}, ops
assert all(c["failed"] == 0 and c["passed"] == c["cases"] > 0 for c in r["checks"]), r["checks"]
assert sum(c["cases"] for c in r["checks"] if c["dtype"] != "fuzz seed 1") == 18 + 22 + 6 + 2
assert len(r["timings"]) == 8 and all(t["ms"] > 0 and t["flops"] > 0 for t in r["timings"])
assert r["ceilings"]["copy_gbs"] > 0 and r["ceilings"]["dense_f32_tflops"] > 0
for s in ("## Device", "## Ceilings", "## Correctness", "## Speed", "what auto picks"):
    assert s in md, s
# B: one check fails and one timing is twice as slow
b = open(d + "/report.json").read().replace('"failed": 0', '"failed": 3', 1)
t = r["timings"][0]
b = b.replace('"ms": %.6g' % t["ms"], '"ms": %.6g' % (2 * t["ms"]), 1)
open(d + "/b.json", "w").write(b)
PY
then pass port_report_contents; else fail port_report_contents "report.json/report.md"; fi
expect port_compare_same 0 "0 correctness regressions" -- port --compare $T/pa/report.json $T/pa/report.json
expect port_compare_regression 1 "REGRESSED" -- port --compare $T/pa/report.json $T/pa/b.json
if head -5 "$T/out" | grep -q "^REGRESSED" && grep -q "^SLOWER" "$T/out"; then pass port_compare_regressions_first
else fail port_compare_regressions_first "$(head -8 "$T/out")"; fi

# --help: exit 0, and every op documents every key the exec layer reads
for sub in "" "op" "check" "bench" "port"; do
  if "$TWIN" $sub --help >"$T/help" 2>&1 && grep -q usage "$T/help"; then pass "help_${sub:-top}"; else fail "help_${sub:-top}" "$(head -3 "$T/help")"; fi
done
for op in quantize dequantize gemm grouped_gemm grouped_gemm_wgrad delayed_scale_update; do
  "$TWIN" op $op --help >"$T/help" 2>&1 || { fail "help_op_$op" "exit $?"; continue; }
  missing=""
  case $op in
    quantize) flags="--mode --qdtype --layout --pow2-scales --swizzled --x-dtype --amax --backend --out-dir" ;;
    dequantize) flags="--mode --qdtype --colwise --swizzled --rows --cols --out-dtype" ;;
    gemm) flags="--op-a --op-b --out-dtype --accumulate --a-mode --a-dtype --b-src-rows --b-src-cols" ;;
    grouped_gemm) flags="--rhs-op --out-dtype --accumulate --lhs-dtype --rhs-qdtype --rhs-colwise" ;;
    grouped_gemm_wgrad) flags="--lhs-op --rhs-op --lhs-swizzled --rhs-src-rows" ;;
    delayed_scale_update) flags="--qdtype --algo --margin" ;;
  esac
  for f in $flags; do grep -q -- "$f" "$T/help" || missing="$missing $f"; done
  if [ -z "$missing" ]; then pass "help_op_$op"; else fail "help_op_$op" "undocumented:$missing"; fi
done
# backends: the table names every operation and both backends
if "$TWIN" backends >"$T/b" 2>&1 && grep -q "grouped_gemm_wgrad" "$T/b" && grep -q "ref .*gpu" "$T/b"; then
  pass backends_table; else fail backends_table "$(head -3 "$T/b")"; fi
rm -rf "$T"
finish
