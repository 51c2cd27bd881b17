"""The attack suite: every way a hostile store, network or caller tried to make a server serve
weights of their choosing (docs/SECURITY.md), against the real routes.

The routes are vLLM's (``engine_ext.engines.vllm.endpoint``: the same router the plugin attaches)
served by uvicorn on loopback, driving a real :class:`~engine_ext.server.controller.Controller`
over two in-process ranks (``tests/fake_ranks.py``: a tensor-parallel shard and replicated
tensors, one of them 8 M elements so that size bounds are real). Stores are a local
directory and the test HTTP server (redirects, a trickling source). Every refusal asserts
the status and reason, that the served version, fingerprint and every rank's bits are
unchanged, and time or memory bounds where the attack was about them.
``tests/test_vllm_endpoint.py`` repeats the top attacks against a real vLLM server.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from engine_ext.format import fingerprint as fpr
from engine_ext.server.controller import Auth, Controller
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.store.signing import Signer, generate_key
from engine_ext.store.sources import Sources
from engine_ext.engines.vllm.endpoint import EndpointPlugin
from fake_ranks import FakeRanks, bits, make_rank, same_bits  # noqa: E402
from servers import free_port  # noqa: E402

ROUTE = "/update_weights_delta"
TOKEN = os.environ["ENGINE_EXT_TOKEN"]  # conftest: the run's token and signing key
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BIG = (2048, 4096)  # 8 M elements: a decode of every one would take 80 MB


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 16, generator=g).to(torch.bfloat16), "b": torch.randn(16, generator=g).to(torch.bfloat16),
            "big": (torch.randn(BIG, generator=g) * 0.02).to(torch.bfloat16)}


def _step(sd: dict, g: torch.Generator) -> dict:
    out = {}
    for n, t in sd.items():
        x = t.float().clone().reshape(-1)
        k = max(1, x.numel() // 50)
        idx = torch.randint(0, x.numel(), (k,), generator=g)
        x[idx] += 0.05 * (x[idx].abs() + 1e-3)
        out[n] = x.to(torch.bfloat16).reshape(t.shape)
    return out


def _publish(root: Path, states: list[dict], **kw) -> None:
    with DeltaPublisher(str(root), anchor_every=0, **kw) as pub:
        for sd in states:
            pub.publish(sd)


class RouteServer:
    """vLLM's update routes on a real uvicorn server, in a thread of this process."""

    def __init__(self, ctl: Controller, auth: Auth):
        import uvicorn
        from fastapi import FastAPI

        app = FastAPI()
        EndpointPlugin().attach_router(app)
        app.state.engine_ext, app.state.engine_ext_auth = ctl, auth
        self.ctl, self.port = ctl, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        assert self.server.started

    def post(self, body, headers=AUTH, timeout: float = 60) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return requests.post(self.url + ROUTE, data=data, headers=headers, timeout=timeout)

    def get(self, headers=AUTH) -> requests.Response:
        return requests.get(self.url + ROUTE, headers=headers, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory, http_server):
    """Run ``a`` (v0 anchor, v1..v3), served at v3 by two ranks, from a local dir and over HTTP."""
    tmp = tmp_path_factory.mktemp("hostile")
    g = torch.Generator().manual_seed(7)
    states = [_state(0)]
    for _ in range(4):
        states.append(_step(states[-1], g))
    local = tmp / "runs" / "a"
    _publish(local, states[:4])
    http_root = http_server.root / "runs" / "a"
    shutil.copytree(local, http_root)
    ranks = [make_rank(r, states[3], sharded=("w",)) for r in range(2)]
    sources = Sources([str(tmp / "runs"), f"{http_server.url}/runs/a", "s3://bucket/run1"])
    ctl = Controller(FakeRanks(ranks), sources, version=None)
    asyncio.run(ctl.start())
    assert ctl.status()["fingerprint"] == json.loads((local / "v00000003.json").read_text())["fingerprint"]
    ctl.state.version, ctl.state.manifests = 3, (_sha(local / "v00000003.json"),)
    srv = RouteServer(ctl, Auth((TOKEN,)))
    try:
        yield {"tmp": tmp, "local": local, "http": http_server, "states": states, "ranks": ranks, "srv": srv, "ctl": ctl}
    finally:
        srv.stop()


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(w) -> tuple:
    st = w["ctl"].status()
    return st["version"], st["fingerprint"], bits(w["ranks"])


def _unchanged(w, before) -> None:
    after = _snapshot(w)
    assert after[:2] == before[:2], (after[:2], before[:2])
    assert same_bits(before[2], after[2]), "a rank's weights changed"


def _refused(w, r: requests.Response, status: int, reason: str, before) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["ok"] is False and body["reason"] == reason and body["error"], body
    _unchanged(w, before)
    return body


@contextlib.contextmanager
def served_at(w, version: int):
    """Really take the ranks back to ``version`` (an explicit rollback via the anchor), and forward
    to v3 again afterwards: attacks on the step to v3 then meet a real route, not a pretence."""
    srv, local = w["srv"], w["local"]
    target = local / ("v00000000.anchor.json" if version == 0 else f"v{version:08d}.json")
    r = srv.post({"url": str(target), "rollback": True})
    assert r.status_code == 200 and r.json()["version"] == version, r.text
    try:
        yield
    finally:
        r = srv.post({"url": str(local / "v00000003.json")})
        assert r.status_code == 200 and r.json()["version"] == 3, r.text


def _copy_run(w, name: str) -> Path:
    dst = w["tmp"] / "runs" / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(w["local"], dst)
    return dst


# --------------------------------------------------------------------------- sources


@pytest.mark.parametrize("url", ["{http}/runs%2Fa%2Fv00000003.json", "{http}/runs/a%2F..%2Fv00000003.json",
                                 "{http}/runs%5Ca%5Cv00000003.json", "{http}/runs/a/v00000003.json?x=1"])
def test_encoded_separators_refused_before_any_fetch(world, url):
    """The allow-list escape: ``%2F`` made the check and the store split the URL differently."""
    before, http = _snapshot(world), world["http"]
    http.requests.clear()
    r = world["srv"].post({"url": url.format(http=http.url)})
    _refused(world, r, 403, "forbidden_source", before)
    assert http.requests == [], "fetched from a refused source"


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc/runs/a/v1.json", "http://[::1/runs/a/v1.json",
                                 "s3://BUCKET/run1/v00000001.json", "s3://bucket/run1%2F..%2Fx/v1.json", "x" * 5000])
def test_malformed_or_case_folded_sources_are_403(world, url):
    before = _snapshot(world)
    body = _refused(world, world["srv"].post({"url": url}), 403, "forbidden_source", before)
    assert "runs" not in body["error"].replace(url[:150], "")  # the allow-list is not echoed
    assert len(body["error"]) < 400


# --------------------------------------------------------------------------- signatures and binding


def test_unsigned_and_untrusted_deltas_refused_before_blobs(world, tmp_path):
    """The forged-collision attack needed an unsigned delta claiming the genuine fingerprints:
    refused on its signature, before any blob is read."""
    before, http = _snapshot(world), world["http"]
    forged = _copy_run(world, "forged")
    rogue_key = tmp_path / "rogue.key"
    generate_key(rogue_key)
    _publish(forged, [world["states"][3], world["states"][4]], signing_key=str(rogue_key))  # v0 anchor, v1 by a rogue
    # the rogue's delta, renamed v4 and claiming to continue the served v3
    m = json.loads((forged / "v00000001.json").read_text())
    m.update(version=4, base_version=3, anchor_version=0)
    (forged / "v00000004.json").write_text(json.dumps(m))
    Signer(str(rogue_key)).sign_file(forged / "v00000004.json")
    for blob in m["blobs"]:
        shutil.copy(forged / blob["key"], forged / blob["key"].replace("v00000001", "v00000004"))
    body = _refused(world, world["srv"].post({"url": str(forged / "v00000004.json")}), 403, "signature", before)
    assert "not signed by 1 trusted key" in body["error"]
    (forged / "v00000004.json.sig").unlink()  # unsigned altogether
    _refused(world, world["srv"].post({"url": str(forged / "v00000004.json")}), 403, "signature", before)
    assert http.requests == []


def test_mix_and_match_refused_by_base_hash(world):
    """A genuinely signed delta of another run whose base has the very same weights (so the
    fingerprint matches, as a collision would): refused because it names another base manifest."""
    before = _snapshot(world)
    other = world["tmp"] / "runs" / "other"
    _publish(other, world["states"][:5])  # identical weights, published again: other manifest bytes
    assert json.loads((other / "v00000003.json").read_text())["fingerprint"] == before[1]
    body = _refused(world, world["srv"].post({"url": str(other / "v00000004.json")}), 422, "integrity", before)
    assert "not bound" in body["error"]


def test_chain_links_are_bound_by_hash(world):
    """Inside a chain, a link swapped for another run's (same fingerprints, same key) breaks the chain."""
    before = _snapshot(world)
    other = world["tmp"] / "runs" / "other"
    if not other.exists():
        _publish(other, world["states"][:5])
    spliced = _copy_run(world, "spliced")
    for f in ("v00000002.json", "v00000002.json.sig"):
        shutil.copy(other / f, spliced / f)  # ... a chain v2 (foreign) -> v3 (ours)
    for b in json.loads((other / "v00000002.json").read_text())["blobs"]:
        shutil.copy(other / b["key"], spliced / b["key"])
    (spliced / "v00000000.anchor.json").unlink()
    with served_at(world, 1):
        at_v1 = _snapshot(world)
        body = _refused(world, world["srv"].post({"url": str(spliced / "v00000003.json")}), 422, "integrity", at_v1)
        assert "not bound" in body["error"]
    _unchanged(world, before)


# --------------------------------------------------------------------------- bounds


def _rss_peak_during(fn):
    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        out = fn()
    finally:
        done.set()
        th.join()
    return out, time.perf_counter() - t, max(0, peak[0] - base)


def _signed_bomb(w, name: str, tensors: list[dict], blob: bytes, blob_size: int | None = None) -> Path:
    """A trusted-signed manifest (a compromised publisher) whose tiny blob claims huge decodes."""
    import hashlib

    d = _copy_run(w, name)
    served = json.loads((w["local"] / "v00000003.json").read_text())
    (d / "v00000004.0.bin").write_bytes(blob)
    m = {"kind": "delta", "model": "model", "version": 4, "base_version": 3, "anchor_version": 0,
         "fingerprint": "0" * 16, "base_fingerprint": served["fingerprint"], "created_unix": 0.0,
         "base_manifests": [_sha(w["local"] / "v00000003.json")],
         "blobs": [{"key": "v00000004.0.bin", "size": blob_size or len(blob), "sha256": hashlib.sha256(blob).hexdigest()}],
         "tensors": tensors, "format": "engine-ext-delta", "format_version": 2}
    fps = {t["name"]: fpr.parse(t["fingerprint"]) for t in tensors}
    m["fingerprint"] = fpr.fmt(fpr.model_fingerprint(fps))
    m["base_fingerprint"] = fpr.fmt(fpr.model_fingerprint({t["name"]: fpr.parse(t["base_fingerprint"]) for t in tensors}))
    (d / "v00000004.json").write_text(json.dumps(m))
    Signer.from_settings().sign_file(d / "v00000004.json")
    return d / "v00000004.json"


def _entry(name, shape, nnz, fp, base_fp, blob_len, positions, values, mode="rel"):
    import hashlib

    return {"name": name, "dtype": "bfloat16", "shape": list(shape), "nnz": nnz, "fingerprint": fp,
            "base_fingerprint": base_fp, "blob": 0, "offset": 0, "sha256": hashlib.sha256(b"x" * blob_len).hexdigest(),
            "positions": {"coder": positions, "length": 0}, "values": {"coder": values, "length": blob_len, "mode": mode}}


def test_decode_bomb_refused_fast_and_small(world):
    """Every element of the 8 M-element tensor changed, from a 64-byte payload: refused from the
    manifest alone (decoded bytes vs payload), in under a second, with under 100 MB."""
    before = _snapshot(world)
    served = json.loads((world["local"] / "v00000003.json").read_text())
    fps = {t["name"]: t["fingerprint"] for t in served["tensors"]}
    tensors = [_entry("big", BIG, BIG[0] * BIG[1], fps["big"], fps["big"], 64, "all", "zstd")]
    tensors += [{"name": n, "dtype": "bfloat16", "shape": s, "nnz": 0, "fingerprint": fps[n], "base_fingerprint": fps[n],
                 "positions": {"coder": "none", "length": 0}, "values": {"coder": "none", "length": 0}}
                for n, s in (("w", [8, 16]), ("b", [16]))]
    url = _signed_bomb(world, "bomb", tensors, b"x" * 64)
    r, seconds, extra = _rss_peak_during(lambda: world["srv"].post({"url": str(url)}))
    body = _refused(world, r, 400, "bad_manifest", before)
    assert "decode bomb" in body["error"]
    assert seconds < 1.0 and extra < 100 << 20, (seconds, extra)


def test_unknown_tensors_refused_before_any_blob(world):
    """The reviewer's bomb named tensors the model does not have: refused by name, from the manifest."""
    before = _snapshot(world)
    tensors = [_entry("not.in.the.model", [1 << 20], 1 << 20, "0" * 16, "1" * 16, 64, "all", "zstd")]
    url = _signed_bomb(world, "unknown", tensors, b"x" * 64)
    world["http"].requests.clear()
    r, seconds, _ = _rss_peak_during(lambda: world["srv"].post({"url": str(url)}))
    # a tensor the served model does not hold: refused from the target manifest, as a version of
    # another model (409 model_mismatch, naming the tensor), before any route or blob is read
    assert r.status_code == 409 and r.json()["reason"] == "model_mismatch", r.text
    assert "'not.in.the.model'" in r.json()["error"] and "not in the served model" in r.json()["error"]
    _unchanged(world, before)
    assert seconds < 1.0


def test_oversized_manifest_and_payload_refused(world):
    """A 62 MiB manifest (520,000 tensors) and a manifest declaring more payload than twice the
    model: both refused before anything else is read."""
    before = _snapshot(world)
    d = _copy_run(world, "huge")
    filler = {"name": "t", "dtype": "bfloat16", "shape": [1], "nnz": 0, "fingerprint": "0" * 16, "base_fingerprint": "0" * 16}
    big = json.dumps({"kind": "delta", "tensors": [dict(filler, name=f"t{i}") for i in range(520_000)]})
    (d / "v00000004.json").write_text(big)
    Signer.from_settings().sign_file(d / "v00000004.json")
    t = time.perf_counter()
    body = _refused(world, world["srv"].post({"url": str(d / "v00000004.json")}), 502, "fetch", before)
    assert "over the limit" in body["error"] and time.perf_counter() - t < 2
    served = json.loads((world["local"] / "v00000003.json").read_text())
    fps = {x["name"]: x["fingerprint"] for x in served["tensors"]}
    model_bytes = 2 * (8 * 16 + 16 + BIG[0] * BIG[1])
    tensors = [_entry("b", [16], 1, fps["b"], fps["b"], 8, "zstd", "zstd")]
    tensors += [{"name": n, "dtype": "bfloat16", "shape": s, "nnz": 0, "fingerprint": fps[n], "base_fingerprint": fps[n],
                 "positions": {"coder": "none", "length": 0}, "values": {"coder": "none", "length": 0}}
                for n, s in (("w", [8, 16]), ("big", list(BIG)))]
    url = _signed_bomb(world, "payload", tensors, b"x" * 8, blob_size=3 * model_bytes)
    body = _refused(world, world["srv"].post({"url": str(url)}), 400, "bad_manifest", before)
    assert "twice its size" in body["error"]


def test_chain_length_is_bounded(world, monkeypatch):
    from engine_ext.store import route

    before = _snapshot(world)
    d = _copy_run(world, "longchain")
    (d / "v00000000.anchor.json").unlink()
    with served_at(world, 0):
        limits = route.Limits.for_model(world["ctl"].state.tensors)
        monkeypatch.setattr(route.Limits, "for_model", classmethod(lambda cls, tensors: cls(
            limits.manifest_bytes, 2, limits.payload_bytes, limits.decoded_bytes)))
        r = world["srv"].post({"url": str(d / "v00000003.json")})  # v0 -> v3: three links
        monkeypatch.undo()
        assert r.status_code == 409 and "of at most 2 links" in r.json()["error"], r.text
    _unchanged(world, before)


# --------------------------------------------------------------------------- the network and the disk


def test_redirects_out_of_the_store_refused_and_token_kept(world, engine_settings):
    """A redirect to another path of the same host (or another host) is not followed, and the
    store's bearer token never goes there."""
    before, http = _snapshot(world), world["http"]
    engine_settings(http_token="store-secret")
    evil = http.root / "evil"
    evil.mkdir(exist_ok=True)
    http.requests.clear()
    http.redirects["/runs/a/v00000004.json"] = f"{http.url}/evil/v00000004.json"
    try:
        body = _refused(world, world["srv"].post({"url": f"{http.url}/runs/a/v00000004.json"}), 403, "forbidden_source", before)
        assert "redirect out of the store refused" in body["error"]
        http.redirects["/runs/a/v00000004.json"] = "http://169.254.169.254/latest/meta-data"
        _refused(world, world["srv"].post({"url": f"{http.url}/runs/a/v00000004.json"}), 403, "forbidden_source", before)
    finally:
        http.redirects.clear()
    assert [p for _, p, _ in http.requests if not p.startswith("/runs/a/")] == []
    assert all(h.get("Authorization") == "Bearer store-secret" for _, _, h in http.requests)


def test_redirect_inside_the_store_is_followed(world):
    """A redirect that stays below the store's root is an ordinary move: followed (a replay here)."""
    http = world["http"]
    http.redirects["/runs/a/moved.json"] = "/runs/a/v00000003.json"
    http.redirects["/runs/a/moved.json.sig"] = "/runs/a/v00000003.json.sig"
    try:
        r = world["srv"].post({"url": f"{http.url}/runs/a/moved.json"})
    finally:
        http.redirects.clear()
    assert r.status_code == 200 and r.json()["noop"] is True, r.text


@pytest.mark.parametrize("kind", ["symlink_to_dev_zero", "fifo"])
def test_local_store_refuses_links_and_special_files(world, kind):
    """A blob that is a link to /dev/zero used to take 3 GB and 12 s; a FIFO hung the update."""
    before = _snapshot(world)
    d = _copy_run(world, kind)
    target = d / json.loads((world["local"] / "v00000003.json").read_text())["blobs"][0]["key"]
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        os.symlink("/dev/zero", target)
    with served_at(world, 2):
        at_v2 = _snapshot(world)
        r, took, extra = _rss_peak_during(lambda: world["srv"].post({"url": str(d / "v00000003.json")}, timeout=20))
        body = _refused(world, r, 403, "forbidden_source", at_v2)
        assert ("symbolic link" if kind != "fifo" else "not a regular file") in body["error"]
        assert took < 2 and extra < 100 << 20, (took, extra)
    _unchanged(world, before)


def test_slow_source_never_holds_other_updates(world):
    """A source trickling one byte every 0.2 s used to hold the update lock past 60 s: now it gives
    up at the fetch deadline (504) and another update, from another source, is applied meanwhile.

    Only the slow request runs under the short deadline (a transaction reads it when it starts); the
    set-up, the other update and the way back run under the normal one, so a loaded host cannot
    fail them. "Meanwhile" is an order, not a wall time: the other update is answered while the slow
    one is still in flight."""
    from engine_ext import settings

    http = world["http"]
    shutil.copytree(world["local"], http.root / "runs" / "a" / "slow", dirs_exist_ok=True)
    results = {}

    def slow():
        results["slow"] = world["srv"].post({"url": f"{http.url}/runs/a/slow/v00000003.json"}, timeout=60)

    def slow_started() -> bool:
        with http.lock:
            return any("/runs/a/slow/" in path for _, path, _ in http.requests)

    with served_at(world, 2):
        http.requests.clear()
        http.trickle = 0.2
        try:
            with settings.override(fetch_timeout=SLOW_DEADLINE_S):
                th = threading.Thread(target=slow)
                th.start()
                deadline = time.monotonic() + 60
                while not slow_started():  # its transaction has read the short deadline
                    assert time.monotonic() < deadline and th.is_alive(), "the slow update never reached its source"
                    time.sleep(0.02)
            fast = world["srv"].post({"url": str(world["local"] / "v00000003.json")})
            slow_in_flight = th.is_alive()
            th.join(SLOW_DEADLINE_S + 30)
        finally:
            http.trickle = 0.0
        assert fast.status_code == 200 and fast.json()["version"] == 3, fast.text
        assert slow_in_flight, "the other update was answered only after the slow source gave up: it was held"
        r = results["slow"]
        assert r.status_code == 504 and r.json()["reason"] == "fetch_timeout", r.text
        assert world["ctl"].status()["version"] == 3


SLOW_DEADLINE_S = 6.0  # the slow request's fetch deadline: far above what the other update needs on a loaded host


# --------------------------------------------------------------------------- callers


def test_secure_by_default_and_bearer_scheme(world):
    """No token configured and no explicit opening: every request refused (401), GET included.
    With a token: required, the scheme in any case."""
    closed = RouteServer(world["ctl"], Auth())
    try:
        for r in (closed.post({"url": "x"}), closed.get(), closed.post({"url": "x"}, headers={})):
            assert r.status_code == 401 and "no token is configured" in r.json()["error"]
    finally:
        closed.stop()
    srv = world["srv"]
    assert srv.get(headers={}).status_code == 401 and srv.get(headers={"Authorization": "Bearer nope"}).status_code == 401
    assert srv.get(headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    st = srv.get().json()
    assert st["history"] is not None and st["fingerprint"]
    assert srv.post("x" * 100_000).status_code == 400  # oversized body: refused, not parsed


def test_replay_is_a_noop_and_downgrade_needs_rollback(world):
    before = _snapshot(world)
    r = world["srv"].post({"url": str(world["local"] / "v00000003.json")})
    assert r.status_code == 200 and r.json()["noop"] is True and r.json()["payload_bytes"] == 0
    _unchanged(world, before)
    body = _refused(world, world["srv"].post({"url": str(world["local"] / "v00000001.json")}), 409, "downgrade", before)
    assert "rollback" in body["error"]
    r = world["srv"].post({"url": str(world["local"] / "v00000001.json"), "rollback": True})
    assert r.status_code == 200 and r.json()["version"] == 1, r.text  # explicit: via the anchor
    r = world["srv"].post({"url": str(world["local"] / "v00000003.json")})
    assert r.status_code == 200 and r.json()["version"] == 3
    _unchanged(world, before)


def test_wait_queue_is_bounded(world):
    """200 queued ``"wait": true`` requests used to cause 200 pauses: now at most
    ENGINE_EXT_MAX_WAITING + 1 are in flight, the rest get 429.

    The first update's pause holds until every request that was not let in has its 429 (a
    condition, not a pause of 0.5 s that a loaded host could outlast while the 40 requests are
    still arriving, letting a sixth in once the first five were done), so exactly
    ENGINE_EXT_MAX_WAITING + 1 are let in."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    ctl = world["ctl"]
    fake = ctl.ranks
    url = str(world["local"] / "v00000003.json")
    refused = 40 - (ctl.max_waiting + 1)
    with served_at(world, 2):
        fake.gate, fake.calls[:] = threading.Event(), []
        try:
            with ThreadPoolExecutor(40) as pool:
                futures = [pool.submit(world["srv"].post, {"url": url, "wait": True}) for _ in range(40)]
                deadline = time.monotonic() + 120
                while sum(f.done() for f in futures) < refused:
                    assert time.monotonic() < deadline, [f.result().status_code for f in futures if f.done()]
                    time.sleep(0.02)
                assert all(f.result().status_code == 429 for f in futures if f.done())  # only refusals answered so far
                fake.gate.set()
                answers = [f.result() for f in futures]
        finally:
            fake.gate.set()
            fake.gate = None
    codes = [a.status_code for a in answers]
    assert codes.count(429) == refused and set(codes) <= {200, 409, 429}, codes
    assert sum(c.startswith("pause") for c in fake.calls) <= ctl.max_waiting + 1


# --------------------------------------------------------------------------- hygiene


def test_errors_do_not_echo_paths_lists_or_megabytes(world):
    before = _snapshot(world)
    missing = _refused(world, world["srv"].post({"url": str(world["local"] / "v00000099.json")}), 404, "not_found", before)
    assert str(world["tmp"]) not in missing["error"]
    bad_latest = _copy_run(world, "badlatest")
    (bad_latest / "LATEST").write_bytes(b"{" + b"x" * 900_000)
    r = world["srv"].post({"url": str(bad_latest)})
    assert r.status_code in (400, 502) and len(r.text) < 1000, r.text[:300]
    hist = world["srv"].get().json()["history"]
    assert all(len(json.dumps(h)) < 2000 for h in hist)
    _unchanged(world, before)


def test_fetched_parts_dropped_whatever_happens(world):
    """What the ranks fetched for an update is dropped when it fails (on a rank, at verify, at a
    refusal) and when it commits: nothing is held between updates."""
    ctl, fake = world["ctl"], world["ctl"].ranks
    held = lambda: [len(up._fetches) for up in fake.ranks]  # noqa: E731
    with served_at(world, 2):
        fake.fail_rank = 1
        try:
            r = world["srv"].post({"url": str(world["local"] / "v00000003.json")})
        finally:
            fake.fail_rank = None
        assert r.status_code == 500 and r.json()["reason"] == "apply" and held() == [0, 0]
        assert ctl.status()["version"] == 2
        assert fake.calls[-1] == "discard"
        r = world["srv"].post({"url": str(world["local"] / "v00000003.json")})
        assert r.status_code == 200 and r.json()["version"] == 3 and held() == [0, 0], r.text


def test_manifest_keys_are_matched_whole():
    from engine_ext.errors import ManifestError
    from engine_ext.format.latest import Latest

    with pytest.raises(ManifestError):
        Latest.from_json(json.dumps({"version": 1, "manifest": "v00000001.json\n", "fingerprint": "0" * 16}).encode())
    with pytest.raises(ManifestError):
        Latest.from_json(json.dumps({"version": 1, "manifest": "../v1.json", "fingerprint": "0" * 16}).encode())
