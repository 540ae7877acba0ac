# Peer timings for `twin bench --backend gpu --op grouped_gemm --peers FILE`, adapted from
# ../../shared/peers/torch_grouped_mm.py: torch._grouped_mm (bf16) and torch._scaled_grouped_mm
# (fp8 e4m3, rowwise scales) on the five grouped shapes, dense bf16 / fp8 8192^3, each timed
# with triton.testing.do_bench (median, ms). Prints one JSON object on stdout (progress on
# stderr):  {"device": ..., "torch": ..., "rows": {"<key>": {"<peer>": ms, ...}, ...}}
# Keys: "grouped_G4_m8192_N4096_K7168" (peers torch._grouped_mm, torch._scaled_grouped_mm),
# "dense_8192" (peers torch.matmul, torch._scaled_mm), "wgrad_G4_m8192_N4096_K7168" (peer
# torch._grouped_mm in its ragged-K form: out [G, K, N] = torch._grouped_mm(x.t(), dy, offs)
# with x [G*m, K], dy [G*m, N], offs along the contracting dim; "wgrad_layout" says which
# operand layout torch took). Run on the GPU machine:
#   python3 tools/peers/torch_grouped_mm.py [--wgrad-only] > peers.json
# --wgrad-only: the bf16 forward and wgrad rows only (no fp8, no dense).
import json, os, sys
import torch
from triton.testing import do_bench

dev = "cuda"
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": {}}
def log(*a): print(*a, file=sys.stderr, flush=True)
def bench(f): return do_bench(f, warmup=50, rep=300, return_mode="median")

wgrad_only = "--wgrad-only" in sys.argv[1:]
shapes = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (32, 512, 2048, 7168),
          (128, 128, 2048, 4096)]
# TWIN_PEER_GG_SHAPES="GxMxNxK,..." (the list given to `twin bench --shapes`): those shapes instead
if os.environ.get("TWIN_PEER_GG_SHAPES"):
    shapes = [tuple(int(v) for v in t.split("x")) for t in os.environ["TWIN_PEER_GG_SHAPES"].split(",")]
    assert all(len(t) == 4 and min(t) >= 1 for t in shapes), shapes
for (G, m, N, K) in shapes:
    M = G * m
    row = {}
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16)
    offs = torch.arange(1, G + 1, device=dev, dtype=torch.int32) * m
    try:
        f = lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        f(); torch.cuda.synchronize()
        row["torch._grouped_mm"] = bench(f)
    except Exception as e:
        log("grouped_mm", repr(e)[:160])
    try:
        if wgrad_only: raise RuntimeError("skipped (--wgrad-only)")
        a8 = a.to(torch.float8_e4m3fn); b8 = b.to(torch.float8_e4m3fn)
        sa = torch.ones(M, device=dev, dtype=torch.float32); sb = torch.ones(G, N, device=dev, dtype=torch.float32)
        f8 = lambda: torch._scaled_grouped_mm(a8, b8.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16)
        f8(); torch.cuda.synchronize()
        row["torch._scaled_grouped_mm"] = bench(f8)
    except Exception as e:
        log("scaled_grouped_mm", repr(e)[:160])
    key = f"grouped_G{G}_m{m}_N{N}_K{K}"
    out["rows"][key] = row
    log(key, row)
    del a, b
    torch.cuda.empty_cache()
    # wgrad, same FLOPs: out [G, K, N] from x [M, K] and dy [M, N], ragged along M
    wrow = {}
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    for layout, xa in (("x.t() (column-major view)", lambda: x.t()), ("x.t().contiguous()", lambda: x.t().contiguous())):
        try:
            xt = xa()
            fw = lambda: torch._grouped_mm(xt, dy, offs=offs)
            o = fw(); torch.cuda.synchronize()
            assert tuple(o.shape) == (G, K, N), tuple(o.shape)
            wrow["torch._grouped_mm"] = bench(fw)
            wrow["wgrad_layout"] = layout
            break
        except Exception as e:
            log("wgrad grouped_mm", layout, repr(e)[:200])
    wkey = f"wgrad_G{G}_m{m}_N{N}_K{K}"
    out["rows"][wkey] = wrow
    log(wkey, wrow)
    del x, dy
    torch.cuda.empty_cache()

if wgrad_only:
    print(json.dumps(out))
    sys.exit(0)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
row = {"torch.matmul": bench(lambda: a @ b)}
a8 = a.to(torch.float8_e4m3fn); b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
one = torch.ones((), device=dev)
try:
    row["torch._scaled_mm"] = bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
except Exception as e:
    log("scaled_mm", repr(e)[:160])
out["rows"]["dense_8192"] = row
log("dense_8192", row)
print(json.dumps(out))
