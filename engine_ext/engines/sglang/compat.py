"""Every SGLang name engine_ext relies on beyond its documented HTTP API, in one place.

The adapter modules call SGLang only through the functions here (or through objects
SGLang hands them, whose members are listed in :data:`TOUCHPOINTS`). Checked on
:data:`CHECKED_ON` (tests run against SGLang 0.5.23 on the CPU; tests/test_sglang_compat.py
also finds every touchpoint statically in the installed sources).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..compat import Touchpoint

CHECKED_ON = {"0.5.23": "tests run against SGLang 0.5.23 (CPU) and a static check of its sources"}

_TM = "sglang.srt.managers.tokenizer_manager"
_SCHED = "sglang.srt.managers.scheduler"
# SGLang's own weight updates (TokenizerManager methods): the plugin hooks each, since after one our
# fingerprints are re-read before the next op
OUTSIDE_UPDATE_METHODS = (
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "update_weights_from_ipc",
    "end_weight_update",
)
# Declarations, alike in shape across both engines' compat modules on purpose (the `duplicates` tool pairs
# them): each engine lists its own names, checked against its own sources by engines.compat.check.
TOUCHPOINTS = (
    Touchpoint("sglang.srt.plugins.hook_registry", "HookRegistry.register", (), "our hooks (AFTER)"),
    Touchpoint("sglang.srt.plugins.hook_registry", "HookType", (), ""),
    Touchpoint(_SCHED, "Scheduler.init_request_dispatcher", (), "hook target: add our request handler"),
    Touchpoint(_SCHED, "Scheduler._request_dispatcher", (), "private: the scheduler's request dispatcher"),
    Touchpoint(_SCHED, "Scheduler.flush_cache", ("empty_cache",), "radix/KV cache reset after an update"),
    Touchpoint(_SCHED, "Scheduler.record_weight_version_change", ("new_version",), "weight version on the rank"),
    Touchpoint(_SCHED, "Scheduler.tp_worker", (), "holds the model runner"),
    Touchpoint(_TM, "TokenizerManager.init_request_dispatcher", (), "hook target: controller and routes"),
    Touchpoint(_TM, "TokenizerManager._dispatch_to_scheduler", ("obj",), "private: sends our request to rank 0"),
    Touchpoint(_TM, "TokenizerManager._result_dispatcher", (), "private: routes our reply"),
    Touchpoint(
        _TM, "TokenizerManager._update_weight_version_if_provided", ("weight_version",), "private: version label"
    ),
    Touchpoint(_TM, "TokenizerManager.auto_create_handle_loop", (), ""),
    Touchpoint(_TM, "TokenizerManager.model_update_lock", (), "pause mode wait: its writer lock"),
    Touchpoint(_TM, "TokenizerManager.is_pause", (), ""),
    Touchpoint(_TM, "TokenizerManager.pause_generation", ("obj",), ""),
    Touchpoint(_TM, "TokenizerManager.continue_generation", ("obj",), ""),
    *(
        Touchpoint(_TM, f"TokenizerManager.{m}", (), "hook target: mark an outside update")
        for m in OUTSIDE_UPDATE_METHODS
    ),
    Touchpoint("sglang.srt.managers.communicator", "FanOutCommunicator", (), "awaits our reply like SGLang's own"),
    Touchpoint("sglang.srt.managers.io_struct", "wrap_as_pickle", ("obj",), "envelope for our messages"),
    Touchpoint("sglang.srt.managers.io_struct", "PauseGenerationReqInput", (), ""),
    Touchpoint("sglang.srt.managers.io_struct", "ContinueGenerationReqInput", (), ""),
    Touchpoint("sglang.utils", "TypeBasedDispatcher", (), ""),
    Touchpoint("sglang.srt.runtime_context", "get_parallel", (), "TP group and rank"),
    Touchpoint("sglang.srt.runtime_context", "get_model", (), "model path and revision"),
    Touchpoint(
        "sglang.srt.model_loader.loader",
        "DefaultModelLoader.postprocess_weights",
        ("model", "target_device"),
        "every loader's post-processing step: wrapped by the post-processing census (census.py)",
    ),
    Touchpoint(
        "sglang.srt.entrypoints.http_server", "get_global_state", (), "the TokenizerManager of the HTTP process"
    ),
    Touchpoint("sglang.srt.entrypoints.http_server", "app", (), "our routes are added to it"),
    Touchpoint("sglang.srt.utils.auth", "auth_level", (), "ADMIN_OPTIONAL on our routes"),
    # ServerArgs is assembled from field groups at import time; the keys are declared here:
    Touchpoint(
        "sglang.srt.arg_groups.fields.serving", "Serving.api_key", (), "server_args.api_key opens our routes too"
    ),
    Touchpoint(
        "sglang.srt.arg_groups.fields.serving", "Serving.admin_api_key", (), "so does server_args.admin_api_key"
    ),
)


def default_model_loader_class():
    """SGLang's ``DefaultModelLoader``, whose static ``postprocess_weights`` every loader runs after loading."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    return DefaultModelLoader


def register_after_hook(target: str, fn) -> None:
    """Run ``fn(result, self, *args, **kwargs)`` after SGLang's ``target`` (a dotted method path)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, fn, HookType.AFTER)


# --------------------------------------------------------------------------- scheduler side


@dataclass(frozen=True)
class SchedulerModel:
    """What a rank agent is built from: a Scheduler's model and its place in tensor parallelism."""

    model: Any  # the served torch module
    model_path: str  # the checkpoint it loaded
    revision: str | None
    tp_rank: int
    tp_cpu_group: Any  # the TP group's CPU (gloo) process group


def scheduler_model(scheduler) -> SchedulerModel:
    """The :class:`SchedulerModel` of a Scheduler."""
    from sglang.srt.runtime_context import get_model, get_parallel  # SGLang: only in its own processes

    tp = get_parallel().tp_group
    return SchedulerModel(
        model=scheduler.tp_worker.model_runner.model,
        model_path=get_model().model_path,
        revision=getattr(get_model(), "revision", None),
        tp_rank=tp.rank_in_group,
        tp_cpu_group=tp.cpu_group,
    )


def flush_cache(scheduler) -> bool:
    return bool(scheduler.flush_cache(empty_cache=False))


def record_weight_version(scheduler, version: str) -> None:
    scheduler.record_weight_version_change(new_version=version)


def add_request_handler(scheduler, message_type, handler) -> None:
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher([(message_type, handler)])


def wrap_as_pickle(obj):
    from sglang.srt.managers.io_struct import wrap_as_pickle as wrap

    return wrap(obj)


# --------------------------------------------------------------------------- tokenizer side


def reply_channel(tm, reply_type):
    """A FanOutCommunicator that sends a request to scheduler rank 0 and awaits one ``reply_type``."""
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.utils import TypeBasedDispatcher

    comm = FanOutCommunicator(lambda obj: tm._dispatch_to_scheduler(wrap_as_pickle(obj)), 1)
    tm._result_dispatcher += TypeBasedDispatcher([(reply_type, comm.handle_recv)])
    return comm


def topology():
    """(dp_size, pp_size) of the running server."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return getattr(p, "dp_size", 1), getattr(p, "pp_size", 1)


async def pause(tm, mode: str) -> None:
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    await tm.pause_generation(PauseGenerationReqInput(mode=mode))


async def resume(tm) -> None:
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput

    await tm.continue_generation(ContinueGenerationReqInput())


def set_weight_version(tm, version: str) -> None:
    tm._update_weight_version_if_provided(version)


def http_tokenizer_manager():
    """The TokenizerManager of this process's HTTP server (None before it is set up)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    state = get_global_state()
    return None if state is None else state.tokenizer_manager


def server_api_keys(tm) -> tuple[str, ...]:
    """The server's own ``--api-key`` and ``--admin-api-key`` (either opens our routes)."""
    sa = getattr(tm, "server_args", None)
    return tuple(k for k in (getattr(sa, "api_key", None), getattr(sa, "admin_api_key", None)) if k)


def mark_admin_optional(*routes) -> None:
    """Give our routes SGLang's ADMIN_OPTIONAL auth level (``--admin-api-key`` guards them when set)."""
    try:
        from sglang.srt.utils.auth import AuthLevel, auth_level
    except ImportError:  # older SGLang without per-route auth levels
        return
    for fn in routes:
        auth_level(AuthLevel.ADMIN_OPTIONAL)(fn)
