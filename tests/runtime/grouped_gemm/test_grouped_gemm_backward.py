"""The triton path's backward (issue 10): each backward kernel against its pure-PyTorch twin
(`moekit.grouped_gemm.backward.*_torch`), the twins against torch autograd through the fp32 reference
and against finite differences (gradcheck, float64), and every gradient of
moe_experts(backend="triton") against torch autograd through `moekit.reference.moe_experts_ref`.

The SwiGLU backward runs two ways: reading the pre-activations the forward's GEMM1 saved
(`gemm1_swiglu_with_pre`, what the autograd Function runs) and recomputing them (RECOMPUTE, what the
custom op's backward runs); both are held to the twin, and to each other.

CPU: Triton interpreter, float32, poisoned workspaces, odd and prime sizes; every case leaves at least
one expert without pairs (its weight gradients must be exactly 0). GPU (marked gpu): bf16 at
Qwen3-30B-A3B within 2x the error of plain PyTorch in bf16, bitwise reproducible, no host sync.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import moekit.experts.triton as triton_experts
from helpers import aot_compile_check, check_exact_zeros, distinct_topk_ids, experts_plain, rel_err
from moekit import PRESETS, ExpertsConfig, align_block_size, moe_experts
from moekit._workspace import poisoning
from moekit.align import Alignment
from moekit.grouped_gemm import (
    _placed_rows,
    gemm1_swiglu_torch,
    gemm1_swiglu_with_pre,
    gemm2_weighted_torch,
    moe_sum_torch,
)
from moekit.grouped_gemm.backward import (
    SAVED_TILES,
    SAVED_TILES_64,
    BackwardTiles,
    SwigluGrads,
    down_proj_grad,
    down_proj_grad_torch,
    gate_up_proj_grad,
    gate_up_proj_grad_torch,
    hidden_states_grad,
    hidden_states_grad_torch,
    saved_tiles,
    sorted_rows,
    swiglu_backward,
    swiglu_backward_torch,
    wgrad,
)
from moekit.reference import moe_experts_ref
from moekit.tuning import (
    WGRAD_ENV,
    WgradConfig,
    default_config,
    load_table,
    shared_memory_budget,
    wgrad_config,
)

CFG = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                    block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)
CFG32 = ExpertsConfig(block_m=16, block_n1=32, block_k1=32, warps1=4, stages1=1,
                      block_n2=32, block_k2=32, warps2=4, stages2=1, group_m=2)
NAMES = ("hidden_states", "gate_up_proj", "down_proj", "topk_weights")

CASES = [  # (T, E, H, I, K, routing)
    (7, 8, 64, 48, 2, "distinct"),
    (1, 5, 32, 16, 2, "distinct"),       # T = 1
    (13, 5, 37, 11, 1, "distinct"),      # prime sizes: masked H and I tails; K = 1
    (40, 3, 24, 40, 2, "distinct"),      # several row blocks per expert
    (11, 4, 32, 20, 4, "k=e"),           # K = E, expert 3's slot marked -1 so it stays empty
    (23, 4, 40, 24, 2, "one-expert"),    # every pair on expert 1 (duplicate ids within a row)
    (9, 6, 48, 16, 3, "sentinels"),      # ids -1, E and 2**32 + 1; a token with no valid slot
    (6, 3, 32, 16, 4, "k>e"),            # an expert-parallel shard: K > E
]


def case_id(c):
    return "T{}-E{}-H{}-I{}-K{}-{}".format(*c)


def routing(num_tokens, num_experts, top_k, kind):
    """(T, K) int64 ids; at least one expert (the last) gets no pair."""
    if kind == "distinct":
        return distinct_topk_ids(num_tokens, num_experts, top_k, dtype=torch.int64)
    if kind == "k=e":
        ids = torch.stack([torch.randperm(num_experts) for _ in range(num_tokens)])
        return torch.where(ids == num_experts - 1, -1, ids)
    if kind == "one-expert":
        return torch.ones(num_tokens, top_k, dtype=torch.int64)
    if kind == "sentinels":
        ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=torch.int64)
        ids[0::2, 0] = num_experts
        ids[1, -1] = -1
        ids[3, 1] = 2**32 + 1                     # wraps to 1 if truncated to 32 bits
        ids[-1, :] = -1
        return ids
    if kind == "k>e":
        pool = torch.tensor([0, 1, -1, num_experts + 4])
        return pool[torch.randint(0, 4, (num_tokens, top_k))]
    raise ValueError(kind)


def make(num_tokens, num_experts, hidden, inter, top_k, kind):
    x = torch.randn(num_tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    w = torch.rand(num_tokens, top_k) + 0.1
    ids = routing(num_tokens, num_experts, top_k, kind)
    dout = torch.randn(num_tokens, hidden + 5)[:, 2:hidden + 2]      # a strided gradient
    return x, gate_up, down, w, ids, dout


def ref_grads(x, gate_up, down, w, ids, dout):
    """Torch autograd through the fp32 reference: (dx, d gate_up, d down, d topk_weights)."""
    leaves = [t.detach().float().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts_ref(*leaves, ids).backward(dout.float())
    return [t.grad for t in leaves]


def padding_rows(align):
    """Sorted rows that hold no pair: the padding of live blocks and every row past num_padded."""
    rows = torch.ones(align.sorted_ids.numel(), dtype=torch.bool)
    placed, _, _ = _placed_rows(align)
    rows[placed] = False
    return rows


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("saved", [True, False], ids=["saved", "recompute"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward_kernels_match_their_twins(case, saved, id_dtype):
    num_tokens, num_experts, hidden, inter, top_k, kind = case
    x, gate_up, down, w, ids, dout = make(*case)
    if id_dtype == torch.int32 and kind == "sentinels":
        ids[3, 1] = num_experts + 7               # 2**32 + 1 does not fit: another id past E
    ids = ids.to(id_dtype)
    align = align_block_size(ids, num_experts, CFG.block_m, backend="torch")
    live = int(align.num_padded)
    with poisoning():
        pre = gemm1_swiglu_with_pre(x, gate_up, align, top_k, CFG)[1] if saved else None
        if saved:          # whatever padding rows hold (the forward writes zeros there) never leaks
            pre[padding_rows(align)] = float("nan")
        sw = swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG, pre=pre)
        dx = hidden_states_grad(sw.dpre_w, gate_up, ids, align, CFG)
        d_gu = gate_up_proj_grad(sw.dpre_w, x, None, align, top_k, torch.float32)
        d_down = down_proj_grad(dout, sw.h_w, None, align, top_k, torch.float32)
    tw = swiglu_backward_torch(x, gate_up, down, dout, w, align, top_k, pre=pre)
    assert rel_err(sw.dpre_w[:live], tw.dpre_w[:live]) <= 1e-5
    assert rel_err(sw.h_w[:live], tw.h_w[:live]) <= 1e-5
    assert rel_err(sw.topk_weights, tw.topk_weights) <= 1e-5
    zeros = padding_rows(align)[:live]           # padding rows of live blocks: written, exactly 0
    assert torch.equal(sw.dpre_w[:live][zeros], torch.zeros_like(sw.dpre_w[:live][zeros]))
    assert torch.equal(sw.h_w[:live][zeros], torch.zeros_like(sw.h_w[:live][zeros]))
    # Each downstream kernel is fed the kernel's own dpre_w / h_w, so a failure names one kernel.
    assert rel_err(dx, hidden_states_grad_torch(sw.dpre_w, gate_up, ids, align)) <= 1e-5
    assert rel_err(d_gu, gate_up_proj_grad_torch(sw.dpre_w, x, None, align, top_k)) <= 1e-5
    assert rel_err(d_down, down_proj_grad_torch(dout, sw.h_w, None, align, top_k)) <= 1e-5
    check_exact_zeros((dx, d_gu, d_down, sw.topk_weights.view(num_tokens, top_k)), ids.long(), num_experts)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_saved_pre_activations_give_the_recomputed_gradients(case):
    """The SwiGLU backward reading the forward's pre-activations (fp32 here: they are the recomputed
    ones up to summation order) against the same kernel recomputing them, output by output."""
    num_tokens, num_experts, hidden, inter, top_k, kind = case
    x, gate_up, down, w, ids, dout = make(*case)
    align = align_block_size(ids, num_experts, CFG.block_m, backend="torch")
    live = int(align.num_padded)
    with poisoning():
        h, pre = gemm1_swiglu_with_pre(x, gate_up, align, top_k, CFG)
        saved = swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG, pre=pre)
        again = swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG)
        # pre loaded after the loop over H instead of before it (SAVED_TILES loads it first)
        late = swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG, pre=pre,
                               tiles=dataclasses.replace(SAVED_TILES, pre_first=False))
        # 16-column tiles, one a program or two halves a program (a second half past I included)
        narrow = BackwardTiles(16, 16, 2, recompute=False, warps=4)
        one = swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG, pre=pre, tiles=narrow)
        halves = [swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG, pre=pre,
                                  tiles=dataclasses.replace(narrow, halves=2, pre_first=first))
                  for first in (False, True)]
    for name, got, want, other in zip(SwigluGrads._fields, saved, again, late):
        got, want, other = (got, want, other) if name == "topk_weights" else (
            got[:live], want[:live], other[:live])
        assert rel_err(got, want) <= 1e-5, name
        assert torch.equal(got, other), name                       # the same arithmetic, bit for bit
    for name, want, ref, *twos in zip(SwigluGrads._fields, again, one, *halves):
        if name != "topk_weights":
            want, ref, twos = want[:live], ref[:live], [t[:live] for t in twos]
        assert rel_err(ref, want) <= 1e-5, name
        assert all(torch.equal(ref, t) for t in twos), name        # the same dots, column for column
    with pytest.raises(ValueError, match="tiles: recompute=False but pre is None"):
        swiglu_backward(x, gate_up, down, dout, w, align, top_k, CFG, tiles=SAVED_TILES)
    placed, pair, _ = _placed_rows(align)       # h_w is the forward's h times the routing weight
    assert rel_err(saved.h_w[placed], h[placed] * w.reshape(-1)[pair, None]) <= 1e-5


@pytest.mark.parametrize("case", CASES[:1] + CASES[4:], ids=case_id)
def test_twins_match_autograd_of_the_reference(case):
    num_tokens, num_experts, hidden, inter, top_k, kind = case
    x, gate_up, down, w, ids, dout = make(*case)
    align = align_block_size(ids, num_experts, CFG.block_m, backend="torch")
    pre = gemm1_swiglu_torch(x, gate_up, align, top_k, swiglu=False)
    for saved in (None, pre):
        sw = swiglu_backward_torch(x, gate_up, down, dout, w, align, top_k, pre=saved)
        twins = (hidden_states_grad_torch(sw.dpre_w, gate_up, ids, align),
                 gate_up_proj_grad_torch(sw.dpre_w, x, None, align, top_k),
                 down_proj_grad_torch(dout, sw.h_w, None, align, top_k),
                 sw.topk_weights.view(num_tokens, top_k))
        for name, got, want in zip(NAMES, twins, ref_grads(x, gate_up, down, w, ids, dout)):
            assert rel_err(got, want) <= 1e-5, name
    # d down from the unscaled h, the routing weight applied by the weight-gradient twin (`wgrad`'s
    # scaled mode: the path that recomputes h alone when only down_proj trains).
    h = gemm1_swiglu_torch(x, gate_up, align, top_k)
    want = ref_grads(x, gate_up, down, w, ids, dout)[2]
    assert rel_err(down_proj_grad_torch(dout, h, w, align, top_k), want) <= 1e-5


class _Twins(torch.autograd.Function):
    """The forward twins chained, differentiated by the backward twins (gradcheck's subject)."""

    @staticmethod
    def forward(ctx, x, gate_up, down, w, ids, align):
        pre = gemm1_swiglu_torch(x, gate_up, align, ids.shape[1], swiglu=False)
        h = gemm1_swiglu_torch(x, gate_up, align, ids.shape[1])
        out = moe_sum_torch(gemm2_weighted_torch(h, down, w, align), ids, gate_up.shape[0])
        ctx.save_for_backward(x, gate_up, down, w, ids, pre)
        ctx.align = align
        return out

    @staticmethod
    def backward(ctx, dout):
        x, gate_up, down, w, ids, pre = ctx.saved_tensors
        align, top_k = ctx.align, ids.shape[1]
        sw = swiglu_backward_torch(x, gate_up, down, dout, w, align, top_k, pre=pre)
        return (hidden_states_grad_torch(sw.dpre_w, gate_up, ids, align),
                gate_up_proj_grad_torch(sw.dpre_w, x, None, align, top_k),
                down_proj_grad_torch(dout, sw.h_w, None, align, top_k),
                sw.topk_weights.view(w.shape), None, None)


@pytest.mark.parametrize("kind", ["distinct", "sentinels"])
def test_twins_pass_gradcheck_in_float64(kind):
    # The kernels accumulate in fp32 (the forward ones too), so finite differences would measure
    # their rounding; the kernels are held to these twins instead.
    x, gate_up, down, w, ids, _ = make(5, 4, 6, 3, 2, kind)
    align = align_block_size(ids, 4, 4, backend="torch")
    leaves = [t.double().requires_grad_(True) for t in (x, gate_up, down, w)]
    assert torch.autograd.gradcheck(lambda *t: _Twins.apply(*t, ids, align), leaves)


@pytest.mark.parametrize("paired", [False, True], ids=["blocks", "paired"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_gradients_match_autograd_of_the_reference(case, paired):
    num_tokens, num_experts, hidden, inter, top_k, kind = case
    x, gate_up, down, w, ids, dout = make(*case)
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    cfg = dataclasses.replace(CFG, pair_blocks=2) if paired else CFG   # the forward in paired tiles
    with poisoning():
        out = moe_experts(*leaves, ids, backend="triton", config=cfg, ignore_invalid_ids=True)
        out.backward(dout)
    got = [t.grad for t in leaves]
    for name, g, want in zip(NAMES, got, ref_grads(x, gate_up, down, w, ids, dout)):
        assert g.shape == want.shape and g.dtype == want.dtype, name
        assert rel_err(g, want) <= 1e-5, name
    check_exact_zeros(got, ids, num_experts)


def test_strided_inputs_and_an_expanded_output_grad():
    # x a column slice, the weights Transformers' transposed layout read through views, and the
    # gradient of out.sum(): an expanded tensor whose strides are 0.
    _, gate_up, down, w, ids, _ = make(9, 5, 40, 12, 2, "sentinels")
    x = torch.randn(9, 47)[:, 3:43]
    gu_t = gate_up.transpose(1, 2).contiguous().requires_grad_(True)          # (E, H, 2I) storage
    down_t = down.transpose(1, 2).contiguous().requires_grad_(True)           # (E, I, H) storage
    x.requires_grad_(True)
    out = moe_experts(x, gu_t.transpose(1, 2), down_t.transpose(1, 2), w, ids, backend="triton",
                      config=CFG, ignore_invalid_ids=True)
    out.sum().backward()
    want = ref_grads(x.detach(), gate_up, down, w, ids, torch.ones(9, 40))
    assert rel_err(x.grad, want[0]) <= 1e-5
    assert rel_err(gu_t.grad.transpose(1, 2), want[1]) <= 1e-5
    assert rel_err(down_t.grad.transpose(1, 2), want[2]) <= 1e-5


LAUNCHERS = ("swiglu_backward", "gemm1_swiglu", "hidden_states_grad", "gate_up_proj_grad", "down_proj_grad")


@pytest.mark.parametrize("trainable,expected", [
    (("hidden_states",), {"swiglu_backward", "hidden_states_grad"}),
    (("topk_weights",), {"swiglu_backward"}),                          # frozen experts, the router trains
    (("down_proj",), {"gemm1_swiglu", "down_proj_grad"}),               # h alone, by the forward kernel
    (("gate_up_proj", "topk_weights"), {"swiglu_backward", "gate_up_proj_grad"}),
    (NAMES, {"swiglu_backward", "hidden_states_grad", "gate_up_proj_grad", "down_proj_grad"}),
], ids=lambda v: "+".join(v) if isinstance(v, tuple) else None)
def test_frozen_inputs_get_no_grad_and_no_kernel(monkeypatch, trainable, expected):
    x, gate_up, down, w, ids, dout = make(8, 5, 32, 16, 2, "distinct")
    tensors = dict(zip(NAMES, (x, gate_up, down, w)))
    for name in trainable:
        tensors[name].requires_grad_(True)
    out = moe_experts(*tensors.values(), ids, backend="triton", config=CFG)
    called, pre = [], []
    for fn in LAUNCHERS:
        original = getattr(triton_experts, fn)
        monkeypatch.setattr(triton_experts, fn,
                            lambda *a, _f=original, _n=fn, **k: called.append(_n) or _f(*a, **k))
    real = triton_experts.swiglu_backward
    monkeypatch.setattr(triton_experts, "swiglu_backward",
                        lambda *a, **k: pre.append(k["pre"]) or real(*a, **k))
    out.backward(dout)
    assert set(called) == expected
    # The SwiGLU backward reads what the forward's GEMM1 saved (its (L, 2I) pre-activations), never
    # recomputes them; with only down_proj trainable nothing was saved (h is recomputed instead).
    assert all(p is not None and p.shape[1] == 2 * gate_up.shape[1] // 2 for p in pre)
    assert len(pre) == ("swiglu_backward" in expected)
    want = ref_grads(x, gate_up, down, w, ids, dout)
    for name, ref in zip(NAMES, want):
        got = tensors[name].grad
        if name in trainable:
            assert rel_err(got, ref) <= 1e-5, name
        else:
            assert got is None, name


def test_backward_is_bitwise_reproducible():
    # Busy experts (several row blocks each) and unplaced pairs; no atomics, nothing left unwritten.
    x, gate_up, down, w, ids, dout = make(30, 4, 48, 24, 3, "sentinels")
    leaves = [t.requires_grad_(True) for t in (x, gate_up, down, w)]
    out = moe_experts(*leaves, ids, backend="triton", config=CFG, ignore_invalid_ids=True)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    second = torch.autograd.grad(out, leaves, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_both_weight_gradients_share_one_row_starts(monkeypatch):
    """A backward computes the experts' first rows once (host work: a few torch ops) and hands them
    to both weight-gradient launches."""
    calls = []
    real = Alignment.row_starts
    monkeypatch.setattr(Alignment, "row_starts", lambda self: calls.append(1) or real(self))
    x, gate_up, down, w, ids, dout = make(30, 4, 48, 24, 3, "sentinels")
    leaves = [t.requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts(*leaves, ids, backend="triton", config=CFG, ignore_invalid_ids=True).backward(dout)
    assert len(calls) == 1 and all(t.grad is not None for t in leaves)


@pytest.mark.parametrize("trainable,saves_pre", [
    (NAMES, True), (("hidden_states",), True), (("topk_weights",), True), (("gate_up_proj",), True),
    (("down_proj",), False),
], ids=lambda v: "+".join(v) if isinstance(v, tuple) else None)
def test_what_the_forward_saves(trainable, saves_pre):
    """The inputs, the alignment and, when the SwiGLU backward will run, the (L, 2I) pre-activations
    in x's dtype (GEMM1's own: those of the placed rows equal the twin's; padding rows 0)."""
    x, gate_up, down, w, ids, _ = make(9, 5, 32, 12, 2, "sentinels")
    tensors = dict(zip(NAMES, (x, gate_up, down, w)))
    for name in trainable:
        tensors[name].requires_grad_(True)
    with poisoning():
        out = moe_experts(*tensors.values(), ids, backend="triton", config=CFG, ignore_invalid_ids=True)
    *_, sorted_ids, expert_ids, num_padded, tokens_per_expert, block_codes, pre = out.grad_fn.saved_tensors
    if not saves_pre:
        assert pre is None
        return
    align = align_block_size(ids, 5, CFG.block_m, backend="torch")
    assert torch.equal(sorted_ids, align.sorted_ids) and pre.shape == (sorted_ids.numel(), 24)
    assert pre.dtype == x.dtype and pre.is_contiguous()
    live = int(num_padded)
    assert rel_err(pre[:live], gemm1_swiglu_torch(x, gate_up, align, 2, swiglu=False)[:live]) <= 1e-5
    zeros = padding_rows(align)[:live]
    assert torch.equal(pre[:live][zeros], torch.zeros_like(pre[:live][zeros]))


def test_a_later_forward_leaves_the_saved_pre_activations_alone():
    """Two forwards on different inputs, then the first one's backward: its saved buffer is its
    own (a fresh allocation each forward, nothing pooled), so its gradients are the first inputs'."""
    first = make(8, 4, 32, 16, 2, "distinct")
    second = make(8, 4, 32, 16, 2, "distinct")
    leaves = [[t.clone().requires_grad_(True) for t in case[:4]] for case in (first, second)]
    with poisoning():
        outs = [moe_experts(*lv, case[4], backend="triton", config=CFG)
                for lv, case in zip(leaves, (first, second))]
        pres = [o.grad_fn.saved_tensors[-1] for o in outs]
        assert pres[0].data_ptr() != pres[1].data_ptr()
        outs[0].backward(first[5])
    for name, got, want in zip(NAMES, (t.grad for t in leaves[0]), ref_grads(*first)):
        assert rel_err(got, want) <= 1e-5, name


def test_backward_tiles_fit_shared_memory():
    # Recomputing, the SwiGLU backward streams five tiles where GEMM1 streams three: the forward's
    # tiles (e.g. the H200 table's T=64 entry, 128 x 128 x 3 stages) would overflow shared memory on
    # the GPU. Reading the saved pre-activations it streams two (dout rows, down columns).
    shape = PRESETS["qwen3-30b-a3b"]
    configs = [default_config(shape, t) for t in (1, 64, 1000, 65536)]
    configs += [c for by_tokens in load_table("nvidia_h200").values() for c in by_tokens.values()]
    configs.append(dataclasses.replace(configs[-1], block_m=256, block_n1=256, block_k1=256, stages1=8))
    for cfg in configs:
        for itemsize in (2, 4):
            for recompute, streamed in ((True, (2, 3)), (False, (1, 1))):
                tiles = BackwardTiles.fit(cfg, itemsize, recompute=recompute)
                rows, cols = streamed
                used = tiles.stages * tiles.block_k * (rows * cfg.block_m + cols * tiles.block_n)
                assert tiles.recompute is recompute
                assert used * itemsize == tiles.pipeline_bytes(cfg.block_m, itemsize)
                assert used * itemsize <= shared_memory_budget(None), (cfg, itemsize, tiles)
                # Recomputing: GEMM1's tiles capped at 64; reading pre: tiles of its own.
                own = saved_tiles(cfg.block_m)
                n, k, stages = ((min(cfg.block_n1, 64), min(cfg.block_k1, 64), cfg.stages1) if recompute else
                                (own.block_n, own.block_k, own.stages))
                assert tiles.block_n == n and tiles.block_k <= k and 1 <= tiles.stages <= stages
    saved = BackwardTiles.fit(ExpertsConfig(block_m=64, block_n1=128, block_k1=128, stages1=4), 2,
                              recompute=False)
    assert saved == SAVED_TILES_64 == BackwardTiles(128, 128, 4, False, 8, True)   # fits as it is
    saved = BackwardTiles.fit(ExpertsConfig(block_m=128, block_n1=128, block_k1=64, stages1=4), 2,
                              recompute=False)
    assert saved == SAVED_TILES == BackwardTiles(64, 64, 5, False, 8, True)    # fits as it is
    assert saved_tiles(16) == saved_tiles(64) == SAVED_TILES_64 and saved_tiles(256) == SAVED_TILES
    assert BackwardTiles.fit(ExpertsConfig(block_m=64, block_n1=128, block_k1=128, stages1=4), 2) == \
        BackwardTiles(64, 64, 4, True)
    halves = BackwardTiles(64, 64, 3, recompute=False, halves=2)      # two down tiles a step
    assert halves.pipeline_bytes(128, 2) == 3 * 64 * (128 + 2 * 64) * 2
    for bad in ({"halves": 3, "recompute": False}, {"halves": 2, "recompute": True}):
        with pytest.raises(ValueError, match="BackwardTiles.halves must be 1, or 2 reading the saved"):
            BackwardTiles(64, 64, 3, **bad)


def test_swiglu_backward_compiles_for_sm90_without_spills():
    """The SwiGLU backward reading the saved pre-activations and recomputing them, with the tiles
    `BackwardTiles.fit` gives the smallest and the largest forward tiles, through ptxas for sm_90
    (skipped where this Triton has no CUDA backend or ptxas); without spills, but for the opt-in
    two-halves form (`BackwardTiles.halves`), which must compile (it may spill at 128 rows)."""
    out = aot_compile_check("--backward", "--tiles", "S,L", "--regs")
    assert "6/6 backward variants compile" in out
    lines = [line for line in out.splitlines() if line.startswith("backward.")]
    assert len(lines) == 6 and all(re.search(r"\d+r[ /]", line) for line in lines), lines
    assert all(" local " not in line for line in lines if ".saved_h2 " not in line), lines
    assert "backward.L.saved " in lines[3] and "n64" in lines[3]       # SAVED_TILES, reading pre


# The weight gradients' own tiles (`WgradConfig`): small ones so every expert spans several N and C
# tiles and row steps; scaled (`wgrad` given topk_weights): BN < BC scales the [BN, BM] operand, BN >= BC
# the [BM, BC] one; unscaled (the training step's launches): both tiles straight to the dot.
WGRAD_TILES = [WgradConfig(16, 32, 16, 4, 1), WgradConfig(32, 16, 32, 4, 2), WgradConfig(16, 16, 16, 2, 3)]


@pytest.mark.parametrize("mode", ["prescaled", "scaled", "padding_zero"])
@pytest.mark.parametrize("tiles", WGRAD_TILES, ids=WgradConfig.label)
@pytest.mark.parametrize("case", [CASES[3], CASES[6]], ids=case_id)
def test_weight_gradients_with_their_own_tiles(case, tiles, mode):
    num_tokens, num_experts, hidden, inter, top_k, kind = case
    x, gate_up, down, w, ids, dout = make(*case)
    align = align_block_size(ids, num_experts, CFG.block_m, backend="torch")
    # Operands as the backward feeds them: dpre_w and h_w, or an unscaled h with the weights.
    scaled, zero = mode == "scaled", mode == "padding_zero"
    scale = w if scaled else None
    sw = swiglu_backward_torch(x, gate_up, down, dout, torch.ones_like(w) if scaled else w, align, top_k)
    dpre, h = sw.dpre_w.clone(), sw.h_w.clone()
    # Rows no pair owns are never read, or, padding_zero, read as the zeros swiglu_backward writes
    # there (rows past num_padded, never written, stay NaN: no expert's group reaches them).
    unowned = padding_rows(align)
    if zero:
        unowned[: int(align.num_padded)] = False
    dpre[unowned] = float("nan")
    h[unowned] = float("nan")
    with poisoning():
        d_gu = gate_up_proj_grad(dpre, x, scale, align, top_k, torch.float32, tiles, padding_zero=zero)
        d_down = down_proj_grad(dout, h, scale, align, top_k, torch.float32, tiles, padding_zero=zero)
    assert rel_err(d_gu, gate_up_proj_grad_torch(dpre, x, scale, align, top_k)) <= 1e-5
    assert rel_err(d_down, down_proj_grad_torch(dout, h, scale, align, top_k)) <= 1e-5
    want = ref_grads(x, gate_up, down, w, ids, dout)               # either way, the true gradients
    assert rel_err(d_gu, want[1]) <= 1e-5 and rel_err(d_down, want[2]) <= 1e-5
    check_exact_zeros((None, d_gu, d_down, None), ids, num_experts)
    if zero:
        with pytest.raises(ValueError, match="padding_zero needs an operand in sorted-row order"):
            wgrad(x, x, None, align, top_k, d_gu.shape, torch.float32, a_by_token=True, b_by_token=True,
                  padding_zero=True)
        # The gathered operands copied into sorted-row order first: no index read, the same sums.
        xs, dos = sorted_rows(x, align, top_k), sorted_rows(dout, align, top_k)
        xs[int(align.num_padded):] = float("nan")        # rows past num_padded are never read
        dos[int(align.num_padded):] = float("nan")
        with poisoning():
            got_gu = wgrad(dpre, xs, None, align, top_k, d_gu.shape, torch.float32, a_by_token=False,
                           b_by_token=False, tiles=tiles, padding_zero=True)
            got_down = wgrad(dos, h, None, align, top_k, d_down.shape, torch.float32, a_by_token=False,
                             b_by_token=False, tiles=tiles, padding_zero=True)
        assert torch.equal(got_gu, d_gu) and torch.equal(got_down, d_down)


# The range kernel (`WgradConfig.experts` > 1): a program walks several experts' rows in one loop.
# Steps of 16 rows under 16- and 32-row align blocks (a step inside a block, or a block's two halves),
# ranges of 2 and 3 experts (a last range cut short by E), routings that leave experts empty in the
# middle of a range (k=e, one-expert, sentinels) or every expert of a range empty (one-expert, E = 4).
RANGE_TILES = [WgradConfig(16, 32, 16, 4, 2, experts=2), WgradConfig(32, 16, 32, 4, 3, experts=3)]


@pytest.mark.parametrize("padding_zero", [False, True], ids=["masked", "padding_zero"])
@pytest.mark.parametrize("align_m", [16, 32])
@pytest.mark.parametrize("tiles", RANGE_TILES, ids=WgradConfig.label)
@pytest.mark.parametrize("case", [CASES[3], CASES[4], CASES[5], CASES[6]], ids=case_id)
def test_weight_gradients_walking_expert_ranges(case, tiles, align_m, padding_zero, monkeypatch):
    import moekit.grouped_gemm.backward as gb

    num_tokens, num_experts, hidden, inter, top_k, kind = case
    x, gate_up, down, w, ids, dout = make(*case)
    align = align_block_size(ids, num_experts, align_m, backend="torch")
    sw = swiglu_backward_torch(x, gate_up, down, dout, w, align, top_k)
    dpre, h = sw.dpre_w.clone(), sw.h_w.clone()
    unowned = padding_rows(align)
    if padding_zero:                    # zeros on the padding rows, NaN past num_padded
        unowned[: int(align.num_padded)] = False
    dpre[unowned] = float("nan")
    h[unowned] = float("nan")
    launched = []
    real = gb.moe_wgrad_range_kernel
    monkeypatch.setattr(gb, "moe_wgrad_range_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    with poisoning():
        d_gu = gate_up_proj_grad(dpre, x, None, align, top_k, torch.float32, tiles, padding_zero=padding_zero)
        d_down = down_proj_grad(dout, h, None, align, top_k, torch.float32, tiles, padding_zero=padding_zero)
    experts = min(tiles.experts, num_experts)
    assert [g[0] % -(-num_experts // experts) for g in launched] == [0, 0]       # both took the range kernel
    assert rel_err(d_gu, gate_up_proj_grad_torch(dpre, x, None, align, top_k)) <= 1e-5
    assert rel_err(d_down, down_proj_grad_torch(dout, h, None, align, top_k)) <= 1e-5
    want = ref_grads(x, gate_up, down, w, ids, dout)
    assert rel_err(d_gu, want[1]) <= 1e-5 and rel_err(d_down, want[2]) <= 1e-5
    check_exact_zeros((None, d_gu, d_down, None), ids, num_experts)
    # The per-tile kernel's sums in the same order of rows: the same bits.
    per_tile = dataclasses.replace(tiles, experts=1, block_m=min(tiles.block_m, align_m))
    assert torch.equal(d_gu, gate_up_proj_grad(dpre, x, None, align, top_k, torch.float32, per_tile,
                                               padding_zero=padding_zero))


def test_range_kernel_only_where_it_applies():
    """Scaled calls, and align blocks that are no power of two >= 16, take the per-tile kernel."""
    from moekit.grouped_gemm.backward import _range_rows

    x, gate_up, down, w, ids, dout = make(*CASES[3])
    tiles = WgradConfig(16, 32, 64, 4, 2, experts=4)
    for block, scaled, want in ((16, False, 16), (32, False, 32), (128, False, 64), (16, True, 0),
                                (8, False, 0), (48, False, 0)):
        align = align_block_size(ids, gate_up.shape[0], block, backend="torch")
        assert _range_rows(tiles, align, scaled) == want, (block, scaled)
    align = align_block_size(ids, gate_up.shape[0], 16, backend="torch")
    assert _range_rows(dataclasses.replace(tiles, experts=1), align, False) == 0
    with pytest.raises(ValueError, match="WgradConfig.experts must be a positive int"):
        WgradConfig(experts=0)
    assert WgradConfig(experts=3).label().endswith(" e3") and "e" not in WgradConfig().label().split()[-1]
    assert WgradConfig.parse("experts=8,block_m=32") == WgradConfig(block_m=32, experts=8)


def test_wgrad_tiles_from_the_environment(monkeypatch):
    monkeypatch.setenv(WGRAD_ENV, "block_n=32, block_m=16,stages=2")
    assert wgrad_config(2) == WgradConfig(block_n=32, block_m=16, stages=2)
    for bad in ("block_n=48", "block_k=64", "block_m=256", "warps=x", "stages", "block_n=32,block_n=64"):
        monkeypatch.setenv(WGRAD_ENV, bad)
        with pytest.raises(ValueError, match=WGRAD_ENV):
            wgrad_config(2)
    monkeypatch.delenv(WGRAD_ENV)
    for itemsize in (2, 4):                     # the default fits the budget in 16 and 32 bits
        tiles = wgrad_config(itemsize)
        assert tiles.pipeline_bytes(itemsize) <= shared_memory_budget(None), tiles
    assert wgrad_config(2) == WgradConfig()
    # Many rows an expert: the wide tiles, fitted to the budget; the environment still wins.
    from moekit.tuning import WIDE_WGRAD, WIDE_WGRAD_ROWS

    for itemsize in (2, 4):
        wide = wgrad_config(itemsize, rows_per_expert=WIDE_WGRAD_ROWS)
        assert wide == WIDE_WGRAD.fit(itemsize, shared_memory_budget(None))
        assert wide.pipeline_bytes(itemsize) <= shared_memory_budget(None)
    assert wgrad_config(2, rows_per_expert=WIDE_WGRAD_ROWS) == WIDE_WGRAD      # fits as it is in bf16
    assert wgrad_config(2, rows_per_expert=WIDE_WGRAD_ROWS - 1) == WgradConfig()
    # Few rows an expert: the range kernel's tiles.
    from moekit.tuning import RANGE_WGRAD, RANGE_WGRAD_ROWS

    assert wgrad_config(2, rows_per_expert=RANGE_WGRAD_ROWS - 1) == RANGE_WGRAD
    assert wgrad_config(2, rows_per_expert=RANGE_WGRAD_ROWS) == WgradConfig()
    assert RANGE_WGRAD.experts > 1 and wgrad_config(4, rows_per_expert=1).experts == RANGE_WGRAD.experts
    monkeypatch.setenv(WGRAD_ENV, "block_n=32")
    assert wgrad_config(2, rows_per_expert=10**6) == WgradConfig(block_n=32)


def test_wgrad_picks_its_tiles_by_rows_per_expert(monkeypatch):
    """`wgrad` without tiles asks for the tiles of its call's rows per expert (S / E)."""
    import moekit.grouped_gemm.backward as gb

    asked = []
    real = gb.wgrad_config
    monkeypatch.setattr(gb, "wgrad_config",
                        lambda *a, **k: asked.append(k["rows_per_expert"]) or real(*a, **k))
    x, gate_up, down, w, ids, dout = make(*CASES[3])
    num_experts = gate_up.shape[0]
    align = align_block_size(ids, num_experts, CFG.block_m, backend="torch")
    sw = swiglu_backward_torch(x, gate_up, down, dout, w, align, ids.shape[1])
    gate_up_proj_grad(sw.dpre_w, x, None, align, ids.shape[1], torch.float32)
    assert asked == [ids.numel() / num_experts]


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_float16_gradients_within_twice_plain_pytorch(num_tokens):
    # The interpreter rounds float16 stores to nearest (bf16 ones toward zero): the tolerance rule on CPU.
    num_experts, hidden, inter, top_k = 6, 96, 48, 2
    x, gate_up, down, _, _, dout = (t.half() for t in make(num_tokens, num_experts, hidden, inter, top_k,
                                                            "distinct"))
    w, ids = torch.softmax(torch.randn(num_tokens, num_experts), -1).topk(top_k, -1)
    ids[:, 0] = torch.where(ids[:, 0] == num_experts - 1, 0, ids[:, 0])      # an expert with no pair
    want = ref_grads(x, gate_up, down, w, ids, dout)
    base = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    experts_plain(*base, ids).backward(dout)
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts(*leaves, ids, backend="triton", config=CFG32).backward(dout)
    for name, t, b, ref in zip(NAMES, leaves, base, want):
        assert t.grad.dtype == b.grad.dtype, name
        err, base_err = rel_err(t.grad, ref), rel_err(b.grad, ref)
        assert err <= 2 * base_err, (name, err, base_err)


# GPU: bf16 at the Qwen3-30B-A3B shape (run on the H200:
# pytest -m gpu tests/runtime/grouped_gemm/test_grouped_gemm_backward.py).

def qwen_case(num_tokens, dtype=torch.bfloat16, seed=0):
    shape = PRESETS["qwen3-30b-a3b"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, i, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    x = torch.randn(num_tokens, h, device="cuda", generator=gen).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).to(dtype)
    down = (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).to(dtype)
    logits = torch.randn(num_tokens, e, device="cuda", generator=gen)
    logits[:, -1] = float("-inf")        # the last expert gets no pairs: its gradient must be exactly 0
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    dout = torch.randn(num_tokens, h, device="cuda", generator=gen).to(dtype)
    return x, gate_up, down, w, ids.to(torch.int32), dout


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1000])
def test_bf16_gradients_within_twice_plain_pytorch_gpu(num_tokens):
    x, gate_up, down, w, ids, dout = qwen_case(num_tokens)
    want = ref_grads(x, gate_up, down, w, ids, dout)
    base = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    experts_plain(*base, ids).backward(dout)
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    out = moe_experts(*leaves, ids, backend="triton")
    got = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    again = torch.autograd.grad(out, leaves, dout)
    for name, g, b, ref, g2 in zip(NAMES, got, (t.grad for t in base), want, again):
        assert g.dtype == b.dtype, name
        assert rel_err(g, ref) <= 2 * rel_err(b, ref), (name, rel_err(g, ref), rel_err(b, ref))
        assert torch.equal(g, g2), name                                       # deterministic
    check_exact_zeros([g.cpu() for g in got], ids.cpu().long(), gate_up.shape[0])


@pytest.mark.gpu
def test_fp32_gradients_match_reference_gpu():
    x, gate_up, down, w, ids, dout = qwen_case(64, torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    got = torch.autograd.grad(moe_experts(*leaves, ids, backend="triton"), leaves, dout)
    for name, g, ref in zip(NAMES, got, ref_grads(x, gate_up, down, w, ids, dout)):
        assert rel_err(g, ref) <= 1e-5, name


@pytest.mark.gpu
def test_backward_makes_no_host_sync_gpu():
    x, gate_up, down, w, ids, dout = qwen_case(300)
    leaves = [t.requires_grad_(True) for t in (x, gate_up, down, w)]
    torch.autograd.grad(moe_experts(*leaves, ids, backend="triton"), leaves, dout)   # compile kernels
    out = moe_experts(*leaves, ids, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = torch.autograd.grad(out, leaves, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu
def test_make_graphed_callables_trains_through_the_experts_gpu():
    """torch.cuda.make_graphed_callables over moe_experts (forward and backward each one CUDA-graph
    replay, PyTorch's API for a host-bound training step): new inputs of the captured shapes, new
    routing included, copied into its static inputs, give the eager step's four gradients bit for
    bit (the alignment is recomputed on the device at each replay; nothing stale)."""
    x, gate_up, down, w, ids, _ = qwen_case(300)
    leaves = [t.detach().requires_grad_(True) for t in (x, gate_up, down, w)]

    def experts(x_, gu_, d_, w_, ids_):
        return moe_experts(x_, gu_, d_, w_, ids_, backend="triton")

    graphed = torch.cuda.make_graphed_callables(experts, (*leaves, ids))
    for seed in (1, 2):
        x2, _, _, w2, ids2, dout = qwen_case(300, seed=seed)
        inputs = [x2.requires_grad_(True), leaves[1], leaves[2], w2.requires_grad_(True)]
        eager = torch.autograd.grad(experts(*inputs, ids2), inputs, dout)
        got = torch.autograd.grad(graphed(*inputs, ids2), inputs, dout)
        for name, a, b in zip(NAMES, got, eager, strict=True):
            assert torch.equal(a, b), f"d {name}: the graphed step differs from the eager one (seed {seed})"


def test_pre_activations_freed_before_the_weight_gradients(monkeypatch):
    """The backward frees the saved (L, 2I) pre-activations once the SwiGLU backward has read them:
    neither weight gradient is computed while they are alive (the peak). A second backward through
    the retained graph has the forward's GEMM1 store them again, and its gradients are the first's,
    bit for bit."""
    x, gate_up, down, w, ids, dout = make(30, 4, 48, 24, 3, "distinct")
    leaves = [t.requires_grad_(True) for t in (x, gate_up, down, w)]
    out = moe_experts(*leaves, ids, backend="triton", config=CFG)
    seen, alive, stored = [], [], []
    real_swiglu = triton_experts.swiglu_backward
    monkeypatch.setattr(triton_experts, "swiglu_backward",
                        lambda *a, **k: seen.append(k["pre"]) or real_swiglu(*a, **k))
    for name in ("gate_up_proj_grad", "down_proj_grad"):
        real = getattr(triton_experts, name)
        monkeypatch.setattr(triton_experts, name, lambda *a, _f=real, **k: alive.append(
            seen[-1].untyped_storage().nbytes()) or _f(*a, **k))
    real_gemm1 = triton_experts.gemm1_swiglu_with_pre
    monkeypatch.setattr(triton_experts, "gemm1_swiglu_with_pre",
                        lambda *a, **k: stored.append(1) or real_gemm1(*a, **k))
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    assert len(seen) == 1 and seen[0].numel() > 0 and alive == [0, 0] and stored == []
    second = torch.autograd.grad(out, leaves, dout)
    assert len(seen) == 2 and stored == [1] and alive == [0, 0, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    for got, ref in zip(first, ref_grads(x, gate_up, down, w, ids, dout), strict=True):
        assert rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint-reentrant", "save-on-cpu"])
def test_activation_checkpointing_and_saved_tensor_hooks(how):
    """Under torch.utils.checkpoint (non-reentrant and reentrant: the forward recomputed in the
    backward) and with the saved tensors packed by hooks (`save_on_cpu`), the four gradients are
    those of a plain training step, bit for bit, and a second step on the same module gives them
    again (nothing freed that a later step needs)."""
    from torch.utils.checkpoint import checkpoint

    x, gate_up, down, w, ids, dout = make(20, 4, 32, 16, 2, "distinct")

    def step(wrap):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
        fn = lambda *ts: moe_experts(*ts, ids, backend="triton", config=CFG)  # noqa: E731
        out = wrap(fn, leaves)
        out.backward(dout)
        return [t.grad for t in leaves]

    plain = step(lambda fn, leaves: fn(*leaves))
    if how == "save-on-cpu":
        def wrap(fn, leaves):
            with torch.autograd.graph.save_on_cpu():
                return fn(*leaves)
    else:
        def wrap(fn, leaves):
            return checkpoint(fn, *leaves, use_reentrant=how.endswith("reentrant"))
    for _ in range(2):
        got = step(wrap)
        assert all(g is not None and torch.equal(g, p) for g, p in zip(got, plain, strict=True)), how
