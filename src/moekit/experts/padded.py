"""`padded` backend: every expert padded to the busiest one's row count, two batched matmuls.

Buffers (C = cap rows per expert):
    x_pad (E, C, H)  token rows by expert, zeros in unused rows
    h     (E, C, 2I) (+ gate_up_bias) -> activation -> (E, C, I) -> y (E, C, H) (+ down_bias)
Without a capacity factor C is the busiest expert's count (read back to the host: a sync). With
capacity_factor c, C = ceil(c * S / E) is fixed (Switch Transformer), so the backend can be
captured in a CUDA graph, and pairs past an expert's capacity are dropped: they contribute 0.
"""

from __future__ import annotations

import math

import torch

from moekit._memory import fits
from moekit.activation import SWIGLU, GatedActivation, gated
from moekit.align import sort_pairs


class PaddedWorkspaceTooLarge(RuntimeError):
    """The (E, cap, *) buffers would not fit in the device's free memory."""


def capacity(num_pairs: int, num_experts: int, capacity_factor: float) -> int:
    """Switch-Transformer expert capacity: ceil(c * S / E) rows per expert."""
    return math.ceil(capacity_factor * num_pairs / num_experts)


def workspace_bytes(num_experts: int, cap: int, hidden: int, inter: int, itemsize: int) -> int:
    # x_pad, h (2I), act (I), y: the four (E, cap, *) buffers alive at the peak.
    return num_experts * cap * (hidden + 2 * inter + inter + hidden) * itemsize


def check_workspace_fits(num_bytes: int, device: torch.device) -> None:
    """Raise before allocating when the buffers would not fit (`moekit._memory.fits`; on the
    CPU too: an (E, cap, *) workspace under extreme skew can exhaust the machine)."""
    reason = fits(num_bytes, device)
    if reason:
        raise PaddedWorkspaceTooLarge(f"padded backend's (E, cap, *) buffers: {reason}; use a "
                                      "capacity_factor or another backend")


@torch.compiler.disable(reason="backend='padded' without capacity_factor sizes its buffers by the busiest "
                        "expert's count (a host read), which torch.compile(fullgraph=True) cannot trace; "
                        "give capacity_factor or use backend='grouped_mm'")
def _busiest(counts: torch.Tensor) -> int:
    return int(counts.max())                                            # host sync


def experts_padded(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   capacity_factor: float | None = None, stats: dict | None = None,
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                   activation: GatedActivation = SWIGLU, interleaved: bool = False) -> torch.Tensor:
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = gate_up_proj.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = hidden_states.device

    pairs = sort_pairs(topk_ids, num_experts)
    valid, key, counts = pairs.valid, pairs.key, pairs.counts
    rank = pairs.ranks()                                                 # rank of pair p in its expert

    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if not num_experts or not num_pairs:
        cap = 0                               # no pairs, or no experts (every id invalid): no rows
    elif capacity_factor is None:
        cap = _busiest(counts[:num_experts])
    else:
        cap = capacity(num_pairs, num_experts, capacity_factor)
    check_workspace_fits(workspace_bytes(num_experts, cap, hidden, two_i // 2,
                                         hidden_states.element_size()), dev)

    kept = valid & (rank < cap)
    if stats is not None:
        stats["capacity"] = cap
        stats["dropped"] = (valid & ~kept).sum()                          # device scalar, no sync
    # Flat row in the (E * cap) buffer; dropped and invalid pairs go to a spare row E * cap.
    dest = torch.where(kept, key * cap + rank, num_experts * cap)
    tok = torch.arange(num_pairs, device=dev) // top_k
    x_pad = hidden_states.new_zeros(num_experts * cap + 1, hidden)
    x_pad.index_copy_(0, dest, hidden_states[tok])
    x_pad = x_pad[:-1].view(num_experts, cap, hidden)

    h = torch.bmm(x_pad, gate_up_proj.transpose(1, 2))                  # (E, cap, 2I)
    if gate_up_bias is not None:
        h = h + gate_up_bias[:, None, :]
    y = torch.bmm(gated(h, activation, interleaved), down_proj.transpose(1, 2))   # (E, cap, H)
    if down_bias is not None:       # rows of no pair get it too, and are never gathered
        y = y + down_bias[:, None, :]

    y_flat = torch.cat([y.reshape(num_experts * cap, hidden), y.new_zeros(1, hidden)])
    w = torch.where(kept, topk_weights.reshape(-1).float(), 0.0)
    per_pair = y_flat[dest].float() * w[:, None]
    return per_pair.view(num_tokens, top_k, hidden).sum(1).to(hidden_states.dtype)
