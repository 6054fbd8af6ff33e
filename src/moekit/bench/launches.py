"""Kernel launches per call and how busy the device was, from one profiled call.

CUDA: torch.profiler with CUDA activity; every GPU activity of the call is an interval on the
device. `kernels` counts the kernel intervals (memcpy and memset are not kernels), `busy_ms` is the
length of the union of all intervals (kernels and copies), so wall time − busy time is the time the
GPU sat idle waiting for the CPU.

CPU: there is no device timeline, so `busy_ms` is NaN. `kernels` counts what would be a launch on
a GPU: every aten op that computes (view and allocation ops excluded) plus every Triton launch.
The Triton interpreter has no launch hook, so its entry point is wrapped while counting, and the
torch ops it runs internally to stage arguments are not counted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekit.bench.timing import CacheFlusher

_aten = torch.ops.aten
# Ops that only allocate or describe memory: no kernel runs on a GPU for them.
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.lift_fresh.default,
    _aten.set_.source_Storage_storage_offset, _aten.resize_.default,
}


@dataclass(frozen=True)
class LaunchProfile:
    """Launches and device busy time of one call.

    Attributes:
        kernels: kernels launched by one call (see the module doc for the CPU count).
        busy_ms: time the device spent running them (union of activity intervals); NaN on CPU.
    """

    kernels: int
    busy_ms: float


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func not in _NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


class _TritonInterpreterCounter:
    """Counts interpreted Triton launches and pauses `ops` counting inside them."""

    def __init__(self, ops: _OpCounter):
        self.ops = ops
        self.launches = 0
        self._cls = None
        self._orig = None

    def __enter__(self) -> _TritonInterpreterCounter:
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            return self
        self._cls, self._orig = InterpretedFunction, InterpretedFunction.run
        orig, counter = self._orig, self

        def run(fn_self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                counter.launches += 1
            counter.ops.paused += 1
            try:
                return orig(fn_self, *args, **kwargs)
            finally:
                counter.ops.paused -= 1

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        if self._cls is not None:
            self._cls.run = self._orig


@contextlib.contextmanager
def patched_runs(kernels: Sequence, wrap: Callable) -> Iterator[None]:
    """Each Triton kernel's launches (kernel[grid](...) calls its `run`) through wrap(kernel, run): an
    instance attribute `run`. On exit the attribute an enclosing patch had set is put back, or removed.
    Not monkeypatch.setattr: its undo leaves the class's bound `run` behind as an instance attribute,
    which hides any later patch of the class's method (`_TritonInterpreterCounter` counts interpreted
    launches that way) from these kernels."""
    saved = [k.__dict__.get("run") for k in kernels]
    for k in kernels:
        k.run = wrap(k, k.run)
    try:
        yield
    finally:
        for k, before in zip(kernels, saved, strict=True):
            if before is None:
                del k.run
            else:
                k.run = before


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals in µs, returned in ms."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e3


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def _profile_cuda(call: Callable[[], object], device: torch.device) -> LaunchProfile:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in gpu if not _is_copy(e.name)]
    busy = _union_ms([(e.time_range.start, e.time_range.end) for e in gpu])
    return LaunchProfile(kernels=len(kernels), busy_ms=busy if gpu else math.nan)


def _profile_cpu(call: Callable[[], object]) -> LaunchProfile:
    counter = _OpCounter()
    with counter, _TritonInterpreterCounter(counter) as triton_counter:
        call()
    return LaunchProfile(kernels=counter.ops + triton_counter.launches, busy_ms=math.nan)


def profile_call(call: Callable[[], object], device: torch.device | str,
                 flush: CacheFlusher | None = None) -> LaunchProfile:
    """Profile one call (warm it up first). Starts from a flushed cache and an idle device."""
    device = torch.device(device)
    if flush is not None:
        flush()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return _profile_cuda(call, device)
    return _profile_cpu(call)
