/* PLACEHOLDER: the golden runner (tools engineer) replaces this file. */
#include "golden/runner.h"
