#!/usr/bin/env python3
"""Goldens for the MoE block (include/twin/tw_moe.h): the block written plainly in JAX on CPU
in f64, every expert evaluated densely on every token with a routing mask (no dispatch, no
capacity, no grouped GEMM), gradients by jax.grad. Never uses twin's code.

Re-run (from the repository root; deterministic, seeded):
    python3 golden/gen_moe.py          # writes golden/data/moe/<case>/
Needs numpy, ml_dtypes and jax (written with jax 0.10.2, CPU).

Model, per token t (E experts, k chosen, F the FFN width):
    logits = x @ gate
    router (TE semantics): softmax after top-k, softmax before top-k, or sigmoid (optional
      expert bias steering the choice only; weights renormalised when k > 1); group-limited
      top-k when num_groups > 0; weights times scaling. The chosen set is a constant for the
      gradient (stop_gradient on the selection), as in every router.
    expert e on all tokens: h = x @ wi[e] + bi[e];  a = act(h[:, :F]) * h[:, F:]
      late:  out = sum_e w[t, e] * (a @ wo[e] + bo[e])
      early: out = sum_{e chosen} ((w[t, e] * a) @ wo[e] + bo[e])
    aux = coeff * E / (k * T^2) * sum_e (sum_t p[t, e]) * count[e], p = softmax(logits) or
      sigmoid normalised over the experts, count[e] = tokens choosing e (a constant).
    L = sum(out * d_out) + aux   ->  dx, dgate, dwi, dwo, dbi, dbo = dL/d(...)
Selection is made robust: a case is redrawn until every token's k-th and (k+1)-th scores
(and the kept and dropped group scores) differ by more than 1e-3, so twin's f32 selection
equals this f64 one.

Each case directory holds moe.txt (key = value) and
    x.npy f32 [T, H], gate.npy f32 [H, E], wi.npy f32 [E, H, 2F], wo.npy f32 [E, F, H],
    bi.npy f32 [E, 2F], bo.npy f32 [E, H] (bias = 1 only), expert_bias.npy f32 [E] (when
    set), d_out.npy f32 [T, H]  (bf16 and fp8_* cases: every input is a bf16 value, stored as f32;
    the golden is the exact block: the fp8 recipes' quantization is what twin's budget covers)
    idx.npy i32 [T, k]  the chosen experts, by descending score, ties by ascending id
    out.npy f64 [T, H], aux.npy f64 [], dx.npy, dgate.npy, dwi.npy, dwo.npy, dbi.npy, dbo.npy f64
f64 results are rounded to 40 significant bits (stable across JAX builds).
"""
import os
import sys

import ml_dtypes
import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "moe")

# name, T, H, F, E, k, score, pre, groups, gtopk, scaling, act, weighting, coeff, bias, ebias, align, recipe
CASES = [
    ("swiglu_late", 12, 8, 6, 4, 2, "softmax", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "f32"),
    ("swiglu_early", 12, 8, 6, 4, 2, "softmax", 0, 0, 0, 1.0, "swiglu", "early", 0.01, 1, 0, 1, "f32"),
    ("geglu_late_nobias", 10, 6, 5, 4, 2, "softmax", 1, 0, 0, 1.0, "geglu", "late", 0.0, 0, 0, 4, "f32"),
    ("bilinear_early", 12, 7, 3, 6, 3, "softmax", 0, 0, 0, 2.0, "bilinear", "early", 0.1, 1, 0, 1, "f32"),
    ("k1", 12, 8, 4, 4, 1, "softmax", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "f32"),
    ("k_all_experts", 8, 5, 4, 3, 3, "softmax", 1, 0, 0, 1.0, "swiglu", "late", 0.01, 0, 0, 1, "f32"),
    ("sigmoid_bias", 16, 8, 6, 8, 3, "sigmoid", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 1, 2, "f32"),
    ("sigmoid_k1_early", 8, 6, 4, 4, 1, "sigmoid", 0, 0, 0, 1.5, "geglu", "early", 0.02, 0, 0, 1, "f32"),
    ("group_limited", 10, 8, 4, 8, 4, "softmax", 0, 4, 2, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "f32"),
    ("idle_experts", 4, 8, 6, 16, 2, "softmax", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 8, "f32"),
    ("awkward_sizes", 17, 13, 7, 5, 2, "softmax", 0, 0, 0, 1.0, "geglu", "late", 0.05, 1, 0, 4, "f32"),
    ("bf16_late", 16, 16, 8, 4, 2, "softmax", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "bf16"),
    ("bf16_early", 16, 16, 8, 8, 2, "sigmoid", 0, 0, 0, 1.0, "swiglu", "early", 0.01, 0, 0, 4, "bf16"),
    # fp8 recipes: bf16 values in, every expert GEMM on e4m3 operands; H and F past one
    # 128-block (partial blocks at the ends) so the block scales of 1x128/128x128/MXFP8 vary.
    ("fp8_current_late", 24, 136, 72, 2, 1, "softmax", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "fp8_current"),
    ("fp8_block_late", 24, 136, 72, 2, 2, "softmax", 0, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "fp8_block"),
    ("fp8_block_early", 32, 136, 40, 4, 3, "sigmoid", 0, 0, 0, 1.0, "geglu", "early", 0.01, 0, 1, 4, "fp8_block"),
    ("fp8_mxfp8_late", 24, 136, 72, 2, 1, "softmax", 1, 0, 0, 1.0, "swiglu", "late", 0.01, 1, 0, 1, "fp8_mxfp8"),
    ("fp8_mxfp8_early", 16, 96, 40, 4, 1, "softmax", 0, 0, 0, 1.0, "bilinear", "early", 0.02, 1, 0, 2, "fp8_mxfp8"),
]

GELU_C = np.sqrt(2.0 / np.pi)


def act(name, g):
    if name == "swiglu":
        return g * jax.nn.sigmoid(g)
    if name == "geglu":
        return 0.5 * g * (1.0 + jnp.tanh(GELU_C * (g + 0.044715 * g ** 3)))
    return g


def select(sel, k, groups, gtopk):
    """Chosen experts per token (numpy, f64): descending sel, ties by ascending id; with
    groups, only experts of the gtopk best groups (group score: sum of its top k/gtopk)."""
    T, E = sel.shape
    idx = np.zeros((T, k), np.int32)
    margin = np.inf
    for t in range(T):
        s = sel[t].copy()
        if groups:
            per = E // groups
            gs = np.array([np.sort(s[g * per:(g + 1) * per])[::-1][:k // gtopk].sum() for g in range(groups)])
            gorder = sorted(range(groups), key=lambda g: (-gs[g], g))
            if gtopk < groups:
                margin = min(margin, abs(gs[gorder[gtopk - 1]] - gs[gorder[gtopk]]))
            for g in gorder[gtopk:]:
                s[g * per:(g + 1) * per] = -np.inf
        order = sorted(range(E), key=lambda e: (-s[e], e))
        idx[t] = order[:k]
        if k < E and np.isfinite(s[order[k]]):
            margin = min(margin, abs(s[order[k - 1]] - s[order[k]]))
    return idx, margin


def scores(logits, score, pre, ebias):
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1) if pre else logits
    s = jax.nn.sigmoid(logits)
    return s + ebias if ebias is not None else s


def block(params, x, d_out, c, idx):
    (_, T, H, F, E, k, score, pre, groups, gtopk, scaling, actname, weighting, coeff, bias, _, _, _) = c
    gate, wi, wo, bi, bo, ebias = params["gate"], params["wi"], params["wo"], params.get("bi"), params.get("bo"), params.get("ebias")
    logits = x @ gate
    chosen = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], idx].set(1.0)  # constant: from the f64 selection
    if score == "softmax" and not pre:
        sel_logits = jnp.where(chosen > 0, logits, -jnp.inf)
        w = jax.nn.softmax(sel_logits, axis=-1) * chosen
    elif score == "softmax":
        w = jax.nn.softmax(logits, axis=-1) * chosen
    else:
        w = jax.nn.sigmoid(logits) * chosen
        if k > 1:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * scaling
    out = jnp.zeros((T, H))
    for e in range(E):
        h = x @ wi[e] + (bi[e] if bias else 0.0)
        a = act(actname, h[:, :F]) * h[:, F:]
        if weighting == "early":
            eo = (a * w[:, e:e + 1]) @ wo[e] + (bo[e] if bias else 0.0)
            out = out + chosen[:, e:e + 1] * eo
        else:
            eo = a @ wo[e] + (bo[e] if bias else 0.0)
            out = out + w[:, e:e + 1] * eo
    if score == "softmax":
        p = jax.nn.softmax(logits, axis=-1)
    else:
        s = jax.nn.sigmoid(logits)
        p = s / jnp.sum(s, axis=-1, keepdims=True)
    counts = jnp.sum(chosen, axis=0)
    aux = coeff * E / (k * T * T) * jnp.sum(jnp.sum(p, axis=0) * counts)
    return jnp.sum(out * d_out) + aux, (out, aux)


def round40(a):
    a = np.asarray(a, np.float64)
    m, e = np.frexp(a)
    return np.ldexp(np.round(m * 2.0**40) / 2.0**40, e)


def to_bf16_values(a):
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def draw(c, seed):
    (_, T, H, F, E, k, score, pre, groups, gtopk, _, _, _, _, bias, ebias, _, recipe) = c
    rng = np.random.default_rng(seed)
    f = to_bf16_values if recipe != "f32" else (lambda a: a)
    arr = {
        "x": f(rng.uniform(-1, 1, (T, H)).astype(np.float32)),
        "gate": f((rng.uniform(-1, 1, (H, E)) * 2.0 / np.sqrt(H)).astype(np.float32)),
        "wi": f((rng.uniform(-1, 1, (E, H, 2 * F)) / np.sqrt(H)).astype(np.float32)),
        "wo": f((rng.uniform(-1, 1, (E, F, H)) / np.sqrt(F)).astype(np.float32)),
        "d_out": f(rng.uniform(-1, 1, (T, H)).astype(np.float32)),
    }
    if bias:
        arr["bi"] = rng.uniform(-0.2, 0.2, (E, 2 * F)).astype(np.float32)
        arr["bo"] = rng.uniform(-0.2, 0.2, (E, H)).astype(np.float32)
    if ebias:
        arr["expert_bias"] = rng.uniform(-0.1, 0.1, (E,)).astype(np.float32)
    return arr


def main():
    os.makedirs(OUT, exist_ok=True)
    for i, c in enumerate(CASES):
        name, T, H, F, E, k, score, pre, groups, gtopk, scaling, actname, weighting, coeff, bias, ebias, align, recipe = c
        for attempt in range(200):
            arr = draw(c, 20261124 + 1000 * i + attempt)
            logits = arr["x"].astype(np.float64) @ arr["gate"].astype(np.float64)
            eb = arr.get("expert_bias")
            sel = np.asarray(scores(jnp.asarray(logits), score, pre, None if eb is None else jnp.asarray(eb, jnp.float64)))
            idx, margin = select(sel, k, groups, gtopk)
            if margin > 1e-3:
                break
        else:
            raise SystemExit("%s: no draw with a selection margin above 1e-3" % name)
        params = {kk: jnp.asarray(arr[kk], jnp.float64) for kk in ("gate", "wi", "wo")}
        if bias:
            params["bi"] = jnp.asarray(arr["bi"], jnp.float64)
            params["bo"] = jnp.asarray(arr["bo"], jnp.float64)
        if eb is not None:
            params["ebias"] = jnp.asarray(eb, jnp.float64)
        x64, d64 = jnp.asarray(arr["x"], jnp.float64), jnp.asarray(arr["d_out"], jnp.float64)
        f = jax.jit(jax.value_and_grad(lambda p, x: block(p, x, d64, c, idx), argnums=(0, 1), has_aux=True))
        (_, (out, aux)), (gp, dx) = f(params, x64)
        d_ = os.path.join(OUT, name)
        os.makedirs(d_, exist_ok=True)
        with open(os.path.join(d_, "moe.txt"), "w") as fh:
            fh.write("# MoE block, dense JAX model in f64 (golden/gen_moe.py); L = sum(out * d_out) + aux\n")
            for kk, v in (("T", T), ("H", H), ("F", F), ("E", E), ("k", k), ("score", score), ("pre_softmax", pre),
                          ("num_groups", groups), ("group_topk", gtopk), ("scaling", scaling), ("act", actname),
                          ("weighting", weighting), ("aux_coeff", coeff), ("bias", bias), ("expert_bias", ebias),
                          ("alignment", align), ("recipe", recipe), ("margin", "%.3g" % margin)):
                fh.write("%s = %s\n" % (kk, v))
        for kk, v in arr.items():
            np.save(os.path.join(d_, kk + ".npy"), v)
        np.save(os.path.join(d_, "idx.npy"), idx)
        outs = {"out": out, "aux": aux, "dx": dx, "dgate": gp["gate"], "dwi": gp["wi"], "dwo": gp["wo"]}
        if bias:
            outs["dbi"], outs["dbo"] = gp["bi"], gp["bo"]
        for kk, v in outs.items():
            np.save(os.path.join(d_, kk + ".npy"), round40(v))
    print("moe: %d cases" % len(CASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
