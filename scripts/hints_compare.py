"""The launch hints (`moekit.launch_hints`) side by side in one process: the triton expert path and
the whole `MoELayer` (router included), each captured in a CUDA graph under every setting of the two
switches and timed as the bench times it (after an L2 flush, `moekit.bench.timing.time_fn`).

Settings: plain (both off), evict (MOEKIT_WEIGHT_EVICT_FIRST=1), pdl (MOEKIT_PDL=1), both. The
settings are timed in turn, `--rounds` times over (plain, evict, pdl, both, plain, ...), so a drift of
the machine shows as a difference between rounds; the table gives each setting's median over its
rounds and its ratio to plain. Every setting's output is first checked bitwise against plain's.

Usage: python scripts/hints_compare.py [--preset qwen3-30b-a3b] [--tokens 1,2,4,8,16,64,256]
       [--rounds 2] [--flush write|clean] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from unittest import mock

import torch

import moekit
from moekit import eager_graphs, launch_hints
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.results import write_jsonl
from moekit.bench.roofline import floor_ms
from moekit.bench.timing import time_fn
from moekit.experts.triton import experts_triton

SETTINGS = {"plain": (0, 0), "evict": (0, 1), "pdl": (1, 0), "both": (1, 1)}


def under(setting: str, fn):
    """fn() with the two switches set as `setting` says (restored after)."""
    pdl, evict = SETTINGS[setting]
    with mock.patch.dict(os.environ, {launch_hints.PDL_ENV: str(pdl), launch_hints.EVICT_ENV: str(evict)}):
        return fn()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,2,4,8,16,64,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--flush", default="write", choices=("write", "clean"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    started = time.perf_counter()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    eager_graphs.set_enabled(False)             # each path's own launches are captured
    ceil = measure_ceilings(dev, dtype)
    print(f"{torch.cuda.get_device_name(dev)}: copy {ceil.copy_gbps:.0f} GB/s, matmul "
          f"{ceil.matmul_tflops:.0f} TFLOP/s; torch {torch.__version__}; commit "
          f"{os.environ.get('MOEKIT_COMMIT', '?')}; flush {args.flush}", flush=True)
    torch.manual_seed(0)
    layer = moekit.MoELayer(moekit.get_shape(args.preset), dtype=dtype, device=dev).requires_grad_(False)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, layer.shape.hidden_size, device=dev, dtype=dtype)
        w, ids = layer.route(x)
        fl = floor_ms(layer.shape, t, ids, dtype, ceil)
        paths = {
            "experts": functools.partial(experts_triton, x, layer.gate_up_proj, layer.down_proj, w, ids),
            "layer": functools.partial(layer, x),
        }
        for path, fn in paths.items():
            plain = under("plain", fn)
            for s in SETTINGS:
                if not torch.equal(under(s, fn), plain):
                    raise SystemExit(f"T={t} {path} {s}: not bitwise equal to the plain launch")
            times: dict[str, list[float]] = {s: [] for s in SETTINGS}
            for _ in range(args.rounds):
                for s in SETTINGS:
                    timed = functools.partial(time_fn, fn, graph=True, device=dev, flush_l2=args.flush)
                    times[s].append(under(s, timed).median_ms)
            med = {s: statistics.median(v) for s, v in times.items()}
            row = dict(tokens=t, path=path, floor_ms=fl, **{f"{s}_ms": med[s] for s in SETTINGS},
                       **{f"{s}_rounds": times[s] for s in SETTINGS})
            rows.append(row)
            cells = "  ".join(f"{s} {med[s]:.4f} ({100 * fl / med[s]:4.1f}%, {med['plain'] / med[s]:.3f}x)"
                              for s in SETTINGS)
            spread = max(max(v) / min(v) for v in times.values())
            print(f"T={t:>5} {path:>7}: {cells}  [rounds' max/min {spread:.3f}]", flush=True)
    print(f"done in {time.perf_counter() - started:.0f} s")
    write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
