#!/usr/bin/env bash
# Notes v36's device call: the pointwise training pass (2-byte KL and MSE, 1.13x on the H200).
# Trees under /tmp/v36 (outside the checkout: git apply inside it patches paths relative to its
# root): HEAD, and HEAD + pointwise_write_variants.patch (a scalar-training instantiation without
# grad_output's loads and the per-element loss's stores) with its two knobs for 2-byte types,
# PW_WRITE_MIN_BLOCKS (launch bounds) and PW_WRITE_BATCH (packs a batch), set by a #define
# at the top of common.cuh. Each tree builds mse and kl_div; ab_times.py times them, two rounds.
# Note: on the device `git archive HEAD` gave the session's first commit (84f5a4d), so "base" was
# the code before 5c28e20, as meant.
#   PHASE=grid: the working tree + pointwise_train_grid.patch (PW_TRAIN_PACKS_PER_THREAD: the
#   writing passes' grid, one block per that many packs a thread), timed by ab_env_variants.py.
#   PHASE=contig: the same with pointwise_contiguous_batches.patch (PW_CONTIGUOUS_BATCHES=1: the
#   writing passes read a block's batch as one run of packs, as the sum-only pass does).
#   PHASE=hints: the working tree and three variants of it by pointwise_hints.py (evict-first
#   gradient stores, L2-block loads, both), timed by ab_times.py, two rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TORCH_EXTENSIONS_DIR=$PWD/scratch/ext
mkdir -p scratch "$OUT"
if [ "${PHASE:-variants}" = grid ] || [ "${PHASE:-variants}" = contig ]; then
  rm -rf /tmp/v36 && mkdir -p /tmp/v36/grid && tar -c --exclude=./scratch --exclude=./.git . | tar -x -C /tmp/v36/grid
  patch=pointwise_train_grid.patch cases="mse:8192:8192:bfloat16:train kl:16384:16384:float16:train kl:16384:16384:bfloat16:train"
  variants="base= k1=PW_TRAIN_PACKS_PER_THREAD=1 k2=PW_TRAIN_PACKS_PER_THREAD=2 k4=PW_TRAIN_PACKS_PER_THREAD=4 k8=PW_TRAIN_PACKS_PER_THREAD=8 k16=PW_TRAIN_PACKS_PER_THREAD=16"
  if [ "$PHASE" = contig ]; then
    patch=pointwise_contiguous_batches.patch variants="base= contiguous=PW_CONTIGUOUS_BATCHES=1"
    cases="$cases kl:16384:16384:float32:train mse:32768:32768:float32:train mse:8192:8192:float32:train"
  fi
  (cd /tmp/v36/grid && git apply) < notes/experiments/$patch || exit 1
  for kernel in kl_div mse; do
    (cd /tmp/v36/grid && python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_grid_$kernel.log" 2>&1) &
  done
  start=$(date +%s); wait; echo "builds $(( $(date +%s) - start )) s"
  nvidia-smi --query-gpu=name --format=csv,noheader
  python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
  (cd /tmp/v36/grid && AB_CASES="$cases" AB_VARIANTS="$variants" python3 notes/experiments/ab_env_variants.py) 2>&1 |
    tee "$OUT/ab_$PHASE.txt"
  exit 0
fi
if [ "${PHASE:-variants}" = hints ]; then
  rm -rf /tmp/v36 && mkdir -p /tmp/v36
  for v in base cs l2 csl2; do
    mkdir -p /tmp/v36/$v && tar -c --exclude=./scratch --exclude=./.git . | tar -x -C /tmp/v36/$v
    [ $v = base ] || (cd /tmp/v36/$v && python3 notes/experiments/pointwise_hints.py $v) || exit 1
    for kernel in kl_div mse; do
      (cd /tmp/v36/$v && python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_${v}_$kernel.log" 2>&1) &
    done
  done
  start=$(date +%s); wait; echo "builds $(( $(date +%s) - start )) s"
  nvidia-smi --query-gpu=name --format=csv,noheader
  python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
  cases=("mse 8192x8192 bfloat16 train" "kl 16384x16384 float16 train" "kl 16384x16384 float32 train" "mse 32768x32768 float32 train")
  for round in 1 2; do
    for v in base cs l2 csl2; do echo "round $round $v $(cd /tmp/v36/$v && python3 notes/experiments/ab_times.py "${cases[@]}")"; done
  done 2>&1 | tee "$OUT/ab_hints.txt"
  exit 0
fi
variants=("base:" "spec:" "spec_b1:PW_WRITE_BATCH 1" "spec_b2:PW_WRITE_BATCH 2" "spec_m3:PW_WRITE_MIN_BLOCKS 3"
          "spec_b8:PW_WRITE_BATCH 8" "spec_m3b2:PW_WRITE_MIN_BLOCKS 3|PW_WRITE_BATCH 2")
rm -rf /tmp/v36 && mkdir -p /tmp/v36
for v in "${variants[@]}"; do
  name=${v%%:*} defines=${v#*:} tree=/tmp/v36/${v%%:*}
  mkdir -p $tree && git archive HEAD | tar -x -C $tree
  cp notes/experiments/ab_times.py $tree/notes/experiments/
  if [ "$name" != base ]; then (cd $tree && git apply) < notes/experiments/pointwise_write_variants.patch || exit 1; fi
  IFS='|' read -ra lines <<< "$defines"
  for line in "${lines[@]}"; do [ -n "$line" ] && sed -i "1i #define $line" $tree/kernels/common.cuh; done
  for kernel in kl_div mse; do
    (cd $tree && python3 loader.py --arch 9.0 --kernel $kernel > "$OUT/build_${name}_$kernel.log" 2>&1) &
  done
done
start=$(date +%s); wait; echo "builds $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
cases=("mse 8192x8192 bfloat16 train" "mse 8192x8192 float16 train" "kl 16384x16384 float16 train"
       "kl 16384x16384 bfloat16 train" "kl 16384x16384 float32 train" "mse 32768x32768 float32 train")
for round in 1 2; do
  for v in "${variants[@]}"; do
    echo "round $round ${v%%:*} $(cd /tmp/v36/${v%%:*} && python3 notes/experiments/ab_times.py "${cases[@]}")"
  done
done 2>&1 | tee "$OUT/ab_pointwise_train.txt"
