"""The normal mode in chunks: one chunk's all-to-alls overlap another chunk's experts.

`ExpertParallelMoE(..., overlap_chunks=n)` / `ep_moe_experts(..., overlap_chunks=n)`, n > 1:

    plan     once, over all T tokens (`dispatch.plan_routes`, one launch on CUDA)
    cut      chunk c = tokens [c·T//n, (c+1)·T//n). A token's rows never straddle chunks, and a
             chunk's rows for rank d are the plan's rows pos[b_c, d] .. pos[b_c+1, d] of d's, so
             the chunk counts are differences of the plan's positions at the n - 1 inner bounds
    counts   one all-to-all of the (N, n) chunk counts, one host sync (as `dispatch`)
    pack     each chunk's send buffers from a view of the plan ((rank, token) order, as `dispatch`)
    then per chunk: rows all-to-all -> experts -> back all-to-all -> the per-token reduce into
             out[chunk]; each chunk is a `dispatch` / `combine` of its token range.

On CUDA the all-to-alls run on a side stream (one per device, `comm_stream`), the rest on the
caller's (compute) stream, ordered by events; the host issues

    compute  pack 0 .. pack n-1 | experts 0 | experts 1 | reduce 0 | experts 2 | reduce 1 | ...
    comm         rows 0  | rows 1 | back 0 | rows 2 | back 1 | rows 3 | ...

so chunk c+1's rows travel while chunk c's experts run, and chunk c's partials go back while chunk
c+1's experts run (every rank issues its collectives in this same order). Buffers made on the
compute stream and used on the comm stream are `record_stream`-ed to it. On CPU (gloo) the same
calls run in program order.

Against n = 1: each token is sent to the same ranks with the same metadata and each token's
partials are summed in the same rank order, so the result is n = 1's bits wherever a received row's
partial depends only on that row and its expert. The triton backend gives that (its tiles are the
config a single call on all the received rows would pick, its registry entry's `default_config`,
not the chunk's, and each row's dot is its own: on a GPU, and in the interpreter through moekit's
dot shim). The other backends run their GEMMs through torch (cuBLAS, or a CPU BLAS such as MKL or
OpenBLAS), which picks its kernel and so its summation order by the row count: a chunk's GEMMs see
fewer rows, and the result agrees with n = 1 within fp32 rounding of the same sums (measured
~1e-7 with grouped_mm on a CPU), not necessarily bitwise. Per-call expert options that are not per row
(capacity_factor, stats) are refused.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moekit.experts import get_backend, resolve_backend
from moekit.parallel.dispatch import (
    DispatchedTokens,
    Probe,
    RoutePlan,
    _all_to_all,
    call_fields,
    check_group,
    check_inputs_together,
    exchange_counts,
    mark,
    pack,
    plan_routes,
    reduce_partials,
    route_positions,
    run_local_experts,
    unpack_meta,
)
from moekit.placement import Placement

NOT_PER_ROW = ("capacity_factor", "stats")   # expert options whose effect depends on the whole call


def check_overlap_chunks(overlap_chunks: object, mode: str = "normal") -> None:
    """overlap_chunks is an int >= 1, and > 1 only in the normal mode (before any collective)."""
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks must be an int >= 1 (1: no overlap), got {overlap_chunks!r}")
    if overlap_chunks > 1 and mode != "normal":
        raise ValueError(f"overlap_chunks applies to mode='normal'; mode={mode!r} takes overlap_chunks=1")


def chunk_bounds(num_tokens: int, chunks: int) -> list[int]:
    """The n + 1 token bounds of n chunks as even as integers allow (empty chunks when T < n)."""
    return [c * num_tokens // chunks for c in range(chunks + 1)]


def chunk_counts(plan: RoutePlan, bounds: list[int]) -> torch.Tensor:
    """(n, N) int64 on the device: rows of each chunk for each rank (the rows sum to send_counts)."""
    num_tokens, n_ranks = plan.hit.shape
    if num_tokens == 0:
        return plan.send_counts.new_zeros(len(bounds) - 1, n_ranks)
    pos = plan.pos if plan.pos is not None else route_positions(plan.hit)
    # Rows before each bound (int32 positions promote to int64 in one stack).
    at = torch.stack([plan.send_counts.new_zeros(n_ranks), *(pos[b] for b in bounds[1:-1]), plan.send_counts])
    return at.diff(dim=0)


def chunk_plan(plan: RoutePlan, lo: int, hi: int, counts: torch.Tensor) -> RoutePlan:
    """The plan of tokens [lo, hi) alone (views, and on the fused path pos from the chunk's start)."""
    pos = plan.pos
    if pos is not None:
        pos = pos[lo:hi] - pos[lo] if hi > lo else pos[lo:hi]
    return RoutePlan(plan.dest[lo:hi], plan.local[lo:hi], plan.hit[lo:hi], counts, pos)


_comm_streams: dict[torch.device, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the chunked path's all-to-alls run on (one per device, made once)."""
    if device not in _comm_streams:
        _comm_streams[device] = torch.cuda.Stream(device)
    return _comm_streams[device]


class Streams:
    """The compute stream (the caller's current one) and the comm stream on CUDA; on CPU every
    method does nothing and the calls run in program order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm = comm_stream(device)

    def on_comm(self) -> contextlib.AbstractContextManager:
        """Run the block's work (collectives included: NCCL orders them after it) on the comm stream."""
        return torch.cuda.stream(self.comm) if self.cuda else contextlib.nullcontext()

    def record(self) -> torch.cuda.Event | None:
        """An event at the current stream's point (compute's, or comm's inside `on_comm`)."""
        return torch.cuda.current_stream(self.compute.device).record_event() if self.cuda else None

    def wait(self, event: torch.cuda.Event | None) -> None:
        """The current stream waits for `event`."""
        if event is not None:
            torch.cuda.current_stream(self.compute.device).wait_event(event)

    def share(self, *tensors: torch.Tensor) -> None:
        """Tensors from the compute stream that the comm stream uses: not reused before it is done."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.comm)


def _pin_config(experts_opts: dict, backend: str, x: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, top_k: int, rows: int) -> dict:
    """experts_opts with the triton config of one call on all `rows` received rows (when none given)."""
    if experts_opts.get("config") is not None or rows == 0 or gate_up_proj.shape[0] == 0:
        return experts_opts
    impl = get_backend(resolve_backend(backend, x.device, x.shape[1], down_proj.shape[2], x.element_size()))
    if impl.default_config is None:
        return experts_opts
    return {**experts_opts, "config": impl.default_config(rows, gate_up_proj, top_k, x.dtype, x.device)}


def overlapped_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, placement: Placement, chunks: int,
                   group: dist.ProcessGroup | None = None, backend: str = "auto",
                   ignore_invalid_ids: bool = False, tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                   probe: Probe | None = None, **experts_opts) -> torch.Tensor:
    """`dispatch` -> `run_local_experts` -> `combine` in `chunks` token ranges, overlapped (module
    docstring; collective). Returns (T, H): the unchunked path's bits with the triton backend, within
    fp32 rounding of them with the others (their BLAS orders sums by the chunk's row count).

    probe: called after "plan", "counts", each chunk's "pack", "rows", "experts", "back" and
    "reduce", in the order issued (`moekit ep-bench` syncs there, which serialises the streams).

    Input errors and disagreements fail every rank in the one count exchange, as in `dispatch`.
    """
    check_overlap_chunks(chunks)
    given = [k for k in NOT_PER_ROW if experts_opts.get(k) is not None]
    if given:
        raise ValueError(f"overlap_chunks > 1 runs the experts once per chunk: {', '.join(given)} "
                         "(per call, not per row) would change the result; use overlap_chunks=1")
    rank, _ = check_group(placement, group)
    check_inputs_together(x, topk_weights, topk_ids, placement, group, gate_up_proj, x,
                          ignore_invalid_ids=ignore_invalid_ids, chunks=chunks)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    plan = plan_routes(topk_ids, placement, rank, tables)
    bounds = chunk_bounds(num_tokens, chunks)
    counts = chunk_counts(plan, bounds)
    mark(probe, "plan")
    fields = call_fields(x, topk_ids, placement)
    by_rank = exchange_counts(counts.T.contiguous(), group, fields)     # [rank][chunk], sent and received
    send, recv = ([list(col) for col in zip(*lists, strict=True)] for lists in by_rank)
    mark(probe, "counts")
    experts_opts = _pin_config(experts_opts, backend, x, gate_up_proj, down_proj, top_k, sum(map(sum, recv)))

    streams = Streams(x.device)
    # Every receive buffer first: the comm stream writes them after waiting for the packs' events.
    recv_x = [x.new_empty(sum(r), hidden) for r in recv]
    recv_meta = [torch.empty(sum(r), 2 * top_k, dtype=torch.int32, device=x.device) for r in recv]
    packed, packed_at = [], []
    for c in range(chunks):
        lo, hi = bounds[c], bounds[c + 1]
        packed.append(pack(x[lo:hi], topk_weights[lo:hi], chunk_plan(plan, lo, hi, counts[c]), sum(send[c])))
        packed_at.append(streams.record())
        mark(probe, "pack")

    arrived: list[torch.cuda.Event | None] = [None] * chunks
    returned: list[torch.cuda.Event | None] = [None] * chunks
    backs: list[torch.Tensor | None] = [None] * chunks
    out = x.new_empty(num_tokens, hidden)

    def send_rows(c: int) -> None:
        send_x, send_meta, _ = packed[c]
        with streams.on_comm():
            streams.wait(packed_at[c])
            _all_to_all(recv_x[c], send_x, recv[c], send[c], group)
            _all_to_all(recv_meta[c], send_meta, recv[c], send[c], group)
            arrived[c] = streams.record()
        streams.share(send_x, send_meta, recv_x[c], recv_meta[c])
        mark(probe, "rows")

    def reduce(c: int) -> None:
        streams.wait(returned[c])
        reduce_partials(backs[c], packed[c][2], x.dtype, out=out[bounds[c]:bounds[c + 1]])
        backs[c] = None
        mark(probe, "reduce")

    send_rows(0)
    for c in range(chunks):
        if c + 1 < chunks:
            send_rows(c + 1)            # before chunk c's experts: it travels while they run
        streams.wait(arrived[c])
        weights, ids = unpack_meta(recv_meta[c], top_k)
        partial = run_local_experts(DispatchedTokens(recv_x[c], weights, ids, recv[c]), gate_up_proj,
                                    down_proj, backend=backend, **experts_opts)
        s = sum(send[c])
        back = partial.new_empty(s + 1, hidden)
        back[s].zero_()
        done = streams.record()
        mark(probe, "experts")
        with streams.on_comm():
            streams.wait(done)
            _all_to_all(back[:s], partial, send[c], recv[c], group)
            returned[c] = streams.record()
        streams.share(partial, back)
        backs[c] = back
        mark(probe, "back")
        if c > 0:
            reduce(c - 1)               # after chunk c's experts: its back all-to-all ran meanwhile
    reduce(chunks - 1)
    return out
