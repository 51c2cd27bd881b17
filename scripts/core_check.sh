#!/usr/bin/env bash
# The core package alone, as a trainer machine gets it: a fresh virtualenv, `pip install .`
# (not editable, no extras), then the signed CLI round trip (scripts/core_roundtrip.py),
# run from outside the checkout so that nothing is imported from the source tree; and the
# wheel (`pip wheel --no-deps .`) ships engine_ext with engine_ext/triton_kernels and
# nothing else (no tests, no top-level triton_kernels). scripts/test.sh runs it as the
# "core" suite. torch is installed first at the version the main virtualenv pins
# (the CPU wheel pip's find-links has here), so that pip does not fetch a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
source scripts/env.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/engine_ext_core.XXXXXX")
trap 'rm -rf "$work"' EXIT
log="$work/pip.log"
torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo "")
"${PYTHON:-python3}" -m venv "$work/venv"
core="$work/venv/bin/python"
if [ -n "$torch_version" ]; then
  pip_install "$log" "$core" "torch==$torch_version"
fi
pip_install "$log" "$core" "$repo"
extras=$("$core" -c "import importlib.util as u; print(' '.join(m for m in ('vllm', 'sglang', 'boto3', 'transformers', 'fastapi') if u.find_spec(m)))")
if [ -n "$extras" ]; then
  echo "core venv holds packages of the extras: $extras" >&2
  exit 1
fi
(cd "$work" && "$core" "$repo/scripts/core_roundtrip.py" "$work/roundtrip")

quiet "$log" "$core" -m pip wheel --disable-pip-version-check --no-deps "$repo" -w "$work/wheel"
"$core" - "$work"/wheel/engine_ext-*.whl <<'PYEOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
code = [n for n in names if ".dist-info/" not in n]
tops = sorted({n.split("/")[0] for n in code})
assert tops == ["engine_ext"], f"the wheel holds top-level {tops}, want only engine_ext"
assert "engine_ext/triton_kernels/apply_kernel.py" in names, "engine_ext/triton_kernels is missing from the wheel"
assert not any("tests/" in n or n.startswith("triton_kernels/") for n in names), "the wheel ships tests or a top-level triton_kernels"
print(f"wheel ok: {sys.argv[1].rsplit('/', 1)[-1]}, {len(code)} files under engine_ext/ (triton_kernels included, no tests)")
PYEOF
echo "core check passed"
