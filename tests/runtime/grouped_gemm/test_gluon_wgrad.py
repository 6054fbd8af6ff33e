"""The Hopper Gluon weight gradient on `wgrad`'s runtime path (`moekit.grouped_gemm.gluon_wgrad`,
`moekit.grouped_gemm.backward.gluon_wgrad`) and the row gather that feeds it (`sorted_rows`).

CPU: the gather kernel (interpreted) against its twin `sorted_rows_torch`, exactly; the dispatch
predicate `_gluon_wgrad_tiles` on each of its conditions (capability, interpreter and Gluon
monkeypatched); the Gluon branch's host side (the gather, then the launch recorded, not run); `wgrad`
never taking the Gluon path off the GPU; moekit importing without Gluon.
GPU (marked gpu; skipped unless compute capability 9 and Gluon): bf16 d gate_up / d down against the
fp32 twins within 2x plain bf16 PyTorch's error, poisoned workspaces, empty experts exactly 0, bitwise
reproducible, a spy proving the Gluon kernel ran; the moe_experts autograd path through it.
The sm_90 compile check: `aot_compile_check.py --gluon-wgrad`.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

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
from moekit import PRESETS, align_block_size, moe_experts
from moekit._workspace import poisoning
from moekit.grouped_gemm import gluon_wgrad as gluon_kernels
from moekit.tuning import (
    GLUON_COOP_WGRAD,
    GLUON_COOP_WGRAD_ROWS,
    GLUON_PP_WGRAD,
    SHARED_MEMORY_LIMIT,
    WGRAD_ENV,
    WgradConfig,
    get_config,
    gluon_wgrad_tiles,
)

# ---- the gather (CPU: interpreted) -------------------------------------------------------------

GATHER_CASES = [  # (T, E, K, C, block_m, routing)
    (1, 4, 2, 40, 16, "distinct"),         # T = 1: most experts empty
    (7, 5, 2, 300, 16, "distinct"),        # C past one 256-column tile, masked tail
    (13, 6, 3, 17, 32, "sentinels"),       # ids -1 and E: pairs never placed
    (41, 3, 2, 64, 16, "one-expert"),      # every pair on expert 1, several 32-row programs
]


def gather_case_id(c):
    return f"T{c[0]}-E{c[1]}-K{c[2]}-C{c[3]}-m{c[4]}-{c[5]}"


def routing(num_tokens, num_experts, top_k, kind, gen):
    if kind == "one-expert":
        return torch.ones(num_tokens, top_k, dtype=torch.int32)
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, generator=gen)
    if kind == "sentinels":
        ids[0, 0], ids[1, -1] = -1, num_experts
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", GATHER_CASES, ids=gather_case_id)
def test_sorted_rows_matches_its_twin(case, dtype):
    num_tokens, num_experts, top_k, cols, block_m, kind = case
    gen = torch.Generator().manual_seed(num_tokens * 100 + cols)
    ids = routing(num_tokens, num_experts, top_k, kind, gen)
    align = align_block_size(ids, num_experts, block_m, backend="torch")
    assert align.sorted_ids.dtype == torch.int32
    assert (align.tokens_per_expert == 0).any(), "every case leaves an expert without pairs"
    # a strided source (a column slice of a wider buffer): the kernel takes both strides
    src = torch.randn(num_tokens, cols + 3, generator=gen).to(dtype)[:, 2:cols + 2]
    with poisoning():
        got = gb.sorted_rows(src, align, top_k)
    want = gb.sorted_rows_torch(src, align, top_k)
    npad = int(align.num_padded)
    assert got.shape == want.shape == (align.sorted_ids.numel(), cols) and got.dtype == dtype
    assert torch.equal(got[:npad], want[:npad])                 # bitwise; NaN would fail
    padding = align.sorted_ids[:npad] >= align.num_pairs
    assert padding.any() and torch.equal(got[:npad][padding], torch.zeros_like(got[:npad][padding]))
    assert torch.isnan(got[npad:]).all(), "rows past num_padded are not written"


# ---- the dispatch predicate (CPU, with the device's answers monkeypatched) ---------------------

E, N, C, T, K = 4, 256, 512, 64, 2


def predicate_call(dtype=torch.bfloat16, block_m=64, a_by_token=False, b_by_token=True, **override):
    """`_gluon_wgrad_tiles` for a d gate_up launch (A sorted rows (L, N), B by token (T, C)) that
    passes every condition; `override` replaces an argument."""
    ids = distinct_topk_ids(T, E, K)
    align = align_block_size(ids, E, block_m, backend="torch")
    rows = align.sorted_ids.numel()
    a = torch.zeros(T if a_by_token else rows, N, dtype=dtype)
    b = torch.zeros(T if b_by_token else rows, C, dtype=dtype)
    args = dict(a=a, b=b, topk_weights=None, align=align, shape=(E, N, C), dtype=dtype, a_by_token=a_by_token,
                b_by_token=b_by_token, tiles=None, padding_zero=True)
    args.update(override)
    return gb._gluon_wgrad_tiles(**args)


def test_gluon_wgrad_applies_to_the_training_launches(on_hopper):
    assert predicate_call() == GLUON_PP_WGRAD                                     # d gate_up
    # d down, gathering dout's token rows (32 an expert): the cooperative tiles gather each row half as often
    assert predicate_call(a_by_token=True, b_by_token=False) == GLUON_COOP_WGRAD
    rows = align_block_size(distinct_topk_ids(T, E, K), E, 64, backend="torch").sorted_ids.numel()
    narrow = torch.zeros(rows, 128, dtype=torch.bfloat16)           # C = 128: no 256-column tile divides it
    assert predicate_call(a_by_token=True, b_by_token=False, shape=(E, N, 128), b=narrow) == GLUON_PP_WGRAD
    assert predicate_call(a_by_token=False, b_by_token=False) == GLUON_PP_WGRAD  # both sorted
    assert predicate_call(dtype=torch.float16) == GLUON_PP_WGRAD
    assert predicate_call(block_m=128) == GLUON_PP_WGRAD
    # the by-token operand is copied first: its layout does not matter
    assert predicate_call(b=torch.zeros(C, T, dtype=torch.bfloat16).T) == GLUON_PP_WGRAD


@pytest.mark.parametrize("why", [
    "env-off", "no-gluon", "not-sm90", "tiles", "tiles-env", "scaled", "no-padding-zero", "both-by-token",
    "fp32", "dtype-mix", "grad-dtype", "block_m-32", "n-tile", "c-tile", "a-3d", "a-column-major",
    "a-row-stride", "a-misaligned",
])
def test_gluon_wgrad_refused(on_hopper, monkeypatch, why):
    bf16 = torch.bfloat16
    rows = align_block_size(distinct_topk_ids(T, E, K), E, 64, backend="torch").sorted_ids.numel()
    override = {}
    if why == "env-off":
        monkeypatch.setenv(gb.GLUON_WGRAD_ENV, "0")
    elif why == "no-gluon":
        monkeypatch.setattr(gluon_kernels, "GLUON_AVAILABLE", False)
    elif why == "not-sm90":
        monkeypatch.setattr(gb, "_sm90", lambda device: False)
    elif why == "tiles":
        override = {"tiles": WgradConfig()}
    elif why == "tiles-env":
        monkeypatch.setenv(WGRAD_ENV, "block_m=32")
    elif why == "scaled":
        override = {"topk_weights": torch.ones(T, K)}
    elif why == "no-padding-zero":
        override = {"padding_zero": False}
    elif why == "fp32":
        override = {"dtype": torch.float32, "a": torch.zeros(rows, N), "b": torch.zeros(T, C)}
    elif why == "dtype-mix":
        override = {"b": torch.zeros(T, C, dtype=torch.float16)}
    elif why == "grad-dtype":
        override = {"dtype": torch.float32}
    elif why == "n-tile":
        override = {"shape": (E, N + 64, C), "a": torch.zeros(rows, N + 64, dtype=bf16)}
    elif why == "c-tile":
        override = {"shape": (E, N, C - 64), "b": torch.zeros(T, C - 64, dtype=bf16)}
    elif why == "a-3d":
        override = {"a": torch.zeros(1, rows, N, dtype=bf16)}
    elif why == "a-column-major":
        override = {"a": torch.zeros(N, rows, dtype=bf16).T}
    elif why == "a-row-stride":      # rows N + 1 elements apart: not a multiple of 16 bytes
        override = {"a": torch.zeros(rows, N + 1, dtype=bf16)[:, :N]}
    elif why == "a-misaligned":
        override = {"a": torch.zeros(rows * N + 1, dtype=bf16)[1:].view(rows, N)}
    if why == "both-by-token":
        got = predicate_call(a=torch.zeros(T, N, dtype=bf16), a_by_token=True)
    elif why == "block_m-32":
        got = predicate_call(block_m=32)
    else:
        got = predicate_call(**override)
    assert got is None


def test_gluon_wgrad_picks_cooperative_tiles_from_512_rows_an_expert(on_hopper):
    assert gluon_wgrad_tiles(GLUON_COOP_WGRAD_ROWS - 1) == GLUON_PP_WGRAD
    assert gluon_wgrad_tiles(GLUON_COOP_WGRAD_ROWS) == GLUON_COOP_WGRAD
    assert gluon_wgrad_tiles(1, gathers_a=True) == GLUON_COOP_WGRAD
    # d down past GATHER_A_ROWS rows an expert reads a copy of dout: the tiles by rows again
    ids = distinct_topk_ids((gb.GATHER_A_ROWS + 1) * E // K + 1, E, K)
    more = align_block_size(ids, E, 64, backend="torch")
    assert not gb.gathers_a(more.num_pairs, E)
    assert predicate_call(align=more, a_by_token=True, b_by_token=False,
                          a=torch.zeros(ids.shape[0], N, dtype=torch.bfloat16),
                          b=torch.zeros(more.sorted_ids.numel(), C, dtype=torch.bfloat16)) == GLUON_PP_WGRAD
    ids = torch.zeros(GLUON_COOP_WGRAD_ROWS * E // K, K, dtype=torch.int32)   # 512 pairs an expert
    align = align_block_size(ids, E, 64, backend="torch")
    assert predicate_call(align=align) == GLUON_COOP_WGRAD
    for tiles in (GLUON_PP_WGRAD, GLUON_COOP_WGRAD):
        assert tiles.smem_bytes() <= SHARED_MEMORY_LIMIT


def test_sm90_is_capability_9_compiled(monkeypatch):
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(gb, "interpreting", lambda: False)
    for major, want in ((8, False), (9, True), (10, False), (12, False)):
        monkeypatch.setattr(gb, "capability_major", lambda index, major=major: major)
        assert gb._sm90(cuda0) is want, major
    assert gb._sm90(torch.device("cpu")) is False
    monkeypatch.setattr(gb, "interpreting", lambda: True)
    assert gb._sm90(cuda0) is False


def test_wgrad_never_takes_the_gluon_path_on_the_cpu(monkeypatch):
    """Even with a Gluon: a CPU device runs the Triton kernels (interpreted)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the Gluon kernel launched on the CPU")

    monkeypatch.setattr(gb, "gluon_wgrad", refuse)
    monkeypatch.delenv(gb.GLUON_WGRAD_ENV, raising=False)
    num_tokens, num_experts, hidden, inter, top_k = 9, 4, 32, 16, 2
    ids = distinct_topk_ids(num_tokens, num_experts, top_k)
    align = align_block_size(ids, num_experts, 64, backend="torch")
    rows = align.sorted_ids.numel()
    x, dout = torch.randn(num_tokens, hidden), torch.randn(num_tokens, hidden)
    pad = align.sorted_ids >= align.num_pairs
    dpre, h = torch.randn(rows, 2 * inter), torch.randn(rows, inter)
    dpre[pad], h[pad] = 0, 0
    for dtype in (torch.float32, torch.bfloat16):
        assert predicate_call(dtype=dtype) is None
    with poisoning():
        d_gu = gb.gate_up_proj_grad(dpre, x, None, align, top_k, torch.float32, padding_zero=True)
        d_down = gb.down_proj_grad(dout, h, None, align, top_k, torch.float32, padding_zero=True)
    assert rel_err(d_gu, gb.gate_up_proj_grad_torch(dpre, x, None, align, top_k)) < 1e-5
    assert rel_err(d_down, gb.down_proj_grad_torch(dout, h, None, align, top_k)) < 1e-5


@pytest.mark.parametrize("launch", ["gate_up", "down-gathered", "down-chunked"])
def test_gluon_branch_copies_or_gathers_then_launches(on_hopper, monkeypatch, launch):
    """`wgrad`'s Gluon branch on the CPU, the kernel launch recorded instead of run. d gate_up: x
    copied into sorted rows (the interpreted gather), one launch. d down at up to GATHER_A_ROWS rows
    an expert: no copy, one launch with dout as it lies (its row stride, the sorted ids and pair count
    to gather its rows by, no descriptor over it); above: dout copied a column chunk at a time
    through one buffer, a launch a chunk. Descriptors over the right tensors and boxes, one program
    an SM at most (OFF_GPU_SMS here), the tiles' constexprs."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(gluon_kernels, "gluon_wgrad_kernel", Recorder())
    copies = []
    real_sorted_rows = gb.sorted_rows

    def counting_sorted_rows(t, *args, **kwargs):
        copies.append(t)
        return real_sorted_rows(t, *args, **kwargs)

    monkeypatch.setattr(gb, "sorted_rows", counting_sorted_rows)
    if launch == "down-chunked":
        monkeypatch.setattr(gb, "GATHER_A_ROWS", 2)          # 8 rows an expert here: above it
    num_tokens, num_experts, top_k, hidden, inter = 16, 4, 2, 512, 128
    ids = distinct_topk_ids(num_tokens, num_experts, top_k)
    align = align_block_size(ids, num_experts, 64, backend="torch")
    rows = align.sorted_ids.numel()
    wide = torch.randn(num_tokens, 2 * hidden).bfloat16()
    x, dout = torch.randn(num_tokens, hidden).bfloat16(), wide[:, hidden:]      # dout: row stride 2H
    dpre, h = torch.randn(rows, 2 * inter).bfloat16(), torch.randn(rows, inter).bfloat16()
    bf16 = torch.bfloat16
    if launch == "gate_up":
        grad = gb.gate_up_proj_grad(dpre, x, None, align, top_k, bf16, padding_zero=True)
        sorted_op, token_major = dpre, x
    else:
        grad = gb.down_proj_grad(dout, h, None, align, top_k, bf16, padding_zero=True)
        sorted_op, token_major = h, dout
    tiles = GLUON_PP_WGRAD                                   # 8 rows an expert
    e, n, c = grad.shape
    assert (n, c) == ((2 * inter, hidden) if launch == "gate_up" else (hidden, inter))
    chunks = {"gate_up": 1, "down-gathered": 1, "down-chunked": gb.gluon_a_chunks(n, tiles)}[launch]
    assert chunks == (4 if launch == "down-chunked" else 1)
    assert len(launches) == chunks
    assert len(copies) == (0 if launch == "down-gathered" else chunks)
    width = n // chunks
    npad = int(align.num_padded)
    for i, (grid, args, kwargs) in enumerate(launches):
        (a_desc, b_desc, c_desc, row_starts, num_items, tiles_per_expert, c_tiles, n_arg, g_ptr, g_stride,
         sorted_ids, num_pairs) = args
        gathered = launch == "down-gathered"
        assert n_arg == n and kwargs["GATHER_A"] is gathered and kwargs["BK"] == 64
        assert (kwargs["STAGES"], kwargs["PINGPONG"], kwargs["A_W"]) == (tiles.stages, tiles.pingpong, 128)
        regs = (gluon_kernels.GATHER_PRODUCER_REGS, gluon_kernels.GATHER_CONSUMER_REGS) if gathered \
            else (gluon_kernels.PRODUCER_REGS, gluon_kernels.CONSUMER_REGS)
        assert (kwargs["PRODUCER_REGS"], kwargs["CONSUMER_REGS"]) == regs
        assert tiles_per_expert == (width // tiles.block_n) * (c // tiles.block_c)
        assert c_tiles == c // tiles.block_c
        assert num_items == e * tiles_per_expert and grid == (min(gb.num_sms(x.device), num_items),)
        assert torch.equal(row_starts, align.row_starts())
        if gathered:
            assert a_desc is None and g_ptr is dout and g_stride == 2 * hidden and kwargs["TOP_K"] == top_k
            assert sorted_ids is align.sorted_ids and num_pairs == align.num_pairs
            assert b_desc.base is sorted_op and b_desc.block_shape == [64, tiles.block_c]
        else:
            descs = (a_desc, b_desc)
            by_token = 1 if launch == "gate_up" else 0
            assert descs[1 - by_token].base is sorted_op
            cols = slice(i * width, (i + 1) * width) if launch == "down-chunked" else slice(None)
            if i == len(launches) - 1:       # the buffer holds the last chunk once all are made
                want = gb.sorted_rows_torch(token_major[:, cols], align, top_k)[:npad]
                assert torch.equal(descs[by_token].base[:npad], want)
            assert [d.block_shape for d in descs] == [[64, tiles.block_n], [64, tiles.block_c]]
        # The store view starts i * width rows into the (E * N, C) gradient.
        row0 = i * width
        assert c_desc.base.data_ptr() == grad.data_ptr() + row0 * c * grad.element_size()
        assert list(c_desc.shape) == [e * n - row0, c]
        assert c_desc.block_shape == [tiles.block_n, tiles.block_c]
    if launch == "down-chunked":
        assert all(args[0].base is launches[0][1][0].base for _, args, _ in launches)   # one buffer


def test_gluon_wgrad_gathers_operands_as_they_lie_or_a_copy():
    """The by-token operand reaches the kernel as it lies when its rows are 16-byte copies (unit
    column stride, row stride and base 16-byte aligned: a contiguous tensor, a column slice of wider
    rows, one row broadcast to all), else as a contiguous copy of the same values (a column
    broadcast, a transposed view, a view starting off a 16-byte boundary)."""
    wide = torch.randn(6, 128).bfloat16()
    for ok in (torch.randn(6, 64).bfloat16(), wide[:, 64:], torch.randn(1, 64).bfloat16().expand(6, 64)):
        assert gb._gather_operand(ok) is ok
    flat = torch.randn(6 * 64 + 1).bfloat16()
    for bad in (torch.randn(6, 1).bfloat16().expand(6, 64), torch.randn(64, 6).bfloat16().t(),
                flat[1:].view(6, 64)):
        got = gb._gather_operand(bad)
        assert got.is_contiguous() and got.data_ptr() % 16 == 0 and torch.equal(got, bad)


def test_gluon_a_chunks_and_launch_arguments_refused():
    """d down's dout is copied in GLUON_A_CHUNKS column chunks when each is a whole number of the
    tiles' rows, else whole; `gluon_wgrad` refuses a chunk that does not fit the gradient, a gathered
    A that is not all of it, and mixed dtypes, and `sorted_rows` an out buffer of another shape or
    dtype, naming them, before any launch."""
    pp = GLUON_PP_WGRAD
    assert gb.gluon_a_chunks(2048, pp) == gb.gluon_a_chunks(512, pp) == gb.GLUON_A_CHUNKS == 4
    assert [gb.gluon_a_chunks(n, pp) for n in (128, 384, 768)] == [1, 1, 1]
    out = torch.empty(2, 256, 128, dtype=torch.bfloat16)
    row_starts = torch.zeros(3, dtype=torch.int32)
    a, b = torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    for n_base in (-128, 64, 256):     # outside [0, N - Na], or not a multiple of block_n
        with pytest.raises(ValueError, match="n_base"):
            gb.gluon_wgrad(a, b, row_starts, out, pp, n_base=n_base)
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    align = align_block_size(ids, 2, 64, backend="torch")
    with pytest.raises(ValueError, match="a gathered A whole"):
        gb.gluon_wgrad(a, b, row_starts, out, pp, gather_a=(align, 2))          # 128 of N = 256 columns
    with pytest.raises(ValueError, match="16-bit dtype"):
        gb.gluon_wgrad(a.half(), b, row_starts, out, pp)
    t = torch.randn(2, 8)
    for bad in (torch.empty(align.sorted_ids.numel(), 9), torch.empty(align.sorted_ids.numel(), 8,
                                                                       dtype=torch.float16)):
        with pytest.raises(ValueError, match="sorted_rows: out must be"):
            gb.sorted_rows(t, align, 2, out=bad)


def test_moekit_imports_without_gluon():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton.experimental.gluon' or name.startswith('triton.experimental.gluon.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import moekit.grouped_gemm.gluon_wgrad as k, moekit.grouped_gemm.backward as gb\n"
        "assert k.GLUON_AVAILABLE is False and k.gluon_wgrad_kernel is None, k.GLUON_ERROR\n"
        "assert 'blocked' in k.GLUON_ERROR\n"
        "import moekit.experts.triton\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")


# ---- the sm_90 compile check (tools/aot_compile_check.py) ----------------------------------------

def test_gluon_wgrad_kernel_compiles_for_sm90_without_spills():
    """The Hopper Gluon weight gradient's two tiles (bf16 and fp16; sorted operands, and A or B
    gathered from its token rows by the producer) and the row gather kernel, through ptxas
    for sm_90 (skipped where this Triton has no Gluon, CUDA backend or ptxas)."""
    out = aot_compile_check("--gluon-wgrad", "--regs")
    assert "9/9 gluon wgrad kernels compile" in out
    lines = [line for line in out.splitlines() if line.startswith("gluon-wgrad ")]
    assert sum(".gather-a" in line for line in lines) == 4
    assert len(lines) == 9 and all(" OK " in line and "r " in line and " local " not in line
                                   for line in lines), lines


# ---- GPU -----------------------------------------------------------------------------------------

hopper = pytest.mark.skipif(not (hopper_with_gluon() and gluon_kernels.GLUON_AVAILABLE),
                            reason="needs compute capability 9 and Gluon")
OLMOE = (64, 2048, 1024, 8)            # E, H, I, K: an OLMoE-like shape
QWEN = tuple(getattr(PRESETS["qwen3-30b-a3b"], f) for f in ("num_experts", "hidden_size",
                                                            "intermediate_size", "top_k"))
GPU_CASES = [  # (name, (E, H, I, K), T, routing, align block size)
    ("qwen-T1", QWEN, 1, "softmax", 64),
    ("qwen-T64", QWEN, 64, "softmax", 64),
    ("qwen-T1000", QWEN, 1000, "softmax", 64),
    ("qwen-T4096", QWEN, 4096, "softmax", 64),
    ("qwen-T1000-m128", QWEN, 1000, "softmax", 128),
    ("olmoe-T1000", OLMOE, 1000, "softmax", 64),
    ("olmoe-T4096-coop", OLMOE, 4096, "softmax", 64),      # 512 rows an expert: cooperative tiles
    ("qwen-T1000-one-expert", QWEN, 1000, "one-expert", 64),
    ("qwen-T1000-sentinels", QWEN, 1000, "sentinels", 64),
    ("qwen-T333-strided", QWEN, 333, "softmax", 64),        # x and dout: column halves of (T, 2H) rows
]


def gpu_case(shape, num_tokens, kind, block_m, seed=0, strided=False):
    """Inputs of the two weight-gradient launches as the backward makes them: dpre_w and h_w random,
    zero on every padding row (`swiglu_backward` writes them so); the last expert gets no pairs.
    strided: x and dout are views with a row stride of 2H (the kernel gathers their rows as they lie)."""
    num_experts, hidden, inter, top_k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    _, ids = softmax_routing(num_tokens, num_experts, top_k, generator=gen, kind=kind)
    align = align_block_size(ids, num_experts, block_m, backend="triton")
    rows = align.sorted_ids.numel()

    def randn(*size):
        return torch.randn(*size, device="cuda", generator=gen).to(torch.bfloat16)

    if strided:
        x, dout = randn(num_tokens, 2 * hidden)[:, hidden:], randn(num_tokens, 2 * hidden)[:, :hidden]
    else:
        x, dout = randn(num_tokens, hidden), randn(num_tokens, hidden)
    dpre_w, h_w = randn(rows, 2 * inter), randn(rows, inter)
    pad = align.sorted_ids >= align.num_pairs
    dpre_w[pad], h_w[pad] = 0, 0
    return ids, align, x, dout, dpre_w, h_w


@pytest.fixture
def gluon_spy(monkeypatch):
    """The tiles of every `gluon_wgrad` launch `wgrad` makes."""
    launched = []
    real = gb.gluon_wgrad

    def spy(a, b, row_starts, out, tiles, **kwargs):
        launched.append(tiles)
        return real(a, b, row_starts, out, tiles, **kwargs)

    monkeypatch.setattr(gb, "gluon_wgrad", spy)
    monkeypatch.delenv(gb.GLUON_WGRAD_ENV, raising=False)
    monkeypatch.delenv(WGRAD_ENV, raising=False)
    return launched


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gluon_wgrad_within_twice_plain_pytorch_gpu(case, gluon_spy):
    name, shape, num_tokens, kind, block_m = case
    ids, align, x, dout, dpre_w, h_w = gpu_case(shape, num_tokens, kind, block_m,
                                                strided=name.endswith("-strided"))
    top_k = shape[3]
    starts = align.row_starts()
    bf16 = torch.bfloat16

    def run():
        with poisoning():
            return (gb.gate_up_proj_grad(dpre_w, x, None, align, top_k, bf16, padding_zero=True,
                                         row_starts=starts),
                    gb.down_proj_grad(dout, h_w, None, align, top_k, bf16, padding_zero=True,
                                      row_starts=starts))

    got = run()
    want = (gb.gate_up_proj_grad_torch(dpre_w, x, None, align, top_k),
            gb.down_proj_grad_torch(dout, h_w, None, align, top_k))
    plain = (gb.wgrad_torch(dpre_w, x, None, align, top_k, a_by_token=False, b_by_token=True,
                            compute_dtype=bf16),
             gb.wgrad_torch(dout, h_w, None, align, top_k, a_by_token=True, b_by_token=False,
                            compute_dtype=bf16))
    wanted_tiles = gluon_wgrad_tiles(align.num_pairs / shape[0])
    # d gate_up once; d down once (gathering dout's rows, on the cooperative tiles) up to GATHER_A_ROWS
    # rows an expert, else once a column chunk of its copy of dout
    gathering = gb.gathers_a(align.num_pairs, shape[0])
    down_tiles = GLUON_COOP_WGRAD if gathering else wanted_tiles
    down_launches = 1 if gathering else gb.gluon_a_chunks(shape[1], wanted_tiles)
    assert gluon_spy == [wanted_tiles] + [down_tiles] * down_launches, gluon_spy
    assert (wanted_tiles == GLUON_COOP_WGRAD) is name.endswith("-coop")
    valid = (ids >= 0) & (ids < shape[0])
    empty = torch.ones(shape[0], dtype=torch.bool, device="cuda")
    empty[ids[valid].long()] = False
    assert empty.any()
    for launch, g, ref, base in zip(("gate_up", "down"), got, want, plain, strict=True):
        assert g.dtype == bf16 and g.shape == ref.shape
        assert rel_err(g, ref) <= 2 * rel_err(base, ref), (launch, rel_err(g, ref), rel_err(base, ref))
        assert torch.equal(g[empty], torch.zeros_like(g[empty])), launch      # NaN (unwritten) fails too
    again = run()
    assert all(torch.equal(g, g2) for g, g2 in zip(got, again, strict=True))   # bitwise reproducible


@pytest.mark.gpu
@hopper
def test_gluon_wgrad_switch_off_runs_the_triton_kernels_gpu(gluon_spy, monkeypatch):
    ids, align, x, dout, dpre_w, h_w = gpu_case(QWEN, 1000, "softmax", 64)
    on = gb.down_proj_grad(dout, h_w, None, align, QWEN[3], torch.bfloat16, padding_zero=True)
    launched = len(gluon_spy)
    assert launched == 1                                      # 62.5 rows an expert: dout gathered
    monkeypatch.setenv(gb.GLUON_WGRAD_ENV, "0")
    off = gb.down_proj_grad(dout, h_w, None, align, QWEN[3], torch.bfloat16, padding_zero=True)
    assert len(gluon_spy) == launched
    ref = gb.down_proj_grad_torch(dout, h_w, None, align, QWEN[3])
    assert rel_err(on, ref) < 1e-2 and rel_err(off, ref) < 1e-2


@pytest.mark.gpu
@hopper
def test_gluon_wgrad_through_moe_experts_autograd_gpu(gluon_spy):
    """The training step's backward (moe_experts, backend "triton") at T = 1000 with an align block
    size of 64: both weight gradients take the Gluon kernel; all four gradients within 2x plain bf16
    PyTorch's error (the fp32 reference through torch autograd), deterministic, no host sync."""
    num_tokens = 1000
    config = dataclasses.replace(get_config(PRESETS["qwen3-30b-a3b"], num_tokens, torch.bfloat16, "cuda"),
                                 block_m=64)
    check_training_step(lambda *a: moe_experts(*a, backend="triton", config=config), QWEN, num_tokens)
    # two backwards (the second one checked bitwise, with no host sync): d gate_up and d down (62.5 rows
    # an expert: dout's rows gathered, no copy, on the cooperative tiles) once each
    assert gluon_spy == [GLUON_PP_WGRAD, GLUON_COOP_WGRAD] * 2, gluon_spy
