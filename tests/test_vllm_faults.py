"""Faults on the read side of a real vLLM CPU server lose nothing (docs/RELIABILITY.md).

One server reads an HTTP store (tests/servers.py, on loopback) that misbehaves on cue. It
starts cold on the final weights (its fingerprint and outputs: the cold-start reference) and
is taken back to v0 by the anchor (``rollback``); then the store answers 503 (retried, the
update lands), cuts reads half way (retried, the update lands), stays down or keeps cutting
(a clear 502 once the retries are spent, within 30 s, the served weights and outputs untouched,
the next update fine). Every update runs under the default fetch deadline: the 30 s is the
attack's bound, asserted on the failing updates alone, so a loaded host cannot fail the set-up. Then the server is SIGKILLed in the middle of an update: the model
directory it served from is byte for byte what it was (the plugin never writes it), and a
new server started from the v0 checkpoint with ENGINE_EXT_FOLLOW catches up to the store's
LATEST by itself, with the fingerprint and the outputs of the cold start.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import pytest
import requests

pytest.importorskip("vllm")
from vllm_helpers import Server, make_model, rl_trajectory, save_state_dict  # noqa: E402

pytestmark = pytest.mark.vllm
K = 5


def tree_sha(path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def served(server) -> tuple:
    return server.status()["fingerprint"], server.outputs()


def test_store_outages_and_a_killed_server_lose_nothing(tmp_path, http_server):
    http_server.reset()
    model = make_model(tmp_path / "model", "qwen2")
    run = http_server.root / f"run-{tmp_path.name}"
    final = save_state_dict(tmp_path / "final", rl_trajectory(model, run, K, seed=5), model)
    final_files = tree_sha(final)
    root = f"{http_server.url}/{run.name}"
    fp = {v: json.loads((run / f"v{v:08d}.json").read_text())["fingerprint"] for v in range(1, K + 1)}
    server = Server(final, sources=root, log=tmp_path / "server.log")  # cold on vK: the reference
    try:
        cold = served(server)
        assert cold[0] == fp[K] and server.status()["version"] is None  # version unknown: matched by fingerprint
        r = server.update({"url": f"{root}/v00000000.anchor.json", "rollback": True})
        assert r.status_code == 200 and r.json()["version"] == 0, r.text
        http_server.fail_next = 2  # 503 twice: retried
        r = server.update({"url": f"{root}/v00000001.json"})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        http_server.cut_next = 2  # two reads cut half way: read again
        r = server.update({"url": f"{root}/v00000002.json"})
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        at_v2 = served(server)
        assert at_v2[0] == fp[2]
        for switch in ("fail_next", "cut_next"):  # the store stays down, or keeps cutting every read
            setattr(http_server, switch, 10**6)
            t = time.monotonic()
            r = server.update({"url": f"{root}/v00000003.json"})
            took = time.monotonic() - t
            http_server.reset()
            assert r.status_code == 502 and r.json()["reason"] == "fetch", (switch, r.text)
            assert took < 30, (switch, took)  # the retries give up in bounded time
            assert served(server) == at_v2, switch  # nothing changed
        r = server.update({"url": f"{root}/v00000003.json"})
        assert r.status_code == 200 and r.json()["version"] == 3, r.text

        http_server.delay = 2.0  # every read of the store now takes 2 s: the next update is slow
        killed = threading.Event()

        def update_then_die():
            try:
                server.update({"url": f"{root}/v{K:08d}.json"}, timeout=120)
            except requests.RequestException:
                killed.set()  # the server went away mid-request

        th = threading.Thread(target=update_then_die)
        th.start()
        deadline = time.monotonic() + 60
        while not any(r[0] == "GET" and r[1].endswith(".bin") for r in list(http_server.requests)):
            assert time.monotonic() < deadline, "the update never reached the blobs"
            time.sleep(0.05)
        os.killpg(server.proc.pid, signal.SIGKILL)  # the whole server, mid-update
        th.join(60)
        assert killed.is_set()
    finally:
        server.stop()
        http_server.reset()
    assert tree_sha(final) == final_files  # the model directory it served from is never written

    follow = {"ENGINE_EXT_FOLLOW": root, "ENGINE_EXT_FOLLOW_INTERVAL": "1"}
    with Server(model, sources=root, base_version=0, env=follow, log=tmp_path / "restarted.log") as again:
        deadline = time.monotonic() + 120
        while (st := again.status())["version"] != K:
            assert time.monotonic() < deadline, st["follow"]
            time.sleep(1)
        assert st["follow"]["state"] == "following" and st["follow"]["failures_in_a_row"] == 0, st["follow"]
        caught_up = served(again)
    assert caught_up == cold  # the fingerprint (fp[K]) and the outputs of the cold start on the final weights
