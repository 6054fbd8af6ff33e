"""DRAM bytes, L2 hit rate and duration of each expert-path kernel, read by Nsight Compute (issue 15).

The forward GEMMs stream every expert's weights; whether each weight tile comes from DRAM once, or
once per row block that reads it (the L2 missing the reuse the tile order plans), decides how near the
bandwidth term of the floor a kernel can get. ncu counts it:

    ncu --clock-control none --target-processes all --csv --metrics \
        dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
        python3 scripts/dram_traffic.py --tokens 2048,4096 [--backward] > ncu.csv
    python3 scripts/dram_traffic.py --report ncu.csv

The run itself: for each T, the preset's inputs (`scripts/kernel_breakdown.py`'s), two warm-up calls
outside the profiled range, then one call (forward, or with --backward the training step) inside a
CUDA profiler range (`--profile-from-start off` on the ncu line profiles only that call). The report
sets each kernel's DRAM reads against the bytes it must read at least (the experts' weights it
touches, once), when the kernel is a forward GEMM.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_breakdown import _call, _inputs  # noqa: E402

from moekit.shapes import PRESETS  # noqa: E402


def run(args) -> None:
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    for tokens in args.tokens:
        fn = _call("triton", args.backward, *_inputs(args.preset, tokens, dtype, device))
        fn()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


# ncu's units, to seconds and bytes (it picks one per row)
UNITS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "%": 1.0}


def report(path: str, preset: str, tokens: list[int]) -> str:
    """A Markdown table of the ncu CSV: kernel, µs, DRAM read / write MB, L2 hit rate."""
    rows: dict[tuple[str, str], dict[str, float]] = {}
    order: list[tuple[str, str]] = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for rec in csv.DictReader(lines):
        key = (rec["ID"], rec["Kernel Name"].split("(")[0])
        if key not in rows:
            rows[key] = {}
            order.append(key)
        value = float(rec["Metric Value"].replace(",", ""))
        rows[key][rec["Metric Name"]] = value * UNITS.get(rec.get("Metric Unit", ""), 1.0)
    shape = PRESETS[preset]
    weights_mb = shape.num_experts * 3 * shape.hidden_size * shape.intermediate_size * 2 / 1e6
    out = [f"# DRAM traffic per kernel, {preset} (weights {weights_mb:.0f} MB in bf16, gate_up 2/3 of it)",
           "",
           f"Tokens per profiled call, in order: {', '.join(map(str, tokens))}.", "",
           "| # | kernel | µs | DRAM read MB | DRAM write MB | L2 hit % |", "|---:|---|---:|---:|---:|---:|"]
    nan = float("nan")
    for key in order:
        m = rows[key]
        out.append(f"| {key[0]} | `{key[1]}` | {m.get('gpu__time_duration.sum', nan) * 1e6:.1f} | "
                   f"{m.get('dram__bytes_read.sum', nan) / 1e6:.1f} | "
                   f"{m.get('dram__bytes_write.sum', nan) / 1e6:.1f} | "
                   f"{m.get('lts__t_sector_hit_rate.pct', nan):.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="2048,4096", type=lambda s: [int(t) for t in s.split(",")])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backward", action="store_true", help="profile the training step, not the forward")
    p.add_argument("--report", metavar="CSV", help="turn ncu's --csv output into a Markdown table")
    p.add_argument("--out", help="where the report goes (default: stdout)")
    args = p.parse_args(argv)
    if args.report:
        text = report(args.report, args.preset, args.tokens)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
