"""`moekit` command line: one subcommand per study, each in the lab module that owns it.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Only the module of
the subcommand being run is imported (`moekit --help` and `moekit --version` import none of them:
no study, plotting or console code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection

from moekit import env

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("moekit.bench.cli", "time every backend against the roofline floor"),
    "report": ("moekit.bench.report_cli", "redraw any study's plots and report from its results CSV"),
    "imbalance": ("moekit.bench.imbalance", "skewed routing: one GPU, simulated EP, capacity, replication"),
    "ep-bench": ("moekit.bench.ep_bench", "expert parallelism over torch.distributed (use torchrun)"),
    "tune": ("moekit.bench.tune", "search tile configs for a shape on this GPU, write a JSON table"),
    "ablate": ("moekit.bench.ablate", "what each design choice of the triton path buys, against the article"),
    "profile": ("moekit.bench.profile", "where one call's time goes: kernels, host work, graph launch"),
    "sweep": ("moekit.bench.variants", "tile configs and variants of the triton path side by side"),
    "e2e": ("moekit.bench.e2e", "Transformers generation end to end, per experts implementation"),
}


def _version() -> str:
    from moekit import __version__

    return __version__


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the arguments of `commands` only (None: of every subcommand)."""
    parser = argparse.ArgumentParser(prog="moekit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"moekit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if commands is None or name in commands:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


# The `bench` extra: the lab's console and plots (the runtime never needs them).
EXTRA_MODULES = ("rich", "matplotlib")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top level takes no option with a value, so the first bare word is the subcommand.
    command = next((a for a in argv if not a.startswith("-")), None)
    prog = f"moekit {command}" if command in SUBCOMMANDS else "moekit"
    try:
        env.check_all()     # before any module reads a switch at import, and before any work
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = build_parser([command] if command in SUBCOMMANDS else []).parse_args(argv)
        return int(args._run(args) or 0)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRA_MODULES:
            raise
        print(f"{prog}: error: {missing} is not installed; the lab needs the bench extra: "
              "pip install 'moekit[bench]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
