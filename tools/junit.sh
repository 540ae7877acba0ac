# Sourced by the shell tests: case / check helpers that count cases and write JUnit XML to
# $XML_OUTPUT_FILE (Bazel sets it), so tools/test.sh counts each case, not each script.
_junit_cases=""
_junit_failed=0
_junit_skipped=0
_junit_total=0
_junit_suite=${JUNIT_SUITE:-shell}

_xml_escape() { sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g'; }

# pass NAME | fail NAME MESSAGE (one <testcase> per line: tools/test.sh counts lines)
pass() {
  _junit_total=$((_junit_total + 1))
  _junit_cases="$_junit_cases
<testcase classname=\"$_junit_suite\" name=\"$1\"/>"
  echo "[PASS] $1"
}
fail() {
  _junit_total=$((_junit_total + 1)); _junit_failed=$((_junit_failed + 1))
  local msg; msg=$(printf '%s' "$2" | _xml_escape)
  _junit_cases="$_junit_cases
<testcase classname=\"$_junit_suite\" name=\"$1\"><failure message=\"$msg\"/></testcase>"
  echo "[FAIL] $1: $2"
}

# skip NAME REASON: a case that stood aside (counted as skipped, not passed)
skip() {
  _junit_total=$((_junit_total + 1)); _junit_skipped=$((_junit_skipped + 1))
  local msg; msg=$(printf '%s' "$2" | _xml_escape)
  _junit_cases="$_junit_cases
<testcase classname=\"$_junit_suite\" name=\"$1\"><skipped message=\"$msg\"/></testcase>"
  echo "[SKIP] $1: $2"
}

# finish: writes the XML, prints the synthesis, exits non-zero on any failure
finish() {
  if [ -n "${XML_OUTPUT_FILE:-}" ]; then
    printf '<?xml version="1.0" encoding="UTF-8"?>\n<testsuites><testsuite name="%s" tests="%d" failures="%d">%s</testsuite></testsuites>\n' \
      "$_junit_suite" "$_junit_total" "$_junit_failed" "$_junit_cases" > "$XML_OUTPUT_FILE"
  fi
  echo "$((_junit_total - _junit_failed - _junit_skipped)) passed, $_junit_failed failed, $_junit_skipped skipped"
  [ "$_junit_failed" -eq 0 ]
  exit $?
}
