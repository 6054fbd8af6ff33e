"""`moekit ep-bench` results: the long-format rows, the plot and the report, for the scaffold.

One row per (scenario, placement, rank, phase); rank -1 holds the step, the slowest rank's time
in each iteration. Every row carries the run's provenance (the `moekit bench` fields, from
`moekit.bench.results.collect_provenance`), so rows of different runs can share one file
(`moekit ep-bench --append`); the plot and the report show the latest run. Both are drawn from rows
read back from the CSV, never from live measurements. Folders of earlier runs (ep_results.csv,
ep_report.md) redraw under their own names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from moekit.bench.layers import file_stem
from moekit.bench.plots import png_bytes
from moekit.bench.results import Provenance, check_provenance, check_shape_columns, positive_problem
from moekit.bench.study import CSV_NAME as CSV_NAME
from moekit.bench.study import FILES, Files, Study, is_noisy, timing_notes
from moekit.bench.study import REPORT_NAME as REPORT_NAME

PHASES = ("dispatch", "experts", "wait", "combine")
STEP = -1  # the rank value of step rows
STATUSES = ("ok", "failed")


@dataclass(frozen=True)
class EPRow(Provenance):
    """One measurement of `moekit ep-bench`: its run's `Provenance` columns, then the case. Times in
    ms (NaN when not timed).

    Setup: mode "distributed" (a real process group) or "simulated" (N virtual ranks in one process,
    no communication timed); dist_backend "nccl" | "gloo" | "" (simulated); placement "contiguous"
    or "replicated" (hot experts copied into spare slots). Loads: expert_busiest_over_mean of the
    scenario's pairs per expert; rank_busiest_over_mean of pairs per rank under the placement;
    rows_sent / rows_recv / pairs_recv of this rank (on step rows: the busiest rank's).
    """

    mode: str
    dist_backend: str
    world_size: int
    preset: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    tokens_per_rank: int
    backend: str
    scenario: str
    expert_busiest_over_mean: float
    placement: str
    replicas: int
    rank_busiest_over_mean: float
    rank: int
    phase: str
    status: str
    reason: str
    max_err: float
    tol: float
    median_ms: float
    p20_ms: float
    p80_ms: float
    n_rep: int
    rows_sent: int
    rows_recv: int
    pairs_recv: int
    threads: int | None = None   # torch intra-op threads of a CPU run (each rank's)


def check_row(row: EPRow) -> str:
    """"" when a row can be reported: usable provenance, a layer shape, a group of >= 1 rank."""
    return check_provenance(row) or check_shape_columns(row, "tokens_per_rank") or \
        positive_problem(row, "world_size")


def latest_run(rows: Sequence[EPRow]) -> list[EPRow]:
    last = max(r.run_id for r in rows)
    return [r for r in rows if r.run_id == last]


def _groups(rows: Sequence[EPRow]) -> list[tuple[str, str]]:
    """(placement, scenario) pairs in the order measured."""
    return list(dict.fromkeys((r.placement, r.scenario) for r in rows))


def _step(rows: Sequence[EPRow], placement: str, scenario: str) -> EPRow:
    return next(r for r in rows if r.placement == placement and r.scenario == scenario and r.rank == STEP)


def _phase(rows: Sequence[EPRow], placement: str, scenario: str, rank: int, phase: str) -> EPRow | None:
    return next((r for r in rows if r.placement == placement and r.scenario == scenario
                 and r.rank == rank and r.phase == phase), None)


def plot(rows: Sequence[EPRow]) -> tuple[str, bytes]:
    """Per scenario, one stacked bar per rank (dispatch, experts, wait, combine medians), and the
    step time (slowest rank) as a black tick; one panel per placement."""
    r0 = rows[0]
    placements = list(dict.fromkeys(r.placement for r in rows))
    n = r0.world_size
    fig = Figure(figsize=(max(7.5, 1.1 * n * len({r.scenario for r in rows})), 3.6 * len(placements)))
    axes = fig.subplots(len(placements), 1, squeeze=False)[:, 0]
    colors = {"dispatch": "tab:blue", "experts": "tab:orange", "wait": "lightgray", "combine": "tab:green"}
    width = 0.8 / n
    for ax, placement in zip(axes, placements, strict=True):
        scenarios = [s for p, s in _groups(rows) if p == placement]
        for i, scenario in enumerate(scenarios):
            for rank in range(n):
                bottom, xpos = 0.0, i + (rank - (n - 1) / 2) * width
                for phase in PHASES:
                    r = _phase(rows, placement, scenario, rank, phase)
                    if r is None or math.isnan(r.median_ms):
                        continue
                    ax.bar(xpos, r.median_ms, width * 0.9, bottom=bottom, color=colors[phase],
                           label=phase if (i, rank) == (0, 0) else None)
                    bottom += r.median_ms
            step = _step(rows, placement, scenario)
            if not math.isnan(step.median_ms):
                ax.hlines(step.median_ms, i - 0.45, i + 0.45, colors="black",
                          label="step (slowest rank)" if i == 0 else None)
        ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{placement} placement: bars = ranks 0..{n - 1}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"ep-bench {r0.preset} ({r0.mode}, {r0.dist_backend or 'loopback'}, N={n}, "
                 f"T={r0.tokens_per_rank}/rank, {r0.dtype}, {r0.backend}), {r0.device_name}", fontsize=9)
    return f"ep_{file_stem(r0.preset)}.png", png_bytes(fig)


def _ms(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.3g}"


def render(rows: Sequence[EPRow], plot_name: str | None = None) -> str:
    r0 = rows[0]
    n = r0.world_size
    lines = [
        f"# moekit ep-bench: {r0.preset}, {n} ranks ({r0.mode})", "",
        f"- run {r0.run_id}, {r0.date}, commit `{r0.commit or 'unknown'}`",
        f"- device: {r0.device_name} ({r0.device_type}), "
        f"process group: {r0.dist_backend or 'none (loopback)'}",
        f"- torch {r0.torch_version}, triton {r0.triton_version}, python {r0.python_version}, "
        f"moekit {r0.moekit_version}",
        f"- ceilings (rank 0's device): copy {r0.copy_gbps:.1f} GB/s, matmul {r0.matmul_tflops:.3g} TFLOP/s",
        f"- shape E={r0.num_experts}, H={r0.hidden_size}, I={r0.intermediate_size}, K={r0.top_k}; "
        f"{r0.tokens_per_rank} tokens per rank; {r0.dtype}; experts backend {r0.backend}",
        *timing_notes(rows),
        "",
        "Per iteration every rank starts together (barrier), then: dispatch (count exchange, the host "
        "sync, and the row all-to-all), experts, wait (a barrier: idle until the slowest rank's experts "
        "are done), combine (reverse all-to-all and the per-token sum). Step = the slowest rank's total, "
        "per iteration; medians over iterations. Timings of a placement that failed the correctness "
        "check are withheld.",
        "",
    ]
    if r0.mode == "simulated":
        lines += ["Simulated: ranks ran one after the other on one device; no communication is timed "
                  "(dispatch = plan + pack, combine = the per-token sum, wait = none).", ""]
    balanced = {p: _step(rows, p, "balanced").median_ms for p, s in _groups(rows) if s == "balanced"}
    lines += ["| placement | scenario | experts busiest/mean | ranks busiest/mean | step ms | × balanced "
              "| experts ms per rank | max dispatch ms | max combine ms | status |",
              "|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for placement, scenario in _groups(rows):
        step = _step(rows, placement, scenario)
        if step.status != "ok":
            lines.append(f"| {placement} | {scenario} | {step.expert_busiest_over_mean:.2f} | "
                         f"{step.rank_busiest_over_mean:.2f} | – | – | – | – | – | failed: {step.reason} |")
            continue
        per_rank = [_phase(rows, placement, scenario, r, "experts") for r in range(n)]
        experts = ", ".join(_ms(r.median_ms) if r else "–" for r in per_rank)

        def worst(phase: str, placement=placement, scenario=scenario) -> str:
            vals = [r.median_ms for r in (_phase(rows, placement, scenario, k, phase) for k in range(n))
                    if r is not None and not math.isnan(r.median_ms)]
            return _ms(max(vals)) if vals else "–"

        base = balanced.get(placement, math.nan)
        ratio = "–" if math.isnan(base) or base <= 0 else f"{step.median_ms / base:.2f}"
        noisy = " noisy" if is_noisy(step.p20_ms, step.p80_ms) else ""
        lines.append(f"| {placement} | {scenario} | {step.expert_busiest_over_mean:.2f} | "
                     f"{step.rank_busiest_over_mean:.2f} | {_ms(step.median_ms)} "
                     f"({_ms(step.p20_ms)}–{_ms(step.p80_ms)}){noisy} | {ratio} | {experts} | "
                     f"{worst('dispatch')} | {worst('combine')} | ok |")
    if plot_name:
        lines += ["", f"![per-rank phases]({plot_name})"]
    return "\n".join(lines) + "\n"


def output_files(rows: Sequence[EPRow], files: Files = FILES) -> dict[str, str | bytes]:
    """The plot and the report of the latest run in `rows`, rendered in memory (the report last)."""
    rows = latest_run(rows)
    name, png = plot(rows)
    return {name: png, files.report: render(rows, name)}


STUDY = Study("ep-bench", EPRow, output_files, check=check_row, statuses=STATUSES,
              legacy=(Files("ep_results.csv", "ep_report.md"),))
read_csv = STUDY.read
