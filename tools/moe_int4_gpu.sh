#!/usr/bin/env bash
# One device call for the int4 expert kernel (issue 37): the GPU tests of the MoE target, the one-layer kernel sweep,
# the Qwen3.5-35B-A3B-shape int4 model on the whole chip and on 16- and 24-SM green contexts (Thor projection:
# tools/thor_projection.py --moe). Everything lands in $OUT (set OUT=somewhere to run it by hand).
set -u
OUT=${OUT:-/tmp/moe_int4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/moe_int4.txt"
echo "== GPU tests" | tee "$log"
timeout 240 python3 -m pytest -q -m gpu tests/models/test_moe_int4.py tests/models/test_moe.py 2>&1 | tail -25 | tee -a "$log"
echo "== layer" | tee -a "$log"
timeout 200 python3 tools/moe_int4_bench.py layer --out "$OUT/moe_layer.json" 2>&1 | tail -60 | tee -a "$log"
tuning=()
[ -s "$OUT/moe_layer.json" ] && tuning=(--tuning "$OUT/moe_layer.json")
for sms in 0 16 24; do
  echo "== model, SM limit $sms" | tee -a "$log"
  timeout 200 python3 tools/moe_int4_bench.py model --out "$OUT/moe_model_sm$sms.json" --sm-limit "$sms" \
    "${tuning[@]}" 2>&1 | tail -20 | tee -a "$log"
done
