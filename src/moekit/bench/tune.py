"""`moekit tune`: search the Triton expert path's tiles for one shape on this GPU.

For each token count T and each candidate block_m, GEMM1's and GEMM2's tiles are searched
separately (each GEMM timed alone in a CUDA graph), then the whole path (align, both GEMMs, sum)
is timed with each block_m's winners. On every block_m's winners within SWITCH_SPAN (1.25x) of the
fastest, the opt-in switches are tried (`switch_variants`: paired tiles, TMA weight loads where the
device and weights allow them, persistent GEMMs, alone and combined), each as a whole path; the
fastest of all wins. A paired variant (2 x block_m rows a tile) runs the tiles tuned for block_m
2 x block_m when that one was tuned (`paired_tiles`). Routing is uniform random with k
distinct experts per token; each timed graph runs R different routings back to back, so small T
reads more distinct experts than L2 holds and the weights come from HBM as in a real model.
Candidate tiles are those whose pipelined operands fit in the device's shared memory
(`moekit.tuning.shared_memory_limit`).

--weights fp8 runs the same search on block-scaled FP8 weights (`SearchWeights`): the layer's weights
quantized once (`moekit.quant.quantize_experts`), GEMM1 timed on x quantized per row
(`moekit.quant.quantize_rows`), GEMM2 on GEMM1's quantized h, the whole path through
`moekit.experts.fp8.experts_triton_fp8`; the candidates are the tiles the FP8 kernels run
(`moekit.tuning.check_fp8_config`: GEMM1's block_n 128, block_k 64 or 128), their shared memory
counted at e4m3's byte an operand (x and h are e4m3 too). The activations stay in --dtype; the
winners go under the key dtype=float8_e4m3fn, which every call on FP8 weights reads.

A study on the scaffold (`moekit.bench.study`): every timing is a row (`moekit.bench.tune_report.
TuneRow`, with provenance) in --out's results.csv, with report.md and a plot drawn from them. The
winners are merged into a JSON table in the format `moekit.tuning` loads, `<device>.json` in
$MOEKIT_CONFIG_DIR when it is set (where `moekit.tuning` looks first), else in --out, else in
./moekit-results/ (--table names another file); never into the installed package unless --table
says so. The table is checked before any tuning, rewritten atomically after each token count, and
records what it was tuned with in "_meta" (Triton and torch versions, the device's name;
`moekit.tuning.get_config` warns when the running Triton differs). The kernels' launchers come from
the runtime (`moekit.experts.triton`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from moekit.align import align_block_size
from moekit.bench import args as arg_types
from moekit.bench.args import GPU_PRESET, RESULTS_ROOT, usage_error
from moekit.bench.fp8 import quantize_projections, shape_problem
from moekit.bench.results import FP8, atomic_write_text
from moekit.bench.study import measure_provenance, warn_to
from moekit.bench.timing import capture_graph, sync
from moekit.bench.tune_report import STUDY, SWITCH_SPAN, tune_rows, variant_label
from moekit.experts.fp8 import experts_triton_fp8
from moekit.experts.triton import experts_triton, gemm1_swiglu, gemm2_weighted
from moekit.grouped_gemm import resolve_tma
from moekit.grouped_gemm.fp8 import gemm1_swiglu_fp8, gemm2_weighted_fp8
from moekit.quant import FP8_DTYPE, Fp8Weight, quantize_rows
from moekit.shapes import MoEShape
from moekit.tuning import (
    META_KEY,
    PACKAGED_DIR,
    SHARED_MEMORY_LIMIT,
    ExpertsConfig,
    TuningTable,
    check_fp8_config,
    default_config,
    device_slug,
    fp8_tiles,
    parse_table,
    pipeline_bytes,
    running_versions,
    shape_key,
    shared_memory_limit,
)

PROG = "moekit tune"
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
GRAPH_REPS = 10
Timer = Callable[[Callable[[], object]], float]


def graph_time_ms(fn: Callable[[], object], reps: int = GRAPH_REPS,
                  device: torch.device | str = "cuda") -> float:
    """Median ms of one replay of fn captured in a CUDA graph (`timing.capture_graph`: warmed up,
    host syncs refused, a failed capture cleaned up); `reps` replays back to back."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    graph, _ = capture_graph(fn, device)
    graph.replay()
    sync(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    sync(device)
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


def gemm_candidates(block_m: int, itemsize: int, swiglu: bool, limit: int = SHARED_MEMORY_LIMIT, *,
                    fp8: bool = False) -> list[dict[str, int]]:
    """Tiles (block_n, block_k, warps, stages) whose pipelined operands fit in `limit` bytes of
    shared memory (`moekit.tuning.shared_memory_limit` of the device) at `itemsize` bytes an operand
    element. fp8: only the tiles the block-scaled FP8 kernels run (`moekit.tuning.check_fp8_config`);
    their operands, x and h included, are e4m3 (itemsize 1)."""
    if block_m <= 32:
        # Few rows: the kernel streams weights; narrow tiles give more programs per SM in flight.
        space = itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))
    else:
        space = itertools.product((64, 128, 256) if not swiglu else (64, 128), (64, 128), (4, 8), (3, 4))
    which = 1 if swiglu else 2
    # FP8: the other GEMM's tiles made fit, so the check judges this GEMM's alone.
    base = fp8_tiles(ExpertsConfig(block_m=block_m)) if fp8 else ExpertsConfig(block_m=block_m)
    out = []
    for bn, bk, warps, stages in space:
        p = dict(block_n=bn, block_k=bk, warps=warps, stages=stages)
        cfg = _with(base, which, p)
        if pipeline_bytes(cfg, itemsize, which) <= limit and (not fp8 or _runs_fp8(cfg)):
            out.append(p)
    return out


def _runs_fp8(cfg: ExpertsConfig) -> bool:
    try:
        check_fp8_config(cfg)
    except ValueError:
        return False
    return True


def switch_variants(cfg: ExpertsConfig, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor) -> list[ExpertsConfig]:
    """cfg, then cfg with the opt-in switches in every combination: pair_blocks 1 and 2, tma_weights
    where both weights pass `moekit.grouped_gemm.tma_supported` with cfg's tiles (`resolve_tma`),
    persistent off and on. Each config once."""
    tma = (False, True) if resolve_tma(replace(cfg, tma_weights=True), gate_up_proj, down_proj).tma_weights \
        else (False,)
    out = [cfg]
    for pair, use_tma, persistent in itertools.product((1, 2), tma, (False, True)):
        v = replace(cfg, pair_blocks=pair, tma_weights=use_tma, persistent=persistent)
        if v not in out:
            out.append(v)
    return out


TILE_FIELDS = tuple(f"{name}{which}" for which in (1, 2)
                    for name in ("block_n", "block_k", "warps", "stages"))


def paired_tiles(variant: ExpertsConfig, winners: dict[int, ExpertsConfig]) -> ExpertsConfig:
    """A paired variant (pair_blocks 2) computes 2 * block_m rows a tile: it takes the GEMM tiles
    tuned for block_m 2 * block_m when that block_m was tuned (`winners`, by block_m), else keeps its
    own. Any other variant is returned as it is."""
    double = winners.get(2 * variant.block_m)
    if variant.pair_blocks != 2 or double is None:
        return variant
    return replace(variant, **{f: getattr(double, f) for f in TILE_FIELDS})


def _with(cfg: ExpertsConfig, which: int, p: dict[str, int]) -> ExpertsConfig:
    return replace(cfg, **{f"block_n{which}": p["block_n"], f"block_k{which}": p["block_k"],
                           f"warps{which}": p["warps"], f"stages{which}": p["stages"]})


@dataclass(frozen=True)
class SearchWeights:
    """The expert weights a search runs on, and the kernels that run them: dense gate_up (E, 2I, H)
    and down (E, H, I) (`gemm1_swiglu`, `gemm2_weighted`, `experts_triton`), or block-scaled FP8
    `Fp8Weight`s (`gemm1_swiglu_fp8` on x quantized per row, `gemm2_weighted_fp8` on GEMM1's
    quantized h, `experts_triton_fp8`). out_dtype: the activations' dtype, GEMM2's output."""

    gate_up: torch.Tensor | Fp8Weight
    down: torch.Tensor | Fp8Weight
    out_dtype: torch.dtype

    @property
    def fp8(self) -> bool:
        return isinstance(self.gate_up, Fp8Weight)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights' data, which the plan reads for TMA (`resolve_tma`)."""
        return (self.gate_up.data, self.down.data) if self.fp8 else (self.gate_up, self.down)

    @property
    def itemsize(self) -> int:
        """Bytes of a GEMM operand's element in shared memory: e4m3's on FP8 weights (the kernels
        quantize x and h too; the CPU's float16 stand-ins do not count), else the weights' dtype's."""
        return FP8_DTYPE.itemsize if self.fp8 else self.gate_up.element_size()

    def gemm1_input(self, x: torch.Tensor):
        """GEMM1's x operand: x, or (xq, xs) as the FP8 path quantizes it before GEMM1."""
        return quantize_rows(x, dtype=self.gate_up.data.dtype) if self.fp8 else x

    def gemm1(self, x_in, align, top_k: int, cfg: ExpertsConfig):
        """GEMM2's h operand: h, or (hq, hs)."""
        if self.fp8:
            return gemm1_swiglu_fp8(*x_in, self.gate_up, align, top_k, cfg)
        return gemm1_swiglu(x_in, self.gate_up, align, top_k, cfg)

    def gemm2(self, h_in, topk_weights: torch.Tensor, align, cfg: ExpertsConfig) -> torch.Tensor:
        if self.fp8:
            return gemm2_weighted_fp8(*h_in, self.down, topk_weights, align, cfg, self.out_dtype)
        return gemm2_weighted(h_in, self.down, topk_weights, align, cfg)

    def path(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             cfg: ExpertsConfig) -> torch.Tensor:
        run = experts_triton_fp8 if self.fp8 else experts_triton
        return run(x, self.gate_up, self.down, topk_weights, topk_ids, config=cfg)


def search_weights(shape: MoEShape, dtype: torch.dtype, device: torch.device, fp8: bool) -> SearchWeights:
    """Random weights of the shape in dtype (scaled by 1 / sqrt of their fan-in); with fp8 quantized
    once (`moekit.bench.fp8.quantize_projections`: float16 stand-ins off CUDA)."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gate_up = torch.randn(e, 2 * i, h, device=device, dtype=dtype).div_(h**0.5)
    down = torch.randn(e, h, i, device=device, dtype=dtype).div_(i**0.5)
    if fp8:
        quantized = quantize_projections(gate_up, down)
        gate_up, down = quantized.gate_up, quantized.down
    return SearchWeights(gate_up, down, dtype)


def _gemm1_all(xs, weights, aligns, top_k, cfg):
    return [weights.gemm1(x, a, top_k, cfg) for x, a in zip(xs, aligns)]


def _gemm2_all(hs, weights, ws, aligns, cfg):
    return [weights.gemm2(h, w, a, cfg) for h, w, a in zip(hs, ws, aligns)]


def _path_all(xs, weights, ws, ids, cfg):
    return [weights.path(x, w, t, cfg) for x, w, t in zip(xs, ws, ids)]


def tune_tokens(shape: MoEShape, num_tokens: int, dtype: torch.dtype, rotations: int,
                log: Callable[[str], None] = print, *, device: torch.device | str = "cuda",
                timer: Timer = graph_time_ms, seed: int = 0, switches: bool = True,
                fp8: bool = False) -> tuple[ExpertsConfig, list[dict]]:
    """The fastest config for `num_tokens`, and one record per timing; with fp8, of the FP8 kernels
    on the weights quantized once (`search_weights`; activations in dtype).

    Records (JSON-ready dicts): per GEMM candidate {tokens, block_m, gemm (1 or 2), ms, block_n,
    block_k, warps, stages}; per whole path {tokens, gemm: 0, ms, **ExpertsConfig fields}: each
    block_m's winners (every switch off), then, with `switches`, each of
    those within SWITCH_SPAN of the fastest with each of `switch_variants` (told apart by their
    block_m and switches, `variant_label`; paired ones with `paired_tiles`). A candidate that fails
    to run is logged and skipped.
    `timer(fn)` returns ms of one call of fn (a CUDA-graph replay by default; tests stub it).
    """
    dev = torch.device(device)
    e, h, k = shape.num_experts, shape.hidden_size, shape.top_k
    smem = shared_memory_limit(dev)
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + num_tokens)
    weights = search_weights(shape, dtype, dev, fp8)
    xs, ws, ids = [], [], []
    for _ in range(rotations):
        xs.append(torch.randn(num_tokens, h, generator=gen).to(dev, dtype))
        ids.append(torch.rand(num_tokens, e, generator=gen).argsort(1)[:, :k].to(dev, torch.int32))
        ws.append(torch.softmax(torch.randn(num_tokens, k, generator=gen), -1).to(dev))
    x_ins = [weights.gemm1_input(x) for x in xs]     # GEMM1 alone is timed without the quantization
    records: list[dict] = []
    winners_by_bm: list[tuple[float, ExpertsConfig]] = []    # each block_m's whole path
    for bm in block_m_candidates(shape, num_tokens):
        # Plain tiles (the default config may set switches: they are tried after, on the winners).
        base = replace(default_config(shape, num_tokens, weights.itemsize, dev), block_m=bm,
                       group_m=8, pair_blocks=1, tma_weights=False, persistent=False)
        aligns = [align_block_size(t, e, bm) for t in ids]
        winners = {}
        for which in (1, 2):
            timed = []
            hs = None
            if which == 2:
                hs = _gemm1_all(x_ins, weights, aligns, k, base)
            for p in gemm_candidates(bm, weights.itemsize, swiglu=which == 1, limit=smem, fp8=weights.fp8):
                cfg = _with(base, which, p)
                if which == 1:
                    fn = functools.partial(_gemm1_all, x_ins, weights, aligns, k, cfg)
                else:
                    fn = functools.partial(_gemm2_all, hs, weights, ws, aligns, cfg)
                try:
                    ms = timer(fn) / rotations
                except Exception as exc:  # a tile the compiler cannot fit: skip it, say why
                    log(f"  skip T={num_tokens} bm={bm} gemm{which} {p}: {type(exc).__name__}")
                    continue
                timed.append((ms, p))
                records.append(dict(tokens=num_tokens, block_m=bm, gemm=which, ms=ms, **p))
            if timed:
                winners[which] = min(timed, key=lambda t: t[0])[1]
        if len(winners) < 2:
            log(f"T={num_tokens:>6} bm={bm:>3}: no GEMM{1 if 1 not in winners else 2} tile ran; skipped")
            continue
        cfg = _with(_with(base, 1, winners[1]), 2, winners[2])
        total = timer(functools.partial(_path_all, xs, weights, ws, ids, cfg)) / rotations
        records.append(dict(tokens=num_tokens, gemm=0, ms=total, **asdict(cfg)))
        log(f"T={num_tokens:>6} bm={bm:>3}: {total * 1e3:8.1f} us  {cfg}")
        winners_by_bm.append((total, cfg))
    if not winners_by_bm:
        raise RuntimeError(f"no candidate config ran at T={num_tokens}")
    winners_by_bm.sort(key=lambda tc: tc[0])
    best_total, best_cfg = winners_by_bm[0]
    # The switches on every block_m's tiles within SWITCH_SPAN of the fastest path, fastest first: a
    # switch can turn the order of two block_m around (paired tiles suit block_m 64, not 128).
    # Paired variants take the tiles tuned for twice their block_m (`paired_tiles`): the shipped H200
    # entries at 2,048 / 4,096 tokens are block_m 128's tiles over 64-row blocks, which the search
    # never tried while a paired variant kept block_m 64's own (4-warp) tiles (2026-12-01).
    by_bm = {c.block_m: c for _, c in winners_by_bm}
    near = [c for t, c in winners_by_bm if t <= SWITCH_SPAN * best_total]
    variants = list(dict.fromkeys(paired_tiles(v, by_bm) for c in near
                                  for v in switch_variants(c, *weights.tensors)[1:])) if switches else []
    for cfg in variants:
        label = variant_label(cfg)
        try:
            total = timer(functools.partial(_path_all, xs, weights, ws, ids, cfg)) / rotations
        except Exception as exc:  # a switch this Triton or device cannot run: skip it, say why
            log(f"  skip T={num_tokens} bm={cfg.block_m} {label}: {type(exc).__name__}")
            continue
        records.append(dict(tokens=num_tokens, gemm=0, ms=total, **asdict(cfg)))
        log(f"T={num_tokens:>6} bm={cfg.block_m:>3} {label}: {total * 1e3:8.1f} us")
        if total < best_total:
            best_total, best_cfg = total, cfg
    return best_cfg, records


def merged_table(path: Path, key: str, found: dict[int, ExpertsConfig],
                 meta: dict[str, str] | None = None) -> dict:
    """The table in `path` (checked by `parse_table`; empty when absent) with `found` merged into
    `key`; token counts in increasing order; "_meta" first: `meta` when given, else the file's."""
    old = parse_table(path) if path.is_file() else TuningTable()
    table = {k: {str(t): c.to_dict() for t, c in entry.items()} for k, entry in old.items()}
    entry = table.setdefault(key, {})
    entry.update({str(t): c.to_dict() for t, c in found.items()})
    table[key] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
    meta = meta if meta is not None else old.meta
    return {META_KEY: dict(meta), **table} if meta else table


def write_table(path: Path, key: str, found: dict[int, ExpertsConfig],
                meta: dict[str, str] | None = None) -> None:
    """Merge `found` into the table file (with `meta` as its "_meta"), through a temporary file and a
    rename."""
    atomic_write_text(path, json.dumps(merged_table(Path(path), key, found, meta), indent=1) + "\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg_types.add_preset(p, default=GPU_PRESET)
    p.add_argument("--tokens", type=arg_types.token_counts, default=list(DEFAULT_TOKENS),
                   help=f"comma-separated token counts (default: {','.join(map(str, DEFAULT_TOKENS))})")
    arg_types.add_dtype(p, choices=("bfloat16", "float16"), default="bfloat16")
    arg_types.add_weights(p, "the expert weights the tiles are tuned for: dtype (default: dense, in "
                             "--dtype), or fp8: block-quantized to e4m3 once (one fp32 scale per 128x128 "
                             "block) and searched on the FP8 kernels' tiles, activations in --dtype; the "
                             "winners go under the key dtype=float8_e4m3fn, which calls on FP8 weights "
                             "read. H and I must be multiples of 128")
    p.add_argument("--rotations", type=arg_types.int_range(0), default=0,
                   help="routings per timed graph (default 0: enough to read past L2 at small T)")
    p.add_argument("--rep", type=arg_types.int_range(1), default=GRAPH_REPS,
                   help=f"timed graph replays per candidate (default {GRAPH_REPS})")
    arg_types.add_device(p, "cuda or cuda:N (default: cuda); tuning needs a GPU")
    arg_types.add_seed(p, "the tokens and routings")
    arg_types.add_out(p, "tune-<UTC timestamp>", STUDY.result_names,
                      " (an older `--out TABLE.json` means --table TABLE.json)")
    p.add_argument("--table", type=arg_types.out_file, default=None,
                   help="JSON table to write or merge the winners into (default: <device>.json in "
                        "$MOEKIT_CONFIG_DIR when set, else in --out, else in ./moekit-results/; never the "
                        "installed package's); an existing file must be a valid table")
    p.add_argument("--switches", action=argparse.BooleanOptionalAction, default=True,
                   help=f"also time the fastest tiles (each block_m's within {SWITCH_SPAN:g}x of the "
                        "fastest path) with paired tiles, TMA weights and persistent GEMMs, alone and "
                        "combined (default: on)")
    p.add_argument("--records", type=arg_types.out_file, default=None,
                   help="also write every timing as JSON lines (results.csv holds them too)")


def default_table(out: Path | None, device: torch.device) -> Path:
    """Where the table goes without --table: <device>.json in $MOEKIT_CONFIG_DIR (where
    `moekit.tuning` looks first) when set, else in --out, else in ./moekit-results/."""
    env = os.environ.get("MOEKIT_CONFIG_DIR")
    folder = Path(env) if env else (out if out is not None else RESULTS_ROOT)
    return folder / f"{device_slug(device)}.json"


def _paths(args: argparse.Namespace, device: torch.device) -> tuple[Path | None, Path]:
    """(--out, --table), with the older spelling `--out TABLE.json` read as --table."""
    out, table = args.out, args.table
    if out is not None and out.suffix == ".json" and not out.is_dir() and table is None:
        out, table = None, out
    return out, table or default_table(out, device)


def _check_table(table: Path, explicit: bool) -> str:
    """"" when the table can be written and merged into; else the one-line problem."""
    if not explicit:
        where = "$MOEKIT_CONFIG_DIR" if os.environ.get("MOEKIT_CONFIG_DIR") else "the table's folder"
        try:
            arg_types.check_out_dir(table.parent, where)
        except ValueError as exc:
            return str(exc)
        if table.is_dir():
            return f"{table}: is a folder, expected the table file"
    try:
        merged_table(table, "", {})     # a bad table is reported before any tuning
    except ValueError as exc:
        return f"--table: {exc}" if explicit else str(exc)
    return ""


def run(args: argparse.Namespace) -> int:
    device = args.device or (torch.device("cuda") if torch.cuda.is_available() else None)
    if device is None or device.type != "cuda":
        return usage_error(PROG, "needs a CUDA GPU; the packaged defaults serve CPU runs")
    console = Console()
    try:
        layer = arg_types.resolve_layer(args, device, warn_to(console))
    except ValueError as exc:
        return usage_error(PROG, exc)
    shape = layer.shape
    fp8 = args.weights == FP8
    problem = shape_problem(layer.name, shape) if fp8 else ""
    if problem:
        return usage_error(PROG, f"--weights fp8: {problem}")
    dtype = getattr(torch, args.dtype)
    try:   # search_weights draws the weights in the dtype itself
        arg_types.check_memory([layer], dtype, device, args.tokens, fp8=fp8, drawn_in_fp32=False)
    except ValueError as exc:
        return usage_error(PROG, exc)
    key = shape_key(shape, FP8_DTYPE if fp8 else dtype)
    out, table = _paths(args, device)
    problem = _check_table(table, explicit=args.table is not None or out != args.out)
    if problem:
        return usage_error(PROG, problem)
    try:
        arg_types.check_out(out, STUDY.result_names, args.overwrite)
    except ValueError as exc:
        return usage_error(PROG, exc)
    meta = running_versions(device)
    if table.is_file():
        tuned = parse_table(table).meta
        if tuned and tuned != meta:
            console.print(f"{table} was tuned with {tuned}; its _meta now records this run's {meta}",
                          highlight=False, markup=False, style="yellow", soft_wrap=True)
    _, prov = measure_provenance(device, dtype, console)
    out_dir = out or RESULTS_ROOT / f"tune-{prov.run_id}"
    timer = functools.partial(graph_time_ms, reps=args.rep, device=device)
    rows, records, status = [], [], 0
    for t in dict.fromkeys(args.tokens):
        rot = args.rotations or (8 if t <= 16 else 2 if t <= 256 else 1)
        try:
            best, rec = tune_tokens(shape, t, dtype, rot, lambda m: console.print(m, highlight=False),
                                    device=device, timer=timer, seed=args.seed, switches=args.switches,
                                    fp8=fp8)
        except RuntimeError as exc:   # every tile failed: the tokens tuned so far are kept
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            status = 1
            break
        records += rec
        rows += tune_rows(prov, layer.name, shape, rot, rec, best, fp8=fp8)
        write_table(table, key, {t: best}, meta)
    if args.records:
        atomic_write_text(args.records, "".join(json.dumps(r) + "\n" for r in records))
    if rows:   # the token counts tuned before a failure are kept, in the table and in the results
        written = STUDY.write(rows, out_dir, overwrite=args.overwrite)
        out_dir = written[0].parent
        console.print(f"Wrote {table}; {', '.join(p.name for p in written)} in {out_dir}", highlight=False)
        looked_in = Path(os.environ.get("MOEKIT_CONFIG_DIR", PACKAGED_DIR)).resolve()
        if table.name == f"{device_slug(device)}.json" and table.parent.resolve() != looked_in:
            console.print(f"moekit uses this table when MOEKIT_CONFIG_DIR={table.parent}", highlight=False,
                          soft_wrap=True)
    return status
