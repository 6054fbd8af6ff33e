"""Expert parallelism simulated on one device: N virtual ranks in one process.

    simulate_ep    the same plan / pack / experts / reduce steps as `moekit.parallel.dispatch` and
                   `combine`, every all-to-all replaced by slicing and concatenating the virtual
                   ranks' buffers (a loopback). It checks the EP data path without a process group
                   and times each virtual rank's phases (`moekit ep-bench --simulate N`). No
                   communication is timed: the loopback copies stand in for it.
    rank_problem   one rank's share of a layer cut out (its tokens, local ids, weights), to time
                   each rank's experts alone on one GPU (`moekit imbalance`, the article's
                   simulation of 8 GPUs)
    StepTime       a simulated step: each rank's time run alone; the step waits for the slowest
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import torch

from moekit.bench.timing import sync
from moekit.parallel.dispatch import (
    DispatchedTokens,
    check_routing,
    pack,
    plan_routes,
    reduce_partials,
    run_local_experts,
    unpack_meta,
)
from moekit.placement import Assignment, Placement, rank_weights

Result = TypeVar("Result")

PHASES = ("dispatch", "experts", "combine")


@dataclass
class SimulatedTimes:
    """Milliseconds of each virtual rank's phases, filled by `simulate_ep` when given one.

    ms[phase][r]: "dispatch" = plan + pack of source rank r; "experts" = rank r's experts on the
    rows it received; "combine" = the per-token reduce on rank r. The loopback copies that stand in
    for the all-to-alls are not timed.
    """

    ms: dict[str, list[float]] = field(default_factory=dict)


class _Clock:
    """Times calls with the device synchronised around each; a no-op when there is no sink."""

    def __init__(self, device: torch.device, times: SimulatedTimes | None):
        self.device = device
        self.times = times
        if times is not None:
            times.ms = {p: [] for p in PHASES}

    def __call__(self, phase: str, fn: Callable[[], Result]) -> Result:
        if self.times is None:
            return fn()
        sync(self.device)
        t0 = time.perf_counter()
        out = fn()
        sync(self.device)
        self.times.ms[phase].append((time.perf_counter() - t0) * 1e3)
        return out


def shard_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  placement: Placement) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's (gate_up (E_r, 2I, H), down (E_r, H, I)) from all E experts' weights (copies)."""
    return [rank_weights(gate_up_proj, down_proj, placement, r) for r in range(placement.num_ranks)]


def _check(xs, topk_weights, topk_ids, shards, placement: Placement) -> None:
    n = placement.num_ranks
    if not len(xs) == len(topk_weights) == len(topk_ids) == len(shards) == n:
        raise ValueError(f"simulate_ep needs {n} entries per list (placement.num_ranks), got "
                         f"{len(xs)}, {len(topk_weights)}, {len(topk_ids)}, {len(shards)}")
    for r, (gate_up, _) in enumerate(shards):
        if gate_up.shape[0] != len(placement.slots[r]):
            raise ValueError(f"shards[{r}] holds {gate_up.shape[0]} experts, the placement gives "
                             f"rank {r} {len(placement.slots[r])}")
    for x, w, ids in zip(xs, topk_weights, topk_ids, strict=True):
        check_routing(x, w, ids, placement.num_experts)


def _packed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, placement: Placement, rank: int,
            tables) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    plan = plan_routes(ids, placement, rank, tables)
    counts = plan.send_counts.tolist()
    return counts, pack(x, weights, plan, sum(counts))


def simulate_ep(xs: list[torch.Tensor], topk_weights: list[torch.Tensor], topk_ids: list[torch.Tensor],
                shards: list[tuple[torch.Tensor, torch.Tensor]], placement: Placement, *,
                backend: str = "auto", times: SimulatedTimes | None = None,
                **experts_opts) -> list[torch.Tensor]:
    """Run one expert-parallel layer call for N virtual ranks, one after the other.

    Args:
        xs, topk_weights, topk_ids: per virtual rank, (T_r, H), (T_r, K), (T_r, K) global ids.
        shards: per virtual rank, its experts' (gate_up_proj, down_proj), from `shard_experts`.
        placement: which virtual rank holds which experts, N = placement.num_ranks.
        backend, experts_opts: for `moe_experts` on each rank.
        times: if given, each phase of each virtual rank is timed (device synchronised around it).

    Returns:
        the N outputs (T_r, H), as the N ranks of a real group would return them.
    """
    _check(xs, topk_weights, topk_ids, shards, placement)
    n, top_k = placement.num_ranks, topk_ids[0].shape[1]
    clock = _Clock(xs[0].device, times)
    tables = placement.copy_table(xs[0].device)

    sent = [clock("dispatch", partial(_packed, xs[r], topk_weights[r], topk_ids[r], placement, r, tables))
            for r in range(n)]
    counts = [c for c, _ in sent]  # counts[src][dst]: rows rank src sends to rank dst
    pieces = [(torch.split(bufs[0], c), torch.split(bufs[1], c)) for c, bufs in sent]

    partials = []
    for d in range(n):
        weights, ids = unpack_meta(torch.cat([pieces[s][1][d] for s in range(n)]), top_k)
        tokens = DispatchedTokens(torch.cat([pieces[s][0][d] for s in range(n)]), weights, ids,
                                  [counts[s][d] for s in range(n)])
        gate_up, down = shards[d]
        partials.append(clock("experts", partial(run_local_experts, tokens, gate_up, down,
                                                 backend=backend, **experts_opts)))

    back = [torch.split(partials[d], [counts[s][d] for s in range(n)]) for d in range(n)]
    outs = []
    for s in range(n):
        rows = torch.cat([*(back[d][s] for d in range(n)), partials[0].new_zeros(1, partials[0].shape[1])])
        outs.append(clock("combine", partial(reduce_partials, rows, sent[s][1][2], xs[s].dtype)))
    return outs


@dataclass(frozen=True)
class RankProblem:
    """One rank's share of a layer, compacted: what that rank's experts would receive.

    Attributes:
        token_idx: int64 (T_r,), the global tokens with at least one pair on this rank.
        hidden_states: (T_r, H) those tokens.
        topk_weights: (T_r, K_r) their weights on this rank's pairs, 0 in unused slots.
        topk_ids: int32 (T_r, K_r) local expert index, -1 in unused slots. K_r = the most local
            pairs any token has (<= K), so no token carries columns that are all -1.
        gate_up_proj: (E_r, 2I, H) and down_proj: (E_r, H, I): the rank's experts' weights, copied.
        num_pairs: pairs on this rank.
    """

    token_idx: torch.Tensor
    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    num_pairs: int


def rank_problem(hidden_states: torch.Tensor, topk_weights: torch.Tensor, assignment: Assignment,
                 r: int, weights: tuple[torch.Tensor, torch.Tensor]) -> RankProblem:
    """Cut out rank r's work: its tokens, local ids and weights (reads counts: a host sync).

    `weights` is `rank_weights(...)` for rank r. Running `moe_experts(p.hidden_states,
    p.gate_up_proj, p.down_proj, p.topk_weights, p.topk_ids, ignore_invalid_ids=True)` and adding
    each rank's rows at `p.token_idx` gives the full layer's output.
    """
    mine = assignment.rank == r                                           # (T, K)
    per_token = mine.sum(1)
    token_idx = torch.nonzero(per_token > 0).squeeze(1)
    # At least one column: moe_experts needs K >= 1 even for a rank that got no tokens.
    k_r = max(1, int(per_token.max()) if per_token.numel() else 0)
    sub = mine[token_idx]
    # Move this rank's slots to the front of each row (stable), keep the first K_r columns.
    order = torch.sort((~sub).to(torch.int8), dim=1, stable=True).indices[:, :k_r]
    keep = torch.gather(sub, 1, order)
    ids = torch.gather(assignment.local_ids[token_idx], 1, order)
    w = torch.gather(topk_weights[token_idx], 1, order)
    ids = torch.where(keep, ids, -1).to(torch.int32)
    w = torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device))
    return RankProblem(token_idx, hidden_states[token_idx], w, ids, weights[0], weights[1],
                       int(sub.sum()))


@dataclass(frozen=True)
class StepTime:
    """A simulated EP step: each rank's time, run alone; the step waits for the slowest rank."""

    per_rank_ms: tuple[float, ...]

    @property
    def step_ms(self) -> float:
        return max(self.per_rank_ms)

    @property
    def mean_ms(self) -> float:
        return sum(self.per_rank_ms) / len(self.per_rank_ms)

    @property
    def slowest_over_mean(self) -> float:
        return self.step_ms / self.mean_ms if self.mean_ms > 0 else 1.0

    @property
    def slowest_rank(self) -> int:
        return self.per_rank_ms.index(self.step_ms)
