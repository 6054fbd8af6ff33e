"""The expert-parallel MoE layer: each rank routes its own tokens, holds E_r of the E experts, and
exchanges token rows with the other ranks, in one of two modes:

    normal       route (local) -> dispatch (counts, then rows; one host sync) -> moe_experts on the
                 local experts -> combine -> (T, H)                        (`moekit.parallel.dispatch`);
                 with overlap_chunks=n > 1 in n token ranges, one chunk's all-to-alls on a side
                 stream while another's experts run; the same bits with the triton backend, within
                 fp32 rounding with the BLAS-backed ones         (`moekit.parallel.overlap`)
    low_latency  route -> fixed blocks of `capacity` rows to every rank (no host sync) -> masked
                 (E_r, C_e, H) experts -> combine -> (T, H); `ExpertParallelMoE.capture` records the
                 whole layer in CUDA graphs                           (`moekit.parallel.low_latency`)

Both split a replicated expert's pairs among its copies as `moekit.placement.assign` does (pass a
placement from `replicate_hot_experts`). The output on every rank equals the single-device
`MoELayer` on that rank's tokens (up to fp32 summation order: each token's partial sums from
different ranks are added in rank order); in the low-latency mode, pairs past a capacity are dropped
and counted (or refused), never silently. Forward only: the all-to-alls carry no autograd, so the
layer refuses to run with gradients on.

A bad input on one rank never leaves the others waiting in a collective: in the normal mode every
rank raises after the count exchange, which also catches ranks that disagree on the hidden size,
dtype, top_k or placement (`moekit.parallel.dispatch`); in the low-latency mode the failing rank
stands in and raises (`moekit.parallel.low_latency`, which lists what still must fail alike).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import skip_init

from moekit._validation import (
    FLOAT_DTYPES,
    check_capacity_factor,
    check_layer_input,
    check_replay_input,
    check_tensor,
)
from moekit.eager_graphs import CapturedWeights
from moekit.experts import ExpertsOptions, check_backend_name, get_backend, moe_experts
from moekit.graphs import capture_graph
from moekit.layer import WEIGHT_NAMES, MoELayer
from moekit.parallel.dispatch import (
    caught,
    check_forward_only,
    check_group,
    check_hidden_states,
    check_top_k_width,
    check_weights,
    combine,
    disagreements,
    dispatch,
    fail_in_exchange,
    first_error,
    group_device,
    raise_rank_error,
    run_local_experts,
)
from moekit.parallel.low_latency import OVERFLOW_POLICIES, check_capacity, low_latency_moe, stand_in
from moekit.parallel.overlap import check_overlap_chunks, overlapped_moe
from moekit.placement import Placement, contiguous_placement, rank_weights
from moekit.routing import route
from moekit.shapes import MoEShape, get_shape

MODES = ("normal", "low_latency")
LOW_LATENCY_BACKENDS = ("auto", "masked")   # the low-latency mode runs the masked kernels


def check_mode(mode: str, capacity: int | None, expert_capacity: int | None, overflow: str,
               backend: str) -> None:
    """The mode's arguments, before any collective (every rank fails alike)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "normal":
        if capacity is not None or expert_capacity is not None or overflow != "drop":
            raise ValueError("capacity, expert_capacity and overflow apply to mode='low_latency' (the "
                             "normal mode sizes its buffers from the exchanged counts and drops nothing)")
        check_backend_name(backend)
        return
    if capacity is None:
        raise ValueError("mode='low_latency' needs capacity= (token rows each rank sends each rank, "
                         "e.g. the most tokens a rank holds in one call)")
    check_capacity("capacity", capacity)
    if expert_capacity is not None:
        check_capacity("expert_capacity", expert_capacity)
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if backend not in LOW_LATENCY_BACKENDS:
        raise ValueError(f"mode='low_latency' runs the masked kernels: backend must be one of "
                         f"{LOW_LATENCY_BACKENDS}, got {backend!r}")


# The normal mode's expert options: `moe_experts`'s keywords but the ones the mode sets itself.
NORMAL_OPTIONS = tuple(name for name, p in inspect.signature(moe_experts).parameters.items()
                       if p.kind is p.KEYWORD_ONLY and name not in ("backend", "ignore_invalid_ids", "out"))


def check_experts_opts(backend: str, experts_opts: dict) -> None:
    """The normal mode's expert options, checked as `moe_experts` checks them, before any collective:
    a rank that receives no rows never calls it, and one that raised alone mid-exchange would leave
    the others waiting."""
    unknown = sorted(set(experts_opts) - set(NORMAL_OPTIONS))
    if unknown:
        raise TypeError(f"unknown expert option(s) {', '.join(unknown)} for mode='normal'; it takes "
                        f"{', '.join(NORMAL_OPTIONS)}")
    options = ExpertsOptions(config=experts_opts.get("config"), stats=experts_opts.get("stats"),
                             capacity_factor=check_capacity_factor(experts_opts.get("capacity_factor")))
    if backend != "auto":
        get_backend(backend).check_options(options)


def ep_moe_experts(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, placement: Placement,
                   group: dist.ProcessGroup | None = None, backend: str = "auto",
                   ignore_invalid_ids: bool = False,
                   tables: tuple[torch.Tensor, torch.Tensor] | None = None, mode: str = "normal",
                   capacity: int | None = None, expert_capacity: int | None = None,
                   overflow: str = "drop", overlap_chunks: int = 1, top_k: int | None = None,
                   **experts_opts) -> torch.Tensor:
    """`moekit.moe_experts` over an expert-parallel group (collective: every rank calls it).

    Args:
        hidden_states: (T, H) this rank's tokens; T may differ between ranks, and be 0.
        gate_up_proj: (E_r, 2I, H) this rank's experts, in `placement.slots[rank]` order.
        down_proj: (E_r, H, I).
        topk_weights: (T, K) routing weights.
        topk_ids: (T, K) global expert ids in [0, E).
        placement: which rank holds which of the E experts (`moekit.placement`).
        group: the process group (default: the world).
        backend: experts backend on each rank ("auto" or one of `moekit.BACKENDS`).
        ignore_invalid_ids: pairs with ids outside [0, E) contribute 0 instead of raising.
        tables: `placement.copy_table(device)`, to reuse across calls.
        mode: "normal" (counts exchanged, one host sync, nothing dropped) or "low_latency" (fixed
            blocks, no host sync, CUDA-graph capturable; `moekit.parallel.low_latency`).
        capacity: low_latency: C, token rows each rank sends each rank (the same on every rank).
        expert_capacity: low_latency: C_e, rows per local expert (default N * C).
        overflow: low_latency: "drop" (pairs past a capacity contribute 0, counted in stats) or
            "raise" (every rank raises `CapacityOverflow` if any pair was dropped; one sync).
        overlap_chunks: normal: n > 1 runs the layer in n token ranges, each chunk's all-to-alls
            overlapping another chunk's experts on CUDA (`moekit.parallel.overlap`); the bits of 1
            (the default: one dispatch, experts, combine) with the triton backend, within fp32
            rounding of them with the others (their BLAS sums in an order set by the row count).
        top_k: the K every rank routes with, if known (`ExpertParallelMoE` passes its shape's): a
            topk_ids of another width is then this rank's input error, and a low-latency rank
            standing in sizes its blocks by it.
        experts_opts: normal: passed on to `moe_experts` (e.g. config for triton); low_latency:
            config (the masked kernels' tiles) and stats (a dict filled with the drop counters).

    Returns:
        (T, H) in the dtype of hidden_states: sum_k w[t,k] * expert_{ids[t,k]}(x_t).

    Errors: arguments the same on every rank of SPMD code (placement's rank count, mode, capacities,
    overflow, overlap_chunks, expert options) raise at once. An error in this call's tensors on one
    rank (hidden_states, topk_weights, topk_ids, this rank's weights: shapes, dtypes, devices, grad
    flags; ids outside [0, E) on CPU) never leaves the other ranks waiting: in the normal mode every
    rank raises after the count exchange, which also raises on every rank when the ranks disagree on
    the hidden size, dtype, top_k or placement (`moekit.parallel.dispatch`); in the low-latency mode
    the failing rank stands in and raises, the others return (or all raise, with overflow="raise";
    `moekit.parallel.low_latency`).
    """
    check_mode(mode, capacity, expert_capacity, overflow, backend)
    check_overlap_chunks(overlap_chunks, mode)
    if mode == "normal":
        check_experts_opts(backend, experts_opts)
    rank, _ = check_group(placement, group)
    if mode == "low_latency":
        return low_latency_moe(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                               placement=placement, capacity=capacity, expert_capacity=expert_capacity,
                               overflow=overflow, group=group, ignore_invalid_ids=ignore_invalid_ids,
                               tables=tables, top_k=top_k, **experts_opts)
    # Checked here, not only in moe_experts: a rank that receives no rows never calls it, and a
    # rank that fails alone mid-exchange leaves the others waiting for the collective's timeout.
    num_local = len(placement.slots[rank])
    error = first_error(lambda: check_weights(gate_up_proj, down_proj, num_local, group),
                        lambda: check_hidden_states(hidden_states, gate_up_proj),
                        lambda: check_forward_only(gate_up_proj, down_proj),
                        lambda: check_top_k_width(topk_ids, top_k))
    if error is not None:
        fail_in_exchange(error, group, group_device(group, gate_up_proj, hidden_states), overlap_chunks)
    if overlap_chunks > 1:
        return overlapped_moe(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                              placement=placement, chunks=overlap_chunks, group=group, backend=backend,
                              ignore_invalid_ids=ignore_invalid_ids, tables=tables, **experts_opts)
    tokens, handle = dispatch(hidden_states, topk_weights, topk_ids, placement, group=group,
                              ignore_invalid_ids=ignore_invalid_ids, tables=tables)
    partial = run_local_experts(tokens, gate_up_proj, down_proj, backend=backend, **experts_opts)
    return combine(partial, handle, group=group)


class ExpertParallelMoE(nn.Module):
    """An MoE layer whose experts are spread over a process group (expert parallelism).

    Args:
        shape: an `MoEShape` or a preset name.
        placement: which experts each rank holds (a `moekit.placement.Placement`, e.g. with
            replicas from `replicate_hot_experts`); default `contiguous_placement(E, N)`.
        group: the process group (default: the world); must be initialised.
        backend: experts backend on each rank; router_backend: "auto", "torch" or "triton".
        dtype, device: of the parameters.
        mode: "normal" or "low_latency" (see the module docstring); capacity, expert_capacity,
            overflow: the low-latency mode's (`ep_moe_experts`).
        overlap_chunks: the normal mode's: n > 1 overlaps the all-to-alls of one of n token ranges
            with the experts of another (`moekit.parallel.overlap`; the same bits as 1, the default,
            with the triton backend; within fp32 rounding of them with the BLAS-backed ones).

    Parameters:
        router_weight (E, H), the same on every rank; gate_up_proj (E_r, 2I, H) and down_proj
        (E_r, H, I), this rank's experts in `placement.slots[rank]` order.
    """

    def __init__(self, shape: MoEShape | str, *, placement: Placement | None = None,
                 group: dist.ProcessGroup | None = None, backend: str = "auto",
                 router_backend: str = "auto", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, mode: str = "normal",
                 capacity: int | None = None, expert_capacity: int | None = None, overflow: str = "drop",
                 overlap_chunks: int = 1):
        super().__init__()
        check_mode(mode, capacity, expert_capacity, overflow, backend)
        check_overlap_chunks(overlap_chunks, mode)
        self.mode, self.capacity, self.overlap_chunks = mode, capacity, overlap_chunks
        self.expert_capacity, self.overflow = expert_capacity, overflow
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs torch.distributed initialised "
                               "(init_process_group, e.g. under torchrun)")
        self.shape = get_shape(shape)
        self.group = group
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        e, h, i = self.shape.num_experts, self.shape.hidden_size, self.shape.intermediate_size
        self.placement = placement if placement is not None else contiguous_placement(e, world)
        if self.placement.num_ranks != world or self.placement.num_experts != e:
            raise ValueError(f"placement is for {self.placement.num_experts} experts on "
                             f"{self.placement.num_ranks} ranks; the layer has {e} experts and the "
                             f"group {world} ranks")
        self.local_experts = self.placement.slots[self.rank]
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._agreed = False
        self.backend = backend
        self.router_backend = router_backend
        kw = dict(dtype=dtype, device=device)
        n = len(self.local_experts)
        self.router_weight = nn.Parameter(torch.empty(e, h, **kw))
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, h, **kw))
        self.down_proj = nn.Parameter(torch.empty(n, h, i, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """This rank's share of the weights `MoELayer.reset_parameters(generator)` draws: with the
        same seed on every rank, the group holds exactly the single-device layer's weights."""
        if self.router_weight.is_meta:
            return  # skip_init (from_layer): the weights are about to be copied in
        s = self.shape
        h, i = s.hidden_size, s.intermediate_size
        held = torch.tensor(self.local_experts, dtype=torch.int64)
        # The full tensors are drawn, in MoELayer's order, so that the numbers match it exactly.
        router = torch.randn(self.router_weight.shape, generator=generator) / math.sqrt(h)
        gate_up = torch.randn((s.num_experts, 2 * i, h), generator=generator) / math.sqrt(h)
        down = torch.randn((s.num_experts, h, i), generator=generator) / math.sqrt(i)
        self.router_weight.copy_(router)
        self.gate_up_proj.copy_(gate_up[held])
        self.down_proj.copy_(down[held])

    @classmethod
    @torch.no_grad()
    def from_layer(cls, layer: MoELayer, *, placement: Placement | None = None,
                   group: dist.ProcessGroup | None = None, backend: str | None = None,
                   **mode_opts) -> ExpertParallelMoE:
        """This rank's share of a full `MoELayer` (its router and its experts' weights, copied).
        mode_opts: mode, capacity, expert_capacity, overflow, overlap_chunks (the constructor's)."""
        p = layer.gate_up_proj
        if backend is None:
            backend = "auto" if mode_opts.get("mode") == "low_latency" else layer.backend
        ep = skip_init(cls, layer.shape, placement=placement, group=group, backend=backend,
                       router_backend=layer.router_backend, dtype=p.dtype, device=p.device, **mode_opts)
        gate_up, down = rank_weights(layer.gate_up_proj, layer.down_proj, ep.placement, ep.rank)
        ep.router_weight.copy_(layer.router_weight)
        ep.gate_up_proj.copy_(gate_up)
        ep.down_proj.copy_(down)
        return ep

    def extra_repr(self) -> str:
        s = self.shape
        return (f"experts={s.num_experts}, local={list(self.local_experts)}, rank={self.rank}, "
                f"hidden={s.hidden_size}, intermediate={s.intermediate_size}, top_k={s.top_k}, "
                f"backend={self.backend!r}, mode={self.mode!r}"
                + (f", capacity={self.capacity}" if self.mode == "low_latency" else "")
                + (f", overlap_chunks={self.overlap_chunks}" if self.overlap_chunks > 1 else ""))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.router_weight, self.shape.top_k, renormalize=self.shape.norm_topk_prob,
                     backend=self.router_backend)

    def agree(self) -> None:
        """Check once, on the first call, that every rank built the same layer (collective: one
        all_gather of a few ints, never again). Ranks that disagree on the shape, dtype, mode,
        capacities, overlap_chunks or placement would exchange rows of other sizes or layouts: garbage
        or a crash inside the collective library. Each call's x is then checked against this rank's
        own configuration, locally. Raises the same ValueError on every rank, naming the fields."""
        if self._agreed:
            return
        s, p = self.shape, self.gate_up_proj
        fields = {
            "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_experts": s.num_experts, "top_k": s.top_k, "norm_topk_prob": int(s.norm_topk_prob),
            "dtype": FLOAT_DTYPES.index(p.dtype) if p.dtype in FLOAT_DTYPES else -1,
            "mode": MODES.index(self.mode), "capacity": self.capacity or 0,
            "expert_capacity": self.expert_capacity or 0, "overflow": OVERFLOW_POLICIES.index(self.overflow),
            "overlap_chunks": self.overlap_chunks,
            "placement": self.placement.digest,
        }
        mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=p.device)
        world = dist.get_world_size(self.group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.group)
        table = torch.stack(gathered).tolist()
        names = {"dtype": lambda v: str(FLOAT_DTYPES[v]) if v >= 0 else "?", "mode": lambda v: MODES[v],
                 "overflow": lambda v: OVERFLOW_POLICIES[v]}
        differ = disagreements({name: [names.get(name, lambda v: v)(row[j]) for row in table]
                                for j, name in enumerate(fields)})
        if differ:
            raise ValueError("ExpertParallelMoE: the ranks of the group built different layers; every rank "
                             "must pass the same shape, dtype, mode, capacity, expert_capacity, overflow, "
                             "overlap_chunks and placement. They differ in: " + "; ".join(differ))
        self._agreed = True

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                **experts_opts) -> torch.Tensor:
        """The expert path for given routing: (T, H) -> (T, H) (collective). An input error on one
        rank fails as `ep_moe_experts` says (topk_ids must have the layer's top_k)."""
        self.agree()
        return ep_moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                              placement=self.placement, group=self.group, backend=self.backend,
                              tables=self.tables(), mode=self.mode, capacity=self.capacity,
                              expert_capacity=self.expert_capacity, overflow=self.overflow,
                              overlap_chunks=self.overlap_chunks, top_k=self.shape.top_k, **experts_opts)

    def _check_x(self, x: object, num_valid_tokens: object = None, padded: bool = False) -> None:
        """What the router takes: x (..., H) (padded: (T, H) with a 0-d int32 num_valid_tokens) in the
        parameters' dtype, on their device. Reads attributes only: no host sync."""
        check_layer_input(x, self.shape.hidden_size)
        p = self.router_weight
        check_tensor("x", x, ndim=2 if padded else None, dtypes=(p.dtype,), device=p.device)
        if padded:
            check_tensor("num_valid_tokens", num_valid_tokens, ndim=0, dtypes=(torch.int32,), device=p.device)

    def _fail_together(self, error: Exception, config: object = None) -> NoReturn:
        """This rank's part in a call whose x failed its checks, then raises `error`: every rank takes
        part in the call's collectives, so none waits for the group's timeout. The normal mode reports
        it in the count exchange (every rank raises); the low-latency mode stands in (`stand_in`:
        the call with no tokens of this rank's, its experts serving the others'). config: the
        experts' tiles the other ranks run with."""
        self.agree()
        weights = (self.gate_up_proj, self.down_proj)
        if self.mode == "normal":
            fail_in_exchange(error, self.group, group_device(self.group, *weights), self.overlap_chunks)
        num_local = len(self.local_experts)
        usable = caught(lambda: check_weights(*weights, num_local, self.group)) is None
        shape = (self.shape.hidden_size, self.gate_up_proj.dtype, self.shape.top_k)
        stand_in(error, shape, weights=weights if usable else None,
                 placement=self.placement, capacity=self.capacity, expert_capacity=self.expert_capacity,
                 overflow=self.overflow, group=self.group, config=config)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`placement.copy_table` on the parameters' device, built once."""
        dev = self.gate_up_proj.device
        if dev not in self._tables:
            self._tables[dev] = self.placement.copy_table(dev)
        return self._tables[dev]

    def forward(self, x: torch.Tensor, **experts_opts) -> torch.Tensor:
        """x (..., H) -> (..., H), routed on this rank (collective: every rank calls it). An x of the
        wrong shape, dtype or device on one rank leaves no rank waiting: in the normal mode every rank
        raises, in the low-latency mode that rank stands in and raises (see the module docstring)."""
        error = caught(lambda: self._check_x(x))
        if error is not None:
            self._fail_together(error, experts_opts.get("config"))
        flat = x.reshape(-1, self.shape.hidden_size)
        weights, ids = self.route(flat)
        return self.experts(flat, weights, ids, **experts_opts).view(x.shape)

    def forward_padded(self, x: torch.Tensor, num_valid_tokens: torch.Tensor,
                       stats: dict | None = None, **experts_opts) -> torch.Tensor:
        """Low-latency mode on a padded batch, the body `capture` records: x (T, H), of which rows
        >= num_valid_tokens (int32 device scalar) are padding; the router gives them id -1,
        so they are never sent. Returns (T, H); padding rows are 0. Collective."""
        if self.mode != "low_latency":
            raise ValueError("forward_padded and capture need mode='low_latency'")
        error = caught(lambda: self._check_x(x, num_valid_tokens, padded=True))
        if error is not None:
            self._fail_together(error, experts_opts.get("config"))
        self.agree()
        weights, ids = route(x, self.router_weight, self.shape.top_k, renormalize=self.shape.norm_topk_prob,
                             backend=self.router_backend, num_valid_tokens=num_valid_tokens)
        return ep_moe_experts(x, self.gate_up_proj, self.down_proj, weights, ids, placement=self.placement,
                              group=self.group, backend=self.backend, ignore_invalid_ids=True,
                              tables=self.tables(), mode="low_latency", capacity=self.capacity,
                              expert_capacity=self.expert_capacity, overflow=self.overflow, stats=stats,
                              **experts_opts)

    def capture(self, max_tokens: int, buckets: Sequence[int] | None = None) -> CapturedEP:
        """Record the whole layer (router, dispatch, experts, combine) in CUDA graphs for any
        T <= max_tokens (collective: every rank, with the same max_tokens and buckets; see
        `CapturedEP` for when more than the one default bucket is safe)."""
        return CapturedEP(self, max_tokens, buckets)


class CapturedEP:
    """Callable replaying a low-latency `ExpertParallelMoE` captured in CUDA graphs.

    Every rank must build it with the same buckets (the captures run the all-to-alls) and call it
    once per step. By default there is one bucket, max_tokens: the all-to-alls' sizes follow from
    the capacity, not from T, so ranks may serve different T in a step, T = 0 included, and they
    all replay the same graph. With several buckets (e.g. `default_buckets(max_tokens)`, which
    saves the router and packing work of the unused rows) each call replays the smallest bucket
    that holds its T, and then every rank must serve the same bucket in a step: graphs replayed on
    different ranks must hold the same NCCL operations in the same order, or the ranks wait on
    each other forever (a hang, not an error: NCCL's watchdog does not see replayed collectives).
    The returned tensor is a view into a static buffer, overwritten by the next call: clone it to
    keep it. `stats` is the last replay's counters (static device tensors, rewritten each replay).
    A replay is forward-only: call it under torch.no_grad() or torch.inference_mode(). The weights
    are read in place: copy_ new values into them; replacing one (a new Parameter, `.data` swapped)
    makes the next call raise, on that rank alone. An x that fails the replay's checks on one rank
    (shape, dtype, device, too many tokens, grad) is not a hang: that rank replays with no tokens
    and raises; the others' outputs are what they would be had it had no tokens.

    Call `close()` (or use it as a context manager) before `dist.destroy_process_group()`: NCCL
    keeps a communicator alive while a CUDA graph holding its operations exists, so destroying the
    group with a live capture hangs.
    """

    def __init__(self, ep: ExpertParallelMoE, max_tokens: int, buckets: Sequence[int] | None = None):
        p = ep.gate_up_proj
        if not p.is_cuda:
            raise ValueError("ExpertParallelMoE.capture needs the layer on a CUDA device")
        if ep.mode != "low_latency" or ep.overflow != "drop":
            raise ValueError("ExpertParallelMoE.capture needs mode='low_latency' and overflow='drop' "
                             "(the normal mode and overflow='raise' sync the host)")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.ep, self.max_tokens = ep, max_tokens
        self.weights = CapturedWeights("ExpertParallelMoE", ep, WEIGHT_NAMES)
        self.buckets = sorted(set(buckets or (max_tokens,)))
        if self.buckets[-1] != max_tokens or self.buckets[0] < 1:
            raise ValueError(f"buckets must lie in [1, max_tokens] and include max_tokens, got {buckets}")
        self.x = torch.zeros(max_tokens, ep.shape.hidden_size, dtype=p.dtype, device=p.device)
        self.out = torch.zeros_like(self.x)
        self.num_valid = torch.full((), max_tokens, dtype=torch.int32, device=p.device)
        self.bucket_stats: dict[int, dict] = {}
        self.stats: dict = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        ep.agree()   # its collective and host read before capturing, never inside a graph
        pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for b in reversed(self.buckets):   # the largest first: the others reuse its pool memory
                self.graphs[b], _ = capture_graph(functools.partial(self._body, b), p.device, pool=pool)

    def _body(self, bucket: int) -> None:
        stats: dict = {}
        self.out[:bucket].copy_(self.ep.forward_padded(self.x[:bucket], self.num_valid, stats=stats))
        self.bucket_stats[bucket] = stats       # the capture's call is the last: its tensors replay

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) with 0 <= T <= max_tokens -> (T, H) view of the static output (collective).
        Forward-only: a call that autograd would record (grad mode on, x or the layer's parameters
        requiring grad) raises."""
        if not self.graphs:
            raise RuntimeError("this CapturedEP was closed; capture the layer again")
        self.weights.check()
        error = caught(lambda: check_replay_input(x, self.x, self.max_tokens, self.weights.tensors()))
        if error is not None:
            self._stand_in(x)
            raise_rank_error(error, self.ep.rank)
        num_tokens = x.shape[0]
        self.x[:num_tokens].copy_(x)
        self._replay(num_tokens, num_tokens)
        return self.out[:num_tokens]

    def _stand_in(self, x: object) -> None:
        """This rank's step when its x failed the replay's checks: a replay with no tokens, so that its
        experts still serve the rows the other ranks send and none of them waits for it. The bucket is
        the one x's row count picks (the largest when x has no rows dimension or too many rows)."""
        rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else self.max_tokens
        self._replay(min(rows, self.max_tokens), 0)

    def _replay(self, rows: int, num_valid: int) -> None:
        """Replay the graph of the smallest bucket holding `rows`, its first num_valid rows the tokens."""
        bucket = next(b for b in self.buckets if b >= rows)
        self.num_valid.fill_(num_valid)
        self.graphs[bucket].replay()
        self.stats = self.bucket_stats[bucket]

    def close(self) -> None:
        """Free the graphs (and with them NCCL's hold on the communicator); call before destroying
        the process group. Waits for replays in flight; calling the capture afterwards is an error."""
        if self.graphs:
            torch.cuda.synchronize(self.x.device)
            for graph in self.graphs.values():
                graph.reset()
            self.graphs.clear()

    def __enter__(self) -> CapturedEP:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
