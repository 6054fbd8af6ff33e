# sourced by each call script
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=$OUT/r; mkdir -p $R
export MOEKIT_COMMIT=$(cat COMMIT); cp COMMIT $R/
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/install.log 2>&1
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
step() { # name timeout cmd...
  local name=$1 to=$2; shift 2; local t0=$SECONDS
  timeout $to "$@" > $R/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS-t0)) s" | tee -a $R/times.txt
}
pack() { cd $OUT && tar czf r.tgz r && rm -rf r; }
