"""CUDA graphs behind eager calls at decode sizes: an eager call that costs a replay, not a launch storm.

At a handful of tokens an MoE layer's GPU work is tens of microseconds, while an eager call's host
work (Python, the dispatcher, the router's and the expert path's launches) is 100-250 us: a model
that decodes eagerly waits on the host. `GraphCache` records such a call once per token count in a
CUDA graph over static input buffers; a later eager call with the same key copies its inputs into
those buffers (one multi-tensor copy for all of them, `copy_in`), replays the graph and returns a
clone of the graph's static output. The graph runs the very kernels, tiles and launch order of the
eager call it recorded, so the result is the same bit for bit.

Who uses it: `MoELayer.forward` (router + experts, `eager_graphs=True` by default) and the
Transformers experts function (`moekit.integrations.transformers.register(eager_graphs=True)`).
A call takes the graph only when every one of these holds (`eligible`), else it runs as before:

    - 1 <= T <= max_tokens (EAGER_GRAPH_MAX_TOKENS = 16: above it the GPU time outgrows the host's);
    - every tensor is a plain CUDA tensor (no FakeTensor, DTensor or other subclass) and the
      interpreter is off;
    - no gradient is needed (grad mode off, or nothing requires grad): a graph has no autograd;
    - not under torch.compile and not inside a stream capture (the caller's own graph records the
      eager kernels instead);
    - MOEKIT_EAGER_GRAPHS is not "0" (read at import; `set_enabled` switches it at run time).

What the graph keeps fixed, and so what its key must name (the caller's `key`, plus each input's
shape, dtype and device and the autocast state, which the cache adds): the weights' addresses,
shapes and strides (an in-place update of a weight is seen by the next replay; a new weight tensor
at a new address gets a graph of its own) and every option that changes the launches. Process-wide
settings (tuning tables, MOEKIT_* switches) are read when a graph is recorded: after changing one,
`graph_cache(module).clear()`. A call whose work cannot be recorded (it syncs the host,
`moekit.graphs.NotCapturable`) is remembered and runs eagerly from then on.

Memory: each cache (one per module, held weakly: it goes with the module) keeps at most
`max_graphs` graphs (least recently used dropped first) in one private memory pool, with their
static inputs and outputs; at decode sizes that is a few MB a layer. Recording costs a few eager
calls and synchronises the device once, the first time each token count is seen (as a JIT compile
does); later calls never synchronise. Under `torch.cuda.set_sync_debug_mode` other than "default"
nothing is recorded (the calls run their kernels). Replays of one cache must not run concurrently
from two threads (they share the static buffers), as a module's eager calls normally do not.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moekit import env
from moekit._validation import interpreting
from moekit.experts import resolve_backend
from moekit.graphs import NotCapturable, capture_graph

__all__ = ["EAGER_GRAPH_MAX_TOKENS", "CapturedWeights", "GraphCache", "eligible", "graph_cache",
           "set_enabled", "tensor_key"]

EAGER_GRAPH_MAX_TOKENS = 16
MAX_GRAPHS = 2 * EAGER_GRAPH_MAX_TOKENS    # every token count of two weight sets: a batch size that
                                           # varies from step to step never evicts a graph it needs
_PLAIN = (torch.Tensor, nn.Parameter)

_enabled = env.flag("MOEKIT_EAGER_GRAPHS")


def set_enabled(enabled: bool) -> bool:
    """Turn eager graphs on or off for the whole process; returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, bool(enabled)
    return before


def eligible(num_tokens: int, tensors: Sequence[torch.Tensor | None], backend: str = "auto",
             max_tokens: int = EAGER_GRAPH_MAX_TOKENS) -> bool:
    """Whether an eager call over these tensors (None entries skipped) on the experts `backend` may
    replay a graph: only the triton backend records (the others read routing back to the host).

    Under torch.compile it answers False before reading num_tokens: a comparison of a symbolic
    token count would add a guard (T <= 16) and a recompile past it."""
    if not _enabled or torch.compiler.is_compiling() or not 1 <= num_tokens <= max_tokens:
        return False
    present = [t for t in tensors if t is not None]
    if not present or any(type(t) not in _PLAIN or not t.is_cuda for t in present):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    if interpreting() or resolve_backend(backend, present[0].device) != "triton":
        return False
    return not torch.cuda.is_current_stream_capturing()


def tensor_key(t: torch.Tensor | None) -> Hashable:
    """What a graph bakes in of a tensor it reads in place (a weight): address, shape, strides, dtype."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class CapturedWeights:
    """The weights a captured layer's graphs read in place, as recorded at capture (`tensor_key`).
    `check()` before a replay raises if one was replaced since (a new Parameter, `.data` swapped):
    the graphs would read the old, perhaps freed, memory. An in-place `copy_` keeps the key and stays
    allowed. Reads attributes only: no host sync."""

    def __init__(self, owner: str, module: nn.Module, names: Sequence[str]):
        self.owner, self.module, self.names = owner, module, tuple(names)
        self.keys = tuple(tensor_key(getattr(module, n)) for n in self.names)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The weights as the module holds them now."""
        return tuple(getattr(self.module, n) for n in self.names)

    def check(self) -> None:
        for name, key in zip(self.names, self.keys):
            if tensor_key(getattr(self.module, name)) != key:
                raise RuntimeError(f"{self.owner}.{name} was replaced after the capture (its graphs read the "
                                   "captured tensor's memory); capture the layer again, or copy_ new values "
                                   "into the captured parameter in place")


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]      # static buffers the graph reads
    output: torch.Tensor                  # static buffer every replay rewrites
    input_bytes: list[torch.Tensor]       # the static inputs viewed as bytes (`copy_in`)


def as_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """t's elements viewed as a 1-D uint8 tensor (no copy), or None when t is not contiguous."""
    if not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


def copy_in(statics: tuple[torch.Tensor, ...], static_bytes: list[torch.Tensor],
            inputs: tuple[torch.Tensor, ...]) -> None:
    """statics[i].copy_(inputs[i]) for every i, as one multi-tensor launch when every input is
    contiguous (the byte views of inputs of different dtypes share one dtype, uint8, so a single
    `torch._foreach_copy_` serves them all), else one copy each. On a GPU each launch is host time."""
    if len(inputs) > 1:
        sources = [as_bytes(t) for t in inputs]
        if all(s is not None for s in sources):
            torch._foreach_copy_(static_bytes, sources)
            return
    for static, t in zip(statics, inputs):
        static.copy_(t)


def _autocast_state() -> tuple:
    """Autocast on CUDA as a graph records it: a call under another state must not replay it (the
    router's linear, say, would run in another dtype)."""
    return (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


class GraphCache:
    """Graphs of one module's eager calls, keyed by the caller's key and the inputs' shapes and dtypes.

    `cache(fn, inputs, key)` returns fn(*inputs) computed by a replay, or None when this call cannot
    be recorded (the caller then runs fn itself). fn must return one tensor and read its inputs only
    through its arguments; every tensor it reads otherwise (weights) must be named by key.
    """

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.max_graphs = max_graphs
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._uncapturable: set[Hashable] = set()
        self._pool = None
        self.captures = 0          # graphs recorded so far (the tests read it)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._uncapturable.clear()

    def __call__(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                 key: Hashable) -> torch.Tensor | None:
        full = (key, tuple((tuple(t.shape), t.dtype, t.device) for t in inputs), _autocast_state())
        entry = self._entries.get(full)
        if entry is None:
            if full in self._uncapturable:
                return None
            entry = self._record(fn, inputs, full)
            if entry is None:
                return None
        else:
            self._entries.move_to_end(full)
        copy_in(entry.inputs, entry.input_bytes, inputs)
        entry.graph.replay()
        return entry.output.clone()

    def _record(self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                full: Hashable) -> _Entry | None:
        device = inputs[0].device
        if device.type != "cuda":           # no graph off CUDA: the caller runs fn, now and for this key
            self._uncapturable.add(full)
            return None
        if torch.cuda.get_sync_debug_mode() != 0:     # the caller watches for syncs: record nothing
            return None
        # Normal (not inference-mode) tensors: an eager call under inference_mode copies into them
        # later, which inference tensors would refuse outside inference mode.
        with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
            static = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in inputs)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                graph, output = capture_graph(lambda: fn(*static), device, pool=self._pool)
            except NotCapturable:
                self._uncapturable.add(full)
                return None
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"an eager-graph call must return one tensor, got {type(output).__name__}")
        entry = _Entry(graph, static, output, [as_bytes(t) for t in static])
        self._entries[full] = entry
        self.captures += 1
        while len(self._entries) > self.max_graphs:
            self._entries.popitem(last=False)
        return entry


_caches: weakref.WeakKeyDictionary[nn.Module, GraphCache] = weakref.WeakKeyDictionary()


def graph_cache(module: nn.Module) -> GraphCache:
    """The module's cache (made on first use; it lives as long as the module, outside its state, so
    state_dict, deepcopy and pickling never see it)."""
    cache = _caches.get(module)
    if cache is None:
        cache = _caches[module] = GraphCache()
    return cache
