"""Tile sweep of the fused SwiGLU backward (`moe_swiglu_bwd_kernel`, reading the saved pre-activations).

For each T, on the preset's shape in bf16 with the routing of a softmax top-k (the last expert never
picked) and the block size of the forward's config at T (`moekit.tuning.get_config`), the launch a
training step runs (`moekit.grouped_gemm_backward.swiglu_backward` with `pre` from the forward's
GEMM1, all three outputs) runs with

    default    `BackwardTiles.fit` (what training runs now: `saved_tiles(block_m)` as they fit)
    n.. k..    candidates: block_n x block_k, stages, warps (those over the device's shared memory
               left out)

Each variant is first checked before any timing: dpre_w, h_w (at the placed rows) and d topk_weights
against the fp32 twin, error at most 2x plain PyTorch's in bf16 (`compute_dtype`), workspaces
poisoned (a row left unwritten reads NaN), the same bits on a second run. A variant that fails to
compile or breaks the rule is reported and not timed. Then each is timed alone from a CUDA graph, L2
flushed before every call, median of --rep calls. TFLOP/s counts the g GEMM of placed pairs
(2 * T * K * H * I). A last table lists each T's variants, best first.

`--device cpu` is a smoke run under the interpreter (tiny shape, float16, two small candidates).

Usage: python scripts/swiglu_bwd_compare.py [--tokens 4096,16384] [--rep N] [--out rows.jsonl] [--device cpu]
"""

from __future__ import annotations

import os
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import argparse
import functools
import itertools
import time

import torch

import moekit
from moekit._workspace import poisoning
from moekit.align import align_block_size
from moekit.bench.tile_sweep import Sweep, add_args, best_first, first_line, write_rows
from moekit.bench.wgrad import rel_err
from moekit.grouped_gemm import _placed_rows, gemm1_swiglu_with_pre
from moekit.grouped_gemm_backward import BackwardTiles, swiglu_backward, swiglu_backward_torch
from moekit.tuning import get_config, shared_memory_limit

OUTPUTS = ("dpre_w", "h_w", "topk_weights")
GPU_TOKENS = "4096,16384"
# The fastest of a first sweep (block_n, block_k in 64/128, 3-5 stages, 4/8 warps; H200,
# 2026-11-30), each with the saved pre-activations loaded after the loop and before it (pre_first);
# then two 64-column halves a program (halves=2), which may spill at 128 rows (aot_compile_check).
GPU_CANDIDATES = tuple(BackwardTiles(n, k, s, False, 8, first) for (n, k, s), first in itertools.product(
    ((64, 64, 5), (64, 64, 4), (64, 128, 4), (64, 128, 3), (128, 64, 5), (128, 64, 4), (128, 128, 4),
     (128, 128, 3), (64, 64, 3)), (False, True))) + tuple(
    BackwardTiles(64, k, s, False, w, first, 2) for k, s, w, first in (
        (64, 3, 8, False), (64, 4, 8, False), (64, 3, 8, True), (64, 3, 4, False), (32, 4, 8, False)))
CPU_CANDIDATES = (BackwardTiles(16, 16, 2, False, 4), BackwardTiles(32, 16, 3, False, 2, True),
                  BackwardTiles(16, 16, 2, False, 4, False, 2))


def make_case(shape: moekit.MoEShape, tokens: int, dtype: torch.dtype, dev: torch.device, seed: int = 0):
    e, hidden, inter, top_k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device=dev, generator=gen) * scale).to(dtype)

    logits = torch.randn(tokens, e, device=dev, generator=gen)
    logits[:, -1] = float("-inf")
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    cfg = get_config(shape, tokens, dtype, dev)
    align = align_block_size(ids, e, cfg.block_m, backend="torch")
    x, dout = randn(tokens, hidden), randn(tokens, hidden)
    gate_up = randn(e, 2 * inter, hidden, scale=hidden ** -0.5)
    down = randn(e, hidden, inter, scale=inter ** -0.5)
    _, pre = gemm1_swiglu_with_pre(x, gate_up, align, top_k, cfg)
    args = (x, gate_up, down, dout, w, align, top_k)
    ref = swiglu_backward_torch(*args, pre=pre)
    plain = swiglu_backward_torch(*args, pre=pre, compute_dtype=dtype)
    rows = _placed_rows(align)[0]
    pick = {"dpre_w": lambda g: g.dpre_w[rows], "h_w": lambda g: g.h_w[rows],
            "topk_weights": lambda g: g.topk_weights}
    base = {k: rel_err(pick[k](plain), pick[k](ref)) for k in OUTPUTS}
    flops = 2.0 * tokens * top_k * hidden * inter
    return cfg, args, pre, ref, base, pick, flops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p, GPU_TOKENS)
    a = p.parse_args(argv)
    started = time.perf_counter()
    sweep = Sweep.from_args(p, a, GPU_TOKENS)
    dev, dtype, shape = sweep.device, sweep.dtype, sweep.shape
    candidates = GPU_CANDIDATES if sweep.on_gpu else CPU_CANDIDATES
    print(f"{sweep.device_name}; torch {torch.__version__}; E={shape.num_experts} H={shape.hidden_size} "
          f"I={shape.intermediate_size} K={shape.top_k}", flush=True)
    rows: list[dict] = []
    for t in sweep.tokens:
        cfg, args, pre, ref, base, pick, flops = make_case(shape, t, dtype, dev)
        default = BackwardTiles.fit(cfg, dtype.itemsize, dev, recompute=False)
        variants = {"default": default}
        for c in candidates:
            fits = c.pipeline_bytes(cfg.block_m, dtype.itemsize) <= shared_memory_limit(dev)
            if fits and c not in variants.values():
                variants[c.label()] = c
        print(f"T={t}: block_m {cfg.block_m}, warps1 {cfg.warps1}, default {default.label()}; "
              f"plain {dtype} errors " + ", ".join(f"{k} {v:.2e}" for k, v in base.items()), flush=True)
        for name, tiles in variants.items():
            row = {"tokens": t, "variant": name, "tiles": tiles.label(), "block_m": cfg.block_m,
                   **{f"base_err_{k}": v for k, v in base.items()}}
            try:
                with poisoning():
                    got = swiglu_backward(*args, cfg, pre=pre, tiles=tiles)
                    again = swiglu_backward(*args, cfg, pre=pre, tiles=tiles)
            except Exception as exc:                          # e.g. out of shared memory
                row["error"] = first_line(exc)
            else:
                errs = {k: rel_err(pick[k](got), pick[k](ref)) for k in OUTPUTS}
                row.update({f"err_{k}": v for k, v in errs.items()})
                bad = [k for k in OUTPUTS if not errs[k] <= 2 * base[k]]
                if bad:
                    row["error"] = "error over 2x plain: " + ", ".join(bad)
                elif not all(torch.equal(pick[k](got), pick[k](again)) for k in OUTPUTS):
                    row["error"] = "not bitwise reproducible"
            if "error" not in row:
                ms = sweep.time(functools.partial(swiglu_backward, *args, cfg, pre=pre, tiles=tiles))
                row.update(ms=ms, tflops=flops / ms / 1e9)
                print(f"{t:>6} {name:>18} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  "
                      + " ".join(f"{errs[k]:.2e}" for k in OUTPUTS), flush=True)
            else:
                print(f"{t:>6} {name:>18} NOT TIMED: {row['error']}", flush=True)
            rows.append(row)
    print("\nbest first (x default):", *best_first(rows, "default", label="tiles", top=8), sep="\n")
    write_rows(a.out, rows)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if any("ms" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
