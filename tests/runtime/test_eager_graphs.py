"""Eager calls at decode sizes replay a per-token-count CUDA graph (`moekit.eager_graphs`).

CPU: the rules that keep a call eager (no graph without CUDA, with gradients, past 16 tokens, when
switched off) and the cache's bookkeeping. GPU: the replay equals the eager call bit for bit (same
kernels), against the fp32 reference within the 2x rule, with no stale input, output or weight.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from helpers import layer_ref, rel_err, same_dtype_bound
from moekit import PRESETS, MoELayer, eager_graphs
from moekit.eager_graphs import EAGER_GRAPH_MAX_TOKENS, GraphCache, eligible, graph_cache, tensor_key
from moekit.reference import moe_experts_ref

QWEN = PRESETS["qwen3-30b-a3b"]


# CPU: what keeps a call eager.

def test_no_graph_off_cuda_and_layer_output_unchanged():
    layer = MoELayer("tiny")
    x = torch.randn(3, 64)
    with torch.no_grad():
        out = layer(x)
        layer.eager_graphs = False
        plain = layer(x)
    assert torch.equal(out, plain)
    assert len(graph_cache(layer)) == 0


def test_cache_called_on_cpu_tensors_records_nothing():
    """A `GraphCache` called directly with CPU inputs returns None (the caller runs fn itself), as for
    any call it cannot record, and remembers the key: fn never runs inside it."""
    cache = GraphCache()
    for _ in range(2):
        assert cache(lambda t: pytest.fail("fn ran"), (torch.randn(3, 8),), "key") is None
    assert len(cache) == 0 and cache.captures == 0


class Unread:
    """Tensors that must not be looked at: eligible() decides from the token count first."""

    def __iter__(self):
        raise AssertionError("tensors read")


def test_eligible_needs_cuda_tensors_and_the_triton_backend(monkeypatch):
    """With every other condition met (interpreter off, no gradient), a CPU tensor alone, or a
    backend that does not record, keeps the call eager."""
    monkeypatch.setattr(eager_graphs, "interpreting", lambda: False)
    w = torch.zeros(4, 4)
    with torch.no_grad():
        assert not eligible(3, (torch.zeros(3, 4), w), "triton")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with torch.no_grad():
        assert eligible(3, (torch.zeros(3, 4), w), "triton")       # the control: all met
        assert not eligible(3, (torch.zeros(3, 4), w), "loop")
    assert not eligible(3, (torch.zeros(3, 4), w.requires_grad_()), "triton")   # a gradient is needed
    with torch.no_grad():             # a module's parameters under no_grad (decoding): no gradient needed
        assert eligible(3, (torch.zeros(3, 4), w), "triton")


def test_eligible_needs_tokens_in_range_and_tensors():
    assert not eligible(0, Unread())
    assert not eligible(EAGER_GRAPH_MAX_TOKENS + 1, Unread())
    with pytest.raises(AssertionError, match="tensors read"):
        eligible(1, Unread())
    assert not eligible(1, (None,))
    with torch.device("meta"):
        assert not eligible(1, (torch.zeros(1),))


def test_set_enabled_switches_eligibility_and_returns_the_previous_setting():
    before = eager_graphs.set_enabled(False)
    try:
        assert not eligible(1, Unread())                              # decided before the tensors
        assert eager_graphs.set_enabled(True) is False
        with pytest.raises(AssertionError, match="tensors read"):
            eligible(1, Unread())
    finally:
        eager_graphs.set_enabled(before)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        GraphCache(0)
    with pytest.raises(TypeError, match="eager_graphs must be a bool"):
        MoELayer("tiny", eager_graphs="yes")


def test_cache_is_per_module_and_dies_with_it():
    a, b = MoELayer("tiny"), MoELayer("tiny")
    assert graph_cache(a) is graph_cache(a) and graph_cache(a) is not graph_cache(b)
    count = len(eager_graphs._caches)
    del a
    gc.collect()
    assert len(eager_graphs._caches) == count - 1
    assert "graph" not in str(b.state_dict().keys())


def test_tensor_key_names_address_shape_strides():
    w = torch.zeros(4, 4)                      # w.t(): the same address and shape, other strides
    assert tensor_key(w) != tensor_key(w.t()) and tensor_key(w) != tensor_key(w.clone())
    assert tensor_key(None) is None


def test_layer_key_changes_with_everything_a_graph_bakes_in():
    """A new tensor for any weight, or another backend or router backend, gives the layer another key
    (a graph of its own); an in-place copy into a weight keeps it."""
    layer = MoELayer("tiny")
    key = layer._graph_key()
    with torch.no_grad():
        layer.down_proj.copy_(layer.down_proj * 2)
    assert layer._graph_key() == key
    for name in ("router_weight", "gate_up_proj", "down_proj"):
        old = getattr(layer, name)
        setattr(layer, name, torch.nn.Parameter(old.detach().clone()))
        assert layer._graph_key() != key, name
        setattr(layer, name, old)
    assert layer._graph_key() == key
    for name, other in (("backend", "loop"), ("router_backend", "torch")):
        old = getattr(layer, name)
        assert old != other
        setattr(layer, name, other)
        assert layer._graph_key() != key, name
        setattr(layer, name, old)


# GPU.

def qwen_bf16(**kw) -> MoELayer:
    """The Qwen3-30B-A3B layer for inference, weights drawn on the GPU (1/sqrt(fan_in))."""
    layer = torch.nn.utils.skip_init(MoELayer, QWEN, dtype=torch.bfloat16, device="cuda", **kw)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p, fan_in in ((layer.router_weight, QWEN.hidden_size), (layer.gate_up_proj, QWEN.hidden_size),
                          (layer.down_proj, QWEN.intermediate_size)):
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) / fan_in**0.5)
    return layer.requires_grad_(False)


def eager_of(layer, x):
    layer.eager_graphs = False
    try:
        return layer(x)
    finally:
        layer.eager_graphs = True


@pytest.mark.gpu
def test_layer_replay_equals_eager_and_reference():
    layer = qwen_bf16()
    cache = graph_cache(layer)
    for num_tokens in (1, 2, 3, 5, 8, 13, 16, 1, 16):
        x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
        for entry in cache._entries.values():
            entry.output.fill_(float("nan"))      # a replay that wrote nothing would show
        got = layer(x)
        eager = eager_of(layer, x)
        assert torch.equal(got, eager), num_tokens
        w, ids = layer.route(x)
        args = (x, layer.gate_up_proj, layer.down_proj, w, ids)
        ref = moe_experts_ref(*args)
        assert rel_err(got, ref) <= same_dtype_bound(*args, ref), num_tokens
    assert cache.captures == 7 and len(cache) == 7      # one graph per token count


@pytest.mark.gpu
def test_layer_outputs_are_not_views_of_the_static_buffer():
    layer = qwen_bf16()
    x1, x2 = (torch.randn(4, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y1 = layer(x1)
    keep = y1.clone()
    y2 = layer(x2)
    assert graph_cache(layer).captures == 1
    assert torch.equal(y1, keep) and not torch.equal(y1, y2)
    assert torch.equal(y2, eager_of(layer, x2))
    x3 = torch.randn(2, 3, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)  # (B, S, H)
    assert torch.equal(layer(x3), eager_of(layer, x3))


@pytest.mark.gpu
def test_layer_replay_follows_weights_in_place_and_new_tensors():
    layer = qwen_bf16()
    x = torch.randn(5, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer(x)
    with torch.no_grad():
        layer.router_weight.mul_(-1.0)            # in place: the same graph reads the new values
        layer.down_proj.mul_(0.5)
    got = layer(x)
    assert graph_cache(layer).captures == 1
    assert torch.equal(got, eager_of(layer, x))
    ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, QWEN.top_k,
                    QWEN.norm_topk_prob)
    assert rel_err(got, ref) < 2e-2
    layer.gate_up_proj = torch.nn.Parameter(layer.gate_up_proj.detach() * 2, requires_grad=False)
    got = layer(x)                                # a new tensor: a graph of its own
    assert graph_cache(layer).captures == 2
    assert torch.equal(got, eager_of(layer, x))


@pytest.mark.gpu
def test_layer_stays_eager_with_gradients_past_16_tokens_and_when_off():
    layer = qwen_bf16()
    cache = graph_cache(layer)
    x = torch.randn(17, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer(x)
    layer.requires_grad_(True)
    out = layer(x[:4])
    assert out.grad_fn is not None
    out.float().square().sum().backward()
    assert layer.gate_up_proj.grad is not None and torch.isfinite(layer.gate_up_proj.grad).all()
    before = eager_graphs.set_enabled(False)
    try:
        with torch.no_grad():
            layer(x[:4])
    finally:
        eager_graphs.set_enabled(before)
    assert cache.captures == 0
    with torch.no_grad():
        layer(x[:4])
    assert cache.captures == 1


@pytest.mark.gpu
def test_layer_under_inference_mode_then_no_grad():
    layer = qwen_bf16()
    x = torch.randn(3, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        a = layer(x)
    b = layer(x)                                  # static buffers are not inference tensors
    assert torch.equal(a, b) and graph_cache(layer).captures == 1


@pytest.mark.gpu
def test_layer_inside_a_users_capture_runs_its_kernels():
    """Inside the caller's own capture the layer records its kernels (no replay in a capture)."""
    layer = qwen_bf16()
    x = torch.randn(2, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer(x)                                      # warm: compiles, and records a graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, eager_of(layer, x))
    assert graph_cache(layer).captures == 1


def test_the_autocast_state_is_part_of_every_key():
    """A graph recorded outside autocast must not serve a call under it (its linear would run in
    another dtype): the cache adds the CUDA autocast state to the caller's key."""
    from moekit.eager_graphs import _autocast_state

    before = _autocast_state()
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else contextlib.nullcontext():
        with torch.autocast("cuda", dtype=torch.bfloat16 if before[1] != torch.bfloat16 else torch.float16):
            inside = _autocast_state()
    assert inside != before


@pytest.mark.gpu
def test_layer_under_autocast_gets_a_graph_of_its_own():
    layer = qwen_bf16()
    x = torch.randn(3, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer(x)
    with torch.autocast("cuda", dtype=torch.float16):
        got = layer(x)
        eager = eager_of(layer, x)
    assert graph_cache(layer).captures == 2 and torch.equal(got, eager)


@pytest.mark.gpu
def test_nothing_is_recorded_while_syncs_are_watched_and_sizes_never_thrash():
    """Under sync debug mode "error" the layer runs its kernels (no recording, no sync); every token
    count from 1 to 16 keeps its graph (no eviction while the batch size varies)."""
    layer = qwen_bf16()
    cache = graph_cache(layer)
    x = torch.randn(16, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer(x[:3])
    eager_of(layer, x[:5])                               # compiles the 5-token kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = layer(x[:5])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.captures == 1 and torch.equal(got, eager_of(layer, x[:5]))
    for _ in range(2):
        for t in range(1, 17):
            layer(x[:t])
    assert cache.captures == 16 and len(cache) == 16


@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_in_fills_every_static_buffer_of_any_dtype(contiguous, monkeypatch):
    """One multi-tensor copy over byte views (inputs of three dtypes), or, with a strided input,
    one copy each; either way every static buffer holds its input bit for bit."""
    from moekit.eager_graphs import as_bytes, copy_in

    inputs = (torch.randn(3, 16, dtype=torch.bfloat16), torch.randint(-5, 100, (3, 4)),
              torch.rand(3, 4))
    if not contiguous:
        inputs = (inputs[0], torch.randint(-5, 100, (4, 3)).t(), inputs[2])
    statics = tuple(torch.full_like(t, float("nan") if t.is_floating_point() else -7) for t in inputs)
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a: calls.append(1) or real(*a))
    copy_in(statics, [as_bytes(t) for t in statics], inputs)
    assert calls == ([1] if contiguous else [])
    for static, t in zip(statics, inputs):
        assert static.dtype == t.dtype and torch.equal(static, t)
