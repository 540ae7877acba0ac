#!/usr/bin/env bash
# The test command: installs dependencies, runs every non-GPU test under Bazel, and ends with
# one line "N passed, N failed, N skipped" counted from the per-case JUnit XML the tests write
# (skipped: a case that stood aside and said why, e.g. a test that needs more GPUs than the
# machine has; never counted as passed).
# Extra arguments go to `bazel test` (e.g. --config=gpu on a GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || { echo "setup failed"; echo "0 passed, 1 failed"; exit 1; }
bazel test //... "$@"
rc=$?
if printf '%s\n' "$@" | grep -q -- '--config=gpu'; then
  targets=$(bazel query 'tests(//...)' 2>/dev/null)
else
  targets=$(bazel query 'tests(//...) except attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null)
fi
passed=0; failed=0; skipped=0; missing=0
for t in $targets; do
  p=${t#//}; p=${p/://}
  x="bazel-testlogs/$p/test.xml"
  if [ ! -f "$x" ]; then missing=$((missing + 1)); continue; fi
  n=$(grep -c '<testcase' "$x")
  f=$(grep -c -E '<failure|<error' "$x")
  k=$(grep -c '<skipped' "$x")
  passed=$((passed + n - f - k)); failed=$((failed + f)); skipped=$((skipped + k))
done
# A target that did not build or run leaves no XML: count it as one failure.
failed=$((failed + missing))
if [ $rc -ne 0 ] && [ $failed -eq 0 ]; then failed=1; fi
echo "$passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
