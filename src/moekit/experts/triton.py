"""`triton` backend launcher: align -> GEMM1 (gather + SwiGLU) -> GEMM2 (weight + scatter) -> sum.

Four launches after the router for small T (align is one kernel up to 4096 pairs), five above.
No host synchronisation: every buffer's size follows from (T, K, E, config) and the grids are
sized from the fixed upper bound `Alignment.max_blocks`; programs past num_padded return.
Workspace: h (L, I) and y (S, H) in the input dtype (L = padded rows, S = T * K).
"""

from __future__ import annotations

import torch
import triton

from moekit import _workspace
from moekit._validation import MAX_TRITON_EXPERTS, check_triton_device
from moekit.align import Alignment, align_block_size
from moekit.kernels.grouped_gemm import moe_gemm1_swiglu_kernel, moe_gemm2_kernel, moe_sum_kernel
from moekit.shapes import MoEShape
from moekit.tuning import ExpertsConfig, get_config


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in full fp32 (not tf32): the fp32 path is a correctness path.
    return "ieee" if dtype == torch.float32 else "tf32"


def gemm1_swiglu(x: torch.Tensor, gate_up_proj: torch.Tensor, align: Alignment, top_k: int,
                 cfg: ExpertsConfig) -> torch.Tensor:
    """h (L, I): silu(x_tok @ gate_e^T) * (x_tok @ up_e^T) at each sorted row; padding rows 0."""
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    h = _workspace.empty(align.sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(inter, cfg.block_n1)
    moe_gemm1_swiglu_kernel[(align.max_blocks * n_tiles,)](
        x, gate_up_proj, h, align.sorted_ids, align.expert_ids, align.num_padded,
        align.num_pairs, inter, hidden, n_tiles,
        x.stride(0), x.stride(1), *gate_up_proj.stride(), h.stride(0), h.stride(1),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1,
        GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k1 == 0,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=cfg.warps1, num_stages=cfg.stages1,
    )
    return h


def gemm2_weighted(h: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                   align: Alignment, cfg: ExpertsConfig) -> torch.Tensor:
    """y (S, H): (h_row @ down_e^T) * routing weight, stored at each pair's own row."""
    num_experts, hidden, inter = down_proj.shape
    y = _workspace.empty(align.num_pairs, hidden, dtype=h.dtype, device=h.device)
    n_tiles = triton.cdiv(hidden, cfg.block_n2)
    moe_gemm2_kernel[(align.max_blocks * n_tiles,)](
        h, down_proj, y, topk_weights, align.sorted_ids, align.expert_ids, align.num_padded,
        align.num_pairs, hidden, inter, n_tiles,
        h.stride(0), h.stride(1), *down_proj.stride(), y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2,
        GROUP_M=cfg.group_m, EVEN_K=inter % cfg.block_k2 == 0,
        DOT_PRECISION=_dot_precision(h.dtype), num_warps=cfg.warps2, num_stages=cfg.stages2,
    )
    return y


def moe_sum(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor) -> torch.Tensor:
    """out[t] = fp32 sum of y[t*K + j] over the slots with an id in [0, E)."""
    num_tokens, hidden = out.shape
    top_k = topk_ids.shape[1]
    block_h = min(1024, triton.next_power_of_2(hidden))
    block_t = max(1, min(16, 4096 // block_h))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    moe_sum_kernel[grid](y, topk_ids, out, num_tokens, hidden, num_experts, out.stride(0), out.stride(1),
                         TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    return out


def experts_triton(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: ExpertsConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_triton_device("hidden_states", hidden_states)
    num_tokens = hidden_states.shape[0]
    num_experts, two_i, hidden = gate_up_proj.shape
    top_k = topk_ids.shape[1]
    if config is None:
        # An expert-parallel rank may hold fewer experts than a token picks (K > E, the other
        # slots carry ids outside [0, E)): at most E of a token's pairs land here.
        shape = MoEShape(num_experts, hidden, two_i // 2, min(top_k, num_experts))
        config = get_config(shape, num_tokens, hidden_states.dtype, hidden_states.device)
    if out is None:
        out = _workspace.empty_like(hidden_states)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    align = align_block_size(ids, num_experts, config.block_m,
                             backend="triton" if num_experts <= MAX_TRITON_EXPERTS else "torch")
    h = gemm1_swiglu(hidden_states, gate_up_proj, align, top_k, config)
    y = gemm2_weighted(h, down_proj, weights, align, config)
    return moe_sum(y, ids, num_experts, out)
