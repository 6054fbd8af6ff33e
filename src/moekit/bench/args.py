"""Argument types and up-front checks shared by every `moekit` subcommand.

Each `type=` function rejects a bad value while argparse parses, so the user gets argparse's one
line (`moekit bench: error: argument --rep: expected an integer >= 1, got '0'`), exit status 2 and
no traceback, before anything is measured. Checks that need several arguments or the file system
state at run time (`check_out_dir`, `check_no_results`) raise `UsageError`; a subcommand's `run`
turns it into the same kind of line with `usage_error`.

Exit statuses of every study: 0 when at least one case was measured, 1 when none was (every case
failed, errored or was skipped), 2 on a usage error (bad argument, unwritable folder, bad input file).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Collection
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
SEED_MAX = 2**63 - 2  # torch generators take up to 2**64 - 1; studies derive seed + 1


class UsageError(ValueError):
    """A bad argument or input found after parsing; the message names the argument or file."""


def usage_error(prog: str, message: object) -> int:
    """Print argparse's style of error line to stderr and return exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def csv_list(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (no upper bound when hi is None)."""
    def parse(text: str) -> int:
        v = _int(text)
        if v < lo or (hi is not None and v > hi):
            want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected an integer {want}, got {text!r}")
        return v

    return parse


def int_list(lo: int) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each >= lo."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(s) for s in csv_list(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(v < lo for v in values):
            raise argparse.ArgumentTypeError(f"expected integers >= {lo}, got {text!r}")
        return values

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (nan, inf, 0 and negatives are refused)."""
    return _positive_float(text.strip())


def positive_float_list(text: str) -> list[float]:
    """A comma-separated list of finite numbers > 0."""
    try:
        return [_positive_float(s) for s in csv_list(text)]
    except argparse.ArgumentTypeError:
        msg = f"expected comma-separated finite numbers > 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def names(known: Callable[[], Collection[str]], what: str) -> Callable[[str], list[str]]:
    """A comma-separated list of names, each in known() (called at parse time), duplicates dropped."""
    def parse(text: str) -> list[str]:
        allowed = known()
        items = list(dict.fromkeys(csv_list(text)))
        bad = [s for s in items if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))}; expected from "
                                             f"{', '.join(allowed)}")
        return items

    return parse


def device(text: str) -> torch.device:
    """cpu, cuda or cuda:N, where CUDA (and device N) must exist on this machine."""
    try:
        dev = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type == "cpu" and dev.index is None:
        return dev
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA "
                                         "device(s)")
    return dev


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _writable_folder_problem(path: Path) -> str:
    """"" when `path` is, or can be created as, a folder this process may write into."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a folder"
        return "" if os.access(path, os.W_OK | os.X_OK) else "the folder is not writable"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    return "" if os.access(parent, os.W_OK | os.X_OK) else f"cannot create a folder in {parent}"


def out_dir(text: str) -> Path:
    """A folder that exists and is writable, or that can be created (checked now, before any work)."""
    path = Path(text)
    problem = _writable_folder_problem(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return path


def out_file(text: str) -> Path:
    """A file to write: not a folder, in a folder that exists and is writable or can be created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder, expected a file")
    problem = _writable_folder_problem(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({path.parent}: {problem})")
    return path


def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return path


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """UsageError unless `path` is, or can be created as, a writable folder."""
    problem = _writable_folder_problem(Path(path))
    if problem:
        raise UsageError(f"{flag} {path}: {problem}")


def check_no_results(path: Path, result_names: Collection[str], overwrite: bool) -> None:
    """UsageError when the folder already holds one of `result_names`, unless `overwrite`: a study
    must never silently replace earlier results."""
    path = Path(path)
    if overwrite or not path.is_dir():
        return
    found = sorted(n for n in result_names if (path / n).exists())
    if found:
        raise UsageError(f"--out {path}: already holds results ({', '.join(found)}); choose another "
                         "folder, or pass --overwrite to replace them")
