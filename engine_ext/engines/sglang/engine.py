"""Tokenizer side: :class:`engine_ext.server.transaction.Ranks` over SGLang's TokenizerManager.

The controller (:mod:`engine_ext.server.controller`) lives in the process that owns the
TokenizerManager: the HTTP server of ``python -m sglang.launch_server``, or the
Python process of an in-process ``sglang.Engine``. It reaches the TP ranks with a
:class:`~engine_ext.engines.sglang.messages.RankOpReq` sent on the TokenizerManager's own
channel to the schedulers, and awaits the single combined
:class:`~engine_ext.engines.sglang.messages.RankOpReply` through SGLang's
``FanOutCommunicator``, registered in the TokenizerManager's result dispatcher
exactly like SGLang's own control requests.

Pause modes map onto SGLang's: ``keep`` (default) is SGLang's ``retract`` pause (no
request fails; running requests go back to the queue and continue with the new
weights, their KV recomputed, since the radix cache is flushed); ``wait`` holds the
TokenizerManager's model-update writer lock (new requests wait, running ones
drain); ``abort`` aborts running requests (SGLang's ``abort`` pause).
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import AsyncExitStack

from ...errors import UnsupportedError
from ...server.controller import Controller, initial_version
from ...server.protocol import RankReply, UpdateRequest
from . import compat
from .messages import RankOpReply, RankOpReq
from .rank import AFTER_UPDATE

log = logging.getLogger("engine_ext")
_SGLANG_PAUSE = {"keep": "retract", "abort": "abort"}


class SglangRanks:
    """Reach every TP rank's scheduler, pause and resume generation, reset caches."""

    def __init__(self, tm):
        self.tm = tm
        # One combined reply per call: scheduler rank 0 gathers the TP ranks' replies.
        self.comm = compat.reply_channel(tm, RankOpReply)
        self._held: AsyncExitStack | None = None
        self._resume_needed = False

    async def call(self, op: str, **kwargs) -> list[RankReply]:
        if compat.topology() != (1, 1):
            raise UnsupportedError("engine_ext on SGLang supports tensor parallelism only (dp_size = pp_size = 1)")
        self.tm.auto_create_handle_loop()
        replies = await self.comm(RankOpReq(op, kwargs))
        return [RankReply.from_wire(w) for w in replies[0].replies]

    async def pause(self, mode: str) -> None:
        self.tm.auto_create_handle_loop()
        if mode == "wait":
            self._held = AsyncExitStack()
            await self._held.enter_async_context(self.tm.model_update_lock.writer_lock)
            return
        if self.tm.is_pause:  # paused by someone else (e.g. /pause_generation): leave it paused
            self._resume_needed = False
            return
        await compat.pause(self.tm, _SGLANG_PAUSE[mode])
        self._resume_needed = True

    async def resume(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            await held.aclose()
        if self._resume_needed:
            self._resume_needed = False
            await compat.resume(self.tm)

    async def after_update(self, version: int) -> None:
        bad = [r for r in await self.call(AFTER_UPDATE, version=version) if not r.ok]
        if bad:
            log.warning(
                "engine_ext: cache flush/version after v%s incomplete on some ranks: %s",
                version,
                "; ".join(f"rank {r.rank}: {r.error}" for r in bad),
            )
        compat.set_weight_version(self.tm, str(version))


# --------------------------------------------------------------------------- controller per TokenizerManager


def install(tm) -> None:
    """Attach an (unstarted) controller to a TokenizerManager; runs right after its dispatcher init."""
    if getattr(tm, "_engine_ext", None) is not None:
        return
    model_path = getattr(getattr(tm, "server_args", None), "model_path", None)
    version = initial_version(model_path if model_path and os.path.isdir(model_path) else None)
    tm._engine_ext = Controller(SglangRanks(tm), version=version, engine_name="sglang")
    tm._engine_ext_start = None
    tm._engine_ext_outside = False


def mark_outside_update(tm) -> None:
    """SGLang's own weight-update API ran (from disk, tensor, distributed, IPC): our
    fingerprints no longer describe the served weights; re-read them before the next op."""
    tm._engine_ext_outside = True


async def controller(tm) -> Controller:
    """The TokenizerManager's controller, started once (the start-up probe of every rank)."""
    ctl = getattr(tm, "_engine_ext", None)
    if ctl is None:  # the embedding program's set-up (the HTTP routes answer 503 unavailable before asking)
        raise RuntimeError("engine_ext is not installed in this SGLang process (is the plugin loaded? SGLANG_PLUGINS)")
    if not ctl.ready:
        task = tm._engine_ext_start
        if task is None or (task.done() and task.exception() is not None):
            task = tm._engine_ext_start = asyncio.ensure_future(ctl.start())
        await asyncio.shield(task)
        tm._engine_ext_outside = False  # the start-up probe read the current weights
    if getattr(tm, "_engine_ext_outside", False):
        tm._engine_ext_outside = False
        try:
            await ctl.resync("weights changed through SGLang's own update API")
        except BaseException:
            tm._engine_ext_outside = True
            raise
    return ctl


# --------------------------------------------------------------------------- in-process sglang.Engine


def update_weights_delta(engine, url: str, **fields) -> dict:
    """Apply the delta at ``url`` to an in-process ``sglang.Engine`` (same body and answer
    as ``POST /update_weights_delta``; failures raise :class:`engine_ext.errors.DeltaError`)."""
    req = UpdateRequest.parse({"url": url, **fields})
    tm = engine.tokenizer_manager

    async def run():
        return await (await controller(tm)).update(req)

    return engine.loop.run_until_complete(run())


def delta_status(engine) -> dict:
    """Version, fingerprint and recent history of an in-process ``sglang.Engine``."""
    tm = engine.tokenizer_manager

    async def run():
        return (await controller(tm)).status()

    return engine.loop.run_until_complete(run())
