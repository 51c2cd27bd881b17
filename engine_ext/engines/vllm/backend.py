"""The ``engine_ext`` weight-transfer backend (alias ``delta``): vLLM's own update API drives the
update transaction.

With ``weight_transfer_config={"backend": "engine_ext"}`` (``--weight-transfer-config
'{"backend": "engine_ext"}'``), ``LLM.update_weights({"update_info": {"url": ...}})`` runs the
same :class:`~engine_ext.server.transaction.UpdateTransaction` as ``POST /update_weights_delta``:
signed manifests from allowed sources, chains and anchors from the served version, every rank
fetching its own part, verified and rolled back together. ``init_weight_transfer_engine``
may narrow the sources and keys (:mod:`engine_ext.server.transfer_api`); a refusal raises on
every worker with its reason and status in the message (:class:`~engine_ext.errors.UpdateRefused`).

vLLM calls the backend in every worker at once; worker rank 0 drives the transaction
(:class:`WorkerGroupRanks`) and every other worker follows its ops (:func:`follow`)
over the workers' CPU process group until rank 0 says it is done. Offline this is the only
door; online the API server's endpoint takes over vLLM's routes and drives its own
controller, and a backend reached anyway (a direct RPC) finds the committed state on the
ranks (:meth:`~engine_ext.server.controller.Controller.sync`).
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

from ...errors import DeltaError, UpdateRefused
from ...server.controller import Controller, Policy, initial_version
from ...server.protocol import RankReply, UpdateRequest
from ...server.rank import run_op
from ...server.transfer_api import narrow, update_request
from . import compat
from .worker import updater_for

_DONE, _OP = "done", "op"


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    sources: list[str] | None = None  # narrow ENGINE_EXT_SOURCES to these (each under an allowed one)
    trusted_keys: list[str] | None = None  # narrow ENGINE_EXT_TRUSTED_KEYS to these (PEM text or key ids)


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    url: str  # manifest URI or path, or a store root (its LATEST); must be under the allowed sources
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

    _controller: Controller | None = None  # rank 0 only
    _policy: Policy | None = None  # rank 0: what init_weight_transfer_engine narrowed the sources and keys to

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        """Narrow the sources and trusted keys (refused, nothing changed, if it would widen them), then
        every rank probes its layout and fingerprints its weights (once)."""
        wanted = {
            k: v for k, v in (("sources", init_info.sources), ("trusted_keys", init_info.trusted_keys)) if v is not None
        }

        async def init(ctl: Controller):
            policy = narrow(wanted, Policy(ctl.sources, ctl.trust))
            if not ctl.ready:
                await ctl.start()
            self._policy = policy

        self._drive(init)

    def start_weight_update(self) -> None:
        pass  # nothing to prepare: the update is applied in place, in one transaction

    def finish_weight_update(self) -> None:
        pass  # the weight version label reaches the ranks from LLM.finish_weight_update (plugin.py)

    def parse_update_info(self, update_dict: dict) -> DeltaUpdateInfo:
        try:
            req = update_request(update_dict)
        except DeltaError as e:
            raise UpdateRefused.of(e) from None
        return DeltaUpdateInfo(req.url, req.base_version)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronises an accelerator, which fails on CPU-only hosts;
        # the transaction is synchronous already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: DeltaUpdateInfo) -> None:
        """One update transaction to ``info.url``; raises (on every rank) when it did not commit."""
        req = UpdateRequest(info.url, info.base_version, wait=True)

        async def update(ctl: Controller):
            if not ctl.ready:
                await ctl.start()
            return await ctl.update(req, self._policy)

        self._drive(update)

    def _drive(self, step):
        """Run ``step(controller)`` on rank 0 while the other workers follow; every worker raises
        rank 0's failure as an :class:`UpdateRefused` (reason and status in its message), so that
        vLLM ends the weight-update session on all of them alike."""
        group, rank, world = compat.world_cpu_group()

        def updater():
            return updater_for(self.model, self.vllm_config, rank)

        with compat.current_config(self.vllm_config):
            if rank != 0:
                error = follow(updater, group, rank)
                if error is not None:
                    raise UpdateRefused.find(error) or UpdateRefused("internal", 500, error)
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
                refused = UpdateRefused.of(e)
                error = str(refused)
                raise refused from e
            finally:
                ranks.release(error)

    def status(self) -> dict | None:
        """The driver's status (rank 0 only; None elsewhere)."""
        return None if self._controller is None else self._controller.status()

    def shutdown(self) -> None:
        pass
