"""Masked layout family (DeepGEMM's decode layout): grouped GEMMs over (E, C, *) buffers whose
per-expert row counts stay on the device, and the dispatch / combine that build and read it.

    masked_experts   x_masked (E, C, H), counts (E,) -> GEMM1 + SwiGLU -> h (E, C, I)
                     -> GEMM2 (* optional row weight) -> y (E, C, H)
    masked_layout    topk_ids (T, K) -> MaskedLayout (each pair's row in the (E * C) buffer, counts):
                     one single-program kernel on CUDA (`layout_path_for`), twin `masked_layout_torch`
    masked_dispatch  x (T, H) -> x_masked (E, C, H)         (DeepEP's low-latency dispatch, one GPU)
    masked_combine   y (E, C, H), topk_weights (T, K) -> (T, H), fp32 weighted sum in slot order
    masked_moe       the four in a row after the layout: x (T, H) -> (T, H) (the `masked` backend)

`masked_experts` and `masked_moe` also take block-scaled FP8 weights (`moekit.quant.Fp8Weight`, w8a8):
GEMM1 quantizes x's rows per 128 channels as it loads them and h per 128 columns in its epilogue
(`masked_gemm1_swiglu_fp8`), GEMM2 reads the quantized h (`masked_gemm2_fp8`); twin
`masked_experts_fp8_torch`.

Expert e owns rows [0, counts[e]) of its C rows; the kernels read and write only those (programs
past a count exit at once), so the host never needs the counts: one graph-capturable launch per GEMM
whatever the routing. Rows at or past a count are never read, and are left unwritten in the outputs.
A DeepEP low-latency dispatch output (recv_x, recv_count) feeds `masked_experts` directly.

Each launcher (checks done by the caller, buffers allocated here, grid fixed by (E, C, tiles)) sits
beside its pure-PyTorch twin (`*_torch`, fp32, rows past a count 0); @triton.jit code is in
`moekit.masked.kernels`. Legend: T tokens, K top_k, S = T * K pairs, E experts, C capacity (rows per
expert), H hidden, I intermediate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit._paths import PathSwitch
from moekit._validation import (
    FLOAT_DTYPES,
    ID_DTYPES,
    MAX_TRITON_EXPERTS,
    check_out,
    check_shape,
    check_tensor,
    check_triton_device,
)
from moekit.align import sort_pairs
from moekit.grouped_gemm import _dot_precision
from moekit.masked.kernels import (
    masked_combine_kernel,
    masked_dispatch_kernel,
    masked_gemm1_swiglu_fp8_kernel,
    masked_gemm1_swiglu_kernel,
    masked_gemm2_fp8_kernel,
    masked_gemm2_kernel,
    masked_layout_kernel,
)
from moekit.quant import (
    FP8_BLOCK,
    FP8_DTYPE,
    INFERENCE_ONLY,
    Fp8Weight,
    check_fp8_scales,
    check_fp8_weight,
    check_inference,
    dequantize_rows,
    fp8_inputs,
    quantize_rows_torch,
)
from moekit.shapes import MoEShape
from moekit.tuning import (
    ExpertsConfig,
    check_config_type,
    check_fp8_config,
    default_config,
    fp8_tiles,
    pipeline_bytes,
    shared_memory_budget,
    shrink_to_fit,
)

MAX_GRID = 2**31 - 1     # CUDA's limit on a grid's x dimension
LAYOUT_TILE = 4096       # elements of the layout kernel's (BLOCK_P, BLOCK_E) one-hot tile
_layout_switch = PathSwitch("MOEKIT_LAYOUT")     # MOEKIT_LAYOUT_TORCH / MOEKIT_LAYOUT_TRITON


@dataclass(frozen=True)
class MaskedLayout:
    """Where each token-expert pair sits in the masked (E, C, *) layout. Sizes follow (T, K, E, C).

    Attributes:
        dest: int64 (S,), pair p's flat row e * C + r in the (E * C) buffer (r = its rank among
            expert e's pairs, in pair order), or -1 for a pair not placed: an id outside [0, E),
            or a rank at or past C (dropped).
        counts: int32 (E,), rows in use per expert: min(pairs routed to e, C).
        dropped: int64 0-d device tensor, pairs with an id in [0, E) and a rank >= C.
        capacity: C.
    """

    dest: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor
    capacity: int


def layout_path_for(topk_ids: torch.Tensor, num_experts: int) -> str:
    """"triton" or "torch": which implementation `masked_layout` runs for these ids. As the EP steps'
    (`moekit._paths`): the kernel on CUDA tensors, the twin on CPU tensors, unless
    MOEKIT_LAYOUT_TORCH=1 (the twin everywhere) or MOEKIT_LAYOUT_TRITON=1 (the kernel on CPU tensors
    too, interpreted: TRITON_INTERPRET=1, the tests); `use_layout_path` overrides both in a block.
    More than MAX_TRITON_EXPERTS experts always take the twin (the kernel's (BP, E) tile)."""
    return "torch" if num_experts > MAX_TRITON_EXPERTS else _layout_switch.path_for(topk_ids)


def use_layout_path(path: str) -> contextlib.AbstractContextManager[None]:
    """Run `masked_layout` with `path` ("auto", "torch" or "triton") inside the block."""
    return _layout_switch.use(path)


def masked_layout(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> MaskedLayout:
    """The masked layout of (T, K) ids with C = capacity rows per expert, no host sync: one kernel
    launch (`masked_layout_triton`) or its torch twin (`masked_layout_torch`), by `layout_path_for`.
    Both give the same integers: pairs placed in pair order, the first C of each expert kept."""
    if layout_path_for(topk_ids, num_experts) == "triton":
        return masked_layout_triton(topk_ids, num_experts, capacity)
    return masked_layout_torch(topk_ids, num_experts, capacity)


def masked_layout_torch(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> MaskedLayout:
    """Twin of `masked_layout_triton` in torch ops (~25 small ops). A pair's rank in its expert is
    `moekit.align.sort_pairs(...).ranks()`, as the padded backend's."""
    pairs = sort_pairs(topk_ids, num_experts)
    rank = pairs.ranks()
    kept = pairs.valid & (rank < capacity)
    dest = torch.where(kept, pairs.key * capacity + rank, -1)
    counts = pairs.counts[:num_experts].clamp(max=capacity).to(torch.int32)
    return MaskedLayout(dest, counts, (pairs.valid & ~kept).sum(), capacity)


def masked_layout_triton(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> MaskedLayout:
    """`masked_layout` in one launch of `masked_layout_kernel` (a single program, the pairs in
    blocks in pair order, a carried per-expert counter): dest, counts and dropped all written by it."""
    check_triton_device("topk_ids", topk_ids)
    if num_experts > MAX_TRITON_EXPERTS:
        raise ValueError(f"the layout kernel supports num_experts <= {MAX_TRITON_EXPERTS}, got {num_experts}")
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs, dev = ids.numel(), ids.device
    dest = _workspace.empty(num_pairs, dtype=torch.int64, device=dev)
    counts = _workspace.empty(num_experts, dtype=torch.int32, device=dev)
    dropped = _workspace.empty(dtype=torch.int64, device=dev)
    block_e = next_power_of_2(max(num_experts, 1))
    block_p = max(1, min(LAYOUT_TILE // block_e, next_power_of_2(max(num_pairs, 1))))
    masked_layout_kernel[(1,)](ids, dest, counts, dropped, num_pairs, num_experts, capacity,
                               BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4)
    return MaskedLayout(dest, counts, dropped, capacity)


def masked_config(capacity: int, hidden: int, inter: int, itemsize: int,
                  device: torch.device | str | None = None) -> ExpertsConfig:
    """The default tiles for C rows per expert (the tile height follows C, the most rows in use)."""
    return default_config(MoEShape(1, hidden, inter, 1), capacity, itemsize, device)


def _grid(num_experts: int, capacity: int, block_m: int, n: int, block_n: int) -> tuple[int, int, int]:
    num_m, num_n = cdiv(capacity, block_m), cdiv(n, block_n)
    programs = num_experts * num_m * num_n
    if programs > MAX_GRID:
        raise ValueError(f"masked GEMM grid of {programs} programs (E={num_experts} x {num_m} row blocks x "
                         f"{num_n} column tiles) exceeds {MAX_GRID}; use larger tiles or a smaller capacity")
    return programs, num_m, num_n


def masked_gemm1_swiglu(x_masked: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
                        cfg: ExpertsConfig) -> torch.Tensor:
    """h (E, C, I): silu(x @ gate_e^T) * (x @ up_e^T) on rows [0, counts[e]); other rows unwritten."""
    num_experts, capacity, hidden = x_masked.shape
    inter = gate_up_proj.shape[1] // 2
    h = _workspace.empty(num_experts, capacity, inter, dtype=x_masked.dtype, device=x_masked.device)
    programs, num_m, num_n = _grid(num_experts, capacity, cfg.block_m, inter, cfg.block_n1)
    if programs:
        masked_gemm1_swiglu_kernel[(programs,)](
            x_masked, gate_up_proj, h, counts, capacity, inter, hidden, num_m, num_n,
            *x_masked.stride(), *gate_up_proj.stride(), *h.stride(),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1,
            EVEN_K=hidden % cfg.block_k1 == 0, DOT_PRECISION=_dot_precision(x_masked.dtype),
            num_warps=cfg.warps1, num_stages=cfg.stages1,
        )
    return h


def _row_weight_args(row_weights: torch.Tensor | None, counts: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """GEMM2's row-weight pointer and strides: without weights any tensor (never read) and zeros."""
    return (counts, (0, 0)) if row_weights is None else (row_weights, row_weights.stride())


def masked_gemm2(h: torch.Tensor, counts: torch.Tensor, down_proj: torch.Tensor,
                 row_weights: torch.Tensor | None, cfg: ExpertsConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """y (E, C, H): (h @ down_e^T) [* row_weights, fp32] on rows [0, counts[e]); other rows unwritten."""
    num_experts, capacity, inter = h.shape
    hidden = down_proj.shape[1]
    y = out if out is not None else _workspace.empty(num_experts, capacity, hidden, dtype=h.dtype,
                                                     device=h.device)
    programs, num_m, num_n = _grid(num_experts, capacity, cfg.block_m, hidden, cfg.block_n2)
    rw, rw_strides = _row_weight_args(row_weights, counts)
    if programs:
        masked_gemm2_kernel[(programs,)](
            h, down_proj, y, rw, counts, capacity, hidden, inter, num_m, num_n,
            *h.stride(), *down_proj.stride(), *y.stride(), *rw_strides,
            HAS_ROW_WEIGHTS=row_weights is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2,
            BLOCK_K=cfg.block_k2, EVEN_K=inter % cfg.block_k2 == 0, DOT_PRECISION=_dot_precision(h.dtype),
            num_warps=cfg.warps2, num_stages=cfg.stages2,
        )
    return y


def masked_fp8_config(capacity: int, hidden: int, inter: int,
                      device: torch.device | str | None = None) -> ExpertsConfig:
    """The default FP8 tiles for C rows per expert: `masked_config`'s through `masked_fp8_tiles`."""
    return masked_fp8_tiles(masked_config(capacity, hidden, inter, 2, device), device)


def masked_fp8_tiles(cfg: ExpertsConfig, device: torch.device | str | None = None) -> ExpertsConfig:
    """cfg made fit for the masked FP8 kernels (`check_masked_fp8_config`), with pipeline stages
    dropped until the operand tiles fit in the device's shared memory (counted at two bytes an
    element: x is loaded in its own dtype)."""
    cfg = fp8_tiles(cfg)
    # GEMM1 holds two [BM, 128] fp32 accumulators and quantizes each step's rows: for sm_90 ptxas
    # keeps it out of local memory from 32 rows only on 8 warps, and past 64 rows on none.
    cfg = replace(cfg, block_m=min(cfg.block_m, 64))
    if cfg.block_m >= 32:
        cfg = replace(cfg, warps1=max(cfg.warps1, 8))
    budget = shared_memory_budget(device)
    cfg = shrink_to_fit(cfg, lambda c: pipeline_bytes(c, 2, 1), budget, [("stages1", 1)])
    return shrink_to_fit(cfg, lambda c: pipeline_bytes(c, 2, 2), budget, [("stages2", 1)])


def check_masked_fp8_config(cfg: ExpertsConfig) -> ExpertsConfig:
    """ValueError naming the field unless the masked FP8 kernels can run cfg: `check_fp8_config`'s
    rules, and block_k1 = 128 (GEMM1 quantizes each step's activations as one 128-channel group)."""
    check_fp8_config(cfg)
    if cfg.block_k1 != FP8_BLOCK:
        raise ValueError(f"config.block_k1 must be {FP8_BLOCK} for FP8 weights on the masked layout (GEMM1 "
                         f"quantizes the activations per {FP8_BLOCK} channels as it loads them), "
                         f"got {cfg.block_k1}")
    return cfg


def masked_gemm1_swiglu_fp8(x_masked: torch.Tensor, counts: torch.Tensor, gate_up: Fp8Weight,
                            cfg: ExpertsConfig, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(hq (E, C, I) e4m3, or float16 stand-ins on the CPU; hs (E, C, I / 128) float32): silu(gate) * up
    of x's rows [0, counts[e]) quantized per 128 channels, on block-scaled FP8 gate_up, quantized per
    row per 128 columns (power-of-two scales with ue8m0); other rows unwritten."""
    check_masked_fp8_config(cfg)
    num_experts, capacity, hidden = x_masked.shape
    inter = gate_up.shape[1] // 2
    data = gate_up.for_kernels().data
    hq = _workspace.empty(num_experts, capacity, inter, dtype=data.dtype, device=x_masked.device)
    hs = _workspace.empty(num_experts, capacity, inter // FP8_BLOCK, dtype=torch.float32,
                          device=x_masked.device)
    programs, num_m, num_n = _grid(num_experts, capacity, cfg.block_m, inter, FP8_BLOCK)
    if programs:
        masked_gemm1_swiglu_fp8_kernel[(programs,)](
            x_masked, data, gate_up.scale, hq, hs, counts, capacity, inter, hidden, num_m, num_n,
            *x_masked.stride(), *data.stride(), *gate_up.scale.stride(), *hq.stride(), hs.stride(0),
            hs.stride(1), BLOCK_M=cfg.block_m, UE8M0=ue8m0, STANDIN=data.dtype != FP8_DTYPE,
            num_warps=cfg.warps1, num_stages=cfg.stages1,
        )
    return hq, hs


def masked_gemm2_fp8(hq: torch.Tensor, hs: torch.Tensor, counts: torch.Tensor, down: Fp8Weight,
                     row_weights: torch.Tensor | None, cfg: ExpertsConfig, out_dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """y (E, C, H) in out_dtype: (hq @ down_e^T), dequantized, [* row_weights, fp32] on rows
    [0, counts[e]); other rows unwritten."""
    check_masked_fp8_config(cfg)
    num_experts, capacity, inter = hq.shape
    hidden = down.shape[1]
    data = down.for_kernels().data
    y = out if out is not None else _workspace.empty(num_experts, capacity, hidden, dtype=out_dtype,
                                                     device=hq.device)
    programs, num_m, num_n = _grid(num_experts, capacity, cfg.block_m, hidden, cfg.block_n2)
    rw, rw_strides = _row_weight_args(row_weights, counts)
    if programs:
        masked_gemm2_fp8_kernel[(programs,)](
            hq, hs, data, down.scale, y, rw, counts, capacity, hidden, inter, num_m, num_n,
            *hq.stride(), *hs.stride(), *data.stride(), *down.scale.stride(), *y.stride(), *rw_strides,
            HAS_ROW_WEIGHTS=row_weights is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2,
            BLOCK_K=cfg.block_k2, num_warps=cfg.warps2, num_stages=cfg.stages2,
        )
    return y


def _row_blocks(hidden: int) -> tuple[int, int]:
    block_h = min(1024, next_power_of_2(hidden))
    return max(1, min(16, 4096 // block_h)), block_h


def masked_dispatch(x: torch.Tensor, layout: MaskedLayout, num_experts: int, top_k: int) -> torch.Tensor:
    """x_masked (E, C, H): row dest[p] = x[p // K] for each placed pair; other rows unwritten."""
    num_pairs, hidden = layout.dest.numel(), x.shape[1]
    xm = _workspace.empty(num_experts, layout.capacity, hidden, dtype=x.dtype, device=x.device)
    block_p, block_h = _row_blocks(hidden)
    if num_pairs:
        masked_dispatch_kernel[(cdiv(num_pairs, block_p), cdiv(hidden, block_h))](
            x, layout.dest, xm, num_pairs, hidden, x.stride(0), x.stride(1),
            TOP_K=top_k, BLOCK_P=block_p, BLOCK_H=block_h, num_warps=4,
        )
    return xm


def masked_combine(y: torch.Tensor, layout: MaskedLayout, topk_weights: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """out[t] = fp32 sum over placed slots j of topk_weights[t, j] * y[row of pair t*K + j]; a token
    with no placed slot gets 0. y (E, C, H) contiguous; out (T, H) is written in full."""
    num_tokens, hidden = out.shape
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    block_t, block_h = _row_blocks(hidden)
    if num_tokens:
        masked_combine_kernel[(cdiv(num_tokens, block_t), cdiv(hidden, block_h))](
            y, layout.dest, weights, out, num_tokens, hidden, out.stride(0), out.stride(1),
            TOP_K=topk_weights.shape[1], BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        )
    return out


def masked_moe(x: torch.Tensor, layout: MaskedLayout, gate_up_proj: torch.Tensor | Fp8Weight,
               down_proj: torch.Tensor | Fp8Weight, topk_weights: torch.Tensor, cfg: ExpertsConfig,
               out: torch.Tensor | None = None, *, ue8m0: bool = False) -> torch.Tensor:
    """The masked path after the layout: dispatch into (E, C, H), GEMM1 + SwiGLU, GEMM2 written over
    x_masked (dead once GEMM1 has run: launches on one stream run in order), weighted combine. With
    `Fp8Weight`s the FP8 GEMMs (cfg: `check_masked_fp8_config`; ue8m0: power-of-two activation
    scales).

    x (T, H) and topk_weights (T, K) as given to `masked_layout`'s ids; out (T, H) or None (a fresh
    buffer). Every size follows from (T, K, E, C): no host sync. Shared by the `masked` backend and
    the expert-parallel low-latency mode (`moekit.parallel.low_latency`).
    """
    num_experts = gate_up_proj.shape[0]
    x_masked = masked_dispatch(x, layout, num_experts, topk_weights.shape[1])
    if isinstance(gate_up_proj, Fp8Weight):
        hq, hs = masked_gemm1_swiglu_fp8(x_masked, layout.counts, gate_up_proj, cfg, ue8m0=ue8m0)
        y = masked_gemm2_fp8(hq, hs, layout.counts, down_proj, None, cfg, x.dtype, out=x_masked)
    else:
        h = masked_gemm1_swiglu(x_masked, layout.counts, gate_up_proj, cfg)
        y = masked_gemm2(h, layout.counts, down_proj, None, cfg, out=x_masked)
    if out is None:
        out = _workspace.empty_like(x)
    return masked_combine(y, layout, topk_weights, out)


def check_masked_args(x_masked: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor | Fp8Weight,
                      down_proj: torch.Tensor | Fp8Weight, row_weights: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of `masked_experts`' inputs, dense or `Fp8Weight` weights (reads no
    tensor data)."""
    check_tensor("x_masked", x_masked, ndim=3, dtypes=FLOAT_DTYPES)
    check_triton_device("x_masked", x_masked)
    dev, dtype = x_masked.device, x_masked.dtype
    num_experts, capacity, hidden = x_masked.shape
    check_tensor("counts", counts, ndim=1, dtypes=ID_DTYPES, device=dev)
    check_shape("counts", counts, (num_experts,), "one count per expert of x_masked (E, C, H)")
    fp8 = isinstance(gate_up_proj, Fp8Weight) or isinstance(down_proj, Fp8Weight)
    if fp8:         # both block-scaled FP8; float16 stand-ins only for the CPU's interpreter
        check_fp8_weight("gate_up_proj", gate_up_proj, device=dev, allow_standin=dev.type == "cpu")
    else:
        check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=(dtype,), device=dev)
        check_tensor("down_proj", down_proj, ndim=3, dtypes=(dtype,), device=dev)
    e, two_i, h_in = gate_up_proj.shape
    if e != num_experts or h_in != hidden or two_i % 2:
        raise ValueError(f"gate_up_proj must have shape (E={num_experts}, 2*I, H={hidden}) (Transformers "
                         f"layout, gate rows first), got {tuple(gate_up_proj.shape)}")
    if fp8:
        check_fp8_weight("down_proj", down_proj, shape=(num_experts, hidden, two_i // 2), device=dev,
                         allow_standin=dev.type == "cpu")
    else:
        check_shape("down_proj", down_proj, (num_experts, hidden, two_i // 2), "(E, H, I)")
    if row_weights is not None:
        check_tensor("row_weights", row_weights, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        check_shape("row_weights", row_weights, (num_experts, capacity), "(E, C), as x_masked")


def check_counts_in_range(counts: torch.Tensor, capacity: int) -> None:
    """Raise if a count lies outside [0, C]. Reads the counts: a host sync on CUDA."""
    if counts.numel() == 0:
        return
    lo, hi = int(counts.min()), int(counts.max())
    if lo < 0 or hi > capacity:
        raise ValueError(f"counts must lie in [0, C={capacity}], got values in [{lo}, {hi}]")


def masked_experts(
    x_masked: torch.Tensor,
    counts: torch.Tensor,
    gate_up_proj: torch.Tensor | Fp8Weight,
    down_proj: torch.Tensor | Fp8Weight,
    row_weights: torch.Tensor | None = None,
    *,
    config: ExpertsConfig | None = None,
    validate: bool | None = None,
    out: torch.Tensor | None = None,
    ue8m0_scales: bool = False,
) -> torch.Tensor:
    """SwiGLU experts on the masked layout: y[e, r] = down_e(silu(gate_e x[e, r]) * up_e x[e, r])
    (* row_weights[e, r]) for each expert e and row r < counts[e]. No host sync, graph-capturable.
    No backward: with grad mode on, an input that requires grad is a RuntimeError naming it.

    Args:
        x_masked: (E, C, H) float32, float16 or bfloat16; expert e's tokens in rows [0, counts[e])
            (DeepEP's low-latency dispatch output). Other rows are never read: any value there,
            NaN included, is harmless.
        counts: (E,) int32 or int64 on the same device (DeepEP's recv_count, DeepGEMM's masked_m).
            The kernels clamp each count to [0, C], so no count reads past the buffer.
        gate_up_proj: (E, 2I, H), gate rows first (Transformers layout), x_masked's dtype; or a
            `moekit.quant.Fp8Weight` (block-scaled e4m3, H and I multiples of 128): x's rows are
            quantized per 128 channels and h per 128 columns (w8a8), inference only.
        down_proj: (E, H, I), dense or `Fp8Weight` as gate_up_proj.
        row_weights: optional (E, C) float weights multiplied into each output row in fp32 (the
            routing weight of the pair in that row); None leaves the rows unweighted (DeepEP's
            combine applies the weights itself).
        config: tiles (block_m, block_n1, block_k1, ... of `ExpertsConfig`; group_m is unused).
            Default: `masked_config` for C (FP8: `masked_fp8_config`, rules `check_masked_fp8_config`).
        validate: check 0 <= counts <= C, and FP8 weights' scales finite and positive (a host sync
            on CUDA). Default: True on CPU, False on CUDA.
        out: optional (E, C, H) buffer of x_masked's dtype, overlapping neither itself nor an input.
        ue8m0_scales: FP8 weights: the activations' and h's scales are powers of two.

    Returns:
        (E, C, H) in x_masked's dtype. Rows at or past counts[e] are not written: they keep what
        `out` held, or are uninitialised when `out` is None.
    """
    check_masked_args(x_masked, counts, gate_up_proj, down_proj, row_weights)
    check_config_type(config)
    num_experts, capacity, hidden = x_masked.shape
    inter = gate_up_proj.shape[1] // 2
    fp8 = isinstance(gate_up_proj, Fp8Weight)
    check_inference(INFERENCE_ONLY if fp8 else "masked_experts has no backward", x_masked=x_masked,
                    row_weights=row_weights, gate_up_proj=gate_up_proj, down_proj=down_proj)
    if out is not None:
        inputs = fp8_inputs(x_masked=x_masked, counts=counts, gate_up_proj=gate_up_proj, down_proj=down_proj,
                            row_weights=row_weights)
        check_out(out, x_masked, inputs, like_name="x_masked")
    if validate is None:
        validate = x_masked.device.type == "cpu" and not torch.compiler.is_compiling()
    if validate:
        check_counts_in_range(counts, capacity)
        if fp8:     # reads the scales, as the FP8 calls of moe_experts validate them
            check_fp8_scales("gate_up_proj", gate_up_proj)
            check_fp8_scales("down_proj", down_proj)
    if fp8:
        config = masked_fp8_config(capacity, hidden, inter, x_masked.device) if config is None else config
        hq, hs = masked_gemm1_swiglu_fp8(x_masked, counts, gate_up_proj, config, ue8m0=ue8m0_scales)
        return masked_gemm2_fp8(hq, hs, counts, down_proj, row_weights, config, x_masked.dtype, out)
    if config is None:
        config = masked_config(capacity, hidden, inter, x_masked.element_size(), x_masked.device)
    h = masked_gemm1_swiglu(x_masked, counts, gate_up_proj, config)
    return masked_gemm2(h, counts, down_proj, row_weights, config, out)


def _clamped_counts(counts: torch.Tensor, capacity: int) -> list[int]:
    return counts.long().clamp(0, capacity).tolist()


def masked_gemm1_swiglu_torch(x_masked: torch.Tensor, counts: torch.Tensor,
                              gate_up_proj: torch.Tensor) -> torch.Tensor:
    """Twin of `masked_gemm1_swiglu` in fp32: h (E, C, I), rows past the counts 0."""
    num_experts, capacity, _ = x_masked.shape
    inter = gate_up_proj.shape[1] // 2
    h = torch.zeros(num_experts, capacity, inter, dtype=torch.float32, device=x_masked.device)
    for e, n in enumerate(_clamped_counts(counts, capacity)):
        gate, up = (x_masked[e, :n].float() @ gate_up_proj[e].float().T).chunk(2, dim=-1)
        h[e, :n] = F.silu(gate) * up
    return h


def masked_gemm2_torch(h: torch.Tensor, counts: torch.Tensor, down_proj: torch.Tensor,
                       row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `masked_gemm2` in fp32: y (E, C, H), rows past the counts 0."""
    num_experts, capacity, _ = h.shape
    y = torch.zeros(num_experts, capacity, down_proj.shape[1], dtype=torch.float32, device=h.device)
    for e, n in enumerate(_clamped_counts(counts, capacity)):
        y[e, :n] = h[e, :n].float() @ down_proj[e].float().T
        if row_weights is not None:
            y[e, :n] *= row_weights[e, :n].float()[:, None]
    return y


def masked_experts_fp8_torch(x_masked: torch.Tensor, counts: torch.Tensor, gate_up: Fp8Weight,
                             down: Fp8Weight, row_weights: torch.Tensor | None = None, *,
                             ue8m0: bool = False) -> torch.Tensor:
    """Twin of `masked_experts` on FP8 weights, in fp32: (E, C, H), rows past the counts 0. Each
    row quantized per 128 channels, the weights dequantized, silu(gate) * up quantized per 128
    columns, the down projection, the row weight (`moekit.grouped_gemm.fp8.experts_fp8_torch`'s
    quantization on the masked layout)."""
    num_experts, capacity, _ = x_masked.shape
    wg, wd = gate_up.dequantize(), down.dequantize()
    y = torch.zeros(num_experts, capacity, down.shape[1], dtype=torch.float32, device=x_masked.device)
    for e, n in enumerate(_clamped_counts(counts, capacity)):
        if n == 0:
            continue
        xd = dequantize_rows(*quantize_rows_torch(x_masked[e, :n], ue8m0=ue8m0))
        gate, up = (xd @ wg[e].T).chunk(2, dim=-1)
        h = dequantize_rows(*quantize_rows_torch(F.silu(gate) * up, ue8m0=ue8m0))
        y[e, :n] = h @ wd[e].T
        if row_weights is not None:
            y[e, :n] *= row_weights[e, :n].float()[:, None]
    return y


def masked_dispatch_torch(x: torch.Tensor, layout: MaskedLayout, num_experts: int,
                          top_k: int) -> torch.Tensor:
    """Twin of `masked_dispatch`: x_masked (E, C, H) in x's dtype, rows past the counts 0."""
    xm = x.new_zeros(num_experts * layout.capacity, x.shape[1])
    placed = layout.dest >= 0
    pair = torch.arange(layout.dest.numel(), device=x.device)
    xm[layout.dest[placed]] = x[pair[placed] // top_k]
    return xm.view(num_experts, layout.capacity, x.shape[1])


def masked_combine_torch(y: torch.Tensor, layout: MaskedLayout, topk_weights: torch.Tensor) -> torch.Tensor:
    """Twin of `masked_combine` in fp32: (T, H), unplaced slots contribute 0 (their rows never read)."""
    num_tokens, top_k = topk_weights.shape
    y_flat = y.reshape(-1, y.shape[-1]).float()
    placed = (layout.dest >= 0).view(num_tokens, top_k, 1)
    rows = y_flat[layout.dest.clamp(min=0)].view(num_tokens, top_k, -1)
    return torch.where(placed, rows * topk_weights.float()[..., None], 0.0).sum(1)
