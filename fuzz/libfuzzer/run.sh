#!/usr/bin/env bash
# Builds the libFuzzer harness over twin's validators and .npy parser (clang-14,
# -fsanitize=fuzzer,address,undefined) and runs it for a bounded time.
#
#   fuzz/libfuzzer/run.sh [--seconds N] [--merge] [--jobs N]
#   fuzz/libfuzzer/run.sh --findings     # replay each known finding unsuppressed
#
# The kept corpus (fuzz/libfuzzer/corpus/) seeds a scratch corpus; new inputs go to the
# scratch copy, and --merge folds the ones that add coverage back into the kept corpus.
# Any crash, leak, UBSan report or timeout fails the run (exit != 0) and leaves the input in
# $ARTIFACTS (default fuzz-artifacts/; under Bazel the test's undeclared outputs).
# Under `bazel test` (//fuzz:validators_libfuzzer_test) it compiles the real source tree the
# runfiles point into (the test is tagged external: never cached).
set -euo pipefail

seconds=60
merge=0
jobs=1
findings=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --merge) merge=1; shift ;;
    --jobs) jobs="$2"; shift 2 ;;
    --findings) findings=1; shift ;;
    *) echo "usage: $0 [--seconds N] [--merge] [--jobs N]" >&2; exit 2 ;;
  esac
done

# The source tree: this script's real location, two levels up.
self="$(readlink -f "${BASH_SOURCE[0]}")"
root="$(cd "$(dirname "$self")/../.." && pwd)"
[ -f "$root/include/twin/tw_base.h" ] || { echo "run.sh: cannot find the twin tree from $self" >&2; exit 2; }

# clang-14 with the libFuzzer and sanitizer runtimes (Debian: clang-14, libclang-rt-14-dev).
cc=""
for c in clang-14 clang; do command -v "$c" >/dev/null 2>&1 && { cc="$c"; break; }; done
rt_ok() { [ -n "$cc" ] && ls "$($cc -print-resource-dir)"/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; }
if ! rt_ok; then
  echo "run.sh: installing clang-14 and libclang-rt-14-dev" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq clang-14 libclang-rt-14-dev >/dev/null
  cc=clang-14
  rt_ok || { echo "run.sh: no libFuzzer runtime for $cc" >&2; exit 2; }
fi

work="${TEST_TMPDIR:-$(mktemp -d)}/libfuzzer"
artifacts="${ARTIFACTS:-${TEST_UNDECLARED_OUTPUTS_DIR:-$root/fuzz-artifacts}}"
mkdir -p "$work/corpus" "$artifacts"
bin="$work/validators_fuzz"

# The library as the tests link it: core/ (validation, checker, .npy) and the ref backend.
srcs=("$root"/core/*.c "$root"/ref/*.c "$root/fuzz/libfuzzer/validators_fuzz.c")
"$cc" -g -O1 -std=c11 -D_GNU_SOURCE -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fsanitize-recover=undefined \
  -I"$root/include" -I"$root" "${srcs[@]}" -lopenblas -lm -lpthread -o "$bin"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=1"
# Known open findings (known_findings.txt): UBSan suppressions and skipped entry points, so
# the run keeps looking for new ones; anything else halts it.
known="$root/fuzz/libfuzzer/known_findings.txt"
supp="$work/known.supp"
grep -E '^ubsan\s' "$known" | awk '{print $2}' > "$supp" || true
export TWIN_LIBFUZZER_SKIP="$(grep -E '^skip\s' "$known" | awk '{print $2}' | paste -sd, -)"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp"

if [ "$findings" = 1 ]; then
  still=0; gone=0
  while read -r kind what repros; do
    case "$kind" in ubsan|skip) ;; *) continue ;; esac
    for r in $repros; do
      out=$(UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" TWIN_LIBFUZZER_SKIP= "$bin" "$root/fuzz/libfuzzer/findings/$r" 2>&1 || true)
      line=$(printf '%s\n' "$out" | grep -m1 -E 'runtime error|ERROR: AddressSanitizer' | sed 's|.*/core/|core/|' || true)
      if [ -n "$line" ]; then still=$((still + 1)); echo "open   $what ($r): $line"
      else gone=$((gone + 1)); echo "FIXED  $what ($r): no longer reproduces; remove it from known_findings.txt"; fi
    done
  done < "$known"
  echo "run.sh: $still reproducers still fail, $gone fixed"
  exit 0
fi
n_known=$(grep -c -E '^(ubsan|skip)\s' "$known" || true)
[ "$n_known" -gt 0 ] && echo "run.sh: $n_known known findings kept out of the way (fuzz/libfuzzer/known_findings.txt; run.sh --findings)"
cp -n "$root"/fuzz/libfuzzer/corpus/* "$work/corpus/" 2>/dev/null || true
echo "run.sh: fuzzing for ${seconds}s (corpus $(ls "$work/corpus" | wc -l) inputs, artifacts in $artifacts)"
par=(); [ "$jobs" -gt 1 ] && par=(-jobs="$jobs" -workers="$jobs")
"$bin" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -max_len=4096 \
  -print_final_stats=1 "${par[@]}" -artifact_prefix="$artifacts/" "$work/corpus" 2>&1 |
  grep -v -E '^#[0-9]+\s+(NEW|REDUCE|pulse)' | tail -40
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "run.sh: the harness failed (exit $rc); reproduce with: $bin $artifacts/<crash-file>" >&2
  exit "$rc"
fi
if [ "$merge" = 1 ]; then
  "$bin" -merge=1 "$root/fuzz/libfuzzer/corpus" "$work/corpus" 2>&1 | tail -2
fi
echo "run.sh: clean after ${seconds}s"
