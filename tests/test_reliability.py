"""Nothing lost when trainers fail: restarts resume, racing publishers conflict, LATEST stays fresh.

Real stores (a local directory, moto_server's S3 on loopback), real publisher processes
for the race. Every test checks the same invariant: no object the store published ever
changes its bytes, and what a reader can reach is a verified chain. The server-side
faults (store outages, killed servers, rank faults) are in tests/test_vllm_faults.py,
tests/test_vllm_tp2.py and tests/test_sglang_tp.py; docs/RELIABILITY.md lists them all.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from engine_ext.format import fingerprint as fpr
from engine_ext.store import decoding, reader, route
from engine_ext.errors import ConflictError, IntegrityError
from engine_ext.format.latest import LATEST_KEY
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.store.signing import SignatureError, Trust
from engine_ext.trainer import lineage
from engine_ext.store import open_store

from support.synthetic import AdamRL, llm_shapes  # tests/support (tests/ is on sys.path: conftest.py)

REPO = str(Path(__file__).resolve().parents[1])
SHAPES = llm_shapes(hidden=64, layers=2, vocab=512, inter=128, kv=32)


@pytest.fixture(scope="module")
def states():
    tr = AdamRL(SHAPES, lr=1e-5, seed=0)
    return [tr.weights()] + [tr.step() for _ in range(5)]


def model_fp(sd: dict) -> int:
    return fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in sd.items()})


def objects(store) -> dict[str, str]:
    """SHA-256 of every object but LATEST (the one pointer that moves)."""
    return {k: hashlib.sha256(store.read(k)).hexdigest() for k in store.list() if k != LATEST_KEY}


def assert_unchanged(before: dict, store) -> None:
    after = objects(store)
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert not changed, f"published objects changed or vanished: {changed}"


def rebuilt(root: str) -> dict:
    """What a fresh reader gets from the store's LATEST (anchor + chain, all verified)."""
    d = route.resolve(root, bases=decoding.TensorBases({}))
    assert d.kind == "anchor"
    out = {}
    for t in d.tensors:
        from engine_ext.format.delta import apply_tensor

        out[t.name] = apply_tensor(None, t)
    return out


def equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)), n


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/run"
    return str(tmp_path / "run")


def test_a_restarted_trainer_resumes_after_latest_with_a_delta(root, states):
    with DeltaPublisher(root, anchor_every=0) as pub:
        for sd in states[:3]:
            pub.publish(sd)
    store = open_store(root)
    published = objects(store)

    pub = DeltaPublisher(root, anchor_every=0)  # the trainer restarts from its v2 checkpoint
    assert (pub.head.latest.version, pub.next_version) == (2, 3)
    uri = pub.publish(states[3])
    assert uri == store.key_uri("v00000003.json")
    assert (pub.resumed.latest_version, pub.resumed.first_version, pub.resumed.kind) == (2, 3, "delta"), pub.resumed
    pub.publish(states[4])
    pub.close()
    assert_unchanged(published, store)
    assert not store.exists("v00000003.anchor.json")  # a delta, not a second full copy
    d = route.resolve(root, have_version=2, have_fingerprint=model_fp(states[2]), bases=decoding.TensorBases(states[2]))
    assert [m.rsplit("/", 1)[-1] for m in d.manifests] == ["v00000003.json", "v00000004.json"]  # a follower at v2 takes the chain
    equal(rebuilt(root), states[4])


def test_a_restart_at_an_anchored_version_resumes_with_a_delta(root, states):
    """LATEST names the delta of a version that was also anchored (``vN.json`` beside
    ``vN.anchor.json``, both of vN's weights): the anchor alone rebuilds LATEST, a zero-link
    chain. (This once failed as "no chain ... leads from v2.anchor.json to v2.json", so every
    such restart paid a needless anchor, and the chaos soak's final rebuild failed.)"""
    with DeltaPublisher(root, anchor_every=2) as pub:
        for sd in states[:3]:
            pub.publish(sd)
    store = open_store(root)
    assert reader.read_latest(store).manifest == "v00000002.json"
    assert store.exists("v00000002.anchor.json")
    with DeltaPublisher(root, anchor_every=2) as pub:
        pub.publish(states[3])
    assert (pub.resumed.latest_version, pub.resumed.first_version, pub.resumed.kind) == (2, 3, "delta"), pub.resumed
    assert not store.exists("v00000003.anchor.json")
    equal(rebuilt(root), states[3])


def test_an_anchor_with_other_weights_at_latest_s_version_is_refused(tmp_path, states):
    """The anchor a delta names at its own version must hold the same weights. One that does
    not (a rival's anchor copied over by hand: the claim guards only publishers) is an
    integrity error for a reader's route and for a restarted trainer's rebuild alike, never
    served as LATEST's weights."""
    root, rival = str(tmp_path / "run"), str(tmp_path / "rival")
    for where, versions in ((root, states[:3]), (rival, [states[0], states[1], states[4]])):
        with DeltaPublisher(where, anchor_every=2) as pub:
            for sd in versions:
                pub.publish(sd)
    store, other = open_store(root), open_store(rival)
    for key in other.list("v00000002.anchor"):
        store.write(key, other.read(key))
    with pytest.raises(IntegrityError, match="does not hold the weights of v00000002.json"):
        route.resolve(root, bases=decoding.TensorBases({}))
    with pytest.raises(IntegrityError, match="does not hold the weights of v00000002.json"):
        lineage.rebuild(store, reader.read_latest(store), Trust.from_settings())


def test_resume_falls_back_to_an_anchor_and_versions_only_grow(tmp_path, states):
    root = str(tmp_path / "run")
    with DeltaPublisher(root, anchor_every=0) as pub:
        for sd in states[:2]:
            pub.publish(sd)
    store = open_store(root)
    with pytest.raises(ValueError, match="version numbers only grow"):
        DeltaPublisher(root, start_version=1)
    other = {**states[2], "extra.weight": torch.zeros(4, dtype=torch.bfloat16)}  # a new run: other tensors
    with pytest.raises(ValueError, match="cannot resume .* with a delta against v1"):
        DeltaPublisher(root, resume="delta").publish(other)
    # a publisher that crashed after writing v2's blob (never its manifest) burnt v2
    blob = store.list("v00000001.0.")[0]
    store.create("v00000002.0.deadbeef.bin", store.read(blob))
    published = objects(store)
    with DeltaPublisher(root, anchor_every=0) as pub:
        assert pub.next_version == 3
        pub.publish(other)
    assert pub.resumed.kind == "anchor" and "differ" in pub.resumed.reason, pub.resumed
    assert store.exists("v00000003.anchor.json")
    assert_unchanged(published, store)
    equal(rebuilt(root), other)
    with DeltaPublisher(root, anchor_every=0, resume="anchor") as pub:
        pub.publish(other)
    assert (pub.resumed.kind, pub.resumed.first_version) == ("anchor", 4)


def test_a_version_that_fails_to_upload_restarts_the_chain_with_an_anchor(tmp_path, states):
    """A store that refuses writes for a while (disk full, an outage): the failure is raised once, no
    version is ever a delta against one that was not published, and the next version is an anchor
    that a fresh reader rebuilds bit for bit."""
    from engine_ext.store.local import LocalStore

    class Flaky(LocalStore):
        down = False

        def create_file(self, key, path):
            if self.down:
                raise OSError(28, "No space left on device")
            return super().create_file(key, path)

    root = str(tmp_path / "run")
    store = Flaky(root)
    pub = DeltaPublisher(store, anchor_every=0)
    pub.publish(states[0])
    pub.publish(states[1])
    pub.wait()
    store.down = True
    raised = []
    for call in (lambda: pub.publish(states[2]), lambda: pub.publish(states[3]), pub.wait):
        try:  # v2 fails in the background; v3, queued behind it, is skipped (or refused: the error came first)
            call()
        except RuntimeError as e:
            raised.append(str(e))
    assert len(raised) == 1 and "No space left" in raised[0], raised  # raised once
    store.down = False
    published = objects(store)
    uri = pub.publish(states[4])
    pub.close()
    assert uri.endswith(".anchor.json"), uri  # not a delta against the unpublished version
    assert_unchanged(published, store)
    latest = reader.read_latest(store)
    assert latest.version == pub.version and latest.anchor_version == pub.version
    equal(rebuilt(root), states[4])
    for key in store.list("v"):  # every delta on the store names a base that was published
        if key.endswith(".json") and ".anchor." not in key:
            m = reader.read_manifest(store, key)
            assert store.exists(f"v{m.base_version:08d}.json") or store.exists(f"v{m.base_version:08d}.anchor.json"), key


RACER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from engine_ext.errors import ConflictError, IntegrityError
    from engine_ext.trainer.publisher import DeltaPublisher
    root, me, barrier = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    g = torch.Generator().manual_seed(me)
    sd = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16)}
    pub = DeltaPublisher(root, anchor_every=0, workers=1)  # both read the same (empty) store first
    open(f"{barrier}.{me}", "w").close()
    while not all(os.path.exists(f"{barrier}.{i}") for i in (0, 1)):
        time.sleep(0.01)
    done, error, stopped = [], None, None
    try:
        for _ in range(4):
            sd = {"w": (sd["w"].float() + 0.05 * torch.randn(64, 64, generator=g)).to(torch.bfloat16)}
            pub.publish(sd)
            pub.wait()
            done.append(pub.version)
    except ConflictError as e:
        error = str(e)
        try:  # a publisher that lost the store stays stopped: it never publishes again
            pub.publish(sd)
        except ConflictError:
            stopped = True
    print(json.dumps({"done": done, "error": error, "stopped": stopped}))
""")


def test_two_racing_publishers_never_overwrite_each_other(root, tmp_path, s3_server):
    """Two trainer processes publish to one store from the same starting point: each version is
    won by one of them; the other stops with an error naming the version and the store; no
    published object ever changes its bytes (watched while they run) and LATEST stays a
    verified chain."""
    store = open_store(root)
    seen: dict[str, str] = {}
    changed: list[str] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for k, sha in objects(store).items():
                if seen.setdefault(k, sha) != sha:
                    changed.append(k)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = {**os.environ, **s3_server.env, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, root, str(i), str(tmp_path / "barrier")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(__import__("json").loads(out.strip().splitlines()[-1]))
    stop.set()
    watcher.join()
    assert not changed, f"objects rewritten while the publishers raced: {changed}"
    losers = [r for r in results if r["error"]]
    assert losers, results  # both started from an empty store: both wanted v0
    for r in losers:
        assert "cannot be published to" in r["error"] and store.uri in r["error"], r["error"]
        assert r["stopped"], r
    won = [v for r in results for v in r["done"]]
    assert len(won) == len(set(won)), results  # no version published twice
    latest = reader.read_latest(store)
    assert latest.version == max(won)
    route.resolve(root, bases=decoding.TensorBases({}))  # the chain LATEST names verifies link by link


def test_latest_is_re_signed_while_the_publisher_lives(tmp_path, states):
    root = str(tmp_path / "run")
    store = open_store(root)
    pub = DeltaPublisher(root, anchor_every=0, latest_ttl_s=1.2)
    pub.publish(states[0])
    pub.wait()
    first = reader.read_latest(store).expires_unix
    time.sleep(2.0)  # longer than the TTL: only the heartbeat keeps it valid
    assert reader.read_latest(store).expires_unix > first
    # another publisher takes the store over: the first one's heartbeat stops, LATEST is not moved back
    with DeltaPublisher(root, anchor_every=0, latest_ttl_s=1.2) as other:
        other.publish(states[1])
    assert not pub.refresh_latest(force=True)
    assert reader.read_latest(store, allow_expired=True).version == 1
    pub.close()
    time.sleep(1.5)
    with pytest.raises(SignatureError, match="expired"):  # nobody publishes: a frozen store goes stale
        reader.read_latest(store)
    with pytest.raises(ConflictError):
        store.create("v00000001.json", b"{}")
