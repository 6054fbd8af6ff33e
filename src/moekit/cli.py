"""`moekit` command line: one subcommand per study, each in the module that owns it.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("moekit.bench.cli", "time every backend against the roofline floor"),
    "report": ("moekit.bench.report_cli", "redraw plots and the report from a results CSV"),
    "imbalance": ("moekit.bench.imbalance", "skewed routing: one GPU, simulated EP, capacity, replication"),
    "ep-bench": ("moekit.bench.ep_bench", "expert parallelism over torch.distributed (use torchrun)"),
    "tune": ("moekit.bench.tune", "search tile configs for a shape on this GPU, write a JSON table"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
