"""Block-scaled FP8 grouped GEMMs (w8a8): launchers beside their pure-PyTorch twins.

    gemm1_swiglu_fp8   xq (T, H), xs (T, H / 128), gate_up `Fp8Weight` -> hq (L, I), hs (L, I / 128)
    gluon_gemm1_swiglu_fp8, gluon_gemm2_weighted_fp8
                       the same from the Hopper Gluon kernels (`moekit.grouped_gemm.gluon_fp8`):
                       warp-specialized, the scaling of one warpgroup's products under the other's
                       wgmma; `gluon_gemm1_fp8_problem` and `gluon_gemm2_fp8_problem` say where they run
    gemm2_weighted_fp8 hq, hs, down `Fp8Weight`, routing weights -> y (S, H) in the output dtype
    experts_fp8_torch  the whole expert path in fp32 with the same quantization (the oracle)

Kernels: `moekit.grouped_gemm.fp8_kernels`. The launch, tile loop and alignment are the bf16 path's
(`moekit.grouped_gemm._launch`), with the tiles `moekit.tuning.check_fp8_config` admits. The
quantized operands are e4m3, or float16 stand-ins holding e4m3 values (`moekit.quant`); the
activations' dtype follows the weights'.
"""

from __future__ import annotations

import torch

from moekit import _workspace, env
from moekit._host import cdiv
from moekit.align import Alignment
from moekit.grouped_gemm import TMA_MAX_COORD, _launch, _placed_rows, _weights_operand, num_sms
from moekit.grouped_gemm import gluon_fp8 as _gluon_fp8
from moekit.grouped_gemm.fp8_kernels import moe_gemm1_fp8_kernel, moe_gemm2_fp8_kernel
from moekit.grouped_gemm.gluon_wgrad import GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS, MAX_REGS
from moekit.quant import FP8_BLOCK, FP8_DTYPE, Fp8Weight, dequantize_rows, quantize_rows_torch
from moekit.tuning import ExpertsConfig, check_fp8_config


def gemm1_swiglu_fp8(xq: torch.Tensor, xs: torch.Tensor, gate_up: Fp8Weight, align: Alignment, top_k: int,
                     cfg: ExpertsConfig, *, ue8m0: bool = False,
                     pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hq (L, I) in xq's dtype, hs (L, I / 128) float32): silu(gate) * up of each sorted row,
    quantized per 128 columns; padding rows zeros. cfg.tma_weights: as resolved by the caller (the
    plan); pdl: as in `moekit.grouped_gemm.gemm1_swiglu`."""
    check_fp8_config(cfg)
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    rows = align.sorted_ids.numel()
    hq = _workspace.empty(rows, inter, dtype=xq.dtype, device=xq.device)
    hs = _workspace.empty(rows, inter // FP8_BLOCK, dtype=torch.float32, device=xq.device)
    n_tiles = inter // cfg.block_n1
    w, tma = _weights_operand(gate_up.data, cfg, cfg.block_n1, cfg.block_k1)
    ws = gate_up.scale
    args = (xq, w, hq, align.sorted_ids, align.expert_ids, align.block_codes, align.num_padded,
            align.num_pairs, inter, hidden, n_tiles,
            xq.stride(0), xq.stride(1), *gate_up.data.stride(), hq.stride(0), hq.stride(1),
            xs, xs.stride(0), xs.stride(1), ws, *ws.stride(), hs, hs.stride(0))
    _launch(moe_gemm1_fp8_kernel, align.max_blocks, n_tiles, cfg, xq.device, args, dict(
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, GROUP_M=cfg.group_m,
        PAIRED=cfg.pair_blocks == 2, UE8M0=ue8m0, STANDIN=xq.dtype != FP8_DTYPE, TMA_W=tma,
        PERSISTENT=cfg.persistent,
        num_warps=cfg.warps1, num_stages=cfg.stages1), pdl)
    return hq, hs


def _dual(dual: bool | None) -> bool:
    """The Gluon FP8 GEMMs' schedule: dual as given, None: $MOEKIT_GLUON_FP8_DUAL."""
    return env.flag(_gluon_fp8.DUAL_ENV) if dual is None else dual


def _gluon_fp8_problem(activations: torch.Tensor, weight: Fp8Weight, align: Alignment) -> str:
    """What both Gluon FP8 GEMMs need ("" when it holds): Gluon, a CUDA device of compute capability
    9.x (not interpreted), e4m3 activations and weights (not stand-ins), an align block size that is
    a multiple of 64, and the weight's data contiguous."""
    from moekit.grouped_gemm.backward import _sm90

    if not _gluon_fp8.GLUON_AVAILABLE:
        return "this Triton has no Gluon"
    if not _sm90(activations.device):
        return f"needs a CUDA device of compute capability 9.x, got {activations.device}"
    if activations.dtype != FP8_DTYPE or weight.data.dtype != FP8_DTYPE:
        return f"needs e4m3 activations and weights, got {activations.dtype} and {weight.data.dtype}"
    if align.block_m % _gluon_fp8.SUB_M:
        return f"needs an align block size that is a multiple of {_gluon_fp8.SUB_M}, got {align.block_m}"
    if not weight.data.is_contiguous():
        return "needs the weight's data contiguous"
    return ""


def gluon_gemm1_fp8_problem(xq: torch.Tensor, gate_up: Fp8Weight, align: Alignment) -> str:
    """Why the Gluon FP8 GEMM1 cannot run this call ("" when it can): `_gluon_fp8_problem`, H and I
    multiples of 128, E * 2I rows within TMA's coordinates."""
    num_experts, two_i, hidden = gate_up.shape
    problem = _gluon_fp8_problem(xq, gate_up, align)
    if problem:
        return problem
    if hidden % FP8_BLOCK or (two_i // 2) % _gluon_fp8.BLOCK_N:
        return f"needs H and I multiples of {FP8_BLOCK}, got {hidden} and {two_i // 2}"
    if num_experts * two_i >= TMA_MAX_COORD:
        return "needs E * 2I rows within TMA's int32 coordinates"
    return ""


def gluon_gemm1_swiglu_fp8(xq: torch.Tensor, xs: torch.Tensor, gate_up: Fp8Weight, align: Alignment,
                           top_k: int, *, ue8m0: bool = False,
                           dual: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemm1_swiglu_fp8`'s (hq (L, I) e4m3, hs (L, I / 128) float32) from the Hopper Gluon kernel
    (`gluon_gemm1_fp8_kernel`, persistent: one program an SM): x's rows gathered from their tokens by
    the kernel. dual: its dual schedule, else ping-pong (None: $MOEKIT_GLUON_FP8_DUAL). ValueError
    naming the reason where it cannot run (`gluon_gemm1_fp8_problem`)."""
    from moekit.grouped_gemm.backward import _gather_operand, _gluon_descriptor, _gluon_layout

    problem = gluon_gemm1_fp8_problem(xq, gate_up, align)
    if problem:
        raise ValueError(f"gluon_gemm1_swiglu_fp8: {problem}")
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    rows = align.sorted_ids.numel()
    hq = _workspace.empty(rows, inter, dtype=FP8_DTYPE, device=xq.device)
    hs = _workspace.empty(rows, inter // FP8_BLOCK, dtype=torch.float32, device=xq.device)
    if rows == 0 or xq.shape[0] == 0:
        return hq, hs
    bm, bn, bk = _gluon_fp8.SUB_M, _gluon_fp8.BLOCK_N, _gluon_fp8.BLOCK_K
    x = _gather_operand(xq)
    ws = gate_up.scale
    n_tiles = inter // bn
    items = cdiv(rows, bm) * n_tiles            # a bound: num_padded is on the device
    _gluon_fp8.gluon_gemm1_fp8_kernel[(max(1, min(num_sms(xq.device), items)),)](
        _gluon_descriptor(gate_up.data.view(num_experts * two_i, hidden), (bn // 2, bk)),
        _gluon_descriptor(hq, (bm, bn // 2)),             # a tile's two 64-column halves
        x, x.stride(0), xs, xs.stride(0), xs.stride(1), ws, *ws.stride(), hs, hs.stride(0),
        align.sorted_ids, align.expert_ids, align.num_padded, align.num_pairs, hidden, inter, n_tiles,
        A_LAYOUT=_gluon_layout((bm, bk), FP8_DTYPE), ALIGN_M=align.block_m, STAGES_=_gluon_fp8.STAGES,
        UE8M0=ue8m0, TOP_K=top_k, PRODUCER_REGS_=GATHER_PRODUCER_REGS,
        CONSUMER_REGS_=GATHER_CONSUMER_REGS, DUAL=_dual(dual), num_warps=4, maxnreg=MAX_REGS,
    )
    return hq, hs


def gluon_gemm2_fp8_problem(hq: torch.Tensor, down: Fp8Weight, align: Alignment) -> str:
    """Why the Gluon FP8 GEMM2 cannot run this call ("" when it can): `_gluon_fp8_problem` on hq (L, I)
    and down (E, H, I), hq TMA-readable, H and I multiples of 128, E * H rows within TMA's
    coordinates."""
    from moekit.grouped_gemm.backward import _tma_operand

    num_experts, hidden, inter = down.shape
    problem = _gluon_fp8_problem(hq, down, align)
    if problem:
        return problem
    if hidden % _gluon_fp8.BLOCK_N or inter % FP8_BLOCK:
        return f"needs H and I multiples of {FP8_BLOCK}, got {hidden} and {inter}"
    if num_experts * hidden >= TMA_MAX_COORD or not _tma_operand(hq):
        return "needs hq TMA-readable and E * H rows within TMA's int32 coordinates"
    return ""


def gluon_gemm2_weighted_fp8(hq: torch.Tensor, hs: torch.Tensor, down: Fp8Weight, topk_weights: torch.Tensor,
                             align: Alignment, out_dtype: torch.dtype, *,
                             dual: bool | None = None) -> torch.Tensor:
    """`gemm2_weighted_fp8`'s y (S, H) in out_dtype from the Hopper Gluon kernel
    (`gluon_gemm2_fp8_kernel`, persistent: one program an SM). dual: as in `gluon_gemm1_swiglu_fp8`.
    ValueError naming the reason where it cannot run (`gluon_gemm2_fp8_problem`)."""
    from moekit.grouped_gemm.backward import _gluon_descriptor

    problem = gluon_gemm2_fp8_problem(hq, down, align)
    if problem:
        raise ValueError(f"gluon_gemm2_weighted_fp8: {problem}")
    num_experts, hidden, inter = down.shape
    y = _workspace.empty(align.num_pairs, hidden, dtype=out_dtype, device=hq.device)
    rows = align.sorted_ids.numel()
    if rows == 0 or align.num_pairs == 0:
        return y
    bm, bn, bk = _gluon_fp8.SUB_M, _gluon_fp8.BLOCK_N, _gluon_fp8.BLOCK_K
    ds = down.scale
    n_tiles = hidden // bn
    items = cdiv(rows, bm) * n_tiles            # a bound: num_padded is on the device
    _gluon_fp8.gluon_gemm2_fp8_kernel[(max(1, min(num_sms(hq.device), items)),)](
        _gluon_descriptor(hq, (bm, bk)),
        _gluon_descriptor(down.data.view(num_experts * hidden, inter), (bn, bk)),
        y, y.stride(0), topk_weights.reshape(-1), hs, hs.stride(0), hs.stride(1), ds, *ds.stride(),
        align.sorted_ids, align.expert_ids, align.num_padded, align.num_pairs, hidden, n_tiles, inter // bk,
        ALIGN_M=align.block_m, STAGES_=_gluon_fp8.STAGES2, PRODUCER_REGS_=_gluon_fp8.PRODUCER2_REGS,
        CONSUMER_REGS_=_gluon_fp8.CONSUMER2_REGS, DUAL=_dual(dual), num_warps=4, maxnreg=MAX_REGS,
    )
    return y


def gemm2_weighted_fp8(hq: torch.Tensor, hs: torch.Tensor, down: Fp8Weight, topk_weights: torch.Tensor,
                       align: Alignment, cfg: ExpertsConfig, out_dtype: torch.dtype, *,
                       pdl: bool | None = None) -> torch.Tensor:
    """y (S, H) in out_dtype: (hq_row @ down_e^T, dequantized) * routing weight at each pair's row."""
    check_fp8_config(cfg)
    num_experts, hidden, inter = down.shape
    y = _workspace.empty(align.num_pairs, hidden, dtype=out_dtype, device=hq.device)
    n_tiles = cdiv(hidden, cfg.block_n2)
    w, tma = _weights_operand(down.data, cfg, cfg.block_n2, cfg.block_k2)
    ws = down.scale
    args = (hq, w, y, topk_weights, align.sorted_ids, align.expert_ids, align.block_codes, align.num_padded,
            align.num_pairs, hidden, inter, n_tiles,
            hq.stride(0), hq.stride(1), *down.data.stride(), y.stride(0), y.stride(1),
            hs, hs.stride(0), hs.stride(1), ws, *ws.stride())
    _launch(moe_gemm2_fp8_kernel, align.max_blocks, n_tiles, cfg, hq.device, args, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, GROUP_M=cfg.group_m,
        PAIRED=cfg.pair_blocks == 2, TMA_W=tma, PERSISTENT=cfg.persistent, num_warps=cfg.warps2,
        num_stages=cfg.stages2), pdl)
    return y


def gemm1_swiglu_fp8_torch(xq: torch.Tensor, xs: torch.Tensor, gate_up: Fp8Weight, align: Alignment,
                           top_k: int, *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `gemm1_swiglu_fp8`: fp32 on the dequantized operands, h quantized as the kernel's
    epilogue does; (hq in xq's dtype, hs); padding rows zeros (scale: the floor)."""
    x = dequantize_rows(xq, xs)
    w = gate_up.dequantize()
    inter = gate_up.shape[1] // 2
    h = torch.zeros(align.sorted_ids.numel(), inter, dtype=torch.float32, device=xq.device)
    rows, pair, expert = _placed_rows(align)
    for e in expert.unique().tolist():
        sel = expert == e
        gate, up = (x[pair[sel] // top_k] @ w[e].T).chunk(2, dim=-1)
        h[rows[sel]] = torch.nn.functional.silu(gate) * up
    return quantize_rows_torch(h, ue8m0=ue8m0, dtype=xq.dtype)


def gemm2_weighted_fp8_torch(hq: torch.Tensor, hs: torch.Tensor, down: Fp8Weight, topk_weights: torch.Tensor,
                             align: Alignment) -> torch.Tensor:
    """Twin of `gemm2_weighted_fp8` in fp32: y (S, H), rows of unplaced pairs 0."""
    h = dequantize_rows(hq, hs)
    w = down.dequantize()
    y = torch.zeros(align.num_pairs, down.shape[1], dtype=torch.float32, device=hq.device)
    rows, pair, expert = _placed_rows(align)
    weights = topk_weights.reshape(-1).float()
    for e in expert.unique().tolist():
        sel = expert == e
        y[pair[sel]] = (h[rows[sel]] @ w[e].T) * weights[pair[sel], None]
    return y


def experts_fp8_torch(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, ue8m0: bool = False) -> torch.Tensor:
    """The FP8 expert path in fp32 (T, H): x quantized per row per 128 columns, the weights
    dequantized, silu(gate) * up quantized per row per 128 columns, the down projection, the routing
    weight and the sum over the slots with an id in [0, E). The oracle of the FP8 kernels."""
    num_experts = gate_up.shape[0]
    xd = dequantize_rows(*quantize_rows_torch(x, ue8m0=ue8m0))
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gate, up = (xd[tok] @ _dequantize_expert(gate_up, e).T).chunk(2, dim=-1)
        h = dequantize_rows(*quantize_rows_torch(torch.nn.functional.silu(gate) * up, ue8m0=ue8m0))
        out.index_add_(0, tok, (h @ _dequantize_expert(down, e).T) * topk_weights[tok, slot].float()[:, None])
    return out


def _dequantize_expert(w: Fp8Weight, e: int) -> torch.Tensor:
    """Expert e's (N, K) in fp32 (`Fp8Weight.dequantize` of its slice): one expert at a time, so the
    loop backend holds one expert in fp32, not all E."""
    return Fp8Weight(w.data[e:e + 1], w.scale[e:e + 1]).dequantize()[0]
