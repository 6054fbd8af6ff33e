"""PNG plots drawn from result rows alone (never from live measurements), one set per preset
(<preset>: the layer's name as a file name carries it, `moekit.bench.layers.file_stem`):

    time_<preset>.png       median time vs tokens, log-log, p20-p80 band, the floor dotted (and the
                            FP8 floor, grey, for rows on FP8 weights: a backend's "fp8" line)
    floor_pct_<preset>.png  % of floor vs tokens
    launches_<preset>.png   kernels per call vs tokens, log-log
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

# Figure objects without pyplot: no global state and no display backend (the Agg canvas is used
# to write PNGs), so plotting works the same on servers, CI and inside other programs.
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

from moekit.bench.layers import file_stem
from moekit.bench.results import ResultRow, shape_label

MODE_STYLE = {"eager": "-", "graph": "--"}


def series(rows: Sequence[ResultRow], preset: str) -> dict[tuple[str, str], list[ResultRow]]:
    """Timed rows of one preset keyed (backend, mode) in order of appearance, sorted by tokens (a
    backend on FP8 weights is its own: "triton fp8")."""
    out: dict[tuple[str, str], list[ResultRow]] = {}
    for r in rows:
        if r.preset == preset and r.status == "ok":
            out.setdefault((r.series, r.mode), []).append(r)
    return {k: sorted(v, key=lambda r: r.tokens) for k, v in out.items()}


def _styles(rows: Sequence[ResultRow], preset: str) -> dict[tuple[str, str], dict]:
    """One colour per backend, one line style per mode, so eager and graph pair up visually."""
    backends = list(dict.fromkeys(r.series for r in rows if r.preset == preset))
    colors = {b: f"C{i % 10}" for i, b in enumerate(backends)}
    return {(b, m): dict(color=colors[b], ls=MODE_STYLE.get(m, ":"), label=f"{b} ({m})", marker="o", ms=3)
            for b, m in series(rows, preset)}


def floor_by_tokens(rows: Sequence[ResultRow], preset: str, fp8: bool = False) -> list[tuple[int, float]]:
    """(T, floor ms) of one preset: the dense weights' floor, or with fp8 the FP8 weights'."""
    seen: dict[int, float] = {}
    for r in rows:
        if r.preset == preset and r.on_fp8 == fp8 and not math.isnan(r.floor_ms):
            seen.setdefault(r.tokens, r.floor_ms)
    return sorted(seen.items())


def _subtitle(rows: Sequence[ResultRow], preset: str) -> str:
    r = next(r for r in rows if r.preset == preset)
    return (f"{shape_label(r)}, "
            f"{r.dtype}, {r.device_name}\nceilings: {r.copy_gbps:.1f} GB/s copy, "
            f"{r.matmul_tflops:.2f} TFLOP/s matmul")


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG, in memory (files are written only once every output is rendered)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def token_axis(ax: Axes, tokens) -> None:
    """A log2 x axis of token counts, ticked at the measured ones only."""
    tokens = sorted(tokens)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("tokens T")


def plain_log_y(ax: Axes) -> None:
    """A log y axis labelled with plain numbers at 1-2-5 steps (they read better than 10^n labels
    over one or two decades)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _axes(rows: Sequence[ResultRow], preset: str, title: str, ylabel: str,
          logy: bool) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    token_axis(ax, {r.tokens for r in rows if r.preset == preset})
    if logy:
        plain_log_y(ax)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{_subtitle(rows, preset)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _legend(ax: Axes) -> None:
    if not ax.get_legend_handles_labels()[0]:
        return  # nothing timed: no legend (matplotlib would warn)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def plot_time(rows: Sequence[ResultRow], preset: str) -> tuple[str, bytes]:
    fig, ax = _axes(rows, preset, "time per call (band: p20 to p80)", "median time (ms)", logy=True)
    styles = _styles(rows, preset)
    for key, rs in series(rows, preset).items():
        t = [r.tokens for r in rs]
        ax.plot(t, [r.median_ms for r in rs], **styles[key])
        ax.fill_between(t, [r.p20_ms for r in rs], [r.p80_ms for r in rs], color=styles[key]["color"],
                        alpha=0.12)
    for fp8, color, label in ((False, "k", "floor"), (True, "0.55", "FP8 floor")):
        floor = floor_by_tokens(rows, preset, fp8)
        if floor:
            ax.plot([t for t, _ in floor], [f for _, f in floor], color=color, ls=":", lw=2, label=label)
    _legend(ax)
    return f"time_{file_stem(preset)}.png", png_bytes(fig)


def plot_floor_pct(rows: Sequence[ResultRow], preset: str) -> tuple[str, bytes]:
    fig, ax = _axes(rows, preset, "% of floor (floor / time; 100% = at the roof)", "% of floor", logy=False)
    styles = _styles(rows, preset)
    for key, rs in series(rows, preset).items():
        ax.plot([r.tokens for r in rs], [r.pct_floor for r in rs], **styles[key])
    ax.axhline(100, color="k", ls=":", lw=1.5)
    ax.set_ylim(bottom=0)
    _legend(ax)
    return f"floor_pct_{file_stem(preset)}.png", png_bytes(fig)


def plot_launches(rows: Sequence[ResultRow], preset: str) -> tuple[str, bytes]:
    fig, ax = _axes(rows, preset, "kernel launches per call", "kernels per call", logy=True)
    styles = _styles(rows, preset)
    for key, rs in series(rows, preset).items():
        pts = [(r.tokens, r.kernels) for r in rs if r.kernels]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **styles[key])
    _legend(ax)
    return f"launches_{file_stem(preset)}.png", png_bytes(fig)


def presets_of(rows: Sequence[ResultRow]) -> list[str]:
    return list(dict.fromkeys(r.preset for r in rows))


def render_all(rows: Sequence[ResultRow]) -> dict[str, bytes]:
    """Every plot for every preset in `rows`: file name -> PNG bytes (nothing written)."""
    return dict(plot(rows, preset) for preset in presets_of(rows)
                for plot in (plot_time, plot_floor_pct, plot_launches))
