#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it): install, then run every suite.
# Ends with one line per suite (counts and exit status); a failing test's output includes
# the tails of the engine server logs of its module (tests/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
source scripts/env.sh
logs=$(mktemp -d "${TMPDIR:-/tmp}/engine_ext_tests.XXXXXX")
status=0
summary=()

suite() {  # suite NAME COMMAND...: run one pytest suite, remember its counts line
  local name=$1 rc
  shift
  echo "=== suite $name: $*"
  "$@" 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  local counts
  counts=$(grep -E "^=*[ ]*[0-9]+ (passed|failed|skipped|error|deselected)|^=*[ ]*no tests ran" "$logs/$name.log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
  summary+=("suite $name: ${counts:-no pytest summary line} (exit $rc)")
  [ "$rc" -eq 0 ] || status=1
}

# Main suite (vLLM CPU, stores, codec, kernels); SGLang's modules run in SGLang's own venv below.
suite main "$PY" -m pytest -q -p no:cacheprovider -rfEs tests --ignore-glob='tests/test_sglang_*' "$@"
if [ -x "$SGLANG_VENV/bin/python" ] && ls tests/test_sglang_*.py >/dev/null 2>&1; then
  suite sglang "$SGLANG_VENV/bin/python" -m pytest -q -p no:cacheprovider -rfEs tests/test_sglang_*.py -m sglang "$@"
else
  summary+=("suite sglang: not run: no SGLang venv at $SGLANG_VENV (.ci/setup-sglang.sh)")
  status=1
fi
echo
printf '%s\n' "${summary[@]}"
exit $status
