#!/usr/bin/env python3
"""Peer for `twin bench --op quantize`: torch.compile'd per-tensor (current scaling) fp8
quantize of a bf16 [32768, 7168] tensor on the GPU, and the same per group (G = 8 equal
groups, one amax and scale per group). Prints a JSON list of {"name", "shape", "ms"} (median
of CUDA-event timings), which `twin bench --peers FILE` reads.

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


def main():
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    rows = []
    eager = median_ms(per_tensor, x)
    rows.append({"name": "torch eager per-tensor e4m3", "shape": f"{M}x{K} bf16", "ms": eager})
    compiled = torch.compile(per_tensor)
    rows.append({"name": "torch.compile per-tensor e4m3", "shape": f"{M}x{K} bf16", "ms": median_ms(compiled, x)})
    grouped = torch.compile(per_group)
    rows.append({"name": "torch.compile per-group G=8 e4m3", "shape": f"{M}x{K} bf16",
                 "ms": median_ms(grouped, x, 8)})
    json.dump(rows, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
