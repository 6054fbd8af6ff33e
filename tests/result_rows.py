"""Hand-made result rows for the report, redraw and CLI tests (imported as `result_rows`)."""

from __future__ import annotations

import math

from moekit.bench.imbalance_report import ImbalanceRow
from moekit.bench.results import ResultRow

PROVENANCE = dict(
    run_id="20260101T000000Z", date="2026-01-01T00:00:00+00:00", commit="abc123", device_type="cpu",
    device_name="Test CPU", torch_version="2.13", triton_version="3.6", transformers_version="",
    python_version="3.11", moekit_version="0.1.0", dtype="float32", copy_gbps=20.0, matmul_tflops=0.2,
)


def make_row(**kw) -> ResultRow:
    base = dict(
        PROVENANCE,
        preset="tiny", num_experts=8, hidden_size=64, intermediate_size=48, top_k=2, tokens=4,
        backend="triton", mode="eager", status="ok", reason="", max_err=1e-7, tol=1e-6,
        median_ms=2.0, p20_ms=1.5, p80_ms=2.5, n_rep=15, bytes=100_000, flops=200_000, floor_ms=0.005,
        bound="memory", pct_floor=0.25, gbps=0.05, tflops=1e-4, kernels=8, busy_ms=math.nan,
        idle_pct=math.nan, experts_hit=5, experts_hit_mean=5.4, experts_expected=5.46875,
    )
    base.update(kw)
    return ResultRow(**base)


def sample_rows() -> list[ResultRow]:
    """Two backends timed at T = 1, 4, 16, and one failed case."""
    rows = []
    for t in (1, 4, 16):
        for b, k in (("loop", 30 + 9 * t), ("triton", 8)):
            rows.append(make_row(tokens=t, backend=b, kernels=k, median_ms=0.5 * t))
    rows.append(make_row(tokens=16, backend="padded", status="failed", reason="max error 1 > 0.1",
                         median_ms=math.nan, p20_ms=math.nan, p80_ms=math.nan, n_rep=None, kernels=None,
                         pct_floor=math.nan, gbps=math.nan, tflops=math.nan))
    return rows


def imbalance_rows() -> list[ImbalanceRow]:
    """A small `moekit imbalance` run: two scenarios, each with one-GPU, EP (2 ranks, before and
    after replication) and capacity rows, all timed."""
    head = dict(PROVENANCE, preset="tiny", num_experts=8, hidden_size=64, intermediate_size=48, top_k=2,
                tokens=16, seed=0, mode="eager")
    rows = []
    for scenario, skew in (("balanced", 1.0), ("collapse", 4.0)):
        base = dict(head, scenario=scenario, busiest_over_mean=skew)
        for backend, ms in (("loop", 2.0), ("padded", 1.0)):
            rows.append(ImbalanceRow(**base, experiment="one_gpu", backend=backend, status="ok", median_ms=ms,
                                     p20_ms=ms, p80_ms=ms, n_rep=3, floor_ms=0.01, pct_floor=1 / ms, pairs=32,
                                     kernels=5))
        for placement, replicas in (("contiguous", 0), ("replicated", 2)):
            for rank, ms in enumerate((1.0, 0.5)):
                rows.append(ImbalanceRow(**base, experiment="ep", backend="loop", status="ok", median_ms=ms,
                                         placement=placement, ep_ranks=2, spare_slots=1, replicas=replicas,
                                         rank=rank, rank_experts=4, rank_tokens=8, pairs=16))
            rows.append(ImbalanceRow(**base, experiment="ep_step", backend="loop", status="ok",
                                     placement=placement, ep_ranks=2, spare_slots=1, replicas=replicas,
                                     pairs=32, busiest_rank_pairs=16, pairs_busiest_over_mean=1.0,
                                     step_ms=1.0, mean_ms=0.75, slowest_over_mean=4 / 3, slowest_rank=0))
        for c in (1.0, 2.0):
            rows.append(ImbalanceRow(**base, experiment="capacity", backend="padded", status="ok",
                                     median_ms=1.0, capacity_factor=c, capacity=4, dropped=2, pairs=32,
                                     dropped_frac=2 / 32))
    return rows
