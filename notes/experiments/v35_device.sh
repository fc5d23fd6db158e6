#!/usr/bin/env bash
# Notes v35's device calls (ab and ab3 ran with ce_pipelined_halves.patch applied to the tree;
# l2, bench and the h200 phases on main's tree).
#   PHASE=ab     builds this tree and HEAD's (one cache under scratch/ext, kept while the
#                machine is warm), then ab_times.py on both, two rounds, on the CE cases.
#   PHASE=ab3    HEAD, this tree and v34's switches tree, two rounds, then the GPU suite.
#   PHASE=l2     HEAD against HEAD + ce_no_l2_blocks.patch, forward, two rounds.
#   PHASE=h200a  for the next session: main's and the switches tree's builds (h200_launch_switches
#                .patch), scripts/kernel_timeline.py on main, then the pipelined kernel's switches.
#   PHASE=h200b  the other launch switches (rows in registers, claimed rows, pointwise), on a
#                machine still warm from h200a (its builds).
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
h200a|h200b)
  if [ "$PHASE" = h200a ] || [ ! -d /tmp/v35/sw ]; then
    rm -rf /tmp/v35 && mkdir -p /tmp/v35/sw && git archive HEAD | tar -x -C /tmp/v35/sw
    (cd /tmp/v35/sw && git apply) < notes/experiments/h200_launch_switches.patch || exit 1
    cp notes/experiments/ab_env_variants.py /tmp/v35/sw/notes/experiments/  # this tree's version
  fi
  nvidia-smi --query-gpu=name --format=csv,noheader
  start=$(date +%s)
  for kernel in cross_entropy kl_div mse; do
    python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_$kernel.log" 2>&1 &
    (cd /tmp/v35/sw && python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_sw_$kernel.log" 2>&1) &
  done; wait
  echo "builds $(( $(date +%s) - start )) s"
  python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
  ab() { (cd /tmp/v35/sw && AB_CASES="$1" AB_VARIANTS="$2" python3 notes/experiments/ab_env_variants.py | grep -v '^{'); }
  if [ "$PHASE" = h200a ]; then
    python3 scripts/kernel_timeline.py 2>&1 | grep -v Warning | tee "$OUT/timeline.txt"
    ab "8192:50257:bfloat16:train 8192:128256:bfloat16:train" \
       "base= c2=CE_PIPE_MIN_CLUSTER=2 c2s4=CE_PIPE_MIN_CLUSTER=2,CE_PIPE_MAX_STAGES=4 c8=CE_PIPE_MIN_CLUSTER=8 c8s6=CE_PIPE_MIN_CLUSTER=8,CE_PIPE_MAX_STAGES=6 s2=CE_PIPE_MAX_STAGES=2" \
       2>&1 | tee "$OUT/ab_pipelined.txt"
  else
    ab "32768:4096:float32:train" "base= r4=CE_ROW_BLOCKS_PER_SM=4 r3=CE_ROW_BLOCKS_PER_SM=3 r2=CE_ROW_BLOCKS_PER_SM=2" \
       2>&1 | tee "$OUT/ab_rows.txt"
    ab "32768:4096:float32:fwd 16384:8192:bfloat16:fwd" \
       "base= k64=CE_CLAIMED_KB=64 k192=CE_CLAIMED_KB=192 k256=CE_CLAIMED_KB=256 w8=CE_CLAIMED_PER_WARP=8" \
       2>&1 | tee "$OUT/ab_claimed.txt"
    ab "mse:8192:8192:bfloat16:train kl:16384:16384:float16:train kl:16384:16384:float32:fwd mse:32768:32768:float32:fwd" \
       "base= p2=PW_BLOCKS_PER_SM=2 p4=PW_BLOCKS_PER_SM=4 p6=PW_BLOCKS_PER_SM=6" 2>&1 | tee "$OUT/ab_pointwise.txt"
  fi ;;
tests)
  python3 -m pytest -q -p no:cacheprovider --ignore tests/test_build.py ${TESTS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -n 15 ;;
bench)  # the kernels built in parallel first (bench.py would build them one after another)
  for kernel in cross_entropy kl_div mse; do python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_$kernel.log" 2>&1 & done
  wait
  python3 bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" ;;
esac
