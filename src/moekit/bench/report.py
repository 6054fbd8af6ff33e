"""`moekit bench`'s report step: report.md (provenance, the crossover, pivot tables) and the plots,
from rows alone. Forward + backward rows (`moekit bench --backward`, direction "fwd+bwd") get their
own table per layer: time, % of floor, peak memory and the speed-up over grouped_mm; the plots
draw the forward rows.

The dense pair's rows (backend "dense", `moekit.bench.dense`) are a column like a backend's, and the
headline table sets triton's time against them: "% of dense pair" = dense time / triton time at the
same T, in the graph mode where both were timed in one (eager otherwise). Triton rows that record
`rows_per_pair` get a table of the rows their tiles compute per pair (the padding). Rows on FP8
weights (`moekit bench --weights fp8`, `weights` "fp8") are columns of their own ("triton fp8"), each
against the FP8 floor, and a table sets each against the same backend on the dense weights.

`moekit bench` writes it after a sweep; `moekit report DIR` rebuilds it (and the plots) from the
CSV, so a recorded run can be re-rendered without the device it was measured on. `STUDY` ties the
rows (`results.ResultRow`) to this report for the scaffold (`moekit.bench.study`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from moekit.bench import plots
from moekit.bench.ceilings import Ceilings
from moekit.bench.dense import DENSE
from moekit.bench.kernel_work import TILED
from moekit.bench.layers import file_stem
from moekit.bench.results import ResultRow, check_result_row, shape_label, switches_lines
from moekit.bench.roofline import crossover_tokens, fp8_crossover_tokens
from moekit.bench.runner import LAYER
from moekit.bench.study import (
    FILES,
    NOISY_RATIO,
    Files,
    Study,
    code_lines,
    cpu_run_note,
    fmt_number,
    is_noisy,
    spread,
    timing_notes,
)
from moekit.eager_graphs import EAGER_GRAPH_MAX_TOKENS
from moekit.shapes import MoEShape

JSON_NAME = "results.json"
BACKWARD_BASELINE = "grouped_mm"   # the fwd+bwd table's speed-ups are over this backend


def shape_of(r: ResultRow) -> MoEShape:
    return MoEShape(r.num_experts, r.hidden_size, r.intermediate_size, r.top_k)


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in results")
    return dtype


def crossover_of(r: ResultRow) -> float:
    """Tokens where this row's preset turns compute-bound on this row's device (roofline.crossover_tokens)."""
    return crossover_tokens(shape_of(r), dtype_of(r.dtype), Ceilings(r.copy_gbps, r.matmul_tflops))


def ceilings_of(r: ResultRow) -> Ceilings:
    """The roofs a row's run measured (the FP8 one NaN where it was not)."""
    return Ceilings(r.copy_gbps, r.matmul_tflops, r.fp8_tflops)


def _columns(rows: Sequence[ResultRow]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r.series, r.mode) for r in rows))


def _pivot(rows: Sequence[ResultRow], cell: Callable[[ResultRow], str], lead: dict[int, str] | None = None,
           lead_name: str = "", tail: dict[int, str] | None = None, tail_name: str = "") -> list[str]:
    """T down, one column per (backend, mode) across; `lead` / `tail`: a column by T before / after them."""
    cols = _columns(rows)
    by_key = {(r.tokens, r.series, r.mode): r for r in rows}
    head = (["T"] + ([lead_name] if lead else []) + [f"{b} ({m})" for b, m in cols]
            + ([tail_name] if tail else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for t in sorted({r.tokens for r in rows}):
        cells = [str(t)] + ([lead.get(t, "–")] if lead else [])
        for b, m in cols:
            r = by_key.get((t, b, m))
            cells.append("" if r is None else cell(r))
        lines.append("| " + " | ".join(cells + ([tail.get(t, "–")] if tail else [])) + " |")
    return lines


def fmt_pct(v: float) -> str:
    return f"{v:.0f}%" if v >= 10 else f"{v:.2g}%"


def _time_cell(r: ResultRow) -> str:
    if r.status != "ok":
        return r.status.replace("_", " ")
    noisy = " noisy" if is_noisy(r.p20_ms, r.p80_ms) else ""
    return f"{fmt_number(r.median_ms)} ({fmt_pct(r.pct_floor)}){noisy}"


def share_of_dense(rows: Sequence[ResultRow]) -> tuple[str, dict[int, float]]:
    """(mode, {T: 100 * dense time / triton time}) over the Ts where both were timed in that mode:
    graph when any T has both in a graph, else eager ("", {} without such a pair)."""
    ok = {(r.tokens, r.backend, r.mode): r for r in rows if r.status == "ok" and not r.on_fp8}
    for mode in ("graph", "eager"):
        share = {t: 100.0 * d.median_ms / v.median_ms for (t, b, m), d in ok.items()
                 if b == DENSE and m == mode and (v := ok.get((t, TILED, mode))) is not None}
        if share:
            return mode, dict(sorted(share.items()))
    return "", {}


def _dense_note(rs: Sequence[ResultRow], mode: str) -> list[str]:
    if not any(r.backend == DENSE for r in rs):
        return []
    vs = (f" *{TILED} ({mode}): % of dense pair* = the dense pair's time / {TILED}'s, both {mode}."
          if mode else "")
    return [f"*{DENSE}* is the dense pair: the same FLOPs as two dense matmuls, T·K rows (each token "
            "repeated K times) through one expert's weights (`torch.nn.functional.linear`: cuBLAS on a GPU), "
            "the two GEMMs alone (silu(gate)·up computed once, outside the timed call); timed like the "
            "backends. Its % of floor is "
            "against the layer's floor: below the crossover that floor is the weights of every expert hit, "
            "which the pair does not read (it is no bar there); above it, the FLOPs, the same for both."
            + vs, ""]


def _layer_note(rs: Sequence[ResultRow]) -> list[str]:
    if not any(r.backend == LAYER for r in rs):
        return []
    return [f"*{LAYER}* is the whole `MoELayer` as a user calls it: moekit's router and the {TILED} experts "
            f"on the same weights (the same routing); its eager calls of at most {EAGER_GRAPH_MAX_TOKENS} "
            "tokens replay the "
            "layer's eager graphs (`moekit.eager_graphs`), so its eager column is the eager layer call a "
            "decoding model pays. Its floor is the experts' (the router's weight adds E·H elements).", ""]


def fp8_pairs(rows: Sequence[ResultRow]) -> list[tuple[ResultRow, ResultRow | None]]:
    """(row on FP8 weights, the same backend, T and mode on the dense weights or None), per FP8 row."""
    dense = {(r.preset, r.tokens, r.backend, r.mode): r for r in rows
             if not r.on_fp8 and r.direction == "fwd"}
    return [(r, dense.get((r.preset, r.tokens, r.backend, r.mode))) for r in rows if r.on_fp8]


def _fp8_section(rs: Sequence[ResultRow]) -> list[str]:
    """One layer's FP8 rows against the same backend on the dense weights, one line per backend,
    mode and T."""
    pairs = fp8_pairs(rs)
    if not pairs:
        return []
    r0 = pairs[0][0]
    ceilings = ceilings_of(r0)
    roof = (f"the FP8 matmul ceiling ({r0.fp8_tflops:,.0f} TFLOP/s, `torch._scaled_mm` e4m3)"
            if not math.isnan(r0.fp8_tflops) else
            "the matmul ceiling of the dtype (no FP8 ceiling was measured on this device)")
    cross = fp8_crossover_tokens(shape_of(r0), ceilings)
    out = ["", f"### FP8 weights vs {r0.dtype}", "",
           "Block-scaled e4m3 weights (one fp32 scale per 128 × 128 block, quantized once: "
           "`moekit.quant.quantize_experts`) against the same backend on the dense weights, at the same "
           f"T and mode; speed-up = {r0.dtype} time / FP8 time. FP8 floor = max(FP8 bytes of the experts "
           "hit (e4m3 data + scales) + activations + routing over the copy bandwidth, FLOPs over "
           f"{roof}); FP8 crossover ≈ {cross:,.0f} tokens. Each FP8 call was checked first against the "
           "fp32 oracle of its path: `experts_fp8_torch` (w8a8: x quantized per token per 128 channels, "
           "h per 128 columns), or on triton's decode path (w8a16) the fp32 layer on the dequantized "
           f"weights, within 2× plain PyTorch of the same quantization in {r0.dtype}.", "",
           f"| backend | mode | T | {r0.dtype} ms | fp8 ms | speed-up | FP8 floor ms | fp8 % of FP8 floor |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    backends = list(dict.fromkeys(f.backend for f, _ in pairs))
    modes = list(dict.fromkeys(f.mode for f, _ in pairs))
    for f, d in sorted(pairs, key=lambda p: (backends.index(p[0].backend), modes.index(p[0].mode),
                                             p[0].tokens)):
        dense_ok = d is not None and d.status == "ok"
        cells = [_time_or_status(d) if d is not None else "–", _time_or_status(f),
                 f"{d.median_ms / f.median_ms:.2f}×" if dense_ok and f.status == "ok" else "–",
                 fmt_number(f.floor_ms), fmt_pct(f.pct_floor) if f.status == "ok" else "–"]
        out.append(f"| {f.backend} | {f.mode} | {f.tokens} | " + " | ".join(cells) + " |")
    gluon_off = any("MOEKIT_GLUON_FP8=0" in (r.switches or "").split() for r in rs)
    design = f"{VLLM_FP8_DESIGN} {TRITON_FP8_DESIGN if gluon_off else GLUON_FP8_DESIGN}"
    return out + ["", *code_lines(rs, design)]


# Where the FP8 path stands against the design users compare it with (designs, not a timed run): a
# description of the code, written only for rows that code measured (`study.code_lines`).
VLLM_FP8_DESIGN = (
    "Against vLLM's published block-FP8 Triton fused-MoE design (a comparison of designs, not a "
    "side-by-side run): the blocks are the same (128 × 128 weight scales, 1 × 128 activation scales) and "
    "so is the promotion (each 128-deep dot scaled by the row's activation scale and the tile's weight "
    "scale into an fp32 accumulator). vLLM's GEMM1 writes the 2I-wide gate and up pre-activations, then "
    "runs the activation and the per-token-group quantization of h as two more launches before GEMM2; "
    "moekit's GEMM1 computes SwiGLU and quantizes h in its epilogue, so no 2I-wide intermediate reaches "
    "memory (2 · T·K · 2I bytes written and read again in bf16), and up to 16 token-expert pairs it "
    "skips the align and the activation quantization (w8a16 decode kernels).")
# ... and the kernels it ran, unless the run switched the Gluon FP8 GEMMs off
GLUON_FP8_DESIGN = ("Where the align block is 64 or 128 rows moekit's FP8 GEMMs are Hopper Gluon kernels "
                    "(persistent, warp-specialized, wgmma); vLLM's are Triton `tl.dot` kernels.")
TRITON_FP8_DESIGN = ("This run switched the Gluon FP8 GEMMs off (`MOEKIT_GLUON_FP8=0`): both are Triton "
                     "`tl.dot` kernels.")


def _time_or_status(r: ResultRow) -> str:
    return fmt_number(r.median_ms) if r.status == "ok" else r.status.replace("_", " ")


def _padding_table(rs: Sequence[ResultRow]) -> list[str]:
    """Rows computed per pair by triton's tiles, one line per T (the first triton row recording it)."""
    seen: dict[int, float] = {}
    for r in rs:
        if r.backend == TILED and not math.isnan(r.rows_per_pair):
            seen.setdefault(r.tokens, r.rows_per_pair)
    if not seen:
        return []
    out = ["", f"### Rows computed per pair ({TILED}'s tiles)", "",
           "Each expert's pairs rounded up to the align block's rows (num_padded / T·K): the GEMMs compute "
           "this many times the useful FLOPs.", "",
           "| T | rows per pair | padding |", "|---:|---:|---:|"]
    for t, per_pair in sorted(seen.items()):
        out.append(f"| {t} | {per_pair:.2f} | {fmt_pct(100 * (1 - 1 / per_pair))} |")
    return out


def _preset_section(rows: Sequence[ResultRow], preset: str) -> list[str]:
    rs = [r for r in rows if r.preset == preset]
    r0 = rs[0]
    cross = crossover_of(r0)
    ridge = Ceilings(r0.copy_gbps, r0.matmul_tflops).ridge_flops_per_byte
    item = dtype_of(r0.dtype).itemsize
    scale = "" if item == 2 else f" × itemsize/2 ({item}/2)"
    t_max = max(r.tokens for r in rs)
    bound_at_max = next(r.bound for r in rs if r.tokens == t_max)
    out = [
        f"## {shape_label(r0)}",
        "",
        f"**Memory-bound / compute-bound crossover: ≈ {cross:,.0f} tokens** = ridge point "
        f"{ridge:.1f} FLOP/byte × E/K ({r0.num_experts}/{r0.top_k}){scale}. Below it the floor is the "
        f"time to read the weights of the experts hit; above it, the FLOPs. (At T = {t_max}, the "
        f"largest measured, the floor is {bound_at_max}-bound.)",
        "",
        "### Median time per call, ms (% of floor)",
        "",
    ]
    mode, share = share_of_dense(rs)
    out += _dense_note(rs, mode)
    out += _layer_note(rs)
    if any(r.on_fp8 for r in rs):
        out += ["Columns *… fp8* time the backend on FP8 weights; their % is of the FP8 floor (below).", ""]
    floor = {t: fmt_number(f) for t, f in plots.floor_by_tokens(rs, preset)}
    out += _pivot(rs, _time_cell, floor, "floor ms", {t: fmt_pct(v) for t, v in share.items()},
                  f"{TILED} ({mode}): % of dense pair")
    out += _fp8_section(rs)
    out += _padding_table(rs)
    out += ["", f"### Spread of the timed calls: p20–p80 ms (noisy: p80 / p20 > {NOISY_RATIO})", ""]
    out += _pivot(rs, lambda r: spread(r.p20_ms, r.p80_ms) if r.status == "ok" else "")
    out += ["", "### Kernel launches per call", ""]
    out += _pivot(rs, lambda r: fmt_number(r.kernels) if r.status == "ok" else "")
    if any(not math.isnan(r.idle_pct) for r in rs):
        out += ["", "### Device idle, % of wall time (1 − busy / time)", ""]
        out += _pivot(rs, lambda r: fmt_number(r.idle_pct, 2) if r.status == "ok" else "")
    out += ["", "### Distinct experts hit", "",
            "Expected under random routing: E·(1 − ((E−K)/E)^T). *Timed batch* is the batch every "
            "backend ran (its experts set the floor); *mean* averages many random batches routed by "
            "the same router.", "",
            "| T | timed batch | mean | expected | mean vs expected |", "|---:|---:|---:|---:|---:|"]
    seen: set[int] = set()
    for r in sorted(rs, key=lambda r: r.tokens):
        if r.tokens in seen:
            continue
        seen.add(r.tokens)
        dev = 100 * (r.experts_hit_mean / r.experts_expected - 1)
        out.append(f"| {r.tokens} | {r.experts_hit} | {r.experts_hit_mean:.2f} | {r.experts_expected:.2f} "
                   f"| {dev:+.1f}% |")
    untimed = [r for r in rs if r.status != "ok"]
    if untimed:
        out += ["", "### Not timed", ""]
        out += [f"- T={r.tokens} {r.series} ({r.mode}): **{r.status.replace('_', ' ')}**: {r.reason}"
                for r in untimed]
    stem = file_stem(preset)
    out += ["", "### Plots", "",
            f"![time per call](time_{stem}.png)", "",
            f"![% of floor](floor_pct_{stem}.png)", "",
            f"![kernel launches per call](launches_{stem}.png)", ""]
    return out


def _backward_section(rows: Sequence[ResultRow], preset: str) -> list[str]:
    """The fwd+bwd rows of one layer: one line per backend, mode and T."""
    rs = [r for r in rows if r.preset == preset]
    base = {(r.tokens, r.mode): r for r in rs if r.backend == BACKWARD_BASELINE and r.status == "ok"}
    vs = f"speed-up over {BACKWARD_BASELINE}"
    graphed = any(r.mode == "graph" for r in rs)
    out = [f"## {shape_label(rs[0])}: forward + backward", "",
           "One call = `moe_experts(...)` then `.backward(grad_out)`"
           + (": eager, and the whole step recorded in one CUDA graph (mode graph: no host work between "
              "the kernels; peak memory for eager rows only, the graph's pool holds its memory)"
              if graphed else ", eager")
           + "; the gradients of x, gate_up_proj, down_proj and topk_weights were each checked against the "
           "fp32 reference first. "
           + (f"{vs.capitalize()} = its time / this time, at the same T and mode." if base else
              f"No {vs}: {BACKWARD_BASELINE} was not timed forward + backward here."), "",
           "| backend | mode | T | median ms | p20–p80 ms | floor ms | % of floor | peak MiB |"
           + (f" {vs} |" if base else ""),
           "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if base else "")]
    backends = list(dict.fromkeys(r.backend for r in rs))
    modes = list(dict.fromkeys(r.mode for r in rs))
    for r in sorted(rs, key=lambda r: (backends.index(r.backend), modes.index(r.mode), r.tokens)):
        if r.status == "ok":
            cells = [fmt_number(r.median_ms), spread(r.p20_ms, r.p80_ms), fmt_number(r.floor_ms),
                     fmt_pct(r.pct_floor), fmt_number(r.peak_mib)]
        else:
            cells = [r.status.replace("_", " "), "", fmt_number(r.floor_ms), "", ""]
        if base:
            b = base.get((r.tokens, r.mode))
            ok = r.status == "ok" and b is not None and b is not r
            cells.append(f"{b.median_ms / r.median_ms:.2f}×" if ok else "–")
        out.append(f"| {r.backend} | {r.mode} | {r.tokens} | " + " | ".join(cells) + " |")
    untimed = [r for r in rs if r.status != "ok"]
    if untimed:
        out += ["", "### Not timed (forward + backward)", ""]
        out += [f"- T={r.tokens} {r.backend} ({r.mode}): **{r.status.replace('_', ' ')}**: {r.reason}"
                for r in untimed]
    return [*out, ""]


def _floor_notes(rows: Sequence[ResultRow]) -> list[str]:
    """What the floor counts, for each direction present."""
    lines = []
    if any(r.direction == "fwd" for r in rows):
        lines.append("- floor = max(bytes / copy bandwidth, FLOPs / matmul rate); bytes = weights of every "
                     "expert hit + input + output + routing. % of floor = floor / time (100% = at the roof).")
    if any(r.on_fp8 for r in rows):
        lines.append("- rows on FP8 weights (`weights` fp8): the same floor with the weights' bytes those of "
                     "e4m3 data + fp32 block scales and the FLOPs on the FP8 matmul ceiling.")
    if any(r.direction == "fwd+bwd" for r in rows):
        lines.append("- forward + backward floor: FLOPs = 3 × the forward's; bytes = weights of every expert "
                     "hit read twice (forward, backward) + weight gradients of all E experts written once "
                     "in the dtype (dense, 0 for experts not hit) + x, out, grad_out, x again and dx + "
                     "routing read twice and its gradient (fp32); intermediates not counted. Peak MiB = "
                     "device memory one call took above what was held before (CUDA only; – on the CPU, "
                     "not measured).")
    return lines


def _fp8_ceiling(rows: Sequence[ResultRow]) -> str:
    """The provenance line's FP8 roof: measured, or why FP8 rows have none."""
    r0 = rows[0]
    if not math.isnan(r0.fp8_tflops):
        return (f", FP8 matmul **{r0.fp8_tflops:,.2f} TFLOP/s** (`torch._scaled_mm`, e4m3 8192³ with fp32 "
                f"scales; ridge {ceilings_of(r0).ridge(fp8=True):.1f} FLOP/byte)")
    if any(r.on_fp8 for r in rows):
        return "; no FP8 ceiling measured (CPU, or no FP8 matmul): FP8 floors use the matmul ceiling"
    return ""


def render(rows: Sequence[ResultRow], files: Files = FILES) -> str:
    """The report's Markdown text."""
    r0 = rows[0]
    fwd = [r for r in rows if r.direction == "fwd"]
    train = [r for r in rows if r.direction == "fwd+bwd"]
    runs = sorted({r.run_id for r in rows})
    ridge = Ceilings(r0.copy_gbps, r0.matmul_tflops).ridge_flops_per_byte
    versions = f"torch {r0.torch_version}, triton {r0.triton_version}"
    if r0.transformers_version:
        versions += f", transformers {r0.transformers_version}"
    lines = [
        f"# moekit bench: {r0.device_name}",
        "",
        f"- run {', '.join(runs)}, {r0.date}, commit `{r0.commit or 'unknown'}`",
        f"- device: {r0.device_name}, {r0.device_type}; {versions}; python {r0.python_version}",
        *switches_lines(r0),
        f"- dtype {r0.dtype}; ceilings measured on this device: copy **{r0.copy_gbps:,.1f} GB/s**, "
        f"matmul **{r0.matmul_tflops:,.2f} TFLOP/s** (ridge {ridge:.1f} FLOP/byte)" + _fp8_ceiling(rows),
        *_floor_notes(rows),
        "- every backend was checked against the fp32 reference before timing; one that failed is "
        "listed under *Not timed*, never timed.",
        *timing_notes(rows),
        *(["- cache flushed clean before each timed call (`--flush clean`): a buffer larger than the "
           "L2 written, then another read, so the call evicts no dirty lines (the default flush, a write "
           "alone, leaves up to the L2's size of write-backs inside the timed window)."]
          if r0.cache == "flushed clean" else []),
        "",
    ]
    lines += cpu_run_note(rows, "Triton runs through its interpreter and the ceilings are the CPU's, so "
                          "this shows the flow, not GPU performance. Launch counts are aten compute ops "
                          "plus Triton launches." + (
                              " Calls timed with warm caches (no flush before each: writing 64 MB over a "
                              "CPU's cache before a sub-millisecond call mostly times the refill of the "
                              "interpreter's own working set, and made two runs' medians differ by up to "
                              "1.4x)." if r0.cache == "warm" else ""))
    for preset in plots.presets_of(fwd):
        lines += _preset_section(fwd, preset)
    for preset in plots.presets_of(train):
        lines += _backward_section(train, preset)
    plotted = " and the plots" if fwd else ""
    lines += [f"Data: `{files.csv}` (one row per measurement, long format) and `{JSON_NAME}`. "
              f"Rebuild this report{plotted} with `moekit report <this folder>`.", ""]
    return "\n".join(lines)


def report_files(rows: Sequence[ResultRow], files: Files = FILES) -> dict[str, str | bytes]:
    """The plots (of the forward rows) and report.md, rendered in memory: file name -> contents
    (report.md last)."""
    text = render(rows, files)
    return {**plots.render_all([r for r in rows if r.direction == "fwd"]), files.report: text}


STUDY = Study("bench", ResultRow, report_files, check=check_result_row)
