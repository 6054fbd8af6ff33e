source .s18/common.sh
step decode_tests 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_decode.py
tail -2 $R/decode_tests.log
step decode_compare 240 python3 scripts/tile_compare.py --set decode --tokens 1,2,4,8 --out $R/decode_compare.jsonl
sed -n '/^     T /,$p' $R/decode_compare.log
export MOEKIT_CONFIG_DIR=$PWD/.s18/tab
for round in 1 2; do
step tables_olmoe_$round 120 python3 scripts/tile_compare.py --set tables --preset olmoe-1b-7b --tokens 16,64,128,256 --out $R/tables_olmoe_$round.jsonl
step tables_gptoss_$round 120 python3 scripts/tile_compare.py --set tables --preset gpt-oss-20b --tokens 64,128,256 --out $R/tables_gptoss_$round.jsonl
done
for f in $R/tables_*.log; do echo $f; sed -n '/^     T /,$p' $f | grep -v "^$"; done
pack
