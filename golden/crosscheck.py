#!/usr/bin/env python3
"""Cross-check `twin op` against NumPy on random cases drawn here, outside the project.

1. 64 random grouped GEMMs (G 1..12 with empty groups and tail rows, awkward K/N, f32/bf16/f16
   inputs given as f32 values that `twin op` rounds, both rhs layouts, f32/bf16/f16 outputs,
   accumulate): the output must lie within the documented bound of the f64 NumPy result
   (tw_check.h: e = gamma(K) sum|a||b|, bound = e + u_out (|ref| + e) + tiny), and rows past the
   groups must keep their initial bytes.
   Also 16 dense GEMMs (every layout, batched and broadcast) and 16 grouped wgrads (ragged
   contracting dim, row-major and per-group transposed storage, NaN in the unread tail rows).
2. Every quantize mode x layout (and both MXFP8 scale orders, pow2 scales): the bytes of every
   output must equal golden/gen_quantize.quantize_np's.

Run: python3 golden/crosscheck.py [--twin PATH] [--seed N] [--cases 64] [--backend ref|gpu]
Writes JUnit XML (one testcase per case) to $XML_OUTPUT_FILE when Bazel sets it.
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_quantize  # noqa: E402  (NumPy + ml_dtypes only: the independent quantizer)

NP16 = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}
U_OUT = {"f32": 2.0 ** -24, "bf16": 2.0 ** -8, "f16": 2.0 ** -11}
TINY = {"f32": float(np.finfo(np.float32).tiny), "bf16": float(np.finfo(np.float32).tiny),
        "f16": 2.0 ** -25}
U_ACC = 2.0 ** -24
POISON = 0xA5


def rounded(x, dtype):
    """f32 values rounded (RNE) to dtype, as f64."""
    x = np.asarray(x, np.float32)
    if dtype == "f32":
        return x.astype(np.float64)
    return x.astype(NP16[dtype]).astype(np.float64)


def decode_out(arr, dtype):
    if dtype == "f32":
        assert arr.dtype == np.float32, arr.dtype
        return arr.astype(np.float64)
    assert arr.dtype == np.uint16, arr.dtype
    return arr.view(NP16[dtype]).astype(np.float64)


def as_codes(vals, dtype):
    """Storage of values already representable in dtype (f32 as is, 16-bit as u16 codes)."""
    v = np.asarray(vals, np.float32)
    return v if dtype == "f32" else v.astype(NP16[dtype]).view(np.uint16)


def poison_bytes(shape, dtype):
    nbytes = {"f32": 4, "bf16": 2, "f16": 2}[dtype]
    raw = np.full(int(np.prod(shape)) * nbytes, POISON, np.uint8)
    return raw.view(np.float32 if dtype == "f32" else np.uint16).reshape(shape)


class Runner:
    def __init__(self, twin, tmp, backend):
        self.twin, self.tmp, self.n, self.backend = twin, tmp, 0, backend

    def op(self, name, inputs, flags):
        """Runs twin op; returns {output name: array} or raises with twin's stderr."""
        self.n += 1
        d = os.path.join(self.tmp, "c%03d" % self.n)
        os.makedirs(d)
        args = [self.twin, "op", name, "--backend", self.backend, "--out-dir", os.path.join(d, "out")]
        for k, v in inputs.items():
            p = os.path.join(d, k + ".npy")
            np.save(p, v)
            args += ["--in", "%s=%s" % (k, p)]
        for k, v in flags.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError("twin op %s exited %d: %s" % (name, r.returncode, r.stderr.strip()))
        out = {}
        for f in os.listdir(os.path.join(d, "out")):
            out[f[:-4]] = np.load(os.path.join(d, "out", f))
        return out


def random_groups(rng, max_groups, max_size, empty_frac, max_tail):
    """(group sizes, S, M): some groups empty, M - S tail rows past the groups."""
    G = int(rng.integers(1, max_groups + 1))
    gs = rng.integers(0, max_size, size=G)
    gs[rng.random(G) < empty_frac] = 0
    S = int(gs.sum())
    return gs, S, S + int(rng.integers(0, max_tail + 1))


def grouped_gemm_case(run, rng, i):
    gs, S, M = random_groups(rng, 12, 40, 0.25, 4)
    G = len(gs)
    K = int(rng.choice([1, 5, 17, 33, 64, 100, 217, 300]))
    N = int(rng.choice([1, 3, 16, 31, 64]))
    dt = str(rng.choice(["f32", "bf16", "f16"]))
    out_dt = str(rng.choice(["f32", "bf16", "f16"]))
    rhs_op = str(rng.choice(["N", "T"]))
    accumulate = int(rng.random() < 0.3)
    lim = 4.0 if dt != "f16" else 2.0
    lhs32 = (rng.standard_normal((M, K)) * lim).astype(np.float32)
    rhs32 = (rng.standard_normal((G, K, N) if rhs_op == "N" else (G, N, K)) * lim).astype(np.float32)
    lhs, rhs = rounded(lhs32, dt), rounded(rhs32, dt)
    init = rounded(rng.standard_normal((M, N)), out_dt) if accumulate else None
    inputs = dict(lhs=lhs32, rhs=rhs32,
                  group_sizes=gs.astype(np.int64 if i % 2 else np.int32))  # i64 is converted
    flags = dict(lhs_dtype=dt, rhs_dtype=dt, rhs_op=rhs_op, out_dtype=out_dt, accumulate=accumulate)
    if accumulate:
        inputs["out_init"] = as_codes(init, out_dt)
    got_raw = run.op("grouped_gemm", inputs, flags)["out"]
    got = decode_out(got_raw, out_dt)
    ref = np.zeros((M, N))
    absp = np.zeros((M, N))
    off = np.concatenate([[0], np.cumsum(gs)])
    for g in range(G):
        w = rhs[g] if rhs_op == "N" else rhs[g].T
        a = lhs[off[g]:off[g + 1]]
        ref[off[g]:off[g + 1]] = a @ w
        absp[off[g]:off[g + 1]] = np.abs(a) @ np.abs(w)
    if accumulate:
        ref[:S] += init[:S]
        absp[:S] += np.abs(init[:S])
    desc = "G=%d S=%d M=%d K=%d N=%d %s->%s rhs_op=%s acc=%d" % (G, S, M, K, N, dt, out_dt, rhs_op, accumulate)
    ratio = check_bound(desc, got[:S], ref[:S], absp[:S], K, out_dt)
    tail_want = as_codes(init[S:], out_dt) if accumulate else poison_bytes((M - S, N), out_dt)
    if not np.array_equal(got_raw[S:].view(np.uint8), np.ascontiguousarray(tail_want).view(np.uint8)):
        raise AssertionError("%s: rows past the groups were written" % desc)
    return "%s worst err/bound %.3f" % (desc, ratio)


def check_bound(desc, got, ref, absp, K, out_dt):
    """got within the documented bound of ref; returns the worst err/bound."""
    ku = K * U_ACC
    e = (ku / (1 - ku)) * absp
    bound = e + U_OUT[out_dt] * (np.abs(ref) + e) + TINY[out_dt]
    err = np.abs(got - ref)
    bad = ~(err <= bound)
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        raise AssertionError("%s: %d elements out of bound; first %s got %r ref %r bound %r"
                             % (desc, bad.sum(), list(idx), got[idx], ref[idx], bound[idx]))
    return float(np.max(err / bound)) if err.size else 0.0


def gemm_case(run, rng, i):
    """Dense (optionally batched, with a broadcast 2-D operand) GEMM in every layout."""
    M, K, N = (int(rng.choice([1, 5, 17, 64, 130])) for _ in range(3))
    op_a, op_b = str(rng.choice(["N", "T"])), str(rng.choice(["N", "T"]))
    dt, out_dt = str(rng.choice(["f32", "bf16", "f16"])), str(rng.choice(["f32", "bf16", "f16"]))
    B = int(rng.choice([0, 0, 3]))
    ba, bb = (B, B) if B and i % 3 == 0 else ((B, 0) if B and i % 3 == 1 else (0, B))
    sa = ((ba,) if ba else ()) + ((K, M) if op_a == "T" else (M, K))
    sb = ((bb,) if bb else ()) + ((N, K) if op_b == "T" else (K, N))
    a32 = rng.standard_normal(sa).astype(np.float32)
    b32 = rng.standard_normal(sb).astype(np.float32)
    a, b = rounded(a32, dt), rounded(b32, dt)
    A = a if op_a == "N" else np.swapaxes(a, -1, -2)
    Bm = b if op_b == "N" else np.swapaxes(b, -1, -2)
    got = decode_out(run.op("gemm", dict(a=a32, b=b32), dict(a_dtype=dt, b_dtype=dt, op_a=op_a, op_b=op_b,
                                                            out_dtype=out_dt))["out"], out_dt)
    ref, absp = np.matmul(A, Bm), np.matmul(np.abs(A), np.abs(Bm))
    desc = "a%s b%s M=%d K=%d N=%d op=%s%s %s->%s" % (sa, sb, M, K, N, op_a, op_b, dt, out_dt)
    if got.shape != ref.shape:
        raise AssertionError("%s: output shape %s, want %s" % (desc, got.shape, ref.shape))
    return "%s worst err/bound %.3f" % (desc, check_bound(desc, got, ref, absp, K, out_dt))


def per_group_transposed(x, gs):
    """[M, C] -> [C, M] storage whose group g block is x_g^T ([C, m_g]) at element o_g * C."""
    M, C = x.shape
    flat = np.array(x, copy=True).reshape(-1)
    off = np.concatenate([[0], np.cumsum(gs)])
    for g in range(len(gs)):
        flat[off[g] * C:off[g + 1] * C] = x[off[g]:off[g + 1]].T.reshape(-1)
    return flat.reshape(C, M)


def wgrad_case(run, rng, i):
    """Grouped wgrad out[g] = lhs_g^T rhs_g: ragged contracting dim, both storages per operand."""
    gs, S, M = random_groups(rng, 8, 60, 0.25, 3)
    G = len(gs)
    K, N = int(rng.choice([1, 7, 33, 64])), int(rng.choice([1, 5, 17, 40]))
    lhs_op, rhs_op = str(rng.choice(["N", "T"])), str(rng.choice(["N", "T"]))
    dt, out_dt = str(rng.choice(["f32", "bf16", "f16"])), str(rng.choice(["f32", "bf16", "f16"]))
    x32 = rng.standard_normal((M, K)).astype(np.float32)
    y32 = rng.standard_normal((M, N)).astype(np.float32)
    x32[S:] = np.nan  # rows past the groups must never be read
    y32[S:] = np.nan
    x, y = rounded(x32, dt), rounded(y32, dt)
    inputs = dict(lhs=x32 if lhs_op == "N" else per_group_transposed(x32, gs),
                  rhs=y32 if rhs_op == "N" else per_group_transposed(y32, gs),
                  group_sizes=gs.astype(np.int32))
    got = decode_out(run.op("grouped_gemm_wgrad", inputs, dict(lhs_dtype=dt, rhs_dtype=dt, lhs_op=lhs_op,
                                                              rhs_op=rhs_op, out_dtype=out_dt))["out"], out_dt)
    off = np.concatenate([[0], np.cumsum(gs)])
    ref, absp = np.zeros((G, K, N)), np.zeros((G, K, N))
    for g in range(G):
        a, b = x[off[g]:off[g + 1]], y[off[g]:off[g + 1]]
        ref[g], absp[g] = a.T @ b, np.abs(a).T @ np.abs(b)
    desc = "G=%d S=%d M=%d K=%d N=%d lhs_op=%s rhs_op=%s %s->%s" % (G, S, M, K, N, lhs_op, rhs_op, dt, out_dt)
    for g in range(G):
        if gs[g] == 0 and np.any(got[g] != 0):
            raise AssertionError("%s: empty group %d is not exactly 0" % (desc, g))
    ratio = check_bound(desc, got, ref, absp, max(int(gs.max()), 1), out_dt)
    return "%s worst err/bound %.3f" % (desc, ratio)


def quantize_case(run, rng, mode, layout, qdtype, swizzled, pow2):
    gs, _, M = random_groups(rng, 5, 150, 0.3, 2)
    G = len(gs)
    K = int(rng.choice([1, 17, 32, 100, 130, 257]))
    x_dtype = str(rng.choice(["f32", "bf16", "f16"]))
    mag = 2.0 ** rng.integers(-10, 10, size=(M, 1))
    x32 = (rng.standard_normal((M, K)) * mag).astype(np.float32)
    if x_dtype == "f16":
        x32 = np.clip(x32, -60000, 60000)
    xr = rounded(x32, x_dtype).astype(np.float32)
    inputs = dict(x=x32, group_sizes=gs.astype(np.int32))
    flags = dict(mode=mode, layout=layout, qdtype=qdtype, x_dtype=x_dtype, swizzled=int(swizzled),
                 pow2_scales=int(pow2))
    scale = None
    if mode == "delayed":
        scale = rng.uniform(0.01, 4, size=G).astype(np.float32)
        inputs["scale"] = scale
    got = run.op("quantize", inputs, flags)
    want = gen_quantize.quantize_np(xr, gs, mode, qdtype, layout, pow2_scales=bool(pow2),
                                    swizzled=bool(swizzled), scale=scale)
    desc = "%s %s %s x=%s swz=%d pow2=%d G=%d M=%d K=%d" % (mode, layout, qdtype, x_dtype, swizzled, pow2, G, M, K)
    compared = 0
    for name, w in want.items():
        if w is None:
            continue
        if name not in got:
            if name == "col_scale_inv" and "row_scale_inv" in got:
                continue
            raise AssertionError("%s: twin wrote no %s" % (desc, name))
        g = got[name]
        wb, gb = np.ascontiguousarray(w).view(np.uint8).reshape(-1), np.ascontiguousarray(g).view(np.uint8).reshape(-1)
        if wb.size != gb.size:
            raise AssertionError("%s: %s has %d bytes, NumPy %d" % (desc, name, gb.size, wb.size))
        diff = np.nonzero(wb != gb)[0]
        if diff.size:
            raise AssertionError("%s: %s differs in %d bytes, first at byte %d (twin 0x%02x, NumPy 0x%02x)"
                                 % (desc, name, diff.size, diff[0], gb[diff[0]], wb[diff[0]]))
        compared += 1
    if not compared:
        raise AssertionError("%s: nothing compared" % desc)
    return "%s: %d outputs bit-exact" % (desc, compared)


def find_twin():
    for p in ("bazel-bin/tools/twin_cpu", "bazel-bin/tools/twin"):
        if os.access(p, os.X_OK):
            return p
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--twin", default=None, help="the twin binary (default bazel-bin/tools/twin_cpu)")
    ap.add_argument("--seed", type=int, default=20261121)
    ap.add_argument("--cases", type=int, default=64, help="random grouped GEMM cases")
    ap.add_argument("--backend", default="ref", help="the backend `twin op` runs on (ref or gpu)")
    args = ap.parse_args()
    twin = args.twin or find_twin()
    if not twin:
        print("crosscheck: no twin binary; build it (bazel build //tools:twin_cpu) or pass --twin")
        return 2
    np.seterr(all="ignore")
    rng = np.random.default_rng(args.seed)
    results = []  # (name, error or None)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
        run = Runner(os.path.abspath(twin), tmp, args.backend)
        for i in range(args.cases):
            name = "grouped_gemm_%02d" % i
            try:
                msg, err = grouped_gemm_case(run, rng, i), None
            except AssertionError as e:
                msg, err = str(e), str(e)
            results.append((name, err))
            print("[%s] %s: %s" % ("FAIL" if err else "PASS", name, msg))
        for kind, fn, n in (("gemm", gemm_case, 16), ("wgrad", wgrad_case, 16)):
            for i in range(n):
                name = "%s_%02d" % (kind, i)
                try:
                    msg, err = fn(run, rng, i), None
                except AssertionError as e:
                    msg, err = str(e), str(e)
                results.append((name, err))
                print("[%s] %s: %s" % ("FAIL" if err else "PASS", name, msg))
        for mode in gen_quantize.MODES:
            for layout in ("rowwise", "colwise", "rowwise_colwise"):
                for swizzled in ((0, 1) if mode == "mxfp8" else (1,)):
                    pow2 = int(mode in ("current", "block1x128", "block128x128") and layout == "rowwise")
                    qdtype = "e5m2" if layout == "colwise" else "e4m3"
                    name = "quantize_%s_%s%s" % (mode, layout, "_compact" if mode == "mxfp8" and not swizzled else "")
                    try:
                        msg, err = quantize_case(run, rng, mode, layout, qdtype, swizzled, pow2), None
                    except AssertionError as e:
                        msg, err = str(e), str(e)
                    results.append((name, err))
                    print("[%s] %s: %s" % ("FAIL" if err else "PASS", name, msg))
    failed = sum(1 for _, e in results if e)
    print("%d passed, %d failed (seed %d, %.1f s)" % (len(results) - failed, failed, args.seed, time.time() - t0))
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        def esc(s):
            return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
        with open(xml, "w") as f:
            f.write('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites><testsuite name="crosscheck" '
                    'tests="%d" failures="%d">\n' % (len(results), failed))
            for name, err in results:
                if err:
                    f.write('<testcase classname="crosscheck" name="%s"><failure message="%s"/></testcase>\n'
                            % (name, esc(err)))
                else:
                    f.write('<testcase classname="crosscheck" name="%s"/>\n' % name)
            f.write("</testsuite></testsuites>\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
