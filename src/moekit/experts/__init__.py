"""The expert path, four ways. `moe_experts` validates, then dispatches to one backend file.

    loop        experts/loop.py        Transformers' eager loop (reference behaviour, slow)
    padded      experts/padded.py      (E, cap, H) buffers + torch.bmm; optional capacity factor
    grouped_mm  experts/grouped_mm.py  sort + gather + torch grouped_mm
    triton      experts/triton.py      moekit's fused grouped GEMMs (gather on load, SwiGLU and
                                       routing weight fused, scatter on store)
"""

from __future__ import annotations

import warnings

import torch

from moekit._validation import (
    check_capacity_factor,
    check_expert_ids_in_range,
    check_experts_args,
    check_out,
    needs_grad,
)
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.experts.loop import experts_loop
from moekit.experts.padded import PaddedWorkspaceTooLarge, experts_padded
from moekit.experts.triton import experts_triton
from moekit.tuning import ExpertsConfig

BACKENDS = ("loop", "padded", "grouped_mm", "triton")

__all__ = ["BACKENDS", "PaddedWorkspaceTooLarge", "has_backward", "moe_experts", "resolve_backend"]


def has_backward(backend: str, device: torch.device) -> bool:
    """Whether autograd can differentiate the backend on this device. The triton kernels have no
    backward yet; torch's grouped_mm has one on CUDA only."""
    if backend == "triton":
        return False
    return backend != "grouped_mm" or device.type == "cuda"


_warned_grad_fallback: set[str] = set()


def resolve_backend(backend: str, device: torch.device, hidden: int = 16, inter: int = 16,
                    itemsize: int = 2, *, grad: bool = False) -> str:
    """"auto" -> triton on CUDA; on CPU grouped_mm when its alignment holds, else loop.

    grad=True (the call needs gradients): "auto" picks a backend with a backward (grouped_mm on
    CUDA when aligned, else loop) and warns once; an explicit backend without one raises.
    """
    aligned = (hidden * itemsize) % 16 == 0 and (inter * itemsize) % 16 == 0
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        if grad and not has_backward(backend, device):
            raise RuntimeError(
                f"backend={backend!r} has no backward on {device.type}, but this call needs gradients "
                "(an input requires grad and grad mode is on); run it under torch.no_grad() or "
                "torch.inference_mode(), or use backend='auto' (picks a differentiable backend)")
        return backend
    choice = "triton" if device.type == "cuda" else ("grouped_mm" if aligned else "loop")
    if grad and not has_backward(choice, device):
        fallback = "grouped_mm" if aligned and has_backward("grouped_mm", device) else "loop"
        if choice not in _warned_grad_fallback:
            _warned_grad_fallback.add(choice)
            warnings.warn(f"moekit: backend {choice!r} has no backward; this call needs gradients, so "
                          f"it runs on {fallback!r} (warned once)", stacklevel=3)
        choice = fallback
    return choice


def moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str = "auto",
    config: ExpertsConfig | None = None,
    capacity_factor: float | None = None,
    stats: dict | None = None,
    ignore_invalid_ids: bool = False,
    validate: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the experts: out[t] = sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,k].

    Args:
        hidden_states: (T, H) float32, float16 or bfloat16.
        gate_up_proj: (E, 2I, H), gate rows first (Transformers layout), same dtype and device.
        down_proj: (E, H, I).
        topk_weights: (T, K) routing weights (any float dtype; applied in fp32 by triton).
        topk_ids: (T, K) int32 or int64 expert ids.
        backend: "auto" or one of `BACKENDS`. A call that needs gradients runs only on a backend
            with a backward (`has_backward`); "auto" picks one (warning once), an explicit
            backend without one raises RuntimeError. Never a silently detached output.
        config: tile config for the triton backend (default: the tuned table for the device).
        capacity_factor: padded backend only: cap each expert at ceil(c * T * K / E) pairs.
        stats: padded backend only: filled with "capacity" and "dropped" (device scalar).
        ignore_invalid_ids: pairs with ids outside [0, E) contribute exactly 0 (expert
            parallelism marks non-local experts so), and K may exceed E. When False, such ids
            raise ValueError where that costs no host sync: on CPU, or when validate=True.
        validate: check id ranges (a host sync on CUDA). Default: True on CPU, False on CUDA.
        out: optional (T, H) output buffer of the input dtype; must not overlap itself or any
            input (a disjoint slice of an input's storage is fine).

    Returns:
        (T, H) in the dtype of hidden_states. Kernels never read an expert for an invalid id.
    """
    num_experts = check_experts_args(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                                     top_k_at_most_experts=not ignore_invalid_ids)
    dev = hidden_states.device
    grad = needs_grad(hidden_states, gate_up_proj, down_proj, topk_weights)
    backend = resolve_backend(backend, dev, hidden_states.shape[1], down_proj.shape[2],
                              hidden_states.element_size(), grad=grad)
    capacity_factor = check_capacity_factor(capacity_factor)
    if validate is None:
        validate = dev.type == "cpu"
    if validate and not ignore_invalid_ids:
        check_expert_ids_in_range(topk_ids, num_experts)
    if (capacity_factor is not None or stats is not None) and backend != "padded":
        raise ValueError("capacity_factor and stats apply to backend='padded' only")
    if config is not None and backend != "triton":
        raise ValueError("config applies to backend='triton' only")
    if out is not None:
        if grad:
            raise RuntimeError("out= cannot be used when the call needs gradients (autograd does not "
                               "record writes into out); drop out= or run under torch.no_grad()")
        check_out(out, hidden_states, {"hidden_states": hidden_states, "gate_up_proj": gate_up_proj,
                                       "down_proj": down_proj, "topk_weights": topk_weights,
                                       "topk_ids": topk_ids})

    if hidden_states.shape[0] == 0:
        return out if out is not None else torch.empty_like(hidden_states)
    args = (hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
    if backend == "triton":
        return experts_triton(*args, config=config, out=out)
    if backend == "loop":
        result = experts_loop(*args)
    elif backend == "padded":
        result = experts_padded(*args, capacity_factor=capacity_factor, stats=stats)
    else:
        result = experts_grouped_mm(*args)
    if out is not None:
        return out.copy_(result)
    return result
