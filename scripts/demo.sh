#!/usr/bin/env bash
# The main job on an embedded default: tiny model made here, local store, a vLLM CPU
# server with the plugin, a toy trainer publishing a delta every step (examples/demo.py).
# Runs in the virtualenv of scripts/env.sh (created and filled by scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/env.sh
exec "$PY" examples/demo.py "$@"
