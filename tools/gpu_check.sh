#!/usr/bin/env bash
# One device call: environment, install check, GPU tests, then (optionally) tuning and timings.
# Usage: bash tools/gpu_check.sh [tests|memcheck|racecheck|tune|compare|bench|fp8|backward|imbalance|ablate|breakdown|transformers|finetune]...
# (default: tests compare). TESTS selects test files (default: all). Logs and results go under
# $OUT (or ./gpu-out when OUT is unset) and are bundled into $OUT/bundle.tgz at the end.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
steps=${*:-tests compare}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/gpu.txt"
# The commit measured: a COMMIT file written before the call, else git's HEAD, marked "+dirty" when the
# tree differs from it (the device's copy can carry an older HEAD than the tree it runs).
export MOEKIT_COMMIT=${MOEKIT_COMMIT:-$(cat COMMIT 2>/dev/null || echo "$(git rev-parse --short=12 HEAD 2>/dev/null)$(git status --porcelain 2>/dev/null | grep -q . && echo +dirty)")}
echo "commit $MOEKIT_COMMIT" | tee -a "$OUT/gpu.txt"
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    echo "editable install failed (see install.log)"
fi
export PYTHONPATH=$PWD/src   # this tree's code, whatever an earlier install left on the machine
for step in $steps; do
    echo "=== $step"
    case $step in
        tests)   timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --durations=15 ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
        memcheck)
            # Kernels with the caching allocator off, so every buffer's bounds are exact; the graph
            # tests keep it on (cudaMalloc is not allowed while a stream captures).
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 MOEKIT_FUZZ_CASES=${SANITIZER_FUZZ_CASES:-25} MOEKIT_FUZZ_SECONDS=150 \
                timeout ${MEMCHECK_TIMEOUT:-200} compute-sanitizer --tool memcheck --print-limit 20 \
                python3 -m pytest -m gpu -q -rfE -p no:cacheprovider ${MEMCHECK_TESTS:-tests/runtime/test_gpu_core.py \
                tests/runtime/test_gpu_reliability.py tests/runtime/test_gpu_sanitizer.py \
                tests/runtime/masked/test_gpu_masked.py tests/runtime/grouped_gemm/test_grouped_gemm_backward.py} \
                -k "${MEMCHECK_K:-not capture and not graph and not long_context and not bitwise and not 1000 and not 4096}" \
                2>&1 | tee "$OUT/memcheck_kernels.log" | tail -4
            timeout ${MEMCHECK_TIMEOUT:-200} compute-sanitizer --tool memcheck --print-limit 20 \
                python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/runtime/test_gpu_core.py -k "capture or graph" \
                2>&1 | tee "$OUT/memcheck_graphs.log" | tail -4 ;;
        racecheck)
            # Every kernel family once, with no cuBLAS call (tests/runtime/test_gpu_sanitizer.py): under
            # racecheck cuBLAS's Hopper kernels report hazards of their own and then stop the tool.
            timeout ${RACECHECK_TIMEOUT:-300} compute-sanitizer --tool racecheck --racecheck-report hazard \
                --print-limit 20 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/runtime/test_gpu_sanitizer.py \
                2>&1 | tee "$OUT/racecheck.log" | tail -4 ;;
        tune)    timeout ${TUNE_TIMEOUT:-420} python3 -m moekit tune ${TUNE_ARGS:-} --table "$OUT/nvidia_h200.json" --out "$OUT/tune" --records "$OUT/tune_records.jsonl" \
                     2>&1 | tee "$OUT/tune.log" | grep -v skip ;;
        compare) MOEKIT_CONFIG_DIR=$OUT timeout ${COMPARE_TIMEOUT:-300} python3 -m moekit sweep --set tiles ${COMPARE_ARGS:-} \
                     --out "$OUT/compare" 2>&1 | tee "$OUT/compare.log" | tail -40 ;;
        bench)   timeout ${BENCH_TIMEOUT:-450} python3 -m moekit bench --peers ${BENCH_ARGS:-} \
                     --tokens 1,4,16,64,256,1024,2048,4096,8192,16384 --out "$OUT/bench" 2>&1 \
                     | tee "$OUT/bench.log" | tail -60 ;;
        fp8)     timeout ${FP8_TIMEOUT:-450} python3 -m moekit bench --weights fp8 --graph ${FP8_ARGS:---backends triton} \
                     --tokens 1,4,16,64,256,1024,2048,4096,8192,16384 --out "$OUT/fp8" 2>&1 \
                     | tee "$OUT/fp8.log" | tail -40 ;;
        backward) timeout ${BACKWARD_TIMEOUT:-300} python3 -m moekit bench --backward ${BACKWARD_ARGS:-} --out "$OUT/backward" 2>&1 \
                     | tee "$OUT/backward.log" | tail -40 ;;
        imbalance) timeout ${IMBALANCE_TIMEOUT:-300} python3 -m moekit imbalance ${IMBALANCE_ARGS:-} --out "$OUT/imbalance" 2>&1 \
                     | tee "$OUT/imbalance.log" | tail -40 ;;
        ablate)  timeout ${ABLATE_TIMEOUT:-570} python3 -m moekit ablate ${ABLATE_ARGS:-} --out "$OUT/ablate" 2>&1 \
                     | tee "$OUT/ablate.log" | tail -40 ;;
        breakdown) # where one call's device time goes, per kernel: forward and forward + backward
                 timeout ${BREAKDOWN_TIMEOUT:-240} sh -c "python3 -m moekit profile --what kernels,host,graph --backends triton,grouped_mm --out '$OUT/breakdown_fwd' ${BREAKDOWN_ARGS:-} \
                     && python3 -m moekit profile --backward --what kernels,host --backends triton,grouped_mm --out '$OUT/breakdown_bwd' ${BREAKDOWN_ARGS:-}" \
                     > "$OUT/breakdown.log" 2>&1; tail -30 "$OUT/breakdown.log" ;;
        transformers) timeout ${TRANSFORMERS_TIMEOUT:-300} python3 -m moekit e2e ${TRANSFORMERS_ARGS:-} --out "$OUT/transformers" \
                     2>&1 | tee "$OUT/transformers.log" | tail -40 ;;
        finetune) timeout ${FINETUNE_TIMEOUT:-300} python3 examples/qwen3_moe_finetune.py --device cuda --dtype bfloat16 \
                     --steps ${FINETUNE_STEPS:-20} ${FINETUNE_ARGS:-} 2>&1 | tee "$OUT/finetune.log" | tail -30 ;;
    esac
done
(cd "$OUT" && tar czf ../bundle.tgz . && find . -mindepth 1 -delete && mv ../bundle.tgz .)
