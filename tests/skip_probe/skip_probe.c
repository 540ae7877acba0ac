/* Not a test of its own: tests/skip_reason_test.sh runs it to check that a skipped case says
 * why, on stderr and in the JUnit XML (tests/criterion_main.c). */
#include <criterion/criterion.h>

Test(skip_probe, stands_aside) { cr_skip_test("this test needs %d GPUs and sees %d", 4, 1); }
Test(skip_probe, runs) { cr_assert(1); }
