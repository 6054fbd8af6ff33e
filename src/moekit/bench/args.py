"""Flags, argument types, defaults and up-front checks shared by every `moekit` subcommand.

A flag means the same thing in every study that has it, and is added by the one function here:

    --preset      layer shape preset (`add_preset`; `moekit bench` takes a comma-separated list), or
    --shape       E=..,H=..,I=..,K=..[,norm=0|1], or
    --config      a Transformers config.json (the three are mutually exclusive; `moekit bench` takes
                  --shape / --config more than once); a study reads them with `resolve_layers` or
                  `resolve_layer` (`moekit.bench.layers.Layer`: the rows' preset name and the shape)
    --backends    experts backends, comma-separated (`add_backends`)
    --graph       time CUDA-graph replays; --no-graph: eager calls only (`add_graph`)
    --dtype       weights and activations dtype (`add_dtype`)
    --weights     the expert weights: dense in --dtype, or block-scaled FP8 (`add_weights`)
    --device      cpu, cuda or cuda:N (`add_device`)
    --seed        seed of the weights, tokens and routing (`add_seed`)
    --rep         timed calls (or iterations) per case; --warmup: untimed ones first (`add_timing`)
    --out         the run's folder: results.csv, report.md, plots; --overwrite (`add_out`)
    --threads     torch intra-op threads while a CPU run measures, default 1 (`add_threads`; the
                  study measures inside `cpu_threads`, which restores the count after)

Defaults that depend on the machine (`GPU_PRESET` on a GPU, `CPU_PRESET` on a CPU-only machine,
bfloat16 or float32) are resolved by `resolve_device`, `pick` and `resolve_dtype`.

Each `type=` function rejects a bad value while argparse parses, so the user gets argparse's one
line (`moekit bench: error: argument --rep: expected an integer >= 1, got '0'`), exit status 2 and
no traceback, before anything is measured. Checks that need several arguments, the file system or
the device at run time (`check_out_dir`, `check_no_results`, `check_memory`: the layer's weights
fit) raise `UsageError`; a subcommand's `run` turns it into the same kind of line with `usage_error`.

Exit statuses of every study: 0 when at least one case was measured, 1 when none was (every case
failed, errored or was skipped), 2 on a usage error (bad argument, unwritable folder, bad input file).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import torch

from moekit import _memory
from moekit._validation import MAX_PAIRS
from moekit.bench.layers import SHAPE_SYNTAX, Layer, parse_shape, preset_layer, read_config, shape_name
from moekit.bench.results import FP8
from moekit.shapes import PRESETS

GPU_PRESET = "qwen3-30b-a3b"     # every study's layer on a GPU
CPU_PRESET = "tiny"              # on a CPU-only machine (Triton interpreted)
RESULTS_ROOT = Path("moekit-results")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
WEIGHTS = ("dtype", FP8)         # --weights: dense in --dtype, or block-scaled e4m3 (`moekit.bench.fp8`)
SEED_MAX = 2**63 - 2  # torch generators take up to 2**64 - 1; studies derive seed + 1
TOKENS_MAX = MAX_PAIRS  # a call of T tokens has at least T (token, expert) pairs


class UsageError(ValueError):
    """A bad argument or input found after parsing; the message names the argument or file."""


def default_backends() -> tuple[str, ...]:
    """Backends a study runs unless --backends names others: every registered one but `masked`,
    the decode layout, whose default capacity holds E * S rows (tens of GB at prefill sizes)."""
    from moekit.experts import BACKENDS  # here, so that `moekit --help` loads no kernels

    return tuple(b for b in BACKENDS if b != "masked")


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


def int_list(lo: int, hi: int | None = None) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each in [lo, hi] (no upper bound when hi is None)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(s) for s in csv_list(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(v < lo or (hi is not None and v > hi) for v in values):
            want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected integers {want}, got {text!r}")
        return values

    return parse


token_count = int_range(1, TOKENS_MAX)
token_counts = int_list(1, TOKENS_MAX)


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
    """"" when `path` is, or can be created as, a folder this process may write into: tried by
    creating a file in it, or a folder and a file in its nearest existing parent, each of a unique
    name and removed again (permission bits do not bind root, and /proc or a read-only mount refuse
    writes that they would allow; unique names keep ranks checking one folder at once apart)."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a folder"
        return _write_probe_problem(path, "the folder is not writable")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    try:
        probe = tempfile.mkdtemp(dir=parent, prefix=".moekit-write-check-")
    except OSError as exc:
        return f"cannot create a folder in {parent} ({exc.strerror or exc})"
    try:
        return _write_probe_problem(Path(probe), f"cannot write in a folder created in {parent}")
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def _write_probe_problem(folder: Path, problem: str) -> str:
    """"" when a file can be created in `folder` (and is removed again), else `problem` and why."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".moekit-write-check-")
    except OSError as exc:
        return f"{problem} ({exc.strerror or exc})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return ""


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


def one_name(known: Callable[[], Collection[str]], what: str) -> Callable[[str], str]:
    """Exactly one name from known() (called at parse time)."""
    parse_names = names(known, what)

    def parse(text: str) -> str:
        items = parse_names(text)
        if len(items) != 1:
            raise argparse.ArgumentTypeError(f"expected one {what}, got {text!r}")
        return items[0]

    return parse


preset = one_name(lambda: sorted(PRESETS), "preset")


def resolve_device(device: torch.device | None) -> torch.device:
    """--device, or the default: cuda when available."""
    return device or default_device()


def pick(value, device: torch.device, gpu, cpu):
    """`value` when the user gave one (not None), else the GPU or the CPU default for `device`."""
    if value is not None:
        return value
    return gpu if device.type == "cuda" else cpu


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype, or the default: bfloat16 on a GPU, float32 on the CPU."""
    return DTYPES[name] if name else pick(None, device, torch.bfloat16, torch.float32)


def shape_spec(text: str) -> Layer:
    """--shape E=..,H=..,I=..,K=..[,norm=0|1] (`moekit.bench.layers.parse_shape`)."""
    try:
        return parse_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_config(text: str) -> Layer:
    """--config CONFIG.json: a Transformers config, read offline (`moekit.bench.layers.read_config`)."""
    try:
        return read_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_preset(p: argparse.ArgumentParser, *, multiple: bool = False, default: str | None = None) -> None:
    """--preset (a comma-separated list when `multiple`), or --shape, or --config (each may be given
    more than once when `multiple`): the layer(s) to measure, mutually exclusive. Read them with
    `resolve_layers` / `resolve_layer`."""
    when = f"default: {default}" if default else \
        f"default: {GPU_PRESET} on a GPU, {CPU_PRESET} on a CPU-only machine"
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preset", type=names(lambda: sorted(PRESETS), "preset") if multiple else preset,
                       default=default,
                       help=f"layer shape preset{'(s), comma-separated,' if multiple else ''} "
                            f"from {', '.join(sorted(PRESETS))} ({when})")
    action, again = ("append", " (may be given more than once)") if multiple else ("store", "")
    group.add_argument("--shape", type=shape_spec, action=action, dest="layers", default=None,
                       metavar="E=..,H=..,I=..,K=..",
                       help=f"a layer shape instead of a preset: {SHAPE_SYNTAX} (norm=0: the top-k weights "
                            f"are not renormalised){again}")
    group.add_argument("--config", type=model_config, action=action, dest="layers", default=None,
                       metavar="CONFIG.json",
                       help="the MoE layer of a Transformers config.json (Qwen3-MoE, Qwen2-MoE, OLMoE, "
                            f"Mixtral, DeepSeek-V2/V3, GPT-OSS), read offline, instead of a preset{again}")


def _warn_stderr(message: str) -> None:
    print(f"moekit: warning: {message}", file=sys.stderr)


def resolve_layers(args: argparse.Namespace, device: torch.device,
                   warn: Callable[[str], None] | None = None) -> list[Layer]:
    """The layers of --shape / --config (in the order given), else of --preset, else the machine's
    default preset. What a config holds beyond moekit's layer (`Layer.notes`) goes to `warn`
    (default: stderr). ValueError when two different layers share a name."""
    given = getattr(args, "layers", None)
    if given is not None:
        layers = given if isinstance(given, list) else [given]
    else:
        names_ = args.preset if args.preset is not None else pick(None, device, GPU_PRESET, CPU_PRESET)
        layers = [preset_layer(n) for n in (names_ if isinstance(names_, list) else [names_])]
    out: dict[str, Layer] = {}
    for layer in layers:
        if layer.name in out and out[layer.name].shape != layer.shape:
            raise ValueError(f"--config: two different layers are named {layer.name!r}; rename one file")
        out.setdefault(layer.name, layer)
    for layer in out.values():
        for note in layer.notes:
            (warn or _warn_stderr)(note)
    return list(out.values())


def resolve_layer(args: argparse.Namespace, device: torch.device,
                  warn: Callable[[str], None] | None = None) -> Layer:
    """The one layer of a study that measures one (`resolve_layers`)."""
    layers = resolve_layers(args, device, warn)
    if len(layers) != 1:
        raise ValueError(f"expected one layer, got {len(layers)}")
    return layers[0]


def check_memory(layers: Collection[Layer], dtype: torch.dtype, device: torch.device,
                 tokens: Collection[int] = (), *, fp8: bool = False, backward: bool = False,
                 drawn_in_fp32: bool = True) -> None:
    """UsageError naming the first layer whose weights, with the tensors of its largest T, would not
    fit in what the device may give a run (`moekit._memory`; `runner.memory_bytes`): refused before
    anything is allocated or measured."""
    from moekit.bench.runner import memory_bytes  # here: the runner loads the kernels

    t = max(tokens, default=0)
    allowed = _memory.allowed_bytes(device)
    for layer in layers:
        need = memory_bytes(layer.shape, dtype, t, fp8=fp8, backward=backward, drawn_in_fp32=drawn_in_fp32)
        if need <= allowed:
            continue
        label = shape_name(layer.shape)
        name = label if layer.name == label else f"{layer.name} ({label.removeprefix('shape:')})"
        what = f"{str(dtype).removeprefix('torch.')} weights" + (f" and the tensors of T={t}" if t else "")
        free = _memory.free_bytes(device)
        raise UsageError(f"layer {name} needs {need / 1e9:.3g} GB ({what}), over the {allowed / 1e9:.3g} GB "
                         f"a run may take on {device} ({_memory.MEMORY_HEADROOM:.0%} of the {free / 1e9:.3g} "
                         "GB free); choose a smaller layer or fewer tokens")


def layer_given(args: argparse.Namespace) -> bool:
    """Whether --preset, --shape or --config was given (False: the machine's default preset)."""
    return getattr(args, "preset", None) is not None or getattr(args, "layers", None) is not None


def add_backends(p: argparse.ArgumentParser, known: Callable[[], Collection[str]], default: list[str] | None,
                 help: str) -> None:
    """--backends: experts backends, comma-separated, each checked against known()."""
    p.add_argument("--backends", type=names(known, "backend"), default=default, help=help)


def add_graph(p: argparse.ArgumentParser, help: str) -> None:
    """--graph / --no-graph: time CUDA-graph replays; None when neither is given (the study decides)."""
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None, help=help)


def add_dtype(p: argparse.ArgumentParser, choices: Collection[str] = tuple(sorted(DTYPES)),
              default: str | None = None) -> None:
    when = f"default: {default}" if default else "default: bfloat16 on a GPU, float32 on the CPU"
    p.add_argument("--dtype", choices=choices, default=default,
                   help=f"weights and activations dtype ({when})")


def add_weights(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--weights", choices=WEIGHTS, default="dtype", help=help)


def add_device(p: argparse.ArgumentParser,
               help: str = "cuda, cuda:N or cpu (default: cuda when available)") -> None:
    p.add_argument("--device", type=device, default=None, help=help)


def add_seed(p: argparse.ArgumentParser, what: str = "the weights, tokens and routing") -> None:
    p.add_argument("--seed", type=int_range(0, SEED_MAX), default=0, help=f"seed of {what} (default 0)")


def add_timing(p: argparse.ArgumentParser, rep_help: str, warmup_help: str = "untimed calls per case first",
               *, rep_aliases: tuple[str, ...] = ()) -> None:
    """--rep (timed calls or iterations per case) and --warmup; `rep_aliases`: older spellings, hidden."""
    p.add_argument("--rep", type=int_range(1), default=None, help=rep_help)
    for alias in rep_aliases:
        p.add_argument(alias, type=int_range(1), dest="rep", default=None, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int_range(0), default=None, help=warmup_help)


def add_out(p: argparse.ArgumentParser, default: str, result_files: Collection[str], extra: str = "") -> None:
    """--out (the run's folder, refused when it holds results) and --overwrite."""
    p.add_argument("--out", type=out_dir, default=None,
                   help=f"output folder (default: {RESULTS_ROOT}/{default}); a folder that already holds "
                        f"{' or '.join(result_files)} is refused unless --overwrite is given{extra}")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results already in --out (files of the same names; others are kept)")


def check_out(out: Path | None, result_files: Collection[str], overwrite: bool) -> None:
    """Before any work: --out (or the default's parent) is writable and holds no results."""
    if out is None:
        check_out_dir(RESULTS_ROOT, "the default output folder")
        return
    check_out_dir(out)
    check_no_results(out, result_files, overwrite)


def add_threads(p: argparse.ArgumentParser) -> None:
    """--threads: torch intra-op threads while a CPU run measures (`cpu_threads`)."""
    p.add_argument("--threads", type=int_range(1, 1024), default=1,
                   help="CPU runs only: torch intra-op threads while measuring (default 1: the shapes small "
                        "enough for the CPU gain nothing from more, and on a shared machine waiting threads "
                        "cost ms per op and make timings noisy)")


@contextlib.contextmanager
def cpu_threads(device: torch.device, threads: int) -> Iterator[int | None]:
    """torch's intra-op threads set to `threads` while a CPU study measures, restored after; yields
    the count in effect, which the rows record (None on a GPU, where nothing is changed)."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
