"""Where one call's device time goes, kernel by kernel: forward, or forward + backward (training).

    PYTHONPATH=$PWD/src python3 scripts/kernel_breakdown.py [--backward] [--backends triton,grouped_mm]
        [--tokens 1024,4096,16384] [--preset qwen3-30b-a3b] [--out breakdown.md]

For each backend and T: the inputs as `moekit bench` draws them (routed by the preset's router),
three untimed calls, then one call under torch.profiler. On CUDA every kernel (and memcpy/memset)
the call ran is grouped by name (Triton kernels by their function name) with its count, device ms
and share of the call's device time; the call's wall time and device-busy share come with it. On a
CPU there is no device timeline: the aten ops' self CPU time is listed instead (a smoke run of the
script, not a GPU figure). The numbers are one profiled call, for attribution; the timings to quote
come from `moekit bench`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from moekit.bench.runner import make_weights
from moekit.experts import moe_experts
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def breakdown(fn, device: torch.device) -> tuple[list[tuple[str, int, float]], float, float]:
    """([(name, count, ms)] largest first, wall ms, device-busy ms (NaN on CPU)) of one call."""
    for _ in range(3):
        fn()
    _sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    rows: dict[str, list] = defaultdict(lambda: [0, 0.0])
    if device.type == "cuda":
        intervals = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                rows[e.name][0] += 1
                rows[e.name][1] += e.time_range.elapsed_us() / 1e3
                intervals.append((e.time_range.start, e.time_range.end))
        busy, end = 0.0, -1.0
        for s, t in sorted(intervals):   # the union of the device intervals
            if t > end:
                busy += (t - max(s, end)) / 1e3
                end = t
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::") and e.self_cpu_time_total > 0:
                rows[e.key][0] += e.count
                rows[e.key][1] += e.self_cpu_time_total / 1e3
        busy = float("nan")
    out = sorted(((k, c, ms) for k, (c, ms) in rows.items()), key=lambda r: -r[2])
    return out, wall, busy


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
    a = p.parse_args(argv)
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
             f"{torch.cuda.get_device_name() if cuda else 'CPU (aten self time, not a GPU figure)'}", ""]
    for t in tokens:
        inputs = _inputs(preset, t, dtype, device)
        for backend in a.backends.split(","):
            try:
                rows, wall, busy = breakdown(_call(backend, a.backward, *inputs), device)
            except (RuntimeError, ValueError) as exc:
                lines += [f"## {backend}, T = {t}: not run ({str(exc).splitlines()[0]})", ""]
                continue
            total = sum(ms for _, _, ms in rows)
            lines += [f"## {backend}, T = {t}: wall {wall:.3f} ms, device busy {busy:.3f} ms, "
                      f"{sum(c for _, c, _ in rows)} activities", "",
                      "| kernel | count | ms | share |", "|---|---:|---:|---:|"]
            lines += [f"| `{_short(n)}` | {c} | {ms:.3f} | {ms / total:.0%} |" for n, c, ms in rows[: a.top]]
            rest = rows[a.top:]
            if rest:
                rest_ms = sum(ms for _, _, ms in rest)
                lines.append(f"| {len(rest)} others | {sum(c for _, c, _ in rest)} | {rest_ms:.3f} | "
                             f"{rest_ms / total:.0%} |")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
