source .s21/common.sh
W=/tmp/w21; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w21; }
step host 120 python3 .s21/host_probe.py
head -20 $R/host.log; snap
step align 150 python3 scripts/align_compare.py --tokens 1024,2048 --out $R/align.jsonl
tail -3 $R/align.log; snap
