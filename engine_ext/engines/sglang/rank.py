"""Scheduler side: one :class:`~engine_ext.server.rank.RankUpdater` per SGLang TP rank.

Every TP rank of an SGLang server is one scheduler process holding its shard of the
model (``scheduler.tp_worker.model_runner.model``). A :class:`RankOpReq` reaches
every rank's scheduler at the same point of its request stream (rank 0 receives it
and broadcasts it with the rest of the batch), so each rank runs the op on its own
shard, then the ranks exchange their replies over the TP group's CPU (gloo) group
and rank 0 answers with all of them. A failing rank never raises: it answers
``{"ok": False, ...}`` so that the controller can roll every rank back.

The loader the layout probe watches is the model's own ``load_weights``: SGLang
packs ``q/k/v`` into ``qkv_proj`` and ``gate/up`` into ``gate_up_proj``, splits
column-parallel weights on dim 0 and row-parallel ones on dim 1, pads and shards
the vocabulary, and ties ``lm_head`` to the embedding; the probe learns all of it
from the loader, with no per-model table.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

import torch

from ...errors import UnsupportedError
from ...server.protocol import RankReply
from ...server.rank import RankUpdater, run_op
from ...store.checkpoint import served_checkpoint
from . import compat
from .messages import RankOpReply, RankOpReq

log = logging.getLogger("engine_ext")


def derived_weight_error(model: torch.nn.Module) -> str | None:
    """Why in-place writes would not reach the computation, or None.

    SGLang's CPU engine re-packs linear weights for AMX after loading
    (``use_intel_amx_backend``), and some GPU kernels keep derived copies that
    SGLang itself declares (``_derived_weight_cache_error``, mHC splits). Writing
    the checkpoint-layout parameter would then change nothing that is served.
    """
    for name, mod in model.named_modules():
        if getattr(mod, "use_intel_amx_backend", False):
            return f"{name}: weights are re-packed for Intel AMX (SGLang CPU engine); in-place deltas are not supported there"
        reason = getattr(mod, "_derived_weight_cache_error", None)
        if reason:
            return f"{name}: {reason}"
        for attr in ("_hc_attn_tf32_parts", "_hc_ffn_tf32_parts", "_hc_attn_bf16_parts", "_hc_ffn_bf16_parts"):
            if getattr(mod, attr, None) is not None:
                return f"{name}: derived mHC weight splits are active (SGLANG_OPT_DEEPGEMM_HC_PRENORM=0 disables them)"
    return None


def build_updater(
    model: torch.nn.Module, model_path: str, *, revision: str | None = None, rank: int = 0
) -> RankUpdater:
    """A RankUpdater over ``model`` whose loader is the model's own ``load_weights``."""
    error = derived_weight_error(model)
    if error:
        raise UnsupportedError(error)
    ckpt = served_checkpoint(model_path, revision)

    def load(name: str, tensor: torch.Tensor) -> None:
        model.load_weights([(name, tensor)])

    def find_unreproducible(maps: dict) -> dict[str, str]:
        from ...server.census import unreproducible

        return unreproducible(model, maps)  # the adapter refreshes no derived copy: it claims none

    return RankUpdater(
        model, load, ckpt.specs(), ckpt.load, refresh=None, rank=rank, find_unreproducible=find_unreproducible
    )


AFTER_UPDATE = "after_update"  # scheduler op beside the updater's: cache flush and weight version


class RankAgent:
    """The handler of :class:`RankOpReq` on one TP rank.

    ``group``: the TP group's CPU process group (``None`` for TP 1). ``flush_cache``
    and ``set_version`` are the scheduler's own (radix cache reset, weight version).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_path: str,
        *,
        rank: int = 0,
        group=None,
        revision: str | None = None,
        flush_cache: Callable[[], bool] | None = None,
        set_version: Callable[[str], None] | None = None,
    ):
        self.model, self.model_path, self.revision = model, model_path, revision
        self.rank, self.group = rank, group
        self.flush_cache, self.set_version = flush_cache, set_version
        self._updater: RankUpdater | None = None

    @property
    def updater(self) -> RankUpdater:
        if self._updater is None:
            self._updater = build_updater(self.model, self.model_path, revision=self.revision, rank=self.rank)
        return self._updater

    def run(self, op: str, kwargs: dict | None = None) -> dict:
        """This rank's reply to ``op`` as wire data (never raises): an updater op, or ``after_update``."""
        if op == AFTER_UPDATE:
            try:
                return self._after_update(**(kwargs or {})).to_wire()
            except Exception as e:  # noqa: BLE001 - reported, like every op
                log.error("engine_ext: %s failed on TP rank %s: %s", op, self.rank, traceback.format_exc())
                return RankReply.failure(self.rank, e).to_wire()
        return run_op(lambda: self.updater, op, kwargs, rank=self.rank)

    def _after_update(self, version: int) -> RankReply:
        """Drop the radix/KV cache built with the old weights and record the new version."""
        if self.flush_cache is not None and not self.flush_cache():
            # Logged, not answered: the update is committed by then (SGLangRanks.after_update)
            raise RuntimeError(f"SGLang refused to flush the cache after v{version} (requests still running)")
        if self.set_version is not None:
            self.set_version(str(version))
        return RankReply(True, self.rank, version=version)

    def handle(self, req: RankOpReq) -> RankOpReply:
        """Run ``req`` here, then gather every TP rank's reply (a collective: all ranks call it)."""
        mine = self.run(req.op, req.kwargs)
        if self.group is None or torch.distributed.get_world_size(self.group) == 1:
            return RankOpReply([mine])
        replies: list = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(replies, mine, group=self.group)
        return RankOpReply(replies)


# --------------------------------------------------------------------------- scheduler glue


def agent_for_scheduler(scheduler) -> RankAgent:
    """The scheduler's RankAgent, built on first use from its own model and groups."""
    agent = scheduler.__dict__.get("_engine_ext_agent")
    if agent is None:
        found = compat.scheduler_model(scheduler)
        agent = RankAgent(
            found.model,
            found.model_path,
            rank=found.tp_rank,
            group=found.tp_cpu_group,
            revision=found.revision,
            flush_cache=lambda: compat.flush_cache(scheduler),
            set_version=lambda v: compat.record_weight_version(scheduler, v),
        )
        scheduler.__dict__["_engine_ext_agent"] = agent
    return agent


def handle_in_scheduler(scheduler, req: RankOpReq):
    """Dispatcher entry on every TP rank; rank 0's return value goes back to the tokenizer."""
    return compat.wrap_as_pickle(agent_for_scheduler(scheduler).handle(req))


def add_to_dispatcher(scheduler) -> None:
    """Teach a Scheduler's request dispatcher the engine_ext message (after its own init)."""
    compat.add_request_handler(scheduler, RankOpReq, lambda req: handle_in_scheduler(scheduler, req))
