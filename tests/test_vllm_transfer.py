"""vLLM's own weight-transfer API with engine_ext on both sides, on real vLLM CPU servers.

A trainer written against vLLM's API (``WeightTransferTrainerFactory.trainer_init`` with a
``ModuleSource`` and vLLM's own ``HTTPVLLMWeightSyncClient``; backend ``engine_ext`` instead of
``nccl``) drives a dev-mode server whose weight-transfer backend is engine_ext. The first
version is adopted without a fetch (the server holds the trainer's weights); later versions
arrive alternately through vLLM's routes and ``POST /update_weights_delta``, and both doors
see one served state (the bug this module guards: two doors, two states, 409 at the next
update). Three versions later the outputs equal a server cold-started on the trainer's
weights. Two updates through the two doors at once are serialised. An unsigned delta, a URL
outside the sources and a corrupted blob are refused by vLLM's routes with the reason and
status of ``/update_weights_delta``, changing nothing; ``init_weight_transfer_engine`` may
narrow the sources and keys, never widen them. At TP 2 a third door, vLLM's dev-mode
``/collective_rpc`` reaching the workers' backend directly, shares the state too. Offline
(``vllm.LLM`` as the client, TP 2, in a subprocess: tests/vllm_transfer_offline.py) the
worker backend is the only door; three versions equal a cold start there as well (the LLM's
own, on the final weights, before the trainer's v0 anchor takes it back).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from engine_ext.errors import UpdateRefused
from engine_ext.store.signing import Trust

pytest.importorskip("vllm")
from vllm_helpers import Server, Trainer, broken_copy, copy_store, fingerprint, make_model, save_state_dict  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
BACKEND = json.dumps({"backend": "engine_ext"})


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """One dev-mode server (TP 1) with the engine_ext backend, the trainer, and its engine."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo

    tmp = tmp_path_factory.mktemp("vllm_transfer")
    model = make_model(tmp / "model", "qwen2")
    root = tmp / "stores"
    root.mkdir()
    server = Server(model, sources=str(root), env={"VLLM_SERVER_DEV_MODE": "1"},
                    args=["--weight-transfer-config", BACKEND], log=tmp / "server.log")
    try:
        trainer = Trainer(model)
        client = HTTPVLLMWeightSyncClient(server.url)
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltaTrainerInitInfo(str(root / "run"), rank=0, publisher={"chunk_min_cell": 256}),
            client=client, source=ModuleSource(trainer.model))
        yield {"tmp": tmp, "model": model, "root": root, "server": server, "trainer": trainer, "client": client,
               "engine": engine}
        engine.shutdown()
    finally:
        server.stop()


def weight_info(server) -> str:
    return requests.get(server.url + "/weight_info", timeout=30).json()["weight_version"]


def test_versions_through_both_doors_equal_a_cold_start(online):
    server, trainer, engine = online["server"], online["trainer"], online["engine"]
    s0 = engine.send_weights()  # v0: the server holds these weights already
    st = server.status()
    assert (s0.version, s0.kind, st["version"], st["weight_version"]) == (0, "anchor", 0, "0")
    assert st["history"][-1]["noop"] and st["fingerprint"] == fingerprint(trainer.served())  # adopted, nothing fetched
    assert st["native"]["session"] is False and st["native"]["narrowed"] is False
    before = server.outputs()

    trainer.step()
    s1 = engine.send_weights()  # vLLM's routes
    st = server.status()
    assert (s1.version, s1.kind, st["version"], st["weight_version"], weight_info(server)) == (1, "delta", 1, "1", "1")
    assert st["history"][-1]["elements"] > 0 and not st["history"][-1]["noop"]

    trainer.step()
    uri = engine.publish_version()  # the same trainer's v2, through the secure route
    r = server.update({"url": uri})
    assert r.status_code == 200 and (r.json()["version"], r.json()["base_version"]) == (2, 1), r.text
    st = server.status()
    assert (st["version"], st["weight_version"], weight_info(server)) == (2, None, "2")

    trainer.step()
    s3 = engine.send_weights()  # vLLM's routes again, planned from what the route committed
    st = server.status()
    assert (s3.version, st["version"], st["weight_version"], weight_info(server)) == (3, 3, "3", "3")
    final = trainer.served()
    assert st["fingerprint"] == fingerprint(final)
    updated = server.outputs()
    assert updated != before
    for s in (s1, s3):
        assert 0 < s.payload_bytes < s.dense_bytes / 4 and s.dense_bytes == sum(t.numel() * 2 for t in final.values())
    cold_dir = save_state_dict(online["tmp"] / "final", final, online["model"])
    with Server(cold_dir, log=online["tmp"] / "cold.log") as cold:
        assert cold.status()["fingerprint"] == st["fingerprint"]
        assert cold.outputs() == updated


def test_two_doors_at_once_are_serialised(online):
    server, client, trainer, engine = online["server"], online["client"], online["trainer"], online["engine"]
    trainer.step()
    uri = engine.publish_version()  # v4
    answers = {}

    def native():
        client.start_weight_update()
        client.update_weights({"url": uri})
        client.finish_weight_update("4")
        answers["native"] = True

    t = threading.Thread(target=native)
    t.start()
    r = server.update({"url": uri, "wait": True})
    t.join(300)
    assert r.status_code == 200 and r.json()["version"] == 4 and answers == {"native": True}, r.text
    st = server.status()
    history = [h for h in st["history"] if h.get("version") == 4 and h["ok"]]
    assert [h["noop"] for h in history].count(False) == 1 and len(history) == 2  # one applied it, the other found it served
    assert st["version"] == 4 and st["fingerprint"] == fingerprint(trainer.served())


def native_refusal(client, body: dict) -> UpdateRefused:
    from engine_ext.integrations.vllm_transfer import refusal

    client.start_weight_update()
    with pytest.raises(requests.HTTPError) as e:
        client.update_weights(body)
    return refusal(e.value)


def test_refusals_change_nothing(online):
    server, client, trainer, engine = online["server"], online["client"], online["trainer"], online["engine"]
    trainer.step()
    engine.publish_version()  # v5, held back while broken copies of it are offered
    held, outputs = server.status(), server.outputs()
    cases = [("unsigned", 403, "signature"), ("outside", 403, "forbidden_source"), ("corrupt", 422, "integrity")]
    for how, status, reason in cases:
        url = broken_copy(online["root"] / "run", (online["tmp"] if how == "outside" else online["root"]) / how, 5, how)
        refused = native_refusal(client, {"url": url})  # the session ends with the refusal: start works again
        route = server.update({"url": url})
        assert (refused.http_status, refused.reason) == (route.status_code, route.json()["reason"]) == (status, reason), \
            (how, refused, route.text)
        st = server.status()
        assert (st["version"], st["fingerprint"], st["native"]["session"]) == (held["version"], held["fingerprint"], False)
    assert server.outputs() == outputs

    # init_weight_transfer_engine narrows what vLLM's routes accept, never widens it
    for init, reason in [({"sources": [str(online["tmp"] / "outside")]}, "widens_policy"),
                         ({"trusted_keys": ["0123456789abcdef"]}, "widens_policy"),
                         ({"sources": "not a list"}, "bad_request")]:
        with pytest.raises(requests.HTTPError) as e:
            client.init_weight_transfer_engine(init)
        assert e.value.response.json()["reason"] == reason, e.value.response.text
    assert server.status()["native"]["narrowed"] is False  # refused: nothing changed
    client.init_weight_transfer_engine({"sources": [str(online["root"] / "run")], "trusted_keys": sorted(Trust.from_settings().keys)})
    copy = copy_store(online["root"] / "run", online["root"] / "copy")  # allowed by the server, not by the narrowing
    refused = native_refusal(client, {"url": str(copy / "v00000005.json")})
    assert (refused.http_status, refused.reason) == (403, "forbidden_source")
    st = server.status()
    assert st["native"]["narrowed"] is True and st["version"] == held["version"]

    stats = engine.send_weights()  # v6, from v4: the chain v5, v6 through the narrowed door
    st = server.status()
    assert (stats.version, st["version"], st["weight_version"]) == (6, 6, "6")
    assert st["fingerprint"] == fingerprint(trainer.served())
    client.init_weight_transfer_engine({})
    assert server.status()["native"]["narrowed"] is False


def test_tp2_other_doors_share_the_state(tmp_path):
    """TP 2, online: besides vLLM's routes and ``/update_weights_delta``, a third door: vLLM's dev-mode
    ``/collective_rpc`` calling the workers' ``update_weights`` directly (the backend's own driver on
    worker 0, rank 1 following). The API server's controller finds the ranks moved and re-reads
    its state; the next update is planned from it. A corrupted blob (each rank fetching its cells)
    is refused alike by every door."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo
    from engine_ext.server.protocol import RankReply
    from engine_ext.server.transaction import combine_fingerprints
    from engine_ext.format import fingerprint as fpr

    model = make_model(tmp_path / "model", "qwen2")
    root = tmp_path / "stores"
    root.mkdir()
    trainer = Trainer(model, seed=2)
    with Server(model, sources=str(root), tp=2, env={"VLLM_SERVER_DEV_MODE": "1"},
                args=["--weight-transfer-config", BACKEND], log=tmp_path / "tp2.log") as server:
        def rpc(method, **body):
            r = requests.post(server.url + "/collective_rpc", json={"method": method, **body}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["results"] if r.content else None

        client = HTTPVLLMWeightSyncClient(server.url)
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltaTrainerInitInfo(str(root / "run"), rank=0, publisher={"chunk_min_cell": 256}), client=client,
            source=ModuleSource(trainer.model))
        engine.send_weights()  # v0, adopted
        before = server.outputs()
        trainer.step()
        engine.send_weights()  # v1, vLLM's routes
        trainer.step()
        uri = engine.publish_version()  # v2, straight to the workers' backend
        rpc("start_weight_update")
        rpc("update_weights", kwargs={"update_info": {"url": uri}})
        rpc("finish_weight_update")
        st = server.status()
        assert st["version"] == 2 and st["history"][-1].get("outside_update"), st["history"][-1]
        trainer.step()
        s3 = engine.send_weights()  # v3, planned from what the other door committed
        trainer.step()
        r = server.update({"url": engine.publish_version()})  # v4, the secure route
        assert r.status_code == 200 and r.json()["base_version"] == 3 and len(r.json()["fetched_bytes"]) == 2, r.text
        assert s3.version == 3 and server.status()["version"] == 4
        held, outputs = server.status(), server.outputs()
        trainer.step()
        engine.publish_version()  # v5, offered corrupted
        url = broken_copy(root / "run", root / "corrupt", 5, "corrupt")
        refused = native_refusal(client, {"url": url})
        route = server.update({"url": url})
        assert (refused.http_status, refused.reason) == (route.status_code, route.json()["reason"]) == (422, "integrity")
        assert (server.status()["fingerprint"], server.outputs()) == (held["fingerprint"], outputs)
        engine.send_weights()  # v6 through the chain v5, v6
        live = combine_fingerprints([RankReply.from_wire(w) for w in rpc("engine_ext", args=["resync"])])
        assert fpr.fmt(fpr.model_fingerprint(live)) == fingerprint(trainer.served())  # re-read from the live weights
        assert server.outputs() != before
        engine.shutdown()


def test_offline_llm_tp2(tmp_path):
    """``LLM(..., weight_transfer_config={"backend": "delta"})`` (the alias of ``engine_ext``) as the trainer's
    client at TP 2. The LLM starts cold on the trainer's final weights (the reference) and the trainer's v0
    anchor takes it back to the start: one LLM, no second start for the reference."""
    model = make_model(tmp_path / "model", "qwen2")
    root = tmp_path / "stores"
    env = dict(os.environ, VLLM_PLUGINS="engine_ext", VLLM_CPU_KVCACHE_SPACE="1", ENGINE_EXT_SOURCES=str(root),
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_transfer_offline.py"), "--model", str(model),
                        "--store", str(root / "run"), "--tp", "2", "--out", str(tmp_path / "final"),
                        "--outside", str(tmp_path / "outside")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(next(line for line in p.stdout.splitlines() if line.startswith('{"sends"')))
    assert [s["kind"] for s in out["sends"]] == ["anchor", "delta", "delta", "delta"]
    assert out["versions"] == [3, 3] and out["labels"] == ["3", "3"] and out["weight_version"] == "3"
    assert out["live_fingerprint"] == out["trainer_fingerprint"]
    assert out["refusals"] == [[403, "signature"], [403, "forbidden_source"], [422, "integrity"], [403, "widens_policy"]]
    assert out["after_refusals"] == out["live_fingerprint"]
    assert out["outputs"] == out["cold"] and out["outputs"] != out["before"]  # v3 serves what a cold start on it does
