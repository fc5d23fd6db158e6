#!/usr/bin/env bash
# Notes v35's device calls, on a tree with ce_pipelined_halves.patch applied.
#   PHASE=ab     builds this tree and HEAD's (one cache under scratch/ext, kept while the
#                machine is warm), then ab_times.py on both, two rounds, on the CE cases.
#   PHASE=ab3    HEAD, this tree and v34's switches tree, two rounds, then the GPU suite.
#   PHASE=l2     HEAD against HEAD + ce_no_l2_blocks.patch, forward, two rounds.
#   PHASE=tests  the GPU test suite.
#   PHASE=bench  bench.py, with Liger when .whl/ holds its wheel.
# Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TORCH_EXTENSIONS_DIR=$PWD/scratch/ext
mkdir -p scratch "$OUT"
if ls .whl/liger_kernel-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/liger_kernel-*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/site
fi
build_all() {  # $1: tree
  for kernel in cross_entropy kl_div mse; do
    (cd "$1" && python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_$(basename "$1")_$kernel.log" 2>&1) &
  done
}
case ${PHASE:?} in
ab)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
  rm -rf scratch/head && mkdir -p scratch/head && git archive HEAD | tar -x -C scratch/head
  echo "HEAD: $(git log -1 --format='%h %s')"
  start=$(date +%s); build_all "$PWD"; build_all scratch/head; wait
  echo "builds $(( $(date +%s) - start )) s"; grep -h built "$OUT"/build_*.log
  python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
  for round in 1 2; do
    for tree in scratch/head .; do
      echo "round $round $tree $(cd $tree && python3 notes/experiments/ab_times.py 'ce 8192x50257' 'ce 8192x128256' 'ce 32768x4096')"
    done
  done 2>&1 | tee "$OUT/ab.txt" ;;
ab3)  # HEAD, this tree, and HEAD + ce_stage_parts_switches.patch (v34's call-2 tree), then the GPU suite
  # The trees go outside the checkout: git apply inside it would patch (and skip) paths relative to its root.
  rm -rf /tmp/v35 && mkdir -p /tmp/v35/head /tmp/v35/switches
  git archive HEAD | tar -x -C /tmp/v35/head && git archive HEAD | tar -x -C /tmp/v35/switches
  (cd /tmp/v35/switches && git apply) < notes/experiments/ce_stage_parts_switches.patch || exit 1
  grep -c CE_STAGE_PARTS /tmp/v35/switches/kernels/cross_entropy.cu
  start=$(date +%s)
  for tree in . /tmp/v35/head /tmp/v35/switches; do
    (cd $tree && python3 loader.py --arch 9.0 --kernel cross_entropy > "$OUT/build_ce_$(basename $(realpath $tree)).log" 2>&1) &
  done
  for kernel in kl_div mse; do python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_$kernel.log" 2>&1 & done
  wait
  echo "builds $(( $(date +%s) - start )) s"; grep -h built "$OUT"/build_*.log
  a="ce 8192x50257 bfloat16 train" b="ce 8192x128256 bfloat16 train"
  for round in 1 2; do
    echo "round $round head $(cd /tmp/v35/head && python3 notes/experiments/ab_times.py "$a" "$b")"
    echo "round $round halves $(python3 notes/experiments/ab_times.py "$a" "$b")"
    echo "round $round switches-w2 $(cd /tmp/v35/switches && CE_STAGE_PARTS=2 CE_PARTS_BY_WARPS=1 python3 notes/experiments/ab_times.py "$a" "$b")"
  done 2>&1 | tee "$OUT/ab3.txt"
  python3 -m pytest -q -p no:cacheprovider --ignore tests/test_build.py tests 2>&1 | tee "$OUT/pytest.log" | tail -n 15 ;;
l2)  # HEAD against HEAD + ce_no_l2_blocks.patch (the sum-only streamed rows' plain loads, as before v33)
  rm -rf /tmp/v35 && mkdir -p /tmp/v35/plain && git archive HEAD | tar -x -C /tmp/v35/plain
  (cd /tmp/v35/plain && git apply) < notes/experiments/ce_no_l2_blocks.patch || exit 1
  nvidia-smi --query-gpu=name --format=csv,noheader
  for tree in . /tmp/v35/plain; do
    (cd $tree && python3 loader.py --arch 9.0 --kernel cross_entropy > "$OUT/build_ce_$(basename $(realpath $tree)).log" 2>&1) &
  done; wait
  python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
  cases=("ce 8192x128256 bfloat16 fwd" "ce 8192x50257 bfloat16 fwd" "ce 8192x32000 bfloat16 fwd")
  for round in 1 2; do
    echo "round $round head $(python3 notes/experiments/ab_times.py "${cases[@]}")"
    echo "round $round plain $(cd /tmp/v35/plain && python3 notes/experiments/ab_times.py "${cases[@]}")"
  done 2>&1 | tee "$OUT/l2.txt" ;;
tests)
  python3 -m pytest -q -p no:cacheprovider --ignore tests/test_build.py ${TESTS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -n 15 ;;
bench)  # the kernels built in parallel first (bench.py would build them one after another)
  for kernel in cross_entropy kl_div mse; do python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_$kernel.log" 2>&1 & done
  wait
  python3 bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" ;;
esac
