"""Patching a model's MoE blocks in place: their classes are swapped for subclasses (parameters,
state dict and isinstance checks unchanged) whose forward runs on moekit.

Llama-4 (`Llama4TextMoe`) does not call the experts interface: its router scales each expert's
INPUT by sigmoid(top-k logit) and runs every expert densely on every token. Since the experts are
nonlinear, that is not a routing weight on the output, so `MoELayer` / `from_transformers` cannot
hold it (they raise). `patch_llama4(model)` runs such blocks on moekit's experts op as Transformers
defines them: per routing slot k, `experts(x * score_k, ids_k, weight 1)` (one call for the top-1
routing of Llama 4 Scout and Maverick), plus the shared expert.

Whole blocks (`patch_moe_blocks(model)`, opt-in): the supported sparse MoE blocks decode through
one graph of the decoder layer's post-attention norm and moekit's router and experts on the block's
own Parameters (one copy in per call instead of the norm's launches, Transformers' router launches
and the experts function's three copies), wherever nothing would notice the router being skipped
(no router-logit recording, no hooks, eval mode, no gradients).
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moekit import ops
from moekit._validation import FLOAT_DTYPES
from moekit.eager_graphs import graph_cache, tensor_key
from moekit.experts import check_backend_name
from moekit.integrations.transformers.convert import _BLOCKS, from_transformers
from moekit.integrations.transformers.experts import _registered, _transformers
from moekit.layer import MoELayer

__all__ = ["llama4_moe_forward", "patch_llama4", "patch_moe_blocks"]


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
    check_backend_name(backend)
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
    True: swapped in as a module's __class__, parameters and state dict stay as they are. Pickled
    (torch.save, deepcopy) as the recipe (cls, forward, flag), which a load makes again: the class
    itself is no module attribute to look up."""
    return type(f"Moekit{cls.__name__}", (cls,), {"forward": forward, flag: True, "__module__": __name__,
                                                  "_moekit_recipe": (cls, forward, flag),
                                                  "__reduce_ex__": _reduce_patched})


def _reduce_patched(self: nn.Module, protocol: int) -> tuple:
    _, _, *state = object.__reduce_ex__(self, protocol)      # (copyreg.__newobj__, (class,), state, ...)
    return (_new_patched, type(self)._moekit_recipe, *state)


def _new_patched(cls: type, forward: Callable, flag: str) -> nn.Module:
    """An empty instance of the patched class of (cls, forward, flag), for a load to fill in."""
    patched = _patched_class(cls, forward, flag)
    return patched.__new__(patched)


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
