# call 3: moekit bench of the other presets on this tree (must-show 1 for all presets)
source .s22/common.sh
W=/tmp/w22c; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r3.tgz -C /tmp w22c; }
for p in olmoe-1b-7b deepseek-v2-lite mixtral-8x7b; do
  step bench-$p 170 moekit bench --preset $p --out $R/bench-$p
  tail -2 $R/bench-$p.log; snap
done
