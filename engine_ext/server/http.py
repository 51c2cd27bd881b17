"""The HTTP answers of ``POST``/``GET /update_weights_delta``, shared by the vLLM and SGLang routes.

Each engine's route module only reads the request and wraps ``(status, body)`` in its
framework's response; the token check (before the body is read), body parsing, error
statuses and bodies are here, once. Both routes need a token unless the operator opened
them explicitly (:class:`engine_ext.server.controller.Auth`). ``get_controller`` is awaited only
after the token check: on SGLang it may run the start-up probe.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from .controller import Auth, Controller, error_answer
from .protocol import MAX_BODY_BYTES, RequestError, UpdateRequest

log = logging.getLogger("engine_ext")

ControllerGetter = Callable[[], Awaitable["Controller | None"]]
_UNAVAILABLE = (
    503,
    {
        "ok": False,
        "reason": "unavailable",
        "error": "engine_ext is not initialised on this server (is the plugin loaded?)",
    },
)


async def post_answer(
    auth: Auth, get_controller: ControllerGetter, authorization: str | None, read_body: Callable[[], Awaitable[bytes]]
) -> tuple[int, dict]:
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


def bounded_body(request) -> Callable[[], Awaitable[bytes]]:
    """``read_body`` for a Starlette request (vLLM's and SGLang's FastAPI apps): read chunk by chunk
    and refused (400) once past ``MAX_BODY_BYTES``, so a long body is never held whole
    (``request.body()`` reads all of it before anything can look at its size)."""

    async def read() -> bytes:
        out = bytearray()
        async for chunk in request.stream():
            out += chunk
            if len(out) > MAX_BODY_BYTES:
                raise RequestError(f"body is over {MAX_BODY_BYTES} bytes")
        return bytes(out)

    return read


async def get_answer(
    auth: Auth,
    get_controller: ControllerGetter,
    authorization: str | None,
    audit: bool = False,
    cold: str | None = None,
) -> tuple[int, dict]:
    """Status and JSON body of ``GET``: the controller's status, to authorised callers only
    (it shows fingerprints and history); 503 while the controller cannot start. With ``audit``
    (``?audit=1``) also ``audit``: the live weights re-read and checked against the served state
    (reads the whole model on every rank; waits for an update in progress); with ``cold``
    (``&cold=DIR``) also ``cold_audit``: the served model against a cold load of DIR
    (:meth:`~engine_ext.server.controller.Controller.cold_audit`)."""
    try:
        auth.check(authorization)
        ctl = await get_controller()
        if ctl is None:
            return _UNAVAILABLE
        body = await ctl.fresh_status()
        if audit:
            body["audit"] = await ctl.audit()
            if cold:
                body["cold_audit"] = await ctl.cold_audit(cold)
        return 200, body
    except Exception as e:  # noqa: BLE001
        status, answer = error_answer(e)
        return (503 if status == 500 else status), answer


def wants_audit(query: Mapping[str, str]) -> bool:
    """``?audit=1`` (or ``true``) on ``GET``."""
    return str(query.get("audit", "")).lower() in ("1", "true", "yes")


def cold_checkpoint(query: Mapping[str, str]) -> str | None:
    """``&cold=DIR`` on ``GET ...?audit=1``: the checkpoint directory the cold-load audit builds from."""
    return query.get("cold") or None
