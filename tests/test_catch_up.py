"""Catch-up deltas (format 11): composed from a real local store's signed deltas, found by the route
planner in O(log k) links, applied bit-exact by in-process ranks through the real controller (with a
rollback after a failed apply), and refused where a store lies about them."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from fake_ranks import FakeRanks, bits, make_rank, same_bits

from engine_ext import settings
from engine_ext.errors import IntegrityError, ManifestError
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import as_bits
from engine_ext.format.manifest import CATCH_UP, Manifest, catch_up_key, manifest_key
from engine_ext.server.controller import Controller
from engine_ext.server.protocol import UpdateRequest
from engine_ext.store import open_store, route
from engine_ext.store.signing import Signer, Trust
from engine_ext.store.sources import Sources
from engine_ext.trainer import catch_up
from engine_ext.trainer.catch_up import check_spans, publish_catch_ups
from engine_ext.trainer.publisher import DeltaPublisher

V1_CODING = {"reader_mbps": 100.0}  # the deployed default (the suite codes v2 wherever it saves 10 %)


def _run(root, versions: int, spans=(2, 4, 8), seed: int = 0, **publisher) -> list[dict]:
    """``versions`` versions of ``w`` (8x16, the shape the fake ranks shard) and ``b`` (16), each step
    moving a few elements a little, published with catch-ups of ``spans``; every version's state."""
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(8, 16, generator=g).to(torch.bfloat16), "b": torch.randn(16, generator=g).to(torch.bfloat16)}
    out = []
    with DeltaPublisher(str(root), anchor_every=0, catch_up_spans=spans, **publisher) as pub:
        for v in range(versions):
            if v:
                state = {
                    n: torch.where(torch.rand(t.shape, generator=g) < 0.3, (t.float() * 1.01).to(t.dtype), t)
                    for n, t in state.items()
                }
            pub.publish({n: t.clone() for n, t in state.items()})
            out.append({n: t.clone() for n, t in state.items()})
        pub.wait()
        out.append(pub.catch_ups)  # last: what the publisher's catch-ups did
    return out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(as_bits(a[n]), as_bits(b[n])) for n in b)


def test_a_lagging_reader_takes_log_k_links_and_lands_bit_exact(tmp_path, monkeypatch):
    """Composed a tensor at a time (the batch bound at its least), every route lands on v16's bits."""
    monkeypatch.setattr(catch_up, "BATCH_CHANGES", 1)
    with settings.override(**V1_CODING):
        *versions, done = _run(tmp_path / "s", 17, spans=(2, 4, 8, 16))
    published = {(c.base_version, c.version) for c in done if c.key}
    assert {(0, 16), (8, 16), (12, 16), (14, 16), (0, 8)} <= published, done
    assert all(c.payload_bytes < c.parts_bytes for c in done if c.key)
    target = str(tmp_path / "s" / manifest_key(16))
    for held in (0, 1, 3, 7, 8, 13, 15):
        r = route.plan(target, held, None)
        keys = [link.key for link in r.links]
        chain = route.chain_back(r.store, r.target, held, lambda k: route.read_link(r.store, k), 64)
        assert sum(lk.manifest.payload_bytes for lk in r.links) <= sum(lk.manifest.payload_bytes for lk in chain)
        assert len(keys) <= 2 * (16 - held).bit_length(), keys
        got = dict(versions[held])
        for td in route.fetch_planned(r.store, r.links).tensors:
            got[td.name] = apply_tensor(got[td.name], td, check=False)
        assert _same(got, versions[16]), (held, keys)
    assert [lk.key for lk in route.plan(target, 0, None).links] == [catch_up_key(0, 16)]
    assert [lk.key for lk in route.plan(target, 3, None).links] == [
        manifest_key(4), catch_up_key(4, 8), catch_up_key(8, 16)]


def test_the_controller_commits_the_manifest_a_catch_up_stands_for_and_rolls_back_a_failed_apply(tmp_path):
    """Two in-process ranks at v0 take v8 in one catch-up; the state then binds to v8's own manifest, so
    v9's delta follows. A rank failing the apply of a catch-up rolls every rank back to v0's bits. Published
    in tables (format 10's name index, as a big model's are), so each rank reads only its own entries."""
    store = tmp_path / "s"
    with settings.override(inline_entries=1, **V1_CODING):
        *versions, _ = _run(store, 10)
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    failing = Controller(FakeRanks(ranks, fail_rank=1), Sources([str(store)]), version=0)
    asyncio.run(failing.start())
    before = bits(ranks)
    with pytest.raises(Exception, match="injected kernel failure"):
        asyncio.run(failing.update(UpdateRequest.parse({"url": str(store / manifest_key(8))})))
    assert same_bits(before, bits(ranks)) and failing.status()["version"] == 0
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(store / manifest_key(8))})))
    assert [m.rsplit("/", 1)[-1] for m in a["manifests"]] == [catch_up_key(0, 8)]
    assert Manifest.from_json((store / catch_up_key(0, 8)).read_bytes()).index is not None  # in tables
    own = route.read_link(open_store(str(store)), manifest_key(8)).sha256
    assert ctl.state.manifests == (own,)
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(store / manifest_key(9))})))
    assert a["version"] == 9 and [m.rsplit("/", 1)[-1] for m in a["manifests"]] == [manifest_key(9)]
    for up in ranks:
        assert torch.equal(up.module.w.view(torch.int16), versions[9]["w"][up.rank * 4 : (up.rank + 1) * 4].view(torch.int16))
        assert torch.equal(up.module.b.view(torch.int16), versions[9]["b"].view(torch.int16))


def _ulp_steps(old: torch.Tensor, seed: int) -> torch.Tensor:
    """``old`` with about 2 % of its elements one ULP away, small weights more often (as in training: the
    context coder pays on such a tensor)."""
    g = torch.Generator().manual_seed(seed)
    rate = (2e-4 / old.float().abs().clamp(min=1e-4)).clamp(max=0.9)
    bits = as_bits(old).clone()
    chg = torch.rand(old.shape, generator=g) < rate
    bits[chg] += torch.where(torch.rand(old.shape, generator=g) < 0.5, 1, -1)[chg].to(bits.dtype)
    return bits.view(old.dtype)


def test_composing_without_weights_skips_what_needs_them_and_readers_take_the_chain(tmp_path):
    """``engine-ext compact``'s path (no weights): a context-coded link, or a tensor whose composite mixes
    absolute values and relative steps, gets no catch-up, with the reason; the chain still serves. Given
    the version's bits (a publisher's), the mixed tensor is coded as its new bits and lands exact."""
    from safetensors.torch import save_file

    from engine_ext.cli import main

    trust, signer = Trust.from_settings(), Signer.from_settings()
    g = torch.Generator().manual_seed(0)
    w0 = (0.02 * torch.randn(256, 256, generator=g) * torch.exp(torch.randn(256, 256, generator=g))).to(torch.bfloat16)
    states = [{"w": w0}]
    for seed in (1, 2):
        states.append({"w": _ulp_steps(states[-1]["w"], seed)})
    with settings.override(reader_mbps=0.0), DeltaPublisher(str(tmp_path / "ctx"), anchor_every=0) as pub:
        for sd in states:  # bytes first: the context coder wherever it saves 10 %
            pub.publish(sd)
    s = open_store(str(tmp_path / "ctx"))
    assert route.read_link(s, manifest_key(1)).manifest.step_tables
    (c,) = publish_catch_ups(s, 2, (2,), trust=trust, signer=signer)
    assert c.key is None and "context coded" in c.skipped and not s.exists(catch_up_key(0, 2))

    # the mixed case: v2 moves v1's elements again and 64 more, so all-absolute over the union still pays
    moved = as_bits(states[1]["w"]) != as_bits(states[0]["w"])
    moved.view(-1)[torch.nonzero(~moved.view(-1))[:64, 0]] = True
    again = as_bits(states[1]["w"]).clone()
    again[moved] += 1
    states[2] = {"w": again.view(torch.bfloat16)}
    dirs = []
    for v, sd in enumerate(states):
        d = tmp_path / f"ckpt{v}"
        d.mkdir()
        save_file(sd, str(d / "model.safetensors"))
        dirs.append(str(d))
    store = str(tmp_path / "mix")
    assert main(["anchor", dirs[0], "--out", store]) == 0
    with settings.override(**V1_CODING):  # v1 codes absolute values, v2 relative steps
        assert main(["diff", dirs[0], dirs[1], "--out", store, "--mode", "abs"]) == 0
        assert main(["diff", dirs[1], dirs[2], "--out", store, "--mode", "rel"]) == 0
    s = open_store(store)
    (c,) = publish_catch_ups(s, 2, (2,), trust=trust, signer=signer)
    assert c.key is None and "absolute values beside relative steps" in c.skipped, c
    assert [lk.key for lk in route.plan(f"{store}/{manifest_key(2)}", 0, None).links] == [manifest_key(1), manifest_key(2)]
    final = as_bits(states[2]["w"]).reshape(-1)
    (c,) = publish_catch_ups(s, 2, (2,), trust=trust, signer=signer, new_bits=lambda name, pos: final[pos])
    assert c.key == catch_up_key(0, 2) and c.payload_bytes < c.parts_bytes, c
    r = route.plan(f"{store}/{manifest_key(2)}", 0, None)
    assert [lk.key for lk in r.links] == [catch_up_key(0, 2)]
    (td,) = route.fetch_planned(r.store, r.links).tensors
    assert torch.equal(as_bits(apply_tensor(states[0]["w"], td)), as_bits(states[2]["w"]))
    with pytest.raises(ValueError, match="powers of two"):
        check_spans([3])
    from engine_ext.trainer.sharded import ShardedPublisher

    with pytest.raises(ValueError, match="engine-ext compact"):  # one process, no group: it never gets that far
        ShardedPublisher(str(tmp_path / "sharded"), catch_up_spans=(4,))
    with settings.override(**V1_CODING), DeltaPublisher(str(tmp_path / "late"), anchor_every=0, start_version=3) as pub:
        for sd in states[:2]:  # v3 (an anchor), v4: no delta from v2
            pub.publish(sd)
    (c,) = publish_catch_ups(open_store(str(tmp_path / "late")), 4, (2,), trust=trust, signer=signer)
    assert c.key is None and "no chain" in c.skipped, c


def _forge(root, key: str, edit, signer: Signer) -> None:
    """Rewrite the manifest at ``key`` with ``edit(dict)`` and sign it with the run's own key: a compromised
    or buggy compactor, which the signature cannot catch; the route's bindings must."""
    d = json.loads((root / key).read_bytes())
    edit(d)
    raw = json.dumps(d, indent=1).encode()
    (root / key).write_bytes(raw)
    (root / (key + ".sig")).write_bytes(signer.sign_detached(raw))


def test_a_store_that_lies_about_catch_ups_is_refused(tmp_path):
    root = tmp_path / "s"
    with settings.override(**V1_CODING):
        _run(root, 9)
    signer = Signer.from_settings()
    target = str(root / manifest_key(8))
    good = tmp_path / "good"
    shutil.copytree(root, good)

    # a bit flipped in a catch-up: its signature fails before it is parsed
    raw = bytearray((root / catch_up_key(0, 8)).read_bytes())
    raw[raw.index(b'"version"') + 12] ^= 1
    (root / catch_up_key(0, 8)).write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        route.plan(target, 0, None)

    # a signed catch-up that stands for another manifest than the target's own
    shutil.rmtree(root)
    shutil.copytree(good, root)
    _forge(root, catch_up_key(0, 8), lambda d: d.update(stands_for="ab" * 32), signer)
    with pytest.raises(IntegrityError, match="does not stand for"):
        route.plan(target, 0, None)

    # a catch-up moved under another span's key (v4 -> v8 served as v0 -> v8)
    shutil.rmtree(root)
    shutil.copytree(good, root)
    for suffix in ("", ".sig"):
        shutil.copy(root / (catch_up_key(4, 8) + suffix), root / (catch_up_key(0, 8) + suffix))
    with pytest.raises(IntegrityError, match="holds the manifest of"):
        route.plan(target, 0, None)

    # a catch-up not bound to the manifest the reader holds
    shutil.rmtree(root)
    shutil.copytree(good, root)
    held = route.read_link(open_store(str(root)), manifest_key(4)).sha256
    with pytest.raises(IntegrityError, match="not bound"):
        route.plan(target, 4, None, have_manifests=("cd" * 32,))
    assert route.plan(target, 4, None, have_manifests=(held,)).links[0].key == catch_up_key(4, 8)

    # the field is format 11's, and only a delta's
    m = Manifest.from_json((good / catch_up_key(0, 8)).read_bytes())
    assert m.format_version == CATCH_UP and m.stands_for
    for bad in ({"format_version": 10}, {"kind": "anchor"}, {"stands_for": "not a sha"}):
        d = json.loads((good / catch_up_key(0, 8)).read_bytes()) | bad
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(d).encode())
