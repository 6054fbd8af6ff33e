source .s21/common.sh
W=/tmp/w21; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r.tgz -C /tmp w21; }
step gen2 300 python3 .s21/gen_probe2.py 11 8 $R/gen2.json grouped_mm,moekit-blocks,free-block,free-sublayer
tail -14 $R/gen2.log; snap
