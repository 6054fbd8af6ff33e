"""The triton path's plan: what one call of `moekit.experts.triton` runs, decided once, in one place.

`plan_triton_call` takes the call's shapes, dtypes and device (from its tensors), whether it needs
gradients, its expert math and an explicit config, and returns a `TritonPlan`; the entry points
(`experts_triton`, `experts_triton_train`, `experts_triton_grads`) run what it says and hand the
launchers its hints, so no launcher of the call decides anything again. The decisions, and why each
is made here:

    path          "decode": the direct decode path (`moekit.decode`: two kernels, no align) for an
                  inference call of plain SwiGLU (no biases, not interleaved) with no config given,
                  2-D ids and at most `DECODE_MAX_PAIRS` pairs (`DECODE_MAX_PAIRS_FP8` on FP8
                  weights), few of them per expert
                  (`use_decode_direct`, which also reads $MOEKIT_DECODE_DIRECT); else "grouped"
                  (align, GEMM1, GEMM2, slot sum); `takes_decode_path`. First, because each path
                  has its own tiles: a given config names the grouped path's, so the tuner and
                  ablate always get that path.
    decode        decode: both kernels' tiles for T * K pairs and the weights' format (`decode_config`).
    weight_evict  decode: the kernels' weight-load eviction policy ("evict_first" or "";
                  `moekit.launch_hints.weight_evict`: Hopper+, a few pairs, its switch). Read once a
                  call, so both kernels load the weights alike.
    config        grouped: the given config, else the tuned one for T rows (`auto_config`: the
                  shape's checks memoised, `_shape_of`, as are the tables and default tiles), with
                  tma_weights as it will run (`resolve_tma`: off unless both weights pass
                  `tma_supported` with their GEMM's box). Per call, not per shape: TMA depends on the
                  weight tensors themselves (base alignment, strides); the GEMMs take
                  config.tma_weights as said and do not check again.
    align         grouped: the align's implementation, "triton" up to `MAX_TRITON_EXPERTS` experts,
                  else "torch" (`align_backend`).
    grad          grouped: autograd records the call (the triton backward follows). A call that needs
                  gradients with expert biases, another activation or interleaved rows has no plan:
                  the backward kernels compute plain SwiGLU only (`moekit.moe_experts` routes such
                  calls elsewhere first).
    store_pre     grouped, grad: GEMM1 also stores the (L, 2I) pre-activations, for a backward whose
                  SwiGLU backward reads them (x, gate_up_proj or topk_weights needs a gradient).
    pdl           programmatic dependent launch for every forward launch of the call (align, GEMMs and
                  sum, or the two decode kernels; `moekit.launch_hints.pdl_enabled`: Hopper+, its
                  switch). Read once a call, so the call's launches agree.

Cheap and CUDA-graph safe: the plan reads shapes, dtypes, strides, the device's capability (cached)
and environment switches, never device data (no host sync), so a graph captured with a plan replays
its launches. Left to the launch, by design: the persistent grid's cap (SMs times the programs one SM
holds, `moekit.grouped_gemm.programs_per_sm`), which comes from the compiled kernel of the launch's
own arguments and is memoised per specialization; `PERSISTENT_FLATTEN`, a lab switch over the
launchers alone; and the backward's kernels (`moekit.grouped_gemm.backward`), which read their hints
when they run (an eager backward runs after its forward, with the forward's config alone).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit._validation import MAX_TRITON_EXPERTS
from moekit.activation import SWIGLU, GatedActivation
from moekit.decode import DecodeConfig, decode_config, use_decode_direct
from moekit.grouped_gemm import resolve_tma
from moekit.launch_hints import pdl_enabled, weight_evict
from moekit.quant import FP8_DTYPE, Fp8Weight
from moekit.shapes import MoEShape
from moekit.tuning import ExpertsConfig, check_fp8_config, get_config

DECODE = "decode"
GROUPED = "grouped"


@dataclass(frozen=True)
class TritonPlan:
    """What one triton call runs (see the module docstring for each decision and where it is made).

    Attributes:
        path: "decode" or "grouped".
        config: grouped: the tiles as they run, tma_weights resolved; None on the decode path.
        decode: decode: the two kernels' tiles; None on the grouped path.
        align: grouped: "triton" or "torch", the align's implementation; None on the decode path.
        grad: grouped: the call needs gradients (the autograd path).
        store_pre: grouped: GEMM1 stores the pre-activations the backward reads.
        pdl: the forward launches use programmatic dependent launch.
        weight_evict: decode: the weight loads' eviction policy, "" for the default.
    """

    path: str
    config: ExpertsConfig | None = None
    decode: DecodeConfig | None = None
    align: str | None = None
    grad: bool = False
    store_pre: bool = False
    pdl: bool = False
    weight_evict: str = ""


@functools.lru_cache(maxsize=256)
def _shape_of(num_experts: int, hidden: int, inter: int, top_k: int) -> MoEShape:
    """MoEShape(...), memoised: its checks run once per weight shape, not once per call."""
    return MoEShape(num_experts, hidden, inter, top_k)


def auto_config(num_tokens: int, gate_up_proj: torch.Tensor, top_k: int, dtype: torch.dtype,
                device: torch.device) -> ExpertsConfig:
    """The config a call on num_tokens rows picks when given none (the tuned one, else the default).
    The chunked expert-parallel path passes the whole call's to every chunk: the tiles, and so each
    row's summation order, stay those of one call on all the rows."""
    # An expert-parallel rank may hold fewer experts than a token picks (K > E, the other
    # slots carry ids outside [0, E)): at most E of a token's pairs land here.
    num_experts, two_i, hidden = gate_up_proj.shape
    shape = _shape_of(num_experts, hidden, two_i // 2, min(top_k, num_experts))
    return get_config(shape, num_tokens, dtype, device)


def align_backend(num_experts: int) -> str:
    """The triton path's align: the Triton kernels up to their expert limit, else torch."""
    return "triton" if num_experts <= MAX_TRITON_EXPERTS else "torch"


def takes_decode_path(gate_up_proj: torch.Tensor | Fp8Weight, topk_ids: torch.Tensor, *, grad: bool = False,
                      config: ExpertsConfig | None = None, plain: bool = True) -> bool:
    """The plan's path: whether a call on these weights (dense or block-scaled FP8) and ids runs the
    direct decode path (plain: SwiGLU without biases or interleaved rows). The lab's row counts ask
    it too, so they follow the call's path."""
    fp8 = isinstance(gate_up_proj, Fp8Weight)
    shape = gate_up_proj.shape
    return (config is None and not grad and plain and topk_ids.dim() == 2 and len(shape) == 3
            and use_decode_direct(topk_ids.shape[0], topk_ids.shape[1], shape[0], fp8=fp8))


def plan_triton_call(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_ids: torch.Tensor, *, grad: bool = False, store_pre: bool = False,
                     config: ExpertsConfig | None = None, biases: bool = False,
                     activation: GatedActivation = SWIGLU, interleaved: bool = False) -> TritonPlan:
    """The plan of one triton call (the module docstring gives each decision and its reason).

    Args:
        hidden_states: (T, H); its dtype and device are the call's.
        gate_up_proj, down_proj: the weights, read for their shapes and for TMA (`resolve_tma`);
            dense, or block-scaled FP8 (`moekit.quant.Fp8Weight`: FP8 tiles, tables keyed
            dtype=float8_e4m3fn, `moekit.tuning.check_fp8_config`).
        topk_ids: (T, K), read for its shape only.
        grad: autograd records the call.
        store_pre: with grad, GEMM1 stores the pre-activations its backward reads.
        config: the grouped path's tiles, given (None: the tuned ones, or the decode path).
        biases, activation, interleaved: the expert math (`moekit.activation`).

    Raises RuntimeError for a call that needs gradients with expert math beyond plain SwiGLU: no
    triton backward computes it."""
    device = hidden_states.device
    plain = not biases and activation.is_swiglu and not interleaved
    fp8 = isinstance(gate_up_proj, Fp8Weight)
    if takes_decode_path(gate_up_proj, topk_ids, grad=grad, config=config, plain=plain):
        pairs = topk_ids.numel()
        return TritonPlan(DECODE, decode=decode_config(pairs, fp8), pdl=pdl_enabled(device),
                          weight_evict=weight_evict(device, pairs))
    if fp8:         # block-scaled FP8 weights: their data's shape and layout; FP8 tiles
        gate_up_proj, down_proj = gate_up_proj.data, down_proj.data
    if config is None:
        config = auto_config(hidden_states.shape[0], gate_up_proj, topk_ids.shape[1],
                             FP8_DTYPE if fp8 else hidden_states.dtype, device)
    if fp8:
        check_fp8_config(config)
    config = resolve_tma(config, gate_up_proj, down_proj, interleaved=interleaved)
    if grad and not plain:
        raise RuntimeError("the triton backward computes SwiGLU without biases only; this call has "
                           "expert biases, another activation or interleaved gate/up rows and needs "
                           "gradients: use moekit.moe_experts (it picks a differentiable backend)")
    return TritonPlan(GROUPED, config=config, align=align_backend(gate_up_proj.shape[0]), grad=grad,
                      store_pre=grad and store_pre, pdl=pdl_enabled(device))
