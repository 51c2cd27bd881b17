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

# pip_install LOG PYTHON ARGS...: install ARGS into PYTHON's environment with uv where it is at hand
# ($UV, installed by scripts/install.sh: the same resolution as pip, several times faster: the main
# venv in ~15 s instead of ~2-3 min), else with pip. pip's own configuration is handed to uv, which
# does not read it: a machine may keep wheels on disk (find-links), local indexes and constraints.
UV="$(dirname "$PY")/uv"
uv_args() {
  "$PY" - <<'PYEOF'
import shlex, subprocess
out = subprocess.run([__import__("sys").executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url",
         "constraint": "--constraint"}
seen = set()
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.rsplit(".", 1)[-1]
    if name in flags:
        for v in shlex.split(value)[0].split() if value else []:
            if (name, v) not in seen:
                seen.add((name, v))
                print(flags[name]); print(v)
print("--index-strategy"); print("unsafe-best-match")  # pip's rule: the best version over every index
PYEOF
}
pip_install() {
  local log=$1 py=$2
  shift 2
  if [ -x "$UV" ]; then
    local args
    mapfile -t args < <(uv_args)
    # --compile-bytecode: as pip does. Without it a venv holds no .pyc, and where PYTHONDONTWRITEBYTECODE
    # is set (CI and this machine set it) every process compiles torch and vLLM from source on each import:
    # each vLLM server's three processes did, and the main suite took half as long again
    if "$UV" pip install --compile-bytecode --python "$py" "${args[@]}" "$@" >>"$log" 2>&1; then
      return 0
    fi
    echo "uv could not install $* (log: $log); trying pip" >&2
  fi
  quiet "$log" "$py" -m pip install --disable-pip-version-check --no-warn-conflicts "$@"
}
