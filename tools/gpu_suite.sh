#!/usr/bin/env bash
# One call on a GPU machine: every GPU test, `twin check` on all backends, and the benches with
# their peers measured in the same run. Usage (from the repo root on the GPU machine):
#   tools/gpu_suite.sh BUNDLE_DIR OUT_DIR [tests|check|bench|port|fuzz SECONDS|crosscheck ...]
# BUNDLE_DIR comes from ../shared/device/bundle.sh (see README "Running on a GPU").
set -uo pipefail
B=${1:?bundle dir}; O=${2:?out dir}; shift 2
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests check bench)
mkdir -p "$O"
run() { "$B/run.sh" "$@"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$O/summary.txt"
rc=0
i=0
while [ $i -lt ${#steps[@]} ]; do
  s=${steps[$i]}; i=$((i + 1))
  case "$s" in
    tests)
      mkdir -p "$O/xml"
      for t in "$B"/bin/*_gpu_test; do
        n=$(basename "$t")
        start=$(date +%s)
        XML_OUTPUT_FILE="$O/xml/$n.xml" run "bin/$n" >>"$O/tests.log" 2>&1; r=$?
        # grep -c prints 0 and exits 1 when nothing matches: keep its count, not a second 0
        cases=$(grep -c '<testcase' "$O/xml/$n.xml" 2>/dev/null); cases=${cases:-0}
        fails=$(grep -c -E '<failure|<error' "$O/xml/$n.xml" 2>/dev/null); fails=${fails:-0}
        skips=$(grep -c '<skipped' "$O/xml/$n.xml" 2>/dev/null); skips=${skips:-0}
        printf '%-28s rc=%d cases=%s failed=%s skipped=%s (%ds)\n' "$n" "$r" "$cases" "$fails" "$skips" $(( $(date +%s) - start )) | tee -a "$O/summary.txt"
        [ $r -eq 0 ] || rc=1
      done
      tar czf "$O/xml.tgz" -C "$O" xml && rm -rf "$O/xml" ;;
    check)
      run bin/twin check --backend all --golden golden/data >"$O/check.log" 2>&1 || rc=1
      tail -3 "$O/check.log" | tee -a "$O/summary.txt" ;;
    bench)
      python3 tools/peers/torch_quantize.py >"$O/peers_quantize.json" 2>>"$O/bench.log"
      python3 tools/peers/torch_grouped_mm.py >"$O/peers_gemm.json" 2>>"$O/bench.log"
      run bin/twin bench --backend gpu --op quantize --peers "$O/peers_quantize.json" --csv "$O/bench_quantize.csv" 2>>"$O/bench.log" | tee -a "$O/summary.txt"
      run bin/twin bench --backend gpu --op grouped_gemm --peers "$O/peers_gemm.json" --csv "$O/bench_gemm.csv" 2>>"$O/bench.log" | tee -a "$O/summary.txt" ;;
    port)
      # the porting report (tools/port.h): report.md, report.json, roofline.png under $O/port
      { python3 tools/peers/torch_quantize.py; python3 tools/peers/torch_grouped_mm.py; } >"$O/peers_port.json" 2>>"$O/port.log"
      run bin/twin port --quick --golden golden/data --peers "$O/peers_port.json" --out "$O/port" 2>>"$O/port.log" || rc=1
      tail -1 "$O/port.log" | tee -a "$O/summary.txt" ;;
    fuzz)
      secs=${steps[$i]}; i=$((i + 1))
      run bin/twin fuzz --backend gpu --seconds "$secs" --out "$O/fuzz" 2>&1 | tail -40 | tee -a "$O/summary.txt" || rc=1 ;;
    *) echo "unknown step $s" | tee -a "$O/summary.txt"; rc=1 ;;
  esac
done
exit $rc
