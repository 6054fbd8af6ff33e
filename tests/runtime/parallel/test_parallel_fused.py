"""The fused expert-parallel kernels (`moekit.parallel.fused`) against their torch twins, exactly.

Every integer output (dest, local, hit, send counts, positions, metadata, combine_index, drop
counters) must be equal, and every row buffer equal bit for bit, on fresh random inputs and the
edge cases: T = 0, 1, primes, a rank that receives nothing, every pair on one expert, top_k = 1 and
top_k = E, ids outside [0, E) (int32 and int64, 2**32 + e included), replicated placements,
capacities that overflow, N = 1..4. The kernels' outputs start NaN / minimum-poisoned
(`_workspace.poisoning`), so an element a kernel forgets shows up. Small blocks (block_t, block_h)
make the kernels walk about 8 token blocks and 2 H blocks on small T. On CPU the kernels run
interpreted (TRITON_INTERPRET=1).
The twins themselves are checked against hand-written oracles in test_placement and the gloo tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import moekit
from helpers import ROOT
from moekit import _workspace
from moekit.bench.scenarios import make_scenario
from moekit.bench.simulate import shard_experts, simulate_ep
from moekit.parallel import fused
from moekit.parallel.dispatch import (
    RoutePlan,
    pack,
    pack_torch,
    plan_routes,
    plan_routes_torch,
    reduce_partials,
    reduce_partials_torch,
    route_positions,
)
from moekit.parallel.low_latency import pack_fixed, pack_fixed_torch
from moekit.placement import Placement, assign, contiguous_placement, strided_placement

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or moekit._validation.interpreting()),
                                reason="the kernels need CUDA or TRITON_INTERPRET=1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integers (equal iff bitwise equal) of a float tensor; integers unchanged."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
    assert torch.equal(_bits(got).cpu(), _bits(want).cpu()), what


def _placement(kind: str, num_experts: int, world: int) -> Placement:
    """contiguous / strided, or replicated: every rank also holds copies of the next ranks' first
    experts, and expert 0 has a copy on every rank (so copy counts 1..N mix)."""
    if kind == "strided":
        return strided_placement(num_experts, world)
    base = contiguous_placement(num_experts, world, spare_slots=3 if kind == "replicated" else 0)
    if kind != "replicated" or world == 1:
        return base
    slots = []
    for r, own in enumerate(base.slots):
        nxt = base.slots[(r + 1) % world]
        extra = [e for e in dict.fromkeys((0, *nxt[:2])) if e not in own]
        slots.append(own + tuple(extra))
    p = Placement(num_experts, tuple(slots), base.slots_per_rank)
    assert p.num_replicas > 0
    return p


def _ids(kind: str, num_tokens: int, top_k: int, num_experts: int, placement: Placement, dtype: torch.dtype,
         gen: torch.Generator) -> torch.Tensor:
    """(T, K) ids of a routing kind; "invalid" mixes in ids outside [0, E) (-1, E, -5, and for int64
    2**32 + 1, which must not wrap into range)."""
    if kind == "one-expert":                                   # every pair on expert E - 1, repeated
        ids = torch.full((num_tokens, top_k), num_experts - 1)
    elif kind == "distinct":                                   # K distinct experts per token (K = E: all)
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :top_k]
    elif kind == "skip-last-rank":                             # the last rank receives no row
        allowed = [e for e in range(num_experts) if e not in placement.slots[-1]] or [0]
        pick = torch.randint(0, len(allowed), (num_tokens, top_k), generator=gen)
        ids = torch.tensor(allowed)[pick]
    else:
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
        if kind == "invalid" and num_tokens:
            bad = torch.rand(num_tokens, top_k, generator=gen) < 0.3
            junk = torch.tensor([-1, num_experts, -5, num_experts + 7])
            if dtype == torch.int64:
                junk = torch.cat([junk, torch.tensor([2**32 + 1, -(2**40)])])
            ids = torch.where(bad, junk[torch.randint(0, len(junk), ids.shape, generator=gen)], ids)
    return ids.to(dtype)


def _fused_plan(ids, placement, rank, capacity=None, block_t=None) -> RoutePlan:
    with _workspace.poisoning():
        return RoutePlan(*fused.route(ids, placement, rank, None, capacity, block_t=block_t),
                         capacity=capacity)


def check_case(num_tokens: int, top_k: int, num_experts: int, world: int, *, placement_kind="contiguous",
               ids_kind="random", id_dtype=torch.int64, x_dtype=torch.float32, w_dtype=torch.float32,
               hidden=40, capacities=(1, 3), small_blocks=False, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    placement = _placement(placement_kind, num_experts, world)
    ids = _ids(ids_kind, num_tokens, top_k, num_experts, placement, id_dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(x_dtype)
    w = torch.rand(num_tokens, top_k, generator=gen).to(w_dtype)
    w[::3, 0] = -0.0
    # small blocks: about 8 token blocks per launch and 2 H blocks (more would only slow the interpreter)
    block = max(2, triton.next_power_of_2(max(num_tokens, 1)) // 8)
    route_block = block if small_blocks else None
    pack_blocks = dict(block_t=block, block_h=32) if small_blocks else {}
    for rank in sorted({0, world - 1}) if not small_blocks else [world - 1]:
        ref = plan_routes_torch(ids, placement, rank)
        for cap in (None, *capacities):
            got = _fused_plan(ids, placement, rank, cap, route_block)
            for name in ("dest", "local", "hit", "send_counts"):
                assert_same(getattr(got, name), getattr(ref, name), name)
            assert_same(got.pos, route_positions(ref.hit), "pos")
            if cap is None:
                assert got.drops is None
                rows = int(ref.send_counts.sum())
                want = pack_torch(x, w, ref, rows)
                with _workspace.poisoning():
                    have = fused.pack(x, w, got, rows, **pack_blocks)
                for name, a, b in zip(("send_x", "send_meta", "combine_index"), have, want):
                    assert_same(a, b, name)
                _check_reduce(want[2], rows, hidden, gen)
            else:
                want_x, want_meta, handle = pack_fixed_torch(x, w, ref, cap)
                with _workspace.poisoning():
                    have_x, have_meta, have_index, dropped = fused.pack_fixed(x, w, got, cap, **pack_blocks)
                assert_same(have_x, want_x, "send_x fixed")
                assert_same(have_meta, want_meta, "send_meta fixed")
                assert_same(have_index, handle.combine_index, "combine_index fixed")
                assert_same(dropped, torch.stack([handle.dropped_rows, handle.dropped_pairs]), "dropped")
                # per destination: rows past C = max(0, count - C); their pairs add up to dropped_pairs
                over = (ref.send_counts - cap).clamp(min=0)
                assert_same(got.drops[0], over, "drops per destination")
                assert int(got.drops[1].sum()) == int(handle.dropped_pairs)


def _check_reduce(combine_index: torch.Tensor, rows: int, hidden: int, gen: torch.Generator) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        back = torch.randn(rows + 1, hidden, generator=gen).to(dtype)
        back[rows] = 0
        want = reduce_partials_torch(back, combine_index, dtype)
        with _workspace.poisoning():
            assert_same(fused.reduce(back, combine_index, dtype), want, f"reduce {dtype}")


# (T, K, E, N, placement, ids): the edge cases of the brief, each on both the default and small blocks.
CASES = [
    (0, 2, 8, 2, "contiguous", "random"),
    (1, 2, 8, 2, "contiguous", "random"),
    (1, 8, 8, 4, "replicated", "distinct"),            # top_k = E, every rank
    (7, 1, 8, 3, "contiguous", "random"),               # top_k = 1
    (13, 3, 7, 3, "replicated", "invalid"),
    (31, 2, 8, 4, "strided", "invalid"),
    (29, 4, 8, 4, "contiguous", "skip-last-rank"),      # a destination with no rows
    (23, 3, 6, 2, "replicated", "one-expert"),          # every pair on one (replicated) expert
    (17, 4, 4, 4, "contiguous", "distinct"),            # top_k = E = N
    (37, 2, 5, 1, "contiguous", "invalid"),             # N = 1
    (131, 2, 16, 4, "replicated", "random"),
]


@pytest.mark.parametrize("small_blocks", [False, True], ids=["blocks", "small-blocks"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-K{}-E{}-N{}-{}-{}".format(*c))
def test_fused_equals_torch(case, small_blocks):
    t, k, e, n, placement, ids = case
    check_case(t, k, e, n, placement_kind=placement, ids_kind=ids,
               capacities=(3,) if small_blocks else (1, 3, max(t, 1)), small_blocks=small_blocks,
               seed=t * 31 + k)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)],
                         ids=["bf16-x", "fp16-x-bf16-w"])
def test_fused_dtypes(id_dtype, dtypes):
    x_dtype, w_dtype = dtypes
    check_case(19, 3, 8, 3, placement_kind="replicated", ids_kind="invalid", id_dtype=id_dtype,
               x_dtype=x_dtype, w_dtype=w_dtype, capacities=(4,), small_blocks=True, seed=5)


def test_fused_random_rounds():
    """Fresh random inputs: several shapes, placements and capacities."""
    gen = torch.Generator().manual_seed(1234)
    for i in range(6):
        n = int(torch.randint(1, 5, (1,), generator=gen))
        e = int(torch.randint(n, 13, (1,), generator=gen))
        k = int(torch.randint(1, e + 1, (1,), generator=gen))
        t = int(torch.randint(0, 60, (1,), generator=gen))
        check_case(t, k, e, n, placement_kind=("contiguous", "strided", "replicated")[i % 3],
                   ids_kind=("random", "invalid")[i % 2], id_dtype=(torch.int32, torch.int64)[i % 2],
                   capacities=(int(torch.randint(1, 8, (1,), generator=gen)),), small_blocks=bool(i % 2),
                   seed=i)


def test_fused_plan_large_t():
    """T = 16384 (many blocks, counters carried across them), replicated and not, against the twin."""
    for kind, rank in (("contiguous", 0), ("replicated", 1)):
        placement = _placement(kind, 128, 2)
        _, ids = make_scenario("zipf-1.0", 16384, 128, 8, seed=3)
        ids[::97, 3] = -1
        ref = plan_routes_torch(ids, placement, rank)
        got = _fused_plan(ids, placement, rank, capacity=4096)
        for name in ("dest", "local", "hit", "send_counts"):
            assert_same(getattr(got, name), getattr(ref, name), name)
        assert_same(got.pos, route_positions(ref.hit), "pos")
        assert_same(got.drops[0], (ref.send_counts - 4096).clamp(min=0), "drops")


def test_torch_plan_without_replicas_equals_the_assignment():
    """The twin's lookup path (no replica: two table reads) gives what assign's formula gives."""
    gen = torch.Generator().manual_seed(2)
    for placement in (contiguous_placement(8, 3), strided_placement(8, 4), contiguous_placement(5, 1)):
        n = placement.num_ranks
        for dtype in (torch.int32, torch.int64):
            ids = _ids("invalid", 37, 3, placement.num_experts, placement, dtype, gen)
            plan = plan_routes_torch(ids, placement, n - 1)
            a = assign(ids, placement, source_rank=n - 1)
            assert_same(plan.dest, torch.where(a.rank >= 0, a.rank.long(), n), "dest")
            assert_same(plan.local, a.local_ids.long(), "local")
            hit = torch.stack([(plan.dest == d).any(1) for d in range(n)], 1)
            assert_same(plan.hit, hit, "hit")
            assert_same(plan.send_counts, hit.sum(0), "send_counts")


def test_replicas_split_round_robin_in_the_kernel():
    """The kernel's replica rule is assign's: the j-th pair (pair order) of an expert with n copies
    runs on copy (j + source rank) mod n; checked by hand on one expert held by all 3 ranks."""
    placement = Placement(3, ((0, 1), (1, 2), (2, 0, 1)), 3)           # expert 1 on ranks 0, 1, 2
    ids = torch.tensor([[1, 0], [2, 1], [1, 1], [0, 2], [1, 2]])
    for source in range(3):
        plan = _fused_plan(ids, placement, source)
        ranks = plan.dest[ids == 1].tolist()                           # the 5 pairs of expert 1
        assert ranks == [(j + source) % 3 for j in range(5)], (source, ranks)
        a = assign(ids, placement, source_rank=source)
        assert plan.dest.tolist() == a.rank.long().tolist()


def test_public_steps_follow_the_path():
    """plan_routes picks the kernels under use_path("triton") (pos filled), the twins under "torch";
    pack, pack_fixed and reduce_partials follow the plan, with identical results."""
    gen = torch.Generator().manual_seed(3)
    placement = _placement("replicated", 8, 3)
    ids = torch.randint(-1, 9, (11, 3), generator=gen)
    x, w = torch.randn(11, 24, generator=gen), torch.rand(11, 3, generator=gen)
    with fused.use_path("torch"):
        ref = plan_routes(ids, placement, 1, capacity=2)
        rows = int(ref.send_counts.sum())
        want, want_fixed = pack(x, w, ref, rows), pack_fixed(x, w, ref, 2)
        back = torch.randn(rows + 1, 24, generator=gen)
        want_out = reduce_partials(back, want[2], torch.float32)
    with fused.use_path("triton"):
        got = plan_routes(ids, placement, 1, capacity=2)
        have, have_fixed = pack(x, w, got, rows), pack_fixed(x, w, got, 2)
        have_out = reduce_partials(back, have[2], torch.float32)
        stale = pack_fixed(x, w, got, 3)        # another capacity than the plan's: the torch twin
    assert ref.pos is None and got.pos is not None and got.capacity == 2
    for a, b in zip(have, want):
        assert_same(a, b, "pack")
    assert_same(have_fixed[0], want_fixed[0], "send_x")
    assert_same(have_fixed[1], want_fixed[1], "send_meta")
    for name in ("combine_index", "dropped_rows", "dropped_pairs"):
        assert_same(getattr(have_fixed[2], name), getattr(want_fixed[2], name), name)
    assert_same(have_out, want_out, "reduce")
    assert_same(stale[1], pack_fixed_torch(x, w, ref, 3)[1], "send_meta at another capacity")
    with pytest.raises(ValueError, match="path must be"):
        with fused.use_path("fast"):
            pass


def test_path_selection(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("MOEKIT_EP_TORCH", raising=False)
    monkeypatch.delenv("MOEKIT_EP_TRITON", raising=False)
    assert fused.path_for(cpu) == "torch"                    # the CPU default: the twins
    monkeypatch.setenv("MOEKIT_EP_TRITON", "1")
    assert fused.path_for(cpu) == ("triton" if moekit._validation.interpreting() else "torch")
    monkeypatch.setenv("MOEKIT_EP_TORCH", "1")                # torch wins
    assert fused.path_for(cpu) == "torch"
    with fused.use_path("triton"):
        assert fused.path_for(cpu) == ("triton" if moekit._validation.interpreting() else "torch")


@pytest.mark.parametrize("routing", ["zipf-1.0", "collapse"])
def test_simulated_group_bitwise_on_both_paths(routing):
    """N = 3 virtual ranks through plan / pack / experts / reduce: the kernels give the twins' bits."""
    shape = moekit.MoEShape(8, 32, 16, 2)
    layer = moekit.MoELayer(shape, backend="grouped_mm")
    layer.reset_parameters(torch.Generator().manual_seed(0))
    tokens = (5, 0, 9)
    x = torch.randn(sum(tokens), 32, generator=torch.Generator().manual_seed(1))
    w, ids = make_scenario(routing, sum(tokens), 8, 2, seed=2)
    placement = _placement("replicated", 8, 3)
    args = (list(x.split(tokens)), list(w.split(tokens)), list(ids.split(tokens)),
            shard_experts(layer.gate_up_proj.detach(), layer.down_proj.detach(), placement), placement)
    outs = {}
    for path in ("torch", "triton"):
        with fused.use_path(path), torch.no_grad():
            outs[path] = simulate_ep(*args, backend="grouped_mm")
    for a, b in zip(outs["triton"], outs["torch"]):
        assert_same(a, b, "simulated output")


def test_kernels_compile_for_sm90():
    """The interpreter does not see compiled-mode errors; `tools/ep_compile_check.py --quick`
    compiles the normal and the low-latency launches (replicas included) and the masked layout
    kernel to sm_90 cubins, no GPU needed (Triton's bundled ptxas)."""
    script = ROOT / "tools" / "ep_compile_check.py"
    src = str(Path(moekit.__file__).parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert sum(line.startswith("ok ") for line in out.stdout.splitlines()) >= 5, out.stdout


@pytest.mark.gpu
def test_fused_on_cuda_matches_cpu_twins():
    """On the GPU (compiled kernels): the twins' results on CPU."""
    gen = torch.Generator().manual_seed(11)
    placement = _placement("replicated", 128, 2)
    for t in (1, 7, 4096):
        _, ids = make_scenario("zipf-1.0", t, 128, 8, seed=t)
        x = torch.randn(t, 256, generator=gen).to(torch.bfloat16)
        w = torch.rand(t, 8, generator=gen)
        for rank in (0, 1):
            ref = plan_routes_torch(ids, placement, rank)
            got = _fused_plan(ids.cuda(), placement, rank, capacity=max(1, t // 3))
            for name in ("dest", "local", "hit", "send_counts"):
                assert_same(getattr(got, name), getattr(ref, name), name)
            rows = int(ref.send_counts.sum())
            for a, b in zip(fused.pack(x.cuda(), w.cuda(), got, rows), pack_torch(x, w, ref, rows)):
                assert_same(a, b, "pack")
            cap = max(1, t // 3)
            have = fused.pack_fixed(x.cuda(), w.cuda(), got, cap)
            want_x, want_meta, handle = pack_fixed_torch(x, w, ref, cap)
            assert_same(have[0], want_x, "send_x")
            assert_same(have[1], want_meta, "meta")
            assert_same(have[2], handle.combine_index, "combine_index")
            assert_same(have[3].cpu(), torch.stack([handle.dropped_rows, handle.dropped_pairs]), "dropped")


@pytest.mark.gpu
def test_fused_on_cuda_captures():
    """A CUDA graph replay of plan + pack_fixed on new ids equals an eager call."""
    placement = _placement("replicated", 128, 2)
    ids = make_scenario("zipf-1.0", 64, 128, 8, seed=1)[1].cuda()
    x, w = torch.randn(64, 256, device="cuda"), torch.rand(64, 8, device="cuda")

    def step():
        plan = plan_routes(ids, placement, 1, capacity=16)
        return pack_fixed(x, w, plan, 16)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    ids.copy_(make_scenario("zipf-1.5", 64, 128, 8, seed=2)[1].cuda())
    graph.replay()
    eager = step()
    assert_same(captured[0], eager[0], "send_x")
    assert_same(captured[1], eager[1], "meta")
    assert_same(captured[2].combine_index, eager[2].combine_index, "combine_index")
