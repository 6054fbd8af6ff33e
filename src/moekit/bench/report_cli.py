"""`moekit report DIR`: redraw the plots and report.md from a results CSV alone (no device needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from moekit.bench.report import CSV_NAME, write_report
from moekit.bench.results import read_csv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, help=f"a results folder (holding {CSV_NAME}) or a results CSV file")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the plots and report.md (default: the CSV's folder)")


def csv_path(path: Path) -> Path:
    return path / CSV_NAME if path.is_dir() else path


def run(args: argparse.Namespace) -> int:
    console = Console()
    src = csv_path(args.path)
    try:
        rows = read_csv(src)
    except ValueError as exc:
        console.print(f"[red]moekit report: {exc}[/red]", highlight=False)
        return 2
    out_dir = args.out or src.parent
    written = write_report(rows, out_dir)
    names = ", ".join(p.name for p in written)
    console.print(f"Read {len(rows)} rows from {src}; wrote {names} in {out_dir}", highlight=False)
    return 0
