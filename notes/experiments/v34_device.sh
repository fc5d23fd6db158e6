#!/usr/bin/env bash
# Notes v34's second device call, in a tree with the experiment switches that v34 describes
# (CE_STAGE_PARTS, CE_PARTS_BY_WARPS, CE_PREFETCH_KB; not in main): the build, the pipelined
# and streamed tests under the switches, then the A/B of ab_env_variants.py. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
start=$(date +%s)
python3 loader.py --arch 9.0 --kernel cross_entropy > $OUT/build_cross_entropy.log 2>&1
echo "builds $(( $(date +%s) - start )) s"; grep -h built $OUT/build_*.log
python3 -c "import bench; print('copy GB/s', bench.copy_bandwidth_gbps(20))"
CE_STAGE_PARTS=4 CE_PARTS_BY_WARPS=1 CE_PREFETCH_KB=32 python3 -m pytest -q -p no:cacheprovider -x tests/test_cross_entropy.py \
  -k "split or streamed or LLM or 40000 or 40001 or 270000" 2>&1 | tail -n 3
CE_STAGE_PARTS=3 CE_PARTS_BY_WARPS=1 python3 -m pytest -q -p no:cacheprovider -x tests/test_cross_entropy.py -k "split or streamed" 2>&1 | tail -n 3
AB_CASES="8192:50257:bfloat16:train 16384:50257:bfloat16:train 8192:128256:bfloat16:train 4096:40001:float32:train 8192:50257:float32:train" \
AB_VARIANTS="base= b4=CE_STAGE_PARTS=4 w2=CE_STAGE_PARTS=2,CE_PARTS_BY_WARPS=1 w4=CE_STAGE_PARTS=4,CE_PARTS_BY_WARPS=1 w8=CE_STAGE_PARTS=8,CE_PARTS_BY_WARPS=1" \
  python3 notes/experiments/ab_env_variants.py | tee $OUT/ab_train.txt | grep -v '^{'
AB_CASES="8192:50257:bfloat16:fwd 16384:50257:bfloat16:fwd 8192:128256:bfloat16:fwd 4096:40001:float32:fwd 1536:50257:bfloat16:fwd" \
AB_VARIANTS="base= pf16=CE_PREFETCH_KB=16 pf32=CE_PREFETCH_KB=32 pf64=CE_PREFETCH_KB=64" \
  python3 notes/experiments/ab_env_variants.py | tee $OUT/ab_fwd.txt | grep -v '^{'
