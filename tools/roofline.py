#!/usr/bin/env python3
"""The roofline of a `twin port` report: every timed kernel as a point against the ceilings
measured in the same run. Left: ops with FLOPs (GEMMs) at their arithmetic intensity under
min(dense rate of the dtype, copy bandwidth x intensity). Right: streaming ops (quantize) as
achieved bandwidth against the copy ceiling.

    python3 tools/roofline.py report.json [roofline.png]     (default: next to report.json)

Needs matplotlib (python3 -m pip install matplotlib); the report itself does not."""
import json
import os
import sys


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    src = argv[1]
    out = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(src) or ".", "roofline.png")
    with open(src) as f:
        rep = json.load(f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("roofline.py: matplotlib is not installed (python3 -m pip install matplotlib)", file=sys.stderr)
        return 1
    ceil = rep.get("ceilings", {})
    bw = ceil.get("copy_gbs") or -1  # GB/s
    dense = [(k, ceil.get(k) or -1) for k in ("dense_fp8_tflops", "dense_bf16_tflops", "dense_f32_tflops")]
    rows = rep.get("timings", [])
    compute = [r for r in rows if (r.get("flops") or 0) > 0 and (r.get("bytes") or 0) > 0 and (r.get("ms") or 0) > 0]
    stream = [r for r in rows if not (r.get("flops") or 0) > 0 and (r.get("bytes") or 0) > 0 and (r.get("ms") or 0) > 0]
    versions = sorted({r["version"] for r in rows})
    colors = {v: plt.cm.tab10(i % 10) for i, v in enumerate(versions)}
    device = rep.get("facts", {}).get("device") or rep.get("facts", {}).get("cpu") or rep.get("backend", "")

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 8), gridspec_kw={"width_ratios": [3, 2]})
    # left: intensity (FLOP/byte) vs TFLOP/s
    xs = [r["flops"] / r["bytes"] for r in compute] or [1.0]
    ridges = [peak * 1e3 / bw for _, peak in dense if peak > 0 and bw > 0]  # FLOP/byte where the roof bends
    lo, hi = min(xs + ridges) / 4, max(xs + ridges) * 4
    for name, peak in dense:
        if peak <= 0:
            continue
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ys = [min(peak, bw * x / 1e3) if bw > 0 else peak for x in grid]
        ax.plot(grid, ys, "--", lw=1, color="gray")
        ax.annotate(f"{name.replace('_tflops', '').replace('_', ' ')} {peak:.3g} TFLOP/s", (hi, peak), ha="right",
                    va="bottom", fontsize=8, color="gray")
    for r in compute:  # fp8 operands as triangles: their roof is the fp8 line
        ax.scatter(r["flops"] / r["bytes"], r["flops"] / (r["ms"] * 1e-3) / 1e12, color=colors[r["version"]], s=22,
                   marker="^" if "e4m3" in r["shape"] or "e5m2" in r["shape"] else "o")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte); triangles: fp8 operands")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"GEMMs vs dense rate and copy bandwidth ({bw:.0f} GB/s)" if bw > 0 else "GEMMs")
    # right: streaming ops, achieved GB/s in report order
    for i, r in enumerate(stream):
        bx.scatter(i, r["bytes"] / (r["ms"] * 1e6), color=colors[r["version"]], s=22)
    if bw > 0:
        bx.axhline(bw, ls="--", color="gray", lw=1)
        bx.annotate(f"copy {bw:.0f} GB/s", (0, bw), va="bottom", fontsize=8, color="gray")
    bx.set_xticks(range(len(stream)))
    bx.set_xticklabels([f"{r['version']} {r['shape']}" for r in stream], rotation=90,
                       fontsize=max(3, min(7, 400 // max(1, len(stream)))))
    bx.set_xlabel("streaming kernel x shape (report order)")
    bx.set_ylabel("GB/s (bytes read + written)")
    bx.set_title("quantize and other streaming ops")
    handles = [plt.Line2D([], [], marker="o", ls="", color=colors[v], label=v) for v in versions]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8)
    fig.suptitle(f"twin port roofline: {device}")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(out, dpi=120)
    print(f"roofline.py: wrote {out} ({len(compute)} GEMM points, {len(stream)} streaming points)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
