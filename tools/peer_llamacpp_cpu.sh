#!/usr/bin/env bash
# Opt-in peer benchmark (never part of tools/test.sh): build llama.cpp CPU-only from the llama-cpp-python source
# distribution, then time llama-bench -t 2 and `edgespec bench` (plain and n-gram) on the same demo GGUF,
# interleaved, and print the ratios with the machine load. The build is cached under $EDGESPEC_PEER_DIR
# (default ~/.cache/edgespec/peer).
#   bash tools/peer_llamacpp_cpu.sh [repeats] [threads]       (build only: PEER_BUILD_ONLY=1)
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
GGUF=$("$PY" -c "from edgespec.convert.gguf import demo_gguf_path; print(demo_gguf_path())")
exec "$PY" -m edgespec.cli bench peer --llama-bench "$BENCH" --gguf "$GGUF" --repeats "$REPEATS" --threads "$THREADS"
