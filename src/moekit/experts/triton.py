"""`triton` backend launcher: align -> GEMM1 (gather + SwiGLU) -> GEMM2 (weight + scatter) -> sum.

Four launches after the router for small T (align is one kernel up to 4096 pairs), five above.
No host synchronisation: every buffer's size follows from (T, K, E, config) and the grids are
sized from the fixed upper bound `Alignment.max_blocks`; programs past num_padded return.
Workspace: h (L, I) and y (S, H) in the input dtype (L = padded rows, S = T * K).
"""

from __future__ import annotations

import torch

from moekit import _workspace
from moekit._validation import MAX_TRITON_EXPERTS, check_triton_device
from moekit.align import align_block_size
from moekit.grouped_gemm import gemm1_swiglu, gemm2_weighted, moe_sum
from moekit.shapes import MoEShape
from moekit.tuning import ExpertsConfig, get_config


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
