"""A Transformers sparse MoE block <-> a `MoELayer` sharing its Parameters (not copies).

    layer = from_transformers(model.model.layers[0].mlp)     # moekit's router and experts
    block = to_transformers(layer)                            # a Qwen3MoeSparseMoeBlock by default

A block converts when its forward is exactly what MoELayer computes: a softmax, top-k, optionally
renormalised router feeding SiLU-gated experts in the untransposed (E, 2I, H) / (E, H, I) layout
(Qwen3-MoE, OLMoE, Mixtral; `_BLOCKS`). gpt-oss's block (expert biases, a clamped SwiGLU on
interleaved rows, a router bias) and Llama-4's (the router scales each expert's input) have no
MoELayer form: `from_transformers` says what runs them on moekit instead.
"""

from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

from moekit.integrations.transformers.experts import _registered, _transformers, register, unsupported_reason
from moekit.integrations.transformers.fp8 import holds_fp8
from moekit.layer import MoELayer
from moekit.shapes import MoEShape

__all__ = ["from_transformers", "to_transformers"]

# Sparse MoE blocks whose forward is exactly `experts(x, *gate(x)[1:][::-1])` with a softmax,
# top-k, optionally renormalised router: what MoELayer computes. Value: model_type, module path,
# and how to read norm_topk_prob (an attribute of the router, or a constant).
_BLOCKS: dict[str, tuple[str, str, str | bool]] = {
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                               "norm_topk_prob"),
    "OlmoeSparseMoeBlock": ("olmoe", "transformers.models.olmoe.modeling_olmoe", "norm_topk_prob"),
    "MixtralSparseMoeBlock": ("mixtral", "transformers.models.mixtral.modeling_mixtral", True),
}
_BLOCK_BY_MODEL_TYPE = {model_type: (module, name) for name, (model_type, module, _) in _BLOCKS.items()}


# MoE blocks MoELayer cannot hold, and what runs them on moekit instead.
_NOT_A_LAYER = {
    "GptOssMLP": "gpt-oss's experts have biases and a clamped SwiGLU on interleaved rows, and its router a "
                 "bias, none of which MoELayer holds; register() runs its experts on moekit's kernels "
                 "(experts_implementation='moekit')",
    "Llama4TextMoe": "Llama-4 scales each expert's input by its router score (sigmoid), which MoELayer's "
                     "routing weight on the output cannot express (the experts are nonlinear); "
                     "patch_llama4(model) runs the block on moekit's experts op",
}


def _block_spec(block: nn.Module) -> tuple[int, bool]:
    """(top_k, norm_topk_prob) of a supported sparse MoE block's router."""
    # A patched block (patch_llama4, patch_moe_blocks) subclasses the original.
    name = next((c.__name__ for c in type(block).__mro__ if c.__name__ in _BLOCKS), type(block).__name__)
    for cls in type(block).__mro__:
        if cls.__name__ in _NOT_A_LAYER:
            raise TypeError(f"from_transformers cannot convert {cls.__name__}: {_NOT_A_LAYER[cls.__name__]}")
    if name not in _BLOCKS:
        raise TypeError(f"from_transformers supports {sorted(_BLOCKS)}, got {name}")
    norm = _BLOCKS[name][2]
    gate = block.gate
    return int(gate.top_k), bool(getattr(gate, norm) if isinstance(norm, str) else norm)


def from_transformers(block: nn.Module, *, backend: str = "auto", router_backend: str = "auto",
                      layer_cls: type | None = None):
    """A `MoELayer` whose Parameters are the block's own (shared, not copied).

    Args:
        block: a Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock or MixtralSparseMoeBlock.
        backend, router_backend: of the new layer.
        layer_cls: MoELayer or a subclass.

    Returns:
        The layer; `layer.router_weight is block.gate.weight`, and likewise for the experts. The
        router's fp32 weights are not rounded to the model dtype (Transformers rounds them), and
        Mixtral's training-time jitter is not modelled.
    """

    _transformers()
    top_k, norm = _block_spec(block)
    experts, gate = block.experts, block.gate
    reason = unsupported_reason(experts)
    if reason is not None:
        raise ValueError(f"moekit cannot run {type(experts).__name__}: it has {reason}")
    if holds_fp8(experts):
        raise ValueError(f"{type(experts).__name__} holds FP8 weights, a MoELayer dense ones: FP8 experts "
                         "run through experts_implementation='moekit'")
    if experts.is_transposed:
        raise ValueError("MoELayer holds (E, 2I, H) / (E, H, I) weights; this block's are transposed")
    router_weight, gate_up, down = gate.weight, experts.gate_up_proj, experts.down_proj
    for pname, p in (("gate.weight", router_weight), ("experts.gate_up_proj", gate_up),
                     ("experts.down_proj", down)):
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"block.{pname} must be an nn.Parameter to be shared")
    num_experts, two_i, hidden = gate_up.shape
    if tuple(router_weight.shape) != (num_experts, hidden):
        raise ValueError(f"block.gate.weight must have shape (E={num_experts}, H={hidden}), got "
                         f"{tuple(router_weight.shape)} (an expert-parallel shard cannot be converted)")
    if router_weight.dtype != gate_up.dtype or router_weight.device != gate_up.device:
        raise ValueError("block.gate.weight must share the experts' dtype and device, got "
                         f"{router_weight.dtype} on {router_weight.device} vs {gate_up.dtype} on "
                         f"{gate_up.device}")
    shape = MoEShape(num_experts, hidden, two_i // 2, top_k, norm)
    # Built on the meta device: no memory and no random init for weights about to be replaced.
    with torch.device("meta"):
        layer = (layer_cls or MoELayer)(shape, backend=backend, router_backend=router_backend,
                                        dtype=gate_up.dtype)
    layer.router_weight, layer.gate_up_proj, layer.down_proj = router_weight, gate_up, down
    layer.train(block.training)
    return layer


def to_transformers(layer, config=None, *, experts_implementation: str | None = "moekit") -> nn.Module:
    """A Transformers sparse MoE block whose Parameters are the layer's own (shared, not copied).

    Args:
        layer: a `MoELayer`.
        config: a Qwen3MoeConfig, OlmoeConfig or MixtralConfig whose MoE sizes match the layer
            (copied, not changed); default: a Qwen3MoeConfig built from `layer.shape`.
        experts_implementation: set on the block's config copy; "moekit" is registered if needed.
            None keeps the config's own.

    Returns:
        The block, e.g. `Qwen3MoeSparseMoeBlock`; `block.gate.weight is layer.router_weight`.
    """
    tf = _transformers()
    s = layer.shape
    if config is None:
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(hidden_size=s.hidden_size, moe_intermediate_size=s.intermediate_size,
                                num_experts=s.num_experts, num_experts_per_tok=s.top_k,
                                norm_topk_prob=s.norm_topk_prob, hidden_act="silu")
    else:
        config = copy.deepcopy(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in _BLOCK_BY_MODEL_TYPE:
        raise ValueError(f"to_transformers supports model types {sorted(_BLOCK_BY_MODEL_TYPE)}, "
                         f"got {model_type!r}")
    if experts_implementation is not None:
        if experts_implementation == "moekit":
            register()
        elif experts_implementation not in tf.builtin_names and experts_implementation not in _registered:
            raise ValueError(f"experts_implementation {experts_implementation!r} is not registered")
        config._experts_implementation = experts_implementation
    module, cls_name = _BLOCK_BY_MODEL_TYPE[model_type]
    block_cls = getattr(importlib.import_module(module), cls_name)
    with torch.device("meta"):
        block = block_cls(config)
    if _block_spec(block) != (s.top_k, s.norm_topk_prob):
        raise ValueError(f"config routes with (top_k, norm_topk_prob) = {_block_spec(block)}, "
                         f"the layer with {(s.top_k, s.norm_topk_prob)}")
    mine = {"gate.weight": layer.router_weight, "experts.gate_up_proj": layer.gate_up_proj,
            "experts.down_proj": layer.down_proj}
    theirs = dict(block.named_parameters())
    if set(theirs) != set(mine):
        raise ValueError(f"{cls_name} has parameters {sorted(theirs)}, expected {sorted(mine)}")
    for pname, p in mine.items():
        if theirs[pname].shape != p.shape:
            raise ValueError(f"config gives {pname} shape {tuple(theirs[pname].shape)}, the layer "
                             f"has {tuple(p.shape)}")
    block.gate.weight = layer.router_weight
    block.experts.gate_up_proj = layer.gate_up_proj
    block.experts.down_proj = layer.down_proj
    reason = unsupported_reason(block.experts)
    if reason is not None:
        raise ValueError(f"the config gives experts with {reason}; MoELayer's are SiLU-gated")
    if any(b.is_meta for b in block.buffers()):
        raise ValueError(f"{cls_name} has buffers moekit cannot fill")
    block.train(layer.training)
    return block
