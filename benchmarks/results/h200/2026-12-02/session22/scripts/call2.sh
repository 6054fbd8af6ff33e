# call 2: the whole GPU suite except the fuzz, five workers
source .s22/common.sh
W=/tmp/w22b; rm -rf $W; mv $R $W; R=$W
snap() { tar czf $OUT/r2.tgz -C /tmp w22b; }
step suite 540 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 5 --durations=15 tests -k "not fuzz"
tail -25 $R/suite.log; snap
