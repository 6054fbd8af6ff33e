"""Eager greedy decoding, ms per new token, with bounds that free more than the experts:
free-block (the sparse MoE block returns zeros: no router, no experts) and free-sublayer (also the
post-attention RMSNorm returns its input). Interleaved repetitions, medians."""
import statistics, sys, json
from pathlib import Path
import torch
sys.path.insert(0, "scripts")
import generate_bench as gb
from moekit.integrations.transformers import patch_moe_blocks, register
from transformers.integrations.moe import ExpertsInterface

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 11
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
register()
ExpertsInterface.register("free-experts", lambda self, h, *_: torch.zeros_like(h))
dev = torch.device("cuda")
model = gb.build(layers, dev, torch.bfloat16, False)
dec = model.model.layers
gen = torch.Generator().manual_seed(1)
short = torch.randint(3, model.config.vocab_size, (1, 32), generator=gen).to(dev)

def zeros(h):
    return torch.zeros_like(h)

def ident(h):
    return h

def setup(v):
    patch_moe_blocks(model, enabled=v == "moekit-blocks")
    impl = {"grouped_mm": "grouped_mm", "moekit": "moekit", "moekit-blocks": "moekit",
            "free-experts": "free-experts"}.get(v, "grouped_mm")
    model.set_experts_implementation(impl)
    for layer in dec:
        for m in (layer.mlp, layer.post_attention_layernorm):
            m.__dict__.pop("forward", None)
        if v in ("free-block", "free-sublayer"):
            layer.mlp.forward = zeros
        if v == "free-sublayer":
            layer.post_attention_layernorm.forward = ident

def measure(v, n=32):
    setup(v)
    ms_n, out = gb.wall_ms(lambda: gb.generate(model, short, n, False), dev)
    ms_1, _ = gb.wall_ms(lambda: gb.generate(model, short, 1, False), dev)
    return (ms_n - ms_1) / (n - 1)

variants = ["grouped_mm", "moekit", "moekit-blocks", "free-experts", "free-block", "free-sublayer"]
for v in variants:
    measure(v); measure(v)
times = {v: [] for v in variants}
for r in range(reps):
    for v in variants:
        times[v].append(measure(v))
med = {v: statistics.median(t) for v, t in times.items()}
print(f"layers {layers}, reps {reps}, eager ms per new token (median, min-max), grouped_mm / variant")
for v in variants:
    print(f"{v:15s} {med[v]:7.3f} ({min(times[v]):.3f}-{max(times[v]):.3f})  {med['grouped_mm']/med[v]:.3f}x")
# host-side profile of one decode step: launches per step per variant
from torch.profiler import profile, ProfilerActivity
res = {}
for v in variants:
    setup(v)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        gb.generate(model, short, 2, False)
    k = sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    res[v] = k
print("CUDA kernels+copies in a 2-token generate (prefill of 32 + 1 decode step):", res)
Path(sys.argv[3] if len(sys.argv) > 3 else "gen_probe.json").write_text(json.dumps({"times": times, "launches": res}))
