#!/bin/bash
# issue 34b device run: GPU tree tests, per-layer tree GDN/conv timing, tree_cost full chip and 16 SMs (Triton, then reference)
python3 -m pip install -q --no-deps --target /tmp/site ../../.whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ln -sfn ../arch edgespec/arch && ln -sfn ../serving edgespec/serving
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
left() { echo $(( $1 - SECONDS )); }
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/kernels/test_tree_triton.py \
  tests/kernels/test_tree_kernels.py tests/models/test_tree_forward.py tests/speculative/test_tree_lossless.py \
  2>&1 | tee $OUT/gpu_tests.txt | tail -25
echo "tests done at $SECONDS s"
timeout 120 python3 tools/kernel_bench.py --skip-tests --only tree 2>&1 | tee $OUT/tree_layer.txt | tail -30
echo "layer bench done at $SECONDS s"
A="--shape qwen3.5-27b --format int4 --lm-head int4 --rows 33,64 --chain-rows 16 --graphs"
run() {  # name, deadline (s since start), env, extra args
  local t=$(left $2); if [ $t -lt 60 ]; then echo "skip $1: $t s left"; return; fi
  echo "# $3 python tools/tree_cost.py $A $4 --json $1.json  (at $SECONDS s)" | tee -a $OUT/tree_cost.txt
  env $3 timeout $t python3 tools/tree_cost.py $A $4 --json $OUT/$1.json 2>&1 | grep -v Warning | tee -a $OUT/tree_cost.txt
}
run tree_full 300 EDGESPEC_TREE_TRITON=1 ""
run tree_sm16 330 EDGESPEC_TREE_TRITON=1 "--sm-limit 16"
run tree_sm16_ref 360 EDGESPEC_TREE_TRITON=0 "--sm-limit 16"
run tree_full_ref 390 EDGESPEC_TREE_TRITON=0 ""
echo "all done at $SECONDS s"
