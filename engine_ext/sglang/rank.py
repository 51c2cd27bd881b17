"""Scheduler side: one :class:`~engine_ext.updater.Updater` per SGLang TP rank.

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
from typing import Callable

import torch

from ..updater import Updater, checkpoint_reader, checkpoint_specs, model_files
from .messages import RankOpReply, RankOpReq

log = logging.getLogger("engine_ext")

UPDATER_OPS = ("setup", "apply", "commit", "rollback", "status", "resync")
OPS = UPDATER_OPS + ("after_update",)


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


def build_updater(model: torch.nn.Module, model_path: str, *, revision: str | None = None, rank: int = 0) -> Updater:
    """An Updater over ``model`` whose loader is the model's own ``load_weights``."""
    error = derived_weight_error(model)
    if error:
        raise RuntimeError(error)
    files = model_files(model_path, revision)

    def load(name: str, tensor: torch.Tensor) -> None:
        model.load_weights([(name, tensor)])

    return Updater(model, load, checkpoint_specs(files), checkpoint_reader(files), refresh=None, rank=rank)


class RankAgent:
    """The handler of :class:`RankOpReq` on one TP rank.

    ``group``: the TP group's CPU process group (``None`` for TP 1). ``flush_cache``
    and ``set_version`` are the scheduler's own (radix cache reset, weight version).
    """

    def __init__(self, model: torch.nn.Module, model_path: str, *, rank: int = 0, group=None,
                 revision: str | None = None, flush_cache: Callable[[], bool] | None = None,
                 set_version: Callable[[str], None] | None = None):
        self.model, self.model_path, self.revision = model, model_path, revision
        self.rank, self.group = rank, group
        self.flush_cache, self.set_version = flush_cache, set_version
        self._updater: Updater | None = None

    @property
    def updater(self) -> Updater:
        if self._updater is None:
            self._updater = build_updater(self.model, self.model_path, revision=self.revision, rank=self.rank)
        return self._updater

    def run(self, op: str, kwargs: dict | None = None) -> dict:
        """This rank's reply to ``op`` (never raises)."""
        kwargs = kwargs or {}
        try:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; one of {OPS}")
            with torch.no_grad():
                out = self._after_update(**kwargs) if op == "after_update" else getattr(self.updater, op)(**kwargs)
            return {"ok": True, "rank": self.rank, **out}
        except Exception as e:  # noqa: BLE001 - reported to the controller, which rolls every rank back
            log.error("engine_ext: %s failed on TP rank %s: %s", op, self.rank, traceback.format_exc())
            return {"ok": False, "rank": self.rank, "error": f"{type(e).__name__}: {e}", "reason": getattr(e, "reason", "apply")}

    def _after_update(self, version: int) -> dict:
        """Drop the radix/KV cache built with the old weights and record the new version."""
        flushed = None
        if self.flush_cache is not None:
            flushed = bool(self.flush_cache())
            if not flushed:
                log.warning("engine_ext: SGLang refused to flush the cache after v%s (requests still running)", version)
        if self.set_version is not None:
            self.set_version(str(version))
        return {"flushed": flushed}

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
        from sglang.srt.runtime_context import get_model, get_parallel

        runner = scheduler.tp_worker.model_runner
        tp = get_parallel().tp_group
        agent = RankAgent(
            runner.model, get_model().model_path, rank=tp.rank_in_group, group=tp.cpu_group,
            revision=getattr(get_model(), "revision", None),
            flush_cache=lambda: scheduler.flush_cache(empty_cache=False),
            set_version=lambda v: scheduler.record_weight_version_change(new_version=v))
        scheduler.__dict__["_engine_ext_agent"] = agent
    return agent


def handle_in_scheduler(scheduler, req: RankOpReq):
    """Dispatcher entry on every TP rank; rank 0's return value goes back to the tokenizer."""
    from sglang.srt.managers.io_struct import wrap_as_pickle

    return wrap_as_pickle(agent_for_scheduler(scheduler).handle(req))


def add_to_dispatcher(scheduler) -> None:
    """Teach a Scheduler's request dispatcher the engine_ext message (after its own init)."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher([(RankOpReq, lambda req: handle_in_scheduler(scheduler, req))])
