"""Hugging Face Transformers (>= 5.0): moekit as an experts implementation, and block <-> MoELayer.

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
transposed or not (a transposed module is read through strided views, no copy). Everything else goes
to Transformers' own grouped_mm path with one warning per (class, reason): non-gated experts, other
activations or custom `_apply_gate`s, the default gate on interleaved rows, a post-expert norm,
quantized or DTensor weights.

Llama-4 (`Llama4TextMoe`) does not call the experts interface: its router scales each expert's
INPUT by sigmoid(top-k logit) and runs every expert densely on every token. Since the experts are
nonlinear, that is not a routing weight on the output, so `MoELayer` / `from_transformers` cannot
hold it (they raise). `patch_llama4(model)` runs such blocks on moekit's experts op as Transformers
defines them: per routing slot k, `experts(x * score_k, ids_k, weight 1)` (one call for the top-1
routing of Llama 4 Scout and Maverick), plus the shared expert.

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

Whole blocks (`patch_moe_blocks(model)`, opt-in): the supported sparse MoE blocks decode through
one graph of the decoder layer's post-attention norm and moekit's router and experts on the block's
own Parameters (one copy in per call instead of the norm's launches, Transformers' router launches
and the experts function's three copies), wherever nothing would notice the router being skipped
(no router-logit recording, no hooks, eval mode, no gradients).

Expert parallelism: Transformers marks the experts another rank owns with the id E (the local
expert count); every id outside [0, E) contributes exactly 0 (no expert weight is read for it) and
its routing weight gets a gradient of exactly 0.

`transformers` is an optional dependency: this module imports it only when one of its functions is
called, so `import moekit` works without it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moekit import ops
from moekit._validation import FLOAT_DTYPES, needs_grad
from moekit.activation import SWIGLU, GatedActivation
from moekit.eager_graphs import eligible, graph_cache, tensor_key
from moekit.experts import BACKENDS, ExpertsOptions, has_backward
from moekit.layer import MoELayer
from moekit.shapes import MoEShape

__all__ = ["experts_forward", "from_transformers", "patch_llama4", "patch_moe_blocks", "register",
           "to_transformers", "unsupported_reason"]

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


@dataclass(frozen=True)
class _Transformers:
    """The few Transformers objects the integration needs, imported once."""

    interface: type                    # ExpertsInterface (a class-wide registry)
    grouped_mm_forward: Callable       # Transformers' grouped_mm experts function: the fallback
    default_apply_gate: Callable | None
    gpt_oss_apply_gate: Callable | None   # GptOssExperts._apply_gate: clamped SwiGLU, interleaved
    silu_types: tuple[type, ...]
    builtin_names: frozenset[str]


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
    _TF = _Transformers(
        interface=interface,
        grouped_mm_forward=moe.grouped_mm_experts_forward,
        default_apply_gate=getattr(moe, "_default_apply_gate", None),
        gpt_oss_apply_gate=getattr(gpt_oss, "_apply_gate", None),
        silu_types=silu,
        builtin_names=frozenset(moe.ALL_EXPERTS_FUNCTIONS) | {"eager"},
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
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if not isinstance(eager_graphs, bool):
        raise TypeError(f"eager_graphs must be a bool, got {eager_graphs!r}")
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
    (E, 2I, H) / (E, H, I) weights, biases, activation and row layout)."""
    tf = _transformers()
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


def _warn_once(cls_name: str, reason: str) -> None:
    if (cls_name, reason) in _warned or torch.compiler.is_compiling():
        return
    _warned.add((cls_name, reason))
    warnings.warn(f"moekit: {cls_name} has {reason}; running Transformers' grouped_mm experts instead",
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
    if reason is None and backend != "auto":
        biases = [b for b in (plan["gate_up_bias"], plan["down_bias"]) if b is not None]
        math = {k: plan[k] for k in ("gate_up_bias", "down_bias", "activation", "interleaved")}
        options = ExpertsOptions(**ExpertsOptions.math(**math))
        if (not has_backward(backend, self.gate_up_proj.device, options)
                and needs_grad(hidden_states, top_k_weights, self.gate_up_proj, self.down_proj, *biases)):
            reason = (f"inputs that need gradients and backend={backend!r} has no backward on "
                      f"{self.gate_up_proj.device.type} for these experts")
    if reason is not None:
        _warn_once(type(self).__name__, reason)
        return _transformers().grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights)
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


def llama4_moe_forward(block: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Llama4TextMoe.forward` with the routed experts on `moekit.ops.experts` (`block.moekit_backend`,
    set by `patch_llama4`).

    Transformers: scores = sigmoid(top-k router logits) (0 elsewhere); every expert e runs on
    x * scores[:, e]; out = shared_expert(x) + the sum over experts. An expert given 0 returns 0
    (gate and up are 0), so only the top-k pairs count: per slot k, experts(x * score_k) for the
    pairs (t, ids[t, k]) with routing weight 1, which moekit computes sparsely.

    Returns:
        (out (T, H), router_logits (T, E)), as the block's own forward.
    """
    x = hidden_states.reshape(-1, block.hidden_dim)
    router_scores, router_logits = block.router(x)
    ids = torch.topk(router_logits, block.top_k, dim=1).indices       # the router's own top-k
    scores = router_scores.gather(1, ids)
    experts = block.experts
    gate_up, down = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    out = block.shared_expert(x)
    for k in range(block.top_k):
        routed = ops.experts((x * scores[:, k:k + 1]).to(gate_up.dtype), gate_up, down, ones, ids[:, k:k + 1],
                             backend=block.moekit_backend)
        out = out + routed.to(out.dtype)
    return out, router_logits


def patch_llama4(model: nn.Module, *, backend: str = "auto") -> int:
    """Run every `Llama4TextMoe` block of `model` on moekit's experts (`llama4_moe_forward`).

    The blocks' class is swapped for a subclass whose forward is `llama4_moe_forward` (parameters,
    state dict and isinstance checks unchanged); calling again changes the backend.

    Args:
        model: a Transformers model holding Llama4TextMoe blocks (Llama4ForCausalLM, ...).
        backend: the moekit experts backend, "auto" or one of `moekit.BACKENDS`.

    Returns:
        The number of blocks patched. Raises ValueError for experts moekit cannot run (an
        activation other than SiLU, weights of another dtype or layout).
    """
    _transformers()
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    base = importlib.import_module("transformers.models.llama4.modeling_llama4").Llama4TextMoe
    patched = 0
    for module in model.modules():
        if not isinstance(module, base):
            continue
        experts = module.experts
        act = getattr(experts, "act_fn", None)
        if not (isinstance(act, _transformers().silu_types) or act is F.silu):
            raise ValueError(f"moekit cannot run Llama4TextExperts with activation {type(act).__name__} "
                             "(moekit fuses SiLU only)")
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if gate_up.dtype not in FLOAT_DTYPES or down.dtype != gate_up.dtype or gate_up.dim() != 3:
            raise ValueError(f"moekit cannot run Llama4TextExperts with weights {tuple(gate_up.shape)} "
                             f"{gate_up.dtype} / {tuple(down.shape)} {down.dtype}")
        if not getattr(type(module), "moekit_patched", False):
            module.__class__ = _patched_class(type(module), llama4_moe_forward, "moekit_patched")
        module.moekit_backend = backend
        patched += 1
    return patched


@functools.cache
def _patched_class(cls: type, forward: Callable, flag: str) -> type:
    """A subclass of cls named Moekit<cls> whose forward is `forward` and whose attribute `flag` is
    True: swapped in as a module's __class__, parameters and state dict stay as they are."""
    return type(f"Moekit{cls.__name__}", (cls,), {"forward": forward, flag: True, "__module__": __name__})


# Decoding through whole-block graphs: router + experts in one replay (`patch_moe_blocks`).

_block_layers: weakref.WeakKeyDictionary[nn.Module, MoELayer | None] = weakref.WeakKeyDictionary()


def patch_moe_blocks(model: nn.Module, *, enabled: bool = True, fold_norm: bool = True) -> int:
    """Let the sparse MoE blocks of `model` decode through one CUDA graph of the whole block.

    With moekit as the experts implementation (`register`; its `eager_graphs` on), an eager call of
    a Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock or MixtralSparseMoeBlock on at most 16 tokens that
    needs no gradient replays a graph of `from_transformers(block)` (moekit's router and experts on
    the block's own Parameters, `moekit.eager_graphs`): one copy in instead of the router's five
    launches and the experts function's three copies. The routing is the block's (softmax, top-k,
    renormalised or not); the routing weights stay fp32 where Transformers rounds them to the model
    dtype, so results agree within bf16 rounding, not bit for bit. Every other call runs the block's
    own forward: prefill, training mode (Mixtral's router jitter), gradients, torch.compile, another
    experts implementation, while Transformers records router logits (`output_router_logits`) or
    any other forward hook watches the router or the experts.

    fold_norm=True (the default) also records the decoder layer's `post_attention_layernorm` in the
    block's graph, for Qwen3MoeDecoderLayer, OlmoeDecoderLayer and MixtralDecoderLayer, whose
    forward feeds that norm's output straight into the block (`residual + mlp(norm(h))`): during a
    call of the decoder layer that takes the fast path, the norm hands its input on untouched and
    the block's replay applies the norm's own ops (the same kernels, so the same result as the norm
    run eagerly). It saves the norm's eager launches (a cast, pow, mean, add, rsqrt, two muls and a
    cast back) at each layer of each decoding step. Called outside its decoder layer's forward, or
    watched by a hook, the norm runs as always; should anything other than the block receive a
    handed-on input, the decoder layer raises rather than return a wrong result.

    The modules' classes are swapped for subclasses (parameters, state dict and isinstance checks
    unchanged), as `patch_llama4` does; enabled=False turns the fast path off again.

    Returns:
        The number of blocks patched.
    """
    _transformers()
    patched = 0
    for module in model.modules():
        if _swap_class(module, _BLOCKS, _block_forward, "moekit_block_patched"):
            module.moekit_block_graphs = enabled      # the block's layer and its graphs are kept
            patched += 1
    for module in model.modules():
        block = module._modules.get("mlp")
        norm = module._modules.get("post_attention_layernorm")
        if block is None or norm is None or not getattr(type(block), "moekit_block_patched", False):
            continue
        fold = enabled and fold_norm and _swap_class(module, _DECODER_LAYERS, _decoder_forward,
                                                      "moekit_layer_patched")
        if fold:
            _swap_class(norm, None, _norm_forward, "moekit_norm_patched")
        block.moekit_fold_norm = fold
    return patched


# The decoder layers whose forward ends `residual + self.mlp(self.post_attention_layernorm(h))`
# (Transformers 5): where `patch_moe_blocks(fold_norm=True)` may fold that norm into the block's graph.
_DECODER_LAYERS: dict[str, tuple[str, str]] = {
    "Qwen3MoeDecoderLayer": ("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe"),
    "OlmoeDecoderLayer": ("olmoe", "transformers.models.olmoe.modeling_olmoe"),
    "MixtralDecoderLayer": ("mixtral", "transformers.models.mixtral.modeling_mixtral"),
}


def _unpatched(cls: type, flag: str) -> type:
    return cls.__mro__[1] if getattr(cls, flag, False) else cls


def _swap_class(module: nn.Module, known: dict | None, forward: Callable, flag: str) -> bool:
    """Give module the patched subclass of its class when that class is one of `known` (by name and
    defining module; None: any class); whether it has it now."""
    base = _unpatched(type(module), flag)
    if known is not None and (base.__name__ not in known or base.__module__ != known[base.__name__][1]):
        return False
    if type(module) is base:
        module.__class__ = _patched_class(base, forward, flag)
    return True


def _decoder_forward(self: nn.Module, *args, **kwargs):
    """The decoder layer's own forward, during which its post_attention_layernorm may hand its input
    on to the block (`patch_moe_blocks(fold_norm=True)`)."""
    base = type(self).__mro__[1]
    if torch.compiler.is_compiling():                # traced as the layer's own forward
        return base.forward(self, *args, **kwargs)
    block = self._modules["mlp"]
    if not block.__dict__.get("moekit_fold_norm", False):
        return base.forward(self, *args, **kwargs)
    norm = self._modules["post_attention_layernorm"]
    norm.__dict__["_moekit_into"] = block
    try:
        out = base.forward(self, *args, **kwargs)
    finally:
        norm.__dict__["_moekit_into"] = None
        handed = block.__dict__.pop("_moekit_prenorm", None)
    if handed is not None:
        raise RuntimeError(
            f"moekit: {base.__name__}.post_attention_layernorm handed its input on to the MoE block, "
            "which was not called with it: this forward is not the one patch_moe_blocks folds the "
            "norm for; call patch_moe_blocks(model, fold_norm=False)")
    return out


def _norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """post_attention_layernorm: during its decoder layer's call, hands its input on to the block
    when the block will replay a graph of norm + block; else the norm's own forward."""
    if torch.compiler.is_compiling():
        return type(self).__mro__[1].forward(self, hidden_states)
    block = self.__dict__.get("_moekit_into")
    if block is None:                                # not armed: called outside its decoder layer
        return type(self).__mro__[1].forward(self, hidden_states)
    hooked = self._forward_pre_hooks or self._forward_hooks
    weight = self._parameters.get("weight")
    # the norm's output has the input's dtype (what the block's graph checked) only when its weight has it
    same_dtype = weight is not None and weight.dtype == hidden_states.dtype
    if hidden_states.dim() == 3 and same_dtype and not hooked:
        layer = _block_fast_layer(block, hidden_states)
        if layer is not None:
            self.__dict__["_moekit_into"] = None             # once per decoder layer call
            block.__dict__["_moekit_prenorm"] = (hidden_states, self, layer)
            return hidden_states
    return type(self).__mro__[1].forward(self, hidden_states)


def _block_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():                # no module state touched while Dynamo traces
        return type(self).__mro__[1].forward(self, hidden_states)
    pending = self.__dict__.pop("_moekit_prenorm", None)
    if pending is not None:
        x, norm, layer = pending
        if x is not hidden_states:
            raise RuntimeError(
                "moekit: the MoE block got another tensor than the one its post_attention_layernorm "
                "handed on; call patch_moe_blocks(model, fold_norm=False)")
        return _replay_with_norm(layer, norm, x)
    layer = _block_fast_layer(self, hidden_states) if hidden_states.dim() == 3 else None
    if layer is None:
        return type(self).__mro__[1].forward(self, hidden_states)
    # The layer's graph replay without its module call: _block_fast_layer checked what forward would.
    return layer._replay(hidden_states.reshape(-1, hidden_states.shape[-1])).view(hidden_states.shape)


def _replay_with_norm(layer: MoELayer, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """block(norm(x)) from one graph of the norm's own forward and the layer (recorded per shape)."""
    norm_forward = type(norm).__mro__[1].forward

    def fn(t: torch.Tensor) -> torch.Tensor:
        normed = norm_forward(norm, t)
        return layer._forward_flat(normed.reshape(-1, normed.shape[-1])).view(normed.shape)

    key = (layer._graph_key(), type(norm).__mro__[1], tensor_key(norm.weight),
           getattr(norm, "variance_epsilon", None))
    out = graph_cache(layer)(fn, (x,), key)
    return fn(x) if out is None else out


def _block_fast_layer(block: nn.Module, hidden_states: torch.Tensor) -> MoELayer | None:
    """The block's MoELayer when a call on hidden_states (B, S, H) may replay its graph
    (`patch_moe_blocks`), else None."""
    if not getattr(block, "moekit_block_graphs", False) or block.training or torch.compiler.is_compiling():
        return None
    experts = block.experts
    name = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    options = _registered.get(name, (None,))[0] if isinstance(name, str) else None
    if options is None or not options[1]:                 # not moekit, or its eager graphs off
        return None
    if _hooked(block) or _recording_router_logits():
        return None
    layer = _block_layer(block, options[0])
    if layer is None or not _layer_replays(layer, hidden_states):
        return None
    return layer


def _layer_replays(layer: MoELayer, x: torch.Tensor) -> bool:
    """Whether the layer's call on x (..., H) replays its eager graph (`moekit.eager_graphs.eligible`),
    with the checks of MoELayer.forward (hidden size and dtype), which the fast path skips."""
    return (layer.eager_graphs and x.shape[-1] == layer.shape.hidden_size
            and x.dtype == layer.gate_up_proj.dtype and layer._graphable(x))


def _block_layer(block: nn.Module, backend: str) -> MoELayer | None:
    """from_transformers(block), kept while it still shares the block's Parameters (rebuilt when one
    was replaced); None for blocks it cannot hold."""
    layer = _block_layers.get(block, False)
    gate, experts = block.gate, block.experts
    if layer is not None and layer is not False and (
            layer.router_weight is not gate.weight or layer.gate_up_proj is not experts.gate_up_proj
            or layer.down_proj is not experts.down_proj or layer.backend != backend):
        layer = False
    if layer is False:
        try:
            layer = from_transformers(block, backend=backend)
        except (TypeError, ValueError):
            layer = None
        else:
            layer.eval()
        _block_layers[block] = layer
    return layer


def _hooked(block: nn.Module) -> bool:
    """Whether a forward hook other than Transformers' output capture watches the router or the
    experts (the graph would skip it), or global module hooks are set."""
    torch_module = torch.nn.modules.module
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or getattr(torch_module, "_global_backward_hooks", None)):
        return True
    for m in (block.gate, block.experts):
        if m._forward_pre_hooks or any(getattr(h, "__name__", "") != "output_capturing_hook"
                                       for h in m._forward_hooks.values()):
            return True
    return False


def _recording_router_logits() -> bool:
    """Whether Transformers is collecting router logits now (`output_router_logits`); True when its
    collector cannot be read (never skip the router then)."""
    collector = _router_logits_collector()
    if collector is None:    # another Transformers: assume it records
        return True
    try:
        collected = collector.get()
    except Exception:
        return True
    return collected is not None and "router_logits" in collected


@functools.cache
def _router_logits_collector():
    """Transformers' context variable of the outputs being captured, or None where it has none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except Exception:
        return None
    return _active_collector
