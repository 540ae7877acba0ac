#!/usr/bin/env python3
"""Golden GEMM / grouped GEMM / grouped wgrad cases for twin (layout: golden/FORMAT.md).

Independent of twin's C code: NumPy + ml_dtypes, every product in f64. Quantized operands
come from golden/gen_quantize.py (quantize_np), itself written from tw_quantize.h.

    gemm_np(a, b, op_a, op_b, out_init=None) -> (expected, abs_prod)
    grouped_gemm_np(lhs, rhs, rhs_op, group_sizes, M, out_init=None, out_dtype="f32")
    grouped_gemm_wgrad_np(lhs, rhs, group_sizes, out_init=None, out_dtype="f32",
                          lhs_op="N", rhs_op="N")
Operands are stored values (any float array, used as f64) in the layouts of tw_gemm.h;
out_init is the decoded initial output; untouched elements are marked as described below.

Re-run (deterministic, seeded):  python3 golden/gen_gemm.py [--out golden/data/gemm]

Each case stores its inputs in their storage layout, `expected.npy` (f64, the exact result)
and `abs_prod.npy` (f64, sum_k |a||b| plus |out_init| when accumulating). Elements the
operation must not touch have abs_prod = -1 and expected = their initial value (the decoded
poison bytes 0xA5.., or out_init); so do NaN/inf results of NaN/inf inputs, which must
match exactly. Sums are of elementwise f64 products (no BLAS). case.txt also records the logical M, N, K (and G) and
`bound_k`, the longest contraction of any output element: the K to give
tw_gemm_error_bound (gemm and grouped: K; wgrad: the largest group size).
"""
import argparse
import os
import shutil
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_quantize import dequantize_np, quantize_np  # noqa: E402  (NumPy, from tw_quantize.h)

POISON = 0xA5
NP_DTYPE = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


# ---- values and codes -----------------------------------------------------------------

def round_to(x, dtype):
    """x (any float array) rounded to dtype (RNE), returned as f64."""
    return np.asarray(x, np.float32).astype(NP_DTYPE[dtype]).astype(np.float64)


def codes(x, dtype):
    """Storage of x (already representable) as .npy: f32 as is, 16-bit as u16 codes."""
    if dtype == "f32":
        return np.asarray(x, np.float32)
    return np.asarray(x, np.float32).astype(NP_DTYPE[dtype]).view(np.uint16)


def poison_value(dtype):
    """The value an output element holds after poisoning with 0xA5 bytes."""
    if dtype == "f32":
        return float(np.frombuffer(bytes([POISON] * 4), np.float32)[0])
    return float(np.frombuffer(bytes([POISON] * 2), np.uint16).view(NP_DTYPE[dtype])[0])


def initial(shape, out_dtype, out_init):
    if out_init is not None:
        return np.array(out_init, np.float64).reshape(shape)
    return np.full(shape, poison_value(out_dtype), np.float64)


# ---- the three operations, f64 -----------------------------------------------------------

def op_view(x, op):
    """The logical operand of a stored one: op N is the storage, T its transpose."""
    return x if op == "N" else np.swapaxes(x, -1, -2)


def product(A, B):
    """(A @ B, |A| @ |B|) from elementwise products summed in f64: no BLAS, so no BLAS
    shortcut (skipping zeros) can hide an inf*0 = NaN. A [..., M, K], B [..., K, N]."""
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf are meant to give NaN
        terms = A[..., :, :, None] * B[..., None, :, :]
        return terms.sum(axis=-2), np.abs(terms).sum(axis=-2)


def exact_where_special(expected, abs_prod):
    """NaN/inf results (from NaN/inf inputs) have no error bound: mark them abs_prod -1, so
    the checker demands the same special value (NaN meets NaN, inf the same inf)."""
    abs_prod = np.array(abs_prod, copy=True)
    abs_prod[~np.isfinite(expected)] = -1.0
    return abs_prod


def gemm_np(a, b, op_a, op_b, out_init=None):
    """out [B?, M, N] = op(a) @ op(b) (+ out_init). a, b: stored values (f64), 2-D or 3-D;
    a 2-D operand is broadcast over the batch. Returns (expected, abs_prod), f64."""
    A = op_view(np.asarray(a, np.float64), op_a)
    B = op_view(np.asarray(b, np.float64), op_b)
    expected, abs_prod = product(A, B)
    if out_init is not None:
        init = np.asarray(out_init, np.float64).reshape(expected.shape)
        expected = expected + init
        abs_prod = abs_prod + np.abs(init)
    return expected, exact_where_special(expected, abs_prod)


def offsets(group_sizes):
    return np.concatenate([[0], np.cumsum(np.asarray(group_sizes, np.int64))])


def per_group_kn(v, G, rr, rc, src_kn):
    """The rhs source [G*rr, rc] per group as [K, N]: as stored (rhs op N) or transposed (op T)."""
    w = v.reshape(G, rr, rc)
    return w if src_kn else np.swapaxes(w, 1, 2)


def grouped_gemm_np(lhs, rhs, rhs_op, group_sizes, M, out_init=None, out_dtype="f32"):
    """Grouped forward: out[o_g:o_g+m_g] = lhs[o_g:o_g+m_g] @ op(rhs[g]) (+ out_init).
    lhs [M, K] (rows past sum(group_sizes) are ignored), rhs [G, K, N] (N) or [G, N, K] (T).
    Rows past the groups are untouched: abs_prod -1, expected = initial value."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    N = rhs.shape[2] if rhs_op == "N" else rhs.shape[1]
    expected = initial((M, N), out_dtype, out_init)
    abs_prod = np.full((M, N), -1.0)
    off = offsets(group_sizes)
    for g in range(len(group_sizes)):
        r0, r1 = off[g], off[g + 1]
        if r0 == r1:
            continue
        w = op_view(rhs[g], rhs_op)
        acc = expected[r0:r1] if out_init is not None else 0.0
        e, a = product(lhs[r0:r1], w)
        expected[r0:r1] = e + acc
        abs_prod[r0:r1] = exact_where_special(e + acc, a + np.abs(acc))
    return expected, abs_prod


def grouped_gemm_wgrad_np(lhs, rhs, group_sizes, out_init=None, out_dtype="f32", lhs_op="N",
                          rhs_op="N"):
    """Grouped wgrad: out[g] = lhs_g^T @ rhs_g -> [G, K, N]. op N: lhs [M, K], rhs [M, N];
    op T: the per-group transposed storage, passed as [K, M] / [N, M] (tw_gemm.h). Rows past
    the groups are ignored. An empty group gives exact zeros, or keeps out_init untouched
    (abs_prod -1) when accumulating."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if lhs_op == "T":
        lhs = from_per_group_transposed(lhs, group_sizes)
    if rhs_op == "T":
        rhs = from_per_group_transposed(rhs, group_sizes)
    G, K, N = len(group_sizes), lhs.shape[1], rhs.shape[1]
    expected = initial((G, K, N), out_dtype, out_init)
    abs_prod = np.zeros((G, K, N))
    off = offsets(group_sizes)
    for g in range(G):
        r0, r1 = off[g], off[g + 1]
        if r0 == r1:
            if out_init is not None:
                abs_prod[g] = -1.0
            else:
                expected[g] = 0.0
            continue
        acc = expected[g] if out_init is not None else 0.0
        e, a = product(lhs[r0:r1].T, rhs[r0:r1])
        expected[g] = e + acc
        abs_prod[g] = exact_where_special(e + acc, a + np.abs(acc))
    return expected, abs_prod


def per_group_transposed(x, group_sizes):
    """[M, C] -> flat storage of per-group [C, m_g] blocks at element o_g*C, tail kept."""
    M, C = x.shape
    flat = np.array(x, copy=True).reshape(-1)
    off = offsets(group_sizes)
    for g in range(len(group_sizes)):
        r0, r1 = off[g], off[g + 1]
        flat[r0 * C:r1 * C] = x[r0:r1].T.reshape(-1)
    return flat


def from_per_group_transposed(stored, group_sizes):
    """Inverse of per_group_transposed: [C, M] storage -> logical [M, C] (tail rows NaN)."""
    C, M = stored.shape
    flat = np.asarray(stored).reshape(-1)
    x = np.full((M, C), np.nan)
    off = offsets(group_sizes)
    for g in range(len(group_sizes)):
        r0, r1 = off[g], off[g + 1]
        x[r0:r1] = flat[r0 * C:r1 * C].reshape(C, r1 - r0).T
    return x


# ---- case writing ---------------------------------------------------------------------------

class Case:
    def __init__(self, root, name, op):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir, exist_ok=True)
        self.keys = [("op", op)]

    def key(self, k, v):
        self.keys.append((k, str(v)))

    def npy(self, name, arr):
        np.save(os.path.join(self.dir, name + ".npy"), np.ascontiguousarray(arr))

    def plain(self, p, stored, dtype):
        self.key(p + "_mode", "none")
        self.key(p + "_dtype", dtype)
        self.npy(p, codes(stored, dtype))

    def quantized(self, p, q):
        """q: dict(data, scale_inv, mode, qdtype, colwise, swizzled, src_rows, src_cols)."""
        self.key(p + "_mode", q["mode"])
        self.key(p + "_qdtype", q["qdtype"])
        self.key(p + "_colwise", int(q["colwise"]))
        self.key(p + "_swizzled", int(q["swizzled"]))
        self.key(p + "_src_rows", q["src_rows"])
        self.key(p + "_src_cols", q["src_cols"])
        self.npy(p + "_data", q["data"])
        self.npy(p + "_scale_inv", q["scale_inv"])

    def outputs(self, out_dtype, accumulate, out_init, expected, abs_prod, bound_k, abs_prod_lifted=None):
        self.key("out_dtype", out_dtype)
        self.key("accumulate", int(accumulate))
        if accumulate:
            self.npy("out_init", codes(out_init, out_dtype))
        self.key("bound_k", bound_k)
        self.npy("expected", np.asarray(expected, np.float64))
        self.npy("abs_prod", np.asarray(abs_prod, np.float64))
        if abs_prod_lifted is not None:
            self.npy("abs_prod_lifted", np.asarray(abs_prod_lifted, np.float64))
        with open(os.path.join(self.dir, "case.txt"), "w") as f:
            f.write("# generated by golden/gen_gemm.py; do not edit\n")
            for k, v in self.keys:
                f.write("%s = %s\n" % (k, v))


def randn(rng, shape, dtype, scale=1.0):
    return round_to(rng.standard_normal(shape) * scale, dtype)


def out_init_for(rng, shape, out_dtype, accumulate):
    return randn(rng, shape, out_dtype) if accumulate else None


def gemm_case(root, rng, name, M, K, N, op_a="N", op_b="N", dt_a="f32", dt_b=None,
              out_dtype="f32", accumulate=0, batch_a=0, batch_b=0):
    dt_b = dt_b or dt_a
    sa = (K, M) if op_a == "T" else (M, K)
    sb = (N, K) if op_b == "T" else (K, N)
    a = randn(rng, ((batch_a,) if batch_a else ()) + sa, dt_a)
    b = randn(rng, ((batch_b,) if batch_b else ()) + sb, dt_b)
    batch = batch_a or batch_b
    oshape = ((batch,) if batch else ()) + (M, N)
    init = out_init_for(rng, oshape, out_dtype, accumulate)
    exp, ab = gemm_np(a, b, op_a, op_b, init)
    c = Case(root, name, "gemm")
    c.key("op_a", op_a)
    c.key("op_b", op_b)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.plain("a", a, dt_a)
    c.plain("b", b, dt_b)
    c.outputs(out_dtype, accumulate, init, exp, ab, K)


def with_nan_tail(x, rows_used):
    """Rows past the groups hold NaN: a read of them would show in the result."""
    x = np.array(x, copy=True)
    x[rows_used:] = np.nan
    return x


def grouped_case(root, rng, name, gs, M, K, N, rhs_op="N", dt="f32", out_dtype="f32",
                 accumulate=0):
    G, S = len(gs), int(sum(gs))
    lhs = with_nan_tail(randn(rng, (M, K), dt), S)
    rhs = randn(rng, (G, K, N) if rhs_op == "N" else (G, N, K), dt)
    init = out_init_for(rng, (M, N), out_dtype, accumulate)
    exp, ab = grouped_gemm_np(lhs, rhs, rhs_op, gs, M, init, out_dtype)
    c = Case(root, name, "grouped_gemm")
    c.key("rhs_op", rhs_op)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.plain("lhs", lhs, dt)
    c.plain("rhs", rhs, dt)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, K)


def wgrad_case(root, rng, name, gs, M, K, N, lhs_op="N", rhs_op="N", dt="f32",
               out_dtype="f32", accumulate=0):
    G, S = len(gs), int(sum(gs))
    lhs = with_nan_tail(randn(rng, (M, K), dt), S)
    rhs = with_nan_tail(randn(rng, (M, N), dt), S)
    init = out_init_for(rng, (G, K, N), out_dtype, accumulate)
    # op T: per-group transposed blocks, as one [cols, M] tensor
    ls = lhs if lhs_op == "N" else per_group_transposed(lhs, gs).reshape(K, M)
    rs = rhs if rhs_op == "N" else per_group_transposed(rhs, gs).reshape(N, M)
    exp, ab = grouped_gemm_wgrad_np(ls, rs, gs, init, out_dtype, lhs_op, rhs_op)
    c = Case(root, name, "grouped_gemm_wgrad")
    c.key("lhs_op", lhs_op)
    c.key("rhs_op", rhs_op)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.plain("lhs", ls, dt)
    c.plain("rhs", rs, dt)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, max(max(gs), 1))


def with_specials(x, spots):
    """x with the given {(index tuple): value} entries set (inf, -inf, NaN, 0)."""
    x = np.array(x, copy=True)
    for idx, v in spots.items():
        x[idx] = v
    return x


def special_cases(root, rng):
    """NaN and inf inputs: where they land in the output is part of the contract."""
    inf, nan = np.inf, np.nan
    for op_a, op_b, dt, out_dt in (("N", "N", "f32", "f32"), ("T", "N", "bf16", "bf16"),
                                   ("N", "T", "f16", "f32")):
        M, K, N = 6, 8, 5
        a = randn(rng, (K, M) if op_a == "T" else (M, K), dt)
        b = randn(rng, (N, K) if op_b == "T" else (K, N), dt)
        at = (lambda i, k: (k, i)) if op_a == "T" else (lambda i, k: (i, k))
        bt = (lambda k, j: (j, k)) if op_b == "T" else (lambda k, j: (k, j))
        # row 0: one +inf (signed by b); row 1: NaN; row 2: inf - inf; row 3: inf * 0 at column 2
        a = with_specials(a, {at(0, 1): inf, at(1, 2): nan, at(2, 3): inf, at(2, 4): -inf,
                              at(3, 5): -inf})
        b = with_specials(b, {bt(5, 2): 0.0, bt(3, 0): 1.0, bt(4, 0): 1.0})
        exp, ab = gemm_np(a, b, op_a, op_b)
        c = Case(root, "gemm_%s%s_%s_specials_out_%s" % (op_a, op_b, dt, out_dt), "gemm")
        c.key("op_a", op_a)
        c.key("op_b", op_b)
        c.key("M", M)
        c.key("N", N)
        c.key("K", K)
        c.plain("a", a, dt)
        c.plain("b", b, dt)
        c.outputs(out_dt, 0, None, exp, ab, K)

    gs, M, K, N = [4, 0, 5, 3], 14, 6, 7  # tail rows 12, 13 hold NaN
    lhs = with_nan_tail(randn(rng, (M, K), "f32"), 12)
    lhs = with_specials(lhs, {(1, 2): inf, (6, 0): -inf})
    rhs = with_specials(randn(rng, (4, K, N), "f32"), {(2, 3, 4): nan, (0, 2, 1): 0.0})
    exp, ab = grouped_gemm_np(lhs, rhs, "N", gs, M)
    c = Case(root, "grouped_N_f32_specials", "grouped_gemm")
    c.key("rhs_op", "N")
    for k, v in (("M", M), ("N", N), ("K", K), ("G", 4)):
        c.key(k, v)
    c.plain("lhs", lhs, "f32")
    c.plain("rhs", rhs, "f32")
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs("f32", 0, None, exp, ab, K)

    gs, M, K, N = [3, 0, 4], 9, 5, 6
    lhs = with_specials(with_nan_tail(randn(rng, (M, K), "f32"), 7), {(0, 1): inf, (4, 3): nan})
    rhs = with_specials(with_nan_tail(randn(rng, (M, N), "f32"), 7), {(0, 2): 0.0, (5, 5): -inf})
    exp, ab = grouped_gemm_wgrad_np(lhs, rhs, gs, None, "bf16")
    c = Case(root, "wgrad_NN_f32_specials_out_bf16", "grouped_gemm_wgrad")
    c.key("lhs_op", "N")
    c.key("rhs_op", "N")
    for k, v in (("M", M), ("N", N), ("K", K), ("G", 3)):
        c.key(k, v)
    c.plain("lhs", lhs, "f32")
    c.plain("rhs", rhs, "f32")
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs("bf16", 0, None, exp, ab, 4)


def plain_cases(root, rng):
    # dense: every layout, awkward sizes, dtypes, batching, accumulate
    for op_a in "NT":
        for op_b in "NT":
            gemm_case(root, rng, "gemm_%s%s_f32_17x33x5" % (op_a, op_b), 17, 33, 5, op_a, op_b)
            gemm_case(root, rng, "gemm_%s%s_bf16_5x217x17" % (op_a, op_b), 5, 217, 17, op_a, op_b,
                      "bf16")
    gemm_case(root, rng, "gemm_NN_f32_1x1x1", 1, 1, 1)
    gemm_case(root, rng, "gemm_NT_f32_217x1x5", 217, 1, 5, "N", "T")
    gemm_case(root, rng, "gemm_TN_f32_1x217x1", 1, 217, 1, "T", "N")
    gemm_case(root, rng, "gemm_NN_f32_5x0x17_k0", 5, 0, 17)
    gemm_case(root, rng, "gemm_NN_f16_17x64x33_out_f16", 17, 64, 33, dt_a="f16", out_dtype="f16")
    gemm_case(root, rng, "gemm_NT_bf16_33x128x17_out_bf16", 33, 128, 17, "N", "T", "bf16",
              out_dtype="bf16")
    gemm_case(root, rng, "gemm_NN_f32xbf16_17x33x5", 17, 33, 5, dt_a="f32", dt_b="bf16")
    gemm_case(root, rng, "gemm_NN_f32_17x33x5_acc", 17, 33, 5, accumulate=1)
    gemm_case(root, rng, "gemm_TT_bf16_17x33x5_acc_out_bf16", 17, 33, 5, "T", "T", "bf16",
              out_dtype="bf16", accumulate=1)
    gemm_case(root, rng, "gemm_batched_NN_f32_3x17x33x5", 17, 33, 5, batch_a=3, batch_b=3)
    gemm_case(root, rng, "gemm_batched_TN_bf16_4x5x17x33", 5, 17, 33, "T", "N", "bf16",
              batch_a=4, batch_b=4)
    gemm_case(root, rng, "gemm_batched_NT_f32_a3d_b2d", 17, 33, 5, "N", "T", batch_a=3)
    gemm_case(root, rng, "gemm_batched_TT_f32_a2d_b3d_acc", 5, 17, 33, "T", "T", batch_b=2,
              accumulate=1)

    # grouped forward: zero-size groups, tails, both rhs layouts
    G8 = [5, 0, 17, 1, 0, 33, 64, 2]  # S = 122
    for rhs_op in "NT":
        grouped_case(root, rng, "grouped_%s_f32_G8_tail" % rhs_op, G8, 130, 33, 17, rhs_op)
        grouped_case(root, rng, "grouped_%s_bf16_G8_tail" % rhs_op, G8, 217, 64, 5, rhs_op, "bf16")
    grouped_case(root, rng, "grouped_N_f32_G1_1x1x1", [1], 1, 1, 1)
    grouped_case(root, rng, "grouped_N_f32_G4_all_empty", [0, 0, 0, 0], 5, 17, 5)
    grouped_case(root, rng, "grouped_T_f32_G3_exact_217", [100, 0, 117], 217, 17, 5, "T")
    grouped_case(root, rng, "grouped_N_bf16_G8_out_bf16", G8, 122, 128, 33, "N", "bf16", "bf16")
    grouped_case(root, rng, "grouped_T_f16_G2_out_f16_acc", [3, 14], 20, 33, 17, "T", "f16", "f16", 1)
    grouped_case(root, rng, "grouped_N_f32_G8_acc_tail", G8, 130, 5, 17, "N", accumulate=1)

    # wgrad: ragged contracting dim, every storage pair
    for lhs_op in "NT":
        for rhs_op in "NT":
            wgrad_case(root, rng, "wgrad_%s%s_f32_G8_tail" % (lhs_op, rhs_op), G8, 130, 17, 5,
                       lhs_op, rhs_op)
            wgrad_case(root, rng, "wgrad_%s%s_bf16_G4_tail" % (lhs_op, rhs_op), [17, 0, 1, 5], 30,
                       33, 17, lhs_op, rhs_op, "bf16")
    wgrad_case(root, rng, "wgrad_NN_f32_G3_all_empty", [0, 0, 0], 4, 5, 17)
    wgrad_case(root, rng, "wgrad_NN_bf16_G8_out_bf16", G8, 122, 33, 17, "N", "N", "bf16", "bf16")
    wgrad_case(root, rng, "wgrad_TN_f32_G8_acc_keeps_empty", G8, 130, 17, 5, "T", "N",
               accumulate=1)
    wgrad_case(root, rng, "wgrad_NT_bf16_G4_acc_out_bf16", [17, 0, 1, 5], 23, 17, 33, "N", "T",
               "bf16", "bf16", 1)
    wgrad_case(root, rng, "wgrad_NN_f32_G1_217x1x1", [217], 217, 1, 1)


# ---- quantized operands ----------------------------------------------------------------------

def spread(rng, shape):
    """Rows of different magnitudes (1e-2 .. 1e2), so blocks and groups get different scales."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, size=shape[:-1] + (1,))
    return np.asarray(x, np.float32)


def lift_subnormal_codes(data, qdtype):
    """fp8 codes with every nonzero subnormal code replaced by the smallest normal of its sign.
    Hopper's fp8 tensor core aligns a 32-deep instruction's products to the largest product's
    exponent fields, a subnormal code counting at the smallest normal exponent, so the promoted
    model's sum |a||b| takes these magnitudes (tw_check.h, tw_fp8_lift_subnormal_codes)."""
    d = np.asarray(data, np.uint8)
    emask, min_normal = (0x78, 0x08) if qdtype == "e4m3" else (0x7C, 0x04)
    sub = ((d & emask) == 0) & ((d & 0x7F) != 0)
    return np.where(sub, (d & 0x80) | min_normal, d).astype(np.uint8)


def qoperand(rng, rows, cols, group_sizes, mode, qdtype, colwise, swizzled=True, pow2=False):
    """Quantize a random [rows, cols] source by group_sizes and keep one orientation.
    Returns (operand dict for Case.quantized, logical [rows, cols] f64 of the dequantized
    values, the same of the lifted codes (lift_subnormal_codes); rows past the groups are NaN,
    to be ignored)."""
    x = spread(rng, (rows, cols))
    scale = None
    if mode == "delayed":  # stored scales from an earlier step: a bit off the current amax
        off = np.concatenate([[0], np.cumsum(group_sizes)])
        scale = np.array([448.0 / (1.5 * max(np.abs(x[off[g]:off[g + 1]]).max(initial=0), 1e-3))
                          for g in range(len(group_sizes))], np.float32)
    layout = "colwise" if colwise else "rowwise"
    q = quantize_np(x, group_sizes, mode, qdtype, layout, pow2, swizzled, scale)
    data = q["col_data" if colwise else "row_data"]
    sinv = q["col_scale_inv" if colwise else "row_scale_inv"]
    S = int(np.sum(group_sizes))
    out = []
    for d in (data, lift_subnormal_codes(data, qdtype)):
        vals = dequantize_np(d, sinv, group_sizes, mode, qdtype, colwise, rows, cols, swizzled)
        logical = np.asarray(vals, np.float64)
        logical[S:] = np.nan
        out.append(logical)
    op = dict(data=data, scale_inv=sinv, mode=mode, qdtype=qdtype, colwise=colwise,
              swizzled=swizzled, src_rows=rows, src_cols=cols)
    return op, out[0], out[1]


def stored_transposed(mode, colwise):
    """Tensor and block scaling store their colwise copy transposed (per group)."""
    return colwise and mode != "mxfp8"


def qgemm_case(root, rng, name, M, K, N, mode, qa, qb, a_colwise, b_colwise, a_src_t, b_src_t,
               out_dtype="bf16", accumulate=0):
    """Dense GEMM on two quantized operands. a_src_t: a's source is [K, M] (else [M, K]);
    b_src_t: b's source is [N, K] (else [K, N]). op follows from how each is stored."""
    ar, ac = (K, M) if a_src_t else (M, K)
    br, bc = (N, K) if b_src_t else (K, N)
    a, av, al = qoperand(rng, ar, ac, [ar], mode, qa, a_colwise)
    b, bv, bl = qoperand(rng, br, bc, [br], mode, qb, b_colwise)
    # logical storage: a transposed copy stores the source transposed
    a_t = a_src_t != stored_transposed(mode, a_colwise)
    b_t = b_src_t != stored_transposed(mode, b_colwise)
    def store(v, colwise):
        return v.T if stored_transposed(mode, colwise) else v
    op_a, op_b = ("T" if a_t else "N"), ("T" if b_t else "N")
    init = out_init_for(rng, (M, N), out_dtype, accumulate)
    exp, ab = gemm_np(store(av, a_colwise), store(bv, b_colwise), op_a, op_b, init)
    _, ab_lifted = gemm_np(store(al, a_colwise), store(bl, b_colwise), op_a, op_b, init)
    c = Case(root, name, "gemm")
    c.key("op_a", op_a)
    c.key("op_b", op_b)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.quantized("a", a)
    c.quantized("b", b)
    c.outputs(out_dtype, accumulate, init, exp, ab, K, ab_lifted)


def qgrouped_case(root, rng, name, gs, M, K, N, mode, ql, qr, rhs_op, rhs_colwise,
                  out_dtype="bf16", accumulate=0):
    """Grouped forward, quantized: lhs rowwise [M, K] by gs; rhs quantized in the uniform
    form, source [G*K, N] (rhs stored [K, N] per group) or [G*N, K] (stored [N, K])."""
    G = len(gs)
    lhs, lv, ll = qoperand(rng, M, K, gs, mode, ql, False)
    # which source gives per-group storage [K, N] (op N) or [N, K] (op T)
    src_kn = (rhs_op == "N") != stored_transposed(mode, rhs_colwise)
    rr, rc = (K, N) if src_kn else (N, K)
    rhs, rv, rl = qoperand(rng, G * rr, rc, [rr] * G, mode, qr, rhs_colwise)

    init = out_init_for(rng, (M, N), out_dtype, accumulate)
    exp, ab = grouped_gemm_np(np.nan_to_num(lv), per_group_kn(rv, G, rr, rc, src_kn), "N", gs, M, init, out_dtype)
    _, ab_lifted = grouped_gemm_np(np.nan_to_num(ll), per_group_kn(rl, G, rr, rc, src_kn), "N", gs, M, init, out_dtype)
    c = Case(root, name, "grouped_gemm")
    c.key("rhs_op", rhs_op)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.quantized("lhs", lhs)
    c.quantized("rhs", rhs)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, K, ab_lifted)


def qwgrad_case(root, rng, name, gs, M, K, N, mode, ql, qr, lhs_colwise, rhs_colwise,
                out_dtype="bf16", accumulate=0):
    """Grouped wgrad, quantized: lhs source [M, K], rhs source [M, N], both by gs; the op of
    each is T exactly when its data is a per-group transposed copy."""
    G = len(gs)
    lhs, lv, ll = qoperand(rng, M, K, gs, mode, ql, lhs_colwise)
    rhs, rv, rl = qoperand(rng, M, N, gs, mode, qr, rhs_colwise)
    init = out_init_for(rng, (G, K, N), out_dtype, accumulate)
    S = int(sum(gs))
    exp, ab = grouped_gemm_wgrad_np(lv[:S], rv[:S], gs, init, out_dtype)
    _, ab_lifted = grouped_gemm_wgrad_np(ll[:S], rl[:S], gs, init, out_dtype)
    c = Case(root, name, "grouped_gemm_wgrad")
    c.key("lhs_op", "T" if stored_transposed(mode, lhs_colwise) else "N")
    c.key("rhs_op", "T" if stored_transposed(mode, rhs_colwise) else "N")
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.quantized("lhs", lhs)
    c.quantized("rhs", rhs)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, max(max(gs), 1), ab_lifted)


def quantized_cases(root, rng):
    # dense. Tensor scaling: any orientation; blocks must lie along K.
    qgemm_case(root, rng, "qgemm_current_e4m3xe4m3_NT_17x64x33", 17, 64, 33, "current", "e4m3",
               "e4m3", False, False, False, True)
    qgemm_case(root, rng, "qgemm_current_e4m3xe5m2_TN_colwise_5x217x17", 5, 217, 17, "current",
               "e4m3", "e5m2", True, True, False, True, out_dtype="f32")
    qgemm_case(root, rng, "qgemm_delayed_e5m2xe4m3_NN_33x17x5_acc", 33, 17, 5, "delayed", "e5m2",
               "e4m3", False, False, False, False, accumulate=1)
    qgemm_case(root, rng, "qgemm_mxfp8_NN_17x100x33", 17, 100, 33, "mxfp8", "e4m3", "e4m3",
               False, True, False, False)
    qgemm_case(root, rng, "qgemm_mxfp8_NT_e4m3xe5m2_33x64x17", 33, 64, 17, "mxfp8", "e4m3", "e5m2",
               False, False, False, True)
    qgemm_case(root, rng, "qgemm_mxfp8_TN_5x96x17_f16", 5, 96, 17, "mxfp8", "e4m3", "e4m3",
               True, True, True, False, out_dtype="f16")
    qgemm_case(root, rng, "qgemm_block1x128_NT_17x130x33", 17, 130, 33, "block1x128", "e4m3",
               "e4m3", False, False, False, True)
    qgemm_case(root, rng, "qgemm_block128x128_NT_colwise_b_130x200x17", 130, 200, 17,
               "block128x128", "e4m3", "e4m3", False, True, False, False, out_dtype="f32")

    G5 = [40, 0, 17, 64, 3]  # S = 124
    qgrouped_case(root, rng, "qgrouped_current_N_G5_tail", G5, 130, 64, 33, "current", "e4m3",
                  "e4m3", "N", False)
    qgrouped_case(root, rng, "qgrouped_current_T_colwise_G5_tail", G5, 130, 33, 17, "current",
                  "e4m3", "e5m2", "T", True, out_dtype="f32")
    qgrouped_case(root, rng, "qgrouped_delayed_T_G5", G5, 124, 17, 5, "delayed", "e5m2", "e4m3",
                  "T", False, accumulate=1)
    qgrouped_case(root, rng, "qgrouped_mxfp8_N_colwise_G5_tail", G5, 130, 64, 17, "mxfp8", "e4m3",
                  "e4m3", "N", True)
    qgrouped_case(root, rng, "qgrouped_mxfp8_T_G5_K100", G5, 124, 100, 33, "mxfp8", "e4m3",
                  "e4m3", "T", False)
    qgrouped_case(root, rng, "qgrouped_block1x128_T_G5_K130", G5, 130, 130, 17, "block1x128",
                  "e4m3", "e4m3", "T", False)
    qgrouped_case(root, rng, "qgrouped_block128x128_N_G3_K200", [130, 0, 70], 217, 200, 17,
                  "block128x128", "e4m3", "e4m3", "N", False)

    W6 = [32, 0, 17, 64, 0, 5]  # S = 118
    qwgrad_case(root, rng, "qwgrad_current_TT_e4m3xe5m2_G6_tail", W6, 130, 33, 17, "current",
                "e4m3", "e5m2", True, True)
    qwgrad_case(root, rng, "qwgrad_delayed_NN_G6", W6, 118, 17, 33, "delayed", "e4m3", "e4m3",
                False, False, out_dtype="f32")
    qwgrad_case(root, rng, "qwgrad_mxfp8_NN_colwise_G6_tail", W6, 130, 64, 33, "mxfp8", "e4m3",
                "e4m3", True, True)
    qwgrad_case(root, rng, "qwgrad_block1x128_TT_G6_acc", W6, 118, 17, 5, "block1x128", "e4m3",
                "e4m3", True, True, accumulate=1)
    qwgrad_case(root, rng, "qwgrad_block128x128_NT_G3", [150, 0, 67], 230, 17, 33,
                "block128x128", "e4m3", "e4m3", False, True)


def tma_wgrad_cases(root):
    """bf16/f16 wgrad with K and N multiples of 8 (what the gpu's TMA version gg_wgmma takes):
    groups ending inside a 64-row block (1, 63, 65, 129), empty groups, K past a 128 tile, N past
    a 256 tile, NaN rows past the sum. Own seed, so the cases above keep their bytes."""
    rng = np.random.default_rng(20261124)
    wgrad_case(root, rng, "wgrad_NN_bf16_G5_tma_tails", [1, 63, 0, 65, 129], 300, 136, 24, "N", "N", "bf16")
    wgrad_case(root, rng, "wgrad_NN_f16_G4_tma_out_f16_acc", [64, 0, 7, 100], 180, 16, 264, "N", "N", "f16",
               "f16", 1)
    wgrad_case(root, rng, "wgrad_NN_bf16_G3_tma_out_bf16", [200, 1, 50], 260, 72, 8, "N", "N", "bf16", "bf16")


def draw_rows(rng, gs, U, M):
    """lhs_rows [M] i32: for i < S a row of [0, U) (repeats: a token on several experts) or -1 (a
    zero row), one in 8; entries past S out of range (never read)."""
    S = int(sum(gs))
    rows = rng.integers(0, max(U, 1), size=M).astype(np.int32)
    rows[rng.random(M) < 0.125] = -1
    if U == 0:
        rows[:] = -1
    rows[S:] = 1 << 30
    return rows


def gathered(values, rows, S):
    """L[i] = values[rows[i]] (0 for -1) for i < S, NaN past S (never read)."""
    L = np.full((len(rows), values.shape[1]), np.nan)
    for i in range(S):
        L[i] = 0.0 if rows[i] < 0 else values[rows[i]]
    return L


def rows_case(root, rng, name, gs, U, M, K, N, rhs_op="N", dt="f32", out_dtype="f32", accumulate=0):
    """Grouped forward with a row-gathered lhs (tw_grouped_gemm_rows): lhs [U, K], lhs_rows [M]."""
    G, S = len(gs), int(sum(gs))
    lhs = randn(rng, (U, K), dt)
    rows = draw_rows(rng, gs, U, M)
    rhs = randn(rng, (G, K, N) if rhs_op == "N" else (G, N, K), dt)
    init = out_init_for(rng, (M, N), out_dtype, accumulate)
    exp, ab = grouped_gemm_np(gathered(lhs, rows, S), rhs, rhs_op, gs, M, init, out_dtype)
    c = Case(root, name, "grouped_gemm_rows")
    c.key("rhs_op", rhs_op)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.key("U", U)
    c.plain("lhs", lhs, dt)
    c.npy("lhs_rows", rows)
    c.plain("rhs", rhs, dt)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, K)


def qrows_case(root, rng, name, gs, U, M, K, N, mode, ql, qr, rhs_op, out_dtype="bf16", accumulate=0):
    """Row-gathered quantized lhs: the [U, K] source quantized rowwise as one group; rhs as in
    qgrouped_case (uniform groups, rowwise, per-group storage [K, N] or [N, K])."""
    G, S = len(gs), int(sum(gs))
    lhs, lv, ll = qoperand(rng, U, K, [U], mode, ql, False)
    rows = draw_rows(rng, gs, U, M)
    src_kn = rhs_op == "N"
    rr, rc = (K, N) if src_kn else (N, K)
    rhs, rv, rl = qoperand(rng, G * rr, rc, [rr] * G, mode, qr, False)

    init = out_init_for(rng, (M, N), out_dtype, accumulate)
    exp, ab = grouped_gemm_np(np.nan_to_num(gathered(lv, rows, S)), per_group_kn(rv, G, rr, rc, src_kn), "N", gs, M, init, out_dtype)
    _, ab_lifted = grouped_gemm_np(np.nan_to_num(gathered(ll, rows, S)), per_group_kn(rl, G, rr, rc, src_kn), "N", gs, M, init, out_dtype)
    c = Case(root, name, "grouped_gemm_rows")
    c.key("rhs_op", rhs_op)
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.key("U", U)
    c.quantized("lhs", lhs)
    c.npy("lhs_rows", rows)
    c.quantized("rhs", rhs)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, K, ab_lifted)


def wgrad_rows_case(root, rng, name, gs, U, M, K, N, dt="bf16", out_dtype="f32", accumulate=0):
    """Grouped wgrad with a row-gathered lhs (tw_grouped_gemm_wgrad_rows): out[g] = L_g^T rhs_g."""
    G, S = len(gs), int(sum(gs))
    lhs = randn(rng, (U, K), dt)
    rows = draw_rows(rng, gs, U, M)
    rhs = with_nan_tail(randn(rng, (M, N), dt), S)
    init = out_init_for(rng, (G, K, N), out_dtype, accumulate)
    exp, ab = grouped_gemm_wgrad_np(np.nan_to_num(gathered(lhs, rows, S)), rhs, gs, init, out_dtype)
    c = Case(root, name, "grouped_gemm_wgrad_rows")
    c.key("lhs_op", "N")
    c.key("rhs_op", "N")
    c.key("M", M)
    c.key("N", N)
    c.key("K", K)
    c.key("G", G)
    c.key("U", U)
    c.plain("lhs", lhs, dt)
    c.npy("lhs_rows", rows)
    c.plain("rhs", rhs, dt)
    c.npy("group_sizes", np.asarray(gs, np.int32))
    c.outputs(out_dtype, accumulate, init, exp, ab, max(max(gs), 1))


def rows_cases(root):
    """Row-gathered lhs (EP rows by source): repeated rows, -1 rows, empty groups, U smaller and
    larger than M, entries past S out of range. Own seed, so the cases above keep their bytes."""
    rng = np.random.default_rng(20261128)
    G5 = [40, 0, 17, 64, 3]  # S = 124
    rows_case(root, rng, "rows_N_f32_G5_U50", G5, 50, 130, 33, 17)
    rows_case(root, rng, "rows_T_bf16_G5_U300_out_bf16_acc", G5, 300, 124, 64, 24, "T", "bf16", "bf16", 1)
    rows_case(root, rng, "rows_N_bf16_G3_U0_all_zero_rows", [5, 0, 3], 0, 8, 16, 8, "N", "bf16")
    qrows_case(root, rng, "qrows_block1x128_T_G5_U90_K256", G5, 90, 130, 256, 24, "block1x128", "e4m3", "e4m3", "T")
    qrows_case(root, rng, "qrows_mxfp8_T_G5_U200_K96", G5, 200, 124, 96, 17, "mxfp8", "e4m3", "e4m3", "T")
    qrows_case(root, rng, "qrows_current_N_G5_U60", G5, 60, 124, 64, 33, "current", "e4m3", "e4m3", "N",
               out_dtype="f32")
    wgrad_rows_case(root, rng, "wgrad_rows_bf16_G5_U70", G5, 70, 130, 40, 24)
    wgrad_rows_case(root, rng, "wgrad_rows_f32_G3_U20_acc", [9, 0, 30], 20, 39, 8, 16, "f32", "f32", 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "data", "gemm"))
    args = ap.parse_args()
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    rng = np.random.default_rng(20261121)
    plain_cases(args.out, rng)
    quantized_cases(args.out, rng)
    special_cases(args.out, rng)
    tma_wgrad_cases(args.out)
    rows_cases(args.out)
    n = len([d for d in os.listdir(args.out) if os.path.isdir(os.path.join(args.out, d))])
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(args.out) for f in fs)
    print("gen_gemm: %d cases, %.2f MB in %s" % (n, size / 1e6, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
