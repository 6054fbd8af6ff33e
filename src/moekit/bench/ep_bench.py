"""`moekit ep-bench`: expert parallelism over torch.distributed, each rank's time split into phases.

    torchrun --nproc-per-node N -m moekit ep-bench [--preset P --tokens T ...]   nccl on CUDA, gloo on CPU
    moekit ep-bench --simulate N      one process, N virtual ranks (`moekit.bench.simulate`, one device)
    moekit report DIR                 the plot and report again, from the results CSV

For every routing scenario (`moekit.bench.scenarios`, drawn for all N·T tokens, then rank r takes
rows [r·T, (r+1)·T)) and placement (contiguous; with --spare-slots S also hot experts replicated into
S spare slots per rank, planned from the scenario's loads), each rank first checks its output
against the fp32 reference (`moekit.bench.correctness`; a failure on any rank withholds the
timings), then times --rep iterations (after --warmup untimed ones) of:

    barrier -> dispatch (plan, count all-to-all and its host sync, pack, row all-to-all)
            -> experts (moe_experts on the received rows)
            -> wait (barrier: idle until the slowest rank's experts are done)
            -> combine (reverse all-to-all, per-token sum)

Step time of an iteration = the slowest rank's dispatch + experts + wait + combine. Every case also
times the whole call with no sync inside (`step_plain`: barrier, the call, device sync; the slowest
rank's), the step as a model runs it. --overlap-chunks 1,2,4 runs the normal mode once per value
(`moekit.parallel.overlap`): with n > 1 the synced phases are summed over the chunks (serialised by
the syncs) and step_plain is the overlapped call. A study on the
scaffold (`moekit.bench.study`): rank 0 writes the rows (`moekit.bench.ep_report.EPRow`, with
`moekit bench`'s provenance) to results.csv, then the plot and report.md drawn from them (--append
adds the rows to the folder's results.csv instead). NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before the group starts. Errors are printed on stdout
(every rank's console), as the distributed tests expect.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from moekit.bench import args as arg_types
from moekit.bench.args import RESULTS_ROOT
from moekit.bench.correctness import Check, expected_output
from moekit.bench.ep_report import (
    A2A_PEAK,
    COMBINE_STEPS,
    DISPATCH_STEPS,
    GRAPH,
    MODES,
    PHASES,
    PLAIN,
    SINGLE,
    STEP,
    STEPS,
    STUDY,
    EPRow,
)
from moekit.bench.results import Provenance
from moekit.bench.runner import make_weights
from moekit.bench.scenarios import SCENARIOS, busiest_over_mean, expert_loads, make_scenario
from moekit.bench.simulate import SimulatedTimes, shard_experts, simulate_ep
from moekit.bench.study import (
    CSV_NAME,
    exit_status,
    find_results,
    measure_provenance,
    redraw,
    warn_to,
    with_threads,
)
from moekit.bench.timing import TimingStats, sync
from moekit.experts import BACKENDS, moe_experts, resolve_backend
from moekit.graphs import NotCapturable, capture_graph
from moekit.parallel import disable_nvls
from moekit.parallel.dispatch import combine, dispatch, plan_routes, run_local_experts
from moekit.parallel.ep import ep_moe_experts
from moekit.parallel.low_latency import (
    low_latency_combine,
    low_latency_dispatch,
    low_latency_experts,
    low_latency_moe,
)
from moekit.parallel.overlap import overlapped_moe
from moekit.placement import Placement, contiguous_placement, rank_weights, replicate_hot_experts
from moekit.shapes import MoEShape

PROG = "moekit ep-bench"
GPU_TOKENS, CPU_TOKENS = 4096, 64
GPU_WARMUP, CPU_WARMUP = 10, 3
GPU_REP, CPU_REP = 50, 10
LL_GPU_TOKENS, LL_CPU_TOKENS = (1, 4, 16, 64, 128), (1, 4)
A2A_GPU_MIB, A2A_CPU_MIB = (16, 256), (1,)
GRAPH_REPLAYS = 20  # a graph sample: this many back-to-back replays (decode runs layer after layer)


def add_arguments(p: argparse.ArgumentParser) -> None:
    arg_types.add_preset(p)
    p.add_argument("--tokens", type=arg_types.token_count, default=None,
                   help=f"tokens per rank (default: {GPU_TOKENS} on GPUs, {CPU_TOKENS} on the CPU)")
    p.add_argument("--scenarios", type=arg_types.csv_list, default=",".join(SCENARIOS),
                   help="routing scenarios, comma-separated (`moekit.bench.scenarios.make_scenario` names)")
    p.add_argument("--trace", type=arg_types.existing_path, default=None,
                   help="routing trace (.pt or .npy) for the scenario 'file' (`moekit.bench.scenarios`)")
    p.add_argument("--backends", type=arg_types.one_name(lambda: ("auto", *BACKENDS), "backend"),
                   default="auto", help="the experts backend every rank runs (one name; default: auto)")
    p.add_argument("--backend", type=arg_types.one_name(lambda: ("auto", *BACKENDS), "backend"),
                   dest="backends", help=argparse.SUPPRESS)  # the older spelling
    arg_types.add_dtype(p)
    p.add_argument("--spare-slots", type=arg_types.int_range(0), default=0,
                   help="also run with hot experts replicated into this many spare slots per rank")
    arg_types.add_timing(p, f"timed iterations (default: {CPU_REP} CPU, {GPU_REP} GPU)",
                         f"untimed iterations first (default: {CPU_WARMUP} CPU, {GPU_WARMUP} GPU)",
                         rep_aliases=("--iters",))
    p.add_argument("--modes", type=arg_types.csv_list, default=None,
                   help="EP modes, comma-separated: normal, low_latency (default: both on GPUs, normal on "
                        "the CPU)")
    p.add_argument("--ll-tokens", type=arg_types.token_counts, default=None,
                   help="low_latency: tokens per rank, each its own case with capacity = tokens (default: "
                        f"{','.join(map(str, LL_GPU_TOKENS))} on GPUs, {','.join(map(str, LL_CPU_TOKENS))} "
                        "on the CPU)")
    p.add_argument("--overlap-chunks", type=arg_types.int_list(1), default="1",
                   help="normal mode: overlap_chunks values, comma-separated, each its own case (token "
                        "chunks whose all-to-alls overlap the experts; default: 1, no overlap)")
    p.add_argument("--a2a-mib", type=arg_types.int_list(1), default=None,
                   help="all-to-all peak: MiB each rank sends in a plain equal-split all-to-all "
                        f"(default: {','.join(map(str, A2A_GPU_MIB))} on GPUs, "
                        f"{','.join(map(str, A2A_CPU_MIB))} on the CPU)")
    p.add_argument("--simulate", type=arg_types.int_range(1), default=None, metavar="N",
                   help="no process group: N virtual ranks in this process, on one device")
    arg_types.add_out(p, "ep-<UTC timestamp>", STUDY.result_names,
                      f" (or --append: add the rows to its {CSV_NAME})")
    p.add_argument("--append", action="store_true",
                   help=f"add this run's rows to --out's {CSV_NAME} (an ep-bench CSV); the plot and report "
                        "show the latest run")
    p.add_argument("--redraw", type=arg_types.existing_path, default=None, metavar="CSV",
                   help=argparse.SUPPRESS)  # the older spelling of `moekit report`
    p.add_argument("--timeout", type=arg_types.int_range(1), default=600,
                   help="seconds before a stuck collective fails")
    arg_types.add_threads(p)
    arg_types.add_seed(p)


@dataclass(frozen=True)
class Config:
    preset: str
    shape: MoEShape
    tokens: int
    scenarios: tuple[str, ...]
    trace: Path | None
    dtype: torch.dtype
    backend: str
    spare_slots: int
    warmup: int
    iters: int
    seed: int
    device: torch.device
    modes: tuple[str, ...] = ("normal",)
    ll_tokens: tuple[int, ...] = LL_CPU_TOKENS
    a2a_mib: tuple[int, ...] = ()
    overlap_chunks: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class Group:
    """The process group this run measures (rank 0 of a simulated run is the only process)."""

    rank: int
    world: int
    dist_backend: str  # "nccl", "gloo", or "" when simulated
    device: torch.device


def _config(args: argparse.Namespace, device: torch.device, console: Console | None = None) -> Config:
    layer = arg_types.resolve_layer(args, device, warn_to(console) if console is not None else None)
    preset, shape = layer.name, layer.shape
    tokens = arg_types.pick(args.tokens, device, GPU_TOKENS, CPU_TOKENS)
    scenarios = tuple(args.scenarios)
    for name in scenarios:  # fail on a bad name or trace before any group-wide work
        make_scenario(name, 1, shape.num_experts, shape.top_k, trace=args.trace)
    if tokens < 1 or args.spare_slots < 0 or not scenarios:
        raise ValueError("--tokens must be >= 1, --spare-slots >= 0, --scenarios not empty")
    dtype = arg_types.resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backends, device, shape.hidden_size, shape.intermediate_size,
                              torch.empty((), dtype=dtype).element_size())
    warmup = arg_types.pick(args.warmup, device, GPU_WARMUP, CPU_WARMUP)
    iters = arg_types.pick(args.rep, device, GPU_REP, CPU_REP)
    if warmup < 0 or iters < 1:
        raise ValueError("--warmup must be >= 0 and --rep >= 1")
    modes = tuple(getattr(args, "modes", None) or (MODES if device.type == "cuda" else ("normal",)))
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes: unknown mode(s) {', '.join(bad)}; expected some of {', '.join(MODES)}")
    ll_tokens = tuple(arg_types.pick(getattr(args, "ll_tokens", None), device, LL_GPU_TOKENS, LL_CPU_TOKENS))
    a2a_mib = tuple(arg_types.pick(getattr(args, "a2a_mib", None), device, A2A_GPU_MIB, A2A_CPU_MIB))
    overlap_chunks = tuple(dict.fromkeys(getattr(args, "overlap_chunks", None) or (1,)))
    arg_types.check_memory([layer], dtype, device, [tokens])
    return Config(preset, shape, tokens, scenarios, args.trace, dtype, backend, args.spare_slots, warmup,
                  iters, args.seed, device, modes, ll_tokens, a2a_mib, overlap_chunks)


def _routing(cfg: Config, name: str, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = cfg.shape
    return make_scenario(name, world * cfg.tokens, s.num_experts, s.top_k, seed=cfg.seed,
                         hidden_size=s.hidden_size, trace=cfg.trace, device=cfg.device)


def _tokens(cfg: Config, rank: int) -> torch.Tensor:
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed * 100_003 + 1 + rank)
    return torch.randn(cfg.tokens, cfg.shape.hidden_size, generator=g, device=cfg.device).to(cfg.dtype)


def _placements(cfg: Config, ids: torch.Tensor, world: int) -> list[tuple[str, Placement]]:
    e = cfg.shape.num_experts
    out = [("contiguous", contiguous_placement(e, world))]
    if cfg.spare_slots:
        start = contiguous_placement(e, world, cfg.spare_slots)
        out.append(("replicated", replicate_hot_experts(expert_loads(ids, e).cpu(), start)))
    return out


def _base(prov: Provenance, cfg: Config, grp: Group, mode: str, scenario: str, expert_skew: float,
          label: str, placement: Placement) -> dict:
    s = cfg.shape
    return {**asdict(prov), "mode": mode, "dist_backend": grp.dist_backend, "world_size": grp.world,
            "preset": cfg.preset, "num_experts": s.num_experts, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "top_k": s.top_k, "tokens_per_rank": cfg.tokens,
            "backend": cfg.backend, "scenario": scenario, "expert_busiest_over_mean": expert_skew,
            "placement": label, "replicas": placement.num_replicas}


class Clock:
    """A `moekit.parallel.dispatch.Probe` that syncs the device and records each step's ms (summed
    over the calls with one name: a chunked call marks each step once per chunk); after "experts" a
    barrier, timed as "wait" (collective there)."""

    def __init__(self, device: torch.device):
        self.device, self.ms = device, {}

    def start(self) -> None:
        sync(self.device)
        self.ms, self.last = {}, time.perf_counter()

    def __call__(self, name: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.ms[name], self.last = self.ms.get(name, 0.0) + (now - self.last) * 1e3, now
        if name == "experts":   # then "wait": idle until the slowest rank's experts are done
            dist.barrier()
            self("wait")


def timed_sample(clock: Clock, steps: tuple[str, ...]) -> list[float]:
    """One iteration's columns: the PHASES (dispatch and combine = the sums of their steps), then
    the steps (0 for a step the mode does not have)."""
    ms = clock.ms
    dispatch = sum(ms.get(k, 0.0) for k in DISPATCH_STEPS)
    combine = sum(ms.get(k, 0.0) for k in COMBINE_STEPS)
    return [dispatch, ms["experts"], ms["wait"], combine, *(ms.get(k, 0.0) for k in steps)]


def _rows(base: dict, per_rank: list[dict], phases: tuple[str, ...],
          step_phases: int | None = None) -> list[EPRow]:
    """EPRows from each rank's {"check", "samples" (iters x phases ms), "rows_sent", ...}; the step
    of an iteration is the slowest rank's sum of its first `step_phases` columns (default: all).
    A rank's optional "bytes" {phase: bytes sent to other ranks} fills bytes_sent."""
    pairs = [p["pairs_recv"] for p in per_rank]
    mean = sum(pairs) / len(pairs)
    base = {**base, "rank_busiest_over_mean": max(pairs) / mean if mean else 1.0}
    checks: list[Check] = [p["check"] for p in per_rank]
    failed = next((c for c in checks if not c.ok), None)
    status, reason = ("failed", failed.reason) if failed else ("ok", "")
    max_err = max(c.max_err for c in checks)
    tol = min(c.tol for c in checks)
    nan = float("nan")
    untimed = {"median_ms": nan, "p20_ms": nan, "p80_ms": nan, "n_rep": 0}
    k = len(phases) if step_phases is None else step_phases

    def stats(samples: list[float]) -> dict:
        if failed or not samples:
            return untimed
        st = TimingStats.from_samples(samples)
        return {"median_ms": st.median_ms, "p20_ms": st.p20_ms, "p80_ms": st.p80_ms, "n_rep": st.n}

    rows = []
    for rank, p in enumerate(per_rank):
        for j, phase in enumerate(phases):
            col = [] if failed else [it[j] for it in p["samples"]]
            rows.append(EPRow(**base, rank=rank, phase=phase, status=status, reason=reason,
                              max_err=p["check"].max_err, tol=p["check"].tol, **stats(col),
                              rows_sent=p["rows_sent"], rows_recv=p["rows_recv"],
                              pairs_recv=p["pairs_recv"], bytes_sent=p.get("bytes", {}).get(phase)))
    iters = 0 if failed else len(per_rank[0]["samples"])
    steps = [max(sum(p["samples"][i][:k]) for p in per_rank) for i in range(iters)]
    busiest = max(range(len(per_rank)), key=lambda r: pairs[r])
    step_row = partial(EPRow, **base, rank=STEP, status=status, reason=reason, max_err=max_err, tol=tol,
                       rows_sent=per_rank[busiest]["rows_sent"], rows_recv=per_rank[busiest]["rows_recv"],
                       pairs_recv=pairs[busiest])
    rows.append(step_row(phase="step", **stats(steps)))
    # Whole-call timings every rank took (plain, CUDA graphs): the slowest rank's, per iteration.
    for name in (PLAIN, GRAPH, SINGLE):
        whole = [p.get(name, []) for p in per_rank]
        if all(whole):
            rows.append(step_row(phase=name, **stats([max(w[i] for w in whole)
                                                      for i in range(len(whole[0]))])))
        elif any(p.get(name + "_error") for p in per_rank):
            reason_ = next(p[name + "_error"] for p in per_rank if p.get(name + "_error"))
            rows.append(replace(step_row(phase=name, **untimed), status="failed", reason=reason_))
    return rows


def _cross_bytes(counts: list[int], rank: int, row_bytes: int) -> int:
    """Bytes of the rows in `counts` (per rank) that leave this rank."""
    return (sum(counts) - counts[rank]) * row_bytes


def _measure_rank(cfg: Config, grp: Group, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                  placement: Placement, full: tuple[torch.Tensor, torch.Tensor], chunks: int = 1) -> dict:
    """This rank's check and timings for one scenario, placement and overlap_chunks (collective),
    normal mode: the steps synced and timed, and the whole call plain."""
    gate_up, down = rank_weights(*full, placement, grp.rank)
    tables = placement.copy_table(cfg.device)
    layer = partial(ep_moe_experts, x, gate_up, down, w, ids, placement=placement, backend=cfg.backend,
                    tables=tables, overlap_chunks=chunks)
    with torch.inference_mode():
        check = expected_output(x, *full, w, ids).check(layer())
        tokens, handle = dispatch(x, w, ids, placement, tables=tables)    # what travels (any chunks)
        row_bytes = x.shape[1] * x.element_size()
        meta_bytes = 2 * ids.shape[1] * 4
        info = {"check": check, "rows_sent": sum(handle.send_counts),
                "rows_recv": sum(tokens.recv_counts), "pairs_recv": int((tokens.topk_ids >= 0).sum()),
                "bytes": {"rows": _cross_bytes(handle.send_counts, grp.rank, row_bytes + meta_bytes),
                          "back": _cross_bytes(handle.recv_counts, grp.rank, row_bytes)}}
        samples = []
        if _all_ok(check.ok, cfg.device):
            if chunks == 1:
                steps = _phases(partial(dispatch, x, w, ids, placement, tables=tables),
                                partial(run_local_experts, gate_up_proj=gate_up, down_proj=down,
                                        backend=cfg.backend), combine)
            else:
                steps = partial(overlapped_moe, x, gate_up, down, w, ids, placement=placement, chunks=chunks,
                                backend=cfg.backend, tables=tables)
            samples = _time_steps(cfg, steps)
            info[PLAIN] = _time_calls(cfg, layer)
    return {**info, "samples": samples}


def _phases(send, compute, back):
    """send(probe) -> (tokens, handle), compute(tokens) -> partial, back(partial, handle, probe) as
    one call taking the probe, which also marks "experts"."""
    def call(probe):
        tokens, handle = send(probe=probe)
        partial_ = compute(tokens)
        probe("experts")
        return back(partial_, handle, probe=probe)
    return call


def _time_steps(cfg: Config, call) -> list[list[float]]:
    """Per iteration (after cfg.warmup untimed): barrier, call(probe=clock), each step synced and
    timed, a barrier after the experts (`Clock`; `timed_sample` columns). Collective."""
    clock = Clock(cfg.device)
    samples = []
    for i in range(cfg.warmup + cfg.iters):
        dist.barrier()
        clock.start()
        call(probe=clock)
        if i >= cfg.warmup:
            samples.append(timed_sample(clock, STEPS))
    return samples


def _time_calls(cfg: Config, fn, repeat: int = 1) -> list[float]:
    """ms per call of fn(), no sync inside: each sample `repeat` calls back to back from a barrier
    and a device sync to a device sync, after cfg.warmup untimed samples (collective)."""
    out = []
    for i in range(cfg.warmup + cfg.iters):
        dist.barrier()
        sync(cfg.device)
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync(cfg.device)
        if i >= cfg.warmup:
            out.append((time.perf_counter() - t0) * 1e3 / repeat)
    return out


def _all_ok(ok: bool, device: torch.device) -> bool:
    """True on every rank when `ok` is true on every rank (collective)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _distributed_rows(cfg: Config, grp: Group, prov: Provenance | None, console: Console) -> list[EPRow]:
    weights = make_weights(cfg.shape, cfg.dtype, cfg.device, cfg.seed)
    full = (weights.gate_up_proj, weights.down_proj)
    rows: list[EPRow] = []
    if cfg.a2a_mib:
        rows += _a2a_peak_rows(cfg, grp, prov, console)
    if "normal" in cfg.modes:
        rows += _normal_rows(cfg, grp, prov, console, full)
    if "low_latency" in cfg.modes:
        for tokens in cfg.ll_tokens:
            rows += _low_latency_rows(replace(cfg, tokens=tokens), grp, prov, console, full)
    return rows


def _normal_rows(cfg: Config, grp: Group, prov: Provenance | None, console: Console,
                 full: tuple[torch.Tensor, torch.Tensor]) -> list[EPRow]:
    x = _tokens(cfg, grp.rank)
    mine = slice(grp.rank * cfg.tokens, (grp.rank + 1) * cfg.tokens)
    rows: list[EPRow] = []
    for name in cfg.scenarios:
        w_all, ids_all = _routing(cfg, name, grp.world)
        skew = busiest_over_mean(expert_loads(ids_all, cfg.shape.num_experts).cpu())
        for (label, placement), chunks in itertools.product(_placements(cfg, ids_all, grp.world),
                                                            cfg.overlap_chunks):
            mine_info = _measure_rank(cfg, grp, x, w_all[mine], ids_all[mine], placement, full, chunks)
            gathered: list[dict | None] = [None] * grp.world
            dist.all_gather_object(gathered, mine_info)
            if grp.rank == 0:
                base = _base(prov, cfg, grp, "distributed", name, skew, label, placement)
                new = [replace(r, overlap_chunks=chunks)
                       for r in _rows(base, gathered, (*PHASES, *STEPS), len(PHASES))]
                rows += new
                at = {r.phase: r for r in new if r.rank == STEP}
                plain = at[PLAIN].median_ms if PLAIN in at else math.nan
                console.print(f"  normal {name:<14} {label:<10} chunks {chunks:<2} step "
                              f"{at['step'].median_ms:8.3f} ms  plain {plain:8.3f} ms  ranks busiest/mean "
                              f"{at['step'].rank_busiest_over_mean:.2f}  {at['step'].status}")
    return rows


def _graph_timings(cfg: Config, name: str, fn) -> dict:
    """{name: samples} when every rank captured `fn` in a CUDA graph, else {name + "_error": why}
    (collective: the ranks agree before any replay, so none waits in a collective alone)."""
    if cfg.device.type != "cuda":
        return {}
    try:
        graph, _ = capture_graph(fn, cfg.device)
        error = ""
    except NotCapturable as exc:
        graph, error = None, str(exc).splitlines()[0][:200]
    if not _all_ok(not error, cfg.device):
        return {name + "_error": error or "another rank could not capture"}
    return {name: _time_calls(cfg, graph.replay, GRAPH_REPLAYS)}


def _low_latency_rows(cfg: Config, grp: Group, prov: Provenance | None, console: Console,
                      full: tuple[torch.Tensor, torch.Tensor]) -> list[EPRow]:
    """The low-latency mode at cfg.tokens per rank, capacity = cfg.tokens (nothing can overflow a
    destination): eager with its steps timed, the whole call replayed from a CUDA graph, and the
    same tokens through all experts on this rank's GPU alone (a graph too)."""
    x = _tokens(cfg, grp.rank)
    mine = slice(grp.rank * cfg.tokens, (grp.rank + 1) * cfg.tokens)
    cap = cfg.tokens
    rows: list[EPRow] = []
    for name in cfg.scenarios:
        w_all, ids_all = _routing(cfg, name, grp.world)
        w, ids = w_all[mine], ids_all[mine]
        skew = busiest_over_mean(expert_loads(ids_all, cfg.shape.num_experts).cpu())
        for label, placement in _placements(cfg, ids_all, grp.world):
            gate_up, down = rank_weights(*full, placement, grp.rank)
            tables = placement.copy_table(cfg.device)
            layer = partial(low_latency_moe, x, gate_up, down, w, ids, placement=placement, capacity=cap,
                            tables=tables)
            with torch.inference_mode():
                stats: dict = {}
                check = expected_output(x, *full, w, ids).check(layer(stats=stats))
                counts = stats["recv_counts"].tolist()
                dropped = int(stats["dropped"])
                if dropped:  # capacity = tokens per rank: a destination's block cannot overflow
                    check = replace(check, ok=False, reason=f"{dropped} pairs dropped")
                row_bytes = x.shape[1] * x.element_size()
                info = {"check": check, "rows_sent": grp.world * cap, "rows_recv": sum(counts),
                        "pairs_recv": int(stats["expert_counts"].sum()),
                        "bytes": {"rows": (grp.world - 1) * cap * (row_bytes + (2 * ids.shape[1] + 1) * 4),
                                  "back": (grp.world - 1) * cap * row_bytes}}
                samples = []
                if _all_ok(check.ok, cfg.device):
                    send = partial(low_latency_dispatch, x, w, ids, placement, cap, tables=tables)
                    compute = partial(low_latency_experts, gate_up_proj=gate_up, down_proj=down)
                    samples = _time_steps(cfg, _phases(send, compute, low_latency_combine))
                    info[PLAIN] = _time_calls(cfg, layer)
                    info.update(_graph_timings(cfg, GRAPH, layer))
                    info.update(_graph_timings(cfg, SINGLE, partial(
                        moe_experts, x, *full, w, ids, backend=cfg.backend)))
            gathered: list[dict | None] = [None] * grp.world
            dist.all_gather_object(gathered, {**info, "samples": samples})
            if grp.rank == 0:
                base = _base(prov, cfg, grp, "distributed", name, skew, label, placement)
                new = [replace(r, ep_mode="low_latency", capacity=cap)
                       for r in _rows(base, gathered, (*PHASES, *STEPS), len(PHASES))]
                rows += new
                us = {r.phase: r.median_ms * 1e3 for r in new if r.rank == STEP}
                status = next(r for r in new if r.rank == STEP).status
                console.print(f"  low_latency T={cfg.tokens:<4} {name:<14} {label:<10} eager "
                              f"{us['step']:8.1f} us  graph {us.get(GRAPH, math.nan):8.1f} us"
                              f"  one GPU {us.get(SINGLE, math.nan):8.1f} us  {status}")
    return rows


def _a2a_peak_rows(cfg: Config, grp: Group, prov: Provenance | None, console: Console) -> list[EPRow]:
    """A plain all-to-all of equal splits, each size in cfg.a2a_mib (MiB sent per rank, to all ranks
    with itself): the peak the dispatch and combine all-to-alls are compared with, in this run."""
    rows = []
    for mib in cfg.a2a_mib:
        n = mib * 2**20 // (2 * grp.world) * grp.world  # bf16 elements, a multiple of the world
        send = torch.ones(n, dtype=torch.bfloat16, device=cfg.device)
        recv = torch.empty_like(send)
        samples = [[ms] for ms in _time_calls(cfg, partial(dist.all_to_all_single, recv, send))]
        crossing = n * 2 * (grp.world - 1) // grp.world
        info = {"check": Check(True, 0.0, 0.0), "samples": samples, "rows_sent": 0, "rows_recv": 0,
                "pairs_recv": 0, "bytes": {"a2a": crossing}}
        gathered: list[dict | None] = [None] * grp.world
        dist.all_gather_object(gathered, info)
        if grp.rank == 0:
            base = _base(prov, cfg, grp, "distributed", A2A_PEAK, 1.0, f"{mib} MiB",
                         contiguous_placement(cfg.shape.num_experts, grp.world))
            new = _rows(base, gathered, ("a2a",))
            step = new[-1]
            rows += [replace(r, bytes_sent=crossing) for r in new]
            gbps = crossing / step.median_ms / 1e6 if step.median_ms > 0 else math.nan
            console.print(f"  all-to-all {mib:>4} MiB per rank: {step.median_ms:8.3f} ms, "
                          f"{gbps:7.1f} GB/s leaving each rank")
    return rows


def _simulated_rows(cfg: Config, grp: Group, prov: Provenance, console: Console) -> list[EPRow]:
    n = grp.world
    weights = make_weights(cfg.shape, cfg.dtype, cfg.device, cfg.seed)
    full = (weights.gate_up_proj, weights.down_proj)
    xs = [_tokens(cfg, r) for r in range(n)]
    rows: list[EPRow] = []
    phases = ("dispatch", "experts", "combine")
    for name in cfg.scenarios:
        w_all, ids_all = _routing(cfg, name, n)
        ws, idss = list(w_all.split(cfg.tokens)), list(ids_all.split(cfg.tokens))
        skew = busiest_over_mean(expert_loads(ids_all, cfg.shape.num_experts).cpu())
        for label, placement in _placements(cfg, ids_all, n):
            shards = shard_experts(*full, placement)
            with torch.inference_mode():
                outs = simulate_ep(xs, ws, idss, shards, placement, backend=cfg.backend)
                checks = [expected_output(xs[r], *full, ws[r], idss[r]).check(outs[r]) for r in range(n)]
                samples: list[list[list[float]]] = [[] for _ in range(n)]
                if all(c.ok for c in checks):
                    for i in range(cfg.warmup + cfg.iters):
                        t = SimulatedTimes()
                        simulate_ep(xs, ws, idss, shards, placement, backend=cfg.backend, times=t)
                        if i >= cfg.warmup:
                            for r in range(n):
                                samples[r].append([t.ms[p][r] for p in phases])
            loads = _simulated_loads(ids_all, placement, n, cfg.tokens)
            per_rank = [{"check": checks[r], "samples": samples[r], **loads[r]} for r in range(n)]
            base = _base(prov, cfg, grp, "simulated", name, skew, label, placement)
            new = _rows(base, per_rank, phases)
            rows += new
            console.print(f"  {name:<14} {label:<10} step {new[-1].median_ms:8.3f} ms  "
                          f"ranks busiest/mean {new[-1].rank_busiest_over_mean:.2f}  {new[-1].status}")
    return rows


def _simulated_loads(ids_all: torch.Tensor, placement: Placement, n: int, tokens: int) -> list[dict]:
    loads = [{"rows_sent": 0, "rows_recv": 0, "pairs_recv": 0} for _ in range(n)]
    for src, ids in enumerate(ids_all.split(tokens)):
        plan = plan_routes(ids, placement, src)
        rows = plan.send_counts.tolist()
        pairs = torch.bincount(plan.dest.reshape(-1), minlength=n + 1)[:n].tolist()
        loads[src]["rows_sent"] = sum(rows)
        for d in range(n):
            loads[d]["rows_recv"] += rows[d]
            loads[d]["pairs_recv"] += pairs[d]
    return loads


def _start_group(args: argparse.Namespace) -> tuple[Group, bool]:
    """Join the caller's process group, or start one from torchrun's environment."""
    disable_nvls()  # before NCCL reads its environment
    owns = not dist.is_initialized()
    if owns:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("ep-bench needs a process group: launch it with "
                             "`torchrun --nproc-per-node N -m moekit ep-bench ...`, or use --simulate N")
        timeout = datetime.timedelta(seconds=args.timeout)
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")
    return Group(dist.get_rank(), dist.get_world_size(), backend, device), owns


def _fail(console: Console, message: object) -> int:
    console.print(f"[red]{PROG}: {message}[/red]", highlight=False, soft_wrap=True)
    return 2


def _check_out(args: argparse.Namespace) -> None:
    """Before any work, on every rank: --out is writable and holds no results (with --append: its
    results.csv, if any, is an ep-bench CSV)."""
    if args.append and args.out is not None:
        arg_types.check_out_dir(args.out)
        if (args.out / CSV_NAME).exists():
            STUDY.read(args.out / CSV_NAME)
        return
    arg_types.check_out(args.out, STUDY.result_names, args.overwrite)


def _write(rows: list[EPRow], args: argparse.Namespace, out_dir: Path, console: Console) -> int:
    """results.csv (this run's rows, after the folder's earlier ones with --append), the plot and
    report.md; the exit status."""
    earlier = STUDY.read(out_dir / CSV_NAME) if args.append and (out_dir / CSV_NAME).exists() else []
    written = STUDY.write([*earlier, *rows], out_dir, overwrite=args.overwrite or args.append)
    out_dir = written[0].parent
    console.print(f"Wrote {', '.join(p.name for p in written)} in {out_dir}", highlight=False)
    return exit_status(PROG, rows, out_dir / CSV_NAME, console,
                       lambda r: f"{r.scenario} {r.placement} rank {r.rank} {r.phase}")


def run(args: argparse.Namespace) -> int:
    disable_nvls()  # first of all: nothing below may start NCCL or symmetric memory with NVLS on
    console = Console()
    try:
        if args.redraw is not None:
            study, src = find_results(args.redraw, STUDY)
            arg_types.check_out_dir(args.out or src.parent, "--out" if args.out else "the CSV's folder")
            written = redraw(study, src, args.out)[1]
            console.print(f"Wrote {', '.join(str(p) for p in written)}", highlight=False)
            return 0
        _check_out(args)
    except ValueError as exc:
        return _fail(console, exc)
    if args.simulate is not None:
        return _run_simulated(args, console)
    try:
        grp, owns = _start_group(args)
    except ValueError as exc:
        return _fail(console, exc)
    try:
        if grp.rank != 0:
            console = Console(quiet=True)
        try:  # every rank sees the same arguments, so every rank stops here together
            cfg = _config(args, grp.device, console)
            if grp.world > cfg.shape.num_experts:
                raise ValueError(f"{grp.world} ranks but only {cfg.shape.num_experts} experts")
        except ValueError as exc:
            return _fail(console, exc)
        with arg_types.cpu_threads(cfg.device, args.threads) as threads:
            prov = measure_provenance(cfg.device, cfg.dtype, console)[1] if grp.rank == 0 else None
            console.print(f"ep-bench: {cfg.preset}, {grp.world} ranks ({grp.dist_backend}), {cfg.tokens} "
                          f"tokens per rank, {str(cfg.dtype).removeprefix('torch.')}, experts backend "
                          f"{cfg.backend}")
            rows = with_threads(_distributed_rows(cfg, grp, prov, console), threads)
        status = _write(rows, args, args.out or RESULTS_ROOT / f"ep-{prov.run_id}", console) \
            if grp.rank == 0 else 0
        dist.barrier()
        return status
    finally:
        if owns:
            dist.destroy_process_group()


def _run_simulated(args: argparse.Namespace, console: Console) -> int:
    n = args.simulate
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    try:
        cfg = _config(args, device, console)
        if n > cfg.shape.num_experts:
            raise ValueError(f"--simulate {n}: more ranks than the preset's {cfg.shape.num_experts} experts")
        # Only the normal mode's experts are simulated: refuse, not drop, what only a process group
        # (torchrun) measures. --ll-tokens and --a2a-mib default to None (not given).
        modes = [m for m in cfg.modes if m != "normal"] if getattr(args, "modes", None) else []
        for flag, asked in ((f"--modes {','.join(modes)}", modes),
                            ("--ll-tokens", getattr(args, "ll_tokens", None) is not None),
                            ("--overlap-chunks", cfg.overlap_chunks != (1,)),
                            ("--a2a-mib", getattr(args, "a2a_mib", None) is not None)):
            if asked:
                raise ValueError(f"{flag} needs a process group (--simulate times no communication)")
    except ValueError as exc:
        return _fail(console, exc)
    grp = Group(0, n, "", device)
    with arg_types.cpu_threads(cfg.device, args.threads) as threads:
        prov = measure_provenance(cfg.device, cfg.dtype, console)[1]
        console.print(f"ep-bench (simulated): {cfg.preset}, {n} virtual ranks on {device}, {cfg.tokens} "
                      f"tokens per rank, {str(cfg.dtype).removeprefix('torch.')}, experts backend "
                      f"{cfg.backend}")
        rows = with_threads(_simulated_rows(cfg, grp, prov, console), threads)
    return _write(rows, args, args.out or RESULTS_ROOT / f"ep-sim-{prov.run_id}", console)
