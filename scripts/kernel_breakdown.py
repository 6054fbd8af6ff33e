"""Where one call's device time goes, kernel by kernel: forward, or forward + backward (training).

    PYTHONPATH=$PWD/src python3 scripts/kernel_breakdown.py [--backward] [--backends triton,grouped_mm]
        [--tokens 1024,4096,16384] [--preset qwen3-30b-a3b] [--out breakdown.md] [--steady]

For each backend and T: the inputs as `moekit bench` draws them (routed by the preset's router),
three untimed calls, then one call under torch.profiler. On CUDA every kernel (and memcpy/memset)
the call ran is grouped by name (Triton kernels by their function name) with its count, device ms
and share of the call's device time; the call's wall time and device-busy share come with it. On a
CPU there is no device timeline: the aten ops' self CPU time is listed instead (a smoke run of the
script, not a GPU figure). The numbers are one profiled call, for attribution; the timings to quote
come from `moekit bench`.

Per kernel, the useful FLOPs it did and its achieved rate (useful FLOPs / its device time): the
triton path's GEMM kernels by `moekit.bench.kernel_work.triton_kernel_flops` (GEMM1 2·S·H·2I, GEMM2
2·S·I·H; backward: the SwiGLU backward's g = dout @ down_e, 2·S·H·I (a and b saved by the
forward), dx 2·S·2I·H, the weight gradients 2·S·2I·H and 2·S·H·I; a kernel launched twice, GEMM2
and dx, is told apart by launch order), "–" for a kernel without a count (align, sums, other
backends' kernels, CPU aten ops).
Each triton case also says the rows its tiles computed, num_padded of its alignment read back after
the run over the S pairs ("1.24 rows computed per pair, 19% padding": the GEMMs did 1.24x the useful
FLOPs), and every case its layer's useful FLOPs (the roofline's) over the device-busy time; on CUDA
also the device span (first activity's start to the last one's end), how much of it was idle, and
the largest idle gaps (host work the device waited for).

Programmatic dependent launch (`moekit.launch_hints`) is turned off here unless --pdl: under it a
kernel starts while the one before it runs and waits inside (griddepcontrol.wait), so its profiled
duration would include that wait (a sum kernel after GEMM2 looked 6x its real time).

--steady adds, per case, how the call behaves alone and in a loop (a training loop's steps):
    isolated      median of 10 calls, each after an L2 flush and a sync (what `moekit bench` times)
    back-to-back  20 calls issued without a sync between them, per call (the host runs ahead)
    host          median host time of one call (launch to return) within the back-to-back run
On a CPU the three are host wall times (no device queue to run ahead of).

--host-profile (triton backward only) adds where that host time goes: the training step's forward
(`experts_triton_train`) and backward (`experts_triton_backward`) called directly on this thread
(autograd runs a CUDA backward on a thread of its own, which cProfile does not see), back to back,
their host ms a step each, then cProfile's top functions by own time over the loop.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple
from unittest import mock

import torch

from moekit.bench.kernel_work import KernelFlops, label_launches, triton_kernel_flops, triton_rows
from moekit.bench.roofline import traffic, training_traffic
from moekit.bench.runner import make_weights
from moekit.bench.timing import sync, time_fn
from moekit.experts import moe_experts
from moekit.experts.triton import auto_config, experts_triton_backward, experts_triton_train
from moekit.launch_hints import PDL_ENV
from moekit.routing import route
from moekit.shapes import PRESETS


def _inputs(preset: str, tokens: int, dtype: torch.dtype, device: torch.device):
    shape = PRESETS[preset]
    weights = make_weights(shape, dtype, device, 0)
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden_size, generator=g, device=device).to(dtype)
    w, ids = route(x, weights.router_weight, shape.top_k, renormalize=shape.norm_topk_prob)
    grad_out = torch.randn(tokens, shape.hidden_size, generator=g, device=device).to(dtype)
    return x, weights.gate_up_proj, weights.down_proj, w, ids, grad_out


def _call(backend: str, backward: bool, x, gate_up, down, w, ids, grad_out):
    if not backward:
        def forward():
            with torch.no_grad():
                moe_experts(x, gate_up, down, w, ids, backend=backend)
        return forward
    leaves = [t.detach().requires_grad_(True) for t in (x, gate_up, down, w)]

    def step():
        for t in leaves:
            t.grad = None
        with torch.enable_grad():
            moe_experts(*leaves, ids, backend=backend).backward(grad_out)
    return step


def steady(fn, device: torch.device, isolated: int = 10, loop: int = 20) -> str:
    """'isolated a ms, back-to-back b ms a call, host c ms a call' of fn (see the module doc)."""
    alone = time_fn(fn, warmup=3, rep=isolated, flush_l2=device.type == "cuda", device=device).median_ms
    sync(device)
    host = []
    t_loop = time.perf_counter()
    for _ in range(loop):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    per_call = (time.perf_counter() - t_loop) * 1e3 / loop
    return (f"Steady: isolated {alone:.3f} ms, back-to-back {per_call:.3f} ms a call, "
            f"host {statistics.median(host):.3f} ms a call.")


def host_profile(inputs, device: torch.device, loop: int = 20, top: int = 25) -> list[str]:
    """Markdown lines: the triton training step's host time, forward and backward apart, and
    cProfile's `top` functions by own time (see the module doc)."""
    x, gate_up, down, w, ids, grad_out = inputs
    needs = (True, True, True, True)
    # the backward gets the forward's config, as autograd's ctx keeps it: picked once, not per step
    config = auto_config(x.shape[0], gate_up, ids.shape[1], x.dtype, x.device)

    def fwd():
        _, pre, align = experts_triton_train(x, gate_up, down, w, ids)
        return pre, align

    def bwd(pre, align):
        experts_triton_backward(grad_out, x, gate_up, down, w, ids, align, config, needs, pre=pre)

    for _ in range(3):
        bwd(*fwd())
    sync(device)
    t_fwd, t_bwd = [], []
    for _ in range(loop):
        t0 = time.perf_counter()
        saved = fwd()
        t1 = time.perf_counter()
        bwd(*saved)
        t_bwd.append((time.perf_counter() - t1) * 1e3)
        t_fwd.append((t1 - t0) * 1e3)
    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(loop):
        bwd(*fwd())
    prof.disable()
    sync(device)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    body = buf.getvalue().strip().splitlines()
    start = next((i for i, line in enumerate(body) if line.lstrip().startswith("ncalls")), 0)
    return [f"Host, called on this thread: forward {statistics.median(t_fwd):.3f} ms, backward "
            f"{statistics.median(t_bwd):.3f} ms a step (median of {loop}); cProfile over {loop} steps, "
            f"top {top} by own time:", "", "```", *body[start:], "```"]


class KernelRow(NamedTuple):
    """One line of a case's table: a kernel (and its role in the call, "" when it has none), its
    launches, their device ms, and their useful FLOPs (None: not counted)."""

    name: str
    role: str
    count: int
    ms: float
    flops: int | None = None

    @property
    def tflops(self) -> float:
        """Useful FLOPs / device time, TFLOP/s (NaN when not counted)."""
        return self.flops / (self.ms * 1e-3) / 1e12 if self.flops is not None and self.ms > 0 else math.nan


def aggregate(launches: Sequence[tuple[str, float]], flops: Sequence[KernelFlops] = ()) -> list[KernelRow]:
    """Device activities (name, ms) in launch order -> one row per kernel and role, largest ms first:
    the n-th launch of a kernel takes the n-th entry of `flops` for it (`label_launches`)."""
    rows: dict[tuple[str, str], list] = {}
    for (name, ms), k in zip(launches, label_launches([n for n, _ in launches], flops)):
        row = rows.setdefault((name, k.role if k else ""), [0, 0.0, None])
        row[0] += 1
        row[1] += ms
        if k is not None:
            row[2] = (row[2] or 0) + k.flops
    out = [KernelRow(name, role, c, ms, f) for (name, role), (c, ms, f) in rows.items()]
    return sorted(out, key=lambda r: -r.ms)


def breakdown(fn, device: torch.device,
              flops: Sequence[KernelFlops] = ()) -> tuple[list[KernelRow], float, float, str]:
    """(rows largest first, wall ms, device-busy ms (NaN on CPU), a line on the idle gaps between
    device activities ('' on CPU)) of one call; on CUDA the kernels named in `flops` carry their
    useful FLOPs (`aggregate`)."""
    for _ in range(3):
        fn()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    if device.type == "cuda":
        events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        rows = aggregate([(name, (end - start) / 1e3) for start, end, name in events], flops)
        busy, last, last_name = 0.0, -1.0, ""
        gaps = []                      # idle device time between activities, with their neighbours
        for start, end, name in events:   # the union of the device intervals
            if last >= 0 and start > last:
                gaps.append(((start - last) / 1e3, last_name, name))
            if end > last:
                busy += (end - max(start, last)) / 1e3
                last, last_name = end, name
        span = (last - events[0][0]) / 1e3 if events else 0.0
        idle = (f"Device span (first start to last end) {span:.3f} ms, {span - busy:.3f} ms of it idle; "
                "largest gaps: " + "; ".join(f"{g * 1e3:.0f} us before {_short(n, 40)}"
                                             for g, _, n in sorted(gaps, reverse=True)[:3]) + ".")
    else:
        rows = sorted((KernelRow(e.key, "", e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
                       if e.key.startswith("aten::") and e.self_cpu_time_total > 0), key=lambda r: -r.ms)
        busy, idle = float("nan"), ""
    return rows, wall, busy, idle


def _gflop(flops: int | None) -> str:
    return "–" if flops is None else f"{flops / 1e9:,.3g}"


def _rate(tflops: float) -> str:
    if math.isnan(tflops):
        return "–"
    return f"{tflops:,.1f}" if tflops >= 10 else f"{tflops:.3g}"


def table(rows: Sequence[KernelRow], top: int) -> list[str]:
    """The case's Markdown table: the `top` rows by device time, then the others in one line."""
    total = sum(r.ms for r in rows)
    lines = ["| kernel | count | ms | share | useful GFLOP | TFLOP/s |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows[:top]:
        role = f" {r.role}" if r.role else ""
        lines.append(f"| `{_short(r.name)}`{role} | {r.count} | {r.ms:.3f} | {r.ms / total:.0%} | "
                     f"{_gflop(r.flops)} | {_rate(r.tflops)} |")
    rest = rows[top:]
    if rest:
        rest_ms = sum(r.ms for r in rest)
        lines.append(f"| {len(rest)} others | {sum(r.count for r in rest)} | {rest_ms:.3f} | "
                     f"{rest_ms / total:.0%} | | |")
    return lines


def summary(rows: Sequence[KernelRow], busy: float, layer_flops: int) -> list[str]:
    """Lines under a case's heading: the layer's useful FLOPs over the busy time, and the counted
    kernels' FLOPs over their own time (CUDA only: NaN busy time says nothing)."""
    if math.isnan(busy):
        return [f"Useful FLOPs per call: {_gflop(layer_flops)} GFLOP (no device timeline on the CPU)."]
    lines = [f"Useful FLOPs per call: {_gflop(layer_flops)} GFLOP, {_rate(layer_flops / busy / 1e9)} TFLOP/s "
             "over the device-busy time."]
    counted = [r for r in rows if r.flops is not None]
    if counted:
        f, ms = sum(r.flops for r in counted), sum(r.ms for r in counted)
        lines.append(f"GEMM kernels: {_gflop(f)} GFLOP useful in {ms:.3f} ms, {_rate(f / ms / 1e9)} TFLOP/s.")
    return lines


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="default: qwen3-30b-a3b on a GPU, tiny on the CPU")
    p.add_argument("--tokens", default=None, help="comma-separated (default: 1024,4096,16384 GPU; 16 CPU)")
    p.add_argument("--backends", default="triton,grouped_mm")
    p.add_argument("--backward", action="store_true", help="forward + backward (default: forward only)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per case")
    p.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    p.add_argument("--steady", action="store_true",
                   help="also time each case alone, back to back, and its host time (see above)")
    p.add_argument("--host-profile", action="store_true",
                   help="triton backward: host time of forward and backward apart, cProfile's top functions")
    p.add_argument("--pdl", action="store_true",
                   help="keep programmatic dependent launch on (default off here: see the module doc)")
    a = p.parse_args(argv)
    with mock.patch.dict(os.environ, {PDL_ENV: "1" if a.pdl else "0"}):     # read at each launch
        return _run(p, a)


def _run(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = a.preset or ("qwen3-30b-a3b" if cuda else "tiny")
    if preset not in PRESETS:
        p.error(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    try:
        tokens = [int(t) for t in (a.tokens or ("1024,4096,16384" if cuda else "16")).split(",")]
    except ValueError:
        p.error(f"--tokens: expected comma-separated ints, got {a.tokens!r}")
    if any(t < 1 for t in tokens):
        p.error("--tokens: every count must be >= 1")
    dtype = torch.bfloat16 if cuda else torch.float32
    what = "forward + backward" if a.backward else "forward"
    lines = [f"# Kernel breakdown: {preset}, {what}, {str(dtype).removeprefix('torch.')}, "
             f"{torch.cuda.get_device_name() if cuda else 'CPU (aten self time, not a GPU figure)'}", "",
             f"Programmatic dependent launch {'on' if a.pdl else 'off'} "
             f"({PDL_ENV}={os.environ[PDL_ENV]}).", ""]
    shape = PRESETS[preset]
    for t in tokens:
        inputs = _inputs(preset, t, dtype, device)
        x, gate_up, _, _, ids, _ = inputs
        layer = (training_traffic if a.backward else traffic)(shape, t, ids, dtype).flops
        for backend in a.backends.split(","):
            try:
                rc = triton_rows(x, gate_up, ids, grad=a.backward) if backend == "triton" else None
                flops = triton_kernel_flops(shape, rc.pairs, a.backward) if rc else ()
                rows, wall, busy, idle = breakdown(_call(backend, a.backward, *inputs), device, flops)
            except (RuntimeError, ValueError) as exc:
                lines += [f"## {backend}, T = {t}: not run ({str(exc).splitlines()[0]})", ""]
                continue
            lines += [f"## {backend}, T = {t}: wall {wall:.3f} ms, device busy {busy:.3f} ms, "
                      f"{sum(r.count for r in rows)} activities", ""]
            if rc is not None:
                tiles = f", block_m {rc.block_m}" if rc.block_m else ", direct decode: no alignment"
                lines.append(f"Padding: {rc} ({rc.rows:,} rows computed for {rc.pairs:,} pairs{tiles}).")
            if idle:
                lines.append(idle)
            if a.steady:
                lines.append(steady(_call(backend, a.backward, *inputs), device))
            if a.host_profile and a.backward and backend == "triton":
                lines += ["", *host_profile(inputs, device)]
            lines += [*summary(rows, busy, layer), "", *table(rows, a.top), ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
