"""Two launch hints of the inference kernels on Hopper and later, on by default there; each an
environment switch ("0" turns it off) read once a call by the triton path's plan
(`moekit.experts.plan`) and at each launch of a launcher called without one, so one process can time
both settings side by side (`moekit sweep --set hints`):

    MOEKIT_PDL                  programmatic dependent launch. The router, align, GEMM1, GEMM2, sum
                                and direct-decode kernels, and in the backward the row gathers, tile
                                sums, row starts and dx (GEMM2 and its sum; the Gluon kernels and the
                                Triton fallbacks of the SwiGLU backward and the weight gradients are
                                launched plainly) are launched with the programmatic stream
                                serialization attribute: a kernel's programs may start (and wait on
                                the SM) while the kernel before it in the stream finishes, so each
                                launch and ramp overlaps the tail of the kernel before. Every such
                                kernel first executes `griddepcontrol.wait` (the kernel before it has
                                finished and its memory is visible) and only then reads anything,
                                then `griddepcontrol.launch_dependents`: the kernel before may be
                                anyone's (an optimizer step writing the weights).
    MOEKIT_WEIGHT_EVICT_FIRST   the direct decode kernels' weight loads carry the L2 `evict_first`
                                priority when a call has at most EVICT_MAX_PAIRS pairs: each weight
                                tile is read once, so it replaces its own kind in L2 instead of what
                                is read again or still has to be written back (a call that small
                                is short enough for those write-backs to show).

The grouped GEMMs' weight tiles go through cp.async or TMA, which carry no cache policy in Triton,
so evict_first applies to the decode kernels alone, and only to small calls (beyond a few pairs it
gains nothing). Both change only the schedule or the cache priority,
never a value: the results are bitwise those of the plain launch (GPU-tested). Off CUDA, under the
interpreter and before compute capability 9 both are off.
"""

from __future__ import annotations

import functools

import torch

from moekit import env
from moekit._validation import interpreting

PDL_ENV = "MOEKIT_PDL"
EVICT_ENV = "MOEKIT_WEIGHT_EVICT_FIRST"
# evict_first up to this many (token, slot) pairs a call: Qwen3-30B-A3B's T = 1 and 2 (the decode
# kernels' SMALL_DECODE band); from 32 pairs on, the weights' L2 reuse outweighs it.
EVICT_MAX_PAIRS = 16


@functools.lru_cache(maxsize=16)
def capability_major(index: int) -> int:
    """The compute capability's major number of CUDA device `index` (cached)."""
    return torch.cuda.get_device_capability(index)[0]


def _hopper(device: torch.device) -> bool:
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return capability_major(index) >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch ($MOEKIT_PDL, Hopper+)."""
    return env.flag(PDL_ENV) and _hopper(device)


def pdl_kwargs(device: torch.device, on: bool | None = None) -> dict:
    """Launch keywords of a kernel with a USE_PDL constexpr: {} (the plain launch, the kernel compiled
    as before) or USE_PDL with Triton's `launch_pdl` option. on: the caller's decision (a call's
    plan, `moekit.experts.plan`); None: `pdl_enabled(device)`, read now."""
    if on is None:
        on = pdl_enabled(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {}


def weight_evict(device: torch.device, num_pairs: int) -> str:
    """The eviction policy of the decode kernels' weight loads for a call of num_pairs pairs:
    "evict_first" ($MOEKIT_WEIGHT_EVICT_FIRST, Hopper+, at most EVICT_MAX_PAIRS pairs) or ""."""
    if num_pairs > EVICT_MAX_PAIRS or not env.flag(EVICT_ENV) or not _hopper(device):
        return ""
    return "evict_first"
