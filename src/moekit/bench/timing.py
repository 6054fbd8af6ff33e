"""Timing one call the way a forward pass experiences it.

Method (the article's Step 3): warm up first, then time every call on its own. Before each call the
last-level cache is flushed by writing a buffer larger than it, and the device is synchronised, so
the timed window starts with an idle GPU and a cold cache; the CPU's launch work therefore counts,
as it does in a real forward pass. On CUDA the window is two CUDA events; on the CPU it is
`time.perf_counter`. With `graph=True` the call is captured once in a CUDA graph and the replays
are timed.

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

MIN_REP = 15
MAX_REP = 400
TARGET_MS = 400.0
MIN_WARMUP = 3
WARMUP_MS = 25.0
CPU_FLUSH_BYTES = 64 * 2**20  # larger than the last-level cache of common desktop and server CPUs


class NotCapturable(RuntimeError):
    """`fn` cannot be recorded in a CUDA graph (it syncs the host, or there is no CUDA device)."""


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


class CacheFlusher:
    """Writes a buffer larger than the last-level cache, evicting whatever the last call left there."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20
            nbytes = max(256 * 2**20, 4 * l2)
        else:
            nbytes = CPU_FLUSH_BYTES
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_no_host_sync(fn: Callable[[], object], device: torch.device) -> None:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        raise NotCapturable(f"the call synchronizes the host: {str(exc).splitlines()[0]}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(device)


def _reset_capture_state(device: torch.device) -> None:
    """After a failed capture: a small capture that succeeds takes the generators out of capture mode."""
    stream = torch.cuda.Stream(device)
    scratch = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin()
            scratch.add_(1)
            graph.capture_end()
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass  # best effort: the original failure is what gets reported


def capture_graph(fn: Callable[[], object], device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """Record `fn` in a CUDA graph; raise `NotCapturable` with the reason when it cannot be.

    Returns:
        (graph, what fn returned while capturing: the static output every replay rewrites).
    """
    if device.type != "cuda":
        raise NotCapturable(f"CUDA graphs need a CUDA device, got {device}")
    # Warm up on a side stream first: lazy initialisation (cuBLAS handles, Triton JIT, caching
    # allocator growth) must not happen while capturing.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    # A capture that fails leaves PyTorch's CUDA generators in capture mode (every later random
    # op on the device then raises), so a call that syncs the host is caught here, uncaptured.
    _check_no_host_sync(fn, device)
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream(device)
    capture_stream.wait_stream(torch.cuda.current_stream(device))
    failure: Exception | None = None
    # capture_begin/end by hand rather than torch.cuda.graph(): when capture fails, that context
    # manager raises from capture_end before restoring the current stream, and every later op
    # would then run on the dead capture stream. Here the stream context always unwinds, and the
    # first error (the real reason, e.g. a host sync) is the one reported.
    with torch.cuda.stream(capture_stream):
        graph.capture_begin()
        try:
            out = fn()
        except Exception as exc:
            failure = exc
        try:
            graph.capture_end()
        except Exception as exc:
            failure = failure or exc
    torch.cuda.current_stream(device).wait_stream(capture_stream)
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # an invalidated capture may surface once more here
        failure = failure or exc
    if failure is not None:
        _reset_capture_state(device)
        text = str(failure).strip()
        raise NotCapturable(f"{type(failure).__name__}: {text.splitlines()[0] if text else ''}") from failure
    return graph, out


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
    flush_l2: bool = True,
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
        flush_l2: write a buffer larger than the last-level cache before every call.
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
    flush = CacheFlusher(dev) if flush_l2 else None
    call: Callable[[], object] = fn
    if graph:
        g, _ = capture_graph(fn, dev)
        call = g.replay

    # Warm-up doubles as the estimate of one iteration's wall time, flush and sync included (the
    # first call may compile, so it is left out of the estimate when there are others).
    call_ms: list[float] = []
    wall_ms: list[float] = []
    n_warm = warmup if warmup is not None else MIN_WARMUP
    while len(call_ms) < n_warm or (
        warmup is None and sum(call_ms[1:]) < WARMUP_MS and len(call_ms) < 10 * MIN_WARMUP
    ):
        t0 = time.perf_counter()
        call_ms.append(_timed_call(call, dev, flush))
        wall_ms.append((time.perf_counter() - t0) * 1e3)
    if rep is None:
        estimate = min(wall_ms[1:] or wall_ms or [1.0])
        rep = int(min(MAX_REP, max(min_rep, math.ceil(TARGET_MS / max(estimate, 1e-3)))))
    samples = [_timed_call(call, dev, flush) for _ in range(rep)]
    return TimingStats.from_samples(samples)
