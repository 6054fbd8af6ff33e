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
