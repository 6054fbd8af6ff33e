"""The sweep: every layer x tokens x backend x mode through `run_case`, as long-format rows.

Backends may include the dense pair (`moekit.bench.dense.DENSE`, checked against its own reference:
`runner.for_backend`). Triton rows record the rows its tiles compute per pair (`rows_per_pair`,
`moekit.bench.kernel_work.triton_rows`: the alignment of the call's config, read back once per T).

A "fwd+bwd" plan (`moekit bench --backward`) times one forward + backward per call instead, eager
and (when the plan has the mode) the whole step in one CUDA graph, through
`bench.backward.run_training_case`.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from moekit.bench.backward import run_training_case, training_workload
from moekit.bench.ceilings import Ceilings
from moekit.bench.kernel_work import TILED, triton_rows
from moekit.bench.layers import Layer
from moekit.bench.results import DIRECTIONS, Provenance, ResultRow
from moekit.bench.runner import (
    DEFAULT_OPTIONS,
    MODES,
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
    rows' preset column. direction: "fwd", or "fwd+bwd" (one forward + backward per call)."""

    layers: tuple[Layer, ...]
    tokens: tuple[int, ...]
    backends: tuple[str, ...]
    modes: tuple[str, ...]
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    direction: str = "fwd"

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

    @property
    def presets(self) -> tuple[str, ...]:
        """The layers' names (the rows' preset column)."""
        return tuple(layer.name for layer in self.layers)

    @property
    def num_cases(self) -> int:
        return len(self.layers) * len(self.tokens) * len(self.backends) * len(self.modes)


def to_row(prov: Provenance, work: Workload, backend: str, mode: str, m: Measurement,
           direction: str = "fwd", flushed: bool | str = True, rows_per_pair: float = math.nan) -> ResultRow:
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
        rows_per_pair=rows_per_pair,
    )


def rows_per_pair(work: Workload, direction: str) -> float:
    """Rows the triton backend's tiles compute per pair on this workload (NaN when it cannot tell:
    an error there is the triton rows' own to report)."""
    try:
        return triton_rows(work.x, work.weights.gate_up_proj, work.topk_ids,
                           grad=direction == "fwd+bwd").per_pair
    except Exception:   # the triton case itself records what went wrong
        return math.nan


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
        for tokens in plan.tokens:
            work = make_workload(preset, shape, tokens, weights, plan.dtype, plan.device, seed=plan.seed,
                                 routing_draws=options.routing_draws)
            if plan.direction == "fwd+bwd":
                work = training_workload(work, plan.seed)
            for backend in plan.backends:
                case_work = for_backend(work, backend)
                per_pair = rows_per_pair(work, plan.direction) if backend == TILED else math.nan
                for mode in plan.modes:
                    what = f"{preset} T={tokens} {backend} {mode}"
                    if on_case:
                        on_case(what, None)
                    if plan.direction == "fwd+bwd":
                        m = run_training_case(work, backend, ceilings, options, mode)
                    else:
                        m = run_case(case_work, backend, mode, ceilings, options)
                    row = to_row(prov, work, backend, mode, m, plan.direction, options.flush_l2, per_pair)
                    rows.append(row)
                    if on_case:
                        on_case(what, row)
                    _free(plan.device)
                del case_work
            del work
        del weights
        _free(plan.device)
    return rows

