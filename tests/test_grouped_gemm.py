"""Each grouped GEMM kernel against its pure-PyTorch twin (`moekit.grouped_gemm.*_torch`), and the
twins, chained, against the whole-path fp32 reference (so a twin cannot drift from the maths).

CPU (Triton interpreter, float32) with poisoned workspaces; rows a kernel must not write (padding
rows past num_padded, pairs never placed) are left out of the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import distinct_topk_ids, rel_err
from moekit import ExpertsConfig, align_block_size
from moekit._workspace import poisoning
from moekit.grouped_gemm import (
    gemm1_swiglu,
    gemm1_swiglu_torch,
    gemm2_weighted,
    gemm2_weighted_torch,
    moe_sum,
    moe_sum_torch,
)
from moekit.reference import moe_experts_ref

CFG = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                    block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)
PAIRED = dataclasses.replace(CFG, pair_blocks=2)     # tiles of 32 rows over 16-row blocks

CASES = [  # (T, E, H, I, K)
    (7, 8, 64, 48, 2),
    (1, 4, 32, 16, 4),
    (13, 5, 37, 11, 1),      # prime sizes: masked K and N tails
    (40, 3, 24, 40, 3),      # several blocks per expert
]


def make(num_tokens, num_experts, hidden, inter, top_k, invalid=False):
    x = torch.randn(num_tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=torch.int64)
    if invalid:
        ids[::3, 0] = -1                                  # expert-parallel sentinels: never placed
    w = torch.rand(num_tokens, top_k)
    return x, gate_up, down, w, ids


@pytest.mark.parametrize("cfg", [CFG, PAIRED], ids=["blocks", "paired"])
@pytest.mark.parametrize("invalid", [False, True], ids=["all-valid", "sentinels"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_kernels_match_their_twins(case, invalid, cfg):
    x, gate_up, down, w, ids = make(*case, invalid=invalid)
    num_experts, top_k = case[1], case[4]
    align = align_block_size(ids, num_experts, cfg.block_m, backend="torch")
    live = int(align.num_padded)
    placed = torch.zeros(ids.numel(), dtype=torch.bool)
    placed[align.sorted_ids[:live][align.sorted_ids[:live] < ids.numel()].long()] = True
    with poisoning():
        h = gemm1_swiglu(x, gate_up, align, top_k, cfg)
        y = gemm2_weighted(h, down, w, align, cfg)
        out = moe_sum(y, ids, num_experts, torch.full_like(x, float("nan")))
    h_ref = gemm1_swiglu_torch(x, gate_up, align, top_k)
    assert rel_err(h[:live], h_ref[:live]) <= 1e-5
    y_ref = gemm2_weighted_torch(h_ref, down, w, align)
    assert rel_err(y[placed], y_ref[placed]) <= 1e-5
    assert rel_err(out, moe_sum_torch(y, ids, num_experts)) <= 1e-6
    # The twins chained are the expert path itself.
    chained = moe_sum_torch(y_ref, ids, num_experts)
    assert rel_err(chained, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


@pytest.mark.parametrize("cfg", [CFG, PAIRED], ids=["blocks", "paired"])
def test_padding_rows_of_h_are_zero(cfg):
    x, gate_up, down, w, ids = make(5, 4, 32, 16, 2)
    align = align_block_size(ids, 4, cfg.block_m, backend="torch")
    with poisoning():
        h = gemm1_swiglu(x, gate_up, align, 2, cfg)
    live = int(align.num_padded)
    padding = align.sorted_ids[:live] == ids.numel()
    assert padding.any() and torch.equal(h[:live][padding], torch.zeros_like(h[:live][padding]))


@pytest.mark.parametrize("cfg", [CFG, PAIRED], ids=["blocks", "paired"])
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_epilogues_switched_off_match_their_twins(case, cfg):
    """GEMM1 with swiglu=False stores [gate | up] (L, 2I); GEMM2 without weights stores the rows
    unweighted: the two unfused halves `moekit ablate` times, each against its twin and against
    the fused kernel once the left-out step is applied by hand."""
    x, gate_up, down, w, ids = make(*case, invalid=True)
    num_experts, inter, top_k = case[1], case[3], case[4]
    align = align_block_size(ids, num_experts, cfg.block_m, backend="torch")
    live = int(align.num_padded)
    placed = torch.zeros(ids.numel(), dtype=torch.bool)
    placed[align.sorted_ids[:live][align.sorted_ids[:live] < ids.numel()].long()] = True
    with poisoning():
        pre = gemm1_swiglu(x, gate_up, align, top_k, cfg, swiglu=False)
        h = gemm1_swiglu(x, gate_up, align, top_k, cfg)
        y = gemm2_weighted(h, down, None, align, cfg)
    assert pre.shape == (align.sorted_ids.numel(), 2 * inter)
    assert rel_err(pre[:live], gemm1_swiglu_torch(x, gate_up, align, top_k, swiglu=False)[:live]) <= 1e-5
    swiglu = torch.nn.functional.silu(pre[:live, :inter]) * pre[:live, inter:]
    assert rel_err(swiglu, h[:live]) <= 1e-5
    assert rel_err(y[placed], gemm2_weighted_torch(h, down, None, align)[placed]) <= 1e-5
    weighted = gemm2_weighted(h, down, w, align, cfg)
    assert rel_err(y[placed] * w.reshape(-1, 1)[placed], weighted[placed]) <= 1e-5
