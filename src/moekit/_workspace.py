"""Fresh buffers for the kernels' outputs and workspaces, with a poison mode for tests.

With poisoning on (`MOEKIT_POISON_WORKSPACES=1`, or the `poisoning()` context manager), every buffer
that a launcher allocates for a kernel to fill starts as NaN (floats) or the dtype's minimum
(integers), so a row a kernel forgets to write shows up in the result or as an out-of-range index,
never as a plausible stale value. Off by default: it costs a fill per buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moekit import env

_poison = env.flag("MOEKIT_POISON_WORKSPACES")


def empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.empty, NaN- or minimum-filled while poisoning is on."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison:
        t.fill_(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min)
    return t


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(*t.shape, dtype=t.dtype, device=t.device)


ALIGN_BYTES = 16       # Triton specialises a pointer on its address being a multiple of 16


def empty_parts(sizes: tuple[int, ...], *, dtype: torch.dtype,
                device: torch.device | str) -> list[torch.Tensor]:
    """1-D buffers of these lengths carved out of one allocation (one torch.empty and one split in
    place of an allocation each: on a GPU each is host work). They never overlap, and each starts on
    an ALIGN_BYTES boundary, as a buffer of its own does (so the kernels specialise alike)."""
    return split_parts(empty(parts_size(sizes, dtype), dtype=dtype, device=device), sizes)


def _pieces(sizes: tuple, dtype: torch.dtype) -> list:
    """Each part's length, then the padding that takes the next one to an ALIGN_BYTES boundary.
    Plain arithmetic: the sizes may be symbolic (torch.compile's fake tensors)."""
    unit = max(1, ALIGN_BYTES // dtype.itemsize)
    pieces = []
    for n in sizes:
        pieces += (n, -n % unit)
    return pieces


def parts_size(sizes: tuple, dtype: torch.dtype) -> int:
    """Elements of the one allocation `empty_parts` carves these parts from."""
    return sum(_pieces(sizes, dtype))


def split_parts(buffer: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The parts of an `empty_parts` allocation (1-D, `parts_size` long), as views of it."""
    return list(buffer.split(_pieces(sizes, buffer.dtype))[::2])


@contextlib.contextmanager
def poisoning(enabled: bool = True) -> Iterator[None]:
    """Turn workspace poisoning on (or off) inside the block."""
    global _poison
    before, _poison = _poison, enabled
    try:
        yield
    finally:
        _poison = before
