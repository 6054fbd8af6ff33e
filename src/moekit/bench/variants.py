"""`moekit sweep`: variants of the triton expert path side by side in one process, on one workload a T.

    --set tiles    the tuned config ("table") against persistent kernels, TMA weights, paired tiles
                   (each shrunk to the device's shared memory), the packaged table's config and the
                   default an untuned shape runs
    --set decode   the four-kernel path against the direct decode path (`moekit.decode`) with its
                   default tiles and each of `DECODE_TILES`
    --set group    the table's config with group_m 1, 2, 4, 8 (row blocks of one expert run on a
                   column tile before the next) and with 32-row blocks
    --set hints    the launch hints (`moekit.launch_hints`): plain, evict-first weights, programmatic
                   dependent launch, both
    --set flush    the cache before each timed call: written over (`moekit bench`), written then a
                   clean buffer read, or left warm
    --set wgrad    the weight-gradient kernel's tiles (`moekit.bench.wgrad`): the forward's old tiles,
                   `wgrad_config`'s and the candidates, both launches of a training step
    --set fp8      the dense weights against the same weights in block-scaled FP8: the backend's
                   choice, its FP8 tiles with and without TMA, two other tile families, and at
                   decode sizes the decode kernels' tile sets on the e4m3 weights (H and I divisible
                   by 128)

Each variant goes through the benchmark's `run_case`: checked against the fp32 reference first (the
2x rule; a variant that fails is recorded and never timed), then timed by `time_fn` (graph replays
on CUDA), its launches counted, and set against the roofline floor (wgrad: its FLOPs over the matmul
ceiling). `--rounds` times the whole set several times, each round in a new order: variants timed
one after the other in one fixed order take whatever drift the device's state has at that moment
(identical launches have differed by a quarter at one token that way). Rows follow `SweepRow`;
`moekit report DIR` redraws report.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from unittest import mock

import numpy as np
import torch

from moekit.bench import args as arg_types
from moekit.bench import wgrad
from moekit.bench.args import usage_error
from moekit.bench.correctness import Check
from moekit.bench.lab import first_line, layer_head, report, run_study
from moekit.bench.results import LayerRow
from moekit.bench.roofline import Traffic
from moekit.bench.runner import Measurement, Options, Workload, make_weights, make_workload, run_case
from moekit.bench.study import FILES, Files, Study
from moekit.launch_hints import EVICT_ENV, PDL_ENV

PROG = "moekit sweep"
GPU_TOKENS = {"decode": (1, 2, 4, 8, 16), "group": (16, 32, 64, 128), "hints": (1, 4, 16, 64, 256),
              "flush": (1, 4, 16, 64, 256, 1024)}
GPU_DEFAULT_TOKENS = (1024, 4096, 16384)
CPU_TOKENS = (8,)
CPU_OPTIONS = Options(warmup=0, rep=2, flush_l2=False, routing_draws=1)
GPU_OPTIONS = Options(routing_draws=1)
GPU_ROUNDS = 3
Factory = Callable[[Workload], Callable[[], object]]


@dataclass(frozen=True)
class SweepRow(LayerRow):
    """One variant at one T: its run's `Provenance` and layer columns, then the set, the variant, what
    it ran (`tiles`: the config's fields, or the switches) and `run_case`'s measurement over its
    rounds (`set_rows`); speedup is the set's first variant's median over this one's; spread_pct:
    the range of the rounds' medians as a % of their median (NaN: one round, or rows before rounds)."""

    variant_set: str
    variant: str
    tiles: str
    mode: str
    status: str
    reason: str
    max_err: float
    floor_ms: float
    median_ms: float
    pct_floor: float
    p20_ms: float
    p80_ms: float
    n_rep: int | None
    kernels: int | None
    speedup: float
    rounds: int = 1
    spread_pct: float = math.nan


def render(rows: Sequence[SweepRow], files: Files = FILES) -> dict[str, str]:
    return {files.report: report(
        rows, "moekit sweep", lambda r: f"{r.variant_set}: {r.preset}, T = {r.tokens} ({r.mode})",
        ("variant", "status", "median_ms", "pct_floor", "speedup", "p20_ms", "p80_ms", "spread_pct",
         "max_err", "kernels", "tiles", "reason"),
        ["- speedup: the set's first variant's median over the row's; pct_floor: the roofline floor over "
         "the median (wgrad: its FLOPs at the matmul ceiling)",
         "- median, p20, p80: the medians of the rounds' own; spread_pct: the range of the rounds' medians "
         "as a % of their median (a gap between two variants below their spreads is not a result)"])}


STUDY = Study("sweep", SweepRow, render)


@dataclass(frozen=True)
class Variant:
    """How one variant runs: its call on the workload, what it ran, and any change to the workload
    (wgrad: its own reference and FLOPs) or to the timing (flush)."""

    factory: Factory
    tiles: str = ""
    work: Workload | None = None
    flush_l2: bool | str | None = None


def _tiles(cfg) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.to_dict().items())


def _experts(cfg) -> Variant:
    from moekit.experts import moe_experts

    def make(work: Workload):
        wt = work.weights
        args = (work.x, wt.gate_up_proj, wt.down_proj, work.topk_weights, work.topk_ids)
        return lambda: moe_experts(*args, backend="triton", config=cfg)
    return Variant(make, _tiles(cfg) if cfg is not None else "backend's choice")


def _chosen(work: Workload, gate_up, down) -> str:
    """What the backend's plan runs on work's call (`moekit.experts.plan`), as a variant's tiles."""
    from moekit.experts.plan import DECODE, plan_triton_call

    plan = plan_triton_call(work.x, gate_up, down, work.topk_ids)
    ran = f"decode {plan.decode.label()}" if plan.path == DECODE else _tiles(plan.config)
    return f"backend's choice: {ran}"


def _decode(cfg) -> Variant:
    from moekit.decode import experts_decode

    def make(work: Workload):
        wt = work.weights
        w, ids, out = work.topk_weights.contiguous(), work.topk_ids.contiguous(), torch.empty_like(work.x)
        return lambda: experts_decode(work.x, wt.gate_up_proj, wt.down_proj, w, ids, out, cfg)
    return Variant(make, cfg.label())


def _hinted(env: dict[str, str]) -> Variant:
    """The experts path with the hints' switches set while it launches (and while a graph records it)."""
    plain = _experts(None).factory

    def make(work: Workload):
        fn = plain(work)

        def call():
            with mock.patch.dict(os.environ, env):
                return fn()
        return call
    return Variant(make, " ".join(f"{k}={v}" for k, v in env.items()))


def tile_variants(work: Workload) -> dict[str, Variant]:
    from moekit import tuning

    s, t, dtype, dev = work.shape, work.tokens, work.dtype, work.device
    base = tuning.get_config(s, t, dtype, dev)
    budget = tuning.shared_memory_budget(dev)
    persistent = replace(base, persistent=True)
    paired = replace(base, block_m=64, pair_blocks=2, block_n2=256)
    fitted = {"persistent": persistent, "persistent+tma": replace(persistent, tma_weights=True),
              "tma": replace(base, tma_weights=True), "paired": paired,
              "paired+tma": replace(paired, tma_weights=True)}
    configs = {"table": base, **{n: tuning.fit_shared_memory(c, dtype.itemsize, budget)
                                 for n, c in fitted.items()},
               "packaged": tuning.get_config(s, t, dtype, dev,
                                             table=tuning.packaged_table(tuning.table_slug(dev))),
               "default": tuning.default_config(s, t, dtype.itemsize, dev)}
    return {n: _experts(c) for n, c in configs.items()}


def decode_variants(work: Workload) -> dict[str, Variant]:
    from moekit.decode import DECODE_TILES, DEFAULT_DECODE
    from moekit.tuning import get_config

    return {"table": _experts(get_config(work.shape, work.tokens, work.dtype, work.device)),
            "direct": _decode(DEFAULT_DECODE),
            **{f"direct {i}": _decode(c) for i, c in enumerate(DECODE_TILES)}}


def group_variants(work: Workload) -> dict[str, Variant]:
    from moekit.tuning import get_config

    base = get_config(work.shape, work.tokens, work.dtype, work.device)
    bm32 = replace(base, block_m=32)
    groups = {f"group {g}": _experts(replace(base, group_m=g)) for g in (1, 2, 4, 8)}
    return {"table": _experts(base), **groups,
            "bm32": _experts(bm32), "bm32 group 1": _experts(replace(bm32, group_m=1))}


def hint_variants(work: Workload) -> dict[str, Variant]:
    return {name: _hinted({EVICT_ENV: evict, PDL_ENV: pdl}) for name, evict, pdl in (
        ("plain", "0", "0"), ("evict", "1", "0"), ("pdl", "0", "1"), ("both", "1", "1"))}


def flush_variants(work: Workload) -> dict[str, Variant]:
    plain = _experts(None)
    return {name: replace(plain, tiles=f"flush_l2={flush}", flush_l2=flush)
            for name, flush in (("write", "write"), ("clean", "clean"), ("none", False))}


@dataclass(frozen=True)
class WgradExpected:
    """The wgrad launches' gate (`WgradCase.problem`: 2x plain PyTorch's error, exact zeros for experts
    with no pairs), in the shape of `correctness.Expected`."""

    case: wgrad.WgradCase
    tol: float = math.nan

    def check(self, out: object) -> Check:
        errs = []
        for launch, got in zip(wgrad.LAUNCHES, out, strict=True):
            err, problem = self.case.problem(launch, got)
            if problem:
                return Check(False, err, 2 * self.case.base_err[launch], f"{launch}: {problem}")
            errs.append(err)
        return Check(True, max(errs), self.tol)


def wgrad_variants(work: Workload) -> dict[str, Variant]:
    from moekit.tuning import get_config, shared_memory_limit, wgrad_config

    s, t, dtype, dev = work.shape, work.tokens, work.dtype, work.device
    cfg = get_config(s, t, dtype, dev)
    case = wgrad.make_case(s, t, dtype, cfg.block_m, dev)
    flops = int(sum(case.flops.values()))
    wwork = replace(work, expected=WgradExpected(case),
                    traffic=Traffic(work.traffic.experts_hit, 0, 0, 0, flops))
    default = wgrad_config(dtype.itemsize, dev, rows_per_expert=t * s.top_k / s.num_experts)
    tiles = {"old": wgrad.legacy_tiles(cfg), "default": dict.fromkeys(wgrad.LAUNCHES, default)}
    for c in wgrad.CANDIDATES if dev.type == "cuda" else wgrad.CPU_CANDIDATES:
        fits = c.pipeline_bytes(dtype.itemsize) <= shared_memory_limit(dev)
        if fits and dict.fromkeys(wgrad.LAUNCHES, c) not in tiles.values():
            tiles[c.label()] = dict.fromkeys(wgrad.LAUNCHES, c)

    def variant(per_launch: dict) -> Variant:
        label = " / ".join(dict.fromkeys(v.label() for v in per_launch.values()))
        return Variant(lambda _w: lambda: tuple(case.run(k, per_launch[k]) for k in wgrad.LAUNCHES), label,
                       wwork)
    return {n: variant(v) for n, v in tiles.items()}


def fp8_variants(work: Workload) -> dict[str, Variant]:
    """The triton path on the dense weights (first: the speed-up column is dense / FP8), then on the
    same weights in block-scaled FP8 (`moekit.bench.fp8`): the backend's choice, its tiles with and
    without TMA weights, two other tile families, and at decode sizes the decode kernels' tile sets
    on the e4m3 weights. Each FP8 variant is checked against the oracle of the path it runs."""
    from moekit import tuning
    from moekit.bench.fp8 import Fp8Workloads, fp8_factory, quantize_layer
    from moekit.decode import DECODE_TILES, DEFAULT_DECODE, experts_decode, use_decode_direct
    from moekit.experts import ExpertsOptions, get_backend, moe_experts
    from moekit.quant import FP8_DTYPE

    experts = quantize_layer(work.weights)
    twins = Fp8Workloads(work, experts)
    s, t, dev = work.shape, work.tokens, work.device
    base = tuning.get_config(s, t, FP8_DTYPE, dev)

    def grouped(cfg) -> Variant:
        def make(w: Workload):
            args = (w.x, experts.gate_up, experts.down, w.topk_weights, w.topk_ids)
            if experts.standin:
                return lambda: get_backend("triton").run_fp8(*args, ExpertsOptions(config=cfg), None, False)
            return lambda: moe_experts(*args, backend="triton", config=cfg)
        return Variant(make, _tiles(cfg), twins.w8a8)

    def direct(tiles) -> Variant:
        def make(w: Workload):
            ids, wt, out = w.topk_ids.contiguous(), w.topk_weights.contiguous(), torch.empty_like(w.x)
            scales = (experts.gate_up.scale, experts.down.scale)
            return lambda: experts_decode(w.x, experts.gate_up.data, experts.down.data, wt, ids, out, tiles,
                                          scales)
        return Variant(make, tiles.label(), twins.w8a16)

    families = {"fp8 table": base, "fp8 tma": replace(base, tma_weights=True),
                "fp8 no tma": replace(base, tma_weights=False),
                "fp8 bm64 w4": tuning.fp8_tiles(replace(base, block_m=64, pair_blocks=1, warps1=4, warps2=4,
                                                        stages1=3, stages2=3, block_n2=128)),
                "fp8 bm128 w8": tuning.fp8_tiles(replace(base, block_m=128, pair_blocks=1, warps1=8, warps2=8,
                                                         stages1=3, stages2=3, block_n2=128))}
    chosen = Variant(fp8_factory("triton", experts), _chosen(work, experts.gate_up, experts.down),
                     twins.for_backend("triton"))
    dense = replace(_experts(None), tiles=_chosen(work, work.weights.gate_up_proj, work.weights.down_proj))
    variants = {"dense": dense, "fp8": chosen}
    variants.update({n: grouped(c) for n, c in families.items()})
    # The dense weights' bound, wider than FP8's: the rows past FP8's own bound are what decides it.
    if use_decode_direct(t, s.top_k, s.num_experts):
        variants.update({f"fp8 direct {i}": direct(c) for i, c in enumerate((DEFAULT_DECODE, *DECODE_TILES))})
    return variants


SETS: dict[str, Callable[[Workload], dict[str, Variant]]] = {
    "tiles": tile_variants, "decode": decode_variants, "group": group_variants, "hints": hint_variants,
    "flush": flush_variants, "wgrad": wgrad_variants, "fp8": fp8_variants}


def _combined(runs: Sequence[Measurement]) -> dict:
    """One variant's columns over its rounds: the medians of the rounds' median, p20 and p80, and the
    rounds' range of medians as a % of their median (a round that failed: that round's columns)."""
    bad = next((m for m in runs if m.status != "ok"), None)
    if bad is not None:
        return {**bad.columns(), "rounds": len(runs), "spread_pct": math.nan}
    cols = runs[0].columns()
    medians = [m.median_ms for m in runs]
    median = float(np.median(medians))
    cols.update(max_err=max(m.max_err for m in runs), median_ms=median,
                pct_floor=100.0 * cols["floor_ms"] / median,
                p20_ms=float(np.median([m.timing.p20_ms for m in runs])),
                p80_ms=float(np.median([m.timing.p80_ms for m in runs])),
                n_rep=sum(m.timing.n for m in runs), rounds=len(runs),
                spread_pct=100.0 * (max(medians) - min(medians)) / median)
    return cols


def set_rows(name: str, work: Workload, head: dict, modes: Sequence[str], ceilings, options: Options,
             progress: Callable[[str], None], rounds: int = 1, seed: int = 0) -> list[SweepRow]:
    """Every variant of one set at work's T, in every mode (a set that cannot be built: one error row).

    Each round times every variant once, the rounds after the first in a shuffled order (seeded), so
    a drift of the device's state over the run spreads over the variants instead of landing on the
    ones timed together; a variant that fails a round is not run again."""
    try:
        variants = SETS[name](work)
    except Exception as exc:   # e.g. a set's inputs that do not fit: one row lost, not the study
        variants = {"(set)": None}
        reason = first_line(exc)
    rows = []
    for mode in modes:
        runs: dict[str, list[Measurement]] = {n: [] for n, v in variants.items() if v is not None}
        order, rng = list(runs), random.Random(seed)
        for r in range(rounds):
            if r:
                rng.shuffle(order)
            for vname in order:
                if runs[vname] and runs[vname][-1].status != "ok":
                    continue
                v = variants[vname]
                progress(f"{name} T={work.tokens} {vname} ({mode})"
                         + (f", round {r + 1}" if rounds > 1 else ""))
                opts = options if v.flush_l2 is None else replace(options, flush_l2=v.flush_l2)
                runs[vname].append(run_case(v.work or work, vname, mode, ceilings, opts, v.factory))
        first = math.nan
        for vname, v in variants.items():
            if v is None:
                cols = {"status": "error", "reason": reason, "max_err": math.nan, "floor_ms": math.nan,
                        "median_ms": math.nan, "pct_floor": math.nan, "p20_ms": math.nan, "p80_ms": math.nan,
                        "n_rep": None, "kernels": None}
            else:
                cols = _combined(runs[vname])
            first = cols["median_ms"] if math.isnan(first) else first
            rows.append(SweepRow(**head, variant_set=name, variant=vname, tiles=v.tiles if v else "",
                                 mode=mode, speedup=first / cols["median_ms"], **cols))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="sets", type=arg_types.names(lambda: list(SETS), "set"), default=["tiles"],
                   help=f"comma-separated, from {', '.join(SETS)} (default: tiles)")
    arg_types.add_preset(p)
    p.add_argument("--tokens", type=arg_types.token_counts, default=None,
                   help="token counts (default on a GPU: " + "; ".join(
                       f"{n} {','.join(map(str, t))}" for n, t in GPU_TOKENS.items())
                        + f"; else {','.join(map(str, GPU_DEFAULT_TOKENS))}; "
                        f"{','.join(map(str, CPU_TOKENS))} on the CPU)")
    p.add_argument("--dtype", choices=tuple(sorted(arg_types.DTYPES)), default=None,
                   help="weights and activations dtype (default: bfloat16 on a GPU, float16 on the CPU: "
                        "the interpreter rounds bf16 stores toward zero; fp32's plain error is 0 to the "
                        "wgrad gate)")
    arg_types.add_graph(p, "time CUDA-graph replays (default: on with CUDA); --no-graph: eager calls")
    arg_types.add_timing(p, f"timed calls per variant (default: time_fn's on a GPU, {CPU_OPTIONS.rep} "
                            "on the CPU)")
    p.add_argument("--rounds", type=arg_types.int_range(1), default=None,
                   help=f"times every variant is timed, each round in a new order (default: {GPU_ROUNDS} "
                        "on a GPU, 1 on the CPU)")
    arg_types.add_device(p)
    arg_types.add_seed(p, "the weights, tokens, routing and the rounds' order")
    arg_types.add_out(p, "sweep-<UTC timestamp>", STUDY.result_names)
    arg_types.add_threads(p)


def _set_tokens(args: argparse.Namespace, device: torch.device, name: str) -> Sequence[int]:
    """The token counts variant set `name` runs at: --tokens, else the set's default on the device."""
    return arg_types.pick(args.tokens, device, GPU_TOKENS.get(name, GPU_DEFAULT_TOKENS), CPU_TOKENS)


def run(args: argparse.Namespace) -> int:
    try:
        device = arg_types.resolve_device(args.device)
        if args.graph and device.type != "cuda":
            raise ValueError("--graph needs a CUDA device")
        layer = arg_types.resolve_layer(args, device)
        dtype = arg_types.DTYPES[args.dtype] if args.dtype else arg_types.pick(None, device, torch.bfloat16,
                                                                              torch.float16)
        tokens = [t for name in args.sets for t in _set_tokens(args, device, name)]
        arg_types.check_memory([layer], dtype, device, tokens, fp8="fp8" in args.sets)
    except ValueError as exc:
        return usage_error(PROG, exc)
    base = GPU_OPTIONS if device.type == "cuda" else CPU_OPTIONS
    options = replace(base, warmup=base.warmup if args.warmup is None else args.warmup,
                      rep=base.rep if args.rep is None else args.rep)
    modes = ("graph",) if arg_types.pick(args.graph, device, True, False) else ("eager",)
    rounds = arg_types.pick(args.rounds, device, GPU_ROUNDS, 1)
    s = layer.shape

    def measure(console, ceilings, prov) -> list[SweepRow]:
        weights = make_weights(s, dtype, device, args.seed)
        rows = []
        for name in args.sets:
            for t in _set_tokens(args, device, name):
                work = make_workload(layer.name, s, t, weights, dtype, device, seed=args.seed,
                                     routing_draws=1)
                rows += set_rows(name, work, layer_head(prov, layer, tokens=t), modes, ceilings, options,
                                 lambda m: console.print(f"  {m}", highlight=False), rounds, args.seed)
        return rows

    return run_study(PROG, args, STUDY, device, dtype, measure,
                     lambda r: f"{r.variant_set} T={r.tokens} {r.variant} ({r.mode})", rep=options.rep,
                     fp8="fp8" in args.sets)
