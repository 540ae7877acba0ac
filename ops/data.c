/* ops/data.h: the seeded stream and tensors of any rank that the runners build inputs from. */
#include "ops/data.h"

uint64_t tw_splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double tw_splitmix_unit(uint64_t *state) { return (double)(tw_splitmix64(state) >> 11) * 0x1.0p-53; }

int64_t tw_numel(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; i++) n *= shape[i];
  return n;
}

tw_tensor tw_tensor_of(void *p, tw_dtype t, int nd, const int64_t *shape, tw_mem m) {
  tw_tensor x = {p, t, nd, {0, 0, 0, 0}, m};
  for (int i = 0; i < nd && i < 4; i++) x.shape[i] = shape[i];
  return x;
}

tw_tensor tw_host_tensor(void *p, tw_dtype t, int nd, const int64_t *shape) {
  return tw_tensor_of(p, t, nd, shape, TW_MEM_HOST);
}
