"""moekit's router and expert path with the contract torch.compile and Transformers need.

    experts       x (T, H), gate_up_proj (E, 2I, H), down_proj (E, H, I), topk_weights (T, K),
                  topk_ids (T, K) -> (T, H) in x's dtype
    topk_softmax  logits (T, E) -> topk_weights float32 (T, K), topk_ids int32 (T, K)
    route         linear + topk_softmax

These are the library's own entries (`moekit.moe_experts`, `moekit.topk_softmax`, `moekit.route`)
with the expert-parallel contract fixed: ids outside [0, E) always contribute exactly 0 and are
never read back for validation (no host sync), and K may exceed E. Under torch.compile the entries
call the custom ops `moekit::experts` and `moekit::topk_softmax`, registered beside them
(`moekit.experts`, `moekit.routing.router`) over the same implementations.
"""

from __future__ import annotations

import torch

from moekit.activation import GatedActivation
from moekit.experts import moe_experts
from moekit.routing import route as _route
from moekit.routing import topk_softmax as _topk_softmax
from moekit.tuning import ExpertsConfig

__all__ = ["experts", "route", "topk_softmax"]


def experts(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, backend: str = "auto",
            config: ExpertsConfig | None = None, gate_up_bias: torch.Tensor | None = None,
            down_bias: torch.Tensor | None = None, activation: str | GatedActivation | None = None,
            interleaved: bool = False) -> torch.Tensor:
    """`moekit.moe_experts` with ids outside [0, E) skipped and never validated; same Args."""
    return moe_experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend=backend,
                       config=config, ignore_invalid_ids=True, validate=False, gate_up_bias=gate_up_bias,
                       down_bias=down_bias, activation=activation, interleaved=interleaved)


def topk_softmax(logits: torch.Tensor, top_k: int, *, renormalize: bool = True,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`moekit.topk_softmax`; same Args and Returns."""
    return _topk_softmax(logits, top_k, renormalize=renormalize, backend=backend)


def route(hidden_states: torch.Tensor, router_weight: torch.Tensor, top_k: int, *,
          renormalize: bool = True, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`moekit.route`: the linear stays visible to the compiler; same Args and Returns."""
    return _route(hidden_states, router_weight, top_k, renormalize=renormalize, backend=backend)
