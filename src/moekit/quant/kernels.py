"""FP8 quantization on the device: activations per row per 128 columns (`quantize_rows_kernel`), and
the helpers GEMM epilogues share (`quantize_groups`, `e4m3_round`).

Legend: T rows, K columns, G = K / 128 groups of a row, B = 128 (`moekit.quant.FP8_BLOCK`).

    quantize_rows_kernel  program (t, group tile): x[t, groups] fp32 -> amax per group ->
                          scale = max(amax / 448, floor) (UE8M0: the power of two at or above) ->
                          q = clamp(x / scale, +-448) rounded to e4m3; q (T, K), scale (T, G)

The scale and its reciprocal are IEEE round-to-nearest divisions (`tl.math.div_rn`: Triton's plain
fp32 division is approximate on the GPU) and values are multiplied by the reciprocal, as the PyTorch
twin does: the kernel's scales and values equal the twin's bit for bit. STANDIN: q is
held in float16 and rounded to the e4m3 grid arithmetically (`e4m3_round`), where e4m3 cannot run.
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
SCALE_FLOOR = tl.constexpr(1e-10 / 448.0)


@triton.jit
def e4m3_round(v):
    """v (fp32, within [-448, 448]) rounded to the nearest e4m3 value, ties to even, as fp32: the
    step of v's binade is 2**(exponent - 3) (3 mantissa bits; subnormals below 2**-6 step 2**-9), and
    adding then subtracting 1.5 * 2**23 rounds v / step to an integer in fp32's own rounding. v's
    sign bit is put back: that sum makes a zero (v = -0, or a small negative v) +0, e4m3's cast -0."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0
    rounded = ((tl.math.div_rn(v, step) + magic) - magic) * step
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_ceil(s):
    """The power of two at or above s (positive, normal fp32): its exponent, plus one unless the
    mantissa is zero."""
    bits = s.to(tl.int32, bitcast=True)
    up = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((bits & 0x7F800000) + (up << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_groups(x, UE8M0: tl.constexpr, STANDIN: tl.constexpr):
    """(q, scale) of x [R, 128] fp32 quantized per row: scale [R] fp32, q [R, 128] fp32 on the e4m3
    grid when STANDIN, else within [-448, 448] for the store's cast to e4m3 to round. NaN and
    infinities reach q and scale as in the twin, so the row's output is NaN (Triton's max and clamp
    drop NaN by default: the row would come out finite and wrong)."""
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), SCALE_FLOOR,
                       propagate_nan=tl.PropagateNan.ALL)
    if UE8M0:
        scale = tl.where(scale == scale, ue8m0_ceil(scale), scale)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)     # one division a row
    q = tl.clamp(x * inv[:, None], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if STANDIN:
        q = e4m3_round(q)
    return q, scale


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, G, stride_xt, stride_xk, stride_qt, stride_qk, stride_st,
                         stride_sg, BLOCK_G: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr,
                         STANDIN: tl.constexpr):
    # grid (T, cdiv(G, BLOCK_G)): one row's BLOCK_G groups of GROUP columns a program.
    t = tl.program_id(0).to(tl.int64)
    rg = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)                   # [BG]
    g_in = rg < G
    cols = (rg[:, None] * GROUP + tl.arange(0, GROUP)[None, :]).to(tl.int64)   # [BG, B]
    x = tl.load(x_ptr + t * stride_xt + cols * stride_xk, mask=g_in[:, None], other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, UE8M0, STANDIN)
    tl.store(q_ptr + t * stride_qt + cols * stride_qk, q.to(q_ptr.dtype.element_ty), mask=g_in[:, None])
    tl.store(s_ptr + t * stride_st + rg * stride_sg, scale, mask=g_in)
