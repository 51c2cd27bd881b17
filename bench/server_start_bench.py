"""What the plugin adds to a vLLM CPU server's start, at its defaults, side by side in one run.

    python bench/server_start_bench.py                # a ~170 M-parameter Qwen2, 3 rounds of each
    python bench/server_start_bench.py --layers 24    # bigger

Each round starts the same model twice, in turn: without the plugin (``VLLM_PLUGINS=""``:
neither the general nor the endpoint plugin loads) and with it (``VLLM_PLUGINS=engine_ext``:
the CPU patches, and the start-up probe of every rank: layout, live fingerprints, and the
check that every served tensor equals the checkpoint it was loaded from). "Healthy" is
``/health`` answering; "updatable" is the plugin's status holding a fingerprint (the probe
done). Prints the medians and their ratio.
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


def start(model: Path, plugin: bool, log: Path) -> tuple[float, float | None]:
    from engine_ext.engines.vllm.launcher import VllmServer

    env = {"ENGINE_EXT_NO_AUTH": "1"} if plugin else {"VLLM_PLUGINS": ""}
    t = time.perf_counter()
    server = VllmServer(model, log=log, env=env, token="")
    try:
        healthy = time.perf_counter() - t
        if not plugin:
            return healthy, None
        while not requests.get(server.url + "/update_weights_delta", timeout=30).json().get("fingerprint"):
            time.sleep(0.1)
        return healthy, time.perf_counter() - t
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from engine_ext.tiny_models import load_state_dict, make_model

    with tempfile.TemporaryDirectory(prefix="engine_ext_start_") as tmp:
        model = make_model(Path(tmp) / "model", "qwen2", vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                           heads=16, kv_heads=2)
        params = sum(t.numel() for t in load_state_dict(model).values())
        runs = {False: [], True: []}
        for i in range(args.rounds):
            for plugin in (False, True):
                runs[plugin].append(start(model, plugin, Path(tmp) / f"{i}_{plugin}.log"))
                print(f"round {i + 1}, plugin {plugin}: healthy {runs[plugin][-1][0]:.1f} s"
                      + (f", updatable {runs[plugin][-1][1]:.1f} s" if plugin else ""), flush=True)
    bare = statistics.median(h for h, _ in runs[False])
    healthy = statistics.median(h for h, _ in runs[True])
    ready = statistics.median(r for _, r in runs[True])
    print(f"\n{params / 1e6:.0f} M parameters, {os.cpu_count()} cores, medians of {args.rounds} rounds")
    print("| | without the plugin | with the plugin | ratio |\n|---|---|---|---|")
    print(f"| healthy | {bare:.1f} s | {healthy:.1f} s | {healthy / bare:.2f}x |")
    print(f"| updatable (probe and load check done) | — | {ready:.1f} s | {ready / bare:.2f}x |")


if __name__ == "__main__":
    main()
