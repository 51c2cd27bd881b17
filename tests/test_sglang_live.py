"""A live SGLang 0.5.23 server on the CPU (``--device cpu``, torch-native kernels, TP 2
by default: one scheduler process per TP rank) with the ``engine_ext`` plugin: deltas through ``POST /update_weights_delta`` while
generation requests keep arriving, then greedy outputs and logprobs must equal those
after SGLang's own dense reload of the final checkpoint (``/update_weights_from_disk``,
SGLang's loader) in the same server.

Everything is real: ``python -m sglang.launch_server`` with its TokenizerManager,
scheduler and detokenizer processes, the plugin loaded by SGLang in each of them, the
ZMQ path, the radix cache flush, the weight version in ``/model_info``. The only
addition is the test-only torchvision stub on ``PYTHONPATH`` (tests/sglang_stubs).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.engine]
pytest.importorskip("sglang", reason="needs the SGLang virtualenv (.ci/setup-sglang.sh)")
requests = pytest.importorskip("requests")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "sglang_stubs"))
sys.path.insert(0, str(HERE))

from test_sglang_tp import STEPS, _free_port, make_case  # noqa: E402

ROUTE = "/update_weights_delta"
AUTH = {"Authorization": f"Bearer {os.environ['ENGINE_EXT_TOKEN']}"}  # conftest: every route needs the token
TP = int(os.environ.get("ENGINE_EXT_SGLANG_LIVE_TP", "2"))  # 2: two scheduler processes, one per core
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [17] * 12, [900, 4, 33, 512, 7]]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang_live")
    case = make_case(tmp, "qwen2")
    port = _free_port()
    env = dict(os.environ, SGLANG_PLUGINS="engine_ext", ENGINE_EXT_SOURCES=",".join(case["sources"]),
               ENGINE_EXT_BASE_VERSION="0", OMP_NUM_THREADS="1",
               # SGLang's CPU TP binds each rank to cores; without it TP > #NUMA nodes is refused.
               SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r % (os.cpu_count() or 1)) for r in range(TP)),
               PYTHONPATH=os.pathsep.join(p for p in [str(HERE / "sglang_stubs"), str(ROOT), os.environ.get("PYTHONPATH")] if p))
    log = open(tmp / "server.log", "w")
    # --sleep-on-idle (SGLang's own flag): between requests the scheduler waits on its sockets; without it an idle
    # TP 2 server here keeps 1.4 of the host's 2 cores busy, taken from the suite running beside it (0.06 with it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", case["model"], "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--context-length", "256",
         "--max-total-tokens", "4096", "--skip-server-warmup", "--random-seed", "0", "--tp-size", str(TP), "--sleep-on-idle"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{(tmp / 'server.log').read_text()[-4000:]}"
            assert time.monotonic() < deadline, "server did not come up in 300 s"
            try:
                r = requests.get(url + ROUTE, headers=AUTH, timeout=5)
                if r.status_code == 200 and r.json().get("fingerprint"):
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        yield {"url": url, "case": case, "log": tmp / "server.log"}
    finally:
        stop_server(proc)
        log.close()


def stop_server(proc) -> None:
    """Stop an SGLang server we started (its whole process group: launcher, TokenizerManager, schedulers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def generate(url: str) -> list:
    """Greedy ids and logprobs, each prompt computed from scratch (radix cache flushed)."""
    assert requests.post(url + "/flush_cache", timeout=30).status_code == 200
    out = []
    for ids in PROMPTS:
        r = requests.post(url + "/generate", json={"input_ids": ids, "return_logprob": True,
                          "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}, timeout=120)
        r.raise_for_status()
        out.append([(x[1], x[0]) for x in r.json()["meta_info"]["output_token_logprobs"]])
    return out


def test_live_server_deltas_under_load_equal_sglangs_own_reload(live):
    url, case = live["url"], live["case"]
    before = generate(url)

    stop, stats, spans = threading.Event(), {"ok": 0, "failed": []}, []

    def load(k):
        i = k
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = requests.post(url + "/generate", json={"input_ids": PROMPTS[i % len(PROMPTS)],
                                  "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}},
                                  timeout=120)
                if r.status_code == 200:
                    stats["ok"] += 1
                    spans.append((t0, time.monotonic()))
                else:
                    stats["failed"].append(r.text)
            except requests.RequestException as e:
                stats["failed"].append(repr(e))
            i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    answers, update_spans = [], []
    try:
        while stats["ok"] + len(stats["failed"]) < 2:  # generation is under way
            time.sleep(0.05)
        for u, mode in zip(case["urls"], ["keep", "wait", "keep"]):
            time.sleep(0.2)  # let new requests get into the running batch
            t0 = time.monotonic()
            answers.append(requests.post(url + ROUTE, json={"url": u, "pause_mode": mode}, headers=AUTH, timeout=120))
            update_spans.append((t0, time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join()
    # some requests were running across an update and still completed
    assert any(a < u0 and b > u1 for a, b in spans for u0, u1 in update_spans), (spans, update_spans)
    assert [a.status_code for a in answers] == [200] * STEPS, [a.text for a in answers]
    assert [a.json()["version"] for a in answers] == list(range(1, STEPS + 1))
    assert all(a.json()["fallback"] == [] for a in answers)
    assert stats["ok"] > 0 and stats["failed"] == [], stats  # no request failed during the updates

    after = generate(url)
    assert after != before  # the deltas changed what is served
    assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == str(STEPS)
    status = requests.get(url + ROUTE, headers=AUTH, timeout=10).json()
    assert status["version"] == STEPS and status["engine"] == "sglang"

    r = requests.post(url + ROUTE, json={"url": case["bad"]["integrity"]}, headers=AUTH, timeout=60)
    assert r.status_code == 422 and r.json()["reason"] == "integrity"
    r = requests.post(url + ROUTE, json={"url": case["bad"]["verify"]}, headers=AUTH, timeout=60)
    assert r.status_code == 500 and r.json()["reason"] == "verify"  # applied, verified, rolled back
    assert generate(url) == after  # refused deltas changed nothing

    # SGLang's own dense reload of the final checkpoint: the served outputs must not move.
    r = requests.post(url + "/update_weights_from_disk", json={"model_path": case["final"]}, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert generate(url) == after
    # and our fingerprints, re-read after SGLang's own update, still say version-3 weights
    fp = requests.get(url + ROUTE, headers=AUTH, timeout=30).json()
    assert fp["fingerprint"] == answers[-1].json()["fingerprint"]
