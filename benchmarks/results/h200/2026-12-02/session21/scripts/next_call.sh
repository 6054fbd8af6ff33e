# The call session 22 should start with (issue 14's last must-show on this tree): source a copy of
# common.sh with .s21 replaced, from the repo root, with COMMIT naming the tree.
# 1. the whole GPU suite except the fuzz (three workers); 2. the fuzz at its default budget
# (160 s: session 21 cut it to 120 s and it failed its throughput floor with 12 cases, all correct);
# 3. moekit bench of Qwen3-30B-A3B (graph and eager, launch counts) on this tree.
source .s22/common.sh
W=/tmp/w22; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w22; }
step suite 330 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 --durations=10 tests -k "not fuzz"
tail -3 $R/suite.log; snap
step fuzz 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu_reliability.py -k fuzz
tail -3 $R/fuzz.log; snap
step bench 150 moekit bench --out $R/bench
tail -3 $R/bench.log; snap
