"""Fleets: pushed (``engine_ext.fleet``, ``engine-ext push``) and pulling (``ENGINE_EXT_FOLLOW``).

The first tests need no engine: the follower against in-process ranks over a real local
store, and the push client against tiny real HTTP replicas that answer what a busy or
refusing server answers. The last runs three real vLLM CPU replicas of a tiny model
(started one after the other: this machine has two cores), one pulling from an HTTP
store, two pushed from S3 (moto_server on loopback); one of them lags five versions and
catches up in one push, one is stopped mid-push and reported, then restarted pulling
from a local directory. All end on the final version with the fingerprint and the
outputs of a cold start of the final weights.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import torch

from engine_ext.server.controller import Controller
from engine_ext.server.protocol import ROUTE
from engine_ext.fleet import Fleet, version_of
from engine_ext.server.follow import Follower
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.store.sources import Sources
from fake_ranks import FakeRanks, make_rank

TOKEN = os.environ["ENGINE_EXT_TOKEN"]  # conftest: the run's token and signing key


def _steps(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = [{"w": torch.randn(8, 16, generator=g).to(torch.bfloat16), "b": torch.randn(16, generator=g).to(torch.bfloat16)}]
    for _ in range(n):
        out.append({k: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(torch.bfloat16) for k, t in out[-1].items()})
    return out


# --------------------------------------------------------------------------- pull, no engine


def test_follower_catches_up_backs_off_and_keeps_serving(tmp_path):
    states = _steps(4)
    store = tmp_path / "run"
    pub = DeltaPublisher(str(store), anchor_every=0)
    pub.publish(states[0])
    pub.wait()
    ranks = [make_rank(r, states[0]) for r in range(2)]
    ctl = Controller(FakeRanks(ranks), Sources([]), version=0)  # the followed store alone is allowed...
    ctl.sources = Sources([str(store)])  # ...as Sources.from_settings adds ENGINE_EXT_FOLLOW

    async def me():
        return ctl

    f = ctl.follower = Follower(me, str(store), interval_s=0.1)  # looks driven by hand here, not by its loop

    async def scenario():
        await ctl.start()
        await f.check()
        assert (ctl.version, f.lag_versions(), f.failures) == (0, 0, 0)  # LATEST is what is served
        for sd in states[1:4]:
            pub.publish(sd)
        pub.wait()
        await f.check()  # three versions behind: one update (a chain of three)
        assert (ctl.version, f.latest_version, f.lag_versions(), f.lag_seconds(), f.updates) == (3, 3, 0, 0.0, 1)
        assert ctl.history[-1]["version"] == 3 and ctl.history[-1]["base_version"] == 0
        good = (store / "LATEST").read_bytes()
        (store / "LATEST").write_bytes(b"{not json")  # the store breaks: refused, counted, backed off
        await f.check()
        await f.check()
        assert ctl.version == 3 and f.failures == 2 and "bad LATEST pointer" in f.last_error
        assert 0.4 * 0.8 <= f.delay() <= 0.4 * 1.2  # doubled per failure in a row, +-20 %
        (store / "LATEST").write_bytes(good)
        pub.publish(states[4])
        pub.wait()
        await f.check()
        assert (ctl.version, f.failures, f.last_error) == (4, 0, None)
        st = ctl.status()["follow"]
        assert st["lag_versions"] == 0 and st["latest_version"] == 4 and st["updates"] == 2

    asyncio.run(scenario())
    pub.close()
    for up in ranks:
        assert torch.equal(up.module.b.view(torch.int16), states[4]["b"].view(torch.int16))


def test_follower_started_before_the_first_version_waits_without_backing_off(tmp_path):
    """A store with no LATEST yet is not a failure: the follower says it is waiting, keeps its
    interval (no backoff), and takes the first version at its next look."""
    states = _steps(1)
    store = tmp_path / "run"
    ranks = [make_rank(0, states[0], world=1)]
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]), version=None)

    async def me():
        return ctl

    f = ctl.follower = Follower(me, str(store), interval_s=2.0)

    async def scenario():
        await ctl.start()
        for _ in range(3):
            await f.check()
        st = ctl.status()["follow"]
        assert (st["state"], st["failures_in_a_row"], st["last_error"]) == ("waiting", 0, None), st
        assert 2.0 * 0.8 <= f.delay() <= 2.0 * 1.2  # the interval, not a backoff
        with DeltaPublisher(str(store), anchor_every=0) as pub:
            pub.publish(states[0])
            pub.publish(states[1])
        await f.check()
        assert (ctl.version, f.state(), f.failures) == (1, "following", 0)

    asyncio.run(scenario())
    assert torch.equal(ranks[0].module.w.view(torch.int16), states[1]["w"].view(torch.int16))


# --------------------------------------------------------------------------- push, no engine


class _Replica:
    """A tiny real HTTP server answering the update route: ``answers`` in order (status, body), then 200."""

    def __init__(self, answers, version: int = 7):
        outer = self
        self.answers, self.version, self.posts = list(answers), version, 0

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"version": 5})

            def do_POST(self):
                assert self.path == ROUTE and self.headers["Authorization"] == f"Bearer {TOKEN}"
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["wait"] is True
                outer.posts += 1
                if outer.answers:
                    self._send(*outer.answers.pop(0))
                else:
                    self._send(200, {"version": outer.version, "pause_ms": 12.5, "fetched_bytes": [100, 50]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_push_retries_transient_failures_and_names_the_replicas_that_failed():
    busy = _Replica([(409, {"reason": "busy", "error": "another update"}), (503, {"reason": "unavailable", "error": "x"})])
    refusing = _Replica([(422, {"reason": "integrity", "error": "SHA-256 mismatch"})])
    other_model = _Replica([(409, {"reason": "model_mismatch", "error": "1 tensor(s) not in the served model"})] * 3)
    fine = _Replica([])
    dead = "http://127.0.0.1:9"  # nothing listens: connection refused on every attempt
    try:
        res = Fleet([busy.url, refusing.url, other_model.url, fine.url, dead], TOKEN, retries=2, backoff_s=0.05).update(
            "s3://b/run/v00000007.json")
        assert res.target == 7 == version_of("s3://b/run/v00000007.json") and not res.ok
        by = {r.url: r for r in res.replicas}
        assert by[busy.url].ok and by[busy.url].attempts == 3 and busy.posts == 3  # 409, 503, then 200
        assert by[busy.url].version_before == 5 and by[busy.url].version_after == 7 and by[busy.url].fetched_bytes == 150
        assert not by[refusing.url].ok and by[refusing.url].attempts == 1 and by[refusing.url].status == 422  # not retried
        assert not by[other_model.url].ok and other_model.posts == 1 and "model_mismatch" in by[other_model.url].error
        assert by[fine.url].ok and by[fine.url].attempts == 1
        assert not by[dead].ok and by[dead].attempts == 3 and by[dead].status is None
        assert [r.url for r in res.failed] == [refusing.url, other_model.url, dead]
        table = res.table()
        assert "FAILED (422)" in table and "FAILED (no answer)" in table
        wrong = _Replica([], version=6)  # answers 200 with another version: not ok
        try:
            assert not Fleet([wrong.url], TOKEN).update("/x/v00000007.json").ok
        finally:
            wrong.close()
    finally:
        for r in (busy, refusing, other_model, fine):
            r.close()


def test_push_cli_exit_status_names_the_failed_replica():
    fine, refusing = _Replica([]), _Replica([(409, {"reason": "busy", "error": "b"})] * 9)
    try:
        cmd = [sys.executable, "-m", "engine_ext.cli", "push", "/s/v00000007.json", "--servers", f"{fine.url},{refusing.url}",
               "--retries", "1"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and f"did not reach v7: {refusing.url}" in p.stderr, (p.stdout, p.stderr)
        assert fine.url in p.stdout and "FAILED (409)" in p.stdout
        p = subprocess.run(cmd[:6] + [fine.url, "--json"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and json.loads(p.stdout)["ok"] is True, p.stderr
    finally:
        fine.close()
        refusing.close()


# --------------------------------------------------------------------------- three vLLM replicas


@pytest.mark.vllm
def test_three_vllm_replicas_pushed_and_pulling(tmp_path, http_server, s3_server):
    pytest.importorskip("vllm")
    import boto3
    from vllm_helpers import Server, make_model, save_state_dict

    from engine_ext.tiny_models import load_state_dict

    model = make_model(tmp_path / "model", "qwen2")
    local = tmp_path / "run"
    http_root = http_server.root / "run"
    bucket = s3_server.make_bucket()
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    synced: set[str] = set()

    def mirror():
        """The trainer's store copied to an HTTP root and an S3 bucket: blobs and manifests first, LATEST last."""
        files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name.startswith("LATEST"), str(p)))
        for p in files:
            key = str(p.relative_to(local))
            if key in synced and not key.startswith("LATEST"):
                continue
            (http_root / key).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, http_root / key)
            s3.put_object(Bucket=bucket, Key=f"run/{key}", Body=p.read_bytes())
            synced.add(key)

    master = {n: t.float() for n, t in load_state_dict(model).items()}
    g = torch.Generator().manual_seed(5)
    pub = DeltaPublisher(str(local), anchor_every=4)  # anchors at v4 and v8: a lagging replica may take one

    def publish_next():
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=g) * 1e-3 * (t.abs().mean() + 1e-3))
        pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})
        pub.wait()
        mirror()

    pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})  # v0: the checkpoint the servers start from
    pub.wait()
    mirror()
    sources = ",".join([str(local), f"{http_server.url}/run", f"s3://{bucket}/run"])
    s3uri = lambda v: f"s3://{bucket}/run/v{v:08d}.json"  # noqa: E731
    servers = {}
    try:
        servers["pull"] = Server(model, sources=sources, base_version=0, log=tmp_path / "pull.log",
                                 env={"ENGINE_EXT_FOLLOW": f"{http_server.url}/run", "ENGINE_EXT_FOLLOW_INTERVAL": "0.5"})
        servers["b"] = Server(model, sources=sources, base_version=0, log=tmp_path / "b.log")
        servers["c"] = Server(model, sources=sources, base_version=0, log=tmp_path / "c.log")
        for v in range(1, 6):  # b is pushed every version; c lags
            publish_next()
            res = Fleet([servers["b"].url], TOKEN).update(s3uri(v))
            assert res.ok, res.table()
        res = Fleet([servers["b"].url, servers["c"].url], TOKEN).update(s3uri(5))  # c: five versions in one push
        assert res.ok, res.table()
        c = next(r for r in res.replicas if r.url == servers["c"].url)
        assert (c.version_before, c.version_after) == (0, 5)
        hist = servers["c"].status()["history"][-1]
        assert hist["base_version"] == 0 and hist["version"] == 5
        assert _wait(lambda: servers["pull"].status()["version"] == 5, 60), servers["pull"].status()["follow"]

        publish_next()  # v6: c is stopped while the push runs
        fleet = Fleet([servers["b"].url, servers["c"].url], TOKEN, retries=2, backoff_s=0.2)
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("res", fleet.update(s3uri(6))))
        th.start()
        servers.pop("c").stop()
        th.join(300)
        res = out["res"]
        assert not res.ok and [r.url for r in res.failed] == [fleet.urls[1]], res.table()
        assert next(r for r in res.replicas if r.url == fleet.urls[0]).version_after == 6

        publish_next()  # v7; c comes back pulling from the local directory, from v0: an anchor or a chain
        publish_next()  # v8 (an anchor)
        servers["c2"] = Server(model, sources=sources, base_version=0, log=tmp_path / "c2.log",
                               env={"ENGINE_EXT_FOLLOW": str(local), "ENGINE_EXT_FOLLOW_INTERVAL": "0.5"})
        assert Fleet([servers["b"].url], TOKEN).update(s3uri(8)).ok
        for name in ("pull", "c2"):
            assert _wait(lambda: servers[name].status()["version"] == 8, 120), servers[name].status()["follow"]
        final_fp = json.loads((local / "v00000008.json").read_text())["fingerprint"]
        follow = servers["pull"].status()["follow"]
        assert follow["lag_versions"] == 0 and follow["failures_in_a_row"] == 0 and follow["updates"] >= 2
        metrics = requests.get(servers["pull"].url + "/metrics", timeout=30).text
        assert "engine_ext_follow_lag_versions 0.0" in metrics and "engine_ext_fetched_bytes_total" in metrics
        outputs = {}
        for name, srv in servers.items():
            assert srv.status()["fingerprint"] == final_fp, name
            outputs[name] = srv.outputs()
    finally:
        for srv in servers.values():
            srv.stop()
        pub.close()
    cold_dir = save_state_dict(tmp_path / "final", {n: t.to(torch.bfloat16) for n, t in master.items()}, model)
    with Server(cold_dir, log=tmp_path / "cold.log") as cold:
        assert cold.status()["fingerprint"] == final_fp
        want = cold.outputs()
    assert all(o == want for o in outputs.values())


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.25)
    return cond()
