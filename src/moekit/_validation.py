"""Argument checks shared by the public ops. Every check runs before any kernel launch.

None of these reads device memory, except `check_expert_ids_in_range`, which syncs on CUDA and is
therefore only called for CPU tensors or when the caller asked for validation.
"""

from __future__ import annotations

import math
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The Triton router and align kernels hold one row of E (padded to a power of two) per program.
MAX_TRITON_EXPERTS = 4096
ID_DTYPES = (torch.int32, torch.int64)
# The most (token, expert) pairs a call may have: the align sorts pair indices in int32.
MAX_PAIRS = 2**31 - 2


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


def check_capacity_factor(capacity_factor: object) -> float | None:
    """None, or a finite real number > 0 (the padded backend's Switch-Transformer capacity)."""
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor must be a number or None, got {type(capacity_factor).__name__} "
                        f"{capacity_factor!r}")
    if not 0 < capacity_factor < math.inf:      # comparisons, not math.isfinite: Dynamo traces them
        raise ValueError(f"capacity_factor must be > 0 and finite, got {capacity_factor}")
    return float(capacity_factor)


def check_dtype(name: str, dtype: object) -> torch.dtype:
    """A floating torch.dtype moekit computes in; names such as "bfloat16" are accepted."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise TypeError(f"{name} must be one of ({allowed}) or its name, got {dtype!r}")
    return dtype


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses a strided view can touch."""
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory the views a and b can reach intersects. Exact for slices of rows;
    conservative (True) for views interleaved within one span."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of t may share memory. Exact for dense views (torch's own answer);
    for other views (a slice of columns) the sufficient rule: dims of size > 1 by increasing stride,
    each stride beyond the farthest element the smaller-stride dims reach (alone under torch.compile:
    Dynamo cannot trace torch's answer)."""
    if not torch.compiler.is_compiling():
        code = torch._debug_has_internal_overlap(t)
        if code != 2:       # 0: no overlap, 1: overlap, 2: too hard for torch to tell
            return code == 1
    if t.numel() == 0:
        return False
    ordered: list[tuple[int, int]] = []     # (stride, size) by increasing stride; no sorted(): Dynamo
    for n, st in zip(t.shape, t.stride()):  # cannot sort symbolic keys, it can compare them
        if n > 1:
            i = 0
            while i < len(ordered) and ordered[i][0] <= abs(st):
                i += 1
            ordered.insert(i, (abs(st), n))
    reach = 0
    for stride, size in ordered:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_out(out: torch.Tensor, like: torch.Tensor, inputs: dict[str, torch.Tensor],
              like_name: str = "hidden_states") -> None:
    """An `out=` buffer: same shape, dtype and device as `like` (named `like_name` in errors), no
    element written twice (no internal overlap, e.g. an expanded view), and no byte shared with any
    input. Under torch.compile the inputs are not compared: Dynamo cannot read addresses, and the
    compiled call copies a fresh result into out, so a shared byte cannot corrupt what it reads."""
    check_tensor("out", out, dtypes=(like.dtype,), device=like.device)
    check_shape("out", out, tuple(like.shape), f"same as {like_name}")
    if overlaps_itself(out):
        raise ValueError("out must not overlap itself (an expanded or stride-0 view writes one element "
                         "twice); pass a plain buffer")
    if torch.compiler.is_compiling():
        return
    for name, t in inputs.items():
        if overlaps(out, t):
            raise ValueError(f"out must not share memory with {name}")


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Autograd would record this call: grad mode is on and some input requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_layer_input(x: object, hidden: int) -> None:
    """A layer's input: hidden states (..., H), so at least 1-D. Reads no tensor data."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != hidden:
        raise ValueError(f"x must have shape (..., H={hidden}) (hidden states, at least 1-D), "
                         f"got {tuple(x.shape)}")


def check_replay_input(x: object, static: torch.Tensor, max_tokens: int,
                       params: tuple[torch.Tensor, ...]) -> int:
    """x (T, H) for a replay of a captured layer whose static input is `static` (max_tokens, H);
    returns T. Reads attributes only: no host sync, so the check holds under a caller's capture."""
    hidden = static.shape[1]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must have shape (T, H={hidden}), got {tuple(x.shape)}")
    if x.dtype != static.dtype:
        raise TypeError(f"x has dtype {x.dtype}, but the layer was captured in {static.dtype}; "
                        f"cast x (x.to({static.dtype}))")
    if x.device != static.device:
        raise ValueError(f"x must be on the captured layer's device {static.device}, got {x.device}")
    if x.shape[0] > max_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens; this capture serves at most {max_tokens}")
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        who = "x requires grad" if x.requires_grad else "the layer's parameters require grad"
        raise RuntimeError(f"{who}, but a captured layer is forward-only (a graph replay records no "
                           "autograd); call it under torch.no_grad() or torch.inference_mode(), "
                           "or train with the eager layer")
    return x.shape[0]


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
    check_routing_args(topk_weights, topk_ids, num_tokens, num_experts, dev,
                       top_k_at_most_experts=top_k_at_most_experts)
    return num_experts


def check_routing_args(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_tokens: int, num_experts: int,
                       dev: torch.device, *, top_k_at_most_experts: bool = True) -> None:
    """topk_ids (T, K) int32/int64 and topk_weights (T, K) float on dev, K in [1, E] (>= 1 when
    top_k_at_most_experts is False). Reads no tensor data."""
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


def check_expert_biases(gate_up_bias: object, down_bias: object, gate_up_proj: torch.Tensor) -> None:
    """Optional per-expert biases: gate_up_bias (E, 2I) and down_bias (E, H), each None or a tensor
    of the weights' dtype and device. Reads no tensor data."""
    if gate_up_bias is None and down_bias is None:
        return
    num_experts, two_i, hidden = gate_up_proj.shape
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (num_experts, two_i)),
                              ("down_bias", down_bias, (num_experts, hidden))):
        if bias is None:
            continue
        check_tensor(name, bias, ndim=2, dtypes=(gate_up_proj.dtype,), device=gate_up_proj.device)
        what = "(E, 2I), in gate_up_proj's row layout" if name == "gate_up_bias" else "(E, H)"
        check_shape(name, bias, shape, what)


def check_bool(name: str, value: object) -> bool:
    """A flag argument: a bool, not a truthy stand-in ("no" and 0 would read as given)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value
