"""The roofs, measured once per run on the device under test.

    copy_gbps      a large device-to-device copy; read + write bytes over time (STREAM's convention)
    matmul_tflops  a large square matmul in the benchmark's dtype; 2 N^3 FLOPs over time
    fp8_tflops     runs that time FP8 weights (`moekit bench --weights fp8`): a dense e4m3 matmul
                   of 8192^3 through torch._scaled_mm with fp32 scales, bf16 out, on CUDA (NaN on
                   the CPU, or where the device has no FP8 matmul; FP8 floors then use matmul_tflops)

Measured rather than taken from a datasheet: the floor should be what this device actually
reaches, at its clocks and power limit, as the article measured its own roofs. On the CPU the same
two numbers are measured on the CPU, so the flow is the same even if the numbers mean less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekit.bench.timing import time_fn

# Sizes large enough to reach steady state (well past any cache), small enough to take < 1 s.
CUDA_COPY_BYTES = 1 << 30
CUDA_MATMUL_N = 8192
CPU_COPY_BYTES = 128 << 20
CPU_MATMUL_N = 1024
FP8_MATMUL_N = 8192


@dataclass(frozen=True)
class Ceilings:
    """Measured roofs of one device.

    Attributes:
        copy_gbps: copy bandwidth in GB/s (1e9 bytes/s), read and write bytes both counted.
        matmul_tflops: dense matmul rate in TFLOP/s (1e12 FLOP/s) in the benchmark's dtype.
        fp8_tflops: dense e4m3 matmul rate in TFLOP/s; NaN when not measured.
    """

    copy_gbps: float
    matmul_tflops: float
    fp8_tflops: float = math.nan

    def __post_init__(self) -> None:
        for name in ("copy_gbps", "matmul_tflops", "fp8_tflops"):
            v = getattr(self, name)
            if name == "fp8_tflops" and isinstance(v, float) and math.isnan(v):
                continue
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"Ceilings.{name} must be a positive number, got {v!r}")

    def compute_tflops(self, fp8: bool = False) -> float:
        """The compute roof: the dtype's matmul rate, or with fp8 the FP8 one (the dtype's when the
        FP8 rate was not measured)."""
        return self.fp8_tflops if fp8 and not math.isnan(self.fp8_tflops) else self.matmul_tflops

    def ridge(self, fp8: bool = False) -> float:
        """Arithmetic intensity (FLOPs per byte) where that compute roof meets the bandwidth roof."""
        return self.compute_tflops(fp8) * 1e12 / (self.copy_gbps * 1e9)

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the dtype's compute roof meets the bandwidth roof."""
        return self.ridge()


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


def measure_fp8_tflops(device: torch.device, n: int = FP8_MATMUL_N, rep: int | None = None) -> float:
    """A dense (n, n) x (n, n) matmul of float8_e4m3fn operands with fp32 scales (per tensor), bf16
    out, through torch._scaled_mm (cuBLAS's FP8 GEMM on CUDA, fp32 accumulation): 2 n^3 FLOPs over
    time. Raises RuntimeError where the device has no FP8 matmul."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device, generator=g).to(torch.float8_e4m3fn)
    scale = torch.ones((), device=device)
    # _scaled_mm takes its second operand column-major: b.t() of a row-major b is.
    stats = time_fn(lambda: torch._scaled_mm(a, b.t(), scale, scale, out_dtype=torch.bfloat16),
                    rep=rep, flush_l2=False, device=device)
    return 2 * n**3 / (stats.median_ms * 1e-3) / 1e12


def fp8_ceiling(device: torch.device, rep: int | None = None) -> tuple[float, str]:
    """(fp8_tflops, "") measured on a CUDA device, or (NaN, why not): on the CPU the FP8 roof is not
    measured (its floors use the dtype's matmul rate), nor on a GPU without an FP8 matmul."""
    if device.type != "cuda":
        return math.nan, ("FP8 ceiling not measured on the CPU: the FP8 rows' floors use the matmul "
                          "ceiling of the dtype")
    try:
        return measure_fp8_tflops(device, FP8_MATMUL_N, rep), ""
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return math.nan, (f"FP8 ceiling not measured (torch._scaled_mm: {first}): the FP8 rows' floors "
                          "use the matmul ceiling of the dtype")


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
