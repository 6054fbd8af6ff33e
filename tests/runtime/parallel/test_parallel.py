"""Expert parallelism: the EP layer must compute the layer on the same tokens.

Two kinds of test:
  * in-process: `simulate_ep` runs N virtual ranks through the same plan / pack / experts / reduce
    steps with a loopback all-to-all (fast; many placements and world sizes);
  * spawned gloo groups of 2 and 4 processes on 127.0.0.1: each world is started once (a module
    fixture), runs every case, and saves its outputs; the tests compare them here.
The oracle is the fp32 reference on all the tokens (`moe_experts_ref`, routed by the tests' own
`helpers.topk_softmax_fp32`), never moekit's single-device layer. The per-token reduction in rank
order is checked bitwise against an explicitly ordered fp32 sum (`exact_experts`).
The parent process hosts the TCPStore (port 0: the OS picks a free one, so there is no race), and
every child is killed if the world has not finished within WORLD_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import itertools
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moekit
import moekit.cli
from helpers import rel_err, same_dtype_bound, topk_softmax_fp32
from moekit.bench import ep_bench
from moekit.bench.ep_report import A2A_PEAK, CSV_NAME, PHASES, PLAIN, REPORT_NAME, STEP, STEPS, read_csv
from moekit.bench.scenarios import expert_loads, make_scenario
from moekit.bench.simulate import shard_experts, simulate_ep
from moekit.parallel import (
    NVLS_OFF,
    ExpertParallelMoE,
    combine,
    disable_nvls,
    dispatch,
    ep_moe_experts,
    fused,
    run_local_experts,
)
from moekit.parallel.dispatch import plan_routes_torch, route_positions
from moekit.parallel.overlap import chunk_bounds, chunk_counts, chunk_plan
from moekit.placement import (
    Placement,
    contiguous_placement,
    rank_weights,
    replicate_hot_experts,
    strided_placement,
)
from moekit.reference import moe_experts_ref

disable_nvls()  # NVLink multicast off for every test here, and for every process they start

WORLD_TIMEOUT_S = 240   # a hang guard: under two pytest workers on two cores a 4-process world took ~40 s
SEED = 1234
BACKEND = "grouped_mm"  # what "auto" picks on CPU for these shapes; the experts path is not under test
OVERLAP_CHUNKS = (2, 3)  # these cases also run chunked (`moekit.parallel.overlap`): the same bits as 1
OVERLAP_CASES = ("router-rank-without-tokens", "collapse", "zipf-1.5", "hot-replicated",
                 "fewer-tokens-than-chunks")
# E = 7 does not divide over 2 or 4 ranks, and with 4 ranks one of them holds a single expert (< K).
UNEVEN = moekit.MoEShape(7, 64, 48, 2)


# The rank-order case: E = 4 experts, one per rank of 4, top_k = 3 < 4: a token's partials come
# from 3 ranks, and three fp32 additions depend on their order.
ORDER_WORLD = 4
ORDER_TOKENS = (1, 2, 0, 1)
TINY_W = 2.0**-24  # half an ulp of 1.0: 1 + TINY_W rounds back to 1, TINY_W + TINY_W + 1 does not


def exact_experts(num_experts: int, hidden: int = 8, inter: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts whose output is exactly ones(H) for any x with x[:, 0] == 1, in fp32 on any backend.

    gate = 32 * x0 = 32, up = x0 / 32; silu(32) = 32 in fp32 (sigmoid(32) rounds to 1), so the
    activation is exactly 1 and down (column 0 of ones) gives 1 in every row. A pair's partial is
    then exactly its routing weight, and a token's output is the fp32 sum of its weights in the
    order the combine adds them.
    """
    gate_up = torch.zeros(num_experts, 2 * inter, hidden)
    gate_up[:, :inter, 0] = 32.0
    gate_up[:, inter:, 0] = 1 / 32
    down = torch.zeros(num_experts, hidden, inter)
    down[:, :, 0] = 1.0
    return gate_up, down


def exact_arithmetic(layer: moekit.MoELayer, x: torch.Tensor) -> tuple[moekit.MoELayer, torch.Tensor]:
    """The layer and tokens with values whose expert math is exact in fp32 in any summation order:
    x in halves, gate_up in {-1/8, 0, 1/8} (every gate and up value exact), down with one nonzero
    (+-2**k) per output row (each output one product of the activation). The CPU GEMMs are not
    row-independent (MKL takes another kernel for 1 or 2 rows), so chunked and unchunked calls are
    compared bit for bit on these: what differs then is the chunking, not the BLAS."""
    g = torch.Generator().manual_seed(SEED + 2)
    num_experts, two_i, hidden = layer.gate_up_proj.shape
    inter = two_i // 2
    exact = copy.deepcopy(layer)
    with torch.no_grad():
        exact.gate_up_proj.copy_(torch.randint(-1, 2, (num_experts, two_i, hidden), generator=g) / 8)
        scale = 2.0 ** torch.randint(-2, 3, (num_experts, hidden, 1), generator=g)
        sign = torch.randint(0, 2, (num_experts, hidden, 1), generator=g) * 2 - 1
        cols = torch.randint(0, inter, (num_experts, hidden, 1), generator=g)
        exact.down_proj.copy_(torch.zeros(num_experts, hidden, inter).scatter_(2, cols, scale * sign))
    return exact, (x * 2).round() / 2


def ordered_case():
    """(x, weights, ids, gate_up, down) of the rank-order case; each token has one weight 1 and two
    TINY_W, the 1 placed first or last in rank order and anywhere in slot order."""
    ids = torch.tensor([[0, 1, 2], [2, 1, 0], [3, 0, 2], [1, 3, 0]], dtype=torch.int32)
    weights = torch.tensor([[1, TINY_W, TINY_W], [1, TINY_W, TINY_W], [TINY_W, 1, TINY_W],
                            [TINY_W, 1, TINY_W]], dtype=torch.float32)
    x = torch.randn(ids.shape[0], 8, generator=torch.Generator().manual_seed(SEED))
    x[:, 0] = 1.0
    return (x, weights, ids, *exact_experts(ORDER_WORLD))


def rank_order_sum(weights: torch.Tensor, ids: torch.Tensor, placement: Placement,
                   reverse: bool = False) -> torch.Tensor:
    """(T,) each token's weights added one by one in fp32, by the rank holding the expert
    (increasing, or decreasing with `reverse`): what the combine of `exact_experts` must return."""
    out = []
    for w_row, id_row in zip(weights.tolist(), ids.tolist(), strict=True):
        ranks = [next(r for r, slots in enumerate(placement.slots) if e in slots) for e in id_row]
        acc = torch.zeros((), dtype=torch.float32)
        for _, w in sorted(zip(ranks, w_row, strict=True), reverse=reverse):
            acc = acc + torch.tensor(w, dtype=torch.float32)
        out.append(acc)
    return torch.stack(out)


def _split_rows(tokens) -> list[slice]:
    bounds = [0, *torch.tensor(tokens).cumsum(0).tolist()]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class Case:
    """One EP run. tokens[r] = rank r's token count; routing "router" uses the layer's router."""

    name: str
    tokens: tuple[int, ...]
    routing: str = "router"
    shape: str = "tiny"
    spare_slots: int = 0      # > 0: replicas of the hottest experts fill the spare slots
    duplicate_ids: bool = False
    backend: str = BACKEND


def _cases(world: int) -> list[Case]:
    if world == 2:
        uneven_tokens, idle, few = (9, 4), (0, 6), (2, 1)
    else:
        uneven_tokens, idle, few = (5, 0, 11, 3), (4, 0, 7, 0), (1, 2, 0, 1)
    return [
        Case("router", uneven_tokens),
        Case("router-rank-without-tokens", idle),
        Case("collapse", uneven_tokens, routing="collapse"),            # ranks > 0 receive nothing
        Case("zipf-1.5", uneven_tokens, routing="zipf-1.5"),
        Case("hot-replicated", uneven_tokens, routing="hot-1", spare_slots=1),
        Case("uneven-experts", uneven_tokens, shape="uneven"),
        Case("duplicate-ids", uneven_tokens, routing="zipf-1.0", duplicate_ids=True),
        Case("loop-backend", idle, routing="balanced", backend="loop"),
        Case("no-tokens-anywhere", (0,) * world),
        Case("fewer-tokens-than-chunks", few, routing="balanced"),
    ]


def _gpu_cases(world: int) -> list[Case]:
    tokens = tuple(range(37, 37 + world))
    return [
        Case("router", tokens, backend="auto"),
        Case("collapse", tokens, routing="collapse", backend="auto"),
        Case("zipf-1.5", tokens, routing="zipf-1.5", backend="auto"),
        Case("uneven-experts", tokens, shape="uneven", backend="auto"),
        Case("no-tokens-anywhere", (0,) * world, backend="auto"),
    ]


def _shape(case: Case) -> moekit.MoEShape:
    return UNEVEN if case.shape == "uneven" else moekit.get_shape(case.shape)


def _full_layer(case: Case) -> moekit.MoELayer:
    layer = moekit.MoELayer(_shape(case), backend=case.backend)
    layer.reset_parameters(torch.Generator().manual_seed(SEED))
    return layer


def _global_inputs(case: Case, layer: moekit.MoELayer):
    """All ranks' tokens and routing, concatenated in rank order; the same in every process."""
    shape, total = layer.shape, sum(case.tokens)
    x = torch.randn(total, shape.hidden_size, generator=torch.Generator().manual_seed(SEED + 1))
    if case.routing == "router":
        weights, ids = layer.route(x)
    else:
        weights, ids = make_scenario(case.routing, total, shape.num_experts, shape.top_k, seed=SEED)
    if case.duplicate_ids:
        ids = ids.clone()
        ids[::2, 1] = ids[::2, 0]  # each (token, slot) pair counts on its own
    return x, weights, ids


def _placement(case: Case, ids: torch.Tensor, world: int) -> Placement:
    e = _shape(case).num_experts
    base = contiguous_placement(e, world, spare_slots=case.spare_slots)
    if case.spare_slots:
        return replicate_hot_experts(expert_loads(ids, e), base)
    return base


def _run_case(case: Case, rank: int, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    layer = _full_layer(case)
    x, weights, ids = _global_inputs(case, layer)
    placement = _placement(case, ids, world)
    layer, x, weights, ids = layer.to(device), x.to(device), weights.to(device), ids.to(device)
    lo = sum(case.tokens[:rank])
    mine = slice(lo, lo + case.tokens[rank])
    ep = ExpertParallelMoE.from_layer(layer, placement=placement)
    result = {}
    with torch.no_grad():
        if case.routing == "router":
            out = ep(x[mine])
            weights, ids = ep.route(x[mine])
            result["ids"] = ids
        else:
            weights, ids = weights[mine], ids[mine]
            out = ep.experts(x[mine], weights, ids)
        if case.name in OVERLAP_CASES:
            # On exact-arithmetic experts (`exact_arithmetic`); on CUDA also on these weights, where
            # the triton kernels' rows are independent of each other.
            variants = {"exact": exact_arithmetic(layer, x)}
            if device.type == "cuda":
                variants["overlap"] = (layer, x)
            for (name, (full, tokens_)), n in itertools.product(variants.items(), (1, *OVERLAP_CHUNKS)):
                chunked = ExpertParallelMoE.from_layer(full, placement=placement, overlap_chunks=n)
                result[f"{name}{n}"] = chunked(tokens_[mine]) if case.routing == "router" else \
                    chunked.experts(tokens_[mine], weights, ids)
        # The same call through the three public phases, to see what this rank sent and received.
        tokens, handle = dispatch(x[mine], weights, ids, placement)
        partial = run_local_experts(tokens, ep.gate_up_proj, ep.down_proj, backend=case.backend)
        again = combine(partial, handle)
    result = {**result, "out": out, "again": again}
    return {**{k: v.cpu() for k, v in result.items()}, "received": torch.tensor(tokens.recv_counts),
            "sent": torch.tensor(handle.send_counts)}


def _run_world_checks(rank: int, world: int) -> dict[str, object]:
    """Checks that need a live group: bad arguments raise the same clear error on every rank."""
    shape = moekit.get_shape("tiny")
    placement = contiguous_placement(shape.num_experts, world)
    x = torch.randn(3, shape.hidden_size)
    w = torch.full((3, shape.top_k), 0.5)
    ids = torch.zeros(3, shape.top_k, dtype=torch.int32)
    gate_up = torch.zeros(len(placement.slots[rank]), 2 * shape.intermediate_size, shape.hidden_size)
    down = torch.zeros(len(placement.slots[rank]), shape.hidden_size, shape.intermediate_size)
    errors = {}
    for name, kwargs in {
        "wrong-world": dict(placement=contiguous_placement(shape.num_experts, world + 1)),
        "bad-ids": dict(placement=placement, ids=ids + shape.num_experts),
        "wrong-local-experts": dict(placement=placement, gate_up=gate_up[:0], down=down[:0]),
        "overlap-zero": dict(placement=placement, opts=dict(overlap_chunks=0)),
        "overlap-low-latency": dict(placement=placement, opts=dict(overlap_chunks=2, mode="low_latency",
                                                                   capacity=3)),
        "overlap-stats": dict(placement=placement, opts=dict(overlap_chunks=2, stats={})),
    }.items():
        try:
            ep_moe_experts(x, kwargs.get("gate_up", gate_up), kwargs.get("down", down), w,
                           kwargs.get("ids", ids), placement=kwargs["placement"], **kwargs.get("opts", {}))
        except ValueError as exc:
            errors[name] = str(exc)
    # Ids out of range with ignore_invalid_ids: those pairs contribute exactly 0.
    invalid = ids.clone()
    invalid[:, 1] = -1
    invalid[0, :] = shape.num_experts
    out = ep_moe_experts(x, gate_up + 1.0, down + 1.0, w, invalid, placement=placement,
                         ignore_invalid_ids=True)
    # Forward only: with gradients on, the layer says so instead of silently dropping them.
    layer = moekit.MoELayer(shape)
    layer.reset_parameters(torch.Generator().manual_seed(SEED))
    ep = ExpertParallelMoE.from_layer(layer)
    try:
        ep(x)
    except RuntimeError as exc:
        errors["grad"] = str(exc)
    # Seeded construction holds this rank's share of the seeded single-device layer.
    seeded = ExpertParallelMoE(shape)
    seeded.reset_parameters(torch.Generator().manual_seed(SEED))
    same = all(torch.equal(getattr(seeded, n), getattr(ep, n))
               for n in ("router_weight", "gate_up_proj", "down_proj"))
    # The combine's rank-order sum, through real all-to-alls (one expert per rank, K = 3 < N = 4).
    ordered = None
    if world == ORDER_WORLD:
        x_all, w_all, ids_all, gate_up_all, down_all = ordered_case()
        mine = _split_rows(ORDER_TOKENS)[rank]
        placement = contiguous_placement(ORDER_WORLD, ORDER_WORLD)
        gate_up_r, down_r = rank_weights(gate_up_all, down_all, placement, rank)
        ordered = [ep_moe_experts(x_all[mine], gate_up_r, down_r, w_all[mine], ids_all[mine],
                                  placement=placement, backend=BACKEND, overlap_chunks=n)
                   for n in (1, *OVERLAP_CHUNKS)]
    return {"errors": errors, "invalid_out": out, "seeded_matches": same, "ordered": ordered}


def _run_bench(out_dir: Path) -> int:
    """`moekit ep-bench` inside the live group (the same code torchrun runs), tiny and quick."""
    parser = argparse.ArgumentParser()
    ep_bench.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--tokens", "16", "--scenarios", "balanced,collapse",
                              "--spare-slots", "1", "--warmup", "1", "--iters", "3", "--out", str(out_dir),
                              "--modes", "normal,low_latency", "--ll-tokens", "3", "--a2a-mib", "1",
                              "--overlap-chunks", "1,2"])
    return ep_bench.run(args)


def join_group(rank: int, world: int, port: int, dist_backend: str) -> torch.device:
    """In a spawned child: join the parent's store and start the process group; this rank's device."""
    disable_nvls()  # NVLink multicast off, before any process group starts
    torch.set_num_threads(1)  # 4 processes on a 2-core machine: no oversubscription
    if dist_backend == "gloo" and rank % 2 == 0:
        # Even ranks run the fused EP kernels (interpreted), odd ranks their torch twins: the rows
        # and metadata on the wire are the same bits, so every world checks both paths and that
        # they interoperate. (On GPUs every rank runs the kernels.)
        os.environ["MOEKIT_EP_TRITON"] = "1"
        os.environ["MOEKIT_LAYOUT_TRITON"] = "1"      # and the masked layout's kernel (low-latency mode)
    timeout = datetime.timedelta(seconds=WORLD_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    device = torch.device("cpu")
    kwargs = {}
    if dist_backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return device


def _worker(rank: int, world: int, port: int, out_dir: str, dist_backend: str) -> None:
    device = join_group(rank, world, port, dist_backend)
    try:
        cases = _cases(world) if dist_backend == "gloo" else _gpu_cases(world)
        results = {c.name: _run_case(c, rank, world, device) for c in cases}
        results["_env"] = {k: os.environ.get(k) for k in NVLS_OFF}
        results["_ep_path"] = fused.path_for(torch.zeros(1, device=device))
        if dist_backend == "gloo":
            results["_checks"] = _run_world_checks(rank, world)
            if world == 2:
                results["_bench_rc"] = _run_bench(Path(out_dir) / "bench")
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn_world(world: int, out_dir: Path, dist_backend: str = "gloo", worker=None,
                 timeout_s: float = WORLD_TIMEOUT_S) -> list[dict]:
    """Run `worker(rank, world, port, out_dir, dist_backend)` (default `_worker`) in `world` spawned
    processes, killed after timeout_s; each saves rank{r}.pt in out_dir, loaded here in rank order."""
    disable_nvls()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.start_processes(worker or _worker, args=(world, store.port, str(out_dir), dist_backend),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{dist_backend} world of {world} did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"gloo{n}")
def gloo_world(request, tmp_path_factory):
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"gloo{world}")
    return world, _spawn_world(world, out_dir), out_dir


def _expected(case: Case) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 reference output of all ranks' tokens, and the router's ids for the "router" cases."""
    layer = _full_layer(case)
    x, weights, ids = _global_inputs(case, layer)
    expected_ids = None
    with torch.no_grad():
        if case.routing == "router":
            weights, expected_ids = topk_softmax_fp32(x @ layer.router_weight.T, layer.shape.top_k,
                                                      layer.shape.norm_topk_prob)
        return moe_experts_ref(x, layer.gate_up_proj, layer.down_proj, weights, ids
                               if expected_ids is None else expected_ids), expected_ids


@pytest.mark.parametrize("case_name", [c.name for c in _cases(2)])
def test_gloo_matches_reference(gloo_world, case_name):
    world, results, _ = gloo_world
    case = next(c for c in _cases(world) if c.name == case_name)
    expected, expected_ids = _expected(case)
    outs = [results[r][case.name]["out"] for r in range(world)]
    for r, out in enumerate(outs):
        assert out.shape == (case.tokens[r], _shape(case).hidden_size)
        assert out.dtype == torch.float32
        # Bitwise reproducible: the per-token sum runs in rank order, never through atomics.
        assert torch.equal(out, results[r][case.name]["again"])
    torch.testing.assert_close(torch.cat(outs), expected)
    if expected_ids is not None:  # each rank's router picks exactly the reference's experts
        assert torch.equal(torch.cat([results[r][case.name]["ids"] for r in range(world)]), expected_ids)


@pytest.mark.parametrize("case_name", OVERLAP_CASES)
def test_gloo_overlap_chunks_bitwise(gloo_world, case_name):
    """overlap_chunks = 2 and 3 return the bits of 1 on every rank (experts with exact math, so
    that only the chunking can differ: on inexact sums grouped_mm's CPU BLAS rounds by the chunk's
    row count, `test_overlap_chunks_on_random_weights_in_a_gloo_world_of_one`): balanced, skewed
    (zipf, collapse), replicated experts, ranks with no tokens or fewer tokens than chunks. Chunk 0's
    pairs and rows are not all of them."""
    world, results, _ = gloo_world
    for r in range(world):
        got = results[r][case_name]
        assert got["exact1"].abs().sum() > 0 or got["exact1"].numel() == 0
        for n in OVERLAP_CHUNKS:
            assert torch.equal(got[f"exact{n}"], got["exact1"]), (r, n)


def test_overlap_chunks_on_random_weights_in_a_gloo_world_of_one(monkeypatch):
    """On random weights (inexact sums) overlap_chunks = 2 and 3 return the bits of 1 with the triton
    backend (interpreted, each row's dot its own), and with grouped_mm, whose CPU BLAS orders sums by
    the chunk's row count, agree with 1 within fp32 rounding; both match the fp32 reference."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, top_k, tokens = 8, 64, 48, 2, 33
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g)
    ref = moe_experts_ref(x, gate_up, down, weights, ids)
    placement = contiguous_placement(num_experts, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.no_grad():
            for backend in ("triton", "grouped_mm"):
                one = ep_moe_experts(x, gate_up, down, weights, ids, placement=placement, backend=backend)
                assert rel_err(one, ref) <= 1e-5, backend
                for n in OVERLAP_CHUNKS:
                    got = ep_moe_experts(x, gate_up, down, weights, ids, placement=placement, backend=backend,
                                         overlap_chunks=n)
                    if backend == "triton":
                        assert torch.equal(got, one), n
                    else:
                        torch.testing.assert_close(got, one, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_overlap_chunks_must_be_a_positive_int():
    """Checked in the constructor, before the process group is looked at."""
    for bad in (0, -1, 1.5, "2", True, None):
        with pytest.raises(ValueError, match="overlap_chunks must be an int >= 1"):
            ExpertParallelMoE("tiny", overlap_chunks=bad)
    with pytest.raises(ValueError, match="overlap_chunks applies to mode='normal'"):
        ExpertParallelMoE("tiny", mode="low_latency", capacity=4, overlap_chunks=2)


@pytest.mark.parametrize("opts,exc,msg", [
    (dict(backend="nope"), ValueError, r"backend must be 'auto' or one of \("),
    (dict(config="bad"), TypeError, r"config must be a moekit\.ExpertsConfig or None, got str"),
    (dict(stats=[]), TypeError, r"stats must be a dict or None, got list"),
    (dict(backend="loop", capacity_factor=1.0), ValueError, r"capacity_factor applies to"),
    (dict(capacity_factor=-1.0), ValueError, r"capacity_factor must be > 0"),
    (dict(chunk=2), TypeError, r"unknown expert option\(s\) chunk for mode='normal'"),
], ids=["backend", "config", "stats", "option-of-another-backend", "capacity-factor", "unknown"])
def test_normal_mode_options_raise_before_any_collective(opts, exc, msg):
    """The same on every rank, so every rank raises at once, before the process group is looked at
    (none is initialised here): a rank that receives no rows never calls the experts, and would wait
    in the combine for one that raised there. The constructor checks its backend alike."""
    assert not dist.is_initialized()
    shape = moekit.get_shape("tiny")
    x = torch.randn(3, shape.hidden_size)
    w, ids = torch.rand(3, shape.top_k), torch.zeros(3, shape.top_k, dtype=torch.int32)
    gu = torch.zeros(shape.num_experts, 2 * shape.intermediate_size, shape.hidden_size)
    dn = torch.zeros(shape.num_experts, shape.hidden_size, shape.intermediate_size)
    with pytest.raises(exc, match=msg):
        ep_moe_experts(x, gu, dn, w, ids, placement=contiguous_placement(shape.num_experts, 2), **opts)
    if set(opts) == {"backend"}:
        with pytest.raises(exc, match=msg):
            ExpertParallelMoE("tiny", **opts)


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 13])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_chunk_counts_and_plans_cut_the_plan_by_token_ranges(num_tokens, chunks):
    """Chunk c's counts are its tokens' rows per rank (the rows sum to the plan's), and its plan is
    the plan of its tokens alone, positions counted from the chunk's first token."""
    placement = replicate_hot_experts(torch.arange(8.0), contiguous_placement(8, 3, spare_slots=1))
    _, ids = make_scenario("zipf-1.0", num_tokens, 8, 2, seed=SEED)
    plan = plan_routes_torch(ids, placement, 1)
    bounds = chunk_bounds(num_tokens, chunks)
    assert bounds[0] == 0 and bounds[-1] == num_tokens and sorted(bounds) == bounds
    counts = chunk_counts(plan, bounds)
    assert counts.shape == (chunks, 3) and torch.equal(counts.sum(0), plan.send_counts)
    full = route_positions(plan.hit)
    for c in range(chunks):
        lo, hi = bounds[c], bounds[c + 1]
        assert torch.equal(counts[c], plan.hit[lo:hi].sum(0))
        with_pos = chunk_plan(replace(plan, pos=full), lo, hi, counts[c])
        assert torch.equal(with_pos.pos, route_positions(plan.hit[lo:hi]))
        assert torch.equal(with_pos.dest, plan.dest[lo:hi])


def test_gloo_split_sizes(gloo_world):
    """Collapse: only rank 0's experts get pairs, so the other ranks receive no rows (zero-size
    splits) yet return their own tokens' outputs. Each token row travels once per destination."""
    world, results, _ = gloo_world
    collapse = next(c for c in _cases(world) if c.name == "collapse")
    received = [results[r]["collapse"]["received"] for r in range(world)]
    assert received[0].tolist() == list(collapse.tokens)  # one row per token, not one per pair
    for r in range(1, world):
        assert received[r].sum() == 0
    hot = next(c for c in _cases(world) if c.name == "hot-replicated")
    assert _placement(hot, _global_inputs(hot, _full_layer(hot))[2], world).num_replicas > 0
    for name in ("collapse", "zipf-1.5", "hot-replicated", "uneven-experts"):
        sent = torch.stack([results[r][name]["sent"] for r in range(world)])
        recv = torch.stack([results[r][name]["received"] for r in range(world)])
        assert torch.equal(sent, recv.T)  # rank s's sends to d are d's receives from s
        case = next(c for c in _cases(world) if c.name == name)
        top_k = _shape(case).top_k
        assert all(n <= min(world, top_k) * t for n, t in zip(sent.sum(1).tolist(), case.tokens, strict=True))


def test_gloo_argument_errors(gloo_world):
    world, results, _ = gloo_world
    for r in range(world):
        errors = results[r]["_checks"]["errors"]
        assert "placement is for" in errors["wrong-world"]
        assert "topk_ids must lie in" in errors["bad-ids"]
        assert "experts in the placement" in errors["wrong-local-experts"]
        assert "overlap_chunks must be an int >= 1" in errors["overlap-zero"]
        assert "overlap_chunks applies to mode='normal'" in errors["overlap-low-latency"]
        assert "stats" in errors["overlap-stats"] and "overlap_chunks=1" in errors["overlap-stats"]
        assert "forward-only" in errors["grad"]
        assert results[r]["_checks"]["seeded_matches"]
        # Rows with no valid pair output exactly 0; slot 1 (-1) adds nothing to the others.
        out = results[r]["_checks"]["invalid_out"]
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert results[r]["_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        assert results[r]["_ep_path"] == ("triton" if r % 2 == 0 else "torch")     # see join_group


ONE_RANK_ERROR_TIMEOUT_S = 90   # the whole world; before the count exchange carried errors, rank 0 hung


def _save_errors(body, rank: int, world: int, port: int, out_dir: str, dist_backend: str) -> None:
    """A spawned rank: join the group, save what body(rank, world) returns (the errors each raised)."""
    join_group(rank, world, port, dist_backend)
    try:
        torch.save(body(rank, world), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_rank_errors(rank: int, world: int) -> dict[int, str]:
    """Rank 1 alone passes an id outside [0, E), in the normal mode and chunked: every rank raises."""
    shape = moekit.get_shape("tiny")
    placement = contiguous_placement(shape.num_experts, world)
    n = len(placement.slots[rank])
    x = torch.randn(3, shape.hidden_size)
    gate_up = torch.zeros(n, 2 * shape.intermediate_size, shape.hidden_size)
    down = torch.zeros(n, shape.hidden_size, shape.intermediate_size)
    ids = torch.zeros(3, shape.top_k, dtype=torch.int32)
    if rank == 1:
        ids[0, 0] = shape.num_experts
    errors = {}
    for chunks in (1, 2):
        try:
            ep_moe_experts(x, gate_up, down, torch.full((3, shape.top_k), 0.5), ids, placement=placement,
                           overlap_chunks=chunks)
        except ValueError as exc:
            errors[chunks] = str(exc)
    return errors


def test_gloo_one_rank_with_invalid_ids_fails_every_rank(tmp_path):
    """An id error on one rank's data is carried in the count exchange: every rank raises a clear
    error naming the rank, instead of that rank alone raising and the others waiting in the exchange
    until the group's timeout (both the one-shot and the chunked path)."""
    errors = _spawn_world(2, tmp_path, worker=functools.partial(_save_errors, _one_rank_errors),
                          timeout_s=ONE_RANK_ERROR_TIMEOUT_S)
    for chunks in (1, 2):
        assert "rank 1: topk_ids must lie in [0, num_experts=" in errors[1][chunks]
        assert "rank(s) [1] of the group reported invalid inputs" in errors[0][chunks]


# name: (what rank 0 builds, what the other ranks build), ExpertParallelMoE keyword arguments
MISMATCHES = {
    "hidden_size": (dict(shape=moekit.MoEShape(8, 64, 48, 2)), dict(shape=moekit.MoEShape(8, 32, 48, 2))),
    "dtype": (dict(dtype=torch.float16), dict(dtype=torch.bfloat16)),
    "top_k": (dict(shape=moekit.MoEShape(8, 64, 48, 2)), dict(shape=moekit.MoEShape(8, 64, 48, 1))),
    "mode": (dict(), dict(mode="low_latency", capacity=4)),
    "capacity": (dict(mode="low_latency", capacity=4), dict(mode="low_latency", capacity=3)),
    "overlap_chunks": (dict(), dict(overlap_chunks=2)),
    "placement": (dict(), dict(placement="strided")),
}


def _mismatch_errors(rank: int, world: int) -> dict[str, str]:
    """Rank 0 builds one layer, the others another: the first call raises on every rank."""
    errors = {}
    for name, kinds in MISMATCHES.items():
        kwargs = dict(kinds[0] if rank == 0 else kinds[1])
        shape = kwargs.pop("shape", moekit.get_shape("tiny"))
        if kwargs.get("placement") == "strided":
            kwargs["placement"] = strided_placement(shape.num_experts, world)
        ep = ExpertParallelMoE(shape, **kwargs)
        x = torch.randn(3, shape.hidden_size, dtype=ep.gate_up_proj.dtype)
        try:
            with torch.no_grad():
                ep(x)
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def test_gloo_ranks_that_build_different_layers_fail_every_rank(tmp_path):
    """Ranks that disagree on the layer's shape, dtype, top_k, mode, capacity, overlap_chunks or
    placement would exchange rows of other sizes or layouts (garbage, or an abort inside gloo): the
    first call agrees on them once and raises on every rank, naming the field and each rank's value."""
    errors = _spawn_world(2, tmp_path, worker=functools.partial(_save_errors, _mismatch_errors),
                          timeout_s=ONE_RANK_ERROR_TIMEOUT_S)
    for r in range(2):
        assert set(errors[r]) == set(MISMATCHES), errors[r]
        for name, message in errors[r].items():
            assert "the ranks of the group built different layers" in message
            assert f"differ in: {name} (rank 0: " in message, message
    assert "dtype (rank 0: torch.float16, rank 1: torch.bfloat16)" in errors[1]["dtype"]
    assert "capacity (rank 0: 4, rank 1: 3)" in errors[0]["capacity"]


def _split(t: torch.Tensor, counts) -> list[torch.Tensor]:
    return list(torch.split(t, list(counts)))


@pytest.mark.parametrize(
    "num_experts,world,top_k,tokens",
    [
        (8, 1, 2, (13,)),
        (8, 3, 2, (4, 0, 9)),          # uneven placement 3/3/2, a rank without tokens
        (7, 4, 2, (3, 5, 1, 6)),       # one rank holds a single expert, fewer than K
        (8, 8, 3, (2, 0, 1, 3, 0, 5, 1, 1)),
        (5, 5, 5, (3, 2, 0, 4, 1)),    # top_k = E: every rank gets every token
        (6, 2, 1, (0, 0)),             # no tokens anywhere
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
@pytest.mark.parametrize("routing", ["zipf-1.0", "collapse"])
@pytest.mark.parametrize("replicas", [0, 1], ids=["contiguous", "replicated"])
def test_simulated_group_matches_reference(num_experts, world, top_k, tokens, routing, replicas):
    shape = moekit.MoEShape(num_experts, 64, 48, top_k)
    layer = moekit.MoELayer(shape, backend=BACKEND)
    layer.reset_parameters(torch.Generator().manual_seed(SEED))
    total = sum(tokens)
    x = torch.randn(total, shape.hidden_size, generator=torch.Generator().manual_seed(SEED))
    weights, ids = make_scenario(routing, total, num_experts, top_k, seed=SEED)
    placement = contiguous_placement(num_experts, world, spare_slots=replicas)
    if replicas:
        placement = replicate_hot_experts(expert_loads(ids, num_experts), placement)
    with torch.no_grad():
        expected = moe_experts_ref(x, layer.gate_up_proj, layer.down_proj, weights, ids)
        outs = simulate_ep(_split(x, tokens), _split(weights, tokens), _split(ids, tokens),
                           shard_experts(layer.gate_up_proj, layer.down_proj, placement), placement,
                           backend=BACKEND)
    assert [o.shape[0] for o in outs] == list(tokens)
    torch.testing.assert_close(torch.cat(outs), expected)


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_simulated_combine_sums_in_rank_order(backend):
    """Each token's partials are added in increasing rank order, bit for bit (dispatch.py's
    contract): reversed, or in slot order, the sums of 1 and two half-ulps differ."""
    x, weights, ids, gate_up, down = ordered_case()
    placement = contiguous_placement(ORDER_WORLD, ORDER_WORLD)
    expected = rank_order_sum(weights, ids, placement)
    assert not torch.equal(expected, rank_order_sum(weights, ids, placement, reverse=True))
    rows = _split_rows(ORDER_TOKENS)
    with torch.no_grad():
        outs = simulate_ep([x[r] for r in rows], [weights[r] for r in rows], [ids[r] for r in rows],
                           shard_experts(gate_up, down, placement), placement, backend=backend)
    out = torch.cat(outs)
    assert torch.equal(out, expected[:, None].expand_as(out))


def test_gloo_combine_sums_in_rank_order(gloo_world):
    world, results, _ = gloo_world
    if world != ORDER_WORLD:
        pytest.skip("three partials per token need a world of 4")
    _, weights, ids, _, _ = ordered_case()
    expected = rank_order_sum(weights, ids, contiguous_placement(ORDER_WORLD, ORDER_WORLD))
    for i, n in enumerate((1, *OVERLAP_CHUNKS)):   # chunked too: 1, 2 or 0 tokens per rank, 2 or 3 chunks
        out = torch.cat([results[r]["_checks"]["ordered"][i] for r in range(world)])
        assert torch.equal(out, expected[:, None].expand_as(out)), n


def test_simulated_group_nan_stays_in_its_row():
    shape = moekit.get_shape("tiny")
    layer = moekit.MoELayer(shape, backend=BACKEND)
    x = torch.randn(6, shape.hidden_size)
    x[2, 5] = float("nan")
    placement = contiguous_placement(shape.num_experts, 2)
    with torch.no_grad():
        weights, ids = layer.route(x.nan_to_num())
        outs = simulate_ep(_split(x, (3, 3)), _split(weights, (3, 3)), _split(ids, (3, 3)),
                           shard_experts(layer.gate_up_proj, layer.down_proj, placement), placement,
                           backend=BACKEND)
    out = torch.cat(outs)
    assert torch.isnan(out[2]).all()
    assert torch.isfinite(out[torch.arange(6) != 2]).all()


def test_simulated_group_rejects_mismatched_shards():
    shape = moekit.get_shape("tiny")
    layer = moekit.MoELayer(shape)
    placement = contiguous_placement(shape.num_experts, 2)
    shards = shard_experts(layer.gate_up_proj, layer.down_proj, placement)
    x, w, ids = torch.randn(2, 64), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="holds 0 experts"):
        simulate_ep([x, x], [w, w], [ids, ids], [shards[0], (shards[1][0][:0], shards[1][1][:0])],
                    placement)
    with torch.no_grad():
        gate_up, _ = rank_weights(layer.gate_up_proj, layer.down_proj, placement, 1)
    assert torch.equal(gate_up, layer.gate_up_proj[4:])


def test_gloo_ep_bench(gloo_world):
    """`moekit ep-bench` in a live gloo group: every row correct and timed, loads as routed."""
    world, results, out_dir = gloo_world
    if world != 2:
        pytest.skip("the bench smoke run uses the world of 2")
    assert [results[r]["_bench_rc"] for r in range(world)] == [0, 0]
    rows = read_csv(out_dir / "bench" / CSV_NAME)
    bench = out_dir / "bench"
    assert all((bench / n).exists() for n in (REPORT_NAME, "ep_tiny.png", "ep_low_latency_tiny.png"))
    report = (bench / REPORT_NAME).read_text()
    assert all(part in report for part in ("## All-to-all peak", "## Low-latency mode", "| 3 | contiguous |"))
    peak = [r for r in rows if r.scenario == A2A_PEAK]
    # the peak: 2 ranks + the step; each sends half of 1 MiB (bf16, an even split) to the other rank
    assert len(peak) == world + 1 and {r.bytes_sent for r in peak} == {2**20 // 2}
    ep_phases = (*PHASES, *STEPS)
    for mode, tokens, chunks in (("normal", 16, (1, 2)), ("low_latency", 3, (1,))):
        sel = [r for r in rows if r.ep_mode == mode and r.scenario != A2A_PEAK]
        # 2 scenarios x 2 placements x the overlap chunks x (2 ranks x (4 phases + 6 steps) + the step
        # and the plain step); no CUDA graph on CPU
        assert len(sel) == 2 * 2 * len(chunks) * (world * len(ep_phases) + 2), mode
        assert {r.tokens_per_rank for r in sel} == {tokens}
        assert {r.capacity for r in sel} == ({None} if mode == "normal" else {3})
        assert {r.overlap_chunks for r in sel} == set(chunks)
        assert all(r.status == "ok" and r.n_rep == 3 and r.median_ms >= 0 for r in sel)
        for (scenario, placement, n) in {(r.scenario, r.placement, r.overlap_chunks) for r in sel}:
            group = [r for r in sel if r.scenario == scenario and r.placement == placement
                     and r.overlap_chunks == n]
            step = next(r for r in group if r.rank == STEP and r.phase == "step")
            # step_i >= every rank's experts_i in every iteration, so the medians keep that order
            assert all(step.median_ms >= r.median_ms for r in group if r.phase == "experts")
            for k in range(world):
                mine = {r.phase: r for r in group if r.rank == k}
                # dispatch is the sum of its steps in every iteration: its median is at least theirs
                assert mine["dispatch"].median_ms >= mine["rows"].median_ms
                # every step the mode has was marked by its probe (a missing mark reads 0 ms)
                for step_name in STEPS:
                    timed = mine[step_name].median_ms > 0
                    assert timed == (mode == "normal" or step_name != "counts"), (mode, step_name)
            pairs = [next(r for r in group if r.rank == k and r.phase == "experts").pairs_recv
                     for k in range(2)]
            assert sum(pairs) == 2 * tokens * 2  # N * T * K: every pair runs exactly once
            plain = next(r for r in group if r.rank == STEP and r.phase == PLAIN)
            assert plain.median_ms > 0 and plain.n_rep == 3     # the whole call, timed without syncs
            if (scenario, placement) == ("collapse", "contiguous"):
                assert pairs[1] == 0 and step.rank_busiest_over_mean == 2.0
            if (scenario, placement) == ("collapse", "replicated"):
                assert step.replicas > 0 and step.rank_busiest_over_mean < 2.0
    assert {r.dist_backend for r in rows} == {"gloo"} and {r.world_size for r in rows} == {2}


def test_gloo_ep_bench_overlap_chunks(gloo_world, tmp_path):
    """--overlap-chunks 1,2: each value its own normal-mode case (the same traffic), a step_plain row
    beside every case's step, both in the CSV and the report, which `moekit report` redraws."""
    world, results, out_dir = gloo_world
    if world != 2:
        pytest.skip("the bench smoke run uses the world of 2")
    bench = out_dir / "bench"
    assert "overlap_chunks" in (bench / CSV_NAME).read_text().splitlines()[0].split(",")
    rows = [r for r in read_csv(bench / CSV_NAME) if r.ep_mode == "normal" and r.scenario != A2A_PEAK]
    loads: dict[tuple, set] = {}
    for r in (r for r in rows if r.phase == "experts"):
        key = (r.scenario, r.placement, r.rank)
        loads.setdefault(key, set()).add((r.rows_sent, r.rows_recv, r.pairs_recv))
    assert loads and all(len(v) == 1 for v in loads.values())     # chunking changes no row that travels
    plain = {(r.scenario, r.placement, r.overlap_chunks) for r in rows if r.rank == STEP and r.phase == PLAIN}
    assert plain == {(s, p, n) for s in ("balanced", "collapse") for p in ("contiguous", "replicated")
                     for n in (1, 2)}
    report = (bench / REPORT_NAME).read_text()
    assert "| placement | scenario | chunks |" in report and "| plain step ms |" in report
    assert "| contiguous | balanced | 1 |" in report and "| replicated | collapse | 2 |" in report
    assert "| eager plain µs |" in report
    copy_dir = tmp_path / "bench"
    shutil.copytree(bench, copy_dir)
    (copy_dir / REPORT_NAME).unlink()
    assert moekit.cli.main(["report", str(copy_dir)]) == 0
    assert (copy_dir / REPORT_NAME).read_text() == report


def test_ep_bench_simulated_and_redraw(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    ep_bench.add_arguments(parser)
    args = parser.parse_args(["--simulate", "3", "--preset", "tiny", "--tokens", "8", "--scenarios",
                              "balanced,hot", "--warmup", "0", "--iters", "2", "--out", str(tmp_path)])
    assert ep_bench.run(args) == 0
    rows = read_csv(tmp_path / CSV_NAME)
    assert len(rows) == 2 * (3 * 3 + 1)  # 2 scenarios x (3 ranks x 3 phases + the step)
    assert {r.mode for r in rows} == {"simulated"} and all(r.status == "ok" for r in rows)
    (tmp_path / REPORT_NAME).unlink()
    redraw = parser.parse_args(["--redraw", str(tmp_path / CSV_NAME)])
    assert ep_bench.run(redraw) == 0
    assert "| contiguous | hot |" in (tmp_path / REPORT_NAME).read_text()
    # --overlap-chunks times communication: a simulated run (none timed) refuses values but 1
    assert ep_bench.run(parser.parse_args(["--simulate", "2", "--preset", "tiny", "--overlap-chunks", "1,2",
                                           "--out", str(tmp_path / "chunks")])) == 2
    assert "--overlap-chunks needs a process group" in capsys.readouterr().out
    bad = tmp_path / "bad.csv"
    bad.write_text("run_id,date\n1,2\n")
    assert ep_bench.run(parser.parse_args(["--redraw", str(bad)])) == 2
    assert "missing columns" in capsys.readouterr().out


def test_ep_bench_needs_a_group(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    parser = argparse.ArgumentParser()
    ep_bench.add_arguments(parser)
    assert ep_bench.run(parser.parse_args([])) == 2
    assert "torchrun" in capsys.readouterr().out


@pytest.mark.gpu
def test_nccl_world_of_one(tmp_path):
    """NCCL on one GPU: a world of 1 runs the same all-to-alls (to itself) and equals the layer."""
    results = _spawn_world(1, tmp_path, "nccl")
    assert results[0]["_env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    for case in _gpu_cases(1):
        expected, expected_ids = _expected(case)
        torch.testing.assert_close(results[0][case.name]["out"], expected)
        assert torch.equal(results[0][case.name]["out"], results[0][case.name]["again"])
        if expected_ids is not None:
            assert torch.equal(results[0][case.name]["ids"], expected_ids)
        if case.name in OVERLAP_CASES:   # chunked on the comm stream: the same bits
            for name, n in itertools.product(("exact", "overlap"), OVERLAP_CHUNKS):
                assert torch.equal(results[0][case.name][f"{name}{n}"], results[0][case.name][f"{name}1"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_simulated_group_on_gpu(dtype):
    """8 virtual ranks on the GPU with the triton backend, Qwen3-30B-A3B's shape, skewed routing."""
    shape = moekit.PRESETS["qwen3-30b-a3b"]
    layer = moekit.MoELayer(shape, dtype=dtype, device="cuda")
    tokens = (64, 0, 31, 200, 1, 64, 64, 7)
    total = sum(tokens)
    x = torch.randn(total, shape.hidden_size, device="cuda").to(dtype)
    placement = contiguous_placement(shape.num_experts, 8)
    for routing in ("zipf-1.5", "collapse"):
        weights, ids = make_scenario(routing, total, shape.num_experts, shape.top_k, seed=SEED, device="cuda")
        with torch.no_grad():
            outs = simulate_ep(_split(x, tokens), _split(weights, tokens), _split(ids, tokens),
                               shard_experts(layer.gate_up_proj, layer.down_proj, placement), placement,
                               backend="triton")
            out = torch.cat(outs)
            args = (x, layer.gate_up_proj, layer.down_proj, weights, ids)
            ref = moe_experts_ref(*args)
            bound = 1e-5 if dtype == torch.float32 else same_dtype_bound(*args, ref)
            assert rel_err(out, ref) <= bound, (routing, rel_err(out, ref), bound)
