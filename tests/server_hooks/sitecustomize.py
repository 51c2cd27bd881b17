"""Test-only hooks into the engine servers the tests start (never part of the package).

A test puts this directory on a server's ``PYTHONPATH`` and sets, in the server's environment:

- ``ENGINE_EXT_TEST_FAULT=<file>``: once the per-rank updater module is imported,
  ``RankUpdater.apply`` runs as usual (its part is written in place and an undo log kept)
  and then, on the rank whose number the file holds, deletes the file and raises: a rank
  that fails in the middle of an update, after writing. One fault per arming (write the
  rank number into the file to arm it).
- ``ENGINE_EXT_TEST_HIDE_AMX=1``: ``torch.cpu._is_amx_tile_supported()`` answers False in the
  server's processes, which is every choice vLLM 0.32's CPU backend makes on it (the sgl GEMM
  path, the ``amx`` attention ISA, the AMX MLA backend, the MoE prepack ISA): an AMX host
  serves as an AVX-512 host without AMX does, so both hosts' paths run wherever the suite runs
  on AMX (the kernels themselves still run on this CPU).
- ``ENGINE_EXT_TEST_QUIET_SPIN=1``: a reader of vLLM's shared-memory message queues (a worker
  waiting for the engine core's next step, the engine core waiting for a worker's reply) that
  is in its busy window (``SpinCondition``: the second after each read) sleeps 0.5 ms before it
  looks again instead of ``sched_yield()``. Spinning, a worker process holds a whole core while
  requests come less than a second apart (``python bench/queue_spin.py``, figures in
  docs/vllm.md): on a 2-core CI host the readers take the cores from the processes they wait
  for. What is computed is unchanged; each message may wait up to 0.5 ms longer.
- ``ENGINE_EXT_TEST_STACKS=1``: SIGUSR2 makes the process write every thread's Python stack to its
  stderr (``faulthandler``), which is the server's log. A test whose server does not answer
  ``/health`` in time and shows no death sends it to the server's process group before stopping it
  (tests/vllm_helpers.py), so a start-up that hangs names the line each process waits on.
"""

import importlib.abc
import importlib.util
import os
import sys

FLAG = os.environ.get("ENGINE_EXT_TEST_FAULT")


def _armed_for() -> int | None:
    try:
        with open(FLAG) as f:
            return int(f.read().strip())
    except (OSError, ValueError, TypeError):
        return None


def _fail_after_apply(module) -> None:
    original = module.RankUpdater.apply

    def apply(self, *args, **kwargs):
        reply = original(self, *args, **kwargs)
        if _armed_for() == self.rank:
            os.unlink(FLAG)
            raise RuntimeError(f"injected fault on rank {self.rank}, after its apply wrote its part")
        return reply

    module.RankUpdater.apply = apply


def _hide_amx(module) -> None:
    module._is_amx_tile_supported = lambda: False


def _quiet_spin(module) -> None:
    import time

    cls = module.SpinCondition
    wait = cls.wait

    def quiet_wait(self, timeout_ms=None):
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(0.0005)  # busy window: look again soon, without holding the core
            return None
        return wait(self, timeout_ms)

    cls.wait = quiet_wait


if os.environ.get("ENGINE_EXT_TEST_STACKS") == "1":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)

PATCHES = {}  # module name -> what to do once it is imported
if FLAG:
    PATCHES["engine_ext.server.rank"] = _fail_after_apply
if os.environ.get("ENGINE_EXT_TEST_HIDE_AMX") == "1":
    PATCHES["torch.cpu"] = _hide_amx
if os.environ.get("ENGINE_EXT_TEST_QUIET_SPIN") == "1":
    PATCHES["vllm.distributed.device_communicators.shm_broadcast"] = _quiet_spin


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())
