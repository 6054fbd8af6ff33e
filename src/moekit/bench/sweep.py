"""The sweep: every layer x tokens x backend x mode through `run_case`, as long-format rows.

Backends may include the dense pair (`moekit.bench.dense.DENSE`, checked against its own reference:
`runner.for_backend`). Triton rows record the rows its tiles compute per pair (`rows_per_pair`,
`moekit.bench.kernel_work.triton_rows`: the alignment of the call's config, read back once per T).

A "fwd+bwd" plan (`moekit bench --backward`) times one forward + backward per call instead, eager
and (when the plan has the mode) the whole step in one CUDA graph, through
`bench.backward.run_training_case`.

A plan with `fp8` (`moekit bench --weights fp8`) quantizes each layer's weights once
(`bench.fp8.quantize_layer`) and times every backend that takes FP8 weights twice at each T: on the
dense weights, then on the FP8 ones (rows with `weights` "fp8", checked against the FP8 oracle and
put against the FP8 floor: `bench.fp8.Fp8Workloads`).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from moekit.bench.backward import run_training_case, training_workload
from moekit.bench.ceilings import Ceilings
from moekit.bench.fp8 import Fp8Workloads, fp8_backends, quantize_layer, takes_fp8
from moekit.bench.kernel_work import TILED, triton_rows
from moekit.bench.layers import Layer
from moekit.bench.results import DIRECTIONS, FP8, Provenance, ResultRow
from moekit.bench.runner import (
    DEFAULT_OPTIONS,
    MODES,
    BackendFactory,
    Measurement,
    Options,
    Workload,
    for_backend,
    make_weights,
    make_workload,
    run_case,
)

# ResultRow.cache for a run's flush_l2 (`Options`)
CACHE_LABELS = {True: "flushed", "write": "flushed", "clean": "flushed clean", False: "warm"}


@dataclass(frozen=True)
class Plan:
    """layers: presets, --shape or --config layers (`moekit.bench.layers`); each one's name is its
    rows' preset column. direction: "fwd", or "fwd+bwd" (one forward + backward per call). fp8: also
    time the backends that take FP8 weights on the layer's weights quantized (forward only)."""

    layers: tuple[Layer, ...]
    tokens: tuple[int, ...]
    backends: tuple[str, ...]
    modes: tuple[str, ...]
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    direction: str = "fwd"
    fp8: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "tokens", "backends", "modes"):
            if not getattr(self, name):
                raise ValueError(f"Plan.{name} must not be empty")
        if any(t < 1 for t in self.tokens):
            raise ValueError(f"token counts must be >= 1, got {self.tokens}")
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"modes must be in {MODES}, got {bad}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.fp8 and self.direction != "fwd":
            raise ValueError("FP8 weights are timed forward only (FP8 experts are inference only)")
        if self.fp8 and not self.fp8_backends:
            raise ValueError(f"FP8 weights: none of the backends {list(self.backends)} takes them; those "
                             f"that do: {fp8_backends()}")

    @property
    def presets(self) -> tuple[str, ...]:
        """The layers' names (the rows' preset column)."""
        return tuple(layer.name for layer in self.layers)

    @property
    def fp8_backends(self) -> tuple[str, ...]:
        """The backends timed on FP8 weights too (none without `fp8`)."""
        return tuple(fp8_backends(self.backends)) if self.fp8 else ()

    @property
    def num_cases(self) -> int:
        backends = len(self.backends) + len(self.fp8_backends)
        return len(self.layers) * len(self.tokens) * backends * len(self.modes)


def to_row(prov: Provenance, work: Workload, backend: str, mode: str, m: Measurement,
           direction: str = "fwd", flushed: bool | str = True, rows_per_pair: float = math.nan,
           weights: str = "") -> ResultRow:
    """The row of one measurement; its bytes and FLOPs are `work`'s. weights: "" for the dtype's
    weights (the row records the dtype's name), or `results.FP8`."""
    s, t = work.shape, work.traffic
    timing, launches = m.timing, m.launches
    return ResultRow(
        **asdict(prov),
        preset=work.preset, num_experts=s.num_experts, hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size, top_k=s.top_k, tokens=work.tokens,
        backend=backend, mode=mode, status=m.status, reason=m.reason, max_err=m.max_err, tol=m.tol,
        median_ms=m.median_ms,
        p20_ms=timing.p20_ms if timing else float("nan"),
        p80_ms=timing.p80_ms if timing else float("nan"),
        n_rep=timing.n if timing else None,
        bytes=t.bytes, flops=t.flops, floor_ms=m.floor_ms, bound=m.bound, pct_floor=m.pct_floor,
        gbps=m.per_second(t.bytes, 1e9), tflops=m.per_second(t.flops, 1e12),
        kernels=launches.kernels if launches else None,
        busy_ms=launches.busy_ms if launches else float("nan"),
        idle_pct=m.idle_pct,
        experts_hit=t.experts_hit, experts_hit_mean=work.experts_hit_mean,
        experts_expected=s.expected_distinct_experts(work.tokens),
        direction=direction, peak_mib=m.peak_mib, cache=CACHE_LABELS[flushed],
        rows_per_pair=rows_per_pair, weights=weights or str(work.dtype).removeprefix("torch."),
    )


def rows_per_pair(work: Workload, direction: str) -> float:
    """Rows the triton backend's tiles compute per pair on this workload (NaN when it cannot tell:
    an error there is the triton rows' own to report)."""
    try:
        return triton_rows(work.x, work.weights.gate_up_proj, work.topk_ids,
                           grad=direction == "fwd+bwd").per_pair
    except Exception:   # the triton case itself records what went wrong
        return math.nan


Case = tuple[str, Workload, BackendFactory | None, float]   # (weights, workload, factory, rows_per_pair)


def _cases(work: Workload, backend: str, direction: str, fp8: Fp8Workloads | None) -> Iterator[Case]:
    """One backend's cases at one T: on the dense weights, then (an FP8 plan, a backend that takes
    them) on the FP8 weights."""
    per_pair = rows_per_pair(work, direction) if backend == TILED else math.nan
    yield "", for_backend(work, backend), None, per_pair
    if fp8 is not None and takes_fp8(backend):
        yield FP8, fp8.for_backend(backend), fp8.factory(backend), math.nan


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_sweep(plan: Plan, ceilings: Ceilings, prov: Provenance, options: Options = DEFAULT_OPTIONS,
              on_case: Callable[[str, ResultRow | None], None] | None = None) -> list[ResultRow]:
    """Run every case of `plan`; `on_case(description, row)` is called before (row None) and after each."""
    rows: list[ResultRow] = []
    for layer in plan.layers:
        preset, shape = layer.name, layer.shape
        weights = make_weights(shape, plan.dtype, plan.device, plan.seed)
        experts = quantize_layer(weights) if plan.fp8 else None
        for tokens in plan.tokens:
            work = make_workload(preset, shape, tokens, weights, plan.dtype, plan.device, seed=plan.seed,
                                 routing_draws=options.routing_draws)
            if plan.direction == "fwd+bwd":
                work = training_workload(work, plan.seed)
            fp8 = Fp8Workloads(work, experts) if experts is not None else None
            for backend in plan.backends:
                for label, case_work, factory, per_pair in _cases(work, backend, plan.direction, fp8):
                    for mode in plan.modes:
                        what = f"{preset} T={tokens} {backend}{' ' + label if label else ''} {mode}"
                        if on_case:
                            on_case(what, None)
                        if plan.direction == "fwd+bwd":
                            m = run_training_case(work, backend, ceilings, options, mode)
                        else:
                            m = run_case(case_work, backend, mode, ceilings, options, factory)
                        row = to_row(prov, case_work, backend, mode, m, plan.direction, options.flush_l2,
                                     per_pair, label)
                        rows.append(row)
                        if on_case:
                            on_case(what, row)
                        _free(plan.device)
                    del case_work
            del work, fp8
        del weights, experts
        _free(plan.device)
    return rows

