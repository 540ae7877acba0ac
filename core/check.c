/* PLACEHOLDER until the checker lands. */
#include "twin/tw_check.h"
