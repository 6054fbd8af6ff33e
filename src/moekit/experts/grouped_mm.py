"""`grouped_mm` backend: sort, gather, torch grouped_mm, activation, grouped_mm, weight, combine.

Expert biases are added to the sorted rows, gathered by each row's expert, after each grouped_mm.

This is the path Transformers' grouped_mm experts option takes. On Hopper and Blackwell PyTorch
runs grouped_mm as one kernel; elsewhere it falls back to one GEMM per group with a host sync.
The final sum over slots is in fp32 and deterministic (no index_add_ atomics). Pairs with ids
outside [0, E) sort past the last group, rows grouped_mm never writes (nor their gradients): every
such row is selected away, so those pairs add exactly 0 to the output and to every gradient.

Under torch.compile the two grouped GEMMs are the `moekit::grouped_mm` custom op (torch's own
grouped_mm traces in bfloat16 only) with its autograd, so a training call compiles in every dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekit._validation import needs_grad
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
    # A traced tensor has no address to check: `moekit::grouped_mm` checks the base where it runs.
    base_ok = torch.compiler.is_compiling() or w.data_ptr() % 16 == 0
    ok = w.stride(-1) == 1 and all(s * item % 16 == 0 for s in w.stride()[:-1]) and base_ok
    return w if ok else w.contiguous()


@torch.library.custom_op("moekit::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped_mm as one opaque node, for torch.compile (its fake takes bfloat16 only): a (M, K)
    by b (G, K, N) with groups of rows ending at offs -> (M, N), rows past offs[-1] zero; or a (K, M)
    by b (M, N), groups along M -> (G, K, N), the weight gradient's layout."""
    if b.dim() == 3 and b.data_ptr() % 16:      # a weight view at an odd offset (see _aligned_weight)
        b = b.contiguous()
    out = _grouped_mm(a, b, offs=offs)
    if b.dim() == 3:        # torch leaves those rows unwritten; zeros make the op a function of its inputs
        rows = torch.arange(out.shape[0], device=out.device)
        out = torch.where((rows < offs[-1])[:, None], out, 0)
    return out


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _grouped_mm_setup_context(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    gmm = torch.ops.moekit.grouped_mm       # differentiable itself: a double backward works eagerly
    # grouped_mm takes no zero strides, as an expanded grad has; an empty one counts as contiguous
    grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
    if b.dim() == 3:        # out (M, N) = a (M, K) @ b[g] row group by row group
        grad_a = gmm(grad, b.transpose(-1, -2), offs) if need_a else None
        grad_b = gmm(a.t(), grad, offs) if need_b else None
    else:                   # out[g] (K, N) = a[:, group g] @ b[group g, :]
        grad_a = gmm(b, grad.transpose(-1, -2), offs).t() if need_a else None
        grad_b = gmm(a.t(), grad, offs) if need_b else None
    return grad_a, grad_b, None


torch.library.register_autograd("moekit::grouped_mm", _grouped_mm_backward,
                                setup_context=_grouped_mm_setup_context)


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():     # torch's own grouped_mm traces in bfloat16 only
        return torch.ops.moekit.grouped_mm(a, b, offs)
    return _grouped_mm(a, b, offs=offs)


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
    # Where autograd records the call, those rows are also selected away before GEMM1 and after its
    # bias, so their unwritten gradients never reach hidden_states.grad or gate_up_bias.grad[E-1].
    grad = needs_grad(*(t for t in (hidden_states, gate_up_proj, down_proj, topk_weights, gate_up_bias,
                                    down_bias) if t is not None))
    x_sorted = hidden_states[order // top_k]
    if grad:
        x_sorted = torch.where(valid_sorted, x_sorted, 0)
    expert_sorted = pairs.e_sorted.clamp(max=num_experts - 1)
    h = _gmm(x_sorted, gate_up_proj.transpose(-1, -2), offs)
    if gate_up_bias is not None:
        h = h + gate_up_bias[expert_sorted]
    if grad:
        h = torch.where(valid_sorted, h, 0)
    act = gated(h, activation, interleaved).contiguous()
    y_sorted = _gmm(act, down_proj.transpose(-1, -2), offs)
    if down_bias is not None:
        y_sorted = y_sorted + down_bias[expert_sorted]

    w_sorted = torch.where(valid_sorted[:, 0], topk_weights.reshape(-1)[order].float(), 0.0)
    contrib = torch.where(valid_sorted, y_sorted.float() * w_sorted[:, None], 0.0)
    per_pair = torch.empty_like(contrib).index_copy_(0, order, contrib)
    return per_pair.view(num_tokens, top_k, hidden).sum(1).to(hidden_states.dtype)
