/* PLACEHOLDER until the .npy reader lands. */
#include "twin/tw_npy.h"
