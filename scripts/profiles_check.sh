#!/usr/bin/env bash
# Every install profile users are given (README "Install"; scripts/install.sh) resolves from a fresh virtualenv:
# `scripts/install.sh --profile P --dry-run` for each, in parallel, then the versions each resolved to are
# checked (scripts/profiles_check.py). pip --dry-run is the check because the GPU wheels cannot be installed
# here; the GPU profiles resolve against PyPI alone, as on a GPU machine (this machine's pip configuration
# keeps a CPU torch on disk, which pip would otherwise pick for vLLM's torch pin). scripts/test.sh runs it
# beside the main suite, as the "profiles" suite; the test profile itself is installed for real by CI.
#
#   bash scripts/profiles_check.sh [PROFILE...]      # default: every user profile
set -uo pipefail
cd "$(dirname "$0")/.."
profiles=("$@")
# core is installed for real beside (scripts/core_check.sh); name it to resolve it here too
[ ${#profiles[@]} -gt 0 ] || profiles=(vllm vllm-cpu verl verl-cpu trl sglang)
work=$(mktemp -d "${TMPDIR:-/tmp}/engine_ext_profiles.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
# One fresh virtualenv with a current pip for every profile's dry run (pip --dry-run --ignore-installed leaves it empty)
"${PYTHON:-python3}" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --disable-pip-version-check --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location"
export ENGINE_EXT_DRY_RUN_PYTHON=$work/venv/bin/python
pids=()
for p in "${profiles[@]}"; do
  mkdir -p "$work/$p"
  case "$p" in
    vllm|verl|trl|sglang) pypi=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null) ;;
    *) pypi=(env) ;;
  esac
  "${pypi[@]}" ENGINE_EXT_DRY_RUN_OUT="$work/$p" bash scripts/install.sh --profile "$p" --dry-run > "$work/$p.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!profiles[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "profile ${profiles[$i]}: does not resolve; its log:"
    cat "$work/${profiles[$i]}.log"
    status=1
  fi
done
echo "resolved ${#profiles[@]} profiles in $((SECONDS - t0)) s"
[ "$status" -eq 0 ] || exit 1
"$work/venv/bin/python" -m pip install --disable-pip-version-check --quiet packaging 2>&1 | grep -v "^WARNING: Location"
"$work/venv/bin/python" scripts/profiles_check.py "$work" "${profiles[@]}" || exit 1
echo "profiles check passed"
