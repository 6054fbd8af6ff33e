"""Where the host time of one eager training step of the triton expert path goes (issue 10), on a GPU.

    PYTHONPATH=$PWD/src python3 scripts/step_host.py [--tokens 1024,4096,16384] [--out step_host.md]

For each T, the inputs as `scripts/kernel_breakdown.py` draws them (the preset's router), then the
step `moekit bench --backward` times (`TrainingStep`: the inputs' grads set to None, moe_experts with
x, both weights and the routing weights requiring grad, `.backward(grad_out)`) in these variants:

    autograd        as the bench runs it (the backward on autograd's CUDA device thread)
    one-thread      the same under torch.autograd.set_multithreading_enabled(False): the backward
                    on the calling thread
    no-gc           autograd with Python's garbage collector off
    direct          experts_triton_train + experts_triton_backward called on this thread (no
                    autograd at all: what the step would cost with none of its machinery)
    stubbed         autograd with every moekit kernel's launch a no-op (`host_overhead.stubbed_launches`,
                    Triton and Gluon kernels alike): the host time less Triton's launch path, so
                    host - stubbed is what the launches themselves cost (its isolated time is no
                    step's and is not given)

and for each:
    isolated        median ms of 15 steps, each after an L2 flush and a sync, CUDA events
                    around the step (what `moekit bench --backward` times)
    host            median host ms of one step from a synced device (perf_counter), with its
                    forward (until moe_experts returns) and backward (until .backward returns) apart
    first launch    median µs from the step's start to its first kernel's start on the device is
                    not measurable without the profiler, so the profiled step below gives it

--graph adds the step recorded whole in a CUDA graph (as `moekit bench --backward` times it), once
with programmatic dependent launch on (MOEKIT_PDL=1, read at each launch, so baked into the graph)
and once off: isolated replays (L2 flushed before each) in alternating rounds, medians, and one
replay with PDL on under the profiler, kernel by kernel with the gaps between them.

--dx-ab times the whole-step graph with dx's GEMM2 config (`grouped_gemm_backward._dx_config`:
the forward's tiles, pointer weights, one tile a program) against variants of it: a persistent
grid, 128-wide column tiles, both; each variant's gradients checked bitwise against the default's.

Then one step of each variant under torch.profiler (CPU + CUDA, from a synced device): the device
busy time, the span from the profile's first CPU op to the last kernel's end, and the gaps before
each kernel (the host work it waited for), and the CPU ops by self time (top 20), with the thread
each ran on. The numbers are for attribution; the timings to quote come from `moekit bench`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_overhead import stubbed_launches  # noqa: E402
from kernel_breakdown import _inputs  # noqa: E402

from moekit.bench.timing import sync, time_fn  # noqa: E402
from moekit.experts import moe_experts  # noqa: E402
from moekit.experts.triton import auto_config, experts_triton_backward, experts_triton_train  # noqa: E402


def make_steps(inputs):
    x, gate_up, down, w, ids, grad_out = inputs
    leaves = [t.detach().requires_grad_(True) for t in (x, gate_up, down, w)]
    marks: dict[str, float] = {}

    def autograd_step():
        for t in leaves:
            t.grad = None
        with torch.enable_grad():
            out = moe_experts(*leaves, ids, backend="triton")
            marks["fwd"] = time.perf_counter()
            out.backward(grad_out)
        return tuple(t.grad for t in leaves)

    def one_thread_step():
        with torch.autograd.set_multithreading_enabled(False):
            autograd_step()

    def no_gc_step():
        was = gc.isenabled()
        gc.disable()
        try:
            autograd_step()
        finally:
            if was:
                gc.enable()

    config = auto_config(x.shape[0], gate_up, ids.shape[1], x.dtype, x.device)

    def direct_step():
        _, pre, align = experts_triton_train(x, gate_up, down, w, ids)
        marks["fwd"] = time.perf_counter()
        experts_triton_backward(grad_out, x, gate_up, down, w, ids, align, config, (True,) * 4, pre=pre,
                                release_pre=True)

    return {"autograd": autograd_step, "one-thread": one_thread_step, "no-gc": no_gc_step,
            "direct": direct_step, "stubbed": autograd_step}, marks


def host_times(step, marks, device, n: int = 25) -> tuple[float, float, float]:
    tot, fwd = [], []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        tot.append((t1 - t0) * 1e3)
        fwd.append((marks["fwd"] - t0) * 1e3)
    sync(device)
    f, t = statistics.median(fwd), statistics.median(tot)
    return t, f, t - f


def profiled(step, device, top: int = 20) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    events = prof.events()
    kern = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not kern or not cpu:
        return ["(no events)"]
    t0 = min(e.time_range.start for e in cpu)
    busy = sum(e.time_range.elapsed_us() for e in kern) / 1e3
    end = max(e.time_range.end for e in kern)
    lines = [f"Profiled step: device busy {busy:.3f} ms, span from the first CPU op to the last kernel's "
             f"end {(end - t0) / 1e3:.3f} ms; first kernel starts {(kern[0].time_range.start - t0):.0f} µs "
             "after the first CPU op.", "",
             "| kernel | starts at µs | gap before µs | µs |", "|---|---:|---:|---:|"]
    prev = t0
    for e in kern:
        s = e.time_range.start
        lines.append(f"| `{e.name[:50]}` | {s - t0:.0f} | {s - prev:.0f} | {e.time_range.elapsed_us():.0f} |")
        prev = e.time_range.end
    lines += ["", "CPU ops by self time (µs), with their thread:", "",
              "| op | thread | calls | self µs | total µs |", "|---|---:|---:|---:|---:|"]
    agg: dict[tuple[str, int], list[float]] = {}
    for e in cpu:
        key = (e.name[:60], e.thread)
        a = agg.setdefault(key, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += e.self_cpu_time_total
        a[2] += e.cpu_time_total
    for (name, thread), (c, s, tt) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| `{name}` | {thread} | {c} | {s:.0f} | {tt:.0f} |")
    return lines


def alternating(graphs: dict, device, rounds: int, per_round: int) -> dict[str, float]:
    """Median over `rounds` of each graph's median isolated replay (L2 flushed before each) of
    `per_round` replays; the graphs take turns within every round, so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, g in graphs.items():
            t = time_fn(g.replay, warmup=1, rep=per_round, flush_l2=True, device=device)
            times[k].append(t.median_ms)
    return {k: statistics.median(v) for k, v in times.items()}


def graph_ab(step, device, rounds: int = 8, per_round: int = 5) -> list[str]:
    from unittest import mock

    from moekit.graphs import capture_graph
    from moekit.launch_hints import PDL_ENV

    graphs = {}
    for pdl in ("1", "0"):
        with mock.patch.dict(os.environ, {PDL_ENV: pdl}):
            graphs[pdl] = capture_graph(step, device)[0]
    times = alternating(graphs, device, rounds, per_round)
    on, off = times["1"], times["0"]
    lines = [f"Whole step in a CUDA graph, isolated replays (median of {rounds} rounds' medians of "
             f"{per_round}): PDL on {on:.4f} ms, off {off:.4f} ms ({off / on:.3f}x)", ""]
    lines += profiled(graphs["1"].replay, device)
    return lines


def dx_ab(step, device, rounds: int = 8, per_round: int = 5) -> list[str]:
    from dataclasses import replace
    from unittest import mock

    import moekit.grouped_gemm_backward as gb
    from moekit.graphs import capture_graph

    base = gb._dx_config
    variants = {"default": base,
                "persistent": lambda c: replace(base(c), persistent=True),
                "n128": lambda c: replace(base(c), block_n2=128),
                "n128 persistent": lambda c: replace(base(c), block_n2=128, persistent=True)}
    graphs, grads = {}, {}
    for name, fn in variants.items():
        with mock.patch.object(gb, "_dx_config", fn):
            graphs[name], grads[name] = capture_graph(step, device)
    lines = []
    for name in variants:
        graphs[name].replay()
    sync(device)
    for name in variants:
        same = all(torch.equal(a, b) for a, b in zip(grads[name], grads["default"]))
        lines.append(f"- {name}: gradients {'bitwise the default' if same else 'DIFFER from the default'}")
    times = alternating(graphs, device, rounds, per_round)
    for k, ms in times.items():
        lines.append(f"- {k}: {ms:.4f} ms ({times['default'] / ms:.3f}x the default)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--variants", default="autograd,one-thread,no-gc,direct,stubbed")
    p.add_argument("--profile", default="autograd,one-thread",
                   help="variants profiled one step each ('' for none)")
    p.add_argument("--graph", action="store_true", help="also the whole step in a CUDA graph, PDL on / off")
    p.add_argument("--dx-ab", action="store_true", help="also dx's GEMM2 config variants, whole-step graphs")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda")
    lines = [f"# Host time of one training step, {a.preset}, bf16, {torch.cuda.get_device_name()}", ""]
    for t in (int(v) for v in a.tokens.split(",")):
        inputs = _inputs(a.preset, t, torch.bfloat16, device)
        steps, marks = make_steps(inputs)
        for name in a.variants.split(","):
            for _ in range(3 if name != "stubbed" else 0):
                steps[name]()
        sync(device)
        lines += [f"## T = {t}", "", "| variant | isolated ms | host ms | forward | backward |",
                  "|---|---:|---:|---:|---:|"]
        for name in a.variants.split(","):
            if name == "stubbed":
                with stubbed_launches():
                    steps[name]()
                    tot, f, b = host_times(steps[name], marks, device)
                lines.append(f"| {name} | – | {tot:.3f} | {f:.3f} | {b:.3f} |")
                print(lines[-1], flush=True)
                continue
            iso = time_fn(steps[name], warmup=3, rep=15, flush_l2=True, device=device).median_ms
            tot, f, b = host_times(steps[name], marks, device)
            lines.append(f"| {name} | {iso:.3f} | {tot:.3f} | {f:.3f} | {b:.3f} |")
            print(lines[-1], flush=True)
        for name in filter(None, a.profile.split(",")):
            lines += ["", f"### {name}, profiled", "", *profiled(steps[name], device)]
        if a.graph:
            lines += ["", "### the step in a CUDA graph", "", *graph_ab(steps["autograd"], device)]
            print("\n".join(lines[-3:]), flush=True)
        if a.dx_ab:
            lines += ["", "### dx's config, whole-step graphs", "", *dx_ab(steps["autograd"], device)]
            print("\n".join(lines[-6:]), flush=True)
        lines.append("")
        del steps, inputs
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
