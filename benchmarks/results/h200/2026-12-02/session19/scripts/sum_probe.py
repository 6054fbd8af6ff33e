"""moe_sum alone, the previous kernel (a copy of HEAD's sources on OLD) against the new, Qwen3 shape (H 2048, K 8)
and OLMoE (same H, K). Back to back: a graph of 2 calls on different y, / 2; isolated: time_fn after the flush."""
import importlib.util, sys, torch
from moekit.grouped_gemm import moe_sum, moe_sum_torch
from moekit.bench.timing import time_fn
from moekit.bench.tune import graph_time_ms
from moekit.launch_hints import pdl_kwargs
import triton

spec = importlib.util.spec_from_file_location("old_gg", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

def old_sum(y, ids, E, out):
    T, H = out.shape; K = ids.shape[1]
    bh = min(1024, triton.next_power_of_2(H)); bt = max(1, min(16, 4096 // bh))
    grid = (triton.cdiv(T, bt), triton.cdiv(H, bh))
    old.moe_sum_kernel[grid](y, ids, out, T, H, E, out.stride(0), out.stride(1), TOP_K=K, BLOCK_T=bt,
                             BLOCK_H=bh, num_warps=4, **pdl_kwargs(out.device))
    return out

dev = torch.device("cuda"); E, H, K = 128, 2048, 8
for T in (16, 64, 256, 1024, 4096, 16384):
    data = []
    for r in range(2):
        y = torch.randn(T * K, H, device=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (T, K), device=dev, dtype=torch.int32)
        ids[0, 1] = -1
        data.append((y, ids, torch.empty(T, H, device=dev, dtype=torch.bfloat16)))
    ref = moe_sum_torch(data[0][0], data[0][1], E)
    line = f"T={T:>6}"
    for name, fn in (("old", old_sum), ("new", moe_sum)):
        out = fn(data[0][0], data[0][1], E, torch.full_like(data[0][2], float("nan")))
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        iso = time_fn(lambda: fn(*data[0][:2], E, data[0][2]), graph=True).median_ms
        b2b = graph_time_ms(lambda: [fn(y, i, E, o) for y, i, o in data]) / 2
        gb = T * K * H * 2 / 1e9
        line += f" | {name}: iso {iso*1e3:7.2f} us  b2b {b2b*1e3:7.2f} us ({gb/b2b:4.2f} TB/s) err {err:.1e}"
    print(line, flush=True)
