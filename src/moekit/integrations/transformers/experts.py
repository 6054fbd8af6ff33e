"""moekit as a Transformers (>= 5.0) experts implementation: `register` and the function it installs.

    from moekit.integrations.transformers import register
    register()                                                   # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moekit")
    model.set_experts_implementation("moekit")                   # or switch a loaded model

Transformers' `@use_experts_implementation` classes call the registered function as
`fn(experts, hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K))`; the function reads
`experts.gate_up_proj`, `experts.down_proj`, `experts.act_fn` and the layout flags the decorator
sets (`has_gate`, `has_bias`, `is_transposed`, `is_concatenated`, `has_post_expert_norm`). It runs
`moekit.ops.experts` (triton on CUDA; grouped_mm, or loop for unaligned sizes, on CPU) for
  - SiLU-gated experts (the default `_apply_gate`) in the concatenated [gate; up] layout, and
  - gpt-oss's experts (`GptOssExperts._apply_gate`: clamped SwiGLU with its `alpha` and `limit`, on
    interleaved gate/up columns, `moekit.activation`), with their biases `gate_up_proj_bias` and
    `down_proj_bias` (fused in the triton kernels' epilogues),
transposed or not (a transposed module is read through strided views, no copy). FineGrainedFP8
experts (`FP8Experts`, quantization_config quant_method "fp8": e4m3 weights with 128 x 128
`*_scale_inv` block scales) run `moekit.moe_experts` on `moekit.quant.Fp8Weight`s, inference only
(`fp8.py`; `register` adds moekit to their registry, FP8ExpertsInterface, too). Everything else
goes to Transformers' own grouped_mm path (FP8 modules: its FP8 one) with one warning per (class,
reason): non-gated experts, other activations or custom `_apply_gate`s, the default gate on
interleaved rows, a post-expert norm, other quantized or DTensor weights.

Training: a call that needs gradients runs on moekit too, through `moekit.ops.experts`, whose
autograd reaches the experts' gate_up_proj / down_proj Parameters (through the transpose views of a
transposed module), the hidden states and the routing weights (so the router trains); frozen
experts (requires_grad=False) get no gradient and cost no weight-gradient kernel. "auto" picks a
backend with a backward: triton on CUDA (its backward in `moekit.experts.triton`, also under
torch.compile through the `moekit::experts` op's autograd); grouped_mm on CPU for aligned sizes,
else loop. An explicit backend without a backward on the device (`moekit.experts.has_backward`:
masked) falls back to Transformers' grouped_mm for such calls, with one warning.

Decoding: an eager call of at most 16 tokens that needs no gradient, on the triton backend, replays
a CUDA graph of the experts recorded for its token count (`moekit.eager_graphs`, keyed by the
weights' addresses and the call's layout; `register(eager_graphs=False)` or MOEKIT_EAGER_GRAPHS=0
turn it off): the same kernels for a fraction of an eager call's host time.

Expert parallelism: Transformers marks the experts another rank owns with the id E (the local
expert count); every id outside [0, E) contributes exactly 0 (no expert weight is read for it) and
its routing weight gets a gradient of exactly 0.

`transformers` is an optional dependency: `_transformers()` imports the few objects of it the
integration uses on the first call that needs them, so importing this package (and `import moekit`)
works without it. The other modules of the package reach Transformers through it too.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moekit import ops
from moekit._validation import FLOAT_DTYPES, check_bool, needs_grad
from moekit.activation import SWIGLU, GatedActivation
from moekit.eager_graphs import eligible, graph_cache, tensor_key
from moekit.experts import ExpertsOptions, check_backend_name, has_backward
from moekit.integrations.transformers.fp8 import (
    fp8_fallback,
    fp8_forward,
    fp8_plan,
    fp8_reason_for_call,
    holds_fp8,
)

__all__ = ["experts_forward", "register", "unsupported_reason"]


@dataclass(frozen=True)
class _Transformers:
    """The few Transformers objects the integration needs, imported once."""

    interface: type                    # ExpertsInterface (a class-wide registry)
    grouped_mm_forward: Callable       # Transformers' grouped_mm experts function: the fallback
    default_apply_gate: Callable | None
    gpt_oss_apply_gate: Callable | None   # GptOssExperts._apply_gate: clamped SwiGLU, interleaved
    silu_types: tuple[type, ...]
    builtin_names: frozenset[str]
    fp8_interface: type | None          # FP8ExpertsInterface: FineGrainedFP8's FP8Experts dispatch here
    fp8_grouped_mm_forward: Callable | None   # its grouped_mm: the fallback of FP8 modules
    fp8_apply_gate: Callable | None     # FP8Experts._apply_gate


_TF: _Transformers | None = None
_registered: dict[str, tuple[str, Callable]] = {}
_warned: set[tuple[str, str]] = set()


def _transformers() -> _Transformers:
    global _TF
    if _TF is not None:
        return _TF
    try:
        moe = importlib.import_module("transformers.integrations.moe")
        activations = importlib.import_module("transformers.activations")
    except ImportError as exc:
        raise ImportError(
            "moekit.integrations.transformers needs Transformers >= 5.0 (the experts interface): "
            "pip install 'moekit[transformers]'"
        ) from exc
    silu = tuple(t for t in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if t is not None)
    interface = moe.ExpertsInterface
    try:
        gpt_oss = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss").GptOssExperts
    except (ImportError, AttributeError):
        gpt_oss = None
    try:
        fp8 = importlib.import_module("transformers.integrations.finegrained_fp8")
    except ImportError:
        fp8 = None
    fp8_interface = getattr(fp8, "FP8ExpertsInterface", None)
    fp8_names = frozenset(fp8_interface._global_mapping) if fp8_interface is not None else frozenset()
    _TF = _Transformers(
        interface=interface,
        grouped_mm_forward=moe.grouped_mm_experts_forward,
        default_apply_gate=getattr(moe, "_default_apply_gate", None),
        gpt_oss_apply_gate=getattr(gpt_oss, "_apply_gate", None),
        silu_types=silu,
        builtin_names=frozenset(moe.ALL_EXPERTS_FUNCTIONS) | fp8_names | {"eager"},
        fp8_interface=fp8_interface,
        fp8_grouped_mm_forward=getattr(fp8, "fp8_grouped_mm_experts_forward", None),
        fp8_apply_gate=getattr(getattr(fp8, "FP8Experts", None), "_apply_gate", None),
    )
    return _TF


def register(name: str = "moekit", *, backend: str = "auto", eager_graphs: bool = True) -> Callable:
    """Register moekit's experts function with Transformers under `name`. Idempotent.

    Args:
        name: the `experts_implementation` name to register (not one of Transformers' own).
        backend: the moekit experts backend, "auto" (triton on CUDA, grouped_mm or loop on CPU) or
            one of `moekit.BACKENDS`.
        eager_graphs: eager calls of at most 16 tokens that need no gradient (decoding) replay a
            CUDA graph of the experts recorded per token count (`moekit.eager_graphs`); False
            launches the kernels one by one. Registering the same name again with another backend
            or eager_graphs replaces the function.

    Returns:
        The registered function (the same object for repeated calls with the same arguments).
    """
    tf = _transformers()
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name in tf.builtin_names:
        raise ValueError(f"name {name!r} is one of Transformers' own experts implementations")
    check_backend_name(backend)
    check_bool("eager_graphs", eager_graphs)
    known = _registered.get(name)
    if known is not None and known[0] == (backend, eager_graphs):
        fn = known[1]
    else:
        if backend == "auto" and eager_graphs:
            fn = experts_forward
        else:
            fn = functools.partial(experts_forward, backend=backend, eager_graphs=eager_graphs)
        _registered[name] = ((backend, eager_graphs), fn)
    tf.interface.register(name, fn)
    if tf.fp8_interface is not None:          # FineGrainedFP8's experts dispatch through their own registry
        tf.fp8_interface.register(name, fn)
    return fn


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why moekit's kernels cannot run this Transformers experts module; None when they can."""
    return _plan(experts)[0]


def _activation_plan(experts: nn.Module, tf: _Transformers) -> tuple[str | None, GatedActivation, bool]:
    """(reason, activation, interleaved) from the module's `_apply_gate`: the default one (act_fn on
    the first half times the second) or gpt-oss's (clamped SwiGLU on interleaved columns)."""
    apply_gate = getattr(type(experts), "_apply_gate", tf.default_apply_gate)
    if tf.gpt_oss_apply_gate is not None and apply_gate is tf.gpt_oss_apply_gate:
        alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
        try:
            return None, GatedActivation("gpt_oss", alpha, limit), True
        except (TypeError, ValueError) as exc:
            return f"gpt-oss gate parameters alpha={alpha!r}, limit={limit!r} ({exc})", SWIGLU, False
    if tf.default_apply_gate is None or apply_gate is not tf.default_apply_gate:
        return "a custom _apply_gate", SWIGLU, False
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up rows with the default _apply_gate (is_concatenated=False)", SWIGLU, False
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, tf.silu_types) or act is F.silu):
        return f"activation {type(act).__name__} (moekit fuses SiLU only)", SWIGLU, False
    return None, SWIGLU, False


def _plan(experts: nn.Module) -> tuple[str | None, dict]:
    """(why moekit cannot run the module, or None; the keyword arguments of `ops.experts` giving its
    (E, 2I, H) / (E, H, I) weights, biases, activation and row layout; for FP8 weights (`holds_fp8`)
    {"fp8": its weights} instead)."""
    tf = _transformers()
    if holds_fp8(experts):
        return fp8_plan(experts, tf)
    if not getattr(experts, "has_gate", True):
        return "non-gated experts (has_gate=False)", {}
    if getattr(experts, "has_post_expert_norm", False):
        return "a post-expert norm (has_post_expert_norm=True)", {}
    reason, activation, interleaved = _activation_plan(experts, tf)
    if reason is not None:
        return reason, {}
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no gate_up_proj / down_proj tensors", {}
    if _is_dtensor(gate_up) or _is_dtensor(down):
        return "DTensor weights", {}
    if gate_up.dtype not in FLOAT_DTYPES or down.dtype != gate_up.dtype:
        return f"weights of dtype {gate_up.dtype} / {down.dtype}", {}
    if gate_up.device.type not in ("cuda", "cpu"):
        return f"weights on {gate_up.device.type}", {}
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"weights of shapes {tuple(gate_up.shape)} / {tuple(down.shape)}", {}
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (num_experts, hidden, two_i // 2):
        return f"weights of shapes {tuple(gate_up.shape)} / {tuple(down.shape)}", {}
    biases = {"gate_up_bias": None, "down_bias": None}
    if getattr(experts, "has_bias", False):
        reason = _bias_reason(experts, gate_up)
        if reason is not None:
            return reason, {}
        biases = {"gate_up_bias": experts.gate_up_proj_bias, "down_bias": experts.down_proj_bias}
    return None, {"gate_up_proj": gate_up, "down_proj": down, **biases, "activation": activation,
                  "interleaved": interleaved}


def _bias_reason(experts: nn.Module, gate_up: torch.Tensor) -> str | None:
    """Why the biases of a has_bias module cannot be read: gate_up_proj_bias (E, 2I) and
    down_proj_bias (E, H) tensors of the weights' dtype and device."""
    num_experts, two_i, hidden = gate_up.shape
    for name, shape in (("gate_up_proj_bias", (num_experts, two_i)),
                        ("down_proj_bias", (num_experts, hidden))):
        bias = getattr(experts, name, None)
        if not isinstance(bias, torch.Tensor) or _is_dtensor(bias):
            return f"expert biases (has_bias=True) without a {name} tensor"
        if bias.dtype != gate_up.dtype or bias.device != gate_up.device or tuple(bias.shape) != shape:
            return (f"expert biases: {name} of shape {tuple(bias.shape)}, {bias.dtype} on {bias.device}; "
                    f"expected {shape}, {gate_up.dtype} on {gate_up.device}")
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    # A DTensor's experts would need its local shard; Transformers swaps those in before the call.
    return type(t).__name__ == "DTensor"


def _warn_once(cls_name: str, reason: str, fallback: str = "grouped_mm") -> None:
    if (cls_name, reason) in _warned or torch.compiler.is_compiling():
        return
    _warned.add((cls_name, reason))
    warnings.warn(f"moekit: {cls_name} has {reason}; running Transformers' {fallback} experts instead",
                  stacklevel=3)


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str = "auto",
    eager_graphs: bool = True,
) -> torch.Tensor:
    """The function `register` installs: Transformers' experts signature on moekit's kernels.

    Args:
        self: a Transformers experts module (`@use_experts_implementation`).
        hidden_states: (T, H); cast to the weights' dtype and the result cast back, as Transformers
            does under autocast.
        top_k_index: (T, K) expert ids; ids outside [0, E) (expert-parallel sentinels) give 0 and
            receive no gradient.
        top_k_weights: (T, K) routing weights.
        backend: see `register`. A call that needs gradients (grad mode on, and the hidden states,
            the weights or the routing weights require grad) runs on moekit when the backend has a
            backward on the device ("auto" always does), else on Transformers' grouped_mm.
        eager_graphs: see `register`.

    Returns:
        (T, H) in the dtype of hidden_states.
    """
    reason, plan = _plan(self)
    fp8_weights = plan.get("fp8")
    if reason is None and fp8_weights is not None:
        reason = fp8_reason_for_call(backend, hidden_states, top_k_weights)
    elif reason is None and backend != "auto":
        biases = [b for b in (plan["gate_up_bias"], plan["down_bias"]) if b is not None]
        math = {k: plan[k] for k in ("gate_up_bias", "down_bias", "activation", "interleaved")}
        options = ExpertsOptions(**ExpertsOptions.math(**math))
        if (not has_backward(backend, self.gate_up_proj.device, options)
                and needs_grad(hidden_states, top_k_weights, self.gate_up_proj, self.down_proj, *biases)):
            reason = (f"inputs that need gradients and backend={backend!r} has no backward on "
                      f"{self.gate_up_proj.device.type} for these experts")
    if reason is not None:
        tf = _transformers()
        fallback = ("grouped_mm", tf.grouped_mm_forward) if not holds_fp8(self) else fp8_fallback(self, tf)
        _warn_once(type(self).__name__, reason, fallback[0])
        return fallback[1](self, hidden_states, top_k_index, top_k_weights)
    if fp8_weights is not None:
        return fp8_forward(self, fp8_weights, hidden_states, top_k_index, top_k_weights, backend,
                           eager_graphs)
    gate_up, down = plan.pop("gate_up_proj"), plan.pop("down_proj")

    def run(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = ops.experts(hidden.to(gate_up.dtype), gate_up, down, weights, ids, backend=backend, **plan)
        return out.to(hidden.dtype)

    inputs = (hidden_states, top_k_index, top_k_weights)
    if eager_graphs and _graphable(inputs, gate_up, down, plan, backend):
        key = ("experts", backend, tensor_key(gate_up), tensor_key(down), tensor_key(plan["gate_up_bias"]),
               tensor_key(plan["down_bias"]), plan["activation"], plan["interleaved"])
        out = graph_cache(self)(run, inputs, key)
        if out is not None:
            return out
    return run(*inputs)


def _graphable(inputs: tuple, gate_up: torch.Tensor, down: torch.Tensor, plan: dict, backend: str) -> bool:
    """An eager decoding call the triton backend serves (`moekit.eager_graphs.eligible`)."""
    tensors = (*inputs, gate_up, down, plan["gate_up_bias"], plan["down_bias"])
    hidden = inputs[0]
    return hidden.dim() == 2 and eligible(hidden.shape[0], tensors, backend)
