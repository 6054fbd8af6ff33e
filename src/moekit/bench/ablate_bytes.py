"""`moekit ablate`'s bytes ablation: the DRAM bytes each kernel of one `layer` call moves, read from
Nsight Compute's counters, against the floor's byte count.

The parent runs `ncu` on a child Python process (`python -m moekit.bench.ablate_bytes ...`) that
builds the same workload (same preset, T, dtype and seed, so the same routing), warms the layer up,
then runs it once between cudaProfilerStart and cudaProfilerStop (`--profile-from-start off`), so
only that call's kernels are profiled, each with caches flushed first (ncu's default). Counters:

    dram__bytes_read.sum, dram__bytes_write.sum    per kernel launch, in bytes (--print-units base)

Where the counters cannot be read (no CUDA device, no `ncu`, ERR_NVGPUCTRPERM: profiling restricted
to administrators, a timeout), the row is "skipped" with the reason, never a guess.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
NCU_TIMEOUT_S = 600
DEFAULT_NCU_PATHS = ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")


@dataclass(frozen=True)
class KernelBytes:
    """One profiled kernel launch: its name and DRAM bytes."""

    kernel: str
    read: int
    write: int


def find_ncu(path: str | None = None) -> str | None:
    """The ncu executable: `path`, else ncu on PATH, else the usual CUDA install places."""
    if path:
        return path if Path(path).is_file() and os.access(path, os.X_OK) else None
    found = shutil.which("ncu")
    return found or next((p for p in DEFAULT_NCU_PATHS if Path(p).is_file() and os.access(p, os.X_OK)), None)


def ncu_command(ncu: str, log_file: Path, preset: str, tokens: int, dtype: torch.dtype, seed: int,
                device: torch.device) -> list[str]:
    return [ncu, "--csv", "--page", "raw", "--print-units", "base", "--metrics", ",".join(METRICS),
            "--profile-from-start", "off", "--target-processes", "all", "--log-file", str(log_file),
            sys.executable, "-m", "moekit.bench.ablate_bytes", "--preset", preset, "--tokens", str(tokens),
            "--dtype", str(dtype).removeprefix("torch."), "--seed", str(seed), "--device", str(device)]


def _number(text: str) -> int:
    return int(float(text.replace(",", "")))


def parse_ncu_csv(text: str) -> list[KernelBytes]:
    """Kernel launches of ncu's raw CSV page (header row, units row, one row per launch; ==PROF==
    lines and anything before the header skipped). ValueError when there is no table."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no CSV table in ncu's output")
    table = [ln for ln in lines[start:] if ln.startswith('"')]
    out = []
    for row in csv.DictReader(io.StringIO("\n".join(table))):
        if not row.get("ID", "").strip() or not row.get(METRICS[0], "").strip():
            continue                                       # the units row
        out.append(KernelBytes(row["Kernel Name"], _number(row[METRICS[0]]), _number(row[METRICS[1]])))
    if not out:
        raise ValueError("ncu profiled no kernel")
    return out


def ncu_problem(text: str, returncode: int) -> str:
    """Why ncu's counters could not be read, from its output ("" when nothing says so)."""
    if "ERR_NVGPUCTRPERM" in text:
        return ("ncu: ERR_NVGPUCTRPERM, GPU performance counters restricted to administrators (run as root, "
                "or load the driver with NVreg_RestrictProfilingToAdminUsers=0)")
    errors = [ln.strip() for ln in text.splitlines() if "==ERROR==" in ln]
    if errors:
        return "ncu: " + errors[0].removeprefix("==ERROR==").strip()
    return f"ncu exited with status {returncode}" if returncode else ""


def profile_layer(ncu: str, preset: str, tokens: int, dtype: torch.dtype, seed: int, device: torch.device,
                  timeout_s: int = NCU_TIMEOUT_S) -> tuple[list[KernelBytes], str]:
    """(kernels, "") from one profiled call of the layer, or ([], why the counters were not read)."""
    with tempfile.TemporaryDirectory(prefix="moekit-ncu-") as tmp:
        log = Path(tmp) / "ncu.csv"
        try:
            done = subprocess.run(ncu_command(ncu, log, preset, tokens, dtype, seed, device),
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [], f"ncu took longer than {timeout_s} s"
        except OSError as exc:
            return [], f"ncu could not start: {exc}"
        text = (log.read_text(errors="replace") if log.is_file() else "") + done.stdout + done.stderr
    problem = ncu_problem(text, done.returncode)
    if problem:
        return [], problem
    try:
        return parse_ncu_csv(text), ""
    except ValueError as exc:
        return [], f"ncu: {exc}"


def _child(argv: list[str]) -> int:
    """Under ncu: build the workload, warm the layer up, profile one call."""
    import moekit.kernels  # noqa: F401  (the interpreter switch, before any kernel)
    from moekit.bench.ablate_variants import Setup, build
    from moekit.bench.runner import make_weights, make_workload
    from moekit.shapes import PRESETS

    p = argparse.ArgumentParser(prog="moekit.bench.ablate_bytes")
    p.add_argument("--preset", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--device", required=True)
    args = p.parse_args(argv)
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), PRESETS[args.preset]
    weights = make_weights(shape, dtype, device, args.seed)
    work = make_workload(args.preset, shape, args.tokens, weights, dtype, device, seed=args.seed,
                         routing_draws=1)
    call = build("layer", Setup(work)).call
    for _ in range(3):
        call()
    torch.cuda.synchronize(device)
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize(device)
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
