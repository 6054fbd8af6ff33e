"""GEMV1's shared pairs (DecodeConfig.share) on / off: the direct path on the router's routing (Qwen3-30B-A3B
and OLMoE, bf16), CUDA graph after the written flush, same routing, rounds alternating; % of the floor."""
import dataclasses, sys, torch, moekit
from moekit.decode import decode_config, experts_decode
from moekit.bench.timing import time_fn
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.roofline import floor_ms
from moekit.reference import moe_experts_ref

dev = torch.device("cuda"); dt = torch.bfloat16
ceil = measure_ceilings(dev, dt)
print(f"copy {ceil.copy_gbps:.0f} GB/s", flush=True)
for preset in sys.argv[1].split(","):
    shape = moekit.get_shape(preset)
    layer = moekit.MoELayer(shape, dtype=dt, device=dev).requires_grad_(False)
    for T in (1, 2, 4, 8):
        torch.manual_seed(T)
        x = torch.randn(T, shape.hidden_size, device=dev, dtype=dt)
        w, ids = layer.route(x)
        w, ids = w.contiguous(), ids.contiguous()
        fl = floor_ms(shape, T, ids, dt, ceil)
        ref = moe_experts_ref(x, layer.gate_up_proj, layer.down_proj, w, ids)
        nd = int(torch.unique(ids).numel())
        res = {}
        for rnd in range(3):
            for share in (False, True):
                cfg = dataclasses.replace(decode_config(ids.numel()), share=share)
                out = torch.empty_like(x)
                fn = lambda: experts_decode(x, layer.gate_up_proj, layer.down_proj, w, ids, out, cfg)
                fn()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                res.setdefault(share, []).append((time_fn(fn, graph=True).median_ms, err))
        line = f"{preset} T={T} pairs={ids.numel()} distinct={nd} floor {fl*1e3:.1f} us"
        for share in (False, True):
            ms = [m for m, _ in res[share]]
            line += f" | share={share}: " + "/".join(f"{m*1e3:.1f}" for m in ms) + f" us ({100*fl/min(ms):.1f}% best) err {res[share][0][1]:.2e}"
        print(line, flush=True)
