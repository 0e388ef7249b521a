#!/usr/bin/env bash
# Peer run: llama.cpp (CUDA, built from the llama-cpp-python sdist's vendor/ folder) against edgespec's quantized
# products on the same random-weight llama shape, printed side by side. Opt-in: never part of CI or tools/test.sh.
#
#   bash tools/peer_llamacpp.sh prepare        # on a machine with PyPI: download the sdist, strip it into .peer/
#   bash tools/peer_llamacpp.sh build          # on the GPU host: CUDA build of llama-bench + llama-quantize (~5 min)
#   bash tools/peer_llamacpp.sh bench          # on the GPU host: GGUFs (F16, Q8_0, Q4_0, Q4_K_M), llama-bench, ours
#   bash tools/peer_llamacpp.sh moe            # on the GPU host: the MoE row (issue 37), after build; see below
#
# .peer/ holds the stripped llama.cpp source (.peer/llama.cpp.tar.gz, ~10 MB: no docs/models/tests/examples or
# non-CUDA/CPU backends) and, on the GPU host, the build and the GGUF files. Shape (the issue's random llama):
# hidden 3072, 28 layers, 24/8 heads, ffn 8192, vocab 49152; override with PEER_SHAPE="--hidden .. --layers ..".
# The edgespec side, on the same shape: `edgespec bench formats` (the whole model: decode at context 128 as
# llama-bench's tg128 ends there, through the arch hooks and a CUDA graph, and whole-model prefill of 512 / 2048
# tokens) and tools/quant_bench.py (the linear stack of a step alone, an upper bound, printed as such). The
# Q4_K_M row also runs on the very file llama-bench reads: `python -m edgespec.bench.gguf_file` (row "gguf").
set -euo pipefail
cd "$(dirname "$0")/.."
PEER=.peer
SRC=$PEER/llama.cpp
BUILD=$PEER/build
MODELS=${PEER_MODELS:-$PEER/models}
SHAPE=${PEER_SHAPE:-"--hidden 3072 --layers 28 --heads 24 --kv-heads 8 --ffn 8192 --vocab 49152"}
PY=${PYTHON:-python3}

strip_tree() {   # $1: llama.cpp source dir -> only what a CUDA/CPU build of the two tools needs
  local d=$1
  rm -rf "$d"/{docs,models,benches,tests,examples,media,.github,.devops,scripts,pocs,app,skills,grammars} \
         "$d"/tools/ui "$d"/tools/server/public* "$d"/tools/mtmd/legacy-models 2>/dev/null || true
  for b in "$d"/ggml/src/ggml-*/; do
    case "$(basename "$b")" in ggml-cuda|ggml-cpu|ggml-blas) ;; *) rm -rf "$b" ;; esac
  done
  for sub in tests examples pocs app; do mkdir -p "$d/$sub"; : > "$d/$sub/CMakeLists.txt"; done
}

case "${1:-}" in
prepare)
  mkdir -p $PEER/dl
  "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d $PEER/dl
  rm -rf $PEER/x && mkdir -p $PEER/x
  tar -xzf $PEER/dl/llama_cpp_python-*.tar.gz -C $PEER/x
  rm -rf $SRC && mv $PEER/x/*/vendor/llama.cpp $SRC && rm -rf $PEER/x $PEER/dl
  strip_tree $SRC
  tar -czf $PEER/llama.cpp.tar.gz -C $PEER llama.cpp && rm -rf $SRC
  du -sh $PEER/llama.cpp.tar.gz
  ;;
build)
  [ -d $SRC ] || tar -xzf $PEER/llama.cpp.tar.gz -C $PEER
  cmake -S $SRC -B $BUILD -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
        ${PEER_CMAKE:-} >/dev/null
  cmake --build $BUILD -j "$(nproc)" --target llama-bench llama-quantize 2>&1 | tail -3
  ls -l $BUILD/bin/llama-bench $BUILD/bin/llama-quantize
  ;;
bench)
  mkdir -p "$MODELS"
  # PEER_QUANTS / PEER_FORMATS / PEER_PREFILL narrow a run to the rows it needs (device minutes are scarce);
  # PEER_Q4KM_DIRECT=1 writes the Q4_K_M mix straight from tools/peer_gguf.py --q4-k-m (no F16 file, no quantize).
  QUANTS=${PEER_QUANTS:-"f16 Q8_0 Q4_0 Q4_K_M"}
  PREFILL=${PEER_PREFILL:-512,2048}
  if [ "${PEER_Q4KM_DIRECT:-0}" = 1 ]; then
    [ "$QUANTS" = Q4_K_M ] || { echo "PEER_Q4KM_DIRECT=1 writes only Q4_K_M (no F16 to quantize from): set PEER_QUANTS=Q4_K_M, not '$QUANTS'" >&2; exit 2; }
    [ -f "$MODELS/Q4_K_M.gguf" ] || "$PY" tools/peer_gguf.py "$MODELS/Q4_K_M.gguf" --gguf-py $SRC/gguf-py --q4-k-m $SHAPE
  else
    [ -f "$MODELS/f16.gguf" ] || "$PY" tools/peer_gguf.py "$MODELS/f16.gguf" --gguf-py $SRC/gguf-py $SHAPE
  fi
  for q in $QUANTS; do
    [ "$q" = f16 ] || [ -f "$MODELS/$q.gguf" ] || $BUILD/bin/llama-quantize "$MODELS/f16.gguf" "$MODELS/$q.gguf" $q \
      "$(nproc)" >/dev/null 2>&1
  done
  out=${OUT:-$PEER}
  for f in $QUANTS; do
    $BUILD/bin/llama-bench -m "$MODELS/$f.gguf" -ngl 99 -fa 1 -p "$PREFILL" -n 128 -r 3 -o json 2>/dev/null \
      > "$out/llamacpp_$f.json"
  done
  "$PY" -m edgespec.cli bench formats ${PEER_FORMATS:-dense,fp8,int4,nvfp4} --format-shape ${PEER_FORMAT_SHAPE:-peer-llama} \
    --context 128 --format-prefill "$PREFILL" --out "$out/formats_peer.json" | tee "$out/edgespec_formats.txt"
  if [ "${PEER_GGUF:-1}" = 1 ]; then     # the same Q4_K_M file on edgespec (K-quant Triton products); PEER_GGUF=0 skips
    # edgespec reads GGUF metadata with gguf-py: llama.cpp's own copy where the GPU host has none installed
    PYTHONPATH="$SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m edgespec.bench.gguf_file \
      --gguf "$MODELS/Q4_K_M.gguf" --context 128 --prefill "$PREFILL" --out "$out/gguf_Q4_K_M.json" \
      | tee "$out/edgespec_gguf.txt"
  fi
  if [ "${PEER_STACK:-1}" = 1 ]; then     # PEER_STACK=0 skips the linear-stack bound (saves device minutes)
    OUT=$out "$PY" tools/quant_bench.py --llama="$SHAPE" --shapes '' --formats int4,nvfp4,fp8_block \
      --prefill 512,2048 --prefill-shapes llama | tee "$out/edgespec_peer.txt"
  fi
  "$PY" tools/peer_report.py "$out"
  ;;
moe)
  # The MoE row: llama.cpp's qwen3moe (attention-only: no Gated DeltaNet, no shared expert) at Qwen3.5-35B-A3B's
  # expert dimensions (256 experts, top 8, width 512, hidden 2048, 40 layers, 16/2 heads of 256), random Q4_K
  # blocks written directly (the F16 file would be ~66 GB), against edgespec's int4 g128 model of the same layout
  # (every layer gated attention, the shared expert kept; tools/moe_int4_bench.py --attention-only), decode at
  # context 128 as llama-bench's tg128 ends there. Random weights on both sides (each its own format). edgespec's
  # row runs the served MoE path (routing fused into the grouping launch, the CUDA-core expert path for 1-2 rows):
  # its "MoE path:" line says so.
  mkdir -p "$MODELS"
  MOE_SHAPE=${PEER_MOE_SHAPE:-"--moe 256 --experts-used 8 --expert-ffn 512 --head-dim 256 --hidden 2048 --layers 40 --heads 16 --kv-heads 2 --vocab 248320"}
  [ -f "$MODELS/moe_q4k.gguf" ] || "$PY" tools/peer_gguf.py "$MODELS/moe_q4k.gguf" --gguf-py $SRC/gguf-py --qtype Q4_K \
    $MOE_SHAPE
  out=${OUT:-$PEER}
  $BUILD/bin/llama-bench -m "$MODELS/moe_q4k.gguf" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json 2>/dev/null \
    > "$out/llamacpp_moe_q4k.json"
  "$PY" tools/moe_int4_bench.py model --attention-only --context 128 --verify-rows 4,16 \
    --out "$out/edgespec_moe.json" | tee "$out/edgespec_moe.txt"
  "$PY" tools/peer_report.py "$out"
  ;;
*)
  sed -n '2,16p' "$0"; exit 2 ;;
esac
