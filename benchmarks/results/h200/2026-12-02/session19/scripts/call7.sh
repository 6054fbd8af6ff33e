source .s19/common.sh
W=/tmp/w19; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w19; }
MOEKIT_CONFIG_DIR=$PWD/.s19/oldtab step tables_oldnew 60 python3 scripts/tile_compare.py --set tables --preset qwen3-30b-a3b --tokens 16,128,256 --out $R/tables_oldnew.jsonl
sed -n '/^     T /,$p' $R/tables_oldnew.log | grep -v "^$" | tail -4; snap
step qwen3 170 moekit bench --preset qwen3-30b-a3b --tokens 1,4,16,64,128,256,1024,4096,16384 --backends triton --out $R/qwen3
grep -A14 "Median time" $R/qwen3/report.md | tail -11; snap
step presets 100 moekit bench --preset olmoe-1b-7b,deepseek-v2-lite --tokens 1,4,16,64,256 --backends triton --no-dense --out $R/presets
snap
step tests 100 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_tuning.py tests/test_tile_compare.py tests/test_layer.py
tail -2 $R/tests.log; snap
# The last step collected no test (rc 5: those three files hold no GPU-marked test), so the
# same machine then ran (call7/tests_gpu.log):
#   source .s19/common.sh; python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_gpu_core.py \
#     tests/test_layer.py tests/test_eager_graphs.py tests/test_tuning.py > $R/tests.log 2>&1; pack
