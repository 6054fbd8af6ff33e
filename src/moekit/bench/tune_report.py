"""`moekit tune` results: one row per timing, the report and the plot, for the scaffold.

`moekit.bench.tune` times GEMM1 and GEMM2 candidate tiles alone, then the whole path with each
block_m's winners, then the fastest of those with the opt-in switches (paired tiles, TMA weights,
persistent GEMMs), on dense or block-scaled FP8 expert weights; every timing becomes a `TuneRow`
(long format, provenance in every row, the weights in its `weights` column). The
report (the chosen config per token count, the whole-path time of every block_m and every switch
variant tried) and the plot are drawn from rows read back from the CSV, so `moekit report DIR`
redraws them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from matplotlib.figure import Figure

from moekit.bench.layers import file_stem
from moekit.bench.plots import plain_log_y, png_bytes, token_axis
from moekit.bench.results import (
    FP8,
    LayerRow,
    Provenance,
    check_provenance,
    check_shape_columns,
    positive_problem,
    shape_label,
    switches_lines,
)
from moekit.bench.study import FILES, Files, Study
from moekit.shapes import MoEShape
from moekit.tuning import SWITCH_FIELDS, TILE_FIELDS, ExpertsConfig

PATH, GEMM1, GEMM2 = 0, 1, 2
PER_GEMM = ("block_n", "block_k", "warps", "stages")


@dataclass(frozen=True)
class TuneRow(LayerRow):
    """One timing of `moekit tune`: its run's `Provenance` and layer columns, then the case.

    gemm: 1 = GEMM1 (gate_up + SwiGLU) alone, 2 = GEMM2 (down + routing weight) alone, 0 = the whole
    path (align, both GEMMs, sum). ms: one routing's time (a graph replay of `rotations` different
    routings, divided by rotations). chosen: 1 on the whole-path row whose config went into the
    table. The tile columns are `moekit.tuning.ExpertsConfig`'s tile fields; a GEMM row fills its own
    GEMM's four (and block_m), the other GEMM's are empty. weights: the expert weights the kernels
    ran on, the dtype's name (dense) or "fp8" (block-scaled e4m3, `moekit tune --weights fp8`; the
    activations in `dtype`); empty in CSVs written before the column (dense: `weights_of`).
    """

    rotations: int
    gemm: int
    ms: float
    chosen: int
    block_m: int
    block_n1: int | None
    block_k1: int | None
    warps1: int | None
    stages1: int | None
    block_n2: int | None
    block_k2: int | None
    warps2: int | None
    stages2: int | None
    group_m: int | None
    pair_blocks: int | None = None
    tma_weights: int | None = None   # whole-path rows: 0 / 1 (empty in CSVs written before the switches)
    persistent: int | None = None
    weights: str = ""


CONFIG_FIELDS = TILE_FIELDS + SWITCH_FIELDS


SWITCH_SPAN = 1.25   # block_m whose whole path is within this factor of the fastest get the switch search


def variant_label(cfg: ExpertsConfig | TuneRow) -> str:
    """The opt-in switches a config (or a whole-path row) has on, e.g. "paired+tma"; "" for none: a
    block_m's own tiles (the tuner's base configs set no switch), else a switch variant tried on them."""
    on = [name for name, is_on in (("paired", cfg.pair_blocks == 2), ("tma", cfg.tma_weights),
                                   ("persistent", cfg.persistent)) if is_on]
    return "+".join(on)


def weights_of(row: TuneRow) -> str:
    """The expert weights a row was tuned on: its `weights`, or in rows written before that column
    the dense weights, named by the dtype."""
    return row.weights or row.dtype


def tune_rows(prov: Provenance, preset: str, shape: MoEShape, rotations: int, records: Sequence[dict],
              chosen: ExpertsConfig, *, fp8: bool = False) -> list[TuneRow]:
    """Rows of one token count's records (`moekit.bench.tune.tune_tokens`), `chosen` marked; their
    weights "fp8" with fp8, else the provenance's dtype."""
    weights = FP8 if fp8 else prov.dtype
    rows = []
    for r in records:
        tiles = dict.fromkeys(CONFIG_FIELDS[1:])
        if r["gemm"] == PATH:
            cfg = ExpertsConfig(**{k: r.get(k, False) for k in CONFIG_FIELDS})   # switches: off if absent
            tiles.update({k: getattr(cfg, k) for k in TILE_FIELDS[1:]})
            tiles.update({k: int(getattr(cfg, k)) for k in SWITCH_FIELDS})
            is_chosen = cfg == chosen
        else:
            tiles.update({f"{k}{r['gemm']}": r[k] for k in PER_GEMM})
            is_chosen = False
        rows.append(TuneRow(**asdict(prov), preset=preset, num_experts=shape.num_experts,
                            hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                            top_k=shape.top_k, tokens=r["tokens"], rotations=rotations, gemm=r["gemm"],
                            ms=r["ms"], chosen=int(is_chosen), block_m=r["block_m"], **tiles,
                            weights=weights))
    return rows


def check_row(row: TuneRow) -> str:
    """"" when a row can be reported; else what is wrong with it."""
    problem = check_provenance(row) or check_shape_columns(row) or \
        positive_problem(row, "rotations", "ms", "block_m")
    if not problem and row.gemm not in (PATH, GEMM1, GEMM2):
        problem = f"column 'gemm' must be 0 (whole path), 1 or 2, got {row.gemm}"
    if not problem and row.chosen not in (0, 1):
        problem = f"column 'chosen' must be 0 or 1, got {row.chosen}"
    if not problem and row.weights not in ("", FP8, row.dtype):
        problem = f"column 'weights' must be {FP8!r} or the dtype {row.dtype!r}, got {row.weights!r}"
    return problem


def _us(ms: float) -> str:
    return "–" if math.isnan(ms) else f"{ms * 1e3:,.1f}"


def _tiles(r: TuneRow, gemm: int) -> str:
    return "×".join(str(getattr(r, f"{k}{gemm}")) for k in ("block_n", "block_k")) + \
        f", {getattr(r, f'warps{gemm}')}w, {getattr(r, f'stages{gemm}')}s"


def plot(rows: Sequence[TuneRow]) -> tuple[str, bytes]:
    """Whole-path time per routing vs tokens, one line per block_m (its tiles alone); the chosen
    configs circled (a switch variant where one won)."""
    r0 = rows[0]
    paths = [r for r in rows if r.gemm == PATH]
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    for bm in sorted({r.block_m for r in paths}):     # each block_m's own tiles, no switch variant
        pts = sorted((r.tokens, r.ms * 1e3) for r in paths if r.block_m == bm and not variant_label(r))
        ax.plot([t for t, _ in pts], [us for _, us in pts], marker="o", ms=3, label=f"block_m {bm}")
    chosen = sorted((r.tokens, r.ms * 1e3) for r in paths if r.chosen)
    ax.plot([t for t, _ in chosen], [us for _, us in chosen], ls="none", marker="o", ms=9, mfc="none",
            mec="k", label="chosen")
    token_axis(ax, {r.tokens for r in paths})
    plain_log_y(ax)
    ax.set_ylabel("whole path, µs per routing")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"moekit tune: {shape_label(r0)}, {_weights_label(r0)}, {r0.device_name}", fontsize=9)
    return f"tune_{file_stem(r0.preset)}.png", png_bytes(fig)


def _weights_label(r: TuneRow) -> str:
    """"bfloat16", or "fp8 weights, bfloat16 activations"."""
    weights = weights_of(r)
    return r.dtype if weights == r.dtype else f"{weights} weights, {r.dtype} activations"


def _path_us(r: TuneRow | None, chosen: TuneRow | None) -> str:
    """A whole path's µs, in bold when it is the chosen one."""
    if r is None:
        return _us(math.nan)
    return "**" + _us(r.ms) + "**" if r is chosen else _us(r.ms)


def render(rows: Sequence[TuneRow], plot_name: str, files: Files = FILES) -> str:
    r0 = rows[0]
    tokens = sorted({r.tokens for r in rows})
    block_ms = sorted({r.block_m for r in rows if r.gemm == PATH and not variant_label(r)})
    lines = [
        f"# moekit tune: {r0.preset} on {r0.device_name}", "",
        f"- run {', '.join(sorted({r.run_id for r in rows}))}, {r0.date}, commit `{r0.commit or 'unknown'}`",
        f"- torch {r0.torch_version}, triton {r0.triton_version}, python {r0.python_version}, "
        f"moekit {r0.moekit_version}; ceilings copy {r0.copy_gbps:,.1f} GB/s, matmul "
        f"{r0.matmul_tflops:,.3g} TFLOP/s",
        *switches_lines(r0),
        f"- shape E={r0.num_experts}, H={r0.hidden_size}, I={r0.intermediate_size}, K={r0.top_k}; "
        f"{_weights_label(r0)}",
        "",
        "For each T and block_m, GEMM1's and GEMM2's tiles were timed alone (CUDA-graph replays of "
        "`rotations` different routings, per routing), then the whole path with each block_m's winners, "
        f"then those within {SWITCH_SPAN:g}× of the fastest with the opt-in switches (paired tiles, TMA "
        "weights, persistent GEMMs); the fastest whole path was chosen. Tiles: block_n×block_k, warps, "
        "stages.",
        "",
        "| T | rotations | chosen block_m | GEMM1 tile | GEMM2 tile | group_m | switches | "
        "GEMM1 candidates | GEMM2 candidates | " + " | ".join(f"path µs, block_m {bm}" for bm in block_ms)
        + " | path µs with switches |",
        "|---:|---:|---:|---|---|---:|---|---:|---:|" + "---:|" * len(block_ms) + "---|",
    ]
    for t in tokens:
        rs = [r for r in rows if r.tokens == t]
        chosen = next((r for r in rs if r.gemm == PATH and r.chosen), None)
        path = {r.block_m: r for r in rs if r.gemm == PATH and not variant_label(r)}
        counts = [sum(r.gemm == g for r in rs) for g in (GEMM1, GEMM2)]
        head = (f"{chosen.block_m} | {_tiles(chosen, 1)} | {_tiles(chosen, 2)} | {chosen.group_m} | "
                f"{variant_label(chosen).replace('+', ', ') or 'none'}" if chosen else "– | – | – | – | –")
        tried = [r for r in rs if r.gemm == PATH and variant_label(r)]
        several = len({r.block_m for r in tried}) > 1       # then each variant names its block_m
        variants = ", ".join(f"{f'block_m {r.block_m} ' if several else ''}{variant_label(r)} "
                             f"{_path_us(r, chosen)}" for r in tried) or "–"
        lines.append(f"| {t} | {rs[0].rotations} | {head} | {counts[0]} | {counts[1]} | "
                     + " | ".join(_path_us(path.get(bm), chosen) for bm in block_ms) + f" | {variants} |")
    lines += ["", f"![whole path per block_m]({plot_name})", "",
              f"Data: `{files.csv}` (one row per timing, long format, provenance in every row). Redraw "
              "the plot and this report with `moekit report <this folder>`.", ""]
    return "\n".join(lines)


def output_files(rows: Sequence[TuneRow], files: Files = FILES) -> dict[str, str | bytes]:
    """The plot and the report, rendered in memory (the report last)."""
    name, png = plot(rows)
    return {name: png, files.report: render(rows, name, files)}


STUDY = Study("tune", TuneRow, output_files, check=check_row, statuses=None)
