source .s18/common.sh
step eager_probe 120 python3 .s18/eager_probe.py
cat $R/eager_probe.log | grep "^T="
export MOEKIT_CONFIG_DIR=$PWD/.s18/tab
for round in 1 2; do
step tables_olmoe_$round 120 python3 scripts/tile_compare.py --set tables --preset olmoe-1b-7b --tokens 16,64,128,256 --out $R/tables_olmoe_$round.jsonl
step tables_gptoss_$round 120 python3 scripts/tile_compare.py --set tables --preset gpt-oss-20b --tokens 64,128,256 --out $R/tables_gptoss_$round.jsonl
done
unset MOEKIT_CONFIG_DIR
step tests 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_tuning.py tests/test_tile_compare.py
for f in $R/tables_*.log; do echo $f; sed -n '/^     T /,$p' $f; done
tail -2 $R/tests.log
pack
