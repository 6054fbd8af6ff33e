"""`moekit bench`: time every backend against the roofline floor, write CSV, JSON, plots, report.

With no arguments it picks what fits the machine: Qwen3-30B-A3B in bfloat16 with CUDA graphs on a
GPU; the `tiny` preset in float32 on a CPU-only machine (Triton through its interpreter), which
runs end to end in well under two minutes. --shape and --config measure any other layer.

Beside the backends it times the dense pair (`moekit.bench.dense`, rows with backend "dense"): the
layer's FLOPs as two dense matmuls through one expert's weights (cuBLAS on a GPU), checked and timed
the same way; the report sets triton's time against it ("% of dense pair"). On by default with CUDA;
--dense times it on the CPU too, --no-dense leaves it out. Likewise the whole layer (`--layer`, rows
with backend "layer"): `moekit.MoELayer`, router included, called as a user calls it, whose eager calls
of at most 16 tokens replay its eager graphs: the eager layer call a decoding model pays.

--backward times one forward + backward per call instead (`moekit.bench.backward`), eager and (on a
GPU, by default) the whole step in one CUDA graph, for each backend the registry says has a backward
on the device: the rows' direction is "fwd+bwd", their floor that of `roofline.training_traffic`, and
on CUDA the eager rows carry the call's peak memory.

--weights fp8 quantizes the layer's expert weights once (block-scaled e4m3, `moekit.bench.fp8`) and
times each backend that takes FP8 weights (triton, masked, loop) on them beside the same backend on the
dense weights, in the same run: rows with `weights` "fp8", checked against the FP8 oracle, their
floor from the FP8 bytes and the FP8 matmul ceiling (`torch._scaled_mm`, measured with the others on
CUDA); the report and the console give the FP8 speed-up per token count. On a CPU-only machine its
default layer is `bench.fp8.CPU_SHAPE` (the tiny preset's H and I are not multiples of 128).

Every argument is checked while parsing and the output folder before anything is measured; a folder
that already holds results is refused unless --overwrite is given. All outputs are rendered in
memory and then written, each file atomically. Exit status: 0 when at least one case was timed,
1 when none was, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moekit.bench import args as arg_types
from moekit.bench import peers
from moekit.bench.args import CPU_PRESET, RESULTS_ROOT, usage_error
from moekit.bench.dense import DENSE
from moekit.bench.fp8 import CPU_SHAPE, fp8_backends, shape_problem
from moekit.bench.kernel_work import TILED
from moekit.bench.layers import parse_shape
from moekit.bench.report import JSON_NAME, STUDY, crossover_of, fmt_pct, fp8_pairs
from moekit.bench.results import FP8, ResultRow, json_text
from moekit.bench.runner import LAYER, Options
from moekit.bench.study import (
    CSV_NAME,
    exit_status,
    is_noisy,
    measure_provenance,
    status_counts,
    warn_to,
    with_threads,
)
from moekit.bench.sweep import Plan, run_sweep
from moekit.bench.timing import FLUSH_MODES
from moekit.eager_graphs import EAGER_GRAPH_MAX_TOKENS
from moekit.experts import BACKENDS, has_backward

PROG = "moekit bench"
GPU_TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192)
CPU_TOKENS = (1, 4, 16, 64)
QUICK_GPU_TOKENS = (1, 16, 256, 4096)
QUICK_CPU_TOKENS = (1, 4, 16)
BACKWARD_GPU_TOKENS = (1024, 4096, 16384)   # training batches
BACKWARD_CPU_TOKENS = (1, 4, 16)            # an interpreted triton step takes about 0.5 s
QUICK_BACKWARD_GPU_TOKENS = (1024, 4096)
QUICK = Options(warmup=1, rep=5, routing_draws=16)
# The CPU run demonstrates the flow: interpreted Triton takes 0.1 to 1 s a call, so at least 5
# timed calls there instead of the article's 15 (still about 0.4 s of calls for fast backends).
CPU_DEFAULT = Options(warmup=1, min_rep=5)
RESULT_NAMES = (*STUDY.result_names, JSON_NAME)
# Said once above a CPU run's tables: the triton rows' hundreds of ms are the interpreter's.
INTERPRETER_NOTE = ("Triton kernels run under the interpreter on this CPU-only machine: their times measure "
                    "the interpreter, not the kernels")


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg_types.add_preset(p, multiple=True)
    p.add_argument("--tokens", type=arg_types.token_counts, default=None,
                   help=f"token counts, e.g. 1,4,16 (default: {','.join(map(str, GPU_TOKENS))} on a GPU, "
                        f"{','.join(map(str, CPU_TOKENS))} on the CPU)")
    default = arg_types.default_backends()
    arg_types.add_backends(p, lambda: [*BACKENDS, *peers.PEERS], None,
                           f"experts backends, comma-separated (default: {','.join(default)}; with "
                           "--backward, those of them with a backward on the device); Transformers peers "
                           f"{','.join(peers.PEERS)} may be named too (not with --backward)")
    arg_types.add_dtype(p)
    arg_types.add_graph(p, "also time each backend captured in a CUDA graph (default: on with CUDA)")
    arg_types.add_out(p, "<UTC timestamp>", RESULT_NAMES)
    p.add_argument("--peers", action="store_true",
                   help="also time Transformers' experts implementations (eager, batched_mm, grouped_mm)")
    p.add_argument("--dense", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the dense pair: the layer's FLOPs as two dense matmuls, T*K rows through "
                        "one expert's weights (cuBLAS on a GPU), rows with backend 'dense' and the report's "
                        "'%% of dense pair' column (default: on with CUDA; on the CPU its ~20 µs calls are "
                        "the run's noisiest rows; forward only: not with --backward)")
    p.add_argument("--layer", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the whole layer as a user calls it: moekit.MoELayer (router + triton "
                        "experts) on the same weights, rows with backend 'layer'; its eager calls of at most "
                        f"{EAGER_GRAPH_MAX_TOKENS} tokens replay the layer's eager graphs (default: on with "
                        "CUDA; forward only)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK.rep} timed calls, fewer token counts, fewer routing draws")
    arg_types.add_timing(p, "timed calls per case (default: ~0.4 s of calls, clamped to 15..400 on a GPU, "
                            "5..400 on the CPU)", "warm-up calls per case")
    arg_types.add_device(p)
    arg_types.add_threads(p)
    arg_types.add_seed(p, "the weights, tokens and router")
    p.add_argument("--flush", choices=FLUSH_MODES, default="write",
                   help="how the GPU's cache is flushed before each timed call: write a buffer larger than "
                        "it (default; leaves dirty lines the call writes back), or clean: write it, then "
                        "read another as large (see moekit.bench.timing); the CPU times warm caches")
    p.add_argument("--backward", action="store_true",
                   help="time forward + backward of the expert path (eager, and on a GPU the step in a "
                        "CUDA graph too; gradients of x, both weights and the routing weights, checked "
                        "first) for each backend with a backward on the "
                        f"device; default tokens {','.join(map(str, BACKWARD_GPU_TOKENS))} on a GPU, "
                        f"{','.join(map(str, BACKWARD_CPU_TOKENS))} on the CPU")
    arg_types.add_weights(p, "the experts' weights: dtype (default: dense, in --dtype), or fp8: also each "
                             f"backend that takes FP8 weights ({','.join(fp8_backends())}) on the weights "
                             "block-quantized to e4m3 (one fp32 scale per 128x128 block), beside the same "
                             "backend on the dense weights; floors from the FP8 bytes and the FP8 matmul "
                             "ceiling (torch._scaled_mm, CUDA). H and I must be multiples of 128 (default "
                             f"layer on the CPU: --shape {CPU_SHAPE}); forward only")


def _resolve_plan(args: argparse.Namespace, console: Console) -> tuple[Plan, bool]:
    device = arg_types.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    fp8 = args.weights == FP8
    if fp8 and args.backward:
        raise ValueError("--weights fp8: FP8 experts are inference only; drop --backward")
    if fp8 and not arg_types.layer_given(args) and not on_gpu:
        layers = [parse_shape(CPU_SHAPE)]
    else:
        layers = arg_types.resolve_layers(args, device, warn_to(console))
    if not arg_types.layer_given(args) and not on_gpu:
        why = "--device cpu" if torch.cuda.is_available() else "No CUDA device"
        what = (f"the layer {CPU_SHAPE} (FP8 blocks need H and I divisible by 128)" if fp8
                else f"the '{CPU_PRESET}' preset")
        console.print(f"[yellow]{why}: {what} on the CPU (Triton interpreted, CPU ceilings).[/yellow]",
                      soft_wrap=True)
    problems = [shape_problem(layer.name, layer.shape) for layer in layers] if fp8 else []
    if any(problems):
        raise ValueError("--weights fp8: " + "; ".join(p for p in problems if p))
    if args.backends is not None:
        backends = list(dict.fromkeys(args.backends))
    elif args.backward:
        backends = [b for b in arg_types.default_backends() if has_backward(b, device)]
    elif fp8:
        backends = fp8_backends(arg_types.default_backends())
    else:
        backends = list(arg_types.default_backends())
    if fp8 and not fp8_backends(backends):
        raise ValueError(f"--weights fp8: none of --backends {','.join(backends)} takes FP8 weights; those "
                         f"that do: {','.join(fp8_backends())}")
    for b in backends:
        if b not in BACKENDS and not peers.is_peer(b):
            raise ValueError(f"--backends: unknown backend {b!r}; expected from {BACKENDS + peers.PEERS}")
    with_peers = args.peers or any(peers.is_peer(b) for b in backends)
    if args.backward:
        if with_peers:
            raise ValueError("--backward: Transformers' experts (--peers, or a peer in --backends) are timed "
                             "forward only; drop them")
        if args.dense:
            raise ValueError("--dense: the dense pair is timed forward only; drop --dense or --backward")
        if args.layer:
            raise ValueError("--layer: the layer is timed forward only; drop --layer or --backward")
    if with_peers:
        if peers.transformers_version() is None:
            console.print("[yellow]--peers: transformers is not installed; skipping its experts "
                          "implementations (pip install 'moekit\\[transformers]').[/yellow]")
            backends = [b for b in backends if not peers.is_peer(b)]
            with_peers = False
        elif args.peers:
            backends += [p for p in peers.PEERS if p not in backends]
    if not args.backward and arg_types.pick(args.layer, device, True, False) and LAYER not in backends:
        backends.append(LAYER)
    if not args.backward and arg_types.pick(args.dense, device, True, False) and DENSE not in backends:
        backends.append(DENSE)
    tokens = args.tokens or list(_default_tokens(on_gpu, args.quick, args.backward))
    dtype = arg_types.resolve_dtype(args.dtype, device)
    graph = arg_types.pick(args.graph, device, True, False)
    modes = ("eager", "graph") if graph else ("eager",)
    arg_types.check_memory(layers, dtype, device, tokens, fp8=fp8, backward=args.backward)
    plan = Plan(tuple(layers), tuple(tokens), tuple(backends), modes, dtype, device, args.seed,
                direction="fwd+bwd" if args.backward else "fwd", fp8=fp8)
    return plan, with_peers


def _default_tokens(on_gpu: bool, quick: bool, backward: bool) -> tuple[int, ...]:
    if backward:
        gpu, cpu = (QUICK_BACKWARD_GPU_TOKENS, QUICK_CPU_TOKENS) if quick else (BACKWARD_GPU_TOKENS,
                                                                                BACKWARD_CPU_TOKENS)
    else:
        gpu, cpu = (QUICK_GPU_TOKENS, QUICK_CPU_TOKENS) if quick else (GPU_TOKENS, CPU_TOKENS)
    return gpu if on_gpu else cpu


def _options(args: argparse.Namespace, device: torch.device) -> Options:
    base = QUICK if args.quick else (Options() if device.type == "cuda" else CPU_DEFAULT)
    # The CPU times warm caches (--quick too): a 64 MB flush before each sub-millisecond call doubles
    # its time and spreads two runs' medians apart.
    return replace(base, warmup=args.warmup if args.warmup is not None else base.warmup,
                   rep=args.rep if args.rep is not None else base.rep,
                   flush_l2=device.type == "cuda" and args.flush)


def _summary_table(rows: Sequence[ResultRow], title: str,
                   extra: Callable[[ResultRow], str] | None = None) -> Table:
    """Backends down, token counts across (short numeric columns fit a narrow terminal); `extra(row)`
    adds a line under a timed cell."""
    tokens = sorted({r.tokens for r in rows})
    table = Table(title=title)
    table.add_column("backend (mode)")
    for t in tokens:
        table.add_column(f"T={t}", justify="right")
    floors = [("floor", {r.tokens: r.floor_ms for r in rows if not r.on_fp8}),
              ("FP8 floor", {r.tokens: r.floor_ms for r in rows if r.on_fp8})]
    floors = [(name, f) for name, f in floors if f]
    for i, (name, floor) in enumerate(floors):
        table.add_row(name, *[f"{floor[t]:.3g}" if t in floor else "" for t in tokens],
                      end_section=i == len(floors) - 1)
    by_key = {(r.tokens, r.series, r.mode): r for r in rows}
    for b, m in dict.fromkeys((r.series, r.mode) for r in rows):
        cells = []
        for t in tokens:
            r = by_key.get((t, b, m))
            if r is None:
                cells.append("")
            elif r.status == "ok":
                noisy = " [yellow]noisy[/yellow]" if is_noisy(r.p20_ms, r.p80_ms) else ""
                more = extra(r) if extra else ""
                cells.append(f"{r.median_ms:.3g}\n{fmt_pct(r.pct_floor)}\n[dim]{r.p20_ms:.3g}–{r.p80_ms:.3g}[/dim]"
                             + noisy + (f"\n{more}" if more else ""))
            else:
                style = "red" if r.status in ("failed", "error") else "dim"
                cells.append(f"[{style}]{r.status.replace('_', ' ')}[/{style}]")
        table.add_row(f"{b} ({m})", *cells)
    return table


def _fp8_table(rows: Sequence[ResultRow], preset: str) -> Table | None:
    """FP8 against the dense weights, backends down, token counts across (None without FP8 rows)."""
    pairs = fp8_pairs([r for r in rows if r.preset == preset])
    if not pairs:
        return None
    dtype = pairs[0][0].dtype
    tokens = sorted({f.tokens for f, _ in pairs})
    table = Table(title=f"{preset}: FP8 weights vs {dtype}: fp8 ms / {dtype} ms / speed-up / % of FP8 floor")
    table.add_column("backend (mode)")
    for t in tokens:
        table.add_column(f"T={t}", justify="right")
    by_key = {(f.tokens, f.backend, f.mode): (f, d) for f, d in pairs}
    for b, m in dict.fromkeys((f.backend, f.mode) for f, _ in pairs):
        cells = []
        for t in tokens:
            f, d = by_key.get((t, b, m), (None, None))
            if f is None or f.status != "ok":
                cells.append("" if f is None else f"[red]{f.status.replace('_', ' ')}[/red]")
                continue
            dense = f"{d.median_ms:.3g}" if d is not None and d.status == "ok" else "–"
            speed = f"{d.median_ms / f.median_ms:.2f}×" if d is not None and d.status == "ok" else "–"
            cells.append(f"{f.median_ms:.3g}\n{dense}\n{speed}\n{fmt_pct(f.pct_floor)}")
        table.add_row(f"{b} ({m})", *cells)
    return table


def _summary(rows: Sequence[ResultRow], preset: str, direction: str) -> Table:
    rs = [r for r in rows if r.preset == preset]
    if direction == "fwd":
        return _summary_table(rs, f"{preset}: median ms per call / % of floor / p20–p80 ms; crossover ≈ "
                                  f"{crossover_of(rs[0]):,.0f} tokens")
    return _summary_table(rs, f"{preset}, forward + backward: median ms per call / % of floor / p20–p80 ms"
                              " / peak MiB (CUDA)",
                          lambda r: "" if math.isnan(r.peak_mib) else f"{r.peak_mib:,.0f} MiB")


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        plan, with_peers = _resolve_plan(args, console)
        arg_types.check_out(args.out, RESULT_NAMES, args.overwrite)
    except ValueError as exc:
        return usage_error(PROG, exc)
    options = _options(args, plan.device)
    with arg_types.cpu_threads(plan.device, args.threads) as threads:   # the ceilings too: same threads
        ceilings, prov = measure_provenance(
            plan.device, plan.dtype, console, rep=options.rep,
            transformers_version=peers.transformers_version() if with_peers else None, fp8=plan.fp8)
        out_dir = args.out or RESULTS_ROOT / prov.run_id
        progress = Progress(TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        with progress:
            task = progress.add_task("sweep", total=plan.num_cases)

            def on_case(what: str, row: ResultRow | None) -> None:
                if row is None:
                    progress.update(task, description=what)
                else:
                    progress.advance(task)

            rows = with_threads(run_sweep(plan, ceilings, prov, options, on_case), threads)

    written = STUDY.write(rows, out_dir, extra={JSON_NAME: json_text(rows)}, overwrite=args.overwrite)
    out_dir = written[0].parent
    if plan.device.type == "cpu" and any(b in (TILED, LAYER) for b in plan.backends):
        console.print(INTERPRETER_NOTE, highlight=False)
    for preset in plan.presets:
        console.print(_summary(rows, preset, plan.direction))
        fp8_table = _fp8_table(rows, preset)
        if fp8_table is not None:
            console.print(fp8_table)
    console.print("rows: " + ", ".join(f"{n} {s}" for s, n in status_counts(rows).items()))
    console.print(f"Wrote {out_dir / CSV_NAME}, {JSON_NAME}, {len(written) - 3} plots and "
                  f"{written[-1].name} in {out_dir}")
    if any(math.isnan(r.median_ms) for r in rows if r.status == "ok"):
        print(f"{PROG}: error: internal error: a timed row has no time", file=sys.stderr)
        return 1
    return exit_status(PROG, rows, out_dir / CSV_NAME, console,
                       lambda r: f"{r.preset} T={r.tokens} {r.series} ({r.mode})")
