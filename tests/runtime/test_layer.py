import functools
import json
import re

import pytest
import torch

from helpers import EagerReplay, check_replay_refusals, layer_ref, rel_err
from moekit import BACKENDS, PRESETS, ExpertsConfig, MoELayer, MoEShape
from moekit.eager_graphs import CapturedWeights
from moekit.layer import WEIGHT_NAMES, CapturedMoE, default_buckets
from moekit.tuning import default_config, get_config, load_table, parse_table, shape_key

# The reference routes with the tests' own fp32 router (helpers.topk_softmax_fp32), never with
# moekit's: the torch router backend is moekit.reference.topk_softmax_ref itself.


@pytest.mark.parametrize("router_backend", ["torch", "triton"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_matches_reference(backend, router_backend):
    layer = MoELayer("tiny", backend=backend, router_backend=router_backend)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == x.shape
    s = layer.shape
    ref = layer_ref(x.reshape(-1, 64), layer.router_weight, layer.gate_up_proj, layer.down_proj,
                    s.top_k, s.norm_topk_prob)
    assert rel_err(out.reshape(-1, 64), ref) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_1_without_renormalisation_applies_the_weight(backend):
    """top_k = 1 and norm_topk_prob off: each token's output is its expert's times p < 1.

    With renormalisation the one weight would be exactly 1, and a backend that dropped the weight
    multiply would pass; here the weights are the softmax probabilities (about 1/E).
    """
    layer = MoELayer(MoEShape(6, 32, 16, 1, norm_topk_prob=False), backend=backend)
    x = torch.randn(9, 32)
    weights, _ = layer.route(x)
    assert (weights < 0.9).all()
    ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, 1, False)
    with torch.no_grad():
        assert rel_err(layer(x), ref) <= 1e-5


def test_layer_without_renormalisation_and_triton_router():
    layer = MoELayer(MoEShape(6, 32, 16, 3, norm_topk_prob=False), router_backend="triton")
    x = torch.randn(7, 32)
    ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, 3, False)
    with torch.no_grad():   # the Triton router has no backward
        assert rel_err(layer(x), ref) <= 1e-5


def test_seeded_init_is_reproducible_and_rejects_bad_input():
    a, b = MoELayer("tiny"), MoELayer("tiny")
    a.reset_parameters(torch.Generator().manual_seed(3))
    b.reset_parameters(torch.Generator().manual_seed(3))
    assert torch.equal(a.gate_up_proj, b.gate_up_proj)
    with pytest.raises(ValueError, match="x must have shape"):
        a(torch.randn(3, 63))
    with pytest.raises(ValueError, match="CUDA"):
        a.capture(8)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(backend="nope"), r"backend must be 'auto' or one of \("),
    (dict(router_backend="nope"),
     r"router_backend must be 'auto' or one of \('torch', 'triton'\), got 'nope'"),
    (dict(backend=None), r"backend must be 'auto' or one of \("),
], ids=["backend", "router-backend", "backend-none"])
def test_layer_refuses_unknown_backends_when_built(kwargs, msg):
    """Named when the layer is built, as its dtype is, not at the first call."""
    with pytest.raises(ValueError, match=msg):
        MoELayer("tiny", **kwargs)


def test_layer_input_of_rank_0_raises_naming_x():
    """x is hidden states (..., H): a 0-d tensor raises a ValueError that says so, where indexing
    its last dimension had raised an IndexError; a 1-D token still equals the fp32 layer."""
    layer = MoELayer(MoEShape(8, 32, 16, 2))
    with pytest.raises(ValueError, match=re.escape("x must have shape (..., H=32) (hidden states, at least "
                                                   "1-D), got ()")):
        layer(torch.tensor(1.0))
    x = torch.randn(32)
    ref = layer_ref(x[None], layer.router_weight, layer.gate_up_proj, layer.down_proj, 2)
    with torch.no_grad():
        assert rel_err(layer(x)[None], ref) <= 1e-5


def _captured_on_cpu(layer: MoELayer, max_tokens: int) -> CapturedMoE:
    """`layer.capture(max_tokens)` with its static buffers on the CPU, each bucket's CUDA graph
    stood in for by `EagerReplay` of the bucket's real body (capture itself needs CUDA)."""
    captured = CapturedMoE.__new__(CapturedMoE)
    captured.layer, captured.max_tokens = layer, max_tokens
    captured.weights = CapturedWeights("MoELayer", layer, WEIGHT_NAMES)
    captured.buckets = default_buckets(max_tokens)
    captured.x = torch.zeros(max_tokens, layer.shape.hidden_size, dtype=layer.gate_up_proj.dtype)
    captured.out = torch.zeros_like(captured.x)
    captured.num_valid = torch.zeros((), dtype=torch.int32)
    captured.graphs = {b: EagerReplay(functools.partial(captured._body, b)) for b in captured.buckets}
    return captured


def test_captured_layer_is_forward_only_and_checks_x():
    """A replay records no autograd: a call that needs gradients (the layer's parameters require
    grad, the default, or x does) raises instead of returning a detached output; x of another dtype
    or device raises instead of being cast into the static buffer. Under no_grad, inference_mode or
    with the layer frozen the replay equals the fp32 layer."""
    layer = MoELayer(MoEShape(8, 32, 16, 2))
    captured = _captured_on_cpu(layer, 4)
    x = torch.randn(3, 32)
    ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, 2)
    check_replay_refusals(captured, x)
    with pytest.raises(ValueError, match=r"x must have shape \(T, H=32\)"):
        captured(x[0])
    with torch.no_grad():
        assert rel_err(captured(x), ref) <= 1e-5
    with torch.inference_mode():
        assert rel_err(captured(x[:1]), ref[:1]) <= 1e-5
    layer.requires_grad_(False)
    assert rel_err(captured(x), ref) <= 1e-5
    with pytest.raises(RuntimeError, match="x requires grad.*forward-only"):
        captured(x.clone().requires_grad_(True))


def test_captured_layer_serves_every_token_count_up_to_its_maximum():
    """Every T from 0 to max_tokens (5: buckets 1, 2, 4, 5) runs in the least bucket that holds it
    and equals the fp32 layer, the maximum itself included; one token more is refused."""
    layer = MoELayer(MoEShape(8, 32, 16, 2)).requires_grad_(False)
    captured = _captured_on_cpu(layer, 5)
    assert captured.buckets == [1, 2, 4, 5]
    x = torch.randn(6, 32)
    ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, 2)
    for t in range(6):
        got = captured(x[:t])
        assert got.shape == (t, 32) and rel_err(got, ref[:t]) <= 1e-5, t
    with pytest.raises(ValueError, match="x has 6 tokens; this capture serves at most 5"):
        captured(x)


def test_captured_layer_refuses_replaced_weights():
    """A graph reads the weights' memory as captured: after a parameter is replaced (a new Parameter,
    or its .data swapped) the replay raises instead of reading the old, perhaps freed, tensor; new
    values copied in place are what the next replay computes with."""
    layer = MoELayer(MoEShape(8, 32, 16, 2)).requires_grad_(False)
    x = torch.randn(3, 32)
    captured = _captured_on_cpu(layer, 4)
    new = torch.randn_like(layer.gate_up_proj)
    layer.gate_up_proj.copy_(new)
    ref = layer_ref(x, layer.router_weight, new, layer.down_proj, 2)
    assert rel_err(captured(x), ref) <= 1e-5
    layer.down_proj.data = layer.down_proj.data.clone()
    with pytest.raises(RuntimeError, match=r"MoELayer.down_proj was replaced.*capture the layer again"):
        captured(x)
    captured = _captured_on_cpu(layer, 4)
    layer.router_weight = torch.nn.Parameter(layer.router_weight.detach().clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"MoELayer.router_weight was replaced"):
        captured(x)


def test_default_config_for_every_preset_and_size():
    for shape in PRESETS.values():
        for t in (0, 1, 16, 256, 4096, 100_000):
            cfg = default_config(shape, t)
            assert isinstance(cfg, ExpertsConfig)
            assert cfg.block_m in (16, 32, 64, 128)


def test_tuning_table_lookup(tmp_path, monkeypatch):
    shape = PRESETS["tiny"]
    cfg1 = ExpertsConfig(block_m=16, block_n1=32)
    cfg2 = ExpertsConfig(block_m=64, block_n1=128)
    table = {shape_key(shape, torch.float32): {"1": cfg1.to_dict(), "512": cfg2.to_dict()}}
    (tmp_path / "cpu.json").write_text(json.dumps(table))
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    load_table.cache_clear()
    try:
        assert get_config(shape, 2, torch.float32, "cpu") == cfg1
        assert get_config(shape, 300, torch.float32, "cpu") == cfg2
        assert get_config(shape, 2, torch.float16, "cpu") == default_config(shape, 2)
    finally:
        load_table.cache_clear()


@pytest.mark.parametrize("text,msg", [
    ("{not json", "cannot read JSON"),
    ('{"k": {"1": {"block_m": 3}}}', "power of two"),
    ('{"k": {"1": {"bogus": 3}}}', "unknown ExpertsConfig keys"),
    ('{"k": {"x": {}}}', "bad entry"),
])
def test_bad_tuning_files_name_the_file(tmp_path, text, msg):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=msg) as info:
        parse_table(path)
    assert str(path) in str(info.value)
