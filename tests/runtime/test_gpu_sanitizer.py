"""Every Triton kernel family once on the GPU, with no cuBLAS call anywhere: the suite for
`compute-sanitizer --tool racecheck` / `memcheck` (`tools/gpu_check.sh racecheck`).

Why a separate file: under racecheck, cuBLAS's Hopper kernels (`nvjet_sm90_*`) report hazards of
their own and then stop the sanitizer ("failed to handle a hardware exception"), so the other GPU
tests, whose references and router use cuBLAS, cannot finish under it. Here inputs are drawn on the
CPU, every kernel runs on CUDA in float32 (full-precision dots: no tensor-core shortcuts hide a bad
row) or bfloat16, and every check is made on the CPU against the kernels' torch twins or the fp32
reference. Small shapes: racecheck slows kernels a hundredfold.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import (
    align_ref,
    assert_alignment_equals,
    distinct_topk_ids,
    rel_err,
    same_dtype_bound,
    topk_softmax_fp32,
)
from moekit import ExpertsConfig, align_block_size, masked_experts, moe_experts, topk_softmax
from moekit.grouped_gemm import gemm1_swiglu, gemm1_swiglu_torch, gemm2_weighted, gemm2_weighted_torch
from moekit.masked import masked_gemm1_swiglu_torch, masked_gemm2_torch
from moekit.reference import moe_experts_ref

pytestmark = pytest.mark.gpu
CFG = ExpertsConfig(block_m=16, block_n1=32, block_k1=32, warps1=4, stages1=2,
                    block_n2=32, block_k2=32, warps2=4, stages2=2, group_m=2)
CUDA = torch.device("cuda")


def case(num_tokens=37, num_experts=6, hidden=96, inter=80, top_k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, generator=gen)     # one expert left idle
    ids[:, 0] = 0                                                             # and one busy expert
    w = torch.rand(num_tokens, top_k, generator=gen)
    return x, gate_up, down, w, ids


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_router_and_align_kernels(num_tokens):
    logits = torch.randn(num_tokens, 60)
    w, ids = topk_softmax(logits.to(CUDA), 4, backend="triton")
    w_ref, ids_ref = topk_softmax_fp32(logits, 4)
    assert torch.equal(ids.cpu(), ids_ref)
    assert rel_err(w.cpu(), w_ref) <= 1e-6
    for block_m in (16, 64):
        got = align_block_size(ids, 60, block_m, backend="triton")
        assert_alignment_equals(got, align_ref(ids.cpu(), 60, block_m))


@pytest.mark.parametrize("pair_blocks", [1, 2], ids=["blocks", "paired"])
def test_grouped_gemm_kernels(pair_blocks):
    cfg = dataclasses.replace(CFG, pair_blocks=pair_blocks)
    x, gate_up, down, w, ids = case(num_tokens=90)
    align = align_block_size(ids.to(CUDA), 6, cfg.block_m, backend="triton")
    h = gemm1_swiglu(x.to(CUDA), gate_up.to(CUDA), align, 3, cfg)
    y = gemm2_weighted(h, down.to(CUDA), w.to(CUDA), align, cfg)
    align_cpu = align_block_size(ids, 6, cfg.block_m, backend="torch")
    live = int(align_cpu.num_padded)
    h_ref = gemm1_swiglu_torch(x, gate_up, align_cpu, 3)
    assert rel_err(h.cpu()[:live], h_ref[:live]) <= 1e-5
    assert rel_err(y.cpu(), gemm2_weighted_torch(h_ref, down, w, align_cpu)) <= 1e-5


def test_expert_path_forward_and_backward_fp32():
    x, gate_up, down, w, ids = case()
    leaves = [t.to(CUDA).clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    out = moe_experts(*leaves, ids.to(CUDA), backend="triton", config=CFG)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout.to(CUDA))
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    ref = moe_experts_ref(*ref_leaves, ids)
    ref.backward(dout)
    assert rel_err(out.detach().cpu(), ref.detach()) <= 1e-5
    for got, want in zip(leaves, ref_leaves):
        assert rel_err(got.grad.cpu(), want.grad) <= 1e-5


def test_expert_path_bf16_within_twice_plain_pytorch():
    x, gate_up, down, w, ids = case()
    low = [t.to(torch.bfloat16) for t in (x, gate_up, down)]
    with torch.no_grad():
        out = moe_experts(*(t.to(CUDA) for t in low), w.to(CUDA), ids.to(CUDA), backend="triton", config=CFG)
    ref = moe_experts_ref(*low, w, ids)
    assert rel_err(out.float().cpu(), ref) <= same_dtype_bound(*low, w, ids, ref)   # bf16 baseline on the CPU


def test_masked_kernels():
    num_experts, cap, hidden, inter = 5, 24, 96, 80
    gen = torch.Generator().manual_seed(2)
    x_masked = torch.randn(num_experts, cap, hidden, generator=gen)
    counts = torch.tensor([0, 1, 24, 17, 5], dtype=torch.int32)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    row_w = torch.rand(num_experts, cap, generator=gen)
    got = masked_experts(x_masked.to(CUDA), counts.to(CUDA), gate_up.to(CUDA), down.to(CUDA), row_w.to(CUDA))
    want = masked_gemm2_torch(masked_gemm1_swiglu_torch(x_masked, counts, gate_up), counts, down, row_w)
    for e, n in enumerate(counts.tolist()):
        assert rel_err(got[e, :n].cpu(), want[e, :n]) <= 1e-5
