"""Transformers' FineGrainedFP8 experts on moekit's FP8 path (`moekit.moe_experts` on `Fp8Weight`s).

A model whose config carries `quantization_config` {"quant_method": "fp8", "weight_block_size":
[128, 128]} is quantized by Transformers' loader (`from_pretrained`; on a CUDA or XPU machine:
without one it refuses to quantize and dequantizes a pre-quantized checkpoint to bf16):
`replace_with_fp8_linear` swaps every `*.experts` module for `FP8Experts`, decorated with
`use_experts_implementation` but dispatching through its own registry, `FP8ExpertsInterface` (a
subclass of ExpertsInterface with a mapping of its own: `register` adds moekit to both), and the
loader fills it (Transformers 5.17 and 5.24 alike):

    gate_up_proj            (E, 2I, H) float8_e4m3fn, [gate; up] rows (is_concatenated, never
                            transposed)
    gate_up_proj_scale_inv  (E, 2I / 128, H / 128) float32 (scale_fmt "float") or float8_e8m0fnu
                            ("ue8m0"): block (i, j) of the weight is data * scale_inv
    down_proj               (E, H, I), with down_proj_scale_inv (E, H / 128, I / 128)
    block_size              the config's weight_block_size; activation_scheme "dynamic" or "static"

That is exactly an `Fp8Weight` each. moekit runs a module in this layout when it has the default
gate (act_fn SiLU on the first half times the second: FP8Experts' own `_apply_gate` without
swiglu_alpha, limit or softcaps), no bias and no post-expert norm, block_size [128, 128],
activation_scheme "dynamic" (moekit quantizes activations per token per 128 channels), e4m3
weights with H and I multiples of 128, on CUDA (triton) or the CPU (loop, the fp32 twin). The
`Fp8Weight`s are cached per module: references to the module's tensors (float32 scales) or scales
converted to float32 once (other scale dtypes), rebuilt when a tensor is replaced or changed in
place; building them reads the scales once (`check_scale_values`: finite and positive, else a
ValueError naming the module), a host sync on CUDA. Under torch.compile the call is the
`moekit::experts_fp8` op on the module's tensors.

Inference only: a call that needs gradients of the hidden states or routing weights falls back (the
e4m3 weights themselves never get one). A fallback runs Transformers' FP8 grouped_mm (its eager
loop for activation_scheme "static"), with one warning per (class, reason).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from moekit._validation import needs_grad
from moekit.eager_graphs import eligible, graph_cache, tensor_key
from moekit.experts import moe_experts
from moekit.experts.fp8 import fp8_backend
from moekit.experts.registry import fp8_backend_names, get_backend
from moekit.quant import FP8_BLOCK, FP8_DTYPE, Fp8Weight
from moekit.quant.loading import check_fp8_tensors, check_scale_values

__all__ = ["fp8_fallback", "fp8_forward", "fp8_plan", "fp8_reason_for_call", "holds_fp8"]

_SCALES = ("gate_up_proj_scale_inv", "down_proj_scale_inv", "up_proj_scale_inv")
_GATE_EXTRAS = ("swiglu_alpha", "limit", "gate_softcap", "up_softcap")   # FP8Experts' gate variants
_NAMES = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
_cache: weakref.WeakKeyDictionary[nn.Module, tuple[Hashable, Fp8Weight, Fp8Weight]] = (
    weakref.WeakKeyDictionary())


def holds_fp8(experts: nn.Module) -> bool:
    """Whether the module holds FP8 weights as Transformers lays them out (`*_scale_inv` tensors
    beside the weights, or float8 weights): its plan is `fp8_plan`'s."""
    if any(isinstance(getattr(experts, name, None), torch.Tensor) for name in _SCALES):
        return True
    weight = getattr(experts, "gate_up_proj", None)
    return isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point and weight.element_size() == 1


def _gate_reason(experts: nn.Module, tf) -> str | None:
    apply_gate = getattr(type(experts), "_apply_gate", tf.default_apply_gate)
    if tf.fp8_apply_gate is not None and apply_gate is tf.fp8_apply_gate:
        extras = [f"{n}={getattr(experts, n)!r}" for n in _GATE_EXTRAS
                  if getattr(experts, n, None) is not None]
        if extras:
            return f"an FP8 gate with {', '.join(extras)} (moekit's FP8 experts run plain SwiGLU)"
    elif tf.default_apply_gate is None or apply_gate is not tf.default_apply_gate:
        return "a custom _apply_gate"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up rows (is_concatenated=False)"
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, tf.silu_types) or act is F.silu):
        return f"activation {type(act).__name__} (moekit fuses SiLU only)"
    return None


def _layout_reason(experts: nn.Module, tf) -> str | None:
    """Why moekit cannot run this FP8 module, read from its flags and tensors' metadata (no data)."""
    if not getattr(experts, "has_gate", True):
        return "non-gated experts (has_gate=False)"
    if getattr(experts, "has_bias", False):
        return "expert biases (has_bias=True) on FP8 weights"
    if getattr(experts, "has_post_expert_norm", False):
        return "a post-expert norm (has_post_expert_norm=True)"
    reason = _gate_reason(experts, tf)
    if reason is not None:
        return reason
    scheme = getattr(experts, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        return f"FP8 activation_scheme={scheme!r} (moekit quantizes activations dynamically)"
    block = getattr(experts, "block_size", None)
    if block is None or tuple(block) != (FP8_BLOCK, FP8_BLOCK):
        return f"FP8 weight_block_size {block!r} (moekit takes [{FP8_BLOCK}, {FP8_BLOCK}])"
    tensors = [getattr(experts, n, None) for n in _NAMES]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "FP8 weights without gate_up_proj / down_proj and their *_scale_inv tensors"
    if any(type(t).__name__ == "DTensor" for t in tensors):
        return "DTensor weights"
    if getattr(experts, "is_transposed", False):
        return "transposed FP8 weights (is_transposed=True)"
    gate_up, gate_up_s, down, down_s = tensors
    if gate_up.dtype != FP8_DTYPE or down.dtype != FP8_DTYPE:
        return f"quantized weights of dtype {gate_up.dtype} / {down.dtype} (moekit's FP8 takes float8_e4m3fn)"
    if gate_up.device.type not in ("cuda", "cpu"):
        return f"weights on {gate_up.device.type}"
    try:
        check_fp8_tensors("gate_up_proj", gate_up, gate_up_s)
        check_fp8_tensors("down_proj", down, down_s)
    except (TypeError, ValueError) as exc:
        return f"FP8 weights moekit cannot read ({exc})"
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (num_experts, hidden, two_i // 2) or down.device != gate_up.device:
        return (f"FP8 weights of shapes {tuple(gate_up.shape)} / {tuple(down.shape)} on {gate_up.device} / "
                f"{down.device}")
    return None


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:            # an inference tensor tracks no version
        return None


def _wrappers(experts: nn.Module) -> tuple[Fp8Weight, Fp8Weight]:
    """The module's (gate_up, down) `Fp8Weight`s, cached per module while its tensors stay the same
    (built, their scales checked, and cached outside a stream capture only)."""
    tensors = tuple(getattr(experts, n) for n in _NAMES)
    key = tuple((tensor_key(t), _version(t)) for t in tensors)
    hit = _cache.get(experts)
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    with torch.no_grad():
        pair = tuple(Fp8Weight(w.detach(), s.detach() if s.dtype == torch.float32 else s.detach().float())
                     for w, s in (tensors[:2], tensors[2:]))
    if pair[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return pair                             # the check is a host sync: never inside a capture
    for name, w in zip(("gate_up_proj_scale_inv", "down_proj_scale_inv"), pair):
        check_scale_values(f"moekit: {type(experts).__name__}.{name}", w.scale)
    _cache[experts] = (key, *pair)
    return pair


def fp8_plan(experts: nn.Module, tf) -> tuple[str | None, dict]:
    """(why moekit cannot run the FP8 module, or None; {"fp8": (gate_up, down)}): `Fp8Weight`s, or
    under torch.compile the four tensors (scales as float32) for the `moekit::experts_fp8` op."""
    reason = _layout_reason(experts, tf)
    if reason is not None:
        return reason, {}
    if torch.compiler.is_compiling():               # no module state touched while Dynamo traces
        gate_up, gate_up_s, down, down_s = (getattr(experts, n).detach() for n in _NAMES)
        return None, {"fp8": (gate_up, gate_up_s.float(), down, down_s.float())}
    return None, {"fp8": _wrappers(experts)}


def fp8_reason_for_call(backend: str, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> str | None:
    """Why this call of a module `fp8_plan` accepts must fall back: gradients, or a backend that
    takes no FP8 weights."""
    if backend != "auto" and get_backend(backend).run_fp8 is None:
        return (f"FP8 weights, which backend={backend!r} does not take (FP8 backends: "
                f"{', '.join(fp8_backend_names())})")
    if needs_grad(hidden_states, top_k_weights):
        return "FP8 weights and inputs that need gradients (moekit's FP8 experts are inference only)"
    return None


def fp8_fallback(experts: nn.Module, tf) -> tuple[str, Callable]:
    """(its name, Transformers' own FP8 experts function) for a call moekit leaves to Transformers."""
    if getattr(experts, "activation_scheme", "dynamic") == "static" or tf.fp8_grouped_mm_forward is None:
        forward = type(experts).forward
        while hasattr(forward, "__wrapped__"):           # the decorator's dispatch -> the eager loop
            forward = forward.__wrapped__
        return "eager FP8", forward
    return "FP8 grouped_mm", tf.fp8_grouped_mm_forward


def fp8_forward(experts: nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, backend: str, eager_graphs: bool) -> torch.Tensor:
    """(T, H) in hidden_states' dtype: the experts on moekit's FP8 path, sentinel ids (outside [0, E))
    contributing 0; eager decoding calls replay a CUDA graph as the dense path's do."""
    if torch.compiler.is_compiling():
        return torch.ops.moekit.experts_fp8(hidden_states, *weights, top_k_weights, top_k_index,
                                            fp8_backend(backend, hidden_states.device), None, False)
    gate_up, down = weights

    def run(hidden: torch.Tensor, ids: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        return moe_experts(hidden, gate_up, down, routing, ids, backend=backend, ignore_invalid_ids=True,
                           validate=False)

    inputs = (hidden_states, top_k_index, top_k_weights)
    tensors = (*inputs, gate_up.data, gate_up.scale, down.data, down.scale)
    if eager_graphs and hidden_states.dim() == 2 and eligible(hidden_states.shape[0], tensors, backend):
        key = ("experts_fp8", backend, *(tensor_key(t) for t in tensors[3:]))
        out = graph_cache(experts)(run, inputs, key)
        if out is not None:
            return out
    return run(*inputs)
