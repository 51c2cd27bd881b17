"""The test harness's own hooks into the servers it starts (tests/server_hooks, tests/vllm_helpers.py),
on plain Python processes: no engine starts here.

A server start that hangs must explain itself: its processes write their stacks on SIGUSR2, and the
test ``Server`` starts a hung server once more, keeping the hung one's log and naming it in the run's
summary. The retry is checked with the launcher replaced (a mock: a real hang costs a 300 s wait).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import server_report
import vllm_helpers

HOOKS = Path(__file__).resolve().parent / "server_hooks"
WAITER = """
import threading, time
def the_line_a_hung_start_waits_on():
    time.sleep(60)
threading.Thread(target=the_line_a_hung_start_waits_on, daemon=True).start()
print("up", flush=True)
the_line_a_hung_start_waits_on()
"""


def test_a_hung_process_group_names_the_line_each_thread_waits_on(tmp_path):
    log = tmp_path / "server.log"
    env = {**os.environ, "ENGINE_EXT_TEST_STACKS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [str(HOOKS), os.environ.get("PYTHONPATH")] if p)}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", WAITER], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.time() + 30
        while "up" not in log.read_text() and time.time() < deadline:
            time.sleep(0.05)
        stacks = vllm_helpers.process_group_stacks(proc.pid, log)  # its 3 s to answer, as a server gets: a loaded host
        assert proc.poll() is None, "SIGUSR2 must not stop a process that registered the hook"
        assert stacks.count("the_line_a_hung_start_waits_on") >= 2, stacks  # both threads, each at its line
        assert "Thread 0x" in stacks, stacks
    finally:
        proc.kill()
        proc.wait()
    assert "no process of the group" in vllm_helpers.process_group_stacks(proc.pid, log, settle_s=0)


def test_a_hung_start_is_started_again_once_and_named(tmp_path, monkeypatch):
    """Mock launcher: each start writes its log, then hangs as told (raises StartHung) or succeeds."""
    starts = []

    def fake_start(self, model, *, log, hangs, **kw):
        Path(log).write_text(f"start {len(starts)}\n")
        starts.append(log)
        if len(starts) <= hangs:
            raise vllm_helpers.StartHung("vLLM server not healthy after 300s; stacks ...")
        raise RuntimeError("started")  # stands for the rest of Server.__init__ (no real server behind it)

    monkeypatch.setattr(vllm_helpers.VllmServer, "__init__", fake_start)
    monkeypatch.setattr(server_report, "HANGS", [])
    monkeypatch.delenv("ENGINE_EXT_TEST_REPORT", raising=False)
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="started"):
        vllm_helpers.Server("model", log=log, hangs=1)
    assert len(starts) == 2 and log.read_text() == "start 1\n"
    assert (tmp_path / "server.log.hung").read_text() == "start 0\n"
    assert server_report.hangs() == [str(tmp_path / "server.log.hung")]

    starts.clear()
    with pytest.raises(vllm_helpers.StartHung):  # a second hang fails the test
        vllm_helpers.Server("model", log=log, hangs=2)
    assert len(starts) == 2
