"""Align: both backends equal, field by field, to the tests' own pair-by-pair construction.

`helpers.align_ref` builds the expected Alignment in plain Python (never from moekit's torch
backend, which would grade the triton one); integer metadata compares exactly.
"""

import pytest
import torch

from helpers import align_ref, assert_alignment_equals, distinct_topk_ids
from moekit import align_block_size
from moekit.align import FUSED_MAX_PAIRS


def _both(ids, num_experts, block_m):
    expected = align_ref(ids, num_experts, block_m)
    for backend in ("torch", "triton"):
        a = align_block_size(ids, num_experts, block_m, backend=backend)
        assert a.block_m == block_m and a.num_pairs == ids.numel()
        assert_alignment_equals(a, expected)
    return a


CASES = [  # (T, E, K, block_m)
    (1, 8, 2, 16), (4, 4, 2, 2), (13, 7, 3, 4), (31, 60, 7, 16), (3, 5, 5, 3), (17, 1, 1, 8),
    (FUSED_MAX_PAIRS // 8 + 37, 128, 8, 64),   # two-launch path, with an empty expert
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
    from moekit.kernels.align import row_starts_kernel

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
    import moekit.align as align_mod

    if kind == "one-expert":
        ids = torch.full((97, 2), 3, dtype=torch.int32)
    else:
        ids = distinct_topk_ids(61, 12, 4)
        if kind == "sentinels":
            ids[0, 0], ids[5, 3] = -1, 12
    for by_expert in (True, False):
        monkeypatch.setattr(align_mod, "FUSED_IDS_BY_EXPERT", by_expert)
        _both(ids, 12, 4)
