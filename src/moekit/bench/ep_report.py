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
from moekit.bench.results import (
    Provenance,
    check_provenance,
    check_shape_columns,
    positive_problem,
    switches_lines,
)
from moekit.bench.study import CSV_NAME as CSV_NAME
from moekit.bench.study import FILES, Files, Study, is_noisy, timing_notes
from moekit.bench.study import REPORT_NAME as REPORT_NAME

PHASES = ("dispatch", "experts", "wait", "combine")
# The steps inside dispatch and combine (`moekit.parallel.dispatch.Probe`): rows of their own, not
# summed into the step (their phase's row holds their sum). The low-latency mode has no "counts".
DISPATCH_STEPS = ("plan", "counts", "pack", "rows")
COMBINE_STEPS = ("back", "reduce")
STEPS = (*DISPATCH_STEPS, *COMBINE_STEPS)
COMM_STEPS = ("rows", "back")  # the all-to-alls of token rows: bytes_sent says how much crossed
STEP = -1  # the rank value of step rows
# Rank -1 rows of the low-latency mode besides "step" (eager): the whole layer replayed from a CUDA
# graph, and the same tokens through all experts on one GPU (also a graph), each the slowest rank's.
GRAPH, SINGLE = "graph", "single"
# Rank -1 rows of every layer case besides "step": the whole call with no sync inside (between a
# barrier and a device sync), the slowest rank's; "step" is the sum of the synced phases.
PLAIN = "step_plain"
A2A_PEAK = "a2a-peak"  # the scenario of the all-to-all peak rows (phase "a2a", rank -1)
MODES = ("normal", "low_latency")
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
    ep_mode "normal" (count exchange, exact sizes) or "low_latency" (fixed blocks of `capacity` rows,
    no host sync); phases also the steps inside dispatch and combine (`STEPS`), on rank -1 `PLAIN`
    (the call timed whole, no inner sync) and in the low-latency mode `GRAPH` and `SINGLE`; scenario
    `A2A_PEAK` rows time a plain all-to-all. overlap_chunks: the normal mode's
    (`moekit.parallel.overlap`; older files: 1); with n > 1 each phase is the sum over the chunks
    (synced, so nothing overlaps there; `PLAIN` is the overlapped call).
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
    ep_mode: str = "normal"      # "normal" or "low_latency" (older files: normal)
    capacity: int | None = None  # low-latency rows per destination rank (C)
    bytes_sent: int | None = None  # bytes this rank sent to other ranks in this phase (rows, back, a2a)
    overlap_chunks: int = 1      # normal mode: token chunks whose all-to-alls overlap experts (older: 1)


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
    return next(r for r in rows if r.placement == placement and r.scenario == scenario and r.rank == STEP
                and r.phase == "step")


def _phase(rows: Sequence[EPRow], placement: str, scenario: str, rank: int, phase: str) -> EPRow | None:
    return next((r for r in rows if r.placement == placement and r.scenario == scenario
                 and r.rank == rank and r.phase == phase), None)


def _normal(rows: Sequence[EPRow]) -> list[EPRow]:
    return [r for r in rows if r.ep_mode == "normal" and r.scenario != A2A_PEAK]


def _low_latency(rows: Sequence[EPRow]) -> list[EPRow]:
    return [r for r in rows if r.ep_mode == "low_latency"]


def _chunk_values(rows: Sequence[EPRow]) -> list[int]:
    return sorted({r.overlap_chunks for r in rows})


def _with_chunks(rows: Sequence[EPRow], chunks: int) -> list[EPRow]:
    return [r for r in rows if r.overlap_chunks == chunks]


def plot(all_rows: Sequence[EPRow]) -> tuple[str, bytes]:
    """Per scenario, one stacked bar per rank (dispatch, experts, wait, combine medians), and the
    step time (slowest rank) as a black tick; one panel per placement. Bars and step of the fewest
    overlap chunks measured (1 normally); the plain step of every chunk count as a dashed tick."""
    chunk_values = _chunk_values(all_rows)
    rows = _with_chunks(all_rows, chunk_values[0])
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
            for j, chunks in enumerate(chunk_values):
                plain = _phase(_with_chunks(all_rows, chunks), placement, scenario, STEP, PLAIN)
                if plain is not None and not math.isnan(plain.median_ms):
                    ax.hlines(plain.median_ms, i - 0.45, i + 0.45, colors=f"C{(j + 4) % 10}",
                              linestyles="dashed", label=f"plain step, {chunks} chunk(s)" if i == 0 else None)
        ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{placement} placement: bars = ranks 0..{n - 1}"
                     + (f" ({chunk_values[0]} overlap chunk(s))" if chunk_values != [1] else ""), fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"ep-bench {r0.preset} ({r0.mode}, {r0.dist_backend or 'loopback'}, N={n}, "
                 f"T={r0.tokens_per_rank}/rank, {r0.dtype}, {r0.backend}), {r0.device_name}", fontsize=9)
    return f"ep_{file_stem(r0.preset)}.png", png_bytes(fig)


def plot_low_latency(rows: Sequence[EPRow]) -> tuple[str, bytes]:
    """Low-latency mode, balanced routing (else the first scenario), contiguous placement: the
    graph-replayed step, the eager step and one GPU's time for the same tokens, against T per rank;
    the target (2x one GPU) dashed."""
    r0 = rows[0]
    scenario = "balanced" if any(r.scenario == "balanced" for r in rows) else r0.scenario
    placement = r0.placement
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    sel = sorted((r for r in rows if r.scenario == scenario and r.placement == placement and r.rank == STEP),
                 key=lambda r: r.tokens_per_rank)
    for phase, style, label in ((GRAPH, "o-", "EP step, CUDA graph"), ("step", "s:", "EP step, eager"),
                                (SINGLE, "^-", "one GPU, all experts (graph)")):
        pts = [(r.tokens_per_rank, r.median_ms * 1e3) for r in sel if r.phase == phase
               and not math.isnan(r.median_ms)]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label)
            if phase == SINGLE:
                ax.plot([t for t, _ in pts], [2 * v for _, v in pts], "k--", lw=0.8,
                        label="target: 2x one GPU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank (capacity = tokens)")
    ax.set_ylabel("us per layer call (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"low-latency EP, {r0.preset}, N={r0.world_size}, {scenario}, {placement}, {r0.dtype}, "
                 f"{r0.device_name}", fontsize=8)
    return f"ep_low_latency_{file_stem(r0.preset)}.png", png_bytes(fig)


def _ms(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.3g}"


def _us(v: float) -> str:
    return "–" if math.isnan(v) else f"{v * 1e3:.1f}"


def _gbps(row: EPRow | None) -> str:
    if row is None or not row.bytes_sent or math.isnan(row.median_ms) or row.median_ms <= 0:
        return "–"
    return f"{row.bytes_sent / row.median_ms / 1e6:.3g}"


def _worst(rows: Sequence[EPRow], placement: str, scenario: str, phase: str) -> EPRow | None:
    """The rank whose `phase` took longest (median), or None."""
    found = [r for r in (_phase(rows, placement, scenario, k, phase) for k in range(rows[0].world_size))
             if r is not None and not math.isnan(r.median_ms)]
    return max(found, key=lambda r: r.median_ms) if found else None


def _worst_ms(rows: Sequence[EPRow], placement: str, scenario: str, phase: str) -> float:
    r = _worst(rows, placement, scenario, phase)
    return math.nan if r is None else r.median_ms


def _a2a_lines(rows: Sequence[EPRow]) -> list[str]:
    peak = [r for r in rows if r.scenario == A2A_PEAK and r.rank == STEP and r.status == "ok"]
    if not peak:
        return []
    lines = ["## All-to-all peak (this run)", "",
             "A plain `all_to_all_single` of equal splits (bf16), slowest rank; GB/s = bytes leaving "
             "each rank per second.", "", "| MiB per rank | ms | GB/s |", "|---:|---:|---:|"]
    lines += [f"| {r.placement.removesuffix(' MiB')} | {_ms(r.median_ms)} | {_gbps(r)} |" for r in peak]
    return [*lines, ""]


def _normal_lines(rows: Sequence[EPRow]) -> list[str]:
    lines = [f"## Normal mode: {rows[0].tokens_per_rank} tokens per rank", "",
             "Per iteration every rank starts together (barrier), then: dispatch (plan, the count "
             "exchange with its host sync, pack, the row all-to-all), experts, wait (a barrier: idle until "
             "the slowest rank's experts are done), combine (reverse all-to-all, the per-token sum). Each "
             "step ends with a device sync (so the steps add a little). Step = the slowest rank's total, per "
             "iteration; medians over iterations. Comm = the slowest rank's dispatch + combine as a share "
             "of the step; step ÷ experts = the step over the slowest rank's experts phase (the same "
             "per-rank expert work alone on its GPU). Timings of a placement that failed the correctness "
             "check are withheld.", "",
             "Chunks = overlap_chunks (`moekit.parallel.overlap`): n > 1 runs the layer in n token ranges, "
             "one chunk's all-to-alls overlapping another's experts; its phases are summed over the chunks, "
             "each synced (so nothing overlaps in them). Plain step = the whole call, no sync inside, timed "
             "from a barrier to a device sync (the slowest rank's, median): the step as a model runs it. "
             "Non-expert % of plain = (plain step − slowest experts) ÷ plain step: what communication and "
             "waiting still add.", ""]
    lines += ["| placement | scenario | chunks | experts busiest/mean | ranks busiest/mean | step ms "
              "| plain step ms | × balanced | experts ms per rank | max dispatch ms | max combine ms "
              "| comm % of step | step ÷ experts | plain ÷ experts | non-expert % of plain | status |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    steps_table = []
    for placement, scenario in _groups(rows):
        for chunks in _chunk_values(rows):
            sub = _with_chunks(rows, chunks)
            if not any(r.placement == placement and r.scenario == scenario for r in sub):
                continue
            cells = _normal_cells(sub, placement, scenario)
            lines.append(f"| {placement} | {scenario} | {chunks} | {cells}")
            ok = _step(sub, placement, scenario).status == "ok"
            if ok and _worst(sub, placement, scenario, "plan") is not None:
                times = [_ms(_worst_ms(sub, placement, scenario, k)) for k in STEPS]
                rate = [_gbps(_worst(sub, placement, scenario, k)) for k in COMM_STEPS]
                steps_table.append(f"| {placement} | {scenario} | {chunks} | {' | '.join(times)} | "
                                   f"{' | '.join(rate)} |")
    if steps_table:
        lines += ["", "Inside dispatch and combine: each step's slowest rank (ms), and the all-to-alls' "
                  "rate (GB/s leaving that rank, to compare with the peak above).", "",
                  f"| placement | scenario | chunks | {' | '.join(STEPS)} | rows GB/s | back GB/s |",
                  "|---|---|---:|" + "---:|" * (len(STEPS) + 2), *steps_table]
    return [*lines, ""]


def _normal_cells(rows: Sequence[EPRow], placement: str, scenario: str) -> str:
    """The normal table's cells after the chunks column, for one chunk count's rows."""
    n = rows[0].world_size
    step = _step(rows, placement, scenario)
    if step.status != "ok":
        return (f"{step.expert_busiest_over_mean:.2f} | {step.rank_busiest_over_mean:.2f} | "
                + "– | " * 10 + f"failed: {step.reason} |")
    balanced = _phase(rows, placement, "balanced", STEP, "step")
    base = balanced.median_ms if balanced is not None else math.nan
    per_rank = [_phase(rows, placement, scenario, r, "experts") for r in range(n)]
    experts = ", ".join(_ms(r.median_ms) if r else "–" for r in per_rank)
    disp, comb = (_worst_ms(rows, placement, scenario, p) for p in ("dispatch", "combine"))
    worst_experts = _worst_ms(rows, placement, scenario, "experts")
    plain_row = _phase(rows, placement, scenario, STEP, PLAIN)
    plain = plain_row.median_ms if plain_row is not None else math.nan
    ratio = "–" if math.isnan(base) or base <= 0 else f"{step.median_ms / base:.2f}"
    comm = (disp + comb) / step.median_ms * 100 if step.median_ms > 0 else math.nan
    over = step.median_ms / worst_experts if worst_experts > 0 else math.nan
    plain_over = plain / worst_experts if worst_experts > 0 else math.nan
    exposed = (plain - worst_experts) / plain * 100 if plain > 0 else math.nan
    noisy = " noisy" if is_noisy(step.p20_ms, step.p80_ms) else ""
    return (f"{step.expert_busiest_over_mean:.2f} | {step.rank_busiest_over_mean:.2f} | "
            f"{_ms(step.median_ms)} ({_ms(step.p20_ms)}–{_ms(step.p80_ms)}){noisy} | {_ms(plain)} | "
            f"{ratio} | {experts} | {_ms(disp)} | {_ms(comb)} | {_ms(comm)} | {_ms(over)} | "
            f"{_ms(plain_over)} | {_ms(exposed)} | ok |")


def _low_latency_lines(rows: Sequence[EPRow]) -> list[str]:
    lines = ["## Low-latency mode", "",
             "Fixed blocks of C = tokens-per-rank rows to every rank (nothing can overflow), the experts "
             "on the masked layout, no host sync. graph = the whole call (dispatch, experts, combine) "
             "replayed from a CUDA graph, 20 replays back to back per sample; one GPU = the same tokens "
             "through all experts on one GPU (`moe_experts`, a CUDA graph too); target: graph ≤ 2× one "
             "GPU. Eager = the same call with each step synced and timed (steps: slowest rank). Times in "
             "µs; the slowest rank's. Eager plain = the same call with no sync inside, timed whole.", "",
             "| T/rank | placement | scenario | graph µs | one GPU µs | graph ÷ one GPU | eager step µs "
             "| eager plain µs | dispatch | experts | wait | combine | rows GB/s | status |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for tokens in sorted({r.tokens_per_rank for r in rows}):
        sub = [r for r in rows if r.tokens_per_rank == tokens]
        for placement, scenario in _groups(sub):
            at = {r.phase: r for r in sub if r.rank == STEP and r.placement == placement
                  and r.scenario == scenario}
            step = at["step"]
            if step.status != "ok":
                lines.append(f"| {tokens} | {placement} | {scenario} | " + "– | " * 10
                             + f"failed: {step.reason} |")
                continue
            graph, single, plain = at.get(GRAPH), at.get(SINGLE), at.get(PLAIN)
            g = graph.median_ms if graph is not None else math.nan
            one = single.median_ms if single is not None else math.nan
            ratio = g / one if one > 0 else math.nan
            notes = "; ".join(f"{k}: {r.reason}" for k, r in at.items() if r.status != "ok")
            phases = " | ".join(_us(_worst_ms(sub, placement, scenario, p)) for p in PHASES)
            rate = _gbps(_worst(sub, placement, scenario, "rows"))
            lines.append(f"| {tokens} | {placement} | {scenario} | {_us(g)} | {_us(one)} | {_ms(ratio)} | "
                         f"{_us(step.median_ms)} | {_us(plain.median_ms if plain else math.nan)} | "
                         f"{phases} | {rate} | {notes or 'ok'} |")
    return [*lines, ""]


def render(rows: Sequence[EPRow], plot_names: Sequence[str] = ()) -> str:
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
        *switches_lines(r0),
        f"- shape E={r0.num_experts}, H={r0.hidden_size}, I={r0.intermediate_size}, K={r0.top_k}; "
        f"{r0.dtype}; experts backend {r0.backend}",
        *timing_notes(rows),
        "",
    ]
    if r0.mode == "simulated":
        lines += ["Simulated: ranks ran one after the other on one device; no communication is timed "
                  "(dispatch = plan + pack, combine = the per-token sum, wait = none).", ""]
    lines += _a2a_lines(rows)
    normal, low = _normal(rows), _low_latency(rows)
    if normal:
        lines += _normal_lines(normal)
    if low:
        lines += _low_latency_lines(low)
    lines += [f"![{name.removesuffix('.png')}]({name})" for name in plot_names]
    return "\n".join(lines) + "\n"


def output_files(rows: Sequence[EPRow], files: Files = FILES) -> dict[str, str | bytes]:
    """The plots and the report of the latest run in `rows`, rendered in memory (the report last)."""
    rows = latest_run(rows)
    out: dict[str, str | bytes] = {}
    for sel, draw in ((_normal(rows), plot), (_low_latency(rows), plot_low_latency)):
        if sel:
            name, png = draw(sel)
            out[name] = png
    return {**out, files.report: render(rows, list(out))}


STUDY = Study("ep-bench", EPRow, output_files, check=check_row, statuses=STATUSES,
              legacy=(Files("ep_results.csv", "ep_report.md"),))
read_csv = STUDY.read
