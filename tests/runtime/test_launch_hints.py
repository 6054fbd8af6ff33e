"""Launch hints (`moekit.launch_hints`): programmatic dependent launch and the weights' evict_first
priority change the schedule and the L2 priority only, never a value."""

from __future__ import annotations

import pytest
import torch

from helpers import poisoned, rel_err, same_dtype_bound
from moekit import PRESETS, eager_graphs, launch_hints
from moekit.decode import experts_decode
from moekit.experts.triton import experts_triton
from moekit.reference import moe_experts_ref

HINTS = (launch_hints.PDL_ENV, launch_hints.EVICT_ENV)


def _set(monkeypatch, on: bool) -> None:
    for env in HINTS:
        monkeypatch.setenv(env, "1" if on else "0")


def test_off_the_gpu_both_hints_are_off_whatever_the_environment(monkeypatch):
    _set(monkeypatch, True)
    cpu = torch.device("cpu")
    assert launch_hints.pdl_kwargs(cpu) == {}
    assert not launch_hints.pdl_enabled(cpu)
    assert launch_hints.weight_evict(cpu, 1) == ""
    monkeypatch.setattr(launch_hints, "interpreting", lambda: False)      # compiled Triton, CPU tensor
    assert launch_hints.pdl_kwargs(cpu) == {}
    assert launch_hints.weight_evict(cpu, 1) == ""


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("", False), (" 0 ", False), ("yes", True)])
def test_the_switches_read_the_environment_at_each_call(monkeypatch, value, on):
    monkeypatch.setattr(launch_hints, "_hopper", lambda device: True)
    dev = torch.device("cuda")
    for env in HINTS:
        monkeypatch.setenv(env, value)
    assert launch_hints.pdl_enabled(dev) is on
    assert launch_hints.pdl_kwargs(dev) == ({"USE_PDL": True, "launch_pdl": True} if on else {})
    assert launch_hints.weight_evict(dev, 1) == ("evict_first" if on else "")
    assert launch_hints.weight_evict(dev, launch_hints.EVICT_MAX_PAIRS) == ("evict_first" if on else "")
    assert launch_hints.weight_evict(dev, launch_hints.EVICT_MAX_PAIRS + 1) == ""


def test_both_hints_are_on_by_default_on_hopper(monkeypatch):
    monkeypatch.setattr(launch_hints, "_hopper", lambda device: True)
    for env in HINTS:
        monkeypatch.delenv(env, raising=False)
    dev = torch.device("cuda")
    assert launch_hints.pdl_enabled(dev)
    assert launch_hints.weight_evict(dev, 8) == "evict_first"
    monkeypatch.setattr(launch_hints, "_hopper", lambda device: False)      # an Ampere GPU
    assert not launch_hints.pdl_enabled(dev)
    assert launch_hints.weight_evict(dev, 8) == ""


def test_evict_first_loads_compute_the_same_values_interpreted(monkeypatch):
    """The interpreter runs the decode kernels with W_EVICT = "evict_first" (the policy compiled in;
    PDL's inline assembly cannot run interpreted): bitwise the plain launch."""
    if torch.cuda.is_available():
        pytest.skip("an interpreter test (the GPU test below covers CUDA)")
    import moekit.decode as decode

    g = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, top_k = 6, 32, 16, 2
    x = torch.randn(5, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    ids = torch.tensor([[0, 5], [2, 2 + 1], [5, 0], [1, 4], [3, 0]], dtype=torch.int32)
    w = torch.rand(5, top_k, generator=g)
    plain_decode = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, "cpu"))
    monkeypatch.setattr(decode, "weight_evict", lambda device, num_pairs: "evict_first")
    hinted = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, "cpu"))
    assert torch.equal(hinted, plain_decode)


QWEN = PRESETS["qwen3-30b-a3b"]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 256, 1000])
def test_hints_on_gpu_bitwise_plain_launch_eager_and_in_a_graph(qwen_layer, monkeypatch, num_tokens):
    """Router, align, GEMMs, sum and the decode kernels with both hints on: bitwise the plain launch,
    eager and replayed from a CUDA graph captured with the hints on (new inputs copied in), and
    within the fp32 reference's bound."""
    if not launch_hints._hopper(torch.device("cuda")):
        pytest.skip("the hints need compute capability 9 or later")
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(eager_graphs, "_enabled", False)   # the layer's own launches, not a replay
    _set(monkeypatch, False)
    plain_layer = qwen_layer(x)
    w, ids = qwen_layer.route(x)
    args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    plain = experts_triton(*args)
    _set(monkeypatch, True)
    assert launch_hints.pdl_enabled(x.device)
    assert torch.equal(qwen_layer(x), plain_layer)
    out = poisoned(x.shape, x.dtype, "cuda")
    assert torch.equal(experts_triton(*args, out=out), plain)
    ref = moe_experts_ref(*args)
    assert rel_err(out, ref) <= same_dtype_bound(*args, ref)

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        experts_triton(*args, out=out)
    x2 = torch.randn_like(x)
    w2, ids2 = qwen_layer.route(x2)
    _set(monkeypatch, False)
    expected = experts_triton(x2, qwen_layer.gate_up_proj, qwen_layer.down_proj, w2, ids2)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_hints_on_gpu_make_no_host_sync(qwen_layer, monkeypatch):
    _set(monkeypatch, True)
    for num_tokens in (1, 64):
        x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
        qwen_layer(x)                                # compiles first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            qwen_layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [64, 1000])
def test_pdl_in_the_backward_gives_the_plain_launch_gradients_bitwise(qwen_layer, monkeypatch, num_tokens):
    """The backward's row gathers, tile sums and row starts launched with PDL (and the forward's
    kernels): every gradient bitwise that of the plain launch, eager and from a whole-step CUDA
    graph captured with PDL on."""
    if not launch_hints._hopper(torch.device("cuda")):
        pytest.skip("the hints need compute capability 9 or later")
    from moekit.experts import moe_experts
    from moekit.graphs import capture_graph

    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    grad_out = torch.randn_like(x)
    leaves = [t.detach().clone().requires_grad_(True)
              for t in (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w)]

    def step():
        for t in leaves:
            t.grad = None
        moe_experts(*leaves, ids, backend="triton").backward(grad_out)
        return tuple(t.grad for t in leaves)

    _set(monkeypatch, False)
    plain = [g.clone() for g in step()]
    _set(monkeypatch, True)
    hinted = step()
    for a, b in zip(hinted, plain):
        assert torch.equal(a, b)
    graph, grads = capture_graph(step, x.device)
    for g in grads:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(grads, plain):
        assert torch.equal(a, b)
