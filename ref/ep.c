/* The oracle's expert parallelism (tw_ep.h): filled in by the EP slice. */
#include "ref/ref_moe.h"

const tw_ep_backend tw_ref_ep = {0};
