"""Expert biases, gpt-oss's activation and interleaved gate/up rows (`moekit.activation`): the kernels
against their twins, every backend against the fp32 reference, bad arguments, gradients.

Oracles: `moekit.reference.moe_experts_ref` (fp32, written out, used by no backend) and
`helpers.experts_same_dtype` (plain PyTorch in the input dtype, Transformers' GptOssExperts math
written out). float32: 1e-5 relative; float16 (and bf16 on the GPU): at most 2x the error of plain
PyTorch in that dtype against fp32. Data: gate/up pre-activations spread over about +-20, so that
gpt-oss's clamp at limit 7 binds on both sides, and biases large enough to move every row (a dropped
or misplaced bias fails); inputs redrawn per test (seeded by its id), outputs and workspaces
NaN-poisoned.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import distinct_topk_ids, poisoned, rel_err, same_dtype_bound
from moekit import ExpertsConfig, GatedActivation, align_block_size, moe_experts, ops
from moekit._workspace import poisoning
from moekit.experts import ExpertsOptions, resolve_backend
from moekit.experts.triton import experts_triton
from moekit.grouped_gemm import (
    gemm1_swiglu,
    gemm1_swiglu_torch,
    gemm2_weighted,
    gemm2_weighted_torch,
    resolve_tma,
)
from moekit.reference import moe_experts_ref

SMALL = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                      block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)
PAIRED = dataclasses.replace(SMALL, pair_blocks=2)
TORCH_AND_TRITON = ("loop", "padded", "grouped_mm", "triton")
# (activation, interleaved): gpt-oss's own, and each half of it on its own.
MATH = [("gpt_oss", True), ("gpt_oss", False), ("swiglu", True)]


def make(num_tokens, num_experts, hidden, inter, top_k, dtype=torch.float32, *, sentinels=False):
    """x, gate_up (E, 2I, H), down (E, H, I), w, ids, gate_up_bias (E, 2I), down_bias (E, H). Expert
    E-1 gets no token when K < E (`distinct_topk_ids`)."""
    x = torch.randn(num_tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) * 6 / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=torch.int64)
    if sentinels:
        ids[::3, 0] = -1
    w = torch.rand(num_tokens, top_k)
    bias_gu, bias_down = torch.randn(num_experts, 2 * inter) * 3, torch.randn(num_experts, hidden)
    cast = [t.to(dtype) for t in (x, gate_up, down)]
    return (*cast, w, ids, bias_gu.to(dtype), bias_down.to(dtype))


def math_kwargs(activation: str, interleaved: bool, gate_up_bias, down_bias) -> dict:
    return dict(gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation,
                interleaved=interleaved)


CASES = [  # (T, E, H, I, K)
    (1, 4, 32, 16, 2),       # T = 1
    (13, 5, 37, 11, 1),      # prime sizes (masked K and N tails), top_k = 1
    (40, 3, 24, 40, 3),      # several blocks per expert, I > H, top_k = E (no empty expert)
    (7, 8, 64, 48, 2),       # the tiny preset: 7 experts hit at most, expert 7 empty
]


def kernels_against_twins(x, gate_up, down, w, ids, bias_gu, bias_down, cfg, act, interleaved):
    """GEMM1 and GEMM2 with the math under cfg, poisoned workspaces, against their fp32 twins
    (1e-5); padding rows of h exactly 0 (the bias kept out). Returns (placed pairs, GEMM2's twin)."""
    top_k = ids.shape[1]
    align = align_block_size(ids, gate_up.shape[0], cfg.block_m, backend="torch")
    live = int(align.num_padded)
    rows = align.sorted_ids[:live]
    placed = torch.zeros(ids.numel(), dtype=torch.bool)
    placed[rows[rows < ids.numel()].long()] = True
    with poisoning():
        h = gemm1_swiglu(x, gate_up, align, top_k, cfg, bias=bias_gu, activation=act, interleaved=interleaved)
        y = gemm2_weighted(h, down, w, align, cfg, bias=bias_down)
    h_ref = gemm1_swiglu_torch(x, gate_up, align, top_k, bias=bias_gu, activation=act,
                               interleaved=interleaved)
    assert rel_err(h[:live], h_ref[:live]) <= 1e-5
    padding = rows == ids.numel()
    assert torch.equal(h[:live][padding], torch.zeros_like(h[:live][padding]))
    y_ref = gemm2_weighted_torch(h_ref, down, w, align, bias=bias_down)
    assert rel_err(y[placed], y_ref[placed]) <= 1e-5
    return placed, y_ref


@pytest.mark.parametrize("math", MATH, ids=lambda m: f"{m[0]}-{'interleaved' if m[1] else 'concat'}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_kernels_match_their_twins(case, math):
    """GEMM1 (bias + activation epilogue) and GEMM2 (bias before the weight) against their twins
    in fp32, poisoned workspaces; padding rows of h exactly 0; the twins chained are the reference."""
    activation, interleaved = math
    x, gate_up, down, w, ids, bias_gu, bias_down = make(*case, sentinels=case[0] > 1)
    act = GatedActivation(activation)
    for cfg in ((SMALL, PAIRED) if case[0] == 40 else (SMALL,)):
        placed, y_ref = kernels_against_twins(x, gate_up, down, w, ids, bias_gu, bias_down, cfg, act,
                                              interleaved)
    # The twins chained (slot sum of the placed pairs) are the expert path of the reference.
    chained = torch.where(placed[:, None], y_ref, 0.0).view(case[0], case[4], -1).sum(1)
    kw = math_kwargs(activation, interleaved, bias_gu, bias_down)
    ref = moe_experts_ref(x, gate_up, down, w, ids, **kw)
    assert rel_err(chained, ref) <= 1e-5


def test_unfused_epilogue_stores_biased_pre_activations():
    """swiglu=False (the ablation's unfused GEMM1) stores [gate | up] with the bias added, interleaved
    rows split into the two halves."""
    x, gate_up, down, w, ids, bias_gu, _ = make(9, 4, 32, 16, 2)
    align = align_block_size(ids, 4, SMALL.block_m, backend="torch")
    live = int(align.num_padded)
    with poisoning():
        pre = gemm1_swiglu(x, gate_up, align, 2, SMALL, swiglu=False, bias=bias_gu, interleaved=True)
    want = gemm1_swiglu_torch(x, gate_up, align, 2, swiglu=False, bias=bias_gu, interleaved=True)
    valid = align.sorted_ids[:live] < ids.numel()
    assert rel_err(pre[:live][valid], want[:live][valid]) <= 1e-5


# TMA weights (`ExpertsConfig.tma_weights`) under the expert math: the descriptor path (emulated by
# the interpreter) feeds the same bias and activation epilogues; interleaved gate/up rows are read as
# one [2 BN, BK] box. Its compiled form for sm_90 is checked by tools/aot_compile_check.py.

TMA = dataclasses.replace(SMALL, tma_weights=True)
TMA_CASES = [  # (T, E, H, I, K): fp32 rows 16-byte aligned (H, I multiples of 4)
    (7, 8, 64, 48, 2),
    (13, 5, 40, 24, 1),      # N tails (H = 40, I = 24): the rows after a tile are read and dropped
    (40, 3, 24, 40, 3),      # several blocks per expert (paired tiles too), K tails
]


@pytest.mark.parametrize("math", MATH, ids=lambda m: f"{m[0]}-{'interleaved' if m[1] else 'concat'}")
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: "T{}-E{}-H{}-I{}-K{}".format(*c))
def test_tma_weights_with_the_math_match_their_twins(case, math, descriptors):
    """GEMM1 and GEMM2 with tma_weights, biases and the activation against their twins in fp32;
    expert 0 gets no token, so the last expert's tiles reach past the end of the weights."""
    activation, interleaved = math
    x, gate_up, down, w, _, bias_gu, bias_down = make(*case)
    ids = distinct_topk_ids(case[0], case[1], case[4], dtype=torch.int64, avoid=0)
    ids[::3, 0] = -1
    for cfg in ((TMA, dataclasses.replace(PAIRED, tma_weights=True)) if case[0] == 40 else (TMA,)):
        del descriptors[:]
        kernels_against_twins(x, gate_up, down, w, ids, bias_gu, bias_down, cfg, GatedActivation(activation),
                              interleaved)
        assert descriptors == [[32 if interleaved else 16, 16], [16, 16]]   # interleaved: a [2 BN, BK] box


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "concat"])
def test_tma_weights_gpt_oss_whole_path_fp16_within_twice_torch_error(interleaved, descriptors):
    """The triton backend with tma_weights and gpt-oss's math in fp16 against the fp32 reference."""
    x, gate_up, down, w, ids, bias_gu, bias_down = make(9, 6, 32, 24, 3, torch.float16, sentinels=True)
    w = w.half()
    kw = math_kwargs("gpt_oss", interleaved, bias_gu, bias_down)
    ref = moe_experts_ref(x, gate_up, down, w, ids, **kw)
    out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=TMA, ignore_invalid_ids=True,
                      out=poisoned(x.shape, x.dtype, "cpu"), **kw)
    assert len(descriptors) == 2
    assert rel_err(out, ref) <= same_dtype_bound(x, gate_up, down, w, ids, ref, **kw)


def test_tma_weights_fall_back_where_interleaved_rows_overflow_the_box(descriptors):
    """Interleaved gate_up needs a [2 * block_n1, BK] box: block_n1 = 256 exceeds TMA's 256 rows, so
    the resolved config runs the pointer path (for both GEMMs, as one decision), explicitly; the
    concatenated layout keeps TMA at that block; 128 interleaved (a 256-row box) keeps it too."""
    x, gate_up, down, w, ids, bias_gu, bias_down = make(5, 4, 32, 16, 2)
    wide = dataclasses.replace(TMA, block_n1=256)
    assert resolve_tma(wide, gate_up, down, interleaved=True) == dataclasses.replace(wide, tma_weights=False)
    assert resolve_tma(wide, gate_up, down) is wide
    at_limit = dataclasses.replace(TMA, block_n1=128)
    assert resolve_tma(at_limit, gate_up, down, interleaved=True) is at_limit
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    with poisoning():
        out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=wide, **kw)
    assert descriptors == []
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids, **kw)) <= 1e-5
    with poisoning():
        out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=at_limit, **kw)
    assert descriptors == [[256, 16], [16, 16]]
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids, **kw)) <= 1e-5


def test_tma_weights_skip_transposed_weights(descriptors):
    """Transformers' GptOssExperts weights are read through transposed views: not contiguous, so
    the pointer path runs (no descriptor), with the same result."""
    x, gate_up, down, w, ids, bias_gu, bias_down = make(6, 4, 32, 16, 2)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    assert resolve_tma(TMA, gate_up_t, down_t, interleaved=True).tma_weights is False
    out = moe_experts(x, gate_up_t, down_t, w, ids, backend="triton", config=TMA, **kw)
    assert descriptors == []
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids, **kw)) <= 1e-5


SHAPES = [  # (T, E, H, I, K)
    (1, 4, 32, 16, 2),       # T = 1
    (11, 5, 37, 11, 1),      # prime sizes, top_k = 1 (grouped_mm: unaligned, skipped)
    (9, 6, 32, 24, 3),       # expert 5 empty
]


def aligned(backend, hidden, inter, dtype):
    return backend != "grouped_mm" or (hidden * dtype.itemsize % 16 == 0 and inter * dtype.itemsize % 16 == 0)


@pytest.mark.parametrize("backend", TORCH_AND_TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-H{}-I{}-K{}".format(*s))
def test_gpt_oss_experts_match_reference(backend, dtype, shape):
    """gpt-oss's experts (biases, clamped activation, interleaved rows) on every backend that takes
    them, into a NaN-poisoned out= buffer."""
    if not aligned(backend, shape[2], shape[3], dtype):
        pytest.skip("grouped_mm needs 16-byte rows")
    x, gate_up, down, w, ids, bias_gu, bias_down = make(*shape, dtype)
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    ref = moe_experts_ref(x, gate_up, down, w, ids, **kw)
    out = poisoned(x.shape, dtype, "cpu")
    got = moe_experts(x, gate_up, down, w, ids, backend=backend, out=out,
                      **({"config": SMALL} if backend == "triton" else {}), **kw)
    assert got.data_ptr() == out.data_ptr() and out.dtype == dtype
    bound = 1e-5 if dtype == torch.float32 else same_dtype_bound(x, gate_up, down, w, ids, ref, **kw)
    assert rel_err(out, ref) <= bound, (rel_err(out, ref), bound)


@pytest.mark.parametrize("backend", TORCH_AND_TRITON)
def test_swiglu_with_biases_matches_reference(backend):
    x, gate_up, down, w, ids, bias_gu, bias_down = make(10, 4, 32, 16, 2)
    kw = math_kwargs("swiglu", False, bias_gu, bias_down)
    out = moe_experts(x, gate_up, down, w, ids, backend=backend, **kw,
                      **({"config": SMALL} if backend == "triton" else {}))
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids, **kw)) <= 1e-5


def test_one_bias_alone_and_custom_gate_parameters():
    x, gate_up, down, w, ids, bias_gu, bias_down = make(8, 4, 32, 16, 2)
    act = GatedActivation("gpt_oss", alpha=1.0, limit=2.5)
    for kw in (dict(gate_up_bias=bias_gu), dict(down_bias=bias_down)):
        ref = moe_experts_ref(x, gate_up, down, w, ids, activation="gpt_oss", alpha=1.0, limit=2.5, **kw)
        for backend in ("loop", "triton"):
            out = moe_experts(x, gate_up, down, w, ids, backend=backend, activation=act,
                              **({"config": SMALL} if backend == "triton" else {}), **kw)
            assert rel_err(out, ref) <= 1e-5, (backend, list(kw))


def test_zero_biases_are_bitwise_the_default_path():
    """The bias epilogues add exactly zero: the biased kernels give the default kernels' bits."""
    x, gate_up, down, w, ids, bias_gu, bias_down = make(9, 4, 32, 16, 2)
    plain = moe_experts(x, gate_up, down, w, ids, backend="triton", config=SMALL)
    biased = moe_experts(x, gate_up, down, w, ids, backend="triton", config=SMALL,
                         gate_up_bias=torch.zeros_like(bias_gu), down_bias=torch.zeros_like(bias_down))
    assert torch.equal(plain, biased)


@pytest.mark.parametrize("backend", TORCH_AND_TRITON)
def test_sentinel_pairs_get_no_bias(backend):
    """Ids outside [0, E) contribute exactly 0: no down bias leaks into a row without a local expert."""
    x, gate_up, down, w, _, bias_gu, bias_down = make(6, 4, 32, 16, 2)
    ids = torch.tensor([[0, -1], [4, 2], [-1, -1], [3, 1], [9, 0], [2, 3]])
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    out = ops.experts(x, gate_up, down, w, ids, backend=backend,
                      **({"config": SMALL} if backend == "triton" else {}), **kw)
    assert torch.equal(out[2], torch.zeros(32))
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids, **kw)) <= 1e-5


def _good():
    x, gate_up, down, w, ids, bias_gu, bias_down = make(5, 4, 40, 16, 2)
    return dict(hidden_states=x, gate_up_proj=gate_up, down_proj=down, topk_weights=w, topk_ids=ids,
                gate_up_bias=bias_gu, down_bias=bias_down)


BAD = [
    ("gate_up_bias", lambda g: g["gate_up_bias"][:, :16], ValueError,
     "gate_up_bias must have shape \\(4, 32\\)"),
    ("gate_up_bias", lambda g: g["gate_up_bias"][None], ValueError, "gate_up_bias must be 2-D"),
    ("gate_up_bias", lambda g: g["gate_up_bias"].half(), TypeError, "gate_up_bias must have dtype"),
    ("gate_up_bias", lambda g: g["gate_up_bias"].tolist(), TypeError, "gate_up_bias must be a torch.Tensor"),
    ("down_bias", lambda g: g["down_bias"][:3], ValueError, "down_bias must have shape \\(4, 40\\)"),
    ("down_bias", lambda g: g["down_bias"].double(), TypeError, "down_bias must have dtype"),
    ("activation", lambda g: "gelu", ValueError, "activation must be one of"),
    ("activation", lambda g: 3, TypeError, "activation must be a str"),
    ("activation", lambda g: GatedActivation("gpt_oss", limit=0.0), ValueError, "limit must be > 0"),
    ("interleaved", lambda g: 1, TypeError, "interleaved must be a bool"),
]


@pytest.mark.parametrize("name,mutate,exc,msg", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_math_arguments_raise(name, mutate, exc, msg):
    g = _good()
    with pytest.raises(exc, match=msg):
        g[name] = mutate(g)        # GatedActivation(limit=0) raises here
        moe_experts(backend="loop", **g)


def test_masked_backend_refuses_the_math_by_name():
    g = _good()
    owners = "\\['grouped_mm', 'loop', 'padded', 'triton'\\]"
    with pytest.raises(ValueError, match=f"gate_up_bias and down_bias apply to backends {owners}, "
                                         "not backend='masked'"):
        moe_experts(backend="masked", **g)
    g.pop("gate_up_bias"), g.pop("down_bias")
    with pytest.raises(ValueError, match="activation applies to"):
        moe_experts(backend="masked", activation="gpt_oss", **g)
    with pytest.raises(ValueError, match="gate_up_bias must have shape"):   # the op checks too
        torch.ops.moekit.experts(*g.values(), "loop", None, torch.zeros(4, 3), None)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def test_gradients_never_drop_a_bias_gradient():
    """A call with biases that needs gradients: "auto" runs a torch backend (every gradient, the
    biases' included, equals autograd through the reference); "triton" raises, directly too."""
    x, gate_up, down, w, ids, bias_gu, bias_down = make(7, 4, 32, 16, 2)
    dout = torch.randn(7, 32)
    leaves = _leaves(x, gate_up, down, w, bias_gu, bias_down)
    ref = moe_experts_ref(*leaves[:4], ids, **math_kwargs("gpt_oss", True, *leaves[4:]))
    want = torch.autograd.grad((ref * dout).sum(), leaves)
    leaves = _leaves(x, gate_up, down, w, bias_gu, bias_down)
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # CPU: grouped_mm differentiates, no fallback
        out = moe_experts(*leaves[:4], ids, **math_kwargs("gpt_oss", True, *leaves[4:]))
    got = torch.autograd.grad((out * dout).sum(), leaves)
    for name, a, b in zip(("x", "gate_up", "down", "w", "gate_up_bias", "down_bias"), got, want, strict=True):
        assert rel_err(a, b) <= 1e-5, name
    frozen = _leaves(x, gate_up, down, w)
    with pytest.raises(RuntimeError, match="backend='triton' has no backward for calls given gate_up_bias"):
        moe_experts(*frozen, ids, backend="triton", gate_up_bias=bias_gu)
    with pytest.raises(RuntimeError, match="has no backward for calls given down_bias"):
        moe_experts(x, gate_up, down, w, ids, backend="triton", down_bias=leaves[5])   # only the bias trains
    with pytest.raises(RuntimeError, match="has no backward for calls given activation, interleaved"):
        moe_experts(*frozen, ids, backend="triton", activation="gpt_oss", interleaved=True)
    with pytest.raises(RuntimeError, match="triton backward computes SwiGLU without biases only"):
        experts_triton(*frozen, ids, config=SMALL, gate_up_bias=bias_gu)
    with pytest.raises(RuntimeError, match="differentiates SwiGLU experts without biases only"):
        torch.ops.moekit.experts(*frozen, ids, "triton", None, bias_gu, None)
    with pytest.raises(RuntimeError, match="differentiates SwiGLU experts without biases only"):
        torch.ops.moekit.experts(*frozen, ids, "triton", None, None, bias_down)
    for activation, interleaved in (("gpt_oss", False), ("swiglu", True)):
        with pytest.raises(RuntimeError, match="differentiates SwiGLU experts without biases only"):
            torch.ops.moekit.experts(*frozen, ids, "triton", None, None, None, activation, 1.702, 7.0,
                                     interleaved)
    with torch.no_grad():                          # inference: triton serves the call
        moe_experts(*frozen, ids, backend="triton", config=SMALL, gate_up_bias=bias_gu)


def test_auto_on_cuda_routes_a_training_call_away_from_triton():
    """resolve_backend alone (no GPU needed): with biases and gradients, "auto" on CUDA picks
    grouped_mm (aligned) or loop and says why, once; without gradients it stays on triton."""
    opts = ExpertsOptions(**ExpertsOptions.math(torch.zeros(1), None, GatedActivation("gpt_oss"), True))
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, 64, 64, 2, grad=False, options=opts) == "triton"
    with pytest.warns(UserWarning, match="'triton' has no backward for calls given gate_up_bias, activation, "
                                         "interleaved; .* runs on 'grouped_mm'"):
        assert resolve_backend("auto", cuda, 64, 64, 2, grad=True, options=opts) == "grouped_mm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # warned once
        assert resolve_backend("auto", cuda, 63, 64, 2, grad=True, options=opts) == "loop"
    assert resolve_backend("auto", cuda, 64, 64, 2, grad=True) == "triton"


def test_compiled_gpt_oss_experts_with_dynamic_tokens():
    """torch.compile(fullgraph, dynamic) of ops.experts with the gpt-oss math: the moekit::experts op
    in the graph, no recompile across token counts, the reference's values."""
    x_all, gate_up, down, w_all, ids_all, bias_gu, bias_down = make(9, 5, 32, 16, 2)
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *t: ops.experts(*t, backend="triton", config=SMALL, **kw), fullgraph=True,
                             dynamic=True, backend=counter)
    frames = []
    with torch.no_grad():
        for num_tokens in (9, 4):
            args = (x_all[:num_tokens].clone(), gate_up, down, w_all[:num_tokens].clone(),
                    ids_all[:num_tokens].clone())
            assert rel_err(compiled(*args), moe_experts_ref(*args, **kw)) <= 1e-5
            frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0]
    assert "moekit.experts" in counter.graphs[-1].code


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_gpt_oss_20b_bf16_gpu(num_tokens, monkeypatch):
    """gpt-oss-20b's expert shapes (E=32, K=4, H=I=2880) in bf16 on the compiled kernels, weights in
    Transformers' GptOssExperts layout (gate_up (E, H, 2I) interleaved, down (E, I, H), read through
    transposed views): error <= 2x plain bf16 PyTorch's; zero biases give the default kernels' bits
    (the normal path's: biases never take the direct decode path, so it stays off for the comparison)."""
    from moekit import PRESETS

    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "0")

    s, dev, dt = PRESETS["gpt-oss-20b"], torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(num_tokens)
    h, i, e = s.hidden_size, s.intermediate_size, s.num_experts
    x = torch.randn(num_tokens, h, device=dev, generator=gen).to(dt)
    gate_up = (torch.randn(e, h, 2 * i, device=dev, generator=gen) * 6 / h**0.5).to(dt).transpose(1, 2)
    down = (torch.randn(e, i, h, device=dev, generator=gen) / i**0.5).to(dt).transpose(1, 2)
    bias_gu = (torch.randn(e, 2 * i, device=dev, generator=gen) * 3).to(dt)
    bias_down = torch.randn(e, h, device=dev, generator=gen).to(dt)
    logits = torch.randn(num_tokens, e, device=dev, generator=gen)
    top, ids = logits.topk(s.top_k, dim=-1)
    w = torch.softmax(top, dim=-1)                 # GptOssTopKRouter: softmax over the top-k logits
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    with torch.inference_mode():
        ref = moe_experts_ref(x, gate_up, down, w, ids, **kw)
        out = moe_experts(x, gate_up, down, w, ids, backend="triton", **kw)
        bound = same_dtype_bound(x, gate_up, down, w, ids, ref, **kw)
        assert rel_err(out, ref) <= bound, (rel_err(out, ref), bound)
        plain = moe_experts(x, gate_up, down, w, ids, backend="triton")
        zero = moe_experts(x, gate_up, down, w, ids, backend="triton", gate_up_bias=torch.zeros_like(bias_gu),
                           down_bias=torch.zeros_like(bias_down))
        assert torch.equal(plain, zero)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(64, 64, 3), (128, 64, 4)], ids=lambda t: "n{}-k{}-s{}".format(*t))
def test_gpt_oss_with_tma_weights_bf16_gpu(tiles, descriptors):
    """gpt-oss's math with tma_weights compiled, in bf16: contiguous (E, 2I, H) weights, interleaved
    rows read as one [2 BN, BK] box (256 rows at BN = 128), N tails (I = 360, H = 584), sentinels;
    against the fp32 reference by the 2x rule and against the pointer path."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU with TMA (capability >= 9)")
    block_n, block_k, stages = tiles
    inputs = make(300, 8, 584, 360, 4, torch.bfloat16, sentinels=True)
    x, gate_up, down, w, ids, bias_gu, bias_down = (t.cuda() for t in inputs)
    cfg = ExpertsConfig(block_m=64, block_n1=block_n, block_k1=block_k, warps1=8, stages1=stages,
                        block_n2=block_n, block_k2=block_k, warps2=4, stages2=stages, group_m=4,
                        tma_weights=True)
    assert resolve_tma(cfg, gate_up, down, interleaved=True) == cfg
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    with torch.inference_mode():
        ref = moe_experts_ref(x, gate_up, down, w, ids, **kw)
        bound = same_dtype_bound(x, gate_up, down, w, ids, ref, **kw)
        for c in (cfg, dataclasses.replace(cfg, block_m=32, pair_blocks=2)):
            out = moe_experts(x, gate_up, down, w, ids, backend="triton", config=c, ignore_invalid_ids=True,
                              out=poisoned(x.shape, x.dtype, "cuda"), **kw)
            assert rel_err(out, ref) <= bound, (c, rel_err(out, ref), bound)
            pointer = moe_experts(x, gate_up, down, w, ids, backend="triton", ignore_invalid_ids=True,
                                  config=dataclasses.replace(c, tma_weights=False), **kw)
            assert torch.equal(out, pointer) or rel_err(out, pointer) <= bound
    assert descriptors[:2] == [[2 * block_n, block_k], [block_n, block_k]] and len(descriptors) == 4


@pytest.mark.parametrize("backend", ["loop", "triton"])
def test_experts_op_opcheck_with_the_gpt_oss_math(backend):
    """The moekit::experts op with its math arguments: schema, fake tensor and AOT dispatch checks."""
    x, gate_up, down, w, ids, bias_gu, bias_down = make(6, 4, 32, 16, 2)
    cfg = None if backend == "loop" else [getattr(SMALL, f.name) for f in dataclasses.fields(SMALL)]
    args = (x, gate_up, down, w, ids, backend, cfg, bias_gu, bias_down, "gpt_oss", 1.702, 7.0, True)
    torch.library.opcheck(torch.ops.moekit.experts.default, args)
    kw = math_kwargs("gpt_oss", True, bias_gu, bias_down)
    assert rel_err(torch.ops.moekit.experts(*args), moe_experts_ref(x, gate_up, down, w, ids, **kw)) <= 1e-5
