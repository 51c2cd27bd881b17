"""``vllm.endpoint_plugins`` entry point: ``POST``/``GET /update_weights_delta``.

Loaded in the API server process only when ``VLLM_PLUGINS`` names ``engine_ext``
(vLLM 0.32 contract: ``vllm/plugins/endpoint_plugins/interface.py``). The routes
drive :class:`engine_ext.service.Controller` through the engine client's public
methods (``collective_rpc``, ``pause_generation``, ``reset_prefix_cache``,
``update_weight_version``, ``resume_generation``); the worker-side method they
call is installed by the general plugin.
"""
from __future__ import annotations

import logging
import os
from argparse import Namespace

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ..service import ROUTE, Controller, Sources, check_token, error_answer, initial_version, parse_request

log = logging.getLogger("engine_ext")


class VllmEngine:
    """:class:`engine_ext.service.Engine` over vLLM's ``EngineClient``."""

    def __init__(self, client):
        self.client = client

    async def call_ranks(self, op: str, **kwargs) -> list[dict]:
        return list(await self.client.collective_rpc("engine_ext", args=(op,), kwargs=kwargs))

    async def pause(self, mode: str) -> None:
        # The caches are reset after the apply instead (clear_cache would drop the
        # KV of requests frozen by mode "keep").
        await self.client.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def after_update(self, version: int) -> None:
        if not await self.client.reset_prefix_cache():
            log.warning("engine_ext: prefix cache reset refused by the engine after v%s", version)
        await self.client.update_weight_version(str(version))


def controller(request: Request) -> Controller | None:
    return getattr(request.app.state, "engine_ext", None)


def _unavailable() -> JSONResponse:
    return JSONResponse({"ok": False, "reason": "unavailable", "error": "engine_ext is not initialised on this server"}, 503)


async def post_update(request: Request) -> JSONResponse:
    ctl = controller(request)
    if ctl is None:
        return _unavailable()
    try:
        check_token(request.headers.get("authorization"))
        req = parse_request(await request.body())
        return JSONResponse(await ctl.update(req))
    except Exception as e:  # noqa: BLE001 - every failure is an answer with a status
        status, body = error_answer(e)
        log.warning("engine_ext: update refused/failed (%s): %s", status, body["error"])
        return JSONResponse(body, status)


async def get_update(request: Request) -> JSONResponse:
    ctl = controller(request)
    if ctl is None:
        return _unavailable()
    try:
        check_token(request.headers.get("authorization"))
    except Exception as e:  # noqa: BLE001
        status, body = error_answer(e)
        return JSONResponse(body, status)
    return JSONResponse(ctl.status())


class EndpointPlugin:
    """Factory object per the vLLM endpoint-plugin protocol."""

    name = "engine_ext"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route(ROUTE, post_update, methods=["POST"])
        router.add_api_route(ROUTE, get_update, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        if engine_client is None:
            return
        model_dir = getattr(args, "model", None)
        ctl = Controller(VllmEngine(engine_client), Sources.from_env(),
                         version=initial_version(model_dir if model_dir and os.path.isdir(model_dir) else None))
        state.engine_ext = ctl
        try:
            await ctl.start()
        except Exception:  # noqa: BLE001 - keep serving; the route answers with the reason
            log.exception("engine_ext: start-up probe failed; /update_weights_delta will refuse updates")
