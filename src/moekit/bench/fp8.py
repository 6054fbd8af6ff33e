"""Block-scaled FP8 expert weights in the lab (`moekit bench --weights fp8`, `moekit ablate`'s fp8
ablation): the layer's weights quantized once, the call timed on them, and the oracle each call is
checked against before it is timed.

    quantize_layer   the dense weights -> `moekit.quant.Fp8Weight`s (`quantize_experts`: e4m3, one
                     fp32 scale per 128 x 128 block), once per layer (`quantize_projections`: any
                     pair of projections, e.g. `moekit tune --weights fp8`'s). On the CPU the data
                     are held as float16 stand-ins of the same values: Triton's interpreter has no
                     e4m3 dot
    fp8_factory      backend b on them: `moe_experts(x, gate_up, down, ..., backend=b)` on CUDA, as a
                     user calls it; on the CPU the backend's `run_fp8` on the stand-ins (moe_experts
                     takes e4m3 data only)
    Fp8Workloads     a workload's FP8 twins: the same x, routing and weights' values, the traffic of
                     `roofline.fp8_traffic` (FP8 bytes, the FP8 roof) and the reference of the path
                     the backend runs:

    path                              fp32 reference                     plain PyTorch baseline
    w8a8: triton above the decode     `experts_fp8_torch`: x quantized   `correctness.experts_same_dtype`
    bound, loop                       per token per 128 channels, the    in the dtype on the weights
                                      weights dequantized, h quantized   dequantized to it, x and h
                                      per 128 columns                    quantized and back (`fake_quant`)
    w8a16: triton's decode path       the fp32 layer on the weights      the same loop on them, x and h
    (`moekit.decode.use_decode_direct`) dequantized (`moe_experts_ref`)  as they are

The budget is the bench's 2x rule (`correctness.budget`). The baseline's quantizer and dequantizer
are written here in plain PyTorch, calling none of moekit's FP8 code, so a bug there is not in
the budget too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from moekit.bench.correctness import budget, experts_same_dtype
from moekit.bench.kernel_work import TILED
from moekit.bench.roofline import fp8_traffic
from moekit.bench.runner import BackendFactory, Call, Weights, Workload
from moekit.decode import use_decode_direct
from moekit.experts import BACKENDS, ExpertsOptions, get_backend, moe_experts
from moekit.experts.registry import fp8_backend_names
from moekit.grouped_gemm.fp8 import experts_fp8_torch
from moekit.quant import FP8_BLOCK, STANDIN_DTYPE, Fp8Weight, quantize_experts
from moekit.reference import moe_experts_ref
from moekit.shapes import MoEShape

CPU_SHAPE = "E=8,H=128,I=128,K=2"   # `moekit bench --weights fp8`'s layer on a CPU-only machine
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
SCALE_MIN = 1e-10 / E4M3_MAX        # an all-zero group: a tiny positive scale, values zero


def takes_fp8(backend: str) -> bool:
    """Whether a moekit backend takes FP8 weights (its registry entry has a `run_fp8`)."""
    return backend in fp8_backend_names()


def fp8_backends(backends: Iterable[str] = BACKENDS) -> list[str]:
    """The backends among `backends` that take FP8 weights, in order."""
    return [b for b in backends if takes_fp8(b)]


def shape_problem(name: str, shape: MoEShape) -> str:
    """"" when the layer's weights can be block-scaled (H and I divisible by 128), else why not."""
    h, i = shape.hidden_size, shape.intermediate_size
    if h % FP8_BLOCK == 0 and i % FP8_BLOCK == 0:
        return ""
    return (f"layer {name!r} has H={h}, I={i}: FP8 block scaling needs both divisible by {FP8_BLOCK} "
            f"(e.g. --shape {CPU_SHAPE}, or a preset such as qwen3-30b-a3b)")


@dataclass(frozen=True)
class Fp8Experts:
    """A layer's expert weights in block-scaled FP8. standin: the data are float16 stand-ins holding
    the e4m3 values (the CPU's Triton interpreter), called through the backends' `run_fp8`."""

    gate_up: Fp8Weight
    down: Fp8Weight
    standin: bool = False


def quantize_layer(weights: Weights) -> Fp8Experts:
    """Both projections of `weights` quantized (`quantize_projections`)."""
    return quantize_projections(weights.gate_up_proj, weights.down_proj)


def quantize_projections(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> Fp8Experts:
    """gate_up_proj (E, 2I, H) and down_proj (E, H, I) quantized (`quantize_experts`); stand-ins off
    CUDA."""
    gate_up, down = quantize_experts(gate_up_proj), quantize_experts(down_proj)
    if gate_up.device.type == "cuda":
        return Fp8Experts(gate_up, down)
    gate_up, down = (Fp8Weight(w.data.to(STANDIN_DTYPE), w.scale) for w in (gate_up, down))
    return Fp8Experts(gate_up, down, standin=True)


def fp8_factory(backend: str, experts: Fp8Experts) -> BackendFactory:
    """`runner.run_case`'s factory of `backend` on the FP8 weights (module doc)."""
    def make(work: Workload) -> Call:
        args = (work.x, experts.gate_up, experts.down, work.topk_weights, work.topk_ids)
        if experts.standin:
            run, options = get_backend(backend).run_fp8, ExpertsOptions()
            return lambda: run(*args, options, None, False)
        return lambda: moe_experts(*args, backend=backend)

    return make


def fake_quant(v: torch.Tensor) -> torch.Tensor:
    """v (rows, K) rounded to e4m3 per row per 128 columns and back, in v's dtype: scale = amax / 448
    in fp32, values scaled, clamped, cast and multiplied back."""
    rows, k = v.shape
    groups = v.float().reshape(rows, k // FP8_BLOCK, FP8_BLOCK)
    scale = (groups.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=SCALE_MIN)
    q = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(rows, k).to(v.dtype)


def dequantized(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """(E, N, K) in dtype: each stored value times its block's scale (in fp32), then rounded."""
    scale = w.scale.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2)
    return (w.data.float() * scale).to(dtype)


def decode_path(backend: str, work: Workload) -> bool:
    """Whether the call runs w8a16: triton's decode kernels at few pairs (`use_decode_direct`)."""
    return backend == TILED and use_decode_direct(work.tokens, work.topk_ids.shape[1], work.shape.num_experts,
                                                  fp8=True)


class Fp8Workloads:
    """The FP8 twins of one workload, each built on first use (module doc)."""

    def __init__(self, work: Workload, experts: Fp8Experts):
        self.work = work
        self.experts = experts

    def for_backend(self, backend: str) -> Workload:
        """The workload `run_case` times `backend` on: w8a16 on triton's decode path, else w8a8."""
        return self.w8a16 if decode_path(backend, self.work) else self.w8a8

    def factory(self, backend: str) -> BackendFactory:
        return fp8_factory(backend, self.experts)

    def _twin(self, ref: torch.Tensor, base: torch.Tensor) -> Workload:
        w = self.work
        expected = budget(ref, base, w.shape.hidden_size + w.shape.intermediate_size)
        return replace(w, expected=expected, traffic=fp8_traffic(w.shape, w.tokens, w.topk_ids, w.dtype))

    def _in_dtype(self) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.work.dtype
        return dequantized(self.experts.gate_up, dtype), dequantized(self.experts.down, dtype)

    @cached_property
    def w8a8(self) -> Workload:
        w, e = self.work, self.experts
        ref = experts_fp8_torch(w.x, e.gate_up, e.down, w.topk_weights, w.topk_ids)
        base = experts_same_dtype(fake_quant(w.x), *self._in_dtype(), w.topk_weights, w.topk_ids,
                                  h_pass=fake_quant)
        return self._twin(ref, base)

    @cached_property
    def w8a16(self) -> Workload:
        w, e = self.work, self.experts
        ref = moe_experts_ref(w.x, e.gate_up.dequantize(), e.down.dequantize(), w.topk_weights, w.topk_ids)
        base = experts_same_dtype(w.x, *self._in_dtype(), w.topk_weights, w.topk_ids)
        return self._twin(ref, base)
