"""The router: linear, fp32 softmax, top-k, renormalise (Transformers' Qwen3-MoE router).

Backends:
    torch   F.linear, then `moekit.reference.topk_softmax_ref` (stable int64 keys, fp32 softmax).
    triton  F.linear, then one Triton kernel for softmax + top-k + renormalisation.
Both return (topk_weights float32 (T, K), topk_ids int32 (T, K)) with identical ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit._validation import (
    FLOAT_DTYPES,
    MAX_TRITON_EXPERTS,
    check_bool,
    check_tensor,
    check_top_k,
    check_triton_device,
    needs_grad,
)
from moekit.launch_hints import pdl_kwargs
from moekit.reference import topk_softmax_ref
from moekit.routing.kernels import topk_softmax_kernel

ROUTER_BACKENDS = ("torch", "triton")


def check_router_backend(backend: object, name: str = "backend") -> None:
    """ValueError naming the argument unless backend is "auto" or one of `ROUTER_BACKENDS`."""
    if backend != "auto" and backend not in ROUTER_BACKENDS:
        raise ValueError(f"{name} must be 'auto' or one of {ROUTER_BACKENDS}, got {backend!r}")


def resolve_router_backend(backend: str, logits: torch.Tensor) -> str:
    """"auto" -> triton on CUDA for E <= MAX_TRITON_EXPERTS when no gradient is needed, else torch.

    The Triton kernel has no backward: with gradients needed (so that the router trains) "auto"
    takes the torch path, which gives identical ids, and an explicit "triton" raises.
    """
    num_experts = logits.shape[-1]
    grad = needs_grad(logits)
    if backend == "auto":
        return "triton" if logits.is_cuda and num_experts <= MAX_TRITON_EXPERTS and not grad else "torch"
    check_router_backend(backend)
    if backend == "triton":
        if num_experts > MAX_TRITON_EXPERTS:
            raise ValueError(f"router backend='triton' supports at most {MAX_TRITON_EXPERTS} experts, got "
                             f"E={num_experts}; use backend='torch' or 'auto'")
        if grad:
            raise RuntimeError("router backend='triton' has no backward, but the logits need gradients; "
                               "use backend='auto' or 'torch', or run under torch.no_grad()")
    return backend


def topk_softmax(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    backend: str = "auto",
    num_valid_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, top-k and renormalisation of router logits.

    Args:
        logits: (T, E) float logits.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the K chosen probabilities by their sum.
        backend: "auto", "torch" or "triton".
        num_valid_tokens: optional int32 device scalar n (0-d, on logits' device); rows >= n get
            id -1 and weight 0, so a CUDA graph captured for T rows can serve any n <= T (both
            backends: more experts than the kernel takes route through the torch one).

    Returns:
        (topk_weights float32 (T, K), topk_ids int32 (T, K)).
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_top_k(top_k, logits.shape[1])
    check_bool("renormalize", renormalize)
    return _topk_softmax_checked(logits, top_k, renormalize, backend, num_valid_tokens)


def _topk_softmax_checked(logits: torch.Tensor, top_k: int, renormalize: bool, backend: str,
                          num_valid_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_softmax` past its checks of logits and top_k (`route` made them on its own inputs,
    which imply them: F.linear of checked inputs is a (T, E) float tensor)."""
    backend = resolve_router_backend(backend, logits)
    if num_valid_tokens is not None:
        check_tensor("num_valid_tokens", num_valid_tokens, dtypes=(torch.int32,), device=logits.device)
        if num_valid_tokens.dim() != 0:     # the kernel reads one element, torch would broadcast more
            raise ValueError("num_valid_tokens must be a 0-d int32 tensor (a device scalar, torch.tensor(n, "
                             f"dtype=torch.int32)), got shape {tuple(num_valid_tokens.shape)}")
    elif torch.compiler.is_compiling() and not needs_grad(logits):
        return torch.ops.moekit.topk_softmax(logits, top_k, renormalize, backend)
    return _run(logits, top_k, renormalize, backend, num_valid_tokens)


def _run(logits: torch.Tensor, top_k: int, renormalize: bool, backend: str,
         num_valid_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked router: the torch twin, or the Triton kernel."""
    if backend == "torch":
        weights, ids = topk_softmax_ref(logits, top_k, renormalize)
        if num_valid_tokens is None:
            return weights, ids
        # as the kernel: rows at or past n are padding (id -1, weight 0), with no host sync
        pad = torch.arange(logits.shape[0], device=logits.device)[:, None] >= num_valid_tokens
        return weights.masked_fill(pad, 0.0), ids.masked_fill(pad, -1)
    check_triton_device("logits", logits)
    num_tokens, num_experts = logits.shape
    weights = _workspace.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = _workspace.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // e_pad, next_power_of_2(num_tokens)))
    grid = (cdiv(num_tokens, block_t),)
    topk_softmax_kernel[grid](
        logits, weights, ids, num_valid_tokens if num_valid_tokens is not None else ids,
        num_tokens, num_experts, logits.stride(0), logits.stride(1),
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), E_PAD=e_pad, BLOCK_T=block_t,
        RENORMALIZE=renormalize, HAS_NUM_VALID=num_valid_tokens is not None,
        num_warps=4 if e_pad <= 256 else 8, **pdl_kwargs(logits.device),
    )
    return weights, ids


@torch.library.custom_op(
    "moekit::topk_softmax", mutates_args=(),
    schema="(Tensor logits, int top_k, bool renormalize, str backend) -> (Tensor, Tensor)",
)
def _topk_softmax_op(logits: torch.Tensor, top_k: int, renormalize: bool,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`_run` as one opaque node for torch.compile (the launcher sizes its grid from T)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_top_k(top_k, logits.shape[1])
    return _run(logits, top_k, renormalize, backend)


@_topk_softmax_op.register_fake
def _topk_softmax_fake(logits, top_k, renormalize, backend):
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_top_k(top_k, logits.shape[1])
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


def route(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    backend: str = "auto",
    num_valid_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    Args:
        hidden_states: (T, H) tokens.
        router_weight: (E, H) router matrix, same dtype and device as hidden_states.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: make each token's K weights sum to 1 (norm_topk_prob).
        backend: "auto" (triton on CUDA, torch elsewhere), "torch" or "triton".
        num_valid_tokens: see `topk_softmax`.

    Returns:
        (topk_weights float32 (T, K), topk_ids int32 (T, K)); ties go to the lower expert id and a
        NaN logit is chosen only after every number in its row.
    """
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("router_weight", router_weight, ndim=2, dtypes=(hidden_states.dtype,),
                 device=hidden_states.device)
    if router_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(
            f"router_weight must have shape (E, H={hidden_states.shape[1]}), got {tuple(router_weight.shape)}"
        )
    check_top_k(top_k, router_weight.shape[0])
    check_bool("renormalize", renormalize)
    logits = F.linear(hidden_states, router_weight)
    return _topk_softmax_checked(logits, top_k, renormalize, backend, num_valid_tokens)
