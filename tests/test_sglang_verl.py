"""verl 0.9.1's sync into a live SGLang 0.5.23 CPU server: the same manager and actor as
tests/test_verl.py, an SGLang replica instead of a vLLM one.

verl's SGLang rollout (``async_sglang_server.SGLangHttpServer``) launches SGLang through
``Engine._launch_subprocesses`` (which loads the general plugins, as every scheduler process
does) and serves SGLang's own ``http_server.app``: the process and app that
``python -m sglang.launch_server`` gives, which is what this test starts. The replica object is
a fake (verl's ``SGLangReplica`` places its servers on GPUs); the actor side runs verl's own
``update_weights`` in a Ray worker (tests/verl_actor.py). Three versions (an anchor and two
deltas of real AdamW steps of a tied Qwen2) end with the trainer's fingerprint served; an
unsigned version fails the sync, names the replica, and changes nothing; greedy outputs then
equal SGLang's own dense reload of the trainer's final weights in the same server.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# full: CI runs the vLLM case (tests/test_verl.py); this one repeats it on SGLang (`scripts/test.sh --full`)
pytestmark = [pytest.mark.sglang, pytest.mark.engine, pytest.mark.full]
pytest.importorskip("sglang", reason="needs the SGLang virtualenv (.ci/setup-sglang.sh)")
pytest.importorskip("verl")
ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "sglang_stubs"))
sys.path.insert(0, str(HERE))

from test_sglang_live import AUTH, ROUTE, generate, stop_server as stop  # noqa: E402
from test_sglang_tp import _free_port  # noqa: E402
from verl_actor import Replica, VerlActor, manager_for, verl_config  # noqa: E402


def start_sglang(model, sources: str, log: Path):
    port = _free_port()
    env = dict(os.environ, SGLANG_PLUGINS="engine_ext", ENGINE_EXT_SOURCES=sources, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(HERE / "sglang_stubs"), str(ROOT), os.environ.get("PYTHONPATH")] if p))
    out = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--context-length", "256",
         "--max-total-tokens", "4096", "--skip-server-warmup", "--random-seed", "0", "--sleep-on-idle"],
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise AssertionError(f"SGLang did not come up ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            r = requests.get(url + ROUTE, headers=AUTH, timeout=5)
            if r.status_code == 200 and r.json().get("fingerprint"):
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(1)


def status(url: str) -> dict:
    return requests.get(url + ROUTE, headers=AUTH, timeout=30).json()


def test_verl_sync_into_a_live_sglang_server(tmp_path):
    from engine_ext.fleet import WeightSyncError
    from engine_ext.format import fingerprint as fpr
    from engine_ext.tiny_models import make_model, save_state_dict

    def fingerprint(state) -> str:
        return fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in state.items()}))

    model = make_model(tmp_path / "model", "qwen2-tied")
    stores = tmp_path / "stores"
    store = str(stores / "run1")
    env = {k: v for k, v in os.environ.items() if k.startswith("ENGINE_EXT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": env})
    proc, url = start_sglang(model, str(stores), tmp_path / "server.log")
    try:
        remote = ray.remote(VerlActor)
        actor = remote.remote(str(model), {"store": store, "anchor_every": 0})
        manager = manager_for(verl_config(store, manager_line=True), actor, [Replica(0, url)])  # RayPPOTrainer's way
        for step in range(3):
            if step:
                ray.get(actor.train_step.remote())
            m = manager.update_weights(step)
            st = status(url)
            assert st["version"] == step and m["engine_ext/version"] == step
            assert st["fingerprint"] == fingerprint(ray.get(actor.served.remote()))
        assert m["engine_ext/fetched_bytes"] > 0 and m["engine_ext/stored_bytes"] < m["engine_ext/dense_bytes"] / 4, m
        served = ray.get(actor.served.remote())
        after = generate(url)

        unsigned = remote.options(runtime_env={"env_vars": {"ENGINE_EXT_SIGNING_KEY": ""}}).remote(
            str(model), {"store": str(stores / "unsigned")})
        ray.get(unsigned.train_step.remote())
        other = manager_for(verl_config(str(stores / "unsigned"), retries=0), unsigned, [Replica(0, url)])
        before = status(url)
        with pytest.raises(WeightSyncError, match=rf"replica 0 \({url}\): .*signature"):
            other.update_weights(5)
        now = status(url)
        assert (now["version"], now["fingerprint"]) == (before["version"], before["fingerprint"])

        final = save_state_dict(tmp_path / "final", served, like=model)  # SGLang's own dense reload of them
        r = requests.post(url + "/update_weights_from_disk", json={"model_path": str(final)}, timeout=300)
        assert r.status_code == 200 and r.json().get("success"), r.text
        assert generate(url) == after
    finally:
        stop(proc)
        ray.shutdown()
