"""Fused expert-parallel routing, packing and reduce: the launchers of `moekit.parallel.kernels`.

Each step has a pure-torch twin, the reference and the CPU fallback, which its kernel must match
exactly (integers equal, rows the same bits):

    route       one launch: dest / local of every pair, hit (T, N), pos (T, N), the device send
                counts, and for the low-latency mode the rows and pairs past C per destination
                twin: `dispatch.plan_routes_torch` (pos = the twin's `route_positions(hit)`)
    pack        one launch: send_x, send_meta, combine_index of the normal mode, rows at
                start_d + pos from the device counts    twin: `dispatch.pack_torch`
    pack_fixed  one launch: the same in fixed blocks of C rows, empty slots zero / -1, the drop
                counters as device scalars              twin: `low_latency.pack_fixed_torch`
    reduce      one launch: each token's partial rows summed in rank order in fp32
                                                        twin: `dispatch.reduce_partials_torch`

None reads a value back to the host, so all are CUDA-graph safe. The path for a tensor
(`path_for`): "triton" on CUDA tensors, "torch" on CPU tensors, unless the environment says
otherwise: MOEKIT_EP_TORCH=1 runs the torch twins everywhere (to compare), MOEKIT_EP_TRITON=1 the
kernels on CPU tensors too, interpreted (TRITON_INTERPRET=1; the tests). `use_path` overrides both
inside a block, in this process.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit._paths import PATHS, PathSwitch  # noqa: F401  (PATHS: the accepted names)
from moekit.parallel.kernels import ep_pack_kernel, ep_reduce_kernel, ep_route_kernel

if TYPE_CHECKING:
    from moekit.parallel.dispatch import RoutePlan
    from moekit.placement import Placement

_switch = PathSwitch("MOEKIT_EP")       # MOEKIT_EP_TORCH / MOEKIT_EP_TRITON

ROUTE_TILE = 4096      # elements of a route kernel's (BLOCK_T, K) and (BLOCK_T, R) tiles
PACK_TILE = 4096       # elements of a pack / reduce program's (BLOCK_T, BLOCK_H) row tile


def path_for(t: torch.Tensor) -> str:
    """"triton" or "torch": which implementation runs the EP steps on t's device (module docstring)."""
    return _switch.path_for(t)


def use_path(path: str) -> contextlib.AbstractContextManager[None]:
    """Run the EP steps with `path` ("auto", "torch" or "triton") inside the block."""
    return _switch.use(path)


def _pow2(n: int) -> int:
    return next_power_of_2(max(1, n))


def route(topk_ids: torch.Tensor, placement: Placement, rank: int,
          tables: tuple[torch.Tensor, torch.Tensor] | None = None, capacity: int | None = None,
          *, block_t: int | None = None) -> tuple[torch.Tensor, ...]:
    """(dest, local, hit, send_counts, pos, drops): `RoutePlan`'s fields, in one launch.

    dest, local: int64 (T, K); hit: bool (T, N); pos: int32 (T, N), tokens before t with a pair on
    d; send_counts: int64 (N,); drops: int64 (2, N) rows and pairs past `capacity` per destination
    (None without a capacity). block_t: tokens per step (a power of two; tests make it small).
    """
    num_tokens, top_k = topk_ids.shape
    n, dev = placement.num_ranks, topk_ids.device
    t = placement.device_tables(dev)
    table, n_copies = tables if tables is not None else (t.table, t.n_copies)
    replicas = t.num_replicated > 0
    k_pad, r_pad = _pow2(top_k), _pow2(t.num_replicated)
    if block_t is None:
        block_t = min(1024, _pow2(num_tokens), ROUTE_TILE // k_pad, ROUTE_TILE // r_pad if replicas else 1024)
        block_t = max(16, block_t)
    i64 = dict(dtype=torch.int64, device=dev)
    dest = _workspace.empty(num_tokens, top_k, **i64)
    local = _workspace.empty(num_tokens, top_k, **i64)
    hit = _workspace.empty(num_tokens, n, dtype=torch.int8, device=dev)
    pos = _workspace.empty(num_tokens, n, dtype=torch.int32, device=dev)
    counts = _workspace.empty(n, **i64)
    drops = _workspace.empty(2, n, **i64) if capacity is not None else None
    ep_route_kernel[(n,)](
        topk_ids, table, n_copies, t.rep_index, dest, local, hit, pos, counts,
        drops if drops is not None else counts,
        num_tokens, placement.num_experts, n, placement.slots_per_rank, rank, capacity or 0,
        topk_ids.stride(0), topk_ids.stride(1), table.stride(0),
        K=top_k, K_PAD=k_pad, R_PAD=r_pad, BLOCK_T=block_t, HAS_REPLICAS=replicas,
        COUNT_DROPS=capacity is not None,
        num_warps=4 if block_t * max(k_pad, r_pad if replicas else 1) <= 2048 else 8,
    )
    return dest, local, hit.view(torch.bool), counts, pos, drops


def _pack_blocks(hidden: int, block_t: int | None, block_h: int | None) -> tuple[int, int]:
    block_h = block_h or min(_pow2(hidden), 512)
    return block_t or min(64, max(8, PACK_TILE // block_h)), block_h


def _launch_pack(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan, send_x: torch.Tensor,
                 meta: torch.Tensor, combine_index: torch.Tensor, dropped: torch.Tensor, sentinel: int,
                 capacity: int, fill_rows: int, block_t: int | None, block_h: int | None) -> None:
    num_tokens, top_k = plan.dest.shape
    n, hidden = plan.hit.shape[1], x.shape[1]
    block_t, block_h = _pack_blocks(hidden, block_t, block_h)
    token_blocks = cdiv(num_tokens, block_t)
    grid = (token_blocks + cdiv(fill_rows, block_t), max(1, cdiv(hidden, block_h)))
    if grid[0] == 0:
        return
    fixed = fill_rows > 0
    d = min(top_k, n)
    ep_pack_kernel[grid](
        x, topk_weights, plan.dest, plan.local, plan.hit.view(torch.int8), plan.pos, plan.send_counts,
        plan.drops if fixed else plan.send_counts, send_x, meta, combine_index, dropped,
        num_tokens, hidden, n, sentinel, capacity, token_blocks,
        x.stride(0), x.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        send_x.stride(0), meta.stride(0),
        K=top_k, K_PAD=_pow2(top_k), N_PAD=_pow2(n), D=d, D_PAD=_pow2(d), M_PAD=_pow2(2 * top_k + 1),
        BLOCK_T=block_t, BLOCK_H=block_h, FIXED=fixed, num_warps=4,
    )


def pack(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan, num_rows: int, *,
         block_t: int | None = None, block_h: int | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dispatch.pack` in one launch: (send_x (S, H), send_meta (S, 2K) int32, combine_index (T, D))."""
    num_tokens, top_k = plan.dest.shape
    dev = x.device
    send_x = _workspace.empty(num_rows, x.shape[1], dtype=x.dtype, device=dev)
    meta = _workspace.empty(num_rows, 2 * top_k, dtype=torch.int32, device=dev)
    combine_index = _workspace.empty(num_tokens, min(top_k, plan.hit.shape[1]), dtype=torch.int64,
                                     device=dev)
    _launch_pack(x, topk_weights, plan, send_x, meta, combine_index, combine_index, num_rows, 0, 0,
                 block_t, block_h)
    return send_x, meta, combine_index


def pack_fixed(x: torch.Tensor, topk_weights: torch.Tensor, plan: RoutePlan, capacity: int, *,
               block_t: int | None = None, block_h: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`low_latency.pack_fixed` in one launch: (send_x (N * C, H), send_meta (N * C, 2K + 1) int32,
    combine_index (T, D), dropped int64 (2,) = (rows, pairs)). The plan must come from `route`
    with the same capacity (its drop counters)."""
    num_tokens, top_k = plan.dest.shape
    n, dev = plan.hit.shape[1], x.device
    rows = n * capacity
    send_x = _workspace.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
    meta = _workspace.empty(rows, 2 * top_k + 1, dtype=torch.int32, device=dev)
    combine_index = _workspace.empty(num_tokens, min(top_k, n), dtype=torch.int64, device=dev)
    dropped = _workspace.empty(2, dtype=torch.int64, device=dev)
    _launch_pack(x, topk_weights, plan, send_x, meta, combine_index, dropped, rows, capacity, rows,
                 block_t, block_h)
    return send_x, meta, combine_index, dropped


def reduce(back: torch.Tensor, combine_index: torch.Tensor, dtype: torch.dtype, *,
           block_t: int | None = None, block_h: int | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`dispatch.reduce_partials` in one launch: out[t] = sum_j back[combine_index[t, j]] in fp32
    (into `out`, (T, H) of dtype with unit inner stride, when given)."""
    num_tokens, d = combine_index.shape
    hidden = back.shape[1]
    if out is None:
        out = _workspace.empty(num_tokens, hidden, dtype=dtype, device=back.device)
    block_h = block_h or min(_pow2(hidden), 1024)
    block_t = block_t or min(64, max(1, PACK_TILE // block_h))
    grid = (cdiv(num_tokens, block_t), cdiv(hidden, block_h))
    if not combine_index.is_contiguous():
        combine_index = combine_index.contiguous()       # the torch pack's is a column slice
    bf16 = dtype == torch.bfloat16
    if grid[0] and grid[1]:
        ep_reduce_kernel[grid](back, combine_index, out.view(torch.int16) if bf16 else out, num_tokens,
                               hidden, *back.stride(), *out.stride(), D=d, BLOCK_T=block_t, BLOCK_H=block_h,
                               OUT_BF16=bf16, num_warps=4)
    return out
