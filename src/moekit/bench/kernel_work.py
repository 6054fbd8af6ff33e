"""What the triton path's kernels compute for one routing: each GEMM kernel's useful FLOPs, in launch
order, and the rows its tiles compute (the padding).

Useful FLOPs count the S pairs with an expert in [0, E) (S = T * K when every id is valid), never
the padding rows; H hidden, I intermediate:

    forward   moe_gemm1_swiglu_kernel  GEMM1  x rows (S, H) @ gate_up_e^T (H, 2I)        2 S H 2I
              moe_gemm2_kernel         GEMM2  h (S, I) @ down_e^T (I, H)                  2 S I H
    backward  moe_swiglu_bwd_kernel    g = dout @ down_e (a, b saved by the forward)      2 S H I
              (on Hopper gluon_swiglu_bwd_kernel, which gathers dout's rows itself: the same)
              moe_gemm2_kernel         dx = dpre (S, 2I) @ gate_up_e (2I, H)              2 S 2I H
              moe_wgrad_kernel         d gate_up_e = dpre^T @ x                           2 S 2I H
              moe_wgrad_kernel         d down_e = dout^T @ h                              2 S H I
              (moe_wgrad_range_kernel in their place below 128 rows an expert, or on Hopper
              gluon_wgrad_kernel: d gate_up after moe_gather_rows_kernel's copy of x, d down
              gathering dout's rows itself up to GATHER_A_ROWS rows an expert, else a launch for
              each column chunk of its copy of dout)

(the direct decode path's two kernels do GEMM1's and GEMM2's FLOPs on unsorted pairs). The
forward is the roofline's 2 S 3HI; a training step is 18 S H I, the roofline's 3x the forward (the
autograd path saves the pre-activations; only `experts_triton_grads`, the backward from the inputs
alone, recomputes a and b: 4 S H I more, not counted here). A kernel launched for two roles (GEMM2
and dx, the two weight gradients) is told apart by its launch order (`label_launches`).

Bytes (`forward_gemm_bytes`): the least each forward GEMM launch moves, for its floor beside its
time (`moekit profile`): the weights of the experts hit (block-scaled FP8: e4m3 data and fp32
scales), its activations read once and its output written once, in the activations' dtype:

    GEMM1   E_hit 2I H weights + T H (x) + S I (h)        GEMM2   E_hit H I weights + S I (h) + S H (y)

Rows computed: every grouped GEMM runs each expert's pairs rounded up to the align block's
block_m rows, num_padded rows in all (paired tiles compute the same rows: experts stay padded to
block_m), so it does rows / S times the useful FLOPs (`RowsComputed`; `triton_rows` reads num_padded
back from the alignment a call makes: a host read, fine in the lab, never in the runtime).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moekit.experts.plan import auto_config, takes_decode_path
from moekit.experts.triton import align_pairs
from moekit.grouped_gemm.backward import gathers_a, gluon_a_chunks
from moekit.quant import fp8_bytes
from moekit.shapes import MoEShape
from moekit.tuning import ExpertsConfig, gluon_wgrad_tiles

TILED = "triton"   # the backend whose tiles `triton_rows` counts (the bench's padding and dense columns)


@dataclass(frozen=True)
class KernelFlops:
    """One launch of the triton path: its kernel's name, what it computes, its useful FLOPs."""

    kernel: str
    role: str
    flops: int


def triton_kernel_flops(shape: MoEShape, pairs: int, backward: bool = False) -> list[KernelFlops]:
    """The GEMM launches of one triton call on `pairs` valid pairs, in launch order (module doc);
    with `backward`, those of a forward + backward (the forward's first). Align and sum kernels do
    no GEMM FLOPs and are not listed; the decode path's kernels and the FP8 GEMMs are (a call runs
    one path on one weight format)."""
    s, h, i = pairs, shape.hidden_size, shape.intermediate_size
    gemm1, gemm2 = 2 * s * h * 2 * i, 2 * s * i * h
    out = [KernelFlops("moe_gemm1_swiglu_kernel", "GEMM1: gate/up + SwiGLU", gemm1),
           KernelFlops("moe_gemm2_kernel", "GEMM2: down + weight", gemm2),
           KernelFlops("decode_gemm1_swiglu_kernel", "GEMM1, direct decode", gemm1),
           KernelFlops("decode_gemm2_sum_kernel", "GEMM2 + sum, direct decode", gemm2),
           KernelFlops("moe_gemm1_fp8_kernel", "GEMM1 fp8: gate/up + SwiGLU + h quantized", gemm1),
           KernelFlops("moe_gemm2_fp8_kernel", "GEMM2 fp8: down + weight", gemm2),
           KernelFlops("gluon_gemm1_fp8_kernel", "GEMM1 fp8: gate/up + SwiGLU + h quantized", gemm1),
           KernelFlops("gluon_gemm2_fp8_kernel", "GEMM2 fp8: down + weight", gemm2)]
    if backward:
        out += [KernelFlops("moe_swiglu_bwd_kernel", "SwiGLU backward: g (a, b saved)", 2 * s * h * i),
                KernelFlops("gluon_swiglu_bwd_kernel", "SwiGLU backward: g (a, b saved)", 2 * s * h * i),
                KernelFlops("moe_gemm2_kernel", "dx: dpre @ gate_up", 2 * s * 2 * i * h),
                KernelFlops("moe_wgrad_kernel", "d gate_up_proj", 2 * s * 2 * i * h),
                KernelFlops("moe_wgrad_kernel", "d down_proj", 2 * s * h * i),
                KernelFlops("moe_wgrad_range_kernel", "d gate_up_proj", 2 * s * 2 * i * h),
                KernelFlops("moe_wgrad_range_kernel", "d down_proj", 2 * s * h * i),
                KernelFlops("gluon_wgrad_kernel", "d gate_up_proj", 2 * s * 2 * i * h)]
        # d down gathers dout's rows itself up to GATHER_A_ROWS rows an expert, else reads its copy a
        # column chunk at a time: a launch a chunk
        e = shape.num_experts
        chunks = 1 if gathers_a(s, e) else gluon_a_chunks(h, gluon_wgrad_tiles(s / e))
        role = "d down_proj" if chunks == 1 else f"d down_proj, 1 of {chunks} column chunks"
        out += [KernelFlops("gluon_wgrad_kernel", role, 2 * s * h * i // chunks)] * chunks
    return out


def forward_gemm_bytes(shape: MoEShape, tokens: int, pairs: int, experts_hit: int, itemsize: int,
                       fp8: bool = False) -> dict[str, int]:
    """The least bytes each forward GEMM kernel's launch moves (module doc), by kernel name: the
    grouped path's, the decode path's and the FP8 GEMMs' (a call runs one pair of them); itemsize:
    the activations'; fp8: the weights are block-scaled FP8."""
    h, i = shape.hidden_size, shape.intermediate_size
    if fp8:
        w1, w2 = fp8_bytes((experts_hit, 2 * i, h)), fp8_bytes((experts_hit, h, i))
    else:
        w1, w2 = experts_hit * 2 * i * h * itemsize, experts_hit * h * i * itemsize
    gemm1 = w1 + (tokens * h + pairs * i) * itemsize
    gemm2 = w2 + (pairs * i + pairs * h) * itemsize
    names1 = ("moe_gemm1_swiglu_kernel", "decode_gemm1_swiglu_kernel", "moe_gemm1_fp8_kernel",
              "gluon_gemm1_fp8_kernel")
    names2 = ("moe_gemm2_kernel", "decode_gemm2_sum_kernel", "moe_gemm2_fp8_kernel", "gluon_gemm2_fp8_kernel")
    return {**dict.fromkeys(names1, gemm1), **dict.fromkeys(names2, gemm2)}


def label_launches(names: Sequence[str], flops: Sequence[KernelFlops]) -> list[KernelFlops | None]:
    """Each launch (kernel names in launch order) with the entry of `flops` it is: the n-th launch of
    a kernel takes that kernel's n-th entry; a launch with none (another kernel, or one launch too
    many) gets None."""
    by_name: dict[str, list[KernelFlops]] = {}
    for k in flops:
        by_name.setdefault(k.kernel, []).append(k)
    seen: dict[str, int] = {}
    out = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        entries = by_name.get(name, [])
        out.append(entries[n] if n < len(entries) else None)
    return out


def padded_rows(counts: Sequence[int], block_m: int) -> int:
    """Rows the tiles compute: each expert's pairs rounded up to a multiple of block_m (paired tiles
    compute the same rows: experts stay padded to block_m)."""
    return sum(-(-int(n) // block_m) * block_m for n in counts)


def padding_fraction(counts: Sequence[int], block_m: int) -> float:
    """Fraction of the computed rows that are padding: 1 - pairs / padded rows (`RowsComputed`)."""
    return RowsComputed(padded_rows(counts, block_m), sum(int(n) for n in counts), block_m).padding


@dataclass(frozen=True)
class RowsComputed:
    """Rows a call's GEMM tiles compute for its valid pairs."""

    rows: int
    pairs: int
    block_m: int | None = None   # the align block the rows are padded to (None: no alignment)

    @property
    def per_pair(self) -> float:
        """rows / pairs (1.0: no padding); NaN without a pair."""
        return self.rows / self.pairs if self.pairs else float("nan")

    @property
    def padding(self) -> float:
        """Fraction of the computed rows that are padding, 1 - pairs / rows."""
        return 1.0 - self.pairs / self.rows if self.rows else 0.0

    def __str__(self) -> str:
        return f"{self.per_pair:.2f} rows computed per pair, {self.padding:.0%} padding"


def aligned_rows(topk_ids: torch.Tensor, num_experts: int, config: ExpertsConfig) -> RowsComputed:
    """num_padded of the triton backend's alignment of this routing at config.block_m (read back to
    the host) over its valid pairs."""
    align = align_pairs(topk_ids, num_experts, config)
    return RowsComputed(int(align.num_padded), int(align.tokens_per_expert.sum()), config.block_m)


def triton_rows(x: torch.Tensor, gate_up_proj: torch.Tensor, topk_ids: torch.Tensor, *,
                grad: bool = False) -> RowsComputed:
    """The rows a `moe_experts(..., backend="triton")` call with no config computes: its tuned config's
    alignment (`aligned_rows`), or one row per pair on the direct decode path (inference, when on).
    `grad`: the call needs gradients (never the decode path)."""
    if takes_decode_path(gate_up_proj, topk_ids, grad=grad):
        pairs = int(((topk_ids >= 0) & (topk_ids < gate_up_proj.shape[0])).sum())
        return RowsComputed(pairs, pairs)
    config = auto_config(x.shape[0], gate_up_proj, topk_ids.shape[1], x.dtype, x.device)
    return aligned_rows(topk_ids, gate_up_proj.shape[0], config)
