"""Expert parallelism, low-latency mode (DeepEP's): fixed-size buffers, no host sync, graph-capturable.

Every rank sends every rank (itself included) a block of exactly C = `capacity` token rows, used or
not, so the all-to-alls have equal split sizes known before any routing, and the receiver runs its
experts on the masked (E_r, C_e, H) layout (`moekit.masked`) whose per-expert counts stay on the
device. Every buffer's size follows from (T, K, H, N, C, E_r, C_e): nothing is read back to the host,
so the whole layer records into one CUDA graph (decode: T = 1..128 tokens per rank).

Dataflow on one rank of N (T local tokens, K top_k, H hidden, E_r local experts, C_e expert capacity):

    plan     placement.assign (`plan_routes`, as the normal mode): dest (T, K) rank of each pair
             (replicated experts split round-robin among their copies), local (T, K) its expert
             there, hit (T, N) token t has a pair on rank d
    slots    pos[t, d] = tokens before t with a pair on d: t's row in d's block of C rows; a token
             past the C-th is not sent to d (its pairs there are dropped and counted)
    pack     send_x (N * C, H), send_meta (N * C, 2K + 1) int32: [:K] local ids or -1, [K:2K] the
             fp32 routing weights' bits (0.0 where the id is -1), [2K] the source token or -1 (an
             empty slot: zero row, ids -1)
    rows     all_to_all_single, equal splits: x and meta (two collectives)
    layout   masked_layout of the received (N * C, K) ids over E_r experts, C_e rows each (default
             N * C): pairs in (source rank, slot, k) order; an expert's pairs past C_e are dropped
    experts  masked_moe: (E_r, C_e, H) masked GEMMs, then each received row's weighted sum of its
             pairs (slot order, fp32) -> partial (N * C, H)
    back     all_to_all_single of the partials: row j of block d returns to the slot it came from
    reduce   out[t] = sum of t's partial rows in increasing rank order, fp32 (`reduce_partials`);
             a dropped row reads a zero row

Why there is no host sync: the split sizes are N equal blocks (no count exchange, no `.tolist()`),
the counts the experts need (per source, per expert) are computed and consumed on the device, the
masked kernels' grids follow from (E_r, C_e, tiles), and nothing indexes with a boolean mask. The
price: N * C rows travel each way whatever T is, and C_e * E_r rows of expert workspace.

Overflow is never silent. A dropped pair contributes 0 to its token, exactly as if its routing
weight were 0, and is counted in device scalars (the `stats` dict, no sync):

    dropped_rows    (token, destination) rows this rank could not send: the destination's block full
                    (the first C tokens in token order with a pair on d are sent)
    dropped_pairs   this rank's pairs in those rows
    expert_dropped  pairs this rank received but could not place: an expert's C_e rows full (the
                    first C_e in (source rank, slot, k) order are kept). With the default C_e = N * C
                    this happens only when a token repeats an expert in its top-k.
    dropped         dropped_pairs + expert_dropped; summed over the group, every dropped pair once
    recv_counts     (N,) int64 rows received from each source; expert_counts (E_r,) int32 rows in
                    use per local expert; capacity, expert_capacity: the ints in force

overflow="raise" refuses instead: after the combine, one all_reduce of `dropped` and a host read on
every rank; if any pair was dropped anywhere, every rank raises `CapacityOverflow` (the same
message, so no rank is left waiting in a collective). That costs a collective and a sync: not for a
CUDA graph, where the caller reads `stats` when it can afford to.

Input errors on one rank. There is no exchange that the host reads (that is the mode), so a rank
whose inputs fail this call's checks cannot tell the others to raise without a sync; it stands in
instead (`stand_in`, in `low_latency_moe`, `ExpertParallelMoE.forward` / `forward_padded` / `experts`
and a captured replay): it runs the call with no tokens of its own, its experts serving the rows the
other ranks send, and raises its error after the combine. The other ranks return their outputs,
exactly what they would be had that rank had no tokens; no host sync is added, and a captured
replay stands in as a replay with num_valid_tokens = 0. When the bad input is the rank's own expert
weights, its partials come back NaN, so the other ranks' tokens that needed those experts are NaN
rather than silently short a pair. With overflow="raise" the all_reduce above also carries one flag
per rank, and every other rank raises a ValueError naming the failed ranks. With overflow="drop" the
others are not told: if the failing rank then stops calling the layer, they wait in its next
collective.

What still needs every rank to fail alike (raised on one rank, the others wait for the group's
timeout, or the collective library aborts):
    - a direct `low_latency_moe` / `ep_moe_experts` call on a rank that cannot tell the blocks' sizes
      (`geometry`): neither its weights nor its hidden_states usable for H and dtype, or, without
      top_k=, topk_ids and topk_weights without one shared width in [1, E];
    - ranks whose calls are each valid but disagree on H, dtype, top_k, capacity or placement (their
      blocks do not line up; nothing is compared per call: `ExpertParallelMoE` compares them once, at
      its first call, and the layer passes top_k= so a topk_ids of another width is an input error);
    - a captured layer whose weights were replaced (`CapturedEP` raises before replaying);
    - errors between the phases called one by one (`low_latency_dispatch` raises before its exchange;
      `low_latency_experts` and `low_latency_combine` after the dispatch).
Arguments the same on every rank of SPMD code (mode, capacity, expert_capacity, overflow, config)
raise directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from moekit._validation import FLOAT_DTYPES
from moekit.experts import ExpertsOptions, get_backend
from moekit.parallel import fused
from moekit.parallel.dispatch import (
    Probe,
    RoutePlan,
    caught,
    check_forward_only,
    check_group,
    check_hidden_states,
    check_inputs,
    check_weights,
    first_error,
    group_device,
    mark,
    plan_routes,
    raise_rank_error,
    reduce_partials,
    unpack_meta,
)
from moekit.placement import Placement
from moekit.tuning import ExpertsConfig

OVERFLOW_POLICIES = ("drop", "raise")


class CapacityOverflow(RuntimeError):
    """overflow="raise": some token-expert pair did not fit a destination's or an expert's capacity."""


@dataclass(frozen=True)
class LowLatencyTokens:
    """What a rank receives: N blocks of C rows, one per source rank (fixed size, used or not).

    Fields:
        x: (N * C, H) token rows; block s = rows [s * C, (s + 1) * C) from source rank s, its used
            rows first (in the source's token order), zero rows after.
        topk_weights: (N * C, K) float32 routing weights; 0 where the id is -1.
        topk_ids: (N * C, K) int32 local expert ids in [0, E_r), or -1 (pairs held elsewhere,
            empty slots).
        src_token: (N * C,) int32 the row's token index on its source rank, -1 for an empty slot.
        capacity: C.
    """

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    src_token: torch.Tensor
    capacity: int

    @property
    def recv_counts(self) -> torch.Tensor:
        """(N,) int64 rows used in each source's block (on the device, no sync)."""
        return (self.src_token >= 0).view(-1, self.capacity).sum(1)


@dataclass(frozen=True)
class LowLatencyHandle:
    """What `low_latency_combine` needs, and what the send dropped.

    Fields:
        combine_index: (T, D) int64, D = min(K, N): the row of the returned (N * C + 1) buffer
            holding token t's partial from its j-th destination rank (increasing rank); N * C, a
            zero row, after its last one and for a row that was dropped.
        dropped_rows, dropped_pairs: int64 device scalars (see the module docstring).
        capacity: C.
        dtype: of the output (the input's).
    """

    combine_index: torch.Tensor
    dropped_rows: torch.Tensor
    dropped_pairs: torch.Tensor
    capacity: int
    dtype: torch.dtype


def check_capacity(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (rows), got {value!r}")
    return value


def pack_fixed(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan, capacity: int,
               ) -> tuple[torch.Tensor, torch.Tensor, LowLatencyHandle]:
    """Send buffers of one rank, (N * C, H) and (N * C, 2K + 1) int32, and the combine handle.

    Sizes follow from (T, K, H, N, C) only; no host sync. One launch for a fused plan made with this
    capacity (`plan_routes(..., capacity=C)`: it carries pos and the drop counters), else
    `pack_fixed_torch`.
    """
    if plan.pos is not None and plan.drops is not None and plan.capacity == capacity:
        send_x, send_meta, combine_index, dropped = fused.pack_fixed(x, topk_weights, plan, capacity)
        return send_x, send_meta, LowLatencyHandle(combine_index, dropped[0], dropped[1], capacity, x.dtype)
    return pack_fixed_torch(x, topk_weights, plan, capacity)


def pack_fixed_torch(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan, capacity: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, LowLatencyHandle]:
    """`pack_fixed` in torch ops (the fused pack's twin)."""
    num_tokens, top_k = plan.dest.shape
    n, c, dev = plan.hit.shape[1], capacity, x.device
    rows = n * c
    pos = torch.cumsum(plan.hit, 0) - 1                         # (T, N): t's row in d's block
    kept = plan.hit & (pos < c)
    slot = torch.where(kept, torch.arange(n, device=dev) * c + pos, rows)   # rows: nowhere
    token = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    each = torch.arange(num_tokens, device=dev)[:, None].expand(-1, n)   # (T, N): t in every column
    token.scatter_(0, slot.reshape(-1), each.reshape(-1))
    token = token[:rows]
    t_safe = torch.where(token >= 0, token, num_tokens)         # row T of the padded tables: nowhere
    dest = torch.cat([plan.dest, plan.dest.new_full((1, top_k), n)])
    local = torch.cat([plan.local, plan.local.new_full((1, top_k), -1)])
    weights = torch.cat([topk_weights.float(), topk_weights.new_zeros(1, top_k, dtype=torch.float32)])
    same = dest[t_safe] == (torch.arange(rows, device=dev) // c)[:, None]   # (N * C, K) pairs on d
    send_ids = torch.where(same, local[t_safe], -1).to(torch.int32)
    send_w = torch.where(same, weights[t_safe], 0.0)
    send_meta = torch.cat([send_ids, send_w.view(torch.int32), token.to(torch.int32)[:, None]], dim=1)
    send_x = torch.cat([x, x.new_zeros(1, x.shape[1])])[t_safe]

    d = min(top_k, n)
    j = torch.cumsum(plan.hit, 1) - 1                           # (T, N): j-th destination of t
    combine_index = torch.full((num_tokens, d + 1), rows, dtype=torch.int64, device=dev)
    combine_index.scatter_(1, torch.where(plan.hit, j, d), slot)
    sent = torch.cat([kept, kept.new_zeros(num_tokens, 1)], dim=1).gather(1, plan.dest)   # (T, K)
    handle = LowLatencyHandle(combine_index[:, :d], (plan.hit & ~kept).sum(),
                              ((plan.dest < n) & ~sent).sum(), c, x.dtype)
    return send_x, send_meta, handle


def low_latency_dispatch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         placement: Placement, capacity: int, *, group: dist.ProcessGroup | None = None,
                         ignore_invalid_ids: bool = False,
                         tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                         probe: Probe | None = None) -> tuple[LowLatencyTokens, LowLatencyHandle]:
    """Send every token row to the ranks holding its experts in fixed blocks of `capacity` rows
    (collective: every rank calls it, with the same capacity; T may differ between ranks, and be 0).

    Args and ids as `moekit.parallel.dispatch`; capacity: C, rows each rank sends each rank;
    probe: called after the steps "plan", "pack" and "rows" (never in a CUDA graph: it syncs).
    An input error raises on this rank alone, before the exchange: called phase by phase, a rank
    cannot stand in for the experts and combine that follow (`low_latency_moe` does).

    Returns:
        (LowLatencyTokens for this rank's experts, LowLatencyHandle for `low_latency_combine`).
    """
    rank, _ = check_group(placement, group)
    check_capacity("capacity", capacity)
    check_inputs(x, topk_weights, topk_ids, placement, group, ignore_invalid_ids=ignore_invalid_ids)
    return send_fixed(x, topk_weights, topk_ids, placement, rank, capacity, group, tables, probe)


def send_fixed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, placement: Placement,
               rank: int, capacity: int, group: dist.ProcessGroup | None,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None,
               probe: Probe | None = None) -> tuple[LowLatencyTokens, LowLatencyHandle]:
    """`low_latency_dispatch` on checked inputs: plan, pack, the two all-to-alls."""
    plan = plan_routes(topk_ids, placement, rank, tables, capacity=capacity)
    mark(probe, "plan")
    send_x, send_meta, handle = pack_fixed(x, topk_weights, plan, capacity)
    mark(probe, "pack")
    recv_x, recv_meta = torch.empty_like(send_x), torch.empty_like(send_meta)
    dist.all_to_all_single(recv_x, send_x, group=group)         # equal splits: no sizes to exchange
    dist.all_to_all_single(recv_meta, send_meta, group=group)
    top_k = topk_ids.shape[1]
    weights, ids = unpack_meta(recv_meta[:, : 2 * top_k], top_k)
    mark(probe, "rows")
    return LowLatencyTokens(recv_x, weights, ids, recv_meta[:, 2 * top_k], capacity), handle


def low_latency_experts(tokens: LowLatencyTokens, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *,
                        expert_capacity: int | None = None, config: ExpertsConfig | None = None,
                        stats: dict | None = None) -> torch.Tensor:
    """The received rows through this rank's experts on the masked layout: (N * C, H) partials.

    Args:
        tokens: from `low_latency_dispatch`.
        gate_up_proj, down_proj: (E_r, 2I, H), (E_r, H, I), this rank's experts.
        expert_capacity: C_e, rows per local expert (default N * C); pairs past it are dropped.
        config: tiles of the masked kernels (default: the tuned table for E_r experts, N * C rows).
        stats: filled with "expert_dropped", "expert_counts", "recv_counts", "expert_capacity".
    """
    check_forward_only(tokens.x, tokens.topk_weights, gate_up_proj, down_proj)
    rows, num_local = tokens.x.shape[0], gate_up_proj.shape[0]
    cap = check_capacity("expert_capacity", expert_capacity if expert_capacity is not None else rows)
    dev = tokens.x.device
    if num_local == 0:
        # A rank without experts: nobody sends it a pair, and there is no expert to launch.
        partial = torch.zeros_like(tokens.x)
        counts = torch.zeros(0, dtype=torch.int32, device=dev)
        dropped = torch.zeros((), dtype=torch.int64, device=dev)
    else:
        # The masked backend's default tiles are the tuned table's for E_r experts and N * C rows.
        found: dict = {}
        options = ExpertsOptions(config, stats=found, capacity=cap)
        partial = get_backend("masked").run(tokens.x, gate_up_proj, down_proj, tokens.topk_weights,
                                            tokens.topk_ids, options, None)
        counts, dropped = found["counts"], found["dropped"]
    if stats is not None:
        stats.update(expert_dropped=dropped, expert_counts=counts, recv_counts=tokens.recv_counts,
                     expert_capacity=cap)
    return partial


def low_latency_combine(partial: torch.Tensor, handle: LowLatencyHandle, *,
                        group: dist.ProcessGroup | None = None, probe: Probe | None = None) -> torch.Tensor:
    """Return each received row's partial to its source rank (equal splits) and sum per token in
    increasing rank order, fp32 (collective). partial: (N * C, H) -> (T, H) in the input's dtype.
    probe: called after "back" (the all-to-all) and "reduce"."""
    check_forward_only(partial)
    rows = partial.shape[0]
    back = partial.new_empty(rows + 1, partial.shape[1])
    back[rows].zero_()
    dist.all_to_all_single(back[:rows], partial.contiguous(), group=group)
    mark(probe, "back")
    out = reduce_partials(back, handle.combine_index, handle.dtype)
    mark(probe, "reduce")
    return out


def raise_on_overflow(dropped: torch.Tensor, group: dist.ProcessGroup | None, failed: bool = False) -> None:
    """overflow="raise": sum the group's dropped pairs and the ranks whose inputs failed their checks
    (one all_reduce and a host read on every rank). A rank that `failed` returns (it raises its own
    error); every other rank raises a ValueError naming the failed ranks if any, else
    `CapacityOverflow` if any pair was dropped anywhere."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flags = torch.zeros(world, dtype=torch.int64, device=dropped.device)
    if failed:
        flags[rank] = 1
    total = torch.cat([dropped.reshape(1).to(torch.int64), flags])
    dist.all_reduce(total, group=group)
    n, *by_rank = total.tolist()
    bad = [r for r, f in enumerate(by_rank) if f]
    if failed:
        return
    if bad:
        raise ValueError(f"rank(s) {bad} of the group reported invalid inputs and sent no tokens; see the "
                         "error raised on those ranks")
    if n:
        raise CapacityOverflow(f"{n} token-expert pair(s) over the group did not fit (this rank: "
                               f"{int(dropped)} counted); raise capacity= (rows per destination "
                               "rank) or expert_capacity=, or pass overflow='drop' to drop and count them")


def low_latency_moe(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, placement: Placement,
                    capacity: int, expert_capacity: int | None = None, overflow: str = "drop",
                    group: dist.ProcessGroup | None = None, ignore_invalid_ids: bool = False,
                    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                    config: ExpertsConfig | None = None, stats: dict | None = None,
                    top_k: int | None = None) -> torch.Tensor:
    """dispatch -> experts -> combine in the low-latency mode (collective); see the module docstring.

    Arguments as `moekit.parallel.ep_moe_experts` (which calls this for mode="low_latency"), plus
    capacity, expert_capacity, overflow ("drop" or "raise"), config (the masked kernels' tiles),
    stats (a dict filled with the module docstring's counters) and top_k (the group's, if known).
    A rank whose inputs fail their checks stands in (`stand_in`) and raises; see the module docstring.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    check_capacity("capacity", capacity)
    if expert_capacity is not None:
        check_capacity("expert_capacity", expert_capacity)
    rank, _ = check_group(placement, group)
    weights = (gate_up_proj, down_proj)
    num_local = len(placement.slots[rank])
    weights_error = caught(lambda: check_weights(gate_up_proj, down_proj, num_local, group))
    error = weights_error or first_error(
        lambda: check_hidden_states(hidden_states, gate_up_proj),
        lambda: check_forward_only(gate_up_proj, down_proj),
        lambda: check_inputs(hidden_states, topk_weights, topk_ids, placement, group,
                             ignore_invalid_ids=ignore_invalid_ids, top_k=top_k))
    if error is not None:
        usable = None if weights_error is not None else weights
        stand_in(error, geometry(usable, hidden_states, topk_weights, topk_ids, placement, top_k),
                 weights=usable, placement=placement, capacity=capacity, expert_capacity=expert_capacity,
                 overflow=overflow, group=group, config=config)
    return run_fixed(hidden_states, topk_weights, topk_ids, weights, placement=placement, rank=rank,
                     capacity=capacity, expert_capacity=expert_capacity, overflow=overflow, group=group,
                     tables=tables, config=config, stats=stats)


def run_fixed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              weights: tuple[torch.Tensor, torch.Tensor] | None, *, placement: Placement, rank: int,
              capacity: int, expert_capacity: int | None, overflow: str, group: dist.ProcessGroup | None,
              tables: tuple[torch.Tensor, torch.Tensor] | None = None, config: ExpertsConfig | None = None,
              stats: dict | None = None, failed: bool = False) -> torch.Tensor:
    """`low_latency_moe` on checked inputs. weights None: NaN partials in place of this rank's experts'
    (a stand-in whose own weights are the bad input); failed: this rank stands in (`raise_on_overflow`)."""
    tokens, handle = send_fixed(x, topk_weights, topk_ids, placement, rank, capacity, group, tables)
    local: dict = {}
    if weights is None:
        partial = torch.full_like(tokens.x, float("nan"))
        local["expert_dropped"] = torch.zeros((), dtype=torch.int64, device=x.device)
    else:
        partial = low_latency_experts(tokens, *weights, expert_capacity=expert_capacity, config=config,
                                      stats=local)
    out = low_latency_combine(partial, handle, group=group)
    dropped = handle.dropped_pairs + local["expert_dropped"]
    if stats is not None:
        stats.update(local, capacity=capacity, dropped_rows=handle.dropped_rows,
                     dropped_pairs=handle.dropped_pairs, dropped=dropped)
    if overflow == "raise":
        raise_on_overflow(dropped, group, failed)
    return out


def geometry(weights: tuple[torch.Tensor, torch.Tensor] | None, hidden_states: object,
             topk_weights: object, topk_ids: object, placement: Placement,
             top_k: int | None) -> tuple[int, torch.dtype, int] | None:
    """(H, dtype, K) of the blocks the other ranks exchange, as a rank whose inputs failed their checks
    can tell them: H and dtype from its valid weights, else from a (T, H) float hidden_states; K the
    group's top_k if given, else the one width in [1, E] that its 2-D topk_ids and topk_weights
    share (or the one of them that is 2-D has). None when no input gives them (widths that differ:
    either may be the wrong one), and that rank cannot stand in."""
    if weights is not None:
        hidden, dtype = weights[0].shape[2], weights[0].dtype
    elif isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 2 and \
            hidden_states.dtype in FLOAT_DTYPES:
        hidden, dtype = hidden_states.shape[1], hidden_states.dtype
    else:
        return None
    if top_k is None:
        tensors = [t for t in (topk_ids, topk_weights) if isinstance(t, torch.Tensor) and t.dim() == 2]
        widths = {t.shape[1] for t in tensors}
        if len(widths) != 1 or not 1 <= min(widths) <= placement.num_experts:
            return None
        top_k = widths.pop()
    return hidden, dtype, top_k


def stand_in(error: Exception, shape: tuple[int, torch.dtype, int] | None, *,
             weights: tuple[torch.Tensor, torch.Tensor] | None, placement: Placement, capacity: int,
             expert_capacity: int | None, overflow: str, group: dist.ProcessGroup | None,
             config: ExpertsConfig | None = None) -> NoReturn:
    """This rank's part in a low-latency call whose inputs failed their checks, so that no other rank
    waits for it: the call with no tokens of its own (empty blocks to every rank, on `group_device`),
    its experts run on the rows the others send (NaN partials when `weights` is None: those tokens come
    out NaN on the other ranks, never silently short a pair), the combine, and under overflow="raise"
    the all_reduce, which carries the failure to every rank. Then raises `error` (`raise_rank_error`).
    No host sync under overflow="drop"; runs under no_grad (nothing is differentiated).

    shape: (H, dtype, K) of the blocks (`geometry`); None raises at once, on this rank alone: with
    the blocks' sizes unknown it cannot take part."""
    rank = dist.get_rank(group)
    if shape is None:
        raise_rank_error(error, rank)
    hidden, dtype, top_k = shape
    dev = group_device(group, *(weights or ()))
    with torch.no_grad():
        run_fixed(torch.zeros(0, hidden, dtype=dtype, device=dev),
                  torch.zeros(0, top_k, dtype=torch.float32, device=dev),
                  torch.zeros(0, top_k, dtype=torch.int32, device=dev), weights, placement=placement,
                  rank=rank, capacity=capacity, expert_capacity=expert_capacity, overflow=overflow,
                  group=group, config=config, failed=True)
    raise_rank_error(error, rank)
