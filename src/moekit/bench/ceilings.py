"""The two roofs, measured once per run on the device under test.

    copy_gbps      a large device-to-device copy; read + write bytes over time (STREAM's convention)
    matmul_tflops  a large square matmul in the benchmark's dtype; 2 N^3 FLOPs over time

Measured rather than taken from a datasheet: the floor should be what this device actually
reaches, at its clocks and power limit, as the article measured its own roofs. On the CPU the same
two numbers are measured on the CPU, so the flow is the same even if the numbers mean less.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.bench.timing import time_fn

# Sizes large enough to reach steady state (well past any cache), small enough to take < 1 s.
CUDA_COPY_BYTES = 1 << 30
CUDA_MATMUL_N = 8192
CPU_COPY_BYTES = 128 << 20
CPU_MATMUL_N = 1024


@dataclass(frozen=True)
class Ceilings:
    """Measured roofs of one device.

    Attributes:
        copy_gbps: copy bandwidth in GB/s (1e9 bytes/s), read and write bytes both counted.
        matmul_tflops: dense matmul rate in TFLOP/s (1e12 FLOP/s) in the benchmark's dtype.
    """

    copy_gbps: float
    matmul_tflops: float

    def __post_init__(self) -> None:
        for name in ("copy_gbps", "matmul_tflops"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"Ceilings.{name} must be a positive number, got {v!r}")

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the compute roof meets the bandwidth roof."""
        return self.matmul_tflops * 1e12 / (self.copy_gbps * 1e9)


def measure_copy_gbps(device: torch.device, nbytes: int, rep: int | None = None) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    stats = time_fn(lambda: dst.copy_(src), rep=rep, flush_l2=False, device=device)
    return 2 * nbytes / (stats.median_ms * 1e-3) / 1e9


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, rep: int | None = None) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    stats = time_fn(lambda: torch.mm(a, b, out=c), rep=rep, flush_l2=False, device=device)
    return 2 * n**3 / (stats.median_ms * 1e-3) / 1e12


def measure_ceilings(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    rep: int | None = None,
) -> Ceilings:
    """Measure copy bandwidth and matmul rate on `device` (sizes default by device type)."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (CUDA_COPY_BYTES if on_cuda else CPU_COPY_BYTES)
    matmul_n = matmul_n or (CUDA_MATMUL_N if on_cuda else CPU_MATMUL_N)
    return Ceilings(
        copy_gbps=measure_copy_gbps(device, copy_bytes, rep),
        matmul_tflops=measure_matmul_tflops(device, dtype, matmul_n, rep),
    )
