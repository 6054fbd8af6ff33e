"""`moekit ablate`'s figures, one per ablation, drawn from result rows alone (time, overhead or bytes
against tokens; eager solid, CUDA graph dashed). An ablation with nothing measured has no figure."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from moekit.bench.ablate_report import (
    ABLATIONS,
    BYTES_VARIANT,
    TILE_VARIANTS,
    AblateRow,
    ablations_in,
    index,
    modes_of,
    relative,
    timed,
)
from moekit.bench.plots import MODE_STYLE, plain_log_y, png_bytes, token_axis
from moekit.bench.results import shape_label

Value = Callable[[AblateRow], float]


def _median(r: AblateRow) -> float:
    return r.median_ms


def _lines(ax: Axes, rows: Sequence[AblateRow], variants: Sequence[str], value: Value,
           order: Sequence[str]) -> int:
    """One line per (variant, mode) of the timed rows where value is finite, a variant's colour from
    its place in `order` (the same in every panel); returns the lines drawn."""
    drawn = 0
    for v in variants:
        i = order.index(v)
        for mode in modes_of(rows):
            pts = sorted((r.tokens, value(r)) for r in rows if r.variant == v and r.mode == mode and timed(r))
            pts = [(t, y) for t, y in pts if math.isfinite(y)]
            if pts:
                ax.plot([t for t, _ in pts], [y for _, y in pts], color=f"C{i % 10}",
                        ls=MODE_STYLE.get(mode, ":"), marker="o", ms=3, label=f"{v} ({mode})")
                drawn += 1
    return drawn


def _axes(ax: Axes, rows: Sequence[AblateRow], ylabel: str, logy: bool) -> None:
    token_axis(ax, {r.tokens for r in rows})
    if logy:
        plain_log_y(ax)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _figure(rows: Sequence[AblateRow], key: str, panels: Sequence[tuple[Sequence[str], Value, str, bool]],
            ) -> tuple[str, tuple[str, bytes]] | None:
    """A figure of one ablation: one axes per (variants, value, y label, log y); None when empty."""
    rs = [r for r in rows if r.variant in ABLATIONS[key][1]]
    fig = Figure(figsize=(8.5 if len(panels) == 1 else 13, 4.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    drawn = 0
    for ax, (variants, value, ylabel, logy) in zip(axes, panels):
        lines = _lines(ax, rs, variants, value, ABLATIONS[key][1])
        _axes(ax, rs, ylabel, logy and lines > 0)
        drawn += lines
    if not drawn:
        return None
    r0 = rs[0]
    fig.suptitle(f"{ABLATIONS[key][0]}\n{shape_label(r0)}, {r0.dtype}, {r0.device_name}", fontsize=9)
    name = f"ablate_{key}_{r0.preset}.png"
    return name, (key, png_bytes(fig))


def _over(rows: Sequence[AblateRow], base: str) -> Value:
    by = index(rows)
    return lambda r: 100 * relative(by, r.variant, base, r.mode, r.tokens)


def _bytes_figure(rows: Sequence[AblateRow]) -> tuple[str, tuple[str, bytes]] | None:
    ok = [r for r in rows if r.variant == BYTES_VARIANT and r.status == "ok"]
    if not ok:
        return None
    tokens = sorted({r.tokens for r in ok})
    read = [sum(r.dram_read_bytes or 0 for r in ok if r.tokens == t) / 1e6 for t in tokens]
    floor = [next(r.floor_bytes for r in ok if r.tokens == t) / 1e6 for t in tokens]
    fig = Figure(figsize=(8.5, 4.6))
    ax = fig.subplots()
    ax.plot(tokens, read, marker="o", label="DRAM bytes read, all kernels of one call")
    ax.plot(tokens, floor, color="k", ls=":", marker="o",
            label="floor's bytes (weights hit + input + output)")
    _axes(ax, ok, "MB", logy=True)
    fig.suptitle(f"{ABLATIONS['bytes'][0]}\n{shape_label(ok[0])}, {ok[0].dtype}, {ok[0].device_name}",
                 fontsize=9)
    return f"ablate_bytes_{ok[0].preset}.png", ("bytes", png_bytes(fig))


def render_plots(rows: Sequence[AblateRow]) -> dict[str, tuple[str, bytes]]:
    """file name -> (ablation, PNG bytes), in ablation order."""
    ms = "median ms per call"
    specs = {
        "move": [(ABLATIONS["move"][1][1:], _over(rows, "gemms"), "% over the GEMMs alone", False)],
        "swiglu": [(ABLATIONS["swiglu"][1], _median, ms, True)],
        "weight": [(ABLATIONS["weight"][1], _median, ms, True),
                   (ABLATIONS["weight"][1], lambda r: r.max_err if r.max_err > 0 else math.nan,
                    "largest error vs the fp32 reference", True)],
        "graph": [(ABLATIONS["graph"][1], _median, ms, True)],
        "tile": [(TILE_VARIANTS, _median, ms, True),
                 (TILE_VARIANTS[::2], lambda r: 100 * r.padding_frac, "padding, % of computed rows", False)],
        "dense": [(ABLATIONS["dense"][1], _median, ms, True)],
        "sort": [(ABLATIONS["sort"][1], _median, ms, True)],
        "masked": [(ABLATIONS["masked"][1], _median, ms, True)],
        "fp8": [(ABLATIONS["fp8"][1], _median, ms, True)],
    }
    out = {}
    for key in ablations_in(rows):
        fig = _bytes_figure(rows) if key == "bytes" else _figure(rows, key, specs[key])
        if fig is not None:
            out[fig[0]] = fig[1]
    return out
