"""The update transaction, its controller and the per-rank updater, without an engine.

Two "ranks" are plain torch modules whose loader keeps half of the rows of ``w``
(a tensor-parallel shard) and a full copy of ``b``; the controller talks to them
through a tiny in-process :class:`~engine_ext.server.transaction.Ranks` that passes every
reply through the wire format, as the engine adapters do. Stores are real local stores written by
the publisher. What no engine is needed for is tested here; the same code runs
inside real vLLM servers in tests/test_vllm_*.py.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading

import pytest
import torch

from engine_ext.errors import BaseMismatchError, ForbiddenSourceError, VerifyError
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.server.controller import Auth, Busy, Controller, Unauthorized, error_answer
from engine_ext.settings import Settings
from fake_ranks import FakeRanks, bits, make_rank, same_bits  # noqa: E402
from engine_ext.server.protocol import RankReply, RequestError, TensorReport, UpdateRequest
from engine_ext.server.rank import RankUpdater, run_op
from engine_ext.format import fingerprint as fpr
from engine_ext.store.sources import Sources
from engine_ext.server.transaction import combine_fingerprints

parse_request = UpdateRequest.parse

# ---------------------------------------------------------------- sources, requests, tokens


def test_sources_local(tmp_path):
    root = tmp_path / "store"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "store2").mkdir()
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "link")
    s = Sources([str(root)])
    assert s.check(str(root / "sub" / "v1.json")) == str(root / "sub" / "v1.json")
    assert s.check(f"file://{root}/v1.json") == str(root / "v1.json")
    for bad in (str(tmp_path / "store2" / "v1.json"), f"{root}/../secret/v1.json", str(root / "link" / "v1.json"),
                "/etc/passwd", "", "relative/v1.json"):
        with pytest.raises(ForbiddenSourceError):
            s.check(bad)
    with pytest.raises(ForbiddenSourceError, match="ENGINE_EXT_SOURCES"):
        Sources([]).check(str(root / "v1.json"))


def test_sources_remote():
    s = Sources(["s3://bucket/run1", "http://127.0.0.1:9000/stores/a/"])
    assert s.check("s3://bucket/run1/v00000001.json") == "s3://bucket/run1/v00000001.json"
    assert s.check("http://127.0.0.1:9000/stores/a/v1.json") == "http://127.0.0.1:9000/stores/a/v1.json"
    for bad in ("s3://bucket/run10/v1.json", "s3://bucket/run1/../run2/v1.json", "s3://bucket/run1/%2e%2e/x/v1.json",
                "s3://other/run1/v1.json", "http://127.0.0.1:9001/stores/a/v1.json", "https://127.0.0.1:9000/stores/a/v1.json",
                "http://user:pw@127.0.0.1:9000/stores/a/v1.json", "http://169.254.169.254/latest/meta-data"):
        with pytest.raises(ForbiddenSourceError):
            s.check(bad)


def test_parse_request():
    assert parse_request(b'{"url": "s3://b/v1.json"}').url == "s3://b/v1.json"
    r = parse_request({"url": "x", "base_version": 3, "pause_mode": "wait", "wait": True})
    assert (r.base_version, r.pause_mode, r.wait) == (3, "wait", True)
    for bad in (b"", b"{", b"[]", b'"x"', b"{}", b'{"url": ""}', b'{"url": 1}', b'{"url": "x", "base_version": "1"}',
                b'{"url": "x", "base_version": true}', b'{"url": "x", "pause_mode": "now"}', b'{"url": "x", "extra": 1}',
                b"\xff\xfe"):
        with pytest.raises(RequestError):
            parse_request(bad)
    assert error_answer(RequestError("x")) == (400, {"ok": False, "reason": "bad_request", "error": "x"})
    status, body = error_answer(KeyError("/srv/secret/path"))
    assert status == 500 and body["reason"] == "internal" and "/srv/secret" not in body["error"], body
    assert re.fullmatch(r"the request failed with an internal error \(KeyError\); the server's log has the details "
                        r"under error id [0-9a-f]{12}", body["error"]), body


def test_auth_is_secure_by_default():
    """No token and no explicit opening: every request is refused. A token (ours or the engine's
    API key) is required as ``Bearer`` in any case; ENGINE_EXT_NO_AUTH=1 alone opens the route."""
    with pytest.raises(Unauthorized, match="no token is configured"):
        Auth().check("Bearer anything")
    Auth(open=True).check(None)
    auth = Auth(("s3cret", "vllm-api-key"))
    for good in ("Bearer s3cret", "bearer s3cret", "BEARER  vllm-api-key ", "Bearer vllm-api-key"):
        auth.check(good)
    for bad in (None, "", "s3cret", "Bearer wrong", "Basic s3cret", "Bearer", "Bearers3cret"):
        with pytest.raises(Unauthorized):
            auth.check(bad)
    with pytest.raises(Unauthorized):  # a token configured wins over "open"
        Auth(("s3cret",), open=True).check(None)
    s = Settings(token="t", no_auth=False)
    assert Auth.from_settings(engine_tokens=("k", None, ""), s=s) == Auth(("t", "k"), False)


def _replies(*per_rank):
    return [RankReply(True, r, fingerprints={n: TensorReport(*v) for n, v in fps.items()}) for r, fps in enumerate(per_rank)]


def test_combine_fingerprints():
    full = (123, 10, 10)
    assert combine_fingerprints(_replies({"a": full}, {"a": full})) == {"a": 123}
    assert combine_fingerprints(_replies({"a": ((1 << 64) - 5, 4, 10)}, {"a": (7, 6, 10)})) == {"a": 2}
    with pytest.raises(VerifyError, match="disagree"):
        combine_fingerprints(_replies({"a": full}, {"a": (124, 10, 10)}))
    with pytest.raises(VerifyError, match="cover 8 of 10"):
        combine_fingerprints(_replies({"a": (1, 4, 10)}, {"a": (1, 4, 10)}))
    with pytest.raises(VerifyError, match="no rank holds"):
        combine_fingerprints(_replies({"a": full}), names=["b"])


def test_rank_reply_wire_round_trip():
    r = RankReply(True, 1, fingerprints={"w": TensorReport(2**64 - 1, 4, 8)}, tensors={"w": ((2, 4), "bfloat16")},
                  fallback=("x",), converted=("b",), engine={"gemm": {"sgl": 2}}, written=3, seconds={"apply": 0.5})
    wire = r.to_wire()
    import json as _json

    assert RankReply.from_wire(_json.loads(_json.dumps(wire))) == r  # plain JSON types only
    for bad in ({"ok": 1, "rank": 0}, {"ok": True, "rank": 0, "surprise": 1}, [1],
                {"ok": True, "rank": 0, "fingerprints": {"w": ["00", 1]}}):
        with pytest.raises(ValueError):
            RankReply.from_wire(bad)
    failed = RankReply.from_wire(run_op(lambda: (_ for _ in ()).throw(RuntimeError("no model")), "setup", rank=3))
    assert (failed.ok, failed.rank, failed.error) == (False, 3, "RuntimeError: no model")
    assert RankReply.from_wire(run_op(lambda: None, "explode")).error.startswith("ValueError: unknown op")


# ---------------------------------------------------------------- two fake ranks


def run(coro):
    return asyncio.run(coro)


def test_controller_updates_and_chains(published_run):
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]))
    run(ctl.start())
    assert ctl.status()["fingerprint"] == json.loads((store / "v00000000.anchor.json").read_text())["fingerprint"]
    a = run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    assert a["version"] == 1 and a["base_version"] is None  # version unknown at start: matched by fingerprint
    a = run(ctl.update(parse_request({"url": str(store / "v00000003.json")})))
    assert a["version"] == 3 and len(a["manifests"]) == 2
    want = versions[3]
    for up in ranks:
        assert torch.equal(up.module.w.view(torch.int16), want["w"][up.rank * 4:(up.rank + 1) * 4].view(torch.int16))
        assert torch.equal(up.module.b.view(torch.int16), want["b"].view(torch.int16))
    assert ctl.ranks.calls[-3:] == ["commit", "after:3", "resume"]
    n = len(ctl.ranks.calls)
    a = run(ctl.update(parse_request({"url": str(store / "v00000003.json")})))  # a replay: nothing to do
    assert a["noop"] is True and a["version"] == 3 and a["payload_bytes"] == 0
    assert set(ctl.ranks.calls[n:]) == {"status"}  # since the v3 update: only the committed state read back
    held = bits(ranks)
    with pytest.raises(BaseMismatchError, match="rollback") as e:  # going back must be asked for
        run(ctl.update(parse_request({"url": str(store / "v00000002.json")})))
    assert e.value.reason == "downgrade" and ctl.status()["version"] == 3
    assert same_bits(held, bits(ranks))
    a = run(ctl.update(parse_request({"url": str(store / "v00000002.json"), "rollback": True})))  # only via the anchor
    assert a["version"] == 2 and a["manifests"][0].endswith("v00000000.anchor.json")
    assert torch.equal(ranks[1].module.w.view(torch.int16), versions[2]["w"][4:].view(torch.int16))
    (store / "v00000000.anchor.json").unlink()
    with pytest.raises(BaseMismatchError):  # no anchor, and no chain leads from v2 to v1
        run(ctl.update(parse_request({"url": str(store / "v00000001.json"), "rollback": True})))
    assert ctl.status()["version"] == 2


def test_held_weights_are_recognised_by_fingerprint(published_run):
    """A server restarted from the run's first checkpoint (version unknown) adopts the anchor's version
    without fetching it and takes later versions as the chain alone; a server that loaded a version's
    weights from elsewhere adopts that version: nothing fetched, written or paused."""
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]))
    run(ctl.start())
    a = run(ctl.update(parse_request({"url": str(store / "v00000000.anchor.json")})))
    assert a["noop"] and (a["version"], a["payload_bytes"]) == (0, 0) and "fetch" not in ctl.ranks.calls
    a = run(ctl.update(parse_request({"url": str(store)})))  # LATEST, v3: the chain v1..v3, no anchor
    assert a["version"] == 3 and [m.rsplit("/", 1)[-1] for m in a["manifests"]] == [
        "v00000001.json", "v00000002.json", "v00000003.json"]
    assert torch.equal(ranks[0].module.w.view(torch.int16), versions[3]["w"][:4].view(torch.int16))
    other = [make_rank(0, versions[3]), make_rank(1, versions[3])]
    ctl2 = Controller(FakeRanks(other), Sources([str(store)]))
    run(ctl2.start())
    a = run(ctl2.update(parse_request({"url": str(store / "v00000003.json")})))
    assert a["noop"] and a["version"] == 3 and not [c for c in ctl2.ranks.calls if c.startswith(("fetch", "pause"))]
    assert ctl2.state.manifests == (hashlib.sha256((store / "v00000003.json").read_bytes()).hexdigest(),)


def test_an_internal_failure_answers_words_and_an_id_the_log_carries(published_run, caplog):
    """A 500 says what failed in words with an error id; the repr (paths, internals) goes to the log only,
    under that id (docs/SECURITY.md)."""
    store, versions = published_run
    ctl = Controller(FakeRanks([make_rank(0, versions[0]), make_rank(1, versions[0])]), Sources([str(store)]), version=0)
    run(ctl.start())

    async def broken(*a, **k):
        raise RuntimeError("/srv/private/cache/blob.bin is gone")

    ctl._prepare_and_execute = broken
    with caplog.at_level("ERROR", logger="engine_ext"), pytest.raises(Exception) as e:
        run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    status, body = error_answer(e.value)
    assert status == 500 and "/srv/private" not in body["error"] and "RuntimeError" in body["error"], body
    error_id = re.search(r"error id ([0-9a-f]{12})", body["error"]).group(1)
    assert any(error_id in r.getMessage() and "/srv/private" in r.getMessage() for r in caplog.records)
    assert ctl.status()["history"][-1]["error"] == body["error"]  # the status route shows the words, not the repr


def test_failure_on_one_rank_rolls_every_rank_back(published_run):
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    ctl = Controller(FakeRanks(ranks, fail_rank=1), Sources([str(store)]), version=0)
    run(ctl.start())
    before, fp = bits(ranks), ctl.status()["fingerprint"]
    with pytest.raises(Exception, match="injected kernel failure") as e:
        run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    assert error_answer(e.value)[0] == 500
    after = bits(ranks)
    assert same_bits(before, after)
    assert ctl.status()["fingerprint"] == fp and ctl.status()["version"] == 0
    assert "rollback" in ctl.ranks.calls and ctl.ranks.calls[-2:] == ["resume", "discard"]
    assert [len(up._fetches) for up in ranks] == [0, 0]  # the part rank 1 fetched and never applied is dropped
    assert ctl.status()["history"][-1]["ok"] is False


def test_verify_failure_rolls_back(published_run):
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]), version=0)
    run(ctl.start())
    before = bits(ranks)
    from engine_ext.store import reader

    real = reader.fetch_selected

    def lying(*a, **k):  # a rank that decodes one step wrong: its write shows in the fingerprints
        deltas, n = real(*a, **k)
        deltas[0].values[0] += 1
        return deltas, n

    reader.fetch_selected = lying
    try:
        with pytest.raises(VerifyError, match="rolled back"):
            run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    finally:
        reader.fetch_selected = real
    assert same_bits(before, bits(ranks))


def test_one_update_at_a_time(published_run):
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    fake = FakeRanks(ranks)
    fake.gate = threading.Event()  # the first update's pause holds until the refusal was seen (not for a time)
    ctl = Controller(fake, Sources([str(store)]), version=0)

    async def two():
        await ctl.start()
        first = asyncio.create_task(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
        while not ctl.status()["busy"]:  # its prepare (fetch, decode) runs first, in a thread: slow on a loaded host
            assert not first.done(), first
            await asyncio.sleep(0.01)
        try:
            with pytest.raises(Busy):  # while it applies (its pause held), another update is refused
                await ctl.update(parse_request({"url": str(store / "v00000002.json")}))
        finally:
            fake.gate.set()
        waited = asyncio.create_task(ctl.update(parse_request({"url": str(store / "v00000002.json"), "wait": True})))
        return await first, await waited

    a, b = run(two())
    assert (a["version"], b["version"]) == (1, 2)


def test_forbidden_before_fetch(published_run, monkeypatch):
    store, versions = published_run
    ctl = Controller(FakeRanks([make_rank(0, versions[0]), make_rank(1, versions[0])]), Sources([str(store / "nothing")]), version=0)
    run(ctl.start())
    from engine_ext.store import route

    monkeypatch.setattr(route, "plan", lambda *a, **k: pytest.fail("read a forbidden source"))
    with pytest.raises(ForbiddenSourceError):
        run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))




def test_audit_rereads_the_live_weights(published_run):
    """``GET ...?audit=1``: every rank's live weights re-read and checked against the served state;
    a write behind the transaction's back (a mix of two versions) is named."""
    from engine_ext.server.http import get_answer, wants_audit

    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]))
    run(ctl.start())
    run(ctl.update(parse_request({"url": str(store / "v00000002.json")})))
    audit = run(ctl.audit())
    assert audit == {"ok": True, "version": 2, "fingerprint": ctl.status()["fingerprint"], "differ": [],
                     "derived": {"checked": 0, "opaque": 0, "stale": []}}  # these ranks derive nothing
    assert wants_audit({"audit": "1"}) and not wants_audit({})

    async def me():
        return ctl

    status, body = run(get_answer(Auth(("t",)), me, "Bearer t", audit=True))
    assert status == 200 and body["audit"]["ok"] and body["version"] == 2
    with torch.no_grad():
        ranks[1].module.w[0, :3] = versions[3]["w"][4, :3]  # rank 1 holds rows 4-7: three elements of v3
    audit = run(ctl.audit())
    assert not audit["ok"] and audit["differ"] == ["w"] and audit["fingerprint"] != ctl.status()["fingerprint"]
    assert ctl.status()["version"] == 2  # an audit changes nothing


# ---------------------------------------------------------------- a tied copy in the served checkpoint


class TiedRank(torch.nn.Module):
    """Rank ``r`` of ``world`` of a tied model as vLLM builds it: ``lm_head.weight`` is the embedding's
    parameter (rows sharded by rank). The loader skips the tied copy (SGLang), or refuses it when it
    comes without the embedding (vLLM 0.32's AutoWeightsLoader: ``refuse_alone``)."""

    def __init__(self, r: int, world: int, sd: dict, refuse_alone: bool = False):
        super().__init__()
        self.r, self.world, self.refuse_alone = r, world, refuse_alone
        self.model = torch.nn.Module()
        rows, hidden = sd["model.embed_tokens.weight"].shape
        self.model.embed_tokens = torch.nn.Embedding(rows // world, hidden, dtype=torch.bfloat16)
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.zeros(hidden, dtype=torch.bfloat16))
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = self.model.embed_tokens.weight
        for n, t in sd.items():
            self.load(n, t)

    def load(self, name: str, t: torch.Tensor) -> None:
        if name == "lm_head.weight":
            if self.refuse_alone:
                raise ValueError("'lm_head.weight' was skipped because it is tied to 'model.embed_tokens.weight', "
                                 "but 'model.embed_tokens.weight' was not found in the checkpoint")
            return
        p = dict(self.named_parameters())[name]
        with torch.no_grad():
            p.copy_(t if name == "model.norm.weight" else t[self.r * p.shape[0]:(self.r + 1) * p.shape[0]])


@pytest.mark.parametrize("refuse_alone", [False, True], ids=["skipped", "refused-alone"])
def test_a_tied_copy_in_the_served_checkpoint_is_not_served(tmp_path, refuse_alone):
    """A served checkpoint that stores the tied copy (``lm_head.weight`` beside the embedding):
    the engine's loader writes none of it, so it is not served on its own (start-up says so), and
    the trainer's versions, which hold the embedding once, apply on both ranks. A version that
    holds tensors the model lacks (an untied lm_head, another tensor) is refused as a model
    mismatch naming them; nothing changes."""
    from engine_ext.errors import ModelMismatchError
    from engine_ext.format.dtypes import BY_TORCH

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    ckpt = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
            "lm_head.weight": embed.clone()}
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in ckpt.items()}
    modules = [TiedRank(r, 2, ckpt) for r in range(2)]
    for m in modules:
        m.refuse_alone = refuse_alone  # loaded whole; the probe then gives it tensor by tensor
    ranks = [RankUpdater(m, m.load, dict(specs), rank=r) for r, m in enumerate(modules)]
    ctl = Controller(FakeRanks(ranks), Sources([str(tmp_path)]))
    run(ctl.start())
    st = ctl.status()
    assert st["layout"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"} and st["tensors"] == 2
    trainer = TiedRank(0, 1, ckpt)  # the trainer's model: one parameter under both names
    with DeltaPublisher(str(tmp_path / "run"), anchor_every=0) as pub:
        pub.publish(trainer)
        for _ in range(2):
            with torch.no_grad():
                trainer.model.embed_tokens.weight.add_(torch.randn(16, 8, generator=g).to(torch.bfloat16))
            pub.publish(trainer)
    assert st["fingerprint"] == json.loads((tmp_path / "run" / "v00000000.anchor.json").read_text())["fingerprint"]
    a = run(ctl.update(parse_request({"url": str(tmp_path / "run" / "v00000002.json")})))
    assert a["version"] == 2 and a["fingerprint"] == fpr.fmt(pub.fingerprint)
    for up in ranks:
        rows = trainer.model.embed_tokens.weight[up.rank * 8:(up.rank + 1) * 8]
        assert torch.equal(up.module.lm_head.weight.view(torch.int16), rows.view(torch.int16))
    run(ctl.resync())
    assert ctl.status()["fingerprint"] == fpr.fmt(pub.fingerprint)
    with DeltaPublisher(str(tmp_path / "other"), anchor_every=0) as other:
        other.publish(ckpt | {"model.extra.weight": torch.zeros(3, dtype=torch.bfloat16)})
    held = bits(ranks)
    # the checkpoint's own dict holds lm_head as a separate tensor (a clone: an untied model) and one more
    with pytest.raises(ModelMismatchError, match=r"2 tensor\(s\) not in the served model: \['lm_head.weight', 'model.extra.weight'\]") as e:
        run(ctl.update(parse_request({"url": str(tmp_path / "other" / "v00000000.anchor.json"), "rollback": True})))
    assert e.value.http_status == 409 and same_bits(held, bits(ranks))


def test_an_update_writing_a_mismatched_tensor_is_refused_before_anything_is_written(published_run):
    """A tensor whose live weights differ from the checkpoint they were loaded from (the engine re-laid
    it after loading, as vLLM's CPU backend packs a causal-conv1d weight in place) is named at start-up,
    and any route that writes it is refused (409 ``unreproducible``) from the manifests, before a fetch:
    nothing written, the served state unchanged. The rank refuses such a part on its own too."""
    from engine_ext.errors import UnreproducibleError
    from engine_ext.server.rank import RankUpdater

    store, versions = published_run
    ranks = []
    for r in range(2):
        up = make_rank(r, versions[0])
        ranks.append(RankUpdater(up.module, up.load, up.checkpoint, read_checkpoint=lambda n: versions[0][n], rank=r))
    for up in ranks:
        with torch.no_grad():
            up.module.b.copy_(up.module.b.flip(0))  # "derived after loading": the live layout is not the checkpoint's
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]))
    run(ctl.start())
    assert ctl.status()["layout"]["mismatched"] == ["b"]
    before, fp = bits(ranks), ctl.status()["fingerprint"]
    # the served fingerprint is no version's (the re-laid "b"): the route goes through the anchor, which
    # writes every tensor, "b" too
    with pytest.raises(UnreproducibleError, match=r"\['b'\]") as e:
        run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    assert error_answer(e.value)[0] == 409 and e.value.reason == "unreproducible"
    assert "fetch" not in ctl.ranks.calls and same_bits(before, bits(ranks))
    assert ctl.status()["fingerprint"] == fp and ctl.status()["version"] is None
    from engine_ext.format.delta import ABS, TensorDelta
    from engine_ext.format.dtypes import BY_TORCH

    part = TensorDelta("b", BY_TORCH[torch.bfloat16], (16,), ABS, torch.tensor([3]), torch.tensor([1], dtype=torch.int16))
    with pytest.raises(UnreproducibleError):
        ranks[0].apply([part])
    assert same_bits(before, bits(ranks))


def test_a_stale_derived_copy_after_the_apply_rolls_every_rank_back(published_run):
    """After each apply's refresh, the engine's derived copies of the layers written are checked against a
    fresh derivation (``ENGINE_EXT_VERIFY_DERIVED``, default ``sample``): a refresh that did not follow the
    weights fails the update, which rolls back, although the fingerprints (read in the checkpoint layout)
    would have passed. ``off`` leaves it to the audit."""
    from engine_ext import settings

    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    asked = []

    def stale(touched=None, sample=False):
        asked.append(sample)
        return {"checked": 1, "opaque": 0, "stale": ["model.layers.0.mlp"]}

    ranks[1].check_derived = stale
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]), version=0)
    run(ctl.start())
    before = bits(ranks)
    with pytest.raises(Exception, match=r"VerifyError: .*model.layers.0.mlp.*rolled back") as e:
        run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    assert error_answer(e.value)[0] == 500 and e.value.reason == "verify"
    assert asked == [True] and same_bits(before, bits(ranks)) and ctl.status()["version"] == 0
    with settings.override(verify_derived="off"):
        assert run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))["version"] == 1
    assert asked == [True]


def test_a_fallback_tensor_whose_loader_cannot_reload_it_is_refused_at_start_up(published_run):
    """A tensor the probe cannot map because the engine's loader raises (GPT-OSS's experts on vLLM's Triton MoE
    path, whose parameters post-processing deletes) would fail every update in the middle of its apply, after
    other tensors were written: start-up tries the dense fallback's own reload (the value it loaded) and, where
    the loader raises again, refuses updates writing it (409 ``unreproducible``), naming the loader's error. A
    fallback tensor whose loader reloads it is served as usual."""
    from engine_ext.errors import UnreproducibleError
    from engine_ext.server.rank import RankUpdater

    store, versions = published_run
    up = make_rank(0, versions[0], world=1)

    def load(name, t):
        if name == "b":
            raise KeyError("model.layers.0.mlp.experts.w13_weight")  # vLLM's params_dict[name], the parameter gone
        up.load(name, t)

    rank = RankUpdater(up.module, load, up.checkpoint, read_checkpoint=lambda n: versions[0][n])
    ctl = Controller(FakeRanks([rank]), Sources([str(store)]))
    run(ctl.start())
    layout = ctl.status()["layout"]
    assert layout["fallback"] == ["b"] and list(layout["unreproducible"]) == ["b"], layout
    assert "KeyError" in layout["unreproducible"]["b"] and "cannot reload" in layout["unreproducible"]["b"]
    before = bits([rank])
    with pytest.raises(UnreproducibleError, match=r"\['b'\]"):
        run(ctl.update(parse_request({"url": str(store / "v00000001.json")})))
    assert same_bits(before, bits([rank])) and "fetch" not in ctl.ranks.calls


def test_a_rollback_whose_reload_fails_restores_everything_else_and_says_so(published_run):
    """The rollback of a failed apply reloads each dense-fallback tensor's old value through the engine's loader.
    Where that reload raises, it goes on: the in-place tensors' bits and the rank's fingerprints come back, the
    refresh runs, and the rollback then fails naming the tensors whose served bits it could not restore."""
    from engine_ext.errors import RollbackError
    from engine_ext.format.delta import ABS, TensorDelta
    from engine_ext.format.dtypes import BY_TORCH
    from engine_ext.server.rank import RankUpdater

    store, versions = published_run
    up = make_rank(0, versions[0], world=1)
    fail = {"on": False}

    def load(name, t):
        if fail["on"] and name == "b":
            raise TypeError("default_weight_loader() takes 2 positional arguments but 3 were given")
        if name == "b":
            up.module.b.copy_(t.float().to(torch.bfloat16))  # a loader the probe cannot follow (computed)
        else:
            up.load(name, t)

    rank = RankUpdater(up.module, load, up.checkpoint, read_checkpoint=lambda n: versions[0][n])
    rank.setup()
    assert "b" in rank.host and not rank.unreproducible
    fps, before = dict(rank.fps), bits([rank])
    parts = [TensorDelta("w", BY_TORCH[torch.bfloat16], (8, 16), ABS, torch.tensor([5]), torch.tensor([7], dtype=torch.int16)),
             TensorDelta("b", BY_TORCH[torch.bfloat16], (16,), ABS, torch.tensor([3]), torch.tensor([1], dtype=torch.int16))]
    rank.apply(parts)
    assert not same_bits(before, bits([rank]))
    fail["on"] = True
    with pytest.raises(RollbackError, match=r"could not reload 1 tensor\(s\).*'b'"):
        rank.rollback()
    assert rank.fps == fps and torch.equal(rank.host["b"], versions[0]["b"])
    assert torch.equal(up.module.w.view(torch.int16), versions[0]["w"].view(torch.int16))  # the in-place part restored
