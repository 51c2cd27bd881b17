"""What a vLLM CPU server burns between requests, by shape, side by side in one run.

    python bench/queue_spin.py                  # a tiny Qwen2, 30 s of a request every 0.4 s per shape
    python bench/queue_spin.py --seconds 60 --gap 0.2

vLLM's processes wait for each other on shared-memory queues (``shm_broadcast.MessageQueue``), and a
reader spins on ``sched_yield()`` for a second after each message it read (``SpinCondition``). A worker
process therefore holds a core while requests come less than a second apart. The shapes, each started
in turn on the same model with the plugin:

* ``tp1-in-core``: the engine core runs its one worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
* ``tp1-worker``: vLLM CPU's default, a worker process of its own;
* ``tp1-worker-quiet`` and ``tp2-quiet``: with tests/server_hooks' ``ENGINE_EXT_TEST_QUIET_SPIN=1``
  (a reader in its busy window sleeps 0.5 ms between looks), which the test suite runs with;
* ``tp2``: two worker processes.

Each shape's figure is the CPU time of every process in the server's session (``/proc``), from the
first to the last of the timed requests, with the number of requests served and their median latency.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# tests/server_hooks first on the servers' path, then this checkout (the hooks are test-only, never packaged)
HOOKS = os.pathsep.join(p for p in [str(ROOT / "tests" / "server_hooks"), str(ROOT), os.environ.get("PYTHONPATH")] if p)
SHAPES = {  # name -> (tensor-parallel size, extra server environment)
    "tp1-in-core": (1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    "tp1-worker": (1, {"ENGINE_EXT_TEST_QUIET_SPIN": "0"}),
    "tp1-worker-quiet": (1, {"ENGINE_EXT_TEST_QUIET_SPIN": "1", "PYTHONPATH": HOOKS}),
    "tp2": (2, {"ENGINE_EXT_TEST_QUIET_SPIN": "0"}),
    "tp2-quiet": (2, {"ENGINE_EXT_TEST_QUIET_SPIN": "1", "PYTHONPATH": HOOKS}),
}


def session_cpu_s(sid: int) -> float:
    """User and system CPU seconds of every live process in session ``sid`` (a server and its children)."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(model: Path, tp: int, env: dict, seconds: float, gap: float, log: Path) -> dict:
    from engine_ext.engines.vllm.launcher import VllmServer

    if tp == 1:
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0", **env}
    server = VllmServer(model, tp=tp, env=env, log=log, token="")
    try:
        server.complete([11, 12, 13, 14, 15, 16, 17, 18], max_tokens=1, logprobs=0)  # warm-up (> 4 tokens)
        cpu0, t0, latencies = session_cpu_s(server.proc.pid), time.perf_counter(), []
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            requests.post(server.url + "/v1/completions", timeout=120, json={
                "model": server.model, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}).raise_for_status()
            latencies.append(time.perf_counter() - t)
            time.sleep(gap)
        return {"cpu_s": session_cpu_s(server.proc.pid) - cpu0, "wall_s": time.perf_counter() - t0,
                "requests": len(latencies), "median_ms": 1000 * statistics.median(latencies)}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--gap", type=float, default=0.4, help="seconds between one answer and the next request")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    from engine_ext.tiny_models import make_model

    with tempfile.TemporaryDirectory(prefix="engine_ext_spin_") as tmp:
        model = make_model(Path(tmp) / "model", "qwen2")
        print("| shape | server CPU-s | wall s | cores busy | requests | median latency (ms) |\n|---|---:|---:|---:|---:|---:|")
        for name in args.shapes.split(","):
            tp, env = SHAPES[name]
            r = measure(model, tp, env, args.seconds, args.gap, Path(tmp) / f"{name}.log")
            print(f"| {name} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['cpu_s'] / r['wall_s']:.2f} | {r['requests']} | "
                  f"{r['median_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
