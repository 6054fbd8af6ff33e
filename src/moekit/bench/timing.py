"""Timing one call the way a forward pass experiences it.

Method (the article's Step 3): warm up first, then time every call on its own. Before each call the
last-level cache is flushed by writing a buffer larger than it, and the device is synchronised, so
the timed window starts with an idle GPU and a cold cache; the CPU's launch work therefore counts,
as it does in a real forward pass.

A written flush leaves the cache full of dirty lines: the timed call's first reads each evict one,
and on a GPU that is a write-back to memory inside the timed window (up to the L2's size, 50 MB on
an H100 / H200, beside a T = 1 decode call's 75 MB of weights). `flush_l2="clean"` instead writes
the buffer and then reads a second one as large: the write-backs happen in the flush and the
cache is left holding clean lines of no use to the call (cold, as after a layer that only read).

On CUDA the window is two CUDA events; on the CPU it is `time.perf_counter`. With `graph=True` the
call is captured once in a CUDA graph and the replays are timed.

Repeat counts: the article took medians of 15 to 400 calls. By default `time_fn` spends about
`TARGET_MS` of wall time (flushes included) on timed calls, never fewer than `MIN_REP` calls nor
more than `MAX_REP`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moekit.graphs import NotCapturable, capture_graph

__all__ = ["NotCapturable", "TimingStats", "capture_graph", "sync", "time_fn"]

MIN_REP = 15
MAX_REP = 400
TARGET_MS = 400.0
MIN_WARMUP = 3
WARMUP_MS = 25.0
CPU_FLUSH_BYTES = 64 * 2**20  # larger than the last-level cache of common desktop and server CPUs


@dataclass(frozen=True)
class TimingStats:
    """Per-call times in milliseconds: median and the 20th / 80th percentiles over n calls."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    n: int

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> TimingStats:
        if len(samples_ms) == 0:
            raise ValueError("TimingStats.from_samples needs at least one sample")
        a = np.asarray(samples_ms, dtype=np.float64)
        p20, med, p80 = np.percentile(a, [20, 50, 80])
        return cls(float(med), float(p20), float(p80), int(a.size))


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


FLUSH_MODES = ("write", "clean")


class CacheFlusher:
    """Writes a buffer larger than the last-level cache, evicting whatever the last call left there;
    mode "clean" then reads a second buffer as large, so the cache holds clean lines (see above)."""

    def __init__(self, device: torch.device, mode: str = "write"):
        if mode not in FLUSH_MODES:
            raise ValueError(f"CacheFlusher mode must be one of {FLUSH_MODES}, got {mode!r}")
        self.device = device
        self.mode = mode
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20
            nbytes = max(256 * 2**20, 4 * l2)
        else:
            nbytes = CPU_FLUSH_BYTES
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.clean = torch.zeros(nbytes // 8, dtype=torch.int64, device=device) if mode == "clean" else None

    def __call__(self) -> None:
        self.buffer.zero_()
        if self.clean is not None:
            self.clean.max()                  # a read of every line: the dirty ones are written back now


def cache_flusher(device: torch.device, flush_l2: bool | str) -> CacheFlusher | None:
    """`time_fn`'s flush_l2 as a flusher: None for False, the written flush for True, else the mode
    named."""
    if flush_l2 is False:
        return None
    if flush_l2 is not True and flush_l2 not in FLUSH_MODES:
        raise ValueError(f"flush_l2 must be True, False or one of {FLUSH_MODES}, got {flush_l2!r}")
    return CacheFlusher(device, "write" if flush_l2 is True else flush_l2)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_call(call: Callable[[], object], device: torch.device,
                flush: CacheFlusher | None) -> float:
    """One call's time in ms, starting from a flushed cache and an idle device."""
    if flush is not None:
        flush()
    sync(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def time_fn(
    fn: Callable[[], object],
    *,
    graph: bool = False,
    warmup: int | None = None,
    rep: int | None = None,
    flush_l2: bool | str = True,
    device: torch.device | str | None = None,
    min_rep: int = MIN_REP,
) -> TimingStats:
    """Time `fn()` call by call.

    Args:
        fn: the work of one call, with its inputs bound (e.g. a lambda over prepared tensors).
        graph: capture `fn` once in a CUDA graph and time its replays (CUDA only; raises
            `NotCapturable` with the reason when capture fails).
        warmup: calls before timing; default: at least `MIN_WARMUP` and about `WARMUP_MS` of work.
        rep: timed calls; default: about `TARGET_MS` of calls, clamped to [`MIN_REP`, `MAX_REP`].
        flush_l2: write a buffer larger than the last-level cache before every call (True or
            "write"); "clean": then read another as large (no dirty lines left); False: no flush.
        device: where `fn` runs (default: the current CUDA device, else the CPU).
        min_rep: the fewest timed calls when `rep` is None (the CPU demo lowers it: interpreted
            Triton takes 0.1 to 1 s a call).

    Returns:
        TimingStats of the timed calls (median, p20, p80 in ms, n).
    """
    if warmup is not None and warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if rep is not None and rep < 1:
        raise ValueError(f"rep must be >= 1, got {rep}")
    if not 1 <= min_rep <= MAX_REP:
        raise ValueError(f"min_rep must be in [1, {MAX_REP}], got {min_rep}")
    dev = _resolve_device(device)
    flush = cache_flusher(dev, flush_l2)
    call: Callable[[], object] = fn
    if graph:
        g, _ = capture_graph(fn, dev)
        call = g.replay

    # Warm-up doubles as the estimate of one iteration's wall time, flush and sync included. The
    # first call may compile or allocate, so it is left out of the estimate, and when the repeats
    # are to be sized a single warm-up call gets a second (sized by the first alone, a
    # sub-millisecond CPU call whose first run took 25 ms got 15 timed calls instead of about 60).
    call_ms: list[float] = []
    wall_ms: list[float] = []
    n_warm = warmup if warmup is not None else MIN_WARMUP
    while len(call_ms) < n_warm or (rep is None and len(call_ms) == 1) or (
        warmup is None and sum(call_ms[1:]) < WARMUP_MS and len(call_ms) < 10 * MIN_WARMUP
    ):
        t0 = time.perf_counter()
        call_ms.append(_timed_call(call, dev, flush))
        wall_ms.append((time.perf_counter() - t0) * 1e3)
    if rep is None:
        estimate = min(wall_ms[1:] or [1.0])
        rep = int(min(MAX_REP, max(min_rep, math.ceil(TARGET_MS / max(estimate, 1e-3)))))
    samples = [_timed_call(call, dev, flush) for _ in range(rep)]
    return TimingStats.from_samples(samples)
