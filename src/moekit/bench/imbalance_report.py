"""`moekit imbalance` results: the row schema, the plots and the report, for the scaffold.

The study (`moekit.bench.imbalance`) writes `ImbalanceRow`s to results.csv through the scaffold's
row writer (`moekit.bench.study`); everything here draws from rows read back from that CSV, so
`moekit report DIR` rebuilds the plots and the report without a device. Folders of earlier runs
(imbalance.csv, imbalance.md) redraw under their own names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from moekit.bench import results
from moekit.bench.layers import file_stem
from moekit.bench.plots import png_bytes
from moekit.bench.results import LayerRow, MeasuredColumns
from moekit.bench.study import FILES, Files, Study, cpu_run_note, fmt_number, is_noisy, spread, timing_notes

if TYPE_CHECKING:
    from rich.table import Table

EXPERIMENTS = ("one_gpu", "ep", "ep_step", "capacity")


@dataclass(frozen=True)
class ImbalanceCase(LayerRow):
    """The run's `Provenance` and layer columns (as in `moekit bench`), then the case.

    experiment: "one_gpu" | "ep" (one simulated rank) | "ep_step" (a placement's step) | "capacity".
    """

    seed: int
    scenario: str
    busiest_over_mean: float
    experiment: str
    backend: str
    mode: str


@dataclass(frozen=True)
class ImbalanceRow(MeasuredColumns, ImbalanceCase):
    """One measurement of the study: its case (`ImbalanceCase`), the measurement (`MeasuredColumns`),
    then the experiment's own columns. NaN / None where a column does not apply to the experiment.

    placement: the starting placement ("contiguous", "strided"), or "replicated" (ep rows).
    pairs: pairs of the case (the whole layer, or the rank's share).
    """

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
    threads: int | None = None   # torch intra-op threads of a CPU run


def check_row(row: ImbalanceRow) -> str:
    """"" when a row can be reported (times and ratios the report divides by are > 0); else why not."""
    problem = results.check_provenance(row) or results.check_shape_columns(row)
    if problem:
        return problem
    if row.experiment not in EXPERIMENTS:
        return f"column 'experiment' must be one of {EXPERIMENTS}, got {row.experiment!r}"
    if row.experiment == "capacity":
        problem = results.positive_problem(row, "capacity_factor")
    if not problem and row.status == "ok":
        timed = ("step_ms", "mean_ms", "slowest_over_mean") if row.experiment == "ep_step" else ("median_ms",)
        problem = results.positive_problem(row, *timed)
    return problem


def _scenarios(rows: Sequence[ImbalanceRow]) -> list[str]:
    return list(dict.fromkeys(r.scenario for r in rows))


def _placements(rows: Sequence[ImbalanceRow]) -> list[str]:
    """The EP placements in the rows, starting placement first ("contiguous", "replicated")."""
    return list(dict.fromkeys(r.placement for r in rows if r.experiment == "ep_step"))


def one_per_case(rows: Sequence[ImbalanceRow]) -> list[ImbalanceRow]:
    """The last row of each case, in the order the cases first appear: a CSV holding several runs
    is reported from its latest measurement of each case, as the tables of the other reports do."""
    latest: dict[tuple, ImbalanceRow] = {}
    for r in rows:
        c = r.capacity_factor if r.experiment == "capacity" else None    # NaN elsewhere: never equal
        latest[r.preset, r.tokens, r.scenario, r.experiment, r.backend, r.placement, r.rank, c] = r
    return list(latest.values())


def _pick(rows: Sequence[ImbalanceRow], **match) -> list[ImbalanceRow]:
    return [r for r in rows if all(getattr(r, k) == v for k, v in match.items())]


def _subtitle(r: ImbalanceRow) -> str:
    return (f"{results.shape_label(r)}, "
            f"T={r.tokens}, {r.dtype}, {r.mode}, {r.device_name}")


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


def plot_one_gpu(rows: Sequence[ImbalanceRow]) -> tuple[str, bytes]:
    rs, scen = _pick(rows, experiment="one_gpu"), _scenarios(rows)
    backends = list(dict.fromkeys(r.backend for r in rs))
    by = {(r.scenario, r.backend): r for r in rs}
    series = {b: [by[s, b].median_ms if (s, b) in by else math.nan for s in scen] for b in backends}
    notes = {b: [by[s, b].status if (s, b) in by else "" for s in scen] for b in backends}
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    _bars(ax, scen, series, notes)
    if any(v > 0 for vs in series.values() for v in vs):   # NaN > 0 is False: untimed bars
        ax.set_yscale("log")
    ax.set_ylabel("median time per call (ms)")
    ax.set_title(f"one device, whole layer, by routing scenario\n{_subtitle(rows[0])}", fontsize=9)
    return f"imbalance_one_gpu_{file_stem(rows[0].preset)}.png", png_bytes(fig)


def plot_ep(rows: Sequence[ImbalanceRow]) -> tuple[str, bytes] | None:
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
    return f"imbalance_ep_{file_stem(r0.preset)}.png", png_bytes(fig)


def plot_capacity(rows: Sequence[ImbalanceRow]) -> tuple[str, bytes] | None:
    rs = _pick(rows, experiment="capacity")
    if not rs:
        return None
    fig = Figure(figsize=(10, 4.2))
    ax_drop, ax_time = fig.subplots(1, 2)
    for s in _scenarios(rs):
        pts = sorted((r for r in rs if r.scenario == s), key=lambda r: r.capacity_factor)
        cs = [r.capacity_factor for r in pts]
        ax_drop.plot(cs, [100 * r.dropped_frac for r in pts], marker="o", ms=3, label=s)
        ax_time.plot(cs, [r.median_ms for r in pts], marker="o", ms=3, label=s)
    ax_drop.set_ylabel("pairs dropped (%)")
    ax_time.set_ylabel("padded backend, median ms")
    if any(r.median_ms > 0 for r in rs):
        ax_time.set_yscale("log")
    for ax in (ax_drop, ax_time):
        ax.set_xlabel("capacity factor c (cap = ceil(c·T·K/E) pairs per expert)")
        ax.grid(True, alpha=0.3)
    ax_drop.legend(fontsize=7)
    fig.suptitle(f"capacity factor: pairs dropped vs time\n{_subtitle(rs[0])}", fontsize=9)
    return f"imbalance_capacity_{file_stem(rs[0].preset)}.png", png_bytes(fig)


def _cell(r: ImbalanceRow | None, value: Callable[[ImbalanceRow], str]) -> str:
    if r is None:
        return ""
    return value(r) if r.status == "ok" else r.status.replace("_", " ")


def render_report(rows: Sequence[ImbalanceRow], plots: Sequence[str] = (), files: Files = FILES) -> str:
    """The "Load imbalance" report section, from rows alone (each case's last row, `one_per_case`)."""
    runs = sorted({r.run_id for r in rows})
    rows = one_per_case(rows)
    r0, scen = rows[0], _scenarios(rows)
    one = {(r.scenario, r.backend): r for r in _pick(rows, experiment="one_gpu")}
    backends = list(dict.fromkeys(b for _, b in one))
    lines = [
        f"## Load imbalance: {r0.preset}, T = {r0.tokens}",
        "",
        f"- run {', '.join(runs)}, {r0.date}, commit `{r0.commit or 'unknown'}`; "
        f"{r0.device_name} ({r0.device_type}); torch {r0.torch_version}, triton {r0.triton_version}; "
        f"python {r0.python_version}",
        f"- {_subtitle(r0)}; seed {r0.seed}; ceilings copy {r0.copy_gbps:,.1f} GB/s, matmul "
        f"{r0.matmul_tflops:,.2f} TFLOP/s",
        *results.switches_lines(r0),
        "- busiest / mean = the busiest expert's pairs over the mean (1 = balanced, E/K = collapse). "
        "Every case passed the fp32-reference gate before it was timed; one that did not is listed "
        "below, never timed.",
        *timing_notes(rows),
        "",
    ]
    lines += cpu_run_note(rows, "Triton interpreted at a small T, so this shows the study's flow, not GPU "
                                "performance.")
    lines += ["### One device: median ms per call (% of floor), p20–p80 ms", "",
              "| scenario | busiest / mean | floor ms | " + " | ".join(backends) + " |",
              "|---|---:|---:|" + "---:|" * len(backends)]
    for s in scen:
        first = next((one[s, b] for b in backends if (s, b) in one), None)
        if first is None:
            continue
        cells = [_cell(one.get((s, b)), lambda r: f"{fmt_number(r.median_ms)} ({r.pct_floor:.0f}%), "
                       f"{spread(r.p20_ms, r.p80_ms)}") for b in backends]
        lines.append(f"| {s} | {first.busiest_over_mean:.2f} | {fmt_number(first.floor_ms)} | "
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
                             f"{_cell(r, lambda r: fmt_number(r.step_ms))} | "
                             f"{_cell(r, lambda r: f'{r.slowest_over_mean:.2f}')} | {rel} |")
        ranks = _pick(rows, experiment="ep")
        n = max((r.rank for r in ranks if r.rank is not None), default=-1) + 1
        lines += ["", "Per rank: median ms (pairs)", "",
                  "| scenario | placement | " + " | ".join(f"rank {i}" for i in range(n)) + " |",
                  "|---|---|" + "---:|" * n]
        by_rank = {(r.scenario, r.placement, r.rank): r for r in ranks}
        for s in scen:
            for label in labels:
                cells = [_cell(by_rank.get((s, label, i)), lambda r: f"{fmt_number(r.median_ms)} ({r.pairs})")
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
                           f"{fmt_number(r.median_ms)} ms") for c in factors]
            if any(cells):
                lines.append(f"| {s} | {_cell(uncapped, lambda r: fmt_number(r.median_ms) + ' ms')} | "
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
        lines += ["", "### Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})\n" for p in plots]
    lines += ["", f"Data: `{files.csv}` (long format, provenance in every row). Redraw the plots and this "
              f"section with `moekit report <this folder>`.", ""]
    return "\n".join(lines)


def output_files(rows: Sequence[ImbalanceRow], files: Files = FILES) -> dict[str, str | bytes]:
    """The plots and the report, rendered in memory: file name -> contents (the report last)."""
    latest = one_per_case(rows)
    plots = dict(p for p in (plot_one_gpu(latest), plot_ep(latest), plot_capacity(latest)) if p is not None)
    return {**plots, files.report: render_report(rows, list(plots), files)}


def summary_table(rows: Sequence[ImbalanceRow]) -> Table:
    """The console's summary (rich is imported here: the report and plots do without it)."""
    from rich.table import Table

    one = {(r.scenario, r.backend): r for r in _pick(rows, experiment="one_gpu")}
    steps = {(r.scenario, r.placement): r for r in _pick(rows, experiment="ep_step")}
    backends = list(dict.fromkeys(b for _, b in one))
    r0 = rows[0]
    skew = {r.scenario: r.busiest_over_mean for r in rows}
    table = Table(title=f"{r0.preset}, T={r0.tokens}: median ms; EP step ms (slowest / mean)")
    for col in ("scenario", "busiest/mean", *backends, *(f"EP {p}" for p in _placements(rows))):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for s in _scenarios(rows):
        cells = [_cell(one.get((s, b)), lambda r: fmt_number(r.median_ms)
                       + (" noisy" if is_noisy(r.p20_ms, r.p80_ms) else "")) for b in backends]
        cells += [_cell(steps.get((s, p)), lambda r: f"{fmt_number(r.step_ms)} ({r.slowest_over_mean:.2f})")
                  for p in _placements(rows)]
        table.add_row(s, f"{skew[s]:.2f}", *cells)
    return table


STUDY = Study("imbalance", ImbalanceRow, output_files, check=check_row,
              legacy=(Files("imbalance.csv", "imbalance.md"),))
