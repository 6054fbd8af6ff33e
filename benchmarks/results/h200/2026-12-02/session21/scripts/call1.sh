source .s21/common.sh
W=/tmp/w21; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w21; }
step align 60 python3 scripts/align_compare.py --tokens 64,256,512,1024 --out $R/align.jsonl
tail -8 $R/align.log; snap
step tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_gpu_core.py tests/test_align.py
tail -3 $R/tests.log; snap
step gen 200 python3 .s21/gen_probe.py 11 8 $R/gen_probe.json
tail -10 $R/gen.log; snap
