"""`moekit ablate`: what each design choice of the triton expert path buys, one ablation at a time,
each against the article's number (`ablate_report.ABLATIONS`):

    move     moving the tokens in separate passes (permute by gather, unpermute with index_add_ or
             gather-and-sum) vs the fused gather-on-load / scatter-on-store kernels, over the GEMMs alone
    swiglu   SwiGLU in GEMM1's epilogue vs GEMM1 writing (rows, 2I) and a separate silu * mul pass
    weight   the routing weight in GEMM2's epilogue vs a separate multiply, and each one's error
    graph    the whole layer in a CUDA graph vs eager: time, launches per call, device idle
    tile     tile heights 16, 32, 64, 128 (and paired tiles) at each T: time and padded rows
    dense    the grouped kernels vs two dense matmuls of the same FLOPs
    sort     align alone, torch vs triton
    bytes    DRAM bytes per kernel from Nsight Compute at T = 1 and 64, against the floor's bytes
    masked   the masked (E, C, H) layout vs the contiguous one at decode sizes
    fp8      the layer on its weights in block-scaled FP8 vs the dense weights, each against its
             own floor (the FP8 one: FP8 bytes, the FP8 matmul ceiling measured with the others)

For each T one workload (`moekit.bench.runner.make_workload`: weights, tokens, routing, the fp32
reference) is shared by every variant (`moekit.bench.ablate_variants`), and each variant, in each
mode, goes through the benchmark's `run_case`: its output checked against the reference first (the
2x rule; a variant that fails is recorded as failed and never timed), then timed (`time_fn`, a
CUDA-graph replay in graph mode), its launches counted and its device idle time measured.

A study on the scaffold (`moekit.bench.study`): rows follow `ablate_report.AblateRow`, results.csv,
report.md and one figure per ablation are drawn from them; `moekit report DIR` redraws them.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from rich.console import Console

from moekit.bench import args as arg_types
from moekit.bench.ablate_bytes import find_ncu, profile_layer
from moekit.bench.ablate_report import ABLATIONS, BYTES_VARIANT, STUDY, AblateRow
from moekit.bench.ablate_variants import MEASURED, NotApplicable, Setup, build
from moekit.bench.args import CPU_PRESET, GPU_PRESET, RESULTS_ROOT, usage_error
from moekit.bench.ceilings import Ceilings
from moekit.bench.layers import preset_layer
from moekit.bench.results import Provenance
from moekit.bench.runner import Measurement, Options, Workload, make_weights, make_workload, run_case
from moekit.bench.study import CSV_NAME, exit_status, measure_provenance, status_counts
from moekit.shapes import PRESETS

PROG = "moekit ablate"
GPU_TOKENS = (1, 16, 64, 256, 1024, 2048, 4096, 8192)
CPU_TOKENS = (1, 4, 16)
BYTES_TOKENS = (1, 64)
MASKED_MAX_TOKENS = 256     # decode sizes: the masked layout's workspace holds E * T * K rows
# Interpreted Triton takes 0.05 to 0.3 s a call at the tiny preset: one checked call, 2 timed, one
# profiled, and no 64 MB cache flush before each (it cost a fifth of the run and changes nothing
# at interpreter timings): the whole CPU run stays under a minute on two shared cores.
CPU_OPTIONS = Options(warmup=0, rep=2, flush_l2=False, routing_draws=1)
GPU_OPTIONS = Options(routing_draws=1)


@dataclass(frozen=True)
class AblateConfig:
    """What `study_rows` measures.

    Attributes:
        preset, tokens, dtype, device: the layer and the token counts.
        ablations: keys of `ABLATIONS`, in report order.
        modes: "eager", and "graph" for CUDA-graph replays.
        masked_max_tokens: the masked layout runs at T up to this.
        ncu: the Nsight Compute executable ("" to skip the bytes ablation; None: look for it).
        options: warm-up and repeats.
    """

    preset: str
    tokens: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    modes: tuple[str, ...] = ("eager",)
    seed: int = 0
    masked_max_tokens: int = MASKED_MAX_TOKENS
    ncu: str | None = None
    options: Options = CPU_OPTIONS

    def variants_at(self, tokens: int) -> list[str]:
        """The timed variants of the chosen ablations at T, each once, in report order."""
        wanted = {v for a in self.ablations if a != "masked" or tokens <= self.masked_max_tokens
                  for v in ABLATIONS[a][1]}
        return [v for v in MEASURED if v in wanted]


def _free(device: torch.device) -> None:
    """Give a variant's buffers back before the next one (GPU only: a CPU collection costs 0.1 s)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _measure(work: Workload, name: str, setup: Setup, cfg: AblateConfig, ceilings: Ceilings) -> list[dict]:
    """Columns of one variant's rows, one per mode (a variant that cannot be built is an error row)."""
    try:
        case = build(name, setup)
    except NotApplicable as exc:
        return [{"variant": name, "mode": m, "status": "skipped", "reason": str(exc)} for m in cfg.modes]
    except Exception as exc:   # e.g. tiles that cannot be built here: one row lost, not the study
        text = str(exc).strip().splitlines()
        return [{"variant": name, "mode": m, "status": "error",
                 "reason": f"building the variant: {type(exc).__name__}: {text[0] if text else ''}"}
                for m in cfg.modes]
    rows = []
    for mode in cfg.modes:
        case_work = replace(work, expected=case.expected,
                            traffic=case.traffic if case.traffic is not None else work.traffic)
        m: Measurement = run_case(case_work, name, mode, ceilings, cfg.options, lambda _work: case.call)
        tiles = case.config
        rows.append({"variant": name, "mode": mode, **m.columns(), "tol": m.tol,
                     "busy_ms": m.launches.busy_ms if m.launches else float("nan"), "idle_pct": m.idle_pct,
                     "block_m": tiles.block_m if tiles else None,
                     "pair_blocks": tiles.pair_blocks if tiles else None,
                     "padded_rows": case.padded_rows, "pairs": work.topk_ids.numel()})
        _free(work.device)
    return rows


def bytes_rows(cfg: AblateConfig, work: Workload, setup: Setup) -> list[dict]:
    """The bytes ablation at work's T: one row per profiled kernel, or one skipped row with the reason.
    The profiled layer passes the fp32 gate here first, as every timed variant does."""
    head = {"variant": BYTES_VARIANT, "mode": "eager", "floor_bytes": work.traffic.bytes,
            "pairs": work.topk_ids.numel()}
    ncu = find_ncu(cfg.ncu) if cfg.device.type == "cuda" and cfg.ncu != "" else None
    if cfg.device.type != "cuda":
        reason = "no Nsight Compute counters on the CPU (no CUDA device)"
    elif cfg.ncu == "":
        reason = "not asked for (--ncu '')"
    elif ncu is None:
        where = f"at {cfg.ncu}" if cfg.ncu else "on PATH or in /usr/local/cuda/bin"
        reason = f"Nsight Compute (ncu) not found {where}"
    else:
        case = build("layer", setup)
        check = case.expected.check(case.call())
        reason = "" if check.ok else f"the layer failed its correctness gate: {check.reason}"
        if check.ok:
            kernels, reason = profile_layer(ncu, cfg.preset, work.tokens, cfg.dtype, cfg.seed, cfg.device)
            if kernels:
                return [{**head, "status": "ok", "kernel": k.kernel, "dram_read_bytes": k.read,
                         "dram_write_bytes": k.write} for k in kernels]
    return [{**head, "status": "skipped", "reason": reason}]


def study_rows(cfg: AblateConfig, ceilings: Ceilings, prov: Provenance,
               progress: Callable[[str], None] | None = None) -> list[AblateRow]:
    """Every chosen ablation at every T (see the module doc)."""
    shape = PRESETS[cfg.preset]
    weights = make_weights(shape, cfg.dtype, cfg.device, cfg.seed)
    head = {**asdict(prov), "preset": cfg.preset, "num_experts": shape.num_experts,
            "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "top_k": shape.top_k, "seed": cfg.seed}
    bytes_at = BYTES_TOKENS if "bytes" in cfg.ablations else ()
    rows: list[AblateRow] = []
    for t in sorted(set(cfg.tokens) | set(bytes_at)):
        work = make_workload(cfg.preset, shape, t, weights, cfg.dtype, cfg.device, seed=cfg.seed,
                             routing_draws=cfg.options.routing_draws)
        setup = Setup(work)
        cols: list[dict] = []
        for name in cfg.variants_at(t) if t in cfg.tokens else []:
            if progress:
                progress(f"T={t} {name}")
            cols += _measure(work, name, setup, cfg, ceilings)
        if t in bytes_at:
            cols += bytes_rows(cfg, work, setup)
        rows += [AblateRow(**head, tokens=t, **c) for c in cols]
        del setup, work
        _free(cfg.device)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg_types.add_preset(p)
    p.add_argument("--tokens", type=arg_types.token_counts, default=None,
                   help=f"token counts (default: {','.join(map(str, GPU_TOKENS))} on a GPU, "
                        f"{','.join(map(str, CPU_TOKENS))} on the CPU); the bytes ablation runs at "
                        f"T = {' and '.join(map(str, BYTES_TOKENS))}")
    p.add_argument("--ablations", type=arg_types.names(lambda: list(ABLATIONS), "ablation"),
                   default=list(ABLATIONS), help=f"which ablations, comma-separated (default: all: "
                                                 f"{','.join(ABLATIONS)})")
    arg_types.add_dtype(p)
    arg_types.add_graph(p, "also time every variant as CUDA-graph replays (default: on with CUDA)")
    p.add_argument("--masked-max-tokens", type=arg_types.int_range(1), default=MASKED_MAX_TOKENS,
                   help=f"the masked layout runs at T up to this (default {MASKED_MAX_TOKENS}: decode sizes; "
                        "its workspace holds E*T*K rows)")
    p.add_argument("--ncu", default=None, metavar="PATH",
                   help="the Nsight Compute executable for the bytes ablation (default: ncu on PATH or in "
                        "/usr/local/cuda/bin; '' skips it)")
    arg_types.add_timing(p, f"timed calls per case (default: time_fn's on a GPU, {CPU_OPTIONS.rep} on the "
                            "CPU)", "untimed calls per case after the checked one")
    arg_types.add_device(p)
    arg_types.add_seed(p, "the weights, tokens and router")
    arg_types.add_out(p, "ablate-<UTC timestamp>", STUDY.result_names)


def config_from_args(args: argparse.Namespace, console: Console | None = None) -> AblateConfig:
    """Resolve the defaults that depend on the machine; ValueError on a bad combination."""
    if getattr(args, "layers", None):
        # The Nsight Compute step rebuilds the layer from its preset name in a child process.
        raise ValueError("--shape / --config: moekit ablate measures presets only for now; use --preset")
    device = arg_types.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    preset = arg_types.pick(args.preset, device, GPU_PRESET, CPU_PRESET)
    tokens = tuple(dict.fromkeys(arg_types.pick(args.tokens, device, GPU_TOKENS, CPU_TOKENS)))
    if not on_gpu and console is not None and args.preset is None:
        console.print(f"[yellow]No CUDA device: {preset} at T={','.join(map(str, tokens))} on the CPU "
                      "(Triton interpreted: interpreter timings, not GPU ones).[/yellow]", highlight=False)
    if args.graph and not on_gpu:
        raise ValueError("--graph needs a CUDA device")
    base = GPU_OPTIONS if on_gpu else CPU_OPTIONS
    options = replace(base, warmup=args.warmup if args.warmup is not None else base.warmup,
                      rep=args.rep if args.rep is not None else base.rep)
    dtype = arg_types.resolve_dtype(args.dtype, device)
    ablations = tuple(a for a in ABLATIONS if a in args.ablations)
    arg_types.check_memory([preset_layer(preset)], dtype, device,
                           [*tokens, *(BYTES_TOKENS if "bytes" in ablations else ())], fp8="fp8" in ablations)
    return AblateConfig(preset=preset, tokens=tokens, dtype=dtype, device=device, ablations=ablations,
                        modes=("eager", "graph") if arg_types.pick(args.graph, device, True, False)
                        else ("eager",), seed=args.seed, masked_max_tokens=args.masked_max_tokens,
                        ncu=args.ncu, options=options)


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        cfg = config_from_args(args, console)
        arg_types.check_out(args.out, STUDY.result_names, args.overwrite)
    except ValueError as exc:
        return usage_error(PROG, exc)
    ceilings, prov = measure_provenance(cfg.device, cfg.dtype, console, rep=cfg.options.rep,
                                        fp8="fp8" in cfg.ablations)
    out_dir = args.out or RESULTS_ROOT / f"ablate-{prov.run_id}"
    console.print(f"{cfg.preset}, T={','.join(map(str, cfg.tokens))}, "
                  f"{str(cfg.dtype).removeprefix('torch.')}, "
                  f"{' + '.join(cfg.modes)}; ablations: {', '.join(cfg.ablations)}", highlight=False)
    rows = study_rows(cfg, ceilings, prov, progress=lambda m: console.print(f"  {m}", highlight=False))
    written = STUDY.write(rows, out_dir, overwrite=args.overwrite)
    out_dir = written[0].parent
    console.print("rows: " + ", ".join(f"{n} {s}" for s, n in status_counts(rows).items()))
    console.print(f"Wrote {', '.join(p.name for p in written)} in {out_dir}", highlight=False, soft_wrap=True)
    return exit_status(PROG, rows, out_dir / CSV_NAME, console,
                       lambda r: f"T={r.tokens} {r.variant} ({r.mode})")
