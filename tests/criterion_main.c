/* Criterion entry point for every twin test: when Bazel runs the test it sets
 * XML_OUTPUT_FILE, and Criterion writes its per-case JUnit XML there, so bazel-testlogs/
 * counts individual test cases instead of one result per binary. */
#include <stdio.h>

#include <criterion/criterion.h>
#include <criterion/options.h>
#include <criterion/output.h>
#include <stdlib.h>

int main(int argc, char *argv[]) {
  struct criterion_test_set *tests = criterion_initialize();
  const char *xml = getenv("XML_OUTPUT_FILE");
  if (xml && *xml) criterion_add_output("xml", xml);
  int result = 0;
  if (criterion_handle_args(argc, argv, true)) result = !criterion_run_all_tests(tests);
  criterion_finalize(tests);
  return result;
}
