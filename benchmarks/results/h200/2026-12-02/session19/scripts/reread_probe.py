"""Does the direct decode path pay DRAM for an expert read twice? GEMV1 / GEMV2 / both on routings of the
same size with S, S/2, ..., K distinct experts (Qwen3 shape), isolated (graph after the flush) and back to back."""
import torch
from moekit.decode import decode_gemm1_swiglu, decode_gemm2_sum, decode_config
from moekit.bench.timing import time_fn
from moekit.bench.tune import graph_time_ms

dev = torch.device("cuda"); dt = torch.bfloat16
E, H, I, K = 128, 2048, 768, 8
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H**0.5
down = torch.randn(E, H, I, device=dev, dtype=dt) / I**0.5
for T in (2, 4, 8):
    S = T * K
    perm = torch.randperm(E)[:S]
    for distinct_tokens in sorted({T, max(1, T // 2), 1}, reverse=True):
        # token t uses the expert set of token t % distinct_tokens
        ids = torch.stack([perm[(t % distinct_tokens) * K:(t % distinct_tokens + 1) * K] for t in range(T)]).to(dev, torch.int32)
        x = torch.randn(T, H, device=dev, dtype=dt)
        w = torch.softmax(torch.randn(T, K, device=dev), -1)
        cfg = decode_config(S)
        out = torch.empty(T, H, device=dev, dtype=dt)
        h = decode_gemm1_swiglu(x, gate_up, ids, cfg)
        g1 = lambda: decode_gemm1_swiglu(x, gate_up, ids, cfg)
        g2 = lambda: decode_gemm2_sum(h, down, w, ids, out, cfg)
        both = lambda: decode_gemm2_sum(decode_gemm1_swiglu(x, gate_up, ids, cfg), down, w, ids, out, cfg)
        nd = int(torch.unique(ids).numel())
        line = f"T={T} pairs={S} distinct experts={nd:>3}"
        for name, fn in (("gemv1", g1), ("gemv2", g2), ("both", both)):
            iso = time_fn(fn, graph=True).median_ms * 1e3
            b2b = graph_time_ms(lambda: [fn() for _ in range(4)]) / 4 * 1e3
            line += f" | {name} iso {iso:6.1f} b2b {b2b:6.1f} us"
        print(line, flush=True)
