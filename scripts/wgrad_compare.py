"""Tile sweep of the weight-gradient kernel (`moe_wgrad_kernel`): the old tiles against candidates.

For each T, on the preset's shape in bf16 with the routing of a softmax top-k (the last expert never
picked), the two launches of a training step (d gate_up_proj (E, 2I, H), d down_proj (E, H, I);
`moekit.bench.wgrad`) run with

    old        the tiles the kernel took from the forward's config until it had its own (the H200
               table's config at T: block_n x block_k capped at 64, 4 warps, 3 stages)
    default    `moekit.tuning.wgrad_config` at the call's rows per expert (what training runs now)
    n.. c..    `moekit.bench.wgrad.CANDIDATES` (output tile n x c, m rows a step, w warps, s stages;
               e..: the range kernel walking that many experts; a trailing rN: under a register cap)

Each variant is first checked (both launches, before any timing): error against the fp32 twin at
most 2x plain PyTorch's in the same dtype, exact zeros for the expert with no pairs, the same bits
on a second run. A variant that fails to compile or breaks the rule is reported and not timed.
Then each launch is timed alone from a CUDA graph, L2 flushed before every call, median of --rep
calls (`moekit.bench.timing.time_fn`; the graph holds the launcher's few small row_starts ops).
TFLOP/s counts placed pairs only; % is of the matmul ceiling measured in this run. A last table
lists every T's variants side by side, best first.

Budget: about 2-3 minutes on an H200 (compiles dominate: two kernels a variant, 24 variants).
`--device cpu` is a smoke run under the interpreter (tiny shape, float16, two small candidates).

Usage: python scripts/wgrad_compare.py [--tokens 1024,4096,16384] [--rep N] [--only 0,3,...]
       [--out rows.jsonl] [--device cpu] [--padding-zero [only]] [--range-max-regs 128] [--presorted]
"""

from __future__ import annotations

import os
import sys

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import argparse
import re
import time

import torch

import moekit.grouped_gemm_backward as gb
from moekit._workspace import poisoning
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.tile_sweep import Sweep, add_args, best_first, first_line, write_rows
from moekit.bench.wgrad import CANDIDATES, CPU_CANDIDATES, LAUNCHES, WgradCase, legacy_tiles, make_case
from moekit.tuning import ExpertsConfig, WgradConfig, get_config, shared_memory_limit, wgrad_config

PZ = " pz"
XS = " xs"
GPU_TOKENS = "1024,4096,16384"


def variants(case_cfg: ExpertsConfig, candidates: tuple[WgradConfig, ...], itemsize: int,
             device: torch.device, rows_per_expert: float) -> dict[str, dict[str, WgradConfig]]:
    """name -> tiles per launch: old, default (what a training step at these rows per expert
    runs), then the candidates (duplicates of an earlier one left out)."""
    default = wgrad_config(itemsize, device, rows_per_expert=rows_per_expert)
    out = {"old": legacy_tiles(case_cfg), "default": dict.fromkeys(LAUNCHES, default)}
    seen = {tuple(v.values()) for v in out.values()}
    for tiles in candidates:
        if tiles.pipeline_bytes(itemsize) > shared_memory_limit(device):
            continue                                      # over the device's limit: cannot launch
        key = (tiles, tiles)
        if key not in seen:
            seen.add(key)
            out[tiles.label()] = dict.fromkeys(LAUNCHES, tiles)
    return out


def run_variant(case: WgradCase, name: str, tiles: dict[str, WgradConfig], sweep: Sweep,
                matmul_tflops: float | None) -> dict:
    """Check, then time one variant; a name ending in PZ runs with padding_zero (the training step's
    launches: the sorted-row operand's loads need no index)."""
    pz = name.endswith(PZ)
    presorted = XS in name                    # the gathered operand copied into sorted order first
    regs = re.search(r" r(\d+)", name)      # the range kernel under a register cap
    gb.RANGE_MAX_REGS = int(regs.group(1)) if regs else None
    row = {"tokens": case.tokens, "variant": name, "padding_zero": pz,
           **{f"tiles_{k}": t.label() for k, t in tiles.items()},
           **{f"base_err_{k}": case.base_err[k] for k in LAUNCHES}}
    for k in LAUNCHES:                                    # checked before anything is timed
        try:
            with poisoning():                             # a tile left unwritten reads NaN
                got = case.run(k, tiles[k], pz, presorted)
                again = case.run(k, tiles[k], pz, presorted)
        except Exception as exc:                          # e.g. out of shared memory
            row["error"] = f"{k}: {first_line(exc)}"
            return row
        err, problem = case.problem(k, got)
        row[f"err_{k}"] = err
        if problem is None and not torch.equal(got, again):
            problem = "not bitwise reproducible"
        if problem:
            row["error"] = f"{k}: {problem}"
            return row
    for k in LAUNCHES:
        ms = sweep.time(lambda k=k: case.run(k, tiles[k], pz, presorted))
        row[f"ms_{k}"] = ms
        row[f"tflops_{k}"] = case.flops[k] / ms / 1e9
        if presorted:                         # the copy, timed alone (not in ms)
            row[f"ms_copy_{k}"] = sweep.time(lambda k=k: case.copy_operand(k))
    row["ms"] = sum(row[f"ms_{k}"] for k in LAUNCHES)
    row["tflops"] = sum(case.flops.values()) / row["ms"] / 1e9
    row["pct_ceiling"] = 100 * row["tflops"] / matmul_tflops if matmul_tflops else None
    return row


def describe(row: dict) -> str:
    head = f"{row['tokens']:>6} {row['variant']:>20}"
    if "error" in row:
        return f"{head} NOT TIMED: {row['error']}"
    return (f"{head} {row['ms_gate_up']:8.3f} {row['ms_down']:8.3f} {row['ms']:8.3f} {row['tflops']:7.1f} "
            f"{row['pct_ceiling'] or float('nan'):5.1f}% {row['err_gate_up']:9.2e} {row['err_down']:9.2e}"
            + ("" if row["tiles_gate_up"] == row["tiles_down"] else
               f"  ({row['tiles_gate_up']} / {row['tiles_down']})")
            + (f"  copies {row['ms_copy_gate_up']:.3f} + {row['ms_copy_down']:.3f}"
               if "ms_copy_down" in row else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p, GPU_TOKENS)
    p.add_argument("--only", default=None, help="comma-separated indices into the candidates (default: all)")
    p.add_argument("--padding-zero", nargs="?", const="both", choices=("both", "only"), default=None,
                   help="also run each variant with padding_zero (its name ends in ' pz'); 'only': "
                        "just those (the training step's launches)")
    p.add_argument("--range-max-regs", type=int, default=None,
                   help="also run each range-kernel variant with this register cap (name ' rN')")
    p.add_argument("--presorted", action="store_true",
                   help="also run each variant with the gathered operand (x, dout) copied into sorted-row "
                        f"order first (name '{XS.strip()}'; the copy timed apart, as ms_copy_*; with "
                        "--padding-zero the kernel then reads no index)")
    a = p.parse_args(argv)
    started = time.perf_counter()
    sweep = Sweep.from_args(p, a, GPU_TOKENS)
    dev, dtype, shape = sweep.device, sweep.dtype, sweep.shape
    candidates = CANDIDATES if sweep.on_gpu else CPU_CANDIDATES
    if a.only is not None:
        candidates = tuple(candidates[int(i)] for i in a.only.split(","))
    matmul = measure_ceilings(dev, dtype).matmul_tflops if sweep.on_gpu else None   # none interpreted
    print(f"{sweep.device_name}: matmul {matmul or float('nan'):.0f} TFLOP/s "
          f"({str(dtype).removeprefix('torch.')}); "
          f"torch {torch.__version__}; E={shape.num_experts} H={shape.hidden_size} "
          f"I={shape.intermediate_size} K={shape.top_k}", flush=True)
    print(f"{'T':>6} {'variant':>20} {'gate_up':>8} {'down':>8} {'ms':>8} {'TFLOP/s':>7} {'%ceil':>6} "
          f"{'err gu':>9} {'err dn':>9}")
    rows: list[dict] = []
    for t in sweep.tokens:
        cfg = get_config(shape, t, dtype, dev)
        case = make_case(shape, t, dtype, cfg.block_m, dev)
        found = variants(cfg, candidates, dtype.itemsize, dev, t * shape.top_k / shape.num_experts)
        if a.range_max_regs:   # range-kernel variants also under the register cap
            found.update({f"{n} r{a.range_max_regs}": v for n, v in list(found.items())
                          if v["gate_up"].experts > 1})
        if a.presorted:        # each variant also with its gathered operand copied into sorted order
            found.update({f"{n}{XS}": v for n, v in list(found.items())})
        if a.padding_zero:   # each variant also (or only) with padding_zero
            suffixes = ("", PZ) if a.padding_zero == "both" else (PZ,)
            found = {n + s: v for n, v in found.items() for s in suffixes}
        for vname, tiles in found.items():
            try:
                row = run_variant(case, vname, tiles, sweep, matmul)
            except Exception as exc:                       # timing failed: say why, go on
                row = {"tokens": t, "variant": vname, "error": "timing: " + first_line(exc)}
            row["matmul_tflops"] = matmul
            rows.append(row)
            print(describe(row), flush=True)
        del case
    print(f"\n{'T':>6} best first: variant ms (x old)", *best_first(rows, "old"), sep="\n")
    print(f"done in {time.perf_counter() - started:.0f} s")
    write_rows(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
