#!/usr/bin/env python3
"""Golden EP dispatch / combine cases for twin (tw_ep.h), written from the header's formulas
with NumPy + ml_dtypes only (no twin code). One EP group of ep_size ranks per case.

Re-run (deterministic, seeded):  python3 golden/gen_ep.py [--out golden/data/ep]

case.txt: op = ep, ep_size, E, k, H, A (alignment), R (recv capacity), policy (error, drop),
dtype (f32, bf16, e4m3), scale_block (0, or 32: MXFP8 e8m0 row scales), expect_error (1: the
error policy must reject the demand).
Per rank r (inputs): tokens_r.npy ([T_r, H] f32, u16 bf16 codes or u8 e4m3 codes),
token_scales_r.npy (u8 e8m0 [T_r, H/32], fp8 only), topk_idx_r.npy (i32),
topk_weights_r.npy (f32), expert_out_r.npy ([R, H] f32, NaN on padding rows: must not leak),
d_out_r.npy ([T_r, H] f32), d_recv_r.npy ([R, H] f32, NaN on padding), d_recv_weights_r.npy.
Per rank r (expected, exact): recv_tokens_r, recv_scales_r (fp8), recv_weights_r, group_sizes_r, dropped_r (the
dispatch; twin fixes the slot order (source rank, t, j), so rows compare exactly; a backend
with a free order compares each slab as a multiset), out_r (weighted combine), out_unweighted_r,
d_tokens_r and d_topk_weights_r (dispatch_bwd), d_expert_out_r and d_topk_weights_combine_r
(combine_bwd); rows by source (tw_ep_dispatch_by_source, U = ep_size * max_tokens with
max_tokens = the largest T of the case): src_tokens_r [U, H] (row s * max_tokens + t = token t of
source s when one of its kept routes lands on r, else zeros), src_scales_r (fp8, [U, H/32] rows)
and recv_row_r [R] i32 (the src_tokens row of each expert-major row, -1 where none); combine_bwd
by source: d_src_r [U, H] f32 (row s * max_tokens + t = d_out of source s, token t, when one of
its kept routes lands on r, else zeros). Every f32 sum runs in the documented order (j; combine_bwd's d_topk_weights
in the warp order: 32 partials over h, then a fold) with one f32 rounding per operation, as
the header states, so the oracle must match bit for bit.
"""
import argparse
import os
import shutil

import ml_dtypes
import numpy as np

F32 = np.float32


def roundup(a, b):
    return (a + b - 1) // b * b


def layout(c, idx):
    """Per destination rank: the list of slots -> (src, t, j) or None, group sizes, drops."""
    n, E, A, R = c["ep_size"], c["E"], c["A"], c["R"]
    nle = E // n
    dests, error = [], False
    for r in range(n):
        slots = [None] * R
        gs, dropped, O, demand = [], [], 0, 0
        for l in range(nle):
            e = r * nle + l
            routes = [(s, t, j) for s in range(n) for t in range(idx[s].shape[0]) for j in range(c["k"])
                      if idx[s][t, j] == e]
            demand += roundup(len(routes), A)
            kept = min(len(routes), R - O)
            for i in range(kept):
                slots[O + i] = routes[i]
            gs.append(roundup(kept, A))
            dropped.append(len(routes) - kept)
            O += roundup(kept, A)
        if demand > R and c["policy"] == "error":
            error = True
        dests.append((slots, np.array(gs, np.int32), np.array(dropped, np.int32)))
    return dests, error


def f32_sum(terms):
    """Sequential f32 sum from +0 in list order (each term already f32)."""
    acc = np.zeros_like(terms[0]) if terms else None
    for x in terms:
        acc = (acc + x).astype(F32)
    return acc


def warp_order_dot(a, b):
    """combine_bwd's d_topk_weights: sum_h a[h] * b[h] in the header's warp order. Each product
    rounded to f32; partial l in 0..31 adds the products of the h with (h // 8) % 32 == l, from
    +0, one at a time in increasing h; then for m = 16, 8, 4, 2, 1: P[l] += P[l + m] for l < m."""
    P = [F32(0)] * 32
    for h in range(len(a)):
        p = F32(F32(a[h]) * F32(b[h]))
        P[(h // 8) % 32] = F32(P[(h // 8) % 32] + p)
    for m in (16, 8, 4, 2, 1):
        for l in range(m):
            P[l] = F32(P[l] + P[l + m])
    return P[0]


def make_case(root, name, c, rng):
    n, E, k, H, R = c["ep_size"], c["E"], c["k"], c["H"], c["R"]
    nle = E // n
    T = c["T"]
    idx, w, x, xs, dout, scl = [], [], [], [], [], []
    sc = H // 32 if c["dtype"] == "e4m3" else 0
    for r in range(n):
        ids = np.zeros((T[r], k), np.int32)
        for t in range(T[r]):
            p = None
            if c["dist"] == "hot":
                p = np.full(E, 0.2 / (E - 1)); p[0] = 0.8
            ids[t] = rng.choice(E, size=k, replace=False, p=p)
        idx.append(ids)
        w.append(rng.uniform(0.05, 1.0, size=(T[r], k)).astype(F32))
        v = rng.uniform(-2, 2, size=(T[r], H)).astype(F32)
        scl.append(rng.integers(100, 150, size=(T[r], sc), dtype=np.uint8))
        if c["dtype"] == "bf16":
            b = v.astype(ml_dtypes.bfloat16)
            xs.append(b.view(np.uint16))
            x.append(b.astype(F32))
        elif c["dtype"] == "e4m3":  # rows travel as bytes with their scales
            b = v.astype(ml_dtypes.float8_e4m3fn)
            xs.append(b.view(np.uint8))
            x.append(b.astype(F32))
        else:
            xs.append(v)
            x.append(v)
        dout.append(rng.uniform(-1, 1, size=(T[r], H)).astype(F32))
    dests, error = layout(c, idx)
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "case.txt"), "w") as f:
        f.write("# written by golden/gen_ep.py\nop = ep\n")
        for key in ("ep_size", "E", "k", "H", "A", "R", "policy", "dtype"):
            f.write("%s = %s\n" % (key, c[key]))
        f.write("scale_block = %d\n" % (32 if sc else 0))
        f.write("expect_error = %d\n" % int(error))
    for r in range(n):
        np.save(os.path.join(d, "tokens_%d.npy" % r), xs[r])
        if sc:
            np.save(os.path.join(d, "token_scales_%d.npy" % r), scl[r])
        np.save(os.path.join(d, "topk_idx_%d.npy" % r), idx[r])
        np.save(os.path.join(d, "topk_weights_%d.npy" % r), w[r])
        np.save(os.path.join(d, "d_out_%d.npy" % r), dout[r])
    if error:
        return
    # the expert outputs and upstream gradients each destination holds; NaN where no route
    y, dy, dyw = [], [], []
    for r in range(n):
        slots = dests[r][0]
        yr = np.full((R, H), np.nan, F32)
        dyr = np.full((R, H), np.nan, F32)
        dwr = np.full(R, np.nan, F32)
        for i, s in enumerate(slots):
            if s is not None:
                yr[i] = rng.uniform(-3, 3, size=H).astype(F32)
                dyr[i] = rng.uniform(-3, 3, size=H).astype(F32)
                dwr[i] = F32(rng.uniform(-1, 1))
        y.append(yr); dy.append(dyr); dyw.append(dwr)
        np.save(os.path.join(d, "expert_out_%d.npy" % r), yr)
        np.save(os.path.join(d, "d_recv_%d.npy" % r), dyr)
        np.save(os.path.join(d, "d_recv_weights_%d.npy" % r), dwr)
    # route (s, t, j) -> (dest rank, slot)
    where = {}
    for r in range(n):
        for i, s in enumerate(dests[r][0]):
            if s is not None:
                where[s] = (r, i)
    for r in range(n):
        slots, gs, dropped = dests[r]
        recv = np.zeros((R, H), {"f32": F32, "bf16": np.uint16, "e4m3": np.uint8}[c["dtype"]])
        rscl = np.zeros((R, sc), np.uint8)
        rw = np.zeros(R, F32)
        dexp = np.zeros((R, H), F32)
        for i, s in enumerate(slots):
            if s is not None:
                src, t, j = s
                recv[i] = xs[src][t]
                rscl[i] = scl[src][t]
                rw[i] = w[src][t, j]
                dexp[i] = (w[src][t, j] * dout[src][t]).astype(F32)
        np.save(os.path.join(d, "recv_tokens_%d.npy" % r), recv)
        np.save(os.path.join(d, "recv_weights_%d.npy" % r), rw)
        if sc:
            np.save(os.path.join(d, "recv_scales_%d.npy" % r), rscl)
        np.save(os.path.join(d, "group_sizes_%d.npy" % r), gs)
        np.save(os.path.join(d, "dropped_%d.npy" % r), dropped)
        np.save(os.path.join(d, "d_expert_out_%d.npy" % r), dexp)
        # rows by source: each kept route's token once at row src * max_tokens + t
        maxT = max(T)
        src = np.zeros((n * maxT, H), recv.dtype)
        sscl = np.zeros((n * maxT, sc), np.uint8)
        dsrc = np.zeros((n * maxT, H), F32)
        rrow = np.full(R, -1, np.int32)
        for i, s_ in enumerate(slots):
            if s_ is not None:
                so, t, j = s_
                u = so * maxT + t
                src[u] = xs[so][t]
                sscl[u] = scl[so][t]
                dsrc[u] = dout[so][t]
                rrow[i] = u
        np.save(os.path.join(d, "src_tokens_%d.npy" % r), src)
        np.save(os.path.join(d, "d_src_%d.npy" % r), dsrc)
        np.save(os.path.join(d, "recv_row_%d.npy" % r), rrow)
        if sc:
            np.save(os.path.join(d, "src_scales_%d.npy" % r), sscl)
    for s in range(n):
        out = np.zeros((T[s], H), F32)
        outu = np.zeros((T[s], H), F32)
        dtok = np.zeros((T[s], H), F32)
        dtw = np.zeros((T[s], k), F32)
        dtwc = np.zeros((T[s], k), F32)
        for t in range(T[s]):
            kept = [(j, where[(s, t, j)]) for j in range(k) if (s, t, j) in where]
            zero = np.zeros(H, F32)
            out[t] = f32_sum([zero] + [(w[s][t, j] * y[r][i]).astype(F32) for j, (r, i) in kept])
            outu[t] = f32_sum([zero] + [y[r][i] for j, (r, i) in kept])
            dtok[t] = f32_sum([zero] + [dy[r][i] for j, (r, i) in kept])
            for j, (r, i) in kept:
                dtw[t, j] = dyw[r][i]
                dtwc[t, j] = warp_order_dot(dout[s][t], y[r][i])
        np.save(os.path.join(d, "out_%d.npy" % s), out)
        np.save(os.path.join(d, "out_unweighted_%d.npy" % s), outu)
        np.save(os.path.join(d, "d_tokens_%d.npy" % s), dtok)
        np.save(os.path.join(d, "d_topk_weights_%d.npy" % s), dtw)
        np.save(os.path.join(d, "d_topk_weights_combine_%d.npy" % s), dtwc)


CASES = [
    ("ep1_e4_k2_f32", dict(ep_size=1, E=4, k=2, H=5, A=1, R=0, T=[7])),
    ("ep2_e4_k2_a4_bf16", dict(ep_size=2, E=4, k=2, H=6, A=4, R=0, T=[5, 9], dtype="bf16")),
    ("ep4_e8_k3_a2_uneven_t", dict(ep_size=4, E=8, k=3, H=3, A=2, R=0, T=[4, 0, 11, 1])),
    ("ep4_e16_k4_hot_a8", dict(ep_size=4, E=16, k=4, H=4, A=8, R=0, T=[6, 6, 6, 6], dist="hot")),
    ("ep8_e8_k1_a1", dict(ep_size=8, E=8, k=1, H=2, A=1, R=0, T=[3, 1, 4, 1, 5, 9, 2, 6])),
    ("ep2_e4_k2_drop_hot", dict(ep_size=2, E=4, k=2, H=4, A=4, R=8, T=[10, 12], dist="hot", policy="drop")),
    ("ep4_e8_k2_drop_a1", dict(ep_size=4, E=8, k=2, H=3, A=1, R=5, T=[6, 6, 6, 6], dist="hot", policy="drop")),
    ("ep2_e4_k2_e4m3_mxfp8_scales", dict(ep_size=2, E=4, k=2, H=64, A=2, R=0, T=[3, 5], dtype="e4m3")),
    ("ep2_e4_k2_error_policy", dict(ep_size=2, E=4, k=2, H=4, A=4, R=8, T=[10, 12], dist="hot", policy="error")),
]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data", "ep"))
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    rng = np.random.default_rng(1224)
    for name, c in CASES:
        c = dict(dict(dtype="f32", policy="error", dist="uniform"), **c)
        if c["R"] == 0:  # the no-drop capacity of tw_ep_capacity_no_drop
            nle = c["E"] // c["ep_size"]
            c["R"] = roundup(c["ep_size"] * max(c["T"]) * min(c["k"], nle) + nle * (c["A"] - 1), c["A"])
        make_case(args.out, name, c, rng)
    print("ep: %d cases in %s" % (len(CASES), args.out))


if __name__ == "__main__":
    main()
