"""Block-scaled FP8 (float8 e4m3) expert weights and activations, as FP8 checkpoints store them.

Legend: E experts, N output rows, K reduction columns of one weight (gate_up: N = 2I, K = H; down:
N = H, K = I), T rows of activations, B = `FP8_BLOCK` = 128.

    weights      `Fp8Weight`: data (E, N, K) float8_e4m3fn and scale (E, N / B, K / B) float32, one
                 scale per B x B block, w ~= data * scale (DeepSeek-V3's and Transformers'
                 FineGrainedFP8 `weight_scale_inv`); `quantize_experts` makes one from bf16 weights,
                 `Fp8Weight.from_checkpoint` and `moekit.quant.loading` from a checkpoint's tensors
    activations  per row per B columns: q (T, K) float8_e4m3fn and scale (T, K / B) float32
                 (`quantize_rows`, one Triton pass; twin `quantize_rows_torch`)

A block's scale is amax / 448 (448: e4m3's largest finite value), floored at `SCALE_FLOOR` so an
all-zero block quantizes to zeros; with `ue8m0` the scale is rounded up to a power of two (the UE8M0
scales DeepGEMM takes on Blackwell: the quantized values then never exceed 448 either).
Rounding is to nearest, ties to even (the hardware's cvt and torch's cast alike).

The kernels take float16 stand-ins wherever e4m3 cannot run (Triton's interpreter has no e4m3 dot
and rounds casts to e4m3 wrongly): the same e4m3 values held in float16 (every e4m3 value is exact
in float16), and the quantizing kernels round to the e4m3 grid arithmetically (`STANDIN_DTYPE`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit._validation import interpreting, needs_grad
from moekit.quant.kernels import quantize_rows_kernel

FP8_DTYPE = torch.float8_e4m3fn
STANDIN_DTYPE = torch.float16          # e4m3 values held in float16: the interpreter's stand-in
QUANT_DTYPES = (FP8_DTYPE, STANDIN_DTYPE)
FP8_BLOCK = 128
FP8_MAX = 448.0
SCALE_FLOOR = 1e-10 / FP8_MAX          # an all-zero block: scale tiny and positive, values zero


def _check_block_shape(name: str, shape: tuple[int, ...], dims: tuple[str, ...]) -> None:
    for size, dim in zip(shape, dims):
        if size % FP8_BLOCK:
            raise ValueError(f"{name}: FP8 block scaling needs {dim} divisible by {FP8_BLOCK}, got shape "
                             f"{tuple(shape)}")


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """One projection of every expert in block-scaled FP8.

    Attributes:
        data: (E, N, K) float8_e4m3fn (float16 stand-ins for the interpreter's kernel tests).
        scale: (E, N / 128, K / 128) float32: block (i, j) of expert e is data * scale[e, i, j].
    """

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        check_fp8_weight("Fp8Weight", self, allow_standin=True)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(E, N, K) in dtype: every block times its scale (computed in fp32)."""
        e, n, k = self.data.shape
        blocks = self.data.float().view(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
        return (blocks * self.scale[:, :, None, :, None]).view(e, n, k).to(dtype)

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device))

    def for_kernels(self) -> Fp8Weight:
        """The weight as the Triton kernels read it: on the CPU (Triton's interpreter has no e4m3
        dot) e4m3 data as its exact float16 stand-in; elsewhere itself."""
        if self.data.device.type == "cpu" and self.data.dtype == FP8_DTYPE:
            return Fp8Weight(self.data.to(STANDIN_DTYPE), self.scale)
        return self

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                        name: str = "weight") -> Fp8Weight:
        """An FP8 checkpoint's fused expert tensors, weight (E, N, K) float8_e4m3fn and its
        `weight_scale_inv` (E, N / 128, K / 128), checked (errors name `name`; scales finite and
        positive) and wrapped, float32 scales without a copy. Per-expert tensors and whole state
        dicts: `moekit.quant.loading` (`stack_experts`, `experts_from_checkpoint`)."""
        from moekit.quant.loading import fp8_weight

        return fp8_weight(weight, weight_scale_inv, name=name)


def check_fp8_weight(name: str, w: object, *, shape: tuple[int, int, int] | None = None,
                     device: torch.device | None = None, allow_standin: bool = False) -> Fp8Weight:
    """w is an `Fp8Weight` of (E, N, K) e4m3 data (float16 stand-ins when allow_standin) with N and
    K divisible by 128, float32 scales of shape (E, N / 128, K / 128) on its device, and (when
    given) that shape and device. Reads no tensor data (NaN scales: `check_fp8_scales`)."""
    if not isinstance(w, Fp8Weight):
        got = f"a {w.dtype} tensor" if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"{name} must be an moekit.quant.Fp8Weight (e4m3 data and its block scales; "
                        f"moekit.quant.quantize_experts makes one), got {got}")
    data, scale = w.data, w.scale
    dtypes = QUANT_DTYPES if allow_standin else (FP8_DTYPE,)
    if not isinstance(data, torch.Tensor) or data.dtype not in dtypes or data.dim() != 3:
        what = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"{name}.data must be a 3-D float8_e4m3fn tensor (E, N, K), got {what}")
    _check_block_shape(f"{name}.data", tuple(data.shape[1:]), ("N", "K"))
    e, n, k = data.shape
    want = (e, n // FP8_BLOCK, k // FP8_BLOCK)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
        what = (f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
                else type(scale).__name__)
        raise ValueError(f"{name}.scale must be float32 of shape {want} (one per {FP8_BLOCK}x{FP8_BLOCK} "
                         f"block of data {tuple(data.shape)}), got {what}")
    if scale.device != data.device:
        raise ValueError(f"{name}.scale must be on {data.device} (as its data), got {scale.device}")
    if shape is not None and tuple(data.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(data.shape)}")
    if device is not None and data.device != device:
        raise ValueError(f"{name} must be on {device}, got {data.device}")
    return w


def check_scale_values(name: str, scale: torch.Tensor, keys: Sequence[Sequence[str]] | None = None) -> None:
    """Raise ValueError unless every scale is finite and positive, naming `name` and the block's index
    (a host sync on CUDA). keys: scale (E, R, C) stacks per-expert scales whose rows are len(keys)
    equal parts, expert e of part p read from keys[p][e]: the error names that tensor instead."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return
    idx = tuple(int(v) for v in torch.nonzero(bad)[0])
    value = float(scale[idx])
    if keys is not None:
        e, i, j = idx
        rows = scale.shape[1] // len(keys)
        name, idx = keys[i // rows][e], (i % rows, j)
    raise ValueError(f"{name} must be finite and positive, got {value} at {idx}")


INFERENCE_ONLY = "FP8 experts are inference only (no backward)"


def check_inference(what: str = INFERENCE_ONLY, /,
                    **named: torch.Tensor | Fp8Weight | None) -> None:
    """RuntimeError naming the argument if autograd would record the call (grad mode on and a given
    tensor, or an `Fp8Weight`'s data or scale, requiring grad): `what` has no backward, and an output
    cut off from the graph would train nothing without a word."""
    for name, t in named.items():
        parts = (t.data, t.scale) if isinstance(t, Fp8Weight) else (t,) if t is not None else ()
        if needs_grad(*parts):
            raise RuntimeError(f"{what}, and {name} requires grad: "
                               "run the call under torch.no_grad() or torch.inference_mode()")


def fp8_inputs(**named: torch.Tensor | Fp8Weight | None) -> dict[str, torch.Tensor]:
    """A call's inputs by name for `check_out`'s aliasing check, an `Fp8Weight` as its data and scale."""
    out = {}
    for name, t in named.items():
        if isinstance(t, Fp8Weight):
            out.update({name: t.data, f"{name}.scale": t.scale})
        elif t is not None:
            out[name] = t
    return out


def check_fp8_scales(name: str, w: Fp8Weight) -> None:
    """Raise if any of w's scales is NaN, infinite or not positive (`check_scale_values`). Reads the
    scales: a host sync on CUDA, so it runs where weights are made, loaded or validated on request,
    never inside a forward."""
    check_scale_values(f"{name}.scale", w.scale)


def _div_rn(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b rounded once to fp32 (PyTorch's CUDA division by a scalar multiplies by its reciprocal:
    one rounding more, and then not the kernels' IEEE division)."""
    return (a.double() / b).float()


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """The power of two at or above each positive scale, exactly (from the float's own exponent:
    a rounded log2 can land on the power below); NaN and infinity stay as they are."""
    mantissa, exponent = torch.frexp(scale)                 # scale = mantissa * 2**exponent, [0.5, 1)
    keep = (mantissa == 0.5) | ~torch.isfinite(scale)
    return torch.where(keep, scale, torch.ldexp(torch.ones_like(scale), exponent))


def round_to_fp8(v: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """v (already within [-448, 448]) rounded to e4m3, held in dtype (e4m3, or a float16 stand-in)."""
    q = v.to(FP8_DTYPE)
    return q if dtype == FP8_DTYPE else q.to(dtype)


def quantize_experts(w: torch.Tensor, *, ue8m0: bool = False) -> Fp8Weight:
    """Block-quantize expert weights w (E, N, K) (N and K divisible by 128, any float dtype): one
    float32 scale per 128 x 128 block, amax / 448 (a power of two at or above it with ue8m0). Outside
    autograd (quantizing has no derivative): a parameter's values give plain inference weights."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.dtype.is_floating_point:
        raise TypeError(f"w must be a 3-D float tensor (E, N, K), got "
                        f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if w.dtype == FP8_DTYPE:
        raise TypeError("w is float8_e4m3fn already: pair it with its scales as Fp8Weight(data, scale)")
    _check_block_shape("w", tuple(w.shape[1:]), ("N", "K"))
    e, n, k = w.shape
    blocks = w.detach().float().reshape(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(2, 4))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("w holds NaN or infinite values: they have no FP8 block scale")
    scale = torch.clamp(_div_rn(amax, FP8_MAX), min=SCALE_FLOOR)
    if ue8m0:
        scale = _ue8m0(scale)
    q = torch.clamp(blocks / scale[:, :, None, :, None], -FP8_MAX, FP8_MAX).view(e, n, k)
    return Fp8Weight(round_to_fp8(q), scale.contiguous())


def quantize_rows_torch(x: torch.Tensor, *, ue8m0: bool = False, dtype: torch.dtype = FP8_DTYPE,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `quantize_rows`: (q (T, K) in dtype, scale (T, K / 128) float32), per row per 128
    columns, scale = max(amax / 448, SCALE_FLOOR) (rounded up to a power of two with ue8m0), values
    times the scale's reciprocal (one division a row, as the kernels)."""
    t, k = x.shape
    groups = x.float().view(t, k // FP8_BLOCK, FP8_BLOCK)
    scale = torch.clamp(_div_rn(groups.abs().amax(dim=2), FP8_MAX), min=SCALE_FLOOR)
    if ue8m0:
        scale = _ue8m0(scale)
    q = torch.clamp(groups * torch.reciprocal(scale)[:, :, None], -FP8_MAX, FP8_MAX).view(t, k)
    return round_to_fp8(q, dtype), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(T, K) fp32: q's groups of 128 columns times their scales."""
    t, k = q.shape
    return (q.float().view(t, k // FP8_BLOCK, FP8_BLOCK) * scale[:, :, None]).view(t, k)


def fp8_bytes(shape_e_n_k: tuple[int, int, int]) -> int:
    """Bytes of one Fp8Weight of this shape: e4m3 data and its float32 block scales."""
    e, n, k = shape_e_n_k
    return e * n * k + 4 * e * math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK)


def quantize_rows(x: torch.Tensor, *, ue8m0: bool = False, dtype: torch.dtype | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (T, K), scale (T, K / 128) float32): x (T, K) quantized per row per 128 columns in one
    Triton launch, equal to `quantize_rows_torch`. dtype: e4m3, or the float16 stand-in (None: the
    stand-in under Triton's interpreter, else e4m3). Fresh buffers (`moekit._workspace`)."""
    if dtype is None:
        dtype = STANDIN_DTYPE if interpreting() else FP8_DTYPE
    t, k = x.shape
    _check_block_shape("x", (k,), ("K",))
    groups = k // FP8_BLOCK
    q = _workspace.empty(t, k, dtype=dtype, device=x.device)
    scale = _workspace.empty(t, groups, dtype=torch.float32, device=x.device)
    if t:
        block_g = min(8, next_power_of_2(groups))
        quantize_rows_kernel[(t, cdiv(groups, block_g))](
            x, q, scale, groups, x.stride(0), x.stride(1), q.stride(0), q.stride(1), scale.stride(0),
            scale.stride(1), BLOCK_G=block_g, GROUP=FP8_BLOCK, UE8M0=ue8m0, STANDIN=dtype != FP8_DTYPE,
            num_warps=4)
    return q, scale


__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_MAX", "Fp8Weight", "check_fp8_scales", "check_fp8_weight",
           "check_scale_values", "dequantize_rows", "fp8_bytes", "fp8_inputs", "quantize_experts",
           "quantize_rows", "quantize_rows_torch"]
