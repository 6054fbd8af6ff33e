"""The align step's device time at decode and small-prefill sizes (Qwen3-30B-A3B: E = 128, K = 8),
variants side by side, each kernel's pieces timed apart. A measurement script (issue 14: at 16-256
tokens the align is 4-5% of the expert path).

Per T (default 16, 64, 128, 256, 512: up to S = 4096 pairs; the H200 table's block_m for T), a
CUDA graph of N back-to-back `align_block_size(ids, 128, block_m, backend="triton")` calls is
replayed; the median of the replays over N is the time an align adds in a chain of launches
(launch gaps included, as in the expert path's graph). Variants:

    default      as shipped: one program up to FUSED_MAX_PAIRS pairs, one launch of a program a
                 chunk (`align_one_launch_kernel`) up to ONE_LAUNCH_MAX_PAIRS (4,096), else
                 hist + scan + scatter
    one          ONE_LAUNCH_MAX_PAIRS = ONE_LAUNCH_CANDIDATE: one launch of a program a chunk
                 above FUSED_MAX_PAIRS up to that many pairs (4,096), hist + scan + scatter above
    three        ONE_LAUNCH_MAX_PAIRS = 0: hist + scan + scatter above FUSED_MAX_PAIRS
    fused        FUSED_MAX_PAIRS raised to 4096 (one program at every T here)
    warps2/8     the align kernels with 2 / 8 warps (`moekit.align.ALIGN_WARPS`)
Pieces (kernels of this script built from the align kernels' own helpers, one program, the fused
kernel's CHUNK and warps): empty (a kernel doing nothing: the floor of a launch in a graph), keys
(load the ids and store their keys), sort (+ tl.sort), hist (+ histogram and cumsum), fill (the
sentinel fill of sorted_ids), expert_ids (`_write_expert_ids` over every block).
Every variant's alignment is checked equal to the torch twin's first.

--paths: the whole triton expert path and the whole `MoELayer` (router included) instead, each
captured in a CUDA graph and timed as the bench times it (after an L2 flush, `time_fn`), with the
fused align writing the blocks' expert ids expert by expert (`moekit.align.FUSED_IDS_BY_EXPERT`,
"by-expert", the default) and by the search over experts a block ("search", before session 12),
alternating for --rounds rounds; outputs checked bitwise equal first.

    PYTHONPATH=src python scripts/align_compare.py [--tokens 16,64,256] [--out align.jsonl]
    PYTHONPATH=src python scripts/align_compare.py --paths [--tokens 16,32,64,128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from moekit import align as align_mod
from moekit._host import next_power_of_2
from moekit.kernels.align import _chunk_keys, _fill, _write_expert_ids

E, K = 128, 8
BLOCK_M = {16: 16, 64: 16, 128: 32, 256: 32, 512: 64}


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _piece_kernel(ids_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, codes_ptr, S, E, length, max_blocks,
                  PIECE: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    if PIECE == "fill":
        _fill(sorted_ids_ptr, S, 0, length, length, 1024)
    else:
        e, keys = _chunk_keys(ids_ptr, 0, S, E, CHUNK)
        if PIECE == "sort":
            keys = tl.sort(keys)
        if PIECE == "hist" or PIECE == "expert_ids":
            total = tl.histogram(e, E_PAD, mask=e < E)
            padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
            pad_end = tl.cumsum(padded, axis=0)
            if PIECE == "hist":
                tl.store(out_ptr + tl.arange(0, E_PAD), pad_end)
            else:
                num_padded = tl.sum(padded, axis=0)
                _write_expert_ids(expert_ids_ptr, codes_ptr, pad_end, num_padded, E, 0, max_blocks,
                                  max_blocks, BLOCK_M, E_PAD, BLOCK_B)
        else:
            tl.store(out_ptr + tl.arange(0, CHUNK), keys)


def graph_time(fn, n: int, replays: int) -> float:
    """µs per call: a graph of n calls, the median of `replays` replays over n."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(n):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times)


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in
               ("sorted_ids", "expert_ids", "num_padded", "tokens_per_expert", "block_codes"))


def measure(tokens: int, args, gen) -> dict:
    bm = BLOCK_M.get(tokens, 64)
    ids = torch.randn(tokens, E, device="cuda", generator=gen).topk(K, -1).indices.to(torch.int32)
    want = align_mod.align_block_size(ids, E, bm, backend="torch")
    variants = {"default": {}, "one": {"ONE_LAUNCH_MAX_PAIRS": align_mod.ONE_LAUNCH_CANDIDATE},
                "three": {"ONE_LAUNCH_MAX_PAIRS": 0}, "fused": {"FUSED_MAX_PAIRS": 4096},
                "warps2": {"ALIGN_WARPS": 2}, "warps8": {"ALIGN_WARPS": 8}}
    line = {"tokens": tokens, "pairs": tokens * K, "block_m": bm}

    def call():
        return align_mod.align_block_size(ids, E, bm, backend="triton")

    for name, patch in variants.items():
        saved = {k: getattr(align_mod, k) for k in patch}
        for k, v in patch.items():
            setattr(align_mod, k, v)
        try:
            line[name] = graph_time(call, args.n, args.replays) if same(call(), want) else "WRONG"
        finally:
            for k, v in saved.items():
                setattr(align_mod, k, v)
    s = tokens * K
    chunk = max(16, next_power_of_2(s))
    length = align_mod.padded_length(s, E, bm)
    max_blocks = triton.cdiv(length, bm)
    flat = ids.reshape(-1)
    out = torch.empty(max(chunk, 256), dtype=torch.int32, device="cuda")
    sid = torch.empty(length, dtype=torch.int32, device="cuda")
    eid = torch.empty(max_blocks, dtype=torch.int32, device="cuda")
    codes = torch.empty_like(eid)
    warps = 4 if chunk <= 1024 else 8
    line["empty"] = graph_time(lambda: _empty_kernel[(1,)](out), args.n, args.replays)
    for piece in ("keys", "sort", "hist", "fill", "expert_ids"):
        def launch(piece=piece):
            _piece_kernel[(1,)](flat, out, sid, eid, codes, s, E, length, max_blocks, PIECE=piece,
                                CHUNK=chunk, E_PAD=E, BLOCK_M=bm, BLOCK_B=32, num_warps=warps)
        line[piece] = graph_time(launch, args.n, args.replays)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items()),
          flush=True)
    return line


def compare_paths(args) -> list[dict]:
    import functools
    import os

    import moekit
    from moekit import eager_graphs
    from moekit.bench.ceilings import measure_ceilings
    from moekit.bench.roofline import floor_ms
    from moekit.bench.timing import time_fn
    from moekit.experts.triton import experts_triton

    dev, dtype = torch.device("cuda"), torch.bfloat16
    eager_graphs.set_enabled(False)
    ceil = measure_ceilings(dev, dtype)
    print(f"{torch.cuda.get_device_name(dev)}: copy {ceil.copy_gbps:.0f} GB/s, matmul "
          f"{ceil.matmul_tflops:.0f} TFLOP/s; commit {os.environ.get('MOEKIT_COMMIT', '?')}", flush=True)
    torch.manual_seed(0)
    layer = moekit.MoELayer(moekit.get_shape("qwen3-30b-a3b"), dtype=dtype, device=dev).requires_grad_(False)
    settings = {"by-expert": True, "search": False}

    def under(setting, fn):
        saved = align_mod.FUSED_IDS_BY_EXPERT
        align_mod.FUSED_IDS_BY_EXPERT = settings[setting]
        try:
            return fn()
        finally:
            align_mod.FUSED_IDS_BY_EXPERT = saved

    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, layer.shape.hidden_size, device=dev, dtype=dtype)
        w, ids = layer.route(x)
        fl = floor_ms(layer.shape, t, ids, dtype, ceil)
        for path, fn in (("experts", functools.partial(experts_triton, x, layer.gate_up_proj, layer.down_proj,
                                                       w, ids)),
                         ("layer", functools.partial(layer, x))):
            ref = under("search", fn)
            if not torch.equal(under("by-expert", fn), ref):
                raise SystemExit(f"T={t} {path}: by-expert not bitwise equal to search")
            times = {s: [] for s in settings}
            for _ in range(args.rounds):
                for s in settings:
                    timed = functools.partial(time_fn, fn, graph=True, device=dev)
                    times[s].append(under(s, timed).median_ms)
            med = {s: statistics.median(v) for s, v in times.items()}
            rows.append(dict(tokens=t, path=path, floor_ms=fl, **{f"{s}_ms": m for s, m in med.items()},
                             **{f"{s}_rounds": v for s, v in times.items()}))
            cells = "  ".join(f"{s} {m:.4f} ms ({100 * fl / m:4.1f}%)" for s, m in med.items())
            print(f"T={t:>5} {path:>7}: {cells}  search/by-expert {med['search'] / med['by-expert']:.3f}x",
                  flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64,128,256,512")
    parser.add_argument("--n", type=int, default=64, help="calls a graph (default 64)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", help="JSON lines here")
    parser.add_argument("--paths", action="store_true", help="time the expert path and the layer instead")
    parser.add_argument("--rounds", type=int, default=5, help="--paths: alternating rounds (default 5)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.paths:
        rows = compare_paths(args)
    else:
        rows = [measure(int(t), args, gen) for t in args.tokens.split(",")]
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
