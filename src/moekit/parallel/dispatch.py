"""Expert-parallel dispatch and combine over torch.distributed all-to-alls (DeepEP's two halves).

Dataflow on one rank of N (T local tokens, K top_k, H hidden; S rows sent, R rows received):

    plan     placement.assign: dest (T, K) rank of each pair (replicated experts split round-robin,
             see moekit.placement), local (T, K) its expert's index there;
             hit (T, N): token t has at least one pair on rank d; send_counts (N,) = hit.sum(0)
    counts   all_to_all_single(send_counts) -> recv_counts (N,); both read on the host
    pack     one row per (token, destination rank), sorted by (rank, token): a token with 3 experts
             on rank d is sent to d once, its other slots marked -1 (what DeepEP does)
    rows     all_to_all_single: x (S, H) -> (R, H); meta (S, 2K) int32 -> (R, 2K)
    experts  moe_experts(ignore_invalid_ids=True) on the received rows, local ids -> (R, H)
    back     all_to_all_single: (R, H) -> (S, H), the reverse splits
    reduce   out[t] = sum of t's partial rows in increasing rank order, in fp32

plan, pack and reduce run as one Triton launch each on CUDA (`moekit.parallel.fused`; no host read):
the plan's kernel also gives each (token, rank) its row among the rank's rows (pos), so the pack
places rows at start_d + pos from the device counts. The torch functions here (`plan_routes_torch`,
`pack_torch`, `reduce_partials_torch`) are their twins: the reference the kernels equal exactly,
and the CPU path (MOEKIT_EP_TORCH=1 picks them on CUDA too).

The sync point: all_to_all_single takes its split sizes as host integers, so the counts are copied
to the host once per layer call (send and receive together, one device-to-host copy). Every other
step is sized from those integers and runs without a sync. Avoiding it needs fixed-size buffers
(DeepEP's low-latency mode, DeepGEMM's masked layout): `moekit.parallel.low_latency`.

Errors fail every rank, never one alone (a rank that raises before a collective leaves the others
waiting in it until the group's timeout). The count exchange is every call's first collective, and
it carries two things besides the counts (`exchange_counts`; no extra collective or sync):
    input errors   a rank whose inputs fail this call's checks (`check_inputs`: shapes, dtypes,
                   devices, grad flags, ids outside [0, E) on CPU; in `ep_moe_experts` also its
                   experts' weights) sends -1 in place of its counts; after the exchange it raises its
                   own error (naming the argument; its type kept), every other rank a ValueError
                   naming the rank(s) that reported one
    agreement      every rank sends its call's hidden size, dtype, top_k and placement digest
                   (`call_fields`); ranks that differ would exchange rows that do not line up, so every
                   rank raises the same ValueError naming the fields and each rank's value
Arguments that are the same on every rank of SPMD code by construction (the placement's rank count,
mode, capacities, overlap_chunks, expert options) raise directly, before any collective, and are not
compared between ranks here: direct calls with different overlap_chunks send counts of different
sizes (`ExpertParallelMoE.agree` compares them once). The phases called one by one (`dispatch`,
`run_local_experts`, `combine`) fail together in `dispatch` only: a later error (a partial of the
wrong shape in `combine`) raises on its rank alone.

Metadata (one rank):
    send meta (S, 2K) int32: [:, :K] local expert ids or -1; [:, K:] the fp32 routing weights' bits
        (0.0 where the id is -1). Ids and weights travel in one collective, and bit-exact.
    DispatchHandle.combine_index (T, D) int64, D = min(K, N): row of the returned buffer holding
        token t's partial from its j-th destination rank (increasing rank); S, a zero row, after
        its last one. The reduction order is fixed, so results are bitwise reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from moekit._validation import (
    FLOAT_DTYPES,
    ID_DTYPES,
    check_expert_ids_in_range,
    check_shape,
    check_tensor,
    needs_grad,
)
from moekit.experts import moe_experts
from moekit.parallel import fused
from moekit.placement import Placement, assign

Probe = Callable[[str], None]
"""Called with a step's name as each step of a dispatch or combine is issued (`ep-bench` passes one
that syncs the device and reads the clock, to time the steps; the layer passes none: no sync)."""


def mark(probe: Probe | None, name: str) -> None:
    if probe is not None:
        probe(name)


@dataclass(frozen=True)
class RoutePlan:
    """Where one rank's pairs go, before any communication.

    Fields:
        dest: (T, K) int64 destination rank of each pair; N for a pair that goes nowhere.
        local: (T, K) int64 expert index on the destination rank; -1 where dest == N.
        hit: (T, N) bool, token t has at least one pair on rank d.
        send_counts: (N,) int64 on the device, rows for each rank (= hit.sum(0)).
        pos: (T, N) int32, tokens before t with a pair on rank d (`route_positions(hit)`): t's row
            among d's rows where hit. Set by the fused plan only (None: the torch pack computes it).
        drops: (2, N) int64, per destination the rows and the pairs past `capacity` (rows with
            pos >= capacity): the fused plan for the low-latency mode only, else None.
        capacity: the C `drops` counts for, or None.
    """

    dest: torch.Tensor
    local: torch.Tensor
    hit: torch.Tensor
    send_counts: torch.Tensor
    pos: torch.Tensor | None = None
    drops: torch.Tensor | None = None
    capacity: int | None = None


@dataclass(frozen=True)
class DispatchedTokens:
    """What a rank receives: rows for its local experts.

    Fields:
        x: (R, H) token rows, grouped by source rank (increasing), by token within a source.
        topk_weights: (R, K) float32 routing weights; 0 where the id is -1.
        topk_ids: (R, K) int32 local expert ids in [0, E_local), or -1 for pairs held elsewhere.
        recv_counts: rows from each source rank (N ints, sum R).
    """

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    recv_counts: list[int]


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs to bring the partial rows back and sum them.

    Fields:
        send_counts: rows sent to each rank (N ints, sum S).
        recv_counts: rows received from each rank (N ints, sum R).
        combine_index: (T, D) int64, D = min(K, N); see the module docstring.
        dtype: of the output (the input's).
    """

    send_counts: list[int]
    recv_counts: list[int]
    combine_index: torch.Tensor
    dtype: torch.dtype


def check_forward_only(*tensors: torch.Tensor) -> None:
    """Raise if autograd would record the call: the all-to-alls carry no gradient, so the output would be
    silently detached. Reads only local flags (the same on every rank of SPMD code): no collective."""
    if needs_grad(*tensors):
        raise RuntimeError("moekit expert parallelism is forward-only (the all-to-alls carry no "
                           "gradient); run it under torch.no_grad() or torch.inference_mode()")


def check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                  *, ignore_invalid_ids: bool = False, check_ids: bool = True) -> None:
    """Shapes, dtypes, devices; id ranges on CPU (no host sync on CUDA), as `moe_experts` checks.
    check_ids=False leaves the ids to the caller (`ids_error`, reported in the count exchange)."""
    check_tensor("hidden_states", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=x.device)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must have shape (T={x.shape[0]}, K), got {tuple(topk_ids.shape)}")
    if not 1 <= topk_ids.shape[1] <= num_experts:
        raise ValueError(f"top_k (topk_ids.shape[1]) must be in [1, E={num_experts}], "
                         f"got {topk_ids.shape[1]}")
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape), "same as topk_ids")
    error = ids_error(x, topk_ids, num_experts, ignore_invalid_ids=ignore_invalid_ids) if check_ids else None
    if error is not None:
        raise ValueError(error)


def ids_error(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *,
              ignore_invalid_ids: bool = False) -> str | None:
    """The id-range error on CPU (None if the ids are in range, or not checked: CUDA, no host sync)."""
    if x.device.type != "cpu" or ignore_invalid_ids:
        return None
    try:
        check_expert_ids_in_range(topk_ids, num_experts)
    except ValueError as exc:
        return str(exc)
    return None


def check_group(placement: Placement, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world) of the group; the placement must be for the group's size (the same on every rank
    of SPMD code, so raised directly)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if placement.num_ranks != world:
        raise ValueError(f"placement is for {placement.num_ranks} ranks, the process group has {world}")
    return rank, world


def check_backend_device(name: str, t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """t is on a device the group's backend exchanges: the CPU for gloo, a GPU for nccl."""
    backend = dist.get_backend(group)
    if backend == "gloo" and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, but gloo's all-to-all takes CPU tensors only; "
                         "use an nccl process group for GPU tensors")
    if backend == "nccl" and t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}, but nccl's all-to-all takes CUDA tensors only")


def group_device(group: dist.ProcessGroup | None, *likely: object) -> torch.device:
    """Where this rank's collectives go in a call whose inputs failed their checks: the device the
    other ranks' tensors are on, never a bad input's guessed blindly. gloo: the CPU. nccl: the
    group's bound device (init_process_group(device_id=...)), else the first CUDA tensor of `likely`
    (this rank's weights before its inputs), else the current CUDA device. Another backend: the
    first tensor's device of `likely`, else the CPU."""
    backend = dist.get_backend(group)
    tensors = [t for t in likely if isinstance(t, torch.Tensor)]
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
        if bound is not None:
            return torch.device(bound)
        cuda = [t.device for t in tensors if t.is_cuda]
        return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
    return tensors[0].device if tensors else torch.device("cpu")


def caught(check: Callable[[], object]) -> Exception | None:
    """The ValueError, TypeError or RuntimeError `check()` raises, or None: a rank keeps its input
    error to report it in the call's collectives instead of leaving the other ranks waiting there."""
    try:
        check()
    except (ValueError, TypeError, RuntimeError) as exc:
        return exc
    return None


def first_error(*checks: Callable[[], object]) -> Exception | None:
    """The error of the first check that raises one (`caught`), or None; later checks do not run."""
    for check in checks:
        error = caught(check)
        if error is not None:
            return error
    return None


def raise_rank_error(error: Exception, rank: int) -> NoReturn:
    """Raise this rank's input error after the collectives it took part in: its class (ValueError,
    TypeError or RuntimeError) kept, its message prefixed with the rank."""
    cls = next(c for c in (ValueError, TypeError, RuntimeError) if isinstance(error, c))
    raise cls(f"rank {rank}: {error}") from error


def check_top_k_width(topk_ids: torch.Tensor, top_k: int | None) -> None:
    """topk_ids is (T, top_k) for the top_k every rank routes with, when the caller knows it
    (`ExpertParallelMoE` passes its shape's)."""
    if top_k is None:
        return
    check_tensor("topk_ids", topk_ids, ndim=2)
    if topk_ids.shape[1] != top_k:
        raise ValueError(f"topk_ids must have shape (T, K={top_k}) (the top_k every rank routes with), "
                         f"got {tuple(topk_ids.shape)}")


def check_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, placement: Placement,
                 group: dist.ProcessGroup | None, *, ignore_invalid_ids: bool = False,
                 top_k: int | None = None) -> None:
    """One call's routing inputs on this rank, everything that may differ between ranks from call to
    call: shapes, dtypes, devices (on one the group's backend takes), top_k (the group's, when
    given), the forward-only flags, then ids outside [0, E) on CPU (no host sync on CUDA)."""
    check_routing(x, topk_weights, topk_ids, placement.num_experts, check_ids=False)
    check_top_k_width(topk_ids, top_k)
    check_backend_device("hidden_states", x, group)
    check_forward_only(x, topk_weights)
    error = ids_error(x, topk_ids, placement.num_experts, ignore_invalid_ids=ignore_invalid_ids)
    if error is not None:
        raise ValueError(error)


def check_weights(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, num_local: int,
                  group: dist.ProcessGroup | None) -> None:
    """This rank's experts: (E_r, 2I, H) and (E_r, H, I) float tensors of one dtype, on one device the
    group's backend takes, E_r the placement's count for the rank."""
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("down_proj", down_proj, ndim=3, dtypes=(gate_up_proj.dtype,), device=gate_up_proj.device)
    check_backend_device("gate_up_proj", gate_up_proj, group)
    if gate_up_proj.shape[0] != num_local or down_proj.shape[0] != num_local:
        raise ValueError(f"this rank holds {num_local} experts in the placement, but gate_up_proj and "
                         f"down_proj have {gate_up_proj.shape[0]} and {down_proj.shape[0]}")
    _, two_i, hidden = gate_up_proj.shape
    check_shape("gate_up_proj", gate_up_proj, (num_local, two_i - two_i % 2, hidden), "(E_r, 2I, H)")
    check_shape("down_proj", down_proj, (num_local, hidden, two_i // 2), "(E_r, H, I)")


def check_hidden_states(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor) -> None:
    """hidden_states (T, H) in the experts' dtype, on their device, H theirs (after `check_weights`)."""
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=(gate_up_proj.dtype,),
                 device=gate_up_proj.device)
    if hidden_states.shape[1] != gate_up_proj.shape[2]:
        raise ValueError(f"hidden_states must have shape (T, H={gate_up_proj.shape[2]}) (the experts' hidden "
                         f"size), got {tuple(hidden_states.shape)}")


def plan_routes(topk_ids: torch.Tensor, placement: Placement, rank: int,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                capacity: int | None = None) -> RoutePlan:
    """Destination rank and local expert of every pair of `rank`'s tokens (no communication).

    `tables` is `placement.copy_table(device)`, to reuse across calls. On the fused path (CUDA) one
    launch, which also fills `pos` and, given the low-latency `capacity`, `drops`.
    """
    if fused.path_for(topk_ids) == "triton":
        return RoutePlan(*fused.route(topk_ids, placement, rank, tables, capacity), capacity=capacity)
    return plan_routes_torch(topk_ids, placement, rank, tables)


def plan_routes_torch(topk_ids: torch.Tensor, placement: Placement, rank: int,
                      tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> RoutePlan:
    """`plan_routes` in torch ops (the fused plan's twin): pos and drops stay None."""
    n = placement.num_ranks
    if placement.num_replicas == 0:
        # Copy 0 of every expert: two lookups, entry E (ids outside [0, E), clamped to -1 or E) nowhere.
        t = placement.device_tables(topk_ids.device)
        key = topk_ids.clamp(-1, placement.num_experts)
        dest, local = t.dest0[key], t.local0_long[key]
    else:
        a = assign(topk_ids, placement, source_rank=rank, tables=tables)
        dest = torch.where(a.rank >= 0, a.rank.long(), n)
        local = a.local_ids.long()
    hit = torch.zeros(topk_ids.shape[0], n + 1, dtype=torch.bool, device=topk_ids.device)
    hit.scatter_(1, dest, True)  # column N collects the pairs that go nowhere
    hit = hit[:, :n]
    return RoutePlan(dest, local, hit, hit.sum(0))


def route_positions(hit: torch.Tensor) -> torch.Tensor:
    """int32 (T, N): tokens before t with a pair on rank d (`RoutePlan.pos`), in torch ops."""
    return (torch.cumsum(hit, 0) - hit.long()).to(torch.int32)


def pack(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan,
         num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send buffers of one rank, sized by the host count `num_rows` (= plan.send_counts.sum()).

    Returns:
        (send_x (S, H), send_meta (S, 2K) int32, combine_index (T, D) int64).
    One launch for a fused plan (it carries pos), else `pack_torch`.
    """
    if plan.pos is not None:
        return fused.pack(x, topk_weights, plan, num_rows)
    return pack_torch(x, topk_weights, plan, num_rows)


def pack_torch(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan,
               num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack` in torch ops (the fused pack's twin)."""
    num_tokens, top_k = plan.dest.shape
    n = plan.hit.shape[1]
    dev = x.device
    s = num_rows
    # Rows are ordered by (destination rank, token): the order of the flattened (N, T) hit matrix.
    flat = plan.hit.T.reshape(-1)
    pos = torch.cumsum(flat, 0) - 1
    where_to = torch.where(flat, pos, s)  # slot s is a dump for the (d, t) that send nothing
    cell = torch.arange(n * num_tokens, device=dev, dtype=torch.int64)
    rows = torch.empty(s + 1, dtype=torch.int64, device=dev).scatter_(0, where_to, cell)[:s]
    row_token, row_dest = rows % max(num_tokens, 1), rows // max(num_tokens, 1)

    same = plan.dest[row_token] == row_dest[:, None]  # (S, K) pairs of this row's token on its rank
    send_ids = torch.where(same, plan.local[row_token], -1).to(torch.int32)
    send_w = torch.where(same, topk_weights[row_token].float(), 0.0)
    send_meta = torch.cat([send_ids, send_w.view(torch.int32)], dim=1)
    send_x = x[row_token]

    d = min(top_k, n)
    slot = torch.cumsum(plan.hit, 1) - 1  # (T, N): j-th destination of the token
    row_of = pos.view(n, num_tokens).T  # (T, N): its row, where hit
    combine_index = torch.full((num_tokens, d + 1), s, dtype=torch.int64, device=dev)
    combine_index.scatter_(1, torch.where(plan.hit, slot, d), torch.where(plan.hit, row_of, s))
    return send_x, send_meta, combine_index[:, :d]


def unpack_meta(meta: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, 2K) int32 -> (topk_weights (R, K) float32, topk_ids (R, K) int32)."""
    ids = meta[:, :top_k].contiguous()
    weights = meta[:, top_k:].contiguous().view(torch.float32)
    return weights, ids


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
    return out


HEADER = 2   # columns after a rank's counts in the exchange: its `call_fields`


def call_fields(x: torch.Tensor, topk_ids: torch.Tensor, placement: Placement) -> tuple[int, int]:
    """What the ranks of a call must agree on for the exchanged rows to line up, as the two ints
    `exchange_counts` sends: (H << 24 | K << 8 | the dtype's index in FLOAT_DTYPES, placement.digest)."""
    return x.shape[1] << 24 | topk_ids.shape[1] << 8 | FLOAT_DTYPES.index(x.dtype), placement.digest


def disagreements(by_field: dict[str, list]) -> list[str]:
    """'name (rank 0: v0, rank 1: v1, ...)' for each field whose values (one per rank) are not all equal."""
    return [f"{name} ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))})"
            for name, values in by_field.items() if len(set(values)) > 1]


def check_agreement(fields: list[list[int]]) -> None:
    """The ranks' `call_fields` as received (row s from rank s, the same rows on every rank): the
    same ValueError on every rank, naming each field that differs and every rank's value, if any do."""
    if all(f == fields[0] for f in fields):
        return
    shown = {
        "hidden size": [key >> 24 for key, _ in fields],
        "dtype": [str(FLOAT_DTYPES[key & 0xFF]) for key, _ in fields],
        "top_k": [key >> 8 & 0xFFFF for key, _ in fields],
        "placement": [f"{digest:08x}" for _, digest in fields],
    }
    raise ValueError("the ranks of the group called the expert-parallel exchange with rows that do not line "
                     "up; every rank must pass the same hidden size, dtype, top_k and placement. They differ "
                     "in: " + "; ".join(disagreements(shown)))


def exchange_rows(rows: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[list, list]:
    """all_to_all_single of (N, w) int64 rows (row d to rank d); (sent, received) on the host, read
    together (one device-to-host copy)."""
    recv = torch.empty_like(rows)
    dist.all_to_all_single(recv, rows, group=group)
    sent, received = torch.stack([rows, recv]).tolist()
    return sent, received


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None,
                    fields: Sequence[int]) -> tuple[list[int], list[int]]:
    """The one host sync of a layer call: all-to-all the counts, copy both to the host together.
    send_counts: (N,), or (N, n) with n counts per rank (`moekit.parallel.overlap`'s chunks); row d
    goes to rank d, row s of the received ones came from rank s.

    fields: this call's `call_fields`, sent to every rank beside the counts; ranks that differ all
    raise (`check_agreement`). A rank whose inputs failed their checks takes part with -1 in place of
    its counts and fields (`fail_in_exchange`), and every rank raises after the exchange, the others
    a ValueError naming it: an error on one rank's data never leaves the others waiting in a
    collective. No extra collective or sync: the counts are read on the host anyway, and the fields
    are two columns more (two fills, no host-to-device copy)."""
    counts = send_counts.reshape(send_counts.shape[0], -1)
    n = counts.shape[1]
    rows = torch.empty(counts.shape[0], n + HEADER, dtype=torch.int64, device=counts.device)
    rows[:, :n] = counts
    rows[:, n] = fields[0]
    rows[:, n + 1] = fields[1]
    sent, received = exchange_rows(rows, group)
    bad = [s for s, row in enumerate(received) if min(row) < 0]
    if bad:
        raise ValueError(f"rank(s) {bad} of the group reported invalid inputs in the count exchange; see the "
                         "error raised on those ranks")
    check_agreement([row[n:] for row in received])
    if send_counts.dim() == 1:
        return [row[0] for row in sent], [row[0] for row in received]
    return [row[:n] for row in sent], [row[:n] for row in received]


def fail_in_exchange(error: Exception, group: dist.ProcessGroup | None, device: torch.device,
                     chunks: int = 1) -> NoReturn:
    """This rank's part in a normal-mode call whose inputs failed their checks: the count exchange
    every rank makes first, with -1 in place of its counts and fields, so that every rank raises after
    it; then raises `error` (`raise_rank_error`). device: `group_device`; chunks: n of the call's
    (N, n) counts (its overlap_chunks). The host read waits for the exchange to complete here."""
    rows = torch.full((dist.get_world_size(group), chunks + HEADER), -1, dtype=torch.int64, device=device)
    exchange_rows(rows, group)
    raise_rank_error(error, dist.get_rank(group))


def check_inputs_together(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          placement: Placement, group: dist.ProcessGroup | None, *likely: torch.Tensor,
                          ignore_invalid_ids: bool = False, chunks: int = 1) -> None:
    """`check_inputs`, an error reported in the count exchange (`fail_in_exchange`, its device by
    `group_device` of `likely`) so that every rank raises, not this one alone."""
    error = caught(lambda: check_inputs(x, topk_weights, topk_ids, placement, group,
                                        ignore_invalid_ids=ignore_invalid_ids))
    if error is not None:
        fail_in_exchange(error, group, group_device(group, *likely), chunks)


def dispatch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, placement: Placement,
             *, group: dist.ProcessGroup | None = None, ignore_invalid_ids: bool = False,
             tables: tuple[torch.Tensor, torch.Tensor] | None = None, probe: Probe | None = None,
             ) -> tuple[DispatchedTokens, DispatchHandle]:
    """Send every token row to the ranks holding its experts (collective: every rank calls it).

    Args:
        x: (T, H) this rank's tokens (T may be 0).
        topk_weights: (T, K) routing weights.
        topk_ids: (T, K) global expert ids, int32 or int64.
        placement: which rank holds which experts; placement.num_ranks must equal the group's size.
        group: the process group (default: the world).
        ignore_invalid_ids: pairs with ids outside [0, E) are not sent (contribute 0).
        tables: `placement.copy_table(x.device)`, to reuse across calls.
        probe: called after the steps "plan", "counts" (with the host sync), "pack" and "rows".

    Returns:
        (DispatchedTokens for this rank's experts, DispatchHandle for `combine`).

    An input error on one rank (`check_inputs`) and ranks that disagree on the hidden size, dtype,
    top_k or placement raise on every rank, after the count exchange (see the module docstring).
    """
    rank, _ = check_group(placement, group)
    check_inputs_together(x, topk_weights, topk_ids, placement, group, x,
                          ignore_invalid_ids=ignore_invalid_ids)
    plan = plan_routes(topk_ids, placement, rank, tables)
    mark(probe, "plan")
    send_counts, recv_counts = exchange_counts(plan.send_counts, group, call_fields(x, topk_ids, placement))
    mark(probe, "counts")
    send_x, send_meta, combine_index = pack(x, topk_weights, plan, sum(send_counts))
    mark(probe, "pack")
    r = sum(recv_counts)
    recv_x = x.new_empty(r, x.shape[1])
    recv_meta = send_meta.new_empty(r, send_meta.shape[1])
    _all_to_all(recv_x, send_x, recv_counts, send_counts, group)
    _all_to_all(recv_meta, send_meta, recv_counts, send_counts, group)
    weights, ids = unpack_meta(recv_meta, topk_ids.shape[1])
    mark(probe, "rows")
    return (DispatchedTokens(recv_x, weights, ids, recv_counts),
            DispatchHandle(send_counts, recv_counts, combine_index, x.dtype))


def run_local_experts(tokens: DispatchedTokens, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      *, backend: str = "auto", **experts_opts) -> torch.Tensor:
    """The received rows through this rank's experts: (R, H), one partial sum per row.

    `moe_experts` takes at most E_local slots per row; when K > E_local (a rank holding fewer
    experts than top_k, e.g. uneven placement) the slots run in chunks of E_local, summed in fp32.
    """
    x, weights, ids = tokens.x, tokens.topk_weights, tokens.topk_ids
    check_forward_only(x, weights, gate_up_proj, down_proj)
    num_local, top_k = gate_up_proj.shape[0], ids.shape[1]
    if num_local == 0 or x.shape[0] == 0:
        # Nobody sends rows to a rank without experts; an empty receive needs no expert call.
        return torch.zeros_like(x)
    if top_k <= num_local:
        return moe_experts(x, gate_up_proj, down_proj, weights, ids, backend=backend,
                           ignore_invalid_ids=True, **experts_opts)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k0 in range(0, top_k, num_local):
        sl = slice(k0, k0 + num_local)
        acc += moe_experts(x, gate_up_proj, down_proj, weights[:, sl].contiguous(), ids[:, sl].contiguous(),
                           backend=backend, ignore_invalid_ids=True, **experts_opts)
    return acc.to(x.dtype)


def reduce_partials(back: torch.Tensor, combine_index: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """(S + 1, H) partial rows (last row zero) -> (T, H): each token's rows summed in rank order, fp32.
    One launch on the fused path, else `reduce_partials_torch` (the same bits). `out`: a (T, H)
    buffer of dtype to write instead (a row slice of a larger output: the chunked path)."""
    if fused.path_for(back) == "triton":
        return fused.reduce(back, combine_index, dtype, out=out)
    return reduce_partials_torch(back, combine_index, dtype, out)


def reduce_partials_torch(back: torch.Tensor, combine_index: torch.Tensor,
                          dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`reduce_partials` in torch ops (the fused reduce's twin)."""
    num_tokens, d = combine_index.shape
    if num_tokens == 0:
        return back.new_empty(0, back.shape[1], dtype=dtype) if out is None else out
    acc = back[combine_index[:, 0]].float()
    for j in range(1, d):
        acc += back[combine_index[:, j]]
    return acc.to(dtype) if out is None else out.copy_(acc)


def combine(partial: torch.Tensor, handle: DispatchHandle, *,
            group: dist.ProcessGroup | None = None, probe: Probe | None = None) -> torch.Tensor:
    """Return each received row's partial result to its source rank and sum per token (collective).

    Args:
        partial: (R, H) one row per received row, in the order `dispatch` delivered them.
        handle: from the matching `dispatch`.
        probe: called after the steps "back" (the reverse all-to-all) and "reduce".

    Returns:
        (T, H) in the input's dtype: this rank's MoE output.

    A partial of the wrong shape raises on this rank alone, before the exchange (it is this rank's
    own experts' output on what `dispatch` delivered).
    """
    check_forward_only(partial)
    r = sum(handle.recv_counts)
    if partial.dim() != 2 or partial.shape[0] != r:
        raise ValueError(f"partial must have shape (R={r}, H), got {tuple(partial.shape)}")
    s = sum(handle.send_counts)
    back = partial.new_empty(s + 1, partial.shape[1])
    back[s].zero_()
    _all_to_all(back[:s], partial, handle.send_counts, handle.recv_counts, group)
    mark(probe, "back")
    out = reduce_partials(back, handle.combine_index, handle.dtype)
    mark(probe, "reduce")
    return out
