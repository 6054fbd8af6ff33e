"""The expert path: every backend against the fp32 reference, edge cases, bad inputs.

Tolerance (quack's rule): in float16/bfloat16 a backend's relative error against the fp32
reference is at most 2x that of plain PyTorch in the same dtype (`helpers.experts_same_dtype`, a
per-pair computation written in the tests, never a moekit backend); in float32 a stated bound of
1e-5 (fp32 accumulation, no tf32). NaN anywhere, in the output or the baseline, fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import distinct_topk_ids, poisoned, rel_err, same_dtype_bound
from moekit import BACKENDS, ExpertsConfig, masked_experts, moe_experts
from moekit.experts import get_backend, registry
from moekit.reference import moe_experts_ref

# Small tiles keep the interpreter fast and exercise multi-block, multi-tile and masked paths.
SMALL = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                      block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)


def make_weights(num_experts, hidden, inter, dtype, gen=None):
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


def run(backend, *args, **kw):
    if "config" in get_backend(backend).options:          # triton, masked: small tiles
        kw.setdefault("config", SMALL)
    return moe_experts(*args, backend=backend, **kw)


def check_against_reference(backend, x, gate_up, down, w, ids, **kw):
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    out = run(backend, x, gate_up, down, w, ids, **kw)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = rel_err(out, ref)
    if x.dtype == torch.float32:
        assert err <= 1e-5, f"{backend}: fp32 rel err {err:.2e}"
    else:
        bound = same_dtype_bound(x, gate_up, down, w, ids, ref)
        assert err <= bound, f"{backend}: {err:.2e} > {bound:.2e} (2x plain PyTorch in {x.dtype})"
    return out


def aligned(backend, hidden, inter, dtype):
    return backend != "grouped_mm" or (hidden * dtype.itemsize % 16 == 0 and inter * dtype.itemsize % 16 == 0)


SHAPES = [  # (T, E, H, I, K)
    (7, 8, 64, 48, 2),       # tiny preset
    (1, 8, 64, 48, 2),       # T = 1
    (5, 6, 32, 16, 6),       # top_k = E
    (13, 5, 37, 11, 1),      # prime sizes, top_k = 1
    (40, 4, 24, 40, 3),      # T*K > block, I > H, several blocks per expert
    (6, 4, 32, 16, 2),       # 2I == H: ambiguous shape, layout is Transformers' by contract
    (6, 4, 16, 16, 2),       # I == H
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-H{}-I{}-K{}".format(*s))
def test_backends_match_reference(backend, dtype, shape):
    num_tokens, num_experts, hidden, inter, top_k = shape
    if not aligned(backend, hidden, inter, dtype):
        pytest.skip("grouped_mm needs 16-byte rows (covered by test_grouped_mm_alignment_error)")
    x = torch.randn(num_tokens, hidden).to(dtype)
    gate_up, down = make_weights(num_experts, hidden, inter, dtype)
    id_dtype = torch.int64 if num_tokens % 2 else torch.int32      # both id dtypes across the cases
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=id_dtype)
    # Top-k probabilities without renormalisation (OLMoE's router): they sum to less than 1, so a
    # backend that skipped the weight multiply fails at top_k = 1 too.
    w = torch.softmax(torch.randn(num_tokens, num_experts), -1)[:, :top_k]
    check_against_reference(backend, x, gate_up, down, w, ids)


@pytest.mark.parametrize("backend", ["triton", "masked"])
def test_bf16_kernels_match_reference(backend):
    """bf16 through the Triton kernels (interpreted on the CPU, where tl.dot sees bf16 as its uint16
    bits) within the 2x rule of plain bf16 PyTorch, as on a GPU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 32, generator=g).bfloat16()
    gate_up, down = make_weights(4, 32, 16, torch.bfloat16, g)
    ids = distinct_topk_ids(9, 4, 2, generator=g)
    w = torch.rand(9, 2, generator=g)
    check_against_reference(backend, x, gate_up, down, w, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_pairs_on_one_expert_and_empty_experts(backend):
    x = torch.randn(21, 32)
    gate_up, down = make_weights(8, 32, 16, torch.float32)
    ids = torch.full((21, 1), 5, dtype=torch.int32)
    check_against_reference(backend, x, gate_up, down, torch.rand(21, 1), ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_ids_and_unnormalised_weights(backend):
    x = torch.randn(9, 32)
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    ids = torch.tensor([[1, 1, 2]] * 4 + [[0, 3, 3]] * 5, dtype=torch.int32)
    w = torch.randn(9, 3)                          # negative, not summing to 1
    w[0] = 0.0
    check_against_reference(backend, x, gate_up, down, w, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend):
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    out = run(backend, torch.empty(0, 32), gate_up, down, torch.empty(0, 2),
              torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 32) and out.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_ids_contribute_zero_when_ignored(backend):
    x = torch.randn(6, 32)
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    ids = torch.tensor([[0, -1], [4, 2], [-1, -1], [3, 1], [9, 0], [2, 3]], dtype=torch.int32)
    w = torch.rand(6, 2)
    out = run(backend, x, gate_up, down, w, ids, ignore_invalid_ids=True)
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[2], torch.zeros(32))     # a row with no local expert outputs 0
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        run(backend, x, gate_up, down, w, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_stays_in_its_row(backend):
    x = torch.randn(12, 32)
    x[4, 7] = float("nan")
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    ids = distinct_topk_ids(12, 4, 2)
    out = run(backend, x, gate_up, down, torch.rand(12, 2), ids)
    assert torch.isnan(out[4]).all()
    assert torch.isfinite(torch.cat([out[:4], out[5:]])).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    num_tokens, num_experts, hidden, inter = 10, 4, 32, 16
    x_wide = torch.randn(num_tokens, 2 * hidden)
    x = x_wide[:, :hidden]                                                   # row stride 2H
    gate_up = torch.randn(num_experts, hidden, 2 * inter).transpose(1, 2) / hidden**0.5  # (E, 2I, H) view
    down = (torch.randn(num_experts, inter, hidden) / inter**0.5).transpose(1, 2)        # (E, H, I) view
    ids = distinct_topk_ids(num_tokens, num_experts, 2).t().contiguous().t()  # column-major ids
    w = torch.rand(2, num_tokens).t()
    check_against_reference(backend, x, gate_up, down, w, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffer_is_fully_written(backend):
    x = torch.randn(9, 32)
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    ids = distinct_topk_ids(9, 4, 2)
    w = torch.rand(9, 2)
    out = poisoned((9, 32), torch.float32, "cpu")
    got = run(backend, x, gate_up, down, w, ids, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


def test_padded_capacity_factor_drops_and_reports():
    x = torch.randn(16, 32)
    gate_up, down = make_weights(4, 32, 16, torch.float32)
    ids = torch.zeros(16, 1, dtype=torch.int32)
    ids[:4] = torch.arange(4)[:, None]              # expert 0 gets 13 pairs, experts 1..3 one each
    w = torch.rand(16, 1)
    stats = {}
    out = moe_experts(x, gate_up, down, w, ids, backend="padded", capacity_factor=1.0, stats=stats)
    assert stats["capacity"] == 4 and int(stats["dropped"]) == 9   # ceil(1.0 * 16 / 4) = 4 kept of 13
    kept = torch.zeros(16, dtype=torch.bool)
    kept[:4] = True
    kept[4:7] = True                                # expert 0's first 4 pairs in pair order: 0, 4, 5, 6
    ref = moe_experts_ref(x, gate_up, down, torch.where(kept[:, None], w, 0.0), ids)
    assert rel_err(out, ref) <= 1e-5


def test_padded_capacity_counts_only_valid_pairs_as_dropped():
    """Ids outside [0, E) are skipped, not dropped: `dropped` counts valid pairs past capacity."""
    x = torch.randn(8, 32)
    gate_up, down = make_weights(3, 32, 16, torch.float32)
    ids = torch.tensor([[0, -1], [0, 3], [0, 0], [1, 0], [0, 5], [-1, -1], [0, 2], [0, 1]],
                       dtype=torch.int32)
    # Pairs p = 2t + k. Expert 0: p 0, 2, 4, 5, 7, 8, 12, 14 (8 pairs); expert 1: p 6, 15; expert 2:
    # p 13; invalid (-1, 3, 5): p 1, 3, 9, 10, 11. Capacity ceil(1.0 * 16 / 3) = 6, so expert 0 keeps
    # its first six pairs and drops p 12 and 14: 2 dropped, the 5 invalid pairs not among them.
    w = torch.rand(8, 2)
    stats = {}
    out = moe_experts(x, gate_up, down, w, ids, backend="padded", capacity_factor=1.0, stats=stats,
                      ignore_invalid_ids=True)
    assert stats["capacity"] == 6 and int(stats["dropped"]) == 2
    kept = torch.ones(16, dtype=torch.bool)
    kept[[1, 3, 9, 10, 11, 12, 14]] = False
    ref = moe_experts_ref(x, gate_up, down, w, torch.where(kept.view(8, 2), ids, -1))
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[5], torch.zeros(32))      # both slots invalid: exactly 0


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["busiest", "capacity-factor"])
def test_padded_with_no_experts_gives_the_reference_zeros(capacity_factor):
    """E = 0 (an expert-parallel rank holding none) with ignored ids: every pair is invalid, so the
    output is the fp32 reference's, all 0, as on loop and grouped_mm; nothing counted as dropped,
    and the gradients of x and the weights are 0."""
    x = torch.randn(6, 32, requires_grad=True)
    gate_up, down = make_weights(0, 32, 16, torch.float32)
    ids = torch.tensor([[0, -1], [1, 2], [-1, -1], [3, 0], [5, 1], [2, 4]], dtype=torch.int32)
    w = torch.rand(6, 2, requires_grad=True)
    stats = {}
    out = moe_experts(x, gate_up, down, w, ids, backend="padded", ignore_invalid_ids=True,
                      capacity_factor=capacity_factor, stats=stats)
    assert torch.equal(out, moe_experts_ref(x.detach(), gate_up, down, w.detach(), ids))
    assert stats["capacity"] == 0 and int(stats["dropped"]) == 0
    out.pow(2).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens,experts", [(0, 4), (6, 0)], ids=["no-tokens", "no-experts"])
def test_nothing_routed_gives_zeros_and_zero_gradients(backend, tokens, experts):
    """No pair reaches an expert (T = 0, or E = 0 with every id ignored, as on an expert-parallel rank
    holding none): every backend returns the fp32 reference's zeros, also into a poisoned out=, and
    where it has a backward every input gets a gradient of zeros (a step on an empty batch still
    reaches each parameter), with its own shape."""
    x = torch.randn(tokens, 32)
    gate_up, down = make_weights(experts, 32, 16, torch.float32)
    ids = torch.tensor([[0, -1], [1, 2], [-1, -1], [3, 0], [5, 1], [2, 4]], dtype=torch.int32)[:tokens]
    w = torch.rand(tokens, 2)
    kw = {"ignore_invalid_ids": True}
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    assert torch.equal(run(backend, x, gate_up, down, w, ids, **kw), ref)
    out = poisoned(x.shape, x.dtype, x.device)
    assert run(backend, x, gate_up, down, w, ids, out=out, **kw) is out and torch.equal(out, ref)
    if "stats" in get_backend(backend).options:
        stats = {}
        run(backend, x, gate_up, down, w, ids, stats=stats, **kw)
        assert int(stats["dropped"]) == 0
    if not get_backend(backend).has_backward(x.device, None):
        return
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    result = run(backend, *leaves, ids, **kw)
    assert torch.equal(result, ref)
    result.pow(2).sum().backward()
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_grouped_mm_alignment_error():
    gate_up, down = make_weights(4, 37, 11, torch.float32)
    with pytest.raises(ValueError, match="16 bytes"):
        moe_experts(torch.randn(3, 37), gate_up, down, torch.rand(3, 1),
                    torch.zeros(3, 1, dtype=torch.int32), backend="grouped_mm")
    with pytest.raises(ValueError, match="16 bytes"):      # the custom op runs the same check
        torch.ops.moekit.experts(torch.randn(3, 37), gate_up, down, torch.rand(3, 1),
                                 torch.zeros(3, 1, dtype=torch.int32), "grouped_mm", None)


def _good():
    # H=40, I=16: a transposed gate_up or down shows up in its shape (unlike 2I == H)
    x = torch.randn(5, 40)
    gate_up, down = make_weights(4, 40, 16, torch.float32)
    return dict(hidden_states=x, gate_up_proj=gate_up, down_proj=down, topk_weights=torch.rand(5, 2),
                topk_ids=distinct_topk_ids(5, 4, 2))


def _one_id(ids: torch.Tensor, value: int) -> torch.Tensor:
    """ids with a single entry replaced by value, every other entry valid."""
    ids = ids.clone()
    ids[2, 1] = value
    return ids


BAD = [
    ("hidden_states", lambda g: g["hidden_states"][None], ValueError, "hidden_states must be 2-D"),
    ("hidden_states", lambda g: g["hidden_states"].double(), TypeError, "hidden_states must have dtype"),
    ("gate_up_proj", lambda g: g["gate_up_proj"].half(), TypeError, "gate_up_proj must have dtype"),
    ("gate_up_proj", lambda g: g["gate_up_proj"][:, :31], ValueError, "gate_up_proj must have shape"),
    ("gate_up_proj", lambda g: g["gate_up_proj"][..., :39], ValueError, "gate_up_proj must have shape"),
    ("gate_up_proj", lambda g: g["gate_up_proj"].transpose(1, 2), ValueError, "gate_up_proj must have shape"),
    ("down_proj", lambda g: g["down_proj"].transpose(1, 2), ValueError, "down_proj must have shape"),
    ("down_proj", lambda g: g["down_proj"][:3], ValueError, "down_proj must have shape"),
    ("topk_ids", lambda g: g["topk_ids"].float(), TypeError, "topk_ids must have dtype"),
    ("topk_ids", lambda g: g["topk_ids"].to(torch.int16), TypeError, "topk_ids must have dtype"),
    ("topk_ids", lambda g: g["topk_ids"][:4], ValueError, "topk_ids must have shape"),
    ("topk_ids", lambda g: g["topk_ids"] + 3, ValueError, "topk_ids must lie in"),
    ("topk_ids", lambda g: _one_id(g["topk_ids"], 4), ValueError, "topk_ids must lie in"),    # = E
    ("topk_ids", lambda g: _one_id(g["topk_ids"], -1), ValueError, "topk_ids must lie in"),
    ("topk_ids", lambda g: torch.zeros(5, 5, dtype=torch.int32), ValueError, "top_k"),
    ("topk_weights", lambda g: g["topk_weights"][:, :1], ValueError, "topk_weights must have shape"),
    ("topk_weights", lambda g: g["topk_weights"].long(), TypeError, "topk_weights must have dtype"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,mutate,exc,msg", BAD, ids=[b[3] for b in BAD])
def test_bad_inputs_raise(backend, name, mutate, exc, msg):
    g = _good()
    g[name] = mutate(g)
    with pytest.raises(exc, match=msg):
        moe_experts(backend=backend, **g)


def test_bad_options_raise():
    g = _good()
    with pytest.raises(ValueError, match="backend"):
        moe_experts(backend="cuda", **g)
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_experts(backend="loop", capacity_factor=1.0, **g)
    for backend in ("padded", "masked"):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            moe_experts(backend=backend, capacity_factor=0.0, **g)
    with pytest.raises(ValueError, match="out must have shape"):
        moe_experts(backend="loop", out=torch.empty(4, 40), **g)
    with pytest.raises(ValueError, match="out must not share memory with hidden_states"):
        moe_experts(backend="loop", out=g["hidden_states"], **g)
    with pytest.raises(ValueError, match="must be a positive int"):
        ExpertsConfig(block_m=0)
    with pytest.raises(ValueError, match="power of two"):
        ExpertsConfig(block_n1=48)


@pytest.mark.parametrize("option,value,msg", [
    ("config", {"block_m": 16}, r"config must be a moekit\.ExpertsConfig or None, got dict"),
    ("config", "fast", r"config must be a moekit\.ExpertsConfig or None, got str"),
    ("stats", [], r"stats must be a dict or None, got list"),
], ids=["config-dict", "config-str", "stats-list"])
def test_wrongly_typed_options_raise_naming_them(option, value, msg, monkeypatch):
    """An option of the wrong type is a TypeError naming it, raised before the backend runs (so before
    any launch: the masked backend's layout kernel would otherwise run first), on every backend that
    takes it, and in `masked_experts` itself."""
    takers = [b for b in BACKENDS if option in get_backend(b).options]
    assert takers
    for backend in takers:
        stopped = dataclasses.replace(get_backend(backend), run=lambda *_, **__: pytest.fail("it ran"))
        monkeypatch.setitem(registry._REGISTRY, backend, stopped)
        with pytest.raises(TypeError, match=msg):
            moe_experts(backend=backend, **{option: value}, **_good())
    if option == "config":
        g = _good()
        with pytest.raises(TypeError, match=msg):
            masked_experts(g["hidden_states"][None].expand(4, 5, 40), torch.tensor([5, 0, 1, 2]),
                           g["gate_up_proj"], g["down_proj"], config=value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_slots_than_experts_when_invalid_ids_are_ignored(backend):
    # An expert-parallel rank holding 2 experts sees K = 3 slots, one always marked -1.
    x = torch.randn(5, 32)
    gate_up, down = make_weights(2, 32, 16, torch.float32)
    ids = torch.tensor([[0, 1, -1], [1, -1, 0], [-1, -1, 1], [0, -1, -1], [1, 0, -1]], dtype=torch.int32)
    w = torch.rand(5, 3)
    out = run(backend, x, gate_up, down, w, ids, ignore_invalid_ids=True)
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5
    with pytest.raises(ValueError, match="top_k"):
        run(backend, x, gate_up, down, w, ids.clamp(min=0))
