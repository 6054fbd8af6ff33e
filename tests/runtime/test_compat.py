"""moekit._compat: the interpreter shims (CPU only: on a GPU the kernels are compiled)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import moekit.kernels  # noqa: F401  (installs the shims where the interpreter runs)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's shims")


@triton.jit
def _rows_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
def test_interpreted_dot_rows_do_not_depend_on_the_tile_height(dtype):
    """A row of tl.dot is the same bits in a 16-row tile as in a 128-row one, and equals its sum
    taken exactly (fp64) and rounded once to fp32: what lets tests compare two tilings bitwise."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(128, 256, generator=g).to(dtype)
    b = torch.randn(256, 64, generator=g).to(dtype)
    tall = torch.empty(128, 64)
    _rows_dot[(1,)](a, b, tall, M=128, K=256, N=64)
    short = torch.empty(16, 64)
    _rows_dot[(1,)](a[:16].clone(), b, short, M=16, K=256, N=64)
    assert torch.equal(short, tall[:16])
    exact = (a.double() @ b.double()).float()
    assert torch.equal(tall, exact)
