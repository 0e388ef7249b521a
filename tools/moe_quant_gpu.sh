#!/usr/bin/env bash
# One device call for the NVFP4 and block-FP8 expert kernels (issue 37): their GPU tests (kernel == reference,
# a row alone == among 63, captured == eager), the Qwen3.5-35B-A3B-shape model in int4, nvfp4 and fp8_block
# (decode and the 16-row verify against the byte limit of the experts touched), one layer's product per format,
# then the served tiny models lossless on the kernels. Everything lands in $OUT (set OUT=somewhere by hand).
set -u
OUT=${OUT:-/tmp/moe_quant}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log="$OUT/moe_quant.txt"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$log"
echo "== GPU tests: kernels" | tee -a "$log"
timeout 90 python3 -m pytest -q -m gpu tests/models/test_moe_packed.py -k "not spec_equals_plain" 2>&1 | tail -15 | tee -a "$log"
for fmt in int4 nvfp4 fp8_block; do
  echo "== model, $fmt" | tee -a "$log"
  timeout 100 python3 tools/moe_int4_bench.py model --format "$fmt" --verify-rows "${VERIFY_ROWS:-16}" \
    --out "$OUT/moe_model_$fmt.json" 2>&1 | tail -8 | tee -a "$log"
done
for fmt in nvfp4 fp8_block int4; do
  echo "== layer, $fmt" | tee -a "$log"
  timeout 60 python3 tools/moe_int4_bench.py layer --format "$fmt" --configs 1 --rows 1,4,16,64 \
    --out "$OUT/moe_layer_$fmt.json" 2>&1 | tail -8 | tee -a "$log"
done
echo "== GPU tests: served models" | tee -a "$log"
timeout "${MODEL_TESTS_S:-120}" python3 -m pytest -q -m gpu tests/models/test_moe_packed.py -k spec_equals_plain 2>&1 | tail -15 \
  | tee -a "$log"
