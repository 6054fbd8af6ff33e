"""Compatibility shims, applied only where they are needed.

Triton's interpreter (3.6 and earlier) turns a 1-element scalar into an index with
`int(array)`, which NumPy >= 2.4 refuses for arrays of ndim > 0: every loop whose bound is a
kernel argument then fails under TRITON_INTERPRET=1. The shim makes `__index__` read the single
element instead.

The interpreter computes `tl.dot` of fp16 / fp32 tiles as one NumPy matmul in fp32, whose BLAS may
order each element's sum by the tile's shape: on an AMD EPYC with OpenBLAS 0.3.31 (its Zen and
Haswell kernels) a row of a [64, K] @ [K, N] product differed in its last bit from the same row of a
[32, K] @ [K, N] one, so two tilings that a GPU runs bit for bit alike (paired and single row blocks,
the masked and contiguous layouts) did not match interpreted. The shim computes such a dot in fp64
and rounds it to fp32 once: every element is its exact sum rounded, whatever the tile's shape (a
GPU's MMA also accumulates each element independently of the tile's other rows). bf16 tiles go the
same way: the interpreter holds them as their uint16 bits and its own dot multiplies those integers,
so the shim widens the bits to the fp32 they are the upper half of (exact) before the matmul.

Both touch only the interpreter, and only when it is in use.
"""

from __future__ import annotations

import numpy as np

_DOT_INPUTS = (np.float16, np.float32)


def patch_triton_interpreter() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_moekit_shim", False):
        return

    def _index(self) -> int:
        data = self.handle.data
        return int(data.reshape(-1)[0]) if data.size == 1 else int(data)

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patched._moekit_shim = True
    interpreter._patch_lang_tensor = patched
    _patch_dot(interpreter)


def _is_bf16(handle) -> bool:
    return getattr(handle.dtype, "is_bf16", lambda: False)() and handle.data.dtype == np.uint16


def _is_dot_input(handle) -> bool:
    return handle.data.dtype in _DOT_INPUTS or _is_bf16(handle)


def _as_float64(handle) -> np.ndarray:
    if _is_bf16(handle):
        # The interpreter holds bf16 as its uint16 bits: the upper half of an fp32, exact once widened.
        return (handle.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return handle.data.astype(np.float64)


def _patch_dot(interpreter) -> None:
    """InterpreterBuilder.create_dot of fp16 / bf16 / fp32 tiles into an fp32 accumulator: the matmul in
    fp64, rounded once (see the module docstring); every other dot as Triton computes it."""
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_moekit_shim", False):
        return

    def create_dot(self, a, b, d, *args, **kwargs):
        if d.data.dtype == np.float32 and _is_dot_input(a) and _is_dot_input(b):
            exact = np.matmul(_as_float64(a), _as_float64(b))
            return interpreter.TensorHandle(exact.astype(np.float32) + d.data, d.dtype.scalar)
        return original(self, a, b, d, *args, **kwargs)

    create_dot._moekit_shim = True
    builder.create_dot = create_dot
