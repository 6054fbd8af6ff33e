"""`moekit ablate` results: the catalogue of ablations and variants, the rows, the report, for the
scaffold.

Each ablation compares variants of the expert path; each variant is one row per (T, mode) (long
format, provenance in every row), measured by `moekit.bench.ablate` and implemented in
`moekit.bench.ablate_variants`. The report (one section per ablation, each with a sentence that
puts the measurement beside the article's number) and the figures (`moekit.bench.ablate_plots`)
are drawn from rows read back from the CSV alone, so `moekit report DIR` redraws them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moekit import align
from moekit.bench import results
from moekit.bench.results import LayerRow, MeasuredColumns
from moekit.bench.study import FILES, Files, Study, code_lines, cpu_run_note, fmt_number

TILE_HEIGHTS = (16, 32, 64, 128)
TILE_VARIANTS = tuple(f"tile_{bm}{'x2' if pair == 2 else ''}" for bm in TILE_HEIGHTS for pair in (1, 2))
BYTES_VARIANT = "dram_bytes"
MODES = ("eager", "graph")

# The variants, in report order: name -> what it runs (the report's legend; `ablate_variants`
# implements each name).
VARIANTS: dict[str, str] = {
    "gemms": "the grouped GEMMs alone, on rows already in expert order: x is permuted outside the timed "
             "call, GEMM1 + SwiGLU and GEMM2 (unweighted) read and write contiguous rows",
    "index_add": "permute by gather (x[token of each sorted pair]) -> the grouped GEMMs on contiguous rows "
                 "-> unpermute: times the routing weight, index_add_ into the (T, H) output (Transformers' "
                 "grouped_mm path)",
    "gather_sum": "permute by gather -> the grouped GEMMs on contiguous rows -> gather the rows back to "
                  "(token, slot) order, times the weight, sum over the K slots",
    "fused": "the fused kernels on the same alignment: GEMM1 gathers token rows on load, GEMM2 applies "
             "the weight and scatters to (token, slot) rows on store, then the slot sum (moe_sum)",
    "layer": "the whole triton path with the tuned tiles: align -> GEMM1 + SwiGLU -> GEMM2 + weight -> sum "
             "(what moe_experts(backend='triton') runs)",
    "swiglu_separate": "the whole path with GEMM1's epilogue switched off (constexpr SWIGLU=False): GEMM1 "
                       "writes [gate | up] (rows, 2I), then silu(gate) * up as a separate PyTorch pass",
    "weight_separate": "the whole path with GEMM2's epilogue switched off (constexpr MUL_W=False): GEMM2 "
                       "writes unweighted rows in the dtype, then a separate in-place multiply by the "
                       "routing weight",
    **{name: f"the whole path with block_m = {name.split('_')[1].removesuffix('x2')}"
             + (", paired tiles" if name.endswith("x2") else "") for name in TILE_VARIANTS},
    "grouped_gemms": "the fused grouped kernels alone (GEMM1 + SwiGLU, GEMM2 + weight) on a given alignment, "
                     "no sum",
    "dense": "the same FLOPs as two dense matmuls: T·K rows (each token repeated K times) through expert 0, "
             "torch.nn.functional.linear (cuBLAS on a GPU), silu(gate) * up between them",
    "align_torch": "align_block_size(backend='torch'): sort + histogram + cumsum in PyTorch ops",
    "align_triton": "align_block_size(backend='triton')",
    "masked": "moe_experts(backend='masked'): pairs scattered into the (E, C = T·K, H) layout, GEMMs that "
              "skip the rows past each expert's count, weighted combine",
    "fp8": "the whole triton path on the layer's weights in block-scaled FP8 (e4m3, one fp32 scale per "
           "128 × 128 block, quantized once): moe_experts(backend='triton') on Fp8Weights, w8a8 grouped "
           "GEMMs above the decode bound, w8a16 decode kernels below; checked against the FP8 oracle, its "
           "floor from the FP8 bytes and the FP8 matmul ceiling",
    BYTES_VARIANT: "DRAM bytes read and written by each kernel of one `layer` call (Nsight Compute)",
}

# How the code drawing the report runs a variant, beyond its legend: a description of the code, not
# of the rows, written under the legend only for rows that code measured (`study.code_lines`).
CODE: dict[str, str] = {
    "align_triton": f"`align_triton` at this commit: one Triton launch up to "
                    f"{max(align.FUSED_MAX_PAIRS, align.ONE_LAUNCH_MAX_PAIRS):,} pairs, three above.",
}

# Ablation -> (section title, its variants; the first is the one the others are compared with).
ABLATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "move": ("Moving the tokens: separate passes vs the fused kernel",
             ("gemms", "index_add", "gather_sum", "fused")),
    "swiglu": ("SwiGLU in GEMM1's epilogue vs a separate pass", ("layer", "swiglu_separate")),
    "weight": ("Routing weight in GEMM2's epilogue vs a separate multiply", ("layer", "weight_separate")),
    "graph": ("The whole layer in a CUDA graph vs eager", ("layer",)),
    "tile": ("Tile height: time and padding", TILE_VARIANTS),
    "dense": ("The dense-matmul equivalent", ("dense", "grouped_gemms")),
    "sort": ("Sort cost: align alone", ("align_torch", "align_triton")),
    "bytes": ("Bytes actually read (Nsight Compute)", (BYTES_VARIANT,)),
    "masked": ("Masked layout vs contiguous at decode sizes", ("layer", "masked")),
    "fp8": ("Dense weights vs block-scaled FP8 weights", ("layer", "fp8")),
}


def ablations_in(rows: Sequence[AblateRow]) -> list[str]:
    """The ablations these rows hold, in `ABLATIONS` order: each with a row of a variant of its own
    (`layer` is several comparisons' baseline, so its rows alone do not say that they ran), and one
    whose only variant is shared (the graph ablation: `layer`, eager and replayed) where it has rows."""
    variants = {r.variant for r in rows}
    shared = {v for _, vs in ABLATIONS.values() for v in vs
              if sum(v in other for _, other in ABLATIONS.values()) > 1}
    return [key for key, (_, vs) in ABLATIONS.items() if variants & (set(vs) - shared or set(vs))]


@dataclass(frozen=True)
class AblateCase(LayerRow):
    """The run's `Provenance` and layer columns, then the case: variant (a key of `VARIANTS`) and
    mode ("eager", or "graph" for CUDA-graph replays)."""

    seed: int
    variant: str
    mode: str


@dataclass(frozen=True)
class AblateRow(MeasuredColumns, AblateCase):
    """One measurement of `moekit ablate`: its case, the measurement (`MeasuredColumns`), then:

    tol: the gate's error budget; busy_ms, idle_pct: device busy time and idle share (NaN on the
    CPU). block_m, pair_blocks: the tiles of a contiguous-layout variant; padded_rows: rows its
    tiles compute (each expert's pairs rounded up to a multiple of block_m); pairs: the T·K pairs.
    dram_bytes rows: one kernel of one call (`kernel`), its DRAM bytes, and the floor's byte count.
    """

    tol: float = math.nan
    busy_ms: float = math.nan
    idle_pct: float = math.nan
    block_m: int | None = None
    pair_blocks: int | None = None
    padded_rows: int | None = None
    pairs: int | None = None
    kernel: str = ""
    dram_read_bytes: int | None = None
    dram_write_bytes: int | None = None
    floor_bytes: int | None = None

    @property
    def padding_frac(self) -> float:
        """Fraction of the computed rows that are padding: 1 - pairs / padded_rows."""
        if not self.padded_rows or self.pairs is None:
            return math.nan
        return 1.0 - self.pairs / self.padded_rows


def check_row(row: AblateRow) -> str:
    """"" when a row can be reported; else what is wrong with it."""
    problem = results.check_provenance(row) or results.check_shape_columns(row)
    if problem:
        return problem
    if row.variant not in VARIANTS:
        return f"column 'variant' must be one of {list(VARIANTS)}, got {row.variant!r}"
    if row.mode not in MODES:
        return f"column 'mode' must be one of {MODES}, got {row.mode!r}"
    if row.padded_rows is not None and row.pairs is not None and not 0 <= row.pairs <= row.padded_rows:
        return f"column 'pairs' must lie in [0, padded_rows = {row.padded_rows}], got {row.pairs}"
    if row.status != "ok":
        return ""
    if row.variant == BYTES_VARIANT:
        counts = (row.dram_read_bytes, row.dram_write_bytes)
        return results.positive_problem(row, "floor_bytes") or (
            "" if row.kernel and all(n is not None and n >= 0 for n in counts)
            else "a dram_bytes row needs a kernel name and byte counts >= 0")
    return results.positive_problem(row, "median_ms", "p20_ms", "p80_ms")


Key = tuple[str, str, int]          # (variant, mode, tokens)


def index(rows: Sequence[AblateRow]) -> dict[Key, AblateRow]:
    """Timing rows (not dram_bytes) by (variant, mode, tokens)."""
    return {(r.variant, r.mode, r.tokens): r for r in rows if r.variant != BYTES_VARIANT}


def timed(r: AblateRow | None) -> bool:
    return r is not None and r.status == "ok" and not math.isnan(r.median_ms)


def modes_of(rows: Sequence[AblateRow]) -> list[str]:
    return [m for m in MODES if any(r.mode == m for r in rows)]


def tokens_of(rows: Sequence[AblateRow], variants: Sequence[str]) -> list[int]:
    return sorted({r.tokens for r in rows if r.variant in variants})


def relative(by: dict[Key, AblateRow], variant: str, base: str, mode: str, t: int) -> float:
    """time(variant) / time(base) - 1 at (mode, T); NaN unless both were timed."""
    r, b = by.get((variant, mode, t)), by.get((base, mode, t))
    return r.median_ms / b.median_ms - 1.0 if timed(r) and timed(b) else math.nan


def pct(v: float) -> str:
    """A signed percentage ("+13%", "−4%"; "±0%" below half a percent; "–" for NaN)."""
    if math.isnan(v):
        return "–"
    return "±0%" if round(100 * v) == 0 else f"{100 * v:+,.0f}%".replace("-", "−")


def _cell(r: AblateRow | None, value: Callable[[AblateRow], str]) -> str:
    if r is None:
        return ""
    return value(r) if r.status == "ok" else r.status.replace("_", " ")


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)] + \
        ["| " + " | ".join(cells) + " |" for cells in body]


def _compare_table(rows: Sequence[AblateRow], variants: Sequence[str]) -> list[str]:
    """T, mode, then each variant's median ms; after the first (the base), ms (vs the base)."""
    by, base = index(rows), variants[0]
    body = []
    for t in tokens_of(rows, variants):
        for mode in modes_of(rows):
            if not any((v, mode, t) in by for v in variants):
                continue
            cells = [str(t), mode]
            for v in variants:
                rel = "" if v == base else f" ({pct(relative(by, v, base, mode, t))})"
                cells.append(_cell(by.get((v, mode, t)), lambda r, rel=rel: fmt_number(r.median_ms) + rel))
            body.append(cells)
    head = ["T", "mode", *(f"{v} ms" if v == base else f"{v} ms (vs {base})" for v in variants)]
    return _table(head, body)


def _here(rows: Sequence[AblateRow], variants: Sequence[str]) -> tuple[str, int] | None:
    """(mode, T) where the article's comparison is quoted: the largest T with every variant timed,
    in graph mode when there is one (CUDA graphs time the GPU's work, as the article's GPU time)."""
    by = index(rows)
    for mode in sorted(modes_of(rows), key=lambda m: m != "graph"):
        done = [t for t in tokens_of(rows, variants) if all(timed(by.get((v, mode, t))) for v in variants)]
        if done:
            return mode, max(done)
    return None


def _legend(rows: Sequence[AblateRow], variants: Sequence[str]) -> list[str]:
    """Each variant's legend, then how the code runs those with more to say (`CODE`): `code_lines`."""
    variants = list(dict.fromkeys(variants))
    code = code_lines(rows, *(CODE[v] for v in variants if v in CODE))
    return [f"- `{v}`: {VARIANTS[v]}" for v in variants] + [""] + ([*code, ""] if code else [])


# What the article measured (RTX 4060 laptop GPU, bf16, Qwen3-30B-A3B's shape), per ablation.
ARTICLE: dict[str, str] = {
    "move": "The article measured +25% to +45% with index_add_ and +18% to +27% with gather-sum at 2,048 "
            "to 8,192 tokens; its fused kernel left only the sort and the final sum.",
    "swiglu": "The article's whole layer took 35.4 ms with the separate pass and 31.8 ms fused at 8,192 "
              "tokens (+11%), 10.8 and 10.0 ms at 2,048 (+8%), and within 0.1 ms of each other up to 64 "
              "tokens, where reading the weights dominates.",
    "weight": "The article saw the fused versions' largest errors at 0.4× to 0.8× the others' (the weight "
              "and SwiGLU applied in fp32 before one rounding).",
    "graph": "The article's one-token layer took 0.98 ms eager and 0.46 ms in a graph (34 kernels replayed, "
             "most of them its PyTorch align step). Idle % = 1 − device busy time / wall time (GPU only).",
    "tile": "The article found 1% to 24% extra rows at tile heights of 16 to 64 (up to 8,192 tokens), and "
            "vLLM's default picks 128-row tiles above 512 tokens.",
    "dense": "The article measured 29.8 ms against cuBLAS's 26.3 ms at 8,192 tokens (+13%): the gather, the "
             "padding and the down projection's short K = 768 loop. (The dense variant here also pays a "
             "separate SwiGLU pass, which the grouped GEMM1 fuses.)",
    "sort": "The article's PyTorch align took 0.16 ms of GPU time at 8,192 tokens and was most of the 34 "
            "kernels its one-token graph replayed (vLLM does the step in one CUDA kernel, as moekit's "
            "Triton align does).",
    "bytes": "The article's two Triton kernels read 75.5 MB from DRAM for one token, exactly the 8 experts "
             "hit, and 1.20 GB for 64 tokens (127 of 128 experts).",
    "masked": "The article has no number for it: DeepGEMM keeps the masked layout for decode under CUDA "
              "graphs, where the host never learns the per-expert counts.",
    "fp8": "The article has no FP8 number (its kernels read bf16 weights). FP8 weights and their scales "
           "are about half of bf16's bytes, so below the crossover the floor halves; above it the FLOPs "
           "run on the FP8 tensor cores' roof.",
}


def _at(rows: Sequence[AblateRow], variants: Sequence[str]) -> str:
    """"Here, at T = t (mode)": where a comparison is quoted, saying on the CPU what the times are."""
    where = _here(rows, variants)
    cpu = " (interpreter timings, not GPU ones)" if rows[0].device_type == "cpu" else ""
    return f"Here{cpu}, at T = {where[1]} ({where[0]})" if where else f"Here{cpu}, with no T fully timed"


def _rel(rows: Sequence[AblateRow], variant: str, base: str) -> str:
    where = _here(rows, (variant, base))
    return pct(relative(index(rows), variant, base, *where)) if where else "–"


def _spread(values: Sequence[float], unit: str) -> str:
    v = sorted(values)
    if not v:
        return "–"
    return f"{v[0]:.2g}{unit}" if v[0] == v[-1] else f"{v[0]:.2g}{unit} to {v[-1]:.2g}{unit}"


# (variant, base, subject, against): sentences "<where>, <subject> took <variant vs base> against <...>".
RELATIVE = {
    "swiglu": ("swiglu_separate", "layer", "the layer with a separate SwiGLU pass", "the fused epilogue"),
    "dense": ("grouped_gemms", "dense", "the grouped kernels", "two dense matmuls of the same FLOPs"),
    "masked": ("masked", "layer", "the masked layout", "the contiguous one"),
    "fp8": ("fp8", "layer", "the layer on FP8 weights", "the dense weights"),
}


def _here_move(rows: Sequence[AblateRow]) -> str:
    over = [_rel(rows, v, "gemms") for v in ("index_add", "gather_sum", "fused")]
    return (f"{_at(rows, ABLATIONS['move'][1])}, moving the rows in separate passes took {over[0]} "
            f"(index_add_) and {over[1]} (gather-sum) over the GEMMs alone, the fused kernels {over[2]}.")


def _here_weight(rows: Sequence[AblateRow]) -> str:
    by = index(rows)
    ratios = [r.max_err / s.max_err for (v, m, t), r in by.items() if v == "layer"
              for s in [by.get(("weight_separate", m, t))] if timed(r) and timed(s) and s.max_err > 0]
    return (f"{_at(rows, ABLATIONS['weight'][1])}, the layer with a separate multiply took "
            f"{_rel(rows, 'weight_separate', 'layer')} against the fused epilogue, and at every T the fused "
            "weight's largest error "
            f"against fp32 was {_spread(ratios, '×')} the separate multiply's"
            + (" (in fp32 both round alike)." if rows[0].dtype == "float32" else "."))


def _here_graph(rows: Sequence[AblateRow]) -> str:
    by = index(rows)
    e, g = by.get(("layer", "eager", 1)), by.get(("layer", "graph", 1))
    if not timed(e):
        return "Here T = 1 was not timed eagerly."
    cpu = " (an interpreter timing, not a GPU one)" if rows[0].device_type == "cpu" else ""
    graph = f" and {_ms(g)} ms in a graph" if timed(g) else " (no CUDA graph on this device)"
    return f"Here{cpu}, the one-token layer took {_ms(e)} ms eager in {e.kernels} kernels per call{graph}."


def _here_tile(rows: Sequence[AblateRow]) -> str:
    fracs = [100 * r.padding_frac for r in rows if r.variant in TILE_VARIANTS and (r.block_m or 0) <= 64
             and not math.isnan(r.padding_frac)]
    return (f"Here padding to 16 to 64 rows made {_spread(fracs, '%')} of the computed rows padding (a "
            "count, exact on any device).")


def _here_sort(rows: Sequence[AblateRow]) -> str:
    by, where = index(rows), _here(rows, ABLATIONS["sort"][1])
    times = [f"{_ms(by[v, where[0], where[1]])} ms ({v.removeprefix('align_')})"
             for v in ABLATIONS["sort"][1]] if where else ["–"]
    return f"{_at(rows, ABLATIONS['sort'][1])}, align alone took {' and '.join(times)}."


def _here_bytes(rows: Sequence[AblateRow]) -> str:
    ok = any(r.status == "ok" for r in rows)
    return "Here: the counters above." if ok else "Here the counters could not be read (reasons above)."


def _here_relative(key: str) -> Callable[[Sequence[AblateRow]], str]:
    variant, base, subject, against = RELATIVE[key]

    def here(rows: Sequence[AblateRow]) -> str:
        return f"{_at(rows, (variant, base))}, {subject} took {_rel(rows, variant, base)} against {against}."

    return here


HERE: dict[str, Callable[[Sequence[AblateRow]], str]] = {
    "move": _here_move, "weight": _here_weight, "graph": _here_graph, "tile": _here_tile,
    "sort": _here_sort, "bytes": _here_bytes, **{key: _here_relative(key) for key in RELATIVE},
}


def _weight_errors(rows: Sequence[AblateRow]) -> list[str]:
    by = index(rows)
    body = []
    for t in tokens_of(rows, ("layer", "weight_separate")):
        for mode in modes_of(rows):
            fused, sep = by.get(("layer", mode, t)), by.get(("weight_separate", mode, t))
            if fused is None or sep is None:
                continue
            ratio = f"{fused.max_err / sep.max_err:.2g}×" if sep.max_err > 0 else "–"
            body.append([str(t), mode, *(f"{v:.3g}" for v in (fused.max_err, sep.max_err, fused.tol)), ratio])
    return ["", "Largest error against the fp32 reference (tolerance: 2× plain PyTorch's in the dtype):",
            "", *_table(["T", "mode", "fused", "separate", "tolerance", "fused / separate"], body)]


def _ms(r: AblateRow) -> str:
    return fmt_number(r.median_ms)


def _graph_table(rows: Sequence[AblateRow]) -> list[str]:
    by = index(rows)
    body = []
    for t in tokens_of(rows, ("layer",)):
        e, g = by.get(("layer", "eager", t)), by.get(("layer", "graph", t))
        speed = f"{e.median_ms / g.median_ms:.2g}×" if timed(e) and timed(g) else "–"
        idle = [_cell(r, lambda r: fmt_number(r.idle_pct, 2)) for r in (e, g)]
        body.append([str(t), _cell(e, _ms), _cell(g, _ms), speed, _cell(e, lambda r: fmt_number(r.kernels)),
                     *idle, _cell(g, lambda r: f"{r.pct_floor:.0f}%")])
    return _table(["T", "eager ms", "graph ms", "graph speed-up", "kernels per call", "idle % eager",
                   "idle % graph", "graph, % of floor"], body)


def _tile_tables(rows: Sequence[AblateRow]) -> list[str]:
    by = index(rows)
    lines = ["Paired tiles (x2, `ExpertsConfig.pair_blocks = 2`) keep block_m's padding but compute in tiles "
             "of 2·block_m where two of an expert's blocks follow each other."]
    for mode in modes_of(rows):
        body = [[str(t), *(_cell(by.get((v, mode, t)), lambda r: f"{_ms(r)} ({100 * r.padding_frac:.0f}%)")
                           for v in TILE_VARIANTS)]
                for t in tokens_of(rows, TILE_VARIANTS) if any((v, mode, t) in by for v in TILE_VARIANTS)]
        if body:
            lines += ["", f"{mode}: median ms (padding, % of the computed rows)", "",
                      *_table(["T", *TILE_VARIANTS], body)]
    return lines


def _bytes_list(rows: Sequence[AblateRow]) -> list[str]:
    lines = []
    for t in sorted({r.tokens for r in rows}):
        rs = [r for r in rows if r.tokens == t]
        ok = [r for r in rs if r.status == "ok"]
        if not ok:
            lines.append(f"- T = {t}: **skipped**: {'; '.join(dict.fromkeys(r.reason for r in rs))}")
            continue
        read, floor = sum(r.dram_read_bytes or 0 for r in ok), ok[0].floor_bytes
        kernels = ", ".join(f"{r.kernel} {fmt_number(r.dram_read_bytes)} B read, "
                            f"{fmt_number(r.dram_write_bytes)} B written" for r in ok)
        lines.append(f"- T = {t}: {fmt_number(read)} bytes read from DRAM, {read / floor:.2f}× the floor's "
                     f"{fmt_number(floor)} bytes ({kernels})")
    return lines


def _not_timed(rows: Sequence[AblateRow]) -> list[str]:
    bad = [r for r in rows if r.status != "ok" and r.variant != BYTES_VARIANT]
    return ["## Not timed", "", "Failed the fp32 gate (never timed), raised, or cannot run here:", "",
            *(f"- T={r.tokens} {r.variant} ({r.mode}): **{r.status.replace('_', ' ')}**: {r.reason}"
              for r in bad), ""] if bad else []


def _fp8_floors(rows: Sequence[AblateRow]) -> list[str]:
    """Each variant against its own floor: the dense weights', the FP8 weights' (FP8 bytes, FP8 roof)."""
    by, variants = index(rows), ABLATIONS["fp8"][1]
    body = [[str(t), mode, *(_cell(by.get((v, mode, t)), lambda r: f"{r.pct_floor:.2g}%") for v in variants)]
            for t in tokens_of(rows, variants) for mode in modes_of(rows)
            if any((v, mode, t) in by for v in variants)]
    return ["", "% of each one's floor (the FP8 floor: FP8 bytes of the experts hit, FLOPs on the FP8 "
            "matmul ceiling of the run's provenance, `fp8_tflops`):", "",
            *_table(["T", "mode", "layer, % of floor", "fp8, % of FP8 floor"], body)]


# Each ablation's tables after its legend: the median-ms comparison, or its own.
TABLES: dict[str, Callable[[Sequence[AblateRow]], list[str]]] = {
    "weight": lambda rs: _compare(rs, "weight") + _weight_errors(rs), "graph": _graph_table,
    "tile": _tile_tables, "bytes": _bytes_list, "fp8": lambda rs: _compare(rs, "fp8") + _fp8_floors(rs),
}


def _compare(rows: Sequence[AblateRow], key: str) -> list[str]:
    return ["Median ms per call (vs the first variant):", "", *_compare_table(rows, ABLATIONS[key][1])]


def _section(rows: Sequence[AblateRow], key: str, plots: dict[str, str]) -> list[str]:
    """An ablation's legend, tables, the sentence putting it beside the article's number, its figure."""
    title, variants = ABLATIONS[key]
    rs = [r for r in rows if r.variant in variants]
    if not rs:
        return []
    tables = TABLES[key](rs) if key in TABLES else _compare(rs, key)
    figure = ["", f"![{key}]({plots[key]})"] if key in plots else []
    sentence = f"{HERE[key](rs)} {ARTICLE[key]}"
    return [f"## {title}", "", *_legend(rs, variants), *tables, "", sentence, *figure, ""]


def render(rows: Sequence[AblateRow], plots: dict[str, str], files: Files = FILES) -> str:
    """report.md from rows alone; `plots` maps an ablation to its figure's file name."""
    r0 = rows[0]
    lines = [
        f"# moekit ablate: {r0.preset} on {r0.device_name}", "",
        f"- run {', '.join(sorted({r.run_id for r in rows}))}, {r0.date}, commit `{r0.commit or 'unknown'}`",
        f"- {results.shape_label(r0)}, {r0.dtype}, seed {r0.seed}; torch {r0.torch_version}, triton "
        f"{r0.triton_version}, python {r0.python_version}; ceilings copy {r0.copy_gbps:,.1f} GB/s, matmul "
        f"{r0.matmul_tflops:,.3g} TFLOP/s",
        *results.switches_lines(r0),
        "- every variant was checked against the fp32 reference (largest error at most 2× plain PyTorch's "
        "in the same dtype) before it was timed; one that failed is listed under *Not timed*, never timed. "
        "Each call is timed alone, on a GPU after an L2 flush (`moekit.bench.timing`); *graph* rows replay "
        "a CUDA graph of the call.",
        "- the article's numbers come from an RTX 4060 laptop GPU in bf16 (Qwen3-30B-A3B's shape): compare "
        "ratios, not times.",
        "",
    ]
    lines += cpu_run_note(rows, "Triton runs through its interpreter, so every time here is an interpreter "
                          "timing, not a GPU one; the comparisons with the article's GPU numbers show the "
                          "study's flow only. No CUDA graphs and no Nsight Compute counters on the CPU.")
    for key in ablations_in(rows):
        lines += _section(rows, key, plots)
    lines += _not_timed(rows)
    lines += [f"Data: `{files.csv}` (one row per measurement, long format, provenance in every row). "
              "Redraw the figures and this report with `moekit report <this folder>`.", ""]
    return "\n".join(lines)


def output_files(rows: Sequence[AblateRow], files: Files = FILES) -> dict[str, str | bytes]:
    """The figures and report.md, rendered in memory (the report last)."""
    from moekit.bench.ablate_plots import render_plots  # matplotlib only when drawing

    figures = render_plots(rows)
    names = {key: name for name, (key, _) in figures.items()}
    return {**{name: png for name, (_, png) in figures.items()}, files.report: render(rows, names, files)}


STUDY = Study("ablate", AblateRow, output_files, check=check_row)
