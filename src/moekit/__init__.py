"""moekit: fast mixture-of-experts layers on NVIDIA GPUs, and a lab that measures why.

Dataflow of one layer (T tokens, E experts, K top_k, H hidden, I intermediate):
    route            (T, H) -> topk_weights (T, K) fp32, topk_ids (T, K) int32
    align_block_size topk_ids -> Alignment (pairs sorted by expert, padded per block)
    moe_experts      gate_up GEMM + SwiGLU, down GEMM + routing weight, sum over K -> (T, H)
                     (optional expert biases and gpt-oss's activation: `moekit.activation`)
Decode-time masked layout (DeepGEMM; fed by DeepEP's low-latency dispatch):
    masked_experts   x_masked (E, C, H), per-expert counts (E,) on the device -> (E, C, H)
"""

import importlib as _importlib
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _surely_no_cuda() -> bool:
    """No CUDA device can be in use, told without importing torch: CUDA hidden, or (Linux) no NVIDIA
    driver nodes. Then Triton must run interpreted, and the flag must be set before `import
    triton` (its own library functions are compiled at import). Other cases are decided in
    `moekit.kernels`, with torch."""
    if _os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return True
    return _sys.platform.startswith("linux") and not any(
        _os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia"))


if "TRITON_INTERPRET" not in _os.environ and _surely_no_cuda():
    _os.environ["TRITON_INTERPRET"] = "1"

# The public API, imported on first use: `import moekit` (and `moekit --help`) loads neither torch
# nor Triton.
_EXPORTS = {
    "Alignment": "moekit.align",
    "align_block_size": "moekit.align",
    "BACKENDS": "moekit.experts",
    "PaddedWorkspaceTooLarge": "moekit.experts",
    "moe_experts": "moekit.experts",
    "CapturedMoE": "moekit.layer",
    "MoELayer": "moekit.layer",
    "masked_experts": "moekit.masked",
    "route": "moekit.routing",
    "topk_softmax": "moekit.routing",
    "PRESETS": "moekit.shapes",
    "MoEShape": "moekit.shapes",
    "get_shape": "moekit.shapes",
    "ExpertsConfig": "moekit.tuning",
    "GatedActivation": "moekit.activation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'moekit' has no attribute {name!r}") from None
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
