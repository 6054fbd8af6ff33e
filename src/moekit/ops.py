"""moekit's router and expert path as `torch.library` custom ops, for torch.compile and Transformers.

    moekit::topk_softmax  logits (T, E) -> topk_weights float32 (T, K), topk_ids int32 (T, K)
    moekit::experts       x (T, H), gate_up_proj (E, 2I, H), down_proj (E, H, I),
                          topk_weights (T, K), topk_ids (T, K) -> (T, H) in x's dtype

Why custom ops: the launchers size grids and pick tile configs from T in Python, and the loop and
padded backends read counts back to the host; Dynamo can trace neither with a symbolic T. To the
compiler each op is one opaque node whose fake implementation derives the output sizes from the
input sizes alone, so one graph serves every token count, and there is no graph break.

`experts` differs from `moekit.moe_experts` in two ways, both on purpose:
  * ids outside [0, E) always contribute exactly 0 and are never read back for validation (a host
    sync would break the graph). Expert parallelism marks non-local experts so (Transformers uses
    E, moekit's parallel code -1).
  * K may exceed E: an expert-parallel rank can hold fewer experts than a token picks.
Neither op has a backward yet: a call on tensors that need gradients (grad mode on) raises before
any launch, so no output is ever silently detached from the autograd graph.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn.functional as F

from moekit._validation import (
    FLOAT_DTYPES,
    check_experts_args,
    check_tensor,
    check_top_k,
    check_triton_device,
    needs_grad,
)
from moekit.experts import resolve_backend
from moekit.experts.grouped_mm import check_grouped_mm_layout, experts_grouped_mm
from moekit.experts.loop import experts_loop
from moekit.experts.padded import experts_padded
from moekit.experts.triton import experts_triton
from moekit.routing import topk_softmax as _topk_softmax
from moekit.routing.router import resolve_router_backend
from moekit.tuning import ExpertsConfig

__all__ = ["experts", "route", "topk_softmax"]

_CONFIG_FIELDS = tuple(f.name for f in fields(ExpertsConfig))
_HOST_BACKENDS = {"loop": experts_loop, "padded": experts_padded, "grouped_mm": experts_grouped_mm}


def _refuse_grad(op: str, *tensors: torch.Tensor) -> None:
    if needs_grad(*tensors):
        raise RuntimeError(f"moekit::{op} has no backward, but an input requires grad and grad mode is on; "
                           "run it under torch.no_grad() / torch.inference_mode(), or call "
                           "moekit.moe_experts / moekit.route, which pick a differentiable path")


def _check_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Shape, dtype and device checks only: they hold for fake tensors with a symbolic T too."""
    check_experts_args(x, gate_up_proj, down_proj, topk_weights, topk_ids, top_k_at_most_experts=False)


@torch.library.custom_op(
    "moekit::experts", mutates_args=(),
    schema="(Tensor hidden_states, Tensor gate_up_proj, Tensor down_proj, Tensor topk_weights, "
           "Tensor topk_ids, str backend, int[]? config) -> Tensor",
)
def _experts_op(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, backend: str,
                config: list[int] | None) -> torch.Tensor:
    _check_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
    # A contiguous input makes every backend's output contiguous, as the fake one is.
    x = hidden_states.contiguous()
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    if backend == "triton":
        cfg = ExpertsConfig(**dict(zip(_CONFIG_FIELDS, config, strict=True))) if config is not None else None
        return experts_triton(x, gate_up_proj, down_proj, topk_weights, topk_ids, config=cfg)
    return _HOST_BACKENDS[backend](x, gate_up_proj, down_proj, topk_weights, topk_ids).contiguous()


@_experts_op.register_fake
def _experts_fake(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend, config):
    _check_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
    return hidden_states.new_empty(hidden_states.shape)


def experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str = "auto",
    config: ExpertsConfig | None = None,
) -> torch.Tensor:
    """The expert path through `moekit::experts`: traceable by torch.compile with any T.

    Args:
        hidden_states: (T, H) float32, float16 or bfloat16.
        gate_up_proj: (E, 2I, H), gate rows first, same dtype and device; any strides.
        down_proj: (E, H, I); any strides.
        topk_weights: (T, K) routing weights, any float dtype.
        topk_ids: (T, K) int32 or int64; ids outside [0, E) contribute exactly 0.
        backend: "auto" (triton on CUDA; grouped_mm, or loop for unaligned sizes, on CPU) or one
            of `moekit.BACKENDS`. "padded" runs without a capacity factor (nothing dropped).
        config: tile config for the triton backend.

    Returns:
        (T, H) contiguous, in the dtype of hidden_states.
    """
    _check_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
    _refuse_grad("experts", hidden_states, gate_up_proj, down_proj, topk_weights)
    backend = resolve_backend(backend, hidden_states.device, hidden_states.shape[1], down_proj.shape[2],
                              hidden_states.element_size())
    if backend == "triton":
        check_triton_device("hidden_states", hidden_states)
    elif config is not None:
        raise ValueError("config applies to backend='triton' only")
    if backend == "grouped_mm":
        check_grouped_mm_layout(hidden_states, gate_up_proj, down_proj)
    cfg = [getattr(config, name) for name in _CONFIG_FIELDS] if config is not None else None
    return torch.ops.moekit.experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                                    backend, cfg)


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_top_k(top_k, logits.shape[1])


@torch.library.custom_op(
    "moekit::topk_softmax", mutates_args=(),
    schema="(Tensor logits, int top_k, bool renormalize, str backend) -> (Tensor, Tensor)",
)
def _topk_softmax_op(logits: torch.Tensor, top_k: int, renormalize: bool,
                     backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk_softmax(logits, top_k, renormalize=renormalize, backend=backend)


@_topk_softmax_op.register_fake
def _topk_softmax_fake(logits, top_k, renormalize, backend):
    _check_logits(logits, top_k)
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


def topk_softmax(logits: torch.Tensor, top_k: int, *, renormalize: bool = True,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`moekit.topk_softmax` through `moekit::topk_softmax`; same Args and Returns."""
    _check_logits(logits, top_k)
    _refuse_grad("topk_softmax", logits)
    backend = resolve_router_backend(backend, logits)
    if backend == "triton":
        check_triton_device("logits", logits)
    return torch.ops.moekit.topk_softmax(logits, top_k, renormalize, backend)


def route(hidden_states: torch.Tensor, router_weight: torch.Tensor, top_k: int, *,
          renormalize: bool = True, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`moekit.route` through `moekit::topk_softmax`: the linear stays visible to the compiler."""
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("router_weight", router_weight, ndim=2, dtypes=(hidden_states.dtype,),
                 device=hidden_states.device)
    if router_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(f"router_weight must have shape (E, H={hidden_states.shape[1]}), "
                         f"got {tuple(router_weight.shape)}")
    return topk_softmax(F.linear(hidden_states, router_weight), top_k, renormalize=renormalize,
                        backend=backend)
