"""One update transaction behind every vLLM entry point: the in-process ``delta`` backend
(``vllm.LLM``, TP 2: worker 0 drives, worker 1 follows) and ``POST /update_weights_delta``
take the same composed chain v0 -> v3 and end at the same version and fingerprint.

The backend also refuses, on every worker with nothing changed, a version 3 from another
run (the served version, with other weights) and one whose promised fingerprint is wrong
(applied, verified, rolled back on both workers); a later good update still lands.
Runs examples/llm_hook.py in a subprocess (vLLM spawns workers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_ext.format import fingerprint as fpr
from engine_ext.store.signing import Signer

pytest.importorskip("vllm")
from vllm_helpers import Server, copy_store, make_model, rl_trajectory  # noqa: E402

# full: since the weight-transfer backend (issue 28), `delta` is an alias of the `engine_ext` backend, whose
# in-process LLM at TP 2 (refusals changing nothing, both workers, a cold start) CI runs in
# tests/test_vllm_transfer.py::test_offline_llm_tp2, and whose two doors on one server in its online module
pytestmark = [pytest.mark.vllm, pytest.mark.full]
ROOT = Path(__file__).resolve().parents[1]


def test_backend_and_route_run_the_same_transaction(tmp_path):
    model = make_model(tmp_path / "model", "llama")
    root = tmp_path / "stores"
    rl_trajectory(model, root / "run", 4, seed=4)
    rl_trajectory(model, root / "other", 3, seed=5)
    (root / "other" / "v00000000.anchor.json").unlink()
    tampered = copy_store(root / "run", root / "tampered")
    m = json.loads((tampered / "v00000004.json").read_text())
    m["tensors"][0]["fingerprint"] = fpr.fmt(fpr.parse(m["tensors"][0]["fingerprint"]) + 1)
    m["fingerprint"] = fpr.fmt(fpr.model_fingerprint({t["name"]: fpr.parse(t["fingerprint"]) for t in m["tensors"]}))
    (tampered / "v00000004.json").write_text(json.dumps(m))
    Signer.from_settings().sign_file(tampered / "v00000004.json")  # a signed lie: only the apply's verify can tell
    v3 = str(root / "run" / "v00000003.json")
    urls = [v3, str(root / "other" / "v00000003.json"), str(tampered / "v00000004.json"), str(root / "run" / "v00000004.json")]
    env = dict(os.environ, VLLM_PLUGINS="engine_ext", VLLM_CPU_KVCACHE_SPACE="1", ENGINE_EXT_SOURCES=str(root),
               ENGINE_EXT_BASE_VERSION="0")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "llm_hook.py"), "--model", str(model), "--tp", "2",
                        "--urls", ",".join(urls)], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith('{"before"')))
    chain, foreign, lying, last = out["results"]
    fp3 = json.loads(Path(v3).read_text())["fingerprint"]
    assert (chain["ok"], chain["version"], chain["fingerprint"]) == (True, 3, fp3)
    assert not foreign["ok"] and "is version 3 with another fingerprint" in foreign["error"], foreign
    assert not lying["ok"] and "rolled back" in lying["error"], lying
    assert foreign["fingerprint"] == lying["fingerprint"] == fp3  # nothing changed on any worker
    assert last["ok"] and last["version"] == 4
    assert out["versions"] == [4, 4] and out["weight_version"] == "4"
    assert out["fingerprint"] == json.loads((root / "run" / "v00000004.json").read_text())["fingerprint"]
    assert out["after"] != out["before"]

    with Server(model, sources=str(root), base_version=0, log=tmp_path / "server.log") as server:
        r = server.update({"url": v3})
        assert r.status_code == 200, r.text
        a = r.json()
        assert a["version"] == chain["version"] == 3 and len(a["manifests"]) == 3
        assert a["fingerprint"] == chain["fingerprint"] == fp3  # the same weights, by either entry point
