# call 4: Mixtral 8x7B has no H200 table entry (the default tiles read 83-86% of the floor at 256 tokens,
# 68% at 1,024): moekit tune at 128-1,024 tokens into a copy of the packaged table, then the bench with
# that table and with the defaults forced (an empty table), one after the other on this host.
source .s22/common.sh
W=/tmp/w22d; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r4.tgz -C /tmp w22d; }
TAB=$PWD/.s22/tab; mkdir -p $TAB .s22/empty; cp src/moekit/tuning/configs/nvidia_h200.json $TAB/; echo '{}' > .s22/empty/nvidia_h200.json
MOEKIT_CONFIG_DIR=$TAB step tune 300 moekit tune --preset mixtral-8x7b --tokens 128,256,512,1024 --out $R/tune
cp $TAB/nvidia_h200.json $R/tab_mixtral.json; tail -20 $R/tune.log; snap
MOEKIT_CONFIG_DIR=$TAB step tuned 90 moekit bench --preset mixtral-8x7b --tokens 64,128,256,512,1024,2048 --backends triton --no-layer --no-dense --out $R/tuned
MOEKIT_CONFIG_DIR=$PWD/.s22/empty step default 90 moekit bench --preset mixtral-8x7b --tokens 64,128,256,512,1024,2048 --backends triton --no-layer --no-dense --out $R/default
grep -B2 -A10 "^| T | floor" $R/tuned/report.md | head -12; grep -B2 -A10 "^| T | floor" $R/default/report.md | head -12; snap
