"""Routing scenarios: K distinct in-range ids per token, matching weights, the intended skew, seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moekit.bench.scenarios import (
    SCENARIOS,
    balanced,
    busiest_over_mean,
    collapse,
    expert_loads,
    from_file,
    hot,
    make_scenario,
    save_trace,
    zipf,
)

# (T, E, K): tiny, odd and prime, K = 1, K = E, and T smaller than E.
SIZES = [(64, 8, 2), (97, 7, 3), (50, 13, 1), (31, 5, 5), (3, 60, 4)]
SIZE_IDS = [f"T{t}-E{e}-K{k}" for t, e, k in SIZES]


def check_routing(weights: torch.Tensor, ids: torch.Tensor, num_tokens: int, num_experts: int,
                  top_k: int) -> None:
    assert ids.shape == (num_tokens, top_k) and ids.dtype == torch.int32
    assert weights.shape == (num_tokens, top_k) and weights.dtype == torch.float32
    if num_tokens == 0:
        return
    assert int(ids.min()) >= 0 and int(ids.max()) < num_experts
    srt = ids.sort(dim=1).values
    assert not (srt[:, 1:] == srt[:, :-1]).any(), "an expert repeated within a token"
    assert (weights > 0).all()
    torch.testing.assert_close(weights.sum(1), torch.ones(num_tokens))


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_scenario_shape_ids_weights(name, size):
    t, e, k = size
    w, ids = make_scenario(name, t, e, k, seed=3, hidden_size=24)
    check_routing(w, ids, t, e, k)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_is_reproducible_and_empty_ok(name):
    a = make_scenario(name, 200, 16, 4, seed=11)
    b = make_scenario(name, 200, 16, 4, seed=11)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = make_scenario(name, 200, 16, 4, seed=12)
    assert not torch.equal(a[0], c[0])  # the weights always depend on the seed
    check_routing(*make_scenario(name, 0, 16, 4, seed=1), 0, 16, 4)


def test_balanced_counts_differ_by_at_most_one():
    for t, e, k in SIZES:
        loads = expert_loads(balanced(t, e, k, seed=5)[1], e)
        assert int(loads.sum()) == t * k
        assert int(loads.max() - loads.min()) <= 1
    # When E divides T*K every expert gets exactly the mean.
    assert busiest_over_mean(expert_loads(balanced(64, 8, 2)[1], 8)) == 1.0


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_collapse_is_maximum_skew(size):
    t, e, k = size
    loads = expert_loads(collapse(t, e, k, seed=2)[1], e)
    assert loads[:k].tolist() == [t] * k and int(loads[k:].sum()) == 0
    assert busiest_over_mean(loads) == pytest.approx(e / k, rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_hot_experts_are_picked_by_every_token(n):
    t, e, k = 300, 16, 3
    ids = hot(t, e, k, n, seed=9)[1]
    loads = expert_loads(ids, e)
    hot_ids = (loads == t).nonzero().squeeze(1)
    assert hot_ids.numel() >= n  # exactly n unless a cold expert also reaches every token
    for x in hot_ids[:n].tolist():
        assert bool((ids == x).any(1).all())
    assert busiest_over_mean(loads) == pytest.approx(e / k, rel=1e-12)
    assert int(loads.sum()) == t * k


def test_hot_rejects_n_above_top_k():
    with pytest.raises(ValueError, match="n must be an int in"):
        hot(10, 8, 2, 3)


def test_zipf_skew_rises_with_s():
    t, e, k = 4096, 64, 6
    for seed in (0, 1):
        ratios = [busiest_over_mean(expert_loads(zipf(t, e, k, s, seed=seed)[1], e))
                  for s in (0.0, 0.5, 1.0, 1.5)]
        assert all(a < b for a, b in zip(ratios, ratios[1:], strict=False)), ratios
        assert ratios[-1] <= e / k  # one pair per token at most on any expert
    # The hottest expert's share follows the Zipf order: the permutation only relabels experts.
    loads = expert_loads(zipf(t, e, k, 1.5, seed=0)[1], e).sort(descending=True).values
    assert int(loads[0]) > int(loads[4]) > int(loads[20])


def test_make_scenario_names():
    w, ids = make_scenario("hot-1", 40, 8, 2)
    assert int(expert_loads(ids, 8).max()) == 40
    w2, ids2 = make_scenario("zipf-1.0", 40, 8, 2, seed=4)
    assert torch.equal(ids2, zipf(40, 8, 2, 1.0, seed=4)[1])
    for bad in ("zipf", "zipf-x", "nope", "file"):
        with pytest.raises(ValueError):
            make_scenario(bad, 10, 8, 2)
    with pytest.raises(ValueError, match="top_k"):
        make_scenario("balanced", 10, 4, 5)


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_trace_round_trip(tmp_path, suffix):
    w, ids = zipf(37, 9, 3, 1.0, seed=7)
    path = save_trace(tmp_path / f"trace{suffix}", ids, w)
    w2, ids2 = from_file(path, 9)
    assert torch.equal(ids2, ids)
    if suffix == ".pt":
        assert torch.equal(w2, w)
    else:  # .npy keeps ids only: equal weights
        torch.testing.assert_close(w2, torch.full((37, 3), 1 / 3))
    # Longer replays cycle through the trace; shorter ones take its first rows.
    w3, ids3 = make_scenario("file", 80, 9, 3, trace=path)
    assert torch.equal(ids3, ids[torch.arange(80) % 37])
    assert torch.equal(from_file(path, 9, num_tokens=5)[1], ids[:5])
    assert not list(tmp_path.glob(".trace*")), "temporary file left behind"


def test_trace_bad_files_name_the_file(tmp_path):
    cases = {
        "garbage.pt": lambda p: p.write_bytes(b"not a torch file"),
        "flat.npy": lambda p: np.save(p, np.arange(6)),
        "float.npy": lambda p: np.save(p, np.zeros((3, 2))),
        "range.npy": lambda p: np.save(p, np.array([[0, 8], [1, 2]])),
        "dup.npy": lambda p: np.save(p, np.array([[1, 1], [1, 2]])),
        "weights.pt": lambda p: torch.save({"topk_ids": torch.zeros(4, 2, dtype=torch.int64),
                                            "topk_weights": torch.ones(3, 2)}, p),
        "nokey.pt": lambda p: torch.save({"x": torch.zeros(2, 2)}, p),
        "trace.txt": lambda p: p.write_text("0 1"),
    }
    for name, make in cases.items():
        path = tmp_path / name
        make(path)
        with pytest.raises(ValueError, match=name):
            from_file(path, 8)
    with pytest.raises(ValueError, match="missing.pt"):
        from_file(tmp_path / "missing.pt", 8)
    np.save(tmp_path / "ok.npy", np.array([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="K=2"):
        from_file(tmp_path / "ok.npy", 8, top_k=3)


def test_trace_of_complex_ids_or_more_ids_than_experts_names_the_file(tmp_path):
    complex_ids, wide = tmp_path / "complex.pt", tmp_path / "wide.npy"
    torch.save(torch.tensor([[0, 1], [2, 3]], dtype=torch.complex64), complex_ids)
    np.save(wide, np.arange(9).reshape(1, 9) % 8)
    cases = ((complex_ids, "expected 2-D integer ids (T, K), got torch.complex64 of shape (2, 2)"),
             (wide, "has K=9 ids per token, more than the layer's 8 experts"))
    for path, problem in cases:
        with pytest.raises(ValueError) as info:
            from_file(path, 8)
        assert str(info.value) == f"routing trace {path}: {problem}"


def test_expert_loads_skip_invalid_ids():
    ids = torch.tensor([[0, -1], [3, 0], [9, 2]])
    assert expert_loads(ids, 4).tolist() == [2, 0, 1, 1]
    assert busiest_over_mean([2, 0, 1, 1]) == 2.0
    assert busiest_over_mean([0, 0]) == 1.0
