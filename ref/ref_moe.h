/* The oracle's MoE routing tables (ref/router.c, ref/ep.c). */
#ifndef TWIN_REF_REF_MOE_H
#define TWIN_REF_REF_MOE_H

#include "core/backend_moe.h"

extern const tw_router_backend tw_ref_router;
extern const tw_ep_backend tw_ref_ep;

#endif
