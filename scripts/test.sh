#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it): install, then run every suite.
#
#   bash scripts/test.sh            # everything, as CI runs it
#   bash scripts/test.sh --quick    # the edit-test loop: only the tests that start no engine (no core check)
#   bash scripts/test.sh --slow     # everything, and the tests marked slow (variants another module covers)
#
# Suites: core (scripts/core_check.sh: `pip install .` alone in a fresh venv, the signed CLI
# round trip, the wheel's contents), main (vLLM CPU, stores, codec, kernels; on 2 pytest-xdist
# workers, modules that share a server kept on one), sglang (in SGLang's own venv). Ends
# with one line per suite (counts and exit status); a failing test's output includes the
# tails of the engine server logs of its module (tests/conftest.py). Other arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0
slow=0
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then quick=1; elif [ "$a" = "--slow" ]; then slow=1; else args+=("$a"); fi
done
bash scripts/install.sh || exit 1
source scripts/env.sh
logs=$(mktemp -d "${TMPDIR:-/tmp}/engine_ext_tests.XXXXXX")
status=0
summary=()

suite() {  # suite NAME COMMAND...: run one suite, remember its counts line
  local name=$1 rc t0=$SECONDS
  shift
  echo "=== suite $name: $*"
  "$@" 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  local counts
  counts=$(grep -E "^=*[ ]*[0-9]+ (passed|failed|skipped|error|deselected)|^=*[ ]*no tests ran|^core check passed" "$logs/$name.log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
  summary+=("suite $name: ${counts:-no summary line} (exit $rc, $((SECONDS - t0)) s)")
  [ "$rc" -eq 0 ] || status=1
}

pytest_args=(-q -p no:cacheprovider -rfEs)
if [ "$quick" -eq 1 ]; then
  select=(-m "not engine and not slow")
  workers=()
else
  select=(-m "not slow")
  [ "$slow" -eq 1 ] && select=()
  # loadfile: every module on one worker, so a module's shared (module-scoped) servers start once and its
  # tests run in order (xdist_group marks are not honoured under pytest 9.2: xdist 3.8 renames nodes it no longer can)
  workers=(-n 2 --dist loadfile --no-loadscope-reorder)  # modules in collection order: engine modules first (conftest)
  suite core bash scripts/core_check.sh
fi
# Main suite (vLLM CPU, stores, codec, kernels); SGLang's modules run in SGLang's own venv below.
suite main "$PY" -m pytest "${pytest_args[@]}" "${workers[@]}" "${select[@]}" tests --ignore-glob='tests/test_sglang_*' "${args[@]}"
if [ -x "$SGLANG_VENV/bin/python" ] && ls tests/test_sglang_*.py >/dev/null 2>&1; then
  sg_select=(-m "sglang")
  [ "$quick" -eq 1 ] && sg_select=(-m "sglang and not engine")
  suite sglang "$SGLANG_VENV/bin/python" -m pytest "${pytest_args[@]}" tests/test_sglang_*.py "${sg_select[@]}" "${args[@]}"
else
  summary+=("suite sglang: not run: no SGLang venv at $SGLANG_VENV (.ci/setup-sglang.sh)")
  status=1
fi
echo
printf '%s\n' "${summary[@]}"
exit $status
