"""``sglang.srt.plugins`` entry point ``engine_ext``: the whole SGLang set-up.

SGLang 0.5.23 calls every general plugin (filtered by ``SGLANG_PLUGINS``) through
``sglang.srt.plugins.load_plugins()`` in the launcher, in an in-process
``sglang.Engine`` and in every scheduler process (they are spawned, so each one
registers for itself), then applies the registered hooks. This registers:

- after ``Scheduler.init_request_dispatcher`` (every TP rank): the handler of
  :class:`~engine_ext.engines.sglang.messages.RankOpReq` (:mod:`engine_ext.engines.sglang.rank`);
- after ``TokenizerManager.init_request_dispatcher`` (the serving process): the
  reply route and the controller (:mod:`engine_ext.engines.sglang.engine`), and the HTTP
  routes on SGLang's FastAPI app when this process serves HTTP
  (:mod:`engine_ext.engines.sglang.routes`);
- after the TokenizerManager's own weight-update methods (from disk, tensor,
  distributed, IPC, ``end_weight_update``): a mark that makes the next delta op
  re-read the live fingerprints first (version unknown, fingerprint known), so a
  full sync through SGLang's API can be followed by deltas.

No patch to SGLang's files is needed; everything goes through its hook registry.
"""

from __future__ import annotations

import logging

from .compat import OUTSIDE_UPDATE_METHODS  # names only: it imports nothing of SGLang

log = logging.getLogger("engine_ext")

SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher"
TOKENIZER_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_request_dispatcher"
# SGLang's own weight updates: after one, our fingerprints are re-read before the next op.
OUTSIDE_UPDATE_TARGETS = tuple(
    f"sglang.srt.managers.tokenizer_manager.TokenizerManager.{m}" for m in OUTSIDE_UPDATE_METHODS
)
_registered = False


def _after_scheduler_init(result, scheduler, *args, **kwargs):
    from .rank import add_to_dispatcher

    add_to_dispatcher(scheduler)
    return result


def _after_tokenizer_init(result, tm, *args, **kwargs):
    from . import engine, routes

    engine.install(tm)
    routes.attach_if_serving()
    return result


def _after_outside_update(result, tm, *args, **kwargs):
    import inspect

    from . import engine

    if not inspect.isawaitable(result):
        engine.mark_outside_update(tm)
        return result

    async def done():
        try:
            return await result
        finally:
            engine.mark_outside_update(tm)

    return done()


def register() -> None:
    """Register the hooks (idempotent); SGLang applies them right after all plugins ran."""
    global _registered
    if _registered:
        return
    _registered = True
    from ... import settings
    from .compat import register_after_hook

    settings.current()  # every ENGINE_EXT_* variable read once, here, in every SGLang process
    from .census import wrap_post_processing

    wrap_post_processing()  # what post-processing derives is refused, as SGLang's adapter refreshes nothing

    register_after_hook(SCHEDULER_TARGET, _after_scheduler_init)
    register_after_hook(TOKENIZER_TARGET, _after_tokenizer_init)
    for target in OUTSIDE_UPDATE_TARGETS:
        register_after_hook(target, _after_outside_update)
