"""POST /update_weights_delta on a real vLLM CPU server (TP 1, tiny Qwen2).

One server takes deltas through the endpoint (single steps and a chain), refuses bad
requests with the right status while its outputs stay bit-identical, keeps
generation requests running through an update, and finally answers exactly like a
server cold-started on the final weights (tokens and logprobs compared as floats).

This server starts without the test warm-up: its first generation is the 4-token
prompt that killed vLLM 0.32's CPU worker with SIGILL on AMX hosts before the plugin
asked for AMX permission (docs/vllm.md, "Known vLLM CPU issues").
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time
from pathlib import Path

import pytest
import requests

from engine_ext.format import fingerprint as fpr
from engine_ext.store.signing import Signer

pytest.importorskip("vllm")
from vllm_helpers import (PROMPTS, Server, assert_layout_on_this_host, copy_store, make_model, rl_trajectory,  # noqa: E402
                          save_state_dict)

pytestmark = [pytest.mark.vllm]  # one module-scoped server
K = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory, http_server):
    tmp = tmp_path_factory.mktemp("vllm_endpoint")
    model = make_model(tmp / "model", "qwen2")
    root = tmp / "stores"
    final = rl_trajectory(model, root / "run", K, seed=1)
    rl_trajectory(model, root / "other", 3, seed=2)
    (root / "other" / "v00000000.anchor.json").unlink()  # no anchor: nothing leads from our weights there
    corrupt = copy_store(root / "run", root / "corrupt")
    blob = next(corrupt.glob("v00000003.0.*.bin"))
    b = bytearray(blob.read_bytes())
    b[len(b) // 2] ^= 0x40
    blob.write_bytes(bytes(b))
    trunc = copy_store(root / "run", root / "trunc")
    blob = next(trunc.glob("v00000003.0.*.bin"))
    blob.write_bytes(blob.read_bytes()[:-100])
    tampered = copy_store(root / "run", root / "tampered")  # valid blobs, a lying per-tensor fingerprint
    m = json.loads((tampered / "v00000003.json").read_text())
    fp = m["tensors"][0]["fingerprint"]
    m["tensors"][0]["fingerprint"] = f"{(int(fp, 16) + 1) % (1 << 64):016x}"
    m["fingerprint"] = fpr.fmt(fpr.model_fingerprint({t["name"]: fpr.parse(t["fingerprint"]) for t in m["tensors"]}))
    (tampered / "v00000003.json").write_text(json.dumps(m))
    Signer.from_settings().sign_file(tampered / "v00000003.json")  # a signed lie: only the apply's verify can tell
    copy_store(root / "run", tmp / "outside")
    # The top attacks of tests/test_hostile.py, against this real server too:
    unsigned = copy_store(root / "run", root / "unsigned")  # a forged delta cannot be signed
    (unsigned / "v00000003.json.sig").unlink()
    bomb = copy_store(root / "run", root / "bomb")  # names a tensor the model does not have (unchanged, no bytes)
    m = json.loads((bomb / "v00000003.json").read_text())
    t0 = m["tensors"][0]
    m["tensors"].append({"name": "model.not_a_tensor.weight", "dtype": t0["dtype"], "shape": [1 << 20], "nnz": 0,
                         "fingerprint": t0["fingerprint"], "base_fingerprint": t0["fingerprint"]})
    m["fingerprint"] = fpr.fmt(fpr.model_fingerprint({t["name"]: fpr.parse(t["fingerprint"]) for t in m["tensors"]}))
    m["base_fingerprint"] = fpr.fmt(fpr.model_fingerprint({t["name"]: fpr.parse(t["base_fingerprint"]) for t in m["tensors"]}))
    (bomb / "v00000003.json").write_text(json.dumps(m))
    Signer.from_settings().sign_file(bomb / "v00000003.json")
    copy_store(root / "run", http_server.root / "stores" / "run")
    http_server.redirects["/stores/run/v00000003.json"] = "/elsewhere/v00000003.json"  # off the store
    server = Server(model, sources=f"{root},s3://bucket/allowed,{http_server.url}/stores", base_version=0,
                    log=tmp / "server.log", warmup=False, worker_process=True)  # vLLM CPU's default shape
    try:
        yield {"tmp": tmp, "model": model, "root": root, "final": final, "server": server, "http": http_server.url}
    finally:
        server.stop()


def v(root: Path, store: str, n: int) -> str:
    return str(root / store / f"v{n:08d}.json")


def test_start_state(world):
    st = world["server"].status()
    anchor = json.loads((world["root"] / "run" / "v00000000.anchor.json").read_text())
    assert st["version"] == 0 and st["fingerprint"] == anchor["fingerprint"] and st["tensors"] > 0
    assert_layout_on_this_host(st)


def test_first_request_is_short(world):
    """The first step of this server has 4 tokens (see the module docstring); it is served."""
    assert PROMPTS[0] == [5, 6, 7, 8]
    c = world["server"].complete(PROMPTS[0], max_tokens=2)["choices"][0]
    assert len(c["logprobs"]["tokens"]) == 2


def test_single_steps(world):
    s, root = world["server"], world["root"]
    before = s.outputs()
    for n in (1, 2):
        r = s.update({"url": v(root, "run", n)})
        assert r.status_code == 200, r.text
        a = r.json()
        assert a["version"] == n and a["base_version"] == n - 1 and a["elements"] > 0 and a["fallback"] == []
        assert a["fingerprint"] == json.loads(Path(v(root, "run", n)).read_text())["fingerprint"]
        assert {"plan", "fetch", "apply", "verify", "pause", "total"} <= set(a["phases_ms"])
    world["at_v2"] = s.outputs()
    assert world["at_v2"] != before  # the served computation really uses the new weights


@pytest.mark.parametrize("body,status,reason", [
    (lambda w: {"url": v(w["root"], "corrupt", 3)}, 422, "integrity"),
    (lambda w: {"url": v(w["root"], "trunc", 3)}, 422, "integrity"),
    (lambda w: {"url": v(w["root"], "other", 3)}, 409, "base_mismatch"),
    (lambda w: {"url": v(w["root"], "run", 3), "base_version": 1}, 409, "base_mismatch"),
    (lambda w: {"url": v(w["root"], "tampered", 3)}, 500, "verify"),
    (lambda w: {"url": str(w["tmp"] / "outside" / "v00000003.json")}, 403, "forbidden_source"),
    (lambda w: {"url": f"{w['root']}/../outside/v00000003.json"}, 403, "forbidden_source"),
    (lambda w: {"url": "http://127.0.0.1:1/v00000003.json"}, 403, "forbidden_source"),
    (lambda w: {"url": "s3://bucket/allowed/../secret/v1.json"}, 403, "forbidden_source"),
    (lambda w: '{"url": ', 400, "bad_request"),
    (lambda w: "[1, 2]", 400, "bad_request"),
    (lambda w: {"uri": "x"}, 400, "bad_request"),
    (lambda w: {"url": 5}, 400, "bad_request"),
    (lambda w: {"url": v(w["root"], "run", 3), "pause_mode": "later"}, 400, "bad_request"),
    (lambda w: {"url": f"{w['http']}/stores%2Frun%2Fv00000003.json"}, 403, "forbidden_source"),
    (lambda w: {"url": v(w["root"], "unsigned", 3)}, 403, "signature"),
    (lambda w: {"url": v(w["root"], "bomb", 3)}, 409, "model_mismatch"),  # another model: refused by name, no bytes read
    (lambda w: {"url": f"{w['http']}/stores/run/v00000003.json"}, 403, "forbidden_source"),
    (lambda w: {"url": v(w["root"], "run", 1)}, 409, "downgrade"),
    (lambda w: {"url": v(w["root"], "run", 3)}, 401, "unauthorized"),
], ids=["corrupt", "truncated", "wrong-base", "stale-base-version", "fingerprint-mismatch-rollback", "outside",
        "dotdot", "http-outside", "s3-dotdot", "malformed-json", "not-object", "unknown-field", "url-type", "pause-mode",
        "percent-2f", "unsigned-forgery", "unknown-tensor-bomb", "redirect-off-store", "downgrade", "no-token"])
def test_refused_and_unchanged(world, body, status, reason):
    import psutil

    s = world["server"]
    before_status = s.status()
    api = psutil.Process(s.proc.pid)  # the API server process: it fetches and decodes
    rss = api.memory_info().rss
    t = time.perf_counter()
    r = s.update(body(world), headers={} if reason == "unauthorized" else None)
    took, grew = time.perf_counter() - t, api.memory_info().rss - rss
    assert took < 10 and grew < 100 << 20, (took, grew)
    assert r.status_code == status, r.text
    assert r.json()["reason"] == reason and r.json()["error"]
    after_status = s.status()
    assert (after_status["version"], after_status["fingerprint"]) == (before_status["version"], before_status["fingerprint"]) == (2, after_status["fingerprint"])
    assert s.outputs() == world["at_v2"]


def running_requests(server) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge (its /metrics)."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def test_chain_while_generating(world):
    """v4 from v2 (chain v3+v4) while long generations run with pause mode keep: all complete."""
    s, root = world["server"], world["root"]
    with cf.ThreadPoolExecutor(6) as ex:
        gens = [ex.submit(s.complete, [10 + i, 11, 12], 120, 0) for i in range(5)]
        deadline = time.monotonic() + 120  # the update starts once the generations run (not after a sleep)
        while running_requests(s) < len(gens) and not any(g.done() for g in gens):
            assert time.monotonic() < deadline, "the generations never started"
            time.sleep(0.05)
        upd = ex.submit(s.update, {"url": v(root, "run", K)})
        r = upd.result()
        results = [g.result() for g in gens]
    assert r.status_code == 200, r.text
    a = r.json()
    assert a["version"] == K and a["base_version"] == 2 and len(a["manifests"]) == 2
    assert all(len(x["choices"][0]["logprobs"]["tokens"]) == 120 and x["choices"][0]["finish_reason"] == "length" for x in results)
    st = s.status()
    assert st["version"] == K and [h["ok"] for h in st["history"]].count(True) == 3
    metrics = requests.get(s.url + "/metrics", timeout=30).text
    assert "engine_ext_updates_total 3.0" in metrics and "engine_ext_weight_version 4.0" in metrics


def test_identical_to_cold_start(world):
    s = world["server"]
    updated = s.outputs()
    fp = s.status()["fingerprint"]
    s.stop()
    cold_dir = save_state_dict(world["tmp"] / "final_model", world["final"], world["model"])
    with Server(cold_dir, log=world["tmp"] / "cold.log") as cold:
        assert cold.status()["fingerprint"] == fp
        assert cold.outputs() == updated
