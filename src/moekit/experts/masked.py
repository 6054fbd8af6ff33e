"""`masked` backend: pairs scattered into DeepGEMM's masked (E, C, H) layout, counts on the device.

    topk_ids (T, K) -> masked_layout: dest (S,) row of each pair in (E * C), counts (E,), dropped
    x (T, H)        -> masked_dispatch -> x_masked (E, C, H)
                    -> masked_experts (GEMM1 + SwiGLU, GEMM2; programs past a count exit)
                    -> y (E, C, H) -> masked_combine with topk_weights -> (T, H)

The single-GPU twin of DeepEP's low-latency dispatch -> DeepGEMM masked GEMMs -> combine. Every size
follows from (T, K, E, C), so nothing is read back to the host and the backend runs in a CUDA graph.
Capacity C: ceil(c * S / E) with capacity_factor c (Switch Transformer, as the padded backend; at
most S), else S, which no expert can exceed (nothing is dropped, at the price of E * S rows of
workspace: the layout suits decode, or a capacity). Pairs past C are dropped: they contribute 0 and
are counted in stats["dropped"]; pairs with ids outside [0, E) are skipped and not counted.
Workspace: x_masked (E, C, H), which GEMM2 overwrites with y, and h (E, C, I), in the input dtype.

FP8 weights (`moekit.quant.Fp8Weight`, `experts_masked_fp8`): the same layout and launches with the
masked FP8 GEMMs (x quantized per 128 channels inside GEMM1, h quantized in its epilogue: hq (E, C, I)
e4m3 and its scales), C = S, inference only.
"""

from __future__ import annotations

import torch

from moekit._memory import fits
from moekit._validation import check_triton_device
from moekit.experts.padded import PaddedWorkspaceTooLarge, capacity
from moekit.masked import check_masked_fp8_config, masked_fp8_tiles, masked_layout, masked_moe
from moekit.quant import FP8_BLOCK, FP8_DTYPE, Fp8Weight, check_inference
from moekit.shapes import MoEShape
from moekit.tuning import ExpertsConfig, get_config


def masked_capacity(num_pairs: int, num_experts: int, capacity_factor: float | None) -> int:
    """C: S without a capacity factor (nothing dropped), else min(ceil(c * S / E), S)."""
    if capacity_factor is None:
        return num_pairs
    return min(capacity(num_pairs, num_experts, capacity_factor), num_pairs)


def workspace_bytes(num_experts: int, cap: int, hidden: int, inter: int, itemsize: int) -> int:
    # x_masked (H; y is written over it) and h (I): the (E, C, *) buffers alive at the peak.
    return num_experts * cap * (hidden + inter) * itemsize


def _check_fits(nbytes: int, device: torch.device, cap: int) -> None:
    # The free-memory query is skipped while capturing: the graph's sizes were checked eagerly.
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    reason = fits(nbytes, device)
    if reason:
        raise PaddedWorkspaceTooLarge(f"masked backend's (E, C={cap}, *) buffers: {reason}; use a "
                                      "capacity_factor or another backend")


def experts_masked(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   capacity_factor: float | None = None, stats: dict | None = None,
                   config: ExpertsConfig | None = None, out: torch.Tensor | None = None,
                   capacity: int | None = None) -> torch.Tensor:
    check_triton_device("hidden_states", hidden_states)
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if capacity is None:
        capacity = masked_capacity(num_tokens * top_k, num_experts, capacity_factor)
    cap = capacity
    dev = hidden_states.device
    _check_fits(workspace_bytes(num_experts, cap, hidden, inter, hidden_states.element_size()), dev, cap)
    if config is None:
        # K may exceed E on an expert-parallel rank; at most E of a token's pairs land here.
        shape = MoEShape(num_experts, hidden, inter, min(top_k, num_experts))
        config = get_config(shape, num_tokens, hidden_states.dtype, dev)
    layout = masked_layout(topk_ids, num_experts, cap)
    if stats is not None:
        stats["capacity"] = cap
        stats["dropped"] = layout.dropped                                # device scalar, no sync
        stats["counts"] = layout.counts                                  # (E,) int32 on the device
    return masked_moe(hidden_states, layout, gate_up_proj, down_proj, topk_weights, config, out)


def experts_masked_fp8(hidden_states: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                       config: ExpertsConfig | None = None, out: torch.Tensor | None = None,
                       ue8m0: bool = False) -> torch.Tensor:
    """(T, H) in x's dtype: the masked path on block-scaled FP8 weights, C = S (nothing dropped).
    config: the masked FP8 tiles (`moekit.masked.check_masked_fp8_config`; default: the FP8 tiles
    for the call's token count, `moekit.masked.masked_fp8_tiles`)."""
    check_triton_device("hidden_states", hidden_states)
    check_inference(hidden_states=hidden_states, topk_weights=topk_weights, gate_up_proj=gate_up,
                    down_proj=down)
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    cap = masked_capacity(num_tokens * top_k, num_experts, None)
    dev = hidden_states.device
    # x_masked (y written over it) in x's dtype, hq in one byte (two for the CPU's stand-ins), hs.
    row_bytes = hidden * hidden_states.element_size() + 2 * inter + 4 * (inter // FP8_BLOCK)
    _check_fits(num_experts * cap * row_bytes, dev, cap)
    if config is None:
        # As the dense call: the tiles of the call's token count (rows in use), not of C.
        shape = MoEShape(num_experts, hidden, inter, min(top_k, num_experts))
        config = masked_fp8_tiles(get_config(shape, num_tokens, FP8_DTYPE, dev), dev)
    check_masked_fp8_config(config)
    layout = masked_layout(topk_ids, num_experts, cap)
    return masked_moe(hidden_states, layout, gate_up, down, topk_weights, config, out, ue8m0=ue8m0)
