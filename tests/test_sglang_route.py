"""``/update_weights_delta`` through a TestClient of SGLang's real FastAPI app, with the
``engine_ext`` plugin loaded by SGLang's own ``load_plugins()``.

Real: SGLang 0.5.23's ``http_server.app``, its ``TokenizerManager`` (built from
ServerArgs/PortArgs, so our hook installs the controller and the routes the way it
does in a server), its ZMQ sockets and IPC encoding, its ``TypeBasedDispatcher``, the
Qwen2 model class loaded by SGLang's loader (TP 1, gloo), our plugin, controller,
rank handler, reader and publisher. Stand-in: the scheduler *process* (so that the
rank's parameters can be inspected; tests/test_sglang_live.py runs a live server). A
thread plays its request loop exactly
as ``Scheduler.process_input_requests`` does (receive, dispatch through a dispatcher
that our plugin hook extended, send the output back); it records the pause/continue
and abort requests it is sent instead of running generation. SGLang's own lifespan
(OpenAI handlers, warm-up generation against a live scheduler) is not run: the
client gets a long-lived event loop without it.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.engine]
pytest.importorskip("sglang", reason="needs the SGLang virtualenv (.ci/setup-sglang.sh)")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sglang_stubs"))  # before SGLang's model modules import torchvision
sys.path.insert(0, str(HERE))

from test_sglang_tp import STEPS, make_case  # noqa: E402  (same data: K deltas + bad ones)

ROUTE = "/update_weights_delta"


class SchedulerLoop:
    """One TP rank's request loop, as in ``Scheduler.process_input_requests``."""

    def __init__(self, port_args, model, model_path):
        import zmq
        from sglang.srt.managers.io_struct import (
            AbortReq,
            ContinueGenerationReqInput,
            PauseGenerationReqInput,
            UpdateWeightFromDiskReqInput,
        )
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
        from sglang.srt.utils.network import get_zmq_socket
        from sglang.utils import TypeBasedDispatcher

        from engine_ext.engines.sglang import plugin

        self.events, self.versions, self.flushes = [], [], 0
        ctx = zmq.Context.instance()
        self.recv = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, False)
        self.send = SenderWrapper(get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc_name, False))
        self.tp_worker = type("W", (), {})()
        self.tp_worker.model_runner = type("R", (), {"model": model})()
        self._request_dispatcher = TypeBasedDispatcher([
            (PauseGenerationReqInput, lambda r: self.events.append(("pause", r.mode))),
            (ContinueGenerationReqInput, lambda r: self.events.append(("continue",))),
            (AbortReq, lambda r: self.events.append(("abort", r.abort_all))),
            (UpdateWeightFromDiskReqInput, self._update_from_disk),
        ])
        plugin._after_scheduler_init(None, self)  # what the hook on Scheduler.init_request_dispatcher runs
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _update_from_disk(self, req):
        """SGLang's own /update_weights_from_disk as its model runner does it: load_weights."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqOutput
        from engine_ext.tiny_models import load_state_dict

        self.tp_worker.model_runner.model.load_weights(list(load_state_dict(req.model_path).items()))
        return UpdateWeightFromDiskReqOutput(success=True, message="loaded", num_paused_requests=0)

    # the two Scheduler methods the rank handler uses
    def flush_cache(self, empty_cache=True):
        self.flushes += 1
        return True

    def record_weight_version_change(self, new_version):
        self.versions.append(new_version)

    def _loop(self):
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        while not self._stop.is_set():
            if not self.recv.poll(50):
                continue
            req = sock_recv(self.recv, zmq.NOBLOCK)
            out = self._request_dispatcher(req)
            if out is not None:
                self.send.send_output(out, req)

    def wait_for(self, cond, timeout=5.0):
        import time

        end = time.monotonic() + timeout
        while not cond() and time.monotonic() < end:
            time.sleep(0.01)

    def close(self):
        self._stop.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import anyio.from_thread
    import torch
    from fastapi.testclient import TestClient

    tmp = tmp_path_factory.mktemp("sglang_route")
    case = make_case(tmp, "qwen2")
    env = {"SGLANG_PLUGINS": "engine_ext"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from engine_ext import settings

    in_settings = settings.override(sources=tuple(case["sources"]), base_version=0)  # as if read from the environment
    in_settings.__enter__()

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.model_loader import get_model
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.utils.network import get_free_port

    load_plugins()
    sa = ServerArgs(model_path=case["model"], device="cpu", dtype="bfloat16")
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_free_port()}")
        initialize_model_parallel()

    def load(path):
        s = ServerArgs(model_path=path, device="cpu", dtype="bfloat16")
        return get_model(model_config=ModelConfig.from_server_args(s), load_config=LoadConfig(load_format="auto"),
                         device_config=DeviceConfig("cpu"))

    model = load(case["model"])
    port_args = PortArgs.init_new(sa)
    publish(sa, role="tokenizer")  # this process now plays the HTTP server's part
    tm = TokenizerManager(sa, port_args)
    sched = SchedulerLoop(port_args, model, case["model"])
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))
    try:
        with anyio.from_thread.start_blocking_portal() as portal:
            client = TestClient(http_server.app, headers={"authorization": f"Bearer {os.environ['ENGINE_EXT_TOKEN']}"})
            client.portal = portal  # one event loop for all requests (the TokenizerManager's loop lives there)
            yield {"client": client, "case": case, "tm": tm, "sched": sched, "model": model, "load": load,
                   "app": http_server.app}
    finally:
        sched.close()
        in_settings.__exit__(None, None, None)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_plugin_is_loaded_by_sglang_and_hooks_applied(server):
    from importlib.metadata import entry_points

    from sglang.srt.plugins.hook_registry import HookRegistry

    from engine_ext.engines.sglang import plugin

    assert any(ep.name == "engine_ext" and ep.value == "engine_ext.engines.sglang.plugin:register"
               for ep in entry_points(group="sglang.srt.plugins"))
    assert {plugin.SCHEDULER_TARGET, plugin.TOKENIZER_TARGET} <= HookRegistry._patched
    assert server["tm"]._engine_ext is not None  # installed by the TokenizerManager hook
    paths = [(r.path, sorted(r.methods)) for r in server["app"].routes if getattr(r, "path", None) == ROUTE]
    assert sorted(paths) == [(ROUTE, ["GET"]), (ROUTE, ["POST"])]


def test_status_before_any_update(server):
    from engine_ext.tiny_models import load_state_dict

    from engine_ext.format import fingerprint as fpr

    r = server["client"].get(ROUTE)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["engine"] == "sglang" and body["version"] == 0 and body["busy"] is False
    sd = load_state_dict(server["case"]["model"])
    want = fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in sd.items()})
    assert body["fingerprint"] == fpr.fmt(want)  # combined from the rank's live, sharded/padded params
    assert body["tensors"] == len(sd)


@pytest.mark.parametrize("body,reason", [
    (b"{not json", "bad_request"),
    (b"[1, 2]", "bad_request"),
    (b"{}", "bad_request"),
    (json.dumps({"url": 5}).encode(), "bad_request"),
    (json.dumps({"url": "x", "surprise": 1}).encode(), "bad_request"),
    (json.dumps({"url": "x", "pause_mode": "never"}).encode(), "bad_request"),
    (json.dumps({"url": "x", "base_version": True}).encode(), "bad_request"),
])
def test_malformed_bodies_are_400(server, body, reason):
    r = server["client"].post(ROUTE, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["ok"] is False and r.json()["reason"] == reason and r.json()["error"]


def test_sources_outside_the_allow_list_are_403_before_any_fetch(server, tmp_path):
    store = server["case"]["sources"][0]
    outside = tmp_path / "elsewhere.json"  # never created: a fetch would be a 404, not a 403
    for url in [str(outside), f"{store}/../secret.json", "http://169.254.169.254/latest/meta-data",
                f"file://{tmp_path}/x.json", f"{store}-evil/v00000001.json"]:
        r = server["client"].post(ROUTE, json={"url": url})
        assert r.status_code == 403, (url, r.text)
        assert r.json()["reason"] == "forbidden_source"
    assert server["client"].get(ROUTE).json()["version"] == 0


def test_deltas_apply_with_the_answer_format_then_bad_ones_are_refused(server):
    client, case, sched = server["client"], server["case"], server["sched"]
    modes = ["keep", "wait", "abort"]
    for v, (url, mode) in enumerate(zip(case["urls"], modes), start=1):
        sched.events.clear()
        r = client.post(ROUTE, json={"url": url, "pause_mode": mode, "base_version": v - 1})
        assert r.status_code == 200, r.text
        a = r.json()
        assert a["ok"] is True and a["version"] == v and a["base_version"] == v - 1
        assert a["pause_mode"] == mode and a["fallback"] == [] and a["manifests"]
        assert a["elements"] > 0 and 0 < a["payload_bytes"]
        assert len(a["fingerprint"]) == 16 and a["tensors"] > 0
        assert {"plan", "fetch", "pause", "apply", "verify", "reset_cache", "resume", "total"} <= set(a["phases_ms"])
        assert a["pause_ms"] == a["phases_ms"]["pause"]
        # SGLang's pause/continue reached the scheduler (keep = retract; wait = drain in the
        # tokenizer, nothing sent; abort = SGLang's abort-all), the cache was flushed and the
        # weight version recorded on the rank.
        want = {"keep": [("pause", "retract"), ("continue",)], "wait": [],
                "abort": [("continue",)]}[mode]
        sched.wait_for(lambda: len([e for e in sched.events if e[0] != "abort"]) >= len(want))  # continue is fire-and-forget
        assert [e for e in sched.events if e[0] != "abort"] == want, sched.events
        assert (("abort", True) in sched.events) == (mode == "abort")
        assert sched.versions[-1] == str(v)
    assert sched.flushes == STEPS

    status = client.get(ROUTE).json()
    assert status["version"] == STEPS and [h["version"] for h in status["history"] if h["ok"]] == [1, 2, 3]

    # wrong base version requested, corrupt blob, other base, result fingerprint lie: refused, unchanged
    before = {n: p.detach().clone() for n, p in server["model"].named_parameters()}
    for body, status_code, reason in [
        ({"url": case["urls"][0], "base_version": 0}, 409, "base_mismatch"),
        ({"url": case["bad"]["integrity"]}, 422, "integrity"),
        ({"url": case["bad"]["base_mismatch"]}, 409, "base_mismatch"),
        ({"url": case["bad"]["verify"]}, 500, "verify"),
    ]:
        r = client.post(ROUTE, json=body)
        assert r.status_code == status_code and r.json()["reason"] == reason, (body, r.text)
        assert all(torch_equal_bits(p, before[n]) for n, p in server["model"].named_parameters())
    assert client.get(ROUTE).json()["version"] == STEPS

    # the served rank equals a cold load of the final checkpoint, bit for bit
    ref = dict(server["load"](case["final"]).named_parameters())
    assert all(torch_equal_bits(p, ref[n]) for n, p in server["model"].named_parameters())


def test_bearer_token(server):
    from engine_ext import settings

    client = server["client"]
    with settings.override(token="s3cret"):  # ENGINE_EXT_TOKEN
        assert client.get(ROUTE).status_code == 401
        assert client.post(ROUTE, json={"url": "x"}).status_code == 401
        assert client.get(ROUTE, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert client.get(ROUTE, headers={"authorization": "Bearer s3cret"}).status_code == 200


def test_full_sync_through_sglangs_own_api_then_deltas(server, tmp_path):
    """RL frameworks also sync whole weights with SGLang's own API (here
    ``update_weights_from_disk``). Our hook on it makes the next delta op re-read the
    live fingerprints, so a delta based on the synced weights applies (version
    unknown, fingerprint known) instead of being refused as another base."""
    import torch
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
    from engine_ext.tiny_models import load_state_dict, perturb, save_state_dict

    from engine_ext.trainer.publisher import DeltaPublisher

    client, case, tm = server["client"], server["case"], server["tm"]
    outside = perturb(load_state_dict(case["final"]), torch.Generator().manual_seed(7), density=0.5)
    outside_dir = save_state_dict(tmp_path / "outside", outside, case["model"])
    nxt = perturb(outside, torch.Generator().manual_seed(8))
    store = Path(case["sources"][0]) / "after-full-sync"  # under an allowed source
    with DeltaPublisher(str(store), model="qwen2", anchor_every=0, workers=1) as pub:
        pub.publish(outside, version=10)
        url = pub.publish(nxt, version=11)
    for f in store.glob("*.anchor.json"):  # only the delta: it must apply on the synced weights
        f.unlink()
    final_dir = save_state_dict(tmp_path / "next", nxt, case["model"])

    r = client.post(ROUTE, json={"url": url})
    assert r.status_code == 409 and r.json()["reason"] == "base_mismatch", r.text  # not synced yet

    ok, _msg, _ = client.portal.call(tm.update_weights_from_disk, UpdateWeightFromDiskReqInput(model_path=str(outside_dir)))
    assert ok
    r = client.post(ROUTE, json={"url": url})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 11 and r.json()["base_version"] is None
    status = client.get(ROUTE).json()
    assert status["version"] == 11 and any(h.get("outside_update") for h in status["history"])
    ref = dict(server["load"](str(final_dir)).named_parameters())
    assert all(torch_equal_bits(p, ref[n]) for n, p in server["model"].named_parameters())


def test_messages_survive_sglang_msgpack_ipc(monkeypatch):
    """SGLang can run its IPC in msgpack mode (SGLANG_USE_PICKLE_IPC=0): our messages
    then travel in its PickleWrapper envelope and come out as themselves."""
    import zmq
    from sglang.srt.managers import io_struct

    from engine_ext.engines.sglang.messages import RankOpReply, RankOpReq

    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://engine_ext_msgpack")
    b.connect("inproc://engine_ext_msgpack")
    try:
        for pickle_mode in (True, False):
            monkeypatch.setattr(io_struct, "_USE_PICKLE_IPC", pickle_mode)
            for msg in (RankOpReq("apply", {"path": "/dev/shm/x"}), RankOpReply([{"ok": True, "rank": 0}])):
                io_struct.sock_send(a, io_struct.wrap_as_pickle(msg))
                assert io_struct.sock_recv(b) == msg
    finally:
        a.close()
        b.close()


def test_lifespan_wrapper_starts_the_probe_with_the_server():
    """routes.attach wraps the app's lifespan so the start-up probe runs at server start."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from engine_ext.engines.sglang import compat, engine, routes

    seen = []

    @asynccontextmanager
    async def inner(app):
        seen.append("inner")
        yield

    app = FastAPI(lifespan=inner)
    started = []

    async def fake_controller(tm):
        started.append(tm)

    following = []

    class StandInController:  # records the pull-mode start the lifespan performs
        def start_following(self, get_controller):
            following.append(get_controller)

    tm = type("TM", (), {"_engine_ext": StandInController()})()
    orig_ctl, orig_tm = engine.controller, compat.http_tokenizer_manager
    engine.controller, compat.http_tokenizer_manager = fake_controller, lambda: tm
    try:
        assert routes.attach(app) is True and routes.attach(app) is False
        with TestClient(app):
            pass
    finally:
        engine.controller, compat.http_tokenizer_manager = orig_ctl, orig_tm
    assert seen == ["inner"] and started == [tm]
    assert len(following) == 1 and callable(following[0])  # ENGINE_EXT_FOLLOW is started with the server


def torch_equal_bits(a, b) -> bool:
    import torch

    return torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16)) if a.dtype == torch.bfloat16 else torch.equal(a, b)


def test_in_process_engine_hook(server, tmp_path, engine_settings):
    """``engine_ext.engines.sglang.update_weights_delta(engine, url)`` for in-process ``sglang.Engine``
    users: the same controller, reached through ``engine.tokenizer_manager`` on
    ``engine.loop`` (the two attributes of ``sglang.Engine`` it uses). Runs last: it
    publishes a second model's config in this process."""
    import asyncio
    import signal
    import types

    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    from engine_ext.errors import DeltaError
    from engine_ext.engines.sglang import delta_status, update_weights_delta

    case = make_case(tmp_path, "llama")
    engine_settings(sources=tuple(case["sources"]))  # ENGINE_EXT_SOURCES
    sa = ServerArgs(model_path=case["model"], device="cpu", dtype="bfloat16")
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    model = server["load"](case["model"])
    port_args = PortArgs.init_new(sa)
    publish(sa, role="tokenizer")
    loop = asyncio.new_event_loop()
    tm = TokenizerManager(sa, port_args)
    sched = SchedulerLoop(port_args, model, case["model"])
    engine = types.SimpleNamespace(tokenizer_manager=tm, loop=loop)
    try:
        assert delta_status(engine)["version"] == 0
        for v, url in enumerate(case["urls"], start=1):
            assert update_weights_delta(engine, url)["version"] == v
        with pytest.raises(DeltaError) as e:
            update_weights_delta(engine, case["bad"]["integrity"])
        assert e.value.reason == "integrity"
        with pytest.raises(DeltaError) as e:
            update_weights_delta(engine, "/etc/passwd")
        assert e.value.reason == "forbidden_source"
        assert delta_status(engine)["version"] == STEPS
        ref = dict(server["load"](case["final"]).named_parameters())
        assert all(torch_equal_bits(p, ref[n]) for n, p in model.named_parameters())
    finally:
        sched.close()
        for sig in (signal.SIGTERM, signal.SIGQUIT):  # the TokenizerManager's handlers on this loop
            loop.remove_signal_handler(sig)
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
