#!/usr/bin/env bash
# One device call for the Thor-shaped wave (issues 45-49): the GPU tests of the block-scaled products, the hooks'
# stages, DFlash2, trees and images, then the vision tower's cost and the tree cycle's cost on a 16-SM green context.
# Usage on the GPU machine, from the repository root:  OUT=/some/dir bash tools/gpu_wave.sh [stage ...]
# Stages: tests vision vision-full tree tree24 (default: tests vision tree). Each stage is time-boxed so one call fits the device tool's limit.
set -uo pipefail
OUT=${OUT:-.}
stages=${*:-tests vision tree}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
if ! python3 -c "import edgespec.arch, edgespec.serving" 2>/dev/null; then
  # An old setuptools there cannot build the editable install: map arch/ and serving/ into the package by links.
  ln -sfn ../arch edgespec/arch; ln -sfn ../serving edgespec/serving; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
for s in $stages; do
  t0=$(date +%s)
  case $s in
    tests) timeout 270 python3 -m pytest -q -p no:cacheprovider -rfEs tests/kernels/test_block_scaled.py \
             tests/kernels/test_block_scaled_gpu.py tests/arch/test_hook_stages.py tests/kernels/test_linear_route.py \
             tests/drafters/test_dflash2.py \
             tests/models/test_vision_gpu.py tests/speculative/test_tree_lossless.py tests/speculative/test_gpu_session.py \
             2>&1 | tee "$OUT/tests_full.txt" | grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" | tee "$OUT/tests.txt" ;;
    vision) timeout 120 python3 tools/vision_bench.py --sm-limit 16 --decode-shape qwen3.5-27b --format int4 --reps 5 \
             2>&1 | tee "$OUT/vision_sm16.txt" | tail -12 ;;
    tree) timeout 200 python3 tools/tree_cost.py --shape qwen3.5-27b --format int4 --lm-head int4 --rows 17,33 \
             --graphs --runtime --sm-limit 16 --json "$OUT/tree_sm16.json" 2>&1 | tee "$OUT/tree_sm16.txt" | tail -14 ;;
    vision-full) timeout 120 python3 tools/vision_bench.py --decode-shape qwen3.5-27b --format int4 --reps 5 \
             2>&1 | tee "$OUT/vision_full.txt" | tail -6 ;;
    tree24) timeout 200 python3 tools/tree_cost.py --shape qwen3.5-27b --format int4 --lm-head int4 --rows 17,33 \
             --graphs --runtime --sm-limit 24 --json "$OUT/tree_sm24.json" 2>&1 | tee "$OUT/tree_sm24.txt" | tail -6 ;;
    *) echo "unknown stage $s" ;;
  esac
  echo "[stage $s: $(( $(date +%s) - t0 )) s]"
done
