source .s21/common.sh
W=/tmp/w21; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w21; }
step tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_transformers.py tests/test_eager_graphs.py tests/test_layer.py
tail -3 $R/tests.log; snap
step generate 240 python3 scripts/generate_bench.py $R/generate --modes prefill eager compiled --reps 9 --blocks --bound
tail -8 $R/generate.log; snap
step gen2 150 python3 .s21/gen_probe2.py 7 8 $R/gen2.json grouped_mm,moekit-blocks,moekit-blocks-unfolded,free-block
tail -14 $R/gen2.log; snap
