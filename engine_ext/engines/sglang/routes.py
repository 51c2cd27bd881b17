"""``POST`` / ``GET /update_weights_delta`` on SGLang's own FastAPI app.

Same body, answers, statuses and ``ENGINE_EXT_SOURCES`` rule as the vLLM endpoint
(all of it is :mod:`engine_ext.server.http` and :mod:`engine_ext.server.controller`). The routes are added to
``sglang.srt.entrypoints.http_server.app`` in the process that serves HTTP, marked
``ADMIN_OPTIONAL`` like SGLang's own weight-update routes (so ``--admin-api-key``
guards them when set); ``ENGINE_EXT_TOKEN`` adds our own bearer check on top.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.responses import JSONResponse

from ...server.controller import Auth
from ...server.http import bounded_body, cold_checkpoint, get_answer, post_answer, wants_audit
from ...server.protocol import ROUTE
from . import compat, engine

log = logging.getLogger("engine_ext")
HTTP_SERVER = "sglang.srt.entrypoints.http_server"


async def _controller():
    """The controller of this process's TokenizerManager, started on first use; None if not installed."""
    tm = compat.http_tokenizer_manager()
    if tm is None or getattr(tm, "_engine_ext", None) is None:
        return None
    return await engine.controller(tm)


def _auth() -> Auth:
    """ENGINE_EXT_TOKEN, plus SGLang's own --api-key / --admin-api-key."""
    return Auth.from_settings(engine_tokens=compat.server_api_keys(compat.http_tokenizer_manager()))


async def post_update(request: Request) -> JSONResponse:
    status, body = await post_answer(_auth(), _controller, request.headers.get("authorization"), bounded_body(request))
    return JSONResponse(body, status)


async def get_update(request: Request) -> JSONResponse:
    status, body = await get_answer(
        _auth(),
        _controller,
        request.headers.get("authorization"),
        wants_audit(request.query_params),
        cold_checkpoint(request.query_params),
    )
    return JSONResponse(body, status)


def attach(app) -> bool:
    """Add the two routes to ``app`` (idempotent); True if they were added now."""
    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return False
    compat.mark_admin_optional(post_update, get_update)
    app.add_api_route(ROUTE, post_update, methods=["POST"], response_class=JSONResponse)
    app.add_api_route(ROUTE, get_update, methods=["GET"], response_class=JSONResponse)
    _start_with_lifespan(app)
    return True


def _start_with_lifespan(app) -> None:
    """Run the start-up probe as soon as the server is up, not at the first update."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            tm = compat.http_tokenizer_manager()
            if tm is not None and getattr(tm, "_engine_ext", None) is not None:
                task = asyncio.ensure_future(engine.controller(tm))
                task.add_done_callback(_log_start)
                tm._engine_ext.start_following(lambda: engine.controller(tm))  # ENGINE_EXT_FOLLOW: pull mode
            yield state

    app.router.lifespan_context = lifespan


def _log_start(task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("engine_ext: start-up probe failed (updates will answer 503 until it succeeds): %r", task.exception())


def attach_if_serving() -> bool:
    """Attach to SGLang's app if this process imported the HTTP server (not in schedulers)."""
    mod = sys.modules.get(HTTP_SERVER)
    return attach(mod.app) if mod is not None and hasattr(mod, "app") else False
