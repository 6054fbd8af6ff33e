"""What the kernel families share (each family's kernels live in its folder: routing, align,
grouped_gemm, decode, masked, parallel): the programmatic dependent launch entry (`pdl`), and the
interpreter switch. Every family's kernels module imports this package before Triton: on a machine
without CUDA it switches Triton to its interpreter, and the flag must be set before any kernel is
defined (set TRITON_INTERPRET=0 to opt out).
"""

import os as _os
import sys as _sys
import warnings as _warnings

if "TRITON_INTERPRET" not in _os.environ:   # `moekit/__init__` left the decision to torch
    import torch as _torch

    if not _torch.cuda.is_available():
        if "triton" in _sys.modules:
            _warnings.warn("moekit: no CUDA device, but Triton was imported before moekit, so its kernels "
                           "cannot run interpreted; set TRITON_INTERPRET=1 before importing triton",
                           stacklevel=2)
        _os.environ["TRITON_INTERPRET"] = "1"

from moekit._validation import interpreting as _interpreting  # noqa: E402

if _interpreting():
    from moekit._compat import patch_triton_interpreter

    patch_triton_interpreter()
