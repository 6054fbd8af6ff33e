"""`moekit tune`: search the Triton expert path's tiles for one shape on this GPU.

For each token count T and each candidate block_m, GEMM1's and GEMM2's tiles are searched
separately (each GEMM timed alone in a CUDA graph), then the whole path (align, both GEMMs, sum)
is timed with each block_m's winners and the fastest wins. Routing is uniform random with k
distinct experts per token; each timed graph runs R different routings back to back, so small T
reads more distinct experts than L2 holds and the weights come from HBM as in a real model.
Output: a JSON table in the format `moekit.tuning` loads (merged into --out if it exists).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from moekit.align import align_block_size
from moekit.experts.triton import experts_triton, gemm1_swiglu, gemm2_weighted
from moekit.shapes import PRESETS, MoEShape, get_shape
from moekit.tuning import ExpertsConfig, default_config, device_slug, shape_key

SMEM_LIMIT = 227 * 1024


def graph_time_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median ms of one replay of fn captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def block_m_candidates(shape: MoEShape, num_tokens: int) -> list[int]:
    rows = num_tokens * shape.top_k / shape.num_experts
    if rows <= 4:
        return [16]
    if rows <= 16:
        return [16, 32]
    if rows <= 64:
        return [16, 32, 64]
    if rows <= 256:
        return [32, 64, 128]
    return [64, 128]


def gemm_candidates(block_m: int, itemsize: int, swiglu: bool) -> list[dict[str, int]]:
    """Tiles (block_n, block_k, warps, stages) whose pipelined operands fit in shared memory."""
    if block_m <= 32:
        # Few rows: the kernel streams weights; narrow tiles give more programs per SM in flight.
        space = itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))
    else:
        space = itertools.product((64, 128, 256) if not swiglu else (64, 128), (64, 128), (4, 8), (3, 4))
    out = []
    for bn, bk, warps, stages in space:
        b_tiles = 2 if swiglu else 1
        smem = stages * (block_m * bk + b_tiles * bk * bn) * itemsize
        if smem <= SMEM_LIMIT:
            out.append(dict(block_n=bn, block_k=bk, warps=warps, stages=stages))
    return out


def _with(cfg: ExpertsConfig, which: int, p: dict[str, int]) -> ExpertsConfig:
    return replace(cfg, **{f"block_n{which}": p["block_n"], f"block_k{which}": p["block_k"],
                           f"warps{which}": p["warps"], f"stages{which}": p["stages"]})


def _gemm1_all(xs, gate_up, aligns, top_k, cfg):
    return [gemm1_swiglu(x, gate_up, a, top_k, cfg) for x, a in zip(xs, aligns)]


def _gemm2_all(hs, down, ws, aligns, cfg):
    return [gemm2_weighted(h, down, w, a, cfg) for h, w, a in zip(hs, ws, aligns)]


def _path_all(xs, gate_up, down, ws, ids, cfg):
    return [experts_triton(x, gate_up, down, w, t, config=cfg) for x, w, t in zip(xs, ws, ids)]


def tune_tokens(shape: MoEShape, num_tokens: int, dtype: torch.dtype, rotations: int,
                log: Callable[[str], None] = print) -> tuple[ExpertsConfig, list[dict]]:
    dev = torch.device("cuda")
    e, h, i, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    gen = torch.Generator(device="cpu").manual_seed(num_tokens)
    gate_up = (torch.randn(e, 2 * i, h, device=dev, dtype=dtype) / h**0.5)
    down = (torch.randn(e, h, i, device=dev, dtype=dtype) / i**0.5)
    xs, ws, ids = [], [], []
    for _ in range(rotations):
        xs.append(torch.randn(num_tokens, h, generator=gen).to(dev, dtype))
        ids.append(torch.rand(num_tokens, e, generator=gen).argsort(1)[:, :k].to(dev, torch.int32))
        ws.append(torch.softmax(torch.randn(num_tokens, k, generator=gen), -1).to(dev))
    records: list[dict] = []
    best_total, best_cfg = float("inf"), None
    for bm in block_m_candidates(shape, num_tokens):
        base = replace(default_config(shape, num_tokens), block_m=bm, group_m=1 if bm <= 32 else 8)
        aligns = [align_block_size(t, e, bm) for t in ids]
        winners = {}
        for which in (1, 2):
            timed = []
            hs = None
            if which == 2:
                hs = [gemm1_swiglu(x, gate_up, a, k, base) for x, a in zip(xs, aligns)]
            for p in gemm_candidates(bm, gate_up.element_size(), swiglu=which == 1):
                cfg = _with(base, which, p)
                if which == 1:
                    fn = functools.partial(_gemm1_all, xs, gate_up, aligns, k, cfg)
                else:
                    fn = functools.partial(_gemm2_all, hs, down, ws, aligns, cfg)
                try:
                    ms = graph_time_ms(fn) / rotations
                except Exception as exc:  # a tile the compiler cannot fit: skip it, say why
                    log(f"  skip T={num_tokens} bm={bm} gemm{which} {p}: {type(exc).__name__}")
                    continue
                timed.append((ms, p))
                records.append(dict(tokens=num_tokens, block_m=bm, gemm=which, ms=ms, **p))
            winners[which] = min(timed, key=lambda t: t[0])[1]
        cfg = _with(_with(base, 1, winners[1]), 2, winners[2])
        total = graph_time_ms(functools.partial(_path_all, xs, gate_up, down, ws, ids, cfg)) / rotations
        records.append(dict(tokens=num_tokens, gemm=0, ms=total, **cfg.to_dict()))
        log(f"T={num_tokens:>6} bm={bm:>3}: {total * 1e3:8.1f} us  {cfg}")
        if total < best_total:
            best_total, best_cfg = total, cfg
    assert best_cfg is not None
    return best_cfg, records


def write_table(path: Path, key: str, found: dict[int, ExpertsConfig]) -> None:
    table = json.loads(path.read_text()) if path.is_file() else {}
    entry = table.setdefault(key, {})
    entry.update({str(t): c.to_dict() for t, c in sorted(found.items())})
    table[key] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", default="1,4,16,64,256,1024,2048,4096,8192,16384",
                   help="comma-separated token counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--rotations", type=int, default=0,
                   help="routings per timed graph (default: enough to read past L2 at small T)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON table to write or merge into (default: tuning/configs/<device>.json)")
    p.add_argument("--records", type=Path, default=None, help="also write every timing as JSON lines")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("moekit tune needs a CUDA GPU; the packaged defaults serve CPU runs.")
        return 2
    shape = get_shape(args.preset)
    dtype = getattr(torch, args.dtype)
    out = args.out or Path(__file__).parent / "configs" / f"{device_slug()}.json"
    found, records = {}, []
    for t in (int(v) for v in args.tokens.split(",")):
        rot = args.rotations or (8 if t <= 16 else 2 if t <= 256 else 1)
        found[t], rec = tune_tokens(shape, t, dtype, rot)
        records += rec
        write_table(out, shape_key(shape, dtype), {t: found[t]})
    if args.records:
        args.records.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {out}")
    return 0
