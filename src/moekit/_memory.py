"""One rule for "does this buffer fit": a share of the device's free memory, or a stated limit.

Used before allocating anything large (the padded backend's (E, cap, *) buffers, the lab's peer
workspaces), so that a workload that cannot fit is refused with a reason instead of crashing or
driving the machine out of memory.
"""

from __future__ import annotations

import os

import torch

MEMORY_HEADROOM = 0.8   # never plan to take more than this share of what is free


def free_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or available physical memory (CPU on Linux; else unbounded)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def allowed_bytes(device: torch.device, limit_bytes: int | None = None) -> int:
    """MEMORY_HEADROOM of the free memory, capped by `limit_bytes` when one is given."""
    allowed = int(MEMORY_HEADROOM * free_bytes(device))
    return allowed if limit_bytes is None else min(allowed, limit_bytes)


def fits(num_bytes: int, device: torch.device, limit_bytes: int | None = None) -> str:
    """"" when num_bytes fits in `allowed_bytes`, else the reason it does not."""
    allowed = allowed_bytes(device, limit_bytes)
    if num_bytes <= allowed:
        return ""
    return (f"needs {num_bytes / 1e9:.3g} GB, over the {allowed / 1e9:.3g} GB allowed on {device} "
            f"({MEMORY_HEADROOM:.0%} of the free memory{' or the stated limit' if limit_bytes else ''})")
