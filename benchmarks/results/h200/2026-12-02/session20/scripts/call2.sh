source .s20/common.sh
W=/tmp/w20; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w20; }
step align 50 python3 scripts/align_compare.py --tokens 64,256,512,1024 --out $R/align.jsonl
tail -5 $R/align.log; snap
step tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_gpu_core.py tests/test_align.py
tail -3 $R/tests.log; snap
