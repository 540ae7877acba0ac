/* PLACEHOLDER until the numerics work lands: scalar codecs. */
#include "twin/tw_numerics.h"
