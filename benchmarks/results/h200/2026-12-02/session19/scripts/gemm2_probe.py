"""GEMM2 alone on Qwen3-30B-A3B at decode sizes: the table's tiles against persistent / flattened / TMA variants.
Isolated (graph after the written flush, time_fn) and back to back (graph of 4 routings / 4)."""
import dataclasses, sys, torch
import moekit, moekit.grouped_gemm as gg
from moekit.align import align_block_size
from moekit.bench.timing import time_fn
from moekit.bench.tune import graph_time_ms
from moekit.tuning import get_config
from moekit.shapes import PRESETS

shape = PRESETS["qwen3-30b-a3b"]
E, H, I, K = 128, 2048, 768, 8
dev = torch.device("cuda"); dt = torch.bfloat16
torch.manual_seed(0)
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H**0.5
down = torch.randn(E, H, I, device=dev, dtype=dt) / I**0.5
toks = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 64, 256]
R = dataclasses.replace
for T in toks:
    cfg0 = get_config(shape, T, dt, dev)
    print(f"\n== T={T} table: {cfg0}", flush=True)
    rots = []
    for r in range(4):
        x = torch.randn(T, H, device=dev, dtype=dt)
        ids = torch.rand(T, E, device=dev).argsort(1)[:, :K].to(torch.int32)
        w = torch.softmax(torch.randn(T, K, device=dev), -1)
        rots.append((x, ids, w))
    used = sum(int(torch.unique(ids).numel()) for _, ids, _ in rots[:1])
    gb = used * H * I * 2 / 1e9
    variants = {
        "table": (cfg0, False),
        "persistent": (R(cfg0, persistent=True), False),
        "pers flat": (R(cfg0, persistent=True, pair_blocks=1), True),
        "pers flat tma": (R(cfg0, persistent=True, pair_blocks=1, tma_weights=True), True),
        "tma": (R(cfg0, tma_weights=True), False),
        "flat n64k128s4": (R(cfg0, persistent=True, pair_blocks=1, block_n2=64, block_k2=128, stages2=4), True),
        "flat n128k64s4": (R(cfg0, persistent=True, pair_blocks=1, block_n2=128, block_k2=64, stages2=4), True),
        "flat n128k128s4": (R(cfg0, persistent=True, pair_blocks=1, block_n2=128, block_k2=128, stages2=4), True),
        "flat n256k64s3": (R(cfg0, persistent=True, pair_blocks=1, block_n2=256, block_k2=64, stages2=3), True),
        "flat tma n128k64s6": (R(cfg0, persistent=True, pair_blocks=1, tma_weights=True, block_n2=128, block_k2=64, stages2=6), True),
    }
    ref = None
    for name, (cfg, flat) in variants.items():
        try:
            data = []
            for x, ids, w in rots:
                a = align_block_size(ids, E, cfg.block_m)
                h = gg.gemm1_swiglu(x, gate_up, a, K, R(cfg0, block_m=cfg.block_m, pair_blocks=1, persistent=False))
                data.append((h, w, a))
            def one(d=data[0], cfg=cfg, flat=flat):
                gg.PERSISTENT_FLATTEN = flat
                try:
                    return gg.gemm2_weighted(d[0], down, d[1], d[2], cfg)
                finally:
                    gg.PERSISTENT_FLATTEN = False
            def four(cfg=cfg, flat=flat):
                for d in data:
                    one(d, cfg, flat)
            y = one().float()
            if ref is None:
                ref = y
            err = (y - ref).abs().max().item()
            iso = time_fn(one, graph=True).median_ms
            b2b = graph_time_ms(four) / 4
            print(f"{name:>20} iso {iso*1e3:7.1f} us ({gb/iso:5.2f} TB/s)  b2b {b2b*1e3:7.1f} us "
                  f"({gb/b2b:5.2f} TB/s)  maxdiff {err:.2e}  {cfg.block_m}x{cfg.pair_blocks} n{cfg.block_n2} k{cfg.block_k2} s{cfg.stages2}", flush=True)
        except Exception as exc:
            print(f"{name:>20} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
