"""CUDA-graph capture that fails cleanly: one helper for the layer's buckets and the lab's timings.

`torch.cuda.graph()` (the context manager) raises from capture_end before restoring the current
stream when a capture fails, so every later op runs on a dead capture stream, and a failed capture
leaves PyTorch's CUDA generators in capture mode. `capture_graph` warms up on a side stream, checks
that the call does not sync the host, captures by hand, and on failure restores the state and
raises `NotCapturable` with the first error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class NotCapturable(RuntimeError):
    """`fn` cannot be recorded in a CUDA graph (it syncs the host, or there is no CUDA device)."""


def _check_no_host_sync(fn: Callable[[], object], device: torch.device) -> None:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc).lower():
            raise
        raise NotCapturable(f"the call synchronizes the host: {str(exc).splitlines()[0]}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(device)


def _reset_capture_state(device: torch.device) -> None:
    """After a failed capture: a small capture that succeeds takes the generators out of capture mode."""
    stream = torch.cuda.Stream(device)
    scratch = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin()
            scratch.add_(1)
            graph.capture_end()
        torch.cuda.synchronize(device)
    except RuntimeError:
        pass  # best effort: the original failure is what gets reported


def capture_graph(fn: Callable[[], object], device: torch.device, *, pool: tuple | None = None,
                  warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """Record `fn` in a CUDA graph; raise `NotCapturable` with the reason when it cannot be.

    Args:
        fn: the work to record; it must not sync the host (checked before capturing).
        device: a CUDA device.
        pool: a memory pool (`torch.cuda.graph_pool_handle()`) shared with other graphs.
        warmup: calls on a side stream first, so lazy initialisation never happens while capturing.

    Returns:
        (graph, what fn returned while capturing: the static output every replay rewrites).
    """
    if device.type != "cuda":
        raise NotCapturable(f"CUDA graphs need a CUDA device, got {device}")
    # Warm up on a side stream first: lazy initialisation (cuBLAS handles, Triton JIT, caching
    # allocator growth) must not happen while capturing.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    # A capture that fails leaves PyTorch's CUDA generators in capture mode (every later random
    # op on the device then raises), so a call that syncs the host is caught here, uncaptured.
    _check_no_host_sync(fn, device)
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream(device)
    capture_stream.wait_stream(torch.cuda.current_stream(device))
    failure: Exception | None = None
    # capture_begin/end by hand rather than torch.cuda.graph(): when capture fails, that context
    # manager raises from capture_end before restoring the current stream, and every later op
    # would then run on the dead capture stream. Here the stream context always unwinds, and the
    # first error (the real reason, e.g. a host sync) is the one reported.
    with torch.cuda.stream(capture_stream):
        graph.capture_begin(pool=pool)
        try:
            out = fn()
        except Exception as exc:
            failure = exc
        try:
            graph.capture_end()
        except Exception as exc:
            failure = failure or exc
    torch.cuda.current_stream(device).wait_stream(capture_stream)
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:  # an invalidated capture may surface once more here
        failure = failure or exc
    if failure is not None:
        _reset_capture_state(device)
        text = str(failure).strip()
        raise NotCapturable(f"{type(failure).__name__}: {text.splitlines()[0] if text else ''}") from failure
    return graph, out
