#!/usr/bin/env python3
"""Goldens for the circular pipeline (include/twin/tw_pipeline.h): the *sequential* model in
JAX on CPU, f64, loss and every gradient by jax.grad. Never uses twin's code.

Re-run (from the repository root; deterministic, seeded):
    python3 golden/gen_pipeline.py          # writes golden/data/pipeline/<case>/
Needs numpy and jax (written with jax 0.10.2, CPU).

Model. Layer y = x + gelu(x W1) W2 with W1 [E, H], W2 [H, E] and gelu the tanh form
(jax.nn.gelu(approximate=True)). Weights are stored as the pipeline holds them,
[R, S, Lps, rows, cols]; the sequential model runs layer (r*S + s)*Lps + l in that order,
i.e. the reshape [R, S, Lps] -> [layers] (spec §2.1). Loss = 1/2 sum((y - tgt)^2), so
dL/dy = y - tgt ("loss = half_sum_sq" in pipeline.txt).

Each case directory holds pipeline.txt (key = value: S M R d Lps F fsdp E H mb loss) — not
case.txt, so the op runner (golden/runner.c) does not pick these up before the registry knows
the pipeline — and:
    x.npy, tgt.npy   f32 [M, mb, E]          inputs (what the C side runs on, exactly)
    w1.npy, w2.npy   f32 [R*S*Lps, E, H] / [R*S*Lps, H, E]: the [R, S, Lps] weights with
                     their leading axes flattened (.npy for twin has at most 4 dims)
    y.npy, dx.npy    f64 [M, mb, E]          the sequential model's output and dL/dx
    loss.npy         f64 []                  1/2 sum((y - tgt)^2)
    dw1.npy, dw2.npy f64, shaped like w1.npy, w2.npy: dL/dW
f64 results are rounded to 40 significant bits, so that a last-bit difference between JAX
builds cannot change the stored bytes (the C tests' bounds are ~2^-15 relative and larger).
"""
import os
import sys

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "pipeline")
E, H, MB = 4, 8, 4

# (S, M, R, d, Lps, F, fsdp): spec §6 items 1-8
CASES = [
    (2, 2, 1, 1, 1, 1, "plain"),   # 1 smallest
    (4, 4, 1, 1, 1, 1, "plain"),   # 2 non-circular
    (4, 8, 1, 1, 1, 2, "plain"),   # 2 M > S
    (2, 2, 2, 1, 1, 1, "plain"),   # 3 rotate path
    (4, 4, 2, 1, 1, 2, "plain"),   # 3
    (2, 4, 2, 1, 1, 1, "plain"),   # 4 circ_storage
    (4, 8, 2, 1, 1, 2, "plain"),   # 4
    (3, 6, 2, 1, 1, 1, "plain"),   # 4 S = 3
    (2, 6, 2, 1, 1, 1, "plain"),   # 5 mps > 1, roll 1
    (4, 8, 3, 1, 1, 1, "plain"),   # 5
    (4, 8, 2, 2, 1, 1, "plain"),   # 6 d = 2
    (2, 4, 2, 2, 1, 1, "plain"),   # 6 M == dS
    (2, 4, 2, 1, 2, 1, "plain"),   # 7 Lps = 2
    (5, 10, 3, 1, 1, 1, "plain"),  # S = 5
] + [(S, M, R, 1, 1, F, "bsw") for (S, M, R) in ((2, 8, 4), (3, 6, 2), (4, 4, 2), (4, 8, 3)) for F in (1, 2, 4)]


def layer(x, w1, w2):
    return x + jax.nn.gelu(x @ w1, approximate=True) @ w2


def loss_fn(x, w1, w2, tgt):
    # w [R, S, Lps, ...] -> [layers, ...] in the order (r*S + s)*Lps + l
    w1l = w1.reshape((-1,) + w1.shape[3:])
    w2l = w2.reshape((-1,) + w2.shape[3:])
    y = x
    for i in range(w1l.shape[0]):
        y = layer(y, w1l[i], w2l[i])
    return 0.5 * jnp.sum((y - tgt) ** 2), y


def round40(a):
    a = np.asarray(a, np.float64)
    m, e = np.frexp(a)
    return np.ldexp(np.round(m * 2.0**40) / 2.0**40, e)


def name_of(c):
    S, M, R, d, Lps, F, mode = c
    return "S%d_M%d_R%d_d%d_Lps%d_F%d_%s" % (S, M, R, d, Lps, F, mode)


def main():
    os.makedirs(OUT, exist_ok=True)
    grad = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True))
    for i, c in enumerate(CASES):
        S, M, R, d, Lps, F, mode = c
        rng = np.random.default_rng(20261124 + i)
        x = rng.uniform(-1, 1, (M, MB, E)).astype(np.float32)
        tgt = rng.uniform(-1, 1, (M, MB, E)).astype(np.float32)
        w1 = rng.uniform(-1, 1, (R, S, Lps, E, H)).astype(np.float32) / np.float32(np.sqrt(E))
        w2 = rng.uniform(-1, 1, (R, S, Lps, H, E)).astype(np.float32) / np.float32(np.sqrt(H))
        (loss, y), (dx, dw1, dw2) = grad(jnp.asarray(x, jnp.float64), jnp.asarray(w1, jnp.float64),
                                         jnp.asarray(w2, jnp.float64), jnp.asarray(tgt, jnp.float64))
        d_ = os.path.join(OUT, name_of(c))
        os.makedirs(d_, exist_ok=True)
        with open(os.path.join(d_, "pipeline.txt"), "w") as f:
            f.write("# sequential model y = x + gelu(x W1) W2 over layers (r*S+s)*Lps+l; JAX f64 jax.grad\n")
            for k, v in (("S", S), ("M", M), ("R", R), ("d", d), ("Lps", Lps), ("F", F), ("fsdp", mode),
                         ("E", E), ("H", H), ("mb", MB), ("loss", "half_sum_sq")):
                f.write("%s = %s\n" % (k, v))
        for k, v in (("x", x), ("tgt", tgt), ("w1", w1.reshape(-1, E, H)), ("w2", w2.reshape(-1, H, E))):
            np.save(os.path.join(d_, k + ".npy"), v)
        for k, v in (("y", y), ("dx", dx), ("loss", loss), ("dw1", dw1.reshape(-1, E, H)), ("dw2", dw2.reshape(-1, H, E))):
            np.save(os.path.join(d_, k + ".npy"), round40(v))
    print("pipeline: %d cases" % len(CASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
