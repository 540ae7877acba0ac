#include "tests/test_util.h"
