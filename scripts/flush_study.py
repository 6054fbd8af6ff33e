"""How the cache flush before a timed call changes small-T results: the same calls after a written
flush (what `moekit bench` does), a clean one and none.

    PYTHONPATH=$PWD/src python3 scripts/flush_study.py [--tokens 1,2,4,8,16,64,256,1024]
        [--preset qwen3-30b-a3b] [--backends triton,grouped_mm] [--decode 4,5] [--out rows.jsonl]

`moekit.bench.timing` flushes the last-level cache by writing a buffer larger than it. That leaves
the cache full of dirty lines, and the timed call's first reads each evict one: a write-back to
memory inside the timed window, up to the cache's size (50 MB on an H200) beside a decode call's
weights (75 MB at T = 1 on Qwen3-30B-A3B). Per T and backend, each call is timed from a CUDA
graph after each of:

    write   the buffer written (the bench's flush)
    clean   written, then a second buffer as large read: the write-backs happen in the flush,
            the cache holds clean lines of no use to the call
    none    no flush: whatever the previous call left in the cache (weights that fit stay)

and, as a control that involves no MoE kernel, a plain read (`torch.amax`) of a buffer as large
as the call's floor bytes (the experts it touches, its activations) under the same three. The
floor is the bench's (bytes / the copy bandwidth measured in this run); % of the floor is floor /
median. Each backend's output is checked against the fp32 reference (2x rule) before timing.
CPU: `--device cpu --preset tiny --tokens 4` is a smoke run (no graphs, the interpreter).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

import moekit
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.results import write_jsonl
from moekit.bench.roofline import traffic
from moekit.bench.timing import FLUSH_MODES, time_fn
from moekit.bench.wgrad import rel_err
from moekit.decode import DECODE_TILES, experts_decode
from moekit.experts import moe_experts
from moekit.reference import moe_experts_ref

MODES = (*FLUSH_MODES, "none")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="default: qwen3-30b-a3b on a GPU, tiny on the CPU")
    p.add_argument("--tokens", default=None, help="comma-separated (default: 1,2,4,8,16,64,256,1024; CPU 4)")
    p.add_argument("--backends", default="triton,grouped_mm")
    p.add_argument("--decode", default="", help="also the direct decode path with these DECODE_TILES indices "
                   "(comma-separated), named 'direct <i>'")
    p.add_argument("--rep", type=int, default=None, help="timed calls per case (default: time_fn's)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--out", default=None, help="also write the rows as JSON lines here")
    a = p.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    preset = a.preset or ("qwen3-30b-a3b" if gpu else "tiny")
    tokens = [int(v) for v in (a.tokens or ("1,2,4,8,16,64,256,1024" if gpu else "4")).split(",")]
    dtype = torch.bfloat16 if gpu else torch.float32
    rep = a.rep if a.rep is not None else (None if gpu else 2)
    started = time.perf_counter()
    ceil = measure_ceilings(dev, dtype)
    name = torch.cuda.get_device_name(dev) if gpu else "cpu"
    print(f"{name}: copy {ceil.copy_gbps:.0f} GB/s; torch {torch.__version__}; {preset} {dtype}", flush=True)
    torch.manual_seed(0)
    layer = moekit.MoELayer(moekit.get_shape(preset), dtype=dtype, device=dev).requires_grad_(False)
    shape = layer.shape
    rows: list[dict] = []
    print(f"{'T':>6} {'case':>11} " + " ".join(f"{m + ' ms':>10} {'%':>5}" for m in MODES))
    for t in tokens:
        x = torch.randn(t, shape.hidden_size, device=dev, dtype=dtype)
        w, ids = layer.route(x)
        w, ids = w.contiguous(), ids.contiguous()
        tr = traffic(shape, t, ids, dtype)
        floor = tr.bytes / (ceil.copy_gbps * 1e9) * 1e3
        ref = moe_experts_ref(x, layer.gate_up_proj, layer.down_proj, w, ids)
        plain = moe_experts(x, layer.gate_up_proj, layer.down_proj, w, ids, backend="grouped_mm")
        bound = 2 * rel_err(plain, ref) + 1e-6
        probe = torch.zeros(max(1, int(tr.bytes) // 8), dtype=torch.int64, device=dev)
        args = (x, layer.gate_up_proj, layer.down_proj, w, ids)
        cases = {"read probe": probe.amax}
        for b in filter(None, a.backends.split(",")):
            cases[b] = functools.partial(moe_experts, *args, backend=b)
        for i in filter(None, a.decode.split(",")):
            cfg = DECODE_TILES[int(i)]
            cases[f"direct {i}"] = functools.partial(experts_decode, *args, torch.empty_like(x), cfg)
        for case, fn in cases.items():
            row = {"tokens": t, "case": case, "floor_ms": floor, "bytes": tr.bytes}
            if case != "read probe":
                err = rel_err(fn(), ref)
                row["err_vs_fp32"] = err
                if not err <= bound:
                    row["error"] = f"error {err:.2e} over 2x grouped_mm's"
                    print(f"{t:>6} {case:>11} NOT TIMED: {row['error']}", flush=True)
                    rows.append(row)
                    continue
            for m in MODES:
                ms = time_fn(fn, graph=gpu, device=dev, rep=rep,
                             flush_l2=False if m == "none" else m).median_ms
                row[f"{m}_ms"] = ms
                row[f"{m}_pct"] = 100 * floor / ms
            print(f"{t:>6} {case:>11} " + " ".join(f"{row[m + '_ms']:10.4f} {row[m + '_pct']:5.1f}"
                                                  for m in MODES), flush=True)
            rows.append(row)
    write_jsonl(a.out, rows)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
