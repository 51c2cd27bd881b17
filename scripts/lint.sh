#!/usr/bin/env bash
# Lint, format and types on engine_ext/ (the "lint" suite of scripts/test.sh; the rules live in pyproject.toml,
# [tool.ruff] and [tool.mypy], with what is turned off and why):
#   ruff check engine_ext          # the linter (ruff's default rule set, pinned by the lock)
#   ruff format --check engine_ext # the formatter: `ruff format engine_ext` rewrites, this only checks
#   mypy                           # types, on the files pyproject.toml names
# Runs in the project's virtualenv (scripts/env.sh: the test profile installs ruff and mypy). Every step runs;
# the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
status=0
for step in "ruff check engine_ext" "ruff format --check engine_ext" "mypy"; do
  echo "--- $step"
  read -r -a cmd <<< "$step"
  "$PY" -m "${cmd[@]}" || status=1
done
[ "$status" -eq 0 ] && echo "lint check passed"
exit $status
