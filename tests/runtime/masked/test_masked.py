"""The masked layout (issue 12): each masked kernel against its torch twin, the twins against the fp32
reference, and the `masked` backend's own cases (capacity drops counted by hand, empty experts, K = 1
and K = E, ids outside [0, E), NaN in unused rows). CPU: float32 through the Triton interpreter,
poisoned workspaces. The backend's generic cases run in tests/runtime/experts/test_experts.py etc.
(over BACKENDS).

The hand counts here never call moekit: a pair's rank in its expert is counted in a Python loop over
the pairs in order (`kept_by_hand`), independent of `moekit.align.sort_pairs`.
"""

from __future__ import annotations

import math

import pytest
import torch

import moekit._memory
from helpers import aot_compile_check, poisoned, rel_err
from moekit import ExpertsConfig, masked_experts, moe_experts
from moekit._workspace import poisoning
from moekit.experts import get_backend
from moekit.masked import (
    layout_path_for,
    masked_combine,
    masked_combine_torch,
    masked_dispatch,
    masked_dispatch_torch,
    masked_gemm1_swiglu,
    masked_gemm1_swiglu_torch,
    masked_gemm2,
    masked_gemm2_torch,
    masked_layout,
    masked_layout_torch,
    masked_layout_triton,
    use_layout_path,
)
from moekit.reference import moe_experts_ref

SMALL = ExpertsConfig(block_m=16, block_n1=16, block_k1=16, warps1=4, stages1=1,
                      block_n2=16, block_k2=16, warps2=4, stages2=1, group_m=2)


def make_weights(num_experts, hidden, inter, dtype=torch.float32):
    gate_up = torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


def masked_input(counts: list[int], capacity: int, hidden: int, fill=float("nan")) -> torch.Tensor:
    """(E, C, H) with random valid rows and `fill` (NaN by default) in every row past a count."""
    x = torch.full((len(counts), capacity, hidden), fill)
    for e, n in enumerate(counts):
        x[e, :n] = torch.randn(n, hidden)
    return x


def valid_rows(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([t[e, :n] for e, n in enumerate(counts)])


def unused_rows(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([t[e, n:] for e, n in enumerate(counts)])


def rows_ref(x_masked, counts, gate_up, down, row_weights=None) -> torch.Tensor:
    """The valid rows through the fp32 reference of the expert path: row (e, r) is one token routed
    to expert e alone, with weight row_weights[e, r] (1 without)."""
    experts = torch.cat([torch.full((n, 1), e, dtype=torch.int32) for e, n in enumerate(counts)])
    w = valid_rows(row_weights, counts)[:, None] if row_weights is not None else torch.ones(len(experts), 1)
    return moe_experts_ref(valid_rows(x_masked, counts), gate_up, down, w, experts)


# (E, C, H, I, counts): an empty expert in every case; C off the block size; several row blocks.
GEMM_CASES = [
    (4, 5, 32, 16, [3, 0, 5, 1]),
    (3, 37, 37, 11, [37, 0, 20]),          # prime sizes: masked K and N tails; a full expert
    (5, 40, 24, 40, [0, 17, 33, 1, 0]),     # I > H, up to three row blocks of 16
    (1, 16, 16, 16, [16]),                 # E = 1, C = one block exactly, I = H
]


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "row-weights"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: "E{}-C{}-H{}-I{}".format(*c[:4]))
def test_masked_gemms_match_their_twins(case, weighted):
    num_experts, capacity, hidden, inter, counts_list = case
    x = masked_input(counts_list, capacity, hidden)                  # NaN in every unused row
    gate_up, down = make_weights(num_experts, hidden, inter)
    counts = torch.tensor(counts_list, dtype=torch.int32)
    rw = torch.randn(num_experts, capacity) if weighted else None
    with poisoning():
        h = masked_gemm1_swiglu(x, counts, gate_up, SMALL)
        y = masked_gemm2(h, counts, down, rw, SMALL)
    h_ref = masked_gemm1_swiglu_torch(x, counts, gate_up)
    assert rel_err(valid_rows(h, counts_list), valid_rows(h_ref, counts_list)) <= 1e-5
    assert torch.isnan(unused_rows(h, counts_list)).all()           # never written (poisoned)
    y_ref = masked_gemm2_torch(h_ref, counts, down, rw)
    assert rel_err(valid_rows(y, counts_list), valid_rows(y_ref, counts_list)) <= 1e-5
    assert torch.isnan(unused_rows(y, counts_list)).all()
    # The twins chained are the expert path itself, row by row.
    assert rel_err(valid_rows(y_ref, counts_list), rows_ref(x, counts_list, gate_up, down, rw)) <= 1e-5


def test_masked_experts_leaves_rows_past_the_counts_alone():
    """out= rows at or past a count keep what they held; valid rows match the fp32 reference."""
    counts_list = [2, 0, 19, 7]
    x = masked_input(counts_list, 21, 32, fill=float("inf"))
    gate_up, down = make_weights(4, 32, 16)
    out = torch.full((4, 21, 32), -7.0)
    got = masked_experts(x, torch.tensor(counts_list), gate_up, down, config=SMALL, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(unused_rows(out, counts_list), torch.full_like(unused_rows(out, counts_list), -7.0))
    assert rel_err(valid_rows(out, counts_list), rows_ref(x, counts_list, gate_up, down)) <= 1e-5


def test_masked_experts_default_config_and_all_experts_empty():
    x = masked_input([3, 1], 4, 32)
    gate_up, down = make_weights(2, 32, 16)
    out = masked_experts(x, torch.tensor([3, 1], dtype=torch.int32), gate_up, down)   # default tiles
    assert rel_err(valid_rows(out, [3, 1]), rows_ref(x, [3, 1], gate_up, down)) <= 1e-5
    with poisoning():
        none = masked_experts(x, torch.zeros(2, dtype=torch.int32), gate_up, down, config=SMALL)
    assert torch.isnan(none).all()                                   # nothing read, nothing written
    empty = masked_experts(x[:, :0], torch.zeros(2, dtype=torch.int32), gate_up, down)
    assert empty.shape == (2, 0, 32)


def test_counts_out_of_range():
    x = masked_input([4, 2], 4, 32)
    gate_up, down = make_weights(2, 32, 16)
    for bad in ([5, 2], [-1, 2]):
        with pytest.raises(ValueError, match=r"counts must lie in \[0, C=4\]"):
            masked_experts(x, torch.tensor(bad), gate_up, down, config=SMALL)
    # Unvalidated (as on CUDA), the kernels clamp to [0, C]: nothing past the buffer is read.
    with poisoning():
        got = masked_experts(x, torch.tensor([9, -3]), gate_up, down, config=SMALL, validate=False)
    assert rel_err(got[0], rows_ref(x, [4, 0], gate_up, down)) <= 1e-5
    assert torch.isnan(got[1]).all()
    # int64 counts are clamped before any narrowing: 2^32 + 1 is not 1, -(2^32) + 2 is not 2.
    with poisoning():
        got = masked_experts(x, torch.tensor([2**32 + 1, -(2**32) + 2]), gate_up, down, config=SMALL,
                             validate=False)
    assert rel_err(got[0], rows_ref(x, [4, 0], gate_up, down)) <= 1e-5
    assert torch.isnan(got[1]).all()


BAD = [
    ("x_masked", lambda a: a["x_masked"][0], ValueError, "x_masked must be 3-D"),
    ("x_masked", lambda a: a["x_masked"].double(), TypeError, "x_masked must have dtype"),
    ("counts", lambda a: a["counts"].float(), TypeError, "counts must have dtype"),
    ("counts", lambda a: a["counts"][:2], ValueError, "counts must have shape"),
    ("gate_up_proj", lambda a: a["gate_up_proj"][:2], ValueError, "gate_up_proj must have shape"),
    ("gate_up_proj", lambda a: a["gate_up_proj"].transpose(1, 2), ValueError, "gate_up_proj must have shape"),
    ("gate_up_proj", lambda a: a["gate_up_proj"].half(), TypeError, "gate_up_proj must have dtype"),
    ("down_proj", lambda a: a["down_proj"].transpose(1, 2), ValueError, "down_proj must have shape"),
    ("row_weights", lambda a: torch.ones(3, 4), ValueError, "row_weights must have shape"),
    ("out", lambda a: torch.empty(3, 5, 40), ValueError,
     r"out must have shape \(3, 6, 40\) \(same as x_masked"),
    ("out", lambda a: a["x_masked"], ValueError, "out must not share memory with x_masked"),
]


@pytest.mark.parametrize("name,mutate,exc,msg", BAD, ids=[b[3] for b in BAD])
def test_masked_experts_bad_inputs_raise(name, mutate, exc, msg):
    gate_up, down = make_weights(3, 40, 16)      # H = 40, I = 16: a transposed weight shows in its shape
    args = dict(x_masked=masked_input([1, 0, 6], 6, 40), counts=torch.tensor([1, 0, 6], dtype=torch.int32),
                gate_up_proj=gate_up, down_proj=down)
    args[name] = mutate(args)
    with pytest.raises(exc, match=msg):
        masked_experts(**args)


@pytest.mark.parametrize("name", ["x_masked", "gate_up_proj", "down_proj", "row_weights"])
def test_masked_experts_refuses_inputs_that_need_gradients(name):
    """No backward: an input that requires grad (grad mode on) is an error naming it, never an output
    silently cut off from the graph; under no_grad the same call runs."""
    gate_up, down = make_weights(3, 32, 16)
    args = dict(x_masked=masked_input([1, 0, 4], 4, 32, fill=0.0), counts=torch.tensor([1, 0, 4]),
                gate_up_proj=gate_up, down_proj=down, row_weights=torch.rand(3, 4))
    args[name] = args[name].requires_grad_(True)
    with pytest.raises(RuntimeError, match=f"masked_experts has no backward, and {name} requires grad"):
        masked_experts(**args, config=SMALL)
    with torch.no_grad():
        got = masked_experts(**args, config=SMALL)
    assert not got.requires_grad
    ref = rows_ref(*(args[k].detach() for k in ("x_masked", "counts", "gate_up_proj", "down_proj",
                                                "row_weights")))
    assert rel_err(valid_rows(got, [1, 0, 4]), ref) <= 1e-5


# The layout, dispatch and combine.

def kept_by_hand(ids: torch.Tensor, num_experts: int, capacity: int) -> tuple[list[bool], list[int], int]:
    """(kept per pair, rows in use per expert, dropped): pairs in order, each expert's first C kept."""
    seen = [0] * num_experts
    kept, dropped = [], 0
    for e in ids.reshape(-1).tolist():
        if not 0 <= e < num_experts:
            kept.append(False)
            continue
        kept.append(seen[e] < capacity)
        dropped += seen[e] >= capacity
        seen[e] += 1
    return kept, [min(n, capacity) for n in seen], dropped


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_masked_layout_by_hand(path):
    # Pairs p = 3t + k. Expert 2: p 0, 4, 7, 8, 11 (5 pairs); expert 0: p 1, 5; invalid: p 2 (-1), p 10 (4);
    # expert 1: none; expert 3: p 3, 6, 9. C = 3: expert 2 keeps p 0, 4, 7 and drops p 8 and 11.
    ids = torch.tensor([[2, 0, -1], [3, 2, 0], [3, 2, 2], [3, 4, 2]])
    with use_layout_path(path):
        layout = masked_layout(ids, 4, 3)
    dest = [2 * 3 + 0, 0 * 3 + 0, -1, 3 * 3 + 0, 2 * 3 + 1, 0 * 3 + 1,
            3 * 3 + 1, 2 * 3 + 2, -1, 3 * 3 + 2, -1, -1]
    assert layout.dest.tolist() == dest and layout.dest.dtype == torch.int64
    assert layout.counts.tolist() == [2, 0, 3, 3] and layout.counts.dtype == torch.int32
    assert int(layout.dropped) == 2 and layout.capacity == 3
    kept, counts, dropped = kept_by_hand(ids, 4, 3)
    assert [d >= 0 for d in dest] == kept and counts == [2, 0, 3, 3] and dropped == 2


LAYOUT_CASES = [  # (R, K, E, C, ids): "rand" ids in [-2, E + 2) (some invalid), "one" all on expert E - 1
    (0, 2, 4, 3, "rand"),            # R = 0
    (1, 1, 4, 1, "rand"),            # K = 1
    (5, 8, 4, 2, "rand"),            # K > E, experts over capacity
    (37, 1, 8, 3, "rand"),
    (100, 8, 16, 5, "rand"),
    (300, 4, 130, 3, "rand"),        # E not a power of two, several pair blocks
    (2000, 8, 8, 4096, "rand"),      # nothing dropped, many blocks
    (64, 2, 1, 7, "rand"),           # E = 1
    (50, 4, 6, 9, "one"),            # all pairs on one expert, over capacity
    (3, 2, 5, 0, "rand"),            # C = 0: every valid pair dropped
]


def layout_ids(rows, top_k, num_experts, kind, dtype, gen):
    if kind == "one":
        return torch.full((rows, top_k), num_experts - 1, dtype=dtype)
    return torch.randint(-2, num_experts + 2, (rows, top_k), generator=gen).to(dtype)


def assert_same_layout(got, want):
    for name in ("dest", "counts", "dropped"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, name
        assert torch.equal(a, b), (name, a, b)
    assert got.capacity == want.capacity


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "x".join(map(str, c)))
def test_layout_kernel_equals_its_twin(case, dtype):
    """The one-program kernel against the torch twin, integers equal, into poisoned buffers (every
    output element must be written); the twin against the hand count."""
    rows, top_k, num_experts, capacity, kind = case
    gen = torch.Generator().manual_seed(rows * 1000 + top_k * 100 + num_experts)
    for _ in range(2):                                              # fresh ids each time
        ids = layout_ids(rows, top_k, num_experts, kind, dtype, gen)
        want = masked_layout_torch(ids, num_experts, capacity)
        with poisoning():
            got = masked_layout_triton(ids, num_experts, capacity)
        assert_same_layout(got, want)
        assert got.dropped.dim() == 0
        kept, counts, dropped = kept_by_hand(ids, num_experts, capacity)
        assert (want.dest >= 0).tolist() == kept and want.counts.tolist() == counts
        assert int(want.dropped) == dropped


def test_layout_kernel_odd_inputs():
    """Strided (non-contiguous) ids, ids far outside int32 (never placed), E = 0."""
    ids = torch.randint(0, 6, (20, 8))[:, ::2]
    assert_same_layout(masked_layout_triton(ids, 6, 3), masked_layout_torch(ids, 6, 3))
    far = torch.tensor([[2**40, -2**40, 1], [1, 2**33 + 1, -1]])
    assert_same_layout(masked_layout_triton(far, 4, 2), masked_layout_torch(far, 4, 2))
    ids = torch.zeros(3, 2, dtype=torch.int32)
    assert_same_layout(masked_layout_triton(ids, 0, 2), masked_layout_torch(ids, 0, 2))


def test_layout_path_selection(monkeypatch):
    """As the EP steps' paths: the twin on CPU tensors unless MOEKIT_LAYOUT_TRITON=1 (interpreted),
    MOEKIT_LAYOUT_TORCH=1 wins, use_layout_path overrides both; over MAX_TRITON_EXPERTS the twin."""
    ids = torch.zeros(2, 2, dtype=torch.int64)
    monkeypatch.delenv("MOEKIT_LAYOUT_TRITON", raising=False)
    monkeypatch.delenv("MOEKIT_LAYOUT_TORCH", raising=False)
    assert layout_path_for(ids, 8) == "torch"
    monkeypatch.setenv("MOEKIT_LAYOUT_TRITON", "1")
    assert layout_path_for(ids, 8) == "triton" and layout_path_for(ids, 5000) == "torch"
    monkeypatch.setenv("MOEKIT_LAYOUT_TORCH", "1")
    assert layout_path_for(ids, 8) == "torch"
    with use_layout_path("triton"):
        assert layout_path_for(ids, 8) == "triton"
        with use_layout_path("auto"):
            assert layout_path_for(ids, 8) == "torch"
    with pytest.raises(ValueError, match="path must be one of"):
        with use_layout_path("fast"):
            pass


@pytest.mark.parametrize("capacity", [1, 4, 12])
def test_dispatch_and_combine_match_their_twins(capacity):
    ids = torch.tensor([[2, 0, -1], [3, 2, 0], [3, 2, 2], [3, 4, 2]])
    x = torch.randn(16, 37)[::4]                                     # strided rows
    w = torch.randn(4, 3)
    layout = masked_layout(ids, 5, capacity)
    counts = layout.counts.tolist()
    with poisoning():
        xm = masked_dispatch(x, layout, 5, 3)
    assert torch.equal(valid_rows(xm, counts), valid_rows(masked_dispatch_torch(x, layout, 5, 3), counts))
    assert torch.isnan(unused_rows(xm, counts)).all()
    y = torch.randn(5, capacity, 37)
    y[torch.arange(capacity)[None, :] >= layout.counts[:, None]] = float("nan")     # unused rows
    out = masked_combine(y, layout, w, poisoned((4, 37), torch.float32, "cpu"))
    assert rel_err(out, masked_combine_torch(y, layout, w)) <= 1e-6
    # The twins: each placed pair's row carries its token, and the combine is the weighted sum.
    kept, _, _ = kept_by_hand(ids, 5, capacity)
    want = torch.zeros(4, 37)
    for p, d in enumerate(layout.dest.tolist()):
        if kept[p]:
            assert torch.equal(xm.view(-1, 37)[d], x[p // 3])
            want[p // 3] += w.view(-1)[p] * y.view(-1, 37)[d]
    assert rel_err(masked_combine_torch(y, layout, w), want) <= 1e-6


# The backend.

def run(x, gate_up, down, w, ids, **kw):
    return moe_experts(x, gate_up, down, w, ids, backend="masked", config=SMALL, **kw)


def test_backend_capabilities():
    b = get_backend("masked")
    assert b.capturable and b.backward_devices == frozenset()
    assert b.options == {"config", "capacity_factor", "stats"}
    x, gate_up, down = torch.randn(3, 32), *make_weights(4, 32, 16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="backend='masked' has no backward"):
        run(x, gate_up.requires_grad_(True), down, torch.rand(3, 2), ids)


def test_all_pairs_on_one_expert_overflow_is_dropped_and_counted():
    x = torch.randn(16, 32)
    gate_up, down = make_weights(4, 32, 16)
    ids = torch.zeros(16, 1, dtype=torch.int32)
    ids[:4] = torch.arange(4)[:, None]              # expert 0 gets 13 pairs, experts 1..3 one each
    w = torch.rand(16, 1)
    stats = {}
    with poisoning():
        out = run(x, gate_up, down, w, ids, capacity_factor=1.0, stats=stats)
    assert stats["capacity"] == 4 and int(stats["dropped"]) == 9  # ceil(1.0 * 16 / 4) = 4 kept of 13
    kept = torch.zeros(16, dtype=torch.bool)
    kept[:4] = True
    kept[4:7] = True                                # expert 0's first 4 pairs in pair order: 0, 4, 5, 6
    assert kept.tolist() == kept_by_hand(ids, 4, 4)[0]
    ref = moe_experts_ref(x, gate_up, down, torch.where(kept[:, None], w, 0.0), ids)
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[7:], torch.zeros(9, 32))  # every pair of these tokens dropped: exactly 0


def test_every_pair_on_one_expert_without_capacity_drops_nothing():
    """Default C = S: duplicates in a row included, no expert can overflow."""
    x = torch.randn(7, 32)
    gate_up, down = make_weights(5, 32, 16)
    ids = torch.full((7, 3), 2, dtype=torch.int64)
    w = torch.randn(7, 3)
    stats = {}
    out = run(x, gate_up, down, w, ids, stats=stats)
    assert stats["capacity"] == 21 and int(stats["dropped"]) == 0
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5


@pytest.mark.parametrize("top_k", [1, 5], ids=["K1", "K=E"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0], ids=["no-cap", "c0.5", "c1.0"])
def test_backend_with_capacity_against_kept_pairs(top_k, capacity_factor):
    num_tokens, num_experts = 13, 5
    x = torch.randn(num_tokens, 37)
    gate_up, down = make_weights(num_experts, 37, 11)
    if top_k == 1:          # skewed: expert 3 busy, expert 4 empty
        ids = torch.tensor([3, 3, 0, 3, 1, 3, 3, 2, 3, 0, 3, 3, 1])[:, None]
    else:
        ids = torch.rand(num_tokens, num_experts).argsort(1)
    w = torch.rand(num_tokens, top_k)
    stats = {}
    with poisoning():
        out = run(x, gate_up, down, w, ids, capacity_factor=capacity_factor, stats=stats)
    num_pairs = num_tokens * top_k
    cap = num_pairs if capacity_factor is None else math.ceil(capacity_factor * num_pairs / num_experts)
    kept, _, dropped = kept_by_hand(ids, num_experts, cap)
    assert stats["capacity"] == cap and int(stats["dropped"]) == dropped
    # K = E at c = 1: every expert exactly full (C = T), nothing dropped; skewed K = 1 overflows.
    assert (dropped > 0) == (capacity_factor == 0.5 or (capacity_factor == 1.0 and top_k == 1))
    keep = torch.tensor(kept).view(num_tokens, top_k)
    assert rel_err(out, moe_experts_ref(x, gate_up, down, torch.where(keep, w, 0.0), ids)) <= 1e-5


def test_invalid_ids_are_skipped_not_dropped():
    x = torch.randn(8, 32)
    gate_up, down = make_weights(3, 32, 16)
    ids = torch.tensor([[0, -1], [0, 3], [0, 0], [1, 0], [0, 5], [-1, -1], [0, 2], [0, 1]], dtype=torch.int32)
    # Expert 0: p 0, 2, 4, 5, 7, 8, 12, 14 (8 pairs); capacity ceil(1.0 * 16 / 3) = 6 drops p 12 and 14;
    # the five pairs with ids -1, 3, 5 are skipped, not dropped.
    w = torch.rand(8, 2)
    stats = {}
    out = run(x, gate_up, down, w, ids, capacity_factor=1.0, stats=stats, ignore_invalid_ids=True)
    assert stats["capacity"] == 6 and int(stats["dropped"]) == 2
    kept = torch.ones(16, dtype=torch.bool)
    kept[[1, 3, 9, 10, 11, 12, 14]] = False
    assert kept.tolist() == kept_by_hand(ids, 3, 6)[0]
    ref = moe_experts_ref(x, gate_up, down, w, torch.where(kept.view(8, 2), ids, -1))
    assert rel_err(out, ref) <= 1e-5
    assert torch.equal(out[5], torch.zeros(32))
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        run(x, gate_up, down, w, ids)


def test_nan_in_unused_rows_of_the_workspaces_never_reaches_the_output():
    """Poisoned workspaces put NaN in every row of x_masked, h and y past a count (C = S is mostly
    unused); empty experts 1 and 4; the output is finite and exact."""
    x = torch.randn(11, 32)
    gate_up, down = make_weights(6, 32, 16)
    ids = torch.tensor([[0, 2], [3, 5], [2, 0], [5, 3], [0, 3]] * 2 + [[2, 5]], dtype=torch.int32)
    w = torch.rand(11, 2)
    with poisoning():
        out = run(x, gate_up, down, w, ids, out=poisoned((11, 32), torch.float32, "cpu"))
        again = run(x, gate_up, down, w, ids)
    assert torch.isfinite(out).all()
    assert rel_err(out, moe_experts_ref(x, gate_up, down, w, ids)) <= 1e-5
    assert torch.equal(out, again)                                  # deterministic, run to run


def test_workspace_that_cannot_fit_is_refused(monkeypatch):
    x, (gate_up, down) = torch.randn(64, 32), make_weights(4, 32, 16)
    ids = torch.zeros(64, 2, dtype=torch.int32)
    monkeypatch.setattr(moekit._memory, "free_bytes", lambda device: 10_000)
    with pytest.raises(moekit.PaddedWorkspaceTooLarge, match=r"masked backend's \(E, C=128, \*\) buffers"):
        run(x, gate_up, down, torch.rand(64, 2), ids)
    run(x, gate_up, down, torch.rand(64, 2), ids, capacity_factor=0.02)   # C = 1 fits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_layout_kernel_on_cuda_equals_its_twin(dtype):
    """Compiled on the GPU: the kernel's integers equal the twin's (computed on the CPU), into
    poisoned buffers, on the edge cases and at serving sizes (decode to a 16,384-token prefill)."""
    gen = torch.Generator().manual_seed(7)
    cases = LAYOUT_CASES + [(1, 8, 128, 4, "rand"), (128, 8, 128, 16, "rand"), (4096, 8, 128, 320, "rand"),
                            (16384, 8, 128, 1024, "rand"), (16384, 8, 128, 64, "one")]
    for rows, top_k, num_experts, capacity, kind in cases:
        ids = layout_ids(rows, top_k, num_experts, kind, dtype, gen)
        want = masked_layout_torch(ids, num_experts, capacity)
        with poisoning():
            got = masked_layout_triton(ids.cuda(), num_experts, capacity)
        for name in ("dest", "counts", "dropped"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.is_cuda and a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.cpu(), b), (rows, top_k, num_experts, capacity, kind, name)


def test_masked_kernels_compile_for_sm90_without_spills():
    """tools/aot_compile_check.py --masked: the masked GEMMs at the Qwen3-30B-A3B shape, dense and on
    block-scaled e4m3 weights at the tiles `masked_fp8_tiles` makes of 16 to 128 rows, through ptxas
    for sm_90, no local memory."""
    out = aot_compile_check("--masked", "--regs")
    assert "6/6 masked variants compile" in out and "local" not in out
