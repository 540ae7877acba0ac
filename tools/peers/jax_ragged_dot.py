# Peer timings of jax.lax.ragged_dot (bf16, jit), adapted from ../../shared/peers/jax_ragged_dot.py
# to print JSON like torch_grouped_mm.py: {"device": ..., "jax": ..., "rows": {"<key>":
# {"jax.lax.ragged_dot": ms}}}. Merge with the torch file by hand or pass either to --peers.
import json, sys, time
import jax, jax.numpy as jnp, numpy as np

def bench(f, *args, n=50):
    r = f(*args); r.block_until_ready()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(*args).block_until_ready(); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3

out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": {}}
for (G, m, N, K) in [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (32, 512, 2048, 7168),
                     (128, 128, 2048, 4096)]:
    M = G * m
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (M, K), jnp.bfloat16); b = jax.random.normal(k2, (G, K, N), jnp.bfloat16)
    gs = jnp.full((G,), m, jnp.int32)
    f = jax.jit(lambda a, b, gs: jax.lax.ragged_dot(a, b, gs))
    key = f"grouped_G{G}_m{m}_N{N}_K{K}"
    out["rows"][key] = {"jax.lax.ragged_dot": bench(f, a, b, gs)}
    print(key, out["rows"][key], file=sys.stderr, flush=True)
print(json.dumps(out))
