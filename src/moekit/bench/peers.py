"""Transformers' own experts implementations, timed beside moekit's backends (`--peers`).

A Qwen3-MoE experts module is built from a config alone (no download, parameters on the meta
device), then given moekit's weight tensors, so both sides read the very same memory. Transformers
picks the implementation from `config._experts_implementation`:

    hf-eager       the model class's own forward: a Python loop over the experts hit
    hf-batched_mm  gathers one (2I, H) and one (H, I) weight matrix per pair, then torch.bmm
    hf-grouped_mm  sort + torch grouped_mm, as moekit's grouped_mm backend
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from moekit._memory import fits
from moekit.shapes import MoEShape

PEER_IMPLS = ("eager", "batched_mm", "grouped_mm")
PREFIX = "hf-"
PEERS = tuple(PREFIX + impl for impl in PEER_IMPLS)
CPU_WORKSPACE_LIMIT = 4 << 30


def transformers_version() -> str | None:
    """Installed Transformers version, or None when it is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import transformers

    return transformers.__version__


def is_peer(name: str) -> bool:
    return name in PEERS


def workspace_bytes(name: str, shape: MoEShape, tokens: int, dtype: torch.dtype) -> int:
    """Bytes a peer allocates beyond its inputs; batched_mm copies every pair's expert weights."""
    if name != PREFIX + "batched_mm":
        return 0
    return tokens * shape.top_k * shape.expert_bytes(dtype)


def check_fits(name: str, shape: MoEShape, tokens: int, dtype: torch.dtype, device: torch.device) -> str:
    """"" when the peer's workspace fits (`moekit._memory.fits`; at most CPU_WORKSPACE_LIMIT on the
    CPU), else the reason to skip it."""
    need = workspace_bytes(name, shape, tokens, dtype)
    reason = fits(need, device, CPU_WORKSPACE_LIMIT if device.type == "cpu" else None) if need else ""
    return f"gathered weights: {reason}" if reason else ""


def make_peer(name: str, shape: MoEShape, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A callable (x (T, H), ids int64 (T, K), weights (T, K) in x's dtype) -> (T, H).

    Raises:
        ModuleNotFoundError: Transformers is not installed.
        ValueError: `name` is not one of `PEERS`.
    """
    if name not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {name!r}")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=shape.hidden_size,
        moe_intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=shape.norm_topk_prob,
        experts_implementation=name.removeprefix(PREFIX),
    )
    with torch.device("meta"):  # no allocation: the parameters are replaced by moekit's tensors
        module = Qwen3MoeExperts(config)
    module.gate_up_proj = torch.nn.Parameter(gate_up_proj, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down_proj, requires_grad=False)
    module.eval()

    def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return module(x, ids, weights)

    return run
