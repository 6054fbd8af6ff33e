source .s19/common.sh
TAB=$PWD/.s19/tab; mkdir -p $TAB; cp src/moekit/tuning/configs/nvidia_h200.json $TAB/
MOEKIT_CONFIG_DIR=$TAB step tune_qwen3 300 moekit tune --preset qwen3-30b-a3b --tokens 16,128,256 --out $R/tune_qwen3
cp $TAB/nvidia_h200.json $R/tab_qwen3.json
export MOEKIT_CONFIG_DIR=$TAB
for round in 1 2; do
step tables_qwen3_$round 120 python3 scripts/tile_compare.py --set tables --preset qwen3-30b-a3b --tokens 16,64,128,256 --out $R/tables_qwen3_$round.jsonl
done
for f in $R/tables_*.log; do echo $f; sed -n '/^     T /,$p' $f | grep -v "^$"; done
grep -i "winner\|chose\|best" $R/tune_qwen3.log | tail -10
pack
