"""The one scaffold every study stands on: `moekit bench`, `imbalance`, `ep-bench`, `tune` and `ablate`.

A study is arguments -> measure -> rows -> render; only the measuring is its own:

    arguments   shared flags, types and defaults (`moekit.bench.args`)
    provenance  the device's ceilings and the run's provenance, measured once (`measure_provenance`)
    rows        a frozen dataclass on `results.Provenance`: one row per measurement (long format)
    write       results.csv through the one row writer (`results.rows_to_csv`), then the one report
                step: report.md and the plots, rendered from the rows alone. Every file is rendered
                in memory first, then each is written atomically (`Study.write`)
    exit        0 when a case was measured, 1 (one error line) when none was (`exit_status`)
    report      `moekit report DIR` finds which study a folder holds, by its CSV's columns, and
                redraws it (`find_results`, `redraw`)

Each study's report module (`report`, `imbalance_report`, `ep_report`, `tune_report`,
`ablate_report`) defines its `STUDY`: the name, the row type, the row check and the render function.
Folders written before the scaffold keep their file names when redrawn: imbalance.csv ->
imbalance.md, ep_results.csv -> ep_report.md (the 2026-11-29 bench folder already has results.csv
and report.md).
"""

from __future__ import annotations

import csv
import importlib
import math
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import moekit
from moekit.bench.ceilings import Ceilings, fp8_ceiling, measure_ceilings
from moekit.bench.results import (
    STATUSES,
    Provenance,
    claim_folder,
    collect_provenance,
    columns,
    git_commit,
    read_csv,
    rows_to_csv,
    write_files,
)

CSV_NAME = "results.csv"
REPORT_NAME = "report.md"
RESULT_FILES = (CSV_NAME, REPORT_NAME)
REPORT_MODULES = ("moekit.bench.report", "moekit.bench.imbalance_report", "moekit.bench.ep_report",
                  "moekit.bench.tune_report", "moekit.bench.ablate_report", "moekit.bench.profile",
                  "moekit.bench.variants", "moekit.bench.e2e")


@dataclass(frozen=True)
class Files:
    """The names of a results folder's CSV and report."""

    csv: str = CSV_NAME
    report: str = REPORT_NAME


FILES = Files()
Rendered = dict[str, str | bytes]


@dataclass(frozen=True)
class Study:
    """One study's results: how its rows are read, checked and drawn.

    Attributes:
        name: the subcommand ("bench", "imbalance", "ep-bench", "tune", "ablate").
        row_type: a frozen dataclass on `Provenance`; its fields are the CSV's columns.
        render: (rows, files) -> {file name: text or PNG bytes}, the plots, then the report last;
            from the rows alone (`files` names the CSV and the report the text refers to).
        check: row -> "" or what is wrong with it beyond the cell types (`results.read_csv`).
        statuses: the values a "status" column may hold (None: the rows have none).
        legacy: the file names of folders this study wrote before the scaffold.
    """

    name: str
    row_type: type
    render: Callable[[Sequence, Files], Rendered]
    check: Callable[[object], str] | None = None
    statuses: tuple[str, ...] | None = STATUSES
    legacy: tuple[Files, ...] = ()

    @property
    def result_names(self) -> tuple[str, ...]:
        """The files that mark a folder as holding this study's results (older names included)."""
        return (*RESULT_FILES, *(n for f in self.legacy for n in (f.csv, f.report)))

    def read(self, path: Path) -> list:
        """Every row of a CSV of this study, checked; ValueError naming the file (and line)."""
        return read_csv(path, self.row_type, what=f"a moekit {self.name} results CSV",
                        statuses=self.statuses, check=self.check)

    def files_for(self, csv_path: Path) -> Files:
        """The report that goes with a CSV: its legacy name, else report.md."""
        return next((f for f in self.legacy if f.csv == csv_path.name), Files(csv_path.name, REPORT_NAME))

    def write(self, rows: Sequence, out_dir: Path, extra: Mapping[str, str | bytes] | None = None, *,
              overwrite: bool = False) -> list[Path]:
        """results.csv, `extra` files (e.g. results.json), the plots and report.md into out_dir:
        all rendered first, then each written atomically, in that order. Unless overwrite, into the
        folder `claim_folder` gives: out_dir, or the next free name when results reached out_dir
        while the run measured (the returned paths say where)."""
        files = {CSV_NAME: rows_to_csv(rows, self.row_type), **(extra or {}), **self.render(rows, FILES)}
        if not overwrite:
            out_dir = claim_folder(out_dir, CSV_NAME, self.result_names)
        return write_files(files, out_dir)


def studies() -> list[Study]:
    """Every study, `moekit bench` first (their report modules are imported here, not before)."""
    return [importlib.import_module(m).STUDY for m in REPORT_MODULES]


def _header(path: Path) -> set[str]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return set(next(csv.reader(f), []))
    except (OSError, UnicodeDecodeError, csv.Error):
        return set()


def detect(csv_path: Path) -> Study:
    """The study whose columns the CSV holds: the largest share of them (`moekit bench` when none
    is found; reading the file as that study's then names the missing columns)."""
    header = _header(csv_path)

    def share(s: Study) -> float:
        cols = columns(s.row_type)
        return len(header.intersection(cols)) / len(cols)

    return max(studies(), key=share)


def find_results(path: Path, study: Study | None = None) -> tuple[Study, Path]:
    """(the study, its CSV) of a results folder or CSV file. A folder's results.csv is looked for
    first, then the legacy names."""
    path = Path(path)
    if path.is_dir():
        legacy = [f.csv for s in ([study] if study else studies()) for f in s.legacy]
        path = next((path / n for n in (CSV_NAME, *legacy) if (path / n).is_file()), path / CSV_NAME)
    return study or detect(path), path


def redraw(study: Study, src: Path, out_dir: Path | None = None) -> tuple[list, list[Path]]:
    """Read a study's CSV (every row checked first), then redraw its plots and report into out_dir
    (default: the CSV's folder). Returns (rows, files written); ValueError on a bad file."""
    rows = study.read(src)
    return rows, write_files(study.render(rows, study.files_for(src)), out_dir or src.parent)


def measure_provenance(device: torch.device, dtype: torch.dtype, console, *, rep: int | None = None,
                       transformers_version: str | None = None,
                       fp8: bool = False) -> tuple[Ceilings, Provenance]:
    """Measure the device's ceilings once, and the run's provenance that every row carries; with
    fp8, the FP8 matmul ceiling too (`ceilings.fp8_ceiling`: CUDA only, a note where it is not)."""
    console.print(f"Measuring ceilings on {device} ({str(dtype).removeprefix('torch.')})...")
    ceilings = measure_ceilings(device, dtype, rep=rep)
    console.print(f"  copy {ceilings.copy_gbps:,.1f} GB/s, matmul {ceilings.matmul_tflops:,.3g} TFLOP/s, "
                  f"ridge {ceilings.ridge_flops_per_byte:.1f} FLOP/byte")
    if fp8:
        fp8_tflops, why_not = fp8_ceiling(device, rep)
        ceilings = replace(ceilings, fp8_tflops=fp8_tflops)
        if why_not:
            console.print(f"  {why_not}", style="yellow", markup=False, highlight=False)
        else:
            console.print(f"  FP8 matmul {fp8_tflops:,.3g} TFLOP/s (torch._scaled_mm, e4m3), ridge "
                          f"{ceilings.ridge(fp8=True):.1f} FLOP/byte")
    return ceilings, collect_provenance(device, dtype, ceilings.copy_gbps, ceilings.matmul_tflops,
                                        transformers_version=transformers_version,
                                        fp8_tflops=ceilings.fp8_tflops)


def warn_to(console) -> Callable[[str], None]:
    """A `warn` for `args.resolve_layers`: one yellow line on the study's console, printed as is
    (a path or key in brackets is not taken for markup)."""
    return lambda message: console.print(f"warning: {message}", style="yellow", markup=False, highlight=False,
                                         soft_wrap=True)


def fmt_number(v: float | int | None, digits: int = 3) -> str:
    """A table cell: "–" for a missing value, integers with thousands separators, numbers from 100
    up without decimals, smaller ones to `digits` significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


NOISY_RATIO = 1.5   # p80 / p20 above this: the timed calls spread too widely to trust the median


def is_noisy(p20_ms: float, p80_ms: float) -> bool:
    """Whether a timing's p80 / p20 exceeds `NOISY_RATIO` (False when it was not timed)."""
    return p20_ms > 0 and p80_ms / p20_ms > NOISY_RATIO     # NaN compares False


def spread(p20_ms: float, p80_ms: float) -> str:
    """A table cell "p20–p80" in ms, " noisy" appended when p80 / p20 > `NOISY_RATIO`."""
    return f"{fmt_number(p20_ms)}–{fmt_number(p80_ms)}" + (" noisy" if is_noisy(p20_ms, p80_ms) else "")


def with_threads(rows: Sequence, threads: int | None) -> list:
    """The rows with the torch intra-op thread count they were measured with (`args.cpu_threads`;
    None on a GPU: the rows' `threads` stays empty)."""
    return [replace(r, threads=threads) for r in rows] if threads is not None else list(rows)


def timing_notes(rows: Sequence) -> list[str]:
    """Report lines on how trustworthy the timings are: the CPU's intra-op threads, and how many
    timed rows are noisy (p80 / p20 > `NOISY_RATIO`)."""
    lines = []
    r0 = rows[0]
    if r0.device_type == "cpu":
        n = getattr(r0, "threads", None)
        lines.append(f"- CPU timing with {n} torch intra-op thread{'' if n == 1 else 's'} (`--threads`; "
                     "restored after the run)" if n else
                     "- CPU timing: the intra-op thread count was not recorded (a run before `--threads`)")
    timed = [r for r in rows if r.status == "ok" and not math.isnan(r.p20_ms)]
    noisy = sum(is_noisy(r.p20_ms, r.p80_ms) for r in timed)
    if timed:
        lines.append(f"- {noisy} of {len(timed)} timed rows **noisy** (p80 / p20 > {NOISY_RATIO}: the calls' "
                     "times spread widely, from a busy machine or too few calls; rerun before trusting "
                     "their medians)" if noisy else
                     f"- every timed row's p80 / p20 ≤ {NOISY_RATIO} (none noisy)")
    return lines


def cpu_run_note(rows: Sequence, text: str) -> list[str]:
    """A report's one-line note on a CPU run, "> CPU run: <text>" and a blank line (what its times
    and figures are: Triton interpreted, CPU ceilings); nothing for rows measured on a GPU."""
    return [f"> CPU run: {text}", ""] if rows[0].device_type == "cpu" else []


def same_commit(run: str, code: str) -> bool:
    """Whether two recorded commits (`results.git_commit`, MOEKIT_COMMIT) name the same code: both
    known, one hash the prefix of the other (a short hash and its long form, at least 7 digits),
    and the same suffix after "+" (local changes: "+dirty", or what a MOEKIT_COMMIT appends; two
    trees with local changes on one commit are taken for the same code, the commit cannot tell)."""
    (a, _, a_more), (b, _, b_more) = run.lower().partition("+"), code.lower().partition("+")
    return min(len(a), len(b)) >= 7 and (a.startswith(b) or b.startswith(a)) and a_more == b_more


CODE_LEFT_OUT = ("*A description of moekit's code is left out here: the code drawing this report (commit "
                 "{code}) is not the code this run measured (commit {run}), so it may not hold for the run.*")


def code_lines(rows: Sequence, *lines: str) -> list[str]:
    """`lines`: sentences describing moekit's code (its kernels, launch limits, design), not the
    rows' data, so true of the code drawing the report. Kept where every row was measured at
    that code's commit (`same_commit`: a fresh run's report, or a redraw at the run's commit), or,
    where neither commit is known (an installed wheel has no git), at the code's moekit version;
    else one line in their place saying why they are left out. No lines: nothing."""
    if not lines:
        return []
    code = git_commit()
    runs = sorted({r.commit for r in rows})
    if all(same_commit(run, code) for run in runs):
        return list(lines)
    if not code and runs == [""] and {r.moekit_version for r in rows} == {moekit.__version__}:
        return list(lines)
    return [CODE_LEFT_OUT.format(code=f"`{code}`" if code else "unknown",
                                 run=", ".join(f"`{run}`" if run else "unknown" for run in runs))]


def status_counts(rows: Sequence) -> dict[str, int]:
    """Rows by status, in sorted order of the status."""
    out: dict[str, int] = {}
    for r in rows:
        out[r.status] = out.get(r.status, 0) + 1
    return dict(sorted(out.items()))


def exit_status(prog: str, rows: Sequence, csv_path: Path, console,
                describe: Callable[[object], str], bad: Collection[str] = ("failed", "error")) -> int:
    """Print every failed or errored case (`describe(row)` names it), then: 0 when at least one case
    was measured, else one error line on stderr and 1."""
    for r in rows:
        if r.status in bad:
            console.print(f"[red]{describe(r)} {r.status}: {r.reason}[/red]", highlight=False)
    counts = status_counts(rows)
    if counts.get("ok", 0):
        return 0
    print(f"{prog}: error: no case succeeded (" + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f"); the reasons are in {csv_path}", file=sys.stderr)
    return 1
