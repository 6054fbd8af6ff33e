"""time_fn: statistics, repeat counts, and CUDA-graph capture (GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.bench import timing
from moekit.bench.timing import (
    MAX_REP,
    MIN_REP,
    TARGET_MS,
    NotCapturable,
    TimingStats,
    capture_graph,
    time_fn,
)


def test_stats_from_samples():
    s = TimingStats.from_samples([float(v) for v in range(1, 11)])  # 1..10
    assert s.n == 10
    assert s.median_ms == pytest.approx(5.5)
    assert s.p20_ms == pytest.approx(2.8)   # linear interpolation at 0.2 * 9 = 1.8 -> 2 + 0.8
    assert s.p80_ms == pytest.approx(8.2)
    assert s.p20_ms <= s.median_ms <= s.p80_ms
    with pytest.raises(ValueError):
        TimingStats.from_samples([])


def test_stats_are_frozen():
    s = TimingStats(1.0, 0.5, 2.0, 3)
    with pytest.raises(AttributeError):
        s.median_ms = 2.0


class FakeClock:
    """Stands in for time.perf_counter inside moekit.bench.timing: only `advance` moves it.

    A test thus states how long each call takes, and the statistics follow exactly, on any machine
    and under any load (a wall-clock assertion is never a unit test).
    """

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_time_fn_counts_calls_and_measures_them(clock):
    calls = []

    def fn():
        calls.append(1)
        clock.advance(0.002 * len(calls))         # call i takes 2i ms

    s = time_fn(fn, warmup=2, rep=5, flush_l2=False, device="cpu")
    assert s.n == 5 and len(calls) == 7          # warm-up first, then one timed call each
    # The timed calls are calls 3..7 (6..14 ms): the window holds exactly the call.
    assert s.median_ms == pytest.approx(10.0) and s.p20_ms == pytest.approx(7.6)
    assert s.p80_ms == pytest.approx(12.4)


def test_default_repeats_follow_the_article(clock):
    fast = time_fn(lambda: None, flush_l2=False, device="cpu")
    assert fast.n == MAX_REP                     # a trivial call gets the most repeats
    slow = time_fn(lambda: clock.advance(0.05), warmup=1, flush_l2=False, device="cpu")
    assert slow.n == MIN_REP                     # a slow one never fewer than the article's 15
    assert slow.median_ms == pytest.approx(50.0)
    # Between the two: about TARGET_MS of calls.
    mid = time_fn(lambda: clock.advance(0.004), warmup=1, flush_l2=False, device="cpu")
    assert mid.n == math.ceil(TARGET_MS / 4.0)


def test_default_repeats_are_sized_by_a_warm_call(clock):
    """One warm-up call that compiles (slow) must not size the repeats: a warm call does."""
    calls = []

    def fn():
        calls.append(1)
        clock.advance(0.1 if len(calls) == 1 else 0.004)    # 100 ms the first time, then 4 ms

    s = time_fn(fn, warmup=1, flush_l2=False, device="cpu")
    assert s.n == math.ceil(TARGET_MS / 4.0) and len(calls) == 2 + s.n
    assert s.median_ms == pytest.approx(4.0)
    calls.clear()                                           # no warm-up asked: none is run
    assert time_fn(fn, warmup=0, flush_l2=False, device="cpu").n == len(calls) == MAX_REP


def test_flush_runs_before_each_call():
    a = torch.ones(4)
    s = time_fn(lambda: a.add_(1), warmup=1, rep=3, flush_l2=True, device="cpu")
    assert s.n == 3 and float(a[0]) == 5.0


def test_clean_flush_writes_then_reads(monkeypatch):
    """flush_l2="clean": the buffer written, then a second one as large read, before each call."""
    from moekit.bench import timing

    seen = []
    real = timing.CacheFlusher.__call__

    def spy(self):
        seen.append(self.mode)
        real(self)
        assert self.clean is not None and self.clean.numel() * 8 == self.buffer.numel()

    monkeypatch.setattr(timing.CacheFlusher, "__call__", spy)
    a = torch.ones(4)
    s = time_fn(lambda: a.add_(1), warmup=1, rep=3, flush_l2="clean", device="cpu")
    assert s.n == 3 and float(a[0]) == 5.0 and seen == ["clean"] * 4
    with pytest.raises(ValueError, match=r"flush_l2 must be True, False or one of \('write', 'clean'\)"):
        time_fn(lambda: None, flush_l2="cold", device="cpu")
    with pytest.raises(ValueError, match="CacheFlusher mode"):
        timing.CacheFlusher(torch.device("cpu"), "cold")


def test_each_flush_mode_does_its_own_work():
    """The aten ops a flush issues: a write of the whole buffer; "clean" then a reduction that reads
    every element of the second buffer (as large as the first); the written flush reads nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moekit.bench.timing import CacheFlusher

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func.overloadpacket.__name__, args[0].numel() * args[0].element_size()))
            return func(*args, **(kwargs or {}))

    for mode in ("write", "clean"):
        flusher = CacheFlusher(torch.device("cpu"), mode)
        nbytes = flusher.buffer.numel()
        with Ops() as ops:
            flusher()
        want = [("zero_", nbytes)] + ([("max", nbytes)] if mode == "clean" else [])
        assert ops.seen == want, (mode, ops.seen)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rep"):
        time_fn(lambda: None, rep=0, device="cpu")
    with pytest.raises(ValueError, match="warmup"):
        time_fn(lambda: None, warmup=-1, device="cpu")


def test_graph_needs_cuda():
    with pytest.raises(NotCapturable, match="CUDA"):
        time_fn(lambda: None, graph=True, device="cpu")


@pytest.mark.gpu
def test_graph_replays_are_timed_and_sync_is_not_capturable():
    a = torch.randn(512, 512, device="cuda")
    s = time_fn(lambda: a @ a, graph=True, rep=20)
    assert s.n == 20 and s.median_ms > 0
    default = torch.cuda.current_stream()
    with pytest.raises(NotCapturable):
        capture_graph(lambda: (a.sum() > 0).item(), torch.device("cuda"))
    # A failed capture must leave the default stream current and the device usable.
    assert torch.cuda.current_stream() == default
    torch.testing.assert_close((a @ a).sum(), (a @ a).sum())
