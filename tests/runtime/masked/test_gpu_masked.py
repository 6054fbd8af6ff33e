"""GPU tests of the masked layout (issue 12, H200): bf16 at the Qwen3-30B-A3B shape against the fp32
reference with the 2x rule, no host sync, and CUDA-graph replay with changing per-expert counts.

Run with `pytest -m gpu tests/runtime/masked/test_gpu_masked.py` (each test well under 30 s). Skipped
without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from helpers import poisoned, rel_err, same_dtype_bound
from moekit import PRESETS, masked_experts, moe_experts
from moekit._workspace import poisoning
from moekit.reference import moe_experts_ref

pytestmark = pytest.mark.gpu
QWEN = PRESETS["qwen3-30b-a3b"]


@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_masked_backend_bf16_qwen3(qwen_layer, num_tokens):
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    ref = moe_experts_ref(*args)
    bound = same_dtype_bound(*args, ref)
    assert bound < 4e-2
    with poisoning():                                    # NaN in every unused row of the workspaces
        out = poisoned(x.shape, x.dtype, "cuda")
        moe_experts(*args, backend="masked", out=out)
    err = rel_err(out, ref)
    assert err <= bound, f"masked T={num_tokens}: {err:.2e} > {bound:.2e} (2x plain bf16 PyTorch)"


def test_masked_experts_bf16_deepep_layout(qwen_layer):
    """The layout DeepEP's low-latency dispatch hands over: (E, C, H) with NaN past each count,
    counts on the device (empty experts, full ones), per-row weights."""
    num_experts, capacity = QWEN.num_experts, 48
    gen = torch.Generator(device="cuda").manual_seed(5)
    counts = torch.randint(0, capacity + 1, (num_experts,), device="cuda", generator=gen, dtype=torch.int32)
    counts[::9] = 0
    counts[1] = capacity
    rows = torch.arange(capacity, device="cuda")[None, :] < counts[:, None]            # (E, C) valid
    x_masked = torch.randn(num_experts, capacity, QWEN.hidden_size, device="cuda", generator=gen,
                           dtype=torch.bfloat16)
    x_masked[~rows] = float("nan")
    rw = torch.rand(num_experts, capacity, device="cuda", generator=gen)
    out = masked_experts(x_masked, counts, qwen_layer.gate_up_proj, qwen_layer.down_proj, rw)
    experts = torch.arange(num_experts, device="cuda")[:, None].expand(-1, capacity)
    args = (x_masked[rows], qwen_layer.gate_up_proj, qwen_layer.down_proj, rw[rows][:, None],
            experts[rows][:, None].int())
    ref = moe_experts_ref(*args)
    err, bound = rel_err(out[rows], ref), same_dtype_bound(*args, ref)
    assert err <= bound, f"{err:.2e} > {bound:.2e}"


def test_masked_backend_makes_no_host_sync(qwen_layer):
    x = torch.randn(64, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    moe_experts(*args, backend="masked", capacity_factor=1.0)       # compile first: compilation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = {}
        moe_experts(*args, backend="masked", capacity_factor=1.0, stats=stats)
        moe_experts(*args, backend="masked")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _routings(num_tokens, gen):
    """Random, collapse onto experts 0..7 (64 pairs each), then random again (fewer after more)."""
    def rand():
        scores = torch.rand(num_tokens, QWEN.num_experts, device="cuda", generator=gen)
        return scores.argsort(1)[:, :QWEN.top_k]
    return [rand(), torch.arange(QWEN.top_k, device="cuda").repeat(num_tokens, 1), rand()]


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["no-drop", "capacity-1.0"])
def test_masked_backend_graph_replays_changing_routing(qwen_layer, capacity_factor):
    num_tokens = 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    out, stats = torch.empty_like(x), {}
    args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    kw = dict(backend="masked", capacity_factor=capacity_factor)
    moe_experts(*args, out=out, **kw)                                 # warm-up compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_experts(*args, out=out, stats=stats, **kw)
    cap = stats["capacity"]
    assert cap == (num_tokens * QWEN.top_k if capacity_factor is None else 4)   # ceil(512 / 128)
    for new_ids in _routings(num_tokens, gen):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.rand(w.shape, device="cuda", generator=gen))
        ids.copy_(new_ids)                                          # per-expert counts change in place
        out.fill_(float("nan"))
        g.replay()
        eager = moe_experts(*args, **kw)
        assert torch.equal(out, eager)
        loads = torch.bincount(new_ids.flatten(), minlength=QWEN.num_experts)
        assert int(stats["dropped"]) == int((loads - cap).clamp(min=0).sum())   # replayed in place


def test_masked_experts_graph_replays_changing_counts(qwen_layer):
    """The raw masked GEMMs in a graph: counts and rows change in place; rows past a count stay
    untouched (NaN here) after every replay."""
    num_experts, capacity = QWEN.num_experts, 32
    gen = torch.Generator(device="cuda").manual_seed(11)
    x_masked = torch.randn(num_experts, capacity, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((num_experts,), capacity, device="cuda", dtype=torch.int32)
    out = torch.empty_like(x_masked)
    weights = (qwen_layer.gate_up_proj, qwen_layer.down_proj)
    masked_experts(x_masked, counts, *weights, out=out)                # warm-up compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        masked_experts(x_masked, counts, *weights, out=out)
    full = torch.full_like(counts, capacity)
    for new_counts in (full, torch.randint(0, capacity + 1, counts.shape, device="cuda", generator=gen,
                                           dtype=torch.int32), torch.zeros_like(counts), full // 3):
        counts.copy_(new_counts)
        x_masked.copy_(torch.randn_like(x_masked))
        out.fill_(float("nan"))
        g.replay()
        eager = masked_experts(x_masked, counts, *weights)
        rows = torch.arange(capacity, device="cuda")[None, :] < counts[:, None]
        assert torch.equal(out[rows], eager[rows])
        assert torch.isnan(out[~rows]).all()
