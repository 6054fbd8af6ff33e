"""One rule for "does this buffer fit": a share of the device's free memory, or a stated limit.

Used before allocating anything large (the padded backend's (E, cap, *) buffers, the lab's layers
and peer workspaces), so that a workload that cannot fit is refused with a reason instead of
crashing or driving the machine out of memory.
"""

from __future__ import annotations

import os

import torch

MEMORY_HEADROOM = 0.8   # never plan to take more than this share of what is free
UNBOUNDED = 1 << 62
MEMINFO = "/proc/meminfo"


def _available_physical() -> int:
    """MemAvailable (free pages and the cache Linux can drop), else the free pages; else unbounded."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return UNBOUNDED


def _address_space_left() -> int:
    """What an address-space limit (`ulimit -v`) leaves this process; unbounded without one."""
    try:
        import resource  # POSIX only
    except ImportError:
        return UNBOUNDED
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return UNBOUNDED
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return limit
    return max(0, limit - used)


def free_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or on the CPU the available physical memory, capped by what an
    address-space limit leaves the process."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return min(_available_physical(), _address_space_left())


def allowed_bytes(device: torch.device, limit_bytes: int | None = None) -> int:
    """MEMORY_HEADROOM of the free memory, capped by `limit_bytes` when one is given."""
    allowed = int(MEMORY_HEADROOM * free_bytes(device))
    return allowed if limit_bytes is None else min(allowed, limit_bytes)


def fits(num_bytes: int, device: torch.device, limit_bytes: int | None = None) -> str:
    """"" when num_bytes fits in `allowed_bytes`, else the reason it does not ("" while torch.compile
    traces: Dynamo cannot call the free-memory query, and the sizes may be symbolic)."""
    if torch.compiler.is_compiling():
        return ""
    allowed = allowed_bytes(device, limit_bytes)
    if num_bytes <= allowed:
        return ""
    return (f"needs {num_bytes / 1e9:.3g} GB, over the {allowed / 1e9:.3g} GB allowed on {device} "
            f"({MEMORY_HEADROOM:.0%} of the free memory{' or the stated limit' if limit_bytes else ''})")
