"""How much of an isolated CUDA-graph replay's time is the graph's launch, on a GPU (issues 10, 15).

    PYTHONPATH=$PWD/src python3 scripts/graph_launch.py [--tokens 2048,4096,16384] [--out graph_launch.md]

`moekit bench` times a graph row as one isolated call: flush the L2, synchronize, record the start
event, `graph.replay()`, record the end event. The device is idle when the start event is recorded,
so the time includes the host's `cudaGraphLaunch` until the first kernel starts. For each T, the
expert path's forward and its training step (each recorded whole, as `moekit bench` and `moekit bench
--backward` record them) timed three ways, medians over the same number of calls:

    isolated   as `moekit bench` times it
    queued     the same, but a kernel that keeps the device busy for SLEEP_MS is queued after the
               flush and before the start event, so the replay's launch is done before its first
               kernel may start: the graph's device time after a flushed L2
    steady     N replays back to back between two events, per replay (no flush: a training loop's
               view, where each step's traffic has long evicted the last one's)

and the host time of `graph.replay()` alone (perf_counter around it, the device busy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_breakdown import _call, _inputs  # noqa: E402

from moekit.bench.timing import CacheFlusher, sync  # noqa: E402
from moekit.graphs import capture_graph  # noqa: E402

SLEEP_MS = 2.0


def _sleep_cycles(device: torch.device) -> int:
    """torch.cuda._sleep cycles for about SLEEP_MS at the SM clock (measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * SLEEP_MS / max(start.elapsed_time(end), 1e-3))


def timings(graph, device: torch.device, n: int, cycles: int) -> dict[str, float]:
    flush = CacheFlusher(device)
    out: dict[str, list[float]] = {"isolated": [], "queued": [], "replay host": []}
    for _ in range(n):
        for mode in ("isolated", "queued"):
            flush()
            sync(device)
            if mode == "queued":
                torch.cuda._sleep(cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            graph.replay()
            host = time.perf_counter() - t0
            end.record()
            end.synchronize()
            out[mode].append(start.elapsed_time(end))
            if mode == "queued":
                out["replay host"].append(host * 1e3)
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    result = {k: statistics.median(v) for k, v in out.items()}
    result["steady"] = start.elapsed_time(end) / n
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,4096,16384")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    device = torch.device("cuda")
    cycles = _sleep_cycles(device)
    gpu = torch.cuda.get_device_name()
    lines = [f"# Graph launch inside an isolated replay, {a.preset}, bf16, {gpu}", "",
             "| T | call | isolated ms | queued ms | steady ms | replay() host ms |",
             "|---:|---|---:|---:|---:|---:|"]
    for tokens in (int(v) for v in a.tokens.split(",")):
        inputs = _inputs(a.preset, tokens, torch.bfloat16, device)
        for name, backward in (("forward", False), ("training step", True)):
            graph, _ = capture_graph(_call("triton", backward, *inputs), device)
            r = timings(graph, device, a.calls, cycles)
            lines.append(f"| {tokens} | {name} | {r['isolated']:.4f} | {r['queued']:.4f} | "
                         f"{r['steady']:.4f} | {r['replay host']:.4f} |")
            print(lines[-1], flush=True)
            del graph
        del inputs
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
