"""Expert parallelism over torch.distributed: each of N ranks holds some experts, tokens travel.

    dispatch.py     normal mode: plan / pack / all-to-all of counts and rows, combine and the
                    per-token reduce (one host sync per call: the counts)
    overlap.py      normal mode in token chunks (overlap_chunks > 1): one count exchange, then each
                    chunk's all-to-alls on a side CUDA stream overlapping another chunk's experts
    low_latency.py  low-latency mode: fixed blocks of `capacity` rows per rank pair, the masked
                    (E_r, C_e, H) experts, overflow dropped and counted (or refused); no host sync
    ep.py           ExpertParallelMoE (nn.Module, mode="normal" | "low_latency", capture for CUDA
                    graphs) and ep_moe_experts (the functional form)
    fused.py        the Triton launchers of both modes' plan, pack and reduce (one launch each, the
                    CUDA path; the torch functions in dispatch.py / low_latency.py are their twins)

Placements (who holds which experts, replicas of hot experts) come from `moekit.placement`. The
lab measures this runtime: `moekit ep-bench` (`moekit.bench.ep_bench`, launched with torchrun) and
N virtual ranks in one process (`moekit.bench.simulate`).
NVLink multicast stays off in every launcher: see `disable_nvls`.
"""

import os as _os

from moekit.parallel.dispatch import DispatchedTokens, DispatchHandle, combine, dispatch, run_local_experts
from moekit.parallel.ep import CapturedEP, ExpertParallelMoE, ep_moe_experts
from moekit.parallel.low_latency import (
    CapacityOverflow,
    LowLatencyHandle,
    LowLatencyTokens,
    low_latency_combine,
    low_latency_dispatch,
    low_latency_experts,
    low_latency_moe,
)

# NVLS (NVLink SHARP multicast) is off in NCCL and in PyTorch's symmetric memory on the machines
# moekit is measured on; the values must be in the environment before the process group starts.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def disable_nvls() -> None:
    """Set NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set."""
    for key, value in NVLS_OFF.items():
        _os.environ.setdefault(key, value)


__all__ = [
    "NVLS_OFF",
    "CapacityOverflow",
    "CapturedEP",
    "DispatchHandle",
    "DispatchedTokens",
    "ExpertParallelMoE",
    "LowLatencyHandle",
    "LowLatencyTokens",
    "combine",
    "disable_nvls",
    "dispatch",
    "ep_moe_experts",
    "low_latency_combine",
    "low_latency_dispatch",
    "low_latency_experts",
    "low_latency_moe",
    "run_local_experts",
]
