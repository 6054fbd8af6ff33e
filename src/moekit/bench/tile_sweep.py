"""What the backward's tile sweeps share (`scripts/wgrad_compare.py`, `scripts/swiglu_bwd_compare.py`):
their common arguments and set-up (bf16 on a GPU; float16 and the tiny preset under the interpreter,
which computes bf16 dots wrongly), one timing of a checked variant, the best-first summary and the
rows written as JSON lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moekit.bench.results import write_jsonl
from moekit.bench.timing import time_fn
from moekit.shapes import MoEShape, get_shape


def add_args(p: argparse.ArgumentParser, gpu_tokens: str) -> None:
    """--preset, --tokens (default gpu_tokens on a GPU, 16 on the CPU), --rep, --out, --device."""
    p.add_argument("--preset", default=None, help="default: qwen3-30b-a3b on a GPU, tiny on the CPU")
    p.add_argument("--tokens", default=None, help=f"comma-separated (default: {gpu_tokens}; 16 on the CPU)")
    p.add_argument("--rep", type=int, default=None, help="timed calls a launch (default: 20; 1 on the CPU)")
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under the interpreter")


@dataclass(frozen=True)
class Sweep:
    """A sweep's device, dtype, shape, token counts and timed calls, from `add_args`'s arguments."""

    device: torch.device
    dtype: torch.dtype
    shape: MoEShape
    tokens: list[int]
    rep: int

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.on_gpu else "cpu (interpreter)"

    @classmethod
    def from_args(cls, p: argparse.ArgumentParser, a: argparse.Namespace, gpu_tokens: str) -> Sweep:
        dev = torch.device(a.device)
        on_gpu = dev.type == "cuda"
        try:
            tokens = [int(v) for v in (a.tokens or (gpu_tokens if on_gpu else "16")).split(",")]
        except ValueError:
            p.error(f"--tokens: comma-separated ints, got {a.tokens!r}")
        if any(t < 1 for t in tokens):
            p.error("--tokens: positive ints")
        return cls(dev, torch.bfloat16 if on_gpu else torch.float16,
                   get_shape(a.preset or ("qwen3-30b-a3b" if on_gpu else "tiny")), tokens,
                   a.rep or (20 if on_gpu else 1))

    def time(self, fn: Callable[[], object]) -> float:
        """Median ms of fn alone, from a CUDA graph on a GPU, L2 flushed before each call (`time_fn`);
        interpreted: nothing to compile or warm."""
        return time_fn(fn, graph=self.on_gpu, device=self.device, rep=self.rep,
                       warmup=None if self.on_gpu else 0, min_rep=1).median_ms


def first_line(exc: BaseException) -> str:
    """'Type: first line of the message' (at most 160 characters of it)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def best_first(rows: Sequence[dict], ref: str, label: str = "variant", top: int | None = None) -> list[str]:
    """Per T (in the rows' order), the timed rows fastest first: 'label ms (x ref)', ref the variant
    whose time the others are set against (no ratio where it was not timed)."""
    lines = []
    for t in dict.fromkeys(r["tokens"] for r in rows):
        timed = sorted((r for r in rows if r["tokens"] == t and "ms" in r), key=lambda r: r["ms"])
        ref_ms = next((r["ms"] for r in timed if r["variant"] == ref), None)
        cells = [f"{r[label]} {r['ms']:.3f}" + (f" ({ref_ms / r['ms']:.2f}x)" if ref_ms else "")
                 for r in timed]
        lines.append(f"{t:>6} " + "; ".join(cells[:top]))
    return lines


def write_rows(path: str | None, rows: Sequence[dict]) -> None:
    """The rows as JSON lines in path (nothing when path is None)."""
    write_jsonl(path, rows)
