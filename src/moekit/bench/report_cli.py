"""`moekit report DIR`: redraw the plots and report.md from a results CSV alone (no device needed).

The whole CSV is read and every row checked (`moekit.bench.results.check_result_row`) before
anything is drawn; the plots and the report are rendered in memory, then written, each atomically.
A bad file or an unwritable --out gives one error line naming it and exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from moekit.bench import args as arg_types
from moekit.bench.args import usage_error
from moekit.bench.report import CSV_NAME, write_report
from moekit.bench.results import read_results

PROG = "moekit report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=arg_types.existing_path,
                   help=f"a results folder (holding {CSV_NAME}) or a results CSV file")
    p.add_argument("--out", type=arg_types.out_dir, default=None,
                   help="where to write the plots and report.md (default: the CSV's folder; files of the "
                        "same names there are replaced)")


def csv_path(path: Path) -> Path:
    return path / CSV_NAME if path.is_dir() else path


def run(args: argparse.Namespace) -> int:
    console = Console()
    src = csv_path(args.path)
    out_dir = args.out or src.parent
    try:
        arg_types.check_out_dir(out_dir, "--out" if args.out else "the CSV's folder")
        rows = read_results(src)
    except ValueError as exc:
        return usage_error(PROG, exc)
    written = write_report(rows, out_dir)
    names = ", ".join(p.name for p in written)
    console.print(f"Read {len(rows)} rows from {src}; wrote {names} in {out_dir}", highlight=False)
    return 0
