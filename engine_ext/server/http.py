"""The HTTP answers of ``POST``/``GET /update_weights_delta``, shared by the vLLM and SGLang routes.

Each engine's route module only reads the request and wraps ``(status, body)`` in its
framework's response; the token check (before the body is read), body parsing, error
statuses and bodies are here, once. Both routes need a token unless the operator opened
them explicitly (:class:`engine_ext.server.controller.Auth`). ``get_controller`` is awaited only
after the token check: on SGLang it may run the start-up probe.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from .controller import Auth, Controller, error_answer
from .protocol import UpdateRequest

log = logging.getLogger("engine_ext")

ControllerGetter = Callable[[], Awaitable["Controller | None"]]
_UNAVAILABLE = (503, {"ok": False, "reason": "unavailable",
                      "error": "engine_ext is not initialised on this server (is the plugin loaded?)"})


async def post_answer(auth: Auth, get_controller: ControllerGetter, authorization: str | None,
                      read_body: Callable[[], Awaitable[bytes]]) -> tuple[int, dict]:
    """Status and JSON body of ``POST``: 401 before the body is read, 400 for a bad body, then the update."""
    try:
        auth.check(authorization)
        req = UpdateRequest.parse(await read_body())
        ctl = await get_controller()
        if ctl is None:
            return _UNAVAILABLE
        return 200, await ctl.update(req)
    except Exception as e:  # noqa: BLE001 - every failure is an answer with a status
        status, answer = error_answer(e)
        log.warning("engine_ext: update refused/failed (%s): %s", status, answer["error"])
        return status, answer


async def get_answer(auth: Auth, get_controller: ControllerGetter, authorization: str | None) -> tuple[int, dict]:
    """Status and JSON body of ``GET``: the controller's status, to authorised callers only
    (it shows fingerprints and history); 503 while the controller cannot start."""
    try:
        auth.check(authorization)
        ctl = await get_controller()
    except Exception as e:  # noqa: BLE001
        status, answer = error_answer(e)
        return (503 if status == 500 else status), answer
    return _UNAVAILABLE if ctl is None else (200, await ctl.fresh_status())
