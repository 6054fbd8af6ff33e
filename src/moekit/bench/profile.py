"""`moekit profile`: where one call's time goes, on the workloads `moekit bench` draws.

    --what kernels   one call under torch.profiler: on CUDA every kernel (and copy) grouped by name,
                     with its launches, device ms and useful FLOPs (the triton path's GEMMs,
                     `kernel_work.triton_kernel_flops`), for the forward's GEMMs their floor
                     (the larger of `kernel_work.forward_gemm_bytes` over the copy ceiling and the
                     FLOPs over the matmul ceiling, the FP8 one for the FP8 GEMMs) and the % of it
                     their time reaches, and the call's wall and device-busy ms; on the CPU the
                     aten ops' self time (no device timeline)
    --what host      the host work of a call with every moekit kernel's launch a no-op: the router,
                     the experts entry, the whole `MoELayer` (forward) or the training step
                     (--backward), ms a call and Triton launches a call; on CUDA also the same calls
                     launched for real (their host time, the device running behind)
    --what graph     CUDA only: the call recorded whole in a CUDA graph, timed isolated (L2 flushed,
                     as `moekit bench` times it), steady (replays back to back, per replay) and the
                     host time of `graph.replay()`

Programmatic dependent launch is off unless --pdl: under it a kernel starts while the one before it
runs and waits inside, so its profiled duration would include that wait.

--weights fp8 profiles the calls on the layer's expert weights quantized once to block-scaled e4m3
(`moekit.bench.fp8`, as `moekit bench --weights fp8` times them; forward only, backends that take
FP8 weights; on a CPU-only machine without a layer given, the layer `moekit.bench.fp8.CPU_SHAPE`):
the same items, the host phases without the whole layer's.

Every time is `moekit.bench.timing.time_fn`'s (host times: on the CPU clock, no flush). Rows follow
`ProfileRow` (long format, provenance in every row); `moekit report DIR` redraws report.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from unittest import mock

import torch

from moekit.bench import args as arg_types
from moekit.bench.args import usage_error
from moekit.bench.backward import TrainingStep, training_workload
from moekit.bench.ceilings import Ceilings
from moekit.bench.fp8 import CPU_SHAPE, Fp8Experts, fp8_backends, fp8_factory, quantize_layer, shape_problem
from moekit.bench.kernel_work import (
    TILED,
    KernelFlops,
    forward_gemm_bytes,
    label_launches,
    triton_kernel_flops,
    triton_rows,
)
from moekit.bench.lab import first_line, layer_head, report, run_study
from moekit.bench.launches import patched_runs
from moekit.bench.layers import parse_shape
from moekit.bench.results import FP8, LayerRow
from moekit.bench.runner import LAYER, Workload, backend_factory, make_weights, make_workload
from moekit.bench.study import FILES, Files, Study
from moekit.bench.timing import capture_graph, sync, time_fn
from moekit.launch_hints import PDL_ENV

PROG = "moekit profile"
WHAT = ("kernels", "host", "graph")
GPU_TOKENS = (1, 64, 1024, 4096)
CPU_TOKENS = (4,)
TOP = 12                 # kernels listed per case before the rest is summed into one row
STEADY_REPLAYS = 20


@dataclass(frozen=True)
class ProfileRow(LayerRow):
    """One item of a profiled case: its run's `Provenance` and layer columns, then the case (what,
    backend, direction "fwd" / "fwd+bwd") and the item: a kernel or aten op (kernels), a phase
    (host), a timing (graph), or the call's own "(wall)" / "(device busy)" rows. count: its
    launches (kernels: activities; host: Triton launches a call); ms: its device ms (kernels) or ms
    a call; gflop: its useful GFLOP (NaN: not counted)."""

    what: str
    backend: str
    direction: str
    item: str
    role: str
    status: str
    reason: str
    count: int | None
    ms: float
    gflop: float
    weights: str = ""
    floor_ms: float = math.nan
    pct_floor: float = math.nan


def _case_name(r: ProfileRow) -> str:
    fp8 = " fp8" if r.weights == FP8 else ""
    return f"{r.what}: {r.preset} {r.backend}{fp8} {r.direction}, T = {r.tokens}"


def render(rows: Sequence[ProfileRow], files: Files = FILES) -> dict[str, str]:
    notes = [f"- {r.what} {r.backend} {r.direction} T={r.tokens}: {r.status}: {r.reason}"
             for r in rows if r.status != "ok"]
    return {files.report: report(
        [r for r in rows if r.status == "ok"] or rows, "moekit profile",
        _case_name,
        ("item", "role", "count", "ms", "gflop", "floor_ms", "pct_floor"), notes)}


STUDY = Study("profile", ProfileRow, render)


def moekit_kernels() -> list:
    """Every Triton or Gluon kernel of the imported moekit runtime modules, each once."""
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("moekit.") and not name.startswith("moekit.bench") and module is not None:
            found.update({id(v): v for v in vars(module).values()
                          if hasattr(v, "fn") and callable(getattr(v, "run", None))})
    return list(found.values())


@contextlib.contextmanager
def stubbed_launches(sink: list) -> Iterator[None]:
    """kernel[grid](...) of every moekit kernel runs nothing; each launch appends its kernel to sink."""
    def wrap(kernel, _run):
        def run(*args, warmup=False, **kwargs):
            if not warmup:
                sink.append(kernel)
        return run

    with patched_runs(moekit_kernels(), wrap):
        yield


def _call(work: Workload, backend: str, backward: bool,
          experts: Fp8Experts | None = None) -> Callable[[], object]:
    if backward:
        return TrainingStep(work, backend)
    fn = (backend_factory(backend) if experts is None else fp8_factory(backend, experts))(work)

    def forward():
        with torch.no_grad():
            return fn()
    return forward


def _kernel_rows(fn: Callable[[], object], device: torch.device, flops: Sequence[KernelFlops],
                 floors: dict[str, float] | None = None) -> list[dict]:
    """One profiled call (after three untimed ones): its kernels (CUDA) or aten ops (CPU), largest
    first; floors: a launch's floor in ms by kernel name (`device_rows`)."""
    for _ in range(3):
        fn()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    if device.type != "cuda":
        ops = [{"item": e.key, "count": e.count, "ms": e.self_cpu_time_total / 1e3}
               for e in prof.key_averages() if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
        return [{"item": "(wall)", "ms": wall}, *sorted(ops, key=lambda r: -r["ms"])]
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    return [{"item": "(wall)", "ms": wall}, *device_rows(events, flops, floors)]


def device_rows(events: Sequence[tuple[float, float, str]], flops: Sequence[KernelFlops] = (),
                floors: dict[str, float] | None = None) -> list[dict]:
    """The device's launches (start and end in µs, kernel name; in launch order) as rows: "(device
    busy)" (the union of their intervals), then one row per kernel and role, largest first (the
    first TOP, the rest summed): launches, ms, useful GFLOP (`label_launches` on flops) and, for a
    kernel in floors (a launch's floor in ms), floor_ms and pct_floor (its floor over its time)."""
    floors = floors or {}
    by: dict[tuple[str, str], dict] = {}
    for (start, end, name), k in zip(events, label_launches([n for *_, n in events], flops)):
        row = by.setdefault((name, k.role if k else ""), {"item": name, "role": k.role if k else "",
                                                          "count": 0, "ms": 0.0, "gflop": math.nan})
        row["count"] += 1
        row["ms"] += (end - start) / 1e3
        if k is not None:
            row["gflop"] = (0.0 if math.isnan(row["gflop"]) else row["gflop"]) + k.flops / 1e9
        if name in floors:
            row["floor_ms"] = row.get("floor_ms", 0.0) + floors[name]
    busy, last = 0.0, -math.inf        # the union of the device intervals
    for start, end, _ in events:
        busy += max(0.0, end - max(start, last)) / 1e3
        last = max(last, end)
    for row in by.values():
        if "floor_ms" in row and row["ms"] > 0:
            row["pct_floor"] = 100.0 * row["floor_ms"] / row["ms"]
    kernels = sorted(by.values(), key=lambda r: -r["ms"])
    rest = kernels[TOP:]
    tail = [{"item": f"({len(rest)} others)", "count": sum(r["count"] for r in rest),
             "ms": sum(r["ms"] for r in rest)}] if rest else []
    return [{"item": "(device busy)", "count": len(events), "ms": busy}, *kernels[:TOP], *tail]


def _host_rows(work: Workload, backend: str, backward: bool, rep: int | None,
               experts: Fp8Experts | None = None) -> list[dict]:
    """Host ms a call of each phase, launches stubbed (and on CUDA launched, the device behind).
    experts: the calls on these FP8 weights (no whole-layer phase)."""
    from moekit.experts import moe_experts
    from moekit.routing import route

    s, wt = work.shape, work.weights
    calls = {"router": lambda: route(work.x, wt.router_weight, s.top_k, renormalize=s.norm_topk_prob)}
    if backward:
        calls["step"] = TrainingStep(work, backend)
    elif experts is not None:
        calls["experts"] = fp8_factory(backend, experts)(work)
    else:
        args = (work.x, wt.gate_up_proj, wt.down_proj, work.topk_weights, work.topk_ids)
        calls["experts"] = lambda: moe_experts(*args, backend=backend, validate=False)
        if backend == TILED:
            calls[LAYER] = backend_factory(LAYER)(work)
    cpu = torch.device("cpu")
    rows = []
    with torch.no_grad() if not backward else contextlib.nullcontext():
        for phase, fn in calls.items():
            sink: list = []
            with stubbed_launches(sink):
                fn()
                launches = len(sink)
                ms = time_fn(fn, device=cpu, flush_l2=False, rep=rep, min_rep=1).median_ms
            rows.append({"item": phase, "role": "launches stubbed", "count": launches, "ms": ms})
            if work.device.type == "cuda":
                ms = time_fn(fn, device=cpu, flush_l2=False, rep=rep).median_ms
                sync(work.device)
                rows.append({"item": phase, "role": "launched", "count": launches, "ms": ms})
    return rows


def _graph_rows(fn: Callable[[], object], device: torch.device, rep: int | None) -> list[dict]:
    graph, _ = capture_graph(fn, device)
    cpu = torch.device("cpu")

    def replays():
        for _ in range(STEADY_REPLAYS):
            graph.replay()

    rows = [{"item": "isolated", "ms": time_fn(graph.replay, device=device, rep=rep).median_ms},
            {"item": "steady", "count": STEADY_REPLAYS,
             "ms": time_fn(replays, device=device, flush_l2=False, rep=rep).median_ms / STEADY_REPLAYS}]
    host = time_fn(graph.replay, device=cpu, flush_l2=False, rep=rep or 50, min_rep=1).median_ms
    sync(device)
    return [*rows, {"item": "host replay", "ms": host}]


def gemm_floors(work: Workload, pairs: int, ceilings: Ceilings, fp8: bool) -> dict[str, float]:
    """The forward GEMM launches' floors in ms by kernel name (`kernel_work.forward_gemm_bytes` and
    `triton_kernel_flops` against the ceilings; the FP8 GEMMs on the FP8 matmul ceiling), the experts
    hit as the workload's traffic counts them."""
    moved = forward_gemm_bytes(work.shape, work.tokens, pairs, work.traffic.experts_hit,
                               work.x.element_size(), fp8)
    flops = {k.kernel: k.flops for k in triton_kernel_flops(work.shape, pairs)}
    return {name: max(b / (ceilings.copy_gbps * 1e9),
                      flops[name] / (ceilings.compute_tflops("fp8" in name) * 1e12)) * 1e3
            for name, b in moved.items()}


def case_rows(what: str, work: Workload, backend: str, backward: bool, rep: int | None,
              experts: Fp8Experts | None = None, ceilings: Ceilings | None = None) -> list[dict]:
    """The items of one (what, T, backend) case; experts: on these FP8 weights; ceilings: the
    device's, for the forward GEMMs' floors."""
    if what == "host":
        return _host_rows(work, backend, backward, rep, experts)
    fn = _call(work, backend, backward, experts)
    if what == "graph":
        return _graph_rows(fn, work.device, rep)
    flops, floors = (), {}
    if backend == TILED:
        rows = triton_rows(work.x, work.weights.gate_up_proj, work.topk_ids, grad=backward)
        flops = triton_kernel_flops(work.shape, rows.pairs, backward)
        if not backward and ceilings is not None:
            floors = gemm_floors(work, rows.pairs, ceilings, experts is not None)
    return _kernel_rows(fn, work.device, flops, floors)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--what", type=arg_types.names(lambda: WHAT, "profile"), default=["kernels"],
                   help=f"comma-separated, from {', '.join(WHAT)} (default: kernels)")
    arg_types.add_preset(p)
    p.add_argument("--tokens", type=arg_types.token_counts, default=None,
                   help=f"token counts (default: {','.join(map(str, GPU_TOKENS))} on a GPU, "
                        f"{','.join(map(str, CPU_TOKENS))} on the CPU)")
    arg_types.add_backends(p, _known_backends, ["triton"],
                           "experts backends, comma-separated (default: triton)")
    p.add_argument("--backward", action="store_true", help="profile one training step (forward + backward)")
    p.add_argument("--pdl", action="store_true", help="keep programmatic dependent launch on")
    arg_types.add_dtype(p)
    arg_types.add_weights(p, "the expert weights: dense in --dtype (default), or fp8: block-scaled e4m3 "
                             "(one fp32 scale per 128x128 block), forward only, backends that take them")
    arg_types.add_timing(p, "timed calls per host or graph timing (default: time_fn's)")
    arg_types.add_device(p)
    arg_types.add_seed(p)
    arg_types.add_out(p, "profile-<UTC timestamp>", STUDY.result_names)
    arg_types.add_threads(p)


def _check_fp8(args: argparse.Namespace, layer) -> None:
    """--weights fp8's conditions: forward only, backends that take FP8 weights, H and I multiples of
    128 (ValueError naming what is wrong)."""
    if args.backward:
        raise ValueError("--weights fp8: FP8 experts are inference only; drop --backward")
    others = [b for b in args.backends if b not in fp8_backends(args.backends)]
    if others:
        raise ValueError(f"--weights fp8: --backends {','.join(others)} take no FP8 weights; those that do: "
                         f"{','.join(fp8_backends())}")
    problem = shape_problem(layer.name, layer.shape)
    if problem:
        raise ValueError("--weights fp8: " + problem)


def _known_backends() -> list[str]:
    from moekit.experts import BACKENDS

    return list(BACKENDS)


def run(args: argparse.Namespace) -> int:
    fp8 = args.weights == FP8
    try:
        device = arg_types.resolve_device(args.device)
        if "graph" in args.what and device.type != "cuda":
            raise ValueError("--what graph needs a CUDA device")
        if fp8 and not arg_types.layer_given(args) and device.type != "cuda":
            layer = parse_shape(CPU_SHAPE)
        else:
            layer = arg_types.resolve_layer(args, device)
        if fp8:
            _check_fp8(args, layer)
        dtype = arg_types.resolve_dtype(args.dtype, device)
        tokens = arg_types.pick(args.tokens, device, GPU_TOKENS, CPU_TOKENS)
        arg_types.check_memory([layer], dtype, device, tokens, fp8=fp8, backward=args.backward)
    except ValueError as exc:
        return usage_error(PROG, exc)
    direction = "fwd+bwd" if args.backward else "fwd"

    def measure(console, ceilings, prov) -> list[ProfileRow]:
        weights = make_weights(layer.shape, dtype, device, args.seed)
        experts = quantize_layer(weights) if fp8 else None
        tag = {"weights": FP8 if fp8 else str(dtype).removeprefix("torch.")}
        out = []
        for t in tokens:
            work = make_workload(layer.name, layer.shape, t, weights, dtype, device, seed=args.seed,
                                 routing_draws=1)
            work = training_workload(work, args.seed) if args.backward else work
            head = layer_head(prov, layer, tokens=t, direction=direction)
            for what in args.what:
                for backend in args.backends:
                    console.print(f"  {what} {layer.name} T={t} {backend}{' fp8' if fp8 else ''} {direction}",
                                  highlight=False)
                    try:
                        items, status, reason = (case_rows(what, work, backend, args.backward, args.rep,
                                                           experts, ceilings), "ok", "")
                    except Exception as exc:  # one case lost, not the study
                        items, status, reason = [{"item": "(call)"}], "error", first_line(exc)
                    out += [ProfileRow(**head, what=what, backend=backend, status=status, reason=reason,
                                       **tag, **{"role": "", "count": None, "ms": math.nan, "gflop": math.nan,
                                                 **i})
                            for i in items]
        return out

    with mock.patch.dict(os.environ, {PDL_ENV: "1" if args.pdl else "0"}):     # read at each launch
        return run_study(PROG, args, STUDY, device, dtype, measure,
                         lambda r: f"{r.what} T={r.tokens} {r.backend} ({r.direction})", rep=args.rep,
                         fp8=fp8)

