#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it): install, then run every suite.
#
#   bash scripts/test.sh            # as CI runs it (every suite; leaves out the tests marked `full`)
#   bash scripts/test.sh --full     # everything: CI's tests and the `full` ones (the whole model matrix, ...)
#   bash scripts/test.sh --quick    # the edit-test loop: only the tests that start no engine (no core check)
#
# CI has 20 minutes on 2 cores: it serves one cell of each distinct server-side path; the tests
# marked `full` repeat covered paths on more models, widths and servers (~10 more minutes).
# The core check (a fresh venv, mostly downloads) runs beside the main suite.
#
# Suites: lint (scripts/lint.sh: ruff and mypy on engine_ext/, beside main, niced; first and alone with
# --quick), core (scripts/core_check.sh: `pip install .` alone in a fresh venv, the signed CLI
# round trip, every command's --help, the wheel's contents), profiles (scripts/profiles_check.sh: every
# install profile resolves from a fresh venv, pip --dry-run, niced), main (vLLM CPU, stores, codec, kernels; on 2 pytest-xdist
# workers, modules that share a server kept on one), sglang (in SGLang's own venv). Ends
# with one line per suite (counts and exit status); a failing test's output includes the
# tails of the engine server logs of its module (tests/conftest.py). Other arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0
full=0
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then quick=1; elif [ "$a" = "--full" ]; then full=1; else args+=("$a"); fi
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
  record "$name" "$rc" "$t0"
}

record() {  # record NAME RC T0: the suite's counts line from its log
  local name=$1 rc=$2 t0=$3
  local counts
  counts=$(grep -E "^=*[ ]*[0-9]+ (passed|failed|skipped|error|deselected)|^=*[ ]*no tests ran|^(core|profiles|lint) check passed" "$logs/$name.log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
  summary+=("suite $name: ${counts:-no summary line} (exit $rc, $((SECONDS - t0)) s)")
  [ "$rc" -eq 0 ] || status=1
}

# --durations: the slowest tests named in every run's log, for whoever keeps the suite under its 20 minutes
pytest_args=(-q -p no:cacheprovider -rfEs --durations=25)
core_pid=""
profiles_pid=""
lint_pid=""
if [ "$quick" -eq 1 ]; then
  select=(-m "not engine")
  workers=()
  suite lint bash scripts/lint.sh
else
  select=(-m "not full")
  [ "$full" -eq 1 ] && select=()
  # loadfile: every module on one worker, so a module's shared (module-scoped) servers start once and its
  # tests run in order (xdist_group marks are not honoured under pytest 9.2: xdist 3.8 renames nodes it no longer can)
  # ENGINE_EXT_TEST_WORKERS (default 2): the suite's modules spend much of their time waiting (servers starting,
  # stores and fleets answering, soaks and deadlines), so a 2-core host can run more workers than cores
  workers=(-n "${ENGINE_EXT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)  # engine modules first (conftest)
  echo "=== suite core (beside the main suite): bash scripts/core_check.sh > $logs/core.log"
  core_t0=$SECONDS
  bash scripts/core_check.sh > "$logs/core.log" 2>&1 &
  core_pid=$!
  # the resolutions are mostly waiting on the network; niced, they take the cores only when the main suite leaves them idle
  echo "=== suite profiles (beside the main suite): bash scripts/profiles_check.sh > $logs/profiles.log"
  profiles_t0=$SECONDS
  nice -n 10 bash scripts/profiles_check.sh > "$logs/profiles.log" 2>&1 &
  profiles_pid=$!
  # ruff and mypy: ~10 CPU-s, niced like the profiles
  echo "=== suite lint (beside the main suite): bash scripts/lint.sh > $logs/lint.log"
  lint_t0=$SECONDS
  nice -n 10 bash scripts/lint.sh > "$logs/lint.log" 2>&1 &
  lint_pid=$!
fi
# SGLang's modules, in SGLang's own venv, beside the main suite (ENGINE_EXT_TEST_SGLANG_BESIDE=0: after it)
sglang_pid=""
sg_cmd=()
if [ -x "$SGLANG_VENV/bin/python" ] && ls tests/test_sglang_*.py >/dev/null 2>&1; then
  sg_select=(-m "sglang and not full")
  [ "$full" -eq 1 ] && sg_select=(-m "sglang")
  [ "$quick" -eq 1 ] && sg_select=(-m "sglang and not engine")
  sg_cmd=("$SGLANG_VENV/bin/python" -m pytest "${pytest_args[@]}" tests/test_sglang_*.py "${sg_select[@]}" "${args[@]}")
  if [ "$quick" -eq 0 ] && [ "${ENGINE_EXT_TEST_SGLANG_BESIDE:-1}" = 1 ]; then
    echo "=== suite sglang (beside the main suite): ${sg_cmd[*]} > $logs/sglang.log"
    sglang_t0=$SECONDS
    "${sg_cmd[@]}" > "$logs/sglang.log" 2>&1 &
    sglang_pid=$!
  fi
fi
# Main suite (vLLM CPU, stores, codec, kernels)
suite main "$PY" -m pytest "${pytest_args[@]}" "${workers[@]}" "${select[@]}" tests --ignore-glob='tests/test_sglang_*' "${args[@]}"
if [ -n "$lint_pid" ]; then
  wait "$lint_pid"
  lint_rc=$?
  echo "=== suite lint: its log"
  cat "$logs/lint.log"
  record lint "$lint_rc" "$lint_t0"
fi
if [ -n "$core_pid" ]; then
  wait "$core_pid"
  core_rc=$?
  echo "=== suite core: its log"
  cat "$logs/core.log"
  record core "$core_rc" "$core_t0"
fi
if [ -n "$profiles_pid" ]; then
  wait "$profiles_pid"
  profiles_rc=$?
  echo "=== suite profiles: its log"
  grep -v -E "^(ERROR: Ignored|WARNING: Location)" "$logs/profiles.log"
  record profiles "$profiles_rc" "$profiles_t0"
fi
if [ -n "$sglang_pid" ]; then
  wait "$sglang_pid"
  sglang_rc=$?
  echo "=== suite sglang: its log"
  cat "$logs/sglang.log"
  record sglang "$sglang_rc" "$sglang_t0"
elif [ "${#sg_cmd[@]}" -gt 0 ]; then
  suite sglang "${sg_cmd[@]}"
else
  summary+=("suite sglang: not run: no SGLang venv at $SGLANG_VENV (.ci/setup-sglang.sh)")
  status=1
fi
echo
printf '%s\n' "${summary[@]}"
exit $status
