"""Host time of one eager decode call of a patched Qwen3-MoE block, piece by piece (us a call)."""
import sys, time, cProfile, pstats, io
import torch
sys.path.insert(0, "scripts")
import generate_bench as gb
from moekit.integrations import transformers as mt
from moekit.eager_graphs import graph_cache

mt.register()
dev = torch.device("cuda")
model = gb.build(1, dev, torch.bfloat16, False)
model.set_experts_implementation("moekit")
mt.patch_moe_blocks(model)
dl = model.model.layers[0]
block, norm = dl.mlp, dl.post_attention_layernorm
x = torch.randn(1, 1, 2048, device=dev, dtype=torch.bfloat16)
flat = x.view(-1, 2048)
with torch.no_grad():
    for _ in range(3):
        block(x)
torch.cuda.synchronize()
layer = mt._block_layer(block, "auto")
cache = graph_cache(layer)
entry = next(iter(cache._entries.values()))
static = entry.inputs[0]

def host_us(fn, n=150, rounds=7):
    best = []
    with torch.no_grad():
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best.append((t1 - t0) / n * 1e6)
    best.sort()
    return best[len(best) // 2]

cases = {
    "block(x), patched": lambda: block(x),
    "_block_forward(block, x)": lambda: mt._block_forward(block, x),
    "_block_fast_layer checks": lambda: mt._block_fast_layer(block, x, flat),
    "layer._replay(flat)": lambda: layer._replay(flat),
    "layer._graph_key()": lambda: layer._graph_key(),
    "layer._graphable(flat)": lambda: layer._graphable(flat),
    "graph.replay()": lambda: entry.graph.replay(),
    "static.copy_(flat)": lambda: static.copy_(flat),
    "out.clone()": lambda: entry.output.clone(),
    "x.reshape(-1, H)": lambda: x.reshape(-1, 2048),
    "torch.zeros_like(x)": lambda: torch.zeros_like(x),
    "norm(x) (HF RMSNorm)": lambda: norm(x),
    "x + x": lambda: x + x,
}
for name, fn in cases.items():
    print(f"{name:30s} {host_us(fn):8.2f} us", flush=True)
mt.patch_moe_blocks(model, enabled=False)
for impl in ("grouped_mm", "moekit"):
    model.set_experts_implementation(impl)
    print(f"{'HF block, ' + impl:30s} {host_us(lambda: block(x)):8.2f} us", flush=True)
model.set_experts_implementation("moekit")
mt.patch_moe_blocks(model)
pr = cProfile.Profile()
with torch.no_grad():
    pr.enable()
    for _ in range(300):
        block(x)
    pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue())
