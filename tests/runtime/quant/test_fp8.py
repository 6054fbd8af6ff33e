"""Block-scaled FP8 experts: the quantizers, the FP8 grouped GEMMs and decode kernels against their
fp32 twins, the whole path against the fp32 oracle (`experts_fp8_torch`) within 2x the error of
plain PyTorch in the same dtype with the same quantization, the bad-input contract, torch.compile.

On the CPU the kernels run under Triton's interpreter on float16 stand-ins holding e4m3 values
(`moekit.quant.STANDIN_DTYPE`: the interpreter has no e4m3 dot); tests marked gpu run real e4m3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from moekit import GatedActivation, _workspace, moe_experts
from moekit.align import align_block_size
from moekit.decode import (
    DecodeConfig,
    GemvTiles,
    decode_gemm1_swiglu_torch,
    decode_gemm2_sum_torch,
    experts_decode,
    use_decode_direct,
)
from moekit.experts.fp8 import experts_triton_fp8
from moekit.grouped_gemm.fp8 import (
    experts_fp8_torch,
    gemm1_swiglu_fp8,
    gemm1_swiglu_fp8_torch,
    gemm2_weighted_fp8,
    gemm2_weighted_fp8_torch,
)
from moekit.masked import masked_experts, masked_experts_fp8_torch
from moekit.quant import (
    FP8_DTYPE,
    STANDIN_DTYPE,
    Fp8Weight,
    check_fp8_scales,
    dequantize_rows,
    quantize_experts,
    quantize_rows,
    quantize_rows_torch,
)
from moekit.reference import moe_experts_ref
from moekit.tuning import ExpertsConfig, check_fp8_config, fp8_tiles

HAS_CUDA = torch.cuda.is_available()
E4M3_MAX = 448.0


def standin(w: Fp8Weight) -> Fp8Weight:
    """The same e4m3 values held in float16 (exact), for the interpreter's kernels."""
    return Fp8Weight(w.data.to(STANDIN_DTYPE), w.scale)


def make_weights(num_experts, hidden, inter, device="cpu", *, ue8m0=False):
    gu = torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5
    dn = torch.randn(num_experts, hidden, inter, device=device) / inter**0.5
    return quantize_experts(gu, ue8m0=ue8m0), quantize_experts(dn, ue8m0=ue8m0)


def routing(num_tokens, num_experts, top_k, *, dtype=torch.int32, device="cpu", empty_expert=True):
    """(weights, ids): K distinct experts per token; the last expert gets none when K < E."""
    pool = num_experts - 1 if empty_expert and top_k < num_experts else num_experts
    ids = torch.rand(num_tokens, pool).argsort(dim=1)[:, :top_k].to(dtype).contiguous()
    return torch.rand(num_tokens, top_k).to(device), ids.to(device)


# ---- plain PyTorch in x's dtype, with its own quantizer (no moekit code): the 2x rule's baseline


def _quant_rows_plain(v: torch.Tensor) -> torch.Tensor:
    """v (T, K) quantized per row per 128 columns to e4m3 and back, in fp32."""
    t, k = v.shape
    g = v.float().reshape(t, k // 128, 128)
    s = (g.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-10 / E4M3_MAX)
    return ((g / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * s).reshape(t, k)


def _dequant_plain(w: Fp8Weight) -> torch.Tensor:
    e, n, k = w.data.shape
    s = w.scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return w.data.float() * s.reshape(e, n, k)


def experts_fp8_same_dtype(x, gu, dn, w, ids):
    dtype = x.dtype
    xq = _quant_rows_plain(x).to(dtype)
    wg, wd = _dequant_plain(gu).to(dtype), _dequant_plain(dn).to(dtype)
    inter = wd.shape[2]
    out = torch.zeros_like(x)
    for slot in range(ids.shape[1]):
        contrib = torch.zeros_like(out)
        for e in range(wg.shape[0]):
            rows = torch.nonzero(ids[:, slot].long() == e)[:, 0]
            if rows.numel():
                a = xq[rows] @ wg[e].T
                h = _quant_rows_plain(F.silu(a[:, :inter]) * a[:, inter:]).to(dtype)
                contrib[rows] = ((h @ wd[e].T).float() * w[rows, slot].float()[:, None]).to(dtype)
        out = out + contrib
    return out


def fp8_bound(x, gu, dn, w, ids, ref) -> float:
    base = rel_err(experts_fp8_same_dtype(x, gu, dn, w, ids), ref)
    assert math.isfinite(base)
    return 2 * base


# ---- quantizers


def test_e4m3_rounding_of_the_standin_equals_the_cast_on_every_value_and_tie():
    """Rows whose amax is 448 have scale 1: the kernel's arithmetic e4m3 rounding must equal torch's
    cast on every e4m3 value, every midpoint between two (ties to even) and values around them."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.rand(700) * 896 - 448])
    vals = vals.clamp(-E4M3_MAX, E4M3_MAX)
    pad = (-vals.numel()) % 127
    vals = torch.cat([vals, torch.zeros(pad)]).view(-1, 127)
    x = torch.cat([torch.full((vals.shape[0], 1), E4M3_MAX), vals], 1)        # (R, 128), amax 448
    q, s = quantize_rows(x, dtype=STANDIN_DTYPE)
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(q.float(), x.to(FP8_DTYPE).float())


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("rows,cols", [(1, 128), (7, 384), (13, 256), (0, 128)], ids=str)
def test_quantize_rows_kernel_equals_its_twin_bit_for_bit(rows, cols, ue8m0):
    x = torch.randn(rows, cols) * torch.logspace(-4, 4, max(rows, 1))[:rows, None]
    if rows > 2:
        x[1] = 0.0                                             # an all-zero row: scale floor, values 0
        x[2, :5] = torch.tensor([1e30, -1e30, 3.0, 0.0, -7.0]).clamp(-6e4, 6e4)
        x[2, 5:8] = torch.tensor([-0.0, -1e-4, 1e-4])        # signed zeros: -0, and what rounds to it
    with _workspace.poisoning():
        q, s = quantize_rows(x.half(), ue8m0=ue8m0, dtype=STANDIN_DTYPE)
    qt, st = quantize_rows_torch(x.half(), ue8m0=ue8m0, dtype=STANDIN_DTYPE)
    assert torch.equal(s, st) and torch.equal(q.view(torch.int16), qt.view(torch.int16))    # bits: -0 too
    if rows:
        assert q.abs().max() <= E4M3_MAX and bool((s > 0).all())
        if ue8m0:
            assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))      # powers of two
        err = rel_err(dequantize_rows(q, s), x.half().float())
        assert err < 0.04                                       # e4m3: 3 mantissa bits


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_quantizers_carry_nan_and_inf_into_the_group(ue8m0):
    """A NaN or an infinity reaches its group's scale (and values), in the kernel as in the twin, so
    the row's output is NaN, never a finite wrong number; the row's other groups are untouched."""
    x = torch.randn(5, 384)
    x[1, 5], x[2, 130], x[3, 300] = math.nan, math.inf, -math.inf
    with _workspace.poisoning():
        q, s = quantize_rows(x.half(), ue8m0=ue8m0, dtype=STANDIN_DTYPE)
    qt, st = quantize_rows_torch(x.half(), ue8m0=ue8m0, dtype=STANDIN_DTYPE)
    torch.testing.assert_close(s, st, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(q, qt, rtol=0, atol=0, equal_nan=True)
    bad = ~torch.isfinite(dequantize_rows(q, s)).view(5, 3, 128).all(-1)
    assert bad.tolist() == [[False] * 3, [True, False, False], [False, True, False], [False, False, True],
                            [False] * 3]


def test_fp8_nan_in_one_token_stays_in_its_row():
    """RELIABILITY 12 on FP8 weights: a NaN in one token's hidden state gives that token's output row
    NaN and leaves every other row as without it (grouped, masked and decode paths)."""
    num_experts, hidden, inter, top_k = 4, 256, 128, 2
    gu, dn = make_weights(num_experts, hidden, inter)
    for tokens, run in ((9, lambda x, w, ids: experts_triton_fp8(x, standin(gu), standin(dn), w, ids,
                                                                config=CFGS["plain"])),
                        (9, lambda x, w, ids: moe_experts(x, gu, dn, w, ids, backend="masked")),
                        (2, lambda x, w, ids: experts_triton_fp8(x, standin(gu), standin(dn), w, ids))):
        x = torch.randn(tokens, hidden, dtype=torch.float16)
        w, ids = routing(tokens, num_experts, top_k)
        x[1, 7] = 0.0
        with torch.no_grad():
            clean = run(x, w, ids)
            x[1, 7] = math.nan
            out = run(x, w, ids)
        assert torch.isnan(out[1]).all()
        others = [t for t in range(tokens) if t != 1]
        assert torch.isfinite(clean).all() and torch.equal(out[others], clean[others])


def test_quantize_experts_block_scales():
    w = torch.randn(3, 256, 384) * torch.logspace(-3, 3, 3)[:, None, None]
    w[1, :128, 128:256] = 0.0
    q = quantize_experts(w.bfloat16())
    assert q.data.dtype == FP8_DTYPE and q.scale.shape == (3, 2, 3) and q.scale.dtype == torch.float32
    blocks = w.bfloat16().float().view(3, 2, 128, 3, 128).abs().amax((2, 4))
    assert torch.equal(q.scale[blocks > 0], (blocks / E4M3_MAX)[blocks > 0])
    assert torch.equal(q.dequantize()[1, :128, 128:256], torch.zeros(128, 128))
    assert rel_err(q.dequantize(), w.bfloat16().float()) < 0.04
    u = quantize_experts(w, ue8m0=True)
    assert torch.equal(torch.frexp(u.scale).mantissa, torch.full_like(u.scale, 0.5))
    assert bool((u.scale >= blocks / E4M3_MAX).all())
    # the least power of two at or above amax / 448: below twice it, and amax / 448 itself where exact
    blocks32 = w.view(3, 2, 128, 3, 128).abs().amax((2, 4))
    assert bool((u.scale < 2 * blocks32 / E4M3_MAX)[blocks32 > 0].all())
    exact = torch.zeros(1, 128, 256)
    exact[0, 3, 7], exact[0, 5, 200] = E4M3_MAX / 8, E4M3_MAX / 8 * 1.01
    assert quantize_experts(exact, ue8m0=True).scale.flatten().tolist() == [0.125, 0.25]


def test_ue8m0_row_scales_are_the_least_power_of_two_above():
    """Activation groups whose amax / 448 is a power of two keep it as their UE8M0 scale, one just
    above rounds up to the next, in the kernel as in its twin."""
    x = torch.randn(3, 256) * 0.01
    x[0, 10], x[1, 140], x[2, 0] = E4M3_MAX / 4, -E4M3_MAX / 4 * 1.01, E4M3_MAX / 2
    with _workspace.poisoning():
        _, s = quantize_rows(x.half(), ue8m0=True, dtype=STANDIN_DTYPE)
    _, st = quantize_rows_torch(x.half(), ue8m0=True, dtype=STANDIN_DTYPE)
    assert s[0, 0].item() == 0.25 and s[1, 1].item() == 0.5 and s[2, 0].item() == 0.5
    torch.testing.assert_close(s, st, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["loop", "triton", "masked"])
@pytest.mark.parametrize("tokens,experts", [(0, 2), (6, 0)], ids=["no-tokens", "no-experts"])
def test_fp8_nothing_routed_gives_zeros(backend, tokens, experts):
    """No pair reaches an expert (T = 0, or E = 0 with every id ignored: an expert-parallel rank
    holding none): every FP8 backend returns the fp32 reference's zeros, also into a poisoned out=,
    as the dense path and the `moekit::experts_fp8` op do."""
    x = torch.randn(tokens, 128)
    gate_up = quantize_experts(torch.randn(experts, 256, 128))
    down = quantize_experts(torch.randn(experts, 128, 128))
    ids = torch.tensor([[0, -1], [1, 2], [-1, -1], [3, 0], [5, 1], [2, 4]], dtype=torch.int32)[:tokens]
    w = torch.rand(tokens, 2)
    ref = moe_experts_ref(x, gate_up.dequantize(), down.dequantize(), w, ids)
    got = moe_experts(x, gate_up, down, w, ids, backend=backend, ignore_invalid_ids=True)
    assert got.shape == x.shape and torch.equal(got, ref)
    out = torch.full_like(x, math.nan)
    assert moe_experts(x, gate_up, down, w, ids, backend=backend, ignore_invalid_ids=True, out=out) is out
    assert torch.equal(out, ref)


def test_quantize_experts_of_a_parameter_gives_inference_weights():
    """Quantizing has no derivative: a trainable parameter gives data and scales outside autograd
    (those of its detached values, bit for bit), which an inference call then takes with grad mode on
    (only the inputs' requires_grad counts)."""
    gate_up = torch.nn.Parameter(torch.randn(4, 256, 128) / 128**0.5)
    down = torch.nn.Parameter(torch.randn(4, 128, 128) / 128**0.5)
    qgu, qdn = quantize_experts(gate_up), quantize_experts(down)
    assert not any(t.requires_grad for t in (qgu.data, qgu.scale, qdn.data, qdn.scale))
    plain = quantize_experts(gate_up.detach())
    assert torch.equal(qgu.data.float(), plain.data.float()) and torch.equal(qgu.scale, plain.scale)
    x, w, ids = torch.randn(3, 128), torch.rand(3, 2), torch.tensor([[0, 1], [2, 0], [3, 3]])
    out = moe_experts(x, qgu, qdn, w, ids, backend="loop")
    with torch.no_grad():
        expected = moe_experts(x, plain, quantize_experts(down.detach()), w, ids, backend="loop")
    assert not out.requires_grad and torch.equal(out, expected)


def fp8_call_with(config: ExpertsConfig) -> torch.Tensor:
    """An FP8 triton call (H = I = 256: two scale blocks deep) with the given tiles."""
    gate_up, down = quantize_experts(torch.randn(2, 512, 256)), quantize_experts(torch.randn(2, 256, 256))
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    return moe_experts(torch.randn(2, 256), gate_up, down, torch.rand(2, 2), ids, backend="triton",
                       config=config)


@pytest.mark.parametrize("bad,match", [
    (lambda: quantize_experts(torch.randn(2, 100, 128)), "N divisible by 128"),
    (lambda: quantize_experts(torch.randn(2, 128, 130)), "K divisible by 128"),
    (lambda: quantize_experts(torch.full((1, 128, 128), float("nan"))), "NaN"),
    (lambda: Fp8Weight(torch.zeros(1, 128, 128, dtype=FP8_DTYPE), torch.ones(1, 1, 2)),
     "scale must be float32"),
    (lambda: Fp8Weight(torch.zeros(1, 128, 128, dtype=torch.bfloat16), torch.ones(1, 1, 1)), "float8_e4m3fn"),
    (lambda: Fp8Weight(torch.zeros(1, 128, 128, dtype=FP8_DTYPE), torch.ones(1, 1, 1, dtype=torch.float64)),
     "float32"),
    (lambda: check_fp8_scales("gate_up_proj", Fp8Weight(torch.zeros(1, 128, 128, dtype=FP8_DTYPE),
                                                       torch.full((1, 1, 1), float("inf")))), "finite"),
    (lambda: check_fp8_config(ExpertsConfig(16, 64, 128)), "block_n1 must be 128"),
    (lambda: check_fp8_config(ExpertsConfig(16, 128, 256)), "block_k1 must be 32, 64 or 128"),
    (lambda: check_fp8_config(ExpertsConfig(16, 128, 128, block_k2=256)), "block_k2 must be 32, 64 or 128"),
    (lambda: fp8_call_with(ExpertsConfig(16, 128, 128, block_k2=256)), "block_k2 must be 32, 64 or 128"),
], ids=["rows", "cols", "nan-weights", "scale-shape", "bf16-as-fp8", "scale-dtype", "inf-scale", "config",
        "config-k1-256", "config-k2-256", "call-k2-256"])
def test_bad_fp8_input_names_the_argument(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        bad()


# ---- kernels against their twins (stand-ins under the interpreter)

CFGS = {
    "plain": fp8_tiles(ExpertsConfig(16, 64, 64, 4, 2, 64, 64, 4, 2, 4)),
    "paired": fp8_tiles(ExpertsConfig(16, 64, 64, 4, 2, 128, 64, 4, 2, 4, pair_blocks=2)),
    "persistent-k64": ExpertsConfig(32, 128, 64, 4, 2, 64, 64, 4, 2, 4, persistent=True),
    # 256-column down tiles over H = 384: the second runs past H into the next expert's rows
    "tma": fp8_tiles(ExpertsConfig(16, 64, 64, 4, 2, 256, 64, 4, 2, 4, tma_weights=True)),
    "tma-paired-persistent": fp8_tiles(ExpertsConfig(16, 64, 64, 4, 2, 128, 64, 4, 2, 4, pair_blocks=2,
                                                     tma_weights=True, persistent=True)),
}


@pytest.mark.parametrize("cfg", list(CFGS), ids=list(CFGS))
def test_fp8_gemms_equal_their_twins(cfg):
    cfg = CFGS[cfg]
    num_experts, hidden, inter, top_k, tokens = 5, 384, 256, 2, 23
    gu, dn = make_weights(num_experts, hidden, inter)
    w, ids = routing(tokens, num_experts, top_k)
    xq, xs = quantize_rows_torch(torch.randn(tokens, hidden), dtype=STANDIN_DTYPE)
    align = align_block_size(ids, num_experts, cfg.block_m)
    with _workspace.poisoning():
        hq, hs = gemm1_swiglu_fp8(xq, xs, standin(gu), align, top_k, cfg)
    hq_t, hs_t = gemm1_swiglu_fp8_torch(xq, xs, gu, align, top_k)
    live = int(align.num_padded)
    assert rel_err(dequantize_rows(hq[:live], hs[:live]), dequantize_rows(hq_t[:live], hs_t[:live])) < 1e-3
    with _workspace.poisoning():
        y = gemm2_weighted_fp8(hq_t, hs_t, standin(dn), w, align, cfg, torch.float32)
    placed = (ids.reshape(-1) < num_experts)
    assert rel_err(y[placed], gemm2_weighted_fp8_torch(hq_t, hs_t, dn, w, align)[placed]) < 1e-5


SLOT_GROUPS = DecodeConfig(gemv2=GemvTiles(block_n=8, block_k=128), slots2=8)
STEP_SUMS = DecodeConfig(GemvTiles(block_n=16, block_k=256, step_sum=True),
                         GemvTiles(block_n=4, block_k=128, step_sum=True), slots2=4)


@pytest.mark.parametrize("tiles", [DecodeConfig(), SLOT_GROUPS, STEP_SUMS],
                         ids=["one-slot", "slot-groups", "step-sums"])
def test_fp8_decode_kernels_scale_the_weights_in_registers(tiles):
    num_experts, hidden, inter, top_k = 6, 256, 128, 4
    gu, dn = make_weights(num_experts, hidden, inter)
    x = torch.randn(3, hidden)
    w, ids = routing(3, num_experts, top_k, dtype=torch.int64)
    ids[1, 2] = -1
    out = torch.full((3, hidden), float("nan"))
    with _workspace.poisoning():
        experts_decode(x, standin(gu).data, standin(dn).data, w, ids, out, tiles, scales=(gu.scale, dn.scale))
    h = decode_gemm1_swiglu_torch(x, gu.dequantize(), ids)
    ref = decode_gemm2_sum_torch(h, dn.dequantize(), w, ids)
    assert rel_err(out, ref) < 1e-5


# ---- the whole path: edge cases of the bf16 contract, against the fp32 oracle


CASES = {
    "T1-K1": (1, 1, 4, torch.int32),
    "T0": (0, 2, 4, torch.int32),
    "prime-T-int64": (31, 2, 5, torch.int64),
    "K=E": (9, 4, 4, torch.int32),
    "one-expert": (17, 1, 4, torch.int32),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fp8_experts_within_twice_plain_pytorch(case):
    tokens, top_k, num_experts, id_dtype = CASES[case]
    hidden, inter = 256, 128
    gu, dn = make_weights(num_experts, hidden, inter)
    x = torch.randn(tokens, hidden, dtype=torch.float16)
    w, ids = routing(tokens, num_experts, top_k, dtype=id_dtype)
    if case == "one-expert":
        ids.fill_(2)
    with torch.no_grad(), _workspace.poisoning():
        masked = moe_experts(x, gu, dn, w, ids, backend="masked")        # w8a8 at every size
    assert masked.shape == x.shape and masked.dtype == x.dtype
    if tokens:
        ref = experts_fp8_torch(x, gu, dn, w, ids)
        assert rel_err(masked, ref) <= fp8_bound(x, gu, dn, w, ids, ref)
    for cfg in (None, CFGS["paired"]):
        with torch.no_grad(), _workspace.poisoning():
            out = experts_triton_fp8(x, standin(gu), standin(dn), w, ids, config=cfg)
        assert out.shape == x.shape and out.dtype == x.dtype
        if tokens == 0:
            continue
        ref = experts_fp8_torch(x, gu, dn, w, ids)
        if cfg is None and use_decode_direct(tokens, top_k, num_experts, fp8=True):    # decode: w8a16
            ref = decode_gemm2_sum_torch(decode_gemm1_swiglu_torch(x, gu.dequantize(), ids), dn.dequantize(),
                                         w, ids)
            assert rel_err(out, ref) < 2e-3                         # fp16 output rounding
            continue
        assert rel_err(out, ref) <= fp8_bound(x, gu, dn, w, ids, ref)


def test_fp8_triton_backend_on_the_cpu_takes_real_e4m3_weights():
    """backend='triton' on the CPU with e4m3 weights (the interpreter has no e4m3 dot): the same
    result as on their float16 stand-ins, within the 2x rule of the oracle."""
    gu, dn = make_weights(4, 256, 128)
    x = torch.randn(9, 256, dtype=torch.float16)
    w, ids = routing(9, 4, 2)
    with torch.no_grad():
        out = moe_experts(x, gu, dn, w, ids, backend="triton", config=CFGS["plain"])
        standins = experts_triton_fp8(x, standin(gu), standin(dn), w, ids, config=CFGS["plain"])
    ref = experts_fp8_torch(x, gu, dn, w, ids)
    assert torch.equal(out, standins) and rel_err(out, ref) <= fp8_bound(x, gu, dn, w, ids, ref)


def test_fp8_ids_outside_the_experts_contribute_zero():
    num_experts, hidden, inter, top_k = 4, 128, 128, 2
    gu, dn = make_weights(num_experts, hidden, inter)
    x = torch.randn(20, hidden)
    w, ids = routing(20, num_experts, top_k, empty_expert=False)
    ids[0, 0], ids[5, 1], ids[7, 0] = -1, num_experts, 2**31 - 1
    with torch.no_grad():
        out = experts_triton_fp8(x, standin(gu), standin(dn), w, ids, config=CFGS["plain"])
        via_moe = moe_experts(x, gu, dn, w, ids, backend="loop", ignore_invalid_ids=True)
        masked = moe_experts(x, gu, dn, w, ids, backend="masked", ignore_invalid_ids=True)
    keep = ids.clone()
    ref = experts_fp8_torch(x, gu, dn, w, keep)
    assert rel_err(out, ref) < 1e-5 and rel_err(via_moe, ref) < 1e-6 and rel_err(masked, ref) < 1e-5
    with pytest.raises(ValueError, match=r"must lie in \[0, num_experts=4\)"):
        moe_experts(x, gu, dn, w, ids, backend="loop")


def test_moe_experts_fp8_contract():
    gu, dn = make_weights(4, 128, 128)
    x = torch.randn(3, 128)
    w, ids = routing(3, 4, 2)
    with pytest.raises(ValueError, match="takes no FP8 weights"):
        moe_experts(x, gu, dn, w, ids, backend="grouped_mm")
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_experts(x, gu, dn, w, ids, backend="loop", capacity_factor=1.0)
    with pytest.raises(ValueError, match="activation: not available with FP8"):
        moe_experts(x, gu, dn, w, ids, backend="loop", activation="gpt_oss")
    plain = moe_experts(x, gu, dn, w, ids, backend="loop")           # SwiGLU named is what runs anyway
    for act in ("swiglu", GatedActivation()):
        assert torch.equal(moe_experts(x, gu, dn, w, ids, backend="loop", activation=act), plain)
    with pytest.raises(TypeError, match="Fp8Weight"):
        moe_experts(x, gu, dn.dequantize(), w, ids)
    with pytest.raises(ValueError, match="down_proj must have shape"):
        moe_experts(x, gu, quantize_experts(torch.randn(4, 128, 256)), w, ids)
    with pytest.raises(RuntimeError, match="inference only"):
        moe_experts(x.requires_grad_(), gu, dn, w, ids)
    nan_scales = Fp8Weight(gu.data, gu.scale.clone().fill_(float("nan")))
    with pytest.raises(ValueError, match="gate_up_proj.scale must be finite"):
        moe_experts(x.detach(), nan_scales, dn, w, ids)
    # weights that require grad: an error naming them on every backend, never an output cut off from
    # the graph (nn.Parameter data, or a scale quantized from one)
    x = x.detach()
    grad_scale = Fp8Weight(dn.data, dn.scale.clone().requires_grad_())
    grad_data = Fp8Weight(torch.nn.Parameter(gu.data.half(), requires_grad=True).to(FP8_DTYPE), gu.scale)
    for backend in ("loop", "masked", "triton"):
        with pytest.raises(RuntimeError, match="inference only.*down_proj requires grad"):
            moe_experts(x, gu, grad_scale, w, ids, backend=backend)
        with pytest.raises(RuntimeError, match="inference only.*gate_up_proj requires grad"):
            moe_experts(x, grad_data, dn, w, ids, backend=backend)
        with torch.no_grad():
            assert not moe_experts(x, grad_data, grad_scale, w, ids, backend=backend).requires_grad
    # out= may share memory with no input, an Fp8Weight's scale included
    buf = torch.empty(dn.scale.numel() + x.numel())
    aliased = Fp8Weight(dn.data, buf[:dn.scale.numel()].view_as(dn.scale).copy_(dn.scale))
    for backend in ("loop", "masked", "triton"):
        with pytest.raises(ValueError, match="out must not share memory with down_proj.scale"):
            moe_experts(x, gu, aliased, w, ids, backend=backend, out=buf[:x.numel()].view_as(x))


def test_fp8_under_torch_compile():
    from torch._dynamo.testing import CompileCounterWithBackend

    gu, dn = make_weights(4, 128, 128)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x, w, ids: moe_experts(x, gu, dn, w, ids, backend="loop"), backend=counter,
                       fullgraph=True, dynamic=True)
    for tokens in (3, 9):
        x = torch.randn(tokens, 128)
        w, ids = routing(tokens, 4, 2)
        with torch.no_grad():
            assert rel_err(fn(x, w, ids), experts_fp8_torch(x, gu, dn, w, ids)) < 1e-6
    assert counter.frame_count == 1


# ---- the masked layout (`moekit.masked`): the FP8 GEMMs over (E, C, H) buffers


def masked_fp8_same_dtype(x_masked, counts, gu, dn, row_weights):
    """Plain PyTorch in x's dtype with its own quantizer, on the masked layout: (E, C, H), rows past
    the counts 0."""
    dtype = x_masked.dtype
    wg, wd = _dequant_plain(gu).to(dtype), _dequant_plain(dn).to(dtype)
    inter = wd.shape[2]
    y = torch.zeros(*x_masked.shape[:2], wd.shape[1], dtype=dtype, device=x_masked.device)
    for e, n in enumerate(counts.long().clamp(0, x_masked.shape[1]).tolist()):
        if n:
            a = _quant_rows_plain(x_masked[e, :n]).to(dtype) @ wg[e].T
            h = _quant_rows_plain(F.silu(a[:, :inter]) * a[:, inter:]).to(dtype)
            rows = (h @ wd[e].T).float()
            if row_weights is not None:
                rows = rows * row_weights[e, :n].float()[:, None]
            y[e, :n] = rows.to(dtype)
    return y


MASKED_COUNTS = {                       # C = 7 rows an expert
    "empty-and-full": ([0, 7, 3], torch.int32),
    "past-C-and-negative-int64": ([9, -2, 7], torch.int64),
    "all-on-one": ([0, 7, 0], torch.int32),
    "one-row": ([1, 0, 0], torch.int64),
}
MASKED_FP8_TILES = (None, ExpertsConfig(block_m=16, block_n1=128, block_k1=128, warps1=4, stages1=2,
                                        block_n2=64, block_k2=32, warps2=4, stages2=2))


def check_masked_fp8(case, weighted, ue8m0, device, dtype):
    """masked_experts on FP8 weights against its fp32 twin, within 2x plain PyTorch in dtype over the
    rows in use; rows past the counts hold NaN in x and stay unwritten in out."""
    counts_list, count_dtype = MASKED_COUNTS[case]
    num_experts, cap, hidden, inter = 3, 7, 256, 128
    gu, dn = make_weights(num_experts, hidden, inter, device, ue8m0=ue8m0)
    counts = torch.tensor(counts_list, dtype=count_dtype, device=device)
    used = counts.long().clamp(0, cap).tolist()
    x = torch.randn(num_experts, cap, hidden, dtype=dtype, device=device)
    for e, n in enumerate(used):
        x[e, n:] = float("nan")
    rw = torch.rand(num_experts, cap, device=device) if weighted else None
    ref = masked_experts_fp8_torch(x, counts, gu, dn, rw, ue8m0=ue8m0)
    plain = masked_fp8_same_dtype(x, counts, gu, dn, rw)
    pick = torch.arange(cap, device=device)[None, :] < torch.tensor(used, device=device)[:, None]   # (E, C)
    bound = 2 * rel_err(plain[pick], ref[pick])
    for cfg in MASKED_FP8_TILES:
        out = torch.full((num_experts, cap, hidden), float("nan"), dtype=dtype, device=device)
        with torch.no_grad(), _workspace.poisoning():
            y = masked_experts(x, counts, gu, dn, rw, config=cfg, validate=False, out=out,
                               ue8m0_scales=ue8m0)
        assert y is out
        for e, n in enumerate(used):
            assert torch.isnan(y[e, n:]).all()                   # rows past the count: unwritten
        assert torch.isfinite(y[pick]).all() and rel_err(y[pick], ref[pick]) <= bound


@pytest.mark.parametrize("case", list(MASKED_COUNTS))
@pytest.mark.parametrize("weighted,ue8m0", [(False, False), (True, True)], ids=["plain", "weighted-ue8m0"])
def test_masked_fp8_within_twice_plain_pytorch(case, weighted, ue8m0):
    check_masked_fp8(case, weighted, ue8m0, "cpu", torch.float16)


def test_masked_fp8_tiles():
    """The masked FP8 tiles: one scale block a step and a GEMM1 column tile, at most 64 rows, 8 warps
    for GEMM1 from 32 rows, pipeline stages within the shared memory budget."""
    from moekit.masked import masked_fp8_tiles
    from moekit.tuning import pipeline_bytes, shared_memory_budget

    for block_m in (16, 32, 128):
        cfg = masked_fp8_tiles(ExpertsConfig(block_m=block_m, block_n1=64, block_k1=64, warps1=4, stages1=4,
                                             block_n2=256, block_k2=64, warps2=4, stages2=4), "cpu")
        assert (cfg.block_n1, cfg.block_k1, cfg.block_k2) == (128, 128, 128)
        assert cfg.block_m == min(block_m, 64) and cfg.warps1 == (4 if block_m < 32 else 8)
        budget = shared_memory_budget("cpu")
        assert pipeline_bytes(cfg, 2, 1) <= budget and pipeline_bytes(cfg, 2, 2) <= budget


def test_masked_fp8_contract():
    gu, dn = make_weights(3, 128, 128)
    x = torch.randn(3, 4, 128)
    counts = torch.tensor([1, 0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="down_proj must be an moekit.quant.Fp8Weight"):
        masked_experts(x, counts, gu, dn.dequantize())
    with pytest.raises(TypeError, match="gate_up_proj must be an moekit.quant.Fp8Weight"):
        masked_experts(x, counts, gu.dequantize(), dn)
    with pytest.raises(ValueError, match="down_proj must have shape"):
        masked_experts(x, counts, gu, quantize_experts(torch.randn(3, 128, 256)))
    with pytest.raises(ValueError, match="block_k1 must be 128"):
        masked_experts(x, counts, gu, dn, config=ExpertsConfig(block_n1=128, block_k1=64, block_k2=64))
    with pytest.raises(ValueError, match="block_n1 must be 128"):
        masked_experts(x, counts, gu, dn, config=ExpertsConfig(block_n1=64, block_k1=128, block_k2=64))
    with pytest.raises(ValueError, match=r"counts must lie in \[0, C=4\]"):
        masked_experts(x, torch.tensor([5, 0, 0]), gu, dn)
    with pytest.raises(RuntimeError, match="inference only"):
        masked_experts(x.clone().requires_grad_(), counts, gu, dn)
    with pytest.raises(RuntimeError, match="gate_up_proj requires grad"):
        masked_experts(x, counts, Fp8Weight(gu.data, gu.scale.clone().requires_grad_()), dn)
    buf = torch.empty(x.numel())
    aliased = Fp8Weight(gu.data, buf[:gu.scale.numel()].view_as(gu.scale).copy_(gu.scale))
    with pytest.raises(ValueError, match="out must not share memory with gate_up_proj.scale"):
        masked_experts(x, counts, aliased, dn, out=buf.view_as(x))
    inf_scales = Fp8Weight(dn.data, dn.scale.clone().fill_(float("inf")))
    with pytest.raises(ValueError, match="down_proj.scale must be finite"):
        masked_experts(x, counts, gu, inf_scales)
    w, ids = routing(3, 3, 2)
    with pytest.raises(ValueError, match="capacity_factor: not available with FP8"):
        moe_experts(x[0, :3], gu, dn, w, ids, backend="masked", capacity_factor=1.0)


# ---- the GPU: real e4m3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 256, 1024, 4099])
def test_fp8_experts_gpu(tokens):
    num_experts, hidden, inter, top_k = 32, 1024, 384, 8
    gu, dn = make_weights(num_experts, hidden, inter, "cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w, ids = routing(tokens, num_experts, top_k, device="cuda")
    with torch.no_grad(), _workspace.poisoning():
        out = moe_experts(x, gu, dn, w, ids)
        forced = moe_experts(x, gu, dn, w, ids, config=CFGS["paired"])
    ref = experts_fp8_torch(x, gu, dn, w, ids)
    assert rel_err(forced, ref) <= fp8_bound(x, gu, dn, w, ids, ref)
    if use_decode_direct(tokens, top_k, num_experts, fp8=True):   # the decode path: w8a16, dequantized
        h = decode_gemm1_swiglu_torch(x, gu.dequantize(), ids)
        assert rel_err(out, decode_gemm2_sum_torch(h, dn.dequantize(), w, ids)) < 1e-2
    else:
        assert rel_err(out, ref) <= fp8_bound(x, gu, dn, w, ids, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_fp8_nan_in_one_token_stays_in_its_row_gpu(tokens):
    gu, dn = make_weights(8, 256, 128, "cuda")
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    w, ids = routing(tokens, 8, 2, device="cuda")
    for backend in ("triton", "masked"):
        x[0, 7] = 0.0
        with torch.no_grad():
            clean = moe_experts(x, gu, dn, w, ids, backend=backend)
            x[0, 7] = math.nan
            out = moe_experts(x, gu, dn, w, ids, backend=backend)
        assert torch.isnan(out[0]).all(), backend
        assert torch.isfinite(clean).all() and torch.equal(out[1:], clean[1:]), backend


@pytest.mark.gpu
def test_fp8_quantize_rows_gpu_bit_for_bit():
    x = torch.randn(257, 2048, device="cuda", dtype=torch.bfloat16) * 3
    for ue8m0 in (False, True):
        q, s = quantize_rows(x, ue8m0=ue8m0)
        qt, st = quantize_rows_torch(x, ue8m0=ue8m0)
        assert q.dtype == FP8_DTYPE and torch.equal(s, st)
        assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8))
    x[1, 5], x[2, 130], x[3, 300] = math.nan, math.inf, -math.inf      # carried into the group, as the twin
    q, s = quantize_rows(x)
    qt, st = quantize_rows_torch(x)
    torch.testing.assert_close(s, st, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(q.float(), qt.float(), rtol=0, atol=0, equal_nan=True)
    assert s[1, 0].isnan() and s[2, 1].isinf() and s[3, 2].isinf()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_fp8_cuda_graph_replay_equals_eager(tokens):
    gu, dn = make_weights(16, 512, 256, "cuda")
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    w, ids = routing(tokens, 16, 4, device="cuda")
    with torch.no_grad():
        eager = moe_experts(x, gu, dn, w, ids)
        moe_experts(x, gu, dn, w, ids)                    # compiled and warm before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe_experts(x, gu, dn, w, ids)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(captured, moe_experts(x, gu, dn, w, ids))
    assert not torch.equal(captured, eager)


def test_fp8_calls_take_their_plan_from_the_one_planner():
    from moekit.experts.plan import DECODE, GROUPED, plan_triton_call

    gu, dn = make_weights(8, 256, 128)
    gu, dn = standin(gu), standin(dn)
    x = torch.randn(300, 256)
    _, ids = routing(300, 8, 2)
    plan = plan_triton_call(x, gu, dn, ids)
    cfg = plan.config
    assert plan.path == GROUPED and (cfg.block_n1, cfg.block_k1, cfg.block_k2) == (128, 128, 128)
    assert plan_triton_call(x[:1], gu, dn, ids[:1]).path == DECODE
    with pytest.raises(ValueError, match="block_n1 must be 128"):
        plan_triton_call(x, gu, dn, ids, config=ExpertsConfig())


@pytest.mark.gpu
def test_fp8_under_torch_compile_gpu():
    """The `moekit::experts_fp8` op on the triton kernels: one frame for every T (dynamic), equal to
    the eager call bit for bit (the same kernels and tiles)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    gu, dn = make_weights(16, 512, 256, "cuda")
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x, w, ids: moe_experts(x, gu, dn, w, ids), backend=counter, fullgraph=True,
                       dynamic=True)
    for tokens in (3, 40, 300):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        w, ids = routing(tokens, 16, 4, device="cuda")
        with torch.no_grad():
            assert torch.equal(fn(x, w, ids), moe_experts(x, gu, dn, w, ids))
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MASKED_COUNTS))
def test_masked_fp8_gpu(case):
    check_masked_fp8(case, True, False, "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 128])
def test_masked_backend_fp8_gpu_graph_replay(tokens):
    """The masked backend on real e4m3: within 2x plain bf16 PyTorch of the oracle; a captured call
    replays on new tokens as an eager call computes them."""
    gu, dn = make_weights(16, 512, 256, "cuda")
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    w, ids = routing(tokens, 16, 4, device="cuda")
    with torch.no_grad(), _workspace.poisoning():
        eager = moe_experts(x, gu, dn, w, ids, backend="masked")
    ref = experts_fp8_torch(x, gu, dn, w, ids)
    assert rel_err(eager, ref) <= fp8_bound(x, gu, dn, w, ids, ref)
    with torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe_experts(x, gu, dn, w, ids, backend="masked")
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(captured, moe_experts(x, gu, dn, w, ids, backend="masked"))
    assert not torch.equal(captured, eager)
