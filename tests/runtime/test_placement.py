"""Expert placement: contiguous blocks, hot-expert replication, pair assignment, per-rank problems."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moekit import moe_experts
from moekit.bench.scenarios import SCENARIOS, expert_loads, make_scenario
from moekit.bench.simulate import StepTime, rank_problem
from moekit.placement import (
    PLACEMENTS,
    Placement,
    assign,
    contiguous_placement,
    rank_loads,
    rank_weights,
    replicate_hot_experts,
    strided_placement,
)
from moekit.reference import moe_experts_ref


def test_contiguous_placement_blocks():
    p = contiguous_placement(7, 3, spare_slots=2)
    assert p.slots == ((0, 1, 2), (3, 4), (5, 6))
    assert p.slots_per_rank == 5 and p.num_ranks == 3 and p.num_replicas == 0
    assert contiguous_placement(8, 8).slots == tuple((e,) for e in range(8))
    with pytest.raises(ValueError, match="num_ranks"):
        contiguous_placement(4, 5)
    with pytest.raises(ValueError, match="spare_slots"):
        contiguous_placement(4, 2, -1)


def test_strided_placement_spreads_neighbouring_experts():
    p = strided_placement(7, 3, spare_slots=1)
    assert p.slots == ((0, 3, 6), (1, 4), (2, 5)) and p.slots_per_rank == 4
    loads = expert_loads(make_scenario("collapse", 30, 8, 4)[1], 8)
    assert rank_loads(loads, strided_placement(8, 4)) == [30, 30, 30, 30]
    assert rank_loads(loads, contiguous_placement(8, 4)) == [60, 60, 0, 0]


@pytest.mark.parametrize(
    "num_experts, slots, per_rank, match",
    [(3, ((0, 1), (1,)), 2, "held by no rank"), (2, ((0, 0), (1,)), 2, "twice"),
     (3, ((0, 1), (2,)), 1, "slots_per_rank"), (2, ((0, 5), (1,)), 2, "outside")],
    ids=["missing", "twice", "too-many", "out-of-range"],
)
def test_placement_rejects_bad_slots(num_experts, slots, per_rank, match):
    with pytest.raises(ValueError, match=match):
        Placement(num_experts, slots, per_rank)


@pytest.mark.parametrize(
    "slots, per_rank, match",
    [(((0, 1, 2), (3, 4, 0)), 5 / 2 + 1, r"slots_per_rank must be an int"),
     (((0, 1, 2), (3, 4, 0)), 3.0, r"slots_per_rank must be an int"),
     (((0, 1, 2), (3, 4, 0)), True, r"slots_per_rank must be an int"),
     (((0, 1, 2), (3, 4.7, 0)), 3, r"slots\[1\]\[1\] must be an int")],
    ids=["float-per-rank", "integral-float-per-rank", "bool-per-rank", "float-id"],
)
def test_placement_rejects_non_int_slots(slots, per_rank, match):
    # assign() splits rank * slots_per_rank + i with //: a float there or a truncated float id
    # would send pairs to the wrong rank or expert without an error.
    with pytest.raises(TypeError, match=match):
        Placement(5, slots, per_rank)


def test_placement_takes_numpy_and_tensor_ints():
    p = Placement(5, ((0, 1, 2), (np.int64(3), torch.tensor(4), 0)), np.int32(3))
    assert p.slots == ((0, 1, 2), (3, 4, 0)) and type(p.slots_per_rank) is int
    ids = torch.tensor([[3], [4], [0], [0]])
    a = assign(ids, p)
    assert a.rank.flatten().tolist() == [1, 1, 0, 1] and a.local_ids.flatten().tolist() == [0, 1, 0, 2]


def _random_placement(rng: random.Random, num_experts: int, num_ranks: int, spare: int) -> Placement:
    base = contiguous_placement(num_experts, num_ranks, spare)
    slots = [list(s) for s in base.slots]
    for r in range(num_ranks):
        choices = [e for e in range(num_experts) if e not in slots[r]]
        rng.shuffle(choices)
        slots[r] += choices[: rng.randint(0, spare)]
    return Placement(num_experts, tuple(tuple(s) for s in slots), base.slots_per_rank)


@pytest.mark.parametrize("source_rank", [0, 1, 5])
@pytest.mark.parametrize("num_experts, num_ranks, top_k", [(8, 4, 2), (13, 3, 4), (6, 6, 1)],
                         ids=["E8-N4-K2", "E13-N3-K4", "E6-N6-K1"])
def test_assign_matches_predicted_loads(num_experts, num_ranks, top_k, source_rank):
    rng = random.Random(num_experts * 100 + source_rank)
    for name in SCENARIOS:
        _, ids = make_scenario(name, 101, num_experts, top_k, seed=rng.randint(0, 99))
        ids[3, 0] = -1                      # expert-parallel sentinel and an id past E: run nowhere
        ids[7, -1] = num_experts
        placement = _random_placement(rng, num_experts, num_ranks, spare=2)
        a = assign(ids, placement, source_rank=source_rank)
        loads = expert_loads(ids, num_experts)
        assert a.pairs_per_rank().tolist() == rank_loads(loads, placement, source_rank)
        valid = (ids >= 0) & (ids < num_experts)
        assert torch.equal(a.rank < 0, ~valid) and torch.equal(a.local_ids < 0, ~valid)
        for (t, k) in valid.nonzero().tolist():
            r, i = int(a.rank[t, k]), int(a.local_ids[t, k])
            assert placement.slots[r][i] == int(ids[t, k])
        # Copies of one expert share its pairs evenly (round-robin: at most one apart).
        for e, copies in enumerate(placement.copies):
            got = [int(((ids == e) & (a.rank == r)).sum()) for r, _ in copies]
            assert sum(got) == int(loads[e]) and max(got) - min(got) <= 1


def test_assign_without_replicas_skips_the_sort(monkeypatch):
    """No expert has a second copy: every pair runs on copy 0, read from a table (no sort), and ids
    outside [0, E) (int64 ones past 2**32 included) run nowhere; with replicas the sort is back."""
    import moekit.placement as placement_mod

    calls = []
    real = placement_mod.sort_pairs
    monkeypatch.setattr(placement_mod, "sort_pairs", lambda *a: calls.append(1) or real(*a))
    for placement in (contiguous_placement(13, 3, spare_slots=1), strided_placement(13, 5)):
        for dtype in (torch.int32, torch.int64):
            ids = torch.randint(0, 13, (41, 3), dtype=dtype)
            ids[0, 0], ids[1, 2], ids[2, 1] = -1, 13, -7
            if dtype == torch.int64:
                ids[3, 0] = 2**32 + 2
            a = assign(ids, placement, source_rank=2)
            assert a.rank.dtype == a.local_ids.dtype == torch.int32 and a.rank.shape == ids.shape
            for (t, k), e in zip(torch.cartesian_prod(torch.arange(41), torch.arange(3)).tolist(),
                                 ids.reshape(-1).tolist(), strict=True):
                want = next(((r, s.index(e)) for r, s in enumerate(placement.slots) if e in s), (-1, -1))
                assert (int(a.rank[t, k]), int(a.local_ids[t, k])) == want
    assert not calls
    replicated = Placement(4, ((0, 1, 2), (2, 3)), 3)
    assign(torch.tensor([[2, 0]]), replicated)
    assert calls


def test_replication_hand_example():
    base = contiguous_placement(4, 2, spare_slots=1)           # rank 0: {0, 1}, rank 1: {2, 3}
    p = replicate_hot_experts([10, 0, 1, 1], base)
    # Copy expert 0 to rank 1 ([10, 2] -> [5, 7]), then expert 2 to rank 0: its one pair stays on
    # copy 0 (rank 0), which takes 1 from rank 1 -> [6, 6].
    assert p.slots == ((0, 1, 2), (2, 3, 0))
    assert rank_loads([10, 0, 1, 1], p) == [6, 6]
    # Without free slots nothing can move.
    assert replicate_hot_experts([10, 0, 1, 1], contiguous_placement(4, 2)).slots == base.slots


@pytest.mark.parametrize("num_experts, num_ranks, spare", [(8, 4, 1), (16, 4, 2), (13, 5, 3), (6, 2, 4)],
                         ids=["E8-N4-R1", "E16-N4-R2", "E13-N5-R3", "E6-N2-R4"])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_replication_respects_slots_and_never_slows_the_slowest_rank(num_experts, num_ranks, spare, kind):
    base = PLACEMENTS[kind](num_experts, num_ranks, spare)
    gen = torch.Generator().manual_seed(num_experts + spare)
    load_sets = [expert_loads(make_scenario(n, 500, num_experts, 2, seed=1)[1], num_experts)
                 for n in SCENARIOS]
    load_sets += [torch.randint(0, 50, (num_experts,), generator=gen) for _ in range(20)]
    load_sets += [torch.zeros(num_experts, dtype=torch.int64)]
    for loads in load_sets:
        p = replicate_hot_experts(loads, base)
        assert all(len(s) <= base.slots_per_rank for s in p.slots)
        assert all(s[: len(b)] == b for s, b in zip(p.slots, base.slots, strict=True))
        before, after = rank_loads(loads, base), rank_loads(loads, p)
        assert max(after) <= max(before)
        assert sum(after) == sum(before) == int(loads.sum())
        if p.num_replicas:                       # a copy is only kept when it helps
            assert sorted(after, reverse=True) < sorted(before, reverse=True)


def test_replication_relieves_collapse():
    e, n, k = 16, 4, 4
    loads = expert_loads(make_scenario("collapse", 64, e, k)[1], e)
    base = contiguous_placement(e, n, spare_slots=2)
    before = rank_loads(loads, base)
    after = rank_loads(loads, replicate_hot_experts(loads, base))
    assert before == [256, 0, 0, 0]
    # 4 hot experts on rank 0, 6 free slots elsewhere: the best split leaves rank 0 with
    # 64/3 + 64/3 + 64/2 + 64/2 ~ 107 pairs; the greedy must at least halve the step.
    assert max(after) <= max(before) // 2


@pytest.mark.parametrize("name", ["zipf-1.0", "collapse", "hot"])
def test_rank_problems_add_up_to_the_layer(name):
    e, h, i, k, t = 8, 24, 20, 3, 37
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    w, ids = make_scenario(name, t, e, k, seed=4)
    ids[0, 0] = -1
    loads = expert_loads(ids, e)
    placement = replicate_hot_experts(loads, contiguous_placement(e, 3, spare_slots=2))
    a = assign(ids, placement)
    out = torch.zeros(t, h)
    total_pairs = 0
    for r in range(placement.num_ranks):
        p = rank_problem(x, w, a, r, rank_weights(gate_up, down, placement, r))
        assert p.topk_ids.shape[1] <= min(k, len(placement.slots[r]))
        assert p.num_pairs == int((p.topk_ids >= 0).sum()) == int((a.rank == r).sum())
        assert bool(((p.topk_ids >= 0).sum(1) > 0).all())   # only tokens with work on r
        total_pairs += p.num_pairs
        y = moe_experts(p.hidden_states, p.gate_up_proj, p.down_proj, p.topk_weights, p.topk_ids,
                        backend="loop", ignore_invalid_ids=True)
        out.index_add_(0, p.token_idx, y)
    assert total_pairs == int(loads.sum())
    torch.testing.assert_close(out, moe_experts_ref(x, gate_up, down, w, ids))


def test_rank_without_pairs_gives_an_empty_problem():
    e = 4
    ids = torch.tensor([[0, 1], [1, 0]])
    placement = contiguous_placement(e, 2)
    p = rank_problem(torch.randn(2, 8), torch.ones(2, 2), assign(ids, placement), 1,
                     rank_weights(torch.randn(e, 6, 8), torch.randn(e, 8, 3), placement, 1))
    assert p.num_pairs == 0 and p.hidden_states.shape == (0, 8) and p.topk_ids.shape == (0, 1)


def test_step_time():
    s = StepTime((1.0, 3.0, 2.0))
    assert s.step_ms == 3.0 and s.mean_ms == 2.0 and s.slowest_over_mean == 1.5 and s.slowest_rank == 1


@pytest.mark.gpu
def test_assign_on_cuda_matches_cpu_and_captures():
    e = 16
    _, ids = make_scenario("zipf-1.0", 300, e, 4, seed=1)
    placement = replicate_hot_experts(expert_loads(ids, e), contiguous_placement(e, 4, 2))
    ref = assign(ids, placement, source_rank=2)
    dev_ids = ids.cuda()
    tables = placement.copy_table("cuda")
    got = assign(dev_ids, placement, source_rank=2, tables=tables)
    assert torch.equal(got.rank.cpu(), ref.rank) and torch.equal(got.local_ids.cpu(), ref.local_ids)
    assign(dev_ids, placement, source_rank=2, tables=tables)      # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = assign(dev_ids, placement, source_rank=2, tables=tables)
    dev_ids.copy_(torch.flip(ids, dims=[0]).cuda())
    graph.replay()
    want = assign(torch.flip(ids, dims=[0]), placement, source_rank=2)
    assert torch.equal(captured.rank.cpu(), want.rank)


@pytest.mark.parametrize("what", ["more-experts", "fewer-experts", "down-experts", "rank-past",
                                  "rank-negative", "rank-bool"])
def test_rank_weights_refuses_weights_or_a_rank_the_placement_does_not_fit(what):
    """Weights of another expert count (it had returned the wrong experts, or an IndexError) and ranks
    outside [0, num_ranks) raise naming the argument."""
    placement = contiguous_placement(4, 2)
    gate_up, down, r = torch.randn(4, 6, 8), torch.randn(4, 8, 3), 1
    if what == "more-experts":
        gate_up = torch.randn(8, 6, 8)
    elif what == "fewer-experts":
        gate_up = torch.randn(3, 6, 8)
    elif what == "down-experts":
        down = torch.randn(5, 8, 3)
    else:
        r = {"rank-past": 2, "rank-negative": -1, "rank-bool": True}[what]
    name = {"more-experts": "gate_up_proj", "fewer-experts": "gate_up_proj", "down-experts": "down_proj"}.get(
        what, "r")
    with pytest.raises((ValueError, TypeError), match=rf"^{name} "):
        rank_weights(gate_up, down, placement, r)
