"""The Hopper Gluon SwiGLU backward on `swiglu_backward`'s runtime path
(`moekit.grouped_gemm.gluon_swiglu_bwd`, `moekit.grouped_gemm.backward.gluon_swiglu_backward`).

CPU: the tiles by I (`gluon_swiglu_tiles`); the dispatch predicate `_gluon_swiglu_tiles` on each of
its conditions (capability and Gluon monkeypatched); the Gluon branch's host side (dout copied into
sorted rows by the interpreted gather, then the launch recorded, not run: descriptors over the right
tensors and boxes, the STORE_* constexprs, one program an SM at most); explicit Triton tiles and the
CPU never taking it; moekit importing without Gluon (test_gluon_wgrad.py covers the module too).
GPU (marked gpu; skipped unless compute capability 9 and Gluon): bf16 dpre_w, h_w and d topk_weights
against the fp32 twin within 2x plain bf16 PyTorch's error, at Qwen3-30B-A3B and other shapes (both
tile variants), poisoned workspaces and NaN on the pre-activations' padding rows, padding rows exactly
0, bitwise reproducible, each subset of the outputs, a spy proving the Gluon kernel ran; the
moe_experts autograd step through it (test_gluon_wgrad.py and test_grouped_gemm_backward.py
run the whole backward on the GPU too). The sm_90 compile check:
`aot_compile_check.py --gluon-swiglu`.
"""

from __future__ import annotations

import pytest
import torch

import moekit.grouped_gemm.backward as gb
from helpers import (
    aot_compile_check,
    check_training_step,
    distinct_topk_ids,
    hopper_with_gluon,
    rel_err,
    softmax_routing,
)
from moekit import PRESETS, align_block_size
from moekit._workspace import poisoning
from moekit.grouped_gemm import gluon_swiglu_bwd as swiglu_kernels
from moekit.grouped_gemm import gluon_wgrad as gluon_kernels
from moekit.tuning import (
    GLUON_SWIGLU_64,
    GLUON_SWIGLU_128,
    SHARED_MEMORY_LIMIT,
    default_config,
    gluon_swiglu_tiles,
)

# ---- tiles and the dispatch predicate (CPU, with the device's answers monkeypatched) ----------


def test_tiles_by_intermediate_size():
    assert gluon_swiglu_tiles(768) == GLUON_SWIGLU_128 and gluon_swiglu_tiles(1408) == GLUON_SWIGLU_128
    assert gluon_swiglu_tiles(832) == GLUON_SWIGLU_64 and gluon_swiglu_tiles(64) == GLUON_SWIGLU_64
    assert gluon_swiglu_tiles(720) is None and gluon_swiglu_tiles(48) is None
    for tiles in (GLUON_SWIGLU_128, GLUON_SWIGLU_64):
        assert tiles.smem_bytes() <= SHARED_MEMORY_LIMIT
        assert tiles.producer_regs + 2 * tiles.consumer_regs <= 512
        assert tiles.block_m == swiglu_kernels.SUB_M and tiles.block_k == swiglu_kernels.BLOCK_K


E, H, I, T, K = 4, 512, 256, 40, 2


def predicate_args(dtype=torch.bfloat16, block_m=64, hidden=H, inter=I):
    ids = distinct_topk_ids(T, E, K)
    align = align_block_size(ids, E, block_m, backend="torch")
    rows = align.sorted_ids.numel()
    return dict(dout=torch.zeros(T, hidden, dtype=dtype),
                down_proj=torch.zeros(E, hidden, inter, dtype=dtype),
                pre=torch.zeros(rows, 2 * inter, dtype=dtype),
                align=align)


def test_gluon_swiglu_applies_to_the_training_launch(on_hopper):
    assert gb._gluon_swiglu_tiles(**predicate_args()) == GLUON_SWIGLU_128
    assert gb._gluon_swiglu_tiles(**predicate_args(dtype=torch.float16)) == GLUON_SWIGLU_128
    assert gb._gluon_swiglu_tiles(**predicate_args(block_m=128)) == GLUON_SWIGLU_128
    assert gb._gluon_swiglu_tiles(**predicate_args(inter=192)) == GLUON_SWIGLU_64
    args = predicate_args()
    # dout's layout does not matter (it is copied); pre may have more rows than the alignment
    # (`moekit::experts_train` sizes it before the config is known)
    args.update(dout=torch.zeros(H, T, dtype=torch.bfloat16).T,
                pre=torch.zeros(args["pre"].shape[0] + 64, 2 * I, dtype=torch.bfloat16))
    assert gb._gluon_swiglu_tiles(**args) == GLUON_SWIGLU_128


@pytest.mark.parametrize("why", [
    "env-off", "no-gluon", "not-sm90", "recompute", "fp32", "dtype-mix", "block_m-32", "hidden-odd",
    "hidden-short", "inter-odd", "down-strided", "pre-short", "pre-width", "pre-row-stride", "pre-misaligned",
    "no-rows",
])
def test_gluon_swiglu_refused(on_hopper, monkeypatch, why):
    bf16 = torch.bfloat16
    args = predicate_args()
    rows = args["pre"].shape[0]
    if why == "env-off":
        monkeypatch.setenv(gb.GLUON_SWIGLU_ENV, "0")
    elif why == "no-gluon":
        monkeypatch.setattr(gluon_kernels, "GLUON_AVAILABLE", False)
    elif why == "not-sm90":
        monkeypatch.setattr(gb, "_sm90", lambda device: False)
    elif why == "recompute":
        args["pre"] = None
    elif why == "fp32":
        args = predicate_args(dtype=torch.float32)
    elif why == "dtype-mix":
        args["pre"] = args["pre"].half()
    elif why == "block_m-32":
        args = predicate_args(block_m=32)
    elif why == "hidden-odd":              # not a multiple of the 64 columns a ring step
        args = predicate_args(hidden=H + 32)
    elif why == "hidden-short":            # 4 ring steps: the pre tiles are fetched at step PRE_STEP = 4
        args = predicate_args(hidden=64 * swiglu_kernels.PRE_STEP)
    elif why == "inter-odd":
        args = predicate_args(inter=96)
    elif why == "down-strided":
        args["down_proj"] = torch.zeros(E, H, 2 * I, dtype=bf16)[:, :, :I]
    elif why == "pre-short":
        args["pre"] = torch.zeros(rows - 1, 2 * I, dtype=bf16)
    elif why == "pre-width":
        args["pre"] = torch.zeros(rows, 2 * I + 64, dtype=bf16)
    elif why == "pre-row-stride":          # rows 2I + 1 elements apart: not a multiple of 16 bytes
        args["pre"] = torch.zeros(rows, 2 * I + 1, dtype=bf16)[:, :2 * I]
    elif why == "pre-misaligned":
        args["pre"] = torch.zeros(rows * 2 * I + 1, dtype=bf16)[1:].view(rows, 2 * I)
    elif why == "no-rows":                 # T = 0: no sorted row at all (no descriptor over nothing)
        args["align"] = align_block_size(torch.zeros(0, K, dtype=torch.int32), E, 64, backend="torch")
        args["dout"], args["pre"] = torch.zeros(0, H, dtype=bf16), torch.zeros(0, 2 * I, dtype=bf16)
    assert gb._gluon_swiglu_tiles(**args) is None


class Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def swiglu_case(num_tokens=24, num_experts=4, hidden=H, inter=I, top_k=K, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, generator=gen)
    align = align_block_size(ids, num_experts, 64, backend="torch")
    rows = align.sorted_ids.numel()
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen).to(dtype)
    down = torch.randn(num_experts, hidden, inter, generator=gen).to(dtype)
    w = torch.rand(num_tokens, top_k, generator=gen)
    dout = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    pre = torch.randn(rows, 2 * inter, generator=gen).to(dtype)
    return x, gate_up, down, w, ids, dout, pre, align


@pytest.mark.parametrize("wants", [(True, True, True), (True, False, True), (False, True, False),
                                   (True, True, False)], ids=["all", "no-h", "h-only", "no-weights"])
def test_gluon_branch_launches_on_dout_by_token(on_hopper, monkeypatch, wants):
    """`swiglu_backward`'s Gluon branch on the CPU, the kernel launch recorded instead of run: no copy
    of dout (the kernel's producer gathers its token rows: dout as it lies, its row stride, TOP_K, no
    descriptor over it), the descriptors over the right tensors and boxes, the outputs not wanted
    neither allocated nor stored, one program an SM at most, the tiles' registers (within the launch's
    cap)."""
    rec = Recorder()
    monkeypatch.setattr(swiglu_kernels, "gluon_swiglu_bwd_kernel", rec)
    monkeypatch.setattr(gb, "sorted_rows", lambda *a, **k: pytest.fail("dout copied into sorted rows"))
    want_dpre, want_h, want_w = wants
    x, gate_up, down, w, ids, dout, pre, align = swiglu_case()
    cfg = default_config(PRESETS["qwen3-30b-a3b"], 64)
    got = gb.swiglu_backward(x, gate_up, down, dout, w, align, K, cfg, pre=pre, want_dpre=want_dpre,
                             want_h=want_h, want_topk_weights=want_w)
    assert len(rec.launches) == 1
    grid, args, kwargs = rec.launches[0]
    tiles = GLUON_SWIGLU_128
    (b_desc, pre_desc, dpre_desc, h_desc, part, w_arg, sid, eid, npad, num_pairs, hidden, inter,
     n_tiles, dout_ptr, dout_stride) = args
    rows = align.sorted_ids.numel()
    assert (hidden, inter, n_tiles, num_pairs) == (H, I, I // tiles.block_n, align.num_pairs)
    assert grid == (min(gb.num_sms(x.device), (rows // tiles.block_m) * n_tiles),)
    assert dout_ptr is dout and dout_stride == H
    assert (kwargs["TOP_K"], kwargs["BK"]) == (K, 64)
    assert b_desc.base.data_ptr() == down.data_ptr() and list(b_desc.shape) == [E * H, I]
    assert b_desc.block_shape == [64, tiles.block_n]
    assert pre_desc.base is pre and pre_desc.block_shape == [64, tiles.block_n]
    assert (dpre_desc.base is got.dpre_w) if want_dpre else (dpre_desc is pre_desc and got.dpre_w is None)
    assert (h_desc.base is got.h_w) if want_h else (h_desc is pre_desc and got.h_w is None)
    assert (got.topk_weights is not None) is want_w
    if want_w:
        assert part.shape == (rows, n_tiles) and part.dtype == torch.float32
    assert w_arg.data_ptr() == w.data_ptr() and w_arg.shape == (w.numel(),)
    assert sid is align.sorted_ids and eid is align.expert_ids and npad is align.num_padded
    assert (kwargs["STORE_DPRE"], kwargs["STORE_H"], kwargs["STORE_PART"]) == wants
    assert (kwargs["STAGES"], kwargs["ALIGN_M"]) == (tiles.stages, 64)
    assert kwargs["PRE_STEP_"] == swiglu_kernels.PRE_STEP
    assert (kwargs["PRODUCER_REGS"], kwargs["CONSUMER_REGS"]) == (tiles.producer_regs, tiles.consumer_regs)
    assert 2 * kwargs["CONSUMER_REGS"] + kwargs["PRODUCER_REGS"] <= 3 * gluon_kernels.MAX_REGS
    assert kwargs["num_warps"] == 4 and kwargs["maxnreg"] == gluon_kernels.MAX_REGS


def test_explicit_tiles_and_the_cpu_run_the_triton_kernel(on_hopper, monkeypatch):
    """Named Triton tiles pin the Triton kernel even where the predicate holds; on the CPU (no
    capability 9) the predicate refuses, and the Triton kernel's results match the twin."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Gluon SwiGLU backward launched")

    monkeypatch.setattr(gb, "gluon_swiglu_backward", refuse)
    x, gate_up, down, w, ids, dout, pre, align = swiglu_case(num_tokens=9, hidden=384, inter=128,
                                                             dtype=torch.float16)
    cfg = default_config(PRESETS["qwen3-30b-a3b"], 64)
    tiles = gb.BackwardTiles(32, 32, 2, recompute=False, warps=4)
    live = int(align.num_padded)
    with poisoning():
        pinned = gb.swiglu_backward(x, gate_up, down, dout, w, align, K, cfg, pre=pre, tiles=tiles)
    monkeypatch.setattr(gb, "_sm90", lambda device: False)
    x32 = [t.float() for t in (x, gate_up, down, dout, pre)]
    with poisoning():
        cpu = gb.swiglu_backward(x32[0], x32[1], x32[2], x32[3], w, align, K, cfg, pre=x32[4])
    tw = gb.swiglu_backward_torch(x32[0], x32[1], x32[2], x32[3], w, align, K, pre=x32[4])
    assert rel_err(cpu.dpre_w[:live], tw.dpre_w[:live]) <= 1e-5
    assert rel_err(cpu.h_w[:live], tw.h_w[:live]) <= 1e-5
    assert rel_err(cpu.topk_weights, tw.topk_weights) <= 1e-5
    assert rel_err(pinned.dpre_w[:live].float(), tw.dpre_w[:live]) <= 1e-2


def test_gluon_swiglu_backward_refuses_mismatched_buffers():
    """dout of the wrong width or rank and a part buffer of the wrong shape are refused, naming them,
    before any launch."""
    x, gate_up, down, w, ids, dout, pre, align = swiglu_case()
    rows = align.sorted_ids.numel()
    for bad_dout, part in ((torch.empty(24, H + 64, dtype=torch.bfloat16), None),
                           (torch.empty(24, H, 1, dtype=torch.bfloat16), None),
                           (dout, torch.empty(rows, 3))):
        with pytest.raises(ValueError, match="gluon_swiglu_backward: dout"):
            gb.gluon_swiglu_backward(bad_dout, down, pre, w, align, GLUON_SWIGLU_128, K, dpre=None, h=None,
                                     part=part)


# ---- the sm_90 compile check (tools/aot_compile_check.py) ----------------------------------------

def test_gluon_swiglu_kernel_compiles_for_sm90():
    """The Hopper Gluon SwiGLU backward's two tiles (bf16 and fp16; dout's rows gathered by the
    producer) and a launch storing dpre_w alone, through ptxas for sm_90, within
    the shared-memory limit (skipped where this Triton has no Gluon, CUDA backend or ptxas). The
    128-column tiles spill loop counters (reported, allowed)."""
    out = aot_compile_check("--gluon-swiglu", "--regs")
    assert "5/5 gluon swiglu kernels compile" in out
    lines = [line for line in out.splitlines() if line.startswith("gluon-swiglu ")]
    assert len(lines) == 5 and all(" OK " in line and "r " in line for line in lines), lines


# ---- GPU -----------------------------------------------------------------------------------------

hopper = pytest.mark.skipif(not (hopper_with_gluon() and gluon_kernels.GLUON_AVAILABLE),
                            reason="needs compute capability 9 and Gluon")
QWEN = tuple(getattr(PRESETS["qwen3-30b-a3b"], f) for f in ("num_experts", "hidden_size",
                                                            "intermediate_size", "top_k"))
GPU_CASES = [  # (name, (E, H, I, K), T, routing, align block size)
    ("qwen-T1", QWEN, 1, "softmax", 64),
    ("qwen-T64", QWEN, 64, "softmax", 64),
    ("qwen-T1000", QWEN, 1000, "softmax", 64),
    ("qwen-T4096", QWEN, 4096, "softmax", 64),
    ("qwen-T1000-m128", QWEN, 1000, "softmax", 128),
    ("olmoe-T1000", (64, 2048, 1024, 8), 1000, "softmax", 64),
    ("i832-T700-bn64", (16, 1024, 832, 4), 700, "softmax", 64),       # only 64 divides I: GLUON_SWIGLU_64
    ("qwen-T1000-one-expert", QWEN, 1000, "one-expert", 64),
    ("qwen-T1000-sentinels", QWEN, 1000, "sentinels", 64),
    ("qwen-T333-strided", QWEN, 333, "softmax", 64),         # dout: a column half of (T, 2H) rows
]


def gpu_case(shape, num_tokens, kind, block_m, seed=0, strided=False):
    """The SwiGLU backward's inputs as the training step makes them; the last expert gets no pairs;
    the pre-activations' padding rows NaN (never read into a result)."""
    num_experts, hidden, inter, top_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w, ids = softmax_routing(num_tokens, num_experts, top_k, generator=gen, kind=kind)
    align = align_block_size(ids, num_experts, block_m, backend="triton")
    rows = align.sorted_ids.numel()

    def randn(*size, scale=1.0):
        return (torch.randn(*size, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    down = randn(num_experts, hidden, inter, scale=inter ** -0.5)
    pre, dout = randn(rows, 2 * inter), randn(num_tokens, hidden)
    if strided:                    # the kernel gathers dout's rows as they lie, row stride 2H
        dout = randn(num_tokens, 2 * hidden)[:, hidden:]
    pre[align.sorted_ids >= align.num_pairs] = float("nan")
    x = torch.zeros(1, device="cuda", dtype=torch.bfloat16).expand(num_tokens, hidden)        # shapes only
    gate_up = torch.zeros(1, device="cuda", dtype=torch.bfloat16).expand(num_experts, 2 * inter, hidden)
    return ids, align, x, gate_up, down, w, dout, pre


@pytest.fixture
def gluon_spy(monkeypatch):
    """The tiles of every `gluon_swiglu_backward` launch `swiglu_backward` makes."""
    launched = []
    real = gb.gluon_swiglu_backward

    def spy(*args, **kwargs):
        launched.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(gb, "gluon_swiglu_backward", spy)
    monkeypatch.delenv(gb.GLUON_SWIGLU_ENV, raising=False)
    return launched


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gluon_swiglu_within_twice_plain_pytorch_gpu(case, gluon_spy):
    name, shape, num_tokens, kind, block_m = case
    ids, align, x, gate_up, down, w, dout, pre = gpu_case(shape, num_tokens, kind, block_m,
                                                          strided=name.endswith("-strided"))
    top_k, inter = shape[3], shape[2]
    cfg = default_config(PRESETS["qwen3-30b-a3b"], num_tokens)
    npad = int(align.num_padded)

    def run():
        with poisoning():
            return gb.swiglu_backward(x, gate_up, down, dout, w, align, top_k, cfg, pre=pre)

    got = run()
    assert gluon_spy == [gluon_swiglu_tiles(inter)], gluon_spy
    want = gb.swiglu_backward_torch(x, gate_up, down, dout, w, align, top_k, pre=pre)
    plain = gb.swiglu_backward_torch(x, gate_up, down, dout, w, align, top_k, pre=pre,
                                     compute_dtype=torch.bfloat16)
    pad = align.sorted_ids[:npad] >= align.num_pairs
    for field in ("dpre_w", "h_w"):
        g, ref, base = (getattr(t, field)[:npad] for t in (got, want, plain))
        assert g.dtype == torch.bfloat16
        assert rel_err(g, ref) <= 2 * rel_err(base, ref), (field, rel_err(g, ref), rel_err(base, ref))
        assert torch.equal(g[pad], torch.zeros_like(g[pad])), field          # NaN (unwritten) fails too
    assert got.topk_weights.dtype == torch.float32
    assert rel_err(got.topk_weights, want.topk_weights) <= 2 * rel_err(plain.topk_weights, want.topk_weights)
    unplaced = (ids.reshape(-1) < 0) | (ids.reshape(-1) >= shape[0])
    assert torch.equal(got.topk_weights[unplaced], torch.zeros_like(got.topk_weights[unplaced]))
    again = run()
    assert all(torch.equal(a[:npad] if a.dim() == 2 else a, b[:npad] if b.dim() == 2 else b)
               for a, b in zip(got, again, strict=True))                      # bitwise reproducible


@pytest.mark.gpu
@hopper
def test_gluon_swiglu_output_subsets_and_switch_off_gpu(gluon_spy, monkeypatch):
    """Each output alone is the one of the full launch, bit for bit (the others compiled out); the
    switch off runs the Triton kernel, within the same bound."""
    ids, align, x, gate_up, down, w, dout, pre = gpu_case(QWEN, 1000, "softmax", 64)
    cfg = default_config(PRESETS["qwen3-30b-a3b"], 1000)
    npad = int(align.num_padded)
    args = (x, gate_up, down, dout, w, align, QWEN[3], cfg)
    with poisoning():
        full = gb.swiglu_backward(*args, pre=pre)
        only = [gb.swiglu_backward(*args, pre=pre, want_dpre=f == "dpre_w", want_h=f == "h_w",
                                   want_topk_weights=f == "topk_weights") for f in gb.SwigluGrads._fields]
    assert len(gluon_spy) == 4
    for field, part in zip(gb.SwigluGrads._fields, only, strict=True):
        a, b = getattr(full, field), getattr(part, field)
        assert torch.equal(a[:npad], b[:npad]) if a.dim() == 2 else torch.equal(a, b), field
        assert all(getattr(part, f) is None for f in gb.SwigluGrads._fields if f != field)
    monkeypatch.setenv(gb.GLUON_SWIGLU_ENV, "0")
    with poisoning():
        off = gb.swiglu_backward(*args, pre=pre)
    assert len(gluon_spy) == 4
    want = gb.swiglu_backward_torch(x, gate_up, down, dout, w, align, QWEN[3], pre=pre)
    for field in ("dpre_w", "h_w"):
        for t in (full, off):
            assert rel_err(getattr(t, field)[:npad], getattr(want, field)[:npad]) < 1e-2, field


@pytest.mark.gpu
@hopper
def test_gluon_swiglu_through_moe_experts_autograd_gpu(gluon_spy):
    """The training step (moe_experts, backend "triton") at Qwen3's shape runs the Gluon SwiGLU
    backward once; all four gradients within 2x plain bf16 PyTorch's error against the fp32 reference,
    deterministic, no host sync."""
    from moekit import moe_experts

    check_training_step(lambda *a: moe_experts(*a, backend="triton"), QWEN, 777, seed=1)
    assert gluon_spy == [GLUON_SWIGLU_128] * 2, gluon_spy          # the first backward and the second


# ---- the training backward's plumbing (CPU: the Gluon launch stood in for by the fp32 twin) ---------

@pytest.mark.parametrize("frozen", [None, "down_proj", "topk_weights"],
                         ids=["all", "frozen-down", "frozen-router"])
def test_training_backward_through_the_gluon_branch(monkeypatch, frozen):
    """Where the Gluon SwiGLU backward runs (its launch stood in for here by the fp32 twin writing the
    same buffers), the training step passes it dout by token (its producer gathers the rows: no
    sorted copy is made), top_k and the saved pre-activations; d down reads dout by token too. dx
    and the weight gradients computed from its outputs match torch autograd through the fp32
    reference; an expert without pairs gets exact zeros."""
    import moekit.experts.triton as triton_experts
    from helpers import check_exact_zeros
    from moekit import ExpertsConfig, moe_experts
    from moekit.grouped_gemm import _placed_rows
    from moekit.reference import moe_experts_ref

    num_tokens, num_experts, hidden, inter, top_k = 11, 5, 48, 128, 2
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    w = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    ids = distinct_topk_ids(num_tokens, num_experts - 1, top_k, generator=gen)    # the last expert: no pairs
    ids[0, 1], ids[4, 0] = -1, num_experts                                          # pairs never placed
    dout = torch.randn(num_tokens, hidden, generator=gen)
    cfg = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1, block_n2=16, block_k2=16,
                        warps2=4, stages2=1, group_m=2)
    launches, copies, kernel_reads, down_reads = [], [], [], []
    real_sorted_rows, real_down = gb.sorted_rows, triton_experts.down_proj_grad

    def counting_sorted_rows(t, align, k, **kwargs):
        out = real_sorted_rows(t, align, k, **kwargs)
        if t.shape == dout.shape:
            copies.append(out)
        return out

    def spy_down(a, *args, **kwargs):
        down_reads.append(a)
        return real_down(a, *args, **kwargs)

    def twin_launch(dout_arg, down_proj, pre, topk_weights, align, tiles, top_k, *, dpre, h, part):
        launches.append((dpre is not None, h is not None, part is not None))
        kernel_reads.append((dout_arg, top_k))
        placed, pair, _ = _placed_rows(align)
        assert pre.shape[1] == 2 * inter and tiles is GLUON_SWIGLU_128
        tw = gb.swiglu_backward_torch(x, gate_up, down, dout, topk_weights, align, top_k, pre=pre)
        for buf, val in ((dpre, tw.dpre_w), (h, tw.h_w)):
            if buf is not None:
                buf.copy_(val)
        if part is not None:
            part.zero_()
            part[placed, 0] = tw.topk_weights[pair]

    monkeypatch.setattr(gb, "_gluon_swiglu_tiles", lambda *a: GLUON_SWIGLU_128 if a[2] is not None else None)
    monkeypatch.setattr(gb, "gluon_swiglu_backward", twin_launch)
    monkeypatch.setattr(gb, "sorted_rows", counting_sorted_rows)
    monkeypatch.setattr(triton_experts, "down_proj_grad", spy_down)
    names = ("x", "gate_up_proj", "down_proj", "topk_weights")
    leaves = [t.clone().requires_grad_(frozen != name) for name, t in zip(names, (x, gate_up, down, w))]
    with poisoning():
        out = moe_experts(*leaves, ids, backend="triton", config=cfg, ignore_invalid_ids=True)
        got = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)
    assert launches == [(True, frozen != "down_proj", frozen != "topk_weights")]
    assert copies == [] and len(kernel_reads) == 1
    assert torch.equal(kernel_reads[0][0], dout) and kernel_reads[0][1] == top_k     # by token, gathered
    if frozen == "down_proj":
        assert down_reads == []
    else:
        assert len(down_reads) == 1 and torch.equal(down_reads[0], dout)             # by token, not sorted
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts_ref(*ref_leaves, ids).backward(dout)
    want = [r.grad for r, t in zip(ref_leaves, leaves) if t.requires_grad]
    for g, ref in zip(got, want, strict=True):
        assert rel_err(g, ref) <= 1e-5, rel_err(g, ref)
    if frozen is None:
        check_exact_zeros(list(got), ids.long(), num_experts)
