"""`grouped_mm` backend: sort, gather, torch grouped_mm, activation, grouped_mm, weight, combine.

Expert biases are added to the sorted rows, gathered by each row's expert, after each grouped_mm.

This is the path Transformers' grouped_mm experts option takes. On Hopper and Blackwell PyTorch
runs grouped_mm as one kernel; elsewhere it falls back to one GEMM per group with a host sync.
The final sum over slots is in fp32 and deterministic (no index_add_ atomics). Pairs with ids
outside [0, E) sort past the last group, rows grouped_mm never writes (nor their gradients): every
such row is selected away, so those pairs add exactly 0 to the output and to every gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekit.activation import SWIGLU, GatedActivation, gated
from moekit.align import sort_pairs

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def check_grouped_mm_layout(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor,
                            down_proj: torch.Tensor) -> None:
    """grouped_mm needs 16-byte-aligned strides: H and I multiples of 16 bytes."""
    if _grouped_mm is None:
        raise RuntimeError("backend='grouped_mm' needs torch.nn.functional.grouped_mm (torch >= 2.9)")
    item = hidden_states.element_size()
    hidden, inter = hidden_states.shape[1], down_proj.shape[2]
    for name, size in (("hidden_size", hidden), ("intermediate_size", inter)):
        if (size * item) % 16:
            raise ValueError(
                f"backend='grouped_mm' needs {name} * itemsize to be a multiple of 16 bytes, got "
                f"{size} x {item}; use backend='triton' or 'loop'"
            )


def _aligned_weight(w: torch.Tensor) -> torch.Tensor:
    """w itself when grouped_mm can read it (unit inner stride, 16-byte outer strides and base),
    else a contiguous copy: a padded or strided weight view gives the right answer, a little slower."""
    item = w.element_size()
    ok = (w.stride(-1) == 1 and all(s * item % 16 == 0 for s in w.stride()[:-1])
          and w.data_ptr() % 16 == 0)
    return w if ok else w.contiguous()


def experts_grouped_mm(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                       gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       activation: GatedActivation = SWIGLU, interleaved: bool = False) -> torch.Tensor:
    # The layout was checked by the caller (the registry's `check_layout`, in moe_experts and the op).
    gate_up_proj, down_proj = _aligned_weight(gate_up_proj), _aligned_weight(down_proj)
    num_tokens, hidden = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    top_k = topk_ids.shape[1]

    pairs = sort_pairs(topk_ids, num_experts)
    valid, order = pairs.valid, pairs.order
    offs = torch.cumsum(pairs.counts[:num_experts], 0, dtype=torch.int32)  # invalid pairs lie past offs[-1]

    # grouped_mm leaves rows past offs[-1] unwritten, forward and backward: selects (NaN-safe) drop them.
    valid_sorted = valid[order][:, None]
    # Masked so that their unwritten input gradient never reaches hidden_states.grad.
    x_sorted = torch.where(valid_sorted, hidden_states[order // top_k], 0)
    expert_sorted = pairs.e_sorted.clamp(max=num_experts - 1)
    h = _grouped_mm(x_sorted, gate_up_proj.transpose(-1, -2), offs=offs)
    if gate_up_bias is not None:
        h = h + gate_up_bias[expert_sorted]
    # Masked after the bias: their gradient would otherwise land in gate_up_bias.grad[E-1].
    h = torch.where(valid_sorted, h, 0)
    act = gated(h, activation, interleaved).contiguous()
    y_sorted = _grouped_mm(act, down_proj.transpose(-1, -2), offs=offs)
    if down_bias is not None:
        y_sorted = y_sorted + down_bias[expert_sorted]

    w_sorted = torch.where(valid_sorted[:, 0], topk_weights.reshape(-1)[order].float(), 0.0)
    contrib = torch.where(valid_sorted, y_sorted.float() * w_sorted[:, None], 0.0)
    per_pair = torch.empty_like(contrib).index_copy_(0, order, contrib)
    return per_pair.view(num_tokens, top_k, hidden).sum(1).to(hidden_states.dtype)
