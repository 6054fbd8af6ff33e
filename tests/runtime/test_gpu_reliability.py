"""GPU hardening (H200): long-context prefill, determinism, and a seeded fuzz of the triton path.

Every comparison is against the fp32 reference (`moekit.reference`) with the 2x rule: the error of
moekit in a dtype is at most twice that of a plain PyTorch computation in the same dtype, written
in tests/helpers.py independently of moekit's code. The fuzz (its cases and checks in
tests/fuzz_plan.py) runs with workspace poisoning on, so a row a kernel forgets to write shows up
as NaN.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import fuzz_plan
from helpers import rel_err, same_dtype_bound
from moekit import PRESETS, MoELayer, align_block_size, moe_experts
from moekit._workspace import poisoning
from moekit.reference import moe_experts_ref

pytestmark = pytest.mark.gpu
QWEN = PRESETS["qwen3-30b-a3b"]


def sampled_rows(num_tokens: int, count: int, gen: torch.Generator) -> torch.Tensor:
    middle = torch.randint(1, max(2, num_tokens - 1), (count,), generator=gen)
    return torch.cat([torch.tensor([0, num_tokens - 1]), middle]).unique()


@pytest.mark.parametrize("num_tokens", [135_168, 262_144])
def test_long_context_prefill(num_tokens):
    """Qwen3-30B-A3B shape, bf16: (T*K, H) holds more than 2^31 elements at 262,144 tokens."""
    torch.manual_seed(0)
    layer = MoELayer(QWEN, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = layer.route(x)
    align = align_block_size(ids, QWEN.num_experts, 128)
    assert int(align.tokens_per_expert.sum()) == num_tokens * QWEN.top_k
    out = torch.full_like(x, float("nan"))
    moe_experts(x, layer.gate_up_proj, layer.down_proj, w, ids, backend="triton", out=out)
    rows = sampled_rows(num_tokens, 62, torch.Generator().manual_seed(num_tokens)).cuda()
    args = (x[rows], layer.gate_up_proj, layer.down_proj, w[rows], ids[rows])
    ref = moe_experts_ref(*args)
    err, bound = rel_err(out[rows], ref), same_dtype_bound(*args, ref)
    assert err <= bound, f"T={num_tokens}: {err:.2e} > {bound:.2e}"
    assert torch.isfinite(out).all()


def test_more_experts_than_the_router_kernel_takes_capture_and_run():
    """5,000 experts (the router kernel takes 4,096): the default router path and the captured layer
    route through the torch router; eager and replayed outputs are equal and within the 2x rule."""
    from moekit import MoEShape

    torch.manual_seed(2)
    layer = MoELayer(MoEShape(5000, 256, 128, 4), dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    captured = layer.capture(32, buckets=[4, 32])
    for num_tokens in (3, 32):
        x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16)
        eager = layer(x)
        w, ids = layer.route(x)
        args = (x, layer.gate_up_proj, layer.down_proj, w, ids)
        ref = moe_experts_ref(*args)
        assert rel_err(eager, ref) <= same_dtype_bound(*args, ref)
        assert torch.equal(captured(x), eager), f"CUDA graph, T={num_tokens}"


@pytest.mark.parametrize("direct", ["0", "1"], ids=["normal-path", "direct-decode"])
def test_eager_graph_and_compile_are_bitwise_equal(direct, monkeypatch):
    """With the direct decode path off and on: a captured layer replays what an eager call of the
    bucket's size runs (T = 1 takes the direct path when it is on), and so does torch.compile."""
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", direct)
    torch.manual_seed(1)
    layer = MoELayer(QWEN, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    captured = layer.capture(256, buckets=[1, 64, 256])
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for num_tokens in (1, 64, 256):
        x = torch.randn(num_tokens, QWEN.hidden_size, device="cuda", dtype=torch.bfloat16)
        eager = layer(x)
        assert torch.equal(layer(x), eager), "eager run to run"
        assert torch.equal(captured(x), eager), f"CUDA graph, T={num_tokens}"
        assert torch.equal(compiled(x), eager), f"torch.compile, T={num_tokens}"


def test_fuzz_triton_against_fp32_reference():
    """The seeded fuzz of `fuzz_plan`: ten kernel specialisation pools, cases round robin over them,
    every specialisation compiled within the first `WARMUP_CASES` (105 kernel binaries), then only
    compiled kernels. The warm-up cases always run; MOEKIT_FUZZ_SECONDS (default 160) bounds the
    cases after them (a cold Triton cache spends minutes compiling, which says nothing of the cases),
    MOEKIT_FUZZ_CASES (default 600) in all, at least min(cases, 200) of which must run.
    MOEKIT_FUZZ_CASE=i[,j...] runs those cases alone."""
    cases = int(os.environ.get("MOEKIT_FUZZ_CASES", str(fuzz_plan.DEFAULT_CASES)))
    budget_s = float(os.environ.get("MOEKIT_FUZZ_SECONDS", str(fuzz_plan.DEFAULT_SECONDS)))
    only = os.environ.get("MOEKIT_FUZZ_CASE")
    indices = [int(i) for i in only.split(",")] if only else range(cases)
    weights: dict = {}                                   # each shape's expert weights, built once
    start, done, warm_s = time.monotonic(), 0, None
    with torch.no_grad(), poisoning():
        for i in indices:
            fuzz_plan.run_case(fuzz_plan.draw_case(i), "cuda", weights)
            done += 1
            if done == fuzz_plan.WARMUP_CASES:
                warm_s = time.monotonic() - start
            if warm_s is not None and time.monotonic() - start - warm_s > budget_s:
                break
    weights.clear()
    elapsed = time.monotonic() - start
    warm = f", the first {fuzz_plan.WARMUP_CASES} (every compile) in {warm_s:.0f} s" if warm_s else ""
    print(f"fuzz: {done} cases in {elapsed:.0f} s{warm}")
    if not only:
        floor = min(cases, fuzz_plan.FLOOR)
        assert done >= floor, f"only {done} cases ran within {budget_s} s after the warm-up (floor {floor})"
