"""Custom ops (moekit.ops): opcheck, results against the fp32 reference, torch.compile with dynamic T.

fp32 bound 1e-5 relative (fp32 accumulation everywhere), as in test_experts.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import distinct_topk_ids, layer_ref, rel_err, same_dtype_bound, topk_softmax_fp32
from moekit import BACKENDS, ExpertsConfig, MoELayer, MoEShape, ops
from moekit.experts import CONFIG_FIELDS, _config_of, get_backend
from moekit.reference import moe_experts_ref

# Small tiles keep the Triton interpreter quick and still give several blocks per expert.
SMALL = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                      block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)


def make_case(num_tokens, num_experts, hidden, inter, top_k, *, seed=0, id_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    # Expert E-1 receives no pair (distinct_topk_ids avoids it when K < E).
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, generator=gen, dtype=id_dtype)
    w = torch.rand(num_tokens, top_k, generator=gen)
    return x, gate_up, down, w, ids


def with_sentinels(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Transformers' EP sentinel (E) in slot 0 of even rows, moekit's (-1) in row 1, a whole row of E."""
    ids = ids.clone()
    ids[0::2, 0] = num_experts
    ids[1, -1] = -1
    ids[-1, :] = num_experts
    return ids


def cfg_for(backend):
    return SMALL if "config" in get_backend(backend).options else None


CASES = [  # (T, E, H, I, K)
    pytest.param((7, 8, 64, 48, 2), id="tiny"),
    pytest.param((5, 5, 36, 20, 3), id="odd-E5-H36-I20"),
    pytest.param((4, 2, 32, 16, 3), id="K>E-ep-shard"),
    pytest.param((9, 4, 32, 16, 1), id="top1-unnormalised"),   # weights in [0, 1), not 1
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_experts_op_matches_reference_and_skips_sentinels(backend, case):
    num_tokens, num_experts, hidden, inter, top_k = case
    if top_k > num_experts:  # an EP rank holding fewer experts than a token picks
        x, gate_up, down, w, _ = make_case(num_tokens, 4, hidden, inter, top_k)
        gate_up, down = gate_up[:num_experts], down[:num_experts]
        ids = torch.tensor([[0, 3, 1], [2, 1, 0], [3, 2, 2], [1, 0, 3]], dtype=torch.int32)
    else:
        x, gate_up, down, w, ids = make_case(num_tokens, num_experts, hidden, inter, top_k)
        ids = with_sentinels(ids, num_experts)
    valid = (ids >= 0) & (ids < num_experts)
    ref = moe_experts_ref(x, gate_up, down, w, torch.where(valid, ids, -1))
    out = ops.experts(x, gate_up, down, w, ids, backend=backend, config=cfg_for(backend))
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert rel_err(out, ref) <= 1e-5
    # A row whose every id is a sentinel gets exactly 0, not merely a small number.
    dead = ~valid.any(1)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_opcheck(backend):
    x, gate_up, down, w, ids = make_case(6, 4, 32, 16, 2, id_dtype=torch.int64)
    ids = with_sentinels(ids, 4)
    cfg = [getattr(SMALL, f) for f in CONFIG_FIELDS]
    args = (x, gate_up, down, w, ids, backend, cfg if cfg_for(backend) else None)
    torch.library.opcheck(torch.ops.moekit.experts.default, args)
    # Non-contiguous activations (a column slice): the output is contiguous all the same.
    wide = torch.randn(6, 48)
    torch.library.opcheck(torch.ops.moekit.experts.default, (wide[:, 8:40],) + args[1:])


@pytest.mark.parametrize("switch", ["tma_weights", "persistent"])
def test_op_config_list_carries_the_switches(switch):
    """tma_weights and persistent travel in the op's int list as 0 or 1 and come back bools."""
    x, gate_up, down, w, ids = make_case(6, 4, 32, 16, 2, id_dtype=torch.int64)
    cfg = [int(getattr(SMALL, f)) for f in CONFIG_FIELDS]
    cfg[CONFIG_FIELDS.index(switch)] = 1
    assert _config_of(cfg) == dataclasses.replace(SMALL, **{switch: True})
    assert _config_of(cfg[:CONFIG_FIELDS.index(switch)]) == SMALL      # a list without it: off
    out = torch.ops.moekit.experts(x, gate_up, down, w, ids, "triton", cfg)
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


def _ref_grads(x, gate_up, down, w, ids, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts_ref(*leaves, ids).backward(dout)
    return [t.grad for t in leaves]


def test_experts_op_autograd_opcheck():
    """The triton op's autograd (moekit::experts_backward): opcheck with inputs that need grad."""
    x, gate_up, down, w, ids = make_case(6, 4, 32, 16, 2, id_dtype=torch.int64)
    ids = with_sentinels(ids, 4)
    cfg = [getattr(SMALL, f) for f in CONFIG_FIELDS]
    leaves = [t.requires_grad_(True) for t in (x, gate_up, down, w)]
    torch.library.opcheck(torch.ops.moekit.experts.default, (*leaves, ids, "triton", cfg))
    dout = torch.randn(6, 32)
    for needs in ([True, True, True, True], [False, False, True, True]):
        args = (dout, *(t.detach() for t in leaves), ids, "triton", cfg, needs)
        torch.library.opcheck(torch.ops.moekit.experts_backward.default, args)
    frozen = torch.ops.moekit.experts_backward(dout, *(t.detach() for t in leaves), ids, "triton", cfg,
                                                [False, True, False, False])
    assert [tuple(g.shape) for g in frozen] == [(0,), (4, 32, 32), (0,), (0,)]


def test_experts_op_autograd_other_backends_raise_before_running():
    x, gate_up, down, w, ids = make_case(5, 4, 32, 16, 2)
    with pytest.raises(RuntimeError, match="differentiates backend \\['triton'\\] only"):
        torch.ops.moekit.experts(x, gate_up.requires_grad_(True), down, w, ids, "loop", None)


def test_compiled_triton_backward_with_dynamic_tokens():
    """torch.compile(fullgraph) through the op and its autograd: one graph, reference gradients."""
    torch.manual_seed(0)
    x_all, gate_up, down, w_all, ids_all = make_case(9, 5, 36, 20, 2)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *t: ops.experts(*t, backend="triton", config=SMALL), fullgraph=True,
                             dynamic=True, backend=counter)
    for num_tokens in (9, 4):
        x, w, ids = x_all[:num_tokens], w_all[:num_tokens], with_sentinels(ids_all[:num_tokens], 5)
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        dout = torch.randn(num_tokens, 36)
        compiled(*leaves[:3], leaves[3], ids).backward(dout)
        valid = (ids >= 0) & (ids < 5)
        want = _ref_grads(x, gate_up, down, w, torch.where(valid, ids, -1), dout)
        for name, t, ref in zip(("x", "gate_up", "down", "w"), leaves, want):
            assert rel_err(t.grad, ref) <= 1e-5, (num_tokens, name)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_topk_softmax_op(backend):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 6, generator=gen)
    logits[3, 2] = float("nan")
    for renormalize in (True, False):
        torch.library.opcheck(torch.ops.moekit.topk_softmax.default, (logits, 3, renormalize, backend))
        w, ids = ops.topk_softmax(logits, 3, renormalize=renormalize, backend=backend)
        w_ref, ids_ref = topk_softmax_fp32(logits, 3, renormalize)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_empty_batch_and_bad_inputs():
    x, gate_up, down, w, ids = make_case(5, 4, 32, 16, 2)
    out = ops.experts(x[:0], gate_up, down, w[:0], ids[:0])
    assert out.shape == (0, 32) and out.dtype == x.dtype
    with pytest.raises(ValueError, match="down_proj"):
        ops.experts(x, gate_up, down[:, :, :8], w, ids)
    with pytest.raises(TypeError, match="gate_up_proj"):
        ops.experts(x, gate_up.double(), down, w, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        ops.experts(x, gate_up, down, w[:, :1], ids)
    with pytest.raises(TypeError, match="topk_ids"):
        ops.experts(x, gate_up, down, w, ids.float())
    with pytest.raises(ValueError, match="config"):
        ops.experts(x, gate_up, down, w, ids, backend="loop", config=SMALL)
    with pytest.raises(ValueError, match="backend"):
        ops.experts(x, gate_up, down, w, ids, backend="cublas")
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        ops.experts(torch.randn(5, 30), torch.randn(4, 32, 30), torch.randn(4, 30, 16), w, ids,
                    backend="grouped_mm")
    with pytest.raises(ValueError, match="top_k"):
        ops.topk_softmax(torch.randn(3, 4), 5)


def test_layer_compiles_fullgraph_with_dynamic_tokens():
    """One graph (inductor) serves T = 3, 17, 8; T = 1 is specialised by Dynamo (0/1 rule)."""
    torch.manual_seed(0)
    layer = MoELayer(MoEShape(8, 64, 48, 2), backend="auto").requires_grad_(False)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for num_tokens in (3, 17, 8):
        x = torch.randn(num_tokens, 64)
        ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, 2)
        assert rel_err(compiled(x), ref) <= 1e-5
    assert counter.frame_count == 1
    y = compiled(torch.randn(1, 2, 64))
    assert y.shape == (1, 2, 64)


def test_layer_compiles_with_triton_ops():
    """The triton router and experts (interpreted on CPU) inside a compiled graph, tile config pinned."""
    torch.manual_seed(0)
    layer = MoELayer(MoEShape(6, 32, 24, 2, norm_topk_prob=False), backend="triton",
                     router_backend="triton").requires_grad_(False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: layer(t, config=SMALL), fullgraph=True, dynamic=True,
                             backend=counter)
    for num_tokens in (5, 2):
        x = torch.randn(num_tokens, 32)
        ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, 2, False)
        assert rel_err(compiled(x), ref) <= 1e-5
    assert counter.frame_count == 1


def test_import_moekit_without_transformers():
    """transformers is an optional extra: moekit imports without it, register() names the extra."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import moekit, moekit.ops\n"
        "from moekit.integrations import transformers as mt\n"
        "assert 'transformers' not in sys.modules\n"
        "try:\n"
        "    mt.register()\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "pip install 'moekit[transformers]'" in res.stdout


@pytest.mark.gpu
def test_ops_on_cuda_opcheck_and_compile_gpu():
    dev = torch.device("cuda")
    x, gate_up, down, w, ids = (t.to(dev) for t in make_case(300, 16, 256, 192, 4))
    ids = with_sentinels(ids, 16)
    for dtype in (torch.float32, torch.bfloat16):
        args = (x.to(dtype), gate_up.to(dtype), down.to(dtype), w, ids, "triton", None)
        torch.library.opcheck(torch.ops.moekit.experts.default, args)
    torch.library.opcheck(torch.ops.moekit.topk_softmax.default, (torch.randn(300, 16, device=dev), 4, True,
                                                                  "triton"))
    torch.manual_seed(0)
    layer = MoELayer("qwen3-30b-a3b", dtype=torch.bfloat16, device=dev).requires_grad_(False)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for num_tokens in (64, 4096, 300):
        xs = torch.randn(num_tokens, 2048, dtype=torch.bfloat16, device=dev)
        # The reference takes the eager layer's routing: a bf16 router may flip near-ties vs fp32.
        weights, ids = layer.route(xs)
        ref = moe_experts_ref(xs, layer.gate_up_proj, layer.down_proj, weights, ids)
        bound = same_dtype_bound(xs, layer.gate_up_proj, layer.down_proj, weights, ids, ref)
        assert rel_err(compiled(xs), ref) <= bound
        frames.append(counter.frame_count)
    assert frames[-1] == frames[0]
