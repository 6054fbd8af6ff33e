"""Compatibility shims, applied only where they are needed.

Triton's interpreter (3.6 and earlier) turns a 1-element scalar into an index with
`int(array)`, which NumPy >= 2.4 refuses for arrays of ndim > 0: every loop whose bound is a
kernel argument then fails under TRITON_INTERPRET=1. The shim makes `__index__` read the single
element instead. It touches only the interpreter, and only when it is in use.
"""

from __future__ import annotations


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
