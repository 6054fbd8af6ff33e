source .s19/common.sh
step sum_probe 150 python3 .s19/sum_probe.py .s19/old/src/moekit/kernels/grouped_gemm.py
cat $R/sum_probe.log | grep "^T="
for round in 1 2; do
 for ver in old new; do
  if [ $ver = old ]; then PP=$PWD/.s19/old/src; else PP=$PWD/src; fi
  PYTHONPATH=$PP step ab_qwen3_${ver}_$round 120 python3 scripts/tile_compare.py --set tables --preset qwen3-30b-a3b --tokens 16,64,256,1024,4096,16384 --out $R/ab_qwen3_${ver}_$round.jsonl
  PYTHONPATH=$PP step ab_olmoe_${ver}_$round 60 python3 scripts/tile_compare.py --set tables --preset olmoe-1b-7b --tokens 64,256 --out $R/ab_olmoe_${ver}_$round.jsonl
 done
done
for f in $R/ab_*.log; do echo "$f"; grep -E "^ +[0-9]+ +table " $f; done
step tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_grouped_gemm.py tests/test_gpu_core.py
tail -2 $R/tests.log
pack
