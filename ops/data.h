/* The pieces every runner uses to build an operation's inputs (check, bench, fuzz, the
 * sharding sweep, port): one seeded number stream and a tensor of any rank, so that the same
 * seed means the same data everywhere. */
#ifndef TWIN_OPS_DATA_H
#define TWIN_OPS_DATA_H

#include <stdint.h>

#include "twin/tw_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* splitmix64: the next value of the stream whose state is *state. */
uint64_t tw_splitmix64(uint64_t *state);
/* The next value as a double uniform in [0, 1) (its top 53 bits). */
double tw_splitmix_unit(uint64_t *state);
/* The number of elements of a shape of rank nd (1 for rank 0). */
int64_t tw_numel(int nd, const int64_t *shape);
/* A tensor over p of rank nd (<= 4) with the given shape, in memory m. */
tw_tensor tw_tensor_of(void *p, tw_dtype t, int nd, const int64_t *shape, tw_mem m);
/* The same in host memory. */
tw_tensor tw_host_tensor(void *p, tw_dtype t, int nd, const int64_t *shape);

#ifdef __cplusplus
}
#endif
#endif
