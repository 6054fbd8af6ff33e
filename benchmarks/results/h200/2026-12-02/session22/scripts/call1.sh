# call 1: the fuzz at its default budget (160 s), then moekit bench (Qwen3 default) on this tree
source .s22/common.sh
W=/tmp/w22; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w22; }
step fuzz 230 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu_reliability.py -k fuzz
tail -3 $R/fuzz.log; snap
step bench 200 moekit bench --out $R/bench
tail -5 $R/bench.log; snap
