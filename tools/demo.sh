#!/usr/bin/env bash
# The demo command of the README: set up .venv, serve the embedded SmolLM2-135M-Instruct straight from its Q4_1
# GGUF (packed blocks; `EDGESPEC_GGUF_WEIGHTS=fp32` converts to fp32 instead), and answer the robot JSON-plan prompt
# of the bench set with n-gram speculative decoding; the telemetry line gives the decode speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
. .venv/bin/activate
edgespec generate --drafter ngram --max-tokens 160 \
  "Output a compact JSON action list for a robot to pick up the red cube, place it on the tray, then report success. Use fields action, target, destination, and safety_check."
