"""Real vLLM CPU servers for the tests: start, query, stop (by process group id).

Each server runs ``python -m vllm.entrypoints.openai.api_server`` on a free
loopback port with ``VLLM_PLUGINS=engine_ext``; callers stop it in ``finally``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import load_state_dict, make_model, save_state_dict  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [9, 9, 9, 9, 9, 9], [999, 17, 450, 3, 77]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | os.PathLike, *, sources: str = "", tp: int = 1, base_version: int | None = None,
                 log: str | os.PathLike | None = None, extra_env: dict | None = None, startup_s: float = 300):
        self.model, self.port = str(model), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_PLUGINS="engine_ext", VLLM_CPU_KVCACHE_SPACE="1", ENGINE_EXT_SOURCES=sources)
        env.pop("ENGINE_EXT_BASE_VERSION", None)
        if base_version is not None:
            env["ENGINE_EXT_BASE_VERSION"] = str(base_version)
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
        env.update(extra_env or {})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--dtype", "bfloat16",
               "--max-model-len", "256", "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port),
               "--tensor-parallel-size", str(tp), "--max-num-seqs", "16"]
        self.log_path = Path(log or f"/tmp/engine_ext_vllm_{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(startup_s)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); log: {self.log_path}\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not healthy after {timeout}s; log {self.log_path}\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "".join(open(self.log_path, errors="replace").readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # our own process group (start_new_session)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- requests
    def complete(self, prompt, max_tokens: int = 12, logprobs: int = 3, timeout: float = 120) -> dict:
        r = requests.post(self.url + "/v1/completions", timeout=timeout, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": logprobs, "ignore_eos": True})
        r.raise_for_status()
        return r.json()

    def outputs(self) -> list:
        """Greedy token ids, logprobs and top-k alternatives per prompt: compared bit for bit."""
        out = []
        for p in PROMPTS:
            c = self.complete(p)["choices"][0]
            lp = c["logprobs"]
            out.append((c["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        return out

    def update(self, body, headers: dict | None = None, timeout: float = 300) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return requests.post(self.url + "/update_weights_delta", data=data, headers=headers or {}, timeout=timeout)

    def status(self) -> dict:
        return requests.get(self.url + "/update_weights_delta", timeout=30).json()


def rl_trajectory(model_dir, store, steps: int, *, seed: int = 1, lr: float = 1e-3, anchor_every: int = 0,
                  start_version: int = 0) -> dict[str, torch.Tensor]:
    """Publish an anchor of ``model_dir`` then ``steps`` deltas of a noisy-update trajectory; return the final bf16 weights."""
    from engine_ext.publish import DeltaPublisher

    master = {n: t.float() for n, t in load_state_dict(model_dir).items()}
    g = torch.Generator().manual_seed(seed)
    with DeltaPublisher(str(store), anchor_every=anchor_every, start_version=start_version) as pub:
        pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})
        for _ in range(steps):
            for t in master.values():
                t.add_(torch.randn(t.shape, generator=g) * lr * (t.abs().mean() + 1e-3))
            pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


def copy_store(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


__all__ = ["Server", "PROMPTS", "rl_trajectory", "copy_store", "make_model", "save_state_dict", "load_state_dict", "free_port"]
