"""The direct decode path (`moekit.decode`, on unless MOEKIT_DECODE_DIRECT=0): each kernel against its
pure-PyTorch twin, the twins chained against the fp32 reference, the whole path by the 2x rule, and
the triton backend's decision (which calls take it, and that they honour out=, poisoned workspaces,
invalid ids, int32 / int64 ids, non-contiguous inputs). CPU: the Triton interpreter, fp32 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from helpers import aot_compile_check, distinct_topk_ids, poisoned, rel_err, same_dtype_bound
from moekit import ExpertsConfig, moe_experts
from moekit._workspace import poisoning
from moekit.decode import (
    DECODE_MAX_PAIRS,
    DECODE_MAX_PAIRS_FP8,
    DECODE_MAX_REREAD,
    DECODE_TILES,
    DEFAULT_DECODE,
    ENV_VAR,
    SMALL_DECODE,
    SMALL_DECODE_FP8,
    SMALL_DECODE_PAIRS,
    DecodeConfig,
    GemvTiles,
    decode_config,
    decode_gemm1_swiglu,
    decode_gemm1_swiglu_torch,
    decode_gemm2_sum,
    decode_gemm2_sum_torch,
    expected_rereads,
    experts_decode,
    use_decode_direct,
)
from moekit.reference import moe_experts_ref

SMALL = DecodeConfig.both(block_n=16, block_k=16, warps=1, stages=1)
CASES = [  # (T, E, H, I, K)
    (1, 8, 64, 48, 2),
    (3, 5, 37, 11, 3),       # prime sizes: masked K and N tails
    (2, 4, 32, 16, 4),       # top_k = E
    (4, 6, 24, 40, 1),       # top_k = 1
]


def make(num_tokens, num_experts, hidden, inter, top_k, dtype=torch.float32, ids_dtype=torch.int64,
         invalid=False):
    x = torch.randn(num_tokens, hidden).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=ids_dtype)
    if invalid:
        ids[::2, 0] = -1                                  # expert-parallel sentinels
        if ids_dtype == torch.int64:
            ids[1::2, -1] = 2**32 + 1                     # truncated to int32 this would be expert 1
        else:
            ids[1::2, -1] = num_experts
    return x, gate_up, down, torch.rand(num_tokens, top_k), ids


@pytest.mark.parametrize("invalid", [False, True], ids=["all-valid", "invalid"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_kernels_match_their_twins(case, invalid):
    x, gate_up, down, w, ids = make(*case, invalid=invalid)
    with poisoning():
        h = decode_gemm1_swiglu(x, gate_up, ids, SMALL)
        out = decode_gemm2_sum(h, down, w, ids, poisoned(x.shape, x.dtype, x.device), SMALL)
    h_ref = decode_gemm1_swiglu_torch(x, gate_up, ids)
    assert rel_err(h, h_ref) <= 1e-5                      # invalid pairs' rows: zeros, as the twin's
    assert rel_err(out, decode_gemm2_sum_torch(h, down, w, ids)) <= 1e-5
    chained = decode_gemm2_sum_torch(h_ref, down, w, ids)
    assert rel_err(chained, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_fp16_within_twice_torch_error_and_deterministic(case, ids_dtype):
    """fp16 only on CPU: the interpreter's fp32 -> bf16 stores round toward zero (about twice the
    error of round-to-nearest), so bf16 is checked compiled, in the gpu test below."""
    x, gate_up, down, w, ids = make(*case, dtype=torch.float16, ids_dtype=ids_dtype, invalid=True)
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    with poisoning():
        out = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, x.device), SMALL)
        again = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, x.device), SMALL)
    assert torch.equal(out, again)
    valid = (ids >= 0) & (ids < case[1])
    ids_ok = torch.where(valid, ids, 0).long()            # the same-dtype baseline wants ids in range
    assert rel_err(out, ref) <= same_dtype_bound(x, gate_up, down, torch.where(valid, w, 0.0), ids_ok, ref)


def test_the_default_tiles_on_a_qwen_like_row():
    """DEFAULT tiles (block_k 256) over H = 512, I = 96 (K tail in GEMV2): one token, eight experts."""
    x, gate_up, down, w, ids = make(1, 16, 512, 96, 8)
    out = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, x.device))
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_slot_groups_match_the_twin(case, slots):
    """GEMV2 over groups of slots (slots2 > 1; groups that run past K, invalid ids inside a group)."""
    x, gate_up, down, w, ids = make(*case, invalid=True)
    cfg = DecodeConfig(GemvTiles(block_n=16, block_k=16), GemvTiles(block_n=16, block_k=16), slots2=slots)
    h = decode_gemm1_swiglu_torch(x, gate_up, ids).to(x.dtype)
    out = decode_gemm2_sum(h, down, w, ids, poisoned(x.shape, x.dtype, x.device), cfg)
    assert rel_err(out, decode_gemm2_sum_torch(h, down, w, ids)) <= 1e-5


STEP_SUM = GemvTiles(block_n=16, block_k=16, warps=1, stages=1, step_sum=True)


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_step_sums_match_the_twins(case, slots):
    """step_sum: each step's products summed at once ([BN] accumulators), in both kernels, one slot
    at a time and in slot groups; K tails, invalid ids (beside valid ones: top_k > 1)."""
    x, gate_up, down, w, ids = make(*case, invalid=case[-1] > 1)
    cfg = DecodeConfig(STEP_SUM, STEP_SUM, slots2=slots)
    with poisoning():
        h = decode_gemm1_swiglu(x, gate_up, ids, cfg)
        out = decode_gemm2_sum(h, down, w, ids, poisoned(x.shape, x.dtype, x.device), cfg)
    assert rel_err(h, decode_gemm1_swiglu_torch(x, gate_up, ids)) <= 1e-5
    assert rel_err(out, decode_gemm2_sum_torch(h, down, w, ids)) <= 1e-5


def test_unrolled_loops_compute_the_same():
    x, gate_up, down, w, ids = make(*CASES[1], invalid=True)
    unrolled = DecodeConfig.both(block_n=16, block_k=16, warps=1, stages=1, unroll=2)
    out = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, x.device), unrolled)
    assert torch.equal(out, experts_decode(x, gate_up, down, w, ids, torch.empty_like(x), SMALL))


@pytest.fixture
def direct(monkeypatch):
    """The path switched on; records the calls that take the direct path."""
    import moekit.experts.triton as backend

    monkeypatch.setenv(ENV_VAR, "1")
    calls = []
    real = backend.experts_decode

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "experts_decode", spy)
    return calls


def test_the_switch(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")                  # 0: off
    assert not use_decode_direct(1, 8, 128)
    for on in (None, "1", ""):                        # unset (the default), 1 or empty: on
        if on is None:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, on)
        assert use_decode_direct(1, 8, 128) and use_decode_direct(DECODE_MAX_PAIRS // 8, 8, 128)
        assert not use_decode_direct(0, 8, 128) and not use_decode_direct(DECODE_MAX_PAIRS + 1, 1, 10**6)


def test_direct_path_only_where_experts_are_read_about_once():
    """Each pair reads its expert's weights: the direct path stops at DECODE_MAX_REREAD expected
    pairs per expert hit (uniform routing), E * (1 - (1 - K/E)^T) experts hit by T * K pairs."""
    for t, k, e in ((1, 8, 128), (3, 2, 8), (7, 8, 64), (5, 1, 1), (2, 12, 8)):
        hit = e * (1 - max(0.0, 1 - k / e) ** t)
        assert expected_rereads(t, k, e) == pytest.approx(t * k / hit)
    assert expected_rereads(1, 8, 128) == 1.0 and expected_rereads(3, 8, 8) == 3.0     # K = E: T
    # Per preset: Qwen3-30B-A3B (E 128, K 8) direct up to T = 8 (1.24 pairs per expert hit), OLMoE
    # (64, 8) up to 4, DeepSeek-V2-Lite (64, 6) up to 5, Mixtral 8x7B (8, 2) up to 2 (1.46 at T = 4).
    for (e, k), last in (((128, 8), 8), ((64, 8), 4), ((64, 6), 5), ((8, 2), 2)):
        assert [t for t in range(1, 65) if use_decode_direct(t, k, e)] == list(range(1, last + 1)), (e, k)
    assert expected_rereads(8, 8, 128) <= DECODE_MAX_REREAD < expected_rereads(4, 2, 8)
    assert not use_decode_direct(1, 1, 0)
    with pytest.raises(ValueError, match="num_tokens, top_k and num_experts >= 1"):
        expected_rereads(0, 8, 128)


def test_tiles_by_pairs():
    assert decode_config(1) == decode_config(SMALL_DECODE_PAIRS) == SMALL_DECODE
    assert decode_config(SMALL_DECODE_PAIRS + 1) == decode_config(DECODE_MAX_PAIRS) == DEFAULT_DECODE
    # FP8 weights: their own small tiles, up to their bound (at most SMALL_DECODE_PAIRS pairs)
    assert decode_config(1, fp8=True) == decode_config(SMALL_DECODE_PAIRS, fp8=True) == SMALL_DECODE_FP8
    assert DECODE_MAX_PAIRS_FP8 <= SMALL_DECODE_PAIRS and SMALL_DECODE_FP8 in DECODE_TILES
    assert SMALL_DECODE_FP8 != SMALL_DECODE
    assert GemvTiles(step_sum=True).label().endswith("r") and not GemvTiles().label().endswith("r")
    with pytest.raises(ValueError, match="GemvTiles.step_sum must be a bool"):
        GemvTiles(step_sum=1)


def test_experts_decode_runs_the_tiles_of_its_pair_count(monkeypatch):
    """cfg=None: both launches take `decode_config(T * K)`'s tiles (the ones the backend's plan picks)."""
    import moekit.decode as decode

    seen = []
    real1, real2 = decode.decode_gemm1_swiglu, decode.decode_gemm2_sum
    monkeypatch.setattr(decode, "decode_gemm1_swiglu", lambda *a, **k: seen.append(a[-1]) or real1(*a, **k))
    monkeypatch.setattr(decode, "decode_gemm2_sum", lambda *a, **k: seen.append(a[-1]) or real2(*a, **k))
    for num_tokens, tiles in ((2, SMALL_DECODE), (5, DEFAULT_DECODE)):     # 8 and 20 pairs
        x, gate_up, down, w, ids = make(num_tokens, 6, 32, 16, 4)
        seen.clear()
        out = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, x.device))
        assert seen == [tiles, tiles]
        assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_backend_takes_the_direct_path_with_out_and_poisoned_workspaces(direct, ids_dtype):
    # 1.14 pairs an expert hit (E = 32): the direct path
    x, gate_up, down, w, ids = make(3, 32, 40, 24, 4, ids_dtype=ids_dtype, invalid=True)
    x_nc = torch.randn(40, 3).T                          # non-contiguous hidden states and weights
    x_nc.copy_(x)
    w_nc = torch.rand(4, 3).T
    w_nc.copy_(w)
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    out = poisoned(x.shape, x.dtype, x.device)
    with poisoning():
        got = moe_experts(x_nc, gate_up, down, w_nc, ids, backend="triton", ignore_invalid_ids=True, out=out)
        fresh = moe_experts(x, gate_up, down, w, ids, backend="triton", ignore_invalid_ids=True)
    assert got is out and len(direct) == 2
    assert rel_err(out, ref) <= 1e-5 and torch.equal(out, fresh)


def test_backend_keeps_the_normal_path_where_the_direct_one_does_not_apply(direct):
    x, gate_up, down, w, ids = make(2, 16, 32, 16, 2)
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    # Too many pairs, too many pairs per expert (few experts), expert math, a call that needs
    # gradients, an explicit config: the four-kernel path.
    big = make(DECODE_MAX_PAIRS // 2 + 1, 64, 32, 16, 2)
    moe_experts(*big, backend="triton")
    few = make(4, 8, 32, 16, 2)                             # Mixtral-like: 1.46 pairs an expert hit
    assert rel_err(moe_experts(*few, backend="triton"), moe_experts_ref(*few)) <= 1e-5
    bias = torch.randn(16, 32) * 0.1
    biased = moe_experts(x, gate_up, down, w, ids, backend="triton", down_bias=bias)
    assert rel_err(biased, moe_experts_ref(x, gate_up, down, w, ids, down_bias=bias)) <= 1e-5
    xg = x.clone().requires_grad_()
    out = moe_experts(xg, gate_up, down, w, ids, backend="triton")
    out.sum().backward()
    assert xg.grad is not None and rel_err(out.detach(), ref) <= 1e-5
    empty = moe_experts(x[:0], gate_up, down, w[:0], ids[:0], backend="triton")
    assert empty.shape == (0, 32)
    tiled = moe_experts(x, gate_up, down, w, ids, backend="triton", config=ExpertsConfig())   # tiles named
    assert rel_err(tiled, ref) <= 1e-5
    assert direct == []
    assert rel_err(moe_experts(x, gate_up, down, w, ids, backend="triton"), ref) <= 1e-5
    assert len(direct) == 1


def test_decode_kernels_compile_for_sm90_without_spills():
    """tools/aot_compile_check.py --decode: both kernels of every tile set at the Qwen3-30B-A3B shape,
    on bf16 and on block-scaled e4m3 weights, through ptxas for sm_90, no local memory."""
    out = aot_compile_check("--decode", "all", "--regs")
    count = 2 * (len(DECODE_TILES) + 1)
    assert f"{count}/{count} decode variants compile" in out and "local" not in out


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 8])
@pytest.mark.parametrize("tiles", [DEFAULT_DECODE, *DECODE_TILES], ids=lambda c: c.label())
def test_gpu_graph_replay_equals_eager_and_the_2x_rule(qwen_layer, num_tokens, tiles, monkeypatch):
    """Compiled, bf16, Qwen3-30B-A3B: within 2x PyTorch's same-dtype error; a captured graph replays
    on new inputs and routing bit for bit as an eager call computes them."""
    from moekit.graphs import capture_graph

    shape = qwen_layer.shape
    gate_up, down = qwen_layer.gate_up_proj, qwen_layer.down_proj
    x = torch.randn(num_tokens, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    w, ids = qwen_layer.route(x)
    w, ids = w.contiguous(), ids.contiguous()
    out = experts_decode(x, gate_up, down, w, ids, poisoned(x.shape, x.dtype, "cuda"), tiles)
    ref = moe_experts_ref(x, gate_up, down, w, ids)
    assert rel_err(out, ref) <= same_dtype_bound(x, gate_up, down, w, ids, ref)
    graph, _ = capture_graph(lambda: experts_decode(x, gate_up, down, w, ids, out, tiles),
                             torch.device("cuda"))
    x.copy_(torch.randn_like(x))
    rerouted = torch.rand(num_tokens, shape.num_experts, device="cuda").argsort(1)[:, :ids.shape[1]]
    ids.copy_(rerouted.to(ids.dtype))
    w.copy_(torch.rand_like(w))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, experts_decode(x, gate_up, down, w, ids, torch.empty_like(x), tiles))
    if tiles == decode_config(ids.numel()):      # the backend, switched on, runs these launches
        monkeypatch.setenv(ENV_VAR, "1")
        assert torch.equal(out, moe_experts(x, gate_up, down, w, ids, backend="triton"))


def test_decode_config_rejects_bad_tiles():
    """Each bad field is named: block sizes must be powers of two, every knob a positive int."""
    with pytest.raises(ValueError, match=r"GemvTiles\.block_k must be a power of two"):
        GemvTiles(block_k=96)
    with pytest.raises(ValueError, match=r"GemvTiles\.warps must be a positive int"):
        GemvTiles(warps=0)
    with pytest.raises(ValueError, match=r"DecodeConfig\.slots2 must be a power of two"):
        DecodeConfig(slots2=3)
    with pytest.raises(ValueError, match=r"DecodeConfig\.gemv1 must be a GemvTiles"):
        DecodeConfig(gemv1=(16, 256))
    assert DecodeConfig.both(8, 256, 4, 3).label() == "n8k256w4s3u1/n8k256w4s3u1"
