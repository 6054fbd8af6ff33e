source .s19/common.sh
step reread 100 python3 .s19/reread_probe.py
grep "^T=" $R/reread.log
step share 200 python3 .s19/share_probe.py qwen3-30b-a3b,olmoe-1b-7b,gpt-oss-20b
grep -v Warn $R/share.log | grep -v debug_mode
step tests 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 3 tests/test_decode.py
tail -2 $R/tests.log
pack
