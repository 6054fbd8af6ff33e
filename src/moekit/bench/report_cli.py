"""`moekit report DIR`: redraw any study's plots and report from its results CSV alone (no device).

The study is found from the CSV's columns (`moekit.bench.study.find_results`): a folder of `moekit
bench`, `imbalance`, `ep-bench`, `tune` or `ablate`, including folders written before the studies shared
one scaffold (imbalance.csv, ep_results.csv). The whole CSV is read and every row checked before
anything is drawn; the plots and the report are rendered in memory, then written, each atomically.
A bad file or an unwritable --out gives one error line naming it and exit status 2.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from moekit.bench import args as arg_types
from moekit.bench.args import usage_error
from moekit.bench.study import CSV_NAME, find_results, redraw

PROG = "moekit report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=arg_types.existing_path,
                   help=f"a results folder (holding {CSV_NAME}, or an older imbalance.csv / ep_results.csv) "
                        "or a results CSV file of any study")
    p.add_argument("--out", type=arg_types.out_dir, default=None,
                   help="where to write the plots and the report (default: the CSV's folder; files of the "
                        "same names there are replaced)")


def run_redraw(prog: str, path, out, study=None) -> int:
    """Redraw a results folder or CSV (of `study`, or of whichever study it holds); the one step
    behind `moekit report` and the older `--redraw` flags of imbalance and ep-bench."""
    study, src = find_results(path, study)
    try:
        arg_types.check_out_dir(out or src.parent, "--out" if out else "the CSV's folder")
        rows, written = redraw(study, src, out)
    except ValueError as exc:
        return usage_error(prog, exc)
    Console().print(f"Read {len(rows)} {study.name} rows from {src}; wrote "
                    f"{', '.join(p.name for p in written)} in {out or src.parent}", highlight=False,
                    soft_wrap=True)
    return 0


def run(args: argparse.Namespace) -> int:
    return run_redraw(PROG, args.path, args.out)
