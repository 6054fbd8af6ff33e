"""Backward of the grouped GEMM family: launchers beside their pure-PyTorch twins (`*_torch`).

The forward (`moekit.grouped_gemm`) computes, for each pair p = t * K + k placed at sorted row r of
expert e: a, b = x[t] @ gate_e^T, x[t] @ up_e^T; h[r] = silu(a) * b; y_p = w_p * h[r] @ down_e^T;
out[t] = sum_k y_p. Given dout (T, H), with g[r] = dout[t] @ down_e (I):

    d topk_weights[p] = <g[r], h[r]>                                  (unscaled h)
    dpre_w[r]         = w_p * [g * b * silu'(a), g * silu(a)]         (2I; dpre scaled by w_p)
    h_w[r]            = w_p * h[r]
    d down_e          = sum over e's rows of dout[t]^T h_w[r]
    d gate_up_e       = sum over e's rows of dpre_w[r]^T x[t]
    dx[t]             = sum over t's valid slots of dpre_w[r] @ gate_up_e

a and b come from the forward: GEMM1 stores them beside h when a backward will need them
(`moekit.grouped_gemm.gemm1_swiglu_with_pre`, (L, 2I) in the input dtype), so the SwiGLU backward
runs one GEMM (g) instead of three; without them (`pre=None`: the custom op's backward, which has the
inputs alone) it recomputes a and b in the same loop over H. The routing weight is applied once, in
that kernel's fp32 epilogue (dpre_w and h_w each rounded once to the dtype), so the weight gradients
multiply their operand tiles as loaded and dx is GEMM2 without its routing-weight epilogue.

Launchers, in the order the autograd Function (`moekit.experts.triton`) calls them:

    swiglu_backward     dout, weights, pre (or x) -> dpre_w (L, 2I), h_w (L, I), d topk_weights (S,)
                        fp32 (one kernel, plus a tile-sum kernel for the weights)
    hidden_states_grad  dpre_w -> dx (T, H): the forward's GEMM2 with gate_up_e as the (H, 2I) matrix,
                        unweighted, then its slot sum
    gate_up_proj_grad   dpre_w, x -> (E, 2I, H);  down_proj_grad  dout, h_w -> (E, H, I)
                        (both `wgrad`, with their own tiles; given topk_weights, `wgrad` scales
                        the rows itself: d down from the forward's unscaled h, when only down_proj
                        needs a gradient and h is recomputed by GEMM1)

On Hopper (compute capability 9.x, Gluon available) the training step's weight gradients (unscaled,
padding_zero, bf16 / fp16, an align block size that is a multiple of 64) run the persistent warp-
specialized Gluon kernel instead (`moekit.grouped_gemm.gluon_wgrad`, `gluon_wgrad`). d gate_up reads
x copied into sorted-row order (`sorted_rows`: TMA needs contiguous rows, and the copy costs less
than a gather in the kernel). d down, up to `GATHER_A_ROWS` rows an expert, reads dout's token rows
itself (its producer gathers them by cp.async: no copy); with more rows it reads a copy of dout
made a column chunk at a time (`GLUON_A_CHUNKS`), so no whole copy is alive beside the weight
gradients. $MOEKIT_GLUON_WGRAD=0 turns the kernel off; `_gluon_wgrad_tiles` lists every condition.
So does the SwiGLU backward reading the saved pre-activations (`moekit.grouped_gemm.gluon_swiglu_bwd`,
`gluon_swiglu_backward`: a persistent warp-specialized wgmma kernel with ping-pong consumers whose
producer gathers dout's token rows by cp.async, down_proj's by TMA: no copy of dout);
$MOEKIT_GLUON_SWIGLU=0 turns it off, `_gluon_swiglu_tiles` lists the conditions.

Metadata: the forward's `Alignment` (sorted_ids (L,), expert_ids (L / block_m,), num_padded, and
`Alignment.row_starts()` (E + 1,) for the weight gradients). Every grid is sized from
(T, K, E, config) and `Alignment.max_blocks`; nothing is read back to the host. Rows of dpre_w and
h_w past num_padded are not written (nobody reads them); d topk_weights is 0 for pairs never placed
(ids outside [0, E)); every expert's weight gradient is written, exactly 0 for an expert with no
rows. No atomics anywhere: results are bitwise reproducible.

Tiles, until the backward has its own tuned table: dx reuses GEMM2 with the forward's GEMM2 tiles
(same operand tiles, so it fits wherever the forward does), without the forward's TMA and
persistent switches (dx reads gate_up_proj transposed). The SwiGLU backward (`BackwardTiles.fit`):
reading the saved pre-activations, tiles of its own by block_m (`saved_tiles`, two streamed tiles a step:
dout rows, down columns); recomputing, GEMM1's tiles capped at 64 (five streamed tiles: x and dout
rows, gate, up and down columns); then fewer stages, then halved block_k, until they fit the
device's shared-memory budget. The weight gradients have tiles of their own, independent of the forward's
and of the align block size (`moekit.tuning.WgradConfig`: the default fitted to the device, or
$MOEKIT_WGRAD_TILES, or `tiles=` on the launchers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from moekit import _workspace, env
from moekit._host import cdiv, next_power_of_2
from moekit._validation import interpreting
from moekit.align import Alignment
from moekit.grouped_gemm import (
    TMA_ALIGN,
    TMA_MAX_COORD,
    _dot_precision,
    _placed_rows,
    gemm2_weighted,
    gemm2_weighted_torch,
    moe_sum,
    moe_sum_torch,
    num_sms,
    twin_dtype,
)
from moekit.grouped_gemm import gluon_swiglu_bwd as _gluon_swiglu
from moekit.grouped_gemm import gluon_wgrad as _gluon
from moekit.grouped_gemm.backward_kernels import (
    moe_gather_rows_kernel,
    moe_swiglu_bwd_kernel,
    moe_tile_sum_kernel,
    moe_wgrad_kernel,
    moe_wgrad_range_kernel,
)
from moekit.launch_hints import capability_major, pdl_kwargs
from moekit.tuning import (
    WGRAD_ENV,
    ExpertsConfig,
    GluonSwigluTiles,
    GluonWgradTiles,
    WgradConfig,
    gluon_swiglu_tiles,
    gluon_wgrad_tiles,
    shared_memory_budget,
    shrink_to_fit,
    wgrad_config,
)

RECOMPUTE_TILE_CAP = 64     # the SwiGLU backward's block_n / block_k cap when it recomputes a, b


@dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the SwiGLU backward, derived from the forward's config (see the module docstring).

    Attributes:
        block_n, block_k, stages: columns of I, steps over H, pipeline depth.
        recompute: the kernel's RECOMPUTE (a, b recomputed from x: five streamed tiles a step), or
            False (a, b read from the saved pre-activations: two).
        warps: num_warps, or None for the forward's GEMM1 warps.
        pre_first: reading the saved pre-activations, load them before the loop over H (their
            latency hidden behind the GEMM, held in registers through it) instead of after it.
        halves: 2 (reading the saved pre-activations): a program computes 2 * block_n columns as
            two halves with an accumulator each, loading each dout row tile once for both (the
            kernel's HALVES), then the epilogue half by half.
    """

    block_n: int
    block_k: int
    stages: int
    recompute: bool = True
    warps: int | None = None
    pre_first: bool = False
    halves: int = 1

    def __post_init__(self) -> None:
        if self.halves not in (1, 2) or (self.halves == 2 and self.recompute):
            raise ValueError(f"BackwardTiles.halves must be 1, or 2 reading the saved pre-activations "
                             f"(recompute=False), got halves={self.halves!r}, recompute={self.recompute}")

    def label(self) -> str:
        """'n128 k64 s3 w8' ('w=' the forward's warps when None); 'r' ends a recomputing one."""
        warps = "=" if self.warps is None else self.warps
        return (f"n{self.block_n} k{self.block_k} s{self.stages} w{warps}" + (" r" if self.recompute else "")
                + (" pf" if self.pre_first else "") + (" h2" if self.halves == 2 else ""))

    def pipeline_bytes(self, block_m: int, itemsize: int) -> int:
        """Shared memory of the loop's streamed tiles: dout rows [BM, BK] and down columns [BK, BN]
        (one tile a half), and recomputing, x rows and gate and up columns too; `stages` buffers
        of each."""
        rows, cols = (2, 3) if self.recompute else (1, self.halves)
        return self.stages * (rows * block_m * self.block_k + cols * self.block_k * self.block_n) * itemsize

    @classmethod
    def fit(cls, cfg: ExpertsConfig, itemsize: int, device: torch.device | str | None = None, *,
            recompute: bool = True) -> BackwardTiles:
        """Recomputing: GEMM1's block_n1 x block_k1 capped at 64, stages1 and its warps. Reading the
        saved pre-activations: `saved_tiles` for the forward's block_m. Then stages dropped (down
        to 2), then block_k halved (down to 16), until the loop fits the budget."""
        budget = shared_memory_budget(device)
        if recompute:
            cap = RECOMPUTE_TILE_CAP
            tiles = cls(min(cfg.block_n1, cap), min(cfg.block_k1, cap), cfg.stages1, recompute)
        else:
            tiles = saved_tiles(cfg.block_m)
        return shrink_to_fit(tiles, lambda t: t.pipeline_bytes(cfg.block_m, itemsize), budget,
                             (("stages", 2), ("block_k", 16)))


# Reading the saved pre-activations (the training step's launch), by the forward's block_m: 64 x 64,
# 5 stages, 8 warps, the pre-activations loaded before the loop at 128 rows; 128 x 128, 4 stages at
# 64 rows (the fastest of the tile comparison at Qwen3-30B-A3B, bf16). At 128 rows
# narrow columns win although each dout row tile is read I / 64 times: the epilogue's fp32 tiles
# (g, a, b and what follows from them) stay small; at 64 rows the wider tile fits in registers.
SAVED_TILES = BackwardTiles(64, 64, 5, recompute=False, warps=8, pre_first=True)
SAVED_TILES_64 = BackwardTiles(128, 128, 4, recompute=False, warps=8, pre_first=True)


def saved_tiles(block_m: int) -> BackwardTiles:
    """The SwiGLU backward's tiles reading the saved pre-activations, for the forward's block_m:
    `SAVED_TILES` from 128 rows, `SAVED_TILES_64` below (chosen at 64)."""
    return SAVED_TILES if block_m >= 128 else SAVED_TILES_64


class SwigluGrads(NamedTuple):
    """dpre_w (L, 2I) and h_w (L, I), dpre and h scaled by each row's routing weight, in the
    activations' dtype; topk_weights (S,) fp32. None if not asked."""

    dpre_w: torch.Tensor | None
    h_w: torch.Tensor | None
    topk_weights: torch.Tensor | None


def swiglu_backward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, dout: torch.Tensor,
                    topk_weights: torch.Tensor, align: Alignment, top_k: int, cfg: ExpertsConfig, *,
                    pre: torch.Tensor | None = None, want_dpre: bool = True, want_h: bool = True,
                    want_topk_weights: bool = True, tiles: BackwardTiles | None = None) -> SwigluGrads:
    """The fused SwiGLU backward: g = dout[t] @ down_e, with a, b read from `pre` (L, 2I), the
    forward's [gate | up] pre-activations (`moekit.grouped_gemm.gemm1_swiglu_with_pre`), or, pre
    None, recomputed from x and gate_up_proj in the same loop over H. dpre_w and h_w are scaled by
    the routing weight (topk_weights (T, K), the forward's); d topk_weights is <g, h>. `tiles`
    (default `BackwardTiles.fit`) must match: recompute exactly when pre is None. On Hopper, reading
    pre with no tiles named, the Gluon kernel runs instead (`_gluon_swiglu_tiles` says when), its
    producer reading dout's token rows itself (no copy)."""
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    rows = align.sorted_ids.numel()
    dev, dtype = x.device, x.dtype
    recompute = pre is None
    if tiles is not None and tiles.recompute is not recompute:
        raise ValueError(f"tiles: recompute={tiles.recompute} but pre is {'None' if recompute else 'given'}")
    gluon_tiles = _gluon_swiglu_tiles(dout, down_proj, pre, align) if tiles is None else None
    if gluon_tiles is None and tiles is None:
        tiles = BackwardTiles.fit(cfg, x.element_size(), dev, recompute=recompute)
    n_tiles = inter // gluon_tiles.block_n if gluon_tiles else cdiv(inter, tiles.block_n)   # part's columns
    dpre = _workspace.empty(rows, two_i, dtype=dtype, device=dev) if want_dpre else None
    h = _workspace.empty(rows, inter, dtype=dtype, device=dev) if want_h else None
    part = _workspace.empty(rows, n_tiles, dtype=torch.float32, device=dev) if want_topk_weights else None
    if gluon_tiles is not None:
        gluon_swiglu_backward(dout, down_proj, pre, topk_weights, align, gluon_tiles, top_k, dpre=dpre, h=h,
                              part=part)
    else:
        _triton_swiglu_backward(x, gate_up_proj, down_proj, dout, pre, topk_weights, align, top_k, cfg, tiles,
                                dpre, h, part, n_tiles)
    dw = None
    if want_topk_weights:
        dw = torch.zeros(align.num_pairs, dtype=torch.float32, device=dev)   # pairs never placed: 0
        block_t = min(64, max(16, next_power_of_2(n_tiles)))
        moe_tile_sum_kernel[(align.max_blocks,)](
            part, dw, align.sorted_ids, align.num_padded, align.num_pairs, n_tiles, part.stride(0),
            BLOCK_M=align.block_m, BLOCK_T=block_t, num_warps=4, **pdl_kwargs(dev),
        )
    return SwigluGrads(dpre, h, dw)


def _triton_swiglu_backward(x, gate_up_proj, down_proj, dout, pre, topk_weights, align, top_k, cfg,
                            tiles: BackwardTiles, dpre, h, part, n_tiles: int) -> None:
    """`moe_swiglu_bwd_kernel` into dpre, h, part (None: not stored), part with n_tiles columns."""
    inter, hidden, dtype = down_proj.shape[2], gate_up_proj.shape[2], x.dtype
    recompute = pre is None
    want_dpre, want_h, want_topk_weights = dpre is not None, h is not None, part is not None
    dummy = x   # a pointer for the outputs (and pre) not given; their loads and stores are compiled out
    grid_tiles = cdiv(inter, tiles.block_n * tiles.halves)   # each program's columns
    moe_swiglu_bwd_kernel[(align.max_blocks * grid_tiles,)](
        x, dout, gate_up_proj, down_proj, dummy if recompute else pre, topk_weights.reshape(-1),
        dpre if want_dpre else dummy, h if want_h else dummy, part if want_topk_weights else dummy,
        align.sorted_ids, align.expert_ids, align.num_padded, align.num_pairs, inter, hidden, grid_tiles,
        n_tiles,
        x.stride(0), x.stride(1), dout.stride(0), dout.stride(1), *gate_up_proj.stride(), *down_proj.stride(),
        *((0, 0) if recompute else pre.stride()), *(dpre.stride() if want_dpre else (0, 0)),
        *(h.stride() if want_h else (0, 0)), part.stride(0) if want_topk_weights else 0,
        TOP_K=top_k, BLOCK_M=align.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=cfg.group_m,
        EVEN_K=hidden % tiles.block_k == 0, RECOMPUTE=recompute, STORE_DPRE=want_dpre, STORE_H=want_h,
        STORE_PART=want_topk_weights, DOT_PRECISION=_dot_precision(dtype), PRE_FIRST=tiles.pre_first,
        HALVES=tiles.halves,
        num_warps=tiles.warps or cfg.warps1, num_stages=tiles.stages,
    )


@functools.lru_cache(maxsize=64)
def _dx_config(cfg: ExpertsConfig) -> ExpertsConfig:
    """dx's GEMM2 config: the forward's, without TMA weights or a persistent grid (memoised: a
    dataclass replace at every backward is host time)."""
    return replace(cfg, tma_weights=False, persistent=False)


def hidden_states_grad(dpre_w: torch.Tensor, gate_up_proj: torch.Tensor, topk_ids: torch.Tensor,
                       align: Alignment, cfg: ExpertsConfig) -> torch.Tensor:
    """dx (T, H): dpre_w[r] @ gate_up_e at each pair row (GEMM2 without the routing weight: dpre_w
    carries it), summed over the token's valid slots."""
    num_tokens, _ = topk_ids.shape
    y = gemm2_weighted(dpre_w, gate_up_proj.transpose(1, 2), None, align, _dx_config(cfg))
    dx = _workspace.empty(num_tokens, gate_up_proj.shape[2], dtype=dpre_w.dtype, device=dpre_w.device)
    return moe_sum(y, topk_ids, gate_up_proj.shape[0], dx)


def wgrad(a: torch.Tensor, b: torch.Tensor, topk_weights: torch.Tensor | None, align: Alignment, top_k: int,
          shape: tuple[int, int, int], dtype: torch.dtype, *, a_by_token: bool, b_by_token: bool,
          tiles: WgradConfig | None = None, padding_zero: bool = False,
          row_starts: torch.Tensor | None = None) -> torch.Tensor:
    """(E, N, C) in `dtype`: expert e's sum over its rows of A[ra]^T B[rb], or with topk_weights
    (w_p A[ra])^T B[rb] (`moe_wgrad_kernel`, SCALE), with `tiles` (default:
    `moekit.tuning.wgrad_config` for the wider operand's dtype and the device). padding_zero: the
    sorted-row operand (the one not gathered by token) holds zeros on every padding row of each
    expert's group, as `swiglu_backward` writes dpre_w and h_w; its loads then need no index (the
    kernel's PADDING_ZERO). A nonzero padding row would be added to the gradient: only for those.
    With both operands in sorted-row order (neither by token: the other one copied there, finite on
    its padding rows), one holding zeros on them, the kernel reads no index at all.
    row_starts: `align.row_starts()`, when the caller has it (a backward's two launches share one).
    On Hopper the training step's launches take the Gluon kernel instead (`_gluon_wgrad_tiles` says
    when; $MOEKIT_GLUON_WGRAD=0 turns it off): a gathered B (d gate_up's x) copied into sorted-row
    order (`sorted_rows`), then `gluon_wgrad`; a gathered A (d down's dout) read by the kernel from
    its token rows up to GATHER_A_ROWS rows an expert, else copied a column chunk at a time through
    one buffer (`gluon_a_chunks`), one launch a chunk, for a lower peak."""
    if padding_zero and a_by_token and b_by_token:
        raise ValueError("padding_zero needs an operand in sorted-row order (not gathered by token)")
    gluon_tiles = _gluon_wgrad_tiles(a, b, topk_weights, align, shape, dtype, a_by_token=a_by_token,
                                     b_by_token=b_by_token, tiles=tiles, padding_zero=padding_zero)
    if gluon_tiles is not None:
        row_starts = align.row_starts() if row_starts is None else row_starts
        grad = _workspace.empty(*shape, dtype=dtype, device=a.device)
        if not a_by_token:
            b = sorted_rows(b, align, top_k) if b_by_token else b
            return gluon_wgrad(a, b, row_starts, grad, gluon_tiles)
        if gathers_a(align.num_pairs, shape[0]):
            return gluon_wgrad(a, b, row_starts, grad, gluon_tiles, gather_a=(align, top_k))
        # A by token (d down's dout): copied and reduced a column chunk at a time through one
        # buffer, so the copy held beside both weight gradients is 1 / chunks of dout's rows.
        width = shape[1] // gluon_a_chunks(shape[1], gluon_tiles)
        buf = None
        for n0 in range(0, shape[1], width):
            buf = sorted_rows(a[:, n0:n0 + width], align, top_k, out=buf)
            gluon_wgrad(buf, b, row_starts, grad, gluon_tiles, n_base=n0)
        return grad
    tiles = tiles or wgrad_config(max(a.element_size(), b.element_size()), a.device,
                                  rows_per_expert=align.num_pairs / shape[0])
    num_experts, n, c = shape
    grad = _workspace.empty(num_experts, n, c, dtype=dtype, device=a.device)
    n_tiles, c_tiles = cdiv(n, tiles.block_n), cdiv(c, tiles.block_c)
    scale = topk_weights is not None
    row_starts = align.row_starts() if row_starts is None else row_starts
    range_rows = _range_rows(tiles, align, scale)
    if range_rows:
        experts = min(tiles.experts, num_experts)
        moe_wgrad_range_kernel[(cdiv(num_experts, experts) * n_tiles * c_tiles,)](
            a, b, grad, align.sorted_ids, align.expert_ids, row_starts,
            align.num_pairs, num_experts, n, c, n_tiles, c_tiles,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), *grad.stride(),
            TOP_K=top_k, A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token,
            BLOCK_M=range_rows, BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c,
            ALIGN_M=align.block_m, EXPERTS=experts, EXPERTS_POW2=next_power_of_2(experts),
            NUM_STAGES=tiles.stages,
            DOT_PRECISION=_dot_precision(b.dtype), PADDING_ZERO=padding_zero,
            num_warps=tiles.warps, num_stages=tiles.stages,
            **({} if RANGE_MAX_REGS is None else {"maxnreg": RANGE_MAX_REGS}),
        )
        return grad
    moe_wgrad_kernel[(num_experts * n_tiles * c_tiles,)](
        a, b, topk_weights.reshape(-1) if scale else a, grad, align.sorted_ids,
        row_starts, align.num_pairs, n, c, n_tiles, c_tiles,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), *grad.stride(),
        TOP_K=top_k, A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c, NUM_STAGES=tiles.stages,
        DOT_PRECISION=_dot_precision(b.dtype), SCALE=scale, PADDING_ZERO=padding_zero,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return grad


# For variant comparisons: a register cap (ptxas .maxnreg) on the range kernel, e.g. 128 so that two
# 8-warp programs fit one SM. Read at each launch.
RANGE_MAX_REGS: int | None = None


def _range_rows(tiles: WgradConfig, align: Alignment, scaled: bool) -> int:
    """The rows a step of `moe_wgrad_range_kernel` when the call takes it, else 0: tiles.experts > 1,
    unscaled, and an align block size that is a power of two >= 16; its steps are tiles.block_m rows
    or the block size where that is smaller (a step may not cross a block)."""
    block = align.block_m
    if tiles.experts == 1 or scaled or block < 16 or block & (block - 1):
        return 0
    return min(tiles.block_m, block)


# The Gluon weight gradient copies a by-token A operand (d down's dout, (T, H)) into sorted rows in this
# many column chunks, one buffer reused: the copy alive beside every weight gradient sets the step's
# peak; each further chunk costs a gather and a kernel launch.
GLUON_A_CHUNKS = 4
# Up to this many rows an expert (on average) the kernel gathers dout's token rows itself instead: a
# work item is then about one step, bound by its stores, so gathering costs what copying does and no
# copy is made. With more rows the cp.async producer feeds the wgmma more slowly than TMA reads a copy.
GATHER_A_ROWS = 64


def gathers_a(num_pairs: int, num_experts: int) -> bool:
    """Whether the Gluon weight gradient reads a by-token A operand (d down's dout) from its token rows
    itself, rather than from a copy: up to GATHER_A_ROWS rows an expert."""
    return num_pairs <= GATHER_A_ROWS * num_experts


def gluon_a_chunks(n: int, tiles: GluonWgradTiles) -> int:
    """The column chunks of a by-token A operand with N columns: GLUON_A_CHUNKS where each chunk is
    a whole number of tiles.block_n, else 1."""
    chunks = max(GLUON_A_CHUNKS, 1)
    return chunks if n % (chunks * tiles.block_n) == 0 else 1


GLUON_WGRAD_ENV = "MOEKIT_GLUON_WGRAD"     # "0": `wgrad` never takes the Gluon kernel (read at each call)
GLUON_WGRAD_DTYPES = (torch.bfloat16, torch.float16)


def _tma_operand(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover t as it lies: 2-D, unit last stride, 16-byte aligned base
    and row stride, rows within int32 coordinates."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % TMA_ALIGN == 0
            and t.data_ptr() % TMA_ALIGN == 0 and t.shape[0] < TMA_MAX_COORD)


def _sm90(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x (cached), not interpreted: what the Gluon kernel is
    compiled for (its wgmma instructions are sm_90's alone)."""
    if device.type != "cuda" or interpreting():
        return False
    return capability_major(device.index if device.index is not None else torch.cuda.current_device()) == 9


def _gluon_wgrad_tiles(a: torch.Tensor, b: torch.Tensor, topk_weights: torch.Tensor | None,
                       align: Alignment, shape: tuple[int, int, int], dtype: torch.dtype, *,
                       a_by_token: bool, b_by_token: bool, tiles: WgradConfig | None,
                       padding_zero: bool) -> GluonWgradTiles | None:
    """The Gluon kernel's tiles (`moekit.tuning.gluon_wgrad_tiles`, by rows per expert) when `wgrad`
    takes it, else None. It takes it when all of these hold (host values only: no sync):

        $MOEKIT_GLUON_WGRAD is not "0", and this Triton has Gluon
        a CUDA device of compute capability 9.x, not interpreted (`_sm90`)
        no Triton tiles asked for: `tiles` None and $MOEKIT_WGRAD_TILES unset (those pin them)
        unscaled (topk_weights None), padding_zero, not both operands by token
        a and b of one dtype, bf16 or fp16, and the gradient's dtype the same
        the align block size a multiple of the tiles' rows a step (64)
        the tiles dividing N and C (a gathering launch's own, else the rows'); E * N rows within
        TMA's int32 coordinates
        a and b 2-D; each sorted-row operand TMA-readable as it lies (`_tma_operand`; a gathered
        one is copied into a fresh buffer first)
    """
    if not env.flag(GLUON_WGRAD_ENV) or not _gluon.GLUON_AVAILABLE:
        return None
    if not _sm90(a.device):
        return None
    if tiles is not None or env.text(WGRAD_ENV):
        return None
    if topk_weights is not None or not padding_zero or (a_by_token and b_by_token):
        return None
    if a.dtype not in GLUON_WGRAD_DTYPES or b.dtype != a.dtype or dtype != a.dtype:
        return None
    num_experts, n, c = shape
    if num_experts == 0 or a.dim() != 2 or b.dim() != 2 or a.shape[1] != n or b.shape[1] != c:
        return None
    rows = align.num_pairs / num_experts
    # a launch gathering A's rows prefers its own tiles; where they do not divide N and C, the rows' tiles
    wanted = (gluon_wgrad_tiles(rows, gathers_a=a_by_token and gathers_a(align.num_pairs, num_experts)),
              gluon_wgrad_tiles(rows))
    fits = [t for t in wanted if not (align.block_m % t.block_m or n % t.block_n or c % t.block_c)]
    gluon_tiles = fits[0] if fits else None
    if gluon_tiles is None or num_experts * n >= TMA_MAX_COORD:
        return None
    if not ((a_by_token or _tma_operand(a)) and (b_by_token or _tma_operand(b))):
        return None
    return gluon_tiles


@functools.lru_cache(maxsize=32)
def _gluon_layout(block: tuple[int, int], dtype: torch.dtype):
    gl = _gluon.gl
    return gl.NVMMASharedLayout.get_default_for(list(block), {torch.bfloat16: gl.bfloat16,
                                                              torch.float16: gl.float16,
                                                              torch.float8_e4m3fn: gl.float8e4nv}[dtype])


def _gluon_descriptor(t: torch.Tensor, block: tuple[int, int]):
    return _gluon.GluonTensorDescriptor.from_tensor(t, list(block), _gluon_layout(block, t.dtype))


def gluon_wgrad(a: torch.Tensor, b: torch.Tensor, row_starts: torch.Tensor, out: torch.Tensor,
                tiles: GluonWgradTiles, *, n_base: int = 0,
                gather_a: tuple[Alignment, int] | None = None) -> torch.Tensor:
    """out (E, N, C) = per expert e, a[rows_e]^T @ b[rows_e] in out's dtype (fp32 accumulation),
    rows_e = [row_starts[e], row_starts[e + 1]) (`gluon_wgrad_kernel`, persistent: one program an
    SM). a (L, Na) and b (L, C) in sorted-row order, bf16 or fp16, TMA-readable; zeros on every
    padding row in one, finite values in the other; row_starts int32 (E + 1,), multiples of
    tiles.block_m; out contiguous. a's columns are out's N rows [n_base, n_base + Na) (a column
    chunk of the whole A; Na = N and n_base 0 for all of it); tiles.block_n divides Na and n_base,
    tiles.block_c divides C. gather_a (align, top_k): a is by token instead, (T, N), its rows read
    through align.sorted_ids // top_k by the kernel's producer (zeros on the padding rows; n_base
    0). `wgrad` checks all this first (`_gluon_wgrad_tiles`); experts with no rows get exact zeros."""
    num_experts, n, c = out.shape
    n_a = a.shape[1]
    if (b.shape[1] != c or n_a % tiles.block_n or n_base % tiles.block_n or c % tiles.block_c
            or not 0 <= n_base <= n - n_a or (gather_a is not None and n_a != n)):
        raise ValueError(f"gluon_wgrad: a {tuple(a.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, "
                         f"n_base {n_base} with {tiles.label()} tiles: need a (L, Na), b (L, C), "
                         f"0 <= n_base <= N - Na, tiles dividing Na, n_base and C; a gathered A whole")
    if not (a.dtype == b.dtype == out.dtype and a.dtype in GLUON_WGRAD_DTYPES and out.is_contiguous()):
        raise ValueError(f"gluon_wgrad: a, b, out must share a 16-bit dtype ({a.dtype}, {b.dtype}, "
                         f"{out.dtype}), out contiguous")
    acc_n = tiles.block_n if tiles.pingpong else tiles.block_n // 2    # a warpgroup's rows (A box width)
    a_box, b_box = (tiles.block_m, acc_n), (tiles.block_m, tiles.block_c)
    gather = gather_a is not None
    align, top_k = gather_a if gather else (None, 1)
    a = _gather_operand(a) if gather else a
    # The store rows e * N + n (n < Na) of a view starting n_base rows in: out's rows e * N + n_base + n.
    c_desc = _gluon_descriptor(out.view(num_experts * n, c)[n_base:], (acc_n, tiles.block_c))
    c_tiles = c // tiles.block_c
    tiles_per_expert = (n_a // tiles.block_n) * c_tiles
    num_items = num_experts * tiles_per_expert
    regs = ((_gluon.GATHER_PRODUCER_REGS, _gluon.GATHER_CONSUMER_REGS) if gather
            else (_gluon.PRODUCER_REGS, _gluon.CONSUMER_REGS))
    _gluon.gluon_wgrad_kernel[(min(num_sms(a.device), num_items),)](
        None if gather else _gluon_descriptor(a, a_box), _gluon_descriptor(b, b_box),
        c_desc, row_starts, num_items, tiles_per_expert, c_tiles, n,
        a, a.stride(0), align.sorted_ids if gather else row_starts, align.num_pairs if gather else 0,
        A_LAYOUT=_gluon_layout(a_box, a.dtype), B_LAYOUT=_gluon_layout(b_box, b.dtype), A_W=acc_n,
        BK=tiles.block_m, STAGES=tiles.stages, PINGPONG=tiles.pingpong, PRODUCER_REGS=regs[0],
        CONSUMER_REGS=regs[1], GATHER_A=gather, TOP_K=top_k, num_warps=4, maxnreg=_gluon.MAX_REGS,
    )
    return out


def _gather_operand(t: torch.Tensor) -> torch.Tensor:
    """t as the kernel's row gather reads it (16-byte copies: unit column stride, row stride and
    base 16-byte aligned), else a contiguous copy (e.g. an expanded dout)."""
    aligned = (t.stride(0) * t.element_size()) % TMA_ALIGN == 0 and t.data_ptr() % TMA_ALIGN == 0
    if t.stride(1) == 1 and aligned:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


GLUON_SWIGLU_ENV = "MOEKIT_GLUON_SWIGLU"   # "0": `swiglu_backward` never takes the Gluon kernel (each call)


def _gluon_swiglu_tiles(dout: torch.Tensor, down_proj: torch.Tensor, pre: torch.Tensor | None,
                        align: Alignment) -> GluonSwigluTiles | None:
    """The Gluon SwiGLU backward's tiles (`moekit.tuning.gluon_swiglu_tiles`, by I) when
    `swiglu_backward` takes it, else None. It takes it when all of these hold (host values only: no
    sync; the caller asked for no Triton tiles):

        $MOEKIT_GLUON_SWIGLU is not "0", and this Triton has Gluon
        a CUDA device of compute capability 9.x, not interpreted (`_sm90`)
        the saved pre-activations given (pre (>= L, 2I): the training step's launch)
        dout, pre and down_proj of one dtype, bf16 or fp16
        the align block size a multiple of the tiles' 64 rows; at least one sorted row
        H a multiple of 64 with more ring steps than PRE_STEP; tiles dividing I
        down_proj contiguous, E * H rows within TMA's int32 coordinates; pre TMA-readable as it lies
    """
    if pre is None or not env.flag(GLUON_SWIGLU_ENV):
        return None
    if not _gluon.GLUON_AVAILABLE:
        return None
    if not _sm90(dout.device):
        return None
    if dout.dtype not in GLUON_WGRAD_DTYPES or not (pre.dtype == down_proj.dtype == dout.dtype):
        return None
    num_experts, hidden, inter = down_proj.shape
    rows = align.sorted_ids.numel()
    tiles = gluon_swiglu_tiles(inter)
    if tiles is None or rows == 0 or align.block_m % tiles.block_m or dout.dim() != 2:
        return None
    if hidden % tiles.block_k or hidden // tiles.block_k <= _gluon_swiglu.PRE_STEP:
        return None
    if not down_proj.is_contiguous() or not _tma_operand(down_proj.view(num_experts * hidden, inter)):
        return None
    if pre.dim() != 2 or pre.shape[0] < rows or pre.shape[1] != 2 * inter or not _tma_operand(pre):
        return None
    return tiles


def gluon_swiglu_backward(dout: torch.Tensor, down_proj: torch.Tensor, pre: torch.Tensor,
                          topk_weights: torch.Tensor, align: Alignment, tiles: GluonSwigluTiles,
                          top_k: int, *, dpre: torch.Tensor | None, h: torch.Tensor | None,
                          part: torch.Tensor | None) -> None:
    """dpre (L, 2I), h (L, I), part (L, I / tiles.block_n) fp32 of the rows < num_padded, each None
    when not wanted (`gluon_swiglu_bwd_kernel`, persistent: one program an SM): dout (T, H) by token,
    its rows read by the kernel's producer at sorted_ids // top_k (no sorted copy); pre the saved
    (>= L, 2I) pre-activations, topk_weights (T, K) contiguous. `swiglu_backward` checks the rest
    first (`_gluon_swiglu_tiles`)."""
    num_experts, hidden, inter = down_proj.shape
    rows = align.sorted_ids.numel()
    n_tiles = inter // tiles.block_n
    if dout.dim() != 2 or dout.shape[1] != hidden or (part is not None and part.shape != (rows, n_tiles)):
        raise ValueError(f"gluon_swiglu_backward: dout {tuple(dout.shape)} and part "
                         f"{None if part is None else tuple(part.shape)} must be (T, {hidden}) and "
                         f"({rows}, {n_tiles})")
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    dout = _gather_operand(dout)
    pre_desc = _gluon_descriptor(pre, (bm, bn))
    items = cdiv(rows, bm) * n_tiles            # a bound: num_padded is on the device
    _gluon_swiglu.gluon_swiglu_bwd_kernel[(max(1, min(num_sms(pre.device), items)),)](
        _gluon_descriptor(down_proj.view(num_experts * hidden, inter), (bk, bn)),
        pre_desc,
        pre_desc if dpre is None else _gluon_descriptor(dpre, (bm, bn)),     # not stored when None
        pre_desc if h is None else _gluon_descriptor(h, (bm, bn)),
        pre if part is None else part, topk_weights.reshape(-1), align.sorted_ids, align.expert_ids,
        align.num_padded, align.num_pairs, hidden, inter, n_tiles, dout, dout.stride(0),
        A_LAYOUT=_gluon_layout((bm, bk), dout.dtype), BK=bk, ALIGN_M=align.block_m, STAGES=tiles.stages,
        PRE_STEP_=_gluon_swiglu.PRE_STEP, STORE_DPRE=dpre is not None, STORE_H=h is not None,
        STORE_PART=part is not None, PRODUCER_REGS=tiles.producer_regs, CONSUMER_REGS=tiles.consumer_regs,
        TOP_K=top_k, num_warps=4,
        maxnreg=_gluon.MAX_REGS,     # the same register cap as the weight gradient's launch
    )


GATHER_BLOCK_R, GATHER_BLOCK_C = 32, 256     # `moe_gather_rows_kernel`'s tile: rows by columns


def sorted_rows(t: torch.Tensor, align: Alignment, top_k: int, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """(L, C): t's token rows (T, C) copied into sorted-row order (`moe_gather_rows_kernel`, into
    `out` when given, (L, C) of t's dtype, else a workspace buffer): t[sorted_ids[r] // K] at each
    placed row r < num_padded and 0 on the padding rows; rows at or past num_padded are not written.
    A gathered weight-gradient operand in the order of the other one, so `wgrad` can read both with
    no index. No host sync."""
    rows, cols = align.sorted_ids.numel(), t.shape[1]
    if out is None:
        out = _workspace.empty(rows, cols, dtype=t.dtype, device=t.device)
    elif out.shape != (rows, cols) or out.dtype != t.dtype or out.device != t.device:
        raise ValueError(f"sorted_rows: out must be ({rows}, {cols}) {t.dtype} on {t.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if rows and cols:
        moe_gather_rows_kernel[(cdiv(rows, GATHER_BLOCK_R), cdiv(cols, GATHER_BLOCK_C))](
            t, out, align.sorted_ids, align.num_padded, align.num_pairs, cols, t.stride(0), t.stride(1),
            out.stride(0), out.stride(1), TOP_K=top_k, BLOCK_R=GATHER_BLOCK_R, BLOCK_C=GATHER_BLOCK_C,
            num_warps=4, **pdl_kwargs(t.device),
        )
    return out


def sorted_rows_torch(t: torch.Tensor, align: Alignment, top_k: int) -> torch.Tensor:
    """Twin of `sorted_rows` (torch ops, no host sync), every row written: t[sorted_ids[r] // K] at
    each placed row r and 0 on every other row."""
    tok = torch.clamp(align.sorted_ids // top_k, min=0, max=max(t.shape[0] - 1, 0)).long()
    placed = (align.sorted_ids < align.num_pairs).unsqueeze(1)
    return torch.where(placed, t[tok], torch.zeros((), dtype=t.dtype, device=t.device))


def down_proj_grad(dout: torch.Tensor, h: torch.Tensor, topk_weights: torch.Tensor | None, align: Alignment,
                   top_k: int, dtype: torch.dtype, tiles: WgradConfig | None = None, *,
                   padding_zero: bool = False, row_starts: torch.Tensor | None = None) -> torch.Tensor:
    """(E, H, I): sum over each expert's rows of dout[t]^T h[r], h being h_w (already scaled:
    topk_weights None) or the unscaled h with topk_weights, (w_p dout[t])^T h[r]; experts with no
    rows get 0."""
    shape = (align.tokens_per_expert.numel(), dout.shape[1], h.shape[1])
    return wgrad(dout, h, topk_weights, align, top_k, shape, dtype, a_by_token=True,
                 b_by_token=False, tiles=tiles, padding_zero=padding_zero, row_starts=row_starts)


def gate_up_proj_grad(dpre: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor | None,
                      align: Alignment, top_k: int, dtype: torch.dtype,
                      tiles: WgradConfig | None = None, *, padding_zero: bool = False,
                      row_starts: torch.Tensor | None = None) -> torch.Tensor:
    """(E, 2I, H): sum over each expert's rows of dpre[r]^T x[t], dpre being dpre_w (already scaled:
    topk_weights None) or, with topk_weights, (w_p dpre[r])^T x[t]; experts with no rows get 0."""
    shape = (align.tokens_per_expert.numel(), dpre.shape[1], x.shape[1])
    return wgrad(dpre, x, topk_weights, align, top_k, shape, dtype, a_by_token=False, b_by_token=True,
                 tiles=tiles, padding_zero=padding_zero, row_starts=row_starts)


def swiglu_backward_torch(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          dout: torch.Tensor, topk_weights: torch.Tensor, align: Alignment, top_k: int, *,
                          pre: torch.Tensor | None = None,
                          compute_dtype: torch.dtype | None = None) -> SwigluGrads:
    """Twin of `swiglu_backward` in fp32 (a, b from `pre` when given, else x @ gate_up_e^T): padding
    rows of dpre_w and h_w 0, unplaced pairs' weight grad 0. With `compute_dtype`, plain PyTorch in
    that dtype: the same-dtype baseline of the error rule."""
    acc = compute_dtype or twin_dtype(x)
    inter = gate_up_proj.shape[1] // 2
    num_rows = align.sorted_ids.numel()
    dpre = torch.zeros(num_rows, 2 * inter, dtype=acc, device=x.device)
    h = torch.zeros(num_rows, inter, dtype=acc, device=x.device)
    dw = torch.zeros(align.num_pairs, dtype=acc, device=x.device)
    w = topk_weights.reshape(-1).to(acc)
    rows, pair, expert = _placed_rows(align)
    for e in expert.unique().tolist():
        sel = expert == e
        tok = pair[sel] // top_k
        pre_e = x[tok].to(acc) @ gate_up_proj[e].to(acc).T if pre is None else pre[rows[sel]].to(acc)
        a, b = pre_e.chunk(2, dim=-1)
        g = dout[tok].to(acc) @ down_proj[e].to(acc)
        sig = torch.sigmoid(a)
        h_e = a * sig * b
        w_e = w[pair[sel], None]
        dw[pair[sel]] = (g * h_e).sum(-1)
        h[rows[sel]] = w_e * h_e
        dpre[rows[sel]] = w_e * torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=-1)
    return SwigluGrads(dpre, h, dw)


def hidden_states_grad_torch(dpre_w: torch.Tensor, gate_up_proj: torch.Tensor, topk_ids: torch.Tensor,
                             align: Alignment) -> torch.Tensor:
    """Twin of `hidden_states_grad` in fp32."""
    y = gemm2_weighted_torch(dpre_w, gate_up_proj.transpose(1, 2), None, align)
    return moe_sum_torch(y, topk_ids, gate_up_proj.shape[0])


def wgrad_torch(a: torch.Tensor, b: torch.Tensor, topk_weights: torch.Tensor | None, align: Alignment,
                top_k: int, *, a_by_token: bool, b_by_token: bool,
                compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Twin of `wgrad` in fp32 (`twin_dtype`; topk_weights None: no scale); with `compute_dtype`,
    plain PyTorch in that dtype (the weights too): the same-dtype baseline of the error rule."""
    acc = compute_dtype or twin_dtype(a)
    num_experts = align.tokens_per_expert.numel()
    grad = torch.zeros(num_experts, a.shape[1], b.shape[1], dtype=acc, device=a.device)
    w = None if topk_weights is None else topk_weights.reshape(-1).to(acc)
    rows, pair, expert = _placed_rows(align)
    for e in expert.unique().tolist():
        sel = expert == e
        tok = pair[sel] // top_k
        a_rows = a[tok if a_by_token else rows[sel]].to(acc)
        if w is not None:
            a_rows = a_rows * w[pair[sel], None]
        grad[e] = a_rows.T @ b[tok if b_by_token else rows[sel]].to(acc)
    return grad


def down_proj_grad_torch(dout: torch.Tensor, h: torch.Tensor, topk_weights: torch.Tensor | None,
                         align: Alignment, top_k: int) -> torch.Tensor:
    """Twin of `down_proj_grad` in fp32."""
    return wgrad_torch(dout, h, topk_weights, align, top_k, a_by_token=True, b_by_token=False)


def gate_up_proj_grad_torch(dpre: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor | None,
                            align: Alignment, top_k: int) -> torch.Tensor:
    """Twin of `gate_up_proj_grad` in fp32."""
    return wgrad_torch(dpre, x, topk_weights, align, top_k, a_by_token=False, b_by_token=True)
