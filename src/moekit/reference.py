"""Pure-PyTorch fp32 references of every moekit op.

These are the ground truth the tests and the benchmark's correctness gate compare against. They favour
clarity over speed: everything is upcast to float32 and computed pair by pair through dense ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits with +inf -> float32 max, and -inf, NaN -> -float32 max: softmax stays finite."""
    big = torch.finfo(torch.float32).max
    return logits.float().nan_to_num(nan=-big, posinf=big, neginf=-big)


def routing_keys(logits: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys (T, E) whose descending order is the routing order.

    High 32 bits: the fp32 logit's bits mapped so that integer order is float order (-0 counts as
    +0, NaN lowest of all). Low 32 bits: 2^32 - 1 - expert id, so equal logits go to the lower id.
    Top-k is taken on logits, not probabilities: softmax is monotonic, and the logits are the same
    bits in every backend, so every backend picks identical ids. The Triton router builds the same
    keys.
    """
    x = logits.float() + 0.0  # -0.0 + 0.0 == +0.0
    bits = x.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = torch.where(torch.isnan(x), torch.iinfo(torch.int32).min, key).to(torch.int64)
    ids = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return key * 2**32 + (2**32 - 1 - ids)


def topk_softmax_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 (T, K), ids int32 (T, K)) from router logits (T, E).

    Softmax in fp32 over sanitised logits; ids by `routing_keys` (ties to the lower id, NaN never
    chosen while a number is left); renormalisation guards a zero sum.
    """
    probs = torch.softmax(sanitize_logits(logits), dim=-1)
    ids = torch.topk(routing_keys(logits), top_k, dim=-1).indices
    weights = torch.gather(probs, -1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return weights, ids.to(torch.int32)


def route_ref(
    hidden_states: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router reference: (T, E) logits in the inputs' dtype, then `topk_softmax_ref`."""
    return topk_softmax_ref(F.linear(hidden_states, router_weight), top_k, renormalize)


def moe_experts_ref(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    interleaved: bool = False,
) -> torch.Tensor:
    """fp32 reference of the expert path: out[t] = sum_k w[t,k] * down_e(silu(gate_e x) * up_e x).

    With the expert math of `moe_experts`: pre = gate_up_e x + gate_up_bias_e, gate and up its
    halves ([gate; up], or alternate rows when interleaved), activation "swiglu" silu(gate) * up or
    "gpt_oss" (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)
    (Transformers' GptOssExperts), then w * (down_e act + down_bias_e).
    Pairs whose expert id lies outside [0, E) contribute exactly 0 (expert-parallel sentinel).
    Returns float32 (T, H).
    """
    x = hidden_states.float()
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros(x.shape[0], down_proj.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in range(num_experts):
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        h = x[token_idx] @ gate_up_proj[e].float().T
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].float()
        gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=-1)
        if activation == "gpt_oss":
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
        else:
            act = F.silu(gate) * up
        y = act @ down_proj[e].float().T
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot].float()[:, None])
    return out


def moe_layer_ref(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
) -> torch.Tensor:
    """The whole layer in fp32: route then experts. Returns float32 (T, H)."""
    weights, ids = route_ref(hidden_states.float(), router_weight.float(), top_k, renormalize)
    return moe_experts_ref(hidden_states, gate_up_proj, down_proj, weights, ids)
