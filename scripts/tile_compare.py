"""Tile check for the triton path: the tuned config against persistent, paired-tile and TMA variants.

For each T, each config runs the whole expert path (align, GEMM1, GEMM2, sum) from a CUDA graph,
each call alone after an L2 flush (`moekit.bench.timing.time_fn`), on the same routing; the table
gives the median, % of the roofline floor (ceilings measured in this run), the rows computed per
useful row (padding) and the error against the fp32 reference. Variants per T (duplicates of an
earlier one are skipped, at most 6), `--set persistent` (the default):

    table            the tuned config
    persistent       table + persistent (`ExpertsConfig.persistent`: one program per resident slot,
                     each looping over tiles)
    persistent+tma   persistent + tma_weights
    p+tma bm128      persistent + tma_weights, 128-row tiles: block_n 128/256, block_k 64, 8 warps,
                     4/3 stages (the table's tile from T = 8192)
    p+tma paired     the same with paired tiles of 2 x 64 rows over 64-row blocks, 4/4 stages (the
                     table's tile at T = 2048-4096)
    p+tma bm64       the same with 64-row tiles, not paired

`--set flatten`: the experimental fused loops (`moekit.grouped_gemm.PERSISTENT_FLATTEN`, persistent
kernels without paired tiles; a name ending in " flat" runs with it, its config made unpaired):

    table, persistent, persistent flat, persistent+tma, persistent+tma flat, p+tma bm128 flat

`--set tma` (the TMA study of 2026-11-30):

    table            the tuned config
    tma              table + tma_weights (expert weights read through TMA descriptors)
    paired           paired tiles of 2 x 64 rows over 64-row blocks, block_n2 = 256
    paired+tma       paired + tma_weights
    tma k<BK> s<S>   table + tma_weights with block_k BK and S stages in both GEMMs (--tma-tiles;
                     shrunk to fit shared memory, the label shows what ran)

`--set decode` (the direct decode path, `moekit.decode`; tokens 1,2,4,8,16 unless --tokens):

    table            the tuned config (the four-kernel path)
    direct           the two decode kernels with `moekit.decode.DEFAULT_DECODE` (the backend's tiles
                     above `SMALL_DECODE_PAIRS` pairs; below, `SMALL_DECODE`, one of DECODE_TILES)
    direct <i>       ... with `moekit.decode.DECODE_TILES[i]` (block_n / block_k / warps / stages)
    Calls `experts_decode` directly (no MOEKIT_DECODE_DIRECT needed); T * K past
    `DECODE_MAX_PAIRS` still runs (it is a measurement, not the backend's decision).

`--set tables` (a table under test against what ships and the heuristic; T 16,64,128,256 unless
--tokens):

    table            the config `get_config` finds (a table in $MOEKIT_CONFIG_DIR first: the one
                     under test, e.g. `moekit tune`'s)
    packaged         the packaged table's config for T (`moekit.tuning.packaged_table`), or the
                     default where it has none in reach
    default          `moekit.tuning.default_config`: what an untuned shape runs

`--set group` (few-expert shapes, whose experts take several row blocks at decode sizes):

    table            the tuned config (or the default where the shape has no table)
    group <g>        table with group_m g (1, 2, 4, 8): `_swizzle` runs g row blocks' programs on
                     one column tile before the next, so an expert's second block reads the weight
                     tile the first just brought into L2 (with group_m 1 Mixtral 8x7B's second 16-row
                     block of an expert starts 224 GEMM1 column tiles later, past the L2: 72% of the
                     floor at 64 tokens against 91% with group_m 8, H200, session 17, which made 8
                     the default's group_m at every size)
    bm32             table with 32-row blocks (half the blocks, twice the padding)
    bm32 group 1     32-row blocks, ungrouped

A variant that fails to compile or run is reported on its line and the run goes on; one whose
error exceeds 2x the table config's (plus 1e-3) is reported and not timed. "tma" variants on a
device or Triton without TMA descriptors run the pointer path: the line says so.

A last table puts every T's variants side by side (ms, % of the floor). About 2-3 minutes on an H200
from a cold Triton cache (compiles dominate); `--device cpu --preset tiny --tokens 8` is a smoke run
under the interpreter.

Usage: python scripts/tile_compare.py [--set persistent|flatten|tma|decode|group|tables]
       [--tokens 1024,2048,...] [--tma-tiles 64:5,128:3,32:6] [--rep N] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import torch

import moekit
from moekit.align import align_block_size
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.results import write_jsonl
from moekit.bench.roofline import floor_ms
from moekit.bench.timing import time_fn
from moekit.decode import DECODE_TILES, DEFAULT_DECODE, DecodeConfig, experts_decode
from moekit.experts.triton import experts_triton
from moekit.grouped_gemm import resolve_tma
from moekit.reference import moe_experts_ref
from moekit.tuning import (
    default_config,
    fit_shared_memory,
    get_config,
    packaged_table,
    shared_memory_budget,
    table_slug,
)

MAX_VARIANTS = 6


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """"64:5,128:3" -> [(64, 5), (128, 3)]: (block_k, stages) pairs."""
    out = []
    for item in filter(None, text.split(",")):
        bk, _, stages = item.partition(":")
        out.append((int(bk), int(stages)))
    return out


# The persistent set's block shapes, all with TMA weights (`--set persistent`).
BIG_TILE = moekit.ExpertsConfig(block_m=128, block_n1=128, block_k1=64, warps1=8, stages1=4,
                                block_n2=256, block_k2=64, warps2=8, stages2=3, group_m=8,
                                tma_weights=True, persistent=True)
BLOCK_SHAPES = {
    "p+tma bm128": BIG_TILE,
    "p+tma paired": dataclasses.replace(BIG_TILE, block_m=64, pair_blocks=2, stages2=4),
    "p+tma bm64": dataclasses.replace(BIG_TILE, block_m=64, stages2=4),
}


def variants(base: moekit.ExpertsConfig, tma_tiles: list[tuple[int, int]], itemsize: int,
             budget: int, which: str = "persistent",
             others: dict[str, moekit.ExpertsConfig] | None = None) -> dict[str, moekit.ExpertsConfig]:
    """Named configs for one T, duplicates dropped, at most MAX_VARIANTS. others: the `--set tables`
    configs other than the table's (`table_variants`)."""
    tma = dataclasses.replace(base, tma_weights=True)
    persistent = dataclasses.replace(base, persistent=True)
    if which == "persistent":
        candidates = {"table": base, "persistent": persistent,
                      "persistent+tma": dataclasses.replace(persistent, tma_weights=True), **BLOCK_SHAPES}
    elif which == "decode":
        candidates = {"table": base, "direct": DEFAULT_DECODE,
                      **{f"direct {i}": t for i, t in enumerate(DECODE_TILES)}}
        return candidates                   # all of them: the table and len(DECODE_TILES) + 1 tiles
    elif which == "tables":
        candidates = {"table": base, **(others or {})}
    elif which == "group":
        bm32 = dataclasses.replace(base, block_m=32)
        groups = {f"group {g}": dataclasses.replace(base, group_m=g) for g in (1, 2, 4, 8)}
        candidates = {"table": base, **groups, "bm32": bm32,
                      "bm32 group 1": dataclasses.replace(bm32, group_m=1)}
    elif which == "flatten":
        flat = dataclasses.replace(persistent, pair_blocks=1)    # FLATTEN leaves paired tiles alone
        candidates = {"table": base, "persistent": persistent, "persistent flat": flat,
                      "persistent+tma": dataclasses.replace(persistent, tma_weights=True),
                      "persistent+tma flat": dataclasses.replace(flat, tma_weights=True),
                      "p+tma bm128 flat": BIG_TILE}
    else:
        paired = dataclasses.replace(base, block_m=64, pair_blocks=2, block_n2=256)
        candidates = {"table": base, "tma": tma, "paired": paired,
                      "paired+tma": dataclasses.replace(paired, tma_weights=True)}
        for bk, stages in tma_tiles:
            cfg = fit_shared_memory(dataclasses.replace(tma, block_k1=bk, block_k2=bk, stages1=stages,
                                                        stages2=stages), itemsize, budget)
            candidates[f"tma k{cfg.block_k1}/{cfg.block_k2} s{cfg.stages1}/{cfg.stages2}"] = cfg
    out: dict[str, moekit.ExpertsConfig] = {}
    for name, cfg in candidates.items():     # the table's and others' configs run as the runtime runs them
        cfg = cfg if name == "table" or name in (others or {}) else fit_shared_memory(cfg, itemsize, budget)
        seen = {(c, flattened(n)) for n, c in out.items()}
        if (cfg, flattened(name)) not in seen and len(out) < MAX_VARIANTS:
            out[name] = cfg
    return out


def table_variants(shape: moekit.MoEShape, t: int, dtype: torch.dtype,
                   dev: torch.device) -> dict[str, moekit.ExpertsConfig]:
    """`--set tables`' configs beside the table's: the packaged table's and the default."""
    packaged = packaged_table(table_slug(dev))
    return {"packaged": get_config(shape, t, dtype, dev, table=packaged),
            "default": default_config(shape, t, dtype.itemsize, dev)}


def flattened(name: str) -> bool:
    """Whether variant `name` runs with the fused persistent loops (`PERSISTENT_FLATTEN`)."""
    return name.endswith(" flat")


def run_flattened(flat: bool, fn):
    """fn() with `PERSISTENT_FLATTEN` set to flat while it launches (and while a graph captures it)."""
    import moekit.grouped_gemm as gg

    gg.PERSISTENT_FLATTEN = flat
    try:
        return fn()
    finally:
        gg.PERSISTENT_FLATTEN = False


def padding(ids: torch.Tensor, num_experts: int, cfg: moekit.ExpertsConfig) -> float:
    """Rows the GEMMs compute per routed pair."""
    a = align_block_size(ids, num_experts, cfg.block_m)
    codes = a.block_codes.long()
    rows = cfg.block_m * (codes.sum() if cfg.pair_blocks == 2 else (a.expert_ids >= 0).sum())
    return float(rows) / ids.numel()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def describe(cfg: moekit.ExpertsConfig | DecodeConfig, ran: moekit.ExpertsConfig) -> str:
    if isinstance(cfg, DecodeConfig):
        return f"direct decode {cfg.label()} (n k warps stages unroll: GEMV1/GEMV2[xslots])"
    note = " (TMA unsupported here: pointer path)" if cfg.tma_weights and not ran.tma_weights else ""
    return (f"bm={cfg.block_m}x{cfg.pair_blocks} n={cfg.block_n1}/{cfg.block_n2} "
            f"k={cfg.block_k1}/{cfg.block_k2} w={cfg.warps1}/{cfg.warps2} "
            f"s={cfg.stages1}/{cfg.stages2} g={cfg.group_m}{' persistent' if cfg.persistent else ''}{note}")


def run_tokens(layer: moekit.MoELayer, t: int, args, ceil, budget: int, dev: torch.device,
               dtype: torch.dtype) -> list[dict]:
    """One row per variant at T = t: timed, or with the reason it was not."""
    shape = layer.shape
    x = torch.randn(t, shape.hidden_size, device=dev, dtype=dtype)
    w, ids = layer.route(x)
    fl = floor_ms(shape, t, ids, dtype, ceil)
    ref = moe_experts_ref(x, layer.gate_up_proj, layer.down_proj, w, ids)
    table_err = None
    rows = []
    others = table_variants(shape, t, dtype, dev) if args.set == "tables" else None
    for name, cfg in variants(get_config(shape, t, dtype, dev), parse_tiles(args.tma_tiles), dtype.itemsize,
                              budget, args.set, others).items():
        direct = isinstance(cfg, DecodeConfig)
        ran = cfg if direct else resolve_tma(cfg, layer.gate_up_proj, layer.down_proj)
        tiles = describe(cfg, ran)
        fields = dataclasses.asdict(cfg) if direct else cfg.to_dict()
        row = dict(tokens=t, config=name, tma_ran=not direct and ran.tma_weights,
                   **{f"cfg_{k}": v for k, v in fields.items()})
        rows.append(row)
        if direct:
            fn = functools.partial(experts_decode, x, layer.gate_up_proj, layer.down_proj, w.contiguous(),
                                   ids.contiguous(), torch.empty_like(x), cfg)
        else:
            fn = functools.partial(run_flattened, flattened(name), functools.partial(
                experts_triton, x, layer.gate_up_proj, layer.down_proj, w, ids, config=cfg))
        try:
            out = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as exc:   # a tile the compiler refuses: say why, go on
            row["error"] = first_line(exc)
            print(f"{t:>6} {name:>18} FAILED {row['error']}  {tiles}", flush=True)
            continue
        err = rel(out, ref)
        table_err = err if table_err is None else table_err
        row["err_vs_fp32"] = err
        if err > 2 * table_err + 1e-3:
            row["error"] = f"wrong result: err {err:.3e} > 2x the table's {table_err:.3e}"
            print(f"{t:>6} {name:>18} WRONG ({row['error']}); not timed  {tiles}", flush=True)
            continue
        try:
            ms = time_fn(fn, graph=dev.type == "cuda", device=dev, rep=args.rep).median_ms
        except Exception as exc:
            row["error"] = "timing: " + first_line(exc)
            print(f"{t:>6} {name:>18} FAILED {row['error']}  {tiles}", flush=True)
            continue
        row.update(graph_ms=ms, floor_ms=fl, pct_floor=100 * fl / ms,
                   rows_per_pair=1.0 if direct else padding(ids, shape.num_experts, cfg))
        print(f"{t:>6} {name:>18} {ms:9.4f} {row['pct_floor']:6.1f}% {row['rows_per_pair']:9.3f} "
              f"{err:11.2e}  {tiles}", flush=True)
    return rows


def summary(rows: list[dict]) -> None:
    """ms and % of the floor side by side: a line per T, a column per variant."""
    names = list(dict.fromkeys(r["config"] for r in rows))
    print("\n" + f"{'T':>6} " + " ".join(f"{n:>20}" for n in names))
    for t in dict.fromkeys(r["tokens"] for r in rows):
        cells = {r["config"]: f"{r['graph_ms']:.3f} ms {r['pct_floor']:4.1f}%" if "graph_ms" in r
                 else "failed" for r in rows if r["tokens"] == t}
        print(f"{t:>6} " + " ".join(f"{cells.get(n, '-'):>20}" for n in names))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default=None,
                   help="default 1024,2048,4096,8192,16384 (--set decode: 1,2,4,8,16; --set group: "
                        "16,32,64,128; --set tables: 16,64,128,256)")
    p.add_argument("--set", default="persistent",
                   choices=("persistent", "flatten", "tma", "decode", "group", "tables"),
                   help="which variants: persistent kernels and block shapes, the fused loops, the "
                        "TMA study's, the direct decode path's tiles, row-block grouping, or a table against "
                        "the packaged one and the default")
    p.add_argument("--tma-tiles", default="64:5,128:3,32:6",
                   help="--set tma: block_k:stages pairs tried with TMA weights on top of the table config")
    p.add_argument("--rep", type=int, default=None, help="timed calls per variant (default: time_fn's)")
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under the interpreter (fp32, no graph)")
    args = p.parse_args()
    if args.tokens is None:
        default_tokens = {"decode": "1,2,4,8,16", "group": "16,32,64,128", "tables": "16,64,128,256"}
        args.tokens = default_tokens.get(args.set, "1024,2048,4096,8192,16384")
    started = time.perf_counter()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ceil = measure_ceilings(dev, dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}: copy {ceil.copy_gbps:.0f} GB/s, matmul {ceil.matmul_tflops:.0f} TFLOP/s; "
          f"torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    layer = moekit.MoELayer(moekit.get_shape(args.preset), dtype=dtype, device=dev).requires_grad_(False)
    rows: list[dict] = []
    print(f"{'T':>6} {'config':>18} {'graph ms':>9} {'%floor':>7} {'rows/pair':>9} {'err vs fp32':>11}"
          "  tiles")
    for t in (int(v) for v in args.tokens.split(",")):
        try:
            rows += run_tokens(layer, t, args, ceil, shared_memory_budget(dev), dev, dtype)
        except Exception as exc:   # the device itself failed (e.g. a fault left the context unusable)
            print(f"{t:>6} stopped: {first_line(exc)}", flush=True)
            break
    summary(rows)
    print(f"done in {time.perf_counter() - started:.0f} s")
    write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
