"""Kernel-iteration check: triton vs grouped_mm on one preset, % of the roofline floor.

A short table for working on the kernels (the full study is `moekit bench`). Each timed call is
one routing of fresh random tokens; L2 is flushed before every call; captured = CUDA graph replay.
Usage: python scripts/quick_compare.py [--tokens 1,16,64,...] [--backends triton,grouped_mm]
"""

from __future__ import annotations

import argparse
import functools

import torch

import moekit
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.roofline import floor_ms
from moekit.bench.timing import NotCapturable, time_fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,16,64,256,1024,2048,4096,8192,16384")
    p.add_argument("--backends", default="triton,grouped_mm")
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    shape = moekit.get_shape(args.preset)
    ceil = measure_ceilings(dev, dtype)
    print(f"{torch.cuda.get_device_name()}: copy {ceil.copy_gbps:.0f} GB/s, "
          f"matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    torch.manual_seed(0)
    layer = moekit.MoELayer(shape, dtype=dtype, device=dev).requires_grad_(False)   # inference
    cols = ("T", "backend", "eager ms", "graph ms", "floor ms", "%floor", "TFLOP/s")
    print(" ".join(f"{c:>9}" for c in cols))
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, shape.hidden_size, device=dev, dtype=dtype)
        w, ids = layer.route(x)
        fl = floor_ms(shape, t, ids, dtype, ceil)
        for b in args.backends.split(","):
            fn = functools.partial(moekit.moe_experts, x, layer.gate_up_proj, layer.down_proj, w, ids,
                                   backend=b)
            eager = time_fn(fn, device=dev).median_ms
            try:
                graph = time_fn(fn, graph=True, device=dev).median_ms
            except NotCapturable:
                graph = float("nan")
            best = min(eager, graph) if graph == graph else eager
            tflops = t * shape.flops_per_token / (best * 1e-3) / 1e12
            print(f"{t:>9} {b:>9} {eager:9.4f} {graph:9.4f} {fl:9.4f} {100 * fl / best:6.1f}% {tflops:8.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
