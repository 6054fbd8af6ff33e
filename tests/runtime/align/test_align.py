"""Align: both backends equal, field by field, to the tests' own pair-by-pair construction.

`helpers.align_ref` builds the expected Alignment in plain Python (never from moekit's torch
backend, which would grade the triton one); integer metadata compares exactly. The triton backend
runs with its workspaces poisoned (`moekit._workspace.poisoning`), so a sentinel row no kernel
writes shows up as the poison.
"""

import pytest
import torch

import moekit.align as align_mod
from helpers import align_ref, aot_compile_check, assert_alignment_equals, distinct_topk_ids
from moekit import align_block_size
from moekit._workspace import poisoning
from moekit.align import FUSED_MAX_PAIRS, ONE_LAUNCH_CANDIDATE
from moekit.bench.launches import patched_runs


def _both(ids, num_experts, block_m):
    expected = align_ref(ids, num_experts, block_m)
    for backend in ("torch", "triton"):
        with poisoning():
            a = align_block_size(ids, num_experts, block_m, backend=backend)
        assert a.block_m == block_m and a.num_pairs == ids.numel()
        assert_alignment_equals(a, expected)
    return a


CASES = [  # (T, E, K, block_m)
    (1, 8, 2, 16), (4, 4, 2, 2), (13, 7, 3, 4), (31, 60, 7, 16), (3, 5, 5, 3), (17, 1, 1, 8),
    (FUSED_MAX_PAIRS // 8 + 37, 128, 8, 64),   # multi-chunk (one launch by default), an empty expert
    (150, 257, 8, 16),                          # E not a power of two, multi-chunk path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-K{}-bm{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_random_routing(case, dtype):
    num_tokens, num_experts, top_k, block_m = case
    ids = distinct_topk_ids(num_tokens, num_experts, top_k, dtype=dtype)
    _both(ids, num_experts, block_m)


@pytest.mark.parametrize("num_tokens", [1, 5, 600, FUSED_MAX_PAIRS])   # the last: the fused kernel, full
def test_all_pairs_on_one_expert(num_tokens):
    ids = torch.zeros(num_tokens, 1, dtype=torch.int32)
    a = _both(ids, 16, 8)
    assert int(a.tokens_per_expert[0]) == num_tokens and int(a.tokens_per_expert[1:].sum()) == 0


def test_collapse_and_duplicates_in_a_row():
    ids = torch.tensor([[3, 3], [3, 1], [1, 1]], dtype=torch.int64)
    _both(ids, 4, 2)
    _both(torch.arange(4).repeat(300, 1), 6, 32)   # 1200 pairs on experts 0..3, experts 4, 5 empty


def test_invalid_ids_are_never_placed():
    ids = torch.tensor([[0, -1], [5, 2], [2, 9], [-7, 1]], dtype=torch.int32)
    a = _both(ids, 4, 4)
    assert int(a.tokens_per_expert.sum()) == 4          # 0, 2, 2, 1


def test_zero_tokens():
    a = _both(torch.empty(0, 4, dtype=torch.int32), 8, 16)
    assert int(a.num_padded) == 0 and a.sorted_ids.numel() == 0


def test_hand_worked_example():
    # pairs: 0:e2 1:e0 2:e1 3:e2 4:e3 5:e2 6:e0 7:e3; e2 holds 3 pairs -> two blocks of 2
    ids = torch.tensor([[2, 0], [1, 2], [3, 2], [0, 3]])
    a = _both(ids, 4, 2)
    assert a.sorted_ids.tolist()[:10] == [1, 6, 2, 8, 0, 3, 5, 8, 4, 7]
    assert a.expert_ids.tolist()[:5] == [0, 1, 2, 2, 3]
    assert int(a.num_padded) == 10


def test_bad_inputs():
    with pytest.raises(TypeError, match="topk_ids"):
        align_block_size(torch.zeros(2, 2), 4, 4)
    with pytest.raises(ValueError, match="num_experts"):
        align_block_size(torch.zeros(2, 2, dtype=torch.int32), 0, 4)
    with pytest.raises(ValueError, match="block_m"):
        align_block_size(torch.zeros(2, 2, dtype=torch.int32), 4, 0)
    with pytest.raises(ValueError, match="backend"):
        align_block_size(torch.zeros(2, 2, dtype=torch.int32), 4, 4, backend="cuda")


def test_experts_above_the_triton_limit():
    from moekit.align import MAX_TRITON_EXPERTS

    num_experts = MAX_TRITON_EXPERTS + 1
    ids = torch.tensor([[num_experts - 1, 0], [5, 4000]], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"num_experts <= {MAX_TRITON_EXPERTS}"):
        align_block_size(ids, num_experts, 16, backend="triton")
    a = align_block_size(ids, num_experts, 16)            # auto takes the torch path: still right
    assert_alignment_equals(a, align_ref(ids, num_experts, 16))


def test_size_bounds_hold_for_every_block_m():
    """pre_rows_bound and packed_bound: at least L and packed_size for every power-of-two block_m up
    to BLOCK_M_BOUND (the sizes moekit::experts_train gives when no config fixes block_m)."""
    from moekit.align import BLOCK_M_BOUND, packed_bound, packed_size, padded_length, pre_rows_bound

    for num_pairs in (0, 1, 2, 7, 16, 100, 1023, 131072):
        for num_experts in (1, 3, 8, 128, 256):
            for block_m in (2**i for i in range(BLOCK_M_BOUND.bit_length())):
                sizes = (num_pairs, num_experts, block_m)
                assert pre_rows_bound(num_pairs, num_experts) >= padded_length(*sizes)
                assert packed_bound(num_pairs, num_experts) >= packed_size(*sizes)
            top = padded_length(num_pairs, num_experts, BLOCK_M_BOUND)
            assert pre_rows_bound(num_pairs, num_experts) == top


@pytest.mark.parametrize("counts,block_m", [
    ([0], 16), ([5], 64), ([0, 0, 0], 64), ([3, 0, 17, 64, 65, 1, 0], 64), ([1] * 129, 128),
    (list(range(0, 300, 7)), 16),
])
def test_row_starts_kernel_matches_its_twin(counts, block_m):
    """`row_starts_kernel` (interpreted here; CUDA's `Alignment.row_starts` launches it) against the
    torch twin, exactly, on empty experts, one expert, and E not a power of two; the output poisoned
    first (every element must be written)."""
    from moekit._host import next_power_of_2
    from moekit.align import Alignment
    from moekit.align.kernels import row_starts_kernel

    tpe = torch.tensor(counts, dtype=torch.int32)
    e = tpe.numel()
    align = Alignment(torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32),
                      torch.zeros(1, dtype=torch.int32), tpe, block_m, int(tpe.sum()),
                      torch.empty(0, dtype=torch.int32))
    out = torch.full((e + 1,), -7, dtype=torch.int32)
    row_starts_kernel[(1,)](tpe, out, e, BLOCK_M=block_m, E_POW2=max(16, next_power_of_2(e)))
    want = align.row_starts_torch()
    assert torch.equal(out, want) and torch.equal(align.row_starts(), want)   # the CPU takes the twin
    assert int(want[0]) == 0 and int(want[-1]) == sum(-(-c // block_m) * block_m for c in counts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens,num_experts,block_m", [(1, 128, 64), (4096, 128, 64), (999, 60, 128),
                                                           (5000, 4096, 16)])
def test_row_starts_launch_matches_its_twin_gpu(num_tokens, num_experts, block_m):
    ids = torch.randint(-1, num_experts + 1, (num_tokens, 8), device="cuda", dtype=torch.int32)
    align = align_block_size(ids, num_experts, block_m)
    got = align.row_starts()
    assert got.dtype == torch.int32 and torch.equal(got, align.row_starts_torch())
    assert torch.equal(got[-1], align.num_padded.to(torch.int32))


@pytest.mark.parametrize("kind", ["random", "one-expert", "sentinels"])
def test_fused_expert_ids_writers_agree(monkeypatch, kind):
    """The fused kernel's two ways of writing expert_ids and block_codes (expert by expert, the
    default, and the multi-program kernels' search over experts a block) give the tests' own
    alignment (`helpers.align_ref`), field for field."""
    if kind == "one-expert":
        ids = torch.full((97, 2), 3, dtype=torch.int32)
    else:
        ids = distinct_topk_ids(61, 12, 4)
        if kind == "sentinels":
            ids[0, 0], ids[5, 3] = -1, 12
    for by_expert in (True, False):
        monkeypatch.setattr(align_mod, "FUSED_IDS_BY_EXPERT", by_expert)
        _both(ids, 12, 4)


ALIGN_KERNELS = ("align_scatter_kernel", "align_hist_kernel", "align_scan_kernel", "align_one_launch_kernel")


@pytest.fixture
def launches():
    """The names of the align kernels `align_block_size_triton` launches, in order."""
    names = []

    def wrap(kernel, real):
        def spy(*args, **kwargs):
            names.append(kernel.__name__)
            return real(*args, **kwargs)
        return spy

    with patched_runs([getattr(align_mod, name) for name in ALIGN_KERNELS], wrap):
        yield names


PATHS = {"one": ["align_one_launch_kernel"],
         "three": ["align_hist_kernel", "align_scan_kernel", "align_scatter_kernel"]}


def _set_path(monkeypatch, path):
    """ONE_LAUNCH_MAX_PAIRS for the path: the candidate limit (the default's 4,096) or 0 (the three
    launches), whatever the default is."""
    monkeypatch.setattr(align_mod, "ONE_LAUNCH_MAX_PAIRS", ONE_LAUNCH_CANDIDATE if path == "one" else 0)


def test_one_launch_is_on_by_default(launches):
    """At the default `moekit.align.ONE_LAUNCH_MAX_PAIRS` (4,096: faster than the three launches on
    an H200 at 2,048 and 4,096 pairs), a Qwen3-30B-A3B align (E = 128, K = 8) of 2,048 and 4,096
    pairs is one launch of `align_one_launch_kernel`; one of 4,104 (T = 513), the three."""
    for num_tokens, block_m, path in ((256, 32, "one"), (512, 64, "one"), (513, 64, "three")):
        launches.clear()
        _both(distinct_topk_ids(num_tokens, 128, 8), 128, block_m)
        assert launches == PATHS[path], num_tokens


def _with_invalid(ids, num_experts, count):
    """ids with `count` random slots set to ids outside [0, E): -1, E, and for int64 ids values that
    wrap into [0, E) when truncated to 32 bits (2**32 + 3, -2**32 + 1)."""
    bad = [-1, num_experts, 2**31 - 1]
    if ids.dtype == torch.int64:
        bad += [2**32 + 3, -(2**32) + 1]
    flat = ids.reshape(-1)
    slots = torch.randperm(flat.numel())[:count]
    flat[slots] = torch.tensor(bad, dtype=ids.dtype)[torch.arange(count) % len(bad)]
    return ids


MULTI_CHUNK = [  # (T, E, K, block_m, ids dtype, invalid ids): FUSED_MAX_PAIRS < S <= ONE_LAUNCH_CANDIDATE
    (129, 128, 8, 16, torch.int32, 0),       # S = 1032, just above the fused kernel's limit
    (129, 128, 8, 64, torch.int64, 40),
    (257, 60, 7, 32, torch.int64, 25),       # S = 1799 (prime), E not a power of two
    (331, 257, 5, 16, torch.int32, 9),       # S = 1655, E_PAD 512
    (150, 1000, 8, 3, torch.int32, 5),       # block_m not a power of two, most experts empty
    (600, 4, 3, 128, torch.int64, 0),        # S = 1800 on 3 of 4 experts, block_m 128
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", MULTI_CHUNK, ids=lambda c: "T{}-E{}-K{}-bm{}-{}-bad{}".format(
    *c[:4], str(c[4])[-5:], c[5]))
def test_multi_chunk_paths(monkeypatch, launches, case, path):
    """One launch (`align_one_launch_kernel`, ONE_LAUNCH_MAX_PAIRS at ONE_LAUNCH_CANDIDATE, the
    default) and the three (ONE_LAUNCH_MAX_PAIRS = 0) each give the tests' own alignment exactly,
    sentinel rows included, with invalid ids mixed in and an expert without pairs
    (`distinct_topk_ids` leaves E - 1 out)."""
    num_tokens, num_experts, top_k, block_m, dtype, invalid = case
    _set_path(monkeypatch, path)
    ids = _with_invalid(distinct_topk_ids(num_tokens, num_experts, top_k, dtype=dtype), num_experts, invalid)
    assert FUSED_MAX_PAIRS < ids.numel() <= ONE_LAUNCH_CANDIDATE
    a = _both(ids, num_experts, block_m)
    assert launches == PATHS[path]
    assert int(a.tokens_per_expert.sum()) == int(((ids >= 0) & (ids < num_experts)).sum())


@pytest.mark.parametrize("path", PATHS)
def test_multi_chunk_all_pairs_on_one_expert(monkeypatch, launches, path):
    _set_path(monkeypatch, path)
    ids = torch.full((1500, 1), 5, dtype=torch.int32)
    a = _both(ids, 8, 32)
    assert launches == PATHS[path] and int(a.tokens_per_expert[5]) == 1500


def test_one_launch_at_its_limit(monkeypatch, launches):
    """S = ONE_LAUNCH_CANDIDATE (E = 128, K = 8 as Qwen3-30B-A3B): still one launch."""
    _set_path(monkeypatch, "one")
    ids = _with_invalid(distinct_topk_ids(ONE_LAUNCH_CANDIDATE // 8, 128, 8, dtype=torch.int64), 128, 50)
    _both(ids, 128, 64)
    assert launches == PATHS["one"]


def test_one_launch_limit_is_read_at_each_call(monkeypatch, launches):
    ids = distinct_topk_ids(200, 16, 6)                                  # S = 1200
    for limit, path in ((1200, "one"), (1199, "three"), (FUSED_MAX_PAIRS, "three")):
        monkeypatch.setattr(align_mod, "ONE_LAUNCH_MAX_PAIRS", limit)
        launches.clear()
        _both(ids, 16, 16)
        assert launches == PATHS[path], limit


def test_align_kernels_compile_for_sm90_ahead_of_time():
    """Every align kernel compiles for sm_90 as `align_block_size_triton` launches it (no GPU: Triton's
    CUDA backend and ptxas), and the one-launch kernel keeps its registers (no local memory)."""
    text = aot_compile_check("--align", "--regs")
    assert "7/7 align cases compile" in text                     # the script's ALIGN_CASES
    one_launch = [line for line in text.splitlines() if "align_one_launch_kernel" in line]
    assert len(one_launch) == 5 and not any(" local " in line for line in one_launch), one_launch


# int64 ids past int32's range, each of which truncates into [0, E) when cut to 32 bits.
WIDE_IDS = [2**32 + 3, -(2**32) + 2, 2**32, 2**40 + 1, 2**63 - 1, -(2**63), -(2**31) - 1]


@pytest.mark.parametrize("path", ["fused", *PATHS])
def test_int64_ids_past_int32_are_never_placed_on_every_path(monkeypatch, path, device):
    """Both backends give the test's own alignment, field for field, on each kernel path (the
    one-program kernel; a program a chunk; the three launches) when int64 ids lie past int32's range:
    such a pair is counted nowhere and never placed, and every other pair lands as with valid ids."""
    num_tokens = 37 if path == "fused" else 500          # S = 296 or 4,000 pairs (K = 8)
    num_experts, block_m = 16, 16
    if path != "fused":
        _set_path(monkeypatch, path)
    ids = distinct_topk_ids(num_tokens, num_experts, 8, dtype=torch.int64).to(device)
    flat = ids.view(-1)
    flat[::5] = torch.tensor(WIDE_IDS, device=device)[torch.arange(flat[::5].numel(), device=device) % 7]
    expected = align_ref(ids.cpu(), num_experts, block_m)
    for backend in ("torch", "triton"):
        with poisoning():
            got = align_block_size(ids, num_experts, block_m, backend=backend)
        assert_alignment_equals(got, expected)
