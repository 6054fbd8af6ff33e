"""Argument checks shared by the public ops. Every check runs before any kernel launch.

None of these reads device memory, except `check_expert_ids_in_range`, which syncs on CUDA and is
therefore only called for CPU tensors or when the caller asked for validation.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        hint = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{hint}, got {tuple(t.shape)}")


def check_top_k(top_k: object, num_experts: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    return top_k


def check_expert_ids_in_range(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise if any id is outside [0, E). Reads the ids: a host sync on CUDA."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(
            f"topk_ids must lie in [0, num_experts={num_experts}), got values in [{lo}, {hi}]; "
            "pass ignore_invalid_ids=True to skip out-of-range pairs (expert parallelism)"
        )


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(name: str, t: torch.Tensor) -> None:
    """Triton kernels need a CUDA tensor, or a CPU tensor under TRITON_INTERPRET=1."""
    if t.is_cuda or (t.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"backend='triton' needs {name} on a CUDA device (or TRITON_INTERPRET=1 for CPU tensors), "
        f"got {t.device}"
    )


def check_experts_args(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    top_k_at_most_experts: bool = True,
) -> int:
    """Shapes, dtypes and devices of the expert path's inputs; returns E. Reads no tensor data, so
    it also holds for fake tensors with a symbolic T. The layout is Transformers' by contract, never
    guessed from the shapes: gate_up_proj (E, 2I, H) with gate rows first, down_proj (E, H, I).

    top_k_at_most_experts=False lets K exceed E, for expert-parallel ranks holding fewer experts
    than a token picks (their other slots carry ids outside [0, E)).
    """
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES)
    dev, dtype = hidden_states.device, hidden_states.dtype
    num_tokens, hidden = hidden_states.shape
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, dtypes=(dtype,), device=dev)
    check_tensor("down_proj", down_proj, ndim=3, dtypes=(dtype,), device=dev)
    num_experts, two_i, h_in = gate_up_proj.shape
    if h_in != hidden or two_i % 2:
        raise ValueError(
            f"gate_up_proj must have shape (E, 2*I, H={hidden}) (Transformers layout, gate rows "
            f"first), got {tuple(gate_up_proj.shape)}"
        )
    check_shape("down_proj", down_proj, (num_experts, hidden, two_i // 2), "(E, H, I)")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=dev)
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must have shape (T={num_tokens}, K), got {tuple(topk_ids.shape)}")
    if top_k < 1 or (top_k_at_most_experts and top_k > num_experts):
        bound = f"[1, E={num_experts}]" if top_k_at_most_experts else ">= 1"
        raise ValueError(f"top_k (topk_ids.shape[1]) must be {'in ' if top_k_at_most_experts else ''}"
                         f"{bound}, got {top_k}")
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape), "same as topk_ids")
    return num_experts
