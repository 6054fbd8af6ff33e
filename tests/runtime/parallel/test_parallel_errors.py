"""Expert parallelism when one rank's call is bad: no rank is left waiting in a collective.

Spawned gloo worlds of 2 and 3 processes (test_parallel's machinery) run every case, each in a process
group of its own whose timeout is CASE_TIMEOUT_S: a rank left waiting for one that raised alone gets
gloo's timeout error (a RuntimeError, not what the tests expect) and the world goes on to the next
case, so a regression fails its test instead of hanging the suite. The parent checks what each rank
raised or returned:

  * normal mode (`ep_moe_experts`, chunked too, `dispatch`, `ExpertParallelMoE`): every rank raises,
    the bad one its own error naming the argument (its type kept: a wrong dtype is a TypeError), the
    others a ValueError naming the bad rank(s); ranks that disagree on the hidden size, dtype, top_k
    or placement all raise the same ValueError naming the field and each rank's value;
  * low-latency mode: the bad rank stands in (the call with no tokens of its own) and raises; the
    others return their tokens' outputs, NaN where a pair needed a bad rank's invalid weights; with
    overflow="raise" every rank raises; a captured replay stands in the same way.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moekit
from helpers import rel_err
from moekit.parallel import ExpertParallelMoE, disable_nvls, dispatch, ep_moe_experts
from moekit.placement import contiguous_placement, rank_weights, strided_placement
from moekit.reference import moe_experts_ref
from test_parallel import SEED, _spawn_world, join_group
from test_parallel_low_latency import CFG, _captured_ep_on_cpu

disable_nvls()

CASE_TIMEOUT_S = 30         # each case's process group: a rank waiting for one that raised alone gives up
WORLD_TIMEOUT_S = 300       # the whole world, every case included (a few seconds when none waits)
SHAPE = moekit.get_shape("tiny")
TOKENS = 4                  # per rank; the low-latency capacity, so that nothing is dropped
LOW_LATENCY = dict(mode="low_latency", capacity=TOKENS, config=CFG)


@dataclass(frozen=True)
class Case:
    """One call on every rank, `bad` ranks passing `mutation` of their inputs.

    api: "ep" (`ep_moe_experts`; opts its keyword arguments), "dispatch", "layer" (the layer's forward;
    opts its constructor's), "layer-experts" (its `experts` with given routing), "captured" (a low-latency
    layer captured, replayed eagerly on CPU). expect: "raise" (every rank raises), "disagree" (every
    rank raises the same agreement error) or "stand-in" (the bad ranks raise, the others return).
    """

    name: str
    api: str
    mutation: str
    bad: tuple[int, ...] = (1,)
    opts: tuple[tuple[str, object], ...] = ()
    expect: str = "raise"


# mutation: (what the bad rank raises, text its message holds after "rank r: ")
ERRORS = {
    "hidden-size": ("ValueError", "hidden_states must have shape (T, H=64)"),
    "hidden-dtype": ("TypeError", "hidden_states must have dtype in (float32), got torch.float64"),
    "hidden-device": ("ValueError", "hidden_states must be on cpu, got meta"),
    "hidden-1d": ("ValueError", "hidden_states must be 2-D"),
    "ids-rows": ("ValueError", f"topk_ids must have shape (T={TOKENS}, K)"),
    "ids-dtype": ("TypeError", "topk_ids must have dtype in"),
    "ids-range": ("ValueError", "topk_ids must lie in [0, num_experts=8)"),
    "top-k-range": ("ValueError", "top_k (topk_ids.shape[1]) must be in [1, E=8]"),
    "weights-shape": ("ValueError", "topk_weights must have shape (4, 2) (same as topk_ids)"),
    "weights-dtype": ("TypeError", "topk_weights must have dtype in"),
    "expert-count": ("ValueError", "this rank holds 4 experts in the placement, but gate_up_proj and "
                                   "down_proj have 3"),
    "grad": ("RuntimeError", "forward-only"),
    "all-on-meta": ("ValueError", "hidden_states is on meta, but gloo's all-to-all takes CPU tensors only"),
    "x-hidden": ("ValueError", "x must have shape (..., H=64)"),
    "x-dtype": ("TypeError", "x must have dtype in (float32), got torch.float64"),
    "layer-top-k": ("ValueError", "topk_ids must have shape (T, K=2) (the top_k every rank routes with)"),
    "replay-dtype": ("TypeError", "x has dtype torch.float64, but the layer was captured in torch.float32"),
    "replay-rows": ("ValueError", f"x has {TOKENS + 1} tokens; this capture serves at most {TOKENS}"),
}

# mutation: the field the agreement error names
DISAGREE = {"disagree-hidden": "hidden size", "disagree-dtype": "dtype", "disagree-top-k": "top_k",
            "disagree-placement": "placement"}

CHUNKED = (("overlap_chunks", 2),)
CASES = {
    2: [
        *(Case(m, "ep", m, bad=(i % 2,)) for i, m in enumerate(
            ("hidden-size", "hidden-dtype", "hidden-device", "hidden-1d", "ids-rows", "ids-dtype",
             "top-k-range", "weights-shape", "weights-dtype", "expert-count", "grad"))),
        *(Case(f"chunked-{m}", "ep", m, opts=CHUNKED) for m in ("hidden-size", "ids-rows", "expert-count")),
        Case("dispatch-all-on-meta", "dispatch", "all-on-meta", bad=(0,)),
        Case("dispatch-weights-dtype", "dispatch", "weights-dtype"),
        *(Case(m, "ep", m, bad=(1,), expect="disagree") for m in DISAGREE),
        Case("disagree-hidden-chunked", "ep", "disagree-hidden", bad=(0,), opts=CHUNKED, expect="disagree"),
        Case("layer-x-hidden", "layer", "x-hidden"),
        Case("layer-x-dtype-chunked", "layer", "x-dtype", bad=(0,), opts=CHUNKED),
        Case("layer-top-k", "layer-experts", "layer-top-k"),
        *(Case(f"ll-{m}", "ep", m, bad=(i % 2,), opts=tuple(LOW_LATENCY.items()), expect="stand-in")
          for i, m in enumerate(("hidden-size", "hidden-dtype", "ids-rows", "ids-range", "grad",
                                 "expert-count"))),
        Case("ll-raise-hidden-size", "ep", "hidden-size",
             opts=(*LOW_LATENCY.items(), ("overflow", "raise"))),
        Case("ll-layer-x-hidden", "layer", "x-hidden", opts=(("mode", "low_latency"), ("capacity", TOKENS)),
             expect="stand-in"),
        Case("ll-layer-top-k", "layer-experts", "layer-top-k", bad=(0,),
             opts=(("mode", "low_latency"), ("capacity", TOKENS)), expect="stand-in"),
        Case("captured-dtype", "captured", "replay-dtype", expect="stand-in"),
        Case("captured-rows", "captured", "replay-rows", bad=(0,), expect="stand-in"),
    ],
    3: [
        Case("hidden-size-two-ranks", "ep", "hidden-size", bad=(0, 2)),
        Case("chunked-weights-shape", "ep", "weights-shape", bad=(1,), opts=CHUNKED),
        Case("disagree-top-k", "ep", "disagree-top-k", bad=(2,), expect="disagree"),
        Case("ll-ids-rows", "ep", "ids-rows", bad=(2,), opts=tuple(LOW_LATENCY.items()), expect="stand-in"),
    ],
}
NORMAL = [c.name for c in CASES[2] if c.expect == "raise" and not c.name.startswith("ll-")]
LOW = [c.name for c in CASES[2] if c.expect == "stand-in"]


@functools.cache
def _world_inputs(world: int):
    """(layer, x, topk_weights, topk_ids) of all ranks' tokens, the same in every process."""
    layer = moekit.MoELayer(SHAPE)
    layer.reset_parameters(torch.Generator().manual_seed(SEED))
    x = torch.randn(world * TOKENS, SHAPE.hidden_size, generator=torch.Generator().manual_seed(SEED + 1))
    with torch.no_grad():
        weights, ids = layer.route(x)
    return layer.requires_grad_(False), x, weights, ids


def _mutate(mutation: str, x, w, ids, gate_up, down, placement, rank):
    """This rank's (x, w, ids, gate_up, down, placement) with `mutation` applied."""
    e = SHAPE.num_experts
    if mutation == "hidden-size":
        x = torch.randn(TOKENS, SHAPE.hidden_size + 8)
    elif mutation in ("hidden-dtype", "x-dtype", "replay-dtype"):
        x = x.double()
    elif mutation == "hidden-device":
        x = x.to("meta")
    elif mutation == "hidden-1d":
        x = x[0]
    elif mutation == "ids-rows":
        ids = ids[:-1]
    elif mutation == "ids-dtype":
        ids = ids.float()
    elif mutation == "ids-range":
        ids = ids.clone()
        ids[0, 0] = e
    elif mutation == "top-k-range":
        ids = torch.zeros(TOKENS, e + 1, dtype=torch.int32)
        w = torch.full((TOKENS, e + 1), 0.1)
    elif mutation == "weights-shape":
        w = w[:, :1]
    elif mutation == "weights-dtype":
        w = w.to(torch.int32)
    elif mutation == "expert-count":
        gate_up, down = gate_up[:-1], down[:-1]
    elif mutation == "grad":
        x = x.clone().requires_grad_(True)
    elif mutation == "all-on-meta":
        x, w, ids = x.to("meta"), w.to("meta"), ids.to("meta")
    elif mutation == "x-hidden":
        x = torch.randn(TOKENS, SHAPE.hidden_size - 1)
    elif mutation == "layer-top-k":
        w, ids = w[:, :1], ids[:, :1]
    elif mutation == "replay-rows":
        x = torch.randn(TOKENS + 1, SHAPE.hidden_size)
    elif mutation == "disagree-hidden":       # consistent on this rank: only the others differ
        x, gate_up, down = x[:, :32], gate_up[:, :, :32], down[:, :32]
    elif mutation == "disagree-dtype":
        x, gate_up, down = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    elif mutation == "disagree-top-k":
        w, ids = w[:, :1], ids[:, :1]
    elif mutation == "disagree-placement":
        layer = _world_inputs(len(placement.slots))[0]
        placement = strided_placement(e, len(placement.slots))
        gate_up, down = rank_weights(layer.gate_up_proj, layer.down_proj, placement, rank)
    else:
        raise AssertionError(mutation)
    return x, w, ids, gate_up, down, placement


def _run(case: Case, rank: int, world: int, group: dist.ProcessGroup) -> torch.Tensor:
    layer, x_all, w_all, ids_all = _world_inputs(world)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    x, w, ids = x_all[mine], w_all[mine], ids_all[mine]
    placement = contiguous_placement(SHAPE.num_experts, world)
    gate_up, down = rank_weights(layer.gate_up_proj, layer.down_proj, placement, rank)
    if rank in case.bad:
        x, w, ids, gate_up, down, placement = _mutate(case.mutation, x, w, ids, gate_up, down, placement,
                                                      rank)
    opts = dict(case.opts)
    grad = torch.enable_grad() if case.mutation == "grad" else torch.no_grad()
    with grad:
        if case.api == "ep":
            return ep_moe_experts(x, gate_up, down, w, ids, placement=placement, group=group, **opts)
        if case.api == "dispatch":
            return dispatch(x, w, ids, placement, group=group)[0].x
        if case.api == "captured":
            ep = ExpertParallelMoE.from_layer(layer, placement=placement, group=group, mode="low_latency",
                                              capacity=TOKENS)
            return _captured_ep_on_cpu(ep, TOKENS)(x).clone()
        ep = ExpertParallelMoE.from_layer(layer, placement=placement, group=group, **opts)
        tiles = {"config": CFG} if ep.mode == "low_latency" else {}
        return ep(x, **tiles) if case.api == "layer" else ep.experts(x, w, ids, **tiles)


def _errors_worker(rank: int, world: int, port: int, out_dir: str, dist_backend: str) -> None:
    """Every case of the world, each in a process group of its own (CASE_TIMEOUT_S): what each raised
    (class name, message) or returned."""
    join_group(rank, world, port, dist_backend)
    try:
        results = {}
        for case in CASES[world]:
            dist.barrier()      # new_group's own store wait has the case's short timeout: enter it together
            group = dist.new_group(timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S))
            try:
                results[case.name] = ("ok", _run(case, rank, world, group))
            except Exception as exc:      # gloo's timeout too: the test then names what hung
                results[case.name] = (type(exc).__name__, str(exc))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _world(world: int, tmp_path_factory) -> list[dict]:
    if torch.cuda.is_available():
        pytest.skip("the low-latency cases run the masked kernels on CPU tensors, which Triton runs only "
                    "interpreted (machines without CUDA)")
    out_dir = tmp_path_factory.mktemp(f"errors{world}")
    return _spawn_world(world, out_dir, worker=_errors_worker, timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return _world(2, tmp_path_factory)


@pytest.fixture(scope="module")
def world3(tmp_path_factory) -> list[dict]:
    return _world(3, tmp_path_factory)


def _expected_out(world: int, rank: int) -> torch.Tensor:
    layer, x, w, ids = _world_inputs(world)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    return moe_experts_ref(x[mine], layer.gate_up_proj, layer.down_proj, w[mine], ids[mine])


def _check_case(world: int, results: list[dict], case: Case) -> None:
    got = [results[r][case.name] for r in range(world)]
    for r in range(world):
        kind, value = got[r]
        if r in case.bad and case.expect != "disagree":
            cls, text = ERRORS[case.mutation]
            assert kind == cls, (r, got[r])
            assert value.startswith(f"rank {r}: ") and text in value, (r, value)
        elif case.expect == "raise":
            assert kind == "ValueError", (r, got[r])
            assert f"rank(s) {list(case.bad)} of the group reported invalid inputs" in value, (r, value)
        elif case.expect == "disagree":
            assert kind == "ValueError", (r, got[r])
            field = DISAGREE[case.mutation]
            assert "do not line up" in value and f"differ in: {field} (rank 0: " in value, (r, value)
            assert value == got[0][1]       # the same message on every rank
        else:
            assert kind == "ok", (r, got[r])
            assert value.shape == (TOKENS, SHAPE.hidden_size)
            err = rel_err(value, _expected_out(world, r))
            assert err <= 1e-5, (r, err)


def _case(world: int, name: str) -> Case:
    return next(c for c in CASES[world] if c.name == name)


@pytest.mark.parametrize("name", NORMAL)
def test_normal_mode_input_error_on_one_rank_fails_every_rank(world2, name):
    """An error in one rank's tensors (shape, dtype, device, grad flag, top_k, its weights) is carried
    in the count exchange, as ids out of range are (test_parallel): every rank raises, none waits
    (`ep_moe_experts`, chunked, `dispatch`, the layer's forward and experts)."""
    _check_case(2, world2, _case(2, name))


@pytest.mark.parametrize("name", [c.name for c in CASES[2] if c.expect == "disagree"])
def test_normal_mode_ranks_that_disagree_fail_every_rank(world2, name):
    """Ranks whose calls are each valid but whose rows would not line up (hidden size, dtype, top_k,
    placement) raise the same ValueError, naming the field and each rank's value, instead of
    garbage or an abort inside gloo: `ep_moe_experts` called directly agrees on every call."""
    _check_case(2, world2, _case(2, name))


@pytest.mark.parametrize("name", LOW)
def test_low_latency_input_error_on_one_rank_stands_in(world2, name):
    """The bad rank takes part in the call with no tokens of its own and raises; the other ranks
    return their tokens' outputs, the bad rank's experts having served them (captured replays too)."""
    case = _case(2, name)
    if case.mutation != "expert-count":
        _check_case(2, world2, case)
        return
    # The bad rank's own weights are the bad input: the pairs it would run come back NaN, never a
    # silently smaller sum; the others' pairs are computed.
    bad, good = case.bad[0], 1 - case.bad[0]
    kind, value = world2[bad][name]
    assert kind == "ValueError" and ERRORS["expert-count"][1] in value
    kind, out = world2[good][name]
    assert kind == "ok"
    ids = _world_inputs(2)[3][good * TOKENS:(good + 1) * TOKENS]
    poisoned = torch.isin(ids, torch.tensor(contiguous_placement(SHAPE.num_experts, 2).slots[bad])).any(1)
    assert poisoned.any() and not poisoned.all()
    assert torch.isnan(out[poisoned]).all()
    assert rel_err(out[~poisoned], _expected_out(2, good)[~poisoned]) <= 1e-5


def test_low_latency_raise_policy_fails_every_rank(world2):
    """overflow="raise" already reads one all_reduce on the host: it carries the failed ranks too, so
    every rank raises."""
    kind, value = world2[0]["ll-raise-hidden-size"]
    assert kind == "ValueError", (kind, value)
    assert "rank(s) [1] of the group reported invalid inputs and sent no tokens" in value
    kind, value = world2[1]["ll-raise-hidden-size"]
    assert kind == "ValueError" and value.startswith("rank 1: ") and ERRORS["hidden-size"][1] in value


@pytest.mark.parametrize("name", [c.name for c in CASES[3]])
def test_three_ranks(world3, name):
    """A world of 3: two bad ranks named together, a chunked error, one rank of three disagreeing,
    a low-latency stand-in serving two good ranks."""
    _check_case(3, world3, _case(3, name))
