#!/usr/bin/env bash
# One device session: GPU correctness tests, the attention launch sweep, the shape sweep and the cycle split.
# Usage on the GPU machine, from the repository root:  OUT=/some/dir bash tools/gpu_sweep.sh [stage ...]
# Stages: tests, quant-tests, formats, shapes27b, gemv, profile, attn-sweep, kernels, fp8-sweep, pdl, gdn-tile, skinny, skinny-ab, block-attn,
# attn-in-place, drafter, shapes, cycle, multiturn, graph-prefill-tests, prefill (default: tests attn-sweep kernels shapes cycle). Every output lands in $OUT.
# multiturn needs the demo's tokenizer in bench-tokenizer/ (here: python tools/make_bench_model.py --tokenizer-only
# bench-tokenizer; the device has no demo package) and writes its random checkpoints on the device.
# The attention research probes (Nsight Compute, timer traces, the overhead probe) run from lab/lab_sweep.sh.
set -uo pipefail
OUT=${OUT:-.}
stages=${*:-tests attn-sweep kernels shapes cycle}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install failed"
if ! python3 -c "import edgespec.arch, edgespec.serving" 2>/dev/null; then
  # An old setuptools there cannot build the editable install: map arch/ and serving/ into the package by links.
  ln -sfn ../arch edgespec/arch; ln -sfn ../serving edgespec/serving; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for s in $stages; do
  t0=$(date +%s)
  case $s in
    tests) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_gpu.py tests/speculative/test_gpu_session.py \
             tests/speculative/test_deferred_gpu.py tests/drafters/test_dflash.py tests/kernels/test_rope_fused.py tests/kernels/test_argmax.py \
             tests/kernels/test_head_norm_rope.py tests/kernels/test_block_attention_split.py tests/kernels/test_window_write.py tests/kernels/test_attn_sass.py \
             tests/kernels/test_gluon_attention_gpu.py tests/kernels/test_gluon_attention.py \
             2>&1 | tail -15 | tee "$OUT/tests.txt" ;;
    quant-tests) python3 -m pytest -q -p no:cacheprovider tests/weights/test_quant_session_gpu.py tests/kernels/test_quant_kernels_gpu.py \
             tests/speculative/test_gpu_session.py tests/speculative/test_deferred_gpu.py 2>&1 | tail -15 | tee "$OUT/quant_tests.txt" ;;
    formats) for shape in qwen3.5-4b qwen3.5-27b; do python3 -m edgespec.cli bench formats dense,fp8,nvfp4,int4 \
             --format-shape $shape --context 1024 --device cuda 2>&1 | tail -6; done | tee "$OUT/formats.txt" ;;
    shapes27b) python3 tools/gpu_bench.py --shapes qwen3.5-27b --kv model --compare-hf none --sweep-out "$OUT" 2>&1 \
             | tee "$OUT/bench27b.txt" | tail -8 ;;
    gemv) python3 tools/gemv_bench.py --sweep 2>&1 | tee "$OUT/gemv_bench.txt" ;;
    profile) python3 tools/step_profile.py 2>&1 | tee "$OUT/step_profile.txt" ;;
    attn-sweep) python3 tools/kernel_bench.py --skip-tests --only none --sweep 2>&1 | tee "$OUT/attn_sweep.txt" \
             | grep -E "sweep|best|copy" ;;
    kernels) python3 tools/kernel_bench.py --skip-tests --only attn --quick 2>&1 > "$OUT/kernel_bench.txt";
             grep -A20 "FP8-KV speedup" "$OUT/kernel_bench.txt" ;;
    fp8-sweep) python3 tools/kernel_bench.py --skip-tests --only none --fp8-sweep --fp8-sweep-budget 60 2>&1 \
             | tee "$OUT/fp8_sweep.txt" | grep -E "best|copy|default|#" ;;
    block-attn) python3 tools/block_attn_bench.py 2>&1 | tee "$OUT/block_attn.txt" ;;
    attn-in-place) python3 tools/gpu_bench.py --shapes qwen3.5-27b,qwen3.5-4b --kv none --attn-in-place \
             --context 32768 --sweep-out "$OUT" 2>&1 | tee "$OUT/attn_in_place.txt" ;;
    pdl) for p in 0 1; do EDGESPEC_PDL=$p python3 tools/gpu_bench.py --shapes qwen3.5-4b --kv model \
             --compare-hf none --sweep-out "$OUT/pdl$p" 2>&1 | tail -1 | sed "s/^/PDL=$p /"; done | tee "$OUT/pdl.txt" ;;
    gdn-tile) python3 tools/kernel_bench.py --skip-tests --only none --gdn-sweep 2>&1 | tee "$OUT/gdn_tile.txt" \
             | grep -E "best|copy" ;;
    skinny) python3 tools/gemv_bench.py --shapes smollm2-135m,qwen3.5-4b,qwen3.5-27b --skip-gemv --sweep-rows 2>&1 \
             | tee "$OUT/skinny_sweep.txt" | grep -E "rows|verify" ;;
    skinny-ab) for m in wide all; do EDGESPEC_SKINNY=$m python3 tools/gpu_bench.py --shapes smollm2-135m,qwen3.5-4b \
             --kv model --compare-hf none --sweep-out "$OUT/skinny_$m" 2>&1 | tail -2 | sed "s/^/SKINNY=$m /"; done \
             | tee "$OUT/skinny_ab.txt" ;;
    drafter) python3 tools/step_profile.py --drafter qwen3.5-27b 2>&1 | tee "$OUT/drafter_profile.txt" | grep -v "^ *\[" ;;
    shapes) python3 tools/gpu_bench.py --shapes smollm2-135m,qwen3.5-4b,qwen3-4b,qwen3.5-27b --kv model --compare-hf none \
             --sweep-out "$OUT" 2>&1 | tail -12 | tee "$OUT/gpu_bench.txt" ;;
    multiturn) for run in bfloat16:0 bfloat16:128 float32:128; do dt=${run%:*}; gp=${run#*:}; \
             for shape in smollm2-135m qwen3.5-0.8b; do echo "== $shape $dt graph_prefill_max=$gp"; \
             EDGESPEC_GRAPH_PREFILL_MAX=$gp python3 -m edgespec.cli bench multi-turn --random-model $shape --dtype $dt \
             --bench-tokenizer bench-tokenizer --tokens 16 --turns 4 --max-seq-len 4096 \
             --out "$OUT/multiturn_${shape}_${dt}_gp$gp.json"; done; done 2>&1 | tee "$OUT/multiturn.txt" ;;
    graph-prefill-tests) python3 -m pytest -q -p no:cacheprovider tests/cache/test_graph_prefill.py 2>&1 | tail -15 \
             | tee "$OUT/graph_prefill_tests.txt" ;;
    prefill) python3 tools/quant_bench.py --no-decode --llama "--hidden 3072 --layers 28" --prefill 17,32,64,128,512,2048 \
             --prefill-shapes llama,qwen3.5-27b 2>&1 | tee "$OUT/quant_prefill.txt"
             for f in dense int4; do python3 tools/step_profile.py --prefill 512,2048 --shapes peer-llama --format $f; done \
             2>&1 | tee "$OUT/prefill_profile.txt" ;;
    cycle) python3 tools/cycle_bench.py --shape qwen3.5-27b --k 15 --tokens 128 2>&1 | tail -20 \
             | tee "$OUT/cycle_bench.txt" ;;
  esac
  echo "[stage $s: $(( $(date +%s) - t0 )) s]"
done
