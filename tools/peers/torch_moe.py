# Peer timings for `twin bench --backend gpu --op moe --peers FILE`: the MoE block written in
# PyTorch the way a framework engineer would (bf16; router: logits in f32, torch.topk, softmax
# over the k chosen; tokens sorted by expert; experts by torch._grouped_mm on [E, H, 2F] and
# [E, F, H]; SwiGLU; late weighting; index_add combine; Switch aux loss), forward + autograd
# backward timed with triton.testing.do_bench (median ms) on the shapes of tools/bench_gpu_moe.c.
# Prints one JSON object: {"device", "torch", "rows": {"moe_E32_T4096": {"torch_block": ms}}}.
#   python3 tools/peers/torch_moe.py > moe_peers.json
import json, os, sys
import torch
import torch.nn.functional as Fn
from triton.testing import do_bench

dev = "cuda"
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": {}}
def log(*a): print(*a, file=sys.stderr, flush=True)
H, F, K = 7168, 2048, 8

def block(x, gate, wi, wo, E, T):
    logits = x.float() @ gate.float()
    vals, idx = logits.topk(K, dim=-1)
    w = torch.softmax(vals, dim=-1)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[tok]
    h = torch._grouped_mm(xs, wi, offs=offs)
    a = Fn.silu(h[:, :F]) * h[:, F:]
    eo = torch._grouped_mm(a, wo, offs=offs)
    eo = eo * w.flatten()[order, None].to(eo.dtype)
    y = torch.zeros(T, H, device=dev, dtype=x.dtype).index_add_(0, tok, eo)
    p = torch.softmax(logits, dim=-1)
    aux = 0.01 * E / (K * T * T) * (p.sum(0) * counts.float()).sum()
    return y, aux

# TWIN_PEER_MOE_SHAPES="32x4096,256x4096": only those (E x T) shapes
shapes = ((32, 4096), (32, 16384), (256, 4096))
if os.environ.get("TWIN_PEER_MOE_SHAPES"):
    try:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in os.environ["TWIN_PEER_MOE_SHAPES"].split(","))
        assert all(len(t) == 2 and t[0] >= K and t[1] >= 1 for t in shapes)
    except (ValueError, AssertionError):
        sys.exit("torch_moe.py: TWIN_PEER_MOE_SHAPES wants ExT pairs like 32x4096,256x4096 (E >= %d, T >= 1), got '%s'"
                 % (K, os.environ["TWIN_PEER_MOE_SHAPES"]))
for (E, T) in shapes:
    key = f"moe_E{E}_T{T}"
    try:
        x = (torch.randn(T, H, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
        gate = (torch.randn(H, E, device=dev) * 0.01).to(torch.bfloat16).requires_grad_()
        wi = (torch.randn(E, H, 2 * F, device=dev, dtype=torch.bfloat16) * 0.01).requires_grad_()
        wo = (torch.randn(E, F, H, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        def step():
            for t in (x, gate, wi, wo):
                t.grad = None
            y, aux = block(x, gate, wi, wo, E, T)
            torch.autograd.backward([y, aux], [dy, torch.ones((), device=dev)])
        step(); torch.cuda.synchronize()
        out["rows"][key] = {"torch_block": do_bench(step, warmup=3, rep=200, return_mode="median")}
    except Exception as e:
        log(key, repr(e)[:300])
    log(key, out["rows"].get(key))
    for n in ("x", "gate", "wi", "wo", "dy"):
        globals().pop(n, None)
    torch.cuda.empty_cache()
print(json.dumps(out))
