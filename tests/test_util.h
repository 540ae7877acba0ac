/* Helpers shared by the Criterion tests. */
#ifndef TWIN_TESTS_TEST_UTIL_H
#define TWIN_TESTS_TEST_UTIL_H
#include "twin/tw_base.h"
#endif
