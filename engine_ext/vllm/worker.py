"""Worker-side glue: one :class:`~engine_ext.updater.Updater` per vLLM worker.

The general plugin adds one method, ``engine_ext(op, **kwargs)``, to vLLM's
``WorkerBase`` in every process, so the engine client's ordinary
``collective_rpc("engine_ext", args=(op,), kwargs=...)`` reaches it by name (no
pickled functions, no ``--worker-extension-cls``). Replies are plain dicts and
never raise: a failing rank answers ``{"ok": False, ...}`` so the controller can
roll the other ranks back instead of the engine core seeing an exception.
"""
from __future__ import annotations

import logging
import traceback

import torch

from ..updater import Updater, checkpoint_reader, checkpoint_specs, model_files

log = logging.getLogger("engine_ext")
OPS = ("setup", "apply", "commit", "rollback", "status", "resync")


def cpu_refresh(model: torch.nn.Module):
    """Refresh hook for vLLM's CPU backend: re-pack the layers whose weights changed."""
    from .patches import packed_layers, repack

    def refresh(storages: set[int] | None) -> None:
        for ptr, layer in packed_layers(model).items():
            if storages is None or ptr in storages:
                repack(layer)

    return refresh


def build_updater(model: torch.nn.Module, vllm_config, rank: int = 0) -> Updater:
    """An Updater over ``model`` using its own ``load_weights`` as the loader."""
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    files = model_files(mc.model, getattr(mc, "revision", None))

    def load(name: str, tensor: torch.Tensor) -> None:
        model.load_weights([(name, tensor)])

    if current_platform.is_cpu():
        from .patches import cpu_paths

        refresh, describe = cpu_refresh(model), (lambda: {"platform": "cpu", **cpu_paths(model)})
    else:
        refresh, describe = None, (lambda: {"platform": str(current_platform.device_type)})
    return Updater(model, load, checkpoint_specs(files), checkpoint_reader(files), refresh, rank=rank, describe=describe)


def updater_for(model: torch.nn.Module, vllm_config, rank: int = 0) -> Updater:
    """The one Updater of ``model`` (shared by the worker RPC and the ``delta`` backend)."""
    up = model.__dict__.get("_engine_ext_updater")
    if up is None:
        up = build_updater(model, vllm_config, rank)
        model.__dict__["_engine_ext_updater"] = up  # not a submodule/parameter: plain attribute
    return up


def get_updater(worker) -> Updater:
    return updater_for(worker.model_runner.get_model(), worker.vllm_config, getattr(worker, "rank", 0))


def engine_ext(self, op: str, **kwargs) -> dict:
    """``collective_rpc("engine_ext", args=(op,), kwargs=...)`` entry on every worker."""
    rank = getattr(self, "rank", 0)
    try:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}")
        from vllm.config import set_current_vllm_config

        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            out = getattr(get_updater(self), op)(**kwargs)
        return {"ok": True, "rank": rank, **out}
    except Exception as e:  # noqa: BLE001 - reported to the controller, which rolls every rank back
        log.error("engine_ext: %s failed on rank %s: %s", op, rank, traceback.format_exc())
        return {"ok": False, "rank": rank, "error": f"{type(e).__name__}: {e}", "reason": getattr(e, "reason", "apply")}


def install() -> None:
    """Add the ``engine_ext`` RPC method to vLLM's worker base class (idempotent)."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, "engine_ext", None) is not engine_ext:
        WorkerBase.engine_ext = engine_ext
