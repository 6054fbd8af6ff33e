"""`loop` backend: a Python loop over the experts hit, as Transformers' eager experts code runs.

Per expert: find its (token, slot) pairs, two F.linear calls (with the expert's biases, if any), the
gated activation, weight, index_add_ into the output. It launches ~14 kernels per expert hit and
syncs the host once per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekit.activation import SWIGLU, GatedActivation, gated


@torch.compiler.disable(reason="backend='loop' loops in Python over the experts hit (a host read each), "
                        "which torch.compile(fullgraph=True) cannot trace in a call that needs gradients; "
                        "use backend='grouped_mm' (or 'triton')")
def experts_loop(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 activation: GatedActivation = SWIGLU, interleaved: bool = False) -> torch.Tensor:
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden_states)
    ids = topk_ids.long()
    # Ids outside [0, E) land in an extra class that the loop never visits.
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    with torch.no_grad():
        expert_mask = F.one_hot(ids, num_classes=num_experts + 1).permute(2, 1, 0)  # (E+1, K, T)
        expert_hit = torch.greater(expert_mask[:num_experts].sum(dim=(-1, -2)), 0).nonzero()
    for e in expert_hit[:, 0].tolist():
        slot, token_idx = torch.where(expert_mask[e])
        pre = F.linear(hidden_states[token_idx], gate_up_proj[e],
                       None if gate_up_bias is None else gate_up_bias[e])
        h = F.linear(gated(pre, activation, interleaved), down_proj[e],
                     None if down_bias is None else down_bias[e])
        h = h * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out
