#!/usr/bin/env bash
# Expert parallelism on this machine's GPUs: the GPU tests, then `moekit ep-bench` under torchrun.
#
#   tools/ep_gpu.sh [NPROC] [ep-bench arguments...]
#
# NPROC defaults to every visible GPU. With 2 or more GPUs the results go to
# moekit-results/ep-<N>xgpu-<UTC time>/ (CSV, plot, report); COMPARE_TORCH=1 runs the bench a
# second time with MOEKIT_EP_TORCH=1 (plan / pack / reduce in torch ops) into <that>-torch. With one GPU it runs what one GPU
# allows: the world of 1 (NCCL all-to-alls to itself) and the simulated group of 8 virtual ranks.
# NVLink multicast (NVLS) stays off in NCCL and in PyTorch's symmetric memory, here and in every
# process torchrun starts. Each step stays well under 10 minutes on an H200 with the defaults
# (Qwen3-30B-A3B, 4096 tokens per rank, bfloat16, 7 scenarios, 2 placements).
set -euo pipefail
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1

NPROC=${1:-$(nvidia-smi -L | wc -l)}
[[ $# -gt 0 ]] && shift
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=moekit-results/ep-${NPROC}xgpu-${STAMP}

echo "== GPU tests of moekit.parallel (NVLS off)"
python -m pytest -m gpu tests/runtime/parallel/test_parallel_fused.py tests/runtime/test_placement.py \
    tests/runtime/parallel/test_parallel.py tests/runtime/parallel/test_parallel_low_latency.py -q -s

echo "== moekit ep-bench on ${NPROC} GPU(s) -> ${OUT}"
torchrun --standalone --nproc-per-node "${NPROC}" -m moekit ep-bench --spare-slots 2 --out "${OUT}" "$@"

if [[ "${COMPARE_TORCH:-0}" != "0" ]]; then
    # The same bench with the EP plan / pack / reduce in torch ops (the fused kernels' twins).
    echo "== moekit ep-bench, MOEKIT_EP_TORCH=1 -> ${OUT}-torch"
    MOEKIT_EP_TORCH=1 torchrun --standalone --nproc-per-node "${NPROC}" -m moekit ep-bench --spare-slots 2 \
        --out "${OUT}-torch" "$@"
fi

if [[ "${NPROC}" -eq 1 ]]; then
    echo "== simulated group: 8 virtual ranks on this GPU -> ${OUT}-sim8"
    python -m moekit ep-bench --simulate 8 --spare-slots 2 --out "${OUT}-sim8" "$@"
fi
