"""The in-process hook: ``vllm.LLM`` with the ``delta`` weight-transfer backend (tiny Llama).

Runs examples/llm_hook.py in a subprocess (vLLM spawns workers; the plugin patches
vLLM process-wide) and checks the served fingerprint equals the manifest's, the
outputs changed, and a wrong-base delta was refused and rolled back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from vllm_helpers import make_model, rl_trajectory  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


def test_llm_update_weights_delta_backend(tmp_path):
    model = make_model(tmp_path / "model", "llama")
    store = tmp_path / "store"
    rl_trajectory(model, store, 3, seed=4)
    env = dict(os.environ, VLLM_PLUGINS="engine_ext", VLLM_CPU_KVCACHE_SPACE="1", ENGINE_EXT_SOURCES=str(store))
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "llm_hook.py"), "--model", str(model), "--store", str(store), "--upto", "3"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith('{"before"')))
    assert out["fingerprint"] == json.loads((store / "v00000003.json").read_text())["fingerprint"]
    assert out["weight_version"] == "3" and out["status"][0]["version"] == 3
    assert out["after"] != out["before"]
    assert out["wrong_base_error"] and "rolled back" in out["wrong_base_error"]
