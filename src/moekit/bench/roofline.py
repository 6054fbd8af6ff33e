"""The floor of one MoE expert call: the least time any implementation could take on this device.

    bytes = weights of every distinct expert hit + input (T, H) + output (T, H) + routing (ids, weights)
    FLOPs = 2 per weight per (token, expert) pair  = T * K * 2 * 3HI for valid ids
    floor = max(bytes / copy bandwidth, FLOPs / matmul rate)

Small batches are bound by the weights they read (each distinct expert once); once every expert is
hit, bytes stop growing while FLOPs keep growing with T, and the layer turns compute-bound near
T* = ridge * E / K * (itemsize / 2) tokens (ridge = matmul rate / bandwidth in FLOPs per byte;
the itemsize factor is 1 for bf16/fp16, where each weight is 2 bytes and gives 2 FLOPs per token).

Forward + backward (`moekit bench --backward`, `training_traffic`): the backward's two GEMMs per
forward GEMM (activation and weight gradients) make the FLOPs 3x the forward's. The least it must move:

    weights      every distinct expert hit, read twice: once by the forward, once by the backward
                 (gate_up for dx, down for the SwiGLU gradient)
    weight grads d gate_up_proj and d down_proj written once, in the weights' dtype (what every
                 backend returns), for all E experts: autograd's gradients are dense, zero for an
                 expert no token chose
    activations  forward: x read, out written; backward: grad_out and x read, dx written (5 T H)
    routing      ids and weights read by each pass, d topk_weights written (fp32)

Intermediates (the gate/up pre-activations, h, their gradients) are not counted: a fused
implementation could keep them on chip, so the floor stays a floor.

Block-scaled FP8 weights (`moekit bench --weights fp8`, `fp8_traffic`): each distinct expert hit
reads its e4m3 weights and their fp32 scales, one per 128 x 128 block (`moekit.quant.fp8_bytes`),
about half the bf16 bytes; activations, routing and FLOPs are unchanged, and the FLOPs run on the
FP8 roof (`Ceilings.compute_tflops(fp8=True)`, the measured `torch._scaled_mm` rate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.bench.ceilings import Ceilings
from moekit.quant import fp8_bytes
from moekit.shapes import MoEShape

ROUTING_WEIGHT_ITEMSIZE = 4  # moekit.route returns fp32 weights


@dataclass(frozen=True)
class Traffic:
    """Bytes and FLOPs that one call must move and do at the least.

    Attributes:
        experts_hit: distinct experts with at least one valid pair.
        weight_bytes: experts_hit * expert_bytes(dtype).
        io_bytes: input and output rows, 2 * T * H * itemsize.
        routing_bytes: topk_ids and topk_weights, T * K * (id itemsize + weight itemsize).
        flops: GEMM FLOPs of the valid pairs (SwiGLU and the weighted sum are negligible).
        grad_bytes: weight gradients written (0 for a forward; see the module doc).
        fp8: the weights are block-scaled FP8 (`fp8_traffic`): the FLOPs' roof is the FP8 matmul's.
    """

    experts_hit: int
    weight_bytes: int
    io_bytes: int
    routing_bytes: int
    flops: int
    grad_bytes: int = 0
    fp8: bool = False

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.io_bytes + self.routing_bytes + self.grad_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


def traffic(
    shape: MoEShape,
    tokens: int,
    topk_ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    weights_itemsize: int = ROUTING_WEIGHT_ITEMSIZE,
) -> Traffic:
    """Count the bytes and FLOPs of one call with this routing (ids outside [0, E) count nothing)."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must have shape (T={tokens}, K), got {tuple(topk_ids.shape)}")
    ids = topk_ids.reshape(-1).long()
    valid = ids[(ids >= 0) & (ids < shape.num_experts)]
    experts_hit = int(torch.unique(valid).numel())
    item = dtype.itemsize
    return Traffic(
        experts_hit=experts_hit,
        weight_bytes=experts_hit * shape.expert_bytes(dtype),
        io_bytes=2 * tokens * shape.hidden_size * item,
        routing_bytes=topk_ids.numel() * (topk_ids.element_size() + weights_itemsize),
        flops=int(valid.numel()) * 2 * shape.params_per_expert,
    )


def fp8_expert_bytes(shape: MoEShape) -> int:
    """Bytes of one expert's block-scaled FP8 weights: gate_up (2I, H) and down (H, I), e4m3 data
    and their fp32 scales."""
    h, i = shape.hidden_size, shape.intermediate_size
    return fp8_bytes((1, 2 * i, h)) + fp8_bytes((1, h, i))


def fp8_traffic(shape: MoEShape, tokens: int, topk_ids: torch.Tensor, dtype: torch.dtype, *,
                weights_itemsize: int = ROUTING_WEIGHT_ITEMSIZE) -> Traffic:
    """`traffic` of a call on block-scaled FP8 weights (activations in `dtype`): each expert hit
    reads `fp8_expert_bytes`, and the FLOPs run on the FP8 roof (module doc)."""
    t = traffic(shape, tokens, topk_ids, dtype, weights_itemsize=weights_itemsize)
    return replace(t, weight_bytes=t.experts_hit * fp8_expert_bytes(shape), fp8=True)


def training_traffic(shape: MoEShape, tokens: int, topk_ids: torch.Tensor, dtype: torch.dtype, *,
                     weights_itemsize: int = ROUTING_WEIGHT_ITEMSIZE) -> Traffic:
    """Bytes and FLOPs of one forward + backward with this routing (module doc); weight gradients in
    `dtype`, routing-weight gradients in the weights' itemsize."""
    fwd = traffic(shape, tokens, topk_ids, dtype, weights_itemsize=weights_itemsize)
    return Traffic(
        experts_hit=fwd.experts_hit,
        weight_bytes=2 * fwd.weight_bytes,
        io_bytes=fwd.io_bytes + 3 * tokens * shape.hidden_size * dtype.itemsize,
        routing_bytes=2 * fwd.routing_bytes + topk_ids.numel() * weights_itemsize,
        flops=3 * fwd.flops,
        grad_bytes=shape.num_experts * shape.expert_bytes(dtype),
    )


def floor_ms_of(t: Traffic, ceilings: Ceilings) -> float:
    """max(bytes / copy bandwidth, FLOPs / compute roof) in ms; the FP8 roof for FP8 traffic."""
    memory_ms = t.bytes / (ceilings.copy_gbps * 1e9) * 1e3
    compute_ms = t.flops / (ceilings.compute_tflops(t.fp8) * 1e12) * 1e3
    return max(memory_ms, compute_ms)


def bound_of(t: Traffic, ceilings: Ceilings) -> str:
    """"memory" or "compute": which roof sets the floor."""
    return "compute" if t.intensity > ceilings.ridge(t.fp8) else "memory"


def floor_ms(shape: MoEShape, tokens: int, topk_ids: torch.Tensor, dtype: torch.dtype,
             ceilings: Ceilings) -> float:
    """max(bytes / bandwidth, FLOPs / matmul rate) in ms for this routing; see the module doc."""
    return floor_ms_of(traffic(shape, tokens, topk_ids, dtype), ceilings)


def crossover_tokens(shape: MoEShape, dtype: torch.dtype, ceilings: Ceilings) -> float:
    """T where a layer with every expert hit turns compute-bound: ridge * E / K * itemsize / 2.

    With all E experts read, bytes ~ E * 3HI * itemsize and FLOPs = T * K * 2 * 3HI, so the
    intensity is T * K * 2 / (E * itemsize); it meets the ridge at the T returned here.
    """
    return ceilings.ridge_flops_per_byte * shape.num_experts / shape.top_k * dtype.itemsize / 2


def fp8_crossover_tokens(shape: MoEShape, ceilings: Ceilings) -> float:
    """`crossover_tokens` of FP8 weights: FP8 ridge * E / K * (FP8 bytes per weight, scales included) / 2."""
    per_weight = fp8_expert_bytes(shape) / shape.params_per_expert
    return ceilings.ridge(fp8=True) * shape.num_experts / shape.top_k * per_weight / 2
