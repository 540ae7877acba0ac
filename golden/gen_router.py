#!/usr/bin/env python3
"""Golden router cases for twin (tw_router.h): top-k selection, weights, counts, backward and
the aux loss. Independent of twin's C code: NumPy only, every value in f64. The backward is
checked here against central finite differences of this script's own f64 forward before a
case is written (the selection held fixed), so the stored d_logits are verified twice over.

Re-run (deterministic, seeded):  python3 golden/gen_router.py [--out golden/data/router]

Each case directory: case.txt (op = router, score, pre_softmax, topk, num_groups, group_topk,
scaling_factor, has_bias, logits_dtype, coeff, d_loss), logits.npy (f32, or u16 bf16 codes),
expert_bias.npy (f32, when has_bias), d_topk_weights.npy (f32), and the expected
topk_idx.npy (i32), topk_weights.npy (f64), counts.npy (i32), d_logits.npy (f64),
aux_loss.npy (f64 [1]), aux_d_logits.npy (f64).
Order and ties follow tw_router.h: descending selection score, ties to the lower id.
"""
import argparse
import math
import os
import shutil

import ml_dtypes
import numpy as np


# exp through the C library one element at a time: NumPy's f64 exp takes a SIMD path on CPUs with
# AVX-512 whose last bit differs from the scalar one, and the goldens must be byte-identical
# wherever they are regenerated (gen_goldens.py --check). The arrays here are tiny.
_exp = np.frompyfunc(math.exp, 1, 1)


def exp(x):
    return np.asarray(_exp(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def softmax(x):
    z = exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def sigmoid(x):
    return 1.0 / (1.0 + exp(-x))


def order_desc(v, ids):
    """ids sorted by descending v, ties to the lower id."""
    return [ids[i] for i in np.lexsort((np.asarray(ids), -np.asarray(v)))]


def select(sel_row, c):
    E = sel_row.shape[0]
    allowed = list(range(E))
    if c["num_groups"] > 0:
        G, gk = c["num_groups"], c["group_topk"]
        n, per = E // G, c["topk"] // gk
        gscore = [np.sort(sel_row[g * n:(g + 1) * n])[::-1][:per].sum() for g in range(G)]
        kept = order_desc(gscore, list(range(G)))[:gk]
        allowed = [e for e in range(E) if e // n in kept]
    return order_desc(sel_row[allowed], allowed)[:c["topk"]]


def scores(x, c, bias):
    """(s, sel) for logits x [T, E] in f64."""
    if c["score"] == "sigmoid":
        s = sigmoid(x)
        return s, s + (bias if bias is not None else 0.0)
    if c["pre_softmax"]:
        s = softmax(x)
        return s, s
    return x, x


def weights(x, idx, c, bias):
    """topk weights [T, k] for logits x with the selection idx held fixed."""
    s, _ = scores(x, c, bias)
    v = np.take_along_axis(s, idx, axis=1)
    if c["score"] == "softmax" and not c["pre_softmax"]:
        w = softmax(v)
    elif c["score"] == "sigmoid" and c["topk"] > 1:
        w = v / (v.sum(axis=1, keepdims=True) + 1e-20)
    else:
        w = v
    return w * c["scaling_factor"]


def router_bwd(x, idx, dw, c, bias):
    """Analytic d_logits (written from the formulas, not from autodiff)."""
    T, E = x.shape
    g = dw * c["scaling_factor"]
    dl = np.zeros((T, E))
    for t in range(T):
        ids = idx[t]
        if c["score"] == "softmax" and not c["pre_softmax"]:
            p = softmax(x[t, ids])
            dl[t, ids] = p * (g[t] - (g[t] * p).sum())
        elif c["score"] == "softmax":
            s = softmax(x[t])
            ds = np.zeros(E)
            ds[ids] = g[t]
            dl[t] = s * (ds - (ds * s).sum())
        else:
            s = sigmoid(x[t])
            ds = np.zeros(E)
            if c["topk"] > 1:
                S = s[ids].sum() + 1e-20
                ds[ids] = g[t] / S - (g[t] * s[ids]).sum() / S ** 2
            else:
                ds[ids] = g[t]
            dl[t] = ds * s * (1 - s)
    return dl


def aux_probs(x, c):
    if c["score"] == "softmax":
        return softmax(x)
    s = sigmoid(x)
    return s / s.sum(axis=1, keepdims=True)


def aux_loss(x, counts, c):
    T, E = x.shape
    return c["coeff"] * E / (c["topk"] * T * T) * (aux_probs(x, c).sum(axis=0) * counts).sum()


def aux_bwd(x, counts, c):
    T, E = x.shape
    v = c["d_loss"] * c["coeff"] * E / (c["topk"] * T * T) * counts.astype(np.float64)
    dl = np.zeros((T, E))
    for t in range(T):
        if c["score"] == "softmax":
            p = softmax(x[t])
            dl[t] = p * (v - (v * p).sum())
        else:
            s = sigmoid(x[t])
            S = s.sum()
            p = s / S
            dl[t] = (v - (v * p).sum()) / S * s * (1 - s)
    return dl


def finite_diff(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        g[i] = (f(xp) - f(xm)) / (2 * h)
    return g


CASES = [
    # name, T, E, overrides
    ("softmax_post_t17_e8_k2", 17, 8, dict(score="softmax", topk=2)),
    ("softmax_pre_t5_e16_k4_sf2.5", 5, 16, dict(score="softmax", pre_softmax=1, topk=4, scaling_factor=2.5)),
    ("softmax_post_t9_e5_k5", 9, 5, dict(score="softmax", topk=5)),
    ("sigmoid_t13_e7_k1", 13, 7, dict(score="sigmoid", topk=1)),
    ("sigmoid_bias_t9_e32_k4", 9, 32, dict(score="sigmoid", topk=4, bias=True)),
    ("sigmoid_group_t11_e16_g4_gk2_k4", 11, 16, dict(score="sigmoid", topk=4, num_groups=4, group_topk=2, bias=True)),
    ("softmax_group_t7_e12_g3_gk1_k2", 7, 12, dict(score="softmax", topk=2, num_groups=3, group_topk=1)),
    ("softmax_pre_group_t6_e8_g4_gk3_k3", 6, 8, dict(score="softmax", pre_softmax=1, topk=3, num_groups=4, group_topk=3)),
    ("bf16_softmax_pre_t10_e8_k2", 10, 8, dict(score="softmax", pre_softmax=1, topk=2, logits_dtype="bf16")),
    ("ties_softmax_post_t6_e6_k3", 6, 6, dict(score="softmax", topk=3, ties=True)),
    ("ties_sigmoid_t6_e6_k2", 6, 6, dict(score="sigmoid", topk=2, ties=True)),
    ("ties_group_t4_e8_g4_gk2_k2", 4, 8, dict(score="softmax", topk=2, num_groups=4, group_topk=2, ties=True)),
]


def tie_logits(T, E):
    """Rows with exact ties: all equal, equal pairs, a tie at the k-th place."""
    rows = [np.zeros(E), np.array([1.0, 2.0] * (E // 2))[:E], np.array([3.0, 1.0, 3.0, 2.0, 3.0, 0.5] * E)[:E],
            np.linspace(0.5, -0.5, E), np.array([0.25] * (E - 1) + [1.0]), np.array([-1.0, 5.0] + [5.0] * (E - 2))]
    return np.array(rows[:T], dtype=np.float32)


def make_case(out, name, T, E, ov, rng):
    c = dict(score="softmax", pre_softmax=0, topk=1, num_groups=0, group_topk=0, scaling_factor=1.0,
             logits_dtype="f32", coeff=0.01, d_loss=1.25)
    c.update({k: v for k, v in ov.items() if k not in ("bias", "ties")})
    if ov.get("ties"):
        logits = tie_logits(T, E)
    else:
        logits = rng.normal(0.0, 2.0, size=(T, E)).astype(np.float32)
    if c["logits_dtype"] == "bf16":
        logits = logits.astype(ml_dtypes.bfloat16)
    x = logits.astype(np.float64)
    bias = rng.normal(0.0, 0.5, size=E).astype(np.float32) if ov.get("bias") else None
    b64 = bias.astype(np.float64) if bias is not None else None
    _, sel = scores(x, c, b64)
    idx = np.array([select(sel[t], c) for t in range(T)], dtype=np.int32).reshape(T, c["topk"])
    gaps = np.diff(np.sort(sel, axis=1), axis=1)
    # exact ties are defined; near-ties (1e-9 apart) could flip on a last-bit libm difference
    assert ((gaps == 0) | (gaps > 1e-9)).all(), name
    w = weights(x, idx, c, b64)
    counts = np.bincount(idx.ravel(), minlength=E).astype(np.int32)
    dw = rng.normal(0.0, 1.0, size=(T, c["topk"])).astype(np.float32)
    dl = router_bwd(x, idx, dw.astype(np.float64), c, b64)
    fd = finite_diff(lambda z: (weights(z, idx, c, b64) * dw).sum(), x)
    assert np.abs(fd - dl).max() < 1e-6 * max(1.0, np.abs(dl).max()), (name, np.abs(fd - dl).max())
    loss = aux_loss(x, counts, c)
    adl = aux_bwd(x, counts, c)
    afd = finite_diff(lambda z: c["d_loss"] * aux_loss(z, counts, c), x)
    assert np.abs(afd - adl).max() < 1e-8 + 1e-6 * np.abs(adl).max(), (name, np.abs(afd - adl).max())

    d = os.path.join(out, name)
    os.makedirs(d)
    keys = dict(op="router", score=c["score"], pre_softmax=c["pre_softmax"], topk=c["topk"],
                num_groups=c["num_groups"], group_topk=c["group_topk"], scaling_factor=repr(c["scaling_factor"]),
                has_bias=int(bias is not None), logits_dtype=c["logits_dtype"], coeff=repr(c["coeff"]),
                d_loss=repr(c["d_loss"]), T=T, E=E)
    with open(os.path.join(d, "case.txt"), "w") as f:
        f.write("# written by golden/gen_router.py\n")
        for k, v in keys.items():
            f.write("%s = %s\n" % (k, v))
    np.save(os.path.join(d, "logits.npy"), logits.view(np.uint16) if c["logits_dtype"] == "bf16" else logits)
    if bias is not None:
        np.save(os.path.join(d, "expert_bias.npy"), bias)
    np.save(os.path.join(d, "d_topk_weights.npy"), dw)
    np.save(os.path.join(d, "topk_idx.npy"), idx)
    np.save(os.path.join(d, "topk_weights.npy"), w)
    np.save(os.path.join(d, "counts.npy"), counts)
    np.save(os.path.join(d, "d_logits.npy"), dl)
    np.save(os.path.join(d, "aux_loss.npy"), np.array([loss]))
    np.save(os.path.join(d, "aux_d_logits.npy"), adl)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data", "router"))
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    rng = np.random.default_rng(20261124)
    for name, T, E, ov in CASES:
        make_case(args.out, name, T, E, ov, rng)
    print("router: %d cases in %s" % (len(CASES), args.out))


if __name__ == "__main__":
    main()
