#!/usr/bin/env bash
# A skipped Criterion case says why: on stderr, and as <skipped message="..."/> in the XML that
# tools/test.sh counts (Criterion alone prints the reason only with --verbose).
set -u
JUNIT_SUITE=skip_reason
. "$(dirname "$0")/../tools/junit.sh"
PROBE=${1:?usage: skip_reason_test.sh path/to/skip_probe}
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/skip.XXXXXX")
XML_OUTPUT_FILE=$T/probe.xml "$PROBE" >"$T/out" 2>"$T/err"
rc=$?
if [ $rc = 0 ]; then pass skipped_case_is_not_a_failure; else fail skipped_case_is_not_a_failure "exit $rc"; fi
if grep -qF "[SKIP] skip_probe::stands_aside: this test needs 4 GPUs and sees 1" "$T/err"; then pass reason_on_stderr
else fail reason_on_stderr "$(head -c 300 "$T/err")"; fi
if grep -qF '<skipped message="this test needs 4 GPUs and sees 1"/>' "$T/probe.xml" &&
   [ "$(grep -c '<testcase' "$T/probe.xml")" = 2 ] && [ "$(grep -c '<skipped' "$T/probe.xml")" = 1 ]; then
  pass reason_in_the_xml
else fail reason_in_the_xml "$(tr '\n' ' ' <"$T/probe.xml" | head -c 600)"; fi
finish
