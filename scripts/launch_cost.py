"""Host cost of each kernel launch in one eager training step, measured in place (issue 10), on a GPU.

    PYTHONPATH=$PWD/src python3 scripts/launch_cost.py [--tokens 1024,4096] [--out launch_cost.md]

`scripts/step_host.py` gives a step's host time with and without moekit's launches (its stubbed
variant); this says where the launches' part goes. Every moekit kernel's `run` (what
`kernel[grid](...)` calls: Triton's binder, cache key, launch metadata, then the launcher) is
wrapped in a timer, and so is the launcher itself (`driver.active.launcher_cls.__call__`: the
tensor-descriptor conversion, then the C launch), so per kernel:

    run µs        the whole launch, from kernel[grid](...) to its return
    launcher µs   of that, the launcher (descriptors filled, cuLaunchKernelEx)

medians over the measured steps (each from a synced device), for the step as `moekit bench --backward`
runs it (autograd) and called directly on this thread (direct: `experts_triton_train` then
`experts_triton_backward`). Then a bare Triton launch for scale: a kernel that returns at once, with
4 and with 24 arguments, plain and with programmatic dependent launch, and with a host TMA descriptor
argument: µs a launch over back-to-back launches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_overhead import kernels  # noqa: E402
from kernel_breakdown import _inputs  # noqa: E402
from step_host import make_steps  # noqa: E402

from moekit.bench.timing import sync  # noqa: E402


class Timers:
    """Per-kernel lists of host µs: the whole run and the launcher inside it."""

    def __init__(self):
        self.run: dict[str, list[float]] = defaultdict(list)
        self.launcher: dict[str, list[float]] = defaultdict(list)
        self.current = "?"
        self.on = False

    def install(self):
        launcher_cls = triton.runtime.driver.active.launcher_cls
        original_call = launcher_cls.__call__
        timers = self

        def timed_call(self_, *args, **kwargs):
            t0 = time.perf_counter()
            out = original_call(self_, *args, **kwargs)
            if timers.on:
                timers.launcher[timers.current].append((time.perf_counter() - t0) * 1e6)
            return out

        launcher_cls.__call__ = timed_call
        for k in kernels():
            name = getattr(k, "__name__", None) or k.fn.__name__
            bound = type(k).run.__get__(k)

            def run(*args, _bound=bound, _name=name, **kwargs):
                timers.current = _name
                t0 = time.perf_counter()
                out = _bound(*args, **kwargs)
                if timers.on and not kwargs.get("warmup"):
                    timers.run[_name].append((time.perf_counter() - t0) * 1e6)
                return out

            k.run = run


@triton.jit
def _nothing4(a, b, n, m):
    pass


@triton.jit
def _nothing24(a0, a1, a2, a3, a4, a5, a6, a7, n0, n1, n2, n3, n4, n5, n6, n7, s0, s1, s2, s3, s4, s5, s6, s7,
               USE_PDL: tl.constexpr = False):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _nothing_desc(desc, n):
    pass


def bare_launches(n: int = 2000) -> list[str]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    t = torch.zeros(4096, device=dev, dtype=torch.bfloat16)
    w = torch.zeros(1024, 256, device=dev, dtype=torch.bfloat16)
    desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [64, 64])
    ints = [1000 + 16 * i for i in range(8)]
    cases = {
        "4 args": lambda: _nothing4[(1,)](t, t, 1000, 2000),
        "24 args": lambda: _nothing24[(1,)](*[t] * 8, *ints, *ints),
        "24 args, PDL": lambda: _nothing24[(1,)](*[t] * 8, *ints, *ints, USE_PDL=True, launch_pdl=True),
        "a host TMA descriptor": lambda: _nothing_desc[(1,)](desc, 7),
        "a new host TMA descriptor each launch": lambda: _nothing_desc[(1,)](
            TensorDescriptor(w, list(w.shape), list(w.stride()), [64, 64]), 7),
    }
    lines = ["| bare launch | µs a launch |", "|---|---:|"]
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        sync(dev)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
            sync(dev)
        lines.append(f"| {name} | {best:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda")
    timers = Timers()
    timers.install()
    name = torch.cuda.get_device_name()
    lines = [f"# Host cost of each launch in a training step, {a.preset}, bf16, {name}", ""]
    for tokens in (int(v) for v in a.tokens.split(",")):
        steps, _ = make_steps(_inputs(a.preset, tokens, torch.bfloat16, device))
        for variant in ("autograd", "direct"):
            step = steps[variant]
            for _ in range(3):
                step()
            timers.run.clear()
            timers.launcher.clear()
            host = []
            for _ in range(a.steps):
                sync(device)
                timers.on = True
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
                timers.on = False
            sync(device)
            per_step_run = sum(sum(v) for v in timers.run.values()) / a.steps
            per_step_launcher = sum(sum(v) for v in timers.launcher.values()) / a.steps
            lines += [f"## T = {tokens}, {variant}", "",
                      f"Step host time {statistics.median(host):.3f} ms (median of {a.steps}); launches "
                      f"{per_step_run / 1e3:.3f} ms a step, of which the launcher "
                      f"{per_step_launcher / 1e3:.3f}.",
                      "", "| kernel | launches a step | run µs | launcher µs |", "|---|---:|---:|---:|"]
            for name, v in sorted(timers.run.items(), key=lambda kv: -sum(kv[1])):
                lau = timers.launcher.get(name, [])
                lines.append(f"| `{name}` | {len(v) / a.steps:g} | {statistics.median(v):.1f} | "
                             f"{statistics.median(lau) if lau else float('nan'):.1f} |")
            lines.append("")
            print("\n".join(lines[-(len(timers.run) + 6):]), flush=True)
        del steps
        torch.cuda.empty_cache()
    lines += ["## Bare Triton launches (back to back, best of 5 rounds)", "", *bare_launches()]
    text = "\n".join(lines)
    print("\n".join(lines[-8:]))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
