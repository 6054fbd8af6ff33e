"""The benchmark's one contract: a runner takes (shape, tokens, backend, mode) and returns stats.

For one preset and T, `make_workload` draws the inputs once and shares them across backends:

    x               (T, H)      dtype       random tokens
    gate_up_proj    (E, 2I, H)  dtype       shared by every T of the preset
    down_proj       (E, H, I)   dtype
    topk_weights    (T, K)      fp32        from moekit.route with a random router (E, H)
    topk_ids        (T, K)      int32
    expected        fp32 reference output and the error budget (bench.correctness)
    traffic         bytes and FLOPs of this routing (bench.roofline)

The layer (backend `LAYER`, "layer"): `moekit.MoELayer` over the same weights, called on x as a user
calls it: the router (moekit's, on the same router weight: the same routing as the workload's) and the
triton experts in one call; an eager call of at most 16 tokens replays the layer's eager graphs
(`moekit.eager_graphs`), so its eager rows are the "eager call, whole layer" a decoding model pays.

The dense pair (backend `dense.DENSE`: the layer's FLOPs as two dense matmuls through one expert,
`moekit.bench.dense`) runs on the same inputs, checked against its own reference: `for_backend`
gives the workload with it.

`run_case` then, for one backend and mode ("eager" or "graph"):
    1. runs it once (graph: captures it, then replays into a NaN-filled output) and checks the result
       against the reference; a failure is reported and never timed;
    2. times it (bench.timing), 3. profiles one call (bench.launches), 4. puts it against the floor.

`moekit bench --backward` runs the same contract on a fwd+bwd workload (`bench.backward`): the call
is one training step returning the four gradients, `expected` their references, `traffic` that of a
forward + backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moekit.bench import dense, peers
from moekit.bench.ceilings import Ceilings
from moekit.bench.correctness import Expected, ExpectedGrads, expected_output
from moekit.bench.launches import LaunchProfile, profile_call
from moekit.bench.roofline import Traffic, bound_of, floor_ms_of, traffic
from moekit.bench.timing import (
    MIN_REP,
    NotCapturable,
    TimingStats,
    cache_flusher,
    capture_graph,
    sync,
    time_fn,
)
from moekit.experts import BACKENDS, PaddedWorkspaceTooLarge, moe_experts
from moekit.layer import MoELayer
from moekit.routing import route
from moekit.shapes import MoEShape

MODES = ("eager", "graph")
LAYER = "layer"
ROUTING_DRAWS = 64
_DRAW_CHUNK_TOKENS = 1 << 16


@dataclass(frozen=True)
class Options:
    """How hard to measure. None means time_fn's defaults (the article's repeat counts)."""

    warmup: int | None = None
    rep: int | None = None
    min_rep: int = MIN_REP
    flush_l2: bool | str = True      # True / "write", "clean" or False: `time_fn`'s flush_l2
    routing_draws: int = ROUTING_DRAWS


DEFAULT_OPTIONS = Options()


@dataclass(frozen=True)
class Weights:
    router_weight: torch.Tensor   # (E, H)
    gate_up_proj: torch.Tensor    # (E, 2I, H), gate rows first
    down_proj: torch.Tensor       # (E, H, I)


@dataclass(frozen=True)
class Workload:
    preset: str
    shape: MoEShape
    tokens: int
    dtype: torch.dtype
    device: torch.device
    weights: Weights
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expected: Expected | ExpectedGrads     # ExpectedGrads for a fwd+bwd workload
    traffic: Traffic
    experts_hit_mean: float
    grad_out: torch.Tensor | None = None   # (T, H) dtype: the output gradient of a fwd+bwd workload


@dataclass(frozen=True)
class Measurement:
    """What the runner returns for one (shape, tokens, backend, mode)."""

    status: str                 # one of results.STATUSES
    reason: str
    max_err: float
    tol: float
    floor_ms: float
    bound: str
    timing: TimingStats | None = None
    launches: LaunchProfile | None = None
    peak_mib: float = math.nan  # device memory one call took above what was held before; NaN: not measured

    @property
    def median_ms(self) -> float:
        return self.timing.median_ms if self.timing else math.nan

    def per_second(self, amount: float, unit: float) -> float:
        return amount / (self.median_ms * 1e-3) / unit if self.timing else math.nan

    @property
    def pct_floor(self) -> float:
        return 100.0 * self.floor_ms / self.median_ms if self.timing else math.nan

    @property
    def idle_pct(self) -> float:
        if not self.timing or not self.launches or math.isnan(self.launches.busy_ms):
            return math.nan
        return max(0.0, 100.0 * (1.0 - self.launches.busy_ms / self.median_ms))

    def columns(self) -> dict:
        """`results.MeasuredColumns` of this measurement (`imbalance` and `ablate` rows)."""
        t = self.timing
        return {"status": self.status, "reason": self.reason, "max_err": self.max_err,
                "floor_ms": self.floor_ms, "median_ms": self.median_ms, "pct_floor": self.pct_floor,
                "p20_ms": t.p20_ms if t else math.nan, "p80_ms": t.p80_ms if t else math.nan,
                "n_rep": t.n if t else None, "kernels": self.launches.kernels if self.launches else None}


def make_weights(shape: MoEShape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Weights:
    """Random weights scaled by 1/sqrt(fan_in), as an untrained layer; drawn on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size

    def draw(*size: int, fan_in: int) -> torch.Tensor:
        return torch.randn(size, generator=g, device=device).div_(math.sqrt(fan_in)).to(dtype)

    return Weights(draw(e, h, fan_in=h), draw(e, 2 * i, h, fan_in=h), draw(e, h, i, fan_in=i))


def memory_bytes(shape: MoEShape, dtype: torch.dtype, tokens: int = 0, *, fp8: bool = False,
                 backward: bool = False, drawn_in_fp32: bool = True) -> int:
    """Bytes a study must hold at once for this layer at T = `tokens`: the most that `make_weights`
    holds while drawing (each tensor drawn in fp32, then cast, unless not `drawn_in_fp32`), or the
    weights with what `make_workload` keeps (x and the fp32 reference output; `quantize_layer`'s e4m3
    copy with fp8; with backward, the fp32 copies of both projections and their gradients
    `training_workload`'s reference makes). A lower bound: the backends' own buffers come on top, so
    a layer over it can never run."""
    e, h, i, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    size = dtype.itemsize
    router, gate_up, down = e * h, e * 2 * i * h, e * h * i       # elements
    weights = (router + gate_up + down) * size
    cast = 4 if drawn_in_fp32 and dtype != torch.float32 else 0     # the fp32 draw beside its cast
    drawing = router * size + max(gate_up * (cast + size), gate_up * size + down * (cast + size))
    held = weights + tokens * (h * (size + 4) + k * 8)
    if fp8:
        held += gate_up + down
    if backward:
        held += 8 * (gate_up + down)
    return max(drawing, held)


def mean_distinct_experts(shape: MoEShape, router_weight: torch.Tensor, tokens: int, draws: int,
                          generator: torch.Generator) -> float:
    """Distinct experts hit by T routed random tokens, averaged over `draws` independent batches."""
    e, h = shape.num_experts, shape.hidden_size
    per_chunk = max(1, _DRAW_CHUNK_TOKENS // tokens)
    total, done = 0.0, 0
    while done < draws:
        n = min(per_chunk, draws - done)
        x = torch.randn(n * tokens, h, generator=generator, device=router_weight.device)
        x = x.to(router_weight.dtype)
        _, ids = route(x, router_weight, shape.top_k, renormalize=shape.norm_topk_prob)
        hit = torch.zeros(n, e, device=ids.device).scatter_(1, ids.view(n, -1).long(), 1.0)
        total += float(hit.sum())
        done += n
    return total / draws


def make_workload(preset: str, shape: MoEShape, tokens: int, weights: Weights, dtype: torch.dtype,
                  device: torch.device, *, seed: int = 0, routing_draws: int = ROUTING_DRAWS) -> Workload:
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + tokens)
    x = torch.randn(tokens, shape.hidden_size, generator=g, device=device).to(dtype)
    w, ids = route(x, weights.router_weight, shape.top_k, renormalize=shape.norm_topk_prob)
    return Workload(
        preset=preset, shape=shape, tokens=tokens, dtype=dtype, device=device, weights=weights,
        x=x, topk_weights=w, topk_ids=ids,
        expected=expected_output(x, weights.gate_up_proj, weights.down_proj, w, ids),
        traffic=traffic(shape, tokens, ids, dtype),
        experts_hit_mean=mean_distinct_experts(shape, weights.router_weight, tokens, routing_draws, g),
    )


Call = Callable[[], object]
BackendFactory = Callable[[Workload], Call]


def _moekit_factory(backend: str) -> BackendFactory:
    def make(work: Workload) -> Call:
        wt = work.weights
        args = (work.x, wt.gate_up_proj, wt.down_proj, work.topk_weights, work.topk_ids)
        return lambda: moe_experts(*args, backend=backend)

    return make


def _peer_factory(name: str) -> BackendFactory:
    def make(work: Workload) -> Call:
        run = peers.make_peer(name, work.shape, work.weights.gate_up_proj, work.weights.down_proj)
        # The model hands its experts int64 ids and weights in the hidden dtype: converted once here,
        # outside the timed call, as the router would have produced them.
        ids, w = work.topk_ids.long(), work.topk_weights.to(work.dtype)
        return lambda: run(work.x, ids, w)

    return make


def _layer_factory(work: Workload) -> Call:
    """MoELayer (router + triton experts, eager graphs on) sharing the workload's weights."""
    wt = work.weights
    with torch.device("meta"):      # no memory and no random init for weights about to be replaced
        layer = MoELayer(work.shape, backend="triton", dtype=work.dtype)
    layer.router_weight = torch.nn.Parameter(wt.router_weight, requires_grad=False)
    layer.gate_up_proj = torch.nn.Parameter(wt.gate_up_proj, requires_grad=False)
    layer.down_proj = torch.nn.Parameter(wt.down_proj, requires_grad=False)
    return functools.partial(layer, work.x)      # .func: the layer


def _dense_factory(work: Workload) -> Call:
    wt = work.weights
    return dense.dense_pair(work.x, wt.gate_up_proj, wt.down_proj, work.topk_ids.shape[1], gemms_only=True)


def backend_factory(name: str) -> BackendFactory:
    """The factory of a moekit backend, a Transformers peer (`bench.peers.PEERS`), the layer
    (`LAYER`) or the dense pair (`bench.dense.DENSE`)."""
    if name in BACKENDS:
        return _moekit_factory(name)
    if peers.is_peer(name):
        return _peer_factory(name)
    if name == LAYER:
        return _layer_factory
    if name == dense.DENSE:
        return _dense_factory
    raise ValueError(f"unknown backend {name!r}; expected one of "
                     f"{BACKENDS + peers.PEERS + (LAYER, dense.DENSE)}")


def for_backend(work: Workload, backend: str) -> Workload:
    """The workload `run_case` times `backend` on: for the dense pair, with the dense pair's reference
    (`dense.dense_expected`; its traffic and floor stay the layer's), else `work` itself. Build it
    once per workload, not per mode: the reference costs a pass of the fp32 layer."""
    if backend != dense.DENSE:
        return work
    w = work.weights
    return replace(work, expected=dense.dense_expected(work.x, w.gate_up_proj, w.down_proj, work.topk_weights,
                                                       work.topk_ids))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _poison(out: object) -> None:
    """NaN-fill a graph's static output (a tensor, or a tuple of them: a training step's gradients)
    so rows a replay never writes fail the check."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(math.nan)


def not_run(work: Workload, ceilings: Ceilings, status: str, reason: str) -> Measurement:
    """The Measurement of a case that was not run (e.g. "skipped"): its floor, no error, no time."""
    return Measurement(status, reason, **_untimed(work, ceilings))


def _untimed(work: Workload, ceilings: Ceilings) -> dict:
    return dict(max_err=math.nan, tol=work.expected.tol, floor_ms=floor_ms_of(work.traffic, ceilings),
                bound=bound_of(work.traffic, ceilings))


def run_case(work: Workload, backend: str, mode: str, ceilings: Ceilings, options: Options = DEFAULT_OPTIONS,
             factory: BackendFactory | None = None) -> Measurement:
    """Check, then time and profile one backend on one workload in one mode (see module doc)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    base = _untimed(work, ceilings)
    if peers.is_peer(backend):
        reason = peers.check_fits(backend, work.shape, work.tokens, work.dtype, work.device)
        if reason:
            return Measurement("skipped", reason, **base)
    make = factory or backend_factory(backend)
    try:
        fn = make(work)
        if mode == "graph":
            graph, out = capture_graph(fn, work.device)
            _poison(out)
            graph.replay()
            call: Call = graph.replay
        else:
            out = fn()
            call = fn
        sync(work.device)
    except NotCapturable as exc:
        return Measurement("not_capturable", str(exc), **base)
    except PaddedWorkspaceTooLarge as exc:
        return Measurement("skipped", _first_line(exc), **base)
    except Exception as exc:  # a backend that raises is reported, not allowed to stop the sweep
        return Measurement("error", _first_line(exc), **base)

    check = work.expected.check(out)
    base.update(max_err=check.max_err, tol=check.tol)
    if not check.ok:
        return Measurement("failed", check.reason, **base)
    try:
        timing = time_fn(call, warmup=options.warmup, rep=options.rep, flush_l2=options.flush_l2,
                         device=work.device, min_rep=options.min_rep)
        launches = profile_call(call, work.device, cache_flusher(work.device, options.flush_l2))
    except Exception as exc:  # e.g. out of memory on a later call: one row lost, not the sweep
        return Measurement("error", "while timing: " + _first_line(exc), **base)
    return Measurement("ok", "", timing=timing, launches=launches, **base)
