"""The ``delta`` weight-transfer backend: vLLM's own update API drives the update transaction.

With ``weight_transfer_config={"backend": "delta"}`` (``--weight-transfer-config
'{"backend": "delta"}'``), ``LLM.update_weights({"update_info": {"url": ...}})`` and
vLLM's RL routes run the same :class:`~engine_ext.server.transaction.UpdateTransaction` as
``POST /update_weights_delta``: chains and anchors from the served version, the
version kept, every rank verified and rolled back together. vLLM calls the backend in
every worker at once; worker rank 0 drives the transaction
(:class:`WorkerGroupRanks`) and every other worker follows its ops (:func:`follow`)
over the workers' CPU process group until rank 0 says it is done.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...server.controller import Controller, initial_version
from ...server.protocol import RankReply, UpdateRequest
from ...server.rank import run_op
from . import compat
from .worker import updater_for

_DONE, _OP = "done", "op"


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    url: str  # manifest URI or path, or a store root (its LATEST); must be under ENGINE_EXT_SOURCES
    base_version: int | None = None  # refuse unless the engine holds this version


class WorkerGroupRanks:
    """:class:`engine_ext.server.transaction.Ranks` from worker rank 0 to every worker of an in-process engine.

    Each op is broadcast to the followers, run here, and every reply gathered back here.
    Generation does not run during ``update_weights`` (vLLM calls it between steps), so
    pause and resume are no-ops; the caller resets caches and sets the weight version
    (``finish_weight_update(weight_version=...)``, ``reset_prefix_cache``).
    """

    def __init__(self, updater, group, world: int):
        self.updater, self.group, self.world = updater, group, world

    async def call(self, op: str, **kwargs) -> list[RankReply]:
        if self.world > 1:
            dist.broadcast_object_list([(_OP, op, kwargs)], src=0, group=self.group)
        mine = run_op(self.updater, op, kwargs, rank=0)
        replies = [mine]
        if self.world > 1:
            replies = [None] * self.world
            dist.gather_object(mine, replies, dst=0, group=self.group)
        return [RankReply.from_wire(w) for w in replies]

    async def pause(self, mode: str) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def after_update(self, version: int) -> None:
        pass

    def release(self, error: str | None) -> None:
        """Tell the followers the transaction ended (with rank 0's error, if it failed)."""
        if self.world > 1:
            dist.broadcast_object_list([(_DONE, error)], src=0, group=self.group)


def follow(updater, group, rank: int) -> str | None:
    """On a worker other than rank 0: run rank 0's ops until it is done; its error, if any."""
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=group)
        if msg[0][0] == _DONE:
            return msg[0][1]
        _, op, kwargs = msg[0]
        dist.gather_object(run_op(updater, op, kwargs, rank=rank), None, dst=0, group=group)


class DeltaWeightTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    _controller: Controller | None = None

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        """Once, before the first update: every rank probes its layout and fingerprints its weights."""
        self._drive(lambda ctl: ctl.start())

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronises an accelerator, which fails on CPU-only hosts;
        # the transaction is synchronous already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: DeltaUpdateInfo) -> None:
        """One update transaction to ``info.url``; raises (on every rank) when it did not commit."""
        req = UpdateRequest.parse({"url": info.url, "base_version": info.base_version})

        async def update(ctl: Controller):
            if not ctl.ready:
                await ctl.start()
            return await ctl.update(req)

        self._drive(update)

    def _drive(self, step):
        """Run ``step(controller)`` on rank 0 while the other workers follow; every worker raises
        rank 0's failure, so that vLLM ends the weight-update session on all of them alike."""
        group, rank, world = compat.world_cpu_group()

        def updater():
            return updater_for(self.model, self.vllm_config, rank)

        with compat.current_config(self.vllm_config):
            if rank != 0:
                error = follow(updater, group, rank)
                if error is not None:
                    raise RuntimeError(f"engine_ext update failed on rank 0, every rank rolled back: {error}")
                return
            ranks = WorkerGroupRanks(updater, group, world)
            if self._controller is None:
                model = self.model_config.model
                self._controller = Controller(ranks, version=initial_version(model if os.path.isdir(model) else None))
            self._controller.ranks = ranks
            error = None
            try:
                asyncio.run(step(self._controller))
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                raise
            finally:
                ranks.release(error)

    def status(self) -> dict | None:
        """The driver's status (rank 0 only; None elsewhere)."""
        return None if self._controller is None else self._controller.status()

    def shutdown(self) -> None:
        pass
