"""Reliability findings in the core, each pinned by a test that failed before its fix (CPU).

Gradients never silently dropped; `out=` that overlaps itself refused, a disjoint slice of an input
accepted; int64 ids outside [0, E) never placed by the Triton align; the align scan bounded at any
T; top_k > E on the triton path; clear errors for bad options; the poison mode for workspaces.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch

import moekit
from helpers import (
    check_exact_zeros,
    check_training_step,
    distinct_topk_ids,
    experts_same_dtype,
    poisoned,
    rel_err,
    same_dtype_bound,
)
from moekit import ExpertsConfig, MoELayer, align_block_size, moe_experts, ops
from moekit._workspace import poisoning
from moekit.reference import moe_experts_ref, moe_layer_ref

SMALL = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                      block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)


def case(num_tokens=9, num_experts=4, hidden=32, inter=16, top_k=2, dtype=torch.float32):
    x = torch.randn(num_tokens, hidden).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    ids = distinct_topk_ids(num_tokens, num_experts, top_k)
    w = torch.rand(num_tokens, top_k)
    return x, gate_up, down, w, ids


# 1. Gradients: never a silently detached output.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_grouped_mm_trains_on_cpu(dtype):
    """torch's grouped_mm is differentiable on the CPU: backend="grouped_mm" trains there, its four
    gradients within 2x plain PyTorch's error against fp32, an expert without pairs exactly 0."""
    check_training_step(lambda *a: moe_experts(*a, backend="grouped_mm"), (6, 32, 16, 2), 13, device="cpu",
                        dtype=dtype)


def test_masked_without_backward_raises_and_auto_never_picks_it():
    """The one backend without a backward says so for a call that needs gradients."""
    x, gate_up, down, w, ids = case()
    with pytest.raises(RuntimeError, match="backend='masked' has no backward on cpu"):
        moe_experts(x.requires_grad_(True), gate_up, down, w, ids, backend="masked")


def test_out_with_grad_raises():
    x, gate_up, down, w, ids = case()
    with pytest.raises(RuntimeError, match="out= cannot be used"):
        moe_experts(x, gate_up, down, w.requires_grad_(True), ids, backend="loop", out=torch.empty_like(x))


def _fp32_grads(x, gate_up, down, w, ids):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts_ref(*leaves, ids).pow(2).sum().backward()
    return [t.grad for t in leaves]


def test_explicit_triton_with_grad_differentiates():
    # The triton backend has a backward (issue 10); only the asked-for gradient is filled.
    x, gate_up, down, w, ids = case()
    gate_up.requires_grad_(True)
    out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=SMALL)
    assert out.grad_fn is not None
    out.pow(2).sum().backward()
    assert rel_err(gate_up.grad, _fp32_grads(x, gate_up, down, w, ids)[1]) <= 1e-5
    with torch.no_grad():                            # inference records nothing
        out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=SMALL)
    assert out.grad_fn is None
    assert rel_err(out, moe_experts_ref(x, gate_up.detach(), down, w, ids)) <= 1e-5


@pytest.fixture
def fresh_warnings(monkeypatch):
    import moekit.experts

    monkeypatch.setattr(moekit.experts, "_warned_grad_fallback", set())


def test_auto_with_grad_runs_a_differentiable_backend(fresh_warnings):
    # On the CPU "auto" is grouped_mm for aligned shapes, which differentiates there: no fallback.
    x, gate_up, down, w, ids = case()
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = moe_experts(*leaves, ids, backend="auto")
    assert out.grad_fn is not None
    out.pow(2).sum().backward()
    for name, got, ref in zip(("x", "gate_up", "down", "w"), (t.grad for t in leaves),
                              _fp32_grads(x, gate_up, down, w, ids)):
        assert rel_err(got, ref) <= 1e-5, name


def test_layer_backward_fills_every_parameter_grad(fresh_warnings):
    torch.manual_seed(0)
    layer = MoELayer("tiny")
    x = torch.randn(11, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # grouped_mm differentiates: no fallback
        out = layer(x)
    out.pow(2).sum().backward()
    params = [layer.router_weight, layer.gate_up_proj, layer.down_proj]
    assert all(p.grad is not None for p in params)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, *params)]
    s = layer.shape
    moe_layer_ref(*leaves, s.top_k, s.norm_topk_prob).pow(2).sum().backward()
    for got, ref in zip((x.grad, *(p.grad for p in params)), (t.grad for t in leaves)):
        assert rel_err(got, ref) <= 1e-5


def test_layer_with_triton_backend_trains():
    torch.manual_seed(0)
    layer = MoELayer("tiny", backend="triton")         # the parameters require grad
    x = torch.randn(5, 64, requires_grad=True)
    layer(x, config=SMALL).pow(2).sum().backward()
    params = [layer.router_weight, layer.gate_up_proj, layer.down_proj]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, *params)]
    s = layer.shape
    moe_layer_ref(*leaves, s.top_k, s.norm_topk_prob).pow(2).sum().backward()
    for got, ref in zip((x.grad, *(p.grad for p in params)), (t.grad for t in leaves)):
        assert rel_err(got, ref) <= 1e-5


def test_triton_router_with_grad_raises():
    logits = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="router backend='triton' has no backward"):
        moekit.topk_softmax(logits, 2, backend="triton")
    w, _ = moekit.topk_softmax(logits, 2, backend="auto")
    assert w.grad_fn is not None


def test_ops_entries_follow_the_same_gradient_rules():
    x, gate_up, down, w, ids = case()
    with pytest.raises(RuntimeError, match="backend='masked' has no backward on cpu"):
        ops.experts(x, gate_up, down, w.requires_grad_(True), ids, backend="masked")
    for backend in ("loop", "triton", "grouped_mm"):
        w_leaf = w.detach().clone().requires_grad_(True)
        out = ops.experts(x, gate_up, down, w_leaf, ids, backend=backend)
        out.pow(2).sum().backward()
        assert rel_err(w_leaf.grad, _fp32_grads(x, gate_up, down, w, ids)[3]) <= 1e-5, backend
    with pytest.raises(RuntimeError, match="router backend='triton' has no backward"):
        ops.topk_softmax(torch.randn(4, 8, requires_grad=True), 2, backend="triton")


@contextmanager
def nan_filled_empty():
    """torch.empty's memory NaN-filled (torch's deterministic mode), so rows an op never writes show."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
@pytest.mark.parametrize("backend", ["grouped_mm", "auto", "loop", "padded"])
def test_invalid_ids_add_nothing_to_any_gradient(backend, biases):
    """Pairs with ids -1, E and E + 5 (expert parallelism; "auto" through `ops.experts`) add exactly 0
    to every gradient: all six match fp32 autograd through a reference that drops them, with fresh
    buffers NaN-filled (grouped_mm leaves rows past its last group unwritten), bit for bit in two
    calls; a token with no valid id gets dx = 0, the invalid slots d topk_weights = 0 and the idle
    expert zero weight and bias gradients."""
    num_experts, hidden, inter, num_tokens, top_k = 5, 48, 16, 9, 3
    x, gate_up, down, w, ids = case(num_tokens, num_experts, hidden, inter, top_k)
    ids[0, 0], ids[5, 2], ids[7, 1] = -1, num_experts, num_experts + 5
    ids[4] = torch.tensor([-1, num_experts, num_experts + 5])
    biases = [torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)] if biases else [None] * 2
    dout = torch.randn(num_tokens, hidden)
    inputs = [t for t in (x, gate_up, down, w, *biases) if t is not None]
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    bias_names = ("gate_up_bias", "down_bias")
    experts_same_dtype(*leaves[:4], ids, **dict(zip(bias_names, leaves[4:]))).backward(dout)
    runs = []
    for _ in range(2):
        got = [t.clone().requires_grad_(True) for t in inputs]
        bias_kw = dict(zip(bias_names, got[4:]))
        with nan_filled_empty():
            if backend == "auto":
                out = ops.experts(*got[:4], ids, **bias_kw)
            else:
                out = moe_experts(*got[:4], ids, backend=backend, ignore_invalid_ids=True, **bias_kw)
            runs.append(torch.autograd.grad(out, got, dout))
        names = ("x", "gate_up_proj", "down_proj", "topk_weights", *bias_names)
        for name, g, leaf in zip(names, runs[-1], leaves):
            assert rel_err(g, leaf.grad) <= 1e-5, name
        check_exact_zeros(runs[-1][:4], ids.long(), num_experts)
        for g in runs[-1][4:]:
            assert torch.equal(g[num_experts - 1], torch.zeros_like(g[num_experts - 1]))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_triton_backward_with_create_graph_raises():
    """backend="triton" has no double backward: a backward with create_graph=True through it (eager, or
    the custom ops a compiled call runs) raises naming the backends that have one, instead of
    returning a first-order gradient with no graph behind it."""
    x, gate_up, down, w, ids = case()
    calls = {
        "eager": lambda t: moe_experts(t, gate_up, down, w, ids, backend="triton", config=SMALL),
        "experts op": lambda t: torch.ops.moekit.experts(t, gate_up, down, w, ids, "triton", None),
        "experts_train op": lambda t: torch.ops.moekit.experts_train(t, gate_up, down, w, ids, "triton",
                                                                     None, True)[0],
    }
    ref_leaf = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(experts_same_dtype(ref_leaf, gate_up, down, w, ids).sum(), ref_leaf)
    for name, call in calls.items():
        leaf = x.clone().requires_grad_(True)
        out = call(leaf)
        with pytest.raises(RuntimeError, match="backend='triton' is not twice differentiable.*'grouped_mm' "
                                               "or 'loop'"):
            torch.autograd.grad(out.sum(), leaf, create_graph=True)
        (gx,) = torch.autograd.grad(call(leaf).sum(), leaf)           # first order still runs
        assert gx.grad_fn is None and rel_err(gx, want) <= 1e-5, name


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_double_backward_matches_fp32_autograd(backend):
    """A gradient penalty (create_graph=True) through loop and grouped_mm, ids -1 and E among the
    pairs, fresh buffers NaN-filled: the penalised loss's four gradients match fp32 autograd twice
    through the reference."""
    x, gate_up, down, w, ids = case(num_tokens=7, num_experts=5, top_k=3)
    ids[0, 0], ids[3] = -1, torch.tensor([5, -1, 5])
    dout = torch.randn(7, 32)

    def penalised(run):
        leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        out = run(*leaves)
        gx = torch.autograd.grad(out, leaves[0], dout, create_graph=True)[0]
        return torch.autograd.grad((out * dout).sum() + gx.pow(2).sum(), leaves)

    with nan_filled_empty():
        got = penalised(lambda *t: moe_experts(*t, ids, backend=backend, ignore_invalid_ids=True))
    want = penalised(lambda *t: experts_same_dtype(*t, ids))
    for name, g, ref in zip(("x", "gate_up_proj", "down_proj", "topk_weights"), got, want, strict=True):
        assert rel_err(g, ref) <= 1e-5, name


# 2. out=: no internal overlap; a disjoint slice of an input's storage is legal.

@pytest.mark.parametrize("backend", moekit.BACKENDS)
def test_out_overlapping_itself_raises(backend):
    x, gate_up, down, w, ids = case()
    out = torch.zeros(1, 32).expand(9, 32)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        moe_experts(x, gate_up, down, w, ids, backend=backend, out=out)


STRIDED_OUTS = {
    "columns": lambda t, h, dtype: torch.full((t, 2 * h), float("nan"), dtype=dtype)[:, :h],
    "transposed-columns": lambda t, h, dtype: torch.full((h, 2 * t), float("nan"), dtype=dtype).t()[:t],
}


@pytest.mark.parametrize("layout", STRIDED_OUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("backend", moekit.BACKENDS)
def test_strided_out_that_writes_each_element_once_is_accepted(backend, dtype, layout):
    """A view that is not dense but holds each element once (the first H columns of a wider buffer,
    torch cannot tell its overlap cheaply) is a valid out=: every element written, the buffer's
    other columns left alone. A view whose rows overlap stays refused."""
    x, gate_up, down, w, ids = case(dtype=dtype)
    out = STRIDED_OUTS[layout](*x.shape, dtype)
    got = moe_experts(x, gate_up, down, w, ids, backend=backend, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    bound = 1e-5 if dtype == torch.float32 else same_dtype_bound(x, gate_up, down, w, ids, ref)
    assert rel_err(out, ref) <= bound
    assert int(torch.isnan(out._base).sum()) == out._base.numel() - out.numel()
    rows_overlap = torch.zeros(9 * 16 + 16, dtype=dtype).as_strided(out.shape, (16, 1))
    with pytest.raises(ValueError, match="out must not overlap itself"):
        moe_experts(x, gate_up, down, w, ids, backend=backend, out=rows_overlap)


@pytest.mark.parametrize("backend", moekit.BACKENDS)
def test_out_as_disjoint_slice_of_input_storage(backend):
    _, gate_up, down, w, ids = case()
    buf = torch.randn(18, 32)
    x, out = buf[:9], buf[9:]
    out.fill_(float("nan"))
    kw = {"config": SMALL} if "config" in moekit.experts.get_backend(backend).options else {}
    got = moe_experts(x, gate_up, down, w, ids, backend=backend, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5
    with pytest.raises(ValueError, match="out must not share memory with hidden_states"):
        moe_experts(buf[:9], gate_up, down, w, ids, backend=backend, out=buf[8:17], **kw)


# 3. int64 ids outside [0, E) that wrap into range when truncated to 32 bits.

WRAPPING = [2**32 + 3, -(2**32) + 2, 2**33, 2**31, -(2**31) - 1]


def test_triton_align_never_places_wrapping_int64_ids():
    ids = torch.tensor([[0, WRAPPING[0]], [WRAPPING[1], 1], [WRAPPING[2], 3], [WRAPPING[3], WRAPPING[4]]])
    for block_m in (1, 4):
        got = align_block_size(ids, 4, block_m, backend="triton")
        ref = align_block_size(ids, 4, block_m, backend="torch")
        assert torch.equal(got.tokens_per_expert, torch.tensor([1, 1, 0, 1], dtype=torch.int32))
        for name in ("sorted_ids", "expert_ids", "num_padded", "tokens_per_expert"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_triton_experts_skip_wrapping_int64_ids():
    x, gate_up, down, w, _ = case(num_tokens=5)
    ids = torch.tensor([[0, WRAPPING[0]], [WRAPPING[1], 1], [2, 3], [WRAPPING[2], WRAPPING[3]], [1, 0]])
    out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=SMALL, ignore_invalid_ids=True)
    valid = (ids >= 0) & (ids < 4)
    ref = moe_experts_ref(x, gate_up, down, torch.where(valid, w, 0.0), torch.where(valid, ids, 0))
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[3], torch.zeros(32))


# 4. The align scan stays bounded at any T: walk the counts in several slabs.

@pytest.mark.parametrize("num_experts", [5, 60])
def test_align_scan_in_slabs_matches_torch(monkeypatch, num_experts):
    import moekit.align as align_mod

    monkeypatch.setattr(align_mod, "SCAN_ELEMENTS", 16)    # slabs of 2 chunk rows (E=5), of 1 (E=60)
    gen = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(-1, num_experts, (700, 4), generator=gen)     # 2800 pairs: 11 chunks of 256
    ids[:, 0] = num_experts // 2                                     # one expert gets every row
    for block_m in (1, 16):
        got = align_block_size(ids, num_experts, block_m, backend="triton")
        ref = align_block_size(ids, num_experts, block_m, backend="torch")
        for name in ("sorted_ids", "expert_ids", "num_padded", "tokens_per_expert"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (block_m, name)


# 5. top_k > E on the triton path (an expert-parallel rank with fewer experts than a token picks).

def _ep_case():
    x, gate_up, down, _, _ = case(num_tokens=6, num_experts=2)
    ids = torch.tensor([[0, 1, -1], [1, -1, 0], [-1, -1, 1], [0, -1, 5], [1, 0, -1], [3, 4, 5]])
    return x, gate_up, down, torch.rand(6, 3), ids


def test_triton_top_k_above_experts_with_default_config():
    x, gate_up, down, w, ids = _ep_case()
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    out = moe_experts(x, gate_up, down, w, ids, backend="triton", ignore_invalid_ids=True)
    assert rel_err(out, ref) <= 1e-5
    with torch.no_grad():
        out_op = ops.experts(x, gate_up, down, w, ids, backend="triton")
    assert rel_err(out_op, ref) <= 1e-5


# 7. Clear errors, named arguments.

@pytest.mark.parametrize("value,exc,msg", [
    (float("inf"), ValueError, "capacity_factor must be > 0 and finite"),
    (float("nan"), ValueError, "capacity_factor must be > 0 and finite"),
    ("1", TypeError, "capacity_factor must be a number"),
    (True, TypeError, "capacity_factor must be a number"),
])
def test_capacity_factor_is_checked(value, exc, msg):
    x, gate_up, down, w, ids = case()
    with pytest.raises(exc, match=msg):
        moe_experts(x, gate_up, down, w, ids, backend="padded", capacity_factor=value)


def test_triton_router_above_its_expert_limit_raises():
    from moekit._validation import MAX_TRITON_EXPERTS

    logits = torch.randn(2, MAX_TRITON_EXPERTS + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_TRITON_EXPERTS} experts"):
        moekit.topk_softmax(logits, 2, backend="triton")
    w, ids = moekit.topk_softmax(logits, 2, backend="auto")             # auto stays on torch
    assert ids.shape == (2, 2)


def test_grouped_mm_takes_strided_weight_views():
    x, gate_up, down, w, ids = case(hidden=40)
    padded = torch.zeros(4, 32, 41)                                     # row stride 41 floats: unaligned
    padded[..., :40] = gate_up
    gate_up_view = padded[..., :40]
    out = moe_experts(x, gate_up_view, down, w, ids, backend="grouped_mm")
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


def test_layer_names_a_dtype_mismatch_and_takes_dtype_names():
    layer = MoELayer("tiny", dtype="float32")
    assert layer.gate_up_proj.dtype == torch.float32
    with pytest.raises(TypeError, match="x has dtype torch.float16, but this layer's parameters are"):
        layer(torch.randn(3, 64, dtype=torch.float16))
    for bad in ("int8", "nosuch", torch.int32):
        with pytest.raises(TypeError, match="dtype must be one of"):
            MoELayer("tiny", dtype=bad)


# Poison mode: every workspace starts as NaN / int minimum, and the result is still exact.

def test_triton_path_with_poisoned_workspaces():
    x, gate_up, down, w, ids = case(num_tokens=40, num_experts=5, top_k=3)
    ids[:, 0] = 4                                                      # one busy expert, others sparse
    with poisoning():
        for num_tokens in (40, 1):
            out = poisoned((num_tokens, 32), torch.float32, "cpu")
            moe_experts(x[:num_tokens], gate_up, down, w[:num_tokens], ids[:num_tokens], backend="triton",
                        config=SMALL, out=out)
            ref = moe_experts_ref(x[:num_tokens], gate_up, down, w[:num_tokens], ids[:num_tokens])
            assert rel_err(out, ref) <= 1e-5
        weights, got_ids = moekit.topk_softmax(torch.randn(7, 5), 2, backend="triton")
    assert torch.isfinite(weights).all() and ((got_ids >= 0) & (got_ids < 5)).all()


def test_poisoning_fills_new_buffers():
    from moekit import _workspace

    with poisoning():
        assert torch.isnan(_workspace.empty(3, dtype=torch.float16, device="cpu")).all()
        assert (_workspace.empty(3, dtype=torch.int32, device="cpu") == torch.iinfo(torch.int32).min).all()


# RELIABILITY 22: a workspace that cannot fit is refused before any allocation.

def test_padded_workspace_that_cannot_fit_is_refused(monkeypatch):
    import moekit._memory

    x, gate_up, down, w, _ = case(num_tokens=64)
    ids = torch.zeros(64, 2, dtype=torch.int32)
    ids[:, 1] = 1                                                      # collapse: cap = 64 rows per expert
    monkeypatch.setattr(moekit._memory, "free_bytes", lambda device: 10_000)
    with pytest.raises(moekit.PaddedWorkspaceTooLarge, match="over the .* GB allowed"):
        moe_experts(x, gate_up, down, w, ids, backend="padded")


def test_free_cpu_memory_counts_the_cache_linux_can_drop(tmp_path, monkeypatch):
    """MemAvailable, not MemFree: a machine whose memory is mostly page cache has it to give."""
    import moekit._memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\n"
                       "MemAvailable:   12000000 kB\nCached:         11000000 kB\n")
    monkeypatch.setattr(moekit._memory, "MEMINFO", str(meminfo), raising=False)
    monkeypatch.setattr(moekit._memory, "_address_space_left", lambda: 1 << 62, raising=False)
    assert moekit._memory.free_bytes(torch.device("cpu")) == 12000000 * 1024
