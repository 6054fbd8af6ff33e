"""`moekit imbalance`: skewed routing on one GPU, in a simulated expert-parallel group, with a
capacity factor, and with hot experts replicated (the article's Step 5, extended).

For each routing scenario (`moekit.bench.scenarios`) at T tokens, every case goes through the
benchmark's own `run_case` (correctness gate, then `time_fn`, launch profile and roofline floor):

    one_gpu    every backend on the whole layer. The padded backend is skipped, before anything is
               allocated, when its (E, busiest count, *) buffers would not fit (`moekit._memory.fits`)
    ep         N simulated ranks (`moekit.placement`, `moekit.bench.simulate`): each rank's pairs
               alone on this device, one rank after the other; an "ep_step" row per placement holds
               the step time (slowest rank) and slowest / mean. Twice: the starting placement
               (contiguous by default), then with copies of hot experts in R spare slots per rank
               (DeepSeek's EPLB idea)
    capacity   padded backend with capacity factor c: pairs dropped (counted on the host and by the
               backend, which must agree) and its time: the Switch Transformer's trade-off

A study on the scaffold (`moekit.bench.study`): rows follow `ImbalanceRow` (long format,
provenance in every row) and go to results.csv; the plots and report.md are drawn from the CSV alone
(`moekit.bench.imbalance_report`; `moekit report DIR` redraws them).
"""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from rich.console import Console

from moekit._memory import MEMORY_HEADROOM, fits
from moekit.align import sort_pairs
from moekit.bench import args as arg_types
from moekit.bench.args import GPU_PRESET, RESULTS_ROOT, usage_error
from moekit.bench.ceilings import Ceilings
from moekit.bench.correctness import expected_output
from moekit.bench.imbalance_report import STUDY, ImbalanceRow, summary_table
from moekit.bench.report_cli import run_redraw
from moekit.bench.results import Provenance
from moekit.bench.roofline import traffic
from moekit.bench.runner import Measurement, Options, Weights, Workload, make_weights, run_case
from moekit.bench.scenarios import SCENARIOS, busiest_over_mean, expert_loads, make_scenario
from moekit.bench.simulate import StepTime, rank_problem
from moekit.bench.study import CSV_NAME, exit_status, measure_provenance, warn_to, with_threads
from moekit.experts import BACKENDS, moe_experts, resolve_backend
from moekit.experts.padded import capacity, workspace_bytes
from moekit.placement import PLACEMENTS, assign, rank_loads, rank_weights, replicate_hot_experts
from moekit.shapes import PRESETS, MoEShape

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)
GPU_TOKENS, CPU_TOKENS = 4096, 64
CPU_OPTIONS = Options(warmup=1, rep=5)   # the Triton interpreter takes ~0.25 s a call at T=64


@dataclass(frozen=True)
class StudyConfig:
    """What `study_rows` measures.

    Attributes:
        preset, tokens, dtype, device: the layer and batch (`layer_shape`: the shape of a layer given by
            --shape or --config, `preset` its name).
        scenarios: names for `moekit.bench.scenarios.make_scenario`; "file" replays `trace`.
        backends: one-GPU backends.
        ep_ranks: N simulated ranks (0: no EP and no replication part).
        placement: the starting placement, a key of `moekit.placement.PLACEMENTS`.
        spare_slots: R free expert slots per rank, for copies of hot experts.
        ep_backend: the backend every simulated rank runs ("auto": triton on CUDA).
        capacity_factors: for the capacity part (empty: none).
        mode: "eager", or "graph" to time CUDA-graph replays.
        memory_limit_bytes: cap on what the padded buffers may use (default: free memory).
        options: warm-up and repeats (`moekit.bench.runner.Options`).
    """

    preset: str
    tokens: int
    dtype: torch.dtype
    device: torch.device
    scenarios: tuple[str, ...] = SCENARIOS
    backends: tuple[str, ...] = field(default_factory=arg_types.default_backends)
    ep_ranks: int = 8
    placement: str = "contiguous"
    spare_slots: int = 2
    ep_backend: str = "auto"
    capacity_factors: tuple[float, ...] = CAPACITY_FACTORS
    mode: str = "eager"
    seed: int = 0
    trace: str | None = None
    memory_limit_bytes: int | None = None
    options: Options = Options()
    layer_shape: MoEShape | None = None

    @property
    def shape(self) -> MoEShape:
        """`layer_shape` (a --shape or --config layer, named `preset`), else the preset's."""
        return self.layer_shape or PRESETS[self.preset]


def padded_refusal(shape: MoEShape, cap: int, dtype: torch.dtype, device: torch.device,
                   limit_bytes: int | None = None) -> str:
    """"" when the padded backend's (E, cap, *) buffers fit in memory, else the reason they do not."""
    need = workspace_bytes(shape.num_experts, cap, shape.hidden_size, shape.intermediate_size,
                           torch.empty((), dtype=dtype).element_size())
    reason = fits(need, device, limit_bytes)
    return f"padded buffers (E={shape.num_experts}, cap={cap}, *): {reason}; not run" if reason else ""


def dropped_pairs(loads: torch.Tensor, cap: int) -> int:
    """Pairs past their expert's capacity: sum over experts of max(0, load - cap)."""
    return int((torch.as_tensor(loads) - cap).clamp_min(0).sum())


def kept_mask(topk_ids: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """bool (T, K): pairs kept at capacity `cap`: each expert's first `cap` pairs in ascending pair
    index t * K + k, as the padded backend keeps them. Ids outside [0, E) are never kept."""
    pairs = sort_pairs(topk_ids, num_experts)
    return (pairs.valid & (pairs.ranks() < cap)).view(topk_ids.shape)


def _workload(cfg: StudyConfig, shape: MoEShape, weights: Weights, x: torch.Tensor, w: torch.Tensor,
              ids: torch.Tensor) -> Workload:
    return Workload(preset=cfg.preset, shape=shape, tokens=x.shape[0], dtype=cfg.dtype, device=cfg.device,
                    weights=weights, x=x, topk_weights=w, topk_ids=ids,
                    expected=expected_output(x, weights.gate_up_proj, weights.down_proj, w, ids),
                    traffic=traffic(shape, x.shape[0], ids, cfg.dtype), experts_hit_mean=math.nan)


def _run(cfg: StudyConfig, work: Workload, backend: str, ceilings: Ceilings, factory=None) -> Measurement:
    m = run_case(work, backend, cfg.mode, ceilings, cfg.options, factory)
    if cfg.device.type == "cuda":
        if m.status != "ok":
            gc.collect()              # a failed case may hold its buffers in a traceback's frames
        torch.cuda.empty_cache()      # an out-of-memory case must not starve the next one
    return m


def study_rows(cfg: StudyConfig, ceilings: Ceilings, prov: Provenance,
               progress: Callable[[str], None] | None = None) -> list[ImbalanceRow]:
    """Measure every part for every scenario (see the module docstring)."""
    s = cfg.shape
    weights = make_weights(s, cfg.dtype, cfg.device, cfg.seed)
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.tokens, s.hidden_size, generator=g, device=cfg.device).to(cfg.dtype)
    head = {**asdict(prov), "preset": cfg.preset, "num_experts": s.num_experts, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "top_k": s.top_k, "tokens": cfg.tokens,
            "seed": cfg.seed, "mode": cfg.mode}
    rows: list[ImbalanceRow] = []
    for name in cfg.scenarios:
        w, ids = make_scenario(name, cfg.tokens, s.num_experts, s.top_k, seed=cfg.seed,
                               hidden_size=s.hidden_size, trace=cfg.trace, device=cfg.device)
        loads = expert_loads(ids, s.num_experts).cpu()
        base = {**head, "scenario": name, "busiest_over_mean": busiest_over_mean(loads)}
        if progress:
            progress(f"{name}: busiest / mean {base['busiest_over_mean']:.2f}")
        work = _workload(cfg, s, weights, x, w, ids)
        pairs = int(loads.sum())
        for b in cfg.backends:
            row = {**base, "experiment": "one_gpu", "backend": b, "pairs": pairs}
            reason = (padded_refusal(s, int(loads.max()), cfg.dtype, cfg.device, cfg.memory_limit_bytes)
                      if b == "padded" else "")
            if reason:
                rows.append(ImbalanceRow(**row, status="skipped", reason=reason))
                continue
            rows.append(ImbalanceRow(**row, **_run(cfg, work, b, ceilings).columns()))
        if cfg.ep_ranks:
            rows += ep_rows(cfg, base, weights, work, loads, ceilings, progress)
        rows += capacity_rows(cfg, base, work, loads, ceilings)
    return rows


def capacity_rows(cfg: StudyConfig, base: dict, work: Workload, loads: torch.Tensor,
                  ceilings: Ceilings) -> list[ImbalanceRow]:
    s, ids = cfg.shape, work.topk_ids
    rows = []
    for c in cfg.capacity_factors:
        cap = capacity(ids.numel(), s.num_experts, c)
        host_dropped = dropped_pairs(loads, cap)
        row = {**base, "experiment": "capacity", "backend": "padded", "capacity_factor": c, "capacity": cap,
               "dropped": host_dropped, "pairs": int(loads.sum()),
               "dropped_frac": host_dropped / max(1, int(loads.sum()))}
        reason = padded_refusal(s, cap, cfg.dtype, cfg.device, cfg.memory_limit_bytes)
        if reason:
            rows.append(ImbalanceRow(**row, status="skipped", reason=reason))
            continue
        # The backend must equal the reference with the dropped pairs removed.
        capped = replace(work, expected=expected_output(
            work.x, work.weights.gate_up_proj, work.weights.down_proj, work.topk_weights,
            torch.where(kept_mask(ids, s.num_experts, cap), ids, -1)))
        stats: dict = {}

        def factory(wk: Workload, c=c, stats=stats):
            wt = wk.weights
            return lambda: moe_experts(wk.x, wt.gate_up_proj, wt.down_proj, wk.topk_weights, wk.topk_ids,
                                       backend="padded", capacity_factor=c, stats=stats)

        cols = _run(cfg, capped, "padded", ceilings, factory).columns()
        if cols["status"] == "ok" and int(stats["dropped"]) != host_dropped:
            got = int(stats["dropped"])
            cols = {**cols, "status": "failed", "median_ms": math.nan,
                    "reason": f"the backend dropped {got} pairs, the host counts {host_dropped}"}
        rows.append(ImbalanceRow(**row, **cols))
    return rows


def ep_rows(cfg: StudyConfig, base: dict, weights: Weights, work: Workload, loads: torch.Tensor,
            ceilings: Ceilings, progress: Callable[[str], None] | None = None) -> list[ImbalanceRow]:
    """Simulated EP: every rank's share of the layer run alone, then the step = the slowest rank."""
    s = cfg.shape
    backend = resolve_backend(cfg.ep_backend, cfg.device, s.hidden_size, s.intermediate_size,
                              work.x.element_size())
    start = PLACEMENTS[cfg.placement](s.num_experts, cfg.ep_ranks, cfg.spare_slots)
    rows = []
    for label, placement in ((cfg.placement, start), ("replicated", replicate_hot_experts(loads, start))):
        a = assign(work.topk_ids, placement)
        predicted = rank_loads(loads, placement)
        head = {**base, "experiment": "ep", "backend": backend, "placement": label,
                "ep_ranks": cfg.ep_ranks, "spare_slots": cfg.spare_slots, "replicas": placement.num_replicas}
        per_rank, bad, bad_status = [], [], "ok"
        for r in range(cfg.ep_ranks):
            gate_up, down = rank_weights(weights.gate_up_proj, weights.down_proj, placement, r)
            p = rank_problem(work.x, work.topk_weights, a, r, (gate_up, down))
            shape_r = MoEShape(len(placement.slots[r]), s.hidden_size, s.intermediate_size,
                               p.topk_ids.shape[1])
            rank_work = _workload(cfg, shape_r, Weights(weights.router_weight, gate_up, down),
                                  p.hidden_states, p.topk_weights, p.topk_ids)

            def factory(wk: Workload):
                wt = wk.weights
                return lambda: moe_experts(wk.x, wt.gate_up_proj, wt.down_proj, wk.topk_weights,
                                           wk.topk_ids, backend=backend, ignore_invalid_ids=True)

            cols = _run(cfg, rank_work, backend, ceilings, factory).columns()
            if cols["status"] == "ok" and p.num_pairs != predicted[r]:
                cols = {**cols, "status": "failed", "median_ms": math.nan,
                        "reason": f"rank runs {p.num_pairs} pairs, the placement predicts {predicted[r]}"}
            if cols["status"] != "ok":
                bad.append(f"rank {r} {cols['status']}: {cols['reason']}")
                bad_status = bad_status if bad_status in ("failed", "error") else cols["status"]
            per_rank.append(cols["median_ms"])
            rows.append(ImbalanceRow(**head, **cols, rank=r, rank_experts=len(placement.slots[r]),
                                     rank_tokens=int(p.token_idx.numel()), pairs=p.num_pairs))
            del p, rank_work, gate_up, down
        mean_pairs = sum(predicted) / cfg.ep_ranks
        step = {**head, "experiment": "ep_step", "pairs": sum(predicted),
                "busiest_rank_pairs": max(predicted),
                "pairs_busiest_over_mean": max(predicted) / mean_pairs if mean_pairs else 1.0}
        if bad:  # no step time without every rank's time; the worst rank status is the step's
            rows.append(ImbalanceRow(**step, status=bad_status, reason="; ".join(bad)))
            continue
        st = StepTime(tuple(per_rank))
        rows.append(ImbalanceRow(**step, status="ok", step_ms=st.step_ms, mean_ms=st.mean_ms,
                                 slowest_over_mean=st.slowest_over_mean, slowest_rank=st.slowest_rank))
        if progress:
            progress(f"  EP {label}: step {st.step_ms:.3g} ms, slowest / mean {st.slowest_over_mean:.2f}")
    return rows


PROG = "moekit imbalance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg_types.add_preset(p)
    p.add_argument("--tokens", type=arg_types.token_count, default=None,
                   help=f"tokens T (default: {GPU_TOKENS} on a GPU, {CPU_TOKENS} on the CPU)")
    p.add_argument("--scenarios", type=arg_types.csv_list, default=list(SCENARIOS),
                   help=f"routing scenarios (default: {','.join(SCENARIOS)}); also hot-<n>, zipf-<s>")
    p.add_argument("--trace", type=arg_types.existing_path, default=None,
                   help="a saved routing (.pt or .npy of (T, K) ids) to replay as scenario 'file'")
    default = arg_types.default_backends()
    arg_types.add_backends(p, lambda: BACKENDS, list(default),
                           f"one-device experts backends, comma-separated (default: {','.join(default)})")
    p.add_argument("--ep", type=arg_types.int_range(0), default=None,
                   help="simulated expert-parallel ranks N, 0 to skip (default: min(8, E/2))")
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default="contiguous",
                   help="where each rank's experts come from before replication (default: contiguous)")
    p.add_argument("--spare-slots", type=arg_types.int_range(0), default=None,
                   help="free expert slots per rank for copies of hot experts (default: E/N/8, at least 1)")
    p.add_argument("--ep-backend", default="auto",
                   help="backend of each simulated rank (default: triton on CUDA; grouped_mm or loop "
                        "on the CPU)")
    p.add_argument("--capacity-factors", type=arg_types.positive_float_list, default=list(CAPACITY_FACTORS),
                   help="capacity factors for the padded backend, finite and > 0 "
                        f"(default: {','.join(map(str, CAPACITY_FACTORS))})")
    arg_types.add_dtype(p)
    arg_types.add_graph(p, "time every case as CUDA-graph replays instead of eager calls (default: off)")
    p.add_argument("--memory-limit-gb", type=arg_types.positive_float, default=None,
                   help="the padded backend is not run when its buffers would exceed this (default: "
                        f"moekit's memory-fit rule, {MEMORY_HEADROOM * 100:.0f}%% of free memory)")
    arg_types.add_timing(p, "timed calls per case (default: time_fn's on a GPU, "
                            f"{CPU_OPTIONS.rep} on the CPU)", "warm-up calls per case")
    arg_types.add_device(p)
    arg_types.add_threads(p)
    arg_types.add_seed(p, "the weights, tokens and scenarios")
    arg_types.add_out(p, "imbalance-<UTC timestamp>", STUDY.result_names)
    p.add_argument("--redraw", type=arg_types.existing_path, default=None, metavar="DIR",
                   help=argparse.SUPPRESS)  # the older spelling of `moekit report DIR`


def config_from_args(args: argparse.Namespace, console: Console | None = None) -> StudyConfig:
    """Resolve the defaults that depend on the machine; ValueError on a bad combination."""
    device = arg_types.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    layer = arg_types.resolve_layer(args, device, warn_to(console) if console is not None else None)
    preset, shape = layer.name, layer.shape
    tokens = arg_types.pick(args.tokens, device, GPU_TOKENS, CPU_TOKENS)
    if not on_gpu and console is not None and (not arg_types.layer_given(args) or args.tokens is None):
        console.print(f"[yellow]No CUDA device: {preset} at T={tokens} on the CPU (the GPU default is "
                      f"{GPU_PRESET} at T={GPU_TOKENS}); Triton runs interpreted.[/yellow]", soft_wrap=True)
    scenarios = list(dict.fromkeys(args.scenarios))
    if args.trace is not None and "file" not in scenarios:
        scenarios.append("file")
    for s in scenarios:  # fail on a bad name or trace now, not after minutes of measuring
        make_scenario(s, 1, shape.num_experts, shape.top_k, trace=args.trace)
    for b in args.backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r}; expected from {BACKENDS}")
    try:
        resolve_backend(args.ep_backend, device)  # ValueError on an unknown name
    except ValueError as exc:
        raise ValueError(f"--ep-backend: {exc}") from None
    ep = args.ep if args.ep is not None else min(8, max(1, shape.num_experts // 2))
    if ep > shape.num_experts:
        raise ValueError(f"--ep {ep}: more ranks than the {shape.num_experts} experts of {preset}")
    spare = args.spare_slots if args.spare_slots is not None else \
        max(1, math.ceil(shape.num_experts / max(ep, 1)) // 8)
    if args.graph and not on_gpu:
        raise ValueError("--graph needs a CUDA device")
    base = CPU_OPTIONS if not on_gpu else Options()
    options = Options(warmup=args.warmup if args.warmup is not None else base.warmup,
                      rep=args.rep if args.rep is not None else base.rep)
    limit = None if args.memory_limit_gb is None else int(args.memory_limit_gb * 1e9)
    dtype = arg_types.resolve_dtype(args.dtype, device)
    arg_types.check_memory([layer], dtype, device, [tokens])
    return StudyConfig(preset=preset, tokens=tokens, dtype=dtype,
                       device=device, scenarios=tuple(scenarios),
                       backends=tuple(dict.fromkeys(args.backends)),
                       ep_ranks=ep, placement=args.placement, spare_slots=spare, ep_backend=args.ep_backend,
                       capacity_factors=tuple(args.capacity_factors), mode="graph" if args.graph else "eager",
                       seed=args.seed, trace=str(args.trace) if args.trace else None,
                       memory_limit_bytes=limit, options=options, layer_shape=shape)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.redraw is not None:
        return run_redraw(PROG, args.redraw, args.out, STUDY)
    try:
        cfg = config_from_args(args, console)
        arg_types.check_out(args.out, STUDY.result_names, args.overwrite)
    except ValueError as exc:
        return usage_error(PROG, exc)
    with arg_types.cpu_threads(cfg.device, args.threads) as threads:
        ceilings, prov = measure_provenance(cfg.device, cfg.dtype, console)
        console.print(f"{cfg.preset}, T={cfg.tokens}, {str(cfg.dtype).removeprefix('torch.')}, {cfg.mode}; "
                      f"EP {cfg.ep_ranks} ranks with {cfg.spare_slots} spare slot(s) each", soft_wrap=True)
        rows = study_rows(cfg, ceilings, prov, progress=lambda m: console.print(m, highlight=False))
    rows = with_threads(rows, threads)
    out_dir = args.out or RESULTS_ROOT / f"imbalance-{prov.run_id}"
    written = STUDY.write(rows, out_dir, overwrite=args.overwrite)
    out_dir = written[0].parent
    console.print(summary_table(rows))
    console.print(f"Wrote {', '.join(p.name for p in written)} in {out_dir}", highlight=False)
    return exit_status(PROG, rows, out_dir / CSV_NAME, console,
                       lambda r: f"{r.scenario} {r.experiment} {r.backend} {r.placement}")
