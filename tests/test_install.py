"""The set-up scripts against environments that are not theirs, and the verl profile's requirement list.

* An active virtualenv that scripts/install.sh did not fill (a user's training env) is left alone: the
  scripts pick .venv in the repo and say so; one they filled before (it holds their stamp) is used.
* A virtualenv named explicitly (``--venv``) that holds a GPU build of torch is refused a CPU profile (which
  would replace its torch and remove its torchvision), a CPU build a GPU profile: exit 3, a line saying why,
  nothing touched. The GPU torch here is a stand-in (a ``torch`` package holding only ``version.py`` as a
  CUDA build writes it): a real one is 2-3 GB to download, and the scripts read only that file. The
  scripts' reading of it was checked once against a real torch 2.11.0+cu130 on an H200 machine (its
  ``version.py`` has ``cuda: Optional[str] = '13.0'`` and ``hip: Optional[str] = None``, as here).
* requirements/verl.txt is verl 0.9.1's own requirement list less its transformers pin (docs/VERL.md).

The resolution of every profile runs in scripts/profiles_check.sh (CI's "profiles" suite: pip needs the network).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def venv(path: Path, torch_cuda: str | None = "absent") -> Path:
    """A bare virtualenv (no pip: nothing here installs), with a stand-in torch of the given build."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    if torch_cuda != "absent":
        site = next(path.glob("lib/python*/site-packages"))
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text("")
        (site / "torch" / "version.py").write_text(  # as torch's build writes it
            f"from typing import Optional\n__version__ = '2.11.0'\ncuda: Optional[str] = {torch_cuda!r}\nhip: Optional[str] = None\n")
    return path


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


def install(*args: str, active: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "ENGINE_EXT_VENV", "ENGINE_EXT_VENV_NOTED")}
    if active is not None:  # as `source active/bin/activate` leaves it
        env.update(VIRTUAL_ENV=str(active), PATH=f"{active}/bin{os.pathsep}{env['PATH']}")
    return subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60)


def test_an_active_virtualenv_that_is_not_ours_is_left_alone(tmp_path):
    foreign = venv(tmp_path / "training-env", torch_cuda="13.0")
    before = snapshot(foreign)
    for profile in ("demo", "test", "verl-cpu"):  # scripts/demo.sh and scripts/test.sh call install.sh like this
        p = install("--profile", profile, "--plan", active=foreign)
        assert p.returncode == 0, p.stderr
        assert f"into {ROOT}/.venv:" in p.stdout, p.stdout
        assert f"leaving the active virtualenv {foreign} alone" in p.stderr and f"ENGINE_EXT_VENV={foreign}" in p.stderr, p.stderr
    assert snapshot(foreign) == before

    ours = venv(tmp_path / "ours")
    (ours / ".engine_ext-install-stamp-demo").write_text("0\n")  # filled by scripts/install.sh before
    p = install("--profile", "demo", "--plan", active=ours)
    assert p.returncode == 0 and f"into {ours}:" in p.stdout and "leaving" not in p.stderr, (p.stdout, p.stderr)


@pytest.mark.parametrize("profile, torch_cuda, build", [("demo", "13.0", "cuda"), ("verl-cpu", "13.0", "cuda"),
                                                        ("verl", None, "cpu"), ("vllm", None, "cpu")])
def test_a_named_virtualenv_with_the_other_torch_build_is_refused(tmp_path, profile, torch_cuda, build):
    target = venv(tmp_path / "env", torch_cuda=torch_cuda)
    before = snapshot(target)
    p = install("--profile", profile, "--venv", str(target))
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert f"{target} holds a {build} build of torch" in p.stderr and "leaving it alone" in p.stderr, p.stderr
    assert "installing" not in p.stdout
    assert snapshot(target) == before


def test_the_verl_requirements_are_verls_own_less_its_transformers_pin():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    verl = [Requirement(r) for r in requires("verl") if "extra ==" not in r]
    ours = [Requirement(ln.split("#")[0]) for ln in (ROOT / "requirements" / "verl.txt").read_text().splitlines()
            if ln.split("#")[0].strip()]
    assert {str(r) for r in verl if r.name != "transformers"} == {str(r) for r in ours}
    (pin,) = [r for r in verl if r.name == "transformers"]
    assert not pin.specifier.contains("5.16.1")  # the conflict with vLLM 0.32 (transformers>=5.16.1,<5.20)
