source dev/common.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
step dec_tests 120 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider tests/test_decode.py
step dec_tiles 150 python3 scripts/tile_compare.py --set decode --tokens 1,2,4,8
step backward 80 python3 -m moekit bench --backward --out $OUT/w/backward
step steady 70 python3 scripts/kernel_breakdown.py --backward --steady --tokens 4096,16384 --backends triton --out $OUT/w/breakdown_bwd.md
step tune 200 python3 -m moekit tune --tokens 2048,4096 --out $OUT/w/tune --table $OUT/w/tune/nvidia_h200.json
finish
