"""GPU tests (H200): bf16 at the Qwen3-30B-A3B shape, CUDA graphs, no host sync.

Run with `pytest -m gpu`. Skipped on machines without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import moekit.align as align_mod
from helpers import (
    align_ref,
    assert_alignment_equals,
    layer_ref,
    poisoned,
    rel_err,
    same_dtype_bound,
    topk_softmax_fp32,
)
from moekit import BACKENDS, PRESETS, MoELayer, align_block_size, moe_experts, route, topk_softmax
from moekit._workspace import poisoning
from moekit.experts.triton import experts_triton
from moekit.reference import moe_experts_ref

pytestmark = pytest.mark.gpu
QWEN = PRESETS["qwen3-30b-a3b"]


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000, 4096])
def test_backends_bf16_qwen3(qwen_layer, num_tokens):
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    ref = moe_experts_ref(*args)
    bound = same_dtype_bound(*args, ref)
    assert bound < 4e-2
    for backend in BACKENDS:
        out = poisoned(x.shape, x.dtype, "cuda")
        moe_experts(*args, backend=backend, out=out)
        err = rel_err(out, ref)
        assert err <= bound, f"{backend} T={num_tokens}: {err:.2e} > {bound:.2e} (2x plain bf16 PyTorch)"


@pytest.mark.parametrize("num_tokens", [1, 33, 256, 500, 4096])
def test_router_and_align_match_references_on_gpu(num_tokens, monkeypatch):
    """Both router and both align backends against the tests' own references (helpers.py), the
    triton one both with the three launches above FUSED_MAX_PAIRS (`moekit.align.ONE_LAUNCH_MAX_PAIRS`
    at 0) and with the one-launch align (the default, at ONE_LAUNCH_CANDIDATE: 256 and 500 tokens,
    2,048 and 4,000 pairs, run it); also with int64 ids holding sentinels (-1, E + 3, 2**32 + 1:
    never placed)."""
    logits = torch.randn(num_tokens, QWEN.num_experts, device="cuda", dtype=torch.bfloat16)
    logits[0, :5] = float("nan")
    if num_tokens > 2:
        logits[1] = 0.5                                   # a fully tied row
    w_ref, i_ref = topk_softmax_fp32(logits.cpu(), 8)
    for backend in ("torch", "triton"):
        w, i = topk_softmax(logits, 8, backend=backend)
        assert torch.equal(i.cpu(), i_ref), backend
        torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-5, atol=1e-6)
    holes = i_ref.cuda().long()
    holes[::3, 0] = -1
    holes[1::4, -1] = QWEN.num_experts + 3
    holes[2::5, 2] = 2**32 + 1
    for ids, block_m in ((i_ref.cuda(), 16), (i_ref.cuda(), 64), (holes, 32),
                         (torch.arange(8, device="cuda", dtype=torch.int32).repeat(num_tokens, 1), 64)):
        expected = align_ref(ids, QWEN.num_experts, block_m)
        for backend, limit in (("torch", 0), ("triton", 0), ("triton", align_mod.ONE_LAUNCH_CANDIDATE)):
            monkeypatch.setattr(align_mod, "ONE_LAUNCH_MAX_PAIRS", limit)
            with poisoning():
                got = align_block_size(ids, QWEN.num_experts, block_m, backend=backend)
            assert_alignment_equals(got, expected)


def test_triton_path_makes_no_host_sync(qwen_layer):
    x = torch.randn(64, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    qwen_layer(x)  # compile first: compilation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w, ids = route(x, qwen_layer.router_weight, QWEN.top_k)
        experts_triton(x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_capture_replays_new_inputs_and_routing(qwen_layer):
    num_tokens = 96
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    out = torch.empty_like(x)
    args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
    experts_triton(*args, out=out)          # warm-up compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        experts_triton(*args, out=out)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        new_w, new_ids = qwen_layer.route(x)
        w.copy_(new_w)
        ids.copy_(torch.roll(new_ids, 1, 0))  # different routing in place
        out.fill_(float("nan"))
        g.replay()
        eager = experts_triton(*args)
        assert torch.equal(out, eager)


def test_layer_capture_256_replays_1_and_256(qwen_layer):
    run = qwen_layer.capture(256)
    for num_tokens in (256, 1, 256, 37, 1):   # fewer after more: no stale metadata
        x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
        got = run(x).clone()
        # The oracle: the fp32 reference on the routing of the eager layer, with plain bf16 PyTorch
        # setting the bound. The replay equals the eager layer (RELIABILITY.md case 19) but for
        # near-ties of bf16 logits that the bucket's GEMM may round differently.
        w, ids = qwen_layer.route(x)
        args = (x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids)
        ref = moe_experts_ref(*args)
        eager = qwen_layer(x)
        assert rel_err(eager, ref) <= same_dtype_bound(*args, ref)
        assert rel_err(got, eager) < 1e-2
    # garbage in the padding rows of a bucket changes nothing in the valid rows
    run.x.fill_(float("nan"))
    x = torch.randn(3, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert torch.isfinite(run(x)).all()


def test_layer_capture_follows_in_place_weight_changes():
    torch.manual_seed(1)
    layer = MoELayer("olmoe-1b-7b", dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    run = layer.capture(64, buckets=[8, 64])
    x = torch.randn(20, layer.shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.router_weight.mul_(-1.0)            # routing changes in place
        layer.down_proj.mul_(0.5)
    got = run(x)
    ref = layer_ref(x, layer.router_weight, layer.gate_up_proj, layer.down_proj, layer.shape.top_k,
                    layer.shape.norm_topk_prob)
    assert rel_err(got, ref) < 2e-2


def test_int64_offsets_past_2_31_elements():
    """T*K*H > 2^31: y (S, H) has more than 2^31 elements; offsets must be int64."""
    num_tokens, hidden, inter, num_experts, top_k = 131072, 2048, 64, 8, 8  # S*H = 2^31, +1 token
    x = torch.randn(num_tokens + 1, hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    ids = torch.rand(num_tokens + 1, num_experts, device="cuda").argsort(dim=1)[:, :top_k]
    w = torch.rand(num_tokens + 1, top_k, device="cuda")
    out = experts_triton(x, gate_up, down, w, ids.int())
    rows = torch.tensor([0, num_tokens // 2, num_tokens], device="cuda")
    ref = moe_experts_ref(x[rows], gate_up, down, w[rows], ids[rows])
    assert rel_err(out[rows], ref) < 2e-2
