# step NAME LIMIT CMD...: run CMD with a time limit, log to $OUT/w/NAME.log, one status line to $OUT/w/steps.txt
# After every step $OUT/w.tgz is rewritten, so a call killed at its limit still returns what finished.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD/src
export MOEKIT_COMMIT=$(cat COMMIT)
mkdir -p $OUT/w
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout $limit "$@" > $OUT/w/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a $OUT/w/steps.txt; tail -4 $OUT/w/$name.log
  (cd $OUT && tar czf w.tgz w); }
finish() { cd $OUT && tar czf w.tgz w && rm -rf w; }
