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

import moekit.experts.triton as triton_experts
from helpers import (
    check_exact_zeros,
    distinct_topk_ids,
    experts_plain,
    experts_same_dtype,
    layer_ref,
    rel_err,
    same_dtype_bound,
    topk_softmax_fp32,
)
from moekit import BACKENDS, ExpertsConfig, MoELayer, MoEShape, _workspace, moe_experts, ops
from moekit.align import packed_bound, packed_size, pre_rows_bound, unpack_alignment
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
    with pytest.raises(RuntimeError, match="experts_train differentiates backend \\['triton'\\] only"):
        torch.ops.moekit.experts_train(x, gate_up, down, w, ids, "grouped_mm", None, True)


@pytest.mark.parametrize("config", [SMALL, None], ids=["config", "tuned"])
def test_experts_train_opcheck(monkeypatch, config):
    """moekit::experts_train (the compiled training forward) and the backward op fed what it saved:
    schema, fake sizes equal to the real ones (L and the packed alignment from (T, K, E, block_m),
    the tuned block_m when no config is given), AOT dispatch with dynamic shapes, autograd."""
    # Rows of pre past num_padded and the gaps between the packed alignment's parts are never written
    # (unspecified, as torch.empty's): zero-filled workspaces make the runs opcheck compares agree.
    monkeypatch.setattr(_workspace, "empty", lambda *shape, dtype, device: torch.zeros(shape, dtype=dtype,
                                                                                       device=device))
    x, gate_up, down, w, ids = make_case(6, 4, 32, 16, 2, id_dtype=torch.int64)
    ids = with_sentinels(ids, 4)
    cfg = None if config is None else [getattr(config, f) for f in CONFIG_FIELDS]
    leaves = [t.requires_grad_(True) for t in (x, gate_up, down, w)]
    for store_pre in (True, False):
        args = (*leaves, ids, "triton", cfg, store_pre)
        torch.library.opcheck(torch.ops.moekit.experts_train.default, args)
    out, pre, packed = torch.ops.moekit.experts_train(*(t.detach() for t in leaves), ids, "triton", cfg, True)
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, torch.where(ids < 4, ids, -1))) <= 1e-5
    block_m = (config or triton_experts.auto_config(6, gate_up, 2, x.dtype, x.device)).block_m
    align = unpack_alignment(packed, 12, 4, block_m)
    counts = torch.bincount(ids[(ids >= 0) & (ids < 4)], minlength=4)
    assert torch.equal(align.tokens_per_expert, counts.int())
    # Given a config: L rows and the packed length of its block_m; without one, bounds over every
    # block_m up to BLOCK_M_BOUND (sizes that follow T alone, under torch.compile too).
    rows, length = ((pre_rows_bound(12, 4), packed_bound(12, 4)) if config is None else
                    (align.sorted_ids.numel(), packed_size(12, 4, config.block_m)))
    assert pre.shape == (rows, 32) and packed.shape == (length,)
    assert rows >= align.sorted_ids.numel() and length >= packed_size(12, 4, block_m)
    dout = torch.randn(6, 32)
    for needs in ([True, True, True, True], [False, False, True, True]):
        args = (dout, *(t.detach() for t in leaves), ids, "triton", cfg, needs, pre, packed)
        torch.library.opcheck(torch.ops.moekit.experts_backward.default, args)
    grads = torch.ops.moekit.experts_backward(dout, *(t.detach() for t in leaves), ids, "triton", cfg,
                                              [True] * 4, pre, packed)
    want = _ref_grads(x, gate_up, down, w, torch.where(ids < 4, ids, -1), dout)
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(grads, want))
    # No tokens: the sizes still follow from (T, K, E, block_m), L = 0.
    empty = torch.ops.moekit.experts_train(x[:0], gate_up, down, w[:0], ids[:0], "triton", cfg, True)
    assert empty[0].shape == (0, 32) and empty[1].shape == (0, 32)
    args = (x[:0], gate_up, down, w[:0], ids[:0], "triton", cfg, True)
    torch.library.opcheck(torch.ops.moekit.experts_train.default, args)


@pytest.fixture
def launches(monkeypatch):
    """{launcher: calls} of the triton backend's forward GEMM1 (with and without the store), its
    align, and {"pre": [...]}: what the SwiGLU backward was given as pre-activations."""
    calls = {"gemm1_swiglu_with_pre": 0, "gemm1_swiglu": 0, "align_pairs": 0, "pre": []}
    for name in ("gemm1_swiglu_with_pre", "gemm1_swiglu", "align_pairs"):
        real = getattr(triton_experts, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(triton_experts, name, spy)
    swiglu_backward = triton_experts.swiglu_backward
    monkeypatch.setattr(triton_experts, "swiglu_backward",
                        lambda *a, **k: calls["pre"].append(k["pre"]) or swiglu_backward(*a, **k))
    return calls


TRAIN_CASES = [  # (E, H, I, K): expert E-1 gets no pair, sentinels (E and -1) in several slots
    pytest.param((5, 36, 20, 2), id="K2"),
    pytest.param((4, 32, 16, 1), id="K1"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", TRAIN_CASES)
def test_compiled_training_reuses_the_saved_pre_activations(launches, dtype, case):
    """torch.compile(aot_eager, fullgraph, dynamic, the tuned config: its block_m changes with T) of a
    training call: the forward runs GEMM1 with the store once (moekit::experts_train), the backward
    reads those pre-activations and that alignment (no GEMM1, no align, RECOMPUTE off). Gradients of
    x, gate_up_proj, down_proj and topk_weights match fp32 autograd of the reference (fp32: 1e-5;
    fp16: <= 2x plain PyTorch's); the idle expert and the sentinel slots get exactly 0."""
    num_experts, hidden, inter, top_k = case
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *t: ops.experts(*t, backend="triton"), fullgraph=True, dynamic=True,
                             backend=counter)
    for num_tokens in (9, 50):      # 16 and 32 rows a block (default_config), one graph
        x, gate_up, down, w, ids = (t.to(dtype) if t.is_floating_point() else t for t in
                                    make_case(num_tokens, num_experts, hidden, inter, top_k, seed=num_tokens))
        ids = with_sentinels(ids, num_experts)
        dout = torch.randn(num_tokens, hidden, dtype=dtype)
        leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        out = compiled(*leaves, ids)
        counts = ("gemm1_swiglu_with_pre", "gemm1_swiglu", "align_pairs")
        assert [launches[n] for n in counts] == [1, 0, 1]        # the forward: GEMM1 with the store
        out.backward(dout)
        assert [launches[n] for n in counts] == [1, 0, 1]        # the backward: neither again
        assert len(launches["pre"]) == 1 and launches["pre"][0] is not None
        launches.update(gemm1_swiglu_with_pre=0, align_pairs=0, pre=[])
        masked = torch.where((ids >= 0) & (ids < num_experts), ids, -1)
        want = _ref_grads(x, gate_up, down, w, masked, dout)
        base = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        experts_plain(*base, masked).backward(dout)
        for name, t, b, ref in zip(("x", "gate_up", "down", "w"), leaves, base, want):
            assert t.grad.dtype == t.dtype, name
            bound = 1e-5 if dtype == torch.float32 else 2 * rel_err(b.grad, ref)
            assert rel_err(t.grad, ref) <= bound, (num_tokens, name)
        check_exact_zeros([t.grad for t in leaves], ids.long(), num_experts)
    assert counter.frame_count == 1
    assert "moekit.experts_train" in counter.graphs[0].code


def test_compiled_frozen_experts_and_inference_store_nothing(launches):
    """Compiled, only down_proj trains: nothing stored, the backward recomputes h by GEMM1 (as the
    eager autograd). Under torch.no_grad: moekit::experts, no store."""
    x, gate_up, down, w, ids = make_case(9, 5, 36, 20, 2)
    ids = with_sentinels(ids, 5)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *t: ops.experts(*t, backend="triton", config=SMALL), fullgraph=True,
                             backend=counter)
    trained = down.clone().requires_grad_(True)
    compiled(x, gate_up, trained, w, ids).backward(torch.ones(9, 36))
    assert (launches["gemm1_swiglu_with_pre"], launches["gemm1_swiglu"], launches["pre"]) == (0, 2, [])
    want = _ref_grads(x, gate_up, down, w, torch.where((ids >= 0) & (ids < 5), ids, -1), torch.ones(9, 36))
    assert rel_err(trained.grad, want[2]) <= 1e-5
    with torch.no_grad():
        out = compiled(x, gate_up, down, w, ids)
    masked = torch.where((ids >= 0) & (ids < 5), ids, -1)
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, masked)) <= 1e-5
    assert launches["gemm1_swiglu_with_pre"] == 0
    assert "experts_train" in counter.graphs[0].code and "experts_train" not in counter.graphs[-1].code


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


@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
@pytest.mark.parametrize("backend", ["auto", "grouped_mm"])
def test_compiled_cpu_training_matches_eager(backend, biases):
    """torch.compile(fullgraph, dynamic) of a training call on the CPU, where "auto" runs grouped_mm
    (its GEMMs the `moekit::grouped_mm` op): one graph for two token counts, sentinel ids among the
    pairs; the output and every gradient equal eager's bit for bit and fp32 autograd through the
    reference within 1e-5."""
    x_all, gate_up, down, w_all, ids_all = make_case(9, 5, 32, 16, 2)
    bias = [torch.randn(5, 32), torch.randn(5, 32)] if biases else []
    names = ("x", "gate_up_proj", "down_proj", "topk_weights", "gate_up_bias", "down_bias")

    def call(x, gate_up, down, w, ids, *bias):
        kw = dict(zip(("gate_up_bias", "down_bias"), bias))
        return moe_experts(x, gate_up, down, w, ids, backend=backend, ignore_invalid_ids=True, **kw)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, fullgraph=True, dynamic=True, backend=counter)
    for num_tokens in (9, 4):
        x, w, ids = x_all[:num_tokens], w_all[:num_tokens], with_sentinels(ids_all[:num_tokens], 5)
        dout = torch.randn(num_tokens, 32)
        inputs = (x, gate_up, down, w, *bias)
        runs = []
        for fn in (call, compiled):
            leaves = [t.clone().requires_grad_(True) for t in inputs]
            out = fn(*leaves[:4], ids, *leaves[4:])
            runs.append((out, *torch.autograd.grad(out, leaves, dout)))
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        kw = dict(zip(("gate_up_bias", "down_bias"), leaves[4:]))
        ref = experts_same_dtype(*leaves[:4], ids, **kw)
        want = (ref, *torch.autograd.grad(ref, leaves, dout))
        for name, eager, got, ref in zip(("out", *names), *runs, want):
            assert torch.equal(got, eager), (num_tokens, name)
            assert rel_err(got, ref) <= 1e-5, (num_tokens, name)
    assert counter.frame_count == 1
    assert "moekit.grouped_mm" in counter.graphs[0].code


def test_compiled_layer_trains_on_cpu():
    """The default layer (backend "auto") compiled with inductor, fullgraph and dynamic, trains on the
    CPU: output and gradients of x and every parameter within 1e-5 of fp32 autograd through the layer
    reference, for two token counts in one graph."""
    torch.manual_seed(0)
    layer = MoELayer(MoEShape(8, 64, 48, 2))
    params = [layer.router_weight, layer.gate_up_proj, layer.down_proj]
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for num_tokens in (5, 11):
        x = torch.randn(num_tokens, 64, requires_grad=True)
        dout = torch.randn(num_tokens, 64)
        layer.zero_grad(set_to_none=True)
        out = compiled(x)
        out.backward(dout)
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, *params)]
        ref = layer_ref(*leaves, 2)
        ref.backward(dout)
        assert rel_err(out, ref) <= 1e-5
        for name, got, leaf in zip(("x", "router", "gate_up", "down"), (x, *params), leaves):
            assert rel_err(got.grad, leaf.grad) <= 1e-5, (num_tokens, name)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend, message", [
    ("loop", "backend='loop' loops in Python over the experts hit"),
    ("padded", "backend='padded' without capacity_factor sizes its buffers by the busiest expert's count"),
])
def test_compiled_training_names_a_backend_it_cannot_trace(backend, message):
    """loop, and padded without a capacity factor, read counts back to the host: a fullgraph compile
    of a training call on them fails naming the backend, the reason and what to use instead."""
    x, gate_up, down, w, ids = make_case(6, 4, 32, 16, 2)
    compiled = torch.compile(lambda *t: moe_experts(*t, ids, backend=backend), fullgraph=True, dynamic=True,
                             backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
        compiled(x.requires_grad_(True), gate_up, down, w)


@pytest.mark.parametrize("backend", ["padded", "masked"])
def test_compiled_capacity_factor_with_dynamic_tokens(backend):
    """capacity_factor under torch.compile(fullgraph, dynamic): inference on padded and masked (through
    `moekit::experts`), and training on padded (traced), match the fp32 reference at two token counts;
    a capacity of every pair drops none. The factor is an argument of the compiled function, so
    Dynamo traces it as a symbolic float, as it does a module's attribute."""
    x_all, gate_up, down, w_all, ids_all = make_case(9, 5, 32, 16, 2)
    compiled = torch.compile(lambda *t, cf: moe_experts(*t, backend=backend, capacity_factor=cf),
                             fullgraph=True, dynamic=True, backend="aot_eager")
    for num_tokens, cf in ((9, 5.0), (4, 7.5)):
        x, w, ids = x_all[:num_tokens], w_all[:num_tokens], ids_all[:num_tokens]
        with torch.no_grad():
            out = compiled(x, gate_up, down, w, ids, cf=cf)
        assert rel_err(out, experts_same_dtype(x, gate_up, down, w, ids)) <= 1e-5
        if backend == "padded":
            leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
            refs = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
            compiled(*leaves, ids, cf=cf).pow(2).sum().backward()
            experts_same_dtype(*refs, ids).pow(2).sum().backward()
            for got, ref in zip(leaves, refs):
                assert rel_err(got.grad, ref.grad) <= 1e-5


@pytest.mark.parametrize("weights", ["dense", "fp8"])
def test_compiled_call_into_out(weights):
    """out= under torch.compile(fullgraph, dynamic): a plain buffer and the first H columns of a wider
    one are written with the eager call's values at two token counts; an expanded out (one element
    written twice) is still refused naming out."""
    from moekit.quant import quantize_experts
    x_all, gate_up, down, w_all, ids_all = make_case(9, 5, 128, 128, 2)
    if weights == "fp8":
        gate_up, down = quantize_experts(gate_up), quantize_experts(down)
    compiled = torch.compile(lambda x, w, ids, out: moe_experts(x, gate_up, down, w, ids, out=out),
                             fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for num_tokens in (9, 4):
            x, w, ids = x_all[:num_tokens], w_all[:num_tokens], ids_all[:num_tokens]
            expected = moe_experts(x, gate_up, down, w, ids)
            wide = torch.full((num_tokens, 256), float("nan"))
            for out in (torch.full_like(x, float("nan")), wide[:, :128]):
                assert compiled(x, w, ids, out) is out and torch.equal(out, expected)
        # fullgraph: Dynamo reports the error the traced code raised, message and all
        with pytest.raises(torch._dynamo.exc.Unsupported, match="out must not overlap itself"):
            compiled(x, w, ids, torch.zeros(128).expand(num_tokens, 128))


@pytest.mark.parametrize("layout", ["rows-by-groups", "weight-gradient"])
def test_grouped_mm_op_matches_per_group_matmuls(layout):
    """`moekit::grouped_mm` (grouped_mm's GEMMs under torch.compile) against plain per-group matmuls in
    fp32, a group left empty: the output (zeros past the last group) and its gradients; opcheck."""
    offs = torch.tensor([5, 5, 17], dtype=torch.int32)
    bounds = [0, 5, 5, 17]
    if layout == "rows-by-groups":       # (M, K) x (G, K, N) -> (M, N)
        a, b = torch.randn(20, 16), torch.randn(3, 16, 32)

        def ref_fn(a, b):
            rows = [a[lo:hi] @ b[g] for g, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
            return torch.cat(rows + [a.new_zeros(len(a) - bounds[-1], b.shape[2])])
    else:                                # (K, M) x (M, N) -> (G, K, N)
        a, b = torch.randn(16, 20), torch.randn(20, 32)

        def ref_fn(a, b):
            return torch.stack([a[:, lo:hi] @ b[lo:hi] for lo, hi in zip(bounds, bounds[1:])])
    leaves = [t.clone().requires_grad_(True) for t in (a, b)]
    refs = [t.clone().requires_grad_(True) for t in (a, b)]
    out, ref = torch.ops.moekit.grouped_mm(*leaves, offs), ref_fn(*refs)
    dout = torch.randn_like(ref)
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5
    for got, want in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, refs, dout)):
        assert rel_err(got, want) <= 1e-5
    torch.library.opcheck(torch.ops.moekit.grouped_mm.default, (*leaves, offs))


def test_grouped_mm_op_with_no_rows():
    """M = 0 (every group empty): the forward, a backward from an expanded gradient (`.sum()`'s, zero
    strides) giving the fp32 reference's zero gradients, and opcheck."""
    offs = torch.zeros(2, dtype=torch.int32)
    a, b = torch.randn(0, 16, requires_grad=True), torch.randn(2, 16, 8, requires_grad=True)
    out = torch.ops.moekit.grouped_mm(a, b, offs)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert a.grad.shape == (0, 16) and torch.equal(b.grad, torch.zeros_like(b))
    torch.library.opcheck(torch.ops.moekit.grouped_mm.default, (a, b, offs))


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens,experts", [(0, 4), (6, 0)], ids=["no-tokens", "no-experts"])
def test_direct_op_calls_with_nothing_routed_give_zeros(backend, tokens, experts):
    """`moekit::experts` and `moekit::experts_fp8` called directly (as a compiled graph replays them)
    where no pair reaches an expert (T = 0, or E = 0: an expert-parallel rank holding none) return the
    fp32 reference's zeros on every backend, as `moe_experts` does, never a launch on an empty shape."""
    from moekit.quant import quantize_experts
    x, gate_up, down, w, ids = make_case(max(tokens, 1), max(experts, 4), 128, 128, 2)
    x, w, ids = x[:tokens], w[:tokens], ids[:tokens]
    gate_up, down = gate_up[:experts], down[:experts]
    ref = moe_experts_ref(x, gate_up, down, w, torch.where(ids < experts, ids, -1))
    out = torch.ops.moekit.experts(x, gate_up, down, w, ids, backend, None)
    assert out.shape == x.shape and torch.equal(out, ref)
    if backend == "triton":
        gu, dn = quantize_experts(gate_up), quantize_experts(down)
        out = torch.ops.moekit.experts_fp8(x, gu.data, gu.scale, dn.data, dn.scale, w, ids, backend, None)
        assert out.shape == x.shape and torch.equal(out, ref)


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



@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_training_gpu_matches_eager_autograd(mode):
    """Qwen3-30B-A3B's shape in bf16: forward + backward under torch.compile (inductor, dynamic T;
    the pre-activations saved by `moekit::experts_train`) gives the eager autograd path's gradients
    bit for bit (the same kernels and tiles), within twice plain bf16 PyTorch's error against fp32."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    gate_up = (torch.randn(e, 2 * i, h, device=dev, generator=gen) / h**0.5).bfloat16()
    down = (torch.randn(e, h, i, device=dev, generator=gen) / i**0.5).bfloat16()

    def step(x, gate_up, down, w, ids):
        return ops.experts(x, gate_up, down, w, ids)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, mode=mode)
    for num_tokens in (300, 1024):
        x = torch.randn(num_tokens, h, device=dev, generator=gen).bfloat16()
        w, ids = torch.randn(num_tokens, e, device=dev, generator=gen).softmax(-1).topk(k, -1)
        w, ids = w / w.sum(-1, keepdim=True), ids.to(torch.int32)
        dout = torch.randn(num_tokens, h, device=dev, generator=gen).bfloat16()
        grads = []
        for fn in (step, compiled, experts_plain):
            leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
            fn(*leaves, ids).backward(dout)
            grads.append([t.grad for t in leaves])
        eager, mine, plain = grads
        ref = _ref_grads(x, gate_up, down, w, ids, dout)
        for a, b, base, want in zip(eager, mine, plain, ref):
            assert torch.equal(a, b)
            assert rel_err(b, want) <= 2 * rel_err(base, want), (num_tokens, rel_err(b, want))
