"""MoELayer: router + experts as an nn.Module, and whole-layer CUDA-graph capture.

An eager call of at most `moekit.eager_graphs.EAGER_GRAPH_MAX_TOKENS` tokens on a CUDA device with
nothing needing gradients replays a graph of the whole layer recorded for its token count
(`eager_graphs=True`, the default; see `moekit.eager_graphs`): same kernels, same result, a
fraction of the host time.

`MoELayer.capture(max_tokens)` records one graph per token bucket (powers of two up to max_tokens,
and max_tokens) over shared static buffers. A call with T tokens copies them into the smallest
bucket >= T and writes T into a device scalar; the router kernel gives the bucket's padding rows
id -1, so they touch no expert and stale rows from earlier calls never leak into the result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moekit._validation import check_bool, check_dtype, check_layer_input, check_replay_input
from moekit.eager_graphs import CapturedWeights, eligible, graph_cache, tensor_key
from moekit.experts import ExpertsOptions, check_backend_name, get_backend, moe_experts, resolve_backend
from moekit.graphs import capture_graph
from moekit.routing import check_router_backend, route, topk_softmax
from moekit.shapes import MoEShape, get_shape


class MoELayer(nn.Module):
    """A mixture-of-experts layer with SwiGLU experts (Transformers weight layout).

    Args:
        shape: an `MoEShape` or a preset name from `moekit.PRESETS`.
        backend: experts backend, "auto" or one of `moekit.BACKENDS`.
        router_backend: "auto", "torch" or "triton".
        eager_graphs: let eager calls at decode sizes replay a per-token-count CUDA graph of the
            layer (`moekit.eager_graphs`); False always launches the kernels one by one.
        dtype, device: of the parameters; dtype may be given by name ("bfloat16").

    Parameters:
        router_weight (E, H), gate_up_proj (E, 2I, H) with gate rows first, down_proj (E, H, I).
    """

    def __init__(self, shape: MoEShape | str, *, backend: str = "auto", router_backend: str = "auto",
                 eager_graphs: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        self.eager_graphs = check_bool("eager_graphs", eager_graphs)
        dtype = check_dtype("dtype", dtype)
        self.shape = get_shape(shape)
        check_backend_name(backend)                 # named now, as dtype is, not at the first call
        check_router_backend(router_backend, "router_backend")
        self.backend = backend
        self.router_backend = router_backend
        e, h, i = self.shape.num_experts, self.shape.hidden_size, self.shape.intermediate_size
        kw = dict(dtype=dtype, device=device)
        self.router_weight = nn.Parameter(torch.empty(e, h, **kw))
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, **kw))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        h, i = self.shape.hidden_size, self.shape.intermediate_size
        for p, fan_in in ((self.router_weight, h), (self.gate_up_proj, h), (self.down_proj, i)):
            # Drawn in fp32 on the CPU so that a seed gives the same weights on every device.
            p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))

    def extra_repr(self) -> str:
        s = self.shape
        return (f"experts={s.num_experts}, hidden={s.hidden_size}, intermediate={s.intermediate_size}, "
                f"top_k={s.top_k}, backend={self.backend!r}")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.router_weight, self.shape.top_k, renormalize=self.shape.norm_topk_prob,
                     backend=self.router_backend)

    def forward(self, x: torch.Tensor, **experts_opts) -> torch.Tensor:
        """x (..., H) -> (..., H). Extra keyword arguments go to `moekit.moe_experts`."""
        check_layer_input(x, self.shape.hidden_size)
        dtype = self.gate_up_proj.dtype
        if x.dtype != dtype:
            raise TypeError(f"x has dtype {x.dtype}, but this layer's parameters are {dtype}; "
                            f"cast x (x.to({dtype})) or the layer (layer.to(dtype))")
        flat = x if x.dim() == 2 else x.reshape(-1, self.shape.hidden_size)   # (T, H) as it comes
        if self.eager_graphs and not experts_opts and self._graphable(flat):
            out = self._replay(flat)
        else:
            out = self._forward_flat(flat, **experts_opts)
        return out if flat is x else out.view(x.shape)

    def _replay(self, flat: torch.Tensor) -> torch.Tensor:
        """The layer on flat (T, H) from its eager graph (recorded on first use), or computed when
        the call cannot be recorded: for callers that checked `_graphable(flat)` and the input's
        shape and dtype (forward; the patched Transformers blocks, which skip the module call)."""
        out = graph_cache(self)(self._forward_flat, (flat,), self._graph_key())
        return self._forward_flat(flat) if out is None else out

    def _forward_flat(self, flat: torch.Tensor, **experts_opts) -> torch.Tensor:
        weights, ids = self.route(flat)
        return moe_experts(flat, self.gate_up_proj, self.down_proj, weights, ids,
                           backend=self.backend, **experts_opts)

    def _graphable(self, x: torch.Tensor) -> bool:
        """Whether a call on x (..., H), T = its rows, may replay an eager graph (`eligible`)."""
        params = (x, self.router_weight, self.gate_up_proj, self.down_proj)
        return eligible(x.shape[:-1].numel(), params, self.backend)

    def _graph_key(self) -> tuple:
        """What a graph of this layer bakes in: the weights it reads in place and the backends."""
        return (self.backend, self.router_backend, self.shape, tensor_key(self.router_weight),
                tensor_key(self.gate_up_proj), tensor_key(self.down_proj))

    def capture(self, max_tokens: int, buckets: Sequence[int] | None = None) -> CapturedMoE:
        """Record the whole layer (router included) in CUDA graphs for any T <= max_tokens."""
        return CapturedMoE(self, max_tokens, buckets)


def default_buckets(max_tokens: int) -> list[int]:
    out, b = [], 1
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


WEIGHT_NAMES = ("router_weight", "gate_up_proj", "down_proj")   # what a captured layer reads in place


class CapturedMoE:
    """Callable replaying a captured MoELayer. Weights are read in place at every replay: copy_ new
    values into them; replacing one (a new Parameter, `.data` swapped) makes the next call raise.

    The returned tensor is a view into a static buffer, overwritten by the next call: clone it
    to keep it. A replay is forward-only: call it under torch.no_grad() or torch.inference_mode()
    (or freeze the layer with `requires_grad_(False)`); to train, call the layer itself.
    """

    def __init__(self, layer: MoELayer, max_tokens: int, buckets: Sequence[int] | None = None):
        p = layer.gate_up_proj
        if not p.is_cuda:
            raise ValueError("MoELayer.capture needs the layer on a CUDA device")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if resolve_backend(layer.backend, p.device) != "triton":
            raise ValueError("MoELayer.capture supports the triton backend (the others sync the host)")
        self.layer = layer
        self.weights = CapturedWeights("MoELayer", layer, WEIGHT_NAMES)
        self.max_tokens = max_tokens
        self.buckets = sorted(set(buckets or default_buckets(max_tokens)))
        if self.buckets[-1] != max_tokens or self.buckets[0] < 1:
            raise ValueError(f"buckets must lie in [1, max_tokens] and include max_tokens, got {buckets}")
        shape, dev = layer.shape, p.device
        self.x = torch.zeros(max_tokens, shape.hidden_size, dtype=p.dtype, device=dev)
        self.out = torch.zeros_like(self.x)
        self.num_valid = torch.zeros((), dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        self.num_valid.fill_(max_tokens)
        with torch.no_grad():
            for b in reversed(self.buckets):   # the largest first: the others reuse its pool memory
                body = functools.partial(self._body, b)
                self.graphs[b], _ = capture_graph(body, dev, pool=pool)

    def _body(self, bucket: int) -> None:
        """One bucket's layer, as an eager call of `bucket` tokens runs it: the backend picks the
        tiles (the tuned config for `bucket` rows) or the direct decode path, so nothing is named here."""
        layer, shape = self.layer, self.layer.shape
        x = self.x[:bucket]
        logits = F.linear(x, layer.router_weight)
        weights, ids = topk_softmax(logits, shape.top_k, renormalize=shape.norm_topk_prob,
                                    backend=layer.router_backend, num_valid_tokens=self.num_valid)
        get_backend("triton").run(x, layer.gate_up_proj, layer.down_proj, weights, ids, ExpertsOptions(),
                                  self.out[:bucket])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) with T <= max_tokens -> (T, H) view of the static output. Forward-only: a call
        that autograd would record (grad mode on, x or the layer's parameters requiring grad) raises."""
        num_tokens = check_replay_input(x, self.x, self.max_tokens, self.weights.tensors())
        self.weights.check()
        if num_tokens == 0:
            return self.out[:0]
        bucket = next(b for b in self.buckets if b >= num_tokens)
        self.x[:num_tokens].copy_(x)
        self.num_valid.fill_(num_tokens)
        self.graphs[bucket].replay()
        return self.out[:num_tokens]
