"""Backward of the grouped GEMM family: launchers beside their pure-PyTorch twins (`*_torch`).

The forward (`moekit.grouped_gemm`) computes, for each pair p = t * K + k placed at sorted row r of
expert e: a, b = x[t] @ gate_e^T, x[t] @ up_e^T; h[r] = silu(a) * b; y_p = w_p * h[r] @ down_e^T;
out[t] = sum_k y_p. Given dout (T, H), with g[r] = dout[t] @ down_e (I):

    d topk_weights[p] = <g[r], h[r]>
    dpre[r]           = [g * b * silu'(a), g * silu(a)]          (2I; per unit routing weight)
    d down_e          = sum over e's rows of (w_p dout[t])^T h[r]
    d gate_up_e       = sum over e's rows of (w_p dpre[r])^T x[t]
    dx[t]             = sum over t's valid slots of w_p dpre[r] @ gate_up_e

Launchers, in the order the autograd Function (`moekit.experts.triton`) calls them:

    swiglu_backward     x, dout, weights -> dpre (L, 2I), h (L, I), d topk_weights (S,) fp32
                        (one kernel recomputing a, b beside g, plus a tile-sum kernel for the weights)
    hidden_states_grad  dpre -> dx (T, H): the forward's GEMM2 with gate_up_e as the (H, 2I) matrix,
                        then its slot sum
    gate_up_proj_grad   dpre, x -> (E, 2I, H);  down_proj_grad  dout, h -> (E, H, I)
                        (both `wgrad`, with their own tiles)

Metadata: the forward's `Alignment` (sorted_ids (L,), expert_ids (L / block_m,), num_padded, and
`Alignment.row_starts()` (E + 1,) for the weight gradients). Every grid is sized from
(T, K, E, config) and `Alignment.max_blocks`; nothing is read back to the host. Rows of dpre and h
past num_padded are not written (nobody reads them); d topk_weights is 0 for pairs never placed
(ids outside [0, E)); every expert's weight gradient is written, exactly 0 for an expert with no
rows. No atomics anywhere: results are bitwise reproducible.

Tiles, until the backward has its own tuned table: dx reuses GEMM2 with the forward's GEMM2 tiles
(same operand tiles, so it fits wherever the forward does). The SwiGLU backward streams five tiles
per step (x and dout rows, gate, up and down columns), so it takes GEMM1's tiles capped at 64 and
drops stages, then halves block_k, until they fit the device's shared-memory budget
(`BackwardTiles.fit`). The weight gradients have tiles of their own, independent of the forward's
and of the align block size (`moekit.tuning.WgradConfig`: the default fitted to the device, or
$MOEKIT_WGRAD_TILES, or `tiles=` on the launchers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit.align import Alignment
from moekit.grouped_gemm import (
    _dot_precision,
    _placed_rows,
    gemm2_weighted,
    gemm2_weighted_torch,
    moe_sum,
    moe_sum_torch,
    twin_dtype,
)
from moekit.kernels.grouped_gemm_backward import moe_swiglu_bwd_kernel, moe_tile_sum_kernel, moe_wgrad_kernel
from moekit.tuning import ExpertsConfig, WgradConfig, shared_memory_budget, wgrad_config

TILE_CAP = 64


@dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the backward kernels, derived from the forward's config (see the module docstring).

    Attributes:
        block_n, block_k, stages: the SwiGLU backward (columns of I, steps over H, pipeline depth).
    """

    block_n: int
    block_k: int
    stages: int

    @classmethod
    def fit(cls, cfg: ExpertsConfig, itemsize: int,
            device: torch.device | str | None = None) -> BackwardTiles:
        budget = shared_memory_budget(device)
        block_n, block_k, stages = min(cfg.block_n1, TILE_CAP), min(cfg.block_k1, TILE_CAP), cfg.stages1

        def pipeline_bytes() -> int:   # x and dout rows [BM, BK], gate, up and down [BK, BN]
            return stages * (2 * cfg.block_m * block_k + 3 * block_k * block_n) * itemsize

        while pipeline_bytes() > budget and (stages > 2 or block_k > 16):
            if stages > 2:
                stages -= 1
            else:
                block_k //= 2
        return cls(block_n, block_k, stages)


class SwigluGrads(NamedTuple):
    """dpre (L, 2I) and h (L, I) in the activations' dtype; topk_weights (S,) fp32. None if not asked."""

    dpre: torch.Tensor | None
    h: torch.Tensor | None
    topk_weights: torch.Tensor | None


def swiglu_backward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, dout: torch.Tensor,
                    align: Alignment, top_k: int, cfg: ExpertsConfig, *, want_dpre: bool = True,
                    want_h: bool = True, want_topk_weights: bool = True) -> SwigluGrads:
    """The fused SwiGLU backward: g = dout[t] @ down_e with a, b recomputed in the same loop over H."""
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    rows = align.sorted_ids.numel()
    dev, dtype = x.device, x.dtype
    tiles = BackwardTiles.fit(cfg, x.element_size(), dev)
    n_tiles = cdiv(inter, tiles.block_n)
    dpre = _workspace.empty(rows, two_i, dtype=dtype, device=dev) if want_dpre else None
    h = _workspace.empty(rows, inter, dtype=dtype, device=dev) if want_h else None
    part = _workspace.empty(rows, n_tiles, dtype=torch.float32, device=dev) if want_topk_weights else None
    dummy = x   # a pointer for the outputs not asked for; their stores are compiled out
    moe_swiglu_bwd_kernel[(align.max_blocks * n_tiles,)](
        x, dout, gate_up_proj, down_proj, dpre if want_dpre else dummy, h if want_h else dummy,
        part if want_topk_weights else dummy, align.sorted_ids, align.expert_ids, align.num_padded,
        align.num_pairs, inter, hidden, n_tiles,
        x.stride(0), x.stride(1), dout.stride(0), dout.stride(1), *gate_up_proj.stride(), *down_proj.stride(),
        *(dpre.stride() if want_dpre else (0, 0)), *(h.stride() if want_h else (0, 0)),
        part.stride(0) if want_topk_weights else 0,
        TOP_K=top_k, BLOCK_M=align.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=cfg.group_m,
        EVEN_K=hidden % tiles.block_k == 0, STORE_DPRE=want_dpre, STORE_H=want_h,
        STORE_PART=want_topk_weights, DOT_PRECISION=_dot_precision(dtype),
        num_warps=cfg.warps1, num_stages=tiles.stages,
    )
    dw = None
    if want_topk_weights:
        dw = torch.zeros(align.num_pairs, dtype=torch.float32, device=dev)   # pairs never placed: 0
        block_t = min(64, max(16, next_power_of_2(n_tiles)))
        moe_tile_sum_kernel[(align.max_blocks,)](
            part, dw, align.sorted_ids, align.num_padded, align.num_pairs, n_tiles, part.stride(0),
            BLOCK_M=align.block_m, BLOCK_T=block_t, num_warps=4,
        )
    return SwigluGrads(dpre, h, dw)


def hidden_states_grad(dpre: torch.Tensor, gate_up_proj: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, align: Alignment, cfg: ExpertsConfig) -> torch.Tensor:
    """dx (T, H): w_p * dpre[r] @ gate_up_e at each pair row, summed over the token's valid slots."""
    num_tokens, _ = topk_ids.shape
    y = gemm2_weighted(dpre, gate_up_proj.transpose(1, 2), topk_weights, align, cfg)
    dx = _workspace.empty(num_tokens, gate_up_proj.shape[2], dtype=dpre.dtype, device=dpre.device)
    return moe_sum(y, topk_ids, gate_up_proj.shape[0], dx)


def wgrad(a: torch.Tensor, b: torch.Tensor, topk_weights: torch.Tensor, align: Alignment, top_k: int,
          shape: tuple[int, int, int], dtype: torch.dtype, *, a_by_token: bool, b_by_token: bool,
          tiles: WgradConfig | None = None) -> torch.Tensor:
    """(E, N, C) in `dtype`: expert e's sum over its rows of (w_p A[ra])^T B[rb] (`moe_wgrad_kernel`),
    with `tiles` (default: `moekit.tuning.wgrad_config` for the wider operand's dtype and the device)."""
    tiles = tiles or wgrad_config(max(a.element_size(), b.element_size()), a.device)
    num_experts, n, c = shape
    grad = _workspace.empty(num_experts, n, c, dtype=dtype, device=a.device)
    n_tiles, c_tiles = cdiv(n, tiles.block_n), cdiv(c, tiles.block_c)
    moe_wgrad_kernel[(num_experts * n_tiles * c_tiles,)](
        a, b, topk_weights, grad, align.sorted_ids, align.row_starts(),
        align.num_pairs, n, c, n_tiles, c_tiles,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), *grad.stride(),
        TOP_K=top_k, A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c, NUM_STAGES=tiles.stages,
        DOT_PRECISION=_dot_precision(b.dtype), num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return grad


def down_proj_grad(dout: torch.Tensor, h: torch.Tensor, topk_weights: torch.Tensor, align: Alignment,
                   top_k: int, dtype: torch.dtype, tiles: WgradConfig | None = None) -> torch.Tensor:
    """(E, H, I): sum over each expert's rows of (w_p dout[t])^T h[r]; experts with no rows get 0."""
    shape = (align.tokens_per_expert.numel(), dout.shape[1], h.shape[1])
    return wgrad(dout, h, topk_weights, align, top_k, shape, dtype, a_by_token=True, b_by_token=False,
                 tiles=tiles)


def gate_up_proj_grad(dpre: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, align: Alignment,
                      top_k: int, dtype: torch.dtype, tiles: WgradConfig | None = None) -> torch.Tensor:
    """(E, 2I, H): sum over each expert's rows of (w_p dpre[r])^T x[t]; experts with no rows get 0."""
    shape = (align.tokens_per_expert.numel(), dpre.shape[1], x.shape[1])
    return wgrad(dpre, x, topk_weights, align, top_k, shape, dtype, a_by_token=False, b_by_token=True,
                 tiles=tiles)


def swiglu_backward_torch(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          dout: torch.Tensor, align: Alignment, top_k: int) -> SwigluGrads:
    """Twin of `swiglu_backward` in fp32: padding rows of dpre and h 0, unplaced pairs' weight grad 0."""
    acc = twin_dtype(x)
    inter = gate_up_proj.shape[1] // 2
    num_rows = align.sorted_ids.numel()
    dpre = torch.zeros(num_rows, 2 * inter, dtype=acc, device=x.device)
    h = torch.zeros(num_rows, inter, dtype=acc, device=x.device)
    dw = torch.zeros(align.num_pairs, dtype=acc, device=x.device)
    rows, pair, expert = _placed_rows(align)
    for e in expert.unique().tolist():
        sel = expert == e
        tok = pair[sel] // top_k
        a, b = (x[tok].to(acc) @ gate_up_proj[e].to(acc).T).chunk(2, dim=-1)
        g = dout[tok].to(acc) @ down_proj[e].to(acc)
        sig = torch.sigmoid(a)
        h[rows[sel]] = a * sig * b
        dpre[rows[sel]] = torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=-1)
        dw[pair[sel]] = (g * h[rows[sel]]).sum(-1)
    return SwigluGrads(dpre, h, dw)


def hidden_states_grad_torch(dpre: torch.Tensor, gate_up_proj: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, align: Alignment) -> torch.Tensor:
    """Twin of `hidden_states_grad` in fp32."""
    y = gemm2_weighted_torch(dpre, gate_up_proj.transpose(1, 2), topk_weights, align)
    return moe_sum_torch(y, topk_ids, gate_up_proj.shape[0])


def wgrad_torch(a: torch.Tensor, b: torch.Tensor, topk_weights: torch.Tensor, align: Alignment, top_k: int,
                *, a_by_token: bool, b_by_token: bool,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of `wgrad` in fp32 (`twin_dtype`); with `compute_dtype`, plain PyTorch in that dtype (the
    weights too): the same-dtype baseline of the error rule."""
    acc = compute_dtype or twin_dtype(a)
    num_experts = align.tokens_per_expert.numel()
    grad = torch.zeros(num_experts, a.shape[1], b.shape[1], dtype=acc, device=a.device)
    w = topk_weights.reshape(-1).to(acc)
    rows, pair, expert = _placed_rows(align)
    for e in expert.unique().tolist():
        sel = expert == e
        tok = pair[sel] // top_k
        a_rows = a[tok if a_by_token else rows[sel]].to(acc) * w[pair[sel], None]
        grad[e] = a_rows.T @ b[tok if b_by_token else rows[sel]].to(acc)
    return grad


def down_proj_grad_torch(dout: torch.Tensor, h: torch.Tensor, topk_weights: torch.Tensor, align: Alignment,
                         top_k: int) -> torch.Tensor:
    """Twin of `down_proj_grad` in fp32."""
    return wgrad_torch(dout, h, topk_weights, align, top_k, a_by_token=True, b_by_token=False)


def gate_up_proj_grad_torch(dpre: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                            align: Alignment, top_k: int) -> torch.Tensor:
    """Twin of `gate_up_proj_grad` in fp32."""
    return wgrad_torch(dpre, x, topk_weights, align, top_k, a_by_token=False, b_by_token=True)
