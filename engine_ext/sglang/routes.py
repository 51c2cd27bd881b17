"""``POST`` / ``GET /update_weights_delta`` on SGLang's own FastAPI app.

Same body, answers, statuses and ``ENGINE_EXT_SOURCES`` rule as the vLLM endpoint
(all of it is :mod:`engine_ext.service`). The routes are added to
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

from ..service import ROUTE, check_token, error_answer, parse_request
from . import engine

log = logging.getLogger("engine_ext")
HTTP_SERVER = "sglang.srt.entrypoints.http_server"


def _tokenizer_manager(request: Request):
    from sglang.srt.entrypoints.http_server import get_global_state

    state = get_global_state()
    return None if state is None else state.tokenizer_manager


def _unavailable(why: str) -> JSONResponse:
    return JSONResponse({"ok": False, "reason": "unavailable", "error": why}, 503)


async def post_update(request: Request) -> JSONResponse:
    try:
        check_token(request.headers.get("authorization"))
        req = parse_request(await request.body())
    except Exception as e:  # noqa: BLE001 - every failure is an answer with a status
        status, body = error_answer(e)
        return JSONResponse(body, status)
    tm = _tokenizer_manager(request)
    if tm is None or getattr(tm, "_engine_ext", None) is None:
        return _unavailable("engine_ext is not initialised on this server (plugin not loaded in the scheduler/tokenizer?)")
    try:
        ctl = await engine.controller(tm)
        return JSONResponse(await ctl.update(req))
    except Exception as e:  # noqa: BLE001
        status, body = error_answer(e)
        log.warning("engine_ext: update refused/failed (%s): %s", status, body["error"])
        return JSONResponse(body, status)


async def get_update(request: Request) -> JSONResponse:
    try:
        check_token(request.headers.get("authorization"))
    except Exception as e:  # noqa: BLE001
        status, body = error_answer(e)
        return JSONResponse(body, status)
    tm = _tokenizer_manager(request)
    if tm is None or getattr(tm, "_engine_ext", None) is None:
        return _unavailable("engine_ext is not initialised on this server")
    try:
        return JSONResponse((await engine.controller(tm)).status())
    except Exception as e:  # noqa: BLE001 - the start-up probe failed: say why
        status, body = error_answer(e)
        return JSONResponse(body, 503 if status == 500 else status)


def attach(app) -> bool:
    """Add the two routes to ``app`` (idempotent); True if they were added now."""
    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return False
    try:
        from sglang.srt.utils.auth import AuthLevel, auth_level

        for fn in (post_update, get_update):
            auth_level(AuthLevel.ADMIN_OPTIONAL)(fn)
    except ImportError:  # older SGLang without per-route auth levels
        pass
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
            tm = _tokenizer_manager(None)
            if tm is not None and getattr(tm, "_engine_ext", None) is not None:
                task = asyncio.ensure_future(engine.controller(tm))
                task.add_done_callback(_log_start)
            yield state

    app.router.lifespan_context = lifespan


def _log_start(task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("engine_ext: start-up probe failed (updates will answer 503 until it succeeds): %r", task.exception())


def attach_if_serving() -> bool:
    """Attach to SGLang's app if this process imported the HTTP server (not in schedulers)."""
    mod = sys.modules.get(HTTP_SERVER)
    return attach(mod.app) if mod is not None and hasattr(mod, "app") else False
