"""Signed versions: what the publisher writes and what a reader accepts (engine_ext.store.signing,
the format-2 manifest fields, route.plan's binding)."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from engine_ext.store import reader, route
from engine_ext.format.latest import Latest
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.store.signing import SignatureError, Signer, Trust, generate_key
from engine_ext.store import open_store


@pytest.fixture
def keys(tmp_path):
    for name in ("a", "b", "c"):
        generate_key(tmp_path / f"{name}.key")
    return tmp_path


def _states(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    s = {"w": torch.randn(64, 8, generator=g).to(torch.bfloat16)}
    out = [s]
    for _ in range(n - 1):
        w = out[-1]["w"].float().clone()
        w[torch.randint(0, 64, (4,), generator=g)] += 0.1
        out.append({"w": w.to(torch.bfloat16)})
    return out


def test_publisher_signs_manifests_and_latest_and_binds_each_base(tmp_path, keys):
    store = tmp_path / "run"
    with DeltaPublisher(str(store), anchor_every=2, signing_key=str(keys / "a.key")) as pub:
        for s in _states(4):
            pub.publish(s)
    trust = Trust.from_public_keys([str(keys / "a.key.pub")])
    st = open_store(str(store))
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in store.glob("*.json")}
    for name in sha:
        assert (store / f"{name}.sig").exists() and reader.read_link(st, name, trust).signed == 1
    # each delta names every manifest of its base version (delta and anchor alike)
    m3 = json.loads((store / "v00000003.json").read_text())
    assert sorted(m3["base_manifests"]) == sorted([sha["v00000002.json"], sha["v00000002.anchor.json"]])
    assert json.loads((store / "v00000001.json").read_text())["base_manifests"] == [sha["v00000000.anchor.json"]]
    latest = reader.read_latest(st, trust)
    assert latest.version == 3 and latest.sha256 == sha["v00000003.json"] and latest.expires_unix > time.time()
    # a route read through the signed LATEST
    chain = route.plan(str(store), 1, None, trust=trust).links
    assert [link.key for link in chain] == ["v00000002.json", "v00000003.json"]


def test_reader_refuses_untrusted_unsigned_and_tampered(tmp_path, keys):
    store = tmp_path / "run"
    with DeltaPublisher(str(store), anchor_every=0, signing_key=str(keys / "a.key")) as pub:
        for s in _states(2):
            pub.publish(s)
    st = open_store(str(store))
    good = Trust.from_public_keys([str(keys / "a.key.pub")])
    with pytest.raises(SignatureError, match="not signed by 1 trusted key"):
        reader.read_link(st, "v00000001.json", Trust.from_public_keys([str(keys / "b.key.pub")]))
    with pytest.raises(SignatureError, match="no trusted keys configured"):
        reader.read_link(st, "v00000001.json", Trust())
    assert reader.read_link(st, "v00000001.json", Trust(allow_unsigned=True)).signed == 0  # explicit opt-out
    raw = (store / "v00000001.json").read_bytes()
    (store / "v00000001.json").write_bytes(raw.replace(b'"model"', b'"modeL"', 1))
    with pytest.raises(SignatureError):
        reader.read_link(st, "v00000001.json", good)
    (store / "v00000001.json").write_bytes(raw)
    (store / "v00000001.json.sig").write_text("{not json")
    with pytest.raises(SignatureError, match="malformed"):
        reader.read_link(st, "v00000001.json", good)


def test_threshold_of_distinct_keys(tmp_path, keys):
    data = b"manifest bytes"
    two = Signer([str(keys / "a.key"), str(keys / "b.key")]).sign_detached(data)
    one = Signer(str(keys / "a.key")).sign_detached(data)
    trust = Trust.from_public_keys([str(keys / f"{n}.key.pub") for n in "abc"], threshold=2)
    assert trust.verify_detached(data, two, "x") == 2
    with pytest.raises(SignatureError, match="not signed by 2"):
        trust.verify_detached(data, one, "x")
    doubled = json.dumps({"signatures": json.loads(one)["signatures"] * 2}).encode()  # the same key twice counts once
    with pytest.raises(SignatureError):
        trust.verify_detached(data, doubled, "x")
    with pytest.raises(ValueError):
        Trust.from_public_keys([str(keys / "a.key.pub")], threshold=2)


def test_latest_expiry_and_binding(tmp_path, keys):
    store = tmp_path / "run"
    signer = Signer(str(keys / "a.key"))
    with DeltaPublisher(str(store), anchor_every=0, signing_key=str(keys / "a.key")) as pub:
        for s in _states(3):
            pub.publish(s)
    st, trust = open_store(str(store)), Trust.from_public_keys([str(keys / "a.key.pub")])
    latest, _ = Latest.from_json((store / "LATEST").read_bytes())

    def rewrite(**changes):
        lt = Latest(**{**latest.__dict__, **changes})
        (store / "LATEST").write_bytes(lt.to_json(signer.signatures(lt.signed_bytes())))

    rewrite(expires_unix=time.time() - 1)  # a frozen pointer, genuinely signed, but stale
    with pytest.raises(SignatureError, match="expired"):
        reader.read_latest(st, trust)
    rewrite(manifest="v00000001.json")  # an old manifest under the newest pointer's hash
    with pytest.raises(Exception, match="not the manifest LATEST names"):
        route.plan(str(store), 0, None, trust=trust)
    (store / "LATEST").write_bytes(Latest(**latest.__dict__).to_json())  # unsigned
    with pytest.raises(SignatureError):
        reader.read_latest(st, trust)


def test_format_1_stores_need_the_explicit_opt_out(tmp_path):
    """A store written before signing (format 1, no base hashes) is read only with ALLOW_UNSIGNED."""
    store = tmp_path / "old"
    with DeltaPublisher(str(store), anchor_every=0, signing_key=None) as pub:
        pub.signer = None
        for s in _states(2):
            pub.publish(s)
    for p in store.glob("*.json"):
        m = json.loads(p.read_text())
        m["format_version"], m["base_manifests"] = 1, []
        m.pop("base_manifests")
        for b in m["blobs"]:  # format 1 knew flat blob digests only (an anchor's is a pieces digest from format 8)
            if b.pop("digest", None):
                b["sha256"] = hashlib.sha256((store / b["key"]).read_bytes()).hexdigest()
        p.write_text(json.dumps(m))
    st = open_store(str(store))
    with pytest.raises(SignatureError):
        reader.read_link(st, "v00000001.json", Trust.from_public_keys([]))
    link = reader.read_link(st, "v00000001.json", Trust(allow_unsigned=True))
    assert link.manifest.format_version == 1 and link.signed == 0
    chain = route.plan(str(Path(store) / "v00000001.json"), 0, None, trust=Trust(allow_unsigned=True)).links
    assert [x.key for x in chain] == ["v00000001.json"]
