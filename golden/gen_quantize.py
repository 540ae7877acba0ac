#!/usr/bin/env python3
"""Goldens for grouped quantize / dequantize / delayed scale update (include/twin/tw_quantize.h).

Written from the header's formulas with NumPy + ml_dtypes only (never twin's C code), so the
oracle is checked against an independent implementation. Every scale computation is f32.

    quantize_np(x_f32, group_sizes, mode, qdtype, layout, pow2_scales=False, swizzled=True,
                scale=None) -> dict(row_data, row_scale_inv, col_data, col_scale_inv, amax)
    dequantize_np(data, scale_inv, group_sizes, mode, qdtype, colwise, rows, cols,
                  swizzled=True, out_dtype="f32") -> out
    delayed_update_np(amax_history, scale, amax, qdtype, algo="max", margin=0)
        -> (amax_history_out, scale_out)

Outputs have the exact shapes of tw_quantize_output_shapes; elements an operation must not
write hold the poison byte 0xA5. Run: python3 golden/gen_quantize.py [out_dir]
(default golden/data/quantize, which it rewrites).
"""
import os
import shutil
import sys
import zlib

import ml_dtypes
import numpy as np

POISON = 0xA5
F32 = np.float32
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
MODES = ["current", "delayed", "mxfp8", "block1x128", "block128x128"]
LAYOUTS = {"rowwise": (True, False), "colwise": (False, True), "rowwise_colwise": (True, True)}


def ceil_div(a, b):
    return -(-a // b)


def round_up(a, b):
    return ceil_div(a, b) * b


def poisoned(shape, dtype):
    """An array of `dtype` whose every byte is the poison byte."""
    n = int(np.prod(shape))
    return np.full(n * np.dtype(dtype).itemsize, POISON, np.uint8).view(dtype).reshape(shape)


def tile_capacity(M, G):
    """T_cap: the most 128-row tiles G groups of M rows in all can need."""
    return (M + 127 * min(G, M)) // 128


def output_shapes(mode, M, K, G):
    """(row_data, row_scale_inv, col_data, col_scale_inv) shapes and scale dtype."""
    T = tile_capacity(M, G)
    if mode in ("current", "delayed"):
        return (M, K), (G,), (M * K,), (G,), np.float32
    if mode == "mxfp8":
        return (M, K), (128 * T, round_up(ceil_div(K, 32), 4)), (M, K), (4 * T, round_up(K, 128)), np.uint8
    if mode == "block1x128":
        return (M, K), (ceil_div(K, 128), round_up(M, 4)), (M * K,), (T, round_up(K, 4)), np.float32
    return (M, K), (T, ceil_div(K, 128)), (M * K,), (ceil_div(K, 128), T), np.float32


def canonical(v):
    """NaN results are written as the positive quiet NaN (f32 0x7FC00000), whatever their sign."""
    v = np.asarray(v, F32)
    return np.where(np.isnan(v), F32(np.nan), v).astype(F32)


def sat(v, qdtype):
    """RNE to fp8 with satfinite: clip to +-max then cast; NaN -> the positive NaN code
    (0x7F e4m3, 0x7E e5m2). Returns u8 codes."""
    m = F32(FP8_MAX[qdtype])
    return np.clip(canonical(v), -m, m).astype(FP8[qdtype]).view(np.uint8)


def decode(codes, qdtype):
    return codes.view(FP8[qdtype]).astype(F32)


def abs_max(a, axis=None):
    """max |a| (0 for no elements); a NaN element gives NaN (np.max propagates it)."""
    a = np.abs(a.astype(F32))
    if a.size == 0:
        return F32(0) if axis is None else np.zeros([d for i, d in enumerate(a.shape) if i != axis], F32)
    return np.max(a, axis=axis)


def compute_scale(amax, qdtype, pow2):
    """1 for amax 0/inf/NaN; fp8_max / amax in f32 (FLT_MAX on overflow); pow2 clears the mantissa."""
    amax = np.asarray(amax, F32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(FP8_MAX[qdtype]) / amax
    s = np.where(np.isinf(s), np.finfo(F32).max, s).astype(F32)
    s = np.where((amax == 0) | ~np.isfinite(amax), F32(1), s).astype(F32)
    if pow2:
        s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(F32)
    return s


def e8m0_ceil(v):
    """Smallest power of two >= v as a biased exponent, saturating at 254; <= 2^-127 -> 0,
    NaN -> 255. Written with frexp (v = m 2^x, 0.5 <= m < 1), not with bit fiddling."""
    v = np.asarray(v, F32)
    out = np.zeros(v.shape, np.int64)
    fin = np.isfinite(v) & (v > 0)
    m, x = np.frexp(v[fin])
    e = np.where(m == 0.5, x - 1, x).astype(np.int64) + 127
    out[fin] = np.clip(e, 0, 254)
    out[np.isinf(v) & (v > 0)] = 254
    out[np.isnan(v)] = 255
    return out.astype(np.uint8)


def e8m0_value(e):
    """2^(e-127) in f32 (0 -> 2^-127, subnormal); 255 -> NaN."""
    e = np.asarray(e).astype(np.int64)
    v = np.ldexp(np.ones(e.shape, np.float64), e - 127).astype(F32)
    return np.where(e == 255, F32(np.nan), v).astype(F32)


def mxfp8_multiplier(e):
    """2^(127-e) in f32, exact (e = 254 gives the subnormal 2^-127); e = 255 -> NaN."""
    e = np.asarray(e).astype(np.int64)
    v = np.ldexp(np.ones(e.shape, np.float64), 127 - e).astype(F32)
    return np.where(e == 255, F32(np.nan), v).astype(F32)


def swizzle(S):
    """cuBLAS 128x4 tiling of S[R, C] (R % 128 == 0, C % 4 == 0), as a flat array."""
    R, C = S.shape
    return S.reshape(R // 128, 4, 32, C // 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1)


def unswizzle(flat, R, C):
    return flat.reshape(R // 128, C // 4, 32, 4, 4).transpose(0, 3, 2, 1, 4).reshape(R, C)


def offsets(group_sizes):
    gs = [int(g) for g in group_sizes]
    off = np.concatenate([[0], np.cumsum(gs)]).astype(np.int64)
    tiles = np.concatenate([[0], np.cumsum([ceil_div(g, 128) for g in gs])]).astype(np.int64)
    return gs, off, tiles


def pad_to(a, rows, cols):
    out = np.zeros((rows, cols), F32)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def quantize_np(x_f32, group_sizes, mode, qdtype, layout, pow2_scales=False, swizzled=True, scale=None):
    x = np.asarray(x_f32, F32)
    M, K = x.shape
    gs, off, tiles = offsets(group_sizes)
    G = len(gs)
    want_row, want_col = LAYOUTS[layout]
    rd_s, rs_s, cd_s, cs_s, sdt = output_shapes(mode, M, K, G)
    rd, cd = poisoned(rd_s, np.uint8), poisoned(cd_s, np.uint8)
    rs, cs = poisoned(rs_s, sdt), poisoned(cs_s, sdt)
    amax = np.zeros(G, F32)
    inv_max = F32(1) / F32(FP8_MAX[qdtype])
    for g in range(G):
        m, o = gs[g], off[g]
        xg = x[o:o + m]
        amax[g] = canonical(abs_max(xg))
        if mode in ("current", "delayed"):
            s = compute_scale(amax[g], qdtype, pow2_scales) if mode == "current" else F32(scale[g])
            q = sat(xg * s, qdtype)
            rd[o:o + m] = q
            cd[o * K:(o + m) * K] = q.T.reshape(-1)
            rs[g] = cs[g] = canonical(F32(1) / s)
        elif mode == "mxfp8":
            nb = ceil_div(K, 32)
            # rowwise: blocks of 32 along k
            xp = pad_to(xg, m, 32 * nb).reshape(m, nb, 32)
            e = e8m0_ceil(abs_max(xp, axis=2) * inv_max)                   # [m, nb]
            mult = np.repeat(mxfp8_multiplier(e), 32, axis=1)[:, :K]
            rd[o:o + m] = sat(xg * mult, qdtype)
            C = rs_s[1]
            S = np.zeros((128 * ceil_div(m, 128), C), np.uint8)
            S[:m, :nb] = e
            rs.reshape(-1)[128 * tiles[g] * C:128 * tiles[g + 1] * C] = swizzle(S) if swizzled else S.reshape(-1)
            # colwise: blocks of 32 rows of the group
            nr = ceil_div(m, 32)
            xp = pad_to(xg, 32 * nr, K).reshape(nr, 32, K)
            e = e8m0_ceil(abs_max(xp, axis=1) * inv_max)                   # [nr, K]
            mult = np.repeat(mxfp8_multiplier(e), 32, axis=0)[:m]
            cd[o:o + m] = sat(xg * mult, qdtype)
            Cc = cs_s[1]
            S = np.zeros((4 * ceil_div(m, 128), Cc), np.uint8)
            S[:nr, :K] = e
            cs.reshape(-1)[4 * tiles[g] * Cc:4 * tiles[g + 1] * Cc] = swizzle(S.T.copy()) if swizzled else S.reshape(-1)
        elif mode == "block1x128":
            nb = ceil_div(K, 128)
            s = compute_scale(abs_max(pad_to(xg, m, 128 * nb).reshape(m, nb, 128), axis=2), qdtype, pow2_scales)
            rd[o:o + m] = sat(xg * np.repeat(s, 128, axis=1)[:, :K], qdtype)
            rs[:, o:o + m] = (F32(1) / s).T
            nr = ceil_div(m, 128)
            s = compute_scale(abs_max(pad_to(xg, 128 * nr, K).reshape(nr, 128, K), axis=1), qdtype, pow2_scales)
            q = sat(xg * np.repeat(s, 128, axis=0)[:m], qdtype)
            cd[o * K:(o + m) * K] = q.T.reshape(-1)
            cs[tiles[g]:tiles[g + 1], :K] = F32(1) / s
        else:  # block128x128
            nr, nb = ceil_div(m, 128), ceil_div(K, 128)
            tiles_x = pad_to(xg, 128 * nr, 128 * nb).reshape(nr, 128, nb, 128)
            s = compute_scale(np.max(np.abs(tiles_x), axis=(1, 3)) if m else np.zeros((0, nb), F32),
                              qdtype, pow2_scales)                           # [nr, nb]
            full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:m, :K]
            q = sat(xg * full, qdtype)
            rd[o:o + m] = q
            cd[o * K:(o + m) * K] = q.T.reshape(-1)
            rs[tiles[g]:tiles[g + 1], :] = F32(1) / s
            cs[:, tiles[g]:tiles[g + 1]] = (F32(1) / s).T
    out = dict(amax=amax)
    if want_row:
        out.update(row_data=rd, row_scale_inv=rs)
    if want_col:
        out.update(col_data=cd, col_scale_inv=cs)
    return out


def dequantize_np(data, scale_inv, group_sizes, mode, qdtype, colwise, rows, cols, swizzled=True,
                  out_dtype="f32"):
    """decode(q) * scale_inv (f32), into [rows, cols]; rows past the groups keep the poison.
    out_dtype bf16/f16 rounds the f32 value (RNE) and returns u16 codes."""
    M, K = rows, cols
    gs, off, tiles = offsets(group_sizes)
    out = poisoned((M, K), np.float32 if out_dtype == "f32" else np.uint16)
    flat_d = np.asarray(data).reshape(-1)
    flat_s = np.asarray(scale_inv).reshape(-1)
    ld = scale_inv.shape[1] if scale_inv.ndim == 2 else 0
    for g, m in enumerate(gs):
        o = off[g]
        if mode == "mxfp8" or not colwise:
            q = decode(flat_d[o * K:(o + m) * K].reshape(m, K), qdtype)
        else:
            q = decode(flat_d[o * K:(o + m) * K].reshape(K, m), qdtype).T
        if mode in ("current", "delayed"):
            s = np.full((m, K), flat_s[g], F32)
        elif mode == "mxfp8" and not colwise:
            R = 128 * ceil_div(m, 128)
            blk = flat_s[128 * tiles[g] * ld:128 * tiles[g + 1] * ld]
            S = unswizzle(blk, R, ld) if swizzled else blk.reshape(R, ld)
            s = np.repeat(e8m0_value(S[:m]), 32, axis=1)[:, :K]
        elif mode == "mxfp8":
            Rc = 4 * ceil_div(m, 128)
            blk = flat_s[4 * tiles[g] * ld:4 * tiles[g + 1] * ld]
            S = unswizzle(blk, ld, Rc).T if swizzled else blk.reshape(Rc, ld)
            s = np.repeat(e8m0_value(S), 32, axis=0)[:m, :K]
        elif mode == "block1x128" and not colwise:
            s = np.repeat(scale_inv[:, o:o + m].T, 128, axis=1)[:, :K]
        elif mode == "block1x128":
            s = np.repeat(scale_inv[tiles[g]:tiles[g + 1], :K], 128, axis=0)[:m]
        else:
            t = scale_inv[tiles[g]:tiles[g + 1]] if not colwise else scale_inv[:, tiles[g]:tiles[g + 1]].T
            s = np.repeat(np.repeat(t, 128, axis=0), 128, axis=1)[:m, :K]
        v = canonical(q * s.astype(F32))
        if out_dtype == "f32":
            out[o:o + m] = v
        elif out_dtype == "bf16":
            out[o:o + m] = v.astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            out[o:o + m] = v.astype(np.float16).view(np.uint16)
    return out


def delayed_update_np(amax_history, scale, amax, qdtype, algo="max", margin=0):
    """TE's DelayedScaleQuantizer.update per group (tw_quantize.h)."""
    hist = np.array(amax_history, F32, copy=True)
    scale = np.array(scale, F32, copy=True)
    hist[:, 0] = amax
    a = np.max(hist, axis=1) if algo == "max" else hist[:, 0].copy()
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(FP8_MAX[qdtype]) / a
    s = np.where(np.isinf(s), np.finfo(F32).max, s).astype(F32)
    s = (s / F32(2.0 ** margin)).astype(F32)
    ok = (a > 0) & np.isfinite(a)
    scale = np.where(ok, s, scale).astype(F32)
    hist = np.roll(hist, -1, axis=1)
    hist[:, 0] = 0
    return hist, scale


# ---- the stored cases -----------------------------------------------------------------------

def make_x(rng, M, K, x_dtype, special=False):
    """Rows of different magnitudes (so blocks get different scales), rounded to x_dtype."""
    mag = 2.0 ** rng.integers(-12, 12, size=(M, 1))
    x = (rng.standard_normal((M, K)) * mag).astype(F32)
    if x_dtype == "f16":
        x = np.clip(x, -60000, 60000)
    if special:
        lim = {"f32": 3.0e38, "bf16": 3.0e38, "f16": 65504.0}[x_dtype]
        tiny = {"f32": 1.0e-40, "bf16": 1.0e-39, "f16": 6.0e-8}[x_dtype]
        vals = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, lim, -lim, tiny, -tiny, 1e-38, 464.0, 465.0,
                448.0, 57344.0, 61440.0, 240.0 + 8.0, 0.0009765625]
        if special == "rows":  # one kind per row (and per group of one row)
            x[0, 3] = np.nan
            x[1, 5] = np.inf
            x[1, 7] = -np.inf
            x[2] = 0.0
            x[3] = tiny * np.sign(x[3])
            x[3, 1] = 1.0e-38 if x_dtype != "f16" else 6.0e-8
            x[5] = lim * np.sign(x[5])
        else:
            # NaN only in the first rows, so later groups and blocks keep finite amaxes
            flat = x[max(1, M // 8):].reshape(-1)
            pos = rng.choice(flat.size, size=min(flat.size, 3 * len(vals)), replace=False)
            for i, p in enumerate(pos):
                flat[p] = vals[2 + i % (len(vals) - 2)]
            x[0, K // 2] = np.nan
            x[0, 0] = -np.nan
        if M >= 3 and special != "rows":
            x[M // 3] = 0.0            # an all-zero row: amax 0
            x[M // 3 + 1] = 1.0e-38 if x_dtype != "f16" else 6.0e-8  # tiny amax: scale overflows
            x[M // 3 + 1, 0] = 0.0
    with np.errstate(over="ignore"):
        if x_dtype == "bf16":
            codes = x.astype(ml_dtypes.bfloat16)
            return codes.astype(F32), codes.view(np.uint16)
        if x_dtype == "f16":
            codes = x.astype(np.float16)
            return codes.astype(F32), codes.view(np.uint16)
    return x, x


def save_case(root, name, keys, arrays):
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "case.txt"), "w") as f:
        f.write("# generated by golden/gen_quantize.py (NumPy + ml_dtypes)\n")
        for k, v in keys.items():
            f.write(f"{k} = {v}\n")
    for k, a in arrays.items():
        np.save(os.path.join(d, k + ".npy"), np.ascontiguousarray(a))


def seed_of(name):
    return zlib.crc32(name.encode())


# (M, K, group_sizes): awkward sizes, zero-size groups, tails (sum < M)
SHAPES = [
    (1, 1, [1]),
    (5, 17, [2, 0, 3]),
    (17, 33, [0, 17]),
    (17, 5, [5, 0, 0, 7]),          # tail of 5 rows
    (217, 130, [100, 0, 60, 40]),   # tail of 17
    (33, 128, [32, 1]),
    (40, 217, [3, 37]),
    (1000, 17, [300, 0, 129, 1, 500]),  # tail of 70
    (130, 32, [128, 2]),
    (5, 1, [0, 5]),
    (217, 33, [0, 0, 150]),         # tail of 67
    (129, 130, [129]),
]


def quantize_cases():
    cases = []
    i = 0
    for mode in MODES:
        for qdtype in ("e4m3", "e5m2"):
            for layout in LAYOUTS:
                for rep in range(2):
                    M, K, gs = SHAPES[i % len(SHAPES)]
                    x_dtype = ["f32", "bf16", "f16"][i % 3]
                    pow2 = int(mode in ("current", "block1x128", "block128x128") and rep == 1)
                    swz = int(mode == "mxfp8" and (rep == 0))
                    cases.append(dict(mode=mode, qdtype=qdtype, layout=layout, M=M, K=K, gs=gs,
                                      x_dtype=x_dtype, pow2=pow2, swizzled=swz, special=False))
                    i += 1
    # special values in every mode and dtype, both layouts at once
    for mode in MODES:
        for qdtype in ("e4m3", "e5m2"):
            for x_dtype in ("f32", "bf16", "f16"):
                M, K, gs = (217, 130, [100, 0, 60, 40]) if x_dtype == "f32" else (40, 33, [7, 0, 33])
                pow2 = int(x_dtype == "bf16" and mode in ("current", "block1x128", "block128x128"))
                cases.append(dict(mode=mode, qdtype=qdtype, layout="rowwise_colwise", M=M, K=K, gs=gs,
                                  x_dtype=x_dtype, pow2=pow2, swizzled=int(x_dtype != "f16"),
                                  special="values"))
            # one special kind per single-row group: NaN, inf, zeros, tiny (scale overflow), normal, huge
            cases.append(dict(mode=mode, qdtype=qdtype, layout="rowwise_colwise", M=7, K=33, gs=[1] * 6,
                              x_dtype="f32", pow2=0, swizzled=1, special="rows"))
    # MXFP8 compact and swizzled on several tiles per group and many groups
    for swz in (0, 1):
        cases.append(dict(mode="mxfp8", qdtype="e4m3", layout="rowwise_colwise", M=300, K=200,
                          gs=[129, 0, 1, 40, 100], x_dtype="bf16", pow2=0, swizzled=swz, special=False))
    # 128x128 and 1x128 with several tiles in both directions
    for mode in ("block1x128", "block128x128"):
        cases.append(dict(mode=mode, qdtype="e4m3", layout="rowwise_colwise", M=300, K=260,
                          gs=[257, 0, 30], x_dtype="bf16", pow2=0, swizzled=0, special=False))
    # many groups, most of them small or empty: tile offsets T(g) add up over 40 groups
    for mode in ("mxfp8", "block1x128", "block128x128", "current"):
        rng = np.random.default_rng(seed_of("many_groups_" + mode))
        sizes = rng.integers(0, 60, size=40) * (rng.random(40) < 0.6)
        sizes[7] = 300  # one group of three tiles
        cases.append(dict(mode=mode, qdtype="e4m3", layout="rowwise_colwise", M=int(sizes.sum()) + 9, K=33,
                          gs=[int(v) for v in sizes], x_dtype="bf16", pow2=0, swizzled=1, special=False))
    # M = 0: nothing but the per-group slots
    cases.append(dict(mode="current", qdtype="e4m3", layout="rowwise_colwise", M=0, K=17, gs=[0, 0],
                      x_dtype="f32", pow2=0, swizzled=0, special=False))
    cases.append(dict(mode="mxfp8", qdtype="e5m2", layout="rowwise_colwise", M=0, K=33, gs=[0],
                      x_dtype="bf16", pow2=0, swizzled=1, special=False))
    return cases


def case_name(c):
    extra = ("_pow2" if c["pow2"] else "") + (("_swz" if c["swizzled"] else "_compact") if c["mode"] == "mxfp8" else "")
    extra += "_special_" + c["special"] if c["special"] else ""
    gs = "-".join(str(g) for g in c["gs"]) if len(c["gs"]) <= 8 else f"{len(c['gs'])}groups"
    return f"{c['mode']}_{c['qdtype']}_{c['layout']}_{c['x_dtype']}_M{c['M']}_K{c['K']}_g{gs}{extra}"


def gen_quantize(root):
    names = []
    for c in quantize_cases():
        name = case_name(c)
        rng = np.random.default_rng(seed_of(name))
        x, x_stored = make_x(rng, c["M"], c["K"], c["x_dtype"], c["special"])
        gs = np.array(c["gs"], np.int32)
        scale = None
        arrays = dict(x=x_stored, group_sizes=gs)
        if c["mode"] == "delayed":
            scale = (2.0 ** rng.integers(-8, 8, size=len(gs)) * rng.uniform(0.5, 1.5, size=len(gs))).astype(F32)
            if c["special"]:
                scale[-1] = F32(3.0e38)  # x * scale overflows: saturates
                scale[0] = F32(0.0)      # scale_inv = inf; x * 0 = 0 (NaN for inf x)
            arrays["scale"] = scale
        out = quantize_np(x, gs, c["mode"], c["qdtype"], c["layout"], bool(c["pow2"]), bool(c["swizzled"]), scale)
        arrays.update(out)
        keys = dict(op="grouped_quantize", mode=c["mode"], qdtype=c["qdtype"], layout=c["layout"],
                    pow2_scales=c["pow2"], swizzled=c["swizzled"], x_dtype=c["x_dtype"])
        save_case(root, name, keys, arrays)
        names.append(name)
    return names


def gen_dequantize(root):
    """Dequantize of real quantize outputs, and of arbitrary codes and scales (every fp8 code,
    NaN/inf codes, e8m0 0x00 and 0xFF) in every mode and orientation."""
    names = []
    M, K, gs = 150, 70, np.array([129, 0, 1, 10], np.int32)  # two 128-row tiles, a tail of 10
    for mode in MODES:
        for qdtype in ("e4m3", "e5m2"):
            for colwise in (0, 1):
                for swz in ((0, 1) if mode == "mxfp8" else (0,)):
                    out_dtype = ["f32", "bf16", "f16"][(len(names)) % 3]
                    name = f"deq_{mode}_{qdtype}_{'colwise' if colwise else 'rowwise'}_{out_dtype}" + \
                        (("_swz" if swz else "_compact") if mode == "mxfp8" else "")
                    rng = np.random.default_rng(seed_of(name))
                    rd_s, rs_s, cd_s, cs_s, sdt = output_shapes(mode, M, K, len(gs))
                    d_shape, s_shape = (cd_s, cs_s) if colwise else (rd_s, rs_s)
                    data = rng.integers(0, 256, size=d_shape).astype(np.uint8)
                    if sdt == np.uint8:
                        scale_inv = rng.integers(100, 150, size=s_shape).astype(np.uint8)
                        flat = scale_inv.reshape(-1)
                        flat[rng.choice(flat.size, 40, replace=False)] = rng.choice([0, 1, 254, 255], 40)
                    else:
                        scale_inv = (2.0 ** rng.integers(-20, 20, size=s_shape) *
                                     rng.uniform(0.5, 1.0, size=s_shape)).astype(F32)
                        flat = scale_inv.reshape(-1)
                        flat[rng.choice(flat.size, min(4, flat.size), replace=False)] = [np.inf, 0.0, 3e38, np.nan][:min(4, flat.size)]
                    out = dequantize_np(data, scale_inv, gs, mode, qdtype, colwise, M, K, bool(swz), out_dtype)
                    keys = dict(op="grouped_dequantize", mode=mode, qdtype=qdtype, colwise=colwise,
                                swizzled=swz, rows=M, cols=K, out_dtype=out_dtype)
                    save_case(root, name, keys, dict(data=data, scale_inv=scale_inv, group_sizes=gs, out=out))
                    names.append(name)
    return names


def gen_delayed(root):
    names = []
    for qdtype in ("e4m3", "e5m2"):
        for algo in ("max", "most_recent"):
            for margin in (0, 2):
                for G, H in ((1, 1), (5, 17)):
                    name = f"delayed_update_{qdtype}_{algo}_margin{margin}_G{G}_H{H}"
                    rng = np.random.default_rng(seed_of(name))
                    hist = (rng.uniform(0, 4, size=(G, H)) * 2.0 ** rng.integers(-10, 10, size=(G, H))).astype(F32)
                    scale = rng.uniform(0.5, 2, size=G).astype(F32)
                    amax = rng.uniform(0, 100, size=G).astype(F32)
                    if G == 5:
                        amax[:4] = [0.0, np.inf, np.nan, 1.0e-38]  # kept, kept, kept, overflow -> FLT_MAX
                        hist[:3] = 0.0
                        hist[3] = 0.0
                        hist[4, H // 2] = np.nan  # MAX sees it: scale kept; MOST_RECENT does not
                    h2, s2 = delayed_update_np(hist, scale, amax, qdtype, algo, margin)
                    keys = dict(op="delayed_scale_update", qdtype=qdtype, algo=algo, margin=margin)
                    save_case(root, name, keys, dict(amax_history=hist, scale=scale, amax=amax,
                                                     amax_history_out=h2, scale_out=s2))
                    names.append(name)
    return names


def main():
    np.seterr(all="ignore")  # overflow to inf/NaN is part of what the special cases test
    here = os.path.dirname(os.path.abspath(__file__))
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "data", "quantize")
    if os.path.isdir(root):
        shutil.rmtree(root)
    os.makedirs(root)
    n = len(gen_quantize(root)) + len(gen_dequantize(root)) + len(gen_delayed(root))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    print(f"{n} cases, {size / 1e6:.2f} MB in {root}")


if __name__ == "__main__":
    main()
