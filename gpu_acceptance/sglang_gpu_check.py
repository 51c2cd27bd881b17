"""GPU check of the SGLang adapter: a real SGLang server takes K deltas through
``POST /update_weights_delta`` and then answers exactly like a server cold-started
on the final weights.

What it does (one short call on a lent GPU; needs ``sglang`` with its CUDA kernels
and this project importable; nothing is downloaded):

1. makes a tiny random model locally (``engine_ext/tiny_models.py``; ``--model-dir`` takes
   any local HF checkpoint instead) and publishes version 0 plus K RL-like deltas
   (a few % of elements move per step) to a local store;
2. starts ``python -m sglang.launch_server`` on it with ``SGLANG_PLUGINS=engine_ext``
   (CUDA graphs on: the apply must write in place for the captured graphs to see it),
   records greedy outputs and logprobs, applies the K deltas through the endpoint
   while generation requests keep arriving (none may fail), records the outputs
   again and the server's answers (pause window, phases), checks ``/model_info``'s
   weight version;
3. stops it, cold-starts a server on the final checkpoint, records the same outputs;
4. compares token ids and logprobs exactly; writes everything to ``--out`` (JSON) and
   exits 0 only if they are identical and every request succeeded.

    python gpu_acceptance/sglang_gpu_check.py --out gpu_acceptance/results/sglang_gpu.json [--tp 2]
    python gpu_acceptance/sglang_gpu_check.py --dry-run     # data + commands only (no GPU)
    # the same against CPU servers (how the script itself was checked; docs/sglang.md):
    PYTHONPATH=tests/sglang_stubs python gpu_acceptance/sglang_gpu_check.py --out /tmp/x.json \
        -- --device cpu --max-total-tokens 4096 --skip-server-warmup
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ROUTE = "/update_weights_delta"


def prepare(work: Path, args) -> dict:
    """Model dir, store with v0 + K deltas, and the final checkpoint for the cold start."""
    import torch

    from engine_ext.trainer.publisher import DeltaPublisher
    from engine_ext.store.signing import generate_key
    from engine_ext.tiny_models import load_state_dict, make_model, perturb, save_state_dict

    if args.model_dir:
        model = Path(args.model_dir)
    else:
        model = make_model(work / "model", "qwen2", vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                           heads=args.heads, kv_heads=args.kv_heads)
    sd = load_state_dict(model)
    gen = torch.Generator().manual_seed(0)
    store, urls = work / "store", []
    key = work / "publisher.key"  # the check runs the product as deployed: signed versions, a token
    if not key.exists():
        generate_key(key)
    t = time.perf_counter()
    with DeltaPublisher(str(store), model="sglang-gpu-check", anchor_every=0, signing_key=str(key)) as pub:
        pub.publish(sd, version=0)
        for v in range(1, args.steps + 1):
            sd = perturb(sd, gen, args.density)
            urls.append(pub.publish(sd, version=v))
    final = save_state_dict(work / "final", sd, model)
    return {"model": str(model), "final": str(final), "store": str(store), "urls": urls,
            "publish_s": time.perf_counter() - t, "public_key": f"{key}.pub"}


class Server:
    """``python -m sglang.launch_server`` as a child process (killed with its group)."""

    def __init__(self, model: str, args, env: dict, log: Path):
        self.url = f"http://127.0.0.1:{args.port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(args.port), "--tp-size", str(args.tp), "--dtype", "bfloat16",
               "--mem-fraction-static", str(args.mem_fraction), "--context-length", "512",
               "--random-seed", "0", *(["--enable-deterministic-inference"] if args.deterministic else []),
               *args.server_args]
        self.cmd = cmd
        self.log = open(log, "w")
        self.proc = None if args.dry_run else subprocess.Popen(
            cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {timeout}s; see {self.log.name}")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def generate(url: str, prompts: list[list[int]], max_new: int) -> list[dict]:
    """Greedy outputs with logprobs, one request at a time (same batching in both servers),
    each computed from scratch: a prompt the radix cache holds (e.g. from the load
    generated during the updates) is prefilled differently and differs in the last bits."""
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()
    out = []
    for ids in prompts:
        r = requests.post(url + "/generate", json={
            "input_ids": ids, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}, timeout=120)
        r.raise_for_status()
        body = r.json()
        lp = body["meta_info"]["output_token_logprobs"]
        out.append({"ids": [int(x[1]) for x in lp], "logprobs": [x[0] for x in lp]})
    return out


def background_load(url: str, prompts, stop: threading.Event, stats: dict, k: int):
    """Keep generation requests arriving during the updates; count failures, keep time spans."""
    i = k
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            r = requests.post(url + "/generate", json={"input_ids": prompts[i % len(prompts)],
                              "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}},
                              timeout=120)
            if r.status_code == 200:
                stats["ok"] += 1
                stats["spans"].append((t0, time.monotonic()))
            else:
                stats["failed"] += 1
        except requests.RequestException:
            stats["failed"] += 1
        i += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "gpu_acceptance" / "results" / "sglang_gpu.json"))
    ap.add_argument("--model-dir", help="a local HF checkpoint (default: a tiny random Qwen2 made here)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.03)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=240, help="seconds to wait for each server start")
    ap.add_argument("--deterministic", action="store_true", help="pass --enable-deterministic-inference to both servers")
    ap.add_argument("--work", help="working dir (default: a temp dir, removed at the end)")
    ap.add_argument("--dry-run", action="store_true", help="prepare data, print the commands, start nothing")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="extra sglang.launch_server args after --")
    args = ap.parse_args()
    args.server_args = [a for a in args.server_args if a != "--"]

    work = Path(args.work or tempfile.mkdtemp(prefix="sglang_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"argv": sys.argv, "ok": False}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        try:
            import sglang

            result["sglang"] = sglang.__version__
        except ImportError:
            if not args.dry_run:
                print("sglang is not installed here: this check needs a GPU machine with sglang (CUDA build)", file=sys.stderr)
                return 2
        data = prepare(work, args)
        result["publish_s"] = data["publish_s"]
        import secrets

        token = secrets.token_hex(16)
        auth = {"Authorization": f"Bearer {token}"}
        env = {"SGLANG_PLUGINS": "engine_ext", "ENGINE_EXT_SOURCES": data["store"], "ENGINE_EXT_BASE_VERSION": "0",
               "ENGINE_EXT_TOKEN": token, "ENGINE_EXT_TRUSTED_KEYS": data["public_key"],
               "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)}
        import random

        rnd = random.Random(0)
        prompts = [[rnd.randrange(4, args.vocab if not args.model_dir else 1000) for _ in range(rnd.randrange(4, 40))]
                   for _ in range(8)]

        live = Server(data["model"], args, env, work / "server_live.log")
        if args.dry_run:
            print("live:", " ".join(live.cmd), "\nenv:", env, "\nurls:", data["urls"])
            live.stop()
            return 0
        try:
            result["live_start_s"] = live.wait_ready(args.timeout)
            t0 = time.perf_counter()
            while True:  # the start-up probe (fingerprints of every rank) runs in the background
                st = requests.get(live.url + ROUTE, headers=auth, timeout=30)
                if st.status_code == 200 or time.perf_counter() - t0 > 120:
                    break
                time.sleep(0.5)
            result["status_before"] = st.json()
            result["before"] = generate(live.url, prompts, args.max_new)
            stop, stats = threading.Event(), {"ok": 0, "failed": 0, "spans": []}
            loads = [threading.Thread(target=background_load, args=(live.url, prompts, stop, stats, k)) for k in range(4)]
            for t in loads:
                t.start()
            answers, update_spans = [], []
            try:
                while stats["ok"] + stats["failed"] < 2:  # generation is under way
                    time.sleep(0.05)
                for url in data["urls"]:
                    time.sleep(0.2)  # let new requests join the running batch
                    t0 = time.monotonic()
                    r = requests.post(live.url + ROUTE, json={"url": url}, headers=auth, timeout=300)
                    update_spans.append((t0, time.monotonic()))
                    answers.append({"status": r.status_code, **r.json()})
            finally:
                stop.set()
                for t in loads:
                    t.join()
            stats["across_an_update"] = sum(any(a < u0 and b > u1 for u0, u1 in update_spans) for a, b in stats.pop("spans"))
            result["answers"], result["load_during_updates"] = answers, stats
            result["after"] = generate(live.url, prompts, args.max_new)
            result["status_after"] = requests.get(live.url + ROUTE, headers=auth, timeout=30).json()
            result["model_info"] = requests.get(live.url + "/model_info", timeout=30).json()
        finally:
            live.stop()

        cold = Server(data["final"], args, {}, work / "server_cold.log")
        try:
            result["cold_start_s"] = cold.wait_ready(args.timeout)
            result["cold"] = generate(cold.url, prompts, args.max_new)
            result["cold_repeat"] = generate(cold.url, prompts, args.max_new)  # is the server itself repeatable?
        finally:
            cold.stop()

        same_ids = [a["ids"] == c["ids"] for a, c in zip(result["after"], result["cold"])]
        same_lp = [a["logprobs"] == c["logprobs"] for a, c in zip(result["after"], result["cold"])]
        changed = [a["ids"] != b["ids"] or a["logprobs"] != b["logprobs"] for a, b in zip(result["after"], result["before"])]
        last_fp = json.loads(Path(data["urls"][-1]).read_text())["fingerprint"]
        result["checks"] = {
            "all_updates_200": all(a["status"] == 200 for a in answers),
            "fingerprint_is_final_manifests": result["status_after"].get("fingerprint") == last_fp,
            "final_version": result["status_after"].get("version") == args.steps,
            "weight_version_in_model_info": str(result["model_info"].get("weight_version")) == str(args.steps),
            "ids_identical_to_cold_start": all(same_ids),
            "logprobs_identical_to_cold_start": all(same_lp),
            "outputs_changed_by_updates": any(changed),
            "cold_start_repeatable": result["cold"] == result["cold_repeat"],
            "no_request_failed_during_updates": stats["failed"] == 0 and stats["ok"] > 0,
            "requests_ran_across_updates": stats["across_an_update"] > 0,
        }
        result["pause_ms"] = [a.get("pause_ms") for a in answers]
        result["ok"] = all(v for k, v in result["checks"].items() if k != "weight_version_in_model_info")
        print(json.dumps({k: result[k] for k in ("device", "checks", "pause_ms", "ok")}, indent=1))
        return 0 if result["ok"] else 1
    finally:
        save_result(Path(args.out), result, work, ("server_live.log", "server_cold.log"), remove_work=not args.work)


def save_result(out: Path, result: dict, work: Path, logs: tuple[str, ...], remove_work: bool) -> None:
    """Write a GPU check's JSON and copy its server logs next to it (kept after a lease ends);
    remove the working dir unless the caller chose it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    for log in logs:
        if (work / log).exists():
            shutil.copy(work / log, out.with_suffix(f".{log}"))
    if remove_work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
