source .s19/common.sh
step g2probe 300 python3 .s19/gemm2_probe.py 16,64,256
cat $R/g2probe.log | grep -v Warn
step flatten 200 python3 scripts/tile_compare.py --set flatten --preset qwen3-30b-a3b --tokens 64,256 --out $R/flatten.jsonl
sed -n '/^     T /,$p' $R/flatten.log | grep -v "^$"
pack
