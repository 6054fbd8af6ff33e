"""What `moekit profile`, `sweep` and `e2e` share on the study scaffold (`moekit.bench.study`): the
run (checks, provenance, measure, write, exit status), the report's head and its Markdown tables.

A study module gives `run_study` its `Study`, a `measure(console, ceilings, prov) -> rows`, and
`describe(row)` naming a case in error lines; the rows' report is `report(rows, title, sections)`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from moekit.bench import args as arg_types
from moekit.bench.args import RESULTS_ROOT, usage_error
from moekit.bench.results import switches_lines
from moekit.bench.study import CSV_NAME, Study, exit_status, fmt_number, measure_provenance, status_counts

Measure = Callable[[object, object, object], list]   # (console, ceilings, provenance) -> rows


def run_study(prog: str, args: argparse.Namespace, study: Study, device: torch.device, dtype: torch.dtype,
              measure: Measure, describe: Callable[[object], str], *, rep: int | None = None,
              transformers_version: str | None = None, fp8: bool = False) -> int:
    """Check --out, measure the ceilings and provenance (fp8: the FP8 matmul ceiling too), `measure`
    the rows (CPU threads pinned by --threads), write results.csv and report.md, print the report;
    the scaffold's exit status."""
    from rich.console import Console  # here: `moekit report` redraws these studies without rich

    console = Console()
    try:
        arg_types.check_out(args.out, study.result_names, args.overwrite)
    except ValueError as exc:
        return usage_error(prog, exc)
    with arg_types.cpu_threads(device, getattr(args, "threads", 1)):
        ceilings, prov = measure_provenance(device, dtype, console, rep=rep,
                                            transformers_version=transformers_version, fp8=fp8)
        rows = measure(console, ceilings, prov)
    out_dir = args.out or RESULTS_ROOT / f"{study.name}-{prov.run_id}"
    if not rows:
        return usage_error(prog, "nothing to measure with these arguments")
    written = study.write(rows, out_dir, overwrite=args.overwrite)
    out_dir = written[0].parent
    console.print(written[-1].read_text(encoding="utf-8"), markup=False, highlight=False, soft_wrap=True)
    console.print("rows: " + ", ".join(f"{n} {s}" for s, n in status_counts(rows).items()))
    console.print(f"Wrote {', '.join(p.name for p in written)} in {out_dir}", highlight=False, soft_wrap=True)
    return exit_status(prog, rows, out_dir / CSV_NAME, console, describe)


def header(rows: Sequence, title: str) -> list[str]:
    """The report's title and provenance lines (from the first row; every run id)."""
    r0 = rows[0]
    return [f"# {title} on {r0.device_name}", "",
            f"- run {', '.join(sorted({r.run_id for r in rows}))}, {r0.date}, "
            f"commit `{r0.commit or 'unknown'}`",
            f"- torch {r0.torch_version}, triton {r0.triton_version}, python {r0.python_version}, "
            f"moekit {r0.moekit_version}, {r0.dtype}; ceilings copy {r0.copy_gbps:,.1f} GB/s, "
            f"matmul {r0.matmul_tflops:,.3g} TFLOP/s",
            *switches_lines(r0), ""]


def layer_head(prov, layer, **more) -> dict:
    """A row's leading columns (`results.LayerRow` less the tokens): provenance, the layer, its shape."""
    s = layer.shape
    return {**asdict(prov), "preset": layer.name, "num_experts": s.num_experts, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "top_k": s.top_k, **more}


def cell(v: object) -> str:
    """A table cell: numbers by `fmt_number`, None as "–", text as is (pipes escaped)."""
    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
        return fmt_number(v)
    return str(v).replace("|", "\\|")


def table(rows: Sequence, columns: Sequence[str]) -> list[str]:
    """A Markdown table of the rows' named columns."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(cell(getattr(r, c)) for c in columns) + " |" for r in rows), ""]


def report(rows: Sequence, title: str, group: Callable[[object], str], columns: Sequence[str],
           notes: Sequence[str] = ()) -> str:
    """report.md: the head, `notes`, then one table of `columns` per group of rows (in row order)."""
    lines = [*header(rows, title), *notes, *([""] if notes else [])]
    for name in dict.fromkeys(group(r) for r in rows):
        lines += [f"## {name}", "", *table([r for r in rows if group(r) == name], columns)]
    return "\n".join(lines)


def first_line(exc: BaseException) -> str:
    """'Type: first line of the message' (a row's reason)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
