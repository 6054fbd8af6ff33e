source .s20/common.sh
W=/tmp/w20; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w20; }
step tests_gg 240 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_grouped_gemm.py tests/test_align.py
tail -3 $R/tests_gg.log; snap
step sum_qwen 150 python3 scripts/sum_compare.py --presets qwen3-30b-a3b --tokens 16,64,128,256,512,1024 --rounds 3 --layer --out $R/sum_qwen.jsonl
grep "split/fused" $R/sum_qwen.log; snap
step align 60 python3 scripts/align_compare.py --tokens 16,64,256,512,1024 --out $R/align.jsonl
tail -6 $R/align.log; snap
step sum_presets 120 python3 scripts/sum_compare.py --presets olmoe-1b-7b,deepseek-v2-lite,mixtral-8x7b --tokens 16,64,256,1024 --rounds 3 --out $R/sum_presets.jsonl
grep "split/fused" $R/sum_presets.log; snap
