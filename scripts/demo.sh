#!/usr/bin/env bash
# The main job on an embedded default: tiny model made here, local store, a vLLM CPU
# server with the plugin, a trainer that learns a sentence and publishes a delta every step,
# the server's own answers showing it learn (examples/demo.py). Installs only what it uses.
# Runs in the virtualenv of scripts/env.sh (created and filled by scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --profile demo
source scripts/env.sh
exec "$PY" examples/demo.py "$@"
