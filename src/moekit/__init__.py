"""moekit: fast mixture-of-experts layers on NVIDIA GPUs, and a lab that measures why.

Dataflow of one layer (T tokens, E experts, K top_k, H hidden, I intermediate):
    route            (T, H) -> topk_weights (T, K) fp32, topk_ids (T, K) int32
    align_block_size topk_ids -> Alignment (pairs sorted by expert, padded per block)
    moe_experts      gate_up GEMM + SwiGLU, down GEMM + routing weight, sum over K -> (T, H)
Decode-time masked layout (DeepGEMM; fed by DeepEP's low-latency dispatch):
    masked_experts   x_masked (E, C, H), per-expert counts (E,) on the device -> (E, C, H)
"""

import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        # Triton kernels can only run interpreted on a machine without a GPU; the flag must be set
        # before the kernels are defined. Set TRITON_INTERPRET=0 to opt out.
        _os.environ["TRITON_INTERPRET"] = "1"

from moekit._validation import interpreting as _interpreting

if _interpreting():
    from moekit._compat import patch_triton_interpreter

    patch_triton_interpreter()

from moekit.align import Alignment, align_block_size
from moekit.experts import BACKENDS, PaddedWorkspaceTooLarge, moe_experts
from moekit.layer import CapturedMoE, MoELayer
from moekit.masked import masked_experts
from moekit.routing import route, topk_softmax
from moekit.shapes import PRESETS, MoEShape, get_shape
from moekit.tuning import ExpertsConfig

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "PRESETS",
    "Alignment",
    "CapturedMoE",
    "ExpertsConfig",
    "MoELayer",
    "MoEShape",
    "PaddedWorkspaceTooLarge",
    "align_block_size",
    "get_shape",
    "masked_experts",
    "moe_experts",
    "route",
    "topk_softmax",
]
