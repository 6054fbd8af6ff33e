"""@triton.jit code only; launchers live beside the ops that use them (routing, align, grouped_gemm,
masked). Importing this package first switches Triton to its interpreter on a machine without CUDA:
the flag must be set before any kernel is defined (set TRITON_INTERPRET=0 to opt out).
"""

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"

from moekit._validation import interpreting as _interpreting  # noqa: E402

if _interpreting():
    from moekit._compat import patch_triton_interpreter

    patch_triton_interpreter()
