"""`moekit bench --backward`: one forward + backward of the expert path per call, eager and in a CUDA graph.

For one workload (`runner.make_workload`), `training_workload` adds

    grad_out    (T, H)  dtype   the output gradient, drawn from the run's seed
    expected    the fp32 reference gradients of x, gate_up_proj, down_proj and topk_weights, with
                their budgets (`correctness.expected_grads`, the 2x rule)
    traffic     the bytes and FLOPs of a forward + backward (`roofline.training_traffic`)

One call (`TrainingStep`) is one training step of the experts: the inputs' .grad set to None (as
`zero_grad(set_to_none=True)`), `moe_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids,
backend=...)` with x, both weights and the routing weights requiring grad, then `.backward(grad_out)`.

`run_training_case`, for one backend and mode:
    0. skipped when the registry says it has no backward on this device (`Backend.backward_devices`);
    1. runs one step and checks the four gradients: a failure is reported, never timed; then times
       the step (an L2 flush before each call) and profiles one (`runner.run_case`);
       mode "graph": the whole step, forward and backward, is recorded in one CUDA graph
       (`moekit.graphs.capture_graph`, as PyTorch's whole-network capture records a training
       step: the grads set to None, then the backward allocates them from the graph's pool, and
       every replay rewrites the same tensors), its gradients poisoned (NaN) and checked after one
       replay, then its replays timed. What an eager training loop pays in host time (Python,
       launches, the autograd engine) is gone there: the two modes side by side say how much of a
       step is the host's. A step that syncs the host or cannot be captured is reported
       not_capturable;
    2. on CUDA, eager: the peak memory of one step above what was held before it
       (`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`); NaN on the CPU, where it
       is not measured, and for graph rows (the graph's pool holds its memory for its lifetime:
       the eager row of the same backend gives the step's peak).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from moekit.bench.ceilings import Ceilings
from moekit.bench.correctness import expected_grads
from moekit.bench.roofline import training_traffic
from moekit.bench.runner import DEFAULT_OPTIONS, Measurement, Options, Workload, not_run, run_case
from moekit.bench.timing import sync
from moekit.experts import get_backend, moe_experts

MIB = 2**20


def training_workload(work: Workload, seed: int = 0) -> Workload:
    """`work` as a fwd+bwd workload: its output gradient, reference gradients and traffic."""
    g = torch.Generator(device=work.device).manual_seed(seed * 1_000_003 + work.tokens + 1)
    grad_out = torch.randn(work.tokens, work.shape.hidden_size, generator=g, device=work.device)
    grad_out = grad_out.to(work.dtype)
    wt = work.weights
    return replace(
        work, grad_out=grad_out,
        expected=expected_grads(work.x, wt.gate_up_proj, wt.down_proj, work.topk_weights, work.topk_ids,
                                grad_out),
        traffic=training_traffic(work.shape, work.tokens, work.topk_ids, work.dtype))


class TrainingStep:
    """One forward + backward of a backend on a fwd+bwd workload; returns the four gradients."""

    def __init__(self, work: Workload, backend: str):
        if work.grad_out is None:
            raise ValueError("TrainingStep needs a fwd+bwd workload (bench.backward.training_workload)")
        wt = work.weights
        # Leaves sharing the workload's storage: no copies, and .grad lands on these views only.
        self.leaves = tuple(t.detach().requires_grad_(True)
                            for t in (work.x, wt.gate_up_proj, wt.down_proj, work.topk_weights))
        self.topk_ids, self.grad_out, self.backend = work.topk_ids, work.grad_out, backend

    def zero_grad(self) -> None:
        for t in self.leaves:
            t.grad = None

    def __call__(self) -> tuple[torch.Tensor | None, ...]:
        self.zero_grad()
        with torch.enable_grad():
            moe_experts(*self.leaves, self.topk_ids, backend=self.backend).backward(self.grad_out)
        return tuple(t.grad for t in self.leaves)


def peak_mib(step: TrainingStep, device: torch.device) -> float:
    """MiB of device memory one step takes above what is held before it (its gradients included);
    NaN off CUDA (not measured)."""
    if device.type != "cuda":
        return math.nan
    step.zero_grad()
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        step()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - before) / MIB
    finally:
        step.zero_grad()


def run_training_case(work: Workload, backend: str, ceilings: Ceilings,
                      options: Options = DEFAULT_OPTIONS, mode: str = "eager") -> Measurement:
    """Check, time, profile and measure the memory of one training step in `mode` (see module doc)."""
    devices = get_backend(backend).backward_devices       # ValueError naming the backends if unknown
    if work.device.type not in devices:
        where = ", ".join(sorted(devices)) or "no device"
        return not_run(work, ceilings, "skipped",
                       f"no backward on {work.device.type} (backend {backend!r} differentiates on {where})")
    step = TrainingStep(work, backend)
    m = run_case(work, backend, mode, ceilings, options, factory=lambda _: step)
    step.zero_grad()
    if m.status != "ok" or mode == "graph":
        return m
    try:
        return replace(m, peak_mib=peak_mib(step, work.device))
    except Exception as exc:  # out of memory on this extra call: the row keeps its time, no peak
        return replace(m, reason=f"peak memory not measured: {type(exc).__name__}")
