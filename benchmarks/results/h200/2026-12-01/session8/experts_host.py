"""Diagnostic (not committed): host and device time of one Transformers experts call at T=1 per implementation,
and a profile of one eager decode step."""
import sys, time, statistics
import torch
sys.path.insert(0, "scripts")
from generate_bench import build
from moekit.integrations.transformers import register
from transformers.integrations.moe import ExpertsInterface

register(); register("moekit-no-graphs", eager_graphs=False)
ExpertsInterface.register("free-experts", lambda self, h, *_: torch.zeros_like(h))
model = build(2, torch.device("cuda"), torch.bfloat16, False)
block = model.model.layers[0].mlp
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    _, w, idx = block.gate(x)
print("weights", w.dtype, tuple(w.shape), "ids", idx.dtype)
impls = ["grouped_mm", "moekit", "moekit-no-graphs", "free-experts"]
for impl in impls:
    model.set_experts_implementation(impl)
    with torch.no_grad():
        for _ in range(30): block.experts(x, idx, w)
        torch.cuda.synchronize()
        host, total = [], []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(200): block.experts(x, idx, w)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) / 200 * 1e6); total.append((t2 - t0) / 200 * 1e6)
        blk = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200): block(x[None])
            torch.cuda.synchronize()
            blk.append((time.perf_counter() - t0) / 200 * 1e6)
    print(f"{impl:18s} experts call: host {statistics.median(host):7.1f} us, back to back {statistics.median(total):7.1f} us; whole block {statistics.median(blk):7.1f} us")
short = torch.randint(3, 1000, (1, 32), device="cuda")
from torch.profiler import profile, ProfilerActivity
for impl in ("moekit", "free-experts"):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        model.generate(short, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, disable_compile=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(short, max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=0, disable_compile=True)
            torch.cuda.synchronize()
    print(f"== profile {impl} (generate 9 new tokens, 2 layers)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
