"""Programmatic dependent launch, the kernel side (`moekit.launch_hints` says when it is on)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with `launch_pdl`: wait until the kernel before it in the
    stream has finished and its memory is visible, then let the next kernel launch. Nothing (compiled
    out) when USE_PDL is False."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
