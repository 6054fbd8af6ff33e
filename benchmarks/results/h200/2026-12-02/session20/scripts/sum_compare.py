"""The slot sum in GEMM2's epilogue against its own launch, side by side on the GPU (issue 14).

`moekit.experts.triton.SLOT_SUM_MAX_PAIRS` decides where the triton path runs GEMM2 with the slot
sum fused (`moekit.grouped_gemm.gemm2_weighted_sum`: three launches, align + GEMM1 + GEMM2) and
where it runs GEMM2 then `moe_sum` (four). Per preset and T, the expert path (`experts_triton`
with the table's config, so T <= 8 runs the grouped GEMMs too, not the direct decode kernels) is
captured in a CUDA graph and timed each call alone after an L2 flush (`moekit.bench.timing.time_fn`,
as `moekit bench` times it), the two variants alternating for --rounds rounds on the same routing;
their outputs are checked bitwise equal first (the fused sum adds the same rounded rows in the same
order). --layer also times the whole `MoELayer` (router included; eager graphs off).

    PYTHONPATH=src python scripts/sum_compare.py [--presets qwen3-30b-a3b,olmoe-1b-7b]
        [--tokens 16,64,256,1024] [--rounds 5] [--layer] [--out sum.jsonl]

Prints per row the medians (ms), % of the roofline floor (ceilings measured in this run) and
split / fused; the JSON lines hold every round.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

VARIANTS = {"fused": None, "split": 0}      # SLOT_SUM_MAX_PAIRS during the call (None: as shipped)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="16,64,128,256,512,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layer", action="store_true", help="also the whole MoELayer (router included)")
    parser.add_argument("--out", help="JSON lines here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1

    import moekit
    import moekit.experts.triton as et
    from moekit import eager_graphs
    from moekit.bench.ceilings import measure_ceilings
    from moekit.bench.roofline import floor_ms
    from moekit.bench.timing import time_fn
    from moekit.tuning import get_config

    dev, dtype = torch.device("cuda"), torch.bfloat16
    eager_graphs.set_enabled(False)
    ceil = measure_ceilings(dev, dtype)
    print(f"{torch.cuda.get_device_name(dev)}: copy {ceil.copy_gbps:.0f} GB/s, matmul "
          f"{ceil.matmul_tflops:.0f} TFLOP/s; commit {os.environ.get('MOEKIT_COMMIT', '?')}; "
          f"SLOT_SUM_MAX_PAIRS {et.SLOT_SUM_MAX_PAIRS}", flush=True)

    def under(variant, fn):
        saved = et.SLOT_SUM_MAX_PAIRS
        et.SLOT_SUM_MAX_PAIRS = 1 << 62 if VARIANTS[variant] is None else VARIANTS[variant]
        try:
            return fn()
        finally:
            et.SLOT_SUM_MAX_PAIRS = saved

    rows = []
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        shape = moekit.get_shape(preset)
        layer = moekit.MoELayer(shape, dtype=dtype, device=dev).requires_grad_(False)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, shape.hidden_size, device=dev, dtype=dtype)
            w, ids = layer.route(x)
            cfg = get_config(shape, t, dtype, dev)
            fl = floor_ms(shape, t, ids, dtype, ceil)
            paths = {"experts": functools.partial(et.experts_triton, x, layer.gate_up_proj, layer.down_proj,
                                                  w, ids, config=cfg)}
            if args.layer:
                paths["layer"] = functools.partial(layer, x)
            for path, fn in paths.items():
                outs = {v: under(v, fn) for v in VARIANTS}
                if not torch.equal(outs["fused"], outs["split"]):
                    raise SystemExit(f"{preset} T={t} {path}: fused and split outputs differ")
                times = {v: [] for v in VARIANTS}
                for _ in range(args.rounds):
                    for v in VARIANTS:
                        timed = functools.partial(time_fn, fn, graph=True, device=dev)
                        times[v].append(under(v, timed).median_ms)
                med = {v: statistics.median(s) for v, s in times.items()}
                rows.append(dict(preset=preset, tokens=t, path=path, floor_ms=fl, config=cfg.to_dict(),
                                 **{f"{v}_ms": m for v, m in med.items()},
                                 **{f"{v}_rounds": s for v, s in times.items()}))
                cells = "  ".join(f"{v} {m:.4f} ms ({100 * fl / m:4.1f}%)" for v, m in med.items())
                print(f"{preset} T={t:>5} {path:>7}: {cells}  split/fused {med['split'] / med['fused']:.3f}x",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
