"""The triton path's plan (`moekit.experts.plan`): which path, tiles and launch hints one call gets, and
that the entry points run the plan they make (the launchers get its config and hints and decide
nothing again). CPU: the Triton interpreter, fp32, small tiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moekit.decode as decode
import moekit.experts.plan as planning
import moekit.experts.triton as triton_experts
import moekit.grouped_gemm as gg
from helpers import distinct_topk_ids, rel_err
from moekit import launch_hints
from moekit._validation import MAX_TRITON_EXPERTS
from moekit.activation import as_activation
from moekit.decode import ENV_VAR, DecodeConfig, decode_config
from moekit.experts.plan import DECODE, GROUPED, align_backend, auto_config, plan_triton_call
from moekit.reference import moe_experts_ref
from moekit.tuning import ExpertsConfig

CFG = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                    block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)
TMA = dataclasses.replace(CFG, tma_weights=True)
GROUPED_LAUNCHERS = ("align_pairs", "gemm1_swiglu", "gemm1_swiglu_with_pre", "gemm2_weighted", "moe_sum")


def make(num_tokens, num_experts=8, hidden=32, inter=16, top_k=2):
    """Inputs whose weight rows are 16-byte aligned in fp32 (H, I multiples of 4): TMA can read them."""
    x = torch.randn(num_tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=torch.int64)
    return x, gate_up, down, torch.rand(num_tokens, top_k), ids


@pytest.fixture(autouse=True)
def decode_on(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")


def counting(monkeypatch, module, name, result=None):
    """Replace module.name by a wrapper that counts its calls (returning `result` when given)."""
    calls = []
    real = getattr(module, name)

    def wrapper(*a, **k):
        calls.append(a)
        return real(*a, **k) if result is None else result
    monkeypatch.setattr(module, name, wrapper)
    return calls


def spy_launchers(monkeypatch, module, names):
    """[(launcher, args, keywords)] of each call of module's launchers, recorded as the caller made
    it; the launch itself runs without PDL (its inline assembly cannot run interpreted)."""
    seen = []
    for name in names:
        real = getattr(module, name)

        def spy(*a, _real=real, _name=name, **k):
            seen.append((_name, a, dict(k)))
            if k.get("pdl"):
                k["pdl"] = False
            return _real(*a, **k)
        monkeypatch.setattr(module, name, spy)
    return seen


def spy_plans(monkeypatch):
    """The plans the triton entry points make, in order."""
    plans = []
    real = triton_experts.plan_triton_call
    monkeypatch.setattr(triton_experts, "plan_triton_call",
                        lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    return plans


def test_a_small_inference_call_takes_the_decode_path():
    x, gate_up, down, _, ids = make(1)                    # 2 pairs over 8 experts
    plan = plan_triton_call(x, gate_up, down, ids)
    assert plan.path == DECODE and plan.decode == decode_config(2)
    assert plan.config is None and plan.align is None and not plan.grad and not plan.store_pre
    assert not plan.pdl and plan.weight_evict == ""        # off the GPU both hints are off
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.path = GROUPED


@pytest.mark.parametrize("why, kwargs", [
    ("grad", {"grad": True}),
    ("config", {"config": CFG}),
    ("bias", {"biases": True}),
    ("gpt_oss", {"activation": as_activation("gpt_oss")}),
    ("interleaved", {"interleaved": True}),
    ("switched off", {}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_keeps_a_small_call_off_the_decode_path(monkeypatch, why, kwargs):
    if why == "switched off":
        monkeypatch.setenv(ENV_VAR, "0")
    x, gate_up, down, _, ids = make(1)
    plan = plan_triton_call(x, gate_up, down, ids, **kwargs)
    assert plan.path == GROUPED and plan.decode is None and plan.weight_evict == ""
    tiles = kwargs.get("config") or auto_config(1, gate_up, 2, x.dtype, x.device)
    assert plan.config == gg.resolve_tma(tiles, gate_up, down, interleaved=kwargs.get("interleaved", False))
    assert plan.align == "triton" and plan.grad is kwargs.get("grad", False)


def test_fp8_weights_take_the_decode_path_up_to_its_own_bound():
    """Block-scaled FP8 weights: the direct decode path up to DECODE_MAX_PAIRS_FP8 pairs, the grouped
    path with FP8 tiles past it, where dense weights of the same shape still take the decode path."""
    from moekit.quant import quantize_experts

    assert decode.DECODE_MAX_PAIRS_FP8 < decode.DECODE_MAX_PAIRS
    num_experts, hidden, inter, top_k = 128, 128, 128, 8
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    fp8 = quantize_experts(gate_up), quantize_experts(down)
    for tokens in (1, 2, 3, 4, 8):
        x = torch.randn(tokens, hidden)
        ids = distinct_topk_ids(tokens, num_experts, top_k, dtype=torch.int64)
        pairs = tokens * top_k
        dense = plan_triton_call(x, gate_up, down, ids)
        plan = plan_triton_call(x, *fp8, ids)
        assert dense.path == DECODE, tokens
        assert plan.path == (DECODE if pairs <= decode.DECODE_MAX_PAIRS_FP8 else GROUPED), tokens
        assert planning.takes_decode_path(fp8[0], ids) is (plan.path == DECODE)
        if plan.path == DECODE:                                    # FP8 weights' own decode tiles
            assert plan.decode == decode.SMALL_DECODE_FP8 and dense.decode == decode.SMALL_DECODE
        if plan.path == GROUPED:
            assert plan.config.block_k1 == plan.config.block_k2 == 128     # FP8 tiles: one scale block


def test_many_pairs_take_the_grouped_path_with_the_tiles_for_their_rows():
    x, gate_up, down, _, ids = make(100)
    tiles = auto_config(100, gate_up, 2, x.dtype, x.device)
    assert tiles != auto_config(1, gate_up, 2, x.dtype, x.device)       # T picks the tiles
    plan = plan_triton_call(x, gate_up, down, ids)
    assert plan.path == GROUPED and plan.config == gg.resolve_tma(tiles, gate_up, down)


@pytest.mark.parametrize("math", [{"biases": True}, {"activation": as_activation("gpt_oss")},
                                  {"interleaved": True}], ids=["bias", "gpt_oss", "interleaved"])
def test_a_call_that_needs_gradients_with_expert_math_has_no_plan(math):
    x, gate_up, down, _, ids = make(40)
    with pytest.raises(RuntimeError, match="triton backward computes SwiGLU without biases only"):
        plan_triton_call(x, gate_up, down, ids, grad=True, **math)
    assert plan_triton_call(x, gate_up, down, ids, **math).path == GROUPED       # inference runs


def test_the_pre_activations_are_stored_for_a_backward_only():
    x, gate_up, down, _, ids = make(40)
    assert plan_triton_call(x, gate_up, down, ids, grad=True, store_pre=True).store_pre
    assert not plan_triton_call(x, gate_up, down, ids, grad=True).store_pre
    assert not plan_triton_call(x, gate_up, down, ids, store_pre=True).store_pre


def test_tma_is_turned_off_where_tma_supported_fails(monkeypatch):
    x, gate_up, down, _, ids = make(40)
    assert plan_triton_call(x, gate_up, down, ids, config=TMA).config == TMA
    odd = make(40, hidden=37)                              # gate_up rows of 148 bytes: not 16-aligned
    assert plan_triton_call(odd[0], odd[1], odd[2], odd[4], config=TMA).config == CFG
    strided = torch.randn(8, 32, 32).transpose(1, 2)      # (E, 2I, H), not contiguous
    assert plan_triton_call(x, strided, down, ids, config=TMA).config == CFG
    wide = dataclasses.replace(TMA, block_n1=256)          # an interleaved box of 512 rows: over TMA's
    assert plan_triton_call(x, gate_up, down, ids, config=wide).config == wide
    assert plan_triton_call(x, gate_up, down, ids, config=wide, interleaved=True).config == \
        dataclasses.replace(wide, tma_weights=False)
    monkeypatch.setattr(gg, "tma_supported", lambda *a, **k: False)
    assert plan_triton_call(x, gate_up, down, ids, config=TMA).config == CFG


def test_the_align_follows_the_expert_count():
    assert align_backend(MAX_TRITON_EXPERTS) == "triton" and align_backend(MAX_TRITON_EXPERTS + 1) == "torch"
    x, gate_up, down, _, ids = make(40, num_experts=MAX_TRITON_EXPERTS + 1, hidden=8, inter=4)
    assert plan_triton_call(x, gate_up, down, ids).align == "torch"


def test_the_launch_hints_are_read_once_into_the_plan(monkeypatch):
    pdl = counting(monkeypatch, planning, "pdl_enabled", True)
    evict = counting(monkeypatch, planning, "weight_evict", "evict_first")
    x, gate_up, down, _, ids = make(1)
    plan = plan_triton_call(x, gate_up, down, ids)
    assert plan.path == DECODE and plan.pdl and plan.weight_evict == "evict_first"
    assert len(pdl) == len(evict) == 1
    x, gate_up, down, _, ids = make(40)
    plan = plan_triton_call(x, gate_up, down, ids)
    assert plan.path == GROUPED and plan.pdl and plan.weight_evict == ""
    assert len(pdl) == 2 and len(evict) == 1               # the grouped GEMMs take no eviction policy


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
def test_experts_triton_runs_the_grouped_plan_it_makes(monkeypatch, grad):
    """The launchers get the plan's config, TMA and PDL decisions and check neither again."""
    x, gate_up, down, w, ids = make(12)
    monkeypatch.setattr(planning, "pdl_enabled", lambda device: True)
    plans = spy_plans(monkeypatch)
    seen = spy_launchers(monkeypatch, triton_experts, GROUPED_LAUNCHERS)
    tma_checks = counting(monkeypatch, gg, "tma_supported")
    pdl_checks = counting(monkeypatch, launch_hints, "pdl_enabled")
    leaves = [t.requires_grad_(grad) for t in (x, gate_up, down, w)]
    out = triton_experts.experts_triton(*leaves, ids, config=TMA)
    [plan] = plans
    assert plan.path == GROUPED and plan.config == TMA and plan.pdl and plan.store_pre is grad
    assert [name for name, _, _ in seen] == [
        "align_pairs", "gemm1_swiglu_with_pre" if grad else "gemm1_swiglu", "gemm2_weighted", "moe_sum"]
    for name, args, kwargs in seen:
        assert kwargs["pdl"] is True, name
        if name.startswith("gemm"):
            assert args[4] is plan.config and kwargs["tma"] is True, name
    assert seen[0][1][2] is plan.config and seen[0][2]["backend"] == plan.align
    assert len(tma_checks) == 2 and pdl_checks == []      # resolve_tma's two checks, none at launch
    assert rel_err(out.detach(), moe_experts_ref(x.detach(), gate_up.detach(), down.detach(), w.detach(),
                                                 ids)) <= 1e-5


def test_experts_triton_runs_the_decode_plan_it_makes(monkeypatch):
    x, gate_up, down, w, ids = make(2)                     # 4 pairs over 8 experts
    monkeypatch.setattr(planning, "weight_evict", lambda device, num_pairs: "evict_first")
    tiles = DecodeConfig.both(block_n=16, block_k=16, warps=1, stages=1)   # none of the pair-count tiles
    monkeypatch.setattr(planning, "decode_config", lambda num_pairs, fp8=False: tiles)
    plans = spy_plans(monkeypatch)
    seen = spy_launchers(monkeypatch, decode, ("decode_gemm1_swiglu", "decode_gemm2_sum"))
    evict_checks = counting(monkeypatch, decode, "weight_evict")
    with torch.no_grad():
        out = triton_experts.experts_triton(x, gate_up, down, w, ids)
    [plan] = plans
    assert plan.path == DECODE and plan.decode is tiles and plan.weight_evict == "evict_first"
    assert [(name, args[-1], kwargs) for name, args, kwargs in seen] == [
        (name, plan.decode, {"w_scale": None, "pdl": plan.pdl, "evict": "evict_first"})
        for name in ("decode_gemm1_swiglu", "decode_gemm2_sum")]
    assert evict_checks == []
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


def test_the_custom_ops_forward_and_backward_run_their_plans(monkeypatch):
    """`experts_triton_train` and `experts_triton_grads` take the config (TMA resolved: off for these
    weights) and hints from their plans; the backward gets the plan's config."""
    x, gate_up, down, w, ids = make(6, num_experts=4, hidden=37)      # H = 37: gate_up rows of 148 bytes
    plans = spy_plans(monkeypatch)
    seen = spy_launchers(monkeypatch, triton_experts, GROUPED_LAUNCHERS + ("experts_triton_backward",))
    out, pre, align = triton_experts.experts_triton_train(x, gate_up, down, w, ids, config=TMA)
    grads = triton_experts.experts_triton_grads(torch.randn_like(x), x, gate_up, down, w, ids,
                                                (False, False, True, False), config=TMA)
    assert [p.config for p in plans] == [CFG, CFG] and all(p.grad for p in plans)
    assert plans[0].store_pre and not plans[1].store_pre
    assert pre is not None and align.block_m == CFG.block_m
    for name, args, kwargs in seen[:4]:
        if name.startswith("gemm"):
            assert args[4] == CFG and kwargs["tma"] is False, name
    assert [name for name, _, _ in seen] == ["align_pairs", "gemm1_swiglu_with_pre", "gemm2_weighted",
                                             "moe_sum", "align_pairs", "experts_triton_backward",
                                             "gemm1_swiglu"]
    assert seen[5][1][7] is plans[1].config and seen[6][1][4] is plans[1].config   # d down's recompute of h
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5
    assert grads[2] is not None and grads[0] is None
