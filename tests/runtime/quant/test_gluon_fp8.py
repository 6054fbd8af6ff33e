"""The Hopper Gluon FP8 GEMM1 (`moekit.grouped_gemm.gluon_fp8`,
`moekit.grouped_gemm.fp8.gluon_gemm1_swiglu_fp8`).

CPU: where it refuses to run (`gluon_gemm1_fp8_problem`), the launch's arguments (the launch recorded,
not run), the sm_90 compile without spills (`aot_compile_check.py --gluon-fp8`).
GPU (marked gpu; skipped unless compute capability 9 and Gluon): hq and hs against the fp32 twin
`gemm1_swiglu_fp8_torch` on real e4m3, poisoned workspaces, padding rows zero, an expert with no
rows, ids outside [0, E), strided x, UE8M0 scales.
"""

from __future__ import annotations

import pytest
import torch

import moekit.grouped_gemm.backward as gb
from helpers import aot_compile_check, hopper_with_gluon, rel_err
from moekit import _workspace
from moekit.align import align_block_size
from moekit.grouped_gemm import gluon_fp8 as kernels
from moekit.grouped_gemm.fp8 import (
    gemm1_swiglu_fp8_torch,
    gemm2_weighted_fp8_torch,
    gluon_gemm1_fp8_problem,
    gluon_gemm1_swiglu_fp8,
    gluon_gemm2_fp8_problem,
    gluon_gemm2_weighted_fp8,
)
from moekit.quant import (
    FP8_DTYPE,
    STANDIN_DTYPE,
    Fp8Weight,
    dequantize_rows,
    quantize_experts,
    quantize_rows,
    quantize_rows_torch,
)

gluon_only = pytest.mark.skipif(not kernels.GLUON_AVAILABLE, reason="this Triton has no Gluon")


def fp8_case(num_tokens, num_experts, hidden, inter, top_k, block_m, device="cpu", *, ue8m0=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    gu = quantize_experts(w, ue8m0=ue8m0)
    ids = torch.rand(num_tokens, num_experts - 1, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gu, ids, x = gu.to(device), ids.to(device), x.to(device)
    align = align_block_size(ids.contiguous(), num_experts, block_m)
    return gu, ids, x, align


@gluon_only
def test_gluon_gemm1_fp8_says_where_it_cannot_run(monkeypatch):
    """Off the sm_90 GPU, on stand-ins, an align block size that is not a multiple of 64, and an I that
    is not a multiple of 128: a reason naming it; the launcher raises it before any launch."""
    gu, ids, x, align = fp8_case(5, 4, 256, 128, 2, 64)
    xq = x.to(FP8_DTYPE)
    assert "compute capability 9" in gluon_gemm1_fp8_problem(xq, gu, align)
    monkeypatch.setattr(gb, "_sm90", lambda device: True)
    assert gluon_gemm1_fp8_problem(xq, gu, align) == ""
    standin = Fp8Weight(gu.data.to(STANDIN_DTYPE), gu.scale)
    assert "e4m3" in gluon_gemm1_fp8_problem(xq.to(STANDIN_DTYPE), standin, align)
    assert "multiple of 64" in gluon_gemm1_fp8_problem(xq, gu, align_block_size(ids, 4, 32))
    odd = quantize_experts(torch.randn(4, 2 * 192, 256))
    assert "multiples of 128" in gluon_gemm1_fp8_problem(xq, odd, align)
    monkeypatch.setattr(gb, "_sm90", lambda device: False)
    with pytest.raises(ValueError, match="gluon_gemm1_swiglu_fp8: needs a CUDA device"):
        gluon_gemm1_swiglu_fp8(xq, torch.ones(5, 2), gu, align, 2)


@gluon_only
def test_gluon_gemm1_fp8_launch_arguments(monkeypatch):
    """The launch recorded instead of run: gate_up's data as (E * 2I, H) in [64, 128] boxes, hq in
    [64, 64] boxes, x as it lies (a column slice: its row stride), the scales and their strides, one
    program an SM at most, the constexprs."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(kernels, "gluon_gemm1_fp8_kernel", Recorder())
    monkeypatch.setattr(gb, "_sm90", lambda device: True)
    num_experts, hidden, inter, top_k = 4, 256, 256, 2
    gu, ids, x, align = fp8_case(9, num_experts, hidden, inter, top_k, 64)
    wide = torch.zeros(9, 2 * hidden, dtype=FP8_DTYPE)
    xq = wide[:, hidden:]
    xs = torch.ones(9, hidden // 128)
    hq, hs = gluon_gemm1_swiglu_fp8(xq, xs, gu, align, top_k, ue8m0=True)
    rows = align.sorted_ids.numel()
    assert hq.shape == (rows, inter) and hq.dtype == FP8_DTYPE and hs.shape == (rows, inter // 128)
    (grid, args, kwargs), = launches
    (w_desc, h_desc, x_arg, x_stride, xs_arg, xs_t, xs_k, ws, ws_e, ws_n, ws_k, hs_arg, hs_stride, sid, eid,
     npad, num_pairs, hidden_arg, inter_arg, n_tiles) = args
    assert w_desc.base.data_ptr() == gu.data.data_ptr()
    assert list(w_desc.shape) == [num_experts * 2 * inter, hidden]
    assert w_desc.block_shape == [64, 128] and h_desc.base is hq and h_desc.block_shape == [64, 64]
    assert x_arg is xq and x_stride == 2 * hidden
    assert xs_arg is xs and (xs_t, xs_k) == xs.stride()
    assert ws is gu.scale and (ws_e, ws_n, ws_k) == ws.stride()
    assert hs_arg is hs and hs_stride == hs.stride(0)
    assert sid is align.sorted_ids and eid is align.expert_ids and npad is align.num_padded
    assert (num_pairs, hidden_arg, inter_arg, n_tiles) == (align.num_pairs, hidden, inter, inter // 128)
    assert grid == (min(gb.num_sms(x.device), (rows // 64) * (inter // 128)),)
    assert (kwargs["ALIGN_M"], kwargs["STAGES_"], kwargs["UE8M0"], kwargs["TOP_K"]) == (64, kernels.STAGES,
                                                                                       True, top_k)
    assert 2 * kwargs["CONSUMER_REGS_"] + kwargs["PRODUCER_REGS_"] <= 3 * kwargs["maxnreg"]
    assert kwargs["DUAL"] is True and kernels.STAGES % 2 == 0          # the dual schedule by default
    monkeypatch.setenv(kernels.DUAL_ENV, "0")
    gluon_gemm1_swiglu_fp8(xq, xs, gu, align, top_k)
    gluon_gemm1_swiglu_fp8(xq, xs, gu, align, top_k, dual=True)
    assert [launch[2]["DUAL"] for launch in launches[1:]] == [False, True]


@gluon_only
def test_gluon_gemm2_fp8_refusals_and_launch_arguments(monkeypatch):
    """GEMM2: refused off sm_90, on stand-ins, on 32-row align blocks and on an hq TMA cannot read,
    naming the reason; the
    launch recorded instead of run: hq in [64, 128] boxes, down's data as (E * H, I) in [128, 128]
    boxes, y (S, H) in the output dtype, the routing weights flat, the scales and their strides."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    num_experts, hidden, inter, top_k = 4, 256, 256, 2
    gu, ids, x, align = fp8_case(9, num_experts, hidden, inter, top_k, 64)
    down = quantize_experts(torch.randn(num_experts, hidden, inter))
    rows = align.sorted_ids.numel()
    hq, hs = torch.zeros(rows, inter, dtype=FP8_DTYPE), torch.ones(rows, inter // 128)
    w = torch.rand(9, top_k)
    assert "compute capability 9" in gluon_gemm2_fp8_problem(hq, down, align)
    monkeypatch.setattr(gb, "_sm90", lambda device: True)
    assert gluon_gemm2_fp8_problem(hq, down, align) == ""
    assert "e4m3" in gluon_gemm2_fp8_problem(hq.to(STANDIN_DTYPE), down, align)
    assert "multiple of 64" in gluon_gemm2_fp8_problem(hq, down, align_block_size(ids, num_experts, 32))
    misaligned = torch.zeros(rows * inter + 1, dtype=FP8_DTYPE)[1:].view(rows, inter)
    assert "TMA-readable" in gluon_gemm2_fp8_problem(misaligned, down, align)
    monkeypatch.setattr(kernels, "gluon_gemm2_fp8_kernel", Recorder())
    y = gluon_gemm2_weighted_fp8(hq, hs, down, w, align, torch.bfloat16)
    assert y.shape == (align.num_pairs, hidden) and y.dtype == torch.bfloat16
    (grid, args, kwargs), = launches
    (a_desc, b_desc, y_arg, y_stride, w_arg, hs_arg, hs_r, hs_k, ds, ds_e, ds_n, ds_k, sid, eid, npad,
     num_pairs, hidden_arg, n_tiles, k_steps) = args
    assert a_desc.base is hq and a_desc.block_shape == [64, 128]
    assert b_desc.base.data_ptr() == down.data.data_ptr()
    assert list(b_desc.shape) == [num_experts * hidden, inter]
    assert b_desc.block_shape == [128, 128]
    assert y_arg is y and y_stride == hidden
    assert w_arg.data_ptr() == w.data_ptr() and w_arg.shape == (w.numel(),)
    assert hs_arg is hs and (hs_r, hs_k) == hs.stride()
    assert ds is down.scale and (ds_e, ds_n, ds_k) == ds.stride()
    assert sid is align.sorted_ids and eid is align.expert_ids and npad is align.num_padded
    assert (num_pairs, hidden_arg, n_tiles, k_steps) == (align.num_pairs, hidden, hidden // 128, inter // 128)
    assert grid == (min(gb.num_sms(x.device), (rows // 64) * (hidden // 128)),)
    assert (kwargs["ALIGN_M"], kwargs["STAGES_"]) == (64, kernels.STAGES2)
    assert 2 * kwargs["CONSUMER_REGS_"] + kwargs["PRODUCER_REGS_"] <= 3 * kwargs["maxnreg"]
    assert kwargs["DUAL"] is True and kernels.STAGES2 % 2 == 0
    monkeypatch.setenv(kernels.DUAL_ENV, "0")
    gluon_gemm2_weighted_fp8(hq, hs, down, w, align, torch.bfloat16)
    gluon_gemm2_weighted_fp8(hq, hs, down, w, align, torch.bfloat16, dual=True)
    assert [launch[2]["DUAL"] for launch in launches[1:]] == [False, True]


def test_gluon_fp8_gemms_compile_for_sm90_without_spills():
    """GEMM1 with float32 and UE8M0 scales, GEMM2 to bf16 and fp16, in the dual schedule, and each in
    the ping-pong one, through ptxas for sm_90 (skipped where this Triton has no Gluon, CUDA backend
    or ptxas): within the shared-memory limit, no local memory."""
    out = aot_compile_check("--gluon-fp8", "--regs")
    assert "6/6 gluon fp8 kernels compile" in out
    lines = [line for line in out.splitlines() if line.startswith("gluon-fp8 ")]
    assert len(lines) == 6 and all(" OK " in line and " local " not in line for line in lines), lines


# ---- GPU -----------------------------------------------------------------------------------------

hopper = pytest.mark.skipif(not (hopper_with_gluon() and kernels.GLUON_AVAILABLE),
                            reason="needs compute capability 9 and Gluon")
GPU_CASES = [  # (name, T, E, H, I, K, block_m, ue8m0, strided)
    ("qwen-T1", 1, 128, 2048, 768, 8, 64, False, False),
    ("qwen-T333", 333, 128, 2048, 768, 8, 64, False, False),
    ("qwen-T2048-ue8m0", 2048, 128, 2048, 768, 8, 64, True, False),
    ("small-T97-m128-strided", 97, 9, 512, 384, 3, 128, False, True),
    ("small-T50-K1", 50, 5, 256, 128, 1, 64, False, False),
]


def _gemm1_plain_bf16(xq, xs, gu, align, top_k, block_m, ue8m0):
    """GEMM1 of the same quantized x and weights in plain bf16 PyTorch (no moekit kernel): each placed
    row's x @ W^T, silu(gate) * up, quantized per 128 columns and back; other rows 0."""
    rows = align.sorted_ids.numel()
    inter = gu.shape[1] // 2
    xd = dequantize_rows(xq, xs).bfloat16()
    pair = align.sorted_ids.long()
    placed = pair < align.num_pairs
    expert = align.expert_ids.long().repeat_interleave(block_m)[:rows]
    h = torch.zeros(rows, inter, device=xq.device)
    for e in expert[placed].unique().tolist():
        sel = placed & (expert == e)
        a = xd[pair[sel] // top_k] @ gu.dequantize()[e].bfloat16().T
        h[sel] = (torch.nn.functional.silu(a[:, :inter]) * a[:, inter:]).float()
    return dequantize_rows(*quantize_rows_torch(h.bfloat16(), ue8m0=ue8m0))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dual", [True, False], ids=["dual", "pingpong"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gluon_gemm1_fp8_equals_its_twin_gpu(case, dual):
    name, num_tokens, num_experts, hidden, inter, top_k, block_m, ue8m0, strided = case
    gu, ids, x, align = fp8_case(num_tokens, num_experts, hidden, inter, top_k, block_m, "cuda", ue8m0=ue8m0)
    ids_bad = ids.clone()
    if num_tokens > 1 and top_k > 1:
        ids_bad[0, 1] = -1                         # a pair never placed
        align = align_block_size(ids_bad, num_experts, block_m)
    xq, xs = quantize_rows(x.to(torch.bfloat16), ue8m0=ue8m0)
    if strided:
        wide = torch.zeros(num_tokens, 2 * hidden, dtype=FP8_DTYPE, device="cuda")
        wide[:, hidden:] = xq
        xq = wide[:, hidden:]
    with _workspace.poisoning():
        hq, hs = gluon_gemm1_swiglu_fp8(xq, xs, gu, align, top_k, ue8m0=ue8m0, dual=dual)
    hq_t, hs_t = gemm1_swiglu_fp8_torch(xq.contiguous(), xs, gu, align, top_k, ue8m0=ue8m0)
    live = int(align.num_padded)
    got, want = dequantize_rows(hq[:live], hs[:live]), dequantize_rows(hq_t[:live], hs_t[:live])
    assert torch.isfinite(got).all()
    # The 2x rule: plain PyTorch of the same quantization in bf16 sets the bound (h's e4m3 rounding
    # flips where the tensor cores' fp8 sums and fp32 differ in the last bits).
    base = rel_err(_gemm1_plain_bf16(xq.contiguous(), xs, gu, align, top_k, block_m, ue8m0)[:live], want)
    assert rel_err(got, want) <= 2 * base, (rel_err(got, want), base)
    if ue8m0:   # a group's amax at a power of two rounds either way: its scale one step apart, no more
        a, b = hs[:live].float(), hs_t[:live].float()
        assert ((a == b) | (a == 2 * b) | (b == 2 * a)).all()
    else:
        assert rel_err(hs[:live], hs_t[:live]) < 1e-3
    # and no row far off (a wrong scale or row is 10% or more; a few e4m3 rounding flips stay far below)
    row_err = (got - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)
    assert float(row_err.max()) < 0.05, float(row_err.max())
    pad = align.sorted_ids[:live] >= align.num_pairs
    assert torch.equal(got[pad], torch.zeros_like(got[pad]))
    again = gluon_gemm1_swiglu_fp8(xq, xs, gu, align, top_k, ue8m0=ue8m0, dual=dual)
    assert torch.equal(again[0][:live].view(torch.uint8), hq[:live].view(torch.uint8))   # reproducible
    assert torch.equal(again[1][:live], hs[:live])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dual", [True, False], ids=["dual", "pingpong"])
def test_gluon_gemm1_fp8_carries_a_nan_token_to_its_rows_only_gpu(dual):
    """A NaN in one token's x: that token's rows of h NaN (scale and values, as the twin), every other
    row as without it."""
    gu, ids, x, align = fp8_case(200, 16, 512, 256, 4, 64, "cuda")
    x[3, 7] = 0.0
    xq, xs = quantize_rows(x.to(torch.bfloat16))
    hq, hs = gluon_gemm1_swiglu_fp8(xq, xs, gu, align, 4, dual=dual)
    x[3, 7] = float("nan")
    xq, xs = quantize_rows(x.to(torch.bfloat16))
    hq_n, hs_n = gluon_gemm1_swiglu_fp8(xq, xs, gu, align, 4, dual=dual)
    live = int(align.num_padded)
    token = (align.sorted_ids[:live] // 4 == 3) & (align.sorted_ids[:live] < align.num_pairs)
    assert int(token.sum()) == 4 and torch.isnan(hs_n[:live][token]).all()
    assert torch.isnan(dequantize_rows(hq_n[:live], hs_n[:live])[token]).all()
    assert torch.equal(hs_n[:live][~token], hs[:live][~token])
    assert torch.equal(hq_n[:live][~token].view(torch.uint8), hq[:live][~token].view(torch.uint8))


def test_fp8_path_takes_the_gluon_gemm1_when_switched_on(monkeypatch):
    """$MOEKIT_GLUON_FP8=1 (the default): the triton FP8 path's GEMMs go to `gluon_gemm1_swiglu_fp8` and
    `gluon_gemm2_weighted_fp8` where they can run (stood in for here by the fp32 twins, the refusal
    checks answering "can"), and the call equals the one on the Triton GEMMs; switched off, or where
    they cannot run, the Triton GEMMs run."""
    import moekit.experts.fp8 as experts_fp8

    calls = []

    def twin_gemm1(xq, xs, gate_up, align, top_k, *, ue8m0=False):
        calls.append(1)
        return gemm1_swiglu_fp8_torch(xq, xs, gate_up, align, top_k, ue8m0=ue8m0)

    def twin_gemm2(hq, hs, down, weights, align, out_dtype):
        calls.append(2)
        return gemm2_weighted_fp8_torch(hq, hs, down, weights, align).to(out_dtype)

    monkeypatch.setattr(experts_fp8, "gluon_gemm1_swiglu_fp8", twin_gemm1)
    monkeypatch.setattr(experts_fp8, "gluon_gemm2_weighted_fp8", twin_gemm2)
    num_experts, hidden, inter, top_k, tokens = 5, 256, 128, 2, 13
    gu, ids, x, _ = fp8_case(tokens, num_experts, hidden, inter, top_k, 64)
    dn = quantize_experts(torch.randn(num_experts, hidden, inter) / inter**0.5)
    w = torch.rand(tokens, top_k)
    standin = [Fp8Weight(t.data.to(STANDIN_DTYPE), t.scale) for t in (gu, dn)]
    cfg = experts_fp8.ExpertsConfig(64, 128, 64, 4, 2, 64, 64, 4, 2, 4)
    monkeypatch.setenv(experts_fp8.GLUON_FP8_ENV, "0")
    base = experts_fp8.experts_triton_fp8(x, *standin, w, ids, config=cfg)
    cases = (("1", "", True), ("1", "needs e4m3", False), ("0", "", False), (None, "", True))
    for switch, can, used in cases:
        if switch is None:                                  # unset: on by default
            monkeypatch.delenv(experts_fp8.GLUON_FP8_ENV)
        else:
            monkeypatch.setenv(experts_fp8.GLUON_FP8_ENV, switch)
        for which in ("gluon_gemm1_fp8_problem", "gluon_gemm2_fp8_problem"):
            monkeypatch.setattr(experts_fp8, which, lambda *a, reason=can: reason)
        calls.clear()
        with _workspace.poisoning():
            out = experts_fp8.experts_triton_fp8(x, *standin, w, ids, config=cfg)
        assert calls == ([1, 2] if used else []), (switch, can)
        assert rel_err(out, base) < 1e-3, (switch, can, rel_err(out, base))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dual", [True, False], ids=["dual", "pingpong"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gluon_gemm2_fp8_equals_its_twin_gpu(case, dual):
    """y at every placed pair's row against `gemm2_weighted_fp8_torch` on the twin's own hq, hs (real
    e4m3), in bf16: within 2x the twin's own rounding to bf16; reproducible bit for bit."""
    name, num_tokens, num_experts, hidden, inter, top_k, block_m, ue8m0, _ = case
    gu, ids, x, align = fp8_case(num_tokens, num_experts, hidden, inter, top_k, block_m, "cuda", ue8m0=ue8m0)
    down = quantize_experts(torch.randn(num_experts, hidden, inter, device="cuda") / inter**0.5, ue8m0=ue8m0)
    w = torch.rand(num_tokens, top_k, device="cuda")
    xq, xs = quantize_rows(x.to(torch.bfloat16), ue8m0=ue8m0)
    hq, hs = gemm1_swiglu_fp8_torch(xq, xs, gu, align, top_k, ue8m0=ue8m0)
    with _workspace.poisoning():
        y = gluon_gemm2_weighted_fp8(hq, hs, down, w, align, torch.bfloat16, dual=dual)
    want = gemm2_weighted_fp8_torch(hq, hs, down, w, align)
    placed = ids.reshape(-1) < num_experts
    err = rel_err(y[placed].float(), want[placed])
    base = rel_err(want[placed].bfloat16().float(), want[placed])     # the twin's own rounding to bf16
    assert err <= 2 * base, (err, base)
    again = gluon_gemm2_weighted_fp8(hq, hs, down, w, align, torch.bfloat16, dual=dual)
    assert torch.equal(again[placed], y[placed])
