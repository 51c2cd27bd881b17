"""Real vLLM CPU servers for the tests, on the package's launcher
(:class:`engine_ext.engines.vllm.launcher.VllmServer`), plus the trajectories they serve.

Every server is warmed up with one 8-token request right after start unless the test
asks otherwise (``warmup=False``): on AMX hosts vLLM 0.32's CPU attention dies with
SIGILL when the first step has at most 4 tokens and nothing asked Linux for AMX
permission before (docs/vllm.md, "Known vLLM CPU issues"). The plugin asks itself;
the warm-up keeps the suite safe on such hosts even if it could not, and
``test_vllm_endpoint.py`` deliberately starts without it.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import server_report  # noqa: E402
from engine_ext.tiny_models import load_state_dict, make_model, save_state_dict  # noqa: E402
from engine_ext.engines.vllm.launcher import ServerDied, VllmServer, cpu_flags, free_port  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [9, 9, 9, 9, 9, 9], [999, 17, 450, 3, 77]]
# tests/server_hooks on a server's PYTHONPATH: test-only faults and switches (its docstring), set by ENGINE_EXT_TEST_* variables
HOOKS = {"PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parent / "server_hooks"), os.environ.get("PYTHONPATH")] if p)}
_SERVERS = itertools.count()  # default log names
WARMUP_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]  # > 4 tokens: oneDNN asks for AMX permission on the way


def process_group_stacks(pgid: int, log: Path, settle_s: float = 3.0, most_lines: int = 400) -> str:
    """The Python stacks of every thread of a process group whose processes write to ``log``: SIGUSR2
    to the group (each process's ``faulthandler``, tests/server_hooks: ``ENGINE_EXT_TEST_STACKS=1``),
    then what they appended to the log."""
    before = log.stat().st_size if log.exists() else 0
    try:
        os.killpg(pgid, signal.SIGUSR2)
    except ProcessLookupError:
        return "(no process of the group is left to ask for its stacks)"
    time.sleep(settle_s)
    with open(log, "rb") as f:
        f.seek(before)
        lines = f.read().decode(errors="replace").splitlines()
    more = f"\n[... {len(lines) - most_lines} more lines in {log}]" if len(lines) > most_lines else ""
    return "stacks of the server's processes (SIGUSR2):\n" + "\n".join(lines[:most_lines]) + more


class StartHung(TimeoutError):
    """A server that neither answered ``/health`` in time nor died; the stacks of its processes follow."""


class Server(VllmServer):
    """A test server: logs noted for failure reports, CPU paths noted for the run summary.

    A start that hangs (no ``/health`` within the launcher's 300 s, no process death in the log) is
    started once more, as an orchestrator's readiness probe would restart it: before the hung one is
    stopped, its processes write their threads' stacks into its log (SIGUSR2, tests/server_hooks), the
    log is kept as ``<log>.hung`` and the run's summary names it (conftest.py). A second hang fails the
    test with those stacks. On a loaded 2-core CI host a TP 2 server once stopped after its load
    (both ranks' census logged, nothing more for 280 s) where it starts in ~35 s alone."""

    def __init__(self, model, *, warmup: bool = True, log=None, fallback: tuple[str, ...] = (),
                 worker_process: bool = False, **kw):
        if kw.get("tp", 1) == 1:  # under pytest-xdist, each worker's servers compute on a core of their own
            worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(worker % (os.cpu_count() or 1))}
            if not worker_process:
                # The engine core runs its one worker itself (vLLM's UniProcExecutor, the shape vLLM takes on one
                # GPU): the API server <-> engine core seam stays, one process start fewer (~12 of a start's ~31
                # CPU-s on 2 cores). vLLM CPU's own default, a worker process of its own (``worker_process=True``),
                # is test_vllm_endpoint's (its main server), test_vllm_api_servers' and the chaos soak's.
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            kw["env"] = {**env, **(kw.get("env") or {})}
        log = log or f"/tmp/engine_ext_vllm_{os.getpid()}_{next(_SERVERS)}.log"
        server_report.note_log(log)  # before the start: a server that fails to start shows its log too
        try:
            super().__init__(model, log=log, **kw)
        except StartHung:
            hung = Path(f"{log}.hung")
            os.replace(log, hung)
            server_report.note_hang(hung)
            super().__init__(model, log=log, **kw)
        try:
            layout = self.status().get("layout") or {}
            engine = (layout.get("engine") or [{}])[0]
            hidden = " (AMX hidden from vLLM)" if "1" in ((kw.get("env") or {}).get("ENGINE_EXT_TEST_HIDE_AMX"),
                                                          os.environ.get("ENGINE_EXT_TEST_HIDE_AMX")) else ""
            paths = (f"CPU flags [{' '.join(cpu_flags())}]{hidden}: GEMM paths {engine.get('gemm')}, attention ISA "
                     f"{engine.get('attention_isa')}" + (f", MLA {engine['mla']}" if engine.get("mla") else "") +
                     f", AMX permission {engine.get('amx')}, converting maps {len(layout.get('converted', []))}")
            server_report.note_engine(f"{paths}, dense fallback {layout.get('fallback')}",
                                      f"{Path(self.model).name} tp={kw.get('tp', 1)}")
            # Loud, whichever test started the server: a tensor this host's engine path leaves to the dense
            # fallback is reloaded whole at every version, and a cell that passes anyway hides the path.
            # ``fallback``: the tensors the engine computes at load on every path (Mamba's A = -exp(A_log)):
            # reloaded through its own loader, bit-equal, and named by the test that expects them
            assert sorted(layout.get("fallback") or []) == sorted(fallback), (
                f"dense fallback on this host ({paths}): {layout.get('fallback')}; every tensor must be mapped "
                "in place on every CPU path (engine_ext/engines/vllm/patches.py)")
            if warmup:
                self.complete(WARMUP_PROMPT, max_tokens=1, logprobs=0)
        except BaseException:
            self.stop()  # a server that started but cannot be used is not left running
            raise

    def _wait(self, timeout: float) -> None:
        try:
            super()._wait(timeout)
        except TimeoutError as e:
            raise StartHung(f"{e}\n{process_group_stacks(self.proc.pid, self.log_path)}") from None

    def outputs(self) -> list:
        """Greedy token ids, logprobs and top-k alternatives per prompt: compared bit for bit."""
        out = []
        for p in PROMPTS:
            c = self.complete(p)["choices"][0]
            lp = c["logprobs"]
            out.append((c["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        return out


def assert_layout_on_this_host(status: dict) -> None:
    """Every tensor mapped in place on whichever CPU GEMM path the host took: none in the dense
    fallback; linear biases mapped through converting maps exactly where the sgl path (AMX hosts)
    keeps them in float32; AMX permission granted in the workers wherever the CPU has AMX."""
    layout = status["layout"]
    assert layout["fallback"] == [], layout
    for engine in layout["engine"]:
        assert all(n.endswith(".bias") for n in layout["converted"]), layout["converted"]
        assert bool(layout["converted"]) == ("sgl" in engine["gemm"]), layout
        assert engine["amx"] in (None, True), engine  # None: no AMX on this CPU


def rl_trajectory(model_dir, store, steps: int, *, seed: int = 1, lr: float = 1e-3, anchor_every: int = 0,
                  start_version: int | None = None, **publisher) -> dict[str, torch.Tensor]:
    """Publish an anchor of ``model_dir`` then ``steps`` deltas of a noisy-update trajectory; return the
    final bf16 weights. ``publisher``: more DeltaPublisher arguments (e.g. ``chunk_min_cell``)."""
    from engine_ext.trainer.publisher import DeltaPublisher

    master = {n: t.float() for n, t in load_state_dict(model_dir).items()}
    g = torch.Generator().manual_seed(seed)
    with DeltaPublisher(str(store), anchor_every=anchor_every, start_version=start_version, **publisher) as pub:
        pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})
        for _ in range(steps):
            for t in master.values():
                t.add_(torch.randn(t.shape, generator=g) * lr * (t.abs().mean() + 1e-3))
            pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


class Trainer:
    """A trainer's side in a test: the served model's weights as fp32 masters (``transformers``), moved a
    little at every step (an optimizer's noise), served in bf16."""

    def __init__(self, model_dir, seed: int = 1, lr: float = 1e-3):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.g, self.lr = torch.Generator().manual_seed(seed), lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=self.g) * self.lr * (p.abs().mean() + 1e-3))

    def served(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in self.model.named_parameters()}


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """The model fingerprint of a state dict (what a manifest and a server's status show)."""
    from engine_ext.format import fingerprint as fpr

    return fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in state.items()}))


def broken_copy(src, dst, version: int, how: str) -> str:
    """A copy of the store ``src`` at ``dst`` whose ``version`` is unsigned (``how="unsigned"``), has
    a corrupted blob (``"corrupt"``), or is intact (elsewhere: ``"outside"``); its manifest's path."""
    dst = copy_store(src, dst)
    if how == "unsigned":
        (dst / f"v{version:08d}.json.sig").unlink()
    elif how == "corrupt":
        blob = next(dst.glob(f"v{version:08d}.0.*.bin"))
        b = bytearray(blob.read_bytes())
        b[len(b) // 2] ^= 0x40
        blob.write_bytes(bytes(b))
    return str(dst / f"v{version:08d}.json")


def copy_store(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


__all__ = ["Server", "ServerDied", "PROMPTS", "assert_layout_on_this_host", "rl_trajectory", "copy_store", "make_model", "save_state_dict",
           "load_state_dict", "free_port", "Trainer", "fingerprint", "broken_copy"]
