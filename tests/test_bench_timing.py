"""time_fn: statistics, repeat counts, and CUDA-graph capture (GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from moekit.bench.timing import MAX_REP, MIN_REP, NotCapturable, TimingStats, capture_graph, time_fn


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


def test_time_fn_counts_calls_and_measures_them():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    s = time_fn(fn, warmup=2, rep=5, flush_l2=False, device="cpu")
    assert s.n == 5 and len(calls) == 7          # warm-up first, then one timed call each
    assert s.median_ms >= 2.0                     # the sleep is inside the window


def test_default_repeats_follow_the_article():
    fast = time_fn(lambda: None, flush_l2=False, device="cpu")
    assert fast.n == MAX_REP                     # a trivial call gets the most repeats
    slow = time_fn(lambda: time.sleep(0.05), warmup=1, flush_l2=False, device="cpu")
    assert slow.n == MIN_REP                     # a slow one never fewer than the article's 15


def test_flush_runs_before_each_call():
    a = torch.ones(4)
    s = time_fn(lambda: a.add_(1), warmup=1, rep=3, flush_l2=True, device="cpu")
    assert s.n == 3 and float(a[0]) == 5.0


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
