"""Expert parallelism over torch.distributed: each of N ranks holds some experts, tokens travel.

    dispatch.py   plan / pack / all-to-all of counts and rows, combine and the per-token reduce
    ep.py         ExpertParallelMoE (nn.Module) and ep_moe_experts (the functional form)
    simulate.py   N virtual ranks in one process (loopback all-to-all): tests and one-GPU studies
    bench.py      `moekit ep-bench`, launched with torchrun

Placements (who holds which experts, replicas of hot experts) come from `moekit.placement`.
NVLink multicast stays off in every launcher: see `disable_nvls`.
"""

import os as _os

from moekit.parallel.dispatch import DispatchedTokens, DispatchHandle, combine, dispatch, run_local_experts
from moekit.parallel.ep import ExpertParallelMoE, ep_moe_experts
from moekit.parallel.simulate import SimulatedTimes, shard_experts, simulate_ep

# NVLS (NVLink SHARP multicast) is off in NCCL and in PyTorch's symmetric memory on the machines
# moekit is measured on; the values must be in the environment before the process group starts.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def disable_nvls() -> None:
    """Set NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set."""
    for key, value in NVLS_OFF.items():
        _os.environ.setdefault(key, value)


__all__ = [
    "NVLS_OFF",
    "DispatchHandle",
    "DispatchedTokens",
    "ExpertParallelMoE",
    "SimulatedTimes",
    "combine",
    "disable_nvls",
    "dispatch",
    "ep_moe_experts",
    "run_local_experts",
    "shard_experts",
    "simulate_ep",
]
