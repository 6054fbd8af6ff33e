"""Each forward GEMM of the triton path alone, under config variants, on a GPU (issues 10 and 15).

The tuning table holds one config a T for both GEMMs (`ExpertsConfig`: `persistent` switches both
kernels). This times GEMM1 (gate_up + SwiGLU, with and without the training step's pre-activation
store) and GEMM2 (down + routing weight) apart, each from a CUDA graph after an L2 flush
(`moekit.bench.timing.time_fn`), on the same alignment, for the table's config and variants of it:

    table         the tuned config
    persistent    + persistent (the kernels loop over tiles; paired tiles stay paired)
    s3, s5        stages 3 / 5 (both GEMMs; shrunk to fit shared memory, the label says what ran)
    n2=128        GEMM2 with 128-wide column tiles (also persistent; with 3 stages, 8 or 4 warps: two
                  programs an SM fit)
    w4            4 warps (both GEMMs)

Every variant's output is compared with the table config's (max abs difference; the K loop is the
same, so 0 is expected) before it is timed. Per row: median ms, useful TFLOP/s (2 S N K / t over the
routed pairs only), and the variant's time over the table's.

    PYTHONPATH=$PWD/src python3 scripts/gemm_split_compare.py [--tokens 2048,4096,16384] [--out F.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import torch

from moekit import PRESETS
from moekit.align import align_block_size
from moekit.bench.timing import time_fn
from moekit.grouped_gemm import gemm1_swiglu, gemm1_swiglu_with_pre, gemm2_weighted
from moekit.tuning import fit_shared_memory, get_config, shared_memory_budget


def variants(base):
    out = {"table": base, "persistent": dataclasses.replace(base, persistent=True)}
    for s in (3, 5):
        out[f"s{s}"] = dataclasses.replace(base, stages1=s, stages2=s)
    out["n2=128"] = dataclasses.replace(base, block_n2=128)
    out["w4"] = dataclasses.replace(base, warps1=4, warps2=4)
    out["persistent n2=128"] = dataclasses.replace(base, persistent=True, block_n2=128)
    # GEMM2 with two programs an SM (one's epilogue under the other's main loop): 96 KB of stages each
    out["n2=128 s3"] = dataclasses.replace(base, block_n2=128, stages2=3)
    out["n2=128 s3 w4"] = dataclasses.replace(base, block_n2=128, stages2=3, warps2=4)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,4096,16384")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dev, bf = torch.device("cuda"), torch.bfloat16
    shape = PRESETS[a.preset]
    e, hd, inter, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(e, 2 * inter, hd, device=dev, generator=gen) / hd ** 0.5).to(bf)
    down = (torch.randn(e, hd, inter, device=dev, generator=gen) / inter ** 0.5).to(bf)
    budget = shared_memory_budget(dev)
    lines = [f"# Forward GEMMs apart, {a.preset}, bf16, {torch.cuda.get_device_name()}", "",
             "| T | GEMM | variant | config | ms | TFLOP/s useful | ÷ table | max abs diff |",
             "|---:|---|---|---|---:|---:|---:|---:|"]
    for t in (int(v) for v in a.tokens.split(",")):
        x = torch.randn(t, hd, device=dev, generator=gen).to(bf)
        logits = torch.randn(t, e, device=dev, generator=gen)
        w, ids = torch.softmax(logits, -1).topk(k, -1)
        w, ids = (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()
        base = get_config(shape, t, bf, dev)
        align = align_block_size(ids, e, base.block_m, backend="triton")
        h_ref = gemm1_swiglu(x, gate_up, align, k, base)
        npad = int(align.num_padded)
        flops = {"GEMM1": 2 * t * k * hd * 2 * inter, "GEMM1+pre": 2 * t * k * hd * 2 * inter,
                 "GEMM2": 2 * t * k * hd * inter}
        refs = {"GEMM1": h_ref, "GEMM1+pre": h_ref, "GEMM2": gemm2_weighted(h_ref, down, w, align, base)}
        table_ms = {}
        for name, cfg in variants(base).items():
            cfg = fit_shared_memory(cfg, bf.itemsize, budget)
            label = (f"bm {cfg.block_m}x{cfg.pair_blocks} n {cfg.block_n1}/{cfg.block_n2} w {cfg.warps1}/"
                     f"{cfg.warps2} s {cfg.stages1}/{cfg.stages2}{' P' if cfg.persistent else ''}")
            calls = {"GEMM1": functools.partial(gemm1_swiglu, x, gate_up, align, k, cfg),
                     "GEMM1+pre": functools.partial(gemm1_swiglu_with_pre, x, gate_up, align, k, cfg),
                     "GEMM2": functools.partial(gemm2_weighted, h_ref, down, w, align, cfg)}
            for gemm, fn in calls.items():
                try:
                    got, ref = fn(), refs[gemm]
                    got = got[0] if isinstance(got, tuple) else got
                    if gemm != "GEMM2":            # h: rows in use (those past num_padded: never written)
                        got, ref = got[:npad], ref[:npad]
                    diff = (got.float() - ref.float()).abs().max().item()
                    ms = time_fn(fn, graph=True, rep=a.rep, device=dev).median_ms
                except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the rest go on
                    why = (str(exc).strip().splitlines() or [""])[-1][:120]
                    err = f"{type(exc).__name__}: {why}"
                    lines.append(f"| {t} | {gemm} | {name} | {label} | failed: {err} | | | |")
                    print(lines[-1], flush=True)
                    continue
                if name == "table":
                    table_ms[gemm] = ms
                ratio = ms / table_ms[gemm] if gemm in table_ms else float("nan")
                lines.append(f"| {t} | {gemm} | {name} | {label} | {ms:.4f} | {flops[gemm] / ms / 1e9:.0f} | "
                             f"{ratio:.3f} | {diff:.3g} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
