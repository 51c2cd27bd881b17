#!/usr/bin/env bash
# The main job on an embedded default: tiny model made here, local store, a vLLM CPU
# server with the plugin, a toy trainer publishing a delta every step (examples/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec ${PYTHON:-python3} examples/demo.py "$@"
