"""The dense pair: the MoE expert path's FLOPs as two dense matmuls through ONE expert's weights.

    x_rows (S, H)  = every token repeated K times (S = T * K rows, drawn once, outside the timed call)
    pre    (S, 2I) = x_rows @ gate_up_0^T           F.linear: cuBLAS on a GPU
    h      (S, I)  = silu(pre[:, :I]) * pre[:, I:]  a separate elementwise pass (`swiglu_pass`)
    y      (S, H)  = h @ down_0^T                   F.linear

The same FLOPs as the layer (2 * S * 3HI) with none of its gather, padding, scatter or weighting, and
one expert's weights instead of every expert hit: below the crossover the layer's floor is the
weights' bandwidth, which the pair does not pay; above it, the pair is the bar of dense GEMM speed.

`moekit ablate`'s `dense` variant times all three steps (the SwiGLU pass, which GEMM1 fuses, costs
it about 10 S I bytes more than the GEMMs). `moekit bench`'s `dense` rows (backend `DENSE`) time the
two GEMMs alone (`gemms_only`): h is computed once outside the timed call, which runs pre (its
result unused) and y = h @ down_0^T, so the bar is cuBLAS's GEMM speed and nothing else. Both are
checked by `dense_expected` on y: the layer whose router sends every pair to expert 0, the pair's
rows weighted and summed per token outside the timed call (`slot_sum`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moekit.bench.correctness import Finished, expected_output

DENSE = "dense"   # the backend column of `moekit bench`'s dense-pair rows


def swiglu_pass(pre: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up of [gate | up] rows (·, 2I), as a separate PyTorch pass."""
    return F.silu(pre[:, :inter]) * pre[:, inter:]


def dense_matmuls(x_rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """y (rows, H) through one expert: two dense matmuls with SwiGLU between them."""
    return F.linear(swiglu_pass(F.linear(x_rows, gate_up), down.shape[1]), down)


def dense_pair(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               top_k: int, *, gemms_only: bool = False) -> Callable[[], torch.Tensor]:
    """The call to time: `dense_matmuls` on x's rows, each repeated top_k times (repeated here, once),
    through expert 0's weights; with gemms_only, the two GEMMs alone (h computed here, once)."""
    rows = x.repeat_interleave(top_k, dim=0)
    gate_up, down = gate_up_proj[0], down_proj[0]
    if not gemms_only:
        return lambda: dense_matmuls(rows, gate_up, down)
    h = swiglu_pass(F.linear(rows, gate_up), down.shape[1])

    def gemms() -> torch.Tensor:
        F.linear(rows, gate_up)          # GEMM1's FLOPs; its SwiGLU is outside the timed call
        return F.linear(h, down)
    return gemms


def slot_sum(y: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """(T, H) fp32: the pair's rows (T * K, H) weighted by their routing weights, summed per token."""
    return (y.float().view(*topk_weights.shape, -1) * topk_weights[..., None]).sum(1)


def dense_expected(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Finished:
    """What `dense_pair`'s output must meet: the layer with every pair routed to expert 0 (its fp32
    reference and the 2x budget), after `slot_sum`."""
    e = expected_output(x, gate_up_proj, down_proj, topk_weights, torch.zeros_like(topk_ids))
    return Finished(e.ref, e.baseline_err, e.tol, lambda y: slot_sum(y, topk_weights))
