"""The runner: correctness gate first (a failing backend is never timed), launches, distinct experts."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.bench import runner
from moekit.bench.ceilings import Ceilings
from moekit.bench.peers import PEERS, transformers_version
from moekit.bench.runner import Options, make_weights, make_workload, mean_distinct_experts, run_case
from moekit.experts import BACKENDS
from moekit.shapes import PRESETS

TINY = PRESETS["tiny"]
CEILINGS = Ceilings(copy_gbps=10.0, matmul_tflops=0.1)
FAST = Options(warmup=0, rep=2, flush_l2=False, routing_draws=8)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def weights():
    return make_weights(TINY, torch.float32, CPU, seed=0)


@pytest.fixture(scope="module")
def work4(weights):
    return make_workload("tiny", TINY, 4, weights, torch.float32, CPU, routing_draws=8)


@pytest.fixture(scope="module")
def work16(weights):
    return make_workload("tiny", TINY, 16, weights, torch.float32, CPU, routing_draws=8)


def _never_timed(*args, **kwargs):
    raise AssertionError("a backend that failed its check was timed")


@pytest.mark.parametrize("wrong", ["zeros", "nan", "shape", "raises"])
def test_failing_backend_is_refused_not_timed(work4, monkeypatch, wrong):
    monkeypatch.setattr(runner, "time_fn", _never_timed)
    monkeypatch.setattr(runner, "profile_call", _never_timed)
    x = work4.x

    def factory(work):
        if wrong == "zeros":
            return lambda: torch.zeros_like(x)
        if wrong == "nan":
            return lambda: torch.full_like(x, math.nan)
        if wrong == "shape":
            return lambda: x[:-1]

        def boom():
            raise RuntimeError("kernel exploded")
        return boom

    m = run_case(work4, "broken", "eager", CEILINGS, FAST, factory=factory)
    assert m.status == ("error" if wrong == "raises" else "failed")
    assert m.timing is None and m.launches is None
    assert math.isnan(m.median_ms) and math.isnan(m.pct_floor)
    assert m.reason


def test_slightly_wrong_backend_fails_the_gate(work4, monkeypatch):
    monkeypatch.setattr(runner, "time_fn", _never_timed)
    ref = work4.expected.ref
    # An error 10x the budget, on one element only.
    bad = ref.clone()
    bad[0, 0] += 10 * work4.expected.tol
    m = run_case(work4, "broken", "eager", CEILINGS, FAST, factory=lambda w: lambda: bad)
    assert m.status == "failed" and m.max_err > m.tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_passes_and_is_timed(work4, backend):
    m = run_case(work4, backend, "eager", CEILINGS, FAST)
    assert m.status == "ok", m.reason
    assert m.max_err <= m.tol
    assert m.timing is not None and m.timing.n == FAST.rep
    assert m.pct_floor == pytest.approx(100 * m.floor_ms / m.timing.median_ms)
    assert m.launches is not None and m.launches.kernels > 0


def test_graph_mode_on_cpu_is_not_capturable(work4):
    m = run_case(work4, "triton", "graph", CEILINGS, FAST)
    assert m.status == "not_capturable" and "CUDA" in m.reason and m.timing is None


def test_loop_launches_per_expert_triton_a_handful(weights, work16):
    work1 = make_workload("tiny", TINY, 1, weights, torch.float32, CPU, routing_draws=8)
    loop1 = run_case(work1, "loop", "eager", CEILINGS, FAST).launches.kernels
    loop16 = run_case(work16, "loop", "eager", CEILINGS, FAST).launches.kernels
    tri1 = run_case(work1, "triton", "eager", CEILINGS, FAST).launches.kernels
    tri16 = run_case(work16, "triton", "eager", CEILINGS, FAST).launches.kernels
    extra_experts = work16.traffic.experts_hit - work1.traffic.experts_hit
    assert extra_experts >= 4
    assert loop16 - loop1 >= 5 * extra_experts        # several launches for every expert hit
    # Fused: a handful at any T, not one per expert (T = 1 takes the direct decode path, 2 fewer
    # launches; T = 16, 4 pairs an expert hit on tiny's 8 experts, the aligned path).
    assert tri1 <= tri16 <= 10
    assert loop16 > 5 * tri16


def test_workload_floor_uses_its_own_routing(work16):
    t = work16.traffic
    hit = int(torch.unique(work16.topk_ids).numel())
    assert t.experts_hit == hit
    assert t.weight_bytes == hit * TINY.expert_bytes(torch.float32)


@pytest.mark.parametrize("tokens", [4, 16, 64])
def test_workload_mean_experts_hit_matches_formula(weights, tokens):
    work = make_workload("tiny", TINY, tokens, weights, torch.float32, CPU)   # default routing draws
    assert work.experts_hit_mean == pytest.approx(TINY.expected_distinct_experts(tokens), rel=0.05)


@pytest.mark.parametrize("preset,tokens", [("tiny", 4), ("tiny", 16), ("qwen3-30b-a3b", 4),
                                           ("qwen3-30b-a3b", 16)])
def test_mean_distinct_experts_matches_formula(preset, tokens):
    shape = PRESETS[preset]
    g = torch.Generator().manual_seed(0)
    router = torch.randn(shape.num_experts, shape.hidden_size, generator=g) / math.sqrt(shape.hidden_size)
    mean = mean_distinct_experts(shape, router, tokens, draws=64, generator=g)
    assert mean == pytest.approx(shape.expected_distinct_experts(tokens), rel=0.05)


@pytest.mark.skipif(transformers_version() is None, reason="transformers is not installed")
@pytest.mark.parametrize("peer", PEERS)
def test_transformers_peers_pass_the_gate(work4, peer):
    m = run_case(work4, peer, "eager", CEILINGS, FAST)
    assert m.status == "ok", m.reason


@pytest.mark.gpu
def test_gpu_triton_graph_is_timed_and_loop_graph_is_not_capturable():
    dev = torch.device("cuda")
    w = make_weights(TINY, torch.bfloat16, dev)
    work = make_workload("tiny", TINY, 16, w, torch.bfloat16, dev, routing_draws=8)
    ok = run_case(work, "triton", "graph", CEILINGS, FAST)
    assert ok.status == "ok", ok.reason
    assert ok.launches.kernels <= 10 and ok.launches.busy_ms > 0
    refused = run_case(work, "loop", "graph", CEILINGS, FAST)
    assert refused.status == "not_capturable" and refused.reason
    assert run_case(work, "loop", "eager", CEILINGS, FAST).status == "ok"
