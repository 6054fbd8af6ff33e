"""Triton launches with the JIT's per-call binding done once per specialization.

`kernel[grid](*args, **kwargs)` makes Triton bind every argument (an exec'd binder calling the
native specializer per argument), build and look up a cache key, ask for launch metadata and only
then call the compiled kernel's launcher. On the H200's host that came to several tens of us a
launch, and a training step of the triton path launches about twenty kernels: its host time
exceeded the device's at 1,024-4,096 tokens (`scripts/kernel_breakdown.py --host-profile`).

`launch(kernel, grid, *args, **kwargs)` launches the same kernel with the same arguments. The first
call of each specialization goes through `kernel[grid]` (which compiles if needed) and keeps the
`CompiledKernel` it returns; later calls with the same specialization call its launcher directly.
The specialization key is computed here, more finely than Triton's own, so two calls that share a
key always share Triton's (and so its compiled kernel):

    a tensor          its dtype and whether its address is 16-byte aligned
    an int            whether it is 1, whether it is a multiple of 16, and its integer width class
    a bool, a str     its value
    a float, None     its type
    a TensorDescriptor its dtype, block shape, layout, padding and base alignment
    keyword arguments (constexprs and launch options): names and values, in the call's order

Anything else (another argument type, an unhashable keyword value), a CPU tensor (so the
interpreter's launches, TRITON_INTERPRET=1, never come here), a launch hook added to Triton's knobs,
a kernel whose `run` is shadowed (the stubs of `scripts/host_overhead.py`), or
`$MOEKIT_FAST_LAUNCH=0` (read at each call) takes `kernel[grid]` every time. The direct call uses
the current device and stream as Triton does.
"""

from __future__ import annotations

import os

import torch

FAST_LAUNCH_ENV = "MOEKIT_FAST_LAUNCH"

_I32 = 2**31
_I64 = 2**63


def _spec(a):
    """One argument's part of the key (see the module doc); raises TypeError when not handled,
    ValueError for a tensor off CUDA."""
    if isinstance(a, torch.Tensor):
        if not a.is_cuda:
            raise ValueError(a.device)
        return (a.dtype, a.data_ptr() & 15 == 0)
    t = type(a)
    if t is int:
        return (a == 1, a & 15 == 0, -_I32 <= a < _I32, -_I64 <= a < _I64)
    if t is bool or t is str:
        return (t, a)
    if a is None or t is float:
        return t
    if hasattr(a, "block_shape") and hasattr(a, "base"):       # a host tensor descriptor
        base = a.base
        if base.device.type != "cuda":
            raise ValueError(base.device)
        return (t, base.dtype, tuple(a.block_shape), repr(getattr(a, "layout", None)),
                getattr(a, "padding", None), base.data_ptr() & 15 == 0)
    raise TypeError(t)


class _Entry:
    """A kept compiled kernel and how to lay the call's arguments out in its parameter order."""

    __slots__ = ("compiled", "names", "defaults")

    def __init__(self, compiled, names: list[str], defaults: dict):
        self.compiled, self.names, self.defaults = compiled, names, defaults


_CACHE: dict = {}


def _entry(kernel, compiled, args: tuple, kwargs: dict) -> _Entry | None:
    """What a direct call of this specialization needs, or None (not a compiled kernel Triton
    returned, or parameters neither given nor defaulted)."""
    if compiled is None or not hasattr(compiled, "packed_metadata") or hasattr(compiled, "result"):
        return None
    params = kernel.signature.parameters
    names = [p.name for p in kernel.params]
    rest = [n for n in names[len(args):] if n not in kwargs]
    if any(params[n].default is params[n].empty for n in rest):
        return None
    return _Entry(compiled, names, {n: params[n].default for n in rest})


def _key(args: tuple) -> tuple:
    """The arguments' part of the key: `_spec` of each, with tensors and ints (nearly every
    argument) handled inline (this runs at every launch)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_cuda:
                raise ValueError(a.device)
            out.append((a.dtype, a.data_ptr() & 15 == 0))
        elif type(a) is int and -_I32 <= a < _I32:
            out.append((a == 1, a & 15 == 0))
        else:
            out.append(_spec(a))
    return tuple(out)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, with Triton's per-call binding done once per
    specialization (see the module doc)."""
    if os.environ.get(FAST_LAUNCH_ENV, "1") == "0" or "run" in vars(kernel):
        kernel[grid](*args, **kwargs)
        return
    try:
        specs = _key(args)          # first: a CPU tensor (the interpreter's) leaves here
        key = (id(kernel), torch.cuda.current_device(), len(args), tuple(kwargs.items()), specs)
        hash(key)
    except (TypeError, ValueError):
        kernel[grid](*args, **kwargs)
        return
    from triton import knobs

    entry = _CACHE.get(key)
    if entry is None or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        compiled = kernel[grid](*args, **kwargs)
        if entry is None:
            entry = _entry(kernel, compiled, args, kwargs)
            if entry is not None:
                _CACHE[key] = entry
        return
    values = list(args)
    for name in entry.names[len(args):]:
        values.append(kwargs[name] if name in kwargs else entry.defaults[name])
    compiled = entry.compiled
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _stream(), compiled.function,
                 compiled.packed_metadata, None, None, None, *values)


def _hooked(hook) -> bool:
    """Whether a launch hook of Triton's knobs would run: set, and not an empty HookChain (what
    Triton 3.6 and later hold when nobody added one)."""
    return hook is not None and getattr(hook, "calls", True) != []


def _stream() -> int:
    """The current CUDA stream of the current device, as Triton's launch takes it."""
    from triton.runtime.driver import driver
    active = driver.active
    return active.get_current_stream(active.get_current_device())


def clear_cache() -> None:
    """Forget every kept compiled kernel (tests)."""
    _CACHE.clear()
