source .s19/common.sh
step reread 200 python3 .s19/reread_probe.py
grep "^T=" $R/reread.log
pack
