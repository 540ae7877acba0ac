#!/usr/bin/env python3
"""Checks the stored router goldens (golden/data/router, written by gen_router.py from
hand-derived gradients) against a plain JAX model differentiated by jax.grad, in f64 on CPU:
topk_weights from the stored selection, d_logits = grad of sum(topk_weights * d_topk_weights),
the aux loss and its gradient. Independent of twin's C code and of gen_router.py's formulas.

    python3 golden/check_router_jax.py [golden/data/router]      # needs `pip install jax`
"""
import os
import sys

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    sys.exit("check_router_jax: JAX is not installed (python3 -m pip install jax; tools/setup.sh should do it)")
import ml_dtypes
import numpy as np

jax.config.update("jax_enable_x64", True)


def keys(d):
    out = {}
    for line in open(os.path.join(d, "case.txt")):
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def weights(x, idx, c, sf):
    if c["score"] == "sigmoid":
        v = jnp.take_along_axis(jax.nn.sigmoid(x), idx, axis=1)
        if idx.shape[1] > 1:
            v = v / (v.sum(axis=1, keepdims=True) + 1e-20)
    elif int(c["pre_softmax"]):
        v = jnp.take_along_axis(jax.nn.softmax(x, axis=1), idx, axis=1)
    else:
        v = jax.nn.softmax(jnp.take_along_axis(x, idx, axis=1), axis=1)
    return v * sf


def aux(x, counts, c, k, coeff):
    T, E = x.shape
    if c["score"] == "softmax":
        p = jax.nn.softmax(x, axis=1)
    else:
        s = jax.nn.sigmoid(x)
        p = s / s.sum(axis=1, keepdims=True)
    return coeff * E / (k * T * T) * (p.sum(axis=0) * counts).sum()


def close(a, b, what, name):
    a, b = np.asarray(a), np.asarray(b)
    err = np.abs(a - b).max() if a.size else 0.0
    tol = 1e-12 * max(1.0, np.abs(b).max() if b.size else 0.0)
    if not err <= tol:
        raise SystemExit("%s: %s differs from JAX by %g (tolerance %g)" % (name, what, err, tol))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "router")
    n = 0
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        c = keys(d)
        x = np.load(os.path.join(d, "logits.npy"))
        if c["logits_dtype"] == "bf16":
            x = x.view(ml_dtypes.bfloat16)
        x = jnp.asarray(x.astype(np.float64))
        idx = jnp.asarray(np.load(os.path.join(d, "topk_idx.npy")))
        dw = jnp.asarray(np.load(os.path.join(d, "d_topk_weights.npy")).astype(np.float64))
        counts = jnp.asarray(np.load(os.path.join(d, "counts.npy")).astype(np.float64))
        sf, k = float(c["scaling_factor"]), int(c["topk"])
        coeff, d_loss = float(c["coeff"]), float(c["d_loss"])
        close(weights(x, idx, c, sf), np.load(os.path.join(d, "topk_weights.npy")), "topk_weights", name)
        g = jax.grad(lambda z: (weights(z, idx, c, sf) * dw).sum())(x)
        close(g, np.load(os.path.join(d, "d_logits.npy")), "d_logits", name)
        close(aux(x, counts, c, k, coeff), np.load(os.path.join(d, "aux_loss.npy"))[0], "aux_loss", name)
        ga = jax.grad(lambda z: d_loss * aux(z, counts, c, k, coeff))(x)
        close(ga, np.load(os.path.join(d, "aux_d_logits.npy")), "aux_d_logits", name)
        n += 1
    print("check_router_jax: %d router goldens agree with jax.grad in f64" % n)
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
