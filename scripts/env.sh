# Sourced by scripts/*.sh: picks the Python everything runs in and exports it as $PY.
# The active virtualenv ($VIRTUAL_ENV) if there is one, else .venv in the repo (created
# here from ${PYTHON:-python3}); never the system Python, which refuses `pip install`
# under PEP 668 and would mix our pins with whatever else is there.
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY="$VIRTUAL_ENV/bin/python"
else
  ENGINE_EXT_VENV=${ENGINE_EXT_VENV:-$PWD/.venv}
  if [ ! -x "$ENGINE_EXT_VENV/bin/python" ]; then
    echo "creating virtualenv $ENGINE_EXT_VENV" >&2
    "${PYTHON:-python3}" -m venv "$ENGINE_EXT_VENV"
  fi
  PY="$ENGINE_EXT_VENV/bin/python"
fi
export PY
# SGLang's own virtualenv (it layers on top of $PY's packages; .ci/setup-sglang.sh).
SGLANG_VENV=${SGLANG_VENV:-$PWD/.venv-sglang}
export SGLANG_VENV

# quiet LOG COMMAND...: run COMMAND with its output appended to LOG; on failure print the
# log's tail and exit (pip's chatter stays out of CI output unless it explains a failure).
quiet() {
  local log=$1
  shift
  "$@" >>"$log" 2>&1 || { echo "failed: $*" >&2; tail -n 60 "$log" >&2; exit 1; }
}
