#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it): install, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
status=0
$PY -m pytest -q -p no:cacheprovider tests "$@" || status=$?
# SGLang's tests run in their own virtualenv (sglang --no-deps; see docs/sglang.md).
if [ -x "${SGLANG_PYTHON:-/opt/venv-sglang/bin/python}" ] && ls tests/test_sglang_*.py >/dev/null 2>&1; then
  "${SGLANG_PYTHON:-/opt/venv-sglang/bin/python}" -m pytest -q -p no:cacheprovider tests/test_sglang_*.py -m sglang || status=$?
fi
exit $status
