#!/usr/bin/env bash
# The demo drafter trained for generality on a GPU (docs/drafters.md, "Trained for generality"): the shipped demo
# drafter fine-tuned on a mix of requests the demo target writes itself (self-instructed, Magpie-style: general
# chat and robot-operator requests) and the synthetic robot templates, with a validation set worded unlike every
# training prompt (robot_stream requests of another seed, never the session bench's own) checked each epoch; the
# best checkpoint on it is kept in $OUT/drafter/best.
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=dir BUDGET_MIN=3 bash tools/gpu_distill_general.sh [distill flags]
#
# Extra arguments go to `edgespec distill` (through tools/gpu_distill_demo.sh) and override the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/edgespec-distill}
OUT=${OUT:-.distill}
SHIPPED=edgespec/data/drafters/smollm2-135m-dflash
mkdir -p "$WORK"
# Validation: robot requests worded unlike the training prompts (other robots, tasks, JSON fields), drawn with
# another seed than the session bench's stream (seed 0, 24 requests), none of whose requests it holds.
"$PY" - "$WORK/validation.jsonl" <<'EOF'
import json, sys
from edgespec.bench.robot_stream import robot_stream
bench = set(robot_stream(24, seed=0))
held = [t for t in dict.fromkeys(robot_stream(400, seed=1)) if t not in bench][:24]
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"user": t}) + "\n" for t in held)
print(f"validation: {len(held)} robot_stream requests (seed 1), none of the bench stream's")
EOF
WORK=$WORK OUT=$OUT bash tools/gpu_distill_demo.sh --init "$SHIPPED" \
  --prompts "${PROMPTS:-self:1500+self-robot:1500+robot:1500}" --samples-per-prompt 0 \
  --held-out "$WORK/validation.jsonl" --eval-each-epoch --keep-best --eval-every 200 --save-every 200 \
  --pack 8 --lr 3e-4 --warmup 50 "$@"
