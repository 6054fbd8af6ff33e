# call 5: review mend (_block_code shared by the two align writers): the align, core and eager-graph GPU tests, then the fuzz
source .s22/common.sh
W=/tmp/w22e; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r5.tgz -C /tmp w22e; }
step tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_align.py tests/test_gpu_core.py tests/test_eager_graphs.py tests/test_gpu_sanitizer.py
tail -3 $R/tests.log; snap
step fuzz 230 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_gpu_reliability.py -k fuzz
tail -3 $R/fuzz.log; snap
