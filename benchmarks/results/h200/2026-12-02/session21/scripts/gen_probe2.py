"""Eager greedy decoding, ms per new token, interleaved reps; per-rep ratios; host time spent inside
the MoE blocks (and the post-attention norms) measured in situ; runs with gc on and gc off."""
import gc, json, statistics as st, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "scripts")
import generate_bench as gb
from moekit.integrations.transformers import patch_moe_blocks, register

reps = int(sys.argv[1]); layers = int(sys.argv[2]); out = Path(sys.argv[3])
variants = sys.argv[4].split(",")
N = 48
register()
dev = torch.device("cuda")
model = gb.build(layers, dev, torch.bfloat16, False)
dec = model.model.layers
gen = torch.Generator().manual_seed(1)
short = torch.randint(3, model.config.vocab_size, (1, 32), generator=gen).to(dev)
acc = {"block": 0.0, "norm": 0.0}

def timed(fn, key):
    def f(h):
        t0 = time.perf_counter(); r = fn(h); acc[key] += time.perf_counter() - t0; return r
    return f

def setup(v):
    patch_moe_blocks(model, enabled=v.startswith("moekit-blocks"))
    model.set_experts_implementation("grouped_mm" if v in ("grouped_mm", "free-block", "free-sublayer") else "moekit")
    for layer in dec:
        b, n = layer.mlp, layer.post_attention_layernorm
        b.__dict__.pop("forward", None); n.__dict__.pop("forward", None)
        if v in ("free-block", "free-sublayer"):
            b.forward = timed(torch.zeros_like, "block")
        else:
            b.forward = timed(lambda h, b=b: type(b).forward(b, h), "block")
        if v == "free-sublayer":
            n.forward = timed(lambda h: h, "norm")
        else:
            n.forward = timed(lambda h, n=n: type(n).forward(n, h), "norm")

def measure(v, nogc):
    setup(v)
    res = {}
    for n in (N, 1):
        gc.collect()
        if nogc: gc.disable()
        acc["block"] = acc["norm"] = 0.0
        try:
            ms, _ = gb.wall_ms(lambda: gb.generate(model, short, n, False), dev)
        finally:
            gc.enable()
        res[n] = (ms, acc["block"] * 1e3, acc["norm"] * 1e3)
    return tuple((res[N][i] - res[1][i]) / (N - 1) for i in range(3))

for v in variants:
    measure(v, False); measure(v, False)
data = {}
for nogc in (False, True):
    rows = {v: [] for v in variants}
    for r in range(reps):
        for v in variants:
            rows[v].append(measure(v, nogc))
    data["gc off" if nogc else "gc on"] = rows
    base = [x[0] for x in rows[variants[0]]]
    print(f"\n== {'gc off' if nogc else 'gc on'}: layers {layers}, reps {reps}, {N} new tokens; ms per new token "
          f"(median, min-max); in-situ host ms per token in blocks / norms; {variants[0]} / variant: median of per-rep ratios")
    for v in variants:
        t = [x[0] for x in rows[v]]
        print(f"{v:16s} {st.median(t):7.3f} ({min(t):.3f}-{max(t):.3f})  blocks {st.median(x[1] for x in rows[v]):6.3f}"
              f"  norms {st.median(x[2] for x in rows[v]):6.3f}  ratio {st.median(a / b for a, b in zip(base, t)):.3f}"
              f"  ratio of medians {st.median(base) / st.median(t):.3f}", flush=True)
out.write_text(json.dumps(data))
