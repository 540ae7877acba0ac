#!/usr/bin/env python3
"""Peers for `twin bench --op quantize`: torch.compile'd fp8 (e4m3) quantize of a bf16
[32768, 7168] tensor on the GPU, one function per scaling mode (current, delayed, MXFP8 1x32,
block 1x128, block 128x128) and layout (rowwise; rowwise + colwise, transposed where twin's
colwise output is), plus current scaling per group (G = 8 equal groups). Prints a JSON list of
{"name", "shape", "ms"} (median of CUDA-event timings), which `twin bench --peers FILE` reads.

    python3 tools/peers/torch_quantize.py > peers.json
"""
import json
import sys

import torch

M, K, ITERS, WARMUP = 32768, 7168, 30, 5
FP8_MAX = 448.0


def per_tensor(x):
    amax = x.abs().amax().float()
    scale = torch.where((amax > 0) & torch.isfinite(amax), FP8_MAX / amax, torch.ones_like(amax))
    q = (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, 1.0 / scale, amax


def per_group(x, groups):
    xg = x.view(groups, -1)
    amax = xg.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where((amax > 0) & torch.isfinite(amax), FP8_MAX / amax, torch.ones_like(amax))
    q = (xg.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view_as(x), 1.0 / scale, amax


def median_ms(fn, *args):
    for _ in range(WARMUP):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


E4M3 = torch.float8_e4m3fn


def q8(v):
    return v.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def scale_of(amax):  # compute_scale of tw_quantize.h (no pow2)
    return torch.where((amax > 0) & torch.isfinite(amax), FP8_MAX / amax, torch.ones_like(amax))


def current_rowcol(x):
    q, si, amax = per_tensor(x)
    return q, q.t().contiguous(), si, amax


def delayed_row(x, s):
    return q8(x.float() * s), x.abs().amax().float()


def delayed_rowcol(x, s):
    q = q8(x.float() * s)
    return q, q.t().contiguous(), x.abs().amax().float()


def e8m0(amax):  # TE's float_to_e8m0: amax / fp8_max rounded up to a power of two, biased
    b = (amax.float() * (1.0 / FP8_MAX)).view(torch.int32)
    return ((b >> 23) + ((b & 0x7FFFFF) != 0).to(torch.int32)).clamp(0, 254)


def mx_mult(e):  # 2^(127 - e)
    return ((254 - e) << 23).view(torch.float32)


def mx_row(x):
    xb = x.view(M, K // 32, 32).float()
    e = e8m0(xb.abs().amax(-1))
    return q8(xb * mx_mult(e)[..., None]).view(M, K), e.to(torch.uint8)


def mx_rowcol(x):
    q, er = mx_row(x)
    xc = x.view(M // 32, 32, K).float()
    ec = e8m0(xc.abs().amax(1))
    return q, er, q8(xc * mx_mult(ec)[:, None, :]).view(M, K), ec.to(torch.uint8)


def b1x128_row(x):
    xb = x.view(M, K // 128, 128).float()
    s = scale_of(xb.abs().amax(-1))
    return q8(xb * s[..., None]).view(M, K), 1.0 / s


def b1x128_rowcol(x):
    q, si = b1x128_row(x)
    xc = x.view(M // 128, 128, K).float()
    sc = scale_of(xc.abs().amax(1))
    return q, si, q8(xc * sc[:, None, :]).view(M, K).t().contiguous(), 1.0 / sc


def b128_row(x):
    xb = x.view(M // 128, 128, K // 128, 128).float()
    s = scale_of(xb.abs().amax(dim=(1, 3)))
    return q8(xb * s[:, None, :, None]).view(M, K), 1.0 / s


def b128_rowcol(x):
    q, si = b128_row(x)
    return q, si, q.t().contiguous()


def main():
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    s = torch.ones((), device="cuda", dtype=torch.float32)
    rows = []
    eager = median_ms(per_tensor, x)
    rows.append({"name": "torch eager current row e4m3", "shape": f"{M}x{K} bf16", "ms": eager})
    # one torch.compile'd function per mode and layout, doing the same work as twin's kernel
    # (G = 1; `twin bench` matches them by name), and current scaling per group at G = 8
    peers = [("current row", per_tensor, (x,)), ("current row+col", current_rowcol, (x,)),
             ("delayed row", delayed_row, (x, s)), ("delayed row+col", delayed_rowcol, (x, s)),
             ("mxfp8 row", mx_row, (x,)), ("mxfp8 row+col", mx_rowcol, (x,)),
             ("block1x128 row", b1x128_row, (x,)), ("block1x128 row+col", b1x128_rowcol, (x,)),
             ("block128x128 row", b128_row, (x,)), ("block128x128 row+col", b128_rowcol, (x,)),
             ("current row G=8", lambda v: per_group(v, 8), (x,))]
    for name, fn, args in peers:
        try:
            rows.append({"name": f"torch.compile {name} e4m3", "shape": f"{M}x{K} bf16",
                         "ms": median_ms(torch.compile(fn), *args)})
        except Exception as e:  # one peer failing leaves the others
            print(f"peer {name}: {type(e).__name__}: {e}", file=sys.stderr)
    json.dump(rows, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
