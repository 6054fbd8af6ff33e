"""FP8 against bf16 on the triton backend, side by side in one process: CUDA-graph replays of the
expert path at the Qwen3-30B-A3B shape (or --shape E,H,I,K), each call after an L2 flush, median of
the replays; plus the measured FP8 and bf16 dense ceilings. A quick look for kernel work; the
recorded numbers come from `moekit bench --weights fp8`.

    python tools/fp8_speed.py [--tokens 1,4,16,...] [--shape 128,2048,768,8] [--configs 'auto;block_m=64,...']
                              [--decode-tiles 'n16k256w4s3u1/n8k128w4s3u1x8;...']
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch
import triton.testing

import moekit
from moekit import decode
from moekit.quant import quantize_experts
from moekit.tuning import ExpertsConfig, fp8_tiles


def graph_ms(fn, flush: torch.Tensor, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    bf16 = 2 * n**3 / triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).T
    one = torch.ones((), device="cuda")
    fp8 = 2 * n**3 / triton.testing.do_bench(
        lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        return_mode="median") / 1e9
    return bf16, fp8


def parse_config(spec: str) -> ExpertsConfig | None:
    """"auto" (None) or fields "block_m=64,block_n2=128,warps1=4,tma_weights=1" over ExpertsConfig's
    defaults, made FP8 tiles."""
    if spec == "auto":
        return None
    fields = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    switches = {k: bool(fields.pop(k, 0)) for k in ("persistent", "tma_weights")}
    return fp8_tiles(ExpertsConfig(**fields, **switches))


def parse_decode(spec: str) -> decode.DecodeConfig:
    """Decode tiles as their label writes them: "n16k256w4s3u1/n8k128w4s3u1x8"."""
    def tiles(text: str) -> decode.GemvTiles:
        return decode.GemvTiles(*(int(v) for v in re.findall(r"\d+", text)))
    first, _, second = spec.partition("/")
    second, _, slots = second.partition("x")
    return decode.DecodeConfig(tiles(first), tiles(second), int(slots or 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384")
    p.add_argument("--shape", default="128,2048,768,8")
    p.add_argument("--configs", default="auto", help="';'-separated FP8 tiles, each 'auto' or "
                   "'block_m=64,block_n2=128,warps1=4,...'")
    p.add_argument("--decode-tiles", default="", help="';'-separated decode tiles as DecodeConfig.label() "
                   "writes them, timed instead of --configs where the decode path runs")
    args = p.parse_args()
    num_experts, hidden, inter, top_k = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    gu = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    dn = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    gu8, dn8 = quantize_experts(gu), quantize_experts(dn)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    specs = args.configs.split(";")
    bf16_peak, fp8_peak = ceilings()
    print(f"ceilings: bf16 {bf16_peak:.0f} TFLOP/s, fp8 {fp8_peak:.0f} TFLOP/s")
    print(f"{'T':>6} {'bf16 ms':>9} {'fp8 ms':>9} {'speed-up':>8} {'fp8 TFLOP/s':>11} {'% ceil':>6}  tiles")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, num_experts, device="cuda")
        w, ids = torch.topk(logits.softmax(-1), top_k)
        ids = ids.int()
        runs = [(spec, parse_config(spec), None) for spec in specs]
        if args.decode_tiles and decode.use_decode_direct(tokens, top_k, num_experts):
            runs = [(f"decode {s}", None, parse_decode(s)) for s in args.decode_tiles.split(";")]
        with torch.inference_mode():
            t16 = graph_ms(lambda x=x, w=w, ids=ids: moekit.moe_experts(x, gu, dn, w, ids), flush)
            for label, cfg, tiles in runs:
                def call(x=x, w=w, ids=ids, cfg=cfg, tiles=tiles):
                    if tiles is None:
                        return moekit.moe_experts(x, gu8, dn8, w, ids, config=cfg)
                    out = torch.empty_like(x)
                    scales = (gu8.scale, dn8.scale)
                    return decode.experts_decode(x, gu8.data, dn8.data, w, ids, out, tiles, scales)
                t8 = graph_ms(call, flush)
                tf = 2 * tokens * top_k * 3 * hidden * inter / t8 / 1e9
                pct = 100 * tf / fp8_peak
                print(f"{tokens:>6} {t16:>9.4f} {t8:>9.4f} {t16 / t8:>8.2f} {tf:>11.0f} {pct:>5.0f}% {label}")
    report_registers()


def report_registers() -> None:
    """Registers and spills of every FP8 GEMM kernel compiled in this process (spills: local memory)."""
    from moekit.grouped_gemm.fp8_kernels import moe_gemm1_fp8_kernel, moe_gemm2_fp8_kernel

    for kernel in (moe_gemm1_fp8_kernel, moe_gemm2_fp8_kernel):
        for cache in getattr(kernel, "device_caches", {}).values():
            for key, compiled in cache[0].items():
                meta = compiled.metadata
                print(f"{kernel.__name__}: regs {compiled.n_regs} spills {compiled.n_spills} "
                      f"warps {meta.num_warps} stages {meta.num_stages} smem {meta.shared} {str(key)[-120:]}")


if __name__ == "__main__":
    main()
