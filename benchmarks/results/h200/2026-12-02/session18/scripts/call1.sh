source .s18/common.sh
step ep_tests 240 python3 -m pytest -m gpu -n 3 -q -rfE -p no:cacheprovider --durations=15 tests/test_parallel.py tests/test_parallel_fused.py tests/test_parallel_low_latency.py tests/test_placement.py tests/test_imbalance.py
tail -3 $R/ep_tests.log
TAB=$PWD/.s18/tab; mkdir -p $TAB .s18/empty; cp src/moekit/tuning/configs/nvidia_h200.json $TAB/; echo '{}' > .s18/empty/nvidia_h200.json
MOEKIT_CONFIG_DIR=$TAB step tune_olmoe 230 moekit tune --preset olmoe-1b-7b --tokens 16,64,128,256 --out $R/tune_olmoe
cp $TAB/nvidia_h200.json $R/tab_olmoe.json
MOEKIT_CONFIG_DIR=$TAB step olmoe_tuned 100 moekit bench --preset olmoe-1b-7b --tokens 1,4,16,64,128,256,1024,4096 --backends triton --out $R/olmoe_tuned
MOEKIT_CONFIG_DIR=$PWD/.s18/empty step olmoe_default 60 moekit bench --preset olmoe-1b-7b --tokens 16,64,128,256 --backends triton --no-layer --no-dense --out $R/olmoe_default
grep -A14 "Triton, graph\|% of floor" $R/olmoe_tuned.log | head -30
pack
