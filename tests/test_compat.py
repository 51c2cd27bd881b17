"""Engine touchpoints, checked statically: every private or version-sensitive vLLM name the
adapter uses exists, with the parameters we pass, in the installed vLLM 0.32.0 (which the
other tests run) and in the vLLM 0.33.0 wheel (GPU build: downloaded, read, never imported).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_ext.engines.compat import SourceTree, Touchpoint, check
from engine_ext.engines.vllm import compat as vllm_compat

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ENGINE_EXT_TEST_CACHE", Path.home() / ".cache" / "engine_ext"))


def vllm_wheel(version: str) -> Path:
    """The vLLM wheel of ``version`` from PyPI (cached); fails with pip's reason if it cannot be had."""
    d = CACHE / "wheels"
    found = sorted(d.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    d.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-d", str(d)], capture_output=True, text=True, timeout=900)
    found = sorted(d.glob(f"vllm-{version}-*.whl"))
    assert p.returncode == 0 and found, f"could not download vllm=={version} from PyPI: {p.stderr[-2000:]}"
    return found[0]


def installed(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
    return Path(list(spec.submodule_search_locations)[0]).parent


def test_vllm_touchpoints_in_the_installed_vllm():
    assert check(SourceTree(installed("vllm")), vllm_compat.TOUCHPOINTS) == []


def test_vllm_touchpoints_in_the_0_33_wheel():
    assert "0.33.0" in vllm_compat.CHECKED_ON
    assert check(SourceTree(vllm_wheel("0.33.0")), vllm_compat.TOUCHPOINTS) == []


def test_checker_finds_what_is_gone():
    tree = SourceTree(installed("vllm"))
    bogus = [Touchpoint("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", ("layer", "keep_weight")),
             Touchpoint("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registri"),
             Touchpoint("vllm.distributed", "get_world_groups"),
             Touchpoint("vllm.no_such_module", "x")]
    problems = check(tree, bogus)
    assert len(problems) == 4, problems
    assert "parameters ['keep_weight'] gone" in problems[0] and "no member '_registri'" in problems[1]
    assert "get_world_groups not found" in problems[2] and "x not found" in problems[3]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_adapters_reach_the_engine_through_compat_only(engine):
    """Outside ``compat.py``, an adapter imports the engine only for base classes it subclasses
    (listed in TOUCHPOINTS) and ``vllm.__version__``."""
    allowed = {("vllm", "backend.py", "vllm.distributed.weight_transfer.base"), ("vllm", "patches.py", "vllm")}
    found = []
    adapter = ROOT / "engine_ext" / "engines" / engine
    assert (adapter / "compat.py").is_file(), adapter
    for p in sorted(adapter.glob("*.py")):
        if p.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [(engine, p.name, n) for n in names if n and n.split(".")[0] == engine and (engine, p.name, n) not in allowed]
    assert found == []


def test_ray_workers_get_our_variables(monkeypatch):
    """vLLM's Ray executor copies only VLLM_* (and a few) variables to its workers; the plugin
    adds our prefixes, so ranks on other nodes get the settings and the store credentials."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    from engine_ext.engines.vllm import compat as vc

    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "MINE_")
    monkeypatch.setenv("ENGINE_EXT_FOLLOW", "s3://b/run")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    assert "ENGINE_EXT_FOLLOW" not in get_env_vars_to_copy()
    vc.carry_env_to_ray_workers()
    vc.carry_env_to_ray_workers()  # idempotent
    import os

    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MINE_,ENGINE_EXT_,AWS_,HF_"
    assert {"ENGINE_EXT_FOLLOW", "AWS_SECRET_ACCESS_KEY"} <= get_env_vars_to_copy()


def test_the_general_plugin_loads_no_numba():
    """What the general plugin imports in every vLLM process before the worker starts stays clear of
    numba's llvmlite: vLLM 0.32 CPU's ``register_triton_kernel_overrides`` scans every module in
    ``sys.modules`` and dies on ``llvmlite.binding.ffi.lib`` (an object whose ``__dict__`` is no dict),
    so every server failed to start when patches.py imported the server's transaction module."""
    modules = ["engine_ext.engines.vllm." + m for m in ("plugin", "compat", "dist", "worker", "patches", "census")]
    code = f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\nprint('llvmlite' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
