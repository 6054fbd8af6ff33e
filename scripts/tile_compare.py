"""Tile-shape check for the triton path: the tuned config against paired-tile variants, side by side.

For each T, each config runs the whole expert path (align, GEMM1, GEMM2, sum) from a CUDA graph,
each call alone after an L2 flush (`moekit.bench.timing.time_fn`), on the same routing; the table
gives the median, % of the roofline floor (ceilings measured in this run) and the rows computed per
useful row (padding). Usage: python scripts/tile_compare.py [--tokens 1024,2048,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch

import moekit
from moekit.align import align_block_size
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.roofline import floor_ms
from moekit.bench.timing import time_fn
from moekit.experts.triton import experts_triton
from moekit.tuning import get_config


def variants(base: moekit.ExpertsConfig) -> dict[str, moekit.ExpertsConfig]:
    """The table's config, and paired tiles of the same height over half-height blocks."""
    out = {"table": base}
    for block_m in (32, 64):
        for n2 in (128, 256):
            cfg = dataclasses.replace(base, block_m=block_m, pair_blocks=2, block_n2=n2)
            out[f"paired{2 * block_m}/{block_m}-n2={n2}"] = cfg
    return out


def padding(ids: torch.Tensor, num_experts: int, cfg: moekit.ExpertsConfig) -> float:
    """Rows the GEMMs compute per routed pair."""
    a = align_block_size(ids, num_experts, cfg.block_m)
    codes = a.block_codes.long()
    rows = cfg.block_m * (codes.sum() if cfg.pair_blocks == 2 else (a.expert_ids >= 0).sum())
    return float(rows) / ids.numel()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    args = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    shape = moekit.get_shape(args.preset)
    ceil = measure_ceilings(dev, dtype)
    print(f"{torch.cuda.get_device_name()}: copy {ceil.copy_gbps:.0f} GB/s, "
          f"matmul {ceil.matmul_tflops:.0f} TFLOP/s")
    torch.manual_seed(0)
    layer = moekit.MoELayer(shape, dtype=dtype, device=dev).requires_grad_(False)
    rows = []
    print(f"{'T':>6} {'config':>22} {'graph ms':>9} {'%floor':>7} {'rows/pair':>9}")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, shape.hidden_size, device=dev, dtype=dtype)
        w, ids = layer.route(x)
        fl = floor_ms(shape, t, ids, dtype, ceil)
        ref = None
        for name, cfg in variants(get_config(shape, t, dtype, dev)).items():
            fn = functools.partial(experts_triton, x, layer.gate_up_proj, layer.down_proj, w, ids, config=cfg)
            out = fn()
            ref = out if ref is None else ref
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = time_fn(fn, graph=True, device=dev).median_ms
            row = dict(tokens=t, config=name, graph_ms=ms, floor_ms=fl, pct_floor=100 * fl / ms,
                       rows_per_pair=padding(ids, shape.num_experts, cfg), diff_vs_table=err,
                       **{f"cfg_{k}": v for k, v in cfg.to_dict().items()})
            rows.append(row)
            print(f"{t:>6} {name:>22} {ms:9.4f} {row['pct_floor']:6.1f}% {row['rows_per_pair']:9.3f}"
                  f"  (rel diff vs table {err:.1e})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
