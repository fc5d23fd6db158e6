#!/usr/bin/env bash
# The whole GPU check in one go, for a machine with a CUDA GPU and torch/ninja/pytest
# installed: build every kernel for this GPU (in parallel), run the full test suite,
# then the benchmark. Logs go to $OUT (or ./gpu_suite_out). RUN_SANITIZER=1 also runs
# scripts/sanitize.sh (compute-sanitizer over every kernel) after the tests. SHARDS=6 on 2 GPUs
# runs the tests in 6 processes side by side (the suite in one 10-minute window; notes v53).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_suite_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")

# Every kernel and dtype for this GPU, at once.
start=$(date +%s)
python3 loader.py --arch "$arch" > "$OUT/build.log" 2>&1 &
if [ "$arch" = 9.0 ]; then  # the sm_90a product too (loader.SM90A_KERNELS), built beside the rest
  python3 loader.py --arch 9.0a --kernel linear_ce_gemm --dtype bfloat16 float16 > "$OUT/build-sm90a.log" 2>&1 &
fi
wait
echo "builds: $(( $(date +%s) - start )) s"; cat "$OUT"/build*.log | grep -v Warning

export FUSED_LOSSES_BUILD_ARCHS="$arch"
if [ "${SHARDS:-1}" -le 1 ]; then
  python3 -m pytest -q -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -n 60
  test_status=${PIPESTATUS[0]}
else
  # SHARDS pytest processes, the tests dealt out in turn; shard i sees the GPUs rotated by i, so its cuda:0
  # differs from its neighbours' and the 2-GPU tests still see every GPU. One seed for all (test_randomized's).
  export FUSED_LOSSES_SEED=${FUSED_LOSSES_SEED:-$RANDOM$RANDOM} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  echo "$SHARDS shards, FUSED_LOSSES_SEED=$FUSED_LOSSES_SEED"
  ids=$(mktemp -d)
  python3 -m pytest --collect-only -q -p no:cacheprovider "${@:-tests}" | grep "::" > "$ids/all"
  mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader)
  for i in $(seq 0 $((SHARDS - 1))); do
    awk -v i="$i" -v n="$SHARDS" 'NR % n == i' "$ids/all" > "$ids/$i"
    rotated=$(for j in "${!gpus[@]}"; do echo "${gpus[$(( (i + j) % ${#gpus[@]} ))]}"; done | paste -sd,)
    ( mapfile -t mine < "$ids/$i"
      CUDA_VISIBLE_DEVICES=$rotated python3 -m pytest -q -p no:cacheprovider "${mine[@]}" > "$OUT/pytest-shard$i.log" 2>&1
      echo $? > "$ids/$i.status" ) &
  done
  wait
  test_status=0
  for i in $(seq 0 $((SHARDS - 1))); do
    echo "shard $i: $(tail -n 1 "$OUT/pytest-shard$i.log")"
    grep -E "^(FAILED|ERROR) " "$OUT/pytest-shard$i.log"
    [ "$(cat "$ids/$i.status")" = 0 ] || test_status=1
  done
  rm -rf "$ids"
fi
if [ "${RUN_SANITIZER:-0}" = 1 ]; then
  scripts/sanitize.sh "$OUT/sanitizer" || test_status=1
fi
if [ -f bench.py ] && [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
fi
exit "$test_status"
