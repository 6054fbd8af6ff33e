"""`moekit ep-bench` results: the long-format rows, their CSV, the plot and the report.

One row per (scenario, placement, rank, phase); rank -1 holds the step, the slowest rank's time
in each iteration. Every row carries the run's provenance (the `moekit bench` fields, from
`moekit.bench.results.collect_provenance`), so rows of different runs can share one file. The plot
and the report are drawn from rows read back from the CSV, never from live measurements.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from matplotlib.figure import Figure

from moekit.bench.results import Provenance, atomic_write, atomic_write_text

CSV_NAME = "ep_results.csv"
REPORT_NAME = "ep_report.md"
PHASES = ("dispatch", "experts", "wait", "combine")
STEP = -1  # the rank value of step rows
STATUSES = ("ok", "failed")


@dataclass(frozen=True)
class EPRow:
    """One measurement of `moekit ep-bench`. Times in ms (NaN when not timed).

    Setup: mode "distributed" (a real process group) or "simulated" (N virtual ranks in one process,
    no communication timed); dist_backend "nccl" | "gloo" | "" (simulated); placement "contiguous"
    or "replicated" (hot experts copied into spare slots). Loads: expert_busiest_over_mean of the
    scenario's pairs per expert; rank_busiest_over_mean of pairs per rank under the placement;
    rows_sent / rows_recv / pairs_recv of this rank (on step rows: the busiest rank's).
    """

    run_id: str
    date: str
    commit: str
    device_type: str
    device_name: str
    torch_version: str
    triton_version: str
    transformers_version: str
    python_version: str
    moekit_version: str
    dtype: str
    copy_gbps: float
    matmul_tflops: float
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


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(EPRow))
_TYPES: dict[str, str] = {f.name: str(f.type) for f in fields(EPRow)}
PROVENANCE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Provenance))


def _format(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def _parse(column: str, text: str, where: str) -> object:
    kind = _TYPES[column]
    if kind == "str":
        return text
    if kind == "float":
        if text == "":
            return math.nan
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{where}: column {column!r} must hold a number, got {text!r}") from None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{where}: column {column!r} must hold an integer, got {text!r}") from None


def rows_to_csv(rows: Sequence[EPRow], *, header: bool = True) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if header:
        writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([_format(getattr(row, c)) for c in COLUMNS])
    return buf.getvalue()


def read_csv(path: Path) -> list[EPRow]:
    """Rows of an ep-bench CSV; ValueError naming the file (and line) on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the ep-bench CSV ({exc})") from None
    try:
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected an ep-bench CSV header")
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: not an ep-bench CSV; missing columns {missing}")
        index = {c: header.index(c) for c in COLUMNS}
        rows = []
        for line_no, record in enumerate(reader, start=2):
            if not record:
                continue
            where = f"{path}:{line_no}"
            if len(record) != len(header):
                raise ValueError(f"{where}: {len(record)} fields, the header has {len(header)}")
            row = EPRow(**{c: _parse(c, record[i], where) for c, i in index.items()})
            if row.status not in STATUSES:
                raise ValueError(f"{where}: status must be one of {STATUSES}, got {row.status!r}")
            rows.append(row)
    except csv.Error as exc:
        raise ValueError(f"{path}: malformed CSV ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: no result rows")
    return rows


def append_csv(rows: Sequence[EPRow], path: Path) -> Path:
    """Add rows to `path` (created if absent; an existing file must be an ep-bench CSV). Atomic."""
    path = Path(path)
    old = rows_to_csv(read_csv(path)) if path.exists() else rows_to_csv([])
    atomic_write_text(path, old + rows_to_csv(rows, header=False))
    return path


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


def plot(rows: Sequence[EPRow], out_dir: Path) -> Path:
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
    path = Path(out_dir) / f"ep_{r0.preset}.png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    return path


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
        lines.append(f"| {placement} | {scenario} | {step.expert_busiest_over_mean:.2f} | "
                     f"{step.rank_busiest_over_mean:.2f} | {_ms(step.median_ms)} "
                     f"({_ms(step.p20_ms)}–{_ms(step.p80_ms)}) | {ratio} | {experts} | {worst('dispatch')} | "
                     f"{worst('combine')} | ok |")
    if plot_name:
        lines += ["", f"![per-rank phases]({plot_name})"]
    return "\n".join(lines) + "\n"


def write_report(rows: Sequence[EPRow], out_dir: Path) -> list[Path]:
    """The plot and the Markdown report of the latest run in `rows`."""
    rows = latest_run(rows)
    png = plot(rows, out_dir)
    md = Path(out_dir) / REPORT_NAME
    atomic_write_text(md, render(rows, png.name))
    return [png, md]
