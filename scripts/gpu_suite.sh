#!/usr/bin/env bash
# The whole GPU check in one go, for a machine with a CUDA GPU and torch/ninja/pytest
# installed: build every kernel for this GPU (in parallel), run the full test suite,
# then the benchmark. Logs go to $OUT (or ./gpu_suite_out). RUN_SANITIZER=1 also runs
# scripts/sanitize.sh (compute-sanitizer over every kernel) after the tests.
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
python3 loader.py --arch "$arch" > "$OUT/build.log" 2>&1
echo "builds: $(( $(date +%s) - start )) s"; grep -v Warning "$OUT/build.log"

FUSED_LOSSES_BUILD_ARCHS="$arch" python3 -m pytest -q -p no:cacheprovider "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -n 60
test_status=${PIPESTATUS[0]}
if [ "${RUN_SANITIZER:-0}" = 1 ]; then
  scripts/sanitize.sh "$OUT/sanitizer" || test_status=1
fi
if [ -f bench.py ] && [ -z "${SKIP_BENCH:-}" ]; then
  python3 bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
fi
exit "$test_status"
