#!/usr/bin/env python3
"""Golden code tables for twin's numerics (tw_numerics.h), from NumPy + ml_dtypes only.

Re-run (from the repository root; deterministic, seeded):
    python3 golden/gen_numerics.py            # writes golden/data/numerics/*.npy
    python3 golden/gen_numerics.py --check    # regenerates in memory, fails if files differ
Needs numpy and ml_dtypes (written with numpy 2.4, ml_dtypes 0.6). Never uses twin's code.

Files (no case.txt: these are tables for tests/numerics_test.c, not runner cases). f32
values travel as their bit patterns in <i4 (int32) arrays, codes as <u2 / |u1:
    decode_<fmt>.npy    i32 [n_codes]  f32 bits of ml_dtypes' decode of code 0..n-1,
                        fmt in bf16, f16, e4m3, e5m2, e2m1 (16 codes), e8m0
    encode_inputs.npy   i32 [N]        f32 bits of the inputs (sorted unique bit patterns)
    encode_<fmt>.npy    codes [N]      x.astype(fmt): bf16, f16 (u2), e4m3, e5m2, e2m1 (u1)
    encode_<fmt>_sat.npy codes [N]     np.clip(x, -max, max).astype(fmt): e4m3, e5m2
    encode_e8m0_ceil.npy u1 [N]        TE's float_to_e8m0 (round up, saturating), derived
                                       here from np.frexp, not from bit tricks
Inputs: every bf16-representable f32 (65536 patterns: all signs, zeros, infs, NaNs,
subnormals); for e4m3, e5m2, e2m1 the midpoint of every pair of adjacent values and the f32
neighbours of each midpoint, and the overflow boundary (max + half an ulp) with neighbours;
every positive f16 and bf16 midpoint plus the neighbours of 8192 random ones; powers of two
2^-149..2^127 with neighbours (e8m0); f32 specials (NaN payloads, subnormals, max); 100000
random bit patterns and 30000 random values with exponents in fp8 range (seed 20261121).
"""
import argparse
import os
import sys

import ml_dtypes
import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "numerics")
SEED = 20261121

FORMATS = {  # name -> (ml_dtypes type, code dtype, number of codes)
    "bf16": (ml_dtypes.bfloat16, np.uint16, 65536),
    "f16": (np.float16, np.uint16, 65536),
    "e4m3": (ml_dtypes.float8_e4m3fn, np.uint8, 256),
    "e5m2": (ml_dtypes.float8_e5m2, np.uint8, 256),
    "e2m1": (ml_dtypes.float4_e2m1fn, np.uint8, 16),
    "e8m0": (ml_dtypes.float8_e8m0fnu, np.uint8, 256),
}


def bits_of(x):
    return np.asarray(x, dtype=np.float32).view(np.int32)


def decode_table(name):
    dt, code_dt, n = FORMATS[name]
    codes = np.arange(n, dtype=code_dt)
    return bits_of(codes.view(dt).astype(np.float32))


def finite_values(name):
    """Sorted distinct finite values of a format, as float64."""
    with np.errstate(invalid="ignore"):
        v = decode_table(name).view(np.float32).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def neighbours(x32):
    x32 = np.asarray(x32, dtype=np.float32)
    return np.concatenate([x32, np.nextafter(x32, np.float32(np.inf)),
                           np.nextafter(x32, np.float32(-np.inf))])


def midpoints(name):
    v = finite_values(name)
    mid = (v[:-1] + v[1:]) / 2
    assert np.all(mid.astype(np.float32).astype(np.float64) == mid), name  # exact in f32
    return mid.astype(np.float32)


def overflow_boundary(name):
    """max + half an ulp of max's binade: the tie that decides overflow."""
    mx = finite_values(name)[-1]
    mant_bits = {"e4m3": 3, "e5m2": 2, "e2m1": 1, "f16": 10, "bf16": 7}[name]
    ulp = 2.0 ** (np.floor(np.log2(mx)) - mant_bits)
    return np.float32(mx + ulp / 2)


def build_inputs():
    rng = np.random.default_rng(SEED)
    parts = [(np.arange(65536, dtype=np.uint32) << 16).view(np.int32)]
    for name in ("e4m3", "e5m2", "e2m1"):
        b = overflow_boundary(name)
        parts.append(bits_of(neighbours(np.concatenate([midpoints(name), [b, -b]]))))
    for name in ("f16", "bf16"):
        mid = midpoints(name)
        mid = np.concatenate([mid[mid > 0], [overflow_boundary(name)]])
        parts.append(bits_of(mid))
        pick = rng.choice(mid, size=8192, replace=False)
        pick = pick * rng.choice(np.array([-1, 1], dtype=np.float32), size=pick.size)
        parts.append(bits_of(neighbours(pick)))
    pow2 = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    parts.append(bits_of(neighbours(np.concatenate([pow2, -pow2]))))
    specials = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000,
                         0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0x7F802000, 0x7F801FFF,
                         0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000,
                         0x00400001, 0x003FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                         0x7F000000, 0x7F000001, 0x7F7F8000, 0x7F7F7FFF],
                        dtype=np.uint32).view(np.int32)
    parts.append(specials)
    parts.append(rng.integers(0, 2**32, size=100000, dtype=np.uint64).astype(np.uint32)
                 .view(np.int32))
    mant = rng.integers(0, 2**23, size=30000, dtype=np.uint32)
    expo = rng.integers(127 - 24, 127 + 20, size=30000, dtype=np.uint32)
    sign = rng.integers(0, 2, size=30000, dtype=np.uint32)
    parts.append(((sign << 31) | (expo << 23) | mant).view(np.int32))
    # sorted by bit pattern (as unsigned), duplicates removed
    return np.unique(np.concatenate(parts).view(np.uint32)).view(np.int32)


def e8m0_ceil(x32):
    """Smallest power of two >= x, as a biased exponent clamped to [0, 254]; NaN -> 255,
    negative (and -0) -> 0, +inf -> 254."""
    with np.errstate(invalid="ignore"):
        x = x32.astype(np.float64)
    out = np.zeros(x.shape, dtype=np.int64)
    pos = (x > 0) & ~np.signbit(x)
    m, e = np.frexp(np.where(pos & np.isfinite(x), x, 1.0))  # x = m * 2^e, m in [0.5, 1)
    ceil_log2 = np.where(m == 0.5, e - 1, e)
    out[pos] = np.clip(ceil_log2[pos] + 127, 0, 254)
    out[np.isposinf(x)] = 254
    out[np.isnan(x)] = 255
    return out.astype(np.uint8)


def build_tables():
    tables = {}
    for name in FORMATS:
        tables["decode_" + name] = decode_table(name)
    bits = build_inputs()
    x = bits.view(np.float32)
    tables["encode_inputs"] = bits
    with np.errstate(all="ignore"):
        for name in ("bf16", "f16", "e4m3", "e5m2", "e2m1"):
            dt, code_dt, _ = FORMATS[name]
            tables["encode_" + name] = x.astype(dt).view(code_dt)
        for name in ("e4m3", "e5m2"):
            dt, code_dt, _ = FORMATS[name]
            mx = np.float32(finite_values(name)[-1])
            tables["encode_%s_sat" % name] = np.clip(x, -mx, mx).astype(dt).view(code_dt)
    tables["encode_e8m0_ceil"] = e8m0_ceil(x)
    return tables


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the stored files")
    args = ap.parse_args()
    tables = build_tables()
    if args.check:
        bad = [k for k, v in tables.items()
               if not np.array_equal(np.load(os.path.join(OUT, k + ".npy")), v)]
        print("numerics goldens: %s" % ("differ: " + ", ".join(bad) if bad else "up to date"))
        return 1 if bad else 0
    os.makedirs(OUT, exist_ok=True)
    total = 0
    for k, v in tables.items():
        path = os.path.join(OUT, k + ".npy")
        np.save(path, np.ascontiguousarray(v))
        total += os.path.getsize(path)
    print("wrote %d tables, %d inputs, %.2f MB to %s" %
          (len(tables), tables["encode_inputs"].size, total / 1e6, OUT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
