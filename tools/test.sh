#!/usr/bin/env bash
# The test command of the README: set up .venv (tools/setup.sh), then lint and run the CPU test suite.
# GPU-only tests skip cleanly without CUDA. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
