"""`moekit imbalance`: skewed routing on one GPU, in a simulated expert-parallel group, with a
capacity factor, and with hot experts replicated (the article's Step 5, extended).

For each routing scenario (`moekit.routing.scenarios`) at T tokens, every case goes through the
benchmark's own `run_case` (correctness gate, then `time_fn`, launch profile and roofline floor):

    one_gpu    every backend on the whole layer. The padded backend is skipped, before anything is
               allocated, when its (E, busiest count, *) buffers would not fit in free memory
    ep         N simulated ranks (`moekit.placement`): each rank's pairs alone on this device, one
               rank after the other; an "ep_step" row per placement holds the step time (slowest
               rank) and slowest / mean. Twice: the starting placement (contiguous by default),
               then with copies of hot experts in R spare slots per rank (DeepSeek's EPLB idea)
    capacity   padded backend with capacity factor c: pairs dropped (counted on the host and by the
               backend, which must agree) and its time: the Switch Transformer's trade-off

Rows follow `ImbalanceRow` (long format, provenance in every row) and go to imbalance.csv; the
plots and imbalance.md are drawn from the CSV alone (`moekit imbalance --redraw DIR` redraws them).
"""

from __future__ import annotations

import argparse
import csv
import gc
import io
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from moekit.bench.ceilings import Ceilings, measure_ceilings
from moekit.bench.cli import DTYPES, RESULTS_ROOT
from moekit.bench.correctness import expected_output
from moekit.bench.results import Provenance, atomic_write, atomic_write_text, collect_provenance
from moekit.bench.roofline import traffic
from moekit.bench.runner import Measurement, Options, Weights, Workload, make_weights, run_case
from moekit.experts import BACKENDS, moe_experts, resolve_backend
from moekit.experts.padded import capacity, workspace_bytes
from moekit.placement import (
    PLACEMENTS,
    StepTime,
    assign,
    rank_loads,
    rank_problem,
    rank_weights,
    replicate_hot_experts,
)
from moekit.routing.scenarios import SCENARIOS, busiest_over_mean, expert_loads, make_scenario
from moekit.shapes import PRESETS, MoEShape

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)
GPU_PRESET, CPU_PRESET = "qwen3-30b-a3b", "tiny"
GPU_TOKENS, CPU_TOKENS = 4096, 64
CPU_OPTIONS = Options(warmup=1, rep=5)   # the Triton interpreter takes ~0.25 s a call at T=64
# Share of free memory the padded buffers may take; the rest is for the timing cache flush, the
# output and allocator fragmentation.
MEMORY_HEADROOM = 0.8
CSV_NAME, REPORT_NAME = "imbalance.csv", "imbalance.md"


@dataclass(frozen=True)
class StudyConfig:
    """What `study_rows` measures.

    Attributes:
        preset, tokens, dtype, device: the layer and batch.
        scenarios: names for `moekit.routing.make_scenario`; "file" replays `trace`.
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
    backends: tuple[str, ...] = BACKENDS
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

    @property
    def shape(self) -> MoEShape:
        return PRESETS[self.preset]


@dataclass(frozen=True)
class ImbalanceRow(Provenance):
    """One measurement of the study: the run's `Provenance` (as in `moekit bench`), then the case.
    NaN / None where a column does not apply to the experiment.

    experiment: "one_gpu" | "ep" (one simulated rank) | "ep_step" (a placement's step) | "capacity".
    placement: the starting placement ("contiguous", "strided"), or "replicated" (ep rows).
    pairs: pairs of the case (the whole layer, or the rank's share).
    status, reason: as in `moekit bench` (ok, failed, error, skipped, ...).
    """

    preset: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    tokens: int
    seed: int
    scenario: str
    busiest_over_mean: float
    experiment: str
    backend: str
    mode: str
    status: str
    reason: str = ""
    max_err: float = math.nan
    median_ms: float = math.nan
    p20_ms: float = math.nan
    p80_ms: float = math.nan
    n_rep: int | None = None
    floor_ms: float = math.nan
    pct_floor: float = math.nan
    kernels: int | None = None
    pairs: int | None = None
    placement: str = ""
    ep_ranks: int | None = None
    spare_slots: int | None = None
    replicas: int | None = None
    rank: int | None = None
    rank_experts: int | None = None
    rank_tokens: int | None = None
    step_ms: float = math.nan
    mean_ms: float = math.nan
    slowest_over_mean: float = math.nan
    slowest_rank: int | None = None
    busiest_rank_pairs: int | None = None
    pairs_busiest_over_mean: float = math.nan
    capacity_factor: float = math.nan
    capacity: int | None = None
    dropped: int | None = None
    dropped_frac: float = math.nan


COLUMNS = tuple(f.name for f in fields(ImbalanceRow))
_TYPES = {f.name: str(f.type) for f in fields(ImbalanceRow)}


def free_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or available physical memory (CPU on Linux; else unbounded)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def padded_refusal(shape: MoEShape, cap: int, dtype: torch.dtype, device: torch.device,
                   limit_bytes: int | None = None) -> str:
    """"" when the padded backend's (E, cap, *) buffers fit in memory, else the reason they do not."""
    need = workspace_bytes(shape.num_experts, cap, shape.hidden_size, shape.intermediate_size,
                           torch.empty((), dtype=dtype).element_size())
    free = free_memory_bytes(device)
    allowed = int(MEMORY_HEADROOM * free)
    if limit_bytes is not None:
        allowed = min(allowed, limit_bytes)
    if need <= allowed:
        return ""
    return (f"padded buffers (E={shape.num_experts}, cap={cap}, *) need {need / 1e9:.3g} GB, over the "
            f"{allowed / 1e9:.3g} GB allowed ({free / 1e9:.3g} GB free); not run")


def dropped_pairs(loads: torch.Tensor, cap: int) -> int:
    """Pairs past their expert's capacity: sum over experts of max(0, load - cap)."""
    return int((torch.as_tensor(loads) - cap).clamp_min(0).sum())


def kept_mask(topk_ids: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """bool (T, K): pairs kept at capacity `cap`: each expert's first `cap` pairs in ascending pair
    index t * K + k, as the padded backend keeps them. Ids outside [0, E) are never kept."""
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    key_sorted, order = torch.sort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)
    start = torch.cumsum(counts, 0) - counts
    j_sorted = torch.arange(flat.numel(), device=flat.device) - start[key_sorted]
    j = torch.empty_like(j_sorted).scatter_(0, order, j_sorted)
    return (valid & (j < cap)).view(topk_ids.shape)


def _workload(cfg: StudyConfig, shape: MoEShape, weights: Weights, x: torch.Tensor, w: torch.Tensor,
              ids: torch.Tensor) -> Workload:
    return Workload(preset=cfg.preset, shape=shape, tokens=x.shape[0], dtype=cfg.dtype, device=cfg.device,
                    weights=weights, x=x, topk_weights=w, topk_ids=ids,
                    expected=expected_output(x, weights.gate_up_proj, weights.down_proj, w, ids),
                    traffic=traffic(shape, x.shape[0], ids, cfg.dtype), experts_hit_mean=math.nan)


def _timing_cols(m: Measurement) -> dict:
    t = m.timing
    return {"status": m.status, "reason": m.reason, "max_err": m.max_err, "floor_ms": m.floor_ms,
            "median_ms": m.median_ms, "pct_floor": m.pct_floor, "p20_ms": t.p20_ms if t else math.nan,
            "p80_ms": t.p80_ms if t else math.nan, "n_rep": t.n if t else None,
            "kernels": m.launches.kernels if m.launches else None}


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
            rows.append(ImbalanceRow(**row, **_timing_cols(_run(cfg, work, b, ceilings))))
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

        cols = _timing_cols(_run(cfg, capped, "padded", ceilings, factory))
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

            cols = _timing_cols(_run(cfg, rank_work, backend, ceilings, factory))
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


def _format(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def rows_to_csv(rows: Sequence[ImbalanceRow]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([_format(getattr(row, c)) for c in COLUMNS])
    return buf.getvalue()


def _parse(column: str, text: str, where: str) -> object:
    kind = _TYPES[column]
    if kind == "str":
        return text
    if text == "":
        if kind == "int":
            raise ValueError(f"{where}: column {column!r} is empty but must hold an integer")
        return math.nan if kind == "float" else None
    try:
        return float(text) if kind == "float" else int(text)
    except ValueError:
        raise ValueError(f"{where}: column {column!r} must hold a number, got {text!r}") from None


def read_rows(path: Path) -> list[ImbalanceRow]:
    """Rows of an imbalance CSV. Raises ValueError naming the file (and line) on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the imbalance CSV ({exc})") from None
    try:
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None) or []
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: not a moekit imbalance CSV; missing columns {missing}")
        index = {c: header.index(c) for c in COLUMNS}
        rows = []
        for line_no, record in enumerate(reader, start=2):
            if not record:
                continue
            if len(record) != len(header):
                raise ValueError(f"{path}:{line_no}: {len(record)} fields, the header has {len(header)}")
            where = f"{path}:{line_no}"
            rows.append(ImbalanceRow(**{c: _parse(c, record[i], where) for c, i in index.items()}))
    except csv.Error as exc:
        raise ValueError(f"{path}: malformed CSV ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _fmt(v: float | int | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _scenarios(rows: Sequence[ImbalanceRow]) -> list[str]:
    return list(dict.fromkeys(r.scenario for r in rows))


def _placements(rows: Sequence[ImbalanceRow]) -> list[str]:
    """The EP placements in the rows, starting placement first ("contiguous", "replicated")."""
    return list(dict.fromkeys(r.placement for r in rows if r.experiment == "ep_step"))


def _pick(rows: Sequence[ImbalanceRow], **match) -> list[ImbalanceRow]:
    return [r for r in rows if all(getattr(r, k) == v for k, v in match.items())]


def _subtitle(r: ImbalanceRow) -> str:
    return (f"{r.preset} (E={r.num_experts}, H={r.hidden_size}, I={r.intermediate_size}, K={r.top_k}), "
            f"T={r.tokens}, {r.dtype}, {r.mode}, {r.device_name}")


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    return path


def _bars(ax, groups: list[str], series: dict[str, list[float]], notes: dict[str, list[str]]) -> None:
    """Grouped bars: one group per scenario, one bar per series; a note where a bar is missing."""
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [v if not math.isnan(v) else 0 for v in values], width, label=label)
        for xpos, v, note in zip(xs, values, notes.get(label, [""] * len(groups)), strict=True):
            if math.isnan(v) and note:
                ax.annotate(note, (xpos, 0), xytext=(0, 3), textcoords="offset points", rotation=90,
                            ha="center", va="bottom", fontsize=6, color="gray")
    ax.set_xticks(range(len(groups)), groups, rotation=20, fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_one_gpu(rows: Sequence[ImbalanceRow], out_dir: Path) -> Path:
    rs, scen = _pick(rows, experiment="one_gpu"), _scenarios(rows)
    backends = list(dict.fromkeys(r.backend for r in rs))
    by = {(r.scenario, r.backend): r for r in rs}
    series = {b: [by[s, b].median_ms if (s, b) in by else math.nan for s in scen] for b in backends}
    notes = {b: [by[s, b].status if (s, b) in by else "" for s in scen] for b in backends}
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    _bars(ax, scen, series, notes)
    ax.set_yscale("log")
    ax.set_ylabel("median time per call (ms)")
    ax.set_title(f"one device, whole layer, by routing scenario\n{_subtitle(rows[0])}", fontsize=9)
    return _save(fig, out_dir / f"imbalance_one_gpu_{rows[0].preset}.png")


def plot_ep(rows: Sequence[ImbalanceRow], out_dir: Path) -> Path | None:
    rs, scen = _pick(rows, experiment="ep_step"), _scenarios(rows)
    if not rs:
        return None
    by = {(r.scenario, r.placement): r for r in rs}
    series, notes = {}, {}
    for label in _placements(rs):
        series[label] = [by[s, label].step_ms if (s, label) in by else math.nan for s in scen]
        notes[label] = [by[s, label].status if (s, label) in by else "" for s in scen]
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    _bars(ax, scen, series, notes)
    for i, s in enumerate(scen):
        for j, label in enumerate(_placements(rs)):
            r = by.get((s, label))
            if r is not None and r.status == "ok":
                ax.annotate(f"{r.slowest_over_mean:.2f}×", (i + (j - 0.5) * 0.4, r.step_ms), xytext=(0, 2),
                            textcoords="offset points", ha="center", fontsize=6)
    r0 = rs[0]
    ax.set_ylabel("step time = slowest rank (ms)")
    ax.set_title(f"simulated EP: {r0.ep_ranks} ranks, {r0.backend}, before / after replicating hot experts "
                 f"({r0.spare_slots} spare slots per rank); labels: slowest / mean rank\n"
                 f"{_subtitle(r0)}", fontsize=9)
    return _save(fig, out_dir / f"imbalance_ep_{r0.preset}.png")


def plot_capacity(rows: Sequence[ImbalanceRow], out_dir: Path) -> Path | None:
    rs = _pick(rows, experiment="capacity")
    if not rs:
        return None
    fig = Figure(figsize=(10, 4.2))
    ax_drop, ax_time = fig.subplots(1, 2)
    for s in _scenarios(rs):
        pts = sorted((r.capacity_factor, r) for r in rs if r.scenario == s)
        ax_drop.plot([c for c, _ in pts], [100 * r.dropped_frac for _, r in pts], marker="o", ms=3, label=s)
        ax_time.plot([c for c, _ in pts], [r.median_ms for _, r in pts], marker="o", ms=3, label=s)
    ax_drop.set_ylabel("pairs dropped (%)")
    ax_time.set_ylabel("padded backend, median ms")
    ax_time.set_yscale("log")
    for ax in (ax_drop, ax_time):
        ax.set_xlabel("capacity factor c (cap = ceil(c·T·K/E) pairs per expert)")
        ax.grid(True, alpha=0.3)
    ax_drop.legend(fontsize=7)
    fig.suptitle(f"capacity factor: pairs dropped vs time\n{_subtitle(rs[0])}", fontsize=9)
    return _save(fig, out_dir / f"imbalance_capacity_{rs[0].preset}.png")


def _cell(r: ImbalanceRow | None, value: Callable[[ImbalanceRow], str]) -> str:
    if r is None:
        return ""
    return value(r) if r.status == "ok" else r.status.replace("_", " ")


def render_report(rows: Sequence[ImbalanceRow], plots: Sequence[Path] = ()) -> str:
    """The "Load imbalance" report section, from rows alone."""
    r0, scen = rows[0], _scenarios(rows)
    one = {(r.scenario, r.backend): r for r in _pick(rows, experiment="one_gpu")}
    backends = list(dict.fromkeys(b for _, b in one))
    lines = [
        f"## Load imbalance: {r0.preset}, T = {r0.tokens}",
        "",
        f"- run {', '.join(sorted({r.run_id for r in rows}))}, {r0.date}, commit `{r0.commit or 'unknown'}`; "
        f"{r0.device_name} ({r0.device_type}); torch {r0.torch_version}, triton {r0.triton_version}; "
        f"python {r0.python_version}",
        f"- {_subtitle(r0)}; seed {r0.seed}; ceilings copy {r0.copy_gbps:,.1f} GB/s, matmul "
        f"{r0.matmul_tflops:,.2f} TFLOP/s",
        "- busiest / mean = the busiest expert's pairs over the mean (1 = balanced, E/K = collapse). "
        "Every case passed the fp32-reference gate before it was timed; one that did not is listed "
        "below, never timed.",
        "",
    ]
    if r0.device_type == "cpu":
        lines += ["> CPU run (Triton interpreted, small T): the flow of the study, not GPU performance.", ""]
    lines += ["### One device: median ms per call (% of floor)", "",
              "| scenario | busiest / mean | floor ms | " + " | ".join(backends) + " |",
              "|---|---:|---:|" + "---:|" * len(backends)]
    for s in scen:
        first = next((one[s, b] for b in backends if (s, b) in one), None)
        if first is None:
            continue
        cells = [_cell(one.get((s, b)), lambda r: f"{_fmt(r.median_ms)} ({r.pct_floor:.0f}%)")
                 for b in backends]
        lines.append(f"| {s} | {first.busiest_over_mean:.2f} | {_fmt(first.floor_ms)} | "
                     + " | ".join(cells) + " |")

    steps = {(r.scenario, r.placement): r for r in _pick(rows, experiment="ep_step")}
    if steps:
        st0 = next(iter(steps.values()))
        labels = _placements(rows)
        ref = "balanced" if "balanced" in scen else scen[0]
        base = steps.get((ref, labels[0]))
        lines += ["", f"### Simulated expert parallelism: {st0.ep_ranks} ranks, {st0.backend}", "",
                  f"Each rank's pairs run alone on this device, one rank after another; a step lasts as long "
                  f"as its slowest rank. *Replicated*: copies of hot experts in {st0.spare_slots} spare "
                  f"slot(s) per rank, pairs split round-robin among copies (`moekit.placement`). "
                  f"*vs {ref}*: step time over {ref}'s {labels[0]} step.", "",
                  "| scenario | placement | copies | busiest rank pairs / mean | step ms | slowest / mean "
                  f"| vs {ref} |", "|---|---|---:|---:|---:|---:|---:|"]
        for s in scen:
            for label in labels:
                r = steps.get((s, label))
                if r is None:
                    continue
                rel = (f"{r.step_ms / base.step_ms:.2f}×" if base is not None and base.status == "ok"
                       and r.status == "ok" else "–")
                lines.append(f"| {s} | {label} | {r.replicas} | {r.pairs_busiest_over_mean:.2f} | "
                             f"{_cell(r, lambda r: _fmt(r.step_ms))} | "
                             f"{_cell(r, lambda r: f'{r.slowest_over_mean:.2f}')} | {rel} |")
        ranks = _pick(rows, experiment="ep")
        n = max((r.rank for r in ranks if r.rank is not None), default=-1) + 1
        lines += ["", "Per rank: median ms (pairs)", "",
                  "| scenario | placement | " + " | ".join(f"rank {i}" for i in range(n)) + " |",
                  "|---|---|" + "---:|" * n]
        by_rank = {(r.scenario, r.placement, r.rank): r for r in ranks}
        for s in scen:
            for label in labels:
                cells = [_cell(by_rank.get((s, label, i)), lambda r: f"{_fmt(r.median_ms)} ({r.pairs})")
                         for i in range(n)]
                if any(cells):
                    lines.append(f"| {s} | {label} | " + " | ".join(cells) + " |")

    caps = {(r.scenario, r.capacity_factor): r for r in _pick(rows, experiment="capacity")}
    if caps:
        factors = sorted({c for _, c in caps})
        lines += ["", "### Capacity factor (padded backend): pairs dropped, median ms", "",
                  "Each expert keeps its first ceil(c·T·K/E) pairs; the rest are dropped (they add 0, as "
                  "a token past capacity rides the residual connection in the Switch Transformer). "
                  "*no cap*: the padded backend padded to the busiest expert.", "",
                  "| scenario | no cap | " + " | ".join(f"c = {c:g}" for c in factors) + " |",
                  "|---|---:|" + "---:|" * len(factors)]
        for s in scen:
            uncapped = one.get((s, "padded"))
            cells = [_cell(caps.get((s, c)), lambda r: f"{100 * r.dropped_frac:.1f}% dropped, "
                           f"{_fmt(r.median_ms)} ms") for c in factors]
            if any(cells):
                lines.append(f"| {s} | {_cell(uncapped, lambda r: _fmt(r.median_ms) + ' ms')} | "
                             + " | ".join(cells) + " |")

    untimed = [r for r in rows if r.status != "ok"]
    if untimed:
        lines += ["", "### Not timed", ""]
        for r in untimed:
            where = r.experiment + (f" {r.placement}" if r.placement else "") + \
                (f" rank {r.rank}" if r.rank is not None else "") + \
                (f" c={r.capacity_factor:g}" if not math.isnan(r.capacity_factor) else "")
            lines.append(f"- {r.scenario}, {where}, {r.backend}: **{r.status}**: {r.reason}")
    if plots:
        lines += ["", "### Plots", ""] + [f"![{p.stem}]({p.name})\n" for p in plots]
    lines += ["", f"Data: `{CSV_NAME}` (long format, provenance in every row). Redraw the plots and this "
              f"section with `moekit imbalance --redraw <this folder>`.", ""]
    return "\n".join(lines)


def write_outputs(rows: Sequence[ImbalanceRow], out_dir: Path) -> list[Path]:
    """Plots and imbalance.md from the rows (the CSV is written separately); returns the files."""
    out_dir = Path(out_dir)
    plots = [p for p in (plot_one_gpu(rows, out_dir), plot_ep(rows, out_dir), plot_capacity(rows, out_dir))
             if p is not None]
    report = out_dir / REPORT_NAME
    atomic_write_text(report, render_report(rows, plots))
    return [*plots, report]


def _csv_list(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list, got nothing")
    return items


def _factors(text: str) -> list[float]:
    try:
        values = [float(s) for s in _csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"capacity factors must be > 0, got {text!r}")
    return values


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help=f"layer shape (default: {GPU_PRESET} on a GPU, {CPU_PRESET} on a CPU-only machine)")
    p.add_argument("--tokens", type=_int_at_least(1), default=None,
                   help=f"tokens T (default: {GPU_TOKENS} on a GPU, {CPU_TOKENS} on the CPU)")
    p.add_argument("--scenarios", type=_csv_list, default=list(SCENARIOS),
                   help=f"routing scenarios (default: {','.join(SCENARIOS)}); also hot-<n>, zipf-<s>")
    p.add_argument("--trace", type=Path, default=None,
                   help="a saved routing (.pt or .npy of (T, K) ids) to replay as scenario 'file'")
    p.add_argument("--backends", type=_csv_list, default=list(BACKENDS),
                   help=f"one-device backends (default: {','.join(BACKENDS)})")
    p.add_argument("--ep", type=_int_at_least(0), default=None,
                   help="simulated expert-parallel ranks N, 0 to skip (default: min(8, E/2))")
    p.add_argument("--placement", choices=sorted(PLACEMENTS), default="contiguous",
                   help="where each rank's experts come from before replication (default: contiguous)")
    p.add_argument("--spare-slots", type=_int_at_least(0), default=None,
                   help="free expert slots per rank for copies of hot experts (default: E/N/8, at least 1)")
    p.add_argument("--ep-backend", default="auto",
                   help="backend of each simulated rank (default: triton on CUDA; grouped_mm or loop "
                        "on the CPU)")
    p.add_argument("--capacity-factors", type=_factors, default=list(CAPACITY_FACTORS),
                   help="capacity factors for the padded backend "
                        f"(default: {','.join(map(str, CAPACITY_FACTORS))})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="the padded backend is not run when its buffers would exceed this (default: "
                        f"{MEMORY_HEADROOM * 100:.0f}%% of free memory)")
    p.add_argument("--rep", type=_int_at_least(1), default=None,
                   help=f"timed calls per case (default: time_fn's on a GPU, {CPU_OPTIONS.rep} on the CPU)")
    p.add_argument("--warmup", type=_int_at_least(0), default=None, help="warm-up calls per case")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--threads", type=_int_at_least(1), default=1,
                   help="CPU runs only: torch intra-op threads (default 1; shapes small enough for the CPU "
                        "gain nothing from more, and on a shared machine waiting threads cost ms per op)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, tokens and scenarios")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output folder (default: {RESULTS_ROOT}/imbalance-<UTC timestamp>)")
    p.add_argument("--redraw", type=Path, default=None, metavar="DIR",
                   help=f"only redraw the plots and {REPORT_NAME} from DIR/{CSV_NAME} (no device needed)")


def config_from_args(args: argparse.Namespace, console: Console | None = None) -> StudyConfig:
    """Resolve the defaults that depend on the machine; ValueError on a bad combination."""
    device = torch.device(args.device) if args.device else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is available")
    on_gpu = device.type == "cuda"
    preset = args.preset or (GPU_PRESET if on_gpu else CPU_PRESET)
    tokens = args.tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
    if not on_gpu and console is not None and (args.preset is None or args.tokens is None):
        console.print(f"[yellow]No CUDA device: {preset} at T={tokens} on the CPU (the GPU default is "
                      f"{GPU_PRESET} at T={GPU_TOKENS}); Triton runs interpreted.[/yellow]")
    shape = PRESETS[preset]
    scenarios = list(dict.fromkeys(args.scenarios))
    if args.trace is not None and "file" not in scenarios:
        scenarios.append("file")
    for s in scenarios:  # fail on a bad name or trace now, not after minutes of measuring
        make_scenario(s, 1, shape.num_experts, shape.top_k, trace=args.trace)
    for b in args.backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r}; expected from {BACKENDS}")
    resolve_backend(args.ep_backend, device)  # ValueError on an unknown name
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
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if on_gpu else torch.float32)
    return StudyConfig(preset=preset, tokens=tokens, dtype=dtype, device=device, scenarios=tuple(scenarios),
                       backends=tuple(dict.fromkeys(args.backends)),
                       ep_ranks=ep, placement=args.placement, spare_slots=spare, ep_backend=args.ep_backend,
                       capacity_factors=tuple(args.capacity_factors), mode="graph" if args.graph else "eager",
                       seed=args.seed, trace=str(args.trace) if args.trace else None,
                       memory_limit_bytes=limit, options=options)


def summary_table(rows: Sequence[ImbalanceRow]) -> Table:
    one = {(r.scenario, r.backend): r for r in _pick(rows, experiment="one_gpu")}
    steps = {(r.scenario, r.placement): r for r in _pick(rows, experiment="ep_step")}
    backends = list(dict.fromkeys(b for _, b in one))
    r0 = rows[0]
    skew = {r.scenario: r.busiest_over_mean for r in rows}
    table = Table(title=f"{r0.preset}, T={r0.tokens}: median ms; EP step ms (slowest / mean)")
    for col in ("scenario", "busiest/mean", *backends, *(f"EP {p}" for p in _placements(rows))):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for s in _scenarios(rows):
        cells = [_cell(one.get((s, b)), lambda r: _fmt(r.median_ms)) for b in backends]
        cells += [_cell(steps.get((s, p)), lambda r: f"{_fmt(r.step_ms)} ({r.slowest_over_mean:.2f})")
                  for p in _placements(rows)]
        table.add_row(s, f"{skew[s]:.2f}", *cells)
    return table


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.redraw is not None:
        src = args.redraw / CSV_NAME if args.redraw.is_dir() else args.redraw
        try:
            rows = read_rows(src)
        except ValueError as exc:
            console.print(f"[red]moekit imbalance: {exc}[/red]", highlight=False)
            return 2
        written = write_outputs(rows, args.out or src.parent)
        console.print(f"Read {len(rows)} rows from {src}; wrote {', '.join(p.name for p in written)}",
                      highlight=False)
        return 0
    try:
        cfg = config_from_args(args, console)
    except ValueError as exc:
        console.print(f"[red]moekit imbalance: {exc}[/red]", highlight=False)
        return 2
    threads = torch.get_num_threads()
    if cfg.device.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        return _measure(cfg, args, console)
    finally:
        torch.set_num_threads(threads)


def _measure(cfg: StudyConfig, args: argparse.Namespace, console: Console) -> int:
    console.print(f"Measuring ceilings on {cfg.device}...")
    ceilings = measure_ceilings(cfg.device, cfg.dtype)
    prov = collect_provenance(cfg.device, cfg.dtype, ceilings.copy_gbps, ceilings.matmul_tflops)
    out_dir = args.out or RESULTS_ROOT / f"imbalance-{prov.run_id}"
    console.print(f"{cfg.preset}, T={cfg.tokens}, {str(cfg.dtype).removeprefix('torch.')}, {cfg.mode}; "
                  f"EP {cfg.ep_ranks} ranks with {cfg.spare_slots} spare slot(s) each")
    rows = study_rows(cfg, ceilings, prov, progress=lambda m: console.print(m, highlight=False))
    atomic_write_text(out_dir / CSV_NAME, rows_to_csv(rows))
    written = write_outputs(rows, out_dir)
    console.print(summary_table(rows))
    for r in rows:
        if r.status in ("failed", "error"):
            console.print(f"[red]{r.scenario} {r.experiment} {r.backend} {r.placement} {r.status}: "
                          f"{r.reason}[/red]", highlight=False)
    console.print(f"Wrote {out_dir / CSV_NAME} and {', '.join(p.name for p in written)}", highlight=False)
    return 0
