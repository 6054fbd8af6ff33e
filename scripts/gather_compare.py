"""The backward's row gather (`moe_gather_rows_kernel`: token rows into sorted-row order) under tile
variants, on a GPU (issue 10).

    PYTHONPATH=$PWD/src python3 scripts/gather_compare.py [--tokens 4096,16384]

For each T, the preset's routing aligned as the training step aligns it, then dout-shaped rows
(T, H) copied into (L, H) by `sorted_rows` with GATHER_BLOCK_R x GATHER_BLOCK_C and num_warps set
per variant: median µs of isolated calls (L2 flushed), the GB/s of the bytes it must move (the
token rows it reads once, every sorted row it writes), and a bitwise check against the default.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_breakdown import _inputs  # noqa: E402

import moekit.grouped_gemm_backward as gb  # noqa: E402
from moekit.bench.timing import time_fn  # noqa: E402
from moekit.experts.triton import align_pairs, auto_config  # noqa: E402

VARIANTS = [(32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 512, 8), (16, 1024, 4), (32, 1024, 8),
            (128, 128, 4), (8, 2048, 8)]


def _with_warps(real, warps, *args, **kwargs):
    kwargs["num_warps"] = warps
    return real(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    print("| T | BLOCK_R x BLOCK_C, warps | µs | GB/s | bitwise the default |")
    print("|---:|---|---:|---:|---|")
    for tokens in (int(v) for v in a.tokens.split(",")):
        x, gate_up, _, _, ids, dout = _inputs(a.preset, tokens, torch.bfloat16, device)
        cfg = auto_config(tokens, gate_up, ids.shape[1], x.dtype, device)
        align = align_pairs(ids.contiguous(), gate_up.shape[0], cfg)
        rows = int(align.num_padded)
        nbytes = (tokens + rows) * dout.shape[1] * dout.element_size()
        base = None
        copy = functools.partial(gb.sorted_rows, dout, align, ids.shape[1])
        for br, bc, warps in VARIANTS:
            run = functools.partial(_with_warps, gb.moe_gather_rows_kernel.run, warps)
            with mock.patch.multiple(gb, GATHER_BLOCK_R=br, GATHER_BLOCK_C=bc), \
                    mock.patch.object(gb.moe_gather_rows_kernel, "run", run):
                out = copy()
                t = time_fn(copy, warmup=5, rep=30, device=device).median_ms
            same = True if base is None else torch.equal(out[:rows], base[:rows])
            base = out if base is None else base
            print(f"| {tokens} | {br} x {bc}, {warps} | {t * 1e3:.1f} | {nbytes / t / 1e6:.0f} | {same} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
