"""Each grouped GEMM kernel against its pure-PyTorch twin (`moekit.grouped_gemm.*_torch`), and the
twins, chained, against the whole-path fp32 reference (so a twin cannot drift from the maths).

CPU (Triton interpreter, float32; float16 for the TMA-weights path) with poisoned workspaces; rows a
kernel must not write (padding rows past num_padded, pairs never placed) are left out of the
comparison. The `gpu` tests run the TMA-weights path compiled, in bf16 (`pytest -m gpu -k tma`);
without a GPU, tools/aot_compile_check.py compiles the kernels for sm_90 (a subset here).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch

from helpers import aot_compile_check, distinct_topk_ids, poisoned, rel_err, same_dtype_bound
from moekit import ExpertsConfig, align_block_size, moe_experts
from moekit._workspace import poisoning
from moekit.activation import SWIGLU, GatedActivation
from moekit.bench.launches import patched_runs
from moekit.experts.triton import experts_triton
from moekit.graphs import capture_graph
from moekit.grouped_gemm import (
    _gemm1,
    gemm1_swiglu,
    gemm1_swiglu_torch,
    gemm1_swiglu_with_pre,
    gemm2_weighted,
    gemm2_weighted_torch,
    moe_sum,
    moe_sum_torch,
    resolve_tma,
    tma_supported,
)
from moekit.reference import moe_experts_ref
from moekit.tuning import fit_shared_memory, get_config, shared_memory_budget

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


def aligned(ids, num_experts, block_m):
    """(alignment, rows in use, mask of the pairs placed): the rows a kernel must write."""
    align = align_block_size(ids, num_experts, block_m, backend="torch")
    live = int(align.num_padded)
    placed = torch.zeros(ids.numel(), dtype=torch.bool)
    placed[align.sorted_ids[:live][align.sorted_ids[:live] < ids.numel()].long()] = True
    return align, live, placed


@pytest.mark.parametrize("cfg", [CFG, PAIRED], ids=["blocks", "paired"])
@pytest.mark.parametrize("invalid", [False, True], ids=["all-valid", "sentinels"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_kernels_match_their_twins(case, invalid, cfg):
    x, gate_up, down, w, ids = make(*case, invalid=invalid)
    num_experts, top_k = case[1], case[4]
    align, live, placed = aligned(ids, num_experts, cfg.block_m)
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
    align, live, placed = aligned(ids, num_experts, cfg.block_m)
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


# The training forward's GEMM1 (`gemm1_swiglu_with_pre`, STORE_PRE): h as without it, plus the [gate | up]
# pre-activations at the sorted rows, in every variant the forward runs (paired, TMA, persistent).


@pytest.fixture
def store_pre_variants(monkeypatch):
    """name -> config of every GEMM1 variant, persistent ones started as 3 programs (their loops
    iterate); with the TMA ones' descriptors built (checked in the test)."""
    import moekit.grouped_gemm as gg

    monkeypatch.setattr(gg, "num_sms", lambda device: 3)
    return {"blocks": CFG, "paired": PAIRED, "tma": dataclasses.replace(CFG, tma_weights=True),
            "persistent": dataclasses.replace(CFG, persistent=True),
            "persistent+paired+tma": dataclasses.replace(PAIRED, persistent=True, tma_weights=True)}


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("invalid", [False, True], ids=["all-valid", "sentinels"])
@pytest.mark.parametrize("case", CASES + [(23, 4, 40, 24, 4)], ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_gemm1_stores_the_pre_activations(case, invalid, id_dtype, store_pre_variants):
    num_tokens, num_experts, hidden, inter, top_k = case
    x, gate_up, down, w, ids = make(*case, invalid=invalid)
    ids = ids.to(id_dtype)
    if top_k == num_experts:                       # K = E: one slot of every token is a sentinel
        ids[:, -1] = -1
    for name, cfg in store_pre_variants.items():
        align, live, _ = aligned(ids, num_experts, cfg.block_m)
        with poisoning():
            h, pre = gemm1_swiglu_with_pre(x, gate_up, align, top_k, cfg)
            h_alone = gemm1_swiglu(x, gate_up, align, top_k, cfg)
        assert pre.shape == (align.sorted_ids.numel(), 2 * inter) and pre.is_contiguous(), name
        assert torch.equal(h[:live], h_alone[:live]), name              # STORE_PRE changes nothing else
        want = gemm1_swiglu_torch(x, gate_up, align, top_k, swiglu=False)
        assert rel_err(pre[:live], want[:live]) <= 1e-5, name
        padding = align.sorted_ids[:live] >= ids.numel()
        assert torch.equal(pre[:live][padding], torch.zeros_like(pre[:live][padding])), name


def test_gemm1_stores_the_pre_activations_in_float16(store_pre_variants):
    """Rounded once from the fp32 accumulators: within one fp16 rounding of the fp32 twin."""
    x, gate_up, down, w, ids = make_tma(13, 5, 40, 24, 2, torch.float16, invalid=True)
    for name, cfg in store_pre_variants.items():
        align, live, _ = aligned(ids, 5, cfg.block_m)
        with poisoning():
            _, pre = gemm1_swiglu_with_pre(x, gate_up, align, 2, cfg)
        want = gemm1_swiglu_torch(x, gate_up, align, 2, swiglu=False)[:live]
        assert pre.dtype == torch.float16
        assert rel_err(pre[:live], want) <= 2 * rel_err(want.half(), want), name


def test_gemm1_stores_the_pre_activations_of_plain_swiglu_only():
    x, gate_up, down, w, ids = make(5, 4, 32, 16, 2)
    align = align_block_size(ids, 4, CFG.block_m, backend="torch")
    with pytest.raises(ValueError, match="plain SwiGLU only"):
        _gemm1(x, gate_up, align, 2, CFG, swiglu=True, bias=torch.zeros(4, 32), activation=SWIGLU,
               interleaved=False, store_pre=True)
    for kwargs in ({"interleaved": True}, {"activation": GatedActivation("gpt_oss")}, {"swiglu": False}):
        args = {"swiglu": True, "bias": None, "activation": SWIGLU, "interleaved": False, **kwargs}
        with pytest.raises(ValueError, match="plain SwiGLU only"):
            _gemm1(x, gate_up, align, 2, CFG, store_pre=True, **args)


# TMA weights (`ExpertsConfig.tma_weights`): the interpreter emulates tensor descriptors (Triton >= 3.4),
# so the descriptor path runs here in fp32 and fp16; its compiled form runs in the gpu tests below.

TMA = dataclasses.replace(CFG, tma_weights=True)
TMA_PAIRED = dataclasses.replace(PAIRED, tma_weights=True)
TMA_CASES = [  # (T, E, H, I, K): rows 16-byte aligned in fp16 and fp32 (H, I multiples of 8)
    (7, 8, 64, 48, 2),
    (1, 4, 32, 16, 4),
    (13, 5, 40, 24, 1),      # N tails: H = 40 and I = 24 are not multiples of 16 (rows of the next
    (40, 3, 24, 40, 3),      # half or expert read and dropped; zeros past the last expert), K tails
]


def make_tma(num_tokens, num_experts, hidden, inter, top_k, dtype, invalid=False):
    """`make`'s inputs in `dtype`, with expert 0 (not the last) left without tokens: the last
    expert's tiles reach past the end of the weights."""
    x, gate_up, down, w, ids = make(num_tokens, num_experts, hidden, inter, top_k, invalid)
    if top_k < num_experts:
        ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=torch.int64, avoid=0)
        if invalid:
            ids[::3, 0] = -1
    return x.to(dtype), gate_up.to(dtype), down.to(dtype), w, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cfg", [TMA, TMA_PAIRED], ids=["blocks", "paired"])
@pytest.mark.parametrize("invalid", [False, True], ids=["all-valid", "sentinels"])
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_tma_weights_match_the_twins_and_the_pointer_path(case, invalid, cfg, dtype, descriptors):
    x, gate_up, down, w, ids = make_tma(*case, dtype, invalid=invalid)
    num_experts, top_k = case[1], case[4]
    align, live, placed = aligned(ids, num_experts, cfg.block_m)
    pointer = dataclasses.replace(cfg, tma_weights=False)
    with poisoning():
        h = gemm1_swiglu(x, gate_up, align, top_k, cfg)
        y = gemm2_weighted(h, down, w, align, cfg)
        assert descriptors == [[16, 16], [16, 16]]
        h_ptr = gemm1_swiglu(x, gate_up, align, top_k, pointer)
        y_ptr = gemm2_weighted(h, down, w, align, pointer)
    assert len(descriptors) == 2                           # the pointer path built none
    tol = 1e-5 if dtype == torch.float32 else 2e-3         # fp16 outputs: one rounding (2**-11)
    assert rel_err(h[:live], gemm1_swiglu_torch(x, gate_up, align, top_k)[:live]) <= tol
    assert rel_err(y[placed], gemm2_weighted_torch(h, down, w, align)[placed]) <= tol
    # Both paths feed the same values to the dot (here bit for bit; NumPy may order a transposed
    # operand's sums differently, so within the tolerance in general).
    assert torch.equal(h[:live], h_ptr[:live]) or rel_err(h[:live], h_ptr[:live]) <= tol
    assert torch.equal(y[placed], y_ptr[placed]) or rel_err(y[placed], y_ptr[placed]) <= tol


@pytest.mark.parametrize("case", TMA_CASES[:3], ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_tma_weights_whole_path_fp16_within_twice_torch_error(case, descriptors):
    """The triton backend with tma_weights in fp16 against the fp32 reference, by the 2x rule."""
    x, gate_up, down, w, ids = make_tma(*case, torch.float16, invalid=True)
    w = w.to(torch.float16)
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    with poisoning():
        out = experts_triton(x, gate_up, down, w, ids, config=TMA)
    assert len(descriptors) == 2
    assert rel_err(out, ref) <= same_dtype_bound(x, gate_up, down, w, ids, ref)


def test_tma_weights_on_an_empty_batch_and_a_single_token(descriptors):
    x, gate_up, down, w, ids = make_tma(1, 4, 32, 16, 2, torch.float32)
    out = experts_triton(x, gate_up, down, w, ids, config=TMA)
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5
    empty = experts_triton(x[:0], gate_up, down, w[:0], ids[:0], config=TMA)
    assert empty.shape == (0, 32)


# The fallback decision: where TMA cannot read the weights, the pointer path runs.


def test_tma_supported_and_the_fallback_decision(monkeypatch):
    import moekit.grouped_gemm as gg

    w = torch.randn(4, 32, 40)                             # fp32 rows of 160 bytes
    assert tma_supported(w) and tma_supported(w.half(), 16, 16) and tma_supported(w.bfloat16())
    assert not tma_supported(torch.randn(4, 32, 37))       # fp32 rows of 148 bytes: not 16-aligned
    assert not tma_supported(torch.randn(4, 32, 36).half())  # fp16 rows of 72 bytes
    assert not tma_supported(w.transpose(1, 2))            # not contiguous (the backward's gate_up^T)
    assert not tma_supported(torch.randn(4 * 32 * 40 + 1)[1:].view(4, 32, 40))   # base off by 4 bytes
    assert not tma_supported(w.double())
    assert not tma_supported(w[:0])
    assert not tma_supported(w, block_n=512) and not tma_supported(w, block_k=512)
    assert not tma_supported(w.half(), 16, 4)              # a box row of 8 bytes
    monkeypatch.setattr(gg, "TensorDescriptor", None)     # a Triton without tensor descriptors
    assert not tma_supported(w)


def test_device_without_tma_falls_back(monkeypatch):
    import moekit.grouped_gemm as gg

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not gg._device_has_tma(torch.device("cpu"))
    monkeypatch.setattr(gg, "_cuda_capability_major", lambda index: 8)     # Ampere
    assert not gg._device_has_tma(torch.device("cuda", 0))
    monkeypatch.setattr(gg, "_cuda_capability_major", lambda index: 9)     # Hopper
    assert gg._device_has_tma(torch.device("cuda", 0))


def test_resolve_tma_records_the_fallback_and_the_backend_uses_it(descriptors):
    x, gate_up, down, w, ids = make(7, 4, 37, 16, 2)       # H = 37: gate_up rows not 16-aligned
    assert not tma_supported(gate_up) and tma_supported(down, 16, 16)
    assert resolve_tma(TMA, gate_up, down) == CFG
    assert resolve_tma(CFG, gate_up, down) is CFG
    aligned = make_tma(7, 4, 32, 16, 2, torch.float32)
    assert resolve_tma(TMA, aligned[1], aligned[2]) is TMA
    assert resolve_tma(dataclasses.replace(TMA, block_n2=512), aligned[1], aligned[2]).tma_weights is False
    with poisoning():
        out = experts_triton(x, gate_up, down, w, ids, config=TMA)
    assert descriptors == []                               # both GEMMs took the pointer path
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5
    # A direct launch decides per weight: GEMM2 alone can use TMA here.
    align = align_block_size(ids, 4, TMA.block_m, backend="torch")
    h = gemm1_swiglu(x, gate_up, align, 2, TMA)
    gemm2_weighted(h, down, w, align, TMA)
    assert descriptors == [[16, 16]]


# On the GPU (H200): the compiled descriptor path, bf16 at the Qwen3-30B-A3B shape.


@pytest.fixture(scope="module")
def qwen_layer(qwen_layer):
    """conftest's layer, on a GPU with TMA only."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU with TMA (capability >= 9)")
    return qwen_layer


def qwen_case(layer, num_tokens):
    """(x, the expert path's arguments, the fp32 reference, 2x plain bf16 PyTorch's error): T tokens
    routed by the layer."""
    x = torch.randn(num_tokens, layer.shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = layer.route(x)
    args = (x, layer.gate_up_proj, layer.down_proj, w, ids)
    ref = moe_experts_ref(*args)
    return x, args, ref, same_dtype_bound(*args, ref)


def _tma_configs(shape, num_tokens):
    """Pointer configs (TMA off; the caller makes their TMA twins): the table's config and its
    paired-tile form."""
    base = dataclasses.replace(get_config(shape, num_tokens, torch.bfloat16, "cuda"), tma_weights=False)
    paired = fit_shared_memory(dataclasses.replace(base, pair_blocks=2), 2, shared_memory_budget("cuda"))
    return {"table": base, "paired": paired}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["table", "paired"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000, 4096])
def test_tma_weights_bf16_qwen3(qwen_layer, num_tokens, variant, descriptors):
    """The TMA path against the fp32 reference (2x plain bf16 PyTorch's error), and against the
    pointer path (bit for bit, or within the same bound)."""
    shape = qwen_layer.shape
    x, args, ref, bound = qwen_case(qwen_layer, num_tokens)
    pointer = _tma_configs(shape, num_tokens)[variant]
    tma = dataclasses.replace(pointer, tma_weights=True)
    assert resolve_tma(tma, qwen_layer.gate_up_proj, qwen_layer.down_proj) == tma, "no TMA on this GPU"
    out_ptr = experts_triton(*args, config=pointer, out=poisoned(x.shape, x.dtype, "cuda"))
    out = experts_triton(*args, config=tma, out=poisoned(x.shape, x.dtype, "cuda"))
    assert len(descriptors) == 2
    err = rel_err(out, ref)
    assert err <= bound, f"T={num_tokens} {variant}: {err:.2e} > {bound:.2e} (2x plain bf16 PyTorch)"
    assert torch.equal(out, out_ptr) or rel_err(out, out_ptr) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(64, 64, 3), (128, 64, 4), (64, 128, 3)],
                         ids=lambda t: "n{}-k{}-s{}".format(*t))
def test_tma_weights_bf16_odd_shape_tails(tiles, descriptors):
    """N and K tails in compiled code: H = 200, I = 72 (neither a multiple of the blocks), the last
    expert routed to, an empty expert, sentinels; both GEMMs against their twins by the 2x rule."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU with TMA (capability >= 9)")
    block_n, block_k, stages = tiles
    x, gate_up, down, w, ids = (t.cuda() for t in make_tma(300, 6, 200, 72, 2, torch.float32, invalid=True))
    x, gate_up, down = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    cfg = ExpertsConfig(block_m=64, block_n1=block_n, block_k1=block_k, warps1=4, stages1=stages,
                        block_n2=block_n, block_k2=block_k, warps2=4, stages2=stages, group_m=4,
                        tma_weights=True)
    assert resolve_tma(cfg, gate_up, down) == cfg
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    bound = same_dtype_bound(x, gate_up, down, w, ids, ref)
    for c in (cfg, dataclasses.replace(cfg, block_m=32, pair_blocks=2)):
        out = experts_triton(x, gate_up, down, w, ids, config=c, out=poisoned(x.shape, x.dtype, "cuda"))
        assert rel_err(out, ref) <= bound, c
    assert len(descriptors) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("variant,num_tokens", [("tma", 512), ("persistent", 2048), ("persistent+tma", 2048)])
def test_replay_from_a_cuda_graph(qwen_layer, variant, num_tokens):
    """Host descriptors are encoded at launch, persistent kernels read the live tile count on the
    device: a captured graph replays on new inputs and new routing (16 experts: other tile counts)
    as an eager call computes them."""
    shape = qwen_layer.shape
    switches = {"tma_weights": "tma" in variant, "persistent": "persistent" in variant}
    cfg = dataclasses.replace(get_config(shape, num_tokens, torch.bfloat16, "cuda"), **switches)
    x = torch.randn(num_tokens, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    out = torch.empty_like(x)
    call = functools.partial(experts_triton, x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids,
                             config=cfg, out=out)
    graph, _ = capture_graph(call, torch.device("cuda"))
    x.copy_(torch.randn_like(x))
    skewed = torch.rand(ids.shape[0], 16, device="cuda").argsort(1)[:, :ids.shape[1]]
    ids.copy_(skewed.to(ids.dtype))
    w.copy_(torch.rand_like(w))
    graph.replay()
    torch.cuda.synchronize()
    eager = experts_triton(x, qwen_layer.gate_up_proj, qwen_layer.down_proj, w, ids, config=cfg)
    assert torch.equal(out, eager)


# Compiled for Hopper without a GPU: Triton's CUDA backend and ptxas, sm_90, bf16. The whole matrix
# (tiles x default / TMA / gpt-oss / interleaved) is `python tools/aot_compile_check.py`.


def test_forward_kernels_compile_for_sm90_ahead_of_time(tmp_path):
    """The default kernels, gpt-oss's (biases, interleaved rows) with TMA weights, the persistent
    ones and the training forward's GEMM1 (STORE_PRE, paired, persistent, TMA) compile for sm_90 as
    their launchers would launch them; the TMA kernels load the weights with TMA instructions
    (UTMALDG), the default kernels do not."""
    assert "4/4 variants compile" in aot_compile_check("--quick", "--dump", str(tmp_path))
    for kernel in ("moe_gemm1_swiglu_kernel", "moe_gemm2_kernel"):
        assert "UTMALDG" in (tmp_path / f"S.gpt-oss+tma.{kernel}.sass").read_text(), kernel
        assert "UTMALDG" not in (tmp_path / f"S.default.{kernel}.sass").read_text(), kernel


# Persistent kernels (`ExpertsConfig.persistent`): fewer programs than tiles, each looping over tiles.
# Off the GPU the launch takes `OFF_GPU_SMS` SMs; the `three_programs` fixture makes it 3, so the
# loops really iterate (checked on the launched grids). Each tile is computed as the one-tile-per-
# program kernels compute it: the outputs are bitwise equal to theirs.

PERSISTENT = dataclasses.replace(CFG, persistent=True)
PERSISTENT_PAIRED = dataclasses.replace(PAIRED, persistent=True)


@pytest.fixture
def three_programs(monkeypatch):
    """Persistent launches start at most 3 programs; yields the grids of the grouped GEMM launches,
    as (kernel name, programs, PERSISTENT)."""
    import moekit.grouped_gemm as gg

    monkeypatch.setattr(gg, "num_sms", lambda device: 3)
    grids = []

    def wrap(kernel, real):
        def spy(*args, grid, warmup, **kwargs):
            grids.append((kernel.__name__, grid[0], kwargs.get("PERSISTENT", False)))
            return real(*args, grid=grid, warmup=warmup, **kwargs)
        return spy

    with patched_runs((gg.moe_gemm1_swiglu_kernel, gg.moe_gemm2_kernel), wrap):
        yield grids


def test_spies_leave_the_kernels_as_they_were(three_programs):
    """After `moekit.bench.launches.patched_runs` the kernels launch through their class's `run`
    again, however it is patched later (no instance attribute left behind); inside, an enclosing spy
    is restored."""
    import moekit.grouped_gemm as gg

    kernels = (gg.moe_gemm1_swiglu_kernel, gg.moe_gemm2_kernel)
    outer = [k.__dict__["run"] for k in kernels]                 # three_programs' spies
    with patched_runs(kernels, lambda k, real: functools.partial(real)):
        assert all(k.__dict__["run"] is not o for k, o in zip(kernels, outer, strict=True))
    assert [k.__dict__["run"] for k in kernels] == outer
    with patched_runs((gg.moe_sum_kernel,), lambda k, real: real):
        pass
    assert "run" not in vars(gg.moe_sum_kernel)


def persistent_bound(align, cfg, n_tiles):
    """The tiles a persistent launch may loop over: row blocks (pairs of them when paired) x n_tiles."""
    blocks = align.max_blocks
    return (blocks + 1) // 2 * n_tiles if cfg.pair_blocks == 2 else blocks * n_tiles


@pytest.mark.parametrize("cfg", [PERSISTENT, PERSISTENT_PAIRED], ids=["blocks", "paired"])
@pytest.mark.parametrize("invalid", [False, True], ids=["all-valid", "sentinels"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_persistent_kernels_match_the_twins_and_the_one_tile_kernels(case, invalid, cfg, three_programs):
    x, gate_up, down, w, ids = make(*case, invalid=invalid)
    num_experts, hidden, inter, top_k = case[1], case[2], case[3], case[4]
    align, live, placed = aligned(ids, num_experts, cfg.block_m)
    one_tile = dataclasses.replace(cfg, persistent=False)
    with poisoning():
        h = gemm1_swiglu(x, gate_up, align, top_k, cfg)
        y = gemm2_weighted(h, down, w, align, cfg)
        h_one = gemm1_swiglu(x, gate_up, align, top_k, one_tile)
        y_one = gemm2_weighted(h, down, w, align, one_tile)
    h_ref = gemm1_swiglu_torch(x, gate_up, align, top_k)
    assert rel_err(h[:live], h_ref[:live]) <= 1e-5
    assert rel_err(y[placed], gemm2_weighted_torch(h_ref, down, w, align)[placed]) <= 1e-5
    assert torch.equal(h[:live], h_one[:live]) and torch.equal(y[placed], y_one[placed])
    bounds = [persistent_bound(align, cfg, -(-inter // cfg.block_n1)),
              persistent_bound(align, cfg, -(-hidden // cfg.block_n2))]
    assert [g[1:] for g in three_programs[:2]] == [(min(3, b), True) for b in bounds]
    blocks = len(align.expert_ids)
    assert three_programs[2:] == [("moe_gemm1_swiglu_kernel", blocks * -(-inter // 16), False),
                                  ("moe_gemm2_kernel", blocks * -(-hidden // 16), False)]


def test_the_persistent_loops_iterate_and_cover_every_tile(three_programs):
    """Many tiles per program (3 programs, dozens of tiles; paired: two row blocks per tile), every
    row of h and every placed row of y written (NaN-poisoned workspaces)."""
    x, gate_up, down, w, ids = make(40, 3, 24, 40, 3)
    for cfg in (PERSISTENT, PERSISTENT_PAIRED):
        del three_programs[:]
        align = align_block_size(ids, 3, cfg.block_m, backend="torch")
        with poisoning():
            h = gemm1_swiglu(x, gate_up, align, 3, cfg)
            y = gemm2_weighted(h, down, w, align, cfg)
        assert int(align.num_padded) // cfg.block_m >= 8             # >= 4 tiles per program
        assert [g[1] for g in three_programs] == [3, 3]
        assert not h[:int(align.num_padded)].isnan().any() and not y.isnan().any()
        assert rel_err(y, gemm2_weighted_torch(h, down, w, align)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cfg", [PERSISTENT, PERSISTENT_PAIRED], ids=["blocks", "paired"])
@pytest.mark.parametrize("case", TMA_CASES[2:], ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_persistent_kernels_with_tma_weights(case, cfg, dtype, descriptors, three_programs):
    """Persistent + TMA weights (N and K tails, sentinels, the last expert's tiles past the weights'
    end) against the twins and bitwise against the one-tile TMA kernels."""
    x, gate_up, down, w, ids = make_tma(*case, dtype, invalid=True)
    num_experts, top_k = case[1], case[4]
    tma = dataclasses.replace(cfg, tma_weights=True)
    align, live, placed = aligned(ids, num_experts, cfg.block_m)
    with poisoning():
        h = gemm1_swiglu(x, gate_up, align, top_k, tma)
        y = gemm2_weighted(h, down, w, align, tma)
        h_one = gemm1_swiglu(x, gate_up, align, top_k, dataclasses.replace(tma, persistent=False))
        y_one = gemm2_weighted(h, down, w, align, dataclasses.replace(tma, persistent=False))
    assert len(descriptors) == 4 and [g[2] for g in three_programs] == [True, True, False, False]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(h[:live], gemm1_swiglu_torch(x, gate_up, align, top_k)[:live]) <= tol
    assert rel_err(y[placed], gemm2_weighted_torch(h, down, w, align)[placed]) <= tol
    assert torch.equal(h[:live], h_one[:live]) and torch.equal(y[placed], y_one[placed])


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "concat"])
@pytest.mark.parametrize("cfg", [PERSISTENT, PERSISTENT_PAIRED], ids=["blocks", "paired"])
def test_persistent_gpt_oss_with_biases(cfg, interleaved, three_programs):
    """gpt-oss's expert math (biases, clamped activation) in the persistent kernels: the fp32
    reference, and the one-tile kernels bit for bit."""
    x, gate_up, down, w, ids = make(40, 3, 24, 40, 2, invalid=True)
    gate_up = gate_up * 6
    kw = dict(gate_up_bias=torch.randn(3, 80) * 3, down_bias=torch.randn(3, 24), activation="gpt_oss",
              interleaved=interleaved)
    ref = moe_experts_ref(x, gate_up, down, w, ids, **kw)
    out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=cfg, ignore_invalid_ids=True,
                      out=poisoned(x.shape, x.dtype, "cpu"), **kw)
    one = moe_experts(x, gate_up, down, w, ids, backend="triton", ignore_invalid_ids=True,
                      config=dataclasses.replace(cfg, persistent=False), **kw)
    assert rel_err(out, ref) <= 1e-5 and torch.equal(out, one)
    assert [g[2] for g in three_programs] == [True, True, False, False]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cfg", [PERSISTENT, PERSISTENT_PAIRED], ids=["blocks", "paired"])
def test_persistent_edge_cases(cfg, id_dtype, three_programs):
    """T = 0, T = 1, every pair on one expert, experts without tokens, invalid ids skipped
    (ignore_invalid_ids), odd N and K tails; NaN-poisoned outputs, the fp32 reference."""
    gate_up, down = torch.randn(5, 22, 37) / 37**0.5, torch.randn(5, 37, 11) / 11**0.5   # H 37, I 11
    run = functools.partial(moe_experts, gate_up_proj=gate_up, down_proj=down, backend="triton", config=cfg,
                            ignore_invalid_ids=True)

    def check(x, w, ids):
        out = run(x, topk_weights=w, topk_ids=ids, out=poisoned(x.shape, x.dtype, "cpu"))
        assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5 or x.shape[0] == 0
        return out

    assert check(torch.randn(0, 37), torch.rand(0, 2), torch.empty(0, 2, dtype=id_dtype)).shape == (0, 37)
    check(torch.randn(1, 37), torch.rand(1, 2), torch.tensor([[4, 1]], dtype=id_dtype))
    x = torch.randn(70, 37)                                     # 70 pairs on expert 3: five 16-row blocks
    check(x, torch.rand(70, 1), torch.full((70, 1), 3, dtype=id_dtype))
    ids = distinct_topk_ids(70, 5, 2, dtype=id_dtype)           # expert 4 empty
    ids[::4, 1] = -1
    ids[1::4, 0] = 5                                            # past E: skipped too
    out = check(x, torch.rand(70, 2), ids)
    assert not out.isnan().any()
    assert any(g[2] and g[1] == 3 for g in three_programs)     # some launch looped


def test_persistent_flatten_switch(monkeypatch, three_programs):
    """The experimental fused loops (PERSISTENT_FLATTEN) reach the kernels of persistent launches
    without paired tiles only; the interpreter runs the loops as written: same outputs."""
    import moekit.grouped_gemm as gg

    flags = []

    def wrap(kernel, real):
        def spy(*args, **kwargs):
            flags.append(kwargs["FLATTEN"])
            return real(*args, **kwargs)
        return spy

    with patched_runs((gg.moe_gemm1_swiglu_kernel, gg.moe_gemm2_kernel), wrap):
        x, gate_up, down, w, ids = make(40, 3, 24, 40, 3)
        plain = experts_triton(x, gate_up, down, w, ids, config=PERSISTENT)
        monkeypatch.setattr(gg, "PERSISTENT_FLATTEN", True)
        for cfg in (PERSISTENT, PERSISTENT_PAIRED, CFG):
            assert torch.equal(experts_triton(x, gate_up, down, w, ids, config=cfg), plain)
    assert flags == [False, False, True, True, False, False, False, False]


def test_persistent_program_count_off_the_gpu():
    import moekit.grouped_gemm as gg

    assert gg.num_sms(torch.device("cpu")) == gg.OFF_GPU_SMS
    assert gg.programs_per_sm(gg.moe_gemm1_swiglu_kernel, (), {}, torch.device("cpu")) == 1
    grids = []
    stub = lambda k, real: lambda *args, grid, warmup, **kwargs: grids.append(grid[0])  # noqa: E731
    x, gate_up, down, w, ids = make(40, 3, 24, 40, 3)
    with patched_runs((gg.moe_gemm2_kernel,), stub):
        for cfg in (PERSISTENT, PERSISTENT_PAIRED, CFG):
            align = align_block_size(ids, 3, cfg.block_m, backend="torch")
            gemm2_weighted(torch.zeros(align.sorted_ids.numel(), 40), down, w, align, cfg)
    assert grids == [gg.OFF_GPU_SMS, gg.OFF_GPU_SMS, len(align.expert_ids) * 2]


# Persistent kernels on the GPU (H200): compiled, bf16 at the Qwen3-30B-A3B shape.


def _persistent_configs(shape, num_tokens):
    """The table's config, and its paired-tile form, persistent; with TMA weights too."""
    table = get_config(shape, num_tokens, torch.bfloat16, "cuda")
    paired = fit_shared_memory(dataclasses.replace(table, pair_blocks=2), 2, shared_memory_budget("cuda"))
    unpaired = dataclasses.replace(table, pair_blocks=1, persistent=True)
    return {"table": dataclasses.replace(table, persistent=True),
            "table+tma": dataclasses.replace(table, persistent=True, tma_weights=True),
            "paired": dataclasses.replace(paired, persistent=True),
            "paired+tma": dataclasses.replace(paired, persistent=True, tma_weights=True),
            "flat": unpaired, "flat+tma": dataclasses.replace(unpaired, tma_weights=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["table", "table+tma", "paired", "paired+tma", "flat", "flat+tma"])
@pytest.mark.parametrize("num_tokens", [1, 64, 1000, 4096])
def test_persistent_bf16_qwen3(qwen_layer, num_tokens, variant, monkeypatch):
    """The persistent path against the fp32 reference (2x plain bf16 PyTorch's error) and against
    the one-tile kernels (bit for bit, or within the same bound); the launch starts no more
    programs than the device holds, without a warning (the occupancy was read). "flat": the
    experimental fused loops (PERSISTENT_FLATTEN)."""
    import moekit.grouped_gemm as gg

    monkeypatch.setattr(gg, "PERSISTENT_FLATTEN", variant.startswith("flat"))
    shape = qwen_layer.shape
    x, args, ref, bound = qwen_case(qwen_layer, num_tokens)
    cfg = _persistent_configs(shape, num_tokens)[variant]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="moekit: cannot tell how many programs")
        out = experts_triton(*args, config=cfg, out=poisoned(x.shape, x.dtype, "cuda"))
    one = experts_triton(*args, config=dataclasses.replace(cfg, persistent=False),
                         out=poisoned(x.shape, x.dtype, "cuda"))
    err = rel_err(out, ref)
    assert err <= bound, f"T={num_tokens} {variant}: {err:.2e} > {bound:.2e} (2x plain bf16 PyTorch)"
    assert torch.equal(out, one) or rel_err(out, one) <= bound
    assert all(1 <= v <= 32 for v in gg._RESIDENT.values())


@pytest.mark.gpu
def test_persistent_bf16_odd_shape_tails():
    """N and K tails in compiled code (H = 200, I = 72), an empty expert, sentinels, more tiles than
    programs (num_sms forced to 3): the persistent kernels by the 2x rule."""
    import moekit.grouped_gemm as gg

    x, gate_up, down, w, ids = (t.cuda() for t in make_tma(300, 6, 200, 72, 2, torch.float32, invalid=True))
    x, gate_up, down = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    bound = same_dtype_bound(x, gate_up, down, w, ids, ref)
    base = ExpertsConfig(block_m=64, block_n1=64, block_k1=64, warps1=4, stages1=3, block_n2=64, block_k2=64,
                         warps2=4, stages2=3, group_m=4, persistent=True)
    real = gg.num_sms
    gg.num_sms = lambda device: 3
    try:
        for cfg in (base, dataclasses.replace(base, block_m=32, pair_blocks=2),
                    dataclasses.replace(base, tma_weights=torch.cuda.get_device_capability()[0] >= 9)):
            out = experts_triton(x, gate_up, down, w, ids, config=cfg, out=poisoned(x.shape, x.dtype, "cuda"))
            assert rel_err(out, ref) <= bound, cfg
    finally:
        gg.num_sms = real
