# Session 10, call 1: weight-gradient range kernel sweep; end-to-end Transformers (prefill, eager, compiled).
source dev/common.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/w/gpu.txt 2>&1
step tests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_grouped_gemm_backward.py
step wgrad 200 python3 scripts/wgrad_compare.py --tokens 1024,4096,16384 --padding-zero only --only 11,22,23,24,25,26,27,28,29,30,31,32,33,34,35 --out $OUT/w/wgrad.jsonl
step generate 140 python3 scripts/generate_bench.py $OUT/w/generate --layers 8 --modes prefill eager --reps 11 --impls grouped_mm batched_mm moekit --blocks --bound
step compiled 150 python3 scripts/generate_bench.py $OUT/w/generate_compiled --layers 8 --modes compiled --reps 5 --impls grouped_mm batched_mm moekit
finish
