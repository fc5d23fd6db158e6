#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, initcheck and synccheck over every fused
# kernel (scripts/sanitize_driver.py). One log per tool in LOG_DIR; exits non-zero if any
# tool reports an error. SANITIZER_TOOLS picks a subset.
# Build the kernels first (scripts/gpu_suite.sh does), or the first tool builds them.
#   scripts/sanitize.sh LOG_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir=${1:?usage: scripts/sanitize.sh LOG_DIR}
mkdir -p "$log_dir"
sanitizer=/usr/local/cuda/bin/compute-sanitizer
if [ ! -x "$sanitizer" ]; then
  sanitizer=$(command -v compute-sanitizer) || { echo "compute-sanitizer not found in /usr/local/cuda/bin or on PATH" >&2; exit 2; }
fi
"$sanitizer" --version | tail -n 1
# Every tensor its own cudaMalloc: an access past a tensor's end, or a read of bytes no
# kernel wrote, is then seen, not hidden inside a block of torch's caching allocator.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

status=0
for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
  start=$(date +%s)
  # Checks limited to our kernels, except initcheck: it must watch every kernel's
  # writes (torch's randn fills our inputs), or every input read looks uninitialized.
  only_ours=(--kernel-name kns=fused_losses)
  [ "$tool" = initcheck ] && only_ours=()
  "$sanitizer" --tool "$tool" "${only_ours[@]}" --error-exitcode 1 \
    --log-file "$log_dir/$tool.log" python3 scripts/sanitize_driver.py > "$log_dir/$tool.out" 2>&1
  rc=$?
  summary=$(grep -h "SUMMARY" "$log_dir/$tool.log" | tail -n 1)  # racecheck: RACECHECK SUMMARY
  echo "$tool: exit $rc in $(( $(date +%s) - start )) s; ${summary:-no summary (see $log_dir/$tool.out)}"
  if [ "$rc" -ne 0 ]; then
    status=1
    tail -n 20 "$log_dir/$tool.out"
  fi
done
exit "$status"
