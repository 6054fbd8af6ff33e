source .s18/common.sh
E=$PWD/.s18/empty; mkdir -p $E; echo '{}' > $E/nvidia_h200.json
for round in 1 2; do
 for ver in old new; do
  if [ $ver = old ]; then PP=$PWD/.s18/old/src; else PP=$PWD/src; fi
  for spec in "mixtral-8x7b 48,64" "gpt-oss-20b 128" "olmoe-1b-7b 128"; do
   set -- $spec
   PYTHONPATH=$PP MOEKIT_CONFIG_DIR=$E step ab_${1}_${ver}_$round 90 python3 scripts/tile_compare.py --set tables --preset $1 --tokens $2 --out $R/ab_${1}_${ver}_$round.jsonl
  done
 done
done
step tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_tuning.py tests/test_tile_compare.py tests/test_gpu_core.py tests/test_layer.py
tail -2 $R/tests.log
step presets 200 moekit bench --preset olmoe-1b-7b,gpt-oss-20b,mixtral-8x7b --tokens 1,4,16,64,128,256,1024,4096 --backends triton --out $R/presets
for f in $R/ab_*.log; do echo "$f"; grep -E "^ +[0-9]+ +(table|packaged|default) " $f; done
pack
