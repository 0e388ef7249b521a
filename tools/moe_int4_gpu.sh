#!/usr/bin/env bash
# One device call for the int4 expert kernels (issue 37): the GPU tests of the int4 MoE target, the one-layer sweep
# (tensor-core launch, the CUDA-core 1-4 row path's launches, the MoE block before/after the fused routing), the
# Qwen3.5-35B-A3B-shape int4 model on the whole chip (with the pre-fusion MoE path beside it) and on 16- and 24-SM
# green contexts (Thor projection: tools/thor_projection.py --moe). Everything lands in $OUT (set OUT=somewhere to
# run it by hand). MOE_TESTS=0 skips the tests; MOE_MMA_CONFIGS=N times N tensor-core launches (default 1, the kept).
set -u
OUT=${OUT:-/tmp/moe_int4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/moe_int4.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$log"
if [ "${MOE_TESTS:-1}" = 1 ]; then
  echo "== GPU tests" | tee -a "$log"
  timeout 200 python3 -m pytest -q -m gpu tests/models/test_moe_int4.py 2>&1 | tail -25 | tee -a "$log"
fi
echo "== layer" | tee -a "$log"
timeout 200 python3 tools/moe_int4_bench.py layer --mma-configs "${MOE_MMA_CONFIGS:-1}" --out "$OUT/moe_layer.json" \
  2>&1 | tail -60 | tee -a "$log"
tuning=()
[ -s "$OUT/moe_layer.json" ] && tuning=(--tuning "$OUT/moe_layer.json")
for sms in 0 16 24; do
  echo "== model, SM limit $sms" | tee -a "$log"
  before=()
  [ "$sms" = 0 ] && before=(--before)
  timeout 200 python3 tools/moe_int4_bench.py model --verify-rows 4,16 --out "$OUT/moe_model_sm$sms.json" \
    --sm-limit "$sms" "${tuning[@]}" "${before[@]}" 2>&1 | tail -20 | tee -a "$log"
done
