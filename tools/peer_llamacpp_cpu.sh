#!/usr/bin/env bash
# Opt-in peer benchmark (never part of tools/test.sh): build llama.cpp CPU-only from the llama-cpp-python source
# distribution, then time llama-bench -t 2 and `edgespec bench` (plain and n-gram) on the same demo GGUF,
# interleaved, and print the ratios with the machine load. The build is cached under $EDGESPEC_PEER_DIR
# (default ~/.cache/edgespec/peer).
#   bash tools/peer_llamacpp_cpu.sh [repeats] [threads]       (build only: PEER_BUILD_ONLY=1)
#   PEER_MOE_TINY=1 bash tools/peer_llamacpp_cpu.sh            (the MoE GGUF writer, tiny qwen3moe, F16 and Q4_K)
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${1:-3}
THREADS=${2:-$(nproc)}
PEER=${EDGESPEC_PEER_DIR:-$HOME/.cache/edgespec/peer}
PY=.venv/bin/python
BENCH="$PEER/llama.cpp-build/bin/llama-bench"
mkdir -p "$PEER"
if [ ! -x "$BENCH" ]; then
  if ! ls "$PEER"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$PEER"
  fi
  SDIST=$(ls "$PEER"/llama_cpp_python-*.tar.gz | head -1)
  SRC="$PEER/src"
  if [ ! -d "$SRC" ]; then
    mkdir -p "$SRC.tmp" && tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=1 && mv "$SRC.tmp" "$SRC"
  fi
  nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$PEER/llama.cpp-build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
  nice -n 10 cmake --build "$PEER/llama.cpp-build" --target llama-bench -j 2 >/dev/null
fi
[ "${PEER_BUILD_ONLY:-0}" = 1 ] && { echo "built $BENCH"; exit 0; }
if [ "${PEER_MOE_TINY:-0}" = 1 ]; then
  # The MoE peer's GGUF writer checked at a tiny shape (issue 37): qwen3moe from tools/peer_gguf.py, as F16 and as
  # the random Q4_K blocks the GPU run uses, each loaded and run by this llama.cpp (pp16, tg16).
  TINY="--moe 8 --experts-used 2 --expert-ffn 256 --head-dim 64 --hidden 256 --layers 2 --heads 4 --kv-heads 2 --vocab 512"
  for q in F16 Q4_K; do
    "$PY" tools/peer_gguf.py "$PEER/moe_tiny_$q.gguf" --gguf-py "$PEER/src/vendor/llama.cpp/gguf-py" --qtype $q $TINY
    "$BENCH" -m "$PEER/moe_tiny_$q.gguf" -p 16 -n 16 -r 1 -t "$THREADS" -o md
  done
  exit 0
fi
GGUF=$("$PY" -c "from edgespec.convert.gguf import demo_gguf_path; print(demo_gguf_path())")
exec "$PY" -m edgespec.cli bench peer --llama-bench "$BENCH" --gguf "$GGUF" --repeats "$REPEATS" --threads "$THREADS"
