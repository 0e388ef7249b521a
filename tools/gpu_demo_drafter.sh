#!/usr/bin/env bash
# The demo drafter on a GPU: continue training the shipped drafter (tools/gpu_distill_demo.sh with --init and
# packed forwards), then check greedy DFlash == plain with the shipped and the new drafter on every bench prompt,
# with the demo target in bf16 and in fp32 on the GPU (edgespec bench prints same-as-plain per prompt and, in bf16,
# whether a difference is a tie flip: the regret of the first differing token under the plain model).
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=dir BUDGET_MIN=4 bash tools/gpu_demo_drafter.sh [distill flags]
#
# The new drafter lands in $OUT/drafter; the bench tables in $OUT/lossless_*.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-.distill}
WORK=${WORK:-/tmp/edgespec-distill}
SHIPPED=edgespec/data/drafters/smollm2-135m-dflash
NEW=${NEW:-$OUT/drafter}
if [ -z "${CHECK_ONLY:-}" ]; then
  WORK=$WORK OUT=$OUT bash tools/gpu_distill_demo.sh --init "$SHIPPED" --prompts robot:3000 --samples-per-prompt 0 \
    --pack 8 --lr 3e-4 --warmup 50 "$@"
else    # CHECK_ONLY=1: no training, only the checks (NEW: a drafter folder to check beside the shipped one)
  GGUF=${GGUF:-$("$PY" -c "from edgespec.convert.gguf import demo_gguf_path; print(demo_gguf_path())")}
  "$PY" -c "import sys; from edgespec.convert.gguf import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])" \
    "$GGUF" "$WORK/target"
fi
for name in shipped new; do
  drafter=$SHIPPED; [ "$name" = new ] && drafter=$NEW
  for dtype in ${DTYPES:-bfloat16 float32}; do
    echo "== drafter $name ($drafter), target $dtype on the GPU"
    "$PY" -m edgespec.cli bench prompts --model "$WORK/target" --device cuda --dtype "$dtype" --drafter dflash \
      --drafter-path "$drafter" --tokens 128 2>&1 | tail -16 | tee "$OUT/lossless_${name}_${dtype}.txt"
  done
done
