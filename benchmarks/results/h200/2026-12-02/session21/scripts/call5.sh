source .s21/common.sh
W=/tmp/w21; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w21; }
step tests 170 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 --durations=8 tests/test_gpu_core.py tests/test_align.py tests/test_transformers.py tests/test_eager_graphs.py tests/test_layer.py
tail -3 $R/tests.log; snap
step generate 200 python3 scripts/generate_bench.py $R/generate --modes prefill eager compiled --reps 9 --blocks --bound
tail -6 $R/generate.log; snap
step fuzz 170 env MOEKIT_FUZZ_SECONDS=120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu_reliability.py -k fuzz
tail -3 $R/fuzz.log; snap
step memcheck 75 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu_core.py -k "router_and_align"
tail -4 $R/memcheck.log; snap
