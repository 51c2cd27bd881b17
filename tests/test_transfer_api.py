"""vLLM's weight-transfer API on engine_ext, without a vLLM server: the payloads' meaning
(:mod:`engine_ext.server.transfer_api`), one served state whichever driver commits (the ranks
carry it), refusals carried as text, and the trainer-side engine driving the server-side door
(:class:`engine_ext.engines.vllm.endpoint.NativeDoor`, the code behind vLLM's routes) over
in-process ranks (tests/fake_ranks.py). Real vLLM servers run the same code in
tests/test_vllm_transfer.py.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from cryptography.hazmat.primitives import serialization

from engine_ext.errors import BaseMismatchError, DeltaError, UpdateRefused
from engine_ext.server.controller import Controller, Policy
from engine_ext.server.protocol import RequestError, UpdateRequest
from engine_ext.server.transaction import UpdateTransaction
from engine_ext.server.transfer_api import WideningError, narrow, update_request
from engine_ext.store.signing import Trust, generate_key
from engine_ext.store.sources import Sources
from fake_ranks import FakeRanks, bits, make_rank, same_bits


def run(coro):
    return asyncio.run(coro)


def url(store, n: int) -> UpdateRequest:
    return UpdateRequest.parse({"url": str(store / f"v{n:08d}.json")})


# --------------------------------------------------------------------------- one served state


def test_two_drivers_share_the_state_the_ranks_carry(published_run):
    """Two drivers over the same ranks (the API server's route and an in-process backend reached
    directly): each re-reads the state the other committed before it plans, the label given to a
    version travels with it, and a commit clears it."""
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    a, b = Controller(FakeRanks(ranks), Sources([str(store)])), Controller(FakeRanks(ranks), Sources([str(store)]))
    run(a.start())
    run(b.start())
    assert run(a.update(url(store, 1)))["version"] == 1
    assert run(b.fresh_status())["version"] == 1  # b re-read what a committed
    r = run(b.update(url(store, 2)))  # planned from v1, not from b's stale start-up state
    assert (r["version"], r["base_version"], len(r["manifests"])) == (2, 1, 1)
    run(b.set_label("step-2"))
    st = run(a.fresh_status())
    assert (st["version"], st["weight_version"], st["commits"]) == (2, "step-2", 2)
    assert any(h.get("outside_update") for h in st["history"])
    assert run(a.update(url(store, 3)))["base_version"] == 2
    st = run(b.fresh_status())
    assert (st["version"], st["weight_version"]) == (3, None)  # the label named v2
    assert [up.version for up in ranks] == [3, 3] and len({up.manifest for up in ranks}) == 1


def test_resync_reads_and_disagreeing_ranks_forget(published_run):
    """A resync is a read: the version survives while the live weights are the served version's. A
    commit that reached only some ranks (they disagree) makes every rank forget the version; the
    fingerprints still bind the next delta."""
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    ctl = Controller(FakeRanks(ranks), Sources([str(store)]))
    run(ctl.start())
    run(ctl.update(url(store, 1)))
    run(ctl.ranks.call("resync"))  # a direct read of the live weights (examples/llm_hook.py does this)
    run(ctl.resync())
    st = run(ctl.fresh_status())
    assert (st["version"], st["commits"]) == (1, 1)
    ranks[0].commit(version=7, manifest="ab" * 32)  # only rank 0 heard of a "v7"
    st = run(ctl.fresh_status())
    assert (st["version"], [up.version for up in ranks]) == (None, [None, None])
    assert ranks[0].commits == ranks[1].commits == st["commits"] == 3
    r = run(ctl.update(url(store, 2)))
    assert (r["version"], r["base_version"]) == (2, None) and [up.version for up in ranks] == [2, 2]


def test_apply_refused_when_the_ranks_moved_since_the_plan(published_run):
    """A stale driver that planned before another door committed cannot write: every rank refuses
    the apply (its commit count moved), the transaction rolls back, nothing changes."""
    store, versions = published_run
    ranks = [make_rank(0, versions[0]), make_rank(1, versions[0])]
    a, b = Controller(FakeRanks(ranks), Sources([str(store)])), Controller(FakeRanks(ranks), Sources([str(store)]))
    run(a.start())
    run(b.start())

    async def race():
        txn = UpdateTransaction(a.ranks, a.state, url(store, 1), str(store / "v00000001.json"), a.trust)
        await txn.prepare()
        await b.update(url(store, 2))  # the other door commits meanwhile (v0 -> v2)
        held = bits(ranks)
        try:
            with pytest.raises(DeltaError, match="another door") as e:
                await txn.execute()  # a's own state did not move: only the ranks can tell
            assert (e.value.reason, e.value.http_status) == ("base_mismatch", 409)
        finally:
            await txn.release()
        return held

    held = run(race())
    assert same_bits(held, bits(ranks)) and [up.version for up in ranks] == [2, 2]
    assert [up._pending for up in ranks] == [None, None]


# --------------------------------------------------------------------------- init_info and update_info


def test_init_info_only_narrows(tmp_path):
    generate_key(tmp_path / "a.key")
    generate_key(tmp_path / "b.key")
    generate_key(tmp_path / "c.key")
    trust = Trust.from_public_keys([str(tmp_path / "a.key.pub"), str(tmp_path / "b.key.pub")], allow_unsigned=True)
    server = Policy(Sources([str(tmp_path / "stores"), "s3://bucket/runs"]), trust)
    assert narrow({}, server) is server and narrow(None, server) is server
    p = narrow({"sources": [str(tmp_path / "stores" / "run1"), "s3://bucket/runs/7"]}, server)
    assert p.sources.check("s3://bucket/runs/7/v00000001.json") and p.trust is trust
    with pytest.raises(Exception, match="not under an allowed prefix"):
        p.sources.check(str(tmp_path / "stores" / "run2" / "v00000001.json"))
    pem = (tmp_path / "b.key.pub").read_text()
    kid_a = next(k for k, v in trust.keys.items() if v.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode() != pem)
    p = narrow({"trusted_keys": [pem]}, server)
    assert len(p.trust.keys) == 1 and kid_a not in p.trust.keys and p.trust.allow_unsigned is False
    assert set(narrow({"trusted_keys": [kid_a.upper()]}, server).trust.keys) == {kid_a}
    for bad, err in [({"sources": [str(tmp_path / "elsewhere")]}, WideningError),
                     ({"sources": [f"{tmp_path}/stores/../elsewhere"]}, WideningError),
                     ({"sources": ["s3://bucket/runs2"]}, WideningError),
                     ({"trusted_keys": [(tmp_path / "c.key.pub").read_text()]}, WideningError),
                     ({"trusted_keys": ["0123456789abcdef"]}, WideningError),
                     ({"trusted_keys": [str(tmp_path / "a.key.pub")]}, RequestError),  # a path: never read
                     ({"sources": []}, RequestError), ({"sources": "s3://bucket/runs"}, RequestError),
                     ({"allow_unsigned": True}, RequestError), (["s3://bucket/runs"], RequestError)]:
        with pytest.raises(err):
            narrow(bad, server)
    assert WideningError.http_status == 403 and WideningError.reason == "widens_policy"
    unsigned_only = Policy(server.sources, Trust(allow_unsigned=True))
    with pytest.raises(WideningError, match="trusts no keys"):
        narrow({"trusted_keys": [kid_a]}, unsigned_only)
    two_of_two = Policy(server.sources, Trust(trust.keys, threshold=2))
    with pytest.raises(RequestError, match="threshold"):
        narrow({"trusted_keys": [kid_a]}, two_of_two)


def test_update_info_is_an_update_request():
    r = update_request({"url": "s3://b/r/v00000001.json", "base_version": 0})
    assert (r.url, r.base_version, r.wait, r.rollback) == ("s3://b/r/v00000001.json", 0, True, False)
    assert update_request([{"url": "x.json"}] * 2).url == "x.json"  # vLLM's per-rank list, one version
    for bad in ([{"url": "a.json"}, {"url": "b.json"}], [], "x.json", {"url": "x.json", "rollback": True},
                {"url": "x.json", "names": []}, {"base_version": 1}, {"url": 7}):
        with pytest.raises(RequestError):
            update_request(bad)


def test_refusals_survive_as_text():
    e = UpdateRefused.of(BaseMismatchError("v3 applies to version 2"))
    assert (e.reason, e.http_status) == ("base_mismatch", 409) and str(e).startswith("engine_ext refused [409 base_mismatch]")
    wrapped = f"RuntimeError: Worker failed with error '{e}', please check the stack trace above"
    found = UpdateRefused.find(wrapped)
    assert (found.reason, found.http_status) == ("base_mismatch", 409) and "v3 applies to version 2" in found.error
    assert UpdateRefused.find("something else") is None
    assert (UpdateRefused.of(ValueError("x")).reason, UpdateRefused.of(ValueError("x")).http_status) == ("internal", 500)


# --------------------------------------------------------------------------- the trainer engine, in process


class DoorClient:
    """vLLM's weight-sync client protocol onto a :class:`NativeDoor` in this process: what the HTTP
    routes do, minus HTTP (vLLM's own workers' session is a flag here)."""

    def __init__(self, ctl: Controller):
        from engine_ext.engines.vllm.endpoint import NativeDoor

        class Engine:  # the engine client's session calls
            async def start_weight_update(self):
                pass

            async def finish_weight_update(self, weight_version=None):
                pass

        self.ctl, self.door = ctl, NativeDoor(Engine(), Policy(ctl.sources, ctl.trust))

    def init_weight_transfer_engine(self, init_info):
        run(self.door.init(self.ctl, {"init_info": init_info}))

    def start_weight_update(self):
        run(self.door.start(self.ctl, {}))

    def update_weights(self, update_info):
        run(self.door.update(self.ctl, {"update_info": update_info}))

    def finish_weight_update(self, weight_version=None):
        run(self.door.finish(self.ctl, {"weight_version": weight_version}))


class Model(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        for n, t in state.items():
            self.register_parameter(n, torch.nn.Parameter(t.float()))

    @torch.no_grad()
    def step(self, g):
        for p in self.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def test_trainer_engine_drives_a_fleet(published_run, tmp_path):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo

    _, versions = published_run
    store = tmp_path / "trainer"
    servers = [[make_rank(0, versions[0]), make_rank(1, versions[0])] for _ in range(2)]
    ctls = [Controller(FakeRanks(r), Sources([str(tmp_path)])) for r in servers]
    for c in ctls:
        run(c.start())
    model, g = Model(versions[0]), torch.Generator().manual_seed(1)
    engine = WeightTransferTrainerFactory.trainer_init(DeltaTrainerInitInfo(str(store), rank=0),
                                                        client=[DoorClient(c) for c in ctls], source=ModuleSource(model))
    s = engine.send_weights()
    assert (s.version, s.kind) == (0, "anchor") and all(c.status()["history"][-1]["noop"] for c in ctls)  # adopted
    for n in (1, 2):
        model.step(g)
        s = engine.send_weights()
        assert (s.version, s.kind) == (n, "delta") and 0 < s.payload_bytes and s.dense_bytes == (8 * 16 + 16) * 2
        assert [(c.version, c.status()["weight_version"]) for c in ctls] == [(n, str(n))] * 2
    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    assert all(torch.equal(up.module.b, want["b"]) for r in servers for up in r)

    engine.clients[1].init_weight_transfer_engine({"sources": [str(tmp_path / "elsewhere")]})  # narrowed: not this store
    model.step(g)
    with pytest.raises(UpdateRefused, match="1 of 2 server") as e:
        engine.send_weights()
    assert (e.value.reason, e.value.http_status) == ("forbidden_source", 403)
    assert [c.version for c in ctls] == [3, 2]  # the first server took v3; the refusing one kept v2
    assert not any(c2.door.session for c2 in engine.clients)  # a refusal ends the session (start works again)
    engine.shutdown()

    resumed = WeightTransferTrainerFactory.trainer_init(DeltaTrainerInitInfo(str(store), rank=0),
                                                         client=[DoorClient(c) for c in ctls], source=ModuleSource(model))
    model.step(g)
    s = resumed.send_weights()  # a restarted trainer continues the store: v4, a delta against v3
    assert (s.version, s.kind) == (4, "delta") and resumed.publisher.resumed.kind == "delta"
    assert [c.version for c in ctls] == [4, 4]  # the lagging server took the chain v3, v4
    resumed.shutdown()
    assert (store / "v00000004.json").is_file()


def test_non_sender_ranks_only_iterate(published_run, tmp_path):
    from vllm.distributed.weight_transfer.base import ModuleSource

    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo, DeltaTrainerWeightTransferEngine

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"a non-sender rank called the client's {name}")

    model = Model(published_run[1][0])
    seen = []

    class Source(ModuleSource):
        def __iter__(self):
            for pair in super().__iter__():
                seen.append(pair[0])
                yield pair

    engine = DeltaTrainerWeightTransferEngine.trainer_init(DeltaTrainerInitInfo(str(tmp_path / "s"), rank=1),
                                                           client=Untouchable(), source=Source(model))
    assert engine.send_weights() is None and engine.publisher is None and sorted(seen) == ["b", "w"]
    assert not (tmp_path / "s").exists()
